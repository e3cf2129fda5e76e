//! Resolution: declaring names (one definition each, none shadowing a built-in), resolving
//! a name to the built-in value, named array, parameter, `let`, segmentation or grid it
//! denotes (visible only after its definition), and the fields and calls that reach into a
//! segmentation (`s.index`, `s.count`, parts, pieces), a grid (axes) or a range (`start`,
//! `end`, `len`).

use super::atoms::bin;
use super::suggest::suggest;
use super::{Checker, Ctx, Def, Early, Structure, Val, R};
use crate::ir::*;
use cm_syntax::ast::{Expr, ExprKind, Ident};
use cm_syntax::{Code, Diagnostic, Span};

/// The built-in values only the mask may read: the query, key, batch and head indices.
const INDICES: &[&str] = &["q", "k", "b", "h"];
/// The built-in values every part of a program may read: the lengths, and `len` (a
/// segment's length, inside `part`).
const LENGTHS: &[&str] = &["q_len", "kv_len", "batch", "num_heads", "len"];

/// The raw score of a pair, read only by the `score` statement.
pub(super) const RAW_SCORE: &str = "score";

/// Every built-in name that is a value.
fn builtin_values() -> impl Iterator<Item = &'static str> {
    INDICES
        .iter()
        .chain(LENGTHS)
        .copied()
        .chain(std::iter::once(RAW_SCORE))
}
/// The built-in functions of the score part (handled by `score`, never as integers).
pub(super) const SCORE_FUNCS: &[&str] = &["softcap", "alibi_slopes", "t5_bucket"];
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
    "concat",
    "elementwise",
];

impl Checker<'_> {
    /// Declares `name` as `def` in the current item; `false`, with `CM0202`, when it is a
    /// built-in value, function or named array, or already defined.
    pub(super) fn declare(&mut self, name: &Ident, def: Def) -> bool {
        if self.is_builtin(&name.name) {
            self.err(Diagnostic::error(
                Code::DuplicateName,
                name.span,
                format!("`{}` is a built-in name and cannot be redefined", name.name),
            ));
            return false;
        }
        if let Some((_, prev)) = self.names.get(&name.name) {
            let prev = *prev;
            self.err(
                Diagnostic::error(
                    Code::DuplicateName,
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
        self.define(name, def);
        true
    }

    /// Whether `n` is a built-in value, function or named array. Statement words are
    /// keywords only at the start of a statement, so they may name things; these may not.
    fn is_builtin(&self, n: &str) -> bool {
        builtin_values().any(|v| v == n)
            || BUILTIN_FUNCS.contains(&n)
            || SCORE_FUNCS.contains(&n)
            || self.arrays.iter().any(|a| a.name == n)
    }

    /// `CM0202` unless `var` may name the variable of an `any` / `all`: not a built-in, a
    /// declared name or an enclosing quantifier's variable.
    pub(super) fn fresh_var(&mut self, var: &Ident) -> R<()> {
        let n = var.name.as_str();
        let taken = if self.is_builtin(n) {
            Some(format!("`{n}` is a built-in name and cannot be redefined"))
        } else if self.names.contains_key(n) || self.vars.iter().any(|v| v == n) {
            Some(format!("`{n}` is already defined"))
        } else {
            None
        };
        let Some(message) = taken else {
            return Ok(());
        };
        self.err(
            Diagnostic::error(Code::DuplicateName, var.span, message)
                .with_hint("name the variable of `any` / `all` with a name of its own, e.g. `i`"),
        );
        Err(())
    }

    /// Makes `name` denote `def` (after [`Checker::declare`], which reserves it, found it
    /// free; an item that checks replaces its placeholder [`Def::Failed`] so).
    pub(super) fn define(&mut self, name: &Ident, def: Def) {
        self.names.insert(name.name.clone(), (def, name.span));
    }

    /// The segmentation `id` names (`CM0201` when it names none).
    pub(super) fn lookup_seg(&mut self, id: &Ident) -> Option<SegId> {
        match self.names.get(&id.name) {
            Some((Def::Seg(s), _)) => Some(*s),
            Some((Def::Failed, _)) => None,
            _ => {
                let hint = suggest(&id.name, self.segs.iter().map(|s| s.name.as_str()));
                let mut d = Diagnostic::error(
                    Code::UnknownName,
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

    /// The positions grid `g` covers, `[at, at + size)`.
    pub(super) fn grid_range(&self, g: GridId, span: Span) -> RangeE {
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

    /// What name `n` denotes here: a built-in value (if `ctx` allows it), a named array, or
    /// a declared name visible at the current item.
    pub(super) fn name(&mut self, n: &str, span: Span, ctx: Ctx) -> R<Val> {
        if let Some(d) = self.vars.iter().rposition(|v| v == n) {
            return Ok(Val::Int(Int::new(IntKind::Var(d as u8), span)));
        }
        let mask_only = |c: Ctx| c == Ctx::Mask || c.pairwise();
        let builtin = match n {
            "b" if ctx == Ctx::Seg => {
                self.seg_reads_b = true;
                self.uses_b = self.uses_b.or(Some(span));
                Some(IntKind::B)
            }
            "q" | "k" | "b" | "h" if !mask_only(ctx) => {
                let hint = if ctx == Ctx::Seg {
                    "a segmentation's lengths and fill depend only on lengths, parameters and the batch index `b`"
                } else {
                    "parameter defaults, grids, parts and requirements depend only on lengths and parameters; segmentations may also read `b`"
                };
                self.err(
                    Diagnostic::error(
                        Code::WrongContext,
                        span,
                        format!("`{n}` cannot be used here"),
                    )
                    .with_hint(hint),
                );
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
            "q_len" | "kv_len" | "batch" | "num_heads" => {
                self.reads_lengths = true;
                self.reads_num_heads |= n == "num_heads";
                self.reads_batch |= n == "batch";
                Some(match n {
                    "q_len" => IntKind::QLen,
                    "kv_len" => IntKind::KvLen,
                    "batch" => IntKind::Batch,
                    _ => IntKind::NumHeads,
                })
            }
            RAW_SCORE => {
                self.err(
                    Diagnostic::error(
                        Code::WrongContext,
                        span,
                        "`score`, the raw score of a pair, is a float: only the `score` statement reads it",
                    )
                    .with_hint("write it in `score = ...;` itself (a `let` holds integers, booleans, ranges, regions and arrays, not floats)"),
                );
                return Err(());
            }
            "len" if ctx == Ctx::Part => Some(IntKind::SegLen),
            "len" => {
                self.err(
                    Diagnostic::error(
                        Code::WrongContext,
                        span,
                        "`len` names the segment length only inside a `part` declaration",
                    )
                    .with_hint("use `seg(q).len` for the length of q's segment"),
                );
                return Err(());
            }
            _ => {
                if let Some(a) = self.arrays.iter().find(|a| a.name == n) {
                    return Ok(Val::Arr(Arr::Const((a.values)()), span));
                }
                None
            }
        };
        if let Some(kind) = builtin {
            return Ok(Val::Int(Int::new(kind, span)));
        }
        if let Some(&at) = self.declared_at.get(n) {
            if at >= self.visible_before {
                self.err(
                    Diagnostic::error(Code::UnknownName, span, format!("`{n}` is used before its definition"))
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
            Some((Def::Seg(s), _)) => {
                self.laid_out_by_now(n, Structure::Segmentation, span)?;
                Ok(Val::Seg(s, span))
            }
            Some((Def::Grid(g), _)) => {
                self.laid_out_by_now(n, Structure::Grid, span)?;
                Ok(Val::Grid(g, span))
            }
            Some((Def::Tree(t), _)) => {
                self.laid_out_by_now(n, Structure::Tree, span)?;
                Ok(Val::Tree(t, span))
            }
            Some((Def::Failed, _)) => Err(()),
            Some((Def::Tensor(_), _)) => {
                self.err(
                    Diagnostic::error(
                        Code::WrongContext,
                        span,
                        format!("tensor `{n}` holds floats: only the `score` and `sink` statements read it"),
                    )
                    .with_hint(format!("index it there: `score = score + {n}[h][bucket];` or `sink = {n}[h];`")),
                );
                Err(())
            }
            Some((Def::Let(id), _)) => self.inline_let(id, span, ctx),
            None => {
                let mut cands: Vec<&str> = self.names.keys().map(String::as_str).collect();
                cands.extend(INDICES.iter().chain(LENGTHS));
                cands.extend(self.arrays.iter().map(|a| a.name));
                let mut d =
                    Diagnostic::error(Code::UnknownName, span, format!("unknown name `{n}`"));
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

    /// `CM0208` when the statement being checked is evaluated before structure `n` is laid
    /// out (a parameter default reads none, a grid only grids, a segmentation grids and
    /// segmentations); notes that the statement reads a structure.
    pub(super) fn laid_out_by_now(&mut self, n: &str, kind: Structure, span: Span) -> R<()> {
        self.reads_structures = true;
        let statement = match self.early {
            Some(e) if e < kind.first_reader() => match e {
                Early::ParamDefault => "a parameter default",
                Early::Grid => "a grid",
                Early::Segmentation => "a segmentation",
                Early::Tree => "a tree",
            },
            _ => return Ok(()),
        };
        self.err(
            Diagnostic::error(
                Code::WrongContext,
                span,
                format!("{statement} cannot read {} `{n}`", kind.word()),
            )
            .with_hint("parameters are bound first, then grids, then segmentations, then trees; compute the value from the lengths or parameters the structure is built from, or check it with a `require`"),
        );
        Err(())
    }

    /// `base.name`: a field of a range, segmentation or grid.
    pub(super) fn field(&mut self, base: &Expr, name: &Ident, span: Span, ctx: Ctx) -> R<Val> {
        let f = name.name.as_str();
        match self.lower(base, ctx)? {
            Val::Range(r) => self.range_field(r, name, span),
            Val::Seg(s, _) => self.seg_field(s, name, span),
            Val::Grid(g, _) => self.grid_field(g, name, span),
            Val::Tree(t, _) => match f {
                "path" => Ok(Val::PathFn(t, span)),
                "count" => Ok(Val::Int(Int::new(
                    IntKind::ArrLen(Box::new(self.trees[t].parents.clone())),
                    span,
                ))),
                _ => self.no_field(
                    name,
                    format!("tree `{}` has no field `{f}`", self.trees[t].name),
                    Some("trees have `path` (`k in t.path(q)`) and `count`".into()),
                ),
            },
            v => self.no_field(name, format!("{} has no field `{f}`", v.describe()), None),
        }
    }

    /// `r.start`, `r.end`, `r.len`.
    fn range_field(&mut self, r: RangeE, name: &Ident, span: Span) -> R<Val> {
        let lo = Int::new(IntKind::RangeLo(Box::new(r.clone())), span);
        let hi = Int::new(IntKind::RangeHi(Box::new(r)), span);
        match name.name.as_str() {
            "start" => Ok(Val::Int(lo)),
            "end" => Ok(Val::Int(hi)),
            "len" => Ok(Val::Int(bin(IntOp::Sub, hi, lo))),
            f => self.no_field(
                name,
                format!("a range has no field `{f}`"),
                Some("ranges have `start`, `end` and `len`".into()),
            ),
        }
    }

    /// `s.index`, `s.count`, a part or a piece of segmentation `s`.
    fn seg_field(&mut self, s: SegId, name: &Ident, span: Span) -> R<Val> {
        let f = name.name.as_str();
        let seg = &self.segs[s];
        let pieces: &[PieceDecl] = match &seg.kind {
            SegKind::Composite(ps) => ps,
            SegKind::Plain(_) => &[],
        };
        if f == "index" {
            return Ok(Val::SegIndexFn(s, span));
        }
        if f == "count" {
            return Ok(Val::Int(Int::new(IntKind::SegCount(s), span)));
        }
        if let Some(i) = seg.parts.iter().position(|p| p.name == f) {
            return Ok(Val::PartFn(s, i, span));
        }
        if let Some(i) = pieces.iter().position(|p| p.name == f) {
            return Ok(Val::PieceFn(s, i, span));
        }
        let names: Vec<&str> = ["index", "count"]
            .into_iter()
            .chain(seg.parts.iter().map(|p| p.name.as_str()))
            .chain(pieces.iter().map(|p| p.name.as_str()))
            .collect();
        let message = format!("segmentation `{}` has no part `{f}`", seg.name);
        let hint = format!("available: {}", names.join(", "));
        self.no_field(name, message, Some(hint))
    }

    /// An axis of grid `g`: `t`, `y`, `x` (3D) or `y`, `x` (2D), slowest first.
    fn grid_field(&mut self, g: GridId, name: &Ident, span: Span) -> R<Val> {
        let f = name.name.as_str();
        let axes: &[&str] = if self.grids[g].dims.len() == 3 {
            &["t", "y", "x"]
        } else {
            &["y", "x"]
        };
        match axes.iter().position(|a| *a == f) {
            Some(i) => Ok(Val::AxisFn(g, i as u8, span)),
            None => {
                let message = format!("grid `{}` has no axis `{f}`", self.grids[g].name);
                let hint = format!("its axes are {}", axes.join(", "));
                self.no_field(name, message, Some(hint))
            }
        }
    }

    /// `CM0209` at the field's name.
    fn no_field(&mut self, name: &Ident, message: String, hint: Option<String>) -> R<Val> {
        let mut d = Diagnostic::error(Code::UnknownField, name.span, message);
        d.hint = hint;
        self.err(d);
        Err(())
    }

    /// `f(x)`: a built-in function, or a segmentation, part, piece or grid axis applied to a
    /// q-side position.
    pub(super) fn call(&mut self, callee: &Expr, args: &[Expr], span: Span, ctx: Ctx) -> R<Val> {
        if let ExprKind::Name(n) = &callee.kind {
            if BUILTIN_FUNCS.contains(&n.as_str()) && !self.names.contains_key(n) {
                return self.builtin_call(n, args, span, ctx);
            }
            if SCORE_FUNCS.contains(&n.as_str()) {
                let use_ = if n == "t5_bucket" {
                    "as the bucket of a bias table, `T[h][t5_bucket(k - q, 32, 128, true)]`, in the `score` statement"
                } else {
                    "in the `score` statement (not in a `let`)"
                };
                self.err(Diagnostic::error(
                    Code::WrongContext,
                    span,
                    format!("`{n}` can only be used {use_}"),
                ));
                return Err(());
            }
        }
        let f = self.lower(callee, ctx)?;
        let what = match &f {
            Val::Seg(s, _) => self.segs[*s].name.clone(),
            _ => "function".into(),
        };
        self.arity(&what, args, 1..=1, span)?;
        let p = self.expect_int(&args[0], ctx)?;
        // The structure of a key (`doc.index(k)`, `doc(k).start`, `img.y(k)`) is a key-side
        // value (see `atoms`); a tree's path is taken of a q-side position.
        let p = match f {
            Val::PathFn(..) => self.no_k(p, ctx)?,
            _ if ctx == Ctx::Mask => p,
            _ => self.no_k(p, ctx)?,
        };
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
            Val::PathFn(t, _) => Ok(Val::Path(t, p, span)),
            v => {
                self.type_err(&v, "a function, segmentation, part or grid axis to call");
                Err(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{error, error_diag, program, small};
    use crate::ir::{Arr, IntKind, Region};

    /// Every place a length can be read sets `reads_lengths`, the implicit `fill q_len` of a
    /// segmentation included; programs that read none leave it false.
    #[test]
    fn reads_lengths_marks_every_read_of_a_length() {
        for src in [
            "mask = k <= q;",
            "param w: int = 4;\nmask = q - w < k <= q;",
            "segments d = [2, 3] fill 5;\nmask = k <= q & d.index(k) == d.index(q);",
            "param parents: [int] = [-1, 0];\ntree t = parents at 3;\nmask = k in t.path(q);",
            "grid g = [2, 2] at 0;\nmask = k <= q;\nrequire 1 < 2 else \"no\";",
        ] {
            assert!(!program(src).reads_lengths, "{src}");
        }
        for src in [
            "mask = k <= q + kv_len - q_len;",
            "param w: int = q_len / 4;\nmask = q - w < k <= q;",
            "segments d = [2, 3];\nmask = k <= q & d.index(k) == d.index(q);",
            "segments d = [2, 3] fill kv_len;\nmask = k <= q & d.index(k) == d.index(q);",
            "require batch < 9 else \"too many\";\nmask = k <= q;",
            "grid g = [2, num_heads] at 0;\nmask = k <= q;",
            "let x = q_len;\nmask = k <= q;",
            "param parents: [int] = [-1, 0];\ntree t = parents at kv_len - 2;\nmask = k in t.path(q);",
        ] {
            assert!(program(src).reads_lengths, "{src}");
        }
    }

    #[test]
    fn built_in_and_named_array_names_cannot_be_redefined() {
        for name in ["q", "kv_len", "len", "min", "elementwise", "small"] {
            let (code, message) = error(&format!("param {name}: int = 1;\nmask = k <= q;"));
            assert_eq!(code, "CM0202", "{name}");
            assert_eq!(
                message,
                format!("`{name}` is a built-in name and cannot be redefined")
            );
        }
        // Statement words are not reserved.
        program("param grid: int = 1;\nmask = k <= q + grid;");
        let d = error_diag("param a: int = 1;\nparam a: int = 2;\nmask = k <= q;");
        assert_eq!(d.code.as_str(), "CM0202");
        assert_eq!(d.related.len(), 1, "points at the first definition");
        assert_eq!(d.related[0].0.start, 6);
    }

    /// A named array is a constant array of its values; names the caller does not pass are
    /// unknown, with the known ones as suggestions.
    #[test]
    fn named_arrays_resolve_to_their_values() {
        let p = program("mask = k < sum(small) + q * 0;");
        let Region::KCmp { rest, .. } = &p.mask else {
            panic!("{:?}", p.mask)
        };
        let text = format!("{rest:?}");
        assert!(
            text.contains(&format!("{:?}", Arr::Const(small()))),
            "{text}"
        );
        let d = error_diag("mask = k < sum(smal);");
        assert_eq!(d.code.as_str(), "CM0201");
        assert_eq!(d.hint.as_deref(), Some("did you mean `small`?"));
        assert_eq!(error("mask = k < sum(trace_context);").0, "CM0201");
    }

    #[test]
    fn names_are_visible_only_after_their_definition() {
        assert_eq!(
            error("mask = k < w;\nparam w: int = 1;").1,
            "unknown name `w`"
        );
        // A `let` sees the names of the items before it, wherever it is used.
        let (code, message) = error("let x = w;\nparam w: int = 1;\nmask = k < x;");
        assert_eq!(code, "CM0201");
        assert_eq!(message, "`w` is used before its definition");
        let d = error_diag("param window: int = 2;\nmask = k < windw;");
        assert_eq!(d.hint.as_deref(), Some("did you mean `window`?"));
        let d = error_diag("mask = k < min;");
        assert_eq!(
            d.hint.as_deref(),
            Some("`min` is a function; call it as `min(...)`")
        );
        // A name whose own declaration failed is not reported again.
        assert_eq!(
            error("param a: int = zz;\nmask = k < a;").1,
            "unknown name `zz`"
        );
    }

    #[test]
    fn q_k_b_h_only_in_the_mask_and_len_only_in_parts() {
        for name in ["q", "k", "b", "h"] {
            let (code, message) = error(&format!("param w: int = {name};\nmask = k <= q;"));
            assert_eq!(
                (code, message),
                ("CM0208", format!("`{name}` cannot be used here"))
            );
        }
        assert_eq!(error("mask = k < len;").0, "CM0208");
        let p =
            program("segments s = [4, 4];\npart s.head = 0 .. len / 2;\nmask = k in s.head(q);");
        assert!(matches!(p.segs[0].parts[0].hi.kind, IntKind::Bin(..)));
        assert!(program("mask = k <= q + b;").uses_b);
        assert!(program("mask = k <= q + h;").uses_h);
    }

    #[test]
    fn fields_of_segmentations_grids_and_ranges() {
        let p = program(
            "segments s = [2, 3];\npart s.head = 0 .. 1;\ngrid g = [2, 3];\n\
             mask = k in s(q) & k < s.index(q) + s.count + s.head(q).len + g.y(q) + g.x(q) \
             + (0 .. 4).end;",
        );
        assert_eq!(p.segs.len(), 1);
        let d = error_diag("segments s = [2, 2];\nmask = k in s.foo(q);");
        assert_eq!(d.code.as_str(), "CM0209");
        assert_eq!(d.hint.as_deref(), Some("available: index, count"));
        let d = error_diag("grid g = [2, 2];\nmask = g.t(q) == 0 & k < q;");
        assert_eq!(d.message, "grid `g` has no axis `t`");
        assert_eq!(d.hint.as_deref(), Some("its axes are y, x"));
        assert_eq!(
            error("mask = k < (0 .. 2).foo;").1,
            "a range has no field `foo`"
        );
        assert_eq!(
            error("part nope.x = 0 .. 1;\nmask = k <= q;").1,
            "`nope` is not a segmentation"
        );
    }
}
