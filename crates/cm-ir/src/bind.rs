//! Binding: a checked [`Program`] plus lengths and parameter values becomes a [`Bound`]
//! program, with every parameter, segmentation table and grid evaluated once. Binding is
//! the step that runs per batch (new lengths, new parameters) without re-parsing.
//!
//! Also here: the exact integer semantics every later stage shares (floor division and
//! modulo, checked overflow) and the evaluation of q-side expressions at a point.

use crate::ir::*;
use crate::tree::TreeTable;
use cm_syntax::Code;
use cm_syntax::{Diagnostic, Span};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Longest supported `q_len` / `kv_len`, in tokens.
pub const MAX_LEN: i64 = 1 << 26;
/// Largest `batch` one plan may index.
pub const MAX_BATCH: i64 = 1 << 20;
/// Largest `num_heads` one plan may index.
pub const MAX_HEADS: i64 = 1 << 16;
/// The range `1 ..= max` of each length [`Program::bind`] accepts (`CM0402` outside it),
/// by the length's name.
pub const LENGTH_LIMITS: [(&str, i64); 4] = [
    ("q_len", MAX_LEN),
    ("kv_len", MAX_LEN),
    ("batch", MAX_BATCH),
    ("num_heads", MAX_HEADS),
];
/// Most (batch, head) pairs one plan may index.
pub const MAX_BATCH_HEADS: i64 = 1 << 24;
/// Most segments (or composite pieces) one segmentation may create.
pub const MAX_SEGMENTS: usize = 1 << 24;

/// Most nested `any` / `all` quantifiers.
pub const MAX_QUANT_DEPTH: usize = 4;
/// Most integers one `any` / `all` ranges over.
pub const MAX_QUANT_TERMS: i64 = 1 << 24;

/// The hint where `+` of arrays may have meant appending.
pub(crate) const CONCAT_HINT: &str =
    "to append, write `concat(A, B)` (`concat(docs, [pad])`, or `concat(docs, pad)` for one integer); `A + B` adds entry by entry and needs arrays of equal length";

/// A parameter value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    Int(i64),
    Array(Arc<[i64]>),
}

/// The lengths a program is planned for. `q_len` query rows and `kv_len` keys, positions
/// 0-based and absolute (top-left aligned); `batch` and `num_heads` only matter for masks
/// that read `b` or `h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub q_len: i64,
    pub kv_len: i64,
    pub batch: i64,
    pub num_heads: i64,
}

impl Shape {
    /// Checks each length against [`LENGTH_LIMITS`] and `batch x num_heads` against
    /// [`MAX_BATCH_HEADS`], as binding does first: callers that take an index into these
    /// lengths check it only once the lengths themselves are valid.
    ///
    /// # Errors
    /// `CM0402` ([`Code::LengthOutOfRange`]) naming the first length out of range, its value
    /// and the accepted range.
    pub fn check(&self) -> PResult<()> {
        let given = [self.q_len, self.kv_len, self.batch, self.num_heads];
        for ((name, max), v) in LENGTH_LIMITS.into_iter().zip(given) {
            if v < 1 || v > max {
                return Err(PlanError::new(
                    Code::LengthOutOfRange,
                    None,
                    format!("{name} = {v} is out of range; expected 1 ..= {max}"),
                ));
            }
        }
        if self.batch * self.num_heads > MAX_BATCH_HEADS {
            return Err(PlanError::new(
                Code::LengthOutOfRange,
                None,
                format!(
                    "batch x num_heads = {} is out of range; expected at most {MAX_BATCH_HEADS}",
                    self.batch * self.num_heads
                ),
            ));
        }
        Ok(())
    }
}

/// An error found while binding or planning: a stable code, a message, the source span
/// when one applies, and a hint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanError {
    pub code: Code,
    pub message: String,
    pub span: Option<Span>,
    pub hint: Option<String>,
}

impl PlanError {
    pub fn new(code: Code, span: Option<Span>, message: impl Into<String>) -> PlanError {
        PlanError {
            code,
            message: message.into(),
            span,
            hint: None,
        }
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> PlanError {
        self.hint = Some(hint.into());
        self
    }

    /// As a diagnostic (spanless errors point at the start of the source).
    pub fn to_diagnostic(&self) -> Diagnostic {
        let mut d = Diagnostic::error(
            self.code,
            self.span.unwrap_or_default(),
            self.message.clone(),
        );
        if let Some(h) = &self.hint {
            d = d.with_hint(h.clone());
        }
        d
    }
}

/// The error without its source, as [`Diagnostic`]'s `Display` writes it (`compilemask`
/// renders it against the source when it has a span).
impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.to_diagnostic().fmt(f)
    }
}

impl std::error::Error for PlanError {}

pub type PResult<T> = Result<T, PlanError>;

/// The hint of every `CM0302`: besides the written arithmetic, the normal forms the
/// reference and the planner both evaluate can overflow (docs/language.md, "Plan-time
/// errors").
pub const OVERFLOW_HINT: &str = "values are 64-bit signed integers; overflow is an error, \
     never wraparound. A comparison is evaluated as the difference of its sides (`k >= c` as \
     `k - c >= 0`) and `lo ..= hi` as `lo .. hi + 1`, so constants near the 64-bit limits can \
     overflow there (docs/language.md, \"Plan-time errors\")";

fn overflow(span: Span) -> PlanError {
    PlanError::new(Code::Overflow, Some(span), "integer overflow").with_hint(OVERFLOW_HINT)
}

/// Floor division (toward negative infinity).
pub fn floor_div(a: i64, d: i64, span: Span) -> PResult<i64> {
    if d == 0 {
        return Err(PlanError::new(
            Code::DivisionByZero,
            Some(span),
            "division by zero",
        ));
    }
    let q = a.checked_div(d).ok_or_else(|| overflow(span))?;
    Ok(if (a % d != 0) && ((a < 0) != (d < 0)) {
        q - 1
    } else {
        q
    })
}

/// Floor modulo: `a - d * floor_div(a, d)`, with the sign of `d`.
pub fn floor_mod(a: i64, d: i64, span: Span) -> PResult<i64> {
    if d == 0 {
        return Err(PlanError::new(
            Code::DivisionByZero,
            Some(span),
            "modulo by zero",
        ));
    }
    if d == -1 {
        return Ok(0);
    }
    let r = a % d;
    Ok(if r != 0 && ((r < 0) != (d < 0)) {
        r + d
    } else {
        r
    })
}

/// `floor(sqrt(x))` for `x >= 0`.
pub fn isqrt(x: i64, span: Span) -> PResult<i64> {
    if x < 0 {
        return Err(PlanError::new(
            Code::NegativeIsqrt,
            Some(span),
            format!("isqrt of a negative number ({x})"),
        ));
    }
    let mut r = (x as f64).sqrt() as i64;
    while r > 0 && r.checked_mul(r).is_none_or(|s| s > x) {
        r -= 1;
    }
    while (r + 1).checked_mul(r + 1).is_some_and(|s| s <= x) {
        r += 1;
    }
    Ok(r)
}

pub fn add(a: i64, b: i64, span: Span) -> PResult<i64> {
    a.checked_add(b).ok_or_else(|| overflow(span))
}

pub fn sub(a: i64, b: i64, span: Span) -> PResult<i64> {
    a.checked_sub(b).ok_or_else(|| overflow(span))
}

pub fn mul(a: i64, b: i64, span: Span) -> PResult<i64> {
    a.checked_mul(b).ok_or_else(|| overflow(span))
}

/// Applies a binary integer operator with the language's semantics.
pub fn apply(op: IntOp, a: i64, b: i64, span: Span) -> PResult<i64> {
    match op {
        IntOp::Add => add(a, b, span),
        IntOp::Sub => sub(a, b, span),
        IntOp::Mul => mul(a, b, span),
        IntOp::Div => floor_div(a, b, span),
        IntOp::Mod => floor_mod(a, b, span),
        IntOp::Min => Ok(a.min(b)),
        IntOp::Max => Ok(a.max(b)),
    }
}

/// A segmentation, laid out: segment `i` is `[starts[i], starts[i + 1])` (zero-length
/// segments are kept, so indices follow the length array).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegTable {
    pub starts: Vec<i64>,
    /// `parts[part][segment]`: absolute `[lo, hi)` of each declared part.
    pub parts: Vec<Vec<(i64, i64)>>,
    pub pieces: Option<PieceTable>,
}

/// The pieces of a composite segmentation: piece `j` is `[bounds[j], bounds[j + 1])`, of
/// kind `kinds[j]`, inside segment `seg_of[j]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceTable {
    pub bounds: Vec<i64>,
    pub kinds: Vec<u32>,
    pub seg_of: Vec<u32>,
    /// `first_of_kind[kind][segment]`: the first piece of that kind in the segment.
    pub first_of_kind: Vec<Vec<Option<u32>>>,
}

impl SegTable {
    pub fn fill(&self) -> i64 {
        *self.starts.last().unwrap_or(&0)
    }

    pub fn count(&self) -> usize {
        self.starts.len() - 1
    }

    /// Index of the segment containing `p`, for `0 <= p < fill`.
    pub fn index_of(&self, p: i64) -> usize {
        self.starts.partition_point(|&s| s <= p) - 1
    }
}

impl PieceTable {
    pub fn index_of(&self, p: i64) -> usize {
        self.bounds.partition_point(|&s| s <= p) - 1
    }
}

/// A grid with its extents evaluated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GridVals {
    /// Extents, slowest axis first.
    pub dims: Vec<i64>,
    pub at: i64,
    pub size: i64,
}

impl GridVals {
    /// Coordinates of position `p` (slowest axis first), or `None` outside the grid.
    pub fn coords(&self, p: i64) -> Option<[i64; 3]> {
        if p < self.at || p - self.at >= self.size {
            return None;
        }
        let mut local = p - self.at;
        let mut out = [0i64; 3];
        let nd = self.dims.len();
        for axis in (0..nd).rev() {
            out[axis] = local % self.dims[axis];
            local /= self.dims[axis];
        }
        Some(out)
    }
}

/// A program bound to lengths and parameter values.
#[derive(Clone, Debug)]
pub struct Bound<'p> {
    pub program: &'p Program,
    pub shape: Shape,
    pub params: Vec<Value>,
    /// Every segmentation laid out; those that read `b` ([`SegDecl::per_batch`]) for the
    /// batch index `seg_batch`.
    pub segs: Vec<SegTable>,
    pub grids: Vec<GridVals>,
    /// Every tree, validated, with its paths; those that read `b` for `seg_batch`.
    pub trees: Vec<TreeTable>,
    /// The batch index the per-batch segmentations of `segs` are laid out for (0 after
    /// [`Program::bind`]; see [`Bound::at_batch`]).
    pub seg_batch: i64,
    /// The extents of every declared tensor (`tensor NAME: [..];`), in declaration order.
    pub tensors: Vec<Vec<i64>>,
    /// The score terms at these lengths and heads; `None` when the program has no `score`
    /// or `sink` statement.
    pub score: Option<crate::score::ScoreTerms>,
}

/// The free variables of an evaluation: the query row, the key (only in `elementwise`),
/// the batch and head index, and `len` inside part declarations.
#[derive(Clone, Copy, Debug, Default)]
pub struct Env {
    pub q: i64,
    pub k: i64,
    pub b: i64,
    pub h: i64,
    pub seg_len: i64,
    /// The values of the enclosing quantifiers' variables, outermost first.
    pub vars: [i64; MAX_QUANT_DEPTH],
}

impl Program {
    /// Names of the declared parameters, in declaration order.
    pub fn param_names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// Checks that every name of `values` is a declared parameter, as [`Program::bind`] does
    /// first (for callers that bind later, or not at all).
    ///
    /// # Errors
    /// `CM0309` for the first unknown name, with the nearest declared name as a hint.
    pub fn check_param_names(&self, values: &BTreeMap<String, Value>) -> PResult<()> {
        for name in values.keys() {
            if !self.params.iter().any(|p| &p.name == name) {
                let hint = match crate::check::suggest(
                    name,
                    self.params.iter().map(|p| p.name.as_str()),
                ) {
                    Some(s) => format!("did you mean `{s}`?"),
                    None if self.params.is_empty() => "this mask takes no parameters".to_string(),
                    None => format!("its parameters are: {}", self.param_names().join(", ")),
                };
                return Err(PlanError::new(
                    Code::UnknownParam,
                    None,
                    format!("unknown parameter `{name}`"),
                )
                .with_hint(hint));
            }
        }
        Ok(())
    }

    /// A bound program with its lengths and parameters only (no structure, no score).
    fn bind_params(&self, shape: Shape, values: &BTreeMap<String, Value>) -> PResult<Bound<'_>> {
        shape.check()?;
        self.check_param_names(values)?;
        let mut b = Bound {
            program: self,
            shape,
            params: Vec::new(),
            segs: Vec::new(),
            grids: Vec::new(),
            trees: Vec::new(),
            seg_batch: 0,
            tensors: Vec::new(),
            score: None,
        };
        let env = Env::default();
        for p in &self.params {
            let v = match (values.get(&p.name), &p.default) {
                // One integer is a one-element array, and a one-element list (from a
                // file, say) is an integer.
                (Some(Value::Int(v)), _) if p.is_array => Value::Array(vec![*v].into()),
                (Some(Value::Array(a)), _) if !p.is_array && a.len() == 1 => Value::Int(a[0]),
                (Some(Value::Array(_)), _) if !p.is_array => {
                    return Err(PlanError::new(
                        Code::BadParamValue,
                        Some(p.span),
                        format!("parameter `{}` is an integer, got a list", p.name),
                    ));
                }
                (Some(v), _) => v.clone(),
                (None, Some(ParamDefault::Int(e))) => Value::Int(b.eval_int(e, &env)?),
                (None, Some(ParamDefault::Array(a))) => Value::Array(b.eval_arr(a, &env)?),
                (None, None) => {
                    return Err(PlanError::new(
                        Code::BadParamValue,
                        Some(p.span),
                        format!("parameter `{}` has no default and no value", p.name),
                    )
                    .with_hint(format!("pass it, e.g. --set {}=...", p.name)));
                }
            };
            b.params.push(v);
        }
        Ok(b)
    }

    /// Binds the program to `shape` and `values` (parameters not given take their
    /// defaults). Cost: O(segments + parameters), independent of `q_len x kv_len`.
    ///
    /// # Errors
    /// Bad lengths (`CM0402`), unknown or ill-typed parameters (`CM0309`, `CM0308`),
    /// bad segment lengths (`CM0306`, `CM0307`), grids (`CM0311`), failed `require`s
    /// (`CM0305`), bad score values or tensor extents (`CM0314`, `CM0315`) and any
    /// arithmetic error while evaluating them. The score terms cost O(num_heads + q_len +
    /// kv_len).
    pub fn bind(&self, shape: Shape, values: &BTreeMap<String, Value>) -> PResult<Bound<'_>> {
        self.bind_with(shape, values, &|_, e| e)
    }

    /// [`Program::bind`], with `annotate` applied to every error raised once the parameters
    /// are bound (structures, requirements, score terms), given their values, so that a
    /// caller can name the values an expression saw. Errors of the lengths and parameters
    /// themselves are not annotated: there are no values then.
    ///
    /// # Errors
    /// As [`Program::bind`].
    pub fn bind_with(
        &self,
        shape: Shape,
        values: &BTreeMap<String, Value>,
        annotate: &dyn Fn(&[Value], PlanError) -> PlanError,
    ) -> PResult<Bound<'_>> {
        let mut b = self.bind_params(shape, values)?;
        match b.bind_structures() {
            Ok(()) => Ok(b),
            Err(e) => Err(annotate(&b.params, e)),
        }
    }

    /// Whether some segmentation or tree reads the batch index `b`.
    pub fn has_per_batch_segs(&self) -> bool {
        self.segs.iter().any(|s| s.per_batch) || self.trees.iter().any(|t| t.per_batch)
    }
}

impl<'p> Bound<'p> {
    /// Everything [`Program::bind`] builds after the parameters: grids, segmentations,
    /// trees, the requirements, tensor extents and score terms.
    fn bind_structures(&mut self) -> PResult<()> {
        let program = self.program;
        let env = Env::default();
        // The requirements that read no structure guard the values structures are built
        // from, so they come first.
        self.check_requires(false)?;
        for g in &program.grids {
            let mut dims = Vec::new();
            let mut size = 1i64;
            for d in &g.dims {
                let v = self.eval_int(d, &env)?;
                if v < 1 {
                    return Err(PlanError::new(
                        Code::BadGrid,
                        Some(d.span),
                        format!("grid `{}` has extent {v}; extents must be >= 1", g.name),
                    ));
                }
                size = mul(size, v, d.span)?;
                dims.push(v);
            }
            let at = self.eval_int(&g.at, &env)?;
            if at < 0 {
                return Err(PlanError::new(
                    Code::BadGrid,
                    Some(g.at.span),
                    format!("grid `{}` starts at {at}; expected a position >= 0", g.name),
                ));
            }
            add(at, size, g.span)?;
            self.grids.push(GridVals { dims, at, size });
        }
        for s in &program.segs {
            let table = self.lay_out(s, 0)?;
            self.segs.push(table);
        }
        for t in &program.trees {
            let table = self.lay_out_tree(t, 0)?;
            self.trees.push(table);
        }
        // Then the requirements that read a structure (`require doc.count <= 64`).
        self.check_requires(true)?;
        self.tensors = self.tensor_extents()?;
        self.score = self.bind_score()?;
        Ok(())
    }

    /// The program with its per-batch segmentations and trees laid out for batch index `b`:
    /// borrowed when none reads `b` or they already are. Cost O(their segments and nodes).
    ///
    /// # Errors
    /// Any error of laying them out at `b` (`CM0306`, `CM0307`, `CM0304`, overflow), its
    /// message naming the batch index.
    pub fn at_batch(&self, b: i64) -> PResult<std::borrow::Cow<'_, Bound<'p>>> {
        if b == self.seg_batch || !self.program.has_per_batch_segs() {
            return Ok(std::borrow::Cow::Borrowed(self));
        }
        let mut out = self.clone();
        out.seg_batch = b;
        for (i, s) in self.program.segs.iter().enumerate() {
            if s.per_batch {
                out.segs[i] = self.lay_out(s, b).map_err(|mut e| {
                    e.message = format!("{} (segmentation `{}` at b = {b})", e.message, s.name);
                    e
                })?;
            }
        }
        for (i, t) in self.program.trees.iter().enumerate() {
            if t.per_batch {
                out.trees[i] = self.lay_out_tree(t, b).map_err(|mut e| {
                    e.message = format!("{} (at b = {b})", e.message);
                    e
                })?;
            }
        }
        Ok(std::borrow::Cow::Owned(out))
    }

    /// Tree `t` evaluated for batch index `b` and validated.
    fn lay_out_tree(&self, t: &TreeDecl, b: i64) -> PResult<TreeTable> {
        let env = Env {
            b,
            ..Env::default()
        };
        let parents = self.eval_arr(&t.parents, &env)?;
        let at = self.eval_int(&t.at, &env)?;
        TreeTable::build(&t.name, parents, at, t.span)
    }

    /// Checks the requirements that read a segmentation or grid (`later`), or those that do
    /// not.
    fn check_requires(&self, later: bool) -> PResult<()> {
        let env = Env::default();
        for r in self
            .program
            .requires
            .iter()
            .filter(|r| r.reads_structures == later)
        {
            if !self.eval_bool(&r.cond, &env)? {
                let mut msg = String::new();
                for part in &r.message {
                    match part {
                        MsgPart::Text(t) => msg.push_str(t),
                        MsgPart::Value(i) => msg.push_str(&self.eval_int(i, &env)?.to_string()),
                    }
                }
                if msg.is_empty() {
                    msg = "a `require` of the mask does not hold".into();
                }
                return Err(PlanError::new(Code::RequireFailed, Some(r.span), msg).with_hint(
                    "this `require` of the mask does not hold for the given lengths and parameters",
                ));
            }
        }
        Ok(())
    }

    /// Lays out segmentation `s` for batch index `b` (read only by per-batch ones).
    fn lay_out(&self, s: &SegDecl, b: i64) -> PResult<SegTable> {
        let env = Env {
            b,
            ..Env::default()
        };
        let fill = self.eval_int(&s.fill, &env)?;
        if !(0..=MAX_LEN).contains(&fill) {
            return Err(PlanError::new(
                Code::LengthOutOfRange,
                Some(s.fill.span),
                format!(
                    "segmentation `{}` fills {fill} positions; expected 0 ..= {MAX_LEN}",
                    s.name
                ),
            ));
        }
        let check_arr = |a: &Arc<[i64]>, span: Span| -> PResult<()> {
            if let Some((i, v)) = a.iter().enumerate().find(|(_, v)| **v < 0) {
                return Err(PlanError::new(
                    Code::NegativeSegment,
                    Some(span),
                    format!("length {v} at index {i} of `{}` is negative", s.name),
                )
                .with_hint("segment lengths are token counts >= 0"));
            }
            Ok(())
        };
        let too_many = || {
            PlanError::new(
                Code::TooLargeToPlan,
                Some(s.span),
                format!(
                    "segmentation `{}` needs more than {MAX_SEGMENTS} segments",
                    s.name
                ),
            )
        };
        let mut starts = vec![0i64];
        let mut pieces = None;
        match &s.kind {
            SegKind::Plain(arr) => {
                let a = self.eval_arr(arr, &env)?;
                check_arr(&a, s.span)?;
                if fill > 0 && a.iter().all(|&v| v == 0) {
                    return Err(PlanError::new(
                        Code::CannotFill,
                        Some(s.span),
                        format!(
                            "the lengths of `{}` sum to 0, so they cannot fill {fill} positions",
                            s.name
                        ),
                    )
                    .with_hint("give at least one positive length"));
                }
                let mut pos = 0i64;
                let mut i = 0usize;
                while pos < fill {
                    let len = a[i % a.len()].min(fill - pos);
                    pos += len;
                    starts.push(pos);
                    i += 1;
                    if i > MAX_SEGMENTS {
                        return Err(too_many());
                    }
                }
            }
            SegKind::Composite(decls) => {
                let mut arrays = Vec::new();
                let mut total = 0i64;
                for d in decls {
                    let a = self.eval_arr(&d.lengths, &env)?;
                    check_arr(&a, d.span)?;
                    let c = self.eval_int(&d.count, &env)?;
                    if !(0..=1 << 20).contains(&c) {
                        return Err(PlanError::new(
                            Code::BadParamValue,
                            Some(d.count.span),
                            format!(
                                "piece `{}` repeats {c} times; expected 0 ..= 1048576",
                                d.name
                            ),
                        ));
                    }
                    if a.is_empty() && c > 0 {
                        return Err(PlanError::new(Code::CannotFill, Some(d.span), format!("the lengths of piece `{}` are an empty array, but each segment takes {c} of them", d.name))
                            .with_hint("give at least one length"));
                    }
                    if c > 0 && a.iter().any(|&v| v > 0) {
                        total += 1;
                    }
                    arrays.push((a, c));
                }
                if fill > 0 && total == 0 {
                    return Err(PlanError::new(Code::CannotFill, Some(s.span), format!("the pieces of `{}` add no tokens, so they cannot fill {fill} positions", s.name)));
                }
                let mut t = PieceTable {
                    bounds: vec![0],
                    kinds: Vec::new(),
                    seg_of: Vec::new(),
                    first_of_kind: vec![Vec::new(); decls.len()],
                };
                let mut counters = vec![0usize; decls.len()];
                let mut pos = 0i64;
                while pos < fill {
                    let seg = starts.len() - 1;
                    for (kind, (a, c)) in arrays.iter().enumerate() {
                        t.first_of_kind[kind].push(None);
                        for _ in 0..*c {
                            let len = a[counters[kind] % a.len()].min(fill - pos);
                            counters[kind] += 1;
                            if t.first_of_kind[kind][seg].is_none() && len > 0 {
                                t.first_of_kind[kind][seg] = Some(t.kinds.len() as u32);
                            }
                            pos += len;
                            t.bounds.push(pos);
                            t.kinds.push(kind as u32);
                            t.seg_of.push(seg as u32);
                            if t.kinds.len() > MAX_SEGMENTS {
                                return Err(too_many());
                            }
                        }
                    }
                    starts.push(pos);
                }
                pieces = Some(t);
            }
        }
        let mut table = SegTable {
            starts,
            parts: Vec::new(),
            pieces,
        };
        for p in &s.parts {
            let mut ranges = Vec::with_capacity(table.count());
            for i in 0..table.count() {
                let (start, end) = (table.starts[i], table.starts[i + 1]);
                let len = end - start;
                let env = Env {
                    seg_len: len,
                    ..Env::default()
                };
                let lo = self.eval_int(&p.lo, &env)?.clamp(0, len);
                let hi = self.eval_int(&p.hi, &env)?.clamp(lo, len);
                ranges.push((start + lo, start + hi));
            }
            table.parts.push(ranges);
        }
        Ok(table)
    }

    fn seg_pos(&self, s: SegId, p: i64, span: Span) -> PResult<usize> {
        let t = &self.segs[s];
        if p < 0 || p >= t.fill() {
            return Err(PlanError::new(
                Code::OutsideSegmentation,
                Some(span),
                format!(
                    "position {p} is outside segmentation `{}`, which covers [0, {})",
                    self.program.segs[s].name,
                    t.fill()
                ),
            )
            .with_hint("segmentations fill [0, q_len) unless declared with `fill`"));
        }
        Ok(t.index_of(p))
    }

    /// Evaluates a range to `[lo, hi)`.
    pub fn eval_range(&self, r: &RangeE, env: &Env) -> PResult<(i64, i64)> {
        match &r.kind {
            RangeKind::Lit(lo, hi) => Ok((self.eval_int(lo, env)?, self.eval_int(hi, env)?)),
            RangeKind::Seg(s, p) => {
                let i = self.seg_pos(*s, self.eval_int(p, env)?, p.span)?;
                Ok((self.segs[*s].starts[i], self.segs[*s].starts[i + 1]))
            }
            RangeKind::SegAt(s, i) => {
                let iv = self.eval_int(i, env)?;
                let t = &self.segs[*s];
                if iv < 0 || iv as usize >= t.count() {
                    return Err(PlanError::new(
                        Code::IndexOutOfRange,
                        Some(i.span),
                        format!(
                            "segment index {iv} is out of range; `{}` has {} segments",
                            self.program.segs[*s].name,
                            t.count()
                        ),
                    ));
                }
                Ok((t.starts[iv as usize], t.starts[iv as usize + 1]))
            }
            RangeKind::Part(s, part, p) => {
                let i = self.seg_pos(*s, self.eval_int(p, env)?, p.span)?;
                Ok(self.segs[*s].parts[*part][i])
            }
            RangeKind::Piece(s, kind, p) => {
                let pv = self.eval_int(p, env)?;
                let seg = self.seg_pos(*s, pv, p.span)?;
                let t = self.segs[*s]
                    .pieces
                    .as_ref()
                    .expect("checked: piece of a composite segmentation");
                Ok(piece_range(t, &self.segs[*s], *kind, pv, seg))
            }
        }
    }

    /// Evaluates an array.
    pub fn eval_arr(&self, a: &Arr, env: &Env) -> PResult<Arc<[i64]>> {
        match a {
            Arr::Param(id) => match &self.params[*id] {
                Value::Array(v) => Ok(v.clone()),
                Value::Int(_) => unreachable!("checked: array parameter"),
            },
            Arr::Const(v) => Ok(v.clone()),
            Arr::Lit(xs) => xs
                .iter()
                .map(|x| self.eval_int(x, env))
                .collect::<PResult<Vec<_>>>()
                .map(Into::into),
            Arr::Add(x, y, span) => {
                let (x, y) = (self.eval_arr(x, env)?, self.eval_arr(y, env)?);
                if x.len() != y.len() {
                    return Err(PlanError::new(
                        Code::BadParamValue,
                        Some(*span),
                        format!(
                            "`+` adds arrays entry by entry, but these have {} and {} entries",
                            x.len(),
                            y.len()
                        ),
                    )
                    .with_hint(CONCAT_HINT));
                }
                x.iter()
                    .zip(y.iter())
                    .map(|(a, b)| add(*a, *b, *span))
                    .collect::<PResult<Vec<_>>>()
                    .map(Into::into)
            }
            Arr::Concat(xs, _) => {
                let mut out = Vec::new();
                for x in xs {
                    out.extend_from_slice(&self.eval_arr(x, env)?);
                }
                Ok(out.into())
            }
            Arr::Slice(x, r, span) => {
                let x = self.eval_arr(x, env)?;
                let (lo, hi) = self.eval_range(r, env)?;
                if lo < 0 || hi < lo || hi as usize > x.len() {
                    return Err(PlanError::new(
                        Code::IndexOutOfRange,
                        Some(*span),
                        format!(
                            "slice {lo}..{hi} is out of range for an array of length {}",
                            x.len()
                        ),
                    )
                    .with_hint("a slice `a[lo .. hi]` needs 0 <= lo <= hi <= count(a)"));
                }
                Ok(x[lo as usize..hi as usize].into())
            }
        }
    }

    /// Evaluates an integer expression at a point.
    pub fn eval_int(&self, e: &Int, env: &Env) -> PResult<i64> {
        // The commonest leaves nest nothing, so they skip the stack count: they are most of
        // a short predicate's nodes, which `elementwise` evaluates once a pair.
        match e.kind {
            IntKind::Const(v) => Ok(v),
            IntKind::K => Ok(env.k),
            IntKind::Q => Ok(env.q),
            _ => crate::deep(|| self.eval_int_at(e, env)),
        }
    }

    fn eval_int_at(&self, e: &Int, env: &Env) -> PResult<i64> {
        let span = e.span;
        Ok(match &e.kind {
            IntKind::Const(v) => *v,
            IntKind::Q => env.q,
            IntKind::K => env.k,
            IntKind::B => env.b,
            IntKind::H => env.h,
            IntKind::QLen => self.shape.q_len,
            IntKind::KvLen => self.shape.kv_len,
            IntKind::Batch => self.shape.batch,
            IntKind::NumHeads => self.shape.num_heads,
            IntKind::SegLen => env.seg_len,
            IntKind::Param(id) => match &self.params[*id] {
                Value::Int(v) => *v,
                Value::Array(_) => unreachable!("checked: integer parameter"),
            },
            IntKind::ArrIndex(a, i) => {
                let a = self.eval_arr(a, env)?;
                let iv = self.eval_int(i, env)?;
                if iv < 0 || iv as usize >= a.len() {
                    return Err(PlanError::new(
                        Code::IndexOutOfRange,
                        Some(span),
                        format!(
                            "index {iv} is out of range for an array of length {}",
                            a.len()
                        ),
                    ));
                }
                a[iv as usize]
            }
            IntKind::ArrLen(a) => self.eval_arr(a, env)?.len() as i64,
            IntKind::ArrSum(a) => {
                let a = self.eval_arr(a, env)?;
                a.iter().try_fold(0i64, |s, v| add(s, *v, span))?
            }
            IntKind::Neg(a) => self
                .eval_int(a, env)?
                .checked_neg()
                .ok_or_else(|| overflow(span))?,
            IntKind::Abs(a) => self
                .eval_int(a, env)?
                .checked_abs()
                .ok_or_else(|| overflow(span))?,
            IntKind::Isqrt(a) => isqrt(self.eval_int(a, env)?, span)?,
            IntKind::Bin(op, a, b) => {
                apply(*op, self.eval_int(a, env)?, self.eval_int(b, env)?, span)?
            }
            IntKind::If(c, a, b) => {
                if self.eval_bool(c, env)? {
                    self.eval_int(a, env)?
                } else {
                    self.eval_int(b, env)?
                }
            }
            IntKind::RangeLo(r) => self.eval_range(r, env)?.0,
            IntKind::RangeHi(r) => self.eval_range(r, env)?.1,
            IntKind::SegIndex(s, p) => self.seg_pos(*s, self.eval_int(p, env)?, p.span)? as i64,
            IntKind::SegCount(s) => self.segs[*s].count() as i64,
            IntKind::Var(d) => env.vars[*d as usize],
            IntKind::GridCoord(g, axis, p) => {
                let pv = self.eval_int(p, env)?;
                match self.grids[*g].coords(pv) {
                    Some(c) => c[*axis as usize],
                    None => return Err(self.outside_grid(*g, pv, p.span, p.has_k())),
                }
            }
        })
    }

    /// `CM0310` for the coordinates of position `p` outside grid `g`; `of_key` says whether
    /// the position reads `k`, whose guard is a region (`k in G & ...`), since an `if`
    /// condition cannot read `k`.
    pub fn outside_grid(&self, g: GridId, p: i64, span: Span, of_key: bool) -> PlanError {
        let gv = &self.grids[g];
        let name = &self.program.grids[g].name;
        PlanError::new(
            Code::OutsideGrid,
            Some(span),
            format!(
                "position {p} is not in grid `{name}`, which covers [{}, {})",
                gv.at,
                gv.at + gv.size
            ),
        )
        .with_hint(if of_key {
            format!(
                "guard key coordinates with `k in {name} & ...`: `&` evaluates its right side \
                 only where its left side holds"
            )
        } else {
            format!("guard coordinates with `if q in {name} then ... else ...`")
        })
    }

    /// Evaluates a boolean; `and` / `or` short-circuit.
    pub fn eval_bool(&self, e: &Bool, env: &Env) -> PResult<bool> {
        crate::deep(|| self.eval_bool_at(e, env))
    }

    fn eval_bool_at(&self, e: &Bool, env: &Env) -> PResult<bool> {
        Ok(match e {
            Bool::Const(v) => *v,
            Bool::Cmp(op, a, b) => cmp(*op, self.eval_int(a, env)?, self.eval_int(b, env)?),
            Bool::And(a, b) => self.eval_bool(a, env)? && self.eval_bool(b, env)?,
            Bool::Or(a, b) => self.eval_bool(a, env)? || self.eval_bool(b, env)?,
            Bool::Not(a) => !self.eval_bool(a, env)?,
            Bool::InGrid(g, p) => self.grids[*g].coords(self.eval_int(p, env)?).is_some(),
        })
    }
}

/// The range a piece kind gives at position `p` in segment `seg`: the piece of that kind
/// containing `p`, else the segment's first piece of that kind, else the empty range at the
/// segment's end.
pub fn piece_range(t: &PieceTable, segs: &SegTable, kind: usize, p: i64, seg: usize) -> (i64, i64) {
    let j = t.index_of(p);
    if t.kinds[j] as usize == kind {
        return (t.bounds[j], t.bounds[j + 1]);
    }
    match t.first_of_kind[kind][seg] {
        Some(f) => (t.bounds[f as usize], t.bounds[f as usize + 1]),
        None => (segs.starts[seg + 1], segs.starts[seg + 1]),
    }
}

/// The integers `[lo, hi)` an `any` / `all` ranges over: `CM0404` past
/// [`MAX_QUANT_TERMS`] (an empty range when `hi <= lo`).
pub fn quant_range(lo: i64, hi: i64, span: Span) -> PResult<std::ops::Range<i64>> {
    if i128::from(hi) - i128::from(lo) > i128::from(MAX_QUANT_TERMS) {
        return Err(PlanError::new(
            Code::TooLargeToPlan,
            Some(span),
            format!(
                "`any` / `all` over {lo}..{hi} ranges over more than {MAX_QUANT_TERMS} integers"
            ),
        ));
    }
    Ok(lo..hi.max(lo))
}

pub fn cmp(op: cm_syntax::CmpOp, a: i64, b: i64) -> bool {
    use cm_syntax::CmpOp::*;
    match op {
        Lt => a < b,
        Le => a <= b,
        Gt => a > b,
        Ge => a >= b,
        Eq => a == b,
        Ne => a != b,
    }
}
