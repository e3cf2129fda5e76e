//! Score terms of a launch: logit soft-capping, a linear bias, a bias by distance and
//! sinks (`CmScoreParams` in `kernels/common.cuh`, applied by the `CM_SCORE` kernel
//! variants).
//!
//! With `s = softmax_scale * (q . k)` for a visible pair of query row `q` and key `k`
//! (0-based, absolute positions) of query head `h`, the logit the softmax sees is
//!
//! ```text
//! s' = (softcap > 0 ? softcap * tanh(s / softcap) : s)
//!    + slopes[h] * (q_coef * q + k_coef * k + offset)           (linear bias: ALiBi)
//!    + dist_bias[h, q - k + kv_len - 1]                          (bias by distance q - k)
//! ```
//!
//! and each row's softmax also counts `exp(sinks[h])` in its denominator (a sink has value
//! vector 0, so it takes weight from the keys and never makes a row visible: a row with no
//! visible key gets output 0 and lse `sinks[h]`). All values are natural-log units. A
//! bucketed table (T5's relative-position buckets) is a bias by distance once gathered:
//! `dist_bias[h, i] = table[h, bucket[i]]`; with `dist_run_end` (the last index of each
//! index's run of equal buckets) a key tile whose distances lie in one run adds one constant
//! instead of gathering per pair.
//!
//! The backward recomputes every logit the same way, multiplies dS by the softcap's
//! derivative `1 - tanh^2`, and (when `dist_bias_grad` is given) adds `d loss / d dist_bias`
//! into it with atomics: fp32 in the fast mode, int64 fixed point in the deterministic mode
//! (the same bits every run). The
//! sinks' gradient needs no kernel: `d loss / d sinks[h] = -sum over rows of
//! exp(sinks[h] - lse) * delta`, `delta = rowsum(dout * out)`.

use crate::Error;
use cudarc::driver::{CudaSlice, SyncOnDrop};

/// Score terms over Rust-owned buffers ([`crate::Forward::score`], [`crate::Backward::score`]).
/// [`Score::NONE`] is plain attention.
#[derive(Clone, Copy, Debug, Default)]
pub struct Score<'a> {
    /// `softcap * tanh(s / softcap)`; 0 for none, else finite and > 0.
    pub softcap: f32,
    /// `slopes [num_heads]` with `(q_coef, k_coef, offset)`.
    pub linear: Option<(&'a CudaSlice<f32>, LinearCoefs)>,
    /// `dist_bias [num_heads, q_len + kv_len - 1]` (`per_head`) or `[q_len + kv_len - 1]`,
    /// with the optional `dist_run_end [q_len + kv_len - 1]`.
    pub dist: Option<DistBias<'a>>,
    /// `sinks [num_heads]`, read by the forward (the backward takes them through lse).
    pub sinks: Option<&'a CudaSlice<f32>>,
}

/// The affine form of a linear bias: `slopes[h] * (q_coef * q + k_coef * k + offset)`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinearCoefs {
    pub q_coef: f32,
    pub k_coef: f32,
    pub offset: f32,
}

/// A bias by distance over Rust-owned buffers.
#[derive(Clone, Copy, Debug)]
pub struct DistBias<'a> {
    pub values: &'a CudaSlice<f32>,
    pub per_head: bool,
    pub run_end: Option<&'a CudaSlice<u32>>,
}

impl Score<'_> {
    /// No score term.
    pub const NONE: Score<'static> = Score {
        softcap: 0.0,
        linear: None,
        dist: None,
        sinks: None,
    };
}

/// Score terms over device addresses owned by the caller ([`crate::ForwardRaw::score`],
/// [`crate::BackwardRaw::score`]): the same terms as [`Score`], each address 0 for "none"
/// and otherwise the first element of an fp32 (u32 for `dist_run_end`) array of the length
/// [`Score`] gives.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScoreRaw {
    pub softcap: f32,
    pub slopes: u64,
    pub linear: LinearCoefs,
    pub dist_bias: u64,
    pub dist_per_head: bool,
    pub dist_run_end: u64,
    pub sinks: u64,
    /// Backward only: `[num_heads or 1, q_len + kv_len - 1]`, shaped as `dist_bias`, which
    /// the backward adds `d loss / d dist_bias` into (zero it first); 0: not wanted. fp32 in
    /// the fast mode; in the deterministic mode int64 fixed point in units of 2^-32 (integer
    /// atomics, so the same bits every run; each entry's magnitude must stay below 2^31),
    /// 8-byte aligned.
    pub dist_bias_grad: u64,
}

impl ScoreRaw {
    /// Whether a term changes the logits (softcap, linear bias, bias by distance): the launch
    /// then runs the score variants. Sinks alone change only each row's normalisation, which
    /// every forward variant applies (and the backward reads through lse), so they run on the
    /// plain kernels at every built shape.
    pub fn modifies_logits(&self) -> bool {
        self.softcap != 0.0 || self.slopes != 0 || self.dist_bias != 0
    }

    /// Every check of the terms against the launch: the softcap's value, alignment, a
    /// gradient buffer only with its table, offsets exact in fp32.
    pub(crate) fn check(&self, q_len: u32, kv_len: u32) -> Result<(), Error> {
        if self.softcap != 0.0 && !(self.softcap.is_finite() && self.softcap > 0.0) {
            return Err(Error::invalid(format!(
                "score softcap = {}: expected a finite value > 0 (or 0 for none)",
                self.softcap
            )));
        }
        for (name, addr) in [
            ("score slopes", self.slopes),
            ("score dist_bias", self.dist_bias),
            ("score dist_run_end", self.dist_run_end),
            ("score sinks", self.sinks),
            ("score dist_bias_grad", self.dist_bias_grad),
        ] {
            crate::forward::check_addr(name, addr, 4)?;
        }
        if self.dist_run_end != 0 && self.dist_bias == 0 {
            return Err(Error::invalid(
                "score dist_run_end given without dist_bias: the runs describe a distance table",
            ));
        }
        if self.dist_bias_grad != 0 && self.dist_bias == 0 {
            return Err(Error::invalid(
                "score dist_bias_grad given without dist_bias: there is no table to differentiate",
            ));
        }
        let l = self.linear;
        if self.slopes != 0
            && !(l.q_coef.is_finite() && l.k_coef.is_finite() && l.offset.is_finite())
        {
            return Err(Error::invalid(format!(
                "score linear coefficients {l:?}: expected finite values"
            )));
        }
        // Positions and distances are formed in fp32, exact below 2^24.
        if q_len as u64 + kv_len as u64 > 1 << 24 && self.modifies_logits() {
            return Err(Error::invalid(format!(
                "score terms with q_len + kv_len = {} tokens: at most 2^24, where positions stay exact in fp32",
                q_len as u64 + kv_len as u64
            )));
        }
        Ok(())
    }

    pub(crate) fn params(&self, q_len: u32, kv_len: u32, backward: bool) -> ScoreParams {
        let len = (q_len + kv_len).saturating_sub(1);
        ScoreParams {
            slopes: self.slopes,
            dist_bias: self.dist_bias,
            dist_run_end: self.dist_run_end,
            sinks: if backward { 0 } else { self.sinks },
            dist_bias_grad: if backward { self.dist_bias_grad } else { 0 },
            softcap: self.softcap,
            inv_softcap: if self.softcap > 0.0 {
                1.0 / self.softcap
            } else {
                0.0
            },
            q_coef: self.linear.q_coef,
            k_coef: self.linear.k_coef,
            offset: self.linear.offset,
            dist_head_stride: if self.dist_per_head { len } else { 0 },
        }
    }
}

/// Mirrors `CmScoreParams` in `kernels/common.cuh` field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ScoreParams {
    slopes: u64,
    dist_bias: u64,
    dist_run_end: u64,
    sinks: u64,
    dist_bias_grad: u64,
    softcap: f32,
    inv_softcap: f32,
    q_coef: f32,
    k_coef: f32,
    offset: f32,
    dist_head_stride: u32,
}

const _: () = assert!(
    std::mem::size_of::<ScoreParams>() == 64,
    "must match sizeof(CmScoreParams)"
);

/// Checks each buffer of `score` against the lengths it must span and returns the device
/// addresses, recording their use on `stream` in the guards it pushes.
pub(crate) fn score_buffers<'s>(
    score: &Score<'s>,
    stream: &'s cudarc::driver::CudaStream,
    q_len: u32,
    kv_len: u32,
    num_heads: usize,
    guards: &mut Vec<SyncOnDrop<'s>>,
) -> Result<ScoreRaw, Error> {
    use cudarc::driver::DevicePtr;
    let len = (q_len as usize + kv_len as usize).saturating_sub(1);
    let mut raw = ScoreRaw {
        softcap: score.softcap,
        ..ScoreRaw::default()
    };
    let mut ptr_f32 = |name: &str, buf: &'s CudaSlice<f32>, need: usize| -> Result<u64, Error> {
        crate::layout::check_buffer_len(name, buf.len(), need)?;
        let (ptr, guard) = buf.device_ptr(stream);
        guards.push(guard);
        Ok(ptr)
    };
    if let Some((slopes, coefs)) = score.linear {
        raw.slopes = ptr_f32("score slopes", slopes, num_heads)?;
        raw.linear = coefs;
    }
    if let Some(sinks) = score.sinks {
        raw.sinks = ptr_f32("score sinks", sinks, num_heads)?;
    }
    if let Some(d) = score.dist {
        let heads = if d.per_head { num_heads } else { 1 };
        raw.dist_bias = ptr_f32("score dist_bias", d.values, heads * len)?;
        raw.dist_per_head = d.per_head;
        if let Some(run_end) = d.run_end {
            crate::layout::check_buffer_len("score dist_run_end", run_end.len(), len)?;
            let (ptr, guard) = run_end.device_ptr(stream);
            guards.push(guard);
            raw.dist_run_end = ptr;
        }
    }
    Ok(raw)
}
