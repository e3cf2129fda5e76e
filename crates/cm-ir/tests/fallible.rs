//! `Bound::never_fails` against the reference semantics: a predicate it accepts fails at no
//! pair of the shape (random predicates with overflowing constants, zero divisors and
//! negative square roots), and the predicates the planner relies on are accepted.

use cm_ir::{Bound, Program, Region, Shape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn compile(src: &str) -> Option<Program> {
    cm_stdlib::compile(src).0
}

fn shape(q_len: i64, kv_len: i64, num_heads: i64) -> Shape {
    cm_testkit::shape(q_len, kv_len, 1, num_heads)
}

/// `never_fails` of the predicate of `mask = elementwise(P);`.
fn never_fails(bound: &Bound<'_>) -> bool {
    match &bound.program.mask {
        Region::Elementwise(c, _) => bound.never_fails(c),
        other => panic!("not an elementwise mask: {other:?}"),
    }
}

fn accepted(pred: &str, q_len: i64, kv_len: i64) -> bool {
    let program = compile(&format!("param w: int = 3;\nmask = elementwise({pred});"))
        .unwrap_or_else(|| panic!("{pred} does not compile"));
    let bound = program
        .bind(shape(q_len, kv_len, 1), &BTreeMap::new())
        .unwrap();
    never_fails(&bound)
}

#[test]
fn known_predicates() {
    let n = 131072;
    assert!(accepted("(k * k + q) % 13 < 6", n, n));
    assert!(accepted(
        "(k * q + k) % 5 != 1 & k * k % (q + 2) == 0",
        n,
        n
    ));
    assert!(accepted("min(q, k) / w == abs(q - k) % (w + 1)", n, n));
    assert!(accepted("isqrt(k * k + q) > h", n, n));
    // A divisor that can be zero, an index, a negative square root, an overflow.
    assert!(!accepted("1 / (k - q) == 0", n, n));
    assert!(!accepted("k % (q - 5) == 0", n, n));
    assert!(!accepted("isqrt(k - q) > 1", n, n));
    assert!(!accepted("k * k * k * k > 5", n, n));
    for overflow in [
        "9223372036854775807 + k > 0",
        "(-9223372036854775807) - k - 2 < 0",
        "k * 4611686018427387904 > 0",
        "-(q - 9223372036854775807 - 1) > 0",
        "abs(k + (-9223372036854775807 - 1)) > 0",
        "(q - 9223372036854775807 - 1) / (0 - 1 - k % 1) > 0",
    ] {
        assert!(!accepted(overflow, 4, 4), "{overflow}");
    }
    assert!(accepted("9223372036854775807 - k > 0", 4, 4));
    assert!(accepted("k * k * k * k > 5", 100, 100));
    let program =
        compile("param a: [int] = [1, 2, 3];\nmask = elementwise(a[k % 3] == 1);").unwrap();
    let bound = program.bind(shape(4, 4, 1), &BTreeMap::new()).unwrap();
    assert!(!never_fails(&bound), "array lookups are not analysed");
}

fn leaf() -> BoxedStrategy<String> {
    prop_oneof![
        3 => Just("k".to_string()),
        3 => Just("q".to_string()),
        1 => Just("h".to_string()),
        1 => Just("w".to_string()),
        3 => (0i64..20).prop_map(|c| c.to_string()),
        1 => (1i64..9).prop_map(|c| format!("(-{c})")),
        2 => proptest::sample::select(vec![
            "3037000500",
            "4611686018427387904",
            "9223372036854775807",
            "(-9223372036854775807 - 1)",
        ])
        .prop_map(str::to_string),
    ]
    .boxed()
}

fn int() -> BoxedStrategy<String> {
    leaf()
        .prop_recursive(4, 24, 2, |inner| {
            let pair = (inner.clone(), inner.clone());
            prop_oneof![
                pair.clone().prop_map(|(a, b)| format!("({a} + {b})")),
                pair.clone().prop_map(|(a, b)| format!("({a} - {b})")),
                pair.clone().prop_map(|(a, b)| format!("({a} * {b})")),
                pair.clone().prop_map(|(a, b)| format!("({a} / {b})")),
                pair.clone().prop_map(|(a, b)| format!("({a} % {b})")),
                pair.clone().prop_map(|(a, b)| format!("min({a}, {b})")),
                pair.prop_map(|(a, b)| format!("max({a}, {b})")),
                inner.clone().prop_map(|a| format!("abs({a})")),
                inner.clone().prop_map(|a| format!("isqrt({a})")),
                inner.prop_map(|a| format!("(-{a})")),
            ]
        })
        .boxed()
}

fn predicate() -> BoxedStrategy<String> {
    let cmp = (
        int(),
        proptest::sample::select(vec!["<", "<=", "==", "!="]),
        int(),
    )
        .prop_map(|(a, op, b)| format!("{a} {op} {b}"));
    cmp.prop_recursive(2, 4, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} & {b})")),
            (inner.clone(), inner).prop_map(|(a, b)| format!("({a} | {b})")),
        ]
    })
    .boxed()
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 512, 0x0fa1_1b1e))]

    /// Accepted predicates fail at no pair; and the analysis is not vacuous.
    #[test]
    fn accepted_predicates_never_fail(
        pred in predicate(),
        q_len in 1i64..24,
        kv_len in 1i64..24,
        num_heads in 1i64..3,
    ) {
        let src = format!("param w: int = 3;\nmask = elementwise({pred});");
        let Some(program) = compile(&src) else {
            return Err(TestCaseError::reject("does not compile"));
        };
        let bound = program.bind(shape(q_len, kv_len, num_heads), &BTreeMap::new()).unwrap();
        if never_fails(&bound) {
            for h in 0..num_heads {
                for q in 0..q_len {
                    for k in 0..kv_len {
                        prop_assert!(
                            bound.visible(q, k, 0, h).is_ok(),
                            "{pred} accepted but fails at q={q} k={k} h={h}"
                        );
                    }
                }
            }
        }
    }
}
