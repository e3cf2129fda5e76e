//! Packed (varlen) planning: samples of different lengths laid back to back, described by
//! FlashAttention's `cu_seqlens_q` / `cu_seqlens_k` prefix sums, each sample with its own
//! positions starting at 0 and the mask applied per sample.
//!
//! A packed plan is an ordinary batch-1 [`Plan`] over `total_q = cu_seqlens_q[batch]` rows
//! and `total_k = cu_seqlens_k[batch]` keys, so kernels, exports and the reference need no
//! change: packed row `r` of sample `b` (local row `i = r - cu_seqlens_q[b]`) holds the
//! intervals of the program bound at `q_len = len_q(b)`, `kv_len = len_k(b)`, `batch =`
//! the number of samples, for local row `i` with batch index `b`, shifted by
//! `cu_seqlens_k[b]`. The tile descriptor is built over the packed rows as usual; tiles that
//! straddle a sample boundary are simply partial (exact either way).
//!
//! Work is shared: a mask that does not read `b` is solved once per distinct
//! `(len_q, len_k)` pair (and head, for masks that read `h`). A sample with no queries adds
//! no rows; a sample with queries but no keys adds rows with no visible key. Neither is
//! bound, so the mask's `require`s are not checked for them.

use crate::plan::{
    row_intervals, too_many_tile_entries, DistinctMasks, MaskPlan, Plan, RowBudget, TreeOverhangs,
    MAX_INTERVALS, MAX_TILE_ENTRIES,
};
use crate::rows::{KeyInterval, RowIntervals};
use crate::symbolic::Solver;
use crate::tiles::{TileDescriptor, TileShape};
use cm_ir::bind::{MAX_BATCH, MAX_BATCH_HEADS, MAX_HEADS, MAX_LEN};
use cm_ir::{Bound, PResult, PlanError, Program, ScoreTerms, Shape, Value};
use cm_syntax::Code;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};

/// Most samples one packing may hold (the `batch` limit of ordinary plans).
pub const MAX_SAMPLES: usize = MAX_BATCH as usize;

/// Validated `cu_seqlens_q` / `cu_seqlens_k`: `batch + 1` non-decreasing offsets each,
/// starting at 0, totals at most `2^26`. Sample `b` owns query rows
/// `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` and keys `cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Packing {
    cu_seqlens_q: Vec<u32>,
    cu_seqlens_k: Vec<u32>,
}

/// Checks one prefix-sum array; `what` names it in errors.
fn offsets(what: &str, cu: &[i64]) -> PResult<Vec<u32>> {
    let bad = |message: String| {
        PlanError::new(Code::BadCuSeqlens, None, message).with_hint(
            "cu_seqlens are prefix sums of the sample lengths: [0, len_0, len_0 + len_1, ...], \
             batch + 1 entries",
        )
    };
    match cu.first() {
        None => {
            return Err(bad(format!(
                "{what} is empty; it needs batch + 1 >= 2 entries"
            )))
        }
        Some(&first) if first != 0 => {
            return Err(bad(format!(
                "{what} must start at 0, got {what}[0] = {first}"
            )))
        }
        Some(_) => {}
    }
    if cu.len() < 2 {
        return Err(bad(format!(
            "{what} has 1 entry; it needs batch + 1 >= 2 entries (one sample at least)"
        )));
    }
    for (i, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(bad(format!(
                "{what} decreases at index {}: {what}[{i}] = {} > {what}[{}] = {} (sample {i} would have a negative length)",
                i + 1,
                w[0],
                i + 1,
                w[1]
            )));
        }
        if w[1] > MAX_LEN {
            return Err(bad(format!(
                "{what}[{}] = {} exceeds the longest supported packed length 2^26 = {MAX_LEN}",
                i + 1,
                w[1]
            )));
        }
    }
    Ok(cu.iter().map(|&x| x as u32).collect())
}

impl Packing {
    /// Validates FlashAttention-style prefix sums.
    ///
    /// # Errors
    /// `CM0409` when either array is empty or has a single entry, does not start at 0,
    /// decreases, or ends above `2^26`; when the two differ in length; when there are more
    /// than `2^20` samples; or when the packing holds no query or no key at all.
    pub fn new(cu_seqlens_q: &[i64], cu_seqlens_k: &[i64]) -> PResult<Packing> {
        let q = offsets("cu_seqlens_q", cu_seqlens_q)?;
        let k = offsets("cu_seqlens_k", cu_seqlens_k)?;
        if q.len() != k.len() {
            return Err(PlanError::new(
                Code::BadCuSeqlens,
                None,
                format!(
                    "cu_seqlens_q has {} entries but cu_seqlens_k has {}; both need batch + 1",
                    q.len(),
                    k.len()
                ),
            )
            .with_hint("give one query length and one key length per sample"));
        }
        if q.len() - 1 > MAX_SAMPLES {
            return Err(PlanError::new(
                Code::BadCuSeqlens,
                None,
                format!(
                    "the packing has {} samples; at most 2^20 = {MAX_SAMPLES} are supported",
                    q.len() - 1
                ),
            ));
        }
        let (tq, tk) = (q[q.len() - 1], k[k.len() - 1]);
        if tq == 0 || tk == 0 {
            return Err(PlanError::new(
                Code::BadCuSeqlens,
                None,
                format!(
                    "the packing holds {tq} queries and {tk} keys in total; a plan needs at least one of each"
                ),
            ));
        }
        Ok(Packing {
            cu_seqlens_q: q,
            cu_seqlens_k: k,
        })
    }

    /// Number of samples (`cu_seqlens_q.len() - 1`).
    pub fn batch(&self) -> u32 {
        (self.cu_seqlens_q.len() - 1) as u32
    }

    /// `[batch + 1]` query offsets.
    pub fn cu_seqlens_q(&self) -> &[u32] {
        &self.cu_seqlens_q
    }

    /// `[batch + 1]` key offsets.
    pub fn cu_seqlens_k(&self) -> &[u32] {
        &self.cu_seqlens_k
    }

    /// All query rows: `cu_seqlens_q[batch]`.
    pub fn total_q(&self) -> u32 {
        self.cu_seqlens_q[self.cu_seqlens_q.len() - 1]
    }

    /// All keys: `cu_seqlens_k[batch]`.
    pub fn total_k(&self) -> u32 {
        self.cu_seqlens_k[self.cu_seqlens_k.len() - 1]
    }

    /// `(q_len, kv_len)` of sample `b`.
    ///
    /// # Panics
    /// If `b >= batch`.
    pub fn lengths(&self, b: u32) -> (u32, u32) {
        let b = b as usize;
        (
            self.cu_seqlens_q[b + 1] - self.cu_seqlens_q[b],
            self.cu_seqlens_k[b + 1] - self.cu_seqlens_k[b],
        )
    }

    /// The sample that owns packed query row `r` (the last of several that share the
    /// offset, so empty samples own nothing), or `None` for `r >= total_q`.
    pub fn sample_of_row(&self, r: u32) -> Option<u32> {
        if r >= self.total_q() {
            return None;
        }
        Some((self.cu_seqlens_q.partition_point(|&o| o <= r) - 1) as u32)
    }
}

/// Names the sample in a per-sample error.
fn in_sample(mut e: PlanError, b: u32, lq: u32, lk: u32) -> PlanError {
    e.message = format!(
        "{} (packed sample b = {b}: q_len = {lq}, kv_len = {lk})",
        e.message
    );
    e
}

/// Plans `program` for packed samples: one batch-1 plan over every sample's rows (see the
/// module docs), with `num_heads` heads (only read by masks that use `h`: one packed mask
/// per distinct head mask, `mask_index` `[1, num_heads]`).
///
/// # Errors
/// `CM0401` for a zero block size; `CM0402` for `num_heads` out of range; `CM0309` for an
/// unknown parameter; `CM0404` when the packed rows or tiles are too large; any error of
/// binding or planning one sample, its message naming the sample and its lengths.
pub fn plan_packed(
    program: &Program,
    packing: &Packing,
    num_heads: i64,
    values: &BTreeMap<String, Value>,
    tile: TileShape,
) -> PResult<Plan> {
    plan_packed_with(program, packing, num_heads, values, tile, &|_, e| e)
}

/// [`plan_packed`], with `annotate` applied to every error raised while a sample is bound
/// or planned, given that sample's parameter values (which may differ from sample to
/// sample, as defaults may read the lengths), before the sample is named. An error of the
/// parameters themselves is not annotated: they have no values then.
///
/// # Errors
/// As [`plan_packed`].
pub fn plan_packed_with(
    program: &Program,
    packing: &Packing,
    num_heads: i64,
    values: &BTreeMap<String, Value>,
    tile: TileShape,
    annotate: &dyn Fn(&[Value], PlanError) -> PlanError,
) -> PResult<Plan> {
    if tile.block_m == 0 || tile.block_n == 0 {
        return Err(PlanError::new(
            Code::ZeroTileSide,
            None,
            format!(
                "tile {}x{} has a zero side; block_m and block_n must be >= 1",
                tile.block_m, tile.block_n
            ),
        ));
    }
    if !(1..=MAX_HEADS).contains(&num_heads) {
        return Err(PlanError::new(
            Code::LengthOutOfRange,
            None,
            format!("num_heads = {num_heads} is out of range; expected 1 ..= {MAX_HEADS}"),
        ));
    }
    let batch = packing.batch();
    if i64::from(batch) * num_heads > MAX_BATCH_HEADS {
        return Err(PlanError::new(
            Code::LengthOutOfRange,
            None,
            format!(
                "samples x num_heads = {} is out of range; expected at most {MAX_BATCH_HEADS}",
                i64::from(batch) * num_heads
            ),
        ));
    }
    // Unknown parameter names fail here, even when no sample is bound (every sample empty).
    program.check_param_names(values)?;
    let hs = if program.uses_h { num_heads as u32 } else { 1 };
    let (total_q, total_k) = (packing.total_q(), packing.total_k());
    // Bound programs by (len_q, len_k), shared by every head.
    let mut bounds: HashMap<(u32, u32), Bound<'_>> = HashMap::new();
    let mut pieces = 0u64;
    let mut elementwise_pairs = 0u64;
    let mut masks: Vec<MaskPlan> = Vec::new();
    let mut seen = DistinctMasks::default();
    let mut local = Vec::with_capacity(hs as usize);
    let mut overhangs = TreeOverhangs::default();
    let mut budget = RowBudget::default();
    // One head's packed rows at a time, deduplicated as soon as they are complete.
    for h in 0..hs {
        let mut rows = RowIntervals::with_capacity(total_q, total_k, total_q as usize);
        // For masks that do not read `b`: this head's rows per (len_q, len_k), so samples
        // of equal lengths share them.
        let mut solved: HashMap<(u32, u32), RowIntervals> = HashMap::new();
        for b in 0..batch {
            let (lq, lk) = packing.lengths(b);
            if lq == 0 {
                continue;
            }
            if lk == 0 {
                for _ in 0..lq {
                    rows.finish_row();
                }
                continue;
            }
            if let Entry::Vacant(slot) = bounds.entry((lq, lk)) {
                let shape = Shape {
                    q_len: i64::from(lq),
                    kv_len: i64::from(lk),
                    batch: i64::from(batch),
                    num_heads,
                };
                let bound = program
                    .bind_with(shape, values, annotate)
                    .map_err(|e| in_sample(e, b, lq, lk))?;
                slot.insert(bound);
            }
            let bound = &bounds[&(lq, lk)];
            let fail = |e| in_sample(annotate(&bound.params, e), b, lq, lk);
            let at = bound.at_batch(i64::from(b)).map_err(fail)?;
            if h == 0 {
                // Every sample has lengths of its own, so every tree is looked at in each.
                overhangs.see(&at, b, false);
            }
            let solver = Solver::new(&at);
            let fresh;
            let sample = if program.uses_b {
                // Every sample differs: nothing to share, nothing to keep.
                fresh = row_intervals(&solver, i64::from(b), i64::from(h), &mut pieces)
                    .map_err(fail)?;
                &fresh
            } else {
                match solved.entry((lq, lk)) {
                    Entry::Occupied(e) => &*e.into_mut(),
                    Entry::Vacant(slot) => {
                        let r = row_intervals(&solver, i64::from(b), i64::from(h), &mut pieces)
                            .map_err(fail)?;
                        &*slot.insert(r)
                    }
                }
            };
            elementwise_pairs += solver.elementwise_pairs.get();
            if rows.interval_count() + sample.interval_count() > MAX_INTERVALS {
                return Err(PlanError::new(
                    Code::TooLargeToPlan,
                    None,
                    format!("the packed mask needs more than {MAX_INTERVALS} intervals"),
                ));
            }
            let shift = packing.cu_seqlens_k[b as usize];
            for i in 0..lq {
                let strides = sample.row_strides(i);
                for (j, iv) in sample.row_runs(i).iter().enumerate() {
                    let run = KeyInterval {
                        start: iv.start + shift,
                        end: iv.end + shift,
                    };
                    rows.push_row_run(run, strides.map_or(1, |s| s[j]));
                }
                rows.finish_row();
            }
        }
        let id = match seen.find(&rows, &masks) {
            Ok(id) => id,
            Err(hash) => {
                budget.take(&rows)?;
                let id = masks.len() as u32;
                let tiles = TileDescriptor::try_build(&rows, tile, MAX_TILE_ENTRIES)
                    .map_err(|_| too_many_tile_entries(tile))?;
                if hs > 1 {
                    seen.insert(hash, id);
                }
                masks.push(MaskPlan { rows, tiles });
                id
            }
        };
        local.push(id);
    }
    let mut mask_index = Vec::with_capacity(num_heads as usize);
    for h in 0..num_heads as usize {
        mask_index.push(local[if program.uses_h { h } else { 0 }]);
    }
    let raster_computed_pairs = masks[0].tiles.computed_pairs;
    let score = packed_score(program, packing, num_heads, values, &bounds)?;
    Ok(Plan {
        q_len: total_q,
        kv_len: total_k,
        batch: 1,
        num_heads: num_heads as u32,
        tile,
        masks,
        mask_index,
        uses_batch: program.uses_b || program.reads_batch,
        uses_head: program.uses_h || program.reads_num_heads,
        elementwise_pairs,
        pieces,
        order: None,
        order_candidates: Vec::new(),
        raster_computed_pairs,
        packing: Some(packing.clone()),
        score,
        tree_overhangs: overhangs.finish(),
    })
}

/// CM0411 for a packed plan's score, at the score statement.
fn positional(program: &Program, message: String) -> PlanError {
    PlanError::new(
        Code::PositionalScore,
        program.score.as_ref().map(|s| s.span),
        message,
    )
    .with_hint("a packed plan takes a bias of q - k (or a table of q - k) only for self-attention samples (cu_seqlens_q == cu_seqlens_k) whose terms agree; plan the samples one by one otherwise")
}

/// The score terms of a packed plan, in packed positions: every bound sample's own terms
/// (at its lengths), which must agree. Terms that read positions need self-attention
/// packing (`cu_seqlens_q == cu_seqlens_k`) and a function of `q - k` (`q_coef ==
/// -k_coef`): a sample's packed `q - k` is then its local one, so every pair gets its own
/// sample's bias. The packed table's bucket of a distance is the samples' (which must
/// agree where two have it); distances no sample has are never visible and get bucket 0.
fn packed_score(
    program: &Program,
    packing: &Packing,
    num_heads: i64,
    values: &BTreeMap<String, Value>,
    bounds: &HashMap<(u32, u32), Bound<'_>>,
) -> PResult<Option<ScoreTerms>> {
    if program.score.is_none() && program.sink.is_none() {
        return Ok(None);
    }
    let self_attention = packing.cu_seqlens_q == packing.cu_seqlens_k;
    let (total_q, total_k) = (packing.total_q() as usize, packing.total_k() as usize);
    let mut merged: Option<(ScoreTerms, u32)> = None;
    let mut filled: Vec<bool> = Vec::new();
    for b in 0..packing.batch() {
        let (lq, lk) = packing.lengths(b);
        let Some(terms) = bounds.get(&(lq, lk)).and_then(|x| x.score.as_ref()) else {
            continue;
        };
        check_positional(program, terms, self_attention, b)?;
        match &merged {
            None => {
                let mut m = terms.clone();
                if let Some(t) = &mut m.table {
                    t.bucket = vec![0; total_q + total_k - 1];
                    filled = vec![false; t.bucket.len()];
                }
                merged = Some((m, b));
            }
            Some((m, first)) => {
                let differ = |what: &str| {
                    positional(
                        program,
                        format!(
                            "sample {b} (q_len {lq}, kv_len {lk}) has another {what} than sample {first}: the score terms of packed samples must agree"
                        ),
                    )
                };
                if m.softcap != terms.softcap {
                    return Err(differ("softcap"));
                }
                if m.linear != terms.linear {
                    return Err(differ("linear bias"));
                }
                match (&m.table, &terms.table) {
                    (Some(a), Some(t))
                        if a.tensor == t.tensor
                            && a.num_buckets == t.num_buckets
                            && a.per_head == t.per_head => {}
                    (None, None) => {}
                    _ => return Err(differ("bias table")),
                }
            }
        }
        let (m, _) = merged.as_mut().expect("set above");
        merge_buckets(program, m, terms, &mut filled, (lq, lk), total_k, b)?;
    }
    if let Some((m, _)) = merged {
        return Ok(Some(m));
    }
    // No sample has both queries and keys (so the offsets differ): no pair is visible, but
    // the sinks still give every row its lse.
    let shape = Shape {
        q_len: total_q as i64,
        kv_len: total_k as i64,
        batch: i64::from(packing.batch()),
        num_heads,
    };
    let bound = program.bind(shape, values)?;
    let terms = bound.score.clone().expect("a score or sink statement");
    check_positional(program, &terms, self_attention, 0)?;
    Ok(Some(terms))
}

fn check_positional(
    program: &Program,
    terms: &ScoreTerms,
    self_attention: bool,
    b: u32,
) -> PResult<()> {
    if !terms.reads_positions() {
        return Ok(());
    }
    if !self_attention {
        return Err(positional(
            program,
            "the score reads positions (a bias of q and k, or a bias table), but the packed samples' query and key offsets differ (cu_seqlens_q != cu_seqlens_k)".into(),
        ));
    }
    if let Some(l) = terms.linear.as_ref().filter(|l| l.q_coef != -l.k_coef) {
        return Err(positional(
            program,
            format!(
                "the bias reads q and k as {} * q + {} * k, not as q - k: in packed samples it would read packed positions (sample {b})",
                l.q_coef, l.k_coef
            ),
        ));
    }
    Ok(())
}

/// Copies sample `b`'s buckets (lengths `lq`, `lk`) into the packed table `m`, checking
/// those another sample set.
fn merge_buckets(
    program: &Program,
    m: &mut ScoreTerms,
    terms: &ScoreTerms,
    filled: &mut [bool],
    (lq, lk): (u32, u32),
    total_k: usize,
    b: u32,
) -> PResult<()> {
    let (Some(packed), Some(own)) = (&mut m.table, &terms.table) else {
        return Ok(());
    };
    let (lq, lk) = (lq as usize, lk as usize);
    for (i, &v) in own.bucket.iter().enumerate() {
        // Local index i is distance d = i - (lk - 1); packed index d + total_k - 1.
        let at = i + total_k - lk;
        if filled[at] && packed.bucket[at] != v {
            let d = i as i64 - (lk as i64 - 1);
            return Err(positional(
                program,
                format!(
                    "the bucket of distance q - k = {d} is {v} in sample {b} (q_len {lq}, kv_len {lk}) but {} in an earlier sample: the score terms of packed samples must agree",
                    packed.bucket[at]
                ),
            ));
        }
        packed.bucket[at] = v;
        filled[at] = true;
    }
    Ok(())
}
