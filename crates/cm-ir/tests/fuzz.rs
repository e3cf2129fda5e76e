//! Fuzzing the checker (and binding) on the stable toolchain, with proptest as the engine:
//! arbitrary bytes, token soups and soups of half-valid statements through
//! `cm_ir::compile` must never panic; every diagnostic has a `CM` code and a span inside the
//! source on character boundaries; a program that compiles binds without panicking.
//! Hostile nesting gives a diagnostic, never a stack overflow.
//!
//! Case counts: `CM_FUZZ_CASES` (default: a quick CI run), e.g.
//! `CM_FUZZ_CASES=50000 cargo test -p cm-ir --test fuzz`.

use cm_ir::Value;
use cm_syntax::Diagnostic;
use cm_testkit::config::fuzz_config;
use cm_testkit::source::{
    binary_chain, comparison_chain, disjunction_chain, lossy_bytes, postfix_chains,
};
use cm_testkit::{check_diags, shape, tokens};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::LazyLock;

/// Compiles `src`; when it compiles, binds it at a few small shapes with default
/// parameters. Nothing may panic; every error is a `CM` code.
fn compile_checked(src: &str) {
    let (program, diags) = cm_stdlib::compile(src);
    check_diags(src, &diags);
    match &program {
        Some(_) => assert!(!diags.iter().any(Diagnostic::is_error), "{diags:?}"),
        None => assert!(diags.iter().any(Diagnostic::is_error), "no error\n{src}"),
    }
    let Some(program) = program else { return };
    for (q_len, kv_len) in [(1, 1), (5, 3), (0, 1), (1, -1)] {
        let shape = shape(q_len, kv_len, 1, 2);
        match program.bind(shape, &BTreeMap::new()) {
            Ok(bound) => {
                // A few pairs of the reference semantics (errors are fine, panics not).
                for q in 0..q_len.min(3) {
                    if let Err(e) = bound.brute_force_row(q, 0, 1) {
                        assert!(e.code.as_str().starts_with("CM03"), "{e}");
                    }
                }
            }
            Err(e) => {
                assert!(e.code.as_str().starts_with("CM"), "{e}");
                if q_len < 1 || kv_len < 1 {
                    assert_eq!(e.code, "CM0402");
                }
            }
        }
    }
}

/// The language's words and symbols, a few names that programs declare, and literals.
static TOKENS: LazyLock<Vec<&str>> = LazyLock::new(|| {
    tokens::concat(&[
        tokens::KEYWORDS,
        tokens::NAMES,
        tokens::FIELDS,
        &["a", "s", "g", "p"],
        tokens::SYMBOLS,
        tokens::DOTS,
        LITERALS,
    ])
});

/// Strings, numbers and a character outside ASCII.
const LITERALS: &[&str] = &[
    "\"m {q_len}\"",
    "0",
    "1",
    "2",
    "7",
    "4096",
    "9223372036854775807",
    "é",
];

fn token_soup() -> impl Strategy<Value = String> {
    cm_testkit::source::token_soup(TOKENS.as_slice(), 60)
}

/// A small expression over a fixed pool of names, often ill-typed or out of context.
fn expr() -> impl Strategy<Value = String> {
    let leaf = proptest::sample::select(vec![
        "q",
        "k",
        "b",
        "h",
        "len",
        "q_len",
        "kv_len",
        "batch",
        "num_heads",
        "0",
        "1",
        "3",
        "-2",
        "9223372036854775807",
        "a",
        "s",
        "g",
        "g3",
        "n",
        "arr",
        "true",
        "false",
        "s(q)",
        "s(k)",
        "s.index(q)",
        "s.hd(q)",
        "s.nope",
        "c.p(q)",
        "c.r(q)",
        "c.z(q)",
        "s[0]",
        "s[q]",
        "arr[0]",
        "arr[k]",
        "g.x(q)",
        "g.y(k)",
        "g.t(q)",
        "g3.t(q)",
        "l2(g)",
        "l1(g3)",
        "linf(s)",
        "box(g, 0..1, 0..2)",
        "box(g3, 0..1, 0..1, 0..1)",
        "box(g, 0..1)",
        "elementwise(k < q)",
        "elementwise(l2(g) < 1)",
        "trace_context",
        "count(arr)",
        "sum(trace_generated)",
        "isqrt(q)",
        "min(q)",
        "max(q, k)",
        "abs(k)",
        "[1, 2]",
        "[]",
        "q .. k",
        "0 ..= q",
        "s(q).start",
        "s(q).len",
        "(q).x",
    ])
    .prop_map(str::to_string);
    leaf.prop_recursive(3, 12, 3, |inner| {
        let op = proptest::sample::select(vec![
            "+", "-", "*", "/", "%", "<", "<=", ">", ">=", "==", "!=", "&", "|", "and", "or", "in",
            "..", "..=",
        ]);
        prop_oneof![
            (inner.clone(), op, inner.clone()).prop_map(|(a, o, b)| format!("{a} {o} {b}")),
            inner.clone().prop_map(|a| format!("({a})")),
            inner.clone().prop_map(|a| format!("!{a}")),
            inner.clone().prop_map(|a| format!("-{a}")),
            (inner.clone(), inner.clone(), inner.clone())
                .prop_map(|(c, a, b)| format!("if {c} then {a} else {b}")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("min({a}, {b})")),
            inner.clone().prop_map(|a| format!("elementwise({a})")),
            inner.clone().prop_map(|a| format!("s({a})")),
            inner.clone().prop_map(|a| format!("arr[{a}]")),
            inner.prop_map(|a| format!("{a}.start")),
        ]
    })
}

/// A statement, often wrong (unknown names, wrong types, duplicates, bad contexts).
fn statement() -> impl Strategy<Value = String> {
    let name = proptest::sample::select(vec![
        "a", "s", "g", "g3", "n", "arr", "c", "q", "min", "grid", "if", "len", "mask",
    ]);
    prop_oneof![
        (name.clone(), expr()).prop_map(|(n, e)| format!("param {n}: int = {e};")),
        (name.clone(), expr()).prop_map(|(n, e)| format!("param {n}: [int] = {e};")),
        (name.clone(), expr()).prop_map(|(n, e)| format!("param {n} = {e};")),
        name.clone().prop_map(|n| format!("param {n}: int;")),
        name.clone().prop_map(|n| format!("param {n};")),
        (name.clone(), expr()).prop_map(|(n, e)| format!("let {n} = {e};")),
        (name.clone(), expr()).prop_map(|(n, e)| format!("segments {n} = {e};")),
        (name.clone(), expr(), expr())
            .prop_map(|(n, e, f)| format!("segments {n} = {e} fill {f};")),
        (expr(), expr()).prop_map(|(e, f)| format!("segments c = {{ p: {e}, r: {f} * 2 }};")),
        (name.clone(), expr()).prop_map(|(n, e)| format!("part s.{n} = {e};")),
        (expr(), expr()).prop_map(|(e, f)| format!("grid g = [{e}, {f}] at 1;")),
        (expr(), expr()).prop_map(|(e, f)| format!("grid g3 = [{e}, {f}, 2];")),
        expr().prop_map(|e| format!("grid g = [{e}];")),
        (expr(), expr()).prop_map(|(c, m)| format!("require {c} else \"bad {{{m}}}\";")),
        expr().prop_map(|e| format!("mask = {e};")),
        Just("segments s = [3, 0, 2];".to_string()),
        Just("part s.hd = 0 .. len / 2;".to_string()),
        Just("param arr: [int] = [1, 2, 3];".to_string()),
        Just("grid g = [3, 4] at 2;".to_string()),
        Just("grid g3 = [2, 2, 2];".to_string()),
        Just("param n: int = 4;".to_string()),
    ]
}

proptest! {
    #![proptest_config(fuzz_config(3000))]

    #[test]
    fn arbitrary_bytes(src in lossy_bytes(600)) {
        compile_checked(&src);
    }

    #[test]
    fn arbitrary_text(src in any::<String>()) {
        compile_checked(&src);
    }

    #[test]
    fn token_soups(src in token_soup()) {
        compile_checked(&src);
    }

    #[test]
    fn statement_soups(stmts in proptest::collection::vec(statement(), 0..10)) {
        compile_checked(&stmts.join("\n"));
    }
}

/// Explicit nesting through the checker: a diagnostic, never a stack overflow.
#[test]
fn deep_nesting_gives_a_diagnostic() {
    let n = 10_000;
    let nest = |open: &str, atom: &str, close: &str| {
        format!("mask = {}{atom}{};", open.repeat(n), close.repeat(n))
    };
    for src in [
        nest("(", "k < q", ")"),
        nest("-", "k < q", ""),
        nest("not ", "k < q", ""),
        nest("!", "(k < q)", ""),
        nest("[", "1", "]"),
        nest("if q < 1 then ", "true", " else false"),
        nest("elementwise(", "k < q", ")"),
        nest("min(1, ", "q", ")"),
    ] {
        let (p, diags) = cm_stdlib::compile(&src);
        check_diags(&src, &diags);
        assert!(p.is_none());
        assert!(diags.iter().any(|d| d.code == "CM0105"), "{diags:?}");
    }
    for src in [
        "(".repeat(100_000),
        "[".repeat(100_000),
        "mask = ".to_string() + &"{".repeat(100_000),
    ] {
        let (p, diags) = cm_stdlib::compile(&src);
        check_diags(&src, &diags);
        assert!(p.is_none());
    }
    // `let` chains: 2,000 links compose (each adds two levels); past MAX_INLINED_DEPTH one
    // error names the first `let` too deep, however long the chain goes on.
    let chain = |n: usize| {
        let mut src = String::from("let a0 = q;\n");
        for i in 1..=n {
            src.push_str(&format!("let a{i} = a{} + 1;\n", i - 1));
        }
        src + &format!("mask = k < a{n};\n")
    };
    let src = chain(2000);
    let (p, diags) = cm_stdlib::compile(&src);
    check_diags(&src, &diags);
    assert!(p.is_some(), "{diags:?}");
    let src = chain(20_000);
    let (p, diags) = cm_stdlib::compile(&src);
    check_diags(&src, &diags);
    assert!(p.is_none());
    let errors: Vec<_> = diags.iter().filter(|d| d.is_error()).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].code, "CM0105");
    let first = (cm_ir::check::MAX_INLINED_DEPTH / 2) as usize;
    let at = src.find(&format!("let a{first} =")).unwrap() + 4;
    assert_eq!(errors[0].span.start as usize, at, "{}", errors[0].message);
}

/// `n`-term flat chains: not nested in the source, but as deep as `n` in the tree.
fn operator_chains(n: usize) -> Vec<String> {
    vec![
        binary_chain(n, "1", " + "),
        binary_chain(n, "q", " - "),
        disjunction_chain(n, "<"),
        comparison_chain(n),
    ]
}

#[test]
fn long_chains_compile() {
    for src in operator_chains(100).into_iter().chain(postfix_chains(100)) {
        let (_, diags) = cm_stdlib::compile(&src);
        check_diags(&src, &diags);
    }
    // Past the limit: CM0105, not a stack overflow.
    for src in operator_chains(1_000)
        .into_iter()
        .chain(operator_chains(100_000))
    {
        let (p, diags) = cm_stdlib::compile(&src);
        check_diags(&src, &diags);
        assert!(p.is_none());
        assert!(diags.iter().any(|d| d.code == "CM0105"), "{diags:?}");
    }
}

/// Postfix chains do not count toward the nesting limit, and the checker recurses on them.
#[test]
fn bug_long_postfix_chains_overflow_the_stack() {
    for src in postfix_chains(1_000) {
        let (p, diags) = cm_stdlib::compile(&src);
        check_diags(&src, &diags);
        assert!(p.is_none());
    }
}

/// Fixed: each `let` used twice by the next doubled the inlined tree (21 lines took seconds
/// and ~800 MB, 30 exhausted memory). Now each `let`'s inlined size is counted at the `let`
/// (200000 nodes at most, well under the 2^22 and 2^41 of these chains), with one error at
/// the first link past it (`a16`: 2^18 - 3 nodes) and none for the links that use it.
#[test]
fn let_doubling_is_not_exponential() {
    for n in [21, 40] {
        let mut src = String::from("let a0 = q;\n");
        for i in 1..=n {
            src.push_str(&format!("let a{i} = a{} + a{};\n", i - 1, i - 1));
        }
        src.push_str(&format!("mask = k < a{n};\n"));
        let (p, diags) = cm_stdlib::compile(&src);
        check_diags(&src, &diags);
        assert!(p.is_none(), "{n} links checked");
        assert_eq!(diags.len(), 1, "{diags:?}");
        assert_eq!(diags[0].code.as_str(), "CM0105", "{diags:?}");
        assert!(
            diags[0].message.starts_with("`a16` is too large"),
            "{diags:?}"
        );
    }
}

/// Parameter values of every kind at bind time: wrong types, unknown names, extremes.
#[test]
fn bind_with_hostile_values() {
    let src = "param n: int = 4;\nparam lens: [int] = [3, 0, 2];\nsegments s = lens;\n\
               grid g = [n, n] at n;\nrequire n > -5 else \"n = {n}\";\n\
               mask = k in s(q) | l2(g) < n;";
    let (p, diags) = cm_stdlib::compile(src);
    let p = p.unwrap_or_else(|| panic!("{diags:?}"));
    let ints = [0, 1, -1, -4, 7, i64::MAX, i64::MIN, 1 << 40];
    let arrays: [&[i64]; 6] = [&[], &[0], &[0, 0], &[-1], &[i64::MAX, 1], &[1 << 30]];
    for (q_len, kv_len) in [(1, 1), (3, 9), (64, 64), (1 << 26, 1)] {
        let shape = shape(q_len, kv_len, 1, 1);
        for &n in &ints {
            for &lens in &arrays {
                let mut v = BTreeMap::new();
                v.insert("n".to_string(), Value::Int(n));
                v.insert("lens".to_string(), Value::Array(lens.into()));
                if let Err(e) = p.bind(shape, &v) {
                    assert!(e.code.as_str().starts_with("CM0"), "{e}");
                }
            }
        }
        // A list for an integer (one-element lists and integers for arrays are accepted).
        let mut v = BTreeMap::new();
        v.insert("n".to_string(), Value::Array(vec![1, 2].into()));
        assert_eq!(p.bind(shape, &v).unwrap_err().code, "CM0308");
        let mut v = BTreeMap::new();
        v.insert("n".to_string(), Value::Array(vec![].into()));
        assert_eq!(p.bind(shape, &v).unwrap_err().code, "CM0308");
        let mut v = BTreeMap::new();
        v.insert("nn".to_string(), Value::Int(1));
        assert_eq!(p.bind(shape, &v).unwrap_err().code, "CM0309");
    }
    for (q_len, kv_len, batch, num_heads) in [
        (0, 1, 1, 1),
        (1, 0, 1, 1),
        (-1, 1, 1, 1),
        (i64::MAX, 1, 1, 1),
        (i64::MIN, 1, 1, 1),
        ((1 << 26) + 1, 1, 1, 1),
        (1, 1, 0, 1),
        (1, 1, 1, 0),
        (1, 1, i64::MAX, 1),
        (1, 1, 1, 1 << 17),
    ] {
        let shape = shape(q_len, kv_len, batch, num_heads);
        assert_eq!(p.bind(shape, &BTreeMap::new()).unwrap_err().code, "CM0402");
    }
}

/// Fixed: a parameter whose default names itself compiled, and binding it panicked.
#[test]
fn self_referential_declarations_do_not_panic() {
    for src in [
        "param a: int = a;\nmask = k < a;",
        "param a = a + 1;\nmask = k < a;",
        "param a: [int] = [a];\nmask = k < 1;",
        "param a: int = a;\nmask = k < 1;",
        "segments s = [s.count];\nmask = k in s(q);",
        "grid g = [2, 2] at g.x(0);\nmask = k in g;",
    ] {
        compile_checked(src);
    }
}

/// Fixed: a declaration that named itself was dropped without a diagnostic (`param a: int
/// = a;` compiled when the mask did not use `a`, and gave only "no mask" when it did).
#[test]
fn self_reference_is_an_error() {
    for src in [
        "param a: int = a;\nmask = k < 1;",
        "param a: int = a;\nmask = k < a;",
        "segments s = [s.count];\nmask = k < 1;",
        "grid g = [2, 2] at g.x(0);\nmask = k < 1;",
    ] {
        let (p, diags) = cm_stdlib::compile(src);
        assert!(p.is_none(), "accepted:\n{src}");
        assert!(
            diags.iter().any(|d| d.is_error() && d.code != "CM0205"),
            "{diags:?}\n{src}"
        );
    }
}
