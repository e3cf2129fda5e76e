//! Operator precedence of region expressions, against a computed answer per row: `!` binds
//! like unary `-` (tighter than every binary operator, so `!A - B` is `(!A) - B` and `A - !B`
//! parses), while the word `not` binds loosely, below comparisons, arithmetic and region `-`
//! but above `&` and `|` (`not k < 2` is `not (k < 2)`); `!` on a
//! number is refused with a hint. Found by a fresh-user test: `!(k < 2) - (k > 5)` used to
//! mean `!((k < 2) - (k > 5))` and `(k <= q) - !(k < 2)` was a syntax error.

mod common;

use common::{check_brute_force, compile, plan, rows, set};
use compilemask::PlanOptions;

/// Every row of `src` at q_len 6, kv_len 10 against `want(q)` (the visible keys of row q),
/// and against the pairwise interpreter.
fn expect_rows(src: &str, want: impl Fn(u32) -> Vec<u32>) {
    let program = compile(src);
    let opts = PlanOptions::new(6).kv_len(10);
    let p = plan(&program, &opts);
    check_brute_force(&program, &opts, &p);
    let expected: Vec<Vec<(u32, u32)>> = (0..6).map(|q| set(want(q))).collect();
    assert_eq!(rows(&p, 0, 0), expected, "{src}");
}

#[test]
fn bang_binds_tighter_than_region_difference() {
    expect_rows("mask = !(k < 2) - (k > 5);", |_| (2..6).collect());
    expect_rows("mask = (k <= q) - !(k < 2);", |q| (0..=q.min(1)).collect());
    expect_rows("mask = !(k < 2) & !(k > 5) | k == q;", |q| {
        (2..6).chain(std::iter::once(q)).collect()
    });
    expect_rows("mask = !!(k <= q);", |q| (0..=q).collect());
}

#[test]
fn not_binds_loosely() {
    expect_rows("mask = not k < 2;", |_| (2..10).collect());
    // `not ((k < 2) - (k > 5))`: the complement of keys 0 and 1.
    expect_rows("mask = not (k < 2) - (k > 5);", |_| (2..10).collect());
    expect_rows("mask = not k < 2 & k <= q;", |q| (2..=q).collect());
}

#[test]
fn bang_on_a_number_is_refused_with_a_hint() {
    let e = compilemask::compile("mask = !k < 2;")
        .map(|_| ())
        .unwrap_err();
    let d = e
        .diagnostics
        .iter()
        .find(|d| d.code == "CM0203")
        .unwrap_or_else(|| panic!("expected CM0203, got:\n{}", e.rendered));
    assert!(d.message.contains("after `!`"), "{}", d.message);
    let hint = d.hint.as_deref().unwrap_or_default();
    assert!(
        hint.contains("`!(k < 2)`") && hint.contains("`not k < 2`"),
        "{hint}"
    );
}
