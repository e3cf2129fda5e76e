//! Exports of a compiled mask to the formats other attention systems consume. Each export
//! is exact (it encodes the same visible set as the row intervals) and refuses, with a
//! clear error, inputs it cannot represent or that would exceed its size limit.

use cm_ir::{Code, PlanError};
use cm_plan::{RowIntervals, TileDescriptor};
use serde::Serialize;

/// Largest dense export, in elements (`q_len x kv_len` for masks, `num_m_blocks x
/// num_n_blocks` for Flex block tables).
pub const DENSE_LIMIT: u64 = 1 << 28;

/// Largest dense export written out as JSON text (the `compilemask export` command), in
/// elements as for [`DENSE_LIMIT`]: JSON spends several bytes per element, so this is
/// 2^24, tens of megabytes of text.
pub const JSON_LIMIT: u64 = 1 << 24;

/// An export that was refused. Displays as a [`PlanError`] of the same code does.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[error("{}", PlanError::from(self.clone()))]
pub enum ExportError {
    /// `CM0403`: more elements than [`DENSE_LIMIT`].
    TooLarge {
        what: &'static str,
        rows: u64,
        cols: u64,
        elements: u64,
        limit: u64,
    },
    /// `CM0408`: a column with more masked row ranges than FlashMask's two.
    NotExpressible { column: u32, count: usize },
    /// `CM0412`: strided runs that expand past [`cm_plan::MAX_EXPANDED_INTERVALS`] unit
    /// intervals (the exports write plain intervals).
    Strides(cm_plan::ExpandError),
}

impl ExportError {
    pub fn code(&self) -> Code {
        match self {
            ExportError::TooLarge { .. } => Code::DenseTooLarge,
            ExportError::NotExpressible { .. } => Code::NotExpressible,
            ExportError::Strides(_) => Code::StridesTooMany,
        }
    }

    /// The message, without the code.
    pub fn message(&self) -> String {
        match self {
            ExportError::TooLarge {
                what,
                rows,
                cols,
                elements,
                limit,
            } => format!("a dense {what} of {rows} x {cols} = {elements} elements exceeds the limit of {limit}; use the interval or block forms instead"),
            ExportError::NotExpressible { column, count } => format!("FlashMask cannot express this mask: column {column} has {count} masked row ranges, FlashMask allows at most 2 (one lower, one upper)"),
            ExportError::Strides(e) => e.to_string(),
        }
    }
}

/// The same error as every other refusal: a code and a message, no span.
impl From<ExportError> for PlanError {
    fn from(e: ExportError) -> PlanError {
        PlanError::new(e.code(), None, e.message())
    }
}

fn check_size(what: &'static str, rows: u64, cols: u64) -> Result<(), ExportError> {
    let elements = rows * cols;
    if elements > DENSE_LIMIT {
        return Err(ExportError::TooLarge {
            what,
            rows,
            cols,
            elements,
            limit: DENSE_LIMIT,
        });
    }
    Ok(())
}

/// The dense boolean mask, `[q_len, kv_len]` row-major, 1 = visible.
///
/// # Errors
/// [`ExportError::TooLarge`] above [`DENSE_LIMIT`] elements.
pub fn dense(rows: &RowIntervals) -> Result<Vec<u8>, ExportError> {
    let (q_len, kv_len) = (u64::from(rows.q_len()), u64::from(rows.kv_len()));
    check_size("mask", q_len, kv_len)?;
    let mut out = vec![0u8; (q_len * kv_len) as usize];
    for q in 0..rows.q_len() {
        let base = q as usize * kv_len as usize;
        let strides = rows.row_strides(q);
        for (j, iv) in rows.row_runs(q).iter().enumerate() {
            let keys = &mut out[base + iv.start as usize..base + iv.end as usize];
            match strides.map_or(1, |s| s[j] as usize) {
                1 => keys.fill(1),
                s => keys.iter_mut().step_by(s).for_each(|x| *x = 1),
            }
        }
    }
    Ok(out)
}

/// The rows as plain intervals, for the exports that write them.
fn unit(rows: &RowIntervals) -> Result<std::borrow::Cow<'_, RowIntervals>, ExportError> {
    rows.expanded().map_err(ExportError::Strides)
}

/// FlexAttention `BlockMask` tensors as plain arrays, with Flex's names and layout
/// (`torch.nn.attention.flex_attention.BlockMask`, B = H = 1): counts are
/// `[num_m_blocks]` / `[num_n_blocks]`, index tables are dense `[num_m_blocks,
/// num_n_blocks]` / `[num_n_blocks, num_m_blocks]`. Each index row lists the counted
/// blocks ascending, then the remaining blocks ascending, as `create_block_mask` does.
/// `kv_*` hold partial blocks (Flex's "mask" blocks), `full_kv_*` fully visible ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlexBlockMask {
    /// `(Q_BLOCK_SIZE, KV_BLOCK_SIZE)`.
    pub block_size: (u32, u32),
    /// `(q_len, kv_len)`.
    pub seq_lengths: (u32, u32),
    pub kv_num_blocks: Vec<i32>,
    pub kv_indices: Vec<i32>,
    pub full_kv_num_blocks: Vec<i32>,
    pub full_kv_indices: Vec<i32>,
    pub q_num_blocks: Vec<i32>,
    pub q_indices: Vec<i32>,
    pub full_q_num_blocks: Vec<i32>,
    pub full_q_indices: Vec<i32>,
}

/// Expands CSR lists to Flex's padded dense tables.
fn padded(offsets: &[u32], idx: &[u32], width: u32) -> (Vec<i32>, Vec<i32>) {
    let mut counts = Vec::with_capacity(offsets.len().saturating_sub(1));
    let mut table = Vec::with_capacity(counts.capacity() * width as usize);
    let mut used = vec![false; width as usize];
    for w in offsets.windows(2) {
        let row = &idx[w[0] as usize..w[1] as usize];
        counts.push(row.len() as i32);
        for &i in row {
            used[i as usize] = true;
            table.push(i as i32);
        }
        for (i, u) in used.iter_mut().enumerate() {
            if !*u {
                table.push(i as i32);
            }
            *u = false;
        }
    }
    (counts, table)
}

/// # Errors
/// [`ExportError::TooLarge`] when the block table exceeds [`DENSE_LIMIT`].
pub fn flex_block_mask(t: &TileDescriptor) -> Result<FlexBlockMask, ExportError> {
    check_size(
        "block table",
        u64::from(t.num_m_blocks),
        u64::from(t.num_n_blocks),
    )?;
    let (kv_num_blocks, kv_indices) = padded(&t.kv_offsets, &t.kv_indices, t.num_n_blocks);
    let (full_kv_num_blocks, full_kv_indices) =
        padded(&t.full_kv_offsets, &t.full_kv_indices, t.num_n_blocks);
    let (q_num_blocks, q_indices) = padded(&t.q_offsets, &t.q_indices, t.num_m_blocks);
    let (full_q_num_blocks, full_q_indices) =
        padded(&t.full_q_offsets, &t.full_q_indices, t.num_m_blocks);
    Ok(FlexBlockMask {
        block_size: (t.tile.block_m, t.tile.block_n),
        seq_lengths: (t.q_len, t.kv_len),
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        q_num_blocks,
        q_indices,
        full_q_num_blocks,
        full_q_indices,
    })
}

/// cuDNN `flex_attention` interval endpoints: for every row, `nfunc` (odd) non-decreasing
/// endpoints `F0 <= F1 <= ...` with visible keys `[0, F0) U [F1, F2) U [F3, F4) ...`.
/// `endpoints` is `[nfunc, q_len]` row-major (cuDNN's `mask_func[H=1, nfunc, total_q]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CudnnEndpoints {
    pub nfunc: u32,
    pub endpoints: Vec<i32>,
}

/// # Errors
/// [`ExportError::Strides`] for strided rows past [`cm_plan::MAX_EXPANDED_INTERVALS`]
/// plain intervals (cuDNN takes plain intervals).
pub fn cudnn_endpoints(rows: &RowIntervals) -> Result<CudnnEndpoints, ExportError> {
    let rows = &*unit(rows)?;
    let per_row = |q: u32| -> Vec<i32> {
        let r = rows.row(q);
        let mut f = Vec::with_capacity(2 * r.len() + 1);
        match r.first() {
            Some(first) if first.start == 0 => f.push(first.end as i32),
            _ => f.push(0),
        }
        let skip = usize::from(r.first().is_some_and(|i| i.start == 0));
        for iv in &r[skip..] {
            f.push(iv.start as i32);
            f.push(iv.end as i32);
        }
        f
    };
    let nfunc = (0..rows.q_len())
        .map(|q| per_row(q).len())
        .max()
        .unwrap_or(1) as u32;
    let q_len = rows.q_len() as usize;
    let mut endpoints = vec![0i32; nfunc as usize * q_len];
    for q in 0..rows.q_len() {
        let f = per_row(q);
        let last = *f.last().unwrap_or(&0);
        for j in 0..nfunc as usize {
            endpoints[j * q_len + q as usize] = *f.get(j).unwrap_or(&last);
        }
    }
    Ok(CudnnEndpoints { nfunc, endpoints })
}

/// FlashMask column bounds (PaddlePaddle FlashMask, arXiv 2410.01359): for every key
/// column, rows `[lts, lte)` (lower part) and `[uts, ute)` (upper part) are masked and all
/// other rows visible. Each is `[kv_len]`; an unused range is empty (`start == end`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FlashMaskBounds {
    pub lts: Vec<i32>,
    pub lte: Vec<i32>,
    pub uts: Vec<i32>,
    pub ute: Vec<i32>,
}

/// # Errors
/// [`ExportError::NotExpressible`] when some column's masked rows form more than two runs;
/// [`ExportError::Strides`] for strided rows past [`cm_plan::MAX_EXPANDED_INTERVALS`] plain
/// intervals.
pub fn flashmask_bounds(rows: &RowIntervals) -> Result<FlashMaskBounds, ExportError> {
    let rows = &*unit(rows)?;
    let kv_len = rows.kv_len() as usize;
    let q_len = rows.q_len();
    // Rows where each column's visibility flips, found by diffing consecutive rows.
    let mut flips: Vec<Vec<u32>> = vec![Vec::new(); kv_len];
    let mut prev: &[cm_plan::KeyInterval] = &[];
    let mut toggle = |q: u32, a: &[cm_plan::KeyInterval], b: &[cm_plan::KeyInterval]| {
        let mut pts: Vec<u32> = a
            .iter()
            .chain(b.iter())
            .flat_map(|iv| [iv.start, iv.end])
            .collect();
        pts.sort_unstable();
        let inside =
            |set: &[cm_plan::KeyInterval], k: u32| set.iter().any(|iv| iv.start <= k && k < iv.end);
        for w in pts.windows(2) {
            if w[0] < w[1] && inside(a, w[0]) != inside(b, w[0]) {
                for col in &mut flips[w[0] as usize..w[1] as usize] {
                    col.push(q);
                }
            }
        }
    };
    for q in 0..q_len {
        let cur = rows.row(q);
        if cur != prev {
            toggle(q, prev, cur);
        }
        prev = cur;
    }
    let mut out = FlashMaskBounds {
        lts: vec![0; kv_len],
        lte: vec![0; kv_len],
        uts: vec![0; kv_len],
        ute: vec![0; kv_len],
    };
    for (k, f) in flips.iter().enumerate() {
        // Visible runs start at even flips; masked runs are the gaps.
        let mut masked = Vec::new();
        let mut cursor = 0u32;
        for pair in f.chunks(2) {
            if pair[0] > cursor {
                masked.push((cursor, pair[0]));
            }
            cursor = pair.get(1).copied().unwrap_or(q_len);
        }
        if cursor < q_len {
            masked.push((cursor, q_len));
        }
        let (upper, lower) = match masked.as_slice() {
            [] => ((0, 0), (0, 0)),
            [one] if one.0 == 0 && one.1 < q_len => (*one, (0, 0)),
            [one] => ((0, 0), *one),
            [u, l] => (*u, *l),
            _ => {
                return Err(ExportError::NotExpressible {
                    column: k as u32,
                    count: masked.len(),
                })
            }
        };
        out.uts[k] = upper.0 as i32;
        out.ute[k] = upper.1 as i32;
        out.lts[k] = lower.0 as i32;
        out.lte[k] = lower.1 as i32;
    }
    Ok(out)
}
