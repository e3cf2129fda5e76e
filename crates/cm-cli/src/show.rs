//! `compilemask show`: a picture of a planned mask (PNG or SVG, by the output's extension),
//! drawn by `cm-view` from the plan's intervals and tiles.

use anyhow::{anyhow, Context, Result};
use compilemask::{Plan, PlanOptions, Program, Structure};
use std::path::Path;

/// What `show` can write, by the output file's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Png,
    Svg,
}

impl Format {
    /// The format of `path` by its extension (any case), or an error naming what is
    /// accepted.
    pub fn of(path: &Path) -> Result<Format> {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match ext.as_deref() {
            Some("png") => Ok(Format::Png),
            Some("svg") => Ok(Format::Svg),
            other => Err(anyhow!(
                "-o {}: `show` writes .png or .svg pictures; give a file name ending in one of them (got {})",
                path.display(),
                match other {
                    Some(e) => format!("extension .{e}"),
                    None => "no extension".into(),
                }
            )),
        }
    }
}

/// The named structure to draw: a packed plan's samples, nothing for a permuted token order
/// (positions no longer follow the program), else the program's segments, parts and grids.
pub fn structure(
    program: &Program,
    options: &PlanOptions,
    plan: &Plan,
) -> Result<Option<Structure>> {
    Ok(match (&plan.packing, &plan.order) {
        (Some(p), _) => Some(Structure::packed(p)),
        (None, Some(_)) => None,
        (None, None) => Some(
            program
                .structure(options)
                .map_err(|e| anyhow!("{}", program.render_error(&e).trim_end()))?,
        ),
    })
}

/// Draws `view` of `plan` to `path` in `format`.
pub fn write(
    program: &Program,
    plan: &Plan,
    structure: Option<&Structure>,
    view: &cm_view::View,
    path: &Path,
    format: Format,
) -> Result<cm_view::Picture> {
    let (uses_batch, uses_head) = program.depends_on_batch_head();
    let subject = cm_view::Subject {
        plan,
        name: cm_view::display_name(program.name()),
        structure,
        uses_batch,
        uses_head,
    };
    let picture = cm_view::figure(&subject, view)?;
    let bytes = match format {
        Format::Png => picture.png()?,
        Format::Svg => picture.svg()?.into_bytes(),
    };
    std::fs::write(path, bytes).with_context(|| format!("cannot write `{}`", path.display()))?;
    Ok(picture)
}
