//! Test support: a tiny deterministic RNG, random interval masks, and an independent dense
//! float64 masked-softmax attention (forward and analytic backward) to compare against.
//!
//! The dense reference deliberately shares no code with the crate: it expands every mask into
//! a `q_len x kv_len` boolean matrix, fills hidden logits with `-inf`, and applies the empty-row
//! contract explicitly.

#![allow(dead_code)]
// Each test binary uses a different subset of these helpers.
// Index loops keep the dense reference a literal transcription of the formulas.
#![allow(clippy::needless_range_loop)]

use cm_plan::RowIntervals;
use cm_reference::AttentionShape;

/// SplitMix64: small, fast, and deterministic across platforms.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)`; `n > 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `[-1, 1)`.
    pub fn signed_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.signed_unit()).collect()
    }
}

/// Random maximal intervals per row; a row is empty with probability `empty_pct`%.
pub fn random_rows(
    rng: &mut Rng,
    q_len: usize,
    kv_len: u32,
    empty_pct: u64,
) -> Vec<Vec<(u32, u32)>> {
    (0..q_len)
        .map(|_| {
            let mut row = Vec::new();
            if rng.below(100) < empty_pct {
                return row;
            }
            let mut pos = 0u32;
            loop {
                // A gap of at least 1 after the first interval keeps intervals non-touching.
                let gap = rng.below(4) as u32 + u32::from(!row.is_empty());
                let start = pos + gap;
                if start >= kv_len {
                    break;
                }
                let end = (start + 1 + rng.below(6) as u32).min(kv_len);
                row.push((start, end));
                pos = end;
            }
            row
        })
        .collect()
}

pub fn random_mask(rng: &mut Rng, q_len: usize, kv_len: usize, empty_pct: u64) -> RowIntervals {
    let rows = random_rows(rng, q_len, kv_len as u32, empty_pct);
    RowIntervals::from_rows(kv_len as u32, &rows).expect("valid random mask")
}

/// Top-left causal mask: row `i` sees keys `[0, i]`.
pub fn causal_mask(q_len: usize, kv_len: usize) -> RowIntervals {
    let rows: Vec<Vec<(u32, u32)>> = (0..q_len)
        .map(|i| vec![(0, (i as u32 + 1).min(kv_len as u32))])
        .collect();
    RowIntervals::from_rows(kv_len as u32, &rows).unwrap()
}

/// `q_len x kv_len` visibility matrix expanded from the intervals.
pub fn dense_visible(mask: &RowIntervals) -> Vec<Vec<bool>> {
    (0..mask.q_len())
        .map(|i| {
            let mut vis = vec![false; mask.kv_len() as usize];
            for iv in mask.row(i) {
                for cell in &mut vis[iv.start as usize..iv.end as usize] {
                    *cell = true;
                }
            }
            vis
        })
        .collect()
}

/// Dense float64 results in the crate's layouts.
#[derive(Debug, Clone)]
pub struct Dense {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Dense masked attention, forward and analytic backward; `masks` is flat `[batch, num_heads]`.
pub fn dense(
    s: &AttentionShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    masks: &[&RowIntervals],
    scale: f64,
) -> Dense {
    let (lq, lk, d, dv) = (s.q_len, s.kv_len, s.head_dim, s.head_dim_v);
    let group = s.num_heads / s.num_kv_heads;
    let mut r = Dense {
        out: vec![0.0; s.batch * s.num_heads * lq * dv],
        lse: vec![0.0; s.batch * s.num_heads * lq],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
    };
    for b in 0..s.batch {
        for h in 0..s.num_heads {
            let kh = h / group;
            let vis = dense_visible(masks[b * s.num_heads + h]);
            let qb = (b * s.num_heads + h) * lq;
            let kb = (b * s.num_kv_heads + kh) * lk;
            for i in 0..lq {
                let qi = &q[(qb + i) * d..(qb + i + 1) * d];
                let logits: Vec<f64> = (0..lk)
                    .map(|j| {
                        if vis[i][j] {
                            let kj = &k[(kb + j) * d..(kb + j + 1) * d];
                            scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    // Empty-row contract: out 0, lse -inf, no gradient.
                    r.lse[qb + i] = f64::NEG_INFINITY;
                    continue;
                }
                let e: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let p: Vec<f64> = e.iter().map(|x| x / z).collect();
                r.lse[qb + i] = m + z.ln();
                let oi = &mut r.out[(qb + i) * dv..(qb + i + 1) * dv];
                for j in 0..lk {
                    for c in 0..dv {
                        oi[c] += p[j] * v[(kb + j) * dv + c];
                    }
                }
                let doi = &dout[(qb + i) * dv..(qb + i + 1) * dv];
                let dp: Vec<f64> = (0..lk)
                    .map(|j| (0..dv).map(|c| doi[c] * v[(kb + j) * dv + c]).sum())
                    .collect();
                let delta: f64 = (0..lk).map(|j| p[j] * dp[j]).sum();
                for j in 0..lk {
                    let ds = p[j] * (dp[j] - delta);
                    for c in 0..d {
                        r.dq[(qb + i) * d + c] += scale * ds * k[(kb + j) * d + c];
                        r.dk[(kb + j) * d + c] += scale * ds * qi[c];
                    }
                    for c in 0..dv {
                        r.dv[(kb + j) * dv + c] += p[j] * doi[c];
                    }
                }
            }
        }
    }
    r
}

/// Max abs difference; equal infinities (e.g. `-inf` lse) count as 0, NaN as infinite.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x == y {
                0.0
            } else if x.is_nan() || y.is_nan() {
                f64::INFINITY
            } else {
                (x - y).abs()
            }
        })
        .fold(0.0, f64::max)
}

pub fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

pub fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

pub fn assert_no_nan(name: &str, x: &[f64]) {
    assert!(x.iter().all(|v| !v.is_nan()), "{name} contains NaN");
}
