//! The element types the reference accepts: `f32` and `f64`.

use std::fmt::Debug;

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// An element type of the reference tensors: implemented for `f32` and `f64` only (sealed).
///
/// The reference computes in `f64` internally; this trait only converts at the boundary.
pub trait Float: Copy + Debug + PartialOrd + Send + Sync + 'static + private::Sealed {
    /// The type's name in messages: `f32` or `f64`.
    const NAME: &'static str;

    /// Widens to `f64` (exact for both implementations).
    fn to_f64(self) -> f64;

    /// Narrows from `f64` with round-to-nearest (`-inf`, `+inf` and 0 are preserved exactly).
    fn from_f64(value: f64) -> Self;
}

impl Float for f32 {
    const NAME: &'static str = "f32";

    fn to_f64(self) -> f64 {
        f64::from(self)
    }

    fn from_f64(value: f64) -> Self {
        // Rounding to the nearest f32 is the intended narrowing of the f64 accumulation.
        value as f32
    }
}

impl Float for f64 {
    const NAME: &'static str = "f64";

    fn to_f64(self) -> f64 {
        self
    }

    fn from_f64(value: f64) -> Self {
        value
    }
}
