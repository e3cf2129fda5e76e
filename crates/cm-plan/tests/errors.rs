//! A plan fails exactly where the pairwise reference fails: programs with terms that can
//! fail (a division, `%` or `isqrt` of a key expression, array lookups, grid coordinates,
//! products that overflow, `elementwise` predicates that fail, `any` / `all` over more
//! entries than an array holds) behind random guards (gapped unions, strided guards, nested
//! `&`, `|`, `-`, `!`, `any`, `all`, `if`), at random lengths. Either both the plan and the
//! reference (`Bound::brute_force_row`, row by row) fail, with the same code, span and
//! message on the same row, or both succeed with the same rows and tiles.

#[allow(dead_code)]
mod common;
use cm_ir::Shape;
use cm_plan::{plan, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// The plan and the reference agree on `src` at these lengths and tile; whether they
/// planned.
fn agree(src: &str, q_len: i64, kv_len: i64, tile: TileShape) -> Result<bool, String> {
    let program = compile(src);
    let s = shape(q_len, kv_len);
    let bound = program
        .bind(s, &params(&[]))
        .map_err(|e| format!("bind: {e}"))?;
    let reference = (0..q_len)
        .map(|q| bound.brute_force_row(q, 0, 0).map_err(|e| (q, e)))
        .collect::<Result<Vec<_>, _>>();
    match (reference, plan(&bound, tile)) {
        (Ok(_), Ok(_)) => {
            check_against_brute_force(&program, s, &params(&[]), tile);
            Ok(true)
        }
        (Err((q, want)), Err(got)) => {
            let row = format!("(planning row q = {q})");
            if got.code != want.code
                || got.span != want.span
                || !got.message.starts_with(&want.message)
                || !got.message.ends_with(&row)
            {
                return Err(format!(
                    "the plan fails with {got:?}, the reference with {want:?} on row {q}"
                ));
            }
            Ok(false)
        }
        (Ok(_), Err(got)) => Err(format!("the plan fails ({got}), the reference does not")),
        (Err((q, want)), Ok(_)) => Err(format!(
            "the reference fails on row {q} ({want}), the plan does not"
        )),
    }
}

fn assert_agrees(src: &str, q_len: i64, kv_len: i64) {
    for (bm, bn) in [(1, 1), (4, 8), (128, 128)] {
        let tile = TileShape {
            block_m: bm,
            block_n: bn,
        };
        if let Err(e) = agree(src, q_len, kv_len, tile) {
            panic!("{e}\nq_len {q_len}, kv_len {kv_len}, tile {bm}x{bn}\n{src}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// The cases docs/language.md listed as known gaps, and their relatives.
// ---------------------------------------------------------------------------------------

/// Key arithmetic behind a guard with a gap: the reference never divides at k = 5.
#[test]
fn division_behind_a_gapped_guard() {
    assert_agrees("mask = k != 5 & 100 / (k - 5) < q;", 20, 20);
    assert_agrees("mask = (k < 5 | k > 5) & 100 / (k - 5) < q;", 30, 17);
    assert_agrees("mask = k != 5 & (k * k) % (k - 5) <= q % 4;", 12, 40);
    assert_agrees(
        "param a: [int] = [3, 1, 4];\nmask = k % 7 == 2 & a[k / 7] <= q;",
        9,
        21,
    );
    // Where the guard keeps the failing key, the plan fails as the reference does.
    assert_agrees("mask = k != 4 & 100 / (k - 5) < q;", 20, 20);
}

/// A nested term under an outer `&` whose left side is several intervals.
#[test]
fn elementwise_nested_behind_a_gapped_guard() {
    assert_agrees(
        "mask = (k != 10) & (k <= q | elementwise(q / (k - 10) < 2));",
        20,
        24,
    );
    assert_agrees(
        "mask = (k < 3 | k > 10) & (k >= q - 2 | elementwise(q / (k - 7) < 2));",
        30,
        20,
    );
}

/// `all` behind a guard: its terms are evaluated at the keys where the guard and the
/// earlier terms hold, so `g[3]` (out of range) is never reached.
#[test]
fn all_behind_a_guard() {
    assert_agrees(
        "param g: [int] = [1, 2, 0];\nmask = k < 2 & (all i in 0 .. 4: k >= g[i]);",
        6,
        8,
    );
    assert_agrees(
        "param g: [int] = [1, 2, 0];\nmask = k < 2 & (all i in 0 .. 4: k >= g[i] + q % 2);",
        6,
        8,
    );
    // Reached at k = 2: the plan fails as the reference does.
    assert_agrees(
        "param g: [int] = [1, 2, 0];\nmask = k < 3 & (all i in 0 .. 4: k >= g[i]);",
        6,
        8,
    );
}

/// The overflow the solver never formed (it moves terms): the reference multiplies at
/// every key it evaluates, so these fail (CM0302) at the first key past the limit.
#[test]
fn overflow_of_key_products() {
    assert_agrees("mask = k * 4611686018427387904 < q;", 20, 20);
    assert_agrees("mask = k < 2 & k * 4611686018427387904 < q;", 20, 20);
    assert_agrees("mask = k * -4611686018427387904 < q;", 5, 9);
    assert_agrees("mask = (k * 3074457345618258603 + q) / 3 <= q;", 7, 9);
    assert_agrees("mask = (k - 9223372036854775807 - 1) / -1 > q;", 4, 6);
    assert_agrees("mask = (k + 9223372036854775800) % 5 == q % 5;", 3, 12);
    assert_agrees("mask = k != 2 & k * 4611686018427387904 < q;", 3, 3);
    // Normalised: `k < -9223372036854775807` is `k + 9223372036854775807 < 0`.
    assert_agrees("mask = k < -9223372036854775807;", 1, 2);
}

/// A large multiple of `k` against a large constant: the constant may be clamped only
/// where that keeps every key's outcome, so the plan is the reference's at each key (found
/// by a fresh user: `4.8e18 < 4.5e18 * k` planned key 1 as visible).
#[test]
fn large_key_multiples_against_large_constants() {
    let coefficients = [
        "4500000000000000000",
        "4611686018427387904",
        "3074457345618258603",
    ];
    let constants = [
        "4800000000000000000",
        "5000000000000000000",
        "4000000000000000000",
        "9223372036854775807",
        "-9223372036854775807",
        "4611686018427387905",
    ];
    for a in coefficients {
        for c in constants {
            for op in ["<", "<=", ">", ">=", "==", "!="] {
                assert_agrees(&format!("mask = {c} {op} {a} * k;"), 1, 2);
                assert_agrees(&format!("mask = {a} * k {op} {c};"), 1, 2);
                assert_agrees(&format!("mask = k < 3 & !({c} {op} {a} * k);"), 2, 4);
            }
        }
    }
}

/// `% 0` of any multiple of `k` fails as `k % 0` does (CM0301), never a panic.
#[test]
fn modulo_by_zero_of_key_multiples() {
    for src in [
        "mask = (2 * k) % 0 == 0;",
        "mask = (3 * k) % 0 == 1;",
        "mask = (2 * k) % 0 != 0 | k <= q;",
        "mask = k % 0 == 0;",
    ] {
        assert_agrees(src, 3, 4);
    }
}

/// `|` of two regions evaluates both sides at every key; `or` of two conditions that read no
/// key (a row condition) stops at the first true one, as `and` at the first false one
/// (docs/language.md, "Errors"): the plan and the reference agree either way, and only the
/// region form fails at row 0.
#[test]
fn or_of_row_conditions_stops_at_the_first_true_side() {
    let planned = |src: &str| {
        agree(
            src,
            5,
            5,
            TileShape {
                block_m: 4,
                block_n: 8,
            },
        )
        .unwrap()
    };
    let row_or = "param w: int = 7;\nmask = (q >= 0) | (w % q > 0);";
    assert_agrees(row_or, 5, 5);
    assert!(planned(row_or));
    assert!(planned(
        "param w: int = 7;\nmask = (q >= 0) or (w % q > 0);"
    ));
    let region_or = "param w: int = 7;\nmask = (k >= 0) | (w % q > 0);";
    assert_agrees(region_or, 5, 5);
    assert!(!planned(region_or));
    // A condition whose key terms cancel reads no key.
    let cancelled = "mask = (q >= 0) | (k >= k + 9 % q);";
    assert_agrees(cancelled, 5, 5);
    assert!(planned(cancelled));
}

/// The reference evaluates a ball's radius on every row and squares an L2 radius at the
/// keys of its grid.
#[test]
fn ball_radius_errors() {
    assert_agrees("grid g = [1, 1] at 5;\nmask = l2(g) < 1 / 0;", 2, 2);
    assert_agrees("grid g = [1, 1] at 5;\nmask = l1(g) < g.y(q);", 2, 2);
    assert_agrees(
        "param r: int = 4000000000;\ngrid g = [2, 2];\nmask = l2(g) <= r;",
        4,
        4,
    );
    assert_agrees(
        "param r: int = 4000000000;\ngrid g = [2, 2] at 3;\nmask = k < 3 & l2(g) <= r | k == q;",
        9,
        9,
    );
}

/// The row that fails decides the error, and the rows before it are kept from failing by
/// long pieces that fail only at their end.
#[test]
fn the_first_failing_row_decides() {
    assert_agrees("mask = k <= q * 2305843009213693952;", 9, 9);
    assert_agrees(
        "param a: [int] = [0, 0, 0, 0, 0, 0];\nmask = k <= q * 2305843009213693952 | k == a[q];",
        9,
        9,
    );
    assert_agrees(
        "param a: [int] = [0, 0, 0, 0, 0, 0];\nmask = k == a[q] | k <= q * 2305843009213693952;",
        9,
        9,
    );
}

/// Within a row, the first failing key decides, whichever term fails there.
#[test]
fn the_first_failing_key_decides() {
    assert_agrees(
        "param a: [int] = [1, 2];\nmask = 100 / (k - 5) < q | k < a[q];",
        4,
        9,
    );
    assert_agrees(
        "param a: [int] = [1, 2];\nmask = k < a[q] | 100 / (k - 5) < q;",
        4,
        9,
    );
    assert_agrees(
        "mask = 100 / (k - 5) < q | k * 2305843009213693952 < q;",
        3,
        9,
    );
    assert_agrees(
        "mask = k * 2305843009213693952 < q | 100 / (k - 3) < q;",
        3,
        9,
    );
}

// ---------------------------------------------------------------------------------------
// The property.
// ---------------------------------------------------------------------------------------

/// A key position, mostly inside the short lengths below.
fn pos() -> BoxedStrategy<i64> {
    prop_oneof![8 => 0i64..24, 1 => 24i64..50].boxed()
}

/// Coefficients of `k` whose products overflow at a few keys, or almost.
fn big() -> BoxedStrategy<&'static str> {
    prop_oneof![
        Just("4611686018427387904"),
        Just("3074457345618258603"),
        Just("1152921504606846976"),
        Just("-4611686018427387904"),
        Just("9223372036854775807"),
        Just("(-9223372036854775807 - 1)"),
        Just("768614336404564650"),
    ]
    .boxed()
}

/// A term that can fail, and where: at a key, on a row, at keys past a product's limit.
fn fallible() -> BoxedStrategy<String> {
    prop_oneof![
        (pos(), 1i64..200).prop_map(|(c, n)| format!("{n} / (k - {c}) < q")),
        pos().prop_map(|c| format!("(k * k) % (k - {c}) <= q % 5")),
        pos().prop_map(|c| format!("isqrt(k - {c}) <= q / 2")),
        pos().prop_map(|c| format!("a[k - {c}] <= q")),
        Just("a[k] > q % 7".to_string()),
        pos().prop_map(|c| format!("k <= q / (q - {c})")),
        pos().prop_map(|c| format!("k < a[q - {c}]")),
        pos().prop_map(|c| format!("k + isqrt(q - {c}) > 3")),
        big().prop_map(|b| format!("k * {b} < q")),
        (big(), 1i64..5).prop_map(|(b, d)| format!("(k * {b} + q) / {d} <= q")),
        pos().prop_map(|c| format!("(k - 9223372036854775807 - {c}) / -1 > q")),
        pos().prop_map(|c| format!("(k + 9223372036854775807 - {c}) % 5 == q % 5")),
        pos().prop_map(|c| format!("elementwise(q / (k - {c}) < 2)")),
        Just("elementwise(a[k] <= q)".to_string()),
        big().prop_map(|b| format!("elementwise(k * {b} < q)")),
        (0i64..6).prop_map(|n| format!("all i in 0 .. {n}: k >= g[i]")),
        (0i64..6).prop_map(|n| format!("any i in 0 .. {n}: k == g[i] + q % 2")),
        (pos(), 0i64..4).prop_map(|(c, n)| format!("all i in 0 .. {n}: k != 100 / (g[i] - {c})")),
        Just("l2(img) <= r".to_string()),
        Just("l1(img) < img.y(q) + 1".to_string()),
        Just("k <= img.x(q) + 2".to_string()),
    ]
    .boxed()
}

/// A guard: a region with gaps, strided runs, a band, a row predicate, or nothing.
fn guard() -> BoxedStrategy<String> {
    prop_oneof![
        pos().prop_map(|c| format!("k != {c}")),
        (pos(), pos()).prop_map(|(a, b)| format!("k < {a} | k > {b}")),
        (2i64..5, 0i64..4).prop_map(|(m, r)| format!("k % {m} == {}", r % m)),
        (2i64..4).prop_map(|m| format!("(q - k) % {m} == 0 & k <= q")),
        (1i64..12).prop_map(|w| format!("q - {w} < k <= q")),
        pos().prop_map(|c| format!("k > {c}")),
        (pos(), pos()).prop_map(|(a, b)| format!("k in {a} .. {b}")),
        pos().prop_map(|c| format!("k == {c}")),
        Just("k / 4 == q / 4".to_string()),
        pos().prop_map(|c| format!("q < {c}")),
        Just("q % 2 == 0".to_string()),
    ]
    .boxed()
}

/// A term that can fail behind a guard that keeps the reference from its failing keys or
/// rows (as often as not only just), sometimes with more keys in front of it.
fn guarded() -> BoxedStrategy<String> {
    let term = prop_oneof![
        (pos(), 1i64..200).prop_map(|(c, n)| format!("k != {c} & {n} / (k - {c}) < q")),
        pos().prop_map(|c| format!("(k < {c} | k > {c}) & (k * k) % (k - {c}) <= q % 5")),
        pos().prop_map(|c| format!("k >= {c} & isqrt(k - {c}) <= q / 2")),
        pos().prop_map(|c| format!("k in {c} .. {c} + count(a) & a[k - {c}] <= q")),
        pos().prop_map(|c| format!("q >= {c} & k < isqrt(q - {c})")),
        pos().prop_map(|c| format!("q != {c} & k <= q / (q - {c})")),
        (big(), 0i64..4).prop_map(|(b, n)| format!("k < {n} & k * {b} < q")),
        (0i64..8, 0i64..6).prop_map(|(c, n)| format!("k < {c} & (all i in 0 .. {n}: k >= g[i])")),
        pos().prop_map(|c| format!("k != {c} & (k <= q | elementwise(q / (k - {c}) < 2))")),
        pos().prop_map(|c| format!("k % 2 == {} & elementwise(q / (k - {c}) < 2)", 1 - c % 2)),
    ];
    (term, guard(), 0u8..3)
        .prop_map(|(t, g, how)| match how {
            0 => t,
            1 => format!("({g}) | ({t})"),
            _ => format!("({t}) - ({g})"),
        })
        .boxed()
}

/// A row predicate for `if`, sometimes one that fails.
fn qbool() -> BoxedStrategy<String> {
    prop_oneof![
        4 => pos().prop_map(|c| format!("q < {c}")),
        2 => Just("q % 2 == 0".to_string()),
        1 => pos().prop_map(|c| format!("q / (q - {c}) > 0")),
        1 => Just("a[q % 4] > 2".to_string()),
    ]
    .boxed()
}

/// Guards and fallible terms combined, `depth` operators deep at most (the variable of an
/// `any` / `all` at depth `d` is `j{d}`, so nested ones never share a name).
fn region(depth: u32) -> BoxedStrategy<String> {
    let leaf = prop_oneof![3 => guard(), 2 => fallible(), 2 => guarded()].boxed();
    if depth == 0 {
        return leaf;
    }
    let inner = region(depth - 1);
    let j = format!("j{depth}");
    let j2 = j.clone();
    prop_oneof![
        3 => leaf,
        4 => (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) & ({b})")),
        2 => (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) - ({b})")),
        3 => (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a}) | ({b})")),
        1 => inner.clone().prop_map(|a| format!("!({a})")),
        2 => (qbool(), inner.clone(), inner.clone())
            .prop_map(|(c, a, b)| format!("if {c} then {a} else {b}")),
        1 => (0i64..4, inner.clone(), inner.clone()).prop_map(move |(n, a, b)| {
            format!("all {j} in 0 .. {n}: ({a}) | ({b}) & k != g[{j}]")
        }),
        1 => (0i64..4, inner)
            .prop_map(move |(n, a)| format!("any {j2} in 0 .. {n}: ({a}) & k >= g[{j2}]")),
    ]
    .boxed()
}

fn list(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// The declarations the terms read: arrays `a` and `g`, a grid `img`, a radius `r`.
fn preamble() -> BoxedStrategy<String> {
    (
        proptest::collection::vec(-3i64..30, 0..6),
        proptest::collection::vec(0i64..30, 0..5),
        (1i64..4, 1i64..5, 0i64..12),
        prop_oneof![Just(2i64), Just(5), Just(4_000_000_000)],
    )
        .prop_map(|(a, g, (gh, gw, at), r)| {
            format!(
                "param a: [int] = {};\nparam g: [int] = {};\nparam r: int = {r};\ngrid img = [{gh}, {gw}] at {at};\n",
                list(&a),
                list(&g)
            )
        })
        .boxed()
}

/// Random programs, lengths and tiles: the plan and the reference agree (both fail alike or
/// both give the same rows). Prints how many cases failed in both.
#[test]
fn plan_fails_exactly_where_the_reference_fails() {
    use std::cell::Cell;
    let (planned, failed) = (Cell::new(0u32), Cell::new(0u32));
    let mut runner =
        proptest::test_runner::TestRunner::new(env_config(PROPTEST_CASES, 3000, 0x0e11_0e11));
    let strategy = (
        preamble(),
        region(3),
        (1i64..48, 1i64..48),
        (1u32..20, 1u32..20),
    );
    let result = runner.run(&strategy, |(pre, mask, (q_len, kv_len), (bm, bn))| {
        let src = format!("{pre}mask = {mask};\n");
        let tile = TileShape {
            block_m: bm,
            block_n: bn,
        };
        match agree(&src, q_len, kv_len, tile) {
            Ok(ok) => {
                let c = if ok { &planned } else { &failed };
                c.set(c.get() + 1);
                Ok(())
            }
            Err(e) => Err(TestCaseError::fail(format!(
                "{e}\nq_len {q_len}, kv_len {kv_len}\n{src}"
            ))),
        }
    });
    eprintln!(
        "plan_fails_exactly_where_the_reference_fails: {} cases planned, {} failed in both",
        planned.get(),
        failed.get()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// At length, a guard with a gap in front of a term that fails in the gap keeps its pieces
/// long: the right side is evaluated over each interval of the guard's keys apart (21
/// pieces at 4096 rows, where the term's values change), not one row at a time.
#[test]
fn gapped_guards_plan_at_length() {
    let s = Shape {
        q_len: 4096,
        kv_len: 4096,
        batch: 1,
        num_heads: 1,
    };
    let program = compile("mask = k != 5 & 100 / (k - 5) < q;");
    let bound = program.bind(s, &params(&[])).unwrap();
    let p = plan(&bound, TileShape::default()).unwrap();
    assert!(p.pieces < 64, "{} pieces", p.pieces);
    for q in [0u32, 1, 6, 50, 105, 4095] {
        let want = bound.brute_force_row(i64::from(q), 0, 0).unwrap();
        assert_eq!(row_pairs(&p.masks[0].rows, q), want, "row {q}");
    }
}
