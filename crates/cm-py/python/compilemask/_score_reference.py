"""The CPU reference with score terms: softcap, linear bias (ALiBi), bias table (T5) and
sinks (docs/language.md, "Scores"), forward and backward on CPU tensors, with the gradients
of the score tensors. No autograd here: these are the entries an autograd function calls.

``score_tensors`` maps the names the program declares (``tensor rel_bias: [num_heads, 32];``,
``tensor sinks: [num_heads];``) to tensors of those shapes. ``lse`` is
``ln(sum exp(s2) + exp(sink[h]))``; a row with no visible key has output 0 and lse ``-inf``,
or ``sink[h]`` with sinks.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from . import _native


def score_terms(plan: Any) -> dict[str, Any] | None:
    """The plan's score terms at its lengths and heads (``None`` without a ``score`` or
    ``sink`` statement): ``softcap``, ``linear`` (``slopes``, ``q_coef``, ``k_coef``,
    ``offset``), ``table`` (``tensor``, ``num_buckets``, ``per_head``, ``shape``, and
    ``bucket``: the bucket of distance ``q - k`` at index ``q - k + kv_len - 1``, as
    native-endian int32 bytes), ``sink`` (``tensor``, ``shape``)."""
    return _native.score_terms(plan._native)


def _prepare(query: Any, key: Any, value: Any, score_tensors: Mapping[str, Any] | None,
             scale: float | None) -> tuple:
    import torch

    from ._ops import _compute_dtype, _dims, _host
    cd = _compute_dtype(query.dtype)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    tensors = {name: _host(t, cd) for name, t in (score_tensors or {}).items()}
    host = [_host(t, cd) for t in (query, key, value)]
    return cd, _dims(query, key, value), host, tensors, scale, cd is torch.float64


def reference_attention(query: Any, key: Any, value: Any, plan: Any,
                        score_tensors: Mapping[str, Any] | None = None,
                        scale: float | None = None) -> tuple[Any, Any]:
    """``(out, lse)`` of attention with ``plan``'s masks and score terms: ``query``
    ``[B, H, Lq, D]``, ``key`` ``[B, Hkv, Lk, D]``, ``value`` ``[B, Hkv, Lk, Dv]``;
    ``scale`` defaults to ``1 / sqrt(D)``."""
    from ._ops import _from_bytes, _lse_dtype
    cd, dims, (q, k, v), tensors, scale, double = _prepare(query, key, value, score_tensors,
                                                           scale)
    out, lse = _native.reference_forward_scored(dims, q, k, v, plan._native, scale, double,
                                                tensors)
    b, hq, _, lq, _, _, dv = dims
    return (_from_bytes(out, cd, (b, hq, lq, dv)).to(query.dtype),
            _from_bytes(lse, cd, (b, hq, lq)).to(_lse_dtype(query.dtype)))


def reference_attention_backward(query: Any, key: Any, value: Any, grad_out: Any, plan: Any,
                                 score_tensors: Mapping[str, Any] | None = None,
                                 scale: float | None = None,
                                 grad_lse: Any | None = None) -> tuple[Any, Any, Any, dict]:
    """Gradients of ``sum(out * grad_out) + sum(lse * grad_lse)`` (``grad_lse``
    ``[B, H, Lq]`` or ``None``) for :func:`reference_attention`: ``(dq, dk, dv, grads)``
    with ``grads`` the score tensors' gradients by name (the bias table's and the sinks';
    slopes and softcaps are constants). Rows whose lse is ``-inf`` ignore ``grad_lse``."""
    from ._ops import _from_bytes, _host
    cd, dims, (q, k, v), tensors, scale, double = _prepare(query, key, value, score_tensors,
                                                           scale)
    dlse = None if grad_lse is None else _host(grad_lse, cd)
    dq, dk, dv, dtable, dsink = _native.reference_backward_scored(
        dims, q, k, v, _host(grad_out, cd), dlse, plan._native, scale, double, tensors)
    terms = score_terms(plan) or {}
    grads = {}
    for raw, part in ((dtable, terms.get("table")), (dsink, terms.get("sink"))):
        if raw is not None and part is not None:
            shape = tuple(part["shape"])
            grads[part["tensor"]] = _from_bytes(raw, cd, shape).to(
                score_tensors[part["tensor"]].dtype)
    return (_from_bytes(dq, cd, tuple(query.shape)).to(query.dtype),
            _from_bytes(dk, cd, tuple(key.shape)).to(key.dtype),
            _from_bytes(dv, cd, tuple(value.shape)).to(value.dtype), grads)
