//! `RowIntervals`: the exact visible keys of every query row, the compiler's primary output.
//!
//! Invariants (checked by [`RowIntervals::validate`] and owned by the planner):
//! every row's intervals are half-open `[start, end)` in 0-based key positions, non-empty,
//! sorted, inside `[0, kv_len)`, and *maximal*: consecutive intervals neither overlap nor
//! touch (`prev.end < next.start`), so `[0,3) U [3,5)` is always stored as `[0,5)`.
//!
//! **Strided runs.** A row may also hold *strided runs*: a run `[start, end)` with stride
//! `s >= 2` holds the keys `start, start + s, start + 2s, ...` below `end`, with `end - 1`
//! its last key (so `(end - 1 - start) % s == 0`) and at least two keys. A dilated window
//! (`(q - k) % 2 == 0` inside a band of 4096 keys) is one run per row instead of 2048
//! intervals. Every run's keys are single keys of the canonical unit form (no key next to a
//! strided key is visible), and runs keep the order and spacing of intervals
//! (`prev.end < next.start`), so [`RowIntervals::expanded`] (each strided run written as
//! its keys, one interval each) is the canonical unit form of the same rows. Rows without
//! any strided run store no strides at all ([`RowIntervals::has_strides`] is false) and
//! read exactly as before; the unit accessors [`RowIntervals::row`] and
//! [`RowIntervals::intervals`] refuse strided rows (a panic, never a silent misreading):
//! consumers that cannot carry strides (exports, the CPU reference, the CUDA plan) take
//! [`RowIntervals::expanded`], which fails past [`MAX_EXPANDED_INTERVALS`].

use serde::Serialize;
use std::borrow::Cow;

/// Most unit intervals [`RowIntervals::expanded`] writes (8 bytes each, as the planner's
/// own limit `cm_plan::plan::MAX_INTERVALS`): a consumer that cannot carry strides gets a
/// clear error (`CM0412`) instead of exhausting memory.
pub const MAX_EXPANDED_INTERVALS: usize = 1 << 27;

/// [`RowIntervals::expanded`] past [`MAX_EXPANDED_INTERVALS`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpandError {
    /// Unit intervals the rows expand to.
    pub intervals: u64,
    /// The limit they exceed.
    pub limit: u64,
}

impl std::fmt::Display for ExpandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the mask's strided runs expand to {} unit intervals, more than the {} that a \
             consumer without strides (a token order, an export, the CPU reference, the CUDA \
             kernels' plan) takes",
            self.intervals, self.limit
        )
    }
}

/// One visible run of keys, half-open `[start, end)`, 0-based key positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct KeyInterval {
    pub start: u32,
    pub end: u32,
}

impl KeyInterval {
    /// Number of keys in the interval.
    pub fn len(&self) -> u64 {
        u64::from(self.end - self.start)
    }

    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

/// Visible key intervals of all `q_len` rows in CSR form.
///
/// Shapes: `row_ptr` is `[q_len + 1]` (offsets into `intervals`), `intervals` is
/// `[num_intervals]`. Memory is O(rows x intervals), never O(q_len x kv_len).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RowIntervals {
    q_len: u32,
    kv_len: u32,
    row_ptr: Vec<u32>,
    intervals: Vec<KeyInterval>,
    /// Each run's stride (`[num_intervals]`, 1 for a plain interval) when `strided`, else
    /// empty.
    strides: Vec<u32>,
    strided: bool,
}

impl RowIntervals {
    /// An empty builder for `q_len` rows over `kv_len` keys; rows are appended in order with
    /// [`RowIntervals::push_row_interval`] and closed with [`RowIntervals::finish_row`].
    pub fn with_capacity(q_len: u32, kv_len: u32, intervals: usize) -> Self {
        let mut row_ptr = Vec::with_capacity(q_len as usize + 1);
        row_ptr.push(0);
        RowIntervals {
            q_len,
            kv_len,
            row_ptr,
            intervals: Vec::with_capacity(intervals),
            strides: Vec::new(),
            strided: false,
        }
    }

    /// Builds from explicit per-row lists; the lists must already satisfy the invariants.
    ///
    /// # Errors
    /// A message naming the first row that breaks an invariant.
    pub fn from_rows(kv_len: u32, rows: &[Vec<(u32, u32)>]) -> Result<Self, String> {
        let q_len = u32::try_from(rows.len()).map_err(|_| "too many rows".to_string())?;
        let mut out = Self::with_capacity(q_len, kv_len, rows.iter().map(Vec::len).sum());
        for row in rows {
            for &(start, end) in row {
                out.push_row_interval(start, end);
            }
            out.finish_row();
        }
        out.validate()?;
        Ok(out)
    }

    /// Builds from CSR arrays: row `q`'s intervals are `intervals[row_ptr[q]..row_ptr[q + 1]]`
    /// (`row_ptr` is `[q_len + 1]`, starting at 0), which must already satisfy the invariants.
    ///
    /// # Errors
    /// A message naming the first row or offset that breaks an invariant.
    pub fn from_csr(
        kv_len: u32,
        row_ptr: Vec<u32>,
        intervals: Vec<KeyInterval>,
    ) -> Result<Self, String> {
        let q_len = u32::try_from(row_ptr.len().saturating_sub(1))
            .map_err(|_| "too many rows".to_string())?;
        if row_ptr.first() != Some(&0)
            || row_ptr.last().map(|&e| e as usize) != Some(intervals.len())
            || row_ptr.windows(2).any(|w| w[0] > w[1])
        {
            return Err(format!(
                "row_ptr must rise from 0 to the {} intervals, one entry per row and one more",
                intervals.len()
            ));
        }
        let out = RowIntervals {
            q_len,
            kv_len,
            row_ptr,
            intervals,
            strides: Vec::new(),
            strided: false,
        };
        out.validate()?;
        Ok(out)
    }

    /// Builds from per-row runs `(start, end, stride)` (stride 1: a plain interval); the
    /// runs must already satisfy the invariants of the module docs.
    ///
    /// # Errors
    /// A message naming the first row that breaks an invariant.
    pub fn from_row_runs(kv_len: u32, rows: &[Vec<(u32, u32, u32)>]) -> Result<Self, String> {
        let q_len = u32::try_from(rows.len()).map_err(|_| "too many rows".to_string())?;
        let mut out = Self::with_capacity(q_len, kv_len, rows.iter().map(Vec::len).sum());
        for row in rows {
            for &(start, end, stride) in row {
                out.push_row_run(KeyInterval { start, end }, stride);
            }
            out.finish_row();
        }
        out.validate()?;
        Ok(out)
    }

    /// Appends an interval to the row being built.
    pub(crate) fn push_row_interval(&mut self, start: u32, end: u32) {
        self.intervals.push(KeyInterval { start, end });
        if self.strided {
            self.strides.push(1);
        }
    }

    /// Appends a run of stride `stride` (1: a plain interval) to the row being built.
    pub(crate) fn push_row_run(&mut self, run: KeyInterval, stride: u32) {
        if stride != 1 {
            self.strided_from_here();
        }
        self.intervals.push(run);
        if self.strided {
            self.strides.push(stride);
        }
    }

    /// Starts storing strides: every run so far is a plain interval.
    fn strided_from_here(&mut self) {
        if !self.strided {
            self.strided = true;
            // As much room as the intervals have (grown as runs come where the allocator
            // refuses it).
            let _ = self.strides.try_reserve_exact(self.intervals.capacity());
            self.strides.resize(self.intervals.len(), 1);
        }
    }

    /// Reserves room for `n` intervals in all, if the allocator grants it (else the array
    /// grows as intervals come): rows written into the room never move. Much of it may stay
    /// unused; [`RowIntervals::shrink_to_fit`] gives it back.
    pub(crate) fn try_reserve_intervals(&mut self, n: usize) {
        let _ = self
            .intervals
            .try_reserve_exact(n.saturating_sub(self.intervals.len()));
    }

    /// Gives back the arrays' unused room.
    pub(crate) fn shrink_to_fit(&mut self) {
        self.intervals.shrink_to_fit();
        self.strides.shrink_to_fit();
    }

    /// Appends `n` rows of `first.len()` intervals each: row `t` holds `first[i] + t *
    /// step[i]` (start and end), computed in wrapping `u32` arithmetic, which is exact when
    /// every endpoint of every row lies in `[0, kv_len]` (as the solver's affine pieces'
    /// do).
    pub(crate) fn push_affine_rows(
        &mut self,
        first: &[KeyInterval],
        step: &[KeyInterval],
        n: usize,
    ) {
        let k = first.len();
        let at = self.intervals.len() as u32;
        self.intervals.reserve(k * n);
        self.row_ptr.reserve(n);
        if let ([f], [d]) = (first, step) {
            self.intervals.extend((0..n as u32).map(|t| KeyInterval {
                start: f.start.wrapping_add(d.start.wrapping_mul(t)),
                end: f.end.wrapping_add(d.end.wrapping_mul(t)),
            }));
        } else if n == 1 {
            self.intervals.extend_from_slice(first);
        } else {
            // Row by row from the previous one: an add per endpoint, where a multiply by the
            // row offset costs several vector instructions on the baseline x86-64 target.
            let mut row = first.to_vec();
            for _ in 0..n {
                self.intervals
                    .extend(row.iter_mut().zip(step).map(|(r, d)| {
                        let this = *r;
                        r.start = r.start.wrapping_add(d.start);
                        r.end = r.end.wrapping_add(d.end);
                        this
                    }));
            }
        }
        self.row_ptr
            .extend((1..=n as u32).map(|t| at + t * k as u32));
        if self.strided {
            self.strides.resize(self.intervals.len(), 1);
        }
    }

    /// As [`RowIntervals::push_affine_rows`], each interval `i` a run of stride
    /// `strides[i]` on every row.
    pub(crate) fn push_affine_runs(
        &mut self,
        first: &[KeyInterval],
        step: &[KeyInterval],
        strides: &[u32],
        n: usize,
    ) {
        if strides.iter().any(|&s| s != 1) {
            self.strided_from_here();
        }
        if self.strided {
            for _ in 0..n {
                self.strides.extend_from_slice(strides);
            }
        }
        self.push_affine_rows(first, step, n);
    }

    /// Closes the row being built.
    pub(crate) fn finish_row(&mut self) {
        self.row_ptr.push(self.intervals.len() as u32);
    }

    pub(crate) fn interval_count(&self) -> usize {
        self.intervals.len()
    }

    pub fn q_len(&self) -> u32 {
        self.q_len
    }

    pub fn kv_len(&self) -> u32 {
        self.kv_len
    }

    /// The first row of every maximal affine run, greedily from row 0: consecutive rows
    /// with equally many runs, each endpoint moving by the same amount from row to row (the
    /// form [`crate::TileDescriptor::try_build_runs`] takes, for rows that did not come from
    /// the solver, such as rows in a token order). O(runs).
    pub fn affine_runs(&self) -> Vec<u32> {
        let step = |a: &KeyInterval, b: &KeyInterval| {
            (
                i64::from(b.start) - i64::from(a.start),
                i64::from(b.end) - i64::from(a.end),
            )
        };
        let mut runs = Vec::new();
        let mut a = 0u32;
        while a < self.q_len {
            runs.push(a);
            let first = self.row_runs(a);
            let mut b = a + 1;
            if b < self.q_len && self.row_runs(b).len() == first.len() {
                let second = self.row_runs(b);
                b += 1;
                while b < self.q_len {
                    let (prev, row) = (self.row_runs(b - 1), self.row_runs(b));
                    let same = row.len() == first.len()
                        && prev
                            .iter()
                            .zip(row)
                            .zip(first.iter().zip(second))
                            .all(|((p, r), (f, s))| step(p, r) == step(f, s));
                    if !same {
                        break;
                    }
                    b += 1;
                }
            }
            a = b;
        }
        runs
    }

    /// The visible intervals of row `q_idx` (0-based); empty for a row with no visible key.
    ///
    /// # Panics
    /// If `q_idx >= q_len`, or if the rows hold strided runs ([`RowIntervals::has_strides`]):
    /// read those with [`RowIntervals::row_runs`] or [`RowIntervals::expanded`].
    pub fn row(&self, q_idx: u32) -> &[KeyInterval] {
        self.assert_unit();
        self.row_runs(q_idx)
    }

    /// The runs of row `q_idx`: its intervals, or with strides ([`RowIntervals::row_strides`])
    /// each run's first key and last key + 1.
    ///
    /// # Panics
    /// If `q_idx >= q_len`.
    pub fn row_runs(&self, q_idx: u32) -> &[KeyInterval] {
        let (a, b) = (
            self.row_ptr[q_idx as usize],
            self.row_ptr[q_idx as usize + 1],
        );
        &self.intervals[a as usize..b as usize]
    }

    /// The strides of row `q_idx`'s runs, `None` when the rows hold no strided run.
    ///
    /// # Panics
    /// If `q_idx >= q_len`.
    pub fn row_strides(&self, q_idx: u32) -> Option<&[u32]> {
        if !self.strided {
            return None;
        }
        let (a, b) = (
            self.row_ptr[q_idx as usize],
            self.row_ptr[q_idx as usize + 1],
        );
        Some(&self.strides[a as usize..b as usize])
    }

    /// Row `q_idx` as plain intervals (its strided runs written as their keys).
    ///
    /// # Panics
    /// If `q_idx >= q_len`.
    pub fn row_expanded(&self, q_idx: u32) -> Cow<'_, [KeyInterval]> {
        let runs = self.row_runs(q_idx);
        match self.row_strides(q_idx) {
            Some(strides) if strides.iter().any(|&s| s > 1) => Cow::Owned(
                runs.iter()
                    .zip(strides)
                    .flat_map(|(iv, &s)| {
                        (iv.start..iv.end)
                            .step_by(s.max(1) as usize)
                            .map(move |k| KeyInterval {
                                start: k,
                                end: if s > 1 { k + 1 } else { iv.end },
                            })
                            .take(if s > 1 { usize::MAX } else { 1 })
                    })
                    .collect(),
            ),
            _ => Cow::Borrowed(runs),
        }
    }

    /// Whether some run has a stride above 1.
    pub fn has_strides(&self) -> bool {
        self.strided
    }

    /// Every run's stride, `[num_intervals]`, or empty when none is strided.
    pub fn strides(&self) -> &[u32] {
        &self.strides
    }

    fn assert_unit(&self) {
        assert!(
            !self.strided,
            "these rows hold strided runs: read them with row_runs / row_strides, or expanded()"
        );
    }

    /// CSR offsets, `[q_len + 1]` (into the runs when there are strides).
    pub fn row_ptr(&self) -> &[u32] {
        &self.row_ptr
    }

    /// All intervals, row after row, `[num_intervals]`.
    ///
    /// # Panics
    /// If the rows hold strided runs: see [`RowIntervals::all_runs`] and
    /// [`RowIntervals::expanded`].
    pub fn intervals(&self) -> &[KeyInterval] {
        self.assert_unit();
        &self.intervals
    }

    /// All runs, row after row, `[num_intervals]`; their strides are
    /// [`RowIntervals::strides`].
    pub fn all_runs(&self) -> &[KeyInterval] {
        &self.intervals
    }

    /// The keys of a run of stride `s`.
    fn run_keys(iv: &KeyInterval, s: u32) -> u64 {
        if s <= 1 {
            iv.len()
        } else {
            u64::from(iv.end - 1 - iv.start) / u64::from(s) + 1
        }
    }

    /// Number of visible (q, k) pairs.
    pub fn visible_pairs(&self) -> u64 {
        if !self.strided {
            return self.intervals.iter().map(KeyInterval::len).sum();
        }
        self.intervals
            .iter()
            .zip(&self.strides)
            .map(|(iv, &s)| Self::run_keys(iv, s))
            .sum()
    }

    /// The unit intervals these rows expand to (each strided run written as its keys).
    pub fn expanded_len(&self) -> u64 {
        if !self.strided {
            return self.intervals.len() as u64;
        }
        self.intervals
            .iter()
            .zip(&self.strides)
            .map(|(iv, &s)| if s <= 1 { 1 } else { Self::run_keys(iv, s) })
            .sum()
    }

    /// The same rows as plain intervals only: `self` when no run is strided, else a copy
    /// with every strided run written as its keys, one interval each (the canonical unit
    /// form).
    ///
    /// # Errors
    /// More than [`MAX_EXPANDED_INTERVALS`] unit intervals.
    pub fn expanded(&self) -> Result<Cow<'_, RowIntervals>, ExpandError> {
        self.expanded_within(MAX_EXPANDED_INTERVALS)
    }

    /// As [`RowIntervals::expanded`] with a limit of `limit` unit intervals.
    ///
    /// # Errors
    /// More than `limit` unit intervals.
    pub fn expanded_within(&self, limit: usize) -> Result<Cow<'_, RowIntervals>, ExpandError> {
        if !self.strided {
            return Ok(Cow::Borrowed(self));
        }
        let total = self.expanded_len();
        if total > limit as u64 {
            return Err(ExpandError {
                intervals: total,
                limit: limit as u64,
            });
        }
        let mut out = RowIntervals::with_capacity(self.q_len, self.kv_len, total as usize);
        for q in 0..self.q_len {
            let a = self.row_ptr[q as usize] as usize;
            let b = self.row_ptr[q as usize + 1] as usize;
            for (iv, &s) in self.intervals[a..b].iter().zip(&self.strides[a..b]) {
                if s <= 1 {
                    out.intervals.push(*iv);
                } else {
                    out.intervals
                        .extend((iv.start..iv.end).step_by(s as usize).map(|k| KeyInterval {
                            start: k,
                            end: k + 1,
                        }));
                }
            }
            out.finish_row();
        }
        Ok(Cow::Owned(out))
    }

    /// Rows with no visible key.
    pub fn empty_rows(&self) -> u32 {
        self.row_ptr.windows(2).filter(|w| w[0] == w[1]).count() as u32
    }

    /// The largest number of runs in one row (a strided run counts once): the width of the
    /// stored form.
    pub fn max_runs_per_row(&self) -> u32 {
        self.row_ptr
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    /// The largest number of maximal intervals in one row: a strided run counts each of its
    /// keys (each is its own maximal interval), as [`RowIntervals::expanded`] writes the row,
    /// so the count is the width a consumer of the expanded rows needs.
    pub fn max_intervals_per_row(&self) -> u32 {
        if !self.strided {
            return self.max_runs_per_row();
        }
        self.row_ptr
            .windows(2)
            .map(|w| {
                let (a, b) = (w[0] as usize, w[1] as usize);
                self.intervals[a..b]
                    .iter()
                    .zip(&self.strides[a..b])
                    .map(|(iv, &s)| if s <= 1 { 1 } else { Self::run_keys(iv, s) })
                    .sum::<u64>()
            })
            .max()
            .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Is key `kv_idx` visible from row `q_idx`? O(log intervals). Rows and keys out of
    /// range are not.
    pub fn is_visible(&self, q_idx: u32, kv_idx: u32) -> bool {
        if q_idx >= self.q_len() {
            return false;
        }
        let row = self.row_runs(q_idx);
        let i = row.partition_point(|iv| iv.end <= kv_idx);
        if i >= row.len() || row[i].start > kv_idx {
            return false;
        }
        match self.row_strides(q_idx) {
            Some(s) => (kv_idx - row[i].start).is_multiple_of(s[i]),
            None => true,
        }
    }

    /// Bytes held by the CSR arrays (and the strides, when there are any).
    pub fn bytes(&self) -> usize {
        self.row_ptr.len() * 4 + self.intervals.len() * 8 + self.strides.len() * 4
    }

    /// Checks every invariant of the module docs.
    ///
    /// # Errors
    /// A message naming the row and interval at fault.
    pub fn validate(&self) -> Result<(), String> {
        if self.row_ptr.len() != self.q_len as usize + 1 {
            return Err(format!(
                "row_ptr has {} entries, expected q_len + 1 = {}",
                self.row_ptr.len(),
                self.q_len + 1
            ));
        }
        if self.strided && self.strides.len() != self.intervals.len() {
            return Err(format!(
                "{} strides for {} runs",
                self.strides.len(),
                self.intervals.len()
            ));
        }
        for q in 0..self.q_len {
            let row = self.row_runs(q);
            for (j, iv) in row.iter().enumerate() {
                if iv.start >= iv.end || iv.end > self.kv_len {
                    return Err(format!(
                        "row {q}: interval {j} [{}, {}) is empty or outside [0, {})",
                        iv.start, iv.end, self.kv_len
                    ));
                }
                let s = self.row_strides(q).map_or(1, |s| s[j]);
                if s == 0
                    || (s > 1
                        && (!(iv.end - 1 - iv.start).is_multiple_of(s) || iv.end - iv.start <= s))
                {
                    return Err(format!(
                        "row {q}: run {j} [{}, {}) of stride {s} does not end one past a key \
                         or holds fewer than two keys",
                        iv.start, iv.end
                    ));
                }
                if j > 0 && row[j - 1].end >= iv.start {
                    return Err(format!(
                        "row {q}: intervals {} and {j} overlap or touch",
                        j - 1
                    ));
                }
            }
        }
        Ok(())
    }
}
