//! Every mask program shown in docs/language.md compiles and plans exactly: each ```text
//! block holding a `mask =` statement, planned at two small shapes (batch 2, so masks that
//! read `b` are planned per sample) against the pairwise semantics.

mod common;

use common::{check_brute_force, compile, plan};
use compilemask::PlanOptions;

fn examples() -> Vec<String> {
    let doc = include_str!("../../../docs/language.md");
    doc.split("```text\n")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .filter(|code| code.contains("mask ="))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_example_plans_exactly() {
    let all = examples();
    assert!(all.len() >= 10, "found only {} examples", all.len());
    for src in &all {
        let program = compile(src);
        for (q_len, kv_len) in [(600, 600), (97, 131)] {
            let mut options = PlanOptions::new(q_len).kv_len(kv_len);
            options.batch = 2;
            let p = plan(&program, &options);
            check_brute_force(&program, &options, &p);
        }
    }
}
