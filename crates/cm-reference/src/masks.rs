//! Which [`RowIntervals`] applies to each `(batch, query head)` pair.
//!
//! A mask may differ per batch (per-sample cutoffs, document ids) and per head, but most calls
//! share one; [`Masks`] covers both without copying any intervals.

use cm_plan::RowIntervals;

use crate::error::ReferenceError;
use crate::shape::AttentionShape;

#[derive(Clone, Debug)]
enum Select {
    Shared,
    PerBatch,
    PerHead,
    Indexed(Vec<usize>),
}

/// The masks of one attention call: a list of borrowed [`RowIntervals`] and the rule that picks
/// one for every `(batch, query head)` pair.
///
/// Every mask used must have been planned for the call's lengths: its `q_len` and `kv_len` equal
/// [`AttentionShape::q_len`] and [`AttentionShape::kv_len`]. This is checked at call time, not
/// here, because the shape is not known yet.
#[derive(Clone, Debug)]
pub struct Masks<'a> {
    masks: Vec<&'a RowIntervals>,
    select: Select,
}

impl<'a> Masks<'a> {
    /// One mask for every batch and head.
    pub fn shared(mask: &'a RowIntervals) -> Self {
        Masks {
            masks: vec![mask],
            select: Select::Shared,
        }
    }

    /// `masks[b]` for every head of batch `b`; the call fails unless `masks.len() == batch`.
    pub fn per_batch(masks: &[&'a RowIntervals]) -> Self {
        Masks {
            masks: masks.to_vec(),
            select: Select::PerBatch,
        }
    }

    /// `masks[h]` for query head `h` of every batch; the call fails unless
    /// `masks.len() == num_heads`.
    pub fn per_head(masks: &[&'a RowIntervals]) -> Self {
        Masks {
            masks: masks.to_vec(),
            select: Select::PerHead,
        }
    }

    /// `masks[index[b * num_heads + h]]` for batch `b`, query head `h`; the call fails unless
    /// `index.len() == batch * num_heads` and every entry is `< masks.len()`. Masks may repeat.
    pub fn indexed(masks: &[&'a RowIntervals], index: &[usize]) -> Self {
        Masks {
            masks: masks.to_vec(),
            select: Select::Indexed(index.to_vec()),
        }
    }

    /// Index into `self.masks` of the mask of `(b, h)`; `None` if out of range.
    fn pick(&self, shape: &AttentionShape, b: usize, h: usize) -> Option<usize> {
        match &self.select {
            Select::Shared => Some(0),
            Select::PerBatch => Some(b),
            Select::PerHead => Some(h),
            Select::Indexed(index) => index.get(b * shape.num_heads + h).copied(),
        }
    }

    /// The mask of every `(b, h)`, flat as `[batch, num_heads]`, after checking counts, index
    /// bounds, lengths and interval invariants (each distinct mask checked once).
    pub(crate) fn resolve(
        &self,
        shape: &AttentionShape,
    ) -> Result<Vec<&'a RowIntervals>, ReferenceError> {
        let pairs = shape
            .batch
            .checked_mul(shape.num_heads)
            .ok_or(ReferenceError::SizeOverflow { tensor: "lse" })?;
        match &self.select {
            Select::Shared => {}
            Select::PerBatch if self.masks.len() != shape.batch => {
                return Err(ReferenceError::MaskCount {
                    layout: "per-batch",
                    dim: "batch",
                    expected: shape.batch,
                    actual: self.masks.len(),
                });
            }
            Select::PerHead if self.masks.len() != shape.num_heads => {
                return Err(ReferenceError::MaskCount {
                    layout: "per-head",
                    dim: "num_heads",
                    expected: shape.num_heads,
                    actual: self.masks.len(),
                });
            }
            Select::Indexed(index) if index.len() != pairs => {
                return Err(ReferenceError::MaskIndexLen {
                    expected: pairs,
                    actual: index.len(),
                });
            }
            _ => {}
        }

        let mut checked = vec![false; self.masks.len()];
        let mut out = Vec::with_capacity(pairs);
        for b in 0..shape.batch {
            for h in 0..shape.num_heads {
                let i = self
                    .pick(shape, b, h)
                    .filter(|&i| i < self.masks.len())
                    .ok_or_else(|| ReferenceError::MaskIndexOutOfRange {
                        batch: b,
                        head: h,
                        index: self.pick(shape, b, h).unwrap_or(usize::MAX),
                        count: self.masks.len(),
                    })?;
                let mask = self.masks[i];
                if !checked[i] {
                    check_mask(mask, i, b, h, shape)?;
                    checked[i] = true;
                }
                out.push(mask);
            }
        }
        Ok(out)
    }
}

/// Lengths must match the shape, and the invariants must hold, so that interval iteration can
/// index `k`/`v` without bounds failures.
fn check_mask(
    mask: &RowIntervals,
    index: usize,
    batch: usize,
    head: usize,
    shape: &AttentionShape,
) -> Result<(), ReferenceError> {
    let (mq, mk) = (mask.q_len(), mask.kv_len());
    let same = |m: u32, s: usize| usize::try_from(m).is_ok_and(|m| m == s);
    if !same(mq, shape.q_len) || !same(mk, shape.kv_len) {
        return Err(ReferenceError::MaskShape {
            mask: index,
            batch,
            head,
            mask_q_len: u64::from(mq),
            mask_kv_len: u64::from(mk),
            q_len: shape.q_len,
            kv_len: shape.kv_len,
        });
    }
    if mask.has_strides() {
        return Err(ReferenceError::InvalidMask {
            mask: index,
            batch,
            head,
            reason: "it holds strided runs, and the reference reads plain intervals: pass \
                     RowIntervals::expanded()"
                .into(),
        });
    }
    mask.validate()
        .map_err(|reason| ReferenceError::InvalidMask {
            mask: index,
            batch,
            head,
            reason,
        })
}
