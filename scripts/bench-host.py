"""Host time of the Python package's calls on the GPU machine (issue 16's "host time per
decode step"): microseconds of Python, checks and launch per call, over back-to-back calls
whose GPU work is left queued (the GPU is waited for only around each timed loop).

    PYTHONPATH=<installed wheel> python3 scripts/bench-host.py [--profile]

Decode step: batch 64, one new row each, GQA 32/8, head_dim 128, bf16, kv_len 8192 - 512 and
growing, page size 16, the decode kernel, called eagerly and replayed as a CUDA graph
(docs/python.md's loop). Also the training forward at q_len 1024, H16, d128 (small enough
that the host's time matters). `--profile` adds cProfile's top entries of a
decode step and of the forward.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch

import compilemask as cm
from compilemask import _ops
from cuda_timing import host_us
from decode_inputs import full_rows, interleaved_table


def report(name: str, fn, calls: int) -> None:
    print(f"{name:58s} {host_us(fn, calls, warmup=10):8.1f} us", flush=True)


def profile(name: str, fn, calls: int) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"\n== cProfile: {name}, {calls} calls")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="add cProfile's top entries")
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    batch, h, h_kv, d, kv, ps = 64, 32, 8, 128, 8192, 16
    pages = kv // ps
    q = torch.randn(batch, h, d, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(pages * batch, ps, h_kv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = interleaved_table(batch, pages, dev)
    tensors = full_rows(batch, kv, dev)
    scale = d ** -0.5
    # Room for every append below: 8192 - 512 keys, one more per step.
    step = cm.builtin("causal").plan_step(1, [kv - 512] * batch)

    def decode_step():
        step.append(1)
        return cm.paged_attention(q, kc, vc, table, step, scale=scale, kernel="decode")

    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    report("_ops.paged_attention_cuda (StepTensors given)",
            lambda: _ops.paged_attention_cuda(q, kc, vc, table, tensors, scale, False), 200)
    report("cm.paged_attention(..., step), tensors cached",
            lambda: cm.paged_attention(q, kc, vc, table, step, scale=scale, kernel="decode"), 200)
    report("step.append(1)", lambda: step.append(1), 50)
    report("step.append(1) + step.to_tensors(device)",
            lambda: (step.append(1), step.to_tensors(dev)), 50)
    report("decode step: step.append(1) + cm.paged_attention(..., step)", decode_step, 50)

    # The CUDA graph loop of docs/python.md: the step's arrays written into captured tensors.
    g_step = cm.builtin("causal").plan_step(1, [kv - 512] * batch)
    g_tensors = g_step.to_tensors(dev, max_intervals=4 * g_step.num_intervals)
    cm.paged_attention(q, kc, vc, table, g_tensors, scale=scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cm.paged_attention(q, kc, vc, table, g_tensors, scale=scale)

    def graph_step():
        g_step.append(1)
        g_step.write_tensors(g_tensors)
        graph.replay()

    report("step.append(1) + step.write_tensors(tensors)",
           lambda: (g_step.append(1), g_step.write_tensors(g_tensors)), 50)
    report("graph step: append + write_tensors + graph.replay()", graph_step, 50)
    if a.profile:
        profile("decode step", decode_step, 40)

    plan = cm.builtin("causal").plan(q_len=1024)
    pt = plan.to_tensors(dev)
    x = torch.randn(1, 16, 1024, 128, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        report("cm.attention forward, q_len 1024, no grad", lambda: cm.attention(x, x, x, pt), 200)
    xg = x.clone().requires_grad_()
    report("cm.attention forward, q_len 1024, q requires grad",
            lambda: cm.attention(xg, x, x, pt), 200)
    if a.profile:
        with torch.no_grad():
            profile("attention forward, no grad", lambda: cm.attention(x, x, x, pt), 200)


if __name__ == "__main__":
    main()
