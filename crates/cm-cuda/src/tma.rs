//! TMA descriptors (`CUtensorMap`) of the attention tensors, for the kernels that load tiles
//! with the Tensor Memory Accelerator ([`crate::KernelKind::FwdWs`]).

use crate::{DType, Error, TensorLayout};
use cudarc::driver::sys;
use cudarc::driver::DeviceRepr;

/// Columns of one TMA box: 64 16-bit elements = 128 bytes, the widest row the 128-byte swizzle
/// allows; a head_dim-128 tile takes two boxes, one per swizzle column atom (`wgmma.cuh`).
const BOX_COLS: u32 = 64;

/// An encoded `CUtensorMap`, passed by value as a `__grid_constant__` kernel parameter
/// (`CmTensorMap` in `kernels/tma.cuh`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorMap([u64; 16]);

// SAFETY: TensorMap is #[repr(C)] plain data of exactly the 128 bytes (64-byte aligned) of the
// kernel's CmTensorMap parameter.
#[allow(unsafe_code)]
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// The descriptor of a `[batch, heads, seq_len, head_dim]` tensor at `addr` with boxes of
    /// `rows` rows x 64 columns, 128-byte swizzled, rows past `seq_len` read as zeros. `layout`
    /// was validated (16-byte aligned address, strides of dims longer than 1 multiples of 16
    /// bytes, contiguous last dim).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `name` when the driver refuses the layout;
    /// [`Error::Driver`] when the driver is missing the call.
    pub(crate) fn encode(
        name: &str,
        dtype: DType,
        addr: u64,
        layout: &TensorLayout,
        rows: u32,
    ) -> Result<TensorMap, Error> {
        let [b, h, s, d] = layout.shape;
        let elem = dtype.size_bytes() as u64;
        // Innermost first. An empty dim still needs extent 1 (a launch with nothing to load
        // never reads it), and a length-1 dim's stride is never used, so any valid one will do.
        let dims: [u64; 4] = [d as u64, s.max(1) as u64, h.max(1) as u64, b.max(1) as u64];
        let stride = |i: usize, n: usize| {
            if n > 1 {
                layout.strides[i] as u64 * elem
            } else {
                16
            }
        };
        let strides: [u64; 3] = [stride(2, s), stride(1, h), stride(0, b)];
        let boxes: [u32; 4] = [BOX_COLS, rows, 1, 1];
        let element_strides: [u32; 4] = [1; 4];
        let data_type = match dtype {
            DType::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        };
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every pointer argument points to a live local array of the rank (4, or 3
        // strides) the call reads; `map` is writable storage of the driver's own type; the
        // call only encodes a descriptor on the host and touches no device memory.
        #[allow(unsafe_code)]
        let result = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                data_type,
                4,
                addr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if result != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::invalid(format!(
                "{name}: the driver cannot describe shape {:?} with strides {:?} at {addr:#x} for TMA \
                 ({result:?}); use another layout or Runtime::set_forward_kernel(KernelKind::FwdWgmma)",
                layout.shape, layout.strides
            )));
        }
        // SAFETY: the driver initialised the map (CUDA_SUCCESS above).
        #[allow(unsafe_code)]
        let map = unsafe { map.assume_init() };
        Ok(TensorMap(map.opaque))
    }
}
