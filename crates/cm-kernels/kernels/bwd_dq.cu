// Backward dQ of the deterministic mode, one CTA of one warpgroup (4 warps) per (64-row query
// block, head, batch): walks the query block's key tiles from the forward lists (partial tiles
// with their rows' visibility bits, then full tiles with no mask code), recomputes S = Q K^T and
// dP = dO V^T, P = exp2(S c log2e - lse_log2), dS = P (dP - delta), and accumulates
// dQ = c dS K in registers in a fixed order, so its bits do not change run to run. All
// products are Hopper wgmma on 128B-swizzled shared memory: S and dP with K-major operands
// (SS), dQ with dS from registers and the K tile read MN-major (RS). Warp w owns query rows
// 16 w .. 16 w + 15 (the forward's fragment layout). K and V are double buffered: the next
// tile's loads run during the current tile's products. Query blocks with no tile write dQ = 0.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16, CM_HEAD_DIM and CM_HEAD_DIM_V
// (cm_kernels::VARIANTS' shapes),
// CM_DYNAMIC_SMEM_BYTES (the dynamic shared memory the runtime launches with), CM_SCORE (1:
// recompute P with the score terms and apply the softcap's derivative to dS).
#include "bwd_common.cuh"

// Shared memory from a 1024-byte-aligned base: Q, dO, two stages of K and V, two stages of
// the per-row key visibility of a partial tile (64 u64).
#define OFF_DO TILE_BYTES
#define OFF_K (TILE_BYTES + TILE_BYTES_V)
#define OFF_V (3 * TILE_BYTES + TILE_BYTES_V)
#define OFF_BITS (3 * TILE_BYTES + 3 * TILE_BYTES_V)
// dQ's accumulator: one array of HEAD_DIM columns up to 128 (one wgmma of N = HEAD_DIM per
// k-step), else one array per 64-column atom (there is no N = 192 shape to cover 192 at once).
#define DQ_PARTS (HEAD_DIM > 128 ? HEAD_DIM / 64 : 1)
#define DQ_PART_COLS (HEAD_DIM / DQ_PARTS)
#define SMEM_BYTES (OFF_BITS + 2 * BLOCK_M * 8 + 1024)
static_assert(SMEM_BYTES == CM_DYNAMIC_SMEM_BYTES, "cm_kernels::Variant::dynamic_shared_bytes must match");
// K and V double buffered.
CM_CHECK_SHAPE(BLOCK_M, BLOCK_N, 2, NUM_THREADS);

// dS = P (dP - delta) in place of dP, P = exp2(S c log2e - lse_log2) recomputed. Element
// [j][e] is query 16 warp + g + 8 (e >> 1), key 8 j + 2 t + (e & 1); with MASKED, bit b of
// bits[e >> 1] says whether key b of the tile is visible from that query, and an invisible
// pair gets exponent -inf whatever its score, so P = 0 (and with it dS) exactly.
template <bool MASKED>
__device__ __forceinline__ void score_grads(const float (&s)[BLOCK_N / 8][4], float (&dp)[BLOCK_N / 8][4],
                                            const u64 (&bits)[2], const float (&lse2)[2], const float (&dl)[2],
                                            float scale_log2, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int e = h * 2 + c;
                float x = fmaf(s[j][e], scale_log2, -lse2[h]);
                if (MASKED && !((bits[h] >> (j * 8 + t * 2 + c)) & 1ull)) x = cm_neg_inf();
                dp[j][e] = cm_exp2(x) * (dp[j][e] - dl[h]);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) cm_bwd_dq(const CmBwdParams p) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (cm_smem_addr(smem_raw) + 1023u) & ~1023u;
    u64* sBits = reinterpret_cast<u64*>(smem_raw + (base - cm_smem_addr(smem_raw)) + OFF_BITS);  // [stage][64]
    const u32 sQ = base;
    const u32 sdO = base + OFF_DO;

    const u32 head = blockIdx.y;
    const u32 batch = blockIdx.z;
    // This (batch, head)'s mask: its fixed-stride lists (cm_cuda::PlanArray).
    const u64 mask = cm_bwd_mask(p, batch, head);
    const u32* kv_offsets = p.kv_offsets + mask * (p.num_m_blocks + 1);
    const u32* full_kv_offsets = p.full_kv_offsets + mask * (p.num_m_blocks + 1);
    const u32 m_block = p.m_block_order[mask * p.num_m_blocks + blockIdx.x];
    const u32 kv_head = head / p.heads_per_kv_head;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 row0 = m_block * BLOCK_M;
    const u64 bh = (u64)batch * p.num_heads + head;

    const u32 p_begin = kv_offsets[m_block];
    const u32 num_partial = kv_offsets[m_block + 1] - p_begin;
    const u32 f_begin = full_kv_offsets[m_block];
    const u32 num_tiles = num_partial + (full_kv_offsets[m_block + 1] - f_begin);

    const u16* k = p.k + batch * p.k_stride_batch + kv_head * p.k_stride_head;
    const u16* v = p.v + batch * p.v_stride_batch + kv_head * p.v_stride_head;

    auto key_of = [&](u32 it) -> u32 {
        return (it < num_partial ? p.kv_indices[p_begin + it] : p.full_kv_indices[f_begin + it - num_partial]) *
               BLOCK_N;
    };
    auto load_kv = [&](u32 key0, u32 st) {
        cm_bwd_load_tile<HEAD_DIM>(base + OFF_K + st * TILE_BYTES, k, p.k_stride_row, key0, p.kv_len);
        cm_bwd_load_tile<HEAD_DIM_V>(base + OFF_V + st * TILE_BYTES_V, v, p.v_stride_row, key0, p.kv_len);
    };
    // The key masks of partial tile `it`'s 64 rows into stage `st` (one u64 per row from the
    // plan's row bits): the even threads of every warp take one row each.
    auto row_bits = [&](u32 it, u32 st) {
        if (it < num_partial && (threadIdx.x & 1) == 0) {
            const u32 r = threadIdx.x >> 1;
            sBits[st * BLOCK_M + r] = cm_bwd_row_bits(p, p_begin + it, r);
        }
    };

    // Row statistics of the thread's rows g and g + 8 (padded workspace rows: in bounds).
    float lse2[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 row = row0 + warp * 16 + g + h * 8;
        lse2[h] = p.lse_log2[bh * p.q_pad + row];
        dl[h] = p.delta[bh * p.q_pad + row];
    }

    float acc_dq[DQ_PARTS][DQ_PART_COLS / 8][4];
#pragma unroll
    for (int pp = 0; pp < DQ_PARTS; ++pp) {
#pragma unroll
        for (int j = 0; j < DQ_PART_COLS / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dq[pp][j][e] = 0.f;
        }
    }

    if (num_tiles > 0) {
        const u32 key0 = key_of(0);
        cm_bwd_load_tile<HEAD_DIM>(sQ, p.q + batch * p.q_stride_batch + head * p.q_stride_head, p.q_stride_row, row0,
                                   p.q_len);
        cm_bwd_load_tile<HEAD_DIM_V>(sdO, p.dout + batch * p.do_stride_batch + head * p.do_stride_head,
                                     p.do_stride_row, row0, p.q_len);
        load_kv(key0, 0);
        cm_cp_async_commit();
        row_bits(0, 0);
    }

    for (u32 it = 0; it < num_tiles; ++it) {
        const u32 st = it & 1;
        const u32 sK = base + OFF_K + st * TILE_BYTES;
        const u32 sV = base + OFF_V + st * TILE_BYTES_V;
        const bool has_next = it + 1 < num_tiles;
        const u32 key_next = has_next ? key_of(it + 1) : 0;
        // Stage st ^ 1 was last read in iteration it - 1, before its closing barrier.
        if (has_next) load_kv(key_next, st ^ 1);
        cm_cp_async_commit();
        cm_cp_async_wait<1>();  // tile it (and Q, dO) landed
        cm_fence_proxy_async();
        __syncthreads();

        // S and dP for the block's 64 queries x 64 keys, contraction over head_dim.
        float s[BLOCK_N / 8][4];
        float dp[BLOCK_N / 8][4];
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        }
        cm_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            cm_wgmma_n64_ss(s, cm_desc_k_major(sQ, BLOCK_M, ks), cm_desc_k_major(sK, BLOCK_N, ks), ks > 0);
        }
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM_V / 16; ++ks) {
            cm_wgmma_n64_ss(dp, cm_desc_k_major(sdO, BLOCK_M, ks), cm_desc_k_major(sV, BLOCK_N, ks), ks > 0);
        }
        cm_wgmma_commit();
        if (has_next) row_bits(it + 1, st ^ 1);
#if CM_SCORE
        // The distance table's view of the tile, loaded while the products run.
        const CmDistTile dist = cm_dist_tile<BLOCK_N / 8, false>(p.score, head, p.q_len, p.kv_len,
                                                                 row0 + warp * 16 + g, key_of(it) + 2 * t);
#endif
        cm_wgmma_wait<0>();
        cm_fence_acc(s);
        cm_fence_acc(dp);

        // dS. A full tile that overhangs kv_len masks the zero-filled keys past it: their
        // score 0 would give P = exp2(-lse_log2), inf for a row with lse below -88.7
        // (ln FLT_MAX), and dQ would get inf * 0 = NaN from their zero K rows.
        const bool partial = it < num_partial;
        const u32 key0 = key_of(it);
#if CM_SCORE
        // The logits with their score terms, already in the log2 domain.
        CmDcap<BLOCK_N / 8> dcap;
        cm_score_logits<BLOCK_N / 8, false, true>(s, dcap, p.score, dist, p.softmax_scale, head, p.q_len, p.kv_len,
                                                  row0 + warp * 16 + g, key0 + 2 * t);
        const float logit_scale = 1.f;
#else
        const float logit_scale = p.scale_log2;
#endif
        if (partial || key0 + BLOCK_N > p.kv_len) {
            u64 bits[2];
            const u32 in_range = p.kv_len - key0;  // key0 < kv_len: the tile is listed
            const u64 range_bits = in_range >= 64 ? ~0ull : (1ull << in_range) - 1;
#pragma unroll
            for (int h = 0; h < 2; ++h) bits[h] = partial ? sBits[st * BLOCK_M + warp * 16 + g + h * 8] : range_bits;
            score_grads<true>(s, dp, bits, lse2, dl, logit_scale, t);
        } else {
            const u64 bits[2] = {~0ull, ~0ull};
            score_grads<false>(s, dp, bits, lse2, dl, logit_scale, t);
        }

#if CM_SCORE
        // Only the scores before the cap carry its derivative.
        if (p.score.softcap > 0.f) cm_mul_dcap(dp, dcap);
#endif
        // dQ += dS K: contraction over the tile's 64 keys, K read transposed.
        u32 dsa[BLOCK_N / 16][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) cm_bwd_a_fragment(dp, kk, dsa[kk]);
        cm_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
            for (int pp = 0; pp < DQ_PARTS; ++pp) {
                cm_wgmma_rs<1>(acc_dq[pp], dsa[kk], cm_desc_mn_major(sK + pp * BLOCK_N * 128, BLOCK_N, kk), 1);
            }
        }
        cm_wgmma_commit();
        cm_wgmma_wait<0>();
#pragma unroll
        for (int pp = 0; pp < DQ_PARTS; ++pp) cm_fence_acc(acc_dq[pp]);
        cm_fence_frag(dsa);
        __syncthreads();  // every warp is done with stage st (K, V, key masks)
    }
    cm_cp_async_wait<0>();

#pragma unroll
    for (int pp = 0; pp < DQ_PARTS; ++pp) {
        cm_bwd_store_rows(p.dq + batch * p.dq_stride_batch + head * p.dq_stride_head + pp * DQ_PART_COLS,
                          p.dq_stride_row, acc_dq[pp], p.softmax_scale, row0, p.q_len, warp, g, t);
    }
}
