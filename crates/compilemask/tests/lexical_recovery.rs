//! One fault, one diagnostic: a character the language does not use, inserted anywhere
//! outside a string or comment of a valid program (every built-in mask and the programs
//! below), makes `compile` report exactly that `CM0101`, at that byte, and nothing else;
//! faults in two statements give one diagnostic each.

use cm_syntax::lexer::{lex, Tok};
use cm_testkit::config::fuzz_config;
use compilemask::{compile, BUILTINS};
use proptest::prelude::*;

/// Valid programs besides the built-ins: every statement form.
const PROGRAMS: &[&str] = &[
    "param w: int = 4;\nparam g: [int] = [0, 9];\nlet lo = max(q - w, 0);\n\
     mask = lo <= k <= q | any i in 0 .. count(g): k == g[i];\n",
    "segments doc = [4, 4] fill kv_len;\npart doc.head = 0 .. 2;\n\
     mask = doc.index(k) == doc.index(q) & k <= q | k in doc.head(q);\n",
    "grid img = [4, 4];\nmask = if q in img then l2(img) < 2 else k <= q;\n",
    "require q_len > 0 else \"need rows, got {q_len}\";\nmask = elementwise(k * k <= q);\n",
];

/// Characters no token starts with: ASCII, typeset lookalikes, control and astral.
const BAD: &[char] = &[
    '$', '@', '?', '~', '`', '\\', '\'', '–', '≤', '×', '\u{7}', '🦀',
];

/// Every byte offset of `src` outside its strings and comments where a character can go: at
/// each token's start and end and inside every token but a string.
fn insertion_points(src: &str) -> Vec<usize> {
    let (toks, diags) = lex(src);
    assert!(diags.is_empty(), "{src}: {diags:?}");
    let mut at = Vec::new();
    for t in toks.iter().filter(|t| t.tok != Tok::Eof) {
        let (start, end) = (t.span.start as usize, t.span.end as usize);
        if matches!(t.tok, Tok::Str(_)) {
            at.extend([start, end]);
        } else {
            at.extend((start..=end).filter(|&i| src.is_char_boundary(i)));
        }
    }
    at.sort_unstable();
    at.dedup();
    at
}

fn sources() -> Vec<&'static str> {
    BUILTINS
        .iter()
        .map(|b| b.source)
        .chain(PROGRAMS.iter().copied())
        .collect()
}

/// The diagnostics `compile` reports for `src`, as (code, start byte) pairs.
fn reported(src: &str) -> Vec<(&'static str, usize)> {
    match compile(src) {
        Ok(_) => Vec::new(),
        Err(e) => e
            .diagnostics
            .iter()
            .map(|d| (d.code.as_str(), d.span.start as usize))
            .collect(),
    }
}

#[test]
fn every_program_compiles_as_it_is() {
    for src in sources() {
        assert!(compile(src).is_ok(), "{src}");
    }
}

proptest! {
    #![proptest_config(fuzz_config(256))]

    #[test]
    fn one_bad_character_is_one_diagnostic(
        which in any::<prop::sample::Index>(),
        point in any::<prop::sample::Index>(),
        bad in prop::sample::select(BAD),
    ) {
        let srcs = sources();
        let base = srcs[which.index(srcs.len())];
        let points = insertion_points(base);
        let at = points[point.index(points.len())];
        let src = format!("{}{bad}{}", &base[..at], &base[at..]);
        prop_assert_eq!(reported(&src), vec![("CM0101", at)], "{}", src);
    }

    /// A run of bad characters is one fault too.
    #[test]
    fn a_run_of_bad_characters_is_one_diagnostic(
        which in any::<prop::sample::Index>(),
        point in any::<prop::sample::Index>(),
        run in prop::collection::vec(prop::sample::select(BAD), 2..5),
    ) {
        let srcs = sources();
        let base = srcs[which.index(srcs.len())];
        let points = insertion_points(base);
        let at = points[point.index(points.len())];
        let run: String = run.into_iter().collect();
        let src = format!("{}{run}{}", &base[..at], &base[at..]);
        prop_assert_eq!(reported(&src), vec![("CM0101", at)], "{}", src);
    }
}

/// Two statements with a fault each: a bad character and a syntax error, in either order,
/// report one diagnostic each, so recovery hides nothing beyond the statement.
#[test]
fn faults_in_two_statements_are_two_diagnostics() {
    let cases: &[(&str, &[(&str, usize)])] = &[
        (
            "let a = k <= $q;\nmask = k <= ;\n",
            &[("CM0101", 13), ("CM0104", 29)],
        ),
        (
            "mask = k <= ;\nlet a = k $ q;\n",
            &[("CM0104", 12), ("CM0101", 24)],
        ),
        (
            "let a = q – 4;\nmask = k <= a @ 1;\n",
            &[("CM0101", 10), ("CM0101", 31)],
        ),
        // An unterminated string swallows the statement's `;`: one diagnostic, not a
        // cascade into the next line.
        (
            "require q_len > 0 else \"short;\nmask = k <= q;\n",
            &[("CM0102", 23)],
        ),
        // A malformed literal is a lexical error too.
        ("mask = k <= 12abc q;\n", &[("CM0103", 12)]),
    ];
    for (src, want) in cases {
        assert_eq!(reported(src), *want, "{src}");
    }
}

/// Reading stops after 1000 errors with one `CM0107` where it stopped, for syntax errors (a
/// file of stray `;`) and lexical ones (stray characters between spaces), whatever follows.
#[test]
fn reading_stops_after_a_thousand_errors() {
    let semis = format!("mask = k <= q;\n{}", ";\n".repeat(5000));
    let spaced = format!("mask = k <= q;\n{}", "@ ".repeat(5000));
    for (src, stop_at) in [
        (&semis, "mask = k <= q;\n".len() + 2 * 1000),
        (&spaced, "mask = k <= q;\n".len() + 2 * 1000),
    ] {
        let diags = compile(src).unwrap_err().diagnostics;
        assert_eq!(diags.len(), 1001, "{}", &src[..20]);
        let stop = diags.last().unwrap();
        assert_eq!(stop.code.as_str(), "CM0107");
        assert_eq!(stop.span.start as usize, stop_at);
        assert!(diags[..1000].iter().all(|d| d.code.as_str() != "CM0107"));
    }
    // Lexical and syntax errors together: one stop, the first, and nothing past it.
    for n in [990, 999, 1000, 1001] {
        let src = format!("mask = k <= q;\n{}{}", ";\n".repeat(30), "@ ;\n".repeat(n));
        let diags = compile(&src).unwrap_err().diagnostics;
        let stops: Vec<_> = diags
            .iter()
            .filter(|d| d.code.as_str() == "CM0107")
            .collect();
        assert!(diags.len() <= 1001, "{n}: {}", diags.len());
        assert_eq!(stops.len(), usize::from(n + 30 >= 1000), "{n}");
        if let Some(stop) = stops.first() {
            assert!(diags.iter().all(|d| d.span.start <= stop.span.start), "{n}");
        }
    }
    // 999 errors are all reported, with no stop.
    let src = format!("mask = k <= q;\n{}", ";".repeat(999));
    let diags = compile(&src).unwrap_err().diagnostics;
    assert_eq!(diags.len(), 999);
    assert!(diags.iter().all(|d| d.code.as_str() == "CM0106"));
}

/// Every line break ariadne draws (`\n`, `\r\n`, a lone `\r`, VT, FF, NEL, LS, PS) gives the
/// same `line:column` in the rendered header as in its `at FILE:LINE:COL` note, and ends a
/// `#` comment: a file with `\r` line endings was one line for the note and, after a
/// comment, for the lexer.
#[test]
fn line_breaks_agree_with_the_rendered_excerpt() {
    for br in [
        "\n", "\r\n", "\r", "\u{0B}", "\u{0C}", "\u{85}", "\u{2028}", "\u{2029}",
    ] {
        let src = format!("# a comment{br}param w: int = 4;{br}mask = q - w < k <= qq;{br}");
        let e = compile(&src).unwrap_err();
        assert_eq!(e.diagnostics.len(), 1, "{br:?}: {:?}", e.diagnostics);
        assert_eq!(e.diagnostics[0].code.as_str(), "CM0201", "{br:?}");
        let text = compilemask::render(&src, "m.cmask", &e.diagnostics);
        assert!(text.contains("m.cmask:3:21"), "{br:?}: {text}");
        assert!(text.contains("at m.cmask:3:21"), "{br:?}: {text}");
        assert_eq!(
            compilemask::line_col(&src, e.diagnostics[0].span.start),
            (3, 21)
        );
    }
}

/// Control characters in a source are drawn as `?` in the excerpt, never written raw (an
/// escape sequence would reach the terminal), and the positions stay those of the source.
#[test]
fn control_characters_are_not_written_raw() {
    for ctl in ["\u{1b}", "\u{7}", "\u{7f}", "\u{9b}"] {
        let src = format!("mask = k <= q;\n{ctl}[31mred\n");
        let e = compile(&src).unwrap_err();
        let text = compilemask::render(&src, "a.cmask", &e.diagnostics);
        assert!(!text.contains(ctl), "{ctl:?}: {text}");
        assert!(text.contains("a.cmask:2:1"), "{ctl:?}: {text}");
        assert!(
            text.contains(&format!("{}[31mred", "?".repeat(ctl.len()))),
            "{text}"
        );
    }
}

/// A name is at most `MAX_NAME_BYTES` long: one byte more is one `CM0108` naming its length,
/// wherever the name stands, and no message quotes a long name whole (a megabyte name made
/// megabyte messages).
#[test]
fn a_name_past_the_limit_is_one_short_diagnostic() {
    use cm_syntax::lexer::MAX_NAME_BYTES;
    let name = |n: usize| "w".repeat(n);
    let ok = name(MAX_NAME_BYTES);
    compile(&format!("param {ok}: int = 1;\nmask = k <= q + {ok} - 1;")).unwrap();
    for n in [MAX_NAME_BYTES + 1, 1 << 20] {
        let long = name(n);
        for src in [
            format!("{long} = 3;\nmask = k <= q;"),
            format!("mask = k <= q + {long};"),
            format!("param {long}: int = 1;\nmask = k <= q;"),
        ] {
            let e = compile(&src).unwrap_err();
            let diags = e.diagnostics;
            assert_eq!(diags.len(), 1, "{n}: {diags:?}");
            assert!(
                e.rendered.len() < 4096,
                "{n}: {} bytes rendered",
                e.rendered.len()
            );
            assert_eq!(diags[0].code.as_str(), "CM0108");
            assert!(diags[0].message.contains(&format!("{n} bytes")));
            assert!(diags[0].message.len() < 100, "{}", diags[0].message);
        }
    }
}

/// No message quotes a megabyte of the source: a malformed literal or a run of unexpected
/// characters is shown by its first characters and its length (a megabyte literal glued to
/// letters was quoted whole).
#[test]
fn long_literals_and_runs_are_quoted_short() {
    let mb = 1 << 20;
    for (bad, code) in [
        (format!("1{}", "a".repeat(mb)), "CM0103"),
        (format!("0x{}", "f".repeat(mb)), "CM0103"),
        (format!("1.5{}", "e".repeat(mb)), "CM0103"),
        (format!("1e{}", "9".repeat(mb)), "CM0103"),
        (format!("0.{}1", "0".repeat(mb)), "CM0103"),
        ("$".repeat(mb), "CM0101"),
        ("\u{7}".repeat(mb), "CM0101"),
    ] {
        let e = compile(&format!("mask = k <= q + {bad};")).unwrap_err();
        let d = &e.diagnostics;
        assert_eq!(d.len(), 1, "{code}: {d:?}");
        assert_eq!(d[0].code.as_str(), code);
        assert!(d[0].message.len() < 400, "{}", d[0].message);
        assert!(
            e.rendered.len() < 4096,
            "{code}: {} bytes rendered",
            e.rendered.len()
        );
    }
}
