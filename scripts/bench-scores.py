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

With `--flex`, W1 also runs FlexAttention (torch.compile'd, the causal `create_block_mask`)
on both of its backends, Triton and FLASH (FlashAttention-4's kernels, where the peers'
staging installs them), with the equivalent `score_mod` of each term (softcap, ALiBi, the T5
table as a captured tensor with its gradient; Flex has no sinks), and FlashAttention-4's own
causal forward and backward without and with its softcap, in the same process.

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
    """FlexAttention on causal W1 with each term's `score_mod`, on both of its backends
    (Triton, and FLASH: FlashAttention-4's CuTe kernels, where the peers' staging installs
    them and the `score_mod` lowers; the error is recorded otherwise), and our speed-up over
    the faster of the two."""
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
    backends = {"triton": None, "flash": {"BACKEND": "FLASH"}}
    out = {}
    for name, mod in mods.items():
        params = [q, k, v] + ([table] if name == "t5_table" else [])
        row = {}
        for backend, options in backends.items():
            fn = lambda mod=mod, options=options: flex(  # noqa: E731
                q, k, v, score_mod=mod, block_mask=bm, kernel_options=options)
            try:
                fwd = median_ms(fn, runs, warmup=2)
                row[f"{backend}_fwd_ms"] = fwd
                row[f"{backend}_fwd_tflops"] = flops / fwd / 1e9
            except Exception as e:  # noqa: BLE001
                row[f"{backend}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            try:
                fwd_bwd = median_ms(lambda fn=fn: torch.autograd.grad(fn(), params, dout), runs,
                                    warmup=2)
                row[f"{backend}_fwd_bwd_ms"] = fwd_bwd
                row[f"{backend}_fwd_bwd_tflops"] = 3.5 * flops / fwd_bwd / 1e9
            except Exception as e:  # noqa: BLE001
                row[f"{backend}_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        for what in ("fwd", "fwd_bwd"):
            best = max((row[f"{b}_{what}_tflops"] for b in backends
                        if f"{b}_{what}_tflops" in row), default=None)
            if best is not None:
                row[f"best_{what}_tflops"] = best
                row[f"ours_over_flex_{what}"] = ours[name][f"{what}_tflops"] / best
        out[name] = row
        print("flex", name, json.dumps(row), flush=True)
    return out


def fa4_rows(q, k, v, dout, flops, runs, ours) -> dict:
    """FlashAttention-4's native causal attention (`flash_attn.cute.flash_attn_func`, inputs
    `[batch, seq, heads, head_dim]`) without and with its softcap of 30, and our speed-up
    over it; its import or launch error where it does not run."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    qb, kb, vb = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dob = dout.transpose(1, 2).contiguous()
    out = {}
    for name, softcap in (("none", 0.0), ("softcap", 30.0)):
        def fn(softcap=softcap):
            o = flash_attn_func(qb, kb, vb, causal=True, softcap=softcap)
            return o[0] if isinstance(o, tuple) else o

        row = {}
        try:
            fwd = median_ms(fn, runs, warmup=2)
            fwd_bwd = median_ms(lambda: torch.autograd.grad(fn(), [qb, kb, vb], dob), runs,
                                warmup=2)
            row.update(fwd_ms=fwd, fwd_tflops=flops / fwd / 1e9, fwd_bwd_ms=fwd_bwd,
                       fwd_bwd_tflops=3.5 * flops / fwd_bwd / 1e9)
            for what in ("fwd", "fwd_bwd"):
                row[f"ours_over_fa4_{what}"] = (ours[name][f"{what}_tflops"]
                                                / row[f"{what}_tflops"])
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out[name] = row
        print("fa4", name, json.dumps(row), flush=True)
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
                q, k, v, pt.kernel_flat, list(pt.kernel_lens), dims, scale, False,
                t.get("softcap", 0.0),
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
            row["flex"] = flex_rows(q, k, v, dout, n, slopes, table, bucket, flops, a.runs, row)
            row["fa4_native"] = fa4_rows(q, k, v, dout, flops, a.runs, row)
        results["workloads"][wname] = {"visible_pairs_per_head": plan.visible_pairs, **row}
        print(wname, json.dumps(row, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
