//! The figure's layout, written as SVG, and its PNG rendering (resvg).

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use compilemask::{StructureGroup, StructureKind};

use crate::raster::{self, Raster};
use crate::{Subject, View, ViewError};

/// The longer side of the plot area, in pixels.
const PLOT: u32 = 640;
/// The shorter side of a plot that downsamples its longer one (a 1 x 100,000 mask is drawn
/// 80 pixels tall, not one).
const MIN_SIDE: u32 = 80;
/// Largest token cell of an upscaled plot, in pixels.
const MAX_CELL: u32 = 48;
const FONT: &str = "DejaVu Sans";
const LEFT: f64 = 78.0;
const LANE_W: f64 = 14.0;
const LANE_GAP: f64 = 6.0;
/// Largest number of structure lanes drawn beside the plot; the legend counts the rest.
const MAX_LANES: usize = 8;
/// Largest number of boundary lines drawn across the plot per axis.
const MAX_LINES: usize = 400;
const LANE_COLOURS: [&str; 6] = [
    "#2f5f9e", "#7b3f9e", "#138a72", "#b03a2e", "#6d5a3a", "#4a5a6a",
];

/// A laid-out figure. [`Picture::svg`] writes it as one SVG document (the mask raster
/// embedded as a PNG data URL, drawn with nearest-neighbour scaling); [`Picture::png`]
/// renders the same document with resvg.
#[derive(Clone, Debug)]
pub struct Picture {
    /// Size of the whole figure, in pixels.
    pub width: u32,
    pub height: u32,
    /// The plot area: left, top, width, height, in pixels.
    pub plot: [u32; 4],
    /// The rows and keys drawn (half-open, 0-based).
    pub rows: (u32, u32),
    pub cols: (u32, u32),
    /// Visible pairs inside the view.
    pub visible: u64,
    raster: Raster,
    /// Everything but the background and the mask raster.
    overlay: String,
}

impl Picture {
    /// The pixel at the centre of token `(q, k)`'s cell when each token has a cell of its
    /// own, or of the pixel that covers it in a downsampled plot; `None` outside the view.
    pub fn pixel_of(&self, q: u32, k: u32) -> Option<(u32, u32)> {
        if !(self.rows.0..self.rows.1).contains(&q) || !(self.cols.0..self.cols.1).contains(&k) {
            return None;
        }
        let [x0, y0, w, h] = self.plot;
        let nr = f64::from(self.rows.1 - self.rows.0);
        let nc = f64::from(self.cols.1 - self.cols.0);
        let fx = (f64::from(k - self.cols.0) + 0.5) / nc * f64::from(w);
        let fy = (f64::from(q - self.rows.0) + 0.5) / nr * f64::from(h);
        Some((x0 + fx as u32, y0 + fy as u32))
    }

    /// Pixels per token along the key and query axes (below 1 when downsampled).
    pub fn scale(&self) -> (f64, f64) {
        (
            f64::from(self.plot[2]) / f64::from(self.cols.1 - self.cols.0),
            f64::from(self.plot[3]) / f64::from(self.rows.1 - self.rows.0),
        )
    }

    fn document(&self, body: &str) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"{FONT}, Verdana, sans-serif\">\n{body}</svg>\n",
            w = self.width,
            h = self.height
        )
    }

    /// The figure as a standalone SVG document.
    ///
    /// # Errors
    /// [`ViewError::Encode`] if the raster cannot be encoded (not expected).
    pub fn svg(&self) -> Result<String, ViewError> {
        let png = encode_png(self.raster.sx, self.raster.sy, &self.raster.rgb, false)?;
        let [x, y, w, h] = self.plot;
        let body = format!(
            "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<image x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{h}\" preserveAspectRatio=\"none\" image-rendering=\"pixelated\" style=\"image-rendering:pixelated\" href=\"data:image/png;base64,{}\"/>\n{}",
            base64::engine::general_purpose::STANDARD.encode(png),
            self.overlay
        );
        Ok(self.document(&body))
    }

    /// The figure as a PNG file's bytes (8-bit RGB).
    ///
    /// # Errors
    /// [`ViewError::Encode`] if the figure cannot be rendered or encoded (not expected).
    pub fn png(&self) -> Result<Vec<u8>, ViewError> {
        let mut pixmap =
            resvg::tiny_skia::Pixmap::new(self.width, self.height).ok_or_else(|| {
                ViewError::Encode(format!("no {}x{} canvas", self.width, self.height))
            })?;
        pixmap.fill(resvg::tiny_skia::Color::WHITE);
        // The mask, nearest neighbour: plot pixel (px, py) shows sample
        // (px * sx / w, py * sy / h).
        let [x0, y0, w, h] = self.plot;
        let stride = self.width as usize * 4;
        let data = pixmap.data_mut();
        for py in 0..h {
            let sy = (u64::from(py) * u64::from(self.raster.sy) / u64::from(h)) as u32;
            for px in 0..w {
                let sx = (u64::from(px) * u64::from(self.raster.sx) / u64::from(w)) as u32;
                let c = self.raster.at(sx, sy);
                let i = (y0 + py) as usize * stride + (x0 + px) as usize * 4;
                data[i..i + 4].copy_from_slice(&[c[0], c[1], c[2], 255]);
            }
        }
        let options = resvg::usvg::Options {
            fontdb: fonts(),
            font_family: FONT.into(),
            ..resvg::usvg::Options::default()
        };
        let tree = resvg::usvg::Tree::from_str(&self.document(&self.overlay), &options)
            .map_err(|e| ViewError::Encode(e.to_string()))?;
        resvg::render(
            &tree,
            resvg::tiny_skia::Transform::identity(),
            &mut pixmap.as_mut(),
        );
        // Opaque everywhere (white background), so premultiplied RGBA is plain RGB.
        let rgb: Vec<u8> = pixmap
            .data()
            .chunks_exact(4)
            .flat_map(|p| [p[0], p[1], p[2]])
            .collect();
        encode_png(self.width, self.height, &rgb, true)
    }
}

/// DejaVu Sans (regular and bold), loaded once.
fn fonts() -> Arc<resvg::usvg::fontdb::Database> {
    static DB: OnceLock<Arc<resvg::usvg::fontdb::Database>> = OnceLock::new();
    DB.get_or_init(|| {
        let mut db = resvg::usvg::fontdb::Database::new();
        db.load_font_data(dejavu::sans::regular().to_vec());
        db.load_font_data(dejavu::sans::bold().to_vec());
        db.set_sans_serif_family(FONT);
        Arc::new(db)
    })
    .clone()
}

fn encode_png(width: u32, height: u32, rgb: &[u8], compress: bool) -> Result<Vec<u8>, ViewError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    if compress {
        enc.set_compression(png::Compression::High);
    }
    enc.write_header()
        .and_then(|mut w| w.write_image_data(rgb))
        .map_err(|e| ViewError::Encode(e.to_string()))?;
    Ok(out)
}

/// Escapes text for SVG / HTML.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// Width of `text` at `size` pixels, estimated from DejaVu Sans's average advance (digits
/// and lower case are about 0.55-0.64 em); used only to keep labels apart.
fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * 0.62
}

/// The plot's pixels along one axis of `n` tokens: upscaled by a whole number of pixels per
/// token when it fits, else `target` pixels.
fn axis_pixels(n: u32, cell: u32, target: u32) -> u32 {
    if cell >= 1 {
        n * cell
    } else {
        target.min(n)
    }
}

/// A round step (1, 2 or 5 times a power of ten, at least 1) giving at most `max` ticks
/// over `span` tokens.
fn nice_step(span: u32, max: u32) -> u32 {
    let raw = (f64::from(span) / f64::from(max.max(1))).max(1.0);
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * mag);
    step.round().max(1.0) as u32
}

/// Percent with enough digits to tell a tiny fraction from zero.
fn percent(frac: f64) -> String {
    let p = frac * 100.0;
    if p == 0.0 || p >= 1.0 {
        format!("{p:.1}%")
    } else if p >= 0.01 {
        format!("{p:.2}%")
    } else {
        format!("{p:.1e}%")
    }
}

fn group_caption(g: &StructureGroup, in_view: usize) -> String {
    let n = g.spans.len();
    let plural = |one: &str, many: &str| {
        if n == 1 {
            one.to_string()
        } else {
            many.to_string()
        }
    };
    let shown = if in_view < n {
        format!(", {in_view} in view")
    } else {
        String::new()
    };
    match g.kind {
        StructureKind::Segments => format!(
            "segments {}: {n} {}{shown}",
            g.name,
            plural("segment", "segments")
        ),
        StructureKind::Pieces => format!("pieces of {}: {n}{shown}", g.name),
        StructureKind::Part => format!("part {}: {n} {}{shown}", g.name, plural("span", "spans")),
        StructureKind::Grid => match g.spans.first() {
            Some(s) => format!("grid {} at {}", s.label, s.rows.0),
            None => format!("grid {}", g.name),
        },
        StructureKind::Samples => format!("packed samples: {n}{shown}"),
    }
}

/// Writes the figure: title, axes, mask, grids, structure, legend.
pub fn layout(s: &Subject<'_>, view: &View, rows: (u32, u32), cols: (u32, u32)) -> Picture {
    let plan = s.plan;
    let mask = plan.mask(view.b, view.h);
    let (nr, nc) = (rows.1 - rows.0, cols.1 - cols.0);
    let long = nr.max(nc);
    let cell = if long <= PLOT {
        (PLOT / long).min(MAX_CELL)
    } else {
        0
    };
    let (mut pw, mut ph) = (axis_pixels(nc, cell, PLOT), axis_pixels(nr, cell, PLOT));
    if cell == 0 {
        // Keep the aspect ratio of the tokens, but never thinner than MIN_SIDE.
        let scale = f64::from(PLOT) / f64::from(long);
        let side = |n: u32| -> u32 {
            let px = (f64::from(n) * scale).round() as u32;
            if px >= MIN_SIDE {
                px
            } else if n <= MIN_SIDE {
                n * (MIN_SIDE / n)
            } else {
                MIN_SIDE
            }
        };
        pw = side(nc);
        ph = side(nr);
    }
    let raster = raster::sample(mask, rows, cols, pw, ph);
    let (sx_tok, sy_tok) = (f64::from(pw) / f64::from(nc), f64::from(ph) / f64::from(nr));

    // Structure groups with a span in view, at most MAX_LANES of them.
    let groups: Vec<&StructureGroup> = s
        .structure
        .map(|st| st.groups.iter().filter(|g| !g.spans.is_empty()).collect())
        .unwrap_or_default();
    let in_view = |g: &StructureGroup| {
        g.spans
            .iter()
            .filter(|sp| sp.rows.0 < i64::from(rows.1) && sp.rows.1 > i64::from(rows.0))
            .count()
    };
    let lanes: Vec<&StructureGroup> = groups
        .iter()
        .copied()
        .filter(|g| in_view(g) > 0)
        .take(MAX_LANES)
        .collect();

    // Title and subtitle.
    let total_pairs = crate::pairs(plan);
    let whole_visible = mask.rows.visible_pairs();
    let mut title = format!(
        "{}  ·  q_len {} × kv_len {}",
        s.name, plan.q_len, plan.kv_len
    );
    if plan.uses_batch || plan.batch > 1 {
        let _ = write!(title, "  ·  b {} of {}", view.b, plan.batch);
    }
    if plan.uses_head || plan.num_heads > 1 {
        let _ = write!(title, "  ·  h {} of {}", view.h, plan.num_heads);
    }
    let counts = mask.tiles.counts();
    let mut subtitle = format!(
        "visible {} ({} pair{}{})  ·  tiles {}×{}: {} full, {} partial, {} empty",
        percent(whole_visible as f64 / total_pairs.max(1.0)),
        whole_visible,
        if whole_visible == 1 { "" } else { "s" },
        if plan.packing.is_some() {
            " of the samples' q_len × kv_len"
        } else {
            ""
        },
        plan.tile.block_m,
        plan.tile.block_n,
        counts.full,
        counts.partial,
        counts.empty
    );
    let zoomed = rows != (0, plan.q_len) || cols != (0, plan.kv_len);
    let mut lines = vec![subtitle.clone()];
    if zoomed {
        lines.push(format!(
            "view: rows {}:{} × keys {}:{}, visible {} of the view",
            rows.0,
            rows.1,
            cols.0,
            cols.1,
            percent(raster.visible as f64 / (f64::from(nr) * f64::from(nc)))
        ));
    }
    // One decimal where the ratio is not whole (16384 keys in 640 px: 25.6 per px).
    let ratio = |r: f64| {
        let s = format!("{r:.1}");
        s.strip_suffix(".0").map_or(s.clone(), str::to_string)
    };
    let per = |px_per: f64, what: &str| {
        if px_per >= 1.0 {
            format!("{} px per {what}", ratio(px_per))
        } else {
            format!("{} {what}s per px", ratio(1.0 / px_per))
        }
    };
    let (key_note, row_note) = (per(sx_tok, "key"), per(sy_tok, "row"));
    subtitle = lines.join("\n");

    // Notes below the legend.
    let mut notes: Vec<String> = Vec::new();
    if plan.uses_head && plan.num_heads == 1 {
        notes.push("note: the mask depends on the head (reads h or num_heads) but was planned with num_heads = 1; this is h = 0 only".into());
    }
    if plan.uses_batch && plan.batch == 1 && plan.packing.is_none() {
        notes.push("note: the mask depends on the batch (reads b or batch) but was planned with batch = 1; this is b = 0 only".into());
    }
    if plan.order.is_some() {
        notes.push(
            "rows and keys are in the planned token order (program positions permuted)".into(),
        );
    }
    if groups.len() > lanes.len() {
        notes.push(format!(
            "{} more structure group(s) not drawn",
            groups.len() - lanes.len()
        ));
    }

    // Geometry. The query axis's label runs along the plot's left side, centred on it; a
    // plot shorter than the label (a few rows) gets room above and below, or the label ran
    // into the subtitle and the legend.
    let (pwf, phf) = (f64::from(pw), f64::from(ph));
    let row_label = format!("query q  ({row_note})");
    let label_pad = ((text_width(&row_label, 12.0) + 8.0 - phf) / 2.0).max(0.0);
    let top_text = 30.0 + 17.0 * lines.len() as f64;
    let top = top_text + 44.0 + label_pad;
    let lanes_w = if lanes.is_empty() {
        16.0
    } else {
        12.0 + lanes.len() as f64 * (LANE_W + LANE_GAP)
    };
    let title_w = text_width(&title, 16.0).max(
        lines
            .iter()
            .map(|l| text_width(l, 12.0))
            .fold(0.0, f64::max),
    );
    let width = (LEFT + pwf + lanes_w).max(title_w + 24.0).max(420.0).ceil();

    // Legend items: (swatch colour, a structure lane?, text).
    let mut items: Vec<(String, bool, String)> = vec![
        (hex(raster::FULL_DARK), false, "visible, full tile".into()),
        (
            hex(raster::PARTIAL_DARK),
            false,
            "visible, partial tile".into(),
        ),
        (
            hex(raster::PARTIAL_LIGHT),
            false,
            "hidden, partial tile".into(),
        ),
        (
            hex(raster::EMPTY_LIGHT),
            false,
            "empty tile (skipped)".into(),
        ),
    ];
    for (i, g) in lanes.iter().enumerate() {
        items.push((
            LANE_COLOURS[i % LANE_COLOURS.len()].into(),
            true,
            group_caption(g, in_view(g)),
        ));
    }
    let mut legend_rows: Vec<Vec<(f64, usize)>> = vec![Vec::new()];
    let mut x = 12.0;
    for (i, (_, _, text)) in items.iter().enumerate() {
        let w = 18.0 + text_width(text, 12.0) + 18.0;
        if x + w > width - 8.0 && x > 12.0 {
            legend_rows.push(Vec::new());
            x = 12.0;
        }
        legend_rows.last_mut().expect("one row").push((x, i));
        x += w;
    }
    let legend_top = top + phf + 22.0 + label_pad;
    let notes_top = legend_top + 20.0 * legend_rows.len() as f64 + 4.0;
    let height = (notes_top + 18.0 * notes.len() as f64 + 8.0).ceil();

    let mut o = String::new();
    let (px0, py0) = (LEFT, top);
    let tx = |k: f64| px0 + (k - f64::from(cols.0)) * sx_tok;
    let ty = |q: f64| py0 + (q - f64::from(rows.0)) * sy_tok;

    // Title block.
    let _ = writeln!(
        o,
        "<text x=\"12\" y=\"24\" font-size=\"16\" font-weight=\"bold\" fill=\"#222\">{}</text>",
        esc(&title)
    );
    for (i, l) in subtitle.lines().enumerate() {
        let _ = writeln!(
            o,
            "<text x=\"12\" y=\"{:.1}\" font-size=\"12\" fill=\"#444\">{}</text>",
            44.0 + 17.0 * i as f64,
            esc(l)
        );
    }

    // Token grid (white, between cells) and tile grid (dark), where legible.
    let mut grid = String::new();
    if sx_tok >= 10.0 && sy_tok >= 10.0 {
        for k in cols.0 + 1..cols.1 {
            let x = tx(f64::from(k));
            let _ = write!(grid, "M{x:.1} {py0:.1}V{:.1}", py0 + phf);
        }
        for q in rows.0 + 1..rows.1 {
            let y = ty(f64::from(q));
            let _ = write!(grid, "M{px0:.1} {y:.1}H{:.1}", px0 + pwf);
        }
        let _ = writeln!(
            o,
            "<path d=\"{grid}\" stroke=\"white\" stroke-width=\"1\" fill=\"none\"/>"
        );
    }
    let (bm, bn) = (plan.tile.block_m, plan.tile.block_n);
    let tile_lines = |lo: u32, hi: u32, b: u32, px_per: f64| -> Vec<u32> {
        if f64::from(b) * px_per < 8.0 || (hi - lo) / b > 256 {
            return Vec::new();
        }
        (lo / b + 1..=(hi - 1) / b).map(|i| i * b).collect()
    };
    let mut tiles = String::new();
    for k in tile_lines(cols.0, cols.1, bn, sx_tok) {
        let x = tx(f64::from(k));
        let _ = write!(tiles, "M{x:.1} {py0:.1}V{:.1}", py0 + phf);
    }
    for q in tile_lines(rows.0, rows.1, bm, sy_tok) {
        let y = ty(f64::from(q));
        let _ = write!(tiles, "M{px0:.1} {y:.1}H{:.1}", px0 + pwf);
    }
    if !tiles.is_empty() {
        let _ = writeln!(
            o,
            "<path d=\"{tiles}\" stroke=\"#333\" stroke-opacity=\"0.3\" stroke-width=\"1\" fill=\"none\"/>"
        );
    }

    // Structure: boundaries across the plot (segments, samples, grids) and lanes beside it.
    for (i, g) in lanes.iter().enumerate() {
        let colour = LANE_COLOURS[i % LANE_COLOURS.len()];
        if g.kind != StructureKind::Part && g.kind != StructureKind::Pieces {
            let mut hs: Vec<i64> = Vec::new();
            let mut vs: Vec<i64> = Vec::new();
            for sp in &g.spans {
                hs.extend([sp.rows.0, sp.rows.1]);
                vs.extend([sp.keys.0, sp.keys.1]);
            }
            let keep = |v: &mut Vec<i64>, lo: u32, hi: u32, px_per: f64| {
                v.retain(|&p| p > i64::from(lo) && p < i64::from(hi));
                v.sort_unstable();
                v.dedup();
                let min_gap = v.windows(2).map(|w| w[1] - w[0]).min().unwrap_or(i64::MAX);
                if v.len() > MAX_LINES || (min_gap as f64) * px_per < 3.0 {
                    v.clear();
                }
            };
            keep(&mut hs, rows.0, rows.1, sy_tok);
            keep(&mut vs, cols.0, cols.1, sx_tok);
            let mut d = String::new();
            for &q in &hs {
                let y = ty(q as f64);
                let _ = write!(d, "M{px0:.1} {y:.1}H{:.1}", px0 + pwf);
            }
            for &k in &vs {
                let x = tx(k as f64);
                let _ = write!(d, "M{x:.1} {py0:.1}V{:.1}", py0 + phf);
            }
            if !d.is_empty() {
                let _ = writeln!(
                    o,
                    "<path d=\"{d}\" stroke=\"{colour}\" stroke-width=\"1.5\" stroke-dasharray=\"5 3\" fill=\"none\"/>"
                );
            }
        }
        let lx = px0 + pwf + 12.0 + i as f64 * (LANE_W + LANE_GAP);
        let _ = writeln!(
            o,
            "<rect x=\"{lx:.1}\" y=\"{py0:.1}\" width=\"{LANE_W}\" height=\"{phf:.1}\" fill=\"#f4f4f4\"/>"
        );
        let mut bars = String::new();
        let mut labels = String::new();
        let mut drawn = 0usize;
        for (j, sp) in g.spans.iter().enumerate() {
            let lo = sp.rows.0.max(i64::from(rows.0));
            let hi = sp.rows.1.min(i64::from(rows.1));
            if lo >= hi {
                continue;
            }
            drawn += 1;
            if drawn > 4 * PLOT as usize {
                break;
            }
            let (y0, y1) = (ty(lo as f64), ty(hi as f64));
            let opacity = if j % 2 == 0 { 0.9 } else { 0.5 };
            let _ = writeln!(
                bars,
                "<rect x=\"{lx:.1}\" y=\"{y0:.2}\" width=\"{LANE_W}\" height=\"{:.2}\" fill=\"{colour}\" fill-opacity=\"{opacity}\"/>",
                (y1 - y0).max(0.5)
            );
            let short = sp.label.rsplit(' ').next().unwrap_or(&sp.label);
            let label = [sp.label.as_str(), short]
                .into_iter()
                .find(|l| text_width(l, 10.0) + 6.0 <= y1 - y0);
            if let Some(l) = label {
                let (cx, cy) = (lx + LANE_W / 2.0 + 3.5, (y0 + y1) / 2.0);
                let _ = writeln!(
                    labels,
                    "<text transform=\"translate({cx:.1},{cy:.1}) rotate(-90)\" text-anchor=\"middle\" font-size=\"10\" fill=\"white\">{}</text>",
                    esc(l)
                );
            }
        }
        o.push_str(&bars);
        o.push_str(&labels);
    }

    // Frame and axes: keys along the top, rows down the left, as attention-gym draws them.
    let _ = writeln!(
        o,
        "<rect x=\"{px0:.1}\" y=\"{py0:.1}\" width=\"{pwf:.1}\" height=\"{phf:.1}\" fill=\"none\" stroke=\"#222\" stroke-width=\"1\"/>"
    );
    let centre = |px_per: f64| if px_per >= 2.0 { 0.5 } else { 0.0 };
    // Ticks at round token indices, `room` pixels apart at least.
    let ticks = |lo: u32, hi: u32, px_per: f64, room: f64| -> Vec<u32> {
        let max = ((f64::from(hi - lo) * px_per) / room).floor().max(1.0) as u32;
        let step = nice_step(hi - lo, max);
        (lo.div_ceil(step) * step..hi)
            .step_by(step as usize)
            .collect()
    };
    let mut d = String::new();
    let key_room = text_width(&cols.1.to_string(), 11.0) + 12.0;
    for k in ticks(cols.0, cols.1, sx_tok, key_room) {
        let x = tx(f64::from(k) + centre(sx_tok));
        let _ = write!(d, "M{x:.1} {py0:.1}v-5");
        let _ = writeln!(
            o,
            "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"11\" fill=\"#333\">{k}</text>",
            py0 - 8.0
        );
    }
    for q in ticks(rows.0, rows.1, sy_tok, 24.0) {
        let y = ty(f64::from(q) + centre(sy_tok));
        let _ = write!(d, "M{px0:.1} {y:.1}h-5");
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" font-size=\"11\" fill=\"#333\">{q}</text>",
            px0 - 8.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        o,
        "<path d=\"{d}\" stroke=\"#222\" stroke-width=\"1\" fill=\"none\"/>"
    );
    let _ = writeln!(
        o,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"12\" fill=\"#222\">key k  ({key_note})</text>",
        px0 + pwf / 2.0,
        py0 - 26.0
    );
    let _ = writeln!(
        o,
        "<text transform=\"translate({:.1},{:.1}) rotate(-90)\" text-anchor=\"middle\" font-size=\"12\" fill=\"#222\">{row_label}</text>",
        16.0,
        py0 + phf / 2.0
    );

    // Legend and notes.
    for (r, row) in legend_rows.iter().enumerate() {
        let y = legend_top + 20.0 * r as f64;
        for &(x, i) in row {
            let (colour, lane, text) = &items[i];
            if *lane {
                let _ = writeln!(
                    o,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"14\" height=\"14\" fill=\"{colour}\" fill-opacity=\"0.9\"/>",
                    y - 11.0
                );
            } else {
                let _ = writeln!(
                    o,
                    "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"14\" height=\"14\" fill=\"{colour}\" stroke=\"#777\" stroke-width=\"0.6\"/>",
                    y - 11.0
                );
            }
            let _ = writeln!(
                o,
                "<text x=\"{:.1}\" y=\"{y:.1}\" font-size=\"12\" fill=\"#222\">{}</text>",
                x + 20.0,
                esc(text)
            );
        }
    }
    for (i, n) in notes.iter().enumerate() {
        let _ = writeln!(
            o,
            "<text x=\"12\" y=\"{:.1}\" font-size=\"11\" fill=\"#8a4b00\">{}</text>",
            notes_top + 12.0 + 18.0 * i as f64,
            esc(n)
        );
    }

    Picture {
        width: width as u32,
        height: height as u32,
        plot: [px0 as u32, py0 as u32, pw, ph],
        rows,
        cols,
        visible: raster.visible,
        raster,
        overlay: o,
    }
}

fn hex(c: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}
