//! The `compilemask` command line: check, plan, inspect, draw and export attention masks.

mod bench;
mod demo;
mod mask_args;
mod score;
mod shard;
mod show;

use anyhow::{anyhow, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use mask_args::MaskArgs;
use serde_json::json;
use std::io::{BufWriter, Write};
use std::process::ExitCode;

// jemalloc with transparent huge pages (configured in .cargo/config.toml): planning writes
// its arrays once into fresh memory, and first-touch faults of 4 KiB pages were a third of
// a single `plan` call's time on large masks (BENCHMARKS.md).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "compilemask",
    bin_name = "compilemask",
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
        /// The program file, or `-` for standard input.
        #[arg(conflicts_with = "builtin")]
        file: Option<std::path::PathBuf>,
        /// A built-in mask instead of a file (see `compilemask list`).
        #[arg(long)]
        builtin: Option<String>,
        /// Treat the program's warnings as errors (exit 1).
        #[arg(long)]
        deny_warnings: bool,
    },
    /// Plan a mask: intervals, tiles and transposes; print statistics.
    Plan {
        #[command(flatten)]
        mask: MaskArgs,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Write the token order the plan is in to FILE: `order[new] = original`, one
        /// position per line (the identity when the plan keeps the program's positions), to
        /// put a model's tokens in that order or to give it back as `--order FILE`. Not `-`:
        /// standard output holds the plan's report.
        #[arg(long, value_name = "FILE")]
        order_out: Option<std::path::PathBuf>,
    },
    /// Print the visible key intervals of rows A..B-1. In the program's positions and
    /// without packing, those rows are solved alone (no other row, no tile descriptor, no
    /// plan warnings), so a row of a mask too large to plan whole is still printed; with
    /// `--order` or `--cu-seqlens-q` the whole plan is made.
    Intervals {
        #[command(flatten)]
        mask: MaskArgs,
        /// Rows A:B (half-open, 0-based).
        #[arg(long, value_parser = parse_rows, allow_hyphen_values = true)]
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
    /// Draw the mask as a picture (PNG or SVG, by the output's extension): a title with the
    /// lengths and the visible fraction, axes with token indices, the tile grid, the
    /// program's segments, parts and grids, and a legend. Visible pairs are dark green in
    /// full tiles and dark amber in partial tiles, hidden pairs of partial tiles light
    /// amber, empty tiles light grey; small masks are upscaled, long ones downsampled.
    ///
    /// With `-o NAME.html`, the explorer page instead: one self-contained HTML file (no
    /// network) to pan and zoom from the whole mask down to single tokens, with a row's
    /// intervals and a tile's class and counts under the pointer and the plan's statistics
    /// beside it; drawn from the plan's intervals and tiles, so 128K tokens stay fast.
    /// --rows / --cols set the view it opens on.
    Show {
        #[command(flatten)]
        mask: MaskArgs,
        /// Output file: NAME.png, NAME.svg or NAME.html (the explorer page); the format is
        /// its extension, so not `-` (standard output has none).
        #[arg(short, long)]
        output: std::path::PathBuf,
        /// Batch index to draw, for masks that read `b`: 0 (the default) ..= --batch - 1.
        #[arg(long, default_value_t = 0)]
        b: u32,
        /// Head index to draw, for masks that read `h`: 0 (the default) ..= --num-heads - 1.
        #[arg(long, default_value_t = 0)]
        h: u32,
        /// Draw only rows A:B (half-open, 0-based; default: every row).
        #[arg(long, value_parser = parse_rows, allow_hyphen_values = true)]
        rows: Option<(u32, u32)>,
        /// Draw only keys C:D (half-open, 0-based; default: every key).
        #[arg(long, value_parser = parse_cols)]
        cols: Option<(u32, u32)>,
    },
    /// Export the mask in another system's format, as JSON (layouts: docs/exports.md).
    ///
    /// An export holds the mask of one (batch, head) pair, named by --b and --h (default 0,
    /// 0) and echoed as "b" and "h" in the JSON. For a mask that reads `b` or `h`, plan with
    /// --batch / --num-heads and export each index you need.
    Export {
        #[command(flatten)]
        mask: MaskArgs,
        #[arg(long, value_enum)]
        format: ExportFormat,
        /// Batch index to export, for masks that depend on it: 0 (the default) ..= --batch - 1.
        #[arg(long)]
        b: Option<u32>,
        /// Head index to export, for masks that depend on it: 0 (the default) ..= --num-heads - 1.
        #[arg(long)]
        h: Option<u32>,
        /// Output file (default, or `-`: standard output).
        #[arg(short, long)]
        output: Option<String>,
    },
    /// Context parallelism: deal the mask's sequence (one square mask of batch 1) to --ranks
    /// ranks in chunks of --chunk tokens by visible pairs, and print each rank's tokens,
    /// visible and computed pairs (against the mean and a split by positions) and the keys
    /// it fetches against ring attention's (docs/python.md, "Context parallelism").
    Shard {
        #[command(flatten)]
        mask: MaskArgs,
        /// Ranks (GPUs) to deal the sequence to: 1 ..= 4294967295.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        ranks: u32,
        /// Tokens per chunk. Default: the largest of 512, 256, 128 and 64 that cuts q_len
        /// into at least 4 chunks per rank (so the deal can balance them), else 64; q_len /
        /// ranks when 64 leaves fewer chunks than ranks.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        chunk: Option<u32>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// List the built-in masks with their parameters and defaults.
    List {
        /// Print one JSON array: each built-in's name, summary and parameters (name, type
        /// `int` or `[int]`, default as written, and its value when it is a literal).
        #[arg(long)]
        json: bool,
    },
    /// Check and time the forward kernel (with --bwd also the backward) on the benchmark
    /// workloads (needs an H100 / H200 and a build with embedded kernels); exit 1 if a
    /// correctness check fails.
    Bench(bench::BenchArgs),
    /// The main job on built-in defaults: plan, draw and check the eight benchmark workloads.
    Demo {
        /// Folder for the pictures.
        #[arg(long, default_value = "compilemask-demo")]
        out: std::path::PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportFormat {
    /// Dense 0/1 mask `[q_len][kv_len]` (refused above 2^24 elements).
    Dense,
    /// FlexAttention BlockMask tensors at --tile (refused above 2^24 tiles).
    Flex,
    /// cuDNN flex_attention interval endpoints.
    Cudnn,
    /// FlashMask column bounds, where expressible.
    Flashmask,
}

/// `n` and `noun`, plural unless `n` is 1 (`1 head`, `2 heads`); every noun counted in the
/// CLI's output takes a plain `s`.
pub(crate) fn count(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// Offsets for a human reader: every entry up to 9, else the first 4, the last 2 and the
/// count (a million samples would print a 17 MB line; `--json` keeps them all).
fn brief_list(values: &[u32]) -> String {
    const SHOW_ALL: usize = 9;
    if values.len() <= SHOW_ALL {
        return format!("{values:?}");
    }
    let show = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
    format!(
        "[{}, ..., {}] ({} entries)",
        show(&values[..4]),
        show(&values[values.len() - 2..]),
        values.len()
    )
}

/// Writes a plan's token order (`order[new] = original`, one per line; the identity for
/// none) to `path`.
fn write_order(
    path: &std::path::Path,
    order: Option<&compilemask::TokenOrder>,
    q_len: u32,
) -> Result<()> {
    if path == std::path::Path::new("-") {
        return Err(anyhow!(
            "--order-out -: standard output holds the plan's report; give a file name for the order"
        ));
    }
    let file = std::fs::File::create(path)
        .map_err(|e| anyhow!("--order-out: cannot create `{}`: {e}", path.display()))?;
    let mut w = BufWriter::new(file);
    let identity;
    let positions: &[u32] = match order {
        Some(o) => &o.order,
        None => {
            identity = (0..q_len).collect::<Vec<u32>>();
            &identity
        }
    };
    positions
        .iter()
        .try_for_each(|p| writeln!(w, "{p}"))
        .and_then(|()| w.flush())
        .map_err(|e| anyhow!("--order-out: cannot write `{}`: {e}", path.display()))
}

fn parse_rows(s: &str) -> Result<(u32, u32), String> {
    parse_range(s, "row")
}

fn parse_cols(s: &str) -> Result<(u32, u32), String> {
    parse_range(s, "key")
}

/// `A:B` with `0 <= A < B`, both u32 (`what` is `row` or `key`).
fn parse_range(s: &str, what: &str) -> Result<(u32, u32), String> {
    let bad = || format!("`{s}` is not a {what} range; expected A:B with 0 <= A < B, e.g. 0:16");
    let (a, b) = s.split_once(':').ok_or_else(bad)?;
    let end = |t: &str, which: &str| -> Result<u32, String> {
        let t = t.trim();
        t.parse::<u32>().map_err(|_| {
            // A non-negative integer too large for an index: name the limit.
            if !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit()) {
                format!(
                    "`{s}` is not a {what} range: {which} = {t} is too large; A:B are u32 {what} indices, at most {}",
                    u32::MAX
                )
            } else {
                bad()
            }
        })
    };
    let a = end(a, "A")?;
    let b = end(b, "B")?;
    if a >= b {
        return Err(bad());
    }
    Ok((a, b))
}

/// Refuses a batch or head index outside the plan.
fn check_batch_head(plan: &compilemask::Plan, b: u32, h: u32) -> Result<()> {
    if let (Some(p), true) = (&plan.packing, b >= plan.batch) {
        let cu = p.cu_seqlens_q();
        let sample = if b < p.batch() {
            format!(
                "; sample {b} is rows {}:{}",
                cu[b as usize],
                cu[b as usize + 1]
            )
        } else {
            String::new()
        };
        return Err(anyhow!(
            "--b {b}: a packed plan (--cu-seqlens-q) is one batch of {} packed rows, so --b must be 0; select a sample by its rows instead{sample}",
            plan.q_len
        ));
    }
    check_index(b, h, plan.batch, plan.num_heads)
}

/// `--b` and `--h` inside a shape of `batch` x `num_heads`.
fn check_index(b: u32, h: u32, batch: u32, num_heads: u32) -> Result<()> {
    if b >= batch {
        return Err(anyhow!(
            "--b {b} is out of range; the plan has batch = {batch} (indices 0 ..= {})",
            batch - 1
        ));
    }
    if h >= num_heads {
        return Err(anyhow!(
            "--h {h} is out of range; the plan has num_heads = {num_heads} (indices 0 ..= {})",
            num_heads - 1
        ));
    }
    Ok(())
}

/// Writes rows `rows.0 .. rows.1` of a mask whose row `q` is `mask`'s row `q - first`, one
/// at a time: JSON `{"rows":[{"q":5, "intervals":[[0,6]]},...]}` or one text line per row.
fn write_intervals(
    w: &mut impl Write,
    mask: &compilemask::RowIntervals,
    first: u32,
    rows: (u32, u32),
    json: bool,
) -> std::io::Result<()> {
    if json {
        w.write_all(b"{\"rows\":[")?;
        for q in rows.0..rows.1 {
            if q > rows.0 {
                w.write_all(b",")?;
            }
            write!(w, "{{\"q\":{q},\"intervals\":[")?;
            for (i, iv) in mask.row_expanded(q - first).iter().enumerate() {
                if i > 0 {
                    w.write_all(b",")?;
                }
                write!(w, "[{},{}]", iv.start, iv.end)?;
            }
            w.write_all(b"]}")?;
        }
        w.write_all(b"]}\n")
    } else {
        for q in rows.0..rows.1 {
            write!(w, "{q}: ")?;
            let ivs = mask.row_expanded(q - first);
            if ivs.is_empty() {
                w.write_all(b"(empty)")?;
            }
            for (i, iv) in ivs.iter().enumerate() {
                if i > 0 {
                    w.write_all(b" U ")?;
                }
                write!(w, "[{}, {})", iv.start, iv.end)?;
            }
            w.write_all(b"\n")?;
        }
        Ok(())
    }
}

/// A closed pipe (`| head`) ends the output quietly; other write errors are errors.
pub(crate) fn finish_output(r: std::io::Result<()>, what: &str) -> Result<()> {
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow!("cannot write {what}: {e}"))
        }
        _ => Ok(()),
    }
}

/// `println!` for `run`: a closed standard output (`compilemask plan ... | head -2`) ends the
/// command quietly instead of panicking; another write error (a full disk) fails it.
macro_rules! out {
    ($($arg:tt)*) => {
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            finish_output(Err(e), "to standard output")?;
            return Ok(ExitCode::SUCCESS);
        }
    };
}

/// Writes an output file named by `-o PATH` through `write`, buffered: `-` is standard output
/// (as `-` for an input file is standard input), where a closed pipe ends quietly as
/// [`finish_output`] says; `what` names the output in errors.
pub(crate) fn write_output(
    path: &str,
    what: &str,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    if path == "-" {
        let stdout = std::io::stdout();
        let mut w = BufWriter::new(stdout.lock());
        return finish_output(write(&mut w).and_then(|()| w.flush()), what);
    }
    let file = std::fs::File::create(path).map_err(|e| anyhow!("cannot write `{path}`: {e}"))?;
    let mut w = BufWriter::new(file);
    write(&mut w)
        .and_then(|()| w.flush())
        .map_err(|e| anyhow!("cannot write `{path}`: {e}"))
}

/// Writes `text` to standard error, ignoring a closed or broken stream (`2>&1 | head`):
/// unlike `eprint!`, never panics.
pub(crate) fn write_stderr(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    // A negative number is a value (`--ranks -1`), so its error names the flag and what it
    // takes instead of clap's "unexpected argument".
    let command = Cli::command().mut_subcommands(|c| c.allow_negative_numbers(true));
    let cli = Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            write_stderr(&format!("{e:#}\n"));
            ExitCode::from(1)
        }
    }
}

fn run(command: Command) -> Result<ExitCode> {
    match command {
        Command::Check {
            file,
            builtin,
            deny_warnings,
        } => {
            let p = mask_args::load_program(file.as_deref(), builtin.as_deref())?;
            mask_args::report_warnings(&p, p.warnings(), deny_warnings)?;
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
            let mut how = if p.uses_elementwise() {
                "; uses elementwise (evaluated pair by pair)".to_string()
            } else {
                String::new()
            };
            if let Some(s) = p.score_part() {
                how.push_str(&format!("; score terms: {}", s.terms.join(", ")));
                if !s.tensors.is_empty() {
                    let t: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
                    how.push_str(&format!(
                        " (tensors given at attention time: {})",
                        t.join(", ")
                    ));
                }
            }
            out!(
                "ok: {} ({}; parameters: {}{how})",
                p.name(),
                count(p.warnings().len() as u64, "warning"),
                if params.is_empty() {
                    "none".into()
                } else {
                    params.join(", ")
                }
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan {
            mask,
            json,
            order_out,
        } => {
            let (program, options, plan, ms) = mask.plan()?;
            if let Some(path) = &order_out {
                write_order(path, plan.order.as_ref(), plan.q_len)?;
            }
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
            if let Some(p) = &plan.packing {
                out["samples"] = json!(p.batch());
                out["cu_seqlens_q"] = json!(p.cu_seqlens_q());
                out["cu_seqlens_k"] = json!(p.cu_seqlens_k());
            }
            if let Some(t) = &plan.score {
                out["score"] = score::json(t, plan.num_heads);
            }
            // The order is chosen on the (0, 0) mask and `raster_computed_pairs` is its count,
            // so both densities are that mask's (whatever the batch and head count); counted
            // only for a plan in an order.
            let densities = plan.order.as_ref().map(|_| {
                let first = plan.mask(0, 0);
                let visible = first.rows.visible_pairs() as f64;
                (
                    visible / plan.raster_computed_pairs.max(1) as f64,
                    visible / first.tiles.computed_pairs.max(1) as f64,
                )
            });
            if let (Some(o), Some((before, after))) = (&plan.order, densities) {
                out["order"] = json!({
                    "patch": o.patch,
                    "traversal": if o.tree_preorder { json!("preorder") } else { json!(o.traversal) },
                    "raster_computed_pairs": plan.raster_computed_pairs,
                    "tile_density_before": before,
                    "tile_density_after": after,
                    "candidates": plan.order_candidates,
                });
            }
            if json {
                out!("{out}");
            } else {
                // Pairs per (batch, head): q_len x kv_len, or for packed samples the sum of
                // each sample's own q_len x kv_len (keys of other samples are never visible).
                let (pairs, what) = match &plan.packing {
                    Some(p) => (
                        (0..p.batch())
                            .map(|b| {
                                let (lq, lk) = p.lengths(b);
                                f64::from(lq) * f64::from(lk)
                            })
                            .sum::<f64>(),
                        "of the samples' q_len x kv_len",
                    ),
                    None => (
                        options.shape().q_len as f64 * options.shape().kv_len as f64,
                        "of q_len x kv_len",
                    ),
                };
                out!(
                    "{}: q_len {} kv_len {}, tile {}x{}",
                    program.name(),
                    plan.q_len,
                    plan.kv_len,
                    plan.tile.block_m,
                    plan.tile.block_n
                );
                if let Some(p) = &plan.packing {
                    out!(
                        "  packed          {}, cu_seqlens_q {}, cu_seqlens_k {}",
                        count(p.batch(), "sample"),
                        brief_list(p.cu_seqlens_q()),
                        brief_list(p.cu_seqlens_k())
                    );
                }
                out!(
                    "  visible pairs   {} ({:.4} {what})",
                    plan.visible_pairs(),
                    plan.visible_pairs() as f64
                        / pairs.max(1.0)
                        / (plan.batch * plan.num_heads) as f64
                );
                out!("  empty rows      {}", plan.empty_rows());
                out!("  intervals/row   at most {}", plan.max_intervals_per_row());
                out!(
                    "  tiles           {} full, {} partial, {} empty",
                    t.full,
                    t.partial,
                    t.empty
                );
                out!(
                    "  computed pairs  {} (tile density {:.3})",
                    plan.computed_pairs(),
                    plan.visible_pairs() as f64 / plan.computed_pairs().max(1) as f64
                );
                out!("  descriptor      {} bytes", plan.descriptor_bytes());
                if let (Some(o), Some((before, _))) = (&plan.order, densities) {
                    let which = match (o.patch, o.traversal) {
                        (Some([t, y, x]), Some(tr)) => format!(
                            "patch {t}x{y}x{x} (frames x rows x columns) {}",
                            serde_json::to_value(tr)?.as_str().unwrap_or("")
                        ),
                        _ => "explicit permutation".to_string(),
                    };
                    out!("  token order     {which}: tile density {before:.3} in raster order");
                }
                if let Some(t) = &plan.score {
                    for line in score::lines(t, plan.num_heads) {
                        out!("  score           {line}");
                    }
                }
                if plan.elementwise_pairs > 0 {
                    out!(
                        "  elementwise     {} evaluated one by one",
                        count(plan.elementwise_pairs, "pair")
                    );
                }
                out!("  plan time       {ms:.3} ms");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Shard {
            mask,
            ranks,
            chunk,
            json,
        } => {
            let (program, _, plan, _) = mask.plan()?;
            let chunk = chunk.unwrap_or_else(|| compilemask::default_chunk(plan.q_len, ranks));
            let (sharding, ms) = shard::shard(&plan, ranks, chunk)?;
            let report = shard::report(&plan, &sharding, ms);
            if json {
                out!("{report}");
            } else {
                for line in shard::lines(program.name(), &report) {
                    out!("{line}");
                }
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
            // In the program's positions and without packing, the rows are solved alone (no
            // other row, no tile descriptor); a token order or packing needs the whole plan.
            let options = mask.options()?;
            let alone =
                options.order == compilemask::OrderRequest::Raster && mask.packed()?.is_none();
            let in_range = |q_len: i64| -> Result<()> {
                if i64::from(rows.1) > q_len {
                    return Err(anyhow!("--rows {}:{} is out of range; the mask has q_len = {q_len} rows (0-based, half-open)", rows.0, rows.1));
                }
                Ok(())
            };
            let (plan, solved, first);
            let rows_of = if alone {
                let program = mask.program()?;
                in_range(options.q_len)?;
                // Lengths out of range are the binding's error (CM0402), below.
                let len = |x: i64| u32::try_from(x).ok().filter(|&x| x > 0);
                if let (Some(batch), Some(num_heads)) = (len(options.batch), len(options.num_heads))
                {
                    check_index(b, h, batch, num_heads)?;
                }
                solved = program
                    .row_range(&options, b, h, rows.0..rows.1)
                    .map_err(|e| anyhow!("{}", program.render_error(&e).trim_end()))?;
                first = rows.0;
                &solved
            } else {
                plan = mask.plan()?.2;
                in_range(i64::from(plan.q_len))?;
                check_batch_head(&plan, b, h)?;
                first = 0;
                &plan.mask(b, h).rows
            };
            // Stream: one row at a time through a buffer, never the whole output in memory.
            let stdout = std::io::stdout();
            let mut w = BufWriter::new(stdout.lock());
            finish_output(
                write_intervals(&mut w, rows_of, first, rows, json).and_then(|()| w.flush()),
                "the intervals",
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Show {
            mask,
            output,
            b,
            h,
            rows,
            cols,
        } => {
            // Refuse before planning what would be refused after it.
            let format = show::Format::of(&output)?;
            let (program, options, plan, ms) = mask.plan()?;
            check_batch_head(&plan, b, h)?;
            let structure = show::structure(&program, &options, &plan)?;
            let view = cm_view::View { b, h, rows, cols };
            let written = show::write(
                &program,
                &plan,
                structure.as_ref(),
                &view,
                (&output, format),
                ms,
            )?;
            let p = match written {
                show::Written::Picture(p) => p,
                show::Written::Page(bytes) => {
                    out!(
                        "wrote {} (explorer page, {bytes} bytes, self-contained) for {}",
                        output.display(),
                        program.name()
                    );
                    return Ok(ExitCode::SUCCESS);
                }
            };
            let (sx, sy) = p.scale();
            let [x, y, w, hh] = p.plot;
            out!(
                "wrote {} ({}x{} pixels; plot {w}x{hh} at ({x}, {y}), {:.4} x {:.4} pixels per key x row) for {}",
                output.display(),
                p.width,
                p.height,
                sx,
                sy,
                program.name()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Export {
            mask,
            format,
            b,
            h,
            output,
        } => {
            // Refuse before planning what would be refused after it.
            let (q_len, kv_len) = mask.lengths()?;
            let (bm, bn) = (i64::from(mask.tile.block_m), i64::from(mask.tile.block_n));
            let (rows, cols, what, advice) = match format {
                ExportFormat::Dense => (
                    q_len,
                    kv_len,
                    "mask",
                    "use `intervals --json`, `--format cudnn` or `--format flex` instead",
                ),
                ExportFormat::Flex => (
                    (q_len + bm - 1) / bm,
                    (kv_len + bn - 1) / bn,
                    "block table",
                    "use a larger --tile, or `--format cudnn`",
                ),
                ExportFormat::Cudnn | ExportFormat::Flashmask => (0, 0, "", ""),
            };
            let limit = compilemask::JSON_LIMIT;
            if rows.saturating_mul(cols) > limit as i64 {
                return Err(compilemask::PlanError::new(
                    compilemask::Code::DenseTooLarge,
                    None,
                    format!("a dense {what} of {rows} x {cols} elements is too large to print as JSON (limit {limit} = 2^24)"),
                )
                .with_hint(advice)
                .into());
            }
            let (program, _, plan, _) = mask.plan()?;
            check_batch_head(&plan, b.unwrap_or(0), h.unwrap_or(0))?;
            let (uses_b, uses_h) = program.depends_on_batch_head();
            let unnamed_b = uses_b && b.is_none() && plan.batch > 1;
            let unnamed_h = uses_h && h.is_none() && plan.num_heads > 1;
            let (b, h) = (b.unwrap_or(0), h.unwrap_or(0));
            if unnamed_b || unnamed_h {
                write_stderr(&format!(
                    "note: the mask depends on the {} index; exporting b = {b}, h = {h} only (choose with --b / --h)\n",
                    if unnamed_b && unnamed_h { "batch and head" } else if unnamed_b { "batch" } else { "head" }
                ));
            }
            if let Some(t) = &plan.score {
                write_stderr(&score::export_warning(t, plan.num_heads));
            }
            let m = plan.mask(b, h);
            let mut value = match format {
                ExportFormat::Dense => {
                    let d = compilemask::export::dense(&m.rows)?;
                    let rows: Vec<&[u8]> = d.chunks(plan.kv_len.max(1) as usize).collect();
                    json!({ "q_len": plan.q_len, "kv_len": plan.kv_len, "mask": rows })
                }
                ExportFormat::Flex => {
                    serde_json::to_value(compilemask::export::flex_block_mask(&m.tiles)?)?
                }
                ExportFormat::Cudnn => {
                    serde_json::to_value(compilemask::export::cudnn_endpoints(&m.rows)?)?
                }
                ExportFormat::Flashmask => {
                    serde_json::to_value(compilemask::export::flashmask_bounds(&m.rows)?)?
                }
            };
            value["b"] = json!(b);
            value["h"] = json!(h);
            write_output(output.as_deref().unwrap_or("-"), "the export", |w| {
                serde_json::to_writer(&mut *w, &value)?;
                w.write_all(b"\n")
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::List { json } => {
            let mut all = Vec::new();
            for b in compilemask::BUILTINS {
                let p = compilemask::builtin(b.name).map_err(|e| anyhow!("{}", e.rendered))?;
                let params = p.parameters();
                if json {
                    let params: Vec<serde_json::Value> = params
                        .iter()
                        .map(|q| {
                            let value = q
                                .default
                                .as_deref()
                                .and_then(|d| compilemask::parse_value(d).ok())
                                .map(|v| match v {
                                    compilemask::Value::Int(i) => json!(i),
                                    compilemask::Value::Array(a) => json!(a.to_vec()),
                                });
                            json!({
                                "name": q.name,
                                "type": if q.is_array { "[int]" } else { "int" },
                                "default": q.default,
                                "default_value": value,
                            })
                        })
                        .collect();
                    let mut entry = json!({
                        "name": b.name,
                        "summary": b.summary(),
                        "parameters": params,
                    });
                    if let Some(s) = p.score_part() {
                        entry["score"] = score::part_json(&s);
                    }
                    all.push(entry);
                    continue;
                }
                let shown: Vec<String> = params
                    .iter()
                    .map(|q| {
                        let ty = if q.is_array { "[int]" } else { "int" };
                        match &q.default {
                            Some(d) => format!("{}: {ty} = {d}", q.name),
                            None => format!("{}: {ty}", q.name),
                        }
                    })
                    .collect();
                out!("{:<20} {}", b.name, b.summary());
                if shown.is_empty() {
                    out!("{:<20} parameters: none", "");
                }
                for (i, q) in shown.iter().enumerate() {
                    out!(
                        "{:<20} {} {q}",
                        "",
                        if i == 0 { "parameters:" } else { "           " }
                    );
                }
                if let Some(s) = p.score_part() {
                    let statements = s
                        .tensors
                        .iter()
                        .map(|t| &t.statement)
                        .chain(&s.score)
                        .chain(&s.sink);
                    for (i, st) in statements.enumerate() {
                        out!(
                            "{:<20} {} {st}",
                            "",
                            if i == 0 { "score:     " } else { "           " }
                        );
                    }
                }
            }
            if json {
                out!("{}", serde_json::Value::Array(all));
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
