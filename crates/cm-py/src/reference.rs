//! The CPU reference attention, driven by a plan given as flat arrays (the form a plan
//! travels in through `torch.library` custom ops): `row_ptr` `[num_masks, q_len + 1]`
//! (offsets into `intervals`), `intervals` `[n, 2]` (start, end; may be padded past the
//! last offset), and `mask_index` `[batch, num_heads]` (which mask each (b, h) uses).

use compilemask::{
    attention_backward, attention_forward, AttentionShape, Float, Masks, RowIntervals,
};
use pyo3::buffer::Element;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::convert::{read_vec, to_bytes, NeBytes};

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
                let row: Vec<(u32, u32)> = (a as usize..b as usize)
                    .map(|i| (flat[2 * i].max(0) as u32, flat[2 * i + 1].max(0) as u32))
                    .collect();
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

fn bytearray<'py, T: NeBytes>(py: Python<'py>, v: &[T]) -> Bound<'py, PyByteArray> {
    PyByteArray::new(py, &to_bytes(v))
}

type Forward<'py> = (Bound<'py, PyByteArray>, Bound<'py, PyByteArray>);

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
    let (q, k, v): (Vec<T>, Vec<T>, Vec<T>) = (
        read_vec(q, "query")?,
        read_vec(k, "key")?,
        read_vec(v, "value")?,
    );
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
    let grads = py
        .detach(|| backward_with_lse(&s, &q, &k, &v, &dout, dlse.as_deref(), plan, scale))
        .map_err(value_error)?;
    Ok((
        bytearray(py, &grads.0),
        bytearray(py, &grads.1),
        bytearray(py, &grads.2),
    ))
}

/// Gradients of `sum(out * dout) + sum(lse * dlse)`.
///
/// The reference backward covers `dout`; the `lse` term is added here. With `P` the row
/// softmax, `d lse_i / d s_ij = P_ij`, so `dq_i += scale * dlse_i * sum_j P_ij k_j` (a
/// forward pass with `v = k`) and `dk_j += scale * sum_i P_ij dlse_i q_i` (the `dv` of a
/// backward pass with `v = k` and `dout_i = dlse_i * q_i`). Rows with no visible key have
/// `P = 0` and contribute nothing.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn backward_with_lse<T: Float>(
    s: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
    dlse: Option<&[T]>,
    plan: &IndexedMasks,
    scale: f64,
) -> Result<(Vec<T>, Vec<T>, Vec<T>), compilemask::ReferenceError> {
    let masks = plan.masks();
    let g = attention_backward(s, q, k, v, dout, &masks, T::from_f64(scale))?;
    let (mut dq, mut dk, dv) = (g.dq, g.dk, g.dv);
    let Some(dlse) = dlse.filter(|d| d.iter().any(|x| x.to_f64() != 0.0)) else {
        return Ok((dq, dk, dv));
    };
    let d = s.head_dim;
    let qk_shape = AttentionShape {
        head_dim_v: s.head_dim,
        ..*s
    };
    if dlse.len() != s.batch * s.num_heads * s.q_len {
        return Err(compilemask::ReferenceError::LengthMismatch {
            tensor: "dlse",
            dims: "[batch, num_heads, q_len]",
            expected: s.batch * s.num_heads * s.q_len,
            actual: dlse.len(),
        });
    }
    let pk = attention_forward(&qk_shape, q, k, k, &masks, T::from_f64(scale))?;
    let mut dout2 = Vec::with_capacity(q.len());
    for (row, &g) in dlse.iter().enumerate() {
        let g = g.to_f64();
        let pk_row = &pk.out[row * d..(row + 1) * d];
        for (x, p) in dq[row * d..(row + 1) * d].iter_mut().zip(pk_row) {
            *x = T::from_f64(x.to_f64() + scale * g * p.to_f64());
        }
        dout2.extend(
            q[row * d..(row + 1) * d]
                .iter()
                .map(|x| T::from_f64(g * x.to_f64())),
        );
    }
    let g2 = attention_backward(&qk_shape, q, k, k, &dout2, &masks, T::from_f64(scale))?;
    for (x, y) in dk.iter_mut().zip(&g2.dv) {
        *x = T::from_f64(x.to_f64() + scale * y.to_f64());
    }
    Ok((dq, dk, dv))
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
