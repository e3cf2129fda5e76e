//! Shared generators and checks for CompileMask's property and fuzz tests.
//!
//! Dev-only (`publish = false`): crates use it as a `[dev-dependency]` from their
//! integration tests (`tests/*.rs`). It holds what those tests had in common:
//!
//! - [`config`]: proptest configurations whose case counts come from an environment
//!   variable (`CM_FUZZ_CASES`, `CM_PROPTEST_CASES`), with a fixed seed for the quick CI run.
//! - [`tokens`]: pieces of the language's vocabulary that token soups and mutations draw
//!   from, and [`tokens::concat`] to assemble a crate's own token list from them.
//! - [`source`]: source-text generators: splicing at a character boundary, flat operator
//!   chains and postfix chains.
//! - [`check_diags`]: every diagnostic is well-formed against its source.
//! - [`shape`]: a [`cm_ir::Shape`] from its four lengths.

#![warn(missing_docs)]

pub mod config;
pub mod source;
pub mod tokens;

use cm_syntax::Diagnostic;

/// Asserts that every diagnostic in `diags` is well-formed against `src`: a `CM` code of six
/// characters, and a primary span and related spans that are ordered, inside the source and
/// on character boundaries.
pub fn check_diags(src: &str, diags: &[Diagnostic]) {
    for d in diags {
        assert!(
            d.code.as_str().starts_with("CM") && d.code.as_str().len() == 6,
            "bad code {d:?}"
        );
        for span in std::iter::once(d.span).chain(d.related.iter().map(|r| r.0)) {
            let (s, e) = (span.start as usize, span.end as usize);
            assert!(
                s <= e && e <= src.len(),
                "span {s}..{e} outside the source ({}): {d:?}\n{src:?}",
                src.len()
            );
            assert!(
                src.is_char_boundary(s) && src.is_char_boundary(e),
                "span {s}..{e} not on char boundaries: {d:?}\n{src:?}"
            );
        }
    }
}

/// A [`cm_ir::Shape`] from its lengths.
pub fn shape(q_len: i64, kv_len: i64, batch: i64, num_heads: i64) -> cm_ir::Shape {
    cm_ir::Shape {
        q_len,
        kv_len,
        batch,
        num_heads,
    }
}
