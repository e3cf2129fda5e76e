"""The GPU benchmark scripts' one timer (scripts/bench-*.py import it: a script's own folder
is on sys.path when it runs)."""

from __future__ import annotations

import torch


def median_ms(fn, runs: int, warmup: int = 3) -> float:
    """Median milliseconds of `runs` calls of `fn` after `warmup` untimed ones, each call
    timed with CUDA events around it and synchronised."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]
