//! `elementwise` evaluated where the surrounding regions leave the answer open: on the
//! right of `&` and `-`, at the left side's keys alone (not their hull); rows in blocks on
//! several threads from 1024 rows, with the reference's error (the first failing row, the
//! smallest failing key) whichever block finishes first; the pairs counted. Against the
//! pairwise semantics.

#[allow(dead_code)]
mod common;
use cm_ir::Shape;
use cm_plan::{plan, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;

/// Predicates no solvable form covers, behind left sides of one or several intervals.
const MASKS: &[&str] = &[
    "mask = q - w < k <= q & elementwise((k * k + q) % 7 < 3);",
    "mask = (k < c | q - w < k <= q) & elementwise((k * q + k) % 5 != 1);",
    "mask = (k < c | k > q + 2) - elementwise(k * k % (q + 2) == 0);",
    "mask = elementwise((q * k) % 3 == 0) | k == q;",
    "mask = if q % 2 == 0 then k <= q & elementwise(k * k * q % 11 < 5) else k < c;",
];

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 150, 0xe1e_e1e))]

    #[test]
    fn elementwise_equals_brute_force(
        mask in proptest::sample::select(MASKS),
        w in 1i64..30,
        c in 0i64..20,
        q_len in 1i64..60,
        kv_len in 1i64..60,
    ) {
        let src = format!("param w: int = {w};\nparam c: int = {c};\n{mask}");
        let program = compile(&src);
        let tile = TileShape { block_m: 8, block_n: 8 };
        check_against_brute_force(&program, shape(q_len, kv_len), &params(&[]), tile);
    }
}

/// Long rows give the same keys, and count every pair of the left side's keys only.
#[test]
fn long_rows_in_parallel_chunks() {
    let program = compile("mask = (k < 3000 | k >= 9000) & elementwise((k * k + q) % 7 < 3);");
    let s = Shape {
        q_len: 3,
        kv_len: 20000,
        batch: 1,
        num_heads: 1,
    };
    let p = check_against_brute_force(&program, s, &params(&[]), TileShape::default());
    assert_eq!(p.elementwise_pairs, 3 * (3000 + 11000));
}

/// Two failing keys in different chunks of one row: the error is the smaller key's, as the
/// reference meets it first.
#[test]
fn the_first_failing_key_decides_the_error() {
    let program = compile(
        "param a: [int] = [1, 2, 3];\n\
         mask = k >= 0 & elementwise(k == 15000 & 1 / (k - 15000) == 0 | k == 5000 & a[k] == 0);",
    );
    let bound = program.bind(shape(2, 20000), &params(&[])).unwrap();
    let reference = bound.brute_force_row(0, 0, 0).unwrap_err();
    let e = plan(&bound, TileShape::default()).unwrap_err();
    assert_eq!(e.code, reference.code);
    assert!(e.message.contains("index 5000"), "{}", e.message);
}

/// From 1024 rows a mask with `elementwise` is solved in blocks of rows on several threads:
/// the same rows and tiles, every row a piece, the pairs of every block counted.
#[test]
fn row_blocks_on_several_threads() {
    let program =
        compile("mask = (k < 5 | q - 20 < k <= q) & elementwise((k * k + q) % 7 < 3) | k == q;");
    let s = shape(2000, 50);
    let p = check_against_brute_force(&program, s, &params(&[]), TileShape::default());
    let want: u64 = (0..2000i64)
        .map(|q| {
            (0..50i64)
                .filter(|&k| k < 5 || (q - 20 < k && k <= q))
                .count() as u64
        })
        .sum();
    assert_eq!(p.elementwise_pairs, want);
}

/// Two failing rows in different blocks: the error is the first row's, as the sequential
/// reference meets it first, whichever block finishes first.
#[test]
fn the_first_failing_row_decides_the_error_across_blocks() {
    let program = compile(
        "param a: [int] = [1, 2, 3];\n\
         mask = k >= 0 & elementwise(q == 1900 & a[k + 10] == 0 | q == 1700 & 1 / (k - k) == 0);",
    );
    let bound = program.bind(shape(2000, 30), &params(&[])).unwrap();
    for _ in 0..5 {
        let e = plan(&bound, TileShape::default()).unwrap_err();
        assert_eq!(e.code, cm_syntax::Code::DivisionByZero);
        assert!(e.message.contains("row q = 1700"), "{}", e.message);
    }
}
