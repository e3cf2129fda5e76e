//! Forward and backward masked attention that visits only the visible `(query, key)` pairs.
//!
//! Softmax is computed per row in `f64` from the row's own maximum, so no sentinel value ever
//! competes with real logits and `-inf - -inf` can never occur: empty rows are detected before
//! any exponent is taken and follow the empty-row contract of the crate docs.

use cm_ir::score::{ScoreTerms, TableBias};
use cm_plan::RowIntervals;

use crate::error::ReferenceError;
use crate::float::Float;
use crate::masks::Masks;
use crate::shape::{check_len, AttentionShape, Sizes};

const Q_DIMS: &str = "[batch, num_heads, q_len, head_dim]";
const K_DIMS: &str = "[batch, num_kv_heads, kv_len, head_dim]";
const V_DIMS: &str = "[batch, num_kv_heads, kv_len, head_dim_v]";
const OUT_DIMS: &str = "[batch, num_heads, q_len, head_dim_v]";
const LSE_DIMS: &str = "[batch, num_heads, q_len]";

/// Result of [`attention_forward`].
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardOutput<T> {
    /// Attention output, `[batch, num_heads, q_len, head_dim_v]`, row-major. Rows with no
    /// visible key are exactly 0.
    pub out: Vec<T>,
    /// Natural-log log-sum-exp of each row's scaled logits (`softmax_scale * q . k` over the
    /// visible keys; with score terms, of their `s2` and the sink's logit),
    /// `[batch, num_heads, q_len]`, row-major. `-inf` for rows with no visible key (the
    /// head's sink logit with sinks).
    pub lse: Vec<T>,
}

/// Result of [`attention_backward`]: gradients of `sum(out * dout)` with respect to the inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients<T> {
    /// Gradient of `q`, `[batch, num_heads, q_len, head_dim]`; 0 for rows with no visible key.
    pub dq: Vec<T>,
    /// Gradient of `k`, `[batch, num_kv_heads, kv_len, head_dim]`, summed over the query heads
    /// of each GQA group; exactly 0 for keys no row of the group sees.
    pub dk: Vec<T>,
    /// Gradient of `v`, `[batch, num_kv_heads, kv_len, head_dim_v]`, summed like `dk`; exactly 0
    /// for keys no row of the group sees.
    pub dv: Vec<T>,
}

/// Score terms and the tensors they read, for [`attention_forward_scored`] and
/// [`attention_backward_scored`] (see `cm_ir::score` for the semantics).
#[derive(Clone, Copy, Debug)]
pub struct Score<'a, T> {
    /// The plan's terms (`Plan::score`), bound to the shape's `q_len`, `kv_len` and
    /// `num_heads`.
    pub terms: &'a ScoreTerms,
    /// The bias table, row-major `[num_heads, num_buckets]` (per head) or `[num_buckets]`;
    /// given exactly when `terms.table` is.
    pub table: Option<&'a [T]>,
    /// The sink logits, `[num_heads]`; given exactly when `terms.sink` is.
    pub sink: Option<&'a [T]>,
}

/// Result of [`attention_backward_scored`]: [`Gradients`] plus those of the score tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreGradients<T> {
    /// `dq`, `dk`, `dv` as in [`attention_backward`].
    pub grads: Gradients<T>,
    /// Gradient of the bias table, its shape; `None` without a table. Each entry sums the
    /// `dS` of every visible pair whose bucket (and head) reads it, over batches and rows.
    pub dtable: Option<Vec<T>>,
    /// Gradient of the sinks, `[num_heads]`; `None` without sinks. `-sum P_sink * D` over
    /// the head's rows with a visible key (rows without one have `D = 0`).
    pub dsink: Option<Vec<T>>,
}

/// The score terms, widened to `f64` and checked against the shape.
struct ScoreCtx<'a> {
    softcap: Option<f64>,
    terms: Option<&'a ScoreTerms>,
    table: Option<(&'a TableBias, Vec<f64>)>,
    sink: Option<Vec<f64>>,
}

/// One visible key's logit `s2` and what the backward needs of it.
#[derive(Clone, Copy)]
struct Logit {
    s: f64,
    /// `d s2 / d s`: `1 - tanh^2(s / c)` with a softcap, else 1.
    dcap: f64,
    /// The table entry it read (0 without a table).
    entry: usize,
}

/// Validated inputs shared by both passes.
struct Ctx<'a, T> {
    shape: AttentionShape,
    sizes: Sizes,
    k: &'a [T],
    v: &'a [T],
    masks: Vec<&'a RowIntervals>,
    scale: f64,
    score: ScoreCtx<'a>,
}

impl<'a> ScoreCtx<'a> {
    fn new<T: Float>(
        shape: &AttentionShape,
        score: Option<&Score<'a, T>>,
    ) -> Result<Self, ReferenceError> {
        let Some(score) = score else {
            return Ok(ScoreCtx {
                softcap: None,
                terms: None,
                table: None,
                sink: None,
            });
        };
        let t = score.terms;
        if let Some(l) = t.linear.as_ref().filter(|l| l.per_head) {
            if l.slopes.len() != shape.num_heads {
                return Err(ReferenceError::ScoreTermsMismatch {
                    what: "num_heads",
                    bound: l.slopes.len(),
                    given: shape.num_heads,
                });
            }
        }
        let tensor = |name: Option<&String>,
                      data: Option<&[T]>,
                      what: &'static str,
                      dims: Vec<usize>|
         -> Result<Option<Vec<f64>>, ReferenceError> {
            let fallback = if what == "sinks" { "sink" } else { "table" };
            match (name, data) {
                (None, None) => Ok(None),
                (Some(n), None) => Err(ReferenceError::ScoreTensor {
                    tensor: n.clone(),
                    what,
                    needs: "read",
                    given: "none was given".into(),
                }),
                (None, Some(d)) => Err(ReferenceError::ScoreTensor {
                    tensor: fallback.into(),
                    what,
                    needs: "do not read",
                    given: format!("one of {} elements was given", d.len()),
                }),
                (Some(n), Some(d)) => {
                    let expected: usize = dims.iter().product();
                    let named = if what == "sinks" {
                        "[num_heads]"
                    } else if dims.len() == 2 {
                        "[num_heads, num_buckets]"
                    } else {
                        "[num_buckets]"
                    };
                    if d.len() != expected {
                        return Err(ReferenceError::ScoreTensorLength {
                            tensor: n.clone(),
                            dims: format!("{named} = {dims:?}"),
                            expected,
                            actual: d.len(),
                        });
                    }
                    if what != "sinks" {
                        check_finite(n, named, &dims, d)?;
                    } else if let Some(head) = d.iter().position(|x| {
                        let x = x.to_f64();
                        x.is_nan() || x == f64::INFINITY
                    }) {
                        return Err(ReferenceError::BadSink {
                            tensor: n.clone(),
                            head,
                            value: d[head].to_f64(),
                        });
                    }
                    Ok(Some(d.iter().map(|x| x.to_f64()).collect()))
                }
            }
        };
        let table_name = t.table.as_ref().map(|x| &x.tensor);
        let dims = t
            .table
            .as_ref()
            .map_or(Vec::new(), |x| x.dims(shape.num_heads));
        let table = tensor(table_name, score.table, "bias table", dims)?;
        if let Some(tb) = &t.table {
            let distances = shape.q_len + shape.kv_len - 1;
            if tb.bucket.len() != distances {
                return Err(ReferenceError::ScoreTermsMismatch {
                    what: "q_len + kv_len - 1",
                    bound: tb.bucket.len(),
                    given: distances,
                });
            }
        }
        let sink = tensor(t.sink.as_ref(), score.sink, "sinks", vec![shape.num_heads])?;
        Ok(ScoreCtx {
            softcap: t.softcap.map(f64::from),
            terms: Some(t),
            table: t.table.as_ref().zip(table),
            sink,
        })
    }

    /// `s2` of pair `(i, j)` in head `h` for the raw score `s`.
    fn logit(&self, s: f64, i: usize, j: usize, h: usize, kv_len: usize) -> Logit {
        let (mut s2, dcap) = match self.softcap {
            Some(c) => {
                let t = (s / c).tanh();
                (c * t, 1.0 - t * t)
            }
            None => (s, 1.0),
        };
        if let Some(t) = self.terms {
            s2 += t.linear_bias(i as i64, j as i64, h);
        }
        let mut entry = 0;
        if let Some((tb, values)) = &self.table {
            entry = tb.index(i, j, h, kv_len);
            s2 += values[entry];
        }
        Logit { s: s2, dcap, entry }
    }
}

/// Refuses a NaN or infinite element of `data`, a row-major tensor of the given `extents`
/// (named `dims`), naming its index along each dimension.
fn check_finite<T: Float>(
    tensor: &str,
    dims: &'static str,
    extents: &[usize],
    data: &[T],
) -> Result<(), ReferenceError> {
    let Some(index) = data.iter().position(|x| !x.to_f64().is_finite()) else {
        return Ok(());
    };
    let mut at = vec![0; extents.len()];
    let mut rest = index;
    for (a, &n) in at.iter_mut().zip(extents).rev() {
        *a = rest % n.max(1);
        rest /= n.max(1);
    }
    let at: Vec<String> = at.iter().map(ToString::to_string).collect();
    Err(ReferenceError::NonFiniteInput {
        tensor: tensor.to_owned(),
        index,
        at: at.join(", "),
        dims,
        value: data[index].to_f64(),
    })
}

fn dot<T: Float>(a: &[f64], b: &[T]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y.to_f64()).sum()
}

fn widen_into<T: Float>(dst: &mut Vec<f64>, src: &[T]) {
    dst.clear();
    dst.extend(src.iter().map(|x| x.to_f64()));
}

/// Softmax statistics of one non-empty row, the sink's logit included.
struct RowStats {
    max: f64,
    sum: f64,
    /// The sink's logit of the row's head, if any.
    sink: Option<f64>,
}

impl<'a, T: Float> Ctx<'a, T> {
    fn new(
        shape: &AttentionShape,
        q: &'a [T],
        k: &'a [T],
        v: &'a [T],
        masks: &Masks<'a>,
        softmax_scale: T,
        score: Option<&Score<'a, T>>,
    ) -> Result<Self, ReferenceError> {
        let sizes = shape.sizes()?;
        check_len("q", Q_DIMS, q.len(), sizes.q)?;
        check_len("k", K_DIMS, k.len(), sizes.k)?;
        check_len("v", V_DIMS, v.len(), sizes.v)?;
        let scale = softmax_scale.to_f64();
        if !scale.is_finite() {
            return Err(ReferenceError::NonFiniteScale { value: scale });
        }
        let s = shape;
        let kv = [s.batch, s.num_kv_heads, s.kv_len];
        check_finite("q", Q_DIMS, &[s.batch, s.num_heads, s.q_len, s.head_dim], q)?;
        check_finite("k", K_DIMS, &[kv[0], kv[1], kv[2], s.head_dim], k)?;
        check_finite("v", V_DIMS, &[kv[0], kv[1], kv[2], s.head_dim_v], v)?;
        let masks = masks.resolve(shape)?;
        let score = ScoreCtx::new(shape, score)?;
        Ok(Ctx {
            shape: *shape,
            sizes,
            k,
            v,
            masks,
            scale,
            score,
        })
    }

    /// Flat index of query row `(b, h, i)`, i.e. the row's offset divided by its width.
    fn q_row(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.shape.num_heads + h) * self.shape.q_len + i
    }

    /// Flat index of key row `(b, kv_head, j)`.
    fn kv_row(&self, b: usize, kv_head: usize, j: usize) -> usize {
        (b * self.shape.num_kv_heads + kv_head) * self.shape.kv_len + j
    }

    fn k_vec(&self, row: usize) -> &'a [T] {
        let d = self.shape.head_dim;
        &self.k[row * d..(row + 1) * d]
    }

    fn v_vec(&self, row: usize) -> &'a [T] {
        let d = self.shape.head_dim_v;
        &self.v[row * d..(row + 1) * d]
    }

    /// Fills `logits` with the logits (`s2`) of the visible keys of row `i`, in interval
    /// order, and returns their max and exp-sum, the sink's included; `None` for a row with
    /// no visible key.
    fn row_logits(
        &self,
        b: usize,
        h: usize,
        i: usize,
        qf: &[f64],
        logits: &mut Vec<Logit>,
    ) -> Result<Option<RowStats>, ReferenceError> {
        let kv_head = h / self.sizes.group;
        let mask = self.masks[b * self.shape.num_heads + h];
        logits.clear();
        let sink = self.score.sink.as_ref().map(|s| s[h]);
        let mut max = sink.unwrap_or(f64::NEG_INFINITY);
        // `i < q_len == mask.q_len()`, which is a u32, so the narrowing is lossless.
        for iv in mask.row(i as u32) {
            for j in iv.start as usize..iv.end as usize {
                let s = self.scale * dot(qf, self.k_vec(self.kv_row(b, kv_head, j)));
                let l = self.score.logit(s, i, j, h, self.shape.kv_len);
                // The kernels form logits in their element type; one that overflows it has
                // no softmax there either.
                if !T::from_f64(l.s).to_f64().is_finite() {
                    return Err(ReferenceError::LogitOverflow {
                        value: l.s,
                        dtype: T::NAME,
                        batch: b,
                        head: h,
                        row: i,
                    });
                }
                max = max.max(l.s);
                logits.push(l);
            }
        }
        if logits.is_empty() {
            return Ok(None);
        }
        // Every exponent is <= 0 and the max itself contributes exp(0) = 1, so sum >= 1:
        // no overflow, no division by zero, and ln(sum) is finite.
        let sum = logits.iter().map(|l| (l.s - max).exp()).sum::<f64>()
            + sink.map_or(0.0, |s| (s - max).exp());
        Ok(Some(RowStats { max, sum, sink }))
    }
}

/// Masked scaled-dot-product attention, forward.
///
/// For batch `b`, query head `h` and query row `i` (0-based), with `kvh = h / (num_heads /
/// num_kv_heads)` and `V(i)` the keys in the half-open intervals `masks[b, h].row(i)`:
/// `s_j = softmax_scale * q[b, h, i, :] . k[b, kvh, j, :]`,
/// `lse[b, h, i] = ln(sum_{j in V(i)} exp(s_j))` and
/// `out[b, h, i, :] = sum_{j in V(i)} exp(s_j - lse) * v[b, kvh, j, :]`.
/// If `V(i)` is empty, `out` is exactly 0 and `lse` is `-inf`.
///
/// Inputs are contiguous row-major slices shaped as in [`AttentionShape`]; `softmax_scale` is a
/// plain multiplier of the logits (commonly `1 / sqrt(head_dim)`). Cost is
/// `O(visible_pairs * (head_dim + head_dim_v))` per `(batch, head)`.
///
/// # Errors
/// [`ReferenceError`] when the head counts are 0 or not divisible, a slice length does not match
/// the shape, a mask is missing, mis-indexed, planned for other lengths or invalid,
/// `softmax_scale` or an input element is not finite, or a logit overflows `f64`.
pub fn attention_forward<T: Float>(
    shape: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    masks: &Masks<'_>,
    softmax_scale: T,
) -> Result<ForwardOutput<T>, ReferenceError> {
    attention_forward_scored(shape, q, k, v, masks, softmax_scale, None)
}

/// [`attention_forward`] with score terms: for a visible pair, `s = softmax_scale * q . k`,
/// `s2 = softcap(s) + linear bias + table entry` (each when present), and the row's softmax
/// runs over its visible keys plus, with sinks, the logit `sink[h]` whose value vector is
/// 0: `lse = ln(sum_j exp(s2_j) + exp(sink[h]))`, `out = sum_j exp(s2_j - lse) v_j`. A
/// row with no visible key has `out = 0` and `lse = -inf`, or `sink[h]` with sinks. Query
/// row `i` and key `j` are the positions `q` and `k` the terms read. `None` is
/// [`attention_forward`].
///
/// # Errors
/// Those of [`attention_forward`]; a score tensor missing, given where the terms read
/// none, of the wrong length or not finite; terms bound for another `num_heads`, `q_len`
/// or `kv_len`.
pub fn attention_forward_scored<T: Float>(
    shape: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    masks: &Masks<'_>,
    softmax_scale: T,
    score: Option<&Score<'_, T>>,
) -> Result<ForwardOutput<T>, ReferenceError> {
    let ctx = Ctx::new(shape, q, k, v, masks, softmax_scale, score)?;
    let (d, dv) = (shape.head_dim, shape.head_dim_v);
    let zero = T::from_f64(0.0);
    let mut out = vec![zero; ctx.sizes.out];
    let mut lse = vec![T::from_f64(f64::NEG_INFINITY); ctx.sizes.lse];
    let (mut qf, mut logits, mut acc) = (Vec::with_capacity(d), Vec::new(), vec![0.0f64; dv]);

    for b in 0..shape.batch {
        for h in 0..shape.num_heads {
            let kv_head = h / ctx.sizes.group;
            let mask = ctx.masks[b * shape.num_heads + h];
            for i in 0..shape.q_len {
                let row = ctx.q_row(b, h, i);
                widen_into(&mut qf, &q[row * d..(row + 1) * d]);
                let Some(stats) = ctx.row_logits(b, h, i, &qf, &mut logits)? else {
                    // `out` is already 0; `lse` is the sink's logit, or -inf without one.
                    if let Some(s) = &ctx.score.sink {
                        lse[row] = T::from_f64(s[h]);
                    }
                    continue;
                };
                acc.fill(0.0);
                let mut t = 0;
                for iv in mask.row(i as u32) {
                    for j in iv.start as usize..iv.end as usize {
                        let p = (logits[t].s - stats.max).exp();
                        t += 1;
                        for (a, x) in acc.iter_mut().zip(ctx.v_vec(ctx.kv_row(b, kv_head, j))) {
                            *a += p * x.to_f64();
                        }
                    }
                }
                for (o, a) in out[row * dv..(row + 1) * dv].iter_mut().zip(&acc) {
                    *o = T::from_f64(a / stats.sum);
                }
                lse[row] = T::from_f64(stats.max + stats.sum.ln());
            }
        }
    }
    Ok(ForwardOutput { out, lse })
}

/// Masked scaled-dot-product attention, backward: the gradients of `sum(out * dout)` for the
/// forward of [`attention_forward`] on the same inputs.
///
/// The forward statistics are recomputed in `f64` rather than taken from the caller, so the
/// result does not inherit the rounding of an `f32` `out` or `lse`. With `P` the row softmax and
/// `D_i = sum_j P_ij * (dout_i . v_j)`: `dv_j += P_ij * dout_i`,
/// `dS_ij = P_ij * (dout_i . v_j - D_i)`, `dq_i = softmax_scale * sum_j dS_ij * k_j` and
/// `dk_j += softmax_scale * dS_ij * q_i`, with `dk`/`dv` summed over the query heads of each
/// GQA group. Rows with no visible key get `dq = 0` and add nothing; keys no row sees get
/// `dk = dv = 0` exactly.
///
/// `dout` is `[batch, num_heads, q_len, head_dim_v]`; the other arguments are as in
/// [`attention_forward`]. Cost is `O(visible_pairs * (head_dim + head_dim_v))` per
/// `(batch, head)`.
///
/// # Errors
/// Those of [`attention_forward`], plus a wrong length or a non-finite element of `dout`.
pub fn attention_backward<T: Float>(
    shape: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
    masks: &Masks<'_>,
    softmax_scale: T,
) -> Result<Gradients<T>, ReferenceError> {
    Ok(attention_backward_scored(shape, q, k, v, dout, None, masks, softmax_scale, None)?.grads)
}

/// [`attention_backward`] with score terms: the gradients of `sum(out * dout) + sum(lse *
/// dlse)` (the second term only with `dlse`, `[batch, num_heads, q_len]`) for
/// [`attention_forward_scored`] on the same inputs, also of the bias table and the sinks.
/// With `P` the row softmax (the sink's probability `P_sink` included) and `D_i = sum_j
/// P_ij * (dout_i . v_j) - dlse_i` (the sink's value vector is 0; `d lse_i / d s_ij = P_ij`):
/// `dS2_ij = P_ij * (dout_i . v_j - D_i)`, `dS_ij = dS2_ij * (1 - tanh^2(s_ij / c))` with a softcap (else `dS2_ij`),
/// `dq_i = softmax_scale * sum_j dS_ij * k_j`, `dk_j += softmax_scale * dS_ij * q_i`,
/// `dv_j += P_ij * dout_i`, `dtable[entry(i, j, h)] += dS2_ij` and `dsink[h] -= P_sink,i *
/// D_i`, summed over batches, rows and (for a table shared by all heads) heads. Slopes
/// and the softcap are constants (no gradient).
///
/// # Errors
/// Those of [`attention_forward_scored`], plus a wrong length or a non-finite element of
/// `dout` or `dlse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_scored<T: Float>(
    shape: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
    dlse: Option<&[T]>,
    masks: &Masks<'_>,
    softmax_scale: T,
    score: Option<&Score<'_, T>>,
) -> Result<ScoreGradients<T>, ReferenceError> {
    let ctx = Ctx::new(shape, q, k, v, masks, softmax_scale, score)?;
    check_len("dout", OUT_DIMS, dout.len(), ctx.sizes.out)?;
    let rows = [shape.batch, shape.num_heads, shape.q_len];
    let out_extents = [rows[0], rows[1], rows[2], shape.head_dim_v];
    check_finite("dout", OUT_DIMS, &out_extents, dout)?;
    if let Some(dlse) = dlse {
        check_len("dlse", LSE_DIMS, dlse.len(), ctx.sizes.lse)?;
        check_finite("dlse", LSE_DIMS, &rows, dlse)?;
    }
    let (d, dvw, scale) = (shape.head_dim, shape.head_dim_v, ctx.scale);
    let mut dq = vec![T::from_f64(0.0); ctx.sizes.q];
    // dk/dv receive contributions from many rows and heads, so they stay in f64 until the end.
    let mut dk_acc = vec![0.0f64; ctx.sizes.k];
    let mut dv_acc = vec![0.0f64; ctx.sizes.v];
    let (mut qf, mut dof, mut logits) =
        (Vec::with_capacity(d), Vec::with_capacity(dvw), Vec::new());
    let (mut probs, mut dps, mut dq_row) = (Vec::new(), Vec::new(), vec![0.0f64; d]);
    let mut dtable = ctx.score.table.as_ref().map(|(_, t)| vec![0.0f64; t.len()]);
    let mut dsink = ctx
        .score
        .sink
        .as_ref()
        .map(|_| vec![0.0f64; shape.num_heads]);

    for b in 0..shape.batch {
        for h in 0..shape.num_heads {
            let kv_head = h / ctx.sizes.group;
            let mask = ctx.masks[b * shape.num_heads + h];
            for i in 0..shape.q_len {
                let row = ctx.q_row(b, h, i);
                widen_into(&mut qf, &q[row * d..(row + 1) * d]);
                let Some(stats) = ctx.row_logits(b, h, i, &qf, &mut logits)? else {
                    // dq is already 0; the row touches no key. With a sink its lse is the
                    // sink itself (d lse / d sink = 1); a -inf sink is no sink, gradient 0.
                    if let (Some(ds), Some(s), Some(dlse)) = (&mut dsink, &ctx.score.sink, dlse) {
                        if s[h] > f64::NEG_INFINITY {
                            ds[h] += dlse[row].to_f64();
                        }
                    }
                    continue;
                };
                widen_into(&mut dof, &dout[row * dvw..(row + 1) * dvw]);
                probs.clear();
                dps.clear();
                let mut delta = 0.0;
                let mut t = 0;
                for iv in mask.row(i as u32) {
                    for j in iv.start as usize..iv.end as usize {
                        let p = (logits[t].s - stats.max).exp() / stats.sum;
                        t += 1;
                        let dp = dot(&dof, ctx.v_vec(ctx.kv_row(b, kv_head, j)));
                        delta += p * dp;
                        probs.push(p);
                        dps.push(dp);
                    }
                }
                if let Some(dlse) = dlse {
                    delta -= dlse[row].to_f64();
                }
                if let (Some(ds), Some(s)) = (&mut dsink, stats.sink) {
                    ds[h] -= (s - stats.max).exp() / stats.sum * delta;
                }
                dq_row.fill(0.0);
                let mut t = 0;
                for iv in mask.row(i as u32) {
                    for j in iv.start as usize..iv.end as usize {
                        let (p, dp, l) = (probs[t], dps[t], logits[t]);
                        t += 1;
                        let kv = ctx.kv_row(b, kv_head, j);
                        let ds2 = p * (dp - delta);
                        if let Some(dt) = &mut dtable {
                            dt[l.entry] += ds2;
                        }
                        let ds = scale * ds2 * l.dcap;
                        for (g, x) in dq_row.iter_mut().zip(ctx.k_vec(kv)) {
                            *g += ds * x.to_f64();
                        }
                        for (g, x) in dk_acc[kv * d..(kv + 1) * d].iter_mut().zip(&qf) {
                            *g += ds * x;
                        }
                        for (g, x) in dv_acc[kv * dvw..(kv + 1) * dvw].iter_mut().zip(&dof) {
                            *g += p * x;
                        }
                    }
                }
                for (o, g) in dq[row * d..(row + 1) * d].iter_mut().zip(&dq_row) {
                    *o = T::from_f64(*g);
                }
            }
        }
    }
    let narrow = |v: Vec<f64>| v.into_iter().map(T::from_f64).collect::<Vec<T>>();
    Ok(ScoreGradients {
        grads: Gradients {
            dq,
            dk: narrow(dk_acc),
            dv: narrow(dv_acc),
        },
        dtable: dtable.map(narrow),
        dsink: dsink.map(narrow),
    })
}
