//! Serving steps over a paged KV cache (`compilemask::Step`, the `cm-serve` crate): the step
//! object behind `compilemask.Step`, and the CPU reference of `compilemask.paged_attention`.
//! The step's arrays cross as native-endian `int32` bytes.

use std::collections::BTreeMap;
use std::sync::Mutex;

use compilemask::{Float, PagedShape, StepError, StepPlan, Value};
use pyo3::buffer::Element;
use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert::{self, py_bytes, read_three, read_vec, NeBytes};
use crate::errors::plan_error;
use crate::reference::{bytearray, Forward};

/// `Step.arrays`' result: `(cu_q, kv_len, row_ptr, intervals)`.
type StepArrays<'py> = (
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
);

/// `Step.prefill_arrays`' result: `(descriptor arrays, key_blocks, kv_len, row_index,
/// q_rows)`.
type PrefillArrays<'py> = (
    Vec<Bound<'py, PyBytes>>,
    Bound<'py, PyBytes>,
    u32,
    Bound<'py, PyBytes>,
    u32,
);

/// A step's error as Python sees it: a `PlanError` rendered against the program for a
/// sequence's plan-time error, a `ValueError` naming the value otherwise.
pub fn step_error(py: Python<'_>, program: &compilemask::Program, e: &StepError) -> PyErr {
    match e {
        StepError::Plan(p) => plan_error(py, Some(program), p),
        other => PyValueError::new_err(other.to_string()),
    }
}

/// Per-sequence parameters from a list of dicts (each may be empty).
pub fn seq_params(
    list: Option<&Bound<'_, PyList>>,
) -> PyResult<Option<Vec<BTreeMap<String, Value>>>> {
    let Some(list) = list else {
        return Ok(None);
    };
    list.iter()
        .map(|item| {
            let dict = item.cast::<PyDict>().map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(
                    "params must be a list of dicts, one per sequence",
                )
            })?;
            convert::params(Some(dict))
        })
        .collect::<PyResult<Vec<_>>>()
        .map(Some)
}

/// A planned serving step (private; wrapped by `compilemask.Step`).
///
/// One Python `Step` may be shared between threads, and `append` / `replan` /
/// `prefill_arrays` run with the GIL released, so the state sits behind a mutex (`frozen`: no
/// PyO3 borrow flag, whose conflicts surface as a bare "Already mutably borrowed" and lose the
/// call). The mutex is only ever taken with the GIL released and dropped before it is taken
/// back: a thread waiting for it while holding the GIL would deadlock against the holder.
#[pyclass(frozen, module = "compilemask._native", name = "Step")]
pub struct Step {
    inner: Mutex<compilemask::Step>,
    pub program: compilemask::Program,
}

impl Step {
    /// Runs `f` on the state with the GIL released, after the calls before it on this step.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut compilemask::Step) -> R + Send,
    ) -> PyResult<R> {
        py.detach(|| match self.inner.lock() {
            Ok(mut step) => Ok(f(&mut step)),
            // A panic inside an earlier call may have left the step half-updated.
            Err(_) => Err(PyRuntimeError::new_err(
                "this Step is unusable: an earlier call on it panicked",
            )),
        })
    }
}

#[pymethods]
impl Step {
    #[getter]
    fn num_seqs(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.plan().num_seqs())
    }

    #[getter]
    fn total_q(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.plan().total_q())
    }

    #[getter]
    fn num_intervals(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |s| s.plan().num_intervals())
    }

    /// Whether the planner reads rows from its piece cache (see `cm_serve`).
    #[getter]
    fn caches_pieces(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |s| s.planner().caches_pieces())
    }

    /// `(cu_q, kv_len, row_ptr, intervals)` as native-endian `int32` bytes.
    fn arrays<'py>(&self, py: Python<'py>) -> PyResult<StepArrays<'py>> {
        // Copied out under the lock so that the four arrays are of one state.
        let (cu_q, kv_len, row_ptr, intervals) = self.with(py, |s| {
            let p = s.plan();
            (
                p.cu_q().to_vec(),
                p.kv_len().to_vec(),
                p.row_ptr().to_vec(),
                p.intervals().to_vec(),
            )
        })?;
        Ok((
            py_bytes(py, &cu_q),
            py_bytes(py, &kv_len),
            py_bytes(py, &row_ptr),
            py_bytes(py, &intervals),
        ))
    }

    /// The step laid out for the paged forward (`cm_serve::StepPlan::prefill` at
    /// `cm_cuda::PREFILL_KEY_BLOCK` keys and `cm_cuda::PREFILL_ROW_BLOCK` rows per block, each
    /// row `row_group` times: the query heads of a kv head packed as rows): the kernels'
    /// descriptor of its virtual rows over the virtual keys
    /// (`cm_cuda::prefill_host_plan`: one mask for every head, with only the lists
    /// `cm_cuda::prefill_lists` names, the others empty; one uint32 bytes object per array, in
    /// the order of `CUDA_PLAN_ARRAYS`), `key_blocks` (int32 bytes, `[num_key_blocks, 4]`),
    /// the virtual `kv_len`, `row_index` (int32 bytes, `[total_q * row_group]`: the virtual
    /// row of copy `j` of step row `r` at `r * row_group + j`) and the virtual rows `q_rows`
    /// (GIL released). `ValueError` when the layout is too large or `row_group` is 0.
    #[pyo3(signature = (row_group = 1))]
    fn prefill_arrays<'py>(&self, py: Python<'py>, row_group: u32) -> PyResult<PrefillArrays<'py>> {
        let built = self.with(py, |s| -> Result<_, String> {
            let prefill = s
                .plan()
                .prefill(compilemask::PrefillShape {
                    key_block: cm_cuda::PREFILL_KEY_BLOCK,
                    row_block: cm_cuda::PREFILL_ROW_BLOCK,
                    row_group,
                })
                .map_err(|e| e.to_string())?;
            let host = cm_cuda::prefill_host_plan(&prefill.rows).map_err(|e| e.to_string())?;
            Ok((host, prefill))
        })?;
        let (host, prefill) = built.map_err(PyValueError::new_err)?;
        Ok((
            host.arrays().iter().map(|a| py_bytes(py, a)).collect(),
            py_bytes(py, &prefill.key_blocks),
            prefill.rows.kv_len(),
            py_bytes(py, &prefill.row_index),
            prefill.q_rows(),
        ))
    }

    /// Row `r`'s intervals; `IndexError` outside `[0, total_q)` (negative rows included).
    fn row(&self, py: Python<'_>, r: i64) -> PyResult<Vec<(u32, u32)>> {
        let got = self.with(py, |s| {
            let p = s.plan();
            match usize::try_from(r) {
                Ok(r) if r < p.total_q() => Ok(p.row(r).collect()),
                _ => Err(p.total_q()),
            }
        })?;
        got.map_err(|total_q| {
            PyIndexError::new_err(format!(
                "row {r} is out of range; the step has total_q = {total_q} rows"
            ))
        })
    }

    /// The next step: sequence `s` gains `new_tokens[s]` tokens, its new rows (GIL released).
    fn append(&self, py: Python<'_>, new_tokens: Vec<i64>) -> PyResult<()> {
        self.with(py, |s| crate::deep(|| s.append(&new_tokens)))?
            .map_err(|e| step_error(py, &self.program, &e))
    }

    /// A step of other sequences with the same planner and its cache (GIL released).
    #[pyo3(signature = (q_len, kv_len, params = None))]
    fn replan(
        &self,
        py: Python<'_>,
        q_len: Vec<i64>,
        kv_len: Vec<i64>,
        params: Option<&Bound<'_, PyList>>,
    ) -> PyResult<()> {
        let own = seq_params(params)?;
        self.with(py, |s| crate::deep(|| s.replan(&q_len, &kv_len, own)))?
            .map_err(|e| step_error(py, &self.program, &e))
    }
}

/// Plans the first step of `program` (GIL released); see `compilemask::Program::plan_step`.
pub fn plan_step(
    py: Python<'_>,
    program: &compilemask::Program,
    q_len: Vec<i64>,
    kv_len: Vec<i64>,
    num_heads: i64,
    params: BTreeMap<String, Value>,
    own: Option<Vec<BTreeMap<String, Value>>>,
) -> PyResult<Step> {
    let result = py.detach(|| {
        crate::deep(|| {
            let planner = program.step_planner(&params)?.with_num_heads(num_heads)?;
            compilemask::Step::new(planner, &q_len, &kv_len, own)
        })
    });
    match result {
        Ok(inner) => Ok(Step {
            inner: Mutex::new(inner),
            program: program.clone(),
        }),
        Err(e) => Err(step_error(py, program, &e)),
    }
}

/// `(num_heads, num_kv_heads, head_dim, head_dim_v, num_pages, page_size,
/// max_pages_per_seq)`.
type PagedDims = (usize, usize, usize, usize, usize, usize, usize);

#[allow(clippy::too_many_arguments)]
fn paged_t<'py, T>(
    py: Python<'py>,
    shape: PagedShape,
    step: &StepPlan,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_table: &[i32],
    scale: f64,
) -> PyResult<Forward<'py>>
where
    T: Float + Element + NeBytes + for<'a, 'p> FromPyObject<'a, 'p>,
{
    let [q, k, v]: [Vec<T>; 3] =
        read_three([(q, "query"), (k_cache, "k_cache"), (v_cache, "v_cache")])?;
    let out = py
        .detach(|| {
            compilemask::paged_attention(&shape, step, &q, &k, &v, block_table, T::from_f64(scale))
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((bytearray(py, &out.out), bytearray(py, &out.lse)))
}

/// The CPU reference of a step over a paged cache: `q` `[total_q, num_heads, head_dim]`,
/// `k_cache` / `v_cache` `[num_pages, page_size, num_kv_heads, head_dim(_v)]` as flat
/// buffers (`float64` when `double`, else `float32`), `block_table` `[num_seqs,
/// max_pages_per_seq]` and the step's arrays as `int32` buffers (checked against the step
/// contract). Returns `(out, lse)` as native-endian bytearrays, `[total_q, num_heads,
/// head_dim_v]` and `[total_q, num_heads]` (GIL released while computing).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn paged_reference<'py>(
    py: Python<'py>,
    dims: PagedDims,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_table: &Bound<'py, PyAny>,
    step: (
        Bound<'py, PyAny>,
        Bound<'py, PyAny>,
        Bound<'py, PyAny>,
        Bound<'py, PyAny>,
    ),
    scale: f64,
    double: bool,
) -> PyResult<Forward<'py>> {
    let (cu_q, kv_len, row_ptr, intervals) = step;
    let plan = StepPlan::from_parts(
        read_vec(&cu_q, "cu_q")?,
        read_vec(&kv_len, "kv_len")?,
        read_vec(&row_ptr, "row_ptr")?,
        read_vec(&intervals, "intervals")?,
    )
    .map_err(|e| PyValueError::new_err(format!("the step tensors are invalid: {e}")))?;
    let block_table: Vec<i32> = read_vec(block_table, "block_table")?;
    let shape = PagedShape {
        num_heads: dims.0,
        num_kv_heads: dims.1,
        head_dim: dims.2,
        head_dim_v: dims.3,
        num_pages: dims.4,
        page_size: dims.5,
        max_pages_per_seq: dims.6,
    };
    if double {
        paged_t::<f64>(py, shape, &plan, q, k_cache, v_cache, &block_table, scale)
    } else {
        paged_t::<f32>(py, shape, &plan, q, k_cache, v_cache, &block_table, scale)
    }
}
