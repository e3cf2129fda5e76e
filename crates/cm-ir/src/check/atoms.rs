//! Normalisation to solvable atoms: every comparison that involves `k` (outside
//! `elementwise`) becomes one of the atoms of [`Region`] that the planner solves for `k`
//! given `q`: `alpha * k + rest op 0` ([`Region::KCmp`]), `floor((alpha * k + rest) / d) op
//! rhs` ([`Region::KDiv`]), `(±k + rest) mod d (== | !=) rhs` ([`Region::KMod`]) and grid
//! distance balls ([`Region::Ball`]). Anything else with `k` is `CM0207`.

use super::{Checker, Ctx, Def, Structure, Val, R};
use crate::ir::*;
use cm_syntax::ast::{CmpOp, Expr, ExprKind};
use cm_syntax::{Code, Diagnostic, Span};

/// Whether `t` is a term with `k` that is not linear: `x / d`, `x % d` or `abs(x)`.
fn is_hole(t: &Int) -> bool {
    t.has_k()
        && match &t.kind {
            IntKind::Bin(IntOp::Div | IntOp::Mod, _, d) => !d.has_k(),
            IntKind::Abs(_) => true,
            _ => false,
        }
}

/// `(alpha * k + rest) % d == v` for literals `alpha` and `d != 0`, as a `%` atom of `k`
/// alone: with `m = |d|` (negating everything for `d < 0`, as `x % d == -((-x) % -d)`) and
/// `g = gcd(alpha, m)`, it holds exactly when `v` is a residue (`0 <= v < m`), `g` divides
/// `v - rest`, and `k % (m / g) == (v - rest) / g * inv` with `inv` the inverse of `alpha /
/// g` modulo `m / g`. `None` when a value does not fit in 64 bits.
fn congruence(alpha: i64, rest: Int, d: i64, v: Int, span: Span) -> Option<Region> {
    let c = |x: i64| Int::constant(x, span);
    let negate = |x: Int| Int::new(IntKind::Neg(Box::new(x)), span);
    let (alpha, rest, v, m) = if d < 0 {
        (
            alpha.checked_neg()?,
            negate(rest),
            negate(v),
            d.checked_neg()?,
        )
    } else {
        (alpha, rest, v, d)
    };
    let (g, inv) = gcd_inverse(alpha.rem_euclid(m), m);
    let period = m / g;
    // The residue times `inv` must not overflow.
    if period > 1 << 31 {
        return None;
    }
    let gap = bin(IntOp::Sub, v.clone(), rest);
    let reachable = Bool::And(
        Box::new(Bool::Cmp(CmpOp::Ge, v.clone(), c(0))),
        Box::new(Bool::Cmp(CmpOp::Lt, v, c(m))),
    );
    let divides = Bool::Cmp(CmpOp::Eq, bin(IntOp::Mod, gap.clone(), c(g)), c(0));
    // The residue, reduced first so the product stays small.
    let target = bin(
        IntOp::Mod,
        bin(
            IntOp::Mul,
            bin(IntOp::Mod, bin(IntOp::Div, gap, c(g)), c(period)),
            c(inv),
        ),
        c(period),
    );
    let atom = Region::KMod {
        alpha: 1,
        rest: c(0),
        div: c(period),
        op: CmpOp::Eq,
        rhs: target,
        span,
    };
    Some(Region::Inter(
        Box::new(Region::Rows(Bool::And(
            Box::new(reachable),
            Box::new(divides),
        ))),
        Box::new(atom),
    ))
}

/// `(gcd(a, m), inv)` for `0 <= a < m`, with `inv * (a / g) == 1 (mod m / g)`.
fn gcd_inverse(a: i64, m: i64) -> (i64, i64) {
    // Extended Euclid on (a, m): r = s * a (mod m) at every step.
    let (mut r0, mut r1) = (i128::from(m), i128::from(a));
    let (mut s0, mut s1) = (0i128, 1i128);
    while r1 != 0 {
        let q = r0 / r1;
        (r0, r1) = (r1, r0 - q * r1);
        (s0, s1) = (s1, s0 - q * s1);
    }
    let g = r0 as i64;
    let period = i128::from(m / g);
    (g, s0.rem_euclid(period) as i64)
}

/// `alpha * k + rest  op  0` for a q-side coefficient `alpha` that is not a literal (a
/// parameter, say): by its sign, `k` compared with a floor division of `-rest` by `|alpha|`
/// (`g*k + r < 0` is `k <= (-r - 1) / g` for `g > 0`), and for `alpha == 0` the row
/// predicate `rest op 0`.
fn scaled_kcmp(alpha: Int, rest: Int, op: CmpOp, span: Span) -> Region {
    let zero = || Int::constant(0, span);
    let one = || Int::constant(1, span);
    let negate = |x: Int| Int::new(IntKind::Neg(Box::new(x)), span);
    // For g > 0 and the numerator n = -r: k against floor(n / g) or floor((n - 1) / g).
    let solved = |g: Int, n: Int, op: CmpOp| -> Region {
        let at = bin(IntOp::Div, n.clone(), g.clone());
        let below = bin(IntOp::Div, bin(IntOp::Sub, n.clone(), one()), g.clone());
        let k_vs = |op: CmpOp, bound: Int| Region::KCmp {
            alpha: 1,
            rest: negate(bound),
            op,
            span,
        };
        match op {
            CmpOp::Lt => k_vs(CmpOp::Le, below),
            CmpOp::Le => k_vs(CmpOp::Le, at),
            CmpOp::Gt => k_vs(CmpOp::Gt, at),
            CmpOp::Ge => k_vs(CmpOp::Gt, below),
            CmpOp::Eq | CmpOp::Ne => {
                let divides = Bool::Cmp(op, bin(IntOp::Mod, n, g), zero());
                let eq = k_vs(op, at);
                if op == CmpOp::Eq {
                    Region::Inter(Box::new(Region::Rows(divides)), Box::new(eq))
                } else {
                    Region::Union(Box::new(Region::Rows(divides)), Box::new(eq))
                }
            }
        }
    };
    let positive = solved(alpha.clone(), negate(rest.clone()), op);
    let negative = solved(negate(alpha.clone()), rest.clone(), op.flip());
    Region::Cond(
        Bool::Cmp(CmpOp::Gt, alpha.clone(), zero()),
        Box::new(positive),
        Box::new(Region::Cond(
            Bool::Cmp(CmpOp::Lt, alpha, zero()),
            Box::new(negative),
            Box::new(Region::Rows(Bool::Cmp(op, rest, zero()))),
        )),
    )
}

/// `a op b`, spanning both.
pub(super) fn bin(op: IntOp, a: Int, b: Int) -> Int {
    let span = a.span.to(b.span);
    Int::new(IntKind::Bin(op, Box::new(a), Box::new(b)), span)
}

/// The value of an integer expression made of literals only (`-3`, `2 * 3`), if it is one.
pub(super) fn const_value(e: &Int) -> Option<i64> {
    match &e.kind {
        IntKind::Const(v) => Some(*v),
        IntKind::Neg(a) => const_value(a)?.checked_neg(),
        IntKind::Bin(IntOp::Add, a, b) => const_value(a)?.checked_add(const_value(b)?),
        IntKind::Bin(IntOp::Sub, a, b) => const_value(a)?.checked_sub(const_value(b)?),
        IntKind::Bin(IntOp::Mul, a, b) => const_value(a)?.checked_mul(const_value(b)?),
        _ => None,
    }
}

/// Splits `e` into `alpha * k + rest + sum(c * T)`: `alpha`, the coefficient of `k`, is an
/// integer expression (a literal sum for `2 * k - k`, a parameter for `a * k`); `rest` is
/// q-side; each `T`, pushed on `holes` with its constant coefficient `c`, is a term with `k`
/// that is not linear (`x / d`, `x % d`, `abs(x)`), and counts 0 in `rest`. `None` when `e`
/// is none of these (`k * k`, `min(k, q)`).
fn terms(e: &Int, coeff: i64, holes: &mut Vec<(i64, Int)>) -> Option<(Int, Int)> {
    if !e.has_k() {
        return Some((Int::constant(0, e.span), e.clone()));
    }
    match &e.kind {
        IntKind::K => Some((Int::constant(1, e.span), Int::constant(0, e.span))),
        IntKind::Neg(a) => {
            let (al, r) = terms(a, coeff.checked_neg()?, holes)?;
            Some((neg(al), Int::new(IntKind::Neg(Box::new(r)), e.span)))
        }
        IntKind::Bin(op @ (IntOp::Add | IntOp::Sub), a, b) => {
            let (aa, ra) = terms(a, coeff, holes)?;
            let cb = if *op == IntOp::Sub {
                coeff.checked_neg()?
            } else {
                coeff
            };
            let (ab, rb) = terms(b, cb, holes)?;
            Some((fold(bin(*op, aa, ab)), bin(*op, ra, rb)))
        }
        IntKind::Bin(IntOp::Mul, a, b) => {
            let (lin, factor) = match (a.has_k(), b.has_k()) {
                (true, false) => (a, b),
                (false, true) => (b, a),
                _ => return None,
            };
            let before = holes.len();
            let c = const_value(factor);
            let (al, r) = terms(
                lin,
                c.and_then(|c| coeff.checked_mul(c)).unwrap_or(0),
                holes,
            )?;
            // A term such as `k / 2` may only be scaled by a constant.
            if c.is_none() && holes.len() > before {
                return None;
            }
            let factor = (**factor).clone();
            Some((
                fold(bin(IntOp::Mul, al, factor.clone())),
                bin(IntOp::Mul, r, factor),
            ))
        }
        _ if is_hole(e) => {
            if let Some(r) = cancelled(e) {
                return Some((Int::constant(0, e.span), r));
            }
            holes.push((coeff, e.clone()));
            Some((Int::constant(0, e.span), Int::constant(0, e.span)))
        }
        _ => None,
    }
}

/// The term `t` (`x / d`, `x % d` or `abs(x)`) as a q-side value when `k` cancels in `x`
/// (`(k - k + q) / 2` is `q / 2`; a case of `(abs(k - q) - k) / 2` is that): `x` without its
/// terms of `k`, which add up to 0.
fn cancelled(t: &Int) -> Option<Int> {
    let q_side = |x: &Int| match linearize(x) {
        Some((0, rest)) => Some(Box::new(rest)),
        _ => None,
    };
    let kind = match &t.kind {
        IntKind::Bin(op @ (IntOp::Div | IntOp::Mod), x, d) => {
            IntKind::Bin(*op, q_side(x)?, d.clone())
        }
        IntKind::Abs(x) => IntKind::Abs(q_side(x)?),
        _ => return None,
    };
    Some(Int::new(kind, t.span))
}

fn neg(e: Int) -> Int {
    let span = e.span;
    fold(Int::new(IntKind::Neg(Box::new(e)), span))
}

/// `e` as one literal when it is made of literals only, else `e`.
fn fold(e: Int) -> Int {
    match const_value(&e) {
        Some(v) => Int::constant(v, e.span),
        None => e,
    }
}

/// `alpha * k + rest` when `e` is linear in `k` with a constant coefficient.
fn linearize(e: &Int) -> Option<(i64, Int)> {
    let mut holes = Vec::new();
    let (alpha, rest) = terms(e, 1, &mut holes)?;
    if !holes.is_empty() {
        return None;
    }
    Some((const_value(&alpha)?, rest))
}

/// Whether the term `t` (`x / d`, `x % d` or `abs(x)`) compared by `op` is one of the
/// analytic atoms: a division of a linear `x`, a residue of `±k + f(q)` (or, for `==` /
/// `!=`, of any literal multiple of `k` modulo a literal), any `abs`. Otherwise the
/// comparison may still be a key-side one.
fn hole_ok(t: &Int, op: CmpOp) -> bool {
    match &t.kind {
        IntKind::Bin(IntOp::Div, x, _) => matches!(linearize(x), Some((a, _)) if a != 0),
        IntKind::Bin(IntOp::Mod, x, d) => match linearize(x) {
            Some((1 | -1, _)) => true,
            Some(_) => matches!(op, CmpOp::Eq | CmpOp::Ne) && const_value(d).is_some(),
            None => false,
        },
        IntKind::Abs(_) => true,
        _ => false,
    }
}

/// Splits `e` into `f + rest` where `f`, the sum of `e`'s additive terms that read `k`,
/// reads neither `q` nor a quantifier's variable (a function of the key alone: `arr[k]`,
/// `doc.index(k)`, `k * k`), and `rest` is q-side. `None` when a term reads both.
fn key_side(e: &Int) -> Option<(Int, Int)> {
    let zero = || Int::constant(0, e.span);
    if !e.has_k() {
        return Some((zero(), e.clone()));
    }
    match &e.kind {
        IntKind::Neg(a) => {
            let (f, r) = key_side(a)?;
            Some((neg(f), neg(r)))
        }
        IntKind::Bin(op @ (IntOp::Add | IntOp::Sub), a, b) => {
            let (fa, ra) = key_side(a)?;
            let (fb, rb) = key_side(b)?;
            Some((fold(bin(*op, fa, fb)), fold(bin(*op, ra, rb))))
        }
        _ if !e.reads_q() && !e.mentions(&|x| matches!(x, IntKind::Var(_))) => {
            Some((e.clone(), zero()))
        }
        _ => None,
    }
}

/// Whether `e` is linear in `k` with literal coefficients once split at its `abs`, `min` and
/// `max` terms: sums, negations and literal multiples of `k`, q-side values, and `abs`,
/// `min`, `max` of such terms.
fn piecewise_linear(e: &Int) -> bool {
    if !e.has_k() {
        return true;
    }
    match &e.kind {
        IntKind::K => true,
        IntKind::Neg(a) | IntKind::Abs(a) => piecewise_linear(a),
        IntKind::Bin(IntOp::Add | IntOp::Sub | IntOp::Min | IntOp::Max, a, b) => {
            piecewise_linear(a) && piecewise_linear(b)
        }
        IntKind::Bin(IntOp::Mul, a, b) => match (const_value(a), const_value(b)) {
            (Some(_), _) => piecewise_linear(b),
            (_, Some(_)) => piecewise_linear(a),
            _ => false,
        },
        _ => false,
    }
}

/// Why `e` (a comparison's `lhs - rhs`) is not solvable: the smallest term that reads `k`
/// together with `q` or a quantifier's variable, and what is wrong with it.
fn mixed_cause(e: &Int) -> Option<(Span, String)> {
    let var = |x: &IntKind| matches!(x, IntKind::Var(_));
    let mixed = |x: &Int| x.has_k() && (x.reads_q() || x.mentions(&var));
    if !mixed(e) {
        return None;
    }
    // An `abs`, `min` or `max` of terms linear in `k` splits into linear cases: what is at
    // fault is around it (`(abs(k - q) - k) % 3`, whose case `(q - 2 * k) % 3` no atom takes).
    if matches!(
        e.kind,
        IntKind::Abs(_) | IntKind::Bin(IntOp::Min | IntOp::Max, ..)
    ) && piecewise_linear(e)
    {
        return None;
    }
    let inner = match &e.kind {
        // A sum that reads both is fine if its terms are: look inside.
        IntKind::Neg(a) => return mixed_cause(a),
        IntKind::Bin(IntOp::Add | IntOp::Sub, a, b) => {
            return mixed_cause(a).or_else(|| mixed_cause(b))
        }
        IntKind::Abs(a) | IntKind::Isqrt(a) => mixed_cause(a),
        IntKind::Bin(_, a, b) => mixed_cause(a).or_else(|| mixed_cause(b)),
        IntKind::If(_, a, b) => mixed_cause(a).or_else(|| mixed_cause(b)),
        IntKind::ArrIndex(_, i) => mixed_cause(i),
        _ => None,
    };
    inner.or_else(|| {
        let with = if e.reads_q() {
            "`q`"
        } else {
            "the variable of an `any` / `all`"
        };
        Some((
            e.span,
            format!("this term reads `k` together with {with}, and is not linear in `k`"),
        ))
    })
}

/// Most cases one comparison with `k` is split into at its `abs`, `min` and `max` terms: the
/// cases of [`Checker::split_cases`] and the parts of `abs(x) < r` ([`Checker::abs_term`])
/// and of `min(x, y) < r` ([`Checker::chain_parts`]), counted over everything the comparison
/// as written becomes. Each `abs` at most doubles them and each `min` / `max` of n terms at
/// most multiplies them by n; past the limit the comparison is `CM0207`, naming the limit
/// and that count ([`case_bound`]).
pub const MAX_COMPARISON_CASES: u64 = 256;

/// The cases of the comparison being normalised (the outermost one, as written): how many
/// comparisons it has been split into so far, the leaves of its tree of cases and parts.
#[derive(Clone, Copy)]
pub(super) struct Cases {
    leaves: u64,
    /// Whether `leaves` passed [`MAX_COMPARISON_CASES`]: every comparison inside fails, and
    /// the outermost one reports the limit.
    over: bool,
}

/// The arguments of the `min` (or `max`, by `op`) chain `e`: `min(min(x, y), z)` (which is
/// how `min(x, y, z)` is written down) has `x`, `y` and `z`. A nested `min` without `k` is
/// one argument (a q-side value).
fn chain_args(e: &Int, op: IntOp) -> Vec<&Int> {
    match &e.kind {
        IntKind::Bin(o, a, b) if *o == op && e.has_k() => {
            let mut args = chain_args(a, op);
            args.extend(chain_args(b, op));
            args
        }
        _ => vec![e],
    }
}

/// The `abs`, `min` and `max` terms that read `k` in `e` (a `min` / `max` of several
/// arguments counting once), and the most cases they split a comparison into: 2 per `abs`,
/// n per `min` / `max` of n arguments, multiplied (saturating). Every term a comparison is
/// split at, or taken apart at, is one of them, each used once along every case: so the
/// cases of a comparison are at most the product of its sides' counts.
fn case_bound(e: &Int) -> (u32, u64) {
    if !e.has_k() {
        return (0, 1);
    }
    let of = |parts: &[&Int]| {
        parts.iter().fold((0u32, 1u64), |(n, c), p| {
            let (pn, pc) = case_bound(p);
            (n.saturating_add(pn), c.saturating_mul(pc))
        })
    };
    match &e.kind {
        IntKind::Abs(a) => {
            let (n, c) = case_bound(a);
            (n.saturating_add(1), c.saturating_mul(2))
        }
        IntKind::Bin(op @ (IntOp::Min | IntOp::Max), ..) => {
            let args = chain_args(e, *op);
            let (n, c) = of(&args);
            (n.saturating_add(1), c.saturating_mul(args.len() as u64))
        }
        IntKind::Neg(a) | IntKind::Isqrt(a) => case_bound(a),
        IntKind::Bin(_, a, b) | IntKind::If(_, a, b) => of(&[a, b]),
        IntKind::ArrIndex(_, a) | IntKind::SegIndex(_, a) | IntKind::GridCoord(_, _, a) => {
            case_bound(a)
        }
        _ => (0, 1),
    }
}

/// The first `abs(x)`, or `min` / `max` chain of arguments `x1, ..., xn`, inside `e`,
/// innermost first, that reads `k` and whose arguments are linear in `k` (no `/`, `%`,
/// `abs`, `min`, `max` of `k` in them): the term a comparison is split at. Searched through
/// arithmetic, `if` branches, indices and positions. Splitting replaces it by one of its
/// arguments (or `-x`), so the term around it may be next: any nesting of them is split.
fn split_point(e: &Int) -> Option<&Int> {
    if !e.has_k() {
        return None;
    }
    let linear = |x: &Int| {
        let mut holes = Vec::new();
        terms(x, 1, &mut holes).is_some() && holes.is_empty()
    };
    match &e.kind {
        IntKind::Bin(op @ (IntOp::Min | IntOp::Max), ..) => {
            let args = chain_args(e, *op);
            if let Some(inner) = args.iter().find_map(|x| split_point(x)) {
                return Some(inner);
            }
            return args.iter().all(|x| linear(x)).then_some(e);
        }
        IntKind::Abs(x) => return split_point(x).or_else(|| linear(x).then_some(e)),
        _ => {}
    }
    match &e.kind {
        IntKind::Neg(a) | IntKind::Isqrt(a) => split_point(a),
        IntKind::Bin(_, a, b) | IntKind::If(_, a, b) => split_point(a).or_else(|| split_point(b)),
        IntKind::ArrIndex(_, a) | IntKind::SegIndex(_, a) | IntKind::GridCoord(_, _, a) => {
            split_point(a)
        }
        _ => None,
    }
}

/// `e` with the sub-term `at` (by address) replaced by `with`.
fn substitute(e: &Int, at: &Int, with: &Int) -> Int {
    if std::ptr::eq(e, at) {
        return with.clone();
    }
    let sub = |x: &Int| Box::new(substitute(x, at, with));
    let kind = match &e.kind {
        IntKind::Neg(a) => IntKind::Neg(sub(a)),
        IntKind::Abs(a) => IntKind::Abs(sub(a)),
        IntKind::Isqrt(a) => IntKind::Isqrt(sub(a)),
        IntKind::Bin(op, a, b) => IntKind::Bin(*op, sub(a), sub(b)),
        IntKind::If(c, a, b) => IntKind::If(c.clone(), sub(a), sub(b)),
        IntKind::ArrIndex(arr, i) => IntKind::ArrIndex(arr.clone(), sub(i)),
        IntKind::SegIndex(s, p) => IntKind::SegIndex(*s, sub(p)),
        IntKind::GridCoord(g, axis, p) => IntKind::GridCoord(*g, *axis, sub(p)),
        other => other.clone(),
    };
    Int::new(kind, e.span)
}

impl Checker<'_> {
    /// The leaves of the current comparison's cases (1 outside one).
    fn case_leaves(&self) -> u64 {
        self.cases.map_or(1, |c| c.leaves)
    }

    /// Whether the current comparison went past [`MAX_COMPARISON_CASES`].
    fn cases_over(&self) -> bool {
        self.cases.is_some_and(|c| c.over)
    }

    /// Back to `leaves` cases, after an attempt that failed (its cases are not made).
    fn reset_cases(&mut self, leaves: u64) {
        if let Some(c) = self.cases.as_mut() {
            if !c.over {
                c.leaves = leaves;
            }
        }
    }

    /// One comparison of the current one becomes `n` (cases or parts): false, and the
    /// whole comparison fails, when that takes it past [`MAX_COMPARISON_CASES`].
    fn split_into(&mut self, n: usize) -> bool {
        let Some(c) = self.cases.as_mut() else {
            return true;
        };
        c.leaves = c.leaves.saturating_add((n as u64).saturating_sub(1));
        if c.leaves > MAX_COMPARISON_CASES {
            c.over = true;
        }
        !c.over
    }

    /// `a op b` (with `k`, of no solvable form as it stands) split into cases at a term
    /// `abs(x)` or `min` / `max` of `x1, ..., xn` whose arguments are linear in `k`
    /// ([`split_point`]): `T(abs(x))` is `x >= 0 & T(x) | x < 0 & T(-x)`; `T(min(x1, ...,
    /// xn))` is the union over `i` of `xi < xj (j < i) & xi <= xj (j > i) & T(xi)` (the
    /// first smallest argument), `max` likewise with `>` and `>=`. Each case's conditions
    /// are linear comparisons and each `T` is normalised again (split further at the term
    /// around, or another one, up to [`MAX_COMPARISON_CASES`] cases in all). So `min(k, q)
    /// < 5`, `max(q - k, 0) % 4 <= 3`, `abs(k - q) % 3 == 0` and `abs(min(k, q) - 4) % 2
    /// == 0` are unions of solvable atoms. `None` (nothing reported) when there is no such
    /// term or a case is not solvable.
    fn split_cases(
        &mut self,
        op: CmpOp,
        (a, b): (&Int, &Int),
        span: Span,
        ctx: Ctx,
    ) -> Option<Val> {
        let at = split_point(a).or_else(|| split_point(b))?;
        let negate = |x: &Int| Int::new(IntKind::Neg(Box::new(x.clone())), x.span);
        let zero = Int::constant(0, at.span);
        // (each condition as lhs, op, rhs; what the term is in that case)
        type Case = (Vec<(Int, CmpOp, Int)>, Int);
        let cases: Vec<Case> = match &at.kind {
            IntKind::Abs(x) => vec![
                (
                    vec![((**x).clone(), CmpOp::Ge, zero.clone())],
                    (**x).clone(),
                ),
                (vec![((**x).clone(), CmpOp::Lt, zero)], negate(x)),
            ],
            IntKind::Bin(m @ (IntOp::Min | IntOp::Max), ..) => {
                let args = chain_args(at, *m);
                // Against the arguments before it and after it: the first extreme one.
                let (before, after) = if *m == IntOp::Min {
                    (CmpOp::Lt, CmpOp::Le)
                } else {
                    (CmpOp::Gt, CmpOp::Ge)
                };
                args.iter()
                    .enumerate()
                    .map(|(i, &x)| {
                        let conds = args
                            .iter()
                            .enumerate()
                            .filter(|&(j, _)| j != i)
                            .map(|(j, &y)| {
                                (x.clone(), if j < i { before } else { after }, y.clone())
                            })
                            .collect();
                        (conds, x.clone())
                    })
                    .collect()
            }
            _ => return None,
        };
        if !self.split_into(cases.len()) {
            return None;
        }
        let before = self.diags.len();
        let mut joined: Option<Val> = None;
        for (conds, term) in cases {
            let case = (|| {
                let mut all: Option<Val> = None;
                for (cl, cop, cr) in conds {
                    let cond = self
                        .compare_at(cop, Val::Int(cl), Val::Int(cr), span, ctx)
                        .ok()?;
                    all = Some(match all {
                        None => cond,
                        Some(prev) => self.and_or(true, prev, cond, span).ok()?,
                    });
                }
                let (a, b) = (substitute(a, at, &term), substitute(b, at, &term));
                let cmp = self.normalise(op, &a, &b, span, ctx)?;
                match all {
                    None => Some(cmp),
                    Some(all) => self.and_or(true, all, cmp, span).ok(),
                }
            })();
            let Some(case) = case else {
                self.diags.truncate(before);
                return None;
            };
            joined = Some(match joined {
                None => case,
                Some(prev) => match self.and_or(false, prev, case, span) {
                    Ok(v) => v,
                    Err(()) => {
                        self.diags.truncate(before);
                        return None;
                    }
                },
            });
        }
        joined
    }

    /// `min(x1, ..., xn)  op  r` for an inequality `op`, the `min` (or `max`) as written on
    /// either side and `r` anything: `min(xs) < r` (or `<=`) is `x1 < r | ... | xn < r`,
    /// `min(xs) > r` (or `>=`) is `x1 > r & ... & xn > r`, `max` the other way round; each
    /// part normalised again. So `min(abs(k - q), abs(k - q - 8)) <= 2` is two bands, not
    /// cases. `None` (nothing reported) when neither side is such a term or a part is not
    /// solvable.
    fn chain_parts(
        &mut self,
        op: CmpOp,
        (a, b): (&Int, &Int),
        span: Span,
        ctx: Ctx,
    ) -> Option<Val> {
        if matches!(op, CmpOp::Eq | CmpOp::Ne) {
            return None;
        }
        let (chain, left) = [(a, true), (b, false)].into_iter().find(|(e, _)| {
            e.has_k() && matches!(e.kind, IntKind::Bin(IntOp::Min | IntOp::Max, ..))
        })?;
        let IntKind::Bin(m, ..) = chain.kind else {
            return None;
        };
        let args = chain_args(chain, m);
        // Read from the chain's side: `min(xs) < r` holds when some argument is below `r`.
        let from_chain = if left { op } else { op.flip() };
        let any = (m == IntOp::Min) == matches!(from_chain, CmpOp::Lt | CmpOp::Le);
        if !self.split_into(args.len()) {
            return None;
        }
        let before = self.diags.len();
        let mut joined: Option<Val> = None;
        for x in args {
            let (l, r) = if left { (x, b) } else { (a, x) };
            let part = self
                .normalise(op, l, r, span, ctx)
                .and_then(|part| match joined.take() {
                    None => Some(part),
                    Some(prev) => self.and_or(!any, prev, part, span).ok(),
                });
            let Some(part) = part else {
                self.diags.truncate(before);
                return None;
            };
            joined = Some(part);
        }
        joined
    }

    /// `a op b` normalised as [`Checker::compare_at`] does, reporting nothing when it is not
    /// solvable (split into cases first): `None` then.
    fn normalise(&mut self, op: CmpOp, a: &Int, b: &Int, span: Span, ctx: Ctx) -> Option<Val> {
        let before = self.diags.len();
        let v = self.compare_at(op, Val::Int(a.clone()), Val::Int(b.clone()), span, ctx);
        match v {
            Ok(v) if self.diags.len() == before => Some(v),
            _ => {
                self.diags.truncate(before);
                None
            }
        }
    }

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
                self.laid_out_by_now(n, Structure::Grid, range.span)?;
                if x.has_k() && !ctx.pairwise() {
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
        if let ExprKind::Call { .. } = &range.kind {
            if let Some(v) = self.tree_path(&x, range, span, ctx)? {
                return Ok(v);
            }
        }
        // In the mask the bounds may be key-side (`q in lo[k] .. hi[k]`): the comparisons
        // decide whether that is solvable.
        let r = if ctx == Ctx::Mask {
            self.lower_range(range, ctx)?
        } else {
            self.expect_range(range, ctx)?
        };
        let (lo, hi) = match r.kind {
            RangeKind::Lit(lo, hi) => (lo, hi),
            _ => (
                Int::new(IntKind::RangeLo(Box::new(r.clone())), r.span),
                Int::new(IntKind::RangeHi(Box::new(r)), range.span),
            ),
        };
        let a = self.compare(CmpOp::Ge, Val::Int(x.clone()), Val::Int(lo), ctx)?;
        let b = self.compare(CmpOp::Lt, Val::Int(x), Val::Int(hi), ctx)?;
        self.and_or(true, a, b, span)
    }

    /// `x in t.path(p)` for a tree `t`: the region for `x` = `k`, `CM0203` for anything
    /// else (a path is a set of keys, not a range); `None` when `range` is not a tree's path.
    fn tree_path(&mut self, x: &Int, range: &Expr, span: Span, ctx: Ctx) -> R<Option<Val>> {
        let ExprKind::Call { callee, .. } = &range.kind else {
            return Ok(None);
        };
        let ExprKind::Field { base, name } = &callee.kind else {
            return Ok(None);
        };
        let is_tree = matches!(&base.kind, ExprKind::Name(n)
            if matches!(self.names.get(n), Some((Def::Tree(_), _))));
        if !is_tree || name.name != "path" {
            return Ok(None);
        }
        let (tree, pos) = match self.lower(range, ctx)? {
            Val::Path(tree, pos, _) => (tree, pos),
            v => {
                self.type_err(&v, "a tree's path");
                return Err(());
            }
        };
        if x.kind == IntKind::K && ctx == Ctx::Mask {
            return Ok(Some(Val::Region(Region::Path { tree, pos, span }, span)));
        }
        self.err(
            Diagnostic::error(
                Code::TypeMismatch,
                span,
                "a tree's path can only be used as `k in t.path(p)` in the mask",
            )
            .with_hint("`t.path(p)` is the set of keys on the path from the root to p's node (its ancestors and itself), not a range of positions"),
        );
        Err(())
    }

    /// `a op b`: a q-side comparison, or, with `k` on one side, the atom it normalises to;
    /// `CM0207` for a comparison with `k` of no solvable form.
    fn compare(&mut self, op: CmpOp, a: Val, b: Val, ctx: Ctx) -> R<Val> {
        let span = a.span().to(b.span());
        self.compare_at(op, a, b, span, ctx)
    }

    /// [`Checker::compare`] reported at `span` (the comparison as written, for the parts an
    /// `abs` is expanded to). A comparison with `k` that is not solvable as it stands is taken
    /// apart at a `min` / `max` side ([`Checker::chain_parts`]) or split into cases at its
    /// `abs`, `min` and `max` terms ([`Checker::split_cases`]) before it is `CM0207`. The
    /// outermost comparison counts the cases of everything it becomes: past
    /// [`MAX_COMPARISON_CASES`] it is `CM0207` naming the limit and the count.
    fn compare_at(&mut self, op: CmpOp, a: Val, b: Val, span: Span, ctx: Ctx) -> R<Val> {
        if self.cases.is_some() {
            if self.cases_over() {
                return Err(());
            }
            return self.compare_cases(op, a, b, span, ctx);
        }
        let sides = match (&a, &b) {
            (Val::Int(x), Val::Int(y)) => Some((x.clone(), y.clone())),
            _ => None,
        };
        self.cases = Some(Cases {
            leaves: 1,
            over: false,
        });
        let before = self.diags.len();
        let v = self.compare_cases(op, a, b, span, ctx);
        let over = self.cases.take().is_some_and(|c| c.over);
        match sides {
            Some((x, y)) if over => {
                self.diags.truncate(before);
                self.too_many_cases(span, &x, &y);
                Err(())
            }
            _ => v,
        }
    }

    /// [`Checker::compare_at`] inside the outermost comparison: as it stands, else taken
    /// apart or split into cases.
    fn compare_cases(&mut self, op: CmpOp, a: Val, b: Val, span: Span, ctx: Ctx) -> R<Val> {
        let ints = match (&a, &b) {
            (Val::Int(x), Val::Int(y)) if (x.has_k() || y.has_k()) && !ctx.pairwise() => {
                Some((x.clone(), y.clone()))
            }
            _ => None,
        };
        let before = self.diags.len();
        let leaves = self.case_leaves();
        let v = self.compare_atoms(op, a, b, span, ctx);
        let Some((x, y)) = ints.filter(|_| v.is_err()) else {
            return v;
        };
        let unsolvable = self.diags[before..]
            .iter()
            .all(|d| d.code == Code::UnsolvableComparison);
        if !unsolvable || self.cases_over() {
            return v;
        }
        let kept = self.diags.split_off(before);
        self.reset_cases(leaves);
        if let Some(v) = self.chain_parts(op, (&x, &y), span, ctx) {
            return Ok(v);
        }
        self.reset_cases(leaves);
        if !self.cases_over() {
            if let Some(v) = self.split_cases(op, (&x, &y), span, ctx) {
                return Ok(v);
            }
        }
        self.reset_cases(leaves);
        self.diags.extend(kept);
        v
    }

    /// `CM0207` for the comparison `x op y` at `span`, whose cases passed
    /// [`MAX_COMPARISON_CASES`]: the limit, and how many its terms may split it into.
    fn too_many_cases(&mut self, span: Span, x: &Int, y: &Int) {
        let ((nx, cx), (ny, cy)) = (case_bound(x), case_bound(y));
        let (terms, count) = (nx.saturating_add(ny), cx.saturating_mul(cy));
        let count = if count == u64::MAX {
            "more than 2^64".to_string()
        } else {
            format!("up to {count}")
        };
        self.err(
            Diagnostic::error(
                Code::UnsolvableComparison,
                span,
                format!(
                    "this comparison would be split into {count} cases at its {terms} `abs`, \
                     `min` and `max` terms of `k`, more than the {MAX_COMPARISON_CASES} one \
                     comparison may have"
                ),
            )
            .with_hint(format!(
                "each `abs` doubles the cases and each `min` / `max` of n terms multiplies them \
                 by n; write it as several comparisons joined with `&` / `|`, each with fewer of \
                 these terms (`min(x, y) % 4 == 0` is `x <= y & x % 4 == 0 | x > y & y % 4 == \
                 0`), or evaluate it pair by pair with `elementwise(...)`, at most {} pairs per \
                 plan, narrowed by a solvable region",
                crate::MAX_ELEMENTWISE_PAIRS
            )),
        );
    }

    /// [`Checker::compare_at`] without splitting into cases.
    fn compare_atoms(&mut self, op: CmpOp, a: Val, b: Val, span: Span, ctx: Ctx) -> R<Val> {
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
        if !a.has_k() && !b.has_k() || ctx.pairwise() {
            return Ok(Val::Bool(Bool::Cmp(op, a, b), span));
        }
        // One side a `/`, `%` or `abs` term as written, the other q-side: that term against
        // the other side unchanged.
        for (t, other, op) in [(&a, &b, op), (&b, &a, op.flip())] {
            if !other.has_k() && is_hole(t) && hole_ok(t, op) {
                return self.k_term(t, op, other.clone(), span, ctx);
            }
        }
        let diff = bin(IntOp::Sub, a, b);
        let mut holes = Vec::new();
        let split = terms(&diff, 1, &mut holes);
        // A term scaled by 0 is no term (`0 * (k / 2)`).
        holes.retain(|(c, _)| *c != 0);
        match split {
            Some((alpha, rest)) if holes.is_empty() => match const_value(&alpha) {
                Some(0) => Ok(Val::Bool(Bool::Cmp(op, rest, Int::constant(0, span)), span)),
                Some(alpha) => Ok(Val::Region(
                    Region::KCmp {
                        alpha,
                        rest,
                        op,
                        span,
                    },
                    span,
                )),
                None => Ok(Val::Region(scaled_kcmp(alpha, rest, op, span), span)),
            },
            Some((alpha, rest))
                if holes.len() == 1
                    && const_value(&alpha) == Some(0)
                    && holes[0].0 != i64::MIN
                    && hole_ok(&holes[0].1, op) =>
            {
                // c * T + rest  op  0 is T compared with -rest / c.
                let (c, t) = holes.pop().expect("one term");
                let (c, op, rhs) = if c < 0 {
                    (-c, op.flip(), rest)
                } else {
                    (c, op, neg(rest))
                };
                if c == 1 {
                    return self.k_term(&t, op, rhs, span, ctx);
                }
                self.scaled_k_term(c, &t, op, rhs, span, ctx)
            }
            _ => match key_side(&diff) {
                // f(k) + rest  op  0: a function of the key against a q-side value.
                Some((f, rest)) => Ok(Val::Region(
                    Region::KeyCmp {
                        f,
                        op,
                        v: neg(rest),
                        span,
                    },
                    span,
                )),
                None => {
                    self.not_solvable(span, mixed_cause(&diff));
                    Err(())
                }
            },
        }
    }

    /// `c * t  op  rhs` for a constant `c > 1`: `t` compared with a floor division of `rhs`
    /// (`c*t < r` is `t <= (r - 1) / c`), and for `==` / `!=` also whether `c` divides `rhs`.
    fn scaled_k_term(
        &mut self,
        c: i64,
        t: &Int,
        op: CmpOp,
        rhs: Int,
        span: Span,
        ctx: Ctx,
    ) -> R<Val> {
        let cst = Int::constant(c, span);
        let one = Int::constant(1, span);
        let below = || {
            bin(
                IntOp::Div,
                bin(IntOp::Sub, rhs.clone(), one.clone()),
                cst.clone(),
            )
        };
        let at = || bin(IntOp::Div, rhs.clone(), cst.clone());
        match op {
            CmpOp::Lt => self.k_term(t, CmpOp::Le, below(), span, ctx),
            CmpOp::Le => self.k_term(t, CmpOp::Le, at(), span, ctx),
            CmpOp::Gt => self.k_term(t, CmpOp::Gt, at(), span, ctx),
            CmpOp::Ge => self.k_term(t, CmpOp::Gt, below(), span, ctx),
            CmpOp::Eq | CmpOp::Ne => {
                let divides = Bool::Cmp(
                    op,
                    bin(IntOp::Mod, rhs.clone(), cst.clone()),
                    Int::constant(0, span),
                );
                let inner = self.k_term(t, op, at(), span, ctx)?;
                // ==: c divides rhs and t == rhs / c; !=: it does not, or t != rhs / c.
                self.and_or(op == CmpOp::Eq, Val::Bool(divides, span), inner, span)
            }
        }
    }

    /// `t  op  rhs` for a term `t` with `k` that is not linear (`x / d`, `x % d`, `abs(x)`)
    /// and a q-side `rhs`: the atom it is, or `CM0207` naming what keeps it from being one.
    fn k_term(&mut self, t: &Int, op: CmpOp, rhs: Int, span: Span, ctx: Ctx) -> R<Val> {
        let cause = match &t.kind {
            IntKind::Bin(IntOp::Div, x, d) => match linearize(x) {
                Some((alpha, rest)) if alpha != 0 => {
                    return Ok(Val::Region(
                        Region::KDiv {
                            alpha,
                            rest,
                            div: (**d).clone(),
                            op,
                            rhs,
                            span,
                        },
                        span,
                    ))
                }
                _ => mixed_cause(t),
            },
            IntKind::Bin(IntOp::Mod, x, d) => match linearize(x) {
                // `x % 0` is an error at every pair, whatever `x` is, so any multiple of `k`
                // takes the atom of `k % 0`, which raises it (CM0301) when the plan
                // evaluates its divisor.
                Some((alpha, rest)) if matches!(alpha, 1 | -1) || const_value(d) == Some(0) => {
                    return Ok(Val::Region(
                        Region::KMod {
                            alpha: if alpha < 0 { -1 } else { 1 },
                            rest,
                            div: (**d).clone(),
                            op,
                            rhs,
                            span,
                        },
                        span,
                    ))
                }
                Some((alpha, rest)) if matches!(op, CmpOp::Eq | CmpOp::Ne) => {
                    match const_value(d).and_then(|d| congruence(alpha, rest, d, rhs, span)) {
                        Some(eq) if op == CmpOp::Eq => return Ok(Val::Region(eq, span)),
                        Some(eq) => return Ok(Val::Region(Region::Not(Box::new(eq)), span)),
                        None => mixed_cause(t),
                    }
                }
                _ => mixed_cause(t),
            },
            IntKind::Abs(x) => return self.abs_term(x, op, rhs, span, ctx),
            _ => mixed_cause(t),
        };
        self.not_solvable(span, cause);
        Err(())
    }

    /// `abs(x)  op  r` as comparisons of `x` with `r` and `-r`: `|x| <= r` is `-r <= x <= r`,
    /// `|x| >= r` is `x >= r | x <= -r`, `|x| == r` is `r >= 0 & (x == r | x == -r)`.
    fn abs_term(&mut self, x: &Int, op: CmpOp, r: Int, span: Span, ctx: Ctx) -> R<Val> {
        // Two comparisons of `x` where there was one.
        if !self.split_into(2) {
            return Err(());
        }
        let minus_r = Int::new(IntKind::Neg(Box::new(r.clone())), r.span);
        let pair = |c: &mut Self, op_r: CmpOp, op_minus: CmpOp| -> R<(Val, Val)> {
            let a = c.compare_at(op_r, Val::Int(x.clone()), Val::Int(r.clone()), span, ctx)?;
            let minus = Val::Int(minus_r.clone());
            let b = c.compare_at(op_minus, Val::Int(x.clone()), minus, span, ctx)?;
            Ok((a, b))
        };
        let zero = Int::constant(0, span);
        match op {
            CmpOp::Le | CmpOp::Lt => {
                let (a, b) = pair(self, op, op.flip())?;
                self.and_or(true, a, b, span)
            }
            CmpOp::Ge | CmpOp::Gt => {
                let (a, b) = pair(self, op, op.flip())?;
                self.and_or(false, a, b, span)
            }
            CmpOp::Eq => {
                let (a, b) = pair(self, CmpOp::Eq, CmpOp::Eq)?;
                let either = self.and_or(false, a, b, span)?;
                let reachable = Val::Bool(Bool::Cmp(CmpOp::Ge, r.clone(), zero), span);
                self.and_or(true, reachable, either, span)
            }
            CmpOp::Ne => {
                let (a, b) = pair(self, CmpOp::Ne, CmpOp::Ne)?;
                let both = self.and_or(true, a, b, span)?;
                let unreachable = Val::Bool(Bool::Cmp(CmpOp::Lt, r.clone(), zero), span);
                self.and_or(false, unreachable, both, span)
            }
        }
    }

    /// `CM0207` for the comparison at `span`, with the term at fault when one is known.
    fn not_solvable(&mut self, span: Span, cause: Option<(Span, String)>) {
        let mut d = Diagnostic::error(
            Code::UnsolvableComparison,
            span,
            "this comparison cannot be solved for `k` analytically",
        )
        .with_hint(format!(
            "solvable forms: `a*k + f(q) < g(q)` (any of < <= > >= == !=, `a` any q-side \
             integer), `(a*k + f(q)) / d < g(q)`, `(±k + f(q)) % d < g(q)`, `abs(a*k + f(q)) < \
             g(q)`, any function of `k` alone against q-side values (`arr[k] <= q`, \
             `doc.index(k) == doc.index(q)`), with terms on either side, and these with \
             `abs`, `min` or `max` of linear terms anywhere in them (split into cases: \
             `min(k, q) < 5`, `abs(k - q) % 3 == 0`); anything else can be \
             evaluated pair by pair with `elementwise(...)`, at most {} pairs per plan, so \
             narrow it with a solvable region (`q - 512 < k <= q & elementwise(...)`)",
            crate::MAX_ELEMENTWISE_PAIRS
        ));
        if let Some((at, why)) = cause {
            d = d.with_related(at, why);
        }
        self.err(d);
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
    use super::super::testing::{error, error_diag, program, rows};
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
            // Terms moved across the comparison.
            ("7 - k / 2 < q", "KDiv"),
            ("q + (k + 1) / 3 >= 4", "KDiv"),
            ("q < 3 - (k - q) % 4", "KMod"),
            ("2 * (k / 3) <= q", "KDiv"),
            ("q - 3 * (k / 2) == 1", "Inter"),
            ("q - 3 * (k / 2) != 1", "Union"),
            ("-2 * (k % 5) > -q", "KMod"),
            // `%` inequalities.
            ("k % 4 <= q % 4", "KMod"),
            ("(k - q) % 5 > 2", "KMod"),
            ("(q - k) % -3 >= -1", "KMod"),
            ("(k + 2) % 6 < q", "KMod"),
            // `abs`.
            ("abs(q - k) <= 2", "Inter"),
            ("abs(k - q) < 3", "Inter"),
            ("abs(q - 2 * k) > 3", "Union"),
            ("abs(k - 5) >= q - 4", "Union"),
            ("abs(k - q) == q - 5", "Inter"),
            ("abs(k - 2) != q - 3", "Union"),
            ("q + abs(k / 2 - q) < 9", "Inter"),
            ("abs(k % 3 - 1) < 1", "Inter"),
            // `%` of a multiple of `k` by a literal: a congruence.
            ("(2 * k) % 3 == 0", "Inter"),
            ("(4 * k + q) % 6 == 2", "Inter"),
            ("(3 * k - q) % -9 != -3", "Not"),
            ("(6 * k) % 4 == q % 4", "Inter"),
            ("(k - k) % 5 == q % 5", "Inter"),
            // Functions of the key alone against q-side values.
            ("k * k < q", "KeyCmp"),
            ("(2 * k) % 3 < q % 3", "KeyCmp"),
            ("k + k / 2 < q", "KeyCmp"),
            ("k / 2 < q - k / 3", "KeyCmp"),
            ("(k * k) / 2 >= q", "KeyCmp"),
            ("(k / 2) % 3 == q % 3", "KeyCmp"),
            ("[5, 1, 4, 1, 5, 9, 2, 6][k % 8] != q % 7", "KeyCmp"),
            ("abs(k * k - 9) <= q", "Inter"),
            // Split into cases at `abs`, `min` and `max` terms of linear arguments.
            ("min(k, q) < 5", "Union"),
            ("max(q - k, 0) <= 3", "Inter"),
            ("abs(k - q) % 3 == 0", "Union"),
            ("abs(k - q) / 2 == 1", "Union"),
            ("(abs(k - q) + 1) % 4 < 2", "Union"),
            ("min(k, q - 3) >= 2", "Inter"),
            ("max(k, 2 * q) == q + 4", "Union"),
            ("min(k, q) != 3", "Union"),
            ("max(k, q) % 5 == 0", "Union"),
            ("min(abs(k - q), 3) < 2", "Union"),
            ("min(k, 10 - k) > q % 4", "KeyCmp"),
            ("min(k, q) + max(k, 3) < q", "Union"),
            ("max(q - k, 0) % 4 <= 3", "Union"),
            // `min` / `max` of any number of terms, nested in each other and in `abs`.
            (
                "min(abs(k - q), abs(k - q + 1), abs(k - q + 2)) < 3",
                "Union",
            ),
            (
                "min(min(abs(k - q), abs(k - q + 1)), abs(k - q + 2)) < 3",
                "Union",
            ),
            ("max(abs(k - q), abs(k - 2 * q), 3) >= q", "Union"),
            ("k < min(k * k, q)", "Inter"),
            (
                "min(abs(k - q), abs(k - q + 1), abs(k - q + 2)) % 3 == 1",
                "Union",
            ),
            (
                "min(abs(k - q), abs(k - q - 3), abs(k - q + 5), abs(k + q)) == 2",
                "Union",
            ),
            (
                "max(min(k, q - 2), min(abs(k - q), q - k + 5)) / 3 != 1",
                "Union",
            ),
            ("abs(min(k, q) - max(k - 3, q / 2)) % 3 != 0", "Union"),
            ("abs(abs(abs(k - q) - 3) - 2) % 2 == 0", "Union"),
            ("min(k, q, 5) + max(k - q, 2, q - 3) < q", "Union"),
            ("q - min(k, 2 * q - k, 4) > max(k - 8, 1)", "Inter"),
            // A term in which `k` cancels is q-side, as a case may make it.
            ("(k - k + q) / 2 < 3", "Rows"),
            ("abs(2 * k - q - k - k) % 3 < 1", "Rows"),
            ("(abs(k - q) - k) / 2 < 3", "Union"),
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

    /// A coefficient of `k` that is not a literal (a parameter, a q-side value) is solved by
    /// its sign, row by row: zero, negative and positive values, every comparison.
    #[test]
    fn q_side_coefficients_of_k_are_solved_by_sign() {
        for op in ["<", "<=", ">", ">=", "==", "!="] {
            for a in [-3, -1, 0, 1, 2, 5] {
                let cmp = format!("a * k + q {op} 7 - q % 3");
                let src = format!("param a: int = {a};\nmask = {cmp};");
                let reference = format!("param a: int = {a};\nmask = elementwise({cmp});");
                assert_eq!(
                    rows(&src, 20, 23),
                    rows(&reference, 20, 23),
                    "{cmp}, a = {a}"
                );
            }
        }
        for cmp in [
            "(q % 4 - 2) * (k - 1) < q - 3",
            "k < k * q",
            "q * k == 2 * q + 4",
        ] {
            assert_eq!(
                rows(&format!("mask = {cmp};"), 17, 19),
                rows(&format!("mask = elementwise({cmp});"), 17, 19),
                "{cmp}"
            );
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

    /// What is not solvable is `CM0207` pointing at the comparison, with the term at fault
    /// marked (its text, and why); `k` inside a function that takes a q-side integer is
    /// `CM0206` at that argument.
    #[test]
    fn unsolvable_forms_are_errors_that_name_the_cause() {
        for (cmp, at, why) in [
            ("k * k * q < 7", "k * k * q", "together with `q`"),
            ("(2 * k) % q == 1", "(2 * k) % q", "together with `q`"),
            ("q * (k / 2) < 3", "q * (k / 2)", "together with `q`"),
            ("abs(k * k * q) < 3", "k * k * q", "together with `q`"),
            (
                "k + 1 < (k + q) / (q + 2)",
                "(k + q) / (q + 2)",
                "together with `q`",
            ),
            ("k == min(k * k, q)", "min(k * k, q)", "together with `q`"),
            ("abs(k * q) % 3 == 0", "k * q", "together with `q`"),
            // An `abs` / `min` / `max` of linear terms splits: the fault is around it.
            (
                "(abs(k - q) - k) % 3 < 1",
                "(abs(k - q) - k) % 3",
                "together with `q`",
            ),
            (
                "any i in 0 .. 2: [1, 2, 3][k + i] == 2",
                "[1, 2, 3][k + i]",
                "together with the variable of an `any` / `all`",
            ),
        ] {
            let src = format!("mask = {cmp};");
            let d = error_diag(&src);
            assert_eq!(d.code.as_str(), "CM0207", "{cmp}");
            let whole = &src[d.span.start as usize..d.span.end as usize];
            assert!(cmp.ends_with(whole), "{cmp}: {whole}");
            assert_eq!(d.related.len(), 1, "{cmp}: {d:?}");
            let (span, label) = &d.related[0];
            assert_eq!(&src[span.start as usize..span.end as usize], at, "{cmp}");
            assert!(label.contains(why), "{cmp}: {label}");
        }
        let src = "mask = k < [abs(k), q][0];";
        let d = error_diag(src);
        assert_eq!(d.code.as_str(), "CM0206");
        assert_eq!(&src[d.span.start as usize..d.span.end as usize], "abs(k)");
    }

    /// A comparison is split into at most `MAX_COMPARISON_CASES` cases: at the limit it is
    /// solved; past it, it is `CM0207` naming the limit and the count of its terms' cases
    /// (not "not linear in `k`"), and it says so at once for any nesting.
    #[test]
    fn comparisons_past_the_case_limit_name_the_limit_and_the_count() {
        use super::MAX_COMPARISON_CASES;
        assert_eq!(MAX_COMPARISON_CASES, 256);
        let nested = |n: usize, c: &str| {
            let mut e = "k - q".to_string();
            for _ in 0..n {
                e = format!("abs({e}) - {c}");
            }
            e
        };
        let abs_of = |shifts: &[i64]| {
            let terms: Vec<String> = shifts.iter().map(|s| format!("abs(k - q + {s})")).collect();
            format!("min({})", terms.join(", "))
        };
        // At the limit: 8 nested `abs` are 2^8 comparisons, 5 `abs` in a `min` 2^5 * 5 cases.
        for cmp in [
            format!("{} < 1", nested(8, "3")),
            format!("{} % 3 == 1", abs_of(&[0, 1, 2, -5, -7])),
        ] {
            let src = format!("mask = {cmp};");
            assert_eq!(
                rows(&src, 23, 17),
                rows(&format!("mask = elementwise({cmp});"), 23, 17),
                "{cmp}"
            );
        }
        for (cmp, terms, count) in [
            (format!("{} < 1", nested(9, "3")), 9, "up to 512"),
            (
                format!("{} % 3 == 1", abs_of(&[0, 1, 2, -5, -7, 9])),
                7,
                "up to 384",
            ),
            (
                format!("{} > q", nested(60, "1")),
                60,
                "up to 1152921504606846976",
            ),
            (
                format!("{} == q", abs_of(&(0..64).collect::<Vec<_>>())),
                65,
                "more than 2^64",
            ),
        ] {
            let src = format!("mask = {cmp};");
            let d = error_diag(&src);
            assert_eq!(d.code.as_str(), "CM0207", "{cmp}");
            assert_eq!(&src[d.span.start as usize..d.span.end as usize], cmp);
            assert!(
                d.message
                    .contains("more than the 256 one comparison may have")
                    && d.message
                        .contains(&format!("its {terms} `abs`, `min` and `max` terms"))
                    && d.message.contains(&format!("split into {count} cases")),
                "{cmp}: {}",
                d.message
            );
            assert!(d.related.is_empty(), "{cmp}: {d:?}");
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
