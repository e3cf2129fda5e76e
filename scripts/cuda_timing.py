"""The GPU benchmark scripts' timers (scripts/bench-*.py import it: a script's own folder
is on sys.path when it runs)."""

from __future__ import annotations

import time

import torch


def median_ms(fn, runs: int, warmup: int = 3, calls: int = 1) -> float:
    """Median milliseconds per call of `fn` over `runs` samples after `warmup` untimed calls;
    each sample times `calls` back-to-back calls with CUDA events around them, synchronised.
    With `calls = 1` the time includes the host's work before the launch whenever the GPU
    is idle waiting for it; with more calls the host runs ahead of the GPU, so a sample
    measures device time (for kernels shorter than their host overhead, e.g. decode)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


def host_us(fn, calls: int = 50, warmup: int = 0) -> float:
    """Microseconds of host time per call of `fn` (Python, checks, launch) over `calls`
    back-to-back calls after `warmup` untimed ones, without waiting for the GPU in between
    (the launches queue behind each other); synchronised before and after."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6
