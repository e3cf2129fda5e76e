// Backward dQ of the deterministic mode, one CTA of 4 warps per (64-row query block, head,
// batch): walks the query block's key tiles from the forward lists (partial tiles with the
// per-row limits, then full tiles with no mask code), recomputes S = Q K^T and
// dP = dO V^T, P = exp2(S c log2e - lse_log2), dS = P (dP - delta), and accumulates
// dQ = c dS K in registers in a fixed order, so its bits do not change run to run. Warp w owns
// query rows 16 w .. 16 w + 15 (the forward's fragment layout); mma.sync m16n8k16 with
// ldmatrix from padded shared memory. Query blocks with no tile write dQ = 0.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16, CM_HEAD_DIM (64|128),
// CM_DYNAMIC_SMEM_BYTES (the dynamic shared memory the runtime launches with).
#include "bwd_common.cuh"

// Shared memory: Q, dO, K, V tiles and the per-row key visibility of a partial tile.
#define SMEM_BYTES (4 * TILE_ELEMS * 2 + BLOCK_M * 8)
static_assert(SMEM_BYTES <= CM_DYNAMIC_SMEM_BYTES, "cm_kernels::Variant::dynamic_shared_bytes is too small");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) cm_bwd_dq(const CmBwdParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    u16* sQ = reinterpret_cast<u16*>(smem);
    u16* sdO = sQ + TILE_ELEMS;
    u16* sK = sdO + TILE_ELEMS;
    u16* sV = sK + TILE_ELEMS;
    u64* sBits = reinterpret_cast<u64*>(sV + TILE_ELEMS);

    const u32 m_block = p.m_block_order[blockIdx.x];
    const u32 head = blockIdx.y;
    const u32 batch = blockIdx.z;
    const u32 kv_head = head / p.heads_per_kv_head;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 row0 = m_block * BLOCK_M;
    const u64 bh = (u64)batch * p.num_heads + head;

    const u32 p_begin = p.kv_offsets[m_block];
    const u32 num_partial = p.kv_offsets[m_block + 1] - p_begin;
    const u32 f_begin = p.full_kv_offsets[m_block];
    const u32 num_tiles = num_partial + (p.full_kv_offsets[m_block + 1] - f_begin);

    const u16* k = p.k + batch * p.k_stride_batch + kv_head * p.k_stride_head;
    const u16* v = p.v + batch * p.v_stride_batch + kv_head * p.v_stride_head;

    // Row statistics of the thread's rows g and g + 8 (padded workspace rows: in bounds).
    float lse2[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 row = row0 + warp * 16 + g + h * 8;
        lse2[h] = p.lse_log2[bh * p.q_pad + row];
        dl[h] = p.delta[bh * p.q_pad + row];
    }

    float acc_dq[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) acc_dq[j][0] = acc_dq[j][1] = acc_dq[j][2] = acc_dq[j][3] = 0.f;

    if (num_tiles > 0) {
        cm_bwd_load_tile(sQ, p.q + batch * p.q_stride_batch + head * p.q_stride_head, p.q_stride_row, row0, p.q_len);
        cm_bwd_load_tile(sdO, p.dout + batch * p.do_stride_batch + head * p.do_stride_head, p.do_stride_row, row0,
                         p.q_len);
        cm_cp_async_commit();
    }
    const u32 smem_q = cm_smem_addr(sQ);
    const u32 smem_do = cm_smem_addr(sdO);
    const u32 smem_k = cm_smem_addr(sK);
    const u32 smem_v = cm_smem_addr(sV);

    for (u32 it = 0; it < num_tiles; ++it) {
        const bool partial = it < num_partial;
        const u32 key0 = (partial ? p.kv_indices[p_begin + it] : p.full_kv_indices[f_begin + it - num_partial]) * BLOCK_N;
        cm_bwd_load_tile(sK, k, p.k_stride_row, key0, p.kv_len);
        cm_bwd_load_tile(sV, v, p.v_stride_row, key0, p.kv_len);
        cm_cp_async_commit();
        if (partial && threadIdx.x < BLOCK_M) {
            sBits[threadIdx.x] = cm_bwd_row_bits(p, p_begin + it, threadIdx.x, row0, key0);
        }
        cm_cp_async_wait<0>();
        __syncthreads();

        // S and dP for the warp's 16 queries x 64 keys.
        float s[BLOCK_N / 8][4];
        float dp[BLOCK_N / 8][4];
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        }
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            u32 qa[4], da[4];
            const u32 a_off = (u32)((warp * 16 + (lane & 15)) * PITCH + ks * 16 + (lane >> 4) * 8) * 2;
            cm_ldmatrix_x4(smem_q + a_off, qa[0], qa[1], qa[2], qa[3]);
            cm_ldmatrix_x4(smem_do + a_off, da[0], da[1], da[2], da[3]);
#pragma unroll
            for (int jp = 0; jp < BLOCK_N / 16; ++jp) {
                const int r = jp * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int c = ks * 16 + ((lane >> 3) & 1) * 8;
                const u32 b_off = (u32)(r * PITCH + c) * 2;
                u32 b0, b1, b2, b3;
                cm_ldmatrix_x4(smem_k + b_off, b0, b1, b2, b3);
                cm_mma16816(s[2 * jp], qa, b0, b1);
                cm_mma16816(s[2 * jp + 1], qa, b2, b3);
                cm_ldmatrix_x4(smem_v + b_off, b0, b1, b2, b3);
                cm_mma16816(dp[2 * jp], da, b0, b1);
                cm_mma16816(dp[2 * jp + 1], da, b2, b3);
            }
        }

        // dS. Element [j][e] is query 16 warp + g + 8 (e >> 1), key 8 j + 2 t + (e & 1).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u64 bits = partial ? sBits[warp * 16 + g + h * 8] : ~0ull;
#pragma unroll
            for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int e = h * 2 + c;
                    const bool vis = (bits >> (j * 8 + t * 2 + c)) & 1ull;
                    const float x = vis ? fmaf(s[j][e], p.scale_log2, -lse2[h]) : cm_neg_inf();
                    const float pr = cm_exp2(x);
                    dp[j][e] = pr * (dp[j][e] - dl[h]);
                }
            }
        }

        // dQ += dS K (keys are the contraction dim; K read transposed).
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            u32 a[4];
            cm_bwd_a_fragment(dp, kk, a);
#pragma unroll
            for (int dd = 0; dd < HEAD_DIM / 16; ++dd) {
                const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = dd * 16 + (lane >> 4) * 8;
                u32 b0, b1, b2, b3;
                cm_ldmatrix_x4_trans(smem_k + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
                cm_mma16816(acc_dq[2 * dd], a, b0, b1);
                cm_mma16816(acc_dq[2 * dd + 1], a, b2, b3);
            }
        }
        __syncthreads();  // every warp is done with sK, sV, sBits
    }
    cm_cp_async_wait<0>();

    cm_bwd_store_rows(p.dq + batch * p.dq_stride_batch + head * p.dq_stride_head, p.dq_stride_row, acc_dq,
                      p.softmax_scale, row0, p.q_len, warp, g, t);
}
