//! The cases of docs/public-reports.md that concern mask semantics, alignment,
//! tile edges, windows, empty rows, mask-build cost and validation, as named tests.
//!
//! Every case writes its mask in the language (docs/language.md), asserts the exact
//! intervals the case gives, checks the plan against the pairwise semantics
//! (`Program::brute_force_row`) and an independent dense tile classification, and, where
//! the case has numeric expectations, runs the CPU reference attention (f64) against a
//! dense float64 implementation written in `common`. The pure-numerics cases (FM-01 with
//! hand-built masks, FM-03, FM-04, GQ-01) live in `crates/cm-reference/tests/`; FM-01 is
//! repeated here with its mask written in the language.

#![allow(clippy::needless_range_loop)] // rows are indexed by their query position

mod common;

use common::{
    arr, check_brute_force, compile, dense_forward, max_abs_diff, plan, rows, set, visibility, Rng,
};
use compilemask::{
    attention_backward, attention_forward, AttentionError, AttentionShape, Masks, PlanOptions,
    Value,
};

fn mha(q_len: usize, kv_len: usize, d: usize, dv: usize) -> AttentionShape {
    AttentionShape {
        batch: 1,
        num_heads: 1,
        num_kv_heads: 1,
        q_len,
        kv_len,
        head_dim: d,
        head_dim_v: dv,
    }
}

/// Runs the reference (f64) on one mask and compares with the dense float64 softmax;
/// returns (out, lse).
fn forward_vs_dense(
    m: &compilemask::MaskPlan,
    d: usize,
    dv: usize,
    seed: u64,
) -> (Vec<f64>, Vec<f64>) {
    let (lq, lk) = (m.rows.q_len() as usize, m.rows.kv_len() as usize);
    let mut rng = Rng(seed);
    let (q, k, v) = (rng.vec(lq * d), rng.vec(lk * d), rng.vec(lk * dv));
    let scale = 1.0 / (d as f64).sqrt();
    let got = attention_forward(
        &mha(lq, lk, d, dv),
        &q,
        &k,
        &v,
        &Masks::shared(&m.rows),
        scale,
    )
    .unwrap();
    let want = dense_forward(&visibility(m), &q, &k, &v, d, dv, scale);
    assert!(got.out.iter().chain(&got.lse).all(|x| !x.is_nan()), "NaN");
    assert!(max_abs_diff(&got.out, &want.out) < 1e-12, "out differs");
    assert!(max_abs_diff(&got.lse, &want.lse) < 1e-12, "lse differs");
    for i in 0..lq {
        if m.rows.row(i as u32).is_empty() {
            assert_eq!(got.lse[i], f64::NEG_INFINITY, "lse of empty row {i}");
            assert!(got.out[i * dv..(i + 1) * dv].iter().all(|&x| x == 0.0));
        } else {
            assert!(got.lse[i].is_finite(), "lse of row {i}");
        }
    }
    (got.out, got.lse)
}

// ---------------------------------------------------------------------------------------
// FM-01: a padding row with an all-false mask row.

#[test]
fn fm_01_padding_row_written_in_the_language() {
    // Rows 0-4 causal over 10 keys (keys 5-9 never visible), row 5 sees nothing.
    let program = compile("mask = if q < 5 then k <= q else false;");
    let o = PlanOptions::new(6).kv_len(10);
    let p = plan(&program, &o);
    check_brute_force(&program, &o, &p);
    let want: Vec<Vec<(u32, u32)>> = (0..5).map(|i| vec![(0, i + 1)]).chain([vec![]]).collect();
    assert_eq!(rows(&p, 0, 0), want);
    assert_eq!(p.empty_rows(), 1);
    forward_vs_dense(p.mask(0, 0), 8, 8, 1);
}

// ---------------------------------------------------------------------------------------
// AL-01: causal alignment when q_len != kv_len.

const TOP_LEFT: &str = "mask = k <= q;";
const BOTTOM_RIGHT: &str = "mask = k <= q + kv_len - q_len;";
/// MagiAttention's bi-causal: bottom-right causal AND top-left inverse causal.
const BI_CAUSAL: &str = "mask = k <= q + kv_len - q_len & k >= q;";

fn al_rows(src: &str, lq: i64, lk: i64) -> Vec<Vec<(u32, u32)>> {
    let program = compile(src);
    let o = PlanOptions::new(lq).kv_len(lk);
    let p = plan(&program, &o);
    check_brute_force(&program, &o, &p);
    rows(&p, 0, 0)
}

#[test]
fn al_01_causal_alignment_lq5_lk2() {
    // A, bottom-right: rows 0-2 empty, row 3 -> {0}, row 4 -> {0, 1}.
    assert_eq!(
        al_rows(BOTTOM_RIGHT, 5, 2),
        vec![vec![], vec![], vec![], vec![(0, 1)], vec![(0, 2)]]
    );
    // The bundled bottom-right built-in agrees.
    let br = compilemask::builtin("causal_bottom_right").unwrap();
    let p = plan(&br, &PlanOptions::new(5).kv_len(2));
    assert_eq!(rows(&p, 0, 0), al_rows(BOTTOM_RIGHT, 5, 2));
    // A, top-left: row 0 -> {0}; rows 1-4 -> {0, 1}.
    assert_eq!(
        al_rows(TOP_LEFT, 5, 2),
        vec![
            vec![(0, 1)],
            vec![(0, 2)],
            vec![(0, 2)],
            vec![(0, 2)],
            vec![(0, 2)]
        ]
    );
    // Bi-causal with Lq = 5, Lk = 2: every row empty.
    assert_eq!(al_rows(BI_CAUSAL, 5, 2), vec![Vec::new(); 5]);
}

#[test]
fn al_01_causal_alignment_lq2_lk5() {
    // B, bottom-right: row 0 -> {0..3}, row 1 -> {0..4}.
    assert_eq!(
        al_rows(BOTTOM_RIGHT, 2, 5),
        vec![vec![(0, 4)], vec![(0, 5)]]
    );
    // B, top-left: row 0 -> {0}, row 1 -> {0, 1}.
    assert_eq!(al_rows(TOP_LEFT, 2, 5), vec![vec![(0, 1)], vec![(0, 2)]]);
}

#[test]
fn al_01_bottom_right_empty_rows_follow_the_contract() {
    // fp32 D = 16 in the report; the f64 reference with D = 16 here.
    let program = compile(BOTTOM_RIGHT);
    let p = plan(&program, &PlanOptions::new(5).kv_len(2));
    assert_eq!(p.empty_rows(), 3);
    let (out, lse) = forward_vs_dense(p.mask(0, 0), 16, 16, 2);
    for i in 0..3 {
        assert_eq!(lse[i], f64::NEG_INFINITY);
        assert!(out[i * 16..(i + 1) * 16].iter().all(|&x| x == 0.0));
    }
}

// ---------------------------------------------------------------------------------------
// BD-01: cross-attention document mask, block sizes dividing neither length.

const CROSS_DOCS: &str = "\
param qlens: [int] = [150, 150];
param klens: [int] = [70, 110];
segments qdoc = qlens;
segments kdoc = klens fill kv_len;
mask = k in kdoc[qdoc.index(q)];
";

#[test]
fn bd_01_cross_document_block_8() {
    let program = compile(CROSS_DOCS);
    for block in [8u32, 7, 128] {
        let o = PlanOptions::new(300).kv_len(180).tile(block, block);
        let p = plan(&program, &o);
        check_brute_force(&program, &o, &p);
        let m = p.mask(0, 0);
        for q in 0..300u32 {
            let want = if q < 150 {
                vec![(0, 70)]
            } else {
                vec![(70, 180)]
            };
            assert_eq!(common::row(m, q), want, "row {q}, block {block}");
        }
        assert_eq!(p.empty_rows(), 0);
        assert_eq!(m.tiles.num_m_blocks, 300u32.div_ceil(block));
        assert_eq!(m.tiles.num_n_blocks, 180u32.div_ceil(block));
        if block == 8 {
            // The ragged corner: query rows 296-299 x keys 176-179 (tile (37, 22)) are all
            // visible, so the edge tile is full by its in-range pairs.
            let map = common::tile_map(&m.tiles);
            assert_eq!(map.len(), 38);
            assert_eq!(map[37].len(), 23);
            assert_eq!(map[37][22], 'F');
            // Rows 144-151 straddle the query boundary: keys 64-71 (tile 8) straddle the
            // key boundary, so tile (18, 8) is partial.
            assert_eq!(map[18][8], 'P');
        }
    }
    let p = plan(&program, &PlanOptions::new(300).kv_len(180).tile(8, 8));
    forward_vs_dense(p.mask(0, 0), 16, 16, 3);
}

// ---------------------------------------------------------------------------------------
// BC-01: block-sparse selection with no element-level predicate.

const BLOCK_SELECT: &str = "\
# Query block i sees key blocks first[i] and second[i] (block 256).
param first: [int] = [0, 1, 0, 2];
param second: [int] = [2, 3, 3, 3];
mask = k / 256 == first[q / 256] | k / 256 == second[q / 256];
";

#[test]
fn bc_01_block_sparse_only_mask() {
    let program = compile(BLOCK_SELECT);
    let o = PlanOptions::new(1024).tile(256, 256);
    let p = plan(&program, &o);
    check_brute_force(&program, &o, &p);
    let m = p.mask(0, 0);
    for q in 0..1024u32 {
        let want = match q / 256 {
            0 => vec![(0, 256), (512, 768)],
            1 => vec![(256, 512), (768, 1024)],
            2 => vec![(0, 256), (768, 1024)],
            _ => vec![(512, 1024)],
        };
        assert_eq!(common::row(m, q), want, "row {q}");
    }
    // The descriptor is authoritative: exactly the 8 selected tiles, all full, nothing
    // else computed.
    let c = p.tile_counts();
    assert_eq!((c.full, c.partial, c.empty), (8, 0, 8));
    assert_eq!(p.computed_pairs(), 8 * 256 * 256);
    assert_eq!(p.computed_pairs(), p.visible_pairs());
    assert_eq!(
        common::tile_map(&m.tiles),
        ["F.F.", ".F.F", "F..F", "..FF"]
            .iter()
            .map(|s| s.chars().collect::<Vec<_>>())
            .collect::<Vec<_>>()
    );
    forward_vs_dense(m, 8, 8, 4);
}

// ---------------------------------------------------------------------------------------
// BC-02: equivalent encodings canonicalise to identical plans.

#[test]
fn bc_02_equivalent_encodings_canonical() {
    // (a) L = 512, block 128: causal as one predicate, as "full blocks below the diagonal
    // plus partial diagonal blocks", and as a rectangle plus a triangle.
    let encodings = [
        "mask = k <= q;",
        "mask = k / 128 < q / 128 | (k / 128 == q / 128 & k <= q);",
        "mask = k < q / 128 * 128 | q / 128 * 128 <= k <= q;",
    ];
    let o = PlanOptions::new(512).tile(128, 128);
    let plans: Vec<_> = encodings
        .iter()
        .map(|src| {
            let program = compile(src);
            let p = plan(&program, &o);
            check_brute_force(&program, &o, &p);
            p
        })
        .collect();
    for (src, p) in encodings.iter().zip(&plans) {
        assert_eq!(p.masks, plans[0].masks, "{src}: plan differs");
        let c = p.tile_counts();
        assert_eq!((c.full, c.partial, c.empty), (6, 4, 6), "{src}");
    }
    // Identical plans give bitwise-identical outputs (f32 and f64).
    let mut rng = Rng(5);
    let s = mha(512, 512, 16, 16);
    let (q, k, v) = (rng.vec(512 * 16), rng.vec(512 * 16), rng.vec(512 * 16));
    let f32s = |x: &[f64]| x.iter().map(|&y| y as f32).collect::<Vec<f32>>();
    let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
    let base64 = compilemask::attention(&s, &q, &k, &v, &plans[0], 0.25).unwrap();
    let base32 = compilemask::attention(&s, &q32, &k32, &v32, &plans[0], 0.25f32).unwrap();
    for p in &plans[1..] {
        assert_eq!(
            compilemask::attention(&s, &q, &k, &v, p, 0.25).unwrap(),
            base64
        );
        assert_eq!(
            compilemask::attention(&s, &q32, &k32, &v32, p, 0.25f32).unwrap(),
            base32
        );
    }
}

#[test]
fn bc_02_window_encodings_equal_causal_16k() {
    // (b) L = 16384: window (L-1, 0), (L, 0), causal, and (-1, 0) with -1 meaning
    // "unbounded", all rows [0, i] inclusive.
    let l = 16384i64;
    let sliding = compilemask::builtin("sliding_window").unwrap();
    let sentinel = compile(
        "param left: int = -1;\n\
         param right: int = 0;\n\
         mask = (left < 0 | k >= q - left) & (right < 0 | k <= q + right);",
    );
    let causal = compilemask::builtin("causal").unwrap();
    let plans = [
        // sliding_window sees q - window < k <= q, so window = L is (L-1, 0).
        plan(
            &sliding,
            &PlanOptions::new(l).param("window", Value::Int(l)),
        ),
        plan(
            &sliding,
            &PlanOptions::new(l).param("window", Value::Int(l + 1)),
        ),
        plan(&causal, &PlanOptions::new(l)),
        plan(&sentinel, &PlanOptions::new(l)),
    ];
    let m = plans[2].mask(0, 0);
    for i in 0..l as u32 {
        assert_eq!(common::row(m, i), vec![(0, i + 1)]);
    }
    for p in &plans {
        assert_eq!(p.masks, plans[2].masks);
    }
}

// ---------------------------------------------------------------------------------------
// SW-01: window sentinels and missing bounds.

#[test]
fn sw_01_window_sentinels() {
    let windowed = compile(
        "# (left, right) window bounds; a negative bound means unbounded.\n\
         param left: int;\n\
         param right: int;\n\
         mask = (left < 0 | k >= q - left) & (right < 0 | k <= q + right);",
    );
    let run = |left: i64, right: i64| {
        let o = PlanOptions::new(6)
            .param("left", Value::Int(left))
            .param("right", Value::Int(right));
        let p = plan(&windowed, &o);
        check_brute_force(&windowed, &o, &p);
        p
    };
    // (a) (-1, 0): unbounded left, causal right: identical to causal, never an empty band.
    let a = run(-1, 0);
    let causal: Vec<Vec<(u32, u32)>> = (0..6).map(|i| vec![(0, i + 1)]).collect();
    assert_eq!(rows(&a, 0, 0), causal);
    assert_eq!(a.empty_rows(), 0);
    let c = plan(
        &compilemask::builtin("causal").unwrap(),
        &PlanOptions::new(6),
    );
    assert_eq!(a.masks, c.masks);
    // (b) (2, 0) with no causal flag: the right bound is part of the window.
    let b = run(2, 0);
    assert_eq!(
        rows(&b, 0, 0),
        vec![
            vec![(0, 1)],
            vec![(0, 2)],
            vec![(0, 3)],
            vec![(1, 4)],
            vec![(2, 5)],
            vec![(3, 6)]
        ]
    );
    forward_vs_dense(b.mask(0, 0), 16, 16, 6);
}

#[test]
fn sw_01_literal_sentinel_gives_all_empty_plan() {
    // The bug's misreading, written out: -1 used arithmetically as the band [q+1, q].
    // The language has no sentinels, so this is what the program says; the plan makes the
    // result visible (every row empty) instead of silently computing zeros.
    let program = compile("param left: int = -1;\nmask = q - left <= k <= q;");
    let p = plan(&program, &PlanOptions::new(6));
    assert_eq!(p.empty_rows(), 6);
    assert_eq!(p.visible_pairs(), 0);
    assert_eq!(p.tile_counts().partial + p.tile_counts().full, 0);
    assert_eq!(p.computed_pairs(), 0);
    // And the JAX misreading (left bound only, no right bound) lets rows see the future.
    let left_only = compile("mask = q - 2 <= k;");
    let p = plan(&left_only, &PlanOptions::new(6));
    assert_eq!(rows(&p, 0, 0)[0], vec![(0, 6)]);
}

// ---------------------------------------------------------------------------------------
// GR-01: floor division of negatives in a multi-segment mask; gradients.

const GR_01: &str = "\
# Reduced three-rule mask of pytorch#158212, t = segment length, w = chunk.
param t: int = 16;
param w: int = 4;
param offset: int = 4;
let r = q - t;
let chunk = (r - offset) / w;
mask = if q < t then k < t & k < q + w
       else if q < 2 * t then
           (k < t & r % w != offset & k <= chunk * w + offset)
         | (t <= k < 2 * t & r % w != offset & (k - t) % w != offset
            & (k - t - offset) / w == chunk)
       else false;
";

fn gr_01_plan(offset: i64) -> (compilemask::Program, PlanOptions, compilemask::Plan) {
    let program = compile(GR_01);
    let o = PlanOptions::new(32).param("offset", Value::Int(offset));
    let p = plan(&program, &o);
    check_brute_force(&program, &o, &p);
    (program, o, p)
}

#[test]
fn gr_01_floor_division_segments() {
    let (_, _, p) = gr_01_plan(4);
    let r = rows(&p, 0, 0);
    for q in 16..20 {
        assert_eq!(r[q], vec![(0, 1), (16, 20)], "row {q}");
    }
    assert_eq!(r[20], vec![(0, 5), (20, 24)]);
    // Truncating division would give rows 17-19 -> [0, 5) U [17, 24): not what we compile.
    for q in 17..20 {
        assert_ne!(r[q], vec![(0, 5), (17, 24)], "row {q}");
    }
    // Segment 1 rows: k < min(t, q + w).
    for q in 0..16u32 {
        assert_eq!(r[q as usize], vec![(0, (q + 4).min(16))]);
    }

    // offset = 0: rows with r mod w == 0 are empty (and follow the empty-row contract).
    let (_, _, p0) = gr_01_plan(0);
    let r0 = rows(&p0, 0, 0);
    for q in [16usize, 20, 24, 28] {
        assert!(r0[q].is_empty(), "row {q}");
    }
    assert_eq!(p0.empty_rows(), 4);
    forward_vs_dense(p0.mask(0, 0), 16, 16, 7);
}

/// `sum(out * dout)` of the dense float64 reference.
fn dense_loss(
    vis: &[Vec<bool>],
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    d: usize,
    scale: f64,
) -> f64 {
    let f = dense_forward(vis, q, k, v, d, d, scale);
    f.out.iter().zip(dout).map(|(a, b)| a * b).sum()
}

/// Central finite differences of the dense loss with respect to every element of `x`.
fn finite_difference(x: &[f64], loss: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-5;
    let mut y = x.to_vec();
    (0..x.len())
        .map(|i| {
            y[i] = x[i] + h;
            let up = loss(&y);
            y[i] = x[i] - h;
            let down = loss(&y);
            y[i] = x[i];
            (up - down) / (2.0 * h)
        })
        .collect()
}

#[test]
fn gr_01_gradients_match_finite_differences() {
    let d = 16usize;
    let scale = 0.25;
    for offset in [4i64, 0] {
        let (_, _, p) = gr_01_plan(offset);
        let m = p.mask(0, 0);
        let vis = visibility(m);
        let mut rng = Rng(100 + offset as u64);
        let (q, k, v, dout) = (
            rng.vec(32 * d),
            rng.vec(32 * d),
            rng.vec(32 * d),
            rng.vec(32 * d),
        );
        let shape = mha(32, 32, d, d);
        let g =
            attention_backward(&shape, &q, &k, &v, &dout, &Masks::shared(&m.rows), scale).unwrap();
        for x in [&g.dq, &g.dk, &g.dv] {
            assert!(x.iter().all(|y| y.is_finite()), "non-finite gradient");
        }
        let fd_q = finite_difference(&q, |x| dense_loss(&vis, x, &k, &v, &dout, d, scale));
        let fd_k = finite_difference(&k, |x| dense_loss(&vis, &q, x, &v, &dout, d, scale));
        let fd_v = finite_difference(&v, |x| dense_loss(&vis, &q, &k, x, &dout, d, scale));
        assert!(max_abs_diff(&g.dq, &fd_q) < 1e-7, "dq, offset {offset}");
        assert!(max_abs_diff(&g.dk, &fd_k) < 1e-7, "dk, offset {offset}");
        assert!(max_abs_diff(&g.dv, &fd_v) < 1e-7, "dv, offset {offset}");

        // Keys nobody sees get dk = dv = 0 exactly; empty rows get dq = 0 exactly.
        let unseen: Vec<usize> = (0..32).filter(|&j| (0..32).all(|i| !vis[i][j])).collect();
        if offset == 0 {
            assert_eq!(unseen, vec![16, 20, 24, 28]);
        } else {
            assert!(unseen.is_empty());
        }
        for j in unseen {
            assert!(
                g.dk[j * d..(j + 1) * d].iter().all(|&x| x == 0.0),
                "dk[{j}]"
            );
            assert!(
                g.dv[j * d..(j + 1) * d].iter().all(|&x| x == 0.0),
                "dv[{j}]"
            );
        }
        for i in 0..32 {
            if m.rows.row(i as u32).is_empty() {
                assert!(
                    g.dq[i * d..(i + 1) * d].iter().all(|&x| x == 0.0),
                    "dq[{i}]"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// HD-01: global rows / columns + block diagonal: up to 3 intervals per row.

const GLOBAL_ROWS_COLS: &str = "\
# vis = (q mod F < Bk) | (k mod F < Bk) | (q / Bk == k / Bk), F = S/2, Bk = S/8.
param F: int = q_len / 2;
param Bk: int = q_len / 8;
grid frames = [kv_len / F, F];
mask = q % F < Bk | box(frames, 0 .. kv_len / F, 0 .. Bk) | q / Bk == k / Bk;
";

#[test]
fn hd_01_multi_interval_rows() {
    let program = compile(GLOBAL_ROWS_COLS);
    let o = PlanOptions::new(16).tile(4, 4);
    let p = plan(&program, &o);
    check_brute_force(&program, &o, &p);
    let keys = |ks: &[u32]| set(ks.iter().copied());
    let all: Vec<u32> = (0..16).collect();
    let want = [
        (vec![0, 1, 8, 9], all.clone()),
        (vec![2, 3], vec![0, 1, 2, 3, 8, 9]),
        (vec![4, 5], vec![0, 1, 4, 5, 8, 9]),
        (vec![6, 7], vec![0, 1, 6, 7, 8, 9]),
        (vec![10, 11], vec![0, 1, 8, 9, 10, 11]),
        (vec![12, 13], vec![0, 1, 8, 9, 12, 13]),
        (vec![14, 15], vec![0, 1, 8, 9, 14, 15]),
    ];
    let r = rows(&p, 0, 0);
    for (qs, ks) in &want {
        for &q in qs {
            assert_eq!(r[q as usize], keys(ks), "row {q}");
        }
    }
    assert_eq!(p.max_intervals_per_row(), 3);
    assert_eq!(r[4], vec![(0, 2), (4, 6), (8, 10)]);
}

#[test]
fn hd_01_head_dims_match_dense() {
    let program = compile(GLOBAL_ROWS_COLS);
    let p = plan(&program, &PlanOptions::new(16));
    let m = p.mask(0, 0);
    for (i, (d, dv)) in [
        (32, 32),
        (48, 48),
        (80, 80),
        (96, 96),
        (112, 112),
        (192, 192),
        (256, 256),
        (31, 31),
        (192, 128),
    ]
    .into_iter()
    .enumerate()
    {
        forward_vs_dense(m, d, dv, 10 + i as u64);
    }
}

// ---------------------------------------------------------------------------------------
// GQ-01: GQA / MQA head mapping through the facade (plans from the language).

#[test]
fn gq_01_gqa_through_the_facade() {
    let l = 8usize;
    let d = 16usize;
    let plans = [
        plan(
            &compilemask::builtin("causal").unwrap(),
            &PlanOptions::new(8),
        ),
        plan(
            &compilemask::builtin("sliding_window").unwrap(),
            &PlanOptions::new(8).param("window", Value::Int(3)),
        ),
        plan(
            &compilemask::builtin("document_causal").unwrap(),
            &PlanOptions::new(8).param("lengths", arr(&[3, 5])),
        ),
    ];
    // Row i of causal sees [0, i]: row 5 sees 6 keys, not 2.
    assert_eq!(common::row(plans[0].mask(0, 0), 5), vec![(0, 6)]);
    let mut rng = Rng(55);
    for (hq, hkv) in [(4usize, 1usize), (8, 2)] {
        let group = hq / hkv;
        let gqa = AttentionShape {
            num_heads: hq,
            num_kv_heads: hkv,
            ..mha(l, l, d, d)
        };
        let mha_shape = AttentionShape {
            num_heads: hq,
            num_kv_heads: hq,
            ..mha(l, l, d, d)
        };
        let (q, k, v) = (
            rng.vec(hq * l * d),
            rng.vec(hkv * l * d),
            rng.vec(hkv * l * d),
        );
        // Query head h reads kv head h / group: repeat K/V per group for the MHA call.
        let repeat = |x: &[f64]| -> Vec<f64> {
            (0..hq)
                .flat_map(|h| x[(h / group) * l * d..(h / group + 1) * l * d].to_vec())
                .collect()
        };
        for p in &plans {
            let g = compilemask::attention(&gqa, &q, &k, &v, p, 0.25).unwrap();
            let m =
                compilemask::attention(&mha_shape, &q, &repeat(&k), &repeat(&v), p, 0.25).unwrap();
            assert_eq!(g, m, "GQA {hq}/{hkv} differs from MHA with repeated K/V");
            for h in 0..hq {
                let kv = h / group;
                let want = dense_forward(
                    &visibility(p.mask(0, 0)),
                    &q[h * l * d..(h + 1) * l * d],
                    &k[kv * l * d..(kv + 1) * l * d],
                    &v[kv * l * d..(kv + 1) * l * d],
                    d,
                    d,
                    0.25,
                );
                assert!(max_abs_diff(&g.out[h * l * d..(h + 1) * l * d], &want.out) < 1e-12);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// GQ-03: per-batch mask with a shrinking batch.

const PER_BATCH_CUTOFF: &str = "\
param n: [int] = [1, 2];
mask = if q < n[b] then k <= q else k < kv_len;
";

#[test]
fn gq_03_per_batch_cutoff() {
    let program = compile(PER_BATCH_CUTOFF);
    assert_eq!(program.depends_on_batch_head(), (true, false));
    // Step 1: B = 2, n = [1, 2].
    let mut o1 = PlanOptions::new(4).param("n", arr(&[1, 2]));
    o1.batch = 2;
    let p1 = plan(&program, &o1);
    check_brute_force(&program, &o1, &p1);
    assert_eq!(
        rows(&p1, 0, 0),
        vec![vec![(0, 1)], vec![(0, 4)], vec![(0, 4)], vec![(0, 4)]]
    );
    assert_eq!(
        rows(&p1, 1, 0),
        vec![vec![(0, 1)], vec![(0, 2)], vec![(0, 4)], vec![(0, 4)]]
    );
    assert_eq!(p1.masks.len(), 2);
    assert_eq!(p1.mask_index, vec![0, 1]);
    // Step 2: B = 1, n = [3], same compiled program (no re-parse, no recompile).
    let mut o2 = PlanOptions::new(4).param("n", arr(&[3]));
    o2.batch = 1;
    let p2 = plan(&program, &o2);
    check_brute_force(&program, &o2, &p2);
    assert_eq!(
        rows(&p2, 0, 0),
        vec![vec![(0, 1)], vec![(0, 2)], vec![(0, 3)], vec![(0, 4)]]
    );
    // Numerics: the facade picks each batch's mask; no NaN, each batch matches dense.
    let d = 16;
    let mut rng = Rng(31);
    let shape = AttentionShape {
        batch: 2,
        ..mha(4, 4, d, d)
    };
    let (q, k, v) = (rng.vec(2 * 4 * d), rng.vec(2 * 4 * d), rng.vec(2 * 4 * d));
    let out = compilemask::attention(&shape, &q, &k, &v, &p1, 0.25).unwrap();
    assert!(out.out.iter().chain(&out.lse).all(|x| x.is_finite()));
    for b in 0..2 {
        let s = b * 4 * d..(b + 1) * 4 * d;
        let want = dense_forward(
            &visibility(p1.mask(b as u32, 0)),
            &q[s.clone()],
            &k[s.clone()],
            &v[s.clone()],
            d,
            d,
            0.25,
        );
        assert!(max_abs_diff(&out.out[s], &want.out) < 1e-12, "batch {b}");
    }
}

// ---------------------------------------------------------------------------------------
// MC-01: build cost at 128K, 32 heads declared and unused.

/// `count` sorted distinct cut points in (0, len), as document lengths.
fn random_documents(rng: &mut Rng, len: i64, boundaries: usize) -> Vec<i64> {
    let mut cuts = std::collections::BTreeSet::new();
    while cuts.len() < boundaries {
        cuts.insert(1 + rng.below(len as u64 - 1) as i64);
    }
    let mut prev = 0;
    let mut lens = Vec::with_capacity(boundaries + 1);
    for c in cuts {
        lens.push(c - prev);
        prev = c;
    }
    lens.push(len - prev);
    lens
}

#[test]
fn mc_01_build_cost_128k() {
    const S: i64 = 131_072;
    let mut rng = Rng(2024);
    let docs = random_documents(&mut rng, S, 1000);
    assert_eq!(docs.iter().sum::<i64>(), S);
    let cases: Vec<(&str, compilemask::Program, PlanOptions)> = vec![
        (
            "causal",
            compilemask::builtin("causal").unwrap(),
            PlanOptions::new(S),
        ),
        (
            "sliding_window 4096",
            compilemask::builtin("sliding_window").unwrap(),
            PlanOptions::new(S).param("window", Value::Int(4096)),
        ),
        (
            "document_causal, 1000 boundaries",
            compilemask::builtin("document_causal").unwrap(),
            PlanOptions::new(S).param("lengths", arr(&docs)),
        ),
        (
            "global rows/cols (HD-01)",
            compile(GLOBAL_ROWS_COLS),
            PlanOptions::new(S),
        ),
    ];
    let mut report = String::new();
    for (name, program, mut o) in cases {
        o.num_heads = 32;
        let p = plan(&program, &o);
        report.push_str(&format!(
            "{name}: rows {} KiB, descriptor {} KiB, pieces {}\n",
            p.masks[0].rows.bytes() / 1024,
            p.descriptor_bytes() / 1024,
            p.pieces
        ));
        // One distinct mask stored for the 32 heads, shared by index.
        assert_eq!(p.masks.len(), 1, "{name}");
        assert_eq!(p.mask_index, vec![0; 32], "{name}");
        assert_eq!(p.num_heads, 32);
        // O(S) memory: intervals ~1 MiB, everything a kernel reads well under 64 MiB.
        assert!(p.masks[0].rows.bytes() < 4 << 20, "{name}: rows too large");
        assert!(
            p.descriptor_bytes() < 64 << 20,
            "{name}: descriptor too large"
        );
        // O(S) time, counted in the solver's pieces (runs of rows whose intervals are
        // affine in the row), each costing its intervals: one for causal, the band's clipped
        // head and the band, one per document, the 8 Bk-row blocks for HD-01 (measured: 1,
        // 2, 1001, 8; bounds with room). A row-by-row or dense build would be S pieces.
        let most = match name {
            "causal" => 2,
            "sliding_window 4096" => 4,
            "document_causal, 1000 boundaries" => 2 * docs.len() as u64,
            _ => 16,
        };
        assert!(p.pieces <= most, "{name}: {} pieces", p.pieces);
        // Spot checks against the pairwise semantics, including the first and last rows.
        let m = p.mask(0, 0);
        let mut sample: Vec<i64> = vec![0, 1, S / 2, S - 2, S - 1];
        sample.extend((0..12).map(|_| rng.below(S as u64) as i64));
        for q in sample {
            let want = program.brute_force_row(&o, q, 0, 0).unwrap();
            assert_eq!(common::row(m, q as u32), want, "{name}: row {q}");
        }
        // Closed forms over every row.
        match name {
            "causal" => assert_eq!(p.visible_pairs(), 32 * (S * (S + 1) / 2) as u64),
            "sliding_window 4096" => {
                for q in 0..S as u32 {
                    assert_eq!(common::row(m, q), vec![(q.saturating_sub(4095), q + 1)]);
                }
            }
            "document_causal, 1000 boundaries" => {
                let mut start = 0u32;
                let mut q = 0u32;
                for &len in &docs {
                    for _ in 0..len {
                        assert_eq!(common::row(m, q), vec![(start, q + 1)], "row {q}");
                        q += 1;
                    }
                    start += len as u32;
                }
            }
            _ => assert_eq!(p.max_intervals_per_row(), 3),
        }
    }
    eprintln!("MC-01 plans (S = 131072, num_heads = 32):\n{report}");
}

// ---------------------------------------------------------------------------------------
// MC-02: one compiled program, many lengths and documents.

#[test]
fn mc_02_no_recompile_new_lengths() {
    let mut rng = Rng(77);
    let window = compilemask::builtin("sliding_window").unwrap();
    let docs = compilemask::builtin("document_causal").unwrap();
    let lengths = [1000i64, 1017, 1100, 2048, 4095, 4096];
    // 50 steps of a W = 128 sliding window at varying S.
    for step in 0..50 {
        let s = lengths[rng.below(lengths.len() as u64) as usize];
        let o = PlanOptions::new(s).param("window", Value::Int(128));
        let p = plan(&window, &o);
        // The band's clipped head and the band, at any length (measured: 2).
        assert!(p.pieces <= 4, "step {step}: {} pieces", p.pieces);
        let m = p.mask(0, 0);
        for q in 0..s as u32 {
            assert_eq!(common::row(m, q), vec![(q.saturating_sub(127), q + 1)]);
        }
        for _ in 0..8 {
            let q = rng.below(s as u64) as i64;
            assert_eq!(
                common::row(m, q as u32),
                window.brute_force_row(&o, q, 0, 0).unwrap(),
                "step {step}, row {q}"
            );
        }
    }
    // 50 steps of document masks with random boundaries at S = 4096.
    for step in 0..50 {
        let n = 1 + rng.below(64) as usize;
        let lens = random_documents(&mut rng, 4096, n);
        let o = PlanOptions::new(4096).param("lengths", arr(&lens));
        let p = plan(&docs, &o);
        // A piece per document (measured: exactly that), whatever the boundaries.
        assert!(
            p.pieces <= 2 * lens.len() as u64,
            "step {step}: {} pieces for {} documents",
            p.pieces,
            lens.len()
        );
        let m = p.mask(0, 0);
        let mut q = 0u32;
        let mut start = 0u32;
        for &len in &lens {
            for _ in 0..len {
                assert_eq!(common::row(m, q), vec![(start, q + 1)], "step {step}");
                q += 1;
            }
            start += len as u32;
        }
        for _ in 0..8 {
            let q = rng.below(4096) as i64;
            assert_eq!(
                common::row(m, q as u32),
                docs.brute_force_row(&o, q, 0, 0).unwrap()
            );
        }
    }
    // 50 steps at small S, every row and tile against brute force, random tiles.
    for _ in 0..50 {
        let s = 1 + rng.below(96) as i64;
        let n = rng.below(6) as usize;
        let mut lens: Vec<i64> = (0..=n).map(|_| rng.below(20) as i64).collect();
        lens[0] += 1; // at least one token
        let o = PlanOptions::new(s)
            .param("lengths", arr(&lens))
            .tile(1 + rng.below(9) as u32, 1 + rng.below(9) as u32);
        let p = plan(&docs, &o);
        check_brute_force(&docs, &o, &p);
        let o = PlanOptions::new(s)
            .param("window", Value::Int(1 + rng.below(12) as i64))
            .tile(1 + rng.below(9) as u32, 1 + rng.below(9) as u32);
        let p = plan(&window, &o);
        check_brute_force(&window, &o, &p);
    }
}

// ---------------------------------------------------------------------------------------
// VA-01: plans of the wrong shape are rejected, and nothing leaks between plans.

#[test]
fn va_01_shape_validation() {
    let causal = compilemask::builtin("causal").unwrap();
    // qo_len = 10, kv_len = 20, Hq = 8, Hkv = 4 (D = 16 on the CPU).
    let shape = AttentionShape {
        batch: 1,
        num_heads: 8,
        num_kv_heads: 4,
        q_len: 10,
        kv_len: 20,
        head_dim: 16,
        head_dim_v: 16,
    };
    let mut rng = Rng(9);
    let (q, k, v) = (
        rng.vec(8 * 10 * 16),
        rng.vec(4 * 20 * 16),
        rng.vec(4 * 20 * 16),
    );
    // (a) a mask planned as (10, 15) and (b) as (20, 10): refused before any computation
    // with `PlanMismatch`, naming the first length that differs, no output.
    let cases = [(10, 15, "kv_len", 15, 20), (20, 10, "q_len", 20, 10)];
    for (lq, lk, what, planned, given) in cases {
        let p = plan(&causal, &PlanOptions::new(lq).kv_len(lk));
        let err = compilemask::attention(&shape, &q, &k, &v, &p, 0.25).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                AttentionError::PlanMismatch { what: w, planned: pl, given: g }
                    if w == what && pl == planned && g == given
            ),
            "{err:?}"
        );
        let want = format!(
            "the plan was made for {what} = {planned}, but the tensors have {what} = {given}; \
             plan again for these tensors"
        );
        assert_eq!(msg, want);
        let err = attention_forward(&shape, &q, &k, &v, &Masks::shared(&p.masks[0].rows), 0.25)
            .unwrap_err();
        assert!(
            err.to_string().contains("expected q_len = 10, kv_len = 20"),
            "{err}"
        );
    }
    // The right plan works.
    let good = plan(&causal, &PlanOptions::new(10).kv_len(20));
    let fresh = compilemask::attention(&shape, &q, &k, &v, &good, 0.25).unwrap();
    // (c) a random custom mask first, then causal: bit for bit a fresh causal call.
    let custom =
        compile("param keep: [int] = [0];\nmask = elementwise((q * 7 + k * 3 + keep[0]) % 5 < 2);");
    let pc = plan(&custom, &PlanOptions::new(10).kv_len(20));
    assert!(pc.elementwise_pairs > 0);
    let first = compilemask::attention(&shape, &q, &k, &v, &pc, 0.25).unwrap();
    let second = compilemask::attention(&shape, &q, &k, &v, &good, 0.25).unwrap();
    assert_ne!(first, second);
    assert_eq!(second, fresh);
    // A per-head plan for 2 heads does not fit 8 heads.
    let per_head = compile("param w: [int] = [2, 3];\nmask = q - w[h] < k <= q;");
    let mut o = PlanOptions::new(10).kv_len(20);
    o.num_heads = 2;
    let ph = plan(&per_head, &o);
    assert_eq!(ph.masks.len(), 2);
    assert!(compilemask::attention(&shape, &q, &k, &v, &ph, 0.25).is_err());
    // Wrong tensor lengths are errors too.
    assert!(compilemask::attention(&shape, &q[1..], &k, &v, &good, 0.25).is_err());
}

// ---------------------------------------------------------------------------------------
// PF-01: scattered neighbours (9 random keys per row).

#[test]
fn pf_01_scattered_neighbours() {
    const S: usize = 768;
    let mut rng = Rng(139);
    let nbr: Vec<i64> = (0..S * 9).map(|_| rng.below(S as u64) as i64).collect();
    let union = "k == nb[9*q] | k == nb[9*q+1] | k == nb[9*q+2] | k == nb[9*q+3] \
                 | k == nb[9*q+4] | k == nb[9*q+5] | k == nb[9*q+6] | k == nb[9*q+7] \
                 | k == nb[9*q+8]";
    let analytic = compile(&format!("param nb: [int];\nmask = {union};"));
    let pointwise = compile(&format!("param nb: [int];\nmask = elementwise({union});"));
    let o = PlanOptions::new(S as i64).param("nb", arr(&nbr));
    let pa = plan(&analytic, &o);
    let pe = plan(&pointwise, &o);
    for q in 0..S {
        let want = set(nbr[9 * q..9 * q + 9].iter().map(|&x| x as u32));
        assert_eq!(common::row(pa.mask(0, 0), q as u32), want, "row {q}");
    }
    assert_eq!(pa.masks, pe.masks);
    assert_eq!(pa.elementwise_pairs, 0);
    assert_eq!(pe.elementwise_pairs, (S * S) as u64);
    // Every row sees at most 9 keys; tiles are nearly all partial, as the report says.
    assert!(pa.visible_pairs() <= 9 * S as u64);
    check_brute_force(&analytic, &o, &pa);
    forward_vs_dense(pa.mask(0, 0), 16, 16, 8);
}
