//! `any` / `all` over the entries of integer arrays, planned analytically: random arrays
//! (empty, unsorted, repeated, out of the keys), odd and unequal lengths, against the
//! pairwise semantics (rows, tile classes, and errors exactly where it errs); and the cost:
//! a term that reads no `q` is solved once, a piece costs one pass over the terms; a range
//! that reads `q` costs runs of the variable per row, not terms per row (the masks of
//! [`RUNS`] against brute force, a 128K-row check, and the bound on terms).

#[allow(dead_code)]
mod common;
use cm_ir::Shape;
use cm_plan::plan::row_intervals;
use cm_plan::symbolic::Solver;
use cm_plan::{plan, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;

/// The gallery's masks written with `any` / `all` (each reads the arrays `g` and `s`).
const MASKS: &[&str] = &[
    // Global tokens in a sliding window (Longformer / BigBird's global part).
    "mask = q - w < k <= q | any i in 0 .. count(g): k == g[i] | q == g[i];",
    // Sinks at given positions, causal.
    "mask = (q - w < k | any i in 0 .. count(g): k == g[i]) & k <= q;",
    // Slice lists (MagiAttention): slice i is queries [s[2i], s[2i+1]) x keys [g[i], g[i] + w).
    "mask = any i in 0 .. min(count(s) / 2, count(g)): q in s[2 * i] .. s[2 * i + 1] & k in g[i] .. g[i] + w;",
    // Media spans (Flamingo-like): rows see their own span's keys and everything before it.
    "mask = k <= q & any i in 0 .. count(g): k < g[i] | q < g[i] + w & k >= g[i];",
    // An intersection: keys allowed by every window around the listed anchors.
    "mask = all i in 0 .. count(g): abs(k - g[i]) <= w + q % 3;",
    // Nested, with a range that depends on q.
    "mask = any i in 0 .. q % 4: any j in 0 .. count(g): k == g[j] + i;",
    // A row-predicate body only.
    "mask = any i in 0 .. count(g): q == g[i] | q - 1 == g[i];",
];

/// Quantifiers whose range reads `q`, so every row is a piece, solved in runs of the
/// variable: bodies affine in it (families that meet, single keys every few keys, members
/// that do not meet, decreasing ones), bodies that change at every value (array entries,
/// `3 * k == i`), residues, `elementwise`, nesting (an inner range that reads the outer
/// variable), `all` (the complement of the union of complements), values whose keys fall
/// outside `[0, kv_len)`, and errors at some values only.
const RUNS: &[&str] = &[
    "mask = any i in 0 .. q + 1: k == i;",
    "mask = any i in q - w .. q + 2: k == 2 * i - q;",
    "mask = any i in 0 .. q / 3 + 1: k in 3 * i .. 3 * i + 2;",
    "mask = any i in -2 .. q - 5: k == q - 3 * i | k == w;",
    "mask = any i in 0 .. q: 3 * k == i;",
    "mask = any i in 0 .. q % 9: k == g[i % max(count(g), 1)] + i;",
    "mask = any i in 0 .. q + 1: (k - i) % 5 == 0 & k < i + w;",
    "mask = any i in 0 .. q % 3 + 1: elementwise(k * k <= q + i);",
    "mask = any i in 0 .. q % 4 + 2: any j in i .. q + 1: k == 2 * j + i;",
    "mask = any i in 0 .. 3: any j in 0 .. q + i: k == j * 7 + i | k > q + 50;",
    "mask = all i in 0 .. q + 1: k != i;",
    "mask = all i in 0 .. q % 5 + 1: k != q - i & k >= i - w;",
    "mask = all i in w .. q: abs(k - i) >= 2 | k > q;",
    "mask = all i in 0 .. q + 1: k / 2 != i / 3;",
    "mask = all i in 0 .. q % 6: any j in 0 .. i + 1: k >= 2 * j & k <= 2 * j + i;",
    "mask = any i in 0 .. q + 1: k == 100 / (i - 3) + 10;",
    "mask = k < 5 | all i in 0 .. q + 1: k >= g[i] - 100;",
];

fn source(mask: &str, g: &[i64], s: &[i64], w: i64) -> String {
    let list = |v: &[i64]| {
        let items: Vec<String> = v.iter().map(i64::to_string).collect();
        format!("[{}]", items.join(", "))
    };
    format!(
        "param g: [int] = {};\nparam s: [int] = {};\nparam w: int = {w};\n{mask}",
        list(g),
        list(s)
    )
}

fn check(src: &str, q_len: i64, kv_len: i64, tile: TileShape) -> Result<(), TestCaseError> {
    let program = compile(src);
    let shape = Shape {
        q_len,
        kv_len,
        batch: 1,
        num_heads: 1,
    };
    let bound = program.bind(shape, &params(&[])).unwrap();
    let reference: Result<Vec<_>, _> = (0..q_len).map(|q| bound.brute_force_row(q, 0, 0)).collect();
    match (reference, plan(&bound, tile)) {
        (Ok(_), Ok(_)) => {
            check_against_brute_force(&program, shape, &params(&[]), tile);
        }
        (Err(_), Err(_)) => {}
        (Ok(_), Err(e)) => prop_assert!(false, "plan failed, reference did not: {e}\n{src}"),
        (Err(e), Ok(_)) => prop_assert!(false, "reference failed, plan did not: {e}\n{src}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 300, 0x0a11_a11a))]

    #[test]
    fn quantifiers_equal_brute_force(
        mask in proptest::sample::select(MASKS),
        g in proptest::collection::vec(-3i64..80, 0..9),
        s in proptest::collection::vec(-3i64..80, 0..12),
        w in 0i64..9,
        (q_len, kv_len) in (1i64..70, 1i64..70),
        (bm, bn) in (1u32..20, 1u32..20),
    ) {
        let tile = TileShape { block_m: bm, block_n: bn };
        check(&source(mask, &g, &s, w), q_len, kv_len, tile)?;
    }
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 300, 0x0a11_2a25))]

    #[test]
    fn ranges_that_read_q_equal_brute_force(
        mask in proptest::sample::select(RUNS),
        g in proptest::collection::vec(-3i64..80, 0..9),
        w in 0i64..9,
        (q_len, kv_len) in (1i64..80, 1i64..80),
        (bm, bn) in (1u32..20, 1u32..20),
    ) {
        let tile = TileShape { block_m: bm, block_n: bn };
        check(&source(mask, &g, &[], w), q_len, kv_len, tile)?;
    }
}

/// A range that reads `q` (every row its own piece) with a body affine in the variable:
/// one run of the variable per row, so 131072 rows cost about one term each (the solver's
/// count of terms, at most 2 a row), not the rows x terms (2^28 to 2^33 here) of solving
/// term by term; sampled rows against their closed forms (brute force of a row would
/// evaluate thousands of terms at each of 131072 keys).
#[test]
fn a_range_that_reads_q_costs_runs_not_terms() {
    type Keys = fn(i64) -> Vec<(u32, u32)>;
    let cases: [(&str, Keys); 3] = [
        ("mask = any i in 0 .. q + 1: k == i;", |q| {
            vec![(0, q as u32 + 1)]
        }),
        (
            "mask = all i in q - 4096 .. q + 1: k >= i - 4096 & k <= q;",
            |q| vec![((q - 4096).max(0) as u32, q as u32 + 1)],
        ),
        ("mask = any i in q - 2048 .. q + 1: k == 2 * i - q;", |q| {
            (q - 4096..=q)
                .step_by(2)
                .filter(|&k| k >= 0)
                .map(|k| (k as u32, k as u32 + 1))
                .collect()
        }),
    ];
    for (mask, keys) in cases {
        let program = compile(mask);
        let n = 131072;
        let bound = program.bind(shape(n, n), &params(&[])).unwrap();
        let solver = Solver::new(&bound);
        let rows = row_intervals(&solver, 0, 0, &mut 0).unwrap();
        for q in [0, 1, 4095, 4096, 65537, n - 1] {
            assert_eq!(row_pairs(&rows, q as u32), keys(q), "{mask} row {q}");
        }
        // Measured: 131072, 141747 and 143789 terms; term by term would be 8.6e9, 5.4e8
        // and 2.7e8 (and stop at the limit, CM0404).
        let terms = solver.quant_evals.get();
        assert!(terms <= 2 * n as u64, "{mask}: {terms} terms for {n} rows");
    }
}

/// Past its limit of terms a solver stops with CM0404 at the quantifier, naming the limit
/// (here a small one, so the test need not evaluate [`cm_plan::symbolic::MAX_QUANT_EVALS`]
/// terms): a range that reads `q` over a body that changes at every value (an array entry)
/// costs about rows x terms; under a limit the same rows are exact.
#[test]
fn terms_past_the_limit_are_an_error_naming_it() {
    let n = 1024i64;
    let g: Vec<i64> = (0..n).map(|i| (i * 7919) % n).collect();
    let src = source("mask = any i in 0 .. q + 1: k == g[i];", &g, &[], 0);
    let program = compile(&src);
    let bound = program.bind(shape(n, n), &params(&[])).unwrap();
    let limit = 1 << 16;
    let solver = Solver::new(&bound).with_quant_limit(limit);
    let e = row_intervals(&solver, 0, 0, &mut 0).unwrap_err();
    assert_eq!(e.code, "CM0404", "{e}");
    assert!(
        e.message.contains(&format!("more than {limit} terms")),
        "{e}"
    );
    let span = e.span.expect("the quantifier's span");
    assert!(src[span.start as usize..].starts_with("any i in"), "{e}");
    // Rows x terms is about n^2 / 2 values at about 1.5 evaluations each.
    let solver = Solver::new(&bound).with_quant_limit(n as u64 * n as u64);
    let rows = row_intervals(&solver, 0, 0, &mut 0).unwrap();
    assert!(
        solver.quant_evals.get() > limit,
        "{}",
        solver.quant_evals.get()
    );
    for q in 0..n {
        assert_eq!(
            row_pairs(&rows, q as u32),
            bound.brute_force_row(q, 0, 0).unwrap()
        );
    }
}

/// Errors inside a term (an index past the array) are reported exactly where the
/// reference reports one: `any` evaluates every term, `all` stops at an empty one.
#[test]
fn errors_inside_terms_follow_the_reference() {
    let tile = TileShape {
        block_m: 4,
        block_n: 4,
    };
    for mask in [
        "mask = any i in 0 .. count(g) + 1: k == g[i];",
        "mask = all i in 0 .. count(g) + 1: k >= g[i] - 100;",
        "mask = all i in 0 .. count(g) + 1: k < g[min(i, 0)] - 100 | k == g[i];",
        "mask = k < 0 & any i in 0 .. 5: k == g[i];",
    ] {
        for g in [&[][..], &[3], &[3, 90, 1]] {
            check(&source(mask, g, &[], 2), 9, 11, tile).unwrap();
        }
    }
}

/// 64 global tokens in a 4096 sliding window at 131072 rows: planned in a few
/// pieces per global token, each evaluation of a piece a pass over the 64 terms (the
/// solver's count of terms), not a pass per row (131072 x 64 terms).
#[test]
fn global_tokens_plan_in_pieces_per_token() {
    let g: Vec<i64> = (0..64).map(|i| i * 2039 + 17).collect();
    let src = source(MASKS[0], &g, &[], 4096);
    let program = compile(&src);
    let n = 131072;
    let bound = program.bind(shape(n, n), &params(&[])).unwrap();
    let solver = Solver::new(&bound);
    let mut pieces = 0;
    let rows = row_intervals(&solver, 0, 0, &mut pieces).unwrap();
    assert!(pieces <= 8 * 64 + 8, "{pieces} pieces");
    // Measured: 319 pieces, 48769 terms (a piece is evaluated again where it splits).
    let terms = solver.quant_evals.get();
    assert!(
        terms <= 3 * 64 * pieces,
        "{terms} terms for {pieces} pieces"
    );
    assert_eq!(solver.elementwise_pairs.get(), 0);
    // Row 100000 sees its window and the 64 global keys (none inside the window here).
    let row = row_pairs(&rows, 100_000);
    assert_eq!(row, bound.brute_force_row(100_000, 0, 0).unwrap());
}
