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

mod masks;

use cm_cuda::reference::{self, round_to, Expected, Inputs, Shape};
use cm_cuda::{
    DType, DevicePlan, Forward, ForwardRaw, KernelKind, LseLayout, Runtime, TensorLayout,
};
use cm_plan::rows::RowIntervals;
use cudarc::driver::{sys, CudaSlice, CudaStream};
use serde_json::{json, Value};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }
}

/// How a test tensor sits in memory.
#[derive(Clone, Copy, Debug)]
enum Mem {
    /// `[batch, heads, seq, head_dim]` row-major.
    Contiguous,
    /// `[batch, seq, heads, head_dim]` memory.
    SeqMajor,
    /// Rows padded to `head_dim + 8` and 3 spare rows per head, padding filled with NaN.
    Padded,
}

impl Mem {
    fn name(self) -> &'static str {
        match self {
            Mem::Contiguous => "contiguous",
            Mem::SeqMajor => "seq_major",
            Mem::Padded => "padded",
        }
    }

    /// The layout of a `[b, h, s, d]` tensor and the buffer length it needs.
    fn layout(self, shape: [usize; 4]) -> (TensorLayout, usize) {
        let [b, h, s, d] = shape;
        match self {
            Mem::Contiguous => (TensorLayout::contiguous(shape), b * h * s * d),
            Mem::SeqMajor => (TensorLayout::seq_major(shape), b * h * s * d),
            Mem::Padded => {
                let (pitch, rows) = (d + 8, s + 3);
                let strides = [
                    (h * rows * pitch) as i64,
                    (rows * pitch) as i64,
                    pitch as i64,
                    1,
                ];
                (TensorLayout { shape, strides }, b * h * rows * pitch)
            }
        }
    }
}

fn nan_bits(dtype: DType) -> u16 {
    match dtype {
        DType::Bf16 => 0x7FC0,
        DType::F16 => 0x7E00,
    }
}

fn to_bits(dtype: DType, x: f32) -> u16 {
    match dtype {
        DType::Bf16 => half::bf16::from_f32(x).to_bits(),
        DType::F16 => half::f16::from_f32(x).to_bits(),
    }
}

fn from_bits(dtype: DType, b: u16) -> f64 {
    match dtype {
        DType::Bf16 => half::bf16::from_bits(b).to_f64(),
        DType::F16 => half::f16::from_bits(b).to_f64(),
    }
}

fn offset(l: &TensorLayout, b: usize, h: usize, s: usize) -> usize {
    (b as i64 * l.strides[0] + h as i64 * l.strides[1] + s as i64 * l.strides[2]) as usize
}

/// Random logical values (rounded to `dtype`) and their memory image in layout `l`; memory
/// outside the view holds NaN so that a stray read shows up in the output.
fn random_tensor(
    rng: &mut Rng,
    dtype: DType,
    l: &TensorLayout,
    len: usize,
) -> (Vec<f64>, Vec<u16>) {
    let [b, h, s, d] = l.shape;
    let mut logical = Vec::with_capacity(b * h * s * d);
    let mut mem = vec![nan_bits(dtype); len];
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                let at = offset(l, bi, hi, si);
                for c in 0..d {
                    let x = round_to(dtype, rng.normal() as f32);
                    logical.push(f64::from(x));
                    mem[at + c] = to_bits(dtype, x);
                }
            }
        }
    }
    (logical, mem)
}

struct Case {
    name: String,
    mask: RowIntervals,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    mem: Mem,
    lse: bool,
    softmax_scale: f32,
}

struct Gpu {
    rt: Runtime,
    stream: Arc<CudaStream>,
}

/// Device buffers of one case.
struct Buffers {
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    out: CudaSlice<u16>,
    lse: Option<CudaSlice<f32>>,
    q_layout: TensorLayout,
    kv_layout: TensorLayout,
    out_len: usize,
}

impl Buffers {
    fn forward(
        &mut self,
        gpu: &Gpu,
        plan: &DevicePlan,
        dtype: DType,
        softmax_scale: f32,
    ) -> Res<()> {
        let [b, h, s, _] = self.q_layout.shape;
        gpu.rt.forward(
            &gpu.stream,
            plan,
            Forward {
                dtype,
                q: (&self.q, self.q_layout),
                k: (&self.k, self.kv_layout),
                v: (&self.v, self.kv_layout),
                out: (&mut self.out, self.q_layout),
                lse: self
                    .lse
                    .as_mut()
                    .map(|buf| (buf, LseLayout::contiguous([b, h, s]))),
                softmax_scale,
            },
        )?;
        Ok(())
    }
}

fn setup(gpu: &Gpu, rng: &mut Rng, c: &Case) -> Res<(Inputs, Buffers)> {
    let (sq, skv) = (c.mask.q_len() as usize, c.mask.kv_len() as usize);
    let (q_layout, q_len_mem) = c.mem.layout([c.batch, c.heads, sq, c.head_dim]);
    let (kv_layout, kv_len_mem) = c.mem.layout([c.batch, c.kv_heads, skv, c.head_dim]);
    let (q, q_mem) = random_tensor(rng, c.dtype, &q_layout, q_len_mem);
    let (k, k_mem) = random_tensor(rng, c.dtype, &kv_layout, kv_len_mem);
    let (v, v_mem) = random_tensor(rng, c.dtype, &kv_layout, kv_len_mem);
    let s = &gpu.stream;
    let lse = if c.lse {
        Some(s.clone_htod(&vec![f32::NAN; c.batch * c.heads * sq])?)
    } else {
        None
    };
    let bufs = Buffers {
        q: s.clone_htod(&q_mem)?,
        k: s.clone_htod(&k_mem)?,
        v: s.clone_htod(&v_mem)?,
        out: s.clone_htod(&vec![nan_bits(c.dtype); q_len_mem])?,
        lse,
        q_layout,
        kv_layout,
        out_len: q_len_mem,
    };
    Ok((Inputs { q, k, v }, bufs))
}

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

#[allow(clippy::too_many_arguments)]
fn check(
    dtype: DType,
    mask: &RowIntervals,
    shape: Shape,
    layout: &TensorLayout,
    out_mem: &[u16],
    lse: Option<&[f32]>,
    rows_sel: &[u32],
    exp: &Expected,
) -> Check {
    let mut c = Check::default();
    let d = shape.head_dim;
    let n = rows_sel.len();
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            for (r, &i) in rows_sel.iter().enumerate() {
                let item = (b * shape.heads + h) * n + r;
                let at = offset(layout, b, h, i as usize);
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

/// Memory of the output buffer outside the logical view must still hold the NaN fill.
fn stray_writes(dtype: DType, layout: &TensorLayout, out_mem: &[u16]) -> usize {
    let mut inside = vec![false; out_mem.len()];
    let [b, h, s, d] = layout.shape;
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                let at = offset(layout, bi, hi, si);
                inside[at..at + d].iter_mut().for_each(|x| *x = true);
            }
        }
    }
    out_mem
        .iter()
        .zip(&inside)
        .filter(|&(&v, &ins)| !ins && v != nan_bits(dtype))
        .count()
}

fn shape_of(c: &Case) -> Shape {
    Shape {
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        q_len: c.mask.q_len() as usize,
        kv_len: c.mask.kv_len() as usize,
        head_dim: c.head_dim,
    }
}

/// Cross-checks this binary's float64 reference against the cm-reference crate.
fn cross_check(c: &Case, shape: Shape, x: &Inputs, exp: &Expected) -> Res<f64> {
    let rs = cm_reference::AttentionShape {
        batch: shape.batch,
        num_heads: shape.heads,
        num_kv_heads: shape.kv_heads,
        q_len: shape.q_len,
        kv_len: shape.kv_len,
        head_dim: shape.head_dim,
        head_dim_v: shape.head_dim,
    };
    let r = cm_reference::attention_forward::<f64>(
        &rs,
        &x.q,
        &x.k,
        &x.v,
        &cm_reference::Masks::shared(&c.mask),
        f64::from(c.softmax_scale),
    )?;
    let mut diff: f64 = 0.0;
    for (a, b) in r.out.iter().zip(&exp.out) {
        diff = diff.max((a - b).abs());
    }
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

/// Fills the output (and lse) with NaN so that an element the kernel leaves unwritten shows.
fn poison(gpu: &Gpu, bufs: &mut Buffers, dtype: DType) -> Res<()> {
    gpu.stream
        .memcpy_htod(&vec![nan_bits(dtype); bufs.out_len], &mut bufs.out)?;
    if let Some(l) = bufs.lse.as_mut() {
        let n = l.len();
        gpu.stream.memcpy_htod(&vec![f32::NAN; n], l)?;
    }
    Ok(())
}

fn run_case(gpu: &mut Gpu, rng: &mut Rng, c: &Case) -> Res<Vec<Value>> {
    let plan = gpu.rt.upload_plan(&c.mask, &gpu.stream)?;
    let (x, mut bufs) = setup(gpu, rng, c)?;
    let shape = shape_of(c);
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
    for kernel in KERNELS {
        gpu.rt.set_forward_kernel(kernel)?;
        poison(gpu, &mut bufs, c.dtype)?;
        bufs.forward(gpu, &plan, c.dtype, c.softmax_scale)?;
        gpu.stream.synchronize()?;
        let out_mem = gpu.stream.clone_dtoh(&bufs.out)?;
        let lse = bufs
            .lse
            .as_ref()
            .map(|l| gpu.stream.clone_dtoh(l))
            .transpose()?;
        let mut chk = check(
            c.dtype,
            &c.mask,
            shape,
            &bufs.q_layout,
            &out_mem,
            lse.as_deref(),
            &rows_sel,
            &exp,
        );
        chk.stray_writes = stray_writes(c.dtype, &bufs.q_layout, &out_mem);
        let pass = chk.pass() && cross.is_none_or(|d| d < 1e-9);
        println!(
            "{} {:<10} {:<44} max_err {:.2e} (dtype-emulated {:.2e}, tol {:.2e}) lse_err {:.1e} empty {} nan {} stray {}{}",
            if pass { "PASS" } else { "FAIL" },
            kernel.name(),
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
        let mut v = chk.json();
        v["kernel"] = json!(kernel.name());
        v["name"] = json!(c.name);
        v["q_len"] = json!(shape.q_len);
        v["kv_len"] = json!(shape.kv_len);
        v["batch"] = json!(c.batch);
        v["heads"] = json!(c.heads);
        v["kv_heads"] = json!(c.kv_heads);
        v["head_dim"] = json!(c.head_dim);
        v["dtype"] = json!(c.dtype.name());
        v["layout"] = json!(c.mem.name());
        v["lse"] = json!(c.lse);
        v["cm_reference_diff"] = json!(cross);
        v["pass"] = json!(pass);
        results.push(v);
    }
    gpu.rt.set_forward_kernel(KernelKind::FwdWs)?;
    Ok(results)
}

fn cases() -> Vec<Case> {
    use DType::{Bf16, F16};
    let mut out = Vec::new();
    let mut add = |mask_name: &str,
                   mask: RowIntervals,
                   (batch, heads, kv_heads): (usize, usize, usize),
                   dtype: DType,
                   head_dim: usize,
                   mem: Mem,
                   lse: bool,
                   scale: Option<f32>| {
        let name = format!(
            "{mask_name} q{} kv{} b{batch} h{heads}/{kv_heads} d{head_dim} {} {}{}",
            mask.q_len(),
            mask.kv_len(),
            dtype.name(),
            mem.name(),
            if lse { " lse" } else { "" }
        );
        let softmax_scale = scale.unwrap_or(1.0 / (head_dim as f32).sqrt());
        out.push(Case {
            name,
            mask,
            batch,
            heads,
            kv_heads,
            head_dim,
            dtype,
            mem,
            lse,
            softmax_scale,
        });
    };
    let combos = [(Bf16, 64), (Bf16, 128), (F16, 64), (F16, 128)];
    for &(dt, d) in &combos {
        for len in [1, 17, 1000] {
            add(
                "causal",
                masks::causal(len, len),
                (2, 4, 2),
                dt,
                d,
                Mem::Contiguous,
                true,
                None,
            );
        }
        add(
            "causal",
            masks::causal(4097, 4097),
            (1, 2, 1),
            dt,
            d,
            Mem::Contiguous,
            true,
            None,
        );
    }
    // Every other mask on two (dtype, head_dim) combos, rotating so each mask meets both
    // dtypes and both head dims.
    let w2 = [700, 300, 1200, 64, 9, 1000, 0, 513];
    let w6 = [300, 1, 0, 450, 77, 2000, 64, 128];
    let others: Vec<(&str, RowIntervals, (usize, usize, usize))> = vec![
        ("causal", masks::causal(17, 100), (2, 4, 2)),
        ("causal", masks::causal(1000, 1500), (1, 4, 2)),
        ("causal", masks::causal(300, 200), (2, 4, 2)),
        (
            "sliding_window",
            masks::sliding_window(1000, 256),
            (2, 4, 2),
        ),
        (
            "sliding_window",
            masks::sliding_window(4097, 1024),
            (1, 2, 1),
        ),
        (
            "document_causal",
            masks::document_causal(4097, &w6),
            (1, 4, 2),
        ),
        ("hstu", masks::hstu(1000, &w2), (2, 4, 2)),
        ("hstu", masks::hstu(4097, &w2), (1, 4, 2)),
        ("clear", masks::clear(37, 30, 5), (1, 4, 2)),
        ("striped", masks::striped(1000, 1000), (1, 4, 2)),
        ("striped", masks::striped(333, 777), (2, 2, 1)),
        ("empty_rows", masks::causal_with_empty_rows(1000), (2, 4, 2)),
        ("full", masks::full(1000, 777), (1, 4, 2)),
        ("full", masks::full(65, 4097), (2, 2, 2)),
        ("causal_gqa32/8", masks::causal(257, 257), (1, 32, 8)),
        ("causal_mqa", masks::causal(500, 500), (2, 4, 1)),
    ];
    for (i, (name, mask, heads)) in others.into_iter().enumerate() {
        for j in 0..2 {
            let (dt, d) = combos[(i + j * 3) % 4];
            add(
                name,
                mask.clone(),
                heads,
                dt,
                d,
                Mem::Contiguous,
                j == 0,
                None,
            );
        }
    }
    add(
        "causal",
        masks::causal(1000, 1000),
        (2, 4, 2),
        Bf16,
        128,
        Mem::SeqMajor,
        true,
        None,
    );
    add(
        "document_causal",
        masks::document_causal(1000, &w6),
        (2, 4, 2),
        F16,
        64,
        Mem::Padded,
        true,
        None,
    );
    add(
        "hstu",
        masks::hstu(1000, &w2),
        (1, 4, 2),
        Bf16,
        64,
        Mem::Padded,
        false,
        None,
    );
    add(
        "causal_scale0.5",
        masks::causal(1000, 1000),
        (1, 4, 2),
        Bf16,
        64,
        Mem::Contiguous,
        true,
        Some(0.5),
    );
    add(
        "causal_scale0.5",
        masks::causal(1000, 1000),
        (1, 4, 2),
        F16,
        128,
        Mem::Contiguous,
        true,
        Some(0.5),
    );
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
    let mut results = Vec::new();
    let mut expect = |what: &str, needle: &str, r: Result<(), cm_cuda::Error>| {
        let (ok, msg) = match r {
            Ok(()) => (false, "accepted".to_string()),
            Err(e) => (e.to_string().contains(needle), e.to_string()),
        };
        println!(
            "{} validation {what}: {msg}",
            if ok { "PASS" } else { "FAIL" }
        );
        results.push(json!({"case": what, "message": msg, "pass": ok}));
    };
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
            },
        )
    };
    expect(
        "head_dim 96",
        "head_dim = 96 is not supported",
        fwd(
            DType::Bf16,
            l(4, 100, 96),
            l(4, 100, 96),
            &mut out,
            l(4, 100, 96),
            0.1,
        ),
    );
    expect(
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
    expect(
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
    expect(
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
    expect(
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
    expect(
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
    expect(
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
    expect(
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
    };
    // SAFETY: the misaligned q address fails validation before any launch, so none of these
    // (made-up) addresses is ever dereferenced.
    #[allow(unsafe_code)]
    let r = unsafe { gpu.rt.forward_raw(s, &plan, &raw) };
    expect("misaligned q", "is not 16-byte aligned", r);
    Ok(results)
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
        dtype: DType::Bf16,
        mem: Mem::Contiguous,
        lse: true,
        softmax_scale: 0.088,
    };
    let plan = gpu.rt.upload_plan(&c.mask, &gpu.stream)?;
    let (_, mut bufs) = setup(gpu, rng, &c)?;
    bufs.forward(gpu, &plan, c.dtype, c.softmax_scale)?;
    gpu.stream.synchronize()?;
    let eager = gpu.stream.clone_dtoh(&bufs.out)?;
    gpu.stream
        .memcpy_htod(&vec![0u16; bufs.out_len], &mut bufs.out)?;
    gpu.stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    bufs.forward(gpu, &plan, c.dtype, c.softmax_scale)?;
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times one workload with every forward kernel: correctness on sampled rows first, then
/// CUDA-event timings of back-to-back calls and host-observed single-call latency.
fn bench(gpu: &mut Gpu, rng: &mut Rng, name: &str, mask: RowIntervals) -> Res<Vec<Value>> {
    let (heads, head_dim, dtype) = (16, 128, DType::Bf16);
    let c = Case {
        name: name.into(),
        mask,
        batch: 1,
        heads,
        kv_heads: heads,
        head_dim,
        dtype,
        mem: Mem::Contiguous,
        lse: true,
        softmax_scale: 1.0 / (head_dim as f32).sqrt(),
    };
    let t0 = Instant::now();
    let plan = gpu.rt.upload_plan(&c.mask, &gpu.stream)?;
    let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (x, mut bufs) = setup(gpu, rng, &c)?;
    let q_len = c.mask.q_len();
    let mut rows_sel = vec![0, 1, 63, 64, 65, q_len / 3, q_len / 2, q_len - 2, q_len - 1];
    rows_sel.extend((0..15).map(|_| (rng.next_u64() % u64::from(q_len)) as u32));
    rows_sel.sort_unstable();
    rows_sel.dedup();
    let shape = shape_of(&c);
    let exp = reference::compute(
        shape,
        &x,
        &c.mask,
        &rows_sel,
        f64::from(c.softmax_scale),
        dtype,
    );
    let flops = 4.0 * heads as f64 * head_dim as f64 * plan.visible_pairs() as f64;
    let density = plan.visible_pairs() as f64 / plan.computed_pairs() as f64;
    let counts = plan.tile_counts();
    let mut results = Vec::new();
    for kernel in KERNELS {
        gpu.rt.set_forward_kernel(kernel)?;
        poison(gpu, &mut bufs, dtype)?;
        bufs.forward(gpu, &plan, dtype, c.softmax_scale)?;
        gpu.stream.synchronize()?;
        let out_mem = gpu.stream.clone_dtoh(&bufs.out)?;
        let lse = bufs
            .lse
            .as_ref()
            .map(|l| gpu.stream.clone_dtoh(l))
            .transpose()?;
        let chk = check(
            dtype,
            &c.mask,
            shape,
            &bufs.q_layout,
            &out_mem,
            lse.as_deref(),
            &rows_sel,
            &exp,
        );

        let ctx = gpu.rt.context();
        for _ in 0..5 {
            bufs.forward(gpu, &plan, dtype, c.softmax_scale)?;
        }
        const RUNS: usize = 60;
        let events = (0..=RUNS)
            .map(|_| ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<Vec<_>, _>>()?;
        events[0].record(&gpu.stream)?;
        for e in &events[1..] {
            bufs.forward(gpu, &plan, dtype, c.softmax_scale)?;
            e.record(&gpu.stream)?;
        }
        gpu.stream.synchronize()?;
        let per_call: Vec<f64> = events
            .windows(2)
            .map(|w| w[0].elapsed_ms(&w[1]).map(f64::from))
            .collect::<Result<_, _>>()?;
        let med_ms = median(per_call.clone());
        let mean_ms = per_call.iter().sum::<f64>() / RUNS as f64;
        // Single-call latency: host enqueue to completion seen by the host.
        let mut single = Vec::new();
        let mut enqueue = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            bufs.forward(gpu, &plan, dtype, c.softmax_scale)?;
            enqueue.push(t.elapsed().as_secs_f64() * 1e6);
            gpu.stream.synchronize()?;
            single.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let tflops = flops / (med_ms * 1e-3) / 1e12;
        println!(
            "{} bench {:<10} {name:<24} q{q_len} H{heads} d{head_dim} bf16: median {med_ms:.3} ms ({tflops:.1} TFLOP/s), \
             mean {mean_ms:.3} ms, single-call {:.3} ms, enqueue {:.1} us, tile density {density:.3} (64x64: {} full, {} partial), \
             plan {plan_ms:.1} ms, max_err {:.2e} (tol {:.2e})",
            if chk.pass() { "PASS" } else { "FAIL" },
            kernel.name(),
            median(single.clone()),
            median(enqueue.clone()),
            counts.full,
            counts.partial,
            chk.max_err,
            chk.tolerance()
        );
        results.push(json!({
            "workload": name, "kernel": kernel.name(), "q_len": q_len, "kv_len": c.mask.kv_len(), "batch": 1,
            "heads": heads, "head_dim": head_dim, "dtype": "bf16", "visible_pairs": plan.visible_pairs(),
            "computed_pairs": plan.computed_pairs(), "tile": "64x64", "tiles_full": counts.full,
            "tiles_partial": counts.partial, "median_ms": med_ms, "mean_ms": mean_ms, "runs": RUNS,
            "tflops": tflops, "single_call_ms": median(single), "enqueue_us": median(enqueue),
            "plan_upload_ms": plan_ms, "sampled_rows_check": chk.json(), "pass": chk.pass(),
        }));
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

struct Args {
    seed: u64,
    json: Option<String>,
    skip_bench: bool,
    kernels_only: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        seed: 0,
        json: None,
        skip_bench: false,
        kernels_only: false,
    };
    let mut it = std::env::args().skip(1);
    let mut seed = None;
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seed" => seed = Some(it.next().and_then(|s| s.parse().ok()).ok_or("--seed needs an integer")?),
            "--json" => a.json = Some(it.next().ok_or("--json needs a path")?),
            "--skip-bench" => a.skip_bench = true,
            "--kernels" => a.kernels_only = true,
            other => return Err(format!("unknown argument {other:?}; usage: cm-gpu-test [--seed N] [--json PATH] [--skip-bench] [--kernels]")),
        }
    }
    // A fresh seed per run unless one is given; printed so a failure can be replayed.
    a.seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1
    });
    Ok(a)
}

fn run(args: &Args, report: &mut Value) -> Res<bool> {
    let rt = Runtime::new_on_device(0)?;
    let ctx = rt.context().clone();
    report["device"] = json!(ctx.name()?);
    println!("device: {}", ctx.name()?);
    // SAFETY: called before any buffer exists; this program orders all work on one stream, so
    // cudarc's cross-stream event tracking is not needed (and would add driver calls to the
    // measured launch path).
    #[allow(unsafe_code)]
    unsafe {
        ctx.disable_event_tracking();
    }
    let mut gpu = Gpu {
        stream: ctx.new_stream()?,
        rt,
    };
    let mut rng = Rng(args.seed);
    let mut all_pass = true;

    let mut results = Vec::new();
    for c in cases() {
        for v in run_case(&mut gpu, &mut rng, &c)? {
            all_pass &= v["pass"] == json!(true);
            results.push(v);
        }
    }
    report["cases"] = Value::Array(results);
    let val = validation(&gpu)?;
    all_pass &= val.iter().all(|v| v["pass"] == json!(true));
    report["validation"] = Value::Array(val);
    let g = graph_capture(&gpu, &mut rng)?;
    all_pass &= g["pass"] == json!(true);
    report["graph_capture"] = g;

    if !args.skip_bench {
        let mut b = Vec::new();
        for (name, mask) in [
            ("W1 causal 8K", masks::causal(8192, 8192)),
            ("W1 causal 32K", masks::causal(32768, 32768)),
            ("W5 sliding_window 32K", masks::sliding_window(32768, 4096)),
            (
                "W6 document_causal 32K",
                masks::document_causal(32768, &[4096, 1024, 8192, 512, 2048, 3072, 256, 6144]),
            ),
            (
                "W2 hstu 32K",
                masks::hstu(32768, &[2048, 1536, 3072, 1024, 2560, 512, 4096, 1280]),
            ),
        ] {
            for v in bench(&mut gpu, &mut rng, name, mask)? {
                all_pass &= v["pass"] == json!(true);
                b.push(v);
            }
        }
        report["bench"] = Value::Array(b);
    }
    Ok(all_pass)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut report = json!({"seed": args.seed, "kernels": kernels_json()});
    if args.kernels_only {
        println!(
            "{}",
            serde_json::to_string_pretty(&report["kernels"]).unwrap_or_default()
        );
        return ExitCode::from(u8::from(report["kernels"].get("error").is_some()));
    }
    println!(
        "cm-gpu-test seed {} (replay with --seed {})",
        args.seed, args.seed
    );
    let pass = match run(&args, &mut report) {
        Ok(p) => p,
        Err(e) => {
            println!("FAIL error: {e}");
            report["error"] = json!(e.to_string());
            false
        }
    };
    report["pass"] = json!(pass);
    let text = serde_json::to_string_pretty(&report).unwrap_or_default();
    if let Some(path) = &args.json {
        if let Err(e) = std::fs::write(path, &text) {
            eprintln!("cannot write {path}: {e}");
        }
    }
    println!(
        "{}",
        if pass {
            "ALL PASS"
        } else {
            "SOME CHECKS FAILED"
        }
    );
    if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
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
            let c = Case {
                name: String::new(),
                mask,
                batch: 2,
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                dtype,
                mem: Mem::Padded,
                lse: true,
                softmax_scale: 0.125,
            };
            let shape = shape_of(&c);
            let (q_layout, q_len) = c.mem.layout([2, 4, shape.q_len, 64]);
            let (kv_layout, kv_len) = c.mem.layout([2, 2, shape.kv_len, 64]);
            let x = Inputs {
                q: random_tensor(&mut rng, dtype, &q_layout, q_len).0,
                k: random_tensor(&mut rng, dtype, &kv_layout, kv_len).0,
                v: random_tensor(&mut rng, dtype, &kv_layout, kv_len).0,
            };
            let rows: Vec<u32> = (0..c.mask.q_len()).collect();
            let exp = reference::compute(shape, &x, &c.mask, &rows, 0.125, dtype);
            assert!(cross_check(&c, shape, &x, &exp).unwrap() < 1e-9);
            let emulated_err = exp
                .emulated
                .iter()
                .zip(&exp.out)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(emulated_err > 0.0 && emulated_err < 2e-2, "{emulated_err}");
        }
    }
}
