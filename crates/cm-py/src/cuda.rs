//! The CUDA path of `compilemask.attention`: forward and backward launches of `cm-cuda` on
//! torch's current stream over torch's device memory.
//!
//! torch stays the owner of everything: the Python side passes each tensor as `(data_ptr,
//! shape, strides)` ints, the plan as the device addresses of the descriptor arrays it keeps in
//! tensors (`PlanTensors.kernel`), and the stream as `torch.cuda.current_stream().cuda_stream`.
//! Nothing here allocates device memory or synchronises, so a launch is cheap, stream-ordered
//! with torch's own work, and can be captured in a CUDA graph. The kernels of each device are
//! loaded once per process (into the primary context, the one torch uses) and kept.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cm_cuda::{
    BackwardRaw, DType, Error, ForwardRaw, LseLayout, PlanView, Runtime, TensorLayout,
    PLAN_ARRAY_COUNT,
};
use compilemask::TileShape;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The tile shape of the plan's descriptor (`cm_cuda::TILE`; the `ws_*` arrays of the default
/// forward kernel are at `cm_cuda::WS_TILE`, the `bwd_*` arrays of the warp-specialised
/// backward at `cm_cuda::BWD_TILE`), at which `Plan.kernel_arrays` builds it.
pub fn kernel_tile() -> TileShape {
    let (block_m, block_n) = cm_cuda::TILE;
    TileShape { block_m, block_n }
}

/// `(block_m, block_n)` of the CUDA kernels' tiles.
#[pyfunction]
pub fn cuda_kernel_tile() -> (u32, u32) {
    let t = kernel_tile();
    (t.block_m, t.block_n)
}

/// The head dimensions the CUDA kernels are built for (every kernel of
/// `cm_kernels::VARIANTS` at each), ascending.
pub fn head_dims() -> Vec<u32> {
    let mut dims: Vec<u32> = cm_kernels::VARIANTS.iter().map(|v| v.head_dim).collect();
    dims.sort_unstable();
    dims.dedup();
    dims
}

/// Names of the descriptor arrays, in the order `Plan.kernel_arrays` returns them and the
/// launches take their addresses.
pub fn plan_array_names() -> Vec<&'static str> {
    cm_cuda::PlanArray::ALL.iter().map(|a| a.name()).collect()
}

/// Invalid arguments are the caller's `ValueError`; everything else (no kernels in this
/// build, no driver, an unsupported GPU, a driver failure) is a `RuntimeError`.
fn py_err(e: Error) -> PyErr {
    match e {
        Error::InvalidArgument(msg) => {
            PyValueError::new_err(format!("compilemask.attention: {msg}"))
        }
        other => PyRuntimeError::new_err(format!("compilemask.attention on CUDA: {other}")),
    }
}

type Runtimes = Mutex<HashMap<usize, Arc<Runtime>>>;

/// The runtime of device `ordinal`, loading its kernels on first use.
fn runtime(ordinal: usize) -> Result<Arc<Runtime>, Error> {
    static RUNTIMES: OnceLock<Runtimes> = OnceLock::new();
    let runtimes = RUNTIMES.get_or_init(Default::default);
    // A poisoned lock only means another thread panicked while loading; the map itself is
    // always consistent (an entry is inserted whole or not at all).
    let mut map = runtimes.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = map.get(&ordinal) {
        return Ok(rt.clone());
    }
    let rt = Arc::new(Runtime::new_on_device(ordinal)?);
    map.insert(ordinal, rt.clone());
    Ok(rt)
}

/// fp32 elements of the backward workspace (`cm_cuda::backward_workspace_len`).
#[pyfunction]
pub fn cuda_workspace_len(
    q_len: u32,
    batch: usize,
    num_heads: usize,
    head_dim: usize,
    deterministic: bool,
) -> PyResult<usize> {
    cm_cuda::backward_workspace_len(
        q_len,
        kernel_tile(),
        batch,
        num_heads,
        head_dim,
        deterministic,
    )
    .ok_or_else(|| PyValueError::new_err("the backward workspace size overflows"))
}

/// A tensor as the Python side passes it: `(data_ptr, shape, strides)`, strides in elements.
type Tensor4 = (u64, [usize; 4], [i64; 4]);
type Tensor3 = (u64, [usize; 3], [i64; 3]);
/// A plan's kernel descriptor as the Python side passes it: `(q_len, kv_len, num_masks,
/// [mask_batch, mask_heads], [(address, length in u32 elements); PLAN_ARRAY_COUNT])`.
type DescriptorArg = (u32, u32, u32, [u32; 2], Vec<(u64, usize)>);

fn dtype(name: &str) -> PyResult<DType> {
    match name {
        "bfloat16" => Ok(DType::Bf16),
        "float16" => Ok(DType::F16),
        _ => Err(PyValueError::new_err(format!(
            "compilemask.attention on CUDA: dtype {name} is not supported (bfloat16, float16)"
        ))),
    }
}

fn layout(t: &Tensor4) -> TensorLayout {
    TensorLayout {
        shape: t.1,
        strides: t.2,
    }
}

/// The runtime of `device` and a view of the plan's arrays in its context.
fn plan_view(device: usize, plan: &DescriptorArg) -> Result<(Arc<Runtime>, PlanView), Error> {
    let rt = runtime(device)?;
    let arrays: [(u64, usize); PLAN_ARRAY_COUNT] = plan.4.as_slice().try_into().map_err(|_| {
        Error::InvalidArgument(format!(
            "the plan has {} kernel arrays, expected {PLAN_ARRAY_COUNT}",
            plan.4.len()
        ))
    })?;
    // SAFETY: the Python side passes the data pointers of the `PlanTensors.kernel` tensors,
    // made by `Plan.to_tensors` from `HostPlan::build_masks` at `kernel_tile()` for the
    // plan's `num_masks` masks and `mask_index` dims, and held on this device by the caller
    // (and, through torch's stream-ordered allocator, until the launches that read them have
    // run); their lengths are the tensors' own.
    #[allow(unsafe_code)]
    let view = unsafe {
        PlanView::borrowed(
            rt.context().clone(),
            plan.0,
            plan.1,
            kernel_tile(),
            plan.2,
            plan.3,
            arrays,
        )?
    };
    Ok((rt, view))
}

/// Torch's stream (its address, as `torch.cuda.current_stream().cuda_stream` gives it) as a
/// cudarc stream of the runtime's context, without taking ownership.
fn torch_stream(rt: &Runtime, stream: usize) -> Arc<cudarc::driver::CudaStream> {
    // SAFETY: `stream` is torch's current stream of the runtime's device, a live stream of the
    // primary context the runtime was loaded into; torch keeps it alive while work is queued
    // on it.
    #[allow(unsafe_code)]
    unsafe {
        rt.context()
            .wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream)
    }
}

/// Forward attention on `stream` (an address of a CUDA stream of device `device`, as torch
/// gives it); returns once the kernel is enqueued (GIL released). `q`, `k`, `v`, `out` are
/// `[batch, heads, seq_len, head_dim]` tensors, `lse` `[batch, num_heads, q_len]` fp32.
/// `ValueError` for arguments the kernels refuse, `RuntimeError` when they cannot run.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_forward(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype_name: &str,
    plan: DescriptorArg,
    q: Tensor4,
    k: Tensor4,
    v: Tensor4,
    out: Tensor4,
    lse: Tensor3,
    scale: f32,
) -> PyResult<()> {
    let raw = ForwardRaw {
        dtype: dtype(dtype_name)?,
        q: q.0,
        q_layout: layout(&q),
        k: k.0,
        k_layout: layout(&k),
        v: v.0,
        v_layout: layout(&v),
        out: out.0,
        out_layout: layout(&out),
        lse: Some((
            lse.0,
            LseLayout {
                shape: lse.1,
                strides: lse.2,
            },
        )),
        softmax_scale: scale,
    };
    py.detach(|| {
        let (rt, view) = plan_view(device, &plan)?;
        let stream = torch_stream(&rt, stream);
        // SAFETY: every address is a torch tensor's data pointer on `device` (checked by the
        // Python side), with the tensor's own shape and strides, so each layout's span lies in
        // memory torch keeps allocated until stream-ordered work after this launch; `out` and
        // `lse` are fresh outputs that overlap nothing. The plan view's contract is above.
        #[allow(unsafe_code)]
        unsafe {
            rt.forward_raw(&stream, &view, &raw)
        }
    })
    .map_err(py_err)
}

/// Backward attention on `stream` (GIL released): writes `dq`, `dk`, `dv`, the gradients of
/// `sum(out * dout)`; `workspace` is `(address, fp32 elements)`, at least
/// `cuda_workspace_len`. Arguments and errors as in [`cuda_forward`].
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_backward(
    py: Python<'_>,
    device: usize,
    stream: usize,
    dtype_name: &str,
    plan: DescriptorArg,
    q: Tensor4,
    k: Tensor4,
    v: Tensor4,
    out: Tensor4,
    dout: Tensor4,
    lse: Tensor3,
    dq: Tensor4,
    dk: Tensor4,
    dv: Tensor4,
    workspace: (u64, usize),
    scale: f32,
    deterministic: bool,
) -> PyResult<()> {
    let raw = BackwardRaw {
        dtype: dtype(dtype_name)?,
        q: q.0,
        q_layout: layout(&q),
        k: k.0,
        k_layout: layout(&k),
        v: v.0,
        v_layout: layout(&v),
        out: out.0,
        out_layout: layout(&out),
        dout: dout.0,
        dout_layout: layout(&dout),
        lse: lse.0,
        lse_layout: LseLayout {
            shape: lse.1,
            strides: lse.2,
        },
        dq: dq.0,
        dq_layout: layout(&dq),
        dk: dk.0,
        dk_layout: layout(&dk),
        dv: dv.0,
        dv_layout: layout(&dv),
        workspace: workspace.0,
        workspace_len: workspace.1,
        softmax_scale: scale,
        deterministic,
    };
    py.detach(|| {
        let (rt, view) = plan_view(device, &plan)?;
        let stream = torch_stream(&rt, stream);
        // SAFETY: as in `cuda_forward`; `dq`, `dk`, `dv` and the workspace are fresh torch
        // allocations that overlap nothing, the workspace holding `workspace.1` fp32 elements.
        #[allow(unsafe_code)]
        unsafe {
            rt.backward_raw(&stream, &view, &raw)
        }
    })
    .map_err(py_err)
}
