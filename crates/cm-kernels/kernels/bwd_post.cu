// Backward post-processing of the fast mode, one CTA of 128 threads per (64-row query block,
// head, batch): dQ = softmax_scale * the fp32 accumulator that bwd_dkdv added into
// atomically, rounded to the element type. Rows no tile reached were zeroed by bwd_pre, so
// rows with no visible key get dQ = 0.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16 (1 = bf16, 0 = fp16), CM_HEAD_DIM (64|128).
#include "bwd_common.cuh"

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
    for (int c = threadIdx.x; c < BLOCK_M * CHUNKS_PER_ROW; c += NUM_THREADS) {
        const u32 r = c / CHUNKS_PER_ROW;
        const u32 col = (c % CHUNKS_PER_ROW) * 8;
        if (row0 + r >= p.q_len) continue;
        const float4 a = *reinterpret_cast<const float4*>(acc + r * HEAD_DIM + col);
        const float4 b = *reinterpret_cast<const float4*>(acc + r * HEAD_DIM + col + 4);
        const float s = p.softmax_scale;
        uint4 out;
        out.x = cm_pack2(a.x * s, a.y * s);
        out.y = cm_pack2(a.z * s, a.w * s);
        out.z = cm_pack2(b.x * s, b.y * s);
        out.w = cm_pack2(b.z * s, b.w * s);
        *reinterpret_cast<uint4*>(dq + (i64)(row0 + r) * p.dq_stride_row + col) = out;
    }
}
