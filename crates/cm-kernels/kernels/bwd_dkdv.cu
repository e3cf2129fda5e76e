// Backward dK / dV, one CTA of 4 warps per (64-key block, kv head, batch): walks the key
// block's query tiles from the transposed descriptor lists (partial tiles with the forward's
// per-row limits, then full tiles with no mask code; empty tiles are never visited) for every
// query head of the GQA group, so dK and dV of a kv head are summed in registers in a fixed
// order: no atomics, the same bits run to run. Warp w owns keys 16 w .. 16 w + 15 and
// computes, per 64-row query tile, on mma.sync m16n8k16 with ldmatrix from padded shared
// memory:
//   S^T = K Q^T and dP^T = V dO^T (keys x queries), P^T = exp2(S^T c log2e - lse_log2),
//   dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q.
// When the workspace has a dQ accumulator (the fast mode) it also computes dQ = dS K for the
// tile (dS^T goes through shared memory to become an A operand) and adds it into the fp32
// workspace with atomic reductions, whose order between CTAs varies run to run; bwd_post
// scales and rounds it. Without the accumulator (the deterministic mode) dQ is left to
// bwd_dq. One kernel serves both modes: the mode is a uniform branch, and compiling the modes
// apart gave the dQ-less one a register spill at head_dim 128.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16, CM_HEAD_DIM (64|128),
// CM_DYNAMIC_SMEM_BYTES (the dynamic shared memory the runtime launches with).
#include "bwd_common.cuh"

// dS^T [64 keys][64 queries] in shared memory, padded like the tiles.
#define DS_PITCH (BLOCK_M + 8)

// Shared memory: K, V, Q, dO tiles, dS^T, lse_log2 and delta of the query tile, and the
// per-row key visibility of a partial tile.
#define SMEM_BYTES (4 * TILE_ELEMS * 2 + BLOCK_N * DS_PITCH * 2 + BLOCK_M * 4 * 2 + BLOCK_M * 8)
static_assert(SMEM_BYTES <= CM_DYNAMIC_SMEM_BYTES, "cm_kernels::Variant::dynamic_shared_bytes is too small");

// dq_accum[0..2) += (a, b): one vector reduction (sm_90) instead of two scalar atomics.
__device__ __forceinline__ void cm_red_add2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) cm_bwd_dkdv(const CmBwdParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    u16* sK = reinterpret_cast<u16*>(smem);
    u16* sV = sK + TILE_ELEMS;
    u16* sQ = sV + TILE_ELEMS;
    u16* sdO = sQ + TILE_ELEMS;
    u16* sdS = sdO + TILE_ELEMS;
    float* sLse = reinterpret_cast<float*>(sdS + BLOCK_N * DS_PITCH);
    float* sDelta = sLse + BLOCK_M;
    u64* sBits = reinterpret_cast<u64*>(sDelta + BLOCK_M);

    const u32 n_block = p.n_block_order[blockIdx.x];
    const u32 kv_head = blockIdx.y;
    const u32 batch = blockIdx.z;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;  // fragment row within the warp's 16 keys (and g + 8)
    const int t = lane & 3;   // fragment column pair
    const u32 key0 = n_block * BLOCK_N;

    const u32 p_begin = p.q_offsets[n_block];
    const u32 num_partial = p.q_offsets[n_block + 1] - p_begin;
    const u32 f_begin = p.full_q_offsets[n_block];
    const u32 num_tiles = num_partial + (p.full_q_offsets[n_block + 1] - f_begin);
    const u32 total = num_tiles * p.heads_per_kv_head;

    const u16* k = p.k + batch * p.k_stride_batch + kv_head * p.k_stride_head;
    const u16* v = p.v + batch * p.v_stride_batch + kv_head * p.v_stride_head;

    float acc_dk[HEAD_DIM / 8][4];
    float acc_dv[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[j][e] = acc_dv[j][e] = 0.f;
    }

    if (total > 0) {
        cm_bwd_load_tile(sK, k, p.k_stride_row, key0, p.kv_len);
        cm_bwd_load_tile(sV, v, p.v_stride_row, key0, p.kv_len);
        cm_cp_async_commit();
    }

    const u32 smem_k = cm_smem_addr(sK);
    const u32 smem_v = cm_smem_addr(sV);
    const u32 smem_q = cm_smem_addr(sQ);
    const u32 smem_do = cm_smem_addr(sdO);
    const bool atomic_dq = p.dq_accum != nullptr;

    for (u32 it = 0; it < total; ++it) {
        // Heads outer, tiles inner: the order of the fp32 sums is fixed.
        const u32 head_in_group = it / num_tiles;
        const u32 ti = it - head_in_group * num_tiles;
        const u32 head = kv_head * p.heads_per_kv_head + head_in_group;
        const bool partial = ti < num_partial;
        const u32 m_block = partial ? p.q_indices[p_begin + ti] : p.full_q_indices[f_begin + ti - num_partial];
        const u32 row0 = m_block * BLOCK_M;
        const u64 bh = (u64)batch * p.num_heads + head;

        cm_bwd_load_tile(sQ, p.q + batch * p.q_stride_batch + head * p.q_stride_head, p.q_stride_row, row0, p.q_len);
        cm_bwd_load_tile(sdO, p.dout + batch * p.do_stride_batch + head * p.do_stride_head, p.do_stride_row, row0,
                         p.q_len);
        cm_bwd_load_row_stats(sLse, sDelta, p.lse_log2 + bh * p.q_pad, p.delta + bh * p.q_pad, row0);
        cm_cp_async_commit();
        if (partial && threadIdx.x < BLOCK_M) {
            sBits[threadIdx.x] = cm_bwd_row_bits(p, p.q_partial_ids[p_begin + ti], threadIdx.x, row0, key0);
        }
        cm_cp_async_wait<0>();
        __syncthreads();

        // S^T and dP^T for the warp's 16 keys x 64 queries.
        float s[BLOCK_M / 8][4];
        float dp[BLOCK_M / 8][4];
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        }
        // Not unrolled: with S^T, dP^T, dK and dV all live, unrolling lets ptxas hoist the
        // next k-steps' loads and spill at head_dim 128.
#pragma unroll 1
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            u32 ka[4], va[4];
            const u32 a_off = (u32)((warp * 16 + (lane & 15)) * PITCH + ks * 16 + (lane >> 4) * 8) * 2;
            cm_ldmatrix_x4(smem_k + a_off, ka[0], ka[1], ka[2], ka[3]);
            cm_ldmatrix_x4(smem_v + a_off, va[0], va[1], va[2], va[3]);
#pragma unroll
            for (int jp = 0; jp < BLOCK_M / 16; ++jp) {
                const int r = jp * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int c = ks * 16 + ((lane >> 3) & 1) * 8;
                const u32 b_off = (u32)(r * PITCH + c) * 2;
                u32 b0, b1, b2, b3;
                cm_ldmatrix_x4(smem_q + b_off, b0, b1, b2, b3);
                cm_mma16816(s[2 * jp], ka, b0, b1);
                cm_mma16816(s[2 * jp + 1], ka, b2, b3);
                cm_ldmatrix_x4(smem_do + b_off, b0, b1, b2, b3);
                cm_mma16816(dp[2 * jp], va, b0, b1);
                cm_mma16816(dp[2 * jp + 1], va, b2, b3);
            }
        }

        // P^T and dS^T. Element [j][e] is key 16 warp + g + 8 (e >> 1), query 8 j + 2 t + (e & 1).
        // A masked pair gets exponent -inf whatever its score, so P = 0 and dS = 0 exactly.
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j) {
            const float2 lse2v = *reinterpret_cast<const float2*>(sLse + j * 8 + t * 2);
            const float2 dlv = *reinterpret_cast<const float2*>(sDelta + j * 8 + t * 2);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = j * 8 + t * 2 + c;
                const float lse2 = c ? lse2v.y : lse2v.x;
                const float dl = c ? dlv.y : dlv.x;
                const u64 bits = partial ? sBits[col] : ~0ull;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int e = h * 2 + c;
                    const bool vis = (bits >> (warp * 16 + g + h * 8)) & 1ull;
                    const float x = vis ? fmaf(s[j][e], p.scale_log2, -lse2) : cm_neg_inf();
                    const float pr = cm_exp2(x);
                    s[j][e] = pr;
                    dp[j][e] = pr * (dp[j][e] - dl);
                }
            }
        }

        // dV += P^T dO, then dK += dS^T Q (queries are the contraction dim).
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
            u32 pa[4];
            cm_bwd_a_fragment(s, kk, pa);
#pragma unroll
            for (int dd = 0; dd < HEAD_DIM / 16; ++dd) {
                const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = dd * 16 + (lane >> 4) * 8;
                u32 b0, b1, b2, b3;
                cm_ldmatrix_x4_trans(smem_do + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
                cm_mma16816(acc_dv[2 * dd], pa, b0, b1);
                cm_mma16816(acc_dv[2 * dd + 1], pa, b2, b3);
            }
        }
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
            u32 dsa[4];
            cm_bwd_a_fragment(dp, kk, dsa);
#pragma unroll
            for (int dd = 0; dd < HEAD_DIM / 16; ++dd) {
                const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = dd * 16 + (lane >> 4) * 8;
                u32 b0, b1, b2, b3;
                cm_ldmatrix_x4_trans(smem_q + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
                cm_mma16816(acc_dk[2 * dd], dsa, b0, b1);
                cm_mma16816(acc_dk[2 * dd + 1], dsa, b2, b3);
            }
        }

        if (atomic_dq) {
            // dS^T to shared memory as [key][query], rounded like the dK operand.
#pragma unroll
            for (int j = 0; j < BLOCK_M / 8; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    *reinterpret_cast<u32*>(sdS + (warp * 16 + g + h * 8) * DS_PITCH + j * 8 + t * 2) =
                        cm_pack2(dp[j][h * 2], dp[j][h * 2 + 1]);
                }
            }
            __syncthreads();
            // dQ for the warp's 16 queries = dS [queries x keys] K [keys x d], in 64-column
            // chunks; A is dS read transposed from dS^T, B is K read transposed. The loops are
            // not unrolled so that one chunk's operands are live at a time (no spill at
            // head_dim 64).
            const u32 smem_ds = cm_smem_addr(sdS);
            float* dq_rows = p.dq_accum + (bh * p.q_pad + row0 + warp * 16) * HEAD_DIM;
#pragma unroll 1
            for (int chunk = 0; chunk < HEAD_DIM / 64; ++chunk) {
                float acc[8][4];
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll 1
                for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                    u32 a[4];
                    const int ar = kk * 16 + (lane >> 4) * 8 + (lane & 7);
                    const int ac = warp * 16 + ((lane >> 3) & 1) * 8;
                    cm_ldmatrix_x4_trans(smem_ds + (u32)(ar * DS_PITCH + ac) * 2, a[0], a[1], a[2], a[3]);
#pragma unroll
                    for (int dd = 0; dd < 4; ++dd) {
                        const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                        const int c = chunk * 64 + dd * 16 + (lane >> 4) * 8;
                        u32 b0, b1, b2, b3;
                        cm_ldmatrix_x4_trans(smem_k + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
                        cm_mma16816(acc[2 * dd], a, b0, b1);
                        cm_mma16816(acc[2 * dd + 1], a, b2, b3);
                    }
                }
#pragma unroll
                for (int j = 0; j < 8; ++j) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        cm_red_add2(dq_rows + (g + h * 8) * HEAD_DIM + chunk * 64 + j * 8 + t * 2, acc[j][h * 2],
                                    acc[j][h * 2 + 1]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with sQ, sdO, sdS, sLse, sDelta, sBits
    }
    cm_cp_async_wait<0>();

    cm_bwd_store_rows(p.dk + batch * p.dk_stride_batch + kv_head * p.dk_stride_head, p.dk_stride_row, acc_dk,
                      p.softmax_scale, key0, p.kv_len, warp, g, t);
    cm_bwd_store_rows(p.dv + batch * p.dv_stride_batch + kv_head * p.dv_stride_head, p.dv_stride_row, acc_dv, 1.f,
                      key0, p.kv_len, warp, g, t);
}
