//! Serving's prefill-chunk path: a step's rows through the warp-specialised forward
//! ([`crate::KernelKind::FwdWsPaged`]) with K and V read from a paged KV cache
//! ([`crate::Runtime::prefill_raw`]).
//!
//! The step is laid out by `cm_serve::StepPlan::prefill` at [`PREFILL_KEY_BLOCK`] keys and
//! [`PREFILL_ROW_BLOCK`] rows per block: every sequence's keys padded to whole blocks of a
//! virtual key space, with for each virtual block `n` the int32 entry `key_blocks[n] = (seq,
//! first_key, valid_keys, 0)`, and every sequence's rows padded to whole query tiles
//! (`q_rows` virtual rows; the caller places each step row at its virtual row, and drops the
//! padding rows' outputs). Its rows are an ordinary one-mask plan over `q_rows x
//! num_key_blocks * PREFILL_KEY_BLOCK` ([`crate::HostPlan::build_masks`] with `mask_index =
//! [1, 1]` and [`prefill_lists`]), uploaded like any other. The kernel loads key block `n` in
//! boxes of `min(page_size, PREFILL_KEY_BLOCK)` rows: logical key `p` of sequence `s` is slot
//! `p % page_size` of page `block_table[s, p / page_size]` (vLLM's / FlashInfer's layout, as in
//! [`crate::decode`]).

use crate::forward::{check_addr, prepare, ForwardRaw, Launch};
use crate::layout::{check_no_overlap, check_strides, VECTOR_BYTES};
use crate::plan::{ws_set, HostPlan, PlanLayout, PlanLists};
use crate::score::ScoreRaw;
use crate::tma::TensorMap;
use crate::{DType, Error, KernelKind, LseLayout, TensorLayout};
use cm_plan::rows::RowIntervals;
use cm_plan::tiles::TileShape;
use cudarc::driver::CudaSlice;

/// Keys per block of the paged forward's virtual key space: its tile's `block_n`.
pub const PREFILL_KEY_BLOCK: u32 = 128;

/// Rows per block of the paged forward's virtual rows: its tile's `block_m`, so that no query
/// tile holds rows of two sequences.
pub const PREFILL_ROW_BLOCK: u32 = 128;

const _: () = {
    let tile = cm_kernels::kernel_tiles::<1>(KernelKind::FwdWsPaged)[0];
    assert!(
        tile.0 == PREFILL_ROW_BLOCK && tile.1 == PREFILL_KEY_BLOCK,
        "the virtual row and key blocks are the paged forward's tiles"
    );
};

/// The descriptor arrays the paged forward reads: the forward lists at its tile, the
/// 128 x 128 [`crate::PlanArray::Ws`] set, and `mask_index`. A prefill plan built with these
/// alone ([`crate::HostPlan::build_masks`], [`crate::Runtime::upload_prefill_plan`]) costs a
/// fraction of a full plan's host time and memory, which matters for a layout rebuilt every
/// serving step; a plan holding every list serves too.
pub fn prefill_lists() -> PlanLists {
    let tile = cm_kernels::kernel_tiles::<1>(KernelKind::FwdWsPaged)[0];
    PlanLists::Ws(ws_set(tile).expect("the paged forward's tile is one of fwd_ws's"))
}

/// The descriptor of a prefill layout's rows over its virtual keys (`cm_serve::Prefill::rows`):
/// one mask for every head at the plan's tile, holding only [`prefill_lists`].
///
/// # Errors
/// As [`crate::HostPlan::build_masks`].
pub fn prefill_host_plan(rows: &RowIntervals) -> Result<HostPlan, Error> {
    let (block_m, block_n) = cm_kernels::TILE;
    let tile = TileShape { block_m, block_n };
    HostPlan::build_masks(&[rows], &[0], [1, 1], tile, prefill_lists())
}

/// Smallest page the paged forward reads: a TMA box of fewer rows would not fill a 1 KB
/// swizzle atom (8 rows of 128 bytes).
pub const MIN_PREFILL_PAGE_SIZE: usize = 8;

/// A prefill step over device addresses owned by the caller (e.g. torch's `data_ptr()`), for
/// [`crate::Runtime::prefill_raw`]. Strides are in elements; each address is the element at
/// index 0 of its tensor.
#[derive(Clone, Copy, Debug)]
pub struct PrefillRaw {
    pub dtype: DType,
    /// `[q_rows, num_heads, head_dim]` (the layout's virtual rows), last stride 1.
    pub q: u64,
    pub q_shape: [usize; 3],
    pub q_strides: [i64; 3],
    /// `[num_pages, page_size, num_kv_heads, head_dim]` each (`head_dim_v == head_dim`), last
    /// stride 1; `page_size` a power of two of at least [`MIN_PREFILL_PAGE_SIZE`].
    pub k_cache: u64,
    pub v_cache: u64,
    pub cache_shape: [usize; 4],
    pub k_strides: [i64; 4],
    pub v_strides: [i64; 4],
    /// `[q_rows, num_heads, head_dim]` like `q`.
    pub out: u64,
    pub out_strides: [i64; 3],
    /// Natural-log lse `[num_heads, q_rows]` (row stride 1) with its head stride; `-inf` for
    /// a row with no visible key (whose output is 0).
    pub lse: Option<(u64, i64)>,
    /// `[num_seqs, max_pages_per_seq]` int32 page numbers, and its row stride.
    pub block_table: u64,
    pub block_table_shape: [usize; 2],
    pub block_table_stride: i64,
    /// `[num_key_blocks, 4]` int32, contiguous: `cm_serve::Prefill::key_blocks`, with
    /// `num_key_blocks = plan.kv_len / PREFILL_KEY_BLOCK`.
    pub key_blocks: u64,
    /// Multiplies `q . k` before the softmax; usually `1 / sqrt(head_dim)`.
    pub softmax_scale: f32,
}

/// A prefill step over Rust-owned device buffers, for [`crate::Runtime::prefill`]: every
/// tensor contiguous (row-major in the shapes of [`PrefillRaw`]).
pub struct Prefill<'a> {
    pub dtype: DType,
    /// `[q_rows, num_heads, head_dim]`.
    pub q: &'a CudaSlice<u16>,
    pub q_shape: [usize; 3],
    /// `[num_pages, page_size, num_kv_heads, head_dim]` each.
    pub k_cache: &'a CudaSlice<u16>,
    pub v_cache: &'a CudaSlice<u16>,
    pub cache_shape: [usize; 4],
    /// `[q_rows, num_heads, head_dim]`.
    pub out: &'a mut CudaSlice<u16>,
    /// `[num_heads, q_rows]`, natural log.
    pub lse: Option<&'a mut CudaSlice<f32>>,
    /// `[num_seqs, max_pages_per_seq]`.
    pub block_table: &'a CudaSlice<i32>,
    pub block_table_shape: [usize; 2],
    /// `[num_key_blocks, 4]`, flattened.
    pub key_blocks: &'a CudaSlice<i32>,
    pub softmax_scale: f32,
}

/// Every host-side check of a prefill launch against the plan: no device work, no driver call
/// (so it runs, and is tested, without a GPU). `key_blocks` and the block table live on the
/// device and are not read: the kernel clamps every index it takes from them, so inconsistent
/// entries give wrong rows, never an access outside the tensors.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first argument that fails.
pub fn check_prefill(plan: &PlanLayout, a: &PrefillRaw) -> Result<(), Error> {
    prepare_prefill(plan, a, false).map(|_| ())
}

pub(crate) fn prepare_prefill(
    plan: &PlanLayout,
    a: &PrefillRaw,
    encode_maps: bool,
) -> Result<Option<Launch>, Error> {
    let [q_rows, num_heads, head_dim] = a.q_shape;
    let [num_pages, page_size, num_kv_heads, kd] = a.cache_shape;
    let [num_seqs, max_pages] = a.block_table_shape;
    if kd != head_dim {
        return Err(Error::invalid(format!(
            "k_cache: head_dim = {kd} differs from q's head_dim = {head_dim} (the paged forward \
             runs head_dim_v == head_dim)"
        )));
    }
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(Error::invalid(format!(
            "k_cache: num_kv_heads = {num_kv_heads} must divide q's num_heads = {num_heads} \
             (MHA, GQA and MQA need num_heads % num_kv_heads == 0)"
        )));
    }
    if num_pages == 0 || !page_size.is_power_of_two() || page_size < MIN_PREFILL_PAGE_SIZE {
        return Err(Error::invalid(format!(
            "k_cache: shape {:?}: the paged forward needs at least one page and a page_size that \
             is a power of two of at least {MIN_PREFILL_PAGE_SIZE}, got num_pages = {num_pages}, \
             page_size = {page_size} (the decode path takes any page size)",
            a.cache_shape
        )));
    }
    if num_pages > i32::MAX as usize {
        return Err(Error::invalid(format!(
            "k_cache: num_pages = {num_pages} exceeds 2^31 - 1, which TMA coordinates hold"
        )));
    }
    if num_seqs == 0
        || max_pages == 0
        || num_seqs > u32::MAX as usize
        || max_pages > u32::MAX as usize
    {
        return Err(Error::invalid(format!(
            "block_table: shape {:?}, expected [num_seqs, max_pages_per_seq] with each in 1..=2^32-1",
            a.block_table_shape
        )));
    }
    if a.block_table_stride < max_pages as i64 && num_seqs > 1 {
        return Err(Error::invalid(format!(
            "block_table: row stride {} is below max_pages_per_seq = {max_pages}",
            a.block_table_stride
        )));
    }
    if plan.num_masks != 1 || plan.kv_len % PREFILL_KEY_BLOCK != 0 {
        return Err(Error::invalid(format!(
            "the plan ({} masks, kv_len = {}) is not a prefill layout: one mask over whole \
             {PREFILL_KEY_BLOCK}-key blocks (cm_serve::StepPlan::prefill)",
            plan.num_masks, plan.kv_len
        )));
    }
    let elem = a.dtype.size_bytes() as u64;
    let cdims = ["num_pages", "page_size", "num_kv_heads", "head_dim"];
    for (name, strides) in [("k_cache", &a.k_strides), ("v_cache", &a.v_strides)] {
        check_strides(name, &cdims, &a.cache_shape, strides)?;
    }
    check_addr("block_table", a.block_table, 4)?;
    check_addr("key_blocks", a.key_blocks, 16)?;
    // The forward's own checks, with q, out and lse as a batch-1 [1, num_heads, q_rows, d]
    // view and K / V as the virtual key space the plan spans (their layout stands for the
    // cache's only in the checks: the cache is read through its own TMA descriptors below).
    let as4 = |s: [i64; 3]| [s[0] * q_rows as i64, s[1], s[0], s[2]];
    let q_layout = TensorLayout {
        shape: [1, num_heads, q_rows, head_dim],
        strides: as4(a.q_strides),
    };
    let out_layout = TensorLayout {
        shape: [1, num_heads, q_rows, head_dim],
        strides: as4(a.out_strides),
    };
    let virtual_kv = TensorLayout::contiguous([1, num_kv_heads, plan.kv_len as usize, head_dim]);
    let fwd = ForwardRaw {
        dtype: a.dtype,
        q: a.q,
        q_layout,
        k: a.k_cache,
        k_layout: virtual_kv,
        v: a.v_cache,
        v_layout: virtual_kv,
        out: a.out,
        out_layout,
        lse: a.lse.map(|(addr, head_stride)| {
            (
                addr,
                LseLayout {
                    shape: [1, num_heads, q_rows],
                    strides: [head_stride * num_heads as i64, head_stride, 1],
                },
            )
        }),
        softmax_scale: a.softmax_scale,
        score: ScoreRaw::default(),
    };
    let Some(mut launch) = prepare(plan, &fwd, (KernelKind::FwdWsPaged, None), false)? else {
        return Ok(None);
    };
    check_no_overlap(
        "out",
        &["q_rows", "num_heads", "head_dim"],
        &a.q_shape,
        &a.out_strides,
    )?;
    for (name, addr) in [("k_cache", a.k_cache), ("v_cache", a.v_cache)] {
        check_addr(name, addr, VECTOR_BYTES)?;
    }
    let page_rows = (page_size as u32).min(PREFILL_KEY_BLOCK);
    let p = &mut launch.params;
    p.block_table = a.block_table;
    p.key_blocks = a.key_blocks;
    p.block_table_stride = a.block_table_stride;
    p.page_shift = page_size.trailing_zeros();
    p.page_rows = page_rows;
    p.table_rows = num_seqs as u32;
    p.table_cols = max_pages as u32;
    // The cache as the [batch, heads, seq_len, head_dim] the descriptors take: pages as the
    // batch, the page's slots as the sequence.
    let cache = |s: &[i64; 4]| TensorLayout {
        shape: [num_pages, num_kv_heads, page_size, head_dim],
        strides: [s[0], s[2], s[1], s[3]],
    };
    let (k_cache, v_cache) = (cache(&a.k_strides), cache(&a.v_strides));
    k_cache.validate("k_cache", elem, false)?;
    v_cache.validate("v_cache", elem, false)?;
    launch.kv_bytes_per_pair = u64::from(plan.kv_len) * 2 * head_dim as u64 * elem
        / (num_heads / num_kv_heads).max(1) as u64;
    if encode_maps {
        let rows = cm_kernels::VARIANTS[launch.variant].tile().0;
        launch.tensor_maps = Some([
            TensorMap::encode("q", a.dtype, a.q, &q_layout, rows)?,
            TensorMap::encode("k_cache", a.dtype, a.k_cache, &k_cache, page_rows)?,
            TensorMap::encode("v_cache", a.dtype, a.v_cache, &v_cache, page_rows)?,
        ]);
    }
    Ok(Some(launch))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::HostPlan;
    use crate::PLAN_ARRAY_COUNT;
    use cm_plan::rows::RowIntervals;
    use cm_plan::tiles::TileShape;

    /// A plan of `masks` (each `total_q` rows over `blocks` virtual key blocks, row `q` seeing
    /// keys `0 .. q + 1 + m` of mask `m`, one per head) at made-up (aligned) addresses (the
    /// checks never read device memory).
    fn plan_of(total_q: u32, blocks: u32, masks: u32) -> PlanLayout {
        let (block_m, block_n) = cm_kernels::TILE;
        let tile = TileShape { block_m, block_n };
        let kv_len = blocks * PREFILL_KEY_BLOCK;
        let rows: Vec<RowIntervals> = (0..masks)
            .map(|m| {
                let rows: Vec<Vec<(u32, u32)>> = (0..total_q)
                    .map(|q| vec![(0, (q + 1 + m).min(kv_len))])
                    .collect();
                RowIntervals::from_rows(kv_len, &rows).unwrap()
            })
            .collect();
        let refs: Vec<&RowIntervals> = rows.iter().collect();
        let index: Vec<u32> = (0..masks).collect();
        let dims = [1, masks as usize];
        let host = HostPlan::build_masks(&refs, &index, dims, tile, prefill_lists()).unwrap();
        let mut arrays = [(0u64, 0usize); PLAN_ARRAY_COUNT];
        for (i, (slot, a)) in arrays.iter_mut().zip(host.arrays()).enumerate() {
            *slot = (0x100_0000 * (i as u64 + 1), a.len());
        }
        PlanLayout::new(
            total_q,
            kv_len,
            tile,
            masks,
            [1, masks],
            arrays,
            prefill_lists(),
        )
        .unwrap()
    }

    /// A prefill layout's one-mask plan.
    fn layout(total_q: u32, blocks: u32) -> PlanLayout {
        plan_of(total_q, blocks, 1)
    }

    fn args(total_q: usize, h: usize, h_kv: usize, d: usize, page_size: usize) -> PrefillRaw {
        let cache = [40, page_size, h_kv, d];
        let strides = [
            (page_size * h_kv * d) as i64,
            (h_kv * d) as i64,
            d as i64,
            1,
        ];
        PrefillRaw {
            dtype: DType::Bf16,
            q: 0x1000_0000,
            q_shape: [total_q, h, d],
            q_strides: [(h * d) as i64, d as i64, 1],
            k_cache: 0x2000_0000,
            v_cache: 0x3000_0000,
            cache_shape: cache,
            k_strides: strides,
            v_strides: strides,
            out: 0x4000_0000,
            out_strides: [(h * d) as i64, d as i64, 1],
            lse: Some((0x5000_0000, total_q as i64)),
            block_table: 0x6000_0000,
            block_table_shape: [3, 10],
            block_table_stride: 10,
            key_blocks: 0x7000_0000,
            softmax_scale: 0.125,
        }
    }

    fn err(plan: &PlanLayout, a: &PrefillRaw) -> String {
        match check_prefill(plan, a) {
            Ok(()) => "accepted".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_prefill_launch_is_one_persistent_paged_forward() {
        let plan = layout(300, 5);
        for (d, page_size) in [(128, 16), (64, 8), (128, 256)] {
            let a = args(300, 8, 2, d, page_size);
            let launch = prepare_prefill(&plan, &a, false).unwrap().unwrap();
            let v = &cm_kernels::VARIANTS[launch.variant];
            assert_eq!((v.kernel, v.head_dim), (KernelKind::FwdWsPaged, d as u32));
            let p = &launch.params;
            assert_eq!(p.page_rows, (page_size as u32).min(PREFILL_KEY_BLOCK));
            assert_eq!(1u32 << p.page_shift, page_size as u32);
            assert_eq!(
                (p.table_rows, p.table_cols, p.block_table_stride),
                (3, 10, 10)
            );
            assert_eq!((p.block_table, p.key_blocks), (0x6000_0000, 0x7000_0000));
            // The output rows of q's packed layout: one batch, rows strided by the heads.
            assert_eq!(
                (p.q_len, p.kv_len, p.num_heads, p.batch, p.heads_per_kv_head),
                (300, 640, 8, 1, 4)
            );
            let hd = (8 * d) as i64;
            assert_eq!((p.q_strides[1], p.q_strides[2]), (d as i64, hd));
            assert_eq!((p.o_strides[1], p.o_strides[2]), (d as i64, hd));
            assert_eq!((p.lse_strides[1]), 300);
        }
    }

    #[test]
    fn every_wrong_prefill_argument_is_named() {
        let plan = layout(300, 5);
        let ok = args(300, 8, 2, 128, 16);
        assert_eq!(err(&plan, &ok), "accepted");
        let cases: Vec<(&str, PrefillRaw, &str)> = vec![
            (
                "page not a power of two",
                PrefillRaw {
                    cache_shape: [40, 48, 2, 128],
                    ..ok
                },
                "page_size = 48",
            ),
            (
                "page below 8",
                PrefillRaw {
                    cache_shape: [40, 4, 2, 128],
                    ..ok
                },
                "page_size = 4",
            ),
            (
                "no pages",
                PrefillRaw {
                    cache_shape: [0, 16, 2, 128],
                    ..ok
                },
                "num_pages = 0",
            ),
            (
                "kv heads do not divide",
                PrefillRaw {
                    cache_shape: [40, 16, 3, 128],
                    ..ok
                },
                "num_kv_heads = 3",
            ),
            (
                "head dims differ",
                PrefillRaw {
                    cache_shape: [40, 16, 2, 64],
                    ..ok
                },
                "head_dim = 64 differs",
            ),
            (
                "head_dim not built",
                PrefillRaw {
                    q_shape: [300, 8, 96],
                    cache_shape: [40, 16, 2, 96],
                    ..ok
                },
                "head_dim = 96",
            ),
            (
                "q rows differ from the plan",
                PrefillRaw {
                    q_shape: [299, 8, 128],
                    ..ok
                },
                "q_len = 299",
            ),
            (
                "empty block table",
                PrefillRaw {
                    block_table_shape: [0, 10],
                    ..ok
                },
                "block_table: shape [0, 10]",
            ),
            (
                "block table stride",
                PrefillRaw {
                    block_table_stride: 4,
                    ..ok
                },
                "row stride 4",
            ),
            (
                "unaligned key_blocks",
                PrefillRaw {
                    key_blocks: 0x7000_0004,
                    ..ok
                },
                "key_blocks: address",
            ),
            (
                "unaligned block table",
                PrefillRaw {
                    block_table: 0x6000_0002,
                    ..ok
                },
                "block_table: address",
            ),
            (
                "scale",
                PrefillRaw {
                    softmax_scale: f32::NAN,
                    ..ok
                },
                "softmax_scale = NaN",
            ),
            (
                "cache stride",
                PrefillRaw {
                    k_strides: [2048, 256, 128, 2],
                    ..ok
                },
                "k_cache",
            ),
        ];
        for (what, a, want) in cases {
            let e = err(&plan, &a);
            assert!(e.contains(want), "{what}: {e}");
        }
        let two_masks = plan_of(300, 5, 2);
        assert!(err(&two_masks, &ok).contains("not a prefill layout"));
        assert!(err(&layout(300, 1), &args(300, 8, 2, 128, 16)).contains("accepted"));
    }
}
