//! `Program::row_range` (rows solved alone, no tile descriptor) against the whole plan's
//! rows: every built-in, per batch and head, at ranges that start and end inside the
//! sequence, with q_len != kv_len where the mask allows it.

use compilemask::{PlanOptions, BUILTINS};

#[test]
fn rows_alone_are_the_plans_rows() {
    let mut checked = 0;
    for builtin in BUILTINS {
        let program = compilemask::builtin(builtin.name).unwrap();
        for (q_len, kv_len) in [(37, 37), (29, 45)] {
            let mut options = PlanOptions::new(q_len);
            options.kv_len = Some(kv_len);
            options.batch = 2;
            options.num_heads = 3;
            // Some masks need q_len == kv_len or refuse these lengths: both paths must agree.
            let plan = match program.plan(&options) {
                Ok(plan) => plan,
                Err(whole) => {
                    let alone = program.row_range(&options, 0, 0, 0..1).unwrap_err();
                    assert_eq!(whole.code, alone.code, "{}", builtin.name);
                    continue;
                }
            };
            for (b, h) in [(0, 0), (1, 2)] {
                let rows = &plan.mask(b, h).rows;
                for range in [0..q_len as u32, 5..6, 11..q_len as u32 - 3] {
                    let alone = program.row_range(&options, b, h, range.clone()).unwrap();
                    for q in range.clone() {
                        assert_eq!(
                            alone.row_expanded(q - range.start),
                            rows.row_expanded(q),
                            "{} q_len {q_len} kv_len {kv_len} b {b} h {h} row {q}",
                            builtin.name
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 50, "{checked}");
    let causal = compilemask::builtin("causal").unwrap();
    let options = PlanOptions::new(10);
    let err = causal.row_range(&options, 0, 1, 0..2).unwrap_err();
    assert_eq!(
        err.message,
        "head index h = 1 is outside the shape's 0 .. 1"
    );
    let err = causal.row_range(&options, 0, 0, 3..11).unwrap_err();
    assert_eq!(err.code, compilemask::Code::LengthOutOfRange);
}
