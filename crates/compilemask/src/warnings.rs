//! Plan-time warnings: a plan that is valid but very likely not what was meant. Each has a
//! stable code ([`Code`]'s `CM026x`, one row each of docs/language.md's table), a span in the
//! program and a hint. The CLI prints them on standard error (`--deny-warnings` makes them errors);
//! Python raises them as `compilemask.CompileMaskWarning`.

use cm_syntax::{Code, Diagnostic, Span};

use crate::{Plan, PlanOptions, Program};
use cm_plan::TreeOverhang;

/// Pairs evaluated by `elementwise` above which [`Code::ElementwisePairs`] is raised.
pub const ELEMENTWISE_WARN_PAIRS: u64 = 1_000_000;

/// The first `elementwise(...)` region of `r`, if any.
fn first_elementwise(r: &cm_ir::Region) -> Option<Span> {
    use cm_ir::Region;
    match r {
        Region::Elementwise(_, span) => Some(*span),
        Region::Union(a, b) | Region::Inter(a, b) | Region::Diff(a, b) | Region::Cond(_, a, b) => {
            first_elementwise(a).or_else(|| first_elementwise(b))
        }
        Region::Not(a) => first_elementwise(a),
        _ => None,
    }
}

impl Program {
    /// The plan-time warnings of `plan`, made from `options` (for a packed plan, the
    /// options' parameters; its batch is the number of samples), in the order of the codes
    /// above.
    pub fn plan_warnings(&self, options: &PlanOptions, plan: &Plan) -> Vec<Diagnostic> {
        let ir = &self.ir;
        let mut out = Vec::new();
        let rows = u64::from(plan.q_len) * u64::from(plan.batch) * u64::from(plan.num_heads);
        let empty = plan.empty_rows();
        if plan.visible_pairs() == 0 {
            out.push(
                Diagnostic::warning(
                    Code::NoVisiblePair,
                    ir.mask_span,
                    format!(
                        "the mask sees nothing: no key is visible from any row at q_len = {}, kv_len = {}",
                        plan.q_len, plan.kv_len
                    ),
                )
                .with_label("no visible pair at these lengths and parameters")
                .with_hint("every attention output would be 0; check the lengths, the parameters and the mask's conditions"),
            );
        } else if empty > 0 {
            out.push(
                Diagnostic::warning(
                    Code::EmptyRows,
                    ir.mask_span,
                    format!(
                        "{empty} of {rows} query rows see no key (summed over batch and heads)"
                    ),
                )
                .with_label("some rows see no key")
                .with_hint(if ir.sink.is_some() {
                    "their attention output is 0 and their lse the head's sink logit; `compilemask intervals` shows which rows"
                } else {
                    "their attention output is 0 and their lse -inf; `compilemask intervals` shows which rows"
                }),
            );
        }
        if let (Some(span), 1) = (ir.h_span, plan.num_heads) {
            out.push(
                Diagnostic::warning(Code::OneHead, span, "the mask reads the head index `h`, but it was planned with one head")
                    .with_label("`h` is 0 in every row")
                    .with_hint("plan with the model's head count (--num-heads, num_heads=) so each head gets its own mask"),
            );
        }
        // A score per head (slopes, tables, sinks) planned for one head binds head 0's terms.
        let score_h = ir.score_h_span.or(ir.sink.as_ref().map(|s| s.span));
        if let (None, Some(span), 1) = (ir.h_span, score_h, plan.num_heads) {
            out.push(
                Diagnostic::warning(Code::OneHead, span, "the score reads the head index `h`, but it was planned with one head")
                    .with_label("head 0's terms in every row")
                    .with_hint("plan with the model's head count (--num-heads, num_heads=) so each head gets its own slopes, table row or sink"),
            );
        }
        let batch = plan.packing.as_ref().map_or(plan.batch, |p| p.batch());
        if let (Some(span), 1) = (ir.b_span, batch) {
            out.push(
                Diagnostic::warning(Code::OneBatch, span, "the mask reads the batch index `b`, but it was planned with one batch")
                    .with_label("`b` is 0 in every row")
                    .with_hint("plan with the batch size (--batch, batch=) or the samples (--cu-seqlens-q) the mask is for"),
            );
        }
        for p in ir.params.iter().filter(|p| !p.read) {
            if options.params.contains_key(&p.name) {
                out.push(
                    Diagnostic::warning(
                        Code::UnreadParameter,
                        p.span,
                        format!(
                            "parameter `{}` was set, but nothing in the program reads it",
                            p.name
                        ),
                    )
                    .with_label("declared here, never read")
                    .with_hint(
                        "the value changes nothing; use the parameter in the mask, or drop it",
                    ),
                );
            }
        }
        if plan.elementwise_pairs > ELEMENTWISE_WARN_PAIRS {
            let span = first_elementwise(&ir.mask).unwrap_or(ir.mask_span);
            out.push(
                Diagnostic::warning(
                    Code::ElementwisePairs,
                    span,
                    format!(
                        "`elementwise` evaluated {} (q, k) pairs one by one (more than {ELEMENTWISE_WARN_PAIRS})",
                        plan.elementwise_pairs
                    ),
                )
                .with_label("evaluated pair by pair")
                .with_hint("intersect it with a solvable region first (`q - 512 < k <= q & elementwise(...)`), or write the rule in solvable forms"),
            );
        }
        for o in &plan.tree_overhangs {
            out.push(tree_past_lengths(
                &ir.trees[o.tree],
                o,
                plan.packing.is_some(),
            ));
        }
        out
    }
}

/// [`Code::TreePastLengths`] for `tree`, laid out as `o` says (`packed`: its batch indices
/// are packed samples, each at its own lengths).
fn tree_past_lengths(tree: &cm_ir::ir::TreeDecl, o: &TreeOverhang, packed: bool) -> Diagnostic {
    let (past_q, past_kv) = (o.past_q_len(), o.past_kv_len());
    let need = o.at + o.nodes as i64;
    let (unit, units, lengths) = if packed {
        ("packed sample", "samples", "the sample's q_len")
    } else {
        ("batch index", "batch indices", "q_len")
    };
    let whose = if o.checked > 1 || packed {
        format!(" at {unit} {}", o.b)
    } else {
        String::new()
    };
    let past: Vec<String> = [
        (past_q, "past q_len (no query row)"),
        (past_kv, "past kv_len (no key)"),
    ]
    .into_iter()
    .filter(|&(n, _)| n > 0)
    .enumerate()
    .map(|(i, (n, what))| {
        if i == 0 {
            format!("{} {what}", nodes_lie(n))
        } else {
            format!("{n} {what}")
        }
    })
    .collect();
    let mut message = format!(
        "tree `{}`{whose} has {} nodes at offset {} (positions {} ..= {}), but {lengths} = {} and kv_len = {}: {}",
        tree.name,
        o.nodes,
        o.at,
        o.at,
        need - 1,
        o.q_len,
        o.kv_len,
        past.join(" and ")
    );
    match (o.checked, o.batches) {
        (1, _) => {}
        (checked, 1) => message.push_str(&format!("; the other {} {units} fit", checked - 1)),
        (checked, batches) => message.push_str(&format!(
            "; {batches} of {checked} {units} have nodes outside, this one the most"
        )),
    }
    let longer: Vec<String> = [(past_q, "q_len"), (past_kv, "kv_len")]
        .into_iter()
        .filter(|&(n, _)| n > 0)
        .map(|(_, len)| format!("{len} >= {need}"))
        .collect();
    let fit = (i64::from(o.q_len.min(o.kv_len)) - o.at).max(0);
    let shorter = if fit > 0 {
        format!(
            "a shorter parents list ({fit} nodes fit at offset {})",
            o.at
        )
    } else {
        format!("a smaller offset (no node fits at offset {})", o.at)
    };
    let give = if packed { "give samples of" } else { "give" };
    Diagnostic::warning(Code::TreePastLengths, tree.span, message)
        .with_label(format!(
            "{} of its {} nodes past the lengths",
            o.outside(),
            o.nodes
        ))
        .with_hint(format!(
            "to keep every node, {give} {}, or {shorter}",
            longer.join(" and ")
        ))
}

/// `1 node lies` or `N nodes lie`.
fn nodes_lie(n: u64) -> String {
    if n == 1 {
        "1 node lies".to_string()
    } else {
        format!("{n} nodes lie")
    }
}
