// Serving attention: the new query rows of a step (decode tokens, draft-tree nodes, short
// prefill chunks) of a batch of sequences against a paged KV cache, each row's visible keys
// given as intervals by the step's plan (cm_serve). Decode is bound by reading K and V, so
// the kernel is built to stream the cache once per kv head:
//   - GQA packing: one CTA takes the query rows of ALL query heads of one kv head, packed as
//     (row, head of the group) pairs, 64 per CTA, so K and V are read once per kv head, not
//     once per query head;
//   - split-KV: grid.z splits each CTA's key range (the hull of its rows' intervals) into
//     num_splits parts, each written as a partial output with its lse, merged by
//     cm_decode_merge (FlashDecoding), so that a batch too small to fill the GPU still does;
//   - pages: each 64-key tile is gathered row by row through the block table, one bulk copy
//     (cp.async.bulk) per key row, into a three-stage ring of mbarriers (K and V of tiles
//     i + 1 and i + 2 land during the products of tile i).
// Each warp owns 16 packed rows and runs mma.sync (m16n8k16); warps with no rows only help
// load. Visibility is per element from the row's intervals (64-bit words per row and tile).
//
// Memory safety does not depend on the plan's arrays being consistent: rows are clamped to
// total_q, interval indices to num_intervals, pages read only inside [0, num_pages) and
// positions only below min(kv_len, max_pages_per_seq * page_size); a key outside those is
// never visible and its slot is zero-filled.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16, CM_HEAD_DIM (64 | 128),
// CM_DYNAMIC_SMEM_BYTES (the ring's size, checked below).
#include "fwd_common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

#ifndef CM_HEAD_DIM
#error "CM_HEAD_DIM must be defined (64 or 128)"
#endif

#define BLOCK_M 64
#define BLOCK_N 64
#define NUM_THREADS 128
#define HEAD_DIM CM_HEAD_DIM
#define PITCH (HEAD_DIM + 8)
// Three stages: two CTAs per SM (registers allow no more) keep four tiles of K and V in
// flight, which a bandwidth-bound kernel needs more than a third CTA.
#define STAGES 3
#define STAGE_ELEMS (2 * BLOCK_N * PITCH)

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");
CM_CHECK_SHAPE(BLOCK_M, BLOCK_N, STAGES, NUM_THREADS);
// cm_decode_merge has no dynamic shared memory (and no define).
#ifdef CM_DYNAMIC_SMEM_BYTES
static_assert(CM_DYNAMIC_SMEM_BYTES == STAGES * STAGE_ELEMS * 2, "cm_kernels::Variant::dynamic_shared_bytes");
#endif
#define CM_INT_MAX 0x7fffffff

// Must match cm_cuda::decode::DecodeParams (#[repr(C)], 8-byte fields first, 240 bytes).
// Strides in elements. Index base 0; intervals are half-open [start, end) key positions of
// the row's own sequence.
struct CmDecodeParams {
    const u16* q;            // [total_q, num_heads, head_dim]
    const u16* k_cache;      // [num_pages, page_size, num_kv_heads, head_dim]
    const u16* v_cache;      // [num_pages, page_size, num_kv_heads, head_dim]
    u16* o;                  // [total_q, num_heads, head_dim]
    float* lse;              // [total_q, num_heads] natural log, head stride 1; null: not wanted
    float* partial_o;        // [num_splits, total_q, num_heads, head_dim] when num_splits > 1
    float* partial_lse;      // [num_splits, total_q, num_heads] natural log
    const int* block_table;  // [num_seqs, max_pages_per_seq]
    const int* cu_q;         // [num_seqs + 1]: rows of sequence s are cu_q[s] .. cu_q[s + 1]
    const int* kv_len;       // [num_seqs]: keys of sequence s, the new rows' keys included
    const int* row_ptr;      // [total_q + 1]: row r's intervals are row_ptr[r] .. row_ptr[r + 1]
    const int* intervals;    // [num_intervals, 2] (start, end)
    i64 q_stride_row, q_stride_head;
    i64 o_stride_row, o_stride_head;
    i64 k_stride_page, k_stride_slot, k_stride_head;
    i64 v_stride_page, v_stride_slot, v_stride_head;
    i64 block_table_stride;
    i64 lse_stride_row;
    u32 num_seqs, total_q, num_heads, heads_per_kv_head;
    u32 page_size, num_pages, max_pages_per_seq, num_splits;
    u32 num_intervals;
    u32 m_tiles_per_seq;  // grid.x = num_seqs * m_tiles_per_seq; a CTA also takes m_tile + m_tiles_per_seq, ...
    float scale_log2;     // softmax_scale * log2(e)
    u32 page_shift;       // log2(page_size) for a power of two (a shift instead of a division), else 32
};

static_assert(sizeof(CmDecodeParams) == 240, "must match cm_cuda::decode::DecodeParams");

// Bits [lo, hi) of a 64-bit word, 0 <= lo <= hi <= 64.
__device__ __forceinline__ u64 cm_bit_range(int lo, int hi) {
    if (lo >= hi) return 0ull;
    const u64 upto = hi >= 64 ? ~0ull : ((1ull << hi) - 1ull);
    return upto & ~((1ull << lo) - 1ull);
}

// Gathers the keys [key0, key0 + 64) of one kv head into a stage of the ring: thread t takes
// key row t % 64 of K (t < 64) or of V, one bulk copy of its head_dim x 2 bytes completing on
// the stage's barrier (bulk copies move a row in one request, where 16-byte cp.async moves it
// in head_dim / 8); a position at or past `limit`, or whose page lies outside the cache, is
// zero-filled by plain stores instead. Every thread arrives once.
__device__ __forceinline__ void cm_load_kv_tile(u16* stage, u32 bar, const CmDecodeParams& p, const int* table,
                                                u32 kv_head, int key0, int limit) {
    constexpr u32 ROW_BYTES = HEAD_DIM * 2;
    const int r = threadIdx.x % BLOCK_N;
    const bool is_v = threadIdx.x >= BLOCK_N;
    const int pos = key0 + r;
    bool ok = pos < limit;
    int page = 0;
    u32 slot = 0;
    if (ok) {
        const u32 up = (u32)pos;
        const bool pow2 = p.page_shift < 32;
        page = __ldg(table + (pow2 ? up >> p.page_shift : up / p.page_size));
        slot = pow2 ? up & (p.page_size - 1) : up % p.page_size;
        ok = page >= 0 && (u32)page < p.num_pages;
    }
    u16* dst = stage + ((is_v ? BLOCK_N : 0) + r) * PITCH;
    if (ok) {
        const u16* src = is_v ? p.v_cache + (i64)page * p.v_stride_page + (i64)slot * p.v_stride_slot +
                                    (i64)kv_head * p.v_stride_head
                              : p.k_cache + (i64)page * p.k_stride_page + (i64)slot * p.k_stride_slot +
                                    (i64)kv_head * p.k_stride_head;
        // The stage was last read through ldmatrix (the generic proxy); the bulk copy writes it
        // through the async proxy.
        cm_fence_proxy_async();
        cm_mbar_arrive_expect_tx(bar, ROW_BYTES);
        cm_bulk_load(cm_smem_addr(dst), src, ROW_BYTES, bar);
    } else {
        const u32 d = cm_smem_addr(dst);
#pragma unroll
        for (int c = 0; c < HEAD_DIM; c += 8) {
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(d + c * 2), "r"(0u) : "memory");
        }
        cm_mbar_arrive(bar);
    }
}

// One warp's share of a tile: its 16 packed rows against keys [key_off, key_off + KEYS) of
// the tile (bits: the rows' visible keys of the whole tile), online softmax and P V.
template <int KEYS>
__device__ __forceinline__ void cm_decode_tile(const u32 (&qf)[HEAD_DIM / 16][4], float (&acc_o)[HEAD_DIM / 8][4],
                                               float (&row_max)[2], float (&row_sum)[2], const u16* sK,
                                               const u16* sV, int key_off, const u64 (&bits)[2], float scale_log2,
                                               int lane) {
    constexpr int NB = KEYS / 8;
    const int t = lane & 3;
    float s[NB][4];
#pragma unroll
    for (int j = 0; j < NB; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    const u32 kbase = cm_smem_addr(sK + key_off * PITCH);
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
        for (int jp = 0; jp < KEYS / 16; ++jp) {
            const int r = jp * 16 + (lane & 7) + ((lane >> 4) << 3);
            const int c = ks * 16 + ((lane >> 3) & 1) * 8;
            u32 b0, b1, b2, b3;
            cm_ldmatrix_x4(kbase + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
            cm_mma16816(s[2 * jp], qf[ks], b0, b1);
            cm_mma16816(s[2 * jp + 1], qf[ks], b2, b3);
        }
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = key_off + 8 * j + 2 * t + (e & 1);
            const bool vis = (bits[e >> 1] >> col) & 1ull;
            s[j][e] = vis ? s[j][e] * scale_log2 : cm_neg_inf();
        }
    }
    cm_online_softmax(s, row_max, row_sum, acc_o);
    const u32 vbase = cm_smem_addr(sV + key_off * PITCH);
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
        u32 a[4];
        cm_p_fragment(s, kk, a);
#pragma unroll
        for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
            const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            const int c = dp * 16 + (lane >> 4) * 8;
            u32 b0, b1, b2, b3;
            cm_ldmatrix_x4_trans(vbase + (u32)(r * PITCH + c) * 2, b0, b1, b2, b3);
            cm_mma16816(acc_o[2 * dp], a, b0, b1);
            cm_mma16816(acc_o[2 * dp + 1], a, b2, b3);
        }
    }
}

// Floats of one thread's running state (output fragment, row max and sum) when the key groups
// of a row block are merged through shared memory.
#define STATE_FLOATS (HEAD_DIM / 8 * 4 + 4)
static_assert(NUM_THREADS * STATE_FLOATS * 4 <= STAGES * STAGE_ELEMS * 2, "the merge reuses the ring");

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 2) cm_decode(const CmDecodeParams p) {
    extern __shared__ __align__(128) u16 smem[];
    __shared__ int s_hull[2];
    // One barrier per stage of the ring: a stage is full when its 128 rows' threads arrived
    // and its bulk copies completed.
    __shared__ __align__(8) u64 s_full[STAGES];

    const u32 seq = blockIdx.x / p.m_tiles_per_seq;
    const u32 kv_head = blockIdx.y;
    const u32 split = blockIdx.z;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    if (seq >= p.num_seqs) return;
    const int row_begin = min(max(p.cu_q[seq], 0), (int)p.total_q);
    const int row_end = min(max(p.cu_q[seq + 1], row_begin), (int)p.total_q);
    const u32 group = p.heads_per_kv_head;
    const u32 packed_rows = (u32)(row_end - row_begin) * group;
    const u64 capacity = (u64)p.max_pages_per_seq * p.page_size;
    const int limit = (int)min((u64)max(p.kv_len[seq], 0), min(capacity, (u64)CM_INT_MAX));
    const int* table = p.block_table + (i64)seq * p.block_table_stride;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) cm_mbar_init(cm_smem_addr(&s_full[i]), NUM_THREADS);
        cm_mbar_init_fence();
    }
    __syncthreads();
    // Tiles issued into and consumed from the ring so far (across m_tiles): tile n uses stage
    // n % STAGES in its barrier's phase n / STAGES.
    u32 issued = 0, consumed = 0;

    for (u32 m_tile = blockIdx.x % p.m_tiles_per_seq; m_tile * BLOCK_M < packed_rows; m_tile += p.m_tiles_per_seq) {
        const u32 p0 = m_tile * BLOCK_M;
        // Warps over the tile's packed rows: `row_warps` blocks of 16 rows, and the warps left
        // over split each key tile between them (key groups), so that a decode step's few rows
        // still keep all four warps computing (each warp's keys get their own running softmax,
        // merged at the end).
        const u32 rows_here = min(packed_rows - p0, (u32)BLOCK_M);
        const int row_warps = rows_here <= 16 ? 1 : rows_here <= 32 ? 2 : 4;
        const int key_groups = 4 / row_warps;
        const int rb = warp % row_warps;
        const int kg = warp / row_warps;
        const int key_off = kg * (BLOCK_N / key_groups);
        // The packed rows (g and g + 8 of this warp's row block) this thread's fragments hold:
        // their query row and interval cursor.
        int row[2], cur[2], last[2];
        bool valid[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 pr = p0 + rb * 16 + g + 8 * h;
            valid[h] = pr < packed_rows;
            row[h] = row_begin + (int)(valid[h] ? pr / group : 0);
            cur[h] = valid[h] ? min(max(p.row_ptr[row[h]], 0), (int)p.num_intervals) : 0;
            last[h] = valid[h] ? min(max(p.row_ptr[row[h] + 1], cur[h]), (int)p.num_intervals) : 0;
        }
        const bool warp_rows = p0 + rb * 16 < packed_rows;
        // The hull [lo, hi) of the CTA's rows' intervals: the keys this CTA's splits share.
        if (threadIdx.x == 0) {
            s_hull[0] = CM_INT_MAX;
            s_hull[1] = 0;
        }
        __syncthreads();
        if (threadIdx.x < BLOCK_M && p0 + threadIdx.x < packed_rows) {
            const int r = row_begin + (int)((p0 + threadIdx.x) / group);
            const int a = min(max(p.row_ptr[r], 0), (int)p.num_intervals);
            const int b = min(max(p.row_ptr[r + 1], a), (int)p.num_intervals);
            if (a < b) {
                atomicMin(&s_hull[0], max(p.intervals[2 * a], 0));
                atomicMax(&s_hull[1], min(p.intervals[2 * (b - 1) + 1], limit));
            }
        }
        __syncthreads();
        const int lo = s_hull[0], hi = s_hull[1];
        int tile_begin = 0, tile_end = 0;
        if (lo < hi) {
            const int first = lo / BLOCK_N, count = (hi + BLOCK_N - 1) / BLOCK_N - first;
            tile_begin = first + (int)(((i64)count * split) / p.num_splits);
            tile_end = first + (int)(((i64)count * (split + 1)) / p.num_splits);
        }

        // Q of the packed rows, staged through stage 0's K buffer, into registers.
        {
            constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
            const u32 base = cm_smem_addr(smem);
#pragma unroll
            for (int i = 0; i < BLOCK_M * CHUNKS_PER_ROW / NUM_THREADS; ++i) {
                const int c = threadIdx.x + i * NUM_THREADS;
                const int r = c / CHUNKS_PER_ROW;
                const int col = (c % CHUNKS_PER_ROW) * 8;
                const u32 pr = p0 + r;
                const bool ok = pr < packed_rows;
                const u16* src = p.q + (ok ? (i64)(row_begin + pr / group) * p.q_stride_row +
                                                 (i64)(kv_head * group + pr % group) * p.q_stride_head + col
                                           : 0);
                cm_cp_async16(base + (u32)(r * PITCH + col) * 2, src, ok ? 16 : 0);
            }
            cm_cp_async_commit();
            cm_cp_async_wait<0>();
        }
        __syncthreads();
        u32 qf[HEAD_DIM / 16][4];
        {
            const u32 base = cm_smem_addr(smem);
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                const int r = rb * 16 + (lane & 15);
                const int c = ks * 16 + (lane >> 4) * 8;
                cm_ldmatrix_x4(base + (u32)(r * PITCH + c) * 2, qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3]);
            }
        }
        __syncthreads();

        float acc_o[HEAD_DIM / 8][4];
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) acc_o[j][0] = acc_o[j][1] = acc_o[j][2] = acc_o[j][3] = 0.f;
        float row_max[2] = {cm_neg_inf(), cm_neg_inf()};
        float row_sum[2] = {0.f, 0.f};

        auto issue = [&](int tile) {
            const u32 stage = issued % STAGES;
            cm_load_kv_tile(smem + stage * STAGE_ELEMS, cm_smem_addr(&s_full[stage]), p, table, kv_head,
                            tile * BLOCK_N, limit);
            ++issued;
        };
#pragma unroll
        for (int i = 0; i < STAGES - 1; ++i) {
            if (tile_begin + i < tile_end) issue(tile_begin + i);
        }
        for (int tile = tile_begin; tile < tile_end; ++tile) {
            // The stage this refills was consumed in the previous iteration, which every warp
            // left through its closing barrier.
            if (tile + STAGES - 1 < tile_end) issue(tile + STAGES - 1);
            const u32 stage = consumed % STAGES;
            cm_mbar_wait(cm_smem_addr(&s_full[stage]), (consumed / STAGES) & 1);
            ++consumed;
            const u16* sK = smem + stage * STAGE_ELEMS;
            const u16* sV = sK + BLOCK_N * PITCH;
            const int key0 = tile * BLOCK_N;
            if (warp_rows) {
                // Each fragment row's visible keys in this tile as one word, from its intervals
                // (the cursor skips those that end before the tile; tiles ascend).
                u64 bits[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    bits[h] = 0ull;
                    while (cur[h] < last[h] && p.intervals[2 * cur[h] + 1] <= key0) ++cur[h];
                    for (int c = cur[h]; c < last[h]; ++c) {
                        const int a = p.intervals[2 * c];
                        if (a >= key0 + BLOCK_N) break;
                        bits[h] |= cm_bit_range(max(a - key0, 0), min(p.intervals[2 * c + 1] - key0, BLOCK_N));
                    }
                    bits[h] &= cm_bit_range(0, min(max(limit - key0, 0), BLOCK_N));
                }
                if (key_groups == 4) {
                    cm_decode_tile<BLOCK_N / 4>(qf, acc_o, row_max, row_sum, sK, sV, key_off, bits, p.scale_log2, lane);
                } else if (key_groups == 2) {
                    cm_decode_tile<BLOCK_N / 2>(qf, acc_o, row_max, row_sum, sK, sV, key_off, bits, p.scale_log2, lane);
                } else {
                    cm_decode_tile<BLOCK_N>(qf, acc_o, row_max, row_sum, sK, sV, key_off, bits, p.scale_log2, lane);
                }
            }
            __syncthreads();  // every warp is done with this stage before it is refilled
        }

        // The key groups of a row block merge into its first warp's state (the ring is free
        // now): m = max(m_j), sum = sum_j sum_j 2^(m_j - m), out likewise.
        if (key_groups > 1) {
            float* state = reinterpret_cast<float*>(smem);
            if (kg > 0) {
                float* mine = state + (warp * 32 + lane) * STATE_FLOATS;
#pragma unroll
                for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) mine[j * 4 + e] = acc_o[j][e];
                }
                mine[HEAD_DIM / 2] = row_max[0];
                mine[HEAD_DIM / 2 + 1] = row_max[1];
                mine[HEAD_DIM / 2 + 2] = row_sum[0];
                mine[HEAD_DIM / 2 + 3] = row_sum[1];
            }
            __syncthreads();
            if (kg == 0) {
                for (int other = 1; other < key_groups; ++other) {
                    const float* theirs = state + ((rb + other * row_warps) * 32 + lane) * STATE_FLOATS;
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float m2 = theirs[HEAD_DIM / 2 + h];
                        const float m = fmaxf(row_max[h], m2);
                        if (m == cm_neg_inf()) continue;
                        const float a1 = cm_exp2(row_max[h] - m), a2 = cm_exp2(m2 - m);
                        row_sum[h] = row_sum[h] * a1 + theirs[HEAD_DIM / 2 + 2 + h] * a2;
                        row_max[h] = m;
#pragma unroll
                        for (int j = 0; j < HEAD_DIM / 8; ++j) {
                            acc_o[j][2 * h] = acc_o[j][2 * h] * a1 + theirs[j * 4 + 2 * h] * a2;
                            acc_o[j][2 * h + 1] = acc_o[j][2 * h + 1] * a1 + theirs[j * 4 + 2 * h + 1] * a2;
                        }
                    }
                }
            }
        }

        // Normalise and store (each row block's first warp): the output and lse with one
        // split, else this split's partial output (normalised by its own sum) and lse for
        // cm_decode_merge. Empty: 0 and -inf.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = row_sum[h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (!valid[h] || kg > 0) continue;
            const u32 pr = p0 + rb * 16 + g + 8 * h;
            const u32 head = kv_head * group + pr % group;
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            const float lse = sum > 0.f ? row_max[h] * 0.69314718055994531f + logf(sum) : cm_neg_inf();
            if (p.num_splits == 1) {
                u16* orow = p.o + (i64)row[h] * p.o_stride_row + (i64)head * p.o_stride_head;
#pragma unroll
                for (int j = 0; j < HEAD_DIM / 8; ++j) {
                    *reinterpret_cast<u32*>(orow + j * 8 + t * 2) =
                        cm_pack2(acc_o[j][h * 2] * inv, acc_o[j][h * 2 + 1] * inv);
                }
                if (p.lse != nullptr && t == 0) p.lse[(i64)row[h] * p.lse_stride_row + head] = lse;
            } else {
                const i64 item = ((i64)split * p.total_q + row[h]) * p.num_heads + head;
                float* orow = p.partial_o + item * HEAD_DIM;
#pragma unroll
                for (int j = 0; j < HEAD_DIM / 8; ++j) {
                    orow[j * 8 + t * 2] = acc_o[j][h * 2] * inv;
                    orow[j * 8 + t * 2 + 1] = acc_o[j][h * 2 + 1] * inv;
                }
                if (t == 0) p.partial_lse[item] = lse;
            }
        }
        __syncthreads();  // the next m_tile restages Q through stage 0
    }
}

// Merges the splits of every (row, head): lse = log(sum_j exp(lse_j)), out = sum_j
// exp(lse_j - lse) out_j; a row empty in every split gets 0 and -inf. One warp per (row,
// head), each lane HEAD_DIM / 32 columns.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) cm_decode_merge(const CmDecodeParams p) {
    const u32 item = blockIdx.x * (NUM_THREADS / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (item >= p.total_q * p.num_heads) return;
    const i64 split_stride = (i64)p.total_q * p.num_heads;
    float m = cm_neg_inf();
    for (u32 j = lane; j < p.num_splits; j += 32) m = fmaxf(m, p.partial_lse[j * split_stride + item]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    constexpr int PER_LANE = HEAD_DIM / 32;
    float acc[PER_LANE];
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) acc[c] = 0.f;
    float total = 0.f;
    if (m != cm_neg_inf()) {
        for (u32 j = 0; j < p.num_splits; ++j) {
            const float w = __expf(p.partial_lse[j * split_stride + item] - m);
            total += w;
            const float* src = p.partial_o + (j * split_stride + item) * HEAD_DIM + lane * PER_LANE;
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) acc[c] = fmaf(w, src[c], acc[c]);
        }
    }
    const u32 row = item / p.num_heads, head = item % p.num_heads;
    const float inv = total > 0.f ? 1.f / total : 0.f;
    u16* orow = p.o + (i64)row * p.o_stride_row + (i64)head * p.o_stride_head + lane * PER_LANE;
#pragma unroll
    for (int c = 0; c < PER_LANE; c += 2) {
        *reinterpret_cast<u32*>(orow + c) = cm_pack2(acc[c] * inv, acc[c + 1] * inv);
    }
    if (p.lse != nullptr && lane == 0) {
        p.lse[(i64)row * p.lse_stride_row + head] = total > 0.f ? m + logf(total) : cm_neg_inf();
    }
}
