//! FlashMask's column form as an input: the builtin `flashmask` planned from the arrays
//! `export::flashmask_bounds` writes for a mask gives that mask's rows back, for built-in and
//! written masks at odd and unequal lengths; a plan from the column form is exact against
//! the pairwise semantics too.

mod common;

use common::{arr, check_brute_force, compile, plan, rows};
use compilemask::{export, PlanOptions, Value};

fn ints(v: &[i32]) -> Value {
    arr(&v.iter().map(|&x| i64::from(x)).collect::<Vec<_>>())
}

#[test]
fn column_bounds_give_the_mask_back() {
    let flashmask = compilemask::builtin("flashmask").unwrap();
    let cases: Vec<(compilemask::Program, PlanOptions)> = vec![
        (
            compilemask::builtin("causal").unwrap(),
            PlanOptions::new(37),
        ),
        (
            compilemask::builtin("document_causal").unwrap(),
            PlanOptions::new(50).param("lengths", arr(&[7, 0, 13, 30])),
        ),
        (
            compilemask::builtin("sliding_window").unwrap(),
            PlanOptions::new(41)
                .kv_len(29)
                .param("window", Value::Int(5)),
        ),
        (
            compilemask::builtin("prefix_lm").unwrap(),
            PlanOptions::new(23)
                .kv_len(31)
                .param("prefix", Value::Int(6)),
        ),
        (
            compile("mask = k < 3 | q - 4 <= k & k <= q + 2;"),
            PlanOptions::new(19).kv_len(25),
        ),
    ];
    for (program, options) in cases {
        let original = plan(&program, &options);
        let b = export::flashmask_bounds(&original.mask(0, 0).rows).unwrap();
        let mut from_columns = PlanOptions::new(options.q_len).kv_len(options.shape().kv_len);
        for (name, v) in [
            ("uts", &b.uts),
            ("ute", &b.ute),
            ("lts", &b.lts),
            ("lte", &b.lte),
        ] {
            from_columns = from_columns.param(name, ints(v));
        }
        let p = plan(&flashmask, &from_columns);
        check_brute_force(&flashmask, &from_columns, &p);
        assert_eq!(rows(&p, 0, 0), rows(&original, 0, 0));
    }
    // The defaults mask nothing.
    let options = PlanOptions::new(9).kv_len(4);
    assert_eq!(plan(&flashmask, &options).visible_pairs(), 36);
}
