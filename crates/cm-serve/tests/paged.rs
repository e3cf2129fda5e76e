//! The paged reference against an independent dense float64 softmax: every sequence's
//! contiguous K / V (before paging), a dense mask from `Bound::visible`, GQA by head group.
//! Caches are paged through shuffled page tables, with prompt pages shared between
//! sequences, partially filled last pages, NaN in every slot no sequence owns and -1 in
//! every block-table entry past a sequence's pages (so a read outside the contract shows).

mod common;

use cm_ir::{Shape, Value};
use cm_serve::{paged_attention, PagedError, PagedShape, StepPlan, StepPlanner};
use common::*;
use std::sync::Arc;

/// A paged cache and the contiguous K / V it was made from.
struct Cache {
    k: Vec<f64>,
    v: Vec<f64>,
    block_table: Vec<i32>,
    shape: PagedShape,
    /// Per sequence, `[kv_len, num_kv_heads, head_dim]` and `[.., head_dim_v]`.
    dense_k: Vec<Vec<f64>>,
    dense_v: Vec<Vec<f64>>,
}

/// Heads and widths of one case.
#[derive(Clone, Copy, Debug)]
struct Dims {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    head_dim_v: usize,
}

/// Pages `kv_len` keys per sequence into `page_size` slots; sequence `s` with
/// `shared[s] = Some((t, n))` (`t < s`) shares its first `n` pages (and their K / V) with
/// sequence `t`.
fn page(
    rng: &mut Gen,
    kv_len: &[i64],
    page_size: usize,
    dims: Dims,
    shared: &[Option<(usize, usize)>],
) -> Cache {
    let (hk, d, dv) = (dims.num_kv_heads, dims.head_dim, dims.head_dim_v);
    let needed: Vec<usize> = kv_len
        .iter()
        .map(|&k| (k as usize).div_ceil(page_size))
        .collect();
    let max_pages = needed.iter().max().copied().unwrap_or(0) + 2;
    let owned: usize = needed
        .iter()
        .zip(shared)
        .map(|(&n, sh)| n - sh.map_or(0, |(_, m)| m))
        .sum();
    let num_pages = owned + 3;
    let physical = rng.permutation(num_pages);
    let mut next = 0;
    let mut block_table = vec![-1i32; kv_len.len() * max_pages];
    let mut dense_k: Vec<Vec<f64>> = Vec::new();
    let mut dense_v: Vec<Vec<f64>> = Vec::new();
    for (s, &kv) in kv_len.iter().enumerate() {
        let kv = kv as usize;
        let mut k: Vec<f64> = (0..kv * hk * d).map(|_| rng.signed_unit()).collect();
        let mut v: Vec<f64> = (0..kv * hk * dv).map(|_| rng.signed_unit()).collect();
        for j in 0..needed[s] {
            block_table[s * max_pages + j] = match shared[s] {
                Some((t, m)) if j < m => {
                    assert!(t < s && needed[t] >= m && kv >= m * page_size);
                    block_table[t * max_pages + j]
                }
                _ => {
                    next += 1;
                    physical[next - 1] as i32
                }
            };
        }
        if let Some((t, m)) = shared[s] {
            let n = m * page_size;
            k[..n * hk * d].copy_from_slice(&dense_k[t][..n * hk * d]);
            v[..n * hk * dv].copy_from_slice(&dense_v[t][..n * hk * dv]);
        }
        dense_k.push(k);
        dense_v.push(v);
    }
    let mut kc = vec![f64::NAN; num_pages * page_size * hk * d];
    let mut vc = vec![f64::NAN; num_pages * page_size * hk * dv];
    for (s, &kv) in kv_len.iter().enumerate() {
        for p in 0..kv as usize {
            let slot =
                block_table[s * max_pages + p / page_size] as usize * page_size + p % page_size;
            kc[slot * hk * d..][..hk * d].copy_from_slice(&dense_k[s][p * hk * d..][..hk * d]);
            vc[slot * hk * dv..][..hk * dv].copy_from_slice(&dense_v[s][p * hk * dv..][..hk * dv]);
        }
    }
    Cache {
        k: kc,
        v: vc,
        block_table,
        shape: PagedShape {
            num_heads: dims.num_heads,
            num_kv_heads: hk,
            head_dim: d,
            head_dim_v: dv,
            num_pages,
            page_size,
            max_pages_per_seq: max_pages,
        },
        dense_k,
        dense_v,
    }
}

/// Dense float64 attention of every step row over its sequence's contiguous K / V, with
/// visibility from the pairwise semantics of the program bound at the sequence's length.
fn dense(
    program: &cm_ir::Program,
    values: &[Params],
    plan: &StepPlan,
    cache: &Cache,
    q: &[f64],
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let sh = cache.shape;
    let (hq, hk, d, dv) = (sh.num_heads, sh.num_kv_heads, sh.head_dim, sh.head_dim_v);
    let group = hq / hk;
    let mut out = vec![0.0; plan.total_q() * hq * dv];
    let mut lse = vec![0.0; plan.total_q() * hq];
    for (s, values) in values.iter().enumerate() {
        let kv = plan.kv_len()[s] as i64;
        let shape = Shape {
            q_len: kv,
            kv_len: kv,
            batch: plan.num_seqs() as i64,
            num_heads: 1,
        };
        let bound = program.bind(shape, values).unwrap();
        for i in 0..plan.q_len(s) {
            let r = plan.cu_q()[s] as usize + i;
            let p = plan.position(s, i) as i64;
            let visible: Vec<usize> = (0..kv)
                .filter(|&k| bound.visible(p, k, s as i64, 0).unwrap())
                .map(|k| k as usize)
                .collect();
            for h in 0..hq {
                let kh = h / group;
                let qv = &q[(r * hq + h) * d..][..d];
                let logits: Vec<f64> = visible
                    .iter()
                    .map(|&k| {
                        let kv = &cache.dense_k[s][(k * hk + kh) * d..][..d];
                        scale * qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                if logits.is_empty() {
                    lse[r * hq + h] = f64::NEG_INFINITY;
                    continue;
                }
                let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                let z: f64 = w.iter().sum();
                lse[r * hq + h] = m + z.ln();
                for (wi, &k) in w.iter().zip(&visible) {
                    let vv = &cache.dense_v[s][(k * hk + kh) * dv..][..dv];
                    for c in 0..dv {
                        out[(r * hq + h) * dv + c] += wi / z * vv[c];
                    }
                }
            }
        }
    }
    (out, lse)
}

/// Plans the step, runs the paged reference in f64 and f32, and compares with [`dense`].
#[allow(clippy::too_many_arguments)]
fn check(
    what: &str,
    program: Arc<cm_ir::Program>,
    shared: Params,
    own: Option<Vec<Params>>,
    q_len: &[i64],
    kv_len: &[i64],
    page_size: usize,
    dims: Dims,
    sharing: &[Option<(usize, usize)>],
    seed: u8,
) {
    let mut rng = Gen::new(seed);
    let mut planner = StepPlanner::new(program.clone(), shared.clone()).unwrap();
    let plan = match &own {
        Some(own) => planner.plan_each(q_len, kv_len, own),
        None => planner.plan(q_len, kv_len),
    }
    .unwrap();
    let cache = page(&mut rng, kv_len, page_size, dims, sharing);
    let q: Vec<f64> = (0..plan.total_q() * dims.num_heads * dims.head_dim)
        .map(|_| rng.signed_unit())
        .collect();
    let scale = 1.0 / (dims.head_dim as f64).sqrt();
    let got = paged_attention(
        &cache.shape,
        &plan,
        &q,
        &cache.k,
        &cache.v,
        &cache.block_table,
        scale,
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let values: Vec<Params> = (0..q_len.len())
        .map(|s| {
            let mut v = shared.clone();
            if let Some(own) = &own {
                v.extend(own[s].clone());
            }
            v
        })
        .collect();
    let (out, lse) = dense(&program, &values, &plan, &cache, &q, scale);
    assert_eq!(got.out.len(), out.len());
    for (i, (g, w)) in got.out.iter().zip(&out).enumerate() {
        assert!((g - w).abs() <= 1e-12, "{what}: out[{i}] = {g}, dense {w}");
    }
    for (i, (g, w)) in got.lse.iter().zip(&lse).enumerate() {
        let same = (g == w) || (g - w).abs() <= 1e-12;
        assert!(same, "{what}: lse[{i}] = {g}, dense {w}");
    }
    // Rows that see no key: exactly 0 and -inf.
    for (i, w) in lse.iter().enumerate() {
        if *w == f64::NEG_INFINITY {
            let dv = dims.head_dim_v;
            assert!(
                got.out[i * dv..][..dv].iter().all(|&x| x == 0.0),
                "{what}: empty row {i}"
            );
        }
    }
    // The f32 path: the same computation from rounded inputs.
    let f = |x: &[f64]| x.iter().map(|&v| v as f32).collect::<Vec<f32>>();
    let got32 = paged_attention(
        &cache.shape,
        &plan,
        &f(&q),
        &f(&cache.k),
        &f(&cache.v),
        &cache.block_table,
        scale as f32,
    )
    .unwrap();
    for (g, w) in got32.out.iter().zip(&out) {
        assert!(
            (f64::from(*g) - w).abs() <= 1e-5,
            "{what}: f32 out {g} vs {w}"
        );
    }
}

const DIMS: [Dims; 3] = [
    Dims {
        num_heads: 4,
        num_kv_heads: 1,
        head_dim: 8,
        head_dim_v: 8,
    },
    Dims {
        num_heads: 8,
        num_kv_heads: 1,
        head_dim: 16,
        head_dim_v: 5,
    },
    Dims {
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 4,
        head_dim_v: 4,
    },
];

/// q_len 1 / 7 / 64 over kv_len 1 / 127 / 129 / 4097 in one step, GQA 4:1, 8:1 and 8:2, page
/// sizes 16 and 64 and a contiguous cache (one page of the longest kv_len per sequence).
#[test]
fn paged_equals_dense() {
    let q_len: &[i64] = &[1, 7, 64, 1, 64, 1, 7, 64, 7];
    let kv_len: &[i64] = &[1, 127, 127, 129, 129, 4097, 4097, 4097, 7];
    let none = vec![None; q_len.len()];
    let int = |name: &str, v: i64| params(&[(name, Value::Int(v))]);
    let cases: [(&str, Arc<cm_ir::Program>, Params); 4] = [
        ("causal", builtin("causal"), Params::new()),
        (
            "sliding_window",
            builtin("sliding_window"),
            int("window", 100),
        ),
        (
            "dilated_window",
            builtin("dilated_window"),
            params(&[("window", Value::Int(50)), ("dilation", Value::Int(3))]),
        ),
        // Rows before position 201 see no key.
        ("empty_rows", compile("mask = k < q - 200;"), Params::new()),
    ];
    let mut seed = 0;
    for (name, program, shared) in cases {
        for (di, dims) in DIMS.iter().enumerate() {
            for page_size in [16, 64, 4097] {
                seed += 1;
                let what = format!("{name}, dims {di}, page_size {page_size}");
                check(
                    &what,
                    program.clone(),
                    shared.clone(),
                    None,
                    q_len,
                    kv_len,
                    page_size,
                    *dims,
                    &none,
                    seed,
                );
            }
        }
    }
}

/// Shared prompt pages: three requests sharing a 256-token prompt (16 pages of 16) with
/// suffixes of their own, each scored with its own speculative tree (`tree_decode`), and a
/// fourth request sharing 2 pages of the first one's; the pages really are shared.
#[test]
fn shared_prompt_pages() {
    let trees: Vec<Vec<i64>> = vec![
        vec![-1, 0, 0, 1, 1, 2, 2],
        vec![-1, 0, 1, 2],
        (0..64)
            .map(|i| if i == 0 { -1 } else { (i - 1) / 3 })
            .collect(),
        vec![-1],
    ];
    let own: Vec<Params> = trees
        .iter()
        .map(|p| params(&[("parents", Value::Array(p.clone().into()))]))
        .collect();
    let q_len: Vec<i64> = trees.iter().map(|t| t.len() as i64).collect();
    let kv_len: Vec<i64> = vec![256 + 40 + 7, 256 + 4, 256 + 1 + 64, 33];
    let sharing = [None, Some((0, 16)), Some((0, 16)), Some((0, 2))];
    for (di, dims) in DIMS.iter().enumerate() {
        check(
            &format!("trees over a shared prompt, dims {di}"),
            builtin("tree_decode"),
            Params::new(),
            Some(own.clone()),
            &q_len,
            &kv_len,
            16,
            *dims,
            &sharing,
            40 + di as u8,
        );
    }
    let cache = page(&mut Gen::new(1), &kv_len, 16, DIMS[0], &sharing);
    let m = cache.shape.max_pages_per_seq;
    assert_eq!(cache.block_table[..16], cache.block_table[m..m + 16]);
    assert_eq!(
        cache.block_table[..16],
        cache.block_table[2 * m..2 * m + 16]
    );
    assert_ne!(cache.block_table[16], cache.block_table[m + 16]);
    // Parallel sampling: causal responses after the shared prompt.
    check(
        "causal over a shared prompt",
        builtin("causal"),
        Params::new(),
        None,
        &[1, 1, 64, 7],
        &kv_len,
        16,
        DIMS[1],
        &sharing,
        50,
    );
}

/// Bad caches and block tables are errors naming the value, never a fault.
#[test]
fn bad_inputs_are_errors() {
    let mut planner = StepPlanner::new(builtin("causal"), Params::new()).unwrap();
    let plan = planner.plan(&[1, 2], &[20, 5]).unwrap();
    let dims = DIMS[2];
    let cache = page(&mut Gen::new(9), &[20, 5], 8, dims, &[None, None]);
    let q = vec![0.5; 3 * dims.num_heads * dims.head_dim];
    let run = |shape: &PagedShape, q: &[f64], k: &[f64], v: &[f64], bt: &[i32], scale: f64| {
        paged_attention(shape, &plan, q, k, v, bt, scale)
    };
    let sh = cache.shape;
    assert!(run(&sh, &q, &cache.k, &cache.v, &cache.block_table, 1.0).is_ok());
    let e = |r: Result<_, PagedError>| r.unwrap_err().to_string();
    assert_eq!(
        e(run(
            &sh,
            &q[1..],
            &cache.k,
            &cache.v,
            &cache.block_table,
            1.0
        )),
        format!(
            "q has {} elements, expected {} = [total_q, num_heads, head_dim]",
            q.len() - 1,
            q.len()
        )
    );
    assert!(e(run(
        &sh,
        &q,
        &cache.k[1..],
        &cache.v,
        &cache.block_table,
        1.0
    ))
    .starts_with("k_cache has"));
    assert!(e(run(
        &sh,
        &q,
        &cache.k,
        &cache.v[1..],
        &cache.block_table,
        1.0
    ))
    .starts_with("v_cache has"));
    assert!(e(run(
        &sh,
        &q,
        &cache.k,
        &cache.v,
        &cache.block_table[1..],
        1.0
    ))
    .starts_with("block_table has"));
    assert_eq!(
        e(run(
            &sh,
            &q,
            &cache.k,
            &cache.v,
            &cache.block_table,
            f64::NAN
        )),
        "softmax_scale = NaN is not finite"
    );
    let mut bt = cache.block_table.clone();
    bt[1] = sh.num_pages as i32;
    assert_eq!(
        e(run(&sh, &q, &cache.k, &cache.v, &bt, 1.0)),
        format!(
            "block_table[0][1] = {} is out of range; sequence 0 reads it, so it must name a page \
             of the cache, in [0, num_pages) = [0, {})",
            sh.num_pages, sh.num_pages
        )
    );
    bt[1] = -3;
    assert!(e(run(&sh, &q, &cache.k, &cache.v, &bt, 1.0))
        .starts_with("block_table[0][1] = -3 is out of range"));
    // Entries past a sequence's pages are never read (they hold -1 here).
    assert_eq!(cache.block_table[sh.max_pages_per_seq + 1], -1);
    let narrow = PagedShape {
        max_pages_per_seq: 2,
        ..sh
    };
    let bt2: Vec<i32> = (0..2)
        .flat_map(|s| cache.block_table[s * sh.max_pages_per_seq..][..2].to_vec())
        .collect();
    assert_eq!(
        e(run(&narrow, &q, &cache.k, &cache.v, &bt2, 1.0)),
        "sequence 0 has kv_len = 20, which needs 3 pages of 8 slots, but the block table has max_pages_per_seq = 2"
    );
    for (what, bad) in [
        ("num_heads", PagedShape { num_heads: 0, ..sh }),
        (
            "num_kv_heads",
            PagedShape {
                num_kv_heads: 0,
                ..sh
            },
        ),
        ("head_dim", PagedShape { head_dim: 0, ..sh }),
        (
            "head_dim_v",
            PagedShape {
                head_dim_v: 0,
                ..sh
            },
        ),
        ("page_size", PagedShape { page_size: 0, ..sh }),
    ] {
        assert_eq!(
            e(run(&bad, &q, &cache.k, &cache.v, &cache.block_table, 1.0)),
            format!("{what} = 0; it must be at least 1")
        );
    }
    assert!(e(run(
        &PagedShape { num_heads: 7, ..sh },
        &q,
        &cache.k,
        &cache.v,
        &cache.block_table,
        1.0
    ))
    .starts_with("num_heads = 7 is not a multiple of num_kv_heads = 2"));
    // A NaN in a slot a sequence reads is named where the caller put it: page, slot, kv
    // head and element of the cache, and the sequence's position.
    let mut k = cache.k.clone();
    let page = cache.block_table[sh.max_pages_per_seq] as usize;
    k[((page * 8 + 3) * 2 + 1) * 4 + 2] = f64::NAN;
    assert_eq!(
        e(run(&sh, &q, &k, &cache.v, &cache.block_table, 1.0)),
        format!(
            "k_cache[{page}, 3, 1, 2] (sequence 1, position 3) is NaN; the reference needs \
             finite inputs"
        )
    );
    let mut v = cache.v.clone();
    v[(page * 8 * 2) * dims.head_dim_v] = f64::INFINITY;
    assert!(
        e(run(&sh, &q, &cache.k, &v, &cache.block_table, 1.0)).starts_with(&format!(
            "v_cache[{page}, 0, 0, 0] (sequence 1, position 0) is inf"
        ))
    );
    let mut q_bad = q.clone();
    q_bad[(2 * dims.num_heads + 3) * dims.head_dim + 1] = f64::NAN;
    let msg = e(run(
        &sh,
        &q_bad,
        &cache.k,
        &cache.v,
        &cache.block_table,
        1.0,
    ));
    assert!(
        msg.starts_with("q[2, 3, 1] (sequence 1, its row 1) is NaN"),
        "{msg}"
    );
}
