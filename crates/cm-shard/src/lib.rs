//! Context parallelism: one long sequence (self-attention: its tokens are both the query rows
//! and the keys, `q_len == kv_len`) split across `ranks` devices by the work its mask gives each
//! token, and what every rank must fetch from every other.
//!
//! A plain split by positions gives the ranks very different work: under a causal mask the
//! last of two shards computes three times the pairs of the first. Here the sequence is cut
//! into chunks of `chunk` tokens, and the chunks are dealt to the ranks so that each holds
//! about the same number of visible pairs (query rows times their visible keys) with the same
//! number of chunks (so the same number of tokens, give or take one short last chunk): a
//! longest-first greedy deal with capacities, then swaps between the heaviest and the
//! lightest rank while they shrink the gap (MagiAttention's dispatch by mask area and
//! FlashMask's context-parallel balancing both balance the same quantity). Rank `r` holds its
//! chunks in ascending order; the [`TokenOrder`] that concatenates rank 0's tokens, rank 1's,
//! ... is the permutation of the sequence (queries and keys alike).
//!
//! Each rank's rows then read keys of every rank. For each pair (rank `r`, source `s`) a
//! [`Part`] holds the ranges of `s`'s local keys that some row of `r` sees (the only keys `r`
//! fetches from `s`; ring attention would fetch all of them) and `r`'s rows against those keys
//! compacted into one index range, as row intervals. Attention over the parts of one rank,
//! merged by lse, is attention over its rows; the gradients of fetched keys go back to their
//! source along the same ranges and are summed there.
//!
//! Positions are 0-based; every interval and range is half-open `[start, end)`.

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
    #[error(
        "ranks = {ranks} x {len} tokens: the (rank, source) parts would hold {entries} row \
         pointers (each part plans all of its rank's rows), more than {MAX_PART_ROWS}; use \
         fewer ranks or a shorter sequence"
    )]
    TooLarge { ranks: u32, len: u32, entries: u64 },
    #[error(
        "the plan has batch = {batch} and {masks} distinct masks: context parallelism shards \
         one sequence (batch 1, e.g. a packed plan) whose heads share one mask"
    )]
    NotOneMask { batch: u32, masks: usize },
    #[error(
        "the plan has score terms, which are bound to positions: context parallelism shards \
         masks without them"
    )]
    Score,
}

/// What rank `r` reads from source rank `s` (`s == r`: its own keys, nothing to fetch).
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

/// A sequence dealt to ranks by work ([`shard`]).
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
    /// `parts[r][s]`: what rank `r` reads from rank `s`.
    pub parts: Vec<Vec<Part>>,
}

impl Sharding {
    /// Tokens held by rank `r`.
    pub fn shard_len(&self, r: usize) -> u32 {
        self.offsets[r + 1] - self.offsets[r]
    }

    /// Keys rank `r` fetches from the other ranks.
    pub fn fetched(&self, r: usize) -> u64 {
        self.parts[r]
            .iter()
            .enumerate()
            .filter(|&(s, _)| s != r)
            .map(|(_, p)| u64::from(p.fetched()))
            .sum()
    }

    /// Keys ring attention moves to rank `r`: every other rank's shard.
    pub fn ring_fetched(&self, r: usize) -> u64 {
        u64::from(self.len - self.shard_len(r))
    }

    /// Part `parts[r][s]` as a plan of its own at `tile` (batch 1, one mask for every head):
    /// `q_len` = rank `r`'s tokens, `kv_len` = the keys it fetches from `s`.
    pub fn part_plan(&self, r: usize, s: usize, tile: TileShape) -> Plan {
        let rows = self.parts[r][s].rows.clone();
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
            elementwise_pairs: 0,
            pieces: 0,
            order: None,
            order_candidates: Vec::new(),
            packing: None,
            score: None,
            tree_overhangs: Vec::new(),
        }
    }

    /// Pairs each rank's kernels compute at `tile` (in-range pairs of the non-empty tiles of
    /// its parts).
    pub fn computed_pairs(&self, tile: TileShape) -> Vec<u64> {
        self.parts
            .iter()
            .map(|parts| {
                parts
                    .iter()
                    .map(|p| cm_plan::order::computed_pairs(&p.rows, tile))
                    .sum()
            })
            .collect()
    }
}

/// Tokens per chunk when the caller names none: 512, or `q_len / ranks` (at least 1) when
/// 512 would leave fewer chunks than ranks, so that any `q_len >= ranks` can be dealt.
pub fn default_chunk(q_len: u32, ranks: u32) -> u32 {
    const CHUNK: u32 = 512;
    if u64::from(q_len) >= u64::from(CHUNK) * u64::from(ranks) {
        CHUNK
    } else {
        (q_len / ranks.max(1)).max(1)
    }
}

/// [`shard`] of a plan's one mask; see [`Sharding::part_plan`] for the parts as plans.
///
/// # Errors
/// [`ShardError::NotOneMask`] for a batch above 1 or masks that differ per head,
/// [`ShardError::Score`] for a plan with score terms, and [`shard`]'s errors.
pub fn shard_plan(plan: &Plan, ranks: u32, chunk: u32) -> Result<Sharding, ShardError> {
    if plan.batch != 1 || plan.masks.len() != 1 {
        return Err(ShardError::NotOneMask {
            batch: plan.batch,
            masks: plan.masks.len(),
        });
    }
    if plan.score.is_some() {
        return Err(ShardError::Score);
    }
    shard(&plan.masks[0].rows, ranks, chunk)
}

/// Most row pointers the parts of one sharding hold together (`ranks x len`: every
/// (rank, source) part plans all of its rank's rows): 2^28, 1 GiB of u32.
pub const MAX_PART_ROWS: u64 = 1 << 28;

/// Deals `rows` (one square mask, `q_len == kv_len`) to `ranks` ranks in chunks of `chunk`
/// tokens, balancing visible pairs; see the module docs. Cost: O(intervals x ranks x log
/// chunks) plus the deal's O(chunks^2) at worst.
///
/// # Errors
/// [`ShardError`] for zero ranks or chunk, a mask that is not square, fewer chunks than ranks,
/// more than [`MAX_PART_ROWS`] row pointers in the parts, or strided runs too many to expand.
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
    let entries = u64::from(ranks) * u64::from(len);
    if entries > MAX_PART_ROWS {
        return Err(ShardError::TooLarge {
            ranks,
            len,
            entries,
        });
    }
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
        .map_err(|e| ShardError::Expand(e.to_string()))?;
    let chunk_work: Vec<u64> = (0..num_chunks)
        .map(|c| {
            (c * chunk..((c + 1) * chunk).min(len))
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
    for cs in &chunks {
        for &c in cs {
            order.extend(c * chunk..((c + 1) * chunk).min(len));
        }
        offsets.push(order.len() as u32);
    }
    let order =
        TokenOrder::from_permutation(order, len).expect("every chunk is dealt to exactly one rank");
    let parts = parts(&rows, &chunks, chunk, len);
    Ok(Sharding {
        ranks,
        chunk,
        len,
        order,
        offsets,
        chunks,
        work,
        parts,
    })
}

/// Chunks per rank: a longest-first greedy deal in which rank `r` takes `num / ranks` chunks
/// (one more for the first `num % ranks` ranks), then swaps of one chunk between the heaviest
/// and the lightest rank while a swap lowers the heavier of the two. Each rank's list
/// ascending.
fn deal(chunk_work: &[u64], ranks: u32) -> Vec<Vec<u32>> {
    let (num, ranks) = (chunk_work.len(), ranks as usize);
    let capacity = |r: usize| num / ranks + usize::from(r < num % ranks);
    let mut by_work: Vec<u32> = (0..num as u32).collect();
    by_work.sort_by_key(|&c| (std::cmp::Reverse(chunk_work[c as usize]), c));
    let mut dealt: Vec<Vec<u32>> = vec![Vec::new(); ranks];
    let mut load = vec![0u64; ranks];
    for c in by_work {
        let r = (0..ranks)
            .filter(|&r| dealt[r].len() < capacity(r))
            .min_by_key(|&r| (load[r], r))
            .expect("the capacities sum to the number of chunks");
        dealt[r].push(c);
        load[r] += chunk_work[c as usize];
    }
    // Each swap strictly lowers the larger of the two loads it touches without raising the
    // other above it, so the loop ends; the bound keeps it linear in the worst case.
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

/// Rows as CSR: `row_ptr` (`[rows + 1]`) and the intervals `(start, end)`.
type Csr = (Vec<u32>, Vec<(u32, u32)>);

/// Every (rank, source) part. A rank's chunks are ascending, so the local position of an
/// original key inside its owner is monotone in the key, and a row interval meets each
/// source's keys in one local range (from its first key there to its last): O(intervals x
/// ranks x log chunks) in all, with no permuted copy of the mask (whose rows would break
/// into a run per chunk).
fn parts(rows: &RowIntervals, chunks: &[Vec<u32>], chunk: u32, len: u32) -> Vec<Vec<Part>> {
    let ranks = chunks.len();
    // Rank `s`'s local position of original key `x` in one of its chunks: every chunk but
    // the sequence's last is full, and the last is the last of its rank's list.
    let mut slot = vec![0u32; len.div_ceil(chunk) as usize];
    for cs in chunks {
        for (i, &c) in cs.iter().enumerate() {
            slot[c as usize] = i as u32;
        }
    }
    let local = |x: u32| slot[(x / chunk) as usize] * chunk + x % chunk;
    // Rows of each (rank, source) in the source's local positions.
    let mut csr: Vec<Vec<Csr>> = vec![vec![(vec![0u32], Vec::new()); ranks]; ranks];
    for (r, cs) in chunks.iter().enumerate() {
        for q in cs
            .iter()
            .flat_map(|&c| c * chunk..((c + 1) * chunk).min(len))
        {
            for (s, (row_ptr, ivs)) in csr[r].iter_mut().enumerate() {
                let own = &chunks[s];
                let row_start = ivs.len();
                for iv in rows.row(q) {
                    let first = own.partition_point(|&c| (c + 1) * chunk <= iv.start);
                    let last = own.partition_point(|&c| c * chunk < iv.end);
                    if first >= last {
                        continue;
                    }
                    let lo = iv.start.max(own[first] * chunk);
                    let hi = iv.end.min((own[last - 1] + 1) * chunk).min(len);
                    let (a, b) = (local(lo), local(hi - 1) + 1);
                    // Keys of other ranks between two intervals vanish here: join them.
                    match ivs[row_start..].last_mut() {
                        Some(prev) if prev.1 == a => prev.1 = b,
                        _ => ivs.push((a, b)),
                    }
                }
                row_ptr.push(ivs.len() as u32);
            }
        }
    }
    csr.into_iter()
        .map(|row| row.into_iter().map(|(p, ivs)| compact(&p, &ivs)).collect())
        .collect()
}

/// A part from its rows in the source's local positions (CSR): the union of the ranges
/// they see, and the rows on those keys compacted.
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
