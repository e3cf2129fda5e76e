//! `cm-bwd-test`: checks the backward kernels (fast mode with atomic dQ, deterministic mode)
//! against the float64 CPU reference on fresh random inputs: every workload of docs/workloads.md
//! at small and odd sizes (W1 causal, W2 HSTU, W3 shared prefix, W4 CLEAR, W5 sliding window,
//! W6 document causal, W7 / W8 on the bundled trace), striped and empty rows, q_len != kv_len,
//! GQA / MQA, head_dim 64 and 128, bf16 and fp16, the FM-01 and GR-01 cases of
//! docs/public-reports.md, and the wide shapes (head_dim 256 / head_dim_v 256 and the MLA
//! head_dim 192 / head_dim_v 128: V, the output, dO and dV at head_dim_v) on every workload
//! and the tile-edge class (`common::wide_cases`); checks that the deterministic mode repeats its bits, then checks and
//! times forward + backward on the eight workloads at 8K and 32K with
//! `cm_bench::measure_backward` (as `compilemask bench --bwd` does). Built on the CPU
//! machine, run on the GPU machine:
//!
//! ```text
//! cm-bwd-test [--seed N] [--json PATH] [--skip-bench] [--bench-only]
//! ```
//! Exit status 0 when every check passes, 1 otherwise.

#[path = "../common/mod.rs"]
mod common;

use cm_bench::grad::{self, check_tensor, GradCheck, Grads, Tensors};
use cm_bench::{nan_bits, BenchInputs, BenchOptions};
use cm_cuda::{Backward, DType, DevicePlan, LseLayout, TensorLayout};
use cm_plan::rows::RowIntervals;
use common::{
    from_mem, masks, random_values, stray_writes, to_mem, Buffers, Case, Expect, Gpu, Mem, Res, Rng,
};
use cudarc::driver::CudaSlice;
use serde_json::{json, Value};
use std::process::ExitCode;

/// Device tensors of one case: the forward's, dO, the gradients and the workspace.
struct Dev {
    fwd: Buffers,
    dout: CudaSlice<u16>,
    dq: CudaSlice<u16>,
    dk: CudaSlice<u16>,
    dv: CudaSlice<u16>,
    workspace: CudaSlice<f32>,
}

impl Dev {
    /// Random Q, K, V and dO for `c` (drawn in that order; dO shaped and laid out as the
    /// output, `head_dim_v` wide), uploaded, with room for the gradients (dQ as Q, dK as K,
    /// dV as V); returns the logical tensors too.
    fn random(gpu: &Gpu, rng: &mut Rng, c: &Case, plan: &DevicePlan) -> Res<(Tensors, Dev)> {
        let (x, fwd) = Buffers::random(gpu, rng, c)?;
        let sh = c.shape();
        let dout = random_values(
            rng,
            c.dtype,
            sh.batch * sh.heads * sh.q_len * sh.head_dim_v,
            false,
        );
        let s = &gpu.stream;
        // Room for either mode: the deterministic one needs more (its dQ turn counters).
        let ws = plan
            .backward_workspace_len(sh.batch, sh.heads, sh.head_dim, true)
            .ok_or("workspace size overflow")?;
        let dev = Dev {
            dout: s.clone_htod(&to_mem(c.dtype, &dout, &fwd.out_layout, fwd.out_len_mem))?,
            dq: s.alloc_zeros(fwd.q_len_mem.max(1))?,
            dk: s.alloc_zeros(fwd.kv_len_mem.max(1))?,
            dv: s.alloc_zeros(fwd.v_len_mem.max(1))?,
            workspace: s.alloc_zeros(ws.max(1))?,
            fwd,
        };
        let x = Tensors {
            q: x.q,
            k: x.k,
            v: x.v,
            dout,
        };
        Ok((x, dev))
    }

    fn backward(&mut self, gpu: &Gpu, plan: &DevicePlan, c: &Case, deterministic: bool) -> Res<()> {
        let f = &self.fwd;
        let lse = f
            .lse
            .as_ref()
            .ok_or("the backward needs the forward's lse")?;
        gpu.rt.backward(
            &gpu.stream,
            plan,
            Backward {
                dtype: c.dtype,
                q: (&f.q, f.q_layout),
                k: (&f.k, f.kv_layout),
                v: (&f.v, f.v_layout),
                out: (&f.out, f.out_layout),
                dout: (&self.dout, f.out_layout),
                lse: (lse, f.lse_layout()),
                dlse: None,
                dq: (&mut self.dq, f.q_layout),
                dk: (&mut self.dk, f.kv_layout),
                dv: (&mut self.dv, f.v_layout),
                workspace: &mut self.workspace,
                softmax_scale: c.softmax_scale,
                deterministic,
                dist_bias_grad: None,
                score: cm_cuda::Score::NONE,
            },
        )?;
        Ok(())
    }

    /// Fills the gradients with NaN so that an element the kernels leave unwritten shows.
    fn poison(&mut self, gpu: &Gpu, dtype: DType) -> Res<()> {
        let s = &gpu.stream;
        for buf in [&mut self.dq, &mut self.dk, &mut self.dv] {
            let n = buf.len();
            s.memcpy_htod(&vec![nan_bits(dtype); n], buf)?;
        }
        Ok(())
    }

    /// The gradients' memory images.
    fn download(&self, gpu: &Gpu) -> Res<[Vec<u16>; 3]> {
        let s = &gpu.stream;
        s.synchronize()?;
        Ok([
            s.clone_dtoh(&self.dq)?,
            s.clone_dtoh(&self.dk)?,
            s.clone_dtoh(&self.dv)?,
        ])
    }
}

fn check_grads(c: &Case, got: &Grads, r: &grad::Reference) -> GradCheck {
    let sh = c.shape();
    let (d, dvw) = (sh.head_dim, sh.head_dim_v);
    let mut seen = vec![false; sh.kv_len];
    for q in 0..c.mask.q_len() {
        for iv in c.mask.row(q) {
            seen[iv.start as usize..iv.end as usize].fill(true);
        }
    }
    let empty_row = |r: usize| c.mask.row((r % sh.q_len) as u32).is_empty();
    let unseen_key = |r: usize| !seen[r % sh.kv_len];
    GradCheck {
        dq: check_tensor(&got.dq, &r.exact.dq, &r.emulated.dq, d, empty_row),
        dk: check_tensor(&got.dk, &r.exact.dk, &r.emulated.dk, d, unseen_key),
        dv: check_tensor(&got.dv, &r.exact.dv, &r.emulated.dv, dvw, unseen_key),
    }
}

/// The float64 reference of this binary against `cm_reference::attention_backward`.
fn cross_check(c: &Case, x: &Tensors, r: &grad::Reference) -> Res<f64> {
    let sh = c.shape();
    let g = cm_reference::attention_backward::<f64>(
        &common::attention_shape(sh),
        &x.q,
        &x.k,
        &x.v,
        &x.dout,
        &cm_reference::Masks::shared(&c.mask),
        f64::from(c.softmax_scale),
    )?;
    let diff = common::max_abs_diff;
    Ok(diff(&g.dq, &r.exact.dq)
        .max(diff(&g.dk, &r.exact.dk))
        .max(diff(&g.dv, &r.exact.dv)))
}

fn run_case(gpu: &Gpu, rng: &mut Rng, c: &Case) -> Res<Value> {
    let sh = c.shape();
    let plan = gpu.rt.upload_plan(&c.mask, &gpu.stream)?;
    let (x, mut dev) = Dev::random(gpu, rng, c, &plan)?;
    dev.fwd.forward(gpu, &plan, c)?;
    let reference = grad::compute(sh, &x, &c.mask, f64::from(c.softmax_scale), c.dtype);
    let cross = if sh.q_len <= 300 && sh.kv_len <= 800 {
        Some(cross_check(c, &x, &reference)?)
    } else {
        None
    };
    let (q_layout, kv_layout, v_layout) = (dev.fwd.q_layout, dev.fwd.kv_layout, dev.fwd.v_layout);
    let logical = |mem: &[Vec<u16>; 3]| Grads {
        dq: from_mem(c.dtype, &mem[0], &q_layout),
        dk: from_mem(c.dtype, &mem[1], &kv_layout),
        dv: from_mem(c.dtype, &mem[2], &v_layout),
    };
    let mut modes = Vec::new();
    let mut first_det: Option<[Vec<u16>; 3]> = None;
    let mut repeat_identical = true;
    let mut pass = cross.is_none_or(|d| d < 1e-9);
    for (mode, deterministic) in [
        ("fast", false),
        ("deterministic", true),
        ("deterministic", true),
    ] {
        dev.poison(gpu, c.dtype)?;
        dev.backward(gpu, &plan, c, deterministic)?;
        let mem = dev.download(gpu)?;
        let chk = check_grads(c, &logical(&mem), &reference);
        // Memory outside the gradients' views (padded layouts) must keep its NaN fill.
        let stray = stray_writes(c.dtype, &q_layout, &mem[0])
            + stray_writes(c.dtype, &kv_layout, &mem[1])
            + stray_writes(c.dtype, &v_layout, &mem[2]);
        let ok = chk.pass() && stray == 0;
        pass &= ok;
        println!(
            "{} bwd {:<13} {:<46} {} nan {} zero-rows-wrong {} stray {stray}{}",
            if ok { "PASS" } else { "FAIL" },
            mode,
            c.name,
            chk.describe(),
            chk.nan(),
            chk.zero_rows_wrong(),
            cross.map_or(String::new(), |d| format!(" cm-reference diff {d:.1e}"))
        );
        let mut v = chk.json();
        v["mode"] = json!(mode);
        v["stray_writes"] = json!(stray);
        v["pass"] = json!(ok);
        modes.push(v);
        if deterministic {
            match &first_det {
                None => first_det = Some(mem),
                Some(first) => repeat_identical = *first == mem,
            }
        }
    }
    println!(
        "{} bwd deterministic repeat {:<33} {}",
        if repeat_identical { "PASS" } else { "FAIL" },
        c.name,
        if repeat_identical {
            "bitwise identical"
        } else {
            "bits differ"
        }
    );
    pass &= repeat_identical;
    Ok(c.json(json!({
        "modes": modes, "deterministic_repeat_identical": repeat_identical,
        "cm_reference_diff": cross, "pass": pass,
    })))
}

/// Rows of the reduced GR-01 mask (docs/public-reports.md): segment length t = 16, chunk w = 4,
/// floor semantics; with `offset` = 0 the rows with `r mod w == 0` of segment 2 are empty.
fn gr01(offset: i64) -> RowIntervals {
    let (t, w) = (16i64, 4i64);
    let rows: Vec<Vec<(u32, u32)>> = (0..2 * t)
        .map(|q| {
            let keys: Vec<i64> = (0..2 * t)
                .filter(|&k| {
                    if q < t {
                        k < t && k < q + w
                    } else {
                        let r = q - t;
                        // Literal comparisons: with offset = w no position is excluded.
                        if r.rem_euclid(w) == offset {
                            return false;
                        }
                        let chunk = (r - offset).div_euclid(w);
                        if k < t {
                            k <= chunk * w + offset
                        } else {
                            let rk = k - t;
                            rk.rem_euclid(w) != offset && (rk - offset).div_euclid(w) == chunk
                        }
                    }
                })
                .collect();
            runs(&keys)
        })
        .collect();
    RowIntervals::from_rows(2 * t as u32, &rows).expect("GR-01 rows are canonical")
}

/// Maximal runs of sorted keys as half-open intervals.
fn runs(keys: &[i64]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &k in keys {
        match out.last_mut() {
            Some(last) if last.1 == k as u32 => last.1 += 1,
            _ => out.push((k as u32, k as u32 + 1)),
        }
    }
    out
}

/// FM-01: q_len 6, kv_len 10; rows 0-4 causal (top-left), row 5 empty; keys 5-9 unseen.
fn fm01() -> RowIntervals {
    let rows: Vec<Vec<(u32, u32)>> = (0..6u32)
        .map(|q| if q < 5 { vec![(0, q + 1)] } else { vec![] })
        .collect();
    RowIntervals::from_rows(10, &rows).expect("FM-01 rows are canonical")
}

fn cases() -> Vec<Case> {
    use DType::{Bf16, F16};
    let mut out = Vec::new();
    for combo in common::COMBOS {
        for len in [1, 17, 1000] {
            out.push(Case::new(
                "causal",
                masks::causal(len, len),
                (2, 4, 2),
                combo,
                Mem::Contiguous,
            ));
        }
    }
    let mut others = masks::shared_cases();
    others.extend([
        ("FM-01", fm01(), (1, 2, 2)),
        ("GR-01 offset4", gr01(4), (1, 1, 1)),
        ("GR-01 offset0", gr01(0), (1, 1, 1)),
    ]);
    out.extend(common::on_two_combos(others));
    let w2 = [700, 300, 1200, 64, 9, 1000, 0, 513];
    for (name, mask, heads, combo, mem) in [
        (
            "hstu",
            masks::hstu(1000, &w2),
            (2, 4, 2),
            (Bf16, 128),
            Mem::SeqMajor,
        ),
        (
            "W8 trace_prompt_groups",
            masks::trace_prompt_groups(1000),
            (1, 4, 2),
            (F16, 64),
            Mem::Padded,
        ),
        (
            "W6 document_causal",
            masks::document_causal(1000, &[300, 1, 0, 450]),
            (2, 4, 2),
            (Bf16, 128),
            Mem::Padded,
        ),
    ] {
        out.push(Case::new(name, mask, heads, combo, mem));
    }
    out.extend(common::edge_cases());
    out
}

/// Bad backward arguments come back as errors naming the problem, never as a launch.
fn validation(gpu: &Gpu) -> Res<Vec<Value>> {
    let mask = masks::causal(100, 100);
    let plan = gpu.rt.upload_plan(&mask, &gpu.stream)?;
    let s = &gpu.stream;
    let l = |h: usize, d: usize| TensorLayout::contiguous([1, h, 100, d]);
    let n = 4 * 100 * 64;
    let (q, k, v, out, dout) = (
        s.alloc_zeros::<u16>(n)?,
        s.alloc_zeros::<u16>(n)?,
        s.alloc_zeros::<u16>(n)?,
        s.alloc_zeros::<u16>(n)?,
        s.alloc_zeros::<u16>(n)?,
    );
    let lse = s.alloc_zeros::<f32>(400)?;
    let (mut dq, mut dk, mut dv) = (
        s.alloc_zeros::<u16>(n)?,
        s.alloc_zeros::<u16>(n)?,
        s.alloc_zeros::<u16>(n)?,
    );
    let full_ws = plan
        .backward_workspace_len(1, 4, 64, false)
        .ok_or("workspace size overflow")?;
    let mut ws = s.alloc_zeros::<f32>(full_ws)?;
    let mut small_ws = s.alloc_zeros::<f32>(full_ws - 1)?;
    let mut e = Expect::new("bwd validation");
    let mut bwd = |dq_layout: TensorLayout, ws: &mut CudaSlice<f32>, det: bool| {
        gpu.rt.backward(
            s,
            &plan,
            Backward {
                dtype: DType::Bf16,
                q: (&q, l(4, 64)),
                k: (&k, l(4, 64)),
                v: (&v, l(4, 64)),
                out: (&out, l(4, 64)),
                dout: (&dout, l(4, 64)),
                lse: (&lse, LseLayout::contiguous([1, 4, 100])),
                dlse: None,
                dq: (&mut dq, dq_layout),
                dk: (&mut dk, l(4, 64)),
                dv: (&mut dv, l(4, 64)),
                workspace: ws,
                softmax_scale: 0.125,
                deterministic: det,
                dist_bias_grad: None,
                score: cm_cuda::Score::NONE,
            },
        )
    };
    e.check(
        "small workspace",
        "the backward needs",
        bwd(l(4, 64), &mut small_ws, false),
    );
    e.check(
        "dq shape",
        "dq: shape [1, 2, 100, 64] differs from q's shape",
        bwd(l(2, 64), &mut ws, true),
    );
    let mut overlapping = l(4, 64);
    overlapping.strides[1] = 0;
    e.check("dq overlap", "overlap", bwd(overlapping, &mut ws, true));
    // A thread with no current CUDA context (as PyTorch's autograd threads can be): the
    // runtime binds its own before encoding the TMA descriptors.
    let on_new_thread = std::thread::scope(|scope| {
        scope
            .spawn(|| bwd(l(4, 64), &mut ws, false))
            .join()
            .expect("the backward thread panicked")
    });
    e.accepts(
        "backward on a thread with no current context",
        on_new_thread,
    );
    Ok(e.results)
}

/// Checks and times forward + backward on one workload (batch 1, H = 16, head_dim 128,
/// bf16) with `cm_bench::measure_backward`: the forward's sampled rows, both backward
/// modes' sampled dQ rows and dK / dV keys against float64 and a NaN scan of every gradient
/// first, then CUDA-event medians.
fn bench(gpu: &Gpu, name: &str, mask: &RowIntervals, seed: u64) -> Res<Value> {
    let opts = BenchOptions {
        runs: 20,
        warmup: 3,
        seed,
        ..BenchOptions::default()
    };
    let mut inputs = BenchInputs::new(&gpu.stream, mask.q_len(), mask.kv_len(), opts)?;
    let m = cm_bench::measure_backward(&gpu.rt, &gpu.stream, &mut inputs, mask, true)?;
    let fwd_ms = m.forward.timing.map_or(f64::NAN, |t| t.median_ms);
    let timing = m.timing.map_or("not timed".to_string(), |t| {
        let (det_ms, det_tf) = t.deterministic_bwd.unwrap_or((f64::NAN, f64::NAN));
        format!(
            "fwd+bwd {:.3} ms = {:.1} TFLOP/s (3.5x fwd FLOPs); fwd {fwd_ms:.3} ms, bwd {:.3} ms ({:.1}, 2.5x), \
             deterministic bwd {det_ms:.3} ms ({det_tf:.1})",
            t.fwd_bwd_ms, t.fwd_bwd_tflops, t.bwd_ms, t.bwd_tflops
        )
    });
    let checks: Vec<String> = m
        .checks
        .iter()
        .map(|c| {
            let mode = if c.deterministic { "det" } else { "fast" };
            format!("{mode} {} nan {}", c.grads.describe(), c.nan)
        })
        .collect();
    println!(
        "{} bench {name:<28} q{} H16 d128 bf16: {timing}; tile density {:.3}; fwd max_err {:.2e} (tol {:.2e}); {}",
        if m.pass() { "PASS" } else { "FAIL" },
        mask.q_len(),
        m.forward.visible_pairs as f64 / m.forward.computed_pairs.max(1) as f64,
        m.forward.check.max_abs_err,
        m.forward.check.tolerance,
        checks.join("; ")
    );
    let mut v = m.json();
    v["workload"] = json!(name);
    v["q_len"] = json!(mask.q_len());
    v["kv_len"] = json!(mask.kv_len());
    v["runs"] = json!(opts.runs);
    Ok(v)
}

fn run(args: &common::Args, report: &mut Value) -> Res<bool> {
    let gpu = Gpu::new(report)?;
    let mut rng = Rng(args.seed);
    let mut all_pass = true;
    if !args.has("--bench-only") {
        let mut results = Vec::new();
        for c in cases().into_iter().chain(common::wide_cases()) {
            results.push(run_case(&gpu, &mut rng, &c).unwrap_or_else(|e| common::failed(&c, e)));
        }
        all_pass &= common::record(report, "cases", results);
        all_pass &= common::record(report, "validation", validation(&gpu)?);
    }
    if !args.has("--skip-bench") {
        let mut b = Vec::new();
        for (name, mask) in [8192, 32768].into_iter().flat_map(masks::workloads) {
            b.push(bench(&gpu, &name, &mask, args.seed)?);
        }
        all_pass &= common::record(report, "bench", b);
    }
    Ok(all_pass)
}

fn main() -> ExitCode {
    match common::parse_args("cm-bwd-test", &["--skip-bench", "--bench-only"]) {
        Ok(args) => common::finish("cm-bwd-test", &args, json!({}), |r| run(&args, r)),
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This binary's float64 backward reference agrees with cm-reference, and the dtype
    /// emulation's error is small but not zero (both run here, without a GPU).
    #[test]
    fn reference_agrees_with_cm_reference() {
        let mut rng = Rng(11);
        for (mask, dtype, heads, (d, dvw)) in [
            (masks::clear(37, 30, 5), DType::Bf16, (2, 4, 2)),
            (gr01(4), DType::F16, (1, 2, 1)),
            (fm01(), DType::Bf16, (1, 2, 2)),
            (masks::causal(300, 200), DType::Bf16, (1, 2, 1)),
        ]
        .into_iter()
        .map(|(mask, dtype, heads)| (mask, dtype, heads, (64, 64)))
        // The MLA shape's widths (V, dO, dV narrower than Q, K), with GQA and an empty row.
        .chain([(fm01(), DType::F16, (1, 4, 2), (192, 128))])
        {
            let c = Case::new("", mask, heads, (dtype, d), Mem::Contiguous).with_head_dim_v(dvw);
            let sh = c.shape();
            let (qn, kn) = (
                sh.batch * sh.heads * sh.q_len,
                sh.batch * sh.kv_heads * sh.kv_len,
            );
            let x = Tensors {
                q: random_values(&mut rng, dtype, qn * d, false),
                k: random_values(&mut rng, dtype, kn * d, false),
                v: random_values(&mut rng, dtype, kn * dvw, false),
                dout: random_values(&mut rng, dtype, qn * dvw, false),
            };
            let r = grad::compute(sh, &x, &c.mask, f64::from(c.softmax_scale), dtype);
            assert!(cross_check(&c, &x, &r).unwrap() < 1e-9);
            let chk = check_grads(&c, &r.emulated, &r);
            for t in [chk.dq, chk.dk, chk.dv] {
                assert!(
                    t.max_err == t.emulated_err && t.max_err > 0.0 && t.max_err < 0.1,
                    "{}",
                    t.max_err
                );
            }
            // A nonzero value in FM-01's empty row 5 (dQ) or unseen key 5 (dV) is caught
            // only when the rows are split at the right width.
            if !(c.mask.row(5).is_empty() && grad::rows_seeing(&c.mask, 5).is_empty()) {
                continue;
            }
            let mut bad = Grads {
                dq: r.emulated.dq.clone(),
                dk: r.emulated.dk.clone(),
                dv: r.emulated.dv.clone(),
            };
            bad.dq[5 * d] = 1.0;
            bad.dv[5 * dvw] = 1.0;
            let chk = check_grads(&c, &bad, &r);
            assert_eq!(
                (chk.dq.zero_rows_wrong, chk.dv.zero_rows_wrong),
                (1, 1),
                "d{d} v{dvw}"
            );
        }
    }

    /// Each wide shape gets every shared workload and the 15 tile-edge masks, meets both
    /// dtypes and all three layouts, and its edge masks both logit extremes.
    #[test]
    fn wide_cases_cover_both_shapes() {
        let cases = common::wide_cases();
        let shared = masks::shared_cases().len();
        assert_eq!(cases.len(), 2 * (shared + 15));
        for (part, (d, dv)) in cases.chunks(shared + 15).zip(cm_kernels::WIDE_SHAPES) {
            let (d, dv) = (d as usize, dv as usize);
            assert!(part.iter().all(|c| (c.head_dim, c.head_dim_v) == (d, dv)));
            for dtype in [DType::Bf16, DType::F16] {
                for mem in [Mem::Contiguous, Mem::Padded, Mem::SeqMajor] {
                    assert!(
                        part.iter()
                            .any(|c| c.dtype == dtype && c.mem.name() == mem.name()),
                        "d{d} v{dv} {} {}",
                        dtype.name(),
                        mem.name()
                    );
                }
            }
            let edges = &part[shared..];
            assert!(part[..shared].iter().all(|c| c.logit_mean == 0.0));
            // Alternating over 15 masks: 7 or 8 of each.
            let low = edges.iter().filter(|c| c.logit_mean == -120.0).count();
            assert!((7..=8).contains(&low), "{low}");
            assert!(edges
                .iter()
                .all(|c| c.logit_mean == -120.0 || c.logit_mean == 60.0));
            let tag = if d == dv {
                format!(" d{d} ")
            } else {
                format!(" d{d}v{dv} ")
            };
            assert!(part.iter().all(|c| c.name.contains(&tag)), "{tag}");
        }
    }

    /// (visible pairs, intervals, sum over rows q and intervals [s, e) of (q + 1) *
    /// (s * 65537 + e) mod 2^64) of a mask.
    fn fingerprint(m: &RowIntervals) -> (u64, u64, u64) {
        let (mut vis, mut n, mut h) = (0u64, 0u64, 0u64);
        for q in 0..m.q_len() {
            for iv in m.row(q) {
                vis += u64::from(iv.end - iv.start);
                n += 1;
                let x = u64::from(iv.start) * 65537 + u64::from(iv.end);
                h = h.wrapping_add((u64::from(q) + 1).wrapping_mul(x));
            }
        }
        (vis, n, h)
    }

    /// The W3, W7 and W8 builders give exactly the compiler's built-ins: the expected values
    /// are the fingerprints of `compilemask intervals --builtin NAME --q-len N --rows 0:N
    /// --json [--set ...]` (the small W3 cases with the parameters of `cases`).
    #[test]
    fn workload_masks_match_the_compiler_builtins() {
        let small = [24, 40, 1, 64, 0, 33, 17, 90, 5, 12, 70, 3];
        let w3 = masks::workloads(32768).swap_remove(2).1;
        for (what, mask, want) in [
            ("W3 32K", w3, (78405632, 49152, 1039478665702477824)),
            (
                "W3 1000",
                masks::shared_prefix(1000, &[200, 96, 7, 150], &small, 8),
                (121146, 1635, 33319541816882),
            ),
            (
                "W3 2049",
                masks::shared_prefix(2049, &[200, 96, 7, 150], &small, 8),
                (267160, 3225, 266646415606959),
            ),
            (
                "W3 cut prompt",
                masks::shared_prefix(777, &[500, 400], &[20, 30], 8),
                (230953, 957, 6938928380405),
            ),
            (
                "W7 1000",
                masks::trace_documents(1000),
                (218339, 1000, 13763870092104),
            ),
            (
                "W7 3001",
                masks::trace_documents(3001),
                (880227, 3001, 499942353614909),
            ),
            (
                "W7 32K",
                masks::trace_documents(32768),
                (33094010, 32768, 727039254500846087),
            ),
            (
                "W8 1000",
                masks::trace_prompt_groups(1000),
                (304841, 1506, 18935963755441),
            ),
            (
                "W8 3001",
                masks::trace_prompt_groups(3001),
                (1165755, 4283, 603228976479806),
            ),
            (
                "W8 32K",
                masks::trace_prompt_groups(32768),
                (24696357, 53377, 1185456087236907604),
            ),
        ] {
            assert_eq!(fingerprint(&mask), want, "{what}");
        }
    }

    /// The public-report masks have the rows the cases describe.
    #[test]
    fn public_report_masks() {
        let g = gr01(4);
        for q in 16..20 {
            assert_eq!(g.row(q), gr01_row(&[(0, 1), (16, 20)]), "row {q}");
        }
        assert_eq!(g.row(20), gr01_row(&[(0, 5), (20, 24)]));
        let g0 = gr01(0);
        for q in [16, 20, 24, 28] {
            assert!(g0.row(q).is_empty(), "row {q}");
        }
        let f = fm01();
        assert!(f.row(5).is_empty());
        assert_eq!(f.row(4), gr01_row(&[(0, 5)]));
    }

    fn gr01_row(runs: &[(u32, u32)]) -> Vec<cm_plan::rows::KeyInterval> {
        runs.iter()
            .map(|&(start, end)| cm_plan::rows::KeyInterval { start, end })
            .collect()
    }
}
