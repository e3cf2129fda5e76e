// Hopper warpgroup matrix multiply (wgmma, sm_90a) for 128-thread warpgroups, with B (and
// optionally A) from 128-byte-swizzled shared memory.
//
// Shared-memory tiles: `rows` rows of HEAD_DIM 16-bit elements, stored as HEAD_DIM / 64
// column atoms of [rows][128 bytes]; inside an atom, 16-byte chunk c of row r sits at chunk
// position c ^ (r % 8) (the 128B swizzle the hardware undoes on absolute address bits, so each
// tile starts 1024-byte aligned). The same arrangement serves as a K-major B operand (K tile
// for S = Q K^T: N = keys, K = head_dim) and as an MN-major B operand (V tile for O = P V:
// K = keys, N = head_dim, transposed read).
#pragma once
#include "common.cuh"

#if CM_DTYPE_BF16
#define CM_WGMMA_AB ".bf16.bf16"
#else
#define CM_WGMMA_AB ".f16.f16"
#endif

// Byte offset of 16-byte chunk `chunk` (8 elements) of row `row` in a swizzled tile of `rows` rows.
__device__ __forceinline__ u32 cm_sw128_offset(u32 row, u32 chunk, u32 rows) {
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// Shared-memory matrix descriptor: start address, leading / stride byte offsets, 128B swizzle.
__device__ __forceinline__ u64 cm_wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// A = Q tile or B = K tile (K-major) for k-step ks (head_dim columns 16 ks .. 16 ks + 15) of a
// tile of `rows` rows: 32 bytes per k-step inside a 128-byte atom row, rows * 128 bytes per
// column atom; 8-row groups 1 KB apart.
__device__ __forceinline__ u64 cm_desc_k_major(u32 tile, u32 rows, int ks) {
    return cm_wgmma_desc(tile + (ks >> 2) * rows * 128 + (ks & 3) * 32, 16, 1024);
}
__device__ __forceinline__ u64 cm_desc_k_major64(u32 tile, int ks) { return cm_desc_k_major(tile, 64, ks); }

// B = V tile (MN-major) for k-step ks (keys 16 ks .. 16 ks + 15) of a tile of `rows` rows: 16
// rows of 128 bytes per k-step; the next 64 head_dim columns (LBO) one column atom further.
__device__ __forceinline__ u64 cm_desc_mn_major(u32 tile, u32 rows, int ks) {
    return cm_wgmma_desc(tile + ks * 2048, rows * 128, 1024);
}
__device__ __forceinline__ u64 cm_desc_mn_major64(u32 tile, int ks) { return cm_desc_mn_major(tile, 64, ks); }

__device__ __forceinline__ void cm_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void cm_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cm_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses of accumulator registers across wgmma issue/wait.
template <int J>
__device__ __forceinline__ void cm_fence_acc(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
    }
}

// As cm_fence_acc for register A fragments: placed after the wait of the wgmma that reads
// them, it keeps their registers live (and unreused) until then.
template <int J>
__device__ __forceinline__ void cm_fence_frag(u32 (&a)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
    }
}

// Makes this thread's generic-proxy shared-memory writes (cp.async included) visible to the
// async proxy that wgmma reads through; each writing thread runs it before the barrier.
__device__ __forceinline__ void cm_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

#define CM_ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])

// d (+)= a * B for m64n64k16: d is the warp's [8][4] mma-style fragment of 16 rows x 64 columns,
// a the [4] A fragment of its 16 rows x 16 k; accumulate = 0 overwrites d.
template <int TNSP_B>
__device__ __forceinline__ void cm_wgmma_n64(float (&d)[8][4], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, %38; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3), CM_ACC4(4), CM_ACC4(5), CM_ACC4(6), CM_ACC4(7)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TNSP_B));
}

// d (+)= A * B for m64n64k16 with both operands K-major in shared memory (descriptors).
__device__ __forceinline__ void cm_wgmma_n64_ss(float (&d)[8][4], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3), CM_ACC4(4), CM_ACC4(5), CM_ACC4(6), CM_ACC4(7)
        : "l"(a), "l"(b), "r"(accumulate));
}

// As cm_wgmma_n64 for m64n128k16 (d is [16][4]).
template <int TNSP_B>
__device__ __forceinline__ void cm_wgmma_n128(float (&d)[16][4], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %69, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, %70; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3), CM_ACC4(4), CM_ACC4(5), CM_ACC4(6), CM_ACC4(7),
          CM_ACC4(8), CM_ACC4(9), CM_ACC4(10), CM_ACC4(11), CM_ACC4(12), CM_ACC4(13), CM_ACC4(14), CM_ACC4(15)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TNSP_B));
}

// As cm_wgmma_n64 for m64n256k16 (d is [32][4]): the P V product of a head_dim_v-256 output.
template <int TNSP_B>
__device__ __forceinline__ void cm_wgmma_n256(float (&d)[32][4], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %133, 0; "
        "wgmma.mma_async.sync.aligned.m64n256k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 }, "
        "{%128, %129, %130, %131}, %132, p, 1, 1, %134; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3), CM_ACC4(4), CM_ACC4(5), CM_ACC4(6), CM_ACC4(7),
          CM_ACC4(8), CM_ACC4(9), CM_ACC4(10), CM_ACC4(11), CM_ACC4(12), CM_ACC4(13), CM_ACC4(14), CM_ACC4(15),
          CM_ACC4(16), CM_ACC4(17), CM_ACC4(18), CM_ACC4(19), CM_ACC4(20), CM_ACC4(21), CM_ACC4(22), CM_ACC4(23),
          CM_ACC4(24), CM_ACC4(25), CM_ACC4(26), CM_ACC4(27), CM_ACC4(28), CM_ACC4(29), CM_ACC4(30), CM_ACC4(31)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TNSP_B));
}

// d (+)= A * B for m64n128k16 with both operands K-major in shared memory (descriptors).
__device__ __forceinline__ void cm_wgmma_n128_ss(float (&d)[16][4], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3), CM_ACC4(4), CM_ACC4(5), CM_ACC4(6), CM_ACC4(7),
          CM_ACC4(8), CM_ACC4(9), CM_ACC4(10), CM_ACC4(11), CM_ACC4(12), CM_ACC4(13), CM_ACC4(14), CM_ACC4(15)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (+)= A * B for m64n64k16 with both operands in shared memory, each K-major (0) or MN-major
// (1, a transposed read: the operand stored with its K index along rows, as a V tile is).
template <int TNSP_A, int TNSP_B>
__device__ __forceinline__ void cm_wgmma_n64_ss_t(float (&d)[8][4], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3), CM_ACC4(4), CM_ACC4(5), CM_ACC4(6), CM_ACC4(7)
        : "l"(a), "l"(b), "r"(accumulate), "n"(TNSP_A), "n"(TNSP_B));
}

// As cm_wgmma_n64_ss_t for m64n128k16 (d is [16][4]).
template <int TNSP_A, int TNSP_B>
__device__ __forceinline__ void cm_wgmma_n128_ss_t(float (&d)[16][4], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3), CM_ACC4(4), CM_ACC4(5), CM_ACC4(6), CM_ACC4(7),
          CM_ACC4(8), CM_ACC4(9), CM_ACC4(10), CM_ACC4(11), CM_ACC4(12), CM_ACC4(13), CM_ACC4(14), CM_ACC4(15)
        : "l"(a), "l"(b), "r"(accumulate), "n"(TNSP_A), "n"(TNSP_B));
}

// As cm_wgmma_n64_ss_t for m64n32k16 (d is [4][4]): half a 128-byte swizzle atom of N, for
// head_dim-64 products split between two warpgroups.
template <int TNSP_A, int TNSP_B>
__device__ __forceinline__ void cm_wgmma_n32_ss_t(float (&d)[4][4], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %18, 0; "
        "wgmma.mma_async.sync.aligned.m64n32k16.f32" CM_WGMMA_AB " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, p, 1, 1, %19, %20; }"
        : CM_ACC4(0), CM_ACC4(1), CM_ACC4(2), CM_ACC4(3)
        : "l"(a), "l"(b), "r"(accumulate), "n"(TNSP_A), "n"(TNSP_B));
}

// d (+)= a * B at N = 64 (d [8][4]), 128 (d [16][4]) or 256 (d [32][4]), A from registers, B K-major (0)
// or MN-major (1); cm_wgmma_ss likewise with both operands in shared memory, also at N = 32
// (d [4][4]): the head_dim-wide products pick the shape by overload.
template <int TNSP_B>
__device__ __forceinline__ void cm_wgmma_rs(float (&d)[8][4], const u32 (&a)[4], u64 b, int accumulate) {
    cm_wgmma_n64<TNSP_B>(d, a, b, accumulate);
}
template <int TNSP_B>
__device__ __forceinline__ void cm_wgmma_rs(float (&d)[16][4], const u32 (&a)[4], u64 b, int accumulate) {
    cm_wgmma_n128<TNSP_B>(d, a, b, accumulate);
}
template <int TNSP_B>
__device__ __forceinline__ void cm_wgmma_rs(float (&d)[32][4], const u32 (&a)[4], u64 b, int accumulate) {
    cm_wgmma_n256<TNSP_B>(d, a, b, accumulate);
}
template <int TNSP_A, int TNSP_B>
__device__ __forceinline__ void cm_wgmma_ss(float (&d)[4][4], u64 a, u64 b, int accumulate) {
    cm_wgmma_n32_ss_t<TNSP_A, TNSP_B>(d, a, b, accumulate);
}
template <int TNSP_A, int TNSP_B>
__device__ __forceinline__ void cm_wgmma_ss(float (&d)[8][4], u64 a, u64 b, int accumulate) {
    cm_wgmma_n64_ss_t<TNSP_A, TNSP_B>(d, a, b, accumulate);
}
template <int TNSP_A, int TNSP_B>
__device__ __forceinline__ void cm_wgmma_ss(float (&d)[16][4], u64 a, u64 b, int accumulate) {
    cm_wgmma_n128_ss_t<TNSP_A, TNSP_B>(d, a, b, accumulate);
}

#undef CM_ACC4
