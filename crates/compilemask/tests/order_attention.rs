//! Attention is permutation-equivariant: attention with a plan in a token order, on tensors
//! permuted into that order, equals attention with the raster plan on the raster tensors,
//! permuted. Checked on the CPU reference (f64) for random grids, radii, prefixes, tile
//! shapes and patch orders.

use compilemask::{
    attention_forward, AttentionShape, Masks, OrderRequest, PlanOptions, Traversal, Value,
};
use proptest::prelude::*;

const SRC: &str = "param text: int = 4;\nparam n: int = 6;\nparam r: int = 2;\ngrid img = [n, n] at text;\nmask = if q in img then k < text | l2(img) < r else k < kv_len;\n";

fn values(seed: u64, len: usize) -> Vec<f64> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 2001) as f64 / 1000.0 - 1.0
        })
        .collect()
}

fn permute(x: &[f64], order: &[u32], d: usize) -> Vec<f64> {
    order
        .iter()
        .flat_map(|&o| x[o as usize * d..(o as usize + 1) * d].iter().copied())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn ordered_attention_equals_raster(n in 2i64..9, text in 0i64..6, r in 1i64..5, bm in 1u32..20, bn in 1u32..20,
                                       patch in prop::sample::select(vec![[1u32, 2, 3], [1, 4, 2], [1, 3, 1], [1, 8, 8]]),
                                       t in 0usize..3, auto in any::<bool>(), seed in 1u64..u64::MAX) {
        let program = compilemask::compile(SRC).unwrap();
        let len = text + n * n;
        let mut options = PlanOptions::new(len).tile(bm, bn).param("text", Value::Int(text)).param("n", Value::Int(n)).param("r", Value::Int(r));
        let raster = program.plan(&options).unwrap();
        let order = if auto {
            options.order = OrderRequest::Auto;
            program.plan(&options).unwrap().order.unwrap()
        } else {
            let traversal = [Traversal::RowMajor, Traversal::Boustrophedon, Traversal::Hilbert][t];
            program.grid_order(&options, patch, traversal).unwrap()
        };
        options.order = OrderRequest::Explicit(order.order.clone());
        let permuted = program.plan(&options).unwrap();
        prop_assert_eq!(permuted.visible_pairs(), raster.visible_pairs());
        let d = 5;
        let l = len as usize;
        let shape = AttentionShape { batch: 1, num_heads: 1, num_kv_heads: 1, q_len: l, kv_len: l, head_dim: d, head_dim_v: d };
        let (q, k, v) = (values(seed, l * d), values(seed ^ 0x55, l * d), values(seed ^ 0xAA, l * d));
        let want = attention_forward(&shape, &q, &k, &v, &Masks::shared(&raster.masks[0].rows), 0.4).unwrap();
        let got = attention_forward(&shape, &permute(&q, &order.order, d), &permute(&k, &order.order, d), &permute(&v, &order.order, d), &Masks::shared(&permuted.masks[0].rows), 0.4).unwrap();
        let want_out = permute(&want.out, &order.order, d);
        for (a, b) in got.out.iter().zip(&want_out) {
            prop_assert!((a - b).abs() < 1e-12, "{} vs {}", a, b);
        }
        let want_lse = permute(&want.lse, &order.order, 1);
        for (a, b) in got.lse.iter().zip(&want_lse) {
            prop_assert!((a - b).abs() < 1e-12 || (a.is_infinite() && b.is_infinite()), "lse {} vs {}", a, b);
        }
    }
}

/// `--order auto` reports: raster as the real patch `[1, 1, width]`, candidates distinct
/// and clipped to the grid, and an order that describes raster when raster wins.
#[test]
fn auto_order_candidates_are_distinct_and_raster_is_described() {
    let program = compilemask::compile(SRC).unwrap();
    for (n, tile) in [(3i64, 16u32), (6, 4), (9, 2), (12, 3)] {
        let len = 4 + n * n;
        let mut options = PlanOptions::new(len)
            .tile(tile, tile)
            .param("n", Value::Int(n));
        options.order = OrderRequest::Auto;
        let plan = program.plan(&options).unwrap();
        let order = plan.order.as_ref().unwrap();
        let w = n as u32;
        let cands = &plan.order_candidates;
        let mut keys: Vec<_> = cands
            .iter()
            .map(|c| (c.patch, format!("{:?}", c.traversal)))
            .collect();
        let all = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), all, "n = {n}: duplicate candidates");
        assert!(cands
            .iter()
            .all(|c| c.patch.iter().all(|&e| (1..=w).contains(&e))));
        let raster = cands
            .iter()
            .find(|c| c.patch == [1, 1, w] && c.traversal == Traversal::RowMajor)
            .expect("raster is a candidate");
        assert_eq!(raster.computed_pairs, plan.raster_computed_pairs);
        assert_eq!(cands[0].computed_pairs, plan.computed_pairs());
        assert!(order.patch.is_some() && order.traversal.is_some());
        if plan.computed_pairs() == plan.raster_computed_pairs {
            // Raster won (ties go to raster): the identity, described as raster.
            assert_eq!(order.patch, Some([1, 1, w]), "n = {n}");
            assert_eq!(order.traversal, Some(Traversal::RowMajor));
            assert!(order.order.iter().enumerate().all(|(i, &o)| o == i as u32));
        } else {
            let p = order.patch.unwrap();
            let chosen = program
                .grid_order(&options, p, order.traversal.unwrap())
                .unwrap();
            assert_eq!(chosen.order, order.order);
        }
    }
}
