//! The interval-driven reference against an independent dense float64 masked softmax, for random
//! inputs and masks with odd sizes, GQA/MQA, `head_dim != head_dim_v`, multi-interval rows and
//! empty rows; gradients also against finite differences; and every error path.

mod common;

use cm_plan::RowIntervals;
use cm_reference::{
    attention_backward, attention_forward, AttentionShape, Gradients, Masks, ReferenceError,
};
use common::{
    assert_no_nan, causal_mask, dense, dense_visible, max_abs_diff, random_mask, to_f32, to_f64,
    Dense, Rng,
};

/// `(batch, num_heads, num_kv_heads, q_len, kv_len, head_dim, head_dim_v)`.
type Config = (usize, usize, usize, usize, usize, usize, usize);

const CONFIGS: &[Config] = &[
    (2, 4, 2, 1, 5, 8, 5),   // GQA 4/2, a single query row
    (2, 4, 1, 7, 13, 8, 5),  // MQA 4/1
    (1, 4, 2, 33, 40, 3, 6), // GQA, head_dim < head_dim_v
    (2, 2, 2, 33, 9, 6, 4),  // MHA, q_len > kv_len
    (1, 4, 1, 7, 1, 5, 3),   // a single key
    (1, 2, 1, 7, 0, 4, 2),   // no keys at all: every row is empty
];

fn shape_of(c: Config) -> AttentionShape {
    let (batch, num_heads, num_kv_heads, q_len, kv_len, head_dim, head_dim_v) = c;
    AttentionShape {
        batch,
        num_heads,
        num_kv_heads,
        q_len,
        kv_len,
        head_dim,
        head_dim_v,
    }
}

struct Case {
    shape: AttentionShape,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    dout: Vec<f64>,
    masks: Vec<RowIntervals>,
    /// Flat `[batch, num_heads]` index into `masks`.
    index: Vec<usize>,
    scale: f64,
}

impl Case {
    fn random(rng: &mut Rng, c: Config) -> Case {
        let s = shape_of(c);
        // Fewer masks than (batch, head) pairs, so some pairs share one and some differ.
        let masks: Vec<RowIntervals> = (0..3)
            .map(|_| random_mask(rng, s.q_len, s.kv_len, 20))
            .collect();
        let index = (0..s.batch * s.num_heads)
            .map(|_| rng.below(3) as usize)
            .collect();
        Case {
            q: rng.vec(s.batch * s.num_heads * s.q_len * s.head_dim),
            k: rng.vec(s.batch * s.num_kv_heads * s.kv_len * s.head_dim),
            v: rng.vec(s.batch * s.num_kv_heads * s.kv_len * s.head_dim_v),
            dout: rng.vec(s.batch * s.num_heads * s.q_len * s.head_dim_v),
            masks,
            index,
            scale: 1.5 / (s.head_dim as f64).sqrt(),
            shape: s,
        }
    }

    fn mask_refs(&self) -> Vec<&RowIntervals> {
        self.masks.iter().collect()
    }

    fn per_pair(&self) -> Vec<&RowIntervals> {
        self.index.iter().map(|&i| &self.masks[i]).collect()
    }

    /// The crate's float64 gradients at the case's inputs and scale, over `sel`.
    fn backward(&self, sel: &Masks) -> Gradients<f64> {
        attention_backward(
            &self.shape,
            &self.q,
            &self.k,
            &self.v,
            &self.dout,
            sel,
            self.scale,
        )
        .unwrap()
    }

    /// The dense float64 reference at the case's inputs, each (b, h) under its own mask, at
    /// `scale`.
    fn dense(&self, scale: f64) -> Dense {
        dense(
            &self.shape,
            &self.q,
            &self.k,
            &self.v,
            &self.dout,
            &self.per_pair(),
            scale,
        )
    }

    /// Keys (flat `[batch, num_kv_heads, kv_len]`) that no query row of their group sees.
    fn unseen_keys(&self) -> Vec<usize> {
        let s = &self.shape;
        let group = s.num_heads / s.num_kv_heads;
        let mut seen = vec![false; s.batch * s.num_kv_heads * s.kv_len];
        for b in 0..s.batch {
            for h in 0..s.num_heads {
                let vis = dense_visible(&self.masks[self.index[b * s.num_heads + h]]);
                for row in &vis {
                    for (j, &x) in row.iter().enumerate() {
                        if x {
                            seen[(b * s.num_kv_heads + h / group) * s.kv_len + j] = true;
                        }
                    }
                }
            }
        }
        (0..seen.len()).filter(|&i| !seen[i]).collect()
    }

    /// Query rows (flat `[batch, num_heads, q_len]`) with no visible key.
    fn empty_rows(&self) -> Vec<usize> {
        let s = &self.shape;
        let mut out = Vec::new();
        for (pair, mask) in self.per_pair().into_iter().enumerate() {
            for i in 0..s.q_len {
                if mask.row(i as u32).is_empty() {
                    out.push(pair * s.q_len + i);
                }
            }
        }
        out
    }
}

fn check_contracts(case: &Case, out: &[f64], lse: &[f64], dq: &[f64], dk: &[f64], dv: &[f64]) {
    let s = &case.shape;
    for (name, x) in [
        ("out", out),
        ("lse", lse),
        ("dq", dq),
        ("dk", dk),
        ("dv", dv),
    ] {
        assert_no_nan(name, x);
    }
    for r in case.empty_rows() {
        assert_eq!(lse[r], f64::NEG_INFINITY, "lse of empty row {r}");
        assert!(out[r * s.head_dim_v..(r + 1) * s.head_dim_v]
            .iter()
            .all(|&x| x == 0.0));
        assert!(dq[r * s.head_dim..(r + 1) * s.head_dim]
            .iter()
            .all(|&x| x == 0.0));
    }
    for key in case.unseen_keys() {
        assert!(dk[key * s.head_dim..(key + 1) * s.head_dim]
            .iter()
            .all(|&x| x == 0.0));
        assert!(dv[key * s.head_dim_v..(key + 1) * s.head_dim_v]
            .iter()
            .all(|&x| x == 0.0));
    }
}

#[test]
fn random_masks_cover_multi_interval_and_empty_rows() {
    let mut rng = Rng::new(7);
    let case = Case::random(&mut rng, CONFIGS[2]);
    assert!(case.masks.iter().any(|m| m.max_intervals_per_row() >= 2));
    assert!(case.masks.iter().any(|m| m.empty_rows() >= 1));
}

#[test]
fn f64_matches_dense_reference() {
    let mut rng = Rng::new(1);
    for &c in CONFIGS {
        for _ in 0..2 {
            let case = Case::random(&mut rng, c);
            let masks = case.mask_refs();
            let sel = Masks::indexed(&masks, &case.index);
            let fwd = attention_forward(&case.shape, &case.q, &case.k, &case.v, &sel, case.scale)
                .unwrap();
            let g = case.backward(&sel);
            let want = case.dense(case.scale);
            let tol = 1e-12;
            assert!(max_abs_diff(&fwd.out, &want.out) < tol, "out {c:?}");
            assert!(max_abs_diff(&fwd.lse, &want.lse) < tol, "lse {c:?}");
            assert!(max_abs_diff(&g.dq, &want.dq) < tol, "dq {c:?}");
            assert!(max_abs_diff(&g.dk, &want.dk) < tol, "dk {c:?}");
            assert!(max_abs_diff(&g.dv, &want.dv) < tol, "dv {c:?}");
            check_contracts(&case, &fwd.out, &fwd.lse, &g.dq, &g.dk, &g.dv);
        }
    }
}

#[test]
fn f32_within_spec_of_f64_dense_reference() {
    let mut rng = Rng::new(2);
    for &c in CONFIGS {
        for _ in 0..2 {
            let mut case = Case::random(&mut rng, c);
            // Compare against the float64 reference on the very same (f32-representable) inputs.
            for t in [&mut case.q, &mut case.k, &mut case.v, &mut case.dout] {
                *t = to_f64(&to_f32(t));
            }
            let scale = case.scale as f32;
            let (q, k, v, dout) = (
                to_f32(&case.q),
                to_f32(&case.k),
                to_f32(&case.v),
                to_f32(&case.dout),
            );
            let masks = case.mask_refs();
            let sel = Masks::indexed(&masks, &case.index);
            let fwd = attention_forward(&case.shape, &q, &k, &v, &sel, scale).unwrap();
            let g = attention_backward(&case.shape, &q, &k, &v, &dout, &sel, scale).unwrap();
            let want = case.dense(f64::from(scale));
            let (out, lse) = (to_f64(&fwd.out), to_f64(&fwd.lse));
            let (dq, dk, dv) = (to_f64(&g.dq), to_f64(&g.dk), to_f64(&g.dv));
            assert!(max_abs_diff(&out, &want.out) <= 1e-5, "out {c:?}");
            assert!(max_abs_diff(&lse, &want.lse) <= 1e-5, "lse {c:?}");
            assert!(max_abs_diff(&dq, &want.dq) <= 1e-4, "dq {c:?}");
            assert!(max_abs_diff(&dk, &want.dk) <= 1e-4, "dk {c:?}");
            assert!(max_abs_diff(&dv, &want.dv) <= 1e-4, "dv {c:?}");
            check_contracts(&case, &out, &lse, &dq, &dk, &dv);
        }
    }
}

/// Central differences of `L = sum(out * dout)` computed with the dense reference, so both the
/// crate's backward and the dense analytic backward are checked against the definition.
#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng::new(3);
    let case = Case::random(&mut rng, (1, 4, 2, 7, 9, 4, 3));
    let masks = case.mask_refs();
    let sel = Masks::indexed(&masks, &case.index);
    let per_pair = case.per_pair();
    let g = case.backward(&sel);
    let want = case.dense(case.scale);

    let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
        let r = dense(&case.shape, q, k, v, &case.dout, &per_pair, case.scale);
        r.out.iter().zip(&case.dout).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-6;
    let fd = |which: usize| -> Vec<f64> {
        let base = [&case.q, &case.k, &case.v][which];
        (0..base.len())
            .map(|i| {
                let mut t = [case.q.clone(), case.k.clone(), case.v.clone()];
                t[which][i] += eps;
                let plus = loss(&t[0], &t[1], &t[2]);
                t[which][i] -= 2.0 * eps;
                let minus = loss(&t[0], &t[1], &t[2]);
                (plus - minus) / (2.0 * eps)
            })
            .collect()
    };
    for (which, name, ours, analytic) in [
        (0, "dq", &g.dq, &want.dq),
        (1, "dk", &g.dk, &want.dk),
        (2, "dv", &g.dv, &want.dv),
    ] {
        let numeric = fd(which);
        assert!(
            max_abs_diff(ours, &numeric) < 1e-7,
            "{name} vs finite differences"
        );
        assert!(
            max_abs_diff(analytic, &numeric) < 1e-7,
            "dense {name} vs finite differences"
        );
    }
}

#[test]
fn mask_layouts_agree() {
    let mut rng = Rng::new(4);
    let s = shape_of((2, 4, 2, 7, 11, 4, 4));
    let (q, k, v) = (
        rng.vec(s.batch * s.num_heads * s.q_len * s.head_dim),
        rng.vec(s.batch * s.num_kv_heads * s.kv_len * s.head_dim),
        rng.vec(s.batch * s.num_kv_heads * s.kv_len * s.head_dim_v),
    );
    let m: Vec<RowIntervals> = (0..4).map(|_| random_mask(&mut rng, 7, 11, 10)).collect();
    let run = |sel: &Masks<'_>| attention_forward(&s, &q, &k, &v, sel, 0.5).unwrap();

    let shared = run(&Masks::shared(&m[0]));
    assert_eq!(shared, run(&Masks::indexed(&[&m[0]], &[0; 8])));
    let per_batch = run(&Masks::per_batch(&[&m[0], &m[1]]));
    assert_eq!(
        per_batch,
        run(&Masks::indexed(&[&m[0], &m[1]], &[0, 0, 0, 0, 1, 1, 1, 1]))
    );
    let per_head = run(&Masks::per_head(&[&m[0], &m[1], &m[2], &m[3]]));
    assert_eq!(
        per_head,
        run(&Masks::indexed(
            &[&m[0], &m[1], &m[2], &m[3]],
            &[0, 1, 2, 3, 0, 1, 2, 3]
        ))
    );
    assert_ne!(shared, per_head);
}

/// A one-key band over 200k rows: a dense pass would visit 4e10 pairs and never finish.
#[test]
fn cost_follows_visible_pairs_not_dense_size() {
    let n = 200_000usize;
    let rows: Vec<Vec<(u32, u32)>> = (0..n as u32).map(|i| vec![(i, i + 1)]).collect();
    let mask = RowIntervals::from_rows(n as u32, &rows).unwrap();
    let s = AttentionShape {
        batch: 1,
        num_heads: 1,
        num_kv_heads: 1,
        q_len: n,
        kv_len: n,
        head_dim: 1,
        head_dim_v: 1,
    };
    let q = vec![1.0f32; n];
    let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let fwd = attention_forward(&s, &q, &q, &v, &Masks::shared(&mask), 1.0).unwrap();
    assert_eq!(fwd.out, v);
    assert!(fwd.lse.iter().all(|&x| x == 1.0));
    let g = attention_backward(&s, &q, &q, &v, &q, &Masks::shared(&mask), 1.0).unwrap();
    assert!(g.dq.iter().all(|&x| x == 0.0));
    assert!(g.dv.iter().all(|&x| x == 1.0));
}

#[test]
fn zero_batch_gives_empty_outputs() {
    let s = shape_of((0, 2, 1, 3, 4, 2, 2));
    let mask = causal_mask(3, 4);
    let fwd = attention_forward::<f64>(&s, &[], &[], &[], &Masks::per_batch(&[]), 1.0).unwrap();
    assert!(fwd.out.is_empty() && fwd.lse.is_empty());
    let g = attention_backward::<f64>(&s, &[], &[], &[], &[], &Masks::shared(&mask), 1.0).unwrap();
    assert!(g.dq.is_empty() && g.dk.is_empty() && g.dv.is_empty());
}

mod errors {
    use super::*;

    fn setup() -> (AttentionShape, Vec<f64>, Vec<f64>, Vec<f64>, RowIntervals) {
        let s = shape_of((1, 4, 2, 3, 5, 2, 3));
        (
            s,
            vec![0.1; 4 * 3 * 2],
            vec![0.2; 2 * 5 * 2],
            vec![0.3; 2 * 5 * 3],
            causal_mask(3, 5),
        )
    }

    fn fwd_err(s: &AttentionShape, q: &[f64], k: &[f64], v: &[f64], m: &Masks<'_>) -> String {
        let e = attention_forward(s, q, k, v, m, 1.0).unwrap_err();
        e.to_string()
    }

    #[test]
    fn heads_not_divisible() {
        let (mut s, q, k, v, mask) = setup();
        s.num_kv_heads = 3;
        let e = attention_forward(&s, &q, &k, &v, &Masks::shared(&mask), 1.0).unwrap_err();
        assert_eq!(
            e,
            ReferenceError::HeadsNotDivisible {
                num_heads: 4,
                num_kv_heads: 3
            }
        );
        assert!(e.to_string().contains("num_heads = 4"), "{e}");
        s.num_kv_heads = 0;
        let e = attention_forward(&s, &q, &k, &v, &Masks::shared(&mask), 1.0).unwrap_err();
        assert!(matches!(e, ReferenceError::ZeroHeads { .. }));
    }

    #[test]
    fn slice_lengths_name_tensor_and_dims() {
        let (s, q, k, v, mask) = setup();
        let m = Masks::shared(&mask);
        let msg = fwd_err(&s, &q[1..], &k, &v, &m);
        assert_eq!(
            msg,
            "q has 23 elements, expected 24 = [batch, num_heads, q_len, head_dim]"
        );
        assert!(fwd_err(&s, &q, &k[1..], &v, &m).starts_with("k has 19 elements, expected 20"));
        let msg = fwd_err(&s, &q, &k, &v[1..], &m);
        assert!(
            msg.contains("[batch, num_kv_heads, kv_len, head_dim_v]"),
            "{msg}"
        );
        let e = attention_backward(&s, &q, &k, &v, &[0.0; 5], &m, 1.0).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("dout has 5 elements, expected 36"),
            "{e}"
        );
    }

    #[test]
    fn size_overflow_is_an_error() {
        let (mut s, q, k, v, mask) = setup();
        s.batch = usize::MAX / 2;
        let e = attention_forward(&s, &q, &k, &v, &Masks::shared(&mask), 1.0).unwrap_err();
        assert!(matches!(e, ReferenceError::SizeOverflow { .. }), "{e}");
    }

    #[test]
    fn mask_for_other_lengths() {
        let (s, q, k, v, _) = setup();
        let wrong = causal_mask(3, 4);
        let msg = fwd_err(&s, &q, &k, &v, &Masks::shared(&wrong));
        assert!(
            msg.contains("kv_len = 4; expected q_len = 3, kv_len = 5"),
            "{msg}"
        );
        let wrong = causal_mask(2, 5);
        let right = causal_mask(3, 5);
        let msg = fwd_err(
            &s,
            &q,
            &k,
            &v,
            &Masks::per_head(&[&right, &right, &right, &wrong]),
        );
        assert!(
            msg.starts_with("mask 3 (used by batch 0, head 3) has q_len = 2"),
            "{msg}"
        );
    }

    #[test]
    fn mask_selection_errors() {
        let (s, q, k, v, mask) = setup();
        let e =
            attention_forward(&s, &q, &k, &v, &Masks::per_batch(&[&mask, &mask]), 1.0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "per-batch masks: got 2 masks, expected batch = 1"
        );
        let msg = fwd_err(&s, &q, &k, &v, &Masks::per_head(&[&mask]));
        assert_eq!(msg, "per-head masks: got 1 masks, expected num_heads = 4");
        let msg = fwd_err(&s, &q, &k, &v, &Masks::indexed(&[&mask], &[0, 0, 0]));
        assert_eq!(
            msg,
            "mask index map has 3 entries, expected batch * num_heads = 4"
        );
        let msg = fwd_err(&s, &q, &k, &v, &Masks::indexed(&[&mask], &[0, 0, 1, 0]));
        assert_eq!(
            msg,
            "mask index map entry for batch 0, head 2 is 1, but only 1 masks were given"
        );
    }

    #[test]
    fn non_finite_inputs_and_scale() {
        let (s, mut q, k, v, mask) = setup();
        let m = Masks::shared(&mask);
        let e = attention_forward(&s, &q, &k, &v, &m, f64::NAN).unwrap_err();
        assert!(matches!(e, ReferenceError::NonFiniteScale { .. }));
        q[5] = f64::INFINITY;
        assert_eq!(
            fwd_err(&s, &q, &k, &v, &m),
            "q[0, 0, 2, 1] of [batch, num_heads, q_len, head_dim] is inf; inputs must be finite"
        );
        q[5] = 0.0;
        let mut dout = vec![0.0; 36];
        dout[7] = f64::NAN;
        let e = attention_backward(&s, &q, &k, &v, &dout, &m, 1.0).unwrap_err();
        assert_eq!(e.to_string(), "dout[0, 0, 2, 1] of [batch, num_heads, q_len, head_dim_v] is NaN; inputs must be finite");
    }

    #[test]
    fn logit_overflow_is_an_error_not_nan() {
        let (s, q, mut k, v, mask) = setup();
        k.iter_mut().for_each(|x| *x = 1e300);
        let e = attention_forward(&s, &q, &k, &v, &Masks::shared(&mask), 1e10).unwrap_err();
        assert_eq!(
            e,
            ReferenceError::LogitOverflow {
                value: f64::INFINITY,
                dtype: "f64",
                batch: 0,
                head: 0,
                row: 0
            }
        );
    }

    /// A logit that f64 holds but f32 does not is refused for f32 tensors (the lse would be
    /// inf there), and computed for f64 ones.
    #[test]
    fn logit_overflow_follows_the_element_type() {
        let (s, q, k, v, mask) = setup();
        let m = Masks::shared(&mask);
        let wide = |x: &[f64]| x.iter().map(|&a| (a * 1e20) as f32).collect::<Vec<f32>>();
        let narrow = |x: &[f64]| x.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        let e = attention_forward(&s, &wide(&q), &wide(&k), &narrow(&v), &m, 1.0).unwrap_err();
        let ReferenceError::LogitOverflow { value, dtype, .. } = e else {
            panic!("{e}");
        };
        assert_eq!(dtype, "f32");
        assert!((value / 4e38 - 1.0).abs() < 1e-6, "{value}");
        let q64: Vec<f64> = q.iter().map(|a| a * 1e20).collect();
        let k64: Vec<f64> = k.iter().map(|a| a * 1e20).collect();
        let f = attention_forward(&s, &q64, &k64, &v, &m, 1.0).unwrap();
        assert!(f.lse.iter().all(|x| x.is_finite()), "{:?}", f.lse);
    }
}
