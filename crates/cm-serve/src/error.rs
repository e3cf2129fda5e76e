//! Why a step could not be planned, or why its arrays or a paged attention call were
//! refused. Messages name the offending value and what was expected; indices are 0-based.

use cm_ir::PlanError;

/// A step that cannot be planned, or step arrays that break the contract of
/// [`crate::StepPlan`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// No sequence at all.
    #[error("a step needs at least one sequence, got none")]
    NoSequences,

    /// The per-sequence lists differ in length.
    #[error("{what} has {given} entries for {num_seqs} sequences; give one per sequence")]
    CountMismatch {
        /// The list at fault (`kv_len`, `new_tokens`, `params`).
        what: &'static str,
        /// Its entries.
        given: usize,
        /// The sequences of the step (the entries of `q_len`).
        num_seqs: usize,
    },

    /// A sequence without new rows.
    #[error(
        "q_len[{seq}] = {q_len}: every sequence of a step has at least one new row (q_len >= 1)"
    )]
    NoNewRows {
        /// The sequence.
        seq: usize,
        /// Its `q_len`.
        q_len: i64,
    },

    /// A sequence that gains no token in [`crate::Step::append`].
    #[error(
        "new_tokens[{seq}] = {new_tokens}: every sequence gains at least one new token \
         (new_tokens >= 1), which is its new row"
    )]
    NoNewTokens {
        /// The sequence.
        seq: usize,
        /// Its count.
        new_tokens: i64,
    },

    /// [`crate::Step::append`] of more tokens than a sequence can grow by.
    #[error(
        "new_tokens[{seq}] = {new_tokens} would take kv_len[{seq}] = {kv_len} past the \
         longest supported sequence, {max} keys"
    )]
    AppendPastMax {
        /// The sequence.
        seq: usize,
        /// Its count.
        new_tokens: i64,
        /// Its `kv_len` before the append.
        kv_len: i64,
        /// The longest supported sequence (`cm_ir::bind::MAX_LEN`).
        max: i64,
    },

    /// More new rows than keys: `kv_len` counts the new tokens too.
    #[error(
        "q_len[{seq}] = {q_len} is more than kv_len[{seq}] = {kv_len}: kv_len counts the \
         cached keys including the new tokens, so q_len <= kv_len"
    )]
    MoreRowsThanKeys {
        /// The sequence.
        seq: usize,
        /// Its `q_len`.
        q_len: i64,
        /// Its `kv_len`.
        kv_len: i64,
    },

    /// A `kv_len` outside `1 ..= max`.
    #[error("kv_len[{seq}] = {kv_len} is out of range; expected 1 ..= {max}")]
    KvLenOutOfRange {
        /// The sequence.
        seq: usize,
        /// Its `kv_len`.
        kv_len: i64,
        /// The longest supported sequence (`cm_ir::bind::MAX_LEN`).
        max: i64,
    },

    /// More sequences than a program can index as its batch.
    #[error("the step has {num_seqs} sequences; at most {max} are supported")]
    TooManySequences {
        /// Sequences given.
        num_seqs: usize,
        /// The limit (`cm_ir::bind::MAX_BATCH`).
        max: usize,
    },

    /// More query rows than an `i32` array can index.
    #[error("the step holds {total_q} query rows in all; at most {max} fit the int32 arrays")]
    TooManyRows {
        /// The sum of `q_len`.
        total_q: i64,
        /// The limit.
        max: i64,
    },

    /// A prefill layout ([`crate::StepPlan::prefill`]) spanning more virtual keys or rows
    /// than the forward kernels index.
    #[error(
        "the step's sequences, each padded to whole blocks, span {count} {what}; at most {max} \
         fit the forward kernels' indices"
    )]
    PrefillTooLarge {
        /// `"keys"` or `"rows"`.
        what: &'static str,
        /// The virtual keys or rows the layout needs.
        count: u64,
        /// The limit ([`crate::MAX_PREFILL_KEYS`]).
        max: u64,
    },

    /// A prefill layout of more key blocks than [`crate::MAX_PREFILL_KEY_BLOCKS`] (small
    /// `key_block`s over long caches).
    #[error(
        "the step's sequences span {blocks} key blocks of {key_block} keys; at most {max} \
         (a larger key_block makes fewer)"
    )]
    PrefillTooManyBlocks {
        /// The key blocks the layout needs.
        blocks: u64,
        /// Keys per block, as asked.
        key_block: u32,
        /// The limit.
        max: u64,
    },

    /// A prefill layout whose sequences could see more tiles than
    /// [`crate::MAX_PREFILL_TILES`] (each sequence's row blocks times its key blocks).
    #[error(
        "the step's sequences span up to {tiles} tiles of {row_block} x {key_block}; at most \
         {max} (the tile descriptor would outgrow memory: take the step in smaller chunks)"
    )]
    PrefillTooManyTiles {
        /// Each sequence's row blocks times its key blocks, summed.
        tiles: u64,
        /// Rows per block, as asked.
        row_block: u32,
        /// Keys per block, as asked.
        key_block: u32,
        /// The limit.
        max: u64,
    },

    /// More intervals than [`crate::MAX_STEP_INTERVALS`].
    #[error("the step's rows hold more than {max} intervals")]
    TooManyIntervals {
        /// The limit.
        max: usize,
    },

    /// The program reads the head index: a step has one mask for every head.
    #[error(
        "the mask reads the head index `h`, but a serving step has one mask for every head \
         (per-head masks are not supported in serving steps)"
    )]
    PerHeadMask,

    /// The program reads `num_heads`, which a step binds when it is planned, and none was
    /// given ([`crate::StepPlanner::with_num_heads`]).
    #[error(
        "the program reads `num_heads`, which a serving step binds when it is planned: give the \
         query heads the step will run with (StepPlanner::with_num_heads; Python: \
         plan_step(..., num_heads=H))"
    )]
    NumHeadsNeeded,

    /// The program has score terms, which the step's rows cannot carry.
    #[error(
        "the program has a `score` or `sink` statement, but a serving step carries key \
         intervals only (no score terms): use a program without them"
    )]
    ScoreTerms,

    /// Binding or solving one sequence failed; the error's message names the sequence and
    /// its lengths, and its span (if any) points into the program's source.
    #[error("{0}")]
    Plan(PlanError),

    /// Step arrays given from outside ([`crate::StepPlan::from_parts`]) that break the
    /// contract.
    #[error("{array}: {message}")]
    BadArray {
        /// The array (`cu_q`, `kv_len`, `row_ptr`, `intervals`).
        array: &'static str,
        /// What is wrong, naming the index and value.
        message: String,
    },
}

/// Why [`crate::paged_attention`] refused its inputs.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PagedError {
    /// A dimension of zero where at least one is needed.
    #[error("{what} = 0; it must be at least 1")]
    Zero {
        /// The dimension (`num_heads`, `num_kv_heads`, `head_dim`, `head_dim_v`,
        /// `page_size`).
        what: &'static str,
    },

    /// `num_heads` is not a multiple of `num_kv_heads`.
    #[error(
        "num_heads = {num_heads} is not a multiple of num_kv_heads = {num_kv_heads}; GQA / MQA \
         needs num_heads / num_kv_heads query heads per kv head"
    )]
    HeadsNotDivisible {
        /// Query heads.
        num_heads: usize,
        /// Key/value heads.
        num_kv_heads: usize,
    },

    /// A tensor with the wrong number of elements.
    #[error("{tensor} has {actual} elements, expected {expected} = {dims}")]
    Length {
        /// `q`, `k_cache`, `v_cache`, `block_table`.
        tensor: &'static str,
        /// Its shape in named dimensions.
        dims: &'static str,
        /// Elements the shapes call for.
        expected: usize,
        /// Elements given.
        actual: usize,
    },

    /// An element count that overflows `usize`.
    #[error("the element count of {tensor} overflows usize")]
    Overflow {
        /// The tensor.
        tensor: &'static str,
    },

    /// A sequence needs more pages than a row of the block table holds.
    #[error(
        "sequence {seq} has kv_len = {kv_len}, which needs {needed} pages of {page_size} \
         slots, but the block table has max_pages_per_seq = {max_pages_per_seq}"
    )]
    TooFewPages {
        /// The sequence.
        seq: usize,
        /// Its `kv_len`.
        kv_len: usize,
        /// `ceil(kv_len / page_size)`.
        needed: usize,
        /// Slots per page.
        page_size: usize,
        /// Columns of the block table.
        max_pages_per_seq: usize,
    },

    /// A block table entry a sequence uses that names no page.
    #[error(
        "block_table[{seq}][{index}] = {page} is out of range; sequence {seq} reads it, so it \
         must name a page of the cache, in [0, num_pages) = [0, {num_pages})"
    )]
    PageOutOfRange {
        /// The sequence.
        seq: usize,
        /// The column.
        index: usize,
        /// The entry.
        page: i64,
        /// Pages of the cache.
        num_pages: usize,
    },

    /// A non-finite softmax scale.
    #[error("softmax_scale = {0} is not finite")]
    Scale(f64),

    /// A cache or query element the step reads is NaN or infinite (the reference would
    /// otherwise emit NaN): named by where it is in the tensor the caller gave.
    #[error(
        "{tensor}[{index}] (sequence {seq}, {what}) is {value}; the reference needs finite inputs"
    )]
    NonFiniteInput {
        /// The sequence that reads it.
        seq: usize,
        /// `q`, `k_cache` or `v_cache`.
        tensor: &'static str,
        /// Its index in that tensor, e.g. `5, 3, 0, 7` (page, slot, kv head, element).
        index: String,
        /// What it is to the sequence, e.g. `position 83`.
        what: String,
        /// The element, widened to `f64`.
        value: f64,
    },

    /// The attention reference refused a sequence's gathered inputs.
    #[error("sequence {seq}: {error}")]
    Reference {
        /// The sequence.
        seq: usize,
        /// What the reference said.
        error: cm_reference::ReferenceError,
    },
}
