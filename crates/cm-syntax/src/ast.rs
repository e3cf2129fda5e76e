//! The syntax tree. It records what was written, with spans; names are not resolved and
//! types are not checked here (that is `cm-ir`'s job).

use crate::diag::Span;
use serde::Serialize;

/// A float literal's value, compared by its bits so that syntax trees stay `Eq`. Always
/// finite (the lexer reports a literal too large for `f64` and stores 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct FloatBits(u64);

impl FloatBits {
    pub fn new(v: f64) -> FloatBits {
        FloatBits(v.to_bits())
    }

    pub fn value(self) -> f64 {
        f64::from_bits(self.0)
    }
}

/// A float as messages and listings show it: the shortest text that reads back as `v` (in
/// `v`'s own width, so an `f32` 0.1 stays `0.1`), in exponent form outside `[1e-4, 1e16)` as
/// Python's `repr` does, so `1e30` is not thirty-one digits and `1e-9` not eleven.
pub fn show_float<T>(v: T) -> String
where
    T: Copy + Into<f64> + std::fmt::Display + std::fmt::LowerExp,
{
    let x: f64 = v.into();
    if x != 0.0 && x.is_finite() && !(1e-4..1e16).contains(&x.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Program {
    pub items: Vec<Item>,
}

/// A declared parameter type: `int` or `[int]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ParamType {
    Int,
    IntArray,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegPiece {
    pub name: Ident,
    pub lengths: Expr,
    /// `name: lengths * count`: how many entries of `lengths` each segment takes.
    pub count: Option<Expr>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum SegSpec {
    /// `segments doc = lengths;`
    Plain(Expr),
    /// `segments sample = { prompt: prompts, response: responses * group };`
    Composite(Vec<SegPiece>),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum MsgPiece {
    Text(String),
    Expr(Expr),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Item {
    Param {
        name: Ident,
        ty: Option<ParamType>,
        default: Option<Expr>,
        span: Span,
    },
    Let {
        name: Ident,
        value: Expr,
        span: Span,
    },
    Segments {
        name: Ident,
        spec: SegSpec,
        fill: Option<Expr>,
        span: Span,
    },
    Part {
        seg: Ident,
        name: Ident,
        range: Expr,
        span: Span,
    },
    Grid {
        name: Ident,
        dims: Vec<Expr>,
        at: Option<Expr>,
        span: Span,
    },
    /// `tree t = parents at offset;`: node `i` is position `offset + i`, `parents[i]` its
    /// parent node (-1 for a root).
    Tree {
        name: Ident,
        parents: Expr,
        at: Option<Expr>,
        span: Span,
    },
    Require {
        cond: Expr,
        message: Vec<MsgPiece>,
        span: Span,
    },
    Mask {
        value: Expr,
        span: Span,
    },
    /// `tensor NAME: [D1, D2];`: a float tensor the caller gives at attention time (a bias
    /// table or sinks), learnable; its extents are integer expressions of the lengths and
    /// parameters.
    Tensor {
        name: Ident,
        dims: Vec<Expr>,
        span: Span,
    },
    /// `score = EXPR;`: how a visible pair's score is formed from the raw score `score`.
    Score {
        value: Expr,
        span: Span,
    },
    /// `sink = TENSOR[h];`: the per-head logit that joins every row's softmax.
    Sink {
        value: Expr,
        span: Span,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum UnOp {
    Neg,
    Not,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Mod,
    And,
    Or,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum CmpOp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

impl CmpOp {
    /// The operator with its operands swapped: `a < b` is `b > a`.
    pub fn flip(self) -> CmpOp {
        match self {
            CmpOp::Lt => CmpOp::Gt,
            CmpOp::Le => CmpOp::Ge,
            CmpOp::Gt => CmpOp::Lt,
            CmpOp::Ge => CmpOp::Le,
            other => other,
        }
    }

    pub fn symbol(self) -> &'static str {
        match self {
            CmpOp::Lt => "<",
            CmpOp::Le => "<=",
            CmpOp::Gt => ">",
            CmpOp::Ge => ">=",
            CmpOp::Eq => "==",
            CmpOp::Ne => "!=",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ExprKind {
    Int(i64),
    /// A float literal (only the score part of a program reads floats).
    Float(FloatBits),
    Bool(bool),
    Name(String),
    Array(Vec<Expr>),
    Unary(UnOp, Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `a < b <= c`: a chain, meaning `a < b and b <= c`.
    Compare {
        first: Box<Expr>,
        rest: Vec<(CmpOp, Expr)>,
    },
    /// `lo..hi` (half-open) or `lo..=hi` (inclusive).
    Range {
        lo: Box<Expr>,
        hi: Box<Expr>,
        inclusive: bool,
    },
    In {
        elem: Box<Expr>,
        range: Box<Expr>,
    },
    Call {
        callee: Box<Expr>,
        args: Vec<Expr>,
    },
    Field {
        base: Box<Expr>,
        name: Ident,
    },
    Index {
        base: Box<Expr>,
        index: Box<Expr>,
    },
    If {
        cond: Box<Expr>,
        then: Box<Expr>,
        els: Box<Expr>,
    },
    /// `any i in lo .. hi: body` (the union of `body` over the integers `i` of the range) or
    /// `all i in lo .. hi: body` (their intersection).
    Quant {
        all: bool,
        var: Ident,
        range: Box<Expr>,
        body: Box<Expr>,
    },
    /// Stands in for an expression that failed to parse; a diagnostic was already issued.
    Error,
}

#[cfg(test)]
mod tests {
    use super::show_float;

    /// Shortest round-trip text in the value's own width; exponent form outside [1e-4, 1e16).
    #[test]
    fn floats_show_as_python_repr_would() {
        assert_eq!(show_float(1e3_f32), "1000");
        assert_eq!(show_float(0.1_f32), "0.1");
        assert_eq!(show_float(1e30_f32), "1e30");
        assert_eq!(show_float(1e-9_f64), "1e-9");
        assert_eq!(show_float(-2.5e-5_f64), "-2.5e-5");
        assert_eq!(show_float(1e16_f64), "1e16");
        assert_eq!(show_float(9.5e15_f64), "9500000000000000");
        assert_eq!(show_float(0.0_f64), "0");
        assert_eq!(show_float(0.0001_f64), "0.0001");
    }
}
