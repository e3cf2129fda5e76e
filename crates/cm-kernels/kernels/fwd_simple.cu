// The simple forward kernel: the reference GPU path and the fallback for shapes the Hopper
// kernel does not take. One CTA of 4 warps per (query block, head, batch); each warp owns 16
// query rows and runs mma.sync (m16n8k16) against 64-key tiles. Walks the descriptor's
// partial tiles (per-row interval limits) and then its full tiles (no mask code, except the
// key-length bound on a ragged last tile); empty tiles are never visited.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16 (1 = bf16, 0 = fp16), CM_HEAD_DIM (64|128).
#include "fwd_common.cuh"

#ifndef CM_HEAD_DIM
#error "CM_HEAD_DIM must be defined (64 or 128)"
#endif
#ifndef CM_DTYPE_BF16
#error "CM_DTYPE_BF16 must be defined (1 = bf16, 0 = fp16)"
#endif

#define BLOCK_M 64
#define BLOCK_N 64
#define NUM_THREADS 128
#define HEAD_DIM CM_HEAD_DIM
// 16 bytes of padding per shared-memory row make the 8 row addresses of every ldmatrix fall
// into distinct bank groups.
#define PITCH (HEAD_DIM + 8)

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");
CM_CHECK_SHAPE(BLOCK_M, BLOCK_N, 1, NUM_THREADS);
static_assert(BLOCK_M == BLOCK_N, "Q is staged through the K buffer");

// Copies rows [row0, row0 + 64) of a [seq, HEAD_DIM] matrix into shared memory, zero-filling
// rows at or past `len`.
__device__ __forceinline__ void load_tile(u16* smem, const u16* base, i64 row_stride, u32 row0, u32 len) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    constexpr int PER_THREAD = BLOCK_N * CHUNKS_PER_ROW / NUM_THREADS;
    const u32 smem_base = cm_smem_addr(smem);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * NUM_THREADS;
        const int r = c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * 8;
        const u32 row = row0 + r;
        const bool ok = row < len;
        const u16* src = base + (ok ? (i64)row * row_stride + col : 0);
        cm_cp_async16(smem_base + (u32)(r * PITCH + col) * 2, src, ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) cm_fwd_simple(const CmFwdParams p) {
    __shared__ __align__(128) u16 sK[BLOCK_N * PITCH];
    __shared__ __align__(128) u16 sV[BLOCK_N * PITCH];

    const u32 head = blockIdx.y;
    const u32 batch = blockIdx.z;
    const CmFwdLists lists = cm_fwd_lists(p, batch, head);
    const u32 m_block = lists.m_block_order[blockIdx.x];
    const u32 kv_head = head / p.heads_per_kv_head;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;  // fragment row within the warp's 16 rows (and g + 8)
    const int t = lane & 3;   // fragment column pair
    const u32 row0 = m_block * BLOCK_M;

    const u16* q = p.q + batch * p.q_stride_batch + head * p.q_stride_head;
    const u16* k = p.k + batch * p.k_stride_batch + kv_head * p.k_stride_head;
    const u16* v = p.v + batch * p.v_stride_batch + kv_head * p.v_stride_head;

    const u32 p_begin = lists.kv_offsets[m_block];
    const u32 num_partial = lists.kv_offsets[m_block + 1] - p_begin;
    const u32 f_begin = lists.full_kv_offsets[m_block];
    const u32 num_tiles = num_partial + (lists.full_kv_offsets[m_block + 1] - f_begin);

    // Q fragments stay in registers for the whole block; Q is staged through sK.
    load_tile(sK, q, p.q_stride_row, row0, p.q_len);
    cm_cp_async_commit();
    cm_cp_async_wait<0>();
    __syncthreads();
    u32 qf[HEAD_DIM / 16][4];
    {
        const u32 base = cm_smem_addr(sK);
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            const int r = warp * 16 + (lane & 15);
            const int c = ks * 16 + (lane >> 4) * 8;
            cm_ldmatrix_x4(base + (u32)(r * PITCH + c) * 2, qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3]);
        }
    }
    __syncthreads();

    float acc_o[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
        acc_o[j][0] = acc_o[j][1] = acc_o[j][2] = acc_o[j][3] = 0.f;
    }
    // Per fragment row (g, g + 8): running max in the exp2 domain and this thread's partial
    // row sum (reduced over the quad at the end).
    float row_max[2] = {cm_neg_inf(), cm_neg_inf()};
    float row_sum[2] = {0.f, 0.f};

    auto tile_n_block = [&](u32 it) -> u32 {
        return it < num_partial ? p.kv_indices[p_begin + it] : p.full_kv_indices[f_begin + it - num_partial];
    };

    // Pipeline: K(i+1) streams in during softmax and P*V of tile i, V(i+1) during Q*K^T of
    // tile i+1. One commit group per load (empty at the end) keeps wait_group counts uniform.
    if (num_tiles > 0) {
        const u32 n0 = tile_n_block(0) * BLOCK_N;
        load_tile(sK, k, p.k_stride_row, n0, p.kv_len);
        cm_cp_async_commit();
        load_tile(sV, v, p.v_stride_row, n0, p.kv_len);
        cm_cp_async_commit();
    }

    for (u32 it = 0; it < num_tiles; ++it) {
        const u32 n_block = tile_n_block(it);
        const u32 key0 = n_block * BLOCK_N;
        cm_cp_async_wait<1>();  // K(it) landed
        __syncthreads();

        float s[BLOCK_N / 8][4];
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        }
        {
            const u32 base = cm_smem_addr(sK);
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
                for (int jp = 0; jp < BLOCK_N / 16; ++jp) {
                    const int r = jp * 16 + (lane & 7) + ((lane >> 4) << 3);
                    const int c = ks * 16 + ((lane >> 3) & 1) * 8;
                    u32 b0, b1, b2, b3;
                    cm_ldmatrix_x4(base + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
                    cm_mma16816(s[2 * jp], qf[ks], b0, b1);
                    cm_mma16816(s[2 * jp + 1], qf[ks], b2, b3);
                }
            }
        }
        __syncthreads();  // every warp is done with sK
        if (it + 1 < num_tiles) {
            load_tile(sK, k, p.k_stride_row, tile_n_block(it + 1) * BLOCK_N, p.kv_len);
        }
        cm_cp_async_commit();

        u32 bits[2][BLOCK_N / 32] = {};
        if (it < num_partial) cm_load_row_bits<BLOCK_N / 8>(bits, p, p_begin + it, BLOCK_M, warp, g);
        cm_scale_and_mask_bits(s, p, it < num_partial, bits, key0, t);
        cm_online_softmax(s, row_max, row_sum, acc_o);

        cm_cp_async_wait<1>();  // V(it) landed (only K(it + 1) may be in flight)
        __syncthreads();
        {
            const u32 base = cm_smem_addr(sV);
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                u32 a[4];
                cm_p_fragment(s, kk, a);
#pragma unroll
                for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
                    const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int c = dp * 16 + (lane >> 4) * 8;
                    u32 b0, b1, b2, b3;
                    cm_ldmatrix_x4_trans(base + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
                    cm_mma16816(acc_o[2 * dp], a, b0, b1);
                    cm_mma16816(acc_o[2 * dp + 1], a, b2, b3);
                }
            }
        }
        __syncthreads();  // every warp is done with sV
        if (it + 1 < num_tiles) {
            load_tile(sV, v, p.v_stride_row, tile_n_block(it + 1) * BLOCK_N, p.kv_len);
        }
        cm_cp_async_commit();
    }
    cm_cp_async_wait<0>();

    cm_store_output(p, acc_o, row_max, row_sum, batch, head, row0, warp, g, t);
}
