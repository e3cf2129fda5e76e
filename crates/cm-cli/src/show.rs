//! `compilemask show`: a picture of a planned mask (PNG or SVG, by the output's extension)
//! or its explorer page (HTML), drawn by `cm-view` from the plan's intervals and tiles.

use anyhow::{anyhow, Context, Result};
use compilemask::{Plan, PlanOptions, Program, Structure};
use std::path::Path;

/// What `show` can write, by the output file's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Png,
    Svg,
    /// The explorer page ([`cm_view::explorer`]).
    Html,
}

impl Format {
    /// The format of `path` by its extension (any case), or an error naming what is
    /// accepted.
    pub fn of(path: &Path) -> Result<Format> {
        if path == Path::new("-") {
            return Err(anyhow!(
                "-o -: `show` picks the format by the file's extension (.png, .svg or .html), which standard output lacks; give a file name"
            ));
        }
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match ext.as_deref() {
            Some("png") => Ok(Format::Png),
            Some("svg") => Ok(Format::Svg),
            Some("html" | "htm") => Ok(Format::Html),
            other => Err(anyhow!(
                "-o {}: `show` writes .png or .svg pictures or an .html explorer page; give a file name ending in one of them (got {})",
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

/// What [`write`] wrote.
pub enum Written {
    Picture(cm_view::Picture),
    /// An explorer page of this many bytes.
    Page(usize),
}

/// Draws `view` of `plan` to `path` in `format`; `plan_ms` is the planning time the
/// explorer page shows.
pub fn write(
    program: &Program,
    plan: &Plan,
    structure: Option<&Structure>,
    view: &cm_view::View,
    (path, format): (&Path, Format),
    plan_ms: f64,
) -> Result<Written> {
    let subject = cm_view::Subject {
        plan,
        name: cm_view::display_name(program.name()),
        structure,
    };
    let (bytes, written) = match format {
        Format::Html => {
            let page = cm_view::explorer(&subject, view, Some(plan_ms))?;
            let n = page.len();
            (page.into_bytes(), Written::Page(n))
        }
        Format::Png | Format::Svg => {
            let picture = cm_view::figure(&subject, view)?;
            let bytes = match format {
                Format::Png => picture.png()?,
                _ => picture.svg()?.into_bytes(),
            };
            (bytes, Written::Picture(picture))
        }
    };
    std::fs::write(path, bytes).with_context(|| format!("cannot write `{}`", path.display()))?;
    Ok(written)
}
