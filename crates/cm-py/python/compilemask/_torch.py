"""The torch side: plan tensors, FlexAttention block masks and the attention custom op.

torch is imported lazily, on the first call that needs it; ``import compilemask`` never
imports it.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _native
from ._program import Plan, PlanTensors, ScoreTensors, _flag, _type_name

if TYPE_CHECKING:
    import torch


def torch_or_none() -> Any:
    """The torch module if it can be imported, else None (imports it if needed)."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    try:
        import torch
    except ImportError:
        return None
    return torch


def require_torch(what: str) -> Any:
    """The torch module, or an ImportError that says who needed it."""
    torch = torch_or_none()
    if torch is None:
        raise ImportError(
            f"{what} needs PyTorch, which is not installed (pip install torch). "
            "compilemask.compile, builtin and Program.plan and the list exports work without it."
        )
    return torch


# --------------------------------------------------------------------------- plan tensors


def _host_int32(torch: Any, raw: bytes) -> torch.Tensor:
    """Native-endian int32 bytes as a 1-D CPU tensor of its own memory."""
    if not raw:
        return torch.zeros(0, dtype=torch.int32)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32)


def _int32(torch: Any, raw: bytes, shape: tuple[int, ...], device: Any) -> torch.Tensor:
    if len(raw) == 0:
        return torch.zeros(shape, dtype=torch.int32, device=device)
    t = _host_int32(torch, raw).reshape(shape)
    return t.to(device) if device is not None else t


def _queued_copy(torch: Any, host: torch.Tensor, dev: Any) -> torch.Tensor:
    """``host``, a CPU tensor that nothing else holds, on ``dev``. To CUDA by a non-blocking
    copy from pinned memory, queued on the current stream like a kernel (as vLLM and
    FlashInfer copy their step metadata): torch's blocking copy synchronises the stream, so
    the host would wait for every kernel queued before it (a serving loop's previous step).
    torch keeps the pinned buffer until the copy has read it. ``RuntimeError`` while the stream
    is being captured into a CUDA graph, whose replays would read that buffer after it is
    freed. Traced by torch.compile, a plain copy (fake tensors have no pinned memory)."""
    if dev.type != "cuda" or torch.compiler.is_compiling():
        return host.to(dev)
    _refuse_capture(torch)
    return host.pin_memory().to(dev, non_blocking=True)


def _queued_copy_into(torch: Any, host: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies ``host`` (a CPU tensor that nothing else holds, of ``dst``'s size) into ``dst``
    as :func:`_queued_copy` copies: on CUDA straight from pinned memory into ``dst``, queued
    on the current stream (one copy, no device tensor in between)."""
    if dst.device.type != "cuda" or torch.compiler.is_compiling():
        dst.copy_(host)
        return
    _refuse_capture(torch)
    dst.copy_(host.pin_memory(), non_blocking=True)


def _refuse_capture(torch: Any) -> None:
    """``RuntimeError`` while the current stream is being captured into a CUDA graph: a copy
    from the host captured there would read its pinned buffer at every replay, after it is
    freed."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "compilemask: a step's tensors are made on the host and copied to the GPU, which a "
            "CUDA graph cannot capture; make them before capturing "
            "(step.to_tensors(device, max_intervals=N)), pass those StepTensors and write each "
            "later step into them with step.write_tensors between replays")


def _cache_key(torch: Any, device: Any) -> str:
    """The device as tensors cached per device are keyed: ``"cuda"`` is the current CUDA
    device by its index, so both spellings find one copy."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def _pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1): padding capacities this way lets plans whose
    sizes differ a little share tensor shapes (and compiled graphs)."""
    return 1 << max(n - 1, 0).bit_length()


def _kernel_tensors(torch: Any, arrays: list, dev: Any, queued: bool = False) -> tuple:
    """The CUDA kernels' descriptor of a plan (``arrays``: its ``kernel_arrays()``, every
    distinct mask and the mask index) on ``dev``: ``(views, flat, caps)``, one int32
    ``[capacity]`` tensor per array, views of the one tensor ``flat`` that holds them back to
    back, filled on the host and copied to ``dev`` in one transfer (with ``queued``, by
    :func:`_queued_copy`), and the capacities."""
    lens = [len(raw) // 4 for raw in arrays]
    # At least 4: keeps every array's loads aligned (16-byte rows of the
    # `*partial_row_mask` arrays and tiles of `bwd_partial_key_mask`), as every capacity, a
    # power of two of at least 4 elements, keeps the next array's start.
    caps = [_pow2(max(n, 4)) for n in lens]
    flat = torch.empty(sum(caps), dtype=torch.int32)
    parts, at = [], 0
    with warnings.catch_warnings():
        # The bytes are read-only; they are only read, into `flat`.
        warnings.simplefilter("ignore", UserWarning)
        for raw, n, cap in zip(arrays, lens, caps):
            if n:
                flat[at:at + n] = torch.frombuffer(raw, dtype=torch.int32)
            flat[at + n:at + cap] = 0
            parts.append((at, cap))
            at += cap
    flat = _queued_copy(torch, flat, dev) if queued else flat.to(dev)
    return tuple(flat[a:a + cap] for a, cap in parts), flat, tuple(caps)


def _launch_choices(arrays: list) -> tuple[tuple[int, ...], bool]:
    """What the launches of a plan whose ``kernel_arrays()`` are ``arrays`` choose from its
    lists: the forward's tile sets best first and whether the deterministic backward adds dQ
    in turns (both from the arrays' used lengths, before padding)."""
    lens = [len(raw) // 4 for raw in arrays]
    return tuple(_native.cuda_ws_order(lens)), _native.cuda_dq_turns(lens)


def _checked_scale(scale: Any, head_dim: int) -> float:
    """``scale`` as the float the kernels and the references take (``1 / sqrt(head_dim)``
    for ``None``): ``TypeError`` for a bool or a non-number, ``ValueError`` naming it when it
    is not finite or does not fit float32 (the kernels' softmax scale)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, str, bytes, bytearray)):
        raise TypeError(f"scale must be a number, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number, got {_type_name(scale)}") from None
    if not math.isfinite(value) or abs(value) > _F32_MAX:
        raise ValueError(f"scale = {scale!r} must be finite and fit float32 (magnitude at most "
                         f"{_F32_MAX:.4g})")
    return value


# The largest finite float32.
_F32_MAX = 3.4028234663852886e38


def plan_tensors(plan: Plan, device: Any = None) -> PlanTensors:
    torch = require_torch("Plan.to_tensors")
    key = ("tensors", _cache_key(torch, device))
    cached = plan._cache.get(key)
    if cached is not None:
        return cached
    dev = torch.device("cpu") if device is None else torch.device(device)
    row_raw, iv_raw = plan._native.interval_arrays()
    q_len = plan.q_len
    row_ptr = _int32(torch, row_raw, (plan.num_masks, q_len + 1), dev)
    used = len(iv_raw) // 8
    intervals = torch.zeros((_pow2(used), 2), dtype=torch.int32, device=dev)
    if used:
        intervals[:used] = _int32(torch, iv_raw, (used, 2), dev)
    mask_index = torch.tensor(plan.mask_index, dtype=torch.int32, device=dev).reshape(
        plan.batch, plan.num_heads
    )
    kernel, flat, lens, ws_order, dq_turns = (), None, (), (), True
    if dev.type == "cuda":
        arrays = plan._native.kernel_arrays()
        kernel, flat, lens = _kernel_tensors(torch, arrays, dev)
        ws_order, dq_turns = _launch_choices(arrays)
    out = PlanTensors(row_ptr, intervals, mask_index, q_len, plan.kv_len, plan.batch,
                      plan.num_heads, plan.uses_batch or plan.is_packed, plan.uses_head, kernel,
                      _score_tensors(torch, plan, dev), ws_order, dq_turns, flat, lens)
    plan._cache[key] = out
    return out


def _score_tensors(torch: Any, plan: Plan, dev: Any) -> ScoreTensors | None:
    terms = _native.score_terms(plan._native)
    if terms is None:
        return None
    lin = terms.get("linear")
    slopes = coefs = None
    if lin is not None:
        slopes = torch.tensor(lin["slopes"], dtype=torch.float32, device=dev)
        coefs = (float(lin["q_coef"]), float(lin["k_coef"]), float(lin["offset"]))
    table = terms.get("table")
    bucket = None
    if table is not None:
        n = plan.q_len + plan.kv_len - 1
        bucket = _int32(torch, table["bucket"], (n,), dev).long()
    sink = terms.get("sink")
    run_end = runs = None
    if bucket is not None:
        from . import _ops

        run_end, runs = _ops.distance_runs(bucket)
    return ScoreTensors(
        softcap=float(terms.get("softcap") or 0.0),
        linear=coefs or (0.0, 0.0, 0.0),
        slopes=slopes,
        table=None if table is None else table["tensor"],
        table_shape=None if table is None else tuple(table["shape"]),
        bucket=bucket,
        sink=None if sink is None else sink["tensor"],
        sink_shape=None if sink is None else tuple(sink["shape"]),
        run_end=run_end,
        runs=None if runs is None else tuple(runs),
        per_head=bool(terms["per_head"]),
    )


def _score_tensor_map(score_tensors: Any) -> dict:
    """``score_tensors`` as a dict (None: empty); ``TypeError`` naming its type for anything
    but a mapping, whether or not the plan reads score tensors (a tensor or a list is not
    taken for its truth value or its entries)."""
    if score_tensors is None:
        return {}
    if not isinstance(score_tensors, Mapping):
        raise TypeError(
            f"score_tensors must map each tensor name the program declares to its tensor "
            f"({{name: tensor}}), got {_type_name(score_tensors)}"
        )
    return dict(score_tensors)


def _no_score_tensors(score_tensors: Any) -> None:
    """For a plan without score terms: ``score_tensors`` must give nothing."""
    given = _score_tensor_map(score_tensors)
    if given:
        raise ValueError(
            f"score_tensors {sorted(given)} given, but the plan's program has no score or sink "
            "statement"
        )


def _check_score_heads(score: ScoreTensors, plan_heads: int, heads: int) -> None:
    """Per-head score terms need the plan bound for the query's ``heads``."""
    if score.per_head and plan_heads != heads:
        raise ValueError(
            f"the plan's score terms were bound for num_heads = {plan_heads} (slopes, tables "
            f"and sinks are per head), but the query has {heads} heads; plan with "
            f"program.plan(..., num_heads={heads})"
        )


def _score_inputs(torch: Any, score: ScoreTensors, score_tensors: Any, device: Any,
                  need_sink: bool = True) -> tuple:
    """The table and sink tensors ``score_tensors`` gives for the plan's score (each
    checked: present, of the declared shape, float, on ``device``), and nothing else; the
    sink may be left out when not ``need_sink``."""
    given = _score_tensor_map(score_tensors)
    wanted = {n: shape for n, shape in ((score.table, score.table_shape),
                                        (score.sink, score.sink_shape)) if n is not None}
    for name in given:
        if name not in wanted:
            raise ValueError(
                f"score_tensors[{name!r}]: the program declares no such score tensor "
                f"(it reads {sorted(wanted) or 'none'})"
            )
    out = []
    for name in (score.table, score.sink):
        if name is None:
            out.append(None)
            continue
        if name not in given and name == score.sink and not need_sink:
            out.append(None)
            continue
        if name not in given:
            raise ValueError(
                f"score_tensors is missing {name!r}: the program reads `tensor {name}: "
                f"{list(wanted[name])}`"
            )
        t = given[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"score_tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(wanted[name]):
            raise ValueError(
                f"score_tensors[{name!r}]: shape {tuple(t.shape)}, expected {tuple(wanted[name])} "
                "as the program declares it"
            )
        if not t.is_floating_point():
            raise ValueError(f"score_tensors[{name!r}]: dtype {t.dtype}, expected a float dtype")
        if t.device != device:
            raise ValueError(
                f"score_tensors[{name!r}] is on {t.device} but the attention runs on {device}"
            )
        out.append(t)
    return out[0], out[1]


def make_score_mod(plan: Plan, score_tensors: Any = None, device: Any = None) -> Any:
    torch = require_torch("Plan.score_mod")
    pt = plan_tensors(plan, device)
    score = pt.score
    if score is None:
        return lambda s, b, h, q_idx, kv_idx: s
    table, _ = _score_inputs(torch, score, score_tensors, pt.row_ptr.device, need_sink=False)
    cap = score.softcap
    qc, kc, off = score.linear
    slopes, bucket, kv_len = score.slopes, score.bucket, pt.kv_len
    # The slopes are f32 values (what the kernels take); float64 scores form the bias in
    # float64 from them, as the CPU reference does, not in float32.
    slopes64 = None if slopes is None else slopes.double()
    per_head = table is not None and table.dim() == 2

    def score_mod(s, b, h, q_idx, kv_idx):
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            slope = (slopes64 if s.dtype == torch.float64 else slopes)[h if score.per_head else 0]
            s = s + slope * (qc * q_idx + kc * kv_idx + off)
        if table is not None:
            i = bucket[q_idx - kv_idx + kv_len - 1]
            s = s + (table[h, i] if per_head else table[i])
        return s

    return score_mod


def _scored_attention(torch: Any, query: Any, key: Any, value: Any, plan: Any, pt: PlanTensors,
                      score_tensors: Any, scale: float, plan_dims: list, deterministic: bool) -> tuple:
    """(out, lse) with the plan's score terms: the score kernels on CUDA, the CPU reference
    (through an autograd function) on CPU."""
    score = pt.score
    slopes = score.slopes
    _check_score_heads(score, pt.num_heads, query.shape[1])
    if pt.num_heads != query.shape[1] and slopes is not None:
        # Every head has the same terms (a softcap, one slope, one table for all heads).
        slopes = slopes[:1].expand(query.shape[1]).contiguous()
    table, sink = _score_inputs(torch, score, score_tensors, query.device)
    if query.device.type == "cuda":
        from . import _ops

        dist = None
        if table is not None:
            dist = _ops.table_gather(table.float(), score.bucket, *score.runs)
            if dist.dim() == 1:
                dist = dist.unsqueeze(0)
        return _ops.attention_forward_score(
            query, key, value, pt.kernel_flat, list(pt.kernel_lens), plan_dims, scale,
            bool(deterministic),
            score.softcap, list(score.linear), slopes, dist,
            score.run_end if dist is not None else None,
            None if sink is None else sink.float())
    if not isinstance(plan, Plan):
        raise ValueError(
            "score terms on CPU tensors run the CPU reference, which needs the Plan itself "
            "(pass the Plan, not its PlanTensors)"
        )
    return _scored_reference(torch)(query, key, value, table, sink, plan, score, scale)


def _scored_reference(torch: Any) -> Any:
    """The CPU reference with score terms as an autograd function (built on first use)."""
    cached = getattr(_scored_reference, "fn", None)
    if cached is not None:
        return cached
    from ._score_reference import reference_attention, reference_attention_backward

    class ScoredReference(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, table, sink, plan, score, scale):
            tensors = {n: t for n, t in ((score.table, table), (score.sink, sink)) if n is not None}
            out, lse = reference_attention(q, k, v, plan, tensors, scale)
            ctx.save_for_backward(q, k, v, table, sink)
            ctx.plan, ctx.score, ctx.scale = plan, score, scale
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            if torch.is_grad_enabled():
                # create_graph: the gradients below come from numpy and would carry no graph,
                # so a second-order term would be dropped silently.
                from ._ops import _no_second_order

                _no_second_order(ctx)
            q, k, v, table, sink = ctx.saved_tensors
            score = ctx.score
            if dout is None:
                dout = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
            tensors = {n: t for n, t in ((score.table, table), (score.sink, sink)) if n is not None}
            dq, dk, dv, grads = reference_attention_backward(q, k, v, dout, ctx.plan, tensors,
                                                             ctx.scale, dlse)
            return (dq, dk, dv, grads.get(score.table) if table is not None else None,
                    grads.get(score.sink) if sink is not None else None, None, None, None)

    _scored_reference.fn = ScoredReference.apply
    return _scored_reference.fn


def _interval_table(plan: Plan, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded per-row tables ``starts``, ``ends`` of shape ``[num_masks, q_len, K]`` with
    ``K`` the most intervals of any row of ``interval_arrays()`` (at least 1; a strided run
    there is one interval per key); unused slots are the empty interval (0, 0)."""
    torch = require_torch("Plan.mask_mod")
    key = ("table", _cache_key(torch, device))
    cached = plan._cache.get(key)
    if cached is not None:
        return cached
    row_raw, iv_raw = plan._native.interval_arrays()
    m, q_len = plan.num_masks, plan.q_len
    row_ptr = _int32(torch, row_raw, (m, q_len + 1), None).long()
    used = len(iv_raw) // 8
    ivs = _int32(torch, iv_raw, (max(used, 1), 2), None) if used else torch.zeros(
        (1, 2), dtype=torch.int32)
    first, count = row_ptr[:, :-1], row_ptr[:, 1:] - row_ptr[:, :-1]
    width = max(1, int(count.max())) if count.numel() else 1
    slot = torch.arange(width).view(1, 1, width)
    valid = slot < count.unsqueeze(-1)
    index = (first.unsqueeze(-1) + slot).clamp(max=ivs.shape[0] - 1)
    zero = torch.zeros((), dtype=torch.int32)
    starts = torch.where(valid, ivs[index, 0], zero)
    ends = torch.where(valid, ivs[index, 1], zero)
    dev = torch.device("cpu") if device is None else torch.device(device)
    out = (starts.contiguous().to(dev), ends.contiguous().to(dev))
    plan._cache[key] = out
    return out


def make_mask_mod(plan: Plan, device: Any = None) -> Any:
    torch = require_torch("Plan.mask_mod")
    starts, ends = _interval_table(plan, device)
    width = starts.shape[-1]
    q_len, kv_len = plan.q_len, plan.kv_len
    dev = starts.device
    mask_index = torch.tensor(plan.mask_index, dtype=torch.int64, device=dev).view(
        plan.batch, plan.num_heads)
    # One-dimensional tables read at computed offsets: Inductor's CPU template for a compiled
    # flex_attention (torch 2.11) returned wrong values for a 2-D table row indexed by q_idx
    # and then sliced by column, and right ones for this form (tests/python/test_torch.py).
    starts_flat, ends_flat = starts.reshape(-1), ends.reshape(-1)

    # A dimension the plan has once and its mask does not read serves every index there, as
    # attention() broadcasts it (Flex calls with its own batch and heads). A dimension the
    # mask reads is indexed as given, so a Flex batch or head count the plan was not made
    # for fails (IndexError) instead of reading another (b, h)'s mask; a packed plan's
    # batch is its samples, one Flex batch.
    per_batch = plan.batch > 1 or plan.uses_batch or plan.is_packed
    per_head = plan.num_heads > 1 or plan.uses_head
    single = plan.num_masks == 1 and not (per_batch or per_head)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        # Rows outside 0 .. q_len (Flex's padded last block) read a row in range, and the
        # result is then masked: they see nothing.
        q = q_idx.clamp(0, q_len - 1)
        if single:
            row = q
        else:
            row = mask_index[b if per_batch else 0, h if per_head else 0] * q_len + q
        at = row * width
        visible = (kv_idx >= starts_flat[at]) & (kv_idx < ends_flat[at])
        for j in range(1, width):
            visible = visible | ((kv_idx >= starts_flat[at + j]) & (kv_idx < ends_flat[at + j]))
        return visible & (q_idx >= 0) & (q_idx < q_len) & (kv_idx >= 0) & (kv_idx < kv_len)

    mask_mod.__name__ = f"compilemask_{plan.program.name.strip('<>').replace(' ', '_')}"
    return mask_mod


def _flex_edge_tiles(torch: Any, kv_num: Any, kv_idx: Any, full_num: Any, full_idx: Any,
                     lengths: tuple[int, int], block: tuple[int, int]) -> tuple[Any, Any, Any, Any]:
    """Flex's tables for the same mask: ``create_block_mask`` pads the sequences to whole
    blocks with False, so a tile at a ragged edge is never full there (our descriptor counts
    only in-range pairs and may call it full). Those tiles move to the partial lists, which
    is exact either way (partial tiles apply ``mask_mod``), and every index row is rebuilt
    as Flex orders it: counted blocks ascending, then the others ascending."""
    num_masks, m, n = kv_idx.shape
    cols = torch.arange(n)
    cls = torch.zeros((num_masks, m, n), dtype=torch.int8)
    for num, idx, value in ((kv_num, kv_idx, 1), (full_num, full_idx, 2)):
        counted = cols.view(1, 1, n) < num.view(num_masks, m, 1).long()
        cls.scatter_add_(2, idx.long(), torch.where(counted, value, 0).to(torch.int8))
    ragged_rows = lengths[0] % block[0] != 0
    ragged_cols = lengths[1] % block[1] != 0
    if ragged_rows:
        cls[:, -1, :][cls[:, -1, :] == 2] = 1
    if ragged_cols:
        cls[:, :, -1][cls[:, :, -1] == 2] = 1

    def lists(value: int) -> tuple[Any, Any]:
        hit = cls == value
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)
        return hit.sum(-1).to(torch.int32), order.to(torch.int32)

    kv_num, kv_idx = lists(1)
    full_num, full_idx = lists(2)
    return kv_num, kv_idx, full_num, full_idx


def make_block_mask(plan: Plan, device: Any = None) -> Any:
    torch = require_torch("Plan.to_block_mask")
    from torch.nn.attention.flex_attention import BlockMask

    dev = torch.device("cpu") if device is None else torch.device(device)
    per_mask = [plan._native.flex_block_mask(b, h) for b, h in plan._firsts()]
    m, n = per_mask[0]["num_m_blocks"], per_mask[0]["num_n_blocks"]
    index = torch.tensor(plan.mask_index, dtype=torch.long)

    def stacked(key: str, shape: tuple[int, ...]) -> Any:
        return torch.stack([_int32(torch, pm[key], shape, None) for pm in per_mask])

    tables = _flex_edge_tiles(
        torch,
        stacked("kv_num_blocks", (m,)),
        stacked("kv_indices", (m, n)),
        stacked("full_kv_num_blocks", (m,)),
        stacked("full_kv_indices", (m, n)),
        (plan.q_len, plan.kv_len),
        plan.block_size,
    )

    def table(t: Any, shape: tuple[int, ...]) -> Any:
        return t[index].reshape(plan.batch, plan.num_heads, *shape).contiguous().to(dev)

    return BlockMask.from_kv_blocks(
        table(tables[0], (m,)),
        table(tables[1], (m, n)),
        table(tables[2], (m,)),
        table(tables[3], (m, n)),
        BLOCK_SIZE=plan.block_size,
        mask_mod=make_mask_mod(plan, dev),
        seq_lengths=(plan.q_len, plan.kv_len),
    )


# --------------------------------------------------------------------------- token orders

def _order_index(plan: Plan, device: Any, inverse: bool) -> Any:
    """The plan's order (or its inverse) as an int64 tensor on ``device``, cached."""
    torch = require_torch("compilemask.permute")
    key = ("inverse" if inverse else "order", _cache_key(torch, device))
    cached = plan._cache.get(key)
    if cached is None:
        order = plan.order
        if inverse:
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), dtype=order.dtype)
            order = inv
        cached = order.to(device)
        plan._cache[key] = cached
    return cached


def _reorder(x: Any, plan: Plan, dim: int, inverse: bool, what: str) -> Any:
    torch = require_torch(f"compilemask.{what}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a compilemask.Plan, got {type(plan).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -x.dim() <= dim < x.dim():
        # IndexError, as torch and compilemask.distributed name a dimension out of range.
        raise IndexError(f"dim = {dim} is out of range for a {x.dim()}-D tensor; expected "
                         f"{-x.dim()} ..= {x.dim() - 1}")
    if x.shape[dim] != plan.q_len:
        raise ValueError(
            f"x has {x.shape[dim]} tokens along dim {dim}, but the plan was built for "
            f"q_len = {plan.q_len}"
        )
    if plan.order is None:
        return x
    return x.index_select(dim, _order_index(plan, x.device, inverse))


def permute(x: torch.Tensor, plan: Plan, dim: int = 2) -> torch.Tensor:
    """Puts the tokens of ``x`` (along ``dim``; 2 for ``[batch, num_heads, seq_len,
    head_dim]``) into the plan's token order: new position ``i`` holds original token
    ``plan.order[i]``. Returns ``x`` itself for a plan in raster order. Differentiable."""
    return _reorder(x, plan, dim, False, "permute")


def unpermute(x: torch.Tensor, plan: Plan, dim: int = 2) -> torch.Tensor:
    """The inverse of :func:`permute`: tokens in the plan's order back to the original
    positions, so ``unpermute(permute(x, plan), plan)`` equals ``x``."""
    return _reorder(x, plan, dim, True, "unpermute")


# --------------------------------------------------------------------------- the custom op

def _forward_op() -> Any:
    """The forward custom op (registered on first use: importing ``_ops`` imports torch),
    called without torch's dispatcher where nothing could tell (``attention_forward_eager``)."""
    require_torch("compilemask.attention")
    from . import _ops

    return _ops.attention_forward_eager


# --------------------------------------------------------------------------- attention

_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _broadcast_dim(plan_n: int, n: int, uses: bool, what: str, index_name: str) -> None:
    if plan_n == n or (plan_n == 1 and not uses):
        return
    if plan_n == 1:
        raise ValueError(
            f"the mask depends on the {what} (it reads `{index_name}` or `{what}`, or the plan "
            f"is packed), so the plan must be built for the tensors' {what} = {n} "
            f"(program.plan(..., {what}={n})); it was built for {plan_n}"
        )
    raise ValueError(
        f"the plan was built for {what} = {plan_n}, but the query has {what} = {n}"
    )


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Plan | PlanTensors,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    deterministic: bool = False,
    score_tensors: dict[str, torch.Tensor] | None = None,
) -> Any:
    """Masked attention with a compiled plan, in the SDPA / FlexAttention layout.

    ``query`` ``[batch, num_heads, q_len, head_dim]``, ``key`` ``[batch, num_kv_heads,
    kv_len, head_dim]``, ``value`` ``[batch, num_kv_heads, kv_len, head_dim_v]``; ``plan``
    a :class:`Plan` for exactly these ``q_len`` / ``kv_len`` (or its :meth:`Plan.to_tensors`,
    the form to use under ``torch.compile``). A plan built with batch = num_heads = 1 for a
    mask that reads neither ``b`` nor ``h`` (nor ``batch`` / ``num_heads``) applies to every
    (batch, head).

    ``scale`` defaults to ``1 / sqrt(head_dim)``. ``enable_gqa`` allows ``num_heads`` to be
    a multiple of ``num_kv_heads`` (GQA / MQA), as in SDPA and Flex. Returns ``out``
    ``[batch, num_heads, q_len, head_dim_v]`` in the input dtype, and with ``return_lse``
    also ``lse`` ``[batch, num_heads, q_len]`` (natural log; float32, float64 for float64
    inputs). Rows with no visible key give 0 and ``-inf`` (with a sink: 0 and the sink's
    logit; a ``-inf`` sink is no sink, with gradient 0). Differentiable (``out`` and
    ``lse``). ``deterministic`` selects the CUDA backward whose dQ needs no atomics (the same
    bits every run; the CPU reference always is deterministic).

    Score terms: a plan whose program has a ``score`` or ``sink`` statement (softcap, a
    linear bias such as ALiBi, a bias table such as T5's, sinks; docs/language.md, "Scores")
    forms its logits with them. The program's tensors come by name in ``score_tensors``
    (``{"rel_bias": table, "sinks": s}``, each of its declared shape, float, on the query's
    device); they are differentiable (the table's gradient is summed with fp32 atomics on
    CUDA, so its last bits vary run to run, also with ``deterministic``). ``out`` and
    ``lse`` stay differentiable; on CPU the plan must be a :class:`Plan`, and
    ``torch.compile`` works with score terms on CUDA only (the CPU reference is not
    traceable).

    Packed samples: with a plan from ``program.plan(cu_seqlens_q=..., cu_seqlens_k=...)``,
    pass FlashAttention's varlen layout: ``query`` ``[total_q, num_heads, head_dim]``,
    ``key`` ``[total_k, num_kv_heads, head_dim]``, ``value`` ``[total_k, num_kv_heads,
    head_dim_v]``. They are viewed as batch 1 (``[1, heads, total, head_dim]``, no copy);
    ``out`` comes back as ``[total_q, num_heads, head_dim_v]`` (contiguous) and ``lse`` as
    ``[num_heads, total_q]``. (3-D inputs work with any plan of batch 1; 4-D inputs of batch 1
    work with a packed plan, other batches raise ``ValueError``.)

    On CPU tensors this runs the CPU reference (float32 / float64; float16 and bfloat16 are
    computed in float32). On CUDA tensors it runs the CompileMask kernels (Hopper, compute
    capability 9.0; bfloat16 / float16, head_dim 64, 128 or 256 with ``head_dim_v ==
    head_dim`` and 192 with head_dim_v 128, forward and backward; a softcap or biases at 64
    and 128, and at 192 / 128 forward only (no inputs that require grad); sinks alone at
    every one of those shapes, forward and backward; other cases raise
    ``NotImplementedError``) on the current CUDA stream, without host
    synchronisation, so it can be captured in a CUDA graph. Inputs there need a contiguous
    last dim and 16-byte aligned addresses and strides (a ``.contiguous()`` tensor is fine).
    Wrong devices, dtypes, shapes, strides or a plan for other lengths raise ``ValueError``;
    a wheel built without the CUDA kernels raises ``RuntimeError`` on CUDA tensors.
    """
    torch = require_torch("compilemask.attention")
    enable_gqa = _flag("enable_gqa", enable_gqa)
    return_lse = _flag("return_lse", return_lse)
    deterministic = _flag("deterministic", deterministic)
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() == 3:
        # FlashAttention's varlen layout [total, heads, head_dim]: one batch of packed rows,
        # viewed (no copy) as [1, heads, total, head_dim].
        for name, t in tensors.items():
            if t.dim() != 3:
                raise ValueError(
                    f"query is 3-D (the varlen layout [total_q, num_heads, head_dim]), so "
                    f"{name} must be 3-D too (or pass 4-D [batch, heads, seq_len, head_dim] "
                    f"tensors), got shape {tuple(t.shape)}"
                )
        packed = isinstance(plan, Plan) and plan.is_packed
        plan_q_len = plan.q_len if isinstance(plan, (Plan, PlanTensors)) else None
        if plan_q_len is not None and not packed and query.shape[0] != plan_q_len:
            hint = (f"; its dim 1 is {plan_q_len}: for [num_heads, q_len, head_dim] without a "
                    "batch dim, pass query.unsqueeze(0) (and key, value alike)"
                    if query.shape[1] == plan_q_len else "")
            raise ValueError(
                f"query is 3-D, so it is read as the varlen layout [total_q, num_heads, "
                f"head_dim] with total_q = {query.shape[0]} (dim 0), but the plan has q_len = "
                f"{plan_q_len}{hint}"
            )
        out = attention(query.unsqueeze(0).transpose(1, 2), key.unsqueeze(0).transpose(1, 2),
                        value.unsqueeze(0).transpose(1, 2), plan, scale, enable_gqa, True,
                        deterministic, score_tensors)
        out4, lse4 = out
        out3 = out4[0].transpose(0, 1).contiguous()
        return (out3, lse4[0]) if return_lse else out3
    for name, t in tensors.items():
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, heads, seq_len, head_dim] (or 3-D [total, heads, "
                f"head_dim], the varlen layout, with a plan of batch 1 such as a packed plan), "
                f"got shape {tuple(t.shape)}"
            )
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(
                f"{name} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must have one dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, "
            f"{value.device}"
        )
    b, hq, lq, d = query.shape
    if key.shape[0] != b or value.shape[0] != b:
        raise ValueError(
            f"batch sizes differ: query {b}, key {key.shape[0]}, value {value.shape[0]}"
        )
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"key has {key.shape[1]} heads but value has {value.shape[1]}")
    if key.shape[2] != value.shape[2]:
        raise ValueError(
            f"key has seq_len {key.shape[2]} but value has {value.shape[2]}"
        )
    if key.shape[3] != d:
        raise ValueError(f"query head_dim {d} differs from key head_dim {key.shape[3]}")
    hk, lk = key.shape[1], key.shape[2]
    if hq == 0 or hk == 0:
        raise ValueError(
            f"num_heads = {hq} and num_kv_heads = {hk} (dim 1 of query and key) must be at "
            "least 1")
    if hq % hk != 0:
        raise ValueError(
            f"num_heads = {hq} must be a multiple of num_kv_heads = {hk}"
        )
    if hq != hk and not enable_gqa:
        raise ValueError(
            f"query has {hq} heads and key/value {hk}; pass enable_gqa=True for GQA / MQA"
        )
    for name, n in (("head_dim (query.shape[3])", d), ("head_dim_v (value.shape[3])", value.shape[3])):
        if n == 0:
            raise ValueError(f"{name} = 0; it must be at least 1")
    if isinstance(plan, Plan):
        pt = plan.to_tensors(query.device)
    elif isinstance(plan, PlanTensors):
        pt = plan
    else:
        raise TypeError(
            f"plan must be a compilemask.Plan or PlanTensors, got {type(plan).__name__}"
        )
    if (pt.q_len != lq or pt.kv_len != lk) and isinstance(plan, Plan) and plan.is_packed:
        raise ValueError(
            f"the packed plan holds cu_seqlens_q[-1] = {pt.q_len} query rows and "
            f"cu_seqlens_k[-1] = {pt.kv_len} keys, but the tensors have {lq} and {lk}"
        )
    if b != 1 and isinstance(plan, Plan) and plan.is_packed:
        # Its samples are one batch of packed rows (`b` reads the sample index), so a batch
        # of them is not a broadcast of the plan: each would need its own packing.
        raise ValueError(
            f"a packed plan is one batch of cu_seqlens_q[-1] = {pt.q_len} packed rows, but "
            f"the tensors have batch {b}: pass 4-D tensors of batch 1 or the 3-D varlen "
            "layout [total, heads, head_dim]"
        )
    if pt.q_len != lq or pt.kv_len != lk:
        # A plan has at least one row and one key, so empty sequences have no plan to name.
        again = (f"plan again with program.plan({lq}, {lk}, ...)" if lq and lk else
                 "a plan (and attention) needs at least one query row and one key")
        raise ValueError(
            f"the plan was built for q_len = {pt.q_len}, kv_len = {pt.kv_len}, but query has "
            f"seq_len {lq} and key {lk}; {again}"
        )
    _broadcast_dim(pt.batch, b, pt.uses_batch, "batch", "b")
    _broadcast_dim(pt.num_heads, hq, pt.uses_head, "num_heads", "h")
    if pt.row_ptr.device != query.device:
        raise ValueError(
            f"the plan tensors are on {pt.row_ptr.device} but query is on {query.device}; "
            f"use plan.to_tensors({str(query.device)!r})"
        )
    scale = _checked_scale(scale, d)
    if query.device.type == "cuda" and (not pt.kernel or pt.kernel_flat is None):
        raise ValueError(
            "the plan tensors hold no CUDA kernel descriptor; build them for the query's device "
            f"with plan.to_tensors({str(query.device)!r})"
        )
    if query.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(
            f"compilemask.attention runs on CPU and CUDA tensors, got {query.device}"
        )
    if query.device.type == "cuda":
        from . import _ops

        _ops.check_cuda_backward_supported(
            query, key, value, pt.score is not None and pt.score.modifies_logits)
    mask_index = pt.mask_index.expand(b, hq)
    # How the CUDA kernels find each (batch, head)'s mask in the descriptor, and their tile.
    plan_dims = pt.plan_dims()
    if pt.score is not None:
        out, lse = _scored_attention(torch, query, key, value, plan, pt, score_tensors, scale,
                                     plan_dims, deterministic)
        return (out, lse) if return_lse else out
    _no_score_tensors(score_tensors)
    out, lse = _forward_op()(query, key, value, pt.row_ptr, pt.intervals, mask_index,
                             pt.kernel_flat, list(pt.kernel_lens), plan_dims, scale,
                             bool(deterministic))
    return (out, lse) if return_lse else out
