//! The score part on the command line: `plan` (text and `--json`) shows the bound terms of
//! the score built-ins at any q_len and num_heads, `check` names the terms, `list` and
//! `list --json` show the score statements; CM0411 for a token order.

mod common;

use common::*;
use serde_json::Value;

const SCORED: [&str; 4] = [
    "causal_alibi",
    "causal_softcap",
    "t5_relative_bias",
    "sliding_window_sinks",
];

fn plan_json(name: &str, q_len: u32, heads: u32) -> Value {
    let o = run(&[
        "plan",
        "--builtin",
        name,
        "--q-len",
        &q_len.to_string(),
        "--num-heads",
        &heads.to_string(),
        "--json",
    ]);
    assert!(o.status.success(), "{name} {q_len} {heads}: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

#[test]
fn score_builtins_plan_at_any_length_and_head_count() {
    for name in SCORED {
        for (q_len, heads) in [(1, 1), (7, 3), (128, 12), (1000, 16), (4097, 5)] {
            let s = &plan_json(name, q_len, heads)["score"];
            match name {
                "causal_alibi" => {
                    let l = &s["linear"];
                    let slopes = l["slopes"].as_array().unwrap();
                    assert_eq!(slopes.len(), heads as usize);
                    let want = compilemask::alibi_slopes(heads as usize);
                    for (a, b) in slopes.iter().zip(want) {
                        assert_eq!(a.as_f64().unwrap(), f64::from(-(b as f32)));
                    }
                    assert_eq!(
                        (l["q_coef"].as_i64(), l["k_coef"].as_i64()),
                        (Some(1), Some(-1))
                    );
                    assert_eq!(s["reads_positions"], true);
                }
                "causal_softcap" => assert_eq!(s["softcap"], 50.0),
                "t5_relative_bias" => {
                    let t = &s["table"];
                    assert_eq!(t["tensor"], "rel_bias");
                    assert_eq!(t["shape"], serde_json::json!([heads, 32]));
                    assert!(t["buckets_read"].as_u64().unwrap() <= 32);
                }
                _ => {
                    assert_eq!(s["sink"]["tensor"], "sinks");
                    assert_eq!(s["sink"]["shape"], serde_json::json!([heads]));
                    assert_eq!(s["reads_positions"], false);
                }
            }
        }
    }
    // A plan without a score has no `score` key.
    assert!(plan_json("causal", 5, 2).get("score").is_none());
}

#[test]
fn plan_check_and_list_show_the_score() {
    let o = run(&[
        "plan",
        "--builtin",
        "t5_relative_bias",
        "--q-len",
        "5",
        "--num-heads",
        "2",
    ]);
    assert!(o.status.success());
    assert!(
        stdout(&o).contains("  score           bias table `rel_bias` [2, 32] per head, learnable: 9 of 32 buckets read"),
        "{}",
        stdout(&o)
    );
    let o = run(&[
        "plan",
        "--builtin",
        "causal_alibi",
        "--q-len",
        "5",
        "--num-heads",
        "2",
    ]);
    assert!(
        stdout(&o)
            .contains("linear bias slopes[h] * (q - k), slopes [-0.0625, -0.00390625] (2 heads)"),
        "{}",
        stdout(&o)
    );
    let o = run(&["check", "--builtin", "sliding_window_sinks"]);
    assert!(o.status.success());
    assert!(
        stdout(&o).contains("score terms: sink (tensors given at attention time: sinks)"),
        "{}",
        stdout(&o)
    );
    let o = run(&["list", "--json"]);
    let all: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let listed: Vec<&Value> = all
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b.get("score").is_some())
        .collect();
    let names: Vec<&str> = listed.iter().map(|b| b["name"].as_str().unwrap()).collect();
    assert_eq!(names, SCORED);
    assert_eq!(
        listed[2]["score"]["terms"],
        serde_json::json!(["bias table"])
    );
    assert_eq!(
        listed[2]["score"]["tensors"][0]["statement"],
        "tensor rel_bias: [num_heads, num_buckets];"
    );
    assert_eq!(listed[3]["score"]["sink"], "sink = sinks[h];");
    let o = run(&["list"]);
    assert!(
        stdout(&o).contains("score:      score = softcap(score, cap);"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn token_orders_refuse_positional_scores() {
    let o = run(&[
        "plan",
        "--builtin",
        "causal_alibi",
        "--q-len",
        "4",
        "--order",
        "auto",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("[CM0411]"), "{}", stderr(&o));
}

/// Every export format holds only which pairs are visible: with score terms, `export` still
/// writes the mask, exactly the plain mask's, and warns on stderr naming each term.
#[test]
fn exports_warn_that_score_terms_are_left_out() {
    let dir = scratch("cli-score", "exports");
    for format in ["dense", "flex", "cudnn", "flashmask"] {
        for (name, term) in [
            (
                "causal_alibi",
                "linear bias slopes[h] * (q - k), slopes [-0.25, -0.0625, -0.015625, -0.00390625] (4 heads)",
            ),
            ("causal_softcap", "softcap 50: c * tanh(s / c)"),
            ("t5_relative_bias", "bias table `rel_bias` [4, 32] per head"),
            ("sliding_window_sinks", "sink `sinks` [4]"),
        ] {
            let path = dir.join(format!("{name}-{format}.json"));
            let path = path.to_str().unwrap();
            let args = [
                "export",
                "--builtin",
                name,
                "--q-len",
                "64",
                "--num-heads",
                "4",
                "--format",
                format,
                "-o",
                path,
            ];
            let o = run(&args);
            assert!(o.status.success(), "{args:?}: {}", stderr(&o));
            let err = stderr(&o);
            for needle in [
                "warning: the export holds only which pairs are visible, not the plan's score terms: ",
                term,
                "`plan.score_mod()`",
            ] {
                assert!(err.contains(needle), "{args:?}: no {needle:?} in\n{err}");
            }
            // The mask itself is the plain mask's: T5's default is bidirectional, the window
            // (128) covers all 64 rows, the others are causal.
            let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
            if format == "dense" {
                let rows = v["mask"].as_array().unwrap();
                assert_eq!(rows.len(), 64);
                for (q, row) in rows.iter().enumerate() {
                    for (k, x) in row.as_array().unwrap().iter().enumerate() {
                        let want = name == "t5_relative_bias" || k <= q;
                        assert_eq!(x.as_u64(), Some(u64::from(want)), "{name} ({q}, {k})");
                    }
                }
            }
        }
    }
    // A plan without score terms exports without the warning.
    let o = run(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "8",
        "--format",
        "cudnn",
    ]);
    assert!(o.status.success());
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
}

/// A bias table past 2^31 elements is refused at binding, naming its shape and the limit
/// (it was accepted and failed later); at the limit the plan is made. (Time: BENCHMARKS.md,
/// "Bias tables at the element limit".)
#[test]
fn bias_tables_past_the_limit_are_refused_at_once() {
    fails(
        &[
            "plan",
            "--builtin",
            "t5_relative_bias",
            "--q-len",
            "1000",
            "--set",
            "num_buckets=4294967295",
            "--set",
            "max_distance=4611686018427387904",
            "--num-heads",
            "65536",
        ],
        &[
            "[CM0315]",
            "tensor `rel_bias` is [65536, 4294967295], 281474976645120 elements; expected at most 2^31 = 2147483648",
        ],
    );
    // At the limit the plan is made.
    let out = ok(&[
        "plan",
        "--builtin",
        "t5_relative_bias",
        "--q-len",
        "1000",
        "--set",
        "num_buckets=2147483648",
        "--set",
        "max_distance=4611686018427387904",
    ]);
    assert!(
        out.contains("bias table `rel_bias` [1, 2147483648] per head, learnable: 1999 of 2147483648 buckets read"),
        "{out}"
    );
}
