"""The explorer page (`compilemask show ... -o NAME.html`) in a real headless Chromium:
it loads without network and without script errors, lists the plan's statistics, zooms
with the wheel from the whole mask down to single tokens, pans by dragging, and the text
under the pointer and the screenshot's pixels agree with the plan's intervals and tiles
as the CLI reports them."""

from __future__ import annotations

import io
import re

import pytest
from PIL import Image
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.actions.action_builder import ActionBuilder
from selenium.webdriver.common.actions.wheel_input import ScrollOrigin

from conftest import COLOURS, tile_facts

# A window with an attention sink: two intervals per row in most rows, at 64 x 64 tiles
# full, partial and empty tiles all occur.
SINK_WINDOW = "mask = (k <= q & q - k < 150) | k < 4;\n"
Q_LEN, TILE = 300, 64


@pytest.fixture(scope="module")
def sink(tmp_path_factory, cli):
    d = tmp_path_factory.mktemp("sink")
    src = d / "sink.cmask"
    src.write_text(SINK_WINDOW)
    mask = (str(src), "--q-len", str(Q_LEN), "--tile", f"{TILE}x{TILE}")
    page = cli.page(d / "sink.html", *mask)
    return mask, page, cli.rows(mask, 0, Q_LEN)


def load(browser, page):
    browser.get(page.as_uri())
    assert browser.execute_script("return window.cmExplorer && window.cmExplorer.ready")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def hover(browser, q, k):
    """Moves the pointer to the pixel nearest token (q, k)'s centre; returns the hover
    text and the pixel."""
    x, y = browser.execute_script(f"return window.cmExplorer.clientOf({q}, {k})")
    x, y = round(x), round(y)
    actions = ActionBuilder(browser)
    actions.pointer_action.move_to_location(x, y)
    actions.perform()
    return browser.find_element("id", "hover").text, (x, y)


def parse_hover(text):
    """(q, k, visible, intervals, tile (m, n), class, (visible, pairs) or None)."""
    head = re.match(r"q = (\d+), k = (\d+): (visible|hidden)", text)
    assert head, text
    lines = text.splitlines()
    intervals = [tuple(map(int, m)) for m in re.findall(r"\[(\d+), (\d+)\)", lines[2])]
    tile = re.search(r"tile \(m (\d+), n (\d+)\): (\w+)", text)
    counts = re.search(r"(\d+) of (\d+) pairs visible", text)
    return (
        int(head[1]),
        int(head[2]),
        head[3] == "visible",
        intervals,
        (int(tile[1]), int(tile[2])),
        tile[3],
        (int(counts[1]), int(counts[2])) if counts else None,
    )


def check_hover(text, rows, want_q, want_k, slack):
    """The hover text names a token within `slack` of (want_q, want_k) and says of it what
    the CLI's intervals say: its row's intervals, whether k is visible, the tile's class
    and counts recomputed from the intervals."""
    q, k, seen, intervals, (m, n), cls, counts = parse_hover(text)
    assert abs(q - want_q) <= slack and abs(k - want_k) <= slack, (text, want_q, want_k)
    assert intervals == rows[q], (text, rows[q])
    assert seen == any(s <= k < e for s, e in rows[q]), text
    assert (m, n) == (q // TILE, k // TILE), text
    q0, k0 = m * TILE, n * TILE
    want_cls, visible, pairs = tile_facts(rows, q0, min(q0 + TILE, Q_LEN), k0, min(k0 + TILE, Q_LEN))
    assert cls == want_cls and counts == (visible, pairs), (text, want_cls, visible, pairs)
    return q, k


def screenshot(browser):
    return Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")


def expected_colour(rows, q, k):
    cls = tile_facts(rows, *tile_bounds(q, k))[0]
    hidden, visible = COLOURS[cls]
    return visible if any(s <= k < e for s, e in rows[q]) else hidden


def tile_bounds(q, k):
    q0, k0 = q // TILE * TILE, k // TILE * TILE
    return q0, min(q0 + TILE, Q_LEN), k0, min(k0 + TILE, Q_LEN)


def near(a, b, tol=3):
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def test_the_page_needs_no_network_and_lists_the_plans_statistics(browser, cli, sink):
    mask, page, _ = sink
    html = page.read_text()
    for ref in ("http://", "https://", "<link", " src="):
        assert ref not in html, ref
    load(browser, page)
    stats = dict(
        (row.find_elements("tag name", "td")[0].text, row.find_elements("tag name", "td")[1].text)
        for row in browser.find_elements("css selector", "#stats tr")
    )
    plan = cli.plan(*mask)
    assert stats["visible pairs"].split()[0] == str(plan["visible_pairs"])
    t = plan["tiles"]
    assert stats["tiles"] == f"{t['full']} full, {t['partial']} partial, {t['empty']} empty"
    assert stats["q_len × kv_len"] == f"{Q_LEN} × {Q_LEN}"


def test_hover_on_the_whole_mask_reads_rows_and_tiles(browser, sink):
    _, page, rows = sink
    load(browser, page)
    view = browser.execute_script("return window.cmExplorer.view()")
    assert view["rows"][0] <= 0 and view["rows"][1] >= Q_LEN, view
    # Under 1 pixel per token a pointer pixel may fall on a neighbour: slack 1.
    for q, k in [(0, 0), (10, 200), (100, 2), (160, 100), (299, 299), (250, 40), (200, 199)]:
        text, _ = hover(browser, q, k)
        check_hover(text, rows, q, k, slack=1)


def test_wheel_zooms_to_single_tokens_whose_pixels_match_the_plan(browser, sink):
    _, page, rows = sink
    load(browser, page)
    # Zoom about token (130, 60): partial tile (2, 0) near the band's lower edge and the sink.
    q, k = 130, 60
    for _ in range(12):
        x, y = browser.execute_script(f"return window.cmExplorer.clientOf({q}, {k})")
        ActionChains(browser).scroll_from_origin(
            ScrollOrigin.from_viewport(round(x), round(y)), 0, -400
        ).perform()
        if browser.execute_script("return window.cmExplorer.view().rowsPerPixel") <= 1 / 24:
            break
    view = browser.execute_script("return window.cmExplorer.view()")
    assert view["rowsPerPixel"] <= 1 / 24 and view["keysPerPixel"] <= 1 / 24, view
    assert view["rows"][0] <= q < view["rows"][1] and view["keys"][0] <= k < view["keys"][1], view
    # Every token fully in view: the pixel at its centre has its class's colour.
    r0, r1 = int(view["rows"][0]) + 1, int(view["rows"][1]) - 1
    c0, c1 = int(view["keys"][0]) + 1, int(view["keys"][1]) - 1
    assert r1 - r0 >= 4 and c1 - c0 >= 4, view
    text, _ = hover(browser, q, k)
    check_hover(text, rows, q, k, slack=0)
    shot = screenshot(browser)
    tokens = [
        (tq, tk) for tq in range(max(r0, 0), min(r1, Q_LEN)) for tk in range(max(c0, 0), min(c1, Q_LEN))
    ]
    centres = browser.execute_script(
        "return arguments[0].map(([q, k]) => window.cmExplorer.clientOf(q, k))", tokens
    )
    seen = set()
    for (tq, tk), (x, y) in zip(tokens, centres):
        got = shot.getpixel((round(x), round(y)))
        want = expected_colour(rows, tq, tk)
        assert near(got, want), (tq, tk, got, want)
        seen.add(want)
    # The view holds both visible and hidden tokens, so the check can tell them apart.
    assert len(seen) >= 2, seen
    # At one token per 24+ pixels, the pointer names exactly the token it is on.
    for dq, dk in [(0, 1), (1, 0), (-1, -1), (2, 3)]:
        text, _ = hover(browser, q + dq, k + dk)
        check_hover(text, rows, q + dq, k + dk, slack=0)


def test_drag_pans_by_the_pointers_travel(browser, sink):
    _, page, _ = sink
    load(browser, page)
    browser.execute_script("window.cmExplorer.setView(100, 140, 100, 140)")
    before = browser.execute_script("return window.cmExplorer.view()")
    x, y = browser.execute_script("return window.cmExplorer.clientOf(120, 120)")
    actions = ActionBuilder(browser)
    pointer = actions.pointer_action
    pointer.move_to_location(round(x), round(y)).pointer_down()
    pointer.move_to_location(round(x) - 100, round(y) - 50).pointer_up()
    actions.perform()
    after = browser.execute_script("return window.cmExplorer.view()")
    assert after["keys"][0] - before["keys"][0] == pytest.approx(100 * before["keysPerPixel"], rel=1e-6)
    assert after["rows"][0] - before["rows"][0] == pytest.approx(50 * before["rowsPerPixel"], rel=1e-6)


@pytest.mark.parametrize(
    "mask,last",
    [
        (("--builtin", "causal"), [(0, 131072)]),
        (("--builtin", "sliding_window"), [(131072 - 4096, 131072)]),
    ],
)
def test_128k_tokens_stay_small_and_fast(browser, cli, tmp_path, mask, last):
    mask = (*mask, "--q-len", "131072")
    page = cli.page(tmp_path / "big.html", *mask)
    # Runs, not rows: the whole page is a few tens of KB.
    assert page.stat().st_size < 256 * 1024, page.stat().st_size
    load(browser, page)
    fit_ms = browser.execute_script("return window.cmExplorer.frameMs")
    browser.execute_script("window.cmExplorer.setView(65000, 65100, 64950, 65150)")
    zoom_ms = browser.execute_script("return window.cmExplorer.frameMs")
    browser.execute_script("window.cmExplorer.setView(0, 131072, 0, 131072)")
    refit_ms = browser.execute_script("return window.cmExplorer.frameMs")
    # Generous bounds for a loaded 2-core CI machine; a frame is tens of ms.
    assert max(fit_ms, zoom_ms, refit_ms) < 1500, (fit_ms, zoom_ms, refit_ms)
    got = browser.execute_script("return window.cmExplorer.rowIntervals(131071)")
    assert [tuple(iv) for iv in got] == last == cli.rows(mask, 131071, 131072)[131071]
