"""The CUDA kernels behind `compilemask.attention` (Hopper GPUs; skipped elsewhere): forward,
lse and gradients against a float64 dense masked softmax and against SDPA with a dense mask,
for every workload at small odd sizes, GQA, bfloat16 / float16, head_dim 64 / 128, empty
rows, per-batch / per-head masks, token orders, the deterministic backward, validation,
torch.compile and CUDA graph capture."""

from __future__ import annotations

import contextlib
import math

import pytest

import compilemask as cm

torch = pytest.importorskip("torch", reason="torch is not installed")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)")

from test_torch import WORKLOADS, dense_attention  # noqa: E402

F = torch.nn.functional
# Max error allowed, relative to the reference's largest magnitude (at least 1).
TOL = {torch.bfloat16: (2e-2, 4e-2), torch.float16: (4e-3, 1e-2)}


def _inputs(b, hq, hk, lq, lk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d))
    return [torch.randn(s, generator=g, device="cuda", dtype=torch.float32).to(dtype)
            .requires_grad_() for s in shapes]


def _err(a, ref):
    return (a.double() - ref.double()).abs().max().item() / max(1.0, ref.abs().max().item())


def _weighted_grads(inputs, out, lse, ref_out, ref_lse, empty, seed=1):
    """The gradients with respect to `inputs` (q, k, v) of `sum(out * w_out) + sum(lse *
    w_lse)`, ours and the float64 dense reference's (`ref_out`, `ref_lse`), by autograd on
    both sides: random float64 weights drawn from `seed`, so both of the backward's inputs
    are exercised, with `w_lse` 0 at the rows that see no key (`empty`, lse -inf)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, device="cuda",
                        dtype=torch.float64).masked_fill(empty, 0)
    loss = (out.double() * w_out).sum() + (lse.double().masked_fill(empty, 0) * w_lse).sum()
    grads = torch.autograd.grad(loss, inputs)
    ref_loss = (ref_out * w_out).sum() + (ref_lse.masked_fill(empty, 0) * w_lse).sum()
    return grads, torch.autograd.grad(ref_loss, inputs)


def _check(plan, q, k, v, enable_gqa=False, deterministic=False):
    dtype = q.dtype
    tol_out, tol_grad = TOL[dtype]
    out, lse = cm.attention(q, k, v, plan, return_lse=True, enable_gqa=enable_gqa,
                            deterministic=deterministic)
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = plan.to_dense(format="torch").cuda()
    ref_out, ref_lse, empty = dense_attention(q, k, v, mask, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert _err(out, ref_out) <= tol_out
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty] == 0).all()
    if (~empty).any():
        assert (lse[~empty].double() - ref_lse[~empty]).abs().max().item() <= 1e-2
    grads, ref_grads = _weighted_grads((q, k, v), out, lse, ref_out, ref_lse, empty)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.dtype == dtype and not torch.isnan(a).any(), name
        assert _err(a, b) <= tol_grad, (name, _err(a, b))
    return grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,q_len,kv_len,params", WORKLOADS)
def test_workloads_gqa_against_dense(name, q_len, kv_len, params, dtype):
    plan = cm.builtin(name, **params).plan(q_len, kv_len)
    lk = q_len if kv_len is None else kv_len
    q, k, v = _inputs(2, 4, 2, q_len, lk, 64, dtype)
    _check(plan, q, k, v, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,q_len,params", [
    ("hstu", 203, {"lengths": [120, 33, 50]}),
    ("clear", 16 + 13 * 13, {"text": 16, "grid": 13, "radius": 4}),
])
def test_head_dim_128_and_mha(name, q_len, params, dtype):
    plan = cm.builtin(name, **params).plan(q_len)
    q, k, v = _inputs(1, 3, 3, q_len, q_len, 128, dtype, seed=3)
    _check(plan, q, k, v)


@pytest.mark.parametrize("name,q_len,params", [
    ("sliding_window", 333, {"window": 50}),
    ("shared_prefix", 301, {"prompts": [101], "responses": [50, 70, 80], "group": 3}),
])
def test_against_sdpa(name, q_len, params):
    plan = cm.builtin(name, **params).plan(q_len)
    q, k, v = _inputs(2, 4, 4, q_len, q_len, 64, torch.bfloat16, seed=5)
    out = cm.attention(q, k, v, plan)
    mask = plan.to_dense(format="torch").cuda()
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)
    assert _err(out, ref) <= 2e-2
    w = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), w.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), w)
    for a, b in zip(grads, ref_grads):
        assert _err(a, b) <= 4e-2


def _edge_plans():
    """The tile-edge class: lengths congruent to 1, 63, 64, 65 and 127 modulo 128 (ends inside
    every kernel's 64-row, 128-row and 128-key tiles), q_len below and above kv_len, an
    all-visible mask (full edge tiles), top-left and bottom-right causal (partial edge tiles),
    packed documents that end mid-tile, and a cu_seqlens plan whose samples end mid-tile."""
    full = cm.compile("mask = k >= 0;")
    for r in (1, 63, 64, 65, 127):
        yield f"full {128 + r}x{256 + 128 - r}", full.plan(128 + r, 256 + 128 - r)
        yield f"full {256 + 128 - r}x{128 + r}", full.plan(256 + 128 - r, 128 + r)
        yield f"causal {128 + r}", cm.builtin("causal").plan(128 + r)
        yield f"causal_bottom_right {128 + r}x{384 + 128 - r}", \
            cm.builtin("causal_bottom_right").plan(128 + r, 384 + 128 - r)
        yield f"document_causal {256 + r}", \
            cm.builtin("document_causal", lengths=[100, 77, 150]).plan(256 + r)
    yield "cu_seqlens 0,65,193,320", cm.builtin("causal").plan(cu_seqlens_q=[0, 65, 193, 320])


EDGE_PLANS = list(_edge_plans()) if HOPPER else []


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("logit_mean", [-120.0, 60.0])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128)])
@pytest.mark.parametrize("index", range(len(EDGE_PLANS)))
def test_tile_edges_with_extreme_logits(index, dtype, head_dim, logit_mean, deterministic):
    """Keys past kv_len and rows past q_len contribute nothing whatever the logits: Q and K
    are drawn around a common direction so that every scaled logit is about `logit_mean`
    (at -120 every lse lies far below -88.7 = ln FLT_MAX, where exp(-lse) overflows fp32).
    Output, lse and gradients against float64, within twice the error of PyTorch's own
    attention (SDPA with the dense mask) in the same dtype plus 1e-3."""
    name, plan = EDGE_PLANS[index]
    lq, lk = plan.q_len, plan.kv_len
    g = torch.Generator(device="cuda").manual_seed(index)
    scale = 1.0 / math.sqrt(head_dim)
    mu = math.sqrt(abs(logit_mean) / (scale * head_dim))
    sign = 1.0 if logit_mean > 0 else -1.0

    def draw(shape, shift):
        x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float64) + shift
        return x.to(dtype).requires_grad_()

    q = draw((1, 4, lq, head_dim), mu)
    k = draw((1, 2, lk, head_dim), sign * mu)
    v = draw((1, 2, lk, head_dim), 0.0)
    dout = torch.randn((1, 4, lq, head_dim), generator=g, device="cuda", dtype=torch.float64)
    mask = plan.to_dense(format="torch").cuda()

    out, lse = cm.attention(q, k, v, plan, return_lse=True, enable_gqa=True,
                            deterministic=deterministic)
    ours = (out, *torch.autograd.grad(out, (q, k, v), dout.to(dtype)))
    # The memory-efficient kernel: fp32 scores and a fresh running maximum, as the other
    # flash-style kernels (the math backend would round the scores to the dtype).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1),
                                              v.repeat_interleave(2, dim=1), attn_mask=mask)
    torch_own = (sdpa, *torch.autograd.grad(sdpa, (q, k, v), dout.to(dtype)))
    ref_out, ref_lse, empty = dense_attention(q, k, v, mask, scale)
    exact = (ref_out, *torch.autograd.grad(ref_out, (q, k, v), dout))
    assert not empty.any()
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3, name
    for what, a, t, e in zip(("out", "dq", "dk", "dv"), ours, torch_own, exact):
        assert torch.isfinite(a).all(), (name, what)
        err = (a.double() - e).abs().max().item()
        torch_err = (t.double() - e).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, (name, what, err, torch_err)


def test_deterministic_backward_repeats_its_bits():
    plan = cm.builtin("document_causal", lengths=[100, 77, 140]).plan(317)
    q, k, v = _inputs(2, 4, 2, 317, 317, 64, torch.bfloat16, seed=7)
    first = _check(plan, q, k, v, enable_gqa=True, deterministic=True)
    second = _check(plan, q, k, v, enable_gqa=True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


class _Recorded(torch.overrides.TorchFunctionMode):
    """A mode that changes nothing: with one active, `attention` goes through torch's
    dispatcher (the custom op) instead of its eager path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [False, True])
def test_eager_path_equals_the_op(grad):
    # Eager calls skip torch's dispatcher; the op (torch.compile, modes, transforms) must
    # give the same bits, gradients included (deterministic backward), and refuse a double
    # backward alike.
    plan = cm.builtin("document_causal", lengths=[61, 70, 2]).plan(133)
    q, k, v = _inputs(2, 4, 2, 133, 133, 64, torch.bfloat16, seed=21)
    w = torch.randn(2, 4, 133, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for mode in (None, _Recorded()):
        with mode or contextlib.nullcontext(), torch.set_grad_enabled(grad):
            out, lse = cm.attention(q, k, v, plan, enable_gqa=True, return_lse=True,
                                    deterministic=True)
            got = [out, lse]
            if grad:
                got += torch.autograd.grad((out * w).float().sum() + lse.sum(), (q, k, v))
        results.append(got)
        assert out.requires_grad == grad
    for a, b in zip(*results):
        assert torch.equal(a, b)
    if grad:
        out = cm.attention(q, k, v, plan, enable_gqa=True)
        g, = torch.autograd.grad(out.float().pow(2).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="no second-order gradients"):
            torch.autograd.grad(g.float().pow(2).sum(), q)


def test_batched_gradients_equal_one_by_one():
    # is_grads_batched=True hands the backward legacy-vmap BatchedTensors (type Tensor, no
    # storage): the eager path's direct backward must leave them to the op, which torch runs
    # once per batch entry.
    plan = cm.builtin("document_causal", lengths=[40, 27]).plan(67)
    q, k, v = _inputs(1, 2, 2, 67, 67, 64, torch.bfloat16, seed=5)
    out = cm.attention(q, k, v, plan, deterministic=True)
    w = torch.randn((3,) + out.shape, device="cuda", dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), w, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        want = torch.autograd.grad(out, (q, k, v), w[i], retain_graph=True)
        for a, b in zip(got, want):
            assert torch.equal(a[i], b)


def test_per_batch_and_per_head_masks():
    program = cm.compile("param windows: [int] = [1, 30, 5];\nparam n: [int] = [40, 90];\n"
                         "mask = if q < n[b] then q - windows[h % count(windows)] < k <= q "
                         "else k < kv_len;")
    plan = program.plan(97, batch=2, num_heads=3)
    assert plan.num_masks == 6
    q, k, v = _inputs(2, 3, 3, 97, 97, 64, torch.bfloat16, seed=9)
    _check(plan, q, k, v)
    per_batch = cm.compile("param n: [int] = [40, 90];\nmask = k <= q && k < n[b];")
    q, k, v = _inputs(2, 4, 2, 97, 97, 64, torch.float16, seed=10)
    _check(per_batch.plan(97, batch=2), q, k, v, enable_gqa=True)


# Per-(batch, head) masks under MHA, GQA 4:1 and 32:8, and MQA: heads that see nothing, causal
# heads, per-head windows, masks that differ per batch; one launch per call in every case.
PER_HEAD_MASKS = {
    "head 0 empty, others causal": "mask = h > 0 && k <= q + kv_len - q_len;",
    "per-head windows": "mask = q + kv_len - q_len - 3 * h - 1 < k <= q + kv_len - q_len;",
    "per-batch and per-head": "param n: [int] = [40, 90, 7];\n"
                              "mask = (k <= q && k < n[b % 3] + h) || (h % 3 == 2 && k < 5);",
}


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("heads,batch,lq,lk,d,dtype", [
    ((4, 4), 2, 97, 97, 64, torch.bfloat16),      # MHA
    ((8, 2), 2, 129, 200, 128, torch.float16),    # GQA 4:1
    ((32, 8), 1, 8, 8, 128, torch.bfloat16),      # GQA 32:8, decode length 8
    ((32, 8), 1, 8, 300, 64, torch.float16),      # GQA 32:8, 8 new rows over a longer cache
    ((6, 1), 2, 65, 65, 64, torch.bfloat16),      # MQA
])
@pytest.mark.parametrize("mask", sorted(PER_HEAD_MASKS))
def test_per_head_masks_under_gqa(mask, heads, batch, lq, lk, d, dtype, deterministic):
    hq, hk = heads
    plan = cm.compile(PER_HEAD_MASKS[mask]).plan(lq, lk, batch=batch, num_heads=hq)
    assert plan.num_masks > 1
    q, k, v = _inputs(batch, hq, hk, lq, lk, d, dtype, seed=hq + lq)
    _check(plan, q, k, v, enable_gqa=hq != hk, deterministic=deterministic)


def _kernel_launches(fn) -> dict:
    """Names and counts of the CUDA kernels ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("cm_"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def test_one_launch_for_a_plan_of_sixteen_per_head_masks():
    """Sliding windows of 16, 32, ..., 256 keys, one per head: one forward kernel launch and
    one backward sequence (pre, dK/dV, post) per call, whatever the number of masks."""
    program = cm.compile("mask = q - 16 * (h + 1) < k <= q;")
    plan = program.plan(300, num_heads=16)
    assert plan.num_masks == 16
    q, k, v = _inputs(2, 16, 4, 300, 300, 64, torch.bfloat16, seed=21)
    _check(plan, q, k, v, enable_gqa=True)
    fwd = _kernel_launches(lambda: cm.attention(q, k, v, plan, enable_gqa=True))
    assert fwd == {"cm_fwd_ws": 1}, fwd
    out = cm.attention(q, k, v, plan, enable_gqa=True)
    bwd = _kernel_launches(lambda: torch.autograd.grad(out.sum(), (q, k, v)))
    assert bwd == {"cm_bwd_pre": 1, "cm_bwd_dkdv": 1, "cm_bwd_post": 1}, bwd


def test_token_order_on_the_gpu():
    program = cm.builtin("clear", text=16, grid=32, radius=5)
    n = 16 + 32 * 32
    raster, auto = program.plan(n, block_size=64), program.plan(n, block_size=64, order="auto")
    assert auto.computed_pairs <= raster.computed_pairs
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, n, n, 64, torch.bfloat16, seed=11))
    out = cm.attention(q, k, v, raster)
    pout = cm.attention(cm.permute(q, auto), cm.permute(k, auto), cm.permute(v, auto), auto)
    assert _err(cm.unpermute(pout, auto), out) <= 1e-2


def test_validation():
    plan = cm.builtin("causal").plan(64)
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, 64, 64, 64, torch.bfloat16))
    with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
        cm.attention(q.float(), k.float(), v.float(), plan)
    with pytest.raises(NotImplementedError, match="head_dim 64, 128, 192 \\(head_dim_v 128\\), 256"):
        cm.attention(q[..., :32], k[..., :32], v[..., :32], plan)
    wide = torch.zeros(1, 2, 64, 72, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="aligned"):
        cm.attention(wide[..., 1:65], k, v, plan)  # a 2-byte offset
    strided = torch.zeros(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)[..., ::2]
    with pytest.raises(ValueError, match="stride"):
        cm.attention(strided, k, v, plan)
    with pytest.raises(ValueError, match="to_tensors"):
        cm.attention(q, k, v, plan.to_tensors("cpu"))
    with pytest.raises(ValueError, match="q_len = 64"):
        cm.attention(q[:, :, :63], k, v, plan)
    with pytest.raises(ValueError, match="one device"):
        cm.attention(q, k.cpu(), v, plan)
    # Gradients whose layout autograd chooses (zero strides from sum()) are fine.
    qg, kg, vg = (t.requires_grad_() for t in (q.clone(), k.clone(), v.clone()))
    cm.attention(qg, kg, vg, plan).sum().backward()
    assert qg.grad is not None and not torch.isnan(qg.grad).any()


def test_torch_compile_module():
    plan = cm.builtin("hstu", lengths=[70, 57]).plan(127)
    pt = plan.to_tensors("cuda")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)

        def forward(self, x, pt):
            return cm.attention(self.proj(x), x, x, pt)

    block = Block()
    x = torch.randn(1, 2, 127, 64, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, pt)
    assert _err(out, block(x, pt)) <= 1e-2
    out.float().square().sum().backward()
    grad = block.proj.weight.grad.clone()
    block.proj.weight.grad = None
    block(x, pt).float().square().sum().backward()
    assert _err(grad, block.proj.weight.grad) <= 2e-2


def test_cuda_graph_capture():
    plan = cm.builtin("sliding_window", window=40).plan(200)
    pt = plan.to_tensors("cuda")
    q, k, v = (t.detach() for t in _inputs(1, 4, 2, 200, 200, 64, torch.bfloat16, seed=13))
    static = [t.clone().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out = cm.attention(*static, pt, enable_gqa=True)
        return (out, *torch.autograd.grad(out, static, grad_out))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: loads the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new = _inputs(1, 4, 2, 200, 200, 64, torch.bfloat16, seed=14)
    with torch.no_grad():
        for s, t in zip(static, new):
            s.copy_(t)
    graph.replay()
    eager_out = cm.attention(*new, pt, enable_gqa=True)
    eager = (eager_out, *torch.autograd.grad(eager_out, new, grad_out))
    for a, b in zip(captured, eager):
        assert torch.equal(a, b) or _err(a, b) <= 1e-2
