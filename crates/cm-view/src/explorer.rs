//! The explorer page: one self-contained HTML file (no network, no external script or
//! font) that draws a planned mask in a canvas and lets the reader pan and zoom from the
//! whole mask down to single tokens, hover to read a row's intervals and a tile's class
//! and counts, with the plan's statistics beside it.
//!
//! The page never holds a dense mask. It embeds the mask's row intervals as *affine runs*
//! ([`row_runs`]): consecutive rows with the same number of intervals whose endpoints move
//! by a constant step per row are one run, as the solver produces them (a causal mask of any
//! length is one run). Tiles are embedded as runs of equal class along each query block
//! ([`tile_runs`]). Both are little-endian `i32` arrays in base64. The script draws each
//! frame from them, sampling at most a fixed number of rows per pixel row, so a frame costs
//! O(pixels + sampled rows x intervals per row) whatever `q_len x kv_len` is.

use base64::Engine as _;
use compilemask::{KeyInterval, MaskPlan, RowIntervals, StructureKind};
use serde_json::json;

use crate::raster;
use crate::{Subject, View, ViewError};

/// Largest data the page may embed (the encoded runs), in bytes: a page above it would be
/// slow to load and is refused with [`ViewError::TooLarge`].
pub const MAX_EMBEDDED_BYTES: usize = 64 << 20;

/// Largest number of spans per structure group the page embeds (the rest are counted).
const MAX_SPANS: usize = 10_000;

const SCRIPT: &str = include_str!("explorer.js");
const STYLE: &str = include_str!("explorer.css");

/// The rows of `rows` as affine runs, one after another, as `i32`s:
///
/// `q0, n, m, s_1, e_1, ..., s_m, e_m, [ds_1, de_1, ..., ds_m, de_m]`
///
/// Rows `q0 .. q0 + n` each have `m` intervals; row `q0 + d`'s `i`-th interval is `[s_i +
/// d * ds_i, e_i + d * de_i)` (half-open, 0-based keys). The steps are present only when
/// `n > 1`. Runs cover rows `0 .. q_len` in order, each row once (a row with no interval is
/// in a run with `m = 0`). Greedy: a run grows while the next row fits it, so the cost is
/// O(intervals).
pub fn row_runs(rows: &RowIntervals) -> Vec<i32> {
    // The page draws plain intervals: strided runs as their keys (`explorer` bounds them).
    let unit = rows
        .expanded_within(usize::MAX)
        .unwrap_or_else(|_| unreachable!("no limit"));
    let rows: &RowIntervals = &unit;
    let mut out = Vec::new();
    let mut q = 0;
    while q < rows.q_len() {
        let first = rows.row(q);
        let mut n = 1;
        let next = q + 1;
        if next < rows.q_len() && rows.row(next).len() == first.len() {
            let second = rows.row(next);
            let steps: Vec<(i64, i64)> = first
                .iter()
                .zip(second)
                .map(|(a, b)| {
                    (
                        i64::from(b.start) - i64::from(a.start),
                        i64::from(b.end) - i64::from(a.end),
                    )
                })
                .collect();
            n = 2;
            while q + n < rows.q_len() && on_run(rows.row(q + n), first, &steps, n) {
                n += 1;
            }
            push_run(&mut out, q, n, first, Some(&steps));
        } else {
            push_run(&mut out, q, n, first, None);
        }
        q += n;
    }
    out
}

/// Whether `row`, `d` rows after `first`, continues the run with `steps`.
fn on_run(row: &[KeyInterval], first: &[KeyInterval], steps: &[(i64, i64)], d: u32) -> bool {
    let d = i64::from(d);
    row.len() == first.len()
        && row.iter().zip(first).zip(steps).all(|((r, f), (ds, de))| {
            i64::from(r.start) == i64::from(f.start) + d * ds
                && i64::from(r.end) == i64::from(f.end) + d * de
        })
}

fn push_run(
    out: &mut Vec<i32>,
    q0: u32,
    n: u32,
    first: &[KeyInterval],
    steps: Option<&[(i64, i64)]>,
) {
    // Positions and lengths are at most 2^26 (the planner's limit), so every value and
    // step fits an i32.
    let int = |v: i64| i32::try_from(v).expect("positions are below 2^26");
    out.extend([int(q0.into()), int(n.into()), int(first.len() as i64)]);
    for iv in first {
        out.extend([int(iv.start.into()), int(iv.end.into())]);
    }
    if let Some(steps) = steps {
        for &(ds, de) in steps {
            out.extend([int(ds), int(de)]);
        }
    }
}

/// The tile classes of `mask` as runs along each query block: `(ptr, runs)` where the runs
/// of query block `m` are `runs[3 * ptr[m] .. 3 * ptr[m + 1]]`, each `n0, n1, class` (key
/// blocks `n0 .. n1`, half-open; class 1 partial, 2 full), ascending; key blocks in no run
/// are empty tiles.
pub fn tile_runs(mask: &MaskPlan) -> (Vec<i32>, Vec<i32>) {
    let t = &mask.tiles;
    let mut ptr = Vec::with_capacity(t.num_m_blocks as usize + 1);
    let mut runs: Vec<i32> = Vec::new();
    let int = |v: u32| i32::try_from(v).expect("block indices are below 2^26");
    ptr.push(0);
    for m in 0..t.num_m_blocks as usize {
        let partial = &t.kv_indices[t.kv_offsets[m] as usize..t.kv_offsets[m + 1] as usize];
        let full =
            &t.full_kv_indices[t.full_kv_offsets[m] as usize..t.full_kv_offsets[m + 1] as usize];
        // Merge the two ascending lists, joining neighbours of one class.
        let (mut i, mut j) = (0, 0);
        let start = runs.len();
        while i < partial.len() || j < full.len() {
            let (n, class) = if j >= full.len() || (i < partial.len() && partial[i] < full[j]) {
                i += 1;
                (partial[i - 1], 1)
            } else {
                j += 1;
                (full[j - 1], 2)
            };
            let len = runs.len();
            if len > start && runs[len - 1] == class && runs[len - 2] == int(n) {
                runs[len - 2] = int(n + 1);
            } else {
                runs.extend([int(n), int(n + 1), class]);
            }
        }
        ptr.push(int((runs.len() / 3) as u32));
    }
    (ptr, runs)
}

fn base64_ints(v: &[i32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn kind_name(k: StructureKind) -> &'static str {
    match k {
        StructureKind::Segments => "segments",
        StructureKind::Pieces => "pieces",
        StructureKind::Part => "part",
        StructureKind::Grid => "grid",
        StructureKind::Samples => "samples",
    }
}

/// The plan's statistics as the page lists them: (label, value) pairs for the mask of
/// `(b, h)` and the plan as a whole.
fn statistics(
    s: &Subject<'_>,
    view: &View,
    mask: &MaskPlan,
    plan_ms: Option<f64>,
) -> Vec<(String, String)> {
    let plan = s.plan;
    let total = crate::pairs(plan);
    let visible = mask.rows.visible_pairs();
    let counts = mask.tiles.counts();
    let mut out = vec![
        ("mask".into(), s.name.to_string()),
        (
            "q_len × kv_len".into(),
            format!("{} × {}", plan.q_len, plan.kv_len),
        ),
        (
            "batch, num_heads".into(),
            format!(
                "{}, {} (drawn: b {}, h {})",
                plan.batch, plan.num_heads, view.b, view.h
            ),
        ),
        (
            "visible pairs".into(),
            format!(
                "{visible} ({:.4}% of {})",
                100.0 * visible as f64 / total.max(1.0),
                if plan.packing.is_some() {
                    "the samples' pairs"
                } else {
                    "q_len × kv_len"
                }
            ),
        ),
        (
            "rows that see no key".into(),
            mask.rows.empty_rows().to_string(),
        ),
        (
            "intervals".into(),
            format!(
                "{} (at most {} in a row)",
                mask.rows.all_runs().len(),
                mask.rows.max_intervals_per_row()
            ),
        ),
        (
            "tile block_m × block_n".into(),
            format!("{} × {}", plan.tile.block_m, plan.tile.block_n),
        ),
        (
            "tiles".into(),
            format!(
                "{} full, {} partial, {} empty",
                counts.full, counts.partial, counts.empty
            ),
        ),
        (
            "computed pairs".into(),
            format!(
                "{} ({:.3}x the visible pairs)",
                mask.tiles.computed_pairs,
                mask.tiles.computed_pairs as f64 / (visible as f64).max(1.0)
            ),
        ),
        ("distinct masks".into(), plan.masks.len().to_string()),
        ("solver pieces".into(), plan.pieces.to_string()),
        (
            "elementwise pairs".into(),
            plan.elementwise_pairs.to_string(),
        ),
        (
            "descriptor bytes".into(),
            plan.descriptor_bytes().to_string(),
        ),
    ];
    if let Some(ms) = plan_ms {
        out.push(("plan time".into(), format!("{ms:.2} ms")));
    }
    if let Some(p) = &plan.packing {
        out.push(("packed samples".into(), p.batch().to_string()));
    }
    out
}

/// The explorer page of `subject`, opening on `view`'s rows and keys (the whole mask when
/// they are `None`) of its `(b, h)` mask; `plan_ms` is shown with the statistics.
///
/// # Errors
/// As [`View::resolve`]; [`ViewError::TooLarge`] when the runs to embed exceed
/// [`MAX_EMBEDDED_BYTES`].
pub fn explorer(
    subject: &Subject<'_>,
    view: &View,
    plan_ms: Option<f64>,
) -> Result<String, ViewError> {
    let plan = subject.plan;
    let (rows, cols) = view.resolve(plan)?;
    let mask = plan.mask(view.b, view.h);
    let runs = row_runs(&*mask.rows.expanded().map_err(ViewError::Strides)?);
    let (tile_ptr, tiles) = tile_runs(mask);
    let bytes = 4 * (runs.len() + tile_ptr.len() + tiles.len());
    if bytes > MAX_EMBEDDED_BYTES {
        return Err(ViewError::TooLarge {
            bytes,
            limit: MAX_EMBEDDED_BYTES,
        });
    }
    let mut notes = Vec::new();
    if plan.uses_head && plan.num_heads == 1 {
        notes.push("the mask depends on the head (reads h or num_heads) but was planned with num_heads = 1; this is h = 0 only".to_string());
    }
    if plan.uses_batch && plan.batch == 1 && plan.packing.is_none() {
        notes.push(
            "the mask depends on the batch (reads b or batch) but was planned with batch = 1; this is b = 0 only"
                .to_string(),
        );
    }
    if plan.order.is_some() {
        notes.push(
            "rows and keys are in the planned token order (program positions permuted)".to_string(),
        );
    }
    let structure: Vec<serde_json::Value> = subject
        .structure
        .map(|st| {
            st.groups
                .iter()
                .filter(|g| !g.spans.is_empty())
                .map(|g| {
                    let spans: Vec<serde_json::Value> = g
                        .spans
                        .iter()
                        .take(MAX_SPANS)
                        .map(|sp| json!([sp.rows.0, sp.rows.1, sp.keys.0, sp.keys.1, sp.label]))
                        .collect();
                    json!({
                        "kind": kind_name(g.kind),
                        "name": g.name,
                        "spans": spans,
                        "more": g.spans.len().saturating_sub(MAX_SPANS),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let colour = |c: [u8; 3]| json!(c);
    let data = json!({
        "name": subject.name,
        "q_len": plan.q_len,
        "kv_len": plan.kv_len,
        "b": view.b,
        "h": view.h,
        "block": [plan.tile.block_m, plan.tile.block_n],
        "view": [rows.0, rows.1, cols.0, cols.1],
        "stats": statistics(subject, view, mask, plan_ms),
        "notes": notes,
        "colours": {
            "full": [colour(raster::FULL_LIGHT), colour(raster::FULL_DARK)],
            "partial": [colour(raster::PARTIAL_LIGHT), colour(raster::PARTIAL_DARK)],
            "empty": [colour(raster::EMPTY_LIGHT), colour(raster::EMPTY_DARK)],
        },
        "rows": base64_ints(&runs),
        "tile_ptr": base64_ints(&tile_ptr),
        "tiles": base64_ints(&tiles),
        "structure": structure,
    });
    // Inside a script element `</script` ends it and `<!--` followed by `<script` changes
    // how the HTML parser finds its end, whatever the element's type, so no `<` (nor `>`
    // or `&`) is left as itself: JSON has them inside strings only, where `\u003c` is the
    // same string.
    let data = data
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    let title = crate::svg::esc(&format!(
        "{} · q_len {} × kv_len {} · CompileMask explorer",
        subject.name, plan.q_len, plan.kv_len
    ));
    Ok(format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>{title}</title>\n<style>\n{STYLE}</style>\n</head>\n<body>\n<main>\n<section id=\"plot-wrap\"><canvas id=\"plot\" tabindex=\"0\" aria-label=\"the mask: drag to pan, wheel to zoom\"></canvas></section>\n<aside>\n<h1 id=\"title\"></h1>\n<div class=\"controls\"><button id=\"zoom-in\" title=\"zoom in (+)\">+</button><button id=\"zoom-out\" title=\"zoom out (-)\">−</button><button id=\"fit\" title=\"the whole mask (0)\">whole mask</button></div>\n<p id=\"view\"></p>\n<form id=\"goto\"><input id=\"goto-text\" placeholder=\"rows A:B keys C:D\" aria-label=\"go to rows A:B keys C:D\"><button>go</button></form>\n<pre id=\"hover\">hover over the mask</pre>\n<div id=\"legend\"></div>\n<table id=\"stats\"></table>\n<ul id=\"notes\"></ul>\n<p class=\"help\">Drag to pan, wheel or +/− to zoom about the pointer, 0 for the whole mask. Rows are queries (q), columns keys (k); intervals are half-open and 0-based.</p>\n</aside>\n</main>\n<script id=\"cm-data\" type=\"application/json\">{data}</script>\n<script>\n{SCRIPT}</script>\n</body>\n</html>\n"
    ))
}
