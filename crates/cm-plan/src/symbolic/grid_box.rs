//! Conjunctions of range and residue conditions on the key's coordinates in one grid, as
//! NATTEN 2D writes its window (examples/masks/natten_2d.cmask): `k in G & G.y(k) % d == gy
//! & G.y(k) in ylo ..= yhi & G.x(k) % d == gx & G.x(k) in xlo ..= xhi`, solved as a
//! *strided box*.
//!
//! Each key-side atom `f(k) op v` ([`Region::KeyCmp`]) of such a chain reads one coordinate
//! `c` of the key in the grid, as `f = b + a * c` (a range of `c`) or `f = b + s * ((alpha *
//! c + beta) mod m)` (`f == v`: one residue class of `c`), so the chain's keys are a box of
//! coordinates, each axis one interval with at most one residue class: one run of
//! coordinates, strided for a residue modulo `m >= 2`. The keys are, for every combination
//! of the slow axes' coordinates (ascending), one run of the fast axis: `at + sum(c_i *
//! stride_i) + x` for `x` in that run. Every endpoint is affine over a piece of rows where
//! the atoms' q-side values are, so NATTEN's rows are a few pieces per grid row (the window's
//! clamps change at the grid's edges) with one run per window row, instead of a piece per
//! row each sorting through the keys by value ([`super::keys`]).
//!
//! A residue atom's value is read modulo `m` where it is written so (`gx = G.x(q) % d`):
//! any affine representative of its residue class gives the same keys, so a piece does not
//! end every `m` rows where `G.x(q) % d` wraps.
//!
//! Errors: this is a shortcut, never the only way. A chain is solved here only where the
//! pairwise reference fails at no pair of the piece: the flat conditions on `k` before the
//! first key-side atom keep every key that reaches one inside the grid (so coordinates
//! exist), the key-side functions are checked against 64 bits over the grid's coordinates
//! and divide by no zero, and every q-side value is evaluated over the piece. Where any of
//! that fails or cannot be shown, `None` hands the piece to the general evaluation, which
//! evaluates the terms in the reference's order.

use super::{Affine, AffineInterval, Eval, Flow, List, Piece, Solver};
use cm_ir::ir::{Bool, GridId, Int, IntKind, IntOp, Region};
use cm_syntax::{CmpOp, Span};
use std::cell::RefCell;

/// A key-side function of one coordinate `c` of the key in the chain's grid.
#[derive(Clone, Copy, Debug)]
pub(super) enum CoordFn {
    /// `b + a * c` (`a == 0`: a constant).
    Lin { a: i64, b: i64 },
    /// `b + s * ((alpha * c + beta) mod m)`, `m >= 1`.
    Mod {
        b: i64,
        s: i64,
        alpha: i64,
        beta: i64,
        m: i64,
    },
}

impl CoordFn {
    /// Whether every value it takes for `0 <= c < dim`, and so every value of the
    /// expression it was read from (each of its parts is one too), fits in 64 bits: the
    /// reference evaluates them with checked arithmetic.
    fn fits(self, dim: i64) -> bool {
        let fit = |x: i128| i64::try_from(x).is_ok();
        let last = i128::from(dim - 1);
        match self {
            CoordFn::Lin { a, b } => fit(i128::from(b) + i128::from(a) * last),
            CoordFn::Mod { b, s, m, .. } => fit(i128::from(b) + i128::from(s) * i128::from(m - 1)),
        }
    }

    fn scale(self, c: i64) -> Option<CoordFn> {
        Some(match self {
            CoordFn::Lin { a, b } => CoordFn::Lin {
                a: a.checked_mul(c)?,
                b: b.checked_mul(c)?,
            },
            CoordFn::Mod {
                b,
                s,
                alpha,
                beta,
                m,
            } => CoordFn::Mod {
                b: b.checked_mul(c)?,
                s: s.checked_mul(c)?,
                alpha,
                beta,
                m,
            },
        })
    }

    /// The function plus a constant `c`.
    fn shift(self, c: i64) -> Option<CoordFn> {
        Some(match self {
            CoordFn::Lin { a, b } => CoordFn::Lin {
                a,
                b: b.checked_add(c)?,
            },
            CoordFn::Mod {
                b,
                s,
                alpha,
                beta,
                m,
            } => CoordFn::Mod {
                b: b.checked_add(c)?,
                s,
                alpha,
                beta,
                m,
            },
        })
    }
}

/// A key-side function read as a [`CoordFn`]: the axis it reads (`None`: a constant).
pub(super) type Coord = (Option<usize>, CoordFn);

/// A q-side value over a piece written as `b + t * (a mod m)` (`t != 0`, `m >= 1`).
#[derive(Clone, Copy)]
pub(super) struct ModForm {
    b: Affine,
    t: i64,
    a: Affine,
    m: i64,
    /// Bounds (inclusive) on its value over the piece.
    range: (i128, i128),
}

/// One axis of the box: coordinates `[lo, hi)` congruent to `residue.0` modulo
/// `residue.1`.
#[derive(Clone, Copy)]
struct Axis {
    lo: Affine,
    hi: Affine,
    residue: Option<(Affine, i64)>,
}

/// An axis's coordinates on every row of a piece: `count` of them from `first`, `stride`
/// apart (for the fast axis, `end` is one past the last).
#[derive(Clone, Copy)]
struct Run {
    first: Affine,
    end: Affine,
    stride: i64,
    count: i64,
}

/// A q-side evaluation a strided box keeps between pieces ([`Solver::box_int`]).
trait KeptValue: Copy {
    /// The value over rows `[off, off + n)` of the piece it was evaluated over.
    fn within(self, off: i64, n: i64) -> Self;

    /// Whether it is read on parts of its piece (a form that was not found is evaluated
    /// again: on fewer rows its bounds may fit).
    fn covers(&self) -> bool;
}

impl KeptValue for Affine {
    fn within(self, off: i64, n: i64) -> Affine {
        let step = if n == 1 { 0 } else { self.step };
        Affine {
            first: self.at(off),
            step,
        }
    }

    fn covers(&self) -> bool {
        true
    }
}

impl KeptValue for Option<ModForm> {
    /// Its bounds stay those of the whole piece, which hold on every part.
    fn within(self, off: i64, n: i64) -> Option<ModForm> {
        self.map(|f| ModForm {
            b: f.b.within(off, n),
            a: f.a.within(off, n),
            ..f
        })
    }

    fn covers(&self) -> bool {
        self.is_some()
    }
}

/// Where [`Solver::kept`] keeps a kind of value: by address, the last evaluation; by
/// [`LineKey`](super::LineKey), evaluations inside grid lines.
type KeptMaps<'s, T> = (
    &'s RefCell<super::FastMap<usize, super::BoxValue<T>>>,
    &'s RefCell<super::FastMap<super::LineKey, Result<T, i64>>>,
);

/// The grid whose key coordinates every key-side atom of the chain `r` reads, when `r` is a
/// chain of `&` of q-side predicates, comparisons `alpha * k + rest op 0` and at least one
/// such atom (the form [`Solver::grid_box_chain`] solves).
pub(super) fn chain_grid(r: &Region) -> Option<GridId> {
    let mut grid = None;
    let mut stack = vec![r];
    while let Some(x) = stack.pop() {
        match x {
            Region::Inter(a, b) => {
                stack.push(a);
                stack.push(b);
            }
            Region::Rows(_) | Region::KCmp { .. } => {}
            Region::KeyCmp { f, .. } => {
                let g = coord_grid(f)?;
                if grid.is_some_and(|h| h != g) {
                    return None;
                }
                grid = Some(g);
            }
            _ => return None,
        }
    }
    grid
}

/// The one grid whose coordinates of `k` the key-side function `f` reads, if it reads
/// exactly one grid's and `k` nowhere else.
fn coord_grid(f: &Int) -> Option<GridId> {
    let mut grid = None;
    let mut stack = vec![f];
    while let Some(e) = stack.pop() {
        match &e.kind {
            IntKind::GridCoord(g, _, p) if matches!(p.kind, IntKind::K) => {
                if grid.is_some_and(|h| h != *g) {
                    return None;
                }
                grid = Some(*g);
            }
            IntKind::K => return None,
            IntKind::Neg(a) => stack.push(a),
            IntKind::Bin(IntOp::Add | IntOp::Sub | IntOp::Mul | IntOp::Mod, a, b) => {
                stack.push(a);
                stack.push(b);
            }
            _ if e.has_k() => return None,
            _ => {}
        }
    }
    grid
}

/// The leaves of a chain of `&`, left to right (the order the reference evaluates them in).
fn leaves<'r>(r: &'r Region, out: &mut Vec<&'r Region>) {
    match r {
        Region::Inter(a, b) => {
            leaves(a, out);
            leaves(b, out);
        }
        _ => out.push(r),
    }
}

/// The grid `G` when the q-side value `e` reads the row `q` only as `G`'s fastest
/// coordinate of `q` itself (`G.x(q)` of a 2D grid, `G.z(q)` of a 3D one), at least once,
/// and no other grid's; `ndims` gives each grid's number of axes. Conservative: `q` inside
/// a range or an array, or under any other position, is another way of reading it.
fn line_grid(e: &Int, ndims: &impl Fn(GridId) -> usize) -> Option<GridId> {
    let mut grid = None;
    line_int(e, ndims, &mut grid).then_some(grid).flatten()
}

/// Whether `e` reads `q` only as the fastest coordinate of the grid `grid` (set at its
/// first such read); see [`line_grid`].
fn line_int(e: &Int, ndims: &impl Fn(GridId) -> usize, grid: &mut Option<GridId>) -> bool {
    match &e.kind {
        IntKind::GridCoord(g, axis, pos) if matches!(pos.kind, IntKind::Q) => {
            if usize::from(*axis) + 1 != ndims(*g) || grid.is_some_and(|h| h != *g) {
                return false;
            }
            *grid = Some(*g);
            true
        }
        IntKind::Q | IntKind::K => false,
        IntKind::Const(_)
        | IntKind::B
        | IntKind::H
        | IntKind::QLen
        | IntKind::KvLen
        | IntKind::Batch
        | IntKind::NumHeads
        | IntKind::SegLen
        | IntKind::Param(_)
        | IntKind::SegCount(_)
        | IntKind::Var(_) => true,
        IntKind::ArrIndex(a, i) => !a.reads_q() && line_int(i, ndims, grid),
        IntKind::ArrLen(a) | IntKind::ArrSum(a) => !a.reads_q(),
        IntKind::Neg(a) | IntKind::Abs(a) | IntKind::Isqrt(a) => line_int(a, ndims, grid),
        IntKind::Bin(_, a, b) => line_int(a, ndims, grid) && line_int(b, ndims, grid),
        IntKind::If(c, a, b) => {
            line_bool(c, ndims, grid) && line_int(a, ndims, grid) && line_int(b, ndims, grid)
        }
        IntKind::RangeLo(r) | IntKind::RangeHi(r) => !r.mentions(&|l| matches!(l, IntKind::Q)),
        IntKind::SegIndex(_, pos) | IntKind::GridCoord(_, _, pos) => line_int(pos, ndims, grid),
    }
}

/// [`line_int`] for a q-side condition.
fn line_bool(c: &Bool, ndims: &impl Fn(GridId) -> usize, grid: &mut Option<GridId>) -> bool {
    match c {
        Bool::Const(_) => true,
        Bool::Cmp(_, a, b) => line_int(a, ndims, grid) && line_int(b, ndims, grid),
        Bool::And(a, b) | Bool::Or(a, b) => line_bool(a, ndims, grid) && line_bool(b, ndims, grid),
        Bool::Not(a) => line_bool(a, ndims, grid),
        Bool::InGrid(_, pos) => line_int(pos, ndims, grid),
    }
}

impl Solver<'_, '_> {
    /// The keys of the chain `r` over grid `g` ([`chain_grid`]) as a strided box (module
    /// docs), or `None` where it cannot be shown to be what the reference gives.
    pub(super) fn grid_box_chain(&self, p: &Piece, r: &Region, g: GridId) -> Eval<Option<List>> {
        match self.grid_box_in(p, r, g) {
            Err(Flow::Error(_)) => Ok(None),
            out => out,
        }
    }

    fn grid_box_in(&self, p: &Piece, r: &Region, g: GridId) -> Eval<Option<List>> {
        let gv = &self.bound.grids[g];
        let dims = gv.dims.as_slice();
        let nd = dims.len();
        if nd == 0 || dims.iter().any(|&d| d <= 0) {
            return Ok(None);
        }
        let kv_len = self.bound.shape.kv_len;
        let mut terms = Vec::new();
        leaves(r, &mut terms);
        let mut axes: Vec<Axis> = dims
            .iter()
            .map(|&d| Axis {
                lo: Affine::constant(0),
                hi: Affine::constant(d),
                residue: None,
            })
            .collect();
        let (mut flo, mut fhi) = (Affine::constant(0), Affine::constant(kv_len));
        let mut guarded = false;
        let mut span = Span::default();
        for t in terms {
            match t {
                Region::Rows(c) => {
                    if !self.boolean(p, c)? {
                        // No later term is evaluated at any key.
                        return Ok(Some(Vec::new()));
                    }
                }
                Region::KCmp {
                    alpha,
                    rest,
                    op,
                    span,
                } => {
                    let keys = self.kcmp(p, t, *alpha, rest, *op, *span, None)?;
                    match keys.as_slice() {
                        [] => return Ok(Some(Vec::new())),
                        [iv] => {
                            flo = self.max(p, flo, iv.start)?;
                            fhi = self.min(p, fhi, iv.end)?;
                        }
                        _ => return Ok(None),
                    }
                }
                Region::KeyCmp { f, op, v, span: s } => {
                    span = *s;
                    if !guarded {
                        // Every key that reaches this atom lies in the grid (or none does).
                        let (at, end) =
                            (Affine::constant(gv.at), Affine::constant(gv.at + gv.size));
                        let inside =
                            Self::le_throughout(p, at, flo) && Self::le_throughout(p, fhi, end);
                        if !inside && !Self::le_throughout(p, fhi, flo) {
                            return Ok(None);
                        }
                        guarded = true;
                    }
                    let Some((axis, form)) = self.box_coord_fn(p, f, g) else {
                        return Ok(None);
                    };
                    if !self.box_atom(p, &mut axes, axis, form, *op, v, *s)? {
                        return Ok(None);
                    }
                }
                _ => return Ok(None),
            }
        }
        if !self.lt(p, flo, fhi)? {
            return Ok(Some(Vec::new()));
        }
        let mut runs = Vec::with_capacity(nd);
        for ax in &axes {
            match self.axis_run(p, ax, span)? {
                Some(run) => runs.push(run),
                None => return Ok(Some(Vec::new())),
            }
        }
        let Some(out) = self.box_keys(p, g, &runs, span)? else {
            return Ok(None);
        };
        // Clipped to the flat conditions' keys (inside `[0, kv_len)`), when the box reaches
        // past them.
        let within = match (out.first(), out.last()) {
            (Some(a), Some(z)) => {
                Self::le_throughout(p, flo, a.start) && Self::le_throughout(p, z.end, fhi)
            }
            _ => true,
        };
        if within {
            return Ok(Some(out));
        }
        Ok(Some(self.inter(
            p,
            &out,
            &[AffineInterval::unit(flo, fhi)],
        )?))
    }

    /// Narrows the box by the atom `f op v`, `f` read as `form` of coordinate `axis`;
    /// `false` when the atom is not of a form the box holds.
    #[allow(clippy::too_many_arguments)]
    fn box_atom(
        &self,
        p: &Piece,
        axes: &mut [Axis],
        axis: Option<usize>,
        form: CoordFn,
        op: CmpOp,
        v: &Int,
        span: Span,
    ) -> Eval<bool> {
        match (axis, form) {
            (None, CoordFn::Lin { b, .. }) => {
                // A constant: every key of the grid or none, on each row.
                let v = self.box_int(p, v)?;
                if !self.cmp(p, op, Affine::constant(b), v)? {
                    axes[0].hi = Affine::constant(0);
                }
                Ok(true)
            }
            (Some(i), CoordFn::Lin { a, b }) if a != 0 => {
                let v = self.box_int(p, v)?;
                let rest = self.sub(p, Affine::constant(b), v, span)?;
                let Some((lo, hi)) = self.coord_range(p, a, rest, op, span)? else {
                    return Ok(false);
                };
                let ax = &mut axes[i];
                if let Some(lo) = lo {
                    ax.lo = self.max(p, ax.lo, lo)?;
                }
                if let Some(hi) = hi {
                    ax.hi = self.min(p, ax.hi, hi)?;
                }
                Ok(true)
            }
            (
                Some(i),
                CoordFn::Mod {
                    b,
                    s,
                    alpha,
                    beta,
                    m,
                },
            ) if op == CmpOp::Eq && s.abs() == 1 && alpha.abs() == 1 => {
                // `b + s * X == v` with `X = (alpha * c + beta) mod m` in `[0, m)`: `X == u`
                // for `u = s * (v - b)`, so `c == alpha * (u - beta)` modulo `m` when `u` is
                // in `[0, m)`, no key otherwise. `u`'s class is read from `v`'s own `% m`
                // where `v` is `b + s * (a mod m)`.
                let rep = match self.box_mod_form(p, v)? {
                    Some(f) if f.m == m && f.t == s && f.b == Affine::constant(b) => f.a,
                    _ => {
                        let v = self.box_int(p, v)?;
                        let u =
                            self.scale(p, self.sub(p, v, Affine::constant(b), span)?, s, span)?;
                        if !(self.le(p, Affine::constant(0), u)?
                            && self.lt(p, u, Affine::constant(m))?)
                        {
                            axes[i].hi = Affine::constant(0);
                            return Ok(true);
                        }
                        u
                    }
                };
                if m == 1 {
                    return Ok(true);
                }
                if axes[i].residue.is_some() {
                    return Ok(false);
                }
                let r = self.scale(
                    p,
                    self.sub(p, rep, Affine::constant(beta), span)?,
                    alpha,
                    span,
                )?;
                axes[i].residue = Some((r, m));
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The q-side value `v` over the piece, as [`Solver::int`], read from its last
    /// evaluation when that covered the piece's rows: an affine value is affine on every
    /// run of its rows, and it failed at none of them. A window's slow bounds (NATTEN's
    /// rows of the window, the same along a grid row) are then evaluated once per grid row,
    /// not twice per piece.
    ///
    /// A value that reads `q` only as one grid's fastest coordinate (NATTEN's columns of
    /// the window, `G.x(q)`) is, over a piece inside one line of that grid, a function of
    /// that coordinate on the piece's first row and of the piece's length alone: its
    /// evaluation there (the value, or the offset where it splits) is the same on every
    /// line, so it is kept by that coordinate and length ([`LineKey`]) and read on the
    /// next lines instead of evaluated again. Errors are not kept (evaluated again, with
    /// their own rows).
    fn box_int(&self, p: &Piece, v: &Int) -> Eval<Affine> {
        if self.var_mode.get().is_some() {
            // Pieces range over a quantifier's variable, not rows.
            return self.int(p, v);
        }
        self.kept(p, v, (&self.box_values, &self.line_values), || {
            self.int(p, v)
        })
    }

    /// [`Solver::mod_form`] of a strided box's q-side value, kept as [`Solver::box_int`]
    /// keeps values (a form over a piece holds on every run of its rows).
    fn box_mod_form(&self, p: &Piece, v: &Int) -> Eval<Option<ModForm>> {
        if self.var_mode.get().is_some() {
            return self.mod_form(p, v);
        }
        self.kept(p, v, (&self.box_mods, &self.line_mods), || {
            self.mod_form(p, v)
        })
    }

    /// `eval()`, the evaluation of `v` over the piece, read from `covering` (the last
    /// evaluation of `v`, where it covered the piece's rows) or `lines` (by [`LineKey`])
    /// where they hold it, else evaluated and kept in both (see [`Solver::box_int`]).
    fn kept<T: KeptValue>(
        &self,
        p: &Piece,
        v: &Int,
        (covering, lines): KeptMaps<'_, T>,
        eval: impl FnOnce() -> Eval<T>,
    ) -> Eval<T> {
        let key = v as *const Int as usize;
        let vars = self.vars.get();
        if let Some(&(at, at_vars, value)) = covering.borrow().get(&key) {
            let same = (at.b, at.h, at_vars) == (p.b, p.h, vars);
            if same && at.q0 <= p.q0 && p.q0 + p.n <= at.q0 + at.n {
                return Ok(value.within(p.q0 - at.q0, p.n));
            }
        }
        let line = self.line_key(p, v, key, vars);
        if let Some(k) = &line {
            if let Some(&kept) = lines.borrow().get(k) {
                return kept.map_err(|at| Flow::Split(p.q0 + at));
            }
        }
        let out = eval();
        let kept = match &out {
            Ok(value) => {
                if value.covers() {
                    covering.borrow_mut().insert(key, (*p, vars, *value));
                }
                Ok(*value)
            }
            Err(Flow::Split(at)) => Err(at - p.q0),
            Err(Flow::Error(_)) => return out,
        };
        if let Some(k) = line {
            let mut values = lines.borrow_mut();
            if values.len() >= super::MAX_LINE_VALUES {
                values.clear();
            }
            values.insert(k, kept);
        }
        out
    }

    /// The [`LineKey`] of the value `v` (at address `key`) over the piece, when it reads
    /// `q` only as the fastest coordinate of one grid ([`line_grid`]) and the piece lies
    /// inside one line of that grid (so that coordinate is affine with step 1 on it).
    fn line_key(
        &self,
        p: &Piece,
        v: &Int,
        key: usize,
        vars: [i64; super::MAX_QUANT_DEPTH],
    ) -> Option<super::LineKey> {
        let grids = &self.bound.grids;
        let g = (*self
            .line_grids
            .borrow_mut()
            .entry(key)
            .or_insert_with(|| line_grid(v, &|g| grids[g].dims.len())))?;
        let gv = &grids[g];
        let width = *gv.dims.last()?;
        let local = p.q0.checked_sub(gv.at)?;
        if width <= 0 || local < 0 || local.checked_add(p.n)? > gv.size {
            return None;
        }
        let x0 = local % width;
        (x0 + p.n <= width).then_some((key, x0, p.n, p.b, p.h, vars))
    }

    /// The coordinates with `a * c + rest  op  0` (`a != 0`) as bounds `[lo, hi)`, `None`
    /// for a side left open; `None` for `!=`, which is not one range.
    fn coord_range(
        &self,
        p: &Piece,
        a: i64,
        rest: Affine,
        op: CmpOp,
        span: Span,
    ) -> Eval<Option<(Option<Affine>, Option<Affine>)>> {
        let neg = |x: Affine| self.affine(p, x.first.checked_neg(), x.step.checked_neg(), span);
        let (a, rest, op) = if a < 0 {
            let a = a.checked_neg().ok_or_else(|| super::overflow(span))?;
            (a, neg(rest)?, op.flip())
        } else {
            (a, rest, op)
        };
        let one = Affine::constant(1);
        let minus = neg(rest)?;
        // a * c < -rest  <=>  c <= floor((-rest - 1) / a), and so on.
        let le_floor =
            |x: Affine| -> Eval<Affine> { self.add(p, self.floor_div(p, x, a, span)?, one, span) };
        let ceil_minus = || -> Eval<Affine> { neg(self.floor_div(p, rest, a, span)?) };
        Ok(Some(match op {
            CmpOp::Lt => (None, Some(le_floor(self.sub(p, minus, one, span)?)?)),
            CmpOp::Le => (None, Some(le_floor(minus)?)),
            CmpOp::Gt => (Some(le_floor(minus)?), None),
            CmpOp::Ge => (Some(ceil_minus()?), None),
            CmpOp::Eq => (Some(ceil_minus()?), Some(le_floor(minus)?)),
            CmpOp::Ne => return Ok(None),
        }))
    }

    /// An axis's coordinates as a run, `None` when it has none on the piece's rows.
    fn axis_run(&self, p: &Piece, ax: &Axis, span: Span) -> Eval<Option<Run>> {
        match ax.residue {
            Some((r, m)) => {
                let iv = AffineInterval::unit(ax.lo, ax.hi);
                Ok(self.residue_run(p, r, m, &iv, span)?.map(|run| Run {
                    first: run.start,
                    end: run.end,
                    stride: run.stride,
                    count: (run.end.first - 1 - run.start.first) / run.stride + 1,
                }))
            }
            None => {
                if !self.lt(p, ax.lo, ax.hi)? {
                    return Ok(None);
                }
                Ok(Some(Run {
                    first: ax.lo,
                    end: ax.hi,
                    stride: 1,
                    count: ax.hi.first - ax.lo.first,
                }))
            }
        }
    }

    /// The keys of the box of `runs` (one per axis, slowest first) in grid `g`: for each
    /// combination of the slow axes' coordinates, ascending, the fast axis's run; runs that
    /// touch are merged when both are plain (`None` where a strided one would touch).
    fn box_keys(&self, p: &Piece, g: GridId, runs: &[Run], span: Span) -> Eval<Option<List>> {
        let gv = &self.bound.grids[g];
        let nd = runs.len();
        let (slow, fast) = (&runs[..nd - 1], runs[nd - 1]);
        for run in slow {
            // A slow axis's count must hold on every row: its runs are the list's intervals.
            if run.end.step - run.first.step != 0 && run.stride == 1 {
                return Err(self.single(p));
            }
        }
        // Strides of the slow axes in keys, slowest first.
        let mut strides = vec![1i64; nd];
        for i in (0..nd - 1).rev() {
            strides[i] = strides[i + 1] * gv.dims[i + 1];
        }
        let total: i64 = slow.iter().map(|r| r.count).product();
        let mut out: List = Vec::with_capacity(total as usize);
        let mut idx = vec![0i64; nd - 1];
        'tuples: loop {
            let mut base = Affine::constant(gv.at);
            for (i, run) in slow.iter().enumerate() {
                let c = self.add(p, run.first, Affine::constant(idx[i] * run.stride), span)?;
                base = self.add(p, base, self.scale(p, c, strides[i], span)?, span)?;
            }
            let iv = AffineInterval {
                start: self.add(p, base, fast.first, span)?,
                end: self.add(p, base, fast.end, span)?,
                stride: fast.stride,
            };
            match out.last_mut() {
                Some(last) if !self.lt(p, last.end, iv.start)? => {
                    if last.stride != 1 || iv.stride != 1 {
                        return Ok(None);
                    }
                    last.end = iv.end;
                }
                _ => out.push(iv),
            }
            // The next combination, the fastest slow axis first.
            for i in (0..nd - 1).rev() {
                idx[i] += 1;
                if idx[i] < slow[i].count {
                    continue 'tuples;
                }
                idx[i] = 0;
            }
            break;
        }
        Ok(Some(out))
    }

    /// [`Solver::coord_fn`], read once per (function, grid, b, h): a key-side function
    /// reads neither `q` nor a quantifier's variable.
    fn box_coord_fn(&self, p: &Piece, e: &Int, g: GridId) -> Option<Coord> {
        let key = (e as *const Int as usize, g, p.b, p.h);
        if let Some(&out) = self.coord_fns.borrow().get(&key) {
            return out;
        }
        let out = self.coord_fn(p, e, g);
        self.coord_fns.borrow_mut().insert(key, out);
        out
    }

    /// The key-side function `e` of grid `g`'s coordinates as a [`CoordFn`] of one axis,
    /// checked to fit in 64 bits at every coordinate of the grid, with no `%` by a divisor
    /// below 1 and no other operation on `k`.
    fn coord_fn(&self, p: &Piece, e: &Int, g: GridId) -> Option<Coord> {
        let dims = &self.bound.grids[g].dims;
        let out = self.coord_fn_at(p, e, g)?;
        match out {
            (Some(axis), form) if form.fits(dims[axis]) => Some(out),
            (None, _) => Some(out),
            _ => None,
        }
    }

    fn coord_fn_at(&self, p: &Piece, e: &Int, g: GridId) -> Option<Coord> {
        if !e.has_k() {
            let v = self.bound.eval_int(e, &self.env(p)).ok()?;
            return Some((None, CoordFn::Lin { a: 0, b: v }));
        }
        let dims = &self.bound.grids[g].dims;
        let checked = |out: Coord| match out {
            (Some(axis), form) if !form.fits(dims[axis]) => None,
            _ => Some(out),
        };
        let out = match &e.kind {
            IntKind::GridCoord(h, axis, pos) if *h == g && matches!(pos.kind, IntKind::K) => {
                (Some(usize::from(*axis)), CoordFn::Lin { a: 1, b: 0 })
            }
            IntKind::Neg(a) => {
                let (axis, f) = self.coord_fn_at(p, a, g)?;
                (axis, f.scale(-1)?)
            }
            IntKind::Bin(op @ (IntOp::Add | IntOp::Sub), x, y) => {
                let (ax, fx) = self.coord_fn_at(p, x, g)?;
                let (ay, fy) = self.coord_fn_at(p, y, g)?;
                let fy = if *op == IntOp::Sub { fy.scale(-1)? } else { fy };
                match (ax, fx, ay, fy) {
                    (_, f, None, CoordFn::Lin { b, .. }) => (ax, f.shift(b)?),
                    (None, CoordFn::Lin { b, .. }, _, f) => (ay, f.shift(b)?),
                    (
                        Some(i),
                        CoordFn::Lin { a: a1, b: b1 },
                        Some(j),
                        CoordFn::Lin { a: a2, b: b2 },
                    ) if i == j => (
                        Some(i),
                        CoordFn::Lin {
                            a: a1.checked_add(a2)?,
                            b: b1.checked_add(b2)?,
                        },
                    ),
                    _ => return None,
                }
            }
            IntKind::Bin(IntOp::Mul, x, y) => {
                let (ax, fx) = self.coord_fn_at(p, x, g)?;
                let (ay, fy) = self.coord_fn_at(p, y, g)?;
                match (ax, fx, ay, fy) {
                    (_, f, None, CoordFn::Lin { b, .. }) => (ax, f.scale(b)?),
                    (None, CoordFn::Lin { b, .. }, _, f) => (ay, f.scale(b)?),
                    _ => return None,
                }
            }
            IntKind::Bin(IntOp::Mod, x, y) if !y.has_k() => {
                let (ax, fx) = self.coord_fn_at(p, x, g)?;
                let m = self.bound.eval_int(y, &self.env(p)).ok()?;
                match (ax, fx) {
                    (Some(_), CoordFn::Lin { a, b }) if m >= 1 => (
                        ax,
                        CoordFn::Mod {
                            b: 0,
                            s: 1,
                            alpha: a,
                            beta: b,
                            m,
                        },
                    ),
                    _ => return None,
                }
            }
            _ => return None,
        };
        checked(out)
    }

    /// The q-side value `e` over the piece as `b + t * (a mod m)` when it is written as
    /// sums, differences, negations and constant multiples around one `% m` (`m >= 1`
    /// constant), every part evaluated over the piece and every partial value checked
    /// against 64 bits; `None` otherwise.
    fn mod_form(&self, p: &Piece, e: &Int) -> Eval<Option<ModForm>> {
        let fits = |(lo, hi): (i128, i128)| i64::try_from(lo).is_ok() && i64::try_from(hi).is_ok();
        let range = |x: Affine| {
            let (lo, hi) = super::ends(p, x);
            (i128::from(lo), i128::from(hi))
        };
        let q_free = |x: &Int| !x.mentions(&|l| matches!(l, IntKind::Q | IntKind::Var(_)));
        let out = match &e.kind {
            IntKind::Bin(IntOp::Mod, x, y) if q_free(y) => {
                let m = self.int(p, y)?;
                if m.step != 0 || m.first < 1 {
                    return Ok(None);
                }
                let a = self.int(p, x)?;
                ModForm {
                    b: Affine::constant(0),
                    t: 1,
                    a,
                    m: m.first,
                    range: (0, i128::from(m.first - 1)),
                }
            }
            IntKind::Neg(x) => {
                let Some(f) = self.mod_form(p, x)? else {
                    return Ok(None);
                };
                self.mod_scaled(p, f, -1, e.span)?
            }
            IntKind::Bin(IntOp::Mul, x, y) if q_free(y) => {
                let Some(f) = self.mod_form(p, x)? else {
                    return Ok(None);
                };
                let c = self.int(p, y)?;
                if c.step != 0 {
                    return Ok(None);
                }
                self.mod_scaled(p, f, c.first, e.span)?
            }
            IntKind::Bin(op @ (IntOp::Add | IntOp::Sub), x, y) => {
                let sign = if *op == IntOp::Sub { -1 } else { 1 };
                if let Some(f) = self.mod_form(p, x)? {
                    let v = self.int(p, y)?;
                    let v = self.scale(p, v, sign, e.span)?;
                    let (lo, hi) = range(v);
                    ModForm {
                        b: self.add(p, f.b, v, e.span)?,
                        range: (f.range.0 + lo, f.range.1 + hi),
                        ..f
                    }
                } else if let Some(f) = self.mod_form(p, y)? {
                    let f = self.mod_scaled(p, f, sign, e.span)?;
                    let v = self.int(p, x)?;
                    let (lo, hi) = range(v);
                    ModForm {
                        b: self.add(p, f.b, v, e.span)?,
                        range: (f.range.0 + lo, f.range.1 + hi),
                        ..f
                    }
                } else {
                    return Ok(None);
                }
            }
            _ => return Ok(None),
        };
        Ok(fits(out.range).then_some(out))
    }

    /// `c * f`.
    fn mod_scaled(&self, p: &Piece, f: ModForm, c: i64, span: Span) -> Eval<ModForm> {
        let (x, y) = (f.range.0 * i128::from(c), f.range.1 * i128::from(c));
        Ok(ModForm {
            b: self.scale(p, f.b, c, span)?,
            t: f.t.checked_mul(c).ok_or_else(|| super::overflow(span))?,
            range: (x.min(y), x.max(y)),
            ..f
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(kind: IntKind) -> Int {
        Int::new(kind, Span::default())
    }

    fn coord(g: GridId, axis: u8, pos: Int) -> Int {
        int(IntKind::GridCoord(g, axis, Box::new(pos)))
    }

    fn bin(op: IntOp, a: Int, b: Int) -> Int {
        int(IntKind::Bin(op, Box::new(a), Box::new(b)))
    }

    /// Grid 0 is 2D (`x` is axis 1), grid 1 is 3D (`x` is axis 2).
    fn line(e: &Int) -> Option<GridId> {
        line_grid(e, &|g| [2, 3][g])
    }

    #[test]
    fn line_values_read_q_only_as_one_grids_fastest_coordinate() {
        let q = || int(IntKind::Q);
        let c = |v| int(IntKind::Const(v));
        let x = || coord(0, 1, q());
        // NATTEN's window start along x: min(max(x / d, 3), x % d + 9) - 3.
        let start = bin(
            IntOp::Sub,
            bin(
                IntOp::Min,
                bin(IntOp::Max, bin(IntOp::Div, x(), c(2)), c(3)),
                bin(IntOp::Add, bin(IntOp::Mod, x(), c(2)), c(9)),
            ),
            c(3),
        );
        assert_eq!(line(&start), Some(0));
        assert_eq!(line(&coord(1, 2, q())), Some(1));
        let guarded = int(IntKind::If(
            Box::new(Bool::Cmp(CmpOp::Lt, x(), c(4))),
            Box::new(x()),
            Box::new(c(0)),
        ));
        assert_eq!(line(&guarded), Some(0));
        // Not a function of the fastest coordinate alone.
        for e in [
            c(5),
            q(),
            bin(IntOp::Add, x(), q()),
            coord(0, 0, q()),
            bin(IntOp::Add, x(), coord(0, 0, q())),
            bin(IntOp::Add, x(), coord(1, 2, q())),
            coord(0, 1, bin(IntOp::Add, q(), c(1))),
            coord(1, 1, q()),
            int(IntKind::If(
                Box::new(Bool::InGrid(0, q())),
                Box::new(x()),
                Box::new(c(0)),
            )),
        ] {
            assert_eq!(line(&e), None, "{e:?}");
        }
    }
}
