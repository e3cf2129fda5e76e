// The score terms' per-element work (CmScoreParams, common.cuh), shared by the CM_SCORE
// variants of fwd_ws, bwd_dkdv and bwd_dq. They all hold scores in the m16n8 accumulator
// layout: element [j][e] of a thread's fragment has row row_base + 8 (e >> 1) and column
// col_base + 8 j + (e & 1) (col_base includes the thread's 2 t). Rows are queries and columns
// keys, or the reverse with KEY_ROWS (bwd_dkdv computes S^T).
#pragma once
#include "common.cuh"

#define CM_LOG2E 1.4426950408889634f

// tanh through exp2: 1 - 2 / (2^(2 x log2 e) + 1), exact to a few fp32 ulps of 1 (the
// approximate tanh instruction's 2^-11 relative error would move a capped logit of 50 by
// 0.02, more than bf16's rounding of P); saturates to +-1 for large |x| with no NaN.
__device__ __forceinline__ float cm_tanh(float x) {
    const float e = cm_exp2(2.f * CM_LOG2E * fabsf(x));
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.f));
    return copysignf(fmaf(-2.f, r, 1.f), x);
}

// A thread's view of the distance table for one tile: the index of its element [0][0] (row
// base, column base) and the index step per j (-8 for query rows, +8 for key rows); `constant`
// when every index the thread touches lies in one run of equal values (dist_run_end), `value`
// then that value in the log2 domain.
struct CmDistTile {
    const float* table;  // this head's row of dist_bias
    int base;            // index of element [0][0]; element [j][e] is base + step j + hstep (e >> 1) + cstep (e & 1)
    bool constant;
    float value;
};

template <int NB, bool KEY_ROWS>
__device__ __forceinline__ CmDistTile cm_dist_tile(const CmScoreParams& sp, u32 head, u32 q_len, u32 kv_len,
                                                   u32 row_base, u32 col_base) {
    CmDistTile d;
    const int len = (int)(q_len + kv_len - 1);
    d.table = sp.dist_bias + (u64)head * sp.dist_head_stride;
    // distance index q - k + kv_len - 1
    const int q0 = KEY_ROWS ? (int)col_base : (int)row_base;
    const int k0 = KEY_ROWS ? (int)row_base : (int)col_base;
    d.base = q0 - k0 + (int)kv_len - 1;
    // The extreme indices of the thread's elements: columns span 8 (NB - 1) + 1, rows 8.
    const int col_span = 8 * (NB - 1) + 1;
    const int lo = KEY_ROWS ? d.base - 8 : d.base - col_span;
    const int hi = KEY_ROWS ? d.base + col_span : d.base + 8;
    const int lo_c = min(max(lo, 0), len - 1);
    const int hi_c = min(max(hi, 0), len - 1);
    d.constant = sp.dist_run_end != nullptr && (int)sp.dist_run_end[lo_c] >= hi_c;
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

// Raw q . k scores to log2-domain logits with every score term: softcap, linear bias and
// distance bias (CmScoreParams). With DCAP, dcap receives the softcap's derivative
// 1 - tanh^2 (1 without a softcap), which the backward multiplies into dS. Masked pairs are
// set to -inf afterwards by the caller's mask code, so their values here do not matter.
template <int NB, bool KEY_ROWS, bool DCAP>
__device__ __forceinline__ void cm_score_logits(float (&s)[NB][4], float (&dcap)[NB][4], const CmScoreParams& sp,
                                                float softmax_scale, u32 head, u32 q_len, u32 kv_len,
                                                u32 row_base, u32 col_base) {
    const bool capped = sp.softcap > 0.f;
    const float scale_log2 = softmax_scale * CM_LOG2E;
    const float cap_in = softmax_scale * sp.inv_softcap;
    const float cap_out = sp.softcap * CM_LOG2E;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (capped) {
                const float th = cm_tanh(s[j][e] * cap_in);
                s[j][e] = cap_out * th;
                if (DCAP) dcap[j][e] = fmaf(-th, th, 1.f);
            } else {
                s[j][e] *= scale_log2;
                if (DCAP) dcap[j][e] = 1.f;
            }
        }
    }
    if (sp.slopes != nullptr) {
        const float slope = sp.slopes[head] * CM_LOG2E;
        const float row_coef = slope * (KEY_ROWS ? sp.k_coef : sp.q_coef);
        const float col_coef = slope * (KEY_ROWS ? sp.q_coef : sp.k_coef);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float row_term = fmaf(row_coef, (float)(row_base + 8 * (e >> 1)), slope * sp.offset);
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                s[j][e] += fmaf(col_coef, (float)(col_base + 8 * j + (e & 1)), row_term);
            }
        }
    }
    if (sp.dist_bias != nullptr) {
        const int len = (int)(q_len + kv_len - 1);
        const CmDistTile d = cm_dist_tile<NB, KEY_ROWS>(sp, head, q_len, kv_len, row_base, col_base);
        if (d.constant) {
#pragma unroll
            for (int j = 0; j < NB; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] += d.value;
            }
        } else {
#pragma unroll
            for (int j = 0; j < NB; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] += cm_dist_value<KEY_ROWS>(d, j, e, len);
            }
        }
    }
}

// Adds d loss / d dist_bias of one tile's score gradients (ds: P (dP - delta), natural-log
// units, before the softcap's derivative) to dist_bias_grad with fp32 atomics: one per thread
// when its elements share one run of the table (their sum lands on the run's first index,
// which the caller's gather maps to the same table entry), else one per element.
template <int NB, bool KEY_ROWS>
__device__ __forceinline__ void cm_dist_grad(const float (&ds)[NB][4], const CmScoreParams& sp, u32 head, u32 q_len,
                                             u32 kv_len, u32 row_base, u32 col_base) {
    const int len = (int)(q_len + kv_len - 1);
    const CmDistTile d = cm_dist_tile<NB, KEY_ROWS>(sp, head, q_len, kv_len, row_base, col_base);
    float* grad = sp.dist_bias_grad + (u64)head * sp.dist_head_stride;
    if (d.constant) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) sum += ds[j][e];
        }
        const int col_span = 8 * (NB - 1) + 1;
        const int lo = min(max(KEY_ROWS ? d.base - 8 : d.base - col_span, 0), len - 1);
        if (sum != 0.f) atomicAdd(grad + lo, sum);
    } else {
        const int hstep = KEY_ROWS ? -8 : 8;
        const int cstep = KEY_ROWS ? 1 : -1;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int idx = d.base + cstep * (8 * j + (e & 1)) + hstep * (e >> 1);
                if (ds[j][e] != 0.f && idx >= 0 && idx < len) atomicAdd(grad + idx, ds[j][e]);
            }
        }
    }
}

// The sink's share of a row's softmax, applied when the row is normalised: with the row's
// running maximum row_max and sum (log2 domain, the output accumulated against row_max), the
// sink logit joins the denominator. Returns the output's multiplier and sets lse (natural
// log); a row with nothing visible gets output 0 and lse = the sink.
__device__ __forceinline__ float cm_sink_normalise(float sink, float row_max, float sum, float& lse) {
    const float sink2 = sink * CM_LOG2E;
    const float m = fmaxf(row_max, sink2);
    const float keep = row_max == cm_neg_inf() ? 0.f : cm_exp2(row_max - m);
    const float total = fmaf(sum, keep, cm_exp2(sink2 - m));
    lse = (m + __log2f(total)) * 0.69314718055994531f;
    return keep / total;
}
