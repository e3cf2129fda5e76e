"""The wide shapes of the CUDA kernels (Hopper; skipped elsewhere): head_dim 256 (Gemma) and
head_dim 192 with head_dim_v 128 (DeepSeek's MLA), forward on fwd_ws with 128-key tiles
(64-key stages at 256) and backward on bwd_dkdv_wide (64-key CTAs, the head dim split between
the consumers) in both modes. Output, lse and the gradients of q, k and v against a float64
dense masked softmax for every workload at small odd sizes, GQA and MQA, both dtypes, the
tile-edge class with logits far from 0, per-head masks; every score term (softcap, linear
bias, bias by distance, sinks) at 192 / 128 in the forward; and the refusals: score terms
with inputs that require grad (their backward is built for head_dim 64 and 128) and unbuilt
shapes, before any work is done."""

from __future__ import annotations

import math

import pytest

import compilemask as cm

torch = pytest.importorskip("torch", reason="torch is not installed")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)")

from test_cuda import EDGE_PLANS, TOL, _err, _weighted_grads  # noqa: E402
from test_scores_cuda import CASES, EDGE_CASES, TERMS, _buckets, _check_against_dense, _reference  # noqa: E402
from test_torch import WORKLOADS, dense_attention  # noqa: E402

SHAPES = [(256, 256), (192, 128)]
# The score terms' variant is built at 192 / 128 only (at 256 its registers spill).
SCORE_SHAPES = [(192, 128)]


def _inputs(b, hq, hk, lq, lk, d, dv, dtype, seed=0, mu=0.0, sign=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(shape, shift):
        x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float64) + shift
        return x.to(dtype)

    return draw((b, hq, lq, d), mu), draw((b, hk, lk, d), sign * mu), draw((b, hk, lk, dv), 0.0)


def _check(plan, q, k, v, tol=None, lse_tol=1e-2):
    with torch.no_grad():
        out, lse = cm.attention(q, k, v, plan, return_lse=True,
                                enable_gqa=q.shape[1] != k.shape[1])
    mask = plan.to_dense(format="torch").cuda()
    ref_out, ref_lse, empty = dense_attention(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]))
    assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    err = _err(out, ref_out)
    assert err <= (tol if tol is not None else TOL[q.dtype][0]), err
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty] == 0).all()
    if (~empty).any():
        assert (lse[~empty].double() - ref_lse[~empty]).abs().max().item() <= lse_tol
    return out, ref_out


@pytest.mark.parametrize("d,dv", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,q_len,kv_len,params", WORKLOADS)
def test_wide_head_workloads_against_dense(name, q_len, kv_len, params, dtype, d, dv):
    plan = cm.builtin(name, **params).plan(q_len, kv_len)
    lk = q_len if kv_len is None else kv_len
    _check(plan, *_inputs(2, 4, 2, q_len, lk, d, dv, dtype))


@pytest.mark.parametrize("d,dv", SHAPES)
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (8, 1)])
def test_wide_head_mha_mqa_long_rows(d, dv, heads, kv_heads):
    """Several 128-key tiles per row (full and partial), so every stage of the ring turns
    over more than once and at head_dim 256 both halves of every tile are used."""
    plan = cm.builtin("sliding_window", window=300).plan(777)
    _check(plan, *_inputs(1, heads, kv_heads, 777, 777, d, dv, torch.bfloat16, seed=2))
    plan = cm.builtin("document_causal", lengths=[500, 33, 400]).plan(933)
    _check(plan, *_inputs(2, heads, kv_heads, 933, 933, d, dv, torch.float16, seed=4))


@pytest.mark.parametrize("logit_mean", [-120.0, 60.0])
@pytest.mark.parametrize("d,dv", SHAPES)
@pytest.mark.parametrize("index", range(len(EDGE_PLANS)))
def test_wide_head_tile_edges_with_extreme_logits(index, d, dv, logit_mean):
    """Keys past kv_len and rows past q_len contribute nothing whatever the logits (about
    `logit_mean` each: at -120 every lse lies below -88.7 = ln FLT_MAX)."""
    _, plan = EDGE_PLANS[index]
    scale = 1.0 / math.sqrt(d)
    mu = math.sqrt(abs(logit_mean) / (scale * d))
    q, k, v = _inputs(1, 4, 2, plan.q_len, plan.kv_len, d, dv, torch.bfloat16, seed=index,
                      mu=mu, sign=1.0 if logit_mean > 0 else -1.0)
    # Peaked rows: the output's error follows the largest probability's rounding.
    _check(plan, q, k, v, tol=4e-2, lse_tol=2e-3 * abs(logit_mean))


def test_wide_head_per_head_masks_under_gqa():
    """A mask per query head under GQA (head 0 sees nothing, the others causal or windowed)."""
    program = cm.compile("mask = h > 0 && k <= q && (h % 2 == 1 || k > q - 40);")
    plan = program.plan(200, num_heads=8)
    for d, dv in SHAPES:
        q, k, v = _inputs(2, 8, 2, 200, 200, d, dv, torch.bfloat16, seed=9)
        out, _ = _check(plan, q, k, v)
        assert (out[:, 0] == 0).all()


def _check_grads(plan, q, k, v, deterministic, tol=None, seed=1):
    """The forward as `_check`, then the gradients of test_cuda's weighted loss
    (`_weighted_grads`) against the float64 dense attention's."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = cm.attention(q, k, v, plan, return_lse=True, enable_gqa=q.shape[1] != k.shape[1],
                            deterministic=deterministic)
    mask = plan.to_dense(format="torch").cuda()
    ref_out, ref_lse, empty = dense_attention(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]))
    assert _err(out, ref_out) <= TOL[q.dtype][0]
    grads, ref_grads = _weighted_grads((q, k, v), out, lse, ref_out, ref_lse, empty, seed)
    for name, a, b, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert torch.isfinite(a).all(), name
        err = _err(a, b)
        assert err <= (tol if tol is not None else TOL[q.dtype][1]), (name, err)
    return grads


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d,dv", SHAPES)
@pytest.mark.parametrize("name,q_len,kv_len,params", WORKLOADS)
def test_wide_head_gradients_against_dense(name, q_len, kv_len, params, d, dv, deterministic):
    """Every workload, GQA 4 / 2, both backward modes (the dtype alternates)."""
    plan = cm.builtin(name, **params).plan(q_len, kv_len)
    lk = q_len if kv_len is None else kv_len
    dtype = torch.bfloat16 if (len(name) + d + deterministic) % 2 else torch.float16
    _check_grads(plan, *_inputs(2, 4, 2, q_len, lk, d, dv, dtype, seed=3), deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d,dv", SHAPES)
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (8, 1)])
def test_wide_head_gradients_mha_mqa_long_rows(heads, kv_heads, d, dv, deterministic):
    """Many query tiles per key block (dK / dV summed over tiles and over the query heads of
    a kv head), partial and full tiles in both halves of a key block, a last block whose
    second half lies past kv_len."""
    plan = cm.builtin("sliding_window", window=300).plan(777)
    _check_grads(plan, *_inputs(1, heads, kv_heads, 777, 777, d, dv, torch.bfloat16, seed=5),
                 deterministic)
    plan = cm.builtin("document_causal", lengths=[500, 33, 400]).plan(933)
    _check_grads(plan, *_inputs(2, heads, kv_heads, 933, 933, d, dv, torch.float16, seed=6),
                 deterministic)


@pytest.mark.parametrize("d,dv", SHAPES)
@pytest.mark.parametrize("index", range(len(EDGE_PLANS)))
def test_wide_head_gradients_at_tile_edges(index, d, dv):
    """The tile-edge class with logits about -120 or +60 (at -120 every lse lies below
    -88.7 = ln FLT_MAX, where exp(-lse) of a zero-filled key would overflow), the mode and
    the sign alternating over the plans: no inf or NaN, gradients against float64."""
    _, plan = EDGE_PLANS[index]
    logit_mean = -120.0 if (index + d) % 2 else 60.0
    deterministic = index % 4 < 2
    scale = 1.0 / math.sqrt(d)
    mu = math.sqrt(abs(logit_mean) / (scale * d))
    q, k, v = _inputs(1, 4, 2, plan.q_len, plan.kv_len, d, dv, torch.bfloat16, seed=index,
                      mu=mu, sign=1.0 if logit_mean > 0 else -1.0)
    # Peaked rows: the errors follow the largest probability's rounding.
    _check_grads(plan, q, k, v, deterministic, tol=6e-2)


@pytest.mark.parametrize("d,dv", SHAPES)
def test_wide_head_gradients_per_head_masks_under_gqa(d, dv):
    """A mask per query head under GQA (head 0 sees nothing: zero dQ, nothing in dK / dV)."""
    program = cm.compile("mask = h > 0 && k <= q && (h % 2 == 1 || k > q - 40);")
    plan = program.plan(200, num_heads=8)
    for deterministic in (False, True):
        dq, _, _ = _check_grads(plan, *_inputs(2, 8, 2, 200, 200, d, dv, torch.bfloat16, seed=9),
                                deterministic)
        assert (dq[:, 0] == 0).all()


@pytest.mark.parametrize("d,dv", SHAPES)
def test_wide_head_deterministic_backward_repeats_its_bits(d, dv):
    plan = cm.builtin("document_causal", lengths=[300, 41, 500]).plan(841)
    q, k, v = (x.requires_grad_() for x in _inputs(1, 4, 2, 841, 841, d, dv, torch.bfloat16, seed=8))
    runs = []
    for _ in range(2):
        out = cm.attention(q, k, v, plan, enable_gqa=True, deterministic=True)
        runs.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_wide_head_refusals_name_the_shape():
    plan = cm.builtin("causal").plan(64)
    q, k, v = _inputs(1, 2, 2, 64, 64, 192, 192, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="192 \\(head_dim_v 128\\), 256"):
        cm.attention(q, k, v, plan)
    # The score terms' backward is built at 64 and 128 only: refused before the forward.
    scored = cm.builtin("causal_softcap").plan(64, num_heads=2)
    for d, dv in SCORE_SHAPES:
        q, k, v = _inputs(1, 2, 2, 64, 64, d, dv, torch.bfloat16)
        q.requires_grad_()
        with pytest.raises(NotImplementedError, match=f"a softcap or biases.*head_dim {d} and head_dim_v {dv}"):
            cm.attention(q, k, v, scored)
    q, k, v = _inputs(1, 2, 2, 64, 64, 256, 256, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="with a softcap or biases on CUDA supports .* "
                       "head_dim 64, 128, 192 \\(head_dim_v 128\\) "):
        with torch.no_grad():
            cm.attention(q, k, v, scored)


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("d,dv", SCORE_SHAPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_wide_head_score_terms_forward(case, d, dv, terms):
    """Each score term (and all together) at MLA's shape, forward output and lse against
    the float64 dense attention with the terms applied (test_scores_cuda's reference)."""
    from compilemask import _ops

    name, params, lq, lk = case
    plan = cm.builtin(name, **params).plan(lq, lk)
    pt = plan.to_tensors("cuda")
    mask = plan.to_dense(format="torch").cuda()
    q, k, v = _inputs(2, 4, 2, lq, lk, d, dv, torch.bfloat16, seed=13)
    g = torch.Generator(device="cuda").manual_seed(17)
    use = {t: terms in (t, "all") for t in TERMS[:4]}
    softcap = 5.0 if use["softcap"] else 0.0
    slopes = (torch.tensor([2.0 ** (-(i + 1)) for i in range(4)], device="cuda")
              if use["linear"] else None)
    linear = [-1.0, 1.0, 0.0]
    dist_bias = run_end = None
    if use["dist"]:
        bucket = torch.tensor(_buckets(lq, lk), device="cuda")
        table = torch.randn((4, 8), generator=g, device="cuda")
        dist_bias, run_end = _ops.table_by_distance(table, bucket)
    sinks = torch.randn((4,), generator=g, device="cuda") + 1.0 if use["sinks"] else None
    scale = 1.0 / math.sqrt(d)
    with torch.no_grad():
        out, lse = _ops.attention_forward_score(
            q, k, v, pt.kernel_flat, list(pt.kernel_lens), pt.plan_dims(), scale,
            False, softcap, linear, slopes, dist_bias, run_end, sinks)
    ref_out, ref_lse = _reference(q, k, v, mask, scale, softcap, linear, slopes, dist_bias,
                                  sinks)
    assert out.shape == (2, 4, lq, dv) and torch.isfinite(out).all()
    assert _err(out, ref_out) <= TOL[torch.bfloat16][0], _err(out, ref_out)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 2e-2


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shift", [0.0, -120.0, 60.0])
@pytest.mark.parametrize("d,dv", SHAPES)
@pytest.mark.parametrize("case", CASES[:2] + EDGE_CASES[:2], ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}")
def test_wide_head_sinks_alone_forward_and_gradients(case, d, dv, shift, deterministic):
    """Sinks alone run on the plain kernels (they change only each row's normalisation), so
    the wide shapes, which have no score-term backward, train with them: output, lse and the
    gradients of q, k, v and the sinks against the float64 dense attention, sinks shifted to
    about -120 and +60 as well (a row's sink then far outweighs, or vanishes beside, its
    keys)."""
    _check_against_dense(case, ("sinks",), deterministic, torch.bfloat16, d, 4, 2, shift, dv=dv)


def test_wide_head_sinks_through_attention():
    """`compilemask.attention` with a program whose only score statement is a sink takes
    inputs that require grad at head_dim 256 (no refusal) and its sinks get a gradient."""
    prog = cm.compile("tensor sinks: [num_heads];\nmask = q - 40 < k <= q;\nsink = sinks[h];")
    plan = prog.plan(100, num_heads=4)
    q, k, v = _inputs(1, 4, 2, 100, 100, 256, 256, torch.bfloat16)
    q.requires_grad_()
    sinks = torch.zeros((4,), device="cuda", requires_grad=True)
    out = cm.attention(q, k, v, plan.to_tensors("cuda"), enable_gqa=True, score_tensors={"sinks": sinks})
    out.float().square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(sinks.grad).all()
    assert sinks.grad.abs().sum().item() > 0
