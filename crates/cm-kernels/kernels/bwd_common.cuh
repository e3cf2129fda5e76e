// Shared definitions of the backward kernels (bwd_pre.cu, bwd_dkdv.cu, bwd_dkdv_wide.cu,
// bwd_dq.cu, bwd_post.cu): the parameter block, the 128B-swizzled shared-memory tile loader and the
// per-row key visibility of a partial tile.
//
// The backward pass, for softmax_scale c, P = softmax(c Q K^T) over each row's visible keys:
//   delta_i = sum_d dO[i, d] O[i, d] - dlse_i              (bwd_pre; dlse_i = d loss / d lse_i)
//   dS_ij   = P_ij (dO_i . V_j - delta_i)
//   dV_j    = sum_i P_ij dO_i,   dK_j = c sum_i dS_ij Q_i   (bwd_dkdv, per key block)
//   dQ_i    = c sum_j dS_ij K_j                             (bwd_dkdv with fp32 atomics + bwd_post,
//                                                           or bwd_dq, per query block)
// P is recomputed from the forward's lse: P_ij = exp2(c log2(e) s_ij - log2(e) lse_i).
#pragma once
#include "common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#if CM_SCORE
#include "score.cuh"
#endif

#if !defined(CM_HEAD_DIM) || !defined(CM_HEAD_DIM_V)
#error "CM_HEAD_DIM and CM_HEAD_DIM_V must be defined"
#endif
#ifndef CM_DTYPE_BF16
#error "CM_DTYPE_BF16 must be defined (1 = bf16, 0 = fp16)"
#endif

#define BLOCK_M 64
#define BLOCK_N 64
#define NUM_THREADS 128
// Columns of Q, K, dQ and dK (HEAD_DIM), and of V, O, dO and dV (HEAD_DIM_V).
#define HEAD_DIM CM_HEAD_DIM
#define HEAD_DIM_V CM_HEAD_DIM_V
// Bytes of one 64-row tile of Q or K (TILE_BYTES) and of dO or V (TILE_BYTES_V) in shared
// memory: HEAD_DIM / 64 (HEAD_DIM_V / 64) column atoms of [64 rows][128 bytes],
// 128B-swizzled (wgmma.cuh); multiples of 1024, so tiles placed back to back from a
// 1024-byte-aligned base stay swizzle-atom aligned.
#define TILE_BYTES (BLOCK_M * HEAD_DIM * 2)
#define TILE_BYTES_V (BLOCK_M * HEAD_DIM_V * 2)

// cm_kernels::VARIANTS: 64 and 128, and the wide shapes (cm_kernels::WIDE_SHAPES).
static_assert((HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256) && HEAD_DIM_V == HEAD_DIM ||
                  HEAD_DIM == 192 && HEAD_DIM_V == 128,
              "(head_dim, head_dim_v) must be (64, 64), (128, 128), (256, 256) or (192, 128)");
static_assert(BLOCK_M == BLOCK_N, "query and key tiles share one loader and one shape");

// Kernel parameters, passed by value. Must match cm_cuda::backward::BwdParams field for field
// (#[repr(C)], 8-byte fields first, explicit padding at the end). Tensors are
// [batch, heads, seq, head_dim] with a contiguous last dim; strides in elements.
struct CmBwdParams {
    const u16* q;     // [batch, num_heads, q_len, head_dim]
    const u16* k;     // [batch, num_kv_heads, kv_len, head_dim]
    const u16* v;     // [batch, num_kv_heads, kv_len, head_dim_v]
    const u16* o;     // forward output, [batch, num_heads, q_len, head_dim_v]
    const u16* dout;  // [batch, num_heads, q_len, head_dim_v]
    u16* dq;          // [batch, num_heads, q_len, head_dim]
    u16* dk;          // [batch, num_kv_heads, kv_len, head_dim]
    u16* dv;          // [batch, num_kv_heads, kv_len, head_dim_v]
    const float* lse;  // forward lse (natural log), [batch, num_heads, q_len], seq stride 1
    // Workspace, rows padded to q_pad = num_m_blocks * BLOCK_M so that tile loads need no bounds
    // check: dq_accum [batch, num_heads, q_pad, head_dim] fp32 (null in deterministic mode),
    // lse_log2 and delta [batch, num_heads, q_pad] fp32.
    float* dq_accum;
    float* lse_log2;
    float* delta;
    // d loss / d lse, [batch, num_heads, q_len], seq stride 1; null when the loss does not read
    // lse. d lse_i / d s_ij = P_ij, so it enters every dS_ij as delta_i - dlse_i (bwd_pre).
    const float* dlse;
    i64 q_stride_batch, q_stride_head, q_stride_row;
    i64 k_stride_batch, k_stride_head, k_stride_row;
    i64 v_stride_batch, v_stride_head, v_stride_row;
    i64 o_stride_batch, o_stride_head, o_stride_row;
    i64 do_stride_batch, do_stride_head, do_stride_row;
    i64 dq_stride_batch, dq_stride_head, dq_stride_row;
    i64 dk_stride_batch, dk_stride_head, dk_stride_row;
    i64 dv_stride_batch, dv_stride_head, dv_stride_row;
    i64 lse_stride_batch, lse_stride_head;
    i64 dlse_stride_batch, dlse_stride_head;
    // Tile descriptor at BLOCK_M x BLOCK_N (see cm_plan::TileDescriptor): the forward lists
    // per query block that bwd_dq walks.
    const u32* m_block_order;      // [num_m_blocks] query blocks, most tiles first
    const u32* kv_offsets;         // [num_m_blocks + 1]
    const u32* kv_indices;         // [num_partial]
    const u32* full_kv_offsets;    // [num_m_blocks + 1]
    const u32* full_kv_indices;    // [num_full]
    // Each partial tile's visibility, row by row (as the forward's): bit c % 32 of word c / 32
    // of a row set when key n_block * BLOCK_N + c is visible from it; rows past q_len have none.
    const u32* partial_row_mask;   // [num_partial, BLOCK_M, BLOCK_N / 32]
    // The transposed lists at 64-row query tiles x 128-key blocks (cm_cuda::BWD_TILE) that
    // bwd_dkdv walks, and the key-major visibility of each of their partial tiles: [num_partial,
    // 128 keys, 2 u32] (bit b of word w: query row q_index * 64 + 32 w + b sees the key).
    const u32* bwd_n_block_order;      // [bwd_num_n_blocks] key blocks, most tiles first
    const u32* bwd_q_offsets;          // [bwd_num_n_blocks + 1]
    const u32* bwd_q_indices;          // [num_partial]
    const u32* bwd_full_q_offsets;     // [bwd_num_n_blocks + 1]
    const u32* bwd_full_q_indices;     // [num_full]
    const u32* bwd_partial_key_mask;   // [num_partial, 128, 2]
    // Per entry of bwd_q_indices (bwd_full_q_indices): how many lower key blocks of the mask
    // visit that query tile, the entry's turn among the tile's dQ additions.
    const u32* bwd_q_ranks;            // [num_partial]
    const u32* bwd_full_q_ranks;       // [num_full]
    // The deterministic mode's dQ turns (null otherwise, and whenever bwd_dq computes dQ):
    // [0] the CTAs' start tickets, then [batch, num_heads, q_pad / 64] the count of dQ
    // additions each 64-row query tile has had (cm_dq_turn). Zeroed by bwd_pre.
    u32* dq_turns;
    // The mask of (batch, query head) at batch * mask_stride_batch + head * mask_stride_head;
    // each mask's fixed-stride arrays (block orders, offsets) follow the previous mask's, the
    // tile lists and bits are concatenated (cm_cuda::PlanArray).
    const u32* mask_index;
    u32 q_len;
    u32 kv_len;
    u32 q_pad;
    u32 num_heads;
    u32 heads_per_kv_head;  // GQA group size: query head h reads kv head h / heads_per_kv_head
    float scale_log2;       // softmax_scale * log2(e)
    float softmax_scale;
    u32 num_masks;
    u32 mask_stride_batch;  // 0 when one row of masks serves every batch
    u32 mask_stride_head;   // 0 when one mask serves every head
    u32 num_m_blocks;       // query blocks at BLOCK_M (the forward lists)
    u32 bwd_num_n_blocks;   // key blocks of the transposed lists
    // bwd_dkdv's one-dimensional grid: (batch, kv head) pairs in groups of bwd_head_group
    // (sized to the L2), inside a group key block by key block across its pairs (every
    // pair's heaviest block first); bwd_pairs = batch x num_kv_heads.
    u32 bwd_head_group;
    u32 bwd_pairs;
    CmScoreParams score;    // read by the CM_SCORE variants of bwd_dkdv and bwd_dq
};

static_assert(sizeof(CmBwdParams) == 576, "must match cm_cuda::backward::BwdParams");

__device__ __forceinline__ u32 cm_bwd_mask(const CmBwdParams& p, u32 batch, u32 head) {
    return cm_mask_of(p.mask_index, p.mask_stride_batch, p.mask_stride_head, p.num_masks, batch, head);
}

// bwd_dkdv's and bwd_dkdv_wide's named barrier of their 256 consumer threads (0 is
// __syncthreads).
__device__ __forceinline__ void cm_consumers_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }

// Named barrier ID of THREADS threads (a multiple of 32): sync waits for all of them, arrive
// counts this thread's warp without waiting (a one-way hand-off from arrivers to syncers).
template <int ID, int THREADS>
__device__ __forceinline__ void cm_named_sync() {
    asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS) : "memory");
}
template <int ID, int THREADS>
__device__ __forceinline__ void cm_named_arrive() {
    asm volatile("bar.arrive %0, %1;" ::"n"(ID), "n"(THREADS) : "memory");
}
// The same with an ID known at run time (one barrier per consumer warpgroup).
template <int THREADS>
__device__ __forceinline__ void cm_named_sync_at(u32 id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}
template <int THREADS>
__device__ __forceinline__ void cm_named_arrive_at(u32 id) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(THREADS) : "memory");
}

// The mbarriers of bwd_dkdv's and bwd_dkdv_wide's ring, 8 bytes apart from the first: K and
// V, loaded once (one producer arrival plus the bytes), then per stage of Q and dO a "full"
// (likewise) and an "empty" barrier (one arrival per consumer warp). The kernels' STAGES
// defines the layout.
#define BAR_KV 0
#define BAR_FULL(s) (1 + (s))
#define BAR_EMPTY(s) (1 + STAGES + (s))

// Initialises that ring at shared address `bar0` (one thread, before the CTA's first barrier).
__device__ __forceinline__ void cm_dkdv_ring_init(u32 bar0, int stages, u32 consumer_warps) {
    cm_mbar_init(bar0 + 8 * BAR_KV, 1);
    for (int s = 0; s < stages; ++s) {
        cm_mbar_init(bar0 + 8 * (1 + s), 1);
        cm_mbar_init(bar0 + 8 * (1 + stages + s), consumer_warps);
    }
    cm_mbar_init_fence();
}

// Work item `item` of bwd_dkdv's (and bwd_dkdv_wide's) one-dimensional grid (the CTA's
// blockIdx.x, or its start ticket): items start in order, in groups of bwd_head_group (batch,
// kv head) pairs, rank by rank inside a group, so no pair's heaviest key block waits for every
// other pair's work.
// `ranks` per pair: the key blocks, or their halves (bwd_dkdv_wide, both halves adjacent).
struct CmDkdvPair {
    u32 batch;
    u32 kv_head;
    u32 head0;  // the GQA group's first query head
    u32 rank;   // in [0, ranks)
};

__device__ __forceinline__ CmDkdvPair cm_dkdv_pair(const CmBwdParams& p, u32 ranks, u32 item) {
    const u32 group_blocks = p.bwd_head_group * ranks;
    const u32 group = item / group_blocks;
    const u32 first_pair = group * p.bwd_head_group;
    const u32 pairs = min(p.bwd_head_group, p.bwd_pairs - first_pair);
    const u32 in_group = item - group * group_blocks;
    CmDkdvPair it;
    it.rank = in_group / pairs;
    const u32 pair = first_pair + (in_group - it.rank * pairs);
    const u32 num_kv_heads = p.num_heads / p.heads_per_kv_head;
    it.kv_head = pair % num_kv_heads;
    it.batch = pair / num_kv_heads;
    it.head0 = it.kv_head * p.heads_per_kv_head;
    return it;
}

// A key block's query tiles for one query head of its GQA group, from that (batch, head)'s
// mask: partial tiles [p_begin, p_begin + num_partial) of the transposed partial list, then
// full ones from f_begin (bwd_dkdv, bwd_dkdv_wide).
struct CmDkdvHead {
    u32 head;
    u32 p_begin;
    u32 num_partial;
    u32 f_begin;
    u32 num_tiles;
};

__device__ __forceinline__ CmDkdvHead cm_dkdv_head(const CmBwdParams& p, u32 batch, u32 head, u32 n_block) {
    const u64 mask = cm_bwd_mask(p, batch, head);
    const u32* q_offsets = p.bwd_q_offsets + mask * (p.bwd_num_n_blocks + 1);
    const u32* full_q_offsets = p.bwd_full_q_offsets + mask * (p.bwd_num_n_blocks + 1);
    CmDkdvHead hd;
    hd.head = head;
    hd.p_begin = q_offsets[n_block];
    hd.num_partial = q_offsets[n_block + 1] - hd.p_begin;
    hd.f_begin = full_q_offsets[n_block];
    hd.num_tiles = hd.num_partial + (full_q_offsets[n_block + 1] - hd.f_begin);
    return hd;
}

struct CmDkdvTile {
    bool partial;
    u32 index;  // position in the transposed partial (or full) list
    u32 row0;
};

// Tile `ti` of head `hd`'s list.
__device__ __forceinline__ CmDkdvTile cm_dkdv_tile(const CmBwdParams& p, const CmDkdvHead& hd, u32 ti) {
    CmDkdvTile tl;
    tl.partial = ti < hd.num_partial;
    tl.index = tl.partial ? hd.p_begin + ti : hd.f_begin + ti - hd.num_partial;
    tl.row0 = (tl.partial ? p.bwd_q_indices[tl.index] : p.bwd_full_q_indices[tl.index]) * BLOCK_M;
    return tl;
}

// The turn counters' accesses: a GPU-scope acquire load, a release increment, and the proxy
// fence that orders the bulk reductions (async proxy) with them (generic proxy).
__device__ __forceinline__ u32 cm_ld_acquire(const u32* at) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(at) : "memory");
    return v;
}
__device__ __forceinline__ void cm_red_release_add(u32* at, u32 v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(at), "r"(v) : "memory");
}
__device__ __forceinline__ void cm_fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// The deterministic mode's turn counter of (batch, head)'s 64-row query tile at row0.
__device__ __forceinline__ u32* cm_dq_turn(const CmBwdParams& p, u32 batch, u32 head, u32 row0) {
    return p.dq_turns + 1 + ((u64)batch * p.num_heads + head) * (p.q_pad / BLOCK_M) + row0 / BLOCK_M;
}


// Float offset, inside one 64 x HEAD_DIM tile of the fast mode's dQ accumulator, of the
// m16n8 accumulator element pair block of lane `lane` of warp `warp` (a consumer warpgroup's
// warp, rows 16 warp ..) at columns 8 chunk .. 8 chunk + 7: row 16 warp + lane / 4 + 8 (e >> 1),
// column 8 chunk + 2 (lane % 4) + (e & 1) at offset + e. A warp's four elements of one chunk
// are one 16-byte vector and its 32 vectors are contiguous, so the shared-memory stores and
// the wide kernel's vector reductions are conflict-free and coalesced; bwd_post reads it back.
__device__ __forceinline__ u32 cm_dq_offset(u32 chunk, u32 warp, u32 lane) {
    return ((chunk * 4 + warp) * 32 + lane) * 4;
}

// Copies rows [row0, row0 + 64) of a [seq, COLS] matrix into the swizzled tile at shared
// address `tile`, zero-filling rows at or past `len` (zeros, never garbage that 0 * NaN could
// spread). Eight consecutive threads write the eight chunks of one atom row: distinct banks
// after the swizzle, one coalesced global row.
template <int COLS>
__device__ __forceinline__ void cm_bwd_load_tile(u32 tile, const u16* base, i64 row_stride, u32 row0, u32 len) {
    constexpr int CHUNKS_PER_ROW = COLS / 8;
    constexpr int PER_THREAD = BLOCK_M * CHUNKS_PER_ROW / NUM_THREADS;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * NUM_THREADS;
        const u32 r = c / CHUNKS_PER_ROW;
        const u32 chunk = c % CHUNKS_PER_ROW;
        const u32 row = row0 + r;
        const bool ok = row < len;
        const u16* src = base + (ok ? (i64)row * row_stride + chunk * 8 : 0);
        cm_cp_async16(tile + cm_sw128_offset(r, chunk, BLOCK_M), src, ok ? 16 : 0);
    }
}

// Copies the 64 workspace floats of rows [row0, row0 + 64) of lse_log2 and delta (padded
// rows, so always in bounds) into shared memory; threads 0..31 issue one 16-byte copy each.
__device__ __forceinline__ void cm_bwd_load_row_stats(float* s_lse, float* s_delta, const float* lse_log2,
                                                      const float* delta, u32 row0) {
    if (threadIdx.x < 32) {
        const int i = threadIdx.x & 15;
        const bool is_lse = threadIdx.x < 16;
        const float* src = (is_lse ? lse_log2 : delta) + row0 + i * 4;
        cm_cp_async16(cm_smem_addr((is_lse ? s_lse : s_delta) + i * 4), src, 16);
    }
}

// 64-bit visibility of the tile's keys key0 .. key0 + 63 from local row r of the `partial_id`-th
// partial tile (bit b: key key0 + b visible): the row's two words of p.partial_row_mask.
__device__ __forceinline__ u64 cm_bwd_row_bits(const CmBwdParams& p, u32 partial_id, u32 r) {
    static_assert(BLOCK_N == 64, "one u64 per row");
    const u32* row = p.partial_row_mask + ((u64)partial_id * BLOCK_M + r) * 2;
    return (u64)row[0] | (u64)row[1] << 32;
}

// One 16-bit element to fp32.
__device__ __forceinline__ float cm_to_float(u16 x) {
#if CM_DTYPE_BF16
    return __int_as_float((u32)x << 16);
#else
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
    return r;
#endif
}

// Stores the warp's 16 rows x HEAD_DIM accumulator (m16n8 layout: rows g and g + 8, columns
// 8 j + 2 t and + 1) scaled by `scale` to rows row0 + 16 warp + ... of a strided matrix,
// skipping rows at or past `len`.
template <int ND>
__device__ __forceinline__ void cm_bwd_store_rows(u16* base, i64 row_stride, const float (&acc)[ND][4], float scale,
                                                  u32 row0, u32 len, int warp, int g, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 row = row0 + warp * 16 + g + h * 8;
        if (row >= len) continue;
        u16* out = base + (i64)row * row_stride;
#pragma unroll
        for (int j = 0; j < ND; ++j) {
            *reinterpret_cast<u32*>(out + j * 8 + t * 2) = cm_pack2(acc[j][h * 2] * scale, acc[j][h * 2 + 1] * scale);
        }
    }
}

// The A fragment (16 rows x 16 columns, columns 16 kk ..) of an m16n8 accumulator array,
// rounded to the element type: accumulator pairs are exactly the m16n8k16 A register pairs.
template <int NB>
__device__ __forceinline__ void cm_bwd_a_fragment(const float (&s)[NB][4], int kk, u32 (&a)[4]) {
    a[0] = cm_pack2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = cm_pack2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = cm_pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = cm_pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}
