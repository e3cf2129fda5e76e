"""Serving decode on the GPU machine against the peers in one process (the "serving" targets):
a batch of 64 sequences, one new token each, kv_len 8K / 32K / 128K, GQA 32/8, head_dim 128,
bf16, page sizes 16 and 64.

- ours: `compilemask._ops.paged_attention_cuda` on a paged cache (pages of a sequence
  interleaved with the others', as a cache grown one step at a time lays them out);
- FlexAttention's decoding path (torch.compile'd `flex_attention` with q_len 1 and
  `enable_gqa`, no mask: a decode row sees its whole cache) on contiguous caches
  `[batch, num_kv_heads, kv_len, head_dim]` (the same bytes, no page indirection);
- FlashAttention-4 (`flash_attn.cute.flash_attn_varlen_func` with `page_table`) on the same
  paged cache, where it runs (its error is recorded otherwise).

Then the two mask targets, ours against FlexAttention with the equivalent `mask_mod` (the peer
that can express them): tree decode (batch 16, a random 64-node draft tree per sequence over a
32K cached prefix: node i sees the prefix, its ancestors and itself) and shared-prompt scoring
(one 8K prompt and 16 responses of 512 tokens: each response's rows see the prompt and their
own response causally; ours reads the prompt's pages through every response's block table,
Flex one packed sequence of prompt and responses; FlashAttention-4, which expresses it too, on
the same paged cache with bottom-right causal), as TFLOP/s of visible pairs
(4 x head_dim x num_heads x pairs). Ours runs each through both of `compilemask.paged_attention`'s
kernels on a planned `Step` (`kernel="decode"` and `kernel="prefill"`, the paged forward),
after checking that they agree; `over_flex` takes the faster.

Each decode row is reported as median milliseconds per call of `--runs` samples of `--calls`
back-to-back calls (device time: the host's work per call, reported as `host_us` for ours,
overlaps the GPU's) and TB/s of K and V read (batch x kv_len
x num_kv_heads x head_dim x 2 bytes x 2), with the device-to-device copy bandwidth measured in
the same run (a 4 GiB copy reads and writes 4 GiB each). Correctness is
tests/python/test_paged_cuda.py's and cm-decode-test's; here ours is also checked against
Flex's output on the same keys.

    python3 scripts/bench-decode.py [--runs 20] [--calls 10] [--json OUT.json] [--kv 8192,32768,131072]
"""

from __future__ import annotations

import argparse
import json
import traceback
from types import SimpleNamespace

import torch
import torch._dynamo
from torch.nn.attention.flex_attention import flex_attention

import compilemask as cm
from compilemask import _ops

# Back-to-back calls per timed sample (--calls).
CALLS = 10


from cuda_timing import host_us, median_ms
from decode_inputs import full_rows, interleaved_table


def reference(q, k4, v4, scale, chunk=8):
    """float32 softmax attention of one query row per sequence over its contiguous keys
    (GQA: query head h reads kv head h // group), a few sequences at a time."""
    batch, h, d = q.shape
    h_kv = k4.shape[1]
    out = torch.empty_like(q)
    for b in range(0, batch, chunk):
        qg = q[b:b + chunk].float().view(-1, h_kv, h // h_kv, d)
        k, v = k4[b:b + chunk].float(), v4[b:b + chunk].float()
        p = torch.softmax(torch.einsum("bgrd,bgkd->bgrk", qg, k) * scale, -1)
        out[b:b + chunk] = torch.einsum("bgrk,bgkd->bgrd", p, v).reshape(-1, h, d).to(q.dtype)
    return out


def _tree_parents(n: int, gen: torch.Generator) -> list:
    """A random draft tree in depth-first order: node i's parent is an earlier node."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def both_kernels(row: dict, q, kc, vc, table, step, scale, runs, flops):
    """Times `step` through both kernels of `compilemask.paged_attention` into `row`
    (`decode_ms`, `prefill_ms`, their TFLOP/s, and `ms` / `tflops` / `kernel` of the faster)
    after checking that they agree; returns the faster as a callable."""
    calls = {k: (lambda k=k: cm.paged_attention(q, kc, vc, table, step, scale=scale, kernel=k))
             for k in ("decode", "prefill")}
    row["max_abs_diff_decode_vs_prefill"] = (
        calls["decode"]().float() - calls["prefill"]().float()).abs().max().item()
    for k, fn in calls.items():
        ms = median_ms(fn, runs, calls=CALLS)
        row[f"{k}_ms"], row[f"{k}_tflops"] = ms, flops / ms / 1e9
    best = min(calls, key=lambda k: row[f"{k}_ms"])
    row.update(kernel=best, ms=row[f"{best}_ms"], tflops=row[f"{best}_tflops"])
    return calls[best]


def mask_targets(runs: int, flex, fa4) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask
    dev = "cuda"
    h, h_kv, d = 32, 8, 128
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(1)
    i32 = dict(dtype=torch.int32, device=dev)
    out = {}

    # Tree decode: 16 sequences x 64 nodes over a 32K prefix, page size 64.
    b, n, prefix, ps = 16, 64, 32768, 64
    kv = prefix + n
    anc = torch.zeros((b, n, n), dtype=torch.bool)
    rows, parents = [], []
    for s in range(b):
        par = _tree_parents(n, gen)
        parents.append(par)
        for i in range(n):
            j = i
            while j >= 0:
                anc[s, i, j] = True
                j = par[j]
            keys = [prefix + j for j in range(n) if anc[s, i, j]]
            row = [[0, prefix]]
            for k in keys:
                if row[-1][1] == k:
                    row[-1][1] = k + 1
                else:
                    row.append([k, k + 1])
            rows.append(row)
    pairs = sum(e - a for row in rows for a, e in row)
    pages = kv // ps + 1
    kc = torch.randn((b * pages, ps, h_kv, d), device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(b * pages, **i32).view(b, pages)
    flat = [x for row in rows for iv in row for x in iv]
    lens = [len(row) for row in rows]
    tensors = SimpleNamespace(
        cu_q=torch.arange(0, b * n + 1, n, **i32), kv_len=torch.full((b,), kv, **i32),
        row_ptr=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), **i32),
        intervals=torch.tensor(flat, **i32), max_q_len=n)
    q = torch.randn((b * n, h, d), device=dev, dtype=torch.bfloat16)
    step = cm.builtin("tree_decode").plan_step([n] * b, [kv] * b,
                                               params=[{"parents": p} for p in parents])
    flops = 4 * d * h * pairs
    tree = {"batch": b, "nodes": n, "prefix": prefix, "step_rows_match": step.intervals == flat}
    ours = both_kernels(tree, q, kc, vc, table, step, scale, runs, flops)
    try:
        # Flex on the same keys, contiguous: [b, h_kv, kv, d].
        pos = torch.arange(kv, device=dev)
        k4 = kc.view(b, pages * ps, h_kv, d)[:, :kv].transpose(1, 2).contiguous()
        v4 = vc.view(b, pages * ps, h_kv, d)[:, :kv].transpose(1, 2).contiguous()
        anc_d = anc.to(dev)

        def mask_mod(bb, hh, qi, ki):
            kt = (ki - prefix).clamp(min=0)
            return (ki < prefix) | anc_d[bb, qi, kt]

        bm = create_block_mask(mask_mod, b, None, n, kv, device=dev)
        q4 = q.view(b, n, h, d).transpose(1, 2)
        fl = lambda: flex(q4, k4, v4, block_mask=bm, scale=scale, enable_gqa=True)  # noqa: E731
        err = (ours().float() - fl().transpose(1, 2).reshape(b * n, h, d).float()).abs().max().item()
        fms = median_ms(fl, runs, calls=CALLS)
        tree.update(flex_ms=fms, flex_tflops=flops / fms / 1e9, over_flex=fms / tree["ms"],
                    max_abs_diff_vs_flex=err)
        del k4, v4, pos
    except Exception as e:  # noqa: BLE001
        tree["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print("tree", json.dumps(tree), flush=True)
    out["tree_decode"] = tree
    del kc, vc

    # Shared-prompt scoring: an 8K prompt, 16 responses of 512, page size 64.
    p_len, r, r_len, ps = 8192, 16, 512, 64
    kv = p_len + r_len
    p_pages, r_pages = p_len // ps, r_len // ps
    kc = torch.randn((p_pages + r * r_pages, ps, h_kv, d), device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.stack([torch.cat([torch.arange(p_pages), p_pages + s * r_pages + torch.arange(r_pages)])
                         for s in range(r)]).to(**i32)
    cu = torch.arange(0, r * r_len + 1, r_len, **i32)
    rows_end = torch.arange(p_len + 1, kv + 1, **i32).repeat(r)
    tensors = SimpleNamespace(
        cu_q=cu, kv_len=torch.full((r,), kv, **i32), row_ptr=torch.arange(r * r_len + 1, **i32),
        intervals=torch.stack([torch.zeros_like(rows_end), rows_end], 1).reshape(-1).contiguous(),
        max_q_len=r_len)
    q = torch.randn((r * r_len, h, d), device=dev, dtype=torch.bfloat16)
    pairs = r * sum(p_len + i + 1 for i in range(r_len))
    flops = 4 * d * h * pairs
    step = cm.builtin("causal").plan_step([r_len] * r, [kv] * r)
    shared = {"prompt": p_len, "responses": r, "response_len": r_len,
              "step_rows_match": step.intervals == tensors.intervals.tolist()}
    ours = both_kernels(shared, q, kc, vc, table, step, scale, runs, flops)
    try:
        total = p_len + r * r_len
        k_p = kc[:p_pages].reshape(p_len, h_kv, d)
        k_r = kc[p_pages:].reshape(r * r_len, h_kv, d)
        v_p = vc[:p_pages].reshape(p_len, h_kv, d)
        v_r = vc[p_pages:].reshape(r * r_len, h_kv, d)
        k4 = torch.cat([k_p, k_r]).transpose(0, 1)[None].contiguous()
        v4 = torch.cat([v_p, v_r]).transpose(0, 1)[None].contiguous()

        def mask_mod(bb, hh, qi, ki):
            # query qi is response token qi of the packed responses; key ki of the packed sequence
            qr, kr = qi // r_len, (ki - p_len) // r_len
            return (ki < p_len) | ((kr == qr) & (ki - p_len <= qi))

        bm = create_block_mask(mask_mod, 1, None, r * r_len, total, device=dev)
        q4 = q.transpose(0, 1)[None]
        fl = lambda: flex(q4, k4, v4, block_mask=bm, scale=scale, enable_gqa=True)  # noqa: E731
        err = (ours().float() - fl()[0].transpose(0, 1).float()).abs().max().item()
        fms = median_ms(fl, runs, calls=CALLS)
        shared.update(flex_ms=fms, flex_tflops=flops / fms / 1e9, over_flex=fms / shared["ms"],
                      max_abs_diff_vs_flex=err)
    except Exception as e:  # noqa: BLE001
        shared["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if fa4 is not None:
        # FA4 on the same paged cache: each response a sequence of the prompt's pages and its
        # own, bottom-right causal (FlashAttention's causal for seqlen_q < seqlen_k).
        try:
            seqused = torch.full((r,), kv, **i32)

            def fa():
                o = fa4(q, kc, vc, cu_seqlens_q=cu, cu_seqlens_k=None, seqused_k=seqused,
                        max_seqlen_q=r_len, page_table=table, softmax_scale=scale, causal=True,
                        pack_gqa=True)
                return o[0] if isinstance(o, tuple) else o

            shared["max_abs_diff_vs_fa4"] = (ours().float() - fa().float()).abs().max().item()
            fa_ms = median_ms(fa, runs, calls=CALLS)
            shared.update(fa4_ms=fa_ms, fa4_tflops=flops / fa_ms / 1e9, over_fa4=fa_ms / shared["ms"])
        except Exception as e:  # noqa: BLE001
            shared["fa4_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print("shared_prompt", json.dumps(shared), flush=True)
    out["shared_prompt"] = shared
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--kv", default="8192,32768,131072",
                    help="decode kv_len values, comma-separated (empty: only the mask targets)")
    ap.add_argument("--json")
    ap.add_argument("--calls", type=int, default=10,
                    help="back-to-back calls per timed sample (1: single calls, host time included)")
    a = ap.parse_args()
    global CALLS
    CALLS = a.calls
    dev = "cuda"
    batch, h, h_kv, d = 64, 32, 8, 128
    scale = d ** -0.5

    # Random contents throughout: HBM reads of zeros measured up to a third faster than of
    # random bits on this machine (cm-decode-test's first runs), for the copy as for attention.
    n = 1 << 31
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), a.runs)
    copy_tbs = 2 * n * 2 / copy_ms / 1e9
    del src, dst
    print(f"copy bandwidth {copy_tbs:.2f} TB/s", flush=True)

    torch._dynamo.config.recompile_limit = 1000
    flex = torch.compile(flex_attention, dynamic=False)
    fa4 = None
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
    except Exception as e:  # noqa: BLE001
        print("FA4 not importable:", e)

    results = {"copy_tb_per_s": copy_tbs, "batch": batch, "num_heads": h, "num_kv_heads": h_kv,
               "head_dim": d, "dtype": "bfloat16", "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for kv in [int(x) for x in a.kv.split(",") if x]:
        q = torch.randn((batch, h, d), generator=g, device=dev, dtype=torch.bfloat16)
        bytes_kv = batch * kv * h_kv * d * 2 * 2
        # Flex on contiguous caches.
        k4 = torch.randn((batch, h_kv, kv, d), generator=g, device=dev, dtype=torch.bfloat16)
        v4 = torch.randn_like(k4)
        q4 = q.view(batch, h, 1, d)
        row = {"kv_len": kv}
        try:
            flex_out = flex(q4, k4, v4, scale=scale, enable_gqa=True)
            flex_ms = median_ms(lambda: flex(q4, k4, v4, scale=scale, enable_gqa=True), a.runs,
                                calls=CALLS)
            row.update(flex_ms=flex_ms, flex_tb_per_s=bytes_kv / flex_ms / 1e9)
        except Exception as e:  # noqa: BLE001
            row["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            flex_out, flex_ms = None, None
        for ps in (16, 64):
            pages = kv // ps
            # Page p of sequence s is p * batch + s; the paged cache holds k4 / v4's keys.
            kc = k4.permute(0, 2, 1, 3).reshape(batch, pages, ps, h_kv, d).transpose(0, 1)
            kc = kc.reshape(pages * batch, ps, h_kv, d).contiguous()
            vc = v4.permute(0, 2, 1, 3).reshape(batch, pages, ps, h_kv, d).transpose(0, 1)
            vc = vc.reshape(pages * batch, ps, h_kv, d).contiguous()
            table = interleaved_table(batch, pages, dev)
            tensors = full_rows(batch, kv, dev)
            i32 = dict(dtype=torch.int32, device=dev)

            def ours():
                return _ops.paged_attention_cuda(q, kc, vc, table, tensors, scale, False)

            ms = median_ms(ours, a.runs, calls=CALLS)
            cell_host = host_us(ours)
            cell = {"ms": ms, "host_us": cell_host, "tb_per_s": bytes_kv / ms / 1e9,
                    "fraction_of_copy": bytes_kv / ms / 1e9 / copy_tbs}
            # The reference output: Flex's where it ran, else a float32 softmax of the keys.
            if flex_out is None:
                flex_out = reference(q, k4, v4, scale)
            cell["max_abs_diff_vs_reference"] = (ours().float() - flex_out.view(batch, h, d).float()).abs().max().item()
            if flex_ms is not None:
                cell["over_flex"] = flex_ms / ms
            if fa4 is not None:
                try:
                    cu = torch.arange(batch + 1, **i32)
                    seqused = torch.full((batch,), kv, **i32)
                    qv = q.view(batch, h, d)

                    def fa():
                        return fa4(qv, kc, vc, cu_seqlens_q=cu, cu_seqlens_k=None,
                                   seqused_k=seqused, max_seqlen_q=1, page_table=table,
                                   softmax_scale=scale, causal=True, pack_gqa=True,
                                   num_splits=0)

                    o = fa()
                    o = o[0] if isinstance(o, tuple) else o
                    cell["fa4_max_abs_diff_vs_reference"] = (o.float() - flex_out.view(batch, h, d).float()).abs().max().item()
                    fa_ms = median_ms(fa, a.runs, calls=CALLS)
                    cell.update(fa4_ms=fa_ms, fa4_tb_per_s=bytes_kv / fa_ms / 1e9, over_fa4=fa_ms / ms)
                except Exception as e:  # noqa: BLE001
                    cell["fa4_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc(limit=2)
            row[f"page_{ps}"] = cell
            del kc, vc
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
        del k4, v4
        torch.cuda.empty_cache()
    results["masks"] = mask_targets(a.runs, flex, fa4)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
