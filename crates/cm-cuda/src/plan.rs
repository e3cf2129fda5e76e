//! A plan's tile descriptor and row intervals in device memory, uploaded once and reused by
//! every launch over the same masks and lengths.
//!
//! The descriptor is a fixed set of u32 arrays ([`PlanArray`]) holding every distinct mask of
//! a plan back to back, and `mask_index [mask_batch, mask_heads]`, the mask of each (batch,
//! head), so that one launch serves any plan: a kernel finds its work item's mask through
//! `mask_index` and that mask's lists at a fixed stride (arrays whose length the lengths fix)
//! or through offsets that already point into the concatenation (the rest). [`HostPlan`]
//! builds them on the host; [`DevicePlan`] uploads them into one allocation it owns; [`PlanView`] is what a launch
//! reads: the arrays' device addresses and the sizes, either a [`DevicePlan`]'s (through
//! `Deref`) or arrays someone else owns ([`PlanView::borrowed`], e.g. torch tensors, so that
//! torch's allocator orders their lifetime with the launches that read them).

use crate::{Error, KernelKind};
use cm_plan::rows::RowIntervals;
use cm_plan::tiles::{PartialRows, TileCounts, TileDescriptor, TileShape};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::ops::Deref;
use std::sync::Arc;

/// Sets of forward lists for [`crate::KernelKind::FwdWs`], one per tile its variants declare
/// ([`cm_kernels::FWD_WS_TILES`]).
pub const WS_SETS: usize = cm_kernels::FWD_WS_TILES.len();

/// The number of arrays in a descriptor ([`PlanArray::ALL`]).
pub const PLAN_ARRAY_COUNT: usize = 15 + 6 * WS_SETS;

/// One array of a plan's device descriptor, all u32.
///
/// The forward lists at the kernel's tile shape (`kv_offsets [num_m_blocks + 1]`, `kv_indices
/// [num_partial]`, `full_kv_*` likewise), the order in which query blocks are scheduled
/// (`[num_m_blocks]`, most tiles first, so the longest CTAs start first) and each partial
/// tile's visibility as bits per row (`partial_row_mask [num_partial, block_m, block_n / 32]`:
/// bit `c % 32` of word `c / 32` set when key `n_block * block_n + c` is visible from the row;
/// rows past `q_len` have no bits), read by the reference forwards and the backward's `bwd_dq`
/// at the plan's tile ([`cm_kernels::TILE`]). [`PlanArray::Ws`] repeats all of them at each
/// tile of [`crate::KernelKind::FwdWs`]'s variants ([`cm_kernels::FWD_WS_TILES`], one set
/// each). Every kernel reads a partial tile's visibility as bits (one encoding, oriented along
/// its inner loop): by row here, by key in the transposed lists. The `Bwd*` arrays are the backward
/// lists at [`cm_kernels::BWD_TILE`] for the warp-specialised dK/dV kernel: the key-block order
/// (`bwd_n_block_order [num_n_blocks]`, most tiles first), the transposed lists
/// (`bwd_q_offsets [num_n_blocks + 1]`, `bwd_q_indices [num_partial]`, `bwd_full_q_*`
/// likewise) and each partial tile's visibility as bits per *key*, in the transposed lists'
/// order (`bwd_partial_key_mask [num_partial, block_n, block_m / 32]`: for the `i`-th entry of
/// `bwd_q_indices`, in key block `n_block`, bit `r % 32` of word `r / 32` of key `c` set when
/// query row `bwd_q_indices[i] * block_m + r` sees key `n_block * block_n + c`; rows past
/// `q_len` and keys past `kv_len` have no bits). `bwd_q_ranks [num_partial]` and
/// `bwd_full_q_ranks [num_full]` give, for each entry of `bwd_q_indices` (`bwd_full_q_indices`),
/// how many lower key blocks of the same mask also visit that query tile (as a partial or a
/// full tile): the deterministic backward adds each query tile's dQ in ascending key-block
/// order, and an entry's rank is the number of additions that come before its own.
///
/// A plan of several masks holds each mask's arrays one after the other, in mask order. The
/// arrays whose length the lengths fix ([`PlanArray::fixed_len`]: block orders and offsets)
/// repeat at that stride; the others (tile lists and bits) are concatenated, and every offset
/// into them (`*_offsets`) counts from the start of the concatenation, so a kernel needs only
/// its mask's base of the fixed-stride arrays.
/// `mask_index [mask_batch, mask_heads]` holds the mask of each (batch, head); a side of 1
/// applies to every batch (head) of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanArray {
    /// One of the forward lists at the plan's tile ([`cm_kernels::TILE`]).
    Forward(ForwardArray),
    /// One of the forward lists at [`cm_kernels::FWD_WS_TILES`]`[set]`.
    Ws(ForwardArray, usize),
    BwdNBlockOrder,
    BwdQOffsets,
    BwdQIndices,
    BwdFullQOffsets,
    BwdFullQIndices,
    BwdPartialKeyMask,
    BwdQRanks,
    BwdFullQRanks,
    MaskIndex,
}

/// The forward lists of one tile: [`PlanArray::Forward`] at the plan's, [`PlanArray::Ws`] at
/// each of `fwd_ws`'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardArray {
    MBlockOrder,
    KvOffsets,
    KvIndices,
    FullKvOffsets,
    FullKvIndices,
    PartialRowMask,
}

impl ForwardArray {
    /// In the order a forward launch reads them.
    pub(crate) const ALL: [ForwardArray; 6] = [
        ForwardArray::MBlockOrder,
        ForwardArray::KvOffsets,
        ForwardArray::KvIndices,
        ForwardArray::FullKvOffsets,
        ForwardArray::FullKvIndices,
        ForwardArray::PartialRowMask,
    ];

    fn name(self) -> &'static str {
        match self {
            ForwardArray::MBlockOrder => "m_block_order",
            ForwardArray::KvOffsets => "kv_offsets",
            ForwardArray::KvIndices => "kv_indices",
            ForwardArray::FullKvOffsets => "full_kv_offsets",
            ForwardArray::FullKvIndices => "full_kv_indices",
            ForwardArray::PartialRowMask => "partial_row_mask",
        }
    }
}

impl PlanArray {
    /// Every array, in the order of [`HostPlan::arrays`] and [`PlanLayout::new`].
    pub const ALL: [PlanArray; PLAN_ARRAY_COUNT] = {
        const TAIL: [PlanArray; 9] = [
            PlanArray::BwdNBlockOrder,
            PlanArray::BwdQOffsets,
            PlanArray::BwdQIndices,
            PlanArray::BwdFullQOffsets,
            PlanArray::BwdFullQIndices,
            PlanArray::BwdPartialKeyMask,
            PlanArray::BwdQRanks,
            PlanArray::BwdFullQRanks,
            PlanArray::MaskIndex,
        ];
        let mut all = [PlanArray::MaskIndex; PLAN_ARRAY_COUNT];
        let mut i = 0;
        while i < 6 {
            all[i] = PlanArray::Forward(ForwardArray::ALL[i]);
            i += 1;
        }
        let mut j = 0;
        while j < 6 * WS_SETS {
            all[i + j] = PlanArray::Ws(ForwardArray::ALL[j % 6], j / 6);
            j += 1;
        }
        let mut k = 0;
        while k < TAIL.len() {
            all[i + j + k] = TAIL[k];
            k += 1;
        }
        all
    };

    /// Position in [`PlanArray::ALL`].
    pub fn index(self) -> usize {
        match self {
            PlanArray::Forward(a) => a as usize,
            PlanArray::Ws(a, set) => 6 + 6 * set + a as usize,
            other => PlanArray::ALL
                .iter()
                .position(|&x| x == other)
                .expect("every array is in ALL"),
        }
    }

    /// The array's name: `kv_offsets`, or `ws192x128_kv_offsets` for a [`PlanArray::Ws`] set
    /// (named by its tile).
    pub fn name(self) -> String {
        let plain = match self {
            PlanArray::Forward(a) => a.name(),
            PlanArray::Ws(a, set) => {
                let (m, n) = cm_kernels::FWD_WS_TILES[set];
                return format!("ws{m}x{n}_{}", a.name());
            }
            PlanArray::BwdNBlockOrder => "bwd_n_block_order",
            PlanArray::BwdQOffsets => "bwd_q_offsets",
            PlanArray::BwdQIndices => "bwd_q_indices",
            PlanArray::BwdFullQOffsets => "bwd_full_q_offsets",
            PlanArray::BwdFullQIndices => "bwd_full_q_indices",
            PlanArray::BwdPartialKeyMask => "bwd_partial_key_mask",
            PlanArray::BwdQRanks => "bwd_q_ranks",
            PlanArray::BwdFullQRanks => "bwd_full_q_ranks",
            PlanArray::MaskIndex => "mask_index",
        };
        plain.to_string()
    }

    /// One mask's length of the array when the lengths alone fix it (`None` when the mask does,
    /// and for `mask_index`, whose length the plan's batch and heads fix), given
    /// `num_m_blocks` query blocks at the plan's tile, `ws_m[set]` query blocks at each
    /// [`PlanArray::Ws`] set's tile and `bwd_n` key blocks at the `Bwd*` tile.
    fn fixed_len(self, num_m_blocks: u32, ws_m: &[u32; WS_SETS], bwd_n: u32) -> Option<usize> {
        let (m, bwd_n) = (num_m_blocks as usize, bwd_n as usize);
        match self {
            PlanArray::Forward(ForwardArray::MBlockOrder) => Some(m),
            PlanArray::Forward(ForwardArray::KvOffsets)
            | PlanArray::Forward(ForwardArray::FullKvOffsets) => Some(m + 1),
            PlanArray::Ws(ForwardArray::MBlockOrder, set) => Some(ws_m[set] as usize),
            PlanArray::Ws(ForwardArray::KvOffsets | ForwardArray::FullKvOffsets, set) => {
                Some(ws_m[set] as usize + 1)
            }
            PlanArray::BwdNBlockOrder => Some(bwd_n),
            PlanArray::BwdQOffsets | PlanArray::BwdFullQOffsets => Some(bwd_n + 1),
            _ => None,
        }
    }

    /// The array that an offsets array points into (`None` for the others): the base a
    /// plan of several masks adds to each mask's offsets.
    fn indexes(self) -> Option<PlanArray> {
        match self {
            PlanArray::Forward(ForwardArray::KvOffsets) => {
                Some(PlanArray::Forward(ForwardArray::KvIndices))
            }
            PlanArray::Forward(ForwardArray::FullKvOffsets) => {
                Some(PlanArray::Forward(ForwardArray::FullKvIndices))
            }
            PlanArray::Ws(ForwardArray::KvOffsets, set) => {
                Some(PlanArray::Ws(ForwardArray::KvIndices, set))
            }
            PlanArray::Ws(ForwardArray::FullKvOffsets, set) => {
                Some(PlanArray::Ws(ForwardArray::FullKvIndices, set))
            }
            PlanArray::BwdQOffsets => Some(PlanArray::BwdQIndices),
            PlanArray::BwdFullQOffsets => Some(PlanArray::BwdFullQIndices),
            _ => None,
        }
    }

    /// Byte alignment the kernels' loads of this array need.
    fn align(self) -> u64 {
        match self {
            // A row's 128 bits are one 16-byte load.
            PlanArray::Ws(ForwardArray::PartialRowMask, _)
            | PlanArray::Forward(ForwardArray::PartialRowMask) => 16,
            // Each tile's 1 KB is one bulk async copy.
            PlanArray::BwdPartialKeyMask => 16,
            _ => 4,
        }
    }
}

/// Query and key blocks of a `q_len x kv_len` mask at `tile`, as the descriptor counts them.
fn block_counts(q_len: u32, kv_len: u32, tile: TileShape) -> (u32, u32) {
    let (bm, bn) = tile.clamped(q_len, kv_len);
    (q_len.div_ceil(bm), kv_len.div_ceil(bn))
}

/// The tile shape of [`PlanArray::Ws`] set `set`.
pub(crate) fn ws_tile(set: usize) -> TileShape {
    let (block_m, block_n) = cm_kernels::FWD_WS_TILES[set];
    TileShape { block_m, block_n }
}

/// The [`PlanArray::Ws`] set at `tile`, if `fwd_ws` has variants there.
pub(crate) fn ws_set(tile: (u32, u32)) -> Option<usize> {
    cm_kernels::FWD_WS_TILES.iter().position(|&t| t == tile)
}

/// The tile shape of the `Bwd*` arrays.
pub(crate) fn bwd_tile() -> TileShape {
    let (block_m, block_n) = cm_kernels::BWD_TILE;
    TileShape { block_m, block_n }
}

/// Query blocks at each [`PlanArray::Ws`] set's tile.
fn ws_m_blocks(q_len: u32, kv_len: u32) -> [u32; WS_SETS] {
    std::array::from_fn(|set| block_counts(q_len, kv_len, ws_tile(set)).0)
}

/// Throughput per computed pair of `fwd_ws` at a tile relative to its 128-row tile: the
/// 192-row tile (three consumer warpgroups, head_dim 64) ran 1.07-1.17x as many computed
/// pairs per second on the H200 over W1-W8 (the least on masks of many partial tiles;
/// BENCHMARKS.md, "Forward at head_dim 64: 192-row tiles"); at 1.12 each workload there
/// runs the faster of its two tiles, or one within 2% of it (W2 at 8K).
fn relative_rate(tile: (u32, u32)) -> f64 {
    if tile.0 >= 192 {
        1.12
    } else {
        1.0
    }
}

/// The [`PlanArray::Ws`] sets best first for a plan whose arrays have lengths `lens` (in
/// [`PlanArray::ALL`] order, as [`HostPlan::arrays`] made them, before any padding): by the
/// pairs their listed tiles (full and partial, over every mask) cover, divided by the tile's
/// [`relative_rate`], so that masks whose rows a deeper tile covers with more waste (narrow
/// windows) keep the 128-row tile. Ties keep [`cm_kernels::FWD_WS_TILES`]' order.
pub fn ws_order(lens: &[usize; PLAN_ARRAY_COUNT]) -> [usize; WS_SETS] {
    let cost = |set: usize| {
        let tiles: usize = [ForwardArray::KvIndices, ForwardArray::FullKvIndices]
            .iter()
            .map(|&a| lens[PlanArray::Ws(a, set).index()])
            .sum();
        let (m, n) = cm_kernels::FWD_WS_TILES[set];
        tiles as f64 * f64::from(m * n) / relative_rate((m, n))
    };
    let mut order: [usize; WS_SETS] = std::array::from_fn(|set| set);
    order.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)));
    order
}

/// The largest share of partial tiles among the backward's listed tiles (at
/// [`cm_kernels::BWD_TILE`]) at which the deterministic backward adds dQ in `bwd_dkdv` in
/// turns ([`dq_in_turns`]).
///
/// Measured on an H100 (BENCHMARKS.md, "The deterministic backward's dQ: in turns or in
/// `bwd_dq`, chosen per plan"): turns ran 0.71-0.80x the fast backward's speed where at most
/// 9.3% of the tiles were partial (causal, shared prefix, sliding window, documents) against
/// 0.64-0.72x for `bwd_dq`, but 0.47-0.79x where 13-84% were (HSTU, CLEAR, traces) against
/// 0.77-0.90x. Masks of many partial tiles are those whose key blocks reach a shared query
/// tile at far-apart points of their walks (2D windows, short documents, targets), so a turn
/// waits on a CTA that is busy elsewhere; `bwd_dq` reads each query block's own list and never
/// waits.
const DQ_TURNS_MAX_PARTIAL_SHARE: f64 = 0.11;

/// Whether the deterministic backward adds dQ in `bwd_dkdv` in turns (else `bwd_dq` computes
/// it; where turns apply at all, see [`crate::Runtime::backward`]) for a plan whose arrays
/// have lengths `lens` (in [`PlanArray::ALL`] order, as [`HostPlan::arrays`] made them, before
/// any padding): when at most [`DQ_TURNS_MAX_PARTIAL_SHARE`] of the backward's listed tiles
/// are partial. A pure function of the plan, so one plan always takes one path and repeats
/// its bits.
pub fn dq_in_turns(lens: &[usize; PLAN_ARRAY_COUNT]) -> bool {
    let partial = lens[PlanArray::BwdQIndices.index()];
    let full = lens[PlanArray::BwdFullQIndices.index()];
    partial as f64 <= DQ_TURNS_MAX_PARTIAL_SHARE * (partial + full) as f64
}

/// Block indices `0..count` with the most work first (ties: the later block first, which for
/// causal-like masks is also the longer row), so the longest CTAs start first.
fn heaviest_first(count: u32, offsets: [&[u32]; 2]) -> Vec<u32> {
    let work = |i: u32| {
        let i = i as usize;
        offsets.iter().map(|o| o[i + 1] - o[i]).sum::<u32>()
    };
    let mut order: Vec<u32> = (0..count).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(work(i)), std::cmp::Reverse(i)));
    order
}

/// The visibility bits of every row of every partial tile of `desc` (see
/// [`PlanArray::Forward(ForwardArray::PartialRowMask)`]), from the rows' intervals starting at each row's
/// `partial_row_first`.
fn partial_row_masks(desc: &TileDescriptor, rows: &RowIntervals) -> Vec<u32> {
    let per_row = desc.partial_rows(rows);
    let block_m = desc.tile.block_m as usize;
    let block_n = desc.tile.block_n;
    let words = block_n.div_ceil(32) as usize;
    let mut masks = vec![0u32; desc.kv_indices.len() * block_m * words];
    for m in 0..desc.num_m_blocks as usize {
        let row0 = m * block_m;
        let row_end = (row0 + block_m).min(rows.q_len() as usize);
        for p in desc.kv_offsets[m] as usize..desc.kv_offsets[m + 1] as usize {
            let key0 = desc.kv_indices[p] * block_n;
            for q in row0..row_end {
                let r = q - row0;
                let out = &mut masks[(p * block_m + r) * words..][..words];
                for (lo, hi) in runs_in_tile((desc, &per_row), rows, p, q, r, key0) {
                    set_bits(out, lo, hi);
                }
            }
        }
    }
    masks
}

/// The keys row `q` (row `r` of partial tile `p` of `desc`) sees in the tile's keys
/// `[key0, key0 + block_n)`, as runs `[lo, hi)` relative to `key0`: its intervals walked from
/// the tile's `partial_row_first` entry for the row, so only the intervals reaching the tile
/// are read.
fn runs_in_tile<'a>(
    (desc, per_row): (&'a TileDescriptor, &'a PartialRows),
    rows: &'a RowIntervals,
    p: usize,
    q: usize,
    r: usize,
    key0: u32,
) -> impl Iterator<Item = (u32, u32)> + 'a {
    let key_end = key0 + desc.tile.block_n;
    let first = per_row.partial_row_first[p * per_row.partial_row_stride as usize + r] as usize;
    rows.intervals()[first..rows.row_ptr()[q + 1] as usize]
        .iter()
        .take_while(move |iv| iv.start < key_end)
        .map(move |iv| (iv.start.max(key0) - key0, iv.end.min(key_end) - key0))
}

/// The visibility bits of every partial tile of `desc` by key, in the order of the transposed
/// lists (see [`PlanArray::BwdPartialKeyMask`]): `[num_partial, block_n, block_m / 32]`. Each
/// row's intervals are walked from its `partial_row_first` (found through `q_partial_ids`);
/// the cost is the partial tiles' bits, not `q_len x kv_len`.
fn partial_key_masks(desc: &TileDescriptor, rows: &RowIntervals) -> Vec<u32> {
    let per_row = desc.partial_rows(rows);
    let block_m = desc.tile.block_m as usize;
    let block_n = desc.tile.block_n;
    let words = block_m.div_ceil(32);
    let tile_words = block_n as usize * words;
    let mut masks = vec![0u32; desc.q_indices.len() * tile_words];
    // 64-row tiles (the backward's) take each 64-key part of the rows' bits as a 64 x 64 bit
    // matrix, transposed whole, rather than a bit per visible (row, key).
    let by_matrix = block_m == 64 && block_n % 64 == 0;
    let mut matrices = vec![[0u64; 64]; if by_matrix { block_n as usize / 64 } else { 0 }];
    // With a block clamped to a shorter length there is one block, index 0, so
    // `index * block` (at the unclamped tile) still gives its first row or key.
    for n in 0..desc.num_n_blocks as usize {
        let key0 = n as u32 * block_n;
        for i in desc.q_offsets[n] as usize..desc.q_offsets[n + 1] as usize {
            let row0 = desc.q_indices[i] as usize * block_m;
            let row_end = (row0 + block_m).min(rows.q_len() as usize);
            let p = desc.q_partial_ids[i] as usize;
            let out = &mut masks[i * tile_words..][..tile_words];
            for q in row0..row_end {
                let r = q - row0;
                for (lo, hi) in runs_in_tile((desc, &per_row), rows, p, q, r, key0) {
                    if by_matrix {
                        set_row_bits(&mut matrices, r, lo, hi);
                        continue;
                    }
                    let (word, bit) = (r / 32, 1u32 << (r % 32));
                    for key in out[lo as usize * words..hi as usize * words].chunks_exact_mut(words)
                    {
                        key[word] |= bit;
                    }
                }
            }
            for (part, matrix) in matrices.iter_mut().enumerate() {
                transpose64(matrix);
                for (c, &rows_bits) in matrix.iter().enumerate() {
                    let key = &mut out[(part * 64 + c) * 2..][..2];
                    key[0] = rows_bits as u32;
                    key[1] = (rows_bits >> 32) as u32;
                }
                *matrix = [0; 64];
            }
        }
    }
    masks
}

/// Sets keys `[lo, hi)` of row `r` in 64-key bit matrices (`matrices[part][r]`, bit `c` for
/// key `64 part + c`).
fn set_row_bits(matrices: &mut [[u64; 64]], r: usize, lo: u32, hi: u32) {
    for (part, matrix) in matrices.iter_mut().enumerate() {
        let base = part as u32 * 64;
        let (a, b) = (lo.max(base), hi.min(base + 64));
        if a < b {
            let n = b - a;
            let run = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << (a - base)
            };
            matrix[r] |= run;
        }
    }
}

/// Transposes a 64 x 64 bit matrix in place: bit `c` of row `r` becomes bit `r` of row `c`.
/// Swaps the off-diagonal blocks of halving size (32, 16, ..., 1), after Hacker's Delight's
/// `transpose32` (section 7-3), for least-significant-bit-first rows.
fn transpose64(a: &mut [u64; 64]) {
    let mut j = 32usize;
    let mut m: u64 = 0x0000_0000_ffff_ffff;
    while j != 0 {
        let mut k = 0usize;
        while k < 64 {
            let t = ((a[k] >> j) ^ a[k + j]) & m;
            a[k] ^= t << j;
            a[k + j] ^= t;
            k = (k + j + 1) & !j;
        }
        j >>= 1;
        m ^= m << j;
    }
}

/// Sets bits `[lo, hi)` of a little-endian bit array of u32 words.
fn set_bits(words: &mut [u32], lo: u32, hi: u32) {
    let mut c = lo;
    while c < hi {
        let w = (c / 32) as usize;
        let bit = c % 32;
        let n = (hi - c).min(32 - bit);
        let run = if n == 32 {
            u32::MAX
        } else {
            ((1u32 << n) - 1) << bit
        };
        words[w] |= run;
        c += n;
    }
}

/// The forward lists of `desc` in [`ForwardArray::ALL`] order: the query blocks heaviest
/// first, the tile lists, and the partial tiles' row bits.
fn forward_lists(desc: TileDescriptor, rows: &RowIntervals) -> [Vec<u32>; 6] {
    let order = heaviest_first(desc.num_m_blocks, [&desc.kv_offsets, &desc.full_kv_offsets]);
    let row_masks = partial_row_masks(&desc, rows);
    [
        order,
        desc.kv_offsets,
        desc.kv_indices,
        desc.full_kv_offsets,
        desc.full_kv_indices,
        row_masks,
    ]
}

/// Which arrays a descriptor holds: every list, what any launch may read, or one
/// [`PlanArray::Ws`] set and `mask_index` alone, all that a forward of that set's tile reads.
/// The paged forward's layout ([`crate::prefill::prefill_lists`]) is rebuilt every serving
/// step, and the other sets would multiply its host time and memory several times over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanLists {
    All,
    Ws(usize),
}

impl PlanLists {
    /// Whether a descriptor of these lists holds [`PlanArray::Ws`] set `set`.
    fn holds_set(self, set: usize) -> bool {
        self.holds(PlanArray::Ws(ForwardArray::KvIndices, set))
    }

    /// Whether a descriptor of these lists holds array `a`.
    pub fn holds(self, a: PlanArray) -> bool {
        match (self, a) {
            (PlanLists::All, _) | (_, PlanArray::MaskIndex) => true,
            (PlanLists::Ws(set), PlanArray::Ws(_, s)) => s == set,
            (PlanLists::Ws(_), _) => false,
        }
    }

    /// The [`PlanArray::Ws`] sets best first for a descriptor of these lists whose arrays have
    /// `lens` elements ([`ws_order`] over every set; a single set first).
    fn ws_order(self, lens: &[usize; PLAN_ARRAY_COUNT]) -> [usize; WS_SETS] {
        match self {
            PlanLists::All => ws_order(lens),
            PlanLists::Ws(set) => {
                let mut order: [usize; WS_SETS] = std::array::from_fn(|s| s);
                order[..=set].rotate_right(1);
                order
            }
        }
    }

    fn check(self) -> Result<(), Error> {
        match self {
            PlanLists::Ws(set) if set >= WS_SETS => Err(Error::invalid(format!(
                "plan lists Ws({set}): there are {WS_SETS} forward tile sets"
            ))),
            _ => Ok(()),
        }
    }
}

/// Masks of at least this many (q, k) pairs (8K x 8K) build their tile sets on threads of
/// their own: below it, starting the threads costs about what they save.
const PARALLEL_PAIRS: u64 = 1 << 26;

/// One tile set of a descriptor, built independently of the others
/// ([`HostPlan::build_lists`]).
enum SetPart {
    /// A forward set: `fwd_ws`'s set `Some(set)`, or the plan's own tile (`None`), its work
    /// counts and its lists in [`ForwardArray::ALL`] order.
    Forward {
        set: Option<usize>,
        computed_pairs: u64,
        counts: TileCounts,
        lists: [Vec<u32>; 6],
    },
    /// The backward's transposed lists, key-major bits and ranks.
    Backward([(PlanArray, Vec<u32>); 8]),
}

impl SetPart {
    fn forward(set: Option<usize>, desc: TileDescriptor, rows: &RowIntervals) -> SetPart {
        SetPart::Forward {
            set,
            computed_pairs: desc.computed_pairs,
            counts: desc.counts(),
            lists: forward_lists(desc, rows),
        }
    }

    fn backward(rows: &RowIntervals) -> SetPart {
        let bwd = TileDescriptor::build(rows, bwd_tile());
        let order = heaviest_first(bwd.num_n_blocks, [&bwd.q_offsets, &bwd.full_q_offsets]);
        let masks = partial_key_masks(&bwd, rows);
        let (ranks, full_ranks) = visitor_ranks(&bwd);
        SetPart::Backward([
            (PlanArray::BwdNBlockOrder, order),
            (PlanArray::BwdQOffsets, bwd.q_offsets),
            (PlanArray::BwdQIndices, bwd.q_indices),
            (PlanArray::BwdFullQOffsets, bwd.full_q_offsets),
            (PlanArray::BwdFullQIndices, bwd.full_q_indices),
            (PlanArray::BwdPartialKeyMask, masks),
            (PlanArray::BwdQRanks, ranks),
            (PlanArray::BwdFullQRanks, full_ranks),
        ])
    }
}

/// The rank of every entry of `desc`'s transposed partial and full lists among the key blocks
/// that visit its query tile, lowest key block first ([`PlanArray::BwdQRanks`]).
fn visitor_ranks(desc: &TileDescriptor) -> (Vec<u32>, Vec<u32>) {
    let mut seen = vec![0u32; desc.num_m_blocks as usize];
    let mut ranks = vec![0u32; desc.q_indices.len()];
    let mut full_ranks = vec![0u32; desc.full_q_indices.len()];
    for n in 0..desc.num_n_blocks as usize {
        let lists = [
            (&desc.q_offsets, &desc.q_indices, &mut ranks),
            (&desc.full_q_offsets, &desc.full_q_indices, &mut full_ranks),
        ];
        for (offsets, indices, out) in lists {
            for i in offsets[n] as usize..offsets[n + 1] as usize {
                let m = indices[i] as usize;
                out[i] = seen[m];
                seen[m] += 1;
            }
        }
    }
    (ranks, full_ranks)
}

/// A piece of a descriptor built on its own ([`run_jobs`]).
type Job<'a, T> = Box<dyn FnOnce() -> T + Send + 'a>;

/// The results of `jobs` in order: with `parallel` (and more than one core) on scoped
/// threads, at most one per core, each taking every `threads`-th job; else one after the
/// other. A job's panic reaches the caller as it would have without threads.
fn run_jobs<'a, T: Send + 'a>(jobs: Vec<Job<'a, T>>, parallel: bool) -> Vec<T> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(jobs.len());
    if !parallel || threads < 2 {
        return jobs.into_iter().map(|job| job()).collect();
    }
    let count = jobs.len();
    let mut buckets: Vec<Vec<(usize, Job<'a, T>)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, job) in jobs.into_iter().enumerate() {
        buckets[i % threads].push((i, job));
    }
    let mut slots: Vec<Option<T>> = (0..count).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = buckets
            .into_iter()
            .map(|bucket| {
                scope.spawn(move || {
                    bucket
                        .into_iter()
                        .map(|(i, job)| (i, job()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            let done = h
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            for (i, result) in done {
                slots[i] = Some(result);
            }
        }
    });
    slots
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

/// A plan's descriptor on the host: exactly the arrays a [`DevicePlan`] holds on the device.
pub struct HostPlan {
    q_len: u32,
    kv_len: u32,
    tile: TileShape,
    arrays: [Vec<u32>; PLAN_ARRAY_COUNT],
    num_masks: u32,
    mask_dims: [u32; 2],
    stats: PlanStats,
    lists: PlanLists,
}

/// Work counts of a plan, summed over its `mask_index` entries (one per (batch, head) it was
/// built for; a plan of one mask for every (batch, head) has one entry, so its counts are per
/// head): the FLOP count basis of benchmarks.
#[derive(Clone, Copy, Debug, Default)]
struct PlanStats {
    visible_pairs: u64,
    computed_pairs: u64,
    counts: TileCounts,
    ws_computed_pairs: [u64; WS_SETS],
    ws_counts: [TileCounts; WS_SETS],
}

impl PlanStats {
    fn add(&mut self, o: &PlanStats) {
        self.visible_pairs += o.visible_pairs;
        self.computed_pairs += o.computed_pairs;
        for (a, b) in self.ws_computed_pairs.iter_mut().zip(&o.ws_computed_pairs) {
            *a += b;
        }
        let ws = self.ws_counts.iter_mut().zip(&o.ws_counts);
        for (a, b) in std::iter::once((&mut self.counts, &o.counts)).chain(ws) {
            a.full += b.full;
            a.partial += b.partial;
            a.empty += b.empty;
        }
    }
}

impl HostPlan {
    /// Builds the descriptor of `rows` at `tile` (the plan's own tile, [`cm_kernels::TILE`]),
    /// with a [`PlanArray::Ws`] set at each of [`cm_kernels::FWD_WS_TILES`] and the `Bwd*`
    /// arrays at [`cm_kernels::BWD_TILE`]: a plan of one mask for every (batch, head).
    pub fn build(rows: &RowIntervals, tile: TileShape) -> HostPlan {
        HostPlan::build_lists(rows, tile, PlanLists::All)
    }

    /// [`HostPlan::build`] restricted to the arrays `lists` holds; the others stay empty.
    fn build_lists(rows: &RowIntervals, tile: TileShape, lists: PlanLists) -> HostPlan {
        let pairs = u64::from(rows.q_len()) * u64::from(rows.kv_len());
        HostPlan::build_lists_on(rows, tile, lists, pairs >= PARALLEL_PAIRS)
    }

    /// [`HostPlan::build_lists`], each tile set classified and encoded on its own: on
    /// threads of their own with `parallel`.
    fn build_lists_on(
        rows: &RowIntervals,
        tile: TileShape,
        lists: PlanLists,
        parallel: bool,
    ) -> HostPlan {
        let mut jobs: Vec<Job<'_, SetPart>> = Vec::new();
        for set in (0..WS_SETS).filter(|&set| lists.holds_set(set)) {
            jobs.push(Box::new(move || {
                SetPart::forward(
                    Some(set),
                    TileDescriptor::build_forward(rows, ws_tile(set)),
                    rows,
                )
            }));
        }
        if lists == PlanLists::All {
            jobs.push(Box::new(move || {
                SetPart::forward(None, TileDescriptor::build_forward(rows, tile), rows)
            }));
            jobs.push(Box::new(move || SetPart::backward(rows)));
        }
        let parts = run_jobs(jobs, parallel);
        let mut arrays: [Vec<u32>; PLAN_ARRAY_COUNT] = std::array::from_fn(|_| Vec::new());
        let mut stats = PlanStats {
            visible_pairs: rows.visible_pairs(),
            ..PlanStats::default()
        };
        for part in parts {
            match part {
                SetPart::Forward {
                    set,
                    computed_pairs,
                    counts,
                    lists,
                } => {
                    match set {
                        Some(set) => {
                            stats.ws_computed_pairs[set] = computed_pairs;
                            stats.ws_counts[set] = counts;
                        }
                        None => {
                            stats.computed_pairs = computed_pairs;
                            stats.counts = counts;
                        }
                    }
                    for (a, v) in ForwardArray::ALL.into_iter().zip(lists) {
                        let array = match set {
                            Some(set) => PlanArray::Ws(a, set),
                            None => PlanArray::Forward(a),
                        };
                        arrays[array.index()] = v;
                    }
                }
                SetPart::Backward(lists) => {
                    for (a, v) in lists {
                        arrays[a.index()] = v;
                    }
                }
            }
        }
        arrays[PlanArray::MaskIndex.index()] = vec![0];
        HostPlan {
            q_len: rows.q_len(),
            kv_len: rows.kv_len(),
            tile,
            arrays,
            num_masks: 1,
            mask_dims: [1, 1],
            stats,
            lists,
        }
    }

    /// The descriptor of a plan of several masks: `masks` (each `q_len x kv_len`, planned at
    /// the same lengths) one after the other (see [`PlanArray`]), and `mask_index`, row-major
    /// `[mask_dims[0], mask_dims[1]]` = `[batch, num_heads]` (a side of 1 applies to every
    /// batch or head of a launch), naming the mask of each (batch, head). Only the arrays
    /// `lists` holds are built ([`PlanLists::All`] for a plan that any launch may read); the
    /// others stay empty.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when there is no mask, the masks' lengths differ,
    /// `mask_index` does not hold `mask_dims[0] * mask_dims[1]` entries, an entry names no
    /// mask, `lists` names no set, or the concatenation outgrows the kernels' u32 indices.
    pub fn build_masks(
        masks: &[&RowIntervals],
        mask_index: &[u32],
        mask_dims: [usize; 2],
        tile: TileShape,
        lists: PlanLists,
    ) -> Result<HostPlan, Error> {
        lists.check()?;
        let first = masks
            .first()
            .ok_or_else(|| Error::invalid("a plan needs at least one mask"))?;
        let (q_len, kv_len) = (first.q_len(), first.kv_len());
        if let Some((i, m)) = masks
            .iter()
            .enumerate()
            .find(|(_, m)| (m.q_len(), m.kv_len()) != (q_len, kv_len))
        {
            return Err(Error::invalid(format!(
                "mask {i} is {} x {}, mask 0 is {q_len} x {kv_len}: a plan's masks share q_len and kv_len",
                m.q_len(),
                m.kv_len()
            )));
        }
        let entries = mask_dims[0].checked_mul(mask_dims[1]);
        if entries != Some(mask_index.len()) || mask_index.is_empty() {
            return Err(Error::invalid(format!(
                "mask_index holds {} entries, expected mask_batch x mask_heads = {} x {} (at least 1 x 1)",
                mask_index.len(),
                mask_dims[0],
                mask_dims[1]
            )));
        }
        if let Some(&m) = mask_index.iter().find(|&&m| m as usize >= masks.len()) {
            return Err(Error::invalid(format!(
                "mask_index names mask {m}, but the plan has {} masks",
                masks.len()
            )));
        }
        let dims = mask_dims.map(|d| u32::try_from(d).unwrap_or(u32::MAX));
        let num_masks = u32::try_from(masks.len())
            .map_err(|_| Error::invalid(format!("{} masks exceed 2^32", masks.len())))?;
        // Several large masks build on threads of their own, each mask's sets in turn.
        let pairs = u64::from(q_len) * u64::from(kv_len);
        let jobs: Vec<Job<'_, HostPlan>> = masks
            .iter()
            .map(|&m| -> Job<'_, HostPlan> {
                if masks.len() > 1 {
                    Box::new(move || HostPlan::build_lists_on(m, tile, lists, false))
                } else {
                    Box::new(move || HostPlan::build_lists(m, tile, lists))
                }
            })
            .collect();
        let mut parts = run_jobs(jobs, masks.len() > 1 && pairs >= PARALLEL_PAIRS / 4);
        // Each concatenation allocated once at its final size (the first mask's arrays move).
        let mut arrays: [Vec<u32>; PLAN_ARRAY_COUNT] = std::array::from_fn(|i| {
            let total: usize = parts.iter().map(|p| p.arrays[i].len()).sum();
            if parts.len() > 1 {
                Vec::with_capacity(total)
            } else {
                Vec::new()
            }
        });
        for part in &mut parts {
            // Bases of the concatenated lists of tile indices that this mask's offsets point
            // into.
            let base = |a: PlanArray| -> Result<u32, Error> {
                u32::try_from(arrays[a.index()].len()).map_err(|_| {
                    Error::invalid(format!(
                        "the plan's {} array outgrows the kernels' 32-bit indices",
                        a.name()
                    ))
                })
            };
            let mut shifts = [0u32; PLAN_ARRAY_COUNT];
            for a in PlanArray::ALL {
                if let Some(target) = a.indexes() {
                    shifts[a.index()] = base(target)?;
                }
            }
            for a in PlanArray::ALL {
                if a == PlanArray::MaskIndex {
                    continue;
                }
                let shift = shifts[a.index()];
                let src = std::mem::take(&mut part.arrays[a.index()]);
                let dst = &mut arrays[a.index()];
                if shift == 0 && dst.capacity() == 0 {
                    // A plan of one mask: its arrays move as they are.
                    *dst = src;
                } else if src
                    .iter()
                    .max()
                    .is_some_and(|&v| v.checked_add(shift).is_none())
                {
                    return Err(Error::invalid(format!(
                        "the plan's {} array outgrows the kernels' 32-bit indices",
                        a.name()
                    )));
                } else {
                    dst.extend(src.iter().map(|&v| v + shift));
                }
            }
        }
        arrays[PlanArray::MaskIndex.index()] = mask_index.to_vec();
        let mut stats = PlanStats::default();
        for &m in mask_index {
            stats.add(&parts[m as usize].stats);
        }
        Ok(HostPlan {
            q_len,
            kv_len,
            tile,
            arrays,
            num_masks,
            mask_dims: dims,
            stats,
            lists,
        })
    }

    /// The arrays, in [`PlanArray::ALL`] order.
    pub fn arrays(&self) -> &[Vec<u32>; PLAN_ARRAY_COUNT] {
        &self.arrays
    }

    pub fn tile(&self) -> TileShape {
        self.tile
    }

    /// Distinct masks the arrays hold.
    pub fn num_masks(&self) -> u32 {
        self.num_masks
    }

    /// `[mask_batch, mask_heads]` of `mask_index`.
    pub fn mask_dims(&self) -> [u32; 2] {
        self.mask_dims
    }

    /// The arrays this descriptor holds.
    pub fn lists(&self) -> PlanLists {
        self.lists
    }
}

/// Where a plan's descriptor arrays are and the sizes a launch needs, checked against each
/// other but bound to no device: what the launches' argument checks read. Its addresses are
/// plain numbers, so making one is safe and needs no GPU; only a [`PlanView`] over it can be
/// launched.
#[derive(Clone, Copy, Debug)]
pub struct PlanLayout {
    addrs: [u64; PLAN_ARRAY_COUNT],
    pub(crate) q_len: u32,
    pub(crate) kv_len: u32,
    pub(crate) tile: TileShape,
    pub(crate) num_m_blocks: u32,
    /// Query blocks at each [`PlanArray::Ws`] set's tile.
    pub(crate) ws_num_m_blocks: [u32; WS_SETS],
    /// The [`PlanArray::Ws`] sets best first for this plan ([`ws_order`]): a forward of
    /// [`crate::KernelKind::FwdWs`] runs the first set's tile that is built for its head dims.
    pub(crate) ws_order: [usize; WS_SETS],
    /// Key blocks at [`cm_kernels::BWD_TILE`].
    pub(crate) bwd_num_n_blocks: u32,
    /// Whether the deterministic backward adds dQ in turns ([`dq_in_turns`]).
    pub(crate) dq_turns: bool,
    /// Distinct masks in the arrays.
    pub(crate) num_masks: u32,
    /// `[mask_batch, mask_heads]` of `mask_index` (a side of 1 applies to every batch or head).
    pub(crate) mask_dims: [u32; 2],
    /// The arrays the descriptor holds; [`PlanLayout::addr`] refuses the others.
    pub(crate) lists: PlanLists,
}

/// A [`PlanLayout`] in device memory of one CUDA context: what [`crate::Runtime::forward_raw`]
/// and [`crate::Runtime::backward_raw`] read. A [`DevicePlan`] derefs to its view;
/// [`PlanView::borrowed`] makes one over arrays someone else owns.
pub struct PlanView {
    pub(crate) ctx: Arc<CudaContext>,
    layout: PlanLayout,
}

impl Deref for PlanView {
    type Target = PlanLayout;

    fn deref(&self) -> &PlanLayout {
        &self.layout
    }
}

impl PlanView {
    /// A view of descriptor arrays in device memory of `ctx` that the caller owns, laid out as
    /// `layout` says.
    ///
    /// # Safety
    /// Each array of `layout` must hold the contents [`HostPlan::arrays`] gave (a prefix of at
    /// least its length, then anything), in device memory of `ctx` that stays allocated and
    /// unwritten until every launch reading this view has finished.
    #[allow(unsafe_code)]
    pub unsafe fn borrowed(ctx: Arc<CudaContext>, layout: PlanLayout) -> PlanView {
        PlanView { ctx, layout }
    }
}

impl PlanLayout {
    /// The layout of descriptor arrays at the given addresses: `arrays[i]` is the address and
    /// length (in u32 elements, padding included) of [`PlanArray::ALL`]`[i]`, as
    /// [`HostPlan::build_masks`] made them for `num_masks` masks of `q_len x kv_len` at `tile`
    /// with `mask_index [mask_dims[0], mask_dims[1]]` and `lists`. The entries of arrays that
    /// `lists` does not hold are ignored (launches that read them are refused).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a held array is misaligned or shorter than the lengths,
    /// the number of masks and `mask_dims` fix, `num_masks` or a side of `mask_dims` is 0, or
    /// `lists` names no set.
    pub fn new(
        q_len: u32,
        kv_len: u32,
        tile: TileShape,
        num_masks: u32,
        mask_dims: [u32; 2],
        arrays: [(u64, usize); PLAN_ARRAY_COUNT],
        lists: PlanLists,
    ) -> Result<PlanLayout, Error> {
        lists.check()?;
        if tile.block_m == 0 || tile.block_n == 0 {
            return Err(Error::invalid(format!(
                "plan tile {}x{} has a zero side",
                tile.block_m, tile.block_n
            )));
        }
        if num_masks == 0 || mask_dims.contains(&0) {
            return Err(Error::invalid(format!(
                "a plan of {num_masks} masks with mask_index {mask_dims:?}: both need at least one"
            )));
        }
        let (num_m_blocks, _) = block_counts(q_len, kv_len, tile);
        let ws_num_m_blocks = ws_m_blocks(q_len, kv_len);
        let (_, bwd_num_n_blocks) = block_counts(q_len, kv_len, bwd_tile());
        let mut arrays = arrays;
        for (a, slot) in PlanArray::ALL.iter().zip(&mut arrays) {
            if !lists.holds(*a) {
                *slot = (0, 0);
                continue;
            }
            let (addr, len) = *slot;
            if addr == 0 || addr % a.align() != 0 {
                return Err(Error::invalid(format!(
                    "plan array {}: address {addr:#x} is null or not {}-byte aligned",
                    a.name(),
                    a.align()
                )));
            }
            let need = if *a == PlanArray::MaskIndex {
                Some(mask_dims[0] as usize * mask_dims[1] as usize)
            } else {
                a.fixed_len(num_m_blocks, &ws_num_m_blocks, bwd_num_n_blocks)
                    .map(|n| n * num_masks as usize)
            };
            if let Some(need) = need {
                if len < need {
                    return Err(Error::invalid(format!(
                        "plan array {} holds {len} elements; {num_masks} masks of q_len = {q_len} and \
                         kv_len = {kv_len} with mask_index {mask_dims:?} need {need}: the descriptor \
                         was built for other lengths",
                        a.name()
                    )));
                }
            }
        }
        let lens = arrays.map(|(_, len)| len);
        Ok(PlanLayout {
            addrs: arrays.map(|(addr, _)| addr),
            q_len,
            kv_len,
            tile,
            num_m_blocks,
            ws_num_m_blocks,
            ws_order: lists.ws_order(&lens),
            bwd_num_n_blocks,
            dq_turns: dq_in_turns(&lens),
            num_masks,
            mask_dims,
            lists,
        })
    }

    /// This layout with the [`PlanArray::Ws`] sets in `order` (best first), for arrays whose
    /// lengths were padded after [`ws_order`] read them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `order` is not a permutation of the sets.
    pub fn with_ws_order(mut self, order: &[usize]) -> Result<PlanLayout, Error> {
        let mut seen = [false; WS_SETS];
        for &set in order {
            if set < WS_SETS && !seen[set] {
                seen[set] = true;
            }
        }
        if order.len() != WS_SETS || !seen.iter().all(|&s| s) {
            return Err(Error::invalid(format!(
                "the forward's tile set order {order:?} is not a permutation of 0..{WS_SETS}"
            )));
        }
        if !self.lists.holds_set(order[0]) {
            return Err(Error::invalid(format!(
                "the forward's tile set order {order:?} puts set {} first, but the plan holds \
                 only {:?}",
                order[0], self.lists
            )));
        }
        self.ws_order.copy_from_slice(order);
        Ok(self)
    }

    /// This layout with the deterministic backward's dQ path `turns` ([`dq_in_turns`] of the
    /// arrays' lengths before padding), for arrays whose lengths were padded after it read
    /// them.
    pub fn with_dq_turns(mut self, turns: bool) -> PlanLayout {
        self.dq_turns = turns;
        self
    }

    /// The [`PlanArray::Ws`] sets best first.
    pub(crate) fn ws_order(&self) -> [usize; WS_SETS] {
        self.ws_order
    }

    /// Strides of `mask_index` for a launch over `batch x num_heads`: its own row-major
    /// strides, 0 along a side of 1 (which applies to every batch or head).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a side of `mask_index` is neither 1 nor the launch's.
    pub(crate) fn mask_strides(&self, batch: usize, num_heads: usize) -> Result<[u32; 2], Error> {
        let [mb, mh] = self.mask_dims;
        for (what, plan_n, n) in [("batch", mb, batch), ("num_heads", mh, num_heads)] {
            if plan_n != 1 && plan_n as usize != n {
                return Err(Error::invalid(format!(
                    "the plan's masks are for {what} = {plan_n}, but q has {what} = {n}"
                )));
            }
        }
        Ok([if mb == 1 { 0 } else { mh }, u32::from(mh != 1)])
    }

    /// Device address of one array.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the descriptor does not hold `a` (its [`PlanLists`]).
    pub(crate) fn addr(&self, a: PlanArray) -> Result<u64, Error> {
        if !self.lists.holds(a) {
            return Err(Error::invalid(format!(
                "the plan holds only its {:?} lists, and this launch reads plan array {}: \
                 build the plan with PlanLists::All (Runtime::upload_plan) for this kernel",
                self.lists,
                a.name()
            )));
        }
        Ok(self.addrs[a.index()])
    }

    /// The arrays the descriptor holds.
    pub fn lists(&self) -> PlanLists {
        self.lists
    }

    pub fn q_len(&self) -> u32 {
        self.q_len
    }

    pub fn kv_len(&self) -> u32 {
        self.kv_len
    }

    /// The tile shape the descriptor was built at (the kernel's).
    pub fn tile(&self) -> TileShape {
        self.tile
    }
}

/// A plan's descriptor on the device (every mask and `mask_index`), in one allocation this
/// plan owns (every [`PlanArray`], concatenated).
pub struct DevicePlan {
    view: PlanView,
    pub(crate) buffer: CudaSlice<u32>,
    stats: PlanStats,
}

impl Deref for DevicePlan {
    type Target = PlanView;

    fn deref(&self) -> &PlanView {
        &self.view
    }
}

impl DevicePlan {
    /// Copies `host` to the device on `stream`, then waits for the copy, so the plan is ready
    /// for launches on any stream of the context.
    pub(crate) fn upload(host: &HostPlan, stream: &Arc<CudaStream>) -> Result<DevicePlan, Error> {
        // The allocation is 256-byte aligned; padding each array's offset to its alignment
        // keeps every one aligned for the kernels' loads.
        let mut flat: Vec<u32> = Vec::new();
        let mut offsets = [0usize; PLAN_ARRAY_COUNT];
        for ((offset, array), a) in offsets.iter_mut().zip(&host.arrays).zip(PlanArray::ALL) {
            let align = (a.align() / 4) as usize;
            flat.resize(flat.len().next_multiple_of(align), 0);
            *offset = flat.len();
            flat.extend_from_slice(array);
        }
        let buffer = stream
            .clone_htod(&flat)
            .map_err(|e| Error::driver("plan upload", e))?;
        stream
            .synchronize()
            .map_err(|e| Error::driver("plan upload", e))?;
        let base = {
            let (ptr, _guard) = buffer.device_ptr(stream);
            ptr
        };
        let tile = host.tile;
        let (num_m_blocks, _) = block_counts(host.q_len, host.kv_len, tile);
        let ws_num_m_blocks = ws_m_blocks(host.q_len, host.kv_len);
        let (_, bwd_num_n_blocks) = block_counts(host.q_len, host.kv_len, bwd_tile());
        let lens = std::array::from_fn(|i| host.arrays[i].len());
        Ok(DevicePlan {
            view: PlanView {
                ctx: stream.context().clone(),
                layout: PlanLayout {
                    addrs: offsets.map(|o| base + 4 * o as u64),
                    q_len: host.q_len,
                    kv_len: host.kv_len,
                    tile,
                    num_m_blocks,
                    ws_num_m_blocks,
                    ws_order: host.lists.ws_order(&lens),
                    bwd_num_n_blocks,
                    dq_turns: dq_in_turns(&lens),
                    num_masks: host.num_masks,
                    mask_dims: host.mask_dims,
                    lists: host.lists,
                },
            },
            buffer,
            stats: host.stats,
        })
    }

    /// Visible (q, k) pairs summed over the plan's `mask_index` entries (per head for a plan
    /// of one mask for every head): the FLOP count basis (`4 * heads * head_dim * pairs`
    /// for one mask).
    pub fn visible_pairs(&self) -> u64 {
        self.stats.visible_pairs
    }

    /// In-range pairs inside full and partial tiles, summed like [`DevicePlan::visible_pairs`]:
    /// the work the kernel does.
    pub fn computed_pairs(&self) -> u64 {
        self.stats.computed_pairs
    }

    /// Tiles by class at [`PlanLayout::tile`], summed like [`DevicePlan::visible_pairs`].
    pub fn tile_counts(&self) -> TileCounts {
        self.stats.counts
    }

    /// The tile shape `variant` (an index into [`cm_kernels::VARIANTS`] of a forward kernel)
    /// runs this plan at: its [`PlanArray::Ws`] set's for [`crate::KernelKind::FwdWs`],
    /// [`PlanLayout::tile`] for the reference forwards.
    pub fn variant_tile(&self, variant: usize) -> TileShape {
        match ws_set(cm_kernels::VARIANTS[variant].tile()) {
            Some(set) if cm_kernels::VARIANTS[variant].kernel == KernelKind::FwdWs => ws_tile(set),
            _ => self.tile,
        }
    }

    /// [`DevicePlan::computed_pairs`] at [`DevicePlan::variant_tile`]: the work `variant`
    /// does per head.
    pub fn variant_computed_pairs(&self, variant: usize) -> u64 {
        match self.ws_stats_set(variant) {
            Some(set) => self.stats.ws_computed_pairs[set],
            None => self.stats.computed_pairs,
        }
    }

    /// [`DevicePlan::tile_counts`] at [`DevicePlan::variant_tile`].
    pub fn variant_tile_counts(&self, variant: usize) -> TileCounts {
        match self.ws_stats_set(variant) {
            Some(set) => self.stats.ws_counts[set],
            None => self.stats.counts,
        }
    }

    fn ws_stats_set(&self, variant: usize) -> Option<usize> {
        let v = &cm_kernels::VARIANTS[variant];
        (v.kernel == KernelKind::FwdWs)
            .then(|| ws_set(v.tile()))
            .flatten()
    }

    /// Bytes of device memory the plan holds.
    pub fn device_bytes(&self) -> usize {
        self.buffer.len() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bit of each [`PlanArray::Ws`] set's `partial_row_mask` against membership in the
    /// row's intervals, on rows with several runs per tile, ragged lengths (q_len and kv_len
    /// not multiples of 128 or 192) and empty rows; and each partial tile's bits neither all
    /// set nor all clear over its in-range pairs (those would be full or empty tiles).
    #[test]
    fn partial_row_masks_match_the_intervals() {
        let (q_len, kv_len) = (433u32, 301u32);
        let rows = random_rows(q_len, kv_len, 0x2545_f491_4f6c_dd1d);
        let rows = RowIntervals::from_rows(kv_len, &rows).unwrap();
        for set in 0..WS_SETS {
            check_partial_row_masks(&rows, ws_tile(set));
        }
    }

    fn check_partial_row_masks(rows: &RowIntervals, tile: TileShape) {
        let (q_len, kv_len) = (rows.q_len(), rows.kv_len());
        let desc = TileDescriptor::build(rows, tile);
        let masks = partial_row_masks(&desc, rows);
        let (bm, bn) = (tile.block_m as usize, tile.block_n);
        assert!(!desc.kv_indices.is_empty());
        assert_eq!(masks.len(), desc.kv_indices.len() * bm * 4);
        for m in 0..desc.num_m_blocks as usize {
            for p in desc.kv_offsets[m] as usize..desc.kv_offsets[m + 1] as usize {
                let key0 = desc.kv_indices[p] * bn;
                let (mut set, mut clear) = (0, 0);
                for r in 0..bm {
                    let q = (m * bm + r) as u32;
                    for c in 0..bn {
                        let bit = masks[(p * bm + r) * 4 + (c / 32) as usize] >> (c % 32) & 1 == 1;
                        let k = key0 + c;
                        let visible =
                            q < q_len && rows.row(q).iter().any(|iv| iv.start <= k && k < iv.end);
                        assert_eq!(bit, visible, "tile {p} row {q} key {k}");
                        if q < q_len && k < kv_len {
                            if visible {
                                set += 1;
                            } else {
                                clear += 1;
                            }
                        }
                    }
                }
                assert!(set > 0 && clear > 0, "tile {p} is not partial");
            }
        }
    }

    /// Rows of `kv_len` keys with up to 12 random runs each (xorshift from `seed`).
    fn random_rows(q_len: u32, kv_len: u32, seed: u64) -> Vec<Vec<(u32, u32)>> {
        let mut seed = seed;
        let mut next = |bound: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % u64::from(bound)) as u32
        };
        (0..q_len)
            .map(|_| {
                let mut row = Vec::new();
                let mut k = next(40);
                while k < kv_len && row.len() < 12 {
                    let end = (k + 1 + next(30)).min(kv_len);
                    row.push((k, end));
                    k = end + 1 + next(40);
                }
                row
            })
            .collect()
    }

    /// The `Bwd*` arrays of `rows` against brute force: the lists are
    /// `TileDescriptor::build`'s at [`cm_kernels::BWD_TILE`] and classify every (query block, key block)
    /// tile exactly (all in-range pairs visible: full; none: in neither list; else partial),
    /// every bit of every partial tile's key-major mask is the pair's visibility (no bits
    /// past `q_len` or `kv_len`), the key-block order is heaviest first, each key block's lists
    /// ascend (the deterministic backward walks them merged, descending) and every entry's rank
    /// counts the lower key blocks that visit its query tile. Returns the numbers of partial
    /// and full tiles.
    fn check_bwd_arrays(rows: &RowIntervals) -> (usize, usize) {
        let (q_len, kv_len) = (rows.q_len(), rows.kv_len());
        let host = HostPlan::build(
            rows,
            TileShape {
                block_m: 64,
                block_n: 64,
            },
        );
        let array = |a: PlanArray| host.arrays()[a.index()].as_slice();
        let desc = TileDescriptor::build(rows, bwd_tile());
        let (q_offsets, q_indices) = (array(PlanArray::BwdQOffsets), array(PlanArray::BwdQIndices));
        let full_offsets = array(PlanArray::BwdFullQOffsets);
        let full_indices = array(PlanArray::BwdFullQIndices);
        assert_eq!(q_offsets, desc.q_offsets);
        assert_eq!(q_indices, desc.q_indices);
        assert_eq!(full_offsets, desc.full_q_offsets);
        assert_eq!(full_indices, desc.full_q_indices);
        let (num_m, num_n) = block_counts(q_len, kv_len, bwd_tile());
        assert_eq!((desc.num_m_blocks, desc.num_n_blocks), (num_m, num_n));
        let visible = |q: u32, k: u32| {
            q < q_len && k < kv_len && rows.row(q).iter().any(|iv| iv.start <= k && k < iv.end)
        };
        let (bm, bn) = (64u32, 128u32);
        let masks = array(PlanArray::BwdPartialKeyMask);
        assert_eq!(masks.len(), q_indices.len() * 128 * 2);
        for n in 0..num_n {
            let partial =
                &q_indices[q_offsets[n as usize] as usize..q_offsets[n as usize + 1] as usize];
            let full = &full_indices
                [full_offsets[n as usize] as usize..full_offsets[n as usize + 1] as usize];
            for m in 0..num_m {
                let (mut set, mut clear) = (0, 0);
                for q in m * bm..((m + 1) * bm).min(q_len) {
                    for k in n * bn..((n + 1) * bn).min(kv_len) {
                        if visible(q, k) {
                            set += 1;
                        } else {
                            clear += 1;
                        }
                    }
                }
                let class = (partial.contains(&m), full.contains(&m));
                let want = (set > 0 && clear > 0, set > 0 && clear == 0);
                assert_eq!(
                    class, want,
                    "tile (q block {m}, key block {n}): {set} set, {clear} clear"
                );
            }
            for list in [partial, full] {
                assert!(
                    list.windows(2).all(|w| w[0] < w[1]),
                    "key block {n}: {list:?}"
                );
            }
            let ranks = [array(PlanArray::BwdQRanks), array(PlanArray::BwdFullQRanks)];
            let lists = [(q_offsets, q_indices), (full_offsets, full_indices)];
            for ((offsets, indices), ranks) in lists.into_iter().zip(ranks) {
                assert_eq!(ranks.len(), indices.len());
                for i in offsets[n as usize] as usize..offsets[n as usize + 1] as usize {
                    let m = indices[i];
                    let lower = (0..n as usize)
                        .filter(|&n2| {
                            let holds = |o: &[u32], ix: &[u32]| {
                                ix[o[n2] as usize..o[n2 + 1] as usize].contains(&m)
                            };
                            holds(q_offsets, q_indices) || holds(full_offsets, full_indices)
                        })
                        .count();
                    assert_eq!(
                        ranks[i] as usize, lower,
                        "entry {i} (q block {m}, key block {n})"
                    );
                }
            }
            for i in q_offsets[n as usize] as usize..q_offsets[n as usize + 1] as usize {
                let m = q_indices[i];
                for c in 0..bn {
                    for w in 0..2 {
                        let word = masks[(i * 128 + c as usize) * 2 + w as usize];
                        for b in 0..32 {
                            let (q, k) = (m * bm + 32 * w + b, n * bn + c);
                            assert_eq!(
                                word >> b & 1 == 1,
                                visible(q, k),
                                "entry {i} (q block {m}, key block {n}) row {q} key {k}"
                            );
                        }
                    }
                }
            }
        }
        let order = array(PlanArray::BwdNBlockOrder);
        let work = |n: u32| {
            let n = n as usize;
            q_offsets[n + 1] - q_offsets[n] + full_offsets[n + 1] - full_offsets[n]
        };
        let mut sorted = order.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..num_n).collect::<Vec<_>>());
        assert!(order.windows(2).all(|w| work(w[0]) >= work(w[1])));
        (q_indices.len(), full_indices.len())
    }

    /// `bwd_partial_key_mask` bit by bit, and the `Bwd*` lists tile by tile, on rows with
    /// several runs per tile, ragged lengths (neither a multiple of the block), a block of
    /// rows that sees every key (full tiles) and one that sees none (empty tiles).
    #[test]
    fn partial_key_masks_match_the_intervals() {
        let (q_len, kv_len) = (333u32, 301u32);
        let mut rows = random_rows(q_len, kv_len, 0x9e37_79b9_7f4a_7c15);
        for (q, row) in rows.iter_mut().enumerate() {
            match q {
                64..128 => *row = vec![(0, kv_len)],
                192..256 => row.clear(),
                _ if q % 7 == 3 => row.clear(),
                _ => {}
            }
        }
        let rows = RowIntervals::from_rows(kv_len, &rows).unwrap();
        let (partial, full) = check_bwd_arrays(&rows);
        // Blocks 0, 2, 4 and 5 partial with each of the 3 key blocks; block 1 full.
        assert_eq!((partial, full), (12, 3));
    }

    /// Lengths shorter than the blocks (the tile clamps to one block each way): bits only for
    /// rows < q_len and keys < kv_len, at the fixed `[128, 2]` stride per tile.
    #[test]
    fn partial_key_masks_of_lengths_shorter_than_a_block() {
        let (q_len, kv_len) = (10u32, 70u32);
        // Row q sees keys [5q, 5q + 20) and [60, 70) (joined where they meet).
        let partial: Vec<Vec<(u32, u32)>> = (0..q_len)
            .map(|q| {
                let (a, b) = (5 * q, (5 * q + 20).min(kv_len));
                if b >= 60 {
                    vec![(a, kv_len)]
                } else {
                    vec![(a, b), (60, kv_len)]
                }
            })
            .collect();
        let rows = RowIntervals::from_rows(kv_len, &partial).unwrap();
        assert_eq!(check_bwd_arrays(&rows), (1, 0));
        let host = HostPlan::build(&rows, TileShape::default());
        let masks = &host.arrays()[PlanArray::BwdPartialKeyMask.index()];
        // Key 0 is seen by row 0 only; key 65 by all 10 rows; keys past 70 by none.
        assert_eq!(masks[..2], [1, 0]);
        assert_eq!(masks[65 * 2..66 * 2], [(1 << 10) - 1, 0]);
        assert!(masks[70 * 2..].iter().all(|&w| w == 0));
        // Every pair visible: one full tile; none: no tile.
        let all =
            RowIntervals::from_rows(kv_len, &vec![vec![(0, kv_len)]; q_len as usize]).unwrap();
        assert_eq!(check_bwd_arrays(&all), (0, 1));
        let none = RowIntervals::from_rows(kv_len, &vec![vec![]; q_len as usize]).unwrap();
        assert_eq!(check_bwd_arrays(&none), (0, 0));
        // Only the keys shorter than a block, and only the rows.
        let rows = RowIntervals::from_rows(70, &random_rows(100, 70, 7)).unwrap();
        check_bwd_arrays(&rows);
        let rows = RowIntervals::from_rows(300, &random_rows(10, 300, 11)).unwrap();
        check_bwd_arrays(&rows);
    }

    /// A plan of several masks holds each mask's single-mask arrays one after the other: the
    /// fixed-stride arrays verbatim at stride `fixed_len`, the concatenated ones with every
    /// offset and interval index shifted by the lengths of the masks before it; its
    /// `mask_index` is the given one; bad mask indices, lengths and counts are errors.
    #[test]
    fn a_plan_of_several_masks_concatenates_each_masks_arrays() {
        let tile = TileShape {
            block_m: 64,
            block_n: 64,
        };
        let (q_len, kv_len) = (200u32, 170u32);
        let masks: Vec<RowIntervals> = [3u64, 5, 7]
            .iter()
            .map(|&seed| {
                RowIntervals::from_rows(kv_len, &random_rows(q_len, kv_len, seed)).unwrap()
            })
            .collect();
        let refs: Vec<&RowIntervals> = masks.iter().collect();
        let index = [2u32, 0, 0, 1, 2, 1];
        let multi = HostPlan::build_masks(&refs, &index, [2, 3], tile, PlanLists::All).unwrap();
        assert_eq!((multi.num_masks(), multi.mask_dims()), (3, [2, 3]));
        assert_eq!(multi.arrays()[PlanArray::MaskIndex.index()], index);
        let singles: Vec<HostPlan> = masks.iter().map(|m| HostPlan::build(m, tile)).collect();
        let (m, _) = block_counts(q_len, kv_len, tile);
        let ws_m = ws_m_blocks(q_len, kv_len);
        let (_, bwd_n) = block_counts(q_len, kv_len, bwd_tile());
        for a in PlanArray::ALL {
            if a == PlanArray::MaskIndex {
                continue;
            }
            let mut at = 0;
            for (i, single) in singles.iter().enumerate() {
                let own = &single.arrays()[a.index()];
                if let Some(n) = a.fixed_len(m, &ws_m, bwd_n) {
                    assert_eq!(own.len(), n, "{} of mask {i}", a.name());
                }
                let shift: u32 = a.indexes().map_or(0, |target| {
                    singles[..i]
                        .iter()
                        .map(|s| s.arrays()[target.index()].len() as u32)
                        .sum()
                });
                let got = &multi.arrays()[a.index()][at..at + own.len()];
                let want: Vec<u32> = own.iter().map(|v| v + shift).collect();
                assert_eq!(got, want, "{} of mask {i}", a.name());
                at += own.len();
            }
            assert_eq!(at, multi.arrays()[a.index()].len(), "{}", a.name());
        }
        let err = |r: Result<HostPlan, Error>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err(HostPlan::build_masks(
            &refs,
            &[3],
            [1, 1],
            tile,
            PlanLists::All
        ))
        .contains("names mask 3"));
        assert!(err(HostPlan::build_masks(
            &refs,
            &[0, 1],
            [1, 3],
            tile,
            PlanLists::All
        ))
        .contains("2 entries"));
        assert!(err(HostPlan::build_masks(
            &[],
            &[0],
            [1, 1],
            tile,
            PlanLists::All
        ))
        .contains("at least one mask"));
        let short = RowIntervals::from_rows(kv_len, &random_rows(10, kv_len, 1)).unwrap();
        assert!(err(HostPlan::build_masks(
            &[&masks[0], &short],
            &[0, 1],
            [1, 2],
            tile,
            PlanLists::All
        ))
        .contains("share q_len and kv_len"));
    }

    #[test]
    fn host_plan_arrays_have_the_lengths_the_view_checks() {
        let rows: Vec<Vec<(u32, u32)>> = (0..150u32).map(|q| vec![(0, q + 1)]).collect();
        let rows = RowIntervals::from_rows(150, &rows).unwrap();
        let tile = TileShape {
            block_m: 64,
            block_n: 64,
        };
        let host = HostPlan::build(&rows, tile);
        let (m, n) = block_counts(150, 150, tile);
        assert_eq!((m, n), (3, 3));
        let ws_m = ws_m_blocks(150, 150);
        // 150 rows are two 128-row blocks, or one 192-row block (clamped to 150 rows).
        assert_eq!(ws_m, [2, 1]);
        let (_, bwd_n) = block_counts(150, 150, bwd_tile());
        assert_eq!(bwd_n, 2);
        for (a, array) in PlanArray::ALL.iter().zip(host.arrays()) {
            if let Some(len) = a.fixed_len(m, &ws_m, bwd_n) {
                assert_eq!(array.len(), len, "{}", a.name());
            }
        }
        let array = |a: PlanArray| host.arrays()[a.index()].as_slice();
        // Causal at 64x64 over 150 rows: 3 diagonal tiles partial, 3 below them full; each
        // partial tile's rows as 2 words, row 10 of the first seeing keys 0..=10 and row 21
        // of the last (row 149, the last row) keys 128..=149; rows from 150 on have no bits.
        assert_eq!(array(PlanArray::Forward(ForwardArray::KvIndices)).len(), 3);
        assert_eq!(
            array(PlanArray::Forward(ForwardArray::FullKvIndices)).len(),
            3
        );
        let bits = array(PlanArray::Forward(ForwardArray::PartialRowMask));
        assert_eq!(bits.len(), 3 * 64 * 2);
        assert_eq!(bits[10 * 2..11 * 2], [(1 << 11) - 1, 0]);
        let last = 2 * 64 * 2;
        assert_eq!(bits[last + 21 * 2..last + 22 * 2], [(1 << 22) - 1, 0]);
        assert!(bits[last + 22 * 2..].iter().all(|&w| w == 0));
        // At 128x128: the two diagonal tiles partial, the one below them full; the longer
        // second query block is scheduled first.
        let ws = |a: ForwardArray, set: usize| array(PlanArray::Ws(a, set));
        assert_eq!(ws(ForwardArray::KvIndices, 0), [0, 1]);
        assert_eq!(ws(ForwardArray::FullKvIndices, 0), [0]);
        assert_eq!(ws(ForwardArray::MBlockOrder, 0), [1, 0]);
        // At 192x128 one block holds every row: both key tiles partial (row 0 sees key 0
        // only, and only rows 128.. reach keys 128..150), none full.
        assert_eq!(ws(ForwardArray::KvIndices, 1), [0, 1]);
        assert!(ws(ForwardArray::FullKvIndices, 1).is_empty());
        assert_eq!(ws(ForwardArray::MBlockOrder, 1), [0]);
        assert_eq!(ws(ForwardArray::KvOffsets, 1), [0, 2]);
        assert_eq!(
            PlanArray::Ws(ForwardArray::KvOffsets, 1).name(),
            "ws192x128_kv_offsets"
        );
        // Row 100 of block 0 sees keys 0..=100 of tile 0: words 0-2 full, 5 bits of word 3.
        let masks = ws(ForwardArray::PartialRowMask, 0);
        assert_eq!(masks.len(), 2 * 128 * 4);
        assert_eq!(
            masks[100 * 4..101 * 4],
            [u32::MAX, u32::MAX, u32::MAX, 0b11111]
        );
        // Block 1's diagonal tile (keys 128..256): row 130 sees 128..=130; row 149 is the last
        // row; rows from 150 on are past q_len and see nothing.
        let diag = 128 * 4;
        assert_eq!(masks[diag + 2 * 4..diag + 3 * 4], [0b111, 0, 0, 0]);
        assert_eq!(
            masks[diag + 21 * 4..diag + 22 * 4],
            [(1 << 22) - 1, 0, 0, 0]
        );
        assert!(masks[diag + 22 * 4..].iter().all(|&w| w == 0));
        // At 64x128, key block 0 (keys 0..128): query blocks 0 and 1 partial (row r sees
        // keys 0..=r), block 2 (rows 128..150) full; key block 1 (keys 128..150): block 2
        // partial. Key block 0, with 3 tiles, is scheduled first.
        assert_eq!(array(PlanArray::BwdQOffsets), [0, 2, 3]);
        assert_eq!(array(PlanArray::BwdQIndices), [0, 1, 2]);
        assert_eq!(array(PlanArray::BwdFullQOffsets), [0, 1, 1]);
        assert_eq!(array(PlanArray::BwdFullQIndices), [2]);
        assert_eq!(array(PlanArray::BwdNBlockOrder), [0, 1]);
        // Key-major: 128 keys of 2 words (rows 0..32, 32..64) per tile.
        let masks = array(PlanArray::BwdPartialKeyMask);
        assert_eq!(masks.len(), 3 * 128 * 2);
        let key = |tile: usize, c: usize| &masks[(tile * 128 + c) * 2..][..2];
        // Tile (0, 0): key 0 seen by every row, key 40 by rows 40..64, keys 64.. by none.
        assert_eq!(key(0, 0), [u32::MAX, u32::MAX]);
        assert_eq!(key(0, 40), [0, !((1 << 8) - 1)]);
        assert!(masks[64 * 2..128 * 2].iter().all(|&w| w == 0));
        // Tile (1, 0), rows 64..128: keys 0..=64 seen by every row, key 100 by rows 100..,
        // key 127 by row 127 only.
        assert!((0..=64).all(|c| key(1, c) == [u32::MAX, u32::MAX]));
        assert_eq!(key(1, 100), [0, !((1 << 4) - 1)]);
        assert_eq!(key(1, 127), [0, 1 << 31]);
        // Tile (2, 1), rows 128..150 and keys 128..150: key 128 seen by all 22 rows, key 149
        // by row 149; rows from 150 and keys from 150 on are past the lengths.
        assert_eq!(key(2, 0), [(1 << 22) - 1, 0]);
        assert_eq!(key(2, 21), [1 << 21, 0]);
        assert!(masks[(2 * 128 + 22) * 2..].iter().all(|&w| w == 0));
    }

    /// The deterministic backward's dQ path follows the share of partial tiles that brute force
    /// counts at [`cm_kernels::BWD_TILE`]: a causal mask (one partial tile per diagonal block,
    /// 3% at 4096) takes turns, scattered random rows (nearly every tile partial) do not, and
    /// the layouts of both carry their plan's choice until a padded caller overrides it.
    #[test]
    fn the_deterministic_dq_path_follows_the_share_of_partial_tiles() {
        let causal: Vec<Vec<(u32, u32)>> = (0..4096).map(|q| vec![(0, q + 1)]).collect();
        let cases = [
            (RowIntervals::from_rows(4096, &causal).unwrap(), true),
            (
                RowIntervals::from_rows(700, &random_rows(600, 700, 5)).unwrap(),
                false,
            ),
        ];
        for (rows, turns) in cases {
            let (partial, full) = check_bwd_arrays(&rows);
            let share = partial as f64 / (partial + full) as f64;
            assert_eq!(share <= DQ_TURNS_MAX_PARTIAL_SHARE, turns, "share {share}");
            let tile = TileShape {
                block_m: 64,
                block_n: 64,
            };
            let host = HostPlan::build(&rows, tile);
            let lens = host.arrays().each_ref().map(Vec::len);
            assert_eq!(dq_in_turns(&lens), turns, "share {share}");
            let mut slots = [(0u64, 0usize); PLAN_ARRAY_COUNT];
            for (i, (slot, len)) in slots.iter_mut().zip(lens).enumerate() {
                *slot = (0x100_0000 * (i as u64 + 1), len.max(4));
            }
            let layout = PlanLayout::new(
                rows.q_len(),
                rows.kv_len(),
                tile,
                1,
                [1, 1],
                slots,
                PlanLists::All,
            )
            .unwrap();
            assert_eq!(layout.dq_turns, turns);
            assert_eq!(layout.with_dq_turns(!turns).dq_turns, !turns);
        }
    }

    /// A descriptor of one forward set holds exactly that set's arrays (equal to a full
    /// build's) and `mask_index`; its layout checks only those, puts that set first, and
    /// refuses every other array by name.
    #[test]
    fn a_plan_of_one_forward_set_holds_that_set_alone() {
        let (q_len, kv_len) = (300u32, 433u32);
        let rows = RowIntervals::from_rows(kv_len, &random_rows(q_len, kv_len, 11)).unwrap();
        let tile = TileShape {
            block_m: 64,
            block_n: 64,
        };
        let full = HostPlan::build(&rows, tile);
        for set in 0..WS_SETS {
            let lists = PlanLists::Ws(set);
            let part = HostPlan::build_masks(&[&rows], &[0], [1, 1], tile, lists).unwrap();
            assert_eq!(part.lists(), lists);
            for a in PlanArray::ALL {
                let got = &part.arrays()[a.index()];
                if lists.holds(a) {
                    assert_eq!(got, &full.arrays()[a.index()], "{}", a.name());
                } else {
                    assert!(got.is_empty(), "{} is built", a.name());
                }
            }
            let mut slots = [(0u64, 0usize); PLAN_ARRAY_COUNT];
            for (i, (slot, a)) in slots.iter_mut().zip(part.arrays()).enumerate() {
                *slot = (0x100_0000 * (i as u64 + 1), a.len());
            }
            let layout = PlanLayout::new(q_len, kv_len, tile, 1, [1, 1], slots, lists).unwrap();
            assert_eq!(layout.ws_order()[0], set);
            let kv = PlanArray::Ws(ForwardArray::KvIndices, set);
            assert_eq!(layout.addr(kv).unwrap(), slots[kv.index()].0);
            let err = layout.addr(PlanArray::BwdQIndices).unwrap_err().to_string();
            assert!(err.contains("bwd_q_indices"), "{err}");
            let other = (set + 1) % WS_SETS;
            let order: Vec<usize> = (0..WS_SETS).map(|i| (other + i) % WS_SETS).collect();
            assert!(layout.with_ws_order(&order).is_err());
            // The same arrays read as a full plan: the missing lists are too short.
            assert!(
                PlanLayout::new(q_len, kv_len, tile, 1, [1, 1], slots, PlanLists::All)
                    .unwrap_err()
                    .to_string()
                    .contains("holds 0 elements")
            );
        }
        let bad = PlanLists::Ws(WS_SETS);
        assert!(HostPlan::build_masks(&[&rows], &[0], [1, 1], tile, bad).is_err());
    }

    /// The bit-matrix transpose against the bit-by-bit definition, on random matrices.
    #[test]
    fn transpose64_moves_every_bit_across_the_diagonal() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20 {
            let mut a = [0u64; 64];
            for row in a.iter_mut() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                *row = seed;
            }
            let mut t = a;
            transpose64(&mut t);
            for (r, row) in a.iter().enumerate() {
                for (c, col) in t.iter().enumerate() {
                    assert_eq!(col >> r & 1, row >> c & 1, "row {r} key {c}");
                }
            }
        }
    }

    /// The tile sets built on threads of their own give the same descriptor as built in
    /// turn (a sliding window over 8K rows: above the size that starts threads).
    #[test]
    fn threads_build_the_same_descriptor() {
        let len = 8192u32;
        let rows: Vec<Vec<(u32, u32)>> = (0..len)
            .map(|q| {
                vec![
                    (q.saturating_sub(700), q + 1),
                    ((q + 3000) % len, (q + 3000) % len + 1),
                ]
            })
            .map(|mut r| {
                r.sort();
                if r[0].1 >= r[1].0 {
                    r = vec![(r[0].0, r[0].1.max(r[1].1))];
                }
                r
            })
            .collect();
        let rows = RowIntervals::from_rows(len, &rows).unwrap();
        assert!(u64::from(len) * u64::from(len) >= PARALLEL_PAIRS);
        let tile = ws_tile(0);
        for lists in [PlanLists::All, PlanLists::Ws(1)] {
            let threads = HostPlan::build_lists_on(&rows, tile, lists, true);
            let in_turn = HostPlan::build_lists_on(&rows, tile, lists, false);
            for a in PlanArray::ALL {
                assert_eq!(
                    threads.arrays()[a.index()],
                    in_turn.arrays()[a.index()],
                    "{}",
                    a.name()
                );
            }
            assert_eq!(threads.stats.computed_pairs, in_turn.stats.computed_pairs);
            assert_eq!(
                threads.stats.ws_computed_pairs,
                in_turn.stats.ws_computed_pairs
            );
        }
    }

    /// Jobs on threads come back in their order, whatever the number of cores, and a
    /// job's panic reaches the caller.
    #[test]
    fn jobs_on_threads_return_in_order_and_raise_their_panics() {
        for parallel in [false, true] {
            let jobs: Vec<Job<'_, usize>> = (0..37)
                .map(|i| -> Job<'_, usize> { Box::new(move || i * i) })
                .collect();
            let got = run_jobs(jobs, parallel);
            assert_eq!(got, (0..37).map(|i| i * i).collect::<Vec<_>>());
        }
        let panicked = std::panic::catch_unwind(|| {
            let jobs: Vec<Job<'_, u32>> = vec![Box::new(|| 1), Box::new(|| panic!("job 1"))];
            run_jobs(jobs, true)
        });
        let message = panicked.unwrap_err();
        assert_eq!(message.downcast_ref::<&str>(), Some(&"job 1"));
    }
}
