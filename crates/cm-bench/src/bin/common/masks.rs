//! Test masks as per-row visible key intervals (half-open `[start, end)`), built directly so
//! the GPU tests do not depend on the mask compiler; each follows docs/workloads.md where it has a
//! counterpart there. A unit test compares the W3, W7 and W8 builders with the compiler's
//! built-ins (`shared_prefix`, `trace_documents`, `trace_prompt_groups`).

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

/// W3 shared prefix (and W8 with the trace's lengths): sample `j` is a prompt of the cycled
/// `prompts[j]` followed by `group` responses taking the next entries of the cycled
/// `responses`; prompt rows are causal within the prompt, response rows see the whole prompt
/// and their own response causally. The last sample is cut at `len`; zero lengths add nothing.
pub fn shared_prefix(len: u32, prompts: &[u32], responses: &[u32], group: usize) -> RowIntervals {
    assert!(prompts.iter().any(|&p| p > 0), "every prompt is empty");
    let mut rows: Vec<Vec<(u32, u32)>> = Vec::new();
    let mut responses = responses.iter().cycle();
    for &p in prompts.iter().cycle() {
        let p0 = rows.len() as u32;
        if p0 >= len {
            break;
        }
        let p1 = (p0 + p).min(len);
        rows.extend((p0..p1).map(|q| vec![(p0, q + 1)]));
        for &r in responses.by_ref().take(group) {
            let r0 = rows.len() as u32;
            rows.extend((r0..(r0 + r).min(len)).map(|q| vec![(p0, p1), (r0, q + 1)]));
        }
    }
    build(len, rows)
}

/// `(ContextTokens, GeneratedTokens)` of the bundled Azure LLM inference trace 2023
/// (data/README.md), in file order: the lengths of W7 and W8.
pub fn trace() -> (Vec<u32>, Vec<u32>) {
    const CSV: &str = include_str!("../../../../../data/azure-llm-trace-2023-conv.csv");
    CSV.lines()
        .filter_map(|line| {
            let mut cols = line.trim().split(',').skip(1).map(str::parse::<u32>);
            Some((cols.next()?.ok()?, cols.next()?.ok()?))
        })
        .unzip()
}

/// W7: document causal, document `i` of `ContextTokens_i + GeneratedTokens_i` tokens.
pub fn trace_documents(len: u32) -> RowIntervals {
    let (context, generated) = trace();
    let docs: Vec<u32> = context.iter().zip(&generated).map(|(c, g)| c + g).collect();
    document_causal(len, &docs)
}

/// W8: [`shared_prefix`] with prompt `j` of `ContextTokens_j` and its 8 responses
/// `GeneratedTokens_{8j..8j+7}`.
pub fn trace_prompt_groups(len: u32) -> RowIntervals {
    let (context, generated) = trace();
    shared_prefix(len, &context, &generated, 8)
}

/// The eight workloads of docs/workloads.md at sequence length `len` with their default
/// parameters (CLEAR at the `180 x 180` grid of the 32K headline when `len >= 32768`, else
/// the `90 x 90` one), named `W1 causal 8K` etc.
pub fn workloads(len: u32) -> Vec<(String, RowIntervals)> {
    let k = len / 1024;
    let hstu_lengths = [2048, 1536, 3072, 1024, 2560, 512, 4096, 1280];
    let docs = [4096, 1024, 8192, 512, 2048, 3072, 256, 6144];
    let responses = [384, 512, 640, 256, 768, 448, 320, 576];
    // W3's flat list: the 8 responses rotated left by 0, 1, ..., 7 in turn.
    let w3: Vec<u32> = (0..8)
        .flat_map(|j| (0..8).map(move |i| responses[(i + j) % 8]))
        .collect();
    let grid = if len >= 32768 { 180 } else { 90 };
    vec![
        (format!("W1 causal {k}K"), causal(len, len)),
        (format!("W2 hstu {k}K"), hstu(len, &hstu_lengths)),
        (
            format!("W3 shared_prefix {k}K"),
            shared_prefix(len, &[3072, 1536, 2048, 4096], &w3, 8),
        ),
        (format!("W4 clear grid {grid}"), clear(512, grid, 16)),
        (format!("W5 sliding_window {k}K"), sliding_window(len, 4096)),
        (
            format!("W6 document_causal {k}K"),
            document_causal(len, &docs),
        ),
        (format!("W7 trace_documents {k}K"), trace_documents(len)),
        (
            format!("W8 trace_prompt_groups {k}K"),
            trace_prompt_groups(len),
        ),
    ]
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

/// The masks both GPU tests run at small and odd sizes, with their (batch, heads, kv_heads):
/// every workload of docs/workloads.md (W3, W7 and W8 included), q_len != kv_len, striped and empty
/// rows, ragged key tails, GQA and MQA.
pub fn shared_cases() -> Vec<(&'static str, RowIntervals, (usize, usize, usize))> {
    let w2 = [700, 300, 1200, 64, 9, 1000, 0, 513];
    let w6 = [300, 1, 0, 450, 77, 2000, 64, 128];
    // W3 at small sizes: odd prompts and responses (1-token and empty ones included); and a
    // last sample whose prompt is cut.
    let w3 = |len| {
        let responses = [24, 40, 1, 64, 0, 33, 17, 90, 5, 12, 70, 3];
        shared_prefix(len, &[200, 96, 7, 150], &responses, 8)
    };
    vec![
        ("causal", causal(17, 100), (2, 4, 2)),
        ("causal", causal(1000, 1500), (1, 4, 2)),
        ("causal", causal(300, 200), (2, 4, 2)),
        ("causal", causal(2049, 2049), (1, 2, 1)),
        ("W2 hstu", hstu(1000, &w2), (2, 4, 2)),
        ("W3 shared_prefix", w3(1000), (2, 4, 2)),
        ("W3 shared_prefix", w3(2049), (1, 8, 2)),
        (
            "W3 shared_prefix cut prompt",
            shared_prefix(777, &[500, 400], &[20, 30], 8),
            (1, 4, 4),
        ),
        ("W4 clear 37+30x30 r5", clear(37, 30, 5), (1, 4, 2)),
        ("W4 clear 17+20x20 r5", clear(17, 20, 5), (1, 8, 2)),
        ("W5 sliding_window", sliding_window(1000, 256), (2, 4, 2)),
        ("W5 sliding_window", sliding_window(1537, 300), (1, 4, 1)),
        ("W6 document_causal", document_causal(1000, &w6), (1, 4, 2)),
        ("W6 document_causal", document_causal(2049, &w6), (1, 8, 2)),
        ("W7 trace_documents", trace_documents(1000), (2, 4, 2)),
        ("W7 trace_documents", trace_documents(3001), (1, 8, 2)),
        (
            "W8 trace_prompt_groups",
            trace_prompt_groups(1000),
            (2, 4, 2),
        ),
        (
            "W8 trace_prompt_groups",
            trace_prompt_groups(3001),
            (1, 8, 2),
        ),
        ("striped", striped(333, 777), (2, 2, 1)),
        ("empty_rows", causal_with_empty_rows(1000), (2, 4, 2)),
        ("full", full(1000, 777), (1, 4, 2)),
        ("causal_gqa32/8", causal(257, 257), (1, 32, 8)),
        ("causal_mqa", causal(500, 500), (2, 4, 1)),
    ]
}

/// Every key visible: only full tiles, with a ragged last key tile when `kv_len % 64 != 0`.
pub fn full(q_len: u32, kv_len: u32) -> RowIntervals {
    build(kv_len, (0..q_len).map(|_| vec![(0, kv_len)]).collect())
}
