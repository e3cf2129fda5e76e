//! Scores: how a visible pair's logit is formed, beside the mask that decides which pairs
//! are visible. The language's `score` and `sink` statements (docs/language.md, "Scores")
//! are checked into a [`ScoreDecl`] (the expression as written, [`ScoreExpr`], and its
//! normal form, [`ScoreForm`]) and a [`SinkDecl`]; binding turns them into the
//! [`ScoreTerms`] that kernels and the CPU reference consume.
//!
//! Semantics, for a visible pair `(q, k)` of head `h` (0-based absolute positions, the same
//! as the mask's): `s = softmax_scale * dot(Q[q], K[k])`; `s1 = c * tanh(s / c)` with a
//! softcap `c`, else `s`; `s2 = s1 + linear_bias(q, k, h) + table_bias(q, k, h)`. The row's
//! softmax runs over its visible keys plus, with a sink, one extra logit `sink[h]` whose
//! value vector is 0: `lse = ln(sum_k exp(s2) + exp(sink[h]))`. A row with no visible key
//! has output 0 and `lse = -inf` without a sink, `sink[h]` with one; a sink never makes a
//! key visible.

use crate::bind::{Bound, Env, PResult, PlanError, MAX_HEADS};
use crate::ir::{Bool, Int, IntKind};
use cm_syntax::ast::{show_float, FloatBits};
use cm_syntax::{Code, Span};

pub type TensorId = usize;

/// The score terms of a plan, bound to its lengths and heads: what the kernels consume.
/// Every field is optional; a plan whose program has no `score` or `sink` statement carries
/// none (`Plan::score` is `None`), never an empty value.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreTerms {
    /// Logit softcapping `s -> c * tanh(s / c)` (Gemma 2), applied first; `c > 0`, finite.
    pub softcap: Option<f32>,
    /// An additive bias linear in the positions, with a per-head slope (ALiBi).
    pub linear: Option<LinearBias>,
    /// An additive bias read from a tensor given at attention time (T5's relative bias).
    pub table: Option<TableBias>,
    /// The name of a float tensor `[num_heads]` given at attention time: one learnable logit
    /// per head that joins every row's softmax with value vector 0.
    pub sink: Option<String>,
}

/// `bias(q, k, h) = slopes[h] * (q_coef * q + k_coef * k + offset)`, with `q` and `k` the
/// absolute 0-based positions of the program. ALiBi (Press et al., "Train Short, Test Long",
/// 2022) is `slopes = -alibi_slopes(num_heads)`, `q_coef = 1`, `k_coef = -1`, `offset = 0`;
/// its bottom-right form has `offset = kv_len - q_len`. The slopes are constants of the
/// program (no gradient).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearBias {
    /// One slope per query head, `num_heads` entries.
    pub slopes: Vec<f32>,
    /// Whether the slope may differ between heads (its expression reads `h`, `num_heads`
    /// or a parameter). When false every entry of `slopes` is the same, and terms bound for
    /// one head apply to any number of heads.
    pub per_head: bool,
    pub q_coef: i32,
    pub k_coef: i32,
    pub offset: i64,
}

/// `bias(q, k, h) = T[h, bucket[q - k + kv_len - 1]]` (or `T[bucket[..]]` when not
/// `per_head`), with `T` the float tensor named `tensor`, `[num_heads, num_buckets]` or
/// `[num_buckets]`, row-major, given at attention time (learnable: gradients wanted).
#[derive(Clone, Debug, PartialEq)]
pub struct TableBias {
    pub tensor: String,
    pub num_buckets: u32,
    pub per_head: bool,
    /// The bucket of every distance `d = q - k` in `[-(kv_len - 1), q_len - 1]`, at index
    /// `d + kv_len - 1`: `q_len + kv_len - 1` entries, each `< num_buckets`.
    pub bucket: Vec<u32>,
}

impl ScoreTerms {
    /// Whether a term reads the positions `q` or `k`: a linear bias with a nonzero
    /// coefficient, or a bias table. Such terms have no meaning under a token order, and in
    /// packed plans only where every sample's positions start together.
    pub fn reads_positions(&self) -> bool {
        self.table.is_some()
            || self
                .linear
                .as_ref()
                .is_some_and(|l| l.q_coef != 0 || l.k_coef != 0)
    }

    /// The linear bias of pair `(q, k)` in head `h` (0 without a linear term), in `f64` from
    /// the `f32` slopes.
    pub fn linear_bias(&self, q: i64, k: i64, h: usize) -> f64 {
        self.linear.as_ref().map_or(0.0, |l| {
            let x = i128::from(l.q_coef) * i128::from(q)
                + i128::from(l.k_coef) * i128::from(k)
                + i128::from(l.offset);
            f64::from(l.slope(h)) * x as f64
        })
    }

    /// Whether a term is bound per head (slopes that may differ between heads, a table with
    /// a row per head, a sink per head): then the terms apply only to the `num_heads` they
    /// were bound for. Otherwise terms bound for any head count apply to every head.
    pub fn per_head(&self) -> bool {
        self.sink.is_some()
            || self.table.as_ref().is_some_and(|t| t.per_head)
            || self.linear.as_ref().is_some_and(|l| l.per_head)
    }
}

impl LinearBias {
    /// The slope of head `h` (any head when the slope is not per head).
    pub fn slope(&self, h: usize) -> f32 {
        self.slopes[if self.per_head { h } else { 0 }]
    }
}

impl TableBias {
    /// How many of the table's `num_buckets` entries some distance of the plan reads. Cost
    /// O(distances x log), whatever `num_buckets` is.
    pub fn buckets_read(&self) -> usize {
        let mut read = self.bucket.clone();
        read.sort_unstable();
        read.dedup();
        read.len()
    }

    /// The bucket of pair `(q, k)` for a plan of `kv_len` keys; `q < q_len`, `k < kv_len`.
    pub fn bucket_of(&self, q: usize, k: usize, kv_len: usize) -> u32 {
        self.bucket[q + kv_len - 1 - k]
    }

    /// The flat index into the table tensor of pair `(q, k)` in head `h`.
    pub fn index(&self, q: usize, k: usize, h: usize, kv_len: usize) -> usize {
        let b = self.bucket_of(q, k, kv_len) as usize;
        if self.per_head {
            h * self.num_buckets as usize + b
        } else {
            b
        }
    }

    /// The table tensor's extents for `num_heads` heads.
    pub fn dims(&self, num_heads: usize) -> Vec<usize> {
        if self.per_head {
            vec![num_heads, self.num_buckets as usize]
        } else {
            vec![self.num_buckets as usize]
        }
    }
}

/// The ALiBi slopes of `num_heads` heads, head 0 first, as positive numbers (the bias is
/// `-slope * (q - k)`): for a power of two `n`, head `i` has `2^(-8 (i + 1) / n)`; for
/// other counts, the slopes of the power of two `p` below `n`, then every other slope of
/// `2p` heads (those of odd index in `1 ..= 2p`, `2^(-8 (2j + 1) / (2p))`) until there are
/// `n`. This is `get_slopes` of Press et al., "Train Short, Test Long: Attention with
/// Linear Biases Enables Input Length Extrapolation" (ICLR 2022, the authors' repository)
/// and BLOOM's `build_alibi_tensor` (Hugging Face transformers), evaluated exactly in
/// `f64` rather than as repeated products. Empty for 0 heads.
pub fn alibi_slopes(num_heads: usize) -> Vec<f64> {
    (0..num_heads).map(|i| alibi_slope(num_heads, i)).collect()
}

/// The ALiBi slope of head `head` of `num_heads` heads, `alibi_slopes(num_heads)[head]`, in
/// O(1): the score reads one slope per head, and building the whole list for each of them
/// cost O(num_heads^2) (20 s of planning at 2^16 heads).
///
/// # Panics
/// Unless `head < num_heads`.
pub fn alibi_slope(num_heads: usize, head: usize) -> f64 {
    assert!(head < num_heads, "head {head} of {num_heads} ALiBi heads");
    let p = 1usize << num_heads.ilog2();
    let slope = |num: usize, den: usize| (-8.0 * num as f64 / den as f64).exp2();
    if head < p {
        slope(head + 1, p)
    } else {
        slope(2 * (head - p) + 1, 2 * p)
    }
}

/// T5's relative-position bucket, exactly as Hugging Face transformers'
/// `T5Attention._relative_position_bucket(relative_position, bidirectional, num_buckets,
/// max_distance)` (Raffel et al., "Exploring the Limits of Transfer Learning with a Unified
/// Text-to-Text Transformer", JMLR 2020; mesh_tensorflow's `_relative_position_bucket`),
/// where `relative_position` is `k - q` (memory position minus query position).
///
/// Bidirectional: half the buckets for `k > q` (`num_buckets /= 2`, and `num_buckets` is
/// added when `relative_position > 0`), then `n = |relative_position|`; unidirectional: `n =
/// max(-relative_position, 0)` (keys after the query share bucket 0). With `max_exact =
/// num_buckets / 2`, `n < max_exact` is its own bucket; larger `n` get `max_exact +
/// trunc(ln(n / max_exact) / ln(max_distance / max_exact) * (num_buckets - max_exact))`,
/// at most `num_buckets - 1`. The logarithm is evaluated in `f32` in the reference's order
/// (`f32(n) / f32(max_exact)`, `ln` in `f32`, divided by `f32(ln(max_distance / max_exact))`
/// taken in `f64`, times `f32(num_buckets - max_exact)`, truncated), as PyTorch does on the
/// CPU for `float32` tensors.
///
/// # Errors
/// `CM0314` unless `num_buckets >= 2` (`>= 4` when bidirectional, so `max_exact >= 1`) and
/// `max_distance > max_exact`.
pub fn t5_bucket(
    relative_position: i64,
    bidirectional: bool,
    num_buckets: i64,
    max_distance: i64,
    span: Option<Span>,
) -> PResult<i64> {
    let mut nb = num_buckets;
    let mut bucket = 0i64;
    let n = if bidirectional {
        nb /= 2;
        if relative_position > 0 {
            bucket += nb;
        }
        relative_position.unsigned_abs()
    } else {
        (-relative_position.min(0)).unsigned_abs()
    };
    let max_exact = nb / 2;
    if max_exact < 1 || max_distance <= max_exact {
        let call = format!(
            "t5_bucket(num_buckets = {num_buckets}, max_distance = {max_distance}{})",
            if bidirectional { ", bidirectional" } else { "" }
        );
        let message = if max_exact < 1 {
            format!(
                "{call} has no exact bucket; expected num_buckets >= {}",
                if bidirectional { 4 } else { 2 }
            )
        } else {
            format!("{call} has {max_exact} exact buckets and needs max_distance above them")
        };
        return Err(PlanError::new(Code::BadScoreValue, span, message)
        .with_hint(
            "num_buckets must be >= 2 (>= 4 when bidirectional) and max_distance > num_buckets / 2 \
             (/ 4 when bidirectional); T5's defaults are 32 and 128",
        ));
    }
    if n < max_exact as u64 {
        return Ok(bucket + n as i64);
    }
    let ratio = (n as f32 / max_exact as f32).ln();
    let scale = (max_distance as f64 / max_exact as f64).ln() as f32;
    let large = max_exact + (ratio / scale * (nb - max_exact) as f32) as i64;
    Ok(bucket + large.min(nb - 1))
}

/// A float-valued expression of a `score` statement, as written (the pairwise reference
/// evaluates it directly, [`Bound::score_at`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScoreExpr {
    pub kind: ScoreKind,
    pub span: Span,
}

impl ScoreExpr {
    /// Whether some node of the expression satisfies `f`.
    pub fn any_node(&self, f: &impl Fn(&ScoreKind) -> bool) -> bool {
        if f(&self.kind) {
            return true;
        }
        match &self.kind {
            ScoreKind::Neg(a) => a.any_node(f),
            ScoreKind::Bin(_, a, b) | ScoreKind::Softcap(a, b) => a.any_node(f) || b.any_node(f),
            ScoreKind::Index(FloatArr::Lit(xs), _) => xs.iter().any(|x| x.any_node(f)),
            _ => false,
        }
    }

    /// Whether an integer part of the expression (indices included) has a leaf for which
    /// `leaf` holds.
    pub fn reads(&self, leaf: &impl Fn(&IntKind) -> bool) -> bool {
        self.any_node(&|k| match k {
            ScoreKind::Int(i) => i.mentions(leaf),
            ScoreKind::Index(arr, i) => {
                i.mentions(leaf) || matches!(arr, FloatArr::Alibi(n) if n.mentions(leaf))
            }
            ScoreKind::Table { head, bucket, .. } => {
                head.as_ref().is_some_and(|x| x.mentions(leaf))
                    || match bucket {
                        Bucket::Int(i) => i.mentions(leaf),
                        Bucket::T5 { relative, .. } => relative.mentions(leaf),
                    }
            }
            _ => false,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatOp {
    Add,
    Sub,
    Mul,
    Div,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScoreKind {
    /// `score`: the raw scaled score of the pair, `softmax_scale * dot(Q[q], K[k])`.
    Raw,
    Const(FloatBits),
    /// An integer expression (it may read `q`, `k`, `h`, lengths and parameters) as a float.
    Int(Int),
    Neg(Box<ScoreExpr>),
    Bin(FloatOp, Box<ScoreExpr>, Box<ScoreExpr>),
    /// `softcap(x, c)`: `c * tanh(x / c)`.
    Softcap(Box<ScoreExpr>, Box<ScoreExpr>),
    /// An entry of a float array.
    Index(FloatArr, Int),
    /// `T[head][bucket]` (or `T[bucket]`) of a tensor given at attention time.
    Table {
        tensor: TensorId,
        head: Option<Int>,
        bucket: Bucket,
    },
}

/// A float array of a score: a literal, or `alibi_slopes(n)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FloatArr {
    Lit(Vec<ScoreExpr>),
    /// `alibi_slopes(n)`: [`alibi_slopes`] of `n` heads.
    Alibi(Int),
}

/// The bucket index of a bias table: a function of the distance `q - k` only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bucket {
    /// An integer expression in which `q` and `k` occur only as `q - k` or `k - q`.
    Int(Int),
    /// `t5_bucket(relative_position, num_buckets, max_distance, bidirectional)`, see
    /// [`t5_bucket`]; `relative_position` reads `q` and `k` only as `q - k` or `k - q`.
    T5 {
        relative: Int,
        num_buckets: Int,
        max_distance: Int,
        bidirectional: Bool,
        span: Span,
    },
}

/// The normal form of a score, shape-agnostic: what binding evaluates into [`ScoreTerms`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScoreForm {
    /// The softcap `c` (reads lengths and parameters only).
    pub softcap: Option<ScoreExpr>,
    pub linear: Option<LinearForm>,
    pub table: Option<TableForm>,
}

/// `slope(h) * (q_coef * q + k_coef * k + offset)`; `slope` reads `h`, lengths and
/// parameters, the integers lengths and parameters only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearForm {
    pub slope: ScoreExpr,
    pub q_coef: Int,
    pub k_coef: Int,
    pub offset: Int,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableForm {
    pub tensor: TensorId,
    pub per_head: bool,
    pub bucket: Bucket,
    pub span: Span,
}

/// `tensor NAME: [D1, ...];`: a float tensor given at attention time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    pub name: String,
    pub dims: Vec<Int>,
    pub span: Span,
}

/// A checked `score = ...;` statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScoreDecl {
    pub expr: ScoreExpr,
    pub form: ScoreForm,
    pub span: Span,
}

/// A checked `sink = T[h];` statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkDecl {
    pub tensor: TensorId,
    pub span: Span,
}

/// The values of the tensors a score reads, by name, each row-major at its declared
/// extents (for the pairwise reference, [`Bound::score_at`]).
pub type TensorValues<'a> = [(&'a str, &'a [f64])];

fn bad_value(span: Span, message: String) -> PlanError {
    PlanError::new(Code::BadScoreValue, Some(span), message)
}

fn bad_table(span: Span, message: String) -> PlanError {
    PlanError::new(Code::BadScoreTable, Some(span), message)
}

/// `v`, a constant of the score that the kernels take as an `f32` (`what` names it), in
/// `f32`. A nonzero value that `f32` rounds to 0, or one it cannot hold, would change the
/// terms without a word: `CM0314`, naming the value and the range.
fn kernel_f32(v: f64, span: Span, what: impl Fn() -> String) -> PResult<f32> {
    let f = v as f32;
    let why = if !v.is_finite() {
        "it is not a finite number"
    } else if !f.is_finite() {
        "f32 rounds it to infinity"
    } else if f == 0.0 && v != 0.0 {
        "f32 rounds it to 0"
    } else {
        return Ok(f);
    };
    Err(bad_value(
        span,
        format!(
            "{} is {}, which the kernels take as an f32, and {why}; expected 0 or a magnitude from {:e} to {:e}",
            what(),
            show_float(v),
            f32::from_bits(1),
            f32::MAX
        ),
    )
    .with_hint("write 0 (or leave the term out) for no bias; a coefficient is stored as one f32 per head"))
}

/// Most elements of one declared tensor: its extents multiplied. A table's buckets go to
/// the kernels' gather as `int32` indices, so `num_buckets` must stay below `2^31`; the cap
/// on the whole tensor also keeps every size computed from it in range (and the tensor
/// within 8 GiB of `f32`s).
pub const MAX_TENSOR_ELEMENTS: i64 = 1 << 31;

/// The values of tensor `name` among `tensors` (`CM0315` at `span` when not given).
fn given<'a>(tensors: &TensorValues<'a>, name: &str, span: Span) -> PResult<&'a [f64]> {
    tensors
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
        .ok_or_else(|| bad_table(span, format!("tensor `{name}` was not given")))
}

impl Bound<'_> {
    /// The extents of every declared tensor, evaluated and checked against their use.
    ///
    /// # Errors
    /// `CM0315` for an extent < 1, more than [`MAX_TENSOR_ELEMENTS`] elements (checked before
    /// anything proportional to them), a table that is not `[num_heads, n]` (indexed by `h`) or
    /// `[n]`, sinks that are not `[num_heads]`; any error of evaluating an extent.
    pub(crate) fn tensor_extents(&self) -> PResult<Vec<Vec<i64>>> {
        let p = self.program;
        let env = Env::default();
        let mut out = Vec::with_capacity(p.tensors.len());
        for t in &p.tensors {
            let mut dims = Vec::with_capacity(t.dims.len());
            for d in &t.dims {
                let v = self.eval_int(d, &env)?;
                if v < 1 || v > i64::from(u32::MAX) {
                    return Err(bad_table(
                        d.span,
                        format!(
                            "tensor `{}` has extent {v}; expected 1 ..= {}",
                            t.name,
                            u32::MAX
                        ),
                    ));
                }
                dims.push(v);
            }
            let elements: i128 = dims.iter().map(|&d| i128::from(d)).product();
            if elements > i128::from(MAX_TENSOR_ELEMENTS) {
                let shown: Vec<String> = dims.iter().map(i64::to_string).collect();
                return Err(bad_table(
                    t.span,
                    format!(
                        "tensor `{}` is [{}], {elements} elements; expected at most 2^31 = {MAX_TENSOR_ELEMENTS}",
                        t.name,
                        shown.join(", ")
                    ),
                )
                .with_hint("a bias table's buckets reach the kernels as int32 indices, and a table of 2^31 floats is 8 GiB; T5 uses [num_heads, 32]"));
            }
            out.push(dims);
        }
        let heads = self.shape.num_heads;
        let head_extent = |id: TensorId, what: &str, span: Span| -> PResult<()> {
            let dims = &out[id];
            if dims[0] != heads {
                return Err(bad_table(
                    span,
                    format!(
                        "tensor `{}` is {what} indexed by `h`, so its first extent must be num_heads = {heads}, got {}",
                        p.tensors[id].name, dims[0]
                    ),
                )
                .with_hint(format!(
                    "declare it `tensor {}: [num_heads{}];`",
                    p.tensors[id].name,
                    if dims.len() == 2 { ", NUM_BUCKETS" } else { "" }
                )));
            }
            Ok(())
        };
        if let Some(s) = &p.sink {
            head_extent(s.tensor, "the sinks,", s.span)?;
        }
        if let Some(t) = p.score.as_ref().and_then(|s| s.form.table.as_ref()) {
            if t.per_head {
                head_extent(t.tensor, "a bias table", t.span)?;
            }
        }
        Ok(out)
    }

    /// A float expression of the score at a point: `raw` for `score`, `tensors` for tables.
    ///
    /// # Errors
    /// Division by zero (`CM0301`), a softcap that is not positive and finite (`CM0314`),
    /// an index out of range (`CM0304`) or a bucket outside its table (`CM0315`), a tensor
    /// not given, and any integer error of its integer parts.
    pub fn eval_float(
        &self,
        e: &ScoreExpr,
        env: &Env,
        raw: f64,
        tensors: &TensorValues<'_>,
    ) -> PResult<f64> {
        crate::deep(|| self.eval_float_at(e, env, raw, tensors))
    }

    fn eval_float_at(
        &self,
        e: &ScoreExpr,
        env: &Env,
        raw: f64,
        tensors: &TensorValues<'_>,
    ) -> PResult<f64> {
        let f = |x: &ScoreExpr| self.eval_float(x, env, raw, tensors);
        Ok(match &e.kind {
            ScoreKind::Raw => raw,
            ScoreKind::Const(v) => v.value(),
            ScoreKind::Int(i) => self.eval_int(i, env)? as f64,
            ScoreKind::Neg(a) => -f(a)?,
            ScoreKind::Bin(op, a, b) => {
                let (x, y) = (f(a)?, f(b)?);
                match op {
                    FloatOp::Add => x + y,
                    FloatOp::Sub => x - y,
                    FloatOp::Mul => x * y,
                    FloatOp::Div if y == 0.0 => {
                        return Err(PlanError::new(
                            Code::DivisionByZero,
                            Some(b.span),
                            "division by zero in the score",
                        ))
                    }
                    FloatOp::Div => x / y,
                }
            }
            ScoreKind::Softcap(x, c) => {
                let cap = self.softcap_value(c)?;
                cap * (f(x)? / cap).tanh()
            }
            ScoreKind::Index(arr, i) => {
                let iv = self.eval_int(i, env)?;
                let len = match arr {
                    FloatArr::Lit(xs) => xs.len(),
                    FloatArr::Alibi(n) => self.alibi_count(n)?,
                };
                if iv < 0 || iv as usize >= len {
                    return Err(PlanError::new(
                        Code::IndexOutOfRange,
                        Some(i.span),
                        format!("index {iv} is out of range for a float array of length {len}"),
                    ));
                }
                match arr {
                    FloatArr::Lit(xs) => f(&xs[iv as usize])?,
                    FloatArr::Alibi(_) => alibi_slope(len, iv as usize),
                }
            }
            ScoreKind::Table {
                tensor,
                head,
                bucket,
            } => {
                let decl = &self.program.tensors[*tensor];
                let dims = &self.tensors[*tensor];
                let b = self.bucket_at(bucket, env)?;
                let nb = *dims.last().expect("checked: a table has extents");
                if b < 0 || b >= nb {
                    return Err(bad_table(
                        e.span,
                        format!(
                            "bucket {b} is outside tensor `{}`'s {nb} buckets",
                            decl.name
                        ),
                    ));
                }
                let index = match head {
                    Some(hd) => self.eval_int(hd, env)? * nb + b,
                    None => b,
                };
                let values = given(tensors, &decl.name, e.span)?;
                *values.get(index as usize).ok_or_else(|| {
                    bad_table(
                        e.span,
                        format!(
                            "tensor `{}` has {} values, but the score reads entry {index}",
                            decl.name,
                            values.len()
                        ),
                    )
                })?
            }
        })
    }

    /// `n` of `alibi_slopes(n)`, checked to be in `1 ..= 2^16`.
    fn alibi_count(&self, n: &Int) -> PResult<usize> {
        let v = self.eval_int(n, &Env::default())?;
        if !(1..=MAX_HEADS).contains(&v) {
            return Err(bad_value(
                n.span,
                format!("alibi_slopes({v}): expected a head count in 1 ..= {MAX_HEADS}"),
            ));
        }
        Ok(v as usize)
    }

    fn softcap_value(&self, c: &ScoreExpr) -> PResult<f64> {
        let cap = self.eval_float(c, &Env::default(), f64::NAN, &[])?;
        // The kernels take c and 1 / c as normal f32s: a c that rounds to 0 or a subnormal
        // in f32 would silently switch the cap off.
        if !(cap > 0.0
            && cap.is_finite()
            && (cap as f32).is_finite()
            && (cap as f32) >= f32::MIN_POSITIVE)
        {
            return Err(bad_value(
                c.span,
                format!(
                    "softcap {}: expected a positive finite number that f32 holds ({:e} to {:e})",
                    show_float(cap),
                    f32::MIN_POSITIVE,
                    f32::MAX
                ),
            )
            .with_hint("the softcap c in c * tanh(score / c) is > 0 (Gemma 2 uses 50)"));
        }
        Ok(cap)
    }

    /// The bucket of a table at a point (`env.q`, `env.k`).
    fn bucket_at(&self, b: &Bucket, env: &Env) -> PResult<i64> {
        match b {
            Bucket::Int(i) => self.eval_int(i, env),
            Bucket::T5 {
                relative,
                num_buckets,
                max_distance,
                bidirectional,
                span,
            } => {
                let none = Env::default();
                t5_bucket(
                    self.eval_int(relative, env)?,
                    self.eval_bool(bidirectional, &none)?,
                    self.eval_int(num_buckets, &none)?,
                    self.eval_int(max_distance, &none)?,
                    Some(*span),
                )
            }
        }
    }

    /// The pairwise reference of the score: `s2` of pair `(q, k)` in batch `b`, head `h`
    /// for the raw score `raw`, by evaluating the `score` statement as written (`raw` when
    /// the program has none). Visibility is [`Bound::visible`]'s business.
    ///
    /// # Errors
    /// As [`Bound::eval_float`].
    pub fn score_at(
        &self,
        q: i64,
        k: i64,
        b: i64,
        h: i64,
        raw: f64,
        tensors: &TensorValues<'_>,
    ) -> PResult<f64> {
        let Some(s) = &self.program.score else {
            return Ok(raw);
        };
        let env = Env {
            q,
            k,
            b,
            h,
            ..Env::default()
        };
        self.eval_float(&s.expr, &env, raw, tensors)
    }

    /// The sink logit of head `h` (`None` without a `sink` statement).
    ///
    /// # Errors
    /// A sink tensor not given, or shorter than `num_heads`.
    pub fn sink_at(&self, h: i64, tensors: &TensorValues<'_>) -> PResult<Option<f64>> {
        let Some(s) = &self.program.sink else {
            return Ok(None);
        };
        let name = &self.program.tensors[s.tensor].name;
        let values = given(tensors, name, s.span)?;
        values.get(h as usize).copied().map(Some).ok_or_else(|| {
            bad_table(
                s.span,
                format!(
                    "tensor `{name}` has {} values, expected num_heads",
                    values.len()
                ),
            )
        })
    }

    /// The program's score terms at these lengths and heads (`None` without `score` and
    /// `sink` statements). Cost O(num_heads + q_len + kv_len).
    ///
    /// # Errors
    /// `CM0314` for a softcap that is not positive and finite, a slope that `f32` cannot hold
    /// or rounds from nonzero to 0, coefficients outside `i32`, bias positions past `2^24` in magnitude (what f32
    /// holds exactly), bad `t5_bucket` arguments; `CM0315` for a bucket
    /// outside `[0, num_buckets)` (naming the distance); any error of evaluating them.
    pub(crate) fn bind_score(&self) -> PResult<Option<ScoreTerms>> {
        let p = self.program;
        if p.score.is_none() && p.sink.is_none() {
            return Ok(None);
        }
        let none = Env::default();
        let mut terms = ScoreTerms {
            softcap: None,
            linear: None,
            table: None,
            sink: p.sink.as_ref().map(|s| p.tensors[s.tensor].name.clone()),
        };
        let Some(form) = p.score.as_ref().map(|s| &s.form) else {
            return Ok(Some(terms));
        };
        if let Some(c) = &form.softcap {
            terms.softcap = Some(self.softcap_value(c)? as f32);
        }
        if let Some(l) = &form.linear {
            let mut slopes = Vec::with_capacity(self.shape.num_heads as usize);
            for h in 0..self.shape.num_heads {
                let env = Env { h, ..none };
                let v = self.eval_float(&l.slope, &env, f64::NAN, &[])?;
                slopes.push(kernel_f32(v, l.slope.span, || {
                    format!("the bias coefficient of head {h}")
                })?);
            }
            let coef = |i: &Int, what: &str| -> PResult<i32> {
                let v = self.eval_int(i, &none)?;
                i32::try_from(v).map_err(|_| {
                    bad_value(
                        i.span,
                        format!(
                            "the {what} coefficient of the bias is {v}; expected a 32-bit integer"
                        ),
                    )
                })
            };
            let (q_coef, k_coef) = (coef(&l.q_coef, "q")?, coef(&l.k_coef, "k")?);
            let offset = self.eval_int(&l.offset, &none)?;
            // The kernels form `q_coef * q`, `k_coef * k` and their sum with the offset in
            // f32, exact for integers up to 2^24; past that the bias would silently round.
            let (q_last, k_last) = (self.shape.q_len - 1, self.shape.kv_len - 1);
            let parts = [
                ("q_coef * q", i128::from(q_coef) * i128::from(q_last)),
                ("k_coef * k", i128::from(k_coef) * i128::from(k_last)),
                ("the offset", i128::from(offset)),
            ];
            let corners = [(0, 0), (q_last, 0), (0, k_last), (q_last, k_last)].map(|(q, k)| {
                let x = i128::from(q_coef) * i128::from(q)
                    + i128::from(k_coef) * i128::from(k)
                    + i128::from(offset);
                (
                    format!("q_coef * q + k_coef * k + offset at (q, k) = ({q}, {k})"),
                    x,
                )
            });
            let exact = 1i128 << 24;
            let parts = parts.into_iter().map(|(w, x)| (w.to_string(), x));
            if let Some((what, x)) = parts.chain(corners).find(|(_, x)| x.abs() > exact) {
                return Err(bad_value(
                    l.span,
                    format!("the positions of the bias reach {what} = {x}; expected at most 2^24 in magnitude"),
                )
                .with_hint("the kernels form the bias's positions in f32, which holds integers exactly up to 2^24; a constant offset only shifts each row's lse, so leave it out"));
            }
            terms.linear = Some(LinearBias {
                slopes,
                per_head: l
                    .slope
                    .reads(&|x| matches!(x, IntKind::H | IntKind::NumHeads | IntKind::Param(_))),
                q_coef,
                k_coef,
                offset,
            });
        }
        if let Some(t) = &form.table {
            let nb = *self.tensors[t.tensor]
                .last()
                .expect("checked: a table has extents");
            let (q_len, kv_len) = (self.shape.q_len, self.shape.kv_len);
            let mut bucket = Vec::with_capacity((q_len + kv_len - 1) as usize);
            let name = &p.tensors[t.tensor].name;
            // q and k occur only as q - k: every point of a distance gives its bucket.
            for d in 1 - kv_len..q_len {
                let env = Env { q: d, k: 0, ..none };
                let v = self.bucket_at(&t.bucket, &env)?;
                if v < 0 || v >= nb {
                    return Err(bad_table(
                        t.span,
                        format!(
                            "the bucket of distance q - k = {d} is {v}, outside tensor `{name}`'s {nb} buckets"
                        ),
                    )
                    .with_hint("a bias table's bucket must be in [0, num_buckets) for every distance the lengths allow; clip it with min / max"));
                }
                bucket.push(v as u32);
            }
            terms.table = Some(TableBias {
                tensor: name.clone(),
                num_buckets: nb as u32,
                per_head: t.per_head,
                bucket,
            });
        }
        Ok(Some(terms))
    }
}

/// Whether `i` reads `q` and `k` only through `q - k` or `k - q` (so its value at a pair is
/// a function of the distance). Returns the first offending leaf's span otherwise.
pub(crate) fn distance_only(i: &Int) -> Result<(), Span> {
    crate::deep(|| distance_only_here(i))
}

fn distance_only_here(i: &Int) -> Result<(), Span> {
    if let IntKind::Bin(crate::ir::IntOp::Sub, a, b) = &i.kind {
        if matches!(
            (&a.kind, &b.kind),
            (IntKind::Q, IntKind::K) | (IntKind::K, IntKind::Q)
        ) {
            return Ok(());
        }
    }
    let mut bad = None;
    visit_children(i, &mut |c| {
        if bad.is_none() {
            if let Err(s) = distance_only(c) {
                bad = Some(s);
            }
        }
    });
    match (&i.kind, bad) {
        (IntKind::Q | IntKind::K, _) => Err(i.span),
        (_, Some(s)) => Err(s),
        _ => Ok(()),
    }
}

/// Calls `f` on each integer operand of `i` (through its arrays, ranges and conditions).
pub(crate) fn visit_children(i: &Int, f: &mut impl FnMut(&Int)) {
    use crate::ir::{Arr, RangeKind};
    fn arr(a: &Arr, f: &mut impl FnMut(&Int)) {
        match a {
            Arr::Lit(xs) => xs.iter().for_each(&mut *f),
            Arr::Add(x, y, _) => {
                arr(x, f);
                arr(y, f);
            }
            Arr::Concat(xs, _) => xs.iter().for_each(|x| arr(x, f)),
            Arr::Slice(x, r, _) => {
                arr(x, f);
                range(r, f);
            }
            Arr::Param(_) | Arr::Const(_) => {}
        }
    }
    fn range(r: &crate::ir::RangeE, f: &mut impl FnMut(&Int)) {
        match &r.kind {
            RangeKind::Lit(a, b) => {
                f(a);
                f(b);
            }
            RangeKind::Seg(_, p)
            | RangeKind::SegAt(_, p)
            | RangeKind::Part(_, _, p)
            | RangeKind::Piece(_, _, p) => f(p),
        }
    }
    fn boolean(c: &Bool, f: &mut impl FnMut(&Int)) {
        match c {
            Bool::Const(_) => {}
            Bool::Cmp(_, a, b) => {
                f(a);
                f(b);
            }
            Bool::And(a, b) | Bool::Or(a, b) => {
                boolean(a, f);
                boolean(b, f);
            }
            Bool::Not(a) => boolean(a, f),
            Bool::InGrid(_, p) => f(p),
        }
    }
    match &i.kind {
        IntKind::ArrIndex(a, x) => {
            arr(a, f);
            f(x);
        }
        IntKind::ArrLen(a) | IntKind::ArrSum(a) => arr(a, f),
        IntKind::Neg(a) | IntKind::Abs(a) | IntKind::Isqrt(a) => f(a),
        IntKind::Bin(_, a, b) => {
            f(a);
            f(b);
        }
        IntKind::If(c, a, b) => {
            boolean(c, f);
            f(a);
            f(b);
        }
        IntKind::RangeLo(r) | IntKind::RangeHi(r) => range(r, f),
        IntKind::SegIndex(_, p) | IntKind::GridCoord(_, _, p) => f(p),
        _ => {}
    }
}
