"""Shared fixtures of the Python package tests.

The tests import the installed `compilemask` wheel (scripts/test-python.sh builds it and
installs it into a fresh virtual environment) and the independent workloads.md oracle in
tests/workloads (standard library only). Tests that need torch or numpy skip without them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
if str(WORKLOADS) not in sys.path:
    sys.path.insert(0, str(WORKLOADS))


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch", reason="torch is not installed")


@pytest.fixture(scope="session")
def np():
    return pytest.importorskip("numpy", reason="numpy is not installed")


def runs(bits) -> list[tuple[int, int]]:
    """Maximal runs of truthy entries, as half-open intervals."""
    out: list[tuple[int, int]] = []
    start = None
    for k, b in enumerate(list(bits) + [False]):
        if b and start is None:
            start = k
        elif not b and start is not None:
            out.append((start, k))
            start = None
    return out
