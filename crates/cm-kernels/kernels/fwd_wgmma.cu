// The Hopper forward kernel, first stage: one warpgroup (4 warps) per (64-row query block,
// head, batch), both matrix products on wgmma (sm_90a) reading 128B-swizzled shared memory
// directly: S = Q K^T with Q and K as K-major operands, O += P V with the probabilities from
// registers and V as a transposed (MN-major) operand; 64-key tiles from the compiled
// descriptor. Q stays in shared memory rather than registers: a loop-carried register A
// operand was miscompiled (ptxas 13.0 reused its registers inside the loop). Masking,
// softmax and the epilogue are the simple kernel's (fwd_common.cuh), on the same fragment
// layout. TMA loads and producer / consumer warp specialisation are the next stage.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16 (1 = bf16, 0 = fp16), CM_HEAD_DIM (64|128).
#include "fwd_common.cuh"
#include "wgmma.cuh"

#ifndef CM_HEAD_DIM
#error "CM_HEAD_DIM must be defined (64 or 128)"
#endif

#define BLOCK_M 64
#define BLOCK_N 64
#define NUM_THREADS 128
#define HEAD_DIM CM_HEAD_DIM
// Bytes of one 64-row tile; a multiple of 1024, so every tile stays swizzle-atom aligned.
#define TILE_BYTES (BLOCK_N * HEAD_DIM * 2)

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");
CM_CHECK_SHAPE(BLOCK_M, BLOCK_N, 1, NUM_THREADS);
static_assert(BLOCK_M == BLOCK_N, "Q, K and V tiles share one shape");
static_assert(3 * TILE_BYTES <= 48 * 1024, "static shared memory limit");

// Copies rows [row0, row0 + 64) of a [seq, HEAD_DIM] matrix into a swizzled tile at shared
// address `tile`, zero-filling rows at or past `len`. Eight consecutive threads write the
// eight chunks of one atom row: distinct banks after the swizzle, one coalesced global row.
__device__ __forceinline__ void load_tile_sw(u32 tile, const u16* base, i64 row_stride, u32 row0, u32 len) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    constexpr int PER_THREAD = BLOCK_N * CHUNKS_PER_ROW / NUM_THREADS;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * NUM_THREADS;
        const u32 r = c / CHUNKS_PER_ROW;
        const u32 chunk = c % CHUNKS_PER_ROW;
        const u32 row = row0 + r;
        const bool ok = row < len;
        const u16* src = base + (ok ? (i64)row * row_stride + chunk * 8 : 0);
        cm_cp_async16(tile + cm_sw128_offset(r, chunk, BLOCK_N), src, ok ? 16 : 0);
    }
}

__device__ __forceinline__ void pv_mma(float (&d)[16][4], const u32 (&a)[4], u64 b) { cm_wgmma_n128<1>(d, a, b, 1); }
__device__ __forceinline__ void pv_mma(float (&d)[8][4], const u32 (&a)[4], u64 b) { cm_wgmma_n64<1>(d, a, b, 1); }

extern "C" __global__ void __launch_bounds__(NUM_THREADS) cm_fwd_wgmma(const CmFwdParams p) {
    __shared__ __align__(1024) unsigned char smem[3 * TILE_BYTES];
    const u32 sQ = cm_smem_addr(smem);
    const u32 sK = sQ + TILE_BYTES;
    const u32 sV = sK + TILE_BYTES;

    const u32 head = blockIdx.y;
    const u32 batch = blockIdx.z;
    const CmFwdLists lists = cm_fwd_lists(p, batch, head);
    const u32 m_block = lists.m_block_order[blockIdx.x];
    const u32 kv_head = head / p.heads_per_kv_head;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 row0 = m_block * BLOCK_M;

    const u16* q = p.q + batch * p.q_stride_batch + head * p.q_stride_head;
    const u16* k = p.k + batch * p.k_stride_batch + kv_head * p.k_stride_head;
    const u16* v = p.v + batch * p.v_stride_batch + kv_head * p.v_stride_head;

    const u32 p_begin = lists.kv_offsets[m_block];
    const u32 num_partial = lists.kv_offsets[m_block + 1] - p_begin;
    const u32 f_begin = lists.full_kv_offsets[m_block];
    const u32 num_tiles = num_partial + (lists.full_kv_offsets[m_block + 1] - f_begin);

    float acc_o[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
        acc_o[j][0] = acc_o[j][1] = acc_o[j][2] = acc_o[j][3] = 0.f;
    }
    float row_max[2] = {cm_neg_inf(), cm_neg_inf()};
    float row_sum[2] = {0.f, 0.f};

    auto tile_n_block = [&](u32 it) -> u32 {
        return it < num_partial ? p.kv_indices[p_begin + it] : p.full_kv_indices[f_begin + it - num_partial];
    };

    // Pipeline as in the simple kernel: K(i+1) streams in during softmax and P*V of tile i,
    // V(i+1) during Q*K^T of tile i+1; one commit group per load keeps wait counts uniform.
    // Q joins the first K's group.
    if (num_tiles > 0) {
        const u32 n0 = tile_n_block(0) * BLOCK_N;
        load_tile_sw(sQ, q, p.q_stride_row, row0, p.q_len);
        load_tile_sw(sK, k, p.k_stride_row, n0, p.kv_len);
        cm_cp_async_commit();
        load_tile_sw(sV, v, p.v_stride_row, n0, p.kv_len);
        cm_cp_async_commit();
    }

    for (u32 it = 0; it < num_tiles; ++it) {
        const u32 key0 = tile_n_block(it) * BLOCK_N;
        cm_cp_async_wait<1>();  // K(it) landed
        cm_fence_proxy_async();
        __syncthreads();

        float s[BLOCK_N / 8][4];
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        }
        cm_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            cm_wgmma_n64_ss(s, cm_desc_k_major64(sQ, ks), cm_desc_k_major64(sK, ks), ks > 0);
        }
        cm_wgmma_commit();
        cm_wgmma_wait<0>();
        cm_fence_acc(s);
        __syncthreads();  // the warpgroup is done reading sK
        if (it + 1 < num_tiles) {
            load_tile_sw(sK, k, p.k_stride_row, tile_n_block(it + 1) * BLOCK_N, p.kv_len);
        }
        cm_cp_async_commit();

        u32 bits[2][BLOCK_N / 32] = {};
        if (it < num_partial) cm_load_row_bits<BLOCK_N / 8>(bits, p, p_begin + it, BLOCK_M, warp, g);
        cm_scale_and_mask_bits(s, p, it < num_partial, bits, key0, t);
        cm_online_softmax(s, row_max, row_sum, acc_o);

        cm_cp_async_wait<1>();  // V(it) landed (only K(it + 1) may be in flight)
        cm_fence_proxy_async();
        __syncthreads();
        // All P fragments first: registers an in-flight wgmma reads must not be written, and
        // building them between the wgmmas makes ptxas insert extra warpgroup fences.
        u32 pa[BLOCK_N / 16][4];
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) cm_p_fragment(s, kk, pa[kk]);
        cm_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) pv_mma(acc_o, pa[kk], cm_desc_mn_major64(sV, kk));
        cm_wgmma_commit();
        cm_wgmma_wait<0>();
        cm_fence_acc(acc_o);
        __syncthreads();  // the warpgroup is done reading sV
        if (it + 1 < num_tiles) {
            load_tile_sw(sV, v, p.v_stride_row, tile_n_block(it + 1) * BLOCK_N, p.kv_len);
        }
        cm_cp_async_commit();
    }
    cm_cp_async_wait<0>();

    cm_store_output(p, acc_o, row_max, row_sum, batch, head, row0, warp, g, t);
}
