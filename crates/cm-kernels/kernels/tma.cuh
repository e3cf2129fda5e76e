// Hopper asynchrony (sm_90a): mbarriers, TMA tensor loads and warpgroup register
// reallocation, as inline PTX (NVRTC has no CUDA headers).
#pragma once
#include "common.cuh"

// A CUtensorMap as the host encoded it (cuTensorMapEncodeTiled); passed by value as a
// __grid_constant__ kernel parameter, so the TMA unit reads it from parameter space.
struct __align__(64) CmTensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ void cm_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (the TMA unit) before any use.
__device__ __forceinline__ void cm_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also announces `bytes` of TMA traffic the current phase must wait for.
__device__ __forceinline__ void cm_mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cm_mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Waits until the phase with parity `parity` has completed. A fresh barrier is in phase 0,
// so waiting on parity 1 returns at once: how producers pass their first pass over empty slots.
__device__ __forceinline__ void cm_mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// Loads the box at coordinates (c0 innermost .. c3) of `map` into shared memory at `dst`,
// completing `bytes` of `bar`'s transaction count; elements outside the tensor arrive as zeros.
__device__ __forceinline__ void cm_tma_load4(u32 dst, const CmTensorMap* map, u32 bar, int c0, int c1, int c2,
                                             int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(
            dst),
        "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to
// shared `dst` with the bulk copy engine, completing that many bytes of `bar`'s transaction
// count.
__device__ __forceinline__ void cm_bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void cm_tma_prefetch_map(const CmTensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// Warpgroup-wide register budget changes (every thread of the warpgroup executes them).
template <int N>
__device__ __forceinline__ void cm_regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void cm_regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
