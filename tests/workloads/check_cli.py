"""Check ``compilemask plan`` and ``compilemask intervals`` against the independent oracle.

For every built-in workload (W1-W8) at several lengths and tile shapes, and the standard
library's dilated window (strided runs) at a few parameters, runs::

    compilemask plan --builtin NAME --q-len S --tile MxN --json
    compilemask intervals --builtin NAME --q-len S --rows A:B --json

and compares the plan fields and the row intervals exactly with ``oracle.py``. Prints one line
per check and a summary; exits 0 when everything matches, 1 on any mismatch, 2 when the binary
is missing.

Usage::

    python3 tests/workloads/check_cli.py [BINARY] [--lengths 1000,4097] [--grids 32,90]
                                          [--tiles 128x128,64x96]

``BINARY`` defaults to ``$COMPILEMASK``, else ``target/release/compilemask`` of the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import oracle

LENGTHS = (1000, 4097, 8192, 32768)
CLEAR_GRIDS = (32, 90, 180)
TILES = ((128, 128), (64, 96))
PLAN_FIELDS = ("q_len", "kv_len", "visible_pairs", "empty_rows", "max_intervals_per_row",
               "tiles", "computed_pairs")
EDGE_ROWS = 32  # rows checked at the start, the middle and the end
BOUNDARY_ROWS = 3  # rows checked on each side of a segment boundary
TIMEOUT_S = 300


def run_cli(binary: str, args: list[str]) -> tuple[dict | None, str]:
    """Run ``binary args`` and parse its JSON; returns (object, "") or (None, reason)."""
    cmd = [binary, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT_S}s: {' '.join(cmd)}"
    except OSError as e:
        return None, f"could not run {' '.join(cmd)}: {e}"
    if done.returncode != 0:
        return None, (f"exit {done.returncode}: {' '.join(cmd)}\n"
                      f"     stderr: {done.stderr.strip()[-2000:]}")
    try:
        return json.loads(done.stdout), ""
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e}) from {' '.join(cmd)}: {done.stdout[:500]!r}"


def set_args(params: dict) -> list[str]:
    """``--set NAME=VALUE`` for every parameter."""
    return [a for k, v in params.items() for a in ("--set", f"{k}={v}")]


def check_plan(binary: str, name: str, mask: oracle.Mask, tile: tuple[int, int],
               params: dict | None = None) -> list[str]:
    """Problems found comparing ``plan`` with the oracle (empty list when it matches)."""
    got, error = run_cli(binary, ["plan", "--builtin", name, "--q-len", str(mask.q_len),
                                  "--tile", f"{tile[0]}x{tile[1]}", "--json",
                                  *set_args(params or {})])
    if got is None:
        return [error]
    want = oracle.plan_stats(mask, *tile)
    return [f"{field}: cli {got.get(field, '<missing>')} oracle {want[field]}"
            for field in PLAN_FIELDS if got.get(field) != want[field]]


def check_intervals(binary: str, name: str, mask: oracle.Mask, start: int, stop: int,
                    params: dict | None = None) -> list[str]:
    """Problems found comparing ``intervals --rows start:stop`` with the oracle."""
    got, error = run_cli(binary, ["intervals", "--builtin", name, "--q-len", str(mask.q_len),
                                  "--rows", f"{start}:{stop}", "--json",
                                  *set_args(params or {})])
    if got is None:
        return [error]
    want = oracle.intervals_json(mask, start, stop)["rows"]
    rows = got.get("rows") if isinstance(got, dict) else None
    if not isinstance(rows, list):
        return [f"no 'rows' list in the output: {str(got)[:300]}"]
    for cli_row, oracle_row in zip(rows, want):
        if cli_row != oracle_row:
            return [f"first differing row q={oracle_row['q']}: cli {cli_row} "
                    f"oracle {oracle_row}"]
    if len(rows) != len(want):
        return [f"cli printed {len(rows)} rows, oracle {len(want)}"]
    return []


def row_ranges(mask: oracle.Mask) -> list[tuple[int, int]]:
    """Row ranges to compare: the start, the middle, the end and a few segment boundaries
    (the first three, the middle one and the last two)."""
    q_len = mask.q_len
    mid = q_len // 2
    ranges = [(0, EDGE_ROWS), (mid - EDGE_ROWS // 2, mid + EDGE_ROWS // 2),
              (q_len - EDGE_ROWS, q_len)]
    bounds = mask.boundaries()
    for i in sorted({0, 1, 2, len(bounds) // 2, len(bounds) - 2, len(bounds) - 1}):
        if 0 <= i < len(bounds):
            ranges.append((bounds[i] - BOUNDARY_ROWS, bounds[i] + BOUNDARY_ROWS))
    clipped = {(max(0, a), min(q_len, b)) for a, b in ranges}
    return sorted(r for r in clipped if r[0] < r[1])


def cases(lengths: list[int], grids: list[int]) -> list[tuple[str, int, dict]]:
    """(builtin name, q_len, parameters): every workload at every length, CLEAR at its
    grids, and the masks with strided runs at their own parameters and lengths."""
    out = []
    for name in oracle.BUILTINS:
        sizes = [oracle.clear_length(n) for n in grids] if name == "clear" else lengths
        out += [(name, q_len, {}) for q_len in sizes]
    for name, (_, settings) in oracle.STRIDED.items():
        out += [(name, q_len, params) for params, sizes in settings for q_len in sizes]
    return out


def make_mask(name: str, q_len: int, params: dict) -> oracle.Mask:
    """The oracle's mask of a case."""
    if name in oracle.STRIDED:
        return oracle.STRIDED[name][0](q_len, **params)
    return oracle.BUILTINS[name](q_len)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _tile_list(text: str) -> list[tuple[int, int]]:
    return [oracle.parse_tile(t) for t in text.split(",") if t]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary", nargs="?", default=os.environ.get(
        "COMPILEMASK", str(oracle.REPO_ROOT / "target" / "release" / "compilemask")),
        help="path of the compilemask binary")
    parser.add_argument("--lengths", type=_int_list, default=list(LENGTHS),
                        help="comma-separated q_len values for all but CLEAR")
    parser.add_argument("--grids", type=_int_list, default=list(CLEAR_GRIDS),
                        help="comma-separated CLEAR grid sides n (q_len = 512 + n*n)")
    parser.add_argument("--tiles", type=_tile_list, default=list(TILES),
                        help="comma-separated tile shapes MxN")
    args = parser.parse_args(argv)

    binary = Path(args.binary)
    if not binary.is_file() or not os.access(binary, os.X_OK):
        print(f"compilemask binary not found or not executable: {binary} "
              "(pass its path or set COMPILEMASK)")
        return 2

    checks = failures = 0
    first_failure = ""
    for name, q_len, params in cases(args.lengths, args.grids):
        mask = make_mask(name, q_len, params)
        label = " ".join([name, *set_args(params)[1::2]])
        results = [(f"plan {label} S={q_len} tile={m}x{n}",
                    check_plan(str(binary), name, mask, (m, n), params)) for m, n in args.tiles]
        results += [(f"intervals {label} S={q_len} rows={a}:{b}",
                     check_intervals(str(binary), name, mask, a, b, params))
                    for a, b in row_ranges(mask)]
        for label, problems in results:
            checks += 1
            print(f"{'ok  ' if not problems else 'FAIL'} {label}", flush=True)
            for p in problems:
                print(f"     {p}")
            if problems:
                failures += 1
                first_failure = first_failure or label
    print(f"{checks} checks, {failures} failed"
          + (f" (first: {first_failure})" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
