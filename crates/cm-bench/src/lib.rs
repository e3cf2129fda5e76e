//! Benchmarking by the protocol of `docs/workloads.md`: correctness first (sampled rows of the
//! output against the float64 reference on the same inputs, no NaN anywhere), then effective
//! TFLOP/s from the median of back-to-back calls timed with CUDA events, and the single-call
//! latency with the host launch included. [`measure`] does the forward; [`measure_backward`]
//! adds the backward (a forward with lse then a backward on one stream: sampled dQ rows and
//! dK / dV keys against the float64 gradients of [`grad`], no NaN in any gradient, then
//! forward + backward timing); [`decode::measure_decode`] serving's decode over a paged cache.
//! `compilemask bench [--bwd | --decode]` prints these.
//!
//! ```no_run
//! # fn demo(rows: &cm_plan::rows::RowIntervals) -> Result<(), cm_cuda::Error> {
//! use cm_bench::{BenchInputs, BenchOptions};
//! let rt = cm_cuda::Runtime::new_on_device(0)?;
//! let stream = rt.context().default_stream();
//! let opts = BenchOptions::default();
//! let mut inputs = BenchInputs::new(&stream, rows.q_len(), rows.kv_len(), opts)?;
//! let m = cm_bench::measure(&rt, &stream, &mut inputs, rows)?;
//! println!("{:.1} TFLOP/s", m.timing.map_or(0.0, |t| t.tflops));
//! let b = cm_bench::measure_backward(&rt, &stream, &mut inputs, rows, false)?;
//! println!("fwd+bwd {:.1} TFLOP/s", b.timing.map_or(0.0, |t| t.fwd_bwd_tflops));
//! # Ok(()) }
//! ```

pub mod decode;
pub mod grad;
pub mod reference;

use cm_cuda::{Backward, DType, DevicePlan, Error, Forward, LseLayout, Runtime, TensorLayout};
use cm_plan::rows::RowIntervals;
use cudarc::driver::{sys, CudaSlice, CudaStream};
use grad::{ForwardResult, GradCheck, Tensors};
use reference::{Inputs, Shape};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// The dense bf16 matrix-product rate of the H200 measured in this project (TFLOP/s): the
/// scale of the tile-density ceiling.
pub const MATMUL_PEAK_TFLOPS: f64 = 790.0;

/// Shapes and measurement settings of a benchmark (batch is 1: samples are packed into one
/// sequence and the mask separates them).
#[derive(Clone, Copy, Debug)]
pub struct BenchOptions {
    /// Query heads (`num_heads`).
    pub heads: usize,
    /// Key / value heads; must divide `heads` (GQA, MQA).
    pub kv_heads: usize,
    /// Columns of Q and K per head (64, 128, 192 or 256: `cm_kernels::VARIANTS`).
    pub head_dim: usize,
    /// Columns of V and of the output per head (`head_dim`, or 128 at 192).
    pub head_dim_v: usize,
    /// Element type of Q, K, V and the output.
    pub dtype: DType,
    /// Back-to-back calls timed, each between two CUDA events; the protocol asks for >= 50.
    pub runs: usize,
    /// Untimed calls before the timed ones.
    pub warmup: usize,
    /// Single calls timed on the host, each waited for before the next.
    pub latency_runs: usize,
    /// Random query rows checked against the reference, besides the first, last and middle
    /// rows and those at the first tile edges.
    pub check_rows: usize,
    /// Seed of the random inputs and of the sampled rows.
    pub seed: u64,
}

impl Default for BenchOptions {
    /// The headline configuration: H = 16, head_dim 128, bf16, 60 timed calls.
    fn default() -> Self {
        BenchOptions {
            heads: 16,
            kv_heads: 16,
            head_dim: 128,
            head_dim_v: 128,
            dtype: DType::Bf16,
            runs: 60,
            warmup: 5,
            latency_runs: 20,
            check_rows: 16,
            seed: 0x5eed,
        }
    }
}

/// Random standard-normal Q, K and V of one `(q_len, kv_len)`, in device memory and as host
/// bits (for the reference), plus the output and lse buffers, for the shapes of one
/// [`BenchOptions`]. Reused by every mask of those lengths.
pub struct BenchInputs {
    opts: BenchOptions,
    q_len: u32,
    kv_len: u32,
    q_layout: TensorLayout,
    kv_layout: TensorLayout,
    /// V's, `[1, kv_heads, kv_len, head_dim_v]`.
    v_layout: TensorLayout,
    /// The output's, `[1, heads, q_len, head_dim_v]`.
    out_layout: TensorLayout,
    /// Host copies of Q, K and V.
    host: [Vec<u16>; 3],
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    out: CudaSlice<u16>,
    lse: CudaSlice<f32>,
    /// dO and the gradients, allocated by the first [`measure_backward`].
    bwd: Option<BackwardBuffers>,
}

/// The backward's tensors of a [`BenchInputs`]: random dO (and its host copy), dQ, dK, dV
/// and the workspace of the deterministic mode (which also fits the fast one).
struct BackwardBuffers {
    host_dout: Vec<u16>,
    dout: CudaSlice<u16>,
    dq: CudaSlice<u16>,
    dk: CudaSlice<u16>,
    dv: CudaSlice<u16>,
    workspace: CudaSlice<f32>,
}

impl BenchInputs {
    /// Draws the inputs on all host cores and copies them to the device.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero lengths, zero heads, `kv_heads` not dividing
    /// `heads`, or zero `runs` / `latency_runs`; [`Error::Driver`] when an allocation or copy
    /// fails (e.g. out of device memory).
    pub fn new(
        stream: &Arc<CudaStream>,
        q_len: u32,
        kv_len: u32,
        opts: BenchOptions,
    ) -> Result<BenchInputs, Error> {
        if q_len == 0 || kv_len == 0 {
            return Err(Error::invalid(format!(
                "q_len = {q_len} and kv_len = {kv_len} must both be positive"
            )));
        }
        if opts.heads == 0 || opts.kv_heads == 0 || opts.heads % opts.kv_heads != 0 {
            return Err(Error::invalid(format!(
                "heads = {} and kv_heads = {}: both must be positive and kv_heads must divide heads",
                opts.heads, opts.kv_heads
            )));
        }
        if opts.runs == 0 || opts.latency_runs == 0 {
            return Err(Error::invalid("runs and latency_runs must be at least 1"));
        }
        let (d, dv) = (opts.head_dim, opts.head_dim_v);
        let q_layout = TensorLayout::contiguous([1, opts.heads, q_len as usize, d]);
        let kv_layout = TensorLayout::contiguous([1, opts.kv_heads, kv_len as usize, d]);
        let v_layout = TensorLayout::contiguous([1, opts.kv_heads, kv_len as usize, dv]);
        let out_layout = TensorLayout::contiguous([1, opts.heads, q_len as usize, dv]);
        let q_elems = q_layout.span_elements();
        let host = [
            random_bits(opts.dtype, q_elems, opts.seed ^ 0x51),
            random_bits(opts.dtype, kv_layout.span_elements(), opts.seed ^ 0x4b),
            random_bits(opts.dtype, v_layout.span_elements(), opts.seed ^ 0x56),
        ];
        let copy = |h: &Vec<u16>| {
            stream
                .clone_htod(h)
                .map_err(|e| Error::driver("input upload", e))
        };
        Ok(BenchInputs {
            opts,
            q: copy(&host[0])?,
            k: copy(&host[1])?,
            v: copy(&host[2])?,
            out: stream
                .alloc_zeros(out_layout.span_elements())
                .map_err(|e| Error::driver("output allocation", e))?,
            lse: stream
                .alloc_zeros(opts.heads * q_len as usize)
                .map_err(|e| Error::driver("lse allocation", e))?,
            q_len,
            kv_len,
            q_layout,
            kv_layout,
            v_layout,
            out_layout,
            host,
            bwd: None,
        })
    }

    /// `(q_len, kv_len)` of the inputs.
    pub fn lengths(&self) -> (u32, u32) {
        (self.q_len, self.kv_len)
    }

    fn forward(
        &mut self,
        rt: &Runtime,
        stream: &Arc<CudaStream>,
        plan: &DevicePlan,
    ) -> Result<(), Error> {
        let [b, h, s, d] = self.q_layout.shape;
        rt.forward(
            stream,
            plan,
            Forward {
                dtype: self.opts.dtype,
                q: (&self.q, self.q_layout),
                k: (&self.k, self.kv_layout),
                v: (&self.v, self.v_layout),
                out: (&mut self.out, self.out_layout),
                lse: Some((&mut self.lse, LseLayout::contiguous([b, h, s]))),
                softmax_scale: 1.0 / (d as f32).sqrt(),
                score: cm_cuda::Score::NONE,
            },
        )
    }

    /// Draws dO and allocates the gradients and workspace for `plan`, once.
    fn ensure_backward(
        &mut self,
        stream: &Arc<CudaStream>,
        plan: &DevicePlan,
    ) -> Result<(), Error> {
        if self.bwd.is_some() {
            return Ok(());
        }
        let drv = |what| move |e| Error::driver(what, e);
        let o = self.opts;
        let host_dout = random_bits(o.dtype, self.out_layout.span_elements(), o.seed ^ 0x44);
        let ws = plan
            .backward_workspace_len(1, o.heads, o.head_dim, true)
            .ok_or_else(|| Error::invalid("backward workspace size overflows usize"))?;
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<u16>(n)
                .map_err(drv("gradient allocation"))
        };
        self.bwd = Some(BackwardBuffers {
            dout: stream.clone_htod(&host_dout).map_err(drv("dout upload"))?,
            host_dout,
            dq: alloc(self.q_layout.span_elements())?,
            dk: alloc(self.kv_layout.span_elements())?,
            dv: alloc(self.v_layout.span_elements())?,
            workspace: stream
                .alloc_zeros(ws.max(1))
                .map_err(drv("workspace allocation"))?,
        });
        Ok(())
    }

    /// One backward of the last forward's output and lse (after [`Self::ensure_backward`]).
    fn backward(
        &mut self,
        rt: &Runtime,
        stream: &Arc<CudaStream>,
        plan: &DevicePlan,
        deterministic: bool,
    ) -> Result<(), Error> {
        let [b, h, s, d] = self.q_layout.shape;
        let g = self
            .bwd
            .as_mut()
            .ok_or_else(|| Error::invalid("backward buffers are not allocated"))?;
        rt.backward(
            stream,
            plan,
            Backward {
                dtype: self.opts.dtype,
                q: (&self.q, self.q_layout),
                k: (&self.k, self.kv_layout),
                v: (&self.v, self.v_layout),
                out: (&self.out, self.out_layout),
                dout: (&g.dout, self.out_layout),
                lse: (&self.lse, LseLayout::contiguous([b, h, s])),
                dlse: None,
                dq: (&mut g.dq, self.q_layout),
                dk: (&mut g.dk, self.kv_layout),
                dv: (&mut g.dv, self.v_layout),
                workspace: &mut g.workspace,
                softmax_scale: 1.0 / (d as f32).sqrt(),
                deterministic,
                dist_bias_grad: None,
                score: cm_cuda::Score::NONE,
            },
        )
    }
}

/// Standard-normal values rounded to `dtype`, as raw bits; deterministic in `seed` whatever
/// the number of cores.
pub fn random_bits(dtype: DType, n: usize, seed: u64) -> Vec<u16> {
    const CHUNK: usize = 1 << 20;
    let mut out = vec![0u16; n];
    let chunks: Vec<(usize, &mut [u16])> = out.chunks_mut(CHUNK).enumerate().collect();
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per_thread = chunks.len().div_ceil(threads).max(1);
    let mut groups: Vec<Vec<(usize, &mut [u16])>> = Vec::new();
    let mut it = chunks.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per_thread).collect());
    }
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(move || {
                for (i, chunk) in group {
                    let mut state = splitmix(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    let mut uniform = || {
                        state = splitmix(state);
                        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
                    };
                    for pair in chunk.chunks_mut(2) {
                        // Box-Muller: two normals from two uniforms in (0, 1).
                        let r = (-2.0 * uniform().ln()).sqrt();
                        let t = std::f64::consts::TAU * uniform();
                        pair[0] = to_bits(dtype, (r * t.cos()) as f32);
                        if let Some(x) = pair.get_mut(1) {
                            *x = to_bits(dtype, (r * t.sin()) as f32);
                        }
                    }
                }
            });
        }
    });
    out
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `x` rounded to `dtype`, as raw bits.
pub fn to_bits(dtype: DType, x: f32) -> u16 {
    match dtype {
        DType::Bf16 => half::bf16::from_f32(x).to_bits(),
        DType::F16 => half::f16::from_f32(x).to_bits(),
    }
}

/// A quiet NaN of `dtype`, as raw bits: the fill that shows an element a kernel leaves
/// unwritten.
pub fn nan_bits(dtype: DType) -> u16 {
    match dtype {
        DType::Bf16 => 0x7FC0,
        DType::F16 => 0x7E00,
    }
}

/// The value of raw `dtype` bits.
pub fn from_bits(dtype: DType, b: u16) -> f64 {
    match dtype {
        DType::Bf16 => half::bf16::from_bits(b).to_f64(),
        DType::F16 => half::f16::from_bits(b).to_f64(),
    }
}

/// The correctness check of one configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    /// Query rows compared with the reference.
    pub rows: Vec<u32>,
    /// Query heads compared with the reference (first, middle, last).
    pub heads: Vec<usize>,
    /// Largest |output - float64 reference| over the checked rows and heads.
    pub max_abs_err: f64,
    /// The same for the dtype-emulated reference; sets the tolerance.
    pub emulated_err: f64,
    /// `reference::tolerance(emulated_err)`.
    pub tolerance: f64,
    /// Largest |lse - float64 lse| over the checked non-empty rows (must be <= 1e-3).
    pub lse_err: f64,
    /// NaN values in the whole output and lse.
    pub nan: usize,
    /// Checked rows with no visible key whose output is not 0 or whose lse is not `-inf`.
    pub empty_rows_wrong: usize,
}

impl Check {
    /// Whether the kernel's answer is accepted.
    pub fn pass(&self) -> bool {
        self.nan == 0
            && self.empty_rows_wrong == 0
            && self.max_abs_err <= self.tolerance
            && self.lse_err <= 1e-3
    }
}

/// Timings of one configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Median GPU time per call over the back-to-back calls, milliseconds.
    pub median_ms: f64,
    /// Mean of the same, milliseconds.
    pub mean_ms: f64,
    /// `2 * heads * (head_dim + head_dim_v) * visible_pairs / median`, in TFLOP/s.
    pub tflops: f64,
    /// Median host time from the start of a `forward` call to the return of the stream
    /// synchronisation that follows it, on an idle GPU, milliseconds.
    pub single_call_ms: f64,
    /// Median GPU time of the same single calls, between an event recorded just before the
    /// `forward` call and one just after it, milliseconds: the kernel plus the launch delay
    /// the GPU sees, without the host's wake-up after completion.
    pub single_call_gpu_ms: f64,
    /// Median host time of the `forward` call alone (validation and enqueue), microseconds.
    pub enqueue_us: f64,
    /// `single_call_ms - median_ms`, in microseconds: what a lone call pays beyond the kernel.
    pub host_overhead_us: f64,
}

/// Everything measured for one mask.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// Visible (query, key) pairs of the mask, per head.
    pub visible_pairs: u64,
    /// Pairs inside the full and partial tiles at the kernel's tile shape, per head.
    pub computed_pairs: u64,
    /// The kernel's tile shape, `(block_m, block_n)`.
    pub tile: (u32, u32),
    /// Full and partial tiles at that shape.
    pub tiles_full: u64,
    /// See `tiles_full`.
    pub tiles_partial: u64,
    /// `visible / computed pairs * MATMUL_PEAK_TFLOPS`: the best effective rate a kernel that
    /// computes whole tiles at the matrix-product peak could reach.
    pub density_ceiling_tflops: f64,
    /// Host time to build the tile descriptor and upload it, milliseconds.
    pub plan_upload_ms: f64,
    /// The correctness check, always run first.
    pub check: Check,
    /// `None` when the check failed (a wrong kernel is not timed).
    pub timing: Option<Timing>,
}

impl Measurement {
    /// The measurement as the JSON object `compilemask bench` reports (without the
    /// workload's name and lengths, which the caller knows).
    pub fn json(&self) -> Value {
        let c = &self.check;
        let mut v = json!({
            "visible_pairs": self.visible_pairs,
            "tile": [self.tile.0, self.tile.1],
            "computed_pairs": self.computed_pairs,
            "tiles_full": self.tiles_full,
            "tiles_partial": self.tiles_partial,
            "tile_density": self.visible_pairs as f64 / self.computed_pairs.max(1) as f64,
            "density_ceiling_tflops": self.density_ceiling_tflops,
            "plan_upload_ms": self.plan_upload_ms,
            "check": {
                "rows": c.rows, "heads": c.heads, "max_abs_err": c.max_abs_err,
                "emulated_err": c.emulated_err, "tolerance": c.tolerance, "lse_err": c.lse_err,
                "nan": c.nan, "empty_rows_wrong": c.empty_rows_wrong, "pass": c.pass(),
            },
            "pass": c.pass(),
        });
        if let Some(t) = &self.timing {
            v["median_ms"] = json!(t.median_ms);
            v["mean_ms"] = json!(t.mean_ms);
            v["tflops"] = json!(t.tflops);
            v["single_call_ms"] = json!(t.single_call_ms);
            v["single_call_gpu_ms"] = json!(t.single_call_gpu_ms);
            v["host_overhead_us"] = json!(t.host_overhead_us);
            v["enqueue_us"] = json!(t.enqueue_us);
        }
        v
    }
}

/// The median of `v` (the upper one of an even count); `v` must not be empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Checks and times the runtime's forward kernel on `rows` (which must have the inputs'
/// lengths) over `inputs`, on `stream`.
///
/// # Errors
/// [`Error::InvalidArgument`] for lengths that differ from the inputs' or a launch the
/// runtime refuses (e.g. an unbuilt head_dim); [`Error::Driver`] for failed driver calls.
pub fn measure(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    inputs: &mut BenchInputs,
    rows: &RowIntervals,
) -> Result<Measurement, Error> {
    let (plan, plan_upload_ms) = upload(rt, stream, inputs, rows)?;
    measure_plan(rt, stream, inputs, rows, &plan, plan_upload_ms)
}

/// Uploads the plan of `rows` after checking its lengths against the inputs'; returns it with
/// the host milliseconds it took.
fn upload(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    inputs: &BenchInputs,
    rows: &RowIntervals,
) -> Result<(DevicePlan, f64), Error> {
    if (rows.q_len(), rows.kv_len()) != (inputs.q_len, inputs.kv_len) {
        return Err(Error::invalid(format!(
            "the mask has q_len = {} and kv_len = {}, the inputs {} and {}",
            rows.q_len(),
            rows.kv_len(),
            inputs.q_len,
            inputs.kv_len
        )));
    }
    let t0 = Instant::now();
    let plan = rt.upload_plan(rows, stream)?;
    Ok((plan, t0.elapsed().as_secs_f64() * 1e3))
}

fn measure_plan(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    inputs: &mut BenchInputs,
    rows: &RowIntervals,
    plan: &DevicePlan,
    plan_upload_ms: f64,
) -> Result<Measurement, Error> {
    // The forward kernel's own tiles (the variant the launch picks): its work and its
    // density ceiling.
    let variant = cm_cuda::forward_variant(
        plan,
        rt.forward_kernel(),
        inputs.opts.dtype,
        (inputs.opts.head_dim as u32, inputs.opts.head_dim_v as u32),
        false,
        rt.forward_tile(),
    )
    .ok_or_else(|| Error::invalid("no forward kernel is built at the benchmark's head dims"))?;
    let counts = plan.variant_tile_counts(variant);
    let computed_pairs = plan.variant_computed_pairs(variant);
    let tile = plan.variant_tile(variant);
    let density = plan.visible_pairs() as f64 / computed_pairs.max(1) as f64;
    let check = check(rt, stream, inputs, rows, plan)?;
    let timing = if check.pass() {
        Some(time(rt, stream, inputs, plan)?)
    } else {
        None
    };
    Ok(Measurement {
        visible_pairs: plan.visible_pairs(),
        computed_pairs,
        tile: (tile.block_m, tile.block_n),
        tiles_full: counts.full,
        tiles_partial: counts.partial,
        density_ceiling_tflops: density * MATMUL_PEAK_TFLOPS,
        plan_upload_ms,
        check,
        timing,
    })
}

/// Fills a device buffer with `value`.
fn fill<T: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    value: T,
    what: &'static str,
) -> Result<(), Error> {
    let n = buf.len();
    stream
        .memcpy_htod(&vec![value; n], buf)
        .map_err(|e| Error::driver(what, e))
}

/// The query rows a check compares: the first, last and middle rows, those at the first tile
/// edges, and `opts.check_rows` random ones (deterministic in the seed), sorted, distinct.
fn sample_rows(opts: &BenchOptions, len: u32, salt: u64) -> Vec<u32> {
    let mut rng = splitmix(opts.seed ^ u64::from(len) ^ salt);
    let last = len - 1;
    let mut sel: Vec<u32> = vec![
        0,
        1,
        63,
        64,
        65,
        len / 3,
        len / 2,
        last.saturating_sub(1),
        last,
    ];
    sel.extend((0..opts.check_rows).map(|_| {
        rng = splitmix(rng);
        (rng % u64::from(len)) as u32
    }));
    sel.retain(|&r| r < len);
    sel.sort_unstable();
    sel.dedup();
    sel
}

/// First, middle and last of `n` heads.
fn sample_heads(n: usize) -> Vec<usize> {
    let mut heads = vec![0, n / 2, n - 1];
    heads.dedup();
    heads
}

/// Logical values of a `[1, n, len, d]` tensor's bits: rows `rows` (every row when `None`)
/// of the heads `heads`, in that order (`[heads.len(), rows, d]`).
fn gather(
    bits: &[u16],
    dt: DType,
    (len, d): (usize, usize),
    heads: &[usize],
    rows: Option<&[u32]>,
) -> Vec<f64> {
    let mut out = Vec::new();
    for &h in heads {
        let head = &bits[h * len * d..(h + 1) * len * d];
        match rows {
            Some(rows) => {
                for &r in rows {
                    let at = r as usize * d;
                    out.extend(head[at..at + d].iter().map(|&b| from_bits(dt, b)));
                }
            }
            None => out.extend(head.iter().map(|&b| from_bits(dt, b))),
        }
    }
    out
}

/// The rows `sel` of `rows`, as a mask of `sel.len()` rows over the same keys.
fn sub_mask(rows: &RowIntervals, sel: &[u32]) -> Result<RowIntervals, Error> {
    let sub: Vec<Vec<(u32, u32)>> = sel
        .iter()
        .map(|&r| rows.row(r).iter().map(|iv| (iv.start, iv.end)).collect())
        .collect();
    RowIntervals::from_rows(rows.kv_len(), &sub).map_err(Error::invalid)
}

/// Runs one call over a NaN-filled output, then compares sampled rows of sampled heads with
/// the reference and scans the whole output and lse for NaN.
fn check(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    inputs: &mut BenchInputs,
    rows: &RowIntervals,
    plan: &DevicePlan,
) -> Result<Check, Error> {
    let opts = inputs.opts;
    let drv = |what| move |e| Error::driver(what, e);
    fill(stream, &mut inputs.out, nan_bits(opts.dtype), "output fill")?;
    fill(stream, &mut inputs.lse, f32::NAN, "lse fill")?;
    inputs.forward(rt, stream, plan)?;
    let out = stream
        .clone_dtoh(&inputs.out)
        .map_err(drv("output download"))?;
    let lse = stream
        .clone_dtoh(&inputs.lse)
        .map_err(drv("lse download"))?;

    let (q_len, kv_len, d) = (rows.q_len(), rows.kv_len() as usize, opts.head_dim);
    let dv = opts.head_dim_v;
    let sel = sample_rows(&opts, q_len, 0);
    let heads = sample_heads(opts.heads);
    let kv_heads: Vec<usize> = heads
        .iter()
        .map(|h| h / (opts.heads / opts.kv_heads))
        .collect();

    // A reduced problem with the same answer on the checked rows: one head per checked head,
    // the sampled query rows, every key of that head's KV head.
    let x = &inputs.host;
    let dt = opts.dtype;
    let (ql, kl) = ((q_len as usize, d), (kv_len, d));
    let sub = sub_mask(rows, &sel)?;
    let shape = Shape {
        batch: 1,
        heads: heads.len(),
        kv_heads: heads.len(),
        q_len: sel.len(),
        kv_len,
        head_dim: d,
        head_dim_v: opts.head_dim_v,
    };
    let all: Vec<u32> = (0..sel.len() as u32).collect();
    let scale = 1.0 / (d as f64).sqrt();
    let reduced = Inputs {
        q: gather(&x[0], dt, ql, &heads, Some(&sel)),
        k: gather(&x[1], dt, kl, &kv_heads, None),
        v: gather(&x[2], dt, (kv_len, dv), &kv_heads, None),
    };
    let exp = reference::compute(shape, &reduced, &sub, &all, scale, dt);

    let mut c = Check {
        rows: sel.clone(),
        heads: heads.clone(),
        max_abs_err: 0.0,
        emulated_err: 0.0,
        tolerance: 0.0,
        lse_err: 0.0,
        nan: out.iter().filter(|&&b| from_bits(dt, b).is_nan()).count()
            + lse.iter().filter(|x| x.is_nan()).count(),
        empty_rows_wrong: 0,
    };
    for (hi, &h) in heads.iter().enumerate() {
        for (ri, &r) in sel.iter().enumerate() {
            let item = hi * sel.len() + ri;
            let at = (h * q_len as usize + r as usize) * dv;
            let got = &out[at..at + dv];
            let got_lse = f64::from(lse[h * q_len as usize + r as usize]);
            if rows.row(r).is_empty() {
                let zero = got.iter().all(|&b| from_bits(dt, b) == 0.0);
                c.empty_rows_wrong += usize::from(!zero || got_lse != f64::NEG_INFINITY);
                continue;
            }
            for (col, &b) in got.iter().enumerate() {
                let want = exp.out[item * dv + col];
                c.max_abs_err = c.max_abs_err.max((from_bits(dt, b) - want).abs());
                c.emulated_err = c
                    .emulated_err
                    .max((exp.emulated[item * dv + col] - want).abs());
            }
            // NaN compares false here, and is counted above.
            c.lse_err = c.lse_err.max((got_lse - exp.lse[item]).abs());
        }
    }
    c.tolerance = reference::tolerance(c.emulated_err);
    Ok(c)
}

/// Per-call GPU milliseconds of `runs` back-to-back calls of `f`, each between two CUDA
/// events, after `warmup` untimed calls.
pub fn time_calls(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    warmup: usize,
    runs: usize,
    mut f: impl FnMut() -> Result<(), Error>,
) -> Result<Vec<f64>, Error> {
    let drv = |what| move |e| Error::driver(what, e);
    for _ in 0..warmup {
        f()?;
    }
    let events = (0..=runs)
        .map(|_| {
            rt.context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(drv("cuEventCreate"))?;
    events[0].record(stream).map_err(drv("cuEventRecord"))?;
    for e in &events[1..] {
        f()?;
        e.record(stream).map_err(drv("cuEventRecord"))?;
    }
    stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
    events
        .windows(2)
        .map(|w| w[0].elapsed_ms(&w[1]).map(f64::from))
        .collect::<Result<_, _>>()
        .map_err(drv("cuEventElapsedTime"))
}

fn time(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    inputs: &mut BenchInputs,
    plan: &DevicePlan,
) -> Result<Timing, Error> {
    let opts = inputs.opts;
    let drv = |what| move |e| Error::driver(what, e);
    let per_call = time_calls(rt, stream, opts.warmup, opts.runs, || {
        inputs.forward(rt, stream, plan)
    })?;
    let mean_ms = per_call.iter().sum::<f64>() / per_call.len() as f64;
    let median_ms = median(per_call);

    let events = (0..2)
        .map(|_| {
            rt.context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(drv("cuEventCreate"))?;
    let (mut single, mut single_gpu, mut enqueue) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..opts.latency_runs {
        let t = Instant::now();
        events[0].record(stream).map_err(drv("cuEventRecord"))?;
        inputs.forward(rt, stream, plan)?;
        enqueue.push(t.elapsed().as_secs_f64() * 1e6);
        events[1].record(stream).map_err(drv("cuEventRecord"))?;
        stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
        single.push(t.elapsed().as_secs_f64() * 1e3);
        let gpu = events[0]
            .elapsed_ms(&events[1])
            .map_err(drv("cuEventElapsedTime"))?;
        single_gpu.push(f64::from(gpu));
    }
    let single_call_ms = median(single);
    let flops = forward_flops(&opts, plan.visible_pairs());
    Ok(Timing {
        median_ms,
        mean_ms,
        tflops: flops / (median_ms * 1e-3) / 1e12,
        single_call_ms,
        single_call_gpu_ms: median(single_gpu),
        enqueue_us: median(enqueue),
        host_overhead_us: (single_call_ms - median_ms) * 1e3,
    })
}

/// `2 * heads * (head_dim + head_dim_v) * visible_pairs`: the forward's FLOPs by
/// docs/workloads.md (`4 * heads * head_dim * visible_pairs` where the two are equal; S = Q K^T
/// and O = P V, two FLOPs per multiply-add).
fn forward_flops(opts: &BenchOptions, visible_pairs: u64) -> f64 {
    2.0 * opts.heads as f64 * (opts.head_dim + opts.head_dim_v) as f64 * visible_pairs as f64
}

/// The correctness check of one backward mode, run before it is timed.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardCheck {
    /// Whether this is the deterministic mode's check (else the fast mode's).
    pub deterministic: bool,
    /// Query rows whose dQ was compared with the float64 reference, from scratch
    /// ([`grad::dq_rows`]), on the query heads `heads`.
    pub rows: Vec<u32>,
    /// See `rows`.
    pub heads: Vec<usize>,
    /// Keys whose dK and dV were compared with the float64 gradients of the forward's own lse
    /// and output ([`grad::dkdv_keys`]), summed over the query heads of each of `kv_heads`.
    pub keys: Vec<u32>,
    /// See `keys`.
    pub kv_heads: Vec<usize>,
    /// The errors; empty query rows must give dQ = 0 and keys no row sees dK = dV = 0.
    pub grads: GradCheck,
    /// NaN values anywhere in dQ, dK and dV.
    pub nan: usize,
}

impl BackwardCheck {
    pub fn pass(&self) -> bool {
        self.nan == 0 && self.grads.pass()
    }

    pub fn json(&self) -> Value {
        json!({
            "mode": if self.deterministic { "deterministic" } else { "fast" },
            "dq_rows": self.rows, "dq_heads": self.heads, "dkdv_keys": self.keys,
            "dkdv_kv_heads": self.kv_heads, "dq": self.grads.dq.json(),
            "dk": self.grads.dk.json(), "dv": self.grads.dv.json(), "nan": self.nan,
            "pass": self.pass(),
        })
    }
}

/// Forward + backward timings of one configuration (the forward alone is in
/// [`BackwardMeasurement::forward`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackwardTiming {
    /// Median GPU time of a forward with lse followed by a fast-mode backward on one stream,
    /// each pair between two CUDA events, milliseconds.
    pub fwd_bwd_ms: f64,
    /// `3.5 * 2 * heads * (head_dim + head_dim_v) * visible_pairs / fwd_bwd_ms` (3.5 times
    /// the forward's FLOPs), in TFLOP/s.
    pub fwd_bwd_tflops: f64,
    /// Median GPU time of the fast-mode backward alone, milliseconds.
    pub bwd_ms: f64,
    /// `2.5 * 2 * heads * (head_dim + head_dim_v) * visible_pairs / bwd_ms` (2.5 times the
    /// forward's FLOPs), in TFLOP/s.
    pub bwd_tflops: f64,
    /// The deterministic backward alone (milliseconds, TFLOP/s), when asked for.
    pub deterministic_bwd: Option<(f64, f64)>,
}

/// Everything measured for one mask, forward and backward.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardMeasurement {
    /// The forward's check and timing, as [`measure`] gives them.
    pub forward: Measurement,
    /// The fast mode's gradient check, then the deterministic mode's when it is timed too.
    pub checks: Vec<BackwardCheck>,
    /// `None` when a check (forward or backward) failed.
    pub timing: Option<BackwardTiming>,
}

impl BackwardMeasurement {
    /// Whether the forward and every backward check passed.
    pub fn pass(&self) -> bool {
        self.forward.check.pass() && self.checks.iter().all(BackwardCheck::pass)
    }

    /// [`Measurement::json`] of the forward with a `backward` object (checks and timings)
    /// and the overall `pass`.
    pub fn json(&self) -> Value {
        let mut v = self.forward.json();
        let mut b = json!({
            "checks": self.checks.iter().map(BackwardCheck::json).collect::<Vec<_>>(),
        });
        if let Some(t) = &self.timing {
            b["fwd_bwd_ms"] = json!(t.fwd_bwd_ms);
            b["fwd_bwd_tflops"] = json!(t.fwd_bwd_tflops);
            b["bwd_ms"] = json!(t.bwd_ms);
            b["bwd_tflops"] = json!(t.bwd_tflops);
            if let Some((ms, tf)) = t.deterministic_bwd {
                b["deterministic_bwd_ms"] = json!(ms);
                b["deterministic_bwd_tflops"] = json!(tf);
            }
        }
        v["backward"] = b;
        v["pass"] = json!(self.pass());
        v
    }
}

/// Checks and times forward + backward on `rows` over `inputs` (dO drawn on first use), by
/// the backward protocol of BENCHMARKS.md: the forward as [`measure`] does it, then each
/// backward mode's gradients against the float64 references ([`BackwardCheck`]), then the
/// median of `opts.runs` back-to-back calls between CUDA events, after `opts.warmup`, of the
/// fast backward alone, of forward + fast backward, and with `deterministic` of the
/// deterministic backward alone. Nothing is timed when a check fails.
///
/// # Errors
/// As [`measure`].
pub fn measure_backward(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    inputs: &mut BenchInputs,
    rows: &RowIntervals,
    deterministic: bool,
) -> Result<BackwardMeasurement, Error> {
    let (plan, plan_upload_ms) = upload(rt, stream, inputs, rows)?;
    let forward = measure_plan(rt, stream, inputs, rows, &plan, plan_upload_ms)?;
    inputs.ensure_backward(stream, &plan)?;
    let mut checks = vec![check_backward(rt, stream, inputs, rows, &plan, false)?];
    if deterministic {
        checks.push(check_backward(rt, stream, inputs, rows, &plan, true)?);
    }
    let mut m = BackwardMeasurement {
        forward,
        checks,
        timing: None,
    };
    if !m.pass() {
        return Ok(m);
    }
    let opts = inputs.opts;
    let fwd_flops = forward_flops(&opts, plan.visible_pairs());
    let tflops = |flops: f64, ms: f64| flops / (ms * 1e-3) / 1e12;
    let mut timed = |f: &mut dyn FnMut(&mut BenchInputs) -> Result<(), Error>| {
        time_calls(rt, stream, opts.warmup, opts.runs, || f(inputs)).map(median)
    };
    let bwd_ms = timed(&mut |i| i.backward(rt, stream, &plan, false))?;
    let fwd_bwd_ms = timed(&mut |i| {
        i.forward(rt, stream, &plan)?;
        i.backward(rt, stream, &plan, false)
    })?;
    let deterministic_bwd = if deterministic {
        let ms = timed(&mut |i| i.backward(rt, stream, &plan, true))?;
        Some((ms, tflops(2.5 * fwd_flops, ms)))
    } else {
        None
    };
    m.timing = Some(BackwardTiming {
        fwd_bwd_ms,
        fwd_bwd_tflops: tflops(3.5 * fwd_flops, fwd_bwd_ms),
        bwd_ms,
        bwd_tflops: tflops(2.5 * fwd_flops, bwd_ms),
        deterministic_bwd,
    });
    Ok(m)
}

/// A forward with lse, then one backward over NaN-filled gradients; then a NaN scan of the
/// whole dQ, dK and dV, sampled dQ rows against [`grad::dq_rows`] and sampled dK / dV keys
/// against [`grad::dkdv_keys`] (on the first, middle and last query / KV heads).
fn check_backward(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    inputs: &mut BenchInputs,
    rows: &RowIntervals,
    plan: &DevicePlan,
    deterministic: bool,
) -> Result<BackwardCheck, Error> {
    let drv = |what| move |e| Error::driver(what, e);
    let opts = inputs.opts;
    let dt = opts.dtype;
    inputs.forward(rt, stream, plan)?;
    {
        let g = inputs
            .bwd
            .as_mut()
            .ok_or_else(|| Error::invalid("backward buffers are not allocated"))?;
        for buf in [&mut g.dq, &mut g.dk, &mut g.dv] {
            fill(stream, buf, nan_bits(dt), "gradient fill")?;
        }
    }
    inputs.backward(rt, stream, plan, deterministic)?;
    let down = |b: &CudaSlice<u16>| stream.clone_dtoh(b).map_err(drv("gradient download"));
    let g = inputs
        .bwd
        .as_ref()
        .ok_or_else(|| Error::invalid("backward buffers are not allocated"))?;
    let got = Downloaded {
        dq: down(&g.dq)?,
        dk: down(&g.dk)?,
        dv: down(&g.dv)?,
        out: down(&inputs.out)?,
        lse: stream
            .clone_dtoh(&inputs.lse)
            .map_err(drv("lse download"))?,
    };
    check_gradients(&opts, rows, &inputs.host, &g.host_dout, &got, deterministic)
}

/// What [`check_backward`] downloads: the gradients, the forward's output and lse (memory
/// images of the contiguous `[1, heads | kv_heads, len, width]` tensors).
struct Downloaded {
    dq: Vec<u16>,
    dk: Vec<u16>,
    dv: Vec<u16>,
    out: Vec<u16>,
    lse: Vec<f32>,
}

/// The host half of [`check_backward`]: the NaN scan and the sampled dQ rows and dK / dV keys
/// of `got` against the references computed from the inputs `host` (Q, K, V) and `dout`.
fn check_gradients(
    opts: &BenchOptions,
    rows: &RowIntervals,
    x: &[Vec<u16>; 3],
    host_dout: &[u16],
    got: &Downloaded,
    deterministic: bool,
) -> Result<BackwardCheck, Error> {
    let dt = opts.dtype;
    let (dq, dk, dv, out, lse) = (&got.dq, &got.dk, &got.dv, &got.out, &got.lse);
    let nan = [dq, dk, dv]
        .iter()
        .map(|t| t.iter().filter(|&&b| from_bits(dt, b).is_nan()).count())
        .sum();

    let (q_len, kv_len, d) = (rows.q_len(), rows.kv_len(), opts.head_dim);
    let dvw = opts.head_dim_v;
    // (rows, width) of Q / dQ, K / dK, dO / the output, V / dV.
    let (ql, kl) = ((q_len as usize, d), (kv_len as usize, d));
    let (ol, vl) = ((q_len as usize, dvw), (kv_len as usize, dvw));
    let group = opts.heads / opts.kv_heads;
    let scale = 1.0 / (d as f64).sqrt();

    // dQ of sampled rows: a reduced problem as in the forward check, plus those rows of dO.
    let sel = sample_rows(opts, q_len, 0);
    let heads = sample_heads(opts.heads);
    let kvh: Vec<usize> = heads.iter().map(|h| h / group).collect();
    let sub = sub_mask(rows, &sel)?;
    let reduced = Tensors {
        q: gather(&x[0], dt, ql, &heads, Some(&sel)),
        k: gather(&x[1], dt, kl, &kvh, None),
        v: gather(&x[2], dt, vl, &kvh, None),
        dout: gather(host_dout, dt, ol, &heads, Some(&sel)),
    };
    let shape = Shape {
        batch: 1,
        heads: heads.len(),
        kv_heads: heads.len(),
        q_len: sel.len(),
        kv_len: kv_len as usize,
        head_dim: d,
        head_dim_v: dvw,
    };
    let all: Vec<u32> = (0..sel.len() as u32).collect();
    let (exact, emulated) = grad::dq_rows(shape, &reduced, &sub, scale, dt, &all);
    let got_dq = gather(dq, dt, ql, &heads, Some(&sel));
    let n = sel.len();
    let dq_check = grad::check_tensor(&got_dq, &exact, &emulated, d, |r| {
        sub.row((r % n) as u32).is_empty()
    });

    // dK / dV of sampled keys on sampled KV heads, from every row of their query heads.
    let keys = sample_rows(opts, kv_len, 0x6b65_7973);
    let kv_sel = sample_heads(opts.kv_heads);
    let q_heads: Vec<usize> = kv_sel
        .iter()
        .flat_map(|&k| k * group..(k + 1) * group)
        .collect();
    let reduced = Tensors {
        q: gather(&x[0], dt, ql, &q_heads, None),
        k: gather(&x[1], dt, kl, &kv_sel, None),
        v: gather(&x[2], dt, vl, &kv_sel, None),
        dout: gather(host_dout, dt, ol, &q_heads, None),
    };
    let fwd_out = gather(out, dt, ol, &q_heads, None);
    let fwd_lse: Vec<f64> = q_heads
        .iter()
        .flat_map(|&h| &lse[h * q_len as usize..(h + 1) * q_len as usize])
        .map(|&l| f64::from(l))
        .collect();
    let shape = Shape {
        heads: q_heads.len(),
        kv_heads: kv_sel.len(),
        q_len: q_len as usize,
        ..shape
    };
    let fwd = ForwardResult {
        out: &fwd_out,
        lse: &fwd_lse,
    };
    let (exact, emulated) = grad::dkdv_keys(shape, &reduced, rows, scale, dt, &keys, &fwd);
    let unseen: Vec<bool> = keys
        .iter()
        .map(|&j| grad::rows_seeing(rows, j).is_empty())
        .collect();
    let nk = keys.len();
    let dk_check = grad::check_tensor(
        &gather(dk, dt, kl, &kv_sel, Some(&keys)),
        &exact.dk,
        &emulated.dk,
        d,
        |r| unseen[r % nk],
    );
    let dv_check = grad::check_tensor(
        &gather(dv, dt, vl, &kv_sel, Some(&keys)),
        &exact.dv,
        &emulated.dv,
        dvw,
        |r| unseen[r % nk],
    );
    Ok(BackwardCheck {
        deterministic,
        rows: sel,
        heads,
        keys,
        kv_heads: kv_sel,
        grads: GradCheck {
            dq: dq_check,
            dk: dk_check,
            dv: dv_check,
        },
        nan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_bits_are_deterministic_standard_normal() {
        let a = random_bits(DType::Bf16, 3_000_001, 7);
        assert_eq!(a, random_bits(DType::Bf16, 3_000_001, 7));
        assert_ne!(a[..64], random_bits(DType::Bf16, 64, 8)[..]);
        let xs: Vec<f64> = a.iter().map(|&b| from_bits(DType::Bf16, b)).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(
            mean.abs() < 5e-3 && (var - 1.0).abs() < 1e-2,
            "{mean} {var}"
        );
        assert!(xs.iter().all(|x| x.is_finite()));
    }

    /// The host half of the benchmark's backward check at the MLA widths (head_dim 24 here,
    /// head_dim_v 16; GQA, empty rows, keys no row sees): the full float64 reference's
    /// dtype-emulated gradients, as a kernel's output, pass; one wrong dV value of a sampled
    /// key fails; a NaN is counted.
    #[test]
    fn backward_check_at_unequal_head_dims() {
        let (sq, skv, h, hkv, d, dvw) = (90usize, 110usize, 4usize, 2usize, 24usize, 16usize);
        let opts = BenchOptions {
            heads: h,
            kv_heads: hkv,
            head_dim: d,
            head_dim_v: dvw,
            check_rows: 8,
            ..BenchOptions::default()
        };
        let dt = opts.dtype;
        let mask_rows: Vec<Vec<(u32, u32)>> = (0..sq as u32)
            .map(|i| match i {
                30..40 => vec![],
                _ => vec![(i.saturating_sub(20), i + 1)],
            })
            .collect();
        let rows = RowIntervals::from_rows(skv as u32, &mask_rows).unwrap();
        let x = [
            random_bits(dt, h * sq * d, 1),
            random_bits(dt, hkv * skv * d, 2),
            random_bits(dt, hkv * skv * dvw, 3),
        ];
        let dout = random_bits(dt, h * sq * dvw, 4);
        let f = |b: &[u16]| b.iter().map(|&b| from_bits(dt, b)).collect::<Vec<f64>>();
        let shape = Shape {
            batch: 1,
            heads: h,
            kv_heads: hkv,
            q_len: sq,
            kv_len: skv,
            head_dim: d,
            head_dim_v: dvw,
        };
        let scale = 1.0 / (d as f64).sqrt();
        let all: Vec<u32> = (0..sq as u32).collect();
        let inputs = Inputs {
            q: f(&x[0]),
            k: f(&x[1]),
            v: f(&x[2]),
        };
        let fwd = reference::compute(shape, &inputs, &rows, &all, scale, dt);
        let tensors = Tensors {
            q: inputs.q,
            k: inputs.k,
            v: inputs.v,
            dout: f(&dout),
        };
        let full = grad::compute(shape, &tensors, &rows, scale, dt);
        let bits = |v: &[f64]| v.iter().map(|&g| to_bits(dt, g as f32)).collect::<Vec<_>>();
        let mut got = Downloaded {
            dq: bits(&full.emulated.dq),
            dk: bits(&full.emulated.dk),
            dv: bits(&full.emulated.dv),
            out: bits(&fwd.emulated),
            lse: fwd.lse.iter().map(|&l| l as f32).collect(),
        };
        let c = check_gradients(&opts, &rows, &x, &dout, &got, true).unwrap();
        assert!(c.pass(), "{}", c.grads.describe());
        assert!(c.deterministic && c.heads == [0, 2, 3] && c.kv_heads == [0, 1]);
        // An empty row (30 = q_len / 3), an unseen key (109) and key 1 are among the sampled.
        assert!(c.rows.contains(&30) && c.keys.contains(&1) && c.keys.contains(&(skv as u32 - 1)));
        for t in [c.grads.dq, c.grads.dk, c.grads.dv] {
            assert!(t.max_ref > 0.1 && t.max_err > 0.0, "{t:?}");
        }
        // Key 1 of kv head 1, column 15: a sampled key, dV's last column at head_dim_v.
        let at = (skv + 1) * dvw + dvw - 1;
        let right = got.dv[at];
        got.dv[at] = to_bits(dt, (from_bits(dt, right) + 1.0) as f32);
        let c = check_gradients(&opts, &rows, &x, &dout, &got, false).unwrap();
        assert!(c.grads.dq.pass() && c.grads.dk.pass() && !c.grads.dv.pass());
        assert!(c.grads.dv.max_err > 0.9, "{}", c.grads.describe());
        got.dv[at] = nan_bits(dt);
        let c = check_gradients(&opts, &rows, &x, &dout, &got, false).unwrap();
        assert_eq!((c.nan, c.grads.dv.nan), (1, 1));
    }

    #[test]
    fn bits_round_trip_and_decode_both_dtypes() {
        assert_eq!(from_bits(DType::Bf16, 0x3F80), 1.0);
        assert_eq!(from_bits(DType::Bf16, 0xC040), -3.0);
        assert!(from_bits(DType::Bf16, nan_bits(DType::Bf16)).is_nan());
        assert_eq!(from_bits(DType::F16, 0x3C00), 1.0);
        assert_eq!(from_bits(DType::F16, 0xC200), -3.0);
        assert_eq!(from_bits(DType::F16, 0x0001), 2f64.powi(-24));
        assert_eq!(from_bits(DType::F16, 0x7C00), f64::INFINITY);
        assert!(from_bits(DType::F16, nan_bits(DType::F16)).is_nan());
        for dt in [DType::Bf16, DType::F16] {
            assert_eq!(from_bits(dt, to_bits(dt, -0.375)), -0.375);
        }
    }
}
