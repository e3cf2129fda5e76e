//! A step's rows as one mask for a tiled forward kernel ([`StepPlan::prefill`]): the
//! prefill-chunk path, where each sequence brings hundreds or thousands of new rows and the
//! decode kernel's per-element visibility would be compute-bound.
//!
//! The tiled kernel walks keys in blocks of `key_block` and loads each block from the paged
//! cache, so every block must belong to one sequence. The layout gives each sequence its own
//! run of whole key blocks in a *virtual* key space: sequence `s`'s logical key `p` is
//! virtual key `key_offset[s] + p`, with `key_offset[s]` the key blocks of the sequences
//! before it, `sum(ceil(kv_len[s'] / key_block)) * key_block` for `s' < s`.
//!
//! Rows get the same treatment at `row_block` rows a block (the kernel's query tile), after
//! each row is repeated `row_group` times (GQA packing: the query heads of one kv head become
//! consecutive rows of one head, so a sequence of few rows still fills a tile): copy `j` of
//! row `i` of sequence `s` is virtual row `row_offset[s] + i * row_group + j`, each
//! sequence's rows padded to whole row blocks, so no query tile holds rows of two
//! sequences. A tile mixing sequences would see every key block of both, each partial (the
//! other sequence's rows see none of it), and need row bits for all of them: over long
//! caches, hundreds of MiB and of milliseconds a step. A padding row sees what its sequence's last row sees, so each tile is full, partial
//! or empty exactly as for the real rows alone; the kernel computes padding rows like any
//! other and the caller drops them (`row_index` maps each step row to its virtual row).

use crate::error::StepError;
use crate::StepPlan;
use cm_plan::rows::{KeyInterval, RowIntervals};

/// Most virtual keys, and most virtual rows, a prefill layout may span: the forward
/// kernels' 32-bit signed index arithmetic (`cm_cuda`'s sequence-length limit).
pub const MAX_PREFILL_KEYS: u64 = i32::MAX as u64 - 256;

/// Most key blocks a prefill layout may hold: as many as [`MAX_PREFILL_KEYS`] fill at the
/// paged forward's 128-key blocks. Bounds `key_blocks` (16 bytes a block, 256 MiB at most)
/// whatever `key_block` is asked for.
pub const MAX_PREFILL_KEY_BLOCKS: u64 = 1 << 24;

/// Most tiles a prefill layout's sequences may span (each sequence's row blocks times its
/// key blocks, summed): what bounds the tile descriptor built from the layout (4 bytes a
/// listed tile, 2 KiB more a partial one) whatever the mask. 2^24 tiles of 128 x 128 are
/// 2^38 (q, k) pairs, minutes of GPU time in one step.
pub const MAX_PREFILL_TILES: u64 = 1 << 24;

/// How a prefill layout is tiled (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillShape {
    /// Keys per block of the virtual key space: the kernel's key tile.
    pub key_block: u32,
    /// Rows per block of the virtual rows: the kernel's query tile (1 keeps the step's rows
    /// packed).
    pub row_block: u32,
    /// Consecutive virtual rows per step row: `num_heads / num_kv_heads` packs the query
    /// heads of a kv head as rows (GQA packing); 1 for none.
    pub row_group: u32,
}

/// A step laid out for a tiled forward over a paged KV cache (module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefill {
    /// The virtual rows over the virtual keys: `q_rows x num_key_blocks * key_block`, virtual
    /// row `row_offset[s] + i * row_group + j` holding row `i` of sequence `s`'s intervals
    /// shifted by `key_offset[s]`, and each padding row its sequence's last row's.
    pub rows: RowIntervals,
    /// `[total_q * row_group]`: the virtual row of copy `j` of step row `r` at `r * row_group
    /// + j` (0-based, increasing).
    pub row_index: Vec<i32>,
    /// `[num_key_blocks, 4]` int32, row-major: for virtual key block `n`, `(seq, first_key,
    /// valid_keys, 0)`: the block's sequence, the logical position of its first key in that
    /// sequence, and how many of its `key_block` keys the sequence has (`key_block` but in its
    /// last block; keys past them are never visible, and their cache rows are not read).
    pub key_blocks: Vec<i32>,
    /// The tiling, as asked.
    pub shape: PrefillShape,
}

impl Prefill {
    /// Blocks of the virtual key space.
    pub fn num_key_blocks(&self) -> usize {
        self.key_blocks.len() / 4
    }

    /// Virtual rows: the step's rows, each `row_group` times, with each sequence's padded to
    /// whole row blocks.
    pub fn q_rows(&self) -> u32 {
        self.rows.q_len()
    }
}

impl StepPlan {
    /// The step laid out for a tiled forward kernel of the tiles `shape` gives (module docs).
    /// Costs O(virtual rows x intervals + key blocks).
    ///
    /// # Errors
    /// [`StepError::PrefillTooLarge`] when the virtual keys or rows exceed
    /// [`MAX_PREFILL_KEYS`], [`StepError::PrefillTooManyBlocks`] when the key blocks exceed
    /// [`MAX_PREFILL_KEY_BLOCKS`], [`StepError::PrefillTooManyTiles`] when the sequences span
    /// more than [`MAX_PREFILL_TILES`] tiles, [`StepError::TooManyIntervals`] when the padded
    /// rows hold more than [`crate::MAX_STEP_INTERVALS`] intervals; [`StepError::BadArray`] for a zero
    /// block or group.
    pub fn prefill(&self, shape: PrefillShape) -> Result<Prefill, StepError> {
        let PrefillShape {
            key_block,
            row_block,
            row_group,
        } = shape;
        for (name, n) in [
            ("key_block", key_block),
            ("row_block", row_block),
            ("row_group", row_group),
        ] {
            if n == 0 {
                return Err(StepError::BadArray {
                    array: name,
                    message: format!("{name} = 0; expected at least 1"),
                });
            }
        }
        let (kb, rb, group) = (
            u64::from(key_block),
            u64::from(row_block),
            row_group as usize,
        );
        let key_offset = padded_offsets(self.kv_len().iter().map(|&kv| kv as u64), kb);
        let keys = *key_offset.last().expect("offsets start at 0");
        let q_len = self
            .cu_q()
            .windows(2)
            .map(|w| (w[1] - w[0]) as u64 * group as u64);
        let row_offset = padded_offsets(q_len, rb);
        let q_rows = *row_offset.last().expect("offsets start at 0");
        for (what, n) in [("keys", keys), ("rows", q_rows)] {
            if n > MAX_PREFILL_KEYS {
                return Err(StepError::PrefillTooLarge {
                    what,
                    count: n,
                    max: MAX_PREFILL_KEYS,
                });
            }
        }
        let blocks = keys / kb;
        if blocks > MAX_PREFILL_KEY_BLOCKS {
            return Err(StepError::PrefillTooManyBlocks {
                blocks,
                key_block,
                max: MAX_PREFILL_KEY_BLOCKS,
            });
        }
        let tiles: u64 = (0..self.num_seqs())
            .map(|s| {
                let rows = (row_offset[s + 1] - row_offset[s]) / rb;
                rows.saturating_mul((key_offset[s + 1] - key_offset[s]) / kb)
            })
            .fold(0u64, u64::saturating_add);
        if tiles > MAX_PREFILL_TILES {
            return Err(StepError::PrefillTooManyTiles {
                tiles,
                row_block,
                key_block,
                max: MAX_PREFILL_TILES,
            });
        }
        // Each sequence's rows, each `group` times, then its padding rows, each a copy of its
        // last row.
        let seq_rows = |s: usize| {
            let (first, end) = (self.cu_q()[s] as usize, self.cu_q()[s + 1] as usize);
            let pad = (row_offset[s + 1] - row_offset[s]) as usize - (end - first) * group;
            (first..end)
                .flat_map(move |r| std::iter::repeat_n(r, group))
                .chain(std::iter::repeat_n(end.saturating_sub(1), pad))
        };
        let num_intervals: usize = (0..self.num_seqs())
            .flat_map(seq_rows)
            .map(|r| (self.row_ptr()[r + 1] - self.row_ptr()[r]) as usize)
            .sum();
        if num_intervals > crate::MAX_STEP_INTERVALS {
            return Err(StepError::TooManyIntervals {
                max: crate::MAX_STEP_INTERVALS,
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
        let mut row_ptr = Vec::with_capacity(q_rows as usize + 1);
        row_ptr.push(0u32);
        let mut intervals = Vec::with_capacity(num_intervals);
        let mut row_index = Vec::with_capacity(self.total_q() * group);
        for s in 0..self.num_seqs() {
            let shift = key_offset[s] as u32;
            let copies = self.q_len(s) * group;
            row_index.extend((0..copies).map(|i| (row_offset[s] + i as u64) as i32));
            for r in seq_rows(s) {
                intervals.extend(self.row(r).map(|(start, end)| KeyInterval {
                    start: start + shift,
                    end: end + shift,
                }));
                row_ptr.push(intervals.len() as u32);
            }
        }
        // A validated step's rows stay sorted and disjoint under a shift, inside their
        // sequence's blocks.
        let rows = RowIntervals::from_csr(keys as u32, row_ptr, intervals)
            .expect("a validated step's rows, shifted, are valid intervals");
        Ok(Prefill {
            rows,
            row_index,
            key_blocks,
            shape,
        })
    }
}

/// `[n + 1]` offsets of items of the given sizes, each rounded up to whole blocks.
fn padded_offsets(sizes: impl Iterator<Item = u64>, block: u64) -> Vec<u64> {
    let mut offsets = vec![0];
    for size in sizes {
        let last = *offsets.last().expect("offsets start at 0");
        offsets.push(last + size.div_ceil(block) * block);
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(key_block: u32, row_block: u32, row_group: u32) -> PrefillShape {
        PrefillShape {
            key_block,
            row_block,
            row_group,
        }
    }

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
        let p = plan.prefill(shape(4, 1, 1)).unwrap();
        // Blocks: 5 keys -> 2 blocks, 9 -> 3, 4 -> 1: offsets 0, 8, 20; 24 virtual keys.
        assert_eq!(p.rows.q_len(), 4);
        assert_eq!(p.row_index, [0, 1, 2, 3]);
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
        // Rows in blocks of 2: sequence 1's row moves to virtual row 2 and sequence 2's to 4;
        // rows 3 and 5 pad them, each a copy of its sequence's last row.
        let padded = plan.prefill(shape(4, 2, 1)).unwrap();
        assert_eq!(padded.row_index, [0, 1, 2, 4]);
        assert_eq!(padded.q_rows(), 6);
        for (virt, real) in [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (5, 3)] {
            assert_eq!(
                padded.rows.row(virt),
                p.rows.row(real),
                "virtual row {virt}"
            );
        }
        // Two copies of each row in blocks of 4: sequence 0's 4 copies fill a block, the
        // others' 2 copies are padded by 2 more.
        let grouped = plan.prefill(shape(4, 4, 2)).unwrap();
        assert_eq!(grouped.row_index, [0, 1, 2, 3, 4, 5, 8, 9]);
        assert_eq!(grouped.q_rows(), 12);
        let real = [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3];
        for (virt, &real) in real.iter().enumerate() {
            let virt = virt as u32;
            assert_eq!(
                grouped.rows.row(virt),
                p.rows.row(real),
                "virtual row {virt}"
            );
        }
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
            let rb = [1, 3, 8, 128][next(4) as usize];
            let g = [1, 2, 4][next(3) as usize];
            let p = plan.prefill(shape(kb, rb, g)).unwrap();
            assert_eq!(p.rows.kv_len() as usize, p.num_key_blocks() * kb as usize);
            assert_eq!(p.q_rows() % rb, 0);
            assert_eq!(p.row_index.len(), plan.total_q() * g as usize);
            // Every virtual row block holds rows of one sequence, padding rows repeating
            // that sequence's last row.
            let mut seq_of_virtual = vec![None; p.q_rows() as usize];
            for (i, &v) in p.row_index.iter().enumerate() {
                let r = i / g as usize;
                seq_of_virtual[v as usize] = Some((plan.seq_of_row(r).unwrap(), i));
            }
            let mut last = None;
            for (v, seq) in seq_of_virtual.iter().enumerate() {
                match seq {
                    Some(own) => last = Some(*own),
                    None => {
                        let (_, i) = last.expect("a block starts with a real row");
                        assert_eq!(p.rows.row(v as u32), p.rows.row(p.row_index[i] as u32));
                    }
                }
                if v as u32 % rb == 0 {
                    assert!(
                        seq.is_some(),
                        "virtual row block at {v} starts with padding"
                    );
                } else {
                    let prev = seq_of_virtual[v - 1].map(|(s, _)| s);
                    let this = seq.map(|(s, _)| s);
                    assert!(
                        this.is_none() || prev == this,
                        "row block at {v} mixes sequences"
                    );
                }
            }
            for i in 0..plan.total_q() * g as usize {
                let r = i / g as usize;
                let s = plan.seq_of_row(r).unwrap();
                let want: Vec<u32> = plan.row(r).flat_map(|(a, b)| a..b).collect();
                let vr = p.row_index[i] as u32;
                let mut got = vec![];
                for v in 0..p.rows.kv_len() {
                    if p.rows.is_visible(vr, v) {
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
        let err = big(31).prefill(shape(1, 1, 1)).unwrap_err();
        assert!(
            matches!(err, StepError::PrefillTooManyBlocks { blocks, key_block: 1, .. }
                if blocks == 31 << 26),
            "{err}"
        );
        assert!(err.to_string().contains("key blocks of 1 keys"), "{err}");
        let err = big(33).prefill(shape(128, 1, 1)).unwrap_err();
        assert!(
            matches!(err, StepError::PrefillTooLarge { what: "keys", count, .. }
                if count == 33 << 26),
            "{err}"
        );
        // Rows: 2^17 one-row sequences padded to 2^14 rows each.
        let n = 1 << 17;
        let many = step(&vec![1; n], &vec![1; n], &vec![vec![(0, 1)]; n]);
        let err = many.prefill(shape(128, 1 << 14, 1)).unwrap_err();
        assert!(
            matches!(err, StepError::PrefillTooLarge { what: "rows", count, .. }
                if count == 1 << 31),
            "{err}"
        );
        assert!(err.to_string().contains("span 2147483648 rows"), "{err}");
        // Intervals: one row of 2^14 intervals repeated over a 2^14-row block.
        let row: Vec<(i32, i32)> = (0..1 << 14).map(|i| (2 * i, 2 * i + 1)).collect();
        let wide = step(&[1], &[1 << 15], &[row]);
        assert!(matches!(
            wide.prefill(shape(128, 1 << 14, 1)).unwrap_err(),
            StepError::TooManyIntervals { .. }
        ));
    }

    /// With rows padded per sequence, the paged forward's 128 x 128 tiles are partial only
    /// where the mask cuts them (a row's causal edge inside the key block, or a sequence's
    /// last, short block), never because a tile holds two sequences' rows; packed rows
    /// (row_block 1) mix sequences and make many more partial tiles.
    #[test]
    fn padded_rows_leave_partial_only_the_tiles_the_mask_cuts() {
        use cm_plan::tiles::{TileDescriptor, TileShape};
        let (q_len, kv_len) = ([200, 64, 300, 1], [1000, 700, 2000, 130]);
        let rows: Vec<Vec<(i32, i32)>> = q_len
            .iter()
            .zip(kv_len)
            .flat_map(|(&q, kv)| (0..q).map(move |i| vec![(0, kv - q + i + 1)]))
            .collect();
        let plan = step(&q_len, &kv_len, &rows);
        let tile = TileShape {
            block_m: 128,
            block_n: 128,
        };
        for g in [1u32, 4] {
            let p = plan.prefill(shape(128, 128, g)).unwrap();
            let desc = TileDescriptor::build_forward(&p.rows, tile);
            let mut owner = vec![None; p.q_rows() as usize];
            for (i, &v) in p.row_index.iter().enumerate() {
                owner[v as usize] = plan.seq_of_row(i / g as usize);
            }
            for m in 0..desc.num_m_blocks as usize {
                let block_rows = m * 128..(m + 1) * 128;
                let seqs: std::collections::BTreeSet<_> =
                    block_rows.clone().filter_map(|v| owner[v]).collect();
                assert_eq!(
                    seqs.len(),
                    1,
                    "g {g}: query tile {m} holds sequences {seqs:?}"
                );
                for &n in
                    &desc.kv_indices[desc.kv_offsets[m] as usize..desc.kv_offsets[m + 1] as usize]
                {
                    let (key0, valid) = (n * 128, p.key_blocks[4 * n as usize + 2] as u32);
                    let cut = block_rows.clone().any(|v| {
                        let row = p.rows.row(v as u32);
                        row.iter().any(|iv| key0 < iv.end && iv.end < key0 + valid)
                    });
                    assert!(
                        cut || valid < 128,
                        "g {g}: tile ({m}, {n}) is partial but uncut"
                    );
                }
            }
            let packed = plan.prefill(shape(128, 1, g)).unwrap();
            let mixed = TileDescriptor::build_forward(&packed.rows, tile);
            assert!(mixed.kv_indices.len() > 2 * desc.kv_indices.len(), "g {g}");
        }
    }

    /// A chunk of 2^20 rows over 2^26 keys spans 2^32 tiles of 128 x 128: refused by name
    /// before anything of that size is built.
    #[test]
    fn layouts_of_too_many_tiles_are_refused() {
        let rows = 1usize << 20;
        let kv = 1i32 << 26;
        let plan = step(&[rows as i32], &[kv], &vec![vec![(0, 1)]; rows]);
        let err = plan.prefill(shape(128, 128, 1)).unwrap_err();
        assert!(
            matches!(err, StepError::PrefillTooManyTiles { tiles, .. } if tiles == 1 << 32),
            "{err}"
        );
        assert!(
            err.to_string().contains("take the step in smaller chunks"),
            "{err}"
        );
    }

    #[test]
    fn a_zero_block_is_refused() {
        let plan = step(&[1], &[3], &[vec![(0, 3)]]);
        let err = |kb, rb, g| plan.prefill(shape(kb, rb, g)).unwrap_err().to_string();
        assert!(err(0, 128, 1).contains("key_block = 0"));
        assert!(err(128, 0, 1).contains("row_block = 0"));
        assert!(err(128, 128, 0).contains("row_group = 0"));
    }
}
