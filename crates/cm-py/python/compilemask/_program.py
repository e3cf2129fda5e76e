"""Programs and plans: the part of the package that needs no torch."""

from __future__ import annotations

import array
import operator
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Union

from . import _native
from ._native import PlanError

if TYPE_CHECKING:
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    from ._serve import Step

ParamValue = Union[int, Sequence[int]]
DenseFormat = Literal["auto", "torch", "numpy", "list"]
OrderRequest = Union[Literal["raster", "auto"], Sequence[int], None]


class Parameter(NamedTuple):
    """A declared parameter of a mask program."""

    name: str
    is_array: bool
    has_default: bool


class PlanTensors(NamedTuple):
    """A plan as tensors, the form in which it travels through :func:`compilemask.attention`
    (and through ``torch.compile``: a new plan of the same sizes reuses compiled code).

    ``row_ptr`` is int32 ``[num_masks, q_len + 1]`` (each row's first interval in
    ``intervals``), ``intervals`` int32 ``[capacity, 2]`` (start, end; padded with zeros to a
    power of two past the last used entry), ``mask_index`` int32 ``[batch, num_heads]`` (the
    distinct mask of each (b, h)). On a CUDA device, ``kernel`` holds the CUDA kernels'
    tile descriptor of the whole plan (every distinct mask back to back, and the mask index),
    which one launch reads for every (b, h): one int32 ``[capacity]`` tensor per array of
    ``compilemask._native.CUDA_PLAN_ARRAYS``, each padded to a power of two (empty on other
    devices), all views of the one tensor ``kernel_flat`` that holds them back to back, of
    ``kernel_lens`` elements each: what a launch passes. Build them with
    :meth:`Plan.to_tensors`; the CUDA kernels trust its contents, so never assemble one from
    parts of different plans.
    """

    row_ptr: torch.Tensor
    intervals: torch.Tensor
    mask_index: torch.Tensor
    q_len: int
    kv_len: int
    batch: int
    num_heads: int
    uses_batch: bool
    uses_head: bool
    kernel: tuple[torch.Tensor, ...] = ()
    # The plan's score terms on the plan tensors' device (None without a score or sink).
    score: ScoreTensors | None = None
    # On CUDA, the forward's tile sets of ``kernel`` (``ws*`` arrays) best first for this
    # plan: the launch runs the first one built for its head dims (``_native.cuda_ws_order``).
    kernel_ws_order: tuple[int, ...] = ()
    # On CUDA, whether the deterministic backward adds dQ in turns for this plan
    # (``_native.cuda_dq_turns``; else a dQ kernel of its own).
    kernel_dq_turns: bool = True
    # On CUDA, the one int32 tensor that ``kernel``'s arrays are views of, back to back, and
    # their lengths: what a launch passes (one tensor argument instead of one per array).
    kernel_flat: torch.Tensor | None = None
    kernel_lens: tuple[int, ...] = ()

    def plan_dims(self) -> list[int]:
        """``[num_masks, batch, num_heads, kernel_dq_turns, *kernel_ws_order]``: how the CUDA
        kernels find each (batch, head)'s mask in ``kernel`` (a side of 1 applies to every
        batch or head), the deterministic backward's dQ path and which forward tile they
        run."""
        return [self.row_ptr.shape[0], self.batch, self.num_heads, int(self.kernel_dq_turns),
                *self.kernel_ws_order]


class ScoreTensors(NamedTuple):
    """A plan's score terms (docs/language.md, "Scores") as :func:`compilemask.attention`
    applies them: ``softcap`` (0 for none); the linear bias ``slopes[h] * (q_coef * q +
    k_coef * k + offset)`` (``slopes`` float32 ``[num_heads]`` or None, ``linear`` the three
    coefficients); the bias table's ``table`` name, ``table_shape`` and ``bucket`` (int64
    ``[q_len + kv_len - 1]``: the bucket of distance ``q - k`` at index ``q - k + kv_len -
    1``); the ``sink`` tensor's name. Tables and sinks arrive by name at attention time
    (``score_tensors=``)."""

    softcap: float
    linear: tuple[float, float, float]
    slopes: torch.Tensor | None
    table: str | None
    table_shape: tuple[int, ...] | None
    bucket: torch.Tensor | None
    sink: str | None
    sink_shape: tuple[int, ...] | None
    # The runs of equal buckets: int32 ``[q_len + kv_len - 1]`` (each index's run's last
    # index, for the kernels) and the table gradient's run sums (``_ops.distance_runs``).
    run_end: torch.Tensor | None = None
    runs: tuple[torch.Tensor, ...] | None = None
    # Whether a term differs between heads (slopes reading ``h``, a table or sink per head):
    # then the terms hold only for the plan's ``num_heads``; otherwise for any head count.
    per_head: bool = True

    @property
    def modifies_logits(self) -> bool:
        """Whether a term changes the logits (softcap, linear bias, table): CUDA then runs the
        score kernels, built at fewer shapes. Sinks alone change only each row's
        normalisation and run on the plain kernels at every shape."""
        return self.softcap > 0 or self.slopes is not None or self.table is not None


class CompileMaskWarning(UserWarning):
    """A plan that is valid but very likely not what was meant: no visible pair (CM0260),
    rows that see no key (CM0261), a mask that reads ``h`` / ``b`` planned with one head /
    batch (CM0262 / CM0263), a parameter set but never read (CM0264), ``elementwise``
    evaluating more than a million pairs (CM0265), a tree with nodes past ``q_len`` or
    ``kv_len`` (CM0266). The message is the rendered warning;
    ``.diagnostic`` holds its parts (code, span, hint). Make them errors with
    ``warnings.simplefilter("error", compilemask.CompileMaskWarning)``."""

    def __init__(self, rendered: str, diagnostic: _native.Diagnostic):
        super().__init__(rendered)
        self.diagnostic = diagnostic
        self.code = diagnostic.code


def _warn(native: _native.Plan) -> None:
    # stacklevel 3: the caller of Program.plan, not this helper or plan itself.
    for diagnostic, rendered in native.warnings:
        warnings.warn(CompileMaskWarning(rendered, diagnostic), stacklevel=3)


def _plan_error(code: str, message: str, hint: str | None = None) -> PlanError:
    """The ``PlanError`` of an argument check made here, built and rendered by the extension
    (the Rust renderer) so that it reads as every other error."""
    return _native.plan_error(code, message, hint)


_I64 = 1 << 63
# The ranges `bind` accepts (CM0402), for ints too large to reach it: the Rust limits.
_LENGTH_MAX = _native.LENGTH_MAX


def _type_name(value: Any) -> str:
    return type(value).__name__


def _as_index(value: Any) -> int:
    """``operator.index(value)``, with a ``TypeError`` for a tensor on torch's meta device
    (whose ``__index__`` raises a ``RuntimeError``: it holds no value)."""
    if getattr(value, "is_meta", False) is True:
        raise TypeError("a tensor on the meta device holds no value")
    return operator.index(value)


def _int(name: str, value: Any) -> int:
    """An int argument (any ``__index__`` type, never a bool), or ``TypeError`` naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return _as_index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {_type_name(value)} {value!r}") from None


def _flag(name: str, value: Any) -> bool:
    """A bool argument (``bool`` or NumPy's ``bool_``), or ``TypeError`` naming it: a string
    such as ``"yes"`` or ``"False"`` is truthy in Python and would silently mean ``True``."""
    if isinstance(value, bool) or _type_name(value) == "bool_":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {_type_name(value)} {value!r}")


def _length(name: str, value: Any) -> int:
    """``q_len``, ``kv_len``, ``batch`` or ``num_heads``: an int; one too large for the
    native layer is the ``PlanError`` CM0402 that the planner gives any other bad length."""
    v = _int(name, value)
    if not -_I64 <= v < _I64:
        raise _plan_error("CM0402", f"{name} = {v} is out of range; expected 1 ..= "
                                    f"{_LENGTH_MAX[name]}")
    return v


def _index(name: str, value: Any, size: int | None = None) -> int:
    """A row, batch or head index: an int; one too large for the native layer is an
    ``IndexError`` like any other index out of range, naming ``[0, size)`` where the caller
    knows it."""
    v = _int(name, value)
    if not -_I64 <= v < _I64:
        expected = "" if size is None else f"; expected 0 <= {name} < {size}"
        raise IndexError(f"{name} = {v} is out of range{expected}")
    return v


def _span(name: str, value: Any) -> tuple[int, int] | None:
    """A zoom ``(start, stop)`` (half-open) of a picture, or None; ``TypeError`` /
    ``ValueError`` naming ``name`` for anything else."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not hasattr(
            value, "__getitem__"):
        raise TypeError(
            f"{name} must be a (start, stop) pair of ints (half-open), got {type(value).__name__}"
        )
    if len(value) != 2:
        raise ValueError(
            f"{name} must be a (start, stop) pair of ints (half-open), got {len(value)} values"
        )
    return (_index(f"{name}[0]", value[0]), _index(f"{name}[1]", value[1]))


def _ordered(name: str, value: Any, what: str) -> Iterable[Any]:
    """``value`` if it is an ordered collection (a sequence, an iterator, or what a numpy
    array or torch tensor's ``tolist()`` gives); ``TypeError`` naming ``name`` for sets,
    mappings, strings and everything else."""
    if isinstance(value, (Set, Mapping)):
        raise TypeError(
            f"{name} must be {what}, got {_type_name(value)} (it has no order; pass a list)"
        )
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (Sequence, Iterator)):
        raise TypeError(f"{name} must be {what}, got {_type_name(value)}")
    return value


def _bounded(name: str, items: Iterable[Any], limit: int, why: str) -> Iterator[tuple[int, Any]]:
    """``enumerate(items)``, or ``ValueError`` naming ``name`` once it passes ``limit``
    entries, so that an endless iterator stops there instead of filling memory."""
    for i, x in enumerate(items):
        if i == limit:
            raise ValueError(f"{name} has more than {limit} entries ({why})")
        yield i, x


def _source_text(name: str, text: Any) -> str:
    """``text`` if it is a ``str`` that encodes as UTF-8 (no lone surrogates)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {_type_name(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} must be valid Unicode text: character {e.start} is a lone surrogate "
            f"U+{ord(text[e.start]):04X}, which has no UTF-8 encoding"
        ) from None
    return text


def _values(name: str, value: Any) -> Any:
    """``value.tolist()`` of a numpy array or torch tensor; ``TypeError`` naming ``name`` for
    a tensor on torch's meta device, which has shapes but no values."""
    if getattr(value, "is_meta", False) is True:
        raise TypeError(f"{name} is a tensor on the meta device, which holds no values; pass "
                        "a tensor with data (or a list)")
    return value.tolist()


# Most entries an array parameter may hold (docs/language.md, Limits).
_ARRAY_MAX = 1 << 24


def _param_value(name: str, value: Any) -> int | list[int]:
    """An int or a list of ints from an int, a sequence, a numpy array or a torch tensor."""
    if not isinstance(value, (int, list, tuple)) and hasattr(value, "tolist"):
        value = _values(f"parameter `{name}`", value)  # scalars become int, arrays lists
    if isinstance(value, bool):
        raise TypeError(f"parameter `{name}`: expected an int or a list of ints, got bool")
    if isinstance(value, int):
        return value
    value = _ordered(f"parameter `{name}`", value, "an int or a list of ints")
    out: list[int] = []
    for _, x in _bounded(f"parameter `{name}`", value, _ARRAY_MAX,
                         "2^24, the most segments a segmentation may have"):
        if isinstance(x, bool):
            raise TypeError(f"parameter `{name}`: expected ints, got bool {x!r}")
        try:
            out.append(_as_index(x))
        except TypeError:
            raise TypeError(
                f"parameter `{name}`: expected ints, got {type(x).__name__} {x!r}"
            ) from None
    return out


def _order_value(order: Any, q_len: int) -> str | list[int] | None:
    """``None``, ``"raster"``, ``"auto"``, or a list of ints from any sequence of ints (a
    list, a range, a numpy array, a torch tensor) of at most ``q_len`` entries (CM0407
    past them, so that an endless iterator stops)."""
    if order is None or isinstance(order, str):
        return order
    if hasattr(order, "tolist"):
        order = _values("order", order)  # numpy / torch
    order = _ordered(
        "order", order, "'raster', 'auto' or a sequence of ints (a permutation of range(q_len))"
    )
    out: list[int] = []
    for i, x in enumerate(order):
        if i == max(q_len, 1):
            raise _plan_error(
                "CM0407",
                f"bad token order: more than q_len = {q_len} entries",
                "an order lists every position 0 .. q_len - 1 once",
            )
        if isinstance(x, bool):
            raise TypeError(f"order[{i}]: expected an int, got bool")
        try:
            out.append(_as_index(x))
        except TypeError:
            raise TypeError(f"order[{i}]: expected an int, got {type(x).__name__}") from None
        if not -_I64 <= out[-1] < _I64:
            raise _plan_error(
                "CM0407",
                f"bad token order: order[{i}] = {out[-1]} is out of range",
                "an order lists every position 0 .. q_len - 1 once",
            )
    return out


def _offsets(name: str, value: Any) -> list[int]:
    """``cu_seqlens`` as a list of ints from a list, a tuple, a range, a numpy array or an
    integer torch tensor (int32 or int64, on any device)."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "tolist"):
        kind = str(dtype).removeprefix("torch.")
        if not (kind.startswith("int") or kind.startswith("uint")):
            raise TypeError(f"{name} must hold integers (int32 or int64), got dtype {kind}")
        if getattr(value, "ndim", 1) != 1:
            raise ValueError(
                f"{name} must be 1-D (batch + 1 offsets), got shape {tuple(value.shape)}"
            )
        value = _values(name, value)
    value = _ordered(name, value, "a sequence of ints (batch + 1 offsets)")
    out: list[int] = []
    for i, x in _bounded(name, value, _LENGTH_MAX["batch"] + 1,
                         "batch + 1 offsets, at most 2^20 samples"):
        if isinstance(x, bool):
            raise TypeError(f"{name}[{i}]: expected an int, got bool")
        try:
            x = _as_index(x)
        except TypeError:
            raise TypeError(f"{name}[{i}]: expected an int, got {type(x).__name__}") from None
        if not -(1 << 63) <= x < (1 << 63):
            raise _plan_error(
                "CM0409",
                f"{name}[{i}] = {x} exceeds the longest supported packed length 2^26",
                "cu_seqlens are prefix sums of the sample lengths: [0, len_0, len_0 + len_1, "
                "...], batch + 1 entries",
            )
        out.append(x)
    return out


def _block_size(block_size: int | tuple[int, int]) -> tuple[int, int]:
    def side(v: Any) -> int:
        if isinstance(v, bool):
            raise TypeError
        v = _as_index(v)
        if not 0 <= v < (1 << 32):
            raise _plan_error("CM0401", f"block_size side {v} is not a valid tile side; "
                                        f"expected 1 ..= {(1 << 32) - 1}",
                              "tile sides are positive integers, e.g. block_size=(128, 128)")
        return v

    try:
        if isinstance(block_size, (Set, Mapping)):
            raise TypeError
        if isinstance(block_size, int) or hasattr(block_size, "__index__"):
            m = side(block_size)
            return m, m
        m, n = block_size  # type: ignore[misc]
        return side(m), side(n)
    except (TypeError, ValueError) as e:
        if isinstance(e, PlanError):
            raise
        raise TypeError(
            f"block_size must be an int or a (block_m, block_n) pair of ints, got {block_size!r}"
        ) from None


def compile(source: str, *, name: str = "<mask>") -> Program:  # noqa: A001 (like re.compile)
    """Compiles mask source text (see ``docs/language.md``).

    Raises :class:`MaskSyntaxError` (a ``ValueError``) whose message is the rendered
    diagnostics and whose ``.diagnostics`` lists each one (code, message, line, column,
    severity, hint).
    """
    return Program(_native.compile(_source_text("source", source), _source_text("name", name)))


def builtin(name: str, /, **params: ParamValue) -> Program:
    """A mask of the standard library (``causal``, ``hstu``, ``shared_prefix``, ``clear``,
    ``sliding_window``, ``document_causal``, ``trace_documents``, ``trace_prompt_groups``,
    ...; see :func:`builtins`). Keyword arguments become the program's parameter defaults,
    overridable per :meth:`Program.plan`."""
    program = Program(_native.builtin(_source_text("name", name)))
    return program.with_params(params) if params else program


def builtins() -> list[tuple[str, str]]:
    """``(name, one-line summary)`` of every built-in mask."""
    return list(_native.builtins())


def _unpickle_program(source: str, name: str, defaults: dict[str, Any]) -> Program:
    program = compile(source, name=name)
    return Program(program._native, defaults) if defaults else program


def _unpickle_plan(program: Program, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    # Its warnings were shown where it was first planned; a worker that turns them into
    # errors must still be able to load it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompileMaskWarning)
        return program.plan(*args, **kwargs)


class Program:
    """A checked mask program, ready to plan for any lengths and parameters.

    Made by :func:`compile` or :func:`builtin`; planning it again with new lengths or
    parameters re-parses nothing. Programs pickle (as their source, name and bound
    parameters, compiled again when loaded).
    """

    __slots__ = ("_native", "_defaults")

    def __init__(self, native: _native.Program, defaults: Mapping[str, ParamValue] | None = None):
        self._native = native
        self._defaults = {k: _param_value(k, v) for k, v in (defaults or {}).items()}

    def __reduce__(self) -> tuple[Any, tuple[str, str, dict[str, Any]]]:
        # Pickled as its source, name and bound parameters, and compiled again on loading
        # (DataLoader workers, multiprocessing): compiling is deterministic.
        return (_unpickle_program, (self.source, self.name, self.defaults))

    def __copy__(self) -> Program:
        return self  # immutable: with_params makes a new one

    def __deepcopy__(self, memo: dict[int, Any]) -> Program:
        return self

    @property
    def source(self) -> str:
        return self._native.source

    @property
    def name(self) -> str:
        return self._native.name

    @property
    def parameters(self) -> list[Parameter]:
        """The declared parameters, in declaration order (``has_default`` also counts
        defaults bound with :meth:`with_params`)."""
        return [
            Parameter(n, a, d or n in self._defaults) for n, a, d in self._native.params
        ]

    @property
    def defaults(self) -> dict[str, int | list[int]]:
        """Parameter values bound by :func:`builtin` or :meth:`with_params`."""
        return {k: (list(v) if isinstance(v, list) else v) for k, v in self._defaults.items()}

    @property
    def warnings(self) -> list[_native.Diagnostic]:
        return list(self._native.warnings)

    @property
    def uses_batch(self) -> bool:
        """Whether the mask reads the batch index ``b`` (see :attr:`reads_batch`)."""
        return self._native.uses_batch

    @property
    def uses_head(self) -> bool:
        """Whether the mask reads the head index ``h`` (see :attr:`reads_num_heads`)."""
        return self._native.uses_head

    @property
    def reads_batch(self) -> bool:
        """Whether the program reads the length ``batch``: its plans then hold only for the
        batch they were made for (:attr:`Plan.uses_batch`)."""
        return self._native.reads_batch

    @property
    def reads_num_heads(self) -> bool:
        """Whether the program reads the length ``num_heads``: its plans then hold only for
        the heads they were made for (:attr:`Plan.uses_head`), and a serving step needs
        ``plan_step(..., num_heads=)``."""
        return self._native.reads_num_heads

    @property
    def uses_elementwise(self) -> bool:
        """Whether part of the mask is evaluated pair by pair (``elementwise(...)``)."""
        return self._native.uses_elementwise

    def _check_names(self, params: Mapping[str, Any]) -> None:
        declared = [n for n, _, _ in self._native.params]
        for name in params:
            _source_text("a parameter name", name)
            if name not in declared:
                listed = ", ".join(declared) if declared else "none"
                raise _plan_error(
                    "CM0309",
                    f"unknown parameter `{name}` of mask `{self.name}`",
                    f"its parameters: {listed}",
                )

    def _given(self, params: Mapping[str, Any]) -> dict[str, int | list[int]]:
        """The given parameters, checked and read once into ints and lists of ints."""
        self._check_names(params)
        return {k: _param_value(k, v) for k, v in params.items()}

    def _params(self, params: Mapping[str, Any]) -> dict[str, int | list[int]]:
        return {**self._defaults, **self._given(params)}

    def with_params(self, params: Mapping[str, ParamValue] | None = None, /,
                    **kwargs: ParamValue) -> Program:
        """A copy of this program with new parameter defaults (a mapping, keywords, or
        both). Use the mapping form for parameters named like an argument of :meth:`plan`."""
        if params is not None and not isinstance(params, Mapping):
            raise TypeError(
                "with_params: params must be a mapping of parameter names to values (a dict), "
                f"got {_type_name(params)}"
            )
        given = dict(params or {})
        given.update(kwargs)
        values = self._params(given)
        # A list for an integer parameter fails at every plan, so it fails here, where it
        # was given, as planning would (CM0308; a one-element list is that integer).
        for name, is_array, _ in self._native.params:
            value = values.get(name) if name in given else None
            if not is_array and isinstance(value, list) and len(value) != 1:
                raise _plan_error("CM0308", f"parameter `{name}` is an integer, got a list")
        return Program(self._native, values)

    def plan(
        self,
        q_len: int | None = None,
        kv_len: int | None = None,
        batch: int | None = None,
        num_heads: int | None = None,
        *,
        block_size: int | tuple[int, int] = 128,
        order: OrderRequest = None,
        cu_seqlens_q: Any = None,
        cu_seqlens_k: Any = None,
        **params: ParamValue,
    ) -> Plan:
        """Plans the program: binds lengths and parameters, solves every row, classifies
        the ``block_size`` tiles (default 128 x 128) and builds their transposes. Fast (the
        GIL is released) and with no recompilation, so call it per batch with new
        ``lengths=[...]``.

        ``order`` plans the mask in a token order (queries and keys permuted together, so
        ``kv_len`` must equal ``q_len``): ``None`` / ``"raster"`` (the program's own
        positions), ``"auto"`` (the patch order of the mask's first grid with the fewest
        computed pairs at ``block_size``, raster included; :attr:`Plan.order_candidates`
        lists every candidate), or a permutation of ``range(q_len)`` where new position
        ``i`` holds original token ``order[i]``. Run attention on tensors permuted with
        :func:`compilemask.permute` and map the result back with
        :func:`compilemask.unpermute`.

        ``kv_len`` defaults to ``q_len`` (positions are absolute: top-left aligned);
        ``batch`` and ``num_heads`` (default 1) only matter for masks that read ``b`` or
        ``h``. ``params`` override the program's defaults: an int, or a list of ints for
        array parameters (numpy arrays and torch tensors are accepted too).

        **Packed samples** (FlashAttention's varlen form): instead of ``q_len``, give
        ``cu_seqlens_q`` (and ``cu_seqlens_k``, default ``cu_seqlens_q``): the prefix sums of
        the samples' query (key) lengths, ``batch + 1`` ints from 0, as a list or an int32 /
        int64 tensor. Each sample's positions start at 0 and the mask is applied per sample
        (``b`` is the sample index, ``batch`` the number of samples); the plan is one batch
        of ``cu_seqlens_q[-1]`` packed rows over ``cu_seqlens_k[-1]`` keys, in which no row
        sees another sample's keys. :func:`compilemask.attention` takes it with the varlen
        layout ``[total, heads, head_dim]``. ``num_heads`` matters only for masks that read
        ``h``; ``kv_len``, ``batch`` and ``order`` cannot be combined with a packing.

        Raises :class:`PlanError` (a ``ValueError``) with the rendered diagnostic (CM0409 for
        offsets that are not ``batch + 1`` non-decreasing prefix sums from 0, CM0410 for a
        token order with a packing).
        """
        bm, bn = _block_size(block_size)
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            if cu_seqlens_q is None:
                raise TypeError("cu_seqlens_k needs cu_seqlens_q")
            given = [n for n, v in (("q_len", q_len), ("kv_len", kv_len), ("batch", batch))
                     if v is not None]
            if given:
                raise TypeError(
                    f"plan(cu_seqlens_q=...) takes its lengths and batch from the offsets; "
                    f"do not also pass {', '.join(given)}"
                )
            cu_q = _offsets("cu_seqlens_q", cu_seqlens_q)
            cu_k = cu_q if cu_seqlens_k is None else _offsets("cu_seqlens_k", cu_seqlens_k)
            heads = 1 if num_heads is None else _length("num_heads", num_heads)
            given = self._given(params)
            order_v = _order_value(order, cu_q[-1] if cu_q else 0)
            native = self._native.plan_packed(cu_q, cu_k, heads, bm, bn,
                                              {**self._defaults, **given}, order_v)
            _warn(native)
            # Pickling re-plans from the values planned with, read once here (an iterator
            # is used up, and a list may change after this call).
            return Plan(native, self, ((), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                num_heads=heads, block_size=(bm, bn),
                                                order=order_v, **given)))
        if q_len is None:
            raise TypeError("plan() needs q_len (or cu_seqlens_q for packed samples)")
        rows = _length("q_len", q_len)
        lengths = (rows, None if kv_len is None else _length("kv_len", kv_len),
                   1 if batch is None else _length("batch", batch),
                   1 if num_heads is None else _length("num_heads", num_heads))
        given = self._given(params)
        order_v = _order_value(order, rows)
        native = self._native.plan(*lengths, bm, bn, {**self._defaults, **given}, order_v)
        _warn(native)
        return Plan(native, self, (lengths, dict(block_size=(bm, bn), order=order_v, **given)))

    def plan_step(
        self,
        q_len: int | Sequence[int],
        kv_len: Sequence[int],
        *,
        num_heads: int | None = None,
        params: Sequence[Mapping[str, ParamValue]] | None = None,
        **shared: ParamValue,
    ) -> Step:
        """Plans a serving step over a paged KV cache: sequence ``s`` has ``q_len[s]`` new
        query rows (an int: the same for every sequence; 1 for decode, a draft tree's size,
        or a prefill chunk) over ``kv_len[s] >= q_len[s]`` keys, the new tokens included (their
        K / V are written into the cache before the step runs, as in vLLM and FlashInfer).
        New row ``i`` of sequence ``s`` is the logical position ``kv_len[s] - q_len[s] + i``
        and holds the program's visible keys there, the program bound at ``q_len = kv_len =
        kv_len[s]`` with batch index ``b = s``; only the new rows are planned, never the cached
        prefix. Keyword parameters (and the program's defaults) apply to every sequence;
        ``params[s]`` (a list of dicts, one per sequence) to sequence ``s`` over them, e.g.
        each sequence's speculative tree (``builtin("tree_decode")``'s ``parents``).
        ``num_heads`` is only what a program reading ``num_heads`` sees: one mask serves every
        head (a mask that reads ``h`` is refused, as is one with a ``score`` or ``sink``). A
        program that reads it needs it given (``ValueError`` without), and
        :func:`compilemask.paged_attention` refuses a ``q`` of other heads with the step.

        Returns a :class:`Step`; :meth:`Step.append` plans the next decode step and
        :func:`compilemask.paged_attention` runs it. Raises :class:`PlanError` for a
        sequence whose binding or rows fail (the message names it), ``ValueError`` for
        lengths that break the step's contract (``q_len < 1``, ``q_len > kv_len``).
        """
        from ._serve import plan_step

        return plan_step(self, q_len, kv_len, num_heads, params, shared)

    def brute_force_row(
        self,
        q: int,
        q_len: int,
        kv_len: int | None = None,
        batch: int | None = None,
        num_heads: int | None = None,
        *,
        b: int = 0,
        h: int = 0,
        **params: ParamValue,
    ) -> list[tuple[int, int]]:
        """Row ``q``'s visible intervals by the pairwise semantics, testing every key:
        O(kv_len), for tests and spot checks of :meth:`Plan.intervals`."""
        return list(
            self._native.brute_force_row(
                _index("q", q), _length("q_len", q_len),
                None if kv_len is None else _length("kv_len", kv_len),
                1 if batch is None else _length("batch", batch),
                1 if num_heads is None else _length("num_heads", num_heads),
                _index("b", b), _index("h", h), self._params(params),
            )
        )

    def __repr__(self) -> str:
        names = ", ".join(n for n, _, _ in self._native.params)
        return f"Program({self.name!r}, params=[{names}])"


def _ints(raw: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(raw)
    return a.tolist()


def _reshape(flat: list[Any], cols: int) -> list[list[Any]]:
    return [flat[i:i + cols] for i in range(0, len(flat), cols)]


def _import_numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class Plan:
    """A planned mask: the exact row intervals of every distinct (batch, head) mask, the
    tile descriptor at ``block_size``, statistics and exports.

    Statistics sum over every (b, h) of the plan, as the CLI's ``plan --json`` does. A plan
    made by :meth:`Program.plan` pickles as its program and plan arguments and is planned
    again when loaded; its :class:`PlanTensors` pickle as tensors.
    """

    __slots__ = ("_native", "_program", "_cache", "_recipe", "__weakref__")

    def __init__(self, native: _native.Plan, program: Program,
                 recipe: tuple[tuple[Any, ...], dict[str, Any]] | None = None):
        self._native = native
        self._program = program
        self._cache: dict[Any, Any] = {}
        # The arguments of Program.plan that made it (None for a plan made otherwise: a
        # context-parallel part), from which pickling re-plans.
        self._recipe = recipe

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as its program and the arguments that planned it, and planned again on
        # loading (planning is deterministic): the native plan itself has no byte form.
        if self._recipe is None:
            raise TypeError(
                f"this plan of {self._program.name!r} was not made by Program.plan (a "
                "context-parallel part), so it cannot be planned again from a pickle; pickle "
                "its PlanTensors (plan.to_tensors()) or what made it")
        return (_unpickle_plan, (self._program, *self._recipe))

    def __copy__(self) -> Plan:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, Any]) -> Plan:
        return self

    # ------------------------------------------------------------------ statistics
    @property
    def program(self) -> Program:
        return self._program

    @property
    def q_len(self) -> int:
        return self._native.q_len

    @property
    def kv_len(self) -> int:
        return self._native.kv_len

    @property
    def batch(self) -> int:
        return self._native.batch

    @property
    def num_heads(self) -> int:
        return self._native.num_heads

    @property
    def cu_seqlens_q(self) -> list[int] | None:
        """The query offsets of a packed plan (``batch + 1`` ints from 0), else ``None``.
        Sample ``b`` owns packed rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``."""
        return self._native.cu_seqlens_q

    @property
    def cu_seqlens_k(self) -> list[int] | None:
        """The key offsets of a packed plan, else ``None``."""
        return self._native.cu_seqlens_k

    @property
    def is_packed(self) -> bool:
        """Whether the plan was made for packed samples (``cu_seqlens_q=...``)."""
        return self._native.cu_seqlens_q is not None

    @property
    def block_size(self) -> tuple[int, int]:
        """``(block_m, block_n)``: query rows by keys per tile."""
        return self._native.block_size

    @property
    def visible_pairs(self) -> int:
        """Visible (q, k) pairs, summed over every (b, h)."""
        return self._native.visible_pairs

    @property
    def empty_rows(self) -> int:
        """Rows with no visible key (their attention output is 0), summed over (b, h)."""
        return self._native.empty_rows

    @property
    def max_intervals_per_row(self) -> int:
        return self._native.max_intervals_per_row

    @property
    def tiles(self) -> dict[str, int]:
        """``{"full", "partial", "empty"}`` tile counts at ``block_size``."""
        return self._native.tiles

    @property
    def computed_pairs(self) -> int:
        """In-range pairs inside full and partial tiles: the work a tile kernel does."""
        return self._native.computed_pairs

    @property
    def descriptor_bytes(self) -> int:
        """Bytes of everything a kernel reads for this plan."""
        return self._native.descriptor_bytes

    @property
    def elementwise_pairs(self) -> int:
        """Pairs evaluated one by one in ``elementwise(...)`` regions (0: all analytical)."""
        return self._native.elementwise_pairs

    @property
    def num_masks(self) -> int:
        """Distinct masks (1 unless the mask reads ``b`` or ``h`` and they differ)."""
        return self._native.num_masks

    @property
    def mask_index(self) -> list[int]:
        """``[batch * num_heads]`` row-major: the distinct mask each (b, h) uses."""
        return self._native.mask_index

    @property
    def uses_batch(self) -> bool:
        """Whether the masks depend on the batch (read ``b`` or ``batch``): a plan of batch 1
        that does not applies to every batch of the tensors."""
        return self._native.uses_batch

    @property
    def uses_head(self) -> bool:
        """Whether the masks depend on the heads (read ``h`` or ``num_heads``): a plan of one
        head that does not applies to every head."""
        return self._native.uses_head

    @property
    def compile_ms(self) -> float:
        """Wall time of planning, in milliseconds."""
        return self._native.compile_ms

    # ------------------------------------------------------------------ token order
    @property
    def order(self) -> Any:
        """The token order the masks are planned in: new position ``i`` holds original token
        ``order[i]``. An int64 tensor of ``q_len`` entries when torch is installed (a list of
        ints without it); ``None`` when the plan is in the program's own positions (raster).
        See :func:`compilemask.permute`."""
        # Read from the native plan once (it copies the order and checks it against the
        # identity each time): permute and unpermute ask on every call.
        if "order" in self._cache:
            return self._cache["order"]
        raw = self._native.order
        cached = None
        if raw is not None:
            from ._torch import torch_or_none

            torch = torch_or_none()
            if torch is None:
                a = array.array("I")
                a.frombytes(raw)
                cached = a.tolist()
            else:
                cached = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64) \
                    if raw else torch.zeros(0, dtype=torch.int64)
        self._cache["order"] = cached
        return cached

    @property
    def order_candidates(self) -> list[dict[str, Any]]:
        """With ``order="auto"``: every candidate order, fewest computed pairs first, as
        ``{"patch": (frames, rows, columns), "traversal": "rowmajor" | "boustrophedon" |
        "hilbert", "computed_pairs": n, "tile_density": visible / computed}`` (a patch side
        of ``None`` spans the whole grid, so ``(1, 1, None)`` is raster order). Empty for
        other orders. Densities are of the (0, 0) mask."""
        visible = self._native.pairs_00[0]
        return [
            {"patch": patch, "traversal": traversal, "computed_pairs": computed,
             "tile_density": visible / max(computed, 1)}
            for patch, traversal, computed in self._native.order_candidates
        ]

    @property
    def raster_computed_pairs(self) -> int:
        """Computed pairs of the (0, 0) mask in the program's own positions (raster order),
        for comparison with :attr:`computed_pairs` of a plan in another order."""
        return self._native.raster_computed_pairs

    @property
    def tile_density(self) -> float:
        """``visible_pairs / computed_pairs``: the fraction of the pairs a tile kernel
        computes that are visible (1.0 when every non-empty tile is full)."""
        return self.visible_pairs / max(self.computed_pairs, 1)

    def order_info(self) -> dict[str, Any] | None:
        """The ``order`` object of ``compilemask plan --json``: ``patch``, ``traversal``
        (``None`` for an explicit permutation), ``raster_computed_pairs``,
        ``tile_density_before`` (raster) and ``tile_density_after`` (this order) of the (0, 0)
        mask, and ``candidates`` (:attr:`order_candidates`). ``None`` for a plan made without
        ``order``. An ``order="auto"`` that chose raster order reports it (patch ``(1, 1,
        width)``, row-major, with the candidates it beat), as does an explicit identity
        (``traversal`` ``None``), although :attr:`order` is ``None`` for both: the plan is a
        raster plan."""
        if not self._native.in_order:
            return None
        visible, computed = self._native.pairs_00
        return {
            "patch": self._native.order_patch,
            "traversal": self._native.order_traversal,
            "raster_computed_pairs": self.raster_computed_pairs,
            "tile_density_before": visible / max(self.raster_computed_pairs, 1),
            "tile_density_after": visible / max(computed, 1),
            "candidates": self.order_candidates,
        }

    def stats(self) -> dict[str, Any]:
        """The fields of ``compilemask plan --json`` (with ``score`` for a program with score
        terms, and ``order`` for a plan in a token order, see :meth:`order_info`)."""
        out: dict[str, Any] = {
            "mask": self._program.name,
            "q_len": self.q_len,
            "kv_len": self.kv_len,
            "batch": self.batch,
            "num_heads": self.num_heads,
            "tile": list(self.block_size),
            "visible_pairs": self.visible_pairs,
            "empty_rows": self.empty_rows,
            "max_intervals_per_row": self.max_intervals_per_row,
            "tiles": self.tiles,
            "computed_pairs": self.computed_pairs,
            "descriptor_bytes": self.descriptor_bytes,
            "distinct_masks": self.num_masks,
            "pieces": self._native.pieces,
            "elementwise_pairs": self.elementwise_pairs,
            "compile_ms": self.compile_ms,
        }
        cu_q = self.cu_seqlens_q
        if cu_q is not None:
            out["samples"] = len(cu_q) - 1
            out["cu_seqlens_q"] = cu_q
            out["cu_seqlens_k"] = self.cu_seqlens_k
        terms = _native.score_terms(self._native)
        if terms is not None:
            out["score"] = _score_stats(terms)
        info = self.order_info()
        if info is not None:
            out["order"] = info
        return out

    def __repr__(self) -> str:
        return (
            f"Plan({self._program.name!r}, q_len={self.q_len}, kv_len={self.kv_len}, "
            f"batch={self.batch}, num_heads={self.num_heads}, "
            + (f"cu_seqlens_q={self.cu_seqlens_q}, cu_seqlens_k={self.cu_seqlens_k}, "
               if self.is_packed else "")
            + f"visible_pairs={self.visible_pairs}, tiles={self.tiles}, "
            f"block_size={self.block_size})"
        )

    # ------------------------------------------------------------------ intervals
    def intervals(self, q: int, b: int = 0, h: int = 0) -> list[tuple[int, int]]:
        """Row ``q``'s visible keys as sorted, disjoint, maximal ``[start, end)`` pairs."""
        return self._native.intervals(_index("q", q, self.q_len), _index("b", b, self.batch),
                                      _index("h", h, self.num_heads))

    def rows(self, start: int = 0, stop: int | None = None, b: int = 0,
             h: int = 0) -> list[list[tuple[int, int]]]:
        """:meth:`intervals` of rows ``start .. stop - 1`` (default: every row)."""
        return self._native.rows(
            _index("start", start), self.q_len if stop is None else _index("stop", stop),
            _index("b", b), _index("h", h),
        )

    def mask_id(self, b: int = 0, h: int = 0) -> int:
        """Index of the distinct mask that (b, h) uses."""
        return self._native.mask_id(_index("b", b, self.batch), _index("h", h, self.num_heads))

    def _one(self, b: int | None, h: int | None, what: str) -> tuple[int, int]:
        if b is None and h is None:
            if self.num_masks != 1:
                raise ValueError(
                    f"this plan has {self.num_masks} distinct masks (the mask reads b or h); "
                    f"pass b= and h= to {what}"
                )
            return 0, 0
        if b is None or h is None:
            raise ValueError(f"{what}: give both b and h, or neither")
        return b, h

    def _firsts(self) -> list[tuple[int, int]]:
        """A (b, h) using each distinct mask, by mask id."""
        first: dict[int, tuple[int, int]] = {}
        for i, m in enumerate(self.mask_index):
            first.setdefault(m, divmod(i, self.num_heads))
        return [first[m] for m in range(self.num_masks)]

    # ------------------------------------------------------------------ pictures
    def to_image(self, format: Literal["png", "svg"] = "png", *, b: int = 0, h: int = 0,
                 rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> bytes:
        """The mask of (``b``, ``h``) drawn as a picture: PNG bytes, or an SVG document as
        UTF-8 bytes. The figure has a title (mask, lengths, visible fraction), axes with
        token indices, the tile grid where legible, the program's segments, parts and
        grids, and a legend; ``rows`` / ``cols`` = ``(start, stop)`` (half-open) zoom in.
        Drawn from the plan's intervals and tiles, so a long mask costs no dense array.
        Raises ``IndexError`` for a view outside the plan."""
        if not isinstance(format, str):
            raise TypeError(f'format must be "png" or "svg", got {_type_name(format)} '
                            f"{format!r}")
        return self._native.image(format, _index("b", b), _index("h", h), _span("rows", rows),
                                  _span("cols", cols))

    def show(self, *, b: int = 0, h: int = 0, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> MaskImage:
        """:meth:`to_image` as an object that notebooks display (``_repr_png_``) and that
        :meth:`MaskImage.save` writes to a ``.png`` or ``.svg`` file."""
        return MaskImage(self, _index("b", b), _index("h", h), _span("rows", rows),
                         _span("cols", cols))

    # ------------------------------------------------------------------ exports
    def to_dense(self, b: int | None = None, h: int | None = None, *,
                 format: DenseFormat = "auto") -> Any:
        """The dense boolean mask (True = visible), for SDPA's ``attn_mask`` or checks.

        With ``b`` and ``h``: ``[q_len, kv_len]`` for that (batch, head). Without:
        ``[batch, num_heads, q_len, kv_len]`` over the plan's batch and heads (1 x 1 by
        default, which broadcasts). ``format``: ``"torch"`` (a ``torch.bool`` tensor),
        ``"numpy"``, ``"list"`` (nested lists of bools; rows may be shared between (b, h),
        treat them as read-only), or ``"auto"``: torch if importable, else numpy, else
        lists. Refused (:class:`PlanError` CM0403) above ``DENSE_LIMIT`` elements.
        Visibility only: score terms (softcap, biases, sinks) are not part of it (SDPA with
        this mask computes plain attention; see :meth:`score_mod`).
        """
        fmt = format
        if fmt == "auto":
            from ._torch import torch_or_none

            fmt = "torch" if torch_or_none() is not None else (
                "numpy" if _import_numpy() is not None else "list")
        if fmt not in ("torch", "numpy", "list"):
            raise ValueError(f"format must be 'auto', 'torch', 'numpy' or 'list', got {format!r}")
        q_len, kv_len = self.q_len, self.kv_len
        if b is not None or h is not None:
            b, h = self._one(b, h, "to_dense")
            return _dense_array(self._native.dense(b, h), q_len, kv_len, fmt)
        masks = [_dense_array(self._native.dense(bb, hh), q_len, kv_len, fmt)
                 for bb, hh in self._firsts()]
        shape = (self.batch, self.num_heads, q_len, kv_len)
        total = self.batch * self.num_heads * q_len * kv_len
        if fmt == "torch":
            from ._torch import require_torch

            torch = require_torch("Plan.to_dense")
            if len(masks) == 1:
                return masks[0].expand(shape)
            _check_total(total)
            index = torch.tensor(self.mask_index, dtype=torch.long)
            return torch.stack(masks)[index].view(shape)
        if fmt == "numpy":
            np = _import_numpy()
            if len(masks) == 1:
                return np.broadcast_to(masks[0], shape)
            _check_total(total)
            return np.stack(masks)[np.asarray(self.mask_index)].reshape(shape)
        idx = self.mask_index
        return [[masks[idx[bb * self.num_heads + hh]] for hh in range(self.num_heads)]
                for bb in range(self.batch)]

    def block_tensors(self, b: int | None = None, h: int | None = None) -> dict[str, Any]:
        """FlexAttention ``BlockMask`` tables as plain lists, with Flex's names and layout:
        ``kv_num_blocks`` ``[M]``, ``kv_indices`` ``[M][N]`` (partial blocks, Flex's "mask"
        blocks: each row lists the counted blocks ascending, then the rest),
        ``full_kv_num_blocks``, ``full_kv_indices``, and the transposes ``q_num_blocks``
        ``[N]``, ``q_indices`` ``[N][M]``, ``full_q_*``; plus ``block_size`` and
        ``seq_lengths``. With ``b`` and ``h``, for that (b, h); without, every table gets
        leading ``[batch][num_heads]`` dimensions. Visibility only: score terms are not
        part of it (see :meth:`score_mod`)."""
        if b is not None or h is not None:
            b, h = self._one(b, h, "block_tensors")
            return _block_tables(self._native.flex_block_mask(b, h))
        per_mask = [_block_tables(self._native.flex_block_mask(bb, hh))
                    for bb, hh in self._firsts()]
        out: dict[str, Any] = {
            "block_size": per_mask[0]["block_size"],
            "seq_lengths": per_mask[0]["seq_lengths"],
        }
        idx = self.mask_index
        for key in _BLOCK_KEYS:
            out[key] = [[per_mask[idx[bb * self.num_heads + hh]][key]
                         for hh in range(self.num_heads)] for bb in range(self.batch)]
        return out

    def to_cudnn_endpoints(self, b: int | None = None, h: int | None = None) -> dict[str, Any]:
        """cuDNN ``flex_attention`` interval endpoints: ``{"nfunc": n, "endpoints": E}``
        with ``E`` a ``[nfunc][q_len]`` list; row q sees ``[0, E[0][q]) U [E[1][q],
        E[2][q]) U ...``. ``b``/``h`` are needed when the plan has several masks.
        Visibility only: score terms (softcap, biases, sinks) are not part of it."""
        b, h = self._one(b, h, "to_cudnn_endpoints")
        nfunc, raw = self._native.cudnn_endpoints(b, h)
        return {"nfunc": nfunc, "endpoints": _reshape(_ints(raw), self.q_len)}

    def to_flashmask(self, b: int | None = None, h: int | None = None) -> dict[str, list[int]]:
        """FlashMask column bounds ``{"lts", "lte", "uts", "ute"}`` (each ``[kv_len]``): key
        column k is masked for rows ``[lts[k], lte[k])`` and ``[uts[k], ute[k])``.
        :class:`PlanError` (CM0408) when some column has more than two masked runs.
        Visibility only: score terms (softcap, biases, sinks) are not part of it."""
        b, h = self._one(b, h, "to_flashmask")
        raw = self._native.flashmask_bounds(b, h)
        return {k: _ints(v) for k, v in raw.items()}

    def interval_arrays(self) -> tuple[list[int], list[tuple[int, int]]]:
        """Every distinct mask's CSR row intervals, concatenated: ``row_ptr`` (flat
        ``num_masks * (q_len + 1)`` offsets into ``intervals``) and ``intervals``."""
        row_ptr, flat = self._native.interval_arrays()
        ivs = _ints(flat)
        return _ints(row_ptr), list(zip(ivs[0::2], ivs[1::2]))

    # ------------------------------------------------------------------ torch
    def to_tensors(self, device: Any = None) -> PlanTensors:
        """The plan as int32 tensors on ``device`` (default CPU), cached per device: what
        :func:`compilemask.attention` takes, and what to pass under ``torch.compile``. On a
        CUDA device this also builds and uploads the CUDA kernels' tile descriptor (once;
        every later call returns the cached tensors)."""
        from ._torch import plan_tensors

        return plan_tensors(self, device)

    def mask_mod(self, device: Any = None) -> Any:
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` that evaluates this plan's row
        intervals from tensors on ``device`` (so ``create_block_mask(plan.mask_mod(), ...)``
        and :meth:`to_block_mask` agree). Pairs with ``q_idx`` outside ``[0, q_len)`` or
        ``kv_idx`` outside ``[0, kv_len)`` are False. A plan of batch 1 (one head) whose mask
        does not read ``b`` (``h``) answers for every ``b`` (``h``), as :func:`attention`
        broadcasts it; an index the mask reads (and a packed plan's ``b``) outside the plan's
        batch (heads) fails with torch's ``IndexError``."""
        from ._torch import make_mask_mod

        return make_mask_mod(self, device)

    def score_mod(self, score_tensors: Mapping[str, Any] | None = None,
                  device: Any = None) -> Any:
        """The FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` of this plan's score
        terms (docs/language.md, "Scores"): the softcap, then the linear bias, then the bias
        table (from ``score_tensors`` by name), so ``flex_attention(q, k, v,
        score_mod=plan.score_mod(tensors), block_mask=plan.to_block_mask())`` computes what
        :func:`compilemask.attention` does, sinks aside: a sink is not a score_mod (it joins
        every row's denominator; from Flex's ``lse``, ``lse' = logaddexp(lse, sink[h])`` and
        ``out' = out * exp(lse - lse')``). Needs torch."""
        from ._torch import make_score_mod

        return make_score_mod(self, score_tensors, device)

    def to_block_mask(self, device: Any = None) -> BlockMask:
        """A ``torch.nn.attention.flex_attention.BlockMask`` built from this plan's tile
        descriptor (``BlockMask.from_kv_blocks``) with a matching :meth:`mask_mod`, at this
        plan's ``block_size``, for ``flex_attention``. Needs torch. On CPU, compile with
        ``torch.compile(flex_attention, dynamic=False)``: torch 2.11's Inductor CPU template
        fails to build the dynamic-shape recompile of any ``mask_mod`` that reads a captured
        tensor (a C++ compile error; torch's own document masks too). Visibility only: pass
        :meth:`score_mod` beside it for the score terms (sinks: see :meth:`score_mod`)."""
        from ._torch import make_block_mask

        return make_block_mask(self, device)


def _score_stats(terms: dict[str, Any]) -> dict[str, Any]:
    """The ``score`` object of ``compilemask plan --json`` from the native score terms."""
    table = terms["table"]
    if table is not None:
        table = {key: table[key]
                 for key in ("tensor", "shape", "num_buckets", "per_head", "buckets_read")}
    return {
        "softcap": terms["softcap"],
        "linear": terms["linear"],
        "table": table,
        "sink": terms["sink"],
        "reads_positions": terms["reads_positions"],
    }


_BLOCK_KEYS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)


def _block_tables(raw: dict[str, Any]) -> dict[str, Any]:
    m, n = raw["num_m_blocks"], raw["num_n_blocks"]
    out: dict[str, Any] = {
        "block_size": tuple(raw["block_size"]),
        "seq_lengths": tuple(raw["seq_lengths"]),
    }
    for key in _BLOCK_KEYS:
        flat = _ints(raw[key])
        if key.endswith("indices"):
            out[key] = _reshape(flat, n if key.endswith("kv_indices") else m)
        else:
            out[key] = flat
    return out


def _check_total(total: int) -> None:
    if total > _native.DENSE_LIMIT:
        raise _plan_error(
            "CM0403",
            f"a dense [batch, num_heads, q_len, kv_len] mask of {total} elements exceeds the "
            f"limit of {_native.DENSE_LIMIT}",
            "pass b= and h= for one (batch, head), or use the interval or block forms",
        )


def _dense_array(raw: bytes, q_len: int, kv_len: int, fmt: str) -> Any:
    if fmt == "torch":
        from ._torch import require_torch

        torch = require_torch("Plan.to_dense")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(q_len, kv_len).bool()
    if fmt == "numpy":
        np = _import_numpy()
        if np is None:
            raise ImportError("Plan.to_dense(format='numpy') needs numpy (pip install numpy)")
        return np.frombuffer(raw, dtype=np.uint8).reshape(q_len, kv_len).astype(bool)
    return [[x == 1 for x in raw[i * kv_len:(i + 1) * kv_len]] for i in range(q_len)]


class MaskImage:
    """A picture of one plan's mask (from :meth:`Plan.show`); Jupyter shows it inline."""

    __slots__ = ("_plan", "_view")

    def __init__(self, plan: Plan, b: int, h: int, rows: tuple[int, int] | None,
                 cols: tuple[int, int] | None):
        self._plan = plan
        self._view = {"b": b, "h": h, "rows": rows, "cols": cols}
        plan.to_image("svg", **self._view)  # refuse a bad view now, not when displayed

    @property
    def png(self) -> bytes:
        return self._plan.to_image("png", **self._view)

    @property
    def svg(self) -> str:
        return self._plan.to_image("svg", **self._view).decode("utf-8")

    def _repr_png_(self) -> bytes:
        return self.png

    def save(self, path: Any) -> None:
        """Writes the picture to ``path``: PNG or SVG by its extension (``.png`` /
        ``.svg``, any case); ``ValueError`` for another one."""
        import os

        ext = os.path.splitext(os.fsdecode(path))[1].lower()
        if ext not in (".png", ".svg"):
            raise ValueError(f"MaskImage.save: {path!r} must end in .png or .svg")
        with open(path, "wb") as f:
            f.write(self._plan.to_image(ext[1:], **self._view))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<MaskImage of {self._plan!r}>"
