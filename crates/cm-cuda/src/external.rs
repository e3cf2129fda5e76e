//! Tensors owned by another library (torch), as an extension module receives them: address,
//! shape, strides, dtype name and device. Their devices, dtypes and (for 1-D arrays)
//! contiguity are checked here, before the launch's own checks of shapes, strides, alignment
//! and the plan, so that the one entry that takes their addresses validates everything in
//! Rust and an error names the tensor, what it is and what was expected.

use crate::plan::{PlanLayout, PlanLists};
use crate::{DType, Error, LseLayout, TensorLayout, PLAN_ARRAY_COUNT};
use cm_plan::tiles::TileShape;

/// A tensor another library owns: the address of element `[0, ..]`, shape, strides in
/// elements, dtype as torch names it (`"bfloat16"`, `"float32"`, `"int32"`) and CUDA ordinal
/// (`-1`: not on a CUDA device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalTensor<const N: usize> {
    pub addr: u64,
    pub shape: [usize; N],
    pub strides: [i64; N],
    pub dtype: String,
    pub device: i64,
}

impl ExternalTensor<4> {
    pub fn layout(&self) -> TensorLayout {
        TensorLayout {
            shape: self.shape,
            strides: self.strides,
        }
    }
}

impl ExternalTensor<3> {
    pub fn lse_layout(&self) -> LseLayout {
        LseLayout {
            shape: self.shape,
            strides: self.strides,
        }
    }
}

impl ExternalTensor<1> {
    /// The address and length of this 1-D tensor (called `name` in errors), which must be
    /// contiguous.
    pub fn contiguous(&self, name: &str) -> Result<(u64, usize), Error> {
        if self.shape[0] > 1 && self.strides[0] != 1 {
            return Err(Error::invalid(format!(
                "{name}: stride {}, expected a contiguous 1-D tensor",
                self.strides[0]
            )));
        }
        Ok((self.addr, self.shape[0]))
    }
}

/// `name` (dtype `got`, on CUDA device `got_device`) must have dtype `want` and be on CUDA
/// device `device`.
pub fn check_tensor(
    name: &str,
    got: &str,
    got_device: i64,
    want: &str,
    device: usize,
) -> Result<(), Error> {
    if got_device != device as i64 {
        let on = if got_device < 0 {
            "not a CUDA device".to_string()
        } else {
            format!("cuda:{got_device}")
        };
        return Err(Error::invalid(format!(
            "{name} is on {on}, the launch is on cuda:{device} (the device of q)"
        )));
    }
    if got != want {
        return Err(Error::invalid(format!(
            "{name}: dtype {got}, expected {want}"
        )));
    }
    Ok(())
}

/// The launch's device and element dtype, from q, after every tensor of `tensors`
/// (`(name, dtype, device, is_element)`, q first) is checked to be on q's device with its
/// expected dtype: q's for element tensors (`is_element`), float32 for the others (lse, the
/// workspace).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first tensor that differs, or q's dtype when the
/// kernels do not support it (bfloat16 and float16 only).
pub fn launch_device_and_dtype(
    tensors: &[(&str, &str, i64, bool)],
) -> Result<(usize, DType), Error> {
    let &(_, q_dtype, q_device, _) = tensors
        .first()
        .ok_or_else(|| Error::invalid("a launch needs q"))?;
    let device =
        usize::try_from(q_device).map_err(|_| Error::invalid("q is not on a CUDA device"))?;
    let dtype = match q_dtype {
        "bfloat16" => DType::Bf16,
        "float16" => DType::F16,
        other => {
            return Err(Error::invalid(format!(
                "q: dtype {other} is not supported on CUDA (bfloat16, float16)"
            )))
        }
    };
    for &(name, got, got_device, element) in tensors {
        let want = if element { q_dtype } else { "float32" };
        check_tensor(name, got, got_device, want, device)?;
    }
    Ok((device, dtype))
}

/// The layout of a plan's descriptor arrays held as int32 tensors on `device` (in
/// [`crate::PlanArray::ALL`] order, made by [`crate::HostPlan::build_masks`] at
/// [`cm_kernels::TILE`] for `num_masks` masks of `q_len x kv_len` with `mask_index
/// [mask_dims[0], mask_dims[1]]` and `lists`): each array `lists` holds checked for device,
/// dtype and contiguity, then [`PlanLayout::new`] (the others are not read).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the array and what is wrong with it, or the lengths it
/// lacks.
pub fn descriptor_layout(
    device: usize,
    q_len: u32,
    kv_len: u32,
    num_masks: u32,
    mask_dims: [u32; 2],
    arrays: &[ExternalTensor<1>],
    lists: PlanLists,
) -> Result<PlanLayout, Error> {
    if arrays.len() != PLAN_ARRAY_COUNT {
        return Err(Error::invalid(format!(
            "the plan has {} kernel arrays, expected {PLAN_ARRAY_COUNT}",
            arrays.len()
        )));
    }
    let mut slots = [(0u64, 0usize); PLAN_ARRAY_COUNT];
    for ((slot, a), kind) in slots.iter_mut().zip(arrays).zip(crate::PlanArray::ALL) {
        if !lists.holds(kind) {
            continue;
        }
        let name = format!("plan array {}", kind.name());
        check_tensor(&name, &a.dtype, a.device, "int32", device)?;
        *slot = a.contiguous(&name)?;
    }
    let (block_m, block_n) = cm_kernels::TILE;
    PlanLayout::new(
        q_len,
        kv_len,
        TileShape { block_m, block_n },
        num_masks,
        mask_dims,
        slots,
        lists,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostPlan;
    use cm_plan::rows::RowIntervals;

    /// Every tensor of a launch is checked for q's device and its dtype before anything
    /// touches the GPU, with an error naming the tensor, what it is and what was expected.
    #[test]
    fn tensors_on_other_devices_or_of_other_dtypes_are_named() {
        let launch =
            launch_device_and_dtype(&[("q", "bfloat16", 1, true), ("lse", "float32", 1, false)]);
        assert_eq!(launch.unwrap(), (1, DType::Bf16));
        let err =
            |t: &[(&str, &str, i64, bool)]| launch_device_and_dtype(t).unwrap_err().to_string();
        assert!(err(&[("q", "float32", 0, true)]).contains("q: dtype float32 is not supported"));
        assert!(err(&[("q", "bfloat16", -1, true)]).contains("q is not on a CUDA device"));
        assert!(
            err(&[("q", "float16", 0, true), ("k", "bfloat16", 0, true)])
                .contains("k: dtype bfloat16, expected float16")
        );
        assert!(err(&[("q", "float16", 0, true), ("v", "float16", 2, true)])
            .contains("v is on cuda:2, the launch is on cuda:0"));
        assert!(
            err(&[("q", "float16", 0, true), ("lse", "float16", 0, false)])
                .contains("lse: dtype float16, expected float32")
        );
        assert!(
            err(&[("q", "float16", 0, true), ("dq", "float16", -1, true)])
                .contains("dq is on not a CUDA device")
        );
    }

    /// The descriptor's arrays: their count, dtype, device and contiguity, then their lengths
    /// against the plan's lengths, mask count and mask index.
    #[test]
    fn descriptor_arrays_are_checked_before_a_view_is_made() {
        let (block_m, block_n) = cm_kernels::TILE;
        let rows = RowIntervals::from_rows(100, &vec![vec![(0, 50)]; 70]).unwrap();
        let host = HostPlan::build_masks(
            &[&rows],
            &[0],
            [1, 1],
            TileShape { block_m, block_n },
            PlanLists::All,
        )
        .unwrap();
        let arrays = |dtype: &str, device: i64, short: bool| -> Vec<ExternalTensor<1>> {
            host.arrays()
                .iter()
                .enumerate()
                .map(|(i, a)| ExternalTensor {
                    addr: 0x10000 * (i as u64 + 1),
                    shape: [if short && i == 1 { 0 } else { a.len().max(4) }],
                    strides: [1],
                    dtype: dtype.to_string(),
                    device,
                })
                .collect()
        };
        let layout = |a: &[ExternalTensor<1>], q_len: u32| {
            descriptor_layout(0, q_len, 100, 1, [1, 1], a, PlanLists::All)
                .map_err(|e| e.to_string())
        };
        assert!(layout(&arrays("int32", 0, false), 70).is_ok());
        let err = |a: &[ExternalTensor<1>], q_len: u32| layout(a, q_len).unwrap_err();
        assert!(
            err(&arrays("int64", 0, false), 70).contains("plan array m_block_order: dtype int64")
        );
        assert!(
            err(&arrays("int32", 1, false), 70).contains("plan array m_block_order is on cuda:1")
        );
        assert!(err(&arrays("int32", 0, true), 70).contains("plan array kv_offsets holds 0"));
        assert!(err(&arrays("int32", 0, false), 7000).contains("built for other lengths"));
        assert!(err(&arrays("int32", 0, false)[..3], 70).contains("3 kernel arrays"));
        let mut strided = arrays("int32", 0, false);
        strided[2].strides = [2];
        assert!(err(&strided, 70).contains("plan array kv_indices: stride 2"));
        // A layout of the paged forward's lists reads none of the others, whatever they hold.
        let lists = crate::prefill_lists();
        let mut others = arrays("int64", 1, true);
        for (t, a) in others.iter_mut().zip(crate::PlanArray::ALL) {
            if lists.holds(a) {
                t.dtype = "int32".into();
                t.device = 0;
            }
        }
        let paged = descriptor_layout(0, 70, 100, 1, [1, 1], &others, lists).unwrap();
        assert_eq!(paged.lists(), lists);
    }
}
