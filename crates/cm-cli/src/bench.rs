//! `compilemask bench`: the forward kernel on the benchmark workloads of docs/workloads.md, by its
//! protocol (batch 1, softmax scale 1/sqrt(head_dim)): correctness on sampled rows against the
//! float64 reference first, then effective TFLOP/s (`2 * heads * (head_dim + head_dim_v) * visible_pairs`
//! over the median of back-to-back calls timed with CUDA events), single-call latency with
//! the host launch included, host overhead, and the tile-density ceiling. Needs the GPU
//! machine and a build with embedded kernels; every argument is checked before the GPU is
//! touched.
//!
//! `--order auto` (issue 6) plans grid masks in the patch order that the compiler chooses for
//! the kernel's tile shape and runs the kernel on that permuted plan with the same random
//! tensors (random tensors are order-agnostic); the reference check then uses the permuted
//! plan's rows, and the FLOP count (visible pairs) is the same in every order. Each such job
//! also checks the permutation property on the GPU: the forward on raster tensors with the
//! raster plan equals the forward on permuted tensors with the ordered plan, un-permuted.
//! `--order-check` runs that property alone on a fixed set of small CLEAR and 3D cases.
//!
//! `--bwd` (issue 4) adds the backward by the protocol of BENCHMARKS.md's backward section
//! (`cm_bench::measure_backward`): after the forward's check, the fast-mode gradients
//! (and with `--deterministic` the deterministic mode's) are checked (NaN scan of dQ, dK, dV;
//! sampled dQ rows and dK / dV keys against float64, within twice the dtype emulation's error
//! plus 1e-3), then a forward with lse followed by a backward on one stream is timed:
//! effective TFLOP/s = 3.5 x the forward's FLOPs over that time, the backward alone 2.5 x.
//! It works in every `--order`: the backward runs on the same (permuted) plan.
//!
//! `--decode` (serving) runs `cm_bench::decode::measure_decode` instead: `--batch` sequences
//! of one new token each over a paged KV cache of each `--sizes` keys and `--page-sizes`
//! (`--heads` / `--kv-heads` / `--head-dim` / `--dtype`), checked against float64 on sampled
//! sequences, then TB/s of K and V read against the copy bandwidth of the same run.

use anyhow::{anyhow, bail, Result};
use clap::{Args, ValueEnum};
use cm_bench::{
    from_bits, random_bits, BackwardMeasurement, BenchInputs, BenchOptions, Measurement,
    MATMUL_PEAK_TFLOPS,
};
use cm_cuda::{DType, KernelKind, Runtime};
use cm_cuda::{Forward, LseLayout, TensorLayout};
use compilemask::{OrderRequest, PlanOptions, RowIntervals, TokenOrder, Traversal, Value as Param};
use serde_json::{json, Value};

/// `println!` that never panics: a closed standard output (`bench | head`) drops the text.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `print!` that never panics, as [`outln!`].
macro_rules! outp {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

/// The eight workloads of docs/workloads.md: (id, built-in mask).
pub const WORKLOADS: [(&str, &str); 8] = [
    ("W1", "causal"),
    ("W2", "hstu"),
    ("W3", "shared_prefix"),
    ("W4", "clear"),
    ("W5", "sliding_window"),
    ("W6", "document_causal"),
    ("W7", "trace_documents"),
    ("W8", "trace_prompt_groups"),
];

/// A count argument: an integer from 1, the error naming the accepted range (clap's own
/// parser says "invalid digit" of `-1`).
fn parse_count(s: &str) -> Result<usize, String> {
    parse_bounded(s, usize::MAX)
}

fn parse_bounded(s: &str, max: usize) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(v) if (1..=max).contains(&v) => Ok(v),
        _ => Err(format!(
            "`{s}` is not a count; expected an integer in 1..={max}"
        )),
    }
}

/// A head count within what a plan indexes (`compilemask::LENGTH_LIMITS`).
fn parse_heads(s: &str) -> Result<usize, String> {
    let max = compilemask::LENGTH_LIMITS
        .iter()
        .find(|(name, _)| *name == "num_heads")
        .map_or(usize::MAX, |&(_, max)| max as usize);
    parse_bounded(s, max)
}

/// Longest sequence accepted: the inputs alone take `6 * heads * head_dim * S` bytes.
const MAX_LEN: u32 = 1 << 20;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Nominal sequence lengths S, comma-separated. CLEAR runs at 512 + n*n tokens with the
    /// grid n of docs/workloads.md (90 for 8192, 180 for 32768; otherwise the nearest grid).
    #[arg(long, value_delimiter = ',', default_value = "8192,32768",
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LEN)),
          allow_negative_numbers = true)]
    sizes: Vec<u32>,
    /// Query heads.
    #[arg(long, default_value_t = 16, value_parser = parse_heads)]
    heads: usize,
    /// Key / value heads (default: --heads); must divide --heads (GQA, MQA).
    #[arg(long, value_parser = parse_heads)]
    kv_heads: Option<usize>,
    /// Columns of Q and K per head.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    head_dim: u32,
    /// Columns of V and of the output per head (default: --head-dim); 128 with --head-dim
    /// 192 is DeepSeek's MLA shape (forward and backward; the built shapes are listed in an
    /// error otherwise).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    head_dim_v: Option<u32>,
    /// Element type of Q, K, V and the output.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DTypeArg,
    /// Built-in masks to run, comma-separated (default: the eight workloads W1..W8).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "causal,hstu,shared_prefix,clear,sliding_window,document_causal,trace_documents,trace_prompt_groups"
    )]
    workloads: Vec<String>,
    /// Forward kernel.
    #[arg(long, value_enum, default_value = "ws")]
    kernel: KernelArg,
    /// The forward's tile `MxN` where the kernel has several at these head dims (`ws` at
    /// head_dim 64: 128x128 or 192x128); default: the one each plan ranks first.
    #[arg(long, value_name = "MxN", allow_hyphen_values = true)]
    fwd_tile: Option<String>,
    /// Token orders to run each workload in, comma-separated: `raster` (the program's
    /// positions) and / or `auto` (the patch order the compiler chooses for the kernel's tile
    /// shape; needs masks with a grid, e.g. clear or neighborhood_3d). Every `auto` run also
    /// checks on the GPU that it equals the raster run, un-permuted.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "raster")]
    order: Vec<OrderArg>,
    /// Only check the permutation property on the GPU (small CLEAR and 3D grids in several
    /// patch orders, and the 16x32x32 video mask), then exit; ignores the workload options.
    #[arg(long)]
    order_check: bool,
    /// Also check and time the backward: a forward with lse then a fast-mode backward on one
    /// stream (effective TFLOP/s = 3.5 x the forward's FLOPs / time), and the backward alone.
    #[arg(long)]
    bwd: bool,
    /// With --bwd: also check and time the deterministic backward (dQ summed in a fixed order).
    #[arg(long, requires = "bwd")]
    deterministic: bool,
    /// Serving decode over a paged KV cache instead of the workloads: `--sizes` are the
    /// cached keys per sequence (e.g. `--decode --sizes 8192,32768,131072 --heads 32
    /// --kv-heads 8`).
    #[arg(long, conflicts_with_all = ["bwd", "order_check"])]
    decode: bool,
    /// With --decode: sequences in the batch.
    #[arg(long, default_value_t = 64, requires = "decode", value_parser = parse_count)]
    batch: usize,
    /// With --decode: keys per cache page, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16,64",
        requires = "decode",
        value_parser = parse_count
    )]
    page_sizes: Vec<usize>,
    /// Back-to-back calls timed per workload and per timed quantity (the protocol asks for at
    /// least 50).
    #[arg(long, default_value_t = 60, value_parser = parse_count)]
    runs: usize,
    /// Seed of the random inputs and sampled rows (default: fixed).
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON to this file (`-`: standard output).
    #[arg(short, long)]
    output: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DTypeArg {
    Bf16,
    Fp16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OrderArg {
    /// The program's own positions.
    Raster,
    /// The compiler's patch order for the kernel's tile shape.
    Auto,
}

impl OrderArg {
    fn name(self) -> &'static str {
        match self {
            OrderArg::Raster => "raster",
            OrderArg::Auto => "auto",
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum KernelArg {
    /// `fwd_ws`, the warp-specialised Hopper kernel (TMA, 128x128 tiles; 192x128 at head_dim
    /// 64).
    Ws,
    /// `fwd_wgmma`, the single-warpgroup Hopper kernel (64x64 tiles).
    Wgmma,
    /// `fwd_simple`, the mma.sync reference path.
    Simple,
}

/// One workload at one size, planned and ready to run.
struct Job {
    id: &'static str,
    name: String,
    nominal: u32,
    /// The rows the kernel runs: in the token order below when there is one.
    rows: RowIntervals,
    plan_ms: f64,
    order: OrderArg,
    /// The chosen order and the raster rows, for `--order auto`.
    ordered: Option<Ordered>,
}

/// What an `auto` job carries besides its permuted rows.
struct Ordered {
    order: TokenOrder,
    raster_rows: RowIntervals,
}

/// The sequence length a workload runs at for nominal size `s`.
fn length_for(name: &str, s: u32) -> u32 {
    if name != "clear" {
        return s;
    }
    // docs/workloads.md's CLEAR grids; other sizes take the grid whose length is nearest.
    let grid = match s {
        1024 | 2048 => 32,
        4096 => 64,
        8192 => 90,
        16384 => 128,
        32768 => 180,
        _ => (f64::from(s.saturating_sub(512)).sqrt().round() as u32).max(1),
    };
    512 + grid * grid
}

fn plan_jobs(a: &BenchArgs, tile: (u32, u32)) -> Result<Vec<Job>> {
    let mut jobs = Vec::new();
    for &s in &a.sizes {
        for name in &a.workloads {
            let id = WORKLOADS
                .iter()
                .find(|(_, n)| n == name)
                .map_or("-", |(id, _)| id);
            let program = compilemask::builtin(name).map_err(|e| anyhow!("{}", e.rendered))?;
            let q_len = length_for(name, s);
            for &order in &a.order {
                let mut opts = PlanOptions::new(i64::from(q_len));
                if order == OrderArg::Auto {
                    // The order search scores candidates at this tile shape: the kernel's.
                    opts = opts.tile(tile.0, tile.1);
                    opts.order = OrderRequest::Auto;
                }
                let t0 = std::time::Instant::now();
                let plan = program.plan(&opts).map_err(|e| {
                    anyhow!(
                        "{name} at q_len {q_len}, --order {}: {}",
                        order.name(),
                        program.render_error(&e).trim_end()
                    )
                })?;
                let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
                if plan.masks.len() != 1 {
                    bail!("{name} differs per batch or head; bench runs one mask shared by every head");
                }
                // The kernels read plain intervals: strided runs written out (CM0412 past
                // the limit).
                let rows = unit_rows(&plan.mask(0, 0).rows, name, q_len)?;
                let ordered = match plan.order {
                    Some(o) => Some(Ordered {
                        order: o,
                        raster_rows: raster_rows(&program, name, q_len)?,
                    }),
                    None => None,
                };
                jobs.push(Job {
                    id,
                    name: name.clone(),
                    nominal: s,
                    rows,
                    plan_ms,
                    order,
                    ordered,
                });
            }
        }
    }
    Ok(jobs)
}

/// The mask's rows in the program's own positions.
fn raster_rows(program: &compilemask::Program, name: &str, q_len: u32) -> Result<RowIntervals> {
    let plan = program
        .plan(&PlanOptions::new(i64::from(q_len)))
        .map_err(|e| {
            anyhow!(
                "{name} at q_len {q_len}: {}",
                program.render_error(&e).trim_end()
            )
        })?;
    unit_rows(&plan.mask(0, 0).rows, name, q_len)
}

/// A mask's rows as plain intervals, as the kernels read them.
fn unit_rows(rows: &RowIntervals, name: &str, q_len: u32) -> Result<RowIntervals> {
    rows.expanded()
        .map(std::borrow::Cow::into_owned)
        .map_err(|e| {
            let e = compilemask::expand_error(e);
            anyhow!(
                "{name} at q_len {q_len}: {}",
                compilemask::render_error("", "", &e).trim_end()
            )
        })
}

fn options(a: &BenchArgs) -> Result<(BenchOptions, KernelKind)> {
    let kv_heads = a.kv_heads.unwrap_or(a.heads);
    if !a.heads.is_multiple_of(kv_heads) {
        bail!(
            "--heads {} --kv-heads {kv_heads}: --kv-heads must divide --heads",
            a.heads
        );
    }
    if a.sizes.is_empty() || a.workloads.is_empty() || a.order.is_empty() {
        bail!("--sizes, --workloads and --order must each name at least one entry");
    }
    let dtype = match a.dtype {
        DTypeArg::Bf16 => DType::Bf16,
        DTypeArg::Fp16 => DType::F16,
    };
    let kernel = match a.kernel {
        KernelArg::Ws => KernelKind::FwdWs,
        KernelArg::Wgmma => KernelKind::FwdWgmma,
        KernelArg::Simple => KernelKind::FwdSimple,
    };
    let head_dim_v = a.head_dim_v.unwrap_or(a.head_dim);
    if a.decode && head_dim_v != a.head_dim {
        bail!(
            "--decode reads V at head_dim: --head-dim-v {head_dim_v} must equal --head-dim {}",
            a.head_dim
        );
    }
    if cm_kernels::find_variant(kernel, dtype, a.head_dim, head_dim_v, false).is_none() {
        bail!(
            "--head-dim {} --head-dim-v {head_dim_v} is not built for {} {dtype}; built head dims: {}",
            a.head_dim,
            kernel.name(),
            cm_kernels::head_dims_text(&cm_kernels::built_head_dims(kernel, dtype, false))
        );
    }
    let opts = BenchOptions {
        heads: a.heads,
        kv_heads,
        head_dim: a.head_dim as usize,
        head_dim_v: head_dim_v as usize,
        dtype,
        runs: a.runs,
        seed: a.seed,
        ..BenchOptions::default()
    };
    Ok((opts, kernel))
}

/// The tile the order search scores candidates at: that of `kernel`'s first variant at the
/// benchmark's dtype and head dims (at head_dim 64 `fwd_ws` also has a 192-row variant, which
/// the launch may pick per plan; orders are searched at the 128-row tile).
fn kernel_tile(kernel: KernelKind, opts: &BenchOptions) -> Result<(u32, u32)> {
    let dims = (opts.head_dim as u32, opts.head_dim_v as u32);
    let v =
        cm_kernels::find_variant(kernel, opts.dtype, dims.0, dims.1, false).ok_or_else(|| {
            anyhow!(
                "{} is not built at head_dim = {} with head_dim_v = {}",
                kernel.name(),
                dims.0,
                dims.1
            )
        })?;
    Ok(cm_kernels::VARIANTS[v].tile())
}

/// `--fwd-tile` as `(block_m, block_n)`, checked to be one of `kernel`'s tiles at the
/// benchmark's dtype and head dims.
fn fwd_tile(a: &BenchArgs, kernel: KernelKind, opts: &BenchOptions) -> Result<Option<(u32, u32)>> {
    let Some(text) = &a.fwd_tile else {
        return Ok(None);
    };
    let dims = (opts.head_dim as u32, opts.head_dim_v as u32);
    let built: Vec<(u32, u32)> =
        cm_kernels::find_variants(kernel, opts.dtype, dims.0, dims.1, false)
            .map(|i| cm_kernels::VARIANTS[i].tile())
            .collect();
    let names: Vec<String> = built.iter().map(|(m, n)| format!("{m}x{n}")).collect();
    let tile = text
        .split_once('x')
        .and_then(|(m, n)| Some((m.parse::<u32>().ok()?, n.parse::<u32>().ok()?)));
    match tile {
        Some(t) if built.contains(&t) => Ok(Some(t)),
        _ => bail!(
            "--fwd-tile {text:?}: expected one of {} ({} at head_dim {} with head_dim_v {}, {})",
            names.join(", "),
            kernel.name(),
            dims.0,
            dims.1,
            opts.dtype
        ),
    }
}

/// Runs the benchmark; `Ok(false)` when a correctness check failed.
pub fn run(a: &BenchArgs) -> Result<bool> {
    let (opts, kernel) = options(a)?;
    if a.decode {
        return run_decode(a, opts);
    }
    if a.order_check {
        return run_order_check(a, opts, kernel);
    }
    let jobs = plan_jobs(a, kernel_tile(kernel, &opts)?)?;
    let tile = fwd_tile(a, kernel, &opts)?;
    let mut rt = Runtime::new_on_device(0)?;
    rt.set_forward_kernel(kernel)?;
    rt.set_forward_tile(tile)?;
    // The legacy default stream: with one stream, cudarc adds no event bookkeeping to the
    // launch path.
    let stream = rt.context().default_stream();
    let device = rt.context().name()?;
    if !a.json {
        outln!(
            "compilemask bench{} on {device}: {} H={} H_kv={} head_dim={} head_dim_v={} {}, median of {} back-to-back calls",
            if a.bwd { " --bwd" } else { "" },
            kernel.name(),
            opts.heads,
            opts.kv_heads,
            opts.head_dim,
            opts.head_dim_v,
            opts.dtype,
            opts.runs
        );
        if a.bwd {
            print_bwd_header(a.deterministic);
        } else {
            print_header();
        }
    }
    let mut results = Vec::new();
    let mut all_pass = true;
    // Inputs of the lengths in use; CLEAR's length differs, so at most two live at a time.
    let mut cache: Vec<BenchInputs> = Vec::new();
    let mut cached_size = None;
    for job in &jobs {
        if cached_size != Some(job.nominal) {
            cache.clear();
            cached_size = Some(job.nominal);
        }
        let (q_len, kv_len) = (job.rows.q_len(), job.rows.kv_len());
        let at = match cache.iter().position(|i| i.lengths() == (q_len, kv_len)) {
            Some(at) => at,
            None => {
                cache.push(BenchInputs::new(&stream, q_len, kv_len, opts)?);
                cache.len() - 1
            }
        };
        let inputs = &mut cache[at];
        let (pass, mut r) = if a.bwd {
            let m = cm_bench::measure_backward(&rt, &stream, inputs, &job.rows, a.deterministic)?;
            if !a.json {
                print_bwd_row(job, &m, a.deterministic);
            }
            (m.pass(), with_job(job, m.json()))
        } else {
            let m = cm_bench::measure(&rt, &stream, inputs, &job.rows)?;
            if !a.json {
                print_row(job, &m);
            }
            (m.check.pass(), with_job(job, m.json()))
        };
        all_pass &= pass;
        if let Some(o) = &job.ordered {
            let e = equivalence(&rt, opts, &o.raster_rows, &job.rows, &o.order)?;
            all_pass &= e.pass();
            if !a.json {
                outln!("    {}", e.describe());
            }
            r["order_check"] = e.to_json();
            r["pass"] = json!(pass && e.pass());
        }
        results.push(r);
    }
    let report = json!({
        "device": device,
        "kernel": kernel.name(),
        "heads": opts.heads,
        "kv_heads": opts.kv_heads,
        "head_dim": opts.head_dim,
        "head_dim_v": opts.head_dim_v,
        "dtype": opts.dtype.name(),
        "runs": opts.runs,
        "seed": opts.seed,
        "backward": a.bwd,
        "orders": a.order.iter().map(|o| o.name()).collect::<Vec<_>>(),
        "matmul_peak_tflops": MATMUL_PEAK_TFLOPS,
        "pass": all_pass,
        "results": results,
    });
    if a.json {
        outln!("{report}");
    } else {
        outln!(
            "\nvisible = visible pairs / (q_len * kv_len); ceiling = visible / computed pairs at the kernel tile x {MATMUL_PEAK_TFLOPS} TFLOP/s;"
        );
        if a.bwd {
            outln!("fwd = forward with lse; bwd = fast-mode backward (dQ added by fp32 reductions); fwd+bwd = the two back to back on one stream;");
            outln!("TFLOP/s = 3.5 x the forward's FLOPs (2 x H x (head_dim + head_dim_v) x visible pairs) / fwd+bwd; bwd TFLOP/s = 2.5 x the forward's FLOPs / bwd;");
            outln!("grad err/tol = the largest error / tolerance over the checked dQ rows and dK / dV keys of every checked mode (<= 1 passes).");
        } else {
            outln!("single = one call, host enqueue to host-visible completion; overhead = single - median; host = single - the GPU time");
            outln!("of that call between events recorded around it (the rest of the overhead is the GPU's); enqueue = host time of the call.");
        }
        if a.order.contains(&OrderArg::Auto) {
            outln!("order auto: planned in the compiler's patch order (patch t,y,x and traversal in the order column) for the kernel tile;");
            outln!("order check: that run equals the raster-order run on the same tensors un-permuted (whole output and lse).");
        }
    }
    write_output(a, &report)?;
    Ok(all_pass)
}

/// `--decode`: every (size, page size) of a serving decode step, one row each.
fn run_decode(a: &BenchArgs, opts: BenchOptions) -> Result<bool> {
    if a.page_sizes.is_empty() {
        bail!("--page-sizes must name at least one page size");
    }
    let rt = Runtime::new_on_device(0)?;
    let stream = rt.context().default_stream();
    let device = rt.context().name()?;
    let copy = cm_bench::decode::copy_bandwidth(&rt, &stream, 10)?;
    if !a.json {
        outln!(
            "compilemask bench --decode on {device}: batch {} H={} H_kv={} head_dim={} {}, median of {} calls; copy bandwidth {copy:.2} TB/s",
            a.batch, opts.heads, opts.kv_heads, opts.head_dim, opts.dtype, opts.runs
        );
        outln!(
            "{:>8} {:>5} {:>6} {:>9} {:>9} {:>7} {:>8} {:>10} {:>5}",
            "kv_len",
            "page",
            "splits",
            "median_ms",
            "TB/s",
            "copy",
            "enqueue",
            "err/tol",
            "check"
        );
    }
    let mut results = Vec::new();
    let mut all_pass = true;
    for &kv_len in &a.sizes {
        for &page_size in &a.page_sizes {
            let m = cm_bench::decode::measure_decode(
                &rt,
                &stream,
                cm_bench::decode::DecodeOptions {
                    batch: a.batch,
                    kv_len: kv_len as usize,
                    page_size,
                    num_heads: opts.heads,
                    num_kv_heads: opts.kv_heads,
                    head_dim: opts.head_dim,
                    dtype: opts.dtype,
                    runs: opts.runs,
                    seed: opts.seed,
                },
            )?;
            all_pass &= m.pass();
            if !a.json {
                outln!(
                    "{:>8} {:>5} {:>6} {:>9.3} {:>9.2} {:>6.0}% {:>6.1}us {:>10.2} {:>5}",
                    kv_len,
                    page_size,
                    m.splits,
                    m.median_ms,
                    m.kv_tb_per_s,
                    100.0 * m.kv_tb_per_s / copy,
                    m.enqueue_us,
                    m.max_err / m.tolerance,
                    if m.pass() { "ok" } else { "FAIL" }
                );
            }
            results.push(m.json(copy));
        }
    }
    let report = json!({"device": device, "decode": true, "copy_tb_per_s": copy, "pass": all_pass, "results": results});
    if a.json {
        outln!("{report}");
    } else {
        outln!("TB/s = batch x kv_len x num_kv_heads x head_dim x 2 bytes x 2 (K and V) / median; copy = that over a 4 GiB device-to-device copy's read + write rate;");
        outln!("enqueue = host time of one step's checks and launches; err/tol = the sampled sequences' largest error / the accuracy rule's bound (<= 1 passes).");
    }
    write_output(a, &report)?;
    Ok(all_pass)
}

/// Writes `report` as pretty JSON to `--output`, when given.
fn write_output(a: &BenchArgs, report: &Value) -> Result<()> {
    if let Some(path) = &a.output {
        let text = serde_json::to_string_pretty(report)?;
        crate::write_output(path, "the report", |w| {
            w.write_all(text.as_bytes())?;
            w.write_all(b"\n")
        })?;
    }
    Ok(())
}

fn print_header() {
    outln!(
        "{:<3} {:<20} {:<22} {:>6} {:>7} {:>7} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>8} {:>9} {:>5}",
        "id",
        "workload",
        "order",
        "q_len",
        "visible",
        "density",
        "ceiling",
        "median_ms",
        "TFLOP/s",
        "single_ms",
        "overhead",
        "host",
        "enqueue",
        "max_err",
        "check"
    );
}

fn print_row(job: &Job, m: &Measurement) {
    let q_len = job.rows.q_len();
    let vis = m.visible_pairs as f64 / (f64::from(q_len) * f64::from(job.rows.kv_len()));
    let density = m.visible_pairs as f64 / m.computed_pairs.max(1) as f64;
    let timing = match &m.timing {
        Some(t) => format!(
            "{:>9.3} {:>8.1} {:>9.3} {:>7.1}us {:>6.1}us {:>6.1}us",
            t.median_ms,
            t.tflops,
            t.single_call_ms,
            t.host_overhead_us,
            (t.single_call_ms - t.single_call_gpu_ms) * 1e3,
            t.enqueue_us
        ),
        None => format!(
            "{:>9} {:>8} {:>9} {:>9} {:>8} {:>8}",
            "-", "-", "-", "-", "-", "-"
        ),
    };
    outln!(
        "{:<3} {:<20} {:<22} {:>6} {:>7.4} {:>7.3} {:>8.0} {timing} {:>9.2e} {:>5}",
        job.id,
        job.name,
        order_label(job),
        q_len,
        vis,
        density,
        m.density_ceiling_tflops,
        m.check.max_abs_err,
        if m.check.pass() { "PASS" } else { "FAIL" }
    );
    if !m.check.pass() {
        outln!(
            "    check failed: max_err {:.2e} (tolerance {:.2e}), lse_err {:.2e}, nan {}, wrong empty rows {}",
            m.check.max_abs_err, m.check.tolerance, m.check.lse_err, m.check.nan, m.check.empty_rows_wrong
        );
    }
}

fn print_bwd_header(deterministic: bool) {
    outp!(
        "{:<3} {:<20} {:<22} {:>6} {:>7} {:>7} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8}",
        "id",
        "workload",
        "order",
        "q_len",
        "visible",
        "density",
        "ceiling",
        "fwd_ms",
        "bwd_ms",
        "fwdbwd_ms",
        "TFLOP/s",
        "bwd_TF/s"
    );
    if deterministic {
        outp!(" {:>8} {:>8}", "det_ms", "det_TF/s");
    }
    outln!(" {:>8} {:>5}", "err/tol", "check");
}

fn print_bwd_row(job: &Job, m: &BackwardMeasurement, deterministic: bool) {
    let f = &m.forward;
    let q_len = job.rows.q_len();
    let vis = f.visible_pairs as f64 / (f64::from(q_len) * f64::from(job.rows.kv_len()));
    let density = f.visible_pairs as f64 / f.computed_pairs.max(1) as f64;
    let timing = match (&f.timing, &m.timing) {
        (Some(ft), Some(t)) => {
            let mut s = format!(
                "{:>8.3} {:>8.3} {:>9.3} {:>8.1} {:>8.1}",
                ft.median_ms, t.bwd_ms, t.fwd_bwd_ms, t.fwd_bwd_tflops, t.bwd_tflops
            );
            if let Some((ms, tf)) = t.deterministic_bwd {
                s += &format!(" {ms:>8.3} {tf:>8.1}");
            }
            s
        }
        _ => {
            let n = if deterministic { 7 } else { 5 };
            vec![format!("{:>8}", "-"); n].join(" ")
        }
    };
    // The worst error / tolerance over the forward output and every checked gradient.
    let mut ratio = f.check.max_abs_err / f.check.tolerance;
    for c in &m.checks {
        for t in [c.grads.dq, c.grads.dk, c.grads.dv] {
            ratio = ratio.max(t.max_err / t.tolerance());
        }
    }
    outln!(
        "{:<3} {:<20} {:<22} {:>6} {:>7.4} {:>7.3} {:>8.0} {timing} {ratio:>8.3} {:>5}",
        job.id,
        job.name,
        order_label(job),
        q_len,
        vis,
        density,
        f.density_ceiling_tflops,
        if m.pass() { "PASS" } else { "FAIL" }
    );
    if !f.check.pass() {
        outln!(
            "    forward check failed: max_err {:.2e} (tolerance {:.2e}), lse_err {:.2e}, nan {}, wrong empty rows {}",
            f.check.max_abs_err, f.check.tolerance, f.check.lse_err, f.check.nan, f.check.empty_rows_wrong
        );
    }
    for c in m.checks.iter().filter(|c| !c.pass()) {
        outln!(
            "    {} backward check failed: {}, nan {}, nonzero rows that must be 0: {}",
            if c.deterministic {
                "deterministic"
            } else {
                "fast"
            },
            c.grads.describe(),
            c.nan,
            c.grads.zero_rows_wrong()
        );
    }
}

/// `raster`, or `auto` with the chosen patch (frames, rows, columns) and traversal.
fn order_label(job: &Job) -> String {
    match (&job.ordered, job.order) {
        (Some(o), _) => format!("auto {}", describe_order(&o.order)),
        (None, OrderArg::Auto) => "auto (raster kept)".to_string(),
        (None, OrderArg::Raster) => "raster".to_string(),
    }
}

fn describe_order(o: &TokenOrder) -> String {
    match (o.patch, o.traversal) {
        (Some([t, y, x]), Some(tr)) => format!("{t}x{y}x{x} {}", traversal_name(tr)),
        _ => "explicit".to_string(),
    }
}

fn traversal_name(t: Traversal) -> &'static str {
    match t {
        Traversal::RowMajor => "rowmajor",
        Traversal::Boustrophedon => "boustro",
        Traversal::Hilbert => "hilbert",
    }
}

fn order_json(job: &Job) -> Value {
    match &job.ordered {
        Some(o) => json!({
            "request": job.order.name(),
            "patch": o.order.patch,
            "traversal": o.order.traversal,
            "identity": o.order.order.iter().enumerate().all(|(i, &p)| i as u32 == p),
        }),
        None => json!({ "request": job.order.name() }),
    }
}

/// A measurement's JSON with the job's fields (workload, order, lengths, plan time) added.
fn with_job(job: &Job, mut v: Value) -> Value {
    let (q_len, kv_len) = (job.rows.q_len(), job.rows.kv_len());
    v["id"] = json!(job.id);
    v["workload"] = json!(job.name);
    v["order"] = order_json(job);
    v["nominal_size"] = json!(job.nominal);
    v["q_len"] = json!(q_len);
    v["kv_len"] = json!(kv_len);
    v["visible_fraction"] =
        json!(v["visible_pairs"].as_f64().unwrap_or(0.0) / (f64::from(q_len) * f64::from(kv_len)));
    v["plan_ms"] = json!(job.plan_ms);
    v
}

/// The permutation property on the GPU for one order: the forward on raster tensors with the
/// raster plan against the forward on permuted tensors with the ordered plan, un-permuted,
/// over the whole output and lse of every head.
#[derive(Clone, Debug)]
struct Equivalence {
    /// Whether the order is the identity (then the check is trivially bitwise).
    identity: bool,
    /// Largest |ordered - raster| over every output element.
    max_abs_diff: f64,
    /// Largest |ordered - raster| / max(1, |ordered|, |raster|): the difference in units
    /// that do not shrink below magnitude 1 (the one the tolerance bounds).
    max_scaled_diff: f64,
    /// Fraction of output elements with identical bits.
    identical: f64,
    /// Largest |lse ordered - lse raster| (equal infinities count as 0).
    lse_diff: f64,
    /// NaN values in both outputs and lses.
    nan: usize,
    /// The bound on `max_scaled_diff`.
    tolerance: f64,
}

/// Bound on the scaled output difference between two orders: 2^-7 for bf16, 2^-10 for fp16
/// (two units in the last place at magnitudes 0.5..1, one at 1..2). The orders differ only
/// in the kernel's accumulation order and in the running maximum that the probabilities
/// are rounded against, as two correct kernels would; the first GPU run saw differences of
/// exactly one unit in the last place at magnitudes 0.5..1.
fn order_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::Bf16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
    }
}

/// Lse differences accepted between orders (the reference check's bound).
const LSE_TOLERANCE: f64 = 1e-3;

impl Equivalence {
    fn pass(&self) -> bool {
        self.nan == 0 && self.max_scaled_diff <= self.tolerance && self.lse_diff <= LSE_TOLERANCE
    }

    fn describe(&self) -> String {
        format!(
            "order check{}: max |ordered - raster| {:.2e}, scaled by max(1, |value|) {:.2e} (tolerance {:.2e}), {:.1}% of elements bitwise equal, lse {:.2e}, nan {}: {}",
            if self.identity { " (identity order)" } else { "" },
            self.max_abs_diff,
            self.max_scaled_diff,
            self.tolerance,
            self.identical * 100.0,
            self.lse_diff,
            self.nan,
            if self.pass() { "PASS" } else { "FAIL" }
        )
    }

    fn to_json(&self) -> Value {
        json!({
            "identity": self.identity,
            "max_abs_diff": self.max_abs_diff,
            "max_scaled_diff": self.max_scaled_diff,
            "identical_fraction": self.identical,
            "lse_diff": self.lse_diff,
            "nan": self.nan,
            "tolerance": self.tolerance,
            "lse_tolerance": LSE_TOLERANCE,
            "pass": self.pass(),
        })
    }
}

/// `[heads, len, d]` rows gathered into token order: row `i` of the result is row
/// `order[i]` of `x`.
fn permute_rows_of(x: &[u16], heads: usize, d: usize, order: &[u32]) -> Vec<u16> {
    let len = order.len();
    let mut out = Vec::with_capacity(x.len());
    for h in 0..heads {
        for &o in order {
            let at = (h * len + o as usize) * d;
            out.extend_from_slice(&x[at..at + d]);
        }
    }
    out
}

/// Runs the property check of one order (`permuted` is `raster` in `order`) on fresh random
/// tensors of the bench's shapes.
fn equivalence(
    rt: &Runtime,
    opts: BenchOptions,
    raster: &RowIntervals,
    permuted: &RowIntervals,
    order: &TokenOrder,
) -> Result<Equivalence> {
    let s = raster.q_len() as usize;
    if raster.kv_len() as usize != s
        || (permuted.q_len(), permuted.kv_len()) != (raster.q_len(), raster.kv_len())
        || order.order.len() != s
    {
        bail!(
            "order check: the raster mask ({} x {}), the ordered mask ({} x {}) and the order ({} tokens) must agree in length",
            raster.q_len(),
            raster.kv_len(),
            permuted.q_len(),
            permuted.kv_len(),
            order.order.len()
        );
    }
    let stream = rt.context().default_stream();
    let drv = |what| move |e| cm_cuda::Error::driver(what, e);
    let (h, hkv, d, dt) = (opts.heads, opts.kv_heads, opts.head_dim, opts.dtype);
    let seed = opts.seed ^ 0x0bde_7000 ^ (s as u64).rotate_left(17);
    let q = random_bits(dt, h * s * d, seed ^ 1);
    let k = random_bits(dt, hkv * s * d, seed ^ 2);
    let v = random_bits(dt, hkv * s * d, seed ^ 3);
    let q_layout = TensorLayout::contiguous([1, h, s, d]);
    let kv_layout = TensorLayout::contiguous([1, hkv, s, d]);
    let run =
        |rows: &RowIntervals, q: &[u16], k: &[u16], v: &[u16]| -> Result<(Vec<u16>, Vec<f32>)> {
            let plan = rt.upload_plan(rows, &stream)?;
            let dq = stream.clone_htod(q).map_err(drv("order check: upload"))?;
            let dk = stream.clone_htod(k).map_err(drv("order check: upload"))?;
            let dv = stream.clone_htod(v).map_err(drv("order check: upload"))?;
            let mut out = stream
                .alloc_zeros::<u16>(h * s * d)
                .map_err(drv("order check: output allocation"))?;
            let mut lse = stream
                .alloc_zeros::<f32>(h * s)
                .map_err(drv("order check: lse allocation"))?;
            rt.forward(
                &stream,
                &plan,
                Forward {
                    dtype: dt,
                    q: (&dq, q_layout),
                    k: (&dk, kv_layout),
                    v: (&dv, kv_layout),
                    out: (&mut out, q_layout),
                    lse: Some((&mut lse, LseLayout::contiguous([1, h, s]))),
                    softmax_scale: 1.0 / (d as f32).sqrt(),
                    score: cm_cuda::Score::NONE,
                },
            )?;
            let out = stream
                .clone_dtoh(&out)
                .map_err(drv("order check: output download"))?;
            let lse = stream
                .clone_dtoh(&lse)
                .map_err(drv("order check: lse download"))?;
            Ok((out, lse))
        };
    let (out_r, lse_r) = run(raster, &q, &k, &v)?;
    let o = &order.order;
    let (out_p, lse_p) = run(
        permuted,
        &permute_rows_of(&q, h, d, o),
        &permute_rows_of(&k, hkv, d, o),
        &permute_rows_of(&v, hkv, d, o),
    )?;
    let mut e = Equivalence {
        identity: o.iter().enumerate().all(|(i, &p)| i as u32 == p),
        max_abs_diff: 0.0,
        max_scaled_diff: 0.0,
        identical: 0.0,
        lse_diff: 0.0,
        nan: 0,
        tolerance: order_tolerance(dt),
    };
    let mut same = 0usize;
    for hh in 0..h {
        for (i, &p) in o.iter().enumerate() {
            let a = (hh * s + i) * d;
            let b = (hh * s + p as usize) * d;
            for (&x, &y) in out_p[a..a + d].iter().zip(&out_r[b..b + d]) {
                let (xv, yv) = (from_bits(dt, x), from_bits(dt, y));
                e.nan += usize::from(xv.is_nan()) + usize::from(yv.is_nan());
                same += usize::from(x == y);
                let diff = (xv - yv).abs();
                e.max_abs_diff = e.max_abs_diff.max(diff);
                e.max_scaled_diff = e
                    .max_scaled_diff
                    .max(diff / xv.abs().max(yv.abs()).max(1.0));
            }
            let (x, y) = (lse_p[hh * s + i], lse_r[hh * s + p as usize]);
            e.nan += usize::from(x.is_nan()) + usize::from(y.is_nan());
            if x != y {
                e.lse_diff = e.lse_diff.max(f64::from((x - y).abs()));
            }
        }
    }
    // NaN compares false in `max`, and is counted above.
    e.identical = same as f64 / (h * s * d).max(1) as f64;
    Ok(e)
}

/// One case of `--order-check`: a built-in mask, its parameters, and the order to test
/// (`None`: the compiler's choice for the kernel tile; else a patch and traversal).
struct OrderCase {
    mask: &'static str,
    q_len: u32,
    params: &'static [(&'static str, i64)],
    patch: Option<([u32; 3], Traversal)>,
}

const ORDER_CASES: &[OrderCase] = &[
    // The brief's small CLEAR grid: 17 text tokens, a 20 x 20 image, radius 5.
    OrderCase {
        mask: "clear",
        q_len: 17 + 20 * 20,
        params: &[("text", 17), ("radius", 5)],
        patch: None,
    },
    OrderCase {
        mask: "clear",
        q_len: 17 + 20 * 20,
        params: &[("text", 17), ("radius", 5)],
        patch: Some(([1, 4, 4], Traversal::Hilbert)),
    },
    OrderCase {
        mask: "clear",
        q_len: 17 + 20 * 20,
        params: &[("text", 17), ("radius", 5)],
        patch: Some(([1, 8, 3], Traversal::Boustrophedon)),
    },
    // A ragged grid (patches cut at the edges) with a text prefix that is not a tile multiple.
    OrderCase {
        mask: "clear",
        q_len: 100 + 45 * 45,
        params: &[("text", 100), ("radius", 9)],
        patch: None,
    },
    // The video case of issue 6: 16 x 32 x 32, |dt| <= 2, |dy|, |dx| <= 8.
    OrderCase {
        mask: "neighborhood_3d",
        q_len: 16 * 32 * 32,
        params: &[],
        patch: None,
    },
    OrderCase {
        mask: "neighborhood_3d",
        q_len: 5 * 7 * 9,
        params: &[
            ("frames", 5),
            ("height", 7),
            ("width", 9),
            ("dt_radius", 1),
            ("radius", 2),
        ],
        patch: Some(([2, 4, 4], Traversal::Hilbert)),
    },
];

/// An [`OrderCase`] planned at the kernel's tile shape.
struct PlannedCase {
    case: &'static OrderCase,
    raster: RowIntervals,
    permuted: RowIntervals,
    order: TokenOrder,
    visible_pairs: u64,
    raster_pairs: u64,
    ordered_pairs: u64,
}

fn plan_order_case(c: &'static OrderCase, tile: (u32, u32)) -> Result<PlannedCase> {
    let program = compilemask::builtin(c.mask).map_err(|e| anyhow!("{}", e.rendered))?;
    let mut base = PlanOptions::new(i64::from(c.q_len)).tile(tile.0, tile.1);
    for &(name, v) in c.params {
        base = base.param(name, Param::Int(v));
    }
    let fail = |e: compilemask::PlanError| {
        anyhow!(
            "order check, {} at q_len {}: {}",
            c.mask,
            c.q_len,
            program.render_error(&e).trim_end()
        )
    };
    let raster = program.plan(&base).map_err(fail)?;
    let mut ordered = base.clone();
    ordered.order = match c.patch {
        None => OrderRequest::Auto,
        Some((patch, traversal)) => OrderRequest::Explicit(
            program
                .grid_order(&base, patch, traversal)
                .map_err(fail)?
                .order,
        ),
    };
    let plan = program.plan(&ordered).map_err(fail)?;
    if raster.masks.len() != 1 || plan.masks.len() != 1 {
        bail!(
            "order check, {}: the mask differs per batch or head",
            c.mask
        );
    }
    let order = match (&plan.order, c.patch) {
        (Some(o), None) => o.clone(),
        // An explicit order comes back without its patch; keep the description.
        (Some(o), Some((patch, traversal))) => TokenOrder {
            patch: Some(patch),
            traversal: Some(traversal),
            ..o.clone()
        },
        (None, _) => TokenOrder::identity(c.q_len),
    };
    Ok(PlannedCase {
        case: c,
        raster: raster.mask(0, 0).rows.clone(),
        permuted: plan.mask(0, 0).rows.clone(),
        order,
        visible_pairs: raster.visible_pairs(),
        raster_pairs: plan.raster_computed_pairs,
        ordered_pairs: plan.masks[0].tiles.computed_pairs,
    })
}

fn run_order_check(a: &BenchArgs, opts: BenchOptions, kernel: KernelKind) -> Result<bool> {
    let tile = kernel_tile(kernel, &opts)?;
    // Plan every case before touching the GPU.
    let planned = ORDER_CASES
        .iter()
        .map(|c| plan_order_case(c, tile))
        .collect::<Result<Vec<_>>>()?;
    let mut rt = Runtime::new_on_device(0)?;
    rt.set_forward_kernel(kernel)?;
    let device = rt.context().name()?;
    if !a.json {
        outln!(
            "compilemask bench --order-check on {device}: {} H={} H_kv={} head_dim={} {}, tile {}x{}",
            kernel.name(),
            opts.heads,
            opts.kv_heads,
            opts.head_dim,
            opts.dtype,
            tile.0,
            tile.1
        );
    }
    let mut all_pass = true;
    let mut results = Vec::new();
    for p in &planned {
        let (c, order) = (p.case, &p.order);
        let e = equivalence(&rt, opts, &p.raster, &p.permuted, order)?;
        all_pass &= e.pass();
        let params: Vec<String> = c.params.iter().map(|(n, v)| format!("{n}={v}")).collect();
        let label = format!(
            "{} q_len {} {} order {}{}",
            c.mask,
            c.q_len,
            if params.is_empty() {
                "(defaults)".to_string()
            } else {
                params.join(",")
            },
            if c.patch.is_some() { "" } else { "auto " },
            describe_order(order)
        );
        if !a.json {
            outln!(
                "{label}: density {:.3} -> {:.3}\n    {}",
                p.visible_pairs as f64 / p.raster_pairs.max(1) as f64,
                p.visible_pairs as f64 / p.ordered_pairs.max(1) as f64,
                e.describe()
            );
        }
        results.push(json!({
            "mask": c.mask,
            "q_len": c.q_len,
            "params": c.params.iter().map(|(n, v)| (n.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "order": if c.patch.is_some() { "explicit" } else { "auto" },
            "patch": order.patch,
            "traversal": order.traversal,
            "visible_pairs": p.visible_pairs,
            "computed_pairs_raster": p.raster_pairs,
            "computed_pairs_ordered": p.ordered_pairs,
            "check": e.to_json(),
        }));
    }
    let report = json!({
        "device": device,
        "kernel": kernel.name(),
        "heads": opts.heads,
        "kv_heads": opts.kv_heads,
        "head_dim": opts.head_dim,
        "dtype": opts.dtype.name(),
        "tile": [tile.0, tile.1],
        "pass": all_pass,
        "order_check": results,
    });
    if a.json {
        outln!("{report}");
    }
    write_output(a, &report)?;
    Ok(all_pass)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A built-in with strided runs reaches the kernels as plain intervals, or as CM0412.
    #[test]
    fn strided_masks_reach_the_kernels_as_plain_intervals() {
        let program = compilemask::builtin("dilated_window").unwrap();
        let plan = program.plan(&PlanOptions::new(8192)).unwrap();
        let strided = &plan.mask(0, 0).rows;
        let rows = unit_rows(strided, "dilated_window", 8192).unwrap();
        assert!(strided.has_strides() && !rows.has_strides());
        assert_eq!(rows.visible_pairs(), strided.visible_pairs());
        assert_eq!(rows.row(8191), &*strided.row_expanded(8191));
        let big = program.plan(&PlanOptions::new(131072)).unwrap();
        let e = unit_rows(&big.mask(0, 0).rows, "dilated_window", 131072)
            .unwrap_err()
            .to_string();
        assert!(e.contains("CM0412"), "{e}");
    }

    #[test]
    fn clear_lengths_follow_workloads_md() {
        assert_eq!(length_for("clear", 8192), 8612);
        assert_eq!(length_for("clear", 32768), 32912);
        assert_eq!(length_for("clear", 1000), 512 + 22 * 22);
        assert_eq!(length_for("clear", 1), 513);
        assert_eq!(length_for("causal", 8192), 8192);
    }

    /// The property the GPU check tests, on the float64 reference: the permuted plan on
    /// tensors permuted by `permute_rows_of`, read back through the order, is the raster
    /// answer (so a GPU failure is the kernel's, not this file's indexing).
    #[test]
    fn permuted_plan_on_permuted_tensors_equals_raster() {
        use cm_bench::reference::{compute, Inputs, Shape};
        for c in ORDER_CASES.iter().filter(|c| c.q_len < 5000) {
            let p = plan_order_case(c, (64, 64)).unwrap();
            let s = c.q_len as usize;
            assert!(p.visible_pairs > 0);
            let identity = p
                .order
                .order
                .iter()
                .enumerate()
                .all(|(i, &o)| i as u32 == o);
            // Explicit patch orders must move tokens, or the check would be vacuous.
            assert!(c.patch.is_none() || !identity, "{} {:?}", c.mask, c.patch);
            let (h, hkv, d) = (2, 1, 8);
            let dt = DType::Bf16;
            let q = random_bits(dt, h * s * d, 1);
            let k = random_bits(dt, hkv * s * d, 2);
            let v = random_bits(dt, hkv * s * d, 3);
            let o = &p.order.order;
            let shape = Shape {
                batch: 1,
                heads: h,
                kv_heads: hkv,
                q_len: s,
                kv_len: s,
                head_dim: d,
                head_dim_v: d,
            };
            let all: Vec<u32> = (0..s as u32).collect();
            let f = |x: &[u16]| x.iter().map(|&b| from_bits(dt, b)).collect::<Vec<f64>>();
            let raster = compute(
                shape,
                &Inputs {
                    q: f(&q),
                    k: f(&k),
                    v: f(&v),
                },
                &p.raster,
                &all,
                0.3,
                dt,
            );
            let permuted = compute(
                shape,
                &Inputs {
                    q: f(&permute_rows_of(&q, h, d, o)),
                    k: f(&permute_rows_of(&k, hkv, d, o)),
                    v: f(&permute_rows_of(&v, hkv, d, o)),
                },
                &p.permuted,
                &all,
                0.3,
                dt,
            );
            let mut worst = 0.0f64;
            for hh in 0..h {
                for (i, &src) in o.iter().enumerate() {
                    let (a, b) = (hh * s + i, hh * s + src as usize);
                    worst = worst.max((permuted.lse[a] - raster.lse[b]).abs());
                    for col in 0..d {
                        let (x, y) = (permuted.out[a * d + col], raster.out[b * d + col]);
                        worst = worst.max((x - y).abs());
                    }
                }
            }
            assert!(worst < 1e-9, "{} {:?}: {worst}", c.mask, c.patch);
            // A wrong un-permutation is caught: reading back without the order differs.
            let naive = (0..h * s * d)
                .map(|i| (permuted.out[i] - raster.out[i]).abs())
                .fold(0.0, f64::max);
            assert!(identity || naive > 1e-3, "{}: {naive}", c.mask);
        }
    }

    #[test]
    fn order_check_cases_plan_and_auto_beats_raster_on_the_video() {
        let video = ORDER_CASES
            .iter()
            .find(|c| c.mask == "neighborhood_3d" && c.patch.is_none())
            .unwrap();
        let p = plan_order_case(video, (64, 64)).unwrap();
        assert!(p.ordered_pairs < p.raster_pairs);
        assert_eq!(p.permuted.q_len(), 16 * 32 * 32);
    }
}
