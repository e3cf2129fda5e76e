//! Lowering of `let`s: a `let` is inlined at every use (so its body is checked in the
//! context of each use, and errors inside it are reported at the use too); one that nobody
//! uses is still checked, and warned about (`CM0250`) when the program is otherwise clean.
//! A `let`'s depth and size with the `let`s it uses inlined are bounded
//! ([`MAX_INLINED_DEPTH`], the checker's node limit) and checked once, at the `let` itself,
//! so a too-deep or too-large chain is one error at the link past the limit, not one per
//! use.

use super::{Checker, Ctx, Def, Val, MAX_NODES, R};
use cm_syntax::ast::{self, ExprKind, Ident, Item};
use cm_syntax::{Code, Diagnostic, Span};

/// Deepest expression a `let` may stand for once the `let`s it uses are inlined: 64 times
/// the parser's nesting limit, so checking, binding and planning (which recurse over
/// expressions through [`crate::deep`]) keep to a bounded stack, while a chain of a thousand
/// `let`s that each add one term (`let u2 = u1 | t2;`) fits.
pub const MAX_INLINED_DEPTH: u32 = 8192;

/// [`Inlined::depth`] of an expression that names a failed definition.
const POISONED: u32 = u32::MAX;

/// An expression's shape with the `let`s it names inlined.
#[derive(Clone, Copy, Debug)]
pub(super) struct Inlined {
    /// 1 for a leaf, one more than its deepest operand otherwise.
    pub depth: u32,
    /// Expression nodes, each inlined `let` counted at every use (saturating).
    pub nodes: u64,
}

/// Calls `f` on each direct operand of `e`.
fn each_operand<'e>(e: &'e ast::Expr, f: &mut impl FnMut(&'e ast::Expr)) {
    match &e.kind {
        ExprKind::Int(_)
        | ExprKind::Float(_)
        | ExprKind::Bool(_)
        | ExprKind::Error
        | ExprKind::Name(_) => {}
        ExprKind::Array(xs) => xs.iter().for_each(f),
        ExprKind::Unary(_, a) | ExprKind::Field { base: a, .. } => f(a),
        ExprKind::Binary(_, a, b)
        | ExprKind::Range { lo: a, hi: b, .. }
        | ExprKind::In { elem: a, range: b }
        | ExprKind::Index { base: a, index: b } => {
            f(a);
            f(b);
        }
        ExprKind::Compare { first, rest } => {
            f(first);
            rest.iter().for_each(|(_, x)| f(x));
        }
        ExprKind::Call { callee, args } => {
            f(callee);
            args.iter().for_each(f);
        }
        ExprKind::If { cond, then, els } => {
            f(cond);
            f(then);
            f(els);
        }
        ExprKind::Quant { range, body, .. } => {
            f(range);
            f(body);
        }
    }
}

impl Checker<'_> {
    /// The inlined depth and size of the body `value` of `let NAME`, measured before the
    /// name is declared (so a use of the name inside is not this `let`); `None`, with the
    /// error reported at the name when the depth is past [`MAX_INLINED_DEPTH`] or the size
    /// past [`MAX_NODES`], when the `let` cannot be used: it then names a failed
    /// definition, or is too deep or too large.
    pub(super) fn let_shape(&mut self, name: &Ident, value: &ast::Expr) -> Option<Inlined> {
        let shape = self.inlined(value);
        if shape.depth == POISONED {
            // It uses a name that failed (already reported): so does every use.
            return None;
        }
        let too_large = if shape.depth > MAX_INLINED_DEPTH {
            Some(Diagnostic::error(
                    Code::TooDeep,
                    name.span,
                    format!("`{}` nests too deeply: with the `let`s it uses inlined, its expression is {} levels deep (at most {MAX_INLINED_DEPTH})", name.name, shape.depth),
                )
                .with_hint("a long chain of `let`s that each use the previous one adds up; join terms in groups (`let g1 = t1 | ... | t100;`) and combine the groups"))
        } else if shape.nodes > MAX_NODES as u64 {
            Some(Diagnostic::error(
                    Code::TooDeep,
                    name.span,
                    format!("`{}` is too large: with the `let`s it uses inlined, its expression has {} nodes (at most {MAX_NODES})", name.name, shape.nodes),
                )
                .with_hint("a `let` is copied into every place that uses it; a chain of lets that each use the previous one twice doubles in size at every step"))
        } else {
            None
        };
        if let Some(d) = too_large {
            self.err(d);
            self.mark_used(value);
            return None;
        }
        Some(shape)
    }

    /// The shape of `e` with every earlier `let` it names inlined (recursion bounded by the
    /// parser's nesting limit); depth [`POISONED`] when it names something that failed to
    /// check.
    fn inlined(&self, e: &ast::Expr) -> Inlined {
        if let ExprKind::Name(n) = &e.kind {
            return match self.names.get(n) {
                Some((Def::Let(id), _)) => {
                    let at = self.let_shapes[*id];
                    Inlined {
                        depth: at.depth.saturating_add(1),
                        nodes: at.nodes.saturating_add(1),
                    }
                }
                Some((Def::Failed, _)) => Inlined {
                    depth: POISONED,
                    nodes: 1,
                },
                _ => Inlined { depth: 1, nodes: 1 },
            };
        }
        let mut below = Inlined { depth: 0, nodes: 0 };
        each_operand(e, &mut |x| {
            let x = self.inlined(x);
            below.depth = below.depth.max(x.depth);
            below.nodes = below.nodes.saturating_add(x.nodes);
        });
        Inlined {
            depth: below.depth.saturating_add(1),
            nodes: below.nodes.saturating_add(1),
        }
    }

    /// Marks the `let`s that `e` names as used (their user failed, so a second report of
    /// them as unused or as checked on their own would only repeat its error).
    fn mark_used(&mut self, e: &ast::Expr) {
        if let ExprKind::Name(n) = &e.kind {
            if let Some((Def::Let(id), _)) = self.names.get(n) {
                self.lets[*id].1 = true;
            }
        }
        each_operand(e, &mut |x| self.mark_used(x));
    }

    /// A use of `let` number `id`: its body lowered in place (in the context of the use,
    /// with the names visible at the `let`), at the use's span.
    pub(super) fn inline_let(&mut self, id: usize, span: Span, ctx: Ctx) -> R<Val> {
        self.lets[id].1 = true;
        let (expr, _, at) = self.lets[id];
        let outer = std::mem::replace(&mut self.visible_before, at);
        // A `let` is a statement: the variables of an `any` it is used in are not its own.
        let vars = std::mem::take(&mut self.vars);
        let v = self.lower(expr, ctx);
        self.vars = vars;
        self.visible_before = outer;
        // Report errors inside the let at the use site too, so the cause is found.
        v.map(|v| respan(v, span))
    }

    /// Checks every `let` that no use has inlined, as if it were used in the mask, so its
    /// errors show. What they read does not count as the mask reading `b`, `h`, `batch` or
    /// `num_heads`. Last first: checking a `let` checks (and marks used) the earlier ones it
    /// names, so a chain of unused `let`s is checked once, not once per link.
    pub(super) fn check_unused_lets(&mut self) {
        let reads = (
            self.uses_b,
            self.uses_h,
            self.reads_num_heads,
            self.reads_batch,
        );
        for id in (0..self.lets.len()).rev() {
            let (body, used, idx) = self.lets[id];
            if !used {
                self.visible_before = idx;
                let _ = self.lower(body, Ctx::Mask);
            }
        }
        (
            self.uses_b,
            self.uses_h,
            self.reads_num_heads,
            self.reads_batch,
        ) = reads;
    }

    /// `CM0250` for every `let` of `program` that is never used.
    pub(super) fn warn_unused_lets(&mut self, program: &ast::Program) {
        for item in &program.items {
            if let Item::Let { name, .. } = item {
                if let Some((Def::Let(id), _)) = self.names.get(&name.name) {
                    if !self.lets[*id].1 {
                        self.diags.push(Diagnostic::warning(
                            Code::UnusedLet,
                            name.span,
                            format!("`{}` is never used", name.name),
                        ));
                    }
                }
            }
        }
    }
}

/// Gives a value from a `let` the span of its use, so later diagnostics point there.
fn respan(v: Val, span: Span) -> Val {
    match v {
        Val::Int(mut i) => {
            i.span = span;
            Val::Int(i)
        }
        Val::Bool(b, _) => Val::Bool(b, span),
        Val::Region(r, _) => Val::Region(r, span),
        Val::Range(mut r) => {
            r.span = span;
            Val::Range(r)
        }
        Val::Arr(a, _) => Val::Arr(a, span),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{check, codes, error, error_diag, program, rows};
    use cm_syntax::Diagnostic;

    /// Each diagnostic's code and message.
    fn coded(diags: &[Diagnostic]) -> Vec<(&'static str, &str)> {
        diags
            .iter()
            .map(|d| (d.code.as_str(), d.message.as_str()))
            .collect()
    }

    /// A `let` means its body written out at each use.
    #[test]
    fn a_let_is_its_body_at_every_use() {
        assert_eq!(
            rows("let w = q - 3;\nmask = k > w & k <= q | k == w;", 16, 16),
            rows("mask = k > q - 3 & k <= q | k == q - 3;", 16, 16)
        );
        // The body is lowered in the context of the use: here it becomes a region.
        assert_eq!(
            rows("let near = q - 2 <= k;\nmask = near & k <= q;", 9, 9),
            rows("mask = q - 2 <= k & k <= q;", 9, 9)
        );
    }

    #[test]
    fn unused_lets_are_checked_and_warned_about_only_when_clean() {
        let (p, diags) = check("let u = 1;\nmask = k <= q;");
        assert!(p.is_some());
        assert_eq!(coded(&diags), [("CM0250", "`u` is never used")]);
        // An error elsewhere: no warning (some use may not have been checked).
        assert_eq!(codes("let u = 1;\nmask = k <= zz;"), ["CM0201"]);
        // The body of an unused let is checked all the same.
        assert_eq!(error("let u = zz;\nmask = k <= q;").0, "CM0201");
        // What an unused let reads is not what the mask reads.
        let p = program("let u = b + h;\nmask = k <= q;");
        assert!(!p.uses_b && !p.uses_h);
        assert!(program("let u = b;\nmask = k <= q + u;").uses_b);
    }

    /// An error about a let's value points at the use (where the value went wrong).
    #[test]
    fn values_of_lets_take_the_span_of_their_use() {
        let src = "let w = 3;\nmask = k < q & w;";
        let d = error_diag(src);
        assert_eq!(d.code.as_str(), "CM0203");
        let at = src.rfind('w').unwrap();
        assert_eq!((d.span.start as usize, d.span.end as usize), (at, at + 1));
    }

    /// `let a0 = q; let a1 = a0; ...` with `n` links, and the mask `k <= a{n-1}`.
    fn chain(n: usize, mask: bool) -> String {
        let mut s = "let a0 = q;\n".to_string();
        for i in 1..n {
            s.push_str(&format!("let a{i} = a{};\n", i - 1));
        }
        if mask {
            s + &format!("mask = k <= a{};", n - 1)
        } else {
            s + "mask = k <= q;"
        }
    }

    /// Link `i` stands for an expression `i + 1` deep, so the last link that fits is
    /// `MAX_INLINED_DEPTH - 1`; the next one is the one error, at its name.
    #[test]
    fn a_let_chain_is_bounded_by_its_inlined_depth_once_at_the_let_past_it() {
        let limit = super::MAX_INLINED_DEPTH as usize;
        assert_eq!(
            rows(&chain(limit, true), 4, 4),
            rows("mask = k <= q;", 4, 4)
        );
        let src = chain(limit + 10, true);
        let d = error_diag(&src);
        assert_eq!(d.code.as_str(), "CM0105");
        assert_eq!(
            d.message,
            format!("`a{limit}` nests too deeply: with the `let`s it uses inlined, its expression is {} levels deep (at most {limit})", limit + 1)
        );
        let at = src.find(&format!("let a{limit} ")).unwrap() + 4;
        assert_eq!(d.span.start as usize, at);
        assert_eq!(d.span.end as usize, at + format!("a{limit}").len());
    }

    /// Checking unused `let`s first to last would lower link `i` with its `i` predecessors
    /// each time, quadratic, past the node limit for this chain; last first checks it once.
    #[test]
    fn an_unused_let_chain_is_checked_once() {
        let (p, diags) = check(&chain(4000, false));
        assert!(p.is_some(), "{diags:?}");
        assert_eq!(coded(&diags), [("CM0250", "`a3999` is never used")]);
    }
}
