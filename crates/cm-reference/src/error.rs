//! Errors of the reference: every bad input is reported, never panicked on.

/// Why a reference call rejected its inputs. Messages name the offending value and what was
/// expected; indices in messages are 0-based.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ReferenceError {
    /// `num_heads` or `num_kv_heads` is 0.
    #[error("num_heads = {num_heads} and num_kv_heads = {num_kv_heads}: both must be at least 1")]
    ZeroHeads {
        /// The shape's `num_heads`.
        num_heads: usize,
        /// The shape's `num_kv_heads`.
        num_kv_heads: usize,
    },

    /// `num_heads` is not a multiple of `num_kv_heads`, so GQA groups are undefined.
    #[error(
        "num_heads = {num_heads} is not a multiple of num_kv_heads = {num_kv_heads}; \
         GQA/MQA needs num_heads / num_kv_heads query heads per kv head"
    )]
    HeadsNotDivisible {
        /// The shape's `num_heads`.
        num_heads: usize,
        /// The shape's `num_kv_heads`.
        num_kv_heads: usize,
    },

    /// The element count of a tensor does not fit in `usize`.
    #[error("the element count of {tensor} overflows usize")]
    SizeOverflow {
        /// The tensor's name (`q`, `k`, `v`, `out`, `lse`).
        tensor: &'static str,
    },

    /// A slice has the wrong number of elements for the shape.
    #[error("{tensor} has {actual} elements, expected {expected} = {dims}")]
    LengthMismatch {
        /// The tensor's name (`q`, `k`, `v`, `dout`).
        tensor: &'static str,
        /// The expected shape in named dimensions, e.g. `[batch, num_heads, q_len, head_dim]`.
        dims: &'static str,
        /// Elements expected from the shape.
        expected: usize,
        /// Elements actually given.
        actual: usize,
    },

    /// A [`crate::Masks`] built per batch or per head holds the wrong number of masks.
    #[error("{layout} masks: got {actual} masks, expected {dim} = {expected}")]
    MaskCount {
        /// `"per-batch"` or `"per-head"`.
        layout: &'static str,
        /// The shape dimension the count must equal (`batch` or `num_heads`).
        dim: &'static str,
        /// The value of that dimension.
        expected: usize,
        /// Masks given.
        actual: usize,
    },

    /// An indexed [`crate::Masks`] has an index map of the wrong length.
    #[error("mask index map has {actual} entries, expected batch * num_heads = {expected}")]
    MaskIndexLen {
        /// `batch * num_heads`.
        expected: usize,
        /// Entries given.
        actual: usize,
    },

    /// An entry of the index map points past the list of masks.
    #[error(
        "mask index map entry for batch {batch}, head {head} is {index}, \
         but only {count} masks were given"
    )]
    MaskIndexOutOfRange {
        /// Batch of the entry.
        batch: usize,
        /// Query head of the entry.
        head: usize,
        /// The out-of-range mask index.
        index: usize,
        /// Number of masks given.
        count: usize,
    },

    /// The mask chosen for a `(batch, head)` was planned for different lengths.
    #[error(
        "mask {mask} (used by batch {batch}, head {head}) has q_len = {mask_q_len}, \
         kv_len = {mask_kv_len}; expected q_len = {q_len}, kv_len = {kv_len}"
    )]
    MaskShape {
        /// Index of the mask in the list given to [`crate::Masks`].
        mask: usize,
        /// First batch using it.
        batch: usize,
        /// First query head using it.
        head: usize,
        /// The mask's `q_len`.
        mask_q_len: u64,
        /// The mask's `kv_len`.
        mask_kv_len: u64,
        /// The shape's `q_len`.
        q_len: usize,
        /// The shape's `kv_len`.
        kv_len: usize,
    },

    /// The mask chosen for a `(batch, head)` breaks a [`cm_plan::RowIntervals`] invariant.
    #[error("mask {mask} (used by batch {batch}, head {head}) is invalid: {reason}")]
    InvalidMask {
        /// Index of the mask in the list given to [`crate::Masks`].
        mask: usize,
        /// First batch using it.
        batch: usize,
        /// First query head using it.
        head: usize,
        /// The invariant that failed.
        reason: String,
    },

    /// `softmax_scale` is NaN or infinite.
    #[error("softmax_scale must be finite, got {value}")]
    NonFiniteScale {
        /// The scale given.
        value: f64,
    },

    /// A sink logit is NaN or `+inf`; `-inf` is allowed (that head has no sink).
    #[error(
        "{tensor}[{head}] of [num_heads] is {value}; a sink must be finite, or -inf for no sink"
    )]
    BadSink {
        /// The sinks tensor's name in the program.
        tensor: String,
        /// The 0-based head.
        head: usize,
        /// The logit given.
        value: f64,
    },

    /// An input element is NaN or infinite; the reference would otherwise emit NaN.
    #[error("{tensor}[{at}] of {dims} is {value}; inputs must be finite")]
    NonFiniteInput {
        /// The tensor's name (`q`, `k`, `v`, `dout`, `dlse`, or a score tensor's).
        tensor: String,
        /// Flat (row-major) 0-based index of the element.
        index: usize,
        /// The element's 0-based index along each dimension, `0, 1, 3, 2`.
        at: String,
        /// The tensor's dimensions by name, `[batch, num_heads, q_len, head_dim]`.
        dims: &'static str,
        /// The element, widened to `f64`.
        value: f64,
    },

    /// A scaled logit (with its score terms) is not finite in the tensors' element type, so
    /// the softmax of the row (and its lse) cannot be represented: the same in `f32` and
    /// `f64`, never an `inf` in the output.
    #[error(
        "scaled logit of batch {batch}, head {head}, query row {row} is {value:e}, not finite in {dtype}; \
         reduce softmax_scale, the input magnitudes or the score terms"
    )]
    LogitOverflow {
        /// The logit, computed in `f64`.
        value: f64,
        /// The element type it had to fit, `f32` or `f64`.
        dtype: &'static str,
        /// Batch of the row.
        batch: usize,
        /// Query head of the row.
        head: usize,
        /// Query row (0-based).
        row: usize,
    },

    /// A score tensor (a bias table or the sinks) was needed and not given, or given where
    /// the score terms have none.
    #[error("the score terms {needs} tensor `{tensor}` ({what}), but {given}")]
    ScoreTensor {
        /// The tensor's name in the program (or `table` / `sink` when the terms have none).
        tensor: String,
        /// `bias table` or `sinks`.
        what: &'static str,
        /// `read` or `do not read`.
        needs: &'static str,
        /// What was given instead.
        given: String,
    },

    /// A score tensor has the wrong number of elements.
    #[error("score tensor `{tensor}` has {actual} elements, expected {expected} = {dims}")]
    ScoreTensorLength {
        /// The tensor's name in the program.
        tensor: String,
        /// Its extents in named dimensions, e.g. `[num_heads, num_buckets] = [8, 32]`.
        dims: String,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        actual: usize,
    },

    /// The score terms were bound for other lengths or heads than the shape's.
    #[error("the score terms were bound for {what} = {bound}, but the shape has {given}; plan again for these tensors")]
    ScoreTermsMismatch {
        /// `num_heads` (slopes) or `q_len + kv_len - 1` (buckets).
        what: &'static str,
        /// The value the terms hold.
        bound: usize,
        /// The shape's value.
        given: usize,
    },
}
