//! `cm-decode-test`: checks the serving kernels (`kernels/decode.cu`: a step's new rows against
//! a paged KV cache; and the prefill-chunk path, `fwd_ws` built with `CM_PAGED` over the step's
//! virtual key blocks, on every case whose page size it takes: powers of two from 8) against
//! the float64 CPU reference on contiguous copies of the same caches, then times decode
//! against the GPU's measured copy bandwidth. Built on the CPU
//! machine, run on the GPU machine:
//!
//! ```text
//! cm-decode-test [--seed N] [--json PATH] [--skip-bench] [--bench-only]
//! ```
//! Cases: bottom-right causal, sliding window, draft trees over the cached prefix (random
//! parent arrays) and random interval rows with empty ones; q_len 1 / 7 / 64, kv_len 1 / 127 /
//! 129 / 4097 / 32768; MHA, GQA 4:1 and 8:1; bf16 and fp16; head_dim 64 and 128; page sizes 1
//! to 256 with shuffled page tables, prompt pages shared between sequences and partially filled
//! last pages; one split, the heuristic's and forced splits; logits around -100 and +45. Every
//! slot the step must not read (past `kv_len`, unreferenced pages) holds NaN. Exit status 0
//! when every check passes.

#[path = "../common/mod.rs"]
mod common;

use cm_bench::reference::{self, Inputs, Shape};
use cm_bench::{from_bits, nan_bits, to_bits};
use cm_cuda::{
    decode_splits, decode_workspace_len, DType, Decode, Prefill, PREFILL_KEY_BLOCK,
    PREFILL_ROW_BLOCK,
};
use cm_plan::rows::RowIntervals;
use cm_serve::PrefillShape;
use common::{Expect, Gpu, Res, Rng};
use cudarc::driver::CudaSlice;
use serde_json::{json, Value};
use std::process::ExitCode;

#[derive(Clone, Copy, Debug)]
enum Mask {
    /// Row i of a sequence with q_len new rows sees keys [0, kv_len - q_len + i + 1).
    Causal,
    /// Bottom-right causal limited to the last `w` keys.
    Window(u32),
    /// The new rows are a draft tree (random parents, parents before children): node i sees
    /// the cached prefix [0, kv_len - q_len), its ancestors and itself.
    Tree,
    /// Zero to three random intervals per row (empty rows included).
    Random,
}

struct Case {
    name: String,
    dtype: DType,
    head_dim: usize,
    num_heads: usize,
    num_kv_heads: usize,
    page_size: usize,
    /// (q_len, kv_len) of each sequence.
    seqs: Vec<(usize, usize)>,
    mask: Mask,
    /// None: the heuristic's.
    splits: Option<u32>,
    /// Means added to Q and K (logits far from 0).
    shifts: (f64, f64),
    /// Sequence s > 0 reuses sequence 0's first pages for its first keys (a shared prompt).
    share_prompt: bool,
}

/// Each new row's visible intervals, built from the mask's definition (not by the planner).
fn rows_of(mask: Mask, q_len: usize, kv_len: usize, rng: &mut Rng) -> Vec<Vec<(u32, u32)>> {
    let prefix = kv_len - q_len;
    let merge = |mut keys: Vec<u32>| {
        keys.sort_unstable();
        keys.dedup();
        let mut out: Vec<(u32, u32)> = Vec::new();
        for k in keys {
            match out.last_mut() {
                Some(last) if last.1 == k => last.1 = k + 1,
                _ => out.push((k, k + 1)),
            }
        }
        out
    };
    match mask {
        Mask::Causal => (0..q_len)
            .map(|i| vec![(0, (prefix + i + 1) as u32)])
            .collect(),
        Mask::Window(w) => (0..q_len)
            .map(|i| {
                let end = (prefix + i + 1) as u32;
                vec![(end.saturating_sub(w), end)]
            })
            .collect(),
        Mask::Tree => {
            let parent: Vec<Option<usize>> = (0..q_len)
                .map(|i| {
                    if i == 0 || rng.uniform() < 0.1 {
                        None
                    } else {
                        Some((rng.next_u64() % i as u64) as usize)
                    }
                })
                .collect();
            (0..q_len)
                .map(|i| {
                    let mut keys: Vec<u32> = Vec::new();
                    let mut node = Some(i);
                    while let Some(n) = node {
                        keys.push((prefix + n) as u32);
                        node = parent[n];
                    }
                    let mut row = merge(keys);
                    if prefix > 0 {
                        if row[0].0 == prefix as u32 {
                            row[0].0 = 0;
                        } else {
                            row.insert(0, (0, prefix as u32));
                        }
                    }
                    row
                })
                .collect()
        }
        Mask::Random => (0..q_len)
            .map(|_| {
                let n = rng.next_u64() % 4;
                let mut cuts: Vec<u32> = (0..2 * n)
                    .map(|_| (rng.next_u64() % (kv_len as u64 + 1)) as u32)
                    .collect();
                cuts.sort_unstable();
                let mut row: Vec<(u32, u32)> = Vec::new();
                for p in cuts.chunks(2) {
                    if p[0] < p[1] {
                        match row.last_mut() {
                            Some(last) if last.1 >= p[0] => last.1 = last.1.max(p[1]),
                            _ => row.push((p[0], p[1])),
                        }
                    }
                }
                row
            })
            .collect(),
    }
}

/// A step's arrays on the host: the rows, the page table and the cache contents.
struct Step {
    cu_q: Vec<i32>,
    kv_len: Vec<i32>,
    row_ptr: Vec<i32>,
    intervals: Vec<i32>,
    /// Each sequence's rows, for the reference.
    rows: Vec<RowIntervals>,
    block_table: Vec<i32>,
    max_pages: usize,
    num_pages: usize,
}

fn build_step(c: &Case, rng: &mut Rng) -> Res<Step> {
    let mut s = Step {
        cu_q: vec![0],
        kv_len: Vec::new(),
        row_ptr: vec![0],
        intervals: Vec::new(),
        rows: Vec::new(),
        block_table: Vec::new(),
        max_pages: 0,
        num_pages: 0,
    };
    for &(q_len, kv_len) in &c.seqs {
        let rows = rows_of(c.mask, q_len, kv_len, rng);
        for row in &rows {
            for &(a, b) in row {
                s.intervals.extend([a as i32, b as i32]);
            }
            s.row_ptr.push((s.intervals.len() / 2) as i32);
        }
        s.cu_q.push(s.cu_q.last().unwrap() + q_len as i32);
        s.kv_len.push(kv_len as i32);
        s.rows.push(RowIntervals::from_rows(kv_len as u32, &rows)?);
    }
    // Pages: each sequence's own in a shuffled pool with spare (never referenced) pages.
    let pages_of: Vec<usize> = c
        .seqs
        .iter()
        .map(|&(_, kv)| kv.div_ceil(c.page_size))
        .collect();
    s.max_pages = pages_of.iter().copied().max().unwrap_or(1).max(1) + 1;
    let own: usize = pages_of.iter().sum();
    s.num_pages = own + 3;
    let mut pool: Vec<i32> = (0..s.num_pages as i32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut next = pool.into_iter();
    let mut first: Vec<i32> = Vec::new();
    for (si, &n) in pages_of.iter().enumerate() {
        let mut row: Vec<i32> = Vec::with_capacity(s.max_pages);
        for p in 0..n {
            // A shared prompt: sequence 0's full pages stand for the first pages of the others.
            let shared = c.share_prompt && si > 0 && p + 1 < pages_of[0] && p + 1 < n;
            row.push(if shared {
                first.get(p).copied().ok_or("shared page past the prompt")?
            } else {
                next.next().ok_or("page pool exhausted")?
            });
        }
        if si == 0 {
            first = row.clone();
        }
        // Past the sequence's pages: a garbage entry the kernel must never follow.
        row.resize(s.max_pages, -7);
        s.block_table.extend(row);
    }
    Ok(s)
}

/// Errors of one launch against the reference.
#[derive(Default)]
struct Check {
    max_err: f64,
    emulated_err: f64,
    lse_err: f64,
    nan: usize,
    empty_rows_wrong: usize,
}

impl Check {
    fn pass(&self) -> bool {
        self.nan == 0
            && self.empty_rows_wrong == 0
            && self.max_err <= reference::tolerance(self.emulated_err)
            && self.lse_err <= 1e-3
    }
}

fn run_case(gpu: &Gpu, rng: &mut Rng, c: &Case) -> Res<Value> {
    let step = build_step(c, rng)?;
    let (h, h_kv, d, ps) = (c.num_heads, c.num_kv_heads, c.head_dim, c.page_size);
    let total_q = *step.cu_q.last().unwrap() as usize;
    let group = h / h_kv;
    let scale = 1.0 / (d as f64).sqrt();
    let q: Vec<f64> = common::shifted_values(rng, c.dtype, total_q * h * d, c.shifts.0);
    let slot = |page: usize, s: usize, kvh: usize| ((page * ps + s) * h_kv + kvh) * d;
    let cache_elems = step.num_pages * ps * h_kv * d;
    // Every slot starts as NaN; the sequences' keys overwrite theirs (shared pages twice, with
    // the same logical contents: position p of every sharing sequence is the prompt's p).
    let mut k_mem = vec![nan_bits(c.dtype); cache_elems];
    let mut v_mem = vec![nan_bits(c.dtype); cache_elems];
    let mut logical: Vec<(Vec<f64>, Vec<f64>)> = Vec::new();
    for (si, &(_, kv)) in c.seqs.iter().enumerate() {
        let table = &step.block_table[si * step.max_pages..][..step.max_pages];
        let mut kl = vec![0.0; h_kv * kv * d];
        let mut vl = vec![0.0; h_kv * kv * d];
        for pos in 0..kv {
            let page = table[pos / ps] as usize;
            for kvh in 0..h_kv {
                let at = slot(page, pos % ps, kvh);
                let written = !from_bits(c.dtype, k_mem[at]).is_nan();
                for e in 0..d {
                    let (kx, vx) = if written {
                        (
                            from_bits(c.dtype, k_mem[at + e]),
                            from_bits(c.dtype, v_mem[at + e]),
                        )
                    } else {
                        let kx = common::shifted_values(rng, c.dtype, 1, c.shifts.1)[0];
                        let vx = common::random_values(rng, c.dtype, 1, false)[0];
                        k_mem[at + e] = to_bits(c.dtype, kx as f32);
                        v_mem[at + e] = to_bits(c.dtype, vx as f32);
                        (kx, vx)
                    };
                    kl[(kvh * kv + pos) * d + e] = kx;
                    vl[(kvh * kv + pos) * d + e] = vx;
                }
            }
        }
        logical.push((kl, vl));
    }
    let s = &gpu.stream;
    let q_dev = s.clone_htod(
        &q.iter()
            .map(|&x| to_bits(c.dtype, x as f32))
            .collect::<Vec<u16>>(),
    )?;
    let k_dev = s.clone_htod(&k_mem)?;
    let v_dev = s.clone_htod(&v_mem)?;
    let up = |v: &[i32]| s.clone_htod(if v.is_empty() { &[0][..] } else { v });
    let (cu_q, kv_len, row_ptr) = (up(&step.cu_q)?, up(&step.kv_len)?, up(&step.row_ptr)?);
    let intervals: CudaSlice<i32> = if step.intervals.is_empty() {
        s.alloc_zeros::<i32>(0)?
    } else {
        s.clone_htod(&step.intervals)?
    };
    let block_table = s.clone_htod(&step.block_table)?;
    let max_q = c.seqs.iter().map(|x| x.0).max().unwrap_or(1);
    let max_kv = c.seqs.iter().map(|x| x.1).max().unwrap_or(1);
    let splits = match c.splits {
        Some(n) => n,
        None => decode_splits(
            c.seqs.len(),
            max_q,
            group,
            h_kv,
            max_kv,
            gpu.rt.num_sms(),
            gpu.rt.decode_ctas_per_sm(c.dtype, d as u32)?,
        ),
    };
    let mut out = s.clone_htod(&vec![nan_bits(c.dtype); total_q * h * d])?;
    let mut lse = s.clone_htod(&vec![f32::NAN; total_q * h])?;
    let mut workspace = s.alloc_zeros::<f32>(decode_workspace_len(splits, total_q, h, d).max(1))?;
    gpu.rt.decode(
        s,
        Decode {
            dtype: c.dtype,
            q: &q_dev,
            q_shape: [total_q, h, d],
            k_cache: &k_dev,
            v_cache: &v_dev,
            cache_shape: [step.num_pages, ps, h_kv, d],
            out: &mut out,
            lse: Some(&mut lse),
            block_table: &block_table,
            block_table_shape: [c.seqs.len(), step.max_pages],
            cu_q: &cu_q,
            kv_len: &kv_len,
            row_ptr: &row_ptr,
            intervals: &intervals,
            max_q_len: max_q,
            num_splits: splits,
            workspace: (splits > 1).then_some(&mut workspace),
            softmax_scale: scale as f32,
        },
    )?;
    let out_host = s.clone_dtoh(&out)?;
    let lse_host = s.clone_dtoh(&lse)?;
    s.synchronize()?;
    let decode_ck = check(c, &step, &q, &logical, scale, &out_host, |r, hh| {
        lse_host[r * h + hh]
    });
    let pass = decode_ck.pass();
    print_check("decode", c, &decode_ck, &format!("splits {splits}"));
    let mut result = json!({
        "case": c.name, "splits": splits, "max_abs_err": decode_ck.max_err,
        "tolerance": reference::tolerance(decode_ck.emulated_err), "lse_max_abs_err": decode_ck.lse_err,
        "nan": decode_ck.nan, "empty_rows_wrong": decode_ck.empty_rows_wrong, "pass": pass,
    });
    if ps.is_power_of_two() && ps >= cm_cuda::prefill::MIN_PREFILL_PAGE_SIZE {
        let plan = cm_serve::StepPlan::from_parts(
            step.cu_q.clone(),
            step.kv_len.clone(),
            step.row_ptr.clone(),
            step.intervals.clone(),
        )?
        .prefill(PrefillShape {
            key_block: PREFILL_KEY_BLOCK,
            row_block: PREFILL_ROW_BLOCK,
            row_group: group as u32,
        })?;
        let dev_plan = gpu.rt.upload_prefill_plan(&plan.rows, s)?;
        let key_blocks = s.clone_htod(&plan.key_blocks)?;
        // q at the layout's virtual rows, the query heads of each kv head packed as rows
        // (query head kvh * group + j of row r at virtual row row_index[r * group + j] of kv
        // head kvh); the padding rows are zeros, as the Python op makes them, and their
        // outputs are dropped.
        let q_rows = plan.q_rows() as usize;
        let at = |r: usize, hh: usize| {
            let v = plan.row_index[r * group + hh % group] as usize;
            (v * h_kv + hh / group) * d
        };
        let mut q_virtual = vec![to_bits(c.dtype, 0.0); q_rows * h_kv * d];
        for r in 0..total_q {
            for hh in 0..h {
                for e in 0..d {
                    q_virtual[at(r, hh) + e] = to_bits(c.dtype, q[(r * h + hh) * d + e] as f32);
                }
            }
        }
        let q_virtual = s.clone_htod(&q_virtual)?;
        let mut out = s.clone_htod(&vec![nan_bits(c.dtype); q_rows * h_kv * d])?;
        let mut lse = s.clone_htod(&vec![f32::NAN; q_rows * h_kv])?;
        gpu.rt.prefill(
            s,
            &dev_plan,
            Prefill {
                dtype: c.dtype,
                q: &q_virtual,
                q_shape: [q_rows, h_kv, d],
                k_cache: &k_dev,
                v_cache: &v_dev,
                cache_shape: [step.num_pages, ps, h_kv, d],
                out: &mut out,
                lse: Some(&mut lse),
                block_table: &block_table,
                block_table_shape: [c.seqs.len(), step.max_pages],
                key_blocks: &key_blocks,
                softmax_scale: scale as f32,
            },
        )?;
        let out_virtual = s.clone_dtoh(&out)?;
        let lse_host = s.clone_dtoh(&lse)?;
        s.synchronize()?;
        let mut out_host = vec![0u16; total_q * h * d];
        for r in 0..total_q {
            for hh in 0..h {
                out_host[(r * h + hh) * d..][..d].copy_from_slice(&out_virtual[at(r, hh)..][..d]);
            }
        }
        let ck = check(c, &step, &q, &logical, scale, &out_host, |r, hh| {
            lse_host[(hh / group) * q_rows + plan.row_index[r * group + hh % group] as usize]
        });
        print_check(
            "prefill",
            c,
            &ck,
            &format!("{} key blocks, {q_rows} rows", plan.num_key_blocks()),
        );
        result["prefill"] = json!({
            "max_abs_err": ck.max_err, "tolerance": reference::tolerance(ck.emulated_err),
            "lse_max_abs_err": ck.lse_err, "nan": ck.nan, "empty_rows_wrong": ck.empty_rows_wrong,
            "pass": ck.pass(),
        });
        result["pass"] = json!(pass && ck.pass());
    }
    Ok(result)
}

fn print_check(path: &str, c: &Case, ck: &Check, extra: &str) {
    println!(
        "{} {path} {}: err {:.2e} (tol {:.2e}) lse err {:.1e} nan {} empty wrong {} {extra}",
        if ck.pass() { "PASS" } else { "FAIL" },
        c.name,
        ck.max_err,
        reference::tolerance(ck.emulated_err),
        ck.lse_err,
        ck.nan,
        ck.empty_rows_wrong
    );
}

/// One launch's outputs (`out` `[total_q, heads, d]`, lse of (row, head) from `lse_at`)
/// against the float64 reference of each sequence on its logical (contiguous) keys.
fn check(
    c: &Case,
    step: &Step,
    q: &[f64],
    logical: &[(Vec<f64>, Vec<f64>)],
    scale: f64,
    out_host: &[u16],
    lse_at: impl Fn(usize, usize) -> f32,
) -> Check {
    let (h, h_kv, d) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let mut ck = Check::default();
    for (si, &(q_len, kv)) in c.seqs.iter().enumerate() {
        let r0 = step.cu_q[si] as usize;
        // The sequence's new rows as batch 1, [1, heads, q_len, d].
        let mut qs = vec![0.0; h * q_len * d];
        for i in 0..q_len {
            for hh in 0..h {
                for e in 0..d {
                    qs[(hh * q_len + i) * d + e] = q[((r0 + i) * h + hh) * d + e];
                }
            }
        }
        let shape = Shape {
            batch: 1,
            heads: h,
            kv_heads: h_kv,
            q_len,
            kv_len: kv,
            head_dim: d,
            head_dim_v: d,
        };
        let inputs = Inputs {
            q: qs,
            k: logical[si].0.clone(),
            v: logical[si].1.clone(),
        };
        let all: Vec<u32> = (0..q_len as u32).collect();
        let exp = reference::compute(shape, &inputs, &step.rows[si], &all, scale, c.dtype);
        for i in 0..q_len {
            let empty = step.rows[si].row(i as u32).is_empty();
            for hh in 0..h {
                let item = hh * q_len + i;
                let got_lse = f64::from(lse_at(r0 + i, hh));
                for e in 0..d {
                    let got = from_bits(c.dtype, out_host[((r0 + i) * h + hh) * d + e]);
                    if got.is_nan() {
                        ck.nan += 1;
                    }
                    if empty && got != 0.0 {
                        ck.empty_rows_wrong += 1;
                    }
                    ck.max_err = ck.max_err.max((got - exp.out[item * d + e]).abs());
                    ck.emulated_err = ck
                        .emulated_err
                        .max((exp.emulated[item * d + e] - exp.out[item * d + e]).abs());
                }
                if got_lse.is_nan() {
                    ck.nan += 1;
                } else if empty {
                    if got_lse != f64::NEG_INFINITY {
                        ck.empty_rows_wrong += 1;
                    }
                } else {
                    ck.lse_err = ck.lse_err.max((got_lse - exp.lse[item]).abs());
                }
            }
        }
    }
    ck
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let base = |name: &str, mask: Mask, seqs: Vec<(usize, usize)>| Case {
        name: name.to_string(),
        dtype: DType::Bf16,
        head_dim: 128,
        num_heads: 32,
        num_kv_heads: 8,
        page_size: 16,
        seqs,
        mask,
        splits: None,
        shifts: (0.0, 0.0),
        share_prompt: false,
    };
    let lengths = vec![(1, 1), (1, 127), (1, 129), (1, 4097), (1, 64), (1, 65)];
    out.push(base("causal q1 odd kv", Mask::Causal, lengths.clone()));
    for &(dtype, d) in &[(DType::F16, 64), (DType::Bf16, 64), (DType::F16, 128)] {
        let mut c = base("causal q1 odd kv", Mask::Causal, lengths.clone());
        c.name = format!("causal q1 odd kv {} d{d}", dtype.name());
        c.dtype = dtype;
        c.head_dim = d;
        out.push(c);
    }
    for &(hq, hkv) in &[(8, 8), (32, 4), (8, 1)] {
        let mut c = base("", Mask::Causal, vec![(7, 300), (1, 1000), (3, 3)]);
        c.name = format!("causal q7 heads {hq}/{hkv}");
        c.num_heads = hq;
        c.num_kv_heads = hkv;
        out.push(c);
    }
    for &splits in &[1u32, 3, 7] {
        let mut c = base("", Mask::Causal, vec![(1, 4097), (2, 2000), (1, 129)]);
        c.name = format!("causal forced splits {splits}");
        c.splits = Some(splits);
        out.push(c);
    }
    for &ps in &[1usize, 64, 256] {
        let mut c = base("", Mask::Window(100), vec![(7, 1000), (1, 50), (64, 700)]);
        c.name = format!("window 100 page {ps}");
        c.page_size = ps;
        out.push(c);
    }
    let mut c = base(
        "tree 64 over prefix",
        Mask::Tree,
        vec![(64, 64 + 3000), (17, 17 + 129), (64, 64)],
    );
    c.share_prompt = true;
    out.push(c);
    let mut c = base(
        "tree q64 MHA d64",
        Mask::Tree,
        vec![(64, 64 + 511), (5, 5 + 1)],
    );
    c.num_heads = 4;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    out.push(c);
    let mut c = base(
        "random rows, empty rows",
        Mask::Random,
        vec![(7, 129), (64, 500), (1, 1), (5, 4097)],
    );
    c.splits = Some(4);
    out.push(c);
    out.push(base(
        "random rows heuristic",
        Mask::Random,
        vec![(33, 1000), (2, 63)],
    ));
    let mut c = base(
        "shared prompt 8 x 16 rows",
        Mask::Causal,
        vec![(16, 600); 8],
    );
    c.share_prompt = true;
    out.push(c);
    for &(qs, ks, label) in &[(3.0, -3.0, "about -100"), (2.0, 2.0, "about +45")] {
        let mut c = base("", Mask::Causal, vec![(1, 129), (7, 1000), (1, 65)]);
        c.name = format!("logits {label}");
        c.shifts = (qs, ks);
        out.push(c);
        let mut c = base("", Mask::Causal, vec![(1, 129), (7, 1000), (1, 65)]);
        c.name = format!("logits {label}, 5 splits");
        c.shifts = (qs, ks);
        c.splits = Some(5);
        out.push(c);
    }
    out.push(base(
        "causal 32K",
        Mask::Causal,
        vec![(1, 32768), (4, 32768)],
    ));
    // Prefill chunks (hundreds of new rows per sequence: the paged forward's shapes), every
    // box size of the paged loads (pages of 8 to 256 slots), odd lengths ending inside a key
    // block, sequences whose GQA-packed rows (groups of 1 to 8) end inside a query tile and
    // are padded, extreme logits.
    let chunks = vec![(300, 1000), (513, 513), (128, 2049), (65, 193)];
    for &(dtype, d, ps, hq, hkv) in &[
        (DType::Bf16, 128, 16, 8, 2),
        (DType::F16, 64, 128, 4, 4),
        (DType::Bf16, 64, 8, 8, 1),
        (DType::F16, 128, 256, 4, 2),
    ] {
        let mut c = base("", Mask::Causal, chunks.clone());
        c.name = format!(
            "prefill chunks {} d{d} page {ps} heads {hq}/{hkv}",
            dtype.name()
        );
        (
            c.dtype,
            c.head_dim,
            c.page_size,
            c.num_heads,
            c.num_kv_heads,
        ) = (dtype, d, ps, hq, hkv);
        out.push(c);
    }
    for (mask, label) in [
        (Mask::Window(100), "window 100"),
        (Mask::Random, "random rows"),
    ] {
        let mut c = base("", mask, vec![(200, 700), (1, 1), (77, 129), (129, 4097)]);
        c.name = format!("prefill {label}");
        (c.num_heads, c.num_kv_heads, c.page_size) = (8, 2, 32);
        out.push(c);
    }
    let mut c = base(
        "prefill shared prompt 4 x 256 rows",
        Mask::Causal,
        vec![(256, 1280); 4],
    );
    (c.num_heads, c.num_kv_heads, c.page_size) = (4, 1, 64);
    c.share_prompt = true;
    out.push(c);
    for &(qs, ks, label) in &[(3.0, -3.0, "about -100"), (2.0, 2.0, "about +45")] {
        let mut c = base("", Mask::Causal, vec![(200, 700), (129, 129), (64, 1025)]);
        c.name = format!("prefill logits {label}");
        c.shifts = (qs, ks);
        (c.num_heads, c.num_kv_heads) = (4, 2);
        out.push(c);
    }
    out
}

/// Bad launches come back as errors naming the argument (the host checks of `decode`).
fn validation(gpu: &Gpu) -> Res<Vec<Value>> {
    let s = &gpu.stream;
    let mut ex = Expect::new("decode validation");
    let q = s.alloc_zeros::<u16>(2 * 8 * 128)?;
    let kc = s.alloc_zeros::<u16>(4 * 16 * 2 * 128)?;
    let bt = s.alloc_zeros::<i32>(2 * 4)?;
    let small = s.alloc_zeros::<i32>(1)?;
    let ints = s.alloc_zeros::<i32>(4)?;
    let mut out = s.alloc_zeros::<u16>(2 * 8 * 128)?;
    let mut call = |q_shape: [usize; 3], cu_q: &CudaSlice<i32>, splits: u32| {
        gpu.rt.decode(
            s,
            Decode {
                dtype: DType::Bf16,
                q: &q,
                q_shape,
                k_cache: &kc,
                v_cache: &kc,
                cache_shape: [4, 16, 2, 128],
                out: &mut out,
                lse: None,
                block_table: &bt,
                block_table_shape: [2, 4],
                cu_q,
                kv_len: &ints,
                row_ptr: &ints,
                intervals: &ints,
                max_q_len: 1,
                num_splits: splits,
                workspace: None,
                softmax_scale: 0.1,
            },
        )
    };
    ex.check(
        "cu_q too short",
        "cu_q: the layout spans 3 elements but the buffer holds 1",
        call([2, 8, 128], &small, 1),
    );
    ex.check(
        "q longer than its buffer",
        "q: the layout spans",
        call([3, 8, 128], &ints, 1),
    );
    ex.check(
        "splits without workspace",
        "needs a workspace",
        call([2, 8, 128], &ints, 2),
    );
    Ok(ex.results)
}

/// Decode at serving shapes (`cm_bench::decode`): batch 64, kv_len 8K / 32K / 128K, GQA
/// 32/8, head_dim 128, bf16, page sizes 16 and 64, against the copy bandwidth of the same run.
fn bench(gpu: &Gpu, seed: u64) -> Res<Value> {
    let copy = cm_bench::decode::copy_bandwidth(&gpu.rt, &gpu.stream, 10)?;
    println!("copy bandwidth {copy:.2} TB/s (4 GiB device-to-device, read + write)");
    let mut rows = Vec::new();
    for kv_len in [8192, 32768, 131072] {
        for page_size in [16, 64] {
            let opts = cm_bench::decode::DecodeOptions {
                batch: 64,
                kv_len,
                page_size,
                num_heads: 32,
                num_kv_heads: 8,
                head_dim: 128,
                dtype: DType::Bf16,
                runs: 20,
                seed,
            };
            let m = cm_bench::decode::measure_decode(&gpu.rt, &gpu.stream, opts)?;
            println!(
                "{} decode batch 64 kv_len {kv_len} GQA 32/8 d128 page {page_size} splits {}: err {:.1e} (tol {:.1e}), \
                 {:.3} ms, {:.2} TB/s ({:.0}% of copy), enqueue {:.1} us",
                if m.pass() { "PASS" } else { "FAIL" },
                m.splits,
                m.max_err,
                m.tolerance,
                m.median_ms,
                m.kv_tb_per_s,
                100.0 * m.kv_tb_per_s / copy,
                m.enqueue_us
            );
            rows.push(m.json(copy));
        }
    }
    Ok(json!({"copy_tb_per_s": copy, "decode": rows}))
}

fn main() -> ExitCode {
    let args = match common::parse_args("cm-decode-test", &["--skip-bench", "--bench-only"]) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let seed = args.seed;
    let skip_bench = args.has("--skip-bench");
    let bench_only = args.has("--bench-only");
    common::finish("cm-decode-test", &args, json!({}), |report| {
        let gpu = Gpu::new(report)?;
        let mut rng = Rng(seed);
        let mut pass = true;
        let mut results = Vec::new();
        for c in cases().into_iter().filter(|_| !bench_only) {
            let r = run_case(&gpu, &mut rng, &c).unwrap_or_else(|e| {
                println!("FAIL decode {}: error {e}", c.name);
                json!({"case": c.name, "error": e.to_string(), "pass": false})
            });
            results.push(r);
        }
        pass &= common::record(report, "cases", results);
        if !bench_only {
            pass &= common::record(report, "validation", validation(&gpu)?);
        }
        if !skip_bench {
            let b = bench(&gpu, seed)?;
            pass &= b["decode"]
                .as_array()
                .is_some_and(|rows| rows.iter().all(|r| r["pass"] == json!(true)));
            report["bench"] = b;
        }
        Ok(pass)
    })
}
