"""Per-head masks against one mask on the GPU machine (the "one plan, one launch" target).

A plan of 16 distinct per-head masks (sliding windows of 1K, 2K, ..., 16K keys, head h
seeing keys (q - 1024 (h + 1), q]) against a plan of one sliding window for every head whose
visible pairs come closest to the same total, both at q_len = kv_len = 32768, H16, head_dim
128, bf16, batch 1. Checks the per-head plan's output on sampled rows against float64 first,
then times forward and forward + backward (fast mode) with CUDA events: median of `--runs`
back-to-back calls after warm-up. Effective TFLOP/s as in BENCHMARKS.md: forward 4 x head_dim x
(visible pairs summed over heads) / time, forward + backward 3.5x that.

    python3 scripts/bench-perhead.py [--q-len 32768] [--runs 20] [--json OUT.json]

Needs torch with CUDA and the compilemask wheel (built with the kernels).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import compilemask as cm
from cuda_timing import median_ms


def visible_pairs(n: int, w: int) -> int:
    """Visible pairs of a causal sliding window of w keys over n rows: sum_q min(q + 1, w)."""
    w = min(w, n)
    return w * n - w * (w - 1) // 2


def check(q, k, v, plan, rows: list[int]) -> float:
    """Largest |out - float64| over the sampled rows of every head."""
    out = cm.attention(q, k, v, plan).double()
    worst = 0.0
    for h in range(q.shape[1]):
        for r in rows:
            keys = [kk for iv in plan.intervals(r, 0, h) for kk in range(iv[0], iv[1])]
            s = (q[0, h, r].double() @ k[0, h, keys].double().T) / math.sqrt(q.shape[-1])
            p = torch.softmax(s, -1)
            ref = p @ v[0, h, keys].double()
            worst = max(worst, (out[0, h, r] - ref).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-len", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    n, heads, d = a.q_len, 16, 128
    windows = [1024 * (h + 1) for h in range(heads)]
    per_head = cm.compile("mask = q - 1024 * (h + 1) < k <= q;").plan(n, num_heads=heads)
    assert per_head.num_masks == heads, per_head.num_masks
    total = sum(visible_pairs(n, w) for w in windows)
    # The single window whose 16 heads' pairs come closest to the per-head plan's.
    w1 = min(range(1, n + 1, 64), key=lambda w: abs(heads * visible_pairs(n, w) - total))
    single = cm.builtin("sliding_window", window=w1).plan(n)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((1, heads, n, d), generator=g, device="cuda", dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    err = check(q.detach(), k.detach(), v.detach(), per_head, [0, 1023, 5000, n - 1])
    results = {"q_len": n, "heads": heads, "head_dim": d, "dtype": "bfloat16",
               "per_head_windows": windows, "single_window": w1, "max_abs_err_sampled": err}
    for name, plan, pairs in (("per_head", per_head, total),
                              ("single", single, heads * visible_pairs(n, w1))):
        plan.to_tensors(q.device)
        flops = 4 * d * pairs
        fwd = median_ms(lambda: cm.attention(q, k, v, plan), a.runs)
        dout = torch.randn_like(q)

        def step():
            out = cm.attention(q, k, v, plan)
            torch.autograd.grad(out, (q, k, v), dout)

        fwd_bwd = median_ms(step, a.runs)
        results[name] = {"visible_pairs": pairs, "num_masks": plan.num_masks,
                         "fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9,
                         "fwd_bwd_ms": fwd_bwd, "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e9}
    for key in ("fwd_tflops", "fwd_bwd_tflops"):
        results[f"ratio_{key}"] = results["per_head"][key] / results["single"][key]
    print(json.dumps(results, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
