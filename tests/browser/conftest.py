"""Fixtures of the explorer-page tests: the `compilemask` binary (CM_BIN), a headless
Chromium from the Debian packages driven by Selenium through the packaged chromedriver,
and the independent facts a page is checked against (the CLI's `intervals --json` and
`plan --json`, tile classes recomputed from the intervals).

scripts/test-browser.sh installs what these need and runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# The legend's colours (cm-view's raster.rs): (hidden, visible) per tile class.
COLOURS = {
    "full": ((200, 235, 200), (20, 110, 45)),
    "partial": ((252, 230, 175), (200, 105, 0)),
    "empty": ((235, 235, 235), (110, 110, 110)),
}


@pytest.fixture(scope="session")
def cli():
    path = os.environ.get("CM_BIN") or shutil.which("compilemask")
    if not path or not Path(path).exists():
        pytest.fail("set CM_BIN to the compilemask binary (scripts/test-browser.sh does)")
    return Cli(path)


class Cli:
    def __init__(self, path: str):
        self.path = path

    def run(self, *args: str) -> str:
        done = subprocess.run([self.path, *args], capture_output=True, text=True)
        assert done.returncode == 0, f"compilemask {' '.join(args)}: {done.stderr}"
        return done.stdout

    def page(self, out: Path, *mask: str) -> Path:
        self.run("show", *mask, "-o", str(out))
        return out

    def plan(self, *mask: str) -> dict:
        return json.loads(self.run("plan", *mask, "--json"))

    def rows(self, mask: tuple[str, ...], start: int, end: int) -> dict[int, list[tuple[int, int]]]:
        """Row q's visible key intervals for q in start..end, from `intervals --json`."""
        v = json.loads(self.run("intervals", *mask, "--rows", f"{start}:{end}", "--json"))
        return {r["q"]: [tuple(iv) for iv in r["intervals"]] for r in v["rows"]}


def tile_facts(rows: dict[int, list[tuple[int, int]]], q0: int, q1: int, k0: int, k1: int):
    """(class, visible pairs, pairs) of the tile of rows q0..q1 and keys k0..k1."""
    visible = sum(
        max(0, min(e, k1) - max(s, k0)) for q in range(q0, q1) for s, e in rows[q]
    )
    pairs = (q1 - q0) * (k1 - k0)
    cls = "full" if visible == pairs else "partial" if visible else "empty"
    return cls, visible, pairs


@pytest.fixture(scope="session")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail("chromium and chromedriver are missing (Debian: chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver), options=options)
    yield d
    d.quit()
