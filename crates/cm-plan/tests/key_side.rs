//! Key-side structure: functions of the key alone (`arr[k]`, `doc.index(k)`, `doc(k).start`,
//! `k * k`) compared with q-side values, and FlashMask's column form (each key's visible rows
//! as ranges, `q in lo[k] .. hi[k]`), planned by sorting the keys once per (batch, head):
//! rows and tiles against the pairwise semantics over random arrays and odd shapes, errors
//! of a key's value only where the reference reaches that key, and the cost.

#[allow(dead_code)]
mod common;
use cm_ir::{Shape, Value};
use cm_plan::plan::row_intervals;
use cm_plan::symbolic::Solver;
use cm_plan::{plan, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;

/// Masks over the arrays `lo`, `hi` (one entry per key, cycled) and a segmentation `doc`.
const MASKS: &[&str] = &[
    // FlashMask's column form: key k is visible to rows [lo[k], hi[k]).
    "mask = q in lo[k % count(lo)] .. hi[k % count(hi)];",
    // Causal with per-key masked rows (FlashMask's lower-triangle start / end indices).
    "mask = k <= q & !(q in lo[k % count(lo)] .. hi[k % count(hi)]);",
    // Per-key thresholds (heavy-hitter / eviction: key k leaves the cache at row hi[k]).
    "mask = k <= q & q < hi[k % count(hi)];",
    // Document masks written per key.
    "mask = doc.index(k) == doc.index(min(q, kv_len - 1)) & k <= q;",
    "mask = doc(k).start <= q & q < doc(k).end;",
    "mask = k in doc.head(k) | k <= q & doc.index(k) + 1 >= doc.index(min(q, kv_len - 1));",
    // A function of k alone, with terms on both sides.
    "mask = k * k / 5 + lo[k % count(lo)] < 2 * q + 3 - k;",
];

fn source(mask: &str, lo: &[i64], hi: &[i64], docs: &[i64]) -> String {
    let list = |v: &[i64]| {
        let items: Vec<String> = v.iter().map(i64::to_string).collect();
        format!("[{}]", items.join(", "))
    };
    format!(
        "param lo: [int] = {};\nparam hi: [int] = {};\nsegments doc = {} fill kv_len;\n\
         part doc.head = 0 .. 2;\n{mask}",
        list(lo),
        list(hi),
        list(docs)
    )
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 300, 0x4e75))]

    #[test]
    fn key_side_atoms_equal_brute_force(
        mask in proptest::sample::select(MASKS),
        lo in proptest::collection::vec(-5i64..60, 1..40),
        hi in proptest::collection::vec(-5i64..60, 1..40),
        docs in proptest::collection::vec(1i64..15, 1..6),
        (q_len, kv_len) in (1i64..60, 1i64..60),
        (bm, bn) in (1u32..20, 1u32..20),
    ) {
        let src = source(mask, &lo, &hi, &docs);
        let program = compile(&src);
        let tile = TileShape { block_m: bm, block_n: bn };
        check_against_brute_force(&program, shape(q_len, kv_len), &params(&[]), tile);
    }
}

/// Masks over per-key arrays made of runs of affine values (`sloped` runs of the solver:
/// rising, falling and constant runs of random lengths, as FlashMask's causal and window
/// bounds are), compared with thresholds that rise, fall and stay, and for equality.
const SLOPED_MASKS: &[&str] = &[
    "mask = q in lo[k % count(lo)] .. hi[k % count(hi)];",
    "mask = k <= q & !(q in lo[k % count(lo)] .. hi[k % count(hi)]);",
    "mask = lo[k % count(lo)] > 2 * q - 40;",
    "mask = lo[k % count(lo)] >= 90 - q;",
    "mask = lo[k % count(lo)] == q | hi[k % count(hi)] == 17;",
    "mask = lo[k % count(lo)] != q + 1 & k < 3 * q;",
    "mask = hi[k % count(hi)] - lo[k % count(lo)] <= q / 3 - 10;",
];

/// An array of `runs` (slope, first value, length) laid end to end.
fn affine_runs(runs: &[(i64, i64, usize)]) -> Vec<i64> {
    runs.iter()
        .flat_map(|&(s, v, n)| (0..n as i64).map(move |i| v + s * i))
        .collect()
}

fn runs_strategy() -> impl Strategy<Value = Vec<(i64, i64, usize)>> {
    proptest::collection::vec((-3i64..=3, -20i64..150, 1usize..45), 1..6)
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 300, 0x51ed))]

    #[test]
    fn sloped_runs_of_key_values_equal_brute_force(
        mask in proptest::sample::select(SLOPED_MASKS),
        lo in runs_strategy(),
        hi in runs_strategy(),
        (q_len, kv_len) in (1i64..140, 1i64..140),
        (bm, bn) in (1u32..20, 1u32..20),
    ) {
        let src = source(mask, &affine_runs(&lo), &affine_runs(&hi), &[5]);
        let program = compile(&src);
        let tile = TileShape { block_m: bm, block_n: bn };
        check_against_brute_force(&program, shape(q_len, kv_len), &params(&[]), tile);
    }
}

/// FlashMask's column forms whose bounds run affinely in `k` plan in a few pieces at 131072
/// keys, not one per row: causal given as upper-triangle bounds (`uts = 0`, `ute = k`), and
/// a causal sliding window of 4096 as lower-triangle starts (`lts = k + 4096` up to the last
/// row, with `causal = 1`); rows checked against the closed form.
#[test]
fn affine_column_bounds_plan_in_few_pieces() {
    let n = 131072i64;
    let flashmask = builtin("flashmask");
    let shape = Shape {
        q_len: n,
        kv_len: n,
        batch: 1,
        num_heads: 1,
    };
    let arr = |f: &dyn Fn(i64) -> i64| Value::Array((0..n).map(f).collect::<Vec<_>>().into());
    // The parameters, the key-side atoms they leave (`q in uts[k] .. ute[k]` is two), and
    // row q's one interval.
    type Case = (Vec<(&'static str, Value)>, u64, fn(u32) -> (u32, u32));
    let cases: [Case; 2] = [
        (vec![("uts", arr(&|_| 0)), ("ute", arr(&|k| k))], 2, |q| {
            (0, q + 1)
        }),
        (
            vec![
                ("causal", Value::Int(1)),
                ("lts", arr(&|k| (k + 4096).min(n))),
            ],
            1,
            |q| (q.saturating_sub(4095), q + 1),
        ),
    ];
    for (values, atoms, row) in cases {
        let bound = flashmask.bind(shape, &params(&values)).unwrap();
        let solver = Solver::new(&bound);
        let mut pieces = 0;
        let rows = row_intervals(&solver, 0, 0, &mut pieces).unwrap();
        // The cost: a few pieces of rows (kept key by key, the keys' set would change, and
        // end a piece, at every row), and each atom's bound read once at every key (not
        // once per piece).
        assert!(pieces <= 8, "{pieces} pieces");
        let evals = solver.key_evals.get();
        assert!(
            evals <= atoms * n as u64,
            "{evals} key values for {atoms} atoms"
        );
        for q in [0u32, 1, 4095, 4096, 70001, n as u32 - 1] {
            let (a, b) = row(q);
            assert_eq!(row_pairs(&rows, q), vec![(a, b)], "row {q}");
        }
    }
}

/// A key whose value fails (an index past the array) fails the plan exactly when the
/// reference reaches it: not when `&` or the hull of its context excludes it.
#[test]
fn a_failing_key_fails_only_where_reached() {
    let tile = TileShape {
        block_m: 4,
        block_n: 4,
    };
    let program = compile("param a: [int] = [3, 1, 4, 1, 5];\nmask = k < 5 & a[k] <= q;");
    check_against_brute_force(&program, shape(9, 12), &params(&[]), tile);
    let program = compile("param a: [int] = [3, 1, 4, 1, 5];\nmask = a[k] <= q;");
    let bound = program.bind(shape(9, 12), &params(&[])).unwrap();
    assert!(bound.brute_force_row(0, 0, 0).is_err());
    let err = plan(&bound, tile).unwrap_err();
    assert_eq!(err.code.as_str(), "CM0304", "{err}");
}

/// FlashMask's causal document mask in column form at 131072 keys: every key visible from
/// its own row to the end of its document (`k <= q & q < ends[k]`), 128 documents: a piece
/// per document, each key's bound read once.
#[test]
fn column_form_plans_in_pieces_per_document() {
    let n = 131072i64;
    let ends: Vec<i64> = (0..n).map(|k| (k / 1024 + 1) * 1024).collect();
    let program = compile("param ends: [int];\nmask = k <= q & q < ends[k];");
    let values = params(&[("ends", Value::Array(ends.into()))]);
    let shape = Shape {
        q_len: n,
        kv_len: n,
        batch: 1,
        num_heads: 1,
    };
    let bound = program.bind(shape, &values).unwrap();
    let solver = Solver::new(&bound);
    let mut pieces = 0;
    let rows = row_intervals(&solver, 0, 0, &mut pieces).unwrap();
    // The cost: pieces per document, and `ends[k]` read once at every key, not once per
    // piece (which would be 128 times as many).
    assert!(pieces <= 2 * 128 + 2, "{pieces} pieces");
    let evals = solver.key_evals.get();
    assert!(evals <= n as u64, "{evals} key values");
    for q in [0u32, 1023, 1024, 70000, n as u32 - 1] {
        let got = row_pairs(&rows, q);
        let start = q / 1024 * 1024;
        assert_eq!(got, vec![(start, q + 1)], "row {q}");
    }
}
