//! Lexer: source text to tokens with byte spans. Total: every input, including any bytes
//! decoded lossily by the caller, lexes to a token list ending in `Eof`, plus diagnostics.

use crate::ast::FloatBits;
use crate::diag::{is_line_break, too_many_errors, Diagnostic, Span, MAX_DIAGNOSTICS};
use crate::Code;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tok {
    Int(i64),
    /// The literal 9223372036854775808 (2^63): no `i64`, but `-9223372036854775808` is
    /// `i64::MIN`, so the parser takes it after a unary minus and refuses it elsewhere.
    IntMinMagnitude,
    /// A float literal (`0.5`, `1e-3`, `2.5e4`): its finite value, compared by bits.
    Float(FloatBits),
    /// String literal: its unescaped text and the byte offset of its first character, so
    /// interpolations `{expr}` can be parsed with real spans.
    Str(Vec<(char, u32)>),
    Ident(String),
    LParen,
    RParen,
    LBracket,
    RBracket,
    LBrace,
    RBrace,
    Comma,
    Semi,
    Colon,
    Eq,
    EqEq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Plus,
    Minus,
    Star,
    Slash,
    Percent,
    Amp,
    Pipe,
    Bang,
    Dot,
    DotDot,
    DotDotEq,
    Eof,
}

impl Tok {
    /// How the token reads in a message.
    pub fn describe(&self) -> String {
        match self {
            Tok::Int(v) => format!("integer `{v}`"),
            Tok::IntMinMagnitude => format!("integer `{}`", i64::MIN.unsigned_abs()),
            Tok::Float(v) => format!("float `{}`", crate::ast::show_float(v.value())),
            Tok::Str(_) => "a string".into(),
            Tok::Ident(s) => format!("`{s}`"),
            Tok::Eof => "end of input".into(),
            other => format!("`{}`", other.text()),
        }
    }

    fn text(&self) -> &'static str {
        match self {
            Tok::LParen => "(",
            Tok::RParen => ")",
            Tok::LBracket => "[",
            Tok::RBracket => "]",
            Tok::LBrace => "{",
            Tok::RBrace => "}",
            Tok::Comma => ",",
            Tok::Semi => ";",
            Tok::Colon => ":",
            Tok::Eq => "=",
            Tok::EqEq => "==",
            Tok::Ne => "!=",
            Tok::Lt => "<",
            Tok::Le => "<=",
            Tok::Gt => ">",
            Tok::Ge => ">=",
            Tok::Plus => "+",
            Tok::Minus => "-",
            Tok::Star => "*",
            Tok::Slash => "/",
            Tok::Percent => "%",
            Tok::Amp => "&",
            Tok::Pipe => "|",
            Tok::Bang => "!",
            Tok::Dot => ".",
            Tok::DotDot => "..",
            Tok::DotDotEq => "..=",
            _ => "?",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Token {
    pub tok: Tok,
    pub span: Span,
}

/// Where a float literal whose integer digits end at `j` ends: after a `.` followed by a
/// digit and more digits, then an optional exponent (`e`, an optional sign, digits); `None`
/// when neither a fraction nor an exponent follows (so `0..5` stays a range of integers).
fn float_end(chars: &[(usize, char)], j: usize) -> Option<usize> {
    let at = |i: usize| chars.get(i).map(|c| c.1);
    let digits = |mut i: usize| {
        while at(i).is_some_and(|c| c.is_ascii_digit() || c == '_') {
            i += 1;
        }
        i
    };
    let mut end = j;
    if at(j) == Some('.') && at(j + 1).is_some_and(|c| c.is_ascii_digit()) {
        end = digits(j + 1);
    }
    if matches!(at(end), Some('e' | 'E')) {
        let sign = usize::from(matches!(at(end + 1), Some('+' | '-')));
        if at(end + 1 + sign).is_some_and(|c| c.is_ascii_digit()) {
            end = digits(end + 1 + sign);
        }
    }
    (end > j).then_some(end)
}

/// Whether every `_` of a number's text sits between two digits (`1_000`, `1.2_5e1_0`), the
/// rule of Python's literals: `1__0`, `10_`, `1_.5` and `1e_5` are typos, not numbers.
pub fn underscores_between_digits(text: &str) -> bool {
    let b = text.as_bytes();
    b.iter().enumerate().all(|(k, &c)| {
        c != b'_'
            || (k > 0 && b[k - 1].is_ascii_digit() && b.get(k + 1).is_some_and(u8::is_ascii_digit))
    })
}

/// `CM0103` for a number whose `_` does not sit between two digits, at `span`.
/// `CM0103` for an integer literal past `i64`; `min_magnitude` when it is 2^63 without the
/// minus sign that would make it `i64::MIN` (the parser's case).
pub(crate) fn integer_too_large(span: Span, min_magnitude: bool) -> Diagnostic {
    let hint = if min_magnitude {
        "the largest integer is 9223372036854775807; -9223372036854775808 is written with its minus sign"
    } else {
        "the largest integer is 9223372036854775807"
    };
    Diagnostic::error(
        Code::BadIntegerLiteral,
        span,
        "integer literal does not fit in 64 bits",
    )
    .with_hint(hint)
}

/// Most bytes of one name: a longer one is CM0108, so that no message quotes a name of
/// megabytes.
pub const MAX_NAME_BYTES: usize = 256;

fn name_too_long(span: Span) -> Diagnostic {
    Diagnostic::error(
        Code::NameTooLong,
        span,
        format!(
            "a name of {} bytes; names are at most {MAX_NAME_BYTES}",
            span.end - span.start
        ),
    )
    .with_hint("shorten the name")
}

fn misplaced_underscore(span: Span) -> Diagnostic {
    Diagnostic::error(
        Code::BadIntegerLiteral,
        span,
        "malformed number literal: `_` must sit between two digits",
    )
    .with_hint("write digit groups with single underscores, as in 1_000_000")
}

/// Most characters of the source one message quotes: a longer literal or run of characters
/// is shown by its first ones and its length, so that no message holds megabytes of input.
const MAX_QUOTED: usize = 48;

/// `text` in backticks, or its first [`MAX_QUOTED`] characters and its length.
fn quote(text: &str) -> String {
    let n = text.chars().count();
    if n <= MAX_QUOTED {
        return format!("`{text}`");
    }
    let head: String = text.chars().take(MAX_QUOTED).collect();
    format!("`{head}…` ({n} characters)")
}

/// `CM0103` for a number followed by letters (`written`, the whole run), `after` the first
/// character past its valid part: an `e` that starts no exponent makes it a malformed float
/// (`1e`, `1.5e`), as does anything after a fraction or exponent (`float`); else a malformed
/// integer (`12abc`).
fn malformed_number(written: &[(usize, char)], after: char, float: bool, span: Span) -> Diagnostic {
    let text: String = written.iter().map(|c| c.1).collect();
    let (message, hint) = if matches!(after, 'e' | 'E') {
        (
            format!(
                "malformed float literal {}: its exponent needs digits",
                quote(&text)
            ),
            "floats are written 0.5, 1e-3, 2.5e4",
        )
    } else if float {
        (
            format!("malformed float literal {}", quote(&text)),
            "floats are written 0.5, 1e-3, 2.5e4",
        )
    } else {
        (
            format!("malformed integer literal {}", quote(&text)),
            "integers are decimal digits, optionally separated by `_`",
        )
    };
    Diagnostic::error(Code::BadIntegerLiteral, span, message).with_hint(hint)
}

/// Whether `c` can begin a token, whitespace or a comment: every character the lexer does
/// not report as unexpected when it starts one.
fn starts_token(c: char) -> bool {
    c.is_whitespace()
        || c.is_ascii_alphanumeric()
        || c == '\u{feff}'
        || "_#\"()[]{},;:=!<>+-*/%&|.".contains(c)
}

/// The ASCII spelling the language uses for a character often pasted in its place (typeset
/// minus signs and dashes, comparison signs, quotes, multiplication and division signs).
fn ascii_lookalike(c: char) -> Option<&'static str> {
    Some(match c {
        '\u{2010}'..='\u{2015}' | '\u{2212}' | '\u{fe63}' | '\u{ff0d}' => "-",
        '\u{2264}' | '\u{2a7d}' => "<=",
        '\u{2265}' | '\u{2a7e}' => ">=",
        '\u{2260}' => "!=",
        '\u{00d7}' | '\u{22c5}' | '\u{2217}' => "*",
        '\u{00f7}' | '\u{2215}' => "/",
        '\u{201c}' | '\u{201d}' | '\u{201e}' => "\"",
        '\u{2026}' => "..",
        '\u{2227}' => "&",
        '\u{2228}' => "|",
        '\u{00ac}' => "!",
        '\u{ff1b}' => ";",
        '\u{ff08}' => "(",
        '\u{ff09}' => ")",
        _ => return None,
    })
}

/// `CM0101` for a run of characters no token starts with (`chars`, at `span`), showing
/// control characters by code point and naming the ASCII spelling of a lookalike.
fn unexpected_characters(chars: &[(usize, char)], span: Span) -> Diagnostic {
    let shown = if chars.iter().any(|c| c.1.is_control()) {
        let points: Vec<String> = chars
            .iter()
            .take(MAX_QUOTED / 4)
            .map(|c| format!("U+{:04X}", c.1 as u32))
            .collect();
        let more = chars.len() - points.len();
        if more == 0 {
            points.join(" ")
        } else {
            format!("{} … ({} characters)", points.join(" "), chars.len())
        }
    } else {
        quote(&chars.iter().map(|c| c.1).collect::<String>())
    };
    let plural = if chars.len() == 1 { "" } else { "s" };
    let message = format!("unexpected character{plural} {shown}");
    let lookalike = match chars {
        [(_, c)] => ascii_lookalike(*c).map(|ascii| (*c, ascii)),
        _ => None,
    };
    let hint = match lookalike {
        Some((c, ascii)) => format!(
            "`{c}` (U+{:04X}) is not the ASCII `{ascii}` the language uses: write `{ascii}`",
            c as u32
        ),
        None => "comments start with `#`; see docs/language.md for the syntax".into(),
    };
    Diagnostic::error(Code::UnexpectedCharacter, span, message).with_hint(hint)
}

/// Splits `src` into tokens. Unknown characters, bad literals and unterminated strings
/// become diagnostics (`CM0101`-`CM0103`) and are skipped, so lexing always finishes.
pub fn lex(src: &str) -> (Vec<Token>, Vec<Diagnostic>) {
    let mut toks = Vec::new();
    let mut diags = Vec::new();
    let chars: Vec<(usize, char)> = src.char_indices().collect();
    let end_of = |i: usize| chars.get(i).map_or(src.len(), |c| c.0);
    let mut i = 0;
    while i < chars.len() {
        let (start, c) = chars[i];
        // A UTF-8 byte-order mark at the start is not part of the program.
        if c.is_whitespace() || (start == 0 && c == '\u{feff}') {
            i += 1;
            continue;
        }
        if c == '#' {
            // A comment ends where the line does (`LineIndex`'s breaks: `\r` endings too).
            while i < chars.len() && !is_line_break(chars[i].1) {
                i += 1;
            }
            continue;
        }
        if diags.len() >= MAX_DIAGNOSTICS {
            diags.push(too_many_errors(start));
            break;
        }
        if c.is_ascii_digit() {
            let mut j = i;
            let mut value: Option<u64> = Some(0);
            while j < chars.len() && (chars[j].1.is_ascii_digit() || chars[j].1 == '_') {
                if let Some(d) = chars[j].1.to_digit(10) {
                    value = value
                        .and_then(|v| v.checked_mul(10))
                        .and_then(|v| v.checked_add(u64::from(d)));
                }
                j += 1;
            }
            // Letters or `_` right after a number belong to it: one malformed literal.
            let word_end = |mut k: usize| {
                while k < chars.len() && (chars[k].1.is_alphanumeric() || chars[k].1 == '_') {
                    k += 1;
                }
                k
            };
            if let Some(end) = float_end(&chars, j) {
                let k = word_end(end);
                if k > end {
                    let span = Span::new(start, end_of(k));
                    diags.push(malformed_number(&chars[i..k], chars[end].1, true, span));
                    toks.push(Token {
                        tok: Tok::Float(FloatBits::new(0.0)),
                        span,
                    });
                    i = k;
                    continue;
                }
                let written: String = chars[i..end].iter().map(|c| c.1).collect();
                let text = written.replace('_', "");
                let span = Span::new(start, end_of(end));
                if !underscores_between_digits(&written) {
                    diags.push(misplaced_underscore(span));
                    toks.push(Token {
                        tok: Tok::Float(FloatBits::new(0.0)),
                        span,
                    });
                    i = end;
                    continue;
                }
                // A nonzero digit before the exponent: the literal is not 0, whatever it
                // rounds to.
                let nonzero = text
                    .split(['e', 'E'])
                    .next()
                    .is_some_and(|m| m.bytes().any(|b| (b'1'..=b'9').contains(&b)));
                match text.parse::<f64>() {
                    Ok(v) if v.is_finite() && (v != 0.0 || !nonzero) => toks.push(Token {
                        tok: Tok::Float(FloatBits::new(v)),
                        span,
                    }),
                    parsed => {
                        let (message, hint) = if parsed.is_ok_and(|v| v == 0.0) {
                            (
                                format!("float literal {} is too small: a 64-bit float rounds it to 0", quote(&written)),
                                "floats are 64-bit; the smallest nonzero magnitude is about 4.9e-324; write 0.0 for zero",
                            )
                        } else {
                            (
                                format!("float literal {} is too large", quote(&written)),
                                "floats are 64-bit; the largest is about 1.8e308",
                            )
                        };
                        diags.push(
                            Diagnostic::error(Code::BadIntegerLiteral, span, message)
                                .with_hint(hint),
                        );
                        toks.push(Token {
                            tok: Tok::Float(FloatBits::new(0.0)),
                            span,
                        });
                    }
                }
                i = end;
                continue;
            }
            let span = Span::new(start, end_of(j));
            if j < chars.len() && (chars[j].1.is_alphanumeric()) {
                let k = word_end(j);
                diags.push(malformed_number(
                    &chars[i..k],
                    chars[j].1,
                    false,
                    Span::new(start, end_of(k)),
                ));
                toks.push(Token {
                    tok: Tok::Int(0),
                    span: Span::new(start, end_of(k)),
                });
                i = k;
                continue;
            }
            let written: String = chars[i..j].iter().map(|c| c.1).collect();
            if !underscores_between_digits(&written) {
                diags.push(misplaced_underscore(span));
                toks.push(Token {
                    tok: Tok::Int(0),
                    span,
                });
                i = j;
                continue;
            }
            match value {
                Some(v) if v <= i64::MAX as u64 => toks.push(Token {
                    tok: Tok::Int(v as i64),
                    span,
                }),
                Some(v) if v == i64::MIN.unsigned_abs() => toks.push(Token {
                    tok: Tok::IntMinMagnitude,
                    span,
                }),
                _ => {
                    diags.push(integer_too_large(span, false));
                    toks.push(Token {
                        tok: Tok::Int(0),
                        span,
                    });
                }
            }
            i = j;
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' {
            let mut j = i;
            while j < chars.len() && (chars[j].1.is_ascii_alphanumeric() || chars[j].1 == '_') {
                j += 1;
            }
            let span = Span::new(start, end_of(j));
            let mut name = &src[start..end_of(j)];
            if name.len() > MAX_NAME_BYTES {
                diags.push(name_too_long(span));
                // Names are ASCII, so any byte is a boundary; later messages quote this much.
                name = &name[..MAX_NAME_BYTES];
            }
            toks.push(Token {
                tok: Tok::Ident(name.to_string()),
                span,
            });
            i = j;
            continue;
        }
        if c == '"' {
            let mut j = i + 1;
            let mut text = Vec::new();
            let mut closed = false;
            while j < chars.len() {
                let (off, ch) = chars[j];
                match ch {
                    '"' => {
                        closed = true;
                        j += 1;
                        break;
                    }
                    '\n' => break,
                    '\\' if j + 1 < chars.len() => {
                        let esc = chars[j + 1].1;
                        let mapped = match esc {
                            'n' => '\n',
                            't' => '\t',
                            other => other,
                        };
                        // Escaped braces must not open an interpolation; mark them with
                        // the offset of the backslash so the parser keeps them literal.
                        text.push((
                            mapped,
                            if esc == '{' || esc == '}' {
                                u32::MAX
                            } else {
                                off as u32
                            },
                        ));
                        j += 2;
                    }
                    _ => {
                        text.push((ch, off as u32));
                        j += 1;
                    }
                }
            }
            let span = Span::new(start, end_of(j));
            if !closed {
                diags.push(
                    Diagnostic::error(
                        Code::UnterminatedString,
                        span,
                        "unterminated string literal",
                    )
                    .with_hint("close the string with `\"` on the same line"),
                );
            }
            toks.push(Token {
                tok: Tok::Str(text),
                span,
            });
            i = j;
            continue;
        }
        let next = chars.get(i + 1).map(|c| c.1);
        let next2 = chars.get(i + 2).map(|c| c.1);
        let (tok, n) = match (c, next) {
            ('(', _) => (Some(Tok::LParen), 1),
            (')', _) => (Some(Tok::RParen), 1),
            ('[', _) => (Some(Tok::LBracket), 1),
            (']', _) => (Some(Tok::RBracket), 1),
            ('{', _) => (Some(Tok::LBrace), 1),
            ('}', _) => (Some(Tok::RBrace), 1),
            (',', _) => (Some(Tok::Comma), 1),
            (';', _) => (Some(Tok::Semi), 1),
            (':', _) => (Some(Tok::Colon), 1),
            ('=', Some('=')) => (Some(Tok::EqEq), 2),
            ('=', _) => (Some(Tok::Eq), 1),
            ('!', Some('=')) => (Some(Tok::Ne), 2),
            ('!', _) => (Some(Tok::Bang), 1),
            ('<', Some('=')) => (Some(Tok::Le), 2),
            ('<', _) => (Some(Tok::Lt), 1),
            ('>', Some('=')) => (Some(Tok::Ge), 2),
            ('>', _) => (Some(Tok::Gt), 1),
            ('+', _) => (Some(Tok::Plus), 1),
            ('-', _) => (Some(Tok::Minus), 1),
            ('*', _) => (Some(Tok::Star), 1),
            ('/', _) => (Some(Tok::Slash), 1),
            ('%', _) => (Some(Tok::Percent), 1),
            ('&', Some('&')) => (Some(Tok::Amp), 2),
            ('&', _) => (Some(Tok::Amp), 1),
            ('|', Some('|')) => (Some(Tok::Pipe), 2),
            ('|', _) => (Some(Tok::Pipe), 1),
            ('.', Some('.')) if next2 == Some('=') => (Some(Tok::DotDotEq), 3),
            ('.', Some('.')) => (Some(Tok::DotDot), 2),
            ('.', _) => (Some(Tok::Dot), 1),
            _ => (None, 1),
        };
        let Some(tok) = tok else {
            // A run of characters the language does not use is one fault, one diagnostic.
            let mut j = i + 1;
            while j < chars.len() && !starts_token(chars[j].1) {
                j += 1;
            }
            diags.push(unexpected_characters(
                &chars[i..j],
                Span::new(start, end_of(j)),
            ));
            i = j;
            continue;
        };
        toks.push(Token {
            tok,
            span: Span::new(start, end_of(i + n)),
        });
        i += n;
    }
    // After too many errors the rest is not read: it ends where reading stopped.
    let eof = diags
        .last()
        .filter(|d| d.code == Code::TooManyErrors)
        .map_or(src.len(), |d| d.span.start as usize);
    toks.push(Token {
        tok: Tok::Eof,
        span: Span::new(eof, eof),
    });
    (toks, diags)
}

#[cfg(test)]
mod tests {
    use super::{lex, Tok};

    fn toks(src: &str) -> Vec<Tok> {
        let (t, d) = lex(src);
        assert!(d.is_empty(), "{src}: {d:?}");
        t.into_iter()
            .map(|t| t.tok)
            .filter(|t| *t != Tok::Eof)
            .collect()
    }

    /// A float has a fraction or an exponent; `0..5` stays a range of integers and `3.x` a
    /// field.
    #[test]
    fn floats_need_a_fraction_or_an_exponent() {
        let f = |v: f64| Tok::Float(crate::ast::FloatBits::new(v));
        assert_eq!(
            toks("0.5 1e-3 2.5E+2 1_000.25"),
            [f(0.5), f(1e-3), f(250.0), f(1000.25)]
        );
        assert_eq!(toks("0..5"), [Tok::Int(0), Tok::DotDot, Tok::Int(5)]);
        assert_eq!(toks("3.x"), [Tok::Int(3), Tok::Dot, Tok::Ident("x".into())]);
        let (t, d) = lex("1e999");
        assert_eq!(d[0].code, "CM0103");
        assert_eq!(d[0].message, "float literal `1e999` is too large");
        assert_eq!(t[0].tok, f(0.0));
        // A nonzero literal is never silently 0; zeros written any way are 0.
        let (_, d) = lex("1e-400 0.000_1e-999");
        let messages: Vec<&str> = d.iter().map(|d| d.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "float literal `1e-400` is too small: a 64-bit float rounds it to 0",
                "float literal `0.000_1e-999` is too small: a 64-bit float rounds it to 0"
            ]
        );
        assert_eq!(toks("0.0 0e-999 00.000e5"), [f(0.0), f(0.0), f(0.0)]);
        assert_eq!(toks("5e-324"), [f(5e-324)]);
        // A number followed by letters is one malformed literal, named as the number it
        // starts: `e` without exponent digits makes a float.
        for (src, message) in [
            (
                "4e",
                "malformed float literal `4e`: its exponent needs digits",
            ),
            (
                "1E",
                "malformed float literal `1E`: its exponent needs digits",
            ),
            (
                "2ex",
                "malformed float literal `2ex`: its exponent needs digits",
            ),
            (
                "1.5e",
                "malformed float literal `1.5e`: its exponent needs digits",
            ),
            ("1.5x", "malformed float literal `1.5x`"),
            ("1e5x", "malformed float literal `1e5x`"),
            ("12abc", "malformed integer literal `12abc`"),
            ("1_0b", "malformed integer literal `1_0b`"),
        ] {
            let (t, d) = lex(src);
            assert_eq!(d.len(), 1, "{src}: {d:?}");
            assert_eq!(
                (d[0].code.as_str(), d[0].message.as_str()),
                ("CM0103", message)
            );
            assert_eq!(
                (
                    t[0].span.end as usize,
                    d[0].span.start as usize,
                    d[0].span.end as usize
                ),
                (src.len(), 0, src.len()),
                "{src}"
            );
        }
        // `1e+` is the literal `1e` and a `+`.
        let (t, d) = lex("1e+");
        assert_eq!(
            d[0].message,
            "malformed float literal `1e`: its exponent needs digits"
        );
        assert_eq!(t[1].tok, Tok::Plus);
    }

    /// `_` groups digits only between two digits, in integers and in every digit run of a
    /// float; anywhere else the whole literal is one diagnostic (never a silent value).
    #[test]
    fn underscores_sit_between_digits() {
        let f = |v: f64| Tok::Float(crate::ast::FloatBits::new(v));
        assert_eq!(
            toks("1_000 4_0_9_6 1_0.2_5 2e1_0"),
            [Tok::Int(1000), Tok::Int(4096), f(10.25), f(2e10)]
        );
        for bad in [
            "1__0", "10_", "1_.5", "1.5_", "1e_5", "1e5_", "1_e5", "2__0.0",
        ] {
            let (t, d) = lex(bad);
            assert_eq!(d.len(), 1, "{bad}: {d:?}");
            assert_eq!(d[0].code, "CM0103", "{bad}");
            assert_eq!(
                (d[0].span.start as usize, d[0].span.end as usize),
                (0, bad.len()),
                "{bad}"
            );
            assert_eq!(t.len(), 2, "{bad}: one literal, then the end: {t:?}");
        }
    }

    /// A run of characters no token starts with is one diagnostic over the whole run; a
    /// typeset lookalike's hint names its ASCII spelling; control characters read as code
    /// points.
    #[test]
    fn unexpected_characters_are_one_diagnostic_per_run() {
        let one = |src: &str| {
            let (t, d) = lex(src);
            assert_eq!(d.len(), 1, "{src}: {d:?}");
            let kept: Vec<Tok> = t.into_iter().map(|t| t.tok).collect();
            (d[0].clone(), kept)
        };
        let (d, kept) = one("k $@? q");
        assert_eq!(
            (d.code.as_str(), d.span.start, d.span.end),
            ("CM0101", 2, 5)
        );
        assert_eq!(d.message, "unexpected characters `$@?`");
        assert_eq!(
            kept,
            [Tok::Ident("k".into()), Tok::Ident("q".into()), Tok::Eof]
        );
        // Whitespace ends a run: two runs are two faults.
        assert_eq!(lex("k $ @ q").1.len(), 2);
        for (src, ascii) in [
            ("q \u{2013} 4", "-"),
            ("q \u{2212} 4", "-"),
            ("k \u{2264} q", "<="),
            ("k \u{2265} q", ">="),
            ("k \u{2260} q", "!="),
            ("2 \u{d7} k", "*"),
            ("\u{201c}", "\""),
        ] {
            let (d, _) = one(src);
            let hint = d.hint.unwrap_or_default();
            assert!(hint.ends_with(&format!("write `{ascii}`")), "{src}: {hint}");
        }
        let (d, _) = one("k \u{7}\u{8} q");
        assert_eq!(d.message, "unexpected characters U+0007 U+0008");
        assert!(d
            .hint
            .unwrap_or_default()
            .starts_with("comments start with"));
    }
}
