//! How `check`, `plan` and `list` show a program's score terms (docs/language.md, "Scores").

use compilemask::{show_float, ScorePart, ScoreTerms};
use serde_json::{json, Value};

/// `a*q + b*k + c` as written by a person: `q - k`, `2*q + 3`, `0`.
fn affine(q: i32, k: i32, offset: i64) -> String {
    let mut out = String::new();
    for (c, name) in [(i64::from(q), "q"), (i64::from(k), "k"), (offset, "")] {
        if c == 0 {
            continue;
        }
        let sign = if c < 0 { "-" } else { "+" };
        if !out.is_empty() {
            out.push_str(&format!(" {sign} "));
        } else if c < 0 {
            out.push('-');
        }
        let a = c.unsigned_abs();
        match (a, name) {
            (1, n) if !n.is_empty() => out.push_str(n),
            (a, "") => out.push_str(&a.to_string()),
            (a, n) => out.push_str(&format!("{a}*{n}")),
        }
    }
    if out.is_empty() {
        "0".into()
    } else {
        out
    }
}

/// One line per term, for `plan`.
pub fn lines(t: &ScoreTerms, num_heads: u32) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(c) = t.softcap {
        out.push(format!("softcap {}: c * tanh(s / c)", show_float(c)));
    }
    if let Some(l) = &t.linear {
        let shown: Vec<String> = l.slopes.iter().take(4).map(|&s| show_float(s)).collect();
        let more = if l.slopes.len() > 4 { ", ..." } else { "" };
        out.push(format!(
            "linear bias slopes[h] * ({}), slopes [{}{more}] ({})",
            affine(l.q_coef, l.k_coef, l.offset),
            shown.join(", "),
            crate::count(num_heads, "head")
        ));
    }
    if let Some(b) = &t.table {
        let dims: Vec<String> = b
            .dims(num_heads as usize)
            .iter()
            .map(|d| d.to_string())
            .collect();
        out.push(format!(
            "bias table `{}` [{}]{}, learnable: {} of {} read",
            b.tensor,
            dims.join(", "),
            if b.per_head {
                " per head"
            } else {
                " shared by the heads"
            },
            b.buckets_read(),
            crate::count(b.num_buckets, "bucket")
        ));
    }
    if let Some(s) = &t.sink {
        out.push(format!("sink `{s}` [{num_heads}], learnable"));
    }
    out
}

/// `export`'s warning for a plan with score terms: every format holds only which pairs are
/// visible, so the terms are named here rather than dropped without a word.
pub fn export_warning(t: &ScoreTerms, num_heads: u32) -> String {
    format!(
        "warning: the export holds only which pairs are visible, not the plan's score terms: {}; \
         apply them where the export is used (from Python, `plan.score_mod()` is FlexAttention's \
         score_mod of the softcap and biases; sinks: docs/exports.md, \"Score terms\")\n",
        lines(t, num_heads).join("; ")
    )
}

/// The terms as `plan --json`'s `score` object.
pub fn json(t: &ScoreTerms, num_heads: u32) -> Value {
    json!({
        "softcap": t.softcap,
        "linear": t.linear.as_ref().map(|l| json!({
            "slopes": l.slopes,
            "q_coef": l.q_coef,
            "k_coef": l.k_coef,
            "offset": l.offset,
        })),
        "table": t.table.as_ref().map(|b| json!({
            "tensor": b.tensor,
            "shape": b.dims(num_heads as usize),
            "num_buckets": b.num_buckets,
            "per_head": b.per_head,
            "buckets_read": b.buckets_read(),
        })),
        "sink": t.sink.as_ref().map(|s| json!({ "tensor": s, "shape": [num_heads] })),
        "reads_positions": t.reads_positions(),
    })
}

/// The score part as written, for `list --json`.
pub fn part_json(s: &ScorePart) -> Value {
    json!({
        "terms": s.terms,
        "tensors": s.tensors.iter().map(|t| json!({ "name": t.name, "statement": t.statement })).collect::<Vec<_>>(),
        "score": s.score,
        "sink": s.sink,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn affine_forms_read_as_written() {
        assert_eq!(super::affine(1, -1, 0), "q - k");
        assert_eq!(super::affine(1, -1, 5), "q - k + 5");
        assert_eq!(super::affine(-2, 0, -3), "-2*q - 3");
        assert_eq!(super::affine(0, 1, 0), "k");
        assert_eq!(super::affine(0, 0, 1), "1");
        assert_eq!(super::affine(0, 0, 0), "0");
    }
}
