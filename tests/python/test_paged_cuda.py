"""The serving kernel through the extension on the GPU machine: one step's new rows against a
paged KV cache (`compilemask._ops.paged_attention_cuda`), checked against a float64 softmax of
the cache gathered to contiguous keys, with rows built from each mask's definition; CUDA graph
replay with changed lengths and torch.compile. Skips without torch or CUDA."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from compilemask import _ops  # noqa: E402

DEV = "cuda"


def _rows(kind: str, q_len: int, kv_len: int, rng: random.Random) -> list[list[tuple[int, int]]]:
    prefix = kv_len - q_len
    if kind == "causal":
        return [[(0, prefix + i + 1)] for i in range(q_len)]
    if kind == "window":
        return [[(max(0, prefix + i + 1 - 50), prefix + i + 1)] for i in range(q_len)]
    if kind == "tree":
        parent = [None] + [rng.randrange(i) if rng.random() > 0.1 else None for i in range(1, q_len)]
        rows = []
        for i in range(q_len):
            keys, n = set(), i
            while n is not None:
                keys.add(prefix + n)
                n = parent[n]
            row = [(0, prefix)] if prefix else []
            for k in sorted(keys):
                if row and row[-1][1] == k:
                    row[-1] = (row[-1][0], k + 1)
                else:
                    row.append((k, k + 1))
            rows.append(row)
        return rows
    raise ValueError(kind)


def _step(seqs, kind, page_size, num_kv_heads, head_dim, dtype, rng, spare_pages=3):
    cu_q, kv_lens, row_ptr, intervals, all_rows = [0], [], [0], [], []
    for q_len, kv_len in seqs:
        rows = _rows(kind, q_len, kv_len, rng)
        all_rows.append(rows)
        for row in rows:
            for a, b in row:
                intervals += [a, b]
            row_ptr.append(len(intervals) // 2)
        cu_q.append(cu_q[-1] + q_len)
        kv_lens.append(kv_len)
    pages_of = [math.ceil(kv / page_size) for _, kv in seqs]
    max_pages = max(pages_of) + 1
    num_pages = sum(pages_of) + spare_pages
    pool = list(range(num_pages))
    rng.shuffle(pool)
    table = []
    for n in pages_of:
        table.append([pool.pop() for _ in range(n)] + [-5] * (max_pages - n))
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for s, (_, kv) in enumerate(seqs):
        for p in range(kv):
            page, slot = table[s][p // page_size], p % page_size
            k_cache[page, slot] = torch.randn(num_kv_heads, head_dim).to(dtype)
            v_cache[page, slot] = torch.randn(num_kv_heads, head_dim).to(dtype)
    i32 = dict(dtype=torch.int32, device=DEV)
    tensors = SimpleNamespace(
        cu_q=torch.tensor(cu_q, **i32), kv_len=torch.tensor(kv_lens, **i32),
        row_ptr=torch.tensor(row_ptr, **i32),
        intervals=torch.tensor(intervals, **i32).reshape(-1, 2),
        max_q_len=max(q for q, _ in seqs))
    return tensors, torch.tensor(table, **i32), k_cache.to(DEV), v_cache.to(DEV), all_rows


def _reference(q, k_cache, v_cache, table, seqs, all_rows, scale):
    """float64 attention of every new row over its sequence's gathered keys."""
    total_q, h, d = q.shape
    page_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(total_q, h, d, dtype=torch.float64)
    lse = torch.full((total_q, h), float("-inf"), dtype=torch.float64)
    r0 = 0
    for s, (q_len, kv) in enumerate(seqs):
        pos = torch.arange(kv)
        pages = table[s].cpu().long()[pos // page_size]
        keys = k_cache.cpu()[pages, pos % page_size].double()  # [kv, h_kv, d]
        vals = v_cache.cpu()[pages, pos % page_size].double()
        for i in range(q_len):
            vis = torch.zeros(kv, dtype=torch.bool)
            for a, b in all_rows[s][i]:
                vis[a:b] = True
            if not vis.any():
                continue
            for hh in range(h):
                kvh = hh // (h // h_kv)
                sc = (keys[vis, kvh] @ q[r0 + i, hh].double().cpu()) * scale
                lse[r0 + i, hh] = torch.logsumexp(sc, 0)
                out[r0 + i, hh] = torch.softmax(sc, 0) @ vals[vis, kvh]
        r0 += q_len
    return out, lse


CASES = [
    ("causal", [(1, 1), (1, 129), (1, 4097), (1, 64)], 16, 32, 8, 128, torch.bfloat16),
    ("window", [(7, 300), (1, 40)], 64, 8, 1, 64, torch.float16),
    ("tree", [(64, 64 + 1000), (9, 9)], 16, 16, 4, 128, torch.bfloat16),
    ("causal", [(3, 3000), (5, 5)], 7, 8, 8, 64, torch.bfloat16),
]


@pytest.mark.parametrize("kind,seqs,page_size,h,h_kv,d,dtype", CASES)
def test_paged_attention_matches_float64(kind, seqs, page_size, h, h_kv, d, dtype):
    rng = random.Random(hash((kind, page_size, h, d)) & 0xFFFF)
    torch.manual_seed(0)
    tensors, table, kc, vc, rows = _step(seqs, kind, page_size, h_kv, d, dtype, rng)
    total_q = sum(q for q, _ in seqs)
    q = torch.randn(total_q, h, d, device=DEV).to(dtype)
    scale = 1 / math.sqrt(d)
    out, lse = _ops.paged_attention_cuda(q, kc, vc, table, tensors, scale, True)
    ref, ref_lse = _reference(q, kc, vc, table, seqs, rows, scale)
    assert torch.isfinite(out).all()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert (out.double().cpu() - ref).abs().max().item() <= tol
    assert (lse.double().cpu() - ref_lse).abs().max().item() <= 1e-3


def test_cuda_graph_replays_with_new_lengths():
    """A graph captured at fixed capacities (shapes) replays correctly after the step's
    lengths and rows change in place: the next decode step of the same batch."""
    rng = random.Random(5)
    seqs = [(1, 500), (1, 700)]
    tensors, table, kc, vc, rows = _step(seqs, "causal", 16, 8, 128, torch.bfloat16, rng,
                                         spare_pages=0)
    q = torch.randn(2, 32, 128, device=DEV).to(torch.bfloat16)
    static_out = _ops.paged_attention_cuda(q, kc, vc, table, tensors, 0.088, False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _ops.paged_attention_cuda(q, kc, vc, table, tensors, 0.088, False)
    # The next step: one token shorter rows (the same pages hold them).
    new = [(1, 499), (1, 650)]
    tensors.kv_len.copy_(torch.tensor([kv for _, kv in new], dtype=torch.int32))
    tensors.intervals.copy_(torch.tensor([[0, kv] for _, kv in new], dtype=torch.int32))
    graph.replay()
    ref, _ = _reference(q, kc, vc, table, new, [[[(0, kv)]] for _, kv in new], 0.088)
    assert (static_out.double().cpu() - ref).abs().max().item() <= 2e-2


def test_torch_compile_traces_the_op():
    rng = random.Random(9)
    seqs = [(2, 300), (1, 65)]
    tensors, table, kc, vc, rows = _step(seqs, "causal", 16, 4, 64, torch.float16, rng)
    q = torch.randn(3, 8, 64, device=DEV).to(torch.float16)

    def step(q):
        return _ops.paged_attention_cuda(q, kc, vc, table, tensors, 0.125, False) * 2

    got = torch.compile(step, fullgraph=True)(q)
    ref, _ = _reference(q, kc, vc, table, seqs, rows, 0.125)
    assert (got.double().cpu() - 2 * ref).abs().max().item() <= 8e-3


def test_bad_arguments_are_value_errors():
    rng = random.Random(1)
    tensors, table, kc, vc, _ = _step([(1, 10)], "causal", 16, 2, 64, torch.bfloat16, rng)
    q = torch.randn(1, 4, 64, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match="num_kv_heads = 2 must divide num_heads = 3"):
        _ops.paged_attention_cuda(q[:, :3], kc, vc, table, tensors, 0.1, False)
    with pytest.raises(ValueError, match="block_table: dtype int64, expected int32"):
        _ops.paged_attention_cuda(q, kc, vc, table.long(), tensors, 0.1, False)
    with pytest.raises(ValueError, match="v_cache: shape"):
        _ops.paged_attention_cuda(q, kc, vc[:, :8], table, tensors, 0.1, False)
