"""Score terms against the same mask without them on the GPU machine (the "scores as well as
masks" targets): softcap, ALiBi (a linear bias), a T5 bucket table (a bias by distance,
learnable) and sinks (learnable), each on W1 (causal) and W6 (packed causal documents) at
q_len = kv_len = 32768, H16, head_dim 128, bf16, batch 1.

Correctness is tests/python/test_scores_cuda.py's (run it in the same call). Times forward and
forward + backward (fast mode; gradients of q, k, v and of the learnable table or sinks) with
CUDA events: median of `--runs` back-to-back calls after warm-up. Effective TFLOP/s as in
BENCHMARKS.md: forward 4 x head_dim x (visible pairs summed over heads) / time, forward +
backward 3.5x that.

    python3 scripts/bench-scores.py [--q-len 32768] [--runs 10] [--flex] [--json OUT.json]

With `--flex`, W1 also runs FlexAttention (torch.compile'd, Triton backend, the causal
`create_block_mask`) with the equivalent `score_mod` of each term (softcap, ALiBi, the T5
table as a captured tensor with its gradient; Flex has no sinks) in the same process.

Needs torch with CUDA and the compilemask wheel (built with the kernels).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import compilemask as cm
from compilemask import _ops
from cuda_timing import median_ms


def t5_buckets(n: int, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's unidirectional relative-position bucket of every distance d = q - k, index
    d + n - 1 (Raffel et al. 2020; transformers' `_relative_position_bucket`,
    bidirectional=False): exact below num_buckets / 2, logarithmic up to max_distance,
    keys after the query in bucket 0."""
    d = torch.arange(-(n - 1), n, dtype=torch.float64).clamp(min=0)
    exact = num_buckets // 2
    large = exact + (torch.log(d.clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).floor()
    return torch.where(d < exact, d, large.clamp(max=num_buckets - 1)).long()


def alibi_slopes(h: int) -> torch.Tensor:
    """ALiBi's head slopes for a power-of-two head count (Press et al. 2022): 2^(-8 (i + 1) / h)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])


def flex_rows(q, k, v, dout, n, slopes, table, bucket, flops, runs, ours) -> dict:
    """FlexAttention (Triton backend) on causal W1 with each term's `score_mod`, and our
    speed-up over it."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.accumulated_recompile_limit = 10000
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, n, n, device="cuda")
    bucket32 = bucket.to(torch.int32)
    mods = {
        "none": None,
        "softcap": lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0),
        "alibi": lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
        "t5_table": lambda s, b, h, qi, ki: s + table[h, bucket32[qi - ki + n - 1]],
    }
    out = {}
    for name, mod in mods.items():
        params = [q, k, v] + ([table] if name == "t5_table" else [])
        fn = lambda mod=mod: flex(q, k, v, score_mod=mod, block_mask=bm)  # noqa: E731
        fwd = median_ms(fn, runs, warmup=2)
        fwd_bwd = median_ms(lambda: torch.autograd.grad(fn(), params, dout), runs, warmup=2)
        out[name] = {"fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9, "fwd_bwd_ms": fwd_bwd,
                     "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e9,
                     "ours_over_flex_fwd": ours[name]["fwd_tflops"] / (flops / fwd / 1e9),
                     "ours_over_flex_fwd_bwd": ours[name]["fwd_bwd_tflops"] / (3.5 * flops / fwd_bwd / 1e9)}
        print("flex", name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-len", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    n, heads, d = a.q_len, 16, 128
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn((1, heads, n, d), generator=g, device=dev, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    bucket = t5_buckets(n).to(dev)
    table = (0.5 * torch.randn((heads, 32), generator=g, device=dev)).requires_grad_()
    sinks = torch.randn((heads,), generator=g, device=dev).requires_grad_()
    slopes = alibi_slopes(heads).to(dev)
    terms = {
        "softcap": dict(softcap=30.0),
        "softcap_50": dict(softcap=50.0),
        "alibi": dict(slopes=slopes),
        "t5_table": dict(table=table),
        "sinks": dict(sinks=sinks),
    }
    results = {"q_len": n, "heads": heads, "head_dim": d, "dtype": "bfloat16", "workloads": {}}
    for wname, program in (("W1", cm.builtin("causal")), ("W6", cm.builtin("document_causal"))):
        plan = program.plan(n)
        pt = plan.to_tensors(dev)
        dims = pt.plan_dims()
        flops = 4 * d * heads * plan.visible_pairs
        scale = 1.0 / math.sqrt(d)

        def plain():
            return cm.attention(q, k, v, plan)

        def scored(t):
            dist, ends = _ops.table_by_distance(t["table"], bucket) if "table" in t else (None, None)
            return _ops.attention_forward_score(
                q, k, v, list(pt.kernel), dims, scale, False, t.get("softcap", 0.0),
                [-1.0, 1.0, 0.0], t.get("slopes"), dist, ends, t.get("sinks"))[0]

        row = {}
        for tname, fn in [("none", plain)] + [(t, (lambda t=t: scored(terms[t]))) for t in terms]:
            params = [q, k, v] + [x for x in (terms.get(tname, {}).get("table"),
                                              terms.get(tname, {}).get("sinks")) if x is not None]
            fwd = median_ms(lambda: fn(), a.runs, warmup=2)

            def step():
                torch.autograd.grad(fn(), params, dout)

            fwd_bwd = median_ms(step, a.runs, warmup=2)
            row[tname] = {"fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9,
                          "fwd_bwd_ms": fwd_bwd, "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e9}
        for tname in terms:
            for key in ("fwd_tflops", "fwd_bwd_tflops"):
                row[tname][f"vs_none_{key}"] = row[tname][key] / row["none"][key]
        if a.flex and wname == "W1":
            row["flex_triton"] = flex_rows(q, k, v, dout, n, slopes, table, bucket, flops, a.runs, row)
        results["workloads"][wname] = {"visible_pairs_per_head": plan.visible_pairs, **row}
        print(wname, json.dumps(row, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
