//! The arguments every planning command shares: which mask, which lengths, which
//! parameters, which tile shape.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use compilemask::{
    Code, OrderRequest, PackedShape, PlanError, PlanOptions, Program, TileShape, Value,
};

#[derive(Args, Debug, Clone)]
pub struct MaskArgs {
    /// A mask program file (`.cmask`).
    #[arg(conflicts_with = "builtin")]
    pub file: Option<String>,
    /// A built-in mask instead of a file (see `compilemask list`).
    #[arg(long)]
    pub builtin: Option<String>,
    /// Number of query rows (or give --cu-seqlens-q for packed samples).
    #[arg(
        long,
        allow_negative_numbers = true,
        required_unless_present = "cu_seqlens_q",
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
    pub cu_seqlens_q: Option<String>,
    /// The prefix sums of the samples' key lengths (default: --cu-seqlens-q).
    #[arg(
        long,
        value_name = "OFFSETS",
        allow_negative_numbers = true,
        requires = "cu_seqlens_q"
    )]
    pub cu_seqlens_k: Option<String>,
    /// Set a parameter: NAME=INT, NAME=A,B,C (an integer array) or NAME=@FILE (integers
    /// separated by commas or whitespace).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<String>,
    /// Tile shape BLOCK_MxBLOCK_N.
    #[arg(long, default_value = "128x128", value_parser = parse_tile)]
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
    /// order of the mask's grid, for 2D/3D local masks) or a file holding a permutation of
    /// [0, q_len) (`order[new] = original`, integers separated by commas or whitespace).
    #[arg(long, default_value = "raster")]
    pub order: String,
    /// Query heads, for masks that read the head index `h`.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub num_heads: i64,
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
/// as `/dev/zero` alike); a longer input is an error naming the file, the limit and
/// `what` it is. Open and read errors are `cannot read {what} `{path}``.
pub fn read_capped(path: &str, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path).with_context(|| format!("cannot read {what} `{path}`"))?;
    let mut bytes = Vec::new();
    file.take(MAX_INPUT_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {what} `{path}`"))?;
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        bail!(
            "{what} `{path}` is larger than the limit of {} MiB ({MAX_INPUT_BYTES} bytes) for a file the CLI reads",
            MAX_INPUT_BYTES >> 20
        );
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_capped_text(path: &str, what: &str) -> Result<String> {
    let bytes = read_capped(path, what)?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        anyhow!("{what} `{path}` is not valid UTF-8 (first bad byte at offset {at})")
    })
}

/// Reads a program file, turning invalid UTF-8 into a clear error.
pub fn read_source(path: &str) -> Result<String> {
    let bytes = read_capped(path, "the mask program")?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        PlanError::new(
            Code::InvalidUtf8,
            None,
            format!("`{path}` is not valid UTF-8 (first bad byte at offset {at})"),
        )
        .into()
    })
}

/// `text`, or the contents of FILE when `text` is `@FILE` (`what` names the flag in errors).
fn text_or_file(what: &str, text: &str) -> Result<String> {
    match text.strip_prefix('@') {
        Some(path) => read_capped_text(path, &format!("the {what} file"))
            .with_context(|| format!("{what}: cannot read `{path}`")),
        None => Ok(text.to_string()),
    }
}

/// Offsets of `--cu-seqlens-q` / `-k` (given inline or as `@FILE`).
fn parse_offsets(what: &str, text: &str) -> Result<Vec<i64>> {
    let bad = |message: String| PlanError::new(Code::BadCuSeqlens, None, message);
    let items = compilemask::parse_int_list(&text_or_file(what, text)?)
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
                    format!("--cu-seqlens-k {k} needs --cu-seqlens-q (the samples' query offsets); give both, or neither and --q-len / --kv-len for one unpacked sample"),
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
        let program = match (&self.file, &self.builtin) {
            (_, Some(name)) => compilemask::builtin(name),
            (Some(path), None) => compilemask::compile_named(&read_source(path)?, path),
            (None, None) => bail!("give a mask program file or --builtin NAME (`compilemask list` shows the built-ins)"),
        };
        let program = program.map_err(|e| anyhow!("{}", e.rendered.trim_end()))?;
        if !program.warnings().is_empty() {
            crate::write_stderr(&compilemask::render_limited(
                program.source(),
                program.name(),
                program.warnings(),
                compilemask::RENDER_LIMIT,
            ));
        }
        Ok(program)
    }

    pub fn options(&self) -> Result<PlanOptions> {
        let mut o = PlanOptions::new(self.q_len.unwrap_or(1));
        o.kv_len = self.kv_len;
        o.batch = self.batch;
        o.num_heads = self.num_heads;
        o.tile = self.tile;
        o.order = match self.order.as_str() {
            "raster" => OrderRequest::Raster,
            "auto" => OrderRequest::Auto,
            path => {
                let t =
                    read_capped_text(path, "the --order permutation file").with_context(|| {
                        format!("--order: `{path}` is not `raster`, `auto` or a readable file")
                    })?;
                let what = format!("--order {path}");
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
        let mut seen: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
        for s in &self.set {
            let (name, value) = s
                .split_once('=')
                .ok_or_else(|| anyhow!("--set `{s}`: expected NAME=VALUE"))?;
            let what = format!("--set {name}");
            let v: Value = if value.starts_with('@') {
                let items =
                    compilemask::parse_int_list(&text_or_file(&what, value)?).map_err(|e| {
                        PlanError::new(Code::BadParamValue, None, format!("{what}: {e}"))
                    })?;
                Value::Array(items.into())
            } else {
                compilemask::parse_value(value).map_err(|e| PlanError {
                    message: format!("{what}: {}", e.message),
                    ..e
                })?
            };
            let name = name.trim();
            if let Some(first) = seen.insert(name.to_string(), s.as_str()) {
                bail!("--set: parameter `{name}` is given twice (`{first}` and `{s}`); give each parameter once");
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
        Ok((program, options, plan, ms))
    }
}
