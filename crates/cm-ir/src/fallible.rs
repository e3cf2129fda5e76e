//! Which predicates cannot fail: a conservative interval analysis of an expression over
//! every pair of a bound program's shape.
//!
//! An `elementwise` predicate that cannot fail at any pair has no errors to keep in the
//! reference's order, so the planner may evaluate it at fewer keys than the reference does
//! (only where the regions around it leave the answer open) without changing any result.
//! "Cannot fail" is decided from the values each subexpression can take: `q` in `[0,
//! q_len)`, `k` in `[0, kv_len)`, `b` in `[0, batch)`, `h` in `[0, num_heads)`, parameters
//! and lengths as bound. An operation is accepted when no value in its operands' ranges
//! makes it fail (overflow out of 64 bits, a zero divisor, `i64::MIN / -1`, `isqrt` of a
//! negative value); lookups whose failure depends on positions (arrays, segmentations,
//! grid coordinates, ranges) and quantifier variables are not analysed and count as able
//! to fail. The answer is therefore `true` only when no pair can fail, and may be `false`
//! for predicates that in fact never do.

use crate::bind::{isqrt, Bound, Value};
use crate::ir::{Bool, Int, IntKind, IntOp};
use cm_syntax::Span;

/// An inclusive range of values, each within `i64`.
type Range = (i128, i128);

impl Bound<'_> {
    /// Whether evaluating `c` fails at no `(q, k, b, h)` of this shape (`q < q_len`, `k <
    /// kv_len`, `b < batch`, `h < num_heads`). Conservative: `false` when unsure (see the
    /// module docs).
    pub fn never_fails(&self, c: &Bool) -> bool {
        crate::deep(|| match c {
            Bool::Const(_) => true,
            Bool::Cmp(_, a, b) => self.range(a).is_some() && self.range(b).is_some(),
            Bool::And(a, b) | Bool::Or(a, b) => self.never_fails(a) && self.never_fails(b),
            Bool::Not(a) => self.never_fails(a),
            // A position outside the grid is simply not in it.
            Bool::InGrid(_, p) => self.range(p).is_some(),
        })
    }

    /// The values `e` can take over the shape's pairs, or `None` when its evaluation may
    /// fail there (or is not analysed).
    fn range(&self, e: &Int) -> Option<Range> {
        crate::deep(|| self.range_at(e))
    }

    fn range_at(&self, e: &Int) -> Option<Range> {
        let sh = &self.shape;
        let upto = |n: i64| (0, i128::from(n) - 1);
        let r = match &e.kind {
            IntKind::Const(v) => point(*v),
            IntKind::Q => upto(sh.q_len),
            IntKind::K => upto(sh.kv_len),
            IntKind::B => upto(sh.batch),
            IntKind::H => upto(sh.num_heads),
            IntKind::QLen => point(sh.q_len),
            IntKind::KvLen => point(sh.kv_len),
            IntKind::Batch => point(sh.batch),
            IntKind::NumHeads => point(sh.num_heads),
            IntKind::Param(id) => match &self.params[*id] {
                Value::Int(v) => point(*v),
                Value::Array(_) => return None,
            },
            IntKind::SegCount(s) => point(self.segs[*s].count() as i64),
            IntKind::Neg(a) => {
                let (lo, hi) = self.range(a)?;
                (-hi, -lo)
            }
            IntKind::Abs(a) => {
                let (lo, hi) = self.range(a)?;
                if lo >= 0 {
                    (lo, hi)
                } else if hi <= 0 {
                    (-hi, -lo)
                } else {
                    (0, hi.max(-lo))
                }
            }
            IntKind::Isqrt(a) => {
                let (lo, hi) = self.range(a)?;
                if lo < 0 {
                    return None;
                }
                let root = |v: i128| isqrt(v as i64, Span::default()).ok().map(i128::from);
                (root(lo)?, root(hi)?)
            }
            IntKind::Bin(op, a, b) => binary(*op, self.range(a)?, self.range(b)?)?,
            IntKind::If(c, a, b) => {
                if !self.never_fails(c) {
                    return None;
                }
                let ((a0, a1), (b0, b1)) = (self.range(a)?, self.range(b)?);
                (a0.min(b0), a1.max(b1))
            }
            IntKind::SegLen
            | IntKind::ArrIndex(..)
            | IntKind::ArrLen(_)
            | IntKind::ArrSum(_)
            | IntKind::RangeLo(_)
            | IntKind::RangeHi(_)
            | IntKind::SegIndex(..)
            | IntKind::GridCoord(..)
            | IntKind::Var(_) => return None,
        };
        fits(r)
    }
}

fn point(v: i64) -> Range {
    (i128::from(v), i128::from(v))
}

/// `r` when both ends lie in `i64` (so every value in it does: evaluation cannot overflow).
fn fits(r: Range) -> Option<Range> {
    let ok = |v: i128| i64::try_from(v).is_ok();
    (r.0 <= r.1 && ok(r.0) && ok(r.1)).then_some(r)
}

/// The values of `a op b` for operands in `a` and `b`, or `None` when some pair of them
/// makes the operation fail (as `cm_ir::bind::apply` does). Every end lies in `i64`, so
/// products of ends fit in `i128`.
fn binary(op: IntOp, (a0, a1): Range, (b0, b1): Range) -> Option<Range> {
    Some(match op {
        IntOp::Add => (a0 + b0, a1 + b1),
        IntOp::Sub => (a0 - b1, a1 - b0),
        IntOp::Mul => {
            let c = [a0 * b0, a0 * b1, a1 * b0, a1 * b1];
            (*c.iter().min()?, *c.iter().max()?)
        }
        IntOp::Div => {
            // A divisor range holding 0 may divide by zero; i64::MIN / -1 overflows.
            if (b0 <= 0 && b1 >= 0) || (a0 == i128::from(i64::MIN) && b0 <= -1 && b1 >= -1) {
                return None;
            }
            // |floor(x / d)| <= |x| for |d| >= 1.
            let m = a0.abs().max(a1.abs());
            (-m, m)
        }
        IntOp::Mod => {
            if b0 <= 0 && b1 >= 0 {
                return None;
            }
            // The result has the sign of the divisor and a smaller magnitude.
            if b0 > 0 {
                (0, b1 - 1)
            } else {
                (b0 + 1, 0)
            }
        }
        IntOp::Min => (a0.min(b0), a1.min(b1)),
        IntOp::Max => (a0.max(b0), a1.max(b1)),
    })
}
