//! Draws a planned mask as a PNG, coloured by tile class: visible pairs are dark green in
//! full tiles and dark amber in partial tiles; hidden pairs of partial tiles are a light amber
//! tint and empty tiles light grey. Long sequences are downsampled so each pixel covers a
//! block of pairs; its colour runs from the light tint to the dark one with the visible
//! fraction.

use anyhow::{Context, Result};
use compilemask::MaskPlan;
use std::io::BufWriter;

/// Largest side of the picture, in pixels.
pub const MAX_SIDE: u32 = 1024;

/// Visible pairs of full tiles: dark green.
const FULL_DARK: [f64; 3] = [20.0, 110.0, 45.0];
/// Hidden pairs of full tiles (only out-of-range or straddling pixels): light green.
const FULL_LIGHT: [f64; 3] = [200.0, 235.0, 200.0];
/// Visible pairs of partial tiles: dark amber.
const PARTIAL_DARK: [f64; 3] = [200.0, 105.0, 0.0];
/// Hidden pairs of partial tiles: light amber.
const PARTIAL_LIGHT: [f64; 3] = [252.0, 230.0, 175.0];
/// Empty tiles: light grey (dark grey only where a downsampled pixel straddles a
/// visible pair of a neighbouring tile).
const EMPTY_LIGHT: [f64; 3] = [235.0, 235.0, 235.0];
const EMPTY_DARK: [f64; 3] = [110.0, 110.0, 110.0];

pub fn write_png(mask: &MaskPlan, path: &str) -> Result<(u32, u32)> {
    let (q_len, kv_len) = (mask.rows.q_len(), mask.rows.kv_len());
    let height = q_len.min(MAX_SIDE);
    let width = kv_len.min(MAX_SIDE);
    let (hf, wf) = (
        f64::from(q_len) / f64::from(height),
        f64::from(kv_len) / f64::from(width),
    );
    // Visible pairs per pixel: each row adds its intervals' coverage to its pixel row.
    let mut cover = vec![0f64; (width * height) as usize];
    for q in 0..q_len {
        let py = ((f64::from(q) / hf) as u32).min(height - 1);
        let line = &mut cover[(py * width) as usize..((py + 1) * width) as usize];
        for iv in mask.rows.row(q) {
            let (s, e) = (f64::from(iv.start) / wf, f64::from(iv.end) / wf);
            let (ps, pe) = (s.floor() as u32, (e.ceil() as u32).min(width));
            for (px, c) in line
                .iter_mut()
                .enumerate()
                .take(pe as usize)
                .skip(ps as usize)
            {
                let lo = s.max(px as f64);
                let hi = e.min(px as f64 + 1.0);
                *c += (hi - lo).max(0.0) * wf;
            }
        }
    }
    let class = tile_classes(mask);
    let t = mask.tiles.tile;
    let mut img = Vec::with_capacity((width * height * 3) as usize);
    for py in 0..height {
        let q = ((f64::from(py) + 0.5) * hf) as u32;
        for px in 0..width {
            let k = ((f64::from(px) + 0.5) * wf) as u32;
            let m = q.min(q_len - 1) / t.block_m;
            let n = k.min(kv_len - 1) / t.block_n;
            let (bg, fg) = match class(m, n) {
                2 => (FULL_LIGHT, FULL_DARK),
                1 => (PARTIAL_LIGHT, PARTIAL_DARK),
                _ => (EMPTY_LIGHT, EMPTY_DARK),
            };
            let frac = (cover[(py * width + px) as usize] / (hf * wf)).clamp(0.0, 1.0);
            for c in 0..3 {
                img.push((bg[c] * (1.0 - frac) + fg[c] * frac).round() as u8);
            }
        }
    }
    let file = std::fs::File::create(path).with_context(|| format!("cannot create `{path}`"))?;
    let mut enc = png::Encoder::new(BufWriter::new(file), width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?
        .write_image_data(&img)
        .with_context(|| format!("cannot write `{path}`"))?;
    Ok((width, height))
}

/// Tile class lookup: 2 full, 1 partial, 0 empty.
fn tile_classes(mask: &MaskPlan) -> impl Fn(u32, u32) -> u8 + '_ {
    let t = &mask.tiles;
    move |m: u32, n: u32| {
        let (m, n) = (m as usize, n as usize);
        let full =
            &t.full_kv_indices[t.full_kv_offsets[m] as usize..t.full_kv_offsets[m + 1] as usize];
        if full.binary_search(&(n as u32)).is_ok() {
            return 2;
        }
        let part = &t.kv_indices[t.kv_offsets[m] as usize..t.kv_offsets[m + 1] as usize];
        u8::from(part.binary_search(&(n as u32)).is_ok())
    }
}
