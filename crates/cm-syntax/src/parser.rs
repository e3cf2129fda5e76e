//! Recursive-descent parser. It never fails and never panics: syntax errors become
//! diagnostics (`CM0104` unexpected token, `CM0105` nesting too deep, `CM0106` bad
//! statement), the broken statement is skipped up to its `;`, and parsing goes on. A
//! statement with a lexical error reports only that error.

use crate::ast::*;
use crate::diag::{too_many_errors, Diagnostic, Span, MAX_DIAGNOSTICS};
use crate::lexer::{integer_too_large, lex, Tok, Token};
use crate::Code;

/// Nesting deeper than this is refused, so hostile input cannot overflow the stack.
/// Operators in a flat chain (`a | b | c ...`) count toward it too, because every later
/// stage recurses once per operator.
const MAX_DEPTH: u32 = 128;

/// Statement keywords, recognised only at the start of a statement.
pub const STATEMENT_KEYWORDS: &[&str] = &[
    "param", "let", "segments", "part", "grid", "tree", "require", "mask", "tensor", "score",
    "sink",
];

/// Words that cannot name anything.
pub const RESERVED: &[&str] = &[
    "if", "then", "else", "in", "and", "or", "not", "true", "false",
];

struct Parser {
    toks: Vec<Token>,
    pos: usize,
    depth: u32,
    diags: Vec<Diagnostic>,
    /// Set after a nesting error: the statement is being skipped, so the missing closers
    /// it leaves behind are not reported one by one.
    skipping: bool,
}

/// Parses a whole program. Always returns a syntax tree (possibly partial) and every
/// diagnostic found; the tree is meaningful only when no diagnostic is an error.
///
/// One fault gives one diagnostic: a statement holding a lexical error (`CM0101`-`CM0103`,
/// from the end of the statement before it to its own `;`) reports that error alone, not the
/// syntax errors the skipped or malformed characters cause after it.
pub fn parse(src: &str) -> (Program, Vec<Diagnostic>) {
    let (toks, lexical) = lex(src);
    let mut p = Parser::new(toks);
    let mut items = Vec::new();
    while !p.at(&Tok::Eof) {
        // The errors so far: the parser's and the lexer's before this statement (the lexer
        // stops by itself at its own limit, and the tokens end where it stopped).
        let at = p.peek().span.start;
        let lexical_before = lexical.partition_point(|d| d.span.start < at);
        if lexical_before + p.diags.len() >= MAX_DIAGNOSTICS {
            p.diags.push(too_many_errors(at as usize));
            break;
        }
        let before = p.pos;
        let (start, reported) = (p.prev_end(), p.diags.len());
        p.skipping = false;
        match p.item() {
            Some(item) => items.push(item),
            None => p.recover(),
        }
        if p.pos == before {
            p.pos += 1;
        }
        let end = if p.at(&Tok::Eof) {
            u32::MAX
        } else {
            p.prev_end()
        };
        if holds_error(&lexical, start, end) {
            p.diags.truncate(reported);
        }
    }
    let mut diags = lexical;
    diags.append(&mut p.diags);
    // The lexer and the parser may each have stopped: the first stop is where reading
    // ended, so what lies past it is not reported, and it is reported once.
    let stop = diags
        .iter()
        .filter(|d| d.code == Code::TooManyErrors)
        .map(|d| d.span.start)
        .min();
    if let Some(stop) = stop {
        let mut kept_stop = false;
        diags.retain(|d| {
            if d.code == Code::TooManyErrors && d.span.start == stop && !kept_stop {
                kept_stop = true;
                return true;
            }
            d.span.start < stop && d.code != Code::TooManyErrors
        });
    }
    (Program { items }, diags)
}

/// Parses one standalone expression (used for `--set` values and tests). As [`parse`], a
/// lexical error is reported alone.
pub fn parse_expr(src: &str) -> (Expr, Vec<Diagnostic>) {
    let (toks, lexical) = lex(src);
    let mut p = Parser::new(toks);
    let e = p.expr();
    if !p.at(&Tok::Eof) {
        let t = p.peek().clone();
        p.diags.push(Diagnostic::error(
            Code::UnexpectedToken,
            t.span,
            format!("expected end of expression, found {}", t.tok.describe()),
        ));
    }
    if lexical.is_empty() {
        (e, p.diags)
    } else {
        (e, lexical)
    }
}

/// Whether one of the lexer's `diags` (in source order) starts in `[start, end)`.
fn holds_error(diags: &[Diagnostic], start: u32, end: u32) -> bool {
    let first = diags.partition_point(|d| d.span.start < start);
    diags.get(first).is_some_and(|d| d.span.start < end)
}

impl Parser {
    fn new(toks: Vec<Token>) -> Self {
        Parser {
            toks,
            pos: 0,
            depth: 0,
            diags: Vec::new(),
            skipping: false,
        }
    }

    fn peek(&self) -> &Token {
        &self.toks[self.pos.min(self.toks.len() - 1)]
    }

    fn at(&self, t: &Tok) -> bool {
        &self.peek().tok == t
    }

    fn at_word(&self, w: &str) -> bool {
        matches!(&self.peek().tok, Tok::Ident(s) if s == w)
    }

    fn bump(&mut self) -> Token {
        let t = self.peek().clone();
        if self.pos < self.toks.len() - 1 {
            self.pos += 1;
        }
        t
    }

    fn prev_end(&self) -> u32 {
        if self.pos == 0 {
            0
        } else {
            self.toks[self.pos - 1].span.end
        }
    }

    fn eat(&mut self, t: &Tok) -> bool {
        if self.at(t) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn eat_word(&mut self, w: &str) -> bool {
        if self.at_word(w) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn error_here(&mut self, expected: &str) {
        if self.skipping {
            return;
        }
        let t = self.peek().clone();
        self.diags.push(
            Diagnostic::error(
                Code::UnexpectedToken,
                t.span,
                format!("expected {expected}, found {}", t.tok.describe()),
            )
            .with_label(format!("expected {expected}")),
        );
        // The statement is skipped from here: a rule around this one that then misses its
        // own token (the `;` after a missing `)` or `]`, at the same token) would report the
        // same fault again.
        self.skipping = true;
    }

    fn expect(&mut self, t: Tok, what: &str) -> bool {
        if self.eat(&t) {
            true
        } else {
            self.error_here(what);
            false
        }
    }

    /// Skips to just past the next `;` (or to the end).
    fn recover(&mut self) {
        while !self.at(&Tok::Eof) {
            if self.bump().tok == Tok::Semi {
                return;
            }
        }
    }

    fn ident(&mut self, what: &str) -> Option<Ident> {
        match &self.peek().tok {
            Tok::Ident(s) if !RESERVED.contains(&s.as_str()) => {
                let t = self.bump();
                let Tok::Ident(name) = t.tok else { return None };
                Some(Ident { name, span: t.span })
            }
            _ => {
                self.error_here(what);
                None
            }
        }
    }

    fn end_statement(&mut self, start: u32) -> Option<Span> {
        if self.expect(Tok::Semi, "`;` to end the statement") {
            Some(Span {
                start,
                end: self.prev_end(),
            })
        } else {
            None
        }
    }

    fn item(&mut self) -> Option<Item> {
        let start = self.peek().span.start;
        let word = match &self.peek().tok {
            Tok::Ident(w) if STATEMENT_KEYWORDS.contains(&w.as_str()) => w.clone(),
            _ => {
                let t = self.peek().clone();
                self.diags.push(
                    Diagnostic::error(
                        Code::ExpectedStatement,
                        t.span,
                        format!("expected a statement, found {}", t.tok.describe()),
                    )
                    .with_hint(
                        "statements start with param, let, segments, part, grid, tree, require, mask, tensor, score or sink",
                    ),
                );
                return None;
            }
        };
        self.bump();
        match word.as_str() {
            "param" => {
                let name = self.ident("a parameter name")?;
                let ty = if self.eat(&Tok::Colon) {
                    if self.eat_word("int") {
                        Some(ParamType::Int)
                    } else if self.eat(&Tok::LBracket)
                        && self.eat_word("int")
                        && self.eat(&Tok::RBracket)
                    {
                        Some(ParamType::IntArray)
                    } else {
                        self.error_here("a type, `int` or `[int]`");
                        return None;
                    }
                } else {
                    None
                };
                let default = if self.eat(&Tok::Eq) {
                    Some(self.expr())
                } else {
                    None
                };
                let span = self.end_statement(start)?;
                Some(Item::Param {
                    name,
                    ty,
                    default,
                    span,
                })
            }
            "let" => {
                let name = self.ident("a name")?;
                if !self.expect(Tok::Eq, "`=`") {
                    return None;
                }
                let value = self.expr();
                let span = self.end_statement(start)?;
                Some(Item::Let { name, value, span })
            }
            "segments" => {
                let name = self.ident("a segmentation name")?;
                if !self.expect(Tok::Eq, "`=`") {
                    return None;
                }
                let spec = if self.eat(&Tok::LBrace) {
                    let mut pieces = Vec::new();
                    loop {
                        let pname = self.ident("a piece name")?;
                        if !self.expect(Tok::Colon, "`:`") {
                            return None;
                        }
                        let e = self.expr();
                        let (lengths, count) = match e.kind {
                            ExprKind::Binary(BinOp::Mul, a, b) => (*a, Some(*b)),
                            other => (
                                Expr {
                                    kind: other,
                                    span: e.span,
                                },
                                None,
                            ),
                        };
                        pieces.push(SegPiece {
                            name: pname,
                            lengths,
                            count,
                        });
                        if self.eat(&Tok::Comma) {
                            if self.at(&Tok::RBrace) {
                                break;
                            }
                            continue;
                        }
                        break;
                    }
                    if !self.expect(Tok::RBrace, "`}` or `,`") {
                        return None;
                    }
                    SegSpec::Composite(pieces)
                } else {
                    SegSpec::Plain(self.expr())
                };
                let fill = if self.eat_word("fill") {
                    Some(self.expr())
                } else {
                    None
                };
                let span = self.end_statement(start)?;
                Some(Item::Segments {
                    name,
                    spec,
                    fill,
                    span,
                })
            }
            "part" => {
                let seg = self.ident("a segmentation name")?;
                if !self.expect(Tok::Dot, "`.` between the segmentation and the part name") {
                    return None;
                }
                let name = self.ident("a part name")?;
                if !self.expect(Tok::Eq, "`=`") {
                    return None;
                }
                let range = self.expr();
                let span = self.end_statement(start)?;
                Some(Item::Part {
                    seg,
                    name,
                    range,
                    span,
                })
            }
            "grid" => {
                let name = self.ident("a grid name")?;
                if !self.expect(Tok::Eq, "`=`") {
                    return None;
                }
                if !self.expect(Tok::LBracket, "`[` starting the grid's dimensions") {
                    return None;
                }
                let dims = self.comma_list(&Tok::RBracket);
                let at = if self.eat_word("at") {
                    Some(self.expr())
                } else {
                    None
                };
                let span = self.end_statement(start)?;
                Some(Item::Grid {
                    name,
                    dims,
                    at,
                    span,
                })
            }
            "tree" => {
                let name = self.ident("a tree name")?;
                if !self.expect(Tok::Eq, "`=`") {
                    return None;
                }
                let parents = self.expr();
                let at = if self.eat_word("at") {
                    Some(self.expr())
                } else {
                    None
                };
                let span = self.end_statement(start)?;
                Some(Item::Tree {
                    name,
                    parents,
                    at,
                    span,
                })
            }
            "require" => {
                let cond = self.expr();
                let message = if self.eat_word("else") {
                    let t = self.bump();
                    match t.tok {
                        Tok::Str(text) => self.message(&text),
                        other => {
                            self.diags.push(Diagnostic::error(
                                Code::UnexpectedToken,
                                t.span,
                                format!(
                                    "expected a message string after `else`, found {}",
                                    other.describe()
                                ),
                            ));
                            return None;
                        }
                    }
                } else {
                    Vec::new()
                };
                let span = self.end_statement(start)?;
                Some(Item::Require {
                    cond,
                    message,
                    span,
                })
            }
            "tensor" => {
                let name = self.ident("a tensor name")?;
                if !self.expect(Tok::Colon, "`:` and the tensor's extents, `[d1, d2]`") {
                    return None;
                }
                if !self.expect(Tok::LBracket, "`[` starting the tensor's extents") {
                    return None;
                }
                let dims = self.comma_list(&Tok::RBracket);
                let span = self.end_statement(start)?;
                Some(Item::Tensor { name, dims, span })
            }
            // `mask`, `score` and `sink`: `WORD = EXPR;`.
            _ => {
                if !self.expect(Tok::Eq, &format!("`=` after `{word}`")) {
                    return None;
                }
                let value = self.expr();
                let span = self.end_statement(start)?;
                Some(match word.as_str() {
                    "score" => Item::Score { value, span },
                    "sink" => Item::Sink { value, span },
                    _ => Item::Mask { value, span },
                })
            }
        }
    }

    /// Splits a message string into text and `{expr}` interpolations, parsing each.
    fn message(&mut self, text: &[(char, u32)]) -> Vec<MsgPiece> {
        let mut pieces = Vec::new();
        let mut lit = String::new();
        let mut i = 0;
        while i < text.len() {
            let (c, off) = text[i];
            if c == '{' && off != u32::MAX {
                let close = text[i..]
                    .iter()
                    .position(|&(c, o)| c == '}' && o != u32::MAX);
                let Some(close) = close else {
                    self.diags.push(
                        Diagnostic::error(
                            Code::UnterminatedString,
                            Span {
                                start: off,
                                end: off + 1,
                            },
                            "unclosed `{` in message",
                        )
                        .with_hint("write `\\{` for a literal brace"),
                    );
                    return pieces;
                };
                if !lit.is_empty() {
                    pieces.push(MsgPiece::Text(std::mem::take(&mut lit)));
                }
                let body = &text[i + 1..i + close];
                let inner: String = body.iter().map(|c| c.0).collect();
                // Source offset of every byte of `inner` (escapes make the text shorter than
                // the source, and characters may be several bytes), then of its end.
                let mut map: Vec<u32> = Vec::with_capacity(inner.len() + 1);
                let mut last = off + 1;
                for &(c, o) in body {
                    if o != u32::MAX {
                        last = o;
                    }
                    map.extend(std::iter::repeat_n(last, c.len_utf8()));
                }
                map.push(text[i + close].1);
                let at = |x: u32| map.get(x as usize).copied().unwrap_or(text[i + close].1);
                let (mut e, diags) = parse_expr(&inner);
                remap(&mut e, &at);
                for mut d in diags {
                    d.span = Span {
                        start: at(d.span.start),
                        end: at(d.span.end),
                    };
                    self.diags.push(d);
                }
                pieces.push(MsgPiece::Expr(e));
                i += close + 1;
            } else {
                lit.push(c);
                i += 1;
            }
        }
        if !lit.is_empty() {
            pieces.push(MsgPiece::Text(lit));
        }
        pieces
    }

    fn comma_list(&mut self, close: &Tok) -> Vec<Expr> {
        let mut out = Vec::new();
        if self.eat(close) {
            return out;
        }
        loop {
            out.push(self.expr());
            if self.eat(&Tok::Comma) {
                if self.eat(close) {
                    return out;
                }
                continue;
            }
            if !self.eat(close) {
                self.error_here(&format!("`,` or {}", close.describe()));
            }
            return out;
        }
    }

    fn error_expr(&self, span: Span) -> Expr {
        Expr {
            kind: ExprKind::Error,
            span,
        }
    }

    /// Reports nesting beyond [`MAX_DEPTH`] and skips the rest of the statement.
    fn too_deep(&mut self) -> Expr {
        let t = self.peek().clone();
        if !self.skipping {
            self.diags.push(
                Diagnostic::error(Code::TooDeep, t.span, "expression nested too deeply").with_hint(format!(
                    "at most {MAX_DEPTH} levels of nesting or operators in one chain are allowed; split it with `let`"
                )),
            );
        }
        // Skip the rest of the statement so the caller makes progress.
        self.skipping = true;
        while !self.at(&Tok::Eof) && !self.at(&Tok::Semi) {
            self.bump();
        }
        self.error_expr(t.span)
    }

    /// Parses the right operand of a chain operator one level deeper.
    fn chained(&mut self, operand: fn(&mut Self) -> Expr) -> Expr {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            self.too_deep()
        } else {
            operand(self)
        }
    }

    pub fn expr(&mut self) -> Expr {
        self.depth += 1;
        let e = if self.depth > MAX_DEPTH {
            self.too_deep()
        } else if self.at_word("if") {
            let start = self.bump().span;
            let cond = self.expr();
            if !self.eat_word("then") {
                self.error_here("`then`");
            }
            let then = self.expr();
            if !self.eat_word("else") {
                self.error_here("`else` (every `if` needs both branches)");
            }
            let els = self.expr();
            let span = start.to(els.span);
            Expr {
                kind: ExprKind::If {
                    cond: Box::new(cond),
                    then: Box::new(then),
                    els: Box::new(els),
                },
                span,
            }
        } else if self.at_quantifier() {
            self.quantifier()
        } else {
            self.or_expr()
        };
        self.depth -= 1;
        e
    }

    /// Whether `any NAME in` or `all NAME in` starts here. `any` and `all` are not reserved:
    /// anywhere else they are ordinary names.
    fn at_quantifier(&self) -> bool {
        let tok = |i: usize| &self.toks[(self.pos + i).min(self.toks.len() - 1)].tok;
        matches!(tok(0), Tok::Ident(w) if w == "any" || w == "all")
            && matches!(tok(1), Tok::Ident(w) if !RESERVED.contains(&w.as_str()))
            && matches!(tok(2), Tok::Ident(w) if w == "in")
    }

    /// `any NAME in RANGE: BODY` / `all NAME in RANGE: BODY`; the body extends as far as an
    /// `if`'s else branch does.
    fn quantifier(&mut self) -> Expr {
        let start = self.bump();
        let all = matches!(&start.tok, Tok::Ident(w) if w == "all");
        let Some(var) = self.ident("a name for the quantified variable") else {
            return self.error_expr(start.span);
        };
        self.eat_word("in");
        let range = self.range_expr();
        if !self.expect(Tok::Colon, "`:` after the range of `any` / `all`") {
            return self.error_expr(start.span.to(range.span));
        }
        let body = self.expr();
        let span = start.span.to(body.span);
        Expr {
            kind: ExprKind::Quant {
                all,
                var,
                range: Box::new(range),
                body: Box::new(body),
            },
            span,
        }
    }

    fn binary(&mut self, op: BinOp, l: Expr, r: Expr) -> Expr {
        let span = l.span.to(r.span);
        Expr {
            kind: ExprKind::Binary(op, Box::new(l), Box::new(r)),
            span,
        }
    }

    fn or_expr(&mut self) -> Expr {
        self.left_chain(Self::and_expr, |t| match t {
            Tok::Pipe => Some(BinOp::Or),
            Tok::Ident(w) if w == "or" => Some(BinOp::Or),
            _ => None,
        })
    }

    fn and_expr(&mut self) -> Expr {
        self.left_chain(Self::not_expr, |t| match t {
            Tok::Amp => Some(BinOp::And),
            Tok::Ident(w) if w == "and" => Some(BinOp::And),
            _ => None,
        })
    }

    /// `not X`: the word form binds loosely, below comparisons, arithmetic and region `-`
    /// (`not k < 2` is `not (k < 2)`); `!` binds tightly, as unary `-` does (`unary_expr`).
    fn not_expr(&mut self) -> Expr {
        if self.at_word("not") {
            let start = self.bump().span;
            self.depth += 1;
            let inner = if self.depth > MAX_DEPTH {
                self.expr()
            } else {
                self.not_expr()
            };
            self.depth -= 1;
            let span = start.to(inner.span);
            return Expr {
                kind: ExprKind::Unary(UnOp::Not, Box::new(inner)),
                span,
            };
        }
        self.cmp_expr()
    }

    fn cmp_op(&self) -> Option<CmpOp> {
        Some(match self.peek().tok {
            Tok::Lt => CmpOp::Lt,
            Tok::Le => CmpOp::Le,
            Tok::Gt => CmpOp::Gt,
            Tok::Ge => CmpOp::Ge,
            Tok::EqEq => CmpOp::Eq,
            Tok::Ne => CmpOp::Ne,
            _ => return None,
        })
    }

    fn cmp_expr(&mut self) -> Expr {
        let first = self.range_expr();
        if self.eat_word("in") {
            let range = self.range_expr();
            let span = first.span.to(range.span);
            return Expr {
                kind: ExprKind::In {
                    elem: Box::new(first),
                    range: Box::new(range),
                },
                span,
            };
        }
        let mut rest = Vec::new();
        let depth = self.depth;
        while let Some(op) = self.cmp_op() {
            self.bump();
            let r = self.chained(Self::range_expr);
            rest.push((op, r));
        }
        self.depth = depth;
        if rest.is_empty() {
            return first;
        }
        let span = first.span.to(rest.last().map_or(first.span, |r| r.1.span));
        Expr {
            kind: ExprKind::Compare {
                first: Box::new(first),
                rest,
            },
            span,
        }
    }

    fn range_expr(&mut self) -> Expr {
        let lo = self.add_expr();
        let inclusive = if self.eat(&Tok::DotDot) {
            false
        } else if self.eat(&Tok::DotDotEq) {
            true
        } else {
            return lo;
        };
        let hi = self.add_expr();
        let span = lo.span.to(hi.span);
        Expr {
            kind: ExprKind::Range {
                lo: Box::new(lo),
                hi: Box::new(hi),
                inclusive,
            },
            span,
        }
    }

    /// A left-associative chain of `operand`s joined by the operators `op_of` recognises.
    fn left_chain(
        &mut self,
        operand: fn(&mut Self) -> Expr,
        op_of: fn(&Tok) -> Option<BinOp>,
    ) -> Expr {
        let depth = self.depth;
        let mut l = operand(self);
        while let Some(op) = op_of(&self.peek().tok) {
            self.bump();
            let r = self.chained(operand);
            l = self.binary(op, l, r);
        }
        self.depth = depth;
        l
    }

    fn add_expr(&mut self) -> Expr {
        self.left_chain(Self::mul_expr, |t| match t {
            Tok::Plus => Some(BinOp::Add),
            Tok::Minus => Some(BinOp::Sub),
            _ => None,
        })
    }

    fn mul_expr(&mut self) -> Expr {
        self.left_chain(Self::unary_expr, |t| match t {
            Tok::Star => Some(BinOp::Mul),
            Tok::Slash => Some(BinOp::Div),
            Tok::Percent => Some(BinOp::Mod),
            _ => None,
        })
    }

    /// Unary `-` and `!` bind tighter than every binary operator, so `!(k < 2) - (k > 5)` is
    /// `(!(k < 2)) - (k > 5)` and `A - !B` parses; `!k < 2` is `(!k) < 2`, which the checker
    /// refuses with a hint (`not` is the loose form).
    fn unary_expr(&mut self) -> Expr {
        let op = match self.peek().tok {
            Tok::Minus => UnOp::Neg,
            Tok::Bang => UnOp::Not,
            _ => return self.postfix_expr(),
        };
        let start = self.bump().span;
        if op == UnOp::Neg && self.peek().tok == Tok::IntMinMagnitude {
            let span = start.to(self.bump().span);
            return Expr {
                kind: ExprKind::Int(i64::MIN),
                span,
            };
        }
        self.depth += 1;
        let inner = if self.depth > MAX_DEPTH {
            self.expr()
        } else {
            self.unary_expr()
        };
        self.depth -= 1;
        let span = start.to(inner.span);
        Expr {
            kind: ExprKind::Unary(op, Box::new(inner)),
            span,
        }
    }

    fn postfix_expr(&mut self) -> Expr {
        let depth = self.depth;
        let e = self.postfix_chain();
        self.depth = depth;
        e
    }

    /// Calls, fields and indexing after a primary; each link counts toward the nesting limit.
    fn postfix_chain(&mut self) -> Expr {
        let mut e = self.primary();
        loop {
            if matches!(self.peek().tok, Tok::LParen | Tok::Dot | Tok::LBracket) {
                self.depth += 1;
                if self.depth > MAX_DEPTH {
                    return self.too_deep();
                }
            }
            if self.eat(&Tok::LParen) {
                let args = self.comma_list(&Tok::RParen);
                let span = Span {
                    start: e.span.start,
                    end: self.prev_end(),
                };
                e = Expr {
                    kind: ExprKind::Call {
                        callee: Box::new(e),
                        args,
                    },
                    span,
                };
            } else if self.at(&Tok::Dot) {
                self.bump();
                let Some(name) = self.ident("a field name after `.`") else {
                    return e;
                };
                let span = e.span.to(name.span);
                e = Expr {
                    kind: ExprKind::Field {
                        base: Box::new(e),
                        name,
                    },
                    span,
                };
            } else if self.eat(&Tok::LBracket) {
                let index = self.expr();
                self.expect(Tok::RBracket, "`]`");
                let span = Span {
                    start: e.span.start,
                    end: self.prev_end(),
                };
                e = Expr {
                    kind: ExprKind::Index {
                        base: Box::new(e),
                        index: Box::new(index),
                    },
                    span,
                };
            } else {
                return e;
            }
        }
    }

    fn primary(&mut self) -> Expr {
        let t = self.peek().clone();
        match t.tok {
            Tok::IntMinMagnitude => {
                self.bump();
                self.diags.push(integer_too_large(t.span, true));
                Expr {
                    kind: ExprKind::Int(0),
                    span: t.span,
                }
            }
            Tok::Int(v) => {
                self.bump();
                Expr {
                    kind: ExprKind::Int(v),
                    span: t.span,
                }
            }
            Tok::Float(v) => {
                self.bump();
                Expr {
                    kind: ExprKind::Float(v),
                    span: t.span,
                }
            }
            Tok::Ident(ref w) if w == "true" || w == "false" => {
                self.bump();
                Expr {
                    kind: ExprKind::Bool(w == "true"),
                    span: t.span,
                }
            }
            Tok::Ident(ref w) if w == "if" => self.expr(),
            Tok::Ident(_) if self.at_quantifier() => self.expr(),
            Tok::Ident(ref w) if !RESERVED.contains(&w.as_str()) => {
                self.bump();
                Expr {
                    kind: ExprKind::Name(w.clone()),
                    span: t.span,
                }
            }
            Tok::LParen => {
                self.bump();
                let mut e = self.expr();
                self.expect(Tok::RParen, "`)`");
                e.span = Span {
                    start: t.span.start,
                    end: self.prev_end(),
                };
                e
            }
            Tok::LBracket => {
                self.bump();
                let items = self.comma_list(&Tok::RBracket);
                Expr {
                    kind: ExprKind::Array(items),
                    span: Span {
                        start: t.span.start,
                        end: self.prev_end(),
                    },
                }
            }
            _ => {
                // The token is left for the statement's recovery; every rule around this one
                // would report it again (a missing `)`, `]` or `;`), so the rest of the
                // statement is skipped quietly: one fault, one diagnostic.
                self.error_here("an expression");
                self.skipping = true;
                self.error_expr(t.span)
            }
        }
    }
}

/// Maps every span of `e` through `at` (from an interpolation's text to the source).
fn remap(e: &mut Expr, at: &dyn Fn(u32) -> u32) {
    e.span = Span {
        start: at(e.span.start),
        end: at(e.span.end),
    };
    match &mut e.kind {
        ExprKind::Array(xs) => xs.iter_mut().for_each(|x| remap(x, at)),
        ExprKind::Unary(_, a) => remap(a, at),
        ExprKind::Binary(_, a, b) => {
            remap(a, at);
            remap(b, at);
        }
        ExprKind::Compare { first, rest } => {
            remap(first, at);
            rest.iter_mut().for_each(|(_, x)| remap(x, at));
        }
        ExprKind::Range { lo, hi, .. } => {
            remap(lo, at);
            remap(hi, at);
        }
        ExprKind::In { elem, range } => {
            remap(elem, at);
            remap(range, at);
        }
        ExprKind::Call { callee, args } => {
            remap(callee, at);
            args.iter_mut().for_each(|x| remap(x, at));
        }
        ExprKind::Field { base, name } => {
            remap(base, at);
            name.span = Span {
                start: at(name.span.start),
                end: at(name.span.end),
            };
        }
        ExprKind::Index { base, index } => {
            remap(base, at);
            remap(index, at);
        }
        ExprKind::If { cond, then, els } => {
            remap(cond, at);
            remap(then, at);
            remap(els, at);
        }
        ExprKind::Quant {
            var, range, body, ..
        } => {
            var.span = Span {
                start: at(var.span.start),
                end: at(var.span.end),
            };
            remap(range, at);
            remap(body, at);
        }
        ExprKind::Int(_)
        | ExprKind::Float(_)
        | ExprKind::Bool(_)
        | ExprKind::Name(_)
        | ExprKind::Error => {}
    }
}
