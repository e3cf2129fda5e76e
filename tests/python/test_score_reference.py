"""The CPU reference with score terms from Python: the plan's terms as a dict, the native
entries on plain lists against a dense computation written here (no torch needed), and with
torch the forward and every gradient (q, k, v, bias table, sinks) against torch's autograd
of a dense float64 computation."""

from __future__ import annotations

import math
import struct

import pytest

import compilemask as cm
from compilemask import _native
from compilemask._score_reference import score_terms

ALL = """tensor rel: [num_heads, 32];
tensor sinks: [num_heads];
mask = k <= q + kv_len - q_len - 1;
score = softcap(score, 4.0) + rel[h][t5_bucket(k - q, 32, 128, false)]
        - alibi_slopes(num_heads)[h] * (q + kv_len - q_len - k);
sink = sinks[h];
"""


def test_score_terms_of_the_builtins():
    t = score_terms(cm.builtin("causal_alibi").plan(5, num_heads=4))
    assert t["softcap"] is None and t["table"] is None and t["sink"] is None
    assert t["linear"] == {"slopes": [-0.25, -0.0625, -0.015625, -0.00390625],
                           "q_coef": 1, "k_coef": -1, "offset": 0}
    t = score_terms(cm.builtin("t5_relative_bias").plan(3, num_heads=2))
    table = t["table"]
    assert (table["tensor"], table["num_buckets"], table["per_head"], table["shape"]) == \
        ("rel_bias", 32, True, [2, 32])
    # Distances q - k = -2 ..= 2: T5's bidirectional buckets of k - q = 2 ..= -2.
    assert list(struct.unpack("=5i", table["bucket"])) == [18, 17, 0, 1, 2]
    t = score_terms(cm.builtin("sliding_window_sinks").plan(3, num_heads=2))
    assert t["sink"] == {"tensor": "sinks", "shape": [2]}
    assert score_terms(cm.builtin("causal").plan(3)) is None


def dense(src_plan, q, k, v, rel, sinks, scale, heads, lq, lk, d):
    """out and lse in float64 from the program's formula, written out here."""
    slopes = [2 ** (-8 * (i + 1) / heads) for i in range(heads)]  # powers of two heads

    def bucket(rel_pos):  # HF's unidirectional T5 bucket, 32 buckets, max distance 128
        n = max(-rel_pos, 0)
        if n < 16:
            return n
        return min(31, 16 + int(math.log(n / 16) / math.log(128 / 16) * 16))

    out, lse = [], []
    for h in range(heads):
        for i in range(lq):
            logits = []
            for j in range(lk):
                if j > i + lk - lq - 1:
                    continue
                s = scale * sum(q[(h * lq + i) * d + t] * k[(h * lk + j) * d + t] for t in range(d))
                s = 4.0 * math.tanh(s / 4.0) + rel[h * 32 + bucket(j - i)]
                s -= slopes[h] * (i + lk - lq - j)
                logits.append((j, s))
            total = sum(math.exp(s) for _, s in logits) + math.exp(sinks[h])
            lse.append(math.log(total))
            out.append(sum(math.exp(s) / total * v[h * lk + j] for j, s in logits))
    return out, lse


def test_native_forward_on_lists_matches_a_dense_computation():
    heads, lq, lk, d = 2, 4, 6, 2
    plan = cm.compile(ALL).plan(lq, lk, num_heads=heads)
    q = [math.sin(i * 0.7) for i in range(heads * lq * d)]
    k = [math.cos(i * 0.3) for i in range(heads * lk * d)]
    v = [math.sin(i * 1.1) for i in range(heads * lk)]
    rel = [math.sin(i * 0.05) for i in range(heads * 32)]
    sinks = [0.5, -1.0]
    raw_out, raw_lse = _native.reference_forward_scored(
        (1, heads, heads, lq, lk, d, 1), q, k, v, plan._native, 0.8, True,
        {"rel": rel, "sinks": sinks})
    out = struct.unpack(f"={heads * lq}d", raw_out)
    lse = struct.unpack(f"={heads * lq}d", raw_lse)
    want_out, want_lse = dense(plan, q, k, v, rel, sinks, 0.8, heads, lq, lk, d)
    assert out == pytest.approx(want_out, abs=1e-12)
    assert lse == pytest.approx(want_lse, abs=1e-12)
    with pytest.raises(ValueError, match="the score terms read tensor `sinks`"):
        _native.reference_forward_scored((1, heads, heads, lq, lk, d, 1), q, k, v,
                                         plan._native, 0.8, True, {"rel": rel})
    with pytest.raises(ValueError, match="score tensor `nope` is not one the plan's score reads"):
        _native.reference_forward_scored((1, heads, heads, lq, lk, d, 1), q, k, v,
                                         plan._native, 0.8, True,
                                         {"rel": rel, "sinks": sinks, "nope": [0.0]})


def test_torch_forward_and_gradients_match_autograd_of_a_dense_computation():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from compilemask._score_reference import reference_attention, reference_attention_backward
    b, heads, kv_heads, lq, lk, d = 2, 4, 2, 5, 7, 3
    plan = cm.compile(ALL).plan(lq, lk, num_heads=heads)
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64)
               for s in ((b, heads, lq, d), (b, kv_heads, lk, d), (b, kv_heads, lk, d)))
    rel = torch.randn(heads, 32, generator=g, dtype=torch.float64)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    dout = torch.randn(b, heads, lq, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(b, heads, lq, generator=g, dtype=torch.float64)
    tensors = {"rel": rel, "sinks": sinks}
    out, lse = reference_attention(q, k, v, plan, tensors, scale=0.6)
    # The loss reads out and lse (every row has a finite lse: the sinks).
    dq, dk, dv, grads = reference_attention_backward(q, k, v, dout, plan, tensors, scale=0.6,
                                                     grad_lse=dlse)

    terms = score_terms(plan)
    bucket = torch.tensor(struct.unpack(f"={lq + lk - 1}i", terms["table"]["bucket"]))
    slopes = torch.tensor(terms["linear"]["slopes"], dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, rel, sinks)]
    lq_, lk_, lv_, lrel, lsink = leaves
    kk = lk_.repeat_interleave(heads // kv_heads, 1)
    vv = lv_.repeat_interleave(heads // kv_heads, 1)
    s = 4.0 * torch.tanh(0.6 * lq_ @ kk.transpose(-1, -2) / 4.0)
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    dist = i - j + lk - 1
    s = s + lrel[:, bucket[dist]][None] + slopes[None, :, None, None] * (i + lk - lq - j)
    mask = j <= i + lk - lq - 1
    s = s.masked_fill(~mask, -math.inf)
    full = torch.cat([s, lsink[None, :, None, None].expand(b, heads, lq, 1)], -1)
    want_lse = torch.logsumexp(full, -1)
    p = torch.exp(s - want_lse[..., None])
    want = p @ vv
    ((want * dout).sum() + (want_lse * dlse).sum()).backward()
    assert torch.allclose(out, want.detach(), atol=1e-12)
    assert torch.allclose(lse, want_lse.detach(), atol=1e-12)
    for got, leaf in zip((dq, dk, dv, grads["rel"], grads["sinks"]), leaves):
        assert torch.allclose(got, leaf.grad, atol=1e-10)
