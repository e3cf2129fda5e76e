//! Forward attention: argument checking and the launch.

use crate::layout::VECTOR_BYTES;
use crate::plan::{ws_set, ForwardArray, PlanArray, PlanLayout};
use crate::score::{Score, ScoreParams, ScoreRaw};
use crate::tma::TensorMap;
use crate::{DType, Error, LseLayout, TensorLayout};
use cm_kernels::{KernelKind, Variant};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

/// A forward launch over Rust-owned device buffers ([`crate::Runtime::forward`]).
///
/// Q is `[batch, num_heads, q_len, head_dim]`, K `[batch, num_kv_heads, kv_len, head_dim]`,
/// V `[batch, num_kv_heads, kv_len, head_dim_v]` and the output `[batch, num_heads, q_len,
/// head_dim_v]` (`num_heads % num_kv_heads == 0`; query head `h` reads KV head `h / (num_heads
/// / num_kv_heads)`; `head_dim_v == head_dim` but for the shapes of
/// [`cm_kernels::WIDE_SHAPES`]), elements of `dtype` stored as raw 16-bit words. `lse`, when given, receives the natural-log log-sum-exp of every row's scaled scores,
/// `[batch, num_heads, q_len]` fp32, `-inf` for a row with no visible key (whose output is 0).
pub struct Forward<'a> {
    pub dtype: DType,
    pub q: (&'a CudaSlice<u16>, TensorLayout),
    pub k: (&'a CudaSlice<u16>, TensorLayout),
    pub v: (&'a CudaSlice<u16>, TensorLayout),
    pub out: (&'a mut CudaSlice<u16>, TensorLayout),
    pub lse: Option<(&'a mut CudaSlice<f32>, LseLayout)>,
    /// Multiplies `q . k` before the softmax; usually `1 / sqrt(head_dim)`.
    pub softmax_scale: f32,
    /// Softcap, biases and sinks ([`crate::score`]); [`Score::NONE`] for plain attention.
    pub score: Score<'a>,
}

/// A forward launch over device addresses owned by someone else (e.g. torch's `data_ptr()`),
/// for [`crate::Runtime::forward_raw`]. Same shapes and meaning as [`Forward`]; each address
/// is the element at index `[0, 0, 0, 0]` (`[0, 0, 0]` for `lse`).
#[derive(Clone, Copy, Debug)]
pub struct ForwardRaw {
    pub dtype: DType,
    pub q: u64,
    pub q_layout: TensorLayout,
    pub k: u64,
    pub k_layout: TensorLayout,
    pub v: u64,
    pub v_layout: TensorLayout,
    pub out: u64,
    pub out_layout: TensorLayout,
    pub lse: Option<(u64, LseLayout)>,
    pub softmax_scale: f32,
    pub score: ScoreRaw,
}

/// Kernel parameters; mirrors `CmFwdParams` in `kernels/common.cuh` field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct FwdParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    pub(crate) q_strides: [i64; 3],
    k_strides: [i64; 3],
    v_strides: [i64; 3],
    pub(crate) o_strides: [i64; 3],
    pub(crate) lse_strides: [i64; 2],
    m_block_order: u64,
    kv_offsets: u64,
    kv_indices: u64,
    full_kv_offsets: u64,
    full_kv_indices: u64,
    partial_row_mask: u64,
    /// Set by the runtime at launch (its per-stream work counter), for FwdWs.
    pub(crate) scheduler: u64,
    mask_index: u64,
    /// The paged forward's cache addressing ([`crate::prefill`]); 0 for the others.
    pub(crate) block_table: u64,
    pub(crate) key_blocks: u64,
    pub(crate) block_table_stride: i64,
    pub(crate) q_len: u32,
    pub(crate) kv_len: u32,
    pub(crate) heads_per_kv_head: u32,
    scale_log2: f32,
    num_m_blocks: u32,
    pub(crate) num_heads: u32,
    pub(crate) batch: u32,
    num_masks: u32,
    mask_strides: [u32; 2],
    /// Set by the runtime at launch from its L2 size, for FwdWs ([`head_group`]).
    pub(crate) ws_head_group: u32,
    pub(crate) page_shift: u32,
    pub(crate) page_rows: u32,
    pub(crate) table_rows: u32,
    pub(crate) table_cols: u32,
    pad: u32,
    score: ScoreParams,
}

const _: () = assert!(
    std::mem::size_of::<FwdParams>() == 368,
    "must match sizeof(CmFwdParams)"
);

// SAFETY: FwdParams is #[repr(C)], Copy, holds only integers and floats, and has the exact
// layout of CmFwdParams (8-byte fields first, no padding; size checked above), so the driver
// may copy its bytes as the kernel's by-value parameter.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for FwdParams {}

/// What a validated launch needs: the kernel, the grid and the parameters (for
/// [`KernelKind::FwdWs`] also the TMA descriptors of Q, K and V, and a grid of one CTA per
/// work item that the runtime caps at one per SM and gives a work counter: the kernel is
/// persistent); `None` when the launch has no work (an empty batch, no heads or no query rows).
pub(crate) struct Launch {
    pub(crate) variant: usize,
    pub(crate) config: LaunchConfig,
    pub(crate) params: FwdParams,
    pub(crate) tensor_maps: Option<[TensorMap; 3]>,
    /// Bytes of K and V that one (batch, query head) pair reads (its kv head's, shared by the
    /// query heads of a GQA group), for [`head_group`].
    pub(crate) kv_bytes_per_pair: u64,
    /// batch x num_heads.
    pub(crate) pairs: u64,
}

/// How many (batch, head) pairs `fwd_ws` (and, over kv heads, `bwd_dkdv`) interleaves, rank
/// by rank (every pair's heaviest block first): as many as three quarters of the L2 holds the
/// streamed tensors of (`bytes_per_pair`: K and V in the forward, Q and dO in the backward;
/// so the CTAs of a group keep re-reading them from L2), at least 1, at most `pairs`. One
/// pair after the other would start the last pair's heaviest block only after every other
/// pair's work, which for masks of long and short documents ends the launch a whole block
/// late.
pub(crate) fn head_group(l2_bytes: u64, bytes_per_pair: u64, pairs: u64) -> u32 {
    let fit = (l2_bytes / 4 * 3) / bytes_per_pair.max(1);
    fit.clamp(1, pairs.max(1)).min(u64::from(u32::MAX)) as u32
}

const MAX_GRID_YZ: usize = 65535;
const MAX_SEQ_LEN: u32 = i32::MAX as u32 - 256;

pub(crate) fn check_addr(name: &str, addr: u64, align: u64) -> Result<(), Error> {
    if addr % align != 0 {
        return Err(Error::invalid(format!(
            "{name}: address {addr:#x} is not {align}-byte aligned, which the kernels' vector accesses need"
        )));
    }
    Ok(())
}

/// Every host-side check of a forward's arguments against each other and the plan: no device
/// work, no driver call (so it runs, and is tested, without a GPU). The checks are the same
/// for every forward kernel; only `fwd_ws`'s TMA descriptors, encoded at launch, need the
/// driver.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first argument that fails, as
/// [`crate::Runtime::forward`] lists them.
pub fn check_forward(plan: &PlanLayout, a: &ForwardRaw) -> Result<(), Error> {
    // The runtime's default kernel, the one built at every shape.
    prepare(plan, a, (KernelKind::FwdWs, None), false).map(|_| ())
}

/// The variant of `kernel_kind` a forward over `plan` runs at `dtype` and `(head_dim,
/// head_dim_v)`, with or without score terms, as an index into [`cm_kernels::VARIANTS`]:
/// where several tiles are built (`fwd_ws` at head_dim 64), `tile` when given (the runtime's
/// [`crate::Runtime::set_forward_tile`], for tests and benchmarks), else the one the plan
/// ranks first ([`crate::plan::ws_order`]). `None` when the shape (or that tile) is not built.
pub fn forward_variant(
    plan: &PlanLayout,
    kernel_kind: KernelKind,
    dtype: DType,
    (head_dim, head_dim_v): (u32, u32),
    scored: bool,
    tile: Option<(u32, u32)>,
) -> Option<usize> {
    let mut built = cm_kernels::find_variants(kernel_kind, dtype, head_dim, head_dim_v, scored);
    if let Some(tile) = tile {
        return built.find(|&i| cm_kernels::VARIANTS[i].tile() == tile);
    }
    let order = plan.ws_order();
    let rank = |i: &usize| {
        let v = &cm_kernels::VARIANTS[*i];
        match ws_set(v.tile()) {
            Some(set) if v.kernel == KernelKind::FwdWs => order.iter().position(|&s| s == set),
            _ => None,
        }
    };
    built.min_by_key(rank)
}

/// Every host-side check of a forward launch; no device work and no synchronisation. With
/// `encode_maps`, also `fwd_ws`'s TMA descriptors (the one step that calls the driver).
pub(crate) fn prepare(
    plan: &PlanLayout,
    a: &ForwardRaw,
    (kernel_kind, tile): (KernelKind, Option<(u32, u32)>),
    encode_maps: bool,
) -> Result<Option<Launch>, Error> {
    let [b, h, sq, d] = a.q_layout.shape;
    let [kb, h_kv, skv, kd] = a.k_layout.shape;
    let dv = a.v_layout.shape[3];
    let head_dim = u32::try_from(d).unwrap_or(u32::MAX);
    let head_dim_v = u32::try_from(dv).unwrap_or(u32::MAX);
    let scored = a.score.modifies_logits();
    if scored && !kernel_kind.has_score_variant() {
        return Err(Error::invalid(format!(
            "score terms that change the logits (softcap, biases) run on the default forward kernel fwd_ws, not {}; \
             Runtime::set_forward_kernel(KernelKind::FwdWs)",
            kernel_kind.name()
        )));
    }
    a.score.check(plan.q_len, plan.kv_len)?;
    let dims = (head_dim, head_dim_v);
    let variant = forward_variant(plan, kernel_kind, a.dtype, dims, scored, tile)
        .ok_or_else(|| {
            if let (Some((m, n)), Some(_)) = (tile, forward_variant(plan, kernel_kind, a.dtype, dims, scored, None)) {
                return Error::invalid(format!(
                    "{} has no {m}x{n} tile at head_dim = {d} with head_dim_v = {dv}{} (Runtime::set_forward_tile)",
                    kernel_kind.name(),
                    if scored { " with score terms" } else { "" },
                ));
            }
            let built = cm_kernels::built_head_dims(kernel_kind, a.dtype, scored);
            Error::invalid(format!(
                "q / v: head_dim = {d} with head_dim_v = {dv} is not supported by {}{} at {}; \
                 built head dims: {}",
                kernel_kind.name(),
                if scored { " with score terms" } else { "" },
                a.dtype,
                cm_kernels::head_dims_text(&built)
            ))
        })?;
    let kernel: &Variant = &cm_kernels::VARIANTS[variant];
    if (kb, kd) != (b, d) {
        return Err(Error::invalid(format!(
            "k: shape {:?} does not match q's batch = {b} and head_dim = {d}",
            a.k_layout.shape
        )));
    }
    if a.v_layout.shape[..3] != a.k_layout.shape[..3] {
        return Err(Error::invalid(format!(
            "v: shape {:?} differs from k's shape {:?} in [batch, num_kv_heads, kv_len]",
            a.v_layout.shape, a.k_layout.shape
        )));
    }
    if a.out_layout.shape != [b, h, sq, dv] {
        return Err(Error::invalid(format!(
            "out: shape {:?}, expected [batch, num_heads, q_len, head_dim_v] = {:?}",
            a.out_layout.shape,
            [b, h, sq, dv]
        )));
    }
    if sq != plan.q_len as usize || skv != plan.kv_len as usize {
        return Err(Error::invalid(format!(
            "q_len = {sq} and kv_len = {skv} (from q and k) do not match the plan's q_len = {} and kv_len = {}",
            plan.q_len, plan.kv_len
        )));
    }
    // The kernels do 32-bit signed arithmetic on key positions.
    if plan.q_len > MAX_SEQ_LEN || plan.kv_len > MAX_SEQ_LEN {
        return Err(Error::invalid(format!(
            "q_len = {} and kv_len = {} must each be at most {MAX_SEQ_LEN}",
            plan.q_len, plan.kv_len
        )));
    }
    if h_kv == 0 && h > 0 || h_kv > 0 && h % h_kv != 0 {
        return Err(Error::invalid(format!(
            "k: num_kv_heads = {h_kv} must divide q's num_heads = {h} (MHA, GQA and MQA need num_heads % num_kv_heads == 0)"
        )));
    }
    if let Some((_, lse)) = &a.lse {
        if lse.shape != [b, h, sq] {
            return Err(Error::invalid(format!(
                "lse: shape {:?}, expected [batch, num_heads, q_len] = {:?}",
                lse.shape,
                [b, h, sq]
            )));
        }
    }
    if !a.softmax_scale.is_finite() {
        return Err(Error::invalid(format!(
            "softmax_scale = {} must be finite",
            a.softmax_scale
        )));
    }
    // Every plan carries FwdWs's lists at each of its tiles; the other kernels read the plan's own.
    let (tile_m, tile_n) = cm_kernels::TILE;
    if (plan.tile.block_m, plan.tile.block_n) != (tile_m, tile_n) {
        return Err(Error::invalid(format!(
            "the plan was built at tile {}x{}, the kernels need {tile_m}x{tile_n}; upload it with Runtime::upload_plan",
            plan.tile.block_m, plan.tile.block_n
        )));
    }
    let elem = a.dtype.size_bytes() as u64;
    a.q_layout.validate("q", elem, false)?;
    a.k_layout.validate("k", elem, false)?;
    a.v_layout.validate("v", elem, false)?;
    a.out_layout.validate("out", elem, true)?;
    for (name, addr) in [("q", a.q), ("k", a.k), ("v", a.v), ("out", a.out)] {
        check_addr(name, addr, VECTOR_BYTES)?;
    }
    if let Some((addr, lse)) = &a.lse {
        lse.validate("lse")?;
        check_addr("lse", *addr, 4)?;
    }
    let mask_strides = plan.mask_strides(b, h)?;
    if b > MAX_GRID_YZ || h > MAX_GRID_YZ {
        return Err(Error::invalid(format!(
            "batch = {b} and num_heads = {h} must each be at most {MAX_GRID_YZ} (CUDA grid limits)"
        )));
    }
    if b == 0 || h == 0 || sq == 0 {
        return Ok(None);
    }

    let s3 = |l: &TensorLayout| [l.strides[0], l.strides[1], l.strides[2]];
    let ws = matches!(kernel_kind, KernelKind::FwdWs | KernelKind::FwdWsPaged);
    // The forward lists at the kernel's tile and its partial tiles' row bits: fwd_ws's set,
    // or the plan's own tile.
    let (lists, num_m_blocks) = if ws {
        let set = ws_set(kernel.tile()).expect("FWD_WS_TILES holds every fwd_ws tile");
        (
            ForwardArray::ALL.map(|a| PlanArray::Ws(a, set)),
            plan.ws_num_m_blocks[set],
        )
    } else {
        (ForwardArray::ALL.map(PlanArray::Forward), plan.num_m_blocks)
    };
    let params = FwdParams {
        q: a.q,
        k: a.k,
        v: a.v,
        o: a.out,
        lse: a.lse.map_or(0, |(addr, _)| addr),
        q_strides: s3(&a.q_layout),
        k_strides: s3(&a.k_layout),
        v_strides: s3(&a.v_layout),
        o_strides: s3(&a.out_layout),
        lse_strides: a.lse.map_or([0, 0], |(_, l)| [l.strides[0], l.strides[1]]),
        m_block_order: plan.addr(lists[0])?,
        kv_offsets: plan.addr(lists[1])?,
        kv_indices: plan.addr(lists[2])?,
        full_kv_offsets: plan.addr(lists[3])?,
        full_kv_indices: plan.addr(lists[4])?,
        partial_row_mask: plan.addr(lists[5])?,
        scheduler: 0,
        mask_index: plan.addr(PlanArray::MaskIndex)?,
        block_table: 0,
        key_blocks: 0,
        block_table_stride: 0,
        q_len: plan.q_len,
        kv_len: plan.kv_len,
        heads_per_kv_head: (h / h_kv) as u32,
        scale_log2: a.softmax_scale * std::f32::consts::LOG2_E,
        num_m_blocks,
        num_heads: h as u32,
        batch: b as u32,
        num_masks: plan.num_masks,
        mask_strides,
        ws_head_group: 1,
        page_shift: 0,
        page_rows: 0,
        table_rows: 0,
        table_cols: 0,
        pad: 0,
        score: a.score.params(plan.q_len, plan.kv_len, false),
    };
    let tensor_maps = if ws && encode_maps {
        let (rows, keys) = (kernel.tile().0, kernel.key_step());
        Some([
            TensorMap::encode("q", a.dtype, a.q, &a.q_layout, rows)?,
            TensorMap::encode("k", a.dtype, a.k, &a.k_layout, keys)?,
            TensorMap::encode("v", a.dtype, a.v, &a.v_layout, keys)?,
        ])
    } else {
        None
    };
    let grid_dim = if ws {
        let items = u64::from(num_m_blocks) * h as u64 * b as u64;
        let items = u32::try_from(items).map_err(|_| {
            Error::invalid(format!(
                "{num_m_blocks} query blocks x num_heads = {h} x batch = {b} = {items} work items exceed 2^32"
            ))
        })?;
        (items, 1, 1)
    } else {
        (num_m_blocks, h as u32, b as u32)
    };
    let config = LaunchConfig {
        grid_dim,
        block_dim: (kernel.threads(), 1, 1),
        shared_mem_bytes: kernel.dynamic_shared_bytes(),
    };
    let elem = a.dtype.size_bytes() as u64;
    let kv_bytes_per_pair =
        u64::from(plan.kv_len) * (d + dv) as u64 * elem / (h / h_kv).max(1) as u64;
    Ok(Some(Launch {
        variant,
        config,
        params,
        tensor_maps,
        kv_bytes_per_pair,
        pairs: b as u64 * h as u64,
    }))
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::plan::{HostPlan, PlanLayout, PlanLists};
    use crate::PLAN_ARRAY_COUNT;
    use cm_plan::rows::RowIntervals;
    use cm_plan::tiles::TileShape;

    /// The layout of a real descriptor at made-up (aligned) addresses: enough for the
    /// argument checks, which never read device memory.
    fn layout(q_len: u32, kv_len: u32, masks: usize, mask_dims: [usize; 2]) -> PlanLayout {
        let (block_m, block_n) = cm_kernels::TILE;
        let tile = TileShape { block_m, block_n };
        let rows: Vec<RowIntervals> = (0..masks)
            .map(|m| {
                let rows: Vec<Vec<(u32, u32)>> = (0..q_len)
                    .map(|q| vec![(0, (q + 1 + m as u32).min(kv_len))])
                    .collect();
                RowIntervals::from_rows(kv_len, &rows).unwrap()
            })
            .collect();
        let refs: Vec<&RowIntervals> = rows.iter().collect();
        let index: Vec<u32> = (0..mask_dims[0] * mask_dims[1])
            .map(|i| (i % masks) as u32)
            .collect();
        let host = HostPlan::build_masks(&refs, &index, mask_dims, tile, PlanLists::All).unwrap();
        let mut arrays = [(0u64, 0usize); PLAN_ARRAY_COUNT];
        for (i, (slot, a)) in arrays.iter_mut().zip(host.arrays()).enumerate() {
            *slot = (0x100_0000 * (i as u64 + 1), a.len());
        }
        let dims = mask_dims.map(|d| d as u32);
        PlanLayout::new(
            q_len,
            kv_len,
            tile,
            masks as u32,
            dims,
            arrays,
            PlanLists::All,
        )
        .unwrap()
    }

    fn args(b: usize, h: usize, h_kv: usize, sq: usize, skv: usize, d: usize) -> ForwardRaw {
        ForwardRaw {
            dtype: DType::Bf16,
            q: 0x1000_0000,
            q_layout: TensorLayout::contiguous([b, h, sq, d]),
            k: 0x2000_0000,
            k_layout: TensorLayout::contiguous([b, h_kv, skv, d]),
            v: 0x3000_0000,
            v_layout: TensorLayout::contiguous([b, h_kv, skv, d]),
            out: 0x4000_0000,
            out_layout: TensorLayout::contiguous([b, h, sq, d]),
            lse: Some((0x5000_0000, LseLayout::contiguous([b, h, sq]))),
            softmax_scale: 0.125,
            score: crate::ScoreRaw::default(),
        }
    }

    /// The backward of `f` over gradients at fixed addresses (dO, dQ, dK and dV shaped as the
    /// output, Q, K and V), no dlse, an empty workspace, the fast mode.
    fn backward_of(f: &ForwardRaw) -> Result<crate::BackwardRaw, Error> {
        crate::BackwardRaw::from_forward(
            f,
            (0x6000_0000, f.out_layout),
            None,
            (0x7000_0000, f.q_layout),
            (0x8000_0000, f.k_layout),
            (0x9000_0000, f.v_layout),
            (0xa000_0000, 0),
            false,
        )
    }

    /// The layout of one mask's descriptor (`rows[q]` its intervals) at made-up addresses.
    fn layout_of(rows: &RowIntervals) -> PlanLayout {
        let (block_m, block_n) = cm_kernels::TILE;
        let tile = TileShape { block_m, block_n };
        let host = HostPlan::build(rows, tile);
        let mut arrays = [(0u64, 0usize); PLAN_ARRAY_COUNT];
        for (i, (slot, a)) in arrays.iter_mut().zip(host.arrays()).enumerate() {
            *slot = (0x100_0000 * (i as u64 + 1), a.len());
        }
        PlanLayout::new(
            rows.q_len(),
            rows.kv_len(),
            tile,
            1,
            [1, 1],
            arrays,
            PlanLists::All,
        )
        .unwrap()
    }

    /// At head_dim 64 `fwd_ws` has a 128-row and a 192-row variant: a causal plan (the
    /// deeper tile wastes about 1% more pairs) runs the 192-row one, a narrow sliding window
    /// (a 192-row block spans 64 more keys of diagonal per tile) the 128-row one; with score
    /// terms or at head_dim 128 there is one variant, and unbuilt shapes have none.
    #[test]
    fn fwd_ws_picks_its_tile_by_the_plans_listed_tiles() {
        let n = 8192u32;
        let causal: Vec<Vec<(u32, u32)>> = (0..n).map(|q| vec![(0, q + 1)]).collect();
        let window: Vec<Vec<(u32, u32)>> = (0..n)
            .map(|q| vec![(q.saturating_sub(255), q + 1)])
            .collect();
        let causal = layout_of(&RowIntervals::from_rows(n, &causal).unwrap());
        let window = layout_of(&RowIntervals::from_rows(n, &window).unwrap());
        let pick = |plan: &PlanLayout, d: u32, scored: bool| {
            forward_variant(plan, KernelKind::FwdWs, DType::Bf16, (d, d), scored, None)
                .map(|i| cm_kernels::VARIANTS[i].tile())
        };
        assert_eq!(pick(&causal, 64, false), Some((192, 128)));
        assert_eq!(pick(&window, 64, false), Some((128, 128)));
        assert_eq!(pick(&causal, 64, true), Some((128, 128)));
        assert_eq!(pick(&causal, 128, false), Some((128, 128)));
        assert_eq!(pick(&causal, 96, false), None);
        // A pinned tile wins over the plan's ranking, where that tile is built.
        let pinned = |plan: &PlanLayout, d: u32, tile: (u32, u32)| {
            forward_variant(
                plan,
                KernelKind::FwdWs,
                DType::Bf16,
                (d, d),
                false,
                Some(tile),
            )
            .map(|i| cm_kernels::VARIANTS[i].tile())
        };
        assert_eq!(pinned(&causal, 64, (128, 128)), Some((128, 128)));
        assert_eq!(pinned(&window, 64, (192, 128)), Some((192, 128)));
        assert_eq!(pinned(&causal, 128, (192, 128)), None);
        let a128 = args(1, 2, 2, n as usize, n as usize, 128);
        let e = prepare(&causal, &a128, (KernelKind::FwdWs, Some((192, 128))), false)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("fwd_ws has no 192x128 tile at head_dim = 128"),
            "{e}"
        );
        // The launch reads the chosen set's lists: 8192 rows are 43 blocks of 192.
        let a = args(1, 2, 2, n as usize, n as usize, 64);
        let launch = prepare(&causal, &a, (KernelKind::FwdWs, None), false)
            .unwrap()
            .unwrap();
        assert_eq!(launch.params.num_m_blocks, 43);
        assert_eq!(launch.config.block_dim.0, 512);
    }

    fn err(plan: &PlanLayout, a: &ForwardRaw) -> String {
        match prepare(plan, a, (KernelKind::FwdSimple, None), false) {
            Ok(_) => "accepted".to_string(),
            Err(e) => e.to_string(),
        }
    }

    /// Every wrong argument of a forward comes back as an error naming the tensor and the
    /// value, checked on the host before any launch (no GPU needed); right ones are accepted,
    /// a plan of several masks included.
    #[test]
    fn every_wrong_forward_argument_is_named() {
        let plan = layout(70, 90, 1, [1, 1]);
        let good = args(2, 4, 2, 70, 90, 64);
        assert_eq!(err(&plan, &good), "accepted");
        let per_head = layout(70, 90, 3, [1, 4]);
        assert_eq!(err(&per_head, &good), "accepted");
        let cases: Vec<(&str, ForwardRaw, &str)> = vec![
            (
                "head_dim",
                args(2, 4, 2, 70, 90, 96),
                "head_dim = 96 with head_dim_v = 96 is not supported by fwd_simple at bf16; built head dims: 64, 128",
            ),
            (
                "q_len",
                args(2, 4, 2, 71, 90, 64),
                "do not match the plan's q_len = 70",
            ),
            (
                "kv heads",
                args(2, 4, 3, 70, 90, 64),
                "num_kv_heads = 3 must divide",
            ),
            (
                "k batch",
                {
                    let mut a = good;
                    a.k_layout = TensorLayout::contiguous([1, 2, 90, 64]);
                    a
                },
                "does not match q's batch = 2",
            ),
            (
                "v shape",
                {
                    let mut a = good;
                    a.v_layout = TensorLayout::contiguous([2, 2, 91, 64]);
                    a
                },
                "v: shape [2, 2, 91, 64] differs from k's shape [2, 2, 90, 64] in [batch, num_kv_heads, kv_len]",
            ),
            (
                "out shape",
                {
                    let mut a = good;
                    a.out_layout = TensorLayout::contiguous([2, 3, 70, 64]);
                    a
                },
                "out: shape [2, 3, 70, 64], expected [batch, num_heads, q_len, head_dim_v] = [2, 4, 70, 64]",
            ),
            (
                "lse shape",
                {
                    let mut a = good;
                    a.lse = Some((0x5000_0000, LseLayout::contiguous([2, 4, 71])));
                    a
                },
                "lse: shape [2, 4, 71]",
            ),
            (
                "scale",
                {
                    let mut a = good;
                    a.softmax_scale = f32::NAN;
                    a
                },
                "softmax_scale = NaN must be finite",
            ),
            (
                "alignment",
                {
                    let mut a = good;
                    a.k = 0x2000_0008;
                    a
                },
                "k: address 0x20000008 is not 16-byte aligned",
            ),
            (
                "last-dim stride",
                {
                    let mut a = good;
                    a.q_layout.strides[3] = 2;
                    a
                },
                "q",
            ),
        ];
        for (what, a, needle) in cases {
            let got = err(&plan, &a);
            assert!(got.contains(needle), "{what}: {got}");
        }
        // A plan whose masks are for 3 heads, launched over 4.
        let three = layout(70, 90, 3, [1, 3]);
        assert!(err(&three, &good).contains("the plan's masks are for num_heads = 3"));
        let batches = layout(70, 90, 2, [3, 1]);
        assert!(err(&batches, &good).contains("the plan's masks are for batch = 3"));
    }

    /// The wide shapes run on fwd_ws (and the backward): head_dim 256 and 192 with head_dim_v
    /// 128 are accepted there (V and the output at head_dim_v), refused by the reference
    /// kernels and at any other pairing, each error naming the shape and listing the built
    /// ones.
    #[test]
    fn wide_head_dims_are_fwd_ws_shapes() {
        let plan = layout(70, 90, 1, [1, 1]);
        let ws = |a: &ForwardRaw| match prepare(&plan, a, (KernelKind::FwdWs, None), false) {
            Ok(_) => "accepted".to_string(),
            Err(e) => e.to_string(),
        };
        let shaped = |d: usize, dv: usize| {
            let mut a = args(2, 4, 2, 70, 90, d);
            a.v_layout = TensorLayout::contiguous([2, 2, 90, dv]);
            a.out_layout = TensorLayout::contiguous([2, 4, 70, dv]);
            a
        };
        assert_eq!(ws(&shaped(256, 256)), "accepted");
        assert_eq!(ws(&shaped(192, 128)), "accepted");
        // Sinks alone need no score variant (there is none at 256); a softcap does.
        let mut sinks = shaped(256, 256);
        sinks.score.sinks = 0x3000_0000;
        assert_eq!(ws(&sinks), "accepted");
        sinks.score.softcap = 30.0;
        assert!(ws(&sinks).contains("with score terms"), "{}", ws(&sinks));
        assert_eq!(
            check_forward(&plan, &shaped(192, 128)).map_err(|e| e.to_string()),
            Ok(())
        );
        let built = "built head dims: 64, 128, 192 (head_dim_v 128), 256";
        for (d, dv) in [(192, 192), (256, 128), (128, 64), (96, 96)] {
            let got = ws(&shaped(d, dv));
            assert!(
                got.contains(&format!(
                    "head_dim = {d} with head_dim_v = {dv} is not supported by fwd_ws"
                )) && got.contains(built),
                "{got}"
            );
        }
        assert!(err(&plan, &shaped(256, 256)).contains("built head dims: 64, 128"));
        let mut wrong_out = shaped(192, 128);
        wrong_out.out_layout = TensorLayout::contiguous([2, 4, 70, 192]);
        assert!(ws(&wrong_out).contains("out: shape [2, 4, 70, 192], expected"));

        // The backward is built at every shape without score terms: the same arguments pass
        // the shape check and reach the workspace's. With score terms (built forward at
        // 192 / 128) it is refused by name, before its own checks.
        let backward_raw = |d: usize, dv: usize, softcap: f32| {
            let mut f = shaped(d, dv);
            f.score.softcap = softcap;
            backward_of(&f).unwrap()
        };
        let check =
            |raw: &crate::BackwardRaw| crate::check_backward(&plan, raw).map_err(|e| e.to_string());
        let backward = |d: usize, dv: usize, softcap: f32| check(&backward_raw(d, dv, softcap));
        for (d, dv) in cm_kernels::WIDE_SHAPES {
            let got = backward(d as usize, dv as usize, 0.0).unwrap_err();
            assert!(got.contains("workspace"), "{got}");
        }
        for (d, dv) in cm_kernels::WIDE_SCORE_SHAPES {
            let got = backward(d as usize, dv as usize, 30.0).unwrap_err();
            assert!(
                got.contains(&format!(
                    "head_dim = {d} with head_dim_v = {dv} and score terms runs forward only; the \
                     backward with score terms is built for head dims 64, 128 at bf16"
                )),
                "{got}"
            );
        }
        assert!(backward(128, 128, 0.0).unwrap_err().contains("workspace"));
        assert!(backward(128, 128, 30.0).unwrap_err().contains("workspace"));
        // Sinks alone change only the normalisation: the plain kernels run them, so every
        // wide shape's backward takes them (and its forward needs no score variant).
        for (d, dv) in cm_kernels::WIDE_SHAPES {
            let mut raw = backward_raw(d as usize, dv as usize, 0.0);
            raw.score.sinks = 0x3000_0000;
            assert!(!raw.score.modifies_logits());
            let got = check(&raw).unwrap_err();
            assert!(got.contains("workspace"), "{got}");
        }
        // At MLA's shape dO is shaped as the output and dV as V, not as Q and K.
        let mut raw = backward_raw(192, 128, 0.0);
        raw.dout_layout = raw.q_layout;
        assert!(check(&raw)
            .unwrap_err()
            .contains("dout: shape [2, 4, 70, 192] differs from out's shape [2, 4, 70, 128]"));
        let mut raw = backward_raw(192, 128, 0.0);
        raw.dv_layout = raw.k_layout;
        assert!(check(&raw)
            .unwrap_err()
            .contains("dv: shape [2, 2, 90, 192] differs from v's shape [2, 2, 90, 128]"));
        let mut raw = backward_raw(192, 128, 0.0);
        raw.dk_layout = raw.v_layout;
        assert!(check(&raw)
            .unwrap_err()
            .contains("dk: shape [2, 2, 90, 128] differs from k's shape [2, 2, 90, 192]"));
    }

    /// `BackwardRaw::from_forward` puts each of the forward's arguments and each gradient at
    /// its own field (no two swapped), and refuses a forward without lse by name.
    #[test]
    fn backward_from_forward_keeps_every_argument_in_place() {
        // Every layout differs from the others (V and the output narrower than Q and K).
        let mut f = args(2, 4, 2, 70, 90, 64);
        f.v_layout = TensorLayout::contiguous([2, 2, 90, 32]);
        f.out_layout = TensorLayout::contiguous([2, 4, 70, 32]);
        f.softmax_scale = 0.25;
        f.score.softcap = 30.0;
        let dlse = (0x5800_0000, LseLayout::contiguous([2, 4, 70]));
        let b = crate::BackwardRaw::from_forward(
            &f,
            (0x6000_0000, f.out_layout),
            Some(dlse),
            (0x7000_0000, f.q_layout),
            (0x8000_0000, f.k_layout),
            (0x9000_0000, f.v_layout),
            (0xa000_0000, 1234),
            true,
        )
        .unwrap();
        assert_eq!(b.dtype, f.dtype);
        let tensors = [
            (b.q, b.q_layout, f.q, f.q_layout),
            (b.k, b.k_layout, f.k, f.k_layout),
            (b.v, b.v_layout, f.v, f.v_layout),
            (b.out, b.out_layout, f.out, f.out_layout),
            (b.dout, b.dout_layout, 0x6000_0000, f.out_layout),
            (b.dq, b.dq_layout, 0x7000_0000, f.q_layout),
            (b.dk, b.dk_layout, 0x8000_0000, f.k_layout),
            (b.dv, b.dv_layout, 0x9000_0000, f.v_layout),
        ];
        for (i, (addr, layout, want_addr, want_layout)) in tensors.into_iter().enumerate() {
            assert_eq!((addr, layout), (want_addr, want_layout), "tensor {i}");
        }
        assert_eq!(Some((b.lse, b.lse_layout)), f.lse);
        assert_eq!(b.dlse, Some(dlse));
        assert_eq!((b.workspace, b.workspace_len), (0xa000_0000, 1234));
        assert_eq!((b.softmax_scale, b.deterministic), (0.25, true));
        assert_eq!(b.score.softcap, 30.0);

        f.lse = None;
        let got = backward_of(&f).unwrap_err();
        assert!(got.to_string().contains("lse: the backward needs"), "{got}");
    }

    #[test]
    fn head_groups_fill_three_quarters_of_the_l2() {
        let mib = 1u64 << 20;
        // H200: 50 MiB of L2. K and V of one pair at 8K, head_dim 128, bf16: 4 MiB.
        assert_eq!(head_group(50 * mib, 4 * mib, 16), 9);
        assert_eq!(head_group(50 * mib, 16 * mib, 16), 2);
        // More room than pairs; K and V larger than the L2; degenerate sizes.
        assert_eq!(head_group(50 * mib, mib, 4), 4);
        assert_eq!(head_group(50 * mib, 64 * mib, 16), 1);
        assert_eq!(head_group(0, 0, 0), 1);
        assert_eq!(head_group(u64::MAX, 1, u64::MAX), u32::MAX);
    }
}
