//! Token orders: planning in a permuted order is exact, and the cheap cost estimate used to
//! choose an order equals the descriptor's computed pairs.

// Each test binary uses a different subset of the shared helpers.
#[allow(dead_code)]
mod common;
use cm_ir::Value;
use cm_plan::order::{
    computed_pairs_in_order, contiguous_runs, permute_rows, TokenOrder, Traversal, PATCHES_2D,
    PATCHES_3D,
};
use cm_plan::{plan_in_order, OrderRequest, TileDescriptor, TileShape};
use common::*;
use proptest::prelude::*;

fn check_order(
    src: &str,
    q_len: i64,
    values: &[(&str, Value)],
    tile: TileShape,
    patch: [u32; 3],
    traversal: Traversal,
) {
    let program = compile(src);
    let bound = program.bind(shape(q_len, q_len), &params(values)).unwrap();
    let raster = cm_plan::plan(&bound, tile).unwrap();
    let rows = &raster.masks[0].rows;
    let order = TokenOrder::grid(q_len as u32, &bound.grids[0], patch, traversal);
    let mut seen = vec![false; q_len as usize];
    for &o in &order.order {
        assert!(
            !std::mem::replace(&mut seen[o as usize], true),
            "order repeats {o}"
        );
    }
    let permuted = permute_rows(rows, &order);
    permuted.validate().unwrap();
    for i in 0..q_len as u32 {
        let r = order.order[i as usize];
        for j in 0..q_len as u32 {
            assert_eq!(
                permuted.is_visible(i, j),
                rows.is_visible(r, order.order[j as usize]),
                "pair ({i}, {j})"
            );
        }
    }
    let run = contiguous_runs(&order);
    let tiles = TileDescriptor::build(&permuted, tile);
    assert_eq!(
        computed_pairs_in_order(rows, &order, &run, tile),
        tiles.computed_pairs
    );
}

const CLEAR: &str = "param text: int = 5;\nparam n: int = 9;\nparam r: int = 3;\ngrid img = [n, n] at text;\nmask = if q in img then k < text | l2(img) < r else k < kv_len;\n";
const VIDEO: &str = "grid v = [3, 5, 6];\nlet t = v.t(q);\nlet y = v.y(q);\nlet x = v.x(q);\nmask = box(v, t - 1 ..= t + 1, y - 2 ..= y + 2, x - 2 ..= x + 2);\n";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn grid_orders_are_exact(n in 3i64..14, text in 0i64..9, r in 1i64..6, bm in 1u32..40, bn in 1u32..40, p in 0usize..9, t in 0usize..3) {
        let traversal = [Traversal::RowMajor, Traversal::Boustrophedon, Traversal::Hilbert][t];
        check_order(CLEAR, text + n * n, &[("text", Value::Int(text)), ("n", Value::Int(n)), ("r", Value::Int(r))], TileShape { block_m: bm, block_n: bn }, PATCHES_2D[p], traversal);
    }
}

#[test]
fn video_orders_are_exact() {
    for &patch in PATCHES_3D {
        for traversal in [
            Traversal::RowMajor,
            Traversal::Boustrophedon,
            Traversal::Hilbert,
        ] {
            check_order(
                VIDEO,
                90,
                &[],
                TileShape {
                    block_m: 16,
                    block_n: 8,
                },
                patch,
                traversal,
            );
        }
    }
}

#[test]
fn auto_order_halves_clear_work() {
    // W4 at its 32K grid (180): the chosen order computes at most half the raster pairs.
    let program = builtin("clear");
    let bound = program
        .bind(shape(512 + 180 * 180, 512 + 180 * 180), &params(&[]))
        .unwrap();
    let tile = TileShape::default();
    let raster = plan_in_order(&bound, tile, &OrderRequest::Raster).unwrap();
    let auto = plan_in_order(&bound, tile, &OrderRequest::Auto).unwrap();
    assert_eq!(auto.visible_pairs(), raster.visible_pairs());
    assert!(
        auto.computed_pairs() * 2 <= raster.computed_pairs(),
        "{} vs {}",
        auto.computed_pairs(),
        raster.computed_pairs()
    );
    assert_eq!(auto.raster_computed_pairs, raster.computed_pairs());
    assert_eq!(
        auto.order_candidates[0].computed_pairs,
        auto.computed_pairs()
    );
}

#[test]
fn order_errors() {
    let program = builtin("causal");
    let bound = program.bind(shape(10, 10), &params(&[])).unwrap();
    let e = plan_in_order(&bound, TileShape::default(), &OrderRequest::Auto).unwrap_err();
    assert_eq!(e.code, "CM0406");
    let e = plan_in_order(
        &bound,
        TileShape::default(),
        &OrderRequest::Explicit(vec![0, 1, 1, 3, 4, 5, 6, 7, 8, 9]),
    )
    .unwrap_err();
    assert_eq!(e.code, "CM0407");
    assert!(e.message.contains("appears twice"), "{}", e.message);
    let e = plan_in_order(
        &bound,
        TileShape::default(),
        &OrderRequest::Explicit(vec![0, 1]),
    )
    .unwrap_err();
    assert_eq!(e.code, "CM0407");
    let bound = program.bind(shape(10, 12), &params(&[])).unwrap();
    let e = plan_in_order(&bound, TileShape::default(), &OrderRequest::Auto).unwrap_err();
    assert_eq!(e.code, "CM0405");
}

/// Orders made of ascending and reversed stretches of keys (a tree numbered children first,
/// put in preorder, reverses its chains): the permuted rows are exact, the cost estimate is
/// the descriptor's, and a reversed interval moves as one piece, so a row costs its
/// intervals, not its keys (a reversed 131072-token causal mask took minutes key by key).
#[test]
fn reversed_stretches_are_exact_and_move_whole() {
    let program = compile("mask = k <= q | (q - 40 <= k & k < q - 20);");
    for (n, stretches) in [
        (1u32, vec![1u32]),
        (2, vec![2]),
        (97, vec![97]),
        (97, vec![1, 5, 30, 2, 59]),
        (200, vec![64, 64, 64, 8]),
    ] {
        let bound = program
            .bind(shape(n.into(), n.into()), &params(&[]))
            .unwrap();
        let raster = cm_plan::plan(&bound, TileShape::default()).unwrap();
        let rows = &raster.masks[0].rows;
        // Stretches laid out last to first, every other one reversed.
        let mut order = Vec::new();
        let mut at = n;
        for (i, &len) in stretches.iter().enumerate() {
            let s: Vec<u32> = (at - len..at).collect();
            at -= len;
            if i % 2 == 0 {
                order.extend(s.iter().rev());
            } else {
                order.extend(s);
            }
        }
        let order = TokenOrder::from_permutation(order, n).unwrap();
        let permuted = permute_rows(rows, &order);
        permuted.validate().unwrap();
        for i in 0..n {
            for j in 0..n {
                assert_eq!(
                    permuted.is_visible(i, j),
                    rows.is_visible(order.order[i as usize], order.order[j as usize]),
                    "n {n}, {stretches:?}: pair ({i}, {j})"
                );
            }
        }
        for tile in [
            TileShape::default(),
            TileShape {
                block_m: 7,
                block_n: 3,
            },
        ] {
            let run = contiguous_runs(&order);
            assert_eq!(
                computed_pairs_in_order(rows, &order, &run, tile),
                TileDescriptor::build(&permuted, tile).computed_pairs
            );
        }
    }
    let n = 131072u32;
    let causal = compile("mask = k <= q;");
    let bound = causal
        .bind(shape(n.into(), n.into()), &params(&[]))
        .unwrap();
    let raster = cm_plan::plan(&bound, TileShape::default()).unwrap();
    let reversed = TokenOrder::from_permutation((0..n).rev().collect(), n).unwrap();
    let run = contiguous_runs(&reversed);
    assert_eq!(run[0].len, n, "one descending run");
    assert!(run[0].descending);
    let permuted = permute_rows(&raster.masks[0].rows, &reversed);
    // Row i is original row n - 1 - i, keys 0 ..= n - 1 - i, now i ..= n - 1.
    for i in [0, 1, n / 2, n - 1] {
        assert_eq!(
            permuted.row(i),
            &[cm_plan::rows::KeyInterval { start: i, end: n }]
        );
    }
}
