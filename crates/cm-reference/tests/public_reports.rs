//! Cases of docs/public-reports.md that the CPU reference must pass: the empty-row
//! contract (FM-01), extreme logits without sentinels (FM-03), the LSE contract (FM-04) and the
//! GQA head mapping (GQ-01).

mod common;

use cm_plan::RowIntervals;
use cm_reference::{attention_backward, attention_forward, AttentionShape, Masks};
use common::{assert_no_nan, causal_mask, dense, max_abs_diff, to_f32, to_f64, Rng};

fn mha(q_len: usize, kv_len: usize, heads: usize, head_dim: usize, dv: usize) -> AttentionShape {
    AttentionShape {
        batch: 1,
        num_heads: heads,
        num_kv_heads: heads,
        q_len,
        kv_len,
        head_dim,
        head_dim_v: dv,
    }
}

/// FM-01: a padding row with an all-false mask row must give 0 / -inf, not NaN.
#[test]
fn fm_01_padding_row_empty_mask() {
    let s = mha(6, 10, 2, 8, 8);
    let mut rows: Vec<Vec<(u32, u32)>> = (0..5).map(|i| vec![(0, i + 1)]).collect();
    rows.push(vec![]);
    let mask = RowIntervals::from_rows(10, &rows).unwrap();
    let mut rng = Rng::new(101);
    let (q, k, v, dout) = (
        rng.vec(2 * 6 * 8),
        rng.vec(2 * 10 * 8),
        rng.vec(2 * 10 * 8),
        rng.vec(2 * 6 * 8),
    );
    let (qf, kf, vf, df) = (to_f32(&q), to_f32(&k), to_f32(&v), to_f32(&dout));
    let sel = Masks::shared(&mask);
    let fwd = attention_forward(&s, &qf, &kf, &vf, &sel, 0.125f32).unwrap();
    let g = attention_backward(&s, &qf, &kf, &vf, &df, &sel, 0.125f32).unwrap();
    let want = dense(
        &s,
        &to_f64(&qf),
        &to_f64(&kf),
        &to_f64(&vf),
        &to_f64(&df),
        &[&mask, &mask],
        0.125,
    );

    for x in [&fwd.out, &fwd.lse, &g.dq, &g.dk, &g.dv] {
        assert!(x.iter().all(|v| !v.is_nan()));
    }
    for h in 0..2 {
        let row5 = h * 6 + 5;
        assert!(
            fwd.out[row5 * 8..row5 * 8 + 8].iter().all(|&x| x == 0.0),
            "out[{h}, 5]"
        );
        assert_eq!(fwd.lse[row5], f32::NEG_INFINITY, "lse[{h}, 5]");
        assert!(
            g.dq[row5 * 8..row5 * 8 + 8].iter().all(|&x| x == 0.0),
            "dq[{h}, 5]"
        );
        for key in 5..10 {
            let kr = h * 10 + key;
            assert!(
                g.dk[kr * 8..kr * 8 + 8].iter().all(|&x| x == 0.0),
                "dk[{h}, {key}]"
            );
            assert!(
                g.dv[kr * 8..kr * 8 + 8].iter().all(|&x| x == 0.0),
                "dv[{h}, {key}]"
            );
        }
        // Rows 0-4 are finite and match the dense reference.
        assert!(fwd.lse[h * 6..h * 6 + 5].iter().all(|x| x.is_finite()));
    }
    assert!(max_abs_diff(&to_f64(&fwd.out), &want.out) <= 1e-5);
    assert!(max_abs_diff(&to_f64(&fwd.lse), &want.lse) <= 1e-5);
    assert!(max_abs_diff(&to_f64(&g.dq), &want.dq) <= 1e-4);
    assert!(max_abs_diff(&to_f64(&g.dk), &want.dk) <= 1e-4);
    assert!(max_abs_diff(&to_f64(&g.dv), &want.dv) <= 1e-4);
}

/// FM-03 inputs: D = 64, q = e0, k_j = -60000 e0, v_j = e_j, so every logit is -60000 exactly.
fn fm_03_inputs() -> (AttentionShape, Vec<f64>, Vec<f64>, Vec<f64>) {
    let s = mha(1, 4, 1, 64, 4);
    let mut q = vec![0.0; 64];
    q[0] = 1.0;
    let mut k = vec![0.0; 4 * 64];
    let mut v = vec![0.0; 4 * 4];
    for j in 0..4 {
        k[j * 64] = -60000.0;
        v[j * 4 + j] = 1.0;
    }
    (s, q, k, v)
}

/// FM-03: logits far below any finite "minus infinity" sentinel still give the right softmax,
/// and the all-masked call gives 0 / -inf without NaN.
#[test]
fn fm_03_logits_below_sentinel_f64() {
    let (s, q, k, v) = fm_03_inputs();
    let all = RowIntervals::from_rows(4, &[vec![(0, 4)]]).unwrap();
    let fwd = attention_forward(&s, &q, &k, &v, &Masks::shared(&all), 1.0).unwrap();
    assert_eq!(fwd.out, vec![0.25; 4]);
    let expected = -60000.0 + 4f64.ln();
    assert!((fwd.lse[0] - expected).abs() < 1e-9, "lse {}", fwd.lse[0]);
    assert!((fwd.lse[0] - -59998.614).abs() < 1e-3);
    let g = attention_backward(&s, &q, &k, &v, &[1.0; 4], &Masks::shared(&all), 1.0).unwrap();
    // Uniform dout: every dS is 0, so dq and dk vanish and dv = p * dout = 0.25.
    assert!(g.dq.iter().chain(&g.dk).all(|&x| x == 0.0));
    assert_eq!(g.dv, vec![0.25; 16]);

    let none = RowIntervals::from_rows(4, &[vec![]]).unwrap();
    let fwd = attention_forward(&s, &q, &k, &v, &Masks::shared(&none), 1.0).unwrap();
    assert_eq!(fwd.out, vec![0.0; 4]);
    assert_eq!(fwd.lse, vec![f64::NEG_INFINITY]);
    let g = attention_backward(&s, &q, &k, &v, &[1.0; 4], &Masks::shared(&none), 1.0).unwrap();
    assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|&x| x == 0.0));
}

/// FM-03 in f32 (the closest analog of the fp16 report the reference supports).
#[test]
fn fm_03_logits_below_sentinel_f32() {
    let (s, q, k, v) = fm_03_inputs();
    let (q, k, v) = (to_f32(&q), to_f32(&k), to_f32(&v));
    let all = RowIntervals::from_rows(4, &[vec![(0, 4)]]).unwrap();
    let fwd = attention_forward(&s, &q, &k, &v, &Masks::shared(&all), 1.0f32).unwrap();
    assert_eq!(fwd.out, vec![0.25f32; 4]);
    // Computed in f64 and rounded once, so the f32 lse is the correctly rounded value.
    assert_eq!(fwd.lse[0], (-60000.0 + 4f64.ln()) as f32);
    let dout = [0.5f32, -1.0, 2.0, 0.0];
    let g = attention_backward(&s, &q, &k, &v, &dout, &Masks::shared(&all), 1.0).unwrap();
    assert_no_nan("grads", &to_f64(&[g.dq, g.dk, g.dv].concat()));

    let none = RowIntervals::from_rows(4, &[vec![]]).unwrap();
    let fwd = attention_forward(&s, &q, &k, &v, &Masks::shared(&none), 1.0f32).unwrap();
    assert_eq!(fwd.out, vec![0.0f32; 4]);
    assert_eq!(fwd.lse, vec![f32::NEG_INFINITY]);
    let g = attention_backward(&s, &q, &k, &v, &dout, &Masks::shared(&none), 1.0).unwrap();
    assert!(g.dq.iter().chain(&g.dk).chain(&g.dv).all(|&x| x == 0.0));
}

/// Merges two partial results of one row by their lse, the way split-KV consumers do; only
/// used to show that the reference's partial (out, lse) pairs compose.
fn merge(a: (&[f32], f32), b: (&[f32], f32)) -> (Vec<f32>, f32) {
    let m = a.1.max(b.1);
    if m == f32::NEG_INFINITY {
        return (vec![0.0; a.0.len()], f32::NEG_INFINITY);
    }
    let (wa, wb) = ((a.1 - m).exp(), (b.1 - m).exp());
    let out =
        a.0.iter()
            .zip(b.0)
            .map(|(x, y)| (wa * x + wb * y) / (wa + wb))
            .collect();
    (out, m + (wa + wb).ln())
}

/// FM-04: lse is natural log (ln 2 for two equal logits, not the base-2 value 1.0), partial
/// results carry lse 0 / -inf that merge correctly.
#[test]
fn fm_04_lse_contract() {
    let s = mha(1, 2, 1, 4, 2);
    let q = [0.0f32; 4];
    let k = [0.3f32, -1.0, 2.0, 0.5, -0.7, 0.1, 0.9, 4.0];
    let v = [1.0f32, 0.0, 0.0, 1.0];
    let run = |rows: &[Vec<(u32, u32)>]| {
        let mask = RowIntervals::from_rows(2, rows).unwrap();
        attention_forward(&s, &q, &k, &v, &Masks::shared(&mask), 0.5f32).unwrap()
    };

    // (a) one call over both keys.
    let a = run(&[vec![(0, 2)]]);
    assert_eq!(a.out, vec![0.5, 0.5]);
    assert_eq!(a.lse[0], std::f32::consts::LN_2);

    // (b) chunk A = {k0}, chunk B = {k1}.
    let (ca, cb) = (run(&[vec![(0, 1)]]), run(&[vec![(1, 2)]]));
    assert_eq!((ca.out.as_slice(), ca.lse[0]), ([1.0, 0.0].as_slice(), 0.0));
    assert_eq!((cb.out.as_slice(), cb.lse[0]), ([0.0, 1.0].as_slice(), 0.0));
    let (out, lse) = merge((&ca.out, ca.lse[0]), (&cb.out, cb.lse[0]));
    assert_eq!(out, vec![0.5, 0.5]);
    assert_eq!(lse, std::f32::consts::LN_2);

    // (c) the row sees nothing in either chunk.
    let e = run(&[vec![]]);
    assert_eq!(
        (e.out.as_slice(), e.lse[0]),
        ([0.0, 0.0].as_slice(), f32::NEG_INFINITY)
    );
    let (out, lse) = merge((&e.out, e.lse[0]), (&e.out, e.lse[0]));
    assert_eq!((out, lse), (vec![0.0, 0.0], f32::NEG_INFINITY));
}

/// GQ-01: query head h reads kv head h / (Hq / Hkv); GQA/MQA equals MHA with K/V repeated per
/// group, for causal (row 5 of L = 8 sees 6 keys), sliding-window and document masks.
#[test]
fn gq_01_gqa_equals_repeated_kv_mha() {
    let l = 8usize;
    let window: Vec<Vec<(u32, u32)>> = (0..l as u32)
        .map(|i| vec![(i.saturating_sub(2), i + 1)])
        .collect();
    let docs: Vec<Vec<(u32, u32)>> = (0..l as u32)
        .map(|i| vec![if i < 3 { (0, i + 1) } else { (3, i + 1) }])
        .collect();
    let masks = [
        causal_mask(l, l),
        RowIntervals::from_rows(l as u32, &window).unwrap(),
        RowIntervals::from_rows(l as u32, &docs).unwrap(),
    ];
    let causal_row5: u64 = masks[0].row(5).iter().map(|iv| iv.len()).sum();
    assert_eq!(causal_row5, 6);

    let mut rng = Rng::new(55);
    for (hq, hkv) in [(4usize, 1usize), (8, 2)] {
        let group = hq / hkv;
        let (d, dv) = (64, 64);
        let gqa = AttentionShape {
            num_kv_heads: hkv,
            ..mha(l, l, hq, d, dv)
        };
        let q = rng.vec(hq * l * d);
        let k = rng.vec(hkv * l * d);
        let v = rng.vec(hkv * l * dv);
        let dout = rng.vec(hq * l * dv);
        // K/V repeated so MHA head h holds kv head h / group.
        let repeat = |x: &[f64], w: usize| -> Vec<f64> {
            (0..hq)
                .flat_map(|h| x[(h / group) * l * w..(h / group + 1) * l * w].to_vec())
                .collect()
        };
        let (k_rep, v_rep) = (repeat(&k, d), repeat(&v, dv));
        let mha_shape = mha(l, l, hq, d, dv);
        let scale = 0.125;

        for mask in &masks {
            let sel = Masks::shared(mask);
            let g_fwd = attention_forward(&gqa, &q, &k, &v, &sel, scale).unwrap();
            let m_fwd = attention_forward(&mha_shape, &q, &k_rep, &v_rep, &sel, scale).unwrap();
            assert_eq!(g_fwd, m_fwd, "forward, {hq}/{hkv}");

            let g = attention_backward(&gqa, &q, &k, &v, &dout, &sel, scale).unwrap();
            let m = attention_backward(&mha_shape, &q, &k_rep, &v_rep, &dout, &sel, scale).unwrap();
            assert_eq!(g.dq, m.dq);
            // dk/dv of a kv head are the sums over its group of query heads.
            let fold = |x: &[f64], w: usize| -> Vec<f64> {
                let mut out = vec![0.0; hkv * l * w];
                for h in 0..hq {
                    let src = &x[h * l * w..(h + 1) * l * w];
                    let dst = &mut out[(h / group) * l * w..(h / group + 1) * l * w];
                    dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
                }
                out
            };
            assert!(max_abs_diff(&g.dk, &fold(&m.dk, d)) < 1e-12);
            assert!(max_abs_diff(&g.dv, &fold(&m.dv, dv)) < 1e-12);

            let want = dense(&gqa, &q, &k, &v, &dout, &vec![mask; hq], scale);
            assert!(max_abs_diff(&g_fwd.out, &want.out) < 1e-12);
            assert!(max_abs_diff(&g.dk, &want.dk) < 1e-12);
        }
    }
}
