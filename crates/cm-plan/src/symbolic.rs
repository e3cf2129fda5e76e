//! The analytical row solver. Rows are processed in *pieces* `[q0, q0 + n)` over which
//! every q-dependent quantity the mask reads is affine in `q` ([`Affine`]), so the visible keys
//! of all rows of a piece are one list of intervals whose endpoints are affine in `q`.
//! Whenever a quantity stops being affine (a segment boundary, a floor-division step, a
//! clamp, an order change between two endpoints), evaluation stops with the first row where
//! it changes ([`Flow::Split`]) and the driver re-evaluates a shorter piece. A piece of one
//! row is always affine, so every construct has an exact fallback; the common masks need a
//! handful of pieces per segment, which is what makes planning cost grow with
//! rows x intervals rather than `q_len x kv_len`.
//!
//! Invariant of every interval list returned for a piece: for *every* row of the piece the
//! intervals are non-empty, inside `[0, kv_len)`, sorted and maximal (neither overlapping
//! nor touching). Comparisons that would break this for some row split the piece instead.
//!
//! Errors: a piece that evaluates has no pair at which the pairwise reference fails (every
//! value is checked over the piece's rows and the keys of the hull it is evaluated at,
//! which hold the keys the reference evaluates it at). The converse is not kept here: an
//! evaluation may fail at rows or keys the reference never reaches, and the driver then
//! halves the piece down to one row, evaluated exactly by [`Solver::exact_row`] (the
//! `exact` module).

use crate::plan::{too_many_intervals, MAX_INTERVALS};
use cm_ir::bind::{self, piece_range, Bound, Env, PlanError, MAX_QUANT_DEPTH};
use cm_ir::ir::*;
use cm_syntax::Code;
use cm_syntax::{CmpOp, Span};
use std::cell::{Cell, RefCell, RefMut};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

pub use cm_ir::MAX_ELEMENTWISE_PAIRS;

mod exact;
mod grid_box;
mod keys;
mod quant;
mod quasi;

use keys::KeySweep;
pub use quant::MAX_QUANT_EVALS;

/// Most row-invariant comparisons a solver keeps ([`Solver`]'s `invariant`): a mask has a
/// few (text or sink tokens); past that many, finding one would cost more than solving it.
const MAX_INVARIANT: usize = 16;

/// Most later piece ends a tree path records as hints when it splits a piece (see
/// `Solver::tree_path`); the driver tries the next pieces up to them.
const MAX_TREE_HINTS: usize = 64;

/// A row-invariant comparison's address in the program, b and h.
type InvariantKey = (usize, i64, i64);

/// A row-invariant comparison's keys and the value of its `rest`, by its [`InvariantKey`].
type Invariant = (InvariantKey, Vec<AffineInterval>, i64);

/// A strided box's q-side value (see `Solver::box_int`): the piece and the enclosing
/// quantifiers' values it was evaluated at, and its value there.
type BoxValue<T> = (Piece, [i64; MAX_QUANT_DEPTH], T);

/// A strided box's q-side value that reads `q` only through one grid's fastest coordinate
/// (see `Solver::box_int`): its address, that coordinate on the piece's first row, the
/// piece's rows, b, h and the enclosing quantifiers' values.
type LineKey = (usize, i64, i64, i64, i64, [i64; MAX_QUANT_DEPTH]);

/// A strided box's key-side function: its address, the grid, b and h.
type CoordFnKey = (usize, GridId, i64, i64);

/// Most values a solver keeps by [`LineKey`]; past that many the table starts afresh (a
/// grid line's values are read again on the next line, not much later).
const MAX_LINE_VALUES: usize = 1 << 16;

/// A map whose keys are addresses and small integers, hashed by `rustc-hash`'s FxHasher
/// (the strided boxes' tables are read several times per piece, where SipHash was a tenth
/// of NATTEN's solve; the keys are not chosen by an adversary).
type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// A canonical list of keys (see the module docs).
type List = Vec<AffineInterval>;

/// Keys found pair by pair, and the first key where the predicate failed, with its error.
type Scan = (Vec<AffineInterval>, Option<(i64, PlanError)>);

/// An integer affine in the row over a piece: `value(q0 + t) = first + step * t` for
/// `0 <= t < n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Affine {
    /// The value at the piece's first row `q0`.
    pub first: i64,
    /// The change from one row to the next.
    pub step: i64,
}

impl Affine {
    /// The same value on every row.
    fn constant(v: i64) -> Affine {
        Affine { first: v, step: 0 }
    }

    /// The value at offset `t`; the caller has checked both ends of the piece fit.
    #[inline]
    pub fn at(self, t: i64) -> i64 {
        self.first + self.step * t
    }
}

/// Why evaluation of a piece stopped.
pub enum Flow {
    /// Re-evaluate with the piece ending just before this absolute row.
    Split(i64),
    Error(PlanError),
}

impl From<PlanError> for Flow {
    fn from(e: PlanError) -> Flow {
        Flow::Error(e)
    }
}

/// A piece's evaluation: its value, or why it stopped.
type Eval<T> = Result<T, Flow>;

/// Keys `[start, end)` of every row of a piece, both ends affine in the row; with a
/// `stride` above 1 a strided run (see [`crate::rows`]): the keys `start, start + stride,
/// ...`, `end - 1` the last, at least two keys, the same number on every row of the piece.
#[derive(Clone, Copy, Debug)]
pub struct AffineInterval {
    pub start: Affine,
    pub end: Affine,
    pub stride: i64,
}

impl AffineInterval {
    /// The plain interval `[start, end)`.
    fn unit(start: Affine, end: Affine) -> AffineInterval {
        AffineInterval {
            start,
            end,
            stride: 1,
        }
    }
}

/// The leftmost term of a chain of `&` (`(a & b) & c` gives `a`), the others pushed onto
/// `rest` in order.
fn left_spine<'r>(r: &'r Region, rest: &mut Vec<&'r Region>) -> &'r Region {
    match r {
        Region::Inter(a, b) => {
            let first = left_spine(a, rest);
            rest.push(b);
            first
        }
        _ => r,
    }
}

/// Whether a list holds a strided run.
pub(crate) fn has_strided(list: &[AffineInterval]) -> bool {
    list.iter().any(|iv| iv.stride != 1)
}

/// Rows `[q0, q0 + n)` of batch `b`, head `h`.
#[derive(Clone, Copy)]
pub struct Piece {
    pub q0: i64,
    pub n: i64,
    pub b: i64,
    pub h: i64,
}

pub struct Solver<'a, 'p> {
    pub bound: &'a Bound<'p>,
    /// Pairs evaluated one by one inside `elementwise(...)`.
    pub elementwise_pairs: Cell<u64>,
    /// Further rows, ascending, where the construct that stopped the last evaluation with
    /// [`Flow::Split`] changes again (after the split's row, inside the piece): known
    /// change points the driver need not rediscover by failing again.
    hints: RefCell<Vec<i64>>,
    /// The last ball's runs (see [`Solver::ball`]).
    ball_runs: RefCell<BallRuns>,
    /// The values of the enclosing `any` / `all` variables, outermost first.
    vars: Cell<[i64; MAX_QUANT_DEPTH]>,
    /// The keys of each `any` / `all` that reads neither `q` nor an enclosing variable, by
    /// (its address in the program, head): the same on every row, so solved once (`None`:
    /// solving it on all keys failed).
    quant_cache: RefCell<HashMap<(usize, i64), Option<List>>>,
    /// The keys of comparisons `alpha * k + rest op 0` whose `rest` reads neither `q` nor
    /// an enclosing variable (`k < text`, attention sinks), by (their address in the
    /// program, b, h): the same on every row, and evaluated once per piece otherwise (a
    /// tenth of W4's solve). At most [`MAX_INVARIANT`], searched in order.
    invariant: RefCell<Vec<Invariant>>,
    /// Whether the mask holds an `elementwise` at all.
    has_elementwise: bool,
    /// Whether each `elementwise` predicate met so far fails at no pair, by its address
    /// (see [`Solver::infallible_elementwise`]).
    infallible: RefCell<Vec<(usize, bool)>>,
    /// Each key-side atom's keys sorted by their value, and the keys at or below the last
    /// threshold asked for, by (its address in the program, head).
    key_sweeps: RefCell<HashMap<(usize, i64), KeySweep>>,
    /// For each chain of `&` met (by its address in the program), the grid whose key
    /// coordinates it reads when it is solved as a strided box ([`grid_box`]), else `None`.
    grid_chains: RefCell<FastMap<usize, Option<GridId>>>,
    /// Evaluations of a chain of grid coordinates that gave its keys as a strided box
    /// ([`grid_box`]).
    pub grid_boxes: Cell<u64>,
    /// The q-side values of strided boxes' atoms, by their address: the last piece each
    /// was evaluated over and its value there (see `Solver::box_int`).
    box_values: RefCell<FastMap<usize, BoxValue<Affine>>>,
    /// As `box_values`, for the residue atoms' values read as `b + t * (a mod m)`
    /// (`Solver::box_mod_form`).
    box_mods: RefCell<FastMap<usize, BoxValue<Option<grid_box::ModForm>>>>,
    /// For each strided box's q-side value met (by its address), the grid whose fastest
    /// coordinate of `q` is the only way it reads `q`, else `None` (`line_grid`).
    line_grids: RefCell<FastMap<usize, Option<GridId>>>,
    /// Those values' evaluations over pieces inside one line of their grid, by [`LineKey`]:
    /// the value, or the offset in the piece where it splits (`Solver::box_int`).
    line_values: RefCell<FastMap<LineKey, Result<Affine, i64>>>,
    /// As `line_values`, for `Solver::box_mod_form`.
    line_mods: RefCell<FastMap<LineKey, Result<Option<grid_box::ModForm>, i64>>>,
    /// Strided boxes' key-side functions read as one coordinate's, by (their address, the
    /// grid, b, h): they read neither `q` nor a quantifier's variable.
    coord_fns: RefCell<FastMap<CoordFnKey, Option<grid_box::Coord>>>,
    /// The plan's `elementwise` pairs when several solvers count them together (rows
    /// solved in blocks on several threads), instead of `elementwise_pairs`.
    shared_pairs: Option<&'a AtomicU64>,
    /// Whether this solver stopped at the pair limit.
    hit_limit: Cell<bool>,
    /// Terms of `any` / `all` evaluated so far, against `quant_limit`.
    pub quant_evals: Cell<u64>,
    /// Values of key-side functions (the `f(k)` of `f(k) op v`) evaluated so far: `kv_len`
    /// for each key-side atom and head, whose keys are then sorted once (see `key_sweeps`),
    /// however many pieces read them.
    pub key_evals: Cell<u64>,
    /// Runs of balls built so far: one per grid row within reach of the query's cell and at
    /// or above the last key's grid row, built again only when what they depend on changes
    /// (see `ball_runs`).
    pub ball_runs_built: Cell<u64>,
    /// [`MAX_QUANT_EVALS`] unless a test sets it ([`Solver::with_quant_limit`]).
    quant_limit: u64,
    /// While an `any` is solved in runs of its variable (`quant`): the depth of that
    /// variable, which pieces then range over (a piece's `q0` is its first value), and the
    /// row, fixed meanwhile.
    var_mode: Cell<Option<(usize, i64)>>,
    /// Counting the pairs `elementwise` would evaluate, not evaluating them (see
    /// [`Solver::counting`]).
    count_only: bool,
}

/// The keys `k` with `(k - start) mod m < len` (`m > 0`, `0 <= len <= m`): the solution of a
/// `%` atom, runs of `len` keys every `m` keys.
#[derive(Clone, Copy)]
struct KeyWindow {
    start: Affine,
    len: Affine,
    m: i64,
}

/// A ball's runs, one per grid row within reach: (flattened grid row, half-width), and
/// what they depend on.
#[derive(Default)]
struct BallRuns {
    key: Option<BallKey>,
    runs: Vec<BallRun>,
    /// The query columns `x` (ascending, distinct) where some run's clamp to its grid row
    /// or to the keys starts or stops holding: a piece of slope 1 from column `x0` is
    /// uniform until the first of them above `x0`.
    flips: Vec<i64>,
}

/// One run of a ball: the first key of its grid row, its half-width, and the first query
/// column from which its end is clamped to the grid row's end (`x + rx + 1 >= w`).
#[derive(Clone, Copy)]
struct BallRun {
    base: i64,
    rx: i64,
    hi_from: i64,
}

/// What a ball's runs (grid row, half-width) depend on: the grid, the metric, the radius
/// and the query's slow coordinates (t, y).
#[derive(Clone, Copy, PartialEq, Eq)]
struct BallKey {
    grid: GridId,
    metric: Metric,
    strict: bool,
    radius: i64,
    tq: i64,
    yq: i64,
}

fn overflow(span: Span) -> Flow {
    Flow::Error(
        PlanError::new(Code::Overflow, Some(span), "integer overflow")
            .with_hint(cm_ir::bind::OVERFLOW_HINT),
    )
}

impl<'a, 'p> Solver<'a, 'p> {
    pub fn new(bound: &'a Bound<'p>) -> Self {
        Solver {
            bound,
            elementwise_pairs: Cell::new(0),
            hints: RefCell::new(Vec::new()),
            ball_runs: RefCell::default(),
            vars: Cell::new([0; MAX_QUANT_DEPTH]),
            quant_cache: RefCell::default(),
            invariant: RefCell::default(),
            has_elementwise: bound.program.mask.uses_elementwise(),
            infallible: RefCell::default(),
            key_sweeps: RefCell::default(),
            grid_chains: RefCell::default(),
            grid_boxes: Cell::new(0),
            box_values: RefCell::default(),
            box_mods: RefCell::default(),
            line_grids: RefCell::default(),
            line_values: RefCell::default(),
            line_mods: RefCell::default(),
            coord_fns: RefCell::default(),
            shared_pairs: None,
            hit_limit: Cell::new(false),
            quant_evals: Cell::new(0),
            key_evals: Cell::new(0),
            ball_runs_built: Cell::new(0),
            quant_limit: MAX_QUANT_EVALS,
            var_mode: Cell::new(None),
            count_only: false,
        }
    }

    /// A solver that counts the pairs `elementwise` would evaluate instead of evaluating
    /// them, taking its predicate to hold at each (so its rows are not the mask's), with no
    /// limit: the planner's count before it evaluates any, exact for a mask whose one
    /// `elementwise` lies outside every `any` / `all` (where no predicate's value decides
    /// where it is evaluated).
    pub fn counting(bound: &'a Bound<'p>) -> Self {
        Solver {
            count_only: true,
            ..Solver::new(bound)
        }
    }

    /// This solver counting its `elementwise` pairs into `pairs`, with other solvers of the
    /// same plan, against [`MAX_ELEMENTWISE_PAIRS`].
    pub fn with_shared_pairs(mut self, pairs: &'a AtomicU64) -> Self {
        self.shared_pairs = Some(pairs);
        self
    }

    /// Whether an evaluation stopped at [`MAX_ELEMENTWISE_PAIRS`].
    pub fn hit_pair_limit(&self) -> bool {
        self.hit_limit.get()
    }

    /// CM0404 past [`MAX_ELEMENTWISE_PAIRS`], at the `elementwise` of `span`.
    pub fn pair_limit_error(span: Option<Span>) -> PlanError {
        PlanError::new(Code::TooLargeToPlan, span, format!("`elementwise` would evaluate more than {MAX_ELEMENTWISE_PAIRS} (q, k) pairs one by one"))
            .with_hint("narrow it with a solvable region, e.g. `q - 512 < k <= q & elementwise(...)`, or write the rule in solvable forms")
    }

    /// Takes the change points recorded by the evaluation that last returned
    /// [`Flow::Split`] (ascending, after the split's row); clears them.
    pub fn take_split_hints(&self, out: &mut Vec<i64>) {
        out.clear();
        std::mem::swap(out, &mut self.hints.borrow_mut());
    }

    /// Forgets recorded change points; called before each evaluation of a piece.
    pub fn clear_split_hints(&self) {
        self.hints.borrow_mut().clear();
    }

    fn env(&self, p: &Piece) -> Env {
        let mut vars = self.vars.get();
        let q = match self.var_mode.get() {
            Some((depth, q)) => {
                vars[depth] = p.q0;
                q
            }
            None => p.q0,
        };
        Env {
            q,
            k: 0,
            b: p.b,
            h: p.h,
            seg_len: 0,
            vars,
        }
    }

    /// The row `q` over the piece: affine in it, or, while pieces range over an `any`
    /// variable, the one row being solved.
    fn q_of(&self, p: &Piece, span: Span) -> Eval<Affine> {
        match self.var_mode.get() {
            Some((_, q)) => Ok(Affine::constant(q)),
            None => self.affine(p, Some(p.q0), Some(1), span),
        }
    }

    /// Builds an affine value, checking that both ends of the piece fit in 64 bits.
    fn affine(&self, p: &Piece, first: Option<i64>, step: Option<i64>, span: Span) -> Eval<Affine> {
        let (Some(first), Some(step)) = (first, step) else {
            return Err(overflow(span));
        };
        let step = if p.n == 1 { 0 } else { step };
        step.checked_mul(p.n - 1)
            .and_then(|x| x.checked_add(first))
            .ok_or_else(|| overflow(span))?;
        Ok(Affine { first, step })
    }

    /// Splits a multi-row piece after its first row, falling back to per-row evaluation.
    fn single(&self, p: &Piece) -> Flow {
        Flow::Split(p.q0 + 1)
    }

    /// The first offset `t` in `1..n` where `f(t) != f(0)`, for `f` that changes at most
    /// once over the piece (monotone), as a split.
    fn split_where(&self, p: &Piece, f: impl Fn(i64) -> bool) -> Option<Flow> {
        let f0 = f(0);
        if f(p.n - 1) == f0 {
            return None;
        }
        let (mut lo, mut hi) = (0i64, p.n - 1);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if f(mid) == f0 {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(Flow::Split(p.q0 + hi))
    }

    /// Sign-uniform comparison `x op y` over the piece, or a split where it changes.
    fn cmp(&self, p: &Piece, op: CmpOp, x: Affine, y: Affine) -> Eval<bool> {
        if x.step == y.step {
            // The difference is constant over the piece.
            return Ok(bind::cmp(op, x.first, y.first));
        }
        let d0 = i128::from(x.first) - i128::from(y.first);
        let da = i128::from(x.step) - i128::from(y.step);
        let d = |t: i64| d0 + da * i128::from(t);
        let truth = |t: i64| bind::cmp(op, d(t).signum() as i64, 0);
        match op {
            CmpOp::Eq | CmpOp::Ne => {
                if da == 0 || p.n == 1 {
                    return Ok(truth(0));
                }
                // d(t) is zero at most at one offset.
                if d0 % da == 0 {
                    let t = -d0 / da;
                    if t == 0 {
                        return Err(Flow::Split(p.q0 + 1));
                    }
                    if t > 0 && t < i128::from(p.n) {
                        return Err(Flow::Split(p.q0 + t as i64));
                    }
                }
                Ok(truth(0))
            }
            _ => match self.split_where(p, truth) {
                Some(s) => Err(s),
                None => Ok(truth(0)),
            },
        }
    }

    fn lt(&self, p: &Piece, x: Affine, y: Affine) -> Eval<bool> {
        self.cmp(p, CmpOp::Lt, x, y)
    }

    fn le(&self, p: &Piece, x: Affine, y: Affine) -> Eval<bool> {
        self.cmp(p, CmpOp::Le, x, y)
    }

    fn add(&self, p: &Piece, x: Affine, y: Affine, span: Span) -> Eval<Affine> {
        self.affine(
            p,
            x.first.checked_add(y.first),
            x.step.checked_add(y.step),
            span,
        )
    }

    fn sub(&self, p: &Piece, x: Affine, y: Affine, span: Span) -> Eval<Affine> {
        self.affine(
            p,
            x.first.checked_sub(y.first),
            x.step.checked_sub(y.step),
            span,
        )
    }

    fn scale(&self, p: &Piece, x: Affine, c: i64, span: Span) -> Eval<Affine> {
        self.affine(p, x.first.checked_mul(c), x.step.checked_mul(c), span)
    }

    /// Whether `x <= y` on every row of the piece (so at both ends: the difference is
    /// affine).
    fn le_throughout(p: &Piece, x: Affine, y: Affine) -> bool {
        x.first <= y.first && x.at(p.n - 1) <= y.at(p.n - 1)
    }

    /// `x <= y` where that holds on every row, `false` where `y <= x` does (rows where they
    /// are equal go either way), else a split where the order changes: for choices that
    /// give the same result when the two are equal.
    fn le_either(&self, p: &Piece, x: Affine, y: Affine) -> Eval<bool> {
        if Self::le_throughout(p, x, y) {
            return Ok(true);
        }
        if Self::le_throughout(p, y, x) {
            return Ok(false);
        }
        self.le(p, x, y)
    }

    /// The smaller of two values; either one where they are equal, so two values that meet
    /// only at an end of the piece (`min(q + 1, kv_len)` on the last row) do not split it.
    fn min(&self, p: &Piece, x: Affine, y: Affine) -> Eval<Affine> {
        if Self::le_throughout(p, y, x) {
            return Ok(y);
        }
        Ok(if self.le(p, x, y)? { x } else { y })
    }

    /// The larger of two values (see [`Solver::min`]).
    fn max(&self, p: &Piece, x: Affine, y: Affine) -> Eval<Affine> {
        if Self::le_throughout(p, y, x) {
            return Ok(x);
        }
        Ok(if self.le(p, x, y)? { y } else { x })
    }

    /// `floor(x / d)` for a constant `d != 0`: affine when `d` divides the slope or the
    /// quotient is constant over the piece; otherwise split where it first changes.
    fn floor_div(&self, p: &Piece, x: Affine, d: i64, span: Span) -> Eval<Affine> {
        if d == 0 {
            return Err(
                PlanError::new(Code::DivisionByZero, Some(span), "division by zero").into(),
            );
        }
        if d == 1 {
            return self.affine(p, Some(x.first), Some(x.step), span);
        }
        let q0 = bind::floor_div(x.first, d, span)?;
        if x.step == 0 || x.step % d == 0 {
            // floor((v0 + a t) / d) = floor(v0 / d) + (a / d) t exactly.
            return self.affine(p, Some(q0), Some(x.step / d), span);
        }
        // The quotient is monotone in t: it first changes where the numerator crosses the
        // next multiple of d in its direction of travel.
        let change = if d > 0 {
            // With r = v0 mod d in [0, d): rising, the first t with v0 + a t >= v0 - r + d
            // is ceil((d - r) / a); falling, the first t with v0 + a t < v0 - r is
            // floor(r / -a) + 1. Neither overflows, and this is the common case (grid
            // coordinates), so it avoids 128-bit division.
            let r = x.first.rem_euclid(d);
            let t = if x.step > 0 {
                (d - r - 1) as u64 / x.step as u64 + 1
            } else {
                r as u64 / x.step.unsigned_abs() + 1
            };
            i128::from(t)
        } else {
            // d made positive by negating both.
            let (v, a, d) = (-i128::from(x.first), -i128::from(x.step), -i128::from(d));
            let q = floor_i128(v, d);
            if a > 0 {
                // First t with v + a t >= (q + 1) d.
                ((q + 1) * d - v + a - 1) / a
            } else {
                // First t with v + a t < q d.
                (v - q * d) / -a + 1
            }
        };
        if change < i128::from(p.n) {
            return Err(Flow::Split(p.q0 + change as i64));
        }
        Ok(Affine::constant(q0))
    }

    fn floor_mod(&self, p: &Piece, x: Affine, d: i64, span: Span) -> Eval<Affine> {
        Ok(self.floor_div_mod(p, x, d, span)?.1)
    }

    /// `floor(x / d)` and `x mod d` (the sign of `d`) from one division.
    fn floor_div_mod(&self, p: &Piece, x: Affine, d: i64, span: Span) -> Eval<(Affine, Affine)> {
        let q = self.floor_div(p, x, d, span)?;
        let dq = self.scale(p, q, d, span)?;
        Ok((q, self.sub(p, x, dq, span)?))
    }

    fn constant(&self, p: &Piece, x: Affine) -> Eval<i64> {
        if x.step != 0 {
            return Err(self.single(p));
        }
        Ok(x.first)
    }

    fn point_int(&self, p: &Piece, e: &Int) -> Eval<Affine> {
        if p.n > 1 {
            return Err(self.single(p));
        }
        Ok(Affine::constant(self.bound.eval_int(e, &self.env(p))?))
    }

    /// A q-side value over the piece, affine, or a split where it stops being affine: its
    /// parts evaluated affinely, and where that splits, the value as a whole through the
    /// normal form of its floor terms ([`quasi`]).
    pub fn int(&self, p: &Piece, e: &Int) -> Eval<Affine> {
        match self.int_plain(p, e) {
            Err(Flow::Split(at)) if matches!(e.kind, IntKind::Bin(..) | IntKind::Neg(_)) => {
                self.int_quasi(p, e, at)
            }
            r => r,
        }
    }

    /// [`Solver::int`] without the normal form at this level (its parts use it through
    /// `if` conditions and ranges only).
    fn int_plain(&self, p: &Piece, e: &Int) -> Eval<Affine> {
        cm_ir::deep(|| self.int_at(p, e))
    }

    fn int_at(&self, p: &Piece, e: &Int) -> Eval<Affine> {
        let span = e.span;
        let sh = &self.bound.shape;
        Ok(match &e.kind {
            IntKind::Const(v) => Affine::constant(*v),
            IntKind::Q => self.q_of(p, span)?,
            IntKind::B => Affine::constant(p.b),
            IntKind::H => Affine::constant(p.h),
            IntKind::QLen => Affine::constant(sh.q_len),
            IntKind::KvLen => Affine::constant(sh.kv_len),
            IntKind::Batch => Affine::constant(sh.batch),
            IntKind::NumHeads => Affine::constant(sh.num_heads),
            // An integer parameter read directly: the solver meets them at every node of
            // long q-side values (NATTEN's window bounds), where building an environment for
            // the interpreter costs more than the value.
            IntKind::Param(id) => match &self.bound.params[*id] {
                cm_ir::Value::Int(v) => Affine::constant(*v),
                cm_ir::Value::Array(_) => Affine::constant(self.bound.eval_int(e, &self.env(p))?),
            },
            IntKind::SegCount(_) => Affine::constant(self.bound.eval_int(e, &self.env(p))?),
            IntKind::ArrIndex(arr, i) => {
                let idx = self.int_plain(p, i)?;
                // An array that reads q (`[q, 1]`) may differ on every row; one that reads
                // only b, h and parameters is the same over the piece.
                if idx.step != 0 || arr.reads_q() {
                    return self.point_int(p, e);
                }
                let a = self.bound.eval_arr(arr, &self.env(p))?;
                if idx.first < 0 || idx.first as usize >= a.len() {
                    return Err(PlanError::new(
                        Code::IndexOutOfRange,
                        Some(span),
                        format!(
                            "index {} is out of range for an array of length {}",
                            idx.first,
                            a.len()
                        ),
                    )
                    .into());
                }
                Affine::constant(a[idx.first as usize])
            }
            IntKind::ArrLen(arr) | IntKind::ArrSum(arr) => {
                if arr.reads_q() {
                    return self.point_int(p, e);
                }
                Affine::constant(self.bound.eval_int(e, &self.env(p))?)
            }
            IntKind::Neg(x) => {
                let x = self.int_plain(p, x)?;
                self.affine(p, x.first.checked_neg(), x.step.checked_neg(), span)?
            }
            IntKind::Abs(x) => {
                let x = self.int_plain(p, x)?;
                let nx = self.affine(p, x.first.checked_neg(), x.step.checked_neg(), span)?;
                self.max(p, x, nx)?
            }
            IntKind::Isqrt(x) => {
                let x = self.int_plain(p, x)?;
                if x.step == 0 {
                    Affine::constant(bind::isqrt(x.first, span)?)
                } else {
                    let lo = x.at(0).min(x.at(p.n - 1));
                    if lo < 0 {
                        return self.point_int(p, e);
                    }
                    let r0 = bind::isqrt(x.first, span)?;
                    if let Some(s) =
                        self.split_where(p, |t| bind::isqrt(x.at(t), span).ok() == Some(r0))
                    {
                        return Err(s);
                    }
                    Affine::constant(r0)
                }
            }
            IntKind::Bin(op, x, y) => {
                let x = self.int_plain(p, x)?;
                let y = self.int_plain(p, y)?;
                match op {
                    IntOp::Add => self.add(p, x, y, span)?,
                    IntOp::Sub => self.sub(p, x, y, span)?,
                    IntOp::Mul => {
                        if y.step == 0 {
                            self.scale(p, x, y.first, span)?
                        } else if x.step == 0 {
                            self.scale(p, y, x.first, span)?
                        } else {
                            return Err(self.single(p));
                        }
                    }
                    IntOp::Div => {
                        let d = self.constant(p, y)?;
                        self.floor_div(p, x, d, span)?
                    }
                    IntOp::Mod => {
                        let d = self.constant(p, y)?;
                        self.floor_mod(p, x, d, span)?
                    }
                    IntOp::Min => self.min(p, x, y)?,
                    IntOp::Max => self.max(p, x, y)?,
                }
            }
            IntKind::If(c, x, y) => {
                if self.boolean(p, c)? {
                    self.int_plain(p, x)?
                } else {
                    self.int_plain(p, y)?
                }
            }
            IntKind::RangeLo(r) => self.range(p, r)?.0,
            IntKind::RangeHi(r) => self.range(p, r)?.1,
            IntKind::SegIndex(s, pos) => {
                let pos = self.int_plain(p, pos)?;
                Affine::constant(self.seg_index(p, *s, pos, span)? as i64)
            }
            IntKind::GridCoord(g, axis, pos) => {
                let pos = self.int_plain(p, pos)?;
                if !self.in_grid(p, *g, pos)? {
                    return Err(self.bound.outside_grid(*g, pos.first, span, false).into());
                }
                self.grid_coords(p, *g, pos, span)?[*axis as usize]
            }
            IntKind::Var(d) => match self.var_mode.get() {
                Some((depth, _)) if depth == *d as usize => {
                    self.affine(p, Some(p.q0), Some(1), span)?
                }
                _ => Affine::constant(self.vars.get()[*d as usize]),
            },
            IntKind::K | IntKind::SegLen => {
                unreachable!("checked: k and len do not reach q-side evaluation")
            }
        })
    }

    /// Index of the segment holding `pos` (constant over the piece, else a split).
    fn seg_index(&self, p: &Piece, s: SegId, pos: Affine, span: Span) -> Eval<usize> {
        let t = &self.bound.segs[s];
        let fill = t.fill();
        if !self.within(p, pos, 0, fill)? {
            let name = &self.bound.program.segs[s].name;
            return Err(PlanError::new(
                Code::OutsideSegmentation,
                Some(span),
                format!(
                    "position {} is outside segmentation `{name}`, which covers [0, {fill})",
                    pos.first
                ),
            )
            .with_hint("segmentations fill [0, q_len) unless declared with `fill`")
            .into());
        }
        let i0 = t.index_of(pos.first);
        if pos.step != 0 {
            self.within(p, pos, t.starts[i0], t.starts[i0 + 1])?;
        }
        Ok(i0)
    }

    fn in_grid(&self, p: &Piece, g: GridId, pos: Affine) -> Eval<bool> {
        let gv = &self.bound.grids[g];
        self.within(p, pos, gv.at, gv.at.saturating_add(gv.size))
    }

    /// Whether `pos` lies in `[lo, hi)`, uniformly over the piece, or a split at the first
    /// row where that changes. Membership of an affine value can change twice (entering,
    /// then leaving), so this is not a monotone predicate for `split_where`.
    fn within(&self, p: &Piece, pos: Affine, lo: i64, hi: i64) -> Eval<bool> {
        let inside = |t: i64| (lo..hi).contains(&pos.at(t));
        let first = inside(0);
        if pos.step == 0 || p.n == 1 {
            return Ok(first);
        }
        // The first offset where the value reaches `target` (moving toward it).
        let reach = |target: i64| -> i64 {
            let d = i128::from(target) - i128::from(pos.first);
            let a = i128::from(pos.step);
            // smallest t >= 0 with a*t >= d (a > 0) or a*t <= d (a < 0)
            // A slope of one key per row (a grid's `q`) needs no division.
            let t = match a {
                1 => d,
                -1 => -d,
                _ if a > 0 => (d + a - 1).div_euclid(a),
                _ => (-d + -a - 1).div_euclid(-a),
            };
            t.clamp(0, i128::from(i64::MAX)) as i64
        };
        let change = if first {
            // Leaving through the far end.
            if pos.step > 0 {
                reach(hi)
            } else {
                reach(lo - 1)
            }
        } else if pos.step > 0 && pos.first < lo {
            let t = reach(lo);
            if t < p.n && inside(t) {
                t
            } else {
                i64::MAX
            }
        } else if pos.step < 0 && pos.first >= hi {
            let t = reach(hi - 1);
            if t < p.n && inside(t) {
                t
            } else {
                i64::MAX
            }
        } else {
            i64::MAX
        };
        if change > 0 && change < p.n {
            return Err(Flow::Split(p.q0 + change));
        }
        Ok(first)
    }

    /// Grid coordinates of `pos` (slowest axis first), for `pos` inside the grid.
    fn grid_coords(&self, p: &Piece, g: GridId, pos: Affine, span: Span) -> Eval<[Affine; 3]> {
        let gv = &self.bound.grids[g];
        let local = self.sub(p, pos, Affine::constant(gv.at), span)?;
        let nd = gv.dims.len();
        let mut out = [Affine::constant(0); 3];
        let mut rest = local;
        for axis in (0..nd).rev() {
            (rest, out[axis]) = self.floor_div_mod(p, rest, gv.dims[axis], span)?;
        }
        Ok(out)
    }

    pub fn range(&self, p: &Piece, r: &RangeE) -> Eval<(Affine, Affine)> {
        match &r.kind {
            RangeKind::Lit(lo, hi) => Ok((self.int(p, lo)?, self.int(p, hi)?)),
            RangeKind::Seg(s, pos) => {
                let pv = self.int(p, pos)?;
                let i = self.seg_index(p, *s, pv, pos.span)?;
                let t = &self.bound.segs[*s];
                Ok((
                    Affine::constant(t.starts[i]),
                    Affine::constant(t.starts[i + 1]),
                ))
            }
            RangeKind::SegAt(..) => {
                if p.n > 1 {
                    let idx = match &r.kind {
                        RangeKind::SegAt(_, i) => self.int(p, i)?,
                        _ => unreachable!(),
                    };
                    if idx.step != 0 {
                        return Err(self.single(p));
                    }
                }
                let (lo, hi) = self.bound.eval_range(r, &self.env(p))?;
                Ok((Affine::constant(lo), Affine::constant(hi)))
            }
            RangeKind::Part(s, part, pos) => {
                let pv = self.int(p, pos)?;
                let i = self.seg_index(p, *s, pv, pos.span)?;
                let (lo, hi) = self.bound.segs[*s].parts[*part][i];
                Ok((Affine::constant(lo), Affine::constant(hi)))
            }
            RangeKind::Piece(s, kind, pos) => {
                let pv = self.int(p, pos)?;
                let seg = self.seg_index(p, *s, pv, pos.span)?;
                let st = &self.bound.segs[*s];
                let t = st.pieces.as_ref().expect("checked: composite segmentation");
                let j = t.index_of(pv.first);
                self.within(p, pv, t.bounds[j], t.bounds[j + 1])?;
                let (a, b) = piece_range(t, st, *kind, pv.first, seg);
                Ok((Affine::constant(a), Affine::constant(b)))
            }
        }
    }

    pub fn boolean(&self, p: &Piece, c: &Bool) -> Eval<bool> {
        cm_ir::deep(|| self.boolean_at(p, c))
    }

    fn boolean_at(&self, p: &Piece, c: &Bool) -> Eval<bool> {
        match c {
            Bool::Const(v) => Ok(*v),
            Bool::Cmp(op, a, b) => {
                let (a, b) = (self.int(p, a)?, self.int(p, b)?);
                self.cmp(p, *op, a, b)
            }
            Bool::And(a, b) => Ok(self.boolean(p, a)? && self.boolean(p, b)?),
            Bool::Or(a, b) => Ok(self.boolean(p, a)? || self.boolean(p, b)?),
            Bool::Not(a) => Ok(!self.boolean(p, a)?),
            Bool::InGrid(g, pos) => {
                let pos = self.int(p, pos)?;
                self.in_grid(p, *g, pos)
            }
        }
    }

    fn all(&self) -> Vec<AffineInterval> {
        vec![AffineInterval::unit(
            Affine::constant(0),
            Affine::constant(self.bound.shape.kv_len),
        )]
    }

    /// The keys of `hull` (all keys for `None`) inside `[0, kv_len)`, as `[lo, hi)`.
    fn clip(&self, hull: Option<(i64, i64)>) -> (i64, i64) {
        let kv_len = self.bound.shape.kv_len;
        let (lo, hi) = hull.unwrap_or((0, kv_len));
        (lo.max(0), hi.min(kv_len))
    }

    /// An overflow unless the reference's `add(mul(alpha, k), r)` fits at every key of
    /// `hull` for every `r` in `rest` (inclusive; the rest's values over the piece), and with
    /// `min_fails` (a divisor of -1 follows) is not `i64::MIN` either: the reference forms it
    /// at each key it reaches, the solver, which moves terms instead, never does. Both are
    /// affine in `k` and `r`, so their extremes are at the corners.
    #[inline]
    fn no_overflow(
        &self,
        alpha: i64,
        rest: (i64, i64),
        min_fails: bool,
        hull: Option<(i64, i64)>,
        span: Span,
    ) -> Eval<()> {
        // Keys are below 2^26 (`MAX_LEN`): a product below 2^57 plus a rest below 2^61 fits.
        const SMALL: i64 = 1 << 61;
        if alpha.unsigned_abs() <= 1 << 31 && -SMALL <= rest.0 && rest.1 <= SMALL {
            return Ok(());
        }
        let (lo, hi) = self.clip(hull);
        if lo < hi && overflows(alpha, rest, min_fails, (lo, hi - 1)) {
            return Err(overflow(span));
        }
        Ok(())
    }

    /// `[lo, hi)` clipped to `[0, kv_len)`, as a canonical list.
    fn interval(&self, p: &Piece, lo: Affine, hi: Affine) -> Eval<Vec<AffineInterval>> {
        Ok(self.clipped(p, lo, hi)?.into_iter().collect())
    }

    /// `[lo, hi)` clipped to the keys, `None` where empty (see [`Solver::interval`]).
    fn clipped(&self, p: &Piece, lo: Affine, hi: Affine) -> Eval<Option<AffineInterval>> {
        let s = self.max(p, lo, Affine::constant(0))?;
        let e = self.min(p, hi, Affine::constant(self.bound.shape.kv_len))?;
        Ok(self.lt(p, s, e)?.then(|| AffineInterval::unit(s, e)))
    }

    /// Appends an interval that starts after every interval already in `out`, merging it
    /// into the last one when they touch.
    fn push_sorted(
        &self,
        p: &Piece,
        out: &mut Vec<AffineInterval>,
        iv: AffineInterval,
    ) -> Eval<()> {
        if let Some(last) = out.last_mut() {
            if self.le(p, iv.start, last.end)? {
                last.end = self.max(p, last.end, iv.end)?;
                return Ok(());
            }
        }
        out.push(iv);
        Ok(())
    }

    fn union(
        &self,
        p: &Piece,
        a: Vec<AffineInterval>,
        b: Vec<AffineInterval>,
    ) -> Eval<Vec<AffineInterval>> {
        if a.is_empty() {
            return Ok(b);
        }
        if b.is_empty() {
            return Ok(a);
        }
        if has_strided(&a) || has_strided(&b) {
            // Strided runs stay when the lists do not meet (not even touching) on any row;
            // else their keys are merged as plain intervals.
            let apart = |x: &[AffineInterval], y: &[AffineInterval]| {
                let (e, s) = (x[x.len() - 1].end, y[0].start);
                e.at(0) < s.at(0) && e.at(p.n - 1) < s.at(p.n - 1)
            };
            let (mut x, y) = if apart(&a, &b) {
                (a, b)
            } else if apart(&b, &a) {
                (b, a)
            } else {
                let (a, b) = (self.unit_list(a)?, self.unit_list(b)?);
                return self.union(p, a, b);
            };
            x.extend(y);
            return Ok(x);
        }
        // One list entirely before the other (at most touching) on every row: the merge
        // below would take all of it, then the other's first interval (merging it when they
        // touch), then the rest of the other, which cannot touch (canonical lists). Only the
        // touching test can split; it is made the same way.
        let before = |x: &[AffineInterval], y: &[AffineInterval]| {
            let (e, s) = (x[x.len() - 1].end, y[0].start);
            e.at(0) <= s.at(0) && e.at(p.n - 1) <= s.at(p.n - 1)
        };
        let (head, tail) = if before(&a, &b) {
            (a, b)
        } else if before(&b, &a) {
            (b, a)
        } else {
            return self.union_merge(p, a, b);
        };
        // The shorter list is copied into the longer one (a few keys before a long list,
        // like the text keys before an image's, are put in front of it).
        if head.len() >= tail.len() {
            let mut out = head;
            out.reserve(tail.len());
            self.push_sorted(p, &mut out, tail[0])?;
            out.extend_from_slice(&tail[1..]);
            return Ok(out);
        }
        let mut out = tail;
        let last = head[head.len() - 1];
        // As `push_sorted` would merge the tail's first interval into the head's last.
        let keep = if self.le(p, out[0].start, last.end)? {
            out[0] = AffineInterval {
                end: self.max(p, last.end, out[0].end)?,
                ..last
            };
            head.len() - 1
        } else {
            head.len()
        };
        out.splice(0..0, head[..keep].iter().copied());
        Ok(out)
    }

    /// The union of any intervals that are canonical for every row of the piece one by one:
    /// sorted by start (at the piece's first row, then its last), each adjacent order checked
    /// over the piece (splitting where it changes), then merged in one pass.
    fn union_all(&self, p: &Piece, all: Vec<AffineInterval>) -> Eval<Vec<AffineInterval>> {
        let mut all = self.unit_list(all)?;
        let last = p.n - 1;
        all.sort_unstable_by_key(|iv| (iv.start.at(0), iv.start.at(last)));
        for w in all.windows(2) {
            // Sorted at both ends of the piece, so sorted on every row unless this splits.
            self.le(p, w[0].start, w[1].start)?;
        }
        let mut out: Vec<AffineInterval> = Vec::with_capacity(all.len());
        for iv in all {
            self.push_sorted(p, &mut out, iv)?;
        }
        Ok(out)
    }

    /// The general merge of two canonical lists.
    fn union_merge(
        &self,
        p: &Piece,
        a: Vec<AffineInterval>,
        b: Vec<AffineInterval>,
    ) -> Eval<Vec<AffineInterval>> {
        let (a, b) = (self.unit_list(a)?, self.unit_list(b)?);
        let mut out = Vec::with_capacity(a.len() + b.len());
        let (mut i, mut j) = (0, 0);
        while i < a.len() || j < b.len() {
            let take_a =
                j >= b.len() || (i < a.len() && self.le_either(p, a[i].start, b[j].start)?);
            let next = if take_a {
                i += 1;
                a[i - 1]
            } else {
                j += 1;
                b[j - 1]
            };
            self.push_sorted(p, &mut out, next)?;
        }
        Ok(out)
    }

    fn inter(
        &self,
        p: &Piece,
        a: &[AffineInterval],
        b: &[AffineInterval],
    ) -> Eval<Vec<AffineInterval>> {
        if has_strided(a) && has_strided(b) {
            let (a, b) = (self.unit_list(a.to_vec())?, self.unit_list(b.to_vec())?);
            return self.inter(p, &a, &b);
        }
        // With strided runs on one side only, a run cut to a plain interval is the run's
        // residue on the cut (`strided_inter`), so `(q - k) % d == 0 & k > q - w & k <= q`
        // stays one run per row as `q - w < k <= q & (q - k) % d == 0` does, instead of a
        // key per interval (a piece per row where the run's anchor alternates).
        let mut out = Vec::new();
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            let s = self.max(p, a[i].start, b[j].start)?;
            let e = self.min(p, a[i].end, b[j].end)?;
            if self.lt(p, s, e)? {
                let run = if a[i].stride != 1 { a[i] } else { b[j] };
                if run.stride == 1 {
                    out.push(AffineInterval::unit(s, e));
                } else {
                    let cut = AffineInterval::unit(s, e);
                    // Keys lie in `[0, kv_len]`, so this arithmetic cannot overflow.
                    let keys = self.residue_run(p, run.start, run.stride, &cut, Span::default())?;
                    out.extend(keys);
                }
            }
            // Where the ends are equal either list may advance: only a strict change of
            // order splits the piece.
            if self.le_either(p, a[i].end, b[j].end)? {
                i += 1;
            } else {
                j += 1;
            }
        }
        Ok(out)
    }

    fn complement(&self, p: &Piece, a: &[AffineInterval]) -> Eval<Vec<AffineInterval>> {
        if has_strided(a) {
            let a = self.unit_list(a.to_vec())?;
            return self.complement(p, &a);
        }
        let mut out = Vec::with_capacity(a.len() + 1);
        let mut prev = Affine::constant(0);
        for iv in a {
            if self.lt(p, prev, iv.start)? {
                out.push(AffineInterval::unit(prev, iv.start));
            }
            prev = iv.end;
        }
        let end = Affine::constant(self.bound.shape.kv_len);
        if self.lt(p, prev, end)? {
            out.push(AffineInterval::unit(prev, end));
        }
        Ok(out)
    }

    /// The list with every strided run written as its keys, one plain interval each (the
    /// same number on every row of the piece, each key moving as the run's start).
    fn unit_list(&self, list: Vec<AffineInterval>) -> Eval<Vec<AffineInterval>> {
        if !has_strided(&list) {
            return Ok(list);
        }
        let mut total = 0usize;
        for iv in &list {
            total += if iv.stride == 1 {
                1
            } else {
                ((iv.end.first - 1 - iv.start.first) / iv.stride + 1) as usize
            };
        }
        if total > MAX_INTERVALS {
            return Err(too_many_intervals().into());
        }
        let mut out = Vec::with_capacity(total);
        for iv in list {
            if iv.stride == 1 {
                out.push(iv);
                continue;
            }
            let mut k = iv.start;
            while k.first < iv.end.first {
                out.push(AffineInterval::unit(
                    k,
                    Affine {
                        first: k.first + 1,
                        step: k.step,
                    },
                ));
                k.first += iv.stride;
            }
        }
        Ok(out)
    }

    /// `list & w` for a window `w` of one residue every `m >= 2` keys (`(q - k) % m == 0`
    /// and the like), as at most one run per interval of `list`: the keys of `[x, e)` with
    /// `k == start (mod m)` run from `start + m * ceil((x - start) / m)` to `start + m *
    /// floor((e - 1 - start) / m)`, each affine where the quotients are, so a dilated
    /// window is one strided run per row in pieces as long as the band's. `None` when the
    /// window is not of that form on the piece or `list` holds strided runs itself.
    fn strided_inter(
        &self,
        p: &Piece,
        w: KeyWindow,
        list: &[AffineInterval],
        span: Span,
    ) -> Eval<Option<Vec<AffineInterval>>> {
        let single = w.m >= 2 && w.len.step == 0 && w.len.first == 1;
        if !single || has_strided(list) {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(list.len());
        for iv in list {
            out.extend(self.residue_run(p, w.start, w.m, iv, span)?);
        }
        Ok(Some(out))
    }

    /// The keys of the plain interval `iv = [x, e)` with `k == start (mod m)`, `m >= 2`:
    /// from `start + m * ceil((x - start) / m)` to `start + m * floor((e - 1 - start) / m)`,
    /// a strided run (a plain interval for one key, nothing for none).
    fn residue_run(
        &self,
        p: &Piece,
        start: Affine,
        m: i64,
        iv: &AffineInterval,
        span: Span,
    ) -> Eval<Option<AffineInterval>> {
        // ceil((x - start) / m) = -floor((start - x) / m)
        let up = self.floor_div(p, self.sub(p, start, iv.start, span)?, m, span)?;
        let first = self.sub(p, start, self.scale(p, up, m, span)?, span)?;
        let last_end = self.sub(p, iv.end, Affine::constant(1), span)?;
        let down = self.floor_div(p, self.sub(p, last_end, start, span)?, m, span)?;
        let last = self.add(p, start, self.scale(p, down, m, span)?, span)?;
        let gap = self.sub(p, last, first, span)?;
        if gap.step != 0 {
            // The number of keys changes along the piece: one row at a time.
            return Err(self.single(p));
        }
        let end = self.add(p, last, Affine::constant(1), span)?;
        Ok(match gap.first.cmp(&0) {
            std::cmp::Ordering::Less => None,
            std::cmp::Ordering::Equal => Some(AffineInterval::unit(first, end)),
            std::cmp::Ordering::Greater => Some(AffineInterval {
                start: first,
                end,
                stride: m,
            }),
        })
    }

    /// Keys with `alpha * k + rest  op  0`.
    fn kcmp_keys(
        &self,
        p: &Piece,
        alpha: i64,
        rest: Affine,
        op: CmpOp,
        span: Span,
    ) -> Eval<Vec<AffineInterval>> {
        // Far outside the keys the comparison's outcome no longer changes, so a constant
        // term beyond `alpha * kv_len + 2` can be clamped exactly; this keeps `k <= i64::MAX`
        // from overflowing below. A larger reach is not clamped (a bound below it would
        // change the outcome); the checked arithmetic below reports what overflows.
        let reach = alpha
            .unsigned_abs()
            .saturating_mul(self.bound.shape.kv_len as u64)
            .saturating_add(2);
        let rest = if rest.step == 0 && reach <= i64::MAX as u64 / 4 {
            let m = reach as i64;
            Affine::constant(rest.first.clamp(-m, m))
        } else {
            rest
        };
        let (alpha, rest, op) = if alpha < 0 {
            let neg = self.affine(p, rest.first.checked_neg(), rest.step.checked_neg(), span)?;
            (
                alpha.checked_neg().ok_or_else(|| overflow(span))?,
                neg,
                op.flip(),
            )
        } else {
            (alpha, rest, op)
        };
        let neg = self.affine(p, rest.first.checked_neg(), rest.step.checked_neg(), span)?;
        let one = Affine::constant(1);
        let lo_inf = Affine::constant(0);
        let hi_inf = Affine::constant(self.bound.shape.kv_len);
        // alpha * k < -rest  <=>  k <= floor((-rest - 1) / alpha), and so on.
        let ceil_neg = |s: &Self| -> Eval<Affine> {
            let f = s.floor_div(p, rest, alpha, span)?;
            s.affine(p, f.first.checked_neg(), f.step.checked_neg(), span)
        };
        match op {
            CmpOp::Lt => {
                let hi = self.add(
                    p,
                    self.floor_div(p, self.sub(p, neg, one, span)?, alpha, span)?,
                    one,
                    span,
                )?;
                self.interval(p, lo_inf, hi)
            }
            CmpOp::Le => {
                let hi = self.add(p, self.floor_div(p, neg, alpha, span)?, one, span)?;
                self.interval(p, lo_inf, hi)
            }
            CmpOp::Gt => {
                let lo = self.add(p, self.floor_div(p, neg, alpha, span)?, one, span)?;
                self.interval(p, lo, hi_inf)
            }
            CmpOp::Ge => self.interval(p, ceil_neg(self)?, hi_inf),
            CmpOp::Eq | CmpOp::Ne => {
                let lo = ceil_neg(self)?;
                let hi = self.add(p, self.floor_div(p, neg, alpha, span)?, one, span)?;
                let eq = self.interval(p, lo, hi)?;
                if op == CmpOp::Eq {
                    Ok(eq)
                } else {
                    self.complement(p, &eq)
                }
            }
        }
    }

    /// Evaluates a region over a piece. `hull` bounds the keys the caller will keep on every
    /// row of the piece, so enumerating atoms (`%`, `elementwise`, key-side values) need not
    /// look beyond it: the list is exact inside the hull and may hold anything outside it
    /// (a complement of what was enumerated inside).
    pub fn region(
        &self,
        p: &Piece,
        r: &Region,
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        cm_ir::deep(|| self.region_in(p, r, hull))
    }

    fn region_in(
        &self,
        p: &Piece,
        r: &Region,
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        match r {
            Region::Rows(c) => Ok(if self.boolean(p, c)? {
                self.all()
            } else {
                Vec::new()
            }),
            Region::KCmp {
                alpha,
                rest,
                op,
                span,
            } => self.kcmp(p, r, *alpha, rest, *op, *span, hull),
            Region::KDiv {
                alpha,
                rest,
                div,
                op,
                rhs,
                span,
            } => {
                let d = self.int(p, div)?;
                let d = self.constant(p, d)?;
                if d == 0 {
                    return Err(PlanError::new(
                        Code::DivisionByZero,
                        Some(div.span),
                        "division by zero",
                    )
                    .into());
                }
                let rest = self.int(p, rest)?;
                // `floor(x / -1)` overflows for `x = i64::MIN`.
                self.no_overflow(*alpha, ends(p, rest), d == -1, hull, *span)?;
                let (alpha, rest, d) = if d < 0 {
                    let Some(neg_d) = d.checked_neg() else {
                        return Err(overflow(div.span));
                    };
                    (
                        alpha.checked_neg().ok_or_else(|| overflow(*span))?,
                        self.affine(p, rest.first.checked_neg(), rest.step.checked_neg(), *span)?,
                        neg_d,
                    )
                } else {
                    (*alpha, rest, d)
                };
                let v = self.int(p, rhs)?;
                let lo = self.scale(p, v, d, *span)?;
                let hi = self.add(p, lo, Affine::constant(d), *span)?;
                // floor(x / d) compared with v is x compared with v*d or (v+1)*d.
                let x_minus = |bound: Affine| self.sub(p, rest, bound, *span);
                match op {
                    CmpOp::Ge => self.kcmp_keys(p, alpha, x_minus(lo)?, CmpOp::Ge, *span),
                    CmpOp::Lt => self.kcmp_keys(p, alpha, x_minus(lo)?, CmpOp::Lt, *span),
                    CmpOp::Le => self.kcmp_keys(p, alpha, x_minus(hi)?, CmpOp::Lt, *span),
                    CmpOp::Gt => self.kcmp_keys(p, alpha, x_minus(hi)?, CmpOp::Ge, *span),
                    CmpOp::Eq | CmpOp::Ne => {
                        let a = self.kcmp_keys(p, alpha, x_minus(lo)?, CmpOp::Ge, *span)?;
                        let b = self.kcmp_keys(p, alpha, x_minus(hi)?, CmpOp::Lt, *span)?;
                        let eq = self.inter(p, &a, &b)?;
                        if *op == CmpOp::Eq {
                            Ok(eq)
                        } else {
                            self.complement(p, &eq)
                        }
                    }
                }
            }
            Region::KMod { .. } => {
                let (w, span) = self.kmod_of(p, r, hull)?.expect("a `%` atom");
                self.window_keys(p, w, hull, span)
            }
            Region::Elementwise(c, espan) => {
                if p.n > 1 {
                    return Err(self.single(p));
                }
                let (lo, hi) = hull.unwrap_or((0, self.bound.shape.kv_len));
                self.elementwise_keys(p, c, *espan, &[(lo, hi)])
            }
            Region::Ball {
                grid,
                metric,
                strict,
                radius,
                span,
            } => self.ball(p, *grid, *metric, *strict, radius, *span, hull),
            Region::Box { grid, ranges, span } => self.grid_box(p, *grid, ranges, *span),
            Region::Path { tree, pos, span } => self.tree_path(p, *tree, pos, *span),
            Region::KeyCmp { f, op, v, span } => {
                // The reference evaluates `f` at every key it reaches.
                if let Some(e) = self.key_failure_in(p, r, f, hull) {
                    return Err(e.into());
                }
                self.key_cmp(p, r, f, *op, v, *span, hull)
            }
            Region::Union(a, b) => {
                if !matches!(**a, Region::Union(..)) && !matches!(**b, Region::Union(..)) {
                    // A predicate that cannot fail is evaluated only at the keys the other
                    // side leaves out, after it (the reference evaluates both sides
                    // everywhere, but only the other side's errors can be met).
                    if let Some(e) = self.infallible_elementwise(p, a)? {
                        let y = self.region(p, b, hull)?;
                        return self.union_elementwise(p, y, e, hull);
                    }
                    let x = self.region(p, a, hull)?;
                    if let Some(e) = self.infallible_elementwise(p, b)? {
                        return self.union_elementwise(p, x, e, hull);
                    }
                    let y = self.region(p, b, hull)?;
                    return self.union(p, x, y);
                }
                // A chain of unions (`k == 5 | k == 17 | k == q | ...`): every operand, left
                // to right as the reference evaluates them, then one sort and merge instead
                // of one merge per operand.
                let mut operands = Vec::new();
                let mut stack = vec![r];
                while let Some(x) = stack.pop() {
                    match x {
                        Region::Union(a, b) => {
                            stack.push(b);
                            stack.push(a);
                        }
                        other => operands.push(other),
                    }
                }
                let mut all = Vec::new();
                let mut open = Vec::new();
                for x in operands {
                    match self.infallible_elementwise(p, x)? {
                        // As for two operands: after the others, at the keys they leave out.
                        Some(e) => open.push(e),
                        None => all.extend(self.region(p, x, hull)?),
                    }
                }
                let mut out = self.union_all(p, all)?;
                for e in open {
                    out = self.union_elementwise(p, out, e, hull)?;
                }
                Ok(out)
            }
            Region::Inter(a, b) | Region::Diff(a, b) => {
                let is_inter = matches!(r, Region::Inter(..));
                if is_inter {
                    let grid = *self
                        .grid_chains
                        .borrow_mut()
                        .entry(r as *const Region as usize)
                        .or_insert_with(|| grid_box::chain_grid(r));
                    if let Some(g) = grid {
                        if let Some(v) = self.grid_box_chain(p, r, g)? {
                            self.grid_boxes.set(self.grid_boxes.get() + 1);
                            return Ok(v);
                        }
                    }
                    if let Some(v) = self.sparse_first_inter(p, a, b, hull)? {
                        return Ok(v);
                    }
                }
                if let Some((c, espan)) = self.infallible_elementwise(p, a)? {
                    // The reference evaluates the right side only where the predicate on the
                    // left holds. That predicate cannot fail, so when the right side solves
                    // on the whole hull the predicate is evaluated only at its keys (`&`) or
                    // outside them (`-`); else (the right side fails somewhere on the hull)
                    // both are evaluated as the reference orders them, below.
                    if let Ok(y) = self.region(p, b, hull) {
                        if !has_strided(&y) {
                            let (lo, hi) = hull.unwrap_or((0, self.bound.shape.kv_len));
                            let ranges = if is_inter {
                                single_row_ranges(&y, (lo, hi))
                            } else {
                                single_row_gaps(&y, (lo, hi))
                            };
                            return self.elementwise_keys(p, c, espan, &ranges);
                        }
                    }
                }
                let x = self.region(p, a, hull)?;
                if x.is_empty() {
                    return Ok(x);
                }
                // Like the reference, the right side is evaluated only where the left side
                // holds: not at all when none of its keys lies in the hull.
                let inner = narrow(keys_hull(p, &x), hull);
                if inner.0 >= inner.1 {
                    return Ok(Vec::new());
                }
                if let (Region::Elementwise(c, espan), 1) = (self.through_conds(p, b)?, p.n) {
                    // The reference evaluates the right side only where the left one holds:
                    // the predicate is evaluated at the left side's keys alone (a strided
                    // run's keys, not its span).
                    let y = self.elementwise_keys(p, c, *espan, &single_row_keys(&x, inner))?;
                    return if is_inter {
                        Ok(y)
                    } else {
                        let not_y = self.complement(p, &y)?;
                        self.inter(p, &x, &not_y)
                    };
                }
                if is_inter {
                    if let Some((w, span)) = self.kmod_of(p, b, Some(inner))? {
                        if let Some(v) = self.strided_inter(p, w, &x, span)? {
                            return Ok(v);
                        }
                    }
                }
                self.where_holds(p, &x, b, is_inter, hull)
            }
            Region::Not(a) => {
                let x = self.region(p, a, hull)?;
                self.complement(p, &x)
            }
            Region::Cond(c, a, b) => {
                if self.boolean(p, c)? {
                    self.region(p, a, hull)
                } else {
                    self.region(p, b, hull)
                }
            }
            Region::Quant {
                all,
                depth,
                lo,
                hi,
                body,
                span,
            } => {
                let invariant = !r.reads_q() && !r.reads_outer_vars(*depth);
                let key = (r as *const Region as usize, p.h);
                // Solved once on all keys when it is kept for every row, unless that fails
                // (at keys the reference may not reach): then within the hull, each time.
                let cached = self.quant_cache.borrow().get(&key).cloned();
                if let Some(Some(v)) = cached {
                    return Ok(v);
                }
                let lo = self.int(p, lo)?;
                let hi = self.int(p, hi)?;
                let range = bind::quant_range(self.constant(p, lo)?, self.constant(p, hi)?, *span)?;
                let outer = self.vars.get();
                let (depth, all) = (*depth as usize, *all);
                let once = invariant && cached.is_none();
                if !once && p.n == 1 {
                    let out = self.quant_in_runs(p, all, depth, range, body, hull, *span);
                    self.vars.set(outer);
                    return out;
                }
                // Over a run of an enclosing variable, terms cost one evaluation each, and
                // that variable's values one by one cost about one run each.
                if !once && self.var_mode.get().is_some() && range.end - range.start > p.n {
                    return Err(self.single(p));
                }
                self.count_quant_evals(range.end - range.start, *span)?;
                let mut out = if once {
                    self.quantifier(p, all, depth, range.clone(), body, None)
                } else {
                    self.quantifier(p, all, depth, range.clone(), body, hull)
                };
                if once {
                    self.quant_cache
                        .borrow_mut()
                        .insert(key, out.as_ref().ok().cloned());
                    if out.is_err() {
                        out = self.quantifier(p, all, depth, range, body, hull);
                    }
                }
                self.vars.set(outer);
                out
            }
        }
    }

    /// `x & r` (`keep`) or `x - r` within `hull`, `r` evaluated where `x` holds, as the
    /// reference evaluates the right side of `&` and `-`: over the hull of `x`'s keys, or,
    /// where that fails (maybe in `x`'s gaps, where the reference does not evaluate `r`), over
    /// each interval of `x` apart.
    fn where_holds(
        &self,
        p: &Piece,
        x: &[AffineInterval],
        r: &Region,
        keep: bool,
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        let part = |x: &[AffineInterval]| -> Eval<Vec<AffineInterval>> {
            let inner = narrow(keys_hull(p, x), hull);
            if inner.0 >= inner.1 {
                return Ok(Vec::new());
            }
            let y = self.region(p, r, Some(inner))?;
            if keep {
                self.inter(p, x, &y)
            } else {
                let not_y = self.complement(p, &y)?;
                self.inter(p, x, &not_y)
            }
        };
        if x.is_empty() {
            return Ok(Vec::new());
        }
        match part(x) {
            Err(Flow::Error(_)) if x.len() > 1 => {
                // Each part lies inside its interval, and the intervals are apart.
                let mut out = Vec::new();
                for iv in x {
                    out.extend(part(std::slice::from_ref(iv))?);
                }
                Ok(out)
            }
            out => out,
        }
    }

    /// The keys of `alpha * k + rest  op  0` (atom `r`) within `hull`.
    #[allow(clippy::too_many_arguments)]
    fn kcmp(
        &self,
        p: &Piece,
        r: &Region,
        alpha: i64,
        rest: &Int,
        op: CmpOp,
        span: Span,
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        let key = (r as *const Region as usize, p.b, p.h);
        if let Some((_, keys, value)) = self.invariant.borrow().iter().find(|(k, ..)| *k == key) {
            self.no_overflow(alpha, (*value, *value), false, hull, span)?;
            return Ok(keys.clone());
        }
        let value = self.int(p, rest)?;
        self.no_overflow(alpha, ends(p, value), false, hull, span)?;
        let keys = self.kcmp_keys(p, alpha, value, op, span)?;
        let mut cache = self.invariant.borrow_mut();
        if cache.len() < MAX_INVARIANT
            && !rest.mentions(&|x| matches!(x, IntKind::Q | IntKind::Var(_)))
        {
            cache.push((key, keys.clone(), value.first));
        }
        Ok(keys)
    }

    /// How key-side atom `r` (its function `f`) fails at a key of `hull`, if it does.
    fn key_failure_in(
        &self,
        p: &Piece,
        r: &Region,
        f: &Int,
        hull: Option<(i64, i64)>,
    ) -> Option<PlanError> {
        let sweep = self.key_sweep(p, r, f);
        sweep
            .first_failing(&[self.clip(hull)])
            .and(sweep.error.clone())
    }

    /// The predicate of `r`, when `r` stands on this one-row piece (its `if`s on the row
    /// decided) for an `elementwise` whose predicate fails at no pair of the plan
    /// ([`Bound::never_fails`], decided once per predicate). Such a predicate may be
    /// evaluated at fewer keys than the reference evaluates it at: only where the regions
    /// around it leave the answer open, since no error of it can be missed.
    fn infallible_elementwise<'r>(
        &self,
        p: &Piece,
        r: &'r Region,
    ) -> Eval<Option<(&'r Bool, Span)>> {
        if !self.has_elementwise || p.n != 1 {
            return Ok(None);
        }
        let Region::Elementwise(c, span) = self.through_conds(p, r)? else {
            return Ok(None);
        };
        let key = c as *const Bool as usize;
        let known = self
            .infallible
            .borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|x| x.1);
        let never_fails = known.unwrap_or_else(|| {
            let v = self.bound.never_fails(c);
            self.infallible.borrow_mut().push((key, v));
            v
        });
        Ok(never_fails.then_some((c, *span)))
    }

    /// `known | elementwise(c)` on a one-row piece, `c` evaluated only at the keys of the
    /// hull outside `known` (all of the hull when `known` holds strided runs).
    fn union_elementwise(
        &self,
        p: &Piece,
        known: Vec<AffineInterval>,
        (c, span): (&Bool, Span),
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        let hull = hull.unwrap_or((0, self.bound.shape.kv_len));
        let ranges = if has_strided(&known) {
            vec![hull]
        } else {
            single_row_gaps(&known, hull)
        };
        let y = self.elementwise_keys(p, c, span, &ranges)?;
        self.union(p, known, y)
    }

    /// The keys of `ranges` (ascending, disjoint, on the one row of `p`) where `c` holds,
    /// evaluated pair by pair in key order, stopping at the first error (the reference's,
    /// which walks the keys in order). The pairs count towards [`MAX_ELEMENTWISE_PAIRS`]
    /// (with the other solvers of the plan when they share a count).
    fn elementwise_keys(
        &self,
        p: &Piece,
        c: &Bool,
        span: Span,
        ranges: &[(i64, i64)],
    ) -> Eval<Vec<AffineInterval>> {
        match self.elementwise_scan(p, c, span, ranges)? {
            (keys, None) => Ok(keys),
            (_, Some((_, e))) => Err(e.into()),
        }
    }

    /// [`Solver::elementwise_keys`], stopping at the first key where `c` fails: the keys
    /// before it where `c` holds, and the key with its error.
    fn elementwise_scan(
        &self,
        p: &Piece,
        c: &Bool,
        span: Span,
        ranges: &[(i64, i64)],
    ) -> Eval<Scan> {
        self.scan(p, span, ranges, |env| self.bound.eval_bool(c, env))
    }

    /// The keys of `ranges` (ascending, disjoint, on the one row of `p`) where `holds`, asked
    /// pair by pair in key order up to the first key where it fails (that key and its error
    /// returned with the keys before it); the pairs count as `elementwise` pairs, against
    /// [`MAX_ELEMENTWISE_PAIRS`] (CM0404 at `span` past it).
    fn scan(
        &self,
        p: &Piece,
        span: Span,
        ranges: &[(i64, i64)],
        holds: impl Fn(&Env) -> cm_ir::PResult<bool>,
    ) -> Eval<Scan> {
        let pairs: u64 = ranges.iter().map(|&(a, z)| (z - a).max(0) as u64).sum();
        if self.count_only {
            let mut keys: Vec<AffineInterval> = Vec::new();
            for &(a, z) in ranges.iter().filter(|(a, z)| a < z) {
                match keys.last_mut() {
                    Some(last) if last.end.first == a => last.end.first = z,
                    _ => keys.push(AffineInterval::unit(
                        Affine::constant(a),
                        Affine::constant(z),
                    )),
                }
            }
            self.count_pairs(pairs, 0);
            return Ok((keys, None));
        }
        let total = match self.shared_pairs {
            Some(shared) => shared.fetch_add(pairs, Ordering::Relaxed) + pairs,
            None => self.elementwise_pairs.get() + pairs,
        };
        if total > MAX_ELEMENTWISE_PAIRS {
            self.hit_limit.set(true);
            return Err(Self::pair_limit_error(Some(span)).into());
        }
        let mut left = pairs;
        let mut env = self.env(p);
        let mut out: Vec<AffineInterval> = Vec::new();
        for &(a, z) in ranges {
            for k in a..z {
                env.k = k;
                left -= 1;
                match holds(&env) {
                    Ok(true) => match out.last_mut() {
                        Some(last) if last.end.first == k => last.end.first += 1,
                        _ => out.push(AffineInterval::unit(
                            Affine::constant(k),
                            Affine::constant(k + 1),
                        )),
                    },
                    Ok(false) => {}
                    Err(e) => {
                        self.count_pairs(pairs - left, left);
                        return Ok((out, Some((k, e))));
                    }
                }
            }
        }
        self.count_pairs(pairs, 0);
        Ok((out, None))
    }

    /// Counts `evaluated` pairs as evaluated one by one, and gives back `unused` pairs that
    /// [`Solver::scan`] counted against the limit before a failure stopped it.
    fn count_pairs(&self, evaluated: u64, unused: u64) {
        if let Some(shared) = self.shared_pairs {
            shared.fetch_sub(unused, Ordering::Relaxed);
        }
        self.elementwise_pairs
            .set(self.elementwise_pairs.get().saturating_add(evaluated));
    }

    /// The union (`any`) or intersection (`all`) of `body` over the variable's values in
    /// `range`. A term that splits the piece does not stop the others: the piece ends at the
    /// first such row and the others go to the driver as later change points, so a piece
    /// costs one pass over the terms however they are ordered. An error is returned only
    /// when no earlier term split (the reference meets it first on the piece's first row).
    fn quantifier(
        &self,
        p: &Piece,
        all: bool,
        depth: usize,
        range: std::ops::Range<i64>,
        body: &Region,
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        let mut vars = self.vars.get();
        let mut splits: Vec<i64> = Vec::new();
        let mut found = Vec::new();
        let mut acc = self.all();
        for i in range {
            vars[depth] = i;
            self.vars.set(vars);
            // `all` is a chain of `&`: each term evaluated where the earlier ones hold.
            let term = if all {
                self.where_holds(p, &acc, body, true, hull)
            } else {
                self.region(p, body, hull)
            };
            match term {
                Ok(v) if all => {
                    if splits.is_empty() {
                        acc = v;
                        // Like `&`: later terms are not evaluated where none is left.
                        if acc.is_empty() {
                            break;
                        }
                    }
                }
                Ok(v) => found.extend(v),
                Err(Flow::Split(s)) => splits.push(s),
                Err(e) if splits.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        if !splits.is_empty() {
            splits.sort_unstable();
            splits.dedup();
            let first = splits.remove(0);
            *self.hints.borrow_mut() = splits;
            return Err(Flow::Split(first));
        }
        if all {
            Ok(acc)
        } else {
            self.union_all(p, found)
        }
    }

    /// The keys of `(alpha * k + rest) mod div  op  rhs` over the piece as a residue window
    /// ([`KeyWindow`]). `div` must be constant over the piece (else one row at a time).
    /// Row-level values (`div`, `rest`, `rhs`), whose errors do not depend on `k`, and the
    /// overflow of `alpha * k + rest` at the keys of `hull`.
    #[allow(clippy::too_many_arguments)]
    fn kmod_window(
        &self,
        p: &Piece,
        alpha: i64,
        rest: &Int,
        div: &Int,
        op: CmpOp,
        rhs: &Int,
        span: Span,
        hull: Option<(i64, i64)>,
    ) -> Eval<KeyWindow> {
        let d = self.int(p, div)?;
        let d = self.constant(p, d)?;
        if d == 0 {
            return Err(
                PlanError::new(Code::DivisionByZero, Some(div.span), "modulo by zero").into(),
            );
        }
        let r = self.int(p, rest)?;
        self.no_overflow(alpha, ends(p, r), false, hull, span)?;
        // `(±k + rest) % d == x % d` (or `!=`): the window is one residue anchored at `x`
        // itself, since only the anchor's residue matters, so `k % d == q % d` is a run
        // along the whole band rather than a piece per residue of q. `x % d` cannot fail
        // once `x` and `d` evaluate (d is not 0), so its errors are those of `x` and `d`.
        let (v, is_residue) = match &rhs.kind {
            IntKind::Bin(IntOp::Mod, x, dx) if matches!(op, CmpOp::Eq | CmpOp::Ne) => {
                let dxv = self.int(p, dx)?;
                if self.constant(p, dxv)? == d {
                    (self.int(p, x)?, true)
                } else {
                    (self.int(p, rhs)?, false)
                }
            }
            _ => (self.int(p, rhs)?, false),
        };
        let neg = |x: Affine| self.affine(p, x.first.checked_neg(), x.step.checked_neg(), span);
        // x mod d == -((-x) mod -d) for d < 0, so a negative divisor is the positive one with
        // k's coefficient, the rest and the compared value negated and the comparison
        // flipped; then the residue u = (alpha * k + r) mod m lies in [0, m).
        let (m, alpha, r, v, op) = if d < 0 {
            let m = d.checked_neg().ok_or_else(|| overflow(span))?;
            (m, -alpha, neg(r)?, neg(v)?, op.flip())
        } else {
            (d, alpha, r, v, op)
        };
        let zero = Affine::constant(0);
        let full = Affine::constant(m);
        let one = Affine::constant(1);
        let clamp = |x: Affine| -> Eval<Affine> { self.min(p, self.max(p, x, zero)?, full) };
        // The residues u that satisfy `u op v`: the cyclic run [lo, lo + len), len in [0, m].
        let (lo, len) = match op {
            CmpOp::Eq | CmpOp::Ne => {
                let hit = is_residue || self.within(p, v, 0, m)?;
                match (op == CmpOp::Eq, hit) {
                    (true, true) => (v, one),
                    (true, false) => (zero, zero),
                    (false, true) => (self.add(p, v, one, span)?, Affine::constant(m - 1)),
                    (false, false) => (zero, full),
                }
            }
            CmpOp::Lt => (zero, clamp(v)?),
            CmpOp::Le => (zero, clamp(self.add(p, v, one, span)?)?),
            CmpOp::Gt | CmpOp::Ge => {
                let first = if op == CmpOp::Gt {
                    self.add(p, v, one, span)?
                } else {
                    v
                };
                let lo = clamp(first)?;
                (lo, self.sub(p, full, lo, span)?)
            }
        };
        // u = alpha * k + r (mod m): k = u - r for alpha = 1, k = r - u for alpha = -1, so
        // the keys' residues are the run [lo - r, lo - r + len) or (r - lo - len, r - lo].
        let start = if alpha == 1 {
            self.sub(p, lo, r, span)?
        } else {
            let s = self.sub(p, r, lo, span)?;
            self.add(p, self.sub(p, s, len, span)?, one, span)?
        };
        Ok(KeyWindow { start, len, m })
    }

    /// The keys `k` with `(k - start) mod m < len` as a canonical list: runs of `len` keys
    /// every `m` keys. With a `hull`, only the runs that meet it on some row of the piece
    /// (and on one row, only their parts inside it): the caller keeps no key outside.
    fn window_keys(
        &self,
        p: &Piece,
        w: KeyWindow,
        hull: Option<(i64, i64)>,
        span: Span,
    ) -> Eval<Vec<AffineInterval>> {
        let KeyWindow { start, len, m } = w;
        let kv_len = self.bound.shape.kv_len;
        let (lo, hi) = hull.unwrap_or((0, kv_len));
        let (lo, hi) = (lo.max(0), hi.min(kv_len));
        if !self.lt(p, Affine::constant(0), len)? {
            return Ok(Vec::new());
        }
        if !self.lt(p, len, Affine::constant(m))? {
            return self.interval(p, Affine::constant(lo), Affine::constant(hi));
        }
        // Runs of fewer than m keys every m keys never touch, so they need no merging.
        let s = self.floor_mod(p, start, m, span)?;
        let m128 = i128::from(m);
        if p.n == 1 {
            let len = i128::from(len.first);
            if (i128::from(hi) - i128::from(lo)) / m128 + 2 > MAX_INTERVALS as i128 {
                return Err(too_many_intervals().into());
            }
            let mut out = Vec::new();
            let mut a = first_run(s.first, len, m128, lo);
            while a < i128::from(hi) {
                let x = a.max(i128::from(lo)) as i64;
                let y = (a + len).min(i128::from(hi)) as i64;
                out.push(AffineInterval::unit(
                    Affine::constant(x),
                    Affine::constant(y),
                ));
                a += m128;
            }
            return Ok(out);
        }
        // Every run [s + j m, s + j m + len) that meets [lo, hi) on some row: s and len are
        // affine, so their extremes over the piece are at its ends.
        let last = p.n - 1;
        let (s_lo, s_hi) = (s.first.min(s.at(last)), s.first.max(s.at(last)));
        let len_hi = len.first.max(len.at(last));
        // s_hi + j m + len_hi > lo and s_lo + j m < hi.
        let j_lo = (i128::from(lo) - i128::from(s_hi) - i128::from(len_hi)).div_euclid(m128) + 1;
        let j_hi = (i128::from(hi) - 1 - i128::from(s_lo)).div_euclid(m128);
        if j_hi - j_lo > MAX_INTERVALS as i128 {
            return Err(too_many_intervals().into());
        }
        let mut out = Vec::new();
        for j in j_lo..=j_hi {
            let shift = i64::try_from(j * m128).map_err(|_| overflow(span))?;
            let a = self.add(p, s, Affine::constant(shift), span)?;
            // A run past every key on every row ends at kv_len (its length may be near
            // i64::MAX for a huge divisor).
            let reach = |t: i64| i128::from(a.at(t)) + i128::from(len.at(t));
            let b = if reach(0) >= i128::from(kv_len) && reach(last) >= i128::from(kv_len) {
                Affine::constant(kv_len)
            } else {
                self.add(p, a, len, span)?
            };
            out.extend(self.interval(p, a, b)?);
        }
        Ok(out)
    }

    /// Whether a window has a key in `[lo, hi)` on every row of the piece (`false`: on none;
    /// a split where that changes).
    fn window_meets(&self, p: &Piece, w: KeyWindow, lo: i64, hi: i64, span: Span) -> Eval<bool> {
        if lo >= hi || !self.lt(p, Affine::constant(0), w.len)? {
            return Ok(false);
        }
        // Every residue occurs among m consecutive keys.
        if hi - lo >= w.m {
            return Ok(true);
        }
        // Runs are clipped to all keys on every row, but to a narrower hull only on one row.
        if p.n > 1 && (lo, hi) != (0, self.bound.shape.kv_len) {
            return Err(self.single(p));
        }
        Ok(!self.window_keys(p, w, Some((lo, hi)), span)?.is_empty())
    }

    /// `a & b` when `a`, or the leftmost term of a chain of `&` in `a`, is (through any
    /// `if`s on the row) a `%` atom and no other term holds an `elementwise`: `a`'s keys are runs every `m` keys, so they are enumerated only within
    /// `b`'s keys, and `(q - k) % 2 == 0 & q - 5 < k <= q` walks 5 keys per row, not
    /// kv_len / 2. Errors stay those of left-to-right evaluation: `a`'s row-level values are
    /// evaluated first, and `b` only when `a` has a key in the hull (the reference evaluates
    /// `b` only where `a` holds; `b`'s errors do not depend on `k`, as it has no
    /// `elementwise`). `None` when the sides are not of that form.
    fn sparse_first_inter(
        &self,
        p: &Piece,
        a: &Region,
        b: &Region,
        hull: Option<(i64, i64)>,
    ) -> Eval<Option<Vec<AffineInterval>>> {
        // `(w & c1) & c2` is `w & (c1 & c2)`, each term evaluated where the earlier ones hold
        // either way: the left spine's other terms are solved first, in order, so a residue
        // first and a band's two sides after it (`(q - k) % d == 0 & k > q - w & k <= q`)
        // cut the band, not a residue run to the last key (whose length alternates by row).
        let mut terms = Vec::new();
        let first = left_spine(a, &mut terms);
        terms.push(b);
        if terms.iter().any(|t| t.uses_elementwise()) {
            return Ok(None);
        }
        let Some((w, span)) = self.kmod_of(p, first, hull)? else {
            return Ok(None);
        };
        let (lo, hi) = hull.unwrap_or((0, self.bound.shape.kv_len));
        if !self.window_meets(p, w, lo.max(0), hi.min(self.bound.shape.kv_len), span)? {
            return Ok(Some(Vec::new()));
        }
        let mut y = self.region(p, terms[0], hull)?;
        for t in &terms[1..] {
            if y.is_empty() {
                break;
            }
            y = self.where_holds(p, &y, t, true, hull)?;
        }
        if y.is_empty() {
            return Ok(Some(y));
        }
        if let Some(v) = self.strided_inter(p, w, &y, span)? {
            return Ok(Some(v));
        }
        let (ylo, yhi) = keys_hull(p, &y);
        let x = self.window_keys(p, w, Some((ylo.max(lo), yhi.min(hi))), span)?;
        Ok(Some(self.inter(p, &y, &x)?))
    }

    /// The residue window of `r` and its span when `r` is, through its `if`s on the row, a
    /// `%` atom (its row-level values evaluated, so their errors come first), evaluated at
    /// the keys of `hull` (see [`Solver::no_overflow`]).
    fn kmod_of(
        &self,
        p: &Piece,
        r: &Region,
        hull: Option<(i64, i64)>,
    ) -> Eval<Option<(KeyWindow, Span)>> {
        let Region::KMod {
            alpha,
            rest,
            div,
            op,
            rhs,
            span,
        } = self.through_conds(p, r)?
        else {
            return Ok(None);
        };
        Ok(Some((
            self.kmod_window(p, *alpha, rest, div, *op, rhs, *span, hull)?,
            *span,
        )))
    }

    /// The region `r` stands for on this piece once its `if`s on the row are decided.
    fn through_conds<'r>(&self, p: &Piece, mut r: &'r Region) -> Eval<&'r Region> {
        while let Region::Cond(c, a, b) = r {
            r = if self.boolean(p, c)? { a } else { b };
        }
        Ok(r)
    }

    /// Appends the keys of grid row `row` (flattened index of its slow coordinates) with x
    /// in `[xlo, xhi)`, clipped to the grid and to `[0, kv_len)`.
    fn push_grid_row(
        &self,
        p: &Piece,
        out: &mut Vec<AffineInterval>,
        g: GridId,
        row: i64,
        (xlo, xhi): (Affine, Affine),
        span: Span,
    ) -> Eval<()> {
        let gv = &self.bound.grids[g];
        let w = gv.dims[gv.dims.len() - 1];
        let base = gv.at + row * w;
        let lo = self.max(p, xlo, Affine::constant(0))?;
        let hi = self.min(p, xhi, Affine::constant(w))?;
        if !self.lt(p, lo, hi)? {
            return Ok(());
        }
        let s = self.add(p, lo, Affine::constant(base), span)?;
        let e = self.min(
            p,
            self.add(p, hi, Affine::constant(base), span)?,
            Affine::constant(self.bound.shape.kv_len),
        )?;
        if !self.lt(p, s, e)? {
            return Ok(());
        }
        self.push_sorted(p, out, AffineInterval::unit(s, e))
    }

    /// The keys of a grid ball around the query's grid point; an overflow where the
    /// reference squares an L2 radius that does not fit at a key of `hull` in the grid.
    #[allow(clippy::too_many_arguments)]
    fn ball(
        &self,
        p: &Piece,
        g: GridId,
        metric: Metric,
        strict: bool,
        radius: &Int,
        span: Span,
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        // The reference evaluates the radius on every row, inside the grid or not.
        let r = self.int(p, radius)?;
        let qa = self.q_of(p, span)?;
        if !self.in_grid(p, g, qa)? {
            return Ok(Vec::new());
        }
        let r = self.constant(p, r)?;
        if square_overflows(metric, r) {
            let gv = &self.bound.grids[g];
            let (lo, hi) = self.clip(hull);
            if lo.max(gv.at) < hi.min(gv.at.saturating_add(gv.size)) {
                return Err(overflow(span));
            }
        }
        let c = self.grid_coords(p, g, qa, span)?;
        let gv = &self.bound.grids[g];
        let nd = gv.dims.len();
        let tq = if nd == 3 { self.constant(p, c[0])? } else { 0 };
        let yq = self.constant(p, c[nd - 2])?;
        let xq = c[nd - 1];
        let (td, hd) = if nd == 3 {
            (gv.dims[0], gv.dims[1])
        } else {
            (1, gv.dims[0])
        };
        // The largest |delta| allowed on one axis, given what the other axes use.
        let reach = |used: i64| -> Option<i64> {
            match metric {
                Metric::L2 => {
                    let r2 = i128::from(r.max(0)) * i128::from(r.max(0));
                    let left = r2 - i128::from(used) - i128::from(strict);
                    if r < 0 || (strict && r == 0) || left < 0 {
                        None
                    } else {
                        Some(bind::isqrt(left.min(i128::from(i64::MAX)) as i64, span).unwrap_or(0))
                    }
                }
                Metric::L1 => {
                    let left = r.saturating_sub(used).saturating_sub(i64::from(strict));
                    (left >= 0).then_some(left)
                }
                Metric::Linf => {
                    let left = r.saturating_sub(i64::from(strict));
                    (left >= 0).then_some(left)
                }
            }
        };
        let cost = |d: i64| match metric {
            Metric::L2 => d * d,
            Metric::L1 => d.abs(),
            Metric::Linf => 0,
        };
        let kv_len = self.bound.shape.kv_len;
        let w = gv.dims[nd - 1];
        // One run per grid row within reach: (flattened row, half-width). They depend only
        // on the key below, the same for every piece of a grid row, so the last ones are
        // kept.
        let key = BallKey {
            grid: g,
            metric,
            strict,
            radius: r,
            tq,
            yq,
        };
        let mut cache = self.ball_runs.borrow_mut();
        if cache.key != Some(key) {
            let runs = &mut cache.runs;
            runs.clear();
            // Grid rows past the last key hold no visible key: bound the loops by kv_len,
            // not only by the radius and the grid.
            if let (Some(rt), true) = (reach(0), kv_len > gv.at) {
                let last_row = (kv_len - 1 - gv.at) / w;
                let t_range = if nd == 3 {
                    (-rt).max(-tq)..=rt.min(td - 1 - tq).min(last_row / hd - tq)
                } else {
                    0..=0
                };
                for dt in t_range {
                    let Some(ry) = reach(cost(dt)) else { continue };
                    let last_dy = (last_row - (tq + dt) * hd - yq).min(ry).min(hd - 1 - yq);
                    for dy in (-ry).max(-yq)..=last_dy {
                        if let Some(rx) = reach(cost(dt) + cost(dy)) {
                            runs.push(BallRun {
                                base: gv.at + ((tq + dt) * hd + (yq + dy)) * w,
                                rx,
                                hi_from: w.saturating_sub(rx).saturating_sub(1),
                            });
                        }
                    }
                }
            }
            self.ball_runs_built
                .set(self.ball_runs_built.get() + runs.len() as u64);
            // Each clamp below holds on one side of a column: lo = base while x <= rx, hi
            // = base + w once x + rx + 1 >= w, and hi = kv_len from the columns where the
            // run's ends reach the keys' end.
            let BallRuns { runs, flips, .. } = &mut *cache;
            flips.clear();
            for run in runs.iter() {
                let past = kv_len.saturating_sub(run.base);
                flips.extend([
                    run.rx.saturating_add(1),
                    run.hi_from,
                    past.saturating_sub(run.rx),
                    past.saturating_add(run.rx),
                ]);
            }
            // Only flips inside the grid row matter: a piece starts at a column x0 >= 0
            // and ends within the row.
            flips.retain(|&x| x > 0 && x < w);
            flips.sort_unstable();
            flips.dedup();
            cache.key = Some(key);
        }
        let runs = &cache.runs;
        // x is affine in q over the piece (slope 0 or 1). Every clamp below flips at most
        // once; split at the first flip so that each is uniform, then build the runs with
        // plain arithmetic. The later flips are the next pieces' ends: hints.
        let (x0, slope) = (xq.first, xq.step);
        if slope != 0 {
            let flips = &cache.flips;
            let from = flips.partition_point(|&x| x <= x0);
            let to = flips.partition_point(|&x| x.saturating_sub(x0) < p.n);
            if from < to {
                let mut later = self.hints.borrow_mut();
                later.clear();
                later.extend(flips[from + 1..to].iter().map(|&x| p.q0 + (x - x0)));
                return Err(Flow::Split(p.q0 + (flips[from] - x0)));
            }
        }
        // Room for one interval more, which a union with keys before the grid's (the text
        // keys of CLEAR) puts in front without growing the list.
        let mut out: Vec<AffineInterval> = Vec::with_capacity(runs.len() + 1);
        for &BallRun { base, rx, hi_from } in runs {
            // Clamped as soon as the run reaches its grid row's edge, so runs of adjacent
            // grid rows touch exactly when both are clamped (both constant).
            let lo = if x0 <= rx {
                Affine::constant(base)
            } else {
                Affine {
                    first: base + x0 - rx,
                    step: slope,
                }
            };
            let hi = if x0 >= hi_from {
                Affine::constant(base + w)
            } else {
                Affine {
                    first: base + x0 + rx + 1,
                    step: slope,
                }
            };
            let hi = if hi.first > kv_len {
                Affine::constant(kv_len)
            } else {
                hi
            };
            if lo.first >= hi.first {
                continue;
            }
            match out.last_mut() {
                // Only a run clamped to the end of its grid row can touch the next row's
                // run, and only when that one is clamped to its start: both constant.
                Some(last) if lo.first <= last.end.first => last.end = hi,
                _ => out.push(AffineInterval::unit(lo, hi)),
            }
        }
        Ok(out)
    }

    /// The keys of key-side atom `r` (its function `f`) by their value, once per (batch,
    /// head), with the keys whose `f` fails ([`KeySweep::new`]).
    fn key_sweep(&self, p: &Piece, r: &Region, f: &Int) -> RefMut<'_, KeySweep> {
        let key = (r as *const Region as usize, p.h);
        RefMut::map(self.key_sweeps.borrow_mut(), |sweeps| {
            sweeps.entry(key).or_insert_with(|| {
                let kv_len = self.bound.shape.kv_len;
                self.key_evals.set(self.key_evals.get() + kv_len as u64);
                let mut env = self.env(p);
                let values = (0..kv_len)
                    .map(|k| {
                        env.k = k;
                        self.bound.eval_int(f, &env)
                    })
                    .collect();
                KeySweep::new(values)
            })
        })
    }

    /// `f(k) op v`, `f` a function of the key alone: the keys by their `f` once per (batch,
    /// head); a piece's keys are those with `f(k) <= v` (or `< v`, or the complements, or
    /// `f(k) == v`), constant until `v` crosses the next single key's value or a sloped
    /// run's smallest or largest value, where the piece ends, except within the sloped runs
    /// that `v` is inside, whose keys at or below `v` are one interval with an end affine in
    /// `v` ([`keys`]). Keys whose `f` fails are in no set; whether the reference reaches
    /// them is the caller's to check.
    #[allow(clippy::too_many_arguments)]
    fn key_cmp(
        &self,
        p: &Piece,
        r: &Region,
        f: &Int,
        op: CmpOp,
        v: &Int,
        span: Span,
        hull: Option<(i64, i64)>,
    ) -> Eval<Vec<AffineInterval>> {
        let kv_len = self.bound.shape.kv_len;
        let mut sweep = self.key_sweep(p, r, f);
        let (lo, hi) = hull.unwrap_or((0, kv_len));
        let v = self.int(p, v)?;
        // f < v is f <= v - 1, so every comparison reads one or two prefixes of the order.
        let minus_one = |x: Affine| self.affine(p, x.first.checked_sub(1), Some(x.step), span);
        let emit = |sweep: &KeySweep| -> Vec<AffineInterval> {
            let mut out = Vec::new();
            let lo32 = lo.clamp(0, kv_len) as u32;
            let first = sweep
                .runs
                .range(..=lo32)
                .next_back()
                .map_or(lo32, |(&s, _)| s);
            for (&s, &e) in sweep.runs.range(first..) {
                if i64::from(s) >= hi {
                    break;
                }
                out.push(AffineInterval::unit(
                    Affine::constant(i64::from(s)),
                    Affine::constant(i64::from(e)),
                ));
            }
            out
        };
        match op {
            CmpOp::Le | CmpOp::Lt | CmpOp::Gt | CmpOp::Ge => {
                let t = if matches!(op, CmpOp::Lt | CmpOp::Ge) {
                    minus_one(v)?
                } else {
                    v
                };
                self.sweep_split(p, &sweep, t)?;
                sweep.move_to(t.first);
                let whole = emit(&sweep);
                let partial: Vec<keys::SlopedRun> = sweep
                    .partial
                    .iter()
                    .map(|&i| sweep.sloped[i as usize])
                    .filter(|run| i64::from(run.k1) > lo && i64::from(run.k0) < hi)
                    .collect();
                drop(sweep);
                let mut parts = Vec::with_capacity(partial.len());
                for run in partial {
                    parts.push(self.sloped_part(p, run, t, span)?);
                }
                // Parts of adjacent runs may touch (a falling run's part ends where a
                // rising one's starts), so they are merged with the rest in one sort.
                let below = if parts.is_empty() {
                    whole
                } else {
                    let mut all = whole;
                    all.extend(parts);
                    self.union_all(p, all)?
                };
                if matches!(op, CmpOp::Le | CmpOp::Lt) {
                    Ok(below)
                } else {
                    self.complement(p, &below)
                }
            }
            CmpOp::Eq | CmpOp::Ne => {
                if v.step != 0 {
                    drop(sweep);
                    return Err(self.single(p));
                }
                let at = v.first;
                let from = sweep.sorted.partition_point(|&(x, _)| x < at);
                let to = sweep.sorted.partition_point(|&(x, _)| x <= at);
                let mut hits: Vec<u32> = sweep.sorted[from..to].iter().map(|&(_, k)| k).collect();
                // A sloped run holds the value at most once.
                for run in &sweep.sloped {
                    let (rlo, rhi) = run.range();
                    let off = i128::from(at) - i128::from(run.f0);
                    if (rlo..=rhi).contains(&at) && off % i128::from(run.slope) == 0 {
                        hits.push(run.k0 + (off / i128::from(run.slope)) as u32);
                    }
                }
                drop(sweep);
                hits.sort_unstable();
                let mut eq: Vec<AffineInterval> = Vec::new();
                for k in hits {
                    let k = i64::from(k);
                    match eq.last_mut() {
                        Some(last) if last.end.first == k => last.end.first += 1,
                        _ => eq.push(AffineInterval::unit(
                            Affine::constant(k),
                            Affine::constant(k + 1),
                        )),
                    }
                }
                if op == CmpOp::Eq {
                    Ok(eq)
                } else {
                    self.complement(p, &eq)
                }
            }
        }
    }

    /// The keys of a sloped run that `t` is inside on every row of the piece (its smallest
    /// value `<= t <` its largest) with `f(k) <= t`: from its first key to the last with
    /// `f0 + s (k - k0) <= t` (`s > 0`), or from the first such key to its end (`s < 0`).
    fn sloped_part(
        &self,
        p: &Piece,
        run: keys::SlopedRun,
        t: Affine,
        span: Span,
    ) -> Eval<AffineInterval> {
        let (k0, k1) = (
            Affine::constant(i64::from(run.k0)),
            Affine::constant(i64::from(run.k1)),
        );
        let above = self.sub(p, t, Affine::constant(run.f0), span)?;
        let steps = self.floor_div(p, above, run.slope.abs(), span)?;
        Ok(if run.slope > 0 {
            let end = self.add(p, self.add(p, k0, steps, span)?, Affine::constant(1), span)?;
            AffineInterval::unit(k0, end)
        } else {
            AffineInterval::unit(self.sub(p, k0, steps, span)?, k1)
        })
    }

    /// The first row of the piece where the set `f(k) <= threshold` changes other than
    /// affinely: where the threshold reaches the next single key's value or a sloped run's
    /// smallest or largest value (rising), or drops below the last one's (falling).
    fn sweep_split(&self, p: &Piece, sweep: &KeySweep, t: Affine) -> Eval<()> {
        if t.step == 0 || p.n == 1 {
            return Ok(());
        }
        let (d, a) = (i128::from(t.first), i128::from(t.step));
        let change = |sorted: &[(i64, u32)]| {
            let at = sorted.partition_point(|&(x, _)| x <= t.first);
            if a > 0 {
                // The first t with first + a t >= next value.
                sorted
                    .get(at)
                    .map(|&(x, _)| (i128::from(x) - d + a - 1) / a)
            } else {
                // The first t with first + a t < the last value at or below.
                at.checked_sub(1)
                    .map(|i| (d - i128::from(sorted[i].0)) / -a + 1)
            }
        };
        match sweep.thresholds().into_iter().filter_map(change).min() {
            Some(c) if c < i128::from(p.n) => Err(Flow::Split(p.q0 + c as i64)),
            _ => Ok(()),
        }
    }

    /// The keys on the path from the root to the node at `pos`: each row's path read from
    /// the tree's table, a piece of rows as long as the table's paths move affinely
    /// (`TreeTable::run`), clipped to the keys.
    fn tree_path(
        &self,
        p: &Piece,
        tree: TreeId,
        pos: &Int,
        span: Span,
    ) -> Eval<Vec<AffineInterval>> {
        let t = &self.bound.trees[tree];
        let pos = self.int(p, pos)?;
        let n = t.len() as i64;
        if !self.within(p, pos, t.at, t.at.saturating_add(n))? {
            return Ok(Vec::new());
        }
        let u = (pos.first - t.at) as usize;
        if p.n == 1 {
            // One row (a tree numbered out of depth-first order is mostly pieces of one row):
            // its path's keys are constants, clipped to the keys as `clipped` would.
            let kv_len = self.bound.shape.kv_len;
            let mut out = Vec::with_capacity(t.path(u).len());
            for &(lo, hi) in t.path(u) {
                let key = |x: u32| t.at.checked_add(i64::from(x)).ok_or_else(|| overflow(span));
                let (start, end) = (key(lo)?.max(0), key(hi)?.min(kv_len));
                if start < end {
                    out.push(AffineInterval::unit(
                        Affine::constant(start),
                        Affine::constant(end),
                    ));
                }
            }
            return Ok(out);
        }
        // Nodes u, u + s, u + 2s, ... for a position of slope s: affine while the table says
        // so (s = 1), or the same node (s = 0); one row at a time otherwise.
        let step_rows = match pos.step {
            0 => None,
            1 => {
                let run = i64::from(t.run[u]);
                if run + 1 < p.n {
                    // The next runs' ends are the next pieces' ends (hints), so rows of a
                    // tree numbered out of depth-first order, pieces of a row or two, are
                    // each solved once rather than first tried to the end of the rows.
                    let mut later = self.hints.borrow_mut();
                    later.clear();
                    let mut at = run + 1;
                    while later.len() < MAX_TREE_HINTS {
                        // u + at is a node: the piece's positions lie in the tree.
                        at += i64::from(t.run[u + at as usize]) + 1;
                        if at >= p.n {
                            break;
                        }
                        later.push(p.q0 + at);
                    }
                    return Err(Flow::Split(p.q0 + run + 1));
                }
                Some(t.path(u + 1))
            }
            _ => return Err(self.single(p)),
        };
        let mut out = Vec::with_capacity(t.path(u).len());
        for (i, &(lo, hi)) in t.path(u).iter().enumerate() {
            let (ds, de) = match step_rows {
                Some(next) => (
                    i64::from(next[i].0) - i64::from(lo),
                    i64::from(next[i].1) - i64::from(hi),
                ),
                None => (0, 0),
            };
            let start = self.affine(p, t.at.checked_add(i64::from(lo)), Some(ds), span)?;
            let end = self.affine(p, t.at.checked_add(i64::from(hi)), Some(de), span)?;
            // A row or two per piece on trees numbered out of depth-first order: no list
            // per interval.
            out.extend(self.clipped(p, start, end)?);
        }
        Ok(out)
    }

    fn grid_box(
        &self,
        p: &Piece,
        g: GridId,
        ranges: &[RangeE],
        span: Span,
    ) -> Eval<Vec<AffineInterval>> {
        let gv = &self.bound.grids[g];
        let nd = gv.dims.len();
        let mut bounds = Vec::with_capacity(nd);
        for r in ranges {
            bounds.push(self.range(p, r)?);
        }
        let slow = |axis: usize| -> Eval<(i64, i64)> {
            let (lo, hi) = bounds[axis];
            let lo = self.constant(p, lo)?.max(0);
            let hi = self.constant(p, hi)?.min(gv.dims[axis]);
            Ok((lo, hi))
        };
        let (t_lo, t_hi) = if nd == 3 { slow(0)? } else { (0, 1) };
        let (y_lo, y_hi) = slow(nd - 2)?;
        let h = gv.dims[nd - 2];
        let (xlo, xhi) = bounds[nd - 1];
        let mut out = Vec::new();
        for t in t_lo..t_hi {
            for y in y_lo..y_hi {
                self.push_grid_row(p, &mut out, g, t * h + y, (xlo, xhi), span)?;
            }
        }
        Ok(out)
    }
}

/// The keys of a one-row list (plain intervals) inside `[lo, hi)`, as ascending ranges.
fn single_row_ranges(list: &[AffineInterval], (lo, hi): (i64, i64)) -> Vec<(i64, i64)> {
    list.iter()
        .map(|iv| (iv.start.first.max(lo), iv.end.first.min(hi)))
        .filter(|(a, z)| a < z)
        .collect()
}

/// The keys of a one-row list inside `[lo, hi)` as ascending ranges: a plain run as one
/// range, a strided run as one range per key.
fn single_row_keys(list: &[AffineInterval], (lo, hi): (i64, i64)) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    for iv in list {
        let (start, end) = (iv.start.first, iv.end.first.min(hi));
        if iv.stride == 1 {
            if start.max(lo) < end {
                out.push((start.max(lo), end));
            }
            continue;
        }
        // The first key of the run at or after lo: start + ceil((lo - start) / stride) * stride.
        let mut k = if start >= lo {
            start
        } else {
            start + (lo - start + iv.stride - 1) / iv.stride * iv.stride
        };
        while k < end {
            out.push((k, k + 1));
            k += iv.stride;
        }
    }
    out
}

/// The keys of `[lo, hi)` outside a one-row list (plain intervals), as ascending ranges.
fn single_row_gaps(list: &[AffineInterval], (lo, hi): (i64, i64)) -> Vec<(i64, i64)> {
    let mut out = Vec::with_capacity(list.len() + 1);
    let mut at = lo;
    for iv in list {
        if iv.start.first > at {
            out.push((at, iv.start.first.min(hi)));
        }
        at = at.max(iv.end.first);
    }
    out.push((at, hi));
    out.retain(|(a, z)| a < z);
    out
}

/// `range` cut to `hull`: a list evaluated within a hull may hold anything outside it.
fn narrow(range: (i64, i64), hull: Option<(i64, i64)>) -> (i64, i64) {
    match hull {
        Some((lo, hi)) => (range.0.max(lo), range.1.min(hi)),
        None => range,
    }
}

/// The smallest range holding the keys of a non-empty canonical list on every row of the
/// piece (its endpoints are affine, so their extremes are at the piece's ends).
fn keys_hull(p: &Piece, list: &[AffineInterval]) -> (i64, i64) {
    let (first, last) = (list[0].start, list[list.len() - 1].end);
    let t = p.n - 1;
    (first.first.min(first.at(t)), last.first.max(last.at(t)))
}

/// Whether [`Solver::no_overflow`] fails for keys `ks` (inclusive, `ks.0 <= ks.1`): at
/// either end.
#[cold]
#[inline(never)]
fn overflows(alpha: i64, rest: (i64, i64), min_fails: bool, ks: (i64, i64)) -> bool {
    let (min, max) = (i128::from(i64::MIN), i128::from(i64::MAX));
    let fits = |k: i64| {
        let x = i128::from(alpha) * i128::from(k);
        x >= min
            && x <= max
            && x + i128::from(rest.0) >= min + i128::from(min_fails)
            && x + i128::from(rest.1) <= max
    };
    !(fits(ks.0) && fits(ks.1))
}

/// Whether the reference's square of an L2 ball's radius `r` (`r * r` for `r > 0`)
/// overflows: it squares it at the pairs whose query and key both lie in the grid.
fn square_overflows(metric: Metric, r: i64) -> bool {
    metric == Metric::L2 && r.max(0).checked_mul(r.max(0)).is_none()
}

/// The smallest and largest value of `x` over the piece (an affine value's extremes are at
/// its ends).
fn ends(p: &Piece, x: Affine) -> (i64, i64) {
    let last = x.at(p.n - 1);
    (x.first.min(last), x.first.max(last))
}

/// The start of the first run `[s + j m, s + j m + len)` (over integers `j`) that ends after
/// `lo`, for `0 <= s < m`, `0 < len`: in 128 bits, so no operand can overflow.
fn first_run(s: i64, len: i128, m: i128, lo: i64) -> i128 {
    let s = i128::from(s);
    s + m * ((i128::from(lo) - s - len).div_euclid(m) + 1)
}

fn floor_i128(x: i128, d: i128) -> i128 {
    if d > 0 {
        x.div_euclid(d)
    } else {
        (-x).div_euclid(-d)
    }
}
