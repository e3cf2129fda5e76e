"""The torch side: `compilemask.attention` against a dense masked softmax (forward, lse and
gradients), validation, FlexAttention block masks, and torch.compile. Skipped without torch.
Runs on CUDA too where available (block masks through compiled FlexAttention); the CUDA
kernels have their own tests in test_cuda.py."""

from __future__ import annotations

import math
import shutil

import pytest

import compilemask as cm

torch = pytest.importorskip("torch", reason="torch is not installed")

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def dense_attention(q, k, v, mask, scale):
    """Masked softmax attention in float64 from a dense boolean mask ``[B|1, H|1, Lq, Lk]``:
    rows with no visible key give out 0 and lse -inf; differentiable without NaN."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    s = (q @ k.transpose(-1, -2)) * scale
    empty = ~mask.any(-1)
    s_masked = s.masked_fill(~mask, -math.inf).masked_fill(empty[..., None], 0.0)
    lse = torch.logsumexp(s_masked, -1)
    p = torch.where(mask, torch.exp(s.masked_fill(~mask, 0.0) - lse[..., None]), 0.0)
    out = p @ v
    return out, lse.masked_fill(empty, -math.inf), empty


WORKLOADS = [
    ("causal", 37, None, {}),
    ("causal_bottom_right", 21, 9, {}),  # rows 0..11 see nothing
    ("causal_bottom_right", 9, 30, {}),
    ("hstu", 70, None, {"lengths": [30, 9, 3, 40], "contextual": 2, "target_divisor": 4}),
    ("shared_prefix", 61, None, {"prompts": [11, 6], "responses": [4, 0, 3, 5], "group": 3}),
    ("clear", 7 + 7 * 7, None, {"text": 7, "radius": 3}),
    ("sliding_window", 45, None, {"window": 6}),
    ("document_causal", 50, None, {"lengths": [13, 0, 7, 21]}),
    ("trace_documents", 64, None, {}),
    ("trace_prompt_groups", 64, None, {}),
]


def _inputs(b, hq, hk, lq, lk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hk, lk, dv, generator=g, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _check(plan, q, k, v, scale=None, atol_out=1e-5, atol_grad=1e-4, enable_gqa=False):
    d = q.shape[-1]
    s = 1.0 / math.sqrt(d) if scale is None else scale
    out, lse = cm.attention(q, k, v, plan, scale=scale, return_lse=True,
                            enable_gqa=enable_gqa)
    ref_out, ref_lse, empty = dense_attention(q, k, v, plan.to_dense(format="torch"), s)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    assert lse.shape == q.shape[:3]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out.double() - ref_out).abs().max().item() <= atol_out
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty.expand_as(out[..., 0])] == 0).all()
    finite = ~empty
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= atol_out
    # Gradients of a weighted sum of out and lse.
    g = torch.Generator().manual_seed(1)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).masked_fill(empty, 0)
    loss = (out.double() * w_out).sum() + (lse.double().masked_fill(empty, 0) * w_lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = (ref_out * w_out).sum() + (ref_lse.masked_fill(empty, 0) * w_lse).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    for name, a, b in zip("qkv", grads, ref_grads):
        assert not torch.isnan(a).any(), name
        err = (a.double() - b.double()).abs().max().item()
        assert err <= atol_grad, (name, err)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,q_len,kv_len,params", WORKLOADS)
def test_attention_matches_dense(name, q_len, kv_len, params, dtype):
    plan = cm.builtin(name, **params).plan(q_len, kv_len)
    lk = q_len if kv_len is None else kv_len
    q, k, v = _inputs(2, 2, 2, q_len, lk, 16, 16, dtype)
    tol = (1e-10, 1e-9) if dtype == torch.float64 else (1e-5, 1e-4)
    _check(plan, q, k, v, atol_out=tol[0], atol_grad=tol[1])


@pytest.mark.parametrize("hq,hk", [(4, 2), (6, 1), (3, 3)])
def test_gqa_and_head_dim_v(hq, hk):
    plan = cm.builtin("hstu", lengths=[20, 13]).plan(33)
    q, k, v = _inputs(2, hq, hk, 33, 33, 8, 5, torch.float64)
    _check(plan, q, k, v, scale=0.3, atol_out=1e-10, atol_grad=1e-9, enable_gqa=hq != hk)


def test_per_head_and_per_batch_masks():
    program = cm.compile("param windows: [int] = [1, 3, 5];\nparam n: [int] = [4, 9];\n"
                         "mask = if q < n[b] then q - windows[h % count(windows)] < k <= q "
                         "else k < kv_len;")
    plan = program.plan(12, batch=2, num_heads=3)
    assert plan.num_masks == 6
    q, k, v = _inputs(2, 3, 3, 12, 12, 4, 4, torch.float64)
    _check(plan, q, k, v, atol_out=1e-10, atol_grad=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cpu(dtype):
    plan = cm.builtin("document_causal", lengths=[10, 23]).plan(33)
    q, k, v = _inputs(1, 2, 2, 33, 33, 16, 16, dtype)
    out = cm.attention(q, k, v, plan)
    assert out.dtype == dtype
    ref, _, _ = dense_attention(q, k, v, plan.to_dense(format="torch"), 0.25)
    assert (out.double() - ref).abs().max().item() < 2e-2
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == dtype


def test_broadcast_plan_over_batch_and_heads():
    plan = cm.builtin("causal").plan(10)  # batch = num_heads = 1: applies everywhere
    q, k, v = _inputs(3, 4, 4, 10, 10, 8, 8, torch.float64)
    _check(plan, q, k, v, atol_out=1e-10, atol_grad=1e-9)


def test_plans_that_depend_on_the_batch_or_heads_do_not_broadcast():
    q = torch.randn(3, 4, 10, 8, dtype=torch.float64)
    # The lengths bind at the plan's values: a plan for one head is not the mask of four.
    for source, what in (("mask = k <= q - num_heads;", "num_heads"),
                         ("mask = k <= q - batch;", "batch")):
        plan = cm.compile(source).plan(10)
        assert (plan.uses_head, plan.uses_batch) == (what == "num_heads", what == "batch")
        for p in (plan, plan.to_tensors()):
            with pytest.raises(ValueError, match=f"depends on the {what}.*{what} = "):
                cm.attention(q, q, q, p)
        fit = cm.compile(source).plan(10, batch=3, num_heads=4)
        ref, _, _ = dense_attention(q, q, q, fit.to_dense(format="torch"), 8 ** -0.5)
        torch.testing.assert_close(cm.attention(q, q, q, fit), ref.to(q.dtype), rtol=0,
                                   atol=1e-12)
    # A packed plan is one batch of its samples, as a Plan or as its PlanTensors.
    packed = cm.builtin("causal").plan(cu_seqlens_q=[0, 4, 10])
    for p in (packed, packed.to_tensors()):
        with pytest.raises(ValueError, match="batch"):
            cm.attention(q[:2, :1], q[:2, :1], q[:2, :1], p)
    cm.attention(q[:1, :1], q[:1, :1], q[:1, :1], packed.to_tensors())


@pytest.mark.parametrize("scored", [False, True])
def test_second_order_gradients_are_refused(scored):
    # The first-order gradients come from a fused backward; a double backward through it
    # raised torch's generic message (plain) or silently dropped the second-order term (with
    # score terms).
    source = "mask = k <= q;" + ("\ntensor sinks: [num_heads];\nsink = sinks[h];" if scored else "")
    plan = cm.compile(source).plan(7, num_heads=2)
    q, k, v = (torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kw = {"score_tensors": {"sinks": torch.randn(2, dtype=torch.float64)}} if scored else {}
    with pytest.raises(RuntimeError, match="no second-order gradients"):
        out = cm.attention(q, k, v, plan, **kw)
        g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        (out.sum() + g.pow(2).sum()).backward()
    # Through autograd.grad alone (a gradient penalty), with a softcap.
    capped = cm.compile("score = softcap(score, 2.0);\nmask = k <= q;").plan(7, num_heads=2)
    with pytest.raises(RuntimeError, match="no second-order gradients"):
        out = cm.attention(q, k, v, capped if scored else plan)
        g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        torch.autograd.grad(g.pow(2).sum() + q.pow(3).sum(), q)
    # First order is unchanged.
    out = cm.attention(q, k, v, plan, **kw)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_non_contiguous_inputs():
    plan = cm.builtin("sliding_window", window=4).plan(20)
    q, k, v = _inputs(2, 20, 20, 3, 3, 8, 8, torch.float64)  # [b, seq, heads, d]
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    assert not q.is_contiguous()
    _check(plan, q, k, v, atol_out=1e-10, atol_grad=1e-9)


def test_plan_tensors_and_plan_give_the_same_result():
    plan = cm.builtin("shared_prefix", prompts=[5], responses=[3, 4], group=2).plan(12)
    q, k, v = (t.detach() for t in _inputs(1, 1, 1, 12, 12, 4, 4, torch.float32))
    pt = plan.to_tensors()
    assert pt.row_ptr.dtype == torch.int32 and pt.row_ptr.shape == (1, 13)
    assert pt.mask_index.shape == (1, 1)
    assert pt.intervals.shape[0] & (pt.intervals.shape[0] - 1) == 0  # a power of two
    assert plan.to_tensors() is pt  # cached
    assert torch.equal(cm.attention(q, k, v, plan), cm.attention(q, k, v, pt))


@pytest.mark.parametrize("interval,match", [
    ([-5, 2], r"row 3: interval 0 is \[-5, 2\), expected ends in \[0, kv_len = 64\]"),
    ([0, -3], r"row 3: interval 0 is \[0, -3\)"),
])
def test_plan_tensors_with_negative_interval_ends_are_refused(interval, match):
    # A negative start was clamped to 0 and ran as [0, 2); [0, -3) was reported as [0, 0).
    pt = cm.builtin("causal").plan(64).to_tensors()
    pt = pt._replace(intervals=pt.intervals.clone())
    row3 = int(pt.row_ptr[0, 3])
    pt.intervals[row3] = torch.tensor(interval, dtype=torch.int32)
    q = torch.randn(1, 1, 64, 8)
    with pytest.raises(ValueError, match=match):
        cm.attention(q, q, q, pt)


# ------------------------------------------------------------------ validation

def _ok():
    plan = cm.builtin("causal").plan(8)
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, 8, 8, 4, 4, torch.float32))
    return plan, q, k, v


@pytest.mark.parametrize("change,match", [
    (lambda p, q, k, v: (p, q[0], k, v), "4-D"),
    (lambda p, q, k, v: (p, q.double(), k, v), "one dtype"),
    (lambda p, q, k, v: (p, q.int(), k.int(), v.int()), "dtype"),
    (lambda p, q, k, v: (p, q, k[:, :, :5], v[:, :, :5]), "kv_len = 8"),
    (lambda p, q, k, v: (p, q[:, :, :5], k, v), "q_len = 8"),
    # An empty sequence is not told to plan for length 0 (CM0402 itself).
    (lambda p, q, k, v: (p, q[:, :, :0], k, v), "needs at least one query row and one key"),
    (lambda p, q, k, v: (p, q, k, v[:, :, :5]), "seq_len"),
    (lambda p, q, k, v: (p, q, k[..., :3], v), "head_dim"),
    (lambda p, q, k, v: (p, q, k[:, :1], v[:, :1]), "enable_gqa"),
    (lambda p, q, k, v: (p, q, k, v[:, :1]), "heads"),
    (lambda p, q, k, v: (p, q, torch.cat([k, k]), v), "batch"),
    (lambda p, q, k, v: (cm.builtin("causal").plan(8, batch=2), q, k, v), "batch = 2"),
])
def test_validation_errors(change, match):
    plan, q, k, v = _ok()
    plan, q, k, v = change(plan, q, k, v)
    with pytest.raises(ValueError, match=match):
        cm.attention(q, k, v, plan)


def test_gqa_heads_must_divide():
    plan, q, k, v = _ok()
    q3 = torch.cat([q, q[:, :1]], dim=1)
    with pytest.raises(ValueError, match="multiple"):
        cm.attention(q3, k, v, plan, enable_gqa=True)


def test_zero_heads_are_named():
    plan, q, k, v = _ok()
    with pytest.raises(ValueError, match="num_heads = 0 .* must be at least 1"):
        cm.attention(q[:, :0], k, v, plan, enable_gqa=True)
    with pytest.raises(ValueError, match="num_kv_heads = 0 .* must be at least 1"):
        cm.attention(q, k[:, :0], v[:, :0], plan, enable_gqa=True)
    # The zero dimension is named (a value without columns was called head_dim).
    with pytest.raises(ValueError, match=r"head_dim_v \(value.shape\[3\]\) = 0; it must"):
        cm.attention(q, k, v[..., :0], plan)
    with pytest.raises(ValueError, match=r"head_dim \(query.shape\[3\]\) = 0; it must"):
        cm.attention(q[..., :0], k[..., :0], v, plan)


@pytest.mark.parametrize("flag", ["enable_gqa", "return_lse", "deterministic"])
@pytest.mark.parametrize("value", ["yes", "False", 1, None])
def test_flags_must_be_bools(flag, value):
    """A truthy string such as 'False' would silently mean True: every flag is a bool."""
    plan, q, k, v = _ok()
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got"):
        cm.attention(q, k, v, plan, **{flag: value})


def test_3d_inputs_name_the_layout_they_are_read_as():
    """3-D tensors are the varlen layout [total_q, num_heads, head_dim]; one laid out as
    [num_heads, q_len, head_dim] (a batch dim left out) is named as such, with the fix."""
    plan, q, k, v = _ok()
    with pytest.raises(ValueError, match=r"read as the varlen layout .* total_q = 2 \(dim 0\), "
                                         r"but the plan has q_len = 8; its dim 1 is 8: .* "
                                         r"query.unsqueeze\(0\)"):
        cm.attention(q[0], k[0], v[0], plan)
    with pytest.raises(ValueError, match=r"total_q = 3 \(dim 0\), but the plan has q_len = 8$"):
        cm.attention(q[0, :, :3].transpose(0, 1), k[0, :, :3].transpose(0, 1),
                     v[0, :, :3].transpose(0, 1), plan)
    out = cm.attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), plan)
    torch.testing.assert_close(out, cm.attention(q, k, v, plan)[0].transpose(0, 1))


def test_a_minus_inf_sink_is_no_sink_on_cpu():
    """A -inf sink leaves its head as without a sink (empty rows: lse -inf) with gradient 0;
    NaN and +inf sinks are refused, naming the head."""
    src = "mask = q >= 2 & k <= q;\n"
    plan = cm.compile("tensor sinks: [num_heads];\n" + src + "sink = sinks[h];").plan(6, num_heads=2)
    plan0 = cm.compile(src).plan(6)
    q, k, v = (t.detach().double() for t in _inputs(1, 2, 2, 6, 6, 4, 4, torch.float32))
    q.requires_grad_()
    sinks = torch.tensor([-math.inf, 0.25], dtype=torch.float64, requires_grad=True)
    out, lse = cm.attention(q, k, v, plan, return_lse=True, score_tensors={"sinks": sinks})
    out0, lse0 = cm.attention(q, k, v, plan0, return_lse=True)
    assert torch.equal(out[:, 0], out0[:, 0]) and torch.equal(lse[:, 0], lse0[:, 0])
    assert lse[0, 0, :2].tolist() == [-math.inf] * 2 and lse[0, 1, :2].tolist() == [0.25] * 2
    (out.sum() + lse[:, :, 2:].sum()).backward()
    assert sinks.grad[0].item() == 0.0 and sinks.grad[1].item() != 0.0
    assert torch.isfinite(q.grad).all()
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match=r"sinks\[1\] of \[num_heads\] is .*; a sink must be "
                                             r"finite, or -inf for no sink"):
            cm.attention(q, k, v, plan, score_tensors={"sinks": torch.tensor([0.0, bad])})


def test_mask_reading_h_needs_a_plan_for_the_heads():
    program = cm.compile("param w: [int] = [1, 2];\nmask = q - w[h % 2] < k <= q;")
    _, q, k, v = _ok()
    with pytest.raises(ValueError, match="num_heads"):
        cm.attention(q, k, v, program.plan(8))  # planned for one head, used with two
    cm.attention(q, k, v, program.plan(8, num_heads=2))


def test_bad_scale_and_plan_types():
    plan, q, k, v = _ok()
    with pytest.raises(ValueError, match="scale"):
        cm.attention(q, k, v, plan, scale=float("inf"))
    # Finite in Python but not in float32, the kernels' scale: named as given.
    with pytest.raises(ValueError, match=r"scale = 1e\+308 must be finite and fit float32"):
        cm.attention(q, k, v, plan, scale=1e308)
    with pytest.raises(TypeError, match="scale must be a number, got True"):
        cm.attention(q, k, v, plan, scale=True)
    with pytest.raises(TypeError, match="scale must be a number"):
        cm.attention(q, k, v, plan, scale="0.5")
    with pytest.raises(TypeError, match="plan"):
        cm.attention(q, k, v, "causal")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="query"):
        cm.attention([1.0], k, v, plan)  # type: ignore[arg-type]


def test_non_finite_inputs_are_refused():
    plan, q, k, v = _ok()
    q = q.clone()
    q[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        cm.attention(q, k, v, plan)


def test_devices_must_agree():
    if not CUDA:
        pytest.skip("needs a CUDA device")
    plan, q, k, v = _ok()
    with pytest.raises(ValueError, match="one device"):
        cm.attention(q.cuda(), k, v, plan)


# ------------------------------------------------------------------ FlexAttention

flex = pytest.importorskip("torch.nn.attention.flex_attention")

BLOCK_CASES = [
    ("causal", 256, 256, {}, (128, 128), lambda b, h, q, k: q >= k),
    ("causal", 300, 300, {}, (128, 128), lambda b, h, q, k: q >= k),
    ("causal", 300, 300, {}, (64, 32), lambda b, h, q, k: q >= k),
    ("sliding_window", 333, 333, {"window": 50}, (64, 64),
     lambda b, h, q, k: (q >= k) & (q - k < 50)),
    ("causal_bottom_right", 200, 328, {}, (128, 128), lambda b, h, q, k: k <= q + 128),
    ("document_causal", 384, 384, {"lengths": [100, 200, 84]}, (64, 64),
     lambda b, h, q, k: (k <= q) & (torch.bucketize(q, torch.tensor([100, 300]), right=True)
                                    == torch.bucketize(k, torch.tensor([100, 300]),
                                                       right=True))),
    # Strided runs: each visible key of a row is its own interval (the row's intervals
    # outnumber its runs), so mask_mod's table must be as wide as the expanded rows.
    ("dilated_window", 129, 129, {"window": 30, "dilation": 3}, (32, 32),
     lambda b, h, q, k: (q >= k) & (q - k < 30) & ((q - k) % 3 == 0)),
    ("dilated_window", 200, 150, {"window": 9, "dilation": 2}, (64, 16),
     lambda b, h, q, k: (q >= k) & (q - k < 9) & ((q - k) % 2 == 0)),
]


def _classes(bm):
    """Tile classes of a BlockMask's (0, 0) mask: 0 empty, 1 partial, 2 full."""
    m, n = bm.kv_indices.shape[-2:]
    out = torch.zeros((m, n), dtype=torch.int64)
    for counts, idx, cls in ((bm.kv_num_blocks, bm.kv_indices, 1),
                             (bm.full_kv_num_blocks, bm.full_kv_indices, 2)):
        for i, c in enumerate(counts[0, 0].tolist()):
            out[i, idx[0, 0, i, :c].long().cpu()] = cls
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,q_len,kv_len,params,block,rule", BLOCK_CASES)
def test_block_mask_equals_create_block_mask(name, q_len, kv_len, params, block, rule, device):
    plan = cm.builtin(name, **params).plan(q_len, kv_len, block_size=block)
    ours = plan.to_block_mask(device)
    theirs = flex.create_block_mask(rule, None, None, q_len, kv_len, device="cpu",
                                    BLOCK_SIZE=block)
    ours_mod = flex.create_block_mask(plan.mask_mod(device), None, None, q_len, kv_len,
                                      device=device, BLOCK_SIZE=block)
    mine = _classes(ours)
    for bm in (theirs, ours_mod):
        # Identical tables: ragged edge tiles are partial in both (Flex pads with False).
        assert torch.equal(mine, _classes(bm)), (mine, _classes(bm))
        for key in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(ours, key).cpu(), getattr(bm, key).cpu()), key
    # The transposes equal Flex's; without ragged edges they also equal our own q_* export.
    for key in ("q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, key).cpu(), getattr(theirs, key).cpu()), key
    for j, n in enumerate(ours.q_num_blocks[0, 0].tolist()):
        assert ours.q_indices[0, 0, j, :n].tolist() == theirs.q_indices[0, 0, j, :n].tolist()
    if q_len % block[0] == 0 and kv_len % block[1] == 0:
        t = plan.block_tensors(0, 0)
        assert ours.q_num_blocks[0, 0].tolist() == t["q_num_blocks"]
        assert ours.full_q_num_blocks[0, 0].tolist() == t["full_q_num_blocks"]
    # mask_mod agrees with the dense mask and with the rule pair by pair.
    dense = plan.to_dense(format="torch").to(device)
    assert torch.equal(flex.create_mask(plan.mask_mod(device), 1, 1, q_len, kv_len,
                                        device=device), dense)
    assert torch.equal(flex.create_mask(rule, 1, 1, q_len, kv_len, device="cpu"), dense.cpu())


COMPILED_FLEX_CASES = [
    ("causal", cm.builtin("causal"), 200, {}, {}),
    ("dilated", cm.builtin("dilated_window"), 256, {}, {}),
    ("per_head", cm.compile("param w: [int] = [3, 40];\nmask = q - w[h % 2] < k <= q;"), 130,
     {"num_heads": 2}, {}),
    ("t5", cm.builtin("t5_relative_bias"), 190, {"num_heads": 2}, {"rel_bias": (2, 32)}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,program,n,plan_args,tensors", COMPILED_FLEX_CASES,
                         ids=[c[0] for c in COMPILED_FLEX_CASES])
def test_compiled_flex_attention_with_our_block_mask(name, program, n, plan_args, tensors, device):
    """torch.compile(flex_attention) with plan.to_block_mask() and plan.score_mod() computes
    compilemask.attention's output: one table row per mask (strided runs as several
    intervals), per-head masks, a bias table, a length that ends inside a tile. (Inductor's
    CPU template read a 2-D interval table wrongly; ``dynamic=False`` because its dynamic
    recompile fails on any mask_mod that reads a captured tensor, torch's own included.)"""
    if device == "cpu" and shutil.which("g++") is None:
        pytest.skip("Inductor's CPU backend needs a C++ compiler")
    # Flex's CUDA template tiles float32 at up to 128 rows and needs the BlockMask's blocks to
    # be multiples of its own (64 x 64 is refused at lowering); the CPU template takes 64.
    block = (128, 128) if device == "cuda" else (64, 64)
    plan = program.plan(n, block_size=block, **plan_args)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn((1, 2, n, 64), generator=g).to(device) for _ in range(3))
    given = {t: torch.randn(shape, generator=g).to(device) for t, shape in tensors.items()}
    compiled = torch.compile(flex.flex_attention, dynamic=False)
    out = compiled(q, k, v, block_mask=plan.to_block_mask(device),
                   score_mod=plan.score_mod(given or None, device))
    want = cm.attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), plan,
                        score_tensors={t: x.cpu().double() for t, x in given.items()} or None)
    err = (out.double().cpu() - want).abs().max().item()
    assert err <= 1e-4 if device == "cpu" else err <= 2e-2, err


def test_score_mod_forms_the_bias_in_the_score_dtype():
    """The linear bias's slope is an f32 value (what the kernels take); score_mod multiplies it
    by the positions in the score's dtype, so float64 Flex matches float64 compilemask.attention
    (it was formed in float32: 3e-7 off at q - k = 999), and float32 is as before."""
    plan = cm.compile("mask = k <= q;\nscore = score + 0.3 * (k - q);").plan(1000, num_heads=2)
    mod = plan.score_mod()
    slope = float(torch.tensor(0.3, dtype=torch.float32))
    q_idx, kv_idx = torch.tensor(999), torch.tensor(0)
    got = mod(torch.zeros((), dtype=torch.float64), 0, 1, q_idx, kv_idx)
    assert got.dtype == torch.float64 and got.item() == slope * -999
    got32 = mod(torch.zeros((), dtype=torch.float32), 0, 1, q_idx, kv_idx)
    assert got32.item() == (torch.tensor(slope, dtype=torch.float32) * -999).item()


def test_block_mask_per_head():
    program = cm.compile("param w: [int] = [3, 40];\nmask = q - w[h % 2] < k <= q;")
    plan = program.plan(100, num_heads=2, block_size=16)
    bm = plan.to_block_mask()
    assert bm.kv_num_blocks.shape == (1, 2, 7)
    rule = lambda b, h, q, k: (q >= k) & (q - k < torch.where(h == 0, 3, 40))  # noqa: E731
    theirs = flex.create_block_mask(rule, 1, 2, 100, 100, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(bm.to_dense(), theirs.to_dense())
    assert torch.equal(flex.create_mask(bm.mask_mod, 1, 2, 100, 100, device="cpu"),
                       plan.to_dense(format="torch"))


def test_mask_mod_broadcasts_as_attention_does():
    # A per-head plan of batch 1 (its mask does not read b) serves Flex's batch 2, and a
    # per-batch plan of one head serves 3 heads: mask_mod indexed its [batch, num_heads]
    # table with Flex's b and h and raised IndexError.
    cases = [("param w: [int] = [2, 5, 9, 30];\nmask = q - w[h] < k <= q;",
              dict(num_heads=4), (2, 4)),
             ("param w: [int] = [2, 30];\nmask = q - w[b] < k <= q;", dict(batch=2), (2, 3))]
    for source, planned, (b, h) in cases:
        program = cm.compile(source)
        plan = program.plan(70, **planned)
        full = program.plan(70, batch=b, num_heads=h)
        want = full.to_dense(format="torch")
        assert torch.equal(flex.create_mask(plan.mask_mod(), b, h, 70, 70, device="cpu"), want)
        bm = plan.to_block_mask()
        q = torch.randn(b, h, 70, 16, dtype=torch.float64)
        out = flex.flex_attention(q, q, q, block_mask=bm)
        assert torch.allclose(out, cm.attention(q, q, q, plan), atol=1e-12)


def test_mask_mod_does_not_broadcast_what_the_mask_reads():
    # A mask that reads h planned with one head (CM0262), or a packed plan's batch, served
    # Flex's other heads / batches with head 0's / batch 0's mask; attention() refuses them.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cm.CompileMaskWarning)
        reads_h = cm.compile("mask = k <= q + h;").plan(21)
        packed = cm.compile("mask = k <= q + b;").plan(cu_seqlens_q=[0, 5, 12])
    assert torch.equal(flex.create_mask(reads_h.mask_mod(), 1, 1, 21, 21, device="cpu"),
                       reads_h.to_dense(format="torch"))
    with pytest.raises((IndexError, RuntimeError)):
        flex.create_mask(reads_h.mask_mod(), 1, 4, 21, 21, device="cpu")
    with pytest.raises((IndexError, RuntimeError)):
        flex.create_mask(packed.mask_mod(), 2, 1, 12, 12, device="cpu")


def test_mask_mod_is_false_outside_the_lengths():
    # Negative rows read row 0 through the clamp and answered for it.
    plan = cm.builtin("causal").plan(10, 12)
    mm = plan.mask_mod()
    t = torch.tensor
    q_idx = t([-11, -10, -1, 0, 9, 10, 11, 0, 0, 0, 5])
    kv_idx = t([0, 0, 0, -1, 0, 0, 0, 12, 13, 0, 5])
    got = mm(t(0), t(0), q_idx, kv_idx)
    assert got.tolist() == [False, False, False, False, True, False, False, False, False,
                            True, True]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len", [256, 300])
def test_flex_attention_with_our_block_mask(device, q_len):
    # 300: edge tiles that are full for us (and partial for create_block_mask).
    plan = cm.builtin("hstu", lengths=[100, 60, 96]).plan(q_len)
    q, k, v = (t.detach().to(device) for t in _inputs(1, 2, 2, q_len, q_len, 64, 64,
                                                      torch.float32))
    bm = plan.to_block_mask(device)
    fn = flex.flex_attention if device == "cpu" else torch.compile(flex.flex_attention)
    out = fn(q, k, v, block_mask=bm)
    ours = cm.attention(q.cpu(), k.cpu(), v.cpu(), plan)
    assert (out.cpu() - ours).abs().max().item() < 1e-4


# ------------------------------------------------------------------ torch.library / compile

def test_batched_gradients_go_through_the_op():
    # torch.autograd.grad(..., is_grads_batched=True) (and jacobian(vectorize=True)) hands a
    # backward torch's legacy vmap BatchedTensors: of type Tensor, with no storage. The CUDA
    # backward called directly (the eager path's skip of the dispatcher) took their address
    # and failed; through the op torch runs it once per batch entry.
    from compilemask import _ops

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 1

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            seen.append((_ops._plain_call_ok(g), _ops._bypasses_dispatcher(g)))
            return g

    x = torch.ones(3, requires_grad=True)
    torch.autograd.grad(Probe.apply(x), x, torch.ones(2, 3), is_grads_batched=True)
    torch.autograd.grad(Probe.apply(x), x, torch.ones(3))
    assert seen == [(False, False), (True, True)]
    # Batched gradients through the op equal the gradients one by one.
    plan = cm.builtin("causal").plan(7, num_heads=2)
    q, k, v = (torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = cm.attention(q, k, v, plan)
    w = torch.randn((3,) + out.shape, dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), w, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        want = torch.autograd.grad(out, (q, k, v), w[i], retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a[i], b, rtol=0, atol=1e-12)


def test_opcheck():
    from compilemask import _ops

    plan = cm.builtin("hstu", lengths=[5, 4]).plan(9)
    pt = plan.to_tensors()
    q, k, v = _inputs(1, 2, 1, 9, 9, 4, 3, torch.float64)
    plan_dims = pt.plan_dims()
    args = (q, k, v, pt.row_ptr, pt.intervals, pt.mask_index.expand(1, 2), pt.kernel_flat,
            list(pt.kernel_lens), plan_dims, 0.5, False)
    torch.library.opcheck(_ops.attention_forward, args)


def test_kernel_descriptor_is_one_flat_tensor_and_its_lengths():
    """What a CUDA launch passes for the descriptor (``kernel_flat``, ``kernel_lens``) holds
    exactly the arrays of ``kernel``, back to back: the extension refuses lengths that do
    not add up to the flat tensor's. Built here on the CPU (a plan's and a prefill layout's
    descriptor), as ``to_tensors`` and ``Step.prefill_tensors`` build it on CUDA."""
    from compilemask import _native
    from compilemask._torch import _kernel_tensors

    plan = cm.builtin("document_causal", lengths=[70, 130]).plan(200)
    arrays = plan._native.kernel_arrays()
    layout = cm.builtin("causal").plan_step([5, 3], [40, 9]).prefill_tensors("cpu", 2)
    for views, flat, lens, raw in [
        (*_kernel_tensors(torch, arrays, torch.device("cpu")), arrays),
        (layout.kernel, layout.kernel_flat, layout.kernel_lens, None),
    ]:
        assert flat.dtype == torch.int32 and flat.dim() == 1 and flat.is_contiguous()
        assert len(lens) == len(views) == len(_native.CUDA_PLAN_ARRAYS)
        assert sum(lens) == flat.numel()
        at = 0
        for i, (view, n) in enumerate(zip(views, lens)):
            # Each array starts 16-byte aligned (the kernels' vector loads).
            assert n >= 4 and n % 4 == 0
            assert view.shape == (n,) and view.data_ptr() == flat.data_ptr() + 4 * at
            if raw is not None:
                want = list(memoryview(bytes(raw[i])).cast("i"))
                assert view[:len(want)].tolist() == want
                assert not view[len(want):].any()
            at += n


def test_compile_reuses_graph_for_new_plans():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    program = cm.builtin("document_causal")

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k, v, plan):
        return cm.attention(q, k, v, plan, enable_gqa=True).square().sum()

    q, k, v = _inputs(2, 4, 2, 64, 64, 8, 8, torch.float32)
    for lengths in ([20, 44], [64], [7, 7, 50], [1] * 64):
        pt = program.plan(64, lengths=lengths).to_tensors()
        loss = step(q, k, v, pt)
        eager = cm.attention(q, k, v, pt, enable_gqa=True).square().sum()
        assert torch.allclose(loss, eager)
        loss.backward()
    assert counter.frame_count == 1


def test_compile_module_with_inductor():
    plan = cm.builtin("sliding_window", window=5).plan(16)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)

        def forward(self, x, pt):
            q = self.proj(x)
            return cm.attention(q, x, x, pt)

    block = Block()
    x = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    pt = plan.to_tensors()
    try:
        compiled = torch.compile(block, fullgraph=True)
        out = compiled(x, pt)
    except Exception as e:  # no C++ compiler for inductor on this machine
        if "compiler" in str(e).lower() or "InvalidCxxCompiler" in type(e).__name__:
            pytest.skip(f"inductor cannot compile here: {e}")
        raise
    assert torch.allclose(out, block(x, pt))
    out.sum().backward()
    assert block.proj.weight.grad is not None


def test_meta_tensors_as_values_are_named():
    # A meta tensor has a shape but no values: every argument read as values names itself
    # (torch's own "Cannot copy out of meta tensor" named nothing).
    meta = torch.tensor([5, 5], device="meta")
    with pytest.raises(TypeError, match="parameter `lengths` is a tensor on the meta device"):
        cm.builtin("document_causal", lengths=meta).plan(10)
    with pytest.raises(TypeError, match="cu_seqlens_q is a tensor on the meta device"):
        cm.builtin("causal").plan(cu_seqlens_q=torch.tensor([0, 5], device="meta"),
                                  cu_seqlens_k=[0, 5])
    with pytest.raises(TypeError, match="order is a tensor on the meta device"):
        cm.builtin("causal").plan(4, order=torch.arange(4, device="meta"))
    with pytest.raises(TypeError, match="kv_len is a tensor on the meta device"):
        cm.builtin("causal").plan_step(1, meta)
    step = cm.builtin("causal").plan_step(1, [5, 5])
    with pytest.raises(TypeError, match="new_tokens is a tensor on the meta device"):
        step.append(meta)
    # One value: a 0-d meta tensor where an int goes, alone or in a list.
    one = torch.tensor(64, device="meta")
    with pytest.raises(TypeError, match="q_len must be an int, got Tensor"):
        cm.builtin("causal").plan(one)
    with pytest.raises(TypeError, match="num_heads must be an int, got Tensor"):
        cm.builtin("causal").plan(64, num_heads=one)
    with pytest.raises(TypeError, match="parameter `lengths`: expected ints, got Tensor"):
        cm.builtin("hstu").plan(64, lengths=[one, 32])
    with pytest.raises(TypeError, match="r must be an int, got Tensor"):
        step.row(one)
