//! The CUDA path of `compilemask.attention`: forward and backward launches of `cm-cuda` on
//! torch's current stream over torch's device memory.
//!
//! torch stays the owner of everything: the Python side passes each tensor as `(data_ptr,
//! shape, strides)` ints, the plan as the one int32 tensor its descriptor arrays are kept in
//! back to back (`PlanTensors.kernel_flat`) with each array's length, and the stream as
//! `torch.cuda.current_stream().cuda_stream`.
//! Nothing here allocates device memory or synchronises, so a launch is cheap, stream-ordered
//! with torch's own work, and can be captured in a CUDA graph. The kernels of each device are
//! loaded once per process (into the primary context, the one torch uses) and kept.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cm_cuda::external::{self, ExternalTensor};
use cm_cuda::{BackwardRaw, Error, ForwardRaw, PlanLayout, PlanView, Runtime};
use compilemask::TileShape;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The tile shape of the plan's descriptor (`cm_cuda::TILE`; the `ws*` arrays of the default
/// forward kernel are at each of `cm_cuda::FWD_WS_TILES`, the `bwd_*` arrays of the
/// warp-specialised backward at `cm_cuda::BWD_TILE`), at which `Plan.kernel_arrays` builds it.
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

/// The `(head_dim, head_dim_v)` shapes the CUDA kernels are built for, ascending, in four
/// lists: the forward without score terms, the forward with them, the backward without and
/// with them (both modes; every dtype has the same shapes).
pub fn head_dims() -> [Vec<(u32, u32)>; 4] {
    use cm_kernels::{built_head_dims, DType, KernelKind};
    [
        built_head_dims(KernelKind::FwdWs, DType::Bf16, false),
        built_head_dims(KernelKind::FwdWs, DType::Bf16, true),
        built_head_dims(KernelKind::BwdDkDv, DType::Bf16, false),
        built_head_dims(KernelKind::BwdDkDv, DType::Bf16, true),
    ]
}

/// Names of the descriptor arrays, in the order `Plan.kernel_arrays` returns them and the
/// launches take their addresses.
pub fn plan_array_names() -> Vec<String> {
    cm_cuda::PlanArray::ALL.iter().map(|a| a.name()).collect()
}

/// Invalid arguments are the caller's `ValueError`; everything else (no kernels in this
/// build, no driver, an unsupported GPU, a driver failure) is a `RuntimeError`. `api` is the
/// public function the message names.
fn api_err(api: &'static str) -> impl Fn(Error) -> PyErr {
    move |e| match e {
        Error::InvalidArgument(msg) => PyValueError::new_err(format!("{api}: {msg}")),
        other => PyRuntimeError::new_err(format!("{api} on CUDA: {other}")),
    }
}

/// [`api_err`] of `compilemask.attention` (the forward and backward entries).
fn py_err(e: Error) -> PyErr {
    api_err("compilemask.attention")(e)
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

/// A tensor as the Python side passes it: `(data_ptr, shape, strides, dtype, device)`,
/// strides in elements, `dtype` torch's name without `torch.` (`"bfloat16"`), `device` the
/// CUDA ordinal (-1 for any other device).
type TensorArg<const N: usize> = (u64, [usize; N], [i64; N], String, i64);
/// A kernel descriptor's arrays as the Python side passes them: one contiguous int32 tensor
/// holding every array back to back, and each array's length (padded) in
/// `CUDA_PLAN_ARRAYS` order. One tensor instead of one per array: each tensor argument
/// costs host time in torch's dispatcher and here.
type ArraysArg = (TensorArg<1>, Vec<usize>);
/// A plan's kernel descriptor as the Python side passes it: `(q_len, kv_len, num_masks,
/// [mask_batch, mask_heads], arrays, ws_order, dq_turns)`, `ws_order` the forward's tile
/// sets best first as [`cuda_ws_order`] gave them for the unpadded arrays.
type DescriptorArg = (u32, u32, u32, [u32; 2], ArraysArg, Vec<usize>, bool);
/// A prefill layout's kernel descriptor as the Python side passes it: `(q_rows, kv_len,
/// arrays)` (the layout's virtual rows and keys), the arrays of `Step.prefill_arrays`
/// (padded; only those of `cm_cuda::prefill_lists` are read).
type PrefillDescriptorArg = (u32, u32, ArraysArg);

/// A launch's score terms as the Python side passes them: `(softcap, slopes, (q_coef,
/// k_coef, offset), dist_bias, dist_per_head, dist_run_end, sinks, dist_bias_grad)`, each
/// tensor a contiguous 1-D tensor or `None` (`cm_cuda::score` gives the meaning): slopes and
/// sinks float32 `[num_heads]`, dist_bias and dist_bias_grad float32 flattened from
/// `[num_heads or 1, q_len + kv_len - 1]`, dist_run_end int32 `[q_len + kv_len - 1]`.
type ScoreArg = (
    f32,
    Option<TensorArg<1>>,
    (f32, f32, f32),
    Option<TensorArg<1>>,
    bool,
    Option<TensorArg<1>>,
    Option<TensorArg<1>>,
    Option<TensorArg<1>>,
);

/// The score terms' tensors checked against the launch (device, dtype, contiguity, length)
/// into the addresses `cm_cuda` takes.
fn score_raw(
    score: ScoreArg,
    device: usize,
    num_heads: usize,
    q_len: u32,
    kv_len: u32,
    deterministic: bool,
) -> Result<cm_cuda::ScoreRaw, Error> {
    let (softcap, slopes, (q_coef, k_coef, offset), dist, dist_per_head, run_end, sinks, grad) =
        score;
    let len = (q_len as usize + kv_len as usize).saturating_sub(1);
    let dist_len = if dist_per_head { num_heads * len } else { len };
    let addr =
        |name: &str, t: Option<TensorArg<1>>, dtype: &str, want: usize| -> Result<u64, Error> {
            let Some(t) = t else { return Ok(0) };
            let t = to_external(t);
            external::check_tensor(name, &t.dtype, t.device, dtype, device)?;
            let (addr, n) = t.contiguous(name)?;
            if n != want {
                return Err(Error::invalid(format!(
                    "{name}: {n} elements, expected {want}"
                )));
            }
            Ok(addr)
        };
    Ok(cm_cuda::ScoreRaw {
        softcap,
        slopes: addr("score slopes", slopes, "float32", num_heads)?,
        linear: cm_cuda::LinearCoefs {
            q_coef,
            k_coef,
            offset,
        },
        dist_bias: addr("score dist_bias", dist, "float32", dist_len)?,
        dist_per_head,
        dist_run_end: addr("score dist_run_end", run_end, "int32", len)?,
        sinks: addr("score sinks", sinks, "float32", num_heads)?,
        // The deterministic backward's table gradient is int64 fixed point (cm_cuda::ScoreRaw).
        dist_bias_grad: addr(
            "score dist_bias_grad",
            grad,
            if deterministic { "int64" } else { "float32" },
            dist_len,
        )?,
    })
}

fn to_external<const N: usize>(t: TensorArg<N>) -> ExternalTensor<N> {
    ExternalTensor {
        addr: t.0,
        shape: t.1,
        strides: t.2,
        dtype: t.3,
        device: t.4,
    }
}

/// The arrays of an [`ArraysArg`] as tensors of their own: array `i` starts at the sum of
/// `lens[..i]` elements into the flat tensor, which must be a contiguous int32 tensor of
/// exactly `lens`' sum of elements (the lengths of another plan's descriptor rarely add up
/// to this one's, so a stale tensor is refused rather than read at the wrong offsets); its
/// device is checked with each array by `descriptor_layout`, and so are the arrays'
/// alignment and lengths against the plan.
fn split_arrays((flat, lens): ArraysArg) -> Result<Vec<ExternalTensor<1>>, Error> {
    let flat = to_external(flat);
    // The offsets below are in 4-byte elements: check the dtype before computing any.
    if flat.dtype != "int32" {
        return Err(Error::invalid(format!(
            "the kernel descriptor: dtype {}, expected int32",
            flat.dtype
        )));
    }
    if flat.shape[0] > 1 && flat.strides[0] != 1 {
        return Err(Error::invalid(format!(
            "the kernel descriptor: stride {}, expected a contiguous tensor",
            flat.strides[0]
        )));
    }
    let total = lens.iter().try_fold(0usize, |a, &n| a.checked_add(n));
    if total != Some(flat.shape[0]) {
        let sum = total.map_or_else(|| "overflow".to_string(), |t| t.to_string());
        return Err(Error::invalid(format!(
            "the kernel descriptor holds {} elements, but its {} arrays' lengths add up to {sum}: \
             pass the kernel_flat and kernel_lens of one PlanTensors",
            flat.shape[0],
            lens.len()
        )));
    }
    // Every array's address is in bounds of the flat tensor, whose byte length must not wrap.
    let end = u64::try_from(flat.shape[0])
        .ok()
        .and_then(|n| n.checked_mul(4))
        .and_then(|bytes| flat.addr.checked_add(bytes));
    if end.is_none() {
        return Err(Error::invalid(format!(
            "the kernel descriptor: address {:#x} with {} elements overflows",
            flat.addr, flat.shape[0]
        )));
    }
    let mut at = flat.addr;
    let mut arrays = Vec::with_capacity(lens.len());
    for n in lens {
        arrays.push(ExternalTensor {
            addr: at,
            shape: [n],
            strides: [1],
            dtype: flat.dtype.clone(),
            device: flat.device,
        });
        // At most `end`: the lengths add up to the flat tensor's.
        at += 4 * n as u64;
    }
    Ok(arrays)
}

/// The layout of the plan's descriptor arrays on `device`, checked
/// (`cm_cuda::external::descriptor_layout`).
fn plan_layout(device: usize, plan: DescriptorArg) -> Result<PlanLayout, Error> {
    let arrays = split_arrays(plan.4)?;
    external::descriptor_layout(
        device,
        plan.0,
        plan.1,
        plan.2,
        plan.3,
        &arrays,
        cm_cuda::PlanLists::All,
    )?
    .with_ws_order(&plan.5)
    .map(|layout| layout.with_dq_turns(plan.6))
}

/// The forward's tile sets (the `ws*` arrays of `CUDA_PLAN_ARRAYS`, one set per tile of the
/// default forward kernel) best first for a plan whose `Plan.kernel_arrays` have `lens` u32
/// elements each (before padding): `cm_cuda::ws_order`.
#[pyfunction]
pub fn cuda_ws_order(lens: Vec<usize>) -> PyResult<Vec<usize>> {
    Ok(cm_cuda::ws_order(&plan_lens("cuda_ws_order", lens)?).to_vec())
}

/// `lens` as one length per descriptor array, or a `ValueError` naming `what` and the count.
fn plan_lens(what: &str, lens: Vec<usize>) -> PyResult<[usize; cm_cuda::PLAN_ARRAY_COUNT]> {
    lens.try_into().map_err(|l: Vec<usize>| {
        PyValueError::new_err(format!(
            "{what}: {} array lengths, expected {}",
            l.len(),
            cm_cuda::PLAN_ARRAY_COUNT
        ))
    })
}

/// Whether the deterministic backward adds dQ in turns for a plan whose `Plan.kernel_arrays`
/// have `lens` u32 elements each (before padding): `cm_cuda::dq_in_turns`.
#[pyfunction]
pub fn cuda_dq_turns(lens: Vec<usize>) -> PyResult<bool> {
    Ok(cm_cuda::dq_in_turns(&plan_lens("cuda_dq_turns", lens)?))
}

/// q, k, v, out and lse as a forward's arguments, each checked to be on q's device with q's
/// dtype (lse float32); returns the device, the arguments (lse included) and q's dtype name.
#[allow(clippy::too_many_arguments)]
fn forward_args(
    q: TensorArg<4>,
    k: TensorArg<4>,
    v: TensorArg<4>,
    out: TensorArg<4>,
    lse: TensorArg<3>,
    softmax_scale: f32,
    score: ScoreArg,
    plan: &DescriptorArg,
    deterministic: bool,
) -> Result<(usize, ForwardRaw, String), Error> {
    let (q, k, v, out, lse) = (
        to_external(q),
        to_external(k),
        to_external(v),
        to_external(out),
        to_external(lse),
    );
    let (device, dtype) = external::launch_device_and_dtype(&[
        ("q", &q.dtype, q.device, true),
        ("k", &k.dtype, k.device, true),
        ("v", &v.dtype, v.device, true),
        ("out", &out.dtype, out.device, true),
        ("lse", &lse.dtype, lse.device, false),
    ])?;
    let raw = ForwardRaw {
        dtype,
        q: q.addr,
        q_layout: q.layout(),
        k: k.addr,
        k_layout: k.layout(),
        v: v.addr,
        v_layout: v.layout(),
        out: out.addr,
        out_layout: out.layout(),
        lse: Some((lse.addr, lse.lse_layout())),
        softmax_scale,
        score: score_raw(score, device, q.shape[1], plan.0, plan.1, deterministic)?,
    };
    Ok((device, raw, q.dtype))
}

/// The runtime of `device` and a view of the plan's arrays in its context.
fn plan_view(device: usize, layout: PlanLayout) -> Result<(Arc<Runtime>, PlanView), Error> {
    let rt = runtime(device)?;
    // SAFETY: the Python side passes the data pointer of the `PlanTensors.kernel_flat` tensor
    // (checked to be int32 on `device`) and its arrays' lengths (`kernel_lens`), made by
    // `Plan.to_tensors` from `HostPlan::build_masks` at `kernel_tile()` for the plan's
    // `num_masks` masks and `mask_index` dims, and held by the caller (and, through torch's
    // stream-ordered allocator, until the launches that read them have run); `split_arrays`
    // checked that the lengths add up to the tensor's own, so every array lies inside it, and
    // `PlanLayout::new` checked them against the plan's lengths.
    #[allow(unsafe_code)]
    let view = unsafe { PlanView::borrowed(rt.context().clone(), layout) };
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

/// Forward attention on `stream` (an address of a CUDA stream of q's device, as torch gives
/// it); returns once the kernel is enqueued (GIL released). `q`, `k`, `v`, `out` are
/// `[batch, heads, seq_len, head_dim]` tensors, `lse` `[batch, num_heads, q_len]` fp32, each
/// passed with its dtype and device, which are checked (every tensor and descriptor array on
/// q's device; q, k, v and out of one supported dtype, lse float32, the descriptor int32)
/// before the launch's own checks of shapes, strides, alignment and the plan's lengths and
/// heads. `ValueError` for arguments the kernels refuse, `RuntimeError` when they cannot run.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_forward(
    py: Python<'_>,
    stream: usize,
    plan: DescriptorArg,
    q: TensorArg<4>,
    k: TensorArg<4>,
    v: TensorArg<4>,
    out: TensorArg<4>,
    lse: TensorArg<3>,
    scale: f32,
    score: ScoreArg,
) -> PyResult<()> {
    let checked = || -> Result<(usize, ForwardRaw, PlanLayout), Error> {
        let (device, raw, _) = forward_args(q, k, v, out, lse, scale, score, &plan, false)?;
        let layout = plan_layout(device, plan)?;
        cm_cuda::check_forward(&layout, &raw)?;
        Ok((device, raw, layout))
    };
    let (device, raw, layout) = checked().map_err(py_err)?;
    py.detach(|| {
        let (rt, view) = plan_view(device, layout)?;
        let stream = torch_stream(&rt, stream);
        // SAFETY: every address is the data pointer of a torch tensor checked above to be on
        // `device` with the expected dtype, passed with the tensor's own shape and strides, so
        // each layout's span lies in memory torch keeps allocated until stream-ordered work
        // after this launch; `out` and `lse` are fresh outputs that overlap nothing. The plan
        // view's contract is in `plan_view`.
        #[allow(unsafe_code)]
        unsafe {
            rt.forward_raw(&stream, &view, &raw)
        }
    })
    .map_err(py_err)
}

/// Backward attention on `stream` (GIL released): writes `dq`, `dk`, `dv`, the gradients of
/// `sum(out * dout) + sum(lse * dlse)` (`dlse`: float32 shaped as `lse`, or `None` when the
/// loss does not read lse); `workspace` is a contiguous 1-D float32 tensor of at least
/// `cuda_workspace_len`. Arguments, checks and errors as in [`cuda_forward`] (dout, dq, dk
/// and dv of q's dtype, dlse and the workspace float32).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_backward(
    py: Python<'_>,
    stream: usize,
    plan: DescriptorArg,
    q: TensorArg<4>,
    k: TensorArg<4>,
    v: TensorArg<4>,
    out: TensorArg<4>,
    dout: TensorArg<4>,
    lse: TensorArg<3>,
    dlse: Option<TensorArg<3>>,
    dq: TensorArg<4>,
    dk: TensorArg<4>,
    dv: TensorArg<4>,
    workspace: TensorArg<1>,
    scale: f32,
    deterministic: bool,
    score: ScoreArg,
) -> PyResult<()> {
    let checked = || -> Result<(usize, BackwardRaw, PlanLayout), Error> {
        let (device, f, q_dtype) =
            forward_args(q, k, v, out, lse, scale, score, &plan, deterministic)?;
        let (dout, dq, dk, dv) = (
            to_external(dout),
            to_external(dq),
            to_external(dk),
            to_external(dv),
        );
        for (name, t) in [("dout", &dout), ("dq", &dq), ("dk", &dk), ("dv", &dv)] {
            external::check_tensor(name, &t.dtype, t.device, &q_dtype, device)?;
        }
        let dlse = match dlse.map(to_external) {
            Some(t) => {
                external::check_tensor("dlse", &t.dtype, t.device, "float32", device)?;
                Some((t.addr, t.lse_layout()))
            }
            None => None,
        };
        let ws = to_external(workspace);
        external::check_tensor("workspace", &ws.dtype, ws.device, "float32", device)?;
        let raw = BackwardRaw::from_forward(
            &f,
            (dout.addr, dout.layout()),
            dlse,
            (dq.addr, dq.layout()),
            (dk.addr, dk.layout()),
            (dv.addr, dv.layout()),
            ws.contiguous("workspace")?,
            deterministic,
        )?;
        let layout = plan_layout(device, plan)?;
        cm_cuda::check_backward(&layout, &raw)?;
        Ok((device, raw, layout))
    };
    let (device, raw, layout) = checked().map_err(py_err)?;
    py.detach(|| {
        let (rt, view) = plan_view(device, layout)?;
        let stream = torch_stream(&rt, stream);
        // SAFETY: as in `cuda_forward`; `dq`, `dk`, `dv` and the workspace are fresh torch
        // allocations that overlap nothing, the workspace holding `workspace_len` fp32 elements.
        #[allow(unsafe_code)]
        unsafe {
            rt.backward_raw(&stream, &view, &raw)
        }
    })
    .map_err(py_err)
}

/// The split-KV count of a serving step on `device` (`cm_cuda::decode_splits` with the
/// device's SMs and the decode kernel's occupancy at `dtype` / `head_dim`), from capacities
/// only, so a CUDA graph captured with it stays valid while lengths change.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_decode_splits(
    device: usize,
    dtype: &str,
    head_dim: u32,
    num_seqs: usize,
    max_q_len: usize,
    heads_per_kv_head: usize,
    num_kv_heads: usize,
    max_kv_len: usize,
) -> PyResult<u32> {
    let dtype = match dtype {
        "bfloat16" => cm_cuda::DType::Bf16,
        "float16" => cm_cuda::DType::F16,
        other => {
            return Err(PyValueError::new_err(format!(
                "compilemask.paged_attention: dtype {other} is not supported on CUDA (bfloat16, float16)"
            )))
        }
    };
    let rt = runtime(device).map_err(api_err("compilemask.paged_attention"))?;
    let ctas = rt
        .decode_ctas_per_sm(dtype, head_dim)
        .map_err(api_err("compilemask.paged_attention"))?;
    Ok(cm_cuda::decode_splits(
        num_seqs,
        max_q_len,
        heads_per_kv_head,
        num_kv_heads,
        max_kv_len,
        rt.num_sms(),
        ctas,
    ))
}

/// fp32 elements of a serving step's split-KV workspace (`cm_cuda::decode_workspace_len`).
#[pyfunction]
pub fn cuda_decode_workspace_len(
    num_splits: u32,
    total_q: usize,
    num_heads: usize,
    head_dim: usize,
) -> usize {
    cm_cuda::decode_workspace_len(num_splits, total_q, num_heads, head_dim)
}

/// A serving launch's query, cache, output and block table, checked against each other:
/// one device and dtype for q, the caches and out; equal cache shapes; out shaped as q; the
/// block table int32 on that device with page stride 1.
struct PagedTensors {
    device: usize,
    dtype: cm_cuda::DType,
    q: ExternalTensor<3>,
    k: ExternalTensor<4>,
    v: ExternalTensor<4>,
    out: ExternalTensor<3>,
    bt: ExternalTensor<2>,
}

fn paged_tensors(
    q: TensorArg<3>,
    k_cache: TensorArg<4>,
    v_cache: TensorArg<4>,
    out: TensorArg<3>,
    block_table: TensorArg<2>,
) -> Result<PagedTensors, Error> {
    let (q, k, v, out, bt) = (
        to_external(q),
        to_external(k_cache),
        to_external(v_cache),
        to_external(out),
        to_external(block_table),
    );
    let (device, dtype) = external::launch_device_and_dtype(&[
        ("q", &q.dtype, q.device, true),
        ("k_cache", &k.dtype, k.device, true),
        ("v_cache", &v.dtype, v.device, true),
        ("out", &out.dtype, out.device, true),
    ])?;
    if k.shape != v.shape {
        return Err(Error::invalid(format!(
            "v_cache: shape {:?} differs from k_cache's shape {:?}",
            v.shape, k.shape
        )));
    }
    if out.shape != q.shape {
        return Err(Error::invalid(format!(
            "out: shape {:?} differs from q's shape {:?}",
            out.shape, q.shape
        )));
    }
    external::check_tensor("block_table", &bt.dtype, bt.device, "int32", device)?;
    if bt.shape[1] > 1 && bt.strides[1] != 1 {
        return Err(Error::invalid(format!(
            "block_table: page stride {}, expected 1",
            bt.strides[1]
        )));
    }
    Ok(PagedTensors {
        device,
        dtype,
        q,
        k,
        v,
        out,
        bt,
    })
}

/// Serving attention of one step over a paged KV cache on `stream` (GIL released; one launch,
/// two when split): `q` and `out` `[total_q, num_heads, head_dim]`, `k_cache` / `v_cache`
/// `[num_pages, page_size, num_kv_heads, head_dim]` of q's dtype, `lse` float32 `[total_q,
/// num_heads]` (head stride 1) or None, `block_table` int32 `[num_seqs, max_pages_per_seq]`
/// (page stride 1), the step's int32 arrays `cu_q`, `kv_len`, `row_ptr`, `intervals`
/// (contiguous; `cm_cuda::decode` gives their meaning) and, with `num_splits > 1`, a
/// contiguous float32 `workspace` of `cuda_decode_workspace_len` elements. Every tensor is
/// checked (device, dtype, contiguity where required) before the launch's own checks.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_paged_attention(
    py: Python<'_>,
    stream: usize,
    q: TensorArg<3>,
    k_cache: TensorArg<4>,
    v_cache: TensorArg<4>,
    out: TensorArg<3>,
    lse: Option<TensorArg<2>>,
    block_table: TensorArg<2>,
    step: [TensorArg<1>; 4],
    max_q_len: usize,
    num_splits: u32,
    workspace: Option<TensorArg<1>>,
    scale: f32,
) -> PyResult<()> {
    let checked = || -> Result<(usize, cm_cuda::DecodeRaw), Error> {
        let PagedTensors {
            device,
            dtype,
            q,
            k,
            v,
            out,
            bt,
        } = paged_tensors(q, k_cache, v_cache, out, block_table)?;
        let mut addrs = [0u64; 4];
        let mut lens = [0usize; 4];
        for (i, (name, t)) in ["cu_q", "kv_len", "row_ptr", "intervals"]
            .into_iter()
            .zip(step)
            .enumerate()
        {
            let t = to_external(t);
            external::check_tensor(name, &t.dtype, t.device, "int32", device)?;
            (addrs[i], lens[i]) = t.contiguous(name)?;
        }
        let [total_q, num_heads, _] = q.shape;
        let num_seqs = bt.shape[0];
        for (name, len, want) in [
            ("cu_q", lens[0], num_seqs + 1),
            ("kv_len", lens[1], num_seqs),
            ("row_ptr", lens[2], total_q + 1),
        ] {
            if len != want {
                return Err(Error::invalid(format!(
                    "{name}: {len} elements, expected {want} (num_seqs = {num_seqs}, total_q = {total_q})"
                )));
            }
        }
        if lens[3] % 2 != 0 {
            return Err(Error::invalid(format!(
                "intervals: {} elements, expected (start, end) pairs",
                lens[3]
            )));
        }
        let lse = match lse {
            Some(t) => {
                let t = to_external(t);
                external::check_tensor("lse", &t.dtype, t.device, "float32", device)?;
                if t.shape != [total_q, num_heads] || (num_heads > 1 && t.strides[1] != 1) {
                    return Err(Error::invalid(format!(
                        "lse: shape {:?} strides {:?}, expected [total_q, num_heads] = [{total_q}, {num_heads}] with head stride 1",
                        t.shape, t.strides
                    )));
                }
                Some((t.addr, t.strides[0]))
            }
            None => None,
        };
        let workspace = match workspace {
            Some(t) => {
                let t = to_external(t);
                external::check_tensor("workspace", &t.dtype, t.device, "float32", device)?;
                Some(t.contiguous("workspace")?)
            }
            None => None,
        };
        let raw = cm_cuda::DecodeRaw {
            dtype,
            q: q.addr,
            q_shape: q.shape,
            q_strides: q.strides,
            k_cache: k.addr,
            v_cache: v.addr,
            cache_shape: k.shape,
            k_strides: k.strides,
            v_strides: v.strides,
            out: out.addr,
            out_strides: out.strides,
            lse,
            block_table: bt.addr,
            block_table_shape: bt.shape,
            block_table_stride: bt.strides[0],
            cu_q: addrs[0],
            kv_len: addrs[1],
            row_ptr: addrs[2],
            intervals: addrs[3],
            num_intervals: lens[3] / 2,
            max_q_len,
            num_splits,
            workspace,
            softmax_scale: scale,
        };
        cm_cuda::check_decode(&raw)?;
        Ok((device, raw))
    };
    let (device, raw) = checked().map_err(api_err("compilemask.paged_attention"))?;
    py.detach(|| {
        let rt = runtime(device)?;
        let stream = torch_stream(&rt, stream);
        // SAFETY: every address is the data pointer of a torch tensor checked above to be on
        // `device` with its dtype, passed with its own shape and strides (the step's arrays
        // with their lengths checked against num_seqs and total_q, the workspace's length
        // checked by `check_decode`), all kept allocated by torch until stream-ordered work
        // after this launch; `out`, `lse` and `workspace` are outputs the caller made fresh.
        #[allow(unsafe_code)]
        unsafe {
            rt.decode_raw(&stream, &raw)
        }
    })
    .map_err(api_err("compilemask.paged_attention"))
}

/// Serving's prefill-chunk path over a paged KV cache on `stream` (GIL released; one launch of
/// the paged forward, `cm_cuda::prefill`): `plan` the descriptor of `Step.prefill_arrays`
/// (the step's rows over its virtual key blocks), `q` and `out` `[total_q, num_heads,
/// head_dim]`, `k_cache` / `v_cache` `[num_pages, page_size, num_kv_heads, head_dim]` of q's
/// dtype, `lse` float32 `[num_heads, total_q]` (row stride 1) or None, `block_table` int32
/// `[num_seqs, max_pages_per_seq]` (page stride 1), `key_blocks` the contiguous int32
/// `[num_key_blocks * 4]` of the same call. Every tensor is checked (device, dtype,
/// contiguity where required, lengths against the plan) before the launch's own checks.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_paged_prefill(
    py: Python<'_>,
    stream: usize,
    plan: PrefillDescriptorArg,
    q: TensorArg<3>,
    k_cache: TensorArg<4>,
    v_cache: TensorArg<4>,
    out: TensorArg<3>,
    lse: Option<TensorArg<2>>,
    block_table: TensorArg<2>,
    key_blocks: TensorArg<1>,
    scale: f32,
) -> PyResult<()> {
    let checked = || -> Result<(usize, cm_cuda::PrefillRaw, PlanLayout), Error> {
        let PagedTensors {
            device,
            dtype,
            q,
            k,
            v,
            out,
            bt,
        } = paged_tensors(q, k_cache, v_cache, out, block_table)?;
        let kb = to_external(key_blocks);
        external::check_tensor("key_blocks", &kb.dtype, kb.device, "int32", device)?;
        let (kb_addr, kb_len) = kb.contiguous("key_blocks")?;
        let (q_rows, kv_len, arrays) = plan;
        let arrays = split_arrays(arrays)?;
        let layout = external::descriptor_layout(
            device,
            q_rows,
            kv_len,
            1,
            [1, 1],
            &arrays,
            cm_cuda::prefill_lists(),
        )?;
        let blocks = (layout.kv_len() / cm_cuda::PREFILL_KEY_BLOCK) as usize;
        if kb_len < 4 * blocks {
            return Err(Error::invalid(format!(
                "key_blocks: {kb_len} elements, expected at least 4 x {blocks} for the plan's {} virtual keys",
                layout.kv_len()
            )));
        }
        let [rows, num_heads, _] = q.shape;
        let lse = match lse {
            Some(t) => {
                let t = to_external(t);
                external::check_tensor("lse", &t.dtype, t.device, "float32", device)?;
                if t.shape != [num_heads, rows] || (rows > 1 && t.strides[1] != 1) {
                    return Err(Error::invalid(format!(
                        "lse: shape {:?} strides {:?}, expected [num_heads, q_rows] = [{num_heads}, {rows}] with row stride 1",
                        t.shape, t.strides
                    )));
                }
                Some((t.addr, t.strides[0]))
            }
            None => None,
        };
        let raw = cm_cuda::PrefillRaw {
            dtype,
            q: q.addr,
            q_shape: q.shape,
            q_strides: q.strides,
            k_cache: k.addr,
            v_cache: v.addr,
            cache_shape: k.shape,
            k_strides: k.strides,
            v_strides: v.strides,
            out: out.addr,
            out_strides: out.strides,
            lse,
            block_table: bt.addr,
            block_table_shape: bt.shape,
            block_table_stride: bt.strides[0],
            key_blocks: kb_addr,
            softmax_scale: scale,
        };
        cm_cuda::check_prefill(&layout, &raw)?;
        Ok((device, raw, layout))
    };
    let (device, raw, layout) = checked().map_err(api_err("compilemask.paged_attention"))?;
    py.detach(|| {
        let (rt, view) = plan_view(device, layout)?;
        let stream = torch_stream(&rt, stream);
        // SAFETY: every address is the data pointer of a torch tensor checked above to be on
        // `device` with its dtype, passed with its own shape and strides (key_blocks with its
        // length checked against the plan's key blocks; the kernel clamps what it reads from
        // them and from the block table), all kept allocated by torch until stream-ordered
        // work after this launch; `out` and `lse` are outputs the caller made fresh. The plan
        // view's contract is in `plan_view` (the arrays of `Step.prefill_arrays`).
        #[allow(unsafe_code)]
        unsafe {
            rt.prefill_raw(&stream, &view, &raw)
        }
    })
    .map_err(api_err("compilemask.paged_attention"))
}
