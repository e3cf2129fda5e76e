//! A planned mask: statistics, row intervals and exports.

use std::sync::Arc;

use compilemask::{export, Traversal};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::convert::py_bytes;
use crate::errors::plan_error;

/// A complete plan (private; wrapped by `compilemask.Plan`).
#[pyclass(frozen, module = "compilemask._native", name = "Plan")]
pub struct Plan {
    pub inner: Arc<compilemask::Plan>,
    pub compile_ms: f64,
    /// The program's name and named structure, for pictures.
    pub name: String,
    pub structure: Option<compilemask::Structure>,
    /// The plan-time warnings, each with its rendering against the source.
    pub warnings: Vec<(crate::errors::Diagnostic, String)>,
}

/// A `PlanError` for an export that was refused: `CM0403` (over the size limit) or
/// `CM0408` (not expressible in the format).
fn export_error(py: Python<'_>, e: &compilemask::ExportError) -> PyErr {
    plan_error(py, None, &e.clone().into())
}

/// Every distinct mask as plain intervals, for the arrays that hold no strides (`CM0412`
/// past their limit).
fn unit_masks<'p>(
    py: Python<'_>,
    p: &'p compilemask::Plan,
) -> PyResult<Vec<std::borrow::Cow<'p, compilemask::RowIntervals>>> {
    p.masks
        .iter()
        .map(|m| m.rows.expanded())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| plan_error(py, None, &compilemask::expand_error(e)))
}

/// The traversal's name, as `compilemask plan --json` writes it.
fn traversal_name(t: Traversal) -> &'static str {
    match t {
        Traversal::RowMajor => "rowmajor",
        Traversal::Boustrophedon => "boustrophedon",
        Traversal::Hilbert => "hilbert",
    }
}

/// A patch as (frames, rows, columns), `None` for an extent that spans the whole grid.
type Patch = (Option<u32>, Option<u32>, Option<u32>);

fn patch(p: [u32; 3]) -> Patch {
    let side = |v: u32| (v != u32::MAX).then_some(v);
    (side(p[0]), side(p[1]), side(p[2]))
}

impl Plan {
    pub fn new(
        plan: compilemask::Plan,
        program: &compilemask::Program,
        structure: Option<compilemask::Structure>,
        options: &compilemask::PlanOptions,
        compile_ms: f64,
    ) -> Plan {
        let lines = compilemask::LineIndex::new(program.source());
        let warnings = program
            .plan_warnings(options, &plan)
            .iter()
            .map(|d| {
                (
                    crate::errors::Diagnostic::new(d, &lines),
                    compilemask::render(program.source(), program.name(), std::slice::from_ref(d)),
                )
            })
            .collect();
        Plan {
            warnings,
            inner: Arc::new(plan),
            compile_ms,
            name: cm_view::display_name(program.name()).to_string(),
            structure,
        }
    }

    /// The distinct mask of `(b, h)`, after a bounds check.
    fn mask(&self, b: i64, h: i64) -> PyResult<&compilemask::MaskPlan> {
        let p = &self.inner;
        if !(0..i64::from(p.batch)).contains(&b) || !(0..i64::from(p.num_heads)).contains(&h) {
            return Err(PyIndexError::new_err(format!(
                "(b, h) = ({b}, {h}) is out of range; the plan has batch = {} and num_heads = {}",
                p.batch, p.num_heads
            )));
        }
        Ok(p.mask(b as u32, h as u32))
    }

    fn row_index(&self, q: i64) -> PyResult<u32> {
        if !(0..i64::from(self.inner.q_len)).contains(&q) {
            return Err(PyIndexError::new_err(format!(
                "row q = {q} is out of range; the plan has q_len = {} rows (0-based)",
                self.inner.q_len
            )));
        }
        Ok(q as u32)
    }
}

#[pymethods]
impl Plan {
    /// `(Diagnostic, rendered)` of every plan-time warning (no visible pair, rows that see
    /// nothing, `h` / `b` read with one head / batch, unread parameters, large
    /// `elementwise`, a tree past the lengths).
    #[getter]
    fn warnings(&self) -> Vec<(crate::errors::Diagnostic, String)> {
        self.warnings.clone()
    }

    #[getter]
    fn q_len(&self) -> u32 {
        self.inner.q_len
    }

    #[getter]
    fn kv_len(&self) -> u32 {
        self.inner.kv_len
    }

    #[getter]
    fn batch(&self) -> u32 {
        self.inner.batch
    }

    #[getter]
    fn num_heads(&self) -> u32 {
        self.inner.num_heads
    }

    /// `cu_seqlens_q` of a packed plan (`[samples + 1]`), else `None`.
    #[getter]
    fn cu_seqlens_q(&self) -> Option<Vec<u32>> {
        self.inner
            .packing
            .as_ref()
            .map(|p| p.cu_seqlens_q().to_vec())
    }

    /// `cu_seqlens_k` of a packed plan (`[samples + 1]`), else `None`.
    #[getter]
    fn cu_seqlens_k(&self) -> Option<Vec<u32>> {
        self.inner
            .packing
            .as_ref()
            .map(|p| p.cu_seqlens_k().to_vec())
    }

    #[getter]
    fn block_size(&self) -> (u32, u32) {
        (self.inner.tile.block_m, self.inner.tile.block_n)
    }

    #[getter]
    fn visible_pairs(&self) -> u64 {
        self.inner.visible_pairs()
    }

    #[getter]
    fn empty_rows(&self) -> u64 {
        self.inner.empty_rows()
    }

    #[getter]
    fn max_intervals_per_row(&self) -> u32 {
        self.inner.max_intervals_per_row()
    }

    #[getter]
    fn tiles<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.inner.tile_counts();
        let d = PyDict::new(py);
        d.set_item("full", t.full)?;
        d.set_item("partial", t.partial)?;
        d.set_item("empty", t.empty)?;
        Ok(d)
    }

    #[getter]
    fn computed_pairs(&self) -> u64 {
        self.inner.computed_pairs()
    }

    #[getter]
    fn descriptor_bytes(&self) -> u64 {
        self.inner.descriptor_bytes()
    }

    #[getter]
    fn elementwise_pairs(&self) -> u64 {
        self.inner.elementwise_pairs
    }

    #[getter]
    fn pieces(&self) -> u64 {
        self.inner.pieces
    }

    #[getter]
    fn num_masks(&self) -> usize {
        self.inner.masks.len()
    }

    /// `[batch * num_heads]`, row-major: the distinct mask of each (b, h).
    #[getter]
    fn mask_index(&self) -> Vec<u32> {
        self.inner.mask_index.clone()
    }

    #[getter]
    fn uses_batch(&self) -> bool {
        self.inner.uses_batch
    }

    #[getter]
    fn uses_head(&self) -> bool {
        self.inner.uses_head
    }

    #[getter]
    fn compile_ms(&self) -> f64 {
        self.compile_ms
    }

    /// The token order the masks are planned in (`order[new] = original`) as uint32 bytes,
    /// or `None` for the program's own positions, which is also what an `order="auto"` that
    /// chose raster order (the identity) gives: the plan is then a raster plan, and
    /// `permute` copies nothing.
    #[getter]
    fn order<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner
            .order
            .as_ref()
            .filter(|o| {
                !o.order
                    .iter()
                    .enumerate()
                    .all(|(i, &t)| i as u64 == u64::from(t))
            })
            .map(|o| py_bytes(py, &o.order))
    }

    /// Whether the plan was planned in a token order at all: also for an `order="auto"` that
    /// chose raster order, or an explicit identity, which `order` gives as `None`.
    #[getter]
    fn in_order(&self) -> bool {
        self.inner.order.is_some()
    }

    /// `(frames, rows, columns)` of the chosen patch order (`None` for a whole extent), or
    /// `None` for raster planning and explicit permutations.
    #[getter]
    fn order_patch(&self) -> Option<Patch> {
        self.inner.order.as_ref().and_then(|o| o.patch).map(patch)
    }

    /// How the chosen grid order visits its patches, `"preorder"` for a tree's depth-first
    /// preorder, `None` for raster planning and explicit permutations.
    #[getter]
    fn order_traversal(&self) -> Option<&'static str> {
        let o = self.inner.order.as_ref()?;
        if o.tree_preorder {
            return Some("preorder");
        }
        o.traversal.map(traversal_name)
    }

    /// With `order="auto"`: `(patch, traversal, computed_pairs)` of every candidate order,
    /// fewest computed pairs first (raster order included, as patch `(1, 1, None)`).
    #[getter]
    fn order_candidates(&self) -> Vec<(Patch, &'static str, u64)> {
        self.inner
            .order_candidates
            .iter()
            .map(|c| {
                (
                    patch(c.patch),
                    traversal_name(c.traversal),
                    c.computed_pairs,
                )
            })
            .collect()
    }

    /// `(visible_pairs, computed_pairs)` of the (0, 0) mask alone (the basis of the token
    /// order's densities, as `raster_computed_pairs` is of that mask).
    #[getter]
    fn pairs_00(&self) -> (u64, u64) {
        let m = self.inner.mask(0, 0);
        (m.rows.visible_pairs(), m.tiles.computed_pairs)
    }

    /// Computed pairs of the (0, 0) mask in the program's own positions.
    #[getter]
    fn raster_computed_pairs(&self) -> u64 {
        self.inner.raster_computed_pairs
    }

    /// Maximal `[start, end)` intervals of row `q` of `(b, h)`.
    #[pyo3(signature = (q, b = 0, h = 0))]
    fn intervals(&self, q: i64, b: i64, h: i64) -> PyResult<Vec<(u32, u32)>> {
        let m = self.mask(b, h)?;
        let q = self.row_index(q)?;
        Ok(m.rows
            .row_expanded(q)
            .iter()
            .map(|iv| (iv.start, iv.end))
            .collect())
    }

    /// Intervals of rows `start .. stop` of `(b, h)`.
    #[pyo3(signature = (start, stop, b = 0, h = 0))]
    fn rows(&self, start: i64, stop: i64, b: i64, h: i64) -> PyResult<Vec<Vec<(u32, u32)>>> {
        let m = self.mask(b, h)?;
        let q_len = i64::from(self.inner.q_len);
        if !(0 <= start && start <= stop && stop <= q_len) {
            return Err(PyIndexError::new_err(format!(
                "rows {start}:{stop} are out of range; expected start:stop with 0 <= start <= stop <= {q_len} (the plan's q_len; 0-based, half-open)"
            )));
        }
        Ok((start as u32..stop as u32)
            .map(|q| {
                m.rows
                    .row_expanded(q)
                    .iter()
                    .map(|iv| (iv.start, iv.end))
                    .collect()
            })
            .collect())
    }

    /// Index of the distinct mask `(b, h)` uses.
    #[pyo3(signature = (b = 0, h = 0))]
    fn mask_id(&self, b: i64, h: i64) -> PyResult<u32> {
        self.mask(b, h)?;
        Ok(self.inner.mask_index[(b * i64::from(self.inner.num_heads) + h) as usize])
    }

    /// CSR row offsets and intervals of every distinct mask, concatenated:
    /// `row_ptr` (uint32, `[num_masks, q_len + 1]`, offsets into the concatenated list) and
    /// `intervals` (uint32, `[total, 2]` as start, end), as native-endian bytes.
    fn interval_arrays<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let p = &self.inner;
        let masks = unit_masks(py, p)?;
        let (row_ptr, flat) = py.detach(|| {
            let mut row_ptr: Vec<u32> = Vec::with_capacity(p.masks.len() * (p.q_len as usize + 1));
            let mut flat: Vec<u32> = Vec::new();
            for m in &masks {
                let base = (flat.len() / 2) as u32;
                row_ptr.extend(m.row_ptr().iter().map(|&o| o + base));
                for iv in m.intervals() {
                    flat.push(iv.start);
                    flat.push(iv.end);
                }
            }
            (row_ptr, flat)
        });
        Ok((py_bytes(py, &row_ptr), py_bytes(py, &flat)))
    }

    /// This plan's sequence dealt to `ranks` ranks in chunks of `chunk` tokens (None:
    /// `cm_shard::default_chunk`) by work (context parallelism, `cm_shard`); `ValueError`
    /// naming what cannot be sharded.
    #[pyo3(signature = (ranks, chunk=None))]
    fn shard(&self, ranks: u32, chunk: Option<u32>) -> PyResult<crate::shard::Sharding> {
        let chunk = chunk.unwrap_or_else(|| compilemask::default_chunk(self.inner.q_len, ranks));
        crate::shard::Sharding::new(self, ranks, chunk)
    }

    /// The CUDA kernels' descriptor of the whole plan at their tile shape
    /// (`cuda_kernel_tile`): every distinct mask back to back and the plan's `mask_index
    /// [batch, num_heads]` (`cm_cuda::HostPlan::build_masks`), one uint32 bytes object per
    /// array, in the order of `CUDA_PLAN_ARRAYS` (GIL released).
    fn kernel_arrays<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let p = &self.inner;
        let unit = unit_masks(py, p)?;
        let host = py.detach(|| {
            let masks: Vec<&compilemask::RowIntervals> = unit.iter().map(|m| m.as_ref()).collect();
            cm_cuda::HostPlan::build_masks(
                &masks,
                &p.mask_index,
                [p.batch as usize, p.num_heads as usize],
                crate::cuda::kernel_tile(),
                cm_cuda::PlanLists::All,
            )
        });
        let host = host.map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        Ok(host.arrays().iter().map(|a| py_bytes(py, a)).collect())
    }

    /// The dense `[q_len, kv_len]` mask of `(b, h)`, one byte per pair (1 = visible).
    /// The plan's picture (see `cm_view`): `"png"` bytes or `"svg"` text as UTF-8 bytes, of
    /// batch `b`, head `h`, rows `rows` and keys `cols` (`(start, stop)`, half-open;
    /// `None`: all). `IndexError` for a view outside the plan, `ValueError` for another
    /// format.
    #[pyo3(signature = (format = "png", b = 0, h = 0, rows = None, cols = None))]
    fn image<'py>(
        &self,
        py: Python<'py>,
        format: &str,
        b: i64,
        h: i64,
        rows: Option<(i64, i64)>,
        cols: Option<(i64, i64)>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.mask(b, h)?;
        let range = |what: &str, r: Option<(i64, i64)>| -> PyResult<Option<(u32, u32)>> {
            r.map(|(lo, hi)| match (u32::try_from(lo), u32::try_from(hi)) {
                (Ok(lo), Ok(hi)) => Ok((lo, hi)),
                _ => Err(PyIndexError::new_err(format!(
                    "{what} = ({lo}, {hi}) is out of range; expected (start, stop) with 0 <= start < stop"
                ))),
            })
            .transpose()
        };
        let view = cm_view::View {
            b: b as u32,
            h: h as u32,
            rows: range("rows", rows)?,
            cols: range("cols", cols)?,
        };
        let subject = cm_view::Subject {
            plan: &self.inner,
            name: &self.name,
            structure: self.structure.as_ref(),
        };
        let picture =
            cm_view::figure(&subject, &view).map_err(|e| PyIndexError::new_err(e.to_string()))?;
        let bytes = match format {
            "png" => py.detach(|| picture.png()),
            "svg" => picture.svg().map(String::into_bytes),
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "format must be \"png\" or \"svg\", got {other:?}"
                )))
            }
        }
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &bytes))
    }

    #[pyo3(signature = (b = 0, h = 0))]
    fn dense<'py>(&self, py: Python<'py>, b: i64, h: i64) -> PyResult<Bound<'py, PyBytes>> {
        let m = self.mask(b, h)?;
        let bytes = py
            .detach(|| export::dense(&m.rows))
            .map_err(|e| export_error(py, &e))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// FlexAttention `BlockMask` tables of `(b, h)`: a dict with `block_size`,
    /// `seq_lengths`, `num_m_blocks`, `num_n_blocks` and, as int32 bytes, `kv_num_blocks`
    /// `[M]`, `kv_indices` `[M, N]`, `full_kv_num_blocks`, `full_kv_indices`, `q_num_blocks`
    /// `[N]`, `q_indices` `[N, M]`, `full_q_num_blocks`, `full_q_indices`.
    #[pyo3(signature = (b = 0, h = 0))]
    fn flex_block_mask<'py>(
        &self,
        py: Python<'py>,
        b: i64,
        h: i64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let m = self.mask(b, h)?;
        let f = py
            .detach(|| export::flex_block_mask(&m.tiles))
            .map_err(|e| export_error(py, &e))?;
        let d = PyDict::new(py);
        d.set_item("block_size", f.block_size)?;
        d.set_item("seq_lengths", f.seq_lengths)?;
        d.set_item("num_m_blocks", m.tiles.num_m_blocks)?;
        d.set_item("num_n_blocks", m.tiles.num_n_blocks)?;
        for (name, v) in [
            ("kv_num_blocks", &f.kv_num_blocks),
            ("kv_indices", &f.kv_indices),
            ("full_kv_num_blocks", &f.full_kv_num_blocks),
            ("full_kv_indices", &f.full_kv_indices),
            ("q_num_blocks", &f.q_num_blocks),
            ("q_indices", &f.q_indices),
            ("full_q_num_blocks", &f.full_q_num_blocks),
            ("full_q_indices", &f.full_q_indices),
        ] {
            d.set_item(name, py_bytes(py, v))?;
        }
        Ok(d)
    }

    /// cuDNN interval endpoints of `(b, h)`: `(nfunc, endpoints)` with `endpoints` int32
    /// bytes `[nfunc, q_len]`; row q sees `[0, F0) U [F1, F2) U ...`.
    #[pyo3(signature = (b = 0, h = 0))]
    fn cudnn_endpoints<'py>(
        &self,
        py: Python<'py>,
        b: i64,
        h: i64,
    ) -> PyResult<(u32, Bound<'py, PyBytes>)> {
        let m = self.mask(b, h)?;
        let e = py
            .detach(|| export::cudnn_endpoints(&m.rows))
            .map_err(|e| export_error(py, &e))?;
        Ok((e.nfunc, py_bytes(py, &e.endpoints)))
    }

    /// FlashMask column bounds of `(b, h)`: a dict of int32 bytes `lts`, `lte`, `uts`,
    /// `ute`, each `[kv_len]`. `ValueError` when a column has more than two masked runs.
    #[pyo3(signature = (b = 0, h = 0))]
    fn flashmask_bounds<'py>(
        &self,
        py: Python<'py>,
        b: i64,
        h: i64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let m = self.mask(b, h)?;
        let f = py
            .detach(|| export::flashmask_bounds(&m.rows))
            .map_err(|e| export_error(py, &e))?;
        let d = PyDict::new(py);
        d.set_item("lts", py_bytes(py, &f.lts))?;
        d.set_item("lte", py_bytes(py, &f.lte))?;
        d.set_item("uts", py_bytes(py, &f.uts))?;
        d.set_item("ute", py_bytes(py, &f.ute))?;
        Ok(d)
    }
}
