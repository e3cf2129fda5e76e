//! CM0266: a tree whose nodes reach past `q_len` or `kv_len` plans (out-of-range positions
//! contribute nothing) but warns, naming the tree, its nodes and offset, the lengths and
//! the nodes past each; per batch index and per packed sample, summarised in one warning.
//! The expected counts are worked out by hand from each tree's positions `at .. at + n`.

mod common;

use common::{arr, compile, plan};
use compilemask::{Diagnostic, PackedShape, PlanOptions, Program, TreeOverhang};

/// The program of examples/masks/tree.cmask: 8 nodes at offset 0.
fn example() -> Program {
    let src = include_str!("../../../examples/masks/tree.cmask");
    compilemask::compile_named(src, "examples/masks/tree.cmask").unwrap()
}

/// The CM0266 warnings of planning `program` with `options`.
fn tree_warnings(program: &Program, options: &PlanOptions) -> Vec<Diagnostic> {
    let p = plan(program, options);
    program
        .plan_warnings(options, &p)
        .into_iter()
        .filter(|d| d.code == "CM0266")
        .collect()
}

fn overhangs(program: &Program, options: &PlanOptions) -> Vec<TreeOverhang> {
    plan(program, options).tree_overhangs
}

#[test]
fn the_example_tree_cut_at_q_len_4_warns_with_its_numbers() {
    let program = example();
    let options = PlanOptions::new(4);
    let o = overhangs(&program, &options);
    assert_eq!(
        o,
        vec![TreeOverhang {
            tree: 0,
            b: 0,
            nodes: 8,
            at: 0,
            q_len: 4,
            kv_len: 4,
            batches: 1,
            checked: 1,
        }]
    );
    assert_eq!(
        (o[0].past_q_len(), o[0].past_kv_len(), o[0].outside()),
        (4, 4, 4)
    );
    let w = tree_warnings(&program, &options);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(!w[0].is_error());
    assert_eq!(
        w[0].message,
        "tree `t` has 8 nodes at offset 0 (positions 0 ..= 7), but q_len = 4 and kv_len = 4: \
         4 nodes lie past q_len (no query row) and 4 past kv_len (no key)"
    );
    assert_eq!(
        w[0].hint.as_deref(),
        Some(
            "to keep every node, give q_len >= 8 and kv_len >= 8, or a shorter parents list \
             (4 nodes fit at offset 0)"
        )
    );
    // The span is the tree's declaration, line 4 of the example.
    let src = program.source();
    let at = w[0].span.start as usize;
    assert!(
        src[at..].starts_with("tree t = parents;"),
        "{:?}",
        &src[at..]
    );
}

#[test]
fn the_example_tree_within_the_lengths_does_not_warn() {
    let program = example();
    for q_len in [8, 12] {
        let options = PlanOptions::new(q_len);
        assert_eq!(overhangs(&program, &options), vec![], "q_len = {q_len}");
        assert_eq!(tree_warnings(&program, &options), vec![], "q_len = {q_len}");
    }
}

#[test]
fn nodes_past_kv_len_only_or_q_len_only_are_told_apart() {
    let program = example();
    // kv_len 6: nodes 6, 7 are no key; every node still has a row.
    let options = PlanOptions::new(8).kv_len(6);
    let w = tree_warnings(&program, &options);
    assert_eq!(w.len(), 1);
    assert!(
        w[0].message
            .ends_with("but q_len = 8 and kv_len = 6: 2 nodes lie past kv_len (no key)"),
        "{}",
        w[0].message
    );
    assert_eq!(
        w[0].hint.as_deref(),
        Some("to keep every node, give kv_len >= 8, or a shorter parents list (6 nodes fit at offset 0)")
    );
    // A tree at 10 planned with 10 rows: no node has a row, every node is a key.
    let program =
        compile("param p: [int] = [-1, 0];\ntree t = p at 10;\nmask = k <= q | k in t.path(q);\n");
    let options = PlanOptions::new(10).kv_len(20);
    let w = tree_warnings(&program, &options);
    assert_eq!(w.len(), 1);
    assert_eq!(
        w[0].message,
        "tree `t` has 2 nodes at offset 10 (positions 10 ..= 11), but q_len = 10 and kv_len = 20: \
         2 nodes lie past q_len (no query row)"
    );
    assert_eq!(
        w[0].hint.as_deref(),
        Some(
            "to keep every node, give q_len >= 12, or a smaller offset (no node fits at offset 10)"
        )
    );
}

#[test]
fn every_tree_is_checked_one_warning_each() {
    let program = compile(
        "tree a = [-1, 0, 0];\ntree c = [-1, 0] at 3;\ntree d = [-1] at 1;\n\
         mask = k in a.path(q) | k in c.path(q) | k in d.path(q);\n",
    );
    // q_len 4: `a` (0 ..= 2) and `d` (1) fit, `c` (3 ..= 4) has one node past both lengths.
    let o = overhangs(&program, &PlanOptions::new(4));
    assert_eq!(o.len(), 1, "{o:?}");
    assert_eq!(
        (o[0].tree, o[0].nodes, o[0].at, o[0].outside()),
        (1, 2, 3, 1)
    );
    // q_len 2: `a` has one node past, `c` both, `d` none.
    let w = tree_warnings(&program, &PlanOptions::new(2));
    let named: Vec<&str> = w.iter().map(|d| &d.message[..8]).collect();
    assert_eq!(named, ["tree `a`", "tree `c`"]);
    assert!(w[0]
        .message
        .ends_with(": 1 node lies past q_len (no query row) and 1 past kv_len (no key)"));
    assert!(w[1]
        .message
        .ends_with(": 2 nodes lie past q_len (no query row) and 2 past kv_len (no key)"));
}

/// The parents read `b`: batch index b's tree is the first 2 + 2b nodes, so at q_len 4
/// b = 2 (6 nodes, 2 outside) and b = 3 (8 nodes, 4 outside) reach past it.
const PER_BATCH: &str = "param p: [int] = [-1, 0, 1, 1, 0, 4, 4, 6];\n\
                         tree t = p[0 .. 2 + 2 * b];\nmask = k in t.path(q);\n";

#[test]
fn a_tree_per_batch_index_is_summarised_in_one_warning() {
    let program = compile(PER_BATCH);
    let mut options = PlanOptions::new(4);
    options.batch = 4;
    let o = overhangs(&program, &options);
    assert_eq!(
        o,
        vec![TreeOverhang {
            tree: 0,
            b: 3,
            nodes: 8,
            at: 0,
            q_len: 4,
            kv_len: 4,
            batches: 2,
            checked: 4,
        }]
    );
    let w = tree_warnings(&program, &options);
    assert_eq!(w.len(), 1, "one warning for the four batch indices: {w:?}");
    assert_eq!(
        w[0].message,
        "tree `t` at batch index 3 has 8 nodes at offset 0 (positions 0 ..= 7), but q_len = 4 \
         and kv_len = 4: 4 nodes lie past q_len (no query row) and 4 past kv_len (no key); \
         2 of 4 batch indices have nodes outside, this one the most"
    );
    // Batch indices 0 and 1 alone fit.
    options.batch = 2;
    assert_eq!(overhangs(&program, &options), vec![]);
}

#[test]
fn packed_samples_are_checked_at_their_own_lengths() {
    let program = compile(PER_BATCH);
    // Samples of 8, 4 and 3 rows hold trees of 2, 4 and 6 nodes: only sample 2's reaches
    // past its lengths, by 3 nodes.
    let packed = PackedShape::self_attention([0, 8, 12, 15]);
    let options = PlanOptions::default();
    let p = program.plan_packed(&packed, &options).unwrap();
    assert_eq!(
        p.tree_overhangs,
        vec![TreeOverhang {
            tree: 0,
            b: 2,
            nodes: 6,
            at: 0,
            q_len: 3,
            kv_len: 3,
            batches: 1,
            checked: 3,
        }]
    );
    let w: Vec<Diagnostic> = program
        .plan_warnings(&options, &p)
        .into_iter()
        .filter(|d| d.code == "CM0266")
        .collect();
    assert_eq!(w.len(), 1);
    assert_eq!(
        w[0].message,
        "tree `t` at packed sample 2 has 6 nodes at offset 0 (positions 0 ..= 5), but the \
         sample's q_len = 3 and kv_len = 3: 3 nodes lie past q_len (no query row) and 3 past \
         kv_len (no key); the other 2 samples fit"
    );
    // A tree that reads no `b` still differs per sample, by the samples' lengths.
    let program = example();
    let packed = PackedShape::self_attention([0, 8, 13]);
    let p = program.plan_packed(&packed, &options).unwrap();
    let o = &p.tree_overhangs;
    assert_eq!(o.len(), 1);
    assert_eq!(
        (
            o[0].b,
            o[0].q_len,
            o[0].outside(),
            o[0].batches,
            o[0].checked
        ),
        (1, 5, 3, 1, 2)
    );
}

/// The built-in `tree` requires q_len <= prompt + count(parents) (an error for rows past
/// the tree); the warning covers the other side, nodes past q_len, so together a plan is
/// silent only when the lengths and the tree end together.
#[test]
fn the_builtin_tree_errors_on_one_side_and_warns_on_the_other() {
    let tree = compilemask::builtin("tree").unwrap();
    // Its default is 127 nodes at prompt 0.
    assert_eq!(tree_warnings(&tree, &PlanOptions::new(127)), vec![]);
    let w = tree_warnings(&tree, &PlanOptions::new(64));
    assert_eq!(w.len(), 1);
    assert!(
        w[0].message.starts_with(
            "tree `t` has 127 nodes at offset 0 (positions 0 ..= 126), but q_len = 64 and kv_len = 64: 63 nodes"
        ),
        "{}",
        w[0].message
    );
    let options = PlanOptions::new(20).param("prompt", compilemask::Value::Int(10));
    let options = options.param("parents", arr(&[-1, 0, 1, 1, 0, 4, 4, 6, 7, 7, 7, 7]));
    let o = overhangs(&tree, &options);
    assert_eq!((o[0].nodes, o[0].at, o[0].outside()), (12, 10, 2));
    let e = tree.plan(&PlanOptions::new(128)).unwrap_err();
    assert_eq!(e.code, "CM0305");
}
