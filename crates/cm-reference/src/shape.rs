//! The shape of one attention call and the checks that turn it into safe slice lengths.

use crate::error::ReferenceError;

/// The dimensions of one attention call. All tensors are contiguous and row-major:
///
/// | tensor | shape |
/// |---|---|
/// | `q`, `dq` | `[batch, num_heads, q_len, head_dim]` |
/// | `k`, `dk` | `[batch, num_kv_heads, kv_len, head_dim]` |
/// | `v`, `dv` | `[batch, num_kv_heads, kv_len, head_dim_v]` |
/// | `out`, `dout` | `[batch, num_heads, q_len, head_dim_v]` |
/// | `lse` | `[batch, num_heads, q_len]` |
///
/// `num_heads` must be a positive multiple of `num_kv_heads` (MHA: equal; GQA: a multiple;
/// MQA: `num_kv_heads = 1`). Any dimension other than `num_heads` / `num_kv_heads` may be 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    /// Number of independent sequences.
    pub batch: usize,
    /// Number of query heads.
    pub num_heads: usize,
    /// Number of key/value heads; query head `h` reads kv head `h / (num_heads / num_kv_heads)`.
    pub num_kv_heads: usize,
    /// Number of query rows per sequence (the mask's `q_len`).
    pub q_len: usize,
    /// Number of keys per sequence (the mask's `kv_len`).
    pub kv_len: usize,
    /// Width of a query and key vector.
    pub head_dim: usize,
    /// Width of a value and output vector; may differ from `head_dim`.
    pub head_dim_v: usize,
}

/// Element counts of every tensor of a checked [`AttentionShape`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub out: usize,
    pub lse: usize,
    /// Query heads per kv head.
    pub group: usize,
}

fn product(tensor: &'static str, dims: &[usize]) -> Result<usize, ReferenceError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(ReferenceError::SizeOverflow { tensor })
}

impl AttentionShape {
    /// Query heads that share one key/value head (`num_heads / num_kv_heads`).
    ///
    /// # Errors
    /// [`ReferenceError::ZeroHeads`] if either head count is 0,
    /// [`ReferenceError::HeadsNotDivisible`] if `num_heads` is not a multiple of `num_kv_heads`.
    pub fn group_size(&self) -> Result<usize, ReferenceError> {
        if self.num_heads == 0 || self.num_kv_heads == 0 {
            return Err(ReferenceError::ZeroHeads {
                num_heads: self.num_heads,
                num_kv_heads: self.num_kv_heads,
            });
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(ReferenceError::HeadsNotDivisible {
                num_heads: self.num_heads,
                num_kv_heads: self.num_kv_heads,
            });
        }
        Ok(self.num_heads / self.num_kv_heads)
    }

    /// Checks the head mapping and computes every tensor's element count without overflow.
    pub(crate) fn sizes(&self) -> Result<Sizes, ReferenceError> {
        let group = self.group_size()?;
        let (b, h, hk) = (self.batch, self.num_heads, self.num_kv_heads);
        Ok(Sizes {
            q: product("q", &[b, h, self.q_len, self.head_dim])?,
            k: product("k", &[b, hk, self.kv_len, self.head_dim])?,
            v: product("v", &[b, hk, self.kv_len, self.head_dim_v])?,
            out: product("out", &[b, h, self.q_len, self.head_dim_v])?,
            lse: product("lse", &[b, h, self.q_len])?,
            group,
        })
    }
}

/// Fails with a message naming `tensor`, its expected shape and both element counts.
pub(crate) fn check_len(
    tensor: &'static str,
    dims: &'static str,
    actual: usize,
    expected: usize,
) -> Result<(), ReferenceError> {
    if actual == expected {
        Ok(())
    } else {
        Err(ReferenceError::LengthMismatch {
            tensor,
            dims,
            expected,
            actual,
        })
    }
}
