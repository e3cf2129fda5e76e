//! Golden tests for small plans: row intervals and tile classes of built-in masks at small
//! lengths, dumped as text (`q: [a,b) U [c,d)` per row, then an F/P/. tile map with one
//! line per query tile). Every plan is also checked row by row against the pairwise
//! semantics and tile by tile against a dense classification, so a snapshot can only hold
//! a correct plan.

mod common;

use common::{arr, check_brute_force, dump, plan};
use compilemask::{PlanOptions, Value};

fn golden(name: &str, builtin: &str, options: PlanOptions) {
    let program = compilemask::builtin(builtin).unwrap();
    let p = plan(&program, &options);
    check_brute_force(&program, &options, &p);
    let mut header = format!("builtin {builtin}");
    for (k, v) in &options.params {
        match v {
            Value::Int(i) => header.push_str(&format!(" {k}={i}")),
            Value::Array(a) => header.push_str(&format!(" {k}={a:?}")),
        }
    }
    insta::assert_snapshot!(name, format!("{header}\n{}", dump(&p, 0, 0)));
}

#[test]
fn plan_causal_10_tiles_4x3() {
    golden(
        "causal_10_tile_4x3",
        "causal",
        PlanOptions::new(10).tile(4, 3),
    );
}

#[test]
fn plan_hstu_small() {
    // Two users of 6 and 10 tokens; 2 contextual tokens; T = max(1, L / 4) targets.
    golden(
        "hstu_small",
        "hstu",
        PlanOptions::new(16)
            .tile(4, 4)
            .param("lengths", arr(&[6, 10]))
            .param("contextual", Value::Int(2))
            .param("target_divisor", Value::Int(4)),
    );
}

#[test]
fn plan_shared_prefix_small() {
    // Sample 0: prompt 3, responses 2 and 1; sample 1: prompt 2, responses 3 and 2.
    golden(
        "shared_prefix_small",
        "shared_prefix",
        PlanOptions::new(13)
            .tile(4, 4)
            .param("prompts", arr(&[3, 2]))
            .param("responses", arr(&[2, 1, 3, 2]))
            .param("group", Value::Int(2)),
    );
}

#[test]
fn plan_clear_6x6_text_3_radius_3() {
    golden(
        "clear_6x6_text3_radius3",
        "clear",
        PlanOptions::new(3 + 6 * 6)
            .tile(8, 8)
            .param("text", Value::Int(3))
            .param("radius", Value::Int(3)),
    );
}
