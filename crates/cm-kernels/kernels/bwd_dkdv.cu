// Backward dK / dV (and the fast mode's dQ), warp-specialised on Hopper after
// FlashAttention-3's backward: one CTA of three warpgroups per (128-key block, kv head, batch),
// key blocks heaviest first. The CTA walks the key block's 64-row query tiles from the
// transposed descriptor lists at 64 x 128 (cm_cuda::BWD_TILE: partial tiles first, then full
// tiles with no mask code; empty tiles are never visited) for every query head of the GQA
// group in turn, each head's tiles from that (batch, head)'s own mask, so dK and dV of a kv
// head are summed in registers in a fixed order: no atomics, the same bits run to run. A step
// takes Q_TILES of those tiles (cm_kernels::Variant::q_tiles_per_step: two at head_dim 64,
// whatever their rows and heads, as one 128-query step; a block with an odd count ends with
// one, its second half masked out and loaded as a copy of the first so that it holds finite
// values).
//
// Warpgroup 0 is the producer: one thread loads K and V once (TMA), then streams each query
// tile's Q and dO (TMA), its lse_log2 and delta rows and, for a partial tile, its key-major
// visibility bits (bulk copies) into a ring of STAGES stages guarded by "full" and "empty"
// mbarriers. Warpgroups 1 and 2 are consumers that own keys 0..63 and 64..127 of the block;
// per tile,
//   S^T = K Q^T, dP^T = V dO^T            SS wgmma, keys x queries (M = this warpgroup's keys)
//   P^T = exp2(S^T c log2e - lse_log2), dS^T = P^T (dP^T - delta)      in registers
//   dV += P^T dO, dK += dS^T Q             dO and Q read MN-major
// (Queries: the step's Q_ROWS.) Warp w of a consumer holds keys 16 w .. 16 w + 15 of its 64
// (the m16n8 accumulator layout).
// Without a dQ accumulator (the deterministic mode with score terms, or with query heads of
// one kv head under different masks) dV's and dK's products read P^T and dS^T from registers,
// the consumers never synchronise with each other and dQ is left to bwd_dq. With one in the
// workspace, after FlashAttention-3's and -4's order: both consumers
// write dS^T to a shared tile (two buffers, alternating by step, at one tile a step without
// score terms: DS_STAGES) and meet on a named barrier; each issues half of the tile's
// dQ = dS K (split along head_dim, or with two tiles a step each consumer one tile's; dS read
// MN-major from the dS^T tile, K read MN-major), then dK's product with dS^T from its own
// registers (DK_RS; with score terms read from its rows of the shared tile, so that no
// fragment is live beside dQ's accumulator and the score terms' registers); while dK's
// product runs it stores dQ to shared memory in the
// accumulator's fragment-ordered layout (conflict-free; bwd_post reads it back into row
// order) and hands the tile to the reducer warp (warp 1 of the producer warpgroup) on a named
// barrier. With two dS^T buffers the consumers wait for the reducer to have read the previous
// tile's dQ only there, behind the products, not before writing dS^T. The reducer adds the whole 64 x head_dim tile into the fp32 accumulator with a
// bulk asynchronous reduction per tile (cp.reduce.async.bulk .add.f32), which overlaps the next
// tile, and hands the tile back once the reduction has read it: the consumers never wait for
// each other's dQ, only (a tile later) for that read. In both modes each consumer waits for
// its dK product at the end of the tile, which releases the stage. In the fast mode the order
// of the dQ additions between CTAs varies run to run; in the deterministic mode (dq_turns set)
// each query tile's additions take turns in ascending key-block order (dkdv_for_each_ordered_step,
// the reducer's turn counters), so dQ repeats its bits, after FlashAttention-3's deterministic
// backward. The modes are separate instantiations of dkdv_consumers.
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16, CM_HEAD_DIM = CM_HEAD_DIM_V (64|128; the
// wider shapes are bwd_dkdv_wide.cu's), CM_Q_TILES (query tiles per step, 1 or 2),
// CM_DYNAMIC_SMEM_BYTES (the dynamic shared memory the runtime launches with), CM_SCORE (1:
// recompute P with the score terms, add the distance table's gradient, apply the softcap's
// derivative to dS).
#include "bwd_common.cuh"
#include "tma.cuh"

static_assert(HEAD_DIM <= 128 && HEAD_DIM_V == HEAD_DIM, "wider shapes are bwd_dkdv_wide.cu's");

// Keys per CTA (two consumer warpgroups of 64) and threads (producer + two consumers).
#define KEY_BLOCK 128
#define DKDV_THREADS 384
// Stages of the Q / dO ring, as the variant declares: a third at head_dim 64, whose tiles take
// half the time to use and half the space to hold (+2% there, neutral at 128, where it costs a
// spill).
#define STAGES CM_STAGES
CM_CHECK_SHAPE(BLOCK_M, KEY_BLOCK, STAGES, DKDV_THREADS);
static_assert(STAGES == 2 || STAGES == 3, "two or three stages");
#define Q_TILES CM_Q_TILES
// Buffers of the shared dS^T tile (cm_kernels::Variant::ds_stages): with two, step it writes
// buffer it % 2, whose last readers (the other consumer's dQ product two steps back) are done
// once both consumers have met on NAMED_DS one step back.
#define DS_STAGES CM_DS_STAGES
static_assert(DS_STAGES == 1 || DS_STAGES == 2 && Q_TILES == 1 && !CM_SCORE,
              "two dS^T buffers at one tile a step without score terms");
// The fast mode's dK product reads dS^T from registers (FlashAttention-4's SM90 choice at
// head_dim 128), which saves each consumer 8 KB of shared-memory reads a tile, the busiest
// unit (BENCHMARKS.md); the score variant keeps the shared tile's rows (its registers are
// short already, and its change is unmeasured).
#define DK_RS (!CM_SCORE)
static_assert(Q_TILES == 1 || Q_TILES == 2 && HEAD_DIM == 64 && !CM_SCORE,
              "two tiles a step only at head_dim 64 without score terms");
// Queries of a step: its tiles' rows, tile h at rows 64 h .. of the step's Q and dO.
#define Q_ROWS (Q_TILES * BLOCK_M)
// K or V of the key block: HEAD_DIM / 64 column atoms of [128 rows][128 bytes].
#define KV_BYTES (KEY_BLOCK * HEAD_DIM * 2)
// Q or dO of a step: HEAD_DIM / 64 column atoms of [Q_ROWS rows][128 bytes].
#define STEP_BYTES (Q_TILES * TILE_BYTES)
// dS^T of one step: [128 keys][Q_ROWS queries], column atoms of 64 queries (one per tile).
#define DS_BYTES (KEY_BLOCK * Q_ROWS * 2)
// One tile's dQ in fp32, fragment-ordered (see cm_dq_offset).
#define DQ_BYTES (BLOCK_M * HEAD_DIM * 4)
// Columns of dQ each consumer computes: half of the tile's, or with two tiles a step all of
// its own tile's.
#define DQ_COLS (HEAD_DIM * Q_TILES / 2)
// lse_log2 of the step's queries, then delta.
#define STATS_BYTES (2 * Q_ROWS * 4)
// One tile's key-major visibility.
#define MASK_BYTES (KEY_BLOCK * 8)

#define OFF_V KV_BYTES
#define OFF_Q (2 * KV_BYTES)
#define OFF_DO (OFF_Q + STAGES * STEP_BYTES)
#define OFF_DS (OFF_DO + STAGES * STEP_BYTES)
#define OFF_DQ (OFF_DS + DS_STAGES * DS_BYTES)
#define OFF_STATS (OFF_DQ + Q_TILES * DQ_BYTES)
#define OFF_MASK (OFF_STATS + STAGES * STATS_BYTES)
#define OFF_BARS (OFF_MASK + STAGES * Q_TILES * MASK_BYTES)
#define SMEM_BYTES (OFF_BARS + 64 + 1024)
static_assert(SMEM_BYTES == CM_DYNAMIC_SMEM_BYTES, "cm_kernels::Variant::dynamic_shared_bytes must match");

// Producer and consumer register budgets: 128 x 24 + 256 x 240 <= 65536.
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#define CONSUMER_WARPS 8

// Named barrier of the 256 consumer threads (0 is __syncthreads, 3 + c each consumer's own in
// score_term_grads).
#define NAMED_DS 1
// The fast mode's dQ goes to the reducer warp in DQ_PARTS parts, each from the consumer
// threads that store it (they arrive) to the reducer's 32 (they sync), and back once its
// reduction has read it (the reducer arrives, the consumers sync). With two dS^T buffers a
// part per consumer, as FlashAttention-4's SM90 backward has: neither consumer waits for the
// other's dQ, and the reducer adds one part while the other is being stored (+1.3% at
// head_dim 128, BENCHMARKS.md). With one buffer the reducer gives dQ back only once both
// consumers' products are done (they read all of dS^T), so one part for both (per-consumer
// parts measured 0.5% slower at head_dim 64).
#define DQ_PARTS (DS_STAGES == 2 ? 2 : 1)
#define NAMED_DQ_FULL(part) (6 + (part))
#define NAMED_DQ_EMPTY(part) (8 + (part))
#define DQ_HANDOFF_THREADS (256 / DQ_PARTS + 32)
// A part of the step's dQ tiles, contiguous in the fragment-ordered layout (cm_dq_offset),
// where consumer c's columns (or with two tiles a step, its tile) are its half.
#define DQ_PART_BYTES (Q_TILES * DQ_BYTES / DQ_PARTS)

// P^T of one step in place of S^T. Element [j][e] is key 16 warp + g + 8 (e >> 1) of this
// consumer, query 8 j + 2 t + (e & 1) of the step (tile j / 8); bits[h][r] are tile h's
// visibility bits of the thread's key row r. A masked pair gets exponent -inf whatever its
// score, so P = 0 (and with it dS) exactly.
template <bool MASKED>
__device__ __forceinline__ void probabilities(float (&s)[Q_ROWS / 8][4], const float* lse2s,
                                              const u64 (&bits)[Q_TILES][2], float scale_log2, int t) {
#pragma unroll
    for (int j = 0; j < Q_ROWS / 8; ++j) {
        const float2 lse2v = *reinterpret_cast<const float2*>(lse2s + j * 8 + t * 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = e & 1;
            float x = fmaf(s[j][e], scale_log2, -(c ? lse2v.y : lse2v.x));
            if (MASKED) {
                // bits[h] is already shifted right by 2 t.
                if (!((bits[j / 8][e >> 1] >> ((j % 8) * 8 + c)) & 1ull)) x = cm_neg_inf();
            }
            s[j][e] = cm_exp2(x);
        }
    }
}

// dS^T = P^T (dP^T - delta) in place of dP^T (same element order as probabilities).
__device__ __forceinline__ void score_grads(float (&dp)[Q_ROWS / 8][4], const float (&pr)[Q_ROWS / 8][4],
                                            const float* deltas, int t) {
#pragma unroll
    for (int j = 0; j < Q_ROWS / 8; ++j) {
        const float2 dlv = *reinterpret_cast<const float2*>(deltas + j * 8 + t * 2);
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] = pr[j][e] * (dp[j][e] - ((e & 1) ? dlv.y : dlv.x));
    }
}

#if CM_SCORE
// The score terms' side of dS^T: the distance table's gradient from dS^T as the softmax sees
// it, then (with a table) the softcap's derivative.
// Distances of one consumer's tile (64 queries x 64 keys): 127, padded.
#define DIST_SPAN 128

__device__ __forceinline__ void score_term_grads(float (&dp)[BLOCK_M / 8][4], const CmDcap<BLOCK_M / 8>& dcap,
                                                 const CmScoreParams& sp, const CmDistTile& dist,
                                                 CmDistGradAcc& acc, u32 head, u32 q_len, u32 kv_len,
                                                 unsigned long long* buf, int buf_lo, u32 c, bool fixed) {
    if (sp.dist_bias_grad != nullptr) {
        cm_dist_grad<BLOCK_M / 8, true>(dp, sp, dist, acc, head, buf, buf_lo, fixed);
        if (!dist.constant) {
            // The warpgroup's shared sums are complete after the first barrier and zero
            // again after the second.
            asm volatile("bar.sync %0, 128;" ::"r"(3 + c) : "memory");
            cm_dist_grad_flush_tile(buf, buf_lo, DIST_SPAN - 1, sp, head, q_len, kv_len, threadIdx.x - 128 * (c + 1),
                                    128, fixed);
            asm volatile("bar.sync %0, 128;" ::"r"(3 + c) : "memory");
        }
    }
    // Only the scores before the cap carry its derivative; without a table it came in
    // through P (cap_in_p).
    if (sp.softcap > 0.f && sp.dist_bias_grad != nullptr) cm_mul_dcap(dp, dcap);
}
#endif

// One CTA's work item: a 128-key block of one (batch, kv head) pair, and its tiles over the
// pair's query heads.
struct CmDkdvBlock {
    CmDkdvPair pair;
    u32 n_block;
    u32 key0;
    u32 total;  // tiles over the group's query heads
};

// Steps of the block's walk: Q_TILES tiles each, the last possibly fewer.
__device__ __forceinline__ u32 dkdv_steps(const CmDkdvBlock& blk) { return (blk.total + Q_TILES - 1) / Q_TILES; }

// A position in the walk over a key block's tiles with two tiles a step: every tile of the
// group's first query head, then the next head's. Kept small (a head's lists and a tile
// index): the producer warpgroup runs on 24 registers.
struct CmDkdvWalk {
    CmDkdvHead hd;
    u32 ti;  // next tile of hd's list
};

// The walk's next tile into tl and its query head into head; false past the block's last.
// Afterwards w.ti == w.hd.num_tiles when it was its head's last.
__device__ __forceinline__ bool dkdv_next(const CmBwdParams& p, const CmDkdvBlock& blk, CmDkdvWalk& w, CmDkdvTile& tl,
                                          u32& head) {
    while (w.ti >= w.hd.num_tiles) {
        if (w.hd.head + 1 >= blk.pair.head0 + p.heads_per_kv_head) return false;
        w.hd = cm_dkdv_head(p, blk.pair.batch, w.hd.head + 1, blk.n_block);
        w.ti = 0;
    }
    tl = cm_dkdv_tile(p, w.hd, w.ti++);
    head = w.hd.head;
    return true;
}

// One step's tiles as dkdv_for_each_step hands them over: whether tile q is present (an
// absent one repeats the first's tile and head), and tile(q) and its query head. One tile a
// step reads its tile where it is used (the score terms' consumers load its first query
// while their products run, as before two-tile steps); two are read by the walk.
struct CmDkdvStep1 {
    const CmBwdParams& p;
    CmDkdvHead hd;
    u32 ti;
    __device__ __forceinline__ bool present(int) const { return true; }
    __device__ __forceinline__ bool partial(int) const { return ti < hd.num_partial; }
    __device__ __forceinline__ CmDkdvTile tile(int) const { return cm_dkdv_tile(p, hd, ti); }
    __device__ __forceinline__ u32 head(int) const { return hd.head; }
};

template <int N>
struct CmDkdvStepList {
    CmDkdvTile tl[N];
    u32 hd[N];
    bool pres[N];
    __device__ __forceinline__ bool present(int q) const { return pres[q]; }
    __device__ __forceinline__ bool partial(int q) const { return pres[q] && tl[q].partial; }
    __device__ __forceinline__ CmDkdvTile tile(int q) const { return tl[q]; }
    __device__ __forceinline__ u32 head(int q) const { return hd[q]; }
};

// The block's steps in order, the same for the producer, the reducer and the consumers:
// calls f(it, step) for each, and with one tile a step head_done(head) after each query
// head's last tile (with two, a step can span two heads: the score terms, whose gradient
// table is flushed per head, take one). One tile a step walks each head's list in nested
// loops, as before two-tile steps (the single walk measured 1.5-3% slower at head_dim 128 on
// W1); two walk the group's lists as one sequence (CmDkdvWalk).
#if Q_TILES == 1
typedef CmDkdvStep1 CmDkdvStep;
#else
typedef CmDkdvStepList<2> CmDkdvStep;
#endif

struct CmNoHeadDone {
    __device__ __forceinline__ void operator()(u32) const {}
};
template <class G> struct CmIsNoHeadDone { static constexpr bool value = false; };
template <> struct CmIsNoHeadDone<CmNoHeadDone> { static constexpr bool value = true; };

template <class F, class G = CmNoHeadDone>
__device__ __forceinline__ void dkdv_for_each_step(const CmBwdParams& p, const CmDkdvBlock& blk, F&& f,
                                                   G&& head_done = G{}) {
#if Q_TILES == 1
    u32 it = 0;
    for (u32 hg = 0; hg < p.heads_per_kv_head; ++hg) {
        const CmDkdvHead hd = cm_dkdv_head(p, blk.pair.batch, blk.pair.head0 + hg, blk.n_block);
        for (u32 ti = 0; ti < hd.num_tiles; ++ti, ++it) f(it, CmDkdvStep1{p, hd, ti});
        head_done(hd.head);
    }
#else
    static_assert(CmIsNoHeadDone<G>::value, "head_done needs one tile a step: with two, a step can span two heads");
    CmDkdvWalk walk = {cm_dkdv_head(p, blk.pair.batch, blk.pair.head0, blk.n_block), 0};
    const u32 steps = dkdv_steps(blk);
    for (u32 it = 0; it < steps; ++it) {
        CmDkdvStepList<2> st;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            st.pres[q] = dkdv_next(p, blk, walk, st.tl[q], st.hd[q]);
            if (!st.pres[q]) {
                st.tl[q] = st.tl[0];
                st.hd[q] = st.hd[0];
            }
        }
        f(it, st);
    }
#endif
}

// The deterministic mode's walk, where every query head of the group has the group's first
// head's mask: the key block's tiles from the highest query tile down (partial and full lists
// merged; each ascends), each tile for every query head of the group in turn, Q_TILES (tile,
// head) pairs a step. dQ is added tile by tile in ascending key-block order and key blocks
// start in ascending order, so a later key block reaches each shared tile no earlier in its walk
// than an earlier one does (causal, windows, documents): the turns rarely wait. Walking heads
// outermost, a later block would reach a later head's tiles two steps per block sooner.
template <class F>
__device__ __forceinline__ void dkdv_for_each_ordered_step(const CmBwdParams& p, const CmDkdvBlock& blk, F&& f) {
    const CmDkdvHead hd = cm_dkdv_head(p, blk.pair.batch, blk.pair.head0, blk.n_block);
    u32 partial_left = hd.num_partial, full_left = hd.num_tiles - hd.num_partial;
    CmDkdvStepList<Q_TILES> st;
    u32 it = 0;
    bool half = false;  // two tiles a step: the step's first pair is set
    auto emit = [&](const CmDkdvTile& tl, u32 head) {
        if constexpr (Q_TILES == 1) {
            st.tl[0] = tl;
            st.hd[0] = head;
            st.pres[0] = true;
            f(it++, st);
        } else if (!half) {
            st.tl[0] = tl;
            st.hd[0] = head;
            half = true;
        } else {
            st.tl[1] = tl;
            st.hd[1] = head;
            st.pres[0] = st.pres[1] = true;
            f(it++, st);
            half = false;
        }
    };
    while (partial_left + full_left > 0) {
        const u32 pq = partial_left > 0 ? p.bwd_q_indices[hd.p_begin + partial_left - 1] : 0;
        const u32 fq = full_left > 0 ? p.bwd_full_q_indices[hd.f_begin + full_left - 1] : 0;
        CmDkdvTile tl;
        tl.partial = partial_left > 0 && (full_left == 0 || pq > fq);
        if (tl.partial) {
            --partial_left;
            tl.index = hd.p_begin + partial_left;
            tl.row0 = pq * BLOCK_M;
        } else {
            --full_left;
            tl.index = hd.f_begin + full_left;
            tl.row0 = fq * BLOCK_M;
        }
        for (u32 hg = 0; hg < p.heads_per_kv_head; ++hg) emit(tl, blk.pair.head0 + hg);
    }
    if constexpr (Q_TILES == 2) {
        // An odd count ends with one pair; the absent second repeats it.
        if (half) {
            st.tl[1] = st.tl[0];
            st.hd[1] = st.hd[0];
            st.pres[0] = true;
            st.pres[1] = false;
            f(it, st);
        }
    }
}

// The consumers' walk over the key block's tiles (warpgroups 1 and 2). The modes are separate
// instantiations, so that no wgmma batch sits behind a run-time branch on the mode while other
// products are in flight (ptxas would serialise them). ORDERED (with ATOMIC_DQ, no score
// terms): the deterministic mode's walk (dkdv_for_each_ordered_step).
template <bool ATOMIC_DQ, bool ORDERED>
__device__ __forceinline__ void dkdv_consumers(const CmBwdParams& p, const CmDkdvBlock& blk, u32 base,
                                               unsigned char* smem, int warpgroup) {
    const u32 sK = base;
    const u32 sV = base + OFF_V;
    const u32 sDQ = base + OFF_DQ;
    auto bar = [&](int i) -> u32 { return base + OFF_BARS + 8 * i; };
    const u32 batch = blk.pair.batch, kv_head = blk.pair.kv_head, key0 = blk.key0, total = blk.total;
#if CM_SCORE
    // Per consumer: the per-distance sums of a tile near the diagonal, zero between tiles.
    __shared__ unsigned long long dist_buf[2][DIST_SPAN];
#endif
    const u32 c = warpgroup - 1;  // this consumer's keys: 64 c .. 64 c + 63 of the block
    const u32 dq_part = c * DQ_PARTS / 2;  // the part of the step's dQ it stores
    const int warp = (threadIdx.x >> 5) & 3;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 sKc = sK + c * 64 * 128;
    const u32 sVc = sV + c * 64 * 128;
    // The block overhangs kv_len (its last keys are TMA's zero fill), and whether each of
    // this thread's two key rows is below kv_len.
    const bool overhangs = key0 + KEY_BLOCK > p.kv_len;
    bool key_in_range[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) key_in_range[h] = key0 + c * 64 + warp * 16 + g + h * 8 < p.kv_len;

    float acc_dk[HEAD_DIM / 8][4];
    float acc_dv[HEAD_DIM / 8][4];
    float acc_dq[DQ_COLS / 8][4];
    float sc[Q_ROWS / 8][4];
    float dp[Q_ROWS / 8][4];
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[j][e] = acc_dv[j][e] = 0.f;
    }
    // Every product that writes these starts with accumulate = 0; zeroing them once keeps
    // their first use from reading undefined registers.
#pragma unroll
    for (int j = 0; j < Q_ROWS / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[j][e] = dp[j][e] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < DQ_COLS / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[j][e] = 0.f;
    }
    if (total > 0) cm_mbar_wait(bar(BAR_KV), 0);

#if CM_SCORE
    CmDistGradAcc dist_acc = {0.f, -1};
    // The distance sums are fixed point in the deterministic mode (no dQ accumulator), so
    // that its table gradient repeats its bits too.
    const bool dist_fixed = !ATOMIC_DQ;
    for (int i = threadIdx.x - 128 * (c + 1); i < DIST_SPAN; i += 128) dist_buf[c][i] = 0;
    asm volatile("bar.sync %0, 128;" ::"r"(3 + c) : "memory");
#endif
    static_assert(!ORDERED || ATOMIC_DQ && !CM_SCORE, "the ordered walk adds dQ, without score terms");
    auto body = [&](u32 it, const auto& st) {
        const u32 s = it % STAGES;
        // The step's tiles: whether each is partial, or absent (the last step of an odd count).
        bool present[Q_TILES], partial[Q_TILES];
#pragma unroll
        for (int q = 0; q < Q_TILES; ++q) {
            present[q] = st.present(q);
            partial[q] = st.partial(q);
        }
        {
            const u32 sQ = base + OFF_Q + s * STEP_BYTES;
            const u32 sdO = base + OFF_DO + s * STEP_BYTES;
            // Formed per tile (not hoisted with its descriptors out of the loop, which spills).
            const u32 sDS = cm_opaque(base + OFF_DS + (DS_STAGES == 2 ? (it & 1) * DS_BYTES : 0));
            cm_mbar_wait(bar(BAR_FULL(s)), (it / STAGES) & 1);

            // S^T and dP^T: this consumer's 64 keys x the step's queries, contraction over
            // head_dim. The keys are a 64-row slice of the 128-row K and V tiles (same column
            // atoms, 64 rows in).
            cm_wgmma_fence();
    #pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                cm_wgmma_ss<0, 0>(sc, cm_wgmma_desc(cm_opaque(sKc) + (ks >> 2) * KEY_BLOCK * 128 + (ks & 3) * 32, 16, 1024),
                                  cm_desc_k_major(sQ, Q_ROWS, ks), ks > 0);
            }
            cm_wgmma_commit();
    #pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                cm_wgmma_ss<0, 0>(dp, cm_wgmma_desc(cm_opaque(sVc) + (ks >> 2) * KEY_BLOCK * 128 + (ks & 3) * 32, 16, 1024),
                                  cm_desc_k_major(sdO, Q_ROWS, ks), ks > 0);
            }
            cm_wgmma_commit();
#if CM_SCORE
            // The tile's first query and the distance table's view of it, loaded while the
            // products run.
            const u32 key_base = key0 + c * 64 + warp * 16 + g;
            const u32 tile_row0 = st.tile(0).row0;
            const u32 query_base = tile_row0 + 2 * t;
            // The tile's distances (queries tile_row0 .., keys key0 + 64 c ..), as indices:
            // the same range in every thread of the consumer.
            const int dist_lo = (int)tile_row0 - (int)(key0 + c * 64 + 63) + (int)p.kv_len - 1;
            const CmDistTile dist = cm_dist_tile<BLOCK_M / 8, true>(p.score, st.head(0), p.q_len, p.kv_len, key_base,
                                                                    query_base, dist_lo, dist_lo + DIST_SPAN - 2);
#endif
            // While they run: this thread's two key rows' visibility of each tile's 64 queries,
            // shifted to its query columns. A full tile of the block that overhangs kv_len sees
            // every query from its keys below kv_len and none from the zero-filled keys past it:
            // their score 0 would give P = exp2(-lse_log2), which overflows to inf for a row
            // with lse below -88.7 (ln FLT_MAX) and reaches dQ through dS K as inf * 0 = NaN.
            // An absent tile sees nothing.
            u64 bits[Q_TILES][2];
            bool masked = overhangs;
    #pragma unroll
            for (int q = 0; q < Q_TILES; ++q) {
                masked |= partial[q] || !present[q];
                if (partial[q]) {
                    const u64* mask = reinterpret_cast<const u64*>(smem + OFF_MASK + (s * Q_TILES + q) * MASK_BYTES);
    #pragma unroll
                    for (int h = 0; h < 2; ++h) bits[q][h] = mask[c * 64 + warp * 16 + g + h * 8] >> (2 * t);
                } else if (overhangs || !present[q]) {
    #pragma unroll
                    for (int h = 0; h < 2; ++h) bits[q][h] = present[q] && key_in_range[h] ? ~0ull : 0ull;
                } else {
                    // Read only when the step's other tile masks (two tiles a step).
    #pragma unroll
                    for (int h = 0; h < 2; ++h) bits[q][h] = Q_TILES == 2 ? ~0ull : 0ull;
                }
            }
            // P^T as soon as S^T is done, while dP^T is computed; then dV += P^T dO (contraction
            // over the step's queries, dO read MN-major) runs while dS^T is formed, or with two
            // tiles a step once it is formed: P^T's fragments beside P^T, dP^T, dK and dV
            // (224 registers) would not fit the consumers' 240.
            cm_wgmma_wait<1>();
            cm_fence_acc(sc);
            const float* lse2s = reinterpret_cast<const float*>(smem + OFF_STATS + s * STATS_BYTES);
#if CM_SCORE
            // The logits with their score terms, already in the log2 domain.
            CmDcap<Q_ROWS / 8> dcap;
            cm_score_logits<Q_ROWS / 8, true, true>(sc, dcap, p.score, dist, p.softmax_scale, st.head(0), p.q_len,
                                                     p.kv_len, key_base, query_base);
            const float logit_scale = 1.f;
#else
            const float logit_scale = p.scale_log2;
#endif
            if (masked) {
                probabilities<true>(sc, lse2s, bits, logit_scale, t);
            } else {
                probabilities<false>(sc, lse2s, bits, logit_scale, t);
            }
            // The operands in the element type: P^T and dS^T as register A fragments (16 queries
            // per k-step).
            u32 pa[Q_ROWS / 16][4];
            u32 dsa[Q_ROWS / 16][4];
            auto pack_p = [&]() {
    #pragma unroll
                for (int kk = 0; kk < Q_ROWS / 16; ++kk) cm_bwd_a_fragment(sc, kk, pa[kk]);
            };
            auto issue_dv = [&]() {
                cm_wgmma_fence();
    #pragma unroll
                for (int kk = 0; kk < Q_ROWS / 16; ++kk)
                    cm_wgmma_rs<1>(acc_dv, pa[kk], cm_desc_mn_major(sdO, Q_ROWS, kk), 1);
                cm_wgmma_commit();
            };
            if constexpr (Q_TILES == 1) pack_p();
#if CM_SCORE
            // With a softcap and no table to differentiate, dS takes the cap's derivative
            // through P, which dV no longer needs (it has pa): dcap ends here, not after dP.
            const bool cap_in_p = p.score.softcap > 0.f && p.score.dist_bias_grad == nullptr;
            if (cap_in_p) cm_mul_dcap(sc, dcap);
#endif
            if constexpr (Q_TILES == 1) issue_dv();
            cm_wgmma_wait<Q_TILES == 1 ? 1 : 0>();
            cm_fence_acc(dp);
            score_grads(dp, sc, lse2s + Q_ROWS, t);
#if CM_SCORE
            score_term_grads(dp, dcap, p.score, dist, dist_acc, st.head(0), p.q_len, p.kv_len, dist_buf[c], dist_lo, c,
                             dist_fixed);
#endif
    #pragma unroll
            for (int kk = 0; kk < Q_ROWS / 16; ++kk) cm_bwd_a_fragment(dp, kk, dsa[kk]);
            if constexpr (Q_TILES == 2) {
                pack_p();
                issue_dv();
            }
            if constexpr (ATOMIC_DQ) {
                // dS^T into the shared tile. Its readers of the previous tile are done: this
                // consumer's dK product retired at the end of that tile, and both consumers' dQ
                // products before they handed their parts of the previous tile's dQ to the
                // reducer, which with one buffer gives either part back only once it has read
                // both (so this consumer's part of the dQ tile is free as well). With two
                // buffers the readers of this one, two steps back, are done already
                // (DS_STAGES), and the dQ part is waited for behind the products.
                if constexpr (DS_STAGES == 1) cm_named_sync_at<DQ_HANDOFF_THREADS>(NAMED_DQ_EMPTY(dq_part));
    #pragma unroll
                for (int kk = 0; kk < Q_ROWS / 16; ++kk) {
    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 row = c * 64 + warp * 16 + g + h * 8;
                        // Queries 16 kk + 2 t (chunk 2 kk) and 16 kk + 8 + 2 t (chunk 2 kk + 1).
                        asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDS + cm_sw128_offset(row, 2 * kk, KEY_BLOCK) + t * 4),
                                     "r"(dsa[kk][h]));
                        asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDS + cm_sw128_offset(row, 2 * kk + 1, KEY_BLOCK) +
                                                                     t * 4),
                                     "r"(dsa[kk][2 + h]));
                    }
                }
                cm_fence_proxy_async();
                // Both halves of dS^T are in shared memory after the barrier.
                cm_consumers_sync(NAMED_DS);
                // dQ = dS K over the block's 128 keys, this consumer's DQ_COLS columns of the
                // step's one tile, or with two tiles a step all columns of tile c: A is dS read
                // transposed from the dS^T tile (16 keys per k-step; tile c's column atom), B the
                // K tile read transposed, starting at this consumer's columns (a column atom at
                // head_dim 128, half of one at 64). Issued before dK's product
                // (FlashAttention-3's order) so that dQ's trip through shared memory and its
                // reduction overlap dK's product on the tensor pipe.
                const u32 sDS_rows = sDS + (Q_TILES == 2 ? c * KEY_BLOCK * 128 : 0);
                const u32 sK_cols =
                    cm_opaque(sK) + (Q_TILES == 2 ? 0 : HEAD_DIM == 128 ? c * KEY_BLOCK * 128 : c * 64);
                cm_wgmma_fence();
    #pragma unroll
                for (int kk = 0; kk < KEY_BLOCK / 16; ++kk) {
                    cm_wgmma_ss<1, 1>(acc_dq, cm_wgmma_desc(sDS_rows + kk * 2048, BLOCK_M * 128, 1024),
                                      cm_wgmma_desc(sK_cols + kk * 2048, KEY_BLOCK * 128, 1024), kk > 0);
                }
                cm_wgmma_commit();
                // dK += dS^T Q: contraction over the step's queries, dS^T from registers (DK_RS)
                // or from this consumer's rows of the shared tile (K-major). Q read MN-major.
                if constexpr (DK_RS) {
    #pragma unroll
                    for (int kk = 0; kk < Q_ROWS / 16; ++kk)
                        cm_wgmma_rs<1>(acc_dk, dsa[kk], cm_desc_mn_major(sQ, Q_ROWS, kk), 1);
                } else {
    #pragma unroll
                    for (int kk = 0; kk < Q_ROWS / 16; ++kk) {
                        cm_wgmma_ss<0, 1>(
                            acc_dk,
                            cm_wgmma_desc(sDS + (kk >> 2) * KEY_BLOCK * 128 + c * 64 * 128 + (kk & 3) * 32, 16, 1024),
                            cm_desc_mn_major(sQ, Q_ROWS, kk), 1);
                    }
                }
                cm_wgmma_commit();
                const u32 sDQ_at = sDQ + (Q_TILES == 2 ? c * DQ_BYTES + 4 * cm_dq_offset(0, warp, lane)
                                                       : 4 * cm_dq_offset(c * (DQ_COLS / 8), warp, lane));

                // dV's and dQ's products are done (groups retire in order); dK's runs on.
                cm_wgmma_wait<1>();
                cm_fence_acc(acc_dq);
                cm_fence_frag(pa);
                // The reducer has read the previous step's dQ tile.
                if constexpr (DS_STAGES == 2) cm_named_sync_at<DQ_HANDOFF_THREADS>(NAMED_DQ_EMPTY(dq_part));
    #pragma unroll
                for (int j = 0; j < DQ_COLS / 8; ++j) {
                    // Chunk j of this consumer's columns; chunks are 2 KB apart (cm_dq_offset).
                    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(sDQ_at + j * 2048),
                                 "f"(acc_dq[j][0]), "f"(acc_dq[j][1]), "f"(acc_dq[j][2]), "f"(acc_dq[j][3])
                                 : "memory");
                }
                cm_fence_proxy_async();
                cm_named_arrive_at<DQ_HANDOFF_THREADS>(NAMED_DQ_FULL(dq_part));
            } else {
                // dK += dS^T Q: contraction over the step's queries, Q read MN-major.
                cm_wgmma_fence();
    #pragma unroll
                for (int kk = 0; kk < Q_ROWS / 16; ++kk) cm_wgmma_rs<1>(acc_dk, dsa[kk], cm_desc_mn_major(sQ, Q_ROWS, kk), 1);
                cm_wgmma_commit();
            }
            // dK's product is waited for here in the fast mode too: kept in flight behind the
            // next tile's S^T, ptxas serialises every product (C7515; BENCHMARKS.md, "a reducer
            // warp for dQ").
            cm_wgmma_wait<0>();
            cm_fence_acc(acc_dv);
            cm_fence_acc(acc_dk);
            cm_fence_frag(pa);
            if constexpr (!ATOMIC_DQ || DK_RS) cm_fence_frag(dsa);
            // Q, dO, the statistics and the bits of stage s are no longer read.
            __syncwarp();
            if (lane == 0) cm_mbar_arrive(bar(BAR_EMPTY(s)));
        }
    };
    if constexpr (ORDERED) {
        dkdv_for_each_ordered_step(p, blk, body);
    } else {
        dkdv_for_each_step(p, blk, body
#if CM_SCORE
                           , [&](u32 head) {
                               // The next head's gradient goes to its own row of the table.
                               if (p.score.dist_bias_grad != nullptr)
                                   cm_dist_grad_flush(dist_acc, p.score, head, dist_fixed);
                           }
#endif
        );
    }

    const u32 row0 = key0 + c * 64;
    cm_bwd_store_rows(p.dk + batch * p.dk_stride_batch + kv_head * p.dk_stride_head, p.dk_stride_row, acc_dk,
                      p.softmax_scale, row0, p.kv_len, warp, g, t);
    cm_bwd_store_rows(p.dv + batch * p.dv_stride_batch + kv_head * p.dv_stride_head, p.dv_stride_row, acc_dv, 1.f,
                      row0, p.kv_len, warp, g, t);
}

extern "C" __global__ void __launch_bounds__(DKDV_THREADS, 1)
    cm_bwd_dkdv(const __grid_constant__ CmBwdParams p, const __grid_constant__ CmTensorMap tm_q,
                const __grid_constant__ CmTensorMap tm_do, const __grid_constant__ CmTensorMap tm_k,
                const __grid_constant__ CmTensorMap tm_v) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (cm_smem_addr(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - cm_smem_addr(smem_raw));
    const u32 sK = base;
    const u32 sV = base + OFF_V;
    auto bar = [&](int i) -> u32 { return base + OFF_BARS + 8 * i; };

    // The deterministic mode adds dQ in turns (dq_turns). A CTA then takes its work item by
    // start ticket, not blockIdx.x: every item it waits for has a lower ticket, so it has
    // started and runs (or has finished) whatever the scheduler's order, and the lowest
    // unfinished one never waits. Its key blocks start in ascending order, the turns' order.
    const bool ordered = !CM_SCORE && p.dq_turns != nullptr;
    u32 item_id = blockIdx.x;
    if (ordered) {
        __shared__ u32 ticket;
        if (threadIdx.x == 0) ticket = atomicAdd(p.dq_turns, 1u);
        __syncthreads();
        item_id = ticket;
    }
    const CmDkdvPair item = cm_dkdv_pair(p, p.bwd_num_n_blocks, item_id);
    const u32 batch = item.batch, kv_head = item.kv_head, head0 = item.head0, rank = item.rank;
    // Any mask's key-block order is a permutation of the blocks; the group's first head's
    // orders the launch.
    const u32 n_block =
        ordered ? rank : p.bwd_n_block_order[(u64)cm_bwd_mask(p, batch, head0) * p.bwd_num_n_blocks + rank];
    const u32 key0 = n_block * KEY_BLOCK;
    // Tiles over the group's query heads, each head's from its own mask.
    u32 total = 0;
    for (u32 hg = 0; hg < p.heads_per_kv_head; ++hg) total += cm_dkdv_head(p, batch, head0 + hg, n_block).num_tiles;
    const CmDkdvBlock blk = {item, n_block, key0, total};

    if (threadIdx.x == 0) cm_dkdv_ring_init(bar(0), STAGES, CONSUMER_WARPS);
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        cm_regs_dealloc<PRODUCER_REGS>();
        if (threadIdx.x == 0 && total > 0) {
            cm_tma_prefetch_map(&tm_q);
            cm_tma_prefetch_map(&tm_do);
            cm_mbar_arrive_expect_tx(bar(BAR_KV), 2 * KV_BYTES);
#pragma unroll
            for (int a = 0; a < HEAD_DIM / 64; ++a) {
                cm_tma_load4(sK + a * KEY_BLOCK * 128, &tm_k, bar(BAR_KV), a * 64, key0, kv_head, batch);
                cm_tma_load4(sV + a * KEY_BLOCK * 128, &tm_v, bar(BAR_KV), a * 64, key0, kv_head, batch);
            }
            auto produce = [&](u32 it, const auto& st) {
                const u32 s = it % STAGES;
                // The step's tiles, read once (one tile a step reads its row from the lists).
                CmDkdvTile tl[Q_TILES];
    #pragma unroll
                for (int q = 0; q < Q_TILES; ++q) tl[q] = st.tile(q);
                // An absent second tile is loaded as a copy of the first (finite values, which
                // the consumers mask out).
                u32 bytes = Q_TILES * (2 * TILE_BYTES + 2 * BLOCK_M * 4);
    #pragma unroll
                for (int q = 0; q < Q_TILES; ++q) bytes += st.partial(q) ? MASK_BYTES : 0;
                cm_mbar_wait(bar(BAR_EMPTY(s)), ((it / STAGES) & 1) ^ 1);
                const u32 full = bar(BAR_FULL(s));
                cm_mbar_arrive_expect_tx(full, bytes);
                const u32 sQ = base + OFF_Q + s * STEP_BYTES;
                const u32 sdO = base + OFF_DO + s * STEP_BYTES;
                const u32 stats = base + OFF_STATS + s * STATS_BYTES;
    #pragma unroll
                for (int q = 0; q < Q_TILES; ++q) {
    #pragma unroll
                    for (int a = 0; a < HEAD_DIM / 64; ++a) {
                        const u32 at = a * Q_ROWS * 128 + q * BLOCK_M * 128;
                        cm_tma_load4(sQ + at, &tm_q, full, a * 64, tl[q].row0, st.head(q), batch);
                        cm_tma_load4(sdO + at, &tm_do, full, a * 64, tl[q].row0, st.head(q), batch);
                    }
                    const u64 rows = ((u64)batch * p.num_heads + st.head(q)) * p.q_pad + tl[q].row0;
                    cm_bulk_load(stats + q * BLOCK_M * 4, p.lse_log2 + rows, BLOCK_M * 4, full);
                    cm_bulk_load(stats + (Q_ROWS + q * BLOCK_M) * 4, p.delta + rows, BLOCK_M * 4, full);
                    if (st.partial(q)) {
                        cm_bulk_load(base + OFF_MASK + (s * Q_TILES + q) * MASK_BYTES,
                                     p.bwd_partial_key_mask + (u64)tl[q].index * KEY_BLOCK * 2, MASK_BYTES, full);
                    }
                }
            };
            if (ordered) {
                dkdv_for_each_ordered_step(p, blk, produce);
            } else {
                dkdv_for_each_step(p, blk, produce);
            }
        } else if (threadIdx.x / 32 == 1 && total > 0 && p.dq_accum != nullptr) {
            // The reducer warp: adds each consumer's part of the step's dQ, once that consumer
            // has stored it, into the fp32 accumulator with one bulk asynchronous reduction
            // (a group each), and gives each part back once its reduction has read it (with
            // one dS^T buffer, once both have been read: see the consumers). It walks the same steps
            // as the consumers, so every barrier phase is matched. In the deterministic mode
            // each reduction waits for its turn (the tile's count of additions reaching this
            // key block's rank among the tile's visitors), and the count goes up once the
            // reduction is complete: each tile's dQ is summed in ascending key-block order.
            // A step's counts go up after the next step's reductions are issued when that
            // step's turns have come already (its group then completes while the next is in
            // flight, so the warp never waits for a completion between steps), and before the
            // next step waits for a turn otherwise (a later visitor never waits on a step that
            // waits itself).
            const u32 sDQ = base + OFF_DQ;
            // The first step finds the dQ parts free.
#pragma unroll
            for (int part = 0; part < DQ_PARTS; ++part) cm_named_arrive_at<DQ_HANDOFF_THREADS>(NAMED_DQ_EMPTY(part));
            const u32 steps = dkdv_steps(blk);
            const bool leader = (threadIdx.x & 31) == 0;
            // The turn counters of the last reduced step, not yet released (leader only).
            u32* pending[Q_TILES] = {};
            // Once every committed group is complete (all), or every one but the newest step's
            // DQ_PARTS.
            auto release_pending = [&](bool all) {
                if (pending[0] == nullptr) return;
                if (all) {
                    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
                } else {
                    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(DQ_PARTS) : "memory");
                }
                cm_fence_proxy_async_global();
    #pragma unroll
                for (int q = 0; q < Q_TILES; ++q) {
                    if (pending[q] != nullptr) cm_red_release_add(pending[q], 1u);
                    pending[q] = nullptr;
                }
            };
            auto reduce = [&](u32 it, const auto& st) {
                // The step's destinations (null for an absent tile) and turns, read before the
                // hand-off.
                float* dst[Q_TILES];
                u32* turn[Q_TILES];
                u32 my_turn[Q_TILES];
    #pragma unroll
                for (int q = 0; q < Q_TILES; ++q) {
                    const CmDkdvTile tl = st.tile(q);
                    dst[q] = st.present(q) ? p.dq_accum + (((u64)batch * p.num_heads + st.head(q)) * p.q_pad +
                                                           tl.row0) * HEAD_DIM
                                           : nullptr;
                    turn[q] = ordered ? cm_dq_turn(p, batch, st.head(q), tl.row0) : nullptr;
                    my_turn[q] = ordered ? (tl.partial ? p.bwd_q_ranks : p.bwd_full_q_ranks)[tl.index] : 0;
                }
                // Part `part` covers bytes [part, part + 1) x DQ_PART_BYTES of the step's dQ tiles
                // in shared memory; each tile's share of it goes to the same bytes of the tile's
                // fragment-ordered rows in the accumulator, one group per part.
#pragma unroll
                for (int part = 0; part < DQ_PARTS; ++part) {
                    cm_named_sync_at<DQ_HANDOFF_THREADS>(NAMED_DQ_FULL(part));
                    if (leader) {
                        if (ordered && part == 0) {
                            bool ready = true;
    #pragma unroll
                            for (int q = 0; q < Q_TILES; ++q) {
                                if (dst[q] != nullptr) ready = ready && cm_ld_acquire(turn[q]) == my_turn[q];
                            }
                            if (!ready) release_pending(true);
                        }
    #pragma unroll
                        for (int q = 0; q < Q_TILES; ++q) {
                            const u32 lo = max(q * DQ_BYTES, part * DQ_PART_BYTES);
                            const u32 hi = min((q + 1) * DQ_BYTES, (part + 1) * DQ_PART_BYTES);
                            if (lo >= hi || dst[q] == nullptr) continue;
                            if (ordered && lo == q * DQ_BYTES) {
                                while (cm_ld_acquire(turn[q]) != my_turn[q]) __nanosleep(128);
                                // The earlier additions (async proxy, released by their CTAs)
                                // come before this one.
                                cm_fence_proxy_async_global();
                            }
                            asm volatile(
                                "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                                    dst[q] + (lo - q * DQ_BYTES) / 4),
                                "r"(sDQ + lo), "r"(hi - lo)
                                : "memory");
                        }
                        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                    }
                    __syncwarp();
                }
                // Each part back once its reduction has read it (with one dS^T buffer, once all
                // have been read: see DQ_PARTS); the last step's are not written again (the
                // consumers sync EMPTY once per step).
#pragma unroll
                for (int part = 0; part < DQ_PARTS; ++part) {
                    if (leader) {
                        if (DS_STAGES == 2 && part + 1 < DQ_PARTS) {
                            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
                        } else {
                            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                        }
                    }
                    __syncwarp();
                    if (it + 1 < steps) cm_named_arrive_at<DQ_HANDOFF_THREADS>(NAMED_DQ_EMPTY(part));
                }
                if (ordered && leader) {
                    // The previous step's turns pass on once its group is complete; this
                    // step's group may still be in flight.
                    release_pending(false);
    #pragma unroll
                    for (int q = 0; q < Q_TILES; ++q) pending[q] = dst[q] != nullptr ? turn[q] : nullptr;
                }
                // The next step's named barrier counts the warp: it must arrive converged.
                __syncwarp();
            };
            if (ordered) {
                dkdv_for_each_ordered_step(p, blk, reduce);
            } else {
                dkdv_for_each_step(p, blk, reduce);
            }
            // The last reduction must finish before the CTA exits, and its turns pass on.
            if (leader) {
                release_pending(true);
                asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
            }
        }
        return;
    }

    cm_regs_alloc<CONSUMER_REGS>();
    if (p.dq_accum == nullptr) {
        dkdv_consumers<false, false>(p, blk, base, smem, warpgroup);
#if !CM_SCORE
    } else if (ordered) {
        dkdv_consumers<true, true>(p, blk, base, smem, warpgroup);
#endif
    } else {
        dkdv_consumers<true, false>(p, blk, base, smem, warpgroup);
    }
}
