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

/// Most errors reading a source gives: past them the lexer and the parser stop with one
/// `CM0107` ([`Code::TooManyErrors`]), so a file of a million stray characters costs what a
/// thousand do (it took 24 GB and a minute for 60 million `;`).
pub const MAX_DIAGNOSTICS: usize = 1000;

/// `CM0107` at byte `at`, where reading stopped.
pub(crate) fn too_many_errors(at: usize) -> Diagnostic {
    Diagnostic::error(
        Code::TooManyErrors,
        Span::new(at, at),
        format!("too many errors: reading stopped here, after {MAX_DIAGNOSTICS}"),
    )
    .with_label("not read from here on")
    .with_hint("fix the errors above and check again")
}

/// Whether `c` ends a line: `\n`, `\r` (alone or before `\n`), vertical tab, form feed,
/// U+0085, U+2028, U+2029 (ariadne's breaks; see [`LineIndex`]).
pub fn is_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r' | '\x0B' | '\x0C' | '\u{0085}' | '\u{2028}' | '\u{2029}'
    )
}

/// 1-based line and column (in characters) of a byte offset; offsets past the end or
/// inside a character clamp to the nearest valid position. Lines break where
/// [`LineIndex`] breaks them. O(source) per call: for many positions of one source, build a
/// [`LineIndex`] once.
pub fn line_col(source: &str, offset: u32) -> (usize, usize) {
    LineIndex::new(source).line_col(offset)
}

/// The line starts of a source, for many [`line_col`] lookups: built in O(source), then each
/// position costs O(log lines), plus O(column) on a line holding non-ASCII characters.
///
/// Lines break after `\n`, `\r\n`, a lone `\r`, vertical tab, form feed, U+0085, U+2028 and
/// U+2029: the breaks of ariadne's `Source`, which draws the excerpt and its `line:column`
/// header, so the two positions a rendered diagnostic gives agree (a file with `\r` line
/// endings was read as one line here).
pub struct LineIndex<'a> {
    source: &'a str,
    /// Byte offset where each line starts, the first 0.
    starts: Vec<usize>,
    /// Whether each line is ASCII, so its columns are byte counts.
    ascii: Vec<bool>,
}

impl<'a> LineIndex<'a> {
    pub fn new(source: &'a str) -> LineIndex<'a> {
        let (mut starts, mut ascii) = (vec![0], vec![true]);
        let mut chars = source.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            if !c.is_ascii() {
                *ascii.last_mut().expect("a line is open") = false;
            }
            let end = match c {
                '\r' => match chars.peek() {
                    Some(&(j, '\n')) => {
                        chars.next();
                        j + 1
                    }
                    _ => i + 1,
                },
                c if is_line_break(c) => i + c.len_utf8(),
                _ => continue,
            };
            starts.push(end);
            ascii.push(true);
        }
        LineIndex {
            source,
            starts,
            ascii,
        }
    }

    /// 1-based line and column (in characters) of a byte offset, as [`line_col`].
    pub fn line_col(&self, offset: u32) -> (usize, usize) {
        let mut off = (offset as usize).min(self.source.len());
        while !self.source.is_char_boundary(off) {
            off -= 1;
        }
        let line = self.starts.partition_point(|&s| s <= off) - 1;
        let start = self.starts[line];
        let col = if self.ascii[line] {
            off - start
        } else {
            self.source[start..off].chars().count()
        };
        (line + 1, col + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::{is_line_break, LineIndex};

    /// The index gives what walking the characters from the start gives, at every byte
    /// offset (inside characters and past the end too), on texts mixing every line break,
    /// `\r\n` pairs and non-ASCII characters.
    #[test]
    fn index_positions_are_the_walked_positions() {
        let pieces = [
            "a", "é", "\n", "\r", "\r\n", "\u{0B}", "\u{85}", "\u{2028}", "🦀", "bc",
        ];
        let mut x = 0x853c_49e6_748f_ea9bu64;
        for _ in 0..300 {
            let mut src = String::new();
            for _ in 0..(x % 40) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                src.push_str(pieces[(x % pieces.len() as u64) as usize]);
            }
            let index = LineIndex::new(&src);
            for offset in 0..=src.len() + 2 {
                let mut off = offset.min(src.len());
                while !src.is_char_boundary(off) {
                    off -= 1;
                }
                let (mut line, mut col) = (1, 1);
                // A `\r\n` pair is one break, taken at its `\n` (an offset at that `\n` is
                // still on the pair's line).
                for (i, c) in src.char_indices().take_while(|&(i, _)| i < off) {
                    if c == '\r' && src[i + 1..].starts_with('\n') {
                        col += 1;
                        continue;
                    }
                    if is_line_break(c) {
                        (line, col) = (line + 1, 1);
                    } else {
                        col += 1;
                    }
                }
                assert_eq!(
                    index.line_col(offset as u32),
                    (line, col),
                    "{src:?} at {offset}"
                );
            }
        }
    }
}
