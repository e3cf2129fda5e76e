//! Q-side values that are affine over a piece only once their floor terms cancel: the
//! normal form of `d * (q / d) + q % d` (which is `q`) and of clamps of such terms, as
//! NATTEN's dilated window writes its start, `q % d + d * max(0, min(q / d - r, L - K))`.
//!
//! [`Solver::int`] evaluates a value affinely and splits a piece where any part of it stops
//! being affine, so `q / d` and `q % d` cut every piece to `d` rows even where their sum is
//! affine. When that happens the value is evaluated again here, over the whole piece, as a
//! [`Quasi`]: an affine part plus `c * floor((t + o) / m)`, which `q / d` and `q % d` both
//! are (with `m = d`), so their floor terms add and cancel. A `min` / `max` whose sides are
//! ordered over the piece (or over a prefix of it, where the piece is split) picks one side;
//! a value that is not a [`Quasi`] (`(n - q % d) / d`) is kept only as bounds ([`Qv::Hard`])
//! for that choice. The result is used only when it is affine; otherwise the first
//! evaluation's split stands.
//!
//! Errors: a side a `min` / `max` leaves out is not evaluated row by row, so this evaluation
//! only succeeds where every part of the value provably fails at no row of the piece: leaves
//! are evaluated by [`Solver::int_at`] (with their errors), divisors are constant and not
//! zero, and every sum, product and quotient is checked against 64 bits over its bounds
//! (`None` where that cannot be shown: the first evaluation's split then stands, and rows
//! are evaluated as before).

use super::{Affine, Eval, Flow, Piece, Solver};
use cm_ir::ir::{Int, IntKind, IntOp};

/// `value(t) = aff(t) + c * floor((t + o) / m)` at offset `t` of a piece, `m >= 1`,
/// `0 <= o < m`; `c == 0` is an affine value (then `m == 1`, `o == 0`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Quasi {
    aff: Affine,
    c: i64,
    m: i64,
    o: i64,
}

/// A value over a piece: a [`Quasi`], or only bounds (inclusive) on every row.
#[derive(Clone, Copy, Debug)]
enum Qv {
    Q(Quasi),
    Hard(i128, i128),
}

fn fits(x: i128) -> bool {
    (i128::from(i64::MIN)..=i128::from(i64::MAX)).contains(&x)
}

impl Quasi {
    fn affine(aff: Affine) -> Quasi {
        Quasi {
            aff,
            c: 0,
            m: 1,
            o: 0,
        }
    }

    fn at(&self, t: i64) -> i128 {
        i128::from(self.aff.first)
            + i128::from(self.aff.step) * i128::from(t)
            + i128::from(self.c) * i128::from((t + self.o) / self.m)
    }

    /// Whether the value never falls or never rises from one row to the next: it moves by
    /// `step` or, where the floor term steps, by `step + c`.
    fn monotone(&self) -> bool {
        let a = i128::from(self.aff.step);
        let b = a + i128::from(self.c);
        let steps: &[i128] = if self.m == 1 { &[b] } else { &[a, b] };
        steps.iter().all(|&s| s >= 0) || steps.iter().all(|&s| s <= 0)
    }

    /// Bounds of the value over `n` rows: its ends when it is monotone; otherwise from
    /// `m * value(t) = lin(t) - c * ((t + o) mod m)` with `lin` affine in `t`.
    fn bounds(&self, n: i64) -> (i128, i128) {
        if self.monotone() {
            let (x, y) = (self.at(0), self.at(n - 1));
            return (x.min(y), x.max(y));
        }
        let (m, c) = (i128::from(self.m), i128::from(self.c));
        let lin = |t: i64| {
            m * (i128::from(self.aff.first) + i128::from(self.aff.step) * i128::from(t))
                + c * i128::from(t + self.o)
        };
        let (l0, l1) = (lin(0), lin(n - 1));
        let slack = -c * (m - 1);
        let lo = l0.min(l1) + slack.min(0);
        let hi = l0.max(l1) + slack.max(0);
        (lo.div_euclid(m), -(-hi).div_euclid(m))
    }

    /// `self + k * other`, when their floor terms are the same or absent.
    fn combine(self, k: i64, other: Quasi) -> Option<Quasi> {
        let (c2, m, o) = if other.c == 0 {
            (0, self.m, self.o)
        } else if self.c == 0 || (self.m, self.o) == (other.m, other.o) {
            (other.c, other.m, other.o)
        } else {
            return None;
        };
        let k = i128::from(k);
        let first = i128::from(self.aff.first) + k * i128::from(other.aff.first);
        let step = i128::from(self.aff.step) + k * i128::from(other.aff.step);
        let c = i128::from(self.c) + k * i128::from(c2);
        let aff = Affine {
            first: i64::try_from(first).ok()?,
            step: i64::try_from(step).ok()?,
        };
        Some(match i64::try_from(c).ok()? {
            0 => Quasi::affine(aff),
            c => Quasi { aff, c, m, o },
        })
    }

    fn scaled(self, k: i64) -> Option<Quasi> {
        Quasi::affine(Affine::constant(0)).combine(k, self)
    }
}

impl Qv {
    fn bounds(&self, n: i64) -> (i128, i128) {
        match *self {
            Qv::Q(q) => q.bounds(n),
            Qv::Hard(lo, hi) => (lo, hi),
        }
    }
}

/// Bounds that fit in 64 bits, as a [`Qv::Hard`].
fn hard((lo, hi): (i128, i128)) -> Option<Qv> {
    (fits(lo) && fits(hi)).then_some(Qv::Hard(lo, hi))
}

/// A quasi value whose every row fits in 64 bits.
fn checked(p: &Piece, q: Quasi) -> Option<Qv> {
    let (lo, hi) = q.bounds(p.n);
    (fits(lo) && fits(hi)).then_some(Qv::Q(q))
}

/// `floor(v / d)` for `d != 0`.
fn floor_div(v: i128, d: i64) -> i128 {
    let d = i128::from(d);
    if d < 0 {
        (-v).div_euclid(-d)
    } else {
        v.div_euclid(d)
    }
}

impl Solver<'_, '_> {
    /// `e` over the piece from its floor terms' normal form, after its affine evaluation
    /// split at `at` (see the module docs): the affine value, or a split (at `at`, or where
    /// a `min` / `max` changes sides, or where a remaining floor term steps, if later).
    pub(super) fn int_quasi(&self, p: &Piece, e: &Int, at: i64) -> Eval<Affine> {
        match self.qv(p, e)? {
            // The floor term is 0 until `t + o` reaches `m`.
            Some(Qv::Q(q)) if q.c == 0 || q.m - q.o >= p.n => Ok(q.aff),
            Some(Qv::Q(q)) => Err(Flow::Split(at.max(p.q0 + q.m - q.o))),
            _ => Err(Flow::Split(at)),
        }
    }

    fn qv(&self, p: &Piece, e: &Int) -> Eval<Option<Qv>> {
        cm_ir::deep(|| self.qv_at(p, e))
    }

    fn qv_at(&self, p: &Piece, e: &Int) -> Eval<Option<Qv>> {
        let (op, x, y) = match &e.kind {
            IntKind::Neg(x) => {
                return Ok(match self.qv(p, x)? {
                    Some(Qv::Q(q)) => q.scaled(-1).and_then(|q| checked(p, q)),
                    Some(Qv::Hard(lo, hi)) => hard((-hi, -lo)),
                    None => None,
                })
            }
            IntKind::Bin(op, x, y) => (*op, x, y),
            _ => return Ok(Some(Qv::Q(Quasi::affine(self.int_at(p, e)?)))),
        };
        let Some(a) = self.qv(p, x)? else {
            return Ok(None);
        };
        let Some(b) = self.qv(p, y)? else {
            return Ok(None);
        };
        let n = p.n;
        let constant = |v: &Qv| match v {
            Qv::Q(q) if q.c == 0 && q.aff.step == 0 => Some(q.aff.first),
            _ => None,
        };
        Ok(match op {
            IntOp::Add | IntOp::Sub => {
                let k = if op == IntOp::Add { 1 } else { -1 };
                let exact = match (a, b) {
                    (Qv::Q(x), Qv::Q(y)) => x.combine(k, y),
                    _ => None,
                };
                match exact {
                    Some(q) => checked(p, q),
                    None => {
                        let ((alo, ahi), (blo, bhi)) = (a.bounds(n), b.bounds(n));
                        hard(if k == 1 {
                            (alo + blo, ahi + bhi)
                        } else {
                            (alo - bhi, ahi - blo)
                        })
                    }
                }
            }
            IntOp::Mul => {
                let (c, v) = match (constant(&a), constant(&b)) {
                    (Some(c), _) => (c, b),
                    (_, Some(c)) => (c, a),
                    _ => return Ok(None),
                };
                match v {
                    Qv::Q(q) => q.scaled(c).and_then(|q| checked(p, q)),
                    Qv::Hard(lo, hi) => {
                        let c = i128::from(c);
                        hard(((lo * c).min(hi * c), (lo * c).max(hi * c)))
                    }
                }
            }
            IntOp::Div | IntOp::Mod => {
                let Some(d) = constant(&b).filter(|&d| d != 0) else {
                    return Ok(None);
                };
                let quotient = quotient(p, a, d);
                if op == IntOp::Div {
                    quotient
                } else {
                    // x mod d = x - d * floor(x / d), in [0, d) or (d, 0].
                    let within = if d > 0 {
                        (0, i128::from(d) - 1)
                    } else {
                        (i128::from(d) + 1, 0)
                    };
                    let exact = match (a, quotient) {
                        (Qv::Q(x), Some(Qv::Q(f))) => f.scaled(d).and_then(|df| x.combine(-1, df)),
                        _ => None,
                    };
                    match exact {
                        Some(r) => checked(p, r),
                        None => hard(within),
                    }
                }
            }
            IntOp::Min | IntOp::Max => return self.choose(p, op == IntOp::Min, a, b),
        })
    }

    /// `min(a, b)` (`is_min`) or `max(a, b)`: the side that is on the right side of the
    /// other on every row, or a split where that stops holding when it holds on the first.
    fn choose(&self, p: &Piece, is_min: bool, a: Qv, b: Qv) -> Eval<Option<Qv>> {
        let n = p.n;
        let ((alo, ahi), (blo, bhi)) = (a.bounds(n), b.bounds(n));
        // The side taken where a <= b, and where a >= b.
        let (low, high) = if is_min { (a, b) } else { (b, a) };
        if ahi <= blo {
            return Ok(Some(low));
        }
        if bhi <= alo {
            return Ok(Some(high));
        }
        let difference = match (a, b) {
            (Qv::Q(x), Qv::Q(y)) => x.combine(-1, y),
            _ => None,
        };
        // What decides the order on a row, monotone in the row, and the side it gives
        // while it holds: the first row where it stops holding ends the prefix.
        let (holds, side): (Box<dyn Fn(i64) -> bool>, Qv) = match (difference, a, b) {
            (Some(d), _, _) if d.monotone() => {
                if d.at(0) <= 0 {
                    (Box::new(move |t| d.at(t) <= 0), low)
                } else {
                    (Box::new(move |t| d.at(t) > 0), high)
                }
            }
            (_, Qv::Q(x), Qv::Hard(..)) if x.monotone() && x.at(0) <= blo => {
                (Box::new(move |t| x.at(t) <= blo), low)
            }
            (_, Qv::Q(x), Qv::Hard(..)) if x.monotone() && x.at(0) >= bhi => {
                (Box::new(move |t| x.at(t) >= bhi), high)
            }
            (_, Qv::Hard(..), Qv::Q(y)) if y.monotone() && y.at(0) >= ahi => {
                (Box::new(move |t| y.at(t) >= ahi), low)
            }
            (_, Qv::Hard(..), Qv::Q(y)) if y.monotone() && y.at(0) <= alo => {
                (Box::new(move |t| y.at(t) <= alo), high)
            }
            _ => return Ok(None),
        };
        match self.split_where(p, holds) {
            Some(s) => Err(s),
            None => Ok(Some(side)),
        }
    }
}

/// `floor(x / d)` for a constant `d != 0`: a [`Quasi`] for `q / d` and for quotients of
/// floor terms that `d` divides, else bounds.
fn quotient(p: &Piece, x: Qv, d: i64) -> Option<Qv> {
    match x {
        // floor((v0 + t) / d) = floor(v0 / d) + floor((v0 mod d + t) / d).
        Qv::Q(q) if q.c == 0 && q.aff.step == 1 && d > 1 => checked(
            p,
            Quasi {
                aff: Affine::constant(q.aff.first.div_euclid(d)),
                c: 1,
                m: d,
                o: q.aff.first.rem_euclid(d),
            },
        ),
        Qv::Q(q) if q.aff.step % d == 0 && q.c % d == 0 => {
            let first = i64::try_from(floor_div(i128::from(q.aff.first), d)).ok()?;
            let step = q.aff.step / d;
            let aff = Affine { first, step };
            checked(
                p,
                match q.c / d {
                    0 => Quasi::affine(aff),
                    c => Quasi { aff, c, ..q },
                },
            )
        }
        v => {
            let (lo, hi) = v.bounds(p.n);
            if d == -1 && lo == i128::from(i64::MIN) {
                return None;
            }
            let (a, b) = (floor_div(lo, d), floor_div(hi, d));
            hard((a.min(b), a.max(b)))
        }
    }
}
