//! `cm-gpu-test`: checks the forward kernel against the float64 CPU reference on fresh random
//! inputs (odd lengths, q_len != kv_len, GQA / MQA, head_dim 64 and 128, bf16 and fp16, empty
//! rows, strided layouts, argument validation, CUDA graph capture), then times it with CUDA
//! events. Built on the CPU machine, run on the GPU machine:
//!
//! ```text
//! cm-gpu-test [--seed N] [--json PATH] [--skip-bench] [--kernels]
//! ```
//! `--kernels` prints the embedded kernels' ptxas facts and exits (needs no GPU). Exit status
//! 0 when every check passes, 1 otherwise.

#[path = "../common/mod.rs"]
mod common;

use cm_bench::reference::{self, Expected, Inputs, Shape};
use cm_bench::{from_bits, nan_bits, BenchInputs, BenchOptions};
use cm_cuda::{DType, Forward, ForwardRaw, KernelKind, LseLayout, TensorLayout};
use cm_plan::rows::RowIntervals;
use common::{masks, stray_writes, Buffers, Case, Expect, Gpu, Mem, Res, Rng};
use cudarc::driver::{sys, CudaSlice};
use serde_json::{json, Value};
use std::process::ExitCode;

/// Errors of one launch's output against the references on `rows_sel`.
#[derive(Default)]
struct Check {
    max_err: f64,
    emulated_err: f64,
    lse_err: f64,
    nan: usize,
    empty_rows: usize,
    empty_rows_wrong: usize,
    stray_writes: usize,
}

impl Check {
    fn tolerance(&self) -> f64 {
        reference::tolerance(self.emulated_err)
    }

    fn pass(&self) -> bool {
        self.nan == 0
            && self.empty_rows_wrong == 0
            && self.stray_writes == 0
            && self.max_err <= self.tolerance()
            && self.lse_err <= 1e-3
    }

    fn json(&self) -> Value {
        json!({
            "max_abs_err": self.max_err, "emulated_dtype_err": self.emulated_err,
            "tolerance": self.tolerance(), "lse_max_abs_err": self.lse_err, "nan": self.nan,
            "empty_rows": self.empty_rows, "empty_rows_wrong": self.empty_rows_wrong,
            "stray_writes": self.stray_writes, "pass": self.pass(),
        })
    }
}

/// The output (and lse) of every (batch, head) on `rows_sel` against the references of its
/// mask: `mask_of(b, h)` gives that mask and the references computed with it for every
/// (batch, head) of `shape`.
fn check<'a>(
    dtype: DType,
    mask_of: impl Fn(usize, usize) -> (&'a RowIntervals, &'a Expected),
    shape: Shape,
    layout: &TensorLayout,
    out_mem: &[u16],
    lse: Option<&[f32]>,
    rows_sel: &[u32],
) -> Check {
    let mut c = Check::default();
    let d = shape.head_dim_v;
    let n = rows_sel.len();
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let (mask, exp) = mask_of(b, h);
            for (r, &i) in rows_sel.iter().enumerate() {
                let item = (b * shape.heads + h) * n + r;
                let at = common::offset(layout, b, h, i as usize);
                let empty = mask.row(i).is_empty();
                c.empty_rows += usize::from(empty);
                let mut row_ok = true;
                for col in 0..d {
                    let g = from_bits(dtype, out_mem[at + col]);
                    if g.is_nan() {
                        c.nan += 1;
                        continue;
                    }
                    if empty {
                        row_ok &= g == 0.0;
                    } else {
                        c.max_err = c.max_err.max((g - exp.out[item * d + col]).abs());
                        c.emulated_err = c
                            .emulated_err
                            .max((exp.emulated[item * d + col] - exp.out[item * d + col]).abs());
                    }
                }
                if let Some(lse) = lse {
                    let g = f64::from(lse[(b * shape.heads + h) * shape.q_len + i as usize]);
                    if g.is_nan() {
                        c.nan += 1;
                    } else if empty {
                        row_ok &= g == f64::NEG_INFINITY;
                    } else {
                        c.lse_err = c.lse_err.max((g - exp.lse[item]).abs());
                    }
                }
                c.empty_rows_wrong += usize::from(empty && !row_ok);
            }
        }
    }
    c
}

/// Cross-checks this binary's float64 reference against the cm-reference crate.
fn cross_check(c: &Case, shape: Shape, x: &Inputs, exp: &Expected) -> Res<f64> {
    let r = cm_reference::attention_forward::<f64>(
        &common::attention_shape(shape),
        &x.q,
        &x.k,
        &x.v,
        &cm_reference::Masks::shared(&c.mask),
        f64::from(c.softmax_scale),
    )?;
    let mut diff = common::max_abs_diff(&r.out, &exp.out);
    for (a, b) in r.lse.iter().zip(&exp.lse) {
        if a.is_finite() || b.is_finite() {
            diff = diff.max((a - b).abs());
        }
    }
    Ok(diff)
}

/// The forward kernels every case runs on, on the same inputs.
const KERNELS: [KernelKind; 3] = [
    KernelKind::FwdWs,
    KernelKind::FwdWgmma,
    KernelKind::FwdSimple,
];

/// Every forward kernel built at `c`'s dtype and head dims, at each of its tiles (`fwd_ws` at
/// head_dim 64 has two, whichever a plan would rank first), selected on the runtime in turn;
/// `f` gets the kernel's label (`fwd_ws`, or `fwd_ws 192x128` for a pinned tile). The
/// runtime's default (fwd_ws, the plan's tile) is restored after.
fn each_forward(
    gpu: &mut Gpu,
    c: &Case,
    mut f: impl FnMut(&mut Gpu, String) -> Res<()>,
) -> Res<()> {
    let dims = (c.head_dim as u32, c.head_dim_v as u32);
    for kernel in KERNELS {
        let tiles: Vec<(u32, u32)> =
            cm_kernels::find_variants(kernel, c.dtype, dims.0, dims.1, false)
                .map(|i| cm_kernels::VARIANTS[i].tile())
                .collect();
        let pinned: Vec<Option<(u32, u32)>> = if tiles.len() > 1 {
            tiles.into_iter().map(Some).collect()
        } else if tiles.is_empty() {
            Vec::new()
        } else {
            vec![None]
        };
        for tile in pinned {
            gpu.rt.set_forward_kernel(kernel)?;
            gpu.rt.set_forward_tile(tile)?;
            let label = match tile {
                Some((m, n)) => format!("{} {m}x{n}", kernel.name()),
                None => kernel.name().to_string(),
            };
            f(gpu, label)?;
        }
    }
    gpu.rt.set_forward_kernel(KernelKind::FwdWs)?;
    gpu.rt.set_forward_tile(None)?;
    Ok(())
}

/// Fills the output (and lse) with NaN so that an element the kernel leaves unwritten shows.
fn poison(gpu: &Gpu, bufs: &mut Buffers, dtype: DType) -> Res<()> {
    gpu.stream
        .memcpy_htod(&vec![nan_bits(dtype); bufs.out_len_mem], &mut bufs.out)?;
    if let Some(l) = bufs.lse.as_mut() {
        let n = l.len();
        gpu.stream.memcpy_htod(&vec![f32::NAN; n], l)?;
    }
    Ok(())
}

fn run_case(gpu: &mut Gpu, rng: &mut Rng, c: &Case) -> Res<Vec<Value>> {
    let plan = gpu.rt.upload_plan(&c.mask, &gpu.stream)?;
    let (x, mut bufs) = Buffers::random(gpu, rng, c)?;
    let shape = c.shape();
    let rows_sel: Vec<u32> = (0..c.mask.q_len()).collect();
    let exp = reference::compute(
        shape,
        &x,
        &c.mask,
        &rows_sel,
        f64::from(c.softmax_scale),
        c.dtype,
    );
    let cross = if shape.q_len <= 1000 && shape.kv_len <= 1500 {
        Some(cross_check(c, shape, &x, &exp)?)
    } else {
        None
    };
    let mut results = Vec::new();
    // The reference forwards are built at head_dim 64 and 128 only (each_forward skips them
    // elsewhere).
    each_forward(gpu, c, |gpu, kernel| {
        poison(gpu, &mut bufs, c.dtype)?;
        bufs.forward(gpu, &plan, c)?;
        gpu.stream.synchronize()?;
        let out_mem = gpu.stream.clone_dtoh(&bufs.out)?;
        let lse = bufs
            .lse
            .as_ref()
            .map(|l| gpu.stream.clone_dtoh(l))
            .transpose()?;
        let mut chk = check(
            c.dtype,
            |_, _| (&c.mask, &exp),
            shape,
            &bufs.out_layout,
            &out_mem,
            lse.as_deref(),
            &rows_sel,
        );
        chk.stray_writes = stray_writes(c.dtype, &bufs.out_layout, &out_mem);
        let pass = chk.pass() && cross.is_none_or(|d| d < 1e-9);
        println!(
            "{} {:<10} {:<44} max_err {:.2e} (dtype-emulated {:.2e}, tol {:.2e}) lse_err {:.1e} empty {} nan {} stray {}{}",
            if pass { "PASS" } else { "FAIL" },
            kernel,
            c.name,
            chk.max_err,
            chk.emulated_err,
            chk.tolerance(),
            chk.lse_err,
            chk.empty_rows,
            chk.nan,
            chk.stray_writes,
            cross.map_or(String::new(), |d| format!(" cm-reference diff {d:.1e}"))
        );
        let mut v = c.json(chk.json());
        v["kernel"] = json!(kernel);
        v["cm_reference_diff"] = json!(cross);
        v["pass"] = json!(pass);
        results.push(v);
        Ok(())
    })?;
    Ok(results)
}

/// A plan of several masks (a causal, an all-visible, an empty and a striped one) assigned
/// per (batch, head) under GQA 4:1, different in each batch: every forward kernel runs it in
/// one launch, and each (batch, head) is checked against the references of its own mask.
fn per_head_masks(gpu: &mut Gpu, rng: &mut Rng) -> Res<Vec<Value>> {
    let (q_len, kv_len) = (193u32, 321u32);
    let empty = RowIntervals::from_rows(kv_len, &vec![Vec::new(); q_len as usize])?;
    let plan_masks = [
        masks::causal(q_len, kv_len),
        masks::full(q_len, kv_len),
        empty,
        masks::striped(q_len, kv_len),
    ];
    let (batch, heads, kv_heads) = (2usize, 8usize, 2usize);
    let index: Vec<u32> = (0..batch * heads)
        .map(|i| {
            let (b, h) = (i / heads, i % heads);
            (if b == 0 { h % 4 } else { 3 - h % 4 }) as u32
        })
        .collect();
    let refs: Vec<&RowIntervals> = plan_masks.iter().collect();
    let plan = gpu
        .rt
        .upload_plan_masks(&refs, &index, [batch, heads], &gpu.stream)?;
    let mut results = Vec::new();
    for combo in [(DType::Bf16, 128), (DType::F16, 64)] {
        let c = Case::new(
            "per-head masks",
            plan_masks[0].clone(),
            (batch, heads, kv_heads),
            combo,
            Mem::Contiguous,
        );
        let (x, mut bufs) = Buffers::random(gpu, rng, &c)?;
        let shape = c.shape();
        let rows_sel: Vec<u32> = (0..q_len).collect();
        let scale = f64::from(c.softmax_scale);
        let exps: Vec<Expected> = plan_masks
            .iter()
            .map(|m| reference::compute(shape, &x, m, &rows_sel, scale, c.dtype))
            .collect();
        let mask_of = |b: usize, h: usize| {
            let m = index[b * heads + h] as usize;
            (&plan_masks[m], &exps[m])
        };
        each_forward(gpu, &c, |gpu, kernel| {
            poison(gpu, &mut bufs, c.dtype)?;
            bufs.forward(gpu, &plan, &c)?;
            gpu.stream.synchronize()?;
            let out_mem = gpu.stream.clone_dtoh(&bufs.out)?;
            let lse = bufs
                .lse
                .as_ref()
                .map(|l| gpu.stream.clone_dtoh(l))
                .transpose()?;
            let chk = check(
                c.dtype,
                mask_of,
                shape,
                &bufs.out_layout,
                &out_mem,
                lse.as_deref(),
                &rows_sel,
            );
            println!(
                "{} {:<10} {:<44} max_err {:.2e} (tol {:.2e}) lse_err {:.1e} empty {} nan {}",
                if chk.pass() { "PASS" } else { "FAIL" },
                kernel,
                c.name,
                chk.max_err,
                chk.tolerance(),
                chk.lse_err,
                chk.empty_rows,
                chk.nan,
            );
            let mut v = c.json(chk.json());
            v["kernel"] = json!(kernel);
            v["masks"] = json!(plan_masks.len());
            results.push(v);
            Ok(())
        })?;
    }
    Ok(results)
}

fn cases() -> Vec<Case> {
    use DType::{Bf16, F16};
    let mut out = Vec::new();
    for combo in common::COMBOS {
        for len in [1, 17, 1000, 4097] {
            let heads = if len > 1000 { (1, 2, 1) } else { (2, 4, 2) };
            out.push(Case::new(
                "causal",
                masks::causal(len, len),
                heads,
                combo,
                Mem::Contiguous,
            ));
        }
    }
    // Every other mask on two (dtype, head_dim) combos; half the cases without the lse.
    let w2 = [700, 300, 1200, 64, 9, 1000, 0, 513];
    let w6 = [300, 1, 0, 450, 77, 2000, 64, 128];
    let mut others = masks::shared_cases();
    others.extend([
        (
            "W5 sliding_window",
            masks::sliding_window(4097, 1024),
            (1, 2, 1),
        ),
        (
            "W6 document_causal",
            masks::document_causal(4097, &w6),
            (1, 4, 2),
        ),
        ("W2 hstu", masks::hstu(4097, &w2), (1, 4, 2)),
        ("striped", masks::striped(1000, 1000), (1, 4, 2)),
        ("full", masks::full(65, 4097), (2, 2, 2)),
    ]);
    for (i, mut c) in common::on_two_combos(others).into_iter().enumerate() {
        c.lse = i % 2 == 0;
        out.push(c);
    }
    for (name, mask, heads, combo, mem, lse, scale) in [
        (
            "causal",
            masks::causal(1000, 1000),
            (2, 4, 2),
            (Bf16, 128),
            Mem::SeqMajor,
            true,
            None,
        ),
        (
            "document_causal",
            masks::document_causal(1000, &w6),
            (2, 4, 2),
            (F16, 64),
            Mem::Padded,
            true,
            None,
        ),
        (
            "hstu",
            masks::hstu(1000, &w2),
            (1, 4, 2),
            (Bf16, 64),
            Mem::Padded,
            false,
            None,
        ),
        (
            "W8 trace_prompt_groups",
            masks::trace_prompt_groups(1000),
            (1, 4, 2),
            (Bf16, 128),
            Mem::Padded,
            true,
            None,
        ),
        (
            "causal_scale0.5",
            masks::causal(1000, 1000),
            (1, 4, 2),
            (Bf16, 64),
            Mem::Contiguous,
            true,
            Some(0.5),
        ),
        (
            "causal_scale0.5",
            masks::causal(1000, 1000),
            (1, 4, 2),
            (F16, 128),
            Mem::Contiguous,
            true,
            Some(0.5),
        ),
        // A scale <= 0 takes fwd_ws's unfolded softmax (the scale cannot fold into the
        // exponent's maximum); partial tiles must still mask to -inf.
        (
            "document_causal_scale-0.3",
            masks::document_causal(1000, &w6),
            (1, 4, 2),
            (Bf16, 128),
            Mem::Contiguous,
            true,
            Some(-0.3),
        ),
        (
            "hstu_scale0",
            masks::hstu(1000, &w2),
            (1, 4, 2),
            (F16, 64),
            Mem::Contiguous,
            true,
            Some(0.0),
        ),
    ] {
        let mut c = Case::new(name, mask, heads, combo, mem);
        c.lse = lse;
        c.softmax_scale = scale.unwrap_or(c.softmax_scale);
        out.push(c);
    }
    out.extend(common::edge_cases());
    for c in &mut out {
        if !c.lse {
            c.name += " no-lse";
        }
    }
    out
}

/// The forward at the shapes of `cm_kernels::WIDE_SHAPES` (fwd_ws): [`common::wide_cases`],
/// every fourth without lse, and a negative softmax scale per shape (fwd_ws's unfolded
/// softmax).
fn wide_cases() -> Vec<Case> {
    let mut out = common::wide_cases();
    for (n, c) in out.iter_mut().enumerate() {
        c.lse = n % 4 != 3;
    }
    for (d, dv) in cm_kernels::WIDE_SHAPES {
        let mut c = Case::new(
            "document_causal_scale-0.3",
            masks::document_causal(1000, &[300, 1, 0, 450, 77, 2000, 64, 128]),
            (1, 4, 2),
            (DType::Bf16, d as usize),
            Mem::Contiguous,
        )
        .with_head_dim_v(dv as usize);
        c.softmax_scale = -0.3;
        out.push(c);
    }
    for c in &mut out {
        if !c.lse {
            c.name += " no-lse";
        }
    }
    out
}

/// Bad arguments must come back as errors naming the problem, never as a launch or a panic.
fn validation(gpu: &Gpu) -> Res<Vec<Value>> {
    let mask = masks::causal(100, 100);
    let plan = gpu.rt.upload_plan(&mask, &gpu.stream)?;
    let s = &gpu.stream;
    let buf = |n: usize| s.alloc_zeros::<u16>(n);
    let l = |h: usize, len: usize, d: usize| TensorLayout::contiguous([1, h, len, d]);
    let (q, k, v) = (
        buf(4 * 100 * 128)?,
        buf(4 * 100 * 128)?,
        buf(4 * 100 * 128)?,
    );
    let mut out = buf(4 * 100 * 128)?;
    let mut short = buf(100)?;
    let mut lse = s.alloc_zeros::<f32>(400)?;
    let mut e = Expect::new("validation");
    let fwd = |dtype,
               lq: TensorLayout,
               lk: TensorLayout,
               out: &mut CudaSlice<u16>,
               lo: TensorLayout,
               scale: f32| {
        gpu.rt.forward(
            s,
            &plan,
            Forward {
                dtype,
                q: (&q, lq),
                k: (&k, lk),
                v: (&v, lk),
                out: (out, lo),
                lse: None,
                softmax_scale: scale,
                score: cm_cuda::Score::NONE,
            },
        )
    };
    e.check(
        "head_dim 96",
        "head_dim = 96 with head_dim_v = 96 is not supported",
        fwd(
            DType::Bf16,
            l(4, 100, 96),
            l(4, 100, 96),
            &mut out,
            l(4, 100, 96),
            0.1,
        ),
    );
    e.check(
        "gqa 6/4",
        "must divide",
        fwd(
            DType::Bf16,
            l(6, 100, 64),
            l(4, 100, 64),
            &mut out,
            l(6, 100, 64),
            0.1,
        ),
    );
    e.check(
        "q_len vs plan",
        "do not match the plan",
        fwd(
            DType::F16,
            l(4, 99, 64),
            l(4, 100, 64),
            &mut out,
            l(4, 99, 64),
            0.1,
        ),
    );
    let mut strided = l(4, 100, 64);
    strided.strides[3] = 2;
    e.check(
        "last stride 2",
        "stride[3] (head_dim) = 2, expected 1",
        fwd(
            DType::Bf16,
            strided,
            l(4, 100, 64),
            &mut out,
            l(4, 100, 64),
            0.1,
        ),
    );
    let mut odd_rows = l(4, 100, 64);
    odd_rows.strides[2] = 68;
    e.check(
        "row stride 68",
        "not a multiple of 16 bytes",
        fwd(
            DType::Bf16,
            odd_rows,
            l(4, 100, 64),
            &mut out,
            l(4, 100, 64),
            0.1,
        ),
    );
    e.check(
        "short out buffer",
        "buffer holds 100",
        fwd(
            DType::Bf16,
            l(4, 100, 64),
            l(4, 100, 64),
            &mut short,
            l(4, 100, 64),
            0.1,
        ),
    );
    e.check(
        "nan scale",
        "softmax_scale = NaN",
        fwd(
            DType::Bf16,
            l(4, 100, 64),
            l(4, 100, 64),
            &mut out,
            l(4, 100, 64),
            f32::NAN,
        ),
    );
    e.check(
        "lse shape",
        "lse: shape [1, 4, 99]",
        gpu.rt.forward(
            s,
            &plan,
            Forward {
                dtype: DType::Bf16,
                q: (&q, l(4, 100, 64)),
                k: (&k, l(4, 100, 64)),
                v: (&v, l(4, 100, 64)),
                out: (&mut out, l(4, 100, 64)),
                lse: Some((&mut lse, LseLayout::contiguous([1, 4, 99]))),
                softmax_scale: 0.1,
                score: cm_cuda::Score::NONE,
            },
        ),
    );
    let raw = ForwardRaw {
        dtype: DType::Bf16,
        q: 0x1000_0002,
        q_layout: l(4, 100, 64),
        k: 0x1000_0000,
        k_layout: l(4, 100, 64),
        v: 0x1000_0000,
        v_layout: l(4, 100, 64),
        out: 0x2000_0000,
        out_layout: l(4, 100, 64),
        lse: None,
        softmax_scale: 0.1,
        score: cm_cuda::ScoreRaw::default(),
    };
    // SAFETY: the misaligned q address fails validation before any launch, so none of these
    // (made-up) addresses is ever dereferenced.
    #[allow(unsafe_code)]
    let r = unsafe { gpu.rt.forward_raw(s, &plan, &raw) };
    e.check("misaligned q", "is not 16-byte aligned", r);
    Ok(e.results)
}

/// A forward captured into a CUDA graph and replayed gives the same bits as an eager launch.
fn graph_capture(gpu: &Gpu, rng: &mut Rng) -> Res<Value> {
    let c = Case {
        name: "graph".into(),
        mask: masks::hstu(1000, &[700, 300]),
        batch: 1,
        heads: 4,
        kv_heads: 2,
        head_dim: 128,
        head_dim_v: 128,
        dtype: DType::Bf16,
        mem: Mem::Contiguous,
        lse: true,
        softmax_scale: 0.088,
        logit_mean: 0.0,
    };
    let plan = gpu.rt.upload_plan(&c.mask, &gpu.stream)?;
    let (_, mut bufs) = Buffers::random(gpu, rng, &c)?;
    bufs.forward(gpu, &plan, &c)?;
    gpu.stream.synchronize()?;
    let eager = gpu.stream.clone_dtoh(&bufs.out)?;
    gpu.stream
        .memcpy_htod(&vec![0u16; bufs.out_len_mem], &mut bufs.out)?;
    gpu.stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    bufs.forward(gpu, &plan, &c)?;
    let graph = gpu
        .stream
        .end_capture(sys::CUgraphInstantiate_flags(0))?
        .ok_or("capture produced no graph")?;
    graph.launch()?;
    gpu.stream.synchronize()?;
    let replayed = gpu.stream.clone_dtoh(&bufs.out)?;
    let pass = eager == replayed;
    println!(
        "{} graph capture: replay {} the eager output",
        if pass { "PASS" } else { "FAIL" },
        if pass { "matches" } else { "differs from" }
    );
    Ok(json!({"pass": pass}))
}

/// Checks and times every forward kernel on one workload with `cm_bench::measure`
/// (sampled rows of three heads against float64 first, then CUDA-event timings of
/// back-to-back calls and the single-call latency).
fn bench(gpu: &mut Gpu, name: &str, mask: &RowIntervals, seed: u64) -> Res<Vec<Value>> {
    let opts = BenchOptions {
        seed,
        ..BenchOptions::default()
    };
    let mut inputs = BenchInputs::new(&gpu.stream, mask.q_len(), mask.kv_len(), opts)?;
    let mut results = Vec::new();
    for kernel in KERNELS {
        gpu.rt.set_forward_kernel(kernel)?;
        let m = cm_bench::measure(&gpu.rt, &gpu.stream, &mut inputs, mask)?;
        let c = &m.check;
        let timing = m.timing.map_or("not timed".to_string(), |t| {
            format!(
                "median {:.3} ms ({:.1} TFLOP/s), mean {:.3} ms, single-call {:.3} ms, enqueue {:.1} us",
                t.median_ms, t.tflops, t.mean_ms, t.single_call_ms, t.enqueue_us
            )
        });
        println!(
            "{} bench {:<10} {name:<26} q{} H{} d{} {}: {timing}, tile density {:.3} ({}x{}: {} full, {} partial), \
             plan {:.1} ms, max_err {:.2e} (tol {:.2e})",
            if c.pass() { "PASS" } else { "FAIL" },
            kernel.name(),
            mask.q_len(),
            opts.heads,
            opts.head_dim,
            opts.dtype,
            m.visible_pairs as f64 / m.computed_pairs.max(1) as f64,
            m.tile.0,
            m.tile.1,
            m.tiles_full,
            m.tiles_partial,
            m.plan_upload_ms,
            c.max_abs_err,
            c.tolerance
        );
        let mut v = m.json();
        v["workload"] = json!(name);
        v["kernel"] = json!(kernel.name());
        v["q_len"] = json!(mask.q_len());
        v["kv_len"] = json!(mask.kv_len());
        results.push(v);
    }
    gpu.rt.set_forward_kernel(KernelKind::FwdWs)?;
    Ok(results)
}

fn kernels_json() -> Value {
    match cm_cuda::embedded_kernels() {
        Ok(ks) => Value::Array(
            ks.iter()
                .map(|k| {
                    json!({"variant": k.variant.name(), "cubin_bytes": k.cubin_bytes, "registers": k.registers,
                           "spill_bytes": k.spill_bytes, "shared_bytes": k.shared_bytes})
                })
                .collect(),
        ),
        Err(e) => json!({"error": e.to_string()}),
    }
}

fn run(args: &common::Args, report: &mut Value) -> Res<bool> {
    let mut gpu = Gpu::new(report)?;
    let mut rng = Rng(args.seed);
    let mut all_pass = true;

    let mut results = Vec::new();
    for c in cases().into_iter().chain(wide_cases()) {
        results.extend(
            run_case(&mut gpu, &mut rng, &c).unwrap_or_else(|e| vec![common::failed(&c, e)]),
        );
    }
    all_pass &= common::record(report, "cases", results);
    all_pass &= common::record(
        report,
        "per_head_masks",
        per_head_masks(&mut gpu, &mut rng)?,
    );
    all_pass &= common::record(report, "validation", validation(&gpu)?);
    let g = graph_capture(&gpu, &mut rng)?;
    all_pass &= g["pass"] == json!(true);
    report["graph_capture"] = g;

    if !args.has("--skip-bench") {
        let mut b = Vec::new();
        for (name, mask) in [8192, 32768].into_iter().flat_map(masks::workloads) {
            b.extend(bench(&mut gpu, &name, &mask, args.seed)?);
        }
        all_pass &= common::record(report, "bench", b);
    }
    Ok(all_pass)
}

fn main() -> ExitCode {
    let args = match common::parse_args("cm-gpu-test", &["--skip-bench", "--kernels"]) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let report = json!({"kernels": kernels_json()});
    if args.has("--kernels") {
        println!(
            "{}",
            serde_json::to_string_pretty(&report["kernels"]).unwrap_or_default()
        );
        return ExitCode::from(u8::from(report["kernels"].get("error").is_some()));
    }
    common::finish("cm-gpu-test", &args, report, |r| run(&args, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The masks are valid RowIntervals of the intended shape, and this binary's float64
    /// reference agrees with cm-reference (both run here, without a GPU).
    #[test]
    fn masks_and_reference_agree_with_cm_reference() {
        let hstu = masks::hstu(1000, &[700, 300]);
        assert_eq!(
            hstu.row(699).len(),
            2,
            "target rows see the history and themselves"
        );
        assert_eq!(
            hstu.row(3),
            hstu.row(4),
            "contextual rows see the whole history"
        );
        let clear = masks::clear(37, 30, 5);
        assert_eq!(
            clear.max_intervals_per_row(),
            10,
            "text + 2r - 1 image rows"
        );
        assert_eq!(masks::causal(300, 200).empty_rows(), 100);
        assert_eq!(masks::causal_with_empty_rows(1000).row(150).len(), 0);
        let mut rng = Rng(7);
        for (mask, dtype) in [
            (clear, DType::Bf16),
            (masks::striped(333, 777), DType::F16),
            (masks::causal(300, 200), DType::Bf16),
        ] {
            let mut c = Case::new("", mask, (2, 4, 2), (dtype, 64), Mem::Padded);
            c.softmax_scale = 0.125;
            let shape = c.shape();
            let (q_elems, kv_elems) = (2 * 4 * shape.q_len * 64, 2 * 2 * shape.kv_len * 64);
            let x = Inputs {
                q: common::random_values(&mut rng, dtype, q_elems, false),
                k: common::random_values(&mut rng, dtype, kv_elems, false),
                v: common::random_values(&mut rng, dtype, kv_elems, false),
            };
            let rows: Vec<u32> = (0..c.mask.q_len()).collect();
            let exp = reference::compute(shape, &x, &c.mask, &rows, 0.125, dtype);
            assert!(cross_check(&c, shape, &x, &exp).unwrap() < 1e-9);
            let emulated_err = common::max_abs_diff(&exp.emulated, &exp.out);
            assert!(emulated_err > 0.0 && emulated_err < 2e-2, "{emulated_err}");
        }
    }
}
