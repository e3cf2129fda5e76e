"""Serving steps over a paged KV cache: :class:`Step` (the rows of a decode, speculative-tree
or chunked-prefill step, planned for the new rows alone) and :func:`paged_attention`.

Planning needs nothing but this package; :meth:`Step.to_tensors` and :func:`paged_attention`
import torch when called.
"""

from __future__ import annotations

import array
import operator
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _native
from ._program import (_LENGTH_MAX, _bounded, _flag, _index, _int, _length, _ordered, _type_name,
                       _values)

if TYPE_CHECKING:
    import torch

    from ._program import Program


class StepTensors(NamedTuple):
    """A step's rows as the decode kernel reads them, int32 tensors on one device:
    ``cu_q`` ``[num_seqs + 1]`` (rows of sequence ``s`` are ``cu_q[s] .. cu_q[s + 1]`` of the
    packed query), ``kv_len`` ``[num_seqs]`` (keys of each sequence, the new tokens
    included), ``row_ptr`` ``[total_q + 1]`` (row ``r``'s intervals are ``row_ptr[r] ..
    row_ptr[r + 1]``), ``intervals`` ``[2 * num_intervals]`` (``(start, end)`` pairs,
    half-open logical key positions of the row's own sequence, sorted and maximal);
    ``max_q_len``, the most new rows of any sequence, sizes the CUDA kernel's grid (a capacity:
    when the arrays are rewritten in place for a captured CUDA graph, keep it at least the
    largest step's, or rows past it are computed by fewer CTAs). Made by
    :meth:`Step.to_tensors`."""

    cu_q: torch.Tensor
    kv_len: torch.Tensor
    row_ptr: torch.Tensor
    intervals: torch.Tensor
    num_seqs: int
    total_q: int
    max_q_len: int


class PrefillTensors(NamedTuple):
    """A step laid out for the paged forward (``cm_cuda::prefill``), on one CUDA device:
    ``kernel``, the int32 descriptor arrays of its virtual rows (each step row ``row_group``
    times, the query heads of one kv head packed as rows, then every sequence's rows padded
    to whole 128-row query tiles) over the virtual key space (every sequence's keys padded to
    whole 128-key blocks); ``key_blocks`` int32 ``[num_key_blocks, 4]`` (each block's
    sequence, first logical key and valid keys); ``row_index`` int64 ``[total_q *
    row_group]`` (the virtual row of copy ``j`` of step row ``r`` at ``r * row_group + j``);
    ``kv_len`` the virtual keys and ``q_rows`` the virtual rows. Only the arrays of the paged
    forward's tile are built (``cm_cuda::prefill_lists``; the others are placeholders it never
    reads). Made by :meth:`Step.prefill_tensors`."""

    kernel: tuple
    key_blocks: torch.Tensor
    row_index: torch.Tensor
    kv_len: int
    q_rows: int
    row_group: int
    # The one tensor ``kernel``'s arrays are views of, back to back, and their lengths.
    kernel_flat: torch.Tensor | None = None
    kernel_lens: tuple[int, ...] = ()

    def plan_dims(self) -> list[int]:
        return [self.kv_len, self.q_rows, self.row_group]


# The "auto" kernel choice of paged_attention: the paged forward once a step brings at least
# this many new rows per sequence on average (its 128-row query tiles are then mostly one
# sequence's rows, and the decode kernel's per-element visibility and mma.sync products are
# the slower path); decode steps, trees and short chunks stay on the decode kernel.
PREFILL_MIN_ROWS_PER_SEQ = 64

# The most query heads per kv head a prefill layout packs as rows (GQA groups are 1 to 64 in
# practice; under "auto" a larger group takes the decode kernel).
MAX_ROW_GROUP = 256


def _padded(torch: Any, raw: bytes, size: int) -> torch.Tensor:
    """:func:`compilemask._torch._host_int32` zero-padded to ``size`` entries (one
    allocation of that size)."""
    from ._torch import _host_int32

    if len(raw) // 4 >= size:
        return _host_int32(torch, raw)
    out = torch.zeros(size, dtype=torch.int32)
    out[:len(raw) // 4] = _host_int32(torch, raw)
    return out


def _room(max_intervals: Any, num_intervals: int) -> int:
    """``max_intervals`` of :meth:`Step.to_tensors`: an int of at least the step's
    ``num_intervals``."""
    room = _int("max_intervals", max_intervals)
    if not num_intervals <= room <= _MAX_INTERVALS:
        raise ValueError(f"max_intervals = {_value_text(room)} is out of range; expected "
                         f"{num_intervals} (the step's num_intervals) ..= {_MAX_INTERVALS} (the "
                         "most intervals a step holds)")
    return room


def _max_q_len(cu_q: bytes) -> int:
    """The most new rows of any sequence, from ``cu_q``'s bytes."""
    offsets = _ints(cu_q)
    return max(map(operator.sub, offsets[1:], offsets[:-1]), default=0)


def _consecutive(parts: Any) -> Any:
    """The one 1-D int32 tensor that ``parts`` lie in one after the other (as
    :meth:`Step.to_tensors` makes them), or None when they do not."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    at = first.storage_offset()
    for t in parts:
        if (t.untyped_storage().data_ptr() != storage or t.storage_offset() != at
                or (t.numel() > 1 and t.stride(0) != 1)):
            return None
        at += t.numel()
    return first.as_strided((at - first.storage_offset(),), (1,), first.storage_offset())


def _ints(raw: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(raw)
    return a.tolist()


# Most sequences one step may have (the planner's batch limit); an endless iterator of
# per-sequence values stops there.
_MAX_SEQS = _LENGTH_MAX["batch"]
_MAX_SEQS_WHY = "one per sequence, at most 2^20 sequences"


_SEQUENCE = "a sequence of ints, one per sequence"

# The int32 arrays of a step, the first four fields of StepTensors.
_STEP_ARRAYS = ("cu_q", "kv_len", "row_ptr", "intervals")

# Most intervals a step holds (cm_serve::MAX_STEP_INTERVALS; the planner refuses more): room
# past it would never be used, and 2^31 pairs took 16 GiB of host memory to pad.
_MAX_INTERVALS = 1 << 27


def _value_text(value: Any) -> str:
    """``repr(value)`` for an error message, cut short; an int too long for Python to print
    (past ``sys.get_int_max_str_digits()``) by its size."""
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"(an int of {value.bit_length()} bits)"
        return "(too large to print)"
    return text if len(text) <= 80 else text[:77] + "..."


def _int_list(name: str, value: Any, what: str = _SEQUENCE) -> list[int]:
    """A list of ints from a sequence, an iterator, a numpy array or an integer tensor;
    ``what`` says what ``name`` takes in a ``TypeError``."""
    if _plain_ints(value):
        # The serving loop's case (a list of plain ints each step): checked as a whole, since
        # naming every element for its possible error cost more than the native step itself.
        return list(value)
    given = value
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = _values(name, value)
        if not isinstance(value, list):  # a scalar, named as the caller gave it
            raise TypeError(f"{name} must be {what}, got {_type_name(given)} {_value_text(given)}")
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be {what}, got {_type_name(value)} {_value_text(value)}")
    value = _ordered(name, value, what)
    out = [_int(f"{name}[{i}]", x) for i, x in _bounded(name, value, _MAX_SEQS, _MAX_SEQS_WHY)]
    for i, x in enumerate(out):
        if not -(1 << 63) <= x < (1 << 63):
            raise ValueError(f"{name}[{i}] = {_value_text(x)} is out of range; expected a signed "
                             "64-bit integer")
    return out


def _plain_ints(value: Any) -> bool:
    """Whether ``value`` is a list or tuple of at most ``_MAX_SEQS`` plain ints (no bools, no
    subclasses), each a signed 64-bit integer: what :func:`_int_list` would accept unchanged."""
    return (type(value) in (list, tuple) and len(value) <= _MAX_SEQS
            and all(type(x) is int for x in value)
            and (not value or (-(1 << 63) <= min(value) and max(value) < (1 << 63))))


def _counts(name: str, value: Any, num_seqs: int) -> list[int]:
    """One int per sequence: an int (the same for every sequence; a numpy or torch scalar
    too) or a sequence of ints."""
    given = value
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = _values(name, value)  # numpy / torch: scalars become int, arrays lists
    if isinstance(value, int) and not isinstance(value, bool):
        value = operator.index(value)
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"{name} = {_value_text(value)} is out of range; expected a signed "
                             "64-bit integer")
        return [value] * num_seqs
    what = f"an int (the same for every sequence) or {_SEQUENCE}"
    if value is not given and not isinstance(value, list):
        # A numpy or torch scalar of another type, named as the caller gave it.
        raise TypeError(f"{name} must be {what}, got {_type_name(given)} {_value_text(given)}")
    return _int_list(name, value, what)


def _seq_params(program: Program, params: Any) -> list[dict[str, Any]] | None:
    """Per-sequence parameter values, checked and converted like :meth:`Program.plan`'s."""
    if params is None:
        return None
    from ._program import _param_value

    params = _ordered("params", params, "a list of dicts, one per sequence")
    out = []
    for i, p in _bounded("params", params, _MAX_SEQS, _MAX_SEQS_WHY):
        if not isinstance(p, Mapping):
            raise TypeError(f"params[{i}] must be a dict of parameter values, got {_type_name(p)}")
        program._check_names(p)
        out.append({k: _param_value(k, v) for k, v in p.items()})
    return out


# The Step whose to_tensors cache holds each cached StepTensors, by id of its cu_q tensor:
# write_tensors of another step into those tensors takes them out of that cache, which would
# otherwise hand them on (to_tensors, paged_attention with that Step) as its own step's.
_CACHED_BY: weakref.WeakValueDictionary[int, Step] = weakref.WeakValueDictionary()


def plan_step(program: Program, q_len: Any, kv_len: Any, num_heads: Any, params: Any,
              shared: Mapping[str, Any]) -> Step:
    kv = _int_list("kv_len", kv_len)
    q = _counts("q_len", q_len, len(kv))
    heads = 1 if num_heads is None else _length("num_heads", num_heads)
    native = program._native.plan_step(q, kv, heads, program._params(shared),
                                       _seq_params(program, params))
    # After the native checks, which name what a step cannot serve at all (h, score terms).
    reads = program.reads_num_heads
    if num_heads is None and reads:
        raise ValueError(
            "this mask reads num_heads, which a step binds when it is planned: pass num_heads= "
            "(the query heads of the q that paged_attention will run it with)")
    return Step(native, program, heads if reads else None)


class Step:
    """The rows of one serving step over a paged KV cache, made by
    :meth:`Program.plan_step` and grown by :meth:`append`.

    Sequence ``s`` has ``q_len[s]`` new query rows (its last tokens, whose K / V are already
    in the cache) and ``kv_len[s]`` keys including them; new row ``i`` is the logical
    position ``kv_len[s] - q_len[s] + i`` (bottom-right aligned). Each row holds the
    program's visible keys at that position, the program bound at ``q_len = kv_len =
    kv_len[s]`` with batch index ``b = s``. One mask serves every head.
    """

    __slots__ = ("_native", "_program", "_num_heads", "_tensors", "_lock", "_written",
                 "__weakref__")

    def __init__(self, native: _native.Step, program: Program, num_heads: int | None):
        self._native = native
        self._program = program
        # The num_heads the program read when planned (None: it reads none), which the q a
        # step runs with must have.
        self._num_heads = num_heads
        self._tensors: dict[str, StepTensors | PrefillTensors] = {}
        # The native step serialises its own calls; this keeps the tensor cache in step
        # with it when threads share a Step (tensors of an old step must not be stored
        # after an append has cleared the cache).
        self._lock = threading.RLock()
        # (tensors, their one span or None, whether any is an inference tensor, where they
        # are) of the last write_tensors: a serving loop writes the same tensors every step,
        # whose layout checks then need not run again while the tensors stay where they were.
        self._written: tuple | None = None

    def __reduce__(self) -> Any:
        raise TypeError(
            "a compilemask.Step holds the serving planner's state (its appended steps) and is "
            "not pickled; send its StepTensors (step.to_tensors(), tensors that pickle) or "
            "plan the step again where it is used")

    @property
    def program(self) -> Program:
        return self._program

    @property
    def num_seqs(self) -> int:
        return self._native.num_seqs

    @property
    def total_q(self) -> int:
        """Query rows of the step (``sum(q_len)``)."""
        return self._native.total_q

    @property
    def num_intervals(self) -> int:
        return self._native.num_intervals

    def _arrays(self) -> tuple[bytes, bytes, bytes, bytes]:
        return self._native.arrays()

    @property
    def cu_q(self) -> list[int]:
        """``[num_seqs + 1]`` row offsets."""
        return _ints(self._arrays()[0])

    @property
    def kv_len(self) -> list[int]:
        """``[num_seqs]`` keys per sequence, the new tokens included."""
        return _ints(self._arrays()[1])

    @property
    def q_len(self) -> list[int]:
        """``[num_seqs]`` new rows per sequence."""
        cu = self.cu_q
        return [b - a for a, b in zip(cu, cu[1:])]

    @property
    def row_ptr(self) -> list[int]:
        """``[total_q + 1]`` interval offsets."""
        return _ints(self._arrays()[2])

    @property
    def intervals(self) -> list[int]:
        """``[2 * num_intervals]`` ``(start, end)`` pairs, flat, row after row."""
        return _ints(self._arrays()[3])

    def row(self, r: int) -> list[tuple[int, int]]:
        """Row ``r``'s visible intervals (``0 <= r < total_q``), half-open."""
        return list(self._native.row(_index("r", r, self.total_q)))

    def positions(self) -> list[int]:
        """The logical position of every row: ``kv_len[s] - q_len[s] + i``."""
        out: list[int] = []
        for q, kv in zip(self.q_len, self.kv_len):
            out.extend(range(kv - q, kv))
        return out

    @property
    def caches_pieces(self) -> bool:
        """Whether rows come from the planner's piece cache (masks that read no length,
        ``b``, ``h`` or ``elementwise``): a decode step then costs a lookup per sequence."""
        return self._native.caches_pieces

    def append(self, new_tokens: Any = 1) -> Step:
        """The next step, in place: sequence ``s`` gains ``new_tokens[s] >= 1`` tokens (an
        int: the same for every sequence), written into the cache before the step runs,
        which are its new rows (``q_len[s] = new_tokens[s]``, ``kv_len[s]`` grows by as much).
        Only those rows are planned; each sequence keeps its parameters. Returns the step.
        On an error (``ValueError``) the step is unchanged."""
        with self._lock:
            self._native.append(_counts("new_tokens", new_tokens, self.num_seqs))
            self._clear_tensors()
        return self

    def _clear_tensors(self) -> None:
        """Empties the tensor cache (the step changed); call with the lock held."""
        for t in self._tensors.values():
            if isinstance(t, StepTensors) and _CACHED_BY.get(id(t.cu_q)) is self:
                del _CACHED_BY[id(t.cu_q)]
        self._tensors.clear()

    def _forget(self, cu_q: Any) -> None:
        """Takes the cached StepTensors whose ``cu_q`` is ``cu_q`` out of the cache (another
        step is writing its arrays into them)."""
        with self._lock:
            for key, t in list(self._tensors.items()):
                if isinstance(t, StepTensors) and t.cu_q is cu_q:
                    del self._tensors[key]
            if _CACHED_BY.get(id(cu_q)) is self:
                del _CACHED_BY[id(cu_q)]

    def replan(self, q_len: Any, kv_len: Any, params: Any = None) -> Step:
        """A step of other sequences (the batch changed), in place, with the same program,
        shared parameters and piece cache; ``params`` as in :meth:`Program.plan_step`."""
        kv = _int_list("kv_len", kv_len)
        q = _counts("q_len", q_len, len(kv))
        own = _seq_params(self._program, params)
        with self._lock:
            self._native.replan(q, kv, own)
            self._clear_tensors()
        return self

    def to_tensors(self, device: Any = None, *, max_intervals: int | None = None) -> StepTensors:
        """The step's arrays as int32 tensors on ``device`` (default CPU), cached until the
        next :meth:`append`. On CUDA they come in one copy that is queued on the current stream
        without waiting for the work before it (use them on another stream only once that
        stream waits for this one); ``RuntimeError`` while a CUDA graph is being captured:
        make them before capturing.

        ``max_intervals`` (at least the step's ``num_intervals``, at most ``2**27``, the most a
        step holds) leaves room for that many
        intervals: ``intervals`` then has ``2 * max_intervals`` entries, the pairs past the
        step's zero and never read (``row_ptr`` bounds every row), so that the later steps of
        a CUDA graph captured with these tensors fit them (:meth:`write_tensors`)."""
        from ._torch import _cache_key, _queued_copy, require_torch

        torch = require_torch("Step.to_tensors")
        dev = torch.device(_cache_key(torch, device))
        key = str(dev)
        with self._lock:
            if max_intervals is not None:
                max_intervals = _room(max_intervals, self.num_intervals)
                key = f"{key} room {max_intervals}"
            cached = self._tensors.get(key)
            if cached is not None:
                return cached
            arrays = self._arrays()
            sizes = [len(a) // 4 for a in arrays]
            if max_intervals is not None:
                sizes[3] = 2 * max_intervals  # the pairs past the step's stay zero
            if dev.type == "cuda":
                # One transfer, split into views of it.
                flat = _queued_copy(torch, _padded(torch, b"".join(arrays), sum(sizes)), dev)
                cu, kv, rp, iv = torch.split(flat, sizes)
            else:
                # Tensors of their own: views of one buffer would each pickle (and hold once
                # loaded) all four arrays.
                cu, kv, rp, iv = (_padded(torch, a, n).to(dev) for a, n in zip(arrays, sizes))
            out = StepTensors(cu, kv, rp, iv, sizes[1], sizes[2] - 1, _max_q_len(arrays[0]))
            self._tensors[key] = out
            _CACHED_BY[id(cu)] = self
        return out

    def write_tensors(self, tensors: StepTensors) -> StepTensors:
        """Writes this step's arrays into ``tensors`` (made by :meth:`to_tensors`, usually of
        an earlier step, with ``max_intervals`` room) in place and returns them: the serving
        loop of a CUDA graph captured with those tensors, ``step.append(1)``,
        ``step.write_tensors(tensors)``, ``graph.replay()``. The step must have their
        ``num_seqs`` and ``total_q`` (the shapes the graph holds) and at most as many
        intervals as ``tensors.intervals`` has room for; its ``max_q_len`` may pass theirs
        (the graph's kernel then gives each CTA more rows; still exact). On CUDA one copy
        queued on the current stream, as :meth:`to_tensors`; ``RuntimeError`` during capture.
        ``ValueError`` naming what does not fit (or tensors a write could fill only in part:
        inference tensors outside inference mode, ``expand``-ed or overlapping tensors),
        ``TypeError`` for anything but :class:`StepTensors` of int32 tensors; on an error the
        tensors are unchanged (the checks of the tensors themselves run when a step first
        writes a ``StepTensors`` and are remembered while it writes that same one, its
        tensors at the same addresses and sizes). Tensors
        that another step's :meth:`to_tensors` cached leave that
        cache (they no longer hold its step). Nothing here checks the block table: a sequence
        whose ``kv_len`` outgrows its block-table row has the keys past it left out on CUDA,
        so grow the table (in place, under a graph) before the step needs it."""
        from ._torch import _host_int32, _queued_copy_into, require_torch

        torch = require_torch("Step.write_tensors")
        if not isinstance(tensors, StepTensors):
            raise TypeError(f"tensors must be the StepTensors of Step.to_tensors, got "
                            f"{_type_name(tensors)}")
        parts = tensors[:4]
        written = self._written
        if written is None or written[0] is not tensors or written[3] != _addresses(parts):
            written = (tensors, *_write_layout(torch, parts))
        elif written[2] and not torch.is_inference_mode_enabled():
            _check_writable(torch, _STEP_ARRAYS, parts)  # names the inference tensor
        owner = _CACHED_BY.get(id(parts[0]))
        if owner is not None and owner is not self:
            # Another step's cached tensors: after this write they no longer hold its step.
            owner._forget(parts[0])
        with self._lock:
            n, t_q, have = self.num_seqs, self.total_q, self.num_intervals
            room = parts[3].numel() // 2
            for name, got, want in (("num_seqs", tensors.num_seqs, n),
                                    ("total_q", tensors.total_q, t_q)):
                if isinstance(got, bool) or not isinstance(got, int):
                    raise TypeError(f"tensors.{name} must be an int, got {_type_name(got)} "
                                    f"{_value_text(got)}")
                if got != want:
                    raise ValueError(
                        f"the tensors hold a step of {name} = {got}, but this step has {want}: "
                        f"a captured graph's shapes do not change; make new tensors "
                        f"(step.to_tensors) and capture again")
            sizes = [parts[0].numel(), parts[1].numel(), parts[2].numel()]
            if sizes != [n + 1, n, t_q + 1]:
                raise ValueError(
                    f"the tensors' cu_q, kv_len and row_ptr have {sizes[0]}, {sizes[1]} and "
                    f"{sizes[2]} entries; expected num_seqs + 1 = {n + 1}, num_seqs = {n} and "
                    f"total_q + 1 = {t_q + 1}")
            if have > room:
                raise ValueError(
                    f"this step has {have} intervals but tensors.intervals has room for "
                    f"{room}: make the tensors with step.to_tensors(device, max_intervals=N), N "
                    f"at least the largest step's num_intervals, and capture again")
            host = _host_int32(torch, b"".join(self._arrays()))
            self._written = written
            span = written[1]
            if span is not None:
                _queued_copy_into(torch, host, span[:host.numel()])
            else:
                done = 0
                for t, m in zip(parts, sizes + [2 * have]):
                    _queued_copy_into(torch, host[done:done + m], t[:m])
                    done += m
        return tensors

    def prefill_tensors(self, device: Any, row_group: int = 1) -> PrefillTensors:
        """The step laid out for the paged forward on ``device`` (CUDA for the kernel; ``None``
        is the CPU), each row ``row_group`` times (``num_heads // num_kv_heads`` packs the
        query heads of a kv head as rows; an int in ``[1, MAX_ROW_GROUP]``), cached until the
        next :meth:`append` (``ValueError`` when the layout is too large). Copied to CUDA as
        :meth:`to_tensors` is."""
        from ._torch import _cache_key, _host_int32, _kernel_tensors, _queued_copy, require_torch

        if isinstance(row_group, bool) or not isinstance(row_group, int):
            raise TypeError(f"row_group must be an int, got {_type_name(row_group)}")
        if not 1 <= row_group <= MAX_ROW_GROUP:
            raise ValueError(f"row_group = {row_group} is out of range; expected 1 to "
                             f"{MAX_ROW_GROUP} (num_heads // num_kv_heads)")
        torch = require_torch("Step.prefill_tensors")
        key = f"prefill {row_group} " + _cache_key(torch, device)
        with self._lock:
            cached = self._tensors.get(key)
            if cached is not None:
                return cached
            dev = torch.device("cpu") if device is None else torch.device(device)
            arrays, blocks, kv_len, row_index, q_rows = self._native.prefill_arrays(row_group)
            kernel, flat, lens = _kernel_tensors(torch, arrays, dev, queued=True)
            blocks_t = _queued_copy(torch, _host_int32(torch, blocks), dev)
            rows_t = _queued_copy(torch, _host_int32(torch, row_index).long(), dev)
            out = PrefillTensors(kernel, blocks_t.reshape(len(blocks) // 16, 4), rows_t,
                                 kv_len, q_rows, row_group, flat, lens)
            self._tensors[key] = out
        return out

    def __repr__(self) -> str:
        return (f"Step({self._program.name!r}, num_seqs={self.num_seqs}, "
                f"total_q={self.total_q}, num_intervals={self.num_intervals})")


def _addresses(parts: Any) -> tuple:
    """Where the step tensors ``parts`` are: what ``set_``, ``resize_`` or ``.data =`` change,
    after which their remembered checks no longer hold."""
    return tuple((t.data_ptr(), t.numel()) for t in parts)


def _write_layout(torch: Any, parts: Any) -> tuple[Any, bool, tuple]:
    """The checks of :meth:`Step.write_tensors` on the four tensors themselves (1-D int32 on
    one device, each writable in full, apart in memory): ``TypeError`` / ``ValueError``
    naming the one at fault; else the one tensor they lie in back to back (None when they do
    not), whether any is an inference tensor, and their :func:`_addresses`."""
    for name, t in zip(_STEP_ARRAYS, parts):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            got = (f"{t.dtype} tensor of shape {tuple(t.shape)}"
                   if isinstance(t, torch.Tensor) else _type_name(t))
            raise TypeError(f"tensors.{name} must be a 1-D int32 tensor, got {got}")
        if t.device != parts[0].device:
            raise ValueError(f"tensors.{name} is on {t.device} but tensors.cu_q on "
                             f"{parts[0].device}")
    _check_writable(torch, _STEP_ARRAYS, parts)
    span = _consecutive(parts)
    return span, any(t.is_inference() for t in parts), _addresses(parts)


def _check_writable(torch: Any, names: tuple, parts: Any) -> None:
    """``ValueError`` for step tensors that a write could only partly fill, checked before
    any is written: an inference tensor outside inference mode, elements that share memory
    (an ``expand``), or two of the four tensors over the same memory."""
    spans = []
    for name, t in zip(names, parts):
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(
                f"tensors.{name} is an inference tensor (made under torch.inference_mode), "
                "which cannot be written outside inference mode: make the tensors outside it, "
                "or write them inside it")
        if t.numel() > 1 and t.stride(0) == 0:
            raise ValueError(f"tensors.{name} has elements that share memory (stride 0, as "
                             "from expand); it must have memory of its own per element")
        if t.numel() and t.device.type != "meta":
            start = t.data_ptr()
            spans.append((start, start + ((t.numel() - 1) * t.stride(0) + 1) * 4, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"tensors.{a} and tensors.{b} overlap in memory; the four tensors "
                             "must be apart (as Step.to_tensors makes them)")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    step: Step | StepTensors,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    kernel: str = "auto",
) -> Any:
    """Attention of a serving step's rows over a paged KV cache (vLLM / FlashInfer layout).

    ``q`` ``[total_q, num_heads, head_dim]``: the step's new rows packed by ``cu_q``;
    ``k_cache`` ``[num_pages, page_size, num_kv_heads, head_dim]``, ``v_cache`` ``[num_pages,
    page_size, num_kv_heads, head_dim_v]``, with the step's new tokens already written;
    ``block_table`` int32 ``[num_seqs, max_pages_per_seq]``: logical key ``p`` of sequence
    ``s`` is slot ``p % page_size`` of page ``block_table[s][p // page_size]`` (only a
    sequence's first ``ceil(kv_len[s] / page_size)`` entries are read, so pages may be shared
    between sequences: a shared prompt is block-table sharing). ``step`` is a :class:`Step`
    or its :meth:`Step.to_tensors`. Query head ``h`` reads kv head ``h // (num_heads //
    num_kv_heads)`` (GQA / MQA). ``scale`` defaults to ``1 / sqrt(head_dim)``.

    Returns ``out`` ``[total_q, num_heads, head_dim_v]`` in the input dtype, and with
    ``return_lse`` also ``lse`` ``[total_q, num_heads]`` (natural log; float32, float64 for
    float64 inputs). A row with no visible key gives 0 and ``-inf``.

    CPU tensors run the CPU reference (float32 / float64; float16 and bfloat16 computed in
    float32): each sequence's pages gathered, then the exact per-row softmax; block-table
    entries outside ``[0, num_pages)`` that a sequence reads raise ``ValueError``. CUDA
    tensors run one of two kernels (``compilemask._ops.paged_attention_cuda``), chosen by
    ``kernel``:

    - ``"decode"``: the decode kernel (the query heads of a kv head packed into each tile,
      split-KV): any step, any page size, and :class:`StepTensors` rewritten in place for a
      captured CUDA graph (:meth:`Step.write_tensors`);
    - ``"prefill"``: the paged forward (the training forward's warp-specialised kernel with K
      and V read through the block table, 128 x 128 tiles over every sequence's keys padded to
      whole 128-key blocks): a :class:`Step` (its rows are laid out on the host), page sizes
      that are powers of two from 8, head_dim 64 or 128; the fast path for prefill chunks
      and shared-prompt scoring, where each sequence brings many rows;
    - ``"auto"`` (default): ``"prefill"`` when it can run and the step averages at least
      ``PREFILL_MIN_ROWS_PER_SEQ`` (64) new rows per sequence, else ``"decode"`` (also when
      the step's prefill layout would outgrow the paged forward's limits).

    A block-table entry outside ``[0, num_pages)`` reads as zeros on CUDA, never outside the
    cache. A :class:`Step` with a sequence of more keys than its block-table row holds pages
    for raises ``ValueError`` on either device; with :class:`StepTensors` (no host copy of the
    lengths, as under CUDA graphs) the CUDA kernels leave the keys past the row out. Not
    differentiable (serving is inference). Wrong shapes, dtypes or devices raise
    ``ValueError``; CUDA dtypes and head dims the kernels lack raise ``NotImplementedError``.

    With a :class:`Step` on CUDA, the first call after each :meth:`Step.append` copies the
    step's arrays to the GPU queued on torch's current stream, and later calls reuse them
    (:meth:`Step.to_tensors`): a call on another stream (layers split across streams) must
    first make that stream wait for the first one (``torch.cuda.Stream.wait_stream``), or
    its kernel may read the arrays before they arrive. Under CUDA graph capture pass
    :class:`StepTensors` (a :class:`Step` raises ``RuntimeError``: its tensors are replaced
    at each append), written for each later step by :meth:`Step.write_tensors`.

    The prefill path lays out the step's rows on the host each time a step changes
    (:meth:`Step.prefill_tensors`, cached until :meth:`Step.append`): each sequence's rows,
    the query heads of a kv head packed as rows and padded to whole 128-row tiles, over its
    keys padded to whole 128-key blocks; a descriptor of every tile a sequence's rows see,
    with per-row bits where the mask cuts a tile.
    """
    from ._torch import _DTYPES, _checked_scale, require_torch

    torch = require_torch("compilemask.paged_attention")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(t)}")
    for name, t, dims in (("q", q, "[total_q, num_heads, head_dim]"),
                          ("k_cache", k_cache, "[num_pages, page_size, num_kv_heads, head_dim]"),
                          ("v_cache", v_cache,
                           "[num_pages, page_size, num_kv_heads, head_dim_v]"),
                          ("block_table", block_table, "[num_seqs, max_pages_per_seq]")):
        if t.dim() != dims.count(",") + 1:
            raise ValueError(f"{name} must be {dims}, got shape {tuple(t.shape)}")
    for name, t in list(named.items())[:3]:
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(
                f"{name} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must have one dtype, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise ValueError(
            "q, k_cache, v_cache and block_table must be on one device, got "
            + ", ".join(f"{n} on {t.device}" for n, t in named.items()))
    total_q, hq, d = q.shape
    num_pages, page_size, hk, dk = k_cache.shape
    if tuple(v_cache.shape[:3]) != (num_pages, page_size, hk):
        raise ValueError(
            f"v_cache has shape {tuple(v_cache.shape)}; its first three dims must be k_cache's "
            f"[num_pages, page_size, num_kv_heads] = {(num_pages, page_size, hk)}")
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k_cache {dk}")
    sizes = {"head_dim (q.shape[2])": d, "head_dim_v (v_cache.shape[3])": v_cache.shape[3],
             "page_size (k_cache.shape[1])": page_size, "num_heads (q.shape[1])": hq,
             "num_kv_heads (k_cache.shape[2])": hk}
    for name, n in sizes.items():
        if n == 0:
            raise ValueError(f"{name} = 0; it must be at least 1")
    if hq % hk != 0:
        raise ValueError(f"num_heads = {hq} must be a multiple of num_kv_heads = {hk}")
    if kernel not in ("auto", "decode", "prefill"):
        raise ValueError(f"kernel must be 'auto', 'decode' or 'prefill', got {kernel!r}")
    return_lse = _flag("return_lse", return_lse)
    if isinstance(step, Step) and step._num_heads not in (None, hq):
        raise ValueError(
            f"the step was planned with num_heads = {step._num_heads}, which its mask reads, but q "
            f"has num_heads = {hq} (q.shape[1]); plan the step with num_heads={hq}")
    if isinstance(step, Step):
        if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "compilemask.paged_attention: a Step cannot be captured in a CUDA graph: its "
                "tensors are replaced at each append, so the graph would read freed memory. "
                "Capture with tensors = step.to_tensors(device, max_intervals=N) and write each "
                "later step into them with step.write_tensors(tensors) (the decode kernel)")
        tensors = step.to_tensors(q.device)
    elif isinstance(step, StepTensors):
        tensors = step
        for name in ("num_seqs", "total_q", "max_q_len"):
            v = getattr(step, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"step.{name} must be an int, got {_type_name(v)} "
                                f"{_value_text(v)}")
        if step.max_q_len < 1:
            raise ValueError(f"step.max_q_len = {step.max_q_len}; it must be at least 1 (the "
                             "most new rows of any sequence)")
    else:
        raise TypeError(f"step must be a compilemask.Step or StepTensors, got {_type_name(step)}")
    for name in _STEP_ARRAYS:
        t = getattr(tensors, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            got = t.dtype if isinstance(t, torch.Tensor) else _type_name(t)
            raise TypeError(f"step.{name} must be an int32 tensor, got {got}")
    if tensors.total_q != total_q:
        raise ValueError(f"the step has total_q = {tensors.total_q} rows, but q has {total_q}")
    if tensors.num_seqs != block_table.shape[0]:
        raise ValueError(f"the step has num_seqs = {tensors.num_seqs} sequences, but "
                         f"block_table has {block_table.shape[0]} rows")
    if isinstance(step, StepTensors):
        for name, want, what in (("cu_q", step.num_seqs + 1, "num_seqs + 1"),
                                 ("kv_len", step.num_seqs, "num_seqs"),
                                 ("row_ptr", step.total_q + 1, "total_q + 1")):
            got = getattr(step, name)
            if got.dim() != 1 or got.numel() != want:
                raise ValueError(f"step.{name} has shape {tuple(got.shape)}; expected [{what}] "
                                 f"= [{want}] (the StepTensors' num_seqs = {step.num_seqs}, "
                                 f"total_q = {step.total_q})")
    for name in _STEP_ARRAYS:
        t = getattr(tensors, name)
        if t.device != q.device:
            raise ValueError(f"step.{name} is on {t.device} but q is on {q.device}; use "
                             f"step.to_tensors({str(q.device)!r})")
    scale = _checked_scale(scale, d)
    if q.device.type == "cuda":
        from . import _ops

        _ops.check_paged_cuda(q, v_cache)
        if isinstance(step, Step):
            _check_pages(step, page_size, block_table.shape[1])
        prefill = None
        if _runs_prefill(kernel, step, page_size):
            try:
                prefill = step.prefill_tensors(q.device, hq // hk)
            except ValueError:
                # The layout outgrows the paged forward's limits (its rows are the step's
                # times num_heads // num_kv_heads, padded): "auto" leaves the step to the
                # decode kernel, which reads the step as it is.
                if kernel == "prefill":
                    raise
        return _ops.paged_attention_cuda(q, k_cache, v_cache, block_table, tensors, scale,
                                         bool(return_lse), prefill)
    if q.device.type != "cpu":
        raise ValueError(f"compilemask.paged_attention runs on CPU and CUDA tensors, got "
                         f"{q.device}")
    # The reference reads the tensors' bytes on the host, which torch.compile cannot trace:
    # it runs eagerly there (a graph break).
    reference = torch.compiler.disable(_paged_cpu)
    out, lse = reference(torch, q, k_cache, v_cache, block_table, tensors, scale)
    return (out, lse) if return_lse else out


def _check_pages(step: Step, page_size: int, max_pages: int) -> None:
    """``ValueError`` when a sequence of ``step`` has more keys than a block-table row of
    ``max_pages`` pages holds (the CUDA kernels would leave the keys past it out)."""
    capacity = max_pages * page_size
    for s, kv in enumerate(step.kv_len):
        if kv > capacity:
            raise ValueError(
                f"kv_len[{s}] = {kv} needs {-(-kv // page_size)} pages of {page_size}, but "
                f"block_table rows hold max_pages_per_seq = {max_pages}")


def _runs_prefill(kernel: str, step: Any, page_size: int) -> bool:
    """Whether a CUDA call that both kernels support (dtype, head dims) runs the paged forward
    (``kernel`` as :func:`paged_attention` documents it); ``ValueError`` naming what stops
    ``kernel="prefill"``, which the decode kernel does not need."""
    if kernel == "decode":
        return False
    why = None
    if not isinstance(step, Step):
        why = ("it needs a compilemask.Step (its rows are laid out on the host), not "
               "StepTensors")
    elif page_size < 8 or page_size & (page_size - 1):
        why = f"page_size = {page_size} is not a power of two of at least 8"
    if why is not None:
        if kernel == "prefill":
            raise ValueError(f"compilemask.paged_attention(kernel='prefill'): {why}; "
                             "kernel='decode' takes it")
        return False
    return kernel == "prefill" or step.total_q >= PREFILL_MIN_ROWS_PER_SEQ * step.num_seqs


def _paged_cpu(torch: Any, q: Any, k_cache: Any, v_cache: Any, block_table: Any,
               tensors: StepTensors, scale: float) -> tuple:
    """The CPU reference (``compilemask._native.paged_reference``) on torch tensors."""
    from ._ops import _compute_dtype, _from_bytes, _host, _lse_dtype

    cd = _compute_dtype(q.dtype)
    total_q, hq, d = q.shape
    num_pages, page_size, hk, _ = k_cache.shape
    dv = v_cache.shape[3]
    dims = (hq, hk, d, dv, num_pages, page_size, block_table.shape[1])
    arrays = [_host(t, torch.int32) for t in tensors[:4]]
    # Room past the step's intervals (Step.to_tensors' max_intervals) is never read.
    if len(arrays[2]) and int(arrays[2][-1]) >= 0:
        arrays[3] = arrays[3][:2 * int(arrays[2][-1])]
    out, lse = _native.paged_reference(
        dims, _host(q, cd), _host(k_cache, cd), _host(v_cache, cd),
        _host(block_table, torch.int32), tuple(arrays), scale, cd == torch.float64)
    return (_from_bytes(out, cd, (total_q, hq, dv)).to(q.dtype),
            _from_bytes(lse, cd, (total_q, hq)).to(_lse_dtype(q.dtype)))
