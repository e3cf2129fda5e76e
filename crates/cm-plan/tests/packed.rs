//! Packed (cu_seqlens) plans against two independent references: the per-sample plans'
//! rows shifted into place, and the pairwise semantics `Bound::visible` of each sample
//! evaluated over every packed key (keys of other samples must be invisible). Tile classes
//! against a dense evaluation of the packed matrix. Empty samples (no queries or no keys),
//! `q_len != kv_len` per sample, samples shorter than a tile, masks that read `b` and `h`.
//! Also every validation error and the sharing of work between equal samples.

#[allow(dead_code)]
mod common;

use cm_ir::{Program, Shape, Value};
use cm_plan::{plan, plan_packed, Packing, Plan, TileShape};
use common::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::BTreeMap;

/// The masks the property runs over: `(source or builtin name, parameters)`. All of them
/// plan without error at any lengths >= 1.
fn programs() -> Vec<(Program, BTreeMap<String, Value>)> {
    vec![
        (builtin("causal"), params(&[])),
        (builtin("causal_bottom_right"), params(&[])),
        (
            builtin("sliding_window"),
            params(&[("window", Value::Int(3))]),
        ),
        (builtin("prefix_lm"), params(&[("prefix", Value::Int(4))])),
        (
            builtin("document_causal"),
            params(&[("lengths", arr(&[5, 0, 3, 9]))]),
        ),
        (
            builtin("hstu"),
            params(&[("lengths", arr(&[7, 2, 12])), ("contextual", Value::Int(2))]),
        ),
        // Reads the batch index: the sample's own cutoff, and `batch` (the sample count).
        (
            compile(
                "param n: [int] = [1, 4, 0, 7];\n\
                 mask = if q < n[b % 4] + batch then k <= q else k < kv_len;",
            ),
            params(&[]),
        ),
        // Reads the head index: a per-head window over bottom-right causal.
        (
            compile("mask = q + kv_len - q_len - h - 1 <= k & k <= q + kv_len - q_len;"),
            params(&[]),
        ),
        // A segmentation per batch index: sample b's documents are a slice of one array.
        (
            compile(
                "param lens: [int] = [2, 3, 1, 4, 5, 2];\nparam offs: [int] = [0, 2, 3, 6];\n\
                 segments doc = lens[offs[b % 3] .. offs[b % 3 + 1]];\n\
                 mask = k in doc(q).start ..= q;",
            ),
            params(&[]),
        ),
        // Reads both, with two intervals per row.
        (
            compile("mask = k < (b + h) % 3 + 1 | q - 2 <= k & k <= q;"),
            params(&[]),
        ),
    ]
}

fn rows_of(plan: &Plan, h: u32, r: u32) -> Vec<(u32, u32)> {
    plan.mask(0, h)
        .rows
        .row_expanded(r)
        .iter()
        .map(|iv| (iv.start, iv.end))
        .collect()
}

/// Checks a packed plan against both references; returns an error naming what differs.
fn check_packed(
    program: &Program,
    values: &BTreeMap<String, Value>,
    cu_q: &[i64],
    cu_k: &[i64],
    num_heads: i64,
    tile: TileShape,
) -> Result<(), TestCaseError> {
    let packing = Packing::new(cu_q, cu_k).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let packed = plan_packed(program, &packing, num_heads, values, tile)
        .map_err(|e| TestCaseError::fail(format!("plan_packed failed: {e}")))?;
    let batch = cu_q.len() - 1;
    let (total_q, total_k) = (cu_q[batch] as u32, cu_k[batch] as u32);
    prop_assert_eq!((packed.q_len, packed.kv_len), (total_q, total_k));
    prop_assert_eq!((packed.batch, packed.num_heads), (1, num_heads as u32));
    prop_assert_eq!(packed.mask_index.len(), num_heads as usize);
    prop_assert_eq!(packed.packing.as_ref(), Some(&packing));
    for h in 0..num_heads as u32 {
        let m = packed.mask(0, h);
        m.rows
            .validate()
            .map_err(|e| TestCaseError::fail(format!("head {h}: {e}")))?;
        let mut dense = vec![false; total_q as usize * total_k as usize];
        for b in 0..batch {
            let (q0, lq) = (cu_q[b], cu_q[b + 1] - cu_q[b]);
            let (k0, lk) = (cu_k[b], cu_k[b + 1] - cu_k[b]);
            prop_assert_eq!(packing.lengths(b as u32), (lq as u32, lk as u32));
            if lq == 0 {
                continue;
            }
            if lk == 0 {
                for i in 0..lq {
                    prop_assert!(
                        rows_of(&packed, h, (q0 + i) as u32).is_empty(),
                        "sample {} has no keys, but its row {} sees some",
                        b,
                        i
                    );
                }
                continue;
            }
            let shape = Shape {
                q_len: lq,
                kv_len: lk,
                batch: batch as i64,
                num_heads,
            };
            let bound = program.bind(shape, values).unwrap();
            // Reference 1: the sample planned on its own, shifted.
            let own = plan(&bound, tile).unwrap();
            for i in 0..lq {
                let r = (q0 + i) as u32;
                prop_assert_eq!(packing.sample_of_row(r), Some(b as u32));
                let want: Vec<(u32, u32)> = own
                    .mask(
                        b as u32 * u32::from(program.uses_b),
                        h * u32::from(program.uses_h),
                    )
                    .rows
                    .row_expanded(i as u32)
                    .iter()
                    .map(|iv| (iv.start + k0 as u32, iv.end + k0 as u32))
                    .collect();
                let got = rows_of(&packed, h, r);
                prop_assert_eq!(
                    &got,
                    &want,
                    "sample {} row {} head {} vs its own plan",
                    b,
                    i,
                    h
                );
                // Reference 2: the pairwise semantics over every packed key.
                for c in 0..total_k as i64 {
                    let inside = (k0..k0 + lk).contains(&c);
                    let visible = inside
                        && bound
                            .visible(i, c - k0, b as i64, i64::from(h))
                            .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(
                        m.rows.is_visible(r, c as u32),
                        visible,
                        "sample {} row {} head {} key {} (packed)",
                        b,
                        i,
                        h,
                        c
                    );
                    dense[r as usize * total_k as usize + c as usize] = visible;
                }
            }
        }
        check_tiles(&m.tiles, &dense, total_q, total_k);
    }
    Ok(())
}

fn config() -> ProptestConfig {
    let cases = std::env::var("CM_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok());
    ProptestConfig {
        cases: cases.unwrap_or(96),
        failure_persistence: None,
        rng_seed: match cases {
            None => proptest::test_runner::RngSeed::Fixed(0x00c0_5eed),
            Some(_) => ProptestConfig::default().rng_seed,
        },
        ..ProptestConfig::default()
    }
}

/// Sample lengths: mostly short (shorter than most tiles), some zero, some longer.
fn length() -> impl Strategy<Value = i64> {
    prop_oneof![2 => Just(0i64), 6 => 1i64..=9, 3 => 10i64..=40, 1 => 41i64..=90]
}

/// `(query lengths, key lengths)` of 1..=6 samples, equal or independent.
fn samples() -> impl Strategy<Value = (Vec<i64>, Vec<i64>)> {
    (1usize..=6, any::<bool>())
        .prop_flat_map(|(n, same)| {
            (
                proptest::collection::vec(length(), n),
                proptest::collection::vec(length(), n),
                Just(same),
            )
        })
        .prop_map(|(q, k, same)| if same { (q.clone(), q) } else { (q, k) })
        .prop_filter("a packing needs one query and one key", |(q, k)| {
            q.iter().sum::<i64>() > 0 && k.iter().sum::<i64>() > 0
        })
}

fn prefix(lengths: &[i64]) -> Vec<i64> {
    let mut out = vec![0];
    for l in lengths {
        out.push(out[out.len() - 1] + l);
    }
    out
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn packed_rows_equal_per_sample_rows(
        which in 0usize..9,
        (lq, lk) in samples(),
        num_heads in 1i64..=3,
        bm in prop_oneof![Just(1u32), 2u32..=9, Just(16u32), Just(128u32)],
        bn in prop_oneof![Just(1u32), 2u32..=9, Just(16u32), Just(128u32)],
    ) {
        let (program, values) = programs().swap_remove(which);
        check_packed(
            &program,
            &values,
            &prefix(&lq),
            &prefix(&lk),
            num_heads,
            TileShape { block_m: bm, block_n: bn },
        )?;
    }
}

#[test]
fn named_cases() {
    let t = |m, n| TileShape {
        block_m: m,
        block_n: n,
    };
    let cases: &[(&[i64], &[i64])] = &[
        (&[0, 5, 12], &[0, 5, 12]),            // the CLI example
        (&[0, 0, 3, 3, 10], &[0, 4, 4, 9, 9]), // empty q, empty k, both
        (&[0, 1], &[0, 1]),                    // one token
        (&[0, 3, 200], &[0, 150, 151]),        // q_len != kv_len both ways, longer than a tile
    ];
    for (which, (program, values)) in programs().iter().enumerate() {
        for (cu_q, cu_k) in cases {
            for tile in [t(128, 128), t(4, 4), t(3, 7)] {
                check_packed(program, values, cu_q, cu_k, 2, tile)
                    .unwrap_or_else(|e| panic!("program {which}, {cu_q:?} / {cu_k:?}: {e}"));
            }
        }
    }
}

#[test]
fn equal_samples_share_their_solution() {
    let program = builtin("hstu");
    let values = params(&[("lengths", arr(&[7, 2, 12])), ("contextual", Value::Int(2))]);
    let tile = TileShape::default();
    let one = plan_packed(
        &program,
        &Packing::new(&[0, 40], &[0, 40]).unwrap(),
        1,
        &values,
        tile,
    )
    .unwrap();
    let four = plan_packed(
        &program,
        &Packing::new(&[0, 40, 80, 80, 120, 160], &[0, 40, 80, 80, 120, 160]).unwrap(),
        4,
        &values,
        tile,
    )
    .unwrap();
    assert_eq!(four.pieces, one.pieces, "equal samples are solved once");
    assert_eq!(
        four.masks.len(),
        1,
        "a mask that reads no h has one packed mask"
    );
    assert_eq!(four.mask_index, vec![0; 4]);
    assert_eq!(four.visible_pairs(), 4 * 4 * one.visible_pairs());
    // A mask reading h: one packed mask per distinct head mask.
    let per_head = compile("mask = q - h <= k & k <= q;");
    let p = plan_packed(
        &per_head,
        &Packing::new(&[0, 5, 9], &[0, 5, 9]).unwrap(),
        3,
        &params(&[]),
        tile,
    )
    .unwrap();
    assert_eq!(p.masks.len(), 3);
    assert_eq!(p.mask_index, vec![0, 1, 2]);
}

#[test]
fn sample_of_row_skips_empty_samples() {
    let p = Packing::new(&[0, 0, 3, 3, 5], &[0, 1, 2, 3, 4]).unwrap();
    let owners: Vec<Option<u32>> = (0..6).map(|r| p.sample_of_row(r)).collect();
    assert_eq!(owners, [Some(1), Some(1), Some(1), Some(3), Some(3), None]);
    assert_eq!((p.batch(), p.total_q(), p.total_k()), (4, 5, 4));
    assert_eq!(p.cu_seqlens_q(), [0, 0, 3, 3, 5]);
    assert_eq!(p.cu_seqlens_k(), [0, 1, 2, 3, 4]);
}

#[test]
fn bad_offsets_are_clear_errors() {
    let cases: &[(&[i64], &[i64], &str)] = &[
        (&[], &[], "cu_seqlens_q is empty"),
        (&[0], &[0], "has 1 entry"),
        (&[1, 5], &[0, 5], "must start at 0, got cu_seqlens_q[0] = 1"),
        (&[0, 5], &[-1, 5], "cu_seqlens_k must start at 0"),
        (&[0, 5, 3], &[0, 5, 6], "cu_seqlens_q decreases at index 2"),
        (
            &[0, 5, 6],
            &[0, 5],
            "cu_seqlens_q has 3 entries but cu_seqlens_k has 2",
        ),
        (
            &[0, 1 << 26, (1 << 26) + 1],
            &[0, 1, 2],
            "exceeds the longest",
        ),
        (&[0, i64::MAX], &[0, 1], "exceeds the longest"),
        (&[0, 0, 0], &[0, 1, 2], "0 queries"),
        (&[0, 4], &[0, 0], "0 keys"),
    ];
    for (q, k, want) in cases {
        let e = Packing::new(q, k).unwrap_err();
        assert_eq!(e.code, "CM0409", "{q:?} / {k:?}");
        assert!(e.message.contains(want), "{q:?} / {k:?}: {}", e.message);
    }
    let p = Packing::new(&[0, 4], &[0, 4]).unwrap();
    let causal = builtin("causal");
    let tile = TileShape::default();
    let e = plan_packed(&causal, &p, 0, &params(&[]), tile).unwrap_err();
    assert_eq!(e.code, "CM0402");
    let e = plan_packed(
        &causal,
        &p,
        1,
        &params(&[]),
        TileShape {
            block_m: 0,
            block_n: 4,
        },
    )
    .unwrap_err();
    assert_eq!(e.code, "CM0401");
    // Unknown parameters fail even when no sample is bound.
    let empty = Packing::new(&[0, 0, 3], &[0, 2, 2]).unwrap();
    let e = plan_packed(
        &builtin("sliding_window"),
        &empty,
        1,
        &params(&[("windw", Value::Int(3))]),
        tile,
    )
    .unwrap_err();
    assert_eq!(e.code, "CM0309");
    assert!(e.hint.unwrap().contains("window"));
    // A sample whose binding fails names the sample.
    let e = plan_packed(
        &builtin("sliding_window"),
        &Packing::new(&[0, 3, 5], &[0, 3, 5]).unwrap(),
        1,
        &params(&[("window", Value::Int(0))]),
        tile,
    )
    .unwrap_err();
    assert_eq!(e.code, "CM0305");
    assert!(
        e.message
            .contains("packed sample b = 0: q_len = 3, kv_len = 3"),
        "{}",
        e.message
    );
}
