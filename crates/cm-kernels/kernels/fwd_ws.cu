// The warp-specialised Hopper forward kernel (FlashAttention-3's structure): per (128-row
// query block, head, batch) one CTA of three warpgroups. Warpgroup 0 is the producer: one
// thread issues TMA loads of the Q block and of every key tile the descriptor lists into a
// two-stage ring of K and V buffers, each guarded by "full" (TMA bytes landed) and "empty"
// (consumers done reading) mbarriers. Warpgroups 1 and 2 are consumers, 64 query rows each:
// S = Q K^T on wgmma (both operands in 128B-swizzled shared memory), masking and the online
// softmax in registers, O += P V on wgmma with P from registers; the softmax of tile i runs
// while the tensor cores compute P V of tile i - 1. The two consumers run the same tile
// sequence independently, so one's softmax also overlaps the other's matrix products, and the
// producer keeps the next tile's loads in flight behind both. The producer gives up
// registers (setmaxnreg) so the consumers can hold S, P and O.
//
// 128x128 tiles: the descriptor's forward lists at that shape (cm_cuda::PlanArray::Ws*);
// partial tiles read each row's visibility as 128 precomputed bits (one 16-byte load per row,
// issued before the tile's scores are computed), so a row with many short runs of keys (2D
// windows in patch order) costs no more than one with a single run; empty tiles are never
// loaded, full tiles run no mask code.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16 (1 = bf16, 0 = fp16), CM_HEAD_DIM (64|128),
// CM_DYNAMIC_SMEM_BYTES (the launch's dynamic shared memory, checked against the layout).
#include "fwd_common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#ifndef CM_HEAD_DIM
#error "CM_HEAD_DIM must be defined (64 or 128)"
#endif

#define BLOCK_M 128
#define BLOCK_N 128
#define NUM_THREADS 384
#define STAGES 2
#define HEAD_DIM CM_HEAD_DIM
// Bytes of one 128-row tile, a multiple of 1024, so every tile and column atom stays
// swizzle-atom aligned.
#define TILE_BYTES (BLOCK_N * HEAD_DIM * 2)
// Q, STAGES x (K, V), then the barriers; plus 1 KB to align the start.
#define BAR_OFFSET ((1 + 2 * STAGES) * TILE_BYTES)
#define SMEM_BYTES (BAR_OFFSET + 128 + 1024)
// Producer and consumer register budgets: 128 x 40 + 256 x 232 <= 65536.
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");
static_assert(BLOCK_M == BLOCK_N, "Q, K and V tiles share one shape");
static_assert(SMEM_BYTES == CM_DYNAMIC_SMEM_BYTES, "dynamic shared memory must match cm_kernels");

// Barriers, 8 bytes each, after the tiles.
#define BAR_Q 0
#define BAR_K_FULL(s) (1 + (s))
#define BAR_V_FULL(s) (1 + STAGES + (s))
#define BAR_K_EMPTY(s) (1 + 2 * STAGES + (s))
#define BAR_V_EMPTY(s) (1 + 3 * STAGES + (s))
#define NUM_BARS (1 + 4 * STAGES)
static_assert(NUM_BARS * 8 <= 128, "barrier area");

// Consumer warps that arrive on an "empty" barrier once their warpgroup's wgmma has read a slot.
#define CONSUMER_WARPS 8

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
    cm_fwd_ws(const __grid_constant__ CmFwdParams p, const __grid_constant__ CmTensorMap tm_q,
              const __grid_constant__ CmTensorMap tm_k, const __grid_constant__ CmTensorMap tm_v) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (cm_smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base;
    const u32 sK0 = base + TILE_BYTES;
    const u32 sV0 = sK0 + STAGES * TILE_BYTES;
    const u32 bars = base + BAR_OFFSET;
    auto bar = [&](int i) -> u32 { return bars + 8 * i; };

    const u32 m_block = p.m_block_order[blockIdx.x];
    const u32 head = blockIdx.y;
    const u32 batch = blockIdx.z;
    const u32 kv_head = head / p.heads_per_kv_head;
    const u32 row0 = m_block * BLOCK_M;

    const u32 p_begin = p.kv_offsets[m_block];
    const u32 num_partial = p.kv_offsets[m_block + 1] - p_begin;
    const u32 f_begin = p.full_kv_offsets[m_block];
    const u32 num_tiles = num_partial + (p.full_kv_offsets[m_block + 1] - f_begin);
    auto tile_n_block = [&](u32 it) -> u32 {
        return it < num_partial ? p.kv_indices[p_begin + it] : p.full_kv_indices[f_begin + it - num_partial];
    };

    if (threadIdx.x == 0) {
        cm_mbar_init(bar(BAR_Q), 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            cm_mbar_init(bar(BAR_K_FULL(s)), 1);
            cm_mbar_init(bar(BAR_V_FULL(s)), 1);
            cm_mbar_init(bar(BAR_K_EMPTY(s)), CONSUMER_WARPS);
            cm_mbar_init(bar(BAR_V_EMPTY(s)), CONSUMER_WARPS);
        }
        cm_mbar_init_fence();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        cm_regs_dealloc<PRODUCER_REGS>();
        if (threadIdx.x == 0 && num_tiles > 0) {
            cm_tma_prefetch_map(&tm_k);
            cm_tma_prefetch_map(&tm_v);
            cm_mbar_arrive_expect_tx(bar(BAR_Q), TILE_BYTES);
#pragma unroll
            for (int a = 0; a < HEAD_DIM / 64; ++a) {
                cm_tma_load4(sQ + a * BLOCK_M * 128, &tm_q, bar(BAR_Q), a * 64, row0, head, batch);
            }
            for (u32 it = 0; it < num_tiles; ++it) {
                const u32 s = it % STAGES;
                const u32 phase = (it / STAGES) & 1;
                const int key0 = (int)(tile_n_block(it) * BLOCK_N);
                const u32 sK = sK0 + s * TILE_BYTES;
                const u32 sV = sV0 + s * TILE_BYTES;
                cm_mbar_wait(bar(BAR_K_EMPTY(s)), phase ^ 1);
                cm_mbar_arrive_expect_tx(bar(BAR_K_FULL(s)), TILE_BYTES);
#pragma unroll
                for (int a = 0; a < HEAD_DIM / 64; ++a) {
                    cm_tma_load4(sK + a * BLOCK_N * 128, &tm_k, bar(BAR_K_FULL(s)), a * 64, key0, kv_head, batch);
                }
                cm_mbar_wait(bar(BAR_V_EMPTY(s)), phase ^ 1);
                cm_mbar_arrive_expect_tx(bar(BAR_V_FULL(s)), TILE_BYTES);
#pragma unroll
                for (int a = 0; a < HEAD_DIM / 64; ++a) {
                    cm_tma_load4(sV + a * BLOCK_N * 128, &tm_v, bar(BAR_V_FULL(s)), a * 64, key0, kv_head, batch);
                }
            }
        }
        return;
    }

    cm_regs_alloc<CONSUMER_REGS>();
    const int lane = threadIdx.x & 31;
    // Row group of this warp inside the 128-row block: consumer 1 owns rows 0..63, consumer 2
    // rows 64..127, 16 per warp.
    const int warp = (threadIdx.x - 128) >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 sQ_rows = sQ + (warpgroup - 1) * 64 * 128;

    float acc_o[HEAD_DIM / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
        acc_o[j][0] = acc_o[j][1] = acc_o[j][2] = acc_o[j][3] = 0.f;
    }
    float row_max[2] = {cm_neg_inf(), cm_neg_inf()};
    float row_sum[2] = {0.f, 0.f};

    float sc[BLOCK_N / 8][4];
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
    }
    u32 pa[BLOCK_N / 16][4];
    float alpha[2];
    // S = Q K^T of tile `it` into sc, issued (not waited for). The Q rows of this consumer are
    // a 64-row slice of the 128-row Q tile: same column atoms (stride BLOCK_M * 128), starting
    // 64 rows in.
    auto issue_s = [&](u32 it) {
        const u32 s = it % STAGES;
        const u32 sK = sK0 + s * TILE_BYTES;
        cm_mbar_wait(bar(BAR_K_FULL(s)), (it / STAGES) & 1);
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
            cm_wgmma_n128_ss(sc, cm_wgmma_desc(sQ_rows + (ks >> 2) * BLOCK_M * 128 + (ks & 3) * 32, 16, 1024),
                             cm_desc_k_major(sK, BLOCK_N, ks), ks > 0);
        }
        cm_wgmma_commit();
    };
    // O += P V of tile `it`, issued (not waited for).
    auto issue_pv = [&](u32 it) {
        const u32 s = it % STAGES;
        const u32 sV = sV0 + s * TILE_BYTES;
        cm_mbar_wait(bar(BAR_V_FULL(s)), (it / STAGES) & 1);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#if HEAD_DIM == 128
            cm_wgmma_n128<1>(acc_o, pa[kk], cm_desc_mn_major(sV, BLOCK_N, kk), 1);
#else
            cm_wgmma_n64<1>(acc_o, pa[kk], cm_desc_mn_major(sV, BLOCK_N, kk), 1);
#endif
        }
        cm_wgmma_commit();
    };
    auto release = [&](int which, u32 it) {
        __syncwarp();
        if (lane == 0) cm_mbar_arrive(bar(which + (int)(it % STAGES)));
    };
    // Visibility bits of this thread's rows in tile `it` when it is partial.
    u32 bits[2][4];
    auto load_bits = [&](u32 it) {
        if (it < num_partial) cm_load_row_bits(bits, p, p_begin + it, BLOCK_M, warp, g);
    };
    // Masks and exponentiates tile `it`'s scores (sc), leaving the output's rescale in alpha.
    auto softmax = [&](u32 it) {
        cm_scale_and_mask_bits(sc, p, it < num_partial, bits, tile_n_block(it) * BLOCK_N, t);
        cm_softmax_step(sc, row_max, row_sum, alpha);
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) cm_p_fragment(sc, kk, pa[kk]);
    };

    // FlashAttention-3's intra-warpgroup overlap: while the tensor cores compute S of tile
    // it and O += P V of tile it - 1, this warpgroup waits only for S, then masks and
    // exponentiates it; the output is rescaled once the P V product has drained.
    if (num_tiles > 0) {
        load_bits(0);
        cm_mbar_wait(bar(BAR_Q), 0);
        cm_wgmma_fence();
        issue_s(0);
        cm_wgmma_wait<0>();
        cm_fence_acc(sc);
        release(BAR_K_EMPTY(0), 0);
        softmax(0);
        pack_p();
    }
    for (u32 it = 1; it < num_tiles; ++it) {
        load_bits(it);
        cm_fence_acc(acc_o);
        cm_wgmma_fence();
        issue_s(it);
        issue_pv(it - 1);
        cm_wgmma_wait<1>();
        cm_fence_acc(sc);
        release(BAR_K_EMPTY(0), it);
        softmax(it);
        cm_wgmma_wait<0>();
        cm_fence_acc(acc_o);
        cm_fence_frag(pa);
        release(BAR_V_EMPTY(0), it - 1);
        cm_rescale(acc_o, alpha);
        pack_p();
    }
    if (num_tiles > 0) {
        cm_fence_acc(acc_o);
        cm_wgmma_fence();
        issue_pv(num_tiles - 1);
        cm_wgmma_wait<0>();
        cm_fence_acc(acc_o);
        cm_fence_frag(pa);
        release(BAR_V_EMPTY(0), num_tiles - 1);
    }

    cm_store_output(p, acc_o, row_max, row_sum, batch, head, row0, warp, g, t);
}
