//! `compilemask demo`: the main job on built-in defaults. Plans the eight workloads of
//! docs/workloads.md at 32K tokens, prints one table, draws each mask, and checks the CPU
//! reference attention on a slice of rows of each against a dense float64 softmax.

use anyhow::{anyhow, Result};
use compilemask::{AttentionShape, Masks, PlanOptions, RowIntervals};
use std::io::Write;

/// (workload id, built-in name, q_len): 32K, CLEAR at its nearest grid (180).
const WORKLOADS: &[(&str, &str, i64)] = &[
    ("W1", "causal", 32768),
    ("W2", "hstu", 32768),
    ("W3", "shared_prefix", 32768),
    ("W4", "clear", 32912),
    ("W5", "sliding_window", 32768),
    ("W6", "document_causal", 32768),
    ("W7", "trace_documents", 32768),
    ("W8", "trace_prompt_groups", 32768),
];

/// Rows of each mask checked against the dense softmax.
const SLICE_ROWS: u32 = 48;
const HEAD_DIM: usize = 64;

/// `println!` for `run`: a closed standard output ends the demo quietly, another write error
/// fails it (`finish_output`).
macro_rules! say {
    ($($arg:tt)*) => {
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            return crate::finish_output(Err(e), "to standard output");
        }
    };
}

pub fn run(out_dir: &std::path::Path) -> Result<()> {
    if out_dir.exists() && !out_dir.is_dir() {
        return Err(anyhow!(
            "--out `{}` is a file; expected a directory (it is created if missing) for the demo's pictures",
            out_dir.display()
        ));
    }
    std::fs::create_dir_all(out_dir)
        .map_err(|e| anyhow!("cannot create `{}`: {e}", out_dir.display()))?;
    say!("CompileMask demo: the eight workloads of docs/workloads.md, tile 128x128, planned on one core\n");
    say!(
        "{:<3} {:<20} {:>6} {:>8} {:>9} {:>7} {:>8} {:>7} {:>10} {:>8} {:>11}",
        "id",
        "mask",
        "q_len",
        "visible",
        "max_iv",
        "full",
        "partial",
        "empty",
        "desc_KiB",
        "plan_ms",
        "attn_err"
    );
    for (id, name, q_len) in WORKLOADS {
        let program = compilemask::builtin(name).map_err(|e| anyhow!("{}", e.rendered))?;
        let options = PlanOptions::new(*q_len);
        let t0 = std::time::Instant::now();
        let plan = program
            .plan(&options)
            .map_err(|e| anyhow!("{}", program.render_error(&e)))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let mask = plan.mask(0, 0);
        let structure = crate::show::structure(&program, &options, &plan)?;
        for (ext, format) in [
            ("png", crate::show::Format::Png),
            ("html", crate::show::Format::Html),
        ] {
            crate::show::write(
                &program,
                &plan,
                structure.as_ref(),
                &cm_view::View::default(),
                (&out_dir.join(format!("{name}.{ext}")), format),
                ms,
            )?;
        }
        let err = slice_error(&mask.rows)?;
        let t = plan.tile_counts();
        let frac = plan.visible_pairs() as f64 / (*q_len as f64 * *q_len as f64);
        say!(
            "{:<3} {:<20} {:>6} {:>8.3} {:>9} {:>7} {:>8} {:>7} {:>10.1} {:>8.3} {:>11.2e}",
            id,
            name,
            q_len,
            frac,
            plan.max_intervals_per_row(),
            t.full,
            t.partial,
            t.empty,
            plan.descriptor_bytes() as f64 / 1024.0,
            ms,
            err
        );
    }
    say!("\nvisible = visible pairs / q_len^2; max_iv = most key intervals in one row; desc_KiB = bytes a kernel reads;");
    say!("attn_err = max |CPU reference attention (f32) - dense float64 softmax| on {SLICE_ROWS} rows, head_dim {HEAD_DIM}.");
    say!("Pictures: {}/<mask>.png: visible pairs dark green in full tiles and dark amber in partial tiles,", out_dir.display());
    say!("hidden pairs of partial tiles light amber, empty tiles light grey; dashed lines and the lanes on the right");
    say!("mark the mask's segments, parts and grids. {}/<mask>.html: the same, explorable (zoom, pan, each row's", out_dir.display());
    say!("intervals under the pointer), in one self-contained page.");
    Ok(())
}

/// A deterministic pseudo-random stream (SplitMix64) in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// Max abs error of the f32 reference against a dense f64 softmax, on rows spread over the
/// mask (segment starts and ends included by taking evenly spaced rows).
fn slice_error(rows: &RowIntervals) -> Result<f64> {
    let (q_len, kv_len) = (rows.q_len(), rows.kv_len());
    let picks: Vec<u32> = (0..SLICE_ROWS)
        .map(|i| (u64::from(i) * u64::from(q_len - 1) / u64::from(SLICE_ROWS - 1)) as u32)
        .collect();
    let slice: Vec<Vec<(u32, u32)>> = picks
        .iter()
        .map(|&q| {
            rows.row_expanded(q)
                .iter()
                .map(|iv| (iv.start, iv.end))
                .collect()
        })
        .collect();
    let sub = RowIntervals::from_rows(kv_len, &slice).map_err(|e| anyhow!(e))?;
    let n = picks.len();
    let kv = kv_len as usize;
    let q = values(1, n * HEAD_DIM);
    let k = values(2, kv * HEAD_DIM);
    let v = values(3, kv * HEAD_DIM);
    let shape = AttentionShape {
        batch: 1,
        num_heads: 1,
        num_kv_heads: 1,
        q_len: n,
        kv_len: kv,
        head_dim: HEAD_DIM,
        head_dim_v: HEAD_DIM,
    };
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let f32s = |x: &[f64]| x.iter().map(|&a| a as f32).collect::<Vec<f32>>();
    let out = compilemask::attention_forward(
        &shape,
        &f32s(&q),
        &f32s(&k),
        &f32s(&v),
        &Masks::shared(&sub),
        scale as f32,
    )
    .map_err(|e| anyhow!("reference attention: {e}"))?;
    // Dense float64 masked softmax over every key, from the same f32-rounded inputs.
    let r = |x: &[f64]| x.iter().map(|&a| f64::from(a as f32)).collect::<Vec<f64>>();
    let (q, k, v) = (r(&q), r(&k), r(&v));
    let mut max_err = 0f64;
    for i in 0..n {
        let logits: Vec<f64> = (0..kv)
            .map(|j| {
                if sub.is_visible(i as u32, j as u32) {
                    (0..HEAD_DIM)
                        .map(|d| q[i * HEAD_DIM + d] * k[j * HEAD_DIM + d])
                        .sum::<f64>()
                        * f64::from(scale as f32)
                } else {
                    f64::NEG_INFINITY
                }
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        for d in 0..HEAD_DIM {
            let want = if m == f64::NEG_INFINITY {
                0.0
            } else {
                let (num, den) =
                    logits
                        .iter()
                        .enumerate()
                        .fold((0.0, 0.0), |(num, den), (j, &l)| {
                            let p = (l - m).exp();
                            (num + p * v[j * HEAD_DIM + d], den + p)
                        });
                num / den
            };
            max_err = max_err.max((f64::from(out.out[i * HEAD_DIM + d]) - want).abs());
        }
    }
    Ok(max_err)
}
