//! Host-side backward references on the test's inputs: the float64 gradients, and the same
//! gradients computed the way a FlashAttention-style kernel in the input dtype computes them
//! (fp32 scores, sums and accumulators; the forward output, the probabilities fed to dV and dS
//! fed to dQ / dK rounded to the dtype). The error of the latter against float64 stands in for
//! "PyTorch's own attention in the same dtype" in the accuracy rule of design.md.

use cm_cuda::reference::round_to;
use cm_cuda::DType;
use cm_plan::rows::RowIntervals;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Logical shape: Q, dO, dQ `[batch, heads, q_len, head_dim]`; K, V, dK, dV
/// `[batch, kv_heads, kv_len, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
}

/// Row-major logical tensors whose values are exactly representable in the test's dtype.
pub struct Tensors {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub dout: Vec<f64>,
}

/// Gradients, shaped as in [`Shape`].
pub struct Grads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// The float64 gradients and the dtype-emulated ones.
pub struct Reference {
    pub exact: Grads,
    pub emulated: Grads,
}

/// One query row's gradient contributions.
struct RowGrad {
    dq64: Vec<f64>,
    dq_emu: Vec<f64>,
}

/// Per-(batch, head) partial dK / dV (the float64 ones, and the emulation's fp32 sums before the
/// softmax scale and rounding).
struct HeadGrads {
    dq64: Vec<f64>,
    dq_emu: Vec<f64>,
    dk64: Vec<f64>,
    dv64: Vec<f64>,
    dk32: Vec<f32>,
    dv32: Vec<f32>,
}

struct Ctx<'a> {
    shape: Shape,
    x: &'a Tensors,
    mask: &'a RowIntervals,
    scale: f64,
    dtype: DType,
}

impl Ctx<'_> {
    fn q_row(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.shape.heads + h) * self.shape.q_len + i) * self.shape.head_dim
    }

    fn kv_row(&self, b: usize, kvh: usize, j: usize) -> usize {
        ((b * self.shape.kv_heads + kvh) * self.shape.kv_len + j) * self.shape.head_dim
    }

    /// Row `i` of head `(b, h)`; when `acc` is given, its dK / dV contributions are added there.
    fn row(&self, b: usize, h: usize, i: usize, mut acc: Option<&mut HeadGrads>) -> RowGrad {
        let d = self.shape.head_dim;
        let kvh = h / (self.shape.heads / self.shape.kv_heads);
        let qv = &self.x.q[self.q_row(b, h, i)..][..d];
        let dov = &self.x.dout[self.q_row(b, h, i)..][..d];
        let keys: Vec<usize> = self
            .mask
            .row(i as u32)
            .iter()
            .flat_map(|iv| iv.start as usize..iv.end as usize)
            .collect();
        let mut out = RowGrad {
            dq64: vec![0.0; d],
            dq_emu: vec![0.0; d],
        };
        if keys.is_empty() {
            return out;
        }
        let kv = |j: usize| &self.x.k[self.kv_row(b, kvh, j)..][..d];
        let vv = |j: usize| &self.x.v[self.kv_row(b, kvh, j)..][..d];
        let scale32 = self.scale as f32;
        let s64: Vec<f64> = keys
            .iter()
            .map(|&j| self.scale * qv.iter().zip(kv(j)).map(|(a, b)| a * b).sum::<f64>())
            .collect();
        let s32: Vec<f32> = keys
            .iter()
            .map(|&j| {
                qv.iter()
                    .zip(kv(j))
                    .fold(0f32, |acc, (a, b)| acc + (*a as f32) * (*b as f32))
                    * scale32
            })
            .collect();

        // float64.
        let m64 = s64.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let l64: f64 = s64.iter().map(|s| (s - m64).exp()).sum();
        let p64: Vec<f64> = s64.iter().map(|s| (s - m64).exp() / l64).collect();
        let dp64: Vec<f64> = keys
            .iter()
            .map(|&j| dov.iter().zip(vv(j)).map(|(a, b)| a * b).sum::<f64>())
            .collect();
        let delta64: f64 = p64.iter().zip(&dp64).map(|(p, dp)| p * dp).sum();

        // Emulated: the forward output as the dtype kernel stores it, then the backward.
        let m32 = s32.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let l32: f32 = s32.iter().map(|s| (s - m32).exp()).sum();
        let lse32 = m32 + l32.ln();
        let mut o32 = vec![0f32; d];
        for (t, &j) in keys.iter().enumerate() {
            let pr = round_to(self.dtype, (s32[t] - m32).exp());
            for (o, x) in o32.iter_mut().zip(vv(j)) {
                *o += pr * *x as f32;
            }
        }
        let delta32: f32 = o32
            .iter()
            .zip(dov)
            .map(|(o, g)| round_to(self.dtype, o / l32) * *g as f32)
            .sum();
        let mut dq32 = vec![0f32; d];

        for (t, &j) in keys.iter().enumerate() {
            let ds64 = p64[t] * (dp64[t] - delta64);
            for (g, x) in out.dq64.iter_mut().zip(kv(j)) {
                *g += self.scale * ds64 * x;
            }
            let p32 = (s32[t] - lse32).exp();
            let dp32 = dov
                .iter()
                .zip(vv(j))
                .fold(0f32, |acc, (a, b)| acc + (*a as f32) * (*b as f32));
            let ds_r = round_to(self.dtype, p32 * (dp32 - delta32));
            let p_r = round_to(self.dtype, p32);
            for (g, x) in dq32.iter_mut().zip(kv(j)) {
                *g += ds_r * *x as f32;
            }
            if let Some(acc) = acc.as_deref_mut() {
                let at = j * d;
                for c in 0..d {
                    acc.dk64[at + c] += self.scale * ds64 * qv[c];
                    acc.dv64[at + c] += p64[t] * dov[c];
                    acc.dk32[at + c] += ds_r * qv[c] as f32;
                    acc.dv32[at + c] += p_r * dov[c] as f32;
                }
            }
        }
        for (e, g) in out.dq_emu.iter_mut().zip(&dq32) {
            *e = f64::from(round_to(self.dtype, g * scale32));
        }
        out
    }

    fn head(&self, b: usize, h: usize) -> HeadGrads {
        let (d, sq, skv) = (self.shape.head_dim, self.shape.q_len, self.shape.kv_len);
        let mut acc = HeadGrads {
            dq64: vec![0.0; sq * d],
            dq_emu: vec![0.0; sq * d],
            dk64: vec![0.0; skv * d],
            dv64: vec![0.0; skv * d],
            dk32: vec![0.0; skv * d],
            dv32: vec![0.0; skv * d],
        };
        for i in 0..sq {
            let r = self.row(b, h, i, Some(&mut acc));
            acc.dq64[i * d..][..d].copy_from_slice(&r.dq64);
            acc.dq_emu[i * d..][..d].copy_from_slice(&r.dq_emu);
        }
        acc
    }
}

/// Runs `f` over `0..n` on all cores and returns the results in index order.
fn parallel<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let mut parts: Vec<(usize, T)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.min(n.max(1)))
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        done.push((i, f(i)));
                    }
                    done
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("reference worker"))
            .collect()
    });
    parts.sort_by_key(|(i, _)| *i);
    parts.into_iter().map(|(_, t)| t).collect()
}

/// Both references for every row and key, on all cores.
pub fn compute(
    shape: Shape,
    x: &Tensors,
    mask: &RowIntervals,
    scale: f64,
    dtype: DType,
) -> Reference {
    let ctx = Ctx {
        shape,
        x,
        mask,
        scale,
        dtype,
    };
    let heads = parallel(shape.batch * shape.heads, |bh| {
        ctx.head(bh / shape.heads, bh % shape.heads)
    });
    let (d, sq, skv) = (shape.head_dim, shape.q_len, shape.kv_len);
    let group = shape.heads / shape.kv_heads;
    let kv_elems = shape.batch * shape.kv_heads * skv * d;
    let mut exact = Grads {
        dq: Vec::with_capacity(shape.batch * shape.heads * sq * d),
        dk: vec![0.0; kv_elems],
        dv: vec![0.0; kv_elems],
    };
    let mut emulated = Grads {
        dq: Vec::with_capacity(exact.dq.capacity()),
        dk: vec![0.0; kv_elems],
        dv: vec![0.0; kv_elems],
    };
    let (mut dk32, mut dv32) = (vec![0f32; kv_elems], vec![0f32; kv_elems]);
    for (bh, hg) in heads.iter().enumerate() {
        exact.dq.extend_from_slice(&hg.dq64);
        emulated.dq.extend_from_slice(&hg.dq_emu);
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        let at = (b * shape.kv_heads + h / group) * skv * d;
        for c in 0..skv * d {
            exact.dk[at + c] += hg.dk64[c];
            exact.dv[at + c] += hg.dv64[c];
            dk32[at + c] += hg.dk32[c];
            dv32[at + c] += hg.dv32[c];
        }
    }
    let scale32 = scale as f32;
    for c in 0..kv_elems {
        emulated.dk[c] = f64::from(round_to(dtype, dk32[c] * scale32));
        emulated.dv[c] = f64::from(round_to(dtype, dv32[c]));
    }
    Reference { exact, emulated }
}

/// dQ of selected rows only (float64, emulated), `[batch, heads, rows.len(), head_dim]`: what
/// a long-sequence benchmark can afford to check.
pub fn dq_rows(
    shape: Shape,
    x: &Tensors,
    mask: &RowIntervals,
    scale: f64,
    dtype: DType,
    rows: &[u32],
) -> (Vec<f64>, Vec<f64>) {
    let ctx = Ctx {
        shape,
        x,
        mask,
        scale,
        dtype,
    };
    let n = rows.len();
    let per = parallel(shape.batch * shape.heads * n, |item| {
        let (bh, r) = (item / n, item % n);
        ctx.row(bh / shape.heads, bh % shape.heads, rows[r] as usize, None)
    });
    let (mut exact, mut emulated) = (Vec::new(), Vec::new());
    for r in per {
        exact.extend(r.dq64);
        emulated.extend(r.dq_emu);
    }
    (exact, emulated)
}
