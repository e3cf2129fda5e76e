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

Each reported as median milliseconds of `--runs` calls and TB/s of K and V read (batch x kv_len
x num_kv_heads x head_dim x 2 bytes x 2), with the device-to-device copy bandwidth measured in
the same run (a 4 GiB copy reads and writes 4 GiB each). Correctness is
tests/python/test_paged_cuda.py's and cm-decode-test's; here ours is also checked against
Flex's output on the same keys.

    python3 scripts/bench-decode.py [--runs 20] [--json OUT.json] [--kv 8192,32768,131072]
"""

from __future__ import annotations

import argparse
import json
import traceback
from types import SimpleNamespace

import torch
import torch._dynamo
from torch.nn.attention.flex_attention import flex_attention

from compilemask import _ops
from cuda_timing import median_ms


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--kv", default="8192,32768,131072")
    ap.add_argument("--json")
    a = ap.parse_args()
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
    for kv in [int(x) for x in a.kv.split(",")]:
        q = torch.randn((batch, h, d), generator=g, device=dev, dtype=torch.bfloat16)
        bytes_kv = batch * kv * h_kv * d * 2 * 2
        # Flex on contiguous caches.
        k4 = torch.randn((batch, h_kv, kv, d), generator=g, device=dev, dtype=torch.bfloat16)
        v4 = torch.randn_like(k4)
        q4 = q.view(batch, h, 1, d)
        row = {"kv_len": kv}
        try:
            flex_out = flex(q4, k4, v4, scale=scale, enable_gqa=True)
            flex_ms = median_ms(lambda: flex(q4, k4, v4, scale=scale, enable_gqa=True), a.runs)
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
            table = (torch.arange(pages, device=dev, dtype=torch.int32)[None, :] * batch
                     + torch.arange(batch, device=dev, dtype=torch.int32)[:, None]).contiguous()
            i32 = dict(dtype=torch.int32, device=dev)
            tensors = SimpleNamespace(
                cu_q=torch.arange(batch + 1, **i32), kv_len=torch.full((batch,), kv, **i32),
                row_ptr=torch.arange(batch + 1, **i32),
                intervals=torch.tensor([[0, kv]] * batch, **i32), max_q_len=1)

            def ours():
                return _ops.paged_attention_cuda(q, kc, vc, table, tensors, scale, False)

            ms = median_ms(ours, a.runs)
            cell = {"ms": ms, "tb_per_s": bytes_kv / ms / 1e9,
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
                    fa_ms = median_ms(fa, a.runs)
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
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
