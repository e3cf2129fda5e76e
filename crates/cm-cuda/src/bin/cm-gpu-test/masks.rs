//! Test masks as per-row visible key intervals (half-open `[start, end)`), built directly so
//! the GPU test does not depend on the mask compiler; each follows workloads.md where it has a
//! counterpart there.

use cm_plan::rows::RowIntervals;

/// Sorts, drops empty runs and merges touching ones, so rows satisfy RowIntervals' invariants.
fn normalize(mut row: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    row.retain(|&(a, b)| a < b);
    row.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(row.len());
    for (a, b) in row {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn build(kv_len: u32, rows: Vec<Vec<(u32, u32)>>) -> RowIntervals {
    let rows: Vec<_> = rows.into_iter().map(normalize).collect();
    RowIntervals::from_rows(kv_len, &rows).expect("test masks are normalized")
}

/// Causal, bottom-right aligned (`q` sees keys `<= q + kv_len - q_len`); rows that see nothing
/// when `q_len > kv_len` are empty. W1 when `q_len == kv_len`.
pub fn causal(q_len: u32, kv_len: u32) -> RowIntervals {
    let shift = i64::from(kv_len) - i64::from(q_len);
    build(
        kv_len,
        (0..q_len)
            .map(|q| {
                vec![(
                    0,
                    (i64::from(q) + shift + 1).clamp(0, i64::from(kv_len)) as u32,
                )]
            })
            .collect(),
    )
}

/// W5: `[max(0, q - w + 1), q + 1)`.
pub fn sliding_window(len: u32, window: u32) -> RowIntervals {
    build(
        len,
        (0..len)
            .map(|q| vec![((q + 1).saturating_sub(window), q + 1)])
            .collect(),
    )
}

/// Splits `[0, len)` into segments of the cycled `lengths` (zero entries add nothing).
fn segments(len: u32, lengths: &[u32]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let mut at = 0;
    for &l in lengths.iter().cycle() {
        if at >= len {
            break;
        }
        if l > 0 {
            out.push((at, (at + l).min(len)));
            at += l;
        }
    }
    out
}

/// W6: causal inside each document.
pub fn document_causal(len: u32, lengths: &[u32]) -> RowIntervals {
    let mut rows = Vec::new();
    for (o, end) in segments(len, lengths) {
        rows.extend((o..end).map(|q| vec![(o, q + 1)]));
    }
    build(len, rows)
}

/// W2 HSTU: per user of length L at offset o, C = 8 contextual rows, T = max(1, L / 8) target
/// rows `[o, E) U [q, q + 1)` (two intervals), history rows `[o, q + 1)`.
pub fn hstu(len: u32, lengths: &[u32]) -> RowIntervals {
    let mut rows = Vec::new();
    for (o, end) in segments(len, lengths) {
        // The last user is cut to fit; it is a user of the cut length.
        let l = end - o;
        let t = (l / 8).max(1).min(l);
        let e = o + l - t;
        for q in o..end {
            let i = q - o;
            rows.push(if i + t >= l {
                vec![(o, e), (q, q + 1)]
            } else if i < 8 {
                vec![(o, e)]
            } else {
                vec![(o, q + 1)]
            });
        }
    }
    build(len, rows)
}

/// W4 CLEAR on a small grid: `text` prefix tokens, then an `n x n` grid in raster order;
/// image tokens see image tokens at squared distance `< r^2`; everyone sees the text; text
/// rows see everything. Up to `2r - 1` image intervals per row.
pub fn clear(text: u32, n: u32, r: u32) -> RowIntervals {
    let len = text + n * n;
    let mut rows: Vec<Vec<(u32, u32)>> = (0..text).map(|_| vec![(0, len)]).collect();
    let r2 = i64::from(r * r);
    for y in 0..n as i64 {
        for x in 0..n as i64 {
            let mut row = vec![(0, text)];
            for y2 in (y - i64::from(r) + 1).max(0)..=(y + i64::from(r) - 1).min(n as i64 - 1) {
                let dy2 = (y2 - y) * (y2 - y);
                let rest = r2 - dy2; // need dx^2 < rest
                if rest <= 0 {
                    continue;
                }
                let mut dx = 0i64;
                while (dx + 1) * (dx + 1) < rest {
                    dx += 1;
                }
                let (x0, x1) = ((x - dx).max(0), (x + dx).min(n as i64 - 1));
                let base = i64::from(text) + y2 * n as i64;
                row.push(((base + x0) as u32, (base + x1 + 1) as u32));
            }
            rows.push(row);
        }
    }
    build(len, rows)
}

/// Many short intervals per row: causal (bottom-right) restricted to keys with
/// `(k / 7) % 3 == q % 3` (runs of 7 every 21 keys).
pub fn striped(q_len: u32, kv_len: u32) -> RowIntervals {
    let shift = i64::from(kv_len) - i64::from(q_len);
    let rows = (0..q_len)
        .map(|q| {
            let hi = (i64::from(q) + shift + 1).clamp(0, i64::from(kv_len)) as u32;
            (0..hi.div_ceil(7))
                .filter(|c| c % 3 == q % 3)
                .map(|c| (c * 7, (c * 7 + 7).min(hi)))
                .collect()
        })
        .collect();
    build(kv_len, rows)
}

/// Causal with empty rows: every 5th row, and the whole run `[100, 228)` (which empties one
/// complete 64-row query block), see nothing.
pub fn causal_with_empty_rows(len: u32) -> RowIntervals {
    build(
        len,
        (0..len)
            .map(|q| {
                if q % 5 == 0 || (100..228).contains(&q) {
                    vec![]
                } else {
                    vec![(0, q + 1)]
                }
            })
            .collect(),
    )
}

/// Every key visible: only full tiles, with a ragged last key tile when `kv_len % 64 != 0`.
pub fn full(q_len: u32, kv_len: u32) -> RowIntervals {
    build(kv_len, (0..q_len).map(|_| vec![(0, kv_len)]).collect())
}
