//! The `compilemask` command line: check, plan, inspect, draw and export attention masks.

mod bench;
mod demo;
mod mask_args;
mod show;

use anyhow::{anyhow, Result};
use clap::{Parser, Subcommand, ValueEnum};
use mask_args::MaskArgs;
use serde_json::json;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "compilemask",
    version,
    about = "Compile attention masks written in the CompileMask language"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a mask program and print its diagnostics; exit 1 on error.
    Check {
        /// The program file.
        file: String,
    },
    /// Plan a mask: intervals, tiles and transposes; print statistics.
    Plan {
        #[command(flatten)]
        mask: MaskArgs,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Print the visible key intervals of rows A..B-1.
    Intervals {
        #[command(flatten)]
        mask: MaskArgs,
        /// Rows A:B (half-open, 0-based).
        #[arg(long, value_parser = parse_rows)]
        rows: (u32, u32),
        /// Batch index, for masks that depend on it.
        #[arg(long, default_value_t = 0)]
        b: u32,
        /// Head index, for masks that depend on it.
        #[arg(long, default_value_t = 0)]
        h: u32,
        /// Print JSON (the default output is one line per row).
        #[arg(long)]
        json: bool,
    },
    /// Draw the mask and its tile classes as a PNG.
    Show {
        #[command(flatten)]
        mask: MaskArgs,
        /// Output file.
        #[arg(short, long)]
        output: String,
    },
    /// Export the mask in another system's format, as JSON.
    Export {
        #[command(flatten)]
        mask: MaskArgs,
        #[arg(long, value_enum)]
        format: ExportFormat,
        /// Output file (default: standard output).
        #[arg(short, long)]
        output: Option<String>,
    },
    /// List the built-in masks and their parameters.
    List,
    /// Check and time the forward kernel on the benchmark workloads (needs an H100 / H200 and
    /// a build with embedded kernels); exit 1 if a correctness check fails.
    Bench(bench::BenchArgs),
    /// The main job on built-in defaults: plan, draw and check the eight benchmark workloads.
    Demo {
        /// Folder for the pictures.
        #[arg(long, default_value = "compilemask-demo")]
        out: String,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportFormat {
    /// Dense boolean mask `[q_len][kv_len]` (refused above 2^28 elements).
    Dense,
    /// FlexAttention BlockMask tensors at --tile.
    Flex,
    /// cuDNN flex_attention interval endpoints.
    Cudnn,
    /// FlashMask column bounds, where expressible.
    Flashmask,
}

/// Largest dense table the CLI prints as JSON, in elements (the library's own limit is
/// larger; JSON text costs several bytes per element).
const CLI_DENSE_LIMIT: i64 = 1 << 24;

fn parse_rows(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("`{s}` is not a row range; expected A:B with 0 <= A < B, e.g. 0:16");
    let (a, b) = s.split_once(':').ok_or_else(bad)?;
    let a: u32 = a.trim().parse().map_err(|_| bad())?;
    let b: u32 = b.trim().parse().map_err(|_| bad())?;
    if a >= b {
        return Err(bad());
    }
    Ok((a, b))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Check { file } => {
            let src = mask_args::read_source(&file)?;
            match compilemask::compile_named(&src, &file) {
                Ok(p) => {
                    eprint!("{}", compilemask::render(&src, &file, p.warnings()));
                    let params: Vec<String> = p
                        .params()
                        .iter()
                        .map(|(n, arr, _)| {
                            if *arr {
                                format!("{n}: [int]")
                            } else {
                                format!("{n}: int")
                            }
                        })
                        .collect();
                    let how = if p.uses_elementwise() {
                        "; uses elementwise (evaluated pair by pair)"
                    } else {
                        ""
                    };
                    println!(
                        "ok: {file} ({} warning(s); parameters: {}{how})",
                        p.warnings().len(),
                        if params.is_empty() {
                            "none".into()
                        } else {
                            params.join(", ")
                        }
                    );
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    eprint!("{}", e.rendered);
                    Ok(ExitCode::from(1))
                }
            }
        }
        Command::Plan { mask, json } => {
            let (program, options, plan, ms) = mask.plan()?;
            let t = plan.tile_counts();
            let out = json!({
                "mask": program.name(),
                "q_len": plan.q_len,
                "kv_len": plan.kv_len,
                "batch": plan.batch,
                "num_heads": plan.num_heads,
                "tile": [plan.tile.block_m, plan.tile.block_n],
                "visible_pairs": plan.visible_pairs(),
                "empty_rows": plan.empty_rows(),
                "max_intervals_per_row": plan.max_intervals_per_row(),
                "tiles": {"full": t.full, "partial": t.partial, "empty": t.empty},
                "computed_pairs": plan.computed_pairs(),
                "descriptor_bytes": plan.descriptor_bytes(),
                "distinct_masks": plan.masks.len(),
                "pieces": plan.pieces,
                "elementwise_pairs": plan.elementwise_pairs,
                "compile_ms": ms,
            });
            let mut out = out;
            if let Some(o) = &plan.order {
                out["order"] = json!({
                    "patch": o.patch,
                    "traversal": o.traversal,
                    "raster_computed_pairs": plan.raster_computed_pairs,
                    "tile_density_before": plan.visible_pairs() as f64 / plan.raster_computed_pairs.max(1) as f64,
                    "tile_density_after": plan.visible_pairs() as f64 / plan.computed_pairs().max(1) as f64,
                    "candidates": plan.order_candidates,
                });
            }
            if json {
                println!("{out}");
            } else {
                let pairs = options.shape().q_len as f64 * options.shape().kv_len as f64;
                println!(
                    "{}: q_len {} kv_len {}, tile {}x{}",
                    program.name(),
                    plan.q_len,
                    plan.kv_len,
                    plan.tile.block_m,
                    plan.tile.block_n
                );
                println!(
                    "  visible pairs   {} ({:.4} of q_len x kv_len)",
                    plan.visible_pairs(),
                    plan.visible_pairs() as f64 / pairs / (plan.batch * plan.num_heads) as f64
                );
                println!("  empty rows      {}", plan.empty_rows());
                println!("  intervals/row   at most {}", plan.max_intervals_per_row());
                println!(
                    "  tiles           {} full, {} partial, {} empty",
                    t.full, t.partial, t.empty
                );
                println!(
                    "  computed pairs  {} (tile density {:.3})",
                    plan.computed_pairs(),
                    plan.visible_pairs() as f64 / plan.computed_pairs().max(1) as f64
                );
                println!("  descriptor      {} bytes", plan.descriptor_bytes());
                if let Some(o) = &plan.order {
                    let before =
                        plan.visible_pairs() as f64 / plan.raster_computed_pairs.max(1) as f64;
                    println!("  token order     patch {:?} {:?}: tile density {before:.3} in raster order", o.patch, o.traversal);
                }
                if plan.elementwise_pairs > 0 {
                    println!(
                        "  elementwise     {} pairs evaluated one by one",
                        plan.elementwise_pairs
                    );
                }
                println!("  plan time       {ms:.3} ms");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Intervals {
            mask,
            rows,
            b,
            h,
            json,
        } => {
            let (_, _, plan, _) = mask.plan()?;
            if rows.1 > plan.q_len {
                return Err(anyhow!("--rows {}:{} is out of range; the mask has q_len = {} rows (0-based, half-open)", rows.0, rows.1, plan.q_len));
            }
            if b >= plan.batch {
                return Err(anyhow!(
                    "--b {b} is out of range; the plan has batch = {} (indices 0 ..= {})",
                    plan.batch,
                    plan.batch - 1
                ));
            }
            if h >= plan.num_heads {
                return Err(anyhow!(
                    "--h {h} is out of range; the plan has num_heads = {} (indices 0 ..= {})",
                    plan.num_heads,
                    plan.num_heads - 1
                ));
            }
            let m = plan.mask(b, h);
            let list: Vec<_> = (rows.0..rows.1)
                .map(|q| json!({"q": q, "intervals": m.rows.row(q).iter().map(|iv| [iv.start, iv.end]).collect::<Vec<_>>()}))
                .collect();
            if json {
                println!("{}", json!({ "rows": list }));
            } else {
                for q in rows.0..rows.1 {
                    let ivs: Vec<String> = m
                        .rows
                        .row(q)
                        .iter()
                        .map(|iv| format!("[{}, {})", iv.start, iv.end))
                        .collect();
                    println!(
                        "{q}: {}",
                        if ivs.is_empty() {
                            "(empty)".to_string()
                        } else {
                            ivs.join(" U ")
                        }
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Show { mask, output } => {
            let (program, _, plan, _) = mask.plan()?;
            let (w, h) = show::write_png(plan.mask(0, 0), &output)?;
            println!("wrote {output} ({w}x{h} pixels) for {}", program.name());
            Ok(ExitCode::SUCCESS)
        }
        Command::Export {
            mask,
            format,
            output,
        } => {
            // Refuse before planning what would be refused after it.
            let shape = mask.options()?.shape();
            let (bm, bn) = (i64::from(mask.tile.block_m), i64::from(mask.tile.block_n));
            let (rows, cols, what) = match format {
                ExportFormat::Dense => (shape.q_len, shape.kv_len, "mask"),
                ExportFormat::Flex => (
                    (shape.q_len + bm - 1) / bm,
                    (shape.kv_len + bn - 1) / bn,
                    "block table",
                ),
                ExportFormat::Cudnn | ExportFormat::Flashmask => (0, 0, ""),
            };
            if rows.saturating_mul(cols) > CLI_DENSE_LIMIT {
                return Err(anyhow!(
                    "error[CM0403]: a dense {what} of {rows} x {cols} elements is too large to print as JSON (limit {CLI_DENSE_LIMIT}); use `intervals`, `--format cudnn` or a larger --tile"
                ));
            }
            let (_, _, plan, _) = mask.plan()?;
            let m = plan.mask(0, 0);
            let value = match format {
                ExportFormat::Dense => {
                    let d = compilemask::export::dense(&m.rows)?;
                    let rows: Vec<Vec<u8>> =
                        d.chunks(plan.kv_len as usize).map(<[u8]>::to_vec).collect();
                    json!({ "q_len": plan.q_len, "kv_len": plan.kv_len, "mask": rows })
                }
                ExportFormat::Flex => {
                    serde_json::to_value(compilemask::export::flex_block_mask(&m.tiles)?)?
                }
                ExportFormat::Cudnn => {
                    serde_json::to_value(compilemask::export::cudnn_endpoints(&m.rows))?
                }
                ExportFormat::Flashmask => {
                    serde_json::to_value(compilemask::export::flashmask_bounds(&m.rows)?)?
                }
            };
            match output {
                Some(path) => std::fs::write(&path, value.to_string())
                    .map_err(|e| anyhow!("cannot write `{path}`: {e}"))?,
                None => println!("{value}"),
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::List => {
            for b in compilemask::BUILTINS {
                let p = compilemask::builtin(b.name).map_err(|e| anyhow!("{}", e.rendered))?;
                let params: Vec<String> = p
                    .params()
                    .iter()
                    .map(|(n, arr, _)| if *arr { format!("{n}=[..]") } else { n.clone() })
                    .collect();
                println!(
                    "{:<20} {}\n{:<20} parameters: {}",
                    b.name,
                    b.summary(),
                    "",
                    if params.is_empty() {
                        "none".into()
                    } else {
                        params.join(", ")
                    }
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(args) => Ok(if bench::run(&args)? {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }),
        Command::Demo { out } => {
            demo::run(&out)?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
