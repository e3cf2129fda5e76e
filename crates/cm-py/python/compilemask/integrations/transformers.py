"""A Hugging Face transformers attention backend: ``attn_implementation="compilemask"``.

Importing this module registers the backend under the name ``"compilemask"`` with
transformers' ``AttentionInterface`` and its mask function with ``AttentionMaskInterface``
(transformers >= 4.53)::

    import compilemask.integrations.transformers  # registers "compilemask"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="compilemask")

Every attention call then runs :func:`compilemask.attention` with a compiled plan:

- by default the model's own mask: causal (aligned at the bottom right, so a decoding step
  with a KV cache sees every cached key), or a causal sliding window of the layer's
  ``sliding_window`` (keys ``(p - window, p]`` for the query at key position ``p``, as
  transformers' masks), or every key for a layer that is not causal;
- packed documents: ``position_ids`` that restart at 0 within a batch of one row
  (``DataCollatorWithFlattening``), or FlashAttention's ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` keyword arguments, give a packed plan in which no token sees another
  document;
- padded batches (a 2-D ``attention_mask`` whose ones are one run per row, left or right
  padding): each row's keys are limited to its run (the outputs of query rows that are
  themselves padding are unspecified; transformers ignores them);
- KV caches: the dynamic cache, and a static one (``StaticCache``,
  ``cache_implementation="static"``), whose slots past the step's last position are no
  row's keys (:func:`mask_function` marks them);
- or any program: :func:`register` another name with ``program=`` (and its ``params``),
  planned at each call's lengths (per document when packed; ``h`` is the query head).

Plans are cached per shape. On CUDA tensors the CompileMask kernels run (Hopper; bfloat16 /
float16, head_dim 64, 128, 256 and MLA's 192 / 128, forward and backward, see
``compilemask._ops.CUDA_FORWARD_HEAD_DIMS`` and ``CUDA_BACKWARD_HEAD_DIMS``); on CPU the CPU reference (float32 / float64). With
the model's own masks, logit soft-capping (``softcap``, Gemma 2) and learnable attention
sinks (``s_aux``, gpt-oss) are applied as the program's score terms (``score =
softcap(score, c);``, ``sink = sinks[h];``; the cap is held in float32), with gradients for
the sinks; a registered program says its own score terms (the model's softcap must match the
program's, and its sinks go to the tensor the program's ``sink`` reads). Attention dropout
raises ``NotImplementedError``;
``output_attentions`` returns no weights (``None``), as SDPA.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from .._program import CompileMaskWarning, Plan, Program, compile
from .._torch import attention, require_torch

__all__ = ["NAME", "attention_forward", "mask_function", "register"]

#: The name the default backend is registered under.
NAME = "compilemask"

# The model's own masks. `qk` is the query's position among the keys: with a KV cache the
# q_len new rows are the last of kv_len positions (bottom-right alignment).
_CAUSAL = """
param window: int = 0;
let qk = q + kv_len - q_len;
mask = k <= qk & (window == 0 | k > qk - window);
"""
# The same, with row b's keys limited to [start[b], end[b]) (a padded batch), the q_len new
# rows the last of the `filled` key slots: kv_len, or in a static cache (slots for
# max_cache_len keys, filled from slot 0) the slots written so far.
_CAUSAL_PADDED = """
param window: int = 0;
param start: [int] = [0];
param end: [int] = [kv_len];
param filled: int = kv_len;
let qk = q + filled - q_len;
mask = k <= qk & (window == 0 | k > qk - window) & k >= start[b] & k < end[b];
"""
_FULL = "mask = k < kv_len;\n"
_FULL_PADDED = """
param start: [int] = [0];
param end: [int] = [kv_len];
mask = k >= start[b] & k < end[b];
"""

# The score statements a model's attention call asks for, appended to the mask's source: the
# softcap's value as a literal (parameters are integers), the sinks as a per-head tensor.
_SINKS = "tensor sinks: [num_heads];\nsink = sinks[h];\n"


# float32's normal range: the kernels and the CPU reference hold the cap as a float32.
_F32_TINY, _F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def _checked_softcap(softcap: Any) -> float:
    """The model's ``softcap`` as a float: a real number (Python, NumPy or a one-element
    tensor, not a bool) above 0 within float32's normal range."""
    value = None
    if not isinstance(softcap, (bool, str, bytes)):
        try:
            value = float(softcap)
        except (TypeError, ValueError, RuntimeError):
            # RuntimeError: a tensor of more than one element.
            value = None
    if value is None or not (math.isfinite(value) and _F32_TINY <= value <= _F32_MAX):
        raise ValueError(
            f"softcap = {softcap!r}: expected a real number above 0 within float32's normal "
            f"range ({_F32_TINY:.4g} .. {_F32_MAX:.4g}); the cap is applied in float32"
        )
    return value


def _score_source(softcap: float | None, sinks: bool) -> str:
    source = "" if softcap is None else f"score = softcap(score, {softcap!r});\n"
    return source + (_SINKS if sinks else "")


_PROGRAMS: dict[str, Program] = {}


def _program(source: str) -> Program:
    if source not in _PROGRAMS:
        _PROGRAMS[source] = compile(source, name="<compilemask.integrations.transformers>")
    return _PROGRAMS[source]


class _Backend:
    """One registered name: a program (None: the model's own masks) and its parameters."""

    def __init__(self, program: Program | None, params: Any, block_size: int | tuple[int, int],
                 cache_size: int):
        self.program = program
        self.params = params
        self.block_size = block_size
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple, Any] = OrderedDict()

    def tensors(self, key: tuple, device: Any, make: Callable[[int], Plan],
                heads: int, num_heads: int) -> tuple[Any, Any]:
        """The plan for `key` as :func:`compilemask.attention` takes it on `device` (its
        tensors; on CPU with score terms the Plan itself, which the CPU reference reads) and
        its score terms (``ScoreTensors`` or None), planned by `make(heads)` on a miss (LRU).
        Score terms are bound per query head, so a plan of one head that has them is planned
        again for `num_heads`."""
        key = (*key, str(device))
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        with warnings.catch_warnings():
            # Empty rows (padding, a window at the start) are expected here, not mistakes.
            warnings.simplefilter("ignore", CompileMaskWarning)
            plan = make(heads)
            pt = plan.to_tensors(device)
            if pt.score is not None and heads != num_heads:
                plan = make(num_heads)
                pt = plan.to_tensors(device)
        hit = (plan if pt.score is not None and device.type == "cpu" else pt, pt.score)
        self.cache[key] = hit
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return hit

    def user_params(self, q_len: int, kv_len: int) -> Mapping[str, Any]:
        if callable(self.params):
            return self.params(q_len, kv_len)
        return self.params or {}


_BACKENDS: dict[str, _Backend] = {}


def _cu_seqlens(torch: Any, kwargs: Mapping[str, Any], batch: int, q_len: int, kv_len: int):
    """(cu_seqlens_q, cu_seqlens_k) of packed documents, or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        cu_q = [int(x) for x in cu_q.tolist()]
        cu_k = cu_q if cu_k is None else [int(x) for x in cu_k.tolist()]
        return cu_q, cu_k
    pos = kwargs.get("position_ids")
    if pos is None or batch != 1 or q_len != kv_len or pos.shape[-1] != q_len:
        return None
    pos = pos.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1).tolist()
    if not starts or starts == [0]:
        return None
    if starts[0] != 0:
        raise ValueError(
            f"packed position_ids must start at 0 (each document counts from 0); got "
            f"{int(pos[0])} first"
        )
    cu = [*starts, q_len]
    return cu, cu


def _key_runs(torch: Any, mask: Any, kv_len: int) -> tuple[list[int], list[int]] | None:
    """Each row's run of valid keys [start, end) of a 2-D padding mask, or None when every
    key of every row is valid."""
    if mask.dim() != 2:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; the compilemask backend takes the "
            f"2-D padding mask [batch, kv_len] (a 4-D mask is a custom mask: pass a program "
            f"to compilemask.integrations.transformers.register instead)"
        )
    valid = mask[:, -kv_len:].bool()
    if bool(valid.all()):
        return None
    n = valid.sum(dim=1)
    idx = torch.arange(valid.shape[1], device=valid.device)
    first = torch.where(valid, idx, valid.shape[1]).min(dim=1).values
    first = torch.where(n > 0, first, torch.zeros_like(first))
    runs = (valid[:, 1:] & ~valid[:, :-1]).sum(dim=1) + valid[:, 0].long()
    if bool((runs > 1).any()):
        raise ValueError(
            "attention_mask has a row whose valid keys are not one run (left or right "
            "padding is supported, holes are not)"
        )
    return first.tolist(), (first + n).tolist()


def _registered_score_tensors(name: str, terms: Any, softcap: float | None,
                              sinks: Any) -> dict[str, Any] | None:
    """A registered program's score tensors for the model's terms: the program says its own
    score, so the model's softcap must be the program's (``score = softcap(score, c);``) and
    the model's sinks go to the tensor the program's ``sink`` statement reads."""
    have_cap = 0.0 if terms is None else terms.softcap
    if softcap is not None and not math.isclose(have_cap, softcap, rel_tol=1e-6):
        raise NotImplementedError(
            f"the model passes softcap = {softcap}, but the program of backend {name!r} "
            + (f"caps at {have_cap}" if have_cap else "has no softcap")
            + f": write `score = softcap(score, {softcap});` into the program"
        )
    sink = None if terms is None else terms.sink
    if sinks is None:
        if sink is not None:
            raise ValueError(
                f"the program of backend {name!r} reads the sink tensor `{sink}`, but the model "
                f"passes no sinks (s_aux)"
            )
        return None
    if sink is None:
        raise NotImplementedError(
            f"the model passes sinks (s_aux), but the program of backend {name!r} has no sink: "
            f"declare `tensor sinks: [num_heads];` and `sink = sinks[h];` in it"
        )
    return {sink: sinks}


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, *, _backend: str = NAME,
                      **kwargs: Any) -> tuple[Any, None]:
    """The attention function transformers calls: ``query`` ``[batch, num_heads, q_len,
    head_dim]``, ``key`` / ``value`` ``[batch, num_kv_heads, kv_len, head_dim]``; returns
    ``([batch, q_len, num_heads, head_dim], None)``, as transformers' SDPA backend."""
    torch = require_torch("compilemask.integrations.transformers")
    if dropout:
        raise NotImplementedError(
            f"the compilemask backend has no attention dropout (got {dropout}); set the "
            f"config's attention_dropout to 0"
        )
    backend = _BACKENDS[_backend]
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if softcap is not None:
        softcap = _checked_softcap(softcap)
    b, hq, q_len, _ = query.shape
    kv_len = key.shape[2]
    packed = _cu_seqlens(torch, kwargs, b, q_len, kv_len)
    runs = None if attention_mask is None else _key_runs(torch, attention_mask, kv_len)
    if packed is not None and runs is not None:
        raise ValueError("packed documents and a padding mask cannot be combined")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window") or 0
    if window and not causal:
        raise NotImplementedError("a sliding window on a layer that is not causal")

    if backend.program is not None:
        if runs is not None:
            raise ValueError(
                "a padded batch with a user program: pack the documents instead "
                "(position_ids or cu_seq_lens), or give full rows"
            )
        program = backend.program
        params = dict(backend.user_params(q_len, kv_len))
        heads = hq if program.uses_head or program.reads_num_heads else 1
        batch = b if (program.uses_batch or program.reads_batch) and packed is None else 1
    else:
        source = (_CAUSAL_PADDED if runs else _CAUSAL) if causal else (
            _FULL_PADDED if runs else _FULL)
        score = _score_source(softcap, sinks is not None)
        program = _program(source + score)
        params = {"window": int(window)} if causal else {}
        if runs is not None:
            params.update(start=runs[0], end=runs[1])
            if causal and attention_mask.dtype == torch.uint8:
                # A static cache's padding mask (mask_function's uint8 form): its slots past
                # the step's last key are no row's keys, so the last row sits at the last
                # written slot. Right padding instead keeps the rows where they are, even
                # when no row reaches kv_len (a batch padded to a multiple).
                params["filled"] = max(runs[1])
        # Score terms are bound per query head (the masks stay one, deduplicated).
        heads, batch = (hq if score else 1), (b if runs is not None else 1)

    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
    bs = backend.block_size
    if packed is not None:
        cu_q, cu_k = packed
        pt, terms = backend.tensors(
            ("packed", id(program), tuple(cu_q), tuple(cu_k), heads, frozen), query.device,
            lambda n: program.plan(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, num_heads=n,
                                   block_size=bs, **params), heads, hq)
    else:
        pt, terms = backend.tensors(
            ("dense", id(program), q_len, kv_len, batch, heads, frozen), query.device,
            lambda n: program.plan(q_len, kv_len, batch, n, block_size=bs, **params), heads, hq)
    score_tensors = None
    if backend.program is not None:
        score_tensors = _registered_score_tensors(_backend, terms, softcap, sinks)
    elif sinks is not None:
        score_tensors = {"sinks": sinks}
    out = attention(query, key, value, pt, scale=scaling, enable_gqa=hq != key.shape[1],
                    score_tensors=score_tensors)
    return out.transpose(1, 2).contiguous(), None


def mask_function(*args: Any, attention_mask: Any = None, kv_length: int | None = None,
                  cache_position: Any = None, q_length: int | None = None, q_offset: int = 0,
                  kv_offset: int = 0, batch_size: int | None = None, device: Any = None,
                  **kwargs: Any) -> Any:
    """The mask function transformers calls while building a model's masks: the 2-D padding
    mask (its last ``kv_length`` keys), or ``None`` when nothing is padded. The attention
    function builds the compiled mask itself, so no dense mask is ever made.

    A static cache (``StaticCache``, ``cache_implementation="static"``) holds slots for
    ``kv_length`` keys of which only those up to the step's last position (``q_offset +
    q_length``, or ``cache_position`` before transformers 5) are written: the slots past it
    are marked padding (zeros, as transformers pads a short mask), so no row sees them, and
    the mask comes back as ``uint8`` (a padding mask is ``bool``), so that the causal rows end
    at the last written slot. The slots hold consecutive positions from ``kv_offset`` (a
    sliding-window layer keeps only its last keys)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask
    end = None  # one past the step's last position
    if q_length is not None:
        end = int(q_offset) + int(q_length)
    elif cache_position is not None and cache_position.numel():
        end, device = int(cache_position[-1]) + 1, cache_position.device
    filled = None
    if kv_length is not None and end is not None and end - int(kv_offset) < kv_length:
        filled = end - int(kv_offset)
    if filled is not None:
        torch = require_torch("compilemask.integrations.transformers")
        if attention_mask is None:
            rows = batch_size if batch_size is not None else 1
            attention_mask = torch.ones(rows, filled, dtype=torch.bool, device=device)
        valid = attention_mask[:, :filled].bool()
        pad = torch.zeros(valid.shape[0], kv_length - valid.shape[1], dtype=torch.bool,
                          device=valid.device)
        # uint8, not bool: tells the attention function that the zeros past the last valid
        # key are unwritten slots (the rows end there), not right padding.
        return torch.cat([valid, pad], dim=1).to(torch.uint8)
    if attention_mask is None:
        return None
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    return None if bool(attention_mask.all()) else attention_mask


def register(name: str = NAME, program: Program | str | None = None, *,
             params: Mapping[str, Any] | Callable[[int, int], Mapping[str, Any]] | None = None,
             block_size: int | tuple[int, int] = 128, cache_size: int = 256) -> str:
    """Registers the backend as ``attn_implementation=name`` (and its mask function under
    the same name); returns ``name``.

    ``program``: ``None`` for the model's own masks (causal, sliding window, full; packed
    and padded batches handled), or a :class:`compilemask.Program` (or its source text)
    to use in every layer instead, planned at each call's ``q_len`` / ``kv_len`` (keys are
    positions ``0 .. kv_len``, so with a KV cache write the mask for the query at
    ``q + kv_len - q_len``) or per packed document. ``params`` are its parameters, or a
    function of ``(q_len, kv_len)`` returning them. ``block_size`` is the plans' tile;
    ``cache_size`` the number of plans kept.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            "compilemask.integrations.transformers needs transformers >= 4.53 "
            "(AttentionInterface and AttentionMaskInterface)"
        ) from e
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or name != name.strip() or "/" in name:
        raise ValueError(f"name = {name!r}: expected a non-empty name without surrounding "
                         f"spaces or '/' (transformers reads 'owner/repo' as a Hub kernel)")
    if name not in _BACKENDS and (name == "eager" or name in AttentionInterface._global_mapping
                                  or name in AttentionMaskInterface._global_mapping):
        raise ValueError(f"name = {name!r} is one of transformers' own attention "
                         f"implementations; registering it would replace that one for every "
                         f"model: choose another name")
    if isinstance(program, str):
        program = compile(program, name=f"<{name}>")
    if program is not None and not isinstance(program, Program):
        raise TypeError(f"program must be a compilemask.Program or source text, got "
                        f"{type(program).__name__}")
    if params is not None and not callable(params):
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be a mapping or a function of (q_len, kv_len), got "
                            f"{type(params).__name__}")
        if program is None:
            raise ValueError("params are given without a program: the model's own masks "
                             "take none")
        program._check_names(params)
    _BACKENDS[name] = _Backend(program, params, block_size, cache_size)

    def forward(*args: Any, **kwargs: Any) -> tuple[Any, None]:
        return attention_forward(*args, _backend=name, **kwargs)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask_function)
    return name


register()
