//! The tile descriptor: exact full / partial classification of every non-empty
//! `block_m x block_n` tile, in forward (per query block) and transposed (per key block) CSR
//! lists, plus the per-row form a kernel uses on partial tiles.
//!
//! Invariants owned here: a tile is *full* exactly when every in-range pair in it is visible
//! (edge tiles count only rows `< q_len` and keys `< kv_len`), *empty* exactly when none is,
//! and *partial* otherwise; empty tiles are never stored; index lists are ascending; the
//! transposed lists hold exactly the same tiles. Memory is O(rows x intervals + non-empty
//! tiles x block_m), never O(num_m_blocks x num_n_blocks).

use crate::rows::{KeyInterval, RowIntervals};
use serde::Serialize;

/// A tile shape in tokens: `block_m` query rows by `block_n` keys. Any positive sizes are
/// accepted for planning and exports; the GPU kernels use their own multiples of 16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct TileShape {
    pub block_m: u32,
    pub block_n: u32,
}

impl TileShape {
    /// Block sizes no larger than the lengths: a tile wider than the sequence covers the
    /// same pairs as one exactly as wide, and the arithmetic stays small.
    pub fn clamped(self, q_len: u32, kv_len: u32) -> (u32, u32) {
        (
            self.block_m.min(q_len.max(1)),
            self.block_n.min(kv_len.max(1)),
        )
    }
}

impl Default for TileShape {
    fn default() -> Self {
        TileShape {
            block_m: 128,
            block_n: 128,
        }
    }
}

/// Counts of tiles by class. `empty` counts every tile of the grid that no row sees into.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TileCounts {
    pub full: u64,
    pub partial: u64,
    pub empty: u64,
}

/// The compiled tile descriptor of one mask at one tile shape.
///
/// Forward lists are CSR over query blocks (`m_block`): the partial key blocks of `m_block`
/// are `kv_indices[kv_offsets[m_block]..kv_offsets[m_block + 1]]`, ascending, and likewise
/// `full_kv_*`. Transposed lists are CSR over key blocks (`n_block`): `q_indices` /
/// `full_q_indices`, with `q_partial_ids[i]` the position of that tile in the forward
/// partial list (so the backward pass finds the same per-row data).
///
/// Per-row form of partial tiles: `partial_row_first` is `[num_partial,
/// partial_row_stride]`. For the
/// `p`-th partial tile `(m_block, n_block)` and local row `r` (query row
/// `q = m_block * block_m + r < q_len`), it holds the absolute index into
/// `RowIntervals::intervals()` of that row's first interval ending after the tile's first
/// key `n_block * block_n`. A kernel applies the row by walking intervals from there while
/// `i < row_ptr[q + 1]` and `intervals[i].start < (n_block + 1) * block_n`, so several
/// intervals per row inside one tile need no special case. Rows `>= q_len` hold
/// `row_ptr[q_len]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileDescriptor {
    pub tile: TileShape,
    pub q_len: u32,
    pub kv_len: u32,
    pub num_m_blocks: u32,
    pub num_n_blocks: u32,
    pub kv_offsets: Vec<u32>,
    pub kv_indices: Vec<u32>,
    pub full_kv_offsets: Vec<u32>,
    pub full_kv_indices: Vec<u32>,
    pub partial_row_first: Vec<u32>,
    /// Entries per partial tile in `partial_row_first`: `block_m`, or `min(block_m,
    /// q_len)` for blocks taller than [`MAX_KERNEL_BLOCK_M`] (so absurd tile shapes
    /// cannot blow up memory, while every kernel tile keeps a fixed stride).
    pub partial_row_stride: u32,
    pub q_offsets: Vec<u32>,
    pub q_indices: Vec<u32>,
    pub q_partial_ids: Vec<u32>,
    pub full_q_offsets: Vec<u32>,
    pub full_q_indices: Vec<u32>,
    /// In-range (q, k) pairs inside full and partial tiles: the work a tile kernel does.
    pub computed_pairs: u64,
}

/// The tallest query block a kernel uses; `partial_row_first` keeps a stride of exactly
/// `block_m` up to this height.
pub const MAX_KERNEL_BLOCK_M: u32 = 1024;

fn ceil_div(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

/// Merges one row's intervals, as inclusive key-tile ranges, into the sorted, merged
/// ranges `acc` (adjacent ranges join).
pub(crate) fn merge_tile_ranges(
    acc: &mut Vec<(u32, u32)>,
    scratch: &mut Vec<(u32, u32)>,
    row: &[KeyInterval],
    bn: u32,
) {
    let tiles = |iv: &KeyInterval| (iv.start / bn, (iv.end - 1) / bn);
    if let ([last], [iv]) = (acc.as_mut_slice(), row) {
        let (a, b) = tiles(iv);
        if a <= last.1 + 1 && last.0 <= b + 1 {
            *last = (last.0.min(a), last.1.max(b));
            return;
        }
    }
    scratch.clear();
    let (mut i, mut j) = (0usize, 0usize);
    while i < acc.len() || j < row.len() {
        let next = if j >= row.len() || (i < acc.len() && acc[i].0 <= row[j].start / bn) {
            i += 1;
            acc[i - 1]
        } else {
            j += 1;
            tiles(&row[j - 1])
        };
        match scratch.last_mut() {
            Some(last) if next.0 <= last.1 + 1 => last.1 = last.1.max(next.1),
            _ => scratch.push(next),
        }
    }
    std::mem::swap(acc, scratch);
}

fn intersect_into(a: &[KeyInterval], b: &[KeyInterval], out: &mut Vec<KeyInterval>) {
    out.clear();
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let lo = a[i].start.max(b[j].start);
        let hi = a[i].end.min(b[j].end);
        if lo < hi {
            out.push(KeyInterval { start: lo, end: hi });
        }
        if a[i].end < b[j].end {
            i += 1;
        } else {
            j += 1;
        }
    }
}

impl TileDescriptor {
    /// Classifies every tile of `rows` at `tile`. Cost O(rows x intervals + non-empty tiles x
    /// block_m).
    ///
    /// # Panics
    /// If a block size is zero (the facade validates tile shapes first).
    pub fn build(rows: &RowIntervals, tile: TileShape) -> TileDescriptor {
        match Self::try_build(rows, tile, usize::MAX) {
            Ok(d) => d,
            Err(_) => unreachable!("no entry limit"),
        }
    }

    /// As [`TileDescriptor::build`], but stops with the number of list entries reached
    /// once the forward lists and per-row data would hold more than `max_entries`.
    ///
    /// # Errors
    /// The entry count at which the limit was exceeded.
    ///
    /// # Panics
    /// If a block size is zero.
    pub fn try_build(
        rows: &RowIntervals,
        tile: TileShape,
        max_entries: usize,
    ) -> Result<TileDescriptor, usize> {
        assert!(
            tile.block_m > 0 && tile.block_n > 0,
            "tile sizes are validated by the caller"
        );
        let (q_len, kv_len) = (rows.q_len(), rows.kv_len());
        let (bm, bn) = tile.clamped(q_len, kv_len);
        let num_m = ceil_div(q_len, bm);
        let num_n = ceil_div(kv_len, bn);
        let row_ptr = rows.row_ptr();
        let mut d = TileDescriptor {
            tile,
            q_len,
            kv_len,
            num_m_blocks: num_m,
            num_n_blocks: num_n,
            kv_offsets: Vec::with_capacity(num_m as usize + 1),
            kv_indices: Vec::new(),
            full_kv_offsets: Vec::with_capacity(num_m as usize + 1),
            full_kv_indices: Vec::new(),
            partial_row_first: Vec::new(),
            partial_row_stride: if tile.block_m <= MAX_KERNEL_BLOCK_M {
                tile.block_m
            } else {
                bm
            },
            q_offsets: Vec::new(),
            q_indices: Vec::new(),
            q_partial_ids: Vec::new(),
            full_q_offsets: Vec::new(),
            full_q_indices: Vec::new(),
            computed_pairs: 0,
        };
        d.kv_offsets.push(0);
        d.full_kv_offsets.push(0);
        let mut touched_ranges: Vec<(u32, u32)> = Vec::new();
        let mut scratch_ranges: Vec<(u32, u32)> = Vec::new();
        let mut inter: Vec<KeyInterval> = Vec::new();
        let mut scratch: Vec<KeyInterval> = Vec::new();
        let mut full: Vec<(u32, u32)> = Vec::new();
        for m in 0..num_m {
            let r0 = m * bm;
            let r1 = (r0 + bm).min(q_len);
            // Key tiles any row of the block touches, as merged inclusive tile-index ranges;
            // rows are merged one by one (each row is sorted), so no sort is needed.
            touched_ranges.clear();
            for q in r0..r1 {
                merge_tile_ranges(&mut touched_ranges, &mut scratch_ranges, rows.row(q), bn);
            }
            inter.clear();
            inter.extend_from_slice(rows.row(r0));
            for q in r0 + 1..r1 {
                let row = rows.row(q);
                match (inter.as_mut_slice(), row) {
                    ([], _) => break,
                    // The common single-interval case needs no scratch list.
                    ([only], [iv]) => {
                        only.start = only.start.max(iv.start);
                        only.end = only.end.min(iv.end);
                        if only.start >= only.end {
                            inter.clear();
                        }
                    }
                    _ => {
                        intersect_into(&inter, row, &mut scratch);
                        std::mem::swap(&mut inter, &mut scratch);
                    }
                }
            }
            // Full tiles: those whose in-range keys lie inside the intersection of all rows.
            full.clear();
            for iv in &inter {
                let first = ceil_div(iv.start, bn);
                let last_excl = if iv.end == kv_len { num_n } else { iv.end / bn };
                if first < last_excl {
                    full.push((first, last_excl));
                }
            }
            let rows_in = u64::from(r1 - r0);
            let mut fi = 0usize;
            for &(first, last) in &touched_ranges {
                let end = last + 1;
                let cols_in = u64::from((end * bn).min(kv_len) - first * bn);
                d.computed_pairs += rows_in * cols_in;
                // Split [first, end) into partial and full runs; full runs lie inside it.
                let mut at = first;
                while fi < full.len() && full[fi].0 < end {
                    let (fs, fe) = full[fi];
                    d.kv_indices.extend(at..fs);
                    d.full_kv_indices.extend(fs..fe);
                    at = fe;
                    fi += 1;
                }
                d.kv_indices.extend(at..end);
            }
            let partial_start = d.kv_offsets[m as usize] as usize;
            d.kv_offsets.push(d.kv_indices.len() as u32);
            d.full_kv_offsets.push(d.full_kv_indices.len() as u32);
            let partial = &d.kv_indices[partial_start..];
            let base = d.partial_row_first.len();
            let stride = d.partial_row_stride as usize;
            let entries = d.kv_indices.len()
                + d.full_kv_indices.len()
                + base
                + partial.len().saturating_mul(stride);
            if entries > max_entries {
                return Err(entries);
            }
            d.partial_row_first
                .resize(base + partial.len() * stride, row_ptr[q_len as usize]);
            for q in r0..r1 {
                let row = rows.row(q);
                let mut j = 0usize;
                for (p, &n) in partial.iter().enumerate() {
                    let tile_start = n * bn;
                    while j < row.len() && row[j].end <= tile_start {
                        j += 1;
                    }
                    d.partial_row_first[base + p * stride + (q - r0) as usize] =
                        row_ptr[q as usize] + j as u32;
                }
            }
        }
        d.build_transpose();
        Ok(d)
    }

    fn build_transpose(&mut self) {
        let num_n = self.num_n_blocks as usize;
        let (q_offsets, ids) = transpose_csr(&self.kv_offsets, &self.kv_indices, num_n);
        self.q_indices = ids.iter().map(|&(m, _)| m).collect();
        self.q_partial_ids = ids.iter().map(|&(_, p)| p).collect();
        self.q_offsets = q_offsets;
        let (full_offsets, full_ids) =
            transpose_csr(&self.full_kv_offsets, &self.full_kv_indices, num_n);
        self.full_q_offsets = full_offsets;
        self.full_q_indices = full_ids.iter().map(|&(m, _)| m).collect();
    }

    /// Tile counts by class over the whole `num_m_blocks x num_n_blocks` grid.
    pub fn counts(&self) -> TileCounts {
        let full = self.full_kv_indices.len() as u64;
        let partial = self.kv_indices.len() as u64;
        let grid = u64::from(self.num_m_blocks) * u64::from(self.num_n_blocks);
        TileCounts {
            full,
            partial,
            empty: grid - full - partial,
        }
    }

    /// Flex's `kv_num_blocks[m_block]`: partial key blocks of a query block.
    pub fn kv_num_blocks(&self) -> Vec<u32> {
        self.kv_offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Flex's `full_kv_num_blocks[m_block]`.
    pub fn full_kv_num_blocks(&self) -> Vec<u32> {
        self.full_kv_offsets
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect()
    }

    /// Flex's `q_num_blocks[n_block]`.
    pub fn q_num_blocks(&self) -> Vec<u32> {
        self.q_offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Flex's `full_q_num_blocks[n_block]`.
    pub fn full_q_num_blocks(&self) -> Vec<u32> {
        self.full_q_offsets
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect()
    }

    /// Bytes of every array a kernel reads, this descriptor's lists plus the row intervals.
    pub fn bytes(&self, rows: &RowIntervals) -> usize {
        let lists = [
            &self.kv_offsets,
            &self.kv_indices,
            &self.full_kv_offsets,
            &self.full_kv_indices,
            &self.partial_row_first,
            &self.q_offsets,
            &self.q_indices,
            &self.q_partial_ids,
            &self.full_q_offsets,
            &self.full_q_indices,
        ];
        lists.iter().map(|v| v.len() * 4).sum::<usize>() + rows.bytes()
    }
}

/// Transposes a CSR (rows -> ascending column ids) into columns -> ascending (row, entry id).
fn transpose_csr(offsets: &[u32], cols: &[u32], num_cols: usize) -> (Vec<u32>, Vec<(u32, u32)>) {
    let mut counts = vec![0u32; num_cols + 1];
    for &c in cols {
        counts[c as usize + 1] += 1;
    }
    for i in 0..num_cols {
        counts[i + 1] += counts[i];
    }
    let out_offsets = counts.clone();
    let mut fill = counts;
    let mut out = vec![(0u32, 0u32); cols.len()];
    for (row, w) in offsets.windows(2).enumerate() {
        for e in w[0]..w[1] {
            let c = cols[e as usize] as usize;
            out[fill[c] as usize] = (row as u32, e);
            fill[c] += 1;
        }
    }
    (out_offsets, out)
}
