//! Source-text generators: splices, and chains that are flat in the source but deep in the
//! syntax tree.

use proptest::prelude::*;
use proptest::sample::Index;

/// Arbitrary bytes, fewer than `max_len`, decoded lossily as UTF-8.
pub fn lossy_bytes(max_len: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<u8>(), 0..max_len)
        .prop_map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Fewer than `max_len` tokens drawn from `tokens`, joined by spaces.
pub fn token_soup(
    tokens: &'static [&'static str],
    max_len: usize,
) -> impl Strategy<Value = String> {
    proptest::collection::vec(proptest::sample::select(tokens), 0..max_len)
        .prop_map(|v| v.join(" "))
}

/// The largest character boundary of `s` at or below `i` (and at most `s.len()`).
pub fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// `base` with `insert` spliced in at the position `at` picks among `0..=base.len()`
/// (moved down to a character boundary).
pub fn splice(base: &str, at: Index, insert: &str) -> String {
    let cut = floor_boundary(base, at.index(base.len() + 1));
    format!("{}{insert}{}", &base[..cut], &base[cut..])
}

/// `mask = k < atom op atom op ... ;` with `n` copies of `atom`.
pub fn binary_chain(n: usize, atom: &str, op: &str) -> String {
    format!("mask = k < {};", vec![atom; n].join(op))
}

/// `mask = k cmp 0 | k cmp 1 | ... ;` with `n` terms (`cmp` a comparison such as `<`).
pub fn disjunction_chain(n: usize, cmp: &str) -> String {
    format!(
        "mask = {};",
        (0..n)
            .map(|i| format!("k {cmp} {i}"))
            .collect::<Vec<_>>()
            .join(" | ")
    )
}

/// `mask = k < 1 < 2 < 2 ... ;` with `n` further comparisons.
pub fn comparison_chain(n: usize) -> String {
    format!("mask = k < 1{};", " < 2".repeat(n))
}

/// Postfix chains of length `n`: `q.x.x...`, `f(1)(1)...`, `a[0][0]...`.
pub fn postfix_chains(n: usize) -> Vec<String> {
    vec![
        format!("mask = k < q{};", ".x".repeat(n)),
        format!("mask = k < f{};", "(1)".repeat(n)),
        format!("mask = k < a{};", "[0]".repeat(n)),
    ]
}
