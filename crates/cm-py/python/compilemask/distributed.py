"""Context parallelism: one long sequence split across ranks by the work its mask gives each
token, each rank fetching from the others only the keys its rows see.

A plain split by positions gives the ranks very different work (the last of two shards of a
causal mask computes three times the pairs of the first), and ring attention moves every
key to every rank. :class:`ContextParallel` cuts the sequence into chunks, deals them to the
ranks so that each holds about the same number of visible pairs and the same number of
tokens, and derives, for every pair of ranks, the ranges of keys one reads from the other and
its rows against them as a plan of their own (``cm_shard`` in the Rust core; MagiAttention's
dispatch by mask area and FlashMask's context-parallel balancing balance the same quantity).

>>> import compilemask as cm
>>> from compilemask.distributed import ContextParallel
>>> cp = ContextParallel(cm.builtin("causal").plan(4096), ranks=2, chunk=256)
>>> [w / sum(cp.work) for w in cp.work]
[0.5, 0.5]

Each rank holds its tokens' Q, K and V (``cp.shard(x, rank)``: the rank's rows of a tensor
in the program's positions); :func:`attention` runs one rank's part: it fetches the keys it
reads over ``torch.distributed`` (one ``all_to_all_single`` for K and one for V; NCCL on GPUs,
gloo on CPU), runs :func:`compilemask.attention` on each source's part and merges the partial
results by lse. In the backward the gradients of fetched keys go back to their ranks the same
way and are summed there; dQ stays local. :func:`simulate` runs every rank in one process
through the same per-rank code (the transport is indexing instead of a collective), for tests
and single-GPU development; its output and gradients are those of ``cm.attention`` on the
whole sequence.

Layouts: ``[batch, heads, seq, head_dim]`` as :func:`compilemask.attention` takes them; the
plan is batch 1 with one mask for every head (a packed plan of documents, say). Of the score
terms, a softcap (every part applies it), sinks (the merge adds each row's sink once, given
as ``score_tensors`` as to :func:`compilemask.attention`) and a bias that reads no position
(a constant per head: the merge adds it to each part's lse) are carried; biases that read
positions are refused, since a part renumbers its rows and keys. Positions are 0-based and
ranges half-open.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ._program import Plan, _flag, _int
from ._torch import require_torch

__all__ = ["ContextParallel", "attention", "simulate"]

_U32_MAX = 2**32 - 1


def _check_count(name: str, value: Any) -> int:
    """``value`` as an int (any ``__index__`` type, as NumPy's; never a bool, ``TypeError``
    otherwise), ``ValueError`` unless it is in ``[1, 2^32)``."""
    v = _int(name, value)
    if not 1 <= v <= _U32_MAX:
        raise ValueError(f"{name} must be in [1, {_U32_MAX}], got {v}")
    return v


def _check_rank(name: str, value: Any, ranks: int) -> int:
    """A rank or source rank as an int (``TypeError`` as :func:`_check_count`), ``IndexError``
    unless it is in ``0 .. ranks``. Checked here, before the native layer, whose 64-bit
    conversion would give an ``OverflowError``, and before any cache keyed by it: ``True``
    hashes as ``1``."""
    v = _int(name, value)
    # A negative rank would index the offsets from the end: an empty or wrong shard.
    if not 0 <= v < ranks:
        raise IndexError(f"{name} = {v} is out of range; expected 0 .. {ranks} (half-open: "
                         f"the sharding has ranks = {ranks})")
    return v


def _check_dim(dim: Any, x: Any) -> int:
    """``dim`` as an int (``TypeError`` as :func:`_check_count`), ``IndexError`` unless it is
    a dimension of ``x`` (negative counts from the end)."""
    d = _int("dim", dim)
    if not -x.dim() <= d < x.dim():
        raise IndexError(f"dim = {d} is not a dimension of a tensor of shape "
                         f"{tuple(x.shape)} (expected -{x.dim()} to {x.dim() - 1})")
    return d


class ContextParallel:
    """``plan``'s sequence dealt to ``ranks`` ranks in chunks of ``chunk`` tokens by visible
    pairs. Default chunk (the CLI's, ``cm_shard::default_chunk``): the largest of 512, 256,
    128 and 64 that cuts the sequence into at least 4 chunks per rank (so the deal can balance
    them), else 64; ``len // ranks`` when 64 leaves fewer chunks than ranks.

    Rank ``r`` holds new positions ``offsets[r] .. offsets[r + 1]``, original tokens
    ``order[offsets[r]:offsets[r + 1]]`` (its chunks, ascending). ``ValueError`` when the
    plan is not one square mask of batch 1 whose score terms are at most a softcap and sinks
    (biases read the positions a part renumbers), has fewer chunks than
    ranks, or its ranks' rows would read keys in more than 2^28 (rank, source) ranges.
    """

    __slots__ = ("_native", "plan", "_plans", "_index")

    def __init__(self, plan: Plan, ranks: int, chunk: Optional[int] = None):
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a compilemask.Plan, got {type(plan).__name__}")
        # The native sharding counts ranks and chunk tokens in 32 bits.
        ranks = _check_count("ranks", ranks)
        if chunk is not None:
            chunk = _check_count("chunk", chunk)
        self._native = plan._native.shard(ranks, chunk)
        self.plan = plan
        self._plans: dict = {}
        self._index: dict = {}

    def __reduce__(self) -> tuple[Any, tuple[Plan, int, int]]:
        # Dealt again from its plan (which pickles as its planning arguments): the deal is
        # deterministic.
        return (ContextParallel, (self.plan, self.ranks, self.chunk))

    @property
    def ranks(self) -> int:
        return self._native.ranks

    @property
    def chunk(self) -> int:
        return self._native.chunk

    @property
    def offsets(self) -> list[int]:
        """``ranks + 1`` boundaries of the ranks' positions in the sharded order."""
        return self._native.offsets

    @property
    def chunks(self) -> list[list[int]]:
        """Each rank's chunks (chunk ``c``: original tokens ``c * chunk .. (c + 1) * chunk``)."""
        return self._native.chunks

    @property
    def work(self) -> list[int]:
        """Visible pairs of each rank's rows."""
        return self._native.work

    @property
    def computed_pairs(self) -> list[int]:
        """Pairs each rank's kernels compute at the plan's tile (its parts' non-empty tiles)."""
        return self._native.computed_pairs()

    # Every rank and source argument goes through _rank / _pair: ``TypeError`` for what is not
    # an int (bools, floats, None), ``IndexError`` naming it outside ``0 .. ranks``.
    def _rank(self, rank: Any) -> int:
        return _check_rank("rank", rank, self.ranks)

    def _pair(self, rank: Any, source: Any) -> tuple[int, int]:
        return self._rank(rank), _check_rank("source", source, self.ranks)

    def shard_len(self, rank: int) -> int:
        """Tokens rank ``rank`` holds."""
        r = self._rank(rank)
        offsets = self.offsets
        return offsets[r + 1] - offsets[r]

    def fetched(self, rank: int) -> int:
        """Keys ``rank`` fetches from the other ranks (K and V each)."""
        return self._native.fetched(self._rank(rank))

    def ring_fetched(self, rank: int) -> int:
        """Keys ring attention would move to ``rank``: every other rank's."""
        return self._native.ring_fetched(self._rank(rank))

    def keys(self, rank: int, source: int) -> list[tuple[int, int]]:
        """Ranges of ``source``'s local key positions that ``rank``'s rows see."""
        return self._native.keys(*self._pair(rank, source))

    def part_plan(self, rank: int, source: int) -> Plan:
        """``rank``'s rows against the keys it reads from ``source``, compacted, as a plan."""
        rank, source = self._pair(rank, source)
        key = (rank, source)
        if key not in self._plans:
            self._plans[key] = Plan(self._native.part_plan(rank, source), self.plan.program)
        return self._plans[key]

    def order(self, device: Any = None) -> Any:
        """``order[new] = original`` as an int64 tensor (made once per device)."""
        torch = require_torch("ContextParallel.order")
        key = ("order", str(device))
        if key not in self._index:
            raw = torch.frombuffer(bytearray(self._native.order), dtype=torch.int32)
            self._index[key] = raw.to(device=device, dtype=torch.int64)
        return self._index[key]

    def _inverse(self, device: Any) -> Any:
        """``inverse[original] = new`` (made once per device)."""
        torch = require_torch("ContextParallel.unshard")
        key = ("inverse", str(device))
        if key not in self._index:
            order = self.order(device)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            self._index[key] = inverse
        return self._index[key]

    def key_index(self, rank: int, source: int, device: Any = None) -> Any:
        """The local key positions of ``source`` that ``rank`` fetches, as an int64 tensor."""
        torch = require_torch("ContextParallel.key_index")
        rank, source = self._pair(rank, source)
        key = (rank, source, str(device))
        if key not in self._index:
            ranges = self.keys(rank, source)
            pieces = [torch.arange(a, b) for a, b in ranges]
            index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
            self._index[key] = index.to(device)
        return self._index[key]

    def shard(self, x: Any, rank: int, dim: int = -2) -> Any:
        """Rank ``rank``'s tokens of ``x`` (positions in the program's order along ``dim``).

        ``x`` holds the whole sequence along ``dim``: ``plan.q_len`` positions (``ValueError``
        otherwise); ``IndexError`` for a rank outside ``0 .. ranks`` or a ``dim`` that ``x``
        lacks."""
        rank = self._rank(rank)
        if not hasattr(x, "shape") or not hasattr(x, "index_select"):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        dim = _check_dim(dim, x)
        if x.shape[dim] != self.plan.q_len:
            raise ValueError(
                f"shard takes the whole sequence along dim {dim}: {self.plan.q_len} positions "
                f"(the plan's q_len), got shape {tuple(x.shape)}"
            )
        index = self.order(x.device)[self.offsets[rank]:self.offsets[rank + 1]]
        return x.index_select(dim, index)

    def unshard(self, shards: list, dim: int = -2) -> Any:
        """The inverse of :meth:`shard` over every rank: the ranks' tensors back in the
        program's order along ``dim``."""
        torch = require_torch("ContextParallel.unshard")
        if len(shards) != self.ranks:
            raise ValueError(f"unshard takes one tensor per rank ({self.ranks}), got {len(shards)}")
        for rank, t in enumerate(shards):
            dim = _check_dim(dim, t)
            if t.shape[dim] != self.shard_len(rank):
                raise ValueError(
                    f"shard {rank} must hold rank {rank}'s {self.shard_len(rank)} positions along "
                    f"dim {dim}, got shape {tuple(t.shape)}"
                )
        whole = torch.cat(list(shards), dim)
        return whole.index_select(dim, self._inverse(whole.device))

    def _part_keys(self, rank: int, source: int, k: Any, v: Any) -> Optional[tuple]:
        """The keys and values of ``source``'s shard ``k`` / ``v`` that ``rank`` reads (``None``
        where it reads none): what the transport delivers, taken here by indexing."""
        index = self.key_index(rank, source, k.device)
        if index.numel() == 0:
            return None
        return k.index_select(-2, index), v.index_select(-2, index)


def _rank_attention(cp: ContextParallel, rank: int, q: Any, fetched: list, dv: int,
                    scale: float, enable_gqa: bool, deterministic: bool, merged: tuple,
                    ready: Any = None) -> tuple:
    """One rank's attention from its queries and, per source rank, the keys and values it
    fetched (``None`` where it reads none; ``dv``: the values' head dim). Its own part runs first; ``ready()`` (when given)
    is called after it, before any fetched tensor is read, so the exchange overlaps the own
    part's work. The parts are merged by lse, in float32, as
    FlashAttention's split-KV merge (``lse = logsumexp_s lse_s``, ``out = sum_s
    exp(lse_s - lse) out_s``). ``merged`` is :func:`_cp_checks`'s ``(sink, shift)``: each
    head's constant bias ``shift`` (``[heads]`` or None) added to every part's lse, since a
    constant added to every logit of a row moves only its lse; then the head's ``sink`` logit
    (``[heads]`` or None) merged as one more part whose output is 0, so it joins each row's
    denominator once. Rows that see no key get 0 and lse -inf (the sink's logit with a sink).
    lse is float32 (float64 for float64 inputs), as :func:`compilemask.attention`'s."""
    torch = require_torch("compilemask.distributed.attention")
    from ._torch import attention as cm_attention

    # Merged in float32 (float64 for float64 inputs, which the CPU reference computes in).
    acc = torch.promote_types(q.dtype, torch.float32)
    outs, lses = [], []
    sources = [rank] + [s for s in range(cp.ranks) if s != rank]
    for i, source in enumerate(sources):
        if i == 1 and ready is not None:
            ready()
        kv = fetched[source]
        if kv is None:
            continue
        k, v = kv
        out, lse = cm_attention(q, k, v, cp.part_plan(rank, source), scale=scale,
                                enable_gqa=enable_gqa, return_lse=True,
                                deterministic=deterministic)
        outs.append(out)
        lses.append(lse.to(acc))
    b, h, n, _ = q.shape
    sink, shift = merged
    if shift is not None:
        lses = [lse + shift.to(acc).reshape(1, -1, 1) for lse in lses]
    if not outs:
        # No key for any row: output 0 as compilemask.attention gives it, still a function of
        # q (gradient 0), so a loss over it differentiates as the whole sequence's does.
        outs = [q.new_zeros((b, h, n, dv)) + q[..., :1] * 0]
        lses = [torch.full((b, h, n), -math.inf, dtype=acc, device=q.device)]
    if sink is not None:
        # A sink is a logit with value vector 0 (docs/language.md, "Scores"): a part of its
        # own, output 0, lse sink[h] on every row of head h.
        outs.append(outs[0].new_zeros(outs[0].shape))
        lses.append(sink.to(acc).reshape(1, -1, 1).expand(b, h, n))
    return _merge(torch, outs, lses, acc) if len(outs) > 1 else (outs[0], lses[0])


def _merge(torch: Any, outs: list, lses: list, acc: Any) -> tuple:
    """Partial results over disjoint keys merged by their lse (in ``acc``)."""
    stacked = torch.stack(lses)
    # Rows that see no key in any part keep lse -inf and weight 0, and give no gradient: every
    # branch that is not selected there stays finite (exp(-inf - -inf) and log(0) would not).
    seen = torch.isfinite(stacked).any(0)
    top = torch.where(seen, stacked.amax(0), 0.0).detach()
    total = torch.exp(stacked - top).sum(0)
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, 1.0)), -math.inf)
    weights = torch.exp(stacked - torch.where(seen, lse, 0.0))
    out = sum(w.unsqueeze(-1) * o.to(acc) for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), lse


def _cp_checks(cp: ContextParallel, query: Any, score_tensors: Any) -> tuple:
    """Checks ``query``'s heads against ``cp``'s plan as :func:`compilemask.attention` does
    (and its sinks: present, of the plan's shape, finite or ``-inf``); returns what the merge
    adds after the parts: the sink tensor ``score_tensors`` gives (None for a plan without
    sinks) and each query head's constant bias ``slopes[h] * offset`` (``[heads]`` float32,
    formed as the kernels form it; None without one). The shard plan refuses biases that read
    positions, so a linear bias here is a constant."""
    torch = require_torch("compilemask.distributed")
    from ._torch import (_broadcast_dim, _check_score_heads, _no_score_tensors, _score_inputs,
                         _score_tensors)

    heads = query.shape[1]
    _broadcast_dim(cp.plan.num_heads, heads, cp.plan.uses_head, "num_heads", "h")
    score = _score_tensors(torch, cp.plan, query.device)
    if score is None:
        _no_score_tensors(score_tensors)
        return None, None
    _check_score_heads(score, cp.plan.num_heads, heads)
    shift = None
    if score.slopes is not None:
        offset = torch.tensor(score.linear[2], dtype=torch.float32, device=query.device)
        shift = (score.slopes * offset).expand(heads) if score.slopes.numel() == 1 \
            else score.slopes * offset
    _, sink = _score_inputs(torch, score, score_tensors, query.device)
    if sink is not None:
        # As the kernels and the CPU reference refuse them: a NaN or +inf sink has no softmax.
        bad = torch.isnan(sink) | (sink == math.inf)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            shown = "NaN" if math.isnan(sink[i].item()) else "inf"
            raise ValueError(
                f"{score.sink}[{i}] of [num_heads] is {shown}; a sink must be finite, or -inf "
                "for no sink"
            )
    return sink, shift


def simulate(query: Any, key: Any, value: Any, cp: ContextParallel, *,
             scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
             deterministic: bool = False, score_tensors: Any = None) -> Any:
    """Every rank of ``cp`` in one process through :func:`attention`'s per-rank code, the
    transport being indexing: ``query`` / ``key`` / ``value`` are the whole sequence in the
    program's positions (``[batch, heads, seq, head_dim]``); the result (and, through
    autograd, the gradients) is in those positions too, as :func:`compilemask.attention`'s on
    the whole sequence (``score_tensors``: the plan's sink tensor, as there)."""
    require_torch("compilemask.distributed.simulate")
    return_lse = _flag("return_lse", return_lse)
    _check_lengths((query, key, value), cp.plan.q_len, "the plan's sequence")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    merged = _cp_checks(cp, query, score_tensors)
    shards = [(cp.shard(query, r), cp.shard(key, r), cp.shard(value, r)) for r in range(cp.ranks)]
    outs, lses = [], []
    for r in range(cp.ranks):
        fetched = [cp._part_keys(r, s, shards[s][1], shards[s][2]) for s in range(cp.ranks)]
        out, lse = _rank_attention(cp, r, shards[r][0], fetched, value.shape[-1], float(scale),
                                   enable_gqa, deterministic, merged)
        outs.append(out)
        lses.append(lse)
    # Keys and values stay in the graph (gradient 0) when no row reads any: as
    # compilemask.attention's, the gradients are then zeros, not missing.
    unread = (key.reshape(-1)[:1].sum() + value.reshape(-1)[:1].sum()) * 0
    out = cp.unshard(outs, -2) + unread.to(outs[0].dtype)
    return (out, cp.unshard(lses, -1)) if return_lse else out


def attention(query: Any, key: Any, value: Any, cp: ContextParallel, *, group: Any = None,
              scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
              deterministic: bool = False, score_tensors: Any = None) -> Any:
    """This rank's part of context-parallel attention over ``torch.distributed``: ``query``,
    ``key`` and ``value`` are this rank's shards (``cp.shard(x, rank)``, ``[batch, heads,
    cp.shard_len(rank), head_dim]``); the rank is ``group``'s (the default group when
    ``None``), whose size must be ``cp.ranks``. Returns this rank's output (and lse) in its
    shard's positions; differentiable (the gradients of fetched keys are sent back to their
    ranks and summed there). Every rank must call it, with equal ``batch``, heads and dtypes;
    ``score_tensors`` gives the plan's sink tensor as to :func:`compilemask.attention` (every
    rank its own copy; its gradient is this rank's rows' part).
    """
    require_torch("compilemask.distributed.attention")
    import torch.distributed as dist

    return_lse = _flag("return_lse", return_lse)

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size != cp.ranks:
        raise ValueError(f"the process group has {size} ranks, the sharding {cp.ranks}")
    _check_lengths((query, key, value), cp.shard_len(rank), f"rank {rank}'s shard")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    merged = _cp_checks(cp, query, score_tensors)
    pending: list = []
    anchor, *pieces = _Fetch.apply(key, value, cp, rank, group, pending)
    fetched = []
    it = iter(pieces)
    for s in range(cp.ranks):
        if s == rank:
            fetched.append(cp._part_keys(rank, rank, key, value))
        elif cp.keys(rank, s):
            fetched.append((next(it), next(it)))
        else:
            fetched.append(None)
    out, lse = _rank_attention(cp, rank, query, fetched, value.shape[-1], float(scale),
                               enable_gqa, deterministic, merged,
                               ready=lambda: [w.wait() for w in pending])
    out = out + anchor.to(out.dtype)
    return (out, lse) if return_lse else out


def _check_lengths(tensors: tuple, n: int, what: str) -> None:
    """Query, key and value must be 4-D with ``n`` positions (``what`` holds them)."""
    for name, t in zip(("query", "key", "value"), tensors):
        if t.dim() != 4 or t.shape[2] != n:
            raise ValueError(
                f"{name} must be {what}, [batch, heads, {n}, head_dim], got shape "
                f"{tuple(t.shape)}"
            )


def _exchange(torch: Any, dist: Any, send: list, recv_sizes: list, like: Any, group: Any,
              pending: Optional[list] = None) -> list:
    """``send[s]`` (token-major ``[n_s, ...]``) to rank ``s`` and ``recv_sizes[s]`` tokens from
    each, by one ``all_to_all_single``; the received pieces in rank order. With ``pending``
    the collective is asynchronous and its work handle is appended there: the pieces may be
    read only after its ``wait()``."""
    flat = torch.cat(send, 0).contiguous()
    out = like.new_empty((sum(recv_sizes),) + tuple(flat.shape[1:]))
    work = dist.all_to_all_single(out, flat, output_split_sizes=recv_sizes,
                                  input_split_sizes=[t.shape[0] for t in send], group=group,
                                  async_op=pending is not None)
    if pending is not None:
        pending.append(work)
    return list(torch.split(out, recv_sizes, 0))


def _fetch_cls() -> Any:
    torch = require_torch("compilemask.distributed.attention")

    class Fetch(torch.autograd.Function):
        """A zero scalar (the anchor: the caller adds it to its output, so that this rank's
        backward always runs, as the other ranks' backward exchanges need it to), then the keys
        and values this rank reads from every other rank (sources ascending, K then V of each,
        only sources it reads), still arriving: the exchanges' work handles are appended to
        ``pending``, to wait on before reading them. Backward returns their gradients to their
        ranks, which add them at the keys they sent (synchronously)."""

        @staticmethod
        def forward(ctx, k, v, cp, rank, group, pending):
            import torch.distributed as dist

            ranks = cp.ranks
            # What each rank s wants of mine, and what I want of each.
            send_index = [k.new_zeros(0, dtype=torch.int64) if s == rank
                          else cp.key_index(s, rank, k.device) for s in range(ranks)]
            recv_sizes = [0 if s == rank else sum(b - a for a, b in cp.keys(rank, s))
                          for s in range(ranks)]
            ctx.save_for_backward(*send_index)
            ctx.meta = (cp, rank, group, recv_sizes, tuple(k.shape), tuple(v.shape), k.dtype,
                        k.device)
            pieces = []
            for x in (k, v):
                tokens = x.permute(2, 0, 1, 3)  # [n, b, h, d]
                got = _exchange(torch, dist, [tokens.index_select(0, i) for i in send_index],
                                recv_sizes, tokens, group, pending)
                pieces.append([g.permute(1, 2, 0, 3) for g in got])
            out = [k.new_zeros(())]
            for s in range(ranks):
                if s != rank and recv_sizes[s] > 0:
                    out += [pieces[0][s], pieces[1][s]]
            return tuple(out)

        @staticmethod
        def backward(ctx, _anchor, *grads):
            import torch.distributed as dist

            send_index = ctx.saved_tensors
            cp, rank, group, recv_sizes, k_shape, v_shape, dtype, device = ctx.meta
            it = iter(grads)
            back = {s: (next(it), next(it)) for s in range(cp.ranks)
                    if s != rank and recv_sizes[s] > 0}
            results = []
            for which, (b, h, n, d) in enumerate((k_shape, v_shape)):
                send = []
                for s in range(cp.ranks):
                    g = back[s][which] if s in back else torch.zeros(
                        (b, h, recv_sizes[s], d), dtype=dtype, device=device)
                    send.append(g.to(dtype).permute(2, 0, 1, 3))
                got = _exchange(torch, dist, send, [i.numel() for i in send_index], send[0],
                                group)
                # Summed in float32 (float64 for float64 inputs).
                acc = torch.promote_types(dtype, torch.float32)
                total = torch.zeros((n, b, h, d), dtype=acc, device=device)
                for i, g in zip(send_index, got):
                    if i.numel():
                        total.index_add_(0, i, g.to(acc))
                results.append(total.permute(1, 2, 0, 3).to(dtype))
            return results[0], results[1], None, None, None, None

    return Fetch


class _Fetch:
    """:func:`_fetch_cls`, built on first use (this module imports without torch)."""

    fn = None

    @classmethod
    def apply(cls, *args: Any) -> Any:
        if cls.fn is None:
            cls.fn = _fetch_cls()
        return cls.fn.apply(*args)
