// Backward pre-processing, one CTA of 128 threads per (64-row query block, head, batch):
// delta_i = sum_d dO[i, d] * O[i, d] - dlse_i in fp32 (dlse_i, when the loss reads lse, is
// d loss / d lse_i: lse_i's own softmax derivative is P_ij, so the term folds into every
// dS_ij = P_ij (dP_ij - delta_i) at no cost), the forward lse converted to the exp2 domain, and
// (when bwd_dkdv adds dQ) the fp32 dQ accumulator zeroed, all into the workspace at padded
// rows, and (deterministic mode) the block's dQ turn counter and the start tickets zeroed.
// Rows at or past q_len, and rows with no visible key (lse = -inf), get lse_log2 = +inf and
// delta = 0: every probability recomputed from them is exp2(s - inf) = 0, so such rows add
// nothing to dK / dV and get dQ = 0, with no -inf - -inf = NaN anywhere.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16 (1 = bf16, 0 = fp16), CM_HEAD_DIM and
// CM_HEAD_DIM_V (cm_kernels::VARIANTS' shapes).
#include "bwd_common.cuh"

CM_CHECK_SHAPE(BLOCK_M, BLOCK_N, 1, NUM_THREADS);

extern "C" __global__ void __launch_bounds__(NUM_THREADS) cm_bwd_pre(const CmBwdParams p) {
    const u32 m_block = blockIdx.x;
    const u32 head = blockIdx.y;
    const u32 batch = blockIdx.z;
    const u32 row0 = m_block * BLOCK_M;
    const u64 bh = (u64)batch * p.num_heads + head;
    // Two threads per row, each over half of head_dim_v in 16-byte vectors.
    const u32 r = threadIdx.x >> 1;
    const u32 half = threadIdx.x & 1;
    const u32 row = row0 + r;
    float acc = 0.f;
    if (row < p.q_len) {
        const u16* o = p.o + batch * p.o_stride_batch + head * p.o_stride_head + (i64)row * p.o_stride_row;
        const u16* d = p.dout + batch * p.do_stride_batch + head * p.do_stride_head + (i64)row * p.do_stride_row;
#pragma unroll
        for (int c = half * (HEAD_DIM_V / 2); c < (int)(half + 1) * (HEAD_DIM_V / 2); c += 8) {
            const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
            const uint4 dv = *reinterpret_cast<const uint4*>(d + c);
            const u32 ow[4] = {ov.x, ov.y, ov.z, ov.w};
            const u32 dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                acc += cm_to_float((u16)(ow[w] & 0xffff)) * cm_to_float((u16)(dw[w] & 0xffff));
                acc += cm_to_float((u16)(ow[w] >> 16)) * cm_to_float((u16)(dw[w] >> 16));
            }
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0) {
        float lse2 = __int_as_float(0x7f800000);  // +inf
        if (row < p.q_len) {
            const float lse = p.lse[batch * p.lse_stride_batch + head * p.lse_stride_head + row];
            if (lse != cm_neg_inf()) {
                lse2 = lse * CM_LOG2E;
                // A row with no visible key keeps delta = 0: its -inf lse depends on nothing.
                if (p.dlse != nullptr) acc -= p.dlse[batch * p.dlse_stride_batch + head * p.dlse_stride_head + row];
            }
        }
        p.lse_log2[bh * p.q_pad + row] = lse2;
        p.delta[bh * p.q_pad + row] = acc;
    }
    if (p.dq_turns != nullptr && threadIdx.x == 0) {
        *cm_dq_turn(p, batch, head, row0) = 0;
        if (m_block == 0 && head == 0 && batch == 0) p.dq_turns[0] = 0;
    }
    if (p.dq_accum != nullptr) {
        float4* acc_rows = reinterpret_cast<float4*>(p.dq_accum + (bh * p.q_pad + row0) * HEAD_DIM);
#pragma unroll
        for (int i = threadIdx.x; i < BLOCK_M * HEAD_DIM / 4; i += NUM_THREADS) {
            acc_rows[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
}
