// Backward dK / dV (and the fast mode's dQ) at the wide shapes (cm_kernels::WIDE_SHAPES:
// head_dim 256, and 192 with head_dim_v 128), warp-specialised like bwd_dkdv.cu but with the
// head dim split between the consumers, as FlashAttention-3's backward does at head_dim 256:
// 64 keys x 256 columns of dK and dV in fp32 are 256 registers per thread of one warpgroup.
//
// One CTA of three warpgroups per (64-key half of a 128-key descriptor block, kv head, batch),
// walking the block's transposed lists at 64 x 128 (cm_cuda::BWD_TILE), so both halves of a
// block run the same query tiles (a tile that only the other half sees costs this half its
// products and contributes exactly 0) and start next to each other in the launch, sharing
// the tiles' Q and dO in L2. Warpgroup 0 is the producer (K and V of the half once, then each
// tile's Q, dO, lse_log2 and delta rows and, for partial tiles, the half's key-major bits,
// through a two-stage mbarrier ring). Warpgroups 1 and 2 are consumers; per tile, consumer c
//   S^T, dP^T for the 64 keys x queries 32 c .. 32 c + 31      SS wgmma, N = 32
//   P^T, dS^T of those queries into shared tiles [64 keys][64 queries]   (one barrier)
//   dV[:, its V columns]  += P^T dO, dK[:, its K columns] += dS^T Q       SS wgmma, all 64 queries
//   fast mode: dQ[:, its K columns] = dS K, added into the fp32 accumulator with one vector
//   reduction per 16 bytes (red.global.add.v4.f32; the 64 KB a bulk reduction would stage
//   does not fit beside the tiles), in bwd_post's fragment order (cm_dq_offset).
// Columns are split by 64-column atoms, the first consumer taking the odd one at 192: 128 / 128
// at 256, 128 / 64 for K and 64 / 64 for V at 192 / 128 (a wgmma B operand cannot start
// inside an atom and span the next).
//
// Compile-time parameters (NVRTC -D): CM_DTYPE_BF16, CM_HEAD_DIM and CM_HEAD_DIM_V (a wide
// shape), CM_DYNAMIC_SMEM_BYTES (the dynamic shared memory the runtime launches with).
#include "bwd_common.cuh"
#include "tma.cuh"

static_assert(HEAD_DIM > 128, "head dims up to 128 are bwd_dkdv.cu's");
#if CM_SCORE
#error "bwd_dkdv_wide has no score terms"
#endif

// The descriptor's key block, this CTA's keys, threads (producer + two consumers).
#define KEY_BLOCK 128
#define CTA_KEYS 64
#define DKDV_THREADS 384
#define STAGES 2
CM_CHECK_SHAPE(BLOCK_M, KEY_BLOCK, STAGES, DKDV_THREADS);
#define K_BYTES (CTA_KEYS * HEAD_DIM * 2)
#define V_BYTES (CTA_KEYS * HEAD_DIM_V * 2)
// P^T or dS^T of one tile: [64 keys][64 queries], one column atom.
#define PT_BYTES (CTA_KEYS * BLOCK_M * 2)
#define STATS_BYTES (2 * BLOCK_M * 4)
#define MASK_BYTES (CTA_KEYS * 8)

#define OFF_V K_BYTES
#define OFF_Q (K_BYTES + V_BYTES)
#define OFF_DO (OFF_Q + STAGES * TILE_BYTES)
#define OFF_P (OFF_DO + STAGES * TILE_BYTES_V)
#define OFF_DS (OFF_P + PT_BYTES)
#define OFF_STATS (OFF_DS + PT_BYTES)
#define OFF_MASK (OFF_STATS + STAGES * STATS_BYTES)
#define OFF_BARS (OFF_MASK + STAGES * MASK_BYTES)
#define SMEM_BYTES (OFF_BARS + 64 + 1024)
static_assert(SMEM_BYTES == CM_DYNAMIC_SMEM_BYTES, "cm_kernels::Variant::dynamic_shared_bytes must match");

#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
#define CONSUMER_WARPS 8

// Named barriers of the 256 consumer threads: both halves of P^T and dS^T written; both
// consumers done reading the previous tile's.
#define NAMED_PDS 1
#define NAMED_REUSE 2

// Columns of consumer C: the first takes ceil(atoms / 2) of the 64-column atoms.
#define K_COLS0 (64 * ((HEAD_DIM / 64 + 1) / 2))
#define V_COLS0 (64 * ((HEAD_DIM_V / 64 + 1) / 2))

template <int J>
__device__ __forceinline__ void wide_zero(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) d[j][e] = 0.f;
    }
}

// A K-major operand of `rows` rows starting `row_off` rows in, k-step ks (16 columns).
__device__ __forceinline__ u64 wide_desc_k_major(u32 tile, u32 rows, u32 row_off, int ks) {
    return cm_wgmma_desc(tile + (ks >> 2) * rows * 128 + (ks & 3) * 32 + row_off * 128, 16, 1024);
}

// Rounds a consumer's [64 keys][32 queries] fragment to the element type into the shared
// [64 keys][64 queries] tile at its queries: element [j][e] is key 16 warp + g + 8 (e >> 1),
// query 32 C + 8 j + 2 t + (e & 1), so each pair is one 4-byte store in chunk 4 C + j.
template <int C>
__device__ __forceinline__ void wide_store_half(u32 tile, const float (&x)[4][4], int warp, int g, int t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 row = warp * 16 + g + h * 8;
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(tile + cm_sw128_offset(row, 4 * C + j, CTA_KEYS) + t * 4),
                         "r"(cm_pack2(x[j][2 * h], x[j][2 * h + 1])));
        }
    }
}

template <int C>
__device__ __forceinline__ void wide_consumer(const CmBwdParams& p, const unsigned char* smem, u32 base, u32 batch,
                                              u32 head0, u32 kv_head, u32 n_block, u32 key0, u32 total) {
    constexpr int K0 = C == 0 ? 0 : K_COLS0;
    constexpr int KC = C == 0 ? K_COLS0 : HEAD_DIM - K_COLS0;
    constexpr int V0 = C == 0 ? 0 : V_COLS0;
    constexpr int VC = C == 0 ? V_COLS0 : HEAD_DIM_V - V_COLS0;
    const int warp = (threadIdx.x >> 5) & 3;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 sK = base;
    const u32 sV = base + OFF_V;
    const u32 sP = base + OFF_P;
    const u32 sDS = base + OFF_DS;
    auto bar = [&](int i) -> u32 { return base + OFF_BARS + 8 * i; };
    const bool dq_on = p.dq_accum != nullptr;
    // The half overhangs kv_len (its last keys are TMA's zero fill), and whether each of this
    // thread's two key rows is below kv_len.
    const bool overhangs = key0 + CTA_KEYS > p.kv_len;
    bool key_in_range[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) key_in_range[h] = key0 + warp * 16 + g + h * 8 < p.kv_len;

    // dK and dV live across the tiles; S^T, dP^T and dQ are zeroed per tile, so that their
    // registers are not carried from one tile to the next (the wgmma operands read them, and
    // with them carried the consumer would not fit its 240 registers).
    float acc_dk[KC / 8][4];
    float acc_dv[VC / 8][4];
    wide_zero(acc_dk);
    wide_zero(acc_dv);
    if (total > 0) cm_mbar_wait(bar(BAR_KV), 0);

    u32 it = 0;
    // total is 0 for a half past kv_len although its block has tiles: the producer loads
    // nothing then, so the tiles must not be waited for.
    for (u32 hg = 0; total > 0 && hg < p.heads_per_kv_head; ++hg) {
        const CmDkdvHead hd = cm_dkdv_head(p, batch, head0 + hg, n_block);
        for (u32 ti = 0; ti < hd.num_tiles; ++ti, ++it) {
            const u32 s = it % STAGES;
            const bool partial = ti < hd.num_partial;
            const u32 sQ = base + OFF_Q + s * TILE_BYTES;
            const u32 sdO = base + OFF_DO + s * TILE_BYTES_V;
            cm_mbar_wait(bar(BAR_FULL(s)), (it / STAGES) & 1);

            // The fixed tiles' addresses, opaque to the compiler in each tile: otherwise it
            // hoists the products' loop-invariant descriptors (2 x HEAD_DIM / 16 of K and V
            // alone, 64 registers at head_dim 256) out of the tile loop, and spills.
            const u32 sKt = cm_opaque(sK);
            const u32 sVt = cm_opaque(sV);
            const u32 sPt = cm_opaque(sP);
            const u32 sDSt = cm_opaque(sDS);
            // S^T and dP^T: the 64 keys x this consumer's 32 queries.
            float sc[4][4];
            float dp[4][4];
            wide_zero(sc);
            wide_zero(dp);
            cm_wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
                cm_wgmma_ss<0, 0>(sc, cm_desc_k_major(sKt, CTA_KEYS, ks), wide_desc_k_major(sQ, BLOCK_M, 32 * C, ks),
                                  ks > 0);
            }
            cm_wgmma_commit();
#pragma unroll
            for (int ks = 0; ks < HEAD_DIM_V / 16; ++ks) {
                cm_wgmma_ss<0, 0>(dp, cm_desc_k_major(sVt, CTA_KEYS, ks), wide_desc_k_major(sdO, BLOCK_M, 32 * C, ks),
                                  ks > 0);
            }
            cm_wgmma_commit();
            // While they run: this thread's two key rows' visibility of its 32 queries. A full
            // tile of a half that overhangs kv_len sees nothing from the zero-filled keys past
            // it (their score 0 would give P = exp2(-lse_log2): inf for lse below -88.7).
            u64 bits[2] = {0, 0};
            if (partial) {
                const u64* mask = reinterpret_cast<const u64*>(smem + OFF_MASK + s * MASK_BYTES);
#pragma unroll
                for (int h = 0; h < 2; ++h) bits[h] = mask[warp * 16 + g + h * 8] >> (32 * C + 2 * t);
            } else if (overhangs) {
#pragma unroll
                for (int h = 0; h < 2; ++h) bits[h] = key_in_range[h] ? ~0ull : 0ull;
            }
            const float* lse2s = reinterpret_cast<const float*>(smem + OFF_STATS + s * STATS_BYTES) + 32 * C;
            const float* deltas = lse2s + BLOCK_M;

            cm_wgmma_wait<1>();
            cm_fence_acc(sc);
            const bool masked = partial || overhangs;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 lse2v = *reinterpret_cast<const float2*>(lse2s + j * 8 + t * 2);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = e & 1;
                    float x = fmaf(sc[j][e], p.scale_log2, -(c ? lse2v.y : lse2v.x));
                    if (masked && !((bits[e >> 1] >> (j * 8 + c)) & 1ull)) x = cm_neg_inf();
                    sc[j][e] = cm_exp2(x);
                }
            }
            // Both consumers finished the previous tile's products that read P^T and dS^T.
            if (it > 0) cm_consumers_sync(NAMED_REUSE);
            wide_store_half<C>(sP, sc, warp, g, t);
            cm_wgmma_wait<0>();
            cm_fence_acc(dp);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 dlv = *reinterpret_cast<const float2*>(deltas + j * 8 + t * 2);
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[j][e] = sc[j][e] * (dp[j][e] - ((e & 1) ? dlv.y : dlv.x));
            }
            wide_store_half<C>(sDS, dp, warp, g, t);
            cm_fence_proxy_async();
            cm_consumers_sync(NAMED_PDS);

            // dV += P^T dO and dK += dS^T Q over the tile's 64 queries (P^T, dS^T K-major; dO
            // and Q read MN-major from this consumer's first column atom).
            cm_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                cm_wgmma_ss<0, 1>(acc_dv, cm_desc_k_major(sPt, CTA_KEYS, kk),
                                  cm_desc_mn_major(sdO + (V0 / 64) * BLOCK_M * 128, BLOCK_M, kk), 1);
            }
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
                cm_wgmma_ss<0, 1>(acc_dk, cm_desc_k_major(sDSt, CTA_KEYS, kk),
                                  cm_desc_mn_major(sQ + (K0 / 64) * BLOCK_M * 128, BLOCK_M, kk), 1);
            }
            cm_wgmma_commit();
            if (dq_on) {
                // dQ[:, this consumer's K columns] = dS K over the half's 64 keys, one column
                // atom at a time (a 64 x 128 fp32 accumulator beside dK and dV spills): dS read
                // MN-major from the dS^T tile, K read MN-major.
                const u32 row0 = cm_dkdv_tile(p, hd, ti).row0;
                float* dst = p.dq_accum + (((u64)batch * p.num_heads + hd.head) * p.q_pad + row0) * HEAD_DIM;
#pragma unroll
                for (int a = 0; a < KC / 64; ++a) {
                    float acc_dq[8][4];
                    wide_zero(acc_dq);
                    cm_wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < CTA_KEYS / 16; ++kk) {
                        cm_wgmma_ss<1, 1>(acc_dq, cm_wgmma_desc(sDSt + kk * 2048, CTA_KEYS * 128, 1024),
                                          cm_wgmma_desc(sKt + (K0 / 64 + a) * CTA_KEYS * 128 + kk * 2048,
                                                        CTA_KEYS * 128, 1024),
                                          kk > 0);
                    }
                    cm_wgmma_commit();
                    cm_wgmma_wait<0>();
                    cm_fence_acc(acc_dq);
                    if (a == 0) {
                        cm_fence_acc(acc_dv);
                        cm_fence_acc(acc_dk);
                        // Q, dO, the statistics and the bits of stage s are no longer read.
                        __syncwarp();
                        if (lane == 0) cm_mbar_arrive(bar(BAR_EMPTY(s)));
                    }
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(
                                         dst + cm_dq_offset(K0 / 8 + 8 * a + j, warp, lane)),
                                     "f"(acc_dq[j][0]), "f"(acc_dq[j][1]), "f"(acc_dq[j][2]), "f"(acc_dq[j][3])
                                     : "memory");
                    }
                }
            } else {
                cm_wgmma_wait<0>();
                cm_fence_acc(acc_dv);
                cm_fence_acc(acc_dk);
                __syncwarp();
                if (lane == 0) cm_mbar_arrive(bar(BAR_EMPTY(s)));
            }
        }
    }

    cm_bwd_store_rows(p.dk + batch * p.dk_stride_batch + kv_head * p.dk_stride_head + K0, p.dk_stride_row, acc_dk,
                      p.softmax_scale, key0, p.kv_len, warp, g, t);
    cm_bwd_store_rows(p.dv + batch * p.dv_stride_batch + kv_head * p.dv_stride_head + V0, p.dv_stride_row, acc_dv,
                      1.f, key0, p.kv_len, warp, g, t);
}

extern "C" __global__ void __launch_bounds__(DKDV_THREADS, 1)
    cm_bwd_dkdv(const __grid_constant__ CmBwdParams p, const __grid_constant__ CmTensorMap tm_q,
                const __grid_constant__ CmTensorMap tm_do, const __grid_constant__ CmTensorMap tm_k,
                const __grid_constant__ CmTensorMap tm_v) {
    extern __shared__ unsigned char smem_raw[];
    const u32 base = (cm_smem_addr(smem_raw) + 1023u) & ~1023u;
    const unsigned char* smem = smem_raw + (base - cm_smem_addr(smem_raw));
    auto bar = [&](int i) -> u32 { return base + OFF_BARS + 8 * i; };

    // A rank is one half of a key block here.
    const CmDkdvPair item = cm_dkdv_pair(p, 2 * p.bwd_num_n_blocks, blockIdx.x);
    const u32 batch = item.batch, kv_head = item.kv_head, head0 = item.head0, rank = item.rank;
    const u32 n_block = p.bwd_n_block_order[(u64)cm_bwd_mask(p, batch, head0) * p.bwd_num_n_blocks + rank / 2];
    const u32 half = rank % 2;
    const u32 key0 = n_block * KEY_BLOCK + half * CTA_KEYS;
    // A half entirely past kv_len has no key to compute (and writes none).
    u32 total = 0;
    if (key0 < p.kv_len) {
        for (u32 hg = 0; hg < p.heads_per_kv_head; ++hg) total += cm_dkdv_head(p, batch, head0 + hg, n_block).num_tiles;
    }

    if (threadIdx.x == 0) cm_dkdv_ring_init(bar(0), STAGES, CONSUMER_WARPS);
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        cm_regs_dealloc<PRODUCER_REGS>();
        if (threadIdx.x == 0 && total > 0) {
            cm_tma_prefetch_map(&tm_q);
            cm_tma_prefetch_map(&tm_do);
            cm_mbar_arrive_expect_tx(bar(BAR_KV), K_BYTES + V_BYTES);
#pragma unroll
            for (int a = 0; a < HEAD_DIM / 64; ++a) {
                cm_tma_load4(base + a * CTA_KEYS * 128, &tm_k, bar(BAR_KV), a * 64, key0, kv_head, batch);
            }
#pragma unroll
            for (int a = 0; a < HEAD_DIM_V / 64; ++a) {
                cm_tma_load4(base + OFF_V + a * CTA_KEYS * 128, &tm_v, bar(BAR_KV), a * 64, key0, kv_head, batch);
            }
            u32 it = 0;
            for (u32 hg = 0; hg < p.heads_per_kv_head; ++hg) {
                const CmDkdvHead hd = cm_dkdv_head(p, batch, head0 + hg, n_block);
                for (u32 ti = 0; ti < hd.num_tiles; ++ti, ++it) {
                    const u32 s = it % STAGES;
                    const CmDkdvTile tl = cm_dkdv_tile(p, hd, ti);
                    const bool partial = tl.partial;
                    const u32 row0 = tl.row0;
                    const u64 rows = ((u64)batch * p.num_heads + hd.head) * p.q_pad + row0;
                    cm_mbar_wait(bar(BAR_EMPTY(s)), ((it / STAGES) & 1) ^ 1);
                    const u32 full = bar(BAR_FULL(s));
                    cm_mbar_arrive_expect_tx(full,
                                             TILE_BYTES + TILE_BYTES_V + STATS_BYTES + (partial ? MASK_BYTES : 0));
                    const u32 sQ = base + OFF_Q + s * TILE_BYTES;
                    const u32 sdO = base + OFF_DO + s * TILE_BYTES_V;
#pragma unroll
                    for (int a = 0; a < HEAD_DIM / 64; ++a) {
                        cm_tma_load4(sQ + a * BLOCK_M * 128, &tm_q, full, a * 64, row0, hd.head, batch);
                    }
#pragma unroll
                    for (int a = 0; a < HEAD_DIM_V / 64; ++a) {
                        cm_tma_load4(sdO + a * BLOCK_M * 128, &tm_do, full, a * 64, row0, hd.head, batch);
                    }
                    const u32 stats = base + OFF_STATS + s * STATS_BYTES;
                    cm_bulk_load(stats, p.lse_log2 + rows, BLOCK_M * 4, full);
                    cm_bulk_load(stats + BLOCK_M * 4, p.delta + rows, BLOCK_M * 4, full);
                    if (partial) {
                        // The block's key-major bits: 2 u32 per key, this half's 64 keys.
                        cm_bulk_load(base + OFF_MASK + s * MASK_BYTES,
                                     p.bwd_partial_key_mask + ((u64)tl.index * KEY_BLOCK + half * CTA_KEYS) * 2,
                                     MASK_BYTES, full);
                    }
                }
            }
        }
        return;
    }

    cm_regs_alloc<CONSUMER_REGS>();
    if (warpgroup == 1) {
        wide_consumer<0>(p, smem, base, batch, head0, kv_head, n_block, key0, total);
    } else {
        wide_consumer<1>(p, smem, base, batch, head0, kv_head, n_block, key0, total);
    }
}
