//! Reduced reproductions of bugs found while writing the golden and public-report tests.
//! Each is `#[ignore = "bug: ..."]` until the library is fixed; run them with
//! `cargo test -p compilemask --test regressions -- --ignored`. Each asserts the behaviour
//! we want, so removing the `ignore` is the whole follow-up once the fix lands.

mod common;

use common::{arr, check_brute_force, compile, plan};
use compilemask::{AttentionShape, PlanOptions, Value};

/// Compiling `src` must give an error with `code`, not a panic.
fn expect_compile_error(src: &str, code: &str) {
    let result = std::panic::catch_unwind(|| compilemask::compile(src).map(|_| ()));
    match result {
        Err(_) => panic!("the checker panicked on:\n{src}"),
        Ok(Ok(())) => panic!("expected {code}, but the program checked:\n{src}"),
        Ok(Err(e)) => assert!(
            e.diagnostics.iter().any(|d| d.code == code),
            "expected {code}, got:\n{}",
            e.rendered
        ),
    }
}

// ---- the checker panics when a failed `segments` / `grid` declaration is used ----------

#[test]
fn segmentation_with_unknown_lengths_then_called() {
    expect_compile_error("segments doc = lenghts;\nmask = k in doc(q);\n", "CM0201");
}

#[test]
fn segmentation_with_integer_lengths_then_called() {
    expect_compile_error("segments doc = 3;\nmask = k in doc(q);\n", "CM0203");
}

#[test]
fn part_of_failed_segmentation() {
    expect_compile_error(
        "segments doc = x;\npart doc.head = 0 .. 1;\nmask = k <= q;\n",
        "CM0201",
    );
}

#[test]
fn axis_of_failed_grid() {
    expect_compile_error("grid img = [x, 2];\nmask = k <= img.y(q);\n", "CM0201");
}

#[test]
fn membership_of_failed_grid() {
    expect_compile_error("grid img = [x, 2];\nmask = k in img;\n", "CM0201");
}

// ---- plan-time panics -------------------------------------------------------------------

const COMPOSITE: &str = "\
param prompts: [int] = [4];
param responses: [int] = [2];
segments sample = { prompt: prompts, response: responses * 1 };
mask = k in sample(q);
";

/// Planning must give an error (any code), not a panic.
fn expect_plan_error(src: &str, options: &PlanOptions) -> compilemask::PlanError {
    let program = compile(src);
    let result = std::panic::catch_unwind(|| program.plan(options).map(|_| ()));
    match result {
        Err(_) => panic!("planning panicked"),
        Ok(Ok(())) => panic!("planning succeeded; expected an error"),
        Ok(Err(e)) => e,
    }
}

#[test]
fn composite_segmentation_with_empty_array() {
    let e = expect_plan_error(
        COMPOSITE,
        &PlanOptions::new(10).param("responses", arr(&[])),
    );
    assert!(e.code == "CM0306" || e.code == "CM0308", "{e}");
}

#[test]
fn composite_segmentation_with_huge_lengths_is_cut_without_overflow() {
    // Lengths are cut to what is left of q_len as they are laid out, so a length near
    // i64::MAX is legal: the first response takes every remaining token.
    let program = compile(COMPOSITE);
    let options = PlanOptions::new(10).param("responses", arr(&[i64::MAX, 1]));
    let plan = program.plan(&options).unwrap();
    for q in 0..10 {
        let got: Vec<(u32, u32)> = plan
            .mask(0, 0)
            .rows
            .row(q)
            .iter()
            .map(|iv| (iv.start, iv.end))
            .collect();
        assert_eq!(
            got,
            program
                .brute_force_row(&options, i64::from(q), 0, 0)
                .unwrap(),
            "row {q}"
        );
    }
}

#[test]
fn modulo_with_huge_divisor() {
    // (q - k) % (2^63 - 1) == 0 holds exactly when k == q for these lengths.
    let program = compile("mask = (q - k) % 9223372036854775807 == 0;");
    let o = PlanOptions::new(2);
    let p = std::panic::catch_unwind(|| plan(&program, &o)).expect("planning panicked");
    check_brute_force(&program, &o, &p);
    assert_eq!(common::rows(&p, 0, 0), vec![vec![(0, 1)], vec![(1, 2)]]);
}

/// A requirement reading a segmentation was evaluated before segmentations were laid out
/// (an index panic); requirements are now evaluated last.
#[test]
fn requirement_reading_a_segmentation() {
    let program = compile(
        "segments doc = [3, 5];\nrequire doc.count <= 4 else \"{doc.count} documents\";\nmask = k in doc(q);",
    );
    let p = plan(&program, &PlanOptions::new(16));
    assert_eq!(common::rows(&p, 0, 0)[15], vec![(11, 16)]);
    let err = expect_plan_error(
        "segments doc = [1];\nrequire doc.count <= 4 else \"{doc.count} documents\";\nmask = k in doc(q);",
        &PlanOptions::new(6),
    );
    assert_eq!(
        (err.code.as_str(), err.message.as_str()),
        ("CM0305", "6 documents")
    );
}

// ---- resource use --------------------------------------------------------------------

#[test]
fn tile_larger_than_the_sequence_costs_memory_per_tile_row() {
    let program = compilemask::builtin("causal").unwrap();
    let p = plan(&program, &PlanOptions::new(10).tile(1 << 22, 1));
    // Either reject such tiles or store only in-range rows; 10 rows need a few hundred bytes.
    assert!(
        p.descriptor_bytes() < 1 << 20,
        "descriptor_bytes = {}",
        p.descriptor_bytes()
    );
}

// ---- determinism ---------------------------------------------------------------------

#[test]
fn diagnostics_of_a_failing_program_in_source_order() {
    // Six lets with unknown names (unused lets are checked too), then one more in the mask:
    // seven errors.
    let src = "let a = z1;\nlet b2 = z2;\nlet c = z3;\nlet d = z4;\nlet e = z5;\nlet f = z6;\nmask = k <= zz;\n";
    let starts = || -> Vec<u32> {
        compilemask::compile(src)
            .unwrap_err()
            .diagnostics
            .iter()
            .map(|d| d.span.start)
            .collect()
    };
    let first = starts();
    assert_eq!(first.len(), 7);
    let mut sorted = first.clone();
    sorted.sort_unstable();
    assert_eq!(first, sorted, "diagnostics not in source order");
    for _ in 0..20 {
        assert_eq!(starts(), first, "diagnostic order changed between compiles");
    }
}

// ---- validation ------------------------------------------------------------------------

#[test]
fn attention_rejects_a_plan_for_other_batch_and_heads() {
    let program =
        compile("param n: [int] = [1, 2];\nmask = if q < n[b] then k <= q else k < kv_len;");
    let mut o = PlanOptions::new(4).param("n", arr(&[1, 3]));
    o.batch = 2;
    let p = plan(&program, &o);
    assert_eq!(p.masks.len(), 2);
    // Tensors for batch 1 with 2 heads: batch * num_heads = 2 = the plan's index length,
    // so the batch-1 mask is used for head 1 without any error.
    let shape = AttentionShape {
        batch: 1,
        num_heads: 2,
        num_kv_heads: 2,
        q_len: 4,
        kv_len: 4,
        head_dim: 4,
        head_dim_v: 4,
    };
    let x = vec![0.5f64; 2 * 4 * 4];
    assert!(
        compilemask::attention(&shape, &x, &x, &x, &p, 1.0).is_err(),
        "a plan for batch = 2, num_heads = 1 was accepted for batch = 1, num_heads = 2"
    );
}

#[test]
fn clear_short_sequence_names_nearest_lengths() {
    // Below text + 1 there is no grid at all: the message names the smallest valid length
    // (it used to say "nearest valid lengths: 4 and 4", or fail on an empty grid).
    let program = compilemask::builtin("clear").unwrap();
    for q_len in [1, 2, 3] {
        let e = program
            .plan(&PlanOptions::new(q_len).param("text", Value::Int(3)))
            .unwrap_err();
        assert!(
            e.message.contains("the smallest valid length is 4"),
            "q_len {q_len}: {}",
            program.render_error(&e)
        );
    }
    // Between valid lengths: the two nearest, distinct, one on each side.
    for (q_len, lower, upper) in [
        (5, 4, 7),
        (6, 4, 7),
        (8, 7, 12),
        (40, 39, 52),
        (33_000, 32_912, 33_273),
    ] {
        let text = if q_len > 1000 { 512 } else { 3 };
        let e = program
            .plan(&PlanOptions::new(q_len).param("text", Value::Int(text)))
            .unwrap_err();
        assert!(
            e.message
                .contains(&format!("nearest valid lengths: {lower} and {upper}")),
            "q_len {q_len}: {}",
            program.render_error(&e)
        );
    }
    // The lengths it names plan.
    for q_len in [4, 7, 12, 39, 52] {
        program
            .plan(
                &PlanOptions::new(q_len)
                    .param("text", Value::Int(3))
                    .param("radius", Value::Int(2)),
            )
            .unwrap();
    }
}
