//! Serving decode by the benchmark protocol: correctness first (sampled sequences' outputs
//! against the float64 reference on the same keys, no NaN), then the median of back-to-back
//! calls timed with CUDA events, as TB/s of K and V read (`batch x kv_len x num_kv_heads x
//! head_dim x 2 bytes x 2`) and as a fraction of the device-to-device copy bandwidth measured
//! in the same run ([`copy_bandwidth`]); the host time of one step's enqueue besides.
//! `compilemask bench --decode` and `cm-decode-test` print these.
//!
//! The step: `batch` sequences of one new token each over `kv_len` cached keys (a decode row
//! sees its whole cache), pages of a sequence interleaved with the others' (page `p` of
//! sequence `s` is `p x batch + s`, as a cache grown one step at a time lays them out), every
//! tensor filled with random values (reads of zeros measured up to a third faster).

use crate::reference::{self, Inputs, Shape};
use crate::{median, random_bits, time_calls};
use cm_cuda::{decode_splits, decode_workspace_len, DType, Decode, Error, Runtime};
use cm_plan::rows::RowIntervals;
use cudarc::driver::{CudaSlice, CudaStream};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// One decode benchmark's shape and settings.
#[derive(Clone, Copy, Debug)]
pub struct DecodeOptions {
    /// Sequences, one new query row each.
    pub batch: usize,
    /// Cached keys of every sequence, the new token's included.
    pub kv_len: usize,
    /// Keys per page.
    pub page_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
    /// Back-to-back calls timed.
    pub runs: usize,
    /// Seed of the random contents.
    pub seed: u64,
}

/// What one decode benchmark measured.
#[derive(Clone, Debug)]
pub struct DecodeMeasurement {
    pub opts: DecodeOptions,
    /// The split-KV count the heuristic chose (`cm_cuda::decode_splits`).
    pub splits: u32,
    /// Largest |output - float64 reference| on the sampled sequences, and the accuracy rule's
    /// bound (twice the dtype-emulated attention's error plus 1e-3).
    pub max_err: f64,
    pub tolerance: f64,
    pub nan: usize,
    pub median_ms: f64,
    /// Median host microseconds to enqueue one step (checks and launches, no wait).
    pub enqueue_us: f64,
    pub kv_tb_per_s: f64,
}

impl DecodeMeasurement {
    pub fn pass(&self) -> bool {
        self.nan == 0 && self.max_err <= self.tolerance
    }

    pub fn json(&self, copy_tb_per_s: f64) -> Value {
        let o = &self.opts;
        json!({
            "batch": o.batch, "kv_len": o.kv_len, "page_size": o.page_size,
            "num_heads": o.num_heads, "num_kv_heads": o.num_kv_heads, "head_dim": o.head_dim,
            "dtype": o.dtype.name(), "splits": self.splits, "max_abs_err": self.max_err,
            "tolerance": self.tolerance, "nan": self.nan, "pass": self.pass(),
            "median_ms": self.median_ms, "enqueue_us": self.enqueue_us,
            "kv_tb_per_s": self.kv_tb_per_s, "fraction_of_copy": self.kv_tb_per_s / copy_tb_per_s,
        })
    }
}

/// One block of random values ([`random_bits`]) that fills the benchmark's tensors
/// periodically, kept on the host for the reference.
struct Block {
    host: Vec<u16>,
    device: CudaSlice<u16>,
}

const BLOCK_ELEMS: usize = 1 << 24;

impl Block {
    fn new(stream: &Arc<CudaStream>, dtype: DType, seed: u64) -> Result<Block, Error> {
        let host = random_bits(dtype, BLOCK_ELEMS, seed);
        let device = stream
            .clone_htod(&host)
            .map_err(|e| Error::driver("cuMemcpyHtoD", e))?;
        Ok(Block { host, device })
    }

    /// A device buffer of `n` elements whose element `i` is `host[(i + offset) % len]`.
    fn fill(
        &self,
        stream: &Arc<CudaStream>,
        n: usize,
        offset: usize,
    ) -> Result<CudaSlice<u16>, Error> {
        let drv = |e| Error::driver("cuMemcpyDtoD", e);
        let mut buf = stream
            .alloc_zeros::<u16>(n)
            .map_err(|e| Error::driver("cuMemAlloc", e))?;
        let mut at = 0;
        while at < n {
            let start = (at + offset) % BLOCK_ELEMS;
            let len = (BLOCK_ELEMS - start).min(n - at);
            stream
                .memcpy_dtod(
                    &self.device.slice(start..start + len),
                    &mut buf.slice_mut(at..at + len),
                )
                .map_err(drv)?;
            at += len;
        }
        Ok(buf)
    }

    fn at(&self, i: usize, offset: usize) -> u16 {
        self.host[(i + offset) % BLOCK_ELEMS]
    }
}

/// The device-to-device copy bandwidth in TB/s (a 4 GiB copy of random values reads and
/// writes 4 GiB each), median of `runs` copies.
///
/// # Errors
/// [`Error::Driver`] when an allocation or copy fails.
pub fn copy_bandwidth(rt: &Runtime, stream: &Arc<CudaStream>, runs: usize) -> Result<f64, Error> {
    let n = 1usize << 31;
    let block = Block::new(stream, DType::Bf16, 7)?;
    let src = block.fill(stream, n, 0)?;
    let mut dst = stream
        .alloc_zeros::<u16>(n)
        .map_err(|e| Error::driver("cuMemAlloc", e))?;
    let ms = median(time_calls(rt, stream, 2, runs, || {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(|e| Error::driver("cuMemcpyDtoD", e))
    })?);
    Ok(2.0 * (n * 2) as f64 / ms / 1e9)
}

/// Checks, then times, one decode step of `opts` (module docs).
///
/// # Errors
/// [`Error::InvalidArgument`] for shapes the kernel refuses; [`Error::Driver`].
pub fn measure_decode(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    opts: DecodeOptions,
) -> Result<DecodeMeasurement, Error> {
    let (b, kv, ps) = (opts.batch, opts.kv_len, opts.page_size);
    let (h, h_kv, d) = (opts.num_heads, opts.num_kv_heads, opts.head_dim);
    if b == 0 || kv == 0 || ps == 0 || h_kv == 0 || h % h_kv != 0 {
        return Err(Error::invalid(format!(
            "decode benchmark: batch = {b}, kv_len = {kv}, page_size = {ps}, num_heads = {h}, num_kv_heads = {h_kv}: \
             each must be positive and num_kv_heads must divide num_heads"
        )));
    }
    let drv = |what| move |e| Error::driver(what, e);
    let pages = kv.div_ceil(ps);
    let num_pages = b * pages;
    let cache_elems = num_pages * ps * h_kv * d;
    let block = Block::new(stream, opts.dtype, opts.seed)?;
    // Distinct offsets keep Q, K and V from holding the same numbers.
    let (q_off, k_off, v_off) = (0, 4_999_999, 9_999_991);
    let q = block.fill(stream, b * h * d, q_off)?;
    let k = block.fill(stream, cache_elems, k_off)?;
    let v = block.fill(stream, cache_elems, v_off)?;
    let table: Vec<i32> = (0..b)
        .flat_map(|s| (0..pages).map(move |p| (p * b + s) as i32))
        .collect();
    let up = |x: &[i32]| stream.clone_htod(x).map_err(drv("cuMemcpyHtoD"));
    let block_table = up(&table)?;
    let seqs: Vec<i32> = (0..=b as i32).collect();
    let cu_q = up(&seqs)?;
    let kv_len = up(&vec![kv as i32; b])?;
    let row_ptr = up(&seqs)?;
    let intervals = up(&(0..b).flat_map(|_| [0, kv as i32]).collect::<Vec<i32>>())?;
    let ctas = rt.decode_ctas_per_sm(opts.dtype, d as u32)?;
    let splits = decode_splits(b, 1, h / h_kv, h_kv, kv, rt.num_sms(), ctas);
    let mut out = stream
        .alloc_zeros::<u16>(b * h * d)
        .map_err(drv("cuMemAlloc"))?;
    let mut workspace = stream
        .alloc_zeros::<f32>(decode_workspace_len(splits, b, h, d).max(1))
        .map_err(drv("cuMemAlloc"))?;
    let step = |out: &mut CudaSlice<u16>, ws: &mut CudaSlice<f32>| {
        rt.decode(
            stream,
            Decode {
                dtype: opts.dtype,
                q: &q,
                q_shape: [b, h, d],
                k_cache: &k,
                v_cache: &v,
                cache_shape: [num_pages, ps, h_kv, d],
                out,
                lse: None,
                block_table: &block_table,
                block_table_shape: [b, pages],
                cu_q: &cu_q,
                kv_len: &kv_len,
                row_ptr: &row_ptr,
                intervals: &intervals,
                max_q_len: 1,
                num_splits: splits,
                workspace: (splits > 1).then_some(ws),
                softmax_scale: 1.0 / (d as f32).sqrt(),
            },
        )
    };
    step(&mut out, &mut workspace)?;
    let got = stream.clone_dtoh(&out).map_err(drv("cuMemcpyDtoH"))?;
    stream.synchronize().map_err(drv("cuStreamSynchronize"))?;

    // The first and last sequences against float64 on their keys, gathered on the host from
    // the block the device buffers repeat.
    let (mut max_err, mut emulated_err, mut nan) = (0.0f64, 0.0f64, 0usize);
    let value = |bits: u16| crate::from_bits(opts.dtype, bits);
    for s in [0, b - 1] {
        let mut x = Inputs {
            q: Vec::with_capacity(h * d),
            k: vec![0.0; h_kv * kv * d],
            v: vec![0.0; h_kv * kv * d],
        };
        for i in 0..h * d {
            x.q.push(value(block.at(s * h * d + i, q_off)));
        }
        for pos in 0..kv {
            let page = table[s * pages + pos / ps] as usize;
            for g in 0..h_kv {
                let base = ((page * ps + pos % ps) * h_kv + g) * d;
                for e in 0..d {
                    x.k[(g * kv + pos) * d + e] = value(block.at(base + e, k_off));
                    x.v[(g * kv + pos) * d + e] = value(block.at(base + e, v_off));
                }
            }
        }
        let shape = Shape {
            batch: 1,
            heads: h,
            kv_heads: h_kv,
            q_len: 1,
            kv_len: kv,
            head_dim: d,
            head_dim_v: d,
        };
        let rows = RowIntervals::from_rows(kv as u32, &[vec![(0, kv as u32)]])
            .map_err(|e| Error::invalid(format!("decode benchmark rows: {e}")))?;
        let exp = reference::compute(shape, &x, &rows, &[0], 1.0 / (d as f64).sqrt(), opts.dtype);
        for hh in 0..h {
            for e in 0..d {
                let g = value(got[(s * h + hh) * d + e]);
                nan += usize::from(g.is_nan());
                max_err = max_err.max((g - exp.out[hh * d + e]).abs());
                emulated_err =
                    emulated_err.max((exp.emulated[hh * d + e] - exp.out[hh * d + e]).abs());
            }
        }
    }

    let median_ms = median(time_calls(rt, stream, 3, opts.runs, || {
        step(&mut out, &mut workspace)
    })?);
    let mut enqueue = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        step(&mut out, &mut workspace)?;
        enqueue.push(t.elapsed().as_secs_f64() * 1e6);
        stream.synchronize().map_err(drv("cuStreamSynchronize"))?;
    }
    let bytes = (b * kv * h_kv * d * 2 * 2) as f64;
    Ok(DecodeMeasurement {
        opts,
        splits,
        max_err,
        tolerance: reference::tolerance(emulated_err),
        nan,
        median_ms,
        enqueue_us: median(enqueue),
        kv_tb_per_s: bytes / median_ms / 1e9,
    })
}
