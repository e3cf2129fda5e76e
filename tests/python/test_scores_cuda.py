"""The score terms' CUDA kernels (softcap, linear bias, bias by distance, sinks; Hopper GPUs,
skipped elsewhere) against a float64 dense attention written here from the formulas of
`compilemask._ops` ("score terms"): forward output and lse, and the gradients of q, k, v, the
distance table and the sinks, for causal, sliding-window and document masks at odd lengths
(full, partial and empty tiles; empty rows with and without a sink), q_len != kv_len, GQA,
bfloat16 / float16, head_dim 64 / 128, both backward modes."""

from __future__ import annotations

import math

import pytest

import compilemask as cm

torch = pytest.importorskip("torch", reason="torch is not installed")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)")

# Max error relative to the reference's largest magnitude (at least 1): output, gradients.
TOL = {torch.bfloat16: (2e-2, 4e-2), torch.float16: (4e-3, 1e-2)}


def _buckets(lq: int, lk: int, num_buckets: int = 8, max_distance: int = 40) -> list[int]:
    """A T5-style bucket of every distance d = q - k (index d + lk - 1): exact below
    num_buckets / 2, logarithmic up to max_distance, one bucket beyond; negative
    distances (keys after the query) in a bucket of their own."""
    out = []
    exact = num_buckets // 2
    for i in range(lq + lk - 1):
        d = i - (lk - 1)
        if d < 0:
            out.append(num_buckets - 1)
        elif d < exact:
            out.append(d)
        else:
            b = exact + int(math.log(d / exact) / math.log(max_distance / exact) * (num_buckets - 1 - exact))
            out.append(min(b, num_buckets - 2))
    return out


def _run_end(bucket: list[int]) -> list[int]:
    ends = [0] * len(bucket)
    for i in range(len(bucket) - 1, -1, -1):
        ends[i] = ends[i + 1] if i + 1 < len(bucket) and bucket[i + 1] == bucket[i] else i
    return ends


def _logits(q, k, scale, softcap, linear, slopes, dist_bias):
    """Every pair's logit with the score terms, float64, [batch, num_heads, q_len, kv_len]
    (k already repeated to the query heads)."""
    hq, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    s = scale * q @ k.transpose(-1, -2)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    qi = torch.arange(lq, device=q.device, dtype=torch.float64).view(-1, 1)
    ki = torch.arange(lk, device=q.device, dtype=torch.float64).view(1, -1)
    if slopes is not None:
        qc, kc, off = linear
        s = s + slopes.double().view(1, -1, 1, 1) * (qc * qi + kc * ki + off)
    if dist_bias is not None:
        idx = (qi - ki + lk - 1).long()
        table = dist_bias.double()
        if table.shape[0] == 1:
            table = table.expand(hq, -1)
        s = s + table[:, idx].unsqueeze(0)
    return s


def _reference(q, k, v, mask, scale, softcap, linear, slopes, dist_bias, sinks):
    """float64 dense attention with the score terms; returns out, lse (empty rows: 0 and
    -inf, or the sink)."""
    q, k, v = (t.double() for t in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    lq = q.shape[2]
    s = _logits(q, k, scale, softcap, linear, slopes, dist_bias).masked_fill(~mask, -math.inf)
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(s.shape[0], -1, lq, 1)
        full = torch.cat([s, sink], dim=-1)
        lse = torch.logsumexp(full, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
    else:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ v, lse


CASES = [
    # (builtin, params, lq, lk)
    ("causal", {}, 197, 197),
    ("sliding_window", {"window": 70}, 261, 261),
    ("causal_bottom_right", {}, 200, 77),  # the top rows see no key
    ("document_causal", {"lengths": [50, 1, 90, 40]}, 181, 181),
    ("prefix_lm", {"prefix": 60}, 150, 150),  # keys after the query (negative distances)
]
TERMS = ["softcap", "linear", "dist", "sinks", "all"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype,d,hq,hk", [(torch.bfloat16, 64, 4, 2), (torch.float16, 128, 2, 2)])
def test_score_terms_against_dense(case, terms, deterministic, dtype, d, hq, hk):
    _check_against_dense(case, terms, deterministic, dtype, d, hq, hk)


# Lengths 1, 63, 64, 65 and 127 past a multiple of 128 (full and partial edge tiles of every
# kernel's tile), q_len != kv_len among them.
EDGE_CASES = [
    ("causal_bottom_right", {}, 129, 129),
    ("causal_bottom_right", {}, 63, 191),
    ("causal_bottom_right", {}, 192, 192),
    ("sliding_window", {"window": 70}, 193, 193),
    ("causal_bottom_right", {}, 100, 255),
]


@pytest.mark.parametrize("shift", [-120.0, 60.0])
@pytest.mark.parametrize("terms", ["dist", "all"])
@pytest.mark.parametrize("case", EDGE_CASES, ids=[f"{c[2]}x{c[3]}" for c in EDGE_CASES])
@pytest.mark.parametrize("deterministic", [False, True])
def test_score_terms_at_tile_edges_with_extreme_logits(case, terms, shift, deterministic):
    """Logits around -120 (lse far below ln(FLT_MIN) = -87.3: a key past kv_len recomputed
    with score 0 would give exp(-lse) = inf) and around +60, through the table (and the
    sinks), at lengths that end inside a tile: no inf or NaN, the float64 reference's values."""
    _check_against_dense(case, terms, deterministic, torch.bfloat16, 64, 4, 2, shift)


# A softcap alone runs the forward against a fixed reference instead of each row's maximum
# where the cap is small enough for P's type (score.cuh, cm_softcap_fixed_ref: bf16 c <= 56.8,
# fp16 c <= 10.05), and the running maximum above: caps on both sides of each bound, logits
# mild, saturating the tanh both ways (peaked rows), or all near -c (every probability
# at the bottom of the reference's range), with and without sinks.
SOFTCAP_CASES = [(torch.bfloat16, c) for c in (1.0, 30.0, 50.0, 56.5, 57.5)] + \
                [(torch.float16, c) for c in (5.0, 10.0, 10.5, 30.0)]


@pytest.mark.parametrize("logits", ["mild", "saturated", "all_low"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", EDGE_CASES[1:4:2], ids=["63x191", "193x193"])
@pytest.mark.parametrize("dtype,cap", SOFTCAP_CASES, ids=[f"{str(t)[6:]}-{c}" for t, c in SOFTCAP_CASES])
def test_softcap_alone_on_both_sides_of_the_fixed_reference(case, dtype, cap, with_sinks, logits):
    terms = ("softcap", "sinks") if with_sinks else ("softcap",)
    _check_against_dense(case, terms, False, dtype, 64, 4, 2, softcap=cap, logits=logits)


def _check_against_dense(case, terms, deterministic, dtype, d, hq, hk, shift=0.0, softcap=5.0, logits="mild",
                         dv=None):
    """Forward and gradients of one plan with `terms` (a name of TERMS, or a tuple of them)
    against the float64 dense attention; `shift` is added to every table entry and sink; `dv`
    is head_dim_v (default `d`).
    `logits`: "mild" (q and k of scale 1.5), "saturated" (q 40 times larger: scaled logits of
    about +-90) or "all_low" (as saturated, with every q . k negative)."""
    from compilemask import _ops

    name, params, lq, lk = case
    plan = cm.builtin(name, **params).plan(lq, lk)
    pt = plan.to_tensors("cuda")
    mask = plan.to_dense(format="torch").cuda()
    g = torch.Generator(device="cuda").manual_seed(7)
    b = 2
    q = torch.randn((b, hq, lq, d), generator=g, device="cuda") * (1.5 if logits == "mild" else 60.0)
    k = torch.randn((b, hk, lk, d), generator=g, device="cuda") * 1.5
    if logits == "all_low":
        q, k = -q.abs(), k.abs()
    q = q.to(dtype).requires_grad_()
    k = k.to(dtype).requires_grad_()
    v = torch.randn((b, hk, lk, dv or d), generator=g, device="cuda").to(dtype).requires_grad_()
    scale = 1.0 / math.sqrt(d)
    use = {t: (t in terms) if isinstance(terms, tuple) else terms in (t, "all") for t in TERMS[:4]}
    softcap = softcap if use["softcap"] else 0.0
    slopes = (torch.tensor([2.0 ** (-(i + 1)) for i in range(hq)], device="cuda")
              if use["linear"] else None)
    linear = [-1.0, 1.0, 0.0]
    dist_bias = run_end = None
    if use["dist"]:
        bucket = torch.tensor(_buckets(lq, lk), device="cuda")
        table = (torch.randn((hq, 8), generator=g, device="cuda") + shift).requires_grad_()
        dist_bias, run_end = _ops.table_by_distance(table, bucket)
        assert run_end.tolist() == _run_end(bucket.tolist())
    sinks = ((torch.randn((hq,), generator=g, device="cuda") + 1.0 + shift).requires_grad_()
             if use["sinks"] else None)

    out, lse = _ops.attention_forward_score(
        q, k, v, pt.kernel_flat, list(pt.kernel_lens), pt.plan_dims(), scale,
        deterministic, softcap, linear, slopes, dist_bias, run_end, sinks)
    ref_out, ref_lse = _reference(q, k, v, mask, scale, softcap, linear, slopes, dist_bias, sinks)
    tol_out, tol_grad = TOL[dtype]
    err = (out.double() - ref_out).abs().max().item() / max(1.0, ref_out.abs().max().item())
    assert not torch.isnan(out).any() and err <= tol_out, err
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 2e-2

    w = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float64)
    # The loss reads lse too (rows whose lse is -inf left out: a constant).
    wl = torch.randn(lse.shape, generator=g, device="cuda", dtype=torch.float64) * finite
    inputs = [q, k, v] + ([table] if use["dist"] else []) + ([sinks] if use["sinks"] else [])
    # The table reaches both through one gather: keep its graph for the reference.
    loss = (out.double() * w).sum() + (lse.double().masked_fill(~finite, 0) * wl).sum()
    grads = torch.autograd.grad(loss, inputs, retain_graph=True)
    ref_loss = (ref_out * w).sum() + (ref_lse.masked_fill(~finite, 0) * wl).sum()
    ref_grads = list(torch.autograd.grad(ref_loss, inputs[:3], retain_graph=True))
    # The table's and the sinks' gradients are sums of dS = P (dP - delta) over many pairs,
    # and each row's dS sums to dout . (O - O_rounded): the output's rounding to the element
    # type, which any kernel's delta = rowsum(dout * out) carries. So their reference takes
    # delta from the kernel's own output (everything else in float64), as the gradients
    # of q, k and v need not.
    delta = (w * out.detach().double()).sum(-1) - wl
    if use["dist"] or use["sinks"]:
        p, dp = _probs_and_dp(q, k, v, mask, scale, softcap, linear, slopes, dist_bias, sinks, w)
        ds = p * (dp - delta.unsqueeze(-1))
        if use["dist"]:
            ref_grads.append(_table_grad(ds, bucket, 8))
        if use["sinks"]:
            ref_grads.append(_sink_grad(sinks, ref_lse, delta))
    for i, (gr, rf) in enumerate(zip(grads, ref_grads)):
        e = (gr.double() - rf).abs().max().item() / max(1.0, rf.abs().max().item())
        assert not torch.isnan(gr).any() and e <= tol_grad, (i, e)


def _table_grad(ds, bucket, num_buckets):
    """d loss / d table[h, j] from every pair's dS ([batch, heads, q_len, kv_len], float64):
    summed per distance q - k, then per bucket."""
    _, hq, lq, lk = ds.shape
    idx = (torch.arange(lq, device=ds.device).view(-1, 1) - torch.arange(lk, device=ds.device).view(1, -1)
           + lk - 1)
    per_dist = torch.zeros((hq, lq + lk - 1), device=ds.device, dtype=torch.float64)
    per_dist.index_add_(1, idx.reshape(-1), ds.sum(0).reshape(hq, -1))
    return torch.zeros((hq, num_buckets), device=ds.device, dtype=torch.float64).index_add_(1, bucket, per_dist)


def _sink_grad(sinks, lse, delta):
    """d loss / d sinks[h] = -sum over rows of exp(sink - lse) delta (float64)."""
    return -(torch.exp(sinks.double().view(1, -1, 1) - lse) * delta).sum((0, 2))


def _probs_and_dp(q, k, v, mask, scale, softcap, linear, slopes, dist_bias, sinks, w):
    """P of every pair (float64, sink included in the denominator) and dP = w . v."""
    with torch.no_grad():
        hq, hk = q.shape[1], k.shape[1]
        out, lse = _reference(q, k, v, mask, scale, softcap, linear, slopes, dist_bias, sinks)
        kk = k.double().repeat_interleave(hq // hk, dim=1)
        vv = v.double().repeat_interleave(hq // hk, dim=1)
        s = _logits(q.double(), kk, scale, softcap, linear, slopes, dist_bias).masked_fill(~mask, -math.inf)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        return p, w @ vv.transpose(-1, -2)


PROGRAMS = [
    # (source, tensors: name -> shape factory (num_heads))
    ("param cap: int = 5;\nmask = k <= q;\nscore = softcap(score, cap);", {}),
    ("mask = k <= q + kv_len - q_len;\nscore = score - alibi_slopes(num_heads)[h] * (q + kv_len - q_len - k);", {}),
    ("tensor rel_bias: [num_heads, 32];\nmask = k <= q;\n"
     "score = score + rel_bias[h][t5_bucket(k - q, 32, 128, false)];", {"rel_bias": lambda h: (h, 32)}),
    ("tensor rel: [17];\nmask = q - 64 < k <= q;\nscore = softcap(score, 30.0) + rel[min(max(q - k, -8), 8) + 8];",
     {"rel": lambda h: (17,)}),
    ("tensor sinks: [num_heads];\nmask = q - 40 < k <= q;\nsink = sinks[h];", {"sinks": lambda h: (h,)}),
]


@pytest.mark.parametrize("source,shapes", PROGRAMS, ids=["softcap", "alibi_br", "t5", "clipped", "sinks"])
def test_attention_with_score_tensors_against_dense(source, shapes):
    """compilemask.attention with a program's score terms (the plan's ScoreTensors and the
    tensors by name) against the float64 dense reference of the same terms; the CPU path
    (the Rust reference) against it too."""
    hq, hk, lq, lk, d = 4, 2, 150, 181, 64
    g = torch.Generator(device="cuda").manual_seed(3)
    plan = cm.compile(source).plan(lq, lk, num_heads=hq)
    pt = plan.to_tensors("cuda")
    score = pt.score
    tensors = {n: (torch.randn(f(hq), generator=g, device="cuda")).requires_grad_() for n, f in shapes.items()}
    q = torch.randn((1, hq, lq, d), generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    k = torch.randn((1, hk, lk, d), generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    v = torch.randn((1, hk, lk, d), generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    out, lse = cm.attention(q, k, v, plan, enable_gqa=True, return_lse=True, score_tensors=tensors)
    table = tensors.get(score.table) if score.table else None
    dist = None
    if table is not None:
        dist = table[..., score.bucket]
        dist = dist if dist.dim() == 2 else dist.unsqueeze(0)
    sinks = tensors.get(score.sink) if score.sink else None
    mask = plan.to_dense(format="torch").cuda()
    scale = 1.0 / math.sqrt(d)
    ref_out, ref_lse = _reference(q, k, v, mask, scale, score.softcap, score.linear, score.slopes,
                                  dist, sinks)
    err = (out.double() - ref_out).abs().max().item() / max(1.0, ref_out.abs().max().item())
    assert err <= TOL[torch.bfloat16][0], err
    finite = torch.isfinite(ref_lse)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 2e-2
    w = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.float64)
    params = [q, k, v] + list(tensors.values())
    grads = torch.autograd.grad((out.double() * w).sum(), params)
    # The CPU reference (Rust, float32) through the same entry, and its gradients.
    cpu = {n: t.detach().cpu().requires_grad_() for n, t in tensors.items()}
    qc, kc, vc = (t.detach().float().cpu().requires_grad_() for t in (q, k, v))
    out_cpu = cm.attention(qc, kc, vc, plan, enable_gqa=True, score_tensors=cpu)
    assert (out_cpu.double() - ref_out.cpu()).abs().max().item() <= 1e-4 * max(1.0, ref_out.abs().max().item())
    grads_cpu = torch.autograd.grad((out_cpu.double() * w.cpu()).sum(), [qc, kc, vc] + list(cpu.values()))
    # q, k, v against the CPU reference; the score tensors' gradients (sums of dS over many
    # pairs) against the float64 dS with the kernel's own delta, as in the test above.
    refs = list(grads_cpu[:3])
    if tensors:
        delta = (w * out.detach().double()).sum(-1)
        p, dp = _probs_and_dp(q, k, v, mask, scale, score.softcap, score.linear, score.slopes, dist,
                              sinks, w)
        ds = p * (dp - delta.unsqueeze(-1))
        for name in tensors:
            if name == score.table:
                t = tensors[name]
                dt = _table_grad(ds, score.bucket, t.shape[-1])
                refs.append(dt if t.dim() == 2 else dt.sum(0))
            else:
                refs.append(_sink_grad(sinks, ref_lse, delta))
    for i, (gg, rf) in enumerate(zip(grads, refs)):
        rf = rf.double().to(gg.device)
        e = (gg.double() - rf).abs().max().item() / max(1.0, rf.abs().max().item())
        assert e <= TOL[torch.bfloat16][1], (i, e)
    # The CPU path's score-tensor gradients against float64 autograd of the dense reference.
    if tensors:
        ref64 = _reference(qc.double(), kc.double(), vc.double(), mask.cpu(), scale, score.softcap,
                           score.linear, None if score.slopes is None else score.slopes.cpu(),
                           None if dist is None else _dist_of(cpu, score), cpu.get(score.sink))[0]
        g64 = torch.autograd.grad((ref64 * w.cpu()).sum(), list(cpu.values()))
        for gc, rf in zip(grads_cpu[3:], g64):
            assert (gc.double() - rf).abs().max().item() <= 1e-3 * max(1.0, rf.abs().max().item())


def _dist_of(tensors, score):
    t = tensors[score.table]
    dist = t[..., score.bucket.cpu()]
    return dist if dist.dim() == 2 else dist.unsqueeze(0)


T5_SINKS = ("tensor rel_bias: [num_heads, 32];\ntensor sinks: [num_heads];\nmask = k <= q;\n"
            "score = softcap(score, 20) + rel_bias[h][t5_bucket(k - q, 32, 128, false)];\n"
            "sink = sinks[h];")


def _scored_inputs(seed, hq=4, hk=2, n=200, d=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((1, hq, n, d), generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn((1, hk, n, d), generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn((1, hk, n, d), generator=g, device="cuda").to(torch.bfloat16)
    table = torch.randn((hq, 32), generator=g, device="cuda")
    sinks = torch.randn((hq,), generator=g, device="cuda")
    return q, k, v, table, sinks


ALIBI_SOFTCAP_SINKS = ("tensor sinks: [num_heads];\nmask = k <= q;\n"
                       "score = softcap(score, 20) - alibi_slopes(num_heads)[h] * (q - k);\n"
                       "sink = sinks[h];")


def test_score_terms_under_torch_compile():
    plan = cm.compile(ALIBI_SOFTCAP_SINKS).plan(200, num_heads=4)
    pt = plan.to_tensors("cuda")
    q, k, v, _, sinks = (t.requires_grad_() for t in _scored_inputs(5))

    def f(q, k, v, sinks, pt):
        return cm.attention(q, k, v, pt, enable_gqa=True, score_tensors={"sinks": sinks})

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v, sinks, pt)
    eager = f(q, k, v, sinks, pt)
    assert (out.float() - eager.float()).abs().max().item() <= 1e-2
    g1 = torch.autograd.grad(out.float().square().sum(), (q, k, v, sinks))
    g2 = torch.autograd.grad(eager.float().square().sum(), (q, k, v, sinks))
    for a, b in zip(g1, g2):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_learnable_table_under_torch_compile(fullgraph):
    """The table's gradient (and every other) equals eager's in a compiled step: it came out
    as zeros while the gather was an autograd function, whose traced backward lost it."""
    plan = cm.compile(T5_SINKS).plan(200, num_heads=4)
    pt = plan.to_tensors("cuda")
    q, k, v, table, sinks = (t.requires_grad_() for t in _scored_inputs(5))

    def f(q, k, v, table, sinks, pt):
        return cm.attention(q, k, v, pt, enable_gqa=True,
                            score_tensors={"rel_bias": table, "sinks": sinks})

    grads = []
    for fn in (f, torch.compile(f, fullgraph=fullgraph)):
        out = fn(q, k, v, table, sinks, pt)
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v, table, sinks)))
    for a, b in zip(*grads):
        assert b.abs().max().item() > 0
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * max(1.0, b.abs().max().item())


def test_score_terms_in_a_cuda_graph():
    plan = cm.compile(T5_SINKS).plan(200, num_heads=4)
    pt = plan.to_tensors("cuda")
    static = [t.clone().requires_grad_() for t in _scored_inputs(6)]
    grad_out = torch.randn(1, 4, 200, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        q, k, v, table, sinks = static
        out = cm.attention(q, k, v, pt, enable_gqa=True,
                           score_tensors={"rel_bias": table, "sinks": sinks})
        return (out, *torch.autograd.grad(out, static, grad_out))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new = [t.requires_grad_() for t in _scored_inputs(7)]
    with torch.no_grad():
        for s, t in zip(static, new):
            s.copy_(t)
    graph.replay()
    out = cm.attention(*new[:3], pt, enable_gqa=True,
                       score_tensors={"rel_bias": new[3], "sinks": new[4]})
    eager = (out, *torch.autograd.grad(out, new, grad_out))
    for a, b in zip(captured, eager):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2 * max(1.0, b.abs().max().item())


def test_score_tensors_are_checked():
    plan = cm.compile(T5_SINKS).plan(64, num_heads=2)
    q = torch.zeros((1, 2, 64, 64), device="cuda", dtype=torch.bfloat16)
    good = {"rel_bias": torch.zeros((2, 32), device="cuda"), "sinks": torch.zeros(2, device="cuda")}
    for bad, message in [
        ({"sinks": good["sinks"]}, r"missing 'rel_bias'.*\[2, 32\]"),
        ({**good, "extra": good["sinks"]}, r"score_tensors\['extra'\]: the program declares no such"),
        ({**good, "sinks": torch.zeros(3, device="cuda")}, r"score_tensors\['sinks'\]: shape \(3,\), expected \(2,\)"),
        ({**good, "sinks": torch.zeros(2, dtype=torch.int32, device="cuda")}, r"dtype torch.int32"),
        ({**good, "sinks": torch.zeros(2)}, r"is on cpu but the attention runs on cuda"),
    ]:
        with pytest.raises(ValueError, match=message):
            cm.attention(q, q, q, plan, score_tensors=bad)
    with pytest.raises(ValueError, match="has no score or sink statement"):
        cm.attention(q, q, q, cm.builtin("causal").plan(64), score_tensors=good)
    with pytest.raises(TypeError, match="score_tensors must map each tensor name .* got Tensor"):
        cm.attention(q, q, q, plan, score_tensors=good["sinks"])


def test_deterministic_backward_repeats_its_bits_with_score_terms():
    """The deterministic mode's gradients, the table's included (int64 fixed point), are the
    same bits run after run."""
    plan = cm.compile(T5_SINKS).plan(333, num_heads=4)
    q, k, v, table, sinks = (t.requires_grad_() for t in _scored_inputs(8, n=333))
    grad_out = torch.randn(1, 4, 333, 64, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        out = cm.attention(q, k, v, plan, enable_gqa=True, deterministic=True,
                           score_tensors={"rel_bias": table, "sinks": sinks})
        runs.append(torch.autograd.grad(out, (q, k, v, table, sinks), grad_out))
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert torch.equal(a, b)


def test_score_terms_need_the_plan_for_the_heads():
    plan = cm.builtin("causal_alibi").plan(64)  # one head
    q = torch.zeros((1, 4, 64, 64), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bound for num_heads = 1.*num_heads=4"):
        cm.attention(q, q, q, plan)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_terms_the_same_for_every_head_apply_to_any_head_count(device):
    """A softcap, a slope that does not read `h` and a table shared by the heads, planned
    for one head, give on 4 heads what the plan for 4 heads gives (outputs and every
    gradient), on the kernels and on the CPU reference, and in the plan's score_mod."""
    src = ("tensor rel: [9];\nmask = k <= q;\n"
           "score = softcap(score, 3.0) - 0.25 * (q - k) + rel[min(max(q - k, -4), 4) + 4];")
    program = cm.compile(src)
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    g = torch.Generator(device="cpu").manual_seed(3)
    q, k, v = (torch.randn(1, 4, 70, 64, generator=g).to(device, dtype).requires_grad_()
               for _ in range(3))
    table = torch.randn(9, generator=g).to(device).requires_grad_()
    results = []
    for heads in (1, 4):
        plan = program.plan(70, num_heads=heads)
        out = cm.attention(q, k, v, plan, score_tensors={"rel": table}, deterministic=True)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, table))
        results.append((out, *grads))
    # The deterministic mode repeats q, k and v's gradient bits; the table's gradient is
    # summed with fp32 atomics on CUDA, whose last bits vary run to run (docs/python.md).
    *exact_1, table_1 = results[0]
    *exact_4, table_4 = results[1]
    for a, b in zip(exact_1, exact_4):
        assert torch.equal(a, b)
    torch.testing.assert_close(table_1, table_4, rtol=1e-5, atol=1e-4)
    one = program.plan(70).score_mod({"rel": table}, device)
    four = program.plan(70, num_heads=4).score_mod({"rel": table}, device)
    s, i, j = (torch.tensor(x, device=device) for x in (1.5, 9, 2))
    for h in range(4):
        h = torch.tensor(h, device=device)
        assert torch.equal(one(s, 0, h, i, j), four(s, 0, h, i, j))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("score", ["", "score = softcap(score, 20);\n"])
def test_a_minus_inf_sink_is_no_sink(deterministic, d, score):
    """A head whose sink is -inf has no sink: its output, lse and q / k / v gradients are
    those of the same mask without sinks (rows with no visible key keep output 0 and lse
    -inf, never NaN), and its sink's gradient is 0; the other heads' finite sinks still
    count. On CUDA (plain and score kernels) and on the CPU reference."""
    hq, hk, lq, lk = 4, 2, 131, 129
    mask = "mask = q >= 3 & k <= q;\n"
    with_sinks = cm.compile("tensor sinks: [num_heads];\n" + mask + score + "sink = sinks[h];")
    without = cm.compile(mask + score)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn((1, h, n, d), generator=g, device="cuda").to(torch.bfloat16)
               for h, n in ((hq, lq), (hk, lk), (hk, lk)))
    sinks = torch.tensor([-math.inf, 0.5, -math.inf, 1.0], device="cuda")
    w = torch.randn((1, hq, lq, d), generator=g, device="cuda", dtype=torch.float64)
    wl = torch.randn((1, hq, lq), generator=g, device="cuda", dtype=torch.float64)
    for dev in ("cuda", "cpu"):
        cast = (lambda t: t) if dev == "cuda" else (lambda t: t.float().cpu())
        ins = [cast(t).requires_grad_() for t in (q, k, v)]
        s = cast(sinks).requires_grad_()
        out, lse = cm.attention(*ins, with_sinks.plan(lq, lk, num_heads=hq), enable_gqa=True,
                                return_lse=True, deterministic=deterministic,
                                score_tensors={"sinks": s})
        ins0 = [cast(t).requires_grad_() for t in (q, k, v)]
        out0, lse0 = cm.attention(*ins0, without.plan(lq, lk), enable_gqa=True, return_lse=True,
                                  deterministic=deterministic)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        heads = [0, 2]
        # The sink kernels form lse as (max + log2(sum)) ln 2, the plain ones max ln 2 + ln(sum).
        assert torch.equal(out[:, heads], out0[:, heads]), dev
        assert torch.allclose(lse[:, heads], lse0[:, heads], rtol=1e-6, atol=1e-5), dev
        assert (lse[:, heads, :3] == -math.inf).all() and (lse[:, 1, :3] == 0.5).all()
        wd, wld = w.to(out.device), wl.to(out.device)
        loss = (out.double() * wd).sum() + (lse.double().nan_to_num(neginf=0) * wld).sum()
        loss0 = (out0.double() * wd).sum() + (lse0.double().nan_to_num(neginf=0) * wld).sum()
        grads = torch.autograd.grad(loss, ins + [s])
        grads0 = torch.autograd.grad(loss0, ins0)
        assert all(torch.isfinite(t).all() for t in grads), dev
        assert grads[3][heads].abs().max().item() == 0.0, dev
        assert grads[3][[1, 3]].abs().min().item() > 0.0, dev
        # dq of the no-sink heads is the same computation; dk / dv sum the heads of a kv
        # head, where the sink heads differ, so compare dq only.
        tol = 0.0 if dev == "cpu" else 1e-2
        e = (grads[0][:, heads].double() - grads0[0][:, heads].double()).abs().max().item()
        assert e <= tol * max(1.0, grads0[0].abs().max().item()), (dev, e)
