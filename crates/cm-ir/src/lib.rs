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
mod fallible;
mod interp;
pub mod ir;
pub mod score;
mod square;
pub mod tree;

pub use bind::{Bound, Env, PResult, PlanError, Shape, Value};
pub use check::check;
pub use cm_syntax::{Code, Diagnostic};
pub use ir::*;
pub use score::{LinearBias, ScoreTerms, TableBias};

/// Most (q, k) pairs one plan may evaluate one by one in `elementwise` (about ten seconds
/// on one core; a short predicate costs about 35 ns a pair). The planner enforces it
/// (`CM0404`); the checker's hints quote it.
pub const MAX_ELEMENTWISE_PAIRS: u64 = 1 << 28;

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

/// Runs `f` with enough stack, switching to a fresh 8 MiB segment when the thread has less
/// than 1 MiB left. The checker, binding, the interpreter and the solver recurse over
/// expressions as deep as [`check::MAX_INLINED_DEPTH`]; each recursive step goes through
/// this, so no depth a program may have overflows any thread's stack.
///
/// The stack is measured at every [`DEEP_STEP`]-th nesting level only (a thread-local
/// count): measuring costs more than a shallow step of the interpreter (it was 40% of
/// `elementwise`'s time), and the 1 MiB red zone holds the few frames of those levels
/// with room to spare, in debug builds too.
pub fn deep<R>(f: impl FnOnce() -> R) -> R {
    thread_local! {
        static LEVEL: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    /// Leaves a level, also when `f` unwinds.
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            LEVEL.with(|l| l.set(l.get().wrapping_sub(1)));
        }
    }
    let level = LEVEL.with(|l| {
        let v = l.get();
        l.set(v.wrapping_add(1));
        v
    });
    let _leave = Leave;
    if level & (DEEP_STEP - 1) == 0 {
        stacker::maybe_grow(1 << 20, 8 << 20, f)
    } else {
        f()
    }
}

/// Nesting levels of [`deep`] between two measurements of the stack (a power of two).
pub const DEEP_STEP: u32 = 8;
