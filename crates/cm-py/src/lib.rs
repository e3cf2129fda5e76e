//! `compilemask._native`: the PyO3 extension behind the `compilemask` Python package.
//!
//! A thin layer over the facade crate `compilemask`: it converts Python values to the
//! facade's types and back, turns errors into Python exceptions carrying their
//! diagnostics, and releases the GIL while planning, while running the CPU reference and
//! while launching the CUDA kernels (`cuda`, on torch's stream over torch's memory).
//! The user-facing API (docstrings, torch integration) lives in `python/compilemask/`;
//! everything here is private to that package.
//!
//! Bulk arrays cross the boundary as native-endian `bytes` of `int32` / `uint32` /
//! `float32` / `float64` (read on the Python side with `array`, `torch.frombuffer` or
//! `numpy.frombuffer`), never as lists of Python ints.

mod convert;
mod cuda;
mod errors;
mod plan;
mod program;
mod reference;
mod serve;
mod shard;

use pyo3::prelude::*;

/// Stack the recursive work (parsing, checking, binding and planning walk expressions
/// recursively, up to the parser's nesting limit of 128) needs with a wide margin.
const RED_ZONE: usize = 4 << 20;
/// The stack [`deep`] switches to when less than [`RED_ZONE`] is left on the caller's.
const DEEP_STACK: usize = 16 << 20;

/// Runs `f` with at least [`RED_ZONE`] bytes of stack, on a fresh [`DEEP_STACK`] segment
/// when the calling thread has less left (a Python thread started after
/// `threading.stack_size(256 * 1024)`, say): the native entry points that parse, check,
/// bind or plan go through it, so their depth never depends on the caller's thread.
pub(crate) fn deep<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(RED_ZONE, DEEP_STACK, f)
}

/// The extension module. Its name is `_native` (imported as `compilemask._native`).
#[pymodule]
#[pyo3(name = "_native")]
fn cm_py(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DENSE_LIMIT", compilemask::DENSE_LIMIT)?;
    m.add(
        "LENGTH_MAX",
        compilemask::LENGTH_LIMITS
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>(),
    )?;
    m.add("MaskSyntaxError", py.get_type::<errors::MaskSyntaxError>())?;
    m.add("PlanError", py.get_type::<errors::PlanError>())?;
    m.add_class::<errors::Diagnostic>()?;
    m.add_class::<program::Program>()?;
    m.add_class::<plan::Plan>()?;
    m.add_class::<shard::Sharding>()?;
    m.add_class::<serve::Step>()?;
    m.add_function(wrap_pyfunction!(errors::py_plan_error, m)?)?;
    m.add_function(wrap_pyfunction!(program::compile, m)?)?;
    m.add_function(wrap_pyfunction!(program::builtin, m)?)?;
    m.add_function(wrap_pyfunction!(program::builtins, m)?)?;
    m.add_function(wrap_pyfunction!(reference::reference_forward, m)?)?;
    m.add_function(wrap_pyfunction!(reference::reference_backward, m)?)?;
    m.add_function(wrap_pyfunction!(reference::score_terms, m)?)?;
    m.add_function(wrap_pyfunction!(reference::reference_forward_scored, m)?)?;
    m.add_function(wrap_pyfunction!(reference::reference_backward_scored, m)?)?;
    m.add_function(wrap_pyfunction!(serve::paged_reference, m)?)?;
    m.add("CUDA_PLAN_ARRAYS", cuda::plan_array_names())?;
    let [forward, score, backward, score_backward] = cuda::head_dims();
    m.add("CUDA_FORWARD_HEAD_DIMS", forward)?;
    m.add("CUDA_SCORE_HEAD_DIMS", score)?;
    m.add("CUDA_BACKWARD_HEAD_DIMS", backward)?;
    m.add("CUDA_SCORE_BACKWARD_HEAD_DIMS", score_backward)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_kernel_tile, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_ws_order, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_dq_turns, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_workspace_len, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_forward, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_paged_prefill, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_decode_splits, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_decode_workspace_len, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_backward, m)?)?;
    Ok(())
}
