//! Backward attention: argument checking and the launches.
//!
//! A backward is three kernels on one stream, every one driven by the plan's tile descriptor
//! (partial tiles apply the forward's per-row limits, full tiles run no mask code, empty tiles
//! are never visited):
//!
//! 1. `bwd_pre`, per 64-row query block: `delta = rowsum(dO * O) - dlse` in fp32 (`dlse` only
//!    when the loss reads lse: `d lse_i / d s_ij = P_ij`, so it joins `dS_ij = P_ij (dP_ij -
//!    delta_i)` with no other pass) and the forward's lse
//!    in the exp2 domain, into the workspace (rows with no visible key get a `+inf` lse there,
//!    so the probabilities recomputed for them are exactly 0); when `bwd_dkdv` adds dQ it also
//!    zeroes the fp32 dQ accumulator, and in the deterministic mode the dQ turn counters.
//! 2. `bwd_dkdv`, per (128-key block, kv head, batch), walking the transposed lists at
//!    [`cm_kernels::BWD_TILE`] (64-row query tiles): dK and dV, summed over the query heads of
//!    a GQA group and over query tiles in registers in a fixed order, written once. It is
//!    warp-specialised: a TMA producer warpgroup streams Q, dO and the row statistics through a
//!    two-stage ring while two wgmma consumer warpgroups (64 keys each) compute. In the fast
//!    mode it also adds each tile's dQ into an fp32 accumulator with one bulk asynchronous
//!    reduction per tile (`cp.reduce.async.bulk .add`), in a fragment-ordered layout that
//!    `bwd_post` reads back. The deterministic mode does the same in turns, after
//!    FlashAttention-3's deterministic backward: each 64-row query tile's additions come in
//!    ascending key-block order (each entry of the transposed lists carries its rank among the
//!    tile's key blocks, `PlanArray::BwdQRanks`; a counter per tile in the workspace says whose
//!    turn it is), CTAs take their key blocks by start ticket in ascending order (so every
//!    turn a CTA waits for belongs to a CTA that has started) and walk their tiles from the
//!    highest query tile down, every query head of the group per tile, so that a later key
//!    block reaches a shared tile no sooner than an earlier one. It does so where that was
//!    measured to beat `bwd_dq`: head_dim 128, one query head per kv head, no score terms,
//!    and at most a ninth of the plan's tiles partial ([`crate::dq_in_turns`]: on masks of
//!    many partial tiles, at head_dim 64 and under GQA the turns wait more than `bwd_dq`
//!    costs). At the wide shapes of
//!    [`cm_kernels::WIDE_SHAPES`] a CTA takes one 64-key half of a block, its two consumers
//!    split the head dim, and dQ is added with vector reductions (`red.global.add.v4.f32`).
//! 3. `bwd_post` scales and rounds the accumulator into dQ. In the deterministic mode without
//!    turns (the other shapes, GQA, score terms, masks of many partial tiles), `bwd_dq`
//!    computes dQ instead:
//!    per 64-row query block, walking the forward lists at [`cm_kernels::TILE`], it recomputes
//!    the tile's probabilities and accumulates dQ in registers (one warpgroup, wgmma, the next
//!    tile's loads double buffered).
//!
//! The only atomic accumulation is the fast mode's dQ: fp32 addition in an order that depends
//! on CTA timing, so its last bits can differ run to run. dK and dV are never atomic, and the
//! deterministic mode gives the same bits on every run.

use crate::forward::{check_addr, check_forward, ForwardRaw};
use crate::layout::{check_buffer_len, VECTOR_BYTES};
use crate::plan::{ForwardArray, PlanArray, PlanLayout, PlanView};
use crate::score::{Score, ScoreParams, ScoreRaw};
use crate::tma::TensorMap;
use crate::{DType, DevicePlan, Error, LseLayout, Runtime, TensorLayout};
use cm_kernels::KernelKind;
use cm_plan::tiles::TileShape;
use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// A backward launch over Rust-owned device buffers ([`Runtime::backward`]): the gradients of
/// `sum(out * dout) + sum(lse * dlse)` (the second term only with `dlse`) for the forward that
/// produced `out` and `lse` from the same `q`, `k`, `v`, plan and `softmax_scale`.
///
/// Q and dQ are `[batch, num_heads, q_len, head_dim]`, the output and dO `[batch, num_heads,
/// q_len, head_dim_v]`; K and dK `[batch, num_kv_heads, kv_len, head_dim]`, V and dV `[batch,
/// num_kv_heads, kv_len, head_dim_v]` (head_dim_v = head_dim but at the MLA shape of
/// `cm_kernels::WIDE_SHAPES`; query head `h` reads KV head
/// `h / (num_heads / num_kv_heads)`; dK and dV are summed over the query heads of each group);
/// `lse` is the forward's `[batch, num_heads, q_len]` fp32 natural-log log-sum-exp. Rows with no
/// visible key (lse `-inf`) get dQ = 0 and add nothing to dK / dV; keys no row sees get
/// dK = dV = 0.
pub struct Backward<'a> {
    pub dtype: DType,
    pub q: (&'a CudaSlice<u16>, TensorLayout),
    pub k: (&'a CudaSlice<u16>, TensorLayout),
    pub v: (&'a CudaSlice<u16>, TensorLayout),
    pub out: (&'a CudaSlice<u16>, TensorLayout),
    pub dout: (&'a CudaSlice<u16>, TensorLayout),
    pub lse: (&'a CudaSlice<f32>, LseLayout),
    /// `d loss / d lse`, shaped as `lse`, when the loss reads lse (FlashAttention's and
    /// FlexAttention's `grad_lse`); rows with no visible key ignore it (their lse is a
    /// constant `-inf`).
    pub dlse: Option<(&'a CudaSlice<f32>, LseLayout)>,
    pub dq: (&'a mut CudaSlice<u16>, TensorLayout),
    pub dk: (&'a mut CudaSlice<u16>, TensorLayout),
    pub dv: (&'a mut CudaSlice<u16>, TensorLayout),
    /// Scratch of at least [`PlanLayout::backward_workspace_len`] fp32 elements; its contents
    /// on entry do not matter.
    pub workspace: &'a mut CudaSlice<f32>,
    /// The forward's `softmax_scale`.
    pub softmax_scale: f32,
    /// `true`: dQ without atomics (same bits every run, about 1.4x the matrix work);
    /// `false`: dQ by fp32 atomic reductions (the fast mode).
    pub deterministic: bool,
    /// The forward's score terms ([`crate::score`]); its sinks are in `lse` already.
    pub score: Score<'a>,
    /// With a bias by distance in `score`: receives `d loss / d dist_bias` (shaped as it,
    /// zeroed by the caller; fp32 atomics, so the last bits vary run to run). The fast mode
    /// only: the deterministic mode's fixed-point gradient is [`BackwardRaw`]'s.
    pub dist_bias_grad: Option<&'a mut CudaSlice<f32>>,
}

/// A backward launch over device addresses owned by someone else (e.g. torch's `data_ptr()`),
/// for [`Runtime::backward_raw`]. Same shapes and meaning as [`Backward`]; each address is the
/// element at index `[0, 0, 0, 0]` (`[0, 0, 0]` for `lse`), `workspace` the first of
/// `workspace_len` fp32 elements.
#[derive(Clone, Copy, Debug)]
pub struct BackwardRaw {
    pub dtype: DType,
    pub q: u64,
    pub q_layout: TensorLayout,
    pub k: u64,
    pub k_layout: TensorLayout,
    pub v: u64,
    pub v_layout: TensorLayout,
    pub out: u64,
    pub out_layout: TensorLayout,
    pub dout: u64,
    pub dout_layout: TensorLayout,
    pub lse: u64,
    pub lse_layout: LseLayout,
    /// As [`Backward::dlse`]: its address and layout.
    pub dlse: Option<(u64, LseLayout)>,
    pub dq: u64,
    pub dq_layout: TensorLayout,
    pub dk: u64,
    pub dk_layout: TensorLayout,
    pub dv: u64,
    pub dv_layout: TensorLayout,
    pub workspace: u64,
    pub workspace_len: usize,
    pub softmax_scale: f32,
    pub deterministic: bool,
    pub score: ScoreRaw,
}

impl BackwardRaw {
    /// The backward of `forward`: its dtype, Q, K, V, output, lse, `softmax_scale` and score
    /// terms, with what only the backward takes. `dout` is `[batch, num_heads, q_len,
    /// head_dim_v]` (the output's shape), `dlse` as [`Backward::dlse`] (the lse's shape), `dq`,
    /// `dk`, `dv` shaped as Q, K and V; `workspace` is the address of the first fp32 element
    /// and the element count ([`PlanLayout::backward_workspace_len`] at least). Each address
    /// is the element at index `[0, 0, 0, 0]` (`[0, 0, 0]` for `dlse`). Nothing else is
    /// checked here: [`check_backward`] (or the launch) checks the result.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming lse when `forward.lse` is `None`: the backward
    /// recomputes the probabilities from the forward's lse.
    #[allow(clippy::too_many_arguments)]
    pub fn from_forward(
        forward: &ForwardRaw,
        dout: (u64, TensorLayout),
        dlse: Option<(u64, LseLayout)>,
        dq: (u64, TensorLayout),
        dk: (u64, TensorLayout),
        dv: (u64, TensorLayout),
        workspace: (u64, usize),
        deterministic: bool,
    ) -> Result<Self, Error> {
        let (lse, lse_layout) = forward
            .lse
            .ok_or_else(|| Error::invalid("lse: the backward needs the forward's lse"))?;
        Ok(BackwardRaw {
            dtype: forward.dtype,
            q: forward.q,
            q_layout: forward.q_layout,
            k: forward.k,
            k_layout: forward.k_layout,
            v: forward.v,
            v_layout: forward.v_layout,
            out: forward.out,
            out_layout: forward.out_layout,
            dout: dout.0,
            dout_layout: dout.1,
            lse,
            lse_layout,
            dlse,
            dq: dq.0,
            dq_layout: dq.1,
            dk: dk.0,
            dk_layout: dk.1,
            dv: dv.0,
            dv_layout: dv.1,
            workspace: workspace.0,
            workspace_len: workspace.1,
            softmax_scale: forward.softmax_scale,
            deterministic,
            score: forward.score,
        })
    }
}

/// Kernel parameters; mirrors `CmBwdParams` in `kernels/bwd_common.cuh` field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BwdParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    lse: u64,
    dq_accum: u64,
    lse_log2: u64,
    delta: u64,
    dlse: u64,
    q_strides: [i64; 3],
    k_strides: [i64; 3],
    v_strides: [i64; 3],
    o_strides: [i64; 3],
    do_strides: [i64; 3],
    dq_strides: [i64; 3],
    dk_strides: [i64; 3],
    dv_strides: [i64; 3],
    lse_strides: [i64; 2],
    dlse_strides: [i64; 2],
    m_block_order: u64,
    kv_offsets: u64,
    kv_indices: u64,
    full_kv_offsets: u64,
    full_kv_indices: u64,
    partial_row_mask: u64,
    bwd_n_block_order: u64,
    bwd_q_offsets: u64,
    bwd_q_indices: u64,
    bwd_full_q_offsets: u64,
    bwd_full_q_indices: u64,
    bwd_partial_key_mask: u64,
    bwd_q_ranks: u64,
    bwd_full_q_ranks: u64,
    dq_turns: u64,
    mask_index: u64,
    q_len: u32,
    kv_len: u32,
    q_pad: u32,
    num_heads: u32,
    heads_per_kv_head: u32,
    scale_log2: f32,
    softmax_scale: f32,
    num_masks: u32,
    mask_strides: [u32; 2],
    num_m_blocks: u32,
    bwd_num_n_blocks: u32,
    /// Set at launch from the device's L2 ([`crate::forward::head_group`]'s rule).
    bwd_head_group: u32,
    bwd_pairs: u32,
    score: ScoreParams,
}

const _: () = assert!(
    std::mem::size_of::<BwdParams>() == 576,
    "must match sizeof(CmBwdParams)"
);

/// How many (batch, kv head) pairs `bwd_dkdv` interleaves, rank by rank. Without turns, as
/// many as the L2 holds the streamed Q and dO of ([`crate::forward::head_group`]). With the
/// deterministic mode's turns (`dq_turns`), every pair: each key block's first reduction of a
/// query tile waits for the block before it in its pair, so k CTAs of one pair in flight start
/// up to k - 1 hand-offs apart (measured: 26% over the fast backward on causal at 32K with two
/// pairs interleaved, each hand-off a bulk reduction's round trip); spread over every pair, the
/// CTAs in flight form short chains, and those of one pair still walk the same tiles together,
/// so their Q and dO stay shared in L2.
fn bwd_head_group(l2_bytes: u64, params: &BwdParams, pair_bytes: u64) -> u32 {
    if params.dq_turns != 0 {
        params.bwd_pairs.max(1)
    } else {
        crate::forward::head_group(l2_bytes, pair_bytes, u64::from(params.bwd_pairs))
    }
}

// SAFETY: BwdParams is #[repr(C)], Copy, holds only integers and floats, and has the exact
// layout of CmBwdParams (8-byte fields first, explicit tail padding, no implicit padding; size
// checked above), so the driver may copy its bytes as the kernel's by-value parameter.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for BwdParams {}

/// One kernel of a backward: the variant (index into `cm_kernels::VARIANTS`), its grid, and
/// whether it also takes the TMA descriptors of Q, dO, K and V (`bwd_dkdv`).
struct Step {
    variant: usize,
    grid: (u32, u32, u32),
    tensor_maps: bool,
}

/// A validated backward: its parameters, the kernels to run in order, and the TMA
/// descriptors of Q and dO (64-row boxes) and K and V (128-row boxes) for `bwd_dkdv`.
struct Launches {
    params: BwdParams,
    steps: Vec<Step>,
    tensor_maps: [TensorMap; 4],
    /// Bytes of Q and dO that one (batch, kv head) pair's key blocks stream (its query
    /// heads'), for the head groups of `bwd_dkdv`.
    pair_bytes: u64,
}

/// fp32 elements of workspace a backward over a `q_len`-row plan at `tile` needs: `lse_log2`
/// and `delta` `[batch, num_heads, q_pad]`, the dQ accumulator `[batch, num_heads, q_pad,
/// head_dim]`, with `q_pad` = q_len rounded up to whole query tiles, and in the
/// deterministic mode one u32 counter per 64-row query tile (`[batch, num_heads, q_pad /
/// 64]`, the turns of its dQ additions) and one more (the CTAs' start tickets); that length
/// also covers the deterministic mode's other dQ path (`bwd_dq`: score terms, per-head masks
/// under GQA, the wide shapes), which uses only `lse_log2` and `delta`. `None` if the
/// count overflows `usize`. Needs no device, so a caller can allocate the workspace (e.g.
/// with torch) before it has a plan view.
pub fn backward_workspace_len(
    q_len: u32,
    tile: TileShape,
    batch: usize,
    num_heads: usize,
    head_dim: usize,
    deterministic: bool,
) -> Option<usize> {
    let (bm, _) = tile.clamped(q_len, 1);
    let q_pad = q_len.div_ceil(bm) as usize * tile.block_m as usize;
    let rows = batch.checked_mul(num_heads)?.checked_mul(q_pad)?;
    let accum = rows.checked_mul(head_dim.checked_add(2)?)?;
    if deterministic {
        accum.checked_add(rows.div_ceil(DQ_TURN_ROWS) + 1)
    } else {
        Some(accum)
    }
}

/// Query rows per dQ turn counter: `bwd_dkdv`'s query tile.
const DQ_TURN_ROWS: usize = 64;

impl PlanLayout {
    /// [`backward_workspace_len`] for this plan.
    pub fn backward_workspace_len(
        &self,
        batch: usize,
        num_heads: usize,
        head_dim: usize,
        deterministic: bool,
    ) -> Option<usize> {
        backward_workspace_len(
            self.q_len,
            self.tile,
            batch,
            num_heads,
            head_dim,
            deterministic,
        )
    }

    /// Query rows padded to whole query tiles (the workspace's row count per head).
    fn q_pad(&self) -> u32 {
        self.num_m_blocks * self.tile.block_m
    }
}

fn check_output(
    name: &str,
    layout: &TensorLayout,
    expected: [usize; 4],
    expected_from: &str,
    elem: u64,
    addr: u64,
) -> Result<(), Error> {
    if layout.shape != expected {
        return Err(Error::invalid(format!(
            "{name}: shape {:?} differs from {expected_from}'s shape {expected:?}",
            layout.shape
        )));
    }
    layout.validate(name, elem, true)?;
    check_addr(name, addr, VECTOR_BYTES)
}

/// Every host-side check of a backward's arguments against each other and the plan: no
/// device work, no driver call (so it runs, and is tested, without a GPU).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first argument that fails, as
/// [`Runtime::backward`] lists them.
pub fn check_backward(plan: &PlanLayout, a: &BackwardRaw) -> Result<(), Error> {
    // Q, K, V, the output and lse are exactly a forward's arguments: the same checks apply.
    let forward = ForwardRaw {
        dtype: a.dtype,
        q: a.q,
        q_layout: a.q_layout,
        k: a.k,
        k_layout: a.k_layout,
        v: a.v,
        v_layout: a.v_layout,
        out: a.out,
        out_layout: a.out_layout,
        lse: Some((a.lse, a.lse_layout)),
        softmax_scale: a.softmax_scale,
        score: a.score,
    };
    check_forward(plan, &forward)?;
    let (d, dv) = (a.q_layout.shape[3] as u32, a.v_layout.shape[3] as u32);
    let scored = a.score.modifies_logits();
    if cm_kernels::find_variant(KernelKind::BwdDkDv, a.dtype, d, dv, scored).is_none() {
        let built = cm_kernels::built_head_dims(KernelKind::BwdDkDv, a.dtype, scored);
        return Err(Error::invalid(format!(
            "q / v: head_dim = {d} with head_dim_v = {dv}{} runs forward only; the backward{} is \
             built for head dims {} at {}",
            if scored { " and score terms" } else { "" },
            if scored { " with score terms" } else { "" },
            cm_kernels::head_dims_text(&built),
            a.dtype
        )));
    }
    // The deterministic mode's table gradient is int64 fixed point (cm_cuda::score).
    if a.deterministic {
        check_addr("score dist_bias_grad", a.score.dist_bias_grad, 8)?;
    }
    let [b, h, _, d] = a.q_layout.shape;
    let elem = a.dtype.size_bytes() as u64;
    if a.dout_layout.shape != a.out_layout.shape {
        return Err(Error::invalid(format!(
            "dout: shape {:?} differs from out's shape {:?}",
            a.dout_layout.shape, a.out_layout.shape
        )));
    }
    a.dout_layout.validate("dout", elem, false)?;
    check_addr("dout", a.dout, VECTOR_BYTES)?;
    if let Some((addr, dlse)) = &a.dlse {
        if dlse.shape != a.lse_layout.shape {
            return Err(Error::invalid(format!(
                "dlse: shape {:?} differs from lse's shape {:?}",
                dlse.shape, a.lse_layout.shape
            )));
        }
        dlse.validate("dlse")?;
        check_addr("dlse", *addr, 4)?;
    }
    check_output("dq", &a.dq_layout, a.q_layout.shape, "q", elem, a.dq)?;
    check_output("dk", &a.dk_layout, a.k_layout.shape, "k", elem, a.dk)?;
    check_output("dv", &a.dv_layout, a.v_layout.shape, "v", elem, a.dv)?;
    let needed = plan
        .backward_workspace_len(b, h, d, a.deterministic)
        .ok_or_else(|| Error::invalid("the backward workspace size overflows usize"))?;
    if a.workspace_len < needed {
        return Err(Error::invalid(format!(
            "workspace: {} fp32 elements, the backward needs {needed} \
             (backward_workspace_len)",
            a.workspace_len
        )));
    }
    check_addr("workspace", a.workspace, VECTOR_BYTES)?;
    // q_len == 0 still runs bwd_dkdv (no query block, every key block), which writes
    // dK = dV = 0.
    Ok(())
}

/// [`check_backward`], then the launches: the kernels, their grids and parameters and the TMA
/// descriptors (the one step that calls the driver).
fn prepare(plan: &PlanLayout, a: &BackwardRaw) -> Result<Option<Launches>, Error> {
    check_backward(plan, a)?;
    let [b, h, _, d] = a.q_layout.shape;
    let h_kv = a.k_layout.shape[1];
    let dv = a.v_layout.shape[3];
    if b == 0 || h == 0 {
        return Ok(None);
    }

    let variant = |kind: KernelKind| {
        let scored = a.score.modifies_logits() && kind.has_score_variant();
        cm_kernels::find_variant(kind, a.dtype, d as u32, dv as u32, scored).ok_or_else(|| {
            Error::invalid(format!(
                "no {} kernel for {} at head_dim = {d}, head_dim_v = {dv}",
                kind.name(),
                a.dtype
            ))
        })
    };
    // bwd_dkdv's keys per CTA: its 128-key block, or one half of it at the wide shapes.
    let dkdv = &cm_kernels::VARIANTS[variant(KernelKind::BwdDkDv)?];
    let dkdv_keys = dkdv.key_step();
    let ctas_per_block = dkdv.block_n / dkdv_keys;
    let (b32, h32, h_kv32) = (b as u32, h as u32, h_kv as u32);
    let per_query_block = (plan.num_m_blocks, h32, b32);
    let mut steps = Vec::with_capacity(3);
    let mut push = |kind: KernelKind, grid: (u32, u32, u32)| -> Result<(), Error> {
        // A grid with no block has nothing to do (no query or no key block).
        if grid.0 > 0 {
            steps.push(Step {
                variant: variant(kind)?,
                grid,
                tensor_maps: kind == KernelKind::BwdDkDv,
            });
        }
        Ok(())
    };
    push(KernelKind::BwdPre, per_query_block)?;
    // One dimension: bwd_dkdv decodes (rank, kv head, batch) from its head groups.
    let blocks =
        u64::from(plan.bwd_num_n_blocks) * u64::from(ctas_per_block) * h_kv as u64 * b as u64;
    let blocks = u32::try_from(blocks).map_err(|_| {
        Error::invalid(format!(
            "{} key blocks x {ctas_per_block} CTAs x num_kv_heads = {h_kv} x batch = {b} = {blocks} \
             backward CTAs exceed 2^32",
            plan.bwd_num_n_blocks
        ))
    })?;
    let per_key_block = (blocks, 1, 1);
    // The deterministic mode adds dQ in bwd_dkdv as well, in turns, where that was measured to
    // beat bwd_dq: head_dim 128, one query head per kv head, no score terms, a plan of mostly
    // full tiles (plan::dq_in_turns); else bwd_dq computes it. On an H100 at 32K (BENCHMARKS.md,
    // "The deterministic backward's dQ: in turns or in bwd_dq"), turns ran 1.03-1.12x
    // bwd_dq's speed there, but 0.80-0.91x at head_dim 64 (where bwd_dkdv takes two query tiles a
    // step) and 0.71x on the sliding window under GQA 32/8, so those keep bwd_dq.
    let dq_in_dkdv = !a.deterministic
        || (plan.dq_turns
            && !dkdv.score
            && dkdv_keys == dkdv.block_n
            && h == h_kv
            && (d, dv) == (128, 128));
    // bwd_dkdv adds dQ exactly when the workspace pointer to the dQ accumulator is set.
    push(KernelKind::BwdDkDv, per_key_block)?;
    push(
        if dq_in_dkdv {
            KernelKind::BwdPost
        } else {
            KernelKind::BwdDq
        },
        per_query_block,
    )?;

    let rows = b * h * plan.q_pad() as usize;
    let (lse_log2, delta) = (a.workspace, a.workspace + 4 * rows as u64);
    let dq_accum = if dq_in_dkdv {
        a.workspace + 8 * rows as u64
    } else {
        0
    };
    // Without query rows bwd_pre does not run (nor zero the tickets), and there is no dQ.
    let dq_turns = if dq_in_dkdv && a.deterministic && plan.num_m_blocks > 0 {
        a.workspace + 4 * (2 + d as u64) * rows as u64
    } else {
        0
    };
    let s3 = |l: &TensorLayout| [l.strides[0], l.strides[1], l.strides[2]];
    let params = BwdParams {
        q: a.q,
        k: a.k,
        v: a.v,
        o: a.out,
        dout: a.dout,
        dq: a.dq,
        dk: a.dk,
        dv: a.dv,
        lse: a.lse,
        dq_accum,
        lse_log2,
        delta,
        dlse: a.dlse.map_or(0, |(addr, _)| addr),
        q_strides: s3(&a.q_layout),
        k_strides: s3(&a.k_layout),
        v_strides: s3(&a.v_layout),
        o_strides: s3(&a.out_layout),
        do_strides: s3(&a.dout_layout),
        dq_strides: s3(&a.dq_layout),
        dk_strides: s3(&a.dk_layout),
        dv_strides: s3(&a.dv_layout),
        lse_strides: [a.lse_layout.strides[0], a.lse_layout.strides[1]],
        dlse_strides: a.dlse.map_or([0, 0], |(_, l)| [l.strides[0], l.strides[1]]),
        m_block_order: plan.addr(PlanArray::Forward(ForwardArray::MBlockOrder))?,
        kv_offsets: plan.addr(PlanArray::Forward(ForwardArray::KvOffsets))?,
        kv_indices: plan.addr(PlanArray::Forward(ForwardArray::KvIndices))?,
        full_kv_offsets: plan.addr(PlanArray::Forward(ForwardArray::FullKvOffsets))?,
        full_kv_indices: plan.addr(PlanArray::Forward(ForwardArray::FullKvIndices))?,
        partial_row_mask: plan.addr(PlanArray::Forward(ForwardArray::PartialRowMask))?,
        bwd_n_block_order: plan.addr(PlanArray::BwdNBlockOrder)?,
        bwd_q_offsets: plan.addr(PlanArray::BwdQOffsets)?,
        bwd_q_indices: plan.addr(PlanArray::BwdQIndices)?,
        bwd_full_q_offsets: plan.addr(PlanArray::BwdFullQOffsets)?,
        bwd_full_q_indices: plan.addr(PlanArray::BwdFullQIndices)?,
        bwd_partial_key_mask: plan.addr(PlanArray::BwdPartialKeyMask)?,
        bwd_q_ranks: plan.addr(PlanArray::BwdQRanks)?,
        bwd_full_q_ranks: plan.addr(PlanArray::BwdFullQRanks)?,
        dq_turns,
        mask_index: plan.addr(PlanArray::MaskIndex)?,
        q_len: plan.q_len,
        kv_len: plan.kv_len,
        q_pad: plan.q_pad(),
        num_heads: h32,
        heads_per_kv_head: (h / h_kv) as u32,
        scale_log2: a.softmax_scale * std::f32::consts::LOG2_E,
        softmax_scale: a.softmax_scale,
        num_masks: plan.num_masks,
        mask_strides: plan.mask_strides(b, h)?,
        num_m_blocks: plan.num_m_blocks,
        bwd_num_n_blocks: plan.bwd_num_n_blocks,
        bwd_head_group: 1,
        bwd_pairs: b32.saturating_mul(h_kv32),
        score: a.score.params(plan.q_len, plan.kv_len, true),
    };
    let query_rows = dkdv.block_m;
    let tensor_maps = [
        TensorMap::encode("q", a.dtype, a.q, &a.q_layout, query_rows)?,
        TensorMap::encode("dout", a.dtype, a.dout, &a.dout_layout, query_rows)?,
        TensorMap::encode("k", a.dtype, a.k, &a.k_layout, dkdv_keys)?,
        TensorMap::encode("v", a.dtype, a.v, &a.v_layout, dkdv_keys)?,
    ];
    let pair_bytes =
        u64::from(plan.q_len) * (d + dv) as u64 * a.dtype.size_bytes() as u64 * (h / h_kv) as u64;
    Ok(Some(Launches {
        params,
        steps,
        tensor_maps,
        pair_bytes,
    }))
}

impl Runtime {
    /// Backward attention over Rust-owned buffers, enqueued on `stream`; returns without
    /// waiting for the GPU.
    ///
    /// Three kernels run in order on `stream`: `bwd_pre` (delta = rowsum(dO * O) - dlse and the lse
    /// into the workspace), `bwd_dkdv` (per 128-key block over the plan's transposed lists; dK
    /// and dV summed in registers in a fixed order, never atomic; also dQ, added into an fp32
    /// workspace accumulator with bulk asynchronous reductions, in the deterministic mode in
    /// ascending key-block order per query tile), then `bwd_post` (the accumulator scaled and
    /// rounded into dQ), or `bwd_dq` (dQ per query block in registers) where the deterministic
    /// mode takes no turns (head dims other than 128, GQA, score terms, many partial tiles;
    /// see the
    /// module docs). The fast mode's dQ is the only sum in a varying order, so only its last
    /// bits can vary run to run; the deterministic mode repeats its bits exactly.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first check that fails (every check of
    /// [`Runtime::forward`] on q, k, v, out and lse; dout, dq, dk and dv shapes, strides and
    /// alignment; a workspace shorter than [`PlanLayout::backward_workspace_len`]; a buffer
    /// shorter than its layout spans); [`Error::Driver`] if a launch is refused.
    pub fn backward(
        &self,
        stream: &Arc<CudaStream>,
        plan: &DevicePlan,
        args: Backward<'_>,
    ) -> Result<(), Error> {
        self.check_stream(stream)?;
        self.check_plan(plan)?;
        self.bind_context()?;
        check_buffer_len("q", args.q.0.len(), args.q.1.span_elements())?;
        check_buffer_len("k", args.k.0.len(), args.k.1.span_elements())?;
        check_buffer_len("v", args.v.0.len(), args.v.1.span_elements())?;
        check_buffer_len("out", args.out.0.len(), args.out.1.span_elements())?;
        check_buffer_len("dout", args.dout.0.len(), args.dout.1.span_elements())?;
        check_buffer_len("lse", args.lse.0.len(), args.lse.1.span_elements())?;
        if let Some((dlse, layout)) = &args.dlse {
            check_buffer_len("dlse", dlse.len(), layout.span_elements())?;
        }
        check_buffer_len("dq", args.dq.0.len(), args.dq.1.span_elements())?;
        check_buffer_len("dk", args.dk.0.len(), args.dk.1.span_elements())?;
        check_buffer_len("dv", args.dv.0.len(), args.dv.1.span_elements())?;
        // The guards record the buffers' use on `stream` (when the context tracks events), so
        // freeing one waits for this launch; they must live until the launches are enqueued.
        let (q, _gq) = args.q.0.device_ptr(stream);
        let (k, _gk) = args.k.0.device_ptr(stream);
        let (v, _gv) = args.v.0.device_ptr(stream);
        let (out, _go) = args.out.0.device_ptr(stream);
        let (dout, _gdo) = args.dout.0.device_ptr(stream);
        let (lse, _gl) = args.lse.0.device_ptr(stream);
        let dlse = args
            .dlse
            .map(|(buf, layout)| (buf.device_ptr(stream), layout));
        let (_, _gp) = plan.buffer.device_ptr(stream);
        let (dq, _gdq) = args.dq.0.device_ptr_mut(stream);
        let (dk, _gdk) = args.dk.0.device_ptr_mut(stream);
        let (dv, _gdv) = args.dv.0.device_ptr_mut(stream);
        let workspace_len = args.workspace.len();
        let (workspace, _gw) = args.workspace.device_ptr_mut(stream);
        let mut score_guards = Vec::new();
        let mut score = crate::score::score_buffers(
            &args.score,
            stream,
            plan.q_len,
            plan.kv_len,
            args.q.1.shape[1],
            &mut score_guards,
        )?;
        let _gd = match args.dist_bias_grad {
            Some(_) if args.deterministic => {
                return Err(Error::invalid(
                    "dist_bias_grad with deterministic = true: the deterministic table gradient is int64 \
                     fixed point, which Backward's f32 buffer cannot hold; use backward_raw",
                ))
            }
            Some(grad) => {
                let heads = match args.score.dist {
                    Some(d) if d.per_head => args.q.1.shape[1],
                    _ => 1,
                };
                let len = (plan.q_len as usize + plan.kv_len as usize).saturating_sub(1);
                check_buffer_len("dist_bias_grad", grad.len(), heads * len)?;
                let (ptr, guard) = grad.device_ptr_mut(stream);
                score.dist_bias_grad = ptr;
                Some(guard)
            }
            None => None,
        };
        let raw = BackwardRaw {
            score,
            dtype: args.dtype,
            q,
            q_layout: args.q.1,
            k,
            k_layout: args.k.1,
            v,
            v_layout: args.v.1,
            out,
            out_layout: args.out.1,
            dout,
            dout_layout: args.dout.1,
            lse,
            lse_layout: args.lse.1,
            dlse: dlse.as_ref().map(|((addr, _), layout)| (*addr, *layout)),
            dq,
            dq_layout: args.dq.1,
            dk,
            dk_layout: args.dk.1,
            dv,
            dv_layout: args.dv.1,
            workspace,
            workspace_len,
            softmax_scale: args.softmax_scale,
            deterministic: args.deterministic,
        };
        match prepare(plan, &raw)? {
            Some(launches) => self.launch_backward(stream, &launches),
            None => Ok(()),
        }
    }

    /// Backward attention over device addresses owned by the caller, enqueued on `stream`;
    /// returns without waiting for the GPU. Performs every check of [`Runtime::backward`]
    /// except the buffer lengths, which it cannot know.
    ///
    /// # Safety
    /// Each address must point to device memory of this runtime's context that holds at least
    /// the elements its layout spans ([`TensorLayout::span_elements`], `workspace_len` for the
    /// workspace), stays allocated until the launches have finished on `stream`, and is not
    /// written by other work meanwhile; dq, dk, dv and the workspace must not overlap each
    /// other or the inputs. `plan` must likewise outlive the launches.
    ///
    /// # Errors
    /// As [`Runtime::backward`].
    #[allow(unsafe_code)]
    pub unsafe fn backward_raw(
        &self,
        stream: &CudaStream,
        plan: &PlanView,
        args: &BackwardRaw,
    ) -> Result<(), Error> {
        self.check_stream(stream)?;
        self.check_plan(plan)?;
        self.bind_context()?;
        match prepare(plan, args)? {
            Some(launches) => self.launch_backward(stream, &launches),
            None => Ok(()),
        }
    }

    #[allow(unsafe_code)]
    fn launch_backward(&self, stream: &CudaStream, launches: &Launches) -> Result<(), Error> {
        let mut params = launches.params;
        params.bwd_head_group =
            bwd_head_group(self.l2_bytes(), &launches.params, launches.pair_bytes);
        for step in &launches.steps {
            let variant = &cm_kernels::VARIANTS[step.variant];
            let config = LaunchConfig {
                grid_dim: step.grid,
                block_dim: (variant.threads(), 1, 1),
                shared_mem_bytes: variant.dynamic_shared_bytes(),
            };
            let mut builder = stream.launch_builder(self.function(step.variant));
            builder.arg(&params);
            if step.tensor_maps {
                for map in &launches.tensor_maps {
                    builder.arg(map);
                }
            }
            // SAFETY: the function is the variant `prepare` chose for these arguments; its
            // parameters are a by-value CmBwdParams, which `params` mirrors, followed for
            // bwd_dkdv (exactly when `tensor_maps` is set) by the four CmTensorMaps of Q, dO, K
            // and V, encoded from the validated layouts at the box heights the kernel loads; the dynamic
            // shared memory is the size the kernel was compiled for (and opted in to when the
            // runtime loaded it). `prepare` checked that every address is aligned and that the
            // grid, shapes and strides match the plan and each other, and sized the workspace,
            // so the kernels touch only elements inside each layout's span; the callers
            // guarantee the spans are allocated and live (checked lengths in `backward`, the
            // caller's contract in `backward_raw`). Kernels on one stream run in order, so
            // each step sees the previous one's workspace writes.
            unsafe { builder.launch(config) }.map_err(|e| Error::driver("cuLaunchKernel", e))?;
        }
        Ok(())
    }
}
