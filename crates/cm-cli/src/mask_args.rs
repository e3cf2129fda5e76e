//! The arguments every planning command shares: which mask, which lengths, which
//! parameters, which tile shape.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use compilemask::{
    Code, OrderRequest, PackedShape, PlanError, PlanOptions, Program, TileShape, Value,
};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Clone)]
pub struct MaskArgs {
    /// A mask program file (`.cmask`), or `-` for standard input.
    #[arg(conflicts_with = "builtin")]
    pub file: Option<PathBuf>,
    /// A built-in mask instead of a file (see `compilemask list`).
    #[arg(long)]
    pub builtin: Option<String>,
    /// Number of query rows (or give --cu-seqlens-q for packed samples).
    #[arg(
        long,
        allow_negative_numbers = true,
        // --cu-seqlens-k alone reaches `packed`, whose message says what it needs (clap's
        // named --q-len and --cu-seqlens-q both, which cannot go together).
        required_unless_present_any = ["cu_seqlens_q", "cu_seqlens_k"],
        conflicts_with = "cu_seqlens_q"
    )]
    pub q_len: Option<i64>,
    /// Number of keys (default: q_len). Positions are absolute (top-left aligned).
    #[arg(long, allow_negative_numbers = true, conflicts_with = "cu_seqlens_q")]
    pub kv_len: Option<i64>,
    /// Packed samples (FlashAttention's varlen form), instead of --q-len: the prefix sums of
    /// the samples' query lengths, batch + 1 integers from 0 (`0,5,12` is two samples of 5
    /// and 7 rows; `@FILE` reads them from a file). Each sample's positions start at 0 and
    /// the mask is applied per sample, with `b` the sample index; the plan is one batch of
    /// cu_seqlens_q[-1] packed rows.
    #[arg(long, value_name = "OFFSETS", allow_negative_numbers = true)]
    pub cu_seqlens_q: Option<OsString>,
    /// The prefix sums of the samples' key lengths (default: --cu-seqlens-q).
    #[arg(long, value_name = "OFFSETS", allow_negative_numbers = true)]
    pub cu_seqlens_k: Option<OsString>,
    /// Set a parameter: NAME=INT, NAME=A,B,C (an integer array) or NAME=@FILE (integers
    /// separated by commas or whitespace).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<OsString>,
    /// Tile shape BLOCK_MxBLOCK_N.
    // A leading '-' is the value's (`-1x5`), so the error names the tile shape.
    #[arg(long, default_value = "128x128", value_parser = parse_tile, allow_hyphen_values = true)]
    pub tile: TileShape,
    /// Batch size, for masks that read the batch index `b` (with --cu-seqlens-q, the
    /// samples are the batch).
    #[arg(
        long,
        default_value_t = 1,
        allow_negative_numbers = true,
        conflicts_with = "cu_seqlens_q"
    )]
    pub batch: i64,
    /// Token order to plan in: `raster` (the program's positions), `auto` (the best patch
    /// order of the mask's grid, for 2D/3D local masks; else a tree's depth-first preorder,
    /// when it computes fewer pairs) or a file holding a permutation of
    /// [0, q_len) (`order[new] = original`, integers separated by commas or whitespace).
    #[arg(long, default_value = "raster")]
    pub order: OsString,
    /// Query heads, for masks that read the head index `h`.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub num_heads: i64,
    /// Treat warnings (the program's and the plan's: no visible pair, rows that see
    /// nothing, `h` / `b` read with one head / batch, unread parameters, large
    /// `elementwise`, a tree past the lengths) as errors: print them and exit 1.
    #[arg(long)]
    pub deny_warnings: bool,
}

/// Prints `warnings` of `program` on standard error; with `deny`, any warning at all is an
/// error naming how many there were.
pub fn report_warnings(
    program: &Program,
    warnings: &[compilemask::Diagnostic],
    deny: bool,
) -> Result<()> {
    if !warnings.is_empty() {
        crate::write_stderr(&compilemask::render_limited(
            program.source(),
            program.name(),
            warnings,
            compilemask::RENDER_LIMIT,
        ));
    }
    if deny && !warnings.is_empty() {
        bail!(
            "{} and --deny-warnings: treating {} as errors",
            crate::count(warnings.len() as u64, "warning"),
            if warnings.len() == 1 { "it" } else { "them" }
        );
    }
    Ok(())
}

pub fn parse_tile(s: &str) -> Result<TileShape, String> {
    let bad = || {
        format!("`{s}` is not a tile shape; expected BLOCK_MxBLOCK_N with positive integers, e.g. 128x128")
    };
    let (m, n) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    let side = |t: &str, which: &str| -> Result<u32, String> {
        let t = t.trim();
        match t.parse::<u32>() {
            Ok(0) => Err(bad()),
            Ok(v) => Ok(v),
            // A positive integer too large for a tile side: name the limit, not the sign.
            Err(_) if !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit()) => Err(format!(
                "`{s}` is not a tile shape: {which} = {t} is too large; the sides of BLOCK_MxBLOCK_N must be at most {} (u32)",
                u32::MAX
            )),
            Err(_) => Err(bad()),
        }
    };
    let block_m = side(m, "BLOCK_M")?;
    let block_n = side(n, "BLOCK_N")?;
    Ok(TileShape { block_m, block_n })
}

/// Largest file the CLI reads: a mask source, `--set NAME=@FILE`, `--order FILE` or
/// `--cu-seqlens-q/-k @FILE` (64 MiB).
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// Reads at most [`MAX_INPUT_BYTES`] of `path` (a regular file, a pipe or a device such
/// as `/dev/zero` alike; `-` is standard input); a longer input is an error naming the
/// file, the limit and `what` it is. Open and read errors are `cannot read {what} `{path}``.
pub fn read_capped(path: &Path, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let shown = path.display();
    let cannot = || format!("cannot read {what} `{shown}`");
    let mut bytes = Vec::new();
    if path == Path::new("-") {
        std::io::stdin()
            .lock()
            .take(MAX_INPUT_BYTES + 1)
            .read_to_end(&mut bytes)
            .with_context(cannot)?;
    } else {
        std::fs::File::open(path)
            .with_context(cannot)?
            .take(MAX_INPUT_BYTES + 1)
            .read_to_end(&mut bytes)
            .with_context(cannot)?;
    }
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        bail!(
            "{what} `{shown}` is larger than the limit of {} MiB ({MAX_INPUT_BYTES} bytes) for a file the CLI reads",
            MAX_INPUT_BYTES >> 20
        );
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text, without a leading byte-order mark: the text of an
/// integer-list file (`--set NAME=@FILE`, `--cu-seqlens-q/-k @FILE`, `--order FILE`).
pub fn read_capped_text(path: &Path, what: &str) -> Result<String> {
    let bytes = read_capped(path, what)?;
    let mut text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        anyhow!(
            "{what} `{}` is not valid UTF-8 (first bad byte at offset {at})",
            path.display()
        )
    })?;
    // Windows editors often start UTF-8 files with a BOM: it marks the encoding and is no
    // part of the first integer.
    if text.starts_with('\u{feff}') {
        text.drain(..'\u{feff}'.len_utf8());
    }
    Ok(text)
}

/// Reads a program file (`-`: standard input), turning invalid UTF-8 into a clear error.
/// Returns the source and the name diagnostics give it (`<stdin>` for `-`).
pub fn read_source(path: &Path) -> Result<(String, String)> {
    let bytes = read_capped(path, "the mask program")?;
    let name = if path == Path::new("-") {
        "<stdin>".to_string()
    } else {
        path.display().to_string()
    };
    let src = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        PlanError::new(
            Code::InvalidUtf8,
            None,
            format!("`{name}` is not valid UTF-8 (first bad byte at offset {at})"),
        )
    })?;
    Ok((src, name))
}

/// The program of a file (`-`: standard input) or a built-in, as every command names it;
/// an error renders its diagnostics against the source.
pub fn load_program(file: Option<&Path>, builtin: Option<&str>) -> Result<Program> {
    let program = match (file, builtin) {
        (_, Some(name)) => compilemask::builtin(name),
        (Some(path), None) => {
            let (src, name) = read_source(path)?;
            compilemask::compile_named(&src, &name)
        }
        (None, None) => bail!("give a mask program file (`-` for standard input) or --builtin NAME (`compilemask list` shows the built-ins)"),
    };
    program.map_err(|e| anyhow!("{}", e.rendered.trim_end()))
}

/// An argument's text after a leading `@`, as a path (any bytes the OS allows), or `None`
/// when it does not start with `@`.
fn at_path(arg: &OsStr) -> Option<PathBuf> {
    let bytes = arg.as_encoded_bytes();
    let rest = bytes.strip_prefix(b"@")?;
    Some(os_path(rest))
}

/// A path from the bytes of part of an argument (split at an ASCII character, so still
/// the OS's encoding).
fn os_path(bytes: &[u8]) -> PathBuf {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        PathBuf::from(OsStr::from_bytes(bytes))
    }
    #[cfg(not(unix))]
    {
        PathBuf::from(String::from_utf8_lossy(bytes).into_owned())
    }
}

/// An argument that must be text (`what` names it in the error).
fn utf8<'a>(arg: &'a OsStr, what: &str) -> Result<&'a str> {
    arg.to_str().ok_or_else(|| {
        anyhow!(
            "{what} `{}` is not valid UTF-8; only file names after `@` may hold other bytes",
            arg.to_string_lossy()
        )
    })
}

/// `arg`, or the contents of FILE when `arg` is `@FILE` (`what` names the flag in errors).
fn text_or_file(what: &str, arg: &OsStr) -> Result<String> {
    match at_path(arg) {
        Some(path) => read_capped_text(&path, &format!("the {what} file")),
        None => Ok(utf8(arg, what)?.to_string()),
    }
}

/// Offsets of `--cu-seqlens-q` / `-k` (given inline or as `@FILE`).
fn parse_offsets(what: &str, arg: &OsStr) -> Result<Vec<i64>> {
    let bad = |message: String| PlanError::new(Code::BadCuSeqlens, None, message);
    let items = compilemask::parse_int_list(&text_or_file(what, arg)?)
        .map_err(|e| bad(format!("{what}: {e}")))?;
    if items.is_empty() {
        return Err(bad(format!(
            "{what} is empty; give batch + 1 offsets from 0, e.g. 0,5,12"
        ))
        .into());
    }
    Ok(items)
}

impl MaskArgs {
    /// The packing of `--cu-seqlens-q` / `--cu-seqlens-k`, if given (offsets not yet
    /// validated: planning does that).
    pub fn packed(&self) -> Result<Option<PackedShape>> {
        let Some(q) = &self.cu_seqlens_q else {
            if let Some(k) = &self.cu_seqlens_k {
                return Err(PlanError::new(
                    Code::BadCuSeqlens,
                    None,
                    format!("--cu-seqlens-k {} needs --cu-seqlens-q (the samples' query offsets); give both, or neither and --q-len / --kv-len for one unpacked sample", k.to_string_lossy()),
                )
                .into());
            }
            return Ok(None);
        };
        let cu_q = parse_offsets("--cu-seqlens-q", q)?;
        let cu_k = match &self.cu_seqlens_k {
            Some(k) => parse_offsets("--cu-seqlens-k", k)?,
            None => cu_q.clone(),
        };
        Ok(Some(PackedShape::new(cu_q, cu_k).num_heads(self.num_heads)))
    }

    /// `(q_len, kv_len)` of the plan to be made: the totals of a packing (0 when the
    /// offsets are empty), else `--q-len` and `--kv-len`.
    pub fn lengths(&self) -> Result<(i64, i64)> {
        Ok(match self.packed()? {
            Some(p) => (
                p.cu_seqlens_q.last().copied().unwrap_or(0),
                p.cu_seqlens_k.last().copied().unwrap_or(0),
            ),
            None => {
                let o = self.options()?;
                (o.shape().q_len, o.shape().kv_len)
            }
        })
    }

    pub fn program(&self) -> Result<Program> {
        let program = load_program(self.file.as_deref(), self.builtin.as_deref())?;
        report_warnings(&program, program.warnings(), self.deny_warnings)?;
        Ok(program)
    }

    pub fn options(&self) -> Result<PlanOptions> {
        if self.q_len.is_none() && self.cu_seqlens_q.is_none() {
            // Only --cu-seqlens-k let clap through: `packed` refuses it (without reading any
            // offsets; with --cu-seqlens-q they are read where the packing is used).
            self.packed()?;
        }
        let mut o = PlanOptions::new(self.q_len.unwrap_or(1));
        o.kv_len = self.kv_len;
        o.batch = self.batch;
        o.num_heads = self.num_heads;
        o.tile = self.tile;
        o.order = match self.order.to_str() {
            Some("raster") => OrderRequest::Raster,
            Some("auto") => OrderRequest::Auto,
            _ => {
                let path = Path::new(&self.order);
                let t =
                    read_capped_text(path, "the --order permutation file").with_context(|| {
                        format!(
                            "--order: `{}` is not `raster`, `auto` or a readable file",
                            path.display()
                        )
                    })?;
                let what = format!("--order {}", path.display());
                let order = compilemask::parse_int_list(&t)
                    .map_err(|e| anyhow!("{what}: {e}"))?
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| {
                        u32::try_from(v).map_err(|_| {
                            anyhow!("{what}: entry {i} is {v}; a token order holds positions 0 ..= q_len - 1")
                        })
                    })
                    .collect::<Result<Vec<u32>>>()?;
                OrderRequest::Explicit(order)
            }
        };
        let mut seen: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        for arg in &self.set {
            let bytes = arg.as_encoded_bytes();
            let shown = arg.to_string_lossy();
            let eq = bytes
                .iter()
                .position(|&c| c == b'=')
                .ok_or_else(|| anyhow!("--set `{shown}`: expected NAME=VALUE"))?;
            let name = std::str::from_utf8(&bytes[..eq])
                .map_err(|_| anyhow!("--set `{shown}`: the parameter name is not valid UTF-8"))?
                .trim();
            if name.is_empty() {
                bail!(
                    "--set `{shown}`: the parameter name before `=` is empty; expected NAME=VALUE"
                );
            }
            let value = &bytes[eq + 1..];
            let what = format!("--set {name}");
            let v: Value = if let Some(path) = value.strip_prefix(b"@") {
                let path = os_path(path);
                let text = read_capped_text(&path, &format!("the {what} file"))?;
                let items = compilemask::parse_int_list(&text).map_err(|e| {
                    PlanError::new(Code::BadParamValue, None, format!("{what}: {e}"))
                })?;
                Value::Array(items.into())
            } else {
                let text = std::str::from_utf8(value).map_err(|_| {
                    anyhow!("{what}: the value is not valid UTF-8; give integers, or @FILE")
                })?;
                compilemask::parse_value(text).map_err(|e| PlanError {
                    message: format!("{what}: {}", e.message),
                    ..e
                })?
            };
            if let Some(first) = seen.insert(name.to_string(), shown.to_string()) {
                bail!("--set: parameter `{name}` is given twice (`{first}` and `{shown}`); give each parameter once");
            }
            o.params.insert(name.to_string(), v);
        }
        Ok(o)
    }

    /// Compiles and plans, rendering any error against the source.
    pub fn plan(&self) -> Result<(Program, PlanOptions, compilemask::Plan, f64)> {
        let program = self.program()?;
        let options = self.options()?;
        let packed = self.packed()?;
        let t0 = std::time::Instant::now();
        let plan = match &packed {
            Some(p) => program.plan_packed(p, &options),
            None => program.plan(&options),
        }
        .map_err(|e| anyhow!("{}", program.render_error(&e).trim_end()))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        report_warnings(
            &program,
            &program.plan_warnings(&options, &plan),
            self.deny_warnings,
        )?;
        Ok((program, options, plan, ms))
    }
}
