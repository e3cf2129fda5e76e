"""The ``torch.library`` custom ops behind :func:`compilemask.attention`.

Imported on first use only (it imports torch). The plan travels as three int32 tensors
(``row_ptr``, ``intervals``, ``mask_index``; see :class:`compilemask.PlanTensors`), so the
ops take nothing but tensors and a float and work under ``torch.compile``:

- ``compilemask::attention_forward(q, k, v, row_ptr, intervals, mask_index, scale)
  -> (out, lse)``
- ``compilemask::attention_backward(grad_out, grad_lse, q, k, v, row_ptr, intervals,
  mask_index, scale) -> (dq, dk, dv)``

Both have fake (meta) implementations; the forward has autograd through the backward op.
CPU tensors run the Rust CPU reference; other devices raise ``NotImplementedError``.
"""

# No `from __future__ import annotations` here: torch.library reads these annotations.

import math
from typing import Any, Optional

import torch
from torch import Tensor

from . import _native


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _cpu_only(q: Tensor) -> None:
    if q.device.type != "cpu":
        raise NotImplementedError(
            f"compilemask.attention on {q.device.type} tensors: CUDA kernels not wired yet; "
            "CPU tensors run the CPU reference"
        )


@torch.library.custom_op("compilemask::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, row_ptr: Tensor, intervals: Tensor,
                      mask_index: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    _cpu_only(q)
    cd = _compute_dtype(q.dtype)
    dims = _dims(q, k, v)
    out, lse = _native.reference_forward(
        dims, _host(q, cd), _host(k, cd), _host(v, cd), _host(row_ptr, torch.int32),
        _host(intervals, torch.int32), _host(mask_index, torch.int32), scale,
        cd == torch.float64)
    b, hq, _, lq, _, _, dv = dims
    return (_from_bytes(out, cd, (b, hq, lq, dv)).to(q.dtype),
            _from_bytes(lse, cd, (b, hq, lq)).to(_lse_dtype(q.dtype)))


@attention_forward.register_fake
def _(q, k, v, row_ptr, intervals, mask_index, scale):
    b, hq, lq, _ = q.shape
    return (q.new_empty((b, hq, lq, v.shape[-1])),
            q.new_empty((b, hq, lq), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("compilemask::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor,
                       v: Tensor, row_ptr: Tensor, intervals: Tensor, mask_index: Tensor,
                       scale: float) -> tuple[Tensor, Tensor, Tensor]:
    _cpu_only(q)
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


@attention_backward.register_fake
def _(grad_out, grad_lse, q, k, v, row_ptr, intervals, mask_index, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, row_ptr, intervals, mask_index, scale = inputs
    ctx.save_for_backward(q, k, v, row_ptr, intervals, mask_index)
    ctx.scale = scale


def _backward(ctx: Any, grad_out: Optional[Tensor], grad_lse: Optional[Tensor]) -> tuple:
    q, k, v, row_ptr, intervals, mask_index = ctx.saved_tensors
    if grad_out is None:
        grad_out = q.new_zeros((*q.shape[:3], v.shape[-1]))
    dq, dk, dv = attention_backward(grad_out, grad_lse, q, k, v, row_ptr, intervals,
                                    mask_index, ctx.scale)
    return dq, dk, dv, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
