//! The reference semantics: whether one (q, k) pair is visible, evaluated directly from
//! the IR. This is the definition every analytical result is tested against, and the
//! evaluator `elementwise(...)` regions use. Cost O(1) per pair, so O(q_len x kv_len) for
//! a whole mask: for tests, debugging and the escape hatch only.
//!
//! Evaluation order is part of the semantics of errors: `&` and `-` skip their right side
//! where the left side is false, `if` evaluates one branch, `|` evaluates both.

use crate::bind::{add, cmp, floor_div, floor_mod, mul, quant_range, Bound, Env, PResult};
use crate::ir::*;

impl Bound<'_> {
    /// Is key `k` visible from query row `q` in batch `b`, head `h`? Keys outside
    /// `[0, kv_len)` are never visible.
    ///
    /// # Errors
    /// Any plan-time error the mask raises at this pair (division by zero, positions outside
    /// a segmentation or grid, overflow).
    pub fn visible(&self, q: i64, k: i64, b: i64, h: i64) -> PResult<bool> {
        if k < 0 || k >= self.shape.kv_len {
            return Ok(false);
        }
        self.at_batch(b)?.visible_here(q, k, b, h)
    }

    /// [`Bound::visible`] with the segmentations as laid out (for batch `b`).
    fn visible_here(&self, q: i64, k: i64, b: i64, h: i64) -> PResult<bool> {
        self.region_at(
            &self.program.mask,
            &Env {
                q,
                k,
                b,
                h,
                ..Env::default()
            },
        )
    }

    /// Row `q`'s visible keys as maximal `[start, end)` runs, by testing every key.
    pub fn brute_force_row(&self, q: i64, b: i64, h: i64) -> PResult<Vec<(u32, u32)>> {
        let mut out: Vec<(u32, u32)> = Vec::new();
        let at = self.at_batch(b)?;
        for k in 0..self.shape.kv_len {
            if at.visible_here(q, k, b, h)? {
                match out.last_mut() {
                    Some(last) if i64::from(last.1) == k => last.1 += 1,
                    _ => out.push((k as u32, k as u32 + 1)),
                }
            }
        }
        Ok(out)
    }

    /// Whether region `r` (the mask or a part of it) holds at the pair of `env`, evaluated
    /// as the mask evaluates it there (the key is not checked against `[0, kv_len)`; the
    /// segmentations are this binding's).
    ///
    /// # Errors
    /// The first error the evaluation meets, as [`Bound::visible`].
    pub fn region_at(&self, r: &Region, env: &Env) -> PResult<bool> {
        crate::deep(|| self.region_here(r, env))
    }

    fn region_here(&self, r: &Region, env: &Env) -> PResult<bool> {
        let k = env.k;
        Ok(match r {
            Region::Rows(c) => self.eval_bool(c, env)?,
            Region::KCmp {
                alpha,
                rest,
                op,
                span,
            } => {
                let lhs = add(mul(*alpha, k, *span)?, self.eval_int(rest, env)?, *span)?;
                cmp(*op, lhs, 0)
            }
            Region::KDiv {
                alpha,
                rest,
                div,
                op,
                rhs,
                span,
            } => {
                let x = add(mul(*alpha, k, *span)?, self.eval_int(rest, env)?, *span)?;
                let d = self.eval_int(div, env)?;
                cmp(*op, floor_div(x, d, div.span)?, self.eval_int(rhs, env)?)
            }
            Region::KMod {
                alpha,
                rest,
                div,
                op,
                rhs,
                span,
            } => {
                let x = add(mul(*alpha, k, *span)?, self.eval_int(rest, env)?, *span)?;
                let d = self.eval_int(div, env)?;
                cmp(*op, floor_mod(x, d, div.span)?, self.eval_int(rhs, env)?)
            }
            Region::Ball {
                grid,
                metric,
                strict,
                radius,
                span,
            } => {
                let r = self.eval_int(radius, env)?;
                let g = &self.grids[*grid];
                let (Some(cq), Some(ck)) = (g.coords(env.q), g.coords(k)) else {
                    return Ok(false);
                };
                let nd = g.dims.len();
                let deltas = (0..nd).map(|a| (cq[a] - ck[a]).abs());
                let d = match metric {
                    Metric::L1 => deltas.sum::<i64>(),
                    Metric::Linf => deltas.max().unwrap_or(0),
                    Metric::L2 => {
                        let s = deltas.map(|x| x * x).sum::<i64>();
                        let r2 = mul(r.max(0), r.max(0), *span)?;
                        return Ok(if *strict {
                            r > 0 && s < r2
                        } else {
                            r >= 0 && s <= r2
                        });
                    }
                };
                if *strict {
                    d < r
                } else {
                    d <= r
                }
            }
            Region::Box { grid, ranges, .. } => {
                let mut bounds = Vec::with_capacity(ranges.len());
                for rg in ranges {
                    bounds.push(self.eval_range(rg, env)?);
                }
                match self.grids[*grid].coords(k) {
                    Some(ck) => bounds
                        .iter()
                        .enumerate()
                        .all(|(a, (lo, hi))| *lo <= ck[a] && ck[a] < *hi),
                    None => false,
                }
            }
            Region::KeyCmp { f, op, v, .. } => {
                cmp(*op, self.eval_int(f, env)?, self.eval_int(v, env)?)
            }
            Region::Path { tree, pos, .. } => {
                let t = &self.trees[*tree];
                let n = t.len() as i64;
                let node = |p: i64| p.checked_sub(t.at).filter(|u| (0..n).contains(u));
                match (node(self.eval_int(pos, env)?), node(k)) {
                    (Some(u), Some(a)) => t.on_path(a as usize, u as usize),
                    _ => false,
                }
            }
            Region::Union(a, b) => {
                let x = self.region_at(a, env)?;
                let y = self.region_at(b, env)?;
                x || y
            }
            Region::Inter(a, b) => self.region_at(a, env)? && self.region_at(b, env)?,
            Region::Diff(a, b) => self.region_at(a, env)? && !self.region_at(b, env)?,
            Region::Not(a) => !self.region_at(a, env)?,
            Region::Cond(c, a, b) => {
                if self.eval_bool(c, env)? {
                    self.region_at(a, env)?
                } else {
                    self.region_at(b, env)?
                }
            }
            Region::Elementwise(c, _) => self.eval_bool(c, env)?,
            Region::Quant {
                all,
                depth,
                lo,
                hi,
                body,
                span,
            } => {
                let range = quant_range(self.eval_int(lo, env)?, self.eval_int(hi, env)?, *span)?;
                let mut inner = *env;
                let mut any = false;
                for i in range {
                    inner.vars[*depth as usize] = i;
                    // `any` evaluates every term, as `|` evaluates both sides; `all` stops at
                    // the first false one, as `&` skips its right side.
                    let v = self.region_at(body, &inner)?;
                    if *all && !v {
                        return Ok(false);
                    }
                    any |= v;
                }
                *all || any
            }
        })
    }
}
