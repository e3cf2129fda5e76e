use cudarc::driver::DriverError;

/// Everything the runtime can report. Messages name the offending value and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The crate was built without CUBINs (no NVRTC at build time).
    #[error("{0}")]
    KernelsUnavailable(&'static str),
    /// libcuda could not be loaded (no NVIDIA driver on this machine).
    #[error("the CUDA driver library (libcuda.so) could not be loaded; is this a machine with an NVIDIA GPU and driver?")]
    DriverUnavailable,
    /// The device cannot run the embedded kernels.
    #[error("unsupported device: {0}")]
    UnsupportedDevice(String),
    /// A launch or plan argument failed host-side validation.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {what}: {source}")]
    Driver {
        what: &'static str,
        #[source]
        source: DriverError,
    },
}

impl Error {
    /// Wraps a driver error with the operation it came from.
    pub fn driver(what: &'static str, source: DriverError) -> Error {
        Error::Driver { what, source }
    }

    /// An argument the caller must change, described by `msg` (which names the value and
    /// what was expected).
    pub fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }
}
