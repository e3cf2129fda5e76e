//! One row evaluated exactly as the pairwise reference evaluates it, errors included: the
//! fallback for a row whose evaluation by [`Solver::region`] fails.
//!
//! [`Solver::region`] narrows the keys it evaluates a region at to a *hull* (one range), so
//! a term the reference evaluates only at some keys of that range (the right side of `&`
//! behind a left side with gaps, a later term of an `all`) is evaluated at more keys than the
//! reference's, and may fail where the reference does not. Here every region is evaluated at
//! its *domain* alone: the keys at which the reference evaluates it on this row. The mask's
//! domain is every key; `a | b` gives both sides its own, `a & b` and `a - b` give `b` the
//! keys of the domain where `a` holds, `all` gives each term the keys where every earlier
//! term holds, `any` each term the whole domain; a region with an empty domain is not
//! evaluated at all.
//!
//! An evaluation gives the region's keys, exact within its domain below the smallest key of
//! the domain at which the reference fails evaluating it (if any: [`Partial::fails`]). The
//! reference walks a row's keys in order and stops at the first pair that fails, so the
//! row's error is the one the reference raises at the mask's first failing key, which is
//! evaluated there pair by pair ([`Bound::region_at`]): the same code, span and message.
//!
//! An atom fails at a key of its domain either wherever it is evaluated (its q-side values:
//! a division by zero, an index out of range; found by evaluating it at the domain's first
//! key), or at keys that depend on the atom: `alpha * k + rest` overflowing (one range of
//! keys does not, [`ok_keys`]; `i64::MIN / -1` in a `/` atom), a key-side function failing at
//! the keys it was found to fail at ([`KeySweep`]), an L2 ball whose squared radius overflows
//! at the keys in its grid, and `elementwise` at the keys where its predicate fails. An atom
//! that fails nowhere in its domain is solved as [`Solver::region`] solves it within the
//! domain's hull, or, where the solver's own arithmetic overflows (constants near the 64-bit
//! limits), pair by pair at the domain's keys, counted as `elementwise` pairs.

use super::{
    floor_i128, single_row_keys, square_overflows, Affine, AffineInterval, Eval, Flow, Piece,
    Solver,
};
use cm_ir::bind;
use cm_ir::ir::{Int, Region};
use cm_ir::PResult;
use cm_syntax::Code;

/// Keys of one row: ascending, disjoint, non-empty `[start, end)` ranges.
type Keys = Vec<(i64, i64)>;

/// A region's keys on one row, exact at the keys of its domain below `fails`, and the
/// smallest key of its domain at which the reference fails evaluating it.
struct Partial {
    keys: Vec<AffineInterval>,
    fails: Option<i64>,
}

impl Partial {
    /// A region that fails at the first key of its domain.
    fn fails_at(k: i64) -> Partial {
        Partial {
            keys: Vec::new(),
            fails: Some(k),
        }
    }
}

/// The smaller of two failing keys.
fn earliest(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        _ => a.or(b),
    }
}

/// The keys of `dom` below `fails` (all of them for `None`).
fn below(dom: &[(i64, i64)], fails: Option<i64>) -> Keys {
    let Some(k) = fails else {
        return dom.to_vec();
    };
    dom.iter()
        .map(|&(a, z)| (a, z.min(k)))
        .filter(|(a, z)| a < z)
        .collect()
}

/// The keys of `dom` that a one-row list holds (a strided run's keys, not its span).
fn meet(dom: &[(i64, i64)], list: &[AffineInterval]) -> Keys {
    let (Some(&(lo, _)), Some(&(_, hi))) = (dom.first(), dom.last()) else {
        return Vec::new();
    };
    let held = single_row_keys(list, (lo, hi));
    let mut out = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < dom.len() && j < held.len() {
        let (a, z) = (dom[i].0.max(held[j].0), dom[i].1.min(held[j].1));
        if a < z {
            out.push((a, z));
        }
        if dom[i].1 <= held[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// The keys `k`, as an inclusive range (empty when its start is past its end), at which the
/// reference's `add(mul(alpha, k), rest)` does not fail, as [`Solver::no_overflow`] asks at
/// two keys: the product and the sum fit in 64 bits, and with `min_fails` (a divisor of -1
/// follows) the sum is not `i64::MIN` either. `alpha != 0`.
fn ok_keys(alpha: i64, rest: i64, min_fails: bool) -> (i128, i128) {
    let (min, max) = (i128::from(i64::MIN), i128::from(i64::MAX));
    // alpha * k must lie in [lo, hi].
    let lo = min.max(min + i128::from(min_fails) - i128::from(rest));
    let hi = max.min(max - i128::from(rest));
    let a = i128::from(alpha);
    let ceil = |x: i128, d: i128| -floor_i128(-x, d);
    if a > 0 {
        (ceil(lo, a), floor_i128(hi, a))
    } else {
        (ceil(hi, a), floor_i128(lo, a))
    }
}

/// The first key of `dom` outside the inclusive range `ok`.
fn first_outside(dom: &[(i64, i64)], ok: (i128, i128)) -> Option<i64> {
    let &(first, _) = dom.first()?;
    if i128::from(first) < ok.0 {
        return Some(first);
    }
    dom.iter()
        .find(|&&(_, z)| i128::from(z - 1) > ok.1)
        .map(|&(a, _)| i128::from(a).max(ok.1 + 1) as i64)
}

/// The first key of `dom` inside `[lo, hi)`.
fn first_inside(dom: &[(i64, i64)], (lo, hi): (i64, i64)) -> Option<i64> {
    dom.iter()
        .map(|&(a, z)| (a.max(lo), z.min(hi)))
        .find(|(a, z)| a < z)
        .map(|(a, _)| a)
}

/// A one-row evaluation's value: a piece of one row never splits.
fn once<T>(r: Eval<T>) -> PResult<T> {
    r.map_err(|f| match f {
        Flow::Error(e) => e,
        Flow::Split(s) => unreachable!("a piece of one row split at {s}"),
    })
}

impl Solver<'_, '_> {
    /// The mask's keys on the one row of `p` (`p.n == 1`) as canonical plain intervals (or
    /// strided runs), exactly as the pairwise reference gives them (see the module docs).
    ///
    /// # Errors
    /// The error the reference raises on that row: the one at its first failing key. A
    /// planning limit (`CM0404`: intervals, `elementwise` pairs) as [`Solver::region`]
    /// meets it.
    pub fn exact_row(&self, p: &Piece) -> PResult<Vec<AffineInterval>> {
        debug_assert_eq!(p.n, 1, "one row at a time");
        let kv_len = self.bound.shape.kv_len;
        let mask = &self.bound.program.mask;
        let row = self.exact(p, mask, &[(0, kv_len)])?;
        let Some(k) = row.fails else {
            return Ok(row.keys);
        };
        match self.bound.region_at(mask, &self.env_at(p, k)) {
            Err(e) => Err(e),
            Ok(_) => {
                debug_assert!(false, "row {} does not fail at key {k}", p.q0);
                // The row pair by pair, which is the reference by definition.
                let keys = self.bound.brute_force_row(p.q0, p.b, p.h)?;
                Ok(keys
                    .into_iter()
                    .map(|(a, z)| {
                        AffineInterval::unit(
                            Affine::constant(i64::from(a)),
                            Affine::constant(i64::from(z)),
                        )
                    })
                    .collect())
            }
        }
    }

    fn env_at(&self, p: &Piece, k: i64) -> cm_ir::Env {
        cm_ir::Env { k, ..self.env(p) }
    }

    fn exact(&self, p: &Piece, r: &Region, dom: &[(i64, i64)]) -> PResult<Partial> {
        cm_ir::deep(|| self.exact_in(p, r, dom))
    }

    fn exact_in(&self, p: &Piece, r: &Region, dom: &[(i64, i64)]) -> PResult<Partial> {
        let Some(&(first, _)) = dom.first() else {
            // Evaluated at no key: it holds nowhere that matters and cannot fail.
            return Ok(Partial {
                keys: Vec::new(),
                fails: None,
            });
        };
        Ok(match r {
            Region::Union(a, b) => {
                let x = self.exact(p, a, dom)?;
                let y = self.exact(p, b, &below(dom, x.fails))?;
                Partial {
                    keys: once(self.union(p, x.keys, y.keys))?,
                    fails: earliest(x.fails, y.fails),
                }
            }
            Region::Inter(a, b) | Region::Diff(a, b) => {
                let x = self.exact(p, a, dom)?;
                let y = self.exact(p, b, &meet(&below(dom, x.fails), &x.keys))?;
                let keys = if matches!(r, Region::Inter(..)) {
                    once(self.inter(p, &x.keys, &y.keys))?
                } else {
                    let not_y = once(self.complement(p, &y.keys))?;
                    once(self.inter(p, &x.keys, &not_y))?
                };
                Partial {
                    keys,
                    fails: earliest(x.fails, y.fails),
                }
            }
            Region::Not(a) => {
                let x = self.exact(p, a, dom)?;
                Partial {
                    keys: once(self.complement(p, &x.keys))?,
                    fails: x.fails,
                }
            }
            Region::Cond(c, a, b) => match self.bound.eval_bool(c, &self.env_at(p, first)) {
                Ok(v) => self.exact(p, if v { a } else { b }, dom)?,
                Err(_) => Partial::fails_at(first),
            },
            Region::Quant {
                all,
                depth,
                lo,
                hi,
                body,
                span,
            } => {
                let env = self.env_at(p, first);
                let range = self
                    .bound
                    .eval_int(lo, &env)
                    .and_then(|lo| bind::quant_range(lo, self.bound.eval_int(hi, &env)?, *span));
                let Ok(range) = range else {
                    return Ok(Partial::fails_at(first));
                };
                self.count_quant_evals(range.end - range.start, *span)?;
                let outer = self.vars.get();
                let out = self.exact_quant(p, *all, *depth as usize, range, body, dom);
                self.vars.set(outer);
                out?
            }
            Region::Elementwise(c, span) => {
                let (keys, failure) = once(self.elementwise_scan(p, c, *span, dom))?;
                Partial {
                    keys,
                    fails: failure.map(|(k, _)| k),
                }
            }
            atom => {
                if self.bound.region_at(atom, &self.env_at(p, first)).is_err() {
                    return Ok(Partial::fails_at(first));
                }
                let fails = self.key_failure(p, atom, dom);
                let d = below(dom, fails);
                let keys = match self.atom_keys(p, atom, &d) {
                    Ok(keys) => keys,
                    // The solver's own arithmetic overflowed where the reference's does not
                    // (constants near the 64-bit limits): the atom pair by pair.
                    Err(e) if e.code != Code::TooLargeToPlan => {
                        let at = |env: &cm_ir::Env| self.bound.region_at(atom, env);
                        once(self.scan(p, self.bound.program.mask_span, &d, at))?.0
                    }
                    Err(e) => return Err(e),
                };
                Partial { keys, fails }
            }
        })
    }

    /// `any` / `all` over `range` at the keys of `dom`: `any` evaluates every term at every
    /// key, `all` each term at the keys where the earlier ones hold (a chain of `&`).
    fn exact_quant(
        &self,
        p: &Piece,
        all: bool,
        depth: usize,
        range: std::ops::Range<i64>,
        body: &Region,
        dom: &[(i64, i64)],
    ) -> PResult<Partial> {
        let mut vars = self.vars.get();
        let mut fails = None;
        // For `all`: the keys where every term so far holds (`None`: no term yet).
        let mut kept: Option<Vec<AffineInterval>> = None;
        let mut found = Vec::new();
        for i in range {
            let d = match &kept {
                Some(keys) => meet(&below(dom, fails), keys),
                None => below(dom, fails),
            };
            if d.is_empty() {
                break;
            }
            vars[depth] = i;
            self.vars.set(vars);
            let term = self.exact(p, body, &d)?;
            fails = earliest(fails, term.fails);
            if all {
                kept = Some(match kept {
                    Some(keys) => once(self.inter(p, &keys, &term.keys))?,
                    None => term.keys,
                });
            } else {
                found.extend(term.keys);
            }
        }
        let keys = if all {
            kept.unwrap_or_else(|| self.all())
        } else {
            once(self.union_all(p, found))?
        };
        Ok(Partial { keys, fails })
    }

    /// The first key of `dom` at which atom `r` fails for a reason that depends on the key,
    /// its q-side values having evaluated at the domain's first key (so everywhere).
    fn key_failure(&self, p: &Piece, r: &Region, dom: &[(i64, i64)]) -> Option<i64> {
        let env = self.env_at(p, dom.first()?.0);
        let value = |e: &Int| self.bound.eval_int(e, &env).ok();
        match r {
            Region::KCmp { alpha, rest, .. } | Region::KMod { alpha, rest, .. } => {
                let r = value(rest)?;
                first_outside(dom, ok_keys(*alpha, r, false))
            }
            Region::KDiv {
                alpha, rest, div, ..
            } => {
                let r = value(rest)?;
                first_outside(dom, ok_keys(*alpha, r, value(div)? == -1))
            }
            Region::KeyCmp { f, .. } => self.key_sweep(p, r, f).first_failing(dom),
            Region::Ball {
                grid,
                metric,
                radius,
                ..
            } => {
                let g = &self.bound.grids[*grid];
                let inside = g.coords(p.q0).is_some();
                (inside && square_overflows(*metric, value(radius)?))
                    .then(|| first_inside(dom, (g.at, g.at.saturating_add(g.size))))?
            }
            _ => None,
        }
    }

    /// The keys of atom `r` within `dom`, at no key of which it fails
    /// ([`Solver::key_failure`]).
    fn atom_keys(&self, p: &Piece, r: &Region, dom: &[(i64, i64)]) -> PResult<Vec<AffineInterval>> {
        let (Some(&(lo, _)), Some(&(_, hi))) = (dom.first(), dom.last()) else {
            return Ok(Vec::new());
        };
        let hull = (lo, hi);
        match r {
            // Keys whose `f` fails lie outside the domain (see `key_failure`).
            Region::KeyCmp { f, op, v, span } => {
                once(self.key_cmp(p, r, f, *op, v, *span, Some(hull)))
            }
            // Its squared radius overflows at every key of the grid, so none is in the
            // domain; the ball holds no other key.
            Region::Ball {
                grid,
                metric,
                radius,
                ..
            } if square_overflows(*metric, self.bound.eval_int(radius, &self.env(p))?)
                && self.bound.grids[*grid].coords(p.q0).is_some() =>
            {
                Ok(Vec::new())
            }
            _ => once(self.region(p, r, Some(hull))),
        }
    }
}
