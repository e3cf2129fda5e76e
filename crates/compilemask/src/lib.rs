//! CompileMask: attention masks written once in a small region language, compiled
//! analytically into the exact visible key intervals of every query row and a tile
//! descriptor for tile kernels.
//!
//! ```
//! let program = compilemask::compile("mask = k <= q;").unwrap();
//! let plan = program.plan(&compilemask::PlanOptions::new(1000)).unwrap();
//! assert_eq!(plan.visible_pairs(), 1000 * 1001 / 2);
//! assert_eq!(plan.mask(0, 0).rows.row(4)[0].end, 5); // row 4 sees [0, 5)
//! ```
//!
//! The public boundary of the Rust crates: [`compile`], [`builtin`], [`Program::plan`],
//! [`Program::plan_packed`] (samples packed back to back, FlashAttention's `cu_seqlens`),
//! [`attention`], the exports, and serving steps over a paged KV cache
//! ([`Program::plan_step`], [`Step::append`], [`paged_attention`]; `cm-serve`). Positions are 0-based and absolute (top-left aligned);
//! every interval is half-open `[start, end)`. The language is documented in
//! `docs/language.md`.

use std::collections::BTreeMap;
use std::sync::Arc;

pub mod text;
pub mod warnings;
pub use text::{parse_int_list, parse_value, ListError};

pub use cm_export::{
    CudnnEndpoints, ExportError, FlashMaskBounds, FlexBlockMask, DENSE_LIMIT, JSON_LIMIT,
};
pub use cm_ir::bind::LENGTH_LIMITS;
pub use cm_ir::score::{alibi_slopes, t5_bucket, LinearBias, ScoreTerms, TableBias};
pub use cm_ir::{PlanError, Shape, Value};
pub use cm_plan::{
    expand_error, ExpandError, KeyInterval, MaskPlan, OrderRequest, Packing, Plan, RowIntervals,
    TileCounts, TileDescriptor, TileShape, TokenOrder, Traversal, TreeOverhang,
    MAX_EXPANDED_INTERVALS,
};
pub use cm_reference::{
    attention_backward, attention_backward_scored, attention_forward, attention_forward_scored,
    AttentionShape, Float, ForwardOutput, Gradients, Masks, ReferenceError, Score, ScoreGradients,
};
pub use cm_serve::{
    paged_attention, PagedError, PagedShape, Prefill, PrefillShape, Step, StepError, StepPlan,
    StepPlanner, MAX_STEP_INTERVALS,
};
pub use cm_shard::{default_chunk, shard, shard_plan, Part, ShardError, Sharding};
pub use cm_stdlib::{Builtin, BUILTINS};
pub use cm_syntax::ast::show_float;
pub use cm_syntax::{line_col, Code, Diagnostic, LineIndex, Severity, Span};

/// A program failed to parse or check.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{rendered}")]
pub struct CompileError {
    /// Every diagnostic, errors and warnings, in source order.
    pub diagnostics: Vec<Diagnostic>,
    /// The diagnostics rendered against the source, without colour: the first
    /// [`RENDER_LIMIT`], then one line counting the rest (`diagnostics` holds them all).
    pub rendered: String,
}

/// A checked mask program, ready to plan for any lengths and parameters.
#[derive(Debug, Clone)]
pub struct Program {
    ir: Arc<cm_ir::Program>,
    source: Arc<str>,
    name: Arc<str>,
    warnings: Vec<Diagnostic>,
}

/// Compiles mask source text.
///
/// # Errors
/// [`CompileError`] with every diagnostic when the source has a syntax or checking error.
pub fn compile(source: &str) -> Result<Program, CompileError> {
    compile_named(source, "<mask>")
}

/// Compiles source text, naming it `name` in diagnostics (a file name, say).
///
/// # Errors
/// As [`compile`].
pub fn compile_named(source: &str, name: &str) -> Result<Program, CompileError> {
    let (ir, diagnostics) = cm_stdlib::compile(source);
    match ir {
        Some(ir) => Ok(Program {
            ir: Arc::new(ir),
            source: source.into(),
            name: name.into(),
            warnings: diagnostics,
        }),
        None => {
            let rendered = render_limited(source, name, &diagnostics, RENDER_LIMIT);
            Err(CompileError {
                diagnostics,
                rendered,
            })
        }
    }
}

/// A built-in mask of the standard library (`causal`, `hstu`, `shared_prefix`, `clear`,
/// `sliding_window`, `document_causal`, `trace_documents`, `trace_prompt_groups`, ...).
///
/// # Errors
/// [`CompileError`] (code `CM0201`) naming the available built-ins when `name` is unknown.
pub fn builtin(name: &str) -> Result<Program, CompileError> {
    match cm_stdlib::get(name) {
        Some(b) => compile_named(b.source, &format!("<builtin {name}>")),
        None => {
            let names: Vec<&str> = BUILTINS.iter().map(|b| b.name).collect();
            let d = Diagnostic::error(
                Code::UnknownName,
                Span::default(),
                format!("unknown built-in mask `{name}`"),
            )
            .with_hint(format!("available: {}", names.join(", ")));
            let rendered = format!("{d}\n");
            Err(CompileError {
                diagnostics: vec![d],
                rendered,
            })
        }
    }
}

/// What to plan a program for.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub q_len: i64,
    /// Defaults to `q_len`.
    pub kv_len: Option<i64>,
    pub batch: i64,
    pub num_heads: i64,
    pub params: BTreeMap<String, Value>,
    /// Defaults to 128 x 128.
    pub tile: TileShape,
    /// The token order to plan in (default: the program's own positions). Orders permute
    /// queries and keys together, so they need `q_len == kv_len`.
    pub order: OrderRequest,
}

/// One query row and one key, batch 1, one head, no parameters, 128 x 128 tiles, raster
/// order: the starting point for [`Program::plan_packed`], whose lengths come from the
/// packing.
impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions::new(1)
    }
}

/// Samples packed back to back in FlashAttention's varlen form, for
/// [`Program::plan_packed`]: `cu_seqlens_q` / `cu_seqlens_k` are the prefix sums of the
/// samples' query and key lengths (`batch + 1` entries each, starting at 0,
/// non-decreasing), and every sample's positions start at 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedShape {
    pub cu_seqlens_q: Vec<i64>,
    pub cu_seqlens_k: Vec<i64>,
    /// Query heads; only read by masks that use the head index `h`. Default 1.
    pub num_heads: i64,
}

impl PackedShape {
    /// A packing of one head.
    pub fn new(cu_seqlens_q: impl Into<Vec<i64>>, cu_seqlens_k: impl Into<Vec<i64>>) -> Self {
        PackedShape {
            cu_seqlens_q: cu_seqlens_q.into(),
            cu_seqlens_k: cu_seqlens_k.into(),
            num_heads: 1,
        }
    }

    /// Samples of equal query and key lengths: `cu_seqlens_q == cu_seqlens_k`.
    pub fn self_attention(cu_seqlens: impl Into<Vec<i64>>) -> Self {
        let cu: Vec<i64> = cu_seqlens.into();
        PackedShape::new(cu.clone(), cu)
    }

    pub fn num_heads(mut self, num_heads: i64) -> Self {
        self.num_heads = num_heads;
        self
    }

    /// Checks the offsets (see [`Packing::new`]).
    ///
    /// # Errors
    /// `CM0409` for offsets that are not `batch + 1` non-decreasing prefix sums from 0.
    pub fn packing(&self) -> Result<Packing, PlanError> {
        Packing::new(&self.cu_seqlens_q, &self.cu_seqlens_k)
    }
}

impl PlanOptions {
    pub fn new(q_len: i64) -> Self {
        PlanOptions {
            q_len,
            kv_len: None,
            batch: 1,
            num_heads: 1,
            params: BTreeMap::new(),
            tile: TileShape::default(),
            order: OrderRequest::Raster,
        }
    }

    pub fn kv_len(mut self, kv_len: i64) -> Self {
        self.kv_len = Some(kv_len);
        self
    }

    pub fn param(mut self, name: &str, value: Value) -> Self {
        self.params.insert(name.to_string(), value);
        self
    }

    pub fn tile(mut self, block_m: u32, block_n: u32) -> Self {
        self.tile = TileShape { block_m, block_n };
        self
    }

    pub fn shape(&self) -> Shape {
        Shape {
            q_len: self.q_len,
            kv_len: self.kv_len.unwrap_or(self.q_len),
            batch: self.batch,
            num_heads: self.num_heads,
        }
    }
}

impl Program {
    /// Plans the program: binds lengths and parameters, solves every row, classifies
    /// tiles and builds the transposes. No re-parsing; call it per batch with new lengths.
    ///
    /// # Errors
    /// [`PlanError`] with a stable code: bad lengths or tile shapes, unknown or ill-typed
    /// parameters, failed `require`s, arithmetic errors (division by zero, overflow) and
    /// positions outside a segmentation or grid. Render it with [`Program::render_error`].
    pub fn plan(&self, options: &PlanOptions) -> Result<Plan, PlanError> {
        let bound = self.bind(options.shape(), &options.params)?;
        cm_plan::plan_in_order(&bound, options.tile, &options.order)
            .map_err(|e| self.name_param_values(&bound.params, e))
    }

    /// [`cm_ir::Program::bind`], its arithmetic errors (a grid's extent, a tree's prompt)
    /// naming the parameter values as planning errors do.
    fn bind(
        &self,
        shape: cm_ir::Shape,
        values: &BTreeMap<String, Value>,
    ) -> Result<cm_ir::Bound<'_>, PlanError> {
        self.ir.bind_with(shape, values, &|params, e| {
            self.name_param_values(params, e)
        })
    }

    /// An arithmetic error (`CM0301`, `CM0302`) also names the values of the parameters its
    /// expression reads (`--set window=...` shows only as `window` in the source snippet).
    /// Arrays of more than 8 values are named by their length.
    fn name_param_values(&self, params: &[Value], mut e: PlanError) -> PlanError {
        if !matches!(e.code, Code::Overflow | Code::DivisionByZero) {
            return e;
        }
        let Some(text) = e
            .span
            .and_then(|s| self.source.get(s.start as usize..s.end as usize))
        else {
            return e;
        };
        let words: std::collections::BTreeSet<&str> = text
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .collect();
        let named: Vec<String> = self
            .ir
            .params
            .iter()
            .zip(params)
            .filter(|(decl, _)| words.contains(decl.name.as_str()))
            .map(|(decl, value)| match value {
                Value::Int(v) => format!("{} = {v}", decl.name),
                Value::Array(a) if a.len() <= 8 => format!("{} = {a:?}", decl.name),
                Value::Array(a) => format!("{} = [{} values]", decl.name, a.len()),
            })
            .collect();
        if !named.is_empty() {
            e.message = format!("{}, where {}", e.message, named.join(", "));
        }
        e
    }

    /// Rows `rows` (0-based, half-open, in the program's positions) of the mask of batch
    /// `b` and head `h`, solved alone: the same intervals as `self.plan(options)?.mask(b,
    /// h).rows` gives for those rows (the returned rows are numbered from 0, row `i` being
    /// row `rows.start + i`), without solving the other rows or building a tile
    /// descriptor, so one row of a mask too large to plan whole is still available. Cost
    /// O(pieces x intervals) of those rows. `options.tile` and `options.order` are not
    /// read.
    ///
    /// ```
    /// let causal = compilemask::builtin("causal").unwrap();
    /// let options = compilemask::PlanOptions::new(1 << 26);
    /// let rows = causal.row_range(&options, 0, 0, (1 << 26) - 1..1 << 26).unwrap();
    /// assert_eq!(rows.row(0)[0].end, 1 << 26);
    /// ```
    ///
    /// # Errors
    /// `CM0402` for `b`, `h` or `rows` outside the shape; any plan-time error of those rows
    /// (another row's error is not raised), as [`Program::plan`].
    pub fn row_range(
        &self,
        options: &PlanOptions,
        b: u32,
        h: u32,
        rows: std::ops::Range<u32>,
    ) -> Result<RowIntervals, PlanError> {
        let shape = options.shape();
        let bound = self.bind(shape, &options.params)?;
        check_indices(&[
            ("batch index b", i64::from(b), shape.batch),
            ("head index h", i64::from(h), shape.num_heads),
        ])?;
        let at = bound.at_batch(i64::from(b))?;
        let solver = cm_plan::symbolic::Solver::new(&at);
        let rows = i64::from(rows.start)..i64::from(rows.end);
        cm_plan::row_range_intervals(&solver, i64::from(b), i64::from(h), rows, &mut 0)
            .map_err(|e| self.name_param_values(&bound.params, e))
    }

    /// Plans the program for samples packed back to back (FlashAttention's `cu_seqlens`
    /// form): a batch-1 plan over `total_q = cu_seqlens_q[batch]` rows and `total_k =
    /// cu_seqlens_k[batch]` keys in which packed row `r` of sample `b` holds the program's
    /// row `r - cu_seqlens_q[b]` planned at that sample's lengths (`q_len`, `kv_len`) with
    /// batch index `b` (`batch` is the number of samples), its keys shifted by
    /// `cu_seqlens_k[b]`. Keys of other samples are never visible. Samples of equal lengths
    /// share their solution when the mask does not read `b`; a mask that reads `h` gets one
    /// packed mask per distinct head (`plan.mask(0, h)`). The plan records the packing in
    /// `Plan::packing`.
    ///
    /// `options` gives the parameters and the tile shape; its `q_len`, `kv_len`, `batch`
    /// and `num_heads` are not read (start from `PlanOptions::default()`).
    ///
    /// ```
    /// use compilemask::{PackedShape, PlanOptions};
    /// let causal = compilemask::builtin("causal").unwrap();
    /// let plan = causal
    ///     .plan_packed(&PackedShape::self_attention([0, 3, 5]), &PlanOptions::default())
    ///     .unwrap();
    /// assert_eq!((plan.q_len, plan.kv_len), (5, 5));
    /// assert_eq!(plan.mask(0, 0).rows.row(4)[0].start, 3); // sample 1's row 1 sees keys 3..5
    /// ```
    ///
    /// # Errors
    /// `CM0409` for bad offsets (length mismatch, not starting at 0, decreasing, totals
    /// above `2^26`, no query or no key at all); `CM0410` for a token order other than
    /// raster (orders and packing do not combine); otherwise as [`Program::plan`], with
    /// a per-sample error naming the sample and its lengths.
    pub fn plan_packed(
        &self,
        packed: &PackedShape,
        options: &PlanOptions,
    ) -> Result<Plan, PlanError> {
        if options.order != OrderRequest::Raster {
            return Err(PlanError::new(
                Code::OrderWithPacking,
                None,
                "token orders are not supported with packed samples (cu_seqlens)",
            )
            .with_hint(
                "plan each sample on its own to use a token order, or plan in raster order",
            ));
        }
        let packing = packed.packing()?;
        cm_plan::plan_packed_with(
            &self.ir,
            &packing,
            packed.num_heads,
            &options.params,
            options.tile,
            &|params, e| self.name_param_values(params, e),
        )
    }

    /// Row `q`'s visible keys for batch index `b` and head `h` (0-based), as sorted,
    /// disjoint, maximal half-open `[start, end)` runs, by the pairwise reference semantics:
    /// every key of `[0, kv_len)` is tested (O(kv_len); for tests and spot checks).
    ///
    /// # Errors
    /// As [`Program::plan`] for binding; `CM0402` for `q`, `b` or `h` outside the shape
    /// (`0 .. q_len`, `0 .. batch`, `0 .. num_heads`); then the first error the reference
    /// meets on the row.
    pub fn brute_force_row(
        &self,
        options: &PlanOptions,
        q: i64,
        b: i64,
        h: i64,
    ) -> Result<Vec<(u32, u32)>, PlanError> {
        let shape = options.shape();
        let bound = self.bind(shape, &options.params)?;
        check_indices(&[
            ("row q", q, shape.q_len),
            ("batch index b", b, shape.batch),
            ("head index h", h, shape.num_heads),
        ])?;
        bound
            .brute_force_row(q, b, h)
            .map_err(|e| self.name_param_values(&bound.params, e))
    }

    /// A planner of serving steps of this program with parameter values `params` (see
    /// [`StepPlanner`]): each sequence's new rows of a decode, tree or prefill-chunk step,
    /// planned for those rows alone, the piece cache kept from step to step.
    ///
    /// # Errors
    /// [`StepError::PerHeadMask`] for a mask that reads `h`, [`StepError::ScoreTerms`] for a
    /// program with a `score` or `sink`, [`StepError::Plan`] (`CM0309`) for an unknown
    /// parameter.
    pub fn step_planner(&self, params: &BTreeMap<String, Value>) -> Result<StepPlanner, StepError> {
        StepPlanner::new(self.ir.clone(), params.clone())
    }

    /// The first serving step of a batch: sequence `s` has `q_len[s]` new rows (its last
    /// tokens, already written into the cache) over `kv_len[s]` keys; `params` apply to
    /// every sequence, `seq_params[s]` (if given) to sequence `s` over them. Grow it with
    /// [`Step::append`]. The arrays are [`StepPlan`]'s.
    ///
    /// ```
    /// let causal = compilemask::builtin("causal").unwrap();
    /// let mut step = causal.plan_step(&[1, 1], &[4, 9], &Default::default(), None).unwrap();
    /// assert_eq!(step.plan().row(1).collect::<Vec<_>>(), [(0, 9)]);
    /// step.append(&[1, 1]).unwrap();
    /// assert_eq!(step.plan().kv_len(), &[5, 10]);
    /// ```
    ///
    /// # Errors
    /// As [`Program::step_planner`] and [`StepPlanner::plan_each`];
    /// [`StepError::NumHeadsNeeded`] for a program that reads `num_heads` (plan it with
    /// `step_planner(params)?.with_num_heads(h)` and [`Step::new`]); render a
    /// [`StepError::Plan`] with [`Program::render_error`].
    pub fn plan_step(
        &self,
        q_len: &[i64],
        kv_len: &[i64],
        params: &BTreeMap<String, Value>,
        seq_params: Option<Vec<BTreeMap<String, Value>>>,
    ) -> Result<Step, StepError> {
        let planner = self.step_planner(params)?;
        if self.reads_num_heads() {
            return Err(StepError::NumHeadsNeeded);
        }
        Step::new(planner, q_len, kv_len, seq_params)
    }

    /// The declared parameters: name, whether it is an integer array, whether it has a
    /// default.
    pub fn params(&self) -> Vec<(String, bool, bool)> {
        self.ir
            .params
            .iter()
            .map(|p| (p.name.clone(), p.is_array, p.default.is_some()))
            .collect()
    }

    /// The declared parameters with their defaults as written in the source (`4096`,
    /// `[2048, 1536]`, `q_len / 4`), in declaration order.
    pub fn parameters(&self) -> Vec<Parameter> {
        self.ir
            .params
            .iter()
            .map(|p| Parameter {
                name: p.name.clone(),
                is_array: p.is_array,
                default: p.default_span.map(|sp| {
                    let (lo, hi) = (
                        char_floor(&self.source, sp.start as usize),
                        char_floor(&self.source, sp.end as usize),
                    );
                    self.source[lo..hi.max(lo)].to_string()
                }),
            })
            .collect()
    }

    /// Whether the mask reads the batch index `b` / the head index `h`.
    pub fn depends_on_batch_head(&self) -> (bool, bool) {
        (self.ir.uses_b, self.ir.uses_h)
    }

    /// Whether the program reads `num_heads` outside its score part (the mask, a parameter
    /// default, a requirement). A serving step binds it from its planner ([`Program::plan_step`]'s
    /// `num_heads`), which must then be the query heads the step runs with; a plan holds
    /// only for the heads it was made for ([`Plan::uses_head`]).
    pub fn reads_num_heads(&self) -> bool {
        self.ir.reads_num_heads
    }

    /// The same for the length `batch`.
    pub fn reads_batch(&self) -> bool {
        self.ir.reads_batch
    }

    /// The token order that visits the program's first grid patch by patch (`patch` is
    /// frames, rows, columns, each side clipped to `[1, the grid's extent]`: 0 reads as 1,
    /// `u32::MAX` as the whole extent), other tokens keeping their places. Plan in it with
    /// `PlanOptions::order = OrderRequest::Explicit(order.order)`.
    ///
    /// # Errors
    /// As [`Program::plan`]; `CM0406` when the program declares no grid.
    pub fn grid_order(
        &self,
        options: &PlanOptions,
        patch: [u32; 3],
        traversal: Traversal,
    ) -> Result<TokenOrder, PlanError> {
        let bound = self.bind(options.shape(), &options.params)?;
        let grid = bound.grids.first().ok_or_else(|| {
            PlanError::new(
                Code::NoGridForOrder,
                None,
                "the mask declares no grid, so it has no patch order",
            )
        })?;
        Ok(TokenOrder::grid(
            options.q_len as u32,
            grid,
            patch,
            traversal,
        ))
    }

    /// The program's named structure at these lengths and parameters: each segmentation's
    /// segments, parts and pieces, and each grid's extent, in absolute positions (the same
    /// for rows and keys). Costs O(segments + pieces); no row is solved.
    ///
    /// # Errors
    /// As [`Program::plan`] (binding the lengths and parameters).
    pub fn structure(&self, options: &PlanOptions) -> Result<Structure, PlanError> {
        let bound = self.bind(options.shape(), &options.params)?;
        let mut groups = Vec::new();
        for (decl, table) in self.ir.segs.iter().zip(&bound.segs) {
            let segments = (0..table.count())
                .map(|i| {
                    let (lo, hi) = (table.starts[i], table.starts[i + 1]);
                    NamedSpan::same(lo, hi, format!("{} {i}", decl.name))
                })
                .collect();
            groups.push(StructureGroup {
                kind: StructureKind::Segments,
                name: decl.name.clone(),
                spans: segments,
            });
            if let (cm_ir::SegKind::Composite(pieces), Some(t)) = (&decl.kind, &table.pieces) {
                let spans = (0..t.kinds.len())
                    .filter(|&j| t.bounds[j] < t.bounds[j + 1])
                    .map(|j| {
                        let kind = &pieces[t.kinds[j] as usize].name;
                        NamedSpan::same(t.bounds[j], t.bounds[j + 1], kind.clone())
                    })
                    .collect();
                groups.push(StructureGroup {
                    kind: StructureKind::Pieces,
                    name: decl.name.clone(),
                    spans,
                });
            }
            for (part, ranges) in decl.parts.iter().zip(&table.parts) {
                let spans = ranges
                    .iter()
                    .filter(|(lo, hi)| lo < hi)
                    .map(|&(lo, hi)| NamedSpan::same(lo, hi, part.name.clone()))
                    .collect();
                groups.push(StructureGroup {
                    kind: StructureKind::Part,
                    name: format!("{}.{}", decl.name, part.name),
                    spans,
                });
            }
        }
        for (decl, g) in self.ir.grids.iter().zip(&bound.grids) {
            let dims: Vec<String> = g.dims.iter().map(i64::to_string).collect();
            groups.push(StructureGroup {
                kind: StructureKind::Grid,
                name: decl.name.clone(),
                spans: vec![NamedSpan::same(
                    g.at,
                    g.at + g.size,
                    format!("{} {}", decl.name, dims.join("x")),
                )],
            });
        }
        Ok(Structure { groups })
    }

    /// The score part of the program, shape-agnostic: its `tensor`, `score` and `sink`
    /// statements as written and the kinds of term the score has; `None` when it has no
    /// `score` or `sink` statement.
    pub fn score_part(&self) -> Option<ScorePart> {
        let ir = &self.ir;
        if ir.score.is_none() && ir.sink.is_none() {
            return None;
        }
        let text = |sp: Span| {
            let (lo, hi) = (
                char_floor(&self.source, sp.start as usize),
                char_floor(&self.source, sp.end as usize),
            );
            self.source[lo..hi.max(lo)]
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        let mut terms = Vec::new();
        if let Some(f) = ir.score.as_ref().map(|s| &s.form) {
            if f.softcap.is_some() {
                terms.push("softcap");
            }
            if f.linear.is_some() {
                terms.push("linear bias");
            }
            if f.table.is_some() {
                terms.push("bias table");
            }
        }
        if ir.sink.is_some() {
            terms.push("sink");
        }
        Some(ScorePart {
            tensors: ir
                .tensors
                .iter()
                .map(|t| ScoreTensor {
                    name: t.name.clone(),
                    statement: text(t.span),
                })
                .collect(),
            score: ir.score.as_ref().map(|s| text(s.span)),
            sink: ir.sink.as_ref().map(|s| text(s.span)),
            terms,
        })
    }

    /// Whether some region is evaluated pair by pair (`elementwise`).
    pub fn uses_elementwise(&self) -> bool {
        self.ir.mask.uses_elementwise()
    }

    /// Warnings found while checking.
    pub fn warnings(&self) -> &[Diagnostic] {
        &self.warnings
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A plan error rendered against this program's source (see [`render_error`]).
    pub fn render_error(&self, e: &PlanError) -> String {
        render_error(&self.source, &self.name, e)
    }
}

/// The score part of a program ([`Program::score_part`]), as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScorePart {
    /// The tensors it reads at attention time, in declaration order.
    pub tensors: Vec<ScoreTensor>,
    /// The `score = ...;` statement, whitespace collapsed.
    pub score: Option<String>,
    /// The `sink = ...;` statement.
    pub sink: Option<String>,
    /// The kinds of term: `softcap`, `linear bias`, `bias table`, `sink`, in that order.
    pub terms: Vec<&'static str>,
}

/// A float tensor a score reads at attention time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScoreTensor {
    pub name: String,
    /// Its `tensor NAME: [..];` statement, whitespace collapsed.
    pub statement: String,
}

/// A declared parameter ([`Program::parameters`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parameter {
    pub name: String,
    /// `[int]` rather than `int`.
    pub is_array: bool,
    /// The default's source text, if it has one.
    pub default: Option<String>,
}

/// The named structure of a bound program or a packed plan ([`Program::structure`],
/// [`Structure::packed`]): groups of named spans of rows and keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Structure {
    pub groups: Vec<StructureGroup>,
}

/// What a [`StructureGroup`] describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StructureKind {
    /// The segments of a `segments` declaration, one span each (zero-length ones too).
    Segments,
    /// The pieces of a composite segmentation, labelled with their piece name.
    Pieces,
    /// One `part` of every segment (non-empty ones only).
    Part,
    /// A grid's positions `[at, at + h*w)`, labelled with its name and extents.
    Grid,
    /// The samples of a packed plan (`cu_seqlens`).
    Samples,
}

/// A named group of spans: a segmentation (`user`), one of its parts (`user.targets`),
/// a grid (`image`), or the samples of a packed plan (`sample`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StructureGroup {
    pub kind: StructureKind,
    pub name: String,
    /// In increasing order of `rows.0`.
    pub spans: Vec<NamedSpan>,
}

/// Half-open, 0-based ranges of query rows and keys that belong to one named thing. They
/// are equal except in packed plans, whose samples' keys start at `cu_seqlens_k[b]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedSpan {
    pub rows: (i64, i64),
    pub keys: (i64, i64),
    pub label: String,
}

impl NamedSpan {
    fn same(lo: i64, hi: i64, label: String) -> NamedSpan {
        NamedSpan {
            rows: (lo, hi),
            keys: (lo, hi),
            label,
        }
    }
}

impl Structure {
    /// The samples of a packed plan: sample `b` is rows `[cu_q[b], cu_q[b + 1])` and keys
    /// `[cu_k[b], cu_k[b + 1])`.
    pub fn packed(packing: &Packing) -> Structure {
        let (cu_q, cu_k) = (packing.cu_seqlens_q(), packing.cu_seqlens_k());
        let spans = (0..packing.batch() as usize)
            .map(|b| NamedSpan {
                rows: (i64::from(cu_q[b]), i64::from(cu_q[b + 1])),
                keys: (i64::from(cu_k[b]), i64::from(cu_k[b + 1])),
                label: format!("sample {b}"),
            })
            .collect();
        Structure {
            groups: vec![StructureGroup {
                kind: StructureKind::Samples,
                name: "sample".into(),
                spans,
            }],
        }
    }
}

/// The largest character boundary of `source` at or before byte `at`.
fn char_floor(source: &str, at: usize) -> usize {
    let mut at = at.min(source.len());
    while !source.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// Source lines longer than this many bytes are shown only around a diagnostic's labels.
const MAX_SHOWN_LINE: usize = 240;

/// Bytes of context kept on each side of the labels when a line is cut.
const LINE_CONTEXT: usize = 80;

/// What ariadne draws for one diagnostic: the source and its labels' byte ranges in it. When
/// every label sits on one line longer than [`MAX_SHOWN_LINE`], that is a stand-in: the line's
/// window around the labels (`...` where cut) at the same line number, so a one-line program of
/// megabytes does not print megabytes per diagnostic.
///
/// Control characters other than tabs and line breaks are drawn as `?` (`??` for the
/// two-byte C1 controls, so every byte offset stays), never written raw: an escape sequence in
/// a source would otherwise reach the terminal.
fn excerpt<'s>(
    source: &'s str,
    lines: &LineIndex,
    spans: &[std::ops::Range<usize>],
) -> (std::borrow::Cow<'s, str>, Vec<std::ops::Range<usize>>) {
    let (shown, spans) = window(source, lines, spans);
    if !shown.chars().any(masked_control) {
        return (shown, spans);
    }
    let mut masked = String::with_capacity(shown.len());
    for c in shown.chars() {
        if masked_control(c) {
            masked.extend(std::iter::repeat_n('?', c.len_utf8()));
        } else {
            masked.push(c);
        }
    }
    (std::borrow::Cow::Owned(masked), spans)
}

/// A control character that [`excerpt`] does not draw as itself.
fn masked_control(c: char) -> bool {
    c.is_control() && c != '\t' && !cm_syntax::is_line_break(c)
}

/// [`excerpt`]'s source and ranges before control characters are masked (`lines`: the index of
/// `source`, which [`render`] builds once).
fn window<'s>(
    source: &'s str,
    lines: &LineIndex,
    spans: &[std::ops::Range<usize>],
) -> (std::borrow::Cow<'s, str>, Vec<std::ops::Range<usize>>) {
    let whole = (std::borrow::Cow::Borrowed(source), spans.to_vec());
    let lo = spans.iter().map(|r| r.start).min().unwrap_or(0);
    let hi = spans.iter().map(|r| r.end).max().unwrap_or(0);
    let line_start = source[..lo]
        .char_indices()
        .rev()
        .find(|&(_, c)| cm_syntax::is_line_break(c))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let line_end = source[lo..]
        .find(cm_syntax::is_line_break)
        .map_or(source.len(), |i| lo + i);
    if line_end - line_start <= MAX_SHOWN_LINE || hi > line_end {
        return whole;
    }
    let win_lo = char_floor(source, lo.saturating_sub(LINE_CONTEXT).max(line_start));
    let win_hi = char_floor(
        source,
        (hi + LINE_CONTEXT).min(line_end).min(lo + MAX_SHOWN_LINE),
    );
    let line = lines.line_col(line_start as u32).0;
    let mut text = "\n".repeat(line - 1);
    if win_lo > line_start {
        text.push_str("...");
    }
    let base = text.len();
    text.push_str(&source[win_lo..win_hi]);
    if win_hi < line_end {
        text.push_str("...");
    }
    let moved = spans
        .iter()
        .map(|r| {
            let at = |x: usize| base + x.clamp(win_lo, win_hi) - win_lo;
            at(r.start)..at(r.end)
        })
        .collect();
    (std::borrow::Cow::Owned(text), moved)
}

/// Renders a plan error: against `source` (called `name`) as [`render`] draws a diagnostic
/// when the error has a span, else as the error's own text (`[CM0402] Error: ...`, then a
/// `Help:` line), which is the header [`render`] draws. The one renderer of errors: the CLI
/// and the Python package print what this returns.
pub fn render_error(source: &str, name: &str, e: &PlanError) -> String {
    match e.span {
        Some(_) => render(source, name, &[e.to_diagnostic()]),
        None => format!("{e}\n"),
    }
}

/// Renders diagnostics against their source, without colour (ariadne). Lines longer than
/// 240 bytes are cut to a window around the labels; the header and the `at
/// FILE:LINE:COL` note give the true position either way.
/// Each diagnostic's first line is its [`Display`](std::fmt::Display) header, `[CODE]
/// Error: message`.
pub fn render(source: &str, name: &str, diagnostics: &[Diagnostic]) -> String {
    use ariadne::{Config, IndexType, Label, Report, ReportKind, Source};
    let mut out = String::new();
    let lines = LineIndex::new(source);
    for d in diagnostics {
        let kind = if d.is_error() {
            ReportKind::Error
        } else {
            ReportKind::Warning
        };
        let span = |sp: &Span| {
            let start = char_floor(source, sp.start as usize);
            start..char_floor(source, sp.end as usize).max(start)
        };
        let spans: Vec<_> = std::iter::once(span(&d.span))
            .chain(d.related.iter().map(|(sp, _)| span(sp)))
            .collect();
        let (shown, spans) = excerpt(source, &lines, &spans);
        let mut report = Report::build(kind, (name, spans[0].clone()))
            .with_config(
                Config::default()
                    .with_color(false)
                    .with_index_type(IndexType::Byte),
            )
            .with_code(d.code)
            .with_message(&d.message)
            .with_label(Label::new((name, spans[0].clone())).with_message(&d.label));
        for ((_, label), range) in d.related.iter().zip(&spans[1..]) {
            report = report.with_label(Label::new((name, range.clone())).with_message(label));
        }
        if let Some(h) = &d.hint {
            report = report.with_help(h);
        }
        let (line, col) = lines.line_col(d.span.start);
        let at = format!("{name}:{line}:{col}");
        report = report.with_note(format!("at {at}"));
        let mut one = Vec::new();
        if report
            .finish()
            .write((name, Source::from(shown.as_ref())), &mut one)
            .is_err()
        {
            one = format!("{d}\n").into_bytes();
        }
        let mut text = String::from_utf8_lossy(&one).into_owned();
        true_header(&mut text, &at);
        out.push_str(&text);
    }
    out
}

/// Puts `at` (`FILE:LINE:COL`) into a report's `╭─[ ... ]` header: on a line that [`window`]
/// cut, ariadne counts the column within the window.
fn true_header(report: &mut String, at: &str) {
    const OPEN: &str = "╭─[ ";
    // The header is the first line that is the box's corner after indentation (a message
    // or label may hold the same characters).
    let mut start = 0;
    let open = loop {
        let line = report[start..].lines().next().unwrap_or("");
        let body = line.trim_start_matches(' ');
        if body.len() < line.len() && body.starts_with(OPEN) {
            break start + (line.len() - body.len());
        }
        match report[start..].find('\n') {
            Some(i) => start += i + 1,
            None => return,
        }
    };
    let from = open + OPEN.len();
    let line_end = report[from..].find('\n').map_or(report.len(), |i| from + i);
    if let Some(close) = report[from..line_end].rfind(" ]") {
        report.replace_range(from..from + close, at);
    }
}

/// How many diagnostics [`CompileError::rendered`] and the CLI render before one line
/// counting the rest: a chain of thousands of errors does not flood the terminal.
pub const RENDER_LIMIT: usize = 50;

/// [`render`] of at most the first `limit` diagnostics, then one line `... and N more
/// errors` (or `warnings`, or `diagnostics (E errors, W warnings)`) for the rest.
pub fn render_limited(
    source: &str,
    name: &str,
    diagnostics: &[Diagnostic],
    limit: usize,
) -> String {
    if diagnostics.len() <= limit {
        return render(source, name, diagnostics);
    }
    let (shown, rest) = diagnostics.split_at(limit);
    let mut out = render(source, name, shown);
    let errors = rest.iter().filter(|d| d.is_error()).count();
    let warnings = rest.len() - errors;
    let plural = |n: usize, one: &str, many: &str| {
        if n == 1 {
            format!("{n} {one}")
        } else {
            format!("{n} {many}")
        }
    };
    let more = match (errors, warnings) {
        (_, 0) => plural(errors, "more error", "more errors"),
        (0, _) => plural(warnings, "more warning", "more warnings"),
        _ => format!(
            "{} ({}, {})",
            plural(rest.len(), "more diagnostic", "more diagnostics"),
            plural(errors, "error", "errors"),
            plural(warnings, "warning", "warnings")
        ),
    };
    out.push_str(&format!("... and {more}\n"));
    out
}

/// Exports of one planned mask.
pub mod export {
    pub use cm_export::{cudnn_endpoints, dense, flashmask_bounds, flex_block_mask};
}

/// Why [`attention`] refused its arguments.
#[derive(Debug, thiserror::Error)]
pub enum AttentionError {
    #[error("the plan was made for {what} = {planned}, but the tensors have {what} = {given}; plan again for these tensors")]
    PlanMismatch {
        what: &'static str,
        planned: usize,
        given: usize,
    },
    #[error("score tensor `{name}` is not one the plan's score reads; it reads {expected}")]
    UnknownScoreTensor { name: String, expected: String },
    #[error("score tensor `{name}` is given twice; give each tensor once")]
    DuplicateScoreTensor { name: String },
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    /// `CM0412`: a mask's strided runs expand past the reference's limit of unit intervals;
    /// it reads as the plan's own error (code, message and hint).
    #[error("{}", expand_error(.0.clone()))]
    Strides(cm_plan::ExpandError),
}

/// CPU reference attention with a plan's masks: `q` `[batch, num_heads, q_len, head_dim]`,
/// `k` `[batch, num_kv_heads, kv_len, head_dim]`, `v` `[batch, num_kv_heads, kv_len,
/// head_dim_v]`, contiguous. Returns `out` `[batch, num_heads, q_len, head_dim_v]` and
/// `lse` `[batch, num_heads, q_len]` (natural log; `-inf` for rows with no visible key,
/// whose output is 0). The plan's score terms apply (a softcap or a linear bias need no
/// tensor); a score that reads tensors needs [`attention_with_scores`].
///
/// # Errors
/// [`AttentionError::PlanMismatch`] when the plan was made for other lengths, or (for a
/// mask that differs per batch or head, or a plan with score terms that differ between
/// heads) another batch size or head count, except that a plan of batch 1 (one head) whose
/// masks do not read `b` (`h`) serves any batch (head count) and a packed plan batch 1 only; [`AttentionError::Reference`] when the tensor shapes disagree with each
/// other or the score reads a tensor; [`AttentionError::Strides`] (`CM0412`) for strided
/// rows past [`cm_plan::MAX_EXPANDED_INTERVALS`].
pub fn attention<T: Float>(
    shape: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    plan: &Plan,
    softmax_scale: T,
) -> Result<ForwardOutput<T>, AttentionError> {
    attention_with_scores(shape, q, k, v, plan, softmax_scale, &[])
}

/// [`attention`] with the plan's score terms (`Plan::score`: softcap, linear bias, bias
/// table, sinks; docs/language.md, "Scores"), the tensors the score reads given by name:
/// a bias table row-major `[num_heads, num_buckets]` (or `[num_buckets]`), sinks
/// `[num_heads]`. `lse` is `ln(sum exp(s2) + exp(sink[h]))`; a row with no visible key has
/// output 0 and lse `-inf`, or `sink[h]` with sinks.
///
/// ```
/// let program = compilemask::builtin("sliding_window_sinks").unwrap();
/// let mut options = compilemask::PlanOptions::new(3);
/// options.num_heads = 1;
/// let plan = program.plan(&options).unwrap();
/// let shape = compilemask::AttentionShape {
///     batch: 1, num_heads: 1, num_kv_heads: 1, q_len: 3, kv_len: 3, head_dim: 1, head_dim_v: 1,
/// };
/// let x = [0.0f64; 3];
/// let out = compilemask::attention_with_scores(&shape, &x, &x, &x, &plan, 1.0, &[("sinks", &[0.0])])
///     .unwrap();
/// assert!((out.lse[0] - 2f64.ln()).abs() < 1e-12); // one key and the sink, both logit 0
/// ```
///
/// # Errors
/// As [`attention`]; [`AttentionError::UnknownScoreTensor`] for a name the score does not
/// read, [`AttentionError::DuplicateScoreTensor`] for a name given twice, [`AttentionError::PlanMismatch`] for another `num_heads` than the plan's when the
/// plan has score terms that differ between heads (`ScoreTerms::per_head`), and
/// [`AttentionError::Reference`] for a tensor missing, of the wrong length or not finite.
pub fn attention_with_scores<T: Float>(
    shape: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    plan: &Plan,
    softmax_scale: T,
    tensors: &[(&str, &[T])],
) -> Result<ForwardOutput<T>, AttentionError> {
    let (expanded, selection) = plan_masks(shape, plan)?;
    let score = score_of(shape, plan, tensors)?;
    Ok(cm_reference::attention_forward_scored(
        shape,
        q,
        k,
        v,
        &reference_masks(&expanded, &selection),
        softmax_scale,
        score.as_ref(),
    )?)
}

/// The gradients of `sum(out * dout) + sum(lse * dlse)` (the second term only with `dlse`,
/// `[batch, num_heads, q_len]`) for [`attention_with_scores`] on the same inputs: `dq`,
/// `dk`, `dv`, and those of the bias table and the sinks (see
/// [`attention_backward_scored`]).
///
/// # Errors
/// As [`attention_with_scores`], plus a wrong length or a non-finite element of `dout` or
/// `dlse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_with_scores<T: Float>(
    shape: &AttentionShape,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
    dlse: Option<&[T]>,
    plan: &Plan,
    softmax_scale: T,
    tensors: &[(&str, &[T])],
) -> Result<ScoreGradients<T>, AttentionError> {
    let (expanded, selection) = plan_masks(shape, plan)?;
    let score = score_of(shape, plan, tensors)?;
    Ok(cm_reference::attention_backward_scored(
        shape,
        q,
        k,
        v,
        dout,
        dlse,
        &reference_masks(&expanded, &selection),
        softmax_scale,
        score.as_ref(),
    )?)
}

/// The plan's score terms with the named tensors.
fn score_of<'a, T>(
    shape: &AttentionShape,
    plan: &'a Plan,
    tensors: &[(&str, &'a [T])],
) -> Result<Option<Score<'a, T>>, AttentionError> {
    let Some(terms) = &plan.score else {
        if let Some((name, _)) = tensors.first() {
            return Err(AttentionError::UnknownScoreTensor {
                name: name.to_string(),
                expected: "none (the plan has no score terms)".into(),
            });
        }
        return Ok(None);
    };
    if terms.per_head() && plan.num_heads as usize != shape.num_heads {
        return Err(AttentionError::PlanMismatch {
            what: "num_heads",
            planned: plan.num_heads as usize,
            given: shape.num_heads,
        });
    }
    let table_name = terms.table.as_ref().map(|t| t.tensor.as_str());
    let sink_name = terms.sink.as_deref();
    for (i, (name, _)) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|(earlier, _)| earlier == name) {
            return Err(AttentionError::DuplicateScoreTensor {
                name: name.to_string(),
            });
        }
        if Some(*name) != table_name && Some(*name) != sink_name {
            let known: Vec<String> = [table_name, sink_name]
                .into_iter()
                .flatten()
                .map(|n| format!("`{n}`"))
                .collect();
            return Err(AttentionError::UnknownScoreTensor {
                name: name.to_string(),
                expected: if known.is_empty() {
                    "none".into()
                } else {
                    known.join(" and ")
                },
            });
        }
    }
    let find =
        |n: Option<&str>| n.and_then(|n| tensors.iter().find(|(m, _)| *m == n).map(|(_, v)| *v));
    Ok(Some(Score {
        terms,
        table: find(table_name),
        sink: find(sink_name),
    }))
}

/// `CM0402` for the first `(what, value, len)` with `value` outside `0 .. len`.
fn check_indices(indices: &[(&str, i64, i64)]) -> Result<(), PlanError> {
    match indices
        .iter()
        .find(|(_, value, len)| !(0..*len).contains(value))
    {
        Some((what, value, len)) => Err(PlanError::new(
            Code::LengthOutOfRange,
            None,
            format!("{what} = {value} is outside the shape's 0 .. {len}"),
        )),
        None => Ok(()),
    }
}

/// Which of the plan's masks each (batch, head) of the tensors reads, in the reference's
/// terms: no index is built from the tensors' shape before the reference has checked the
/// tensors against it (a `batch` of 2^36 allocated it and aborted), so a broadcast plan
/// names its masks per head or per batch of the plan instead.
enum Selection {
    /// One mask serves every (batch, head).
    Shared,
    /// `[batch, num_heads]` row-major, the plan's own shape.
    Indexed(Vec<usize>),
    /// A batch-1 plan whose masks do not read `b`: entry `h` for head `h` of every batch.
    PerHead(Vec<usize>),
    /// A one-head plan whose masks do not read `h`: entry `b` for every head of batch `b`.
    PerBatch(Vec<usize>),
}

/// The plan's masks (strided runs expanded, with their limit: the reference reads plain
/// intervals) and which one each (batch, head) of these tensors reads. A plan of batch 1
/// (num_heads 1) whose masks do not read `b` (`h`) broadcasts over the tensors' batch
/// (heads), as `compilemask.attention` does in Python; a packed plan's batch never does
/// (its `b` is the sample).
#[allow(clippy::type_complexity)]
fn plan_masks<'p>(
    shape: &AttentionShape,
    plan: &'p Plan,
) -> Result<(Vec<std::borrow::Cow<'p, RowIntervals>>, Selection), AttentionError> {
    let check = |what: &'static str, planned: u32, given: usize| {
        if planned as usize == given {
            Ok(())
        } else {
            Err(AttentionError::PlanMismatch {
                what,
                planned: planned as usize,
                given,
            })
        }
    };
    check("q_len", plan.q_len, shape.q_len)?;
    check("kv_len", plan.kv_len, shape.kv_len)?;
    let masks = plan
        .masks
        .iter()
        .map(|m| m.rows.expanded())
        .collect::<Result<Vec<_>, _>>()
        .map_err(AttentionError::Strides)?;
    // Masks that depend on the batch (heads), or a packed plan's batch (its samples), hold
    // only for the batch (heads) they were planned for, even as one distinct mask.
    if plan.uses_batch || plan.packing.is_some() {
        check("batch", plan.batch, shape.batch)?;
    }
    if plan.uses_head {
        check("num_heads", plan.num_heads, shape.num_heads)?;
    }
    if plan.masks.len() == 1 {
        return Ok((masks, Selection::Shared));
    }
    let batch_broadcasts = plan.batch == 1 && !plan.uses_batch && plan.packing.is_none();
    let heads_broadcast = plan.num_heads == 1 && !plan.uses_head;
    if !batch_broadcasts {
        check("batch", plan.batch, shape.batch)?;
    }
    if !heads_broadcast {
        check("num_heads", plan.num_heads, shape.num_heads)?;
    }
    let index: Vec<usize> = plan.mask_index.iter().map(|&i| i as usize).collect();
    // Both broadcast only for a 1 x 1 plan, which has one mask.
    let selection = if batch_broadcasts && shape.batch != 1 {
        Selection::PerHead(index)
    } else if heads_broadcast && shape.num_heads != 1 {
        Selection::PerBatch(index)
    } else {
        Selection::Indexed(index)
    };
    Ok((masks, selection))
}

/// The reference's view of [`plan_masks`]'s result.
fn reference_masks<'a>(
    masks: &'a [std::borrow::Cow<'_, RowIntervals>],
    selection: &Selection,
) -> Masks<'a> {
    let rows: Vec<&RowIntervals> = masks.iter().map(|m| m.as_ref()).collect();
    let pick = |index: &[usize]| index.iter().map(|&i| rows[i]).collect::<Vec<_>>();
    match selection {
        Selection::Shared => Masks::shared(rows[0]),
        Selection::Indexed(index) => Masks::indexed(&rows, index),
        Selection::PerHead(index) => Masks::per_head(&pick(index)),
        Selection::PerBatch(index) => Masks::per_batch(&pick(index)),
    }
}
