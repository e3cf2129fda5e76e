//! Fuzzing the score part: soups of `tensor`, `score` and `sink` statements over float and
//! integer pieces, often ill-formed, through `cm_ir::compile`, binding and the pairwise
//! score never panic; every diagnostic has a `CM` code and a span inside the source; deep
//! `let` chains read by a score give a result, not a stack overflow.

use cm_syntax::Diagnostic;
use cm_testkit::check_diags;
use cm_testkit::config::fuzz_config;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn compile_checked(src: &str) {
    let (program, diags) = cm_stdlib::compile(src);
    check_diags(src, &diags);
    match &program {
        Some(_) => assert!(!diags.iter().any(Diagnostic::is_error), "{diags:?}"),
        None => assert!(diags.iter().any(Diagnostic::is_error), "no error\n{src}"),
    }
    let Some(program) = program else { return };
    let table: Vec<f64> = (0..64).map(f64::from).collect();
    let tensors = [("t", &table[..]), ("u", &table[..]), ("s", &table[..])];
    for (q_len, kv_len, heads) in [(1, 1, 1), (5, 3, 3), (9, 9, 4)] {
        let shape = cm_ir::Shape {
            q_len,
            kv_len,
            batch: 1,
            num_heads: heads,
        };
        match program.bind(shape, &BTreeMap::new()) {
            Ok(bound) => {
                for (q, k) in [(0, 0), (q_len - 1, 0), (0, kv_len - 1)] {
                    if let Err(e) = bound.score_at(q, k, 0, heads - 1, 0.5, &tensors) {
                        assert!(e.code.as_str().starts_with("CM03"), "{e}");
                    }
                    if let Err(e) = bound.sink_at(heads - 1, &tensors) {
                        assert!(e.code.as_str().starts_with("CM03"), "{e}");
                    }
                }
            }
            Err(e) => assert!(e.code.as_str().starts_with("CM"), "{e}"),
        }
    }
}

fn expr() -> impl Strategy<Value = String> {
    let leaf = proptest::sample::select(vec![
        "score",
        "q",
        "k",
        "h",
        "b",
        "q_len",
        "kv_len",
        "num_heads",
        "0",
        "1",
        "-3",
        "0.5",
        "1e-3",
        "2.5e300",
        "1e999",
        "30.0",
        "t",
        "t[h]",
        "t[q - k]",
        "t[h][q - k]",
        "t[0][0]",
        "u[k - q]",
        "s[h]",
        "alibi_slopes(num_heads)",
        "alibi_slopes(num_heads)[h]",
        "alibi_slopes(0)[h]",
        "alibi_slopes(q)[h]",
        "[0.5, 1][h]",
        "[1.5][q]",
        "t5_bucket(k - q, 32, 128, true)",
        "t[h][t5_bucket(k - q, 8, 16, false)]",
        "t[h][t5_bucket(q, 8, 16, false)]",
        "t[h][t5_bucket(k - q, 0, 1, true)]",
        "softcap(score, 5.0)",
        "softcap(score, 0)",
        "softcap(score)",
        "softcap(q, 1.0)",
        "g.y(q) - g.y(k)",
        "abs(q - k)",
        "min(max(q - k, -8), 8) + 8",
        "(q - k) / 2",
        "d",
        "arr[h]",
    ])
    .prop_map(str::to_string);
    leaf.prop_recursive(3, 10, 3, |inner| {
        let op = proptest::sample::select(vec!["+", "-", "*", "/", "%", "<", "&", "|"]);
        prop_oneof![
            (inner.clone(), op, inner.clone()).prop_map(|(a, o, b)| format!("{a} {o} {b}")),
            inner.clone().prop_map(|a| format!("({a})")),
            inner.clone().prop_map(|a| format!("-{a}")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("softcap({a}, {b})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a}[{b}]")),
            inner.prop_map(|a| format!("t[h][{a}]")),
        ]
    })
}

fn statement() -> impl Strategy<Value = String> {
    prop_oneof![
        expr().prop_map(|e| format!("score = {e};")),
        expr().prop_map(|e| format!("score = score + {e};")),
        expr().prop_map(|e| format!("sink = {e};")),
        expr().prop_map(|e| format!("let d = {e};")),
        expr().prop_map(|e| format!("param p: int = {e};")),
        expr().prop_map(|e| format!("tensor t: [{e}];")),
        Just("tensor t: [num_heads, 32];".to_string()),
        Just("tensor t: [8];".to_string()),
        Just("tensor u: [16];".to_string()),
        Just("tensor s: [num_heads];".to_string()),
        Just("tensor w: [2, 3, 4];".to_string()),
        Just("sink = s[h];".to_string()),
        Just("grid g = [2, 4];".to_string()),
        Just("param arr: [int] = [1, 2];".to_string()),
        Just("mask = k <= q;".to_string()),
    ]
}

proptest! {
    #![proptest_config(fuzz_config(2000))]

    #[test]
    fn score_statement_soups(stmts in proptest::collection::vec(statement(), 0..8)) {
        compile_checked(&format!("mask = k < kv_len;\n{}", stmts.join("\n")));
    }
}

/// A chain of `let`s thousands deep inside a bucket and a bias: checked, bound and
/// evaluated without a stack overflow.
#[test]
fn deep_lets_in_a_score() {
    let mut src = String::from("let a0 = q - k;\n");
    for i in 1..=4000 {
        src.push_str(&format!("let a{i} = a{} + 0;\n", i - 1));
    }
    src.push_str(
        "tensor t: [8];\nmask = k <= q;\nscore = score + t[min(max(a4000, 0), 7)] + 0.5 * a4000;\n",
    );
    let (p, diags) = cm_stdlib::compile(&src);
    let p = p.unwrap_or_else(|| panic!("{diags:?}"));
    let shape = cm_ir::Shape {
        q_len: 4,
        kv_len: 4,
        batch: 1,
        num_heads: 1,
    };
    let b = p.bind(shape, &BTreeMap::new()).unwrap();
    let t = b.score.as_ref().unwrap();
    assert_eq!(t.table.as_ref().unwrap().bucket, [0, 0, 0, 0, 1, 2, 3]);
    let l = t.linear.as_ref().unwrap();
    assert_eq!((l.slopes[0], l.q_coef, l.k_coef), (0.5, 1, -1));
}
