//! Lowering of `let`s: a `let` is inlined at every use (so its body is checked in the
//! context of each use, and errors inside it are reported at the use too); one that nobody
//! uses is still checked, and warned about (`CM0250`) when the program is otherwise clean.

use super::{Checker, Ctx, Def, Val, R};
use cm_syntax::ast::{self, Item};
use cm_syntax::{Code, Diagnostic, Span};

/// Most `let`s that may refer to one another in a chain.
const MAX_LET_DEPTH: u32 = 64;

impl Checker<'_> {
    /// A use of `let` number `id`: its body lowered in place (in the context of the use,
    /// with the names visible at the `let`), at the use's span.
    pub(super) fn inline_let(&mut self, id: usize, span: Span, ctx: Ctx) -> R<Val> {
        self.lets[id].1 = true;
        self.let_depth += 1;
        if self.let_depth > MAX_LET_DEPTH {
            self.let_depth -= 1;
            self.err(
                Diagnostic::error(Code::TooDeep, span, "`let` bindings nest too deeply").with_hint(
                    format!("at most {MAX_LET_DEPTH} `let`s may refer to one another in a chain"),
                ),
            );
            return Err(());
        }
        let (expr, _, at) = self.lets[id];
        let outer = std::mem::replace(&mut self.visible_before, at);
        // A `let` is a statement: the variables of an `any` it is used in are not its own.
        let vars = std::mem::take(&mut self.vars);
        let v = self.lower(expr, ctx);
        self.vars = vars;
        self.visible_before = outer;
        self.let_depth -= 1;
        // Report errors inside the let at the use site too, so the cause is found.
        v.map(|v| respan(v, span))
    }

    /// Checks every `let` that no use has inlined, as if it were used in the mask, so its
    /// errors show. What they read does not count as the mask reading `b` or `h`.
    pub(super) fn check_unused_lets(&mut self) {
        let (uses_b, uses_h) = (self.uses_b, self.uses_h);
        for id in 0..self.lets.len() {
            let (body, used, idx) = self.lets[id];
            if !used {
                self.visible_before = idx;
                let _ = self.lower(body, Ctx::Mask);
            }
        }
        (self.uses_b, self.uses_h) = (uses_b, uses_h);
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
        assert_eq!(
            diags
                .iter()
                .map(|d| (d.code.as_str(), d.message.as_str()))
                .collect::<Vec<_>>(),
            [("CM0250", "`u` is never used")]
        );
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

    #[test]
    fn let_chains_nest_at_most_64_deep() {
        let chain = |n: usize| {
            let mut s = "let a0 = q;\n".to_string();
            for i in 1..n {
                s.push_str(&format!("let a{i} = a{};\n", i - 1));
            }
            s + &format!("mask = k <= a{};", n - 1)
        };
        assert_eq!(rows(&chain(64), 4, 4), rows("mask = k <= q;", 4, 4));
        let (code, message) = error(&chain(65));
        assert_eq!(
            (code, message.as_str()),
            ("CM0105", "`let` bindings nest too deeply")
        );
    }
}
