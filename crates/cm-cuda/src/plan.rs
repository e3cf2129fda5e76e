//! A plan's tile descriptor and row intervals in device memory, uploaded once and reused by
//! every launch over the same mask and lengths.

use crate::Error;
use cm_plan::rows::RowIntervals;
use cm_plan::tiles::{TileCounts, TileDescriptor, TileShape};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Element offsets (in u32 words) of each array inside the one device buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Offsets {
    pub(crate) intervals: usize,
    pub(crate) m_block_order: usize,
    pub(crate) kv_offsets: usize,
    pub(crate) kv_indices: usize,
    pub(crate) full_kv_offsets: usize,
    pub(crate) full_kv_indices: usize,
    pub(crate) partial_row_first: usize,
    pub(crate) row_ptr: usize,
    pub(crate) n_block_order: usize,
    pub(crate) q_offsets: usize,
    pub(crate) q_indices: usize,
    pub(crate) q_partial_ids: usize,
    pub(crate) full_q_offsets: usize,
    pub(crate) full_q_indices: usize,
}

/// One mask's descriptor on the device, shared by every (batch, head) of a launch.
///
/// Holds, in one allocation, the forward tile lists at the kernel's tile shape
/// (`kv_offsets [num_m_blocks + 1]`, `kv_indices [num_partial]`, `full_kv_*` likewise),
/// `partial_row_first [num_partial, block_m]`, the row intervals (`row_ptr [q_len + 1]`,
/// `intervals [num_intervals]` as `[start, end)` u32 pairs) and the order in which query
/// blocks are scheduled (`[num_m_blocks]`, most tiles first, so the longest CTAs start first);
/// for the backward pass also the transposed lists (`q_offsets [num_n_blocks + 1]`,
/// `q_indices` and `q_partial_ids [num_partial]`, `full_q_*` likewise) and the key-block
/// order (`[num_n_blocks]`, most tiles first).
pub struct DevicePlan {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) buffer: CudaSlice<u32>,
    pub(crate) base: u64,
    pub(crate) offsets: Offsets,
    pub(crate) q_len: u32,
    pub(crate) kv_len: u32,
    pub(crate) tile: TileShape,
    pub(crate) num_m_blocks: u32,
    pub(crate) num_n_blocks: u32,
    visible_pairs: u64,
    computed_pairs: u64,
    counts: TileCounts,
}

impl DevicePlan {
    /// Builds the descriptor of `rows` at `tile` and copies it to the device on `stream`, then
    /// waits for the copy, so the plan is ready for launches on any stream of the context.
    pub(crate) fn upload(
        rows: &RowIntervals,
        tile: TileShape,
        stream: &Arc<CudaStream>,
    ) -> Result<DevicePlan, Error> {
        let desc = TileDescriptor::build(rows, tile);
        let mut order: Vec<u32> = (0..desc.num_m_blocks).collect();
        let work = |m: u32| {
            let m = m as usize;
            (desc.kv_offsets[m + 1] - desc.kv_offsets[m])
                + (desc.full_kv_offsets[m + 1] - desc.full_kv_offsets[m])
        };
        order.sort_by_key(|&m| (std::cmp::Reverse(work(m)), std::cmp::Reverse(m)));
        let mut n_order: Vec<u32> = (0..desc.num_n_blocks).collect();
        let n_work = |n: u32| {
            let n = n as usize;
            (desc.q_offsets[n + 1] - desc.q_offsets[n])
                + (desc.full_q_offsets[n + 1] - desc.full_q_offsets[n])
        };
        n_order.sort_by_key(|&n| (std::cmp::Reverse(n_work(n)), std::cmp::Reverse(n)));

        let mut host: Vec<u32> = Vec::new();
        let mut push = |v: &[u32]| {
            let at = host.len();
            host.extend_from_slice(v);
            at
        };
        // Intervals first: offset 0 keeps their 8-byte pairs aligned for the kernel's loads.
        let flat_intervals: Vec<u32> = rows
            .intervals()
            .iter()
            .flat_map(|iv| [iv.start, iv.end])
            .collect();
        let offsets = Offsets {
            intervals: push(&flat_intervals),
            m_block_order: push(&order),
            kv_offsets: push(&desc.kv_offsets),
            kv_indices: push(&desc.kv_indices),
            full_kv_offsets: push(&desc.full_kv_offsets),
            full_kv_indices: push(&desc.full_kv_indices),
            partial_row_first: push(&desc.partial_row_first),
            row_ptr: push(rows.row_ptr()),
            n_block_order: push(&n_order),
            q_offsets: push(&desc.q_offsets),
            q_indices: push(&desc.q_indices),
            q_partial_ids: push(&desc.q_partial_ids),
            full_q_offsets: push(&desc.full_q_offsets),
            full_q_indices: push(&desc.full_q_indices),
        };
        let buffer = stream
            .clone_htod(&host)
            .map_err(|e| Error::driver("plan upload", e))?;
        stream
            .synchronize()
            .map_err(|e| Error::driver("plan upload", e))?;
        let base = {
            let (ptr, _guard) = buffer.device_ptr(stream);
            ptr
        };
        Ok(DevicePlan {
            ctx: stream.context().clone(),
            buffer,
            base,
            offsets,
            q_len: rows.q_len(),
            kv_len: rows.kv_len(),
            tile,
            num_m_blocks: desc.num_m_blocks,
            num_n_blocks: desc.num_n_blocks,
            visible_pairs: rows.visible_pairs(),
            computed_pairs: desc.computed_pairs,
            counts: desc.counts(),
        })
    }

    /// Device address of the array at `offset` (u32 words from the buffer start).
    pub(crate) fn addr(&self, offset: usize) -> u64 {
        self.base + 4 * offset as u64
    }

    pub fn q_len(&self) -> u32 {
        self.q_len
    }

    pub fn kv_len(&self) -> u32 {
        self.kv_len
    }

    /// The tile shape the descriptor was built at (the kernel's).
    pub fn tile(&self) -> TileShape {
        self.tile
    }

    /// Visible (q, k) pairs of the mask: the FLOP count basis (`4 * heads * head_dim * pairs`).
    pub fn visible_pairs(&self) -> u64 {
        self.visible_pairs
    }

    /// In-range pairs inside full and partial tiles: the work the kernel does per head.
    pub fn computed_pairs(&self) -> u64 {
        self.computed_pairs
    }

    /// Tiles by class at [`DevicePlan::tile`].
    pub fn tile_counts(&self) -> TileCounts {
        self.counts
    }

    /// Bytes of device memory the plan holds.
    pub fn device_bytes(&self) -> usize {
        self.buffer.len() * 4
    }
}
