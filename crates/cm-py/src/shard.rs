//! Context-parallel sharding of a plan (`cm_shard`), for `compilemask.distributed`.

use std::sync::Arc;

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::py_bytes;
use crate::plan::Plan;

/// A plan's sequence dealt to ranks by work (private; wrapped by
/// `compilemask.distributed.ContextParallel`).
#[pyclass(frozen, module = "compilemask._native", name = "Sharding")]
pub struct Sharding {
    inner: compilemask::Sharding,
    tile: compilemask::TileShape,
    name: String,
}

impl Sharding {
    /// Shards `plan`'s one mask over `ranks` in chunks of `chunk` tokens.
    pub fn new(plan: &Plan, ranks: u32, chunk: u32) -> PyResult<Sharding> {
        let inner = compilemask::shard_plan(&plan.inner, ranks, chunk)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Sharding {
            inner,
            tile: plan.inner.tile,
            name: plan.name.clone(),
        })
    }

    fn check(&self, r: i64, what: &str) -> PyResult<usize> {
        if (0..i64::from(self.inner.ranks)).contains(&r) {
            Ok(r as usize)
        } else {
            Err(PyIndexError::new_err(format!(
                "{what} = {r} is out of range; expected 0 .. {n} (half-open: the sharding has \
                 ranks = {n})",
                n = self.inner.ranks
            )))
        }
    }
}

#[pymethods]
impl Sharding {
    #[getter]
    fn ranks(&self) -> u32 {
        self.inner.ranks
    }

    #[getter]
    fn chunk(&self) -> u32 {
        self.inner.chunk
    }

    #[getter]
    fn len(&self) -> u32 {
        self.inner.len
    }

    /// `order[new] = original` as little-endian int32 bytes.
    #[getter]
    fn order<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        py_bytes(py, &self.inner.order.order)
    }

    #[getter]
    fn offsets(&self) -> Vec<u32> {
        self.inner.offsets.clone()
    }

    #[getter]
    fn chunks(&self) -> Vec<Vec<u32>> {
        self.inner.chunks.clone()
    }

    #[getter]
    fn work(&self) -> Vec<u64> {
        self.inner.work.clone()
    }

    fn fetched(&self, r: i64) -> PyResult<u64> {
        Ok(self.inner.fetched(self.check(r, "rank")?))
    }

    fn ring_fetched(&self, r: i64) -> PyResult<u64> {
        Ok(self.inner.ring_fetched(self.check(r, "rank")?))
    }

    /// Pairs each rank's kernels compute at the plan's tile.
    fn computed_pairs(&self) -> Vec<u64> {
        self.inner.computed_pairs(self.tile)
    }

    /// The ranges of rank `s`'s local keys that rank `r` reads.
    fn keys(&self, r: i64, s: i64) -> PyResult<Vec<(u32, u32)>> {
        let (r, s) = (self.check(r, "rank")?, self.check(s, "source")?);
        Ok(self.inner.keys(r, s).to_vec())
    }

    /// Rank `r`'s rows against the keys it reads from `s`, as a plan of its own.
    fn part_plan(&self, r: i64, s: i64) -> PyResult<Plan> {
        let (r, s) = (self.check(r, "rank")?, self.check(s, "source")?);
        Ok(Plan {
            inner: Arc::new(self.inner.part_plan(r, s, self.tile)),
            compile_ms: 0.0,
            name: format!("{} (rank {r} from rank {s})", self.name),
            structure: None,
            warnings: Vec::new(),
        })
    }
}
