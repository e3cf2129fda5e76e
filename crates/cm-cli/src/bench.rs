//! `compilemask bench`: the forward kernel on the benchmark workloads of workloads.md, by its
//! protocol (batch 1, softmax scale 1/sqrt(head_dim)): correctness on sampled rows against the
//! float64 reference first, then effective TFLOP/s (`4 * heads * head_dim * visible_pairs`
//! over the median of back-to-back calls timed with CUDA events), single-call latency with
//! the host launch included, host overhead, and the tile-density ceiling. Needs the GPU
//! machine and a build with embedded kernels; every argument is checked before the GPU is
//! touched.

use anyhow::{anyhow, bail, Result};
use clap::{Args, ValueEnum};
use cm_cuda::bench::{BenchInputs, BenchOptions, Measurement, MATMUL_PEAK_TFLOPS};
use cm_cuda::{DType, KernelKind, Runtime};
use compilemask::PlanOptions;
use serde_json::{json, Value};

/// The eight workloads of workloads.md: (id, built-in mask).
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

/// Longest sequence accepted: the inputs alone take `6 * heads * head_dim * S` bytes.
const MAX_LEN: u32 = 1 << 20;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Nominal sequence lengths S, comma-separated. CLEAR runs at 512 + n*n tokens with the
    /// grid n of workloads.md (90 for 8192, 180 for 32768; otherwise the nearest grid).
    #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
    sizes: Vec<u32>,
    /// Query heads.
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// Key / value heads (default: --heads); must divide --heads (GQA, MQA).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Elements per head.
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
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
    #[arg(long, value_enum, default_value = "wgmma")]
    kernel: KernelArg,
    /// Back-to-back calls timed per workload (the protocol asks for at least 50).
    #[arg(long, default_value_t = 60)]
    runs: usize,
    /// Seed of the random inputs and sampled rows (default: fixed).
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON to this file.
    #[arg(short, long)]
    output: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DTypeArg {
    Bf16,
    Fp16,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum KernelArg {
    /// `fwd_wgmma`, the Hopper kernel.
    Wgmma,
    /// `fwd_simple`, the mma.sync reference path.
    Simple,
}

/// One workload at one size, planned and ready to run.
struct Job {
    id: &'static str,
    name: String,
    nominal: u32,
    rows: compilemask::RowIntervals,
    plan_ms: f64,
}

/// The sequence length a workload runs at for nominal size `s`.
fn length_for(name: &str, s: u32) -> u32 {
    if name != "clear" {
        return s;
    }
    // workloads.md's CLEAR grids; other sizes take the grid whose length is nearest.
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

fn plan_jobs(a: &BenchArgs) -> Result<Vec<Job>> {
    let mut jobs = Vec::new();
    for &s in &a.sizes {
        for name in &a.workloads {
            let id = WORKLOADS
                .iter()
                .find(|(_, n)| n == name)
                .map_or("-", |(id, _)| id);
            let program = compilemask::builtin(name).map_err(|e| anyhow!("{}", e.rendered))?;
            let q_len = length_for(name, s);
            let t0 = std::time::Instant::now();
            let plan = program
                .plan(&PlanOptions::new(i64::from(q_len)))
                .map_err(|e| {
                    anyhow!(
                        "{name} at q_len {q_len}: {}",
                        program.render_error(&e).trim_end()
                    )
                })?;
            let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
            if plan.masks.len() != 1 {
                bail!("{name} differs per batch or head; bench runs one mask shared by every head");
            }
            jobs.push(Job {
                id,
                name: name.clone(),
                nominal: s,
                rows: plan.mask(0, 0).rows.clone(),
                plan_ms,
            });
        }
    }
    Ok(jobs)
}

fn options(a: &BenchArgs) -> Result<(BenchOptions, KernelKind)> {
    let kv_heads = a.kv_heads.unwrap_or(a.heads);
    if a.heads == 0 || kv_heads == 0 || !a.heads.is_multiple_of(kv_heads) {
        bail!(
            "--heads {} --kv-heads {kv_heads}: both must be positive and --kv-heads must divide --heads",
            a.heads
        );
    }
    if let Some(&s) = a.sizes.iter().find(|&&s| s == 0 || s > MAX_LEN) {
        bail!("--sizes: {s} is out of range; each size must be in 1..={MAX_LEN}");
    }
    if a.sizes.is_empty() || a.workloads.is_empty() {
        bail!("--sizes and --workloads must each name at least one entry");
    }
    if a.runs == 0 {
        bail!("--runs must be at least 1 (the protocol asks for at least 50)");
    }
    let dtype = match a.dtype {
        DTypeArg::Bf16 => DType::Bf16,
        DTypeArg::Fp16 => DType::F16,
    };
    let kernel = match a.kernel {
        KernelArg::Wgmma => KernelKind::FwdWgmma,
        KernelArg::Simple => KernelKind::FwdSimple,
    };
    if cm_kernels::find_variant(kernel, dtype, a.head_dim).is_none() {
        let built: Vec<String> = cm_kernels::VARIANTS
            .iter()
            .filter(|v| v.kernel == kernel && v.dtype == dtype)
            .map(|v| v.head_dim.to_string())
            .collect();
        bail!(
            "--head-dim {} is not built for {} {dtype}; built head dims: {}",
            a.head_dim,
            kernel.name(),
            built.join(", ")
        );
    }
    let opts = BenchOptions {
        heads: a.heads,
        kv_heads,
        head_dim: a.head_dim as usize,
        dtype,
        runs: a.runs,
        seed: a.seed,
        ..BenchOptions::default()
    };
    Ok((opts, kernel))
}

/// Runs the benchmark; `Ok(false)` when a correctness check failed.
pub fn run(a: &BenchArgs) -> Result<bool> {
    let (opts, kernel) = options(a)?;
    let jobs = plan_jobs(a)?;
    let mut rt = Runtime::new_on_device(0)?;
    rt.set_forward_kernel(kernel)?;
    // The legacy default stream: with one stream, cudarc adds no event bookkeeping to the
    // launch path.
    let stream = rt.context().default_stream();
    let device = rt.context().name()?;
    if !a.json {
        println!(
            "compilemask bench on {device}: {} H={} H_kv={} head_dim={} {}, median of {} back-to-back calls",
            kernel.name(),
            opts.heads,
            opts.kv_heads,
            opts.head_dim,
            opts.dtype,
            opts.runs
        );
        print_header();
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
        let m = cm_cuda::bench::measure(&rt, &stream, &mut cache[at], &job.rows)?;
        all_pass &= m.check.pass();
        if !a.json {
            print_row(job, &m);
        }
        results.push(result_json(job, &m));
    }
    let report = json!({
        "device": device,
        "kernel": kernel.name(),
        "heads": opts.heads,
        "kv_heads": opts.kv_heads,
        "head_dim": opts.head_dim,
        "dtype": opts.dtype.name(),
        "runs": opts.runs,
        "seed": opts.seed,
        "matmul_peak_tflops": MATMUL_PEAK_TFLOPS,
        "pass": all_pass,
        "results": results,
    });
    if a.json {
        println!("{report}");
    } else {
        println!(
            "\nvisible = visible pairs / (q_len * kv_len); ceiling = visible / computed pairs at the kernel tile x {MATMUL_PEAK_TFLOPS} TFLOP/s;"
        );
        println!("single = one call, host enqueue to host-visible completion; overhead = single - median; host = single - the GPU time");
        println!("of that call between events recorded around it (the rest of the overhead is the GPU's); enqueue = host time of the call.");
    }
    if let Some(path) = &a.output {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).map_err(|e| anyhow!("cannot write `{path}`: {e}"))?;
    }
    Ok(all_pass)
}

fn print_header() {
    println!(
        "{:<3} {:<20} {:>6} {:>7} {:>7} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>8} {:>9} {:>5}",
        "id",
        "workload",
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
    println!(
        "{:<3} {:<20} {:>6} {:>7.4} {:>7.3} {:>8.0} {timing} {:>9.2e} {:>5}",
        job.id,
        job.name,
        q_len,
        vis,
        density,
        m.density_ceiling_tflops,
        m.check.max_abs_err,
        if m.check.pass() { "PASS" } else { "FAIL" }
    );
    if !m.check.pass() {
        println!(
            "    check failed: max_err {:.2e} (tolerance {:.2e}), lse_err {:.2e}, nan {}, wrong empty rows {}",
            m.check.max_abs_err, m.check.tolerance, m.check.lse_err, m.check.nan, m.check.empty_rows_wrong
        );
    }
}

fn result_json(job: &Job, m: &Measurement) -> Value {
    let c = &m.check;
    let mut v = json!({
        "id": job.id,
        "workload": job.name,
        "nominal_size": job.nominal,
        "q_len": job.rows.q_len(),
        "kv_len": job.rows.kv_len(),
        "visible_pairs": m.visible_pairs,
        "visible_fraction": m.visible_pairs as f64 / (f64::from(job.rows.q_len()) * f64::from(job.rows.kv_len())),
        "tile": [m.tile.0, m.tile.1],
        "computed_pairs": m.computed_pairs,
        "tiles_full": m.tiles_full,
        "tiles_partial": m.tiles_partial,
        "tile_density": m.visible_pairs as f64 / m.computed_pairs.max(1) as f64,
        "density_ceiling_tflops": m.density_ceiling_tflops,
        "plan_ms": job.plan_ms,
        "plan_upload_ms": m.plan_upload_ms,
        "check": {
            "rows": c.rows, "heads": c.heads, "max_abs_err": c.max_abs_err,
            "emulated_err": c.emulated_err, "tolerance": c.tolerance, "lse_err": c.lse_err,
            "nan": c.nan, "empty_rows_wrong": c.empty_rows_wrong, "pass": c.pass(),
        },
        "pass": c.pass(),
    });
    if let Some(t) = &m.timing {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clear_lengths_follow_workloads_md() {
        assert_eq!(length_for("clear", 8192), 8612);
        assert_eq!(length_for("clear", 32768), 32912);
        assert_eq!(length_for("clear", 1000), 512 + 22 * 22);
        assert_eq!(length_for("clear", 1), 513);
        assert_eq!(length_for("causal", 8192), 8192);
    }
}
