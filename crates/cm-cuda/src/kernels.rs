//! The CUBINs embedded by the build script, one per entry of `cm_kernels::VARIANTS`.

use cm_kernels::{Variant, VARIANTS};

/// One embedded CUBIN and what ptxas reported for it.
pub(crate) struct EmbeddedKernel {
    pub(crate) bytes: &'static [u8],
    pub(crate) registers: u32,
    pub(crate) spill_bytes: u32,
    pub(crate) shared_bytes: u32,
}

const VARIANT_COUNT: usize = VARIANTS.len();

// Defines `EMBEDDED: Result<[EmbeddedKernel; VARIANT_COUNT], &str>`; the error explains why no
// CUBIN was built.
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// Build facts of one embedded kernel variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    pub variant: Variant,
    /// CUBIN size in bytes.
    pub cubin_bytes: usize,
    /// Registers per thread.
    pub registers: u32,
    /// Spill stores + loads in bytes per thread (0 for every forward kernel: the build fails
    /// otherwise).
    pub spill_bytes: u32,
    /// Static shared memory per CTA in bytes.
    pub shared_bytes: u32,
}

/// The embedded kernels, in `cm_kernels::VARIANTS` order. Needs no GPU.
///
/// # Errors
/// [`crate::Error::KernelsUnavailable`] when the crate was built without NVRTC.
pub fn embedded_kernels() -> Result<Vec<KernelInfo>, crate::Error> {
    let table = embedded()?;
    Ok(VARIANTS
        .iter()
        .zip(table)
        .map(|(v, k)| KernelInfo {
            variant: *v,
            cubin_bytes: k.bytes.len(),
            registers: k.registers,
            spill_bytes: k.spill_bytes,
            shared_bytes: k.shared_bytes,
        })
        .collect())
}

pub(crate) fn embedded() -> Result<&'static [EmbeddedKernel; VARIANT_COUNT], crate::Error> {
    EMBEDDED
        .as_ref()
        .map_err(|reason| crate::Error::KernelsUnavailable(reason))
}
