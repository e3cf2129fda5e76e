//! FlashMask's column form as an input: the builtin `flashmask` planned from the arrays
//! `export::flashmask_bounds` writes for a mask gives that mask's rows back, for built-in and
//! written masks at odd and unequal lengths; a plan from the column form is exact against
//! the pairwise semantics too.

mod common;

use common::{arr, check_brute_force, compile, plan, rows, set};
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

/// FlashMask's `causal=True` form (`causal = 1`): the upper triangle masked without arrays,
/// the lower triangle's masked rows given by `lts` alone (each run to the last row) or by
/// `lts` and `lte`, against FlashMask's definition evaluated pair by pair (key `k` visible to
/// row `q` when `k <= q` and `q` is not in `[lts[k], lte[k])`), at odd and unequal lengths.
#[test]
fn the_causal_form_masks_the_upper_triangle() {
    let flashmask = compilemask::builtin("flashmask").unwrap();
    let (q_len, kv_len) = (37u32, 29u32);
    // Causal documents of 11, 5 and the rest: a key is masked from its document's end.
    let doc_end = |k: u32| {
        if k < 11 {
            11
        } else if k < 16 {
            16
        } else {
            q_len
        }
    };
    // A causal sliding window of 6 written as lower-triangle starts, and a band of masked
    // rows [k + 3, k + 9) per key.
    type Case = (Vec<i64>, Option<Vec<i64>>);
    let cases: Vec<Case> = vec![
        ((0..kv_len).map(|k| i64::from(doc_end(k))).collect(), None),
        (
            (0..kv_len).map(|k| i64::from((k + 6).min(q_len))).collect(),
            None,
        ),
        (
            (0..kv_len).map(|k| i64::from(k + 3)).collect(),
            Some((0..kv_len).map(|k| i64::from(k + 9)).collect()),
        ),
    ];
    for (lts, lte) in cases {
        let mut options = PlanOptions::new(i64::from(q_len))
            .kv_len(i64::from(kv_len))
            .param("causal", Value::Int(1))
            .param("lts", arr(&lts));
        if let Some(lte) = &lte {
            options = options.param("lte", arr(lte));
        }
        let p = plan(&flashmask, &options);
        check_brute_force(&flashmask, &options, &p);
        for q in 0..q_len {
            let keys = (0..kv_len).filter(|&k| {
                let (lo, hi) = (
                    lts[k as usize],
                    lte.as_ref().map_or(i64::MAX, |e| e[k as usize]),
                );
                k <= q && !(lo..hi).contains(&i64::from(q))
            });
            assert_eq!(
                rows(&p, 0, 0)[q as usize],
                set(keys),
                "row {q} of lts {lts:?}"
            );
        }
    }
}

/// Bad `causal` values and arrays that do not fit the form are errors naming them.
#[test]
fn bad_column_forms_are_named() {
    let flashmask = compilemask::builtin("flashmask").unwrap();
    let eight = |v: i64| arr(&[v; 8]);
    let cases = [
        (
            PlanOptions::new(8).param("causal", Value::Int(2)),
            "causal must be 0 or 1, got 2".to_string(),
        ),
        (
            PlanOptions::new(8)
                .param("causal", Value::Int(1))
                .param("uts", eight(0))
                .param("ute", eight(1)),
            "give lts (and lte) only, got 8 uts".to_string(),
        ),
        (
            PlanOptions::new(8)
                .param("lts", eight(3))
                .param("lte", arr(&[5])),
            "got 8 lts and 1 lte".to_string(),
        ),
        (
            PlanOptions::new(8).param("uts", eight(3)),
            "uts and ute need equal lengths, got 8 and 0".to_string(),
        ),
    ]
    .into_iter()
    // An array of another length than kv_len (and not empty) would leave keys unmasked.
    .chain(
        [(2, "uts", 8), (9, "uts", 8), (7, "lts", 8), (1, "lts", 4)].map(|(n, name, kv_len)| {
            let other = if name == "uts" { "ute" } else { "lte" };
            (
                PlanOptions::new(kv_len)
                    .param(name, arr(&vec![0; n]))
                    .param(other, arr(&vec![0; n])),
                format!("{name} holds one entry per key (kv_len = {kv_len}) or none, got {n}"),
            )
        }),
    );
    for (options, message) in cases {
        let err = flashmask.plan(&options).unwrap_err();
        let text = flashmask.render_error(&err);
        assert!(text.contains(&message), "{text}");
    }
}
