//! The checker: syntax tree to [`Program`]. Every problem becomes a diagnostic (`CM02xx`);
//! nothing here panics. One module per concern:
//!
//! - [`items`]: the statements, one function per kind (`param`, `let`, `segments`, `part`,
//!   `grid`, `require`, `mask`);
//! - [`names`]: resolution of names, fields and calls of segmentations, grids and ranges;
//! - [`types`]: lowering expressions to typed values under the context rules ([`Ctx`]);
//! - [`lets`]: inlining `let`s at their uses, checking and warning about unused ones;
//! - [`atoms`]: normalising comparisons with `k` to the solvable atoms of [`Region`];
//! - [`score`]: the `tensor`, `score` and `sink` statements, and the score's normal form;
//! - [`suggest`]: "did you mean" suggestions.

mod atoms;
mod items;
mod lets;
mod names;
mod score;
mod suggest;
mod types;

pub use atoms::MAX_COMPARISON_CASES;
pub use lets::MAX_INLINED_DEPTH;
pub use suggest::suggest;

use crate::ir::*;
use crate::score::{ScoreDecl, SinkDecl, TensorDecl, TensorId};
use cm_syntax::ast::{self, Item};
use cm_syntax::{Code, Diagnostic, Span};
use std::collections::HashMap;

/// What a declared name denotes.
#[derive(Clone)]
enum Def {
    /// A declaration whose own check failed: uses are errors already reported.
    Failed,
    /// A parameter: its index, and whether it is an integer array.
    Param(ParamId, bool),
    /// A `let`: its index in [`Checker::lets`].
    Let(usize),
    Seg(SegId),
    Grid(GridId),
    Tree(TreeId),
    /// A float tensor given at attention time (`tensor NAME: [..];`).
    Tensor(TensorId),
}

/// Where an expression is being lowered: what it may read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ctx {
    /// Parameter defaults, grids, requirements: lengths and parameters only.
    Const,
    /// A segmentation's lengths and fill: like `Const`, plus the batch index `b` (a
    /// segmentation per batch index).
    Seg,
    /// A `part` range: like `Const`, plus `len`.
    Part,
    /// The mask: also `q`, `k`, `b`, `h`.
    Mask,
    /// Inside `elementwise(...)`: `k` may appear anywhere.
    Elementwise,
    /// The integers of a `score` statement: `q`, `k` and `h` anywhere, as in `elementwise`.
    Score,
}

impl Ctx {
    /// Whether the context is evaluated pair by pair, so `k` may appear anywhere.
    fn pairwise(self) -> bool {
        matches!(self, Ctx::Elementwise | Ctx::Score)
    }
}

/// A lowered expression, by type (see [`types`]).
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
    Tree(TreeId, Span),
    /// `t.path`, to be called on a position.
    PathFn(TreeId, Span),
    /// `t.path(p)`: only `k in t.path(p)` uses it.
    Path(TreeId, Int, Span),
}

/// A failed check: its diagnostic is already recorded.
type R<T> = Result<T, ()>;

/// The state of one check: what has been declared and built so far.
struct Checker<'a> {
    /// The named constant arrays programs may read (the standard library's data).
    arrays: &'a [NamedArray],
    diags: Vec<Diagnostic>,
    /// While a comparison with `k` is normalised (`atoms`): the cases it has been split
    /// into so far at its `abs`, `min` and `max` terms.
    cases: Option<atoms::Cases>,
    names: HashMap<String, (Def, Span)>,
    /// Each `let`: its body, whether it was used, and its item index.
    lets: Vec<(&'a ast::Expr, bool, usize)>,
    params: Vec<ParamDecl>,
    segs: Vec<SegDecl>,
    grids: Vec<GridDecl>,
    trees: Vec<TreeDecl>,
    requires: Vec<Require>,
    /// The mask and the span of its statement.
    mask: Option<(Region, Span)>,
    tensors: Vec<TensorDecl>,
    score: Option<ScoreDecl>,
    sink: Option<SinkDecl>,
    /// Where the batch index `b` / the head index `h` is first read.
    uses_b: Option<Span>,
    uses_h: Option<Span>,
    /// Where the score first reads `h` (it does not make the mask per head).
    score_h: Option<Span>,
    /// Whether some expression read a length (see `Program::reads_lengths`).
    reads_lengths: bool,
    /// Whether some expression read `num_heads` (see `Program::reads_num_heads`).
    reads_num_heads: bool,
    /// Whether some expression read `batch` (see `Program::reads_batch`).
    reads_batch: bool,
    /// Whether each parameter is read.
    params_read: Vec<bool>,
    /// Each `let`'s expression depth and size with the `let`s it uses inlined (see [`lets`]).
    let_shapes: Vec<lets::Inlined>,
    /// The item each name was declared in: a name is visible only in later items.
    declared_at: HashMap<String, usize>,
    /// Index of the item being checked (or of the `let` whose body is being lowered).
    visible_before: usize,
    /// IR nodes built so far, bounded so `let` chains cannot blow up exponentially.
    nodes: usize,
    /// While lowering a statement that binding evaluates before segmentations (and, for
    /// parameter defaults, before grids) are laid out: what it is, for the error when it
    /// reads one.
    early: Option<Early>,
    /// Whether the segmentation being declared reads `b`.
    seg_reads_b: bool,
    /// Whether the statement being checked reads a segmentation or grid.
    reads_structures: bool,
    /// The variables of the `any` / `all` being lowered, outermost first.
    vars: Vec<String>,
}

/// Statements evaluated before some structures exist: binding evaluates parameters, then
/// grids, segmentations and trees (each kind in declaration order), then requirements.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Early {
    /// A parameter default: before every structure.
    ParamDefault,
    /// A grid's extents or offset: reads grids only.
    Grid,
    /// A segmentation's lengths or fill: reads grids and segmentations.
    Segmentation,
    /// A tree's parents or offset: reads every structure.
    Tree,
}

/// The kinds of structure, in the order binding lays them out.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Structure {
    Grid,
    Segmentation,
    Tree,
}

impl Structure {
    fn word(self) -> &'static str {
        match self {
            Structure::Grid => "grid",
            Structure::Segmentation => "segmentation",
            Structure::Tree => "tree",
        }
    }

    /// The earliest statement kind that may read this structure.
    fn first_reader(self) -> Early {
        match self {
            Structure::Grid => Early::Grid,
            Structure::Segmentation => Early::Segmentation,
            Structure::Tree => Early::Tree,
        }
    }
}

/// Most IR nodes a program may lower to (after inlining `let`s).
const MAX_NODES: usize = 200_000;

/// Checks a parsed program in which `arrays` are built-in names. Returns the IR when there
/// are no errors, and every diagnostic (warnings included) either way, in source order.
pub fn check(program: &ast::Program, arrays: &[NamedArray]) -> (Option<Program>, Vec<Diagnostic>) {
    let mut c = Checker {
        arrays,
        diags: Vec::new(),
        cases: None,
        names: HashMap::new(),
        lets: Vec::new(),
        params: Vec::new(),
        segs: Vec::new(),
        grids: Vec::new(),
        trees: Vec::new(),
        requires: Vec::new(),
        mask: None,
        tensors: Vec::new(),
        score: None,
        sink: None,
        uses_b: None,
        uses_h: None,
        score_h: None,
        reads_lengths: false,
        reads_num_heads: false,
        reads_batch: false,
        params_read: Vec::new(),
        let_shapes: Vec::new(),
        declared_at: HashMap::new(),
        visible_before: 0,
        nodes: 0,
        early: None,
        seg_reads_b: false,
        reads_structures: false,
        vars: Vec::new(),
    };
    for (idx, item) in program.items.iter().enumerate() {
        c.visible_before = idx;
        c.item(item, idx);
    }
    c.finish(program)
}

impl<'a> Checker<'a> {
    fn err(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    /// Item `idx` of the program, by kind (see [`items`]).
    fn item(&mut self, item: &'a Item, idx: usize) {
        // An item that fails part-way must not leave its restrictions to the next one.
        self.early = None;
        match item {
            Item::Param {
                name,
                ty,
                default,
                span,
            } => self.param_item(name, *ty, default.as_ref(), *span),
            Item::Let { name, value, .. } => self.let_item(name, value, idx),
            Item::Segments {
                name,
                spec,
                fill,
                span,
            } => self.segments_item(name, spec, fill.as_ref(), *span),
            Item::Part {
                seg,
                name,
                range,
                span,
            } => self.part_item(seg, name, range, *span),
            Item::Grid {
                name,
                dims,
                at,
                span,
            } => self.grid_item(name, dims, at.as_ref(), *span),
            Item::Tree {
                name,
                parents,
                at,
                span,
            } => self.tree_item(name, parents, at.as_ref(), *span),
            Item::Require { cond, message, .. } => self.require_item(cond, message),
            Item::Mask { value, span } => self.mask_item(value, *span),
            Item::Tensor { name, dims, span } => {
                self.score_part(|c| c.tensor_item(name, dims, *span))
            }
            Item::Score { value, span } => self.score_part(|c| c.score_item(value, *span)),
            Item::Sink { value, span } => self.score_part(|c| c.sink_item(value, *span)),
        }
    }

    /// Checks an item of the score part: its reads of `num_heads` and `batch` do not make the
    /// masks depend on the heads or the batch (the score terms are bound and checked on their
    /// own).
    fn score_part(&mut self, check: impl FnOnce(&mut Self)) {
        let reads = (self.reads_num_heads, self.reads_batch);
        check(self);
        (self.reads_num_heads, self.reads_batch) = reads;
    }

    /// After the last item: unused `let`s, the missing-mask error, and the program when
    /// nothing failed.
    fn finish(mut self, program: &ast::Program) -> (Option<Program>, Vec<Diagnostic>) {
        self.check_unused_lets();
        let has_errors = self.diags.iter().any(Diagnostic::is_error);
        // Unused-`let` warnings only make sense when every use was checked.
        if !has_errors {
            self.warn_unused_lets(program);
        }
        self.diags.sort_by_key(|d| (d.span.start, d.span.end));
        let Some((mask, mask_span)) = self.mask else {
            if !has_errors {
                self.diags.push(
                    Diagnostic::error(Code::NoMask, Span::new(0, 0), "the program defines no mask")
                        .with_hint(
                            "end the program with `mask = <region>;`, e.g. `mask = k <= q;`",
                        ),
                );
            }
            return (None, self.diags);
        };
        if has_errors {
            return (None, self.diags);
        }
        for (p, read) in self.params.iter_mut().zip(&self.params_read) {
            p.read = *read;
        }
        let program = Program {
            params: self.params,
            segs: self.segs,
            grids: self.grids,
            trees: self.trees,
            requires: self.requires,
            mask,
            mask_span,
            tensors: self.tensors,
            score: self.score,
            sink: self.sink,
            uses_b: self.uses_b.is_some(),
            uses_h: self.uses_h.is_some(),
            b_span: self.uses_b,
            h_span: self.uses_h,
            score_h_span: self.score_h,
            reads_lengths: self.reads_lengths,
            reads_num_heads: self.reads_num_heads,
            reads_batch: self.reads_batch,
        };
        (Some(program), self.diags)
    }
}

/// Shared by the modules' tests: checking source text, and the codes of what it reports.
#[cfg(test)]
mod testing {
    use crate::ir::{NamedArray, Program};
    use cm_syntax::Diagnostic;
    use std::sync::Arc;

    /// A named array for tests: `[3, 1, 2]`.
    pub fn small() -> Arc<[i64]> {
        vec![3, 1, 2].into()
    }

    pub const ARRAYS: &[NamedArray] = &[NamedArray {
        name: "small",
        values: small,
    }];

    /// Parses and checks `src` with [`ARRAYS`]; the source must parse.
    pub fn check(src: &str) -> (Option<Program>, Vec<Diagnostic>) {
        let (ast, diags) = cm_syntax::parse(src);
        assert!(diags.is_empty(), "{src}: {diags:?}");
        super::check(&ast, ARRAYS)
    }

    /// The program of `src`, which must check without errors.
    pub fn program(src: &str) -> Program {
        let (p, diags) = check(src);
        p.unwrap_or_else(|| panic!("{src}: {diags:?}"))
    }

    /// The codes `src` reports, in source order.
    pub fn codes(src: &str) -> Vec<&'static str> {
        check(src).1.iter().map(|d| d.code.as_str()).collect()
    }

    /// The one error `src` reports: its code and message.
    pub fn error(src: &str) -> (&'static str, String) {
        let d = error_diag(src);
        (d.code.as_str(), d.message)
    }

    /// The one error `src` reports.
    pub fn error_diag(src: &str) -> Diagnostic {
        let (p, diags) = check(src);
        assert!(p.is_none(), "{src} checked");
        let errors: Vec<&Diagnostic> = diags.iter().filter(|d| d.is_error()).collect();
        assert_eq!(errors.len(), 1, "{src}: {diags:?}");
        errors[0].clone()
    }

    /// Every row's visible keys of `src` at `q_len` x `kv_len` (batch and heads 1, default
    /// parameters), by the pairwise reference semantics.
    pub fn rows(src: &str, q_len: i64, kv_len: i64) -> Vec<Vec<(u32, u32)>> {
        let p = program(src);
        let shape = crate::Shape {
            q_len,
            kv_len,
            batch: 1,
            num_heads: 1,
        };
        let bound = p
            .bind(shape, &std::collections::BTreeMap::new())
            .unwrap_or_else(|e| panic!("{src}: {e}"));
        (0..q_len)
            .map(|q| {
                bound
                    .brute_force_row(q, 0, 0)
                    .unwrap_or_else(|e| panic!("{src}: {e}"))
            })
            .collect()
    }
}
