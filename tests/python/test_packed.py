"""Packed samples (FlashAttention's varlen form): ``program.plan(cu_seqlens_q=...,
cu_seqlens_k=...)`` against each sample's own plan shifted into place and the pairwise
semantics (``brute_force_row``); the validation errors; and, with torch,
``compilemask.attention`` on the varlen layout ``[total, heads, head_dim]`` against each
sample's own attention (float64 on CPU; bfloat16 on Hopper GPUs)."""

from __future__ import annotations

import math

import pytest

import compilemask as cm

MASKS = [
    ("causal", {}),
    ("causal_bottom_right", {}),
    ("sliding_window", {"window": 3}),
    ("document_causal", {"lengths": [4, 0, 3]}),
    ("hstu", {"lengths": [7, 2, 12], "contextual": 2}),
]

# (query lengths, key lengths): equal, unequal both ways, empty samples, one token,
# samples longer than a tile.
SAMPLES = [
    ([5, 7], [5, 7]),
    ([3, 0, 6, 2], [4, 2, 0, 9]),
    ([1], [1]),
    ([1, 11], [6, 3]),
    ([40, 3, 150], [40, 3, 150]),
]

# Reads the sample index `b` and the head index `h`.
PER_SAMPLE_HEAD = """
param n: [int] = [1, 4, 0];
mask = if q < n[b % 3] + h then k <= q else q - 1 <= k & k <= q + kv_len - q_len;
"""


def prefix(lengths):
    out = [0]
    for x in lengths:
        out.append(out[-1] + x)
    return out


def expected_rows(program, lq, lk, num_heads=1, h=0, brute=False, **params):
    """Every packed row from each sample's own plan (or brute force), keys shifted."""
    cu_k = prefix(lk)
    rows = []
    for b, (n, m) in enumerate(zip(lq, lk)):
        if n == 0:
            continue
        if m == 0:
            rows.extend([] for _ in range(n))
            continue
        batch = len(lq)
        if brute:
            own = [program.brute_force_row(i, n, m, batch, num_heads, b=b, h=h, **params)
                   for i in range(n)]
        else:
            plan = program.plan(n, m, batch, num_heads, **params)
            bb = b if plan.uses_batch else 0
            hh = h if plan.uses_head else 0
            own = plan.rows(b=bb, h=hh)
        rows.extend([(s + cu_k[b], e + cu_k[b]) for s, e in row] for row in own)
    return rows


@pytest.mark.parametrize("name,params", MASKS)
@pytest.mark.parametrize("lq,lk", SAMPLES)
def test_packed_rows_are_each_samples_rows(name, params, lq, lk):
    program = cm.builtin(name, **params)
    plan = program.plan(cu_seqlens_q=prefix(lq), cu_seqlens_k=prefix(lk), block_size=(4, 8))
    assert plan.is_packed
    assert plan.cu_seqlens_q == prefix(lq) and plan.cu_seqlens_k == prefix(lk)
    assert (plan.q_len, plan.kv_len, plan.batch) == (sum(lq), sum(lk), 1)
    assert plan.rows() == expected_rows(program, lq, lk)
    assert plan.rows() == expected_rows(program, lq, lk, brute=True)
    stats = plan.stats()
    assert stats["samples"] == len(lq)
    assert stats["cu_seqlens_q"] == prefix(lq)
    assert stats["visible_pairs"] == sum(e - s for row in plan.rows() for s, e in row)
    assert "cu_seqlens_q=" in repr(plan)


def test_masks_reading_b_and_h():
    program = cm.compile(PER_SAMPLE_HEAD)
    lq, lk = [3, 6, 0, 5], [3, 4, 2, 8]
    plan = program.plan(cu_seqlens_q=prefix(lq), cu_seqlens_k=prefix(lk), num_heads=3)
    assert plan.num_heads == 3 and len(plan.mask_index) == 3
    for h in range(3):
        assert plan.rows(h=h) == expected_rows(program, lq, lk, num_heads=3, h=h)
        assert plan.rows(h=h) == expected_rows(program, lq, lk, num_heads=3, h=h, brute=True)


def test_cu_seqlens_k_defaults_to_q_and_equal_samples_share_work():
    program = cm.builtin("hstu", lengths=[7, 2, 12], contextual=2)
    one = program.plan(cu_seqlens_q=[0, 40])
    four = program.plan(cu_seqlens_q=[0, 40, 80, 120, 160])
    assert four.cu_seqlens_k == [0, 40, 80, 120, 160]
    assert four.stats()["pieces"] == one.stats()["pieces"]
    assert four.visible_pairs == 4 * one.visible_pairs


def test_offsets_from_ranges_tuples_and_numpy(np):
    program = cm.builtin("causal")
    want = program.plan(cu_seqlens_q=[0, 5, 12]).rows()
    assert program.plan(cu_seqlens_q=(0, 5, 12)).rows() == want
    assert program.plan(cu_seqlens_q=range(0, 13, 6)).cu_seqlens_q == [0, 6, 12]
    for dtype in (np.int32, np.int64):
        assert program.plan(cu_seqlens_q=np.array([0, 5, 12], dtype=dtype)).rows() == want


@pytest.mark.parametrize("cu_q,cu_k,match", [
    ([0, 5, 3], None, "cu_seqlens_q decreases at index 2"),
    ([1, 5], None, "must start at 0"),
    ([0, 5], [0, 4, 5], "2 entries but cu_seqlens_k has 3"),
    ([], None, "is empty"),
    ([0], None, "1 entry"),
    ([0, 0, 0], None, "0 queries"),
    ([0, 4], [0, 0], "0 keys"),
    ([0, 1 << 27], None, r"2\^26"),
    ([0, 1 << 70], None, r"2\^26"),
])
def test_bad_offsets(cu_q, cu_k, match):
    with pytest.raises(cm.PlanError, match=match) as e:
        cm.builtin("causal").plan(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert e.value.code == "CM0409"


def test_packing_errors():
    causal = cm.builtin("causal")
    with pytest.raises(cm.PlanError, match="token orders are not supported") as e:
        causal.plan(cu_seqlens_q=[0, 4], order="auto")
    assert e.value.code == "CM0410"
    with pytest.raises(TypeError, match="do not also pass q_len"):
        causal.plan(8, cu_seqlens_q=[0, 4, 8])
    with pytest.raises(TypeError, match="do not also pass kv_len, batch"):
        causal.plan(kv_len=8, batch=2, cu_seqlens_q=[0, 4, 8])
    with pytest.raises(TypeError, match="cu_seqlens_k needs cu_seqlens_q"):
        causal.plan(cu_seqlens_k=[0, 4])
    with pytest.raises(TypeError, match="needs q_len"):
        causal.plan()
    with pytest.raises(TypeError, match=r"cu_seqlens_q\[1\]: expected an int, got float"):
        causal.plan(cu_seqlens_q=[0, 4.0])
    with pytest.raises(TypeError, match="got bool"):
        causal.plan(cu_seqlens_q=[0, True])
    with pytest.raises(TypeError, match="sequence of ints"):
        causal.plan(cu_seqlens_q="0,4")
    with pytest.raises(cm.PlanError, match="packed sample b = 1: q_len = 4") as e:
        cm.builtin("sliding_window").plan(cu_seqlens_q=[0, 0, 4], window=0)
    assert e.value.code == "CM0305"
    with pytest.raises(cm.PlanError, match="unknown parameter"):
        causal.plan(cu_seqlens_q=[0, 4], window=3)


# ------------------------------------------------------------------ torch


def _varlen(torch, lq, lk, hq, hk, d, dv, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), hk, dv, generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def _per_sample(torch, program, lq, lk, q, k, v, scale, num_heads):
    """Each sample's own attention (4-D, its own plan), concatenated in the varlen layout;
    samples with no keys give 0 and -inf."""
    cu_q, cu_k = prefix(lq), prefix(lk)
    outs, lses = [], []
    for b, (n, m) in enumerate(zip(lq, lk)):
        if n == 0:
            continue
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1).unsqueeze(0)
        if m == 0:
            outs.append(torch.zeros(n, q.shape[1], v.shape[-1], dtype=q.dtype))
            lses.append(torch.full((q.shape[1], n), -math.inf, dtype=torch.float64))
            continue
        kb = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        vb = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        qb = qb[0]
        plan = program.plan(n, m, len(lq), num_heads)
        # The sample at its own batch index of a batch of zeros (the mask may read b).
        out, lse = cm.attention(*(torch.stack([t if i == b else torch.zeros_like(t)
                                               for i in range(len(lq))])
                                  for t in (qb, kb, vb)),
                                plan, scale=scale, return_lse=True, enable_gqa=True)
        outs.append(out[b].transpose(0, 1))
        lses.append(lse[b])
    return torch.cat(outs, 0), torch.cat(lses, 1)


CPU_CASES = [
    ("causal", {}, [5, 7, 1, 33], [5, 7, 1, 33], 2, 2),
    ("causal_bottom_right", {}, [3, 0, 6, 5, 12], [9, 4, 2, 0, 12], 4, 2),
    ("document_causal", {"lengths": [3, 0, 5]}, [17, 9, 17], [17, 9, 17], 3, 1),
    ("sliding_window", {"window": 4}, [130, 2], [130, 2], 2, 1),
]


@pytest.mark.parametrize("name,params,lq,lk,hq,hk", CPU_CASES)
def test_varlen_attention_equals_per_sample_attention(torch, name, params, lq, lk, hq, hk):
    program = cm.builtin(name, **params)
    plan = program.plan(cu_seqlens_q=prefix(lq), cu_seqlens_k=prefix(lk), block_size=16)
    q, k, v = _varlen(torch, lq, lk, hq, hk, 6, 5, torch.float64)
    out, lse = cm.attention(q, k, v, plan, scale=0.4, return_lse=True, enable_gqa=True)
    assert out.shape == (sum(lq), hq, 5) and out.is_contiguous()
    assert lse.shape == (hq, sum(lq))
    ref_out, ref_lse = _per_sample(torch, program, lq, lk, q, k, v, 0.4, hq)
    assert (out - ref_out).abs().max().item() <= 1e-12
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-12
    # Gradients through both.
    g = torch.Generator().manual_seed(3)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    wl = torch.randn(lse.shape, generator=g, dtype=torch.float64).masked_fill(~finite, 0)
    loss = (out * w).sum() + (lse.masked_fill(~finite, 0) * wl).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = (ref_out * w).sum() + (ref_lse.masked_fill(~finite, 0) * wl).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    for which, a, b in zip("qkv", grads, ref_grads):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= 1e-10, which


def test_varlen_attention_with_a_mask_reading_b_and_h(torch):
    program = cm.compile(PER_SAMPLE_HEAD)
    lq, lk = [3, 6, 0, 5], [3, 4, 2, 8]
    plan = program.plan(cu_seqlens_q=prefix(lq), cu_seqlens_k=prefix(lk), num_heads=2)
    q, k, v = _varlen(torch, lq, lk, 2, 2, 4, 4, torch.float64)
    out, lse = cm.attention(q, k, v, plan, return_lse=True)
    ref_out, ref_lse = _per_sample(torch, program, lq, lk, q, k, v, 0.5, 2)
    assert (out - ref_out).abs().max().item() <= 1e-12
    finite = ~torch.isinf(ref_lse)
    assert torch.equal(finite, ~torch.isinf(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() <= 1e-12


def test_varlen_layout_is_batch_one_of_the_4d_layout(torch):
    plan = cm.builtin("causal").plan(cu_seqlens_q=[0, 5, 12])
    q, k, v = _varlen(torch, [5, 7], [5, 7], 2, 2, 4, 4, torch.float32)
    out3 = cm.attention(q, k, v, plan)
    four = [t.detach().transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]
    out4 = cm.attention(*four, plan)
    assert torch.equal(out3, out4[0].transpose(0, 1))
    # Plan tensors (the torch.compile form) work the same way.
    assert torch.equal(cm.attention(q, k, v, plan.to_tensors()), out3)


def test_varlen_validation(torch):
    plan = cm.builtin("causal").plan(cu_seqlens_q=[0, 5, 12])
    q, k, v = _varlen(torch, [5, 7], [5, 7], 2, 2, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="key must be 3-D too"):
        cm.attention(q, k.unsqueeze(0), v, plan)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 12 query rows"):
        cm.attention(q[:11], k, v, plan)
    with pytest.raises(ValueError, match="must be 4-D"):
        cm.attention(q[0], k[0], v[0], plan)
    # A batch of packed rows is refused, whether or not the mask reads `b` (the sample
    # index): it was broadcast without `b` and told to re-plan with batch= (which packed
    # plans do not take) with it.
    four = [t.detach().transpose(0, 1).unsqueeze(0).expand(2, -1, -1, -1) for t in (q, k, v)]
    for program in (cm.builtin("causal"), cm.compile("mask = k <= q + b;")):
        with pytest.raises(ValueError, match="a packed plan is one batch of .* 12 packed rows, "
                                             "but the tensors have batch 2"):
            cm.attention(*four, program.plan(cu_seqlens_q=[0, 5, 12]))


def test_varlen_under_torch_compile(torch):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    program = cm.builtin("causal")

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k, v, pt):
        return cm.attention(q, k, v, pt).square().sum()

    q, k, v = _varlen(torch, [64], [64], 2, 2, 8, 8, torch.float32)
    for cu in ([0, 20, 64], [0, 64], [0, 7, 14, 64]):
        pt = program.plan(cu_seqlens_q=cu).to_tensors()
        loss = step(q, k, v, pt)
        eager = cm.attention(q, k, v, pt).square().sum()
        assert torch.allclose(loss, eager)
        loss.backward()
    assert counter.frame_count == 1


def test_varlen_on_hopper(torch):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs a Hopper GPU (compute capability 9.0)")
    lq, lk = [200, 0, 77, 300], [200, 5, 130, 300]
    program = cm.builtin("causal_bottom_right")
    plan = program.plan(cu_seqlens_q=prefix(lq), cu_seqlens_k=prefix(lk))
    q, k, v = _varlen(torch, lq, lk, 4, 2, 64, 64, torch.bfloat16, device="cuda")
    out, lse = cm.attention(q, k, v, plan, return_lse=True, enable_gqa=True)
    assert out.shape == (sum(lq), 4, 64) and lse.shape == (4, sum(lq))
    qc, kc, vc = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _per_sample(torch, program, lq, lk, qc, kc, vc, 1 / 8, 4)
    assert (out.double().cpu() - ref_out).abs().max().item() <= 2e-2
    finite = ~torch.isinf(ref_lse)
    assert torch.equal(finite, ~torch.isinf(lse.cpu()))
    assert (lse.double().cpu()[finite] - ref_lse[finite]).abs().max().item() <= 2e-2
    out.float().square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and not torch.isnan(t.grad).any()
