//! Planning steps: each sequence's new rows, computed for that sequence alone.
//!
//! Sequence `s` of a step is the program bound as a square program at its own length
//! (`q_len = kv_len = kv_len[s]`, `batch = num_seqs`, batch index `b = s`), and its new rows
//! are that program's rows `kv_len[s] - q_len[s] .. kv_len[s]`, solved alone
//! (`cm_plan::row_range_intervals`): the cached prefix is never re-planned, so a step costs
//! O(new rows x intervals) plus one binding per sequence (O(segments + parameters); a
//! key-side atom such as `arr[k] <= q` also sorts the sequence's keys, O(kv_len log kv_len)).
//!
//! **The piece cache.** Most serving masks (causal, sliding windows, sinks, dilated
//! windows, fixed prefixes) read no length, or read `q_len` and `kv_len` only where they
//! cancel in a square binding (bottom-right causal: `k <= q + kv_len - q_len`):
//! [`cm_ir::Program::square_invariant`] holds, and neither `b`, `h` nor `elementwise`
//! appears. Then binding square at any length gives the same pairwise visibility, the length
//! only bounding the keys, so row `p` of a sequence of
//! `kv_len` keys is row `p` of the program bound once at a *capacity* `C >= kv_len`, its
//! keys cut at `kv_len`. The planner keeps, per capacity, the solver's pieces (runs of rows
//! whose intervals are affine in the row, `cm_plan::first_piece`) that steps have asked for;
//! a row inside a known piece costs a lookup and its intervals' arithmetic, and a row outside
//! every piece solves one piece from that row (to the next known one), never the rows before
//! it. Decode steps of causal or windowed masks stay inside one or two pieces for the whole
//! generation. The capacity is the next power of two of the longest sequence seen (at least
//! [`MIN_CAPACITY`]); a longer sequence doubles it and drops the pieces. Any error on this
//! path (a plan-time error, a limit) re-plans the sequence by the general path, whose
//! result or error is exact for that sequence.

use crate::error::StepError;
use crate::step::StepPlan;
use cm_ir::bind::{MAX_BATCH, MAX_HEADS, MAX_LEN};
use cm_ir::{PlanError, Program, Shape, Value};
use cm_plan::symbolic::Solver;
use cm_plan::AffineRows;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The smallest capacity the piece cache binds at.
pub const MIN_CAPACITY: i64 = 4096;

/// Plans steps of one program with one set of parameters, keeping the piece cache (see the
/// module docs) from step to step.
#[derive(Clone, Debug)]
pub struct StepPlanner {
    program: Arc<Program>,
    params: BTreeMap<String, Value>,
    num_heads: i64,
    cache: Option<PieceCache>,
}

/// Whether rows of `program` at any length are its rows at a larger one, cut at the length.
fn cacheable(program: &Program) -> bool {
    program.square_invariant()
        && !program.uses_b
        && !program.uses_h
        && !program.mask.uses_elementwise()
}

/// The error with the sequence it arose in.
fn in_seq(mut e: PlanError, s: usize, q_len: i64, kv_len: i64) -> StepError {
    e.message = format!(
        "{} (sequence {s}: q_len = {q_len}, kv_len = {kv_len})",
        e.message
    );
    StepError::Plan(e)
}

impl StepPlanner {
    /// A planner of `program` with parameter values `params` (the rest take their defaults).
    ///
    /// # Errors
    /// [`StepError::PerHeadMask`] for a mask that reads `h`; [`StepError::ScoreTerms`] for a
    /// program with a `score` or `sink` statement; [`StepError::Plan`] (`CM0309`) for an
    /// unknown parameter name.
    pub fn new(
        program: Arc<Program>,
        params: BTreeMap<String, Value>,
    ) -> Result<StepPlanner, StepError> {
        if program.uses_h {
            return Err(StepError::PerHeadMask);
        }
        if program.score.is_some() || program.sink.is_some() {
            return Err(StepError::ScoreTerms);
        }
        program
            .check_param_names(&params)
            .map_err(StepError::Plan)?;
        let cache = cacheable(&program).then(PieceCache::default);
        Ok(StepPlanner {
            program,
            params,
            num_heads: 1,
            cache,
        })
    }

    /// The value the program's `num_heads` reads (default 1; the mask is the same for every
    /// head).
    ///
    /// # Errors
    /// [`StepError::Plan`] (`CM0402`) outside `1 ..= 2^16`.
    pub fn with_num_heads(mut self, num_heads: i64) -> Result<StepPlanner, StepError> {
        if !(1..=MAX_HEADS).contains(&num_heads) {
            return Err(StepError::Plan(PlanError::new(
                cm_syntax::Code::LengthOutOfRange,
                None,
                format!("num_heads = {num_heads} is out of range; expected 1 ..= {MAX_HEADS}"),
            )));
        }
        self.num_heads = num_heads;
        Ok(self)
    }

    pub fn program(&self) -> &Arc<Program> {
        &self.program
    }

    /// The parameter values every sequence uses unless it has its own.
    pub fn params(&self) -> &BTreeMap<String, Value> {
        &self.params
    }

    pub fn num_heads(&self) -> i64 {
        self.num_heads
    }

    /// Whether rows come from the piece cache (see the module docs) for sequences without
    /// parameters of their own.
    pub fn caches_pieces(&self) -> bool {
        self.cache.is_some()
    }

    /// Pieces the cache holds now (0 without a cache).
    pub fn cached_pieces(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.pieces.len())
    }

    /// Plans a step: `q_len[s]` new rows of sequence `s` over its `kv_len[s]` keys.
    ///
    /// # Errors
    /// [`StepError::NoSequences`], [`StepError::CountMismatch`] for lists of different
    /// lengths, [`StepError::NoNewRows`], [`StepError::MoreRowsThanKeys`],
    /// [`StepError::KvLenOutOfRange`], [`StepError::TooManySequences`],
    /// [`StepError::TooManyRows`], [`StepError::TooManyIntervals`]; [`StepError::Plan`] for
    /// a sequence whose binding or rows fail (a `require`, an arithmetic error, `CM0412`
    /// for strided runs past their expansion limit), naming the sequence.
    pub fn plan(&mut self, q_len: &[i64], kv_len: &[i64]) -> Result<StepPlan, StepError> {
        let mut out = StepPlan::default();
        self.plan_into(q_len, kv_len, None, &mut out)?;
        Ok(out)
    }

    /// As [`StepPlanner::plan`], sequence `s` with parameters `params[s]` over the
    /// planner's (a speculative tree's `parents`, say).
    ///
    /// # Errors
    /// As [`StepPlanner::plan`]; [`StepError::CountMismatch`] unless there is one parameter
    /// set per sequence; `CM0309` for an unknown name.
    pub fn plan_each(
        &mut self,
        q_len: &[i64],
        kv_len: &[i64],
        params: &[BTreeMap<String, Value>],
    ) -> Result<StepPlan, StepError> {
        let mut out = StepPlan::default();
        self.plan_into(q_len, kv_len, Some(params), &mut out)?;
        Ok(out)
    }

    /// Plans a step into `out`, reusing its allocations (what a decode loop calls every
    /// step). On an error `out` holds an unspecified valid-or-partial step: plan again
    /// before using it.
    ///
    /// # Errors
    /// As [`StepPlanner::plan_each`].
    pub fn plan_into(
        &mut self,
        q_len: &[i64],
        kv_len: &[i64],
        params: Option<&[BTreeMap<String, Value>]>,
        out: &mut StepPlan,
    ) -> Result<(), StepError> {
        let total_q = check_lengths(q_len, kv_len)?;
        if let Some(p) = params {
            if p.len() != q_len.len() {
                return Err(StepError::CountMismatch {
                    what: "params",
                    given: p.len(),
                    num_seqs: q_len.len(),
                });
            }
            for values in p {
                self.program
                    .check_param_names(values)
                    .map_err(StepError::Plan)?;
            }
        }
        let num_seqs = q_len.len();
        out.reset(num_seqs, total_q);
        for s in 0..num_seqs {
            out.push_seq(q_len[s], kv_len[s]);
            let own = params.map(|p| &p[s]).filter(|v| !v.is_empty());
            self.plan_seq(s, num_seqs, q_len[s], kv_len[s], own, out)?;
        }
        Ok(())
    }

    /// Writes the rows of sequence `s`.
    fn plan_seq(
        &mut self,
        s: usize,
        num_seqs: usize,
        q_len: i64,
        kv_len: i64,
        own: Option<&BTreeMap<String, Value>>,
        out: &mut StepPlan,
    ) -> Result<(), StepError> {
        let rows = kv_len - q_len..kv_len;
        if let (None, Some(cache)) = (own, self.cache.as_mut()) {
            let mark = out.mark();
            match cache.rows(&self.program, &self.params, rows.clone(), kv_len, out) {
                Ok(()) => return Ok(()),
                // The general path gives this sequence's own result or error.
                Err(_) => out.rewind(mark),
            }
        }
        let merged;
        let values = match own {
            None => &self.params,
            Some(own) => {
                let mut m = self.params.clone();
                m.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
                merged = m;
                &merged
            }
        };
        let shape = Shape {
            q_len: kv_len,
            kv_len,
            batch: num_seqs as i64,
            num_heads: self.num_heads,
        };
        let err = |e| in_seq(e, s, q_len, kv_len);
        let bound = self.program.bind(shape, values).map_err(err)?;
        let at = bound.at_batch(s as i64).map_err(err)?;
        let solver = Solver::new(&at);
        let solved =
            cm_plan::row_range_intervals(&solver, s as i64, 0, rows, &mut 0).map_err(err)?;
        let solved = solved
            .expanded()
            .map_err(|e| err(cm_plan::expand_error(e)))?;
        for i in 0..q_len as u32 {
            for iv in solved.row(i) {
                out.push_interval(iv.start, iv.end)?;
            }
            out.finish_row();
        }
        Ok(())
    }
}

/// Checks the lengths of a step and returns its `total_q`.
fn check_lengths(q_len: &[i64], kv_len: &[i64]) -> Result<usize, StepError> {
    if q_len.is_empty() {
        // With keys given, the rows are what is missing.
        return Err(if kv_len.is_empty() {
            StepError::NoSequences
        } else {
            StepError::CountMismatch {
                what: "q_len",
                given: 0,
                num_seqs: kv_len.len(),
            }
        });
    }
    if kv_len.len() != q_len.len() {
        return Err(StepError::CountMismatch {
            what: "kv_len",
            given: kv_len.len(),
            num_seqs: q_len.len(),
        });
    }
    if q_len.len() > MAX_BATCH as usize {
        return Err(StepError::TooManySequences {
            num_seqs: q_len.len(),
            max: MAX_BATCH as usize,
        });
    }
    let mut total_q = 0i64;
    for (s, (&q, &kv)) in q_len.iter().zip(kv_len).enumerate() {
        if !(1..=MAX_LEN).contains(&kv) {
            return Err(StepError::KvLenOutOfRange {
                seq: s,
                kv_len: kv,
                max: MAX_LEN,
            });
        }
        if q < 1 {
            return Err(StepError::NoNewRows { seq: s, q_len: q });
        }
        if q > kv {
            return Err(StepError::MoreRowsThanKeys {
                seq: s,
                q_len: q,
                kv_len: kv,
            });
        }
        total_q += q;
    }
    if total_q > i64::from(i32::MAX) {
        return Err(StepError::TooManyRows {
            total_q,
            max: i64::from(i32::MAX),
        });
    }
    Ok(total_q as usize)
}

/// The solver's pieces of the program bound at `capacity` (see the module docs), by first
/// row; no two overlap.
#[derive(Clone, Debug, Default)]
struct PieceCache {
    capacity: i64,
    pieces: BTreeMap<i64, AffineRows>,
}

impl PieceCache {
    /// Writes rows `rows` of a sequence of `kv_len` keys.
    fn rows(
        &mut self,
        program: &Program,
        params: &BTreeMap<String, Value>,
        rows: std::ops::Range<i64>,
        kv_len: i64,
        out: &mut StepPlan,
    ) -> Result<(), StepError> {
        if kv_len > self.capacity {
            self.capacity = (kv_len as u64)
                .next_power_of_two()
                .clamp(MIN_CAPACITY as u64, MAX_LEN as u64) as i64;
            self.pieces.clear();
        }
        let mut p = rows.start;
        while p < rows.end {
            let piece = self.piece(program, params, p)?;
            let last = rows.end.min(piece.q0 + piece.n);
            for q in p..last {
                write_row(piece, q - piece.q0, kv_len, out)?;
                out.finish_row();
            }
            p = last;
        }
        Ok(())
    }

    /// The piece holding row `p`, solved from `p` (up to the next known piece) if none does.
    fn piece(
        &mut self,
        program: &Program,
        params: &BTreeMap<String, Value>,
        p: i64,
    ) -> Result<&AffineRows, StepError> {
        let known = self
            .pieces
            .range(..=p)
            .next_back()
            .filter(|(_, piece)| p < piece.q0 + piece.n)
            .map(|(&q0, _)| q0);
        let q0 = match known {
            Some(q0) => q0,
            None => {
                let next = self
                    .pieces
                    .range(p + 1..)
                    .next()
                    .map_or(self.capacity, |(&q0, _)| q0);
                let shape = Shape {
                    q_len: self.capacity,
                    kv_len: self.capacity,
                    batch: 1,
                    num_heads: 1,
                };
                let bound = program.bind(shape, params).map_err(StepError::Plan)?;
                let solver = Solver::new(&bound);
                let piece =
                    cm_plan::first_piece(&solver, 0, 0, p..next).map_err(StepError::Plan)?;
                self.pieces.insert(p, piece);
                p
            }
        };
        Ok(&self.pieces[&q0])
    }
}

/// Writes row `q0 + t` of `piece` with its keys cut at `kv_len`, strided runs as their keys.
fn write_row(piece: &AffineRows, t: i64, kv_len: i64, out: &mut StepPlan) -> Result<(), StepError> {
    for run in &piece.runs {
        let start = run.start.at(t);
        if start >= kv_len {
            break;
        }
        let end = run.end.at(t).min(kv_len);
        if run.stride == 1 {
            out.push_interval(start as u32, end as u32)?;
        } else {
            let mut k = start;
            while k < end {
                out.push_interval(k as u32, k as u32 + 1)?;
                k += run.stride;
            }
        }
    }
    Ok(())
}

/// A planned step that grows token by token: the planner (and its piece cache), the
/// current step's arrays, and each sequence's own parameters if it has any.
#[derive(Clone, Debug)]
pub struct Step {
    planner: StepPlanner,
    plan: StepPlan,
    /// The arrays the next step is planned into, swapped in on success.
    scratch: StepPlan,
    params: Option<Vec<BTreeMap<String, Value>>>,
    q_len: Vec<i64>,
    kv_len: Vec<i64>,
}

impl Step {
    /// The first step: `q_len[s]` new rows of sequence `s` over its `kv_len[s]` keys, every
    /// sequence with the planner's parameters, or with `params[s]` over them.
    ///
    /// # Errors
    /// As [`StepPlanner::plan_each`].
    pub fn new(
        mut planner: StepPlanner,
        q_len: &[i64],
        kv_len: &[i64],
        params: Option<Vec<BTreeMap<String, Value>>>,
    ) -> Result<Step, StepError> {
        let mut plan = StepPlan::default();
        planner.plan_into(q_len, kv_len, params.as_deref(), &mut plan)?;
        Ok(Step {
            planner,
            plan,
            scratch: StepPlan::default(),
            params,
            q_len: Vec::with_capacity(q_len.len()),
            kv_len: Vec::with_capacity(q_len.len()),
        })
    }

    /// The current step's arrays.
    pub fn plan(&self) -> &StepPlan {
        &self.plan
    }

    pub fn planner(&self) -> &StepPlanner {
        &self.planner
    }

    /// Each sequence's own parameters, if it has any.
    pub fn params(&self) -> Option<&[BTreeMap<String, Value>]> {
        self.params.as_deref()
    }

    /// The next step: sequence `s` gains `new_tokens[s] >= 1` tokens (written into the cache
    /// before the step runs), which are its new rows: `q_len[s] = new_tokens[s]`, `kv_len[s]`
    /// grows by as much. Only the new rows are planned; each sequence keeps its parameters.
    /// On an error the step is unchanged.
    ///
    /// # Errors
    /// [`StepError::CountMismatch`] unless there is one count per sequence,
    /// [`StepError::NoNewTokens`] for a count below 1, [`StepError::AppendPastMax`] for one
    /// that takes a sequence past `MAX_LEN` keys; as [`StepPlanner::plan`] for the new
    /// lengths (`KvLenOutOfRange` past `2^26` keys).
    pub fn append(&mut self, new_tokens: &[i64]) -> Result<(), StepError> {
        let num_seqs = self.plan.num_seqs();
        if new_tokens.len() != num_seqs {
            return Err(StepError::CountMismatch {
                what: "new_tokens",
                given: new_tokens.len(),
                num_seqs,
            });
        }
        if let Some((seq, &n)) = new_tokens.iter().enumerate().find(|(_, &n)| n < 1) {
            return Err(StepError::NoNewTokens { seq, new_tokens: n });
        }
        let kv = self.plan.kv_len();
        if let Some((seq, &n)) = new_tokens
            .iter()
            .enumerate()
            .find(|&(s, &n)| n > MAX_LEN - i64::from(kv[s]))
        {
            return Err(StepError::AppendPastMax {
                seq,
                new_tokens: n,
                kv_len: i64::from(kv[seq]),
                max: MAX_LEN,
            });
        }
        self.q_len.clear();
        self.kv_len.clear();
        for (s, &n) in new_tokens.iter().enumerate() {
            self.q_len.push(n);
            self.kv_len
                .push(i64::from(self.plan.kv_len()[s]).saturating_add(n));
        }
        self.planner.plan_into(
            &self.q_len,
            &self.kv_len,
            self.params.as_deref(),
            &mut self.scratch,
        )?;
        std::mem::swap(&mut self.plan, &mut self.scratch);
        Ok(())
    }

    /// A step of other sequences (a batch that changed) with the same planner, so its piece
    /// cache carries over. On an error the step is unchanged.
    ///
    /// # Errors
    /// As [`Step::new`].
    pub fn replan(
        &mut self,
        q_len: &[i64],
        kv_len: &[i64],
        params: Option<Vec<BTreeMap<String, Value>>>,
    ) -> Result<(), StepError> {
        self.planner
            .plan_into(q_len, kv_len, params.as_deref(), &mut self.scratch)?;
        std::mem::swap(&mut self.plan, &mut self.scratch);
        self.params = params;
        Ok(())
    }
}
