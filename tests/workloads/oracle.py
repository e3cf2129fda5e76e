"""Independent oracle for the benchmark masks W1-W8 of workloads.md.

Written from the specification alone (``workloads.md`` and the JSON contract of the CLI in
``design.md``), not from the compiler's source, so that the two can check each other.

Every mask is a :class:`Mask`: ``q_len == kv_len == S`` rows, each given as its *maximal*
sorted disjoint half-open key intervals ``[(lo, hi), ...]`` (touching runs merged).
:func:`plan_stats` derives from those rows the fields ``compilemask plan --json`` prints.

Command line (Python 3.11, standard library only)::

    python3 tests/workloads/oracle.py --selftest          # checks against dense/hand values
    python3 tests/workloads/oracle.py plan hstu 32768 --tile 64x96
    python3 tests/workloads/oracle.py intervals clear 8612 --rows 510:515
    python3 tests/workloads/oracle.py summary             # visible pairs at 8K and 32K
"""

from __future__ import annotations

import argparse
import bisect
import csv
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Interval = tuple[int, int]
Row = list[Interval]

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACE_RELATIVE = Path("data/azure-llm-trace-2023-conv.csv")
TRACE_FALLBACK = Path("/work/shared/data/azure-llm-trace-2023-conv.csv")

# Default parameters of workloads.md / design.md ("Built-in masks and their parameters").
HSTU_LENGTHS = (2048, 1536, 3072, 1024, 2560, 512, 4096, 1280)
HSTU_CONTEXTUAL = 8
HSTU_TARGET_DIVISOR = 8
PROMPTS = (3072, 1536, 2048, 4096)
RESPONSE_BASE = (384, 512, 640, 256, 768, 448, 320, 576)
# The flat 64-entry list: RESPONSE_BASE rotated left by 0, 1, ..., 7 in turn.
RESPONSES = tuple(RESPONSE_BASE[(i + rot) % 8] for rot in range(8) for i in range(8))
GROUP = 8
CLEAR_TEXT = 512
CLEAR_RADIUS = 16
CLEAR_GRIDS = (32, 64, 90, 128, 180)
WINDOW = 4096
DOCUMENT_LENGTHS = (4096, 1024, 8192, 512, 2048, 3072, 256, 6144)


def merge(intervals: Sequence[Interval]) -> Row:
    """Maximal form of a set of half-open intervals: sorted, disjoint, touching runs joined."""
    out: Row = []
    for lo, hi in sorted(intervals):
        if lo >= hi:
            continue
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


class Mask:
    """A square mask (``q_len == kv_len``) given row by row as maximal key intervals."""

    def __init__(self, q_len: int):
        if q_len < 1:
            raise ValueError(f"q_len must be positive, got {q_len}")
        self.q_len = q_len
        self.kv_len = q_len

    def rows(self, start: int, stop: int) -> list[Row]:
        """Intervals of rows ``start .. stop-1`` (``0 <= start <= stop <= q_len``)."""
        raise NotImplementedError

    def boundaries(self) -> list[int]:
        """Sorted rows where the row formula changes (segment and part starts)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, end)`` that see ``fixed`` plus the causal tail
    ``[max(floor, q - back), q + 1)``; no tail when ``floor`` is None, no window when
    ``back`` is None (the tail then starts at ``floor``)."""

    start: int
    end: int
    fixed: tuple[Interval, ...] = ()
    floor: int | None = None
    back: int | None = None

    def row(self, q: int) -> Row:
        if self.floor is None:
            return merge(self.fixed)
        lo = self.floor if self.back is None else max(self.floor, q - self.back)
        return merge(self.fixed + ((lo, q + 1),))


class PiecewiseMask(Mask):
    """A mask whose rows are covered, in order, by :class:`Piece` runs (W1-W3, W5-W8)."""

    def __init__(self, q_len: int, pieces: list[Piece]):
        super().__init__(q_len)
        pieces = [p for p in pieces if p.start < p.end]
        assert pieces[0].start == 0 and pieces[-1].end == q_len
        assert all(a.end == b.start for a, b in zip(pieces, pieces[1:]))
        self.pieces = pieces
        self._starts = [p.start for p in pieces]

    def rows(self, start: int, stop: int) -> list[Row]:
        out: list[Row] = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            piece = self.pieces[i]
            end = min(stop, piece.end)
            out.extend(piece.row(q) for q in range(start, end))
            start = end
            i += 1
        return out

    def boundaries(self) -> list[int]:
        return self._starts[1:]


def cycle_segments(lengths: Sequence[int], total: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the non-empty segments that cycling ``lengths`` packs into
    ``total`` positions, the last one cut to fit."""
    if any(n < 0 for n in lengths) or (total > 0 and sum(lengths) == 0):
        raise ValueError(f"lengths must be non-negative with a positive sum: {list(lengths)}")
    segments = []
    pos = 0
    i = 0
    while pos < total:
        n = min(lengths[i % len(lengths)], total - pos)
        if n:
            segments.append((pos, n))
        pos += n
        i += 1
    return segments


# --------------------------------------------------------------------------- the workloads


def causal(q_len: int) -> Mask:
    """W1: row q sees ``[0, q + 1)``."""
    return PiecewiseMask(q_len, [Piece(0, q_len, floor=0)])


def sliding_window(q_len: int, window: int = WINDOW) -> Mask:
    """W5: row q sees ``[max(0, q - window + 1), q + 1)``."""
    if window < 0:
        raise ValueError(f"window must be non-negative, got {window}")
    reach = min(q_len, window)  # rows below the window length still see key 0
    return PiecewiseMask(q_len, [Piece(0, reach, floor=0),
                                 Piece(reach, q_len, floor=0, back=window - 1)])


def document_causal(q_len: int, lengths: Sequence[int] = DOCUMENT_LENGTHS) -> Mask:
    """W6: packed documents (lengths cycled, last cut); row q of a document at o: ``[o, q+1)``."""
    return PiecewiseMask(
        q_len, [Piece(o, o + n, floor=o) for o, n in cycle_segments(lengths, q_len)]
    )


def hstu(
    q_len: int,
    lengths: Sequence[int] = HSTU_LENGTHS,
    contextual: int = HSTU_CONTEXTUAL,
    target_divisor: int = HSTU_TARGET_DIVISOR,
) -> Mask:
    """W2: per user of (possibly cut) length L at offset o, ``T = max(1, L // target_divisor)``
    targets at the end and history end ``E = o + L - T``. Targets see ``[o, E)`` and
    themselves; otherwise the first ``contextual`` rows see ``[o, E)``; history rows see
    ``[o, q + 1)``."""
    if contextual < 0 or target_divisor < 1:
        raise ValueError("contextual must be >= 0 and target_divisor >= 1")
    pieces = []
    for o, length in cycle_segments(lengths, q_len):
        end = o + length
        history_end = end - max(1, length // target_divisor)
        context_end = min(o + contextual, history_end)
        pieces += [
            Piece(o, context_end, fixed=((o, history_end),)),
            Piece(context_end, history_end, floor=o),
            Piece(history_end, end, fixed=((o, history_end),), floor=o, back=0),
        ]
    return PiecewiseMask(q_len, pieces)


def shared_prefix(
    q_len: int,
    prompts: Sequence[int] = PROMPTS,
    responses: Sequence[int] = RESPONSES,
    group: int = GROUP,
) -> Mask:
    """W3: sample j has prompt ``prompts[j % len]`` and the next ``group`` entries of
    ``responses`` (cycled); packed until ``q_len``, the last sample cut (prompt first).
    Prompt rows see ``[p0, q + 1)``; response rows ``[p0, p1) U [r0, q + 1)``."""
    if (
        group < 0
        or not prompts
        or (group > 0 and not responses)
        or any(n < 0 for n in list(prompts) + list(responses))
        or (sum(prompts) == 0 and (group == 0 or sum(responses) == 0))
    ):
        raise ValueError("prompts/responses must be non-negative and able to fill q_len")
    pieces = []
    pos = 0
    cursor = 0
    sample = 0
    while pos < q_len:
        p0 = pos
        p1 = min(q_len, p0 + prompts[sample % len(prompts)])
        pieces.append(Piece(p0, p1, floor=p0))
        pos = p1
        for _ in range(group):
            r0 = pos
            pos = min(q_len, r0 + responses[cursor % len(responses)])
            cursor += 1
            pieces.append(Piece(r0, pos, fixed=((p0, p1),), floor=r0))
        sample += 1
    return PiecewiseMask(q_len, pieces)


@functools.lru_cache(maxsize=None)
def load_trace(path: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(ContextTokens, GeneratedTokens)`` of the Azure conversation trace, in file order.

    Without ``path``: ``data/azure-llm-trace-2023-conv.csv`` of the repository, else the
    shared copy. The file starts with a UTF-8 byte-order mark (``utf-8-sig`` drops it)."""
    if path is None:
        found = REPO_ROOT / TRACE_RELATIVE
        path = str(found if found.exists() else TRACE_FALLBACK)
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    return (
        tuple(int(r["ContextTokens"]) for r in rows),
        tuple(int(r["GeneratedTokens"]) for r in rows),
    )


def trace_documents(q_len: int, trace_path: str | None = None) -> Mask:
    """W7: document causal with document i of length ``c_i + g_i`` from the trace."""
    context, generated = load_trace(trace_path)
    return document_causal(q_len, [c + g for c, g in zip(context, generated)])


def trace_prompt_groups(q_len: int, trace_path: str | None = None, group: int = GROUP) -> Mask:
    """W8: the W3 mask with prompt j of length ``c_j`` and its responses ``g_{8j..8j+7}``."""
    context, generated = load_trace(trace_path)
    return shared_prefix(q_len, context, generated, group)


def clear_length(grid: int, text: int = CLEAR_TEXT) -> int:
    """``q_len`` of a CLEAR mask: the text prefix plus the ``grid x grid`` image."""
    return text + grid * grid


class ClearMask(Mask):
    """W4 CLEAR: ``text`` tokens, then a ``grid x grid`` image in raster order. Text rows see
    every key; image rows see all text and the image tokens at squared distance
    ``< radius**2``."""

    def __init__(self, q_len: int, grid: int | None = None, radius: int = CLEAR_RADIUS,
                 text: int = CLEAR_TEXT):
        super().__init__(q_len)
        if text < 0 or radius < 0:
            raise ValueError("text and radius must be non-negative")
        if grid is None:
            grid = math.isqrt(max(0, q_len - text))
        if grid < 0 or clear_length(grid, text) != q_len:
            below = clear_length(math.isqrt(max(0, q_len - text)), text)
            above = clear_length(math.isqrt(max(0, q_len - text)) + 1, text)
            raise ValueError(
                f"clear needs q_len == text + grid*grid; nearest valid lengths {below}, {above}"
            )
        self.grid, self.radius, self.text = grid, radius, text
        # Half width of the disc on the image row dy away: |dx| <= isqrt(r^2 - dy^2 - 1).
        self._half = [(dy, math.isqrt(radius * radius - dy * dy - 1))
                      for dy in range(-radius + 1, radius)]

    def rows(self, start: int, stop: int) -> list[Row]:
        return [self._row(q) for q in range(start, stop)]

    def _row(self, q: int) -> Row:
        text, n = self.text, self.grid
        if q < text:
            return [(0, self.kv_len)]
        y, x = divmod(q - text, n)
        out: Row = [(0, text)] if text else []
        for dy, half in self._half:
            yy = y + dy
            if 0 <= yy < n:
                base = text + yy * n
                lo, hi = base + max(0, x - half), base + min(n, x + half + 1)
                if out and lo <= out[-1][1]:  # generated in order; only touching runs join
                    out[-1] = (out[-1][0], hi)
                else:
                    out.append((lo, hi))
        return out

    def boundaries(self) -> list[int]:
        return [self.text + y * self.grid for y in range(self.grid)]


def clear(q_len: int, grid: int | None = None, radius: int = CLEAR_RADIUS,
          text: int = CLEAR_TEXT) -> Mask:
    """W4 (see :class:`ClearMask`); ``grid`` defaults to the one that fits ``q_len``."""
    return ClearMask(q_len, grid, radius, text)


class DilatedWindowMask(Mask):
    """The standard library's ``dilated_window`` (not a workload): row ``q`` sees the keys
    ``k`` of ``(q - window, q]`` with ``(q - k) % dilation == 0``. The compiler stores each
    row as one strided run, but ``max_intervals_per_row`` counts maximal intervals
    (docs/design.md): with a dilation above 1, one per visible key."""

    def __init__(self, q_len: int, window: int = 4096, dilation: int = 2):
        super().__init__(q_len)
        if window < 1 or dilation < 1:
            raise ValueError("window and dilation must be >= 1")
        self.window, self.dilation = window, dilation

    def rows(self, start: int, stop: int) -> list[Row]:
        return [self._row(q) for q in range(start, stop)]

    def _row(self, q: int) -> Row:
        d = self.dilation
        lo = max(0, q - self.window + 1)
        first = q - d * ((q - lo) // d)
        if d == 1:
            return [(first, q + 1)]
        return [(k, k + 1) for k in range(first, q + 1, d)]

    def boundaries(self) -> list[int]:
        return [self.window - 1] if self.window - 1 < self.q_len else []


def dilated_window(q_len: int, window: int = 4096, dilation: int = 2) -> Mask:
    """The standard library's dilated window (see :class:`DilatedWindowMask`)."""
    return DilatedWindowMask(q_len, window, dilation)


# Masks with strided runs, checked with their parameters (at the defaults, 2048 intervals a
# row are too slow for plain Python): name -> (constructor, [(parameters, lengths)]).
STRIDED: dict[str, tuple[Callable[..., Mask], list[tuple[dict, tuple[int, ...]]]]] = {
    "dilated_window": (dilated_window, [
        ({"window": 100, "dilation": 3}, (1000, 4097)),
        ({"window": 37, "dilation": 2}, (1000,)),
        ({"window": 300, "dilation": 7}, (4097,)),
        ({"window": 64, "dilation": 1}, (1000,)),
    ]),
}

BUILTINS: dict[str, Callable[..., Mask]] = {
    "causal": causal,
    "hstu": hstu,
    "shared_prefix": shared_prefix,
    "clear": clear,
    "sliding_window": sliding_window,
    "document_causal": document_causal,
    "trace_documents": trace_documents,
    "trace_prompt_groups": trace_prompt_groups,
}


def headline_length(name: str, nominal: int) -> int:
    """The benchmark length for a nominal S: CLEAR uses its grid (8K -> 90, 32K -> 180)."""
    if name != "clear":
        return nominal
    grid = {8192: 90, 32768: 180}.get(nominal)
    if grid is None:
        grid = min(CLEAR_GRIDS, key=lambda n: abs(clear_length(n) - nominal))
    return clear_length(grid)


# --------------------------------------------------------------------------- plan statistics


def union_and_intersection(rows: Sequence[Row]) -> tuple[Row, Row]:
    """Maximal union and intersection of the rows' key sets (each row maximal intervals)."""
    delta: dict[int, int] = {}
    for row in rows:
        for lo, hi in row:
            delta[lo] = delta.get(lo, 0) + 1
            delta[hi] = delta.get(hi, 0) - 1
    n = len(rows)
    union: Row = []
    inter: Row = []
    cover = 0
    u_start = i_start = 0
    for pos in sorted(delta):
        new = cover + delta[pos]
        if new == cover:
            continue
        if cover == 0:
            u_start = pos
        elif new == 0:
            union.append((u_start, pos))
        if new == n:
            i_start = pos
        elif cover == n:
            inter.append((i_start, pos))
        cover = new
    return union, inter


def touched_tiles(union: Row, block_n: int, kv_len: int) -> tuple[int, int]:
    """Number of key tiles meeting ``union`` and their total in-range width."""
    count = width = 0
    last = -1
    for lo, hi in union:
        first = max(lo // block_n, last + 1)
        last_here = (hi - 1) // block_n
        if last_here >= first:
            count += last_here - first + 1
            width += min(kv_len, (last_here + 1) * block_n) - first * block_n
            last = last_here
    return count, width


def covered_tiles(inter: Row, block_n: int, kv_len: int) -> int:
    """Number of key tiles whose whole in-range part lies inside ``inter``."""
    count = 0
    for lo, hi in inter:
        first = -(-lo // block_n)
        last = (kv_len - 1) // block_n if hi >= kv_len else hi // block_n - 1
        count += max(0, last - first + 1)
    return count


def plan_stats(mask: Mask, block_m: int = 128, block_n: int = 128) -> dict:
    """The exact fields of ``compilemask plan --json`` (less timings and descriptor size).

    Per query block, a key tile is empty when no row of the block meets it (it misses the
    union of the rows), full when every row sees all its in-range keys (it lies inside the
    intersection), partial otherwise."""
    if block_m < 1 or block_n < 1:
        raise ValueError("tile sides must be positive")
    q_len, kv_len = mask.q_len, mask.kv_len
    visible = empty_rows = max_intervals = 0
    nonempty = full = computed = 0
    for m0 in range(0, q_len, block_m):
        m1 = min(q_len, m0 + block_m)
        rows = mask.rows(m0, m1)
        for row in rows:
            visible += sum(hi - lo for lo, hi in row)
            empty_rows += not row
            max_intervals = max(max_intervals, len(row))
        union, inter = union_and_intersection(rows)
        count, width = touched_tiles(union, block_n, kv_len)
        nonempty += count
        computed += (m1 - m0) * width
        full += covered_tiles(inter, block_n, kv_len)
    total = -(-q_len // block_m) * -(-kv_len // block_n)
    return {
        "q_len": q_len,
        "kv_len": kv_len,
        "visible_pairs": visible,
        "empty_rows": empty_rows,
        "max_intervals_per_row": max_intervals,
        "tiles": {"full": full, "partial": nonempty - full, "empty": total - nonempty},
        "computed_pairs": computed,
    }


def intervals_json(mask: Mask, start: int, stop: int) -> dict:
    """The object ``compilemask intervals --rows start:stop --json`` prints."""
    rows = mask.rows(start, stop)
    return {"rows": [{"q": start + i, "intervals": [[lo, hi] for lo, hi in row]}
                     for i, row in enumerate(rows)]}


# --------------------------------------------------------------------------- self-test


def _dense_stats(rows_bits: list[list[bool]], block_m: int, block_n: int) -> dict:
    """Plan statistics straight from a dense boolean matrix (tile by tile counting)."""
    q_len, kv_len = len(rows_bits), len(rows_bits[0])
    full = partial = empty = computed = 0
    prefix = []
    for bits in rows_bits:
        acc = [0]
        for b in bits:
            acc.append(acc[-1] + b)
        prefix.append(acc)
    for m0 in range(0, q_len, block_m):
        m1 = min(q_len, m0 + block_m)
        for n0 in range(0, kv_len, block_n):
            n1 = min(kv_len, n0 + block_n)
            seen = sum(prefix[q][n1] - prefix[q][n0] for q in range(m0, m1))
            area = (m1 - m0) * (n1 - n0)
            if seen == 0:
                empty += 1
            else:
                computed += area
                if seen == area:
                    full += 1
                else:
                    partial += 1
    runs = [_runs(bits) for bits in rows_bits]
    return {
        "q_len": q_len,
        "kv_len": kv_len,
        "visible_pairs": sum(p[-1] for p in prefix),
        "empty_rows": sum(not r for r in runs),
        "max_intervals_per_row": max(len(r) for r in runs),
        "tiles": {"full": full, "partial": partial, "empty": empty},
        "computed_pairs": computed,
    }


def _runs(bits: list[bool]) -> Row:
    """Maximal runs of True in a boolean list."""
    out: Row = []
    start = None
    for k, b in enumerate(bits + [False]):
        if b and start is None:
            start = k
        elif not b and start is not None:
            out.append((start, k))
            start = None
    return out


# Self-test cases: (builtin name, q_len, parameters). Small sizes and scaled-down parameters
# so that segment boundaries, cut segments, zero lengths and interval merging all occur.
SELFTEST_CASES: list[tuple[str, int, dict]] = [
    ("causal", 300, {}),
    ("causal", 1100, {}),
    ("sliding_window", 1000, {}),
    ("sliding_window", 1000, {"window": 100}),
    ("sliding_window", 300, {"window": 1}),
    ("sliding_window", 300, {"window": 0}),
    ("document_causal", 1100, {}),
    ("document_causal", 1000, {"lengths": [100, 0, 37, 250, 1, 64]}),
    ("hstu", 1100, {}),
    ("hstu", 1200, {"lengths": [200, 150, 3, 0, 30, 1, 300, 9, 17]}),
    ("hstu", 900, {"lengths": [64, 5, 100, 2, 40], "contextual": 0, "target_divisor": 3}),
    ("hstu", 900, {"lengths": [64, 5, 100, 2, 40], "contextual": 20, "target_divisor": 2}),
    ("shared_prefix", 1100, {}),
    ("shared_prefix", 1000, {"prompts": [60, 0, 25], "responses": [10, 0, 7, 30, 5, 1, 12, 8, 3],
                             "group": 4}),
    ("shared_prefix", 1500, {"prompts": [192, 96, 128, 256],
                             "responses": [n // 16 for n in RESPONSES]}),
    ("shared_prefix", 700, {"prompts": [50, 30], "responses": [20, 10, 5], "group": 0}),
    ("clear", clear_length(8), {}),
    ("clear", clear_length(13), {}),
    ("clear", clear_length(20), {}),
    ("clear", clear_length(13, 16), {"radius": 3, "text": 16}),
    ("clear", clear_length(20, 0), {"radius": 5, "text": 0}),
    ("clear", clear_length(17, 40), {"radius": 1, "text": 40}),
    ("clear", clear_length(11, 7), {"radius": 0, "text": 7}),
    ("trace_documents", 777, {}),
    ("trace_documents", 1500, {}),
    ("trace_prompt_groups", 1500, {}),
    ("trace_prompt_groups", 1300, {"group": 3}),
]
SELFTEST_TILES = [(1, 1), (7, 13), (16, 16), (64, 96), (128, 128)]


def _hand_checks() -> list[tuple[str, object, object]]:
    """(label, oracle value, value derived by hand from workloads.md)."""
    checks: list[tuple[str, object, object]] = []
    # W1 causal S=1000 at 128x128: 8 query blocks; block i meets key tiles 0..i, tile i
    # (the diagonal) is partial. Computed pairs: 7 blocks of 128 rows x 128(i+1) keys plus the
    # last block of 104 rows x 1000 keys.
    checks.append(("causal 1000", plan_stats(causal(1000)), {
        "q_len": 1000, "kv_len": 1000, "visible_pairs": 500500, "empty_rows": 0,
        "max_intervals_per_row": 1, "tiles": {"full": 28, "partial": 8, "empty": 28},
        "computed_pairs": 128 * 128 * 28 + 104 * 1000}))
    # W5 S=8192, w=4096: rows 0..4095 see q+1 keys, the other 4096 rows see 4096.
    checks.append(("sliding_window 8192 visible",
                   plan_stats(sliding_window(8192))["visible_pairs"],
                   4096 * 4097 // 2 + 4096 * 4096))
    # W6 S=32768: 25344 per cycle, then 4096 + 1024 and 8192 cut to 2304.
    docs = [4096, 1024, 8192, 512, 2048, 3072, 256, 6144, 4096, 1024, 2304]
    checks.append(("document_causal 32768 visible",
                   plan_stats(document_causal(32768))["visible_pairs"],
                   sum(n * (n + 1) // 2 for n in docs)))
    # W2 one user, S=2048: T=256, E=1792; 8 contextual rows x 1792, history rows i=8..1791 see
    # i+1 keys, 256 targets see 1792+1; the first target (q == E) merges into one interval.
    h = plan_stats(hstu(2048))
    checks.append(("hstu 2048 visible", h["visible_pairs"],
                   8 * 1792 + (1792 * 1793 // 2 - 36) + 256 * 1793))
    checks.append(("hstu 2048 max intervals", h["max_intervals_per_row"], 2))
    checks.append(("hstu 2048 rows 1791..1793", hstu(2048).rows(1791, 1794),
                   [[(0, 1792)], [(0, 1793)], [(0, 1792), (1793, 1794)]]))
    # W3 S=3456: the 3072 prompt (triangle), then one response of 384 that directly follows
    # the prompt, so every row has one interval.
    sp = plan_stats(shared_prefix(3072 + 384))
    checks.append(("shared_prefix 3456 visible", sp["visible_pairs"],
                   3072 * 3073 // 2 + 384 * 3072 + 384 * 385 // 2))
    checks.append(("shared_prefix 3456 max intervals", sp["max_intervals_per_row"], 1))
    checks.append(("shared_prefix second response", shared_prefix(4000).rows(3456, 3458),
                   [[(0, 3072), (3456, 3457)], [(0, 3072), (3456, 3458)]]))
    # W4 n=180: 512 text rows see all 32912 keys; interior rows have 31 image runs + text.
    c = plan_stats(clear(clear_length(180)))
    checks.append(("clear 180 max intervals", c["max_intervals_per_row"], 32))
    checks.append(("clear 180 text row", clear(32912).rows(511, 512), [[(0, 32912)]]))
    # Middle of the image (y = x = 90): dy = 0 gives |dx| <= 15, dy = +-15 gives |dx| <= 5
    # (225 + 25 < 256 <= 225 + 36).
    mid = clear(32912).rows(512 + 90 * 180 + 90, 512 + 90 * 180 + 91)[0]
    centre = 512 + 90 * 180 + 90
    checks.append(("clear 180 centre row dy=0", mid[16], (centre - 15, centre + 16)))
    checks.append(("clear 180 centre row dy=-15", mid[1],
                   (centre - 15 * 180 - 5, centre - 15 * 180 + 6)))
    # The dilated window, window 7, dilation 3: row 10 sees 10, 7, 4 (4 = 10 - 6 > 10 - 7).
    checks.append(("dilated row 10", dilated_window(20, 7, 3).rows(10, 11), [[(4, 5), (7, 8),
                                                                              (10, 11)]]))
    checks.append(("dilated row 1", dilated_window(20, 7, 3).rows(1, 2), [[(1, 2)]]))
    checks.append(("dilated 20 visible", plan_stats(dilated_window(20, 7, 3))["visible_pairs"],
                   sum(len(range(q, max(-1, q - 7), -3)) for q in range(20))))
    checks.append(("empty rows (defaults, 32K)",
                   [plan_stats(BUILTINS[n](headline_length(n, 32768)), 512, 512)["empty_rows"]
                    for n in BUILTINS], [0] * 8))
    return checks


def _describe(params: dict) -> str:
    """Short form of self-test parameters (long lists abbreviated)."""
    return " ".join(
        f"{k}=[{v[0]}, {v[1]}, ... ({len(v)} entries)]" if isinstance(v, list) and len(v) > 9
        else f"{k}={v}" for k, v in params.items())


def selftest() -> int:
    """Compare the interval oracle with a dense evaluation of dense_reference.py and with
    hand-derived values; print one line per check and return the number of failures."""
    from dense_reference import dense_predicate

    failures = 0
    for name, q_len, params in SELFTEST_CASES:
        t0 = time.perf_counter()
        mask = BUILTINS[name](q_len, **params)
        visible = dense_predicate(name, q_len, **params)
        bits = [[visible(q, k) for k in range(q_len)] for q in range(q_len)]
        problems = []
        rows = mask.rows(0, q_len)
        for q, row in enumerate(rows):
            if row != _runs(bits[q]):
                problems.append(f"row {q}: oracle {row} dense {_runs(bits[q])}")
                break
        for a, b in [(0, q_len), (q_len // 3, q_len // 2), (q_len - 1, q_len)]:
            if mask.rows(a, b) != rows[a:b]:
                problems.append(f"rows({a}, {b}) differs from rows(0, q_len)[{a}:{b}]")
        for bm, bn in SELFTEST_TILES:
            got, want = plan_stats(mask, bm, bn), _dense_stats(bits, bm, bn)
            if got != want:
                problems.append(f"tile {bm}x{bn}: oracle {got} dense {want}")
        label = " ".join(filter(None, [name, f"S={q_len}", _describe(params)]))
        print(f"{'ok  ' if not problems else 'FAIL'} dense {label} "
              f"({time.perf_counter() - t0:.1f}s)")
        for p in problems:
            print(f"     {p}")
        failures += bool(problems)
    for label, got, want in _hand_checks():
        ok = got == want
        print(f"{'ok  ' if ok else 'FAIL'} hand  {label}")
        if not ok:
            print(f"     oracle {got}\n     expected {want}")
        failures += not ok
    print(f"self-test: {failures} failure(s)")
    return failures


# --------------------------------------------------------------------------- command line


def parse_tile(text: str) -> tuple[int, int]:
    m, _, n = text.partition("x")
    return int(m), int(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--selftest", action="store_true", help="run the self-test")
    sub = parser.add_subparsers(dest="command")
    plan = sub.add_parser("plan", help="print the plan statistics of a built-in mask")
    plan.add_argument("name", choices=BUILTINS)
    plan.add_argument("q_len", type=int)
    plan.add_argument("--tile", type=parse_tile, default=(128, 128), help="MxN (default 128x128)")
    rows = sub.add_parser("intervals", help="print the intervals of some rows")
    rows.add_argument("name", choices=BUILTINS)
    rows.add_argument("q_len", type=int)
    rows.add_argument("--rows", required=True, help="A:B, rows A..B-1")
    sub.add_parser("summary", help="visible pairs of every workload at 8K and 32K")
    args = parser.parse_args(argv)

    if args.selftest:
        return 1 if selftest() else 0
    if args.command == "plan":
        print(json.dumps(plan_stats(BUILTINS[args.name](args.q_len), *args.tile)))
    elif args.command == "intervals":
        a, _, b = args.rows.partition(":")
        print(json.dumps(intervals_json(BUILTINS[args.name](args.q_len), int(a), int(b))))
    elif args.command == "summary":
        for nominal in (8192, 32768):
            for name, build in BUILTINS.items():
                q_len = headline_length(name, nominal)
                t0 = time.perf_counter()
                visible = plan_stats(build(q_len))["visible_pairs"]
                print(f"{name:20s} S={q_len:6d} visible_pairs={visible:11d} "
                      f"fraction={visible / q_len ** 2:.4f} ({time.perf_counter() - t0:.2f}s)")
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
