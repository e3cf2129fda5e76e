//! `elementwise` evaluated where the surrounding regions leave the answer open: on the
//! right of `&` and `-`, at the left side's keys alone (not their hull); rows in blocks on
//! several threads from 1024 rows, with the reference's error (the first failing row, the
//! smallest failing key) whichever block finishes first; the pairs counted, and counted
//! up front (before any is evaluated) for a mask with one `elementwise`, so a plan past the
//! limit fails at once. Against the pairwise semantics.

#[allow(dead_code)]
mod common;
use cm_ir::Shape;
use cm_plan::symbolic::MAX_ELEMENTWISE_PAIRS;
use cm_plan::{elementwise_pairs_up_front, plan, TileShape};
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
    // Predicates that cannot fail, where the regions around them decide some keys.
    "mask = elementwise((k * k + q) % 7 < 3) & q - w < k <= q;",
    "mask = (k < c | q - w < k <= q) | elementwise((k * q + k) % 5 == 1);",
    "mask = elementwise(k * k % 11 < 4) | k <= q;",
    "mask = elementwise((q + k) % 3 == 0) - (q - w < k <= q);",
    "mask = k == c | elementwise(k % 4 == q % 4) | k == q | k > q + w;",
    "mask = elementwise(k % 3 == 0) | elementwise(k % 5 == q % 5);",
    "mask = if q % 3 == 1 then elementwise(k * q % 4 == 1) else k < c | elementwise(k % 2 == 0);",
    // Predicates that may fail (a zero divisor): evaluated at every key the reference does.
    "mask = k <= q | elementwise(k * k % (q - c) < 3);",
    "mask = elementwise(k / (q - c) < 2) & q - w < k <= q;",
    "mask = elementwise(1 / (k - q + c) == 0) - (k < c);",
    // Strided left sides: evaluated at the runs' keys, not their spans (a zero divisor at
    // an even key, which the odd-key run never holds).
    "mask = k % 2 == 1 & k < 30 & elementwise(q / (k - 2 * c) < 2);",
    "mask = q - w < k <= q & (q - k) % 2 == 1 & elementwise(q / (k - q + 2) < 2);",
    "mask = (k % 3 == 0 & k < q + w) - elementwise(q / (k - 3 * c - 1) < 1);",
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
        check_or_same_error(&program, shape(q_len, kv_len), tile);
        check_counted_up_front(&program, mask, shape(q_len, kv_len));
    }
}

/// The count made before planning is the plan's own count of evaluated pairs for a mask
/// with one `elementwise`; none is made for one with two.
fn check_counted_up_front(program: &cm_ir::Program, mask: &str, s: Shape) {
    let bound = program.bind(s, &params(&[])).unwrap();
    let counted = elementwise_pairs_up_front(&bound, 0, 0, 0..s.q_len);
    let lone = mask.matches("elementwise").count() == 1;
    if let Ok(p) = plan(&bound, TileShape::default()) {
        assert_eq!(counted, lone.then_some(p.elementwise_pairs), "{mask}");
    }
}

/// Past the pair limit a plan fails before evaluating any pair, naming the count: every
/// pair for a bare `elementwise`, the band's pairs behind a band (counted independently),
/// the rows of a row range alone; just under the limit the same mask plans.
#[test]
fn the_pair_limit_is_checked_up_front() {
    let pred = "elementwise((q * 7 + k * 3) % 11 < 5)";
    let band = |n: i64, w: i64| -> u64 { (0..n).map(|q| (q + 1).min(w) as u64).sum() };
    let cases = [
        (format!("mask = {pred};"), 32768i64, (32768u64 * 32768)),
        (
            format!("mask = q - 9000 < k <= q & {pred};"),
            40000,
            band(40000, 9000),
        ),
        (
            format!("mask = {pred} & q - 9000 < k <= q;"),
            40000,
            band(40000, 9000),
        ),
    ];
    for (src, n, want) in cases {
        assert!(want > MAX_ELEMENTWISE_PAIRS, "{src}");
        let program = compile(&src);
        let bound = program.bind(shape(n, n), &params(&[])).unwrap();
        let e = plan(&bound, TileShape::default()).unwrap_err();
        assert_eq!(e.code, "CM0404", "{e}");
        // The error of the count made before any pair is evaluated: it names the exact
        // count. The limit met while evaluating pairs (after up to the limit's pairs) can
        // only say "more than" the limit.
        assert!(
            e.message
                .contains(&format!("would evaluate {want} (q, k) pairs one by one"))
                && e.message.contains(&MAX_ELEMENTWISE_PAIRS.to_string()),
            "{src}: {e}"
        );
        let span = e.span.expect("the elementwise");
        assert!(
            src[span.start as usize..].starts_with("elementwise("),
            "{src}"
        );
    }
    // Rows 0..8192 of the banded mask alone: under the limit, counted exactly.
    let program = compile(&format!("mask = q - 9000 < k <= q & {pred};"));
    let bound = program.bind(shape(40000, 40000), &params(&[])).unwrap();
    let counted = elementwise_pairs_up_front(&bound, 0, 0, 20000..20100);
    assert_eq!(counted, Some(100 * 9000));
}

/// Plans `program`: rows and tiles equal brute force, or, where the reference fails, the
/// plan fails with the same code.
fn check_or_same_error(program: &cm_ir::Program, s: Shape, tile: TileShape) {
    let bound = program.bind(s, &params(&[])).unwrap();
    let reference: Result<Vec<_>, _> = (0..s.q_len)
        .map(|q| bound.brute_force_row(q, 0, 0))
        .collect();
    match reference {
        Ok(_) => {
            check_against_brute_force(program, s, &params(&[]), tile);
        }
        Err(want) => {
            let got = plan(&bound, tile).expect_err("the reference fails, the plan must too");
            assert_eq!(got.code, want.code, "{got} vs {want}");
        }
    }
}

/// The pairs a plan evaluates one by one: only where the regions around the predicate
/// leave the answer open when it cannot fail, every key the reference evaluates when it
/// may; counted independently from the analytic side's rows.
#[test]
fn pairs_counted_only_where_the_answer_is_open() {
    let (q_len, kv_len, w, c) = (300i64, 257i64, 40i64, 9i64);
    let band = |q: i64, k: i64| q - w < k && k <= q;
    let count = |keep: &dyn Fn(i64, i64) -> bool| -> u64 {
        (0..q_len)
            .map(|q| (0..kv_len).filter(|&k| keep(q, k)).count() as u64)
            .sum()
    };
    let all = (q_len * kv_len) as u64;
    let cases: Vec<(&str, u64)> = vec![
        // On the right of `&` (as before) and now on its left: the band's keys only.
        (
            "mask = q - w < k <= q & elementwise((k * k + q) % 13 < 6);",
            count(&band),
        ),
        (
            "mask = elementwise((k * k + q) % 13 < 6) & q - w < k <= q;",
            count(&band),
        ),
        // `|`: the keys the other side leaves out.
        (
            "mask = (k < c | q - w < k <= q) | elementwise((k * q + k) % 5 == 1);",
            all - count(&|q, k| k < c || band(q, k)),
        ),
        (
            "mask = elementwise(k * k % 11 < 4) | k <= q;",
            all - count(&|q, k| k <= q),
        ),
        (
            "mask = k == c | elementwise(k % 4 == q % 4) | k == q;",
            all - count(&|q, k| k == c || k == q),
        ),
        // `-` with the predicate on the left: the keys outside the right side.
        (
            "mask = elementwise((q + k) % 3 == 0) - (q - w < k <= q);",
            all - count(&band),
        ),
        // A predicate that may fail (an array lookup is not analysed) keeps the reference's
        // evaluation: every key on both sides of `|`, every key on the left of `&`.
        ("mask = k <= q | elementwise(a[k % 3] == 1);", all),
        ("mask = elementwise(a[k % 3] == 1) & q - w < k <= q;", all),
    ];
    for (mask, want) in cases {
        let src = format!(
            "param w: int = {w};\nparam c: int = {c};\nparam a: [int] = [1, 0, 1];\n{mask}"
        );
        let p = check_against_brute_force(
            &compile(&src),
            shape(q_len, kv_len),
            &params(&[]),
            TileShape::default(),
        );
        assert_eq!(p.elementwise_pairs, want, "{mask}");
    }
}

/// A predicate that fails only at keys the other side of `|` already holds still fails the
/// plan, as the reference evaluates both sides everywhere.
#[test]
fn errors_inside_the_other_side_are_kept() {
    let program = compile("mask = k <= q | elementwise(k == q & 1 / (k - q) == 0);");
    let bound = program.bind(shape(50, 50), &params(&[])).unwrap();
    let want = bound.brute_force_row(0, 0, 0).unwrap_err();
    let got = plan(&bound, TileShape::default()).unwrap_err();
    assert_eq!(got.code, want.code);
    assert!(got.message.contains("row q = 0"), "{}", got.message);
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
