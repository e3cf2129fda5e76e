//! The rows of planned steps against the pairwise semantics (each sequence bound at its own
//! length, brute force of its new rows), through the piece cache and the general path, step
//! after step; and every error.

mod common;

use cm_ir::Value;
use cm_serve::{Step, StepError, StepPlan, StepPlanner};
use common::*;
use proptest::prelude::*;
use std::sync::Arc;

/// Programs of every kind the planner tells apart: those the piece cache serves (no length,
/// `b`, `h` or `elementwise` read), and those planned by binding every sequence (lengths,
/// `b`, `elementwise`, a tree at the end of the sequence).
fn programs() -> Vec<(&'static str, Arc<cm_ir::Program>, Params, bool)> {
    let int = |name: &str, v: i64| params(&[(name, Value::Int(v))]);
    vec![
        ("causal", builtin("causal"), Params::new(), true),
        (
            "sliding_window",
            builtin("sliding_window"),
            int("window", 100),
            true,
        ),
        (
            "sink_local",
            builtin("sink_local"),
            params(&[("sink", Value::Int(3)), ("window", Value::Int(50))]),
            true,
        ),
        (
            "dilated_window",
            builtin("dilated_window"),
            params(&[("window", Value::Int(40)), ("dilation", Value::Int(3))]),
            true,
        ),
        (
            "chunked_causal",
            builtin("chunked_causal"),
            int("chunk", 64),
            true,
        ),
        ("prefix_lm", builtin("prefix_lm"), int("prefix", 50), true),
        (
            "key_side",
            compile("mask = (k * k) % 13 < 6 & k <= q;"),
            Params::new(),
            true,
        ),
        (
            "quantifier",
            compile("mask = any i in 0 .. 3: q - 10 * i - 2 < k <= q - 10 * i;"),
            Params::new(),
            true,
        ),
        (
            "bidirectional",
            compile("mask = k < 5 | k >= 100;"),
            Params::new(),
            true,
        ),
        (
            "causal_bottom_right",
            builtin("causal_bottom_right"),
            Params::new(),
            true,
        ),
        (
            "window_bottom_right",
            compile(
                "param d: int = kv_len - q_len;\nmask = q + d - 40 < k <= q + d & k >= (kv_len - q_len) / 2;",
            ),
            Params::new(),
            true,
        ),
        (
            "lengths_not_cancelling",
            compile("mask = k <= q + kv_len / 2 - q_len / 2 | k < q_len / 9;"),
            Params::new(),
            false,
        ),
        ("tree_decode", builtin("tree_decode"), Params::new(), false),
        (
            "reads_kv_len",
            compile("mask = k < 4 | k >= kv_len - 8;"),
            Params::new(),
            false,
        ),
        (
            "reads_b",
            compile("mask = k <= q & (k + b) % 3 != 0;"),
            Params::new(),
            false,
        ),
        (
            "reads_num_heads",
            compile("mask = k <= q & k % num_heads == 0;"),
            Params::new(),
            false,
        ),
        (
            "elementwise",
            compile("mask = k <= q & elementwise((q * 7 + k * 3) % 5 < 3);"),
            Params::new(),
            false,
        ),
    ]
}

/// Plans the step and checks it against brute force, the arrays against their contract.
fn check(
    name: &str,
    planner: &mut StepPlanner,
    own: Option<&[Params]>,
    q_len: &[i64],
    kv_len: &[i64],
) -> StepPlan {
    let plan = match own {
        None => planner.plan(q_len, kv_len),
        Some(own) => planner.plan_each(q_len, kv_len, own),
    }
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    plan.validate()
        .unwrap_or_else(|e| panic!("{name}: not canonical: {e}"));
    let want = brute_rows(planner.program(), planner.params(), own, q_len, kv_len);
    let got = step_rows(&plan);
    assert_eq!(got.len(), want.len(), "{name}");
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        let s = plan.seq_of_row(r).unwrap();
        assert_eq!(
            g,
            w,
            "{name}: row {r} (sequence {s}, position {}), q_len {q_len:?}, kv_len {kv_len:?}",
            plan.position(s, r - plan.cu_q()[s] as usize)
        );
    }
    assert_eq!(
        plan.kv_len(),
        kv_len.iter().map(|&k| k as i32).collect::<Vec<_>>()
    );
    let mut cu = vec![0i32];
    for &q in q_len {
        cu.push(cu.last().unwrap() + q as i32);
    }
    assert_eq!(plan.cu_q(), cu);
    plan
}

/// The lengths: q_len 1 / 7 / 64 over kv_len 1 / 127 / 129 / 4097, in steps of
/// several sequences, through the cache (shared parameters) and the general path (the same
/// values given per sequence).
#[test]
fn steps_equal_brute_force() {
    let steps: [(&[i64], &[i64]); 4] = [
        (&[1, 7, 64, 1], &[1, 127, 129, 4097]),
        (&[64, 7, 1], &[4097, 7, 129]),
        (&[1, 1, 1, 1, 1], &[4097, 1, 2, 129, 127]),
        (&[64], &[64]),
    ];
    for (name, program, shared, caches) in programs() {
        let mut planner = StepPlanner::new(program, shared.clone()).unwrap();
        assert_eq!(planner.caches_pieces(), caches, "{name}");
        for (q_len, kv_len) in steps {
            if name == "tree_decode" && kv_len.iter().any(|&k| k < 7) {
                continue;
            }
            check(name, &mut planner, None, q_len, kv_len);
            let own = vec![shared.clone(); q_len.len()];
            check(name, &mut planner, Some(&own), q_len, kv_len);
        }
    }
}

proptest! {
    #![proptest_config(cm_testkit::config::env_config(
        cm_testkit::config::PROPTEST_CASES, 48, 0x5e27e))]

    /// Random steps of every program: up to 5 sequences, q_len up to 70, kv_len up to 700.
    #[test]
    fn random_steps_equal_brute_force(
        seqs in proptest::collection::vec((1i64..=70, 0i64..=630), 1..=5),
    ) {
        let q_len: Vec<i64> = seqs.iter().map(|s| s.0).collect();
        let kv_len: Vec<i64> = seqs.iter().map(|s| s.0 + s.1 + 7).collect();
        for (name, program, shared, _) in programs() {
            let mut planner = StepPlanner::new(program, shared).unwrap();
            check(name, &mut planner, None, &q_len, &kv_len);
        }
    }
}

/// Decoding and appending chunks step after step: each step equals a fresh plan of its
/// lengths and brute force, across the cache's capacity (4096 keys, then 8192).
#[test]
fn appends_equal_fresh_plans() {
    let mut rng = Gen::new(3);
    for (name, program, shared, _) in programs() {
        let planner = StepPlanner::new(program.clone(), shared.clone()).unwrap();
        let mut kv: Vec<i64> = vec![4090, 20, 4093, 300];
        let mut q: Vec<i64> = vec![1, 13, 2, 64];
        let mut step = Step::new(planner, &q, &kv, None).unwrap();
        for _ in 0..12 {
            q = (0..kv.len()).map(|_| 1 + rng.below(5) as i64).collect();
            step.append(&q).unwrap_or_else(|e| panic!("{name}: {e}"));
            for (k, n) in kv.iter_mut().zip(&q) {
                *k += n;
            }
            let mut fresh = StepPlanner::new(program.clone(), shared.clone()).unwrap();
            let want = check(name, &mut fresh, None, &q, &kv);
            assert_eq!(step.plan(), &want, "{name}");
        }
        assert!(
            kv[0] > 4096 && kv[2] > 4096,
            "the steps cross the first capacity"
        );
    }
}

/// Per-sequence parameters: a speculative tree per sequence (`tree_decode`), each over its
/// own prefix, and a window per sequence; append keeps each sequence's parameters.
#[test]
fn trees_and_windows_per_sequence() {
    let trees: Vec<Vec<i64>> = vec![
        vec![-1, 0, 0, 1, 1, 2, 2],
        vec![-1, 0, 1, 2, 3, 4, 5, 6, 7],
        vec![-1],
        // 64 nodes: a 4-ary tree in breadth-first order.
        (0..64)
            .map(|i| if i == 0 { -1 } else { (i - 1) / 4 })
            .collect(),
    ];
    let own: Vec<Params> = trees
        .iter()
        .map(|p| params(&[("parents", Value::Array(p.clone().into()))]))
        .collect();
    let q_len: Vec<i64> = trees.iter().map(|t| t.len() as i64).collect();
    let kv_len: Vec<i64> = vec![4097, 9, 129, 200];
    let mut planner = StepPlanner::new(builtin("tree_decode"), Params::new()).unwrap();
    let plan = check("tree_decode", &mut planner, Some(&own), &q_len, &kv_len);
    // Node 3 of the first tree (parent 1, grandparent 0) sees the prefix, 0, 1 and itself.
    let prefix = 4097 - 7;
    assert_eq!(
        plan.row(3).collect::<Vec<_>>(),
        [(0, prefix + 2), (prefix + 3, prefix + 4)]
    );
    let windows: Vec<Params> = [3, 1000, 17]
        .iter()
        .map(|&w| params(&[("window", Value::Int(w))]))
        .collect();
    let planner = StepPlanner::new(builtin("sliding_window"), Params::new()).unwrap();
    let mut step = Step::new(planner, &[2, 1, 5], &[40, 2000, 17], Some(windows.clone())).unwrap();
    step.append(&[1, 3, 1]).unwrap();
    let want = brute_rows(
        &builtin("sliding_window"),
        &Params::new(),
        Some(&windows),
        &[1, 3, 1],
        &[41, 2003, 18],
    );
    assert_eq!(step_rows(step.plan()), want);
}

/// A decode loop at 32K keys stays in the pieces it found first: causal is one piece, a
/// window two, whatever the number of sequences and steps.
#[test]
fn decode_solves_few_pieces() {
    for (name, program, shared, pieces) in [
        ("causal", builtin("causal"), Params::new(), 1),
        (
            "sliding_window",
            builtin("sliding_window"),
            params(&[("window", Value::Int(4096))]),
            1,
        ),
    ] {
        let planner = StepPlanner::new(program, shared).unwrap();
        let kv: Vec<i64> = (0..64).map(|s| 32_000 + 7 * s).collect();
        let mut step = Step::new(planner, &[1; 64], &kv, None).unwrap();
        for _ in 0..200 {
            step.append(&[1; 64]).unwrap();
        }
        // All rows lie past the window, in one piece found from the shortest sequence's row.
        assert!(
            step.planner().cached_pieces() <= pieces + 1,
            "{name}: {} pieces",
            step.planner().cached_pieces()
        );
        assert_eq!(step.plan().kv_len()[63], 32_000 + 7 * 63 + 200);
    }
}

/// `num_heads` is what a program reading it sees (the mask is still one for every head).
#[test]
fn num_heads_is_the_programs_value() {
    let program = compile("mask = k <= q & k % num_heads == 0;");
    let mut planner = StepPlanner::new(program, Params::new())
        .unwrap()
        .with_num_heads(4)
        .unwrap();
    let plan = planner.plan(&[1], &[10]).unwrap();
    assert_eq!(plan.row(0).collect::<Vec<_>>(), [(0, 1), (4, 5), (8, 9)]);
    let e = StepPlanner::new(builtin("causal"), Params::new())
        .unwrap()
        .with_num_heads(0)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "[CM0402] Error: num_heads = 0 is out of range; expected 1 ..= 65536"
    );
}

/// Every bad input is a clear error naming the value, and leaves an appending step as it
/// was.
#[test]
fn bad_steps_are_errors() {
    let causal = || StepPlanner::new(builtin("causal"), Params::new()).unwrap();
    let e = |q: &[i64], kv: &[i64]| causal().plan(q, kv).unwrap_err();
    assert_eq!(e(&[], &[]), StepError::NoSequences);
    assert_eq!(
        e(&[1, 1], &[3]).to_string(),
        "kv_len has 1 entries for 2 sequences; give one per sequence"
    );
    assert_eq!(
        e(&[1, 0], &[3, 3]).to_string(),
        "q_len[1] = 0: every sequence of a step has at least one new row (q_len >= 1)"
    );
    assert!(e(&[5], &[4])
        .to_string()
        .starts_with("q_len[0] = 5 is more than kv_len[0] = 4"));
    assert_eq!(
        e(&[1], &[0]).to_string(),
        "kv_len[0] = 0 is out of range; expected 1 ..= 67108864"
    );
    assert!(matches!(
        e(&[1], &[1 << 27]),
        StepError::KvLenOutOfRange { .. }
    ));
    assert!(matches!(
        e(&[1 << 26; 40], &[1 << 26; 40]),
        StepError::TooManyRows { .. }
    ));

    let refused = |src: &str| StepPlanner::new(compile(src), Params::new()).unwrap_err();
    assert_eq!(refused("mask = k <= q - h;"), StepError::PerHeadMask);
    assert_eq!(
        refused("tensor sinks: [num_heads];\nsink = sinks[h];\nmask = k <= q;"),
        StepError::ScoreTerms
    );
    let unknown =
        StepPlanner::new(builtin("causal"), params(&[("window", Value::Int(3))])).unwrap_err();
    assert!(
        matches!(&unknown, StepError::Plan(p) if p.code.as_str() == "CM0309"),
        "{unknown}"
    );

    // A sequence whose binding fails names itself and its lengths, with the span.
    let mut trees = StepPlanner::new(builtin("tree_decode"), Params::new()).unwrap();
    let err = trees.plan(&[7, 3], &[100, 5]).unwrap_err();
    let StepError::Plan(p) = &err else {
        panic!("{err}")
    };
    assert_eq!(p.code.as_str(), "CM0305");
    assert!(p.span.is_some());
    assert!(
        p.message.ends_with("(sequence 1: q_len = 3, kv_len = 5)"),
        "{}",
        p.message
    );
    // A plan-time error of a cached program at a row: the general path's own error.
    let mut seg = StepPlanner::new(
        compile("segments d = [100, 50] fill 150;\nmask = k <= q & d.index(k) == d.index(q);"),
        Params::new(),
    )
    .unwrap();
    assert!(seg.caches_pieces());
    check("segments", &mut seg, None, &[3], &[150]);
    let err = seg.plan(&[1, 1], &[20, 151]).unwrap_err();
    let StepError::Plan(p) = &err else {
        panic!("{err}")
    };
    assert_eq!(p.code.as_str(), "CM0303");
    assert!(
        p.message.ends_with("(sequence 1: q_len = 1, kv_len = 151)"),
        "{}",
        p.message
    );

    // Appending: one count per sequence, each >= 1; the step is unchanged on an error.
    let mut step = Step::new(causal(), &[1, 1], &[5, 9], None).unwrap();
    let before = step.plan().clone();
    assert!(matches!(
        step.append(&[1]),
        Err(StepError::CountMismatch {
            what: "new_tokens",
            given: 1,
            num_seqs: 2
        })
    ));
    assert!(matches!(
        step.append(&[1, 0]),
        Err(StepError::NoNewTokens {
            seq: 1,
            new_tokens: 0
        })
    ));
    assert!(matches!(
        step.append(&[1, -4]),
        Err(StepError::NoNewTokens {
            seq: 1,
            new_tokens: -4
        })
    ));
    // The error speaks of what append takes, not of the q_len it would make.
    assert_eq!(
        step.append(&[3, 0]).unwrap_err().to_string(),
        "new_tokens[1] = 0: every sequence gains at least one new token (new_tokens >= 1), which is its new row"
    );
    assert_eq!(step.plan(), &before);
    // A step without rows but with keys names the rows as what is missing.
    assert_eq!(
        Step::new(causal(), &[], &[4, 8], None)
            .unwrap_err()
            .to_string(),
        "q_len has 0 entries for 2 sequences; give one per sequence"
    );
    // So does one past the longest sequence, at the limit's edge and far past it.
    let max = cm_ir::bind::MAX_LEN;
    assert!(matches!(
        step.append(&[1, max - 9 + 1]),
        Err(StepError::AppendPastMax {
            seq: 1,
            kv_len: 9,
            ..
        })
    ));
    assert_eq!(
        step.append(&[i64::MAX, 1]).unwrap_err().to_string(),
        format!(
            "new_tokens[0] = {} would take kv_len[0] = 5 past the longest supported \
             sequence, {max} keys",
            i64::MAX
        )
    );
    assert_eq!(step.plan(), &before);
    assert!(matches!(
        Step::new(causal(), &[1], &[1], Some(vec![])),
        Err(StepError::CountMismatch { what: "params", .. })
    ));
}

/// Arrays from outside are taken exactly when they keep the contract.
#[test]
fn from_parts_checks_the_contract() {
    let mut planner = StepPlanner::new(
        builtin("dilated_window"),
        params(&[("window", Value::Int(9)), ("dilation", Value::Int(2))]),
    )
    .unwrap();
    let plan = planner.plan(&[2, 1], &[12, 3]).unwrap();
    let (cu, kv, rp, iv) = plan.clone().into_parts();
    // Positions 10 and 11 see every other key of 9; position 2 of the second sequence 0 and 2.
    assert_eq!(
        iv,
        [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3]
    );
    assert_eq!(
        StepPlan::from_parts(cu.clone(), kv.clone(), rp.clone(), iv.clone()).unwrap(),
        plan
    );
    let bad = |cu: &[i32], kv: &[i32], rp: &[i32], iv: &[i32]| {
        StepPlan::from_parts(cu.to_vec(), kv.to_vec(), rp.to_vec(), iv.to_vec())
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        bad(&[0], &[], &[0], &[]),
        "cu_q: 1 entries; it needs num_seqs + 1 >= 2 (one sequence at least)"
    );
    assert_eq!(
        bad(&[1, 2], &[3], &[0, 0], &[]),
        "cu_q: cu_q[0] = 1, expected 0"
    );
    assert!(bad(&[0, 1, 1], &[3, 3], &[0, 0], &[])
        .starts_with("cu_q: cu_q[2] = 1 is not above cu_q[1] = 1"));
    assert_eq!(
        bad(&[0, 1], &[3, 3], &[0, 0], &[]),
        "kv_len: 2 entries, expected num_seqs = 1"
    );
    assert!(bad(&[0, 2], &[1], &[0, 0, 0], &[])
        .starts_with("kv_len: kv_len[0] = 1, expected q_len[0] = 2"));
    assert_eq!(
        bad(&[0, 1], &[3], &[0], &[]),
        "row_ptr: 1 entries, expected total_q + 1 = 2"
    );
    assert!(bad(&[0, 1], &[3], &[0, 1], &[0]).starts_with("intervals: 1 entries, an odd number"));
    assert!(bad(&[0, 1], &[3], &[0, 2], &[0, 1])
        .starts_with("row_ptr: row_ptr[0] = 0 and row_ptr[1] = 2"));
    assert_eq!(
        bad(&[0, 1], &[3], &[0, 1], &[1, 4]),
        "intervals: row 0 (sequence 0): interval 0 is [1, 4), expected 0 <= start < end <= kv_len[0] = 3"
    );
    assert!(bad(&[0, 1], &[3], &[0, 1], &[2, 2]).contains("interval 0 is [2, 2)"));
    assert!(bad(&[0, 1], &[5], &[0, 2], &[0, 1, 1, 3]).contains("overlaps or touches"));
    assert!(bad(&[0, 3], &[5], &[0, 2, 1, 2], &[0, 1, 2, 3])
        .starts_with("row_ptr: row_ptr[1] = 2, row_ptr[2] = 1"));
    // An offset past the intervals before the last row: an error, not an index out of range.
    assert!(bad(&[0, 2], &[5], &[0, 3, 2], &[0, 1, 2, 3])
        .starts_with("row_ptr: row_ptr[0] = 0, row_ptr[1] = 3"));
    // A row with no interval is allowed (it sees no key).
    let empty = StepPlan::from_parts(vec![0, 1], vec![4], vec![0, 0], vec![]).unwrap();
    assert_eq!(empty.row(0).count(), 0);
}
