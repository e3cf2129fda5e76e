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
pub mod score;
pub mod tree;

pub use bind::{Bound, Env, PResult, PlanError, Shape, Value};
pub use check::check;
pub use cm_syntax::{Code, Diagnostic};
pub use ir::*;
pub use score::{LinearBias, ScoreTerms, TableBias};

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

/// Runs `f` with at least 256 KiB of stack left, switching to a fresh 8 MiB segment when
/// the thread has less. The checker, binding, the interpreter and the solver recurse over
/// expressions as deep as [`check::MAX_INLINED_DEPTH`]; each recursive step goes through
/// this, so no depth a program may have overflows any thread's stack.
pub fn deep<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(256 << 10, 8 << 20, f)
}
