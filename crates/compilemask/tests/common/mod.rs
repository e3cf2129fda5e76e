//! Shared helpers of the facade's integration tests: brute-force comparison of a plan with
//! the pairwise semantics, an independent dense tile classification, a compact text dump
//! of a plan, and an independent dense float64 attention (forward and analytic backward).

#![allow(dead_code)] // each test binary uses a different subset
#![allow(clippy::needless_range_loop)] // the dense reference transcribes the formulas

use compilemask::{MaskPlan, Plan, PlanOptions, Program, TileDescriptor, Value};

pub fn arr(v: &[i64]) -> Value {
    Value::Array(v.to_vec().into())
}

pub fn compile(src: &str) -> Program {
    compilemask::compile(src).unwrap_or_else(|e| panic!("does not compile:\n{}", e.rendered))
}

pub fn plan(program: &Program, options: &PlanOptions) -> Plan {
    program
        .plan(options)
        .unwrap_or_else(|e| panic!("plan failed:\n{}", program.render_error(&e)))
}

/// The intervals of row `q` of a mask, as pairs.
pub fn row(m: &MaskPlan, q: u32) -> Vec<(u32, u32)> {
    m.rows
        .row_expanded(q)
        .iter()
        .map(|iv| (iv.start, iv.end))
        .collect()
}

/// Every row of `(b, h)` as pairs.
pub fn rows(plan: &Plan, b: u32, h: u32) -> Vec<Vec<(u32, u32)>> {
    let m = plan.mask(b, h);
    (0..plan.q_len).map(|q| row(m, q)).collect()
}

/// A half-open key set from a list of (possibly touching) runs, as maximal intervals.
pub fn set(keys: impl IntoIterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut ks: Vec<u32> = keys.into_iter().collect();
    ks.sort_unstable();
    ks.dedup();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for k in ks {
        match out.last_mut() {
            Some(last) if last.1 == k => last.1 = k + 1,
            _ => out.push((k, k + 1)),
        }
    }
    out
}

/// Checks every row of every (batch, head) against the pairwise semantics
/// (`Program::brute_force_row`), and every tile class and transpose against a dense
/// evaluation. Keep `q_len x kv_len` small.
pub fn check_brute_force(program: &Program, options: &PlanOptions, plan: &Plan) {
    let shape = options.shape();
    assert_eq!(plan.q_len as i64, shape.q_len);
    assert_eq!(plan.kv_len as i64, shape.kv_len);
    for b in 0..shape.batch {
        for h in 0..shape.num_heads {
            let m = plan.mask(b as u32, h as u32);
            m.rows.validate().unwrap();
            let mut dense = vec![false; (shape.q_len * shape.kv_len) as usize];
            for q in 0..shape.q_len {
                let want = program.brute_force_row(options, q, b, h).unwrap();
                assert_eq!(
                    row(m, q as u32),
                    want,
                    "row {q} (b={b}, h={h}) differs from brute force"
                );
                for (s, e) in want {
                    for k in s..e {
                        dense[(q * shape.kv_len) as usize + k as usize] = true;
                    }
                }
            }
            check_tiles(&m.tiles, &dense);
        }
    }
}

/// Tile classes: 'F' full, 'P' partial, '.' empty, from the descriptor's forward lists.
pub fn tile_map(t: &TileDescriptor) -> Vec<Vec<char>> {
    let mut map = vec![vec!['.'; t.num_n_blocks as usize]; t.num_m_blocks as usize];
    for m in 0..t.num_m_blocks as usize {
        let (a, b) = (t.kv_offsets[m] as usize, t.kv_offsets[m + 1] as usize);
        for &n in &t.kv_indices[a..b] {
            assert_eq!(map[m][n as usize], '.', "tile ({m}, {n}) listed twice");
            map[m][n as usize] = 'P';
        }
        let (a, b) = (
            t.full_kv_offsets[m] as usize,
            t.full_kv_offsets[m + 1] as usize,
        );
        for &n in &t.full_kv_indices[a..b] {
            assert_eq!(map[m][n as usize], '.', "tile ({m}, {n}) listed twice");
            map[m][n as usize] = 'F';
        }
    }
    map
}

/// Tile classes, transposes and computed pairs against a dense `[q_len, kv_len]` matrix,
/// classified here independently (edge tiles by their in-range pairs).
pub fn check_tiles(t: &TileDescriptor, dense: &[bool]) {
    let (q_len, kv_len) = (t.q_len, t.kv_len);
    let (bm, bn) = (t.tile.block_m, t.tile.block_n);
    assert_eq!(t.num_m_blocks, q_len.div_ceil(bm));
    assert_eq!(t.num_n_blocks, kv_len.div_ceil(bn));
    let got = tile_map(t);
    let mut computed = 0u64;
    for m in 0..t.num_m_blocks {
        for n in 0..t.num_n_blocks {
            let rows = m * bm..((m + 1) * bm).min(q_len);
            let cols = n * bn..((n + 1) * bn).min(kv_len);
            let (mut any, mut all) = (false, true);
            for q in rows.clone() {
                for k in cols.clone() {
                    let v = dense[(q * kv_len + k) as usize];
                    any |= v;
                    all &= v;
                }
            }
            let want = match (any, all) {
                (false, _) => '.',
                (true, true) => 'F',
                (true, false) => 'P',
            };
            if any {
                computed += u64::from(rows.len() as u32) * u64::from(cols.len() as u32);
            }
            assert_eq!(got[m as usize][n as usize], want, "tile ({m}, {n})");
        }
    }
    assert_eq!(t.computed_pairs, computed, "computed pairs");
    // Transposes hold exactly the forward tiles.
    let mut fwd_p = Vec::new();
    let mut fwd_f = Vec::new();
    for (m, line) in got.iter().enumerate() {
        for (n, &c) in line.iter().enumerate() {
            match c {
                'P' => fwd_p.push((m as u32, n as u32)),
                'F' => fwd_f.push((m as u32, n as u32)),
                _ => {}
            }
        }
    }
    let transposed = |off: &[u32], idx: &[u32]| {
        let mut v: Vec<(u32, u32)> = Vec::new();
        for n in 0..off.len() - 1 {
            let list = &idx[off[n] as usize..off[n + 1] as usize];
            assert!(list.windows(2).all(|w| w[0] < w[1]), "q list not ascending");
            v.extend(list.iter().map(|&m| (m, n as u32)));
        }
        v.sort_unstable();
        v
    };
    assert_eq!(
        transposed(&t.q_offsets, &t.q_indices),
        fwd_p,
        "partial transpose"
    );
    assert_eq!(
        transposed(&t.full_q_offsets, &t.full_q_indices),
        fwd_f,
        "full transpose"
    );
}

/// A compact text dump of one mask: statistics, one line per row, and the tile map.
/// Only semantic outputs: solver internals such as `Plan::pieces` are left out so that
/// the goldens do not churn when the planner changes how it finds the same answer.
pub fn dump(plan: &Plan, b: u32, h: u32) -> String {
    use std::fmt::Write;
    let m = plan.mask(b, h);
    let t = &m.tiles;
    let c = t.counts();
    let mut s = String::new();
    writeln!(
        s,
        "q_len {} kv_len {} tile {}x{}",
        plan.q_len, plan.kv_len, t.tile.block_m, t.tile.block_n
    )
    .unwrap();
    writeln!(
        s,
        "visible_pairs {} empty_rows {} max_intervals_per_row {}",
        m.rows.visible_pairs(),
        m.rows.empty_rows(),
        m.rows.max_intervals_per_row()
    )
    .unwrap();
    writeln!(
        s,
        "tiles full {} partial {} empty {} computed_pairs {}",
        c.full, c.partial, c.empty, t.computed_pairs
    )
    .unwrap();
    writeln!(s, "rows:").unwrap();
    let width = (plan.q_len.max(1) - 1).to_string().len();
    for q in 0..plan.q_len {
        let ivs: Vec<String> = m
            .rows
            .row_expanded(q)
            .iter()
            .map(|iv| format!("[{},{})", iv.start, iv.end))
            .collect();
        let text = if ivs.is_empty() {
            "(empty)".to_string()
        } else {
            ivs.join(" U ")
        };
        writeln!(s, "{q:>width$}: {text}").unwrap();
    }
    writeln!(s, "tiles (query tile per line, key tiles across):").unwrap();
    for (mi, line) in tile_map(t).iter().enumerate() {
        writeln!(s, "{mi:>3} {}", line.iter().collect::<String>()).unwrap();
    }
    s
}

/// Output of the dense float64 reference.
pub struct Dense {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

/// Dense float64 masked attention for batch 1 and one head per mask row set:
/// `q` `[q_len, d]`, `k` `[kv_len, d]`, `v` `[kv_len, dv]`, `vis[q][k]`. Hidden logits are
/// `-inf`; a row with no visible key gives output 0 and lse `-inf`.
pub fn dense_forward(
    vis: &[Vec<bool>],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d: usize,
    dv: usize,
    scale: f64,
) -> Dense {
    let (lq, lk) = (vis.len(), vis.first().map_or(0, Vec::len));
    let mut out = vec![0.0; lq * dv];
    let mut lse = vec![f64::NEG_INFINITY; lq];
    for i in 0..lq {
        let logits: Vec<f64> = (0..lk)
            .map(|j| {
                if vis[i][j] {
                    scale * (0..d).map(|x| q[i * d + x] * k[j * d + x]).sum::<f64>()
                } else {
                    f64::NEG_INFINITY
                }
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue;
        }
        let p: Vec<f64> = logits.iter().map(|&l| (l - m).exp()).collect();
        let z: f64 = p.iter().sum();
        lse[i] = m + z.ln();
        for j in 0..lk {
            for x in 0..dv {
                out[i * dv + x] += p[j] / z * v[j * dv + x];
            }
        }
    }
    Dense { out, lse }
}

/// The visibility matrix of one planned mask.
pub fn visibility(m: &MaskPlan) -> Vec<Vec<bool>> {
    (0..m.rows.q_len())
        .map(|q| {
            (0..m.rows.kv_len())
                .map(|k| m.rows.is_visible(q, k))
                .collect()
        })
        .collect()
}

pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |acc, (x, y)| {
        if x == y {
            acc // equal infinities
        } else {
            acc.max((x - y).abs())
        }
    })
}

/// SplitMix64, deterministic across platforms.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 * 2.0 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.unit()).collect()
    }
}
