//! `any` on one row solved in *runs of its variable*, and the bound on the terms of `any` /
//! `all` a solver evaluates.
//!
//! Why a quantifier can be slow: its terms are evaluated once per piece of rows, so a plan
//! costs pieces x terms; a range that reads `q` (`any i in 0 .. q + 1: k == i`) changes on
//! every row, so every row is a piece and the plan costs rows x terms, quadratic in the
//! length. On a row, though, the body is usually affine in the variable over long runs of
//! it, exactly as a mask is affine in `q` over pieces: so the body is solved over pieces of
//! the variable `[i0, i0 + m)` (the solver's pieces with the variable in place of the row,
//! `Solver::var_mode`), and each interval of such a run, a family `[s + ds*u, e + de*u)`
//! for `u` in `0..m`, is joined in O(1): one interval when consecutive members meet (then
//! the union is `[min s, max e)`: a convex maximum below a concave minimum at both ends of
//! the run stays below it between them), one strided run when they are single keys
//! `|ds| >= 2` apart, else its `m` members. A row then costs O(runs x intervals), and
//! `any i in 0 .. q + 1: k == i` one run per row.

use super::{Affine, AffineInterval, Eval, Flow, List, Piece, Solver};
use cm_ir::bind::PlanError;
use cm_ir::ir::Region;
use cm_syntax::{Code, Span};

/// Most terms of `any` / `all` one solver evaluates (a solver plans one batch index of a
/// plan, one sample of a packed plan, one block of rows of a mask with `elementwise`):
/// a term is one evaluation of a quantifier's body on a piece (about 0.1 us for a short
/// body), a run of the variable solved at once counting as one, each member of a run that
/// does not join as one more. The solver enforces it (`CM0404`) so that no mask plans for
/// minutes.
pub const MAX_QUANT_EVALS: u64 = 1 << 25;

impl Solver<'_, '_> {
    /// This solver stopping past `limit` terms of `any` / `all` instead of
    /// [`MAX_QUANT_EVALS`] (tests of the limit that cannot wait for 2^25 terms).
    pub fn with_quant_limit(mut self, limit: u64) -> Self {
        self.quant_limit = limit;
        self
    }

    /// Counts `terms` evaluations of a quantifier's body (the one at `span`) against the
    /// solver's limit ([`MAX_QUANT_EVALS`] unless set), before they are made.
    pub(super) fn count_quant_evals(&self, terms: i64, span: Span) -> Result<(), PlanError> {
        let total = self.quant_evals.get().saturating_add(terms.max(0) as u64);
        let limit = self.quant_limit;
        if total > limit {
            return Err(PlanError::new(
                Code::TooLargeToPlan,
                Some(span),
                format!(
                    "`any` / `all` would evaluate more than {limit} terms (each term once per piece of rows it is solved on)"
                ),
            )
            .with_hint(
                "a range that reads `q` makes every row a piece of its own: keep `q` out of the range (`any i in 0 .. n: q in s[i] .. e[i] & ...`), or write the union as one region (`any i in 0 .. q + 1: k == i` is `k <= q`)",
            ));
        }
        self.quant_evals.set(total);
        Ok(())
    }

    /// `any i in range: body` (`all` for `all`) on the one row of `p` (`p.n == 1`), within
    /// `hull`, in runs of `i` (the module docs). The caller restores the variables.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quant_in_runs(
        &self,
        p: &Piece,
        all: bool,
        depth: usize,
        range: std::ops::Range<i64>,
        body: &Region,
        hull: Option<(i64, i64)>,
        span: Span,
    ) -> Eval<List> {
        let saved = self.var_mode.get();
        let mut vars = self.vars.get();
        let q = match saved {
            // Inside the runs of an enclosing variable: its value on this one-value piece.
            Some((outer, q)) => {
                vars[outer] = p.q0;
                q
            }
            None => p.q0,
        };
        self.vars.set(vars);
        self.var_mode.set(Some((depth, q)));
        let found = self.runs_of(p, all, range, body, hull, span);
        self.var_mode.set(saved);
        // Change points of the variable's runs are not the caller's.
        self.clear_split_hints();
        let mut found = found?;
        // Strided runs joined one by one, so they stay runs where they meet nothing else.
        let mut strided = Vec::new();
        found.retain(|iv| {
            iv.stride == 1 || {
                strided.push(*iv);
                false
            }
        });
        let mut union = if found.len() <= 1 {
            found
        } else {
            self.union_all(p, found)?
        };
        for run in strided {
            union = self.union(p, union, vec![run])?;
        }
        if all {
            self.complement(p, &union)
        } else {
            Ok(union)
        }
    }

    /// The intervals (not yet merged) of `body` over the values of `range` (for `all`, of
    /// its complement: `all` is the complement of the union of the complements), run by run:
    /// a run is tried as long as the last one that had to be cut, doubled, so a body that
    /// changes at every value costs about 1.5 evaluations a value, one that never does a
    /// single one.
    fn runs_of(
        &self,
        p: &Piece,
        all: bool,
        range: std::ops::Range<i64>,
        body: &Region,
        hull: Option<(i64, i64)>,
        span: Span,
    ) -> Eval<List> {
        let mut found = Vec::new();
        let mut i0 = range.start;
        let mut want = range.end - range.start;
        while i0 < range.end {
            let run = Piece {
                q0: i0,
                n: want.min(range.end - i0),
                b: p.b,
                h: p.h,
            };
            self.count_quant_evals(1, span)?;
            self.clear_split_hints();
            let keys = self.region(&run, body, hull);
            match keys.and_then(|l| {
                if all {
                    self.complement(&run, &l)
                } else {
                    Ok(l)
                }
            }) {
                Ok(list) => {
                    self.join_family(&run, &list, &mut found, span)?;
                    i0 += run.n;
                    want = want.saturating_mul(2);
                }
                Err(Flow::Split(s)) => {
                    debug_assert!(s > i0 && s < i0 + run.n, "split {s} outside the run");
                    want = s - i0;
                }
                // As the driver does with rows: an evaluation over a run may fail at values
                // where the body alone does not.
                Err(Flow::Error(_)) if run.n > 1 => want = run.n / 2,
                Err(e) => return Err(e),
            }
        }
        Ok(found)
    }

    /// Appends to `found` the union over the run's values of each interval of `list`
    /// (canonical at every value of the run): one interval, one strided run, or its members.
    fn join_family(
        &self,
        run: &Piece,
        list: &[AffineInterval],
        found: &mut List,
        span: Span,
    ) -> Result<(), PlanError> {
        let n = run.n;
        let fixed = |a: i64| Affine::constant(a);
        let member = |iv: &AffineInterval, u: i64| AffineInterval {
            start: fixed(iv.start.at(u)),
            end: fixed(iv.end.at(u)),
            stride: iv.stride,
        };
        for iv in list {
            let (s, e) = (iv.start, iv.end);
            if n == 1 {
                found.push(member(iv, 0));
                continue;
            }
            let meet = |u: i64| s.at(u).max(s.at(u + 1)) <= e.at(u).min(e.at(u + 1));
            if iv.stride == 1 && meet(0) && meet(n - 2) {
                found.push(AffineInterval::unit(
                    fixed(s.at(0).min(s.at(n - 1))),
                    fixed(e.at(0).max(e.at(n - 1))),
                ));
            } else if iv.stride == 1 && s.step == e.step && e.first - s.first == 1 {
                // Single keys |ds| >= 2 apart (consecutive ones would meet).
                let (a, z) = (s.at(0).min(s.at(n - 1)), s.at(0).max(s.at(n - 1)));
                found.push(AffineInterval {
                    start: fixed(a),
                    end: fixed(z + 1),
                    stride: s.step.abs(),
                });
            } else {
                self.count_quant_evals(n, span)?;
                found.extend((0..n).map(|u| member(iv, u)));
            }
        }
        Ok(())
    }
}
