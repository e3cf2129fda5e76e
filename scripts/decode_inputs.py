"""The decode benchmarks' shared inputs (scripts/bench-decode.py and bench-host.py import
them: a script's own folder is on sys.path when it runs): a block table whose pages
interleave the sequences, and the StepTensors of one new row per sequence over all its keys."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def interleaved_table(batch: int, pages: int, device) -> torch.Tensor:
    """int32 ``[batch, pages]``: page ``p`` of sequence ``s`` is page ``p * batch + s`` of the
    cache, so no sequence's pages are contiguous."""
    return (torch.arange(pages, device=device, dtype=torch.int32)[None, :] * batch
            + torch.arange(batch, device=device, dtype=torch.int32)[:, None]).contiguous()


def full_rows(batch: int, kv_len: int, device) -> SimpleNamespace:
    """The decode kernel's step arrays (``compilemask.StepTensors``' fields) of ``batch``
    sequences with one new row each that sees all ``kv_len`` keys."""
    i32 = dict(dtype=torch.int32, device=device)
    return SimpleNamespace(
        cu_q=torch.arange(batch + 1, **i32), kv_len=torch.full((batch,), kv_len, **i32),
        row_ptr=torch.arange(batch + 1, **i32),
        intervals=torch.tensor([[0, kv_len]] * batch, **i32), max_q_len=1)
