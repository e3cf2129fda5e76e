//! The stable diagnostic codes: one [`Code`] per row of the table in docs/language.md
//! ("Diagnostics"), with the row's one-line meaning. `CM01xx` is syntax, `CM02xx` names,
//! types and contexts (`CM0250` the checker's one warning, `CM026x` the plan-time warnings), `CM03xx` values met while binding or
//! planning, `CM04xx` planning and export limits. A code never changes its meaning; a test
//! checks this list against the documented table, row by row.

use serde::Serialize;

macro_rules! codes {
    ($($(#[$doc:meta])* $name:ident = $text:literal, $meaning:literal;)*) => {
        /// A stable diagnostic code. Displays, debug-prints (quoted) and serialises as its
        /// text, `CM0104`: the text is its identity everywhere else.
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Code {
            $($(#[$doc])* $name,)*
        }

        impl Code {
            /// Every code, in the table's order.
            pub const ALL: &'static [Code] = &[$(Code::$name,)*];

            /// The code as written: `CM` and four digits.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Code::$name => $text,)*
                }
            }

            /// The one-line meaning of docs/language.md's table.
            pub const fn meaning(self) -> &'static str {
                match self {
                    $(Code::$name => $meaning,)*
                }
            }
        }
    };
}

codes! {
    InvalidUtf8 = "CM0100", "the source is not valid UTF-8";
    UnexpectedCharacter = "CM0101", "unexpected character";
    UnterminatedString = "CM0102", "unterminated string, or an unclosed `{` in a message";
    BadIntegerLiteral = "CM0103", "malformed or too large integer or float literal, or a nonzero float literal that rounds to 0";
    UnexpectedToken = "CM0104", "unexpected token (expected ...)";
    TooDeep = "CM0105", "expression nesting too deep (128 levels, or an operator chain of 128), or a `let` deeper than 8192 levels with the `let`s it uses inlined";
    ExpectedStatement = "CM0106", "expected a statement";
    TooManyErrors = "CM0107", "too many errors: reading stopped after 1000";
    NameTooLong = "CM0108", "a name longer than 256 bytes";
    UnknownName = "CM0201", "unknown name (with a suggestion)";
    DuplicateName = "CM0202", "duplicate or reserved name";
    TypeMismatch = "CM0203", "type mismatch";
    WrongArity = "CM0204", "wrong number of arguments or grid dimensions";
    NoMask = "CM0205", "no `mask` statement";
    UnsolvableK = "CM0206", "`k` used where it cannot be solved (or in a condition)";
    UnsolvableComparison = "CM0207", "a comparison with `k` that is not one of the solvable forms";
    WrongContext = "CM0208", "a name or function used outside the context that allows it (`q` in a parameter default, `len` outside `part`, ...)";
    UnknownField = "CM0209", "unknown field, part or grid axis";
    SecondMask = "CM0210", "more than one `mask`";
    BadDistanceComparison = "CM0211", "a grid distance compared with something other than `<` or `<=`";
    UnsupportedScore = "CM0212", "a `score` or `sink` not of a supported form (the raw `score` or `softcap(score, c)`, plus one bias linear in q and k, plus one bias table indexed by a bucket of q - k; `sink = T[h]`)";
    SecondScore = "CM0213", "more than one `score` or more than one `sink`";
    UnusedLet = "CM0250", "warning: a `let` is never used";
    NoVisiblePair = "CM0260", "warning (plan time): no (q, k) pair is visible at these lengths and parameters";
    EmptyRows = "CM0261", "warning (plan time): some query rows see no key (counted; their output is 0, their lse `-inf`)";
    OneHead = "CM0262", "warning (plan time): the mask reads `h` but was planned with one head";
    OneBatch = "CM0263", "warning (plan time): the mask reads `b` but was planned with one batch (or one packed sample)";
    UnreadParameter = "CM0264", "warning (plan time): a parameter was given a value that nothing in the program reads";
    ElementwisePairs = "CM0265", "warning (plan time): `elementwise` evaluated more than 1,000,000 pairs one by one";
    TreePastLengths = "CM0266", "warning (plan time): a tree has nodes past `q_len` (no query row) or `kv_len` (no key)";
    DivisionByZero = "CM0301", "division or modulo by zero";
    Overflow = "CM0302", "integer overflow";
    OutsideSegmentation = "CM0303", "a position outside a segmentation";
    IndexOutOfRange = "CM0304", "an index out of range (array or segment)";
    RequireFailed = "CM0305", "a `require` failed (its message)";
    CannotFill = "CM0306", "segment lengths that add no tokens cannot fill the sequence";
    NegativeSegment = "CM0307", "a negative segment length";
    BadParamValue = "CM0308", "a bad parameter value (wrong type, missing, not an integer)";
    UnknownParam = "CM0309", "an unknown parameter";
    OutsideGrid = "CM0310", "a grid coordinate of a position outside the grid";
    BadGrid = "CM0311", "a grid with an extent < 1 or a negative offset";
    NegativeIsqrt = "CM0312", "`isqrt` of a negative number";
    BadTree = "CM0313", "a tree's parent array that is not a forest (a parent outside the tree, a cycle) or a tree at a negative position";
    BadScoreValue = "CM0314", "a bad score value: a softcap that is not positive and finite, a coefficient that is not finite, does not fit or rounds from nonzero to 0 in f32, bad `t5_bucket` arguments";
    BadScoreTable = "CM0315", "a bucket outside its table's `[0, num_buckets)`, or a tensor whose extents do not fit its use (`[num_heads, n]` or `[n]` for a table, `[num_heads]` for sinks, every extent >= 1)";
    ZeroTileSide = "CM0401", "a tile shape with a zero side";
    LengthOutOfRange = "CM0402", "a length out of range (`q_len`, `kv_len` in `1 ..= 2^26`, `batch`, `num_heads`)";
    DenseTooLarge = "CM0403", "a dense export above its size limit";
    TooLargeToPlan = "CM0404", "a mask too large to plan (too many segments or intervals)";
    OrderNeedsEqualLengths = "CM0405", "a token order asked for with `q_len != kv_len`";
    NoGridForOrder = "CM0406", "`--order auto` on a mask without a grid or a tree";
    BadOrder = "CM0407", "an explicit token order that is not a permutation of `[0, q_len)`";
    NotExpressible = "CM0408", "a FlashMask export of a mask FlashMask cannot express (a column with more than two masked row ranges)";
    BadCuSeqlens = "CM0409", "bad `cu_seqlens_q` / `cu_seqlens_k` of a packed plan: lengths differ (each needs batch + 1 entries), not starting at 0, decreasing, a total above `2^26`, or no query or no key at all";
    OrderWithPacking = "CM0410", "a token order asked for with packed samples (`cu_seqlens`)";
    PositionalScore = "CM0411", "score terms that read positions (a bias of q or k, a bias table) with a token order, or with packed samples whose query and key offsets differ or whose terms differ";
    StridesTooMany = "CM0412", "strided runs (a dilated window) that a consumer without strides (a token order, exports, the CPU reference, the CUDA kernels) would expand into more than `2^27` unit intervals";
}

impl Code {
    /// The code written `text` (`CM0104`), if there is one.
    pub fn parse(text: &str) -> Option<Code> {
        Code::ALL.iter().copied().find(|c| c.as_str() == text)
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl Serialize for Code {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// `code == "CM0104"`: tests and callers that hold a code's text compare without parsing.
impl PartialEq<&str> for Code {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<str> for Code {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

#[cfg(test)]
mod tests {
    use super::Code;

    /// The rows of the "Diagnostics" table of docs/language.md, as (code, meaning).
    fn documented() -> Vec<(String, String)> {
        let doc = include_str!("../../../docs/language.md");
        doc.lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.strip_prefix("| CM")?.splitn(2, " | ").collect();
                let meaning = cells.get(1)?.strip_suffix(" |")?;
                Some((format!("CM{}", cells[0]), meaning.to_string()))
            })
            .collect()
    }

    #[test]
    fn every_code_is_documented_with_its_meaning() {
        let ours: Vec<(String, String)> = Code::ALL
            .iter()
            .map(|c| (c.as_str().to_string(), c.meaning().to_string()))
            .collect();
        assert_eq!(ours, documented());
    }

    #[test]
    fn codes_are_unique_well_formed_and_parse_back() {
        for (i, c) in Code::ALL.iter().enumerate() {
            let t = c.as_str();
            assert!(
                t.len() == 6 && t.starts_with("CM") && t[2..].bytes().all(|b| b.is_ascii_digit()),
                "{t}"
            );
            assert_eq!(Code::parse(t), Some(*c));
            assert!(Code::ALL[..i].iter().all(|o| o.as_str() != t), "{t} twice");
        }
        assert_eq!(Code::parse("CM9999"), None);
        assert_eq!(Code::parse("cm0104"), None);
    }
}
