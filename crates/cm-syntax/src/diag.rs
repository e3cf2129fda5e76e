//! Diagnostics: errors and warnings as data, with a stable code, a byte span, a hint.
//! Rendering against the source happens in one place, `compilemask::render` (used by the
//! CLI and by Python); the [`Display`](std::fmt::Display) form here is the same text without
//! the source excerpt, for errors that have no span.

use crate::Code;
use serde::Serialize;

/// A half-open byte range `[start, end)` into the source text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub struct Span {
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Span {
        Span {
            start: start as u32,
            end: end as u32,
        }
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// One diagnostic. `code` is stable across releases (`CM01xx` syntax, `CM02xx` names and
/// types, `CM03xx` plan-time values, `CM04xx` planning limits); see [`Code`] and
/// docs/language.md.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    pub code: Code,
    pub severity: Severity,
    pub message: String,
    pub span: Span,
    /// A short label shown under the span.
    pub label: String,
    pub hint: Option<String>,
    /// Other places worth showing, each with a label (a first definition, say).
    pub related: Vec<(Span, String)>,
}

impl Diagnostic {
    pub fn error(code: Code, span: Span, message: impl Into<String>) -> Diagnostic {
        let message = message.into();
        Diagnostic {
            code,
            severity: Severity::Error,
            label: message.clone(),
            message,
            span,
            hint: None,
            related: Vec::new(),
        }
    }

    pub fn warning(code: Code, span: Span, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(code, span, message)
        }
    }

    pub fn with_label(mut self, label: impl Into<String>) -> Diagnostic {
        self.label = label.into();
        self
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Diagnostic {
        self.hint = Some(hint.into());
        self
    }

    pub fn with_related(mut self, span: Span, label: impl Into<String>) -> Diagnostic {
        self.related.push((span, label.into()));
        self
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl Severity {
    /// The word a rendered diagnostic starts with after its code.
    pub fn word(self) -> &'static str {
        match self {
            Severity::Error => "Error",
            Severity::Warning => "Warning",
        }
    }
}

/// The diagnostic without its source: `[CM0309] Error: unknown parameter `windw``, then
/// `    Help: did you mean `window`?` when there is a hint. The first line is the header
/// `compilemask::render` draws above the source excerpt (ariadne's layout), so an error
/// reads the same with and without a span.
impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[{}] {}: {}",
            self.code,
            self.severity.word(),
            self.message
        )?;
        if let Some(h) = &self.hint {
            write!(f, "\n    Help: {h}")?;
        }
        Ok(())
    }
}

/// 1-based line and column (in characters) of a byte offset; offsets past the end or
/// inside a character clamp to the nearest valid position.
pub fn line_col(source: &str, offset: u32) -> (usize, usize) {
    let mut off = (offset as usize).min(source.len());
    while !source.is_char_boundary(off) {
        off -= 1;
    }
    let before = &source[..off];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}
