//! The CompileMask CUDA runtime: loads the sm_90a CUBINs that the build embedded, uploads a
//! plan's tile descriptor and row intervals once ([`DevicePlan`], or [`HostPlan`] arrays the
//! caller uploads itself, lays out with [`PlanLayout::new`] and views with [`PlanView::borrowed`]), and launches attention on a
//! caller-given stream over caller-owned device memory, with no host synchronisation in the
//! launch path (so a launch can be captured in a CUDA graph).
//!
//! With `cm-py` (which passes torch's device addresses to the `_raw` launches), this is one of
//! the two crates of the workspace with `unsafe` code: the CUDA driver calls of the launch path
//! and the NVRTC calls of the build script. Every `unsafe` block says why it holds.
//!
//! Tensors are described by [`TensorLayout`] / [`LseLayout`] (shapes and strides in elements,
//! dims `[batch, heads, seq_len, head_dim]` and `[batch, num_heads, q_len]`).
//!
//! Forward kernels ([`KernelKind`]): `FwdWs` (the default: warp-specialised, TMA loads into a
//! two-stage ring, two wgmma consumer warpgroups, 128x128 tiles), `FwdWgmma` (one warpgroup,
//! 64x64 tiles) and `FwdSimple` (mma.sync, the reference GPU path), chosen with
//! [`Runtime::set_forward_kernel`]. One plan serves every (batch, head) of a launch: a plan of
//! several masks ([`Runtime::upload_plan_masks`], [`HostPlan::build_masks`]) holds each
//! distinct mask's lists and the mask of each (batch, head), which the kernels read per work
//! item, so per-(batch, head) masks (per-head masks under GQA and MQA included) are one
//! forward launch and one backward sequence. `cu_seqlens` packing is a plan of the compiler
//! (`cm_plan::packed`), not a kernel feature.
//!
//! Backward ([`Runtime::backward`], [`Backward`]): pre-processing, dK / dV per key block over
//! the descriptor's transposed lists (never atomic), and dQ either by fp32 atomic reductions
//! (the fast mode) or by a second pass per query block (`deterministic`, the same bits every
//! run); scratch of [`backward_workspace_len`] fp32 elements.
//! [`Runtime::backward`] lists the kernels.
//!
//! ```no_run
//! # fn demo(rows: &cm_plan::rows::RowIntervals) -> Result<(), cm_cuda::Error> {
//! use cm_cuda::{DType, Forward, Runtime, TensorLayout};
//! let rt = Runtime::new_on_device(0)?;
//! let stream = rt.context().default_stream();
//! let plan = rt.upload_plan(rows, &stream)?;
//! let (b, h, h_kv, d) = (1, 16, 16, 128);
//! let (sq, skv) = (rows.q_len() as usize, rows.kv_len() as usize);
//! let alloc = |n| stream.alloc_zeros::<u16>(n).map_err(|e| cm_cuda::Error::driver("alloc", e));
//! let (q, k, v) = (alloc(b * h * sq * d)?, alloc(b * h_kv * skv * d)?, alloc(b * h_kv * skv * d)?);
//! let mut out = alloc(b * h * sq * d)?;
//! rt.forward(&stream, &plan, Forward {
//!     dtype: DType::Bf16,
//!     q: (&q, TensorLayout::contiguous([b, h, sq, d])),
//!     k: (&k, TensorLayout::contiguous([b, h_kv, skv, d])),
//!     v: (&v, TensorLayout::contiguous([b, h_kv, skv, d])),
//!     out: (&mut out, TensorLayout::contiguous([b, h, sq, d])),
//!     lse: None,
//!     softmax_scale: 1.0 / (d as f32).sqrt(),
//!     score: cm_cuda::Score::NONE,
//! })?;
//! # Ok(()) }
//! ```

mod backward;
pub mod decode;
mod error;
pub mod external;
mod forward;
mod kernels;
mod layout;
mod plan;
pub mod prefill;
mod runtime;
pub mod score;
mod tma;

pub use backward::{backward_workspace_len, check_backward, Backward, BackwardRaw};
pub use cm_kernels::{DType, KernelKind, BWD_TILE, FWD_WS_TILES, TILE};
pub use decode::{check_decode, decode_splits, decode_workspace_len, Decode, DecodeRaw};
pub use error::Error;
pub use forward::{check_forward, forward_variant, Forward, ForwardRaw};
pub use kernels::{embedded_kernels, KernelInfo};
pub use layout::{LseLayout, TensorLayout};
pub use plan::{
    dq_in_turns, ws_order, DevicePlan, ForwardArray, HostPlan, PlanArray, PlanLayout, PlanLists,
    PlanView, PLAN_ARRAY_COUNT, WS_SETS,
};
pub use prefill::{
    check_prefill, prefill_host_plan, prefill_lists, Prefill, PrefillRaw, PREFILL_KEY_BLOCK,
    PREFILL_ROW_BLOCK,
};
pub use runtime::Runtime;
pub use score::{DistBias, LinearCoefs, Score, ScoreRaw};
