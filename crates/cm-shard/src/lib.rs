//! Context parallelism: one long sequence (self-attention: its tokens are both the query rows
//! and the keys, `q_len == kv_len`) split across `ranks` devices by the work its mask gives each
//! token, and what every rank must fetch from every other.
//!
//! A plain split by positions gives the ranks very different work: under a causal mask the
//! last of two shards computes three times the pairs of the first. Here the sequence is cut
//! into chunks of `chunk` tokens, and the chunks are dealt to the ranks so that each holds
//! about the same number of visible pairs (query rows times their visible keys) with chunk
//! counts that differ by at most one (`num_chunks / ranks`, one more for the first
//! `num_chunks % ranks` ranks; the same number of tokens when the ranks divide the count): a
//! longest-first greedy deal with capacities, then swaps between the heaviest and the
//! lightest rank while they shrink the gap (MagiAttention's dispatch by mask area and
//! FlashMask's context-parallel balancing both balance the same quantity). Rank `r` holds its
//! chunks in ascending order; the [`TokenOrder`] that concatenates rank 0's tokens, rank 1's,
//! ... is the permutation of the sequence (queries and keys alike).
//!
//! Each rank's rows then read keys of other ranks. For each pair (rank `r`, source `s`) the
//! sharding holds the ranges of `s`'s local keys that some row of `r` sees (the only keys `r`
//! fetches from `s`; ring attention would fetch all of them), and only for the pairs where
//! there is one: that communication plan is what memory scales with, about `ranks` times the
//! sources each rank's visible keys reach, never `ranks x ranks` or `ranks x tokens`. A
//! [`Part`] (those ranges and `r`'s rows against them compacted into one index range, as row
//! intervals) is built on demand by [`Sharding::part`]. Attention over the parts of one rank,
//! merged by lse, is attention over its rows; the gradients of fetched keys go back to their
//! source along the same ranges and are summed there.
//!
//! Positions are 0-based; every interval and range is half-open `[start, end)`.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap};

use cm_ir::ScoreTerms;
use cm_plan::order::TokenOrder;
use cm_plan::rows::{KeyInterval, RowIntervals};
use cm_plan::tiles::{TileDescriptor, TileShape};
use cm_plan::{MaskPlan, Plan};
use serde::Serialize;

/// Why a sequence cannot be sharded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    #[error("ranks = 0: context parallelism needs at least one rank")]
    NoRanks,
    #[error("chunk = 0: chunks need at least one token")]
    EmptyChunk,
    #[error(
        "q_len = {q_len} and kv_len = {kv_len} differ: context parallelism splits one sequence \
         whose tokens are both the queries and the keys (self-attention)"
    )]
    NotSquare { q_len: u32, kv_len: u32 },
    #[error("{len} tokens cannot give each of ranks = {ranks} a token: at most {len} ranks")]
    TooManyRanks { len: u32, ranks: u32 },
    #[error(
        "{len} tokens in chunks of {chunk} make {chunks} chunks, fewer than ranks = {ranks}: \
         use a smaller chunk (at most {max_chunk}) or fewer ranks"
    )]
    TooFewChunks {
        len: u32,
        chunk: u32,
        chunks: u32,
        ranks: u32,
        max_chunk: u32,
    },
    #[error("the mask's strided runs expand to more intervals than a plan holds: {0}")]
    Expand(String),
    /// `ranges` is the bound of [`Sharding::key_ranges`] the deal gives: for every rank and
    /// every maximal interval of keys its rows see, the sources that interval can reach
    /// (`min(chunks it spans, ranks)`).
    #[error(
        "ranks = {ranks} over {len} tokens in chunks of {chunk}: the ranks' rows see keys in \
         up to {ranges} (rank, source) key ranges, more than the {MAX_KEY_RANGES} a sharding \
         holds (12 bytes each); use fewer ranks"
    )]
    TooLarge {
        ranks: u32,
        len: u32,
        chunk: u32,
        ranges: u64,
    },
    #[error(
        "the plan has batch = {batch} and {masks} distinct masks: context parallelism shards \
         one sequence (batch 1, e.g. a packed plan) whose heads share one mask"
    )]
    NotOneMask { batch: u32, masks: usize },
    /// Why each of the plan's score terms that reads positions (or is not carried) cannot go
    /// into a rank's parts, `; ` between them.
    #[error(
        "the plan has score terms that context parallelism does not carry into a rank's \
         parts: {0}; softcaps and sinks are carried, shard a plan without the others"
    )]
    Score(String),
}

/// What rank `r` reads from source rank `s` (`s == r`: its own keys, nothing to fetch), as
/// [`Sharding::part`] builds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Part {
    /// Ranges of `s`'s local key positions (`0..shard_len(s)`) that some row of `r` sees,
    /// ascending, disjoint and maximal.
    pub keys: Vec<(u32, u32)>,
    /// `r`'s rows (`0..shard_len(r)`) against those keys compacted in order: key `j` is the
    /// `j`-th key of `keys`. `kv_len` is the number of keys fetched.
    #[serde(skip)]
    pub rows: RowIntervals,
}

impl Part {
    /// Keys fetched: the sum of the ranges' lengths.
    pub fn fetched(&self) -> u32 {
        self.keys.iter().map(|&(a, b)| b - a).sum()
    }
}

/// A sequence dealt to ranks by work ([`shard`]). Memory: the mask, O(tokens + chunks), and
/// 12 bytes per (rank, source) key range ([`Sharding::key_ranges`]).
#[derive(Clone, Debug, Serialize)]
pub struct Sharding {
    pub ranks: u32,
    /// Tokens per chunk (the last chunk of the sequence may be shorter).
    pub chunk: u32,
    /// Sequence length (`q_len == kv_len`).
    pub len: u32,
    /// `order[new] = original`: rank 0's tokens, then rank 1's, ...
    pub order: TokenOrder,
    /// `ranks + 1` entries: rank `r` holds new positions `offsets[r]..offsets[r + 1]`.
    pub offsets: Vec<u32>,
    /// Rank `r`'s chunks, ascending (chunk `c` is original tokens `c * chunk ..
    /// min((c + 1) * chunk, len)`).
    pub chunks: Vec<Vec<u32>>,
    /// Visible pairs of each rank's rows.
    pub work: Vec<u64>,
    /// `ranks + 1` entries: rank `r` reads the key ranges `range_ptr[r]..range_ptr[r + 1]`
    /// of `range_source` and `keys`, by source and then position.
    range_ptr: Vec<u32>,
    /// Each key range's source rank.
    range_source: Vec<u32>,
    /// Each key range, in its source's local positions.
    keys: Vec<(u32, u32)>,
    /// Per chunk its rank, and its index in that rank's list.
    #[serde(skip)]
    owner: Vec<u32>,
    #[serde(skip)]
    slot: Vec<u32>,
    /// The mask (strided runs expanded), for the parts' rows, which are built on demand.
    #[serde(skip)]
    rows: RowIntervals,
    /// The score terms every part applies as the whole plan does ([`shard_plan`]: the
    /// softcap), carried into [`Sharding::part_plan`].
    #[serde(skip)]
    part_score: Option<ScoreTerms>,
}

impl Sharding {
    /// Tokens held by rank `r`.
    pub fn shard_len(&self, r: usize) -> u32 {
        self.offsets[r + 1] - self.offsets[r]
    }

    /// Original tokens of rank `r`, in its local order.
    fn tokens(&self, r: usize) -> &[u32] {
        &self.order.order[self.offsets[r] as usize..self.offsets[r + 1] as usize]
    }

    /// Indices of rank `r`'s key ranges.
    fn ranges(&self, r: usize) -> std::ops::Range<usize> {
        self.range_ptr[r] as usize..self.range_ptr[r + 1] as usize
    }

    /// Ranks whose keys some row of rank `r` sees, ascending (`r` itself among them when its
    /// rows see some of its own keys). Panics when `r >= ranks`.
    pub fn sources(&self, r: usize) -> impl Iterator<Item = u32> + '_ {
        self.range_source[self.ranges(r)]
            .chunk_by(|a, b| a == b)
            .map(|group| group[0])
    }

    /// Ranges of source `s`'s local key positions (`0..shard_len(s)`) that some row of rank
    /// `r` sees: ascending, disjoint and maximal; empty when there are none. O(log of `r`'s
    /// ranges). Panics when `r >= ranks`.
    pub fn keys(&self, r: usize, s: usize) -> &[(u32, u32)] {
        let ranges = self.ranges(r);
        let of = &self.range_source[ranges.clone()];
        let s = s as u32;
        let (lo, hi) = (
            of.partition_point(|&x| x < s),
            of.partition_point(|&x| x <= s),
        );
        &self.keys[ranges.start + lo..ranges.start + hi]
    }

    /// Key ranges held over every (rank, source) pair: the communication plan's size, at
    /// most [`MAX_KEY_RANGES`].
    pub fn key_ranges(&self) -> usize {
        self.keys.len()
    }

    /// What rank `r` reads from source `s`, rows included (for a source it reads nothing
    /// from: no keys, and `shard_len(r)` empty rows over none). Built from the mask: O(`r`'s
    /// rows x their intervals x log chunks). Panics when `r` or `s` is `>= ranks`.
    pub fn part(&self, r: usize, s: usize) -> Part {
        assert!(
            s < self.ranks as usize,
            "source {s} of {} ranks",
            self.ranks
        );
        let layout = self.layout();
        let tokens = self.tokens(r);
        let mut row_ptr = Vec::with_capacity(tokens.len() + 1);
        row_ptr.push(0u32);
        let mut ivs: Vec<(u32, u32)> = Vec::new();
        for &q in tokens {
            let row_start = ivs.len();
            for iv in self.rows.row(q) {
                let Some((a, b)) = layout.on(s, iv.start, iv.end) else {
                    continue;
                };
                // Keys of other ranks between two intervals vanish here: join them.
                match ivs[row_start..].last_mut() {
                    Some(prev) if prev.1 == a => prev.1 = b,
                    _ => ivs.push((a, b)),
                }
            }
            row_ptr.push(ivs.len() as u32);
        }
        compact(&row_ptr, &ivs)
    }

    /// Keys rank `r` fetches from the other ranks.
    pub fn fetched(&self, r: usize) -> u64 {
        let ranges = self.ranges(r);
        self.range_source[ranges.clone()]
            .iter()
            .zip(&self.keys[ranges])
            .filter(|&(&s, _)| s as usize != r)
            .map(|(_, &(a, b))| u64::from(b - a))
            .sum()
    }

    /// Keys ring attention moves to rank `r`: every other rank's shard.
    pub fn ring_fetched(&self, r: usize) -> u64 {
        u64::from(self.len - self.shard_len(r))
    }

    /// Part `(r, s)` ([`Sharding::part`]) as a plan of its own at `tile` (batch 1, one mask
    /// for every head): `q_len` = rank `r`'s tokens, `kv_len` = the keys it fetches from `s`;
    /// with the plan's softcap when [`shard_plan`] made the sharding (a sink joins the parts'
    /// merge instead: `compilemask.distributed`).
    pub fn part_plan(&self, r: usize, s: usize, tile: TileShape) -> Plan {
        let rows = self.part(r, s).rows;
        let tiles = TileDescriptor::build(&rows, tile);
        Plan {
            q_len: rows.q_len(),
            kv_len: rows.kv_len(),
            batch: 1,
            num_heads: 1,
            tile,
            raster_computed_pairs: tiles.computed_pairs,
            masks: vec![MaskPlan { rows, tiles }],
            mask_index: vec![0],
            uses_batch: false,
            uses_head: false,
            elementwise_pairs: 0,
            pieces: 0,
            order: None,
            order_candidates: Vec::new(),
            packing: None,
            score: self.part_score.clone(),
            tree_overhangs: Vec::new(),
        }
    }

    /// Pairs each rank's kernels compute at `tile` (in-range pairs of the non-empty tiles of
    /// its parts), without building the parts' rows: a block of `block_m` rows touches the
    /// key tiles that the union of its rows' keys touches, so each block splits that union
    /// over the sources once. O(blocks x the pieces of their unions).
    pub fn computed_pairs(&self, tile: TileShape) -> Vec<u64> {
        let layout = self.layout();
        let (mut union, mut pieces) = (Vec::new(), Vec::new());
        // Per part of a rank: its source, its ranges' indices and its keys fetched.
        let mut parts: Vec<(u32, std::ops::Range<usize>, u64)> = Vec::new();
        (0..self.ranks as usize)
            .map(|r| {
                let tokens = self.tokens(r);
                let (bm, _) = tile.clamped(tokens.len() as u32, 1);
                let ranges = self.ranges(r);
                if tokens.len() <= bm as usize {
                    // One block of all the rank's rows sees every key it reads: every key
                    // tile of every part.
                    return tokens.len() as u64 * fetched(&self.keys[ranges]);
                }
                parts.clear();
                let mut at = ranges.start;
                for group in self.range_source[ranges].chunk_by(|a, b| a == b) {
                    let span = at..at + group.len();
                    parts.push((group[0], span.clone(), fetched(&self.keys[span])));
                    at += group.len();
                }
                let mut total = 0u64;
                for block in tokens.chunks(bm as usize) {
                    union_of(&self.rows, block, &mut union);
                    pieces.clear();
                    layout.split(&union, &mut pieces);
                    let mut p = 0;
                    let mut cols = 0u64;
                    for group in pieces.chunk_by(|x, y| x.0 == y.0) {
                        // The block's keys on a source are among its rank's: that part exists.
                        while parts[p].0 != group[0].0 {
                            p += 1;
                        }
                        let (_, span, kv) = &parts[p];
                        cols += tile_columns(
                            &self.keys[span.clone()],
                            group.iter().map(|&(_, a, b)| (a, b)),
                            u64::from(tile.clamped(1, *kv as u32).1),
                            *kv,
                        );
                    }
                    total += block.len() as u64 * cols;
                }
                total
            })
            .collect()
    }

    fn layout(&self) -> Layout<'_> {
        Layout {
            chunks: &self.chunks,
            chunk: self.chunk,
            len: self.len,
            owner: &self.owner,
            slot: &self.slot,
        }
    }
}

/// Keys in `keys`.
fn fetched(keys: &[(u32, u32)]) -> u64 {
    keys.iter().map(|&(a, b)| u64::from(b - a)).sum()
}

/// Columns of the key tiles (`bn` keys wide, the last clipped at `kv` keys) that `pieces`
/// touch, where `pieces` are ascending, disjoint ranges of local keys, each inside one
/// range of `keys` (which is ascending; key `j` of the compacted part is its `j`-th key).
fn tile_columns(
    keys: &[(u32, u32)],
    pieces: impl Iterator<Item = (u32, u32)>,
    bn: u64,
    kv: u64,
) -> u64 {
    let (mut k, mut base) = (0usize, 0u64);
    let mut next_tile = 0u64;
    let mut cols = 0u64;
    for (a, b) in pieces {
        while keys[k].1 <= a {
            base += u64::from(keys[k].1 - keys[k].0);
            k += 1;
        }
        let start = base + u64::from(a - keys[k].0);
        let end = base + u64::from(b - keys[k].0);
        let first = (start / bn).max(next_tile);
        let last = (end - 1) / bn;
        if first <= last {
            cols += ((last + 1) * bn).min(kv) - first * bn;
            next_tile = last + 1;
        }
    }
    cols
}

/// Largest default chunk, in tokens.
pub const DEFAULT_CHUNK_MAX: u32 = 512;
/// Smallest default chunk, in tokens (unless the sequence is too short to give every rank a
/// chunk of it).
pub const DEFAULT_CHUNK_MIN: u32 = 64;
/// Chunks per rank the default chunk leaves where it can.
pub const DEFAULT_CHUNKS_PER_RANK: u32 = 4;

/// Tokens per chunk when the caller names none: the largest power of two from
/// [`DEFAULT_CHUNK_MAX`] (512) down to [`DEFAULT_CHUNK_MIN`] (64) that cuts `q_len` into at
/// least [`DEFAULT_CHUNKS_PER_RANK`] (4) chunks per rank (a short last chunk counts), else
/// 64; and `q_len / ranks` (at least 1) when 64 leaves fewer chunks than ranks, so that any
/// `q_len >= ranks` can be dealt. With one chunk per rank every rank's work is fixed by
/// positions and the deal cannot balance it (a causal mask in 2 chunks over 2 ranks keeps
/// 1.5x the mean on the last); 4 per rank gives the swaps room.
pub fn default_chunk(q_len: u32, ranks: u32) -> u32 {
    let chunks = |c: u32| u64::from(q_len.div_ceil(c));
    let ranks64 = u64::from(ranks.max(1));
    let mut c = DEFAULT_CHUNK_MAX;
    while c > DEFAULT_CHUNK_MIN && chunks(c) < u64::from(DEFAULT_CHUNKS_PER_RANK) * ranks64 {
        c /= 2;
    }
    if chunks(c) < ranks64 {
        c = (q_len / ranks.max(1)).max(1);
    }
    c
}

/// [`shard`] of a plan's one mask; see [`Sharding::part_plan`] for the parts as plans.
///
/// # Errors
/// [`ShardError::NotOneMask`] for a batch above 1 or masks that differ per head,
/// [`ShardError::Score`] for a plan with a bias that reads positions or a bias table
/// (naming why each is refused; softcaps go into every part; sinks and a bias constant per
/// head, which moves only each row's lse, into the parts' merge), and
/// [`shard`]'s errors.
pub fn shard_plan(plan: &Plan, ranks: u32, chunk: u32) -> Result<Sharding, ShardError> {
    if plan.batch != 1 || plan.masks.len() != 1 {
        return Err(ShardError::NotOneMask {
            batch: plan.batch,
            masks: plan.masks.len(),
        });
    }
    let mut part_score = None;
    if let Some(t) = &plan.score {
        // A part is its rank's rows against the keys they fetch from one source, both
        // compacted, so terms that read positions would read the wrong ones; the parts are
        // merged by lse. The softcap changes each logit alone, so every part applies it; a
        // sink joins each row's softmax once, so the merge adds it, not the parts; a bias
        // that reads no position adds one constant to every logit of a head, which moves
        // only that head's lse, so the merge adds it too (the caller reads it from the plan).
        let mut why = Vec::new();
        if t.linear
            .as_ref()
            .is_some_and(|l| l.q_coef != 0 || l.k_coef != 0)
        {
            why.push(
                "the linear bias reads the positions q and k, which a part renumbers (its rows and fetched keys are compacted)",
            );
        }
        if t.table.is_some() {
            why.push("the bias table reads the distance q - k, which a part renumbers (its rows and fetched keys are compacted)");
        }
        if !why.is_empty() {
            return Err(ShardError::Score(why.join("; ")));
        }
        part_score = t.softcap.map(|softcap| ScoreTerms {
            softcap: Some(softcap),
            linear: None,
            table: None,
            sink: None,
        });
    }
    let mut sharding = shard(&plan.masks[0].rows, ranks, chunk)?;
    sharding.part_score = part_score;
    Ok(sharding)
}

/// Most (rank, source) key ranges one sharding holds: 2^28, 12 bytes each (the range and its
/// source), so the communication plan stays within 3 GiB and its O(ranges) passes within
/// seconds. The uses context parallelism is for stay far below: a causal or windowed 256K
/// sequence over 1024 ranks, even in chunks of one token, has about a million ranges; a
/// causal 16K sequence with a rank per token has 2^27.
pub const MAX_KEY_RANGES: u64 = 1 << 28;

/// Deals `rows` (one square mask, `q_len == kv_len`) to `ranks` ranks in chunks of `chunk`
/// tokens, balancing visible pairs; see the module docs.
///
/// Cost: O(intervals x log) for the chunks' work and each rank's union of visible keys, the
/// deal's O(chunks x log ranks) plus per swap O(chunks per rank x log), and O(E x log E) for
/// the key ranges, where E (at most [`MAX_KEY_RANGES`], checked before they are built) sums
/// over each rank's maximal intervals of visible keys `min(chunks spanned, ranks)`. Memory:
/// the mask, O(chunks) and O(E).
///
/// # Errors
/// [`ShardError`] for zero ranks or chunk, a mask that is not square, fewer chunks than ranks,
/// an E above [`MAX_KEY_RANGES`] ([`ShardError::TooLarge`], naming E), or strided runs too
/// many to expand.
pub fn shard(rows: &RowIntervals, ranks: u32, chunk: u32) -> Result<Sharding, ShardError> {
    if ranks == 0 {
        return Err(ShardError::NoRanks);
    }
    if chunk == 0 {
        return Err(ShardError::EmptyChunk);
    }
    let (q_len, kv_len) = (rows.q_len(), rows.kv_len());
    if q_len != kv_len {
        return Err(ShardError::NotSquare { q_len, kv_len });
    }
    let len = q_len;
    if len < ranks {
        return Err(ShardError::TooManyRanks { len, ranks });
    }
    let num_chunks = len.div_ceil(chunk);
    if num_chunks < ranks {
        return Err(ShardError::TooFewChunks {
            len,
            chunk,
            chunks: num_chunks,
            ranks,
            max_chunk: (len / ranks).max(1),
        });
    }
    let rows = rows
        .expanded()
        .map_err(|e| ShardError::Expand(e.to_string()))?
        .into_owned();
    let span = |c: u32| c * chunk..chunk_end(c, chunk, len);
    let chunk_work: Vec<u64> = (0..num_chunks)
        .map(|c| {
            span(c)
                .map(|q| rows.row(q).iter().map(|iv| iv.len()).sum::<u64>())
                .sum()
        })
        .collect();
    let chunks = deal(&chunk_work, ranks);
    let work: Vec<u64> = chunks
        .iter()
        .map(|cs| cs.iter().map(|&c| chunk_work[c as usize]).sum())
        .collect();

    let mut order = Vec::with_capacity(len as usize);
    let mut offsets = vec![0u32];
    let mut owner = vec![0u32; num_chunks as usize];
    let mut slot = vec![0u32; num_chunks as usize];
    for (r, cs) in chunks.iter().enumerate() {
        for (i, &c) in cs.iter().enumerate() {
            order.extend(span(c));
            owner[c as usize] = r as u32;
            slot[c as usize] = i as u32;
        }
        offsets.push(order.len() as u32);
    }
    let layout = Layout {
        chunks: &chunks,
        chunk,
        len,
        owner: &owner,
        slot: &slot,
    };
    let plan =
        key_plan(&rows, &order, &offsets, &layout).map_err(|ranges| ShardError::TooLarge {
            ranks,
            len,
            chunk,
            ranges,
        })?;
    let order =
        TokenOrder::from_permutation(order, len).expect("every chunk is dealt to exactly one rank");
    Ok(Sharding {
        ranks,
        chunk,
        len,
        order,
        offsets,
        chunks,
        work,
        range_ptr: plan.range_ptr,
        range_source: plan.range_source,
        keys: plan.keys,
        owner,
        slot,
        rows,
        part_score: None,
    })
}

/// One past chunk `c`'s last token; in 64 bits, as `(c + 1) * chunk` may pass `u32::MAX`.
fn chunk_end(c: u32, chunk: u32, len: u32) -> u32 {
    (u64::from(c + 1) * u64::from(chunk)).min(u64::from(len)) as u32
}

/// Chunks per rank: a longest-first greedy deal in which rank `r` takes `num / ranks` chunks
/// (one more for the first `num % ranks` ranks), then swaps of one chunk between the heaviest
/// and the lightest rank while a swap lowers the heavier of the two. Each rank's list
/// ascending. O(num x log ranks), plus per swap O(chunks of the two ranks x log).
fn deal(chunk_work: &[u64], ranks: u32) -> Vec<Vec<u32>> {
    let (num, ranks) = (chunk_work.len(), ranks as usize);
    let capacity = |r: usize| num / ranks + usize::from(r < num % ranks);
    let mut by_work: Vec<u32> = (0..num as u32).collect();
    by_work.sort_by_key(|&c| (Reverse(chunk_work[c as usize]), c));
    let mut dealt: Vec<Vec<u32>> = (0..ranks)
        .map(|r| Vec::with_capacity(capacity(r)))
        .collect();
    let mut load = vec![0u64; ranks];
    // The lightest rank with room, the lowest index among equals, from a heap: a scan of
    // every rank per chunk is O(ranks x chunks).
    let mut open: BinaryHeap<Reverse<(u64, usize)>> = (0..ranks)
        .filter(|&r| capacity(r) > 0)
        .map(|r| Reverse((0, r)))
        .collect();
    for c in by_work {
        let Reverse((_, r)) = open
            .pop()
            .expect("the capacities sum to the number of chunks");
        dealt[r].push(c);
        load[r] += chunk_work[c as usize];
        if dealt[r].len() < capacity(r) {
            open.push(Reverse((load[r], r)));
        }
    }
    // Ranks by (load, index): the heaviest is the last (the highest index among equals), the
    // lightest the first, each in O(log ranks).
    let mut by_load: BTreeSet<(u64, usize)> = (0..ranks).map(|r| (load[r], r)).collect();
    let mut values = Vec::new();
    // Each swap strictly lowers the larger of the two loads it touches without raising the
    // other above it, so the loop ends; the bound keeps it linear in the worst case.
    for _ in 0..num {
        let (Some(&(_, light)), Some(&(_, heavy))) = (by_load.first(), by_load.last()) else {
            break;
        };
        let gap = load[heavy] - load[light];
        let Some((i, j)) = best_swap(&dealt[heavy], &dealt[light], chunk_work, gap, &mut values)
        else {
            break;
        };
        let (a, b) = (dealt[heavy][i], dealt[light][j]);
        let d = chunk_work[a as usize] - chunk_work[b as usize];
        by_load.remove(&(load[heavy], heavy));
        by_load.remove(&(load[light], light));
        dealt[heavy][i] = b;
        dealt[light][j] = a;
        load[heavy] -= d;
        load[light] += d;
        by_load.insert((load[heavy], heavy));
        by_load.insert((load[light], light));
    }
    for cs in &mut dealt {
        cs.sort_unstable();
    }
    dealt
}

/// The swap of chunk `heavy[i]` for `light[j]` (`wa > wb`, `wa - wb < gap`) that leaves the
/// two loads closest, `|gap - 2 (wa - wb)|`, the first `(i, j)` in row-major order among
/// equals: what a scan of every pair picks, in O((|heavy| + |light|) x log |light|). Per
/// `i` that gap is `|2 wb - (2 wa - gap)|`, V-shaped in `wb` with its bottom inside the
/// allowed `wb`, so only the nearest `wb` on each side of the bottom can win, each at its
/// lowest `j`. `values` is scratch.
fn best_swap(
    heavy: &[u32],
    light: &[u32],
    chunk_work: &[u64],
    gap: u64,
    values: &mut Vec<(u64, usize)>,
) -> Option<(usize, usize)> {
    if gap == 0 {
        return None;
    }
    values.clear();
    values.extend(
        light
            .iter()
            .enumerate()
            .map(|(j, &b)| (chunk_work[b as usize], j)),
    );
    values.sort_unstable();
    values.dedup_by_key(|v| v.0);
    let gap = i128::from(gap);
    let mut best: Option<(i128, usize, usize)> = None;
    for (i, &a) in heavy.iter().enumerate() {
        let wa = i128::from(chunk_work[a as usize]);
        let bottom = 2 * wa - gap;
        let k = values.partition_point(|&(wb, _)| 2 * i128::from(wb) < bottom);
        let mut here: Option<(i128, usize)> = None;
        for &(wb, j) in values[k.saturating_sub(1)..values.len().min(k + 1)].iter() {
            let wb = i128::from(wb);
            if wb < wa && wa - wb < gap {
                let after = (2 * wb - bottom).abs();
                if here.is_none_or(|h| (after, j) < h) {
                    here = Some((after, j));
                }
            }
        }
        if let Some((after, j)) = here {
            if best.is_none_or(|(g, _, _)| after < g) {
                best = Some((after, i, j));
            }
        }
    }
    best.map(|(_, i, j)| (i, j))
}

/// Where the chunks went: original key `x` is on rank `owner[x / chunk]` at local position
/// `slot[x / chunk] * chunk + x % chunk` (every chunk but the sequence's last is full, and
/// the last is the last of its rank's list).
struct Layout<'a> {
    chunks: &'a [Vec<u32>],
    chunk: u32,
    len: u32,
    owner: &'a [u32],
    slot: &'a [u32],
}

impl Layout<'_> {
    /// Rank `s`'s keys among original keys `[a, b)` as local positions: one range, since its
    /// chunks ascend and so local positions are monotone in the key. O(log chunks).
    fn on(&self, s: usize, a: u32, b: u32) -> Option<(u32, u32)> {
        let own = &self.chunks[s];
        let chunk = u64::from(self.chunk);
        let first = own.partition_point(|&c| (u64::from(c) + 1) * chunk <= u64::from(a));
        let last = own.partition_point(|&c| u64::from(c) * chunk < u64::from(b));
        if first >= last {
            return None;
        }
        // The ends' chunks are `own[first]` and `own[last - 1]`, so no division places them.
        let (c0, c1) = (own[first], own[last - 1]);
        let lo = a.max(c0 * self.chunk);
        let hi = b.min(chunk_end(c1, self.chunk, self.len));
        let x = first as u32 * self.chunk + (lo - c0 * self.chunk);
        let y = (last as u32 - 1) * self.chunk + (hi - c1 * self.chunk);
        Some((x, y))
    }

    /// Bound of [`Layout::split`]'s ranges: an interval meets each rank in at most one
    /// range and a rank only through a chunk it spans.
    fn pieces(&self, union: &[(u32, u32)]) -> u64 {
        let ranks = self.chunks.len() as u64;
        union
            .iter()
            .map(|&(a, b)| (u64::from((b - 1) / self.chunk - a / self.chunk) + 1).min(ranks))
            .sum()
    }

    /// The keys of `union` (disjoint ascending original intervals) on every rank, appended to
    /// `out` as `(rank, local start, local end)`: ranks ascending, each rank's ranges
    /// ascending, disjoint and maximal.
    fn split(&self, union: &[(u32, u32)], out: &mut Vec<(u32, u32, u32)>) {
        // Rank by rank comes out grouped and sorted but costs a search per rank and
        // interval; chunk by chunk costs the pieces and their sort. The cheaper one.
        if self.chunks.len() as u64 * union.len() as u64 <= 4 * self.pieces(union) {
            self.split_by_rank(union, out);
        } else {
            self.split_by_chunk(union, out);
        }
    }

    fn split_by_rank(&self, union: &[(u32, u32)], out: &mut Vec<(u32, u32, u32)>) {
        let start = out.len();
        for s in 0..self.chunks.len() {
            for &(a, b) in union {
                if let Some((x, y)) = self.on(s, a, b) {
                    push_joined(out, start, (s as u32, x, y));
                }
            }
        }
    }

    fn split_by_chunk(&self, union: &[(u32, u32)], out: &mut Vec<(u32, u32, u32)>) {
        let ranks = self.chunks.len();
        let start = out.len();
        for &(a, b) in union {
            let (c0, c1) = (a / self.chunk, (b - 1) / self.chunk);
            if (c1 - c0) as usize >= ranks {
                for s in 0..ranks {
                    if let Some((x, y)) = self.on(s, a, b) {
                        out.push((s as u32, x, y));
                    }
                }
                continue;
            }
            for c in c0..=c1 {
                let lo = a.max(c * self.chunk);
                let hi = b.min(chunk_end(c, self.chunk, self.len));
                let base = self.slot[c as usize] * self.chunk;
                let (x, y) = (base + (lo - c * self.chunk), base + (hi - c * self.chunk));
                out.push((self.owner[c as usize], x, y));
            }
        }
        out[start..].sort_unstable();
        let mut kept = start;
        for i in start..out.len() {
            let piece = out[i];
            if kept > start && out[kept - 1].0 == piece.0 && out[kept - 1].2 == piece.1 {
                out[kept - 1].2 = piece.2;
            } else {
                out[kept] = piece;
                kept += 1;
            }
        }
        out.truncate(kept);
    }
}

/// Appends `piece` to `out`, joining it to the last range after `start` when it is the same
/// rank's and they touch (the keys between them are other ranks').
fn push_joined(out: &mut Vec<(u32, u32, u32)>, start: usize, piece: (u32, u32, u32)) {
    match out[start..].last_mut() {
        Some(prev) if prev.0 == piece.0 && prev.2 == piece.1 => prev.2 = piece.2,
        _ => out.push(piece),
    }
}

/// The keys rows `tokens` see, as disjoint ascending maximal intervals, into `out`.
fn union_of(rows: &RowIntervals, tokens: &[u32], out: &mut Vec<(u32, u32)>) {
    out.clear();
    for &q in tokens {
        out.extend(rows.row(q).iter().map(|iv| (iv.start, iv.end)));
    }
    out.sort_unstable();
    let mut kept = 0;
    for i in 0..out.len() {
        let (a, b) = out[i];
        if kept > 0 && a <= out[kept - 1].1 {
            out[kept - 1].1 = out[kept - 1].1.max(b);
        } else {
            out[kept] = (a, b);
            kept += 1;
        }
    }
    out.truncate(kept);
}

/// The communication plan in CSR form ([`Sharding`]'s fields of the same names).
struct KeyPlan {
    range_ptr: Vec<u32>,
    range_source: Vec<u32>,
    keys: Vec<(u32, u32)>,
}

/// Every rank's key ranges on every source. A rank's union of visible keys meets each
/// source in exactly the keys some row of it reads there (the map to local positions is a
/// bijection on each source), so one split of that union per rank gives its parts' ranges,
/// with no per-row or per-(rank, source) work. `Err` holds the bound E of the ranges
/// ([`Layout::pieces`] summed over the ranks) when it passes [`MAX_KEY_RANGES`], found before
/// any range is built.
fn key_plan(
    rows: &RowIntervals,
    order: &[u32],
    offsets: &[u32],
    layout: &Layout,
) -> Result<KeyPlan, u64> {
    let ranks = layout.chunks.len();
    let mut union_ptr = Vec::with_capacity(ranks + 1);
    union_ptr.push(0usize);
    let mut unions: Vec<(u32, u32)> = Vec::new();
    let mut union = Vec::new();
    let mut bound = 0u64;
    for r in 0..ranks {
        union_of(
            rows,
            &order[offsets[r] as usize..offsets[r + 1] as usize],
            &mut union,
        );
        bound += layout.pieces(&union);
        unions.extend_from_slice(&union);
        union_ptr.push(unions.len());
    }
    if bound > MAX_KEY_RANGES {
        return Err(bound);
    }
    // Pages past the ranges actually built are reserved, never touched; growing by
    // doubling would copy.
    let mut plan = KeyPlan {
        range_ptr: Vec::with_capacity(ranks + 1),
        range_source: Vec::with_capacity(bound as usize),
        keys: Vec::with_capacity(bound as usize),
    };
    plan.range_ptr.push(0);
    let mut pieces = Vec::new();
    for r in 0..ranks {
        pieces.clear();
        layout.split(&unions[union_ptr[r]..union_ptr[r + 1]], &mut pieces);
        plan.range_source.extend(pieces.iter().map(|&(s, _, _)| s));
        plan.keys.extend(pieces.iter().map(|&(_, a, b)| (a, b)));
        plan.range_ptr.push(plan.keys.len() as u32);
    }
    Ok(plan)
}

/// A part from its rows in the source's local positions (CSR: `row_ptr` `[rows + 1]` and
/// the intervals): the union of the ranges they see, and the rows on those keys compacted.
fn compact(row_ptr: &[u32], ivs: &[(u32, u32)]) -> Part {
    let mut keys = ivs.to_vec();
    keys.sort_unstable();
    let mut merged: Vec<(u32, u32)> = Vec::with_capacity(keys.len());
    for (a, b) in keys {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    // Compacted position of each range's first key.
    let mut base = Vec::with_capacity(merged.len());
    let mut fetched = 0u32;
    for &(a, b) in &merged {
        base.push(fetched);
        fetched += b - a;
    }
    let at = |x: u32| {
        let i = merged.partition_point(|&(a, _)| a <= x) - 1;
        base[i] + (x - merged[i].0)
    };
    let mut out_ptr = Vec::with_capacity(row_ptr.len());
    let mut out: Vec<KeyInterval> = Vec::with_capacity(ivs.len());
    out_ptr.push(0u32);
    for w in row_ptr.windows(2) {
        let row_start = out.len();
        // A visible interval lies inside one merged range, so both ends map through it;
        // intervals whose gap no row fetched become adjacent and are joined.
        for &(a, b) in &ivs[w[0] as usize..w[1] as usize] {
            let (a, b) = (at(a), at(b - 1) + 1);
            match out[row_start..].last_mut() {
                Some(prev) if prev.end == a => prev.end = b,
                _ => out.push(KeyInterval { start: a, end: b }),
            }
        }
        out_ptr.push(out.len() as u32);
    }
    let rows = RowIntervals::from_csr(fetched, out_ptr, out)
        .expect("compacted intervals are sorted, disjoint and inside the fetched keys");
    Part { keys: merged, rows }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The deal as first written: a scan of every rank per chunk and of every pair of chunks
    /// per swap.
    fn deal_by_scans(chunk_work: &[u64], ranks: u32) -> Vec<Vec<u32>> {
        let (num, ranks) = (chunk_work.len(), ranks as usize);
        let capacity = |r: usize| num / ranks + usize::from(r < num % ranks);
        let mut by_work: Vec<u32> = (0..num as u32).collect();
        by_work.sort_by_key(|&c| (Reverse(chunk_work[c as usize]), c));
        let mut dealt: Vec<Vec<u32>> = vec![Vec::new(); ranks];
        let mut load = vec![0u64; ranks];
        for c in by_work {
            let r = (0..ranks)
                .filter(|&r| dealt[r].len() < capacity(r))
                .min_by_key(|&r| (load[r], r))
                .unwrap();
            dealt[r].push(c);
            load[r] += chunk_work[c as usize];
        }
        for _ in 0..num {
            let heavy = (0..ranks).max_by_key(|&r| (load[r], r)).unwrap_or(0);
            let light = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            let gap = load[heavy] - load[light];
            let mut best: Option<(u64, usize, usize)> = None;
            for (i, &a) in dealt[heavy].iter().enumerate() {
                for (j, &b) in dealt[light].iter().enumerate() {
                    let (wa, wb) = (chunk_work[a as usize], chunk_work[b as usize]);
                    if wa > wb && wa - wb < gap {
                        let after = (gap as i128 - 2 * (wa - wb) as i128).unsigned_abs() as u64;
                        if best.is_none_or(|(g, _, _)| after < g) {
                            best = Some((after, i, j));
                        }
                    }
                }
            }
            let Some((_, i, j)) = best else { break };
            let (a, b) = (dealt[heavy][i], dealt[light][j]);
            let d = chunk_work[a as usize] - chunk_work[b as usize];
            dealt[heavy][i] = b;
            dealt[light][j] = a;
            load[heavy] -= d;
            load[light] += d;
        }
        for cs in &mut dealt {
            cs.sort_unstable();
        }
        dealt
    }

    proptest! {
        #![proptest_config(cm_testkit::config::env_config(
            cm_testkit::config::PROPTEST_CASES, 2000, 0x5a4f))]

        /// Few distinct works (many ties, many equal swap gaps) or wide ones.
        #[test]
        fn deal_picks_what_the_scans_pick(
            works in prop::collection::vec(0u64..6, 1..60),
            scale in prop::sample::select(vec![1u64, 7, 1 << 40]),
            spread in any::<bool>(),
            ranks in 1u32..12,
        ) {
            let w: Vec<u64> = works
                .iter()
                .enumerate()
                .map(|(i, &x)| if spread { x * scale + (i as u64 * 2654435761) % 1000 } else { x * scale })
                .collect();
            let ranks = ranks.min(w.len() as u32);
            prop_assert_eq!(deal(&w, ranks), deal_by_scans(&w, ranks));
        }

        /// Both ways of splitting a union give what the search per rank and interval, joined,
        /// gives.
        #[test]
        fn the_two_splits_agree(
            len in 1u32..200,
            chunk in 1u32..9,
            ranks in 1u32..20,
            cuts in prop::collection::vec(0u32..200, 0..12),
            seed in any::<u64>(),
        ) {
            let num = len.div_ceil(chunk);
            let ranks = ranks.min(num);
            let w: Vec<u64> = (0..num as u64).map(|c| (c ^ seed) % 17).collect();
            let chunks = deal(&w, ranks);
            let (mut owner, mut slot) = (vec![0; num as usize], vec![0; num as usize]);
            for (r, cs) in chunks.iter().enumerate() {
                for (i, &c) in cs.iter().enumerate() {
                    owner[c as usize] = r as u32;
                    slot[c as usize] = i as u32;
                }
            }
            let layout = Layout { chunks: &chunks, chunk, len, owner: &owner, slot: &slot };
            let mut cuts: Vec<u32> = cuts.into_iter().map(|x| x % (len + 1)).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let union: Vec<(u32, u32)> = cuts.chunks_exact(2).map(|w| (w[0], w[1])).collect();
            let mut want: Vec<(u32, u32, u32)> = Vec::new();
            for s in 0..ranks as usize {
                let mut keys: Vec<u32> = union
                    .iter()
                    .flat_map(|&(a, b)| a..b)
                    .filter(|&x| owner[(x / chunk) as usize] == s as u32)
                    .map(|x| slot[(x / chunk) as usize] * chunk + x % chunk)
                    .collect();
                keys.sort_unstable();
                for x in keys {
                    match want.last_mut() {
                        Some(l) if l.0 == s as u32 && l.2 == x => l.2 += 1,
                        _ => want.push((s as u32, x, x + 1)),
                    }
                }
            }
            let (mut by_rank, mut by_chunk) = (vec![(9, 9, 9)], vec![(9, 9, 9)]);
            layout.split_by_rank(&union, &mut by_rank);
            layout.split_by_chunk(&union, &mut by_chunk);
            prop_assert_eq!(&by_rank[1..], &want[..]);
            prop_assert_eq!(&by_chunk[1..], &want[..]);
            prop_assert!(want.len() as u64 <= layout.pieces(&union));
        }
    }
}
