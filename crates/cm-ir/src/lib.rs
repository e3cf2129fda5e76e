//! The checked, shape-agnostic mask IR and its reference semantics.
//!
//! Pipeline position: `cm_syntax::parse` -> [`check`] -> [`Program`] -> [`Program::bind`]
//! (lengths and parameters) -> [`Bound`], which `cm-plan` compiles analytically and which
//! [`Bound::visible`] defines pair by pair.
//!
//! Invariants owned here: a `Program` only exists when checking found no error; outside
//! `elementwise`, `k` occurs only in the solvable atoms of [`Region`]; integer division and
//! modulo floor toward negative infinity and overflow is an error (`CM0302`).

pub mod bind;
pub mod check;
mod interp;
pub mod ir;
pub mod tree;

pub use bind::{Bound, Env, PResult, PlanError, Shape, Value};
pub use check::check;
pub use cm_syntax::{Code, Diagnostic};
pub use ir::*;

/// Parses and checks `source` in one step, with `arrays` as built-in names (see
/// [`NamedArray`]; `cm_stdlib::ARRAYS` holds the standard library's).
pub fn compile(
    source: &str,
    arrays: &[NamedArray],
) -> (Option<Program>, Vec<cm_syntax::Diagnostic>) {
    let (ast, mut diags) = cm_syntax::parse(source);
    if diags.iter().any(cm_syntax::Diagnostic::is_error) {
        diags.sort_by_key(|d| (d.span.start, d.span.end));
        return (None, diags);
    }
    let (program, more) = check(&ast, arrays);
    diags.extend(more);
    diags.sort_by_key(|d| (d.span.start, d.span.end));
    (program, diags)
}
