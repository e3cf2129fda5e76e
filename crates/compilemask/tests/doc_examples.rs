//! Every mask program shown in docs/language.md (each ```text block holding a `mask =`
//! statement) and every file of examples/masks (the gallery masks BENCHMARKS.md times)
//! compiles and plans exactly, at two small shapes (batch 2, so masks that read `b` are
//! planned per sample), against the pairwise semantics.

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

fn gallery() -> Vec<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/masks");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("examples/masks")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cmask"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| std::fs::read_to_string(p).expect("a mask file"))
        .collect()
}

#[test]
fn every_example_plans_exactly() {
    let docs = examples();
    assert!(docs.len() >= 10, "found only {} examples", docs.len());
    let masks = gallery();
    assert!(
        masks.len() >= 10,
        "found only {} gallery masks",
        masks.len()
    );
    for src in docs.iter().chain(&masks) {
        let program = compile(src);
        for (q_len, kv_len) in [(600, 600), (97, 131)] {
            let mut options = PlanOptions::new(q_len).kv_len(kv_len);
            options.batch = 2;
            let p = plan(&program, &options);
            check_brute_force(&program, &options, &p);
        }
    }
}
