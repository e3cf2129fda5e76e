"""The ``torch.library`` custom ops behind :func:`compilemask.attention`.

Imported on first use only (it imports torch). The plan travels as tensors (``row_ptr``,
``intervals``, ``mask_index`` and, on CUDA, the kernels' descriptor arrays ``kernel``; see
:class:`compilemask.PlanTensors`), so the ops take nothing but tensors and plain values and
work under ``torch.compile``:

- ``compilemask::attention_forward(q, k, v, row_ptr, intervals, mask_index, kernel,
  kernel_lens, plan_dims, scale, deterministic) -> (out, lse)``
- ``compilemask::attention_backward(grad_out, grad_lse, q, k, v, out, lse, row_ptr,
  intervals, mask_index, kernel, kernel_lens, plan_dims, scale, deterministic) -> (dq, dk,
  dv)``

``kernel`` is the plan's CUDA descriptor as one int32 tensor (``PlanTensors.kernel_flat``:
every array of ``PlanTensors.kernel`` back to back, of ``kernel_lens`` elements each; None
off CUDA): one tensor argument instead of twenty, each of which costs host time in torch's
dispatcher and the extension. ``plan_dims`` is ``[num_masks, batch, num_heads,
kernel_dq_turns, *kernel_ws_order]`` of the plan (its mask index's sides, 1 applying to
every batch or head, with which the CUDA kernels find each (batch, head)'s mask in
``kernel``: one launch, one backward sequence, serves the whole plan; then the deterministic
backward's dQ path, ``PlanTensors.kernel_dq_turns``, and the forward's tile sets best first,
``PlanTensors.kernel_ws_order``).

``paged_attention_cuda`` is the CUDA path of :func:`compilemask.paged_attention` (serving
steps over a paged KV cache).

Both ops have fake (meta) implementations; the forward has autograd through the backward op.
CPU tensors run the Rust CPU reference. CUDA tensors run the kernels of ``cm-cuda`` on the
current stream: torch allocates every output and workspace, the extension gets addresses,
shapes and strides as ints, releases the GIL and launches without synchronising.
"""

# No `from __future__ import annotations` here: torch.library reads these annotations.

import contextlib
import math
from typing import Any, Optional

import torch
from torch import Tensor

from . import _native


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- CPU reference

def _host(t: Tensor, dtype: torch.dtype) -> Any:
    """``t`` as a flat contiguous CPU buffer: a numpy array if numpy is installed (no copy
    beyond the dtype / layout conversion), else a list."""
    t = t.detach().to(device="cpu", dtype=dtype).contiguous()
    try:
        return t.numpy().reshape(-1)
    except (ImportError, RuntimeError):
        return t.reshape(-1).tolist()


def _from_bytes(raw: bytearray, dtype: torch.dtype, shape: tuple) -> Tensor:
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()


def _dims(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    b, hq, lq, d = q.shape
    _, hk, lk, _ = k.shape
    return (b, hq, hk, lq, lk, d, v.shape[-1])


def _cpu_forward(q, k, v, row_ptr, intervals, mask_index, scale):
    cd = _compute_dtype(q.dtype)
    dims = _dims(q, k, v)
    out, lse = _native.reference_forward(
        dims, _host(q, cd), _host(k, cd), _host(v, cd), _host(row_ptr, torch.int32),
        _host(intervals, torch.int32), _host(mask_index, torch.int32), scale,
        cd == torch.float64)
    b, hq, _, lq, _, _, dv = dims
    return (_from_bytes(out, cd, (b, hq, lq, dv)).to(q.dtype),
            _from_bytes(lse, cd, (b, hq, lq)).to(_lse_dtype(q.dtype)))


def _cpu_backward(grad_out, grad_lse, q, k, v, row_ptr, intervals, mask_index, scale):
    cd = _compute_dtype(q.dtype)
    dims = _dims(q, k, v)
    dq, dk, dv = _native.reference_backward(
        dims, _host(q, cd), _host(k, cd), _host(v, cd), _host(grad_out, cd),
        None if grad_lse is None else _host(grad_lse, cd),
        _host(row_ptr, torch.int32), _host(intervals, torch.int32),
        _host(mask_index, torch.int32), scale, cd == torch.float64)
    return (_from_bytes(dq, cd, tuple(q.shape)).to(q.dtype),
            _from_bytes(dk, cd, tuple(k.shape)).to(k.dtype),
            _from_bytes(dv, cd, tuple(v.shape)).to(v.dtype))


# --------------------------------------------------------------------------- CUDA kernels

_CUDA_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The (head_dim, head_dim_v) shapes of the kernels' variant table (cm-kernels), from the
# extension: the forward, the forward with score terms, the backward, the backward with
# score terms.
CUDA_FORWARD_HEAD_DIMS = tuple(tuple(s) for s in _native.CUDA_FORWARD_HEAD_DIMS)
CUDA_SCORE_HEAD_DIMS = tuple(tuple(s) for s in _native.CUDA_SCORE_HEAD_DIMS)
CUDA_BACKWARD_HEAD_DIMS = tuple(tuple(s) for s in _native.CUDA_BACKWARD_HEAD_DIMS)
CUDA_SCORE_BACKWARD_HEAD_DIMS = tuple(
    tuple(s) for s in _native.CUDA_SCORE_BACKWARD_HEAD_DIMS)


def _shapes_text(shapes: tuple) -> str:
    return ", ".join(str(d) if d == dv else f"{d} (head_dim_v {dv})" for d, dv in shapes)


def _check_cuda_supported(q: Tensor, v: Tensor, shapes: tuple = CUDA_FORWARD_HEAD_DIMS,
                          what: str = "compilemask.attention on CUDA") -> None:
    d, dv = q.shape[-1], v.shape[-1]
    if q.dtype not in _CUDA_DTYPES or (d, dv) not in shapes:
        raise NotImplementedError(
            f"{what} supports bfloat16 and float16 with head_dim {_shapes_text(shapes)} "
            f"(head_dim_v == head_dim unless named); got {str(q.dtype).removeprefix('torch.')} "
            f"with head_dim {d} and head_dim_v {dv}. Use CPU tensors (the CPU reference) or "
            "plan.to_block_mask() with FlexAttention for other cases."
        )


def check_cuda_backward_supported(q: Tensor, k: Tensor, v: Tensor, scored: bool) -> None:
    """Refuses, before the forward runs, a CUDA call whose inputs need gradients at a shape
    built forward only (``CUDA_BACKWARD_HEAD_DIMS``; ``CUDA_SCORE_BACKWARD_HEAD_DIMS`` with
    ``scored``: a softcap or biases, not sinks alone), so that training fails at the call,
    not at ``backward()`` after the forward's work."""
    if q.device.type != "cuda" or not torch.is_grad_enabled():
        return
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return
    _check_cuda_supported(
        q, v, CUDA_SCORE_BACKWARD_HEAD_DIMS if scored else CUDA_BACKWARD_HEAD_DIMS,
        "the backward of compilemask.attention on CUDA (inputs that require grad"
        + (", a softcap or biases" if scored else "") + ")")


def _raw(t: Tensor) -> tuple:
    """A tensor as the extension takes it: address, shape, strides (in elements), dtype name
    and CUDA ordinal (-1 off CUDA); the extension checks every one before a launch."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()),
            str(t.dtype).removeprefix("torch."), t.device.index if t.is_cuda else -1)


def _kernel_ready(t: Tensor) -> Tensor:
    """``t`` itself when the kernels can read it (contiguous last dim, 16-byte aligned base
    and strides), else a contiguous copy. For gradients, whose layout autograd chooses (the
    gradient of a ``sum()`` is an expanded tensor with zero strides)."""
    elem = t.element_size()
    if (t.is_contiguous() and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and t.shape[-1] * elem % 16 == 0):
        # Every other stride is a multiple of the last dim's size, so of 16 bytes too.
        return t
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        n <= 1 or s * elem % 16 == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]))
    return t if ok else t.contiguous()


def _plan_arg(kernel: Tensor, kernel_lens: list, plan_dims: list, q_len: int,
              kv_len: int) -> tuple:
    """The kernels' view of the plan: lengths, mask count and mask index sides, its
    descriptor arrays (one tensor holding them back to back, and their lengths), the
    forward's tile sets best first and the deterministic backward's dQ path."""
    num_masks, batch, num_heads, dq_turns, *ws_order = plan_dims
    return (q_len, kv_len, num_masks, (batch, num_heads), (_raw(kernel), kernel_lens),
            ws_order, bool(dq_turns))


# The getter of torch.compile's generated code (about 8 us a call cheaper than
# torch.cuda.current_stream on the GPU machine's host), where this torch has it.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device) -> int:
    """torch's current stream on ``device`` (a CUDA device) as its address."""
    if _RAW_STREAM is not None and device.index is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _on_device(device: torch.device) -> Any:
    """A context in which ``device`` is torch's current device. A launch binds the device's
    primary context to the calling thread, which must not change torch's idea of the current
    device under it; ``torch.cuda.device`` (about 4 us to enter and leave) only where another
    device is current."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# No score terms: what the plain ops pass.
_NO_SCORE = (0.0, None, (0.0, 0.0, 0.0), None, False, None, None, None)


def _opt_raw(t: Optional[Tensor]) -> Optional[tuple]:
    return None if t is None else _raw(t.reshape(-1))


def _score_arg(score: Optional[tuple], dist_bias_grad: Optional[Tensor] = None) -> tuple:
    """The extension's view of the score terms ``(softcap, linear, slopes, dist_bias,
    dist_run_end, sinks)`` (see :func:`attention_forward_score`)."""
    if score is None:
        return _NO_SCORE
    softcap, linear, slopes, dist_bias, run_end, sinks = score
    per_head = dist_bias is not None and dist_bias.dim() == 2 and dist_bias.shape[0] > 1
    return (float(softcap), _opt_raw(slopes), tuple(float(x) for x in linear),
            _opt_raw(dist_bias), per_head, _opt_raw(run_end), _opt_raw(sinks),
            # An output: a view (never reshape's silent copy, which the kernels would fill).
            None if dist_bias_grad is None else _raw(dist_bias_grad.view(-1)))


def _modifies_logits(score: Optional[tuple]) -> bool:
    """Whether the score tuple ``(softcap, linear, slopes, dist_bias, dist_run_end, sinks)``
    changes the logits (the score kernels' shapes); sinks alone run on the plain kernels."""
    return score is not None and (score[0] > 0 or score[2] is not None or score[3] is not None)


def _cuda_forward(q, k, v, kernel, kernel_lens, plan_dims, scale, score=None):
    if _modifies_logits(score):
        _check_cuda_supported(q, v, CUDA_SCORE_HEAD_DIMS,
                              "compilemask.attention with a softcap or biases on CUDA")
    else:
        _check_cuda_supported(q, v)
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    out = torch.empty((b, hq, lq, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    with _on_device(q.device):
        _native.cuda_forward(
            _stream(q.device), _plan_arg(kernel, kernel_lens, plan_dims, lq, lk), _raw(q),
            _raw(k), _raw(v), _raw(out), _raw(lse), scale, _score_arg(score))
    return out, lse


def _cuda_backward_out(dout, q, k, v, out, lse, kernel, kernel_lens, plan_dims, scale,
                       deterministic, score=None, dist_bias_grad=None, grad_lse=None):
    """dq, dk, dv of ``sum(out * dout) + sum(lse * grad_lse)`` by the backward kernels
    (``grad_lse`` enters the kernels' delta: d lse_i / d s_ij = P_ij), and that delta
    (``rowsum(dout * out) - grad_lse``, float32 ``[b, hq, lq]``, a view of the workspace)."""
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    dq = torch.empty((b, hq, lq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    workspace = torch.empty(_native.cuda_workspace_len(lq, b, hq, d, deterministic),
                            dtype=torch.float32, device=q.device)
    with _on_device(q.device):
        _native.cuda_backward(
            _stream(q.device), _plan_arg(kernel, kernel_lens, plan_dims, lq, lk), _raw(q),
            _raw(k), _raw(v), _raw(out), _raw(dout), _raw(lse),
            None if grad_lse is None else _raw(grad_lse.float().contiguous()), _raw(dq),
            _raw(dk), _raw(dv), _raw(workspace), scale, deterministic,
            _score_arg(score, dist_bias_grad))
    # The workspace holds lse_log2, then delta, each [b, hq, q_pad] (cm_cuda's
    # backward_workspace_len), then the dQ accumulator (head_dim per row) and, in the
    # deterministic mode, the dQ turn counters: the fast mode's length is rows * (2 + d).
    rows = _native.cuda_workspace_len(lq, b, hq, d, False) // (2 + d)
    delta = workspace[rows:2 * rows].view(b, hq, rows // max(b * hq, 1))[..., :lq]
    return dq, dk, dv, delta


def _cuda_backward(grad_out, grad_lse, q, k, v, out, lse, kernel, kernel_lens, plan_dims, scale,
                   deterministic):
    _check_cuda_supported(q, v, CUDA_BACKWARD_HEAD_DIMS,
                          "the backward of compilemask.attention on CUDA")
    dout = _kernel_ready(grad_out) if grad_out is not None else torch.zeros_like(out)
    return _cuda_backward_out(dout, q, k, v, out, lse, kernel, kernel_lens, plan_dims, scale,
                              deterministic, grad_lse=grad_lse)[:3]


# --------------------------------------------------------------------------- the ops

@torch.library.custom_op("compilemask::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, row_ptr: Tensor, intervals: Tensor,
                      mask_index: Tensor, kernel: Optional[Tensor], kernel_lens: list[int],
                      plan_dims: list[int], scale: float,
                      deterministic: bool) -> tuple[Tensor, Tensor]:
    if q.device.type == "cuda":
        return _cuda_forward(q, k, v, kernel, kernel_lens, plan_dims, scale)
    if q.device.type != "cpu":
        raise NotImplementedError(f"compilemask.attention has no kernels for {q.device}")
    return _cpu_forward(q, k, v, row_ptr, intervals, mask_index, scale)


@attention_forward.register_fake
def _(q, k, v, row_ptr, intervals, mask_index, kernel, kernel_lens, plan_dims, scale,
      deterministic):
    b, hq, lq, _ = q.shape
    return (q.new_empty((b, hq, lq, v.shape[-1])),
            q.new_empty((b, hq, lq), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("compilemask::attention_backward", mutates_args=())
def attention_backward(grad_out: Optional[Tensor], grad_lse: Optional[Tensor], q: Tensor,
                       k: Tensor, v: Tensor, out: Tensor, lse: Tensor, row_ptr: Tensor,
                       intervals: Tensor, mask_index: Tensor, kernel: Optional[Tensor],
                       kernel_lens: list[int], plan_dims: list[int], scale: float,
                       deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    if q.device.type == "cuda":
        return _cuda_backward(grad_out, grad_lse, q, k, v, out, lse, kernel, kernel_lens,
                              plan_dims, scale, deterministic)
    if q.device.type != "cpu":
        raise NotImplementedError(f"compilemask.attention has no kernels for {q.device}")
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    return _cpu_backward(grad_out, grad_lse, q, k, v, row_ptr, intervals, mask_index, scale)


@attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, row_ptr, intervals, mask_index, kernel,
      kernel_lens, plan_dims, scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    (q, k, v, row_ptr, intervals, mask_index, kernel, kernel_lens, plan_dims, scale,
     deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, row_ptr, intervals, mask_index, kernel)
    ctx.kernel_lens = kernel_lens
    ctx.plan_dims = plan_dims
    ctx.scale = scale
    ctx.deterministic = deterministic
    # Outputs the loss does not use get None instead of zeros: a loss of `out` alone passes
    # no lse gradient to the kernels.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> tuple:
    q, k, v, out, lse, row_ptr, intervals, mask_index, kernel = ctx.saved_tensors
    grads = [g for g in (grad_out, grad_lse) if g is not None]
    if q.is_cuda and _bypasses_dispatcher(q, k, v, out, *grads):
        # Not under create_graph (whose double backward the op refuses) nor any tracing.
        dq, dk, dv = _cuda_backward(grad_out, grad_lse, q, k, v, out, lse, kernel,
                                    ctx.kernel_lens, ctx.plan_dims, ctx.scale,
                                    ctx.deterministic)
    else:
        dq, dk, dv = attention_backward(grad_out, grad_lse, q, k, v, out, lse, row_ptr,
                                        intervals, mask_index, kernel, ctx.kernel_lens,
                                        ctx.plan_dims, ctx.scale, ctx.deterministic)
    # One gradient per input: q, k, v, row_ptr, intervals, mask_index, kernel, kernel_lens,
    # plan_dims, scale, deterministic.
    return (dq, dk, dv, None, None, None, None, None, None, None, None)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """``attention_forward`` on CUDA as an autograd function of its own, for eager calls that
    torch's dispatcher would only slow down (:func:`attention_forward_eager`): the op's
    forward, saved tensors and backward, without the two trips through the dispatcher
    (and their conversions of every argument) that a custom op with autograd makes."""

    @staticmethod
    def forward(q, k, v, row_ptr, intervals, mask_index, kernel, kernel_lens, plan_dims, scale,
                deterministic):
        return _cuda_forward(q, k, v, kernel, kernel_lens, plan_dims, scale)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


def attention_forward_eager(q: Tensor, k: Tensor, v: Tensor, row_ptr: Tensor,
                            intervals: Tensor, mask_index: Tensor, kernel: Optional[Tensor],
                            kernel_lens: list[int], plan_dims: list[int], scale: float,
                            deterministic: bool) -> tuple[Tensor, Tensor]:
    """``attention_forward(...)``, called without torch's dispatcher where nothing could tell
    (:func:`_plain_call_ok`: CUDA tensors, no tracing, mode or transform): the kernels
    directly when no gradient is asked for, else :class:`_EagerAttention`. Elsewhere the
    op itself, which torch.compile, fake tensors and functorch see."""
    args = (q, k, v, row_ptr, intervals, mask_index, kernel, kernel_lens, plan_dims, scale,
            deterministic)
    if not (q.is_cuda and _plain_call_ok(q, k, v)):
        return attention_forward(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(*args)
    return _cuda_forward(q, k, v, kernel, kernel_lens, plan_dims, scale)


# --------------------------------------------------------------------------- score terms
#
# The ops with score terms (docs/language.md, "Scores"): with s = scale * q . k of a visible
# pair (query q, key k, query head h), the logit is
#   (softcap > 0 ? softcap * tanh(s / softcap) : s)
#   + slopes[h] * (q_coef * q + k_coef * k + offset)      (linear = [q_coef, k_coef, offset])
#   + dist_bias[h or 0, q - k + kv_len - 1]
# and every row's softmax counts exp(sinks[h]) in its denominator. ``dist_bias`` (float32
# ``[num_heads or 1, q_len + kv_len - 1]``) and ``sinks`` (float32 ``[num_heads]``) are
# differentiable; ``dist_run_end`` (int32 ``[q_len + kv_len - 1]``, the last index of each
# index's run of equal values) lets the kernels add one constant for a tile inside one run.

def _sink_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """d loss / d sinks[h] = -sum over rows of exp(sinks[h] - lse) * delta, with the
    kernels' delta = rowsum(dout * out) - grad_lse: the sink is one more logit of each row's
    softmax, with value 0 (so its dP is 0), and d lse / d sink = exp(sink - lse); 0 for a -inf
    sink."""
    sink = sinks.float().view(1, -1, 1)
    # A -inf sink is no sink: its share is 0 (exp(-inf - lse) is NaN where lse is -inf too).
    share = torch.where(sink == -math.inf, 0.0, torch.exp(sink - lse.float()))
    return -(share * delta).sum(dim=(0, 2))


@torch.library.custom_op("compilemask::attention_forward_score", mutates_args=())
def attention_forward_score(q: Tensor, k: Tensor, v: Tensor, kernel: Tensor,
                            kernel_lens: list[int], plan_dims: list[int], scale: float,
                            deterministic: bool,
                            softcap: float, linear: list[float], slopes: Optional[Tensor],
                            dist_bias: Optional[Tensor], dist_run_end: Optional[Tensor],
                            sinks: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    if q.device.type != "cuda":
        raise NotImplementedError("the score terms' kernels run on CUDA tensors")
    score = (softcap, linear, slopes, dist_bias, dist_run_end, sinks)
    return _cuda_forward(q, k, v, kernel, kernel_lens, plan_dims, scale, score)


@attention_forward_score.register_fake
def _(q, k, v, kernel, kernel_lens, plan_dims, scale, deterministic, softcap, linear, slopes,
      dist_bias, dist_run_end, sinks):
    b, hq, lq, _ = q.shape
    return (q.new_empty((b, hq, lq, v.shape[-1])), q.new_empty((b, hq, lq), dtype=torch.float32))


@torch.library.custom_op("compilemask::attention_backward_score", mutates_args=())
def attention_backward_score(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor,
                             k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             kernel: Tensor, kernel_lens: list[int], plan_dims: list[int],
                             scale: float, deterministic: bool, softcap: float,
                             linear: list[float],
                             slopes: Optional[Tensor],
                             dist_bias: Optional[Tensor], dist_run_end: Optional[Tensor],
                             sinks: Optional[Tensor], want_dist_grad: bool
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    score = (softcap, linear, slopes, dist_bias, dist_run_end, sinks)
    if _modifies_logits(score):
        _check_cuda_supported(q, v, CUDA_SCORE_BACKWARD_HEAD_DIMS,
                              "the backward of compilemask.attention with a softcap or biases on CUDA")
    else:
        _check_cuda_supported(q, v, CUDA_BACKWARD_HEAD_DIMS,
                              "the backward of compilemask.attention on CUDA")
    dout = _kernel_ready(grad_out)
    # The deterministic backward sums the table's gradient in int64 fixed point (units of
    # 2^-32; integer atomics repeat their bits), the fast one in float32. The kernels write
    # it through its address, so it must be contiguous: zeros_like would copy a strided
    # dist_bias's layout, and the flat view the extension takes of it would be a copy that
    # the kernels' sums never reach.
    ddist = (torch.zeros(dist_bias.shape, dtype=torch.int64 if deterministic else torch.float32,
                         device=dist_bias.device)
             if want_dist_grad and dist_bias is not None else None)
    dq, dk, dv, delta = _cuda_backward_out(dout, q, k, v, out, lse, kernel, kernel_lens,
                                           plan_dims, scale, deterministic, score, ddist,
                                           grad_lse)
    if ddist is not None and deterministic:
        ddist = (ddist.double() * 2.0 ** -32).float()
    dsinks = (_sink_grad(sinks, lse, delta) if sinks is not None
              else q.new_zeros((0,), dtype=torch.float32))
    return dq, dk, dv, (ddist if ddist is not None else q.new_zeros((0,), dtype=torch.float32)), dsinks


@attention_backward_score.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, kernel, kernel_lens, plan_dims, scale,
      deterministic, softcap, linear, slopes, dist_bias, dist_run_end, sinks, want_dist_grad):
    ddist = (torch.empty(dist_bias.shape, dtype=torch.float32, device=dist_bias.device)
             if want_dist_grad and dist_bias is not None else q.new_empty((0,), dtype=torch.float32))
    dsinks = (torch.empty_like(sinks, dtype=torch.float32) if sinks is not None
              else q.new_empty((0,), dtype=torch.float32))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ddist, dsinks


def _setup_score_context(ctx: Any, inputs: tuple, output: Any) -> None:
    (q, k, v, kernel, kernel_lens, plan_dims, scale, deterministic, softcap, linear, slopes,
     dist_bias, dist_run_end, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, slopes, dist_bias, dist_run_end, sinks, kernel)
    ctx.kernel_lens = kernel_lens
    ctx.plan_dims, ctx.scale, ctx.softcap, ctx.linear = plan_dims, scale, softcap, linear
    ctx.deterministic = deterministic
    ctx.set_materialize_grads(False)


def _score_backward(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> tuple:
    q, k, v, out, lse, slopes, dist_bias, dist_run_end, sinks, kernel = ctx.saved_tensors
    # Every table and sink present gets its gradient: what needs_input_grad says under
    # torch.compile's traced backward cannot be relied on here (a compiled step lost the
    # table's gradient with it), and the cost is one fp32 sum per tile.
    want_dist = dist_bias is not None
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, ddist, dsinks = attention_backward_score(
        grad_out, grad_lse, q, k, v, out, lse, kernel, ctx.kernel_lens, ctx.plan_dims,
        ctx.scale, ctx.deterministic, ctx.softcap, ctx.linear, slopes, dist_bias, dist_run_end,
        sinks, want_dist)
    # One gradient per input: q, k, v, kernel, kernel_lens, plan_dims, scale,
    # deterministic, softcap, linear, slopes, dist_bias, dist_run_end, sinks.
    return (dq, dk, dv, None, None, None, None, None, None, None, None,
            ddist.to(dist_bias.dtype) if want_dist else None, None,
            dsinks.to(sinks.dtype) if sinks is not None else None)


attention_forward_score.register_autograd(_score_backward, setup_context=_setup_score_context)


@torch.library.custom_op("compilemask::table_by_distance", mutates_args=())
def table_gather(table: Tensor, bucket: Tensor, run_last: Tensor, run_order: Tensor,
                 seg_last: Tensor, seg_bucket: Tensor) -> Tensor:
    """``table[..., bucket]`` in float32: a bucketed bias table (``[num_heads, num_buckets]``
    or ``[num_buckets]``) as the bias by distance the kernels take; the runs
    (:func:`distance_runs`) are its backward's. Its backward sums the gradient of each run
    of equal buckets (a float64 prefix sum over the distances), then each bucket's runs (a
    prefix sum over the runs sorted by bucket), never scattering with atomics:
    deterministic, and free of the contention of 65K distances landing on a few dozen
    buckets at 32K tokens. Ops rather than an autograd function: a compiled step traced the
    function's backward into a zero gradient (measured on the H200)."""
    return table[..., bucket].float()


@table_gather.register_fake
def _(table, bucket, run_last, run_order, seg_last, seg_bucket):
    return table.new_empty(tuple(table.shape[:-1]) + tuple(bucket.shape), dtype=torch.float32)


@torch.library.custom_op("compilemask::table_by_distance_backward", mutates_args=())
def table_gather_backward(grad: Tensor, run_last: Tensor, run_order: Tensor,
                          seg_last: Tensor, seg_bucket: Tensor, num_buckets: int) -> Tensor:
    """d loss / d table from ``grad`` (d loss / d table[..., bucket]), float32."""
    pad = torch.nn.functional.pad
    cs = grad.double().cumsum(-1)[..., run_last]
    per_run = (cs - pad(cs[..., :-1], (1, 0)))[..., run_order]
    cs = per_run.cumsum(-1)[..., seg_last]
    dtable = torch.zeros(tuple(grad.shape[:-1]) + (num_buckets,), dtype=torch.float64,
                         device=grad.device)
    dtable[..., seg_bucket] = cs - pad(cs[..., :-1], (1, 0))
    return dtable.float()


@table_gather_backward.register_fake
def _(grad, run_last, run_order, seg_last, seg_bucket, num_buckets):
    return grad.new_empty(tuple(grad.shape[:-1]) + (num_buckets,), dtype=torch.float32)


def _setup_table_context(ctx: Any, inputs: tuple, output: Any) -> None:
    table, _, run_last, run_order, seg_last, seg_bucket = inputs
    ctx.save_for_backward(run_last, run_order, seg_last, seg_bucket)
    ctx.num_buckets, ctx.dtype = table.shape[-1], table.dtype


def _table_backward(ctx: Any, grad: Tensor) -> tuple:
    dtable = table_gather_backward(grad, *ctx.saved_tensors, ctx.num_buckets)
    return dtable.to(ctx.dtype), None, None, None, None, None


table_gather.register_autograd(_table_backward, setup_context=_setup_table_context)


def _no_second_order(ctx: Any, *grads: Any) -> tuple:
    raise RuntimeError(
        "compilemask.attention has no second-order gradients (a double backward, such as a "
        "gradient penalty through the attention, or gradgradcheck): its gradients come from "
        "a fused backward that is not itself differentiable")


def _no_context(ctx: Any, inputs: tuple, output: Any) -> None:
    pass


# The backward ops are not differentiable: a double backward through them raises the message
# above instead of torch's (which asks for a formula only this package could register).
for _op in (attention_backward, attention_backward_score, table_gather_backward):
    _op.register_autograd(_no_second_order, setup_context=_no_context)


def distance_runs(bucket: Tensor) -> tuple[Tensor, list]:
    """For ``bucket`` (int64 ``[q_len + kv_len - 1]``, the bucket of distance ``q - k`` at
    index ``q - k + kv_len - 1``): the kernels' ``dist_run_end`` (int32, the last index of
    each index's run of equal buckets) and what :func:`table_gather`'s backward needs
    (every run's last index, the runs in bucket order, and each bucket's last run in that
    order with its bucket)."""
    change = torch.ones_like(bucket, dtype=torch.bool)
    change[:-1] = bucket[1:] != bucket[:-1]
    run_last = torch.nonzero(change).flatten()
    run_of = torch.cumsum(torch.nn.functional.pad(change[:-1].long(), (1, 0)), 0)
    run_end = run_last[run_of].to(torch.int32)
    run_bucket = bucket[run_last]
    run_order = torch.argsort(run_bucket, stable=True)
    sorted_bucket = run_bucket[run_order]
    seg = torch.ones_like(sorted_bucket, dtype=torch.bool)
    seg[:-1] = sorted_bucket[1:] != sorted_bucket[:-1]
    seg_last = torch.nonzero(seg).flatten()
    return run_end, [run_last, run_order, seg_last, sorted_bucket[seg_last]]


def table_by_distance(table: Tensor, bucket: Tensor) -> tuple[Tensor, Tensor]:
    """The bias by distance of a bucketed table and the kernels' ``dist_run_end``
    (:func:`distance_runs`)."""
    run_end, runs = distance_runs(bucket)
    return table_gather(table, bucket, *runs), run_end


# Serving: one step's new rows against a paged KV cache (the decode kernel of cm-cuda).

def _paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                     cu_q: Tensor, kv_len: Tensor, row_ptr: Tensor, intervals: Tensor,
                     max_q_len: int, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [total_q, num_heads, head_dim], lse [total_q, num_heads] float32, natural log)``
    of the step on CUDA. The split-KV count comes from capacities only (the shapes of q, the
    cache and the block table, and ``max_q_len``), so a CUDA graph captured once stays valid
    while the step's lengths change."""
    # Inside the op, where the tensors are real (a traced call's are fake and have no address).
    q, k_cache, v_cache = _kernel_ready(q), _kernel_ready(k_cache), _kernel_ready(v_cache)
    total_q, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_pages = block_table.shape
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"compilemask.paged_attention: num_kv_heads = {num_kv_heads} must "
                         f"divide num_heads = {num_heads}")
    dtype = str(q.dtype).removeprefix("torch.")
    device = q.device.index
    splits = _native.cuda_decode_splits(device, dtype, head_dim, num_seqs, max_q_len,
                                        num_heads // num_kv_heads, num_kv_heads,
                                        max_pages * page_size)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((total_q, num_heads), dtype=torch.float32, device=q.device)
    ws_len = _native.cuda_decode_workspace_len(splits, total_q, num_heads, head_dim)
    workspace = torch.empty(ws_len, dtype=torch.float32, device=q.device) if ws_len else None
    step = tuple(_raw(t if t.dim() == 1 else t.reshape(-1))
                 for t in (cu_q, kv_len, row_ptr, intervals))
    with _on_device(q.device):
        _native.cuda_paged_attention(
            _stream(q.device), _raw(q), _raw(k_cache), _raw(v_cache), _raw(out), _raw(lse),
            _raw(block_table), step, max_q_len, splits, _opt_raw(workspace), scale)
    return out, lse


paged_attention_op = torch.library.custom_op("compilemask::paged_attention",
                                             mutates_args=())(_paged_attention)


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, cu_q, kv_len, row_ptr, intervals, max_q_len, scale):
    total_q, num_heads, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((total_q, num_heads), dtype=torch.float32))


def _paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                   key_blocks: Tensor, row_index: Tensor, kernel: Tensor,
                   kernel_lens: list[int], plan_dims: list[int],
                   scale: float) -> tuple[Tensor, Tensor]:
    """``(out [total_q, num_heads, head_dim], lse [total_q, num_heads] float32, natural log)``
    of a step through the paged forward (``cm_cuda::prefill``): ``kernel`` is the descriptor of
    the step's virtual rows over its virtual key blocks (its arrays back to back, of
    ``kernel_lens`` elements each), ``key_blocks`` the blocks' ``(seq,
    first_key, valid_keys, 0)`` entries and ``row_index`` (int64 ``[total_q * row_group]``)
    the virtual row of each (step row, query head of its kv head) (:meth:`compilemask.Step`
    builds them), ``plan_dims`` ``[kv_len, q_rows, row_group]`` (the virtual keys and rows,
    and the query heads packed per kv head: ``num_heads // num_kv_heads``, or 1)."""
    q, k_cache, v_cache = _kernel_ready(q), _kernel_ready(k_cache), _kernel_ready(v_cache)
    kv_len, q_rows, row_group = plan_dims
    q_virtual = to_virtual_rows(q, row_index, q_rows, row_group)
    out = torch.empty_like(q_virtual)
    lse = torch.empty((q_virtual.shape[1], q_rows), dtype=torch.float32, device=q.device)
    plan = (q_rows, kv_len, (_raw(kernel), kernel_lens))
    with _on_device(q.device):
        _native.cuda_paged_prefill(
            _stream(q.device), plan, _raw(q_virtual), _raw(k_cache), _raw(v_cache), _raw(out),
            _raw(lse), _raw(block_table), _raw(key_blocks.reshape(-1)), scale)
    return from_virtual_rows(out, lse, row_index, row_group)


def to_virtual_rows(q: Tensor, row_index: Tensor, q_rows: int, row_group: int) -> Tensor:
    """``q`` ``[total_q, num_heads, head_dim]`` as the prefill layout's contiguous ``[q_rows,
    num_heads // row_group, head_dim]``: query head ``kv_head * row_group + j`` of step row
    ``r`` at virtual row ``row_index[r * row_group + j]`` of kv head ``kv_head`` (GQA
    packing), zeros in the padding rows (which see what their sequence's last row sees: zeros
    keep their scores finite, and their outputs are dropped)."""
    total_q, num_heads, head_dim = q.shape
    heads = num_heads // row_group
    packed = (q.reshape(total_q, heads, row_group, head_dim).transpose(1, 2)
              .reshape(total_q * row_group, heads, head_dim))
    if q_rows == total_q * row_group:
        # No padding: row_index is the identity.
        return packed.contiguous()
    return q.new_zeros((q_rows, heads, head_dim)).index_copy_(0, row_index, packed)


def from_virtual_rows(out: Tensor, lse: Tensor, row_index: Tensor,
                      row_group: int) -> tuple[Tensor, Tensor]:
    """The prefill kernel's ``out`` ``[q_rows, num_kv_heads, head_dim]`` and ``lse``
    ``[num_kv_heads, q_rows]`` back in the step's rows and heads (``to_virtual_rows``
    inverted, padding rows dropped): ``out`` ``[total_q, num_heads, head_dim]`` and ``lse``
    ``[total_q, num_heads]``, both contiguous."""
    heads, head_dim = out.shape[1], out.shape[2]
    total_q = row_index.shape[0] // row_group
    if out.shape[0] != row_index.shape[0]:
        out, lse = out.index_select(0, row_index), lse.index_select(1, row_index)
    out = (out.reshape(total_q, row_group, heads, head_dim).transpose(1, 2)
           .reshape(total_q, heads * row_group, head_dim))
    lse = lse.reshape(heads, total_q, row_group).permute(1, 0, 2).reshape(total_q, -1)
    return out.contiguous(), lse.contiguous()


paged_prefill_op = torch.library.custom_op("compilemask::paged_prefill",
                                           mutates_args=())(_paged_prefill)


@paged_prefill_op.register_fake
def _(q, k_cache, v_cache, block_table, key_blocks, row_index, kernel, kernel_lens, plan_dims,
      scale):
    total_q, num_heads, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((total_q, num_heads), dtype=torch.float32))


def _dispatch_guards() -> Optional[tuple]:
    """torch's switches that anything recording, transforming or tracing ops turns on: a
    torch-function mode (``with torch.device(...)`` too), a dispatch mode (FakeTensorMode,
    FlopCounterMode, make_fx), a functorch transform, the profiler, ``torch.jit.trace`` (whose
    tracer records ops at the dispatcher: a plain call would leave the launch out of the
    trace, whose replays would return the empty outputs). None where this torch lacks one of
    them (every call then goes through the dispatcher)."""
    try:
        return (torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack,
                torch._C._are_functorch_transforms_active, torch._C._autograd._profiler_enabled,
                torch._C._get_tracing_state)
    except AttributeError:
        return None


_DISPATCH_GUARDS = _dispatch_guards()

# Whether a tensor is one of torch's legacy vmap (``BatchedTensor``, of the ``Batched``
# dispatch key; ``type`` says Tensor): ``torch.autograd.grad(..., is_grads_batched=True)`` and
# ``torch.autograd.functional.jacobian(..., vectorize=True)`` pass the gradients of a
# backward as these. Through the dispatcher a custom op runs once per batch entry (torch's
# fallback for the key); the kernels called directly would take the address of a tensor
# that has no storage. None where this torch lacks it (every call then goes through the
# dispatcher).
_IS_LEGACY_BATCHED = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor",
                             None)


def _plain_call_ok(*tensors: Tensor) -> bool:
    """Whether an op may run as the function it wraps instead of through torch's dispatcher,
    whose ~12 us a call is as much as the rest of a decode step's Python: only where nothing
    could tell the difference (no torch.compile tracing, none of :func:`_dispatch_guards`'
    switches on, plain tensors, none of them batched by torch's legacy vmap). Gradients are
    the caller's to handle."""
    if _DISPATCH_GUARDS is None or torch.compiler.is_compiling() or _IS_LEGACY_BATCHED is None:
        return False
    if any(on() for on in _DISPATCH_GUARDS):
        return False
    return all(type(t) is Tensor and not _IS_LEGACY_BATCHED(t) for t in tensors)


def _bypasses_dispatcher(*tensors: Tensor) -> bool:
    """:func:`_plain_call_ok` for an op called without autograd: also no gradient asked for
    (a custom op without an autograd formula refuses a backward, which a plain call would
    not)."""
    if not _plain_call_ok(*tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def check_paged_cuda(q: Tensor, v_cache: Tensor) -> None:
    """``NotImplementedError`` unless both paged kernels run q's dtype and head dims."""
    if q.dtype not in _CUDA_DTYPES or q.shape[-1] not in (64, 128) or v_cache.shape[-1] != q.shape[-1]:
        raise NotImplementedError(
            f"compilemask.paged_attention on CUDA supports bfloat16 and float16 with head_dim 64 "
            f"or 128 and head_dim_v == head_dim; got {str(q.dtype).removeprefix('torch.')} with "
            f"head_dim {q.shape[-1]} and head_dim_v {v_cache.shape[-1]}. Use CPU tensors (the "
            "reference) for other cases.")


def paged_attention_cuda(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                         tensors: Any, scale: float, return_lse: bool, prefill: Any = None):
    """:func:`compilemask.paged_attention` on CUDA tensors: ``tensors`` holds the step's int32
    arrays ``cu_q``, ``kv_len``, ``row_ptr``, ``intervals`` on q's device and its
    ``max_q_len`` (the most new rows of any sequence, a capacity); with ``prefill`` (a
    ``compilemask._serve.PrefillTensors``) the step runs through the paged forward instead
    of the decode kernel."""
    check_paged_cuda(q, v_cache)
    plain = _bypasses_dispatcher(q, k_cache, v_cache, block_table)
    if prefill is not None:
        op = _paged_prefill if plain else paged_prefill_op
        out, lse = op(q, k_cache, v_cache, block_table, prefill.key_blocks, prefill.row_index,
                      prefill.kernel_flat, list(prefill.kernel_lens), prefill.plan_dims(),
                      float(scale))
    else:
        op = _paged_attention if plain else paged_attention_op
        out, lse = op(
            q, k_cache, v_cache, block_table,
            tensors.cu_q, tensors.kv_len, tensors.row_ptr, tensors.intervals,
            int(tensors.max_q_len), float(scale))
    return (out, lse) if return_lse else out
