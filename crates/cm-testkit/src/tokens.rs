//! The language's vocabulary, in pieces that the token lists of the fuzz tests are made of
//! (each test keeps its own order and extras: [`concat`] joins the pieces).

/// Statement keywords, word operators, literals and `int`.
pub const KEYWORDS: &[&str] = &[
    "param", "let", "segments", "part", "grid", "require", "mask", "if", "then", "else", "in",
    "and", "or", "not", "true", "false", "fill", "at", "int",
];

/// The predefined names and built-in functions.
pub const NAMES: &[&str] = &[
    "q",
    "k",
    "b",
    "h",
    "q_len",
    "kv_len",
    "batch",
    "num_heads",
    "len",
    "min",
    "max",
    "abs",
    "isqrt",
    "count",
    "sum",
    "l1",
    "l2",
    "linf",
    "box",
    "elementwise",
    "trace_context",
    "trace_generated",
];

/// Field and coordinate names of segmentations and grids.
pub const FIELDS: &[&str] = &["start", "end", "index", "x", "y", "t"];

/// Brackets, separators, comparisons, arithmetic and `&`.
pub const SYMBOLS: &[&str] = &[
    "(", ")", "[", "]", "{", "}", ",", ";", ":", "=", "==", "!=", "<", "<=", ">", ">=", "+", "-",
    "*", "/", "%", "&",
];

/// `|`, `!` and the dots (field access, ranges).
pub const DOTS: &[&str] = &["|", "!", ".", "..", "..="];

/// The pieces one after the other, as one list (for `proptest::sample::select`).
pub fn concat(pieces: &[&[&'static str]]) -> Vec<&'static str> {
    pieces.concat()
}
