//! Fuzzing the facade's edges on the stable toolchain: whatever the source, compiling it
//! and rendering its diagnostics (ariadne) never panics, and a program that compiles plans
//! or fails with a rendered `CM` error. The parser, checker and planner are fuzzed in their
//! own crates (`cm-syntax`, `cm-ir`, `cm-plan` tests/fuzz.rs).
//!
//! Case counts: `CM_FUZZ_CASES` (default: a quick CI run).

use cm_testkit::config::fuzz_config;
use cm_testkit::source::{lossy_bytes, splice, token_soup};
use compilemask::{compile, PlanOptions, Value};
use proptest::prelude::*;

const TOKENS: &[&str] = &[
    "param",
    "let",
    "segments",
    "part",
    "grid",
    "require",
    "mask",
    "if",
    "then",
    "else",
    "in",
    "q",
    "k",
    "len",
    "l2",
    "box",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ";",
    ":",
    "=",
    "<",
    "<=",
    "+",
    "-",
    "/",
    "%",
    "&",
    "|",
    "!",
    ".",
    "..",
    "\"m {q}\"",
    "\"",
    "0",
    "7",
    "é",
    "\n",
    "\t",
    "\r\n",
    "\u{0}",
    "🦀",
    "\u{301}",
    "#",
];

/// The `FILE:LINE:COL` of every report's `╭─[ ... ]` header and of its `Note: at ...` line.
fn locations(rendered: &str) -> (Vec<&str>, Vec<&str>) {
    let headers = rendered
        .lines()
        .filter_map(|l| {
            l.split_once("╭─[ ")
                .and_then(|(_, r)| r.rsplit_once(" ]"))
                .map(|(at, _)| at)
        })
        .collect();
    let notes = rendered
        .lines()
        .filter_map(|l| l.split_once("Note: at ").map(|(_, at)| at.trim_end()))
        .collect();
    (headers, notes)
}

/// A diagnostic on a line too long to draw whole (cut to a window around it) names its true
/// column in the header, as in the note and the diagnostic itself.
#[test]
fn the_header_of_a_cut_line_gives_the_true_column() {
    for lines_before in [0, 3] {
        for terms in [0, 10, 60, 100] {
            let src = format!(
                "{}mask = k <= q{} + qq;",
                "\n".repeat(lines_before),
                " + 0".repeat(terms)
            );
            let e = compile(&src).unwrap_err();
            let d = &e.diagnostics[0];
            let (line, col) = cm_syntax::line_col(&src, d.span.start);
            assert_eq!(col, 13 + 4 * terms + 4, "{src}");
            let rendered = compilemask::render(&src, "f", &e.diagnostics);
            let at = format!("f:{line}:{col}");
            let (headers, notes) = locations(&rendered);
            assert_eq!(
                (headers, notes),
                (vec![at.as_str()], vec![at.as_str()]),
                "{rendered}"
            );
        }
    }
}

fn source() -> impl Strategy<Value = String> {
    prop_oneof![
        lossy_bytes(300),
        any::<String>(),
        token_soup(TOKENS, 60),
        (
            proptest::sample::select(compilemask::BUILTINS),
            any::<prop::sample::Index>(),
            proptest::sample::select(TOKENS),
        )
            .prop_map(|(b, i, t)| splice(b.source, i, t)),
    ]
}

proptest! {
    #![proptest_config(fuzz_config(1500))]

    #[test]
    fn compile_and_render(src in source(), q_len in 1i64..40, int in any::<i64>()) {
        match compile(&src) {
            Err(e) => {
                prop_assert!(!e.diagnostics.is_empty());
                prop_assert!(!e.rendered.is_empty());
                for d in &e.diagnostics {
                    prop_assert!(d.code.as_str().starts_with("CM"));
                }
                let again = compilemask::render(&src, "fuzz", &e.diagnostics);
                prop_assert!(!again.is_empty());
                let (headers, notes) = locations(&again);
                prop_assert_eq!(headers, notes);
            }
            Ok(program) => {
                let mut opts = PlanOptions::new(q_len).kv_len(q_len + 1).tile(5, 7);
                if let Some((name, is_array, _)) = program.params().first() {
                    let v = if *is_array {
                        Value::Array(vec![int, 1].into())
                    } else {
                        Value::Int(int)
                    };
                    opts = opts.param(name, v);
                }
                if let Err(e) = program.plan(&opts) {
                    prop_assert!(e.code.as_str().starts_with("CM"));
                    prop_assert!(!program.render_error(&e).is_empty());
                }
            }
        }
    }
}

/// A message interpolation after an escape yields a diagnostic span inside `é` (see
/// `bug_interpolation_spans_after_escapes` in cm-syntax), and rendering it panics in
/// ariadne: `compile` itself panics on this one-line program.
#[test]
fn bug_render_panics_on_a_span_inside_a_character() {
    let src = "require true else \"{\\té}\";\nmask = k <= q;\n";
    let r = std::panic::catch_unwind(|| compile(src).map(|_| ()));
    assert!(matches!(r, Ok(Err(_))), "compile panicked");
    render_clamps_spans();
}

/// Diagnostics whose spans point past the end or inside a character still render.
fn render_clamps_spans() {
    let src = "mask = é < 1;\n🦀";
    for (start, end) in [
        (0, 0),
        (8, 9),
        (9, 8),
        (1000, 2000),
        (u32::MAX, u32::MAX),
        (16, 17),
    ] {
        let d = compilemask::Diagnostic::error(
            compilemask::Code::UnexpectedCharacter,
            compilemask::Span { start, end },
            "x",
        );
        assert!(!compilemask::render(src, "t", &[d]).is_empty());
    }
}

/// A message holding the header's own characters is left as written; the box's header line
/// gets the true position.
#[test]
fn a_message_that_looks_like_a_header_is_left_alone() {
    let src = "require 1 == 2 else \"╭─[ boom ]\";\nmask = k <= q;";
    let program = compile(src).unwrap();
    let e = program.plan(&PlanOptions::new(8)).unwrap_err();
    let rendered = program.render_error(&e);
    assert!(rendered.contains("Error: ╭─[ boom ]"), "{rendered}");
    let header = rendered
        .lines()
        .find(|l| l.starts_with(' ') && l.trim_start().starts_with("╭─["))
        .unwrap();
    let (line, col) = cm_syntax::line_col(src, e.span.unwrap().start);
    assert!(header.ends_with(&format!(":{line}:{col} ]")), "{rendered}");
}
