// The score terms' per-element work (CmScoreParams, common.cuh), shared by the CM_SCORE
// variants of fwd_ws, bwd_dkdv and bwd_dq. They all hold scores in the m16n8 accumulator
// layout: element [j][e] of a thread's fragment has row row_base + 8 (e >> 1) and column
// col_base + 8 j + (e & 1) (col_base includes the thread's 2 t). Rows are queries and columns
// keys, or the reverse with KEY_ROWS (bwd_dkdv computes S^T).
#pragma once
#include "common.cuh"

// The hardware's approximate tanh (one special-function op, as FlashAttention-3's softcap):
// its relative error of about 2^-11 moves a capped logit by less than the rounding of
// bf16 / fp16 inputs already moves q . k. (Two at a time through tanh.approx.f16x2 measured
// no faster: the conversions to and from fp16 cost what the op saved.)
__device__ __forceinline__ float cm_tanh(float x) {
    float r;
    asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// The softcap's derivative 1 - tanh^2 of a fragment, in [0, 1], as f16 pairs: element [j][e]
// is half e & 1 of word [j][e >> 1]. The backward multiplies it into dS, which its products
// round to bf16 / fp16 anyway, and half the registers keep bwd_dkdv's score variant from
// spilling (32 more live floats across the score terms and dS spilled 1.2 KB a thread).
template <int NB>
using CmDcap = u32[NB][2];

__device__ __forceinline__ u32 cm_pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// a *= dcap element by element: the softcap's derivative into dS (or into P, which becomes
// dS's factor) in the backward kernels.
template <int NB>
__device__ __forceinline__ void cm_mul_dcap(float (&a)[NB][4], const CmDcap<NB>& dcap) {
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float lo, hi;
            asm("{ .reg .f16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }"
                : "=f"(lo), "=f"(hi)
                : "r"(dcap[j][h]));
            a[j][2 * h] *= lo;
            a[j][2 * h + 1] *= hi;
        }
    }
}

// Whether any term changes the logits themselves (sinks alone only change each row's
// normalisation, so the plain path runs).
__device__ __forceinline__ bool cm_score_modifies_logits(const CmScoreParams& sp) {
    return sp.softcap > 0.f || sp.slopes != nullptr || sp.dist_bias != nullptr;
}

// A thread's view of the distance table for one tile: the index of its element [0][0] (row
// base, column base) and the index step per j (-8 for query rows, +8 for key rows); `constant`
// when every index the thread touches lies in one run of equal values (dist_run_end), `value`
// then that value in the log2 domain and `run` the run's last index. Its loads do not depend
// on the scores, so kernels take it before they wait for S, hiding their latency.
struct CmDistTile {
    const float* table;  // this head's row of dist_bias
    int base;            // index of element [0][0]; element [j][e] is base + step j + hstep (e >> 1) + cstep (e & 1)
    bool constant;
    float value;
    int run;
};

#define INT_MIN_ (-2147483647 - 1)

template <int NB, bool KEY_ROWS>
__device__ __forceinline__ CmDistTile cm_dist_tile(const CmScoreParams& sp, u32 head, u32 q_len, u32 kv_len,
                                                   u32 row_base, u32 col_base, int range_lo = INT_MIN_,
                                                   int range_hi = 0) {
    CmDistTile d;
    d.constant = false;
    d.value = 0.f;
    d.base = 0;
    d.table = sp.dist_bias;
    if (sp.dist_bias == nullptr) return d;
    const int len = (int)(q_len + kv_len - 1);
    d.table = sp.dist_bias + (u64)head * sp.dist_head_stride;
    // distance index q - k + kv_len - 1
    const int q0 = KEY_ROWS ? (int)col_base : (int)row_base;
    const int k0 = KEY_ROWS ? (int)row_base : (int)col_base;
    d.base = q0 - k0 + (int)kv_len - 1;
    // The extreme indices of the thread's elements (columns span 8 (NB - 1) + 1, rows 8), or
    // the caller's range (a whole tile's, so that every thread agrees).
    const int col_span = 8 * (NB - 1) + 1;
    const int lo = range_lo != INT_MIN_ ? range_lo : (KEY_ROWS ? d.base - 8 : d.base - col_span);
    const int hi = range_lo != INT_MIN_ ? range_hi : (KEY_ROWS ? d.base + col_span : d.base + 8);
    const int lo_c = min(max(lo, 0), len - 1);
    const int hi_c = min(max(hi, 0), len - 1);
    d.run = sp.dist_run_end != nullptr ? (int)sp.dist_run_end[lo_c] : -1;
    d.constant = d.run >= hi_c;
    d.value = d.constant ? d.table[lo_c] * CM_LOG2E : 0.f;
    return d;
}

// The distance-table value (log2 domain) of element [j][e].
template <bool KEY_ROWS>
__device__ __forceinline__ float cm_dist_value(const CmDistTile& d, int j, int e, int len) {
    const int hstep = KEY_ROWS ? -8 : 8;
    const int cstep = KEY_ROWS ? 1 : -1;
    const int idx = d.base + cstep * (8 * j + (e & 1)) + hstep * (e >> 1);
    return __ldg(d.table + min(max(idx, 0), len - 1)) * CM_LOG2E;
}

// The tile's logits for one combination of terms (compile-time, so every test below folds):
// LIN a linear bias, DIST 0 none / 1 one constant for the tile / 2 a gather per element.
template <int NB, bool KEY_ROWS, bool DCAP, bool CAP, bool LIN, int DIST>
__device__ __forceinline__ void cm_score_tile(float (&s)[NB][4], CmDcap<NB>& dcap, const CmScoreParams& sp,
                                              const CmDistTile& d, float softmax_scale, u32 head, u32 q_len,
                                              u32 kv_len, u32 row_base, u32 col_base) {
    const float scale_log2 = softmax_scale * CM_LOG2E;
    const float cap_in = softmax_scale * sp.inv_softcap;
    const float cap_out = sp.softcap * CM_LOG2E;
    const int len = (int)(q_len + kv_len - 1);
    // bias of element [j][e] = row_term[e >> 1] + col_coef * (8 j + (e & 1)) (+ the table's)
    float row_term[2] = {0.f, 0.f};
    float col_coef = 0.f;
    if (LIN) {
        const float slope = sp.slopes[head] * CM_LOG2E;
        const float rc = slope * (KEY_ROWS ? sp.k_coef : sp.q_coef);
        col_coef = slope * (KEY_ROWS ? sp.q_coef : sp.k_coef);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_term[h] = fmaf(rc, (float)(row_base + 8 * h), fmaf(col_coef, (float)col_base, slope * sp.offset));
        }
    }
    if (DIST == 1) {
        row_term[0] += d.value;
        row_term[1] += d.value;
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            float th[2] = {0.f, 0.f};
            float dc[2] = {1.f, 1.f};
            if (CAP) {
                th[0] = cm_tanh(s[j][e] * cap_in);
                th[1] = cm_tanh(s[j][e + 1] * cap_in);
            }
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float bias = row_term[e >> 1];
                if (LIN) bias = fmaf(col_coef, (float)(8 * j + c), bias);
                if (DIST == 2) bias += cm_dist_value<KEY_ROWS>(d, j, e + c, len);
                if (CAP) {
                    dc[c] = fmaf(-th[c], th[c], 1.f);
                    s[j][e + c] = fmaf(cap_out, th[c], bias);
                } else {
                    s[j][e + c] = fmaf(s[j][e + c], scale_log2, bias);
                }
            }
            if (DCAP) dcap[j][e >> 1] = cm_pack_f16x2(dc[0], dc[1]);
        }
    }
}

// Raw q . k scores to log2-domain logits with every score term: softcap, linear bias and
// distance bias (CmScoreParams; `d` from cm_dist_tile for this tile). With DCAP, dcap
// receives the softcap's derivative 1 - tanh^2 (1 without a softcap), which the backward
// multiplies into dS. Masked pairs are set to -inf afterwards by the caller's mask code, so
// their values here do not matter. The terms present are uniform over the launch; each
// combination runs its own unrolled loop.
template <int NB, bool KEY_ROWS, bool DCAP>
__device__ __forceinline__ void cm_score_logits(float (&s)[NB][4], CmDcap<NB>& dcap, const CmScoreParams& sp,
                                                const CmDistTile& d, float softmax_scale, u32 head, u32 q_len,
                                                u32 kv_len, u32 row_base, u32 col_base) {
    const bool cap = sp.softcap > 0.f;
    const bool lin = sp.slopes != nullptr;
    const int dist = sp.dist_bias == nullptr ? 0 : (d.constant ? 1 : 2);
#define CM_SCORE_CASE(C, L, D)                                                                                   \
    if (cap == C && lin == L && dist == D) {                                                                     \
        cm_score_tile<NB, KEY_ROWS, DCAP, C, L, D>(s, dcap, sp, d, softmax_scale, head, q_len, kv_len, row_base, \
                                                   col_base);                                                    \
        return;                                                                                                  \
    }
    CM_SCORE_CASE(false, false, 1)
    CM_SCORE_CASE(false, false, 2)
    CM_SCORE_CASE(false, true, 0)
    CM_SCORE_CASE(false, true, 1)
    CM_SCORE_CASE(false, true, 2)
    CM_SCORE_CASE(true, false, 0)
    CM_SCORE_CASE(true, false, 1)
    CM_SCORE_CASE(true, false, 2)
    CM_SCORE_CASE(true, true, 0)
    CM_SCORE_CASE(true, true, 1)
    CM_SCORE_CASE(true, true, 2)
#undef CM_SCORE_CASE
    // No term changes the logits: the scale alone.
    cm_score_tile<NB, KEY_ROWS, DCAP, false, false, 0>(s, dcap, sp, d, softmax_scale, head, q_len, kv_len, row_base,
                                                       col_base);
}

// A softcap bounds every logit to [-c, c], [-c', c'] in the log2 domain (c' = c log2 e), so
// when no other term shifts the logits (sinks act at normalisation only) the forward can
// exponentiate against a fixed reference r instead of each row's running maximum: no row
// maximum, no rescaling, and each probability depends on its own score alone, so the tanh and
// exp2 of a tile pipeline through the special-function unit without waiting on a reduction.
// r must keep every probability 2^(x - r), x in [-c', c'], where P's element type and the
// fp32 sums hold it exactly enough: at most 2^CM_REF_HI (bf16: sums of 2^31 keys times values
// up to 2^33 stay finite in fp32; fp16: below its largest finite 65504) and at least 2^CM_REF_LO
// (bf16: normal fp32 products with values down to 2^-26; fp16: its smallest normal). That
// holds when 2 c' <= CM_REF_HI - CM_REF_LO (bf16 c <= 56.8, Gemma-2's 50 and Grok-1's 30
// included; fp16 c <= 10); larger caps keep the running maximum. Against the row's true
// maximum the largest probability would be exactly 1; here it is rounded to P's type like
// every other one, which the accuracy rule's 2x allows (the stale maximum of
// cm_softmax_step_folded costs the same).
#if CM_DTYPE_BF16
#define CM_REF_HI 64.f
#define CM_REF_LO (-100.f)
#else
#define CM_REF_HI 15.f
#define CM_REF_LO (-14.f)
#endif

// Whether the logits are the softcap's alone and bounded tightly enough for a fixed
// reference; ref then receives it (log2 domain): 0 when that fits, else the nearest bound.
__device__ __forceinline__ bool cm_softcap_fixed_ref(const CmScoreParams& sp, float& ref) {
    const float cap = sp.softcap * CM_LOG2E;
    ref = fmaxf(cap - CM_REF_HI, fminf(0.f, -cap - CM_REF_LO));
    return sp.softcap > 0.f && sp.slopes == nullptr && sp.dist_bias == nullptr && 2.f * cap <= CM_REF_HI - CM_REF_LO;
}

// Raw q . k scores to probabilities against the fixed reference (cm_softcap_fixed_ref), in
// place: 2^(c' tanh(scale s / c) - ref), a multiply, a tanh, an FMA and an exp2 per score.
// MASKED: scores the caller has masked to -inf become 0 (the tanh alone would make them
// -1, the smallest probability, not none); tiles with nothing masked skip the test.
template <int NB, bool MASKED>
__device__ __forceinline__ void cm_softcap_probs(float (&s)[NB][4], float softmax_scale, const CmScoreParams& sp,
                                                 float ref) {
    const float cap_in = softmax_scale * sp.inv_softcap;
    const float cap_out = sp.softcap * CM_LOG2E;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float pe = cm_exp2(fmaf(cm_tanh(s[j][e] * cap_in), cap_out, -ref));
            s[j][e] = MASKED && s[j][e] == cm_neg_inf() ? 0.f : pe;
        }
    }
}

// The deterministic backward's table gradient is fixed point: int64 units of 2^-32 (each
// distance's sum must stay below 2^31 in magnitude), so its atomic additions are integer
// ones, whose sum does not depend on their order.
#define CM_DIST_FIXED_SCALE 4294967296.0f

__device__ __forceinline__ unsigned long long cm_dist_fixed(float v) {
    return (unsigned long long)__float2ll_rn(v * CM_DIST_FIXED_SCALE);
}

// Adds v to slot i of a tile's shared per-distance sums (floats in the buffer's first half,
// or fixed point).
__device__ __forceinline__ void cm_dist_buf_add(unsigned long long* buf, int i, float v, bool fixed) {
    if (v == 0.f) return;
    if (fixed) {
        atomicAdd(buf + i, cm_dist_fixed(v));
    } else {
        atomicAdd(reinterpret_cast<float*>(buf) + i, v);
    }
}

// A thread's running sum of d loss / d dist_bias over tiles whose distances lie in one run
// of the table: flushed with one atomic when the run changes and at the end, so the many
// tiles far from the diagonal (one bucket) cost no atomics of their own.
struct CmDistGradAcc {
    float sum;
    int run;  // the run's last index (the same for every tile of that run); -1: empty
};

// Adds v to the table gradient's entry `idx` of `head` (float, or fixed point when `fixed`).
__device__ __forceinline__ void cm_dist_grad_add(const CmScoreParams& sp, u32 head, int idx, float v, bool fixed) {
    const u64 at = (u64)head * sp.dist_head_stride + idx;
    if (fixed) {
        atomicAdd(reinterpret_cast<unsigned long long*>(sp.dist_bias_grad) + at, cm_dist_fixed(v));
    } else {
        atomicAdd(sp.dist_bias_grad + at, v);
    }
}

__device__ __forceinline__ void cm_dist_grad_flush(CmDistGradAcc& acc, const CmScoreParams& sp, u32 head, bool fixed) {
    if (acc.run >= 0 && acc.sum != 0.f) cm_dist_grad_add(sp, head, acc.run, acc.sum, fixed);
    acc.sum = 0.f;
    acc.run = -1;
}

// Adds d loss / d dist_bias of one tile's score gradients (ds: P (dP - delta), natural-log
// units, before the softcap's derivative): into the thread's running sum when the tile lies
// in one run (the run's last index maps to the same table entry as every index of it), else
// per distance into `buf` (shared memory, one slot per distance of the tile from `buf_lo`,
// zero on entry: floats, or fixed point with `fixed`), which the caller's warpgroup then
// flushes with one global atomic per distance (cm_dist_grad_flush_tile). `d` must come from a tile-wide range, so that the
// choice is the same in every thread.
template <int NB, bool KEY_ROWS>
__device__ __forceinline__ void cm_dist_grad(const float (&ds)[NB][4], const CmScoreParams& sp, const CmDistTile& d,
                                             CmDistGradAcc& acc, u32 head, unsigned long long* buf, int buf_lo,
                                             bool fixed) {
    if (d.constant) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) sum += ds[j][e];
        }
        if (d.run != acc.run) cm_dist_grad_flush(acc, sp, head, fixed);
        acc.run = d.run;
        acc.sum += sum;
    } else {
        const int hstep = KEY_ROWS ? -8 : 8;
        const int cstep = KEY_ROWS ? 1 : -1;
        // Element [m + 1][2 + c] (row half 1) has the distance of [m][c] (row half 0): add
        // those pairs first, so 2 NB + 2 shared adds instead of 4 NB.
#pragma unroll
        for (int m = 0; m + 1 < NB; ++m) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                cm_dist_buf_add(buf, d.base + cstep * (8 * m + c) - buf_lo, ds[m][c] + ds[m + 1][2 + c], fixed);
            }
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            cm_dist_buf_add(buf, d.base + cstep * (8 * (NB - 1) + c) - buf_lo, ds[NB - 1][c], fixed);
            cm_dist_buf_add(buf, d.base + cstep * c + hstep - buf_lo, ds[0][2 + c], fixed);
        }
    }
}

// Moves a non-constant tile's per-distance sums from shared memory to the table's gradient
// (one atomic per non-zero distance of `count`, clipped to the table) and zeroes them; run by
// the `threads` threads of one warpgroup (`rank` 0 ..), between two barriers of it.
__device__ __forceinline__ void cm_dist_grad_flush_tile(unsigned long long* buf, int buf_lo, int count,
                                                        const CmScoreParams& sp, u32 head, u32 q_len, u32 kv_len,
                                                        int rank, int threads, bool fixed) {
    const int len = (int)(q_len + kv_len - 1);
    for (int i = rank; i < count; i += threads) {
        const int idx = buf_lo + i;
        const bool in_table = idx >= 0 && idx < len;
        if (fixed) {
            const unsigned long long v = buf[i];
            if (v != 0 && in_table) {
                atomicAdd(reinterpret_cast<unsigned long long*>(sp.dist_bias_grad) + (u64)head * sp.dist_head_stride +
                              idx,
                          v);
            }
            buf[i] = 0;
        } else {
            float* f = reinterpret_cast<float*>(buf);
            if (f[i] != 0.f && in_table) atomicAdd(sp.dist_bias_grad + (u64)head * sp.dist_head_stride + idx, f[i]);
            f[i] = 0.f;
        }
    }
}

