//! The mask as a grid of samples, drawn from the plan's row intervals and tile lists: never
//! a dense `q_len x kv_len` array. A view of `rows x cols` tokens becomes `sy x sx` samples
//! (`sy = min(rows, height)`, `sx = min(cols, width)`); when a view has fewer tokens than
//! pixels each sample is one token (the figure upscales it by nearest neighbour), otherwise
//! a sample covers a block of tokens and its colour runs from the light tint of its tile
//! class to the dark one with the square root of the visible fraction of that block (so a
//! sparse band, 5% visible, still shows; one token per sample is 0 or 1 either way).

use compilemask::MaskPlan;

/// Visible pairs of full tiles: dark green.
pub const FULL_DARK: [u8; 3] = [20, 110, 45];
/// Hidden pairs where a downsampled sample centred in a full tile straddles its edge.
pub const FULL_LIGHT: [u8; 3] = [200, 235, 200];
/// Visible pairs of partial tiles: dark amber.
pub const PARTIAL_DARK: [u8; 3] = [200, 105, 0];
/// Hidden pairs of partial tiles: light amber.
pub const PARTIAL_LIGHT: [u8; 3] = [252, 230, 175];
/// Empty tiles: light grey (dark grey only where a downsampled sample straddles a visible
/// pair of a neighbouring tile).
pub const EMPTY_LIGHT: [u8; 3] = [235, 235, 235];
pub const EMPTY_DARK: [u8; 3] = [110, 110, 110];

/// A tile's class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileClass {
    Empty,
    Partial,
    Full,
}

/// The class of tile `(m, n)` (query block `m`, key block `n`), by binary search in the
/// descriptor's sorted per-block lists.
pub fn tile_class(mask: &MaskPlan, m: u32, n: u32) -> TileClass {
    let t = &mask.tiles;
    let m = m as usize;
    let full = &t.full_kv_indices[t.full_kv_offsets[m] as usize..t.full_kv_offsets[m + 1] as usize];
    if full.binary_search(&n).is_ok() {
        return TileClass::Full;
    }
    let part = &t.kv_indices[t.kv_offsets[m] as usize..t.kv_offsets[m + 1] as usize];
    if part.binary_search(&n).is_ok() {
        TileClass::Partial
    } else {
        TileClass::Empty
    }
}

/// `sy` rows of `sx` RGB samples, row-major.
#[derive(Clone, Debug)]
pub struct Raster {
    pub sx: u32,
    pub sy: u32,
    pub rgb: Vec<u8>,
    /// Visible pairs inside the view.
    pub visible: u64,
}

impl Raster {
    pub fn at(&self, x: u32, y: u32) -> [u8; 3] {
        let i = (y as usize * self.sx as usize + x as usize) * 3;
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }
}

fn mix(bg: [u8; 3], fg: [u8; 3], f: f64) -> [u8; 3] {
    std::array::from_fn(|c| (f64::from(bg[c]) * (1.0 - f) + f64::from(fg[c]) * f).round() as u8)
}

/// Samples rows `rows.0 .. rows.1` and keys `cols.0 .. cols.1` (half-open, non-empty,
/// inside the mask) of `mask` into at most `max_x x max_y` samples. Cost: O(rows in view x
/// intervals per row + samples x log(tiles per block row)).
pub fn sample(
    mask: &MaskPlan,
    rows: (u32, u32),
    cols: (u32, u32),
    max_x: u32,
    max_y: u32,
) -> Raster {
    let (nr, nc) = (rows.1 - rows.0, cols.1 - cols.0);
    let (sx, sy) = (nc.min(max_x).max(1), nr.min(max_y).max(1));
    // Tokens per sample column; rows are assigned whole to sample rows.
    let wf = f64::from(nc) / f64::from(sx);
    let mut cover = vec![0f64; sx as usize * sy as usize];
    let mut count = vec![0u32; sy as usize];
    let mut visible = 0u64;
    let mut diff = vec![0f64; sx as usize + 1];
    let mut line = vec![0f64; sx as usize];
    let mut current = 0usize;
    let flush = |line: &mut [f64], diff: &mut [f64], out: &mut [f64]| {
        let mut run = 0.0;
        for (x, o) in out.iter_mut().enumerate() {
            run += diff[x];
            *o += line[x] + run;
            line[x] = 0.0;
            diff[x] = 0.0;
        }
        diff[line.len()] = 0.0;
    };
    for q in rows.0..rows.1 {
        let y = (u64::from(q - rows.0) * u64::from(sy) / u64::from(nr)) as usize;
        if y != current {
            let out = &mut cover[current * sx as usize..(current + 1) * sx as usize];
            flush(&mut line, &mut diff, out);
            current = y;
        }
        count[y] += 1;
        // Keys [s, e) visible with weight `w` each (1, or 1 / stride spread over a
        // strided run too dense to draw key by key).
        let mut add = |s: u32, e: u32, w: f64| {
            let xs = f64::from(s - cols.0) / wf;
            let xe = f64::from(e - cols.0) / wf;
            let first = (xs.floor() as usize).min(sx as usize - 1);
            let last = ((xe.ceil() as usize).max(1) - 1).min(sx as usize - 1);
            if first == last {
                line[first] += (xe - xs) * wf * w;
            } else {
                line[first] += (first as f64 + 1.0 - xs) * wf * w;
                line[last] += (xe - last as f64) * wf * w;
                diff[first + 1] += wf * w;
                diff[last] -= wf * w;
            }
        };
        let strides = mask.rows.row_strides(q);
        for (j, iv) in mask.rows.row_runs(q).iter().enumerate() {
            let (s, e) = (iv.start.max(cols.0), iv.end.min(cols.1));
            if s >= e {
                continue;
            }
            let st = strides.map_or(1, |st| st[j]);
            if st == 1 {
                visible += u64::from(e - s);
                add(s, e, 1.0);
                continue;
            }
            // The run's keys in [s, e).
            let k0 = iv.start + (s - iv.start).div_ceil(st) * st;
            if k0 >= e {
                continue;
            }
            let keys = (e - 1 - k0) / st + 1;
            visible += u64::from(keys);
            if keys <= 2 * sx {
                for i in 0..keys {
                    let k = k0 + i * st;
                    add(k, k + 1, 1.0);
                }
            } else {
                add(k0, k0 + (keys - 1) * st + 1, 1.0 / f64::from(st));
            }
        }
    }
    let out = &mut cover[current * sx as usize..(current + 1) * sx as usize];
    flush(&mut line, &mut diff, out);

    let t = mask.tiles.tile;
    let mut rgb = Vec::with_capacity(sx as usize * sy as usize * 3);
    for y in 0..sy {
        let q = rows.0 + ((f64::from(y) + 0.5) * f64::from(nr) / f64::from(sy)) as u32;
        let m = q.min(rows.1 - 1) / t.block_m;
        let pairs = f64::from(count[y as usize].max(1)) * wf;
        for x in 0..sx {
            let k = cols.0 + ((f64::from(x) + 0.5) * wf) as u32;
            let n = k.min(cols.1 - 1) / t.block_n;
            let (bg, fg) = match tile_class(mask, m, n) {
                TileClass::Full => (FULL_LIGHT, FULL_DARK),
                TileClass::Partial => (PARTIAL_LIGHT, PARTIAL_DARK),
                TileClass::Empty => (EMPTY_LIGHT, EMPTY_DARK),
            };
            // Rounding in the running sums can leave a hair below 0 or above 1.
            let frac = (cover[(y * sx + x) as usize] / pairs).clamp(0.0, 1.0);
            rgb.extend_from_slice(&mix(bg, fg, frac.sqrt()));
        }
    }
    Raster {
        sx,
        sy,
        rgb,
        visible,
    }
}
