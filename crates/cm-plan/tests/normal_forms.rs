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
use proptest::test_runner::TestCaseError;

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

/// Forms of q-side values whose floor terms cancel or are clamped away, and `k % d == x %
/// d`, with random windows `w`, dilations `d` (negative too) and offsets, at odd lengths
/// with `q_len != kv_len`: each against the pairwise semantics.
const FLOOR_FORMS: &[&str] = &[
    // `d * (q / d) + q % d` is q, in either order and scaled.
    "mask = k >= d * (q / d) + q % d - w & k <= (q / d) * d + q % d;",
    "mask = k <= 2 * (q % d) + 2 * d * (q / d) - w;",
    // A residue of k against a residue of a q-side value: one residue, anchored at it.
    "mask = k % d == q % d & q - w <= k & k <= q + w;",
    "mask = (k + c) % d != (q - c) % d & abs(q - k) <= w;",
    "mask = (q - k) % d == (q + c) % d & k <= q;",
    // NATTEN's window start in global coordinates, the window clamped at both edges.
    "let g = q % d;\nlet s = max(0, min(q / d - w, (q_len - g + d - 1) / d - 2 * w - 1));\n\
     mask = (k - q) % d == 0 & k in g + d * s .. g + d * (s + 2 * w) + 1;",
    "let g = q % d;\nlet lo = max(g, min(q - d * w, g + d * ((q_len - g + d - 1) / d - 2 * w - 1)));\n\
     mask = (k - q) % d == 0 & k in lo .. lo + 2 * d * w + 1;",
    // Clamps whose sides cross inside the rows.
    "mask = k < min(q % d + c, q - w) | k == max(q / d, q - 3 * w);",
];

proptest::proptest! {
    #![proptest_config(cm_testkit::config::env_config(cm_testkit::config::PROPTEST_CASES, 300, 0x1a7e))]

    #[test]
    fn floor_terms_in_normal_form_equal_brute_force(
        form in proptest::sample::select(FLOOR_FORMS),
        w in 0i64..6,
        d in proptest::sample::select(vec![-4i64, -3, -1, 1, 2, 3, 4, 5, 7]),
        c in -9i64..9,
        (q_len, kv_len) in (1i64..90, 1i64..90),
        (bm, bn) in (1u32..17, 1u32..17),
    ) {
        // NATTEN's forms need d > 0 and a window that fits each dilation group.
        let natten = form.contains("q_len - g");
        let d = if natten { d.abs() } else { d };
        let q_len = if natten { q_len.max(d * (2 * w + 1)) } else { q_len };
        let src = format!("param w: int = {w};\nparam d: int = {d};\nparam c: int = {c};\n{form}");
        let program = compile(&src);
        let tile = TileShape { block_m: bm, block_n: bn };
        check_against_brute_force(&program, shape(q_len, kv_len), &params(&[]), tile);
    }
}

/// NATTEN's 1D neighbourhood with dilation, exactly as NATTEN defines it (the Flex mask of
/// `natten/backends/flex.py`, one spatial axis, stride 1, not causal): query `q` and key `k`
/// in the same dilation group (`q % d == k % d`), the group's length `Lg = L // d + 1 -
/// ((g + d - L % d) // d)`, the window centre `q // d` clamped to `[left, Lg - 1 - right]`
/// with `left = K // 2` and `right = K // 2 + K % 2 - 1`, and the key's group index at most
/// `left` before it or `right` after it.
fn natten_visible(q: i64, k: i64, n: i64, kernel: i64, d: i64) -> bool {
    let (qi, ki, g) = (q / d, k / d, q % d);
    let group_len = n / d + 1 - (g + (d - n % d)) / d;
    let (left, right) = (kernel / 2, kernel / 2 + kernel % 2 - 1);
    let center = qi.max(left).min(group_len - 1 - right);
    let (w0, w1) = (center - ki, ki - center);
    ((0..=left).contains(&w0) || (0..=right).contains(&w1)) && g == k % d
}

/// The same neighbourhood in the language, in global coordinates: keys of q's residue from
/// `g + d * s` for `K` steps of `d`, `s` the window's first group index.
const NATTEN_1D: &str = "param K: int = 7;\nparam d: int = 2;\n\
    let g = q % d;\n\
    let n = q_len / d + 1 - (g + d - q_len % d) / d;\n\
    let s = min(max(q / d, K / 2), n - 1 - (K / 2 + K % 2 - 1)) - K / 2;\n\
    mask = (k - q) % d == 0 & k in g + d * s .. g + d * (s + K - 1) + 1;";

#[test]
fn natten_1d_with_dilation_equals_its_definition() {
    let program = compile(NATTEN_1D);
    for (kernel, d) in [(1, 1), (3, 2), (4, 3), (7, 2), (5, 4), (6, 1), (9, 3)] {
        for n in [
            kernel * d,
            kernel * d + 1,
            kernel * d + 7,
            3 * kernel * d + 5,
        ] {
            let values = params(&[("K", Value::Int(kernel)), ("d", Value::Int(d))]);
            let bound = program.bind(shape(n, n), &values).unwrap();
            let p = plan(&bound, TILES[1]).unwrap();
            for q in 0..n {
                let dense: Vec<u32> = (0..n)
                    .filter(|&k| natten_visible(q, k, n, kernel, d))
                    .map(|k| k as u32)
                    .collect();
                let got: Vec<u32> = row_pairs(&p.masks[0].rows, q as u32)
                    .into_iter()
                    .flat_map(|(a, b)| a..b)
                    .collect();
                assert_eq!(got, dense, "K {kernel}, d {d}, n {n}, row {q}");
            }
            check_against_brute_force(&program, shape(n, n), &values, TILES[0]);
        }
    }
}

/// At 131072 rows NATTEN's formulation is one strided run per row in a few pieces for a
/// small kernel (the edges a piece per group index they clamp), not a piece per `d` rows.
#[test]
fn natten_1d_plans_as_strided_runs_in_few_pieces() {
    let n = 131072;
    for (kernel, d, most) in [(7i64, 2i64, 16u64), (13, 4, 32), (1025, 2, 1100)] {
        let values = [("K", Value::Int(kernel)), ("d", Value::Int(d))];
        let got = pieces(NATTEN_1D, n, n, &values);
        assert!(got <= most, "K {kernel}, d {d}: {got} pieces");
    }
    let program = compile(NATTEN_1D);
    let bound = program.bind(shape(n, n), &params(&[])).unwrap();
    let p = plan(&bound, TileShape::default()).unwrap();
    for q in [0i64, 5, 6, 7, 70001, n - 7, n - 1] {
        let got: Vec<u32> = row_pairs(&p.masks[0].rows, q as u32)
            .into_iter()
            .flat_map(|(a, b)| a..b)
            .collect();
        let dense: Vec<u32> = (0..n)
            .filter(|&k| natten_visible(q, k, n, 7, 2))
            .map(|k| k as u32)
            .collect();
        assert_eq!(got, dense, "row {q}");
    }
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

/// `cmp` planned at `q_len` x `kv_len` with `tile`: its rows are those of the same
/// comparison inside `elementwise` (the pairwise evaluation of it as written), and the
/// planner's rows and tiles are those of the brute-force evaluation of its normal form; or
/// both fail with one code (a division by zero, an overflow).
fn equals_elementwise(
    cmp: &str,
    (q_len, kv_len): (i64, i64),
    tile: TileShape,
) -> Result<(), TestCaseError> {
    let program = compile(&format!("mask = {cmp};"));
    prop_assert!(!program.mask.uses_elementwise(), "{}", cmp);
    let pairwise = compile(&format!("mask = elementwise({cmp});"));
    let s = shape(q_len, kv_len);
    let (a, b) = (
        program.bind(s, &params(&[])).unwrap(),
        pairwise.bind(s, &params(&[])).unwrap(),
    );
    match (plan(&a, tile), plan(&b, tile)) {
        (Ok(x), Ok(y)) => {
            for q in 0..q_len as u32 {
                prop_assert_eq!(
                    row_pairs(&x.masks[0].rows, q),
                    row_pairs(&y.masks[0].rows, q),
                    "{} row {} at {} x {}",
                    cmp,
                    q,
                    q_len,
                    kv_len
                );
            }
            check_against_brute_force(&program, s, &params(&[]), tile);
        }
        (Err(x), Err(y)) => prop_assert_eq!(x.code, y.code, "{}", cmp),
        (x, y) => prop_assert!(false, "{}: {:?} vs {:?}", cmp, x.err(), y.err()),
    }
    Ok(())
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
        lengths in (1i64..40, 1i64..40),
        (bm, bn) in (1u32..9, 1u32..9),
    ) {
        let cmp = format!("{t} {op} {r}");
        equals_elementwise(&cmp, lengths, TileShape { block_m: bm, block_n: bn })?;
    }
}

/// A term of `abs` / `min` / `max` nested in each other, 3 or 4 of them in all, over linear
/// and q-side terms: a `min` / `max` of 2 to 4 arguments (written `min(a, b, c)` or nested
/// `min(min(a, b), c)`), `abs` of any term, differences of them.
fn nested_term() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![3 => linear(), 1 => q_side()];
    leaf.prop_recursive(4, 12, 4, |inner| {
        prop_oneof![
            inner.clone().prop_map(|a| format!("abs({a})")),
            (
                prop::sample::select(&["min", "max"][..]),
                prop::collection::vec(inner.clone(), 2..=4),
                prop::bool::ANY,
            )
                .prop_map(|(f, xs, flat)| if flat {
                    format!("{f}({})", xs.join(", "))
                } else {
                    xs[1..]
                        .iter()
                        .fold(xs[0].clone(), |acc, x| format!("{f}({acc}, {x})"))
                }),
            (inner.clone(), inner).prop_map(|(a, b)| format!("({a} - {b})")),
        ]
    })
    .prop_filter("3 or 4 `abs` / `min` / `max` terms", |t| {
        let terms =
            t.matches("abs(").count() + t.matches("min(").count() + t.matches("max(").count();
        (3..=4).contains(&terms)
    })
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 300, 0x4e57_ed01))]

    /// Nested `abs` / `min` / `max` of 3 or 4 terms, alone or inside `%`, `/` or a sum,
    /// compared either way round with a q-side value: planned exactly, at odd lengths and
    /// `q_len != kv_len`, as their pairwise evaluation.
    #[test]
    fn nested_abs_min_max_equal_elementwise(
        t in nested_term(),
        how in 0u8..5,
        d in 2i64..6,
        x in linear(),
        op in prop::sample::select(&["<", "<=", ">", ">=", "==", "!="][..]),
        r in q_side(),
        flip in prop::bool::ANY,
        lengths in (1i64..48, 1i64..48),
        (bm, bn) in (1u32..9, 1u32..9),
    ) {
        // A residue is compared by `==` / `!=` only: its cases may scale `k` (`(k - q) -
        // (q - k)` is `2 * k - 2 * q`), and `(2 * k + f(q)) % d < r` is no solvable form.
        let (t, op) = match how {
            0 | 1 => (t, op),
            2 => (
                format!("{t} % {d}"),
                if matches!(op, "==" | "!=") { op } else { "==" },
            ),
            3 => (format!("{t} / {d}"), op),
            _ => (format!("{t} + {x}"), op),
        };
        let cmp = if flip { format!("{r} {op} {t}") } else { format!("{t} {op} {r}") };
        equals_elementwise(&cmp, lengths, TileShape { block_m: bm, block_n: bn })?;
    }
}

/// The reported forms (a `min` of three `abs` was CM0207, "not linear in `k`": no more than
/// 4 terms were split, 2 cases each) and nests of 3 and 4 terms like them, at odd lengths and
/// `q_len != kv_len` (tiles of 16 x 16 and 7 x 5).
#[test]
fn nested_abs_min_max_of_three_and_four_terms_equal_elementwise() {
    let forms = [
        "min(abs(k-q), abs(k-q+1), abs(k-q+2)) < 3",
        "min(min(abs(k-q),abs(k-q+1)),abs(k-q+2)) < 3",
        "min(abs(k-q), abs(k-q+1), 5) < 3",
        "abs(abs(k-q)-3) < 2",
        "min(abs(k - q), abs(k - q + 1), abs(k - q + 2)) % 3 == 1",
        "min(abs(k - q), abs(k - q - 4), abs(k - q + 5), abs(2 * q - k)) == 2",
        "max(min(abs(k - q), abs(k - q - 3)), min(abs(k - q + 1), k - 2)) % 4 == 1",
        "max(min(k, q - 2), min(abs(k - q), q - k + 5)) / 3 != 1",
        "abs(min(k, q) - max(k - 3, q / 2)) % 3 != 0",
        "abs(abs(abs(k - q) - 3) - 2) % 2 == 0",
        "min(k, q, 5) + max(k - q, 2, q - 3) < q",
        "q - min(k, 2 * q - k, 4) > max(k - 8, 1)",
        "abs(max(k - q, q - 7 - k, 2 - k) - min(k, 3)) <= 4",
        "max(abs(k - q) - 2, abs(k - 2 * q) - 6, abs(k + q - 20)) >= 5",
    ];
    for cmp in forms {
        for lengths in [(1, 1), (7, 7), (13, 9), (20, 31), (37, 37), (61, 44)] {
            for tile in TILES {
                equals_elementwise(cmp, lengths, *tile)
                    .unwrap_or_else(|e| panic!("{cmp} at {lengths:?}: {e}"));
            }
        }
    }
}
