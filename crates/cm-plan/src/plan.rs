//! The planning driver: a bound program becomes a [`Plan`], one [`MaskPlan`] (row
//! intervals + tile descriptor) per distinct (batch, head) mask, shared where equal.

use crate::order::{choose_grid_order, computed_pairs, permute_rows, Candidate, TokenOrder};
use crate::packed::Packing;
use crate::rows::{ExpandError, KeyInterval, RowIntervals};
use crate::symbolic::{
    has_strided, Affine, AffineInterval, Flow, Piece, Solver, MAX_ELEMENTWISE_PAIRS,
};
use crate::tiles::{TileCounts, TileDescriptor, TileShape, MAX_KERNEL_BLOCK_M};
use cm_ir::ir::Region;
use cm_ir::{Bound, PResult, PlanError, ScoreTerms};
use cm_syntax::{Code, Span};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Most intervals one plan may hold (8 bytes each), so a pathological mask fails with a
/// clear error instead of exhausting memory.
pub const MAX_INTERVALS: usize = 1 << 27;

/// CM0404 for a mask whose rows would hold more than [`MAX_INTERVALS`] intervals.
pub(crate) fn too_many_intervals() -> PlanError {
    PlanError::new(
        Code::TooLargeToPlan,
        None,
        format!("the mask needs more than {MAX_INTERVALS} intervals"),
    )
}

/// Most bytes the row arrays (4 per row offset, 8 per interval, 4 per stride) of a plan's
/// distinct masks may hold together, 2 GiB: more than one mask holds at its own limits
/// (`2^26 + 1` row offsets, [`MAX_INTERVALS`] intervals and their strides, 1.75 GiB), so it
/// bounds plans of many distinct masks (a mask that reads `h` or `b` is planned once per
/// distinct (batch, head)), which fail with CM0404 instead of exhausting memory.
pub const MAX_PLAN_ROW_BYTES: usize = 1 << 31;

/// The running total of a plan's distinct masks' row bytes against a limit
/// ([`MAX_PLAN_ROW_BYTES`] by default).
pub(crate) struct RowBudget {
    bytes: usize,
    masks: usize,
    limit: usize,
}

impl Default for RowBudget {
    fn default() -> Self {
        RowBudget {
            bytes: 0,
            masks: 0,
            limit: MAX_PLAN_ROW_BYTES,
        }
    }
}

impl RowBudget {
    /// Counts one more distinct mask's rows; CM0404 past the limit.
    pub(crate) fn take(&mut self, rows: &RowIntervals) -> PResult<()> {
        self.bytes = self.bytes.saturating_add(rows.bytes());
        self.masks += 1;
        if self.bytes > self.limit {
            return Err(PlanError::new(
                Code::TooLargeToPlan,
                None,
                format!(
                    "the plan's distinct masks need more than {} bytes of row intervals in all ({} distinct masks so far, {} rows each)",
                    self.limit,
                    self.masks,
                    rows.q_len()
                ),
            )
            .with_hint("a mask that reads `h` or `b` is planned once per distinct (batch, head) mask: plan fewer heads or batch indices, or shorter sequences"));
        }
        Ok(())
    }
}

/// The distinct masks a plan holds so far, found by their rows' hash and compared with the
/// stored masks themselves, so that no mask's rows are held twice (a key of its own per mask
/// doubled a plan's memory, past what [`RowBudget`] counts).
#[derive(Default)]
pub(crate) struct DistinctMasks {
    by_hash: HashMap<u64, Vec<u32>>,
}

impl DistinctMasks {
    /// The id of the mask in `masks` whose rows equal `rows`, or the hash to [`insert`] them
    /// under.
    ///
    /// [`insert`]: DistinctMasks::insert
    pub(crate) fn find(&self, rows: &RowIntervals, masks: &[MaskPlan]) -> Result<u32, u64> {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        rows.hash(&mut hasher);
        let hash = hasher.finish();
        self.by_hash
            .get(&hash)
            .and_then(|ids| {
                ids.iter()
                    .copied()
                    .find(|&id| masks[id as usize].rows == *rows)
            })
            .ok_or(hash)
    }

    /// Records mask `id` under the `hash` that [`DistinctMasks::find`] gave for its rows.
    pub(crate) fn insert(&mut self, hash: u64, id: u32) {
        self.by_hash.entry(hash).or_default().push(id);
    }
}

/// Most forward tile-list entries (plus per-row data of partial tiles) one mask may need,
/// so tiny tiles on long sequences fail clearly instead of exhausting memory.
pub const MAX_TILE_ENTRIES: usize = 1 << 26;

/// The descriptor of rows in a token order other than the program's: the solver's pieces no
/// longer describe them, so their affine runs are searched first. `Err` as
/// [`TileDescriptor::try_build_runs`]'s.
fn tiles_in_order(rows: &RowIntervals, tile: TileShape) -> Result<TileDescriptor, usize> {
    let runs = rows.affine_runs();
    TileDescriptor::try_build_runs(rows, &runs, tile, MAX_TILE_ENTRIES)
}

/// CM0404 for a mask whose descriptor at `tile` would exceed [`MAX_TILE_ENTRIES`] (the
/// builder stops counting there, so no total is known).
pub(crate) fn too_many_tile_entries(tile: TileShape) -> PlanError {
    PlanError::new(
        Code::TooLargeToPlan,
        None,
        format!(
            "the tile descriptor needs more than {MAX_TILE_ENTRIES} entries at {}x{} tiles",
            tile.block_m, tile.block_n
        ),
    )
    .with_hint(if tile.block_m > MAX_KERNEL_BLOCK_M {
        // Past the kernels' tallest block the per-row entries no longer shrink with more
        // tiles: each partial tile holds a row entry per row of the (clamped) block.
        format!(
            "it holds one entry per non-empty tile plus one per row of each partial tile: use \
             block_m <= {MAX_KERNEL_BLOCK_M}, a wider block_n, or shorter sequences"
        )
    } else {
        "it holds one entry per non-empty tile plus one per row of each partial tile: use \
         larger tiles or shorter sequences (for scale: a causal mask fits about 1.4M rows at 128x128 tiles)"
            .to_string()
    })
}

/// `CM0412` for strided rows a consumer without strides cannot take expanded.
pub fn expand_error(e: ExpandError) -> PlanError {
    PlanError::new(Code::StridesTooMany, None, e.to_string()).with_hint(
        "plan the strided mask (a dilated window) at shorter lengths for this use, or use a \
         consumer that reads strided runs (the plan's rows and tiles, its statistics, `intervals`)",
    )
}

/// The compiled form of one distinct mask.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MaskPlan {
    pub rows: RowIntervals,
    pub tiles: TileDescriptor,
}

/// A complete plan: every distinct mask's row intervals and tile descriptor, and which
/// one each (batch, head) uses.
#[derive(Clone, Debug)]
pub struct Plan {
    pub q_len: u32,
    pub kv_len: u32,
    pub batch: u32,
    pub num_heads: u32,
    pub tile: TileShape,
    pub masks: Vec<MaskPlan>,
    /// `[batch, num_heads]` row-major: index into `masks`.
    pub mask_index: Vec<u32>,
    /// Whether the masks depend on the batch / the heads: read the index `b` (`h`) or the
    /// length `batch` (`num_heads`). A plan of batch 1 (num_heads 1) whose masks do not
    /// applies to every batch (head) of the tensors, as PyTorch broadcasts a size-1
    /// dimension; one whose masks do, only to the batch (heads) it was planned for, even
    /// when all of them have one mask.
    pub uses_batch: bool,
    pub uses_head: bool,
    /// (q, k) pairs evaluated one by one in `elementwise(...)` regions (0 when the whole
    /// mask was solved analytically).
    pub elementwise_pairs: u64,
    /// Pieces (runs of rows with affine interval endpoints) the solver used.
    pub pieces: u64,
    /// The token order the masks are planned in (`None`: the program's own positions).
    pub order: Option<TokenOrder>,
    /// With `--order auto`: every candidate order's computed pairs, best first.
    pub order_candidates: Vec<Candidate>,
    /// Computed pairs of the first mask in the program's own order (for comparison).
    pub raster_computed_pairs: u64,
    /// For a packed plan ([`crate::plan_packed`]): the samples' offsets. The plan is then a
    /// batch-1 plan over `q_len = total_q` rows and `kv_len = total_k` keys.
    pub packing: Option<Packing>,
    /// The score terms at the plan's lengths and `num_heads` (softcap, linear bias, bias
    /// table, sink; see `cm_ir::score`), in the plan's positions; `None` when the program
    /// has no `score` or `sink` statement (never terms that are all absent).
    pub score: Option<ScoreTerms>,
    /// The program's trees that reach past `q_len` or `kv_len`, in declaration order (for
    /// the plan-time warning `CM0266`).
    pub tree_overhangs: Vec<TreeOverhang>,
}

/// A tree some of whose nodes lie past the lengths it was laid out for: a node past `q_len`
/// has no query row, one past `kv_len` is no key. The language lets such positions
/// contribute nothing, which is rarely what was meant. A tree laid out per batch index
/// (its parents or offset read `b`), or per packed sample (each at its own lengths), is
/// shown at the one whose tree has the most nodes outside.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeOverhang {
    /// The tree's index among the program's trees, in declaration order.
    pub tree: usize,
    /// The batch index (packed sample) shown.
    pub b: u32,
    /// Its nodes, at positions `at .. at + nodes`.
    pub nodes: u64,
    pub at: i64,
    /// The lengths it was laid out for (for a packed sample, the sample's own).
    pub q_len: u32,
    pub kv_len: u32,
    /// How many of the `checked` batch indices (packed samples) it was laid out for have
    /// nodes outside; `checked` is 1 for a tree that is the same at every batch index.
    pub batches: u32,
    pub checked: u32,
}

/// Nodes of a tree of `nodes` nodes from position `at` that lie at positions `>= len`.
fn nodes_past(at: i64, nodes: u64, len: u32) -> u64 {
    // `TreeTable::build` refuses a tree whose end overflows, so the sum fits.
    let end = at + nodes as i64;
    (end - at.max(i64::from(len))).max(0) as u64
}

impl TreeOverhang {
    /// Nodes at positions `>= q_len`: they have no query row.
    pub fn past_q_len(&self) -> u64 {
        nodes_past(self.at, self.nodes, self.q_len)
    }

    /// Nodes at positions `>= kv_len`: they are no key.
    pub fn past_kv_len(&self) -> u64 {
        nodes_past(self.at, self.nodes, self.kv_len)
    }

    /// Nodes past either length.
    pub fn outside(&self) -> u64 {
        nodes_past(self.at, self.nodes, self.q_len.min(self.kv_len))
    }
}

/// The [`TreeOverhang`]s of a plan, gathered over the batch indices (packed samples) its
/// trees are laid out for.
#[derive(Default)]
pub(crate) struct TreeOverhangs {
    /// Per tree: the overhang with the most nodes outside so far, and how many batch
    /// indices were checked.
    trees: Vec<(Option<TreeOverhang>, u32)>,
}

impl TreeOverhangs {
    /// Looks at the trees of `bound`, laid out for batch index (packed sample) `b`;
    /// `only_per_batch` skips the trees that read no `b`, which another index showed.
    pub(crate) fn see(&mut self, bound: &Bound<'_>, b: u32, only_per_batch: bool) {
        let decls = &bound.program.trees;
        self.trees.resize(bound.trees.len(), (None, 0));
        for (i, (table, decl)) in bound.trees.iter().zip(decls).enumerate() {
            if only_per_batch && !decl.per_batch {
                continue;
            }
            let (best, checked) = &mut self.trees[i];
            *checked += 1;
            let seen = TreeOverhang {
                tree: i,
                b,
                nodes: table.len() as u64,
                at: table.at,
                q_len: bound.shape.q_len as u32,
                kv_len: bound.shape.kv_len as u32,
                batches: 0,
                checked: 0,
            };
            if seen.outside() == 0 {
                continue;
            }
            let batches = best.as_ref().map_or(0, |o| o.batches) + 1;
            // Ties keep the earliest batch index.
            let shown = match best.take() {
                Some(o) if o.outside() >= seen.outside() => o,
                _ => seen,
            };
            *best = Some(TreeOverhang { batches, ..shown });
        }
    }

    /// The overhangs, one per tree that has one, in declaration order.
    pub(crate) fn finish(self) -> Vec<TreeOverhang> {
        self.trees
            .into_iter()
            .filter_map(|(o, checked)| o.map(|o| TreeOverhang { checked, ..o }))
            .collect()
    }
}

/// Which token order to plan in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OrderRequest {
    /// The program's own positions.
    Raster,
    /// The best patch order of the program's first grid (see [`crate::order`]); without a
    /// grid, the first tree's depth-first preorder when it computes fewer pairs than the
    /// program's positions (else those positions: the plan has no order).
    Auto,
    /// An explicit permutation: `order[new] = original`.
    Explicit(Vec<u32>),
}

impl Plan {
    /// The mask used by batch `b`, head `h` (0-based).
    ///
    /// # Panics
    /// If `b >= batch` or `h >= num_heads`, as slice indexing does (the message names both).
    pub fn mask(&self, b: u32, h: u32) -> &MaskPlan {
        assert!(
            b < self.batch && h < self.num_heads,
            "mask(b = {b}, h = {h}) of a plan of batch {} and num_heads {}",
            self.batch,
            self.num_heads
        );
        let at = b as usize * self.num_heads as usize + h as usize;
        &self.masks[self.mask_index[at] as usize]
    }

    /// `f` of each (batch, head)'s mask, summed; `f` runs once per distinct mask, so the
    /// cost does not grow with `batch * num_heads`.
    fn sum<T: Into<u64>>(&self, f: impl Fn(&MaskPlan) -> T) -> u64 {
        self.uses()
            .zip(&self.masks)
            .map(|(n, m)| n * f(m).into())
            .sum()
    }

    /// How many (batch, head) pairs use each distinct mask, in `masks` order.
    fn uses(&self) -> impl Iterator<Item = u64> {
        let mut n = vec![0u64; self.masks.len()];
        for &i in &self.mask_index {
            n[i as usize] += 1;
        }
        n.into_iter()
    }

    /// Visible (q, k) pairs, summed over every (batch, head).
    pub fn visible_pairs(&self) -> u64 {
        self.sum(|m| m.rows.visible_pairs())
    }

    /// Rows with no visible key, summed over every (batch, head).
    pub fn empty_rows(&self) -> u64 {
        self.sum(|m| m.rows.empty_rows())
    }

    pub fn max_intervals_per_row(&self) -> u32 {
        self.masks
            .iter()
            .map(|m| m.rows.max_intervals_per_row())
            .max()
            .unwrap_or(0)
    }

    /// Tile counts, summed over every (batch, head).
    pub fn tile_counts(&self) -> TileCounts {
        let mut t = TileCounts::default();
        for (n, m) in self.uses().zip(&self.masks) {
            let c = m.tiles.counts();
            t.full += n * c.full;
            t.partial += n * c.partial;
            t.empty += n * c.empty;
        }
        t
    }

    pub fn computed_pairs(&self) -> u64 {
        self.sum(|m| m.tiles.computed_pairs)
    }

    /// Bytes of everything a kernel reads: each distinct mask's descriptor and intervals,
    /// plus the `[batch, num_heads]` index when there is more than one mask.
    pub fn descriptor_bytes(&self) -> u64 {
        let own: usize = self.masks.iter().map(|m| m.tiles.bytes(&m.rows)).sum();
        let index = if self.masks.len() > 1 {
            self.mask_index.len() * 4
        } else {
            0
        };
        (own + index) as u64
    }
}

/// Solves every row of one (batch, head) mask.
pub fn row_intervals(
    solver: &Solver<'_, '_>,
    b: i64,
    h: i64,
    pieces: &mut u64,
) -> PResult<RowIntervals> {
    row_intervals_runs(solver, b, h, pieces, &mut Vec::new())
}

/// As [`row_intervals`], also reporting the first row of every piece in `runs` (cleared
/// first): within a piece every row has the same number of intervals and every endpoint is
/// affine in the row, what [`TileDescriptor::try_build_runs`] needs.
pub fn row_intervals_runs(
    solver: &Solver<'_, '_>,
    b: i64,
    h: i64,
    pieces: &mut u64,
    runs: &mut Vec<u32>,
) -> PResult<RowIntervals> {
    runs.clear();
    let shape = solver.bound.shape;
    let program = solver.bound.program;
    let (q_len, kv_len) = (shape.q_len as u32, shape.kv_len as u32);
    check_pairs_up_front(solver, b, h, 0..shape.q_len)?;
    if program.mask.uses_elementwise() && shape.q_len >= PARALLEL_ROWS {
        return solve_in_parallel(solver, b, h, pieces, runs);
    }
    let mut sink = RowSink::new(q_len, kv_len, true, std::mem::take(runs));
    solve_rows(
        solver,
        (b, h),
        0..shape.q_len,
        usize::MAX,
        &AtomicUsize::new(0),
        &mut sink,
    )?;
    *pieces += sink.pieces;
    let rows;
    (rows, *runs) = sink.finish();
    Ok(rows)
}

/// The `elementwise` of a mask that holds exactly one, outside every `any` / `all`: the
/// mask whose evaluated pairs [`elementwise_pairs_up_front`] counts exactly.
fn lone_elementwise(mask: &Region) -> Option<Span> {
    let mut found = None;
    let mut stack = vec![mask];
    while let Some(r) = stack.pop() {
        match r {
            Region::Elementwise(_, span) if found.is_none() => found = Some(*span),
            Region::Elementwise(..) => return None,
            Region::Quant { body, .. } if body.uses_elementwise() => return None,
            Region::Union(a, b)
            | Region::Inter(a, b)
            | Region::Diff(a, b)
            | Region::Cond(_, a, b) => stack.extend([&**a, &**b]),
            Region::Not(a) => stack.push(a),
            _ => {}
        }
    }
    found
}

/// The (q, k) pairs the mask's `elementwise` would evaluate one by one on rows `rows`
/// (half-open, program positions) of the mask of batch index `b`, head `h`, counted
/// without evaluating any ([`Solver::counting`]: the rows solved with every predicate
/// taken to hold, in O(rows x intervals)). `None` unless the mask holds exactly one
/// `elementwise`, outside every `any` / `all` (then where it is evaluated depends on no
/// predicate's value, so the count is the one planning makes), or when counting meets a
/// plan-time error (planning reports it).
pub fn elementwise_pairs_up_front(
    bound: &Bound<'_>,
    b: i64,
    h: i64,
    rows: std::ops::Range<i64>,
) -> Option<u64> {
    lone_elementwise(&bound.program.mask)?;
    let counter = Solver::counting(bound);
    let counted = solve_rows(
        &counter,
        (b, h),
        rows,
        usize::MAX,
        &AtomicUsize::new(0),
        &mut Discard,
    );
    counted.ok().map(|()| counter.elementwise_pairs.get())
}

/// CM0404 before any pair is evaluated when the mask's one `elementwise` would take the
/// plan's pairs (those of `solver` so far and those of rows `rows` of (b, h), counted by
/// [`elementwise_pairs_up_front`]) past [`MAX_ELEMENTWISE_PAIRS`], naming the count. Rows
/// that cannot reach the limit however many pairs they evaluate are not counted.
fn check_pairs_up_front(
    solver: &Solver<'_, '_>,
    b: i64,
    h: i64,
    rows: std::ops::Range<i64>,
) -> PResult<()> {
    let bound = solver.bound;
    let Some(span) = lone_elementwise(&bound.program.mask) else {
        return Ok(());
    };
    let so_far = solver.elementwise_pairs.get();
    let most = (rows.end - rows.start) as u64 * bound.shape.kv_len as u64;
    if so_far.saturating_add(most) <= MAX_ELEMENTWISE_PAIRS {
        return Ok(());
    }
    match elementwise_pairs_up_front(bound, b, h, rows) {
        Some(pairs) if so_far.saturating_add(pairs) > MAX_ELEMENTWISE_PAIRS => {
            let total = so_far.saturating_add(pairs);
            Err(PlanError::new(
                Code::TooLargeToPlan,
                Some(span),
                format!("`elementwise` would evaluate {total} (q, k) pairs one by one, more than the limit of {MAX_ELEMENTWISE_PAIRS} per plan"),
            )
            .with_hint("narrow it with a solvable region, e.g. `q - 512 < k <= q & elementwise(...)`, or write the rule in solvable forms"))
        }
        _ => Ok(()),
    }
}

/// A sink that keeps nothing: the counting solve of [`elementwise_pairs_up_front`].
struct Discard;

impl PieceSink for Discard {
    fn piece(&mut self, _: i64, _: i64, _: &[AffineInterval]) {}
}

/// Checks that `rows` lies inside the bound program's rows `[0, q_len)`.
fn check_row_range(solver: &Solver<'_, '_>, rows: &std::ops::Range<i64>) -> PResult<()> {
    let q_len = solver.bound.shape.q_len;
    if rows.start < 0 || rows.start > rows.end || rows.end > q_len {
        return Err(PlanError::new(
            Code::LengthOutOfRange,
            None,
            format!(
                "rows {}..{} are not a range inside the program's rows 0..{q_len} (q_len = {q_len})",
                rows.start, rows.end
            ),
        ));
    }
    Ok(())
}

/// Solves the rows `rows` of one (batch, head) mask alone, in program positions
/// (`0 <= rows.start <= rows.end <= q_len`, half-open): the returned [`RowIntervals`] has
/// `rows.end - rows.start` rows over the bound program's `kv_len` keys, its row `i` being
/// the program's row `rows.start + i`, exactly as [`row_intervals`] gives it. Cost
/// O(pieces x intervals) of those rows: the rows before `rows.start` are never solved (what
/// a serving step needs for the new rows of a long sequence). A mask with `elementwise` is
/// solved on the calling thread whatever the row count. `pieces` counts the solver's
/// pieces.
///
/// # Errors
/// `CM0402` for a range outside `[0, q_len]`; any plan-time error of those rows (another
/// row's error is not raised).
pub fn row_range_intervals(
    solver: &Solver<'_, '_>,
    b: i64,
    h: i64,
    rows: std::ops::Range<i64>,
    pieces: &mut u64,
) -> PResult<RowIntervals> {
    check_row_range(solver, &rows)?;
    check_pairs_up_front(solver, b, h, rows.clone())?;
    let n = (rows.end - rows.start) as u32;
    let kv_len = solver.bound.shape.kv_len as u32;
    let mut sink = RowSink::new(n, kv_len, true, Vec::new());
    solve_rows(
        solver,
        (b, h),
        rows,
        usize::MAX,
        &AtomicUsize::new(0),
        &mut sink,
    )?;
    *pieces += sink.pieces;
    Ok(sink.finish().0)
}

/// Rows `q0 .. q0 + n` (program positions) whose runs are affine in the row: row `q0 + t`
/// holds, for every run, the keys `[start.at(t), end.at(t))` with its `stride` (1: a plain
/// interval; above 1 a strided run, see [`crate::rows`]). On every row of the piece the runs
/// are canonical: non-empty, inside `[0, kv_len)`, sorted, maximal.
#[derive(Clone, Debug)]
pub struct AffineRows {
    pub q0: i64,
    pub n: i64,
    pub runs: Vec<AffineInterval>,
}

impl PieceSink for Option<AffineRows> {
    fn piece(&mut self, q0: i64, n: i64, list: &[AffineInterval]) {
        // A one-row piece has no slope to report.
        let flat = |a: Affine| Affine {
            first: a.first,
            step: if n > 1 { a.step } else { 0 },
        };
        *self = Some(AffineRows {
            q0,
            n,
            runs: list
                .iter()
                .map(|iv| AffineInterval {
                    start: flat(iv.start),
                    end: flat(iv.end),
                    stride: iv.stride,
                })
                .collect(),
        });
    }
}

/// The solver's first piece of `rows` (`0 <= rows.start < rows.end <= q_len`): the run of
/// rows from `rows.start`, ending at or before `rows.end`, over which every endpoint is
/// affine, as the planner finds it. Cost O(intervals) per evaluation of the piece (a few
/// when the structure changes inside `rows`), independent of the rows before `rows.start`
/// and of how many rows the piece holds.
///
/// # Errors
/// `CM0402` for an empty range or one outside `[0, q_len]`; a plan-time error of the
/// piece's rows.
pub fn first_piece(
    solver: &Solver<'_, '_>,
    b: i64,
    h: i64,
    rows: std::ops::Range<i64>,
) -> PResult<AffineRows> {
    check_row_range(solver, &rows)?;
    if rows.is_empty() {
        return Err(PlanError::new(
            Code::LengthOutOfRange,
            None,
            format!("rows {}..{} hold no row", rows.start, rows.end),
        ));
    }
    let mut first = None;
    solve_rows(solver, (b, h), rows, 1, &AtomicUsize::new(0), &mut first)?;
    Ok(first.expect("a non-empty range has a first piece"))
}

/// Rows from which a mask with `elementwise` is solved in [`ROW_BLOCKS`] blocks of rows on
/// several threads (rayon): its rows are pieces of one row each, evaluated pair by pair.
const PARALLEL_ROWS: i64 = 1024;

/// Blocks of rows of a parallel solve: a fixed number, so the pieces (which end at block
/// edges) do not depend on the machine.
const ROW_BLOCKS: i64 = 64;

/// Solves rows `0..q_len` in [`ROW_BLOCKS`] blocks on several threads, each with a solver of
/// its own, their `elementwise` pairs counted together (`solver.elementwise_pairs` holds
/// the plan's count before, and gets the total), then joins the blocks' rows (pieces
/// counted into `pieces`, their first rows into `runs`). The error is the one of the first
/// failing block in row order, which is the sequential driver's, except past the pair
/// limit, which is reported for the whole plan.
fn solve_in_parallel(
    solver: &Solver<'_, '_>,
    b: i64,
    h: i64,
    pieces: &mut u64,
    runs: &mut Vec<u32>,
) -> PResult<RowIntervals> {
    use rayon::prelude::*;
    use std::sync::atomic::AtomicU64;
    let shape = solver.bound.shape;
    let q_len = shape.q_len;
    let kv_len = shape.kv_len as u32;
    let before = solver.elementwise_pairs.get();
    let shared = AtomicU64::new(before);
    let intervals = AtomicUsize::new(0);
    let size = (q_len + ROW_BLOCKS - 1) / ROW_BLOCKS;
    let ranges: Vec<std::ops::Range<i64>> = (0..q_len)
        .step_by(size as usize)
        .map(|a| a..(a + size).min(q_len))
        .collect();
    let bound = solver.bound;
    let solved: Vec<(PResult<RowSink>, bool)> = ranges
        .into_par_iter()
        .map(|r| {
            let s = Solver::new(bound).with_shared_pairs(&shared);
            // Each block keeps its pieces until all are solved and the rows' array is
            // allocated at its final size.
            let mut sink = RowSink::new((r.end - r.start) as u32, kv_len, false, Vec::new());
            let done = solve_rows(&s, (b, h), r, usize::MAX, &intervals, &mut sink);
            (done.map(|()| sink), s.hit_pair_limit())
        })
        .collect();
    let mut blocks = Vec::with_capacity(solved.len());
    for (block, hit_limit) in solved {
        match block {
            Ok(block) => blocks.push(block),
            Err(_) if hit_limit => return Err(Solver::pair_limit_error(None)),
            Err(e) => return Err(e),
        }
    }
    solver.elementwise_pairs.set(shared.load(Ordering::Relaxed));
    let total = blocks.iter().map(|s| s.total).sum();
    let mut rows = RowIntervals::with_capacity(q_len as u32, kv_len, total);
    for block in blocks {
        block.kept.write_into(&mut rows);
        runs.extend(block.runs);
        *pieces += block.pieces;
    }
    Ok(rows)
}

/// Where the driver puts each solved piece: `n` rows from row `q0` whose runs are `list`,
/// affine in the row.
trait PieceSink {
    fn piece(&mut self, q0: i64, n: i64, list: &[AffineInterval]);
}

/// Pieces kept as their first row's intervals and, for a piece of several rows, their
/// slopes, until the array of the rows is allocated (see [`RowSink`]).
#[derive(Default)]
struct Kept {
    pieces: Vec<KeptPiece>,
    chunks: Vec<Vec<KeyInterval>>,
    strides: Vec<u32>,
    /// Intervals in `chunks`.
    len: usize,
}

/// A kept piece's rows: `n` rows whose first row's intervals are `chunks[chunk][at..at +
/// len]` and, for `n > 1`, whose slopes follow them at `chunks[chunk][at + len..at + 2 *
/// len]`; with `strides: Some(s)`, runs whose strides are `strides[s..s + len]`.
struct KeptPiece {
    n: usize,
    chunk: usize,
    at: usize,
    len: usize,
    strides: Option<usize>,
}

/// The size of the first chunk of kept interval lists, in intervals; each next chunk is
/// twice as large, up to [`LIST_CHUNK_MAX`].
const LIST_CHUNK_MIN: usize = 1 << 10;

/// The largest chunk of kept interval lists (2 MiB, a huge page) unless one piece needs
/// more. The lists are written once into chunks that are never moved: one array grown by
/// doubling copies itself at every doubling and, in a fresh process, faults in the pages of
/// every copy.
const LIST_CHUNK_MAX: usize = 1 << 18;

/// Kept interval lists (first rows and slopes) past which a [`RowSink`] that may switch
/// allocates the rows' array and writes every later piece into it as soon as it is solved
/// (256 KiB of lists).
pub const KEPT_MAX: usize = 1 << 15;

impl Kept {
    /// Keeps a piece of `n` rows whose runs are `list`.
    fn keep(&mut self, n: usize, list: &[AffineInterval]) {
        let need = if n > 1 { 2 * list.len() } else { list.len() };
        let fits = self
            .chunks
            .last()
            .is_some_and(|c| c.capacity() - c.len() >= need);
        if !fits {
            let size = self
                .chunks
                .last()
                .map_or(LIST_CHUNK_MIN, |c| (2 * c.capacity()).min(LIST_CHUNK_MAX));
            self.chunks.push(Vec::with_capacity(size.max(need)));
        }
        let chunk = self.chunks.len() - 1;
        let lists = &mut self.chunks[chunk];
        let at = lists.len();
        first_and_slopes(n, list, lists);
        self.len += need;
        let strides = has_strided(list).then(|| {
            let at = self.strides.len();
            self.strides.extend(list.iter().map(|iv| iv.stride as u32));
            at
        });
        self.pieces.push(KeptPiece {
            n,
            chunk,
            at,
            len: list.len(),
            strides,
        });
    }

    /// Writes every kept piece's rows, in order, after the rows of `rows`.
    fn write_into(&self, rows: &mut RowIntervals) {
        for sp in &self.pieces {
            let list = &self.chunks[sp.chunk][sp.at..];
            let first = &list[..sp.len];
            let step = if sp.n > 1 {
                &list[sp.len..2 * sp.len]
            } else {
                first
            };
            match sp.strides {
                Some(at) => {
                    rows.push_affine_runs(first, step, &self.strides[at..at + sp.len], sp.n)
                }
                None => rows.push_affine_rows(first, step, sp.n),
            }
        }
    }
}

/// Appends a piece's first row's intervals and, for `n > 1` rows, their slopes. Every
/// endpoint is in `[0, kv_len]` on every row of the piece, so the rows follow from the first
/// by adding each endpoint's slope in wrapping `u32` arithmetic.
fn first_and_slopes(n: usize, list: &[AffineInterval], out: &mut Vec<KeyInterval>) {
    out.extend(list.iter().map(|iv| KeyInterval {
        start: iv.start.first as u32,
        end: iv.end.first as u32,
    }));
    if n > 1 {
        out.extend(list.iter().map(|iv| KeyInterval {
            start: iv.start.step as u32,
            end: iv.end.step as u32,
        }));
    }
}

/// The solved rows `0..q_len` of a range (relative to its first row) over `kv_len` keys,
/// with the first row of every piece and the pieces counted.
///
/// The rows' array is allocated once, at its final size, only when every row is solved
/// (growing it piece by piece would copy it at every doubling and, in a fresh process,
/// fault in the pages of every copy), so the pieces are kept until then as their first
/// rows and slopes ([`Kept`]). Keeping them costs pages of its own when they are many (W4's
/// 3424 pieces keep 1.1 MiB): once the kept lists pass [`KEPT_MAX`] intervals, a sink that
/// may switch allocates the array with room for the rows to come as estimated (the rows
/// left, each as wide as twice the widest piece so far; at most what `q_len` rows over
/// `kv_len` keys and [`MAX_INTERVALS`] allow), writes the kept pieces into it and every
/// later piece as soon as it is solved. The room is address space: only the pages written
/// are touched, the rest is given back by [`RowSink::finish`]; a mask whose later rows are
/// wider than estimated grows the array as they come.
struct RowSink {
    q_len: u32,
    kv_len: u32,
    kept: Kept,
    /// The rows' array once allocated.
    rows: Option<RowIntervals>,
    runs: Vec<u32>,
    pieces: u64,
    /// Rows solved, and the intervals they hold.
    done: u64,
    total: usize,
    /// The most runs in a row of any piece so far.
    widest: usize,
    may_switch: bool,
    /// A piece's first row and slopes, and its strides, once the array is allocated;
    /// reused from piece to piece.
    scratch: Vec<KeyInterval>,
    scratch_strides: Vec<u32>,
}

impl RowSink {
    /// A sink for `q_len` rows over `kv_len` keys that switches to writing rows as they are
    /// solved when `may_switch` (see [`RowSink`]); `runs` is reused for the pieces' first
    /// rows.
    fn new(q_len: u32, kv_len: u32, may_switch: bool, runs: Vec<u32>) -> RowSink {
        RowSink {
            q_len,
            kv_len,
            kept: Kept::default(),
            rows: None,
            runs,
            pieces: 0,
            done: 0,
            total: 0,
            widest: 0,
            may_switch,
            scratch: Vec::new(),
            scratch_strides: Vec::new(),
        }
    }

    /// Allocates the rows' array with room for the rows solved so far and `rows_left` more of
    /// at most `per_row` runs each, and writes the kept pieces into it.
    fn allocate(&mut self, rows_left: u64, per_row: u64) {
        let most = u64::from(self.q_len) * u64::from(self.kv_len.div_ceil(2));
        let room = (self.total as u64)
            .saturating_add(rows_left.saturating_mul(per_row))
            .min(most)
            .min(MAX_INTERVALS as u64) as usize;
        let mut rows = RowIntervals::with_capacity(self.q_len, self.kv_len, 0);
        // Short of room for all (the allocator refusing it), the array grows as rows come.
        rows.try_reserve_intervals(room.max(self.total));
        self.kept.write_into(&mut rows);
        self.kept = Kept::default();
        self.rows = Some(rows);
    }

    /// The rows, and the first row of every piece.
    fn finish(mut self) -> (RowIntervals, Vec<u32>) {
        match &mut self.rows {
            Some(rows) => rows.shrink_to_fit(),
            None => self.allocate(0, 0),
        }
        (self.rows.expect("allocated"), self.runs)
    }
}

impl PieceSink for RowSink {
    fn piece(&mut self, q0: i64, n: i64, list: &[AffineInterval]) {
        let n = n as usize;
        self.runs.push(q0 as u32);
        self.pieces += 1;
        self.done += n as u64;
        self.total += n * list.len();
        self.widest = self.widest.max(list.len());
        let Some(rows) = &mut self.rows else {
            self.kept.keep(n, list);
            if self.may_switch && self.kept.len > KEPT_MAX {
                let left = u64::from(self.q_len) - self.done;
                self.allocate(left, 2 * self.widest as u64);
            }
            return;
        };
        self.scratch.clear();
        first_and_slopes(n, list, &mut self.scratch);
        let k = list.len();
        let first = &self.scratch[..k];
        let step = if n > 1 { &self.scratch[k..] } else { first };
        if has_strided(list) {
            self.scratch_strides.clear();
            self.scratch_strides
                .extend(list.iter().map(|iv| iv.stride as u32));
            rows.push_affine_runs(first, step, &self.scratch_strides, n);
        } else {
            rows.push_affine_rows(first, step, n);
        }
    }
}

/// Solves rows `rows` piece by piece into `sink`, counting their intervals into `intervals`
/// (shared by the blocks of a parallel solve) against [`MAX_INTERVALS`] before any is
/// written; stops after `max_pieces` pieces, the rows after them unsolved. The error is the
/// pairwise reference's on the first row where it fails (see [`Solver::exact_row`]).
fn solve_rows(
    solver: &Solver<'_, '_>,
    (b, h): (i64, i64),
    rows: std::ops::Range<i64>,
    max_pieces: usize,
    intervals: &AtomicUsize,
    sink: &mut impl PieceSink,
) -> PResult<()> {
    let mut q0 = rows.start;
    let mut done = 0usize;
    // Rows where evaluation found the structure to change, nearest last: after a piece
    // succeeds, the next one is tried up to the nearest known change, not to the end.
    let mut ends: Vec<i64> = vec![rows.end];
    let mut hints: Vec<i64> = Vec::new();
    while q0 < rows.end && done < max_pieces {
        let mut end = ends.last().copied().unwrap_or(rows.end);
        loop {
            let p = Piece {
                q0,
                n: end - q0,
                b,
                h,
            };
            solver.clear_split_hints();
            let list = match solver.region(&p, &solver.bound.program.mask, None) {
                Ok(list) => list,
                Err(Flow::Split(s)) => {
                    debug_assert!(s > q0 && s < end, "split {s} outside ({q0}, {end})");
                    // Later change points the evaluation already found, nearest last.
                    solver.take_split_hints(&mut hints);
                    ends.extend(hints.iter().rev().filter(|&&x| x > s && x < end));
                    end = s;
                    ends.push(s);
                    continue;
                }
                // A piece's evaluation may fail where the reference does not (on a row of
                // the piece that is not the first, or at keys of a hull the reference
                // skips): halved until a row is evaluated alone, exactly.
                Err(Flow::Error(_)) if p.n > 1 => {
                    end = q0 + p.n / 2;
                    ends.push(end);
                    continue;
                }
                Err(Flow::Error(_)) => solver.exact_row(&p).map_err(|mut e| {
                    let bh = if solver.bound.program.uses_b || solver.bound.program.uses_h {
                        format!(", b = {b}, h = {h}")
                    } else {
                        String::new()
                    };
                    e.message = format!("{} (planning row q = {q0}{bh})", e.message);
                    e
                })?,
            };
            let here = list.len() * p.n as usize;
            if intervals.fetch_add(here, Ordering::Relaxed) + here > MAX_INTERVALS {
                return Err(too_many_intervals());
            }
            sink.piece(q0, p.n, &list);
            done += 1;
            q0 = end;
            while ends.last().is_some_and(|&e| e <= q0) {
                ends.pop();
            }
            break;
        }
    }
    Ok(())
}

/// Plans a bound program at a tile shape, in the program's own positions.
///
/// # Errors
/// `CM0401` for a zero block size; any plan-time error of the mask (with its span).
pub fn plan(bound: &Bound<'_>, tile: TileShape) -> PResult<Plan> {
    plan_in_order(bound, tile, &OrderRequest::Raster)
}

/// Plans a bound program at a tile shape in a token order (queries and keys permuted
/// together). Row `i` of each mask is the program's row `order[i]` with keys renumbered.
///
/// # Errors
/// As [`plan`]; `CM0405` when an order is asked for with `q_len != kv_len`, `CM0406` for
/// `Auto` on a mask without a grid, `CM0407` for an explicit order that is not a
/// permutation of `[0, q_len)`.
pub fn plan_in_order(bound: &Bound<'_>, tile: TileShape, request: &OrderRequest) -> PResult<Plan> {
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
    let shape = bound.shape;
    if *request != OrderRequest::Raster
        && bound
            .score
            .as_ref()
            .is_some_and(ScoreTerms::reads_positions)
    {
        return Err(PlanError::new(
            Code::PositionalScore,
            bound.program.score.as_ref().map(|s| s.span),
            "the score reads positions (a bias of q and k, or a bias table), which a token order renumbers",
        )
        .with_hint("plan in the program's own order (raster); softcaps and sinks combine with any order"));
    }
    if *request != OrderRequest::Raster && shape.q_len != shape.kv_len {
        return Err(PlanError::new(Code::OrderNeedsEqualLengths, None, format!("a token order permutes queries and keys together; it needs q_len == kv_len, got {} and {}", shape.q_len, shape.kv_len)));
    }
    let program = bound.program;
    let mut elementwise_pairs = 0u64;
    let bs = if program.uses_b { shape.batch } else { 1 };
    let hs = if program.uses_h { shape.num_heads } else { 1 };
    let mut masks: Vec<MaskPlan> = Vec::new();
    let mut seen = DistinctMasks::default();
    let mut local = vec![0u32; (bs * hs) as usize];
    let mut pieces = 0u64;
    let mut order: Option<TokenOrder> = None;
    let mut order_candidates = Vec::new();
    let mut raster_computed_pairs = 0u64;
    let mut runs: Vec<u32> = Vec::new();
    // Batch 0, head 0's rows in the chosen order and their tiles, when choosing the order
    // built them.
    let mut permuted: Option<(RowIntervals, TileDescriptor)> = None;
    let mut overhangs = TreeOverhangs::default();
    let mut budget = RowBudget::default();
    for b in 0..bs {
        // Segmentations that read `b` laid out for this batch index; the count of pairs
        // evaluated one by one (and its limit) runs over the whole plan.
        let at = bound.at_batch(b)?;
        overhangs.see(&at, b as u32, b > 0);
        let solver = Solver::new(&at);
        solver.elementwise_pairs.set(elementwise_pairs);
        for h in 0..hs {
            let mut rows = row_intervals_runs(&solver, b, h, &mut pieces, &mut runs)?;
            if *request != OrderRequest::Raster && rows.has_strides() {
                // Permuted rows are plain intervals: a permutation keeps no stride.
                rows = rows.expanded().map_err(expand_error)?.into_owned();
            }
            if b == 0 && h == 0 && *request != OrderRequest::Raster {
                raster_computed_pairs = computed_pairs(&rows, tile);
                order = match request {
                    OrderRequest::Raster => None,
                    OrderRequest::Explicit(o) => Some(
                        TokenOrder::from_permutation(o.clone(), shape.q_len as u32).map_err(
                            |e| {
                                PlanError::new(
                                    Code::BadOrder,
                                    None,
                                    format!("bad token order: {e}"),
                                )
                            },
                        )?,
                    ),
                    OrderRequest::Auto => {
                        if let Some(grid) = bound.grids.first() {
                            let (o, candidates) = choose_grid_order(&rows, grid, tile);
                            order_candidates = candidates;
                            Some(o)
                        } else if let Some(tree) = at.trees.first() {
                            // Batch 0's tree when the parents read `b`: one order serves
                            // every batch index (any order is exact; this one is densest
                            // for batch 0). The rows are permuted and their tiles built to
                            // be costed, and both kept when preorder computes fewer pairs;
                            // otherwise raster stays (also when the permuted descriptor
                            // passes the entry limit: raster reports its own). A tree
                            // already numbered in preorder is kept without the estimate.
                            let o = TokenOrder::tree_preorder(shape.q_len as u32, tree);
                            let moved = o.order.iter().enumerate().any(|(i, &p)| p != i as u32);
                            let p = moved.then(|| permute_rows(&rows, &o));
                            let tiles = p.as_ref().and_then(|p| tiles_in_order(p, tile).ok());
                            match (p, tiles) {
                                (Some(p), Some(t)) if t.computed_pairs < raster_computed_pairs => {
                                    permuted = Some((p, t));
                                    Some(o)
                                }
                                _ => None,
                            }
                        } else {
                            return Err(PlanError::new(Code::NoGridForOrder, None, "order `auto` needs a mask with a grid (`grid NAME = [h, w] at offset;`) or a tree (`tree NAME = PARENTS;`)")
                                .with_hint("give an explicit order instead, or use raster"));
                        }
                    }
                };
            }
            let mut prebuilt = None;
            if let Some(o) = &order {
                rows = match permuted.take() {
                    Some((p, t)) => {
                        prebuilt = Some(t);
                        p
                    }
                    None => permute_rows(&rows, o),
                };
            }
            let id = match seen.find(&rows, &masks) {
                Ok(id) => id,
                Err(hash) => {
                    budget.take(&rows)?;
                    let id = masks.len() as u32;
                    // The solver's pieces are affine runs of the program's own rows; rows
                    // in another order are searched for runs.
                    let tiles = match (prebuilt.take(), &order) {
                        (Some(t), _) => Ok(t),
                        (None, None) => {
                            TileDescriptor::try_build_runs(&rows, &runs, tile, MAX_TILE_ENTRIES)
                        }
                        (None, Some(_)) => tiles_in_order(&rows, tile),
                    }
                    .map_err(|_| too_many_tile_entries(tile))?;
                    if bs * hs > 1 {
                        seen.insert(hash, id);
                    }
                    masks.push(MaskPlan { rows, tiles });
                    id
                }
            };
            local[(b * hs + h) as usize] = id;
        }
        elementwise_pairs = solver.elementwise_pairs.get();
    }
    if order.is_none() {
        raster_computed_pairs = masks[0].tiles.computed_pairs;
    }
    let mut mask_index = Vec::with_capacity((shape.batch * shape.num_heads) as usize);
    for b in 0..shape.batch {
        for h in 0..shape.num_heads {
            let lb = if program.uses_b { b } else { 0 };
            let lh = if program.uses_h { h } else { 0 };
            mask_index.push(local[(lb * hs + lh) as usize]);
        }
    }
    Ok(Plan {
        q_len: shape.q_len as u32,
        kv_len: shape.kv_len as u32,
        batch: shape.batch as u32,
        num_heads: shape.num_heads as u32,
        tile,
        masks,
        mask_index,
        uses_batch: program.uses_b || program.reads_batch,
        uses_head: program.uses_h || program.reads_num_heads,
        elementwise_pairs,
        pieces,
        order,
        order_candidates,
        raster_computed_pairs,
        packing: None,
        score: bound.score.clone(),
        tree_overhangs: overhangs.finish(),
    })
}

#[cfg(test)]
mod row_budget_tests {
    use super::*;

    #[test]
    fn distinct_masks_are_counted_together_up_to_the_limit() {
        // Two rows of one interval each: 3 row offsets (12 bytes) + 2 intervals (16 bytes).
        let rows = RowIntervals::from_rows(8, &[vec![(0, 1)], vec![(0, 2)]]).unwrap();
        assert_eq!(rows.bytes(), 28);
        let mut budget = RowBudget {
            limit: 3 * 28,
            ..RowBudget::default()
        };
        for _ in 0..3 {
            budget.take(&rows).unwrap();
        }
        let e = budget.take(&rows).unwrap_err();
        assert_eq!(e.code, Code::TooLargeToPlan);
        assert!(
            e.message.contains("4 distinct masks so far, 2 rows each"),
            "{}",
            e.message
        );
        assert!(e.message.contains("more than 84 bytes"), "{}", e.message);
    }
}

#[cfg(test)]
mod distinct_masks_tests {
    use super::*;

    fn mask(rows: &[Vec<(u32, u32)>]) -> MaskPlan {
        let rows = RowIntervals::from_rows(8, rows).unwrap();
        let tile = TileShape {
            block_m: 64,
            block_n: 64,
        };
        let tiles = TileDescriptor::try_build(&rows, tile, MAX_TILE_ENTRIES).unwrap();
        MaskPlan { rows, tiles }
    }

    #[test]
    fn a_mask_is_found_by_its_rows_not_by_its_hash_alone() {
        let a = mask(&[vec![(0, 1)], vec![(0, 2)]]);
        let b = mask(&[vec![(0, 1)], vec![(1, 2)]]);
        let mut seen = DistinctMasks::default();
        let mut masks = Vec::new();
        let hash_a = seen.find(&a.rows, &masks).unwrap_err();
        // b stored under a's hash (as a collision would), then a itself.
        seen.insert(hash_a, 0);
        seen.insert(hash_a, 1);
        masks.extend([b.clone(), a.clone()]);
        assert_eq!(seen.find(&a.rows, &masks), Ok(1));
        // b's own hash was never inserted, so b is not found: a mask is only ever matched by
        // equal rows.
        assert!(seen.find(&b.rows, &masks).is_err());
        let c = mask(&[vec![(0, 3)], vec![(0, 2)]]);
        assert!(seen.find(&c.rows, &masks).is_err());
    }
}
