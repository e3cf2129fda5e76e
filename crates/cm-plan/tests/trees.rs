//! Trees: `k in t.path(q)` (k an ancestor of q or q itself) over random forests of any
//! depth, numbered in depth-first preorder or shuffled, at offsets, with a prompt before the
//! tree, longer or shorter than the keys, per batch index; rows against the pairwise
//! semantics (which walks up the parents), tiles against a dense evaluation; bad parent
//! arrays are `CM0313`; a 128K-node tree plans in pieces per jump, not per row.

#[allow(dead_code)]
mod common;
use cm_ir::{Shape, Value};
use cm_plan::order::{computed_pairs_in_order, contiguous_runs, TokenOrder};
use cm_plan::{plan, plan_in_order, OrderRequest, TileShape};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use common::*;
use proptest::prelude::*;

/// A random forest of `raw.len()` nodes: each node's parent an earlier node (or none), then
/// the nodes renumbered by the `shuffle` keys ([`relabel`]; none keeps parents first).
fn forest(raw: &[(bool, u32)], shuffle: &[u32]) -> Vec<i64> {
    let parent: Vec<i64> = raw
        .iter()
        .enumerate()
        .map(|(i, &(root, pick))| {
            if i == 0 || root {
                -1
            } else {
                i64::from(pick) % i as i64
            }
        })
        .collect();
    relabel(&parent, shuffle)
}

/// The forest `parent` with node i renumbered by its rank among the shuffle keys (ties and
/// missing keys by index), so that parents may come after their children.
fn relabel(parent: &[i64], shuffle: &[u32]) -> Vec<i64> {
    let n = parent.len();
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by_key(|&i| (shuffle.get(i).copied().unwrap_or(0), i));
    let mut perm = vec![0usize; n];
    for (new, &old) in idx.iter().enumerate() {
        perm[old] = new;
    }
    let mut out = vec![-1i64; n];
    for i in 0..n {
        out[perm[i]] = if parent[i] < 0 {
            -1
        } else {
            perm[parent[i] as usize] as i64
        };
    }
    out
}

/// The same forest's nodes in depth-first preorder.
fn preorder(parents: &[i64]) -> Vec<i64> {
    let n = parents.len();
    let mut children = vec![Vec::new(); n];
    let mut roots = Vec::new();
    for (i, &p) in parents.iter().enumerate() {
        if p < 0 {
            roots.push(i);
        } else {
            children[p as usize].push(i);
        }
    }
    let mut order = Vec::with_capacity(n);
    let mut stack: Vec<usize> = roots.into_iter().rev().collect();
    while let Some(u) = stack.pop() {
        order.push(u);
        stack.extend(children[u].iter().rev());
    }
    let mut pos = vec![0usize; n];
    for (new, &old) in order.iter().enumerate() {
        pos[old] = new;
    }
    let mut out = vec![-1i64; n];
    for (old, &p) in parents.iter().enumerate() {
        out[pos[old]] = if p < 0 { -1 } else { pos[p as usize] as i64 };
    }
    out
}

fn list(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 300, 0x7ee5))]

    #[test]
    fn tree_paths_equal_brute_force(
        raw in proptest::collection::vec((proptest::bool::weighted(0.1), any::<u32>()), 1..60),
        shuffle in proptest::collection::vec(0u32..1000, 0..60),
        dfs in any::<bool>(),
        prompt in 0i64..12,
        extra in -20i64..20,
        kv_extra in -20i64..20,
        (bm, bn) in (1u32..24, 1u32..24),
    ) {
        let parents = forest(&raw, &shuffle);
        let parents = if dfs { preorder(&parents) } else { parents };
        let n = parents.len() as i64;
        let q_len = (prompt + n + extra).max(1);
        let kv_len = (prompt + n + kv_extra).max(1);
        let src = format!(
            "param parents: [int] = {};\nparam prompt: int = {prompt};\n\
             tree t = parents at prompt;\n\
             mask = k < prompt & k <= q | k in t.path(q);",
            list(&parents)
        );
        let tile = TileShape { block_m: bm, block_n: bn };
        check_against_brute_force(&compile(&src), shape(q_len, kv_len), &params(&[]), tile);
    }
}

/// A tree per batch index (each sample's own speculation tree, a slice of one array) and a
/// path of another row than q.
#[test]
fn trees_per_batch_and_other_positions() {
    let program = compile(
        "param parents: [int] = [-1, 0, 0, 1, -1, 0, 1, 1, 2];\n\
         param offs: [int] = [0, 4, 9];\n\
         tree t = parents[offs[b] .. offs[b + 1]];\n\
         mask = k in t.path(q) | k in t.path(q - 1);",
    );
    let shape = Shape {
        q_len: 9,
        kv_len: 9,
        batch: 2,
        num_heads: 1,
    };
    let tile = TileShape {
        block_m: 3,
        block_n: 2,
    };
    let plan = check_against_brute_force(&program, shape, &params(&[]), tile);
    assert_eq!(plan.masks.len(), 2);
}

#[test]
fn bad_parent_arrays_are_errors() {
    let program = compile("param parents: [int];\ntree t = parents;\nmask = k in t.path(q);");
    for (parents, needle) in [
        (vec![-1, 0, 7], "node 2 of tree `t` has parent 7"),
        (vec![1, 0], "tree `t` has a cycle: 0 -> 1 -> 0"),
        (vec![-1, 1], "tree `t` has a cycle: 1 -> 1"),
    ] {
        let err = program
            .bind(shape(4, 4), &params(&[("parents", arr(&parents))]))
            .unwrap_err();
        assert_eq!(err.code.as_str(), "CM0313", "{parents:?}");
        assert!(err.message.contains(needle), "{}", err.message);
    }
}

/// A 131072-node tree: a complete 4-ary tree in preorder (paths of up to 9 nodes) plans in
/// pieces per run of affine paths, far fewer than its rows (the cost is watched through the
/// piece count; its time is in BENCHMARKS.md, not a test).
#[test]
fn large_tree_plans_in_pieces() {
    let n = 131072usize;
    let mut parents = vec![-1i64; n];
    // Heap-numbered 4-ary tree, then put in preorder.
    for (i, p) in parents.iter_mut().enumerate().skip(1) {
        *p = ((i - 1) / 4) as i64;
    }
    let parents = preorder(&parents);
    let program = compile("param parents: [int];\ntree t = parents;\nmask = k in t.path(q);");
    let values = params(&[("parents", Value::Array(parents.clone().into()))]);
    let bound = program.bind(shape(n as i64, n as i64), &values).unwrap();
    let p = plan(&bound, TileShape::default()).unwrap();
    assert!(p.pieces < n as u64 / 2, "{} pieces", p.pieces);
    for q in [0u32, 1, 5000, 77777, n as u32 - 1] {
        let got = row_pairs(&p.masks[0].rows, q);
        assert_eq!(
            got,
            bound.brute_force_row(i64::from(q), 0, 0).unwrap(),
            "row {q}"
        );
    }
    // A chain is one piece.
    let chain: Vec<i64> = (-1..n as i64 - 1).collect();
    let values = params(&[("parents", Value::Array(chain.into()))]);
    let bound = program.bind(shape(n as i64, n as i64), &values).unwrap();
    assert_eq!(plan(&bound, TileShape::default()).unwrap().pieces, 1);
    // The same chain numbered children first (node i's parent is i + 1): its preorder
    // reverses every position, so costing it (and planning in it) moves each row's one
    // interval whole (moved key by key, this took minutes). Its cost equals raster's, which
    // `auto` keeps.
    let reversed: Vec<i64> = (1..n as i64).chain([-1]).collect();
    let values = params(&[("parents", Value::Array(reversed.into()))]);
    let bound = program.bind(shape(n as i64, n as i64), &values).unwrap();
    let auto = plan_in_order(&bound, TileShape::default(), &OrderRequest::Auto).unwrap();
    assert!(auto.order.is_none(), "equal cost keeps raster");
    let preorder = TokenOrder::tree_preorder(n as u32, &bound.trees[0]);
    assert_eq!(preorder.order[0], n as u32 - 1, "the root first");
    let request = OrderRequest::Explicit(preorder.order.clone());
    let p = plan_in_order(&bound, TileShape::default(), &request).unwrap();
    let rows = &p.masks[0].rows;
    assert_eq!(rows.intervals().len(), n, "one interval a row");
    for i in [0u32, 1, 77777, n as u32 - 1] {
        assert_eq!(row_pairs(rows, i), vec![(0, i + 1)], "row {i}");
    }
}

/// Trees numbered out of depth-first order (a random recursive tree: node i's parent
/// uniform among the earlier nodes; a 4-ary tree numbered breadth first; the same with its
/// labels shuffled, parents after children), where a block of rows touches hundreds of
/// scattered key tiles: rows, tile classes and every partial tile's per-row data against
/// brute force.
#[test]
fn scattered_trees_equal_brute_force() {
    let n = 3000usize;
    // Park-Miller, as scripts/gen-tree.sh.
    let mut x = 2u64;
    let mut rnd = |m: usize| {
        x = x * 16807 % 2147483647;
        (x % m as u64) as usize
    };
    let random: Vec<i64> = (0..n)
        .map(|i| if i == 0 { -1 } else { rnd(i) as i64 })
        .collect();
    let bfs: Vec<i64> = (0..n as i64)
        .map(|i| if i == 0 { -1 } else { (i - 1) / 4 })
        .collect();
    let mut pos: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        pos.swap(i, rnd(i + 1));
    }
    let mut shuffled = vec![-1i64; n];
    for v in 0..n {
        if bfs[v] >= 0 {
            shuffled[pos[v]] = pos[bfs[v] as usize] as i64;
        }
    }
    let program = compile("param parents: [int];\ntree t = parents;\nmask = k in t.path(q);");
    for parents in [random, bfs, shuffled] {
        let mut most = 0;
        for (bm, bn) in [(16, 16), (128, 8), (7, 33)] {
            let values = params(&[("parents", arr(&parents))]);
            let tile = TileShape {
                block_m: bm,
                block_n: bn,
            };
            let plan =
                check_against_brute_force(&program, shape(n as i64, n as i64), &values, tile);
            let t = &plan.masks[0].tiles;
            most = most.max(
                t.kv_offsets
                    .windows(2)
                    .map(|w| w[1] - w[0])
                    .max()
                    .unwrap_or(0),
            );
        }
        // Blocks of scattered rows: more touched tiles than a block merges row by row.
        assert!(most > 16, "at most {most} partial tiles in a block");
    }
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 200, 0x0d1e))]

    /// `order = auto` on a tree plans in its depth-first preorder when that computes fewer
    /// pairs: the order is a permutation that keeps tokens outside the tree in place and
    /// makes every subtree one run of positions, every pair of the permuted plan is the
    /// original pair of the moved tokens (against the pairwise semantics), its tiles match a
    /// dense evaluation, and it never computes more pairs than the program's own positions.
    #[test]
    fn auto_order_of_a_tree_is_an_exact_preorder(
        raw in proptest::collection::vec((proptest::bool::weighted(0.1), any::<u32>()), 1..50),
        shuffle in proptest::collection::vec(0u32..1000, 0..50),
        prompt in 0i64..10,
        extra in -10i64..10,
        (bm, bn) in (1u32..20, 1u32..20),
    ) {
        let parents = forest(&raw, &shuffle);
        let n = parents.len() as i64;
        let len = (prompt + n + extra).max(1);
        let src = format!(
            "param parents: [int] = {};\nparam prompt: int = {prompt};\n\
             tree t = parents at prompt;\n\
             mask = k < prompt & k <= q | k in t.path(q);",
            list(&parents)
        );
        let tile = TileShape { block_m: bm, block_n: bn };
        let program = compile(&src);
        let bound = program.bind(shape(len, len), &params(&[])).unwrap();
        let raster = plan(&bound, tile).unwrap();
        let auto = plan_in_order(&bound, tile, &OrderRequest::Auto).unwrap();
        let preorder = TokenOrder::tree_preorder(len as u32, &bound.trees[0]);
        prop_assert!(auto.computed_pairs() <= raster.computed_pairs());
        prop_assert_eq!(auto.raster_computed_pairs, raster.computed_pairs());
        let Some(order) = &auto.order else {
            // Raster kept: preorder would not have computed fewer pairs.
            let cost = computed_pairs_in_order(
                &raster.masks[0].rows, &preorder, &contiguous_runs(&preorder), tile);
            prop_assert!(cost >= raster.computed_pairs());
            return Ok(());
        };
        prop_assert!(order.tree_preorder);
        prop_assert_eq!(&order.order, &preorder.order);
        let l = len as usize;
        let mut seen = vec![false; l];
        for &o in &order.order {
            prop_assert!(!std::mem::replace(&mut seen[o as usize], true), "order repeats {}", o);
        }
        let tree_end = (prompt + n).min(len);
        for p in (0..prompt.min(len)).chain(tree_end..len) {
            prop_assert_eq!(order.order[p as usize], p as u32, "token {} outside the tree moved", p);
        }
        // Each subtree is one run: a node's descendants (those whose path contains it)
        // are exactly the positions right after it, as many as the subtree has nodes.
        let table = &bound.trees[0];
        for v in 0..n.min(len - prompt).max(0) as usize {
            let new_v = order.inverse[prompt as usize + v] as usize;
            let size = (0..n as usize)
                .filter(|&u| prompt as usize + u < l && table.on_path(v, u))
                .count();
            for i in new_v..new_v + size {
                let u = order.order[i] as usize - prompt as usize;
                prop_assert!(table.on_path(v, u), "position {} is not in node {}'s subtree", i, v);
            }
        }
        let rows = &auto.masks[0].rows;
        rows.validate().unwrap();
        let mut dense = vec![false; l * l];
        for i in 0..l {
            let mut want = vec![false; l];
            for (s, e) in bound.brute_force_row(i64::from(order.order[i]), 0, 0).unwrap() {
                for k in s..e {
                    want[order.inverse[k as usize] as usize] = true;
                }
            }
            for j in 0..l {
                prop_assert_eq!(rows.is_visible(i as u32, j as u32), want[j], "pair ({}, {})", i, j);
                dense[i * l + j] = want[j];
            }
        }
        check_tiles(&auto.masks[0].tiles, &dense, len as u32, len as u32);
    }
}

/// A 4-ary tree of 4096 nodes with shuffled labels: `auto` finds its preorder and cuts the
/// computed pairs (the shuffled rows touch scattered key tiles; in preorder a path is a few
/// runs).
#[test]
fn auto_order_packs_a_shuffled_tree() {
    let n = 4096usize;
    let heap: Vec<i64> = (0..n as i64)
        .map(|i| if i == 0 { -1 } else { (i - 1) / 4 })
        .collect();
    // A fixed shuffle (Park-Miller keys) of the heap-numbered tree.
    let mut x = 7u64;
    let keys: Vec<u32> = (0..n)
        .map(|_| {
            x = x * 16807 % 2147483647;
            (x % 1_000_000) as u32
        })
        .collect();
    let parents = relabel(&heap, &keys);
    let program = compile("param parents: [int];\ntree t = parents;\nmask = k in t.path(q);");
    let values = params(&[("parents", Value::Array(parents.into()))]);
    let bound = program.bind(shape(n as i64, n as i64), &values).unwrap();
    let tile = TileShape::default();
    let raster = plan(&bound, tile).unwrap();
    let auto = plan_in_order(&bound, tile, &OrderRequest::Auto).unwrap();
    assert!(auto.order.as_ref().is_some_and(|o| o.tree_preorder));
    assert_eq!(auto.visible_pairs(), raster.visible_pairs());
    assert!(
        auto.computed_pairs() * 4 < raster.computed_pairs(),
        "{} vs {}",
        auto.computed_pairs(),
        raster.computed_pairs()
    );
}
