//! The statements of a program, one function per kind: each checks its item, declares what
//! it defines and records it in the program being built. An item whose check fails declares
//! its name as failed ([`Def::Failed`]), so later uses are not reported again.

use super::{Checker, Ctx, Def, Early, Val, R};
use crate::ir::*;
use cm_syntax::ast::{self, Expr, Ident, MsgPiece, SegSpec};
use cm_syntax::{Code, Diagnostic, Span};

impl<'a> Checker<'a> {
    /// `param NAME: TYPE = DEFAULT;` (type, default or both).
    pub(super) fn param_item(
        &mut self,
        name: &Ident,
        ty: Option<ast::ParamType>,
        default: Option<&Expr>,
        span: Span,
    ) {
        if !self.declare(name, Def::Failed) {
            return;
        }
        let id = self.params.len();
        let default_span = default.map(|e| e.span);
        self.early = Some(Early::ParamDefault);
        let default_val = default.and_then(|e| self.lower(e, Ctx::Const).ok());
        self.early = None;
        let (is_array, default) = match (ty, default_val) {
            (_, None) if default.is_some() => return,
            (Some(ast::ParamType::Int) | None, Some(Val::Int(i))) => {
                (false, Some(ParamDefault::Int(i)))
            }
            (Some(ast::ParamType::IntArray) | None, Some(Val::Arr(a, _))) => {
                (true, Some(ParamDefault::Array(a)))
            }
            (Some(t), None) => (t == ast::ParamType::IntArray, None),
            (None, None) => {
                self.err(
                    Diagnostic::error(
                        Code::TypeMismatch,
                        name.span,
                        format!("parameter `{}` needs a type or a default", name.name),
                    )
                    .with_hint("write `param n: int;`, `param lens: [int];` or give a default"),
                );
                return;
            }
            (ty, Some(v)) => {
                let want = if ty == Some(ast::ParamType::IntArray) {
                    "an integer array"
                } else {
                    "an integer"
                };
                self.err(Diagnostic::error(
                    Code::TypeMismatch,
                    v.span(),
                    format!(
                        "default of `{}` is {}, expected {want}",
                        name.name,
                        v.describe()
                    ),
                ));
                return;
            }
        };
        self.define(name, Def::Param(id, is_array));
        self.params_read.push(false);
        self.params.push(ParamDecl {
            name: name.name.clone(),
            read: false,
            is_array,
            default_span,
            default,
            span,
        });
    }

    /// `let NAME = EXPR;`, item `idx`: checked where it is used (see `lets`), except for
    /// its depth and size with the `let`s it uses inlined, which are checked once, here.
    pub(super) fn let_item(&mut self, name: &Ident, value: &'a ast::Expr, idx: usize) {
        let Some(shape) = self.let_shape(name, value) else {
            self.declare(name, Def::Failed);
            return;
        };
        let id = self.lets.len();
        if self.declare(name, Def::Let(id)) {
            self.lets.push((value, false, idx));
            self.let_shapes.push(shape);
        }
    }

    /// `segments NAME = LENGTHS fill FILL;` or the composite `{ piece: lengths * count, ... }`.
    pub(super) fn segments_item(
        &mut self,
        name: &Ident,
        spec: &ast::SegSpec,
        fill: Option<&Expr>,
        span: Span,
    ) {
        if !self.declare(name, Def::Failed) {
            return;
        }
        self.seg_reads_b = false;
        self.early = Some(Early::Segmentation);
        let kind = match spec {
            SegSpec::Plain(e) => match self.expect_arr(e, Ctx::Seg) {
                Ok(a) => SegKind::Plain(a),
                Err(()) => return,
            },
            SegSpec::Composite(pieces) => SegKind::Composite(self.pieces(pieces)),
        };
        let fill = match fill {
            Some(e) => match self.expect_int(e, Ctx::Seg) {
                Ok(i) => i,
                Err(()) => return,
            },
            None => {
                self.reads_lengths = true;
                Int::new(IntKind::QLen, name.span)
            }
        };
        let per_batch = std::mem::take(&mut self.seg_reads_b);
        self.early = None;
        self.define(name, Def::Seg(self.segs.len()));
        self.segs.push(SegDecl {
            name: name.name.clone(),
            kind,
            fill,
            per_batch,
            parts: Vec::new(),
            span,
        });
    }

    /// The pieces of a composite segmentation that check, each named once.
    fn pieces(&mut self, pieces: &[ast::SegPiece]) -> Vec<PieceDecl> {
        let mut out: Vec<PieceDecl> = Vec::new();
        for p in pieces {
            if out.iter().any(|o| o.name == p.name.name) {
                self.err(Diagnostic::error(
                    Code::DuplicateName,
                    p.name.span,
                    format!("piece `{}` is declared twice", p.name.name),
                ));
                continue;
            }
            let Ok(lengths) = self.expect_arr(&p.lengths, Ctx::Seg) else {
                continue;
            };
            let count = match &p.count {
                Some(e) => match self.expect_int(e, Ctx::Seg) {
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
        out
    }

    /// `part SEG.NAME = LO .. HI;`, a range in segment-local positions.
    pub(super) fn part_item(&mut self, seg: &Ident, name: &Ident, range: &Expr, span: Span) {
        let Some(sid) = self.lookup_seg(seg) else {
            return;
        };
        let taken = self.segs[sid].parts.iter().any(|p| p.name == name.name)
            || matches!(&self.segs[sid].kind, SegKind::Composite(ps) if ps.iter().any(|p| p.name == name.name))
            || ["index", "count"].contains(&name.name.as_str());
        if taken {
            self.err(Diagnostic::error(
                Code::DuplicateName,
                name.span,
                format!("`{}.{}` is already defined", seg.name, name.name),
            ));
            return;
        }
        let Ok(r) = self.expect_range(range, Ctx::Part) else {
            return;
        };
        let RangeKind::Lit(lo, hi) = r.kind else {
            self.err(
                Diagnostic::error(
                    Code::TypeMismatch,
                    range.span,
                    "a part is a range `lo..hi` in segment-local positions",
                )
                .with_hint("for example `part user.targets = len - 8 .. len;`"),
            );
            return;
        };
        self.segs[sid].parts.push(PartDecl {
            name: name.name.clone(),
            lo,
            hi,
            span,
        });
    }

    /// `grid NAME = [H, W] at OFFSET;` or `[T, H, W]`.
    pub(super) fn grid_item(&mut self, name: &Ident, dims: &[Expr], at: Option<&Expr>, span: Span) {
        if !self.declare(name, Def::Failed) {
            return;
        }
        if dims.len() != 2 && dims.len() != 3 {
            self.err(
                Diagnostic::error(
                    Code::WrongArity,
                    span,
                    format!("a grid has 2 or 3 dimensions, found {}", dims.len()),
                )
                .with_hint("`grid img = [h, w] at offset;` or `grid video = [t, h, w];`"),
            );
            return;
        }
        self.early = Some(Early::Grid);
        let dims: R<Vec<Int>> = dims
            .iter()
            .map(|d| self.expect_int(d, Ctx::Const))
            .collect();
        let at = match at {
            Some(e) => self.expect_int(e, Ctx::Const),
            None => Ok(Int::constant(0, name.span)),
        };
        self.early = None;
        let (Ok(dims), Ok(at)) = (dims, at) else {
            return;
        };
        self.define(name, Def::Grid(self.grids.len()));
        self.grids.push(GridDecl {
            dims,
            at,
            name: name.name.clone(),
            span,
        });
    }

    /// `tree NAME = PARENTS at OFFSET;`: the parents may read `b` (a tree per batch index).
    pub(super) fn tree_item(
        &mut self,
        name: &Ident,
        parents: &Expr,
        at: Option<&Expr>,
        span: Span,
    ) {
        if !self.declare(name, Def::Failed) {
            return;
        }
        self.early = Some(Early::Tree);
        self.seg_reads_b = false;
        let parents = self.expect_arr(parents, Ctx::Seg);
        let at = match at {
            Some(e) => self.expect_int(e, Ctx::Seg),
            None => Ok(Int::constant(0, name.span)),
        };
        self.early = None;
        let per_batch = std::mem::take(&mut self.seg_reads_b);
        let (Ok(parents), Ok(at)) = (parents, at) else {
            return;
        };
        self.define(name, Def::Tree(self.trees.len()));
        self.trees.push(TreeDecl {
            name: name.name.clone(),
            parents,
            at,
            per_batch,
            span,
        });
    }

    /// `require COND else "MESSAGE {EXPR}";`.
    pub(super) fn require_item(&mut self, cond_expr: &Expr, message: &[MsgPiece]) {
        self.reads_structures = false;
        let Ok(cond) = self.expect_bool(cond_expr, Ctx::Const) else {
            return;
        };
        let mut parts = Vec::new();
        for piece in message {
            match piece {
                MsgPiece::Text(t) => parts.push(MsgPart::Text(t.clone())),
                MsgPiece::Expr(e) => {
                    if let Ok(i) = self.expect_int(e, Ctx::Const) {
                        parts.push(MsgPart::Value(i));
                    }
                }
            }
        }
        self.requires.push(Require {
            cond,
            message: parts,
            span: cond_expr.span,
            reads_structures: self.reads_structures,
        });
    }

    /// `mask = REGION;`, exactly once.
    pub(super) fn mask_item(&mut self, value: &Expr, span: Span) {
        if self.mask.is_some() {
            self.err(
                Diagnostic::error(Code::SecondMask, span, "the mask is defined more than once")
                    .with_hint("combine regions with `|`, `&` and `-` in a single `mask = ...;`"),
            );
            return;
        }
        if let Ok(r) = self.lower(value, Ctx::Mask).and_then(|v| self.region_of(v)) {
            self.mask = Some((r.balanced(), span));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, codes, error, error_diag, program};
    use crate::ir::*;

    #[test]
    fn parameters_take_their_type_from_the_declaration_or_the_default() {
        let p = program(
            "param a: int;\nparam c: [int];\nparam d = 3;\nparam e = [1, 2];\nparam f: [int] = [];\nmask = k <= q;",
        );
        let kinds: Vec<(&str, bool, bool)> = p
            .params
            .iter()
            .map(|d| (d.name.as_str(), d.is_array, d.default.is_some()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("a", false, false),
                ("c", true, false),
                ("d", false, true),
                ("e", true, true),
                ("f", true, true)
            ]
        );
        assert_eq!(
            error("param n: [int] = 3;\nmask = k <= q;").1,
            "default of `n` is an integer, expected an integer array"
        );
        assert_eq!(error("param n: int = [3];\nmask = k <= q;").0, "CM0203");
    }

    #[test]
    fn segmentations_fill_q_len_unless_told() {
        let p = program(
            "segments a = [2, 3];\nsegments d = [4] fill kv_len;\n\
             segments c = { p: [2, 3], r: [1] * 2 };\nmask = k in a(q) | k in d(q) | k in c.p(q);",
        );
        assert_eq!(p.segs[0].fill.kind, IntKind::QLen);
        assert_eq!(p.segs[1].fill.kind, IntKind::KvLen);
        let SegKind::Composite(pieces) = &p.segs[2].kind else {
            panic!("{:?}", p.segs[2].kind)
        };
        let names: Vec<&str> = pieces.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(names, ["p", "r"]);
        assert_eq!(pieces[0].count.kind, IntKind::Const(1));
        assert_eq!(
            error("segments s = { a: [1], a: [2] };\nmask = k <= q;").1,
            "piece `a` is declared twice"
        );
        assert_eq!(error("segments s = 3;\nmask = k <= q;").0, "CM0203");
    }

    /// A segmentation may read `b` (one layout per batch index), nothing else of the mask.
    #[test]
    fn segmentations_may_read_the_batch_index() {
        let p = program(
            "param lens: [int] = [2, 3, 4, 1];
param offs: [int] = [0, 2, 4];
             segments doc = lens[offs[b] .. offs[b + 1]];
segments plain = [4];
             mask = k in doc(q) | k in plain(q);",
        );
        assert!(p.segs[0].per_batch && !p.segs[1].per_batch);
        assert!(p.uses_b, "the mask reads b through `doc`");
        assert!(
            program(
                "segments s = { a: [2] * (b + 1) };
mask = k in s(q);"
            )
            .segs[0]
                .per_batch
        );
        let (code, message) = error(
            "segments s = [q + 1];
mask = k in s(q);",
        );
        assert_eq!(
            (code, message.as_str()),
            ("CM0208", "`q` cannot be used here")
        );
        let d = error_diag(
            "segments s = [2] fill h + 1;
mask = k in s(q);",
        );
        assert!(d.hint.unwrap().contains("the batch index `b`"));
        // Elsewhere outside the mask, `b` stays out.
        assert_eq!(
            error(
                "param w: int = b;
mask = k <= q;"
            )
            .0,
            "CM0208"
        );
    }

    /// Binding evaluates parameters, then grids, then segmentations, then requirements: an
    /// earlier statement cannot read a later kind of structure.
    #[test]
    fn structures_are_read_only_after_they_are_laid_out() {
        for (src, message) in [
            (
                "segments s = [2];
param n: int = s.count;",
                "a parameter default cannot read segmentation `s`",
            ),
            (
                "grid g = [2, 2];
param n: int = if 3 in g then 1 else 0;",
                "a parameter default cannot read grid `g`",
            ),
            (
                "grid g = [2, 2];
param n: int = g.y(3);",
                "a parameter default cannot read grid `g`",
            ),
            (
                "segments s = [2];
grid g = [s.count, 2];",
                "a grid cannot read segmentation `s`",
            ),
        ] {
            let (code, got) = error(&format!("{src}\nmask = k <= q;"));
            assert_eq!((code, got.as_str()), ("CM0208", message), "{src}");
        }
        program(
            "segments s = [2];
require s.count > 0 else \"x\";
grid g = [2, 2];
segments t = [g.y(3) + 1];
mask = k in t(q);",
        );
    }

    /// `tree t = parents at offset;`: `k in t.path(p)` is a region, `t.count` an integer;
    /// a tree is laid out after segmentations, and its path is only a set of keys.
    #[test]
    fn trees_give_paths_of_keys() {
        let p = program(
            "param parents: [int] = [-1, 0, 0, 1];\ntree t = parents at 2;\n\
             mask = k < 2 | k in t.path(q) | k < t.count - 4;",
        );
        assert_eq!(p.trees.len(), 1);
        assert!(!p.trees[0].per_batch);
        assert!(program("tree t = [-1, b - 1];\nmask = k in t.path(q);").trees[0].per_batch);
        for (src, code, message) in [
            (
                "tree t = [-1];\nmask = t.path(q);",
                "CM0203",
                "expected a region or a boolean, found a tree's path (use it as `k in t.path(p)`)",
            ),
            (
                "tree t = [-1];\nmask = k + 1 in t.path(q);",
                "CM0203",
                "a tree's path can only be used as `k in t.path(p)` in the mask",
            ),
            (
                "tree t = [-1];\nmask = elementwise(k in t.path(q));",
                "CM0203",
                "a tree's path can only be used as `k in t.path(p)` in the mask",
            ),
            (
                "tree t = [-1];\nparam n: int = t.count;\nmask = k <= q;",
                "CM0208",
                "a parameter default cannot read tree `t`",
            ),
            (
                "tree t = [-1];\nsegments s = [t.count];\nmask = k in s(q);",
                "CM0208",
                "a segmentation cannot read tree `t`",
            ),
            (
                "tree t = [q];\nmask = k <= q;",
                "CM0208",
                "`q` cannot be used here",
            ),
            (
                "tree t = [-1];\nmask = k in t.leaves(q);",
                "CM0209",
                "tree `t` has no field `leaves`",
            ),
        ] {
            assert_eq!(error(src), (code, message.to_string()), "{src}");
        }
        // A tree may read segmentations and grids, and requirements read trees.
        program("segments s = [3];\ntree t = [-1, 0] at s.count;\nrequire t.count == 2 else \"x\";\nmask = k in t.path(q);");
    }

    #[test]
    fn parts_are_literal_ranges_named_once() {
        let p = program("segments s = [4];\npart s.head = 0 .. 2;\nmask = k in s.head(q);");
        assert_eq!(p.segs[0].parts.len(), 1);
        for (part, message) in [
            (
                "part s.head = 0 .. 2;\npart s.head = 1 .. 2;",
                "`s.head` is already defined",
            ),
            ("part s.index = 0 .. 1;", "`s.index` is already defined"),
        ] {
            assert_eq!(
                error(&format!("segments s = [4];\n{part}\nmask = k <= q;")).1,
                message
            );
        }
        assert_eq!(
            error("segments s = [4];\npart s.x = s[0];\nmask = k <= q;"),
            (
                "CM0203",
                "a part is a range `lo..hi` in segment-local positions".to_string()
            )
        );
    }

    #[test]
    fn grids_have_two_or_three_dimensions() {
        let p = program("grid g = [2, 3, 4] at 5;\nmask = k in g;");
        assert_eq!(p.grids[0].dims.len(), 3);
        assert_eq!(p.grids[0].at.kind, IntKind::Const(5));
        assert_eq!(
            error("grid g = [2];\nmask = k <= q;"),
            (
                "CM0204",
                "a grid has 2 or 3 dimensions, found 1".to_string()
            )
        );
    }

    #[test]
    fn requirements_keep_their_message_pieces() {
        let p = program("param w: int = 2;\nrequire w >= 1 else \"w is {w}!\";\nmask = k <= q;");
        assert_eq!(p.requires.len(), 1);
        let pieces = &p.requires[0].message;
        assert!(matches!(&pieces[0], MsgPart::Text(t) if t == "w is "));
        assert!(matches!(
            &pieces[1],
            MsgPart::Value(Int {
                kind: IntKind::Param(0),
                ..
            })
        ));
        assert!(matches!(&pieces[2], MsgPart::Text(t) if t == "!"));
    }

    #[test]
    fn exactly_one_mask() {
        assert_eq!(codes("mask = k <= q;\nmask = k < q;"), ["CM0210"]);
        let (p, diags) = check("param w: int = 1;");
        assert!(p.is_none());
        assert_eq!(diags.len(), 1);
        assert_eq!(
            (
                diags[0].code.as_str(),
                diags[0].span.start,
                diags[0].span.end
            ),
            ("CM0205", 0, 0)
        );
        // With another error, the missing mask is not reported on top.
        assert_eq!(codes("param w: int = zz;"), ["CM0201"]);
    }
}
