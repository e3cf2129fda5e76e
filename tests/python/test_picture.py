"""Plan.to_image / Plan.show: PNG and SVG pictures, checked for size and content (pixel
colours of token cells against the plan's own intervals and tiles)."""

from __future__ import annotations

import struct
import zlib

import pytest

import compilemask as cm

FULL_DARK = (20, 110, 45)
PARTIAL_DARK = (200, 105, 0)
PARTIAL_LIGHT = (252, 230, 175)
EMPTY_LIGHT = (235, 235, 235)


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert (depth, colour, interlace) == (8, 2, 0)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride, rows, prev = width * 3, [], bytearray(width * 3)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - 3] if i >= 3 else 0
            b, c = prev[i], (prev[i - 3] if i >= 3 else 0)
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def plot_of(svg: str) -> tuple[int, int, int, int]:
    """The plot frame (x, y, width, height): the SVG's one rect with a #222 stroke."""
    for line in svg.splitlines():
        if line.startswith("<rect") and 'stroke="#222"' in line:
            get = lambda k: float(line.split(f'{k}="')[1].split('"')[0])  # noqa: E731
            return int(get("x")), int(get("y")), int(get("width")), int(get("height"))
    raise AssertionError("no plot frame")


def test_png_cells_match_the_plan():
    plan = cm.builtin("sliding_window", window=4).plan(24, block_size=8)
    png = plan.to_image()
    svg = plan.to_image("svg").decode()
    width, height, rows = decode_png(png)
    assert f'width="{width}" height="{height}"' in svg
    x0, y0, w, h = plot_of(svg)
    assert (w, h) == (24 * 26, 24 * 26)  # 640 // 24 = 26 px per token
    for q in range(24):
        iv = plan.intervals(q)
        for k in range(24):
            x, y = x0 + k * 26 + 13, y0 + q * 26 + 13
            got = tuple(rows[y][3 * x:3 * x + 3])
            visible = any(s <= k < e for s, e in iv)
            # The tile's class from the plan's intervals over the tile's pairs.
            m0, n0 = q // 8 * 8, k // 8 * 8
            seen = sum(any(s <= j < e for s, e in plan.intervals(i))
                       for i in range(m0, m0 + 8) for j in range(n0, n0 + 8))
            cls = "empty" if seen == 0 else "full" if seen == 64 else "partial"
            want = {("full", True): FULL_DARK, ("partial", True): PARTIAL_DARK,
                    ("partial", False): PARTIAL_LIGHT, ("empty", False): EMPTY_LIGHT}[cls, visible]
            assert got == want, (q, k, got, want)


def test_svg_title_legend_and_zoom():
    plan = cm.builtin("hstu").plan(4096, lengths=[1024, 2048, 1024])
    svg = plan.to_image("svg", rows=(900, 1100), cols=(0, 1100)).decode()
    for text in ("hstu", "q_len 4096 × kv_len 4096", "view: rows 900:1100 × keys 0:1100",
                 "segments user: 3 segments, 2 in view", "visible, full tile", "empty tile"):
        assert text in svg, text


def test_show_saves_and_displays(tmp_path):
    plan = cm.compile("mask = k <= q - h;").plan(16, num_heads=3)
    img = plan.show(h=2)
    assert img._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "h 2 of 3" in img.svg
    img.save(tmp_path / "m.png")
    img.save(tmp_path / "m.SVG")
    assert (tmp_path / "m.png").read_bytes() == img.png
    assert (tmp_path / "m.SVG").read_text().startswith("<svg")
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        img.save(tmp_path / "m.jpg")
    # Planned with one head, the picture says the mask reads h.
    one = cm.compile("mask = k <= q - h;").plan(16)
    assert "depends on the head (reads h or num_heads)" in one.to_image("svg").decode()


def test_bad_views_are_refused():
    plan = cm.builtin("causal").plan(8)
    with pytest.raises(IndexError, match="out of range"):
        plan.show(h=1)
    with pytest.raises(IndexError, match="rows 4:9 is out of range"):
        plan.to_image(rows=(4, 9))
    with pytest.raises(ValueError, match="png"):
        plan.to_image("jpeg")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match='format must be "png" or "svg", got NoneType None'):
        plan.to_image(None)  # type: ignore[arg-type]
    for bad, err, message in [((0,), ValueError, "rows must be a .start, stop. pair of ints.*got 1 values"),
                              ((0, 1, 2), ValueError, "got 3 values"),
                              (5, TypeError, "rows must be a .start, stop. pair.*got int"),
                              ("0:4", TypeError, "got str")]:
        with pytest.raises(err, match=message):
            plan.to_image(rows=bad)
        with pytest.raises(err, match=message.replace("rows", "cols")):
            plan.show(cols=bad)


def test_packed_plan_names_samples():
    plan = cm.builtin("causal").plan(cu_seqlens_q=[0, 5, 12], cu_seqlens_k=[0, 3, 12])
    assert "packed samples: 2" in plan.to_image("svg").decode()
