"use strict";
// The CompileMask explorer: draws a planned mask from its embedded row runs and tile runs
// (see cm-view's explorer.rs for the encoding), never from a dense mask. Coordinates: q is
// the query row (down), k the key (across), both 0-based; intervals are half-open.
(function () {
  const D = JSON.parse(document.getElementById("cm-data").textContent);
  const QLEN = D.q_len, KVLEN = D.kv_len, BM = D.block[0], BN = D.block[1];
  // Margins of the plot inside the canvas, in CSS pixels: axis labels left and top.
  const LEFT = 64, TOP = 34, RIGHT = 10, BOTTOM = 10;
  // Most pixels per token, and sampled rows per frame (the cost bound of a frame).
  const MAX_PX_PER_TOKEN = 64, ROW_BUDGET = 1 << 17;
  const OUTSIDE = [255, 255, 255];
  const GROUP_COLOURS = ["#2f5f9e", "#7b3f9e", "#138a72", "#b03a2e", "#6d5a3a", "#4a5a6a"];

  function ints(b64) {
    const s = atob(b64), n = s.length >> 2, a = new Int32Array(n);
    for (let i = 0, j = 0; i < n; i++, j += 4) {
      a[i] = s.charCodeAt(j) | (s.charCodeAt(j + 1) << 8) | (s.charCodeAt(j + 2) << 16) | (s.charCodeAt(j + 3) << 24);
    }
    return a;
  }

  // Row runs: q0, n, m, m x (start, end), and when n > 1, m x (dstart, dend).
  const R = ints(D.rows);
  const runQ = [], runAt = [];
  for (let i = 0; i < R.length;) {
    runQ.push(R[i]);
    runAt.push(i);
    const n = R[i + 1], m = R[i + 2];
    i += 3 + m * (n > 1 ? 4 : 2);
  }
  function runOf(q) {
    let lo = 0, hi = runQ.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (runQ[mid] <= q) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
  // Calls f(start, end) for each interval of row q (0 <= q < QLEN), in order; run is a
  // hint (the run of a nearby row) and the run of q is returned.
  function eachInterval(q, run, f) {
    while (run + 1 < runQ.length && runQ[run + 1] <= q) run++;
    while (run > 0 && runQ[run] > q) run--;
    let i = runAt[run];
    const q0 = R[i], n = R[i + 1], m = R[i + 2], d = q - q0;
    i += 3;
    const st = i + 2 * m;
    for (let j = 0; j < m; j++) {
      let s = R[i + 2 * j], e = R[i + 2 * j + 1];
      if (n > 1) { s += d * R[st + 2 * j]; e += d * R[st + 2 * j + 1]; }
      f(s, e);
    }
    return run;
  }
  function rowIntervals(q) {
    const out = [];
    eachInterval(q, runOf(q), (s, e) => out.push([s, e]));
    return out;
  }

  // Tile runs: the runs of query block m are TR[3 * TP[m] .. 3 * TP[m + 1]] = n0, n1, class.
  const TP = ints(D.tile_ptr), TR = ints(D.tiles);
  const CLASS_NAMES = ["empty", "partial", "full"];
  function tileClass(m, n) {
    let lo = TP[m], hi = TP[m + 1] - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (TR[3 * mid + 1] <= n) lo = mid + 1;
      else if (TR[3 * mid] > n) hi = mid - 1;
      else return TR[3 * mid + 2];
    }
    return 0;
  }
  const COL = [D.colours.empty, D.colours.partial, D.colours.full];

  const canvas = document.getElementById("plot");
  const ctx = canvas.getContext("2d");
  const $ = (id) => document.getElementById(id);
  // The view: the token at the plot's top-left corner and tokens per CSS pixel.
  const V = { r0: 0, c0: 0, rpp: 1, kpp: 1 };
  let cssW = 0, cssH = 0, dpr = 1, image = null, dirty = true, hovered = null;
  const api = { frames: 0, frameMs: 0, ready: false };

  function plotW() { return Math.max(1, cssW - LEFT - RIGHT); }
  function plotH() { return Math.max(1, cssH - TOP - BOTTOM); }

  // Shows rows ra..rb and keys ca..cb whole, same scale on both axes unless one side would
  // be thinner than 80 pixels (a 1 x 100,000 mask), centred.
  function setView(ra, rb, ca, cb) {
    ra = Math.max(0, Math.min(ra, QLEN - 1)); rb = Math.max(ra + 1, Math.min(rb, QLEN));
    ca = Math.max(0, Math.min(ca, KVLEN - 1)); cb = Math.max(ca + 1, Math.min(cb, KVLEN));
    const nr = rb - ra, nc = cb - ca, w = plotW(), h = plotH();
    let s = Math.max(nr / h, nc / w, 1 / MAX_PX_PER_TOKEN);
    V.rpp = Math.min(s, nr / Math.min(h, 80));
    V.kpp = Math.min(s, nc / Math.min(w, 80));
    V.rpp = Math.max(V.rpp, 1 / MAX_PX_PER_TOKEN);
    V.kpp = Math.max(V.kpp, 1 / MAX_PX_PER_TOKEN);
    V.r0 = ra + nr / 2 - (h / 2) * V.rpp;
    V.c0 = ca + nc / 2 - (w / 2) * V.kpp;
    dirty = true;
    draw();
  }
  function fit() { setView(0, QLEN, 0, KVLEN); }

  // Zooms by f (< 1 zooms in) about the plot point (x, y), in CSS pixels.
  function zoomAt(x, y, f) {
    const tq = V.r0 + y * V.rpp, tk = V.c0 + x * V.kpp;
    const maxR = 2 * Math.max(QLEN / Math.min(plotH(), 80), QLEN / plotH());
    const maxK = 2 * Math.max(KVLEN / Math.min(plotW(), 80), KVLEN / plotW());
    // One factor for both axes (the aspect stays), limited by both axes' bounds.
    const lo = Math.max(1 / MAX_PX_PER_TOKEN / V.rpp, 1 / MAX_PX_PER_TOKEN / V.kpp);
    const hi = Math.min(maxR / V.rpp, maxK / V.kpp);
    f = Math.min(Math.max(f, Math.min(lo, 1)), Math.max(hi, 1));
    V.rpp *= f; V.kpp *= f;
    V.r0 = tq - y * V.rpp; V.c0 = tk - x * V.kpp;
    dirty = true;
    draw();
  }

  // The mask raster of the current view at device resolution: each pixel's colour runs
  // from its tile class's light tint to the dark one with the square root of the visible
  // fraction of the tokens it covers (exact when a pixel row covers at most
  // ROW_BUDGET / height rows, else over that many rows spread evenly).
  function raster() {
    const W = Math.max(1, Math.round(plotW() * dpr)), H = Math.max(1, Math.round(plotH() * dpr));
    const rpp = V.rpp / dpr, kpp = V.kpp / dpr;
    const img = ctx.createImageData(W, H), px = img.data;
    const line = new Float64Array(W), diff = new Float64Array(W + 1);
    const cap = Math.max(1, Math.floor(ROW_BUDGET / H));
    // Keys each pixel column covers inside [0, KVLEN).
    const colKeys = new Float64Array(W), colN = new Int32Array(W);
    for (let x = 0; x < W; x++) {
      const a = V.c0 + x * kpp, b = a + kpp;
      colKeys[x] = Math.max(0, Math.min(b, KVLEN) - Math.max(a, 0));
      colN[x] = Math.floor((V.c0 + (x + 0.5) * kpp) / BN);
    }
    const kEnd = V.c0 + W * kpp;
    let run = 0;
    for (let y = 0; y < H; y++) {
      const ra = V.r0 + y * rpp, rb = ra + rpp;
      const qa = Math.max(0, Math.floor(ra)), qb = Math.min(QLEN, Math.ceil(rb));
      let o = 4 * y * W;
      if (qa >= qb) {
        for (let x = 0; x < W; x++, o += 4) { px[o] = OUTSIDE[0]; px[o + 1] = OUTSIDE[1]; px[o + 2] = OUTSIDE[2]; px[o + 3] = 255; }
        continue;
      }
      const span = Math.min(rb, QLEN) - Math.max(ra, 0);
      const sampled = qb - qa <= cap;
      const count = sampled ? qb - qa : cap;
      for (let i = 0; i < count; i++) {
        const q = sampled ? qa + i : qa + Math.floor(((i + 0.5) * (qb - qa)) / cap);
        const w = sampled ? Math.min(q + 1, rb) - Math.max(q, ra) : span / cap;
        run = eachInterval(q, run, (s, e) => {
          const a = Math.max(s, V.c0), b = Math.min(e, kEnd);
          if (a >= b) return;
          const xs = (a - V.c0) / kpp, xe = (b - V.c0) / kpp;
          const first = Math.min(W - 1, Math.floor(xs)), last = Math.min(W - 1, Math.max(1, Math.ceil(xe)) - 1);
          if (first === last) line[first] += (xe - xs) * kpp * w;
          else {
            line[first] += (first + 1 - xs) * kpp * w;
            line[last] += (xe - last) * kpp * w;
            diff[first + 1] += kpp * w;
            diff[last] -= kpp * w;
          }
        });
      }
      const qc = Math.min(QLEN - 1, Math.max(0, Math.floor(ra + rpp / 2)));
      const m = Math.floor(qc / BM);
      let acc = 0, t = TP[m];
      for (let x = 0; x < W; x++, o += 4) {
        acc += diff[x];
        const covered = line[x] + acc;
        line[x] = 0; diff[x] = 0;
        px[o + 3] = 255;
        if (colKeys[x] > 0) {
          const n = Math.min(colN[x], Math.floor((KVLEN - 1) / BN));
          while (t < TP[m + 1] && TR[3 * t + 1] <= n) t++;
          const cls = t < TP[m + 1] && TR[3 * t] <= n ? TR[3 * t + 2] : 0;
          const f = Math.sqrt(Math.min(1, Math.max(0, covered / (colKeys[x] * span))));
          const bg = COL[cls][0], fg = COL[cls][1];
          px[o] = bg[0] + (fg[0] - bg[0]) * f;
          px[o + 1] = bg[1] + (fg[1] - bg[1]) * f;
          px[o + 2] = bg[2] + (fg[2] - bg[2]) * f;
        } else {
          px[o] = OUTSIDE[0]; px[o + 1] = OUTSIDE[1]; px[o + 2] = OUTSIDE[2];
        }
      }
      diff[W] = 0;
    }
    return img;
  }

  // A round step (1, 2 or 5 times a power of ten, at least 1) at least `min` tokens.
  function niceStep(min) {
    const mag = Math.pow(10, Math.floor(Math.log10(Math.max(min, 1))));
    for (const f of [1, 2, 5, 10]) if (f * mag >= min) return f * mag;
    return 10 * mag;
  }

  // Grid lines every `step` tokens along one axis, where `pos(t)` is the CSS coordinate of
  // token boundary t and [t0, t1) the tokens in view.
  function gridLines(step, t0, t1, vertical, style) {
    ctx.strokeStyle = style;
    ctx.beginPath();
    for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
      if (vertical) {
        const x = Math.round(LEFT + (t - V.c0) / V.kpp) + 0.5;
        ctx.moveTo(x, TOP + Math.max(0, -V.r0 / V.rpp)); ctx.lineTo(x, TOP + Math.min(plotH(), (QLEN - V.r0) / V.rpp));
      } else {
        const y = Math.round(TOP + (t - V.r0) / V.rpp) + 0.5;
        ctx.moveTo(LEFT + Math.max(0, -V.c0 / V.kpp), y); ctx.lineTo(LEFT + Math.min(plotW(), (KVLEN - V.c0) / V.kpp), y);
      }
    }
    ctx.stroke();
  }

  function draw() {
    const t0 = performance.now();
    if (dirty || !image) { image = raster(); dirty = false; api.frames++; }
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.putImageData(image, Math.round(LEFT * dpr), Math.round(TOP * dpr));
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const w = plotW(), h = plotH();
    const rA = Math.max(0, V.r0), rB = Math.min(QLEN, V.r0 + h * V.rpp);
    const kA = Math.max(0, V.c0), kB = Math.min(KVLEN, V.c0 + w * V.kpp);
    ctx.save();
    ctx.beginPath(); ctx.rect(LEFT, TOP, w, h); ctx.clip();
    ctx.lineWidth = 1;
    if (1 / V.kpp >= 10 && 1 / V.rpp >= 10) {
      gridLines(1, kA, kB, true, "rgba(0,0,0,0.10)");
      gridLines(1, rA, rB, false, "rgba(0,0,0,0.10)");
    }
    if (BN / V.kpp >= 6) gridLines(BN, kA, kB, true, "rgba(0,0,0,0.35)");
    if (BM / V.rpp >= 6) gridLines(BM, rA, rB, false, "rgba(0,0,0,0.35)");
    drawStructure(rA, rB, kA, kB);
    if (hovered) {
      const [q, k] = hovered;
      const cell = (r, c, nr, nc) => [LEFT + (c - V.c0) / V.kpp, TOP + (r - V.r0) / V.rpp, nc / V.kpp, nr / V.rpp];
      ctx.strokeStyle = "#000";
      ctx.setLineDash([4, 3]);
      const mt = Math.floor(q / BM) * BM, nt = Math.floor(k / BN) * BN;
      ctx.strokeRect(...cell(mt, nt, Math.min(BM, QLEN - mt), Math.min(BN, KVLEN - nt)));
      ctx.setLineDash([]);
      const c = cell(q, k, 1, 1);
      if (c[2] >= 4) { ctx.strokeStyle = "#d00"; ctx.lineWidth = 2; ctx.strokeRect(...c); }
    }
    ctx.restore();
    ctx.strokeStyle = "#888"; ctx.lineWidth = 1;
    ctx.strokeRect(LEFT - 0.5, TOP - 0.5, w + 1, h + 1);
    drawAxes(rA, rB, kA, kB);
    $("view").textContent = `rows ${Math.floor(rA)}:${Math.ceil(rB)} × keys ${Math.floor(kA)}:${Math.ceil(kB)} · ` +
      (V.rpp >= 1 ? `${V.rpp.toFixed(V.rpp < 10 ? 2 : 0)} rows per px` : `${(1 / V.rpp).toFixed(1)} px per row`);
    api.frameMs = performance.now() - t0;
  }

  function drawAxes(rA, rB, kA, kB) {
    ctx.fillStyle = "#333"; ctx.strokeStyle = "#333";
    ctx.font = "11px 'DejaVu Sans', Verdana, sans-serif";
    ctx.textAlign = "center"; ctx.textBaseline = "bottom";
    const ks = niceStep(70 * V.kpp), rs = niceStep(24 * V.rpp);
    ctx.beginPath();
    for (let k = Math.ceil(kA / ks) * ks; k <= kB; k += ks) {
      const x = Math.round(LEFT + (k - V.c0) / V.kpp) + 0.5;
      ctx.moveTo(x, TOP - 5); ctx.lineTo(x, TOP);
      ctx.fillText(String(k), x, TOP - 6);
    }
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (let r = Math.ceil(rA / rs) * rs; r <= rB; r += rs) {
      const y = Math.round(TOP + (r - V.r0) / V.rpp) + 0.5;
      ctx.moveTo(LEFT - 5, y); ctx.lineTo(LEFT, y);
      ctx.fillText(String(r), LEFT - 7, y);
    }
    ctx.stroke();
    ctx.textAlign = "left"; ctx.textBaseline = "top";
    ctx.fillText("k →", 4, 4);
    ctx.fillText("q ↓", 4, 18);
  }

  // Boundaries of the program's named structure in view: dashed lines at each span's first
  // row and first key, in the group's colour (at most 400 per group).
  function drawStructure(rA, rB, kA, kB) {
    ctx.setLineDash([6, 4]);
    D.structure.forEach((g, gi) => {
      ctx.strokeStyle = GROUP_COLOURS[gi % GROUP_COLOURS.length];
      ctx.beginPath();
      let drawn = 0;
      for (const sp of g.spans) {
        if (drawn > 400) break;
        for (const [r, k] of [[sp[0], sp[2]], [sp[1], sp[3]]]) {
          if (r > rA && r < rB) {
            const y = Math.round(TOP + (r - V.r0) / V.rpp) + 0.5;
            ctx.moveTo(LEFT, y); ctx.lineTo(LEFT + plotW(), y); drawn++;
          }
          if (k > kA && k < kB) {
            const x = Math.round(LEFT + (k - V.c0) / V.kpp) + 0.5;
            ctx.moveTo(x, TOP); ctx.lineTo(x, TOP + plotH()); drawn++;
          }
        }
      }
      ctx.stroke();
    });
    ctx.setLineDash([]);
  }

  // The structure spans that hold row q (as rows) and key k (as keys).
  function structureAt(q, k) {
    const out = [];
    for (const g of D.structure) {
      const what = `${g.kind} ${g.name}`;
      const row = g.spans.find((sp) => sp[0] <= q && q < sp[1]);
      const key = g.spans.find((sp) => sp[2] <= k && k < sp[3]);
      if (row) out.push(`${what}: row in ${row[4]} (rows ${row[0]}..${row[1]})`);
      if (key && key !== row) out.push(`${what}: key in ${key[4]} (keys ${key[2]}..${key[3]})`);
    }
    return out;
  }

  // Visible pairs of tile (m, n) and its pairs inside the mask; null past 2^20 rows.
  function tileCounts(m, n) {
    const q0 = m * BM, q1 = Math.min(QLEN, q0 + BM), k0 = n * BN, k1 = Math.min(KVLEN, k0 + BN);
    if (q1 - q0 > 1 << 20) return null;
    let visible = 0, run = runOf(q0);
    for (let q = q0; q < q1; q++) {
      run = eachInterval(q, run, (s, e) => { visible += Math.max(0, Math.min(e, k1) - Math.max(s, k0)); });
    }
    return { visible, pairs: (q1 - q0) * (k1 - k0), q0, q1, k0, k1 };
  }

  const MAX_LISTED = 32;
  function hoverText(q, k) {
    const ivs = rowIntervals(q);
    const keys = ivs.reduce((a, [s, e]) => a + e - s, 0);
    const seen = ivs.some(([s, e]) => s <= k && k < e);
    const m = Math.floor(q / BM), n = Math.floor(k / BN), cls = tileClass(m, n);
    const lines = [`q = ${q}, k = ${k}: ${seen ? "visible" : "hidden"}`];
    lines.push(`row ${q}: ${ivs.length} interval${ivs.length === 1 ? "" : "s"}, ${keys} visible key${keys === 1 ? "" : "s"}`);
    const shown = ivs.slice(0, MAX_LISTED).map(([s, e]) => `[${s}, ${e})`).join(" ");
    lines.push("  " + (shown || "(none)") + (ivs.length > MAX_LISTED ? ` … and ${ivs.length - MAX_LISTED} more` : ""));
    lines.push(`tile (m ${m}, n ${n}): ${CLASS_NAMES[cls]}`);
    const t = tileCounts(m, n);
    if (t) lines.push(`  rows ${t.q0}..${t.q1}, keys ${t.k0}..${t.k1}: ${t.visible} of ${t.pairs} pairs visible`);
    for (const s of structureAt(q, k)) lines.push(s);
    return lines.join("\n");
  }

  function tokenAt(ev) {
    const r = canvas.getBoundingClientRect();
    const x = ev.clientX - r.left - LEFT, y = ev.clientY - r.top - TOP;
    if (x < 0 || y < 0 || x >= plotW() || y >= plotH()) return null;
    const q = Math.floor(V.r0 + y * V.rpp), k = Math.floor(V.c0 + x * V.kpp);
    return q >= 0 && q < QLEN && k >= 0 && k < KVLEN ? [q, k, x, y] : null;
  }

  let drag = null;
  canvas.addEventListener("pointerdown", (ev) => {
    drag = { x: ev.clientX, y: ev.clientY, r0: V.r0, c0: V.c0 };
    canvas.setPointerCapture(ev.pointerId);
    canvas.classList.add("dragging");
  });
  canvas.addEventListener("pointerup", (ev) => {
    drag = null;
    canvas.releasePointerCapture(ev.pointerId);
    canvas.classList.remove("dragging");
  });
  canvas.addEventListener("pointermove", (ev) => {
    if (drag) {
      V.r0 = drag.r0 - (ev.clientY - drag.y) * V.rpp;
      V.c0 = drag.c0 - (ev.clientX - drag.x) * V.kpp;
      dirty = true;
      draw();
      return;
    }
    const t = tokenAt(ev);
    hovered = t ? [t[0], t[1]] : null;
    $("hover").textContent = t ? hoverText(t[0], t[1]) : "hover over the mask";
    draw();
  });
  canvas.addEventListener("wheel", (ev) => {
    ev.preventDefault();
    const r = canvas.getBoundingClientRect();
    const unit = ev.deltaMode === 1 ? 40 : ev.deltaMode === 2 ? 800 : 1;
    zoomAt(ev.clientX - r.left - LEFT, ev.clientY - r.top - TOP, Math.exp(ev.deltaY * unit * 0.002));
  }, { passive: false });
  canvas.addEventListener("dblclick", (ev) => {
    const r = canvas.getBoundingClientRect();
    zoomAt(ev.clientX - r.left - LEFT, ev.clientY - r.top - TOP, 0.5);
  });
  canvas.addEventListener("keydown", (ev) => {
    const w = plotW(), h = plotH();
    const pan = (dr, dc) => { V.r0 += dr * h * V.rpp; V.c0 += dc * w * V.kpp; dirty = true; draw(); };
    const keys = {
      "+": () => zoomAt(w / 2, h / 2, 0.5), "=": () => zoomAt(w / 2, h / 2, 0.5),
      "-": () => zoomAt(w / 2, h / 2, 2), "0": fit,
      ArrowUp: () => pan(-0.1, 0), ArrowDown: () => pan(0.1, 0),
      ArrowLeft: () => pan(0, -0.1), ArrowRight: () => pan(0, 0.1),
    };
    if (keys[ev.key]) { ev.preventDefault(); keys[ev.key](); }
  });
  $("zoom-in").addEventListener("click", () => zoomAt(plotW() / 2, plotH() / 2, 0.5));
  $("zoom-out").addEventListener("click", () => zoomAt(plotW() / 2, plotH() / 2, 2));
  $("fit").addEventListener("click", fit);
  $("goto").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const v = ($("goto-text").value.match(/\d+/g) || []).map(Number);
    if (v.length >= 4) setView(v[0], v[1], v[2], v[3]);
    else if (v.length === 2) setView(v[0] - 8, v[0] + 8, v[1] - 8, v[1] + 8);
  });

  function resize() {
    const r = canvas.getBoundingClientRect();
    // Keep the tokens at the centre where they are.
    const cq = V.r0 + (plotH() / 2) * V.rpp, ck = V.c0 + (plotW() / 2) * V.kpp;
    const first = cssW === 0;
    cssW = r.width; cssH = r.height; dpr = window.devicePixelRatio || 1;
    canvas.width = Math.max(1, Math.round(cssW * dpr));
    canvas.height = Math.max(1, Math.round(cssH * dpr));
    if (first) {
      setView(D.view[0], D.view[1], D.view[2], D.view[3]);
    } else {
      V.r0 = cq - (plotH() / 2) * V.rpp; V.c0 = ck - (plotW() / 2) * V.kpp;
      dirty = true;
      draw();
    }
  }

  // Side panel: title, legend, statistics, notes.
  $("title").textContent = `${D.name} · q_len ${QLEN} × kv_len ${KVLEN}`;
  const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;
  for (const [c, text] of [[COL[2][1], "visible, full tile"], [COL[1][1], "visible, partial tile"],
    [COL[1][0], "hidden, partial tile"], [COL[0][0], "empty tile"], [OUTSIDE, "outside the mask"]]) {
    const d = document.createElement("div");
    const s = document.createElement("span");
    s.className = "swatch"; s.style.background = rgb(c);
    d.append(s, text);
    $("legend").append(d);
  }
  for (const [k, v] of D.stats) {
    const tr = document.createElement("tr");
    for (const t of [k, v]) { const td = document.createElement("td"); td.textContent = t; tr.append(td); }
    $("stats").append(tr);
  }
  for (const n of D.notes) { const li = document.createElement("li"); li.textContent = n; $("notes").append(li); }

  // For scripts and tests: the view, moving it, and where a token is drawn.
  api.view = () => ({
    rows: [V.r0, V.r0 + plotH() * V.rpp], keys: [V.c0, V.c0 + plotW() * V.kpp],
    rowsPerPixel: V.rpp, keysPerPixel: V.kpp,
  });
  api.setView = setView;
  api.rowIntervals = rowIntervals;
  // The centre of token (q, k) in client (viewport) CSS pixels.
  api.clientOf = (q, k) => {
    const r = canvas.getBoundingClientRect();
    return [r.left + LEFT + (k + 0.5 - V.c0) / V.kpp, r.top + TOP + (q + 0.5 - V.r0) / V.rpp];
  };
  window.cmExplorer = api;
  window.addEventListener("resize", resize);
  resize();
  api.ready = true;
})();
