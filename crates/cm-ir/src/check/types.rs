//! Typing: lowering expressions to typed values ([`Val`]: integers, booleans, regions,
//! ranges, arrays, segmentations, grids, functions), with the context rules of [`Ctx`]
//! (which names and functions each part of a program may read, where `k` may appear) and a
//! `CM0203` type mismatch, `CM0204` arity or `CM0206` / `CM0208` context error for
//! anything else.

use super::atoms::{bin, const_value};
use super::{Checker, Ctx, Val, MAX_NODES, R};
use crate::bind::{CONCAT_HINT, MAX_QUANT_DEPTH};
use crate::ir::*;
use cm_syntax::ast::{BinOp, Expr, ExprKind, Ident, UnOp};
use cm_syntax::{Code, Diagnostic, Span};

impl Val {
    pub(super) fn span(&self) -> Span {
        match self {
            Val::Int(i) => i.span,
            Val::Range(r) => r.span,
            Val::Bool(_, s)
            | Val::Region(_, s)
            | Val::Arr(_, s)
            | Val::Seg(_, s)
            | Val::Grid(_, s)
            | Val::Dist(_, _, s)
            | Val::SegIndexFn(_, s)
            | Val::PartFn(_, _, s)
            | Val::PieceFn(_, _, s)
            | Val::AxisFn(_, _, s)
            | Val::Tree(_, s)
            | Val::PathFn(_, s)
            | Val::Path(_, _, s) => *s,
        }
    }

    pub(super) fn describe(&self) -> &'static str {
        match self {
            Val::Int(_) => "an integer",
            Val::Bool(..) => "a boolean",
            Val::Region(..) => "a region of (q, k) pairs",
            Val::Range(_) => "a range",
            Val::Arr(..) => "an integer array",
            Val::Seg(..) => "a segmentation",
            Val::Grid(..) => "a grid",
            Val::Dist(..) => "a grid distance",
            Val::Tree(..) => "a tree",
            Val::Path(..) => "a tree's path (use it as `k in t.path(p)`)",
            Val::SegIndexFn(..)
            | Val::PartFn(..)
            | Val::PieceFn(..)
            | Val::AxisFn(..)
            | Val::PathFn(..) => "a function",
        }
    }
}

/// The value of a boolean made of literals only (`2 > 1`, `not true`), if it is one.
fn const_bool(c: &Bool) -> Option<bool> {
    match c {
        Bool::Const(v) => Some(*v),
        Bool::Cmp(op, a, b) => Some(crate::bind::cmp(*op, const_value(a)?, const_value(b)?)),
        Bool::Not(a) => Some(!const_bool(a)?),
        Bool::And(a, b) => Some(const_bool(a)? && const_bool(b)?),
        Bool::Or(a, b) => Some(const_bool(a)? || const_bool(b)?),
        Bool::InGrid(..) => None,
    }
}

impl Checker<'_> {
    pub(super) fn type_err(&mut self, v: &Val, want: &str) {
        self.err(Diagnostic::error(
            Code::TypeMismatch,
            v.span(),
            format!("expected {want}, found {}", v.describe()),
        ));
    }

    /// `i`, unless it reads `k` outside `elementwise` (`CM0206`).
    pub(super) fn no_k(&mut self, i: Int, ctx: Ctx) -> R<Int> {
        if !ctx.pairwise() && i.has_k() {
            self.err(
                Diagnostic::error(Code::UnsolvableK, i.span, "`k` cannot be used here")
                    .with_hint("outside `elementwise(...)`, `k` may only appear in comparisons such as `k <= q`, `k in r` or `k / w == q / w`"),
            );
            return Err(());
        }
        Ok(i)
    }

    pub(super) fn expect_int(&mut self, e: &Expr, ctx: Ctx) -> R<Int> {
        match self.lower(e, ctx)? {
            Val::Int(i) => Ok(i),
            v => {
                self.type_err(&v, "an integer");
                Err(())
            }
        }
    }

    fn expect_q_int(&mut self, e: &Expr, ctx: Ctx) -> R<Int> {
        let i = self.expect_int(e, ctx)?;
        self.no_k(i, ctx)
    }

    pub(super) fn expect_arr(&mut self, e: &Expr, ctx: Ctx) -> R<Arr> {
        match self.lower(e, ctx)? {
            Val::Arr(a, _) => Ok(a),
            v => {
                self.type_err(&v, "an integer array");
                Err(())
            }
        }
    }

    pub(super) fn expect_bool(&mut self, e: &Expr, ctx: Ctx) -> R<Bool> {
        match self.lower(e, ctx)? {
            Val::Bool(b, _) => Ok(b),
            v @ Val::Region(..) => {
                self.err(Diagnostic::error(Code::UnsolvableK, v.span(), "this condition depends on `k`")
                    .with_hint("conditions of `if` and `require` may only depend on q, b, h and parameters; combine regions with `&` and `|` instead"));
                Err(())
            }
            v => {
                self.type_err(&v, "a boolean");
                Err(())
            }
        }
    }

    /// A range whose bounds do not read `k` (outside `elementwise`).
    pub(super) fn expect_range(&mut self, e: &Expr, ctx: Ctx) -> R<RangeE> {
        let r = self.lower_range(e, ctx)?;
        if !ctx.pairwise() && r.has_k() {
            self.err(Diagnostic::error(
                Code::UnsolvableK,
                r.span,
                "range bounds cannot depend on `k`",
            ));
            return Err(());
        }
        Ok(r)
    }

    /// A range, its bounds possibly reading `k` (`q in lo[k] .. hi[k]`, for a comparison to
    /// decide).
    pub(super) fn lower_range(&mut self, e: &Expr, ctx: Ctx) -> R<RangeE> {
        match self.lower(e, ctx)? {
            Val::Range(r) => Ok(r),
            v => {
                self.type_err(&v, "a range (`lo..hi`, a segment or a part)");
                Err(())
            }
        }
    }

    /// A region, or a boolean as the region of the rows where it holds.
    pub(super) fn region_of(&mut self, v: Val) -> R<Region> {
        match v {
            Val::Region(r, _) => Ok(r),
            Val::Bool(b, _) => Ok(Region::Rows(b)),
            v => {
                self.type_err(&v, "a region or a boolean");
                Err(())
            }
        }
    }

    /// The typed value of `e` in context `ctx`; each call counts one IR node against
    /// [`MAX_NODES`]. A chain of `let`s inlines thousands deep, so on a stack that grows
    /// ([`crate::deep`]).
    pub(super) fn lower(&mut self, e: &Expr, ctx: Ctx) -> R<Val> {
        crate::deep(|| self.lower_here(e, ctx))
    }

    fn lower_here(&mut self, e: &Expr, ctx: Ctx) -> R<Val> {
        let span = e.span;
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            if self.nodes == MAX_NODES + 1 {
                self.err(
                    Diagnostic::error(Code::TooDeep, span, format!("the program is too large: more than {MAX_NODES} expression nodes after inlining `let`s"))
                        .with_hint("a `let` is copied into every place that uses it; a chain of lets that each use the previous one twice doubles in size at every step"),
                );
            }
            return Err(());
        }
        match &e.kind {
            ExprKind::Error => Err(()),
            ExprKind::Int(v) => Ok(Val::Int(Int::constant(*v, span))),
            ExprKind::Float(v) => {
                self.err(
                    Diagnostic::error(
                        Code::TypeMismatch,
                        span,
                        format!("float `{}` where an integer is expected", v.value()),
                    )
                    .with_hint("floats are read only by the `score` statement (and not through a `let`); everything else is an integer"),
                );
                Err(())
            }
            ExprKind::Bool(b) => Ok(Val::Bool(Bool::Const(*b), span)),
            ExprKind::Name(n) => self.name(n, span, ctx),
            ExprKind::Array(items) => {
                let xs: R<Vec<Int>> = items.iter().map(|x| self.expect_q_int(x, ctx)).collect();
                Ok(Val::Arr(Arr::Lit(xs?), span))
            }
            ExprKind::Unary(UnOp::Neg, a) => {
                let a = self.expect_int(a, ctx)?;
                Ok(Val::Int(Int::new(IntKind::Neg(Box::new(a)), span)))
            }
            ExprKind::Unary(UnOp::Not, a) => {
                match self.lower(a, ctx)? {
                    Val::Bool(b, _) => Ok(Val::Bool(Bool::Not(Box::new(b)), span)),
                    Val::Region(r, _) => Ok(Val::Region(Region::Not(Box::new(r)), span)),
                    v => {
                        self.err(
                        Diagnostic::error(
                            Code::TypeMismatch,
                            v.span(),
                            format!("expected a boolean or a region after `!`, found {}", v.describe()),
                        )
                        .with_hint(
                            "`!` binds tighter than comparisons and arithmetic, as unary `-` does \
                             (`!k < 2` is `(!k) < 2`): write `!(k < 2)`, or `not k < 2` (the word \
                             form binds loosely)",
                        ),
                    );
                        Err(())
                    }
                }
            }
            ExprKind::Binary(op, a, b) => self.binary(*op, a, b, span, ctx),
            ExprKind::Compare { first, rest } => self.compare_chain(first, rest, span, ctx),
            ExprKind::Range { lo, hi, inclusive } => {
                let lo = self.expect_int(lo, ctx)?;
                let mut hi = self.expect_int(hi, ctx)?;
                if *inclusive {
                    hi = bin(IntOp::Add, hi, Int::constant(1, span));
                }
                Ok(Val::Range(RangeE {
                    kind: RangeKind::Lit(lo, hi),
                    span,
                }))
            }
            ExprKind::In { elem, range } => self.membership(elem, range, span, ctx),
            ExprKind::If { cond, then, els } => self.if_expr(cond, then, els, span, ctx),
            ExprKind::Field { base, name } => self.field(base, name, span, ctx),
            ExprKind::Index { base, index } => self.index(base, index, span, ctx),
            ExprKind::Call { callee, args } => self.call(callee, args, span, ctx),
            ExprKind::Quant {
                all,
                var,
                range,
                body,
            } => self.quantifier(*all, var, range, body, span, ctx),
        }
    }

    /// `any i in RANGE: BODY` / `all i in RANGE: BODY`: a region (the union or intersection
    /// of `BODY` over the integers of the range) in the mask; `i` is a q-side integer.
    fn quantifier(
        &mut self,
        all: bool,
        var: &Ident,
        range: &Expr,
        body: &Expr,
        span: Span,
        ctx: Ctx,
    ) -> R<Val> {
        let word = if all { "all" } else { "any" };
        self.in_mask_only(
            ctx,
            span,
            format!("`{word}` can only be used in the mask (not inside `elementwise`)"),
        )?;
        if self.vars.len() >= MAX_QUANT_DEPTH {
            self.err(
                Diagnostic::error(
                    Code::TooDeep,
                    span,
                    format!("`any` / `all` nest too deeply: at most {MAX_QUANT_DEPTH} levels"),
                )
                .with_hint("combine the ranges of inner quantifiers into one array"),
            );
            return Err(());
        }
        self.fresh_var(var)?;
        let r = self.expect_range(range, ctx)?;
        let (lo, hi) = match r.kind {
            RangeKind::Lit(lo, hi) => (lo, hi),
            _ => (
                Int::new(IntKind::RangeLo(Box::new(r.clone())), r.span),
                Int::new(IntKind::RangeHi(Box::new(r)), range.span),
            ),
        };
        let depth = self.vars.len() as u8;
        self.vars.push(var.name.clone());
        let v = self.lower(body, ctx);
        self.vars.pop();
        let body = self.region_of(v?)?;
        Ok(Val::Region(
            Region::Quant {
                all,
                depth,
                lo,
                hi,
                body: Box::new(body),
                span,
            },
            span,
        ))
    }

    /// `if c then a else b`: integers, booleans, or regions (a condition on rows).
    fn if_expr(&mut self, cond: &Expr, then: &Expr, els: &Expr, span: Span, ctx: Ctx) -> R<Val> {
        let c = self.expect_bool(cond, ctx)?;
        if c.has_k() && !ctx.pairwise() {
            self.err(Diagnostic::error(
                Code::UnsolvableK,
                cond.span,
                "this condition depends on `k`",
            ));
            return Err(());
        }
        let t = self.lower(then, ctx)?;
        let f = self.lower(els, ctx)?;
        // A condition of literals only picks its branch now (both are still checked), so
        // the planner sees the branch's own atoms (`if 2 > 1 then (q - k) % 2 == 0 else ..`).
        let known = const_bool(&c);
        match (t, f) {
            (t @ Val::Int(_), f @ Val::Int(_)) | (t @ Val::Bool(..), f @ Val::Bool(..))
                if known.is_some() =>
            {
                Ok(if known == Some(true) { t } else { f })
            }
            (t @ (Val::Bool(..) | Val::Region(..)), f @ (Val::Bool(..) | Val::Region(..)))
                if known.is_some() && !ctx.pairwise() =>
            {
                let r = self.region_of(if known == Some(true) { t } else { f })?;
                Ok(Val::Region(r, span))
            }
            (Val::Int(a), Val::Int(b)) => Ok(Val::Int(Int::new(
                IntKind::If(Box::new(c), Box::new(a), Box::new(b)),
                span,
            ))),
            (Val::Bool(a, _), Val::Bool(b, _)) => Ok(Val::Bool(
                Bool::Or(
                    Box::new(Bool::And(Box::new(c.clone()), Box::new(a))),
                    Box::new(Bool::And(Box::new(Bool::Not(Box::new(c))), Box::new(b))),
                ),
                span,
            )),
            (t @ (Val::Bool(..) | Val::Region(..)), f @ (Val::Bool(..) | Val::Region(..)))
                if !ctx.pairwise() =>
            {
                let t = self.region_of(t)?;
                let f = self.region_of(f)?;
                Ok(Val::Region(Region::Cond(c, Box::new(t), Box::new(f)), span))
            }
            (t, f) => {
                self.err(Diagnostic::error(
                    Code::TypeMismatch,
                    span,
                    format!(
                        "the branches of `if` differ: {} and {}",
                        t.describe(),
                        f.describe()
                    ),
                ));
                Err(())
            }
        }
    }

    /// `a[i]` of an array, `a[lo .. hi]`, the slice of its entries `[lo, hi)`, or `s[i]`,
    /// the segment of index `i`.
    fn index(&mut self, base: &Expr, index: &Expr, span: Span, ctx: Ctx) -> R<Val> {
        let b = self.lower(base, ctx)?;
        if let (Val::Arr(a, _), ExprKind::Range { .. }) = (&b, &index.kind) {
            let r = self.expect_range(index, ctx)?;
            return Ok(Val::Arr(
                Arr::Slice(Box::new(a.clone()), Box::new(r), span),
                span,
            ));
        }
        let i = self.expect_int(index, ctx)?;
        // `arr[k]` is a key-side value (see `atoms`); a segment index is q-side only.
        let i = match b {
            Val::Arr(..) if ctx == Ctx::Mask => i,
            _ => self.no_k(i, ctx)?,
        };
        match b {
            Val::Arr(a, _) => Ok(Val::Int(Int::new(
                IntKind::ArrIndex(Box::new(a), Box::new(i)),
                span,
            ))),
            Val::Seg(s, _) => Ok(Val::Range(RangeE {
                kind: RangeKind::SegAt(s, i),
                span,
            })),
            v => {
                self.type_err(&v, "an array or a segmentation to index");
                Err(())
            }
        }
    }

    fn binary(&mut self, op: BinOp, a: &Expr, b: &Expr, span: Span, ctx: Ctx) -> R<Val> {
        let va = self.lower(a, ctx)?;
        let vb = self.lower(b, ctx)?;
        match op {
            BinOp::And | BinOp::Or => self.and_or(op == BinOp::And, va, vb, span),
            _ => match (va, vb) {
                (Val::Int(x), Val::Int(y)) => {
                    let iop = match op {
                        BinOp::Add => IntOp::Add,
                        BinOp::Sub => IntOp::Sub,
                        BinOp::Mul => IntOp::Mul,
                        BinOp::Div => IntOp::Div,
                        _ => IntOp::Mod,
                    };
                    Ok(Val::Int(Int::new(
                        IntKind::Bin(iop, Box::new(x), Box::new(y)),
                        span,
                    )))
                }
                (Val::Arr(x, _), Val::Arr(y, _)) if op == BinOp::Add => {
                    if let (Some(lx), Some(ly)) = (self.static_len(&x), self.static_len(&y)) {
                        if lx != ly {
                            self.err(
                                Diagnostic::error(
                                    Code::TypeMismatch,
                                    span,
                                    format!("`+` adds arrays entry by entry, but these have {lx} and {ly} entries"),
                                )
                                .with_hint(CONCAT_HINT),
                            );
                            return Err(());
                        }
                    }
                    Ok(Val::Arr(Arr::Add(Box::new(x), Box::new(y), span), span))
                }
                (x @ (Val::Region(..) | Val::Bool(..)), y @ (Val::Region(..) | Val::Bool(..)))
                    if op == BinOp::Sub && !ctx.pairwise() =>
                {
                    let x = self.region_of(x)?;
                    let y = self.region_of(y)?;
                    Ok(Val::Region(Region::Diff(Box::new(x), Box::new(y)), span))
                }
                (x, y) => {
                    let hint = if matches!(
                        (&x, &y),
                        (Val::Arr(..), Val::Int(_)) | (Val::Int(_), Val::Arr(..))
                    ) && op == BinOp::Add
                    {
                        CONCAT_HINT
                    } else {
                        "arithmetic works on integers, `+` also on arrays of equal length (entry by entry), `-` also on regions (difference)"
                    };
                    self.err(
                        Diagnostic::error(
                            Code::TypeMismatch,
                            span,
                            format!(
                                "cannot apply this operator to {} and {}",
                                x.describe(),
                                y.describe()
                            ),
                        )
                        .with_hint(hint),
                    );
                    Err(())
                }
            },
        }
    }

    pub(super) fn and_or(&mut self, is_and: bool, a: Val, b: Val, span: Span) -> R<Val> {
        match (a, b) {
            (Val::Bool(x, _), Val::Bool(y, _)) => Ok(Val::Bool(
                if is_and {
                    Bool::And(Box::new(x), Box::new(y))
                } else {
                    Bool::Or(Box::new(x), Box::new(y))
                },
                span,
            )),
            (x @ (Val::Region(..) | Val::Bool(..)), y @ (Val::Region(..) | Val::Bool(..))) => {
                let x = self.region_of(x)?;
                let y = self.region_of(y)?;
                Ok(Val::Region(
                    if is_and {
                        Region::Inter(Box::new(x), Box::new(y))
                    } else {
                        Region::Union(Box::new(x), Box::new(y))
                    },
                    span,
                ))
            }
            (x, y) => {
                let bad = if matches!(x, Val::Bool(..) | Val::Region(..)) {
                    y
                } else {
                    x
                };
                self.type_err(&bad, "a boolean or a region");
                Err(())
            }
        }
    }

    /// The number of entries of `a` when the program fixes it: literals, named arrays, and
    /// parameters by their defaults (a plan with the defaults has this length).
    fn static_len(&self, a: &Arr) -> Option<usize> {
        match a {
            Arr::Lit(xs) => Some(xs.len()),
            Arr::Const(v) => Some(v.len()),
            Arr::Param(id) => match &self.params[*id].default {
                Some(ParamDefault::Array(d)) => self.static_len(d),
                _ => None,
            },
            Arr::Add(x, _, _) => self.static_len(x),
            Arr::Concat(xs, _) => xs.iter().map(|x| self.static_len(x)).sum(),
            Arr::Slice(..) => None,
        }
    }

    /// `concat(a, b, ...)`: the arrays one after the other; an integer argument is a
    /// one-entry array (`concat(docs, pad)`).
    fn concat(&mut self, args: &[Expr], span: Span, ctx: Ctx) -> R<Val> {
        self.arity("concat", args, 1..=64, span)?;
        let mut parts = Vec::with_capacity(args.len());
        for a in args {
            match self.lower(a, ctx)? {
                Val::Arr(x, _) => parts.push(x),
                Val::Int(i) => parts.push(Arr::Lit(vec![self.no_k(i, ctx)?])),
                v => {
                    self.type_err(&v, "an integer array or an integer");
                    return Err(());
                }
            }
        }
        Ok(Val::Arr(Arr::Concat(parts, span), span))
    }

    /// `CM0204` unless `args` has a count in `want`.
    pub(super) fn arity(
        &mut self,
        what: &str,
        args: &[Expr],
        want: std::ops::RangeInclusive<usize>,
        span: Span,
    ) -> R<()> {
        if want.contains(&args.len()) {
            return Ok(());
        }
        let expected = if want.start() == want.end() {
            format!("{}", want.start())
        } else {
            format!("{} to {}", want.start(), want.end())
        };
        self.err(Diagnostic::error(
            Code::WrongArity,
            span,
            format!(
                "`{what}` takes {expected} argument(s), found {}",
                args.len()
            ),
        ));
        Err(())
    }

    /// A call of built-in function `n` (`min`, `max`, `abs`, `isqrt`, `sum`, `count`, `l1`,
    /// `l2`, `linf`, `box` or `elementwise`).
    pub(super) fn builtin_call(&mut self, n: &str, args: &[Expr], span: Span, ctx: Ctx) -> R<Val> {
        match n {
            "min" | "max" => {
                // Each argument adds a level to the expression tree later stages recurse on.
                self.arity(n, args, 2..=64, span)?;
                let op = if n == "min" { IntOp::Min } else { IntOp::Max };
                // With `k`, a key-side value (`min(k, 9) <= q`): the comparison decides.
                let mut acc = self.expect_int(&args[0], ctx)?;
                for a in &args[1..] {
                    let x = self.expect_int(a, ctx)?;
                    acc = bin(op, acc, x);
                }
                acc.span = span;
                Ok(Val::Int(acc))
            }
            "abs" | "isqrt" | "sum" | "count" => {
                self.arity(n, args, 1..=1, span)?;
                let arg = &args[0];
                let kind = match n {
                    // `abs(q - k) <= w` is solvable: the comparison decides (see `atoms`).
                    "abs" => IntKind::Abs(Box::new(self.expect_int(arg, ctx)?)),
                    "isqrt" => IntKind::Isqrt(Box::new(self.expect_int(arg, ctx)?)),
                    "sum" => IntKind::ArrSum(Box::new(self.expect_arr(arg, ctx)?)),
                    _ => IntKind::ArrLen(Box::new(self.expect_arr(arg, ctx)?)),
                };
                Ok(Val::Int(Int::new(kind, span)))
            }
            "concat" => self.concat(args, span, ctx),
            "l1" | "l2" | "linf" => {
                self.arity(n, args, 1..=1, span)?;
                let g = self.expect_grid(&args[0], ctx)?;
                let m = match n {
                    "l1" => Metric::L1,
                    "l2" => Metric::L2,
                    _ => Metric::Linf,
                };
                self.in_mask_only(ctx, span, format!("`{n}` can only be used in the mask"))?;
                Ok(Val::Dist(g, m, span))
            }
            "box" => {
                self.in_mask_only(
                    ctx,
                    span,
                    "`box` can only be used in the mask (not inside `elementwise`)",
                )?;
                if args.is_empty() {
                    self.arity(n, args, 3..=4, span)?;
                }
                let g = self.expect_grid(&args[0], ctx)?;
                let nd = self.grids[g].dims.len();
                self.arity(n, args, nd + 1..=nd + 1, span)?;
                let ranges: R<Vec<RangeE>> = args[1..]
                    .iter()
                    .map(|a| self.expect_range(a, ctx))
                    .collect();
                Ok(Val::Region(
                    Region::Box {
                        grid: g,
                        ranges: ranges?,
                        span,
                    },
                    span,
                ))
            }
            _ => {
                self.arity(n, args, 1..=1, span)?;
                self.in_mask_only(
                    ctx,
                    span,
                    "`elementwise` can only be used in the mask, and not nested",
                )?;
                let b = self.expect_bool(&args[0], Ctx::Elementwise)?;
                Ok(Val::Region(Region::Elementwise(b, span), span))
            }
        }
    }

    /// `CM0208` with `message` unless `ctx` is the mask itself (not `elementwise`).
    fn in_mask_only(&mut self, ctx: Ctx, span: Span, message: impl Into<String>) -> R<()> {
        if ctx == Ctx::Mask {
            return Ok(());
        }
        let message = if ctx == Ctx::Score {
            "regions and grid distances can only be used in the mask, not in the score".into()
        } else {
            message.into()
        };
        self.err(Diagnostic::error(Code::WrongContext, span, message));
        Err(())
    }

    fn expect_grid(&mut self, e: &Expr, ctx: Ctx) -> R<GridId> {
        match self.lower(e, ctx)? {
            Val::Grid(g, _) => Ok(g),
            v => {
                self.type_err(&v, "a grid");
                Err(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{error, error_diag, program, rows};
    use crate::ir::Region;

    #[test]
    fn operators_need_operands_of_their_types() {
        for (src, message) in [
            (
                "mask = k <= q + (k < 3);",
                "cannot apply this operator to an integer and a region of (q, k) pairs",
            ),
            (
                "mask = k <= q * [1, 2];",
                "cannot apply this operator to an integer and an integer array",
            ),
            (
                "mask = !(q + 1) & k < q;",
                "expected a boolean or a region after `!`, found an integer",
            ),
            (
                "mask = k < q & 3;",
                "expected a boolean or a region, found an integer",
            ),
            (
                "mask = [1][0 < 1] < k;",
                "expected an integer, found a boolean",
            ),
            (
                "mask = k < q[0];",
                "expected an array or a segmentation to index, found an integer",
            ),
            (
                "mask = q;",
                "expected a region or a boolean, found an integer",
            ),
            (
                "mask = if q < 3 then 1 else k <= q;",
                "the branches of `if` differ: an integer and a region of (q, k) pairs",
            ),
        ] {
            assert_eq!(error(src), ("CM0203", message.to_string()), "{src}");
        }
    }

    /// `concat` appends, `+` adds entry by entry, slices cut `[lo, hi)`; a `+` of arrays
    /// whose lengths the program fixes and that differ is `CM0203` with the `concat` hint,
    /// as is `+` of an array and an integer.
    #[test]
    fn arrays_concatenate_add_and_slice() {
        let bind = |src: &str| {
            let p = program(src);
            let shape = crate::Shape {
                q_len: 4,
                kv_len: 4,
                batch: 1,
                num_heads: 1,
            };
            let b = p.bind(shape, &Default::default()).unwrap();
            let crate::ir::SegKind::Plain(a) = &p.segs[0].kind else {
                panic!()
            };
            b.eval_arr(a, &Default::default()).unwrap().to_vec()
        };
        let seg = |arr: &str| {
            format!("param pad: int = 9;\nparam docs: [int] = [1, 2, 3];\nsegments s = {arr};\nmask = k in s(q);")
        };
        assert_eq!(bind(&seg("concat(docs, [pad])")), [1, 2, 3, 9]);
        assert_eq!(
            bind(&seg("concat(docs, pad, docs[1 .. 3])")),
            [1, 2, 3, 9, 2, 3]
        );
        assert_eq!(bind(&seg("docs + [pad, 0, pad]")), [10, 2, 12]);
        assert_eq!(bind(&seg("docs[0 ..= 1] + [pad, 1]")), [10, 3]);
        assert_eq!(bind(&seg("concat(small)[1 .. count(small)]")), [1, 2]);
        for arr in ["docs + [pad]", "[1, 2] + concat(docs, 1)", "small + [1]"] {
            let d = error_diag(&seg(arr));
            assert_eq!(d.code.as_str(), "CM0203", "{arr}");
            assert!(
                d.message.starts_with("`+` adds arrays entry by entry"),
                "{}",
                d.message
            );
            assert!(d.hint.unwrap().contains("concat(A, B)"));
        }
        let d = error_diag(&seg("docs + pad"));
        assert!(d.hint.unwrap().contains("concat(docs, pad)"));
        assert_eq!(error(&seg("concat(docs, 1 < 2)")).0, "CM0203");
    }

    /// `any` / `all`: a region over the integers of a range, the variable a q-side integer
    /// visible in the body only; `any` and `all` stay ordinary names elsewhere.
    #[test]
    fn quantifiers_range_over_integers() {
        let src = "param g: [int] = [0, 7, 3];\n\
                   mask = q - 4 < k <= q | any i in 0 .. count(g): k == g[i] | q == g[i];";
        let Region::Union(_, quant) = program(src).mask else {
            panic!()
        };
        assert!(
            matches!(
                *quant,
                Region::Quant {
                    all: false,
                    depth: 0,
                    ..
                }
            ),
            "{quant:?}"
        );
        let reference = "mask = elementwise(q - 4 < k & k <= q | k == 0 | k == 7 | k == 3 \
                         | q == 0 | q == 7 | q == 3);";
        assert_eq!(rows(src, 12, 10), rows(reference, 12, 10));
        let nested = "mask = all i in 0 ..= 1: any j in i .. 3: k == q + i * j;";
        let reference = "mask = elementwise((k == q | k == q + 0 | k == q + 0) \
                         & (k == q + 1 | k == q + 2));";
        assert_eq!(rows(nested, 9, 9), rows(reference, 9, 9));
        // An empty range: `any` is no key, `all` every key.
        assert_eq!(
            rows("mask = any i in 3 .. 1: k == i;", 2, 3),
            [vec![], vec![]]
        );
        assert_eq!(
            rows("mask = all i in 3 .. 1: k == i;", 2, 3),
            [vec![(0, 3)], vec![(0, 3)]]
        );
        program("param any: int = 1;\nparam all: int = 2;\nmask = k < any + all;");
    }

    #[test]
    fn quantifier_errors() {
        for (src, code, message) in [
            ("mask = any q in 0 .. 2: k == q;", "CM0202", "`q` is a built-in name and cannot be redefined"),
            ("param n: int = 2;\nmask = any n in 0 .. 2: k == n;", "CM0202", "`n` is already defined"),
            ("mask = any i in 0 .. 2: any i in 0 .. 2: k == i;", "CM0202", "`i` is already defined"),
            ("mask = any i in 0 .. 2: i;", "CM0203", "expected a region or a boolean, found an integer"),
            ("mask = any i in 0 .. k: k == i;", "CM0206", "range bounds cannot depend on `k`"),
            ("param n: int = any i in 0 .. 2: i == 1;\nmask = k <= q;", "CM0208", "`any` can only be used in the mask (not inside `elementwise`)"),
            ("mask = elementwise(all i in 0 .. 2: k == i);", "CM0208", "`all` can only be used in the mask (not inside `elementwise`)"),
            ("let x = i;\nmask = any i in 0 .. 2: k == x;", "CM0201", "unknown name `i`"),
            (
                "mask = any a in 0..1: any b2 in 0..1: any c in 0..1: any d in 0..1: any e in 0..1: k == a;",
                "CM0105",
                "`any` / `all` nest too deeply: at most 4 levels",
            ),
        ] {
            assert_eq!(error(src), (code, message.to_string()), "{src}");
        }
    }

    #[test]
    fn arguments_are_counted() {
        for (src, message) in [
            (
                "mask = k < min(q);",
                "`min` takes 2 to 64 argument(s), found 1",
            ),
            (
                "mask = k < abs(q, q);",
                "`abs` takes 1 argument(s), found 2",
            ),
            (
                "grid g = [2, 2];\nmask = box(g, 0 .. 1);",
                "`box` takes 3 argument(s), found 2",
            ),
            (
                "segments s = [2];\nmask = k in s(q, q);",
                "`s` takes 1 argument(s), found 2",
            ),
        ] {
            assert_eq!(error(src), ("CM0204", message.to_string()), "{src}");
        }
    }

    /// `if` on rows: integers and booleans choose per row, regions become a conditional
    /// region; conditions may not read `k`.
    #[test]
    fn if_chooses_per_row() {
        let src = "mask = if q < 3 then k <= q else k < 0 | k == q;";
        assert!(matches!(program(src).mask, Region::Cond(..)));
        assert_eq!(
            rows(src, 6, 6),
            rows(
                "mask = elementwise(q < 3 & k <= q | q >= 3 & k == q);",
                6,
                6
            )
        );
        assert_eq!(
            rows("mask = k < (if q < 2 then 1 else q);", 5, 5),
            rows("mask = k < max(1, q) & (q >= 2 | k < 1);", 5, 5)
        );
        assert_eq!(error("mask = if k < q then k <= q else false;").0, "CM0206");
        // A condition of literals picks its branch; the other is still checked.
        assert!(matches!(
            program("mask = if 2 > 1 and not false then k <= q else k < 0;").mask,
            Region::KCmp { .. }
        ));
        assert!(matches!(
            program("mask = k < (if 1 == 2 then q else 3);").mask,
            Region::KCmp { rest, .. } if format!("{rest:?}").contains("Const(3)") && !format!("{rest:?}").contains("If")
        ));
        assert_eq!(error("mask = if true then k <= q else zz;").0, "CM0201");
        assert_eq!(
            error("param n: int = 1;\nrequire k < n else \"x\";\nmask = k <= q;").0,
            "CM0208"
        );
    }

    #[test]
    fn elementwise_reads_k_anywhere_once() {
        let src = "mask = elementwise(k * k <= q);";
        assert!(matches!(program(src).mask, Region::Elementwise(..)));
        assert_eq!(error("mask = elementwise(elementwise(k < q));").0, "CM0208");
        assert_eq!(
            error("grid g = [2, 2];\nmask = elementwise(l2(g) < 1);").0,
            "CM0208"
        );
        assert_eq!(error("mask = k < q[k];").0, "CM0206");
        // Bounds that read `k` are compared like any other side.
        assert_eq!(
            rows("mask = k in k .. q;", 5, 6),
            rows("mask = k < q;", 5, 6)
        );
    }

    #[test]
    fn programs_too_large_after_inlining_are_refused() {
        let mut src = "let a0 = q;\n".to_string();
        for i in 1..40 {
            src.push_str(&format!("let a{i} = a{0} + a{0};\n", i - 1));
        }
        src.push_str("mask = k < a39;");
        let (code, message) = error(&src);
        assert_eq!(code, "CM0105");
        // `a{i}` has 2^(i + 2) - 3 nodes inlined (1 for `a0`; a sum of two uses, each one
        // node more than its let): the first past 200000 is `a16`, and it is named.
        assert_eq!(
            message,
            "`a16` is too large: with the `let`s it uses inlined, its expression has 262141 \
             nodes (at most 200000)"
        );
        // Each let within the limit, their uses together past it: the lowering's count.
        let mut src = "let a0 = q;\n".to_string();
        for i in 1..=12 {
            src.push_str(&format!("let a{i} = a{0} + a{0};\n", i - 1));
        }
        src.push_str(&format!("mask = k < {};", vec!["a12"; 13].join(" + ")));
        let (code, message) = error(&src);
        assert_eq!(code, "CM0105");
        assert!(message.starts_with("the program is too large"), "{message}");
    }
}
