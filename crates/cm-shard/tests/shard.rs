//! `cm_shard::shard` against brute force: every rank's parts, mapped back through the fetched
//! key ranges and the token order, hold exactly the original mask's visible pairs of its
//! rows, once each; chunks are dealt whole with the capacities; work and fetch counts are the
//! pairs and keys they claim; balance on the masks context parallelism is for.

use cm_plan::order::computed_pairs;
use cm_plan::rows::RowIntervals;
use cm_plan::tiles::TileShape;
use cm_shard::{shard, ShardError, Sharding, MAX_KEY_RANGES};
use cm_testkit::config::{env_config, PROPTEST_CASES};
use proptest::prelude::*;
use std::collections::BTreeSet;

/// Visible keys of every row, as sets.
fn dense(rows: &RowIntervals) -> Vec<BTreeSet<u32>> {
    (0..rows.q_len())
        .map(|q| rows.row(q).iter().flat_map(|iv| iv.start..iv.end).collect())
        .collect()
}

/// Checks every claim of `s` about `rows` pair by pair; computed pairs at `tile` against
/// the parts' rows planned one by one.
fn check(rows: &RowIntervals, s: &Sharding, tile: TileShape) {
    let len = rows.q_len();
    let want = dense(rows);
    let ranks = s.ranks as usize;
    // The chunks: each dealt once, the counts the capacities, tokens in order per rank.
    let num = len.div_ceil(s.chunk) as usize;
    let mut seen = vec![false; num];
    for (r, cs) in s.chunks.iter().enumerate() {
        assert_eq!(cs.len(), num / ranks + usize::from(r < num % ranks));
        assert!(cs.windows(2).all(|w| w[0] < w[1]));
        for &c in cs {
            assert!(!std::mem::replace(&mut seen[c as usize], true));
        }
        let tokens: Vec<u32> = cs
            .iter()
            .flat_map(|&c| c * s.chunk..((c + 1) * s.chunk).min(len))
            .collect();
        let held = &s.order.order[s.offsets[r] as usize..s.offsets[r + 1] as usize];
        assert_eq!(held, &tokens[..]);
    }
    assert!(seen.iter().all(|&x| x));
    assert_eq!(s.offsets[ranks], len);
    let mut ranges = 0;
    for (r, &computed_r) in s.computed_pairs(tile).iter().enumerate() {
        let n_r = s.shard_len(r);
        let mut got: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); n_r as usize];
        let mut fetched = 0u64;
        let mut reads = Vec::new();
        let mut computed = 0u64;
        for src in 0..ranks {
            let part = s.part(r, src);
            assert_eq!(part.keys, s.keys(r, src));
            ranges += part.keys.len();
            if !part.keys.is_empty() {
                reads.push(src as u32);
            }
            computed += computed_pairs(&part.rows, tile);
            assert_eq!(part.rows.q_len(), n_r);
            assert_eq!(part.rows.kv_len(), part.fetched());
            part.rows.validate().unwrap();
            assert!(part.keys.windows(2).all(|w| w[0].1 < w[1].0));
            assert!(part
                .keys
                .iter()
                .all(|&(a, b)| a < b && b <= s.shard_len(src)));
            // Compacted key j back to its original token.
            let originals: Vec<u32> = part
                .keys
                .iter()
                .flat_map(|&(a, b)| a..b)
                .map(|local| s.order.order[(s.offsets[src] + local) as usize])
                .collect();
            let mut used = vec![false; originals.len()];
            for (i, set) in got.iter_mut().enumerate() {
                for iv in part.rows.row(i as u32) {
                    for j in iv.start..iv.end {
                        used[j as usize] = true;
                        assert!(set.insert(originals[j as usize]), "pair counted twice");
                    }
                }
            }
            // Only keys some row sees are fetched.
            assert!(used.iter().all(|&u| u));
            if src != r {
                fetched += u64::from(part.fetched());
            }
        }
        let mut pairs = 0u64;
        for (i, set) in got.iter().enumerate() {
            let q = s.order.order[(s.offsets[r] + i as u32) as usize];
            assert_eq!(
                set, &want[q as usize],
                "rank {r}, local row {i} (token {q})"
            );
            pairs += set.len() as u64;
        }
        assert_eq!(s.sources(r).collect::<Vec<_>>(), reads);
        assert_eq!(computed_r, computed, "rank {r} at {tile:?}");
        assert_eq!(s.work[r], pairs);
        assert_eq!(s.fetched(r), fetched);
        assert!(fetched <= s.ring_fetched(r));
    }
    assert_eq!(s.key_ranges(), ranges);
}

/// Random masks: each row a few random intervals.
fn random_rows(len: u32, seed: u64) -> RowIntervals {
    let mut x = seed | 1;
    let mut next = move |m: u32| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % u64::from(m.max(1))) as u32
    };
    let rows: Vec<Vec<(u32, u32)>> = (0..len)
        .map(|_| {
            let mut cuts: Vec<u32> = (0..2 * next(4)).map(|_| next(len + 1)).collect();
            cuts.sort_unstable();
            cuts.dedup();
            cuts.chunks_exact(2)
                .map(|w| (w[0], w[1]))
                .filter(|&(a, b)| a < b)
                .collect::<Vec<_>>()
        })
        .map(|mut row| {
            // Maximal: join intervals that touch.
            let mut out: Vec<(u32, u32)> = Vec::new();
            row.sort_unstable();
            for (a, b) in row {
                match out.last_mut() {
                    Some(l) if a <= l.1 => l.1 = l.1.max(b),
                    _ => out.push((a, b)),
                }
            }
            out
        })
        .collect();
    RowIntervals::from_rows(len, &rows).unwrap()
}

fn causal(len: u32) -> RowIntervals {
    let rows: Vec<Vec<(u32, u32)>> = (0..len).map(|q| vec![(0, q + 1)]).collect();
    RowIntervals::from_rows(len, &rows).unwrap()
}

/// Causal documents of the given lengths, one after the other.
fn documents(lengths: &[u32]) -> RowIntervals {
    let mut rows = Vec::new();
    let mut start = 0;
    for &l in lengths {
        for q in start..start + l {
            rows.push(vec![(start, q + 1)]);
        }
        start += l;
    }
    RowIntervals::from_rows(start, &rows).unwrap()
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 300, 0x5a4d))]

    #[test]
    fn parts_hold_exactly_the_visible_pairs(
        len in 1u32..90,
        ranks in 1u32..6,
        chunk in 1u32..20,
        seed in any::<u64>(),
        block_m in 1u32..20,
        block_n in 1u32..20,
    ) {
        let rows = random_rows(len, seed);
        match shard(&rows, ranks, chunk) {
            Ok(s) => check(&rows, &s, TileShape { block_m, block_n }),
            Err(ShardError::TooFewChunks { chunks, .. }) => prop_assert!(chunks < ranks),
            Err(ShardError::TooManyRanks { len: l, ranks: r }) => prop_assert!(l < r),
            Err(e) => prop_assert!(false, "{e}"),
        }
    }
}

proptest! {
    #![proptest_config(env_config(PROPTEST_CASES, 200, 0x5a4e))]

    /// Up to a rank per token: each rank's rows reach most sources, the case the
    /// communication plan has to stay sparse for.
    #[test]
    fn many_ranks_hold_exactly_the_visible_pairs(
        len in 1u32..70,
        ranks_per_len in 0.5f64..=1.0,
        chunk in 1u32..3,
        seed in any::<u64>(),
        block_m in 1u32..6,
        block_n in 1u32..6,
    ) {
        let rows = random_rows(len, seed);
        let ranks = ((f64::from(len.div_ceil(chunk)) * ranks_per_len) as u32).max(1);
        let s = shard(&rows, ranks, chunk).unwrap();
        check(&rows, &s, TileShape { block_m, block_n });
    }
}

/// A causal mask with a rank per token: the rank holding token `q` reads one key from each
/// rank holding a token up to `q`, and computes one pair per part.
#[test]
fn a_rank_per_token() {
    let len = 4096u32;
    let s = shard(&causal(len), len, 1).unwrap();
    let tile = TileShape::default();
    let computed = s.computed_pairs(tile);
    for r in [0usize, 1, 1000, 2047, 4095] {
        let q = s.order.order[s.offsets[r] as usize];
        assert_eq!(s.work[r], u64::from(q) + 1);
        assert_eq!(s.fetched(r), u64::from(q));
        assert_eq!(s.sources(r).count() as u32, q + 1);
        assert_eq!(computed[r], u64::from(q) + 1);
        for src in s.sources(r) {
            assert_eq!(s.keys(r, src as usize), &[(0, 1)]);
            assert!(s.order.order[s.offsets[src as usize] as usize] <= q);
        }
        let part = s.part(r, s.sources(r).next().unwrap() as usize);
        assert_eq!((part.rows.q_len(), part.rows.kv_len()), (1, 1));
    }
    assert_eq!(
        s.key_ranges() as u64,
        u64::from(len) * u64::from(len + 1) / 2
    );
    assert_eq!(
        (0..len as usize).map(|r| s.fetched(r)).sum::<u64>(),
        u64::from(len) * u64::from(len - 1) / 2
    );
}

#[test]
fn odd_lengths_of_the_context_parallel_masks() {
    for len in [1u32, 127, 129, 1000, 1023] {
        for ranks in [1, 2, 3, 4] {
            for chunk in [1, 16, 64] {
                if len.div_ceil(chunk) < ranks {
                    continue;
                }
                for rows in [
                    causal(len),
                    documents(&[len / 3, len / 5, len - len / 3 - len / 5]),
                ] {
                    check(
                        &rows,
                        &shard(&rows, ranks, chunk).unwrap(),
                        TileShape::default(),
                    );
                }
            }
        }
    }
}

/// The default chunk: the largest of 512, 256, 128, 64 leaving 4 chunks per rank (64 when
/// none does), or q_len / ranks where 64 leaves fewer chunks than ranks; every default deals,
/// and on the short sequences where 512 gave one chunk per rank the deal now balances.
#[test]
fn the_default_chunk_leaves_room_to_balance() {
    for (q_len, ranks, want) in [
        (1000, 2, 128),
        (1000, 3, 64),
        (2000, 8, 64),
        (4096, 2, 512),
        (4096, 8, 128),
        (65536, 8, 512),
        (300, 2, 64),
        (100, 64, 1),
        (200, 3, 64),
        (200, 4, 64),
        (200, 5, 40),
        (7, 7, 1),
        (1, 1, 64),
        (u32::MAX, 1, 512),
        (u32::MAX, u32::MAX, 1),
    ] {
        assert_eq!(
            cm_shard::default_chunk(q_len, ranks),
            want,
            "q_len {q_len}, ranks {ranks}"
        );
    }
    for q_len in 1..=600u32 {
        for ranks in 1..=q_len.min(12) {
            let c = cm_shard::default_chunk(q_len, ranks);
            let chunks = q_len.div_ceil(c);
            assert!(chunks >= ranks, "q_len {q_len}, ranks {ranks}: chunk {c}");
            let candidates = [512u32, 256, 128, 64];
            let fits = candidates.iter().find(|&&x| q_len.div_ceil(x) >= 4 * ranks);
            let expected = match fits {
                Some(&x) => x,
                None if q_len.div_ceil(64) >= ranks => 64,
                None => q_len / ranks,
            };
            assert_eq!(c, expected, "q_len {q_len}, ranks {ranks}");
        }
    }
    // Causal 1000 over 2: 2 chunks of 512 kept the split by positions' 1.5x.
    let rows = causal(1000);
    let s = shard(&rows, 2, cm_shard::default_chunk(1000, 2)).unwrap();
    let mean = s.work.iter().sum::<u64>() as f64 / 2.0;
    let max = *s.work.iter().max().unwrap() as f64;
    assert!(max / mean < 1.02, "{:?}", s.work);
}

/// Causal and packed documents at 64K in chunks of 512: every rank within 1% of the mean
/// work (the position split's last rank does 1.5x / 1.75x the mean at 2 / 4 ranks), and each
/// rank fetches fewer keys than ring attention moves where the mask allows it.
#[test]
fn work_is_balanced() {
    let len = 65536;
    let lengths: Vec<u32> = [4096u32, 1024, 8192, 512, 2048, 3072, 256, 6144]
        .iter()
        .cycle()
        .scan(0u32, |used, &l| {
            let l = l.min(len - *used);
            *used += l;
            (l > 0).then_some(l)
        })
        .collect();
    for rows in [causal(len), documents(&lengths)] {
        for ranks in [2u32, 4, 8] {
            let s = shard(&rows, ranks, 512).unwrap();
            let mean = s.work.iter().sum::<u64>() as f64 / f64::from(ranks);
            for (r, &w) in s.work.iter().enumerate() {
                assert!(
                    (w as f64 - mean).abs() <= 0.01 * mean,
                    "rank {r} of {ranks}: {w} vs mean {mean}"
                );
            }
            let computed = s.computed_pairs(TileShape {
                block_m: 128,
                block_n: 128,
            });
            let mean_c = computed.iter().sum::<u64>() as f64 / f64::from(ranks);
            assert!(computed
                .iter()
                .all(|&c| (c as f64 - mean_c).abs() <= 0.05 * mean_c));
        }
    }
    // Documents: a rank's rows see only their own documents, so fewer keys move.
    let s = shard(&documents(&lengths), 4, 512).unwrap();
    for r in 0..4 {
        assert!(s.fetched(r) < s.ring_fetched(r), "rank {r}");
    }
}

#[test]
fn bad_arguments_are_named() {
    let rows = causal(100);
    assert_eq!(shard(&rows, 0, 8).unwrap_err(), ShardError::NoRanks);
    assert_eq!(shard(&rows, 2, 0).unwrap_err(), ShardError::EmptyChunk);
    let e = shard(&rows, 8, 64).unwrap_err().to_string();
    assert_eq!(
        e,
        "100 tokens in chunks of 64 make 2 chunks, fewer than ranks = 8: use a smaller chunk \
         (at most 12) or fewer ranks"
    );
    // Fewer tokens than ranks: no chunk helps, so none is suggested.
    assert_eq!(
        shard(&rows, 200, 1).unwrap_err().to_string(),
        "100 tokens cannot give each of ranks = 200 a token: at most 100 ranks"
    );
    // Ranks x tokens is no limit: here every rank reads one range, from rank 0.
    let long = RowIntervals::from_rows(1 << 20, &vec![vec![(0, 1)]; 1 << 20]).unwrap();
    let s = shard(&long, 512, 16).unwrap();
    assert_eq!(s.key_ranges(), 512);
    assert!((0..512).all(|r| s.sources(r).eq([0])));
    // Full attention with a rank per token: each of 2^15 ranks reads from every rank, 2^30
    // ranges, refused before any is built.
    let full = RowIntervals::from_rows(1 << 15, &vec![vec![(0, 1 << 15)]; 1 << 15]).unwrap();
    let e = shard(&full, 1 << 15, 1).unwrap_err();
    assert_eq!(
        e,
        ShardError::TooLarge {
            ranks: 1 << 15,
            len: 1 << 15,
            chunk: 1,
            ranges: 1 << 30
        }
    );
    assert_eq!(
        e.to_string(),
        format!(
            "ranks = 32768 over 32768 tokens in chunks of 1: the ranks' rows see keys in up to \
             1073741824 (rank, source) key ranges, more than the {MAX_KEY_RANGES} a sharding \
             holds (12 bytes each); use fewer ranks"
        )
    );
    // The same ranks with each rank's rows on one source's keys fit.
    let s = shard(&long.clone(), 1 << 15, 32).unwrap();
    assert_eq!(s.key_ranges(), 1 << 15);
    let wide = RowIntervals::from_rows(120, &vec![vec![(0, 1)]; 100]).unwrap();
    assert!(shard(&wide, 2, 8)
        .unwrap_err()
        .to_string()
        .contains("q_len = 100 and kv_len = 120 differ"));
}
