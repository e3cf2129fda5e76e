//! CPU reference attention driven by the compiler's row intervals ([`cm_plan::RowIntervals`]).
//!
//! This crate is the ground truth the GPU kernels are tested against and the fallback for users
//! without a GPU. It implements masked scaled-dot-product attention, forward
//! ([`attention_forward`]) and backward ([`attention_backward`]), for `f32` and `f64` tensors,
//! with MHA, GQA and MQA head mapping and `head_dim_v != head_dim`.
//!
//! # Conventions
//! - Tensors are contiguous, row-major slices in the SDPA layout
//!   `[batch, heads, seq_len, head_dim]` described by [`AttentionShape`].
//! - All indices are 0-based; key intervals are half-open `[start, end)`.
//! - Query head `h` reads key/value head `h / (num_heads / num_kv_heads)`.
//! - The mask of every `(batch, head)` pair is a [`cm_plan::RowIntervals`] chosen through
//!   [`Masks`]; only the visible `(query, key)` pairs are ever touched, so the cost is
//!   `O(visible_pairs * head_dim)`, never `O(q_len * kv_len)` per row.
//! - `lse` is the natural-log log-sum-exp of the scaled logits of a row.
//! - Score terms (softcap, linear bias, bias table, sinks; `cm_ir::score`) apply through
//!   [`attention_forward_scored`] / [`attention_backward_scored`], which also return the
//!   gradients of the table and the sinks. With sinks, a row with no visible key has output
//!   0 and `lse = sink[h]`.
//! - Empty-row contract: a row with no visible key has output exactly 0, `lse = -inf`, `dq = 0`
//!   and contributes nothing to `dk`/`dv`; keys no row sees get `dk = dv = 0` exactly. No NaN
//!   is ever produced from masking.
//!
//! All arithmetic is done in `f64` whatever the element type, so the `f32` path differs from a
//! float64 reference only by the rounding of its inputs and outputs.

#![warn(missing_docs)]

mod attention;
mod error;
mod float;
mod masks;
mod shape;

pub use attention::{
    attention_backward, attention_backward_scored, attention_forward, attention_forward_scored,
    ForwardOutput, Gradients, Score, ScoreGradients,
};
pub use error::ReferenceError;
pub use float::Float;
pub use masks::Masks;
pub use shape::AttentionShape;
