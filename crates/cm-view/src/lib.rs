//! Pictures of planned masks, as FlexAttention users know them from attention-gym: a title
//! (mask, lengths, visible fraction), axes with token indices (keys along the top, query
//! rows down the left), the tile grid and the token grid where they are legible, the
//! program's named structure (segment, part and piece boundaries with their names, grid
//! extents, packed samples) and a legend. [`figure`] lays one out; [`Picture::svg`] and
//! [`Picture::png`] write it. [`explorer::explorer`] writes the interactive page (one
//! self-contained HTML file) of the same plan.
//!
//! Everything is drawn from the plan's row intervals and tile lists (see [`raster`]), so a
//! 128K-token mask costs O(rows x intervals), never `q_len x kv_len`. Text is set by resvg
//! in DejaVu Sans, embedded, so a PNG looks the same on every machine.

pub mod explorer;
pub mod raster;
mod svg;

use compilemask::{Plan, Structure};

pub use explorer::explorer;
pub use svg::Picture;

/// What to draw: a plan and what the figure says about it.
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    pub plan: &'a Plan,
    /// The mask's name in the title (a built-in's name, a file name).
    pub name: &'a str,
    /// Named spans to draw beside and across the mask ([`compilemask::Program::structure`],
    /// or [`Structure::packed`] for a packed plan); `None` draws none.
    pub structure: Option<&'a Structure>,
}

/// Which part of the plan to draw: the mask of batch `b`, head `h`, rows `rows.0 ..
/// rows.1` and keys `cols.0 .. cols.1` (half-open, 0-based; `None` is everything).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct View {
    pub b: u32,
    pub h: u32,
    pub rows: Option<(u32, u32)>,
    pub cols: Option<(u32, u32)>,
}

/// A half-open, 0-based range of rows or keys: `start .. end`.
pub type Range = (u32, u32);

/// Why a view was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    /// The explorer's page draws plain intervals: strided runs past their limit (`CM0412`),
    /// read as the plan's own error (code, message and hint), as the exports refuse them.
    #[error("{}", compilemask::expand_error(.0.clone()))]
    Strides(compilemask::ExpandError),
    #[error("{what} = {value} is out of range; the plan has {limit_name} = {limit} (indices 0 ..= {last})", last = limit - 1)]
    Index {
        what: &'static str,
        value: u32,
        limit_name: &'static str,
        limit: u32,
    },
    #[error("{what} {start}:{end} is out of range; expected A:B with 0 <= A < B <= {len} ({len_name} = {len}, half-open, 0-based)")]
    Range {
        what: &'static str,
        start: u32,
        end: u32,
        len_name: &'static str,
        len: u32,
    },
    #[error("cannot encode the picture: {0}")]
    Encode(String),
    #[error("the explorer page would embed {bytes} bytes of row and tile runs, more than its limit of {limit}; draw a PNG or SVG picture of it instead (`-o NAME.png`)")]
    TooLarge { bytes: usize, limit: usize },
}

impl View {
    /// The view's rows and keys, after checking them and `b`, `h` against the plan.
    ///
    /// # Errors
    /// [`ViewError::Index`] for `b >= batch` or `h >= num_heads`; [`ViewError::Range`] for
    /// an empty range or one past `q_len` / `kv_len`.
    pub fn resolve(&self, plan: &Plan) -> Result<(Range, Range), ViewError> {
        for (what, value, limit_name, limit) in [
            ("b", self.b, "batch", plan.batch),
            ("h", self.h, "num_heads", plan.num_heads),
        ] {
            if value >= limit {
                return Err(ViewError::Index {
                    what,
                    value,
                    limit_name,
                    limit,
                });
            }
        }
        let range = |what, r: Option<(u32, u32)>, len_name, len: u32| match r {
            None => Ok((0, len)),
            Some((start, end)) if start < end && end <= len => Ok((start, end)),
            Some((start, end)) => Err(ViewError::Range {
                what,
                start,
                end,
                len_name,
                len,
            }),
        };
        Ok((
            range("rows", self.rows, "q_len", plan.q_len)?,
            range("cols", self.cols, "kv_len", plan.kv_len)?,
        ))
    }
}

/// Lays out the figure of `view` of `subject`.
///
/// # Errors
/// As [`View::resolve`].
pub fn figure(subject: &Subject<'_>, view: &View) -> Result<Picture, ViewError> {
    let (rows, cols) = view.resolve(subject.plan)?;
    Ok(svg::layout(subject, view, rows, cols))
}

/// The (q, k) pairs a visible fraction is of: `q_len x kv_len`, or for a packed plan the
/// sum of its samples' `q_len x kv_len` (pairs across samples are never visible).
pub(crate) fn pairs(plan: &Plan) -> f64 {
    match &plan.packing {
        Some(p) => (0..p.batch())
            .map(|b| {
                let (lq, lk) = p.lengths(b);
                f64::from(lq) * f64::from(lk)
            })
            .sum(),
        None => f64::from(plan.q_len) * f64::from(plan.kv_len),
    }
}

/// A title's name for a program name: `<builtin causal>` is `causal`, a path its file name.
pub fn display_name(program_name: &str) -> &str {
    if let Some(b) = program_name
        .strip_prefix("<builtin ")
        .and_then(|s| s.strip_suffix('>'))
    {
        return b;
    }
    std::path::Path::new(program_name)
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or(program_name)
}
