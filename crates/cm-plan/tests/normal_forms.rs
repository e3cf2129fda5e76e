//! The normal forms of `k` (docs/language.md, "Solvable forms"): `abs`, terms moved across a
//! comparison, `%` inequalities, q-side coefficients, folded `if`s and `% 1`, and chains of
//! unions, comparisons split into cases at `abs` / `min` / `max` terms (random ones against
//! their `elementwise` evaluation): each planned exactly (rows against the pairwise semantics, tiles against a dense
//! evaluation) and in the pieces its structure needs, not one per row.

#[allow(dead_code)]
mod common;
use cm_ir::Value;
use cm_plan::{plan, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;

const TILES: &[TileShape] = &[
    TileShape {
        block_m: 16,
        block_n: 16,
    },
    TileShape {
        block_m: 7,
        block_n: 5,
    },
];

/// Masks of public galleries as they are written there, at odd and unequal lengths.
#[test]
fn gallery_forms_as_written_equal_brute_force() {
    let masks = [
        // attention-gym / NATTEN 1D: a symmetric band.
        "param w: int = 5;\nmask = abs(q - k) <= w;",
        // A strict band off the diagonal, `abs` on the right.
        "param w: int = 4;\nmask = w > abs(k - q + 2);",
        // The complement of a band.
        "mask = abs(q - k) > 6 & k <= q;",
        // Block-sparse with the block index moved across: `c - k / B < K`.
        "param c: int = 9;\nmask = c - k / 4 < 3 & k <= q;",
        // Terms on both sides of a division.
        "mask = q / 8 - k / 8 <= 1 & k <= q;",
        // Within-block causal by residue: `k % B <= q % B` with the same block.
        "param blk: int = 8;\nmask = k % blk <= q % blk & k / blk == q / blk;",
        // Strided (Sparse Transformer column pattern) by residue inequality.
        "mask = (q - k) % 6 < 2 & k <= q;",
        // Negative divisors and moved terms.
        "mask = 3 - (k - q) % -4 >= 2;",
        // A coefficient that is a parameter.
        "param a: int = 3;\nmask = a * k <= q + 1;",
        "param a: int = -2;\nmask = a * k + q > 0 & k < kv_len - 1;",
        // `if` on literals, and `% 1`, folded or solved without one piece per row.
        "mask = if 2 > 1 then q - 9 < k <= q else k < 0;",
        "mask = (k - q) % 1 == 0 & k <= q;",
        // A chain of `k == f(q)` terms, unsorted, some touching, some outside the keys.
        "mask = k == 17 | k == 3 | k == q | k == 4 | k == q - 1 | k == q + 1 | k == 90 \
         | k == q / 2 | k == -1 | k == 2 * q | k == 5;",
    ];
    for src in masks {
        let program = compile(src);
        for (q_len, kv_len) in [(1, 1), (37, 37), (61, 44), (29, 70)] {
            for tile in TILES {
                check_against_brute_force(&program, shape(q_len, kv_len), &params(&[]), *tile);
            }
        }
    }
}

fn pieces(src: &str, q_len: i64, kv_len: i64, values: &[(&str, Value)]) -> u64 {
    let program = compile(src);
    let bound = program.bind(shape(q_len, kv_len), &params(values)).unwrap();
    let tile = TileShape {
        block_m: 64,
        block_n: 64,
    };
    plan(&bound, tile).unwrap().pieces
}

/// The solver's pieces follow the structure, not the rows: a causal band by `abs` or by
/// `% 1` is a handful of pieces at any length; a residue window changes every block.
#[test]
fn normal_forms_plan_in_few_pieces() {
    let n = 4096;
    assert_eq!(pieces("mask = (k - q) % 1 == 0 & k <= q;", n, n, &[]), 1);
    assert_eq!(pieces("mask = (k - q) % -1 != 0 | k <= q;", n, n, &[]), 1);
    assert!(pieces("mask = abs(q - k) <= 100;", n, n, &[]) <= 4);
    assert!(pieces("param a: int = 2;\nmask = a * k <= q;", n, n, &[]) <= 2 * n as u64 / 2);
    assert!(pieces("mask = if 1 == 1 then k <= q else k < 0;", n, n, &[]) == 1);
    // A residue window whose length grows with q % 64: one piece per block of 64 rows.
    let blocks = pieces("mask = k % 64 <= q % 64 & k <= q;", n, n, &[]);
    assert!(blocks <= 2 * n as u64 / 64, "{blocks} pieces");
    // A chain of constant keys is one piece; with `k <= q`, a few more where the causal
    // run reaches each key.
    let chain: Vec<String> = (0..100).rev().map(|i| format!("k == {}", i * 37)).collect();
    assert_eq!(
        pieces(&format!("mask = {};", chain.join(" | ")), n, n, &[]),
        1
    );
    let src = format!("mask = ({}) | k <= q;", chain.join(" | "));
    assert!(pieces(&src, n, n, &[]) <= 300);
}

/// A term linear in `k`: `a*k + b*q + c` with `a` of -1 or 1 (what a `%` inequality of the
/// split cases needs) and small `b`, `c`.
fn linear() -> impl Strategy<Value = String> {
    (prop::bool::ANY, -2i64..=2, -6i64..=6).prop_map(|(neg, b, c)| {
        let a = if neg { -1 } else { 1 };
        format!("({a} * k + {b} * q + {c})")
    })
}

/// A q-side term `b*q + c`.
fn q_side() -> impl Strategy<Value = String> {
    (-2i64..=2, -6i64..=6).prop_map(|(b, c)| format!("({b} * q + {c})"))
}

/// A term with `abs`, `min` or `max` of linear terms, once or nested, maybe inside `/`, `%`
/// or a sum (the comparisons `split_cases` brings to a union of atoms).
fn split_term() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        linear().prop_map(|x| format!("abs({x})")),
        (linear(), prop_oneof![linear(), q_side()]).prop_map(|(x, y)| format!("min({x}, {y})")),
        (linear(), prop_oneof![linear(), q_side()]).prop_map(|(x, y)| format!("max({x}, {y})")),
    ];
    (leaf, linear(), 0u8..5, 2i64..6).prop_map(|(t, x, how, d)| match how {
        0 => t,
        1 => format!("{t} % {d}"),
        2 => format!("{t} / {d}"),
        3 => format!("{t} + {x}"),
        _ => format!("min({t}, {x} + 4)"),
    })
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 200, 0x5b1_17ca5e))]

    /// Random comparisons split into cases at their `abs` / `min` / `max` terms plan, and
    /// their rows are the pairwise evaluation of the same comparison inside `elementwise`.
    #[test]
    fn comparisons_split_into_cases_equal_elementwise(
        t in split_term(),
        op in prop::sample::select(&["<", "<=", ">", ">=", "==", "!="][..]),
        r in q_side(),
        (q_len, kv_len) in (1i64..40, 1i64..40),
        (bm, bn) in (1u32..9, 1u32..9),
    ) {
        let cmp = format!("{t} {op} {r}");
        let program = compile(&format!("mask = {cmp};"));
        prop_assert!(!program.mask.uses_elementwise(), "{}", cmp);
        let pairwise = compile(&format!("mask = elementwise({cmp});"));
        let s = shape(q_len, kv_len);
        let (a, b) = (program.bind(s, &params(&[])).unwrap(), pairwise.bind(s, &params(&[])).unwrap());
        let tile = TileShape { block_m: bm, block_n: bn };
        match (plan(&a, tile), plan(&b, tile)) {
            (Ok(x), Ok(y)) => {
                for q in 0..q_len as u32 {
                    prop_assert_eq!(row_pairs(&x.masks[0].rows, q), row_pairs(&y.masks[0].rows, q), "{} row {}", cmp, q);
                }
                check_against_brute_force(&program, s, &params(&[]), tile);
            }
            // A division by zero, or an overflow, both ways.
            (Err(x), Err(y)) => prop_assert_eq!(x.code, y.code, "{}", cmp),
            (x, y) => prop_assert!(false, "{}: {:?} vs {:?}", cmp, x.err(), y.err()),
        }
    }
}
