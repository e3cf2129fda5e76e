//! The score part of a program: `tensor NAME: [..];` declarations, `score = EXPR;` (how a
//! visible pair's logit is formed from the raw score `score`) and `sink = T[h];`. The score
//! expression is lowered as written ([`ScoreExpr`], which the pairwise reference
//! evaluates) and then brought to its normal form ([`ScoreForm`]): the raw score or
//! `softcap(score, c)`, plus at most one bias `coefficient(h) * (affine in q and k)`, plus
//! at most one bias table indexed by a bucket of `q - k`. Anything else is `CM0212`.
//!
//! Integer parts keep the language's integer semantics (`/` floors); a part is a float when
//! it holds a float literal, `score`, a tensor, `softcap` or `alibi_slopes`. A `let` holds
//! no float.

use super::atoms::bin;
use super::names::RAW_SCORE;
use super::{Checker, Ctx, Def, R};
use crate::ir::*;
use crate::score::*;
use cm_syntax::ast::{BinOp, Expr, ExprKind, FloatBits, Ident, UnOp};
use cm_syntax::{Code, Diagnostic, Span};

/// The hint of most `CM0212` errors: the supported form.
const FORM_HINT: &str = "a score is `score` or `softcap(score, c)`, plus one bias `coefficient * (a*q + b*k + c)` whose coefficient may read `h` (`- alibi_slopes(num_heads)[h] * (q - k)`), plus one table `T[h][bucket]` or `T[bucket]` whose bucket reads q and k only as `q - k` (`t5_bucket(k - q, 32, 128, true)`); see docs/language.md, \"Scores\"";

/// What Swin-style tables get.
const SWIN: &str = "bias tables indexed by two relative coordinates (Swin's 2D relative positions on a grid) are not supported yet";

fn unsupported(span: Span, message: impl Into<String>) -> Diagnostic {
    Diagnostic::error(Code::UnsupportedScore, span, message)
}

fn reads_qk(i: &Int) -> bool {
    i.mentions(&|x| matches!(x, IntKind::Q | IntKind::K))
}

fn score_reads_qk(e: &ScoreExpr) -> bool {
    e.reads(&|x| matches!(x, IntKind::Q | IntKind::K))
}

fn is_raw(e: &ScoreExpr) -> bool {
    e.any_node(&|k| matches!(k, ScoreKind::Raw))
}

fn is_table(e: &ScoreExpr) -> bool {
    e.any_node(&|k| matches!(k, ScoreKind::Table { .. }))
}

fn expr(kind: ScoreKind, span: Span) -> ScoreExpr {
    ScoreExpr { kind, span }
}

/// Whether a grid coordinate occurs in `i` (a Swin-style 2D bucket).
fn has_grid_coord(i: &Int) -> bool {
    crate::deep(|| match &i.kind {
        IntKind::GridCoord(..) => true,
        IntKind::Neg(a) | IntKind::Abs(a) | IntKind::Isqrt(a) => has_grid_coord(a),
        IntKind::Bin(_, a, b) => has_grid_coord(a) || has_grid_coord(b),
        IntKind::If(_, a, b) => has_grid_coord(a) || has_grid_coord(b),
        IntKind::ArrIndex(_, x) | IntKind::SegIndex(_, x) => has_grid_coord(x),
        _ => false,
    })
}

impl<'a> Checker<'a> {
    /// `tensor NAME: [D1, ...];`: one or two extents, integers of the lengths and
    /// parameters.
    pub(super) fn tensor_item(&mut self, name: &Ident, dims: &[Expr], span: Span) {
        if !self.declare(name, Def::Failed) {
            return;
        }
        if dims.is_empty() || dims.len() > 2 {
            let d = unsupported(
                span,
                format!(
                    "tensor `{}` has {} extents; expected 1 or 2",
                    name.name,
                    dims.len()
                ),
            );
            self.err(if dims.len() > 2 {
                d.with_hint(format!("{SWIN}; a table is `[num_heads, num_buckets]` or `[num_buckets]`, sinks `[num_heads]`"))
            } else {
                d.with_hint("a table is `[num_heads, num_buckets]` or `[num_buckets]`, sinks `[num_heads]`")
            });
            return;
        }
        let dims: R<Vec<Int>> = dims
            .iter()
            .map(|d| self.expect_int(d, Ctx::Const))
            .collect();
        let Ok(dims) = dims else {
            return;
        };
        self.define(name, Def::Tensor(self.tensors.len()));
        self.tensors.push(TensorDecl {
            name: name.name.clone(),
            dims,
            span,
        });
    }

    /// `score = EXPR;`, at most once: the expression as written and its normal form.
    pub(super) fn score_item(&mut self, value: &Expr, span: Span) {
        if self.score.is_some() {
            self.err(
                Diagnostic::error(
                    Code::SecondScore,
                    span,
                    "the score is defined more than once",
                )
                .with_hint("add the terms in one `score = ...;`"),
            );
            return;
        }
        // What the score reads does not make the mask per batch or per head.
        let (uses_b, uses_h) = (self.uses_b, self.uses_h);
        self.uses_h = None;
        let e = self.score_expr(value);
        self.score_h = self.score_h.or(self.uses_h);
        (self.uses_b, self.uses_h) = (uses_b, uses_h);
        let Ok(e) = e else {
            return;
        };
        if e.reads(&|x| matches!(x, IntKind::B)) {
            self.err(
                unsupported(value.span, "the score cannot read the batch index `b`")
                    .with_hint(FORM_HINT),
            );
            return;
        }
        if let Ok(form) = self.normal_form(&e) {
            self.score = Some(ScoreDecl {
                expr: e,
                form,
                span,
            });
        }
    }

    /// `sink = T[h];` with `T` a one-extent tensor, at most once.
    pub(super) fn sink_item(&mut self, value: &Expr, span: Span) {
        if self.sink.is_some() {
            self.err(
                Diagnostic::error(
                    Code::SecondScore,
                    span,
                    "the sink is defined more than once",
                )
                .with_hint("a row's softmax has one sink logit per head"),
            );
            return;
        }
        let hint = "declare `tensor sinks: [num_heads];` and write `sink = sinks[h];`";
        // `T[i][j]...`: the innermost base and the indices, outermost last.
        let mut indices = Vec::new();
        let mut base = value;
        while let ExprKind::Index { base: b, index } = &base.kind {
            indices.push(&**index);
            base = b;
        }
        indices.reverse();
        let ExprKind::Name(n) = &base.kind else {
            self.err(
                unsupported(value.span, "a sink is a tensor indexed by the head, `T[h]`")
                    .with_hint(hint),
            );
            return;
        };
        let tensor = match self.names.get(n) {
            Some((Def::Tensor(t), _)) => *t,
            Some((Def::Failed, _)) => return,
            _ => {
                // What the name is (or the resolver's own error: an unknown name, one used
                // before its definition), so the message says why it is not a tensor.
                let Ok(v) = self.name(n, base.span, Ctx::Score) else {
                    return;
                };
                self.err(
                    unsupported(
                        base.span,
                        format!(
                            "`{n}` is {}, but a sink reads a tensor declared with `tensor`",
                            v.describe()
                        ),
                    )
                    .with_hint(hint),
                );
                return;
            }
        };
        let extents = self.tensors[tensor].dims.len();
        if extents != 1 {
            self.err(
                unsupported(
                    value.span,
                    format!("tensor `{n}` has {extents} extents, but sinks are one logit per head: a one-extent tensor `[num_heads]`, read `{n}[h]`"),
                )
                .with_hint(hint),
            );
            return;
        }
        if indices.len() != 1 {
            self.err(
                unsupported(
                    value.span,
                    format!(
                        "tensor `{n}` has 1 extent but is indexed with {}; a sink reads `{n}[h]`",
                        indices.len()
                    ),
                )
                .with_hint(hint),
            );
            return;
        }
        if !matches!(&indices[0].kind, ExprKind::Name(h) if h == "h") {
            self.err(
                unsupported(
                    indices[0].span,
                    format!("a sink is indexed by the head: `{n}[h]`, one logit per head"),
                )
                .with_hint(hint),
            );
            return;
        }
        self.sink = Some(SinkDecl { tensor, span });
    }

    /// Whether `e` is a float (holds a float literal, `score`, a tensor, `softcap` or
    /// `alibi_slopes`); integer parts are lowered as integers.
    fn floaty(&self, e: &Expr) -> bool {
        match &e.kind {
            ExprKind::Float(_) => true,
            ExprKind::Name(n) => {
                n == RAW_SCORE || matches!(self.names.get(n), Some((Def::Tensor(_), _)))
            }
            ExprKind::Array(xs) => xs.iter().any(|x| self.floaty(x)),
            ExprKind::Unary(UnOp::Neg, a) => self.floaty(a),
            ExprKind::Binary(_, a, b) => self.floaty(a) || self.floaty(b),
            ExprKind::Call { callee, .. } => {
                matches!(&callee.kind, ExprKind::Name(n) if n == "softcap" || n == "alibi_slopes")
            }
            ExprKind::Index { base, .. } => self.floaty(base),
            _ => false,
        }
    }

    /// The score expression `e` as written.
    fn score_expr(&mut self, e: &Expr) -> R<ScoreExpr> {
        let span = e.span;
        if !self.floaty(e) {
            let i = self.expect_int(e, Ctx::Score)?;
            return Ok(expr(ScoreKind::Int(i), span));
        }
        let kind = match &e.kind {
            ExprKind::Float(v) => ScoreKind::Const(*v),
            ExprKind::Name(n) if n == RAW_SCORE => ScoreKind::Raw,
            ExprKind::Unary(UnOp::Neg, a) => ScoreKind::Neg(Box::new(self.score_expr(a)?)),
            ExprKind::Binary(op @ (BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div), a, b) => {
                let op = match op {
                    BinOp::Add => FloatOp::Add,
                    BinOp::Sub => FloatOp::Sub,
                    BinOp::Mul => FloatOp::Mul,
                    _ => FloatOp::Div,
                };
                let a = self.score_expr(a)?;
                let b = self.score_expr(b)?;
                ScoreKind::Bin(op, Box::new(a), Box::new(b))
            }
            ExprKind::Call { callee, args } if matches!(&callee.kind, ExprKind::Name(n) if n == "softcap") =>
            {
                self.arity("softcap", args, 2..=2, span)?;
                let x = self.score_expr(&args[0])?;
                let c = self.score_expr(&args[1])?;
                ScoreKind::Softcap(Box::new(x), Box::new(c))
            }
            ExprKind::Index { base, index } => return self.score_index(base, index, span),
            ExprKind::Name(n) => {
                self.err(
                    unsupported(span, format!("tensor `{n}` is read by indexing it")).with_hint(
                        format!(
                        "`{n}[h][bucket]` or `{n}[bucket]` for a table, `{n}[h]` in `sink = ...;`"
                    ),
                    ),
                );
                return Err(());
            }
            ExprKind::Call { .. } | ExprKind::Array(_) => {
                self.err(
                    Diagnostic::error(Code::TypeMismatch, span, "a float array must be indexed")
                        .with_hint("`alibi_slopes(num_heads)[h]`, `[0.5, 0.25][h]`"),
                );
                return Err(());
            }
            _ => {
                self.err(
                    Diagnostic::error(
                        Code::TypeMismatch,
                        span,
                        "floats take only `+`, `-`, `*` and `/`",
                    )
                    .with_hint(FORM_HINT),
                );
                return Err(());
            }
        };
        Ok(expr(kind, span))
    }

    /// `base[index]` of a float: an entry of a float array, or a tensor entry (a bias table).
    fn score_index(&mut self, base: &Expr, index: &Expr, span: Span) -> R<ScoreExpr> {
        let tensor_of = |c: &Self, e: &Expr| match &e.kind {
            ExprKind::Name(n) => match c.names.get(n) {
                Some((Def::Tensor(t), _)) => Some(*t),
                _ => None,
            },
            _ => None,
        };
        if let Some(t) = tensor_of(self, base) {
            return self.table(t, &[index], span);
        }
        if let ExprKind::Index {
            base: inner,
            index: first,
        } = &base.kind
        {
            if let Some(t) = tensor_of(self, inner) {
                return self.table(t, &[first, index], span);
            }
            if let ExprKind::Index { base: inner, .. } = &inner.kind {
                if tensor_of(self, inner).is_some() {
                    self.err(unsupported(span, SWIN).with_hint(FORM_HINT));
                    return Err(());
                }
            }
        }
        let i = self.expect_int(index, Ctx::Score)?;
        let arr = match &base.kind {
            ExprKind::Call { callee, args } if matches!(&callee.kind, ExprKind::Name(n) if n == "alibi_slopes") =>
            {
                self.arity("alibi_slopes", args, 1..=1, base.span)?;
                FloatArr::Alibi(self.expect_int(&args[0], Ctx::Const)?)
            }
            ExprKind::Array(xs) => {
                let xs: R<Vec<ScoreExpr>> = xs.iter().map(|x| self.score_expr(x)).collect();
                FloatArr::Lit(xs?)
            }
            _ => {
                self.err(
                    Diagnostic::error(
                        Code::TypeMismatch,
                        base.span,
                        "expected a float array or a tensor to index",
                    )
                    .with_hint("`alibi_slopes(num_heads)[h]`, `[0.5, 0.25][h]`, `T[h][bucket]`"),
                );
                return Err(());
            }
        };
        Ok(expr(ScoreKind::Index(arr, i), span))
    }

    /// `T[head][bucket]` or `T[bucket]` of tensor `t`.
    fn table(&mut self, t: TensorId, idx: &[&Expr], span: Span) -> R<ScoreExpr> {
        let name = self.tensors[t].name.clone();
        let extents = self.tensors[t].dims.len();
        if idx.len() != extents {
            self.err(
                unsupported(
                    span,
                    format!(
                        "tensor `{name}` has {extents} extent(s) but is indexed with {}",
                        idx.len()
                    ),
                )
                .with_hint("a table `[num_heads, num_buckets]` is read `T[h][bucket]`, a table `[num_buckets]` `T[bucket]`"),
            );
            return Err(());
        }
        let head = if idx.len() == 2 {
            let h = self.expect_int(idx[0], Ctx::Score)?;
            if h.kind != IntKind::H {
                self.err(
                    unsupported(
                        h.span,
                        format!("the first index of table `{name}` must be the head, `h`"),
                    )
                    .with_hint(FORM_HINT),
                );
                return Err(());
            }
            Some(h)
        } else {
            None
        };
        let bucket = self.bucket(idx[idx.len() - 1])?;
        Ok(expr(
            ScoreKind::Table {
                tensor: t,
                head,
                bucket,
            },
            span,
        ))
    }

    /// A bucket: `t5_bucket(rel, num_buckets, max_distance, bidirectional)` or an integer of
    /// `q - k`.
    fn bucket(&mut self, e: &Expr) -> R<Bucket> {
        if let ExprKind::Call { callee, args } = &e.kind {
            if matches!(&callee.kind, ExprKind::Name(n) if n == "t5_bucket") {
                self.arity("t5_bucket", args, 4..=4, e.span)?;
                let relative = self.distance(&args[0])?;
                let num_buckets = self.expect_int(&args[1], Ctx::Const)?;
                let max_distance = self.expect_int(&args[2], Ctx::Const)?;
                let bidirectional = self.expect_bool(&args[3], Ctx::Const)?;
                return Ok(Bucket::T5 {
                    relative,
                    num_buckets,
                    max_distance,
                    bidirectional,
                    span: e.span,
                });
            }
        }
        Ok(Bucket::Int(self.distance(e)?))
    }

    /// An integer that reads `q` and `k` only as `q - k` or `k - q`, and not `h` or `b`.
    fn distance(&mut self, e: &Expr) -> R<Int> {
        let i = self.expect_int(e, Ctx::Score)?;
        if has_grid_coord(&i) {
            self.err(unsupported(i.span, SWIN).with_hint(FORM_HINT));
            return Err(());
        }
        if let Some(span) = first_leaf(&i, &|x| matches!(x, IntKind::H | IntKind::B)) {
            self.err(
                unsupported(span, "a bucket cannot read `h` or `b`")
                    .with_hint("index a per-head table by the head: `T[h][bucket]`"),
            );
            return Err(());
        }
        if let Err(span) = distance_only(&i) {
            self.err(
                unsupported(span, "a bucket reads `q` and `k` only as `q - k` (or `k - q`)")
                    .with_hint("write the bucket as a function of the distance, e.g. `min(max(q - k, -8), 8) + 8`; `q + 1 - k` is `(q + 1) - k`, write `q - k + 1`"),
            );
            return Err(());
        }
        Ok(i)
    }

    /// The normal form of a checked score expression.
    fn normal_form(&mut self, e: &ScoreExpr) -> R<ScoreForm> {
        let mut terms = Vec::new();
        sum_terms(e, false, &mut terms);
        let mut form = ScoreForm::default();
        let mut raw_seen = false;
        for (neg, t) in terms {
            match &t.kind {
                ScoreKind::Raw | ScoreKind::Softcap(..) => {
                    if neg {
                        self.err(
                            unsupported(t.span, "the raw score is added, not subtracted")
                                .with_hint(FORM_HINT),
                        );
                        return Err(());
                    }
                    if raw_seen {
                        self.err(
                            unsupported(t.span, "the raw `score` appears more than once")
                                .with_hint(FORM_HINT),
                        );
                        return Err(());
                    }
                    raw_seen = true;
                    if let ScoreKind::Softcap(x, c) = &t.kind {
                        if x.kind != ScoreKind::Raw {
                            self.err(
                                unsupported(
                                    x.span,
                                    "softcap applies to the raw score: `softcap(score, c)`",
                                )
                                .with_hint(FORM_HINT),
                            );
                            return Err(());
                        }
                        if is_raw(c)
                            || is_table(c)
                            || c.reads(&|x| matches!(x, IntKind::Q | IntKind::K | IntKind::H))
                        {
                            self.err(unsupported(
                                c.span,
                                "the softcap is a constant: it reads lengths and parameters only",
                            ));
                            return Err(());
                        }
                        form.softcap = Some((**c).clone());
                    }
                }
                ScoreKind::Table {
                    tensor,
                    head,
                    bucket,
                } => {
                    if neg {
                        self.err(unsupported(
                            t.span,
                            "a bias table is added, not subtracted: `score + T[h][bucket]`",
                        ));
                        return Err(());
                    }
                    if form.table.is_some() {
                        self.err(
                            unsupported(t.span, "a score reads at most one bias table")
                                .with_hint(FORM_HINT),
                        );
                        return Err(());
                    }
                    form.table = Some(TableForm {
                        tensor: *tensor,
                        per_head: head.is_some(),
                        bucket: bucket.clone(),
                        span: t.span,
                    });
                }
                _ => {
                    let linear = self.linear_term(neg, t)?;
                    let free = |l: &LinearForm| const_zero(&l.q_coef) && const_zero(&l.k_coef);
                    // Terms without positions (`+ 0.5 - h`) add up into one.
                    if let Some(old) = form.linear.take_if(|old| free(old) && free(&linear)) {
                        let span = old.span.to(linear.span);
                        let slope = |l: LinearForm| {
                            let span = l.slope.span;
                            let off = expr(ScoreKind::Int(l.offset), span);
                            expr(
                                ScoreKind::Bin(FloatOp::Mul, Box::new(l.slope), Box::new(off)),
                                span,
                            )
                        };
                        form.linear = Some(LinearForm {
                            slope: expr(
                                ScoreKind::Bin(
                                    FloatOp::Add,
                                    Box::new(slope(old)),
                                    Box::new(slope(linear)),
                                ),
                                span,
                            ),
                            q_coef: Int::constant(0, span),
                            k_coef: Int::constant(0, span),
                            offset: Int::constant(1, span),
                            span,
                        });
                        continue;
                    }
                    if let Some(old) = form
                        .linear
                        .as_ref()
                        .filter(|old| free(old) || free(&linear))
                    {
                        let span = if free(&linear) { linear.span } else { old.span };
                        self.err(unsupported(span, "a constant beside a bias that reads q or k is not supported yet")
                            .with_hint("a constant added to every logit of a head changes only the row's lse (and its weight against a sink); drop it, or fold it into the positions: `0.5 * (q - k) + 0.5` is `0.5 * (q - k + 1)`"));
                        return Err(());
                    }
                    if form.linear.is_some() {
                        self.err(unsupported(t.span, "a score has at most one bias linear in q and k")
                            .with_hint("combine them into one `coefficient * (a*q + b*k + c)`: `-m[h] * q + m[h] * k` is `-m[h] * (q - k)`"));
                        return Err(());
                    }
                    form.linear = Some(linear);
                }
            }
        }
        if !raw_seen {
            self.err(
                unsupported(e.span, "the score does not read the raw `score`").with_hint(
                    "write `score = score + ...;` or `score = softcap(score, c) + ...;`",
                ),
            );
            return Err(());
        }
        Ok(form)
    }

    /// A term `coefficient * affine(q, k)` (negated when `neg`).
    fn linear_term(&mut self, neg: bool, t: &ScoreExpr) -> R<LinearForm> {
        let mut factors = Vec::new();
        let mut neg = neg;
        product_factors(t, false, &mut neg, &mut factors);
        let mut position: Option<&Int> = None;
        let mut slope: Option<ScoreExpr> = None;
        for (divide, f) in factors {
            if is_raw(f) {
                self.err(unsupported(f.span, "the raw score is not scaled or multiplied: it is `score` or `softcap(score, c)`").with_hint(FORM_HINT));
                return Err(());
            }
            if is_table(f) {
                self.err(
                    unsupported(
                        f.span,
                        "a bias table is added as it is, not scaled or multiplied",
                    )
                    .with_hint(FORM_HINT),
                );
                return Err(());
            }
            if score_reads_qk(f) {
                match (&f.kind, divide, position) {
                    (ScoreKind::Int(i), false, None) => position = Some(i),
                    (ScoreKind::Int(_), false, Some(_)) => {
                        self.err(unsupported(f.span, "a bias is linear in q and k: this is a product of two position terms").with_hint(FORM_HINT));
                        return Err(());
                    }
                    _ => {
                        self.err(unsupported(f.span, "the positions of a bias form one integer expression affine in q and k, times a coefficient").with_hint(FORM_HINT));
                        return Err(());
                    }
                }
                continue;
            }
            slope = Some(match (slope, divide) {
                (None, false) => f.clone(),
                (None, true) => expr(
                    ScoreKind::Bin(FloatOp::Div, Box::new(one(f.span)), Box::new(f.clone())),
                    f.span,
                ),
                (Some(s), d) => {
                    let span = s.span.to(f.span);
                    let op = if d { FloatOp::Div } else { FloatOp::Mul };
                    expr(ScoreKind::Bin(op, Box::new(s), Box::new(f.clone())), span)
                }
            });
        }
        let mut slope = slope.unwrap_or_else(|| one(t.span));
        // An integer product (`h * (q - k)`): its factors without positions join the slope.
        let mut owned = None;
        if let Some(i) = position {
            let (coefs, pos, flip) = split_int_product(i);
            for c in coefs {
                let span = slope.span.to(c.span);
                let c = expr(ScoreKind::Int(c), span);
                slope = expr(
                    ScoreKind::Bin(FloatOp::Mul, Box::new(slope), Box::new(c)),
                    span,
                );
            }
            neg ^= flip;
            owned = Some(pos);
        }
        if neg {
            let span = slope.span;
            slope = expr(ScoreKind::Neg(Box::new(slope)), span);
        }
        let (q_coef, k_coef, offset) = match &owned {
            Some(i) => self.affine(i)?,
            None => (
                Int::constant(0, t.span),
                Int::constant(0, t.span),
                Int::constant(1, t.span),
            ),
        };
        for c in [&q_coef, &k_coef, &offset] {
            if let Some(span) = first_leaf(c, &|x| matches!(x, IntKind::H | IntKind::B)) {
                self.err(
                    unsupported(span, "the position part of a bias cannot read `h`").with_hint(
                        "per-head values go into the coefficient: `slopes[h] * (q - k)`",
                    ),
                );
                return Err(());
            }
        }
        Ok(LinearForm {
            slope,
            q_coef,
            k_coef,
            offset,
            span: t.span,
        })
    }

    /// `i` as `q_coef * q + k_coef * k + offset`, the three reading neither `q` nor `k`.
    fn affine(&mut self, i: &Int) -> R<(Int, Int, Int)> {
        crate::deep(|| self.affine_here(i))
    }

    fn affine_here(&mut self, i: &Int) -> R<(Int, Int, Int)> {
        let zero = || Int::constant(0, i.span);
        let one = || Int::constant(1, i.span);
        if !reads_qk(i) {
            return Ok((zero(), zero(), i.clone()));
        }
        let scale = |x: &Int, (a, b, c): (Int, Int, Int)| {
            (
                bin(IntOp::Mul, x.clone(), a),
                bin(IntOp::Mul, x.clone(), b),
                bin(IntOp::Mul, x.clone(), c),
            )
        };
        match &i.kind {
            IntKind::Q => Ok((one(), zero(), zero())),
            IntKind::K => Ok((zero(), one(), zero())),
            IntKind::Neg(a) => {
                let (x, y, z) = self.affine(a)?;
                let neg = |v: Int| Int::new(IntKind::Neg(Box::new(v)), i.span);
                Ok((neg(x), neg(y), neg(z)))
            }
            IntKind::Bin(op @ (IntOp::Add | IntOp::Sub), a, b) => {
                let (a, b) = (self.affine(a)?, self.affine(b)?);
                Ok((bin(*op, a.0, b.0), bin(*op, a.1, b.1), bin(*op, a.2, b.2)))
            }
            IntKind::Bin(IntOp::Mul, a, b) if !reads_qk(a) => Ok(scale(a, self.affine(b)?)),
            IntKind::Bin(IntOp::Mul, a, b) if !reads_qk(b) => Ok(scale(b, self.affine(a)?)),
            IntKind::Bin(IntOp::Mul, ..) => {
                self.err(
                    unsupported(
                        i.span,
                        "a bias is linear in q and k: this is a product of two position terms",
                    )
                    .with_hint(FORM_HINT),
                );
                Err(())
            }
            IntKind::Abs(_) => {
                self.err(
                    unsupported(i.span, "`abs` of positions is not linear in q and k")
                        .with_hint("a bias is affine in q and k; where the mask is causal, `abs(q - k)` is `q - k`"),
                );
                Err(())
            }
            _ => {
                self.err(unsupported(i.span, "this is not affine in q and k").with_hint(FORM_HINT));
                Err(())
            }
        }
    }
}

/// Whether `i` is the literal 0 (a coefficient of a term without that position).
fn const_zero(i: &Int) -> bool {
    super::atoms::const_value(i) == Some(0)
}

fn one(span: Span) -> ScoreExpr {
    expr(ScoreKind::Const(FloatBits::new(1.0)), span)
}

/// The terms of a sum, each with whether it is subtracted.
fn sum_terms<'e>(e: &'e ScoreExpr, neg: bool, out: &mut Vec<(bool, &'e ScoreExpr)>) {
    match &e.kind {
        ScoreKind::Bin(FloatOp::Add, a, b) => {
            sum_terms(a, neg, out);
            sum_terms(b, neg, out);
        }
        ScoreKind::Bin(FloatOp::Sub, a, b) => {
            sum_terms(a, neg, out);
            sum_terms(b, !neg, out);
        }
        ScoreKind::Neg(a) => sum_terms(a, !neg, out),
        _ => out.push((neg, e)),
    }
}

/// The factors of a product, each with whether it divides; negations toggle `neg`; an
/// integer product is split too (`h * (q - k)`), as far as its factors do not read both.
fn product_factors<'e>(
    e: &'e ScoreExpr,
    divide: bool,
    neg: &mut bool,
    out: &mut Vec<(bool, &'e ScoreExpr)>,
) {
    match &e.kind {
        ScoreKind::Bin(FloatOp::Mul, a, b) if !divide => {
            product_factors(a, false, neg, out);
            product_factors(b, false, neg, out);
        }
        ScoreKind::Bin(FloatOp::Div, a, b) if !divide => {
            product_factors(a, false, neg, out);
            out.push((true, b));
        }
        ScoreKind::Neg(a) => {
            *neg = !*neg;
            product_factors(a, divide, neg, out);
        }
        _ => out.push((divide, e)),
    }
}

/// `i` as `c1 * c2 * ... * p` (negated when the flag is set), the `c`s reading neither `q`
/// nor `k`.
fn split_int_product(i: &Int) -> (Vec<Int>, Int, bool) {
    crate::deep(|| match &i.kind {
        IntKind::Bin(IntOp::Mul, a, b) if !reads_qk(a) => {
            let (mut c, p, f) = split_int_product(b);
            c.insert(0, (**a).clone());
            (c, p, f)
        }
        IntKind::Bin(IntOp::Mul, a, b) if !reads_qk(b) => {
            let (mut c, p, f) = split_int_product(a);
            c.push((**b).clone());
            (c, p, f)
        }
        IntKind::Neg(a) => {
            let (c, p, f) = split_int_product(a);
            (c, p, !f)
        }
        _ => (Vec::new(), i.clone(), false),
    })
}

/// The span of the first leaf of `i` for which `leaf` holds.
fn first_leaf(i: &Int, leaf: &impl Fn(&IntKind) -> bool) -> Option<Span> {
    crate::deep(|| first_leaf_here(i, leaf))
}

fn first_leaf_here(i: &Int, leaf: &impl Fn(&IntKind) -> bool) -> Option<Span> {
    if !i.mentions(leaf) {
        return None;
    }
    if leaf(&i.kind) {
        return Some(i.span);
    }
    let mut found = None;
    crate::score::visit_children(i, &mut |c| {
        if found.is_none() {
            found = first_leaf(c, leaf);
        }
    });
    found.or(Some(i.span))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{error, error_diag, program};
    use crate::score::{Bucket, ScoreKind};

    /// The normal forms of the scores the built-ins and docs use.
    #[test]
    fn scores_take_their_normal_form() {
        let p = program("mask = k <= q;\nscore = score - alibi_slopes(num_heads)[h] * (q - k);");
        let f = &p.score.as_ref().unwrap().form;
        assert!(f.softcap.is_none() && f.table.is_none());
        let l = f.linear.as_ref().unwrap();
        assert!(matches!(l.slope.kind, ScoreKind::Neg(_)), "{:?}", l.slope);
        assert!(
            !p.uses_h,
            "the score reading h does not make the mask per head"
        );
        let p = program("param cap: int = 50;\nmask = k <= q;\nscore = softcap(score, cap);");
        let f = &p.score.as_ref().unwrap().form;
        assert!(f.softcap.is_some() && f.linear.is_none());
        let p = program(
            "tensor rel: [num_heads, 32];\nmask = k < kv_len;\n\
             score = score + rel[h][t5_bucket(k - q, 32, 128, true)];",
        );
        let t = p.score.as_ref().unwrap().form.table.as_ref().unwrap();
        assert!(t.per_head && matches!(t.bucket, Bucket::T5 { .. }));
        let p = program(
            "tensor rel: [17];\nmask = k <= q;\n\
             score = 2.0 * (q - k) * 0.5 + rel[min(max(q - k, -8), 8) + 8] + softcap(score, 30.0);",
        );
        let f = &p.score.as_ref().unwrap().form;
        assert!(f.softcap.is_some() && f.linear.is_some());
        assert!(!f.table.as_ref().unwrap().per_head);
        let p = program("tensor sinks: [num_heads];\nmask = k <= q;\nsink = sinks[h];");
        assert!(p.sink.is_some() && p.score.is_none());
        // An integer slope per head, `h` split off the integer product.
        program("mask = k <= q;\nscore = score - (h + 1) * (q - k);");
        program("mask = k <= q;\nscore = score - h * (q - k);");
    }

    #[test]
    fn scores_outside_the_form_are_refused() {
        let mut bad = Vec::new();
        for (src, message) in [
            ("score = score * 2.0;", "the raw score is not scaled or multiplied: it is `score` or `softcap(score, c)`"),
            ("score = 1.0 - score;", "the raw score is added, not subtracted"),
            ("score = score + score;", "the raw `score` appears more than once"),
            ("score = (q - k) * 0.5;", "the score does not read the raw `score`"),
            ("score = softcap(score + 1.0, 5.0);", "softcap applies to the raw score: `softcap(score, c)`"),
            ("score = softcap(score, q + 1);", "the softcap is a constant: it reads lengths and parameters only"),
            ("score = score + (q - k) * (q - k);", "a bias is linear in q and k: this is a product of two position terms"),
            ("score = score + 0.5 * q + 0.25 * k;", "a score has at most one bias linear in q and k"),
            ("score = score + 0.5 * (q - k) + 0.5;", "a constant beside a bias that reads q or k is not supported yet"),
            ("score = score - h + alibi_slopes(num_heads)[h] * (q - k);", "a constant beside a bias that reads q or k is not supported yet"),
            ("score = score + abs(q - k) * 0.5;", "`abs` of positions is not linear in q and k"),
            ("score = score + 1.0 / (q - k);", "the positions of a bias form one integer expression affine in q and k, times a coefficient"),
            ("score = score + (q - k) / 2 * 0.5;", "this is not affine in q and k"),
            ("score = score + 0.5 * (q - k + h);", "the position part of a bias cannot read `h`"),
            ("score = score + b * 1.0;", "the score cannot read the batch index `b`"),
            ("tensor t: [8];\nscore = score + t[q - k + 1 - k];", "a bucket reads `q` and `k` only as `q - k` (or `k - q`)"),
            ("tensor t: [8];\nscore = score + t[h];", "a bucket cannot read `h` or `b`"),
            ("tensor t: [num_heads, 8];\nscore = score + t[0][q - k];", "the first index of table `t` must be the head, `h`"),
            ("tensor t: [num_heads, 8];\nscore = score + t[q - k];", "tensor `t` has 2 extent(s) but is indexed with 1"),
            ("tensor t: [8];\nscore = score + t[0] + t[1];", "a score reads at most one bias table"),
            ("tensor t: [8];\nscore = score - t[0];", "a bias table is added, not subtracted: `score + T[h][bucket]`"),
            ("tensor t: [8];\nscore = score + 2.0 * t[0];", "a bias table is added as it is, not scaled or multiplied"),
            ("tensor t: [4, 4, 4];\nscore = score;", "tensor `t` has 3 extents; expected 1 or 2"),
            ("tensor t: [4, 4];\nscore = score + t[h][q - k][0];", "bias tables indexed by two relative coordinates (Swin's 2D relative positions on a grid) are not supported yet"),
            ("grid g = [4, 4];\ntensor t: [num_heads, 49];\nscore = score + t[h][(g.y(q) - g.y(k) + 3) * 7 + g.x(q) - g.x(k) + 3];", "bias tables indexed by two relative coordinates (Swin's 2D relative positions on a grid) are not supported yet"),
            ("tensor t: [8];\nscore = score + t;", "tensor `t` is read by indexing it"),
            ("tensor s: [num_heads];\nsink = s[0];", "a sink is indexed by the head: `s[h]`, one logit per head"),
            ("tensor s: [num_heads];\nsink = s[h][0];", "tensor `s` has 1 extent but is indexed with 2; a sink reads `s[h]`"),
            ("tensor s: [num_heads];\nsink = s;", "tensor `s` has 1 extent but is indexed with 0; a sink reads `s[h]`"),
            ("tensor s: [num_heads, 2];\nsink = s[h];", "tensor `s` has 2 extents, but sinks are one logit per head: a one-extent tensor `[num_heads]`, read `s[h]`"),
            ("tensor S: [num_heads, 2];\nsink = S[h][0];", "tensor `S` has 2 extents, but sinks are one logit per head: a one-extent tensor `[num_heads]`, read `S[h]`"),
            ("param s: [int] = [1];\nsink = s[h];", "`s` is an integer array, but a sink reads a tensor declared with `tensor`"),
            ("param U: int = 1;\nsink = U[h];", "`U` is an integer, but a sink reads a tensor declared with `tensor`"),
            ("segments u = [2, 2];\nsink = u[h];", "`u` is a segmentation, but a sink reads a tensor declared with `tensor`"),
            ("sink = num_heads[h];", "`num_heads` is an integer, but a sink reads a tensor declared with `tensor`"),
            ("sink = 1.5;", "a sink is a tensor indexed by the head, `T[h]`"),
            ("sink = (1.5)[h];", "a sink is a tensor indexed by the head, `T[h]`"),
        ] {
            let full = format!("mask = k <= q;\n{src}");
            let got = error(&full);
            if got != ("CM0212", message.to_string()) {
                bad.push(format!("{src}: {got:?}"));
            }
        }
        for (src, code, message) in [
            ("score = score;\nscore = score;", "CM0213", "the score is defined more than once"),
            ("tensor s: [num_heads];\nsink = s[h];\nsink = s[h];", "CM0213", "the sink is defined more than once"),
            ("param w: int = 1.5;", "CM0203", "float `1.5` where an integer is expected"),
            ("let x = score;\nscore = x;", "CM0208", "`score`, the raw score of a pair, is a float: only the `score` statement reads it"),
            ("tensor t: [4];\nparam n: int = t[0];", "CM0208", "tensor `t` holds floats: only the `score` and `sink` statements read it"),
            ("param w: int = t5_bucket(1, 32, 128, true);", "CM0208", "`t5_bucket` can only be used as the bucket of a bias table, `T[h][t5_bucket(k - q, 32, 128, true)]`, in the `score` statement"),
            ("param score: int = 1;", "CM0202", "`score` is a built-in name and cannot be redefined"),
            ("score = score + [0.5, 0.25];", "CM0203", "a float array must be indexed"),
            ("score = score + (q < k) * 1.0;", "CM0203", "expected an integer, found a boolean"),
            ("score = softcap(score);", "CM0204", "`softcap` takes 2 argument(s), found 1"),
            // The score statement and the sink statement say the same of an unknown name.
            ("sink = U[h];", "CM0201", "unknown name `U`"),
            ("score = score + U[h];", "CM0201", "unknown name `U`"),
            ("sink = s[h];\ntensor s: [num_heads];", "CM0201", "unknown name `s`"),
            ("score = score + s[0];\ntensor s: [4];", "CM0201", "unknown name `s`"),
        ] {
            let full = format!("mask = k <= q;\n{src}");
            let d = error_diag(&full);
            if (d.code.as_str(), d.message.as_str()) != (code, message) {
                bad.push(format!("{src}: {:?} {}", d.code, d.message));
            }
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }
}
