//! The checked mask IR. Names are resolved, types checked, `let`s inlined, comparisons
//! involving `k` normalised to solvable atoms. The IR is shape-agnostic: `q_len`,
//! `kv_len`, `batch`, `num_heads` and parameters are symbols bound later ([`crate::bind`]).
//!
//! Conventions: positions are 0-based absolute (top-left aligned); every range is
//! half-open `[lo, hi)`; integer division and modulo floor toward negative infinity.

use cm_syntax::{CmpOp, Span};
use std::sync::Arc;

pub type SegId = usize;
pub type GridId = usize;
pub type ParamId = usize;
pub type TreeId = usize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntOp {
    Add,
    Sub,
    Mul,
    /// Floor division (rounds toward negative infinity).
    Div,
    /// Floor modulo: the result has the sign of the divisor.
    Mod,
    Min,
    Max,
}

/// An integer expression. Outside `elementwise`, only comparisons may contain `K`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Int {
    pub kind: IntKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IntKind {
    Const(i64),
    Q,
    K,
    B,
    H,
    QLen,
    KvLen,
    Batch,
    NumHeads,
    /// `len` inside a `part` declaration: the length of the segment being divided.
    SegLen,
    Param(ParamId),
    ArrIndex(Box<Arr>, Box<Int>),
    ArrLen(Box<Arr>),
    ArrSum(Box<Arr>),
    Neg(Box<Int>),
    Bin(IntOp, Box<Int>, Box<Int>),
    Abs(Box<Int>),
    /// Integer square root, `floor(sqrt(x))`, for `x >= 0`.
    Isqrt(Box<Int>),
    If(Box<Bool>, Box<Int>, Box<Int>),
    RangeLo(Box<RangeE>),
    RangeHi(Box<RangeE>),
    SegIndex(SegId, Box<Int>),
    SegCount(SegId),
    /// Grid coordinate of a position: axis 0 is the slowest (t for 3D, y for 2D).
    GridCoord(GridId, u8, Box<Int>),
    /// The variable of the enclosing `any` / `all` at this nesting depth (0: outermost).
    Var(u8),
}

impl Int {
    pub fn new(kind: IntKind, span: Span) -> Int {
        Int { kind, span }
    }

    pub fn constant(v: i64, span: Span) -> Int {
        Int::new(IntKind::Const(v), span)
    }

    /// Does `K` occur anywhere inside?
    pub fn has_k(&self) -> bool {
        self.mentions(&|x| matches!(x, IntKind::K))
    }

    /// Does the query row `Q` occur anywhere inside? A value that does not read it is the
    /// same on every row of a (batch, head) mask.
    pub fn reads_q(&self) -> bool {
        self.mentions(&|x| matches!(x, IntKind::Q))
    }

    /// Whether a leaf for which `leaf` holds occurs anywhere inside.
    pub fn mentions(&self, leaf: &impl Fn(&IntKind) -> bool) -> bool {
        match &self.kind {
            IntKind::Const(_)
            | IntKind::Q
            | IntKind::K
            | IntKind::B
            | IntKind::H
            | IntKind::QLen
            | IntKind::KvLen
            | IntKind::Batch
            | IntKind::NumHeads
            | IntKind::SegLen
            | IntKind::Param(_)
            | IntKind::SegCount(_)
            | IntKind::Var(_) => leaf(&self.kind),
            IntKind::ArrIndex(a, i) => a.mentions(leaf) || i.mentions(leaf),
            IntKind::ArrLen(a) | IntKind::ArrSum(a) => a.mentions(leaf),
            IntKind::Neg(a) | IntKind::Abs(a) | IntKind::Isqrt(a) => a.mentions(leaf),
            IntKind::Bin(_, a, b) => a.mentions(leaf) || b.mentions(leaf),
            IntKind::If(c, a, b) => c.mentions(leaf) || a.mentions(leaf) || b.mentions(leaf),
            IntKind::RangeLo(r) | IntKind::RangeHi(r) => r.mentions(leaf),
            IntKind::SegIndex(_, p) | IntKind::GridCoord(_, _, p) => p.mentions(leaf),
        }
    }
}

/// A q-side boolean (no `K`), except inside [`Region::Elementwise`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bool {
    Const(bool),
    Cmp(CmpOp, Int, Int),
    And(Box<Bool>, Box<Bool>),
    Or(Box<Bool>, Box<Bool>),
    Not(Box<Bool>),
    InGrid(GridId, Int),
}

impl Bool {
    pub fn has_k(&self) -> bool {
        self.mentions(&|x| matches!(x, IntKind::K))
    }

    /// See [`Int::mentions`].
    pub fn mentions(&self, leaf: &impl Fn(&IntKind) -> bool) -> bool {
        match self {
            Bool::Const(_) => false,
            Bool::Cmp(_, a, b) => a.mentions(leaf) || b.mentions(leaf),
            Bool::And(a, b) | Bool::Or(a, b) => a.mentions(leaf) || b.mentions(leaf),
            Bool::Not(a) => a.mentions(leaf),
            Bool::InGrid(_, p) => p.mentions(leaf),
        }
    }
}

/// A range of positions `[lo, hi)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeE {
    pub kind: RangeKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RangeKind {
    Lit(Int, Int),
    /// The segment containing a position.
    Seg(SegId, Int),
    /// The segment with a given index.
    SegAt(SegId, Int),
    /// A declared part of the segment containing a position.
    Part(SegId, usize, Int),
    /// A piece kind of a composite segmentation, at a position (see docs/language.md).
    Piece(SegId, usize, Int),
}

impl RangeE {
    pub fn has_k(&self) -> bool {
        self.mentions(&|x| matches!(x, IntKind::K))
    }

    /// See [`Int::mentions`].
    pub fn mentions(&self, leaf: &impl Fn(&IntKind) -> bool) -> bool {
        match &self.kind {
            RangeKind::Lit(a, b) => a.mentions(leaf) || b.mentions(leaf),
            RangeKind::Seg(_, p)
            | RangeKind::SegAt(_, p)
            | RangeKind::Part(_, _, p)
            | RangeKind::Piece(_, _, p) => p.mentions(leaf),
        }
    }
}

/// An integer array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arr {
    Param(ParamId),
    Lit(Vec<Int>),
    Const(Arc<[i64]>),
    /// Element-wise sum of two arrays of equal length.
    Add(Box<Arr>, Box<Arr>, Span),
    /// The arrays one after the other (`concat(a, b, ...)`).
    Concat(Vec<Arr>, Span),
    /// The entries `[lo, hi)` of an array (`a[lo .. hi]`), `0 <= lo <= hi <= count(a)`.
    Slice(Box<Arr>, Box<RangeE>, Span),
}

impl Arr {
    /// Does the query row occur anywhere inside (see [`Int::reads_q`])?
    pub fn reads_q(&self) -> bool {
        self.mentions(&|x| matches!(x, IntKind::Q))
    }

    /// See [`Int::mentions`].
    pub fn mentions(&self, leaf: &impl Fn(&IntKind) -> bool) -> bool {
        match self {
            Arr::Lit(xs) => xs.iter().any(|x| x.mentions(leaf)),
            Arr::Add(a, b, _) => a.mentions(leaf) || b.mentions(leaf),
            Arr::Concat(xs, _) => xs.iter().any(|x| x.mentions(leaf)),
            Arr::Slice(a, r, _) => a.mentions(leaf) || r.mentions(leaf),
            Arr::Param(_) | Arr::Const(_) => false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    L1,
    L2,
    Linf,
}

/// A set of (q, k) pairs. Each atom is solvable for `k` given `q` (see `cm-plan`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Region {
    /// A q-side predicate: every key of the row when true, none when false.
    Rows(Bool),
    /// `alpha * k + rest  op  0`, `alpha != 0`, `rest` q-side.
    KCmp {
        alpha: i64,
        rest: Int,
        op: CmpOp,
        span: Span,
    },
    /// `floor((alpha * k + rest) / div)  op  rhs`, `alpha != 0`.
    KDiv {
        alpha: i64,
        rest: Int,
        div: Int,
        op: CmpOp,
        rhs: Int,
        span: Span,
    },
    /// `(alpha * k + rest) mod div  op  rhs`, `alpha` is 1 or -1, `op` any comparison: the
    /// keys whose residue lies in a window, a periodic set of runs.
    KMod {
        alpha: i64,
        rest: Int,
        div: Int,
        op: CmpOp,
        rhs: Int,
        span: Span,
    },
    /// `f op v` with `f` a function of the key alone (it reads `k`, not `q` nor a
    /// quantifier's variable: `arr[k]`, `doc.index(k)`, `k * k`) and `v` q-side: planned by
    /// sorting the keys by `f` once per (batch, head).
    KeyCmp {
        f: Int,
        op: CmpOp,
        v: Int,
        span: Span,
    },
    /// Keys of the grid whose distance to the query's grid point is `< radius` (strict)
    /// or `<= radius`. Empty for queries outside the grid.
    Ball {
        grid: GridId,
        metric: Metric,
        strict: bool,
        radius: Int,
        span: Span,
    },
    /// Keys of the grid whose coordinates lie in the given ranges (one per axis, slowest
    /// first), clipped to the grid.
    Box {
        grid: GridId,
        ranges: Vec<RangeE>,
        span: Span,
    },
    /// `k in t.path(pos)`: the keys on the path from the root of tree `t` to the node at
    /// position `pos` (its ancestors and itself); empty when `pos` is not a node of `t`.
    Path {
        tree: TreeId,
        pos: Int,
        span: Span,
    },
    Union(Box<Region>, Box<Region>),
    Inter(Box<Region>, Box<Region>),
    Diff(Box<Region>, Box<Region>),
    Not(Box<Region>),
    Cond(Bool, Box<Region>, Box<Region>),
    /// The escape hatch: a predicate evaluated pair by pair.
    Elementwise(Bool, Span),
    /// `any i in lo .. hi: body` (`all: false`, the union of `body` over the integers `i` of
    /// `[lo, hi)`, empty for an empty range) or `all i in ...` (their intersection, every key
    /// for an empty range). `body` reads `i` as `IntKind::Var(depth)`.
    Quant {
        all: bool,
        depth: u8,
        lo: Int,
        hi: Int,
        body: Box<Region>,
        span: Span,
    },
}

impl Region {
    /// The same region with every chain of unions rebuilt as a balanced tree of the same
    /// operands in the same order. Union is associative, and the solver and the pairwise
    /// interpreter visit its operands left to right in either shape, so the meaning and the
    /// first error are unchanged; a union of a thousand terms built by a chain of `let`s
    /// then nests ten deep, not a thousand. Intersections keep their shape: the solver
    /// narrows each right operand to the keys of the left one, so a left-deep chain is
    /// evaluated in ever smaller ranges.
    pub fn balanced(self) -> Region {
        match self {
            r @ Region::Union(..) => {
                let operands = unions(r).into_iter().map(Region::balanced).collect();
                tree(operands)
            }
            Region::Inter(a, b) => Region::Inter(Box::new(a.balanced()), Box::new(b.balanced())),
            Region::Diff(a, b) => Region::Diff(Box::new(a.balanced()), Box::new(b.balanced())),
            Region::Not(a) => Region::Not(Box::new(a.balanced())),
            Region::Cond(c, a, b) => {
                Region::Cond(c, Box::new(a.balanced()), Box::new(b.balanced()))
            }
            leaf => leaf,
        }
    }

    /// Whether the region holds an `elementwise` atom: the only kind evaluated pair by pair,
    /// so the only one whose cost grows with `q_len x kv_len` and whose errors can depend on
    /// `k`. Exhaustive on purpose: a new atom kind must say which side it is on.
    pub fn uses_elementwise(&self) -> bool {
        match self {
            Region::Elementwise(..) => true,
            Region::Union(a, b)
            | Region::Inter(a, b)
            | Region::Diff(a, b)
            | Region::Cond(_, a, b) => a.uses_elementwise() || b.uses_elementwise(),
            Region::Not(a) => a.uses_elementwise(),
            Region::Quant { body, .. } => body.uses_elementwise(),
            Region::Rows(_)
            | Region::KCmp { .. }
            | Region::KDiv { .. }
            | Region::KMod { .. }
            | Region::Ball { .. }
            | Region::Box { .. }
            | Region::Path { .. }
            | Region::KeyCmp { .. } => false,
        }
    }
}

/// The operands of a chain of unions, left to right, taken apart without recursion (the
/// chain may be thousands deep).
fn unions(r: Region) -> Vec<Region> {
    let mut out = Vec::new();
    let mut todo = vec![r];
    while let Some(r) = todo.pop() {
        match r {
            Region::Union(a, b) => todo.extend([*b, *a]),
            other => out.push(other),
        }
    }
    out
}

/// A balanced tree of unions of `operands`, in order; non-empty.
fn tree(mut operands: Vec<Region>) -> Region {
    if operands.len() == 1 {
        return operands.pop().expect("one operand");
    }
    let right = operands.split_off(operands.len() / 2);
    Region::Union(Box::new(tree(operands)), Box::new(tree(right)))
}

impl Region {
    /// Whether the keys the region gives can differ from one query row to another: it
    /// reads `q`, or is a grid ball (around q's grid point) or `elementwise`. Exhaustive on
    /// purpose, like [`Region::uses_elementwise`].
    pub fn reads_q(&self) -> bool {
        let q = |x: &IntKind| matches!(x, IntKind::Q);
        match self {
            Region::Rows(c) => c.mentions(&q),
            Region::KCmp { rest, .. } => rest.mentions(&q),
            Region::KDiv { rest, div, rhs, .. } | Region::KMod { rest, div, rhs, .. } => {
                rest.mentions(&q) || div.mentions(&q) || rhs.mentions(&q)
            }
            Region::Ball { .. } | Region::Elementwise(..) => true,
            Region::Box { ranges, .. } => ranges.iter().any(|r| r.mentions(&q)),
            Region::Path { pos, .. } => pos.mentions(&q),
            Region::KeyCmp { f, v, .. } => f.mentions(&q) || v.mentions(&q),
            Region::Union(a, b) | Region::Inter(a, b) | Region::Diff(a, b) => {
                a.reads_q() || b.reads_q()
            }
            Region::Cond(c, a, b) => c.mentions(&q) || a.reads_q() || b.reads_q(),
            Region::Not(a) => a.reads_q(),
            Region::Quant { lo, hi, body, .. } => {
                lo.mentions(&q) || hi.mentions(&q) || body.reads_q()
            }
        }
    }

    /// Whether the region reads the variable of a quantifier at nesting depth below `depth`
    /// (one that encloses a quantifier at `depth`).
    pub fn reads_outer_vars(&self, depth: u8) -> bool {
        let outer = |x: &IntKind| matches!(x, IntKind::Var(d) if *d < depth);
        let int = |i: &Int| i.mentions(&outer);
        match self {
            Region::Rows(c) | Region::Elementwise(c, _) => c.mentions(&outer),
            Region::KCmp { rest, .. } => int(rest),
            Region::KDiv { rest, div, rhs, .. } | Region::KMod { rest, div, rhs, .. } => {
                int(rest) || int(div) || int(rhs)
            }
            Region::Ball { radius, .. } => int(radius),
            Region::Box { ranges, .. } => ranges.iter().any(|r| r.mentions(&outer)),
            Region::Path { pos, .. } => int(pos),
            Region::KeyCmp { f, v, .. } => int(f) || int(v),
            Region::Union(a, b) | Region::Inter(a, b) | Region::Diff(a, b) => {
                a.reads_outer_vars(depth) || b.reads_outer_vars(depth)
            }
            Region::Cond(c, a, b) => {
                c.mentions(&outer) || a.reads_outer_vars(depth) || b.reads_outer_vars(depth)
            }
            Region::Not(a) => a.reads_outer_vars(depth),
            Region::Quant { lo, hi, body, .. } => {
                int(lo) || int(hi) || body.reads_outer_vars(depth)
            }
        }
    }
}

/// A named constant integer array that programs read as a built-in name, like a parameter
/// that cannot be set (the standard library's `trace_context`, say). The checker knows no
/// such names of its own; its caller passes them. `values` is called each time a program
/// reads the name, so data that is costly to build should be built once behind it.
#[derive(Clone, Copy, Debug)]
pub struct NamedArray {
    pub name: &'static str,
    pub values: fn() -> Arc<[i64]>,
}

/// A declared parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamDecl {
    pub name: String,
    /// Whether anything in the program reads it (a value given for an unread parameter
    /// changes nothing: a plan-time warning).
    pub read: bool,
    pub is_array: bool,
    pub default: Option<ParamDefault>,
    /// Where the default expression is written in the source.
    pub default_span: Option<Span>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParamDefault {
    Int(Int),
    Array(Arr),
}

/// A part of every segment: `[lo, hi)` in segment-local positions, `len` bound to the
/// segment's length, clipped to `[0, len)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartDecl {
    pub name: String,
    pub lo: Int,
    pub hi: Int,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceDecl {
    pub name: String,
    pub lengths: Arr,
    pub count: Int,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SegKind {
    Plain(Arr),
    Composite(Vec<PieceDecl>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegDecl {
    pub name: String,
    pub kind: SegKind,
    /// Positions to fill, `[0, fill)`; defaults to `q_len`.
    pub fill: Int,
    /// Whether the lengths or the fill read the batch index `b`: then the segmentation is
    /// laid out for each batch index (see [`crate::Bound::at_batch`]).
    pub per_batch: bool,
    pub parts: Vec<PartDecl>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GridDecl {
    pub name: String,
    /// Extents, slowest axis first (`[h, w]` or `[t, h, w]`).
    pub dims: Vec<Int>,
    /// Position of the grid's first cell.
    pub at: Int,
    pub span: Span,
}

/// A tree over positions: node `i` is position `at + i`, `parents[i]` its parent node
/// (`-1` for a root). Validated when bound (a forest: parents in range, no cycle).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeDecl {
    pub name: String,
    pub parents: Arr,
    pub at: Int,
    /// Whether the parents or the offset read `b`: then the tree is laid out per batch
    /// index, like a segmentation.
    pub per_batch: bool,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MsgPart {
    Text(String),
    Value(Int),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Require {
    pub cond: Bool,
    pub message: Vec<MsgPart>,
    pub span: Span,
    /// Whether it reads a segmentation or grid: then it is checked once they are laid out,
    /// else before (so it can guard the values they are built from).
    pub reads_structures: bool,
}

/// A checked program: everything needed to plan it for any lengths and parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    pub params: Vec<ParamDecl>,
    pub segs: Vec<SegDecl>,
    pub grids: Vec<GridDecl>,
    pub trees: Vec<TreeDecl>,
    pub requires: Vec<Require>,
    pub mask: Region,
    /// The `mask = ...;` statement.
    pub mask_span: Span,
    /// The float tensors given at attention time (`tensor NAME: [..];`), in declaration
    /// order.
    pub tensors: Vec<crate::score::TensorDecl>,
    /// The `score = ...;` statement, if any (see [`crate::score`]).
    pub score: Option<crate::score::ScoreDecl>,
    /// The `sink = T[h];` statement, if any.
    pub sink: Option<crate::score::SinkDecl>,
    /// Whether the mask reads the batch index `b` / the head index `h`.
    pub uses_b: bool,
    pub uses_h: bool,
    /// Where `b` / `h` is first read.
    pub b_span: Option<Span>,
    pub h_span: Option<Span>,
    /// Where the score first reads `h` (slopes or tables per head), which the mask's
    /// `h_span` does not count.
    pub score_h_span: Option<Span>,
    /// Whether anything the program holds (a parameter default, a segmentation, including
    /// the implicit `fill q_len`, a grid, a tree, a requirement, the mask, a tensor extent,
    /// the score) reads `q_len`, `kv_len`, `batch` or `num_heads`. Set wherever the checker
    /// resolves one of those names, so a name read only by an unused `let` counts too: when
    /// false, binding at any lengths gives the same parameters, structures and pairwise
    /// visibility, the lengths only bounding the keys (what `cm-serve` relies on to reuse
    /// one binding across sequence lengths).
    pub reads_lengths: bool,
    /// Whether the program outside its score part (`tensor`, `score`, `sink`) reads
    /// `num_heads`, a used `let` included: its masks may then differ with the head count, so
    /// a plan holds only for the heads it was bound with (a serving step binds it from the
    /// planner, not from the tensors).
    pub reads_num_heads: bool,
    /// The same for `batch`.
    pub reads_batch: bool,
}
