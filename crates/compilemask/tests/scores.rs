//! `attention_with_scores` / `attention_backward_with_scores`: the score tensors by name
//! against the reference called with the plan's terms directly, the name and head checks,
//! and the score part of programs as written.

use compilemask::{
    attention_backward_scored, attention_backward_with_scores, attention_forward_scored,
    attention_with_scores, AttentionError, AttentionShape, Masks, PlanOptions, Score,
};

fn shape(heads: usize, q_len: usize, kv_len: usize) -> AttentionShape {
    AttentionShape {
        batch: 1,
        num_heads: heads,
        num_kv_heads: 1,
        q_len,
        kv_len,
        head_dim: 2,
        head_dim_v: 2,
    }
}

fn values(n: usize, seed: f64) -> Vec<f64> {
    (0..n).map(|i| (i as f64 * seed).sin()).collect()
}

#[test]
fn tensors_by_name_are_the_plans_terms() {
    let src = "tensor rel: [num_heads, 8];\ntensor sinks: [num_heads];\nmask = k <= q;\n\
               score = score + rel[h][min(max(q - k, 0), 7)];\nsink = sinks[h];";
    let program = compilemask::compile(src).unwrap();
    let mut options = PlanOptions::new(5);
    options.num_heads = 3;
    let plan = program.plan(&options).unwrap();
    let s = shape(3, 5, 5);
    let (q, k, v, dout) = (
        values(30, 0.3),
        values(10, 0.7),
        values(10, 1.3),
        values(30, 0.9),
    );
    let (rel, sinks) = (values(24, 0.11), values(3, 2.0));
    let named = [("sinks", &sinks[..]), ("rel", &rel[..])];
    let fwd = attention_with_scores(&s, &q, &k, &v, &plan, 0.5, &named).unwrap();
    let terms = plan.score.as_ref().unwrap();
    let score = Score {
        terms,
        table: Some(&rel),
        sink: Some(&sinks),
    };
    let masks = [&plan.masks[0].rows];
    let m = Masks::indexed(&masks, &[0, 0, 0]);
    let direct = attention_forward_scored(&s, &q, &k, &v, &m, 0.5, Some(&score)).unwrap();
    assert_eq!(fwd, direct);
    let dlse: Vec<f64> = (0..15).map(|i| 0.25 * i as f64 - 1.0).collect();
    for dlse in [None, Some(&dlse[..])] {
        let g = attention_backward_with_scores(&s, &q, &k, &v, &dout, dlse, &plan, 0.5, &named)
            .unwrap();
        let g2 =
            attention_backward_scored(&s, &q, &k, &v, &dout, dlse, &m, 0.5, Some(&score)).unwrap();
        assert_eq!(g, g2);
    }
    let g =
        attention_backward_with_scores(&s, &q, &k, &v, &dout, None, &plan, 0.5, &named).unwrap();
    assert_eq!(g.dtable.as_ref().unwrap().len(), 24);
    assert_eq!(g.dsink.as_ref().unwrap().len(), 3);

    let err =
        |r: Result<compilemask::ForwardOutput<f64>, AttentionError>| r.unwrap_err().to_string();
    assert_eq!(
        err(attention_with_scores(
            &s,
            &q,
            &k,
            &v,
            &plan,
            0.5,
            &[("rel", &rel[..]), ("sink", &sinks[..])]
        )),
        "score tensor `sink` is not one the plan's score reads; it reads `rel` and `sinks`"
    );
    assert_eq!(
        err(attention_with_scores(
            &s,
            &q,
            &k,
            &v,
            &plan,
            0.5,
            &[("rel", &rel[..])]
        )),
        "the score terms read tensor `sinks` (sinks), but none was given"
    );
    let s4 = shape(4, 5, 5);
    let q4 = values(40, 0.3);
    assert_eq!(
        err(attention_with_scores(&s4, &q4, &k, &v, &plan, 0.5, &named)),
        "the plan was made for num_heads = 3, but the tensors have num_heads = 4; plan again for these tensors"
    );
    let causal = compilemask::builtin("causal")
        .unwrap()
        .plan(&PlanOptions::new(5))
        .unwrap();
    assert_eq!(
        err(attention_with_scores(&s, &q, &k, &v, &causal, 0.5, &named)),
        "score tensor `sinks` is not one the plan's score reads; it reads none (the plan has no score terms)"
    );
    // Without tensors, a plan without score terms is `attention`.
    assert_eq!(
        attention_with_scores(&s, &q, &k, &v, &causal, 0.5, &[]).unwrap(),
        compilemask::attention(&s, &q, &k, &v, &causal, 0.5).unwrap()
    );
}

/// A plan whose terms are the same for every head (the built-in softcap, a slope without
/// `h`), made for one head, applies to tensors of any head count as the plan for that count.
#[test]
fn terms_the_same_for_every_head_serve_any_head_count() {
    let s = shape(3, 6, 6);
    let (q, k, v) = (values(36, 0.3), values(12, 0.7), values(12, 1.3));
    for src in [
        "param cap: int = 2;\nmask = k <= q;\nscore = softcap(score, cap);",
        "mask = k <= q;\nscore = score - 0.5 * (q - k);",
    ] {
        let program = compilemask::compile(src).unwrap();
        let mut options = PlanOptions::new(6);
        let one = program.plan(&options).unwrap();
        options.num_heads = 3;
        let three = program.plan(&options).unwrap();
        assert_eq!(
            attention_with_scores(&s, &q, &k, &v, &one, 0.5, &[]).unwrap(),
            attention_with_scores(&s, &q, &k, &v, &three, 0.5, &[]).unwrap(),
            "{src}"
        );
    }
}

#[test]
fn score_parts_are_shown_as_written() {
    let p = compilemask::builtin("t5_relative_bias").unwrap();
    let part = p.score_part().unwrap();
    assert_eq!(part.terms, ["bias table"]);
    assert_eq!(part.tensors[0].name, "rel_bias");
    assert_eq!(
        part.score.as_deref(),
        Some("score = score + rel_bias[h][t5_bucket(k - q, num_buckets, max_distance, causal == 0)];")
    );
    assert!(part.sink.is_none());
    let p = compilemask::compile(
        "tensor s: [num_heads];\nmask = k <= q;\nscore = softcap(score,\n    30.0) - 0.5 * (q - k);\nsink = s[h];",
    )
    .unwrap();
    let part = p.score_part().unwrap();
    assert_eq!(part.terms, ["softcap", "linear bias", "sink"]);
    assert_eq!(
        part.score.as_deref(),
        Some("score = softcap(score, 30.0) - 0.5 * (q - k);")
    );
    assert!(compilemask::builtin("causal")
        .unwrap()
        .score_part()
        .is_none());
}

/// A score that reads `h` (slopes, a table row, a sink) planned with one head warns
/// (CM0262) at the score; with the heads, or a score that does not read `h`, it does not.
#[test]
fn a_score_per_head_planned_with_one_head_warns() {
    let cases = [
        (
            "mask = k <= q;\nscore = score - alibi_slopes(num_heads)[h] * (q - k);",
            true,
        ),
        ("tensor s: [num_heads];\nmask = k <= q;\nsink = s[h];", true),
        ("mask = k <= q;\nscore = softcap(score, 30);", false),
    ];
    for (src, per_head) in cases {
        let program = compilemask::compile(src).unwrap();
        for heads in [1, 4] {
            let mut options = PlanOptions::new(16);
            options.num_heads = heads;
            let plan = program.plan(&options).unwrap();
            let warned = program.plan_warnings(&options, &plan).iter().any(|d| {
                d.code == "CM0262" && d.message.contains("the score reads the head index")
            });
            assert_eq!(warned, per_head && heads == 1, "{src} at {heads} heads");
        }
    }
}
