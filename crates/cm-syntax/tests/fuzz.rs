//! Fuzzing the lexer and parser on the stable toolchain (proptest as the engine): arbitrary
//! bytes (decoded lossily), arbitrary Unicode, and soups of the language's own tokens must
//! parse without panicking, every diagnostic carrying a `CM` code and a span inside the
//! source on character boundaries; hostile nesting must give a diagnostic, never a stack
//! overflow.
//!
//! Case counts: `CM_FUZZ_CASES` (default: a quick CI run), e.g.
//! `CM_FUZZ_CASES=50000 cargo test -p cm-syntax --test fuzz`.

use cm_syntax::{line_col, parse, parse_expr, Diagnostic};
use cm_testkit::config::fuzz_config;
use cm_testkit::source::{
    binary_chain, comparison_chain, disjunction_chain, lossy_bytes, postfix_chains, splice,
};
use cm_testkit::tokens;
use proptest::prelude::*;
use std::sync::LazyLock;

/// Every diagnostic is well-formed against `src` (`cm_testkit::check_diags`), has a message
/// and a line and column.
fn check_diags(src: &str, diags: &[Diagnostic]) {
    cm_testkit::check_diags(src, diags);
    for d in diags {
        assert!(!d.message.is_empty(), "empty message {d:?}");
        for span in std::iter::once(d.span).chain(d.related.iter().map(|r| r.0)) {
            let (line, col) = line_col(src, span.start);
            assert!(line >= 1 && col >= 1);
        }
    }
}

fn parse_checked(src: &str) {
    let (_, diags) = parse(src);
    check_diags(src, &diags);
    let (_, diags) = parse_expr(src);
    check_diags(src, &diags);
}

/// Words and symbols of the language, plus near misses.
static TOKENS: LazyLock<Vec<&str>> = LazyLock::new(|| {
    tokens::concat(&[
        tokens::KEYWORDS,
        &["[int]"],
        tokens::NAMES,
        tokens::FIELDS,
        &["doc", "img"],
        tokens::SYMBOLS,
        &["&&", "|", "||", "!", ".", "..", "..="],
        NEAR_MISSES,
    ])
});

/// Dots, comments, strings, numbers, characters and symbols that are not the language's.
const NEAR_MISSES: &[&str] = &[
    "...",
    "#",
    "# comment\n",
    "\"",
    "\"msg {q_len}\"",
    "\"{\"",
    "\"\\{\"",
    "\"}{\"",
    "\"\\\"",
    "\"a\nb\"",
    "0",
    "1",
    "7",
    "4096",
    "1_000",
    "_1",
    "1_",
    "9223372036854775807",
    "9223372036854775808",
    "99999999999999999999999",
    "12abc",
    "1e5",
    "0x10",
    "é",
    "ß",
    "∑",
    "𝕜",
    "\u{0}",
    "\u{7f}",
    "\u{feff}",
    "\u{200b}",
    "\t",
    "\r\n",
    "\\",
    "@",
    "$",
    "`",
    "'",
    "?",
    "^",
    "~",
];

fn token_soup() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        (
            proptest::sample::select(TOKENS.as_slice()),
            prop_oneof![Just(""), Just(" "), Just("\n"), Just("  ")],
        ),
        0..80,
    )
    .prop_map(|v| v.into_iter().map(|(t, s)| format!("{t}{s}")).collect())
}

proptest! {
    #![proptest_config(fuzz_config(3000))]

    #[test]
    fn arbitrary_bytes(src in lossy_bytes(600)) {
        parse_checked(&src);
    }

    #[test]
    fn arbitrary_unicode(src in "\\PC{0,200}") {
        parse_checked(&src);
    }

    #[test]
    fn arbitrary_text_with_any_char(src in any::<String>()) {
        parse_checked(&src);
    }

    #[test]
    fn token_soups(src in token_soup()) {
        parse_checked(&src);
    }

    /// Valid statements with junk spliced in at a random point.
    #[test]
    fn spliced_statements(
        pos in any::<prop::sample::Index>(),
        junk in token_soup(),
    ) {
        let base = "param w: int = 4;\nsegments doc = [3, 0, 5];\npart doc.head = 0 .. len / 2;\n\
                    grid img = [4, 4] at 2;\nrequire w >= 1 else \"w {w} \\{\";\n\
                    let r = doc(q);\nmask = if q in img then l2(img) < w else k in r.start ..= q;\n";
        let src = splice(base, pos, &junk);
        parse_checked(&src);
    }
}

/// Pieces of `require` messages: interpolations, braces, multi-byte characters. Escapes
/// (`\t`, `\\`, `\"`, `\{`) are left out while `bug_interpolation_spans_after_escapes` is
/// open: after one, the spans of diagnostics inside an interpolation are shifted.
const MESSAGE_PIECES: &[&str] = &[
    "{",
    "}",
    "{q_len}",
    "{1 + }",
    "{)}",
    "{é}",
    "{ 𝕜 }",
    "q",
    "+",
    " ",
    "é",
    "𝕜",
    "1",
    "x",
    "{{",
    "}}",
    "{k}",
    "{\u{301}}",
    "#",
];

proptest! {
    #![proptest_config(fuzz_config(3000))]

    /// Interpolated `require` messages: diagnostics inside `{...}` point into the source.
    #[test]
    fn message_interpolations(
        pieces in proptest::collection::vec(proptest::sample::select(MESSAGE_PIECES), 0..12),
    ) {
        let src = format!("require q_len > 0 else \"{}\";\nmask = k <= q;\n", pieces.concat());
        parse_checked(&src);
    }
}

/// Interpolations are parsed from the *unescaped* message, but their diagnostics are
/// shifted by the byte offset of the `{` only: every escape before the error moves the span,
/// here into the middle of `é` (rendering it with ariadne then panics, see the
/// `compilemask` fuzz tests).
#[test]
fn bug_interpolation_spans_after_escapes() {
    for src in [
        "require true else \"{\\té}\";\nmask = k <= q;\n",
        "require true else \"{\\\"é}\";\nmask = k <= q;\n",
        "require true else \"{\\t\\t1 + é}\";\nmask = k <= q;\n",
    ] {
        parse_checked(src);
    }
}

/// `n` copies of `open`, an atom, `n` copies of `close`.
fn nest(prefix: &str, open: &str, atom: &str, close: &str, n: usize) -> String {
    format!("{prefix}{}{atom}{}", open.repeat(n), close.repeat(n))
}

/// Explicit nesting is refused with `CM0105` once it is deeper than the parser allows.
#[test]
fn deep_nesting_gives_a_diagnostic() {
    let n = 10_000;
    let cases = [
        nest("mask = ", "(", "k < q", ")", n),
        nest("mask = ", "(", "", "", n),
        nest("mask = ", "-", "k < q", "", n),
        nest("mask = k < ", "-", "q", "", n),
        nest("mask = ", "not ", "k < q", "", n),
        nest("mask = ", "!", "(k < q)", "", n),
        nest("mask = ", "[", "1", "]", n),
        nest("mask = ", "[", "", "", n),
        nest("mask = ", "if q < 1 then ", "true", " else false", n),
        nest("mask = ", "if ", "", "", n),
        nest("mask = k < ", "min(", "1", ", 2)", n),
        nest("mask = k < ", "abs(", "", "", n),
        nest("mask = k < a", "[", "0", "]", n),
        nest("mask = k in ", "(", "q .. q + 1", ")", n),
        nest("let x = ", "(", "1", ")", n),
        nest("param p: int = ", "-(", "1", ")", n),
        nest("require ", "not ", "true", "", n) + " else \"m\";",
        format!("require true else \"{}\";", "{(".repeat(n)),
        format!(
            "require true else \"{{{}1{}}}\";",
            "(".repeat(n),
            ")".repeat(n)
        ),
        "(".repeat(100_000),
        "-".repeat(100_000),
        "not ".repeat(100_000),
        "{".repeat(100_000),
    ];
    for src in &cases {
        let (_, diags) = parse(src);
        check_diags(src, &diags);
        assert!(
            diags.iter().any(|d| d.is_error()),
            "no error for {}...",
            &src[..60.min(src.len())]
        );
        if diags.iter().any(|d| d.code == "CM0105") {
            continue;
        }
        // Forms that are not nested expressions fail some other way; still an error.
        assert!(
            diags.iter().all(|d| d.code.as_str().starts_with("CM01")),
            "{diags:?}"
        );
    }
    for src in [
        nest("", "(", "1", ")", n),
        nest("", "-", "1", "", n),
        nest("", "!", "1", "", n),
    ] {
        let (_, diags) = parse_expr(&src);
        check_diags(&src, &diags);
        assert!(diags.iter().any(|d| d.code == "CM0105"), "{diags:?}");
    }
}

/// Long flat chains of binary operators (`1 + 1 + ... + 1`, `a | b | ...`, `a < b < ...`)
/// are not nested in the source but build equally deep trees.
fn operator_chains(n: usize) -> Vec<String> {
    vec![
        binary_chain(n, "1", " + "),
        binary_chain(n, "q", " * "),
        disjunction_chain(n, "<"),
        comparison_chain(n),
        format!("mask = k in 0 .. 1{};", " .. 1".repeat(n)),
    ]
}

#[test]
fn long_chains_parse() {
    for src in operator_chains(2_000)
        .into_iter()
        .chain(postfix_chains(2_000))
    {
        let (_, diags) = parse(&src);
        check_diags(&src, &diags);
    }
}

/// Operator chains longer than the nesting limit are refused (and the tree stays shallow).
#[test]
fn very_long_operator_chains_give_a_diagnostic() {
    for src in operator_chains(100_000) {
        let (_, diags) = parse(&src);
        check_diags(&src, &diags);
        assert!(diags.iter().any(|d| d.is_error()), "{}", &src[..40]);
    }
}

#[test]
fn bug_very_long_postfix_chains_overflow_the_stack() {
    for src in postfix_chains(100_000) {
        let (_, diags) = parse(&src);
        check_diags(&src, &diags);
        assert!(diags.iter().any(|d| d.code == "CM0105"), "{diags:?}");
    }
}

#[test]
fn empty_and_trivial_inputs() {
    for src in [
        "",
        " ",
        "\n",
        ";",
        ";;;;",
        "#",
        "mask",
        "mask =",
        "mask = ;",
        "\"",
        "{",
        "}",
        "..=",
        "\u{feff}mask = k <= q;",
    ] {
        parse_checked(src);
    }
}

/// `-9223372036854775808` is `i64::MIN` wherever a unary minus stands before it; the bare
/// magnitude (2^63) is no integer, and one past it is no integer even negated.
#[test]
fn the_smallest_integer_is_written_with_its_minus_sign() {
    use cm_syntax::ast::ExprKind;
    let (e, diags) = parse_expr("-9223372036854775808");
    assert!(diags.is_empty(), "{diags:?}");
    assert!(matches!(e.kind, ExprKind::Int(i64::MIN)), "{:?}", e.kind);
    let (e, diags) = parse_expr("-9223372036854775807");
    assert!(diags.is_empty(), "{diags:?}");
    assert!(
        !matches!(e.kind, ExprKind::Int(_)),
        "a unary minus over the literal"
    );
    for src in [
        "9223372036854775808",
        "q - 9223372036854775808",
        "-9223372036854775809",
        "-(9223372036854775808)",
    ] {
        let (_, diags) = parse_expr(src);
        assert_eq!(diags.len(), 1, "{src}: {diags:?}");
        assert_eq!(diags[0].code.as_str(), "CM0103", "{src}");
        parse_checked(src);
    }
}

/// One fault gives one diagnostic: a missing `)`, `]` or `,` (before another token or at
/// the end of the source) is reported once, not again as a missing `;` at the same token.
#[test]
fn a_missing_closer_is_reported_once() {
    for src in [
        "mask = (k <= q",
        "mask = (k <= q k;",
        "mask = min(k, q",
        "mask = min(k q);",
        "mask = k <= [1, 2",
        "mask = k <= [1, 2 3][0];",
        "param a: [int] = [1, 2",
        "let a = (1 + 2 3;\nmask = k <= q;",
    ] {
        let (_, diags) = parse(src);
        check_diags(src, &diags);
        assert_eq!(
            diags.len(),
            1,
            "{src:?} gave {} diagnostics: {:#?}",
            diags.len(),
            diags.iter().map(|d| &d.message).collect::<Vec<_>>()
        );
        assert_eq!(diags[0].code.to_string(), "CM0104", "{src:?}");
    }
}

/// One fault gives one diagnostic: a token that cannot start an expression, wherever an
/// expression is due (an operand, a call's argument, an array item, inside parentheses, a
/// condition, a range's end), is reported once, not again by each rule around it as a
/// missing `)`, `]`, `then` or `;`.
#[test]
fn a_token_that_cannot_start_an_expression_is_reported_once() {
    let contexts = [
        "mask = k <= @;",
        "mask = k <= q + @;",
        "mask = max(1, @) <= k;",
        "mask = k <= min(@, q);",
        "mask = k <= [1, @][0];",
        "mask = k <= (q + (@));",
        "mask = if @ then k <= q else k < q;",
        "mask = if q > 1 then k <= @ else k < q;",
        "mask = any i in 0 .. @: k == i;",
        "let a = (1 + @;\nmask = k <= q;",
        "param w: int = @;\nmask = k <= q;",
    ];
    let bad = [
        "\"hi\"", ")", "]", "else", ",", ":", "then", "*", "==", "=", "in",
    ];
    for context in contexts {
        for token in bad {
            let src = context.replace('@', token);
            let (_, diags) = parse(&src);
            check_diags(&src, &diags);
            assert_eq!(
                diags.len(),
                1,
                "{src:?} gave {} diagnostics: {:#?}",
                diags.len(),
                diags.iter().map(|d| &d.message).collect::<Vec<_>>()
            );
            // `max(1, ))` closes the call after a trailing comma: its one fault is the
            // second `)`.
            assert_eq!(
                diags[0].code.to_string(),
                "CM0104",
                "{src:?}: {}",
                diags[0].message
            );
        }
    }
}
