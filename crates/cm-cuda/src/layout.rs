//! Shapes and strides of the tensors a launch reads and writes, and their host-side checks.

use crate::Error;

/// Names of the dims of a [`TensorLayout`], for messages.
const DIMS4: [&str; 4] = ["batch", "heads", "seq_len", "head_dim"];
const DIMS3: [&str; 3] = ["batch", "num_heads", "q_len"];

/// Bytes every base address and every non-unit-dim stride must be a multiple of: the kernels
/// move Q, K and V in 16-byte vectors.
pub(crate) const VECTOR_BYTES: u64 = 16;

/// Checks that a caller-owned buffer of `len` elements holds the `span` elements its layout
/// reaches (`span_elements`), for the launches over Rust-owned buffers.
pub(crate) fn check_buffer_len(name: &str, len: usize, span: usize) -> Result<(), Error> {
    if span > len {
        return Err(Error::invalid(format!(
            "{name}: the layout spans {span} elements but the buffer holds {len}"
        )));
    }
    Ok(())
}

/// A `[batch, heads, seq_len, head_dim]` view: `shape` in elements, `strides` in elements
/// (torch's `stride()`), last stride 1. `heads` is `num_heads` for Q and the output and
/// `num_kv_heads` for K and V; `seq_len` is `q_len` or `kv_len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    pub shape: [usize; 4],
    pub strides: [i64; 4],
}

impl TensorLayout {
    /// Row-major `[batch, heads, seq_len, head_dim]`.
    pub fn contiguous(shape: [usize; 4]) -> TensorLayout {
        let [_, h, s, d] = shape.map(|x| x as i64);
        TensorLayout {
            shape,
            strides: [h * s * d, s * d, d, 1],
        }
    }

    /// `[batch, seq_len, heads, head_dim]` memory (the packed-QKV / "BSHD" layout) viewed as
    /// `[batch, heads, seq_len, head_dim]`.
    pub fn seq_major(shape: [usize; 4]) -> TensorLayout {
        let [_, h, s, d] = shape.map(|x| x as i64);
        TensorLayout {
            shape,
            strides: [s * h * d, d, h * d, 1],
        }
    }

    /// Elements of memory the view spans from its base: 1 + the largest element offset, or 0
    /// for an empty view.
    pub fn span_elements(&self) -> usize {
        span(&self.shape, &self.strides)
    }

    /// Checks the constraints every kernel shares; `name` is the tensor's name in messages
    /// and `elem_bytes` the element size.
    pub(crate) fn validate(
        &self,
        name: &str,
        elem_bytes: u64,
        writable: bool,
    ) -> Result<(), Error> {
        if self.strides[3] != 1 && self.shape[3] > 1 {
            return Err(Error::invalid(format!(
                "{name}: stride[3] (head_dim) = {}, expected 1 (the last dim must be contiguous)",
                self.strides[3]
            )));
        }
        check_strides(name, &DIMS4, &self.shape, &self.strides)?;
        for (i, dim) in DIMS4.iter().enumerate().take(3) {
            let bytes = self.strides[i] as u64 * elem_bytes;
            if self.shape[i] > 1 && bytes % VECTOR_BYTES != 0 {
                return Err(Error::invalid(format!(
                    "{name}: stride[{i}] ({dim}) = {} elements = {bytes} bytes is not a multiple of \
                     {VECTOR_BYTES} bytes, which the kernels' vector loads need",
                    self.strides[i]
                )));
            }
        }
        if writable {
            check_no_overlap(name, &DIMS4, &self.shape, &self.strides)?;
        }
        Ok(())
    }
}

/// A `[batch, num_heads, q_len]` fp32 log-sum-exp view (natural log); strides in elements,
/// `q_len` stride 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LseLayout {
    pub shape: [usize; 3],
    pub strides: [i64; 3],
}

impl LseLayout {
    /// Row-major `[batch, num_heads, q_len]`.
    pub fn contiguous(shape: [usize; 3]) -> LseLayout {
        let [_, h, s] = shape.map(|x| x as i64);
        LseLayout {
            shape,
            strides: [h * s, s, 1],
        }
    }

    /// Elements of memory the view spans from its base.
    pub fn span_elements(&self) -> usize {
        span(&self.shape, &self.strides)
    }

    /// `name`: the argument the errors name (`lse`, `dlse`).
    pub(crate) fn validate(&self, name: &str) -> Result<(), Error> {
        if self.strides[2] != 1 && self.shape[2] > 1 {
            return Err(Error::invalid(format!(
                "{name}: stride[2] (q_len) = {}, expected 1 (the last dim must be contiguous)",
                self.strides[2]
            )));
        }
        check_strides(name, &DIMS3, &self.shape, &self.strides)?;
        check_no_overlap(name, &DIMS3, &self.shape, &self.strides)
    }
}

/// Saturates at `usize::MAX` for absurd layouts, which then fail the length checks.
fn span(shape: &[usize], strides: &[i64]) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    let last: u128 = shape
        .iter()
        .zip(strides)
        .map(|(&n, &s)| (n as u128 - 1) * s.max(0) as u128)
        .sum();
    usize::try_from(last + 1).unwrap_or(usize::MAX)
}

pub(crate) fn check_strides(
    name: &str,
    dims: &[&str],
    shape: &[usize],
    strides: &[i64],
) -> Result<(), Error> {
    let mut last_offset: u128 = 0;
    for (i, (&n, &s)) in shape.iter().zip(strides).enumerate() {
        if s < 0 {
            return Err(Error::invalid(format!(
                "{name}: stride[{i}] ({}) = {s} is negative; only non-negative strides are supported",
                dims[i]
            )));
        }
        last_offset += (n.max(1) as u128 - 1) * s as u128;
    }
    // The kernels index with signed 64-bit element offsets.
    if last_offset >= i64::MAX as u128 {
        return Err(Error::invalid(format!(
            "{name}: shape {shape:?} with strides {strides:?} spans more than 2^63 elements"
        )));
    }
    Ok(())
}

/// An output written through two index tuples at one address would race; a sufficient check:
/// sorted by stride, every dim of size > 1 steps past everything the smaller dims span.
pub(crate) fn check_no_overlap(
    name: &str,
    dims: &[&str],
    shape: &[usize],
    strides: &[i64],
) -> Result<(), Error> {
    let mut order: Vec<usize> = (0..shape.len()).filter(|&i| shape[i] > 1).collect();
    order.sort_by_key(|&i| strides[i]);
    let mut inner_span: i64 = 1;
    for &i in &order {
        if strides[i] < inner_span {
            return Err(Error::invalid(format!(
                "{name}: stride[{i}] ({}) = {} makes elements overlap (the smaller dims span {inner_span} \
                 elements); an output must not alias itself",
                dims[i], strides[i]
            )));
        }
        inner_span += strides[i] * (shape[i] as i64 - 1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_and_spans() {
        let c = TensorLayout::contiguous([2, 3, 5, 64]);
        assert_eq!(c.strides, [960, 320, 64, 1]);
        assert_eq!(c.span_elements(), 2 * 3 * 5 * 64);
        let s = TensorLayout::seq_major([2, 3, 5, 64]);
        assert_eq!(s.strides, [960, 64, 192, 1]);
        assert_eq!(s.span_elements(), 1920);
        assert!(c.validate("q", 2, true).is_ok() && s.validate("q", 2, true).is_ok());
        assert_eq!(TensorLayout::contiguous([0, 3, 5, 64]).span_elements(), 0);
    }

    #[test]
    fn rejections_name_the_value() {
        let mut l = TensorLayout::contiguous([1, 2, 8, 64]);
        l.strides[3] = 2;
        let e = l.validate("k", 2, false).unwrap_err().to_string();
        assert!(e.contains("k: stride[3] (head_dim) = 2, expected 1"), "{e}");
        let mut l = TensorLayout::contiguous([1, 2, 8, 64]);
        l.strides[2] = 68;
        let e = l.validate("v", 2, false).unwrap_err().to_string();
        assert!(
            e.contains("stride[2] (seq_len) = 68 elements = 136 bytes"),
            "{e}"
        );
        let mut l = TensorLayout::contiguous([1, 2, 8, 64]);
        l.strides[1] = 0;
        assert!(
            l.validate("k", 2, false).is_ok(),
            "broadcast inputs are fine"
        );
        let e = l.validate("out", 2, true).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
        let mut l = TensorLayout::contiguous([1, 2, 8, 64]);
        l.strides[0] = -8;
        assert!(l
            .validate("q", 2, false)
            .unwrap_err()
            .to_string()
            .contains("negative"));
        let mut lse = LseLayout::contiguous([1, 2, 8]);
        lse.strides[2] = 2;
        assert!(lse
            .validate("lse")
            .unwrap_err()
            .to_string()
            .contains("lse: stride[2] (q_len) = 2"));
    }
}
