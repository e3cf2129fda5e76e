//! A step's rows as one packed mask for a tiled forward kernel ([`StepPlan::prefill`]): the
//! prefill-chunk path, where each sequence brings hundreds or thousands of new rows and the
//! decode kernel's per-element visibility would be compute-bound.
//!
//! The tiled kernel walks keys in blocks of `key_block` and loads each block from the paged
//! cache, so every block must belong to one sequence. The layout gives each sequence its own
//! run of whole key blocks in a *virtual* key space: sequence `s`'s logical key `p` is
//! virtual key `key_offset[s] + p`, with `key_offset[s]` the key blocks of the sequences
//! before it, `sum(ceil(kv_len[s'] / key_block)) * key_block` for `s' < s`. Query rows stay
//! packed as the step packs them (`cu_q`): a query block may hold rows of two sequences, and
//! each row sees only its own sequence's keys.

use crate::error::StepError;
use crate::StepPlan;
use cm_plan::rows::{KeyInterval, RowIntervals};

/// Most virtual keys a prefill layout may span: the forward kernels' 32-bit signed key
/// arithmetic (`cm_cuda`'s sequence-length limit).
pub const MAX_PREFILL_KEYS: u64 = i32::MAX as u64 - 256;

/// Most key blocks a prefill layout may hold: as many as [`MAX_PREFILL_KEYS`] fill at the
/// paged forward's 128-key blocks. Bounds `key_blocks` (16 bytes a block, 256 MiB at most)
/// whatever `key_block` is asked for.
pub const MAX_PREFILL_KEY_BLOCKS: u64 = 1 << 24;

/// A step laid out for a tiled forward over a paged KV cache (module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefill {
    /// The step's rows over the virtual keys: `total_q x num_key_blocks * key_block`, row
    /// `r` of sequence `s` holding its intervals shifted by `key_offset[s]`.
    pub rows: RowIntervals,
    /// `[num_key_blocks, 4]` int32, row-major: for virtual key block `n`, `(seq, first_key,
    /// valid_keys, 0)`: the block's sequence, the logical position of its first key in that
    /// sequence, and how many of its `key_block` keys the sequence has (`key_block` but in its
    /// last block; keys past them are never visible, and their cache rows are not read).
    pub key_blocks: Vec<i32>,
    /// Keys per block, as asked.
    pub key_block: u32,
}

impl Prefill {
    /// Blocks of the virtual key space.
    pub fn num_key_blocks(&self) -> usize {
        self.key_blocks.len() / 4
    }
}

impl StepPlan {
    /// The step laid out for a tiled forward kernel whose key tiles hold `key_block` keys
    /// (module docs). Costs O(rows + intervals + key blocks).
    ///
    /// # Errors
    /// [`StepError::PrefillTooLarge`] when the virtual keys exceed [`MAX_PREFILL_KEYS`],
    /// [`StepError::PrefillTooManyBlocks`] when the key blocks exceed
    /// [`MAX_PREFILL_KEY_BLOCKS`]; [`StepError::BadArray`] for `key_block == 0`.
    pub fn prefill(&self, key_block: u32) -> Result<Prefill, StepError> {
        if key_block == 0 {
            return Err(StepError::BadArray {
                array: "key_block",
                message: "key_block = 0; a key block holds at least 1 key".into(),
            });
        }
        let kb = u64::from(key_block);
        let mut key_offset = Vec::with_capacity(self.num_seqs());
        let mut keys = 0u64;
        for &kv in self.kv_len() {
            key_offset.push(keys);
            keys += (kv as u64).div_ceil(kb) * kb;
        }
        if keys > MAX_PREFILL_KEYS {
            return Err(StepError::PrefillTooLarge {
                keys,
                max: MAX_PREFILL_KEYS,
            });
        }
        let blocks = keys / kb;
        if blocks > MAX_PREFILL_KEY_BLOCKS {
            return Err(StepError::PrefillTooManyBlocks {
                blocks,
                key_block,
                max: MAX_PREFILL_KEY_BLOCKS,
            });
        }
        let mut key_blocks = Vec::with_capacity(4 * blocks as usize);
        for (s, &kv) in self.kv_len().iter().enumerate() {
            let mut first = 0u64;
            while first < kv as u64 {
                let valid = (kv as u64 - first).min(kb);
                key_blocks.extend([s as i32, first as i32, valid as i32, 0]);
                first += kb;
            }
        }
        let mut intervals = Vec::with_capacity(self.num_intervals());
        for (rows, &shift) in self.cu_q().windows(2).zip(&key_offset) {
            let shift = shift as u32;
            for r in rows[0] as usize..rows[1] as usize {
                intervals.extend(self.row(r).map(|(start, end)| KeyInterval {
                    start: start + shift,
                    end: end + shift,
                }));
            }
        }
        let row_ptr = self.row_ptr().iter().map(|&o| o as u32).collect();
        // A validated step's rows stay sorted and disjoint under a shift, inside their
        // sequence's blocks.
        let rows = RowIntervals::from_csr(keys as u32, row_ptr, intervals)
            .expect("a validated step's rows, shifted, are valid intervals");
        Ok(Prefill {
            rows,
            key_blocks,
            key_block,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(q_len: &[i32], kv_len: &[i32], rows: &[Vec<(i32, i32)>]) -> StepPlan {
        let mut cu = vec![0];
        for q in q_len {
            cu.push(cu.last().unwrap() + q);
        }
        let mut row_ptr = vec![0];
        let mut iv = Vec::new();
        for r in rows {
            for &(a, b) in r {
                iv.extend([a, b]);
            }
            row_ptr.push((iv.len() / 2) as i32);
        }
        StepPlan::from_parts(cu, kv_len.to_vec(), row_ptr, iv).unwrap()
    }

    #[test]
    fn every_row_sees_its_own_sequences_keys_shifted_to_whole_blocks() {
        // Sequence 0: 2 rows over 5 keys; sequence 1: 1 row over 9 keys; sequence 2: 1 row
        // over 4 keys (exactly one block).
        let plan = step(
            &[2, 1, 1],
            &[5, 9, 4],
            &[vec![(0, 4)], vec![(0, 1), (3, 5)], vec![(2, 9)], vec![]],
        );
        let p = plan.prefill(4).unwrap();
        // Blocks: 5 keys -> 2 blocks, 9 -> 3, 4 -> 1: offsets 0, 8, 20; 24 virtual keys.
        assert_eq!(p.rows.q_len(), 4);
        assert_eq!(p.rows.kv_len(), 24);
        assert_eq!(p.num_key_blocks(), 6);
        let brute = |r: u32| {
            (0..24)
                .filter(|&k| p.rows.is_visible(r, k))
                .collect::<Vec<_>>()
        };
        assert_eq!(brute(0), [0, 1, 2, 3]);
        assert_eq!(brute(1), [0, 3, 4]);
        assert_eq!(brute(2), (10..17).collect::<Vec<_>>());
        assert!(brute(3).is_empty());
        assert_eq!(
            p.key_blocks,
            [0, 0, 4, 0, 0, 4, 1, 0, 1, 0, 4, 0, 1, 4, 4, 0, 1, 8, 1, 0, 2, 0, 4, 0]
        );
    }

    #[test]
    fn each_visible_virtual_key_maps_back_to_a_visible_key_of_the_rows_sequence() {
        // Random steps: every virtual key a row sees lies in a block of its own sequence,
        // at a logical position the step's row holds, and no other.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % u64::from(n)) as i32
        };
        for _ in 0..200 {
            let seqs = 1 + next(4) as usize;
            let (mut q_len, mut kv_len, mut rows) = (vec![], vec![], vec![]);
            for _ in 0..seqs {
                let kv = 1 + next(300);
                let q = 1 + next(kv.min(20) as u32);
                q_len.push(q);
                kv_len.push(kv);
                for _ in 0..q {
                    let mut row = vec![];
                    let mut at = next(4);
                    while at < kv {
                        let end = (at + 1 + next(40)).min(kv);
                        row.push((at, end));
                        at = end + 1 + next(30);
                    }
                    rows.push(row);
                }
            }
            let plan = step(&q_len, &kv_len, &rows);
            let kb = [16, 64, 128][next(3) as usize];
            let p = plan.prefill(kb).unwrap();
            assert_eq!(p.rows.kv_len() as usize, p.num_key_blocks() * kb as usize);
            for r in 0..plan.total_q() {
                let s = plan.seq_of_row(r).unwrap();
                let want: Vec<u32> = plan.row(r).flat_map(|(a, b)| a..b).collect();
                let mut got = vec![];
                for v in 0..p.rows.kv_len() {
                    if p.rows.is_visible(r as u32, v) {
                        let e = &p.key_blocks[4 * (v / kb) as usize..][..4];
                        assert_eq!(
                            e[0] as usize, s,
                            "row {r} sees a block of sequence {}",
                            e[0]
                        );
                        assert!(
                            (v % kb) < e[2] as u32,
                            "row {r} sees a key past its sequence"
                        );
                        got.push(e[1] as u32 + v % kb);
                    }
                }
                assert_eq!(got, want, "row {r}");
            }
        }
    }

    /// Layouts past either limit are refused before anything of their size is allocated:
    /// 31 sequences of 2^26 keys fit the key limit but not, at one key a block, the block
    /// limit; 33 of them exceed the key limit at any block size.
    #[test]
    fn layouts_past_the_limits_are_refused_by_name() {
        let big = |n: usize| {
            let rows = vec![vec![(0, 1)]; n];
            step(&vec![1; n], &vec![1 << 26; n], &rows)
        };
        let err = big(31).prefill(1).unwrap_err();
        assert!(
            matches!(err, StepError::PrefillTooManyBlocks { blocks, key_block: 1, .. }
                if blocks == 31 << 26),
            "{err}"
        );
        assert!(err.to_string().contains("key blocks of 1 keys"), "{err}");
        let err = big(33).prefill(128).unwrap_err();
        assert!(
            matches!(err, StepError::PrefillTooLarge { keys, .. } if keys == 33 << 26),
            "{err}"
        );
    }

    #[test]
    fn a_zero_key_block_is_refused() {
        let plan = step(&[1], &[3], &[vec![(0, 3)]]);
        assert!(plan
            .prefill(0)
            .unwrap_err()
            .to_string()
            .contains("key_block = 0"));
    }
}
