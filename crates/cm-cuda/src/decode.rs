//! Serving attention over a paged KV cache: argument checking, the split-KV heuristic and the
//! launch of `kernels/decode.cu` ([`crate::Runtime::decode_raw`]).
//!
//! A step is a batch of `num_seqs` sequences; sequence `s` has `q_len[s]` new query rows and
//! `kv_len[s]` cached keys, the new rows' keys included. Its rows (from `cm_serve`'s step
//! plan, as int32 device arrays):
//! - `cu_q: [num_seqs + 1]`: the rows of sequence `s` are `cu_q[s] .. cu_q[s + 1]` of the
//!   packed query `[total_q, num_heads, head_dim]`;
//! - `kv_len: [num_seqs]`;
//! - `row_ptr: [total_q + 1]`: row `r`'s intervals are `row_ptr[r] .. row_ptr[r + 1]` of
//! - `intervals: [num_intervals, 2]`: half-open `[start, end)` key positions of the row's own
//!   sequence, sorted and disjoint, index base 0.
//!
//! The cache is vLLM's / FlashInfer's layout: K and V `[num_pages, page_size, num_kv_heads,
//! head_dim]`; key position `p` of sequence `s` is slot `p % page_size` of page
//! `block_table[s, p / page_size]`.

use crate::forward::check_addr;
use crate::layout::{check_no_overlap, check_strides, VECTOR_BYTES};
use crate::{DType, Error};
use cm_kernels::{KernelKind, Variant};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

/// Packed rows (row, query head of a kv head's group) per CTA and keys per tile of
/// `kernels/decode.cu`.
pub const DECODE_TILE: (u32, u32) = (64, 64);

/// Most splits of one CTA's keys; each split keeps at least [`MIN_TILES_PER_SPLIT`] tiles.
pub const MAX_DECODE_SPLITS: u32 = 64;

/// Fewest 64-key tiles a split is given: below that the partial outputs' traffic and the
/// merge cost more than the parallelism brings.
pub const MIN_TILES_PER_SPLIT: u32 = 4;

/// A serving step's attention over device addresses owned by the caller (e.g. torch's
/// `data_ptr()`), for [`crate::Runtime::decode_raw`]. Strides are in elements; each address
/// is the element at index 0 of its tensor.
#[derive(Clone, Copy, Debug)]
pub struct DecodeRaw {
    pub dtype: DType,
    /// `[total_q, num_heads, head_dim]`, last stride 1.
    pub q: u64,
    pub q_shape: [usize; 3],
    pub q_strides: [i64; 3],
    /// `[num_pages, page_size, num_kv_heads, head_dim]` each, last stride 1.
    pub k_cache: u64,
    pub v_cache: u64,
    pub cache_shape: [usize; 4],
    pub k_strides: [i64; 4],
    pub v_strides: [i64; 4],
    /// `[total_q, num_heads, head_dim]` like `q`.
    pub out: u64,
    pub out_strides: [i64; 3],
    /// Natural-log lse `[total_q, num_heads]` (head stride 1) with its row stride; `-inf`
    /// for a row with no visible key (whose output is 0).
    pub lse: Option<(u64, i64)>,
    /// `[num_seqs, max_pages_per_seq]` int32 page numbers, and its row stride.
    pub block_table: u64,
    pub block_table_shape: [usize; 2],
    pub block_table_stride: i64,
    /// The step's rows (module docs), int32 device arrays.
    pub cu_q: u64,
    pub kv_len: u64,
    pub row_ptr: u64,
    pub intervals: u64,
    pub num_intervals: usize,
    /// The most rows any sequence of the step has (a capacity: it sizes the grid, and a
    /// sequence with more rows is still computed, by fewer CTAs).
    pub max_q_len: usize,
    /// Parts each CTA's keys are split into (1: no split; [`decode_splits`] chooses one).
    pub num_splits: u32,
    /// fp32 scratch of at least [`decode_workspace_len`] elements (none with one split).
    pub workspace: Option<(u64, usize)>,
    /// Multiplies `q . k` before the softmax; usually `1 / sqrt(head_dim)`.
    pub softmax_scale: f32,
}

/// A serving step's attention over Rust-owned device buffers, for [`crate::Runtime::decode`]:
/// every tensor contiguous (row-major in the shapes below), the step's rows as int32 arrays
/// (module docs).
pub struct Decode<'a> {
    pub dtype: DType,
    /// `[total_q, num_heads, head_dim]`.
    pub q: &'a CudaSlice<u16>,
    pub q_shape: [usize; 3],
    /// `[num_pages, page_size, num_kv_heads, head_dim]` each.
    pub k_cache: &'a CudaSlice<u16>,
    pub v_cache: &'a CudaSlice<u16>,
    pub cache_shape: [usize; 4],
    /// `[total_q, num_heads, head_dim]`.
    pub out: &'a mut CudaSlice<u16>,
    /// `[total_q, num_heads]`, natural log.
    pub lse: Option<&'a mut CudaSlice<f32>>,
    /// `[num_seqs, max_pages_per_seq]`.
    pub block_table: &'a CudaSlice<i32>,
    pub block_table_shape: [usize; 2],
    pub cu_q: &'a CudaSlice<i32>,
    pub kv_len: &'a CudaSlice<i32>,
    pub row_ptr: &'a CudaSlice<i32>,
    /// `[num_intervals, 2]`, flattened.
    pub intervals: &'a CudaSlice<i32>,
    pub max_q_len: usize,
    pub num_splits: u32,
    /// At least [`decode_workspace_len`] elements when `num_splits > 1`.
    pub workspace: Option<&'a mut CudaSlice<f32>>,
    pub softmax_scale: f32,
}

/// Row-major strides of `shape`, in elements.
pub(crate) fn row_major<const N: usize>(shape: [usize; N]) -> [i64; N] {
    let mut strides = [1i64; N];
    for i in (0..N.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1] as i64;
    }
    strides
}

/// Kernel parameters; mirrors `CmDecodeParams` in `kernels/decode.cu` field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeParams {
    q: u64,
    k_cache: u64,
    v_cache: u64,
    o: u64,
    lse: u64,
    partial_o: u64,
    partial_lse: u64,
    block_table: u64,
    cu_q: u64,
    kv_len: u64,
    row_ptr: u64,
    intervals: u64,
    q_strides: [i64; 2],
    o_strides: [i64; 2],
    k_strides: [i64; 3],
    v_strides: [i64; 3],
    block_table_stride: i64,
    lse_stride_row: i64,
    num_seqs: u32,
    total_q: u32,
    num_heads: u32,
    heads_per_kv_head: u32,
    page_size: u32,
    num_pages: u32,
    max_pages_per_seq: u32,
    num_splits: u32,
    num_intervals: u32,
    m_tiles_per_seq: u32,
    scale_log2: f32,
    page_shift: u32,
}

const _: () = assert!(
    std::mem::size_of::<DecodeParams>() == 240,
    "must match sizeof(CmDecodeParams)"
);

// SAFETY: DecodeParams is #[repr(C)], Copy, holds only integers and floats, and has the exact
// layout of CmDecodeParams (8-byte fields first, no padding; size checked above), so the
// driver may copy its bytes as the kernel's by-value parameter.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for DecodeParams {}

/// fp32 elements of scratch a step with `num_splits > 1` needs: every split's partial output
/// and lse of every (row, head); 0 for one split.
pub fn decode_workspace_len(
    num_splits: u32,
    total_q: usize,
    num_heads: usize,
    head_dim: usize,
) -> usize {
    if num_splits <= 1 {
        0
    } else {
        num_splits as usize * total_q * num_heads * (head_dim + 1)
    }
}

/// The split-KV heuristic: how many parts to split each CTA's keys into so that the grid
/// fills the GPU in whole waves.
///
/// `ctas = num_seqs x ceil(max_q_len x heads_per_kv_head / 64) x num_kv_heads` CTAs would run
/// unsplit, `slots = num_sms x ctas_per_sm` at a time. Splitting by `s` gives `ctas x s`
/// equal-sized CTAs (equal `kv_len`s assumed) in `ceil(ctas x s / slots)` waves; its wave
/// efficiency is `ctas x s / (waves x slots)`. The answer is the smallest `s` whose efficiency
/// is at least 0.85, else the most efficient `s` (the smallest among equals), with `s` at most
/// [`MAX_DECODE_SPLITS`] and at most one split per [`MIN_TILES_PER_SPLIT`] tiles of
/// `max_kv_len` (FlashDecoding's split-KV; FlashAttention's `num_splits_heuristic` reasons the
/// same way). Depends only on capacities, so a CUDA graph captured at them stays valid while
/// lengths change.
pub fn decode_splits(
    num_seqs: usize,
    max_q_len: usize,
    heads_per_kv_head: usize,
    num_kv_heads: usize,
    max_kv_len: usize,
    num_sms: u32,
    ctas_per_sm: u32,
) -> u32 {
    let block_m = DECODE_TILE.0 as usize;
    let ctas = num_seqs * (max_q_len * heads_per_kv_head).div_ceil(block_m) * num_kv_heads;
    let slots = (num_sms.max(1) * ctas_per_sm.max(1)) as usize;
    if ctas == 0 {
        return 1;
    }
    let tiles = max_kv_len.div_ceil(DECODE_TILE.1 as usize);
    let most = (tiles / MIN_TILES_PER_SPLIT as usize).clamp(1, MAX_DECODE_SPLITS as usize);
    let efficiency = |s: usize| {
        let work = ctas * s;
        work as f64 / (work.div_ceil(slots) * slots) as f64
    };
    let mut best = 1;
    for s in 1..=most {
        if efficiency(s) >= 0.85 {
            return s as u32;
        }
        if efficiency(s) > efficiency(best) + 1e-12 {
            best = s;
        }
    }
    best as u32
}

/// The last dim contiguous, the others non-negative multiples of the kernel's 16-byte vectors.
fn check_vectors(
    name: &str,
    dims: &[&str],
    shape: &[usize],
    strides: &[i64],
    elem_bytes: u64,
) -> Result<(), Error> {
    let last = strides.len() - 1;
    if strides[last] != 1 && shape[last] > 1 {
        return Err(Error::invalid(format!(
            "{name}: stride[{last}] (head_dim) = {}, expected 1 (the last dim must be contiguous)",
            strides[last]
        )));
    }
    check_strides(name, dims, shape, strides)?;
    for (i, dim) in dims.iter().enumerate().take(last) {
        if shape[i] > 1 && strides[i] as u64 * elem_bytes % VECTOR_BYTES != 0 {
            return Err(Error::invalid(format!(
                "{name}: stride[{i}] ({dim}) = {} elements is not a multiple of {VECTOR_BYTES} bytes, \
                 which the kernel's vector loads need",
                strides[i]
            )));
        }
    }
    Ok(())
}

/// A checked launch: the decode kernel's variant and grid, the merge's when split, and the
/// parameters both take.
pub(crate) struct DecodeLaunch {
    pub(crate) variant: usize,
    pub(crate) config: LaunchConfig,
    pub(crate) merge: Option<(usize, LaunchConfig)>,
    pub(crate) params: DecodeParams,
}

const MAX_GRID_YZ: usize = 65535;

/// Every host-side check of a decode launch: no device work, no driver call (so it runs, and
/// is tested, without a GPU). The step's int32 arrays live on the device and are not read:
/// the kernel clamps every index it takes from them (`kernels/decode.cu`), so inconsistent
/// arrays give wrong rows, never an access outside the tensors.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first argument that fails.
pub fn check_decode(a: &DecodeRaw) -> Result<(), Error> {
    prepare_decode(a).map(|_| ())
}

pub(crate) fn prepare_decode(a: &DecodeRaw) -> Result<Option<DecodeLaunch>, Error> {
    let [total_q, num_heads, head_dim] = a.q_shape;
    let [num_pages, page_size, num_kv_heads, kd] = a.cache_shape;
    let [num_seqs, max_pages] = a.block_table_shape;
    // The decode kernels read V at head_dim (head_dim_v == head_dim).
    let d = head_dim as u32;
    let variant = cm_kernels::find_variant(KernelKind::Decode, a.dtype, d, d, false)
        .ok_or_else(|| {
            let built = cm_kernels::built_head_dims(KernelKind::Decode, a.dtype, false);
            Error::invalid(format!(
                "q: head_dim = {head_dim} is not supported by the decode kernel; built head dims: {}",
                cm_kernels::head_dims_text(&built)
            ))
        })?;
    if kd != head_dim {
        return Err(Error::invalid(format!(
            "k_cache: head_dim = {kd} differs from q's head_dim = {head_dim}"
        )));
    }
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(Error::invalid(format!(
            "k_cache: num_kv_heads = {num_kv_heads} must divide q's num_heads = {num_heads} (MHA, GQA and MQA need num_heads % num_kv_heads == 0)"
        )));
    }
    if page_size == 0 || num_pages == 0 {
        return Err(Error::invalid(format!(
            "k_cache: shape {:?} has no pages (num_pages and page_size must be at least 1)",
            a.cache_shape
        )));
    }
    let fits_i32 = |name: &str, n: usize| -> Result<(), Error> {
        if n > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "{name} = {n} exceeds 2^31 - 1, which the kernel's int32 positions hold"
            )));
        }
        Ok(())
    };
    fits_i32("total_q", total_q)?;
    fits_i32("num_intervals", a.num_intervals)?;
    fits_i32("num_pages", num_pages)?;
    fits_i32(
        "max_pages_per_seq x page_size",
        max_pages.saturating_mul(page_size),
    )?;
    if a.num_splits == 0 || a.num_splits > MAX_DECODE_SPLITS {
        return Err(Error::invalid(format!(
            "num_splits = {} must be in 1..={MAX_DECODE_SPLITS}",
            a.num_splits
        )));
    }
    if !a.softmax_scale.is_finite() {
        return Err(Error::invalid(format!(
            "softmax_scale = {} must be finite",
            a.softmax_scale
        )));
    }
    let elem = a.dtype.size_bytes() as u64;
    let qdims = ["total_q", "num_heads", "head_dim"];
    let cdims = ["num_pages", "page_size", "num_kv_heads", "head_dim"];
    check_vectors("q", &qdims, &a.q_shape, &a.q_strides, elem)?;
    check_vectors("out", &qdims, &a.q_shape, &a.out_strides, elem)?;
    check_no_overlap("out", &qdims, &a.q_shape, &a.out_strides)?;
    check_vectors("k_cache", &cdims, &a.cache_shape, &a.k_strides, elem)?;
    check_vectors("v_cache", &cdims, &a.cache_shape, &a.v_strides, elem)?;
    if a.block_table_stride < max_pages as i64 && num_seqs > 1 {
        return Err(Error::invalid(format!(
            "block_table: row stride {} is below max_pages_per_seq = {max_pages}",
            a.block_table_stride
        )));
    }
    for (name, addr, align) in [
        ("q", a.q, VECTOR_BYTES),
        ("k_cache", a.k_cache, VECTOR_BYTES),
        ("v_cache", a.v_cache, VECTOR_BYTES),
        ("out", a.out, VECTOR_BYTES),
        ("block_table", a.block_table, 4),
        ("cu_q", a.cu_q, 4),
        ("kv_len", a.kv_len, 4),
        ("row_ptr", a.row_ptr, 4),
        ("intervals", a.intervals, 4),
    ] {
        check_addr(name, addr, align)?;
    }
    let lse = match a.lse {
        Some((addr, row_stride)) => {
            check_addr("lse", addr, 4)?;
            if total_q > 1 && row_stride < num_heads as i64 {
                return Err(Error::invalid(format!(
                    "lse: row stride {row_stride} is below num_heads = {num_heads} (lse is [total_q, num_heads], head stride 1)"
                )));
            }
            (addr, row_stride)
        }
        None => (0, 0),
    };
    let needed = decode_workspace_len(a.num_splits, total_q, num_heads, head_dim);
    let (partial_o, partial_lse) = if needed > 0 {
        let (addr, len) = a.workspace.ok_or_else(|| {
            Error::invalid(format!(
                "num_splits = {} needs a workspace of {needed} fp32 elements (decode_workspace_len); none was given",
                a.num_splits
            ))
        })?;
        if len < needed {
            return Err(Error::invalid(format!(
                "workspace: {len} fp32 elements, num_splits = {} needs {needed}",
                a.num_splits
            )));
        }
        check_addr("workspace", addr, VECTOR_BYTES)?;
        let o_len = a.num_splits as u64 * total_q as u64 * num_heads as u64 * head_dim as u64;
        (addr, addr + 4 * o_len)
    } else {
        (0, 0)
    };
    if num_kv_heads > MAX_GRID_YZ {
        return Err(Error::invalid(format!(
            "num_kv_heads = {num_kv_heads} must be at most {MAX_GRID_YZ} (CUDA grid limits)"
        )));
    }
    if num_seqs == 0 || total_q == 0 || num_heads == 0 {
        return Ok(None);
    }
    let group = num_heads / num_kv_heads;
    let m_tiles = (a.max_q_len.max(1) * group).div_ceil(DECODE_TILE.0 as usize);
    let grid_x = u32::try_from(num_seqs as u64 * m_tiles as u64).map_err(|_| {
        Error::invalid(format!(
            "num_seqs = {num_seqs} x {m_tiles} row tiles exceed the CUDA grid's 2^31 - 1"
        ))
    })?;
    let kernel: &Variant = &cm_kernels::VARIANTS[variant];
    let params = DecodeParams {
        q: a.q,
        k_cache: a.k_cache,
        v_cache: a.v_cache,
        o: a.out,
        lse: lse.0,
        partial_o,
        partial_lse,
        block_table: a.block_table,
        cu_q: a.cu_q,
        kv_len: a.kv_len,
        row_ptr: a.row_ptr,
        intervals: a.intervals,
        q_strides: [a.q_strides[0], a.q_strides[1]],
        o_strides: [a.out_strides[0], a.out_strides[1]],
        k_strides: [a.k_strides[0], a.k_strides[1], a.k_strides[2]],
        v_strides: [a.v_strides[0], a.v_strides[1], a.v_strides[2]],
        block_table_stride: a.block_table_stride,
        lse_stride_row: lse.1,
        num_seqs: num_seqs as u32,
        total_q: total_q as u32,
        num_heads: num_heads as u32,
        heads_per_kv_head: group as u32,
        page_size: page_size as u32,
        num_pages: num_pages as u32,
        max_pages_per_seq: max_pages as u32,
        num_splits: a.num_splits,
        num_intervals: a.num_intervals as u32,
        m_tiles_per_seq: m_tiles as u32,
        scale_log2: a.softmax_scale * std::f32::consts::LOG2_E,
        page_shift: if page_size.is_power_of_two() {
            page_size.trailing_zeros()
        } else {
            32
        },
    };
    let config = LaunchConfig {
        grid_dim: (grid_x, num_kv_heads as u32, a.num_splits),
        block_dim: (kernel.threads(), 1, 1),
        shared_mem_bytes: kernel.dynamic_shared_bytes(),
    };
    let merge = if a.num_splits > 1 {
        let v = cm_kernels::find_variant(KernelKind::DecodeMerge, a.dtype, d, d, false)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "q: head_dim = {head_dim} has no split-KV merge kernel; use num_splits = 1"
                ))
            })?;
        let items = total_q as u64 * num_heads as u64;
        let warps = (cm_kernels::VARIANTS[v].threads() / 32) as u64;
        let blocks = u32::try_from(items.div_ceil(warps)).map_err(|_| {
            Error::invalid(format!(
                "total_q x num_heads = {items} exceeds the merge's grid"
            ))
        })?;
        Some((
            v,
            LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (cm_kernels::VARIANTS[v].threads(), 1, 1),
                shared_mem_bytes: 0,
            },
        ))
    } else {
        None
    };
    Ok(Some(DecodeLaunch {
        variant,
        config,
        merge,
        params,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> DecodeRaw {
        let (total_q, h, h_kv, d, pages, page) = (3, 8, 2, 128, 10, 16);
        DecodeRaw {
            dtype: DType::Bf16,
            q: 0x1000_0000,
            q_shape: [total_q, h, d],
            q_strides: [(h * d) as i64, d as i64, 1],
            k_cache: 0x2000_0000,
            v_cache: 0x3000_0000,
            cache_shape: [pages, page, h_kv, d],
            k_strides: [(page * h_kv * d) as i64, (h_kv * d) as i64, d as i64, 1],
            v_strides: [(page * h_kv * d) as i64, (h_kv * d) as i64, d as i64, 1],
            out: 0x4000_0000,
            out_strides: [(h * d) as i64, d as i64, 1],
            lse: Some((0x5000_0000, h as i64)),
            block_table: 0x6000_0000,
            block_table_shape: [2, 5],
            block_table_stride: 5,
            cu_q: 0x7000_0000,
            kv_len: 0x7100_0000,
            row_ptr: 0x7200_0000,
            intervals: 0x7300_0000,
            num_intervals: 4,
            max_q_len: 2,
            num_splits: 1,
            workspace: None,
            softmax_scale: 0.125,
        }
    }

    fn err(a: &DecodeRaw) -> String {
        match check_decode(a) {
            Ok(()) => "accepted".into(),
            Err(e) => e.to_string(),
        }
    }

    /// Every wrong argument of a decode launch is an error naming the tensor and the value,
    /// found on the host before any launch.
    #[test]
    fn every_wrong_decode_argument_is_named() {
        assert_eq!(err(&args()), "accepted");
        let mut cases: Vec<(DecodeRaw, &str)> = Vec::new();
        let mut a = args();
        a.q_shape[2] = 96;
        cases.push((a, "head_dim = 96 is not supported"));
        let mut a = args();
        a.cache_shape[2] = 3;
        cases.push((a, "num_kv_heads = 3 must divide"));
        let mut a = args();
        a.cache_shape[3] = 64;
        cases.push((a, "k_cache: head_dim = 64 differs"));
        let mut a = args();
        a.cache_shape[1] = 0;
        cases.push((a, "has no pages"));
        let mut a = args();
        a.k_strides[1] = 100;
        cases.push((a, "k_cache: stride[1] (page_size) = 100 elements"));
        let mut a = args();
        a.v_strides[3] = 2;
        cases.push((a, "v_cache: stride[3] (head_dim) = 2"));
        let mut a = args();
        a.out_strides = [128, 128, 1];
        cases.push((a, "out: stride[1] (num_heads) = 128 makes elements overlap"));
        let mut a = args();
        a.num_splits = 0;
        cases.push((a, "num_splits = 0 must be in 1..=64"));
        let mut a = args();
        a.num_splits = 4;
        cases.push((a, "needs a workspace of 12384 fp32 elements"));
        let mut a = args();
        a.num_splits = 4;
        a.workspace = Some((0x8000_0000, 100));
        cases.push((a, "workspace: 100 fp32 elements"));
        let mut a = args();
        a.block_table_stride = 3;
        cases.push((
            a,
            "block_table: row stride 3 is below max_pages_per_seq = 5",
        ));
        let mut a = args();
        a.k_cache += 8;
        cases.push((a, "k_cache: address 0x20000008 is not 16-byte aligned"));
        let mut a = args();
        a.row_ptr += 2;
        cases.push((a, "row_ptr: address"));
        let mut a = args();
        a.lse = Some((0x5000_0000, 4));
        cases.push((a, "lse: row stride 4 is below num_heads = 8"));
        let mut a = args();
        a.softmax_scale = f32::INFINITY;
        cases.push((a, "softmax_scale = inf must be finite"));
        for (a, needle) in cases {
            let got = err(&a);
            assert!(got.contains(needle), "expected {needle:?}, got {got:?}");
        }
        let mut a = args();
        a.num_splits = 4;
        a.workspace = Some((0x8000_0000, decode_workspace_len(4, 3, 8, 128)));
        assert_eq!(err(&a), "accepted");
    }

    /// The grid: one CTA per (sequence, row tile of packed GQA rows) x kv head x split, and a
    /// merge only when split.
    #[test]
    fn grids_pack_the_query_heads_of_a_kv_head() {
        let mut a = args();
        a.max_q_len = 40; // 40 rows x 4 heads = 160 packed rows: 3 tiles of 64
        let l = prepare_decode(&a).unwrap().unwrap();
        assert_eq!(l.config.grid_dim, (2 * 3, 2, 1));
        assert!(l.merge.is_none());
        a.num_splits = 3;
        a.workspace = Some((0x8000_0000, decode_workspace_len(3, 3, 8, 128)));
        let l = prepare_decode(&a).unwrap().unwrap();
        assert_eq!(l.config.grid_dim.2, 3);
        // 3 rows x 8 heads, 4 (row, head) pairs per merge CTA.
        assert_eq!(l.merge.unwrap().1.grid_dim, (6, 1, 1));
        assert_eq!(
            l.params.partial_lse - l.params.partial_o,
            4 * 3 * 3 * 8 * 128
        );
    }

    /// The heuristic against its definition: a brute-force search of the same efficiency
    /// rule, on shapes from one sequence to large batches.
    #[test]
    fn splits_fill_whole_waves() {
        let eff = |ctas: usize, s: usize, slots: usize| {
            (ctas * s) as f64 / ((ctas * s).div_ceil(slots) * slots) as f64
        };
        for &(seqs, q, group, kvh, kv) in &[
            (64usize, 1usize, 4usize, 8usize, 8192usize),
            (64, 1, 4, 8, 131072),
            (1, 1, 4, 8, 131072),
            (1, 1, 8, 1, 1024),
            (16, 64, 4, 8, 32768),
            (3, 7, 1, 16, 100),
            (200, 1, 8, 8, 4096),
        ] {
            let s = decode_splits(seqs, q, group, kvh, kv, 132, 3) as usize;
            let ctas = seqs * (q * group).div_ceil(64) * kvh;
            let most = (kv.div_ceil(64) / 4).clamp(1, 64);
            assert!((1..=most).contains(&s), "{s} for {seqs} {q} {kv}");
            let e = eff(ctas, s, 396);
            if e < 0.85 {
                assert!((1..=most).all(|t| eff(ctas, t, 396) <= e + 1e-12));
            } else {
                assert!((1..s).all(|t| eff(ctas, t, 396) < 0.85));
            }
        }
        // A batch of 64 decode rows over 8 kv heads: 512 CTAs in 396 slots is 1.3 waves
        // unsplit (65%); two splits make 1024 CTAs in 3 waves (86%).
        assert_eq!(decode_splits(64, 1, 4, 8, 8192, 132, 3), 2);
        assert_eq!(decode_splits(0, 1, 4, 8, 8192, 132, 3), 1);
        assert_eq!(decode_splits(1, 1, 4, 8, 100, 132, 3), 1);
    }
}
