//! Compiling programs and planning them.

use compilemask::Code;
use std::time::Instant;

use compilemask::{OrderRequest, PackedShape, PlanOptions, TileShape};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert;
use crate::errors::{compile_error, plan_error, plan_error_msg, Diagnostic};
use crate::plan::Plan;

/// A checked mask program (private; wrapped by `compilemask.Program`).
#[pyclass(frozen, module = "compilemask._native", name = "Program")]
pub struct Program {
    pub inner: compilemask::Program,
}

/// The token order of `Program.plan(order=...)`: `None` or `"raster"` (the program's own
/// positions), `"auto"` (the best patch order of the mask's first grid), or a sequence of
/// ints, `order[new] = original`. Ints outside `[0, 2^32)` are a `PlanError` (CM0407), like
/// any other non-permutation.
fn order_request(py: Python<'_>, order: Option<&Bound<'_, PyAny>>) -> PyResult<OrderRequest> {
    let Some(order) = order else {
        return Ok(OrderRequest::Raster);
    };
    if let Ok(word) = order.extract::<String>() {
        return match word.as_str() {
            "raster" => Ok(OrderRequest::Raster),
            "auto" => Ok(OrderRequest::Auto),
            _ => Err(pyo3::exceptions::PyValueError::new_err(format!(
                "order must be \"raster\", \"auto\" or a sequence of ints (a permutation), got {word:?}"
            ))),
        };
    }
    let items: Vec<i64> = order.extract().map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(
            "order must be \"raster\", \"auto\" or a sequence of ints (a permutation)",
        )
    })?;
    let explicit = items
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            u32::try_from(o).map_err(|_| {
                plan_error_msg(
                    py,
                    Code::BadOrder,
                    format!("bad token order: order[{i}] = {o} is out of range"),
                    Some("an order lists every position 0 .. q_len - 1 once".into()),
                )
            })
        })
        .collect::<PyResult<Vec<u32>>>()?;
    Ok(OrderRequest::Explicit(explicit))
}

/// Compiles mask source text; raises `MaskSyntaxError` with every diagnostic.
#[pyfunction]
#[pyo3(signature = (source, name = "<mask>"))]
pub fn compile(py: Python<'_>, source: &str, name: &str) -> PyResult<Program> {
    let result = py.detach(|| crate::deep(|| compilemask::compile_named(source, name)));
    match result {
        Ok(inner) => Ok(Program { inner }),
        Err(e) => Err(compile_error(py, &e, source)),
    }
}

/// A built-in mask of the standard library; `MaskSyntaxError` (CM0201) for unknown names.
#[pyfunction]
pub fn builtin(py: Python<'_>, name: &str) -> PyResult<Program> {
    match crate::deep(|| compilemask::builtin(name)) {
        Ok(inner) => Ok(Program { inner }),
        Err(e) => Err(compile_error(py, &e, "")),
    }
}

/// `(name, summary)` of every built-in mask, workloads first.
#[pyfunction]
pub fn builtins() -> Vec<(&'static str, &'static str)> {
    compilemask::BUILTINS
        .iter()
        .map(|b| (b.name, b.summary()))
        .collect()
}

fn block(py: Python<'_>, what: &str, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| {
        plan_error_msg(
            py,
            Code::ZeroTileSide,
            format!(
                "{what} = {v} is not a valid tile side; expected 1 ..= {}",
                u32::MAX
            ),
            Some("tile sides are positive integers, e.g. block_size=(128, 128)".into()),
        )
    })
}

#[pymethods]
impl Program {
    #[getter]
    fn source(&self) -> &str {
        self.inner.source()
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// `(name, is_array, has_default)` of every declared parameter, in declaration order.
    #[getter]
    fn params(&self) -> Vec<(String, bool, bool)> {
        self.inner.params()
    }

    #[getter]
    fn warnings(&self) -> Vec<Diagnostic> {
        let lines = compilemask::LineIndex::new(self.inner.source());
        self.inner
            .warnings()
            .iter()
            .map(|d| Diagnostic::new(d, &lines))
            .collect()
    }

    /// The warnings rendered against the source (empty when there are none).
    fn render_warnings(&self) -> String {
        compilemask::render(
            self.inner.source(),
            self.inner.name(),
            self.inner.warnings(),
        )
    }

    #[getter]
    fn uses_batch(&self) -> bool {
        self.inner.depends_on_batch_head().0
    }

    #[getter]
    fn uses_head(&self) -> bool {
        self.inner.depends_on_batch_head().1
    }

    #[getter]
    fn reads_num_heads(&self) -> bool {
        self.inner.reads_num_heads()
    }

    #[getter]
    fn reads_batch(&self) -> bool {
        self.inner.reads_batch()
    }

    #[getter]
    fn uses_elementwise(&self) -> bool {
        self.inner.uses_elementwise()
    }

    /// Plans the program (GIL released) in the token order `order` (see [`order_request`]).
    /// Raises `PlanError`.
    #[pyo3(signature = (q_len, kv_len = None, batch = 1, num_heads = 1, block_m = 128, block_n = 128, params = None, order = None))]
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        py: Python<'_>,
        q_len: i64,
        kv_len: Option<i64>,
        batch: i64,
        num_heads: i64,
        block_m: i64,
        block_n: i64,
        params: Option<&Bound<'_, PyDict>>,
        order: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Plan> {
        let options = PlanOptions {
            q_len,
            kv_len,
            batch,
            num_heads,
            params: convert::params(params)?,
            tile: TileShape {
                block_m: block(py, "block_m", block_m)?,
                block_n: block(py, "block_n", block_n)?,
            },
            order: order_request(py, order)?,
        };
        let program = &self.inner;
        let (result, ms) = py.detach(|| {
            let t0 = Instant::now();
            let r = crate::deep(|| program.plan(&options));
            (r, t0.elapsed().as_secs_f64() * 1e3)
        });
        match result {
            Ok(plan) => {
                // Structure follows the program's positions, so none for a permuted order.
                let structure = match plan.order {
                    None => program.structure(&options).ok(),
                    Some(_) => None,
                };
                Ok(Plan::new(plan, program, structure, &options, ms))
            }
            Err(e) => Err(plan_error(py, Some(program), &e)),
        }
    }

    /// Plans the program for packed samples (FlashAttention's `cu_seqlens`; GIL released):
    /// one batch-1 plan over `cu_seqlens_q[-1]` rows and `cu_seqlens_k[-1]` keys (see
    /// `compilemask::Program::plan_packed`). `cu_seqlens_k` defaults to `cu_seqlens_q`.
    /// Raises `PlanError` (CM0409 for bad offsets, CM0410 for a token order).
    #[pyo3(signature = (cu_seqlens_q, cu_seqlens_k = None, num_heads = 1, block_m = 128, block_n = 128, params = None, order = None))]
    #[allow(clippy::too_many_arguments)]
    fn plan_packed(
        &self,
        py: Python<'_>,
        cu_seqlens_q: Vec<i64>,
        cu_seqlens_k: Option<Vec<i64>>,
        num_heads: i64,
        block_m: i64,
        block_n: i64,
        params: Option<&Bound<'_, PyDict>>,
        order: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Plan> {
        let cu_seqlens_k = cu_seqlens_k.unwrap_or_else(|| cu_seqlens_q.clone());
        let shape = PackedShape::new(cu_seqlens_q, cu_seqlens_k).num_heads(num_heads);
        let options = PlanOptions {
            params: convert::params(params)?,
            tile: TileShape {
                block_m: block(py, "block_m", block_m)?,
                block_n: block(py, "block_n", block_n)?,
            },
            order: order_request(py, order)?,
            ..PlanOptions::default()
        };
        let program = &self.inner;
        let (result, ms) = py.detach(|| {
            let t0 = Instant::now();
            let r = crate::deep(|| program.plan_packed(&shape, &options));
            (r, t0.elapsed().as_secs_f64() * 1e3)
        });
        match result {
            Ok(plan) => {
                let structure = plan.packing.as_ref().map(compilemask::Structure::packed);
                Ok(Plan::new(plan, program, structure, &options, ms))
            }
            Err(e) => Err(plan_error(py, Some(program), &e)),
        }
    }

    /// The first serving step: sequence `s` has `q_len[s]` new rows over `kv_len[s]` keys
    /// (see `compilemask::Program::plan_step`); `params` apply to every sequence,
    /// `seq_params[s]` to sequence `s` over them. Raises `PlanError` for a sequence's
    /// plan-time error, `ValueError` for bad lengths.
    #[pyo3(signature = (q_len, kv_len, num_heads = 1, params = None, seq_params = None))]
    fn plan_step(
        &self,
        py: Python<'_>,
        q_len: Vec<i64>,
        kv_len: Vec<i64>,
        num_heads: i64,
        params: Option<&Bound<'_, PyDict>>,
        seq_params: Option<&Bound<'_, pyo3::types::PyList>>,
    ) -> PyResult<crate::serve::Step> {
        let shared = convert::params(params)?;
        let own = crate::serve::seq_params(seq_params)?;
        crate::serve::plan_step(py, &self.inner, q_len, kv_len, num_heads, shared, own)
    }

    /// The visible intervals of row `q` of batch `b`, head `h` by the pairwise reference
    /// semantics, testing every key (O(kv_len); for tests and spot checks).
    #[pyo3(signature = (q, q_len, kv_len = None, batch = 1, num_heads = 1, b = 0, h = 0, params = None))]
    #[allow(clippy::too_many_arguments)]
    fn brute_force_row(
        &self,
        py: Python<'_>,
        q: i64,
        q_len: i64,
        kv_len: Option<i64>,
        batch: i64,
        num_heads: i64,
        b: i64,
        h: i64,
        params: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Vec<(u32, u32)>> {
        // The lengths first, as planning checks them: an index is only out of range of a
        // valid length (q_len = 0 is CM0402, not an empty range for q).
        let shape = compilemask::Shape {
            q_len,
            kv_len: kv_len.unwrap_or(q_len),
            batch,
            num_heads,
        };
        shape.check().map_err(|e| plan_error(py, None, &e))?;
        let bad = |what: &str, v: i64, n: i64| {
            pyo3::exceptions::PyIndexError::new_err(format!(
                "{what} = {v} is out of range [0, {n})"
            ))
        };
        if !(0..q_len).contains(&q) {
            return Err(bad("q", q, q_len));
        }
        if !(0..batch).contains(&b) {
            return Err(bad("b", b, batch));
        }
        if !(0..num_heads).contains(&h) {
            return Err(bad("h", h, num_heads));
        }
        let mut options = PlanOptions::new(q_len);
        options.kv_len = kv_len;
        options.batch = batch;
        options.num_heads = num_heads;
        options.params = convert::params(params)?;
        let program = &self.inner;
        py.detach(|| crate::deep(|| program.brute_force_row(&options, q, b, h)))
            .map_err(|e| plan_error(py, Some(program), &e))
    }

    fn __repr__(&self) -> String {
        format!("<compilemask._native.Program {}>", self.inner.name())
    }
}
