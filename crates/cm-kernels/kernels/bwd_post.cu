// Backward post-processing wherever bwd_dkdv adds dQ, one CTA of 128 threads per (64-row query block,
// head, batch): dQ = softmax_scale * the fp32 accumulator that bwd_dkdv added into with bulk
// reductions (in its fragment order, cm_dq_offset), rounded to the element type. Rows no tile
// reached were zeroed by bwd_pre, so rows with no visible key get dQ = 0.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16 (1 = bf16, 0 = fp16), CM_HEAD_DIM and
// CM_HEAD_DIM_V (cm_kernels::VARIANTS' shapes).
#include "bwd_common.cuh"

CM_CHECK_SHAPE(BLOCK_M, BLOCK_N, 1, NUM_THREADS);

extern "C" __global__ void __launch_bounds__(NUM_THREADS) cm_bwd_post(const CmBwdParams p) {
    const u32 m_block = blockIdx.x;
    const u32 head = blockIdx.y;
    const u32 batch = blockIdx.z;
    const u32 row0 = m_block * BLOCK_M;
    const u64 bh = (u64)batch * p.num_heads + head;
    const float* acc = p.dq_accum + (bh * p.q_pad + row0) * HEAD_DIM;
    u16* dq = p.dq + batch * p.dq_stride_batch + head * p.dq_stride_head;
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
#pragma unroll
    for (int i = threadIdx.x; i < BLOCK_M * CHUNKS_PER_ROW; i += NUM_THREADS) {
        const u32 r = i / CHUNKS_PER_ROW;
        const u32 col = (i % CHUNKS_PER_ROW) * 8;
        if (row0 + r >= p.q_len) continue;
        // Row r's eight columns col .. col + 7 are element pair 2 h of lanes 4 (r % 8) .. + 3
        // (the warp of rows 16 (r / 16) .. of either consumer).
        const u32 at = cm_dq_offset(col / 8, r / 16, (r % 8) * 4) + 2 * ((r / 8) % 2);
        float v[8];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const float2 a = *reinterpret_cast<const float2*>(acc + at + 4 * t);
            v[2 * t] = a.x * p.softmax_scale;
            v[2 * t + 1] = a.y * p.softmax_scale;
        }
        uint4 out;
        out.x = cm_pack2(v[0], v[1]);
        out.y = cm_pack2(v[2], v[3]);
        out.z = cm_pack2(v[4], v[5]);
        out.w = cm_pack2(v[6], v[7]);
        *reinterpret_cast<uint4*>(dq + (i64)(row0 + r) * p.dq_stride_row + col) = out;
    }
}
