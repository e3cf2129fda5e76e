//! The checker: resolves names, checks types and contexts, inlines `let`s and normalises
//! comparisons with `k` into the solvable atoms of [`Region`]. Every problem becomes a
//! diagnostic (`CM02xx`); nothing here panics.

use crate::ir::*;
use cm_syntax::ast::{self, BinOp, CmpOp, ExprKind, Item, MsgPiece, SegSpec, UnOp};
use cm_syntax::{Diagnostic, Span};
use std::collections::HashMap;

/// Built-in names that are values.
const BUILTIN_VALUES: &[&str] = &[
    "q",
    "k",
    "b",
    "h",
    "q_len",
    "kv_len",
    "batch",
    "num_heads",
    "trace_context",
    "trace_generated",
    "len",
];
/// Built-in functions.
const BUILTIN_FUNCS: &[&str] = &[
    "min",
    "max",
    "abs",
    "isqrt",
    "sum",
    "count",
    "l1",
    "l2",
    "linf",
    "box",
    "elementwise",
];

#[derive(Clone)]
enum Def {
    /// A declaration whose own check failed: uses are errors already reported.
    Failed,
    Param(ParamId, bool),
    Let(usize),
    Seg(SegId),
    Grid(GridId),
}

/// Where an expression is being lowered: what it may read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ctx {
    /// Parameter defaults, segmentations, grids, requirements: lengths and parameters only.
    Const,
    /// A `part` range: like `Const`, plus `len`.
    Part,
    /// The mask: also `q`, `k`, `b`, `h`.
    Mask,
    /// Inside `elementwise(...)`: `k` may appear anywhere.
    Elementwise,
}

enum Val {
    Int(Int),
    Bool(Bool, Span),
    Region(Region, Span),
    Range(RangeE),
    Arr(Arr, Span),
    Seg(SegId, Span),
    Grid(GridId, Span),
    Dist(GridId, Metric, Span),
    SegIndexFn(SegId, Span),
    PartFn(SegId, usize, Span),
    PieceFn(SegId, usize, Span),
    AxisFn(GridId, u8, Span),
}

impl Val {
    fn span(&self) -> Span {
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
            | Val::AxisFn(_, _, s) => *s,
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Val::Int(_) => "an integer",
            Val::Bool(..) => "a boolean",
            Val::Region(..) => "a region of (q, k) pairs",
            Val::Range(_) => "a range",
            Val::Arr(..) => "an integer array",
            Val::Seg(..) => "a segmentation",
            Val::Grid(..) => "a grid",
            Val::Dist(..) => "a grid distance",
            Val::SegIndexFn(..) | Val::PartFn(..) | Val::PieceFn(..) | Val::AxisFn(..) => {
                "a function"
            }
        }
    }
}

type R<T> = Result<T, ()>;

struct Checker<'a> {
    diags: Vec<Diagnostic>,
    names: HashMap<String, (Def, Span)>,
    /// Each `let`: its body, whether it was used, and its item index.
    lets: Vec<(&'a ast::Expr, bool, usize)>,
    params: Vec<ParamDecl>,
    segs: Vec<SegDecl>,
    grids: Vec<GridDecl>,
    /// Where the batch index `b` / the head index `h` is first read.
    uses_b: Option<Span>,
    uses_h: Option<Span>,
    /// Whether each parameter is read.
    params_read: Vec<bool>,
    /// Each `let`'s expression depth with the `let`s it uses inlined ([`Checker::inlined_depth`]).
    let_depths: Vec<u32>,
    /// The item each name was declared in: a name is visible only in later items.
    declared_at: HashMap<String, usize>,
    /// Index of the item being checked (or of the `let` whose body is being lowered).
    visible_before: usize,
    /// IR nodes built so far, bounded so `let` chains cannot blow up exponentially.
    nodes: usize,
}

/// Most IR nodes a program may lower to (after inlining `let`s).
const MAX_NODES: usize = 200_000;

/// Deepest expression a `let` may stand for once the `let`s it uses are inlined: 64 times
/// the parser's nesting limit, so checking, binding and planning (which recurse over
/// expressions) keep to a bounded stack, while a chain of a thousand `let`s that each add
/// one term (`let u2 = u1 | t2;`) fits.
pub const MAX_INLINED_DEPTH: u32 = 8192;

/// [`Checker::inlined_depth`] of an expression that names a failed definition.
const POISONED: u32 = u32::MAX;

/// The span of the default expression of the `param` item `idx`.
fn default_expr_span(program: &ast::Program, idx: usize) -> Span {
    match &program.items[idx] {
        Item::Param {
            default: Some(e), ..
        } => e.span,
        _ => Span::default(),
    }
}

/// Calls `f` on each direct operand of `e`.
fn each_operand<'e>(e: &'e ast::Expr, f: &mut impl FnMut(&'e ast::Expr)) {
    match &e.kind {
        ExprKind::Int(_) | ExprKind::Bool(_) | ExprKind::Error | ExprKind::Name(_) => {}
        ExprKind::Array(xs) => xs.iter().for_each(f),
        ExprKind::Unary(_, a) | ExprKind::Field { base: a, .. } => f(a),
        ExprKind::Binary(_, a, b)
        | ExprKind::Range { lo: a, hi: b, .. }
        | ExprKind::In { elem: a, range: b }
        | ExprKind::Index { base: a, index: b } => {
            f(a);
            f(b);
        }
        ExprKind::Compare { first, rest } => {
            f(first);
            rest.iter().for_each(|(_, x)| f(x));
        }
        ExprKind::Call { callee, args } => {
            f(callee);
            args.iter().for_each(f);
        }
        ExprKind::If { cond, then, els } => {
            f(cond);
            f(then);
            f(els);
        }
    }
}

/// Checks a parsed program. Returns the IR when there are no errors, and every diagnostic
/// (warnings included) either way.
pub fn check(program: &ast::Program) -> (Option<Program>, Vec<Diagnostic>) {
    let mut c = Checker {
        diags: Vec::new(),
        names: HashMap::new(),
        lets: Vec::new(),
        params: Vec::new(),
        segs: Vec::new(),
        grids: Vec::new(),
        uses_b: None,
        uses_h: None,
        params_read: Vec::new(),
        let_depths: Vec::new(),
        declared_at: HashMap::new(),
        visible_before: 0,
        nodes: 0,
    };
    let mut requires = Vec::new();
    let mut mask: Option<(Region, Span)> = None;
    for (idx, item) in program.items.iter().enumerate() {
        c.visible_before = idx;
        match item {
            Item::Param {
                name,
                ty,
                default,
                span,
            } => {
                if !c.declare(name, Def::Failed) {
                    continue;
                }
                let id = c.params.len();
                let default_val = default.as_ref().and_then(|e| c.lower(e, Ctx::Const).ok());
                let (is_array, default) = match (ty, default_val) {
                    (_, None) if default.is_some() => continue,
                    (Some(ast::ParamType::Int) | None, Some(Val::Int(i))) => {
                        (false, Some(ParamDefault::Int(i)))
                    }
                    (Some(ast::ParamType::IntArray) | None, Some(Val::Arr(a, _))) => {
                        (true, Some(ParamDefault::Array(a)))
                    }
                    (Some(t), None) => (*t == ast::ParamType::IntArray, None),
                    (None, None) => {
                        c.err(
                            Diagnostic::error(
                                "CM0203",
                                name.span,
                                format!("parameter `{}` needs a type or a default", name.name),
                            )
                            .with_hint(
                                "write `param n: int;`, `param lens: [int];` or give a default",
                            ),
                        );
                        continue;
                    }
                    (ty, Some(v)) => {
                        let want = if *ty == Some(ast::ParamType::IntArray) {
                            "an integer array"
                        } else {
                            "an integer"
                        };
                        c.err(Diagnostic::error(
                            "CM0203",
                            v.span(),
                            format!(
                                "default of `{}` is {}, expected {want}",
                                name.name,
                                v.describe()
                            ),
                        ));
                        continue;
                    }
                };
                c.names
                    .insert(name.name.clone(), (Def::Param(id, is_array), name.span));
                c.params_read.push(false);
                c.params.push(ParamDecl {
                    name: name.name.clone(),
                    read: false,
                    is_array,
                    default_span: default.as_ref().map(|_| default_expr_span(program, idx)),
                    default,
                    span: *span,
                });
            }
            Item::Let { name, value, .. } => {
                // Measured before declaring, so a use of the name inside is not this let.
                let depth = c.inlined_depth(value);
                if depth == POISONED {
                    // It uses a name that failed (already reported): so does every use.
                    c.declare(name, Def::Failed);
                    continue;
                }
                if depth > MAX_INLINED_DEPTH {
                    // Reported once, here; uses of the name then fail silently.
                    c.err(
                        Diagnostic::error(
                            "CM0105",
                            name.span,
                            format!("`{}` nests too deeply: with the `let`s it uses inlined, its expression is {depth} levels deep (at most {MAX_INLINED_DEPTH})", name.name),
                        )
                        .with_hint("a long chain of `let`s that each use the previous one adds up; join terms in groups (`let g1 = t1 | ... | t100;`) and combine the groups"),
                    );
                    c.mark_used(value);
                    c.declare(name, Def::Failed);
                    continue;
                }
                let id = c.lets.len();
                if c.declare(name, Def::Let(id)) {
                    c.lets.push((value, false, idx));
                    c.let_depths.push(depth);
                }
            }
            Item::Segments {
                name,
                spec,
                fill,
                span,
            } => {
                if !c.declare(name, Def::Failed) {
                    continue;
                }
                let kind = match spec {
                    SegSpec::Plain(e) => match c.expect_arr(e, Ctx::Const) {
                        Ok(a) => SegKind::Plain(a),
                        Err(()) => continue,
                    },
                    SegSpec::Composite(pieces) => {
                        let mut out: Vec<PieceDecl> = Vec::new();
                        for p in pieces {
                            if out.iter().any(|o| o.name == p.name.name) {
                                c.err(Diagnostic::error(
                                    "CM0202",
                                    p.name.span,
                                    format!("piece `{}` is declared twice", p.name.name),
                                ));
                                continue;
                            }
                            let Ok(lengths) = c.expect_arr(&p.lengths, Ctx::Const) else {
                                continue;
                            };
                            let count = match &p.count {
                                Some(e) => match c.expect_int(e, Ctx::Const) {
                                    Ok(i) => i,
                                    Err(()) => continue,
                                },
                                None => Int::constant(1, p.name.span),
                            };
                            out.push(PieceDecl {
                                name: p.name.name.clone(),
                                lengths,
                                count,
                                span: p.name.span.to(p.lengths.span),
                            });
                        }
                        SegKind::Composite(out)
                    }
                };
                let fill = match fill {
                    Some(e) => match c.expect_int(e, Ctx::Const) {
                        Ok(i) => i,
                        Err(()) => continue,
                    },
                    None => Int::new(IntKind::QLen, name.span),
                };
                c.names
                    .insert(name.name.clone(), (Def::Seg(c.segs.len()), name.span));
                c.segs.push(SegDecl {
                    name: name.name.clone(),
                    kind,
                    fill,
                    parts: Vec::new(),
                    span: *span,
                });
            }
            Item::Part {
                seg,
                name,
                range,
                span,
            } => {
                let Some(sid) = c.lookup_seg(seg) else {
                    continue;
                };
                let taken = c.segs[sid].parts.iter().any(|p| p.name == name.name)
                    || matches!(&c.segs[sid].kind, SegKind::Composite(ps) if ps.iter().any(|p| p.name == name.name))
                    || ["index", "count"].contains(&name.name.as_str());
                if taken {
                    c.err(Diagnostic::error(
                        "CM0202",
                        name.span,
                        format!("`{}.{}` is already defined", seg.name, name.name),
                    ));
                    continue;
                }
                let Ok(r) = c.expect_range(range, Ctx::Part) else {
                    continue;
                };
                let RangeKind::Lit(lo, hi) = r.kind else {
                    c.err(
                        Diagnostic::error(
                            "CM0203",
                            range.span,
                            "a part is a range `lo..hi` in segment-local positions",
                        )
                        .with_hint("for example `part user.targets = len - 8 .. len;`"),
                    );
                    continue;
                };
                c.segs[sid].parts.push(PartDecl {
                    name: name.name.clone(),
                    lo,
                    hi,
                    span: *span,
                });
            }
            Item::Grid {
                name,
                dims,
                at,
                span,
            } => {
                if !c.declare(name, Def::Failed) {
                    continue;
                }
                if dims.len() != 2 && dims.len() != 3 {
                    c.err(
                        Diagnostic::error(
                            "CM0204",
                            *span,
                            format!("a grid has 2 or 3 dimensions, found {}", dims.len()),
                        )
                        .with_hint("`grid img = [h, w] at offset;` or `grid video = [t, h, w];`"),
                    );
                    continue;
                }
                let dims: R<Vec<Int>> = dims.iter().map(|d| c.expect_int(d, Ctx::Const)).collect();
                let at = match at {
                    Some(e) => c.expect_int(e, Ctx::Const),
                    None => Ok(Int::constant(0, name.span)),
                };
                let (Ok(dims), Ok(at)) = (dims, at) else {
                    continue;
                };
                c.names
                    .insert(name.name.clone(), (Def::Grid(c.grids.len()), name.span));
                c.grids.push(GridDecl {
                    name: name.name.clone(),
                    dims,
                    at,
                    span: *span,
                });
            }
            Item::Require {
                cond: cond_expr,
                message,
                ..
            } => {
                let Ok(cond) = c.expect_bool(cond_expr, Ctx::Const) else {
                    continue;
                };
                let mut parts = Vec::new();
                for piece in message {
                    match piece {
                        MsgPiece::Text(t) => parts.push(MsgPart::Text(t.clone())),
                        MsgPiece::Expr(e) => {
                            if let Ok(i) = c.expect_int(e, Ctx::Const) {
                                parts.push(MsgPart::Value(i));
                            }
                        }
                    }
                }
                requires.push(Require {
                    cond,
                    message: parts,
                    span: cond_expr.span,
                });
            }
            Item::Mask { value, span } => {
                if mask.is_some() {
                    c.err(
                        Diagnostic::error("CM0210", *span, "the mask is defined more than once")
                            .with_hint(
                                "combine regions with `|`, `&` and `-` in a single `mask = ...;`",
                            ),
                    );
                    continue;
                }
                if let Ok(r) = c.lower(value, Ctx::Mask).and_then(|v| c.region_of(v)) {
                    mask = Some((r.balanced(), *span));
                }
            }
        }
    }
    // A `let` nobody uses is still checked (as if used in the mask), so its errors show.
    // Last first: checking a `let` checks (and marks used) the earlier ones it names, so a
    // chain of unused `let`s is checked once, not once per link.
    let (uses_b, uses_h) = (c.uses_b, c.uses_h);
    for id in (0..c.lets.len()).rev() {
        let (body, used, idx) = c.lets[id];
        if !used {
            c.visible_before = idx;
            let _ = c.lower(body, Ctx::Mask);
        }
    }
    (c.uses_b, c.uses_h) = (uses_b, uses_h);
    let has_errors = c.diags.iter().any(Diagnostic::is_error);
    // Unused-`let` warnings only make sense when every use was checked.
    if !has_errors {
        for item in &program.items {
            if let Item::Let { name, .. } = item {
                if let Some((Def::Let(id), _)) = c.names.get(&name.name) {
                    if !c.lets[*id].1 {
                        c.diags.push(Diagnostic::warning(
                            "CM0250",
                            name.span,
                            format!("`{}` is never used", name.name),
                        ));
                    }
                }
            }
        }
    }
    c.diags.sort_by_key(|d| (d.span.start, d.span.end));
    let Some((mask, mask_span)) = mask else {
        if !has_errors {
            c.diags.push(
                Diagnostic::error("CM0205", Span::new(0, 0), "the program defines no mask")
                    .with_hint("end the program with `mask = <region>;`, e.g. `mask = k <= q;`"),
            );
        }
        return (None, c.diags);
    };
    if has_errors {
        return (None, c.diags);
    }
    for (p, read) in c.params.iter_mut().zip(&c.params_read) {
        p.read = *read;
    }
    let program = Program {
        params: c.params,
        segs: c.segs,
        grids: c.grids,
        requires,
        mask,
        mask_span,
        uses_b: c.uses_b.is_some(),
        uses_h: c.uses_h.is_some(),
        b_span: c.uses_b,
        h_span: c.uses_h,
    };
    (Some(program), c.diags)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The closest candidate within a small edit distance, for "did you mean" hints.
pub fn suggest<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Option<String> {
    candidates
        .map(|c| (edit_distance(name, c), c))
        .filter(|(d, c)| {
            *d <= 2.max(name.len() / 3)
                && (*d < c.len() || name.starts_with(c) || c.starts_with(name))
        })
        .min()
        .map(|(_, c)| c.to_string())
}

fn bin(op: IntOp, a: Int, b: Int) -> Int {
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

impl<'a> Checker<'a> {
    fn err(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    fn declare(&mut self, name: &ast::Ident, def: Def) -> bool {
        // Statement words are keywords only at the start of a statement, so they may name
        // things; built-in values and functions may not.
        let reserved = BUILTIN_VALUES.contains(&name.name.as_str())
            || BUILTIN_FUNCS.contains(&name.name.as_str());
        if reserved {
            self.err(Diagnostic::error(
                "CM0202",
                name.span,
                format!("`{}` is a built-in name and cannot be redefined", name.name),
            ));
            return false;
        }
        if let Some((_, prev)) = self.names.get(&name.name) {
            let prev = *prev;
            self.err(
                Diagnostic::error(
                    "CM0202",
                    name.span,
                    format!("`{}` is already defined", name.name),
                )
                .with_related(prev, "first defined here")
                .with_hint("pick another name"),
            );
            return false;
        }
        self.declared_at
            .insert(name.name.clone(), self.visible_before);
        self.names.insert(name.name.clone(), (def, name.span));
        true
    }

    fn lookup_seg(&mut self, id: &ast::Ident) -> Option<SegId> {
        match self.names.get(&id.name) {
            Some((Def::Seg(s), _)) => Some(*s),
            Some((Def::Failed, _)) => None,
            _ => {
                let hint = suggest(&id.name, self.segs.iter().map(|s| s.name.as_str()));
                let mut d = Diagnostic::error(
                    "CM0201",
                    id.span,
                    format!("`{}` is not a segmentation", id.name),
                );
                d = match hint {
                    Some(h) => d.with_hint(format!("did you mean `{h}`?")),
                    None => d.with_hint("declare it first with `segments NAME = lengths;`"),
                };
                self.err(d);
                None
            }
        }
    }

    fn type_err(&mut self, v: &Val, want: &str) {
        self.err(Diagnostic::error(
            "CM0203",
            v.span(),
            format!("expected {want}, found {}", v.describe()),
        ));
    }

    fn no_k(&mut self, i: Int, ctx: Ctx) -> R<Int> {
        if ctx != Ctx::Elementwise && i.has_k() {
            self.err(
                Diagnostic::error("CM0206", i.span, "`k` cannot be used here")
                    .with_hint("outside `elementwise(...)`, `k` may only appear in comparisons such as `k <= q`, `k in r` or `k / w == q / w`"),
            );
            return Err(());
        }
        Ok(i)
    }

    fn expect_int(&mut self, e: &ast::Expr, ctx: Ctx) -> R<Int> {
        match self.lower(e, ctx)? {
            Val::Int(i) => Ok(i),
            v => {
                self.type_err(&v, "an integer");
                Err(())
            }
        }
    }

    fn expect_q_int(&mut self, e: &ast::Expr, ctx: Ctx) -> R<Int> {
        let i = self.expect_int(e, ctx)?;
        self.no_k(i, ctx)
    }

    fn expect_arr(&mut self, e: &ast::Expr, ctx: Ctx) -> R<Arr> {
        match self.lower(e, ctx)? {
            Val::Arr(a, _) => Ok(a),
            v => {
                self.type_err(&v, "an integer array");
                Err(())
            }
        }
    }

    fn expect_bool(&mut self, e: &ast::Expr, ctx: Ctx) -> R<Bool> {
        match self.lower(e, ctx)? {
            Val::Bool(b, _) => Ok(b),
            v @ Val::Region(..) => {
                self.err(Diagnostic::error("CM0206", v.span(), "this condition depends on `k`")
                    .with_hint("conditions of `if` and `require` may only depend on q, b, h and parameters; combine regions with `&` and `|` instead"));
                Err(())
            }
            v => {
                self.type_err(&v, "a boolean");
                Err(())
            }
        }
    }

    fn expect_range(&mut self, e: &ast::Expr, ctx: Ctx) -> R<RangeE> {
        match self.lower(e, ctx)? {
            Val::Range(r) => {
                if ctx != Ctx::Elementwise && r.has_k() {
                    self.err(Diagnostic::error(
                        "CM0206",
                        r.span,
                        "range bounds cannot depend on `k`",
                    ));
                    return Err(());
                }
                Ok(r)
            }
            v => {
                self.type_err(&v, "a range (`lo..hi`, a segment or a part)");
                Err(())
            }
        }
    }

    fn region_of(&mut self, v: Val) -> R<Region> {
        match v {
            Val::Region(r, _) => Ok(r),
            Val::Bool(b, _) => Ok(Region::Rows(b)),
            v => {
                self.type_err(&v, "a region or a boolean");
                Err(())
            }
        }
    }

    /// The depth of `e` with every earlier `let` it names inlined: 1 for a leaf, one more
    /// than its deepest operand otherwise (recursion bounded by the parser's nesting limit);
    /// [`POISONED`] when it names something that failed to check.
    fn inlined_depth(&self, e: &ast::Expr) -> u32 {
        if let ExprKind::Name(n) = &e.kind {
            return match self.names.get(n) {
                Some((Def::Let(id), _)) => self.let_depths[*id].saturating_add(1),
                Some((Def::Failed, _)) => POISONED,
                _ => 1,
            };
        }
        let mut below = 0;
        each_operand(e, &mut |x| below = below.max(self.inlined_depth(x)));
        below.saturating_add(1)
    }

    /// Marks the `let`s that `e` names as used (their user failed, so a second report of
    /// them as unused or as checked on their own would only repeat its error).
    fn mark_used(&mut self, e: &ast::Expr) {
        if let ExprKind::Name(n) = &e.kind {
            if let Some((Def::Let(id), _)) = self.names.get(n) {
                self.lets[*id].1 = true;
            }
        }
        each_operand(e, &mut |x| self.mark_used(x));
    }

    /// Lowers `e`; a chain of `let`s inlines thousands deep, so on a stack that grows.
    fn lower(&mut self, e: &ast::Expr, ctx: Ctx) -> R<Val> {
        crate::deep(|| self.lower_here(e, ctx))
    }

    fn lower_here(&mut self, e: &ast::Expr, ctx: Ctx) -> R<Val> {
        let span = e.span;
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            if self.nodes == MAX_NODES + 1 {
                self.err(
                    Diagnostic::error("CM0105", span, format!("the program is too large: more than {MAX_NODES} expression nodes after inlining `let`s"))
                        .with_hint("a `let` is copied into every place that uses it; a chain of lets that each use the previous one twice doubles in size at every step"),
                );
            }
            return Err(());
        }
        match &e.kind {
            ExprKind::Error => Err(()),
            ExprKind::Int(v) => Ok(Val::Int(Int::constant(*v, span))),
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
            ExprKind::Unary(UnOp::Not, a) => match self.lower(a, ctx)? {
                Val::Bool(b, _) => Ok(Val::Bool(Bool::Not(Box::new(b)), span)),
                Val::Region(r, _) => Ok(Val::Region(Region::Not(Box::new(r)), span)),
                v => {
                    self.type_err(&v, "a boolean or a region");
                    Err(())
                }
            },
            ExprKind::Binary(op, a, b) => self.binary(*op, a, b, span, ctx),
            ExprKind::Compare { first, rest } => {
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
            ExprKind::In { elem, range } => {
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
                            let a =
                                self.compare(CmpOp::Ge, Val::Int(x.clone()), Val::Int(lo), ctx)?;
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
            ExprKind::If { cond, then, els } => {
                let c = self.expect_bool(cond, ctx)?;
                if c.has_k() && ctx != Ctx::Elementwise {
                    self.err(Diagnostic::error(
                        "CM0206",
                        cond.span,
                        "this condition depends on `k`",
                    ));
                    return Err(());
                }
                let t = self.lower(then, ctx)?;
                let f = self.lower(els, ctx)?;
                match (t, f) {
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
                    (
                        t @ (Val::Bool(..) | Val::Region(..)),
                        f @ (Val::Bool(..) | Val::Region(..)),
                    ) if ctx != Ctx::Elementwise => {
                        let t = self.region_of(t)?;
                        let f = self.region_of(f)?;
                        Ok(Val::Region(Region::Cond(c, Box::new(t), Box::new(f)), span))
                    }
                    (t, f) => {
                        self.err(Diagnostic::error(
                            "CM0203",
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
            ExprKind::Field { base, name } => self.field(base, name, span, ctx),
            ExprKind::Index { base, index } => {
                let b = self.lower(base, ctx)?;
                let i = self.expect_int(index, ctx)?;
                let i = self.no_k(i, ctx)?;
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
            ExprKind::Call { callee, args } => self.call(callee, args, span, ctx),
        }
    }

    fn grid_range(&self, g: GridId, span: Span) -> RangeE {
        let d = &self.grids[g];
        let mut size = d.dims[0].clone();
        for x in &d.dims[1..] {
            size = bin(IntOp::Mul, size, x.clone());
        }
        RangeE {
            kind: RangeKind::Lit(d.at.clone(), bin(IntOp::Add, d.at.clone(), size)),
            span,
        }
    }

    fn name(&mut self, n: &str, span: Span, ctx: Ctx) -> R<Val> {
        let mask_only = |c: Ctx| c == Ctx::Mask || c == Ctx::Elementwise;
        let builtin = match n {
            "q" | "k" | "b" | "h" if !mask_only(ctx) => {
                self.err(Diagnostic::error("CM0208", span, format!("`{n}` cannot be used here"))
                    .with_hint("parameter defaults, segmentations, grids, parts and requirements depend only on lengths and parameters"));
                return Err(());
            }
            "q" => Some(IntKind::Q),
            "k" => Some(IntKind::K),
            "b" => {
                self.uses_b = self.uses_b.or(Some(span));
                Some(IntKind::B)
            }
            "h" => {
                self.uses_h = self.uses_h.or(Some(span));
                Some(IntKind::H)
            }
            "q_len" => Some(IntKind::QLen),
            "kv_len" => Some(IntKind::KvLen),
            "batch" => Some(IntKind::Batch),
            "num_heads" => Some(IntKind::NumHeads),
            "len" if ctx == Ctx::Part => Some(IntKind::SegLen),
            "len" => {
                self.err(
                    Diagnostic::error(
                        "CM0208",
                        span,
                        "`len` names the segment length only inside a `part` declaration",
                    )
                    .with_hint("use `seg(q).len` for the length of q's segment"),
                );
                return Err(());
            }
            "trace_context" | "trace_generated" => {
                let (c, g) = crate::trace::conv_trace();
                let a = if n == "trace_context" { c } else { g };
                return Ok(Val::Arr(Arr::Const(a), span));
            }
            _ => None,
        };
        if let Some(kind) = builtin {
            return Ok(Val::Int(Int::new(kind, span)));
        }
        if let Some(&at) = self.declared_at.get(n) {
            if at >= self.visible_before {
                self.err(
                    Diagnostic::error("CM0201", span, format!("`{n}` is used before its definition"))
                        .with_hint("a name is visible only in statements after the one that defines it; move the definition up"),
                );
                return Err(());
            }
        }
        match self.names.get(n).cloned() {
            Some((Def::Param(id, false), _)) => {
                self.params_read[id] = true;
                Ok(Val::Int(Int::new(IntKind::Param(id), span)))
            }
            Some((Def::Param(id, true), _)) => {
                self.params_read[id] = true;
                Ok(Val::Arr(Arr::Param(id), span))
            }
            Some((Def::Seg(s), _)) => Ok(Val::Seg(s, span)),
            Some((Def::Grid(g), _)) => Ok(Val::Grid(g, span)),
            Some((Def::Failed, _)) => Err(()),
            Some((Def::Let(id), _)) => {
                self.lets[id].1 = true;
                let (expr, _, at) = self.lets[id];
                let outer = std::mem::replace(&mut self.visible_before, at);
                let v = self.lower(expr, ctx);
                self.visible_before = outer;
                // Report errors inside the let at the use site too, so the cause is found.
                v.map(|v| respan(v, span))
            }
            None => {
                let mut cands: Vec<&str> = self.names.keys().map(String::as_str).collect();
                cands.extend(BUILTIN_VALUES);
                let mut d = Diagnostic::error("CM0201", span, format!("unknown name `{n}`"));
                if BUILTIN_FUNCS.contains(&n) {
                    d = d.with_hint(format!("`{n}` is a function; call it as `{n}(...)`"));
                } else if let Some(s) = suggest(n, cands.into_iter()) {
                    d = d.with_hint(format!("did you mean `{s}`?"));
                } else {
                    d = d.with_hint(
                        "names must be defined (param, let, segments, grid) before they are used",
                    );
                }
                self.err(d);
                Err(())
            }
        }
    }

    fn binary(&mut self, op: BinOp, a: &ast::Expr, b: &ast::Expr, span: Span, ctx: Ctx) -> R<Val> {
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
                    Ok(Val::Arr(Arr::Add(Box::new(x), Box::new(y), span), span))
                }
                (x @ (Val::Region(..) | Val::Bool(..)), y @ (Val::Region(..) | Val::Bool(..)))
                    if op == BinOp::Sub && ctx != Ctx::Elementwise =>
                {
                    let x = self.region_of(x)?;
                    let y = self.region_of(y)?;
                    Ok(Val::Region(Region::Diff(Box::new(x), Box::new(y)), span))
                }
                (x, y) => {
                    self.err(Diagnostic::error("CM0203", span, format!("cannot apply this operator to {} and {}", x.describe(), y.describe()))
                        .with_hint("arithmetic works on integers, `+` also on arrays of equal length, `-` also on regions (difference)"));
                    Err(())
                }
            },
        }
    }

    fn and_or(&mut self, is_and: bool, a: Val, b: Val, span: Span) -> R<Val> {
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
            Diagnostic::error("CM0207", span, "this comparison cannot be solved for `k` analytically")
                .with_hint("solvable forms: `a*k + f(q) < g(q)` (any of < <= > >= == !=), `(a*k + f(q)) / d < g(q)`, `(±k + f(q)) % d == g(q)`; wrap anything else in `elementwise(...)` to evaluate it pair by pair"),
        );
    }

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
                        "CM0211",
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
                    "CM0206",
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

    fn field(&mut self, base: &ast::Expr, name: &ast::Ident, span: Span, ctx: Ctx) -> R<Val> {
        let b = self.lower(base, ctx)?;
        let f = name.name.as_str();
        match b {
            Val::Range(r) => {
                let lo = Int::new(IntKind::RangeLo(Box::new(r.clone())), span);
                match f {
                    "start" => Ok(Val::Int(lo)),
                    "end" => Ok(Val::Int(Int::new(IntKind::RangeHi(Box::new(r)), span))),
                    "len" => Ok(Val::Int(bin(
                        IntOp::Sub,
                        Int::new(IntKind::RangeHi(Box::new(r)), span),
                        lo,
                    ))),
                    _ => {
                        self.err(
                            Diagnostic::error(
                                "CM0209",
                                name.span,
                                format!("a range has no field `{f}`"),
                            )
                            .with_hint("ranges have `start`, `end` and `len`"),
                        );
                        Err(())
                    }
                }
            }
            Val::Seg(s, _) => {
                if f == "index" {
                    return Ok(Val::SegIndexFn(s, span));
                }
                if f == "count" {
                    return Ok(Val::Int(Int::new(IntKind::SegCount(s), span)));
                }
                if let Some(i) = self.segs[s].parts.iter().position(|p| p.name == f) {
                    return Ok(Val::PartFn(s, i, span));
                }
                if let SegKind::Composite(ps) = &self.segs[s].kind {
                    if let Some(i) = ps.iter().position(|p| p.name == f) {
                        return Ok(Val::PieceFn(s, i, span));
                    }
                }
                let mut names: Vec<String> = vec!["index".into(), "count".into()];
                names.extend(self.segs[s].parts.iter().map(|p| p.name.clone()));
                if let SegKind::Composite(ps) = &self.segs[s].kind {
                    names.extend(ps.iter().map(|p| p.name.clone()));
                }
                self.err(
                    Diagnostic::error(
                        "CM0209",
                        name.span,
                        format!("segmentation `{}` has no part `{f}`", self.segs[s].name),
                    )
                    .with_hint(format!("available: {}", names.join(", "))),
                );
                Err(())
            }
            Val::Grid(g, _) => {
                let nd = self.grids[g].dims.len();
                let axes: &[&str] = if nd == 3 {
                    &["t", "y", "x"]
                } else {
                    &["y", "x"]
                };
                match axes.iter().position(|a| *a == f) {
                    Some(i) => Ok(Val::AxisFn(g, i as u8, span)),
                    None => {
                        self.err(
                            Diagnostic::error(
                                "CM0209",
                                name.span,
                                format!("grid `{}` has no axis `{f}`", self.grids[g].name),
                            )
                            .with_hint(format!("its axes are {}", axes.join(", "))),
                        );
                        Err(())
                    }
                }
            }
            v => {
                self.err(Diagnostic::error(
                    "CM0209",
                    name.span,
                    format!("{} has no field `{f}`", v.describe()),
                ));
                Err(())
            }
        }
    }

    fn arity(
        &mut self,
        what: &str,
        args: &[ast::Expr],
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
            "CM0204",
            span,
            format!(
                "`{what}` takes {expected} argument(s), found {}",
                args.len()
            ),
        ));
        Err(())
    }

    fn call(&mut self, callee: &ast::Expr, args: &[ast::Expr], span: Span, ctx: Ctx) -> R<Val> {
        if let ExprKind::Name(n) = &callee.kind {
            if BUILTIN_FUNCS.contains(&n.as_str()) && !self.names.contains_key(n) {
                return self.builtin_call(n, args, span, ctx);
            }
        }
        let f = self.lower(callee, ctx)?;
        let what = match &f {
            Val::Seg(s, _) => self.segs[*s].name.clone(),
            _ => "function".into(),
        };
        self.arity(&what, args, 1..=1, span)?;
        let p = self.expect_int(&args[0], ctx)?;
        let p = self.no_k(p, ctx)?;
        match f {
            Val::Seg(s, _) => Ok(Val::Range(RangeE {
                kind: RangeKind::Seg(s, p),
                span,
            })),
            Val::SegIndexFn(s, _) => {
                Ok(Val::Int(Int::new(IntKind::SegIndex(s, Box::new(p)), span)))
            }
            Val::PartFn(s, i, _) => Ok(Val::Range(RangeE {
                kind: RangeKind::Part(s, i, p),
                span,
            })),
            Val::PieceFn(s, i, _) => Ok(Val::Range(RangeE {
                kind: RangeKind::Piece(s, i, p),
                span,
            })),
            Val::AxisFn(g, a, _) => Ok(Val::Int(Int::new(
                IntKind::GridCoord(g, a, Box::new(p)),
                span,
            ))),
            v => {
                self.type_err(&v, "a function, segmentation, part or grid axis to call");
                Err(())
            }
        }
    }

    fn builtin_call(&mut self, n: &str, args: &[ast::Expr], span: Span, ctx: Ctx) -> R<Val> {
        match n {
            "min" | "max" => {
                // Each argument adds a level to the expression tree later stages recurse on.
                self.arity(n, args, 2..=64, span)?;
                let op = if n == "min" { IntOp::Min } else { IntOp::Max };
                let mut acc = self.expect_q_int(&args[0], ctx)?;
                for a in &args[1..] {
                    let x = self.expect_q_int(a, ctx)?;
                    acc = bin(op, acc, x);
                }
                acc.span = span;
                Ok(Val::Int(acc))
            }
            "abs" | "isqrt" => {
                self.arity(n, args, 1..=1, span)?;
                let x = self.expect_q_int(&args[0], ctx)?;
                let k = if n == "abs" {
                    IntKind::Abs(Box::new(x))
                } else {
                    IntKind::Isqrt(Box::new(x))
                };
                Ok(Val::Int(Int::new(k, span)))
            }
            "sum" | "count" => {
                self.arity(n, args, 1..=1, span)?;
                let a = self.expect_arr(&args[0], ctx)?;
                let k = if n == "sum" {
                    IntKind::ArrSum(Box::new(a))
                } else {
                    IntKind::ArrLen(Box::new(a))
                };
                Ok(Val::Int(Int::new(k, span)))
            }
            "l1" | "l2" | "linf" => {
                self.arity(n, args, 1..=1, span)?;
                let g = self.expect_grid(&args[0], ctx)?;
                let m = match n {
                    "l1" => Metric::L1,
                    "l2" => Metric::L2,
                    _ => Metric::Linf,
                };
                if ctx != Ctx::Mask {
                    self.err(Diagnostic::error(
                        "CM0208",
                        span,
                        format!("`{n}` can only be used in the mask"),
                    ));
                    return Err(());
                }
                Ok(Val::Dist(g, m, span))
            }
            "box" => {
                if ctx != Ctx::Mask {
                    self.err(Diagnostic::error(
                        "CM0208",
                        span,
                        "`box` can only be used in the mask (not inside `elementwise`)",
                    ));
                    return Err(());
                }
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
                if ctx != Ctx::Mask {
                    self.err(Diagnostic::error(
                        "CM0208",
                        span,
                        "`elementwise` can only be used in the mask, and not nested",
                    ));
                    return Err(());
                }
                let b = self.expect_bool(&args[0], Ctx::Elementwise)?;
                Ok(Val::Region(Region::Elementwise(b, span), span))
            }
        }
    }

    fn expect_grid(&mut self, e: &ast::Expr, ctx: Ctx) -> R<GridId> {
        match self.lower(e, ctx)? {
            Val::Grid(g, _) => Ok(g),
            v => {
                self.type_err(&v, "a grid");
                Err(())
            }
        }
    }
}

/// Gives a value from a `let` the span of its use, so later diagnostics point there.
fn respan(v: Val, span: Span) -> Val {
    match v {
        Val::Int(mut i) => {
            i.span = span;
            Val::Int(i)
        }
        Val::Bool(b, _) => Val::Bool(b, span),
        Val::Region(r, _) => Val::Region(r, span),
        Val::Range(mut r) => {
            r.span = span;
            Val::Range(r)
        }
        Val::Arr(a, _) => Val::Arr(a, span),
        other => other,
    }
}
