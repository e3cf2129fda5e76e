//! Normalisation to solvable atoms: every comparison that involves `k` (outside
//! `elementwise`) becomes one of the atoms of [`Region`] that the planner solves for `k`
//! given `q`: `alpha * k + rest op 0` ([`Region::KCmp`]), `floor((alpha * k + rest) / d) op
//! rhs` ([`Region::KDiv`]), `(±k + rest) mod d (== | !=) rhs` ([`Region::KMod`]) and grid
//! distance balls ([`Region::Ball`]). Anything else with `k` is `CM0207`.

use super::{Checker, Ctx, Def, Val, R};
use crate::ir::*;
use cm_syntax::ast::{CmpOp, Expr, ExprKind};
use cm_syntax::{Code, Diagnostic, Span};

/// `a op b`, spanning both.
pub(super) fn bin(op: IntOp, a: Int, b: Int) -> Int {
    let span = a.span.to(b.span);
    Int::new(IntKind::Bin(op, Box::new(a), Box::new(b)), span)
}

/// The value of an integer expression made of literals only (`-3`, `2 * 3`), if it is one.
fn const_value(e: &Int) -> Option<i64> {
    match &e.kind {
        IntKind::Const(v) => Some(*v),
        IntKind::Neg(a) => const_value(a)?.checked_neg(),
        IntKind::Bin(IntOp::Add, a, b) => const_value(a)?.checked_add(const_value(b)?),
        IntKind::Bin(IntOp::Sub, a, b) => const_value(a)?.checked_sub(const_value(b)?),
        IntKind::Bin(IntOp::Mul, a, b) => const_value(a)?.checked_mul(const_value(b)?),
        _ => None,
    }
}

/// Splits `e` into `alpha * k + rest` when it is linear in `k` with a constant coefficient.
fn linearize(e: &Int) -> Option<(i64, Int)> {
    if !e.has_k() {
        return Some((0, e.clone()));
    }
    match &e.kind {
        IntKind::K => Some((1, Int::constant(0, e.span))),
        IntKind::Neg(a) => {
            let (al, r) = linearize(a)?;
            Some((
                al.checked_neg()?,
                Int::new(IntKind::Neg(Box::new(r)), e.span),
            ))
        }
        IntKind::Bin(op @ (IntOp::Add | IntOp::Sub), a, b) => {
            let (aa, ra) = linearize(a)?;
            let (ab, rb) = linearize(b)?;
            let alpha = if *op == IntOp::Add {
                aa.checked_add(ab)?
            } else {
                aa.checked_sub(ab)?
            };
            Some((alpha, bin(*op, ra, rb)))
        }
        IntKind::Bin(IntOp::Mul, a, b) => {
            let (lin, factor) = match (const_value(a), const_value(b)) {
                (_, Some(c)) => (a, c),
                (Some(c), _) => (b, c),
                _ => return None,
            };
            let (al, r) = linearize(lin)?;
            Some((
                al.checked_mul(factor)?,
                bin(IntOp::Mul, r, Int::constant(factor, e.span)),
            ))
        }
        _ => None,
    }
}

impl Checker<'_> {
    /// `a < b <= c`: each link compared on its own, joined with `&`.
    pub(super) fn compare_chain(
        &mut self,
        first: &Expr,
        rest: &[(CmpOp, Expr)],
        span: Span,
        ctx: Ctx,
    ) -> R<Val> {
        let mut prev = self.lower(first, ctx)?;
        let mut acc: Option<Val> = None;
        for (op, rhs) in rest {
            let r = self.lower(rhs, ctx)?;
            let keep = match &r {
                Val::Int(i) => Val::Int(i.clone()),
                _ => Val::Int(Int::constant(0, r.span())),
            };
            let cmp = self.compare(*op, prev, r, ctx)?;
            acc = Some(match acc {
                None => cmp,
                Some(a) => self.and_or(true, a, cmp, span)?,
            });
            prev = keep;
        }
        acc.ok_or(())
    }

    /// `x in r`: `r.start <= x & x < r.end`, or grid membership for a grid `r`.
    pub(super) fn membership(&mut self, elem: &Expr, range: &Expr, span: Span, ctx: Ctx) -> R<Val> {
        let x = self.expect_int(elem, ctx)?;
        if let ExprKind::Name(n) = &range.kind {
            if let Some((Def::Grid(g), _)) = self.names.get(n) {
                let g = *g;
                if x.has_k() && ctx != Ctx::Elementwise {
                    let lo = Int::new(
                        IntKind::RangeLo(Box::new(self.grid_range(g, range.span))),
                        range.span,
                    );
                    let hi = Int::new(
                        IntKind::RangeHi(Box::new(self.grid_range(g, range.span))),
                        range.span,
                    );
                    let a = self.compare(CmpOp::Ge, Val::Int(x.clone()), Val::Int(lo), ctx)?;
                    let b = self.compare(CmpOp::Lt, Val::Int(x), Val::Int(hi), ctx)?;
                    return self.and_or(true, a, b, span);
                }
                return Ok(Val::Bool(Bool::InGrid(g, x), span));
            }
        }
        let r = self.expect_range(range, ctx)?;
        let lo = Int::new(IntKind::RangeLo(Box::new(r.clone())), r.span);
        let hi = Int::new(IntKind::RangeHi(Box::new(r)), range.span);
        let a = self.compare(CmpOp::Ge, Val::Int(x.clone()), Val::Int(lo), ctx)?;
        let b = self.compare(CmpOp::Lt, Val::Int(x), Val::Int(hi), ctx)?;
        self.and_or(true, a, b, span)
    }

    /// `a op b`: a q-side comparison, or, with `k` on one side, the atom it normalises to;
    /// `CM0207` for a comparison with `k` of no solvable form.
    fn compare(&mut self, op: CmpOp, a: Val, b: Val, ctx: Ctx) -> R<Val> {
        let span = a.span().to(b.span());
        let (a, b, op) = match (a, b) {
            (Val::Dist(g, m, s), Val::Int(r)) => return self.ball(g, m, op, r, s.to(span), ctx),
            (Val::Int(r), Val::Dist(g, m, s)) => {
                return self.ball(g, m, op.flip(), r, s.to(span), ctx)
            }
            (Val::Int(a), Val::Int(b)) => (a, b, op),
            (x, y) => {
                let bad = if matches!(x, Val::Int(_)) { y } else { x };
                self.type_err(&bad, "an integer to compare");
                return Err(());
            }
        };
        if !a.has_k() && !b.has_k() || ctx == Ctx::Elementwise {
            return Ok(Val::Bool(Bool::Cmp(op, a, b), span));
        }
        let diff = bin(IntOp::Sub, a.clone(), b.clone());
        if let Some((alpha, rest)) = linearize(&diff) {
            if alpha == 0 {
                return Ok(Val::Bool(Bool::Cmp(op, rest, Int::constant(0, span)), span));
            }
            return Ok(Val::Region(
                Region::KCmp {
                    alpha,
                    rest,
                    op,
                    span,
                },
                span,
            ));
        }
        let (side, other, op) = if a.has_k() && !b.has_k() {
            (a, b, op)
        } else if b.has_k() && !a.has_k() {
            (b, a, op.flip())
        } else {
            self.not_solvable(span);
            return Err(());
        };
        if let IntKind::Bin(kop @ (IntOp::Div | IntOp::Mod), x, d) = &side.kind {
            if let (Some((alpha, rest)), false) = (linearize(x), d.has_k()) {
                if alpha != 0 && *kop == IntOp::Div {
                    return Ok(Val::Region(
                        Region::KDiv {
                            alpha,
                            rest,
                            div: (**d).clone(),
                            op,
                            rhs: other,
                            span,
                        },
                        span,
                    ));
                }
                if (alpha == 1 || alpha == -1) && matches!(op, CmpOp::Eq | CmpOp::Ne) {
                    return Ok(Val::Region(
                        Region::KMod {
                            alpha,
                            rest,
                            div: (**d).clone(),
                            equal: op == CmpOp::Eq,
                            rhs: other,
                            span,
                        },
                        span,
                    ));
                }
            }
        }
        self.not_solvable(span);
        Err(())
    }

    fn not_solvable(&mut self, span: Span) {
        self.err(
            Diagnostic::error(Code::UnsolvableComparison, span, "this comparison cannot be solved for `k` analytically")
                .with_hint("solvable forms: `a*k + f(q) < g(q)` (any of < <= > >= == !=), `(a*k + f(q)) / d < g(q)`, `(±k + f(q)) % d == g(q)`; wrap anything else in `elementwise(...)` to evaluate it pair by pair"),
        );
    }

    /// `dist(g) op r`, a grid distance ball: `op` must be `<` or `<=` (`CM0211`) and `r`
    /// q-side.
    fn ball(
        &mut self,
        g: GridId,
        metric: Metric,
        op: CmpOp,
        r: Int,
        span: Span,
        ctx: Ctx,
    ) -> R<Val> {
        let r = self.no_k(r, ctx)?;
        let strict = match op {
            CmpOp::Lt => true,
            CmpOp::Le => false,
            _ => {
                self.err(
                    Diagnostic::error(
                        Code::BadDistanceComparison,
                        span,
                        format!(
                            "a grid distance can only be compared with `<` or `<=`, found `{}`",
                            op.symbol()
                        ),
                    )
                    .with_hint(
                        "write `l2(img) < r`; for the outside of a ball use `!(l2(img) < r)`",
                    ),
                );
                return Err(());
            }
        };
        if ctx == Ctx::Elementwise {
            self.err(
                Diagnostic::error(
                    Code::UnsolvableK,
                    span,
                    "grid distances cannot be used inside `elementwise`",
                )
                .with_hint("write the coordinates out with `img.y(k)` and `img.x(k)`"),
            );
            return Err(());
        }
        Ok(Val::Region(
            Region::Ball {
                grid: g,
                metric,
                strict,
                radius: r,
                span,
            },
            span,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{error, program, rows};
    use crate::ir::Region;

    /// Every solvable form keeps its meaning: the normalised atom sees, row by row, the keys
    /// that `elementwise` (which evaluates the comparison as written, pair by pair) sees.
    #[test]
    fn atoms_mean_what_the_comparison_says() {
        let cases = [
            ("k <= q", "KCmp"),
            ("2 * k - q < 3", "KCmp"),
            ("q - 3 < k", "KCmp"),
            ("(k - q) * 3 >= -6", "KCmp"),
            ("-k + q > 0", "KCmp"),
            ("k != q - 1", "KCmp"),
            ("k == 5", "KCmp"),
            ("(k + 1) / 3 == q / 3", "KDiv"),
            ("(2 * k - q) / 4 < 1", "KDiv"),
            ("q / 2 >= (k - 1) / 5", "KDiv"),
            ("(q - k) % 4 == 1", "KMod"),
            ("(k + q) % 3 != 0", "KMod"),
        ];
        for (cmp, kind) in cases {
            let src = format!("mask = {cmp};");
            let got = format!("{:?}", program(&src).mask);
            assert!(got.starts_with(kind), "{cmp}: {got}");
            for (q_len, kv_len) in [(24, 20), (7, 31)] {
                assert_eq!(
                    rows(&src, q_len, kv_len),
                    rows(&format!("mask = elementwise({cmp});"), q_len, kv_len),
                    "{cmp} at {q_len} x {kv_len}"
                );
            }
        }
    }

    #[test]
    fn chains_and_membership_are_conjunctions_of_atoms() {
        for (src, reference) in [
            (
                "mask = q - 3 < k <= q;",
                "mask = elementwise(q - 3 < k & k <= q);",
            ),
            (
                "mask = k in q - 2 .. q + 1;",
                "mask = elementwise(q - 2 <= k & k < q + 1);",
            ),
            (
                "mask = k in 0 ..= q / 2;",
                "mask = elementwise(k <= q / 2);",
            ),
            (
                "grid g = [2, 3] at 2;\nmask = k in g;",
                "mask = elementwise(2 <= k & k < 8);",
            ),
        ] {
            assert_eq!(rows(src, 12, 12), rows(reference, 12, 12), "{src}");
        }
        // The query's membership of a grid is a row predicate.
        let p = program("grid g = [2, 3] at 2;\nmask = q in g;");
        assert!(matches!(
            p.mask,
            Region::Rows(crate::ir::Bool::InGrid(0, _))
        ));
    }

    /// A comparison in which `k` cancels is a row predicate, not an atom.
    #[test]
    fn cancelled_k_is_a_row_predicate() {
        let p = program("mask = k - k + q < 3;");
        assert!(matches!(p.mask, Region::Rows(_)), "{:?}", p.mask);
        assert_eq!(
            rows("mask = k - k + q < 3;", 5, 4),
            [vec![(0, 4)], vec![(0, 4)], vec![(0, 4)], vec![], vec![]]
        );
    }

    #[test]
    fn unsolvable_forms_are_errors() {
        for (cmp, want) in [
            ("k * k < q", "CM0207"),
            ("(2 * k) % 3 == 0", "CM0207"),
            ("k % 3 < 1", "CM0207"),
            ("k / k == 1", "CM0207"),
            ("k < k * q", "CM0207"),
            // `abs` takes a q-side integer: `k` inside it cannot be solved at all.
            ("abs(k - q) < 2", "CM0206"),
        ] {
            assert_eq!(error(&format!("mask = {cmp};")).0, want, "{cmp}");
        }
    }

    #[test]
    fn grid_distances_are_balls_compared_with_lt_or_le() {
        let ball = |src: &str| match program(src).mask {
            Region::Ball { metric, strict, .. } => (metric, strict),
            other => panic!("{src}: {other:?}"),
        };
        use crate::ir::Metric::{Linf, L1, L2};
        assert_eq!(ball("grid g = [3, 3];\nmask = l2(g) < 2;"), (L2, true));
        assert_eq!(ball("grid g = [3, 3];\nmask = 2 >= l1(g);"), (L1, false));
        assert_eq!(ball("grid g = [3, 3];\nmask = 1 > linf(g);"), (Linf, true));
        for op in ["==", "!=", ">", ">="] {
            let (code, message) = error(&format!("grid g = [3, 3];\nmask = l2(g) {op} 1;"));
            assert_eq!(code, "CM0211", "{op}");
            assert!(message.contains(&format!("`{op}`")), "{message}");
        }
        assert_eq!(
            error("grid g = [3, 3];\nmask = l2(g) < k;").0,
            "CM0206",
            "a radius that depends on k"
        );
    }
}
