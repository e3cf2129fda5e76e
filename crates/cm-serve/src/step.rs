//! [`StepPlan`]: the rows of one serving step, the four `int32` arrays the decode kernel
//! reads.

use crate::error::StepError;
use cm_ir::bind::MAX_LEN;

/// Most intervals one step may hold (8 bytes each, the planner's own limit
/// `cm_plan::plan::MAX_INTERVALS`): `2 * MAX_STEP_INTERVALS` fits an `i32` index.
pub const MAX_STEP_INTERVALS: usize = 1 << 27;

/// The rows of one serving step over a paged KV cache.
///
/// A step is a batch of `num_seqs` sequences; sequence `s` has `q_len[s] >= 1` new query rows
/// and `kv_len[s] >= q_len[s]` cached keys *including* the new tokens (their K/V are written
/// into the cache before the step runs, as in vLLM and FlashInfer). New row `i` of sequence
/// `s` is the logical position `kv_len[s] - q_len[s] + i` (bottom-right alignment). All
/// arrays are `i32`, 0-based:
///
/// | array | shape | meaning |
/// |---|---|---|
/// | `cu_q` | `[num_seqs + 1]` | rows of sequence `s` are `cu_q[s] .. cu_q[s + 1]` of the packed query `[total_q, num_heads, head_dim]` |
/// | `kv_len` | `[num_seqs]` | keys of sequence `s`, the new tokens included |
/// | `row_ptr` | `[total_q + 1]` | row `r`'s intervals are `row_ptr[r] .. row_ptr[r + 1]` of `intervals` |
/// | `intervals` | `[2 * num_intervals]` | `(start, end)` pairs |
///
/// Each row's intervals are half-open `[start, end)` logical key positions of the row's own
/// sequence, sorted, disjoint and maximal (`prev.end < next.start`), with `0 <= start < end
/// <= kv_len[s]`; plain intervals only (strided runs are written as their keys). A row with
/// no interval sees no key (output 0, lse `-inf`). One mask serves every head. Logical key
/// `p` of sequence `s` lives in page `block_table[s][p / page_size]`, slot `p % page_size`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    cu_q: Vec<i32>,
    kv_len: Vec<i32>,
    row_ptr: Vec<i32>,
    intervals: Vec<i32>,
}

impl StepPlan {
    /// Checks arrays made elsewhere (read back from tensors, say) against the contract of
    /// [`StepPlan`] and takes them.
    ///
    /// # Errors
    /// [`StepError::BadArray`] naming the array, index and value at fault: `cu_q` empty, not
    /// starting at 0 or not strictly increasing (every `q_len >= 1`); `kv_len` of another
    /// length than `num_seqs`, or a `kv_len` below its `q_len` or above `2^26`; `row_ptr`
    /// not `total_q + 1` offsets from 0 to `num_intervals`, non-decreasing; `intervals` of
    /// odd length or an interval empty, outside `[0, kv_len[s])`, unsorted or touching the
    /// one before.
    pub fn from_parts(
        cu_q: Vec<i32>,
        kv_len: Vec<i32>,
        row_ptr: Vec<i32>,
        intervals: Vec<i32>,
    ) -> Result<StepPlan, StepError> {
        let plan = StepPlan {
            cu_q,
            kv_len,
            row_ptr,
            intervals,
        };
        plan.validate()?;
        Ok(plan)
    }

    /// The arrays, `(cu_q, kv_len, row_ptr, intervals)`.
    pub fn into_parts(self) -> (Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>) {
        (self.cu_q, self.kv_len, self.row_ptr, self.intervals)
    }

    /// Checks every invariant of [`StepPlan`] (see [`StepPlan::from_parts`]).
    ///
    /// # Errors
    /// As [`StepPlan::from_parts`].
    pub fn validate(&self) -> Result<(), StepError> {
        let bad = |array: &'static str, message: String| StepError::BadArray { array, message };
        let cu = &self.cu_q;
        if cu.len() < 2 {
            return Err(bad(
                "cu_q",
                format!(
                    "{} entries; it needs num_seqs + 1 >= 2 (one sequence at least)",
                    cu.len()
                ),
            ));
        }
        if cu[0] != 0 {
            return Err(bad("cu_q", format!("cu_q[0] = {}, expected 0", cu[0])));
        }
        for s in 0..cu.len() - 1 {
            if cu[s + 1] <= cu[s] {
                return Err(bad(
                    "cu_q",
                    format!(
                        "cu_q[{}] = {} is not above cu_q[{s}] = {}: sequence {s} would have \
                         q_len = {} (every q_len >= 1)",
                        s + 1,
                        cu[s + 1],
                        cu[s],
                        i64::from(cu[s + 1]) - i64::from(cu[s])
                    ),
                ));
            }
        }
        let num_seqs = cu.len() - 1;
        if self.kv_len.len() != num_seqs {
            return Err(bad(
                "kv_len",
                format!(
                    "{} entries, expected num_seqs = {num_seqs}",
                    self.kv_len.len()
                ),
            ));
        }
        for (s, &kv) in self.kv_len.iter().enumerate() {
            let q = cu[s + 1] - cu[s];
            if kv < q || i64::from(kv) > MAX_LEN {
                return Err(bad(
                    "kv_len",
                    format!(
                        "kv_len[{s}] = {kv}, expected q_len[{s}] = {q} ..= {MAX_LEN} (the keys \
                         include the new tokens)"
                    ),
                ));
            }
        }
        let total_q = cu[num_seqs] as usize;
        if self.row_ptr.len() != total_q + 1 {
            return Err(bad(
                "row_ptr",
                format!(
                    "{} entries, expected total_q + 1 = {}",
                    self.row_ptr.len(),
                    total_q + 1
                ),
            ));
        }
        if self.intervals.len() % 2 != 0 {
            return Err(bad(
                "intervals",
                format!(
                    "{} entries, an odd number: it holds (start, end) pairs",
                    self.intervals.len()
                ),
            ));
        }
        let n = self.intervals.len() / 2;
        if self.row_ptr[0] != 0 || self.row_ptr[total_q] as usize != n {
            return Err(bad(
                "row_ptr",
                format!(
                    "row_ptr[0] = {} and row_ptr[{total_q}] = {}, expected 0 and \
                     num_intervals = {n}",
                    self.row_ptr[0], self.row_ptr[total_q]
                ),
            ));
        }
        for s in 0..num_seqs {
            let kv = self.kv_len[s];
            for r in cu[s] as usize..cu[s + 1] as usize {
                let (a, z) = (self.row_ptr[r], self.row_ptr[r + 1]);
                if a > z || z as usize > n {
                    return Err(bad(
                        "row_ptr",
                        format!(
                            "row_ptr[{r}] = {a}, row_ptr[{}] = {z}: offsets are \
                             non-decreasing and at most num_intervals = {n}",
                            r + 1
                        ),
                    ));
                }
                let mut prev_end: Option<i32> = None;
                for j in a as usize..z as usize {
                    let (start, end) = (self.intervals[2 * j], self.intervals[2 * j + 1]);
                    if start < 0 || start >= end || end > kv {
                        return Err(bad(
                            "intervals",
                            format!(
                                "row {r} (sequence {s}): interval {j} is [{start}, {end}), \
                                 expected 0 <= start < end <= kv_len[{s}] = {kv}"
                            ),
                        ));
                    }
                    if prev_end.is_some_and(|e| e >= start) {
                        return Err(bad(
                            "intervals",
                            format!(
                                "row {r} (sequence {s}): interval {j} [{start}, {end}) overlaps \
                                 or touches the one before; a row's intervals are sorted and \
                                 maximal"
                            ),
                        ));
                    }
                    prev_end = Some(end);
                }
            }
        }
        Ok(())
    }

    /// Sequences of the step.
    pub fn num_seqs(&self) -> usize {
        self.cu_q.len().saturating_sub(1)
    }

    /// Query rows of the step, `cu_q[num_seqs]`.
    pub fn total_q(&self) -> usize {
        self.cu_q.last().map_or(0, |&t| t as usize)
    }

    /// Intervals of the step, `intervals.len() / 2`.
    pub fn num_intervals(&self) -> usize {
        self.intervals.len() / 2
    }

    /// `[num_seqs + 1]` row offsets.
    pub fn cu_q(&self) -> &[i32] {
        &self.cu_q
    }

    /// `[num_seqs]` keys per sequence, the new tokens included.
    pub fn kv_len(&self) -> &[i32] {
        &self.kv_len
    }

    /// `[total_q + 1]` interval offsets.
    pub fn row_ptr(&self) -> &[i32] {
        &self.row_ptr
    }

    /// `[2 * num_intervals]` `(start, end)` pairs, row after row.
    pub fn intervals(&self) -> &[i32] {
        &self.intervals
    }

    /// New rows of sequence `s`.
    ///
    /// # Panics
    /// If `s >= num_seqs`.
    pub fn q_len(&self, s: usize) -> usize {
        (self.cu_q[s + 1] - self.cu_q[s]) as usize
    }

    /// The logical position of new row `i` of sequence `s`: `kv_len[s] - q_len[s] + i`.
    ///
    /// # Panics
    /// If `s >= num_seqs`.
    pub fn position(&self, s: usize, i: usize) -> usize {
        self.kv_len[s] as usize - self.q_len(s) + i
    }

    /// The sequence that owns step row `r`, or `None` for `r >= total_q`.
    pub fn seq_of_row(&self, r: usize) -> Option<usize> {
        if r >= self.total_q() {
            return None;
        }
        Some(self.cu_q.partition_point(|&o| o as usize <= r) - 1)
    }

    /// Row `r`'s intervals as `(start, end)` pairs, half-open.
    ///
    /// # Panics
    /// If `r >= total_q`.
    pub fn row(&self, r: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
        let (a, z) = (self.row_ptr[r] as usize, self.row_ptr[r + 1] as usize);
        self.intervals[2 * a..2 * z]
            .chunks_exact(2)
            .map(|c| (c[0] as u32, c[1] as u32))
    }

    /// Empties the arrays for a new step of `num_seqs` sequences and `total_q` rows,
    /// keeping their allocations.
    pub(crate) fn reset(&mut self, num_seqs: usize, total_q: usize) {
        self.cu_q.clear();
        self.cu_q.reserve(num_seqs + 1);
        self.cu_q.push(0);
        self.kv_len.clear();
        self.kv_len.reserve(num_seqs);
        self.row_ptr.clear();
        self.row_ptr.reserve(total_q + 1);
        self.row_ptr.push(0);
        self.intervals.clear();
    }

    /// Starts sequence `s` with `q_len` rows over `kv_len` keys (checked by the caller).
    pub(crate) fn push_seq(&mut self, q_len: i64, kv_len: i64) {
        let last = *self.cu_q.last().expect("reset pushes cu_q[0]");
        self.cu_q.push(last + q_len as i32);
        self.kv_len.push(kv_len as i32);
    }

    /// Appends an interval to the row being written; its bounds are checked by the caller.
    pub(crate) fn push_interval(&mut self, start: u32, end: u32) -> Result<(), StepError> {
        if self.intervals.len() >= 2 * MAX_STEP_INTERVALS {
            return Err(StepError::TooManyIntervals {
                max: MAX_STEP_INTERVALS,
            });
        }
        self.intervals.push(start as i32);
        self.intervals.push(end as i32);
        Ok(())
    }

    /// Where the rows written so far end, for [`StepPlan::rewind`].
    pub(crate) fn mark(&self) -> (usize, usize) {
        (self.row_ptr.len(), self.intervals.len())
    }

    /// Drops the rows written after `mark`.
    pub(crate) fn rewind(&mut self, (rows, intervals): (usize, usize)) {
        self.row_ptr.truncate(rows);
        self.intervals.truncate(intervals);
    }

    /// Closes the row being written.
    pub(crate) fn finish_row(&mut self) {
        self.row_ptr.push((self.intervals.len() / 2) as i32);
    }
}
