//! The arguments every planning command shares: which mask, which lengths, which
//! parameters, which tile shape.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use compilemask::{OrderRequest, PlanOptions, Program, TileShape, Value};

#[derive(Args, Debug, Clone)]
pub struct MaskArgs {
    /// A mask program file (`.cmask`).
    #[arg(conflicts_with = "builtin")]
    pub file: Option<String>,
    /// A built-in mask instead of a file (see `compilemask list`).
    #[arg(long)]
    pub builtin: Option<String>,
    /// Number of query rows.
    #[arg(long, allow_negative_numbers = true)]
    pub q_len: i64,
    /// Number of keys (default: q_len). Positions are absolute (top-left aligned).
    #[arg(long, allow_negative_numbers = true)]
    pub kv_len: Option<i64>,
    /// Set a parameter: NAME=INT, NAME=A,B,C (an integer array) or NAME=@FILE (integers
    /// separated by commas or whitespace).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<String>,
    /// Tile shape BLOCK_MxBLOCK_N.
    #[arg(long, default_value = "128x128", value_parser = parse_tile)]
    pub tile: TileShape,
    /// Batch size, for masks that read the batch index `b`.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
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
    let block_m: u32 = m.trim().parse().map_err(|_| bad())?;
    let block_n: u32 = n.trim().parse().map_err(|_| bad())?;
    if block_m == 0 || block_n == 0 {
        return Err(bad());
    }
    Ok(TileShape { block_m, block_n })
}

/// Reads a program file, turning invalid UTF-8 into a clear error.
pub fn read_source(path: &str) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read `{path}`"))?;
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        anyhow!("error[CM0100]: `{path}` is not valid UTF-8 (first bad byte at offset {at})")
    })
}

impl MaskArgs {
    pub fn program(&self) -> Result<Program> {
        let program = match (&self.file, &self.builtin) {
            (_, Some(name)) => compilemask::builtin(name),
            (Some(path), None) => compilemask::compile_named(&read_source(path)?, path),
            (None, None) => bail!("give a mask program file or --builtin NAME (`compilemask list` shows the built-ins)"),
        };
        let program = program.map_err(|e| anyhow!("{}", e.rendered.trim_end()))?;
        if !program.warnings().is_empty() {
            eprint!(
                "{}",
                compilemask::render(program.source(), program.name(), program.warnings())
            );
        }
        Ok(program)
    }

    pub fn options(&self) -> Result<PlanOptions> {
        let mut o = PlanOptions::new(self.q_len);
        o.kv_len = self.kv_len;
        o.batch = self.batch;
        o.num_heads = self.num_heads;
        o.tile = self.tile;
        o.order = match self.order.as_str() {
            "raster" => OrderRequest::Raster,
            "auto" => OrderRequest::Auto,
            path => {
                let t = std::fs::read_to_string(path).with_context(|| {
                    format!("--order: `{path}` is not `raster`, `auto` or a readable file")
                })?;
                let order: Result<Vec<u32>, _> = t
                    .split(|c: char| c == ',' || c.is_whitespace())
                    .filter(|x| !x.is_empty())
                    .map(str::parse::<u32>)
                    .collect();
                OrderRequest::Explicit(order.map_err(|_| anyhow!("--order {path}: expected non-negative integers separated by commas or whitespace"))?)
            }
        };
        let mut seen: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
        for s in &self.set {
            let (name, value) = s
                .split_once('=')
                .ok_or_else(|| anyhow!("--set `{s}`: expected NAME=VALUE"))?;
            let text = match value.strip_prefix('@') {
                Some(path) => {
                    let t = std::fs::read_to_string(path)
                        .with_context(|| format!("--set {name}: cannot read `{path}`"))?;
                    let items: Vec<&str> = t
                        .split(|c: char| c == ',' || c.is_whitespace())
                        .filter(|x| !x.is_empty())
                        .collect();
                    format!("[{}]", items.join(","))
                }
                None => value.to_string(),
            };
            let v: Value = compilemask::parse_value(&text)
                .map_err(|e| anyhow!("--set {name}: {}", e.message))?;
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
        let t0 = std::time::Instant::now();
        let plan = program
            .plan(&options)
            .map_err(|e| anyhow!("{}", program.render_error(&e).trim_end()))?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok((program, options, plan, ms))
    }
}
