//! Integers written as text: the one reader of integer lists and parameter values that the
//! CLI uses for `--set NAME=VALUE`, `--set NAME=@FILE`, `--cu-seqlens-q/-k` and `--order
//! FILE`, so that every one accepts the same forms and refuses bad entries in the same
//! words.
//!
//! A list is integers separated by commas and / or whitespace, optionally inside `[` `]`
//! (`0,5,12`, `[0, 5, 12]`, `0 5 12`, one per line). An integer is an optional sign and
//! digits in which each `_` sits between two digits (`1_000`, `1_0` is 10), exactly as the
//! language's integer literals, so a list reads like an array literal of the language
//! (`compilemask list --json` reads parameter defaults with it). An empty entry (`0,,5`,
//! a comma at either end) is an error, never silently dropped.

use crate::{Code, PlanError, Value};

/// Why a list was refused. Positions count entries from 0; the `Display` text is the one
/// wording of each fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ListError {
    #[error("empty entry at position {position} (between two commas, or a comma at an end); separate integers with single commas or whitespace, e.g. 0,5,12")]
    EmptyEntry { position: usize },
    #[error("entry {position}, `{entry}`, {fault}")]
    BadEntry {
        position: usize,
        entry: String,
        fault: IntFault,
    },
}

/// What is wrong with one integer's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IntFault {
    #[error("is not an integer")]
    NotAnInteger,
    #[error("is not an integer: `_` must sit between two digits, as in 1_000")]
    MisplacedUnderscore,
    #[error("is outside the 64-bit integer range")]
    OutOfRange,
}

/// One integer: an optional sign, then digits in which each `_` sits between two digits (as
/// the language's literals: `1_000` is an integer, `1__0`, `10_` and `_10` are not).
///
/// # Errors
/// [`IntFault`] saying why `token` is not a 64-bit integer.
pub fn parse_int(token: &str) -> Result<i64, IntFault> {
    let unsigned = token.strip_prefix(['+', '-']).unwrap_or(token);
    if !cm_syntax::lexer::underscores_between_digits(unsigned) {
        return Err(IntFault::MisplacedUnderscore);
    }
    token
        .replace('_', "")
        .parse::<i64>()
        .map_err(|e| match e.kind() {
            std::num::IntErrorKind::PosOverflow | std::num::IntErrorKind::NegOverflow => {
                IntFault::OutOfRange
            }
            _ => IntFault::NotAnInteger,
        })
}

/// `token` with the characters that print as nothing or as blank space (a byte-order mark,
/// a zero-width space, controls) escaped as `\u{feff}`, so an error shows what is wrong.
fn visible(token: &str) -> String {
    token
        .chars()
        .map(|c| {
            let escaped = c.escape_debug().to_string();
            // escape_debug also escapes quotes and backslashes, which print as they are.
            if escaped.len() > 1 && !matches!(c, '"' | '\'' | '\\') {
                escaped
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The text inside optional brackets, trimmed, and whether there were brackets.
fn unbracketed(text: &str) -> (&str, bool) {
    let t = text.trim();
    match t.strip_prefix('[').and_then(|b| b.strip_suffix(']')) {
        Some(inner) => (inner.trim(), true),
        None => (t, false),
    }
}

/// Integers separated by commas and / or whitespace, optionally in brackets; empty text
/// (or `[]`) is the empty list.
///
/// # Errors
/// [`ListError`] naming the first empty or bad entry and its position.
pub fn parse_int_list(text: &str) -> Result<Vec<i64>, ListError> {
    let (body, _) = unbracketed(text);
    let mut out = Vec::new();
    if body.is_empty() {
        return Ok(out);
    }
    for piece in body.split(',') {
        if piece.trim().is_empty() {
            return Err(ListError::EmptyEntry {
                position: out.len(),
            });
        }
        for token in piece.split_whitespace() {
            let v = parse_int(token).map_err(|fault| ListError::BadEntry {
                position: out.len(),
                entry: visible(token),
                fault,
            })?;
            out.push(v);
        }
    }
    Ok(out)
}

/// A parameter value: one integer (`2048`), or a list as [`parse_int_list`] reads it
/// (`2048,1536`, `[2048]`, `[]`, `2048 1536`). A lone integer without brackets or comma is
/// an [`Value::Int`] (binding accepts it for an array parameter as a one-element array).
///
/// # Errors
/// `CM0308` with the list's or the integer's fault, or for text that holds no entry.
pub fn parse_value(text: &str) -> Result<Value, PlanError> {
    let bad = |message: String| {
        PlanError::new(Code::BadParamValue, None, message).with_hint(
            "values are integers, or lists of integers separated by commas or whitespace, \
             such as 2048,1536,3072",
        )
    };
    let (body, bracketed) = unbracketed(text);
    if !bracketed && !body.contains(',') {
        let mut tokens = body.split_whitespace();
        match (tokens.next(), tokens.next()) {
            (Some(one), None) => {
                return parse_int(one)
                    .map(Value::Int)
                    .map_err(|fault| bad(format!("`{}` {fault}", visible(one))));
            }
            (None, _) => {
                return Err(bad(format!(
                    "`{text}` is not an integer or a list of integers (an empty list is `[]`)"
                )))
            }
            (Some(_), Some(_)) => {}
        }
    }
    parse_int_list(text)
        .map(|items| Value::Array(items.into()))
        .map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(text: &str) -> Result<Vec<i64>, String> {
        parse_int_list(text).map_err(|e| e.to_string())
    }

    #[test]
    fn lists_in_every_separator_and_bracket_form() {
        for text in [
            "0,5,12",
            "[0, 5, 12]",
            "0 5 12",
            "0\n5\n12\n",
            " 0, 5\t12 ",
            "0,\n5 ,12",
        ] {
            assert_eq!(list(text), Ok(vec![0, 5, 12]), "{text:?}");
        }
        assert_eq!(list(""), Ok(vec![]));
        assert_eq!(list("[ ]"), Ok(vec![]));
        assert_eq!(list("1_000,-2"), Ok(vec![1000, -2]));
        assert_eq!(
            list("-9223372036854775808"),
            Ok(vec![i64::MIN]),
            "the whole range"
        );
    }

    #[test]
    fn empty_and_bad_entries_are_named_with_their_position() {
        for (text, position) in [("0,,5", 1), (",0", 0), ("0,5,", 2), ("0,\n,5", 1)] {
            assert_eq!(
                parse_int_list(text),
                Err(ListError::EmptyEntry { position }),
                "{text:?}"
            );
        }
        assert_eq!(
            list("0 1 x 3").unwrap_err(),
            "entry 2, `x`, is not an integer"
        );
        assert_eq!(
            list("0,99999999999999999999").unwrap_err(),
            "entry 1, `99999999999999999999`, is outside the 64-bit integer range"
        );
        assert!(list("1,,2")
            .unwrap_err()
            .starts_with("empty entry at position 1 "));
    }

    /// The integer the language's lexer reads `text` as, when it reads it as one integer
    /// literal and nothing else.
    fn literal(text: &str) -> Option<i64> {
        use cm_syntax::lexer::{lex, Tok};
        let (toks, diags) = lex(text);
        match (&toks[..], diags.is_empty()) {
            ([one, eof], true) if eof.tok == Tok::Eof => match one.tok {
                Tok::Int(v) => Some(v),
                _ => None,
            },
            _ => None,
        }
    }

    /// `_` in a list entry follows the language's literals, which the lexer defines: the
    /// reader accepts exactly the tokens it reads as one integer, with the same value.
    #[test]
    fn underscores_read_as_in_literals() {
        for text in [
            "1_0",
            "1_000_000",
            "4_096",
            "1__0",
            "10_",
            "1_0_",
            "0_7",
            "_10",
            "_",
            "__1",
            "1_x",
            "_1_",
        ] {
            assert_eq!(parse_int(text).ok(), literal(text), "{text:?}");
        }
        assert_eq!(list("1_0,2_048"), Ok(vec![10, 2048]));
        assert_eq!(list("-1_0 +2_0"), Ok(vec![-10, 20]), "after a sign, too");
        assert_eq!(
            list("5 _10").unwrap_err(),
            "entry 1, `_10`, is not an integer: `_` must sit between two digits, as in 1_000"
        );
        assert_eq!(parse_int("-_10"), Err(IntFault::MisplacedUnderscore));
        assert_eq!(parse_int("1_-0"), Err(IntFault::MisplacedUnderscore));
        assert_eq!(parse_int("1-0"), Err(IntFault::NotAnInteger));
        assert_eq!(
            parse_value("_5").unwrap_err().message,
            "`_5` is not an integer: `_` must sit between two digits, as in 1_000"
        );
    }

    /// A character that prints as nothing is shown escaped, so the entry in the message
    /// differs visibly from one that is fine.
    #[test]
    fn invisible_characters_in_a_bad_entry_are_escaped() {
        assert_eq!(
            list("1,\u{feff}2").unwrap_err(),
            "entry 1, `\\u{feff}2`, is not an integer"
        );
        assert_eq!(
            list("3\u{200b}").unwrap_err(),
            "entry 0, `3\\u{200b}`, is not an integer"
        );
        assert_eq!(
            parse_value("\u{feff}7").unwrap_err().message,
            "`\\u{feff}7` is not an integer"
        );
        // Printable characters, quotes and backslashes included, are shown as they are.
        assert_eq!(
            list("é'\\\"").unwrap_err(),
            "entry 0, `é'\\\"`, is not an integer"
        );
    }

    #[test]
    fn values_are_integers_or_lists() {
        assert_eq!(parse_value(" 7 "), Ok(Value::Int(7)));
        assert_eq!(parse_value("[7]"), Ok(Value::Array(vec![7].into())));
        assert!(parse_value("7,")
            .unwrap_err()
            .message
            .starts_with("empty entry at position 1 "));
        assert_eq!(
            parse_value("2048,1536"),
            Ok(Value::Array(vec![2048, 1536].into()))
        );
        assert_eq!(parse_value("1 2"), Ok(Value::Array(vec![1, 2].into())));
        assert_eq!(parse_value("[]"), Ok(Value::Array(Vec::new().into())));
        let e = parse_value("abc").unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::BadParamValue, "`abc` is not an integer")
        );
        let e = parse_value("99999999999999999999").unwrap_err();
        assert_eq!(
            e.message,
            "`99999999999999999999` is outside the 64-bit integer range"
        );
        let e = parse_value("1,,2").unwrap_err();
        assert_eq!(e.code, Code::BadParamValue);
        assert!(e.message.starts_with("empty entry at position 1 "), "{e}");
        let e = parse_value("").unwrap_err();
        assert_eq!(
            e.message,
            "`` is not an integer or a list of integers (an empty list is `[]`)"
        );
    }
}
