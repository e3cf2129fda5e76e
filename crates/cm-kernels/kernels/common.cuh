// Shared definitions for the CompileMask kernels. Compiled by NVRTC with no CUDA headers, so
// everything the kernels need (fixed-width types, conversions, tensor-core instructions) is
// spelled out here with inline PTX for sm_90a.
#pragma once

// 1 in the variants that apply the score terms that change logits (CmScoreParams); the
// others read only the sinks, at normalisation.
#ifndef CM_SCORE
#define CM_SCORE 0
#endif

// log2(e): natural-log quantities (lse, biases, sinks) into the kernels' log2 domain.
#define CM_LOG2E 1.4426950408889634f

// The shape every variant declares (cm_kernels::Variant): the tile of the descriptor lists it
// reads (CM_BLOCK_M query rows x CM_BLOCK_N keys), the depth of its load ring (CM_STAGES; 1
// without one) and its threads per CTA (CM_THREADS). A kernel either takes them or checks them
// against what it is written for (CM_CHECK_SHAPE), so a table entry and a source cannot
// disagree silently.
#if !defined(CM_BLOCK_M) || !defined(CM_BLOCK_N) || !defined(CM_STAGES) || !defined(CM_THREADS)
#error "CM_BLOCK_M, CM_BLOCK_N, CM_STAGES and CM_THREADS must be defined (cm_kernels::Variant::defines)"
#endif
#define CM_CHECK_SHAPE(block_m, block_n, stages, threads)                                                 \
    static_assert(CM_BLOCK_M == (block_m) && CM_BLOCK_N == (block_n) && CM_STAGES == (stages) &&            \
                      CM_THREADS == (threads),                                                              \
                  "the variant's declared shape (cm_kernels::Variant) is not the one this kernel is written for")

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// One visible run of keys, half-open [start, end); matches cm_plan::KeyInterval.
struct CmKeyInterval {
    u32 start;
    u32 end;
};

// Score terms (the score part of a program, docs/language.md): how a visible pair's logit is
// formed before the softmax. With s = softmax_scale * (q . k):
//   s' = softcap > 0 ? softcap * tanh(s / softcap) : s
//        + slopes[h] * (q_coef * q + k_coef * k + offset)          (linear bias, e.g. ALiBi)
//        + dist_bias[h * dist_head_stride + q - k + kv_len - 1]    (a bias by distance, e.g.
//                                                                   a T5 bucket table gathered)
// and each row's softmax also counts exp(sinks[h]) in its denominator (a sink has value 0).
// The `CM_SCORE` variants read every term; the others only the sinks, which change a row's
// normalisation and not its logits (cm_sink_normalise, every forward). A null pointer or a
// zero softcap switches a term off.
// Must match cm_cuda::ScoreParams (#[repr(C)], pointers first, 64 bytes).
struct CmScoreParams {
    const float* slopes;       // [num_heads], natural-log units
    const float* dist_bias;    // [num_heads or 1, q_len + kv_len - 1], natural-log units
    const u32* dist_run_end;   // [q_len + kv_len - 1]: the last index of each index's run of equal
                               // values (a key tile whose distances lie in one run adds one
                               // constant); null: always gather
    const float* sinks;        // [num_heads] sink logits (natural log); forward only
    float* dist_bias_grad;     // [num_heads or 1, q_len + kv_len - 1]: the backward adds
                               // d loss / d dist_bias with fp32 atomics; null: not wanted
    float softcap;             // 0: none
    float inv_softcap;         // 1 / softcap
    float q_coef, k_coef, offset;
    u32 dist_head_stride;      // q_len + kv_len - 1, or 0 when one distance table serves every head
};

// Kernel parameters, passed by value. Must match cm_cuda::launch::FwdParams field for field
// (#[repr(C)]): 8-byte fields first so that neither side inserts padding.
// Tensors are [batch, heads, seq, head_dim] with a contiguous last dim; strides in elements.
struct CmFwdParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;  // [batch, num_heads, q_len], seq stride 1; null when not requested
    i64 q_stride_batch, q_stride_head, q_stride_row;
    i64 k_stride_batch, k_stride_head, k_stride_row;
    i64 v_stride_batch, v_stride_head, v_stride_row;
    i64 o_stride_batch, o_stride_head, o_stride_row;
    i64 lse_stride_batch, lse_stride_head;
    // Tile descriptor at the kernel's tile shape (see cm_plan::TileDescriptor).
    const u32* m_block_order;  // [num_m_blocks] query blocks, heaviest first
    const u32* kv_offsets;     // [num_m_blocks + 1]
    const u32* kv_indices;     // [num_partial]
    const u32* full_kv_offsets;  // [num_m_blocks + 1]
    const u32* full_kv_indices;  // [num_full]
    // Each partial tile's visibility, row by row: bit c % 32 of word c / 32 of a row set when
    // key n_block * BLOCK_N + c is visible from it; rows past q_len have no bits.
    const u32* partial_row_mask;   // [num_partial, BLOCK_M, BLOCK_N / 32]
    u32* scheduler;  // fwd_ws: [next work item, finished CTAs], zero between launches
    const u32* mask_index;  // the mask of (batch, head) at batch * mask_stride_batch + head * mask_stride_head
    // fwd_ws built with CM_PAGED (a serving step's rows, cm_serve::Prefill): K and V come from
    // a paged cache, key block n of the virtual key space from sequence key_blocks[n].x,
    // logical keys key_blocks[n].y .. + key_blocks[n].z, through block_table; null otherwise.
    const int* block_table;   // [num_seqs, block_table_stride] page numbers
    const int4* key_blocks;   // [kv_len / BLOCK_N]: (seq, first_key, valid_keys, 0)
    i64 block_table_stride;
    u32 q_len;
    u32 kv_len;
    u32 heads_per_kv_head;  // GQA group size: query head h reads kv head h / heads_per_kv_head
    float scale_log2;       // softmax_scale * log2(e): scores are exponentiated with exp2
    // The launch's extent; the persistent fwd_ws walks num_m_blocks x num_heads x batch items.
    u32 num_m_blocks;
    u32 num_heads;
    u32 batch;
    u32 num_masks;
    u32 mask_stride_batch;  // 0 when one row of masks serves every batch
    u32 mask_stride_head;   // 0 when one mask serves every head
    // fwd_ws: (batch, head) pairs whose items are interleaved (heaviest query blocks of all
    // of them first), as many as the L2 holds the K and V of; 1: one pair after the other.
    u32 ws_head_group;
    u32 page_shift;  // CM_PAGED: log2(page_size)
    u32 page_rows;   // CM_PAGED: rows per TMA box of the cache, min(page_size, BLOCK_N)
    u32 table_rows;  // CM_PAGED: the block table's [num_seqs, max_pages_per_seq], >= 1 each:
    u32 table_cols;  // every entry it reads is clamped inside
    u32 pad_;
    CmScoreParams score;
};

static_assert(sizeof(CmScoreParams) == 64, "must match cm_cuda::ScoreParams");
static_assert(sizeof(CmFwdParams) == 368, "must match cm_cuda::forward::FwdParams");

// The plan's mask of (batch, head), an index into its per-mask arrays (cm_cuda::PlanArray).
// The host checked every entry when it built the plan; the clamp keeps a corrupted index
// inside the arrays.
__device__ __forceinline__ u32 cm_mask_of(const u32* mask_index, u32 stride_batch, u32 stride_head, u32 num_masks,
                                          u32 batch, u32 head) {
    const u32 m = mask_index[batch * stride_batch + head * stride_head];
    return m < num_masks ? m : num_masks - 1;
}

// One mask's forward lists: the fixed-stride arrays at that mask's base (the partial and full
// tile lists and the row bits are concatenated, and the offsets here point into them).
struct CmFwdLists {
    const u32* m_block_order;    // [num_m_blocks]
    const u32* kv_offsets;       // [num_m_blocks + 1]
    const u32* full_kv_offsets;  // [num_m_blocks + 1]
};

__device__ __forceinline__ CmFwdLists cm_fwd_lists(const CmFwdParams& p, u32 batch, u32 head) {
    const u64 mask = cm_mask_of(p.mask_index, p.mask_stride_batch, p.mask_stride_head, p.num_masks, batch, head);
    CmFwdLists l;
    l.m_block_order = p.m_block_order + mask * p.num_m_blocks;
    l.kv_offsets = p.kv_offsets + mask * (p.num_m_blocks + 1);
    l.full_kv_offsets = p.full_kv_offsets + mask * (p.num_m_blocks + 1);
    return l;
}

__device__ __forceinline__ float cm_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ u32 cm_smem_addr(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills, which is how rows past the
// end of a sequence become zeros (never garbage that could turn into NaN through 0 * NaN).
__device__ __forceinline__ void cm_cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cm_cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cm_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ void cm_ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void cm_ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// D = A * B + D for one m16n8k16 tile, fp32 accumulators.
__device__ __forceinline__ void cm_mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if CM_DTYPE_BF16
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats to a packed pair of 16-bit values, round to nearest even; `lo` lands in the low
// half, which is the lower column for mma fragments and the lower address in memory.
__device__ __forceinline__ u32 cm_pack2(float lo, float hi) {
    u32 r;
#if CM_DTYPE_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// x, opaque to the compiler where it is read: a loop-invariant value (a shared-memory tile's
// address) is then formed again where it is used instead of being hoisted out of the loop
// into registers held across it, which kernels at their register limit would spill.
__device__ __forceinline__ u32 cm_opaque(u32 x) {
    asm volatile("mov.b32 %0, %0;" : "+r"(x));
    return x;
}

// 2^x with ex2(-inf) = +0, which the NaN-free softmax relies on.
__device__ __forceinline__ float cm_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
