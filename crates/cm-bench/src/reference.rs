//! Host-side reference attention for checking the GPU kernels on selected rows: the float64
//! answer, and the same attention computed the way a FlashAttention-style kernel in the input
//! dtype computes it (fp32 scores and sums, probabilities and output rounded to the dtype).
//! The error of the latter against float64 stands in for "PyTorch's own attention in the same
//! dtype" in the accuracy rule of docs/design.md: a kernel passes when its error is at most twice
//! that plus 1e-3 ([`tolerance`]).

use cm_cuda::DType;
use cm_plan::rows::RowIntervals;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Logical shape: Q `[batch, heads, q_len, head_dim]`, K `[batch, kv_heads, kv_len, head_dim]`,
/// V `[batch, kv_heads, kv_len, head_dim_v]`, the output `[batch, heads, q_len, head_dim_v]`.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
    /// Columns of V and of the output.
    pub head_dim_v: usize,
}

/// Row-major logical tensors whose values are exactly representable in the test's dtype:
/// `q` is `[batch, heads, q_len, head_dim]`, `k` `[batch, kv_heads, kv_len, head_dim]` and `v`
/// `[batch, kv_heads, kv_len, head_dim_v]`.
pub struct Inputs {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
}

/// Reference results for the selected rows of every (batch, head).
pub struct Expected {
    /// float64 attention output, `[batch, heads, rows.len(), head_dim_v]`; 0 for an empty row.
    pub out: Vec<f64>,
    /// float64 natural-log log-sum-exp of the scaled scores, `[batch, heads, rows.len()]`;
    /// `-inf` for an empty row.
    pub lse: Vec<f64>,
    /// The dtype-emulated output, shaped as `out`.
    pub emulated: Vec<f64>,
}

/// The largest output error a kernel may have, given the largest error of the dtype-emulated
/// attention against float64 on the same rows.
pub fn tolerance(emulated_err: f64) -> f64 {
    2.0 * emulated_err + 1e-3
}

/// `x` rounded to the nearest value of `dtype` (ties to even).
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::Bf16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
    }
}

/// One computed row: item index, float64 output, dtype-emulated output, float64 lse.
type RowResult = (usize, Vec<f64>, Vec<f64>, f64);

/// Computes both references for `rows_sel` (query row indices) of every (batch, head), on all
/// cores; `scale` multiplies `q . k` before the softmax.
pub fn compute(
    shape: Shape,
    x: &Inputs,
    mask: &RowIntervals,
    rows_sel: &[u32],
    scale: f64,
    dtype: DType,
) -> Expected {
    let (d, dv) = (shape.head_dim, shape.head_dim_v);
    let group = shape.heads / shape.kv_heads;
    let n_rows = rows_sel.len();
    let items = shape.batch * shape.heads * n_rows;
    let mut out = vec![0.0; items * dv];
    let mut emulated = vec![0.0; items * dv];
    let mut lse = vec![f64::NEG_INFINITY; items];
    // One (batch, head, row) per step: rows of long masks are heavy and few.
    const CHUNK: usize = 1;
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let pieces: Vec<Vec<RowResult>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    let (mut s64, mut s32) = (Vec::new(), Vec::new());
                    loop {
                        let start = next.fetch_add(CHUNK, Ordering::Relaxed);
                        if start >= items {
                            break;
                        }
                        for item in start..(start + CHUNK).min(items) {
                            let (bh, r) = (item / n_rows, item % n_rows);
                            let (b, h) = (bh / shape.heads, bh % shape.heads);
                            let i = rows_sel[r] as usize;
                            let kvh = h / group;
                            let qv = &x.q[((b * shape.heads + h) * shape.q_len + i) * d..][..d];
                            let key_row = |j: usize, width: usize| {
                                ((b * shape.kv_heads + kvh) * shape.kv_len + j) * width
                            };
                            s64.clear();
                            s32.clear();
                            for iv in mask.row(i as u32) {
                                for j in iv.start as usize..iv.end as usize {
                                    let kj = &x.k[key_row(j, d)..][..d];
                                    s64.push(
                                        qv.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale,
                                    );
                                    let dot32 = qv
                                        .iter()
                                        .zip(kj)
                                        .fold(0f32, |acc, (a, b)| acc + (*a as f32) * (*b as f32));
                                    s32.push(dot32 * scale as f32);
                                }
                            }
                            let (mut o64, mut o_emu, mut row_lse) =
                                (vec![0.0; dv], vec![0.0; dv], f64::NEG_INFINITY);
                            if !s64.is_empty() {
                                let m64 = s64.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                                let m32 = s32.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                                let (mut l64, mut l32) = (0.0f64, 0.0f32);
                                let mut acc32 = vec![0f32; dv];
                                let mut t = 0;
                                for iv in mask.row(i as u32) {
                                    for j in iv.start as usize..iv.end as usize {
                                        let vj = &x.v[key_row(j, dv)..][..dv];
                                        let p64 = (s64[t] - m64).exp();
                                        let p32 = (s32[t] - m32).exp();
                                        let p_rounded = round_to(dtype, p32);
                                        t += 1;
                                        l64 += p64;
                                        l32 += p32;
                                        for c in 0..dv {
                                            o64[c] += p64 * vj[c];
                                            acc32[c] += p_rounded * vj[c] as f32;
                                        }
                                    }
                                }
                                for c in 0..dv {
                                    o64[c] /= l64;
                                    o_emu[c] = f64::from(round_to(dtype, acc32[c] / l32));
                                }
                                row_lse = m64 + l64.ln();
                            }
                            done.push((item, o64, o_emu, row_lse));
                        }
                    }
                    done
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("reference worker"))
            .collect()
    });
    for (item, o64, o_emu, row_lse) in pieces.into_iter().flatten() {
        out[item * dv..][..dv].copy_from_slice(&o64);
        emulated[item * dv..][..dv].copy_from_slice(&o_emu);
        lse[item] = row_lse;
    }
    Expected { out, lse, emulated }
}
