//! Host-side backward references for checking the GPU backward: the float64 gradients, and
//! the same gradients computed the way a FlashAttention-style kernel in the input dtype
//! computes them (fp32 scores, sums and accumulators; the forward output, the probabilities
//! fed to dV and dS fed to dQ / dK rounded to the dtype). The error of the latter against
//! float64 stands in for "PyTorch's own attention in the same dtype" in the accuracy rule of
//! docs/design.md: a kernel's gradient passes when its error is at most twice that plus 1e-3
//! ([`TensorCheck`]).
//!
//! Three entry points: [`compute`] (every row and key: the small-size tests of `cm-bwd-test`),
//! [`dq_rows`] (dQ of sampled rows, from scratch) and [`dkdv_keys`] (dK and dV of sampled keys
//! from the forward's own lse and output, so that a long sequence costs only the rows that see
//! those keys).
//!
//! Shapes are [`Shape`]'s: Q, dQ `[batch, heads, q_len, head_dim]`; dO and the forward's
//! output `[batch, heads, q_len, head_dim_v]`; K, dK `[batch, kv_heads, kv_len, head_dim]`; V,
//! dV `[batch, kv_heads, kv_len, head_dim_v]`.

use crate::reference::{round_to, tolerance, Shape};
use cm_cuda::DType;
use cm_plan::rows::RowIntervals;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Row-major logical tensors whose values are exactly representable in the test's dtype,
/// shaped as in [`Shape`] (`v` and `dout` at `head_dim_v`).
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

/// Per-(batch, head) dQ and partial dK / dV (the float64 ones, and the emulation's fp32 sums
/// before the softmax scale and rounding): dQ `[q_len, head_dim]`, dK `[kv_len, head_dim]`,
/// dV `[kv_len, head_dim_v]`.
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
    /// Index of row `i` of head `(b, h)` in a `[batch, heads, q_len, width]` tensor.
    fn q_row(&self, b: usize, h: usize, i: usize, width: usize) -> usize {
        ((b * self.shape.heads + h) * self.shape.q_len + i) * width
    }

    /// Index of key `j` of kv head `(b, kvh)` in a `[batch, kv_heads, kv_len, width]` tensor.
    fn kv_row(&self, b: usize, kvh: usize, j: usize, width: usize) -> usize {
        ((b * self.shape.kv_heads + kvh) * self.shape.kv_len + j) * width
    }

    /// Row `i` of head `(b, h)`; when `acc` is given, its dK / dV contributions are added there.
    fn row(&self, b: usize, h: usize, i: usize, mut acc: Option<&mut HeadGrads>) -> RowGrad {
        let (d, dvw) = (self.shape.head_dim, self.shape.head_dim_v);
        let kvh = h / (self.shape.heads / self.shape.kv_heads);
        let qv = &self.x.q[self.q_row(b, h, i, d)..][..d];
        let dov = &self.x.dout[self.q_row(b, h, i, dvw)..][..dvw];
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
        let kv = |j: usize| &self.x.k[self.kv_row(b, kvh, j, d)..][..d];
        let vv = |j: usize| &self.x.v[self.kv_row(b, kvh, j, dvw)..][..dvw];
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
        let mut o32 = vec![0f32; dvw];
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
                for (c, &qc) in qv.iter().enumerate() {
                    acc.dk64[at + c] += self.scale * ds64 * qc;
                    acc.dk32[at + c] += ds_r * qc as f32;
                }
                let at = j * dvw;
                for (c, &g) in dov.iter().enumerate() {
                    acc.dv64[at + c] += p64[t] * g;
                    acc.dv32[at + c] += p_r * g as f32;
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
        let dvw = self.shape.head_dim_v;
        let mut acc = HeadGrads {
            dq64: vec![0.0; sq * d],
            dq_emu: vec![0.0; sq * d],
            dk64: vec![0.0; skv * d],
            dv64: vec![0.0; skv * dvw],
            dk32: vec![0.0; skv * d],
            dv32: vec![0.0; skv * dvw],
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
    let (d, dvw, sq, skv) = (shape.head_dim, shape.head_dim_v, shape.q_len, shape.kv_len);
    let group = shape.heads / shape.kv_heads;
    let (k_elems, v_elems) = (
        shape.batch * shape.kv_heads * skv * d,
        shape.batch * shape.kv_heads * skv * dvw,
    );
    let mut exact = Grads {
        dq: Vec::with_capacity(shape.batch * shape.heads * sq * d),
        dk: vec![0.0; k_elems],
        dv: vec![0.0; v_elems],
    };
    let mut emulated = Grads {
        dq: Vec::with_capacity(exact.dq.capacity()),
        dk: vec![0.0; k_elems],
        dv: vec![0.0; v_elems],
    };
    let (mut dk32, mut dv32) = (vec![0f32; k_elems], vec![0f32; v_elems]);
    for (bh, hg) in heads.iter().enumerate() {
        exact.dq.extend_from_slice(&hg.dq64);
        emulated.dq.extend_from_slice(&hg.dq_emu);
        let (b, h) = (bh / shape.heads, bh % shape.heads);
        let kv_head = b * shape.kv_heads + h / group;
        let at = kv_head * skv * d;
        for c in 0..skv * d {
            exact.dk[at + c] += hg.dk64[c];
            dk32[at + c] += hg.dk32[c];
        }
        let at = kv_head * skv * dvw;
        for c in 0..skv * dvw {
            exact.dv[at + c] += hg.dv64[c];
            dv32[at + c] += hg.dv32[c];
        }
    }
    let scale32 = scale as f32;
    for (e, g) in emulated.dk.iter_mut().zip(&dk32) {
        *e = f64::from(round_to(dtype, g * scale32));
    }
    for (e, g) in emulated.dv.iter_mut().zip(&dv32) {
        *e = f64::from(round_to(dtype, *g));
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

/// The forward's results the backward starts from, logical row-major: the output
/// `[batch, heads, q_len, head_dim_v]` (values of the dtype) and the natural-log lse
/// `[batch, heads, q_len]` (`-inf` for a row with no visible key).
pub struct ForwardResult<'a> {
    pub out: &'a [f64],
    pub lse: &'a [f64],
}

/// dK and dV of selected keys, `[batch, kv_heads, keys.len(), head_dim]` and
/// `[batch, kv_heads, keys.len(), head_dim_v]`.
pub struct KeyGrads {
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// dK and dV of the keys `keys` of every (batch, kv head), summed over the query heads of
/// each group: `(float64, dtype-emulated)`. Unlike
/// [`compute`] it takes the row statistics from `fwd` (the forward kernel's lse, and its
/// output for `delta = rowsum(dO * O)`), exactly what the backward kernels start from, so
/// each key costs only the rows that see it, whatever the sequence length. The forward's own
/// accuracy is checked separately (sampled rows against [`crate::reference::compute`]).
pub fn dkdv_keys(
    shape: Shape,
    x: &Tensors,
    mask: &RowIntervals,
    scale: f64,
    dtype: DType,
    keys: &[u32],
    fwd: &ForwardResult<'_>,
) -> (KeyGrads, KeyGrads) {
    let (d, dvw, sq) = (shape.head_dim, shape.head_dim_v, shape.q_len);
    let group = shape.heads / shape.kv_heads;
    // delta per (batch, head, row), float64 and as the kernel sums it (fp32 over dtype values).
    let rows_total = shape.batch * shape.heads * sq;
    let (mut delta64, mut delta32) = (vec![0f64; rows_total], vec![0f32; rows_total]);
    for r in 0..rows_total {
        let (o, g) = (&fwd.out[r * dvw..][..dvw], &x.dout[r * dvw..][..dvw]);
        delta64[r] = o.iter().zip(g).map(|(a, b)| a * b).sum();
        delta32[r] = o
            .iter()
            .zip(g)
            .fold(0f32, |acc, (a, b)| acc + (*a as f32) * (*b as f32));
    }
    let seen_by: Vec<Vec<usize>> = keys.iter().map(|&j| rows_seeing(mask, j)).collect();
    let n = keys.len();
    let scale32 = scale as f32;
    let per = parallel(shape.batch * shape.kv_heads * n, |item| {
        let (bk, t) = (item / n, item % n);
        let (b, kvh) = (bk / shape.kv_heads, bk % shape.kv_heads);
        let j = keys[t] as usize;
        let kv_at = (b * shape.kv_heads + kvh) * shape.kv_len + j;
        let (kj, vj) = (&x.k[kv_at * d..][..d], &x.v[kv_at * dvw..][..dvw]);
        let (mut dk64, mut dv64) = (vec![0f64; d], vec![0f64; dvw]);
        let (mut dk32, mut dv32) = (vec![0f32; d], vec![0f32; dvw]);
        for h in kvh * group..(kvh + 1) * group {
            for &i in &seen_by[t] {
                let r = (b * shape.heads + h) * sq + i;
                let (qi, gi) = (&x.q[r * d..][..d], &x.dout[r * dvw..][..dvw]);
                let lse = fwd.lse[r];
                let s64 = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                let dp64: f64 = gi.iter().zip(vj).map(|(a, b)| a * b).sum();
                let p64 = (s64 - lse).exp();
                let ds64 = p64 * (dp64 - delta64[r]);
                let dot32 = |a: &[f64], b: &[f64]| {
                    a.iter()
                        .zip(b)
                        .fold(0f32, |acc, (x, y)| acc + (*x as f32) * (*y as f32))
                };
                let p32 = (dot32(qi, kj) * scale32 - lse as f32).exp();
                let ds_r = round_to(dtype, p32 * (dot32(gi, vj) - delta32[r]));
                let p_r = round_to(dtype, p32);
                for c in 0..d {
                    dk64[c] += scale * ds64 * qi[c];
                    dk32[c] += ds_r * qi[c] as f32;
                }
                for c in 0..dvw {
                    dv64[c] += p64 * gi[c];
                    dv32[c] += p_r * gi[c] as f32;
                }
            }
        }
        let dk_emu = dk32
            .iter()
            .map(|&g| f64::from(round_to(dtype, g * scale32)));
        let dv_emu = dv32.iter().map(|&g| f64::from(round_to(dtype, g)));
        (
            dk64,
            dv64,
            dk_emu.collect::<Vec<_>>(),
            dv_emu.collect::<Vec<_>>(),
        )
    });
    let mut exact = KeyGrads {
        dk: Vec::with_capacity(per.len() * d),
        dv: Vec::with_capacity(per.len() * dvw),
    };
    let mut emulated = KeyGrads {
        dk: Vec::with_capacity(per.len() * d),
        dv: Vec::with_capacity(per.len() * dvw),
    };
    for (dk64, dv64, dk_emu, dv_emu) in per {
        exact.dk.extend(dk64);
        exact.dv.extend(dv64);
        emulated.dk.extend(dk_emu);
        emulated.dv.extend(dv_emu);
    }
    (exact, emulated)
}

/// The query rows of `mask` that see key `key`, ascending.
pub fn rows_seeing(mask: &RowIntervals, key: u32) -> Vec<usize> {
    (0..mask.q_len())
        .filter(|&i| {
            let row = mask.row(i);
            let at = row.partition_point(|iv| iv.end <= key);
            row.get(at).is_some_and(|iv| iv.start <= key)
        })
        .map(|i| i as usize)
        .collect()
}

/// Errors of one gradient tensor against the references.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TensorCheck {
    /// Largest |kernel - float64| over the checked values.
    pub max_err: f64,
    /// Largest |emulated - float64|: the dtype's own error, which sets the tolerance.
    pub emulated_err: f64,
    /// Largest |float64| (the gradients' scale).
    pub max_ref: f64,
    /// NaN values among the checked ones.
    pub nan: usize,
    /// Rows that must be exactly 0 (empty query rows for dQ, unseen keys for dK / dV) but
    /// are not.
    pub zero_rows_wrong: usize,
}

impl TensorCheck {
    /// [`crate::reference::tolerance`] of the emulation's error: twice it plus 1e-3.
    pub fn tolerance(&self) -> f64 {
        tolerance(self.emulated_err)
    }

    pub fn pass(&self) -> bool {
        self.nan == 0 && self.zero_rows_wrong == 0 && self.max_err <= self.tolerance()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"max_abs_err": self.max_err, "emulated_dtype_err": self.emulated_err,
               "tolerance": self.tolerance(), "max_abs_ref": self.max_ref, "nan": self.nan,
               "zero_rows_wrong": self.zero_rows_wrong, "pass": self.pass()})
    }
}

/// Compares `got` (logical) with `exact` / `emulated`, row by row of `d` values (the tensor's
/// width: `head_dim` for dQ / dK, `head_dim_v` for dV);
/// `zero_row(r)` says whether row `r` must be exactly 0.
pub fn check_tensor(
    got: &[f64],
    exact: &[f64],
    emulated: &[f64],
    d: usize,
    zero_row: impl Fn(usize) -> bool,
) -> TensorCheck {
    let mut c = TensorCheck::default();
    for (r, ((g, e), m)) in got
        .chunks(d)
        .zip(exact.chunks(d))
        .zip(emulated.chunks(d))
        .enumerate()
    {
        let must_be_zero = zero_row(r);
        let mut row_wrong = false;
        for ((&g, &e), &m) in g.iter().zip(e).zip(m) {
            if g.is_nan() {
                c.nan += 1;
                continue;
            }
            row_wrong |= must_be_zero && g != 0.0;
            c.max_err = c.max_err.max((g - e).abs());
            c.emulated_err = c.emulated_err.max((m - e).abs());
            c.max_ref = c.max_ref.max(e.abs());
        }
        c.zero_rows_wrong += usize::from(row_wrong);
    }
    c
}

/// The checks of dQ, dK and dV of one backward.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradCheck {
    pub dq: TensorCheck,
    pub dk: TensorCheck,
    pub dv: TensorCheck,
}

impl GradCheck {
    pub fn pass(&self) -> bool {
        self.dq.pass() && self.dk.pass() && self.dv.pass()
    }

    /// NaN values in the three tensors' checked values.
    pub fn nan(&self) -> usize {
        self.dq.nan + self.dk.nan + self.dv.nan
    }

    pub fn zero_rows_wrong(&self) -> usize {
        self.dq.zero_rows_wrong + self.dk.zero_rows_wrong + self.dv.zero_rows_wrong
    }

    /// `dq 1.2e-3/4.0e-3 dk ... dv ...` (error / tolerance).
    pub fn describe(&self) -> String {
        format!(
            "dq {:.2e}/{:.2e} dk {:.2e}/{:.2e} dv {:.2e}/{:.2e} (err/tol)",
            self.dq.max_err,
            self.dq.tolerance(),
            self.dk.max_err,
            self.dk.tolerance(),
            self.dv.max_err,
            self.dv.tolerance()
        )
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"dq": self.dq.json(), "dk": self.dk.json(), "dv": self.dv.json(),
                           "pass": self.pass()})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{self, Inputs};
    use crate::{from_bits, random_bits};

    /// A batch-2 GQA problem (4 query heads, 2 KV heads) at `[q_len, kv_len, head_dim,
    /// head_dim_v]`: query row `i` sees the key intervals `row(i)`; Q, K, V and dO are random
    /// values of `dt` from seeds `seed` to `seed + 3`.
    fn problem(
        [sq, skv, d, dvw]: [usize; 4],
        dt: DType,
        seed: u64,
        row: impl Fn(u32) -> Vec<(u32, u32)>,
    ) -> (Shape, RowIntervals, Tensors) {
        let rows: Vec<Vec<(u32, u32)>> = (0..sq as u32).map(row).collect();
        let mask = RowIntervals::from_rows(skv as u32, &rows).unwrap();
        let shape = Shape {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            q_len: sq,
            kv_len: skv,
            head_dim: d,
            head_dim_v: dvw,
        };
        let vals = |n: usize, seed: u64| -> Vec<f64> {
            random_bits(dt, n, seed)
                .iter()
                .map(|&b| from_bits(dt, b))
                .collect()
        };
        let x = Tensors {
            q: vals(2 * 4 * sq * d, seed),
            k: vals(2 * 2 * skv * d, seed + 1),
            v: vals(2 * 2 * skv * dvw, seed + 2),
            dout: vals(2 * 4 * sq * dvw, seed + 3),
        };
        (shape, mask, x)
    }

    /// With the float64 forward's lse and output, the sampled-key gradients are exactly the
    /// full reference's (GQA, empty rows, keys no row sees, q_len != kv_len), and the
    /// emulation stays within a dtype's error of them; with V as wide as Q and K, and narrower
    /// (as the MLA shape's).
    #[test]
    fn sampled_keys_match_the_full_reference() {
        sampled_keys_match_at(16, 16);
        sampled_keys_match_at(24, 16);
    }

    fn sampled_keys_match_at(d: usize, dvw: usize) {
        let (sq, skv) = (150usize, 170usize);
        let dt = DType::Bf16;
        let (shape, mask, x) = problem([sq, skv, d, dvw], dt, 1, |i| match i {
            40..50 => vec![],
            _ => vec![(i.saturating_sub(60), i + 1), (160, 165)],
        });
        let scale = 0.3;
        let full = compute(shape, &x, &mask, scale, dt);
        let all: Vec<u32> = (0..sq as u32).collect();
        let inputs = Inputs {
            q: x.q.clone(),
            k: x.k.clone(),
            v: x.v.clone(),
        };
        let fwd = reference::compute(shape, &inputs, &mask, &all, scale, dt);
        let keys = [0u32, 1, 89, 90, 149, 150, 162, 169];
        let result = ForwardResult {
            out: &fwd.out,
            lse: &fwd.lse,
        };
        let (exact, emulated) = dkdv_keys(shape, &x, &mask, scale, dt, &keys, &result);
        assert_eq!(
            (exact.dk.len(), exact.dv.len(), emulated.dv.len()),
            (
                4 * keys.len() * d,
                4 * keys.len() * dvw,
                4 * keys.len() * dvw
            )
        );
        for bk in 0..2 * 2 {
            for (t, &j) in keys.iter().enumerate() {
                let (want, got) = (bk * skv + j as usize, bk * keys.len() + t);
                for c in 0..d {
                    let want = full.exact.dk[want * d + c];
                    assert!((exact.dk[got * d + c] - want).abs() < 1e-12);
                    assert!((emulated.dk[got * d + c] - want).abs() < 0.05);
                }
                for c in 0..dvw {
                    let want = full.exact.dv[want * dvw + c];
                    assert!((exact.dv[got * dvw + c] - want).abs() < 1e-12);
                    assert!((emulated.dv[got * dvw + c] - want).abs() < 0.05);
                }
            }
        }
        // Keys 150..160 and 165.. are seen by no row: exactly 0 in both.
        let unseen = keys.iter().position(|&j| j == 169).unwrap();
        assert!(rows_seeing(&mask, 169).is_empty() && rows_seeing(&mask, 162).len() == sq - 10);
        let at = unseen * d;
        assert!(exact.dk[at..at + d].iter().all(|&g| g == 0.0));
        let at_v = unseen * dvw;
        assert!(emulated.dv[at_v..at_v + dvw].iter().all(|&g| g == 0.0));
        // The checker: the emulation against float64 passes by construction, a perturbed
        // gradient does not, and a nonzero unseen key is caught.
        let chk = check_tensor(&emulated.dk, &exact.dk, &emulated.dk, d, |r| {
            r % 8 == unseen
        });
        assert!(chk.pass() && chk.max_err == chk.emulated_err && chk.max_err > 0.0);
        let mut bad = emulated.dk.clone();
        bad[at] = 1e-3;
        let chk = check_tensor(&bad, &exact.dk, &emulated.dk, d, |r| r % 8 == unseen);
        assert_eq!(chk.zero_rows_wrong, 1);
        bad[at] = 0.0;
        bad[0] += 1.0;
        assert!(!check_tensor(&bad, &exact.dk, &emulated.dk, d, |_| false).pass());
    }

    /// At head_dim 24 / head_dim_v 16 (V, dO and dV narrower than Q and K, GQA, empty rows,
    /// unseen keys) the float64 gradients of [`compute`] and [`dq_rows`] are cm-reference's
    /// `attention_backward`, an independent implementation, and the emulation is within a
    /// dtype's error of them.
    #[test]
    fn unequal_head_dims_match_cm_reference() {
        let (sq, skv, d, dvw) = (40usize, 50usize, 24usize, 16usize);
        let dt = DType::F16;
        let (shape, mask, x) = problem([sq, skv, d, dvw], dt, 5, |i| match i {
            10..13 => vec![],
            _ => vec![(i.saturating_sub(9), i + 1), (45, 48)],
        });
        let scale = 0.2;
        let full = compute(shape, &x, &mask, scale, dt);
        let want = cm_reference::attention_backward::<f64>(
            &cm_reference::AttentionShape {
                batch: 2,
                num_heads: 4,
                num_kv_heads: 2,
                q_len: sq,
                kv_len: skv,
                head_dim: d,
                head_dim_v: dvw,
            },
            &x.q,
            &x.k,
            &x.v,
            &x.dout,
            &cm_reference::Masks::shared(&mask),
            scale,
        )
        .unwrap();
        for (what, got, emu, want) in [
            ("dq", &full.exact.dq, &full.emulated.dq, &want.dq),
            ("dk", &full.exact.dk, &full.emulated.dk, &want.dk),
            ("dv", &full.exact.dv, &full.emulated.dv, &want.dv),
        ] {
            assert_eq!(got.len(), want.len(), "{what}");
            assert_eq!(emu.len(), want.len(), "{what}");
            let max_ref = want.iter().fold(0f64, |m, g| m.max(g.abs()));
            assert!(max_ref > 0.1, "{what}: {max_ref}");
            for (i, ((g, e), w)) in got.iter().zip(emu.iter()).zip(want.iter()).enumerate() {
                assert!((g - w).abs() < 1e-12, "{what}[{i}]: {g} vs {w}");
                assert!((e - w).abs() < 0.05, "{what}[{i}] emulated: {e} vs {w}");
            }
        }
        // Sampled rows (an empty one among them) give the same dQ rows.
        let sel = [0u32, 11, 39];
        let (dq64, dq_emu) = dq_rows(shape, &x, &mask, scale, dt, &sel);
        for bh in 0..2 * 4 {
            for (t, &i) in sel.iter().enumerate() {
                let got = (bh * sel.len() + t) * d;
                let at = (bh * sq + i as usize) * d;
                assert_eq!(&dq64[got..got + d], &full.exact.dq[at..at + d]);
                assert_eq!(&dq_emu[got..got + d], &full.emulated.dq[at..at + d]);
            }
        }
        assert!(dq64[d..2 * d].iter().all(|&g| g == 0.0));
    }
}
