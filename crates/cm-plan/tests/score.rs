//! Score terms in plans: a plan carries its bound program's terms; a token order refuses
//! terms that read positions (CM0411) and keeps softcaps and sinks; a packed self-attention
//! plan gives every visible pair its own sample's bias (against each sample's pairwise
//! reference, `Bound::score_at` at local positions), and refuses what has no per-sample
//! meaning: offsets that differ, a bias of q or k alone, terms that differ by sample.

use cm_ir::{Program, Shape};
use cm_plan::{plan, plan_in_order, plan_packed, OrderRequest, Packing, TileShape};
use std::collections::BTreeMap;

fn compile(src: &str) -> Program {
    let (p, diags) = cm_stdlib::compile(src);
    p.unwrap_or_else(|| panic!("{src}: {diags:?}"))
}

const TILE: TileShape = TileShape {
    block_m: 16,
    block_n: 16,
};

fn shape(q_len: i64, kv_len: i64, num_heads: i64) -> Shape {
    Shape {
        q_len,
        kv_len,
        batch: 1,
        num_heads,
    }
}

const ALIBI: &str = "mask = k <= q;\nscore = score - alibi_slopes(num_heads)[h] * (q - k);";
const T5: &str = "tensor rel: [num_heads, 32];\nmask = k < kv_len;\nscore = softcap(score, 30.0) + rel[h][t5_bucket(k - q, 32, 128, true)] - alibi_slopes(num_heads)[h] * (q - k);";
const SINKS: &str = "param window: int = 3;\ntensor sinks: [num_heads];\nmask = q - window < k <= q;\nsink = sinks[h];\nscore = softcap(score, 20);";

#[test]
fn plans_carry_their_bound_terms() {
    let p = compile(ALIBI);
    let b = p.bind(shape(9, 9, 3), &BTreeMap::new()).unwrap();
    let pl = plan(&b, TILE).unwrap();
    assert_eq!(pl.score, b.score);
    assert_eq!(pl.score.unwrap().linear.unwrap().slopes.len(), 3);
    let p = compile("mask = k <= q;");
    let b = p.bind(shape(4, 4, 1), &BTreeMap::new()).unwrap();
    assert!(plan(&b, TILE).unwrap().score.is_none());
}

#[test]
fn token_orders_refuse_positional_terms() {
    let order = OrderRequest::Explicit(vec![1, 0, 3, 2]);
    for src in [ALIBI, T5] {
        let p = compile(src);
        let b = p.bind(shape(4, 4, 2), &BTreeMap::new()).unwrap();
        let e = plan_in_order(&b, TILE, &order).unwrap_err();
        assert_eq!(e.code, "CM0411", "{src}");
        assert!(e.span.is_some());
    }
    let p = compile(SINKS);
    let b = p.bind(shape(4, 4, 2), &BTreeMap::new()).unwrap();
    let pl = plan_in_order(&b, TILE, &order).unwrap();
    assert_eq!(pl.score.unwrap().softcap, Some(20.0));
}

/// Every visible pair of every sample of a packed self-attention plan: the packed terms at
/// packed positions against the sample's own pairwise reference at local positions.
#[test]
fn packed_self_attention_gives_each_pair_its_samples_bias() {
    let table: Vec<f64> = (0..64).map(|i| f64::from(i) * 0.125 - 3.0).collect();
    let tensors = [("rel", table.as_slice())];
    for cu in [
        vec![0i64, 5, 12, 12, 40],
        vec![0, 1],
        vec![0, 130, 131, 200],
    ] {
        let p = compile(T5);
        let packing = Packing::new(&cu, &cu).unwrap();
        let pl = plan_packed(&p, &packing, 2, &BTreeMap::new(), TILE).unwrap();
        let terms = pl.score.clone().unwrap();
        let total = *cu.last().unwrap();
        let tb = terms.table.as_ref().unwrap();
        assert_eq!(tb.bucket.len() as i64, 2 * total - 1);
        for s in 0..cu.len() - 1 {
            let (lo, n) = (cu[s], cu[s + 1] - cu[s]);
            if n == 0 {
                continue;
            }
            let own = p.bind(shape(n, n, 2), &BTreeMap::new()).unwrap();
            for h in 0..2i64 {
                for i in 0..n {
                    for j in 0..n {
                        let raw = ((i * 7 + j * 3) % 11) as f64 - 5.0;
                        let want = own.score_at(i, j, s as i64, h, raw, &tensors).unwrap();
                        let (q, k) = (lo + i, lo + j);
                        let c = f64::from(terms.softcap.unwrap());
                        let got = c * (raw / c).tanh()
                            + terms.linear_bias(q, k, h as usize)
                            + table[tb.index(q as usize, k as usize, h as usize, total as usize)];
                        assert!(
                            (want - got).abs() < 1e-5,
                            "cu {cu:?} sample {s} ({i}, {j}) h {h}: {want} vs {got}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn packed_plans_refuse_terms_without_a_per_sample_meaning() {
    let none = BTreeMap::new();
    let cases: &[(&str, &[i64], &[i64], &str)] = &[
        (ALIBI, &[0, 3, 7], &[0, 4, 7], "the packed samples' query and key offsets differ"),
        (T5, &[0, 3, 7], &[0, 3, 8], "the packed samples' query and key offsets differ"),
        (
            "mask = k <= q;\nscore = score + 0.5 * q;",
            &[0, 3, 7],
            &[0, 3, 7],
            "the bias reads q and k as 1 * q + 0 * k, not as q - k",
        ),
        (
            "mask = k <= q;\nscore = softcap(score, q_len);",
            &[0, 3, 7],
            &[0, 3, 7],
            "sample 1 (q_len 4, kv_len 4) has another softcap than sample 0",
        ),
        (
            "tensor t: [16];\nmask = k <= q;\nscore = score + t[min(q - k + q_len, 15)];",
            &[0, 3, 7],
            &[0, 3, 7],
            "the bucket of distance q - k = -2 is 2 in sample 1 (q_len 4, kv_len 4) but 1 in an earlier sample",
        ),
    ];
    for (src, cq, ck, message) in cases {
        let packing = Packing::new(cq, ck).unwrap();
        let e = plan_packed(&compile(src), &packing, 2, &none, TILE).unwrap_err();
        assert_eq!(e.code, "CM0411", "{src}");
        assert!(e.message.contains(message), "{src}: {}", e.message);
    }
    // Softcaps, sinks and per-head constants have a meaning in any packing, even one where
    // no sample has both queries and keys.
    for (cq, ck) in [
        (vec![0i64, 3, 7], vec![0i64, 5, 6]),
        (vec![0, 3, 3], vec![0, 0, 4]),
    ] {
        let packing = Packing::new(&cq, &ck).unwrap();
        let pl = plan_packed(&compile(SINKS), &packing, 2, &none, TILE).unwrap();
        let t = pl.score.unwrap();
        assert_eq!((t.sink.as_deref(), t.softcap), (Some("sinks"), Some(20.0)));
    }
    let pl = plan_packed(
        &compile("mask = k <= q;\nscore = score + [0.5, 2.0][h];"),
        &Packing::new(&[0, 2, 5], &[0, 4, 5]).unwrap(),
        2,
        &none,
        TILE,
    )
    .unwrap();
    assert_eq!(pl.score.unwrap().linear.unwrap().slopes, [0.5, 2.0]);
}
