//! The tile descriptor: exact full / partial classification of every non-empty
//! `block_m x block_n` tile, in forward (per query block) and transposed (per key block) CSR
//! lists, and the per-row form a kernel uses on partial tiles, derived on demand
//! ([`TileDescriptor::partial_rows`]).
//!
//! Invariants owned here: a tile is *full* exactly when every in-range pair in it is visible
//! (edge tiles count only rows `< q_len` and keys `< kv_len`), *empty* exactly when none is,
//! and *partial* otherwise; empty tiles are never stored; index lists are ascending; the
//! transposed lists hold exactly the same tiles. A descriptor's memory is O(non-empty
//! tiles) and its per-row form's O(partial tiles x block_m), never O(num_m_blocks x
//! num_n_blocks).
//!
//! Two builders give the same descriptor: [`TileDescriptor::build`] classifies rows one by
//! one; [`TileDescriptor::try_build_runs`], which the planner uses, classifies the solver's
//! affine pieces as wholes (see `tests/tiles_fast.rs` for their comparison).

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
/// The per-row form of partial tiles that the CUDA kernels read is not held here: it is
/// `block_m` entries per partial tile, more than all the lists together on scattered masks
/// (222 MB for a 131072-node tree numbered out of depth-first order, against 15 MB of
/// lists), and only a kernel launch needs it, so the upload derives it
/// ([`TileDescriptor::partial_rows`]).
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

/// The per-row form of a descriptor's partial tiles, the layout the CUDA kernels read.
///
/// `partial_row_first` is `[num_partial, partial_row_stride]`. For the `p`-th partial tile
/// `(m_block, n_block)` of the forward lists and local row `r` (query row `q = m_block *
/// block_m + r < q_len`), it holds the absolute index into `RowIntervals::intervals()` of
/// that row's first interval ending after the tile's first key `n_block * block_n`. A kernel
/// applies the row by walking intervals from there while `i < row_ptr[q + 1]` and
/// `intervals[i].start < (n_block + 1) * block_n`, so several intervals per row inside one
/// tile need no special case. Rows `>= q_len` hold `row_ptr[q_len]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartialRows {
    pub partial_row_first: Vec<u32>,
    /// Entries per partial tile: `block_m`, or `min(block_m, q_len)` for blocks taller than
    /// [`MAX_KERNEL_BLOCK_M`] (so absurd tile shapes cannot blow up memory, while every
    /// kernel tile keeps a fixed stride).
    pub partial_row_stride: u32,
}

/// Entries per partial tile of [`PartialRows`] at `tile` (the block clamped to `q_len`).
fn partial_row_stride(tile: TileShape, q_len: u32, kv_len: u32) -> u32 {
    if tile.block_m <= MAX_KERNEL_BLOCK_M {
        tile.block_m
    } else {
        tile.clamped(q_len, kv_len).0
    }
}

fn ceil_div(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

/// Exact `n / d` for every `u32` `n` and a fixed divisor `d >= 1`, by one multiply-high
/// instead of a hardware division: with `c = ceil(2^64 / d)`, `n / d = (c * n) >> 64` for
/// all 32-bit `n` (Lemire, Kaser and Kurz, "Faster remainder by direct computation", 2019:
/// exact whenever the 64 fraction bits cover the numerator's 32 bits plus `log2 d`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DivU32 {
    /// `ceil(2^64 / d)`; 0 stands for `d == 1`, whose `2^64` does not fit.
    c: u64,
}

impl DivU32 {
    pub(crate) fn new(d: u32) -> DivU32 {
        assert!(d > 0, "division by zero");
        DivU32 {
            c: if d == 1 {
                0
            } else {
                (u64::MAX / u64::from(d)) + 1
            },
        }
    }

    #[inline]
    pub(crate) fn div(self, n: u32) -> u32 {
        if self.c == 0 {
            n
        } else {
            ((u128::from(self.c) * u128::from(n)) >> 64) as u32
        }
    }
}

/// Merges inclusive tile-index ranges sorted by start (`next`) into the sorted, merged
/// ranges `acc` (adjacent ranges join).
fn merge_ranges(
    acc: &mut Vec<(u32, u32)>,
    scratch: &mut Vec<(u32, u32)>,
    next: impl ExactSizeIterator<Item = (u32, u32)>,
) {
    let mut next = next.peekable();
    // The common case of one range each needs no scratch list.
    if let ([last], 1) = (acc.as_mut_slice(), next.len()) {
        let r = next.next().expect("one range");
        if r.0 <= last.1 + 1 && last.0 <= r.1 + 1 {
            *last = (last.0.min(r.0), last.1.max(r.1));
        } else if r.0 < last.0 {
            acc.insert(0, r);
        } else {
            acc.push(r);
        }
        return;
    }
    scratch.clear();
    let mut i = 0usize;
    loop {
        let item = match (acc.get(i), next.peek()) {
            (Some(&x), Some(&y)) if x.0 <= y.0 => {
                i += 1;
                x
            }
            (_, Some(_)) => next.next().expect("peeked"),
            (Some(&x), None) => {
                i += 1;
                x
            }
            (None, None) => break,
        };
        match scratch.last_mut() {
            Some(last) if item.0 <= last.1 + 1 => last.1 = last.1.max(item.1),
            _ => scratch.push(item),
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

/// Intersects the running intersection `inter` of a block's rows with one more row.
fn intersect_row(
    inter: &mut Vec<KeyInterval>,
    scratch: &mut Vec<KeyInterval>,
    row: &[KeyInterval],
) {
    match (inter.as_mut_slice(), row) {
        ([], _) => {}
        // The common single-interval case needs no scratch list.
        ([only], [iv]) => {
            only.start = only.start.max(iv.start);
            only.end = only.end.min(iv.end);
            if only.start >= only.end {
                inter.clear();
            }
        }
        _ => {
            intersect_into(inter, row, scratch);
            std::mem::swap(inter, scratch);
        }
    }
}

/// Affine runs shorter than this are not runs of their own: their few rows cost less one
/// at a time, or together with the short runs next to them (see [`monotone_rows`]), than a
/// run's bookkeeping per partial tile.
const MIN_RUN: u32 = 4;

/// Rows `[a, b)` of one query block, classified together.
struct Segment<'r> {
    a: u32,
    b: u32,
    kind: Kind<'r>,
}

enum Kind<'r> {
    /// Rows classified one by one (the straightforward pass).
    Rows,
    /// Rows of short affine runs, classified in stretches of rows whose intervals move
    /// little from one row to the next (see [`classify_group`]).
    Group,
    /// The rows of one affine run (see [`TileDescriptor::try_build_runs`]), or of short
    /// affine runs whose endpoints are each monotone over them (see [`monotone_rows`]).
    Run(Run<'r>),
}

/// Rows within a block whose endpoints are each monotone in the row (non-decreasing or
/// non-increasing), every row holding the same number of intervals: the rows of an affine
/// run, or of consecutive short runs checked by [`monotone_rows`]. Each endpoint's extremes
/// over the rows are at the first and last.
struct Run<'r> {
    first: &'r [KeyInterval],
    last: &'r [KeyInterval],
    /// How the rows' endpoints move.
    shape: RunShape,
}

enum RunShape {
    /// Every endpoint is affine in the row (one solver piece).
    Affine,
    /// Monotone only (consecutive short pieces); `stretch` tells whether every start and
    /// end moves by at most a tile (`block_n` keys) from one row to the next, which makes
    /// the rows one stretch (see [`add_stretch`]).
    Monotone { stretch: bool },
}

impl<'r> Run<'r> {
    fn new(rows: &'r RowIntervals, (a, b): (u32, u32), shape: RunShape) -> Self {
        Run {
            first: rows.row_runs(a),
            last: rows.row_runs(b - 1),
            shape,
        }
    }

    /// Whether the run's `n` rows are one stretch (see [`add_stretch`]) at tiles `bn` keys
    /// wide.
    fn stretch(&self, n: u32, bn: u32) -> bool {
        match self.shape {
            // Affine endpoints move by the same amount on every row: by at most a tile when
            // they move by at most a tile per row on average.
            RunShape::Affine => {
                let span = u64::from(bn) * u64::from(n - 1);
                self.first.iter().zip(self.last).all(|(f, l)| {
                    u64::from(f.start.abs_diff(l.start)) <= span
                        && u64::from(f.end.abs_diff(l.end)) <= span
                })
            }
            RunShape::Monotone { stretch } => stretch,
        }
    }
}

/// Key tiles any row of a block touches, as merged inclusive tile-index ranges.
#[derive(Default)]
pub(crate) struct Touched {
    pub(crate) list: Vec<(u32, u32)>,
    scratch: Vec<(u32, u32)>,
    /// Ranges not yet merged into `list` (see [`Touched::add`]).
    pending: Vec<(u32, u32)>,
    /// One bit per key tile, for settling many ranges (see [`Touched::settle`]).
    bits: Vec<u64>,
}

/// The per-block scratch lists, reused across blocks.
#[derive(Default)]
struct Scratch {
    touched: Touched,
    /// Keys every row of the block sees, holding every full tile (see [`add_stretch`]).
    inter: Vec<KeyInterval>,
    inter_scratch: Vec<KeyInterval>,
    seg_inter: Vec<KeyInterval>,
    full: Vec<(u32, u32)>,
    /// A stretch's extremes of each interval (see [`add_stretch`]).
    extremes: Vec<[u32; 4]>,
    /// Each endpoint's direction over a group of short runs (see [`monotone_rows`]).
    signs: Vec<[u32; 2]>,
}

impl TileDescriptor {
    /// Classifies every tile of `rows` at `tile`. Cost O(rows x intervals + non-empty
    /// tiles).
    ///
    /// # Panics
    /// If a block size is zero (the facade validates tile shapes first).
    pub fn build(rows: &RowIntervals, tile: TileShape) -> TileDescriptor {
        match Self::build_impl(rows, None, tile, usize::MAX, true) {
            Ok(d) => d,
            Err(_) => unreachable!("no entry limit"),
        }
    }

    /// [`TileDescriptor::build`] without the transposed lists (`q_offsets`, `q_indices`,
    /// `q_partial_ids`, `full_q_offsets` and `full_q_indices` stay empty): the forward lists
    /// alone, for kernels that walk query blocks. Transposing is most of the cost of a
    /// descriptor with many full tiles.
    ///
    /// # Panics
    /// If a block size is zero.
    pub fn build_forward(rows: &RowIntervals, tile: TileShape) -> TileDescriptor {
        match Self::build_impl(rows, None, tile, usize::MAX, false) {
            Ok(d) => d,
            Err(_) => unreachable!("no entry limit"),
        }
    }

    /// As [`TileDescriptor::build`], but stops with the number of list entries reached
    /// once the forward lists and the per-row form of partial tiles ([`PartialRows`], which
    /// a launch derives) would hold more than `max_entries`.
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
        Self::build_impl(rows, None, tile, max_entries, true)
    }

    /// As [`TileDescriptor::try_build`] (the same descriptor, bit for bit), for rows the
    /// solver produced in *affine runs*: `runs` holds the first row of every run, ascending
    /// from 0, each run lasting until the next one starts (the last until `q_len`). Within a
    /// run every row must have the same number of intervals and every interval endpoint
    /// must be affine in the row, as the solver's pieces are
    /// ([`crate::plan::row_intervals_runs`] reports them; debug builds check it).
    ///
    /// A block's rows are then classified run by run from each run's first and last rows
    /// (when its endpoints move by at most a tile per row; else row by row). Consecutive
    /// runs shorter than a few rows are taken together as one run when every endpoint is
    /// monotone over them, else classified in stretches of similar rows. Cost O(runs x
    /// intervals + rows in short runs x intervals + non-empty tiles).
    ///
    /// # Errors
    /// As [`TileDescriptor::try_build`].
    ///
    /// # Panics
    /// If a block size is zero, or `runs` does not start at 0 or is not ascending.
    pub fn try_build_runs(
        rows: &RowIntervals,
        runs: &[u32],
        tile: TileShape,
        max_entries: usize,
    ) -> Result<TileDescriptor, usize> {
        assert!(
            rows.q_len() == 0 || runs.first() == Some(&0),
            "runs start at row 0"
        );
        assert!(
            runs.windows(2).all(|w| w[0] < w[1])
                && runs.last().is_none_or(|&r| r < rows.q_len().max(1)),
            "runs are ascending row indices"
        );
        debug_assert!(runs_are_affine(rows, runs), "runs are affine");
        Self::build_impl(rows, Some(runs), tile, max_entries, true)
    }

    /// Rows with strided runs are classified through two rows of plain intervals
    /// ([`stride_proxies`]): the rows that touch the same tiles in the solver's runs (a
    /// strided run's proxy is its hull or its keys, affine where the run is, as many on
    /// every row of a run), the keys seen whole row by row.
    fn build_impl(
        rows: &RowIntervals,
        runs: Option<&[u32]>,
        tile: TileShape,
        max_entries: usize,
        transpose: bool,
    ) -> Result<TileDescriptor, usize> {
        assert!(
            tile.block_m > 0 && tile.block_n > 0,
            "tile sizes are validated by the caller"
        );
        if rows.has_strides() {
            let (touch, inter) = stride_proxies(rows, tile, max_entries)?;
            let touch = touch.as_ref().unwrap_or(rows);
            debug_assert!(
                runs.is_none_or(|r| runs_are_affine(touch, r)),
                "a strided run's proxies are affine where the run is"
            );
            return Self::build_classified(
                (touch, Some(&inter)),
                runs,
                tile,
                (max_entries, transpose),
            );
        }
        Self::build_classified((rows, None), runs, tile, (max_entries, transpose))
    }

    /// The descriptor of the rows whose tiles are classified from `(touch, inter)`:
    /// `(rows, None)` for rows of plain intervals, or the proxies of strided rows, `touch`
    /// for the tiles a row touches and `inter` for the keys it sees whole. `touch_runs` are
    /// runs of `touch` (see [`TileDescriptor::try_build_runs`]); the transposed lists only
    /// with `transpose`.
    fn build_classified(
        (touch, inter): (&RowIntervals, Option<&RowIntervals>),
        touch_runs: Option<&[u32]>,
        tile: TileShape,
        (max_entries, transpose): (usize, bool),
    ) -> Result<TileDescriptor, usize> {
        let (q_len, kv_len) = (touch.q_len(), touch.kv_len());
        let (bm, bn) = tile.clamped(q_len, kv_len);
        let div_n = DivU32::new(bn);
        let num_m = ceil_div(q_len, bm);
        let num_n = ceil_div(kv_len, bn);
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
            q_offsets: Vec::new(),
            q_indices: Vec::new(),
            q_partial_ids: Vec::new(),
            full_q_offsets: Vec::new(),
            full_q_indices: Vec::new(),
            computed_pairs: 0,
        };
        d.kv_offsets.push(0);
        d.full_kv_offsets.push(0);
        let mut s = Scratch::default();
        // The segments (runs cut at block edges) of the current block.
        let mut segments: Vec<Segment<'_>> = Vec::new();
        let mut run_at = 0usize;
        let stride = partial_row_stride(tile, q_len, kv_len) as usize;
        for m in 0..num_m {
            let (r0, r1) = (m * bm, ((m + 1) * bm).min(q_len));
            block_segments(
                touch,
                touch_runs,
                (r0, r1),
                bn,
                &mut run_at,
                &mut s.signs,
                &mut segments,
            );
            // Key tiles any row of the block touches, as merged inclusive tile-index
            // ranges, and keys every row of the block sees, among them every full tile's.
            s.touched.list.clear();
            s.inter.clear();
            for (i, seg) in segments.iter().enumerate() {
                classify_segment(touch, seg, i == 0, (bn, div_n), &mut s);
            }
            s.touched.settle(num_n);
            if let Some(inter) = inter {
                // Its keys are some of the rows' own, so the tiles it touches are touched.
                s.inter.clear();
                classify_rows(inter, (r0, r1), true, div_n, &mut s);
                s.touched.settle(num_n);
            }
            // Full tiles: those whose in-range keys every row sees, i.e. lie inside `inter`.
            s.full.clear();
            for iv in &s.inter {
                let first = ceil_div(iv.start, bn);
                let last_excl = if iv.end == kv_len {
                    num_n
                } else {
                    div_n.div(iv.end)
                };
                if first < last_excl {
                    s.full.push((first, last_excl));
                }
            }
            let rows_in = u64::from(r1 - r0);
            let mut fi = 0usize;
            let partial_start = d.kv_indices.len();
            for &(first, last) in &s.touched.list {
                let end = last + 1;
                let cols_in = u64::from((end * bn).min(kv_len) - first * bn);
                d.computed_pairs += rows_in * cols_in;
                // Split [first, end) into partial and full runs; full runs lie inside it.
                let mut at = first;
                while fi < s.full.len() && s.full[fi].0 < end {
                    let (fs, fe) = s.full[fi];
                    d.kv_indices.extend(at..fs);
                    d.full_kv_indices.extend(fs..fe);
                    at = fe;
                    fi += 1;
                }
                d.kv_indices.extend(at..end);
            }
            d.kv_offsets.push(d.kv_indices.len() as u32);
            d.full_kv_offsets.push(d.full_kv_indices.len() as u32);
            let entries = d.kv_indices.len()
                + d.full_kv_indices.len()
                + partial_start.saturating_mul(stride)
                + (d.kv_indices.len() - partial_start).saturating_mul(stride);
            if entries > max_entries {
                return Err(entries);
            }
        }
        if transpose {
            d.build_transpose();
        }
        Ok(d)
    }

    /// The per-row form of the partial tiles ([`PartialRows`]) of this descriptor of
    /// `rows`. Each row of a block keeps a cursor on its intervals, advanced as the block's
    /// partial tiles come in ascending order, and the end of the interval there: a row's
    /// entry changes only where one of its intervals ends, so a tile costs a comparison per
    /// row and a copy. Cost O(rows x intervals + partial tiles x block_m).
    ///
    /// # Panics
    /// If `rows` has other lengths than the descriptor's (it is not the mask it was built
    /// from).
    pub fn partial_rows(&self, rows: &RowIntervals) -> PartialRows {
        let (q_len, kv_len) = (self.q_len, self.kv_len);
        assert_eq!(
            (rows.q_len(), rows.kv_len()),
            (q_len, kv_len),
            "the rows of a descriptor have its lengths"
        );
        let (bm, bn) = self.tile.clamped(q_len, kv_len);
        let stride = partial_row_stride(self.tile, q_len, kv_len);
        let row_ptr = rows.row_ptr();
        let ivs = rows.all_runs();
        // Allocated once at its final size: growing it costs more in fresh pages than
        // filling it.
        let mut out = Vec::with_capacity(self.kv_indices.len() * stride as usize);
        let (mut cursor, mut next) = (Vec::new(), Vec::new());
        for m in 0..self.num_m_blocks {
            let (r0, r1) = (m * bm, ((m + 1) * bm).min(q_len));
            let partial = &self.kv_indices
                [self.kv_offsets[m as usize] as usize..self.kv_offsets[m as usize + 1] as usize];
            cursor.clear();
            cursor.extend_from_slice(&row_ptr[r0 as usize..r1 as usize]);
            next.clear();
            next.extend(
                (r0 as usize..r1 as usize).map(|q| next_end(ivs, row_ptr[q], row_ptr[q + 1])),
            );
            let ends = &row_ptr[r0 as usize + 1..=r1 as usize];
            for &nb in partial {
                let tile_start = nb * bn;
                for ((i, e), &end) in cursor.iter_mut().zip(next.iter_mut()).zip(ends) {
                    while *e <= tile_start {
                        *i += 1;
                        *e = next_end(ivs, *i, end);
                    }
                }
                out.extend_from_slice(&cursor);
                // Rows past q_len.
                out.extend(std::iter::repeat_n(
                    row_ptr[q_len as usize],
                    (stride - (r1 - r0)) as usize,
                ));
            }
        }
        PartialRows {
            partial_row_first: out,
            partial_row_stride: stride,
        }
    }

    fn build_transpose(&mut self) {
        let num_n = self.num_n_blocks as usize;
        let (q_offsets, q_indices, ids) =
            transpose_csr(&self.kv_offsets, &self.kv_indices, num_n, true);
        self.q_offsets = q_offsets;
        self.q_indices = q_indices;
        self.q_partial_ids = ids;
        let (full_offsets, full_indices, _) =
            transpose_csr(&self.full_kv_offsets, &self.full_kv_indices, num_n, false);
        self.full_q_offsets = full_offsets;
        self.full_q_indices = full_indices;
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

    /// Bytes of every array a kernel reads: this descriptor's lists, the row intervals and
    /// the per-row form of partial tiles that a launch derives ([`Self::partial_rows`],
    /// counted, not built).
    pub fn bytes(&self, rows: &RowIntervals) -> usize {
        let stride = partial_row_stride(self.tile, self.q_len, self.kv_len) as usize;
        let lists = [
            &self.kv_offsets,
            &self.kv_indices,
            &self.full_kv_offsets,
            &self.full_kv_indices,
            &self.q_offsets,
            &self.q_indices,
            &self.q_partial_ids,
            &self.full_q_offsets,
            &self.full_q_indices,
        ];
        lists.iter().map(|v| v.len() * 4).sum::<usize>()
            + self.kv_indices.len() * stride * 4
            + rows.bytes()
    }
}

/// Two rows of plain intervals that classify the tiles of rows with strided runs exactly:
/// `touch`, whose rows touch the same tiles (a run of stride `s <= block_n` as its hull
/// `[start, end)`, which meets no tile its keys miss, as only the last tile is narrower than
/// `block_n` and it holds the run's last key if it meets the hull; a wider stride as its
/// keys), and `inter`, the plain intervals alone: a strided key has no visible neighbour,
/// so no tile of two or more in-range keys that holds one is full, and the keys of a
/// one-key tile (`block_n == 1`, or the last tile when `kv_len % block_n == 1`) are kept.
/// `touch` is `None` when no stride exceeds `block_n`: then the rows' own runs, read as
/// intervals (`RowIntervals::row_runs`), are their hulls, and no copy of them is made (at
/// NATTEN 2D's 917K runs, the copy's fresh pages cost more than classifying them).
///
/// # Errors
/// The unit intervals needed when they exceed `max_entries` (with `block_n == 1`, every
/// key of a run).
fn stride_proxies(
    rows: &RowIntervals,
    tile: TileShape,
    max_entries: usize,
) -> Result<(Option<RowIntervals>, RowIntervals), usize> {
    let (q_len, kv_len) = (rows.q_len(), rows.kv_len());
    let (_, bn) = tile.clamped(q_len, kv_len);
    if bn == 1 {
        let unit = rows
            .expanded_within(max_entries)
            .map_err(|e| e.intervals as usize)?
            .into_owned();
        return Ok((Some(unit.clone()), unit));
    }
    let last_key_alone = kv_len % bn == 1;
    let hulls = rows.strides().iter().all(|&st| st <= bn);
    let plain = rows.strides().iter().filter(|&&st| st == 1).count();
    let mut touch =
        (!hulls).then(|| RowIntervals::with_capacity(q_len, kv_len, rows.all_runs().len()));
    let mut inter = RowIntervals::with_capacity(q_len, kv_len, plain);
    for q in 0..q_len {
        let strides = rows.row_strides(q).expect("strided rows");
        for (iv, &st) in rows.row_runs(q).iter().zip(strides) {
            if st == 1 {
                inter.push_row_interval(iv.start, iv.end);
            } else if last_key_alone && iv.end == kv_len {
                inter.push_row_interval(kv_len - 1, kv_len);
            }
            let Some(touch) = touch.as_mut() else {
                continue;
            };
            if st <= bn {
                touch.push_row_interval(iv.start, iv.end);
            } else {
                for k in (iv.start..iv.end).step_by(st as usize) {
                    touch.push_row_interval(k, k + 1);
                }
                if touch.interval_count() > max_entries {
                    return Err(touch.interval_count());
                }
            }
        }
        if let Some(touch) = touch.as_mut() {
            touch.finish_row();
        }
        inter.finish_row();
    }
    Ok((touch, inter))
}

/// Whether every run of `rows` holds rows of equally many intervals whose endpoints are
/// affine in the row ([`TileDescriptor::try_build_runs`]' contract; checked in debug builds).
fn runs_are_affine(rows: &RowIntervals, runs: &[u32]) -> bool {
    let q_len = rows.q_len();
    runs.iter().enumerate().all(|(i, &a)| {
        let b = runs.get(i + 1).map_or(q_len, |&e| e);
        let (first, last) = (rows.row_runs(a), rows.row_runs(b - 1));
        let steps = i64::from(b - a - 1).max(1);
        let at = |v0: u32, v1: u32, t: u32| {
            let (v0, v1) = (i64::from(v0), i64::from(v1));
            ((v1 - v0) % steps == 0).then(|| v0 + (v1 - v0) / steps * i64::from(t))
        };
        first.len() == last.len()
            && (a..b).all(|q| {
                let row = rows.row_runs(q);
                row.len() == first.len()
                    && row.iter().zip(first.iter().zip(last)).all(|(iv, (f, l))| {
                        at(f.start, l.start, q - a) == Some(i64::from(iv.start))
                            && at(f.end, l.end, q - a) == Some(i64::from(iv.end))
                    })
            })
    })
}

/// The segments of the block of rows `[r0, r1)`: without `runs`, one segment of rows
/// classified one by one; else the runs cut at the block's edges (`run_at`: the run holding
/// `r0`, advanced block by block), those shorter than [`MIN_RUN`] rows joined into
/// segments, each one run where [`monotone_rows`] finds it monotone (`signs` is its
/// scratch), else rows classified in stretches.
fn block_segments<'r>(
    rows: &'r RowIntervals,
    runs: Option<&[u32]>,
    (r0, r1): (u32, u32),
    bn: u32,
    run_at: &mut usize,
    signs: &mut Vec<[u32; 2]>,
    segments: &mut Vec<Segment<'r>>,
) {
    segments.clear();
    let Some(runs) = runs else {
        segments.push(Segment {
            a: r0,
            b: r1,
            kind: Kind::Rows,
        });
        return;
    };
    let mut a = r0;
    while a < r1 {
        while *run_at + 1 < runs.len() && runs[*run_at + 1] <= a {
            *run_at += 1;
        }
        let b = runs.get(*run_at + 1).map_or(rows.q_len(), |&e| e).min(r1);
        if b - a >= MIN_RUN {
            segments.push(Segment {
                a,
                b,
                kind: Kind::Run(Run::new(rows, (a, b), RunShape::Affine)),
            });
        } else {
            match segments.last_mut() {
                Some(Segment {
                    b: last_b,
                    kind: Kind::Group,
                    ..
                }) => *last_b = b,
                _ => segments.push(Segment {
                    a,
                    b,
                    kind: Kind::Group,
                }),
            }
        }
        a = b;
    }
    for seg in segments.iter_mut() {
        if !matches!(seg.kind, Kind::Group) {
            continue;
        }
        let stretch = monotone_rows(rows, (seg.a, seg.b), bn, signs);
        if let Some(stretch) = stretch {
            seg.kind = Kind::Run(Run::new(
                rows,
                (seg.a, seg.b),
                RunShape::Monotone { stretch },
            ));
        }
    }
}

/// Whether rows `[a, b)` are one [`Run`]: every row holds the same number of intervals and
/// each start and each end is monotone over them (CLEAR's image-edge rows: one- and two-row
/// pieces whose clamps change one by one). `Some(stretch)` when they are, `stretch` telling
/// whether no endpoint moves by more than a tile (`bn` keys) from one row to the next;
/// `None` otherwise, and for keys from 2^31 (beyond the planner's lengths), whose steps
/// the check below does not take exactly. `signs` is scratch. Cost O(rows x intervals).
fn monotone_rows(
    rows: &RowIntervals,
    (a, b): (u32, u32),
    bn: u32,
    signs: &mut Vec<[u32; 2]>,
) -> Option<bool> {
    if rows.kv_len() > i32::MAX as u32 {
        return None;
    }
    let (first, last) = (rows.row_runs(a), rows.row_runs(b - 1));
    // Each endpoint's direction is the one from the first row to the last, as a mask that
    // negates a step against it (all ones) or keeps it (zero): every step, so oriented, must
    // be non-negative, and the rows are a stretch when none exceeds a tile. Checked a row at
    // a time, without a branch per endpoint; a step between keys below 2^31 is exact as an
    // `i32`.
    let dir = |f: u32, l: u32| if f <= l { 0 } else { u32::MAX };
    signs.clear();
    signs.extend(
        first
            .iter()
            .zip(last)
            .map(|(f, l)| [dir(f.start, l.start), dir(f.end, l.end)]),
    );
    let oriented = |p: u32, r: u32, m: u32| ((r.wrapping_sub(p) ^ m).wrapping_sub(m)) as i32;
    let (mut against, mut far) = (0i32, 0i32);
    let mut prev = first;
    for q in a + 1..b {
        let row = rows.row_runs(q);
        if row.len() != first.len() {
            return None;
        }
        for ((p, r), m) in prev.iter().zip(row).zip(signs.iter()) {
            let (s, e) = (
                oriented(p.start, r.start, m[0]),
                oriented(p.end, r.end, m[1]),
            );
            against |= s | e;
            far |= i32::from(s as u32 > bn) | i32::from(e as u32 > bn);
        }
        if against < 0 {
            return None;
        }
        prev = row;
    }
    Some(far == 0)
}

/// Adds one segment's rows to the block's touched tile ranges and to `inter`, the keys that
/// can lie in a full tile (`first`: the block's first segment, which starts `inter`).
fn classify_segment(
    rows: &RowIntervals,
    seg: &Segment<'_>,
    first: bool,
    (bn, div_n): (u32, DivU32),
    s: &mut Scratch,
) {
    match &seg.kind {
        Kind::Rows => classify_rows(rows, (seg.a, seg.b), first, div_n, s),
        Kind::Group => classify_group(rows, (seg.a, seg.b), first, (bn, div_n), s),
        // A run whose endpoints move by at most a tile per row is a stretch; each
        // endpoint's extremes over it are at its first or last row.
        Kind::Run(run) if run.stretch(seg.b - seg.a, bn) => {
            s.extremes.clear();
            s.extremes
                .extend(run.first.iter().zip(run.last).map(|(f, l)| {
                    [
                        f.start.min(l.start),
                        f.end.max(l.end),
                        f.start.max(l.start),
                        f.end.min(l.end),
                    ]
                }));
            add_stretch(first, div_n, s);
        }
        Kind::Run(_) => classify_rows(rows, (seg.a, seg.b), first, div_n, s),
    }
}

/// Adds rows `[a, b)` one by one to the block's touched tile ranges and to `inter` (their
/// exact intersection).
fn classify_rows(
    rows: &RowIntervals,
    (a, b): (u32, u32),
    first: bool,
    div_n: DivU32,
    s: &mut Scratch,
) {
    for q in a..b {
        let row = rows.row_runs(q);
        s.touched.add(
            row.iter()
                .map(|iv| (div_n.div(iv.start), div_n.div(iv.end - 1))),
        );
    }
    let mut q = a;
    if first {
        s.inter.extend_from_slice(rows.row_runs(q));
        q += 1;
    }
    while q < b && !s.inter.is_empty() {
        intersect_row(&mut s.inter, &mut s.inter_scratch, rows.row_runs(q));
        q += 1;
    }
}

/// Adds rows `[a, b)` to the block's touched tile ranges and to `inter`, as stretches (see
/// [`add_stretch`]) of as many consecutive rows as qualify.
fn classify_group(
    rows: &RowIntervals,
    (a, b): (u32, u32),
    mut first: bool,
    (bn, div_n): (u32, DivU32),
    s: &mut Scratch,
) {
    let mut q = a;
    while q < b {
        let mut prev = rows.row_runs(q);
        s.extremes.clear();
        s.extremes
            .extend(prev.iter().map(|iv| [iv.start, iv.end, iv.start, iv.end]));
        q += 1;
        while q < b {
            let row = rows.row_runs(q);
            let close = row.len() == prev.len()
                && prev
                    .iter()
                    .zip(row)
                    .all(|(p, r)| p.start.abs_diff(r.start) <= bn && p.end.abs_diff(r.end) <= bn);
            if !close {
                break;
            }
            for (x, iv) in s.extremes.iter_mut().zip(row) {
                x[0] = x[0].min(iv.start);
                x[1] = x[1].max(iv.end);
                x[2] = x[2].max(iv.start);
                x[3] = x[3].min(iv.end);
            }
            prev = row;
            q += 1;
        }
        add_stretch(first, div_n, s);
        first = false;
    }
}

/// Adds a *stretch* to the block's touched tile ranges and to `inter`: consecutive rows with
/// equally many intervals, each start and end moving by at most a tile (`block_n` keys) from
/// one row to the next, given as each interval's extremes over the rows in `s.extremes`
/// (smallest start, largest end, largest start, smallest end).
///
/// Touched tiles: one interval's tile ranges on consecutive rows overlap or touch, so
/// together they are the tiles from its smallest start to its largest end; these ranges
/// come sorted by start, as the intervals do.
///
/// Full tiles: in a tile that every row sees whole, a key stays in the same interval on
/// every row. Were it in interval `i` on one row and in a later one on the next, the first
/// row's gap after `i` would lie past the tile and the next row's gap before `i + 1` before
/// it, so the start of `i + 1` would have moved by more than a tile (for an earlier one, the
/// end of `i - 1`). So every full tile lies in some interval's [largest start, smallest
/// end), which is seen by every row: intersected into `inter`, these keep `inter` inside
/// the rows' intersection and every full tile inside `inter`, which is all the
/// classification needs (they may leave out keys outside full tiles).
fn add_stretch(first: bool, div_n: DivU32, s: &mut Scratch) {
    s.touched.add(
        s.extremes
            .iter()
            .map(|x| (div_n.div(x[0]), div_n.div(x[1] - 1))),
    );
    if !first && s.inter.is_empty() {
        return;
    }
    s.seg_inter.clear();
    s.seg_inter.extend(s.extremes.iter().filter_map(|x| {
        (x[2] < x[3]).then_some(KeyInterval {
            start: x[2],
            end: x[3],
        })
    }));
    if first {
        std::mem::swap(&mut s.inter, &mut s.seg_inter);
    } else {
        intersect_row(&mut s.inter, &mut s.inter_scratch, &s.seg_inter);
    }
}

/// Touched-tile lists up to this long take each row's ranges by a merge at once; past it
/// the ranges wait in `pending` for one sort at the block's end ([`Touched::settle`]): merging every
/// row into a long list costs the list's length per row (a block of scattered rows, as a
/// tree numbered out of depth-first order, touches hundreds of tiles).
const SHORT_TOUCHED: usize = 16;

impl Touched {
    /// Adds inclusive tile ranges, sorted by start.
    pub(crate) fn add(&mut self, ranges: impl ExactSizeIterator<Item = (u32, u32)>) {
        if self.pending.is_empty() && self.list.len() + ranges.len() <= SHORT_TOUCHED {
            merge_ranges(&mut self.list, &mut self.scratch, ranges);
        } else {
            self.pending.extend(ranges);
        }
    }

    /// Merges the pending ranges into `list`, of key tiles `0..num_n`: by one sort, or,
    /// with at least one range per 64 tiles (a block of scattered rows), by marking a bit
    /// per tile and reading the runs of set bits back, O(ranges + num_n / 64) instead of a
    /// sort's O(ranges x log ranges).
    pub(crate) fn settle(&mut self, num_n: u32) {
        if self.pending.is_empty() {
            return;
        }
        let words = num_n.div_ceil(64) as usize;
        if self.pending.len() + self.list.len() < words {
            self.pending.sort_unstable();
            merge_ranges(&mut self.list, &mut self.scratch, self.pending.drain(..));
            return;
        }
        self.bits.clear();
        self.bits.resize(words, 0);
        for (a, b) in self.list.drain(..).chain(self.pending.drain(..)) {
            set_bit_range(&mut self.bits, a, b);
        }
        // Runs start at a set bit whose lower neighbour is clear and end at one whose
        // upper neighbour is clear; the k-th end closes the k-th start.
        let mut closed = 0usize;
        for (i, &x) in self.bits.iter().enumerate() {
            let below = if i > 0 { self.bits[i - 1] >> 63 } else { 0 };
            let above = self.bits.get(i + 1).map_or(0, |&y| y & 1);
            let base = i as u32 * 64;
            let mut starts = x & !((x << 1) | below);
            let mut ends = x & !((x >> 1) | (above << 63));
            while starts != 0 {
                self.list.push((base + starts.trailing_zeros(), 0));
                starts &= starts - 1;
            }
            while ends != 0 {
                self.list[closed].1 = base + ends.trailing_zeros();
                closed += 1;
                ends &= ends - 1;
            }
        }
    }
}

/// Sets bits `a..=b` of a little-endian bit array of u64 words.
fn set_bit_range(bits: &mut [u64], a: u32, b: u32) {
    if a == b {
        bits[(a / 64) as usize] |= 1 << (a % 64);
        return;
    }
    let (wa, wb) = ((a / 64) as usize, (b / 64) as usize);
    let lo = u64::MAX << (a % 64);
    let hi = u64::MAX >> (63 - b % 64);
    if wa == wb {
        bits[wa] |= lo & hi;
        return;
    }
    bits[wa] |= lo;
    bits[wa + 1..wb].fill(u64::MAX);
    bits[wb] |= hi;
}

/// The end of interval `i` of a row whose intervals end at `end`, `u32::MAX` when `i` is
/// past its last.
#[inline]
fn next_end(ivs: &[KeyInterval], i: u32, end: u32) -> u32 {
    if i < end {
        ivs[i as usize].end
    } else {
        u32::MAX
    }
}

/// Transposes a CSR (rows -> ascending column ids) into columns -> ascending rows: the
/// column offsets, each entry's row and, with `with_ids`, its entry id in the input (else
/// empty).
///
/// Each column's output run starts `rows x 4` bytes after the previous one's, a power of two
/// whenever the row count is, so the runs' next slots share a few cache sets: written one
/// entry at a time, row after row, nearly every entry missed (an all-visible mask at 1M
/// tokens, 8192 x 8192 tiles, spent 9 of its 10 s here). So the entries are staged in
/// blocks of [`STAGE_ROWS`] rows x a band of [`TRANSPOSE_BAND`] columns and each column's
/// staged rows written as one run. Each column's rows come out ascending either way.
fn transpose_csr(
    offsets: &[u32],
    cols: &[u32],
    num_cols: usize,
    with_ids: bool,
) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut counts = vec![0u32; num_cols + 1];
    for &c in cols {
        counts[c as usize + 1] += 1;
    }
    for i in 0..num_cols {
        counts[i + 1] += counts[i];
    }
    let out_offsets = counts.clone();
    let mut fill = counts;
    let mut rows = vec![0u32; cols.len()];
    let mut ids = vec![0u32; if with_ids { cols.len() } else { 0 }];
    let num_rows = offsets.len().saturating_sub(1);
    // A band's pass visits every row, so more than one pays off only where rows hold many
    // entries.
    let bands = num_cols
        .div_ceil(TRANSPOSE_BAND)
        .min(cols.len() / (4 * num_rows).max(1))
        .max(1);
    let width = num_cols.div_ceil(bands).max(1);
    let mut cursor = offsets[..num_rows].to_vec();
    // A column gets at most one entry per row (a row's columns ascend strictly).
    let mut staged_rows = vec![0u32; width * STAGE_ROWS];
    let mut staged_ids = vec![0u32; if with_ids { width * STAGE_ROWS } else { 0 }];
    let mut staged = vec![0u8; width];
    let mut touched = Vec::with_capacity(width);
    for band in 0..bands {
        let band_start = band * width;
        let band_end = if band + 1 == bands {
            u32::MAX
        } else {
            (band_start + width) as u32
        };
        for block in (0..num_rows).step_by(STAGE_ROWS) {
            for row in block..num_rows.min(block + STAGE_ROWS) {
                let (mut e, end) = (cursor[row], offsets[row + 1]);
                while e < end && cols[e as usize] < band_end {
                    let c = cols[e as usize] as usize - band_start;
                    let n = usize::from(staged[c]);
                    if n == 0 {
                        touched.push(c);
                    }
                    staged_rows[c * STAGE_ROWS + n] = row as u32;
                    if with_ids {
                        staged_ids[c * STAGE_ROWS + n] = e;
                    }
                    staged[c] += 1;
                    e += 1;
                }
                cursor[row] = e;
            }
            for c in touched.drain(..) {
                let n = usize::from(std::mem::take(&mut staged[c]));
                let at = fill[band_start + c] as usize;
                let from = c * STAGE_ROWS;
                copy_run(&mut rows[at..at + n], &staged_rows[from..from + n]);
                if with_ids {
                    copy_run(&mut ids[at..at + n], &staged_ids[from..from + n]);
                }
                fill[band_start + c] += n as u32;
            }
        }
    }
    (out_offsets, rows, ids)
}

/// Copies one staged run. A whole line has a length known here, so it compiles to a few
/// vector moves; a variable-length copy is a `memmove` call, which cost more than the
/// staging saved on causal lists (4M calls at 1M tokens).
#[inline]
fn copy_run(to: &mut [u32], from: &[u32]) {
    match (
        <&mut [u32; STAGE_ROWS]>::try_from(&mut *to),
        <&[u32; STAGE_ROWS]>::try_from(from),
    ) {
        (Ok(to), Ok(from)) => *to = *from,
        _ => to.copy_from_slice(from),
    }
}

/// Columns per band of [`transpose_csr`]: their staged rows (`STAGE_ROWS x 4` bytes each,
/// twice with ids) stay in the L1 and L2.
const TRANSPOSE_BAND: usize = 256;
/// Rows staged per column before its run is written: 16 u32 are one 64-byte cache line.
const STAGE_ROWS: usize = 16;

#[cfg(test)]
mod tests {
    use super::{DivU32, TileDescriptor, TileShape, Touched};
    use crate::rows::RowIntervals;

    /// A xorshift generator of values below its argument, for repeatable random cases.
    fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
        move |m| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        }
    }

    /// The staged transpose lists every column's entries with their rows ascending and their
    /// input ids, as sorting the (column, row) pairs does, on lists sparse (one pass) and
    /// dense (many bands, last band wider), with empty rows and columns.
    #[test]
    fn transposed_lists_are_the_sorted_pairs() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for case in 0..60 {
            let num_rows = 1 + next(300) as usize;
            let num_cols = [1, 5, 255, 256, 257, 700, 2000][case % 7];
            let keep = [1, 10, 50, 100][case % 4];
            let mut offsets = vec![0u32];
            let mut cols = Vec::new();
            for _ in 0..num_rows {
                cols.extend((0..num_cols as u32).filter(|_| next(100) < keep));
                offsets.push(cols.len() as u32);
            }
            let mut want: Vec<(u32, u32, u32)> = Vec::new();
            for r in 0..num_rows {
                for e in offsets[r]..offsets[r + 1] {
                    want.push((cols[e as usize], r as u32, e));
                }
            }
            want.sort_unstable();
            let (out_offsets, rows, ids) = super::transpose_csr(&offsets, &cols, num_cols, true);
            assert_eq!(out_offsets.len(), num_cols + 1);
            for c in 0..num_cols {
                let got = (out_offsets[c]..out_offsets[c + 1])
                    .map(|i| (c as u32, rows[i as usize], ids[i as usize]));
                let expect = want.iter().copied().filter(|w| w.0 == c as u32);
                assert!(got.eq(expect), "case {case}: column {c} of {num_cols}");
            }
            let (_, rows_only, no_ids) = super::transpose_csr(&offsets, &cols, num_cols, false);
            assert_eq!((rows_only, no_ids.len()), (rows, 0));
        }
    }

    /// Settling touched ranges by sorting and by a bitmap (chosen by the ranges per tile)
    /// gives the merged runs of the tiles marked, whatever the ranges: overlapping,
    /// adjacent, across and at 64-tile word edges, some added before the pending list.
    #[test]
    fn settled_ranges_are_the_marked_tiles() {
        let mut next64 = xorshift(0x2545_f491_4f6c_dd1d);
        let mut next = |m: u32| next64(u64::from(m)) as u32;
        for case in 0..400 {
            let num_n = [1, 2, 63, 64, 65, 127, 128, 129, 200, 5000][case % 10];
            let count = 1 + next(if case % 3 == 0 { 8 } else { 200 });
            let mut ranges = Vec::new();
            for _ in 0..count {
                let a = next(num_n);
                let b = (a + next(if case % 2 == 0 { 3 } else { 140 })).min(num_n - 1);
                ranges.push((a, b));
            }
            let mut want = vec![false; num_n as usize];
            for &(a, b) in &ranges {
                want[a as usize..=b as usize].fill(true);
            }
            let mut t = Touched::default();
            // The first few merged at once, the rest pending, as `add` does.
            let early = ranges.len().min(next(3) as usize);
            let mut sorted_early = ranges[..early].to_vec();
            sorted_early.sort_unstable();
            t.add(sorted_early.into_iter());
            t.pending.extend_from_slice(&ranges[early..]);
            t.settle(num_n);
            let mut got = vec![false; num_n as usize];
            for w in t.list.windows(2) {
                assert!(
                    w[0].1 + 1 < w[1].0,
                    "runs apart and ascending: {:?}",
                    t.list
                );
            }
            for &(a, b) in &t.list {
                assert!(a <= b && b < num_n, "{:?}", t.list);
                got[a as usize..=b as usize].fill(true);
            }
            assert_eq!(got, want, "case {case}: {ranges:?} -> {:?}", t.list);
            assert!(t.pending.is_empty());
        }
    }

    /// Rows of one-row runs (so the builder groups them), monotone or not, some of whose
    /// endpoints step by more than 2^31 keys from one row to the next: over `kv_len` from
    /// 2^31 they are not taken as monotone (such steps do not fit the check's 32 bits, and a
    /// fall past 2^31 would read as a rise), and either way the descriptor is the per-row
    /// builder's.
    #[test]
    fn short_runs_with_steps_past_2_pow_31() {
        for (kv_len, jump) in [
            (3_000_000_000u32, 2_500_000_000u32),
            (1_900_000_000, 1_800_000_000),
        ] {
            let monotone = |q: u32| {
                let s = if q < 5 { 100 + q } else { jump + q };
                vec![(q, q + 2), (s, s + 5 + q)]
            };
            let sawtooth = |q: u32| match q % 3 {
                0 => vec![(q, q + 2), (jump + q, jump + 20)],
                1 => vec![(q, q + 3), (100 + q, jump + 21)],
                _ => vec![(q + 1, q + 4), (jump + 2, jump + 22)],
            };
            // Rises below 2^31 and one fall past it: every step looks like a rise in 32
            // bits.
            let ends = [
                200_000_000u32,
                1_700_000_000,
                3_200_000_000,
                700_000_000,
                2_200_000_000,
            ];
            let hidden_fall = |q: u32| {
                let e = ends[q.min(4) as usize].min(kv_len - 1);
                vec![(q, q + 2), (e - 5, e)]
            };
            for make in [
                &monotone as &dyn Fn(u32) -> Vec<(u32, u32)>,
                &sawtooth,
                &hidden_fall,
            ] {
                let rows =
                    RowIntervals::from_rows(kv_len, &(0..9).map(make).collect::<Vec<_>>()).unwrap();
                let runs: Vec<u32> = (0..9).collect();
                for block_n in [1 << 20, 1 << 16] {
                    let tile = TileShape {
                        block_m: 16,
                        block_n,
                    };
                    let fast = TileDescriptor::try_build_runs(&rows, &runs, tile, usize::MAX);
                    assert_eq!(fast, TileDescriptor::try_build(&rows, tile, usize::MAX));
                }
            }
        }
    }

    /// The forward-only build is the full build's forward half, with no transposed lists.
    #[test]
    fn a_forward_build_holds_the_forward_lists_alone() {
        let rows: Vec<Vec<(u32, u32)>> = (0..300u32)
            .map(|q| {
                if q % 7 == 3 {
                    vec![]
                } else {
                    vec![(q / 3, (q + 1).min(250)), (260, 261 + q % 39)]
                }
            })
            .collect();
        let rows = RowIntervals::from_rows(300, &rows).unwrap();
        for (block_m, block_n) in [(64, 64), (128, 128), (192, 128), (64, 128)] {
            let tile = TileShape { block_m, block_n };
            let full = TileDescriptor::build(&rows, tile);
            let fwd = TileDescriptor::build_forward(&rows, tile);
            assert_eq!(fwd.kv_offsets, full.kv_offsets);
            assert_eq!(fwd.kv_indices, full.kv_indices);
            assert_eq!(fwd.full_kv_offsets, full.full_kv_offsets);
            assert_eq!(fwd.full_kv_indices, full.full_kv_indices);
            assert_eq!(fwd.computed_pairs, full.computed_pairs);
            assert!(!full.q_indices.is_empty() && !full.q_offsets.is_empty());
            assert!(fwd.q_offsets.is_empty() && fwd.q_indices.is_empty());
            assert!(fwd.q_partial_ids.is_empty() && fwd.full_q_offsets.is_empty());
            assert!(fwd.full_q_indices.is_empty());
        }
    }

    #[test]
    fn division_by_multiply_high_is_exact() {
        let mut divisors = vec![1u32, 2, 3, 5, 7, 37, 64, 100, 127, 128, 129, 1000, 5000];
        divisors.extend([
            1 << 31,
            (1 << 31) - 1,
            (1 << 31) + 1,
            u32::MAX - 1,
            u32::MAX,
        ]);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..2000 {
            divisors.push((next() as u32).max(1));
            divisors.push(((next() % 4096) as u32).max(1));
        }
        for &d in &divisors {
            let f = DivU32::new(d);
            let d64 = u64::from(d);
            let mut numerators = vec![0u32, 1, d - 1, d, u32::MAX, u32::MAX - 1];
            for m in [1u64, 2, 3, 1000] {
                let v = d64 * m;
                if v <= u64::from(u32::MAX) {
                    numerators.extend([v as u32, (v - 1) as u32]);
                }
            }
            numerators.extend((0..50).map(|_| next() as u32));
            for n in numerators {
                assert_eq!(f.div(n), n / d, "{n} / {d}");
            }
        }
    }
}
