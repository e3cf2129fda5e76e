//! What the GPU test binaries `cm-gpu-test` (forward) and `cm-bwd-test` (backward) share:
//! the test masks, the random inputs and their memory layouts, the device setup, the
//! argument-validation helper and the command line / report skeleton. Each binary includes
//! this module with `#[path]`, so an item one of them does not use is not dead code.
#![allow(dead_code)]

pub mod masks;

use cm_bench::reference::{round_to, Inputs, Shape};
use cm_bench::{from_bits, nan_bits, to_bits};
use cm_cuda::{DType, DevicePlan, Forward, LseLayout, Runtime, TensorLayout};
use cm_plan::rows::RowIntervals;
use cudarc::driver::{CudaSlice, CudaStream};
use serde_json::{json, Value};
use std::process::ExitCode;
use std::sync::Arc;

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// xorshift64*: the tests' inputs and sampled rows, reproducible from `--seed`.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }
}

/// `n` random values of `dtype`, as exact f64; `fast` draws uniform values of unit variance
/// (for multi-GB inputs), otherwise standard normal ones.
pub fn random_values(rng: &mut Rng, dtype: DType, n: usize, fast: bool) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let x = if fast {
                (rng.uniform() - 0.5) * 3.464
            } else {
                rng.normal()
            };
            f64::from(round_to(dtype, x as f32))
        })
        .collect()
}

/// `n` standard-normal values plus `shift`, rounded to `dtype`, as exact f64.
pub fn shifted_values(rng: &mut Rng, dtype: DType, n: usize, shift: f64) -> Vec<f64> {
    (0..n)
        .map(|_| f64::from(round_to(dtype, (rng.normal() + shift) as f32)))
        .collect()
}

/// How a test tensor sits in memory (all of a case's tensors alike).
#[derive(Clone, Copy, Debug)]
pub enum Mem {
    /// `[batch, heads, seq, head_dim]` row-major.
    Contiguous,
    /// `[batch, seq, heads, head_dim]` memory.
    SeqMajor,
    /// Rows padded to `head_dim + 8` and 3 spare rows per head, padding filled with NaN.
    Padded,
}

impl Mem {
    pub fn name(self) -> &'static str {
        match self {
            Mem::Contiguous => "contiguous",
            Mem::SeqMajor => "seq_major",
            Mem::Padded => "padded",
        }
    }

    /// The layout of a `[b, h, s, d]` tensor and the buffer length it needs.
    pub fn layout(self, shape: [usize; 4]) -> (TensorLayout, usize) {
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

/// Element offset of logical index `[b, h, s, 0]`.
pub fn offset(l: &TensorLayout, b: usize, h: usize, s: usize) -> usize {
    (b as i64 * l.strides[0] + h as i64 * l.strides[1] + s as i64 * l.strides[2]) as usize
}

/// Calls `f(logical row index, memory offset of that row)` for every row of layout `l`.
fn for_rows(l: &TensorLayout, mut f: impl FnMut(usize, usize)) {
    let [b, h, s, _] = l.shape;
    for bi in 0..b {
        for hi in 0..h {
            for si in 0..s {
                f((bi * h + hi) * s + si, offset(l, bi, hi, si));
            }
        }
    }
}

/// The memory image (`len` elements) of a logical row-major tensor in layout `l`; memory
/// outside the view holds NaN, so that a stray read shows up in the output.
pub fn to_mem(dtype: DType, logical: &[f64], l: &TensorLayout, len: usize) -> Vec<u16> {
    let d = l.shape[3];
    let mut mem = vec![nan_bits(dtype); len];
    for_rows(l, |r, at| {
        for c in 0..d {
            mem[at + c] = to_bits(dtype, logical[r * d + c] as f32);
        }
    });
    mem
}

/// Logical row-major values of a memory image in layout `l`.
pub fn from_mem(dtype: DType, mem: &[u16], l: &TensorLayout) -> Vec<f64> {
    let d = l.shape[3];
    let mut out = vec![0.0; l.shape.iter().product()];
    for_rows(l, |r, at| {
        for c in 0..d {
            out[r * d + c] = from_bits(dtype, mem[at + c]);
        }
    });
    out
}

/// Elements of `mem` outside the view of layout `l` that no longer hold the NaN fill.
pub fn stray_writes(dtype: DType, l: &TensorLayout, mem: &[u16]) -> usize {
    let mut inside = vec![false; mem.len()];
    let d = l.shape[3];
    for_rows(l, |_, at| inside[at..at + d].fill(true));
    mem.iter()
        .zip(&inside)
        .filter(|&(&v, &ins)| !ins && v != nan_bits(dtype))
        .count()
}

/// One test configuration: a mask, shapes, dtype, memory layout, whether the forward writes
/// the lse, and the softmax scale.
pub struct Case {
    pub name: String,
    pub mask: RowIntervals,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Columns of V and of the output (`head_dim` but in [`cm_kernels::WIDE_SHAPES`]).
    pub head_dim_v: usize,
    pub dtype: DType,
    pub mem: Mem,
    pub lse: bool,
    pub softmax_scale: f32,
    /// The mean of the scaled logits `softmax_scale * q . k` that Q and K are drawn around
    /// (0: plain standard-normal inputs). Every element of Q is shifted by `mu` and of K by
    /// `mu` or `-mu`, `mu = sqrt(|logit_mean| / (|softmax_scale| head_dim))`, so that the
    /// logits are `logit_mean` plus a spread of a few units: at -120 every lse lies far below
    /// -88.7 (ln FLT_MAX), where exp(-lse) overflows fp32.
    pub logit_mean: f64,
}

impl Case {
    /// A case with lse and the softmax scale `1 / sqrt(head_dim)`, named after the mask and
    /// its shapes.
    pub fn new(
        mask_name: &str,
        mask: RowIntervals,
        (batch, heads, kv_heads): (usize, usize, usize),
        (dtype, head_dim): (DType, usize),
        mem: Mem,
    ) -> Case {
        Case {
            name: format!(
                "{mask_name} q{} kv{} b{batch} h{heads}/{kv_heads} d{head_dim} {}{}",
                mask.q_len(),
                mask.kv_len(),
                dtype.name(),
                match mem {
                    Mem::Contiguous => String::new(),
                    other => format!(" {}", other.name()),
                }
            ),
            mask,
            batch,
            heads,
            kv_heads,
            head_dim,
            head_dim_v: head_dim,
            dtype,
            mem,
            lse: true,
            softmax_scale: 1.0 / (head_dim as f32).sqrt(),
            logit_mean: 0.0,
        }
    }

    /// The case with V and the output at `head_dim_v` columns, named so.
    pub fn with_head_dim_v(mut self, head_dim_v: usize) -> Case {
        if head_dim_v != self.head_dim {
            self.name = self.name.replacen(
                &format!(" d{} ", self.head_dim),
                &format!(" d{}v{head_dim_v} ", self.head_dim),
                1,
            );
        }
        self.head_dim_v = head_dim_v;
        self
    }

    /// The shifts of Q's and K's elements that give logits around `logit_mean`.
    fn input_shifts(&self) -> (f64, f64) {
        let scale = f64::from(self.softmax_scale).abs();
        if self.logit_mean == 0.0 || scale == 0.0 {
            return (0.0, 0.0);
        }
        let mu = (self.logit_mean.abs() / (scale * self.head_dim as f64)).sqrt();
        let sign = self.logit_mean.signum() * f64::from(self.softmax_scale).signum();
        (mu, sign * mu)
    }

    /// The case's description in a report, with `extra`'s fields added.
    pub fn json(&self, extra: Value) -> Value {
        let mut v = json!({
            "name": self.name, "q_len": self.mask.q_len(), "kv_len": self.mask.kv_len(),
            "batch": self.batch, "heads": self.heads, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim, "head_dim_v": self.head_dim_v, "dtype": self.dtype.name(),
            "layout": self.mem.name(),
            "lse": self.lse, "softmax_scale": self.softmax_scale, "logit_mean": self.logit_mean,
        });
        if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
            v.extend(extra);
        }
        v
    }

    pub fn shape(&self) -> Shape {
        Shape {
            batch: self.batch,
            heads: self.heads,
            kv_heads: self.kv_heads,
            q_len: self.mask.q_len() as usize,
            kv_len: self.mask.kv_len() as usize,
            head_dim: self.head_dim,
            head_dim_v: self.head_dim_v,
        }
    }
}

/// The (dtype, head_dim) combinations every test covers.
pub const COMBOS: [(DType, usize); 4] = [
    (DType::Bf16, 64),
    (DType::Bf16, 128),
    (DType::F16, 64),
    (DType::F16, 128),
];

/// Each mask of `masks` on two [`COMBOS`], rotating so that every mask meets both dtypes and
/// both head dims across the list.
pub fn on_two_combos(masks: Vec<(&'static str, RowIntervals, (usize, usize, usize))>) -> Vec<Case> {
    let mut out = Vec::new();
    for (i, (name, mask, heads)) in masks.into_iter().enumerate() {
        for j in 0..2 {
            out.push(Case::new(
                name,
                mask.clone(),
                heads,
                COMBOS[(i + j * 3) % 4],
                Mem::Contiguous,
            ));
        }
    }
    out
}

/// The tile-edge class of `cm-gpu-test` and `cm-bwd-test`: lengths congruent to 1, 63, 64,
/// 65 and 127 modulo 128 (so sequences end inside the 64-row, 128-row and 128-key tiles of
/// every kernel), q_len below, equal to and above kv_len, all-visible masks (the edge tiles
/// are full), causal ones (partial edge tiles), packed documents whose samples end
/// mid-tile, MHA and GQA, every dtype and head dim, all three memory layouts, with logits
/// around -120 (lse far below -88.7) and +60. Keys at or past kv_len and rows at or past
/// q_len must contribute nothing, whatever the logits.
pub fn edge_cases() -> Vec<Case> {
    let mems = [Mem::Contiguous, Mem::Padded, Mem::SeqMajor];
    let mut out = Vec::new();
    for (i, r) in [1u32, 63, 64, 65, 127].into_iter().enumerate() {
        let r2 = 128 - r;
        let cases = [
            ("full", masks::full(128 + r, 256 + r2), (1, 4, 2)),
            ("full", masks::full(256 + r2, 128 + r), (2, 2, 2)),
            ("causal", masks::causal(128 + r, 128 + r), (1, 4, 1)),
            ("causal", masks::causal(128 + r, 384 + r2), (1, 2, 2)),
            (
                "document_causal",
                masks::document_causal(256 + r, &[100, 77, 150]),
                (1, 4, 2),
            ),
        ];
        for (j, (name, mask, heads)) in cases.into_iter().enumerate() {
            for (k, logit_mean) in [-120.0, 60.0].into_iter().enumerate() {
                let mut c = Case::new(
                    name,
                    mask.clone(),
                    heads,
                    COMBOS[(i + j + k) % 4],
                    mems[(i + 2 * j + k) % 3],
                );
                c.logit_mean = logit_mean;
                c.name += &format!(" logits{logit_mean:+}");
                out.push(c);
            }
        }
    }
    out
}

/// The wide shapes of `cm_kernels::WIDE_SHAPES` (head_dim 256 / head_dim_v 256, and the MLA
/// 192 / 128), for `cm-gpu-test` and `cm-bwd-test`: every workload of
/// [`masks::shared_cases`] and the tile-edge class (lengths 1, 63, 64, 65, 127 past a
/// multiple of 128, q_len below and above kv_len, with logits around -120 and +60,
/// alternating), both dtypes and all three memory layouts in rotation, MHA, GQA and MQA.
pub fn wide_cases() -> Vec<Case> {
    let mems = [Mem::Contiguous, Mem::Padded, Mem::SeqMajor];
    let dtypes = [DType::Bf16, DType::F16];
    let mut out = Vec::new();
    for (d, dv) in cm_kernels::WIDE_SHAPES {
        let (d, dv) = (d as usize, dv as usize);
        let mut masks_here = masks::shared_cases();
        let edges = masks_here.len();
        for r in [1u32, 63, 64, 65, 127] {
            masks_here.push(("full", masks::full(128 + r, 384 - r), (1, 4, 2)));
            masks_here.push(("causal", masks::causal(256 + r, 128 + r), (1, 2, 2)));
            masks_here.push((
                "document_causal",
                masks::document_causal(256 + r, &[100, 77, 150]),
                (1, 4, 1),
            ));
        }
        for (i, (name, mask, heads)) in masks_here.into_iter().enumerate() {
            // One counter over both shapes, so that each mask meets both dtypes and the
            // layouts rotate through the shapes.
            let n = out.len();
            let mut c =
                Case::new(name, mask, heads, (dtypes[n % 2], d), mems[n % 3]).with_head_dim_v(dv);
            if i >= edges {
                c.logit_mean = if n % 2 == 0 { -120.0 } else { 60.0 };
                c.name += &format!(" logits{:+}", c.logit_mean);
            }
            out.push(c);
        }
    }
    out
}

/// Q, K, V, the output and the lse of one case on the device, in the case's layout; the
/// output and lse start as NaN.
pub struct Buffers {
    pub q: CudaSlice<u16>,
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    pub out: CudaSlice<u16>,
    pub lse: Option<CudaSlice<f32>>,
    pub q_layout: TensorLayout,
    pub kv_layout: TensorLayout,
    /// V's and the output's (at head_dim_v columns).
    pub v_layout: TensorLayout,
    pub out_layout: TensorLayout,
    /// Buffer lengths (elements) of Q-shaped, K-shaped, V-shaped and output-shaped tensors.
    pub q_len_mem: usize,
    pub kv_len_mem: usize,
    pub v_len_mem: usize,
    pub out_len_mem: usize,
}

impl Buffers {
    /// Random standard-normal Q, K, V for `c` (drawn in that order; Q and K shifted for the
    /// case's `logit_mean`), uploaded.
    pub fn random(gpu: &Gpu, rng: &mut Rng, c: &Case) -> Res<(Inputs, Buffers)> {
        let sh = c.shape();
        let q_elems = sh.batch * sh.heads * sh.q_len * sh.head_dim;
        let kv_elems = sh.batch * sh.kv_heads * sh.kv_len * sh.head_dim;
        let v_elems = sh.batch * sh.kv_heads * sh.kv_len * sh.head_dim_v;
        let (q_shift, k_shift) = c.input_shifts();
        let x = Inputs {
            q: shifted_values(rng, c.dtype, q_elems, q_shift),
            k: shifted_values(rng, c.dtype, kv_elems, k_shift),
            v: random_values(rng, c.dtype, v_elems, false),
        };
        let b = Buffers::new(gpu, c, &x)?;
        Ok((x, b))
    }

    pub fn new(gpu: &Gpu, c: &Case, x: &Inputs) -> Res<Buffers> {
        let sh = c.shape();
        let (q_layout, q_len_mem) = c.mem.layout([sh.batch, sh.heads, sh.q_len, sh.head_dim]);
        let (kv_layout, kv_len_mem) = c
            .mem
            .layout([sh.batch, sh.kv_heads, sh.kv_len, sh.head_dim]);
        let (v_layout, v_len_mem) = c
            .mem
            .layout([sh.batch, sh.kv_heads, sh.kv_len, sh.head_dim_v]);
        let (out_layout, out_len_mem) = c.mem.layout([sh.batch, sh.heads, sh.q_len, sh.head_dim_v]);
        let s = &gpu.stream;
        let up =
            |v: &[f64], l: &TensorLayout, len: usize| s.clone_htod(&to_mem(c.dtype, v, l, len));
        let lse = if c.lse {
            Some(s.clone_htod(&vec![f32::NAN; (sh.batch * sh.heads * sh.q_len).max(1)])?)
        } else {
            None
        };
        Ok(Buffers {
            q: up(&x.q, &q_layout, q_len_mem)?,
            k: up(&x.k, &kv_layout, kv_len_mem)?,
            v: up(&x.v, &v_layout, v_len_mem)?,
            out: s.clone_htod(&vec![nan_bits(c.dtype); out_len_mem.max(1)])?,
            lse,
            q_layout,
            kv_layout,
            v_layout,
            out_layout,
            q_len_mem,
            kv_len_mem,
            v_len_mem,
            out_len_mem,
        })
    }

    pub fn lse_layout(&self) -> LseLayout {
        let [b, h, s, _] = self.q_layout.shape;
        LseLayout::contiguous([b, h, s])
    }

    /// One forward of the case's tensors, enqueued.
    pub fn forward(&mut self, gpu: &Gpu, plan: &DevicePlan, c: &Case) -> Res<()> {
        let lse_layout = self.lse_layout();
        gpu.rt.forward(
            &gpu.stream,
            plan,
            Forward {
                dtype: c.dtype,
                q: (&self.q, self.q_layout),
                k: (&self.k, self.kv_layout),
                v: (&self.v, self.v_layout),
                out: (&mut self.out, self.out_layout),
                lse: self.lse.as_mut().map(|buf| (buf, lse_layout)),
                softmax_scale: c.softmax_scale,
                score: cm_cuda::Score::NONE,
            },
        )?;
        Ok(())
    }
}

/// A case that stopped with an error: printed, and reported as a failure, so that the
/// remaining cases still run.
pub fn failed(c: &Case, e: Box<dyn std::error::Error>) -> Value {
    println!("FAIL {}: error {e}", c.name);
    c.json(json!({"error": e.to_string(), "pass": false}))
}

/// Stores `results` under `key` in `report`; whether every one has `"pass": true`.
pub fn record(report: &mut Value, key: &str, results: Vec<Value>) -> bool {
    let pass = results.iter().all(|v| v["pass"] == json!(true));
    report[key] = Value::Array(results);
    pass
}

/// `Shape` as cm-reference spells it, for the cross-checks against that crate.
pub fn attention_shape(s: Shape) -> cm_reference::AttentionShape {
    cm_reference::AttentionShape {
        batch: s.batch,
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        q_len: s.q_len,
        kv_len: s.kv_len,
        head_dim: s.head_dim,
        head_dim_v: s.head_dim_v,
    }
}

/// The largest |a - b| over two equally long slices.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The runtime and the one stream every launch of a test binary goes to.
pub struct Gpu {
    pub rt: Runtime,
    pub stream: Arc<CudaStream>,
}

impl Gpu {
    /// Device 0, with its name recorded in `report`.
    pub fn new(report: &mut Value) -> Res<Gpu> {
        let rt = Runtime::new_on_device(0)?;
        let ctx = rt.context().clone();
        report["device"] = json!(ctx.name()?);
        println!("device: {}", ctx.name()?);
        // SAFETY: called before any buffer exists; these programs order all work on one
        // stream, so cudarc's cross-stream event tracking is not needed (and would add driver
        // calls to the measured launch path).
        #[allow(unsafe_code)]
        unsafe {
            ctx.disable_event_tracking();
        }
        Ok(Gpu {
            stream: ctx.new_stream()?,
            rt,
        })
    }
}

/// Argument-validation checks: each bad launch must come back as an error naming the
/// problem, never as a launch or a panic.
pub struct Expect {
    label: &'static str,
    pub results: Vec<Value>,
}

impl Expect {
    pub fn new(label: &'static str) -> Expect {
        Expect {
            label,
            results: Vec::new(),
        }
    }

    /// Passes when `r` is an error whose message contains `needle`.
    pub fn check(&mut self, what: &str, needle: &str, r: Result<(), cm_cuda::Error>) {
        let (ok, msg) = match r {
            Ok(()) => (false, "accepted".to_string()),
            Err(e) => (e.to_string().contains(needle), e.to_string()),
        };
        self.record(what, ok, msg);
    }

    /// Passes when `r` succeeded.
    pub fn accepts(&mut self, what: &str, r: Result<(), cm_cuda::Error>) {
        let (ok, msg) = match r {
            Ok(()) => (true, "accepted".to_string()),
            Err(e) => (false, e.to_string()),
        };
        self.record(what, ok, msg);
    }

    fn record(&mut self, what: &str, ok: bool, msg: String) {
        println!(
            "{} {} {what}: {msg}",
            if ok { "PASS" } else { "FAIL" },
            self.label
        );
        self.results
            .push(json!({"case": what, "message": msg, "pass": ok}));
    }
}

/// The command line both binaries take: `--seed N`, `--json PATH` and their own flags.
pub struct Args {
    pub seed: u64,
    pub json: Option<String>,
    /// The flags of `flags` that were given.
    pub flags: Vec<&'static str>,
}

impl Args {
    pub fn has(&self, flag: &str) -> bool {
        self.flags.contains(&flag)
    }
}

/// Parses the command line of binary `name` with boolean `flags`.
pub fn parse_args(name: &str, flags: &[&'static str]) -> Result<Args, String> {
    let usage = format!(
        "usage: {name} [--seed N] [--json PATH]{}",
        flags.iter().map(|f| format!(" [{f}]")).collect::<String>()
    );
    let mut a = Args {
        seed: 0,
        json: None,
        flags: Vec::new(),
    };
    let mut seed = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seed" => {
                seed = Some(
                    it.next()
                        .and_then(|s| s.parse().ok())
                        .ok_or("--seed needs an integer")?,
                )
            }
            "--json" => a.json = Some(it.next().ok_or("--json needs a path")?),
            other => match flags.iter().find(|&&f| f == other) {
                Some(&f) => a.flags.push(f),
                None => return Err(format!("unknown argument {other:?}; {usage}")),
            },
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

/// Runs `run` and reports: prints the seed, records an error as a failure, writes `report`
/// (with `seed` and `pass`) to `--json`, prints ALL PASS or SOME CHECKS FAILED; exit status 0
/// exactly when everything passed.
pub fn finish(
    name: &str,
    args: &Args,
    mut report: Value,
    run: impl FnOnce(&mut Value) -> Res<bool>,
) -> ExitCode {
    println!(
        "{name} seed {} (replay with --seed {})",
        args.seed, args.seed
    );
    report["seed"] = json!(args.seed);
    let pass = match run(&mut report) {
        Ok(p) => p,
        Err(e) => {
            println!("FAIL error: {e}");
            report["error"] = json!(e.to_string());
            false
        }
    };
    report["pass"] = json!(pass);
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text) {
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
