//! Attention with score terms against a dense float64 computation written here: visibility
//! from `Bound::visible`, every pair's logit from the statement as written
//! (`Bound::score_at`, the pairwise reference, which shares nothing with the bound
//! `ScoreTerms` the reference reads), the sink from `Bound::sink_at`, the softmax with the
//! sink's logit. Gradients of q, k, v, the bias table and the sinks against central finite
//! differences of that dense forward. Odd lengths, `q_len != kv_len`, MHA / GQA / MQA,
//! rows with no visible key with and without sinks, f32 and f64.

mod common;

use cm_ir::{Bound, Program, Shape};
use cm_plan::{plan, TileShape};
use cm_reference::{
    attention_backward_scored, attention_forward_scored, AttentionShape, Masks, Score,
};
use common::Rng;
use std::collections::BTreeMap;

fn compile(src: &str) -> Program {
    let (p, diags) = cm_stdlib::compile(src);
    p.unwrap_or_else(|| panic!("{src}: {diags:?}"))
}

/// Slopes of power-of-two head counts and these literals are exact in f32, so the dense
/// reference (f64 slopes) and the bound terms (f32) agree to rounding.
const PROGRAMS: &[&str] = &[
    // Everything at once, bottom-right, with two empty rows when q_len = kv_len.
    "tensor rel: [num_heads, 32];\ntensor sinks: [num_heads];\n\
     mask = k <= q + kv_len - q_len - 2;\n\
     score = softcap(score, 4.0) + rel[h][t5_bucket(k - q, 32, 128, false)] \
             - alibi_slopes(num_heads)[h] * (q + kv_len - q_len - k);\n\
     sink = sinks[h];",
    // A table shared by the heads over clipped distances, no sink, rows that see nothing.
    "tensor rel: [9];\nmask = k < q - 1 | k == kv_len - 1 & q > 3;\n\
     score = score + rel[min(max(q - k, -4), 4) + 4] + 0.25 * h;",
    // Bidirectional T5 buckets with sinks: rows 0 and 1 see nothing but the sink.
    "tensor rel: [num_heads, 16];\ntensor sinks: [num_heads];\nmask = q >= 2 & k < kv_len;\n\
     score = score + rel[h][t5_bucket(k - q, 16, 32, true)];\nsink = sinks[h];",
    // Sinks only, over a sliding window.
    "tensor sinks: [num_heads];\nmask = q - 2 < k <= q;\nsink = sinks[h];",
];

struct Case {
    shape: AttentionShape,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    dout: Vec<f64>,
    /// The loss's weight on each row's lse (`d loss / d lse`).
    dlse: Vec<f64>,
    table: Vec<f64>,
    sink: Vec<f64>,
}

fn rand_vec(rng: &mut Rng, n: usize, scale: f64) -> Vec<f64> {
    (0..n).map(|_| rng.signed_unit() * scale).collect()
}

fn case(rng: &mut Rng, shape: AttentionShape, table_len: usize) -> Case {
    let s = &shape;
    let nq = s.batch * s.num_heads * s.q_len;
    let nk = s.batch * s.num_kv_heads * s.kv_len;
    Case {
        q: rand_vec(rng, nq * s.head_dim, 1.5),
        k: rand_vec(rng, nk * s.head_dim, 1.5),
        v: rand_vec(rng, nk * s.head_dim_v, 1.0),
        dout: rand_vec(rng, nq * s.head_dim_v, 1.0),
        dlse: rand_vec(rng, nq, 1.0),
        table: rand_vec(rng, table_len, 2.0),
        sink: rand_vec(rng, s.num_heads, 2.0),
        shape,
    }
}

/// Dense forward: `out` and `lse`, from the pairwise semantics only.
fn dense(bound: &Bound<'_>, c: &Case, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let s = &c.shape;
    let group = s.num_heads / s.num_kv_heads;
    let tensors = [("rel", c.table.as_slice()), ("sinks", c.sink.as_slice())];
    let mut out = vec![0.0; s.batch * s.num_heads * s.q_len * s.head_dim_v];
    let mut lse = vec![f64::NEG_INFINITY; s.batch * s.num_heads * s.q_len];
    for b in 0..s.batch {
        for h in 0..s.num_heads {
            let kvh = h / group;
            let sink = bound.sink_at(h as i64, &tensors).unwrap();
            for i in 0..s.q_len {
                let row = (b * s.num_heads + h) * s.q_len + i;
                let qi = &c.q[row * s.head_dim..(row + 1) * s.head_dim];
                let mut logits = Vec::new();
                for j in 0..s.kv_len {
                    if !bound
                        .visible(i as i64, j as i64, b as i64, h as i64)
                        .unwrap()
                    {
                        continue;
                    }
                    let kr = (b * s.num_kv_heads + kvh) * s.kv_len + j;
                    let kj = &c.k[kr * s.head_dim..(kr + 1) * s.head_dim];
                    let raw = scale * qi.iter().zip(kj).map(|(x, y)| x * y).sum::<f64>();
                    let s2 = bound
                        .score_at(i as i64, j as i64, b as i64, h as i64, raw, &tensors)
                        .unwrap();
                    logits.push((kr, s2));
                }
                if logits.is_empty() {
                    if let Some(sk) = sink {
                        lse[row] = sk;
                    }
                    continue;
                }
                let total: f64 =
                    logits.iter().map(|(_, x)| x.exp()).sum::<f64>() + sink.map_or(0.0, f64::exp);
                lse[row] = total.ln();
                for (kr, x) in &logits {
                    let p = x.exp() / total;
                    for t in 0..s.head_dim_v {
                        out[row * s.head_dim_v + t] += p * c.v[kr * s.head_dim_v + t];
                    }
                }
            }
        }
    }
    (out, lse)
}

/// `sum(out * dout) + sum(lse * dlse)` over the rows whose lse is finite (an empty row's
/// `-inf` lse is a constant).
fn loss(bound: &Bound<'_>, c: &Case, scale: f64) -> f64 {
    let (out, lse) = dense(bound, c, scale);
    let by_lse: f64 = lse
        .iter()
        .zip(&c.dlse)
        .filter(|(l, _)| l.is_finite())
        .map(|(l, g)| l * g)
        .sum();
    out.iter().zip(&c.dout).map(|(a, b)| a * b).sum::<f64>() + by_lse
}

/// Central finite differences of the dense loss in every element of one tensor.
fn finite_differences(
    bound: &Bound<'_>,
    c: &mut Case,
    scale: f64,
    pick: fn(&mut Case) -> &mut Vec<f64>,
) -> Vec<f64> {
    let eps = 1e-6;
    (0..pick(c).len())
        .map(|i| {
            let x = pick(c)[i];
            pick(c)[i] = x + eps;
            let hi = loss(bound, c, scale);
            pick(c)[i] = x - eps;
            let lo = loss(bound, c, scale);
            pick(c)[i] = x;
            (hi - lo) / (2.0 * eps)
        })
        .collect()
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g == w) || (g - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn forward_and_gradients_match_dense_float64_and_finite_differences() {
    let mut rng = Rng::new(14);
    let tile = TileShape {
        block_m: 4,
        block_n: 4,
    };
    let mut checked = 0;
    for (pi, src) in PROGRAMS.iter().enumerate() {
        let program = compile(src);
        // MHA, GQA and MQA; q_len == kv_len and not, odd lengths.
        for (batch, heads, kv_heads, q_len, kv_len) in
            [(1, 2, 2, 7, 7), (2, 4, 2, 5, 9), (1, 4, 1, 9, 5)]
        {
            let s = Shape {
                q_len: q_len as i64,
                kv_len: kv_len as i64,
                batch: batch as i64,
                num_heads: heads as i64,
            };
            let bound = program.bind(s, &BTreeMap::new()).unwrap();
            let pl = plan(&bound, tile).unwrap();
            let terms = pl.score.as_ref().unwrap();
            let shape = AttentionShape {
                batch,
                num_heads: heads,
                num_kv_heads: kv_heads,
                q_len,
                kv_len,
                head_dim: 3,
                head_dim_v: 2,
            };
            let table_len = terms
                .table
                .as_ref()
                .map_or(0, |t| t.dims(heads).iter().product());
            let mut c = case(&mut rng, shape, table_len);
            let scale = 0.7;
            let masks: Vec<_> = pl.masks.iter().map(|m| &m.rows).collect();
            let index: Vec<usize> = if pl.masks.len() == 1 {
                vec![0; batch * heads]
            } else {
                pl.mask_index.iter().map(|&i| i as usize).collect()
            };
            let score = Score {
                terms,
                table: terms.table.as_ref().map(|_| c.table.as_slice()),
                sink: terms.sink.as_ref().map(|_| c.sink.as_slice()),
            };
            let m = Masks::indexed(&masks, &index);
            let fwd = attention_forward_scored(&shape, &c.q, &c.k, &c.v, &m, scale, Some(&score))
                .unwrap();
            let (out, lse) = dense(&bound, &c, scale);
            let what = format!("program {pi} shape {shape:?}");
            close(&format!("{what} out"), &fwd.out, &out, 1e-9);
            close(&format!("{what} lse"), &fwd.lse, &lse, 1e-9);
            let g = attention_backward_scored(
                &shape,
                &c.q,
                &c.k,
                &c.v,
                &c.dout,
                Some(&c.dlse),
                &m,
                scale,
                Some(&score),
            )
            .unwrap();
            // The f32 path computes in f64 too: the same numbers to f32 rounding.
            let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
            let (q32, k32, v32, d32, l32, t32, s32) = (
                f(&c.q),
                f(&c.k),
                f(&c.v),
                f(&c.dout),
                f(&c.dlse),
                f(&c.table),
                f(&c.sink),
            );
            let score32 = Score {
                terms,
                table: terms.table.as_ref().map(|_| t32.as_slice()),
                sink: terms.sink.as_ref().map(|_| s32.as_slice()),
            };
            let g32 = attention_backward_scored(
                &shape,
                &q32,
                &k32,
                &v32,
                &d32,
                Some(&l32),
                &m,
                0.7f32,
                Some(&score32),
            )
            .unwrap();
            let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
            close(
                &format!("{what} dq f32"),
                &wide(&g32.grads.dq),
                &g.grads.dq,
                1e-4,
            );
            let fd = |c: &mut Case, pick| finite_differences(&bound, c, scale, pick);
            close(
                &format!("{what} dq"),
                &g.grads.dq,
                &fd(&mut c, |c| &mut c.q),
                1e-6,
            );
            close(
                &format!("{what} dk"),
                &g.grads.dk,
                &fd(&mut c, |c| &mut c.k),
                1e-6,
            );
            close(
                &format!("{what} dv"),
                &g.grads.dv,
                &fd(&mut c, |c| &mut c.v),
                1e-6,
            );
            match &g.dtable {
                Some(dt) => close(
                    &format!("{what} dtable"),
                    dt,
                    &fd(&mut c, |c| &mut c.table),
                    1e-6,
                ),
                None => assert!(terms.table.is_none()),
            }
            match &g.dsink {
                Some(ds) => close(
                    &format!("{what} dsink"),
                    ds,
                    &fd(&mut c, |c| &mut c.sink),
                    1e-6,
                ),
                None => assert!(terms.sink.is_none()),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, PROGRAMS.len() * 3);
}

/// Rows with no visible key: output 0; lse -inf without sinks, the head's sink with them;
/// no gradient from them (a sink's gradient comes only from rows with a key).
#[test]
fn empty_rows_with_and_without_sinks() {
    for (src, sinks) in [(PROGRAMS[2], true), (PROGRAMS[1], false)] {
        let program = compile(src);
        let s = Shape {
            q_len: 2,
            kv_len: 3,
            batch: 1,
            num_heads: 2,
        };
        let bound = program.bind(s, &BTreeMap::new()).unwrap();
        let pl = plan(&bound, TileShape::default()).unwrap();
        assert_eq!(pl.empty_rows(), 4, "{src}");
        let terms = pl.score.as_ref().unwrap();
        let shape = AttentionShape {
            batch: 1,
            num_heads: 2,
            num_kv_heads: 1,
            q_len: 2,
            kv_len: 3,
            head_dim: 2,
            head_dim_v: 2,
        };
        let table = vec![0.5; terms.table.as_ref().unwrap().dims(2).iter().product()];
        let sink = [1.25, -0.5];
        let score = Score {
            terms,
            table: Some(&table[..]),
            sink: sinks.then_some(&sink[..]),
        };
        let masks = [&pl.masks[0].rows];
        let m = Masks::indexed(&masks, &[0, 0]);
        let x = [0.3; 8];
        let kv = [0.2; 6];
        let fwd = attention_forward_scored(&shape, &x, &kv, &kv, &m, 1.0, Some(&score)).unwrap();
        assert!(fwd.out.iter().all(|&o| o == 0.0));
        let want = if sinks {
            vec![1.25, 1.25, -0.5, -0.5]
        } else {
            vec![f64::NEG_INFINITY; 4]
        };
        assert_eq!(fwd.lse, want);
        let g = attention_backward_scored(&shape, &x, &kv, &kv, &x, None, &m, 1.0, Some(&score))
            .unwrap();
        assert!(g
            .grads
            .dq
            .iter()
            .chain(&g.grads.dk)
            .chain(&g.grads.dv)
            .all(|&v| v == 0.0));
        assert!(g.dtable.unwrap().iter().all(|&v| v == 0.0));
        assert_eq!(g.dsink, sinks.then(|| vec![0.0, 0.0]));
    }
}

/// A `-inf` sink is no sink: its head's output, lse and gradients are those of the same
/// mask without a sink (rows with no visible key included: lse -inf, never NaN), and its
/// own gradient is 0, while the other head's finite sink still counts. `+inf` is refused.
#[test]
fn a_minus_inf_sink_is_no_sink() {
    let with = compile("tensor sinks: [num_heads];\nmask = q >= 2 & k <= q + 1;\nsink = sinks[h];");
    let without = compile("mask = q >= 2 & k <= q + 1;");
    let s = Shape {
        q_len: 7,
        kv_len: 9,
        batch: 1,
        num_heads: 2,
    };
    let shape = AttentionShape {
        batch: 1,
        num_heads: 2,
        num_kv_heads: 2,
        q_len: 7,
        kv_len: 9,
        head_dim: 3,
        head_dim_v: 2,
    };
    let c = case(&mut Rng::new(11), shape, 0);
    let pw = plan(
        &with.bind(s, &BTreeMap::new()).unwrap(),
        TileShape::default(),
    )
    .unwrap();
    let po = plan(
        &without.bind(s, &BTreeMap::new()).unwrap(),
        TileShape::default(),
    )
    .unwrap();
    let sink = [f64::NEG_INFINITY, 0.75];
    let score = Score {
        terms: pw.score.as_ref().unwrap(),
        table: None,
        sink: Some(&sink[..]),
    };
    let (mw, mo) = ([&pw.masks[0].rows], [&po.masks[0].rows]);
    let (mw, mo) = (Masks::indexed(&mw, &[0, 0]), Masks::indexed(&mo, &[0, 0]));
    let (q, k, v) = (&c.q, &c.k, &c.v);
    let fw = attention_forward_scored(&shape, q, k, v, &mw, 0.5, Some(&score)).unwrap();
    let fo = attention_forward_scored(&shape, q, k, v, &mo, 0.5, None).unwrap();
    let (rows, dv) = (shape.q_len, shape.head_dim_v);
    assert_eq!(fw.out[..rows * dv], fo.out[..rows * dv], "head 0's output");
    assert_eq!(fw.lse[..rows], fo.lse[..rows], "head 0's lse");
    assert_eq!(
        fw.lse[..2],
        [f64::NEG_INFINITY; 2],
        "empty rows keep lse -inf"
    );
    assert_eq!(
        fw.lse[rows..rows + 2],
        [0.75; 2],
        "head 1's sink still counts"
    );
    assert!(fw.out.iter().all(|x| x.is_finite()));
    let dlse = Some(c.dlse.as_slice());
    let gw =
        attention_backward_scored(&shape, q, k, v, &c.dout, dlse, &mw, 0.5, Some(&score)).unwrap();
    let go = attention_backward_scored(&shape, q, k, v, &c.dout, dlse, &mo, 0.5, None).unwrap();
    let dsink = gw.dsink.unwrap();
    assert_eq!(dsink[0], 0.0, "a -inf sink has no gradient");
    assert!(dsink[1].is_finite() && dsink[1] != 0.0);
    let head0 = |g: &[f64], n: usize| g[..n].to_vec();
    let d = shape.head_dim;
    assert_eq!(head0(&gw.grads.dq, rows * d), head0(&go.grads.dq, rows * d));
    assert_eq!(head0(&gw.grads.dk, 9 * d), head0(&go.grads.dk, 9 * d));
    assert_eq!(head0(&gw.grads.dv, 9 * dv), head0(&go.grads.dv, 9 * dv));
    let up = [f64::INFINITY, 0.0];
    let bad = Score {
        sink: Some(&up[..]),
        ..score
    };
    assert_eq!(
        attention_forward_scored(&shape, q, k, v, &mw, 0.5, Some(&bad))
            .unwrap_err()
            .to_string(),
        "sinks[0] of [num_heads] is inf; a sink must be finite, or -inf for no sink"
    );
}

#[test]
fn score_tensors_are_checked() {
    let program = compile(PROGRAMS[0]);
    let s = Shape {
        q_len: 3,
        kv_len: 3,
        batch: 1,
        num_heads: 2,
    };
    let bound = program.bind(s, &BTreeMap::new()).unwrap();
    let pl = plan(&bound, TileShape::default()).unwrap();
    let terms = pl.score.as_ref().unwrap();
    let shape = AttentionShape {
        batch: 1,
        num_heads: 2,
        num_kv_heads: 2,
        q_len: 3,
        kv_len: 3,
        head_dim: 1,
        head_dim_v: 1,
    };
    let masks = [&pl.masks[0].rows];
    let m = Masks::indexed(&masks, &[0, 0]);
    let x = [0.5; 6];
    let table = [0.0; 64];
    let sink = [0.0; 2];
    let run = |table: Option<&[f64]>, sink: Option<&[f64]>, shape: &AttentionShape| {
        let score = Score { terms, table, sink };
        attention_forward_scored(shape, &x, &x, &x, &m, 1.0, Some(&score))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        run(None, Some(&sink), &shape),
        "the score terms read tensor `rel` (bias table), but none was given"
    );
    assert_eq!(
        run(Some(&table[..10]), Some(&sink), &shape),
        "score tensor `rel` has 10 elements, expected 64 = [num_heads, num_buckets] = [2, 32]"
    );
    assert_eq!(
        run(Some(&table), Some(&[0.0; 3]), &shape),
        "score tensor `sinks` has 3 elements, expected 2 = [num_heads] = [2]"
    );
    let nan = [f64::NAN, 0.0];
    assert_eq!(
        run(Some(&table), Some(&nan), &shape),
        "sinks[0] of [num_heads] is NaN; a sink must be finite, or -inf for no sink"
    );
    let none = compile("mask = k <= q;\nscore = score + 1.0;");
    let b = none.bind(s, &BTreeMap::new()).unwrap();
    let p2 = plan(&b, TileShape::default()).unwrap();
    let score = Score {
        terms: p2.score.as_ref().unwrap(),
        table: Some(&table[..]),
        sink: None,
    };
    assert_eq!(
        attention_forward_scored(&shape, &x, &x, &x, &m, 1.0, Some(&score))
            .unwrap_err()
            .to_string(),
        "the score terms do not read tensor `table` (bias table), but one of 64 elements was given"
    );
    let wide = AttentionShape {
        num_heads: 4,
        num_kv_heads: 4,
        ..shape
    };
    let x4 = [0.5; 12];
    let score = Score {
        terms,
        table: Some(&table[..]),
        sink: Some(&sink[..]),
    };
    let m4 = Masks::indexed(&masks, &[0, 0, 0, 0]);
    assert_eq!(
        attention_forward_scored(&wide, &x4, &x4, &x4, &m4, 1.0, Some(&score))
            .unwrap_err()
            .to_string(),
        "the score terms were bound for num_heads = 2, but the shape has 4; plan again for these tensors"
    );
}

/// Terms that are the same for every head (a softcap, a slope that does not read `h`, a
/// table shared by the heads), bound for one head, apply to any head count and give what
/// terms bound for that head count give; a slope that reads `h` is refused instead.
#[test]
fn terms_without_heads_apply_to_every_head() {
    let bind = |src: &str, num_heads: usize| {
        let s = Shape {
            q_len: 5,
            kv_len: 7,
            batch: 1,
            num_heads: num_heads as i64,
        };
        let program = compile(src);
        let bound = program.bind(s, &BTreeMap::new()).unwrap();
        plan(&bound, TileShape::default()).unwrap()
    };
    let shape = AttentionShape {
        batch: 1,
        num_heads: 4,
        num_kv_heads: 2,
        q_len: 5,
        kv_len: 7,
        head_dim: 3,
        head_dim_v: 2,
    };
    let mut rng = Rng::new(41);
    let q = rand_vec(&mut rng, 4 * 5 * 3, 2.0);
    let k = rand_vec(&mut rng, 2 * 7 * 3, 2.0);
    let v = rand_vec(&mut rng, 2 * 7 * 2, 1.0);
    let table = rand_vec(&mut rng, 9, 1.0);
    let shared = "tensor rel: [9];\nmask = k <= q + 2;\n\
                  score = softcap(score, 3.0) - 0.25 * (q - k) + rel[min(max(q - k, -4), 4) + 4];";
    let run = |pl: &cm_plan::Plan| {
        let masks = [&pl.masks[0].rows];
        let m = Masks::indexed(&masks, &[0; 4]);
        let score = Score {
            terms: pl.score.as_ref().unwrap(),
            table: Some(&table[..]),
            sink: None,
        };
        attention_forward_scored(&shape, &q, &k, &v, &m, 0.5, Some(&score))
    };
    let (one, four) = (bind(shared, 1), bind(shared, 4));
    assert!(!one.score.as_ref().unwrap().per_head());
    let (a, b) = (run(&one).unwrap(), run(&four).unwrap());
    assert_eq!((a.out, a.lse), (b.out, b.lse));
    let per_head = "mask = k <= q + 2;\nscore = score - 0.25 * (h + 1) * (q - k);";
    let one = bind(per_head, 1);
    assert!(one.score.as_ref().unwrap().per_head());
    let masks = [&one.masks[0].rows];
    let m = Masks::indexed(&masks, &[0; 4]);
    let score = Score {
        terms: one.score.as_ref().unwrap(),
        table: None,
        sink: None,
    };
    assert_eq!(
        attention_forward_scored(&shape, &q, &k, &v, &m, 0.5, Some(&score))
            .unwrap_err()
            .to_string(),
        "the score terms were bound for num_heads = 1, but the shape has 4; plan again for these tensors"
    );
}
