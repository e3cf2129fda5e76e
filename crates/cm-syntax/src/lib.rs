//! Syntax of the CompileMask mask language: text to a syntax tree plus diagnostics.
//!
//! Invariant: [`parse`] is total. It returns `(Program, Vec<Diagnostic>)` for every input
//! and never panics; it knows nothing of lengths, tiles, CUDA or Python. The language is
//! specified in `docs/language.md`.

pub mod ast;
pub mod code;
pub mod diag;
pub mod lexer;
pub mod parser;

pub use ast::*;
pub use code::Code;
pub use diag::{is_line_break, line_col, Diagnostic, LineIndex, Severity, Span};
pub use parser::{parse, parse_expr};
