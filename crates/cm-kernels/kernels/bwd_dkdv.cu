// Backward dK / dV, one CTA of one warpgroup (4 warps) per (64-key block, kv head, batch):
// walks the key block's query tiles from the transposed descriptor lists (partial tiles with
// the forward's per-row limits, then full tiles with no mask code; empty tiles are never
// visited) for every query head of the GQA group, so dK and dV of a kv head are summed in
// registers in a fixed order: no atomics, the same bits run to run. All matrix products are
// Hopper wgmma (sm_90a) on 128B-swizzled shared memory, FlashAttention-3's backward in one
// warpgroup. Per 64-row query tile, with the key block's K and V resident:
//   S^T = K Q^T, dP^T = V dO^T            SS wgmma, K-major operands (keys x queries, M = keys)
//   P^T = exp2(S^T c log2e - lse_log2), dS^T = P^T (dP^T - delta)      in registers
//   dV += P^T dO, dK += dS^T Q             RS wgmma, dO and Q tiles read MN-major
// Warp w holds keys 16 w .. 16 w + 15 of every product (the m16n8 accumulator layout).
// When the workspace has a dQ accumulator (the fast mode) it also computes dQ = dS K for the
// tile: dS^T goes to a swizzled shared tile and is read back as an MN-major A operand, K as an
// MN-major B operand, and the product is added into the fp32 workspace with vector atomic
// reductions, whose order between CTAs varies run to run; bwd_post scales and rounds it.
// Without the accumulator (the deterministic mode) dQ is left to bwd_dq; the mode is a
// uniform branch. Q, dO and the row statistics of the next tile stream in (cp.async, double
// buffered) while the current one is computed, and the next partial tile's per-row key masks
// are computed while the current tile's first products run.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16, CM_HEAD_DIM (64|128),
// CM_DYNAMIC_SMEM_BYTES (the dynamic shared memory the runtime launches with).
#include "bwd_common.cuh"

// Shared memory from a 1024-byte-aligned base: K, V, two stages of Q and dO, dS^T
// ([64 keys][64 queries], one swizzle atom wide), then two stages of lse_log2 and delta
// (64 f32 each) and of the per-row key visibility of a partial tile (64 u64).
#define DS_BYTES (BLOCK_N * BLOCK_M * 2)
#define OFF_V TILE_BYTES
#define OFF_Q (2 * TILE_BYTES)
#define OFF_DO (4 * TILE_BYTES)
#define OFF_DS (6 * TILE_BYTES)
#define OFF_STATS (OFF_DS + DS_BYTES)
#define OFF_BITS (OFF_STATS + 2 * 2 * BLOCK_M * 4)
#define SMEM_BYTES (OFF_BITS + 2 * BLOCK_M * 8 + 1024)
static_assert(SMEM_BYTES == CM_DYNAMIC_SMEM_BYTES, "cm_kernels::Variant::dynamic_shared_bytes must match");

// dq_accum[0..2) += (a, b): one vector reduction (sm_90) instead of two scalar atomics.
__device__ __forceinline__ void cm_red_add2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

// One query tile of the walk: `it` counts heads outer, tiles inner (the fixed order of the
// fp32 sums).
struct BwdTile {
    u32 head;
    u32 row0;
    bool partial;
    u32 partial_id;  // index of the tile in the forward's partial list (partial tiles only)
};

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) cm_bwd_dkdv(const CmBwdParams p) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (cm_smem_addr(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - cm_smem_addr(smem_raw));
    const u32 sK = base;
    const u32 sV = base + OFF_V;
    const u32 sDS = base + OFF_DS;
    float* sStats = reinterpret_cast<float*>(smem + OFF_STATS);  // [stage][lse | delta][64]
    u64* sBits = reinterpret_cast<u64*>(smem + OFF_BITS);        // [stage][64]

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
    const bool atomic_dq = p.dq_accum != nullptr;

    auto tile_at = [&](u32 it) -> BwdTile {
        const u32 head_in_group = it / num_tiles;
        const u32 ti = it - head_in_group * num_tiles;
        BwdTile tl;
        tl.head = kv_head * p.heads_per_kv_head + head_in_group;
        tl.partial = ti < num_partial;
        tl.partial_id = tl.partial ? p.q_partial_ids[p_begin + ti] : 0;
        tl.row0 = (tl.partial ? p.q_indices[p_begin + ti] : p.full_q_indices[f_begin + ti - num_partial]) * BLOCK_M;
        return tl;
    };
    // Q, dO and the row statistics of tile `tl` into stage `st` (no commit).
    auto load_tile = [&](const BwdTile& tl, u32 st) {
        const u64 bh = (u64)batch * p.num_heads + tl.head;
        cm_bwd_load_tile(base + OFF_Q + st * TILE_BYTES, p.q + batch * p.q_stride_batch + tl.head * p.q_stride_head,
                         p.q_stride_row, tl.row0, p.q_len);
        cm_bwd_load_tile(base + OFF_DO + st * TILE_BYTES,
                         p.dout + batch * p.do_stride_batch + tl.head * p.do_stride_head, p.do_stride_row, tl.row0,
                         p.q_len);
        float* stats = sStats + st * 2 * BLOCK_M;
        cm_bwd_load_row_stats(stats, stats + BLOCK_M, p.lse_log2 + bh * p.q_pad, p.delta + bh * p.q_pad, tl.row0);
    };
    // The key masks of a partial tile's 64 rows into stage `st`: the even threads of every
    // warp take one row each, so each warp waits on the interval walk of 16 rows.
    auto row_bits = [&](const BwdTile& tl, u32 st) {
        if (tl.partial && (threadIdx.x & 1) == 0) {
            const u32 r = threadIdx.x >> 1;
            sBits[st * BLOCK_M + r] = cm_bwd_row_bits(p, tl.partial_id, r, tl.row0, key0);
        }
    };

    float acc_dk[HEAD_DIM / 8][4];
    float acc_dv[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[j][e] = acc_dv[j][e] = 0.f;
    }

    BwdTile cur;
    if (total > 0) {
        cur = tile_at(0);
        cm_bwd_load_tile(sK, k, p.k_stride_row, key0, p.kv_len);
        cm_bwd_load_tile(sV, v, p.v_stride_row, key0, p.kv_len);
        load_tile(cur, 0);
        cm_cp_async_commit();
        row_bits(cur, 0);
    }

    for (u32 it = 0; it < total; ++it) {
        const u32 st = it & 1;
        const u32 sQ = base + OFF_Q + st * TILE_BYTES;
        const u32 sdO = base + OFF_DO + st * TILE_BYTES;
        const bool has_next = it + 1 < total;
        BwdTile next;
        if (has_next) {
            // Stage st ^ 1 was last read in iteration it - 1, before its closing barrier.
            next = tile_at(it + 1);
            load_tile(next, st ^ 1);
        }
        cm_cp_async_commit();
        cm_cp_async_wait<1>();  // tile it (and K, V) landed; only tile it + 1 may be in flight
        cm_fence_proxy_async();
        __syncthreads();

        // S^T and dP^T: keys x queries, contraction over head_dim.
        float s[BLOCK_M / 8][4];
        float dp[BLOCK_M / 8][4];
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
        }
        cm_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            cm_wgmma_n64_ss(s, cm_desc_k_major(sK, BLOCK_N, ks), cm_desc_k_major(sQ, BLOCK_M, ks), ks > 0);
        }
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            cm_wgmma_n64_ss(dp, cm_desc_k_major(sV, BLOCK_N, ks), cm_desc_k_major(sdO, BLOCK_M, ks), ks > 0);
        }
        cm_wgmma_commit();
        // While they run: the next partial tile's key masks (stage st ^ 1 was last read in
        // iteration it - 1).
        if (has_next) row_bits(next, st ^ 1);
        cm_wgmma_wait<0>();
        cm_fence_acc(s);
        cm_fence_acc(dp);

        // P^T and dS^T. Element [j][e] is key 16 warp + g + 8 (e >> 1), query 8 j + 2 t + (e & 1).
        // A masked pair gets exponent -inf whatever its score, so P = 0 and dS = 0 exactly.
        const float* sLse = sStats + st * 2 * BLOCK_M;
        const float* sDelta = sLse + BLOCK_M;
        const u64* bits_st = sBits + st * BLOCK_M;
#pragma unroll
        for (int j = 0; j < BLOCK_M / 8; ++j) {
            const float2 lse2v = *reinterpret_cast<const float2*>(sLse + j * 8 + t * 2);
            const float2 dlv = *reinterpret_cast<const float2*>(sDelta + j * 8 + t * 2);
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = j * 8 + t * 2 + c;
                const float lse2 = c ? lse2v.y : lse2v.x;
                const float dl = c ? dlv.y : dlv.x;
                const u64 bits = cur.partial ? bits_st[col] : ~0ull;
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

        // The operands in the element type: P^T and dS^T as register A fragments (16 queries
        // per k-step), and dS^T into its swizzled tile for dQ (last read by iteration it - 1's
        // dQ product, finished before its closing barrier).
        u32 pa[BLOCK_M / 16][4];
        u32 dsa[BLOCK_M / 16][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
            cm_bwd_a_fragment(s, kk, pa[kk]);
            cm_bwd_a_fragment(dp, kk, dsa[kk]);
        }
        if (atomic_dq) {
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 row = warp * 16 + g + h * 8;
                    // Queries 16 kk + 2 t (chunk 2 kk) and 16 kk + 8 + 2 t (chunk 2 kk + 1).
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDS + cm_sw128_offset(row, 2 * kk, BLOCK_N) + t * 4),
                                 "r"(dsa[kk][h]));
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDS + cm_sw128_offset(row, 2 * kk + 1, BLOCK_N) + t * 4),
                                 "r"(dsa[kk][2 + h]));
                }
            }
            cm_fence_proxy_async();
        }

        // dV += P^T dO, dK += dS^T Q: contraction over the tile's 64 queries.
        cm_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) cm_wgmma_rs<1>(acc_dv, pa[kk], cm_desc_mn_major(sdO, BLOCK_M, kk), 1);
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) cm_wgmma_rs<1>(acc_dk, dsa[kk], cm_desc_mn_major(sQ, BLOCK_M, kk), 1);
        cm_wgmma_commit();
        // Every warp's dS^T rows in shared memory (the barrier overlaps the products above).
        if (atomic_dq) __syncthreads();
        // The fragments must stay intact until the products have read them; waiting here
        // also keeps them and the dQ accumulator from being live at once (no spill at
        // head_dim 128).
        cm_wgmma_wait<0>();
        cm_fence_acc(acc_dv);
        cm_fence_acc(acc_dk);
        cm_fence_frag(pa);
        cm_fence_frag(dsa);

        if (atomic_dq) {
            // dQ [queries x head_dim] = dS K, contraction over the block's 64 keys: A is dS read
            // transposed from the dS^T tile, B the K tile read transposed.
            float acc_dq[HEAD_DIM / 8][4];
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) acc_dq[j][0] = acc_dq[j][1] = acc_dq[j][2] = acc_dq[j][3] = 0.f;
            cm_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                cm_wgmma_ss<1, 1>(acc_dq, cm_wgmma_desc(sDS + kk * 2048, BLOCK_M * 128, 1024),
                                  cm_desc_mn_major(sK, BLOCK_N, kk), kk > 0);
            }
            cm_wgmma_commit();
            cm_wgmma_wait<0>();
            cm_fence_acc(acc_dq);
            const u64 bh = (u64)batch * p.num_heads + cur.head;
            float* dq_rows = p.dq_accum + (bh * p.q_pad + cur.row0 + warp * 16) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    cm_red_add2(dq_rows + (g + h * 8) * HEAD_DIM + j * 8 + t * 2, acc_dq[j][h * 2],
                                acc_dq[j][h * 2 + 1]);
                }
            }
        }
        __syncthreads();  // every warp is done with stage st, dS^T and the statistics
        if (has_next) cur = next;
    }
    cm_cp_async_wait<0>();

    cm_bwd_store_rows(p.dk + batch * p.dk_stride_batch + kv_head * p.dk_stride_head, p.dk_stride_row, acc_dk,
                      p.softmax_scale, key0, p.kv_len, warp, g, t);
    cm_bwd_store_rows(p.dv + batch * p.dv_stride_batch + kv_head * p.dv_stride_head, p.dv_stride_row, acc_dv, 1.f,
                      key0, p.kv_len, warp, g, t);
}
