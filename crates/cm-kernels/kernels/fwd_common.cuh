// Per-tile steps shared by the forward kernels. Both keep scores and output in the mma.sync
// m16n8 accumulator layout (which is also wgmma's): warp w owns query rows 16 w + g and
// 16 w + g + 8 of its block (g = lane / 4), and element [j][e] of a fragment is column
// 8 j + 2 (lane % 4) + (e & 1) of row g + 8 (e >> 1).
#pragma once
#include "common.cuh"
#if CM_SCORE
#include "score.cuh"
#endif

// Masks the raw scores of NB * 8 keys (a 128-key tile, NB = 16, or a 64-key half of one, NB =
// 8): a partial tile's rows come as visibility bits (NB / 4 words per row, as the plan's
// partial_row_mask arrays hold them, the half's own words for a half): element [j][e] of row half
// h is key 8 j + 2 t + (e & 1), bit (8 j + 2 t + e) % 32 of word j / 4; a full tile that
// overhangs kv_len masks the zero-filled keys past it. Masked scores become -inf.
template <int NB>
__device__ __forceinline__ void cm_mask_bits(float (&s)[NB][4], const CmFwdParams& p, bool partial,
                                             const u32 (&bits)[2][NB / 4], u32 key0, int t) {
    if (partial) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // Shifted once by this thread's column pair, every test below is by a constant.
            u32 w[NB / 4];
#pragma unroll
            for (int k = 0; k < NB / 4; ++k) w[k] = bits[h][k] >> (t * 2);
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                const u32 bit = 1u << ((j & 3) * 8);
                if (!(w[j >> 2] & bit)) s[j][h * 2] = cm_neg_inf();
                if (!(w[j >> 2] & (bit << 1))) s[j][h * 2 + 1] = cm_neg_inf();
            }
        }
    } else if (key0 + NB * 8 > p.kv_len) {
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (key0 + j * 8 + t * 2 + (e & 1) >= p.kv_len) s[j][e] = cm_neg_inf();
            }
        }
    }
}

// Scales scores into the exp2 domain, then cm_mask_bits (scaling first keeps a masked score at
// -inf whatever the sign of the scale).
template <int NB>
__device__ __forceinline__ void cm_scale_and_mask_bits(float (&s)[NB][4], const CmFwdParams& p, bool partial,
                                                       const u32 (&bits)[2][NB / 4], u32 key0, int t) {
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= p.scale_log2;
    }
    cm_mask_bits(s, p, partial, bits, key0, t);
}

// The visibility bits of this thread's rows (warp * 16 + g and + 8 of the block) in the
// `partial_index`-th partial tile of p.partial_row_mask, for kernels that read them straight
// from global memory (one warpgroup, BLOCK_M rows); rows past q_len have none.
template <int NB>
__device__ __forceinline__ void cm_load_row_bits(u32 (&bits)[2][NB / 4], const CmFwdParams& p, u32 partial_index,
                                                 u32 block_m, int warp, int g) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32* row = p.partial_row_mask + ((u64)partial_index * block_m + warp * 16 + g + h * 8) * (NB / 4);
#pragma unroll
        for (int k = 0; k < NB / 4; ++k) bits[h][k] = row[k];
    }
}

// Online softmax over one tile, score side: turns s into unnormalised probabilities against
// the new running max, updates the running sums, and returns in alpha the factor by which the
// output accumulated so far must be rescaled (cm_rescale), which a kernel may apply later,
// once no matrix product is accumulating into it. A row with nothing visible so far keeps max
// -inf; exponentiating against 0 instead gives exp2(-inf) = 0 everywhere and never
// -inf - -inf = NaN.
template <int NB>
__device__ __forceinline__ void cm_softmax_step(float (&s)[NB][4], float (&row_max)[2], float (&row_sum)[2],
                                                float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = row_max[h];
#pragma unroll
        for (int j = 0; j < NB; ++j) mx = fmaxf(mx, fmaxf(s[j][h * 2], s[j][h * 2 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == cm_neg_inf() ? 0.f : mx;
        alpha[h] = cm_exp2(row_max[h] - m_use);
        row_max[h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float pe = cm_exp2(s[j][h * 2 + e] - m_use);
                s[j][h * 2 + e] = pe;
                sum += pe;
            }
        }
        row_sum[h] = row_sum[h] * alpha[h] + sum;
    }
}

// The growth of a row's maximum (log2 domain) below which cm_softmax_step_folded may keep the
// old one: probabilities against a stale maximum are at most 2^8, far from overflowing
// fp16 / bf16 P or the fp32 sums, and the output needs no rescale (FlashAttention-4's
// conditional rescaling).
#define CM_RESCALE_THRESHOLD 8.0f
// A stale maximum costs accuracy where a fresh one would not: against the row's true maximum
// its largest probability is exactly 1 (as in PyTorch's attention and the accuracy rule's
// reference), against a stale one 2^delta for a fractional delta, rounded to the element type.
// When that key dominates the row (peaked softmax, e.g. logits far from 0 with a spread of a
// few units) the rounding doubles the output's error. So the old maximum is kept only while
// the row's mass so far is at least 2^CM_RESCALE_MASS_LOG2 times the new maximum's probability: the
// key then carries at most 1/65 of the row's weight and its rounding is far below the output's.
// Each thread tests its own quarter of the row's sum against a quarter of that (a sufficient
// condition for the whole sum), and the four threads of a row agree through one ballot.
#define CM_RESCALE_MASS_LOG2 6

// cm_softmax_step on raw (unscaled, masked) scores for a positive scale_log2, folding the
// scale into the exponent (FlashAttention-3's exp2(s * scale - max * scale) as one FMA per
// score instead of a separate multiply): the raw maximum scaled is the scaled maximum, and a
// masked -inf stays -inf. row_max stays in the scaled log2 domain, as cm_softmax_step keeps
// it, but moves only when the tile's maximum exceeds it by more than CM_RESCALE_THRESHOLD or
// the row's mass so far is too small for a stale maximum (CM_RESCALE_MASS_LOG2); alpha is
// otherwise exactly 1 and cm_rescale_if_needed skips the multiply. The sum and the output
// stay relative to the same row_max, so out and lse are unchanged.
template <int NB>
__device__ __forceinline__ void cm_softmax_step_folded(float (&s)[NB][4], float scale_log2, float (&row_max)[2],
                                                       float (&row_sum)[2], float (&alpha)[2]) {
    const u32 quad = (threadIdx.x & 31) & ~3u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = cm_neg_inf();
#pragma unroll
        for (int j = 0; j < NB; ++j) mx = fmaxf(mx, fmaxf(s[j][h * 2], s[j][h * 2 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx *= scale_log2;
        // The maximum never moves down; a row that has seen nothing (row_max -inf) takes any
        // finite maximum through the threshold test.
        // row_sum >= 2^e for its exponent e: an integer test instead of an exp2, which
        // would compete with the tile's 64 per thread for the special-function unit.
        const int e = (__float_as_int(row_sum[h]) >> 23) - 127;
        const bool mass_ok = mx - row_max[h] <= (float)(e - CM_RESCALE_MASS_LOG2 + 2);
        const bool quad_ok = ((__ballot_sync(0xffffffffu, mass_ok) >> quad) & 0xfu) == 0xfu;
        const bool grows = mx > row_max[h] + CM_RESCALE_THRESHOLD || (mx > row_max[h] && !quad_ok);
        mx = grows ? mx : row_max[h];
        const float m_use = mx == cm_neg_inf() ? 0.f : mx;
        alpha[h] = cm_exp2(row_max[h] - m_use);
        row_max[h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NB; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float pe = cm_exp2(fmaf(s[j][h * 2 + e], scale_log2, -m_use));
                s[j][h * 2 + e] = pe;
                sum += pe;
            }
        }
        row_sum[h] = row_sum[h] * alpha[h] + sum;
    }
}

// Adds each row half's probabilities to its running sum (a fixed reference: no maximum, no
// rescale).
template <int NB>
__device__ __forceinline__ void cm_add_row_sums(const float (&s)[NB][4], float (&row_sum)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NB; ++j) sum += s[j][h * 2] + s[j][h * 2 + 1];
        row_sum[h] += sum;
    }
}

template <int ND>
__device__ __forceinline__ void cm_rescale(float (&acc_o)[ND][4], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < ND; ++j) {
        acc_o[j][0] *= alpha[0];
        acc_o[j][1] *= alpha[0];
        acc_o[j][2] *= alpha[1];
        acc_o[j][3] *= alpha[1];
    }
}

// cm_rescale unless every row of the warp keeps its maximum (alpha exactly 1), which after
// the first tiles of a row is the common case; the vote is warp-uniform.
template <int ND>
__device__ __forceinline__ void cm_rescale_if_needed(float (&acc_o)[ND][4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) cm_rescale(acc_o, alpha);
}

// Online softmax over one tile with the output rescaled at once (kernels that run the
// matrix products one after the other).
template <int NB, int ND>
__device__ __forceinline__ void cm_online_softmax(float (&s)[NB][4], float (&row_max)[2], float (&row_sum)[2],
                                                  float (&acc_o)[ND][4]) {
    float alpha[2];
    cm_softmax_step(s, row_max, row_sum, alpha);
    cm_rescale(acc_o, alpha);
}

// The A fragment (16 rows x 16 keys) of probabilities for keys 16 kk .. 16 kk + 15, from the
// score fragment: the m16n8 accumulator pairs are exactly the m16n8k16 A register pairs.
template <int NB>
__device__ __forceinline__ void cm_p_fragment(const float (&s)[NB][4], int kk, u32 (&a)[4]) {
    a[0] = cm_pack2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = cm_pack2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = cm_pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = cm_pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// The sink's share of a row's softmax (common.cuh's CmScoreParams), applied when the row is
// normalised, in every forward variant (it needs no per-logit work): with the row's
// running maximum row_max and sum (log2 domain, the output accumulated against row_max), the
// sink logit joins the denominator. Returns the output's multiplier and sets lse (natural
// log); a row with nothing visible gets output 0 and lse = the sink (-inf: no sink).
__device__ __forceinline__ float cm_sink_normalise(float sink, float row_max, float sum, float& lse) {
    const float sink2 = sink * CM_LOG2E;
    // A row with nothing visible has no maximum, whatever row_max holds: the softcap's fixed
    // reference (score.cuh) starts it finite, and a -inf sink then made total 0 and the
    // output 0 * inf = NaN.
    const float seen_max = sum > 0.f ? row_max : cm_neg_inf();
    const float m = fmaxf(seen_max, sink2);
    // A -inf sink is no sink: with no visible key either, exp2(m - m) would be NaN.
    if (m == cm_neg_inf()) {
        lse = cm_neg_inf();
        return 0.f;
    }
    const float keep = seen_max == cm_neg_inf() ? 0.f : cm_exp2(seen_max - m);
    const float total = fmaf(sum, keep, cm_exp2(sink2 - m));
    lse = (m + __log2f(total)) * 0.69314718055994531f;
    return keep / total;
}

// Normalises and stores the warp's rows; rows with an empty sum (no visible key) write 0 and
// lse -inf.
template <int ND>
__device__ __forceinline__ void cm_store_output(const CmFwdParams& p, const float (&acc_o)[ND][4],
                                                const float (&row_max)[2], const float (&row_sum)[2],
                                                u32 batch, u32 head, u32 row0, int warp, int g, int t) {
    u16* o = p.o + batch * p.o_stride_batch + head * p.o_stride_head;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = row_sum[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const u32 qrow = row0 + warp * 16 + g + h * 8;
        if (qrow >= p.q_len) continue;
        float inv = sum > 0.f ? 1.f / sum : 0.f;
        float lse = sum > 0.f ? row_max[h] * 0.69314718055994531f + logf(sum) : cm_neg_inf();
        if (p.score.sinks != nullptr) inv = cm_sink_normalise(p.score.sinks[head], row_max[h], sum, lse);
        u16* orow = o + (i64)qrow * p.o_stride_row;
#pragma unroll
        for (int j = 0; j < ND; ++j) {
            *reinterpret_cast<u32*>(orow + j * 8 + t * 2) = cm_pack2(acc_o[j][h * 2] * inv, acc_o[j][h * 2 + 1] * inv);
        }
        if (p.lse != nullptr && t == 0) {
            // row_max is log2-domain: lse = ln(sum_k exp(scale * s_k)) = max * ln2 + ln(sum).
            p.lse[batch * p.lse_stride_batch + head * p.lse_stride_head + qrow] = lse;
        }
    }
}
