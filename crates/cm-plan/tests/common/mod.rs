//! Shared helpers: compile a program, bind it, and compare the analytical plan with the
//! brute-force pairwise semantics of `cm_ir`.

use cm_ir::{Program, Shape, Value};
use cm_plan::{plan, Plan, TileShape};
use std::collections::BTreeMap;

pub fn compile(src: &str) -> Program {
    let (p, diags) = cm_stdlib::compile(src);
    match p {
        Some(p) => p,
        None => panic!("program failed to compile: {diags:?}\n{src}"),
    }
}

pub fn builtin(name: &str) -> Program {
    compile(
        cm_stdlib::get(name)
            .unwrap_or_else(|| panic!("no builtin {name}"))
            .source,
    )
}

pub fn params(list: &[(&str, Value)]) -> BTreeMap<String, Value> {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

pub fn arr(v: &[i64]) -> Value {
    Value::Array(v.to_vec().into())
}

pub fn shape(q_len: i64, kv_len: i64) -> Shape {
    Shape {
        q_len,
        kv_len,
        batch: 1,
        num_heads: 1,
    }
}

/// Row `q` of a mask's rows as `(start, end)` pairs.
pub fn row_pairs(rows: &cm_plan::RowIntervals, q: u32) -> Vec<(u32, u32)> {
    rows.row_expanded(q)
        .iter()
        .map(|iv| (iv.start, iv.end))
        .collect()
}

/// Plans `program` and checks every row of every (batch, head) against brute force, and
/// every tile class against a dense evaluation. Returns the plan.
pub fn check_against_brute_force(
    program: &Program,
    shape: Shape,
    values: &BTreeMap<String, Value>,
    tile: TileShape,
) -> Plan {
    let bound = program
        .bind(shape, values)
        .unwrap_or_else(|e| panic!("bind failed: {e}"));
    let plan = plan(&bound, tile).unwrap_or_else(|e| panic!("plan failed: {e}"));
    for b in 0..shape.batch {
        for h in 0..shape.num_heads {
            let m = plan.mask(b as u32, h as u32);
            m.rows.validate().unwrap();
            let mut dense = vec![false; (shape.q_len * shape.kv_len) as usize];
            for q in 0..shape.q_len {
                let want = bound.brute_force_row(q, b, h).unwrap();
                let got: Vec<(u32, u32)> = m
                    .rows
                    .row_expanded(q as u32)
                    .iter()
                    .map(|iv| (iv.start, iv.end))
                    .collect();
                assert_eq!(got, want, "row {q} (b={b}, h={h}) differs from brute force");
                for (s, e) in want {
                    for k in s..e {
                        dense[(q * shape.kv_len) as usize + k as usize] = true;
                    }
                }
            }
            check_tiles(&m.tiles, &dense, shape.q_len as u32, shape.kv_len as u32);
            check_partial_rows(m, &dense).unwrap_or_else(|e| panic!("b={b}, h={h}: {e}"));
        }
    }
    plan
}

/// Tile classes and transposes against the dense matrix.
pub fn check_tiles(t: &cm_plan::TileDescriptor, dense: &[bool], q_len: u32, kv_len: u32) {
    let (bm, bn) = (t.tile.block_m, t.tile.block_n);
    let mut full = Vec::new();
    let mut partial = Vec::new();
    let mut computed = 0u64;
    for m in 0..q_len.div_ceil(bm) {
        for n in 0..kv_len.div_ceil(bn) {
            let (mut any, mut all) = (false, true);
            let rows = m * bm..((m + 1) * bm).min(q_len);
            let cols = n * bn..((n + 1) * bn).min(kv_len);
            for q in rows.clone() {
                for k in cols.clone() {
                    let v = dense[(q * kv_len + k) as usize];
                    any |= v;
                    all &= v;
                }
            }
            if any {
                computed += u64::from(rows.len() as u32) * u64::from(cols.len() as u32);
                if all {
                    full.push((m, n))
                } else {
                    partial.push((m, n))
                }
            }
        }
    }
    let csr = |off: &[u32], idx: &[u32]| -> Vec<(u32, u32)> {
        off.windows(2)
            .enumerate()
            .flat_map(|(m, w)| {
                idx[w[0] as usize..w[1] as usize]
                    .iter()
                    .map(move |&n| (m as u32, n))
            })
            .collect()
    };
    assert_eq!(
        csr(&t.full_kv_offsets, &t.full_kv_indices),
        full,
        "full tiles"
    );
    assert_eq!(csr(&t.kv_offsets, &t.kv_indices), partial, "partial tiles");
    assert_eq!(t.computed_pairs, computed, "computed pairs");
    let mut full_t: Vec<(u32, u32)> = csr(&t.full_q_offsets, &t.full_q_indices)
        .into_iter()
        .map(|(n, m)| (m, n))
        .collect();
    full_t.sort();
    assert_eq!(full_t, full, "full transpose");
    let pt = csr(&t.q_offsets, &t.q_indices);
    let mut part_t: Vec<(u32, u32)> = pt.iter().map(|&(n, m)| (m, n)).collect();
    part_t.sort();
    assert_eq!(part_t, partial, "partial transpose");
    for (i, &(n, m)) in pt.iter().enumerate() {
        assert_eq!(
            partial[t.q_partial_ids[i] as usize],
            (m, n),
            "q_partial_ids"
        );
    }
}

/// The per-row form of partial tiles: walking the intervals from `partial_row_first` as a
/// kernel does reproduces the tile's visible keys exactly.
pub fn check_partial_rows(
    m: &cm_plan::MaskPlan,
    dense: &[bool],
) -> Result<(), proptest::test_runner::TestCaseError> {
    let t = &m.tiles;
    let per_row = t.partial_rows(&m.rows);
    let (bm, bn) = (t.tile.block_m, t.tile.block_n);
    let (q_len, kv_len) = (t.q_len, t.kv_len);
    let row_ptr = m.rows.row_ptr();
    let ivs = m.rows.all_runs();
    let strides = m.rows.strides();
    let mut p = 0usize;
    for mb in 0..t.num_m_blocks {
        let (a, z) = (
            t.kv_offsets[mb as usize] as usize,
            t.kv_offsets[mb as usize + 1] as usize,
        );
        for &nb in &t.kv_indices[a..z] {
            let k0 = nb * bn;
            let k1 = (k0 + bn).min(kv_len);
            let stride = per_row.partial_row_stride;
            proptest::prop_assert!(stride == bm || stride == bm.min(q_len), "stride {}", stride);
            for r in 0..stride {
                let q = mb * bm + r;
                let first = per_row.partial_row_first[p * stride as usize + r as usize];
                if q >= q_len {
                    proptest::prop_assert_eq!(first, row_ptr[q_len as usize], "padding row");
                    continue;
                }
                let mut want = Vec::new();
                for k in k0..k1 {
                    if dense[(q * kv_len + k) as usize] {
                        want.push(k);
                    }
                }
                let mut got = Vec::new();
                let mut i = first as usize;
                proptest::prop_assert!(i >= row_ptr[q as usize] as usize, "first before row start");
                if i > row_ptr[q as usize] as usize {
                    proptest::prop_assert!(
                        ivs[i - 1].end <= k0,
                        "skipped an interval ending in the tile"
                    );
                }
                while i < row_ptr[q as usize + 1] as usize && ivs[i].start < k1 {
                    // A strided run's keys: its start plus multiples of its stride.
                    let st = strides.get(i).copied().unwrap_or(1);
                    for k in ivs[i].start.max(k0)..ivs[i].end.min(k1) {
                        if (k - ivs[i].start).is_multiple_of(st) {
                            got.push(k);
                        }
                    }
                    i += 1;
                }
                proptest::prop_assert_eq!(got, want, "partial tile ({}, {}) row {}", mb, nb, q);
            }
            p += 1;
        }
    }
    Ok(())
}
