//! The CPU reference attention, driven by a plan given as flat arrays (the form a plan
//! travels in through `torch.library` custom ops): `row_ptr` `[num_masks, q_len + 1]`
//! (offsets into `intervals`), `intervals` `[n, 2]` (start, end; may be padded past the
//! last offset), and `mask_index` `[batch, num_heads]` (which mask each (b, h) uses).

use compilemask::{
    attention_backward_scored, attention_forward, AttentionShape, Float, Masks, RowIntervals,
};
use pyo3::buffer::Element;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::convert::{read_three, read_vec, to_bytes, NeBytes};

/// `(batch, num_heads, num_kv_heads, q_len, kv_len, head_dim, head_dim_v)`.
type Dims = (usize, usize, usize, usize, usize, usize, usize);

fn shape(d: Dims) -> AttentionShape {
    AttentionShape {
        batch: d.0,
        num_heads: d.1,
        num_kv_heads: d.2,
        q_len: d.3,
        kv_len: d.4,
        head_dim: d.5,
        head_dim_v: d.6,
    }
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The plan's masks, rebuilt (and validated) from the flat arrays.
struct IndexedMasks {
    masks: Vec<RowIntervals>,
    index: Vec<usize>,
}

impl IndexedMasks {
    fn read(
        s: &AttentionShape,
        row_ptr: &Bound<'_, PyAny>,
        intervals: &Bound<'_, PyAny>,
        mask_index: &Bound<'_, PyAny>,
    ) -> PyResult<IndexedMasks> {
        let row_ptr: Vec<i32> = read_vec(row_ptr, "row_ptr")?;
        let flat: Vec<i32> = read_vec(intervals, "intervals")?;
        let index: Vec<i32> = read_vec(mask_index, "mask_index")?;
        let stride = s.q_len + 1;
        if row_ptr.is_empty() || row_ptr.len() % stride != 0 {
            return Err(value_error(format!(
                "plan row_ptr has {} entries, not a multiple of q_len + 1 = {stride}: \
                 the plan was built for another q_len",
                row_ptr.len()
            )));
        }
        let kv_len = u32::try_from(s.kv_len).map_err(value_error)?;
        let total = flat.len() / 2;
        let mut masks = Vec::with_capacity(row_ptr.len() / stride);
        for (m, ptr) in row_ptr.chunks(stride).enumerate() {
            let mut rows = Vec::with_capacity(s.q_len);
            for (q, w) in ptr.windows(2).enumerate() {
                let (a, b) = (w[0], w[1]);
                if a < 0 || a > b || b as usize > total {
                    return Err(value_error(format!(
                        "plan row_ptr of mask {m}, row {q} is [{a}, {b}), outside the {total} intervals"
                    )));
                }
                let mut row = Vec::with_capacity((b - a) as usize);
                for (j, i) in (a as usize..b as usize).enumerate() {
                    let (start, end) = (flat[2 * i], flat[2 * i + 1]);
                    match (u32::try_from(start), u32::try_from(end)) {
                        (Ok(start), Ok(end)) => row.push((start, end)),
                        _ => {
                            return Err(value_error(format!(
                                "plan mask {m}, row {q}: interval {j} is [{start}, {end}), expected ends in [0, kv_len = {kv_len}]"
                            )))
                        }
                    }
                }
                rows.push(row);
            }
            let r = RowIntervals::from_rows(kv_len, &rows)
                .map_err(|e| value_error(format!("plan mask {m} is invalid: {e}")))?;
            masks.push(r);
        }
        let pairs = s.batch * s.num_heads;
        if index.len() != pairs {
            return Err(value_error(format!(
                "plan mask_index has {} entries, expected batch * num_heads = {pairs}",
                index.len()
            )));
        }
        let index = index
            .iter()
            .map(|&i| {
                usize::try_from(i)
                    .ok()
                    .filter(|&i| i < masks.len())
                    .ok_or_else(|| {
                        value_error(format!(
                            "plan mask_index entry {i} is out of range for {} masks",
                            masks.len()
                        ))
                    })
            })
            .collect::<PyResult<_>>()?;
        Ok(IndexedMasks { masks, index })
    }

    fn masks(&self) -> Masks<'_> {
        let refs: Vec<&RowIntervals> = self.masks.iter().collect();
        Masks::indexed(&refs, &self.index)
    }
}

pub(crate) fn bytearray<'py, T: NeBytes>(py: Python<'py>, v: &[T]) -> Bound<'py, PyByteArray> {
    PyByteArray::new(py, to_bytes(v))
}

pub(crate) type Forward<'py> = (Bound<'py, PyByteArray>, Bound<'py, PyByteArray>);

#[allow(clippy::too_many_arguments)]
fn forward_t<'py, T>(
    py: Python<'py>,
    s: AttentionShape,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    plan: &IndexedMasks,
    scale: f64,
) -> PyResult<Forward<'py>>
where
    T: Float + Element + NeBytes + for<'a, 'p> FromPyObject<'a, 'p>,
{
    let [q, k, v]: [Vec<T>; 3] = read_three([(q, "query"), (k, "key"), (v, "value")])?;
    let out = py
        .detach(|| attention_forward(&s, &q, &k, &v, &plan.masks(), T::from_f64(scale)))
        .map_err(value_error)?;
    Ok((bytearray(py, &out.out), bytearray(py, &out.lse)))
}

/// Forward attention on the CPU reference. `q`, `k`, `v` are flat row-major buffers
/// (`float64` when `double`, else `float32`) of `[batch, num_heads, q_len, head_dim]`,
/// `[batch, num_kv_heads, kv_len, head_dim]`, `[batch, num_kv_heads, kv_len, head_dim_v]`.
/// Returns `(out, lse)` as native-endian bytearrays of the same float type (GIL released).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn reference_forward<'py>(
    py: Python<'py>,
    dims: Dims,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    row_ptr: &Bound<'py, PyAny>,
    intervals: &Bound<'py, PyAny>,
    mask_index: &Bound<'py, PyAny>,
    scale: f64,
    double: bool,
) -> PyResult<Forward<'py>> {
    let s = shape(dims);
    let plan = IndexedMasks::read(&s, row_ptr, intervals, mask_index)?;
    if double {
        forward_t::<f64>(py, s, q, k, v, &plan, scale)
    } else {
        forward_t::<f32>(py, s, q, k, v, &plan, scale)
    }
}

type Backward<'py> = (
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
);

#[allow(clippy::too_many_arguments)]
fn backward_t<'py, T>(
    py: Python<'py>,
    s: AttentionShape,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    dout: &Bound<'py, PyAny>,
    dlse: Option<&Bound<'py, PyAny>>,
    plan: &IndexedMasks,
    scale: f64,
) -> PyResult<Backward<'py>>
where
    T: Float + Element + NeBytes + for<'a, 'p> FromPyObject<'a, 'p>,
{
    let (q, k, v, dout): (Vec<T>, Vec<T>, Vec<T>, Vec<T>) = (
        read_vec(q, "query")?,
        read_vec(k, "key")?,
        read_vec(v, "value")?,
        read_vec(dout, "grad_out")?,
    );
    let dlse: Option<Vec<T>> = match dlse {
        Some(d) => Some(read_vec(d, "grad_lse")?),
        None => None,
    };
    let masks = plan.masks();
    let grads = py
        .detach(|| {
            attention_backward_scored(
                &s,
                &q,
                &k,
                &v,
                &dout,
                dlse.as_deref(),
                &masks,
                T::from_f64(scale),
                None,
            )
        })
        .map_err(value_error)?
        .grads;
    Ok((
        bytearray(py, &grads.dq),
        bytearray(py, &grads.dk),
        bytearray(py, &grads.dv),
    ))
}

/// Backward attention on the CPU reference: gradients `(dq, dk, dv)` of
/// `sum(out * grad_out) + sum(lse * grad_lse)` (`grad_lse` may be `None`), as bytearrays of
/// the input float type; arguments as in [`reference_forward`] (GIL released).
#[pyfunction]
#[pyo3(signature = (dims, q, k, v, dout, dlse, row_ptr, intervals, mask_index, scale, double))]
#[allow(clippy::too_many_arguments)]
pub fn reference_backward<'py>(
    py: Python<'py>,
    dims: Dims,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    dout: &Bound<'py, PyAny>,
    dlse: Option<&Bound<'py, PyAny>>,
    row_ptr: &Bound<'py, PyAny>,
    intervals: &Bound<'py, PyAny>,
    mask_index: &Bound<'py, PyAny>,
    scale: f64,
    double: bool,
) -> PyResult<Backward<'py>> {
    let s = shape(dims);
    let plan = IndexedMasks::read(&s, row_ptr, intervals, mask_index)?;
    if double {
        backward_t::<f64>(py, s, q, k, v, dout, dlse, &plan, scale)
    } else {
        backward_t::<f32>(py, s, q, k, v, dout, dlse, &plan, scale)
    }
}

/// The score terms of a plan (`Plan::score`, see `cm_ir::score`) as a dict, or `None` when
/// its program has no `score` or `sink` statement: `softcap` (float or `None`), `linear`
/// (`{"slopes": [num_heads floats], "q_coef", "k_coef", "offset"}` or `None`), `table`
/// (`{"tensor", "num_buckets", "per_head", "shape", "buckets_read", "bucket"}` or `None`,
/// `buckets_read` how many buckets some distance reads, `bucket` the
/// bucket of every distance `q - k` at index `q - k + kv_len - 1` as native-endian `int32`
/// bytes, `q_len + kv_len - 1` of them), `sink` (`{"tensor", "shape"}` or `None`),
/// `per_head` (`ScoreTerms::per_head`: whether the terms hold only for the plan's
/// `num_heads`), `reads_positions` (`ScoreTerms::reads_positions`).
#[pyfunction]
pub fn score_terms<'py>(
    py: Python<'py>,
    plan: &crate::plan::Plan,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let p = &plan.inner;
    let Some(t) = &p.score else {
        return Ok(None);
    };
    let heads = p.num_heads as usize;
    let d = PyDict::new(py);
    d.set_item("softcap", t.softcap)?;
    d.set_item("per_head", t.per_head())?;
    d.set_item("reads_positions", t.reads_positions())?;
    let linear = match &t.linear {
        Some(l) => {
            let x = PyDict::new(py);
            x.set_item("slopes", &l.slopes)?;
            x.set_item("q_coef", l.q_coef)?;
            x.set_item("k_coef", l.k_coef)?;
            x.set_item("offset", l.offset)?;
            Some(x)
        }
        None => None,
    };
    d.set_item("linear", linear)?;
    let table = match &t.table {
        Some(b) => {
            let x = PyDict::new(py);
            x.set_item("tensor", &b.tensor)?;
            x.set_item("num_buckets", b.num_buckets)?;
            x.set_item("per_head", b.per_head)?;
            x.set_item("shape", b.dims(heads))?;
            x.set_item("buckets_read", b.buckets_read())?;
            let bucket: Vec<i32> = b.bucket.iter().map(|&v| v as i32).collect();
            x.set_item("bucket", crate::convert::py_bytes(py, &bucket))?;
            Some(x)
        }
        None => None,
    };
    d.set_item("table", table)?;
    let sink = match &t.sink {
        Some(s) => {
            let x = PyDict::new(py);
            x.set_item("tensor", s)?;
            x.set_item("shape", vec![heads])?;
            Some(x)
        }
        None => None,
    };
    d.set_item("sink", sink)?;
    Ok(Some(d))
}

/// The named score tensors, read as `T`.
fn score_tensors<T>(tensors: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, Vec<T>)>>
where
    T: Element + Copy + for<'a, 'p> FromPyObject<'a, 'p>,
{
    let Some(tensors) = tensors else {
        return Ok(Vec::new());
    };
    tensors
        .iter()
        .map(|(name, values)| {
            let name: String = name.extract()?;
            let values = read_vec(&values, &name)?;
            Ok((name, values))
        })
        .collect()
}

type ScoredBackward<'py> = (
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
    Bound<'py, PyByteArray>,
    Option<Bound<'py, PyByteArray>>,
    Option<Bound<'py, PyByteArray>>,
);

#[allow(clippy::too_many_arguments)]
fn scored_t<'py, T>(
    py: Python<'py>,
    s: AttentionShape,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    dout: Option<&Bound<'py, PyAny>>,
    dlse: Option<&Bound<'py, PyAny>>,
    plan: &compilemask::Plan,
    scale: f64,
    tensors: Option<&Bound<'py, PyDict>>,
) -> PyResult<(Forward<'py>, Option<ScoredBackward<'py>>)>
where
    T: Float + Element + NeBytes + for<'a, 'p> FromPyObject<'a, 'p>,
{
    let (q, k, v): (Vec<T>, Vec<T>, Vec<T>) = (
        read_vec(q, "query")?,
        read_vec(k, "key")?,
        read_vec(v, "value")?,
    );
    let dout: Option<Vec<T>> = dout.map(|d| read_vec(d, "grad_out")).transpose()?;
    let dlse: Option<Vec<T>> = dlse.map(|d| read_vec(d, "grad_lse")).transpose()?;
    let named = score_tensors::<T>(tensors)?;
    let refs: Vec<(&str, &[T])> = named
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect();
    let scale = T::from_f64(scale);
    let (fwd, bwd) = py
        .detach(|| -> Result<_, compilemask::AttentionError> {
            let fwd = compilemask::attention_with_scores(&s, &q, &k, &v, plan, scale, &refs)?;
            let bwd = match &dout {
                Some(d) => Some(compilemask::attention_backward_with_scores(
                    &s,
                    &q,
                    &k,
                    &v,
                    d,
                    dlse.as_deref(),
                    plan,
                    scale,
                    &refs,
                )?),
                None => None,
            };
            Ok((fwd, bwd))
        })
        .map_err(value_error)?;
    let forward = (bytearray(py, &fwd.out), bytearray(py, &fwd.lse));
    let backward = bwd.map(|g| {
        (
            bytearray(py, &g.grads.dq),
            bytearray(py, &g.grads.dk),
            bytearray(py, &g.grads.dv),
            g.dtable.map(|x| bytearray(py, &x)),
            g.dsink.map(|x| bytearray(py, &x)),
        )
    });
    Ok((forward, backward))
}

/// Forward attention with the plan's score terms on the CPU reference: `q`, `k`, `v` as in
/// [`reference_forward`], `plan` the native plan (its masks and `score_terms`),
/// `tensors` the score tensors by name (`{"rel_bias": ..., "sinks": ...}`, flat row-major
/// buffers of the same float type). Returns `(out, lse)` bytearrays (GIL released).
#[pyfunction]
#[pyo3(signature = (dims, q, k, v, plan, scale, double, tensors = None))]
#[allow(clippy::too_many_arguments)]
pub fn reference_forward_scored<'py>(
    py: Python<'py>,
    dims: Dims,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    plan: &crate::plan::Plan,
    scale: f64,
    double: bool,
    tensors: Option<&Bound<'py, PyDict>>,
) -> PyResult<Forward<'py>> {
    let s = shape(dims);
    let scored = if double {
        scored_t::<f64>
    } else {
        scored_t::<f32>
    };
    Ok(scored(py, s, q, k, v, None, None, &plan.inner, scale, tensors)?.0)
}

/// Backward of [`reference_forward_scored`]: the gradients of `sum(out * grad_out) +
/// sum(lse * grad_lse)` (`dlse` may be `None`) as `(dq, dk, dv, dtable, dsink)` bytearrays
/// of the input float type, `dtable` / `dsink` `None` when the score has no table / no sinks
/// (GIL released).
#[pyfunction]
#[pyo3(signature = (dims, q, k, v, dout, dlse, plan, scale, double, tensors = None))]
#[allow(clippy::too_many_arguments)]
pub fn reference_backward_scored<'py>(
    py: Python<'py>,
    dims: Dims,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    dout: &Bound<'py, PyAny>,
    dlse: Option<&Bound<'py, PyAny>>,
    plan: &crate::plan::Plan,
    scale: f64,
    double: bool,
    tensors: Option<&Bound<'py, PyDict>>,
) -> PyResult<ScoredBackward<'py>> {
    let s = shape(dims);
    let scored = if double {
        scored_t::<f64>
    } else {
        scored_t::<f32>
    };
    scored(
        py,
        s,
        q,
        k,
        v,
        Some(dout),
        dlse,
        &plan.inner,
        scale,
        tensors,
    )?
    .1
    .ok_or_else(|| value_error("the backward gave no gradients"))
}
