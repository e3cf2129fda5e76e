//! `compilemask shard`: the deal of a causal and a document mask against hand-computed
//! totals (visible pairs summed over ranks, the split by positions' imbalance, equal tokens),
//! the human-readable report, and clear errors for what cannot be sharded.

mod common;

use common::*;

#[test]
fn causal_is_balanced_where_a_position_split_is_not() {
    let v = json(&[
        "shard",
        "--builtin",
        "causal",
        "--q-len",
        "4096",
        "--ranks",
        "4",
        "--chunk",
        "128",
        "--json",
    ]);
    let ranks = v["per_rank"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    let total: u64 = ranks
        .iter()
        .map(|r| r["visible_pairs"].as_u64().unwrap())
        .sum();
    assert_eq!(total, 4096 * 4097 / 2);
    assert!(ranks
        .iter()
        .all(|r| r["tokens"] == 1024 && r["chunks"] == 8));
    assert!(v["max_over_mean_visible"].as_f64().unwrap() < 1.001);
    // Rank r of a split by positions sees (2r + 1) / 16 of the pairs (+ its diagonal).
    let split = v["position_split_max_over_mean_visible"].as_f64().unwrap();
    assert!((split - 1.75).abs() < 0.01, "{split}");
    let position: Vec<u64> = ranks
        .iter()
        .map(|r| r["position_split_visible_pairs"].as_u64().unwrap())
        .collect();
    let want: Vec<u64> = (0..4u64)
        .map(|r| (r * 1024..(r + 1) * 1024).map(|q| q + 1).sum())
        .collect();
    assert_eq!(position, want);
    for r in ranks {
        assert!(r["fetched_keys"].as_u64() <= r["ring_fetched_keys"].as_u64());
    }
}

#[test]
fn the_report_names_every_rank() {
    let out = ok(&[
        "shard",
        "--builtin",
        "document_causal",
        "--set",
        "lengths=[700,300,1000]",
        "--q-len",
        "2000",
        "--ranks",
        "3",
        "--chunk",
        "100",
    ]);
    assert!(
        out.contains("2000 tokens over 3 ranks in chunks of 100"),
        "{out}"
    );
    assert!(out.contains("of ring attention's"), "{out}");
    let one = ok(&[
        "shard",
        "--builtin",
        "causal",
        "--q-len",
        "256",
        "--ranks",
        "1",
    ]);
    assert!(one.contains("256 tokens over 1 rank in chunks"), "{one}");
    assert_eq!(
        out.lines()
            .filter(|l| l.trim_start().starts_with(['0', '1', '2']))
            .count(),
        3
    );
}

#[test]
fn what_cannot_be_sharded_is_named() {
    fails(
        &[
            "shard",
            "--builtin",
            "causal",
            "--q-len",
            "100",
            "--ranks",
            "8",
            "--chunk",
            "64",
        ],
        &["fewer than ranks = 8", "at most 12"],
    );
    fails(
        &[
            "shard",
            "--builtin",
            "causal",
            "--q-len",
            "100",
            "--ranks",
            "0",
        ],
        &["invalid value '0' for '--ranks", "not in 1..=4294967295"],
    );
    fails(
        &[
            "shard",
            "--builtin",
            "causal",
            "--q-len",
            "100",
            "--kv-len",
            "120",
            "--ranks",
            "2",
        ],
        &["q_len = 100 and kv_len = 120 differ"],
    );
    // The biases are refused, each for its own reason (they read positions a part
    // renumbers); softcaps and sinks are carried, so their plans shard as their masks do.
    for (name, reason) in [
        (
            "causal_alibi",
            "the linear bias reads the positions q and k, which a part renumbers",
        ),
        (
            "t5_relative_bias",
            "the bias table reads the distance q - k, which a part renumbers",
        ),
    ] {
        fails(
            &["shard", "--builtin", name, "--q-len", "1000", "--ranks", "2"],
            &[
                "the plan has score terms that context parallelism does not carry into a rank's parts: ",
                reason,
            ],
        );
    }
    let args = |name: &'static str| {
        [
            "shard",
            "--builtin",
            name,
            "--q-len",
            "1000",
            "--ranks",
            "2",
            "--json",
        ]
    };
    // The softcap's mask is causal: the same deal.
    assert_eq!(
        json(&args("causal_softcap"))["per_rank"],
        json(&args("causal"))["per_rank"]
    );
    let sinks = json(&args("sliding_window_sinks"));
    assert!(
        sinks["max_over_mean_visible"].as_f64().unwrap() < 1.1,
        "{sinks}"
    );
}

/// Without `--chunk` the chunk is the largest of 512, 256, 128, 64 leaving 4 chunks per
/// rank, else 64, or q_len / ranks when 64 leaves fewer chunks than ranks (as Python's
/// `ContextParallel`, `cm_shard::default_chunk`): 1000 tokens over 2 ranks in chunks of 128
/// balance (512 gave 2 chunks, the split by positions' 1.5x), 4096 over 2 keep 512, 200 over
/// 5 take 40.
#[test]
fn the_default_chunk_gives_the_deal_room() {
    let shard = |q_len: &str, ranks: &str| {
        json(&[
            "shard",
            "--builtin",
            "causal",
            "--q-len",
            q_len,
            "--ranks",
            ranks,
            "--json",
        ])
    };
    let v = shard("1000", "2");
    assert_eq!(v["chunk"], 128, "{v}");
    assert!(v["max_over_mean_visible"].as_f64().unwrap() < 1.02, "{v}");
    assert!(v["position_split_max_over_mean_visible"].as_f64().unwrap() > 1.4);
    let v = shard("4096", "2");
    let tokens: u64 = v["per_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(tokens, 4096);
    assert_eq!(v["chunk"], 512, "{v}");
    assert_eq!(shard("4096", "8")["chunk"], 128);
    assert_eq!(shard("200", "5")["chunk"], 40);
    let out = ok(&[
        "shard",
        "--builtin",
        "causal",
        "--q-len",
        "1000",
        "--ranks",
        "3",
    ]);
    assert!(
        out.contains("1000 tokens over 3 ranks in chunks of 64"),
        "{out}"
    );
    // The help states the rule.
    let help = ok(&["shard", "--help"]);
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains(
            "the largest of 512, 256, 128 and 64 that cuts q_len into at least 4 chunks per rank"
        ),
        "{help}"
    );
}
