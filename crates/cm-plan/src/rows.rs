//! `RowIntervals`: the exact visible keys of every query row, the compiler's primary output.
//!
//! Invariants (checked by [`RowIntervals::validate`] and owned by the planner):
//! every row's intervals are half-open `[start, end)` in 0-based key positions, non-empty,
//! sorted, inside `[0, kv_len)`, and *maximal*: consecutive intervals neither overlap nor
//! touch (`prev.end < next.start`), so `[0,3) U [3,5)` is always stored as `[0,5)`.

use serde::Serialize;

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

    /// Appends an interval to the row being built.
    pub(crate) fn push_row_interval(&mut self, start: u32, end: u32) {
        self.intervals.push(KeyInterval { start, end });
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
        } else {
            for t in 0..n as u32 {
                self.intervals
                    .extend(first.iter().zip(step).map(|(f, d)| KeyInterval {
                        start: f.start.wrapping_add(d.start.wrapping_mul(t)),
                        end: f.end.wrapping_add(d.end.wrapping_mul(t)),
                    }));
            }
        }
        self.row_ptr
            .extend((1..=n as u32).map(|t| at + t * k as u32));
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

    /// The visible intervals of row `q_idx` (0-based); empty for a row with no visible key.
    ///
    /// # Panics
    /// If `q_idx >= q_len`.
    pub fn row(&self, q_idx: u32) -> &[KeyInterval] {
        let (a, b) = (
            self.row_ptr[q_idx as usize],
            self.row_ptr[q_idx as usize + 1],
        );
        &self.intervals[a as usize..b as usize]
    }

    /// CSR offsets, `[q_len + 1]`.
    pub fn row_ptr(&self) -> &[u32] {
        &self.row_ptr
    }

    /// All intervals, row after row, `[num_intervals]`.
    pub fn intervals(&self) -> &[KeyInterval] {
        &self.intervals
    }

    /// Number of visible (q, k) pairs.
    pub fn visible_pairs(&self) -> u64 {
        self.intervals.iter().map(KeyInterval::len).sum()
    }

    /// Rows with no visible key.
    pub fn empty_rows(&self) -> u32 {
        self.row_ptr.windows(2).filter(|w| w[0] == w[1]).count() as u32
    }

    /// The largest number of (maximal) intervals in one row.
    pub fn max_intervals_per_row(&self) -> u32 {
        self.row_ptr
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    /// Is key `kv_idx` visible from row `q_idx`? O(log intervals).
    pub fn is_visible(&self, q_idx: u32, kv_idx: u32) -> bool {
        let row = self.row(q_idx);
        let i = row.partition_point(|iv| iv.end <= kv_idx);
        i < row.len() && row[i].start <= kv_idx
    }

    /// Bytes held by the CSR arrays.
    pub fn bytes(&self) -> usize {
        self.row_ptr.len() * 4 + self.intervals.len() * 8
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
        for q in 0..self.q_len {
            let row = self.row(q);
            for (j, iv) in row.iter().enumerate() {
                if iv.start >= iv.end || iv.end > self.kv_len {
                    return Err(format!(
                        "row {q}: interval {j} [{}, {}) is empty or outside [0, {})",
                        iv.start, iv.end, self.kv_len
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
