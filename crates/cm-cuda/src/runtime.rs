//! The loaded kernels of one CUDA context and the launch entry points.

use crate::decode::{prepare_decode, row_major, Decode, DecodeRaw};
use crate::forward::{prepare, Launch};
use crate::layout::check_buffer_len;
use crate::prefill::{prefill_host_plan, prepare_prefill, Prefill, PrefillRaw};
use crate::{DevicePlan, Error, Forward, ForwardRaw, HostPlan, PlanLists, PlanView};
use cm_kernels::{KernelKind, VARIANTS};
use cm_plan::rows::RowIntervals;
use cm_plan::tiles::TileShape;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The embedded kernels loaded into one CUDA context. Cheap to share (`&Runtime` is all a
/// launch needs); create one per context.
pub struct Runtime {
    ctx: Arc<CudaContext>,
    /// One function per entry of `cm_kernels::VARIANTS`.
    functions: Vec<CudaFunction>,
    forward_kernel: KernelKind,
    forward_tile: Option<(u32, u32)>,
    /// Streaming multiprocessors of the device: the grid of the persistent kernels.
    num_sms: u32,
    /// L2 cache bytes of the device (fwd_ws's head groups).
    l2_bytes: u64,
    /// Owns the work counters of the persistent kernels, two u32 per slot, all zero between
    /// launches (each launch leaves its counter as it found it).
    _schedulers: CudaSlice<u32>,
    /// Their device address, taken once so that launches record no events on them.
    schedulers_base: u64,
    /// The slot of each stream that has launched a persistent kernel, by stream handle:
    /// launches on one stream run one after another, so they can share a counter.
    scheduler_slots: Mutex<HashMap<usize, usize>>,
}

/// Streams with a work counter of their own ([`Runtime::scheduler_for`]).
const MAX_SCHEDULER_STREAMS: usize = 1024;

impl Runtime {
    /// Opens device `ordinal` (its primary context) and loads the kernels.
    ///
    /// # Errors
    /// [`Error::KernelsUnavailable`] when built without NVRTC, [`Error::DriverUnavailable`]
    /// with no libcuda, [`Error::UnsupportedDevice`] for anything but compute capability 9.0,
    /// [`Error::Driver`] when the driver refuses.
    pub fn new_on_device(ordinal: usize) -> Result<Runtime, Error> {
        crate::kernels::embedded()?;
        if !driver_present() {
            return Err(Error::DriverUnavailable);
        }
        let count =
            CudaContext::device_count().map_err(|e| Error::driver("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::UnsupportedDevice(format!(
                "device ordinal {ordinal}, but this machine has {count} CUDA device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::driver("context creation", e))?;
        Runtime::new(ctx)
    }

    /// Loads the kernels into an existing context (e.g. the one torch uses).
    ///
    /// # Errors
    /// As [`Runtime::new_on_device`].
    pub fn new(ctx: Arc<CudaContext>) -> Result<Runtime, Error> {
        let table = crate::kernels::embedded()?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| Error::driver("cuDeviceGetAttribute", e))?;
        if cc != (9, 0) {
            let name = ctx.name().unwrap_or_else(|_| "unknown".into());
            return Err(Error::UnsupportedDevice(format!(
                "device {} ({name}) has compute capability {}.{}; the kernels are built for sm_90a and run \
                 only on compute capability 9.0 (H100, H200)",
                ctx.ordinal(),
                cc.0,
                cc.1
            )));
        }
        let functions = VARIANTS
            .iter()
            .zip(table)
            .map(|(v, k)| {
                let module = ctx
                    .load_module(Ptx::from_binary(k.bytes.to_vec()))
                    .map_err(|e| Error::driver("cuModuleLoadData", e))?;
                let f = module
                    .load_function(v.kernel.entry_point())
                    .map_err(|e| Error::driver("cuModuleGetFunction", e))?;
                let dynamic = v.dynamic_shared_bytes();
                if dynamic > 0 {
                    // Above 48 KB a kernel must opt in to its dynamic shared memory.
                    f.set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        dynamic as i32,
                    )
                    .map_err(|e| Error::driver("cuFuncSetAttribute", e))?;
                }
                Ok(f)
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let num_sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| Error::driver("cuDeviceGetAttribute", e))?;
        let l2_bytes = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(|e| Error::driver("cuDeviceGetAttribute", e))?;
        let init = ctx.default_stream();
        let schedulers = init
            .alloc_zeros::<u32>(2 * MAX_SCHEDULER_STREAMS)
            .map_err(|e| Error::driver("work counter allocation", e))?;
        init.synchronize()
            .map_err(|e| Error::driver("work counter allocation", e))?;
        let schedulers_base = {
            let (ptr, _guard) = schedulers.device_ptr(&init);
            ptr
        };
        Ok(Runtime {
            ctx,
            functions,
            forward_kernel: KernelKind::FwdWs,
            forward_tile: None,
            num_sms: num_sms.max(1) as u32,
            l2_bytes: l2_bytes.max(0) as u64,
            _schedulers: schedulers,
            schedulers_base,
            scheduler_slots: Mutex::new(HashMap::new()),
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The kernel forward launches use: [`KernelKind::FwdWs`] unless set otherwise.
    pub fn forward_kernel(&self) -> KernelKind {
        self.forward_kernel
    }

    /// Chooses the forward kernel, e.g. [`KernelKind::FwdSimple`], the mma.sync reference
    /// path. Plans are shared: every plan holds the lists of every forward kernel.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a kernel that is not a forward kernel.
    pub fn set_forward_kernel(&mut self, kernel: KernelKind) -> Result<(), Error> {
        if !kernel.is_forward() {
            return Err(Error::invalid(format!(
                "{} is not a forward kernel",
                kernel.name()
            )));
        }
        self.forward_kernel = kernel;
        Ok(())
    }

    /// The tile forward launches use where their kernel has several at the launch's head dims
    /// (`fwd_ws` at head_dim 64: 128x128 and 192x128); `None` (the default): the one each plan
    /// ranks first ([`crate::ws_order`]).
    pub fn forward_tile(&self) -> Option<(u32, u32)> {
        self.forward_tile
    }

    /// Pins the forward's tile (tests and benchmarks run both of `fwd_ws`'s at head_dim 64);
    /// a launch whose kernel has no variant at that tile for its head dims is refused.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a tile no forward kernel is built at.
    pub fn set_forward_tile(&mut self, tile: Option<(u32, u32)>) -> Result<(), Error> {
        if let Some((m, n)) = tile {
            if !cm_kernels::VARIANTS
                .iter()
                .any(|v| v.kernel.is_forward() && v.tile() == (m, n))
            {
                return Err(Error::invalid(format!(
                    "no forward kernel is built at tile {m}x{n}; fwd_ws's tiles: {:?}",
                    cm_kernels::FWD_WS_TILES
                )));
            }
        }
        self.forward_tile = tile;
        Ok(())
    }

    /// Builds the tile descriptor of `rows` at the kernels' tile shapes ([`cm_kernels::TILE`],
    /// the forward lists at each of [`cm_kernels::FWD_WS_TILES`] and the transposed lists at
    /// [`crate::BWD_TILE`]) and uploads it with the row intervals. Waits for the copy (once per plan, never per launch).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `stream` belongs to another context; [`Error::Driver`].
    pub fn upload_plan(
        &self,
        rows: &RowIntervals,
        stream: &Arc<CudaStream>,
    ) -> Result<DevicePlan, Error> {
        self.check_stream(stream)?;
        DevicePlan::upload(&HostPlan::build(rows, kernel_tile()), stream)
    }

    /// [`Runtime::upload_plan`] for a plan of several masks: `masks` (sharing q_len and
    /// kv_len) and `mask_index`, row-major `[mask_dims[0], mask_dims[1]]` = `[batch,
    /// num_heads]` (a side of 1 applies to every batch or head), naming each (batch, head)'s
    /// mask. One launch then runs every (batch, head) with its own mask.
    ///
    /// # Errors
    /// As [`HostPlan::build_masks`], and as [`Runtime::upload_plan`].
    pub fn upload_plan_masks(
        &self,
        masks: &[&RowIntervals],
        mask_index: &[u32],
        mask_dims: [usize; 2],
        stream: &Arc<CudaStream>,
    ) -> Result<DevicePlan, Error> {
        self.check_stream(stream)?;
        let host =
            HostPlan::build_masks(masks, mask_index, mask_dims, kernel_tile(), PlanLists::All)?;
        DevicePlan::upload(&host, stream)
    }

    /// [`Runtime::upload_plan`] for [`Runtime::prefill`]: a prefill layout's rows over its
    /// virtual keys (`cm_serve::Prefill::rows`), with only the lists the paged forward reads
    /// ([`crate::prefill::prefill_lists`]), so other launches refuse the plan.
    ///
    /// # Errors
    /// As [`Runtime::upload_plan`].
    pub fn upload_prefill_plan(
        &self,
        rows: &RowIntervals,
        stream: &Arc<CudaStream>,
    ) -> Result<DevicePlan, Error> {
        self.check_stream(stream)?;
        DevicePlan::upload(&prefill_host_plan(rows)?, stream)
    }

    /// Forward attention over Rust-owned buffers, enqueued on `stream`; returns without
    /// waiting for the GPU.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first check that fails (shapes against each other
    /// and the plan, strides, alignment, a buffer shorter than its layout spans, GQA
    /// divisibility, head_dim, grid limits); [`Error::Driver`] if the launch is refused.
    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        plan: &DevicePlan,
        args: Forward<'_>,
    ) -> Result<(), Error> {
        self.check_stream(stream)?;
        self.check_plan(plan)?;
        self.bind_context()?;
        check_buffer_len("q", args.q.0.len(), args.q.1.span_elements())?;
        check_buffer_len("k", args.k.0.len(), args.k.1.span_elements())?;
        check_buffer_len("v", args.v.0.len(), args.v.1.span_elements())?;
        check_buffer_len("out", args.out.0.len(), args.out.1.span_elements())?;
        if let Some((buf, layout)) = &args.lse {
            check_buffer_len("lse", buf.len(), layout.span_elements())?;
        }
        // The guards record the buffers' use on `stream` (when the context tracks events), so
        // freeing one waits for this launch; they must live until the launch is enqueued.
        let (q, _gq) = args.q.0.device_ptr(stream);
        let (k, _gk) = args.k.0.device_ptr(stream);
        let (v, _gv) = args.v.0.device_ptr(stream);
        let (_, _gp) = plan.buffer.device_ptr(stream);
        let (out, _go) = args.out.0.device_ptr_mut(stream);
        let (lse, _gl) = match args.lse {
            Some((buf, layout)) => {
                let (ptr, guard) = buf.device_ptr_mut(stream);
                (Some((ptr, layout)), Some(guard))
            }
            None => (None, None),
        };
        let mut score_guards = Vec::new();
        let score = crate::score::score_buffers(
            &args.score,
            stream,
            plan.q_len,
            plan.kv_len,
            args.q.1.shape[1],
            &mut score_guards,
        )?;
        let raw = ForwardRaw {
            score,
            dtype: args.dtype,
            q,
            q_layout: args.q.1,
            k,
            k_layout: args.k.1,
            v,
            v_layout: args.v.1,
            out,
            out_layout: args.out.1,
            lse,
            softmax_scale: args.softmax_scale,
        };
        match prepare(plan, &raw, (self.forward_kernel, self.forward_tile), true)? {
            Some(launch) => self.launch(stream, launch),
            None => Ok(()),
        }
    }

    /// Forward attention over device addresses owned by the caller, enqueued on `stream`;
    /// returns without waiting for the GPU. Performs every check of [`Runtime::forward`]
    /// except the buffer lengths, which it cannot know.
    ///
    /// # Safety
    /// Each address must point to device memory of this runtime's context that holds at least
    /// the elements its layout spans ([`crate::TensorLayout::span_elements`]), stays allocated
    /// until the launch has finished on `stream`, and is not written by other work meanwhile;
    /// `out` and `lse` must not overlap each other or the inputs. `plan` must likewise outlive
    /// the launch.
    ///
    /// # Errors
    /// As [`Runtime::forward`].
    #[allow(unsafe_code)]
    pub unsafe fn forward_raw(
        &self,
        stream: &CudaStream,
        plan: &PlanView,
        args: &ForwardRaw,
    ) -> Result<(), Error> {
        self.check_stream(stream)?;
        self.check_plan(plan)?;
        self.bind_context()?;
        match prepare(plan, args, (self.forward_kernel, self.forward_tile), true)? {
            Some(launch) => self.launch(stream, launch),
            None => Ok(()),
        }
    }

    /// Streaming multiprocessors of the device.
    pub fn num_sms(&self) -> u32 {
        self.num_sms
    }

    /// L2 cache bytes of the device (the forward's and backward's head groups).
    pub(crate) fn l2_bytes(&self) -> u64 {
        self.l2_bytes
    }

    /// CTAs of the decode kernel at `dtype` and `head_dim` that one SM runs at once (the
    /// driver's occupancy of its registers and shared memory), for [`crate::decode_splits`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a head_dim without a decode kernel; [`Error::Driver`].
    pub fn decode_ctas_per_sm(&self, dtype: crate::DType, head_dim: u32) -> Result<u32, Error> {
        let v = cm_kernels::find_variant(KernelKind::Decode, dtype, head_dim, head_dim, false)
            .ok_or_else(|| {
                let built = cm_kernels::built_head_dims(KernelKind::Decode, dtype, false);
                Error::invalid(format!(
                    "head_dim = {head_dim} is not supported by the decode kernel; built head \
                     dims: {}",
                    cm_kernels::head_dims_text(&built)
                ))
            })?;
        let variant = &VARIANTS[v];
        self.functions[v]
            .occupancy_max_active_blocks_per_multiprocessor(
                variant.threads(),
                variant.dynamic_shared_bytes() as usize,
                None,
            )
            .map_err(|e| Error::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))
    }

    /// Serving attention of one step over a paged KV cache in Rust-owned buffers
    /// ([`crate::decode`]), enqueued on `stream`; returns without waiting for the GPU.
    ///
    /// # Errors
    /// As [`Runtime::decode_raw`], and a buffer shorter than its shape spans.
    #[allow(unsafe_code)]
    pub fn decode(&self, stream: &Arc<CudaStream>, args: Decode<'_>) -> Result<(), Error> {
        let [total_q, h, d] = args.q_shape;
        let [num_seqs, _] = args.block_table_shape;
        check_paged_buffers(
            [
                args.q.len(),
                args.k_cache.len(),
                args.v_cache.len(),
                args.out.len(),
                args.block_table.len(),
            ],
            args.lse.as_ref().map(|l| l.len()),
            args.q_shape,
            args.cache_shape,
            args.block_table_shape,
        )?;
        check_buffer_len("cu_q", args.cu_q.len(), num_seqs + 1)?;
        check_buffer_len("kv_len", args.kv_len.len(), num_seqs)?;
        check_buffer_len("row_ptr", args.row_ptr.len(), total_q + 1)?;
        if args.intervals.len() % 2 != 0 {
            return Err(Error::invalid(format!(
                "intervals: {} elements, expected (start, end) pairs",
                args.intervals.len()
            )));
        }
        let (q, _gq) = args.q.device_ptr(stream);
        let (k, _gk) = args.k_cache.device_ptr(stream);
        let (v, _gv) = args.v_cache.device_ptr(stream);
        let (bt, _gb) = args.block_table.device_ptr(stream);
        let (cu_q, _gc) = args.cu_q.device_ptr(stream);
        let (kv_len, _gl) = args.kv_len.device_ptr(stream);
        let (row_ptr, _gr) = args.row_ptr.device_ptr(stream);
        let (intervals, _gi) = args.intervals.device_ptr(stream);
        let num_intervals = args.intervals.len() / 2;
        let (out, _go) = args.out.device_ptr_mut(stream);
        let (lse, _gs) = match args.lse {
            Some(buf) => {
                let (p, g) = buf.device_ptr_mut(stream);
                (Some((p, h as i64)), Some(g))
            }
            None => (None, None),
        };
        let (workspace, _gw) = match args.workspace {
            Some(buf) => {
                let len = buf.len();
                let (p, g) = buf.device_ptr_mut(stream);
                (Some((p, len)), Some(g))
            }
            None => (None, None),
        };
        let raw = DecodeRaw {
            dtype: args.dtype,
            q,
            q_shape: args.q_shape,
            q_strides: row_major(args.q_shape),
            k_cache: k,
            v_cache: v,
            cache_shape: args.cache_shape,
            k_strides: row_major(args.cache_shape),
            v_strides: row_major(args.cache_shape),
            out,
            out_strides: row_major([total_q, h, d]),
            lse,
            block_table: bt,
            block_table_shape: args.block_table_shape,
            block_table_stride: args.block_table_shape[1] as i64,
            cu_q,
            kv_len,
            row_ptr,
            intervals,
            num_intervals,
            max_q_len: args.max_q_len,
            num_splits: args.num_splits,
            workspace,
            softmax_scale: args.softmax_scale,
        };
        // SAFETY: every address comes from a live CudaSlice whose length was checked against
        // the span its shape reaches (the step's arrays against num_seqs and total_q; the
        // kernel clamps the indices it reads from them), and the guards above record the use on
        // `stream` until the launch is enqueued; `out`, `lse` and `workspace` are distinct
        // `&mut` buffers, so they alias nothing.
        unsafe { self.decode_raw(stream, &raw) }
    }

    /// Serving attention of one step over device addresses owned by the caller, enqueued on
    /// `stream` (one launch, two with `num_splits > 1`: the split-KV partials, then their
    /// merge); returns without waiting for the GPU, so it can be captured in a CUDA graph.
    ///
    /// # Safety
    /// Each address must point to device memory of this runtime's context holding its shape
    /// (the step's arrays: `num_seqs + 1`, `num_seqs`, `total_q + 1` and `2 x num_intervals`
    /// int32), live until the launch has finished on `stream`; `out`, `lse` and `workspace`
    /// must not overlap each other or the inputs.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first check of [`crate::check_decode`] that fails;
    /// [`Error::Driver`] if a launch is refused.
    #[allow(unsafe_code)]
    pub unsafe fn decode_raw(&self, stream: &CudaStream, args: &DecodeRaw) -> Result<(), Error> {
        self.check_stream(stream)?;
        self.bind_context()?;
        let Some(launch) = prepare_decode(args)? else {
            return Ok(());
        };
        let kernels = std::iter::once((launch.variant, launch.config)).chain(launch.merge);
        for (variant, config) in kernels {
            let mut builder = stream.launch_builder(&self.functions[variant]);
            builder.arg(&launch.params);
            // SAFETY: both entry points of decode.cu take one by-value CmDecodeParams, which
            // DecodeParams mirrors; block size and shared memory are the variant's.
            // `prepare_decode` checked alignment, strides and the workspace's size, the kernel
            // clamps every index it reads from the step's arrays and the block table, and the
            // caller guarantees the spans are allocated and live (this function's contract).
            unsafe { builder.launch(config) }.map_err(|e| Error::driver("cuLaunchKernel", e))?;
        }
        Ok(())
    }

    /// Serving's prefill-chunk path ([`crate::prefill`]): a step's rows, laid out by
    /// `cm_serve::StepPlan::prefill` and uploaded as `plan`, through the warp-specialised
    /// forward with K and V read from the paged cache; one persistent launch on `stream`,
    /// no host synchronisation.
    ///
    /// # Errors
    /// As [`Runtime::prefill_raw`], and a buffer shorter than its shape spans.
    #[allow(unsafe_code)]
    pub fn prefill(
        &self,
        stream: &Arc<CudaStream>,
        plan: &DevicePlan,
        args: Prefill<'_>,
    ) -> Result<(), Error> {
        self.check_plan(plan)?;
        let total_q = args.q_shape[0];
        check_paged_buffers(
            [
                args.q.len(),
                args.k_cache.len(),
                args.v_cache.len(),
                args.out.len(),
                args.block_table.len(),
            ],
            args.lse.as_ref().map(|l| l.len()),
            args.q_shape,
            args.cache_shape,
            args.block_table_shape,
        )?;
        let blocks = (plan.kv_len / crate::prefill::PREFILL_KEY_BLOCK) as usize;
        if args.key_blocks.len() != 4 * blocks {
            return Err(Error::invalid(format!(
                "key_blocks: {} elements, expected 4 x {blocks} for the plan's kv_len = {}",
                args.key_blocks.len(),
                plan.kv_len
            )));
        }
        let (q, _gq) = args.q.device_ptr(stream);
        let (k, _gk) = args.k_cache.device_ptr(stream);
        let (v, _gv) = args.v_cache.device_ptr(stream);
        let (bt, _gb) = args.block_table.device_ptr(stream);
        let (kb, _gkb) = args.key_blocks.device_ptr(stream);
        let (_, _gp) = plan.buffer.device_ptr(stream);
        let (out, _go) = args.out.device_ptr_mut(stream);
        let (lse, _gs) = match args.lse {
            Some(buf) => {
                let (p, g) = buf.device_ptr_mut(stream);
                (Some((p, total_q as i64)), Some(g))
            }
            None => (None, None),
        };
        let raw = PrefillRaw {
            dtype: args.dtype,
            q,
            q_shape: args.q_shape,
            q_strides: row_major(args.q_shape),
            k_cache: k,
            v_cache: v,
            cache_shape: args.cache_shape,
            k_strides: row_major(args.cache_shape),
            v_strides: row_major(args.cache_shape),
            out,
            out_strides: row_major(args.q_shape),
            lse,
            block_table: bt,
            block_table_shape: args.block_table_shape,
            block_table_stride: args.block_table_shape[1] as i64,
            key_blocks: kb,
            softmax_scale: args.softmax_scale,
        };
        // SAFETY: every address comes from a live CudaSlice whose length was checked against
        // the span its shape reaches (key_blocks against the plan's key blocks; the kernel
        // clamps what it reads from them and from the block table), the plan is this
        // runtime's upload, and the guards above record the use on `stream` until the launch
        // is enqueued; `out` and `lse` are distinct `&mut` buffers, so they alias nothing.
        unsafe { self.prefill_raw(stream, plan, &raw) }
    }

    /// [`Runtime::prefill`] over device addresses owned by the caller, enqueued on `stream`.
    ///
    /// # Safety
    /// Each address must point to device memory of this runtime's context holding its shape
    /// (`key_blocks`: `4 x plan.kv_len / PREFILL_KEY_BLOCK` int32), live until the launch
    /// has finished on `stream`; `out` and `lse` must not overlap each other or the inputs;
    /// `plan` must outlive the launch.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first check of [`crate::check_prefill`] that
    /// fails; [`Error::Driver`] if the launch is refused.
    #[allow(unsafe_code)]
    pub unsafe fn prefill_raw(
        &self,
        stream: &CudaStream,
        plan: &PlanView,
        args: &PrefillRaw,
    ) -> Result<(), Error> {
        self.check_stream(stream)?;
        self.check_plan(plan)?;
        self.bind_context()?;
        match prepare_prefill(plan, args, true)? {
            Some(launch) => self.launch(stream, launch),
            None => Ok(()),
        }
    }

    /// The device address of `stream`'s work counter.
    fn scheduler_for(&self, stream: &CudaStream) -> Result<u64, Error> {
        // A poisoned lock only means another thread panicked while inserting; the map is
        // consistent (an entry is inserted whole or not at all).
        let mut slots = self
            .scheduler_slots
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let next = slots.len();
        let slot = *slots.entry(stream.cu_stream() as usize).or_insert(next);
        if slot >= MAX_SCHEDULER_STREAMS {
            slots.remove(&(stream.cu_stream() as usize));
            return Err(Error::invalid(format!(
                "forward launches on more than {MAX_SCHEDULER_STREAMS} distinct streams of one runtime; \
                 reuse streams or Runtime::set_forward_kernel(KernelKind::FwdWgmma)"
            )));
        }
        Ok(self.schedulers_base + 8 * slot as u64)
    }

    #[allow(unsafe_code)]
    fn launch(&self, stream: &CudaStream, mut launch: Launch) -> Result<(), Error> {
        if launch.tensor_maps.is_some() {
            // FwdWs is persistent: one CTA per SM takes work items from the stream's counter.
            launch.config.grid_dim.0 = launch.config.grid_dim.0.min(self.num_sms);
            launch.params.scheduler = self.scheduler_for(stream)?;
            launch.params.ws_head_group =
                crate::forward::head_group(self.l2_bytes, launch.kv_bytes_per_pair, launch.pairs);
        }
        let func = &self.functions[launch.variant];
        let mut builder = stream.launch_builder(func);
        builder.arg(&launch.params);
        if let Some(maps) = &launch.tensor_maps {
            for map in maps {
                builder.arg(map);
            }
        }
        // SAFETY: `func` is the variant `prepare` chose for these arguments, and its
        // parameters are a by-value CmFwdParams, which `params` mirrors, followed for FwdWs
        // (exactly when `tensor_maps` is set) by the TMA descriptors of Q, K and V, encoded
        // from the same addresses and layouts, its work counter a live slot of `schedulers`
        // that only launches on this stream use (so never two at once); the block size and
        // dynamic shared memory are the variant's. `prepare` checked that
        // every address is aligned and that the grid, shapes and strides match the plan and
        // each other, so the kernel touches only elements inside each layout's span; the
        // callers guarantee the spans are allocated and live (checked lengths in `forward`,
        // the caller's contract in `forward_raw`).
        unsafe { builder.launch(launch.config) }.map_err(|e| Error::driver("cuLaunchKernel", e))?;
        Ok(())
    }

    /// The loaded kernel of `cm_kernels::VARIANTS[variant]`.
    pub(crate) fn function(&self, variant: usize) -> &CudaFunction {
        &self.functions[variant]
    }

    pub(crate) fn check_stream(&self, stream: &CudaStream) -> Result<(), Error> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::invalid(
                "the stream belongs to another CUDA context than this runtime's",
            ));
        }
        Ok(())
    }

    /// Makes the runtime's context current on the calling thread. Encoding a TMA descriptor
    /// (`cuTensorMapEncodeTiled`) needs one, and a caller's thread may have none: PyTorch runs
    /// backward passes on its own autograd threads, where the driver reported
    /// `CUDA_ERROR_INVALID_CONTEXT`. Every launch entry point calls it before `prepare`.
    pub(crate) fn bind_context(&self) -> Result<(), Error> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::driver("binding the CUDA context to this thread", e))
    }

    pub(crate) fn check_plan(&self, plan: &PlanView) -> Result<(), Error> {
        if plan.ctx.cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::invalid(
                "the plan was uploaded to another CUDA context than this runtime's",
            ));
        }
        Ok(())
    }
}

/// The lengths of a serving launch's buffers (`[q, k_cache, v_cache, out, block_table]`, and
/// lse's) against the spans their shapes reach: `q` and `out` `[total_q, num_heads,
/// head_dim]`, the caches `cache_shape`, lse `total_q x num_heads`.
fn check_paged_buffers(
    lens: [usize; 5],
    lse: Option<usize>,
    q_shape: [usize; 3],
    cache_shape: [usize; 4],
    block_table_shape: [usize; 2],
) -> Result<(), Error> {
    let span = |shape: &[usize]| shape.iter().product::<usize>();
    let q = span(&q_shape);
    let names = ["q", "k_cache", "v_cache", "out", "block_table"];
    let spans = [
        q,
        span(&cache_shape),
        span(&cache_shape),
        q,
        span(&block_table_shape),
    ];
    for ((name, len), want) in names.into_iter().zip(lens).zip(spans) {
        check_buffer_len(name, len, want)?;
    }
    match lse {
        Some(len) => check_buffer_len("lse", len, q_shape[0] * q_shape[1]),
        None => Ok(()),
    }
}

/// The tile shape of the plan's own lists ([`cm_kernels::TILE`]).
fn kernel_tile() -> TileShape {
    let (block_m, block_n) = cm_kernels::TILE;
    TileShape { block_m, block_n }
}

#[allow(unsafe_code)]
fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names; loading the NVIDIA driver
    // library has no preconditions.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without kernels or without a GPU, opening the runtime is an error that
    /// says what is missing, never a panic.
    #[test]
    fn missing_kernels_or_driver_is_a_clear_error() {
        match Runtime::new_on_device(0) {
            Ok(_) => {} // a machine with a Hopper GPU and embedded kernels
            Err(Error::KernelsUnavailable(msg)) => {
                assert!(
                    msg.contains("CM_NVRTC_DIR") && crate::embedded_kernels().is_err(),
                    "{msg}"
                );
            }
            Err(Error::DriverUnavailable) => {
                assert_eq!(crate::embedded_kernels().unwrap().len(), VARIANTS.len())
            }
            Err(e) => assert!(matches!(e, Error::UnsupportedDevice(_)), "{e}"),
        }
    }
}
