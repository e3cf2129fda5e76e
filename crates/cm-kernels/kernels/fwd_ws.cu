// The warp-specialised Hopper forward kernel (FlashAttention-3's structure), persistent: one
// CTA of three warpgroups per SM takes work items (128-row query block, head, batch) from a
// global counter until none is left. Items come in groups of (batch, head) pairs (as many as
// the L2 holds the K and V of, p.ws_head_group), and inside a group query block by query block
// in the descriptor's heaviest-first order across the group's pairs: the longest blocks of
// every pair of a group start first (a pair's heaviest block started after the other pairs'
// work would end the launch late), the group's last items are the lightest, and the CTAs
// running at one time share the group's K and V in L2. Warpgroup 0 is the producer: one thread issues TMA loads of each
// item's Q block and of every key tile the descriptor lists into a two-stage ring of K and V
// buffers, each guarded by "full" (TMA bytes landed) and "empty" (consumers done reading)
// mbarriers; the ring and its phases run on across items, the next item's number reaches the
// consumers through a two-slot ring in shared memory, and its Q is loaded as soon as the
// consumers' last Q K^T of the current one has completed, so loads of the next item overlap
// the end of this one and its output stores. The counter (p.scheduler: next item, finished
// CTAs) starts at zero and the last CTA to finish puts it back to zero, so launches on one
// stream can reuse it (the runtime keeps one per stream). Warpgroups 1 and 2 are consumers, 64 query rows each:
// S = Q K^T on wgmma (both operands in 128B-swizzled shared memory), masking and the online
// softmax in registers, O += P V on wgmma with P from registers; the softmax of tile i runs
// while the tensor cores compute P V of tile i - 1. The two consumers run the same tile
// sequence independently, so one's softmax also overlaps the other's matrix products, and the
// producer keeps the next tile's loads in flight behind both. The producer gives up
// registers (setmaxnreg) so the consumers can hold S, P and O.
//
// 128x128 tiles: the descriptor's forward lists at that shape (cm_cuda::PlanArray::Ws*);
// partial tiles read each row's visibility as 128 precomputed bits, which the producer copies
// into shared memory with the tile's K (one bulk copy of 2 KB; a consumer reads its rows' 16
// bytes once the scores are done), so a row with many short runs of keys (2D
// windows in patch order) costs no more than one with a single run; empty tiles are never
// loaded, full tiles run no mask code.
//
// Wider heads keep the 128x128 descriptor tiles: head_dim 192 with head_dim_v 128 (MLA) runs
// the same 128-key stages with a 192-column S product and a 128-column output; head_dim 256
// splits every tile into two 64-key stages (CM_WS_KEY_STEP), each loaded, scored and
// multiplied on its own with the half of the tile's visibility bits it covers, since two
// stages of 128 keys x 256 columns of K and V beside the 128 x 256 Q tile exceed shared
// memory (a 64 x 256 fp32 output per consumer then leaves room for 64-key scores only).
//
// Paged K and V (CM_PAGED = 1, serving's prefill-chunk path): the key space is cm_serve's
// virtual one, every sequence of a step padded to whole 128-key blocks, and key block n is
// loaded from the paged cache (tm_k and tm_v describe [num_pages, num_kv_heads, page_size,
// head_dim]) in boxes of p.page_rows rows, one per page or one per 128 keys of a longer page,
// each box's page read from the block table. A sequence's last block loads only the boxes
// holding its keys; its V rows past them, read from a page's unused slots or left from an
// earlier tile, may hold any bits (NaN included), and 0 x NaN would reach the output through
// P V, so each consumer zeroes them before its P V product. Their K rows need no care: those
// keys are never visible, so the block is partial and its bits select -inf over any score.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16 (1 = bf16, 0 = fp16), CM_HEAD_DIM (64, 128,
// 192 or 256: Q and K columns), CM_HEAD_DIM_V (V and output columns: CM_HEAD_DIM, or 128 at
// 192), CM_WS_KEY_STEP (keys per stage: 128, or 64 at head_dim 256), CM_DYNAMIC_SMEM_BYTES
// (the launch's dynamic shared memory, checked against the layout), CM_SCORE (1: apply the
// score terms of CmScoreParams, score.cuh), CM_PAGED (1: K and V from a paged cache).
#include "fwd_common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#if !defined(CM_HEAD_DIM) || !defined(CM_HEAD_DIM_V) || !defined(CM_WS_KEY_STEP)
#error "CM_HEAD_DIM, CM_HEAD_DIM_V and CM_WS_KEY_STEP must be defined"
#endif
#ifndef CM_PAGED
#define CM_PAGED 0
#endif

#define BLOCK_M CM_BLOCK_M
#define BLOCK_N 128
// One consumer warpgroup per 64 query rows, behind the producer warpgroup.
#define NUM_CONSUMERS (BLOCK_M / 64)
#define NUM_THREADS (128 * (1 + NUM_CONSUMERS))
#define STAGES CM_STAGES
#define HEAD_DIM CM_HEAD_DIM
#define HEAD_DIM_V CM_HEAD_DIM_V
#define KEY_STEP CM_WS_KEY_STEP
// Pipeline steps (stages' worth of keys) per descriptor tile.
#define STEPS (BLOCK_N / KEY_STEP)
// Bytes of the Q tile and of one stage of K and of V, multiples of 1024, so every tile and
// column atom stays swizzle-atom aligned.
#define Q_BYTES (BLOCK_M * HEAD_DIM * 2)
#define K_BYTES (KEY_STEP * HEAD_DIM * 2)
#define V_BYTES (KEY_STEP * HEAD_DIM_V * 2)
// Q, STAGES x (K, V), the barriers, then STAGES x the visibility bits of a partial tile's 128
// rows (16 bytes each); plus 1 KB to align the start.
#define BAR_OFFSET (Q_BYTES + STAGES * (K_BYTES + V_BYTES))
#define BITS_OFFSET (BAR_OFFSET + 256)
#define BITS_BYTES (BLOCK_M * 16)
#define SMEM_BYTES (BITS_OFFSET + STAGES * BITS_BYTES + 1024)
// Producer and consumer register budgets: 128 x 40 + 256 x 232 = 384 x 168 with two
// consumers, 128 x 32 + 384 x 160 = 512 x 128 with three (FlashAttention-3's split for its
// 192-row head_dim 64 tile). setmaxnreg moves registers inside the CTA's pool, the launch's
// threads x registers per thread (168 or 128): a split that asks for more waits forever.
#if NUM_CONSUMERS == 2
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#else
#define PRODUCER_REGS 32
#define CONSUMER_REGS 160
#endif

static_assert((HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256) && HEAD_DIM_V == HEAD_DIM ||
                  HEAD_DIM == 192 && HEAD_DIM_V == 128,
              "(head_dim, head_dim_v) must be (64, 64), (128, 128), (256, 256) or (192, 128)");
static_assert(BLOCK_M == 128 || BLOCK_M == 192 && HEAD_DIM == 64, "block_m: 128, or 192 at head_dim 64");
CM_CHECK_SHAPE(BLOCK_M, BLOCK_N, STAGES, NUM_THREADS);
static_assert(KEY_STEP == 128 || KEY_STEP == 64 && HEAD_DIM == 256, "keys per stage: 128, or 64 at head_dim 256");
// At head_dim 256 the score terms' registers beside the 64 x 256 output spill (also with a
// 240-register consumer budget); cm_kernels::WIDE_SCORE_SHAPES leaves that variant out.
static_assert(!CM_SCORE || HEAD_DIM != 256, "no score variant at head_dim 256");
static_assert(SMEM_BYTES == CM_DYNAMIC_SMEM_BYTES, "dynamic shared memory must match cm_kernels");
// The pool: one CTA per SM, each thread at most the file's share rounded down to 8 registers.
static_assert(128 * PRODUCER_REGS + 128 * NUM_CONSUMERS * CONSUMER_REGS <= NUM_THREADS * ((65536 / NUM_THREADS) & ~7),
              "the register split must fit the CTA's pool");
static_assert(!CM_PAGED || (KEY_STEP == 128 && !CM_SCORE && NUM_CONSUMERS == 2),
              "the paged forward: 128x128 tiles of one key step, no score terms");

// Barriers, 8 bytes each, after the tiles.
#define BAR_Q 0
#define BAR_Q_EMPTY 1
#define BAR_K_FULL(s) (2 + (s))
#define BAR_V_FULL(s) (2 + STAGES + (s))
#define BAR_K_EMPTY(s) (2 + 2 * STAGES + (s))
#define BAR_V_EMPTY(s) (2 + 3 * STAGES + (s))
#define BAR_ITEM_FULL(k) (2 + 4 * STAGES + (k))
#define BAR_ITEM_EMPTY(k) (4 + 4 * STAGES + (k))
#define NUM_BARS (6 + 4 * STAGES)
// The two item slots (a WsItem each, 32 bytes) follow the barriers.
#define ITEM_SLOTS_OFFSET (NUM_BARS * 8)
static_assert(ITEM_SLOTS_OFFSET % 16 == 0 && ITEM_SLOTS_OFFSET + 64 <= 256, "barrier area");

// Consumer warps that arrive on an "empty" barrier once their warpgroup's wgmma has read a slot.
#define CONSUMER_WARPS (4 * NUM_CONSUMERS)

// One work item: a query block of one (head, batch) and its key tiles, partial first, from
// that (batch, head)'s mask. The producer decodes it once and hands it to the consumers whole
// through shared memory.
struct WsItem {
    u32 head, batch, row0, p_begin, num_partial, f_begin, num_tiles;
    u32 valid;  // 0: no work is left
};

__device__ __forceinline__ WsItem ws_item(const CmFwdParams& p, u32 item) {
    WsItem w;
    // Groups of ws_head_group (batch, head) pairs one after the other; inside a group, rank
    // by rank (each pair's heaviest query block first) across its pairs.
    const u32 group_items = p.ws_head_group * p.num_m_blocks;
    const u32 group = item / group_items;
    const u32 first_pair = group * p.ws_head_group;
    const u32 pairs = min(p.ws_head_group, p.num_heads * p.batch - first_pair);
    const u32 in_group = item - group * group_items;
    const u32 rank = in_group / pairs;
    const u32 head_batch = first_pair + (in_group - rank * pairs);
    w.head = head_batch % p.num_heads;
    w.batch = head_batch / p.num_heads;
    const CmFwdLists lists = cm_fwd_lists(p, w.batch, w.head);
    const u32 m_block = lists.m_block_order[rank];
    w.row0 = m_block * BLOCK_M;
    w.p_begin = lists.kv_offsets[m_block];
    w.num_partial = lists.kv_offsets[m_block + 1] - w.p_begin;
    w.f_begin = lists.full_kv_offsets[m_block];
    w.num_tiles = w.num_partial + (lists.full_kv_offsets[m_block + 1] - w.f_begin);
    w.valid = 1;
    return w;
}

__device__ __forceinline__ u32 ws_n_block(const CmFwdParams& p, const WsItem& w, u32 it) {
    return it < w.num_partial ? p.kv_indices[w.p_begin + it] : p.full_kv_indices[w.f_begin + it - w.num_partial];
}

#if CM_PAGED
// Issues the TMA loads of key block `blk` (cm_serve's (seq, first_key, valid_keys)) of a paged
// cache into the `atoms` column atoms at `dst` (each KEY_STEP x 64 columns), completing on
// `bar`: the boxes of p.page_rows rows that hold the block's valid keys, each from the page
// the block table names. The block's entry and the table are device data the host does not
// re-read, so the sequence, the table column and the valid keys are clamped into range; a
// page number outside the cache reads as zeros (TMA's bounds). Returns the bytes it loads.
__device__ __forceinline__ u32 cm_valid_keys(int4 blk) { return (u32)max(0, min(blk.z, BLOCK_N)); }

__device__ __forceinline__ u32 cm_load_paged_block(const CmFwdParams& p, const CmTensorMap* map, u32 dst, u32 bar,
                                                   int4 blk, u32 kv_head, int atoms, bool issue) {
    // page_rows is a power of two (min(page_size, 128)): a shift, not a division, which the
    // producer's 40 registers cannot hold beside its loop.
    const u32 boxes = (cm_valid_keys(blk) + p.page_rows - 1) >> (31 - __clz(p.page_rows));
    if (issue) {
        const int* table = p.block_table + (i64)min((u32)blk.x, p.table_rows - 1) * p.block_table_stride;
        const u32 page_mask = (1u << p.page_shift) - 1;
        for (u32 c = 0; c < boxes; ++c) {
            const u32 pos = (u32)blk.y + c * p.page_rows;
            const int page = __ldg(table + min(pos >> p.page_shift, p.table_cols - 1));
            for (int a = 0; a < atoms; ++a) {
                cm_tma_load4(dst + a * KEY_STEP * 128 + c * p.page_rows * 128, map, bar, a * 64, (int)(pos & page_mask),
                             (int)kv_head, page);
            }
        }
    }
    return boxes * p.page_rows * 128 * atoms;
}

// Zeroes rows valid .. KEY_STEP of a V stage (every column atom) from the 128 threads of one
// consumer warpgroup, then makes the stores visible to the warpgroup's wgmma (async proxy)
// before any of its warps issues one. A 128B-swizzled row stays within its own 128 bytes, so
// whole rows are zeroed without the swizzle.
__device__ __forceinline__ void cm_zero_v_rows(u32 sV, u32 valid, int warpgroup) {
    const u32 tid = threadIdx.x % 128;
    const u32 chunks = (KEY_STEP - valid) * 8;
#pragma unroll
    for (int a = 0; a < HEAD_DIM_V / 64; ++a) {
        const u32 atom = sV + a * KEY_STEP * 128 + valid * 128;
        for (u32 i = tid; i < chunks; i += 128) {
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(atom + i * 16), "r"(0u) : "memory");
        }
    }
    cm_fence_proxy_async();
    if (warpgroup == 1) {
        asm volatile("bar.sync 1, 128;" ::: "memory");
    } else {
        asm volatile("bar.sync 2, 128;" ::: "memory");
    }
}
#endif

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
    cm_fwd_ws(const __grid_constant__ CmFwdParams p, const __grid_constant__ CmTensorMap tm_q,
              const __grid_constant__ CmTensorMap tm_k, const __grid_constant__ CmTensorMap tm_v) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (cm_smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base;
    const u32 sK0 = base + Q_BYTES;
    const u32 sV0 = sK0 + STAGES * K_BYTES;
    const u32 bars = base + BAR_OFFSET;
    auto bar = [&](int i) -> u32 { return bars + 8 * i; };
    const u32 item_slots = bars + ITEM_SLOTS_OFFSET;
    const u32 num_items = p.num_m_blocks * p.num_heads * p.batch;

    if (threadIdx.x == 0) {
        cm_mbar_init(bar(BAR_Q), 1);
        cm_mbar_init(bar(BAR_Q_EMPTY), CONSUMER_WARPS);
        cm_mbar_init(bar(BAR_ITEM_FULL(0)), 1);
        cm_mbar_init(bar(BAR_ITEM_FULL(1)), 1);
        cm_mbar_init(bar(BAR_ITEM_EMPTY(0)), CONSUMER_WARPS);
        cm_mbar_init(bar(BAR_ITEM_EMPTY(1)), CONSUMER_WARPS);
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
        if (threadIdx.x == 0) {
            cm_tma_prefetch_map(&tm_q);
            cm_tma_prefetch_map(&tm_k);
            cm_tma_prefetch_map(&tm_v);
            u32 tile_no = 0;  // key tiles loaded so far, over all items: the ring position
            u32 q_no = 0;     // Q blocks loaded so far
            u32 item = blockIdx.x;
            for (u32 k = 0;; ++k) {
                const u32 slot = k & 1;
                WsItem w = {};
                if (item < num_items) w = ws_item(p, item);
                cm_mbar_wait(bar(BAR_ITEM_EMPTY(slot)), ((k >> 1) & 1) ^ 1);
                const u32 dst = item_slots + 32 * slot;
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(w.head), "r"(w.batch),
                             "r"(w.row0), "r"(w.p_begin)
                             : "memory");
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst + 16), "r"(w.num_partial),
                             "r"(w.f_begin), "r"(w.num_tiles), "r"(w.valid)
                             : "memory");
                cm_mbar_arrive(bar(BAR_ITEM_FULL(slot)));
                if (!w.valid) break;
                item = gridDim.x + atomicAdd(p.scheduler, 1u);
                if (w.num_tiles == 0) continue;
                const u32 kv_head = w.head / p.heads_per_kv_head;
                cm_mbar_wait(bar(BAR_Q_EMPTY), (q_no & 1) ^ 1);
                cm_mbar_arrive_expect_tx(bar(BAR_Q), Q_BYTES);
#pragma unroll
                for (int a = 0; a < HEAD_DIM / 64; ++a) {
                    cm_tma_load4(sQ + a * BLOCK_M * 128, &tm_q, bar(BAR_Q), a * 64, w.row0, w.head, w.batch);
                }
                ++q_no;
                for (u32 it = 0; it < w.num_tiles * STEPS; ++it, ++tile_no) {
                    const u32 tile = it / STEPS;
                    const u32 s = tile_no % STAGES;
                    const u32 phase = (tile_no / STAGES) & 1;
                    const int key0 = (int)(ws_n_block(p, w, tile) * BLOCK_N + (it % STEPS) * KEY_STEP);
                    const u32 sK = sK0 + s * K_BYTES;
                    const u32 sV = sV0 + s * V_BYTES;
                    // A partial tile's row bits travel with its K tile (same slot, same barrier),
                    // all 128 keys' of them with each of its steps.
                    const bool partial = tile < w.num_partial;
                    cm_mbar_wait(bar(BAR_K_EMPTY(s)), phase ^ 1);
#if CM_PAGED
                    const int4 blk = p.key_blocks[key0 / BLOCK_N];
                    const u32 k_bytes = cm_load_paged_block(p, &tm_k, sK, 0, blk, kv_head, HEAD_DIM / 64, false);
                    cm_mbar_arrive_expect_tx(bar(BAR_K_FULL(s)), k_bytes + (partial ? BITS_BYTES : 0));
                    cm_load_paged_block(p, &tm_k, sK, bar(BAR_K_FULL(s)), blk, kv_head, HEAD_DIM / 64, true);
#else
                    cm_mbar_arrive_expect_tx(bar(BAR_K_FULL(s)), K_BYTES + (partial ? BITS_BYTES : 0));
#pragma unroll
                    for (int a = 0; a < HEAD_DIM / 64; ++a) {
                        cm_tma_load4(sK + a * KEY_STEP * 128, &tm_k, bar(BAR_K_FULL(s)), a * 64, key0, kv_head,
                                     w.batch);
                    }
#endif
                    if (partial) {
                        cm_bulk_load(base + BITS_OFFSET + s * BITS_BYTES,
                                     p.partial_row_mask + (u64)(w.p_begin + tile) * BLOCK_M * 4, BITS_BYTES,
                                     bar(BAR_K_FULL(s)));
                    }
                    cm_mbar_wait(bar(BAR_V_EMPTY(s)), phase ^ 1);
#if CM_PAGED
                    cm_mbar_arrive_expect_tx(bar(BAR_V_FULL(s)), k_bytes / HEAD_DIM * HEAD_DIM_V);
                    cm_load_paged_block(p, &tm_v, sV, bar(BAR_V_FULL(s)), blk, kv_head, HEAD_DIM_V / 64, true);
#else
                    cm_mbar_arrive_expect_tx(bar(BAR_V_FULL(s)), V_BYTES);
#pragma unroll
                    for (int a = 0; a < HEAD_DIM_V / 64; ++a) {
                        cm_tma_load4(sV + a * KEY_STEP * 128, &tm_v, bar(BAR_V_FULL(s)), a * 64, key0, kv_head,
                                     w.batch);
                    }
#endif
                }
            }
            // Every CTA has taken its last number once all have counted themselves here, so
            // the last one can rearm the counter for the next launch on the stream.
            if (atomicAdd(p.scheduler + 1, 1u) == gridDim.x - 1) {
                atomicExch(p.scheduler, 0u);
                atomicExch(p.scheduler + 1, 0u);
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

    float sc[KEY_STEP / 8][4];
#pragma unroll
    for (int j = 0; j < KEY_STEP / 8; ++j) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
    }
    u32 pa[KEY_STEP / 16][4];
    float acc_o[HEAD_DIM_V / 8][4];
    float row_max[2], row_sum[2], alpha[2];
    u32 bits[2][KEY_STEP / 32];
    u32 tile_no = 0;
    u32 q_no = 0;

    auto release = [&](int which) {
        __syncwarp();
        if (lane == 0) cm_mbar_arrive(bar(which));
    };
    for (u32 k = 0;; ++k) {
        const u32 slot = k & 1;
        cm_mbar_wait(bar(BAR_ITEM_FULL(slot)), (k >> 1) & 1);
        WsItem w;
        const u32 src = item_slots + 32 * slot;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w.head), "=r"(w.batch), "=r"(w.row0), "=r"(w.p_begin)
                     : "r"(src)
                     : "memory");
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w.num_partial), "=r"(w.f_begin), "=r"(w.num_tiles), "=r"(w.valid)
                     : "r"(src + 16)
                     : "memory");
        release(BAR_ITEM_EMPTY(slot));
        if (!w.valid) break;
#pragma unroll
        for (int j = 0; j < HEAD_DIM_V / 8; ++j) {
            acc_o[j][0] = acc_o[j][1] = acc_o[j][2] = acc_o[j][3] = 0.f;
        }
        row_max[0] = row_max[1] = cm_neg_inf();
#if CM_SCORE
        {
            float ref;
            if (cm_softcap_fixed_ref(p.score, ref)) row_max[0] = row_max[1] = ref;
        }
#endif
        row_sum[0] = row_sum[1] = 0.f;

        // S = Q K^T of the item's step `it` (ring slot `slot`) into sc, issued (not waited
        // for). The Q rows of this consumer are a 64-row slice of the 128-row Q tile: same
        // column atoms (stride BLOCK_M * 128), starting 64 rows in.
        auto issue_s = [&](u32 slot) {
            const u32 s = slot % STAGES;
            const u32 sK = sK0 + s * K_BYTES;
            cm_mbar_wait(bar(BAR_K_FULL(s)), (slot / STAGES) & 1);
            // Q's descriptors are formed here for every step: hoisted out of the item loop,
            // they would be held across it, and the score variant spills.
            const u32 sQt = cm_opaque(sQ_rows);
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                const u64 a = cm_wgmma_desc(sQt + (ks >> 2) * BLOCK_M * 128 + (ks & 3) * 32, 16, 1024);
#if KEY_STEP == 128
                cm_wgmma_n128_ss(sc, a, cm_desc_k_major(sK, KEY_STEP, ks), ks > 0);
#else
                cm_wgmma_n64_ss(sc, a, cm_desc_k_major(sK, KEY_STEP, ks), ks > 0);
#endif
            }
            cm_wgmma_commit();
        };
        // O += P V of ring slot `slot`, issued (not waited for).
#if CM_PAGED
        // Valid keys of the key block whose scores were issued last, and of the one whose
        // P V is issued next.
        u32 s_valid = KEY_STEP, pv_valid = KEY_STEP;
#endif
        auto issue_pv = [&](u32 slot) {
            const u32 s = slot % STAGES;
            const u32 sV = sV0 + s * V_BYTES;
            cm_mbar_wait(bar(BAR_V_FULL(s)), (slot / STAGES) & 1);
#if CM_PAGED
            if (pv_valid < KEY_STEP) cm_zero_v_rows(sV, pv_valid, warpgroup);
#endif
#pragma unroll
            for (int kk = 0; kk < KEY_STEP / 16; ++kk) {
                cm_wgmma_rs<1>(acc_o, pa[kk], cm_desc_mn_major(sV, KEY_STEP, kk), 1);
            }
            cm_wgmma_commit();
        };
        // Step `it`'s first key, read before its scores are issued (and, with score terms,
        // the distance table's view of the tile, whose loads then overlap the product).
        u32 key0 = 0;
#if CM_SCORE
        const bool modifies = cm_score_modifies_logits(p.score);
        CmDistTile dist;
#endif
        auto load_bits = [&](u32 it) {
            key0 = ws_n_block(p, w, it / STEPS) * BLOCK_N + (it % STEPS) * KEY_STEP;
#if CM_PAGED
            s_valid = cm_valid_keys(p.key_blocks[key0 / BLOCK_N]);
#endif
#if CM_SCORE
            dist = cm_dist_tile<KEY_STEP / 8, false>(p.score, w.head, p.q_len, p.kv_len, w.row0 + warp * 16 + g,
                                                    key0 + 2 * t);
#endif
        };
        // When step `it` (ring slot `slot`) is in a partial tile, the visibility bits of this
        // thread's rows for the step's keys, which arrived with its K: read once its scores
        // are done, before the slot is released.
        auto read_bits = [&](u32 it, u32 slot) {
            if (it / STEPS < w.num_partial) {
                const u32 tile_bits = base + BITS_OFFSET + (slot % STAGES) * BITS_BYTES;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 row_bits = tile_bits + (warp * 16 + g + h * 8) * 16;
#if KEY_STEP == 128
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(bits[h][0]), "=r"(bits[h][1]), "=r"(bits[h][2]), "=r"(bits[h][3])
                                 : "r"(row_bits)
                                 : "memory");
#else
                    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                                 : "=r"(bits[h][0]), "=r"(bits[h][1])
                                 : "r"(row_bits + (it % STEPS) * (KEY_STEP / 8))
                                 : "memory");
#endif
                }
            }
        };
        // Masks and exponentiates tile `it`'s scores (sc), leaving the output's rescale in alpha;
        // a positive scale (the usual case; a uniform branch) folds into the exponent.
        auto softmax = [&](u32 it) {
#if CM_SCORE
            // A softcap alone exponentiates against a fixed reference (cm_softcap_fixed_ref),
            // which row_max holds from the item's start. Other terms that change the logits
            // form each one explicitly (softcap, biases, in the log2 domain), then mask; the
            // folded step then runs at scale 1, keeping its conditional rescaling. Sinks alone
            // take the plain path (they act at the end).
            float fixed_ref;
            if (cm_softcap_fixed_ref(p.score, fixed_ref)) {
                const float scale = p.scale_log2 / CM_LOG2E;
                if (it / STEPS < w.num_partial || key0 + KEY_STEP > p.kv_len) {
                    cm_mask_bits(sc, p, it / STEPS < w.num_partial, bits, key0, t);
                    cm_softcap_probs<KEY_STEP / 8, true>(sc, scale, p.score, fixed_ref);
                } else {
                    cm_softcap_probs<KEY_STEP / 8, false>(sc, scale, p.score, fixed_ref);
                }
                cm_add_row_sums(sc, row_sum);
                alpha[0] = alpha[1] = 1.f;
                return;
            }
            if (modifies) {
                CmDcap<KEY_STEP / 8> no_dcap;
                cm_score_logits<KEY_STEP / 8, false, false>(sc, no_dcap, p.score, dist, p.scale_log2 / CM_LOG2E,
                                                           w.head, p.q_len, p.kv_len, w.row0 + warp * 16 + g,
                                                           key0 + 2 * t);
                cm_mask_bits(sc, p, it / STEPS < w.num_partial, bits, key0, t);
                cm_softmax_step_folded(sc, 1.f, row_max, row_sum, alpha);
                return;
            }
#endif
            if (p.scale_log2 > 0.f) {
                cm_mask_bits(sc, p, it / STEPS < w.num_partial, bits, key0, t);
                cm_softmax_step_folded(sc, p.scale_log2, row_max, row_sum, alpha);
            } else {
                cm_scale_and_mask_bits(sc, p, it / STEPS < w.num_partial, bits, key0, t);
                cm_softmax_step(sc, row_max, row_sum, alpha);
            }
        };
        auto pack_p = [&]() {
#pragma unroll
            for (int kk = 0; kk < KEY_STEP / 16; ++kk) cm_p_fragment(sc, kk, pa[kk]);
        };

        // FlashAttention-3's intra-warpgroup overlap: while the tensor cores compute S of
        // tile it and O += P V of tile it - 1, this warpgroup waits only for S, then masks and
        // exponentiates it; the output is rescaled once the P V product has drained. Q is
        // handed back to the producer as soon as the item's last S has been computed.
        const u32 n = w.num_tiles * STEPS;
        if (n > 0) {
            load_bits(0);
            cm_mbar_wait(bar(BAR_Q), q_no & 1);
            ++q_no;
            cm_wgmma_fence();
            issue_s(tile_no);
            cm_wgmma_wait<0>();
            cm_fence_acc(sc);
            read_bits(0, tile_no);
            release(BAR_K_EMPTY(tile_no % STAGES));
            if (n == 1) release(BAR_Q_EMPTY);
            softmax(0);
            pack_p();
#if CM_PAGED
            pv_valid = s_valid;
#endif
        }
        for (u32 it = 1; it < n; ++it) {
            load_bits(it);
            cm_fence_acc(acc_o);
            cm_wgmma_fence();
            issue_s(tile_no + it);
            issue_pv(tile_no + it - 1);
            cm_wgmma_wait<1>();
            cm_fence_acc(sc);
            read_bits(it, tile_no + it);
            release(BAR_K_EMPTY((tile_no + it) % STAGES));
            if (it + 1 == n) release(BAR_Q_EMPTY);
            softmax(it);
            cm_wgmma_wait<0>();
            cm_fence_acc(acc_o);
            cm_fence_frag(pa);
            release(BAR_V_EMPTY((tile_no + it - 1) % STAGES));
            cm_rescale_if_needed(acc_o, alpha);
            pack_p();
#if CM_PAGED
            pv_valid = s_valid;
#endif
        }
        if (n > 0) {
            cm_fence_acc(acc_o);
            cm_wgmma_fence();
            issue_pv(tile_no + n - 1);
            cm_wgmma_wait<0>();
            cm_fence_acc(acc_o);
            cm_fence_frag(pa);
            release(BAR_V_EMPTY((tile_no + n - 1) % STAGES));
        }
        tile_no += n;

        cm_store_output(p, acc_o, row_max, row_sum, w.batch, w.head, w.row0, warp, g, t);
    }
}
