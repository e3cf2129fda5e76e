"""Type stubs of the extension module `compilemask._native` (private; use `compilemask`)."""

from typing import Any, Sequence

__version__: str
DENSE_LIMIT: int
LENGTH_MAX: dict[str, int]

class MaskSyntaxError(ValueError):
    """A mask program failed to parse or check; the message is the rendered diagnostics."""

    diagnostics: list[Diagnostic]
    rendered: str

class PlanError(ValueError):
    """Planning or an export failed; the message is the rendered diagnostic."""

    code: str
    hint: str | None
    diagnostics: list[Diagnostic]
    rendered: str

class Diagnostic:
    """One diagnostic: stable code, severity, message, span (1-based line / column and
    0-based byte offsets) and hint."""

    @property
    def code(self) -> str: ...
    @property
    def severity(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def hint(self) -> str | None: ...
    @property
    def line(self) -> int: ...
    @property
    def column(self) -> int: ...
    @property
    def end_line(self) -> int: ...
    @property
    def end_column(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...

class Program:
    @property
    def source(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def params(self) -> list[tuple[str, bool, bool]]: ...
    @property
    def warnings(self) -> list[Diagnostic]: ...
    @property
    def uses_batch(self) -> bool: ...
    @property
    def uses_head(self) -> bool: ...
    @property
    def uses_elementwise(self) -> bool: ...
    def render_warnings(self) -> str: ...
    def plan(
        self,
        q_len: int,
        kv_len: int | None = None,
        batch: int = 1,
        num_heads: int = 1,
        block_m: int = 128,
        block_n: int = 128,
        params: dict[str, int | list[int]] | None = None,
        order: str | Sequence[int] | None = None,
    ) -> Plan: ...
    def plan_step(
        self,
        q_len: list[int],
        kv_len: list[int],
        num_heads: int = 1,
        params: dict[str, int | list[int]] | None = None,
        seq_params: list[dict[str, int | list[int]]] | None = None,
    ) -> Step: ...
    def plan_packed(
        self,
        cu_seqlens_q: list[int],
        cu_seqlens_k: list[int] | None = None,
        num_heads: int = 1,
        block_m: int = 128,
        block_n: int = 128,
        params: dict[str, int | list[int]] | None = None,
        order: str | Sequence[int] | None = None,
    ) -> Plan: ...
    def brute_force_row(
        self,
        q: int,
        q_len: int,
        kv_len: int | None = None,
        batch: int = 1,
        num_heads: int = 1,
        b: int = 0,
        h: int = 0,
        params: dict[str, int | list[int]] | None = None,
    ) -> list[tuple[int, int]]: ...

class Plan:
    @property
    def q_len(self) -> int: ...
    @property
    def kv_len(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def cu_seqlens_q(self) -> list[int] | None: ...
    @property
    def cu_seqlens_k(self) -> list[int] | None: ...
    @property
    def block_size(self) -> tuple[int, int]: ...
    @property
    def visible_pairs(self) -> int: ...
    @property
    def empty_rows(self) -> int: ...
    @property
    def max_intervals_per_row(self) -> int: ...
    @property
    def tiles(self) -> dict[str, int]: ...
    @property
    def computed_pairs(self) -> int: ...
    @property
    def descriptor_bytes(self) -> int: ...
    @property
    def elementwise_pairs(self) -> int: ...
    @property
    def pieces(self) -> int: ...
    @property
    def num_masks(self) -> int: ...
    @property
    def mask_index(self) -> list[int]: ...
    @property
    def uses_batch(self) -> bool: ...
    @property
    def uses_head(self) -> bool: ...
    @property
    def compile_ms(self) -> float: ...
    @property
    def order(self) -> bytes | None: ...
    @property
    def order_patch(self) -> tuple[int | None, int | None, int | None] | None: ...
    @property
    def order_traversal(self) -> str | None: ...
    @property
    def order_candidates(
        self,
    ) -> list[tuple[tuple[int | None, int | None, int | None], str, int]]: ...
    @property
    def pairs_00(self) -> tuple[int, int]: ...
    @property
    def raster_computed_pairs(self) -> int: ...
    def kernel_arrays(self) -> list[bytes]: ...
    def shard(self, ranks: int, chunk: int) -> Sharding: ...

class Sharding:
    @property
    def ranks(self) -> int: ...
    @property
    def chunk(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def order(self) -> bytes: ...
    @property
    def offsets(self) -> list[int]: ...
    @property
    def chunks(self) -> list[list[int]]: ...
    @property
    def work(self) -> list[int]: ...
    def fetched(self, r: int) -> int: ...
    def ring_fetched(self, r: int) -> int: ...
    def computed_pairs(self) -> list[int]: ...
    def keys(self, r: int, s: int) -> list[tuple[int, int]]: ...
    def part_plan(self, r: int, s: int) -> Plan: ...
    def intervals(self, q: int, b: int = 0, h: int = 0) -> list[tuple[int, int]]: ...
    def rows(self, start: int, stop: int, b: int = 0, h: int = 0) -> list[list[tuple[int, int]]]: ...
    def mask_id(self, b: int = 0, h: int = 0) -> int: ...
    def interval_arrays(self) -> tuple[bytes, bytes]: ...
    @property
    def warnings(self) -> list[tuple[Diagnostic, str]]: ...
    def image(self, format: str = "png", b: int = 0, h: int = 0,
              rows: tuple[int, int] | None = None,
              cols: tuple[int, int] | None = None) -> bytes: ...
    def dense(self, b: int = 0, h: int = 0) -> bytes: ...
    def flex_block_mask(self, b: int = 0, h: int = 0) -> dict[str, Any]: ...
    def cudnn_endpoints(self, b: int = 0, h: int = 0) -> tuple[int, bytes]: ...
    def flashmask_bounds(self, b: int = 0, h: int = 0) -> dict[str, bytes]: ...

def compile(source: str, name: str = "<mask>") -> Program: ...
def builtin(name: str) -> Program: ...
def builtins() -> list[tuple[str, str]]: ...
def plan_error(code: str, message: str, hint: str | None = None) -> PlanError: ...
def reference_forward(
    dims: tuple[int, int, int, int, int, int, int],
    q: Any,
    k: Any,
    v: Any,
    row_ptr: Any,
    intervals: Any,
    mask_index: Any,
    scale: float,
    double: bool,
) -> tuple[bytearray, bytearray]: ...
def paged_reference(
    dims: tuple[int, int, int, int, int, int, int],
    q: Any,
    k_cache: Any,
    v_cache: Any,
    block_table: Any,
    step: tuple[Any, Any, Any, Any],
    scale: float,
    double: bool,
) -> tuple[bytearray, bytearray]: ...

class Step:
    @property
    def num_seqs(self) -> int: ...
    @property
    def total_q(self) -> int: ...
    @property
    def num_intervals(self) -> int: ...
    @property
    def caches_pieces(self) -> bool: ...
    def arrays(self) -> tuple[bytes, bytes, bytes, bytes]: ...
    def prefill_arrays(self, row_group: int = 1) -> tuple[list[bytes], bytes, int, bytes, int]: ...
    def row(self, r: int) -> list[tuple[int, int]]: ...
    def append(self, new_tokens: list[int]) -> None: ...
    def replan(
        self, q_len: list[int], kv_len: list[int], params: list[dict[str, Any]] | None = None
    ) -> None: ...

def score_terms(plan: Plan) -> dict[str, Any] | None: ...
def reference_forward_scored(
    dims: tuple[int, int, int, int, int, int, int],
    q: Any,
    k: Any,
    v: Any,
    plan: Plan,
    scale: float,
    double: bool,
    tensors: dict[str, Any] | None = None,
) -> tuple[bytearray, bytearray]: ...
def reference_backward_scored(
    dims: tuple[int, int, int, int, int, int, int],
    q: Any,
    k: Any,
    v: Any,
    dout: Any,
    dlse: Any | None,
    plan: Plan,
    scale: float,
    double: bool,
    tensors: dict[str, Any] | None = None,
) -> tuple[bytearray, bytearray, bytearray, bytearray | None, bytearray | None]: ...
CUDA_PLAN_ARRAYS: list[str]
CUDA_HEAD_DIMS: list[int]

def cuda_kernel_tile() -> tuple[int, int]: ...
def cuda_ws_order(lens: list[int]) -> list[int]: ...
def cuda_dq_turns(lens: list[int]) -> bool: ...
def cuda_workspace_len(
    q_len: int, batch: int, num_heads: int, head_dim: int, deterministic: bool
) -> int: ...
# A tensor as the CUDA entry points take it: (data_ptr, shape, strides in elements, dtype name
# without "torch.", CUDA ordinal or -1); every one is checked before a launch.
_Tensor = tuple[int, tuple[int, ...], tuple[int, ...], str, int]
# A descriptor's arrays: one contiguous int32 tensor holding them back to back, and each
# array's length.
_Arrays = tuple[_Tensor, list[int]]
# A plan's descriptor: (q_len, kv_len, num_masks, (mask_batch, mask_heads), arrays,
# the forward's tile sets best first as cuda_ws_order gave them, the deterministic backward's
# dQ path as cuda_dq_turns gave it).
_Descriptor = tuple[int, int, int, tuple[int, int], _Arrays, list[int], bool]
# The score terms (softcap, slopes, (q_coef, k_coef, offset), dist_bias, dist_per_head,
# dist_run_end, sinks, dist_bias_grad), as cm-py's `ScoreArg`.
_Score = tuple[float, _Tensor | None, tuple[float, float, float], _Tensor | None, bool,
               _Tensor | None, _Tensor | None, _Tensor | None]

def cuda_forward(
    stream: int,
    plan: _Descriptor,
    q: _Tensor,
    k: _Tensor,
    v: _Tensor,
    out: _Tensor,
    lse: _Tensor,
    scale: float,
    score: _Score,
) -> None: ...
def cuda_paged_attention(
    stream: int,
    q: _Tensor,
    k_cache: _Tensor,
    v_cache: _Tensor,
    out: _Tensor,
    lse: _Tensor | None,
    block_table: _Tensor,
    step: tuple[_Tensor, _Tensor, _Tensor, _Tensor],
    max_q_len: int,
    num_splits: int,
    workspace: _Tensor | None,
    scale: float,
) -> None: ...
def cuda_paged_prefill(
    stream: int,
    plan: tuple[int, int, _Arrays],
    q: _Tensor,
    k_cache: _Tensor,
    v_cache: _Tensor,
    out: _Tensor,
    lse: _Tensor | None,
    block_table: _Tensor,
    key_blocks: _Tensor,
    scale: float,
) -> None: ...
def cuda_decode_splits(
    device: int,
    dtype: str,
    head_dim: int,
    num_seqs: int,
    max_q_len: int,
    heads_per_kv_head: int,
    num_kv_heads: int,
    max_kv_len: int,
) -> int: ...
def cuda_decode_workspace_len(num_splits: int, total_q: int, num_heads: int, head_dim: int) -> int: ...
def cuda_backward(
    stream: int,
    plan: _Descriptor,
    q: _Tensor,
    k: _Tensor,
    v: _Tensor,
    out: _Tensor,
    dout: _Tensor,
    lse: _Tensor,
    dlse: _Tensor | None,
    dq: _Tensor,
    dk: _Tensor,
    dv: _Tensor,
    workspace: _Tensor,
    scale: float,
    deterministic: bool,
    score: _Score,
) -> None: ...
def reference_backward(
    dims: tuple[int, int, int, int, int, int, int],
    q: Any,
    k: Any,
    v: Any,
    dout: Any,
    dlse: Any | None,
    row_ptr: Any,
    intervals: Any,
    mask_index: Any,
    scale: float,
    double: bool,
) -> tuple[bytearray, bytearray, bytearray]: ...
