//! Attention over a packed (cu_seqlens) plan equals each sample's own attention,
//! concatenated (float64): forward output and lse, and the gradients of q, k and v. Samples
//! of different query and key lengths, empty samples, GQA, masks that read `b` and `h`.

mod common;

use cm_ir::{Shape, Value};
use cm_plan::{plan, plan_packed, Packing, RowIntervals, TileShape};
use cm_reference::{attention_backward, attention_forward, AttentionShape, Masks};
use common::{assert_no_nan, max_abs_diff, Rng};
use std::collections::BTreeMap;

/// Rows `r0 .. r0 + n` of every head of a `[heads, rows, d]` tensor.
fn gather(x: &[f64], heads: usize, rows: usize, d: usize, r0: usize, n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(heads * n * d);
    for h in 0..heads {
        let base = (h * rows + r0) * d;
        out.extend_from_slice(&x[base..base + n * d]);
    }
    out
}

/// Writes a `[heads, n, d]` block into rows `r0 .. r0 + n` of a `[heads, rows, d]` tensor.
#[allow(clippy::too_many_arguments)]
fn scatter(dst: &mut [f64], src: &[f64], heads: usize, rows: usize, d: usize, r0: usize, n: usize) {
    for h in 0..heads {
        let base = (h * rows + r0) * d;
        dst[base..base + n * d].copy_from_slice(&src[h * n * d..(h + 1) * n * d]);
    }
}

struct Case {
    source: &'static str,
    params: Vec<(&'static str, Value)>,
    lengths: Vec<(i64, i64)>,
    heads: (usize, usize),
    dims: (usize, usize),
    tile: TileShape,
}

fn run(case: &Case, seed: u64) {
    let (ir, diags) =
        cm_stdlib::compile(cm_stdlib::get(case.source).map_or(case.source, |b| b.source));
    let program = ir.unwrap_or_else(|| panic!("{}: {diags:?}", case.source));
    let values: BTreeMap<String, Value> = case
        .params
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let (mut cu_q, mut cu_k) = (vec![0i64], vec![0i64]);
    for &(lq, lk) in &case.lengths {
        cu_q.push(cu_q[cu_q.len() - 1] + lq);
        cu_k.push(cu_k[cu_k.len() - 1] + lk);
    }
    let (hq, hk) = case.heads;
    let (d, dv) = case.dims;
    let packing = Packing::new(&cu_q, &cu_k).unwrap();
    let packed = plan_packed(&program, &packing, hq as i64, &values, case.tile).unwrap();
    let (tq, tk) = (packed.q_len as usize, packed.kv_len as usize);
    let shape = AttentionShape {
        batch: 1,
        num_heads: hq,
        num_kv_heads: hk,
        q_len: tq,
        kv_len: tk,
        head_dim: d,
        head_dim_v: dv,
    };
    let mut rng = Rng::new(seed);
    let (q, k, v) = (
        rng.vec(hq * tq * d),
        rng.vec(hk * tk * d),
        rng.vec(hk * tk * dv),
    );
    let dout = rng.vec(hq * tq * dv);
    let scale = 0.7;
    let masks: Vec<&RowIntervals> = packed.masks.iter().map(|m| &m.rows).collect();
    let index: Vec<usize> = packed.mask_index.iter().map(|&i| i as usize).collect();
    let masks = Masks::indexed(&masks, &index);
    let fwd = attention_forward(&shape, &q, &k, &v, &masks, scale).unwrap();
    let grads = attention_backward(&shape, &q, &k, &v, &dout, &masks, scale).unwrap();
    assert_no_nan("out", &fwd.out);
    assert_no_nan("dq", &grads.dq);

    // Each sample on its own, written into packed-shaped buffers.
    let mut out = vec![f64::NAN; hq * tq * dv];
    let mut lse = vec![f64::NAN; hq * tq];
    let mut dq = vec![f64::NAN; hq * tq * d];
    let mut dk = vec![f64::NAN; hk * tk * d];
    let mut dvv = vec![f64::NAN; hk * tk * dv];
    let batch = case.lengths.len();
    for (b, &(lq, lk)) in case.lengths.iter().enumerate() {
        let (q0, k0) = (cu_q[b] as usize, cu_k[b] as usize);
        let (lq, lk) = (lq as usize, lk as usize);
        let own: Vec<RowIntervals> = if lq == 0 {
            vec![RowIntervals::from_rows(lk as u32, &[]).unwrap(); hq]
        } else if lk == 0 {
            vec![RowIntervals::from_rows(0, &vec![vec![]; lq]).unwrap(); hq]
        } else {
            let bound = program
                .bind(
                    Shape {
                        q_len: lq as i64,
                        kv_len: lk as i64,
                        batch: batch as i64,
                        num_heads: hq as i64,
                    },
                    &values,
                )
                .unwrap();
            let p = plan(&bound, case.tile).unwrap();
            let b = if program.uses_b { b as u32 } else { 0 };
            (0..hq as u32)
                .map(|h| {
                    let h = if program.uses_h { h } else { 0 };
                    p.mask(b, h).rows.clone()
                })
                .collect()
        };
        let refs: Vec<&RowIntervals> = own.iter().collect();
        let idx: Vec<usize> = (0..hq).collect();
        let s = AttentionShape {
            q_len: lq,
            kv_len: lk,
            ..shape
        };
        let (qb, kb, vb) = (
            gather(&q, hq, tq, d, q0, lq),
            gather(&k, hk, tk, d, k0, lk),
            gather(&v, hk, tk, dv, k0, lk),
        );
        let m = Masks::indexed(&refs, &idx);
        let f = attention_forward(&s, &qb, &kb, &vb, &m, scale).unwrap();
        let g = attention_backward(
            &s,
            &qb,
            &kb,
            &vb,
            &gather(&dout, hq, tq, dv, q0, lq),
            &m,
            scale,
        )
        .unwrap();
        scatter(&mut out, &f.out, hq, tq, dv, q0, lq);
        scatter(&mut lse, &f.lse, hq, tq, 1, q0, lq);
        scatter(&mut dq, &g.dq, hq, tq, d, q0, lq);
        scatter(&mut dk, &g.dk, hk, tk, d, k0, lk);
        scatter(&mut dvv, &g.dv, hk, tk, dv, k0, lk);
    }
    let name = case.source;
    for (what, got, want, tol) in [
        ("out", &fwd.out, &out, 1e-12),
        ("lse", &fwd.lse, &lse, 1e-12),
        ("dq", &grads.dq, &dq, 1e-11),
        ("dk", &grads.dk, &dk, 1e-11),
        ("dv", &grads.dv, &dvv, 1e-11),
    ] {
        let err = max_abs_diff(got, want);
        assert!(
            err <= tol,
            "{name} {:?}: packed {what} differs from the per-sample {what} by {err}",
            case.lengths
        );
    }
}

#[test]
fn packed_attention_equals_per_sample_attention() {
    let t = |m, n| TileShape {
        block_m: m,
        block_n: n,
    };
    let cases = [
        Case {
            source: "causal",
            params: vec![],
            lengths: vec![(5, 5), (7, 7), (1, 1), (33, 33)],
            heads: (2, 2),
            dims: (8, 8),
            tile: t(16, 16),
        },
        Case {
            source: "causal_bottom_right",
            params: vec![],
            lengths: vec![(3, 9), (0, 4), (6, 2), (5, 0), (0, 0), (12, 12)],
            heads: (4, 2),
            dims: (6, 5),
            tile: t(4, 8),
        },
        Case {
            source: "document_causal",
            params: vec![("lengths", Value::Array(vec![3, 0, 5].into()))],
            lengths: vec![(17, 17), (9, 9), (17, 17)],
            heads: (3, 1),
            dims: (4, 4),
            tile: t(128, 128),
        },
        Case {
            // Per-head windows (GQA groups whose heads differ), bottom-right aligned.
            source: "mask = q + kv_len - q_len - 2 * h - 1 <= k & k <= q + kv_len - q_len;",
            params: vec![],
            lengths: vec![(8, 11), (2, 2), (0, 3), (20, 14)],
            heads: (4, 2),
            dims: (5, 7),
            tile: t(3, 5),
        },
        Case {
            // Reads b: each sample its own cutoff.
            source:
                "param n: [int] = [0, 3, 9];\nmask = if q < n[b % 3] then k <= q else k < kv_len;",
            params: vec![],
            lengths: vec![(6, 6), (6, 6), (10, 4), (4, 10)],
            heads: (1, 1),
            dims: (3, 3),
            tile: t(8, 8),
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        run(case, 0x5eed + i as u64);
    }
}
