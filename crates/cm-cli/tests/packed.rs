//! `--cu-seqlens-q` / `--cu-seqlens-k` (packed samples) on `plan`, `intervals`, `show` and
//! `export`: packed rows equal each sample's own `intervals` shifted into place, statistics
//! sum over the samples, and every bad input exits non-zero with a clear message.

mod common;

use common::*;

use serde_json::json;

fn scratch(test: &str) -> std::path::PathBuf {
    common::scratch("cli-packed", test)
}

/// `intervals --json` rows of `args`, as `(q, [[start, end], ...])`.
fn rows(args: &[&str]) -> Vec<Vec<(u64, u64)>> {
    let v = json(args);
    v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["intervals"]
                .as_array()
                .unwrap()
                .iter()
                .map(|iv| (iv[0].as_u64().unwrap(), iv[1].as_u64().unwrap()))
                .collect()
        })
        .collect()
}

/// The mask arguments of each case: a built-in with parameters.
const MASKS: &[&[&str]] = &[
    &["--builtin", "causal"],
    &["--builtin", "causal_bottom_right"],
    &["--builtin", "sliding_window", "--set", "window=3"],
    &["--builtin", "document_causal", "--set", "lengths=4,0,3"],
];

#[test]
fn packed_rows_are_each_samples_rows_shifted() {
    // (query lengths, key lengths): equal, unequal both ways, empty samples.
    let cases: &[(&[i64], &[i64])] = &[
        (&[5, 7], &[5, 7]),
        (&[3, 0, 6, 2], &[4, 2, 0, 9]),
        (&[1, 11], &[6, 3]),
    ];
    for mask in MASKS {
        for (lq, lk) in cases {
            let prefix = |l: &[i64]| {
                let mut cu = vec![0i64];
                for x in l {
                    cu.push(cu[cu.len() - 1] + x);
                }
                cu
            };
            let (cu_q, cu_k) = (prefix(lq), prefix(lk));
            let join = |cu: &[i64]| cu.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
            let (sq, sk) = (join(&cu_q), join(&cu_k));
            let total_q = cu_q[cu_q.len() - 1];
            let range = format!("0:{total_q}");
            let mut args: Vec<&str> = vec!["intervals"];
            args.extend_from_slice(mask);
            args.extend_from_slice(&[
                "--cu-seqlens-q",
                &sq,
                "--cu-seqlens-k",
                &sk,
                "--rows",
                &range,
                "--json",
            ]);
            let packed = rows(&args);
            let mut plan_args: Vec<&str> = vec!["plan"];
            plan_args.extend_from_slice(mask);
            plan_args.extend_from_slice(&["--cu-seqlens-q", &sq, "--cu-seqlens-k", &sk, "--json"]);
            let stats = json(&plan_args);
            let mut visible = 0u64;
            for b in 0..lq.len() {
                let (q0, k0) = (cu_q[b] as usize, cu_k[b] as u64);
                let (n, m) = (lq[b], lk[b]);
                if n == 0 {
                    continue;
                }
                let want: Vec<Vec<(u64, u64)>> = if m == 0 {
                    vec![vec![]; n as usize]
                } else {
                    let (ns, ms, r) = (n.to_string(), m.to_string(), format!("0:{n}"));
                    let mut own: Vec<&str> = vec!["intervals"];
                    own.extend_from_slice(mask);
                    own.extend_from_slice(&[
                        "--q-len", &ns, "--kv-len", &ms, "--rows", &r, "--json",
                    ]);
                    rows(&own)
                        .into_iter()
                        .map(|row| row.into_iter().map(|(s, e)| (s + k0, e + k0)).collect())
                        .collect()
                };
                visible += want.iter().flatten().map(|(s, e)| e - s).sum::<u64>();
                assert_eq!(
                    &packed[q0..q0 + n as usize],
                    &want[..],
                    "{mask:?} {sq} / {sk}: sample {b}"
                );
            }
            assert_eq!(stats["q_len"], json!(total_q));
            assert_eq!(stats["kv_len"], json!(cu_k[cu_k.len() - 1]));
            assert_eq!(stats["batch"], json!(1));
            assert_eq!(stats["samples"], json!(lq.len()));
            assert_eq!(stats["cu_seqlens_q"], json!(cu_q));
            assert_eq!(stats["cu_seqlens_k"], json!(cu_k));
            assert_eq!(
                stats["visible_pairs"],
                json!(visible),
                "{mask:?} {sq} / {sk}"
            );
        }
    }
}

/// The human report lists short offsets whole and long ones by their ends and count (a
/// million samples printed a 17 MB line); `--json` keeps every entry.
#[test]
fn the_report_abbreviates_long_offsets() {
    let short = ok(&["plan", "--builtin", "causal", "--cu-seqlens-q", "0,5,12"]);
    assert!(
        short.contains("2 samples, cu_seqlens_q [0, 5, 12], cu_seqlens_k [0, 5, 12]"),
        "{short}"
    );
    let cu: Vec<String> = (0..=40).map(|i| (3 * i).to_string()).collect();
    let cu = cu.join(",");
    let long = ok(&["plan", "--builtin", "causal", "--cu-seqlens-q", &cu]);
    assert!(
        long.contains("40 samples, cu_seqlens_q [0, 3, 6, 9, ..., 117, 120] (41 entries)"),
        "{long}"
    );
    let v = json(&[
        "plan",
        "--builtin",
        "causal",
        "--cu-seqlens-q",
        &cu,
        "--json",
    ]);
    assert_eq!(v["cu_seqlens_q"].as_array().unwrap().len(), 41);
}

#[test]
fn cu_seqlens_k_defaults_to_q_and_files_work() {
    let dir = scratch("files");
    let path = dir.join("cu.txt");
    std::fs::write(&path, "0, 5\n12\n").unwrap();
    let at = format!("@{}", path.to_str().unwrap());
    let a = json(&[
        "plan",
        "--builtin",
        "causal",
        "--cu-seqlens-q",
        "0,5,12",
        "--json",
    ]);
    let b = json(&[
        "plan",
        "--builtin",
        "causal",
        "--cu-seqlens-q",
        &at,
        "--json",
    ]);
    for v in [&a, &b] {
        assert_eq!(v["cu_seqlens_k"], json!([0, 5, 12]));
        assert_eq!(v["visible_pairs"], json!(15 + 28));
    }
    // Heads: a per-head mask gets one packed mask per head.
    let src = dir.join("heads.cmask");
    std::fs::write(&src, "mask = q - h <= k & k <= q;\n").unwrap();
    let v = json(&[
        "plan",
        src.to_str().unwrap(),
        "--cu-seqlens-q",
        "0,5,12",
        "--num-heads",
        "3",
        "--json",
    ]);
    assert_eq!(v["distinct_masks"], json!(3));
    assert_eq!(v["num_heads"], json!(3));
    let r = rows(&[
        "intervals",
        src.to_str().unwrap(),
        "--cu-seqlens-q",
        "0,5,12",
        "--num-heads",
        "3",
        "--h",
        "2",
        "--rows",
        "5:8",
        "--json",
    ]);
    assert_eq!(r, vec![vec![(5, 6)], vec![(5, 7)], vec![(5, 8)]]);
    // Text output names the packing.
    let text = ok(&["plan", "--builtin", "causal", "--cu-seqlens-q", "0,5,12"]);
    assert!(text.contains("packed          2 samples"), "{text}");
}

#[test]
fn show_and_export_a_packed_plan() {
    let dir = scratch("show");
    let png = dir.join("packed.png");
    let out = ok(&[
        "show",
        "--builtin",
        "causal",
        "--cu-seqlens-q",
        "0,5,12",
        "--cu-seqlens-k",
        "0,3,12",
        "-o",
        png.to_str().unwrap(),
    ]);
    assert!(out.contains("wrote"), "{out}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let v = json(&[
        "export",
        "--builtin",
        "causal",
        "--cu-seqlens-q",
        "0,2,3",
        "--format",
        "dense",
    ]);
    assert_eq!(v["mask"], json!([[1, 0, 0], [1, 1, 0], [0, 0, 1]]));
}

#[test]
fn bad_packings_fail_clearly() {
    let base = ["plan", "--builtin", "causal"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        v
    };
    fails(
        &with(&["--cu-seqlens-q", "0,5,3"]),
        &["CM0409", "decreases at index 2"],
    );
    fails(
        &with(&["--cu-seqlens-q", "1,5"]),
        &["CM0409", "must start at 0"],
    );
    fails(
        &with(&["--cu-seqlens-q", "0,5", "--cu-seqlens-k", "0,4,5"]),
        &["CM0409", "2 entries but cu_seqlens_k has 3"],
    );
    fails(
        &with(&["--cu-seqlens-q", "0,5,x"]),
        &["CM0409", "entry 2, `x`, is not an integer"],
    );
    fails(&with(&["--cu-seqlens-q", ""]), &["CM0409", "is empty"]);
    fails(&with(&["--cu-seqlens-q", "0"]), &["CM0409", "1 entry"]);
    fails(
        &with(&["--cu-seqlens-q", "0,0,0"]),
        &["CM0409", "0 queries"],
    );
    fails(
        &with(&["--cu-seqlens-q", "0,99999999999"]),
        &["CM0409", "2^26"],
    );
    fails(
        &with(&["--cu-seqlens-q", "0,99999999999999999999"]),
        &["CM0409", "outside the 64-bit integer range"],
    );
    fails(
        &with(&["--cu-seqlens-q", "0,5", "--q-len", "5"]),
        &["cannot be used with"],
    );
    fails(
        &with(&["--cu-seqlens-q", "0,5", "--batch", "2"]),
        &["cannot be used with"],
    );
    fails(&with(&[]), &["--q-len"]);
    fails(
        &with(&["--cu-seqlens-q", "0,5", "--order", "auto"]),
        &["CM0410", "token orders are not supported"],
    );
    fails(
        &with(&["--cu-seqlens-q", "0,5", "--set", "window=2"]),
        &["CM0309"],
    );
    fails(
        &with(&["--cu-seqlens-q", "@/nonexistent/cu.txt"]),
        &["cannot read"],
    );
    // Per-sample errors name the sample.
    fails(
        &[
            "plan",
            "--builtin",
            "sliding_window",
            "--set",
            "window=0",
            "--cu-seqlens-q",
            "0,0,4",
        ],
        &["CM0305", "packed sample b = 1: q_len = 4, kv_len = 4"],
    );
    fails(
        &[
            "intervals",
            "--builtin",
            "causal",
            "--cu-seqlens-q",
            "0,5,12",
            "--rows",
            "0:3",
            "--b",
            "1",
        ],
        &["--b must be 0", "sample 1 is rows 5:12"],
    );
    fails(
        &[
            "intervals",
            "--builtin",
            "causal",
            "--cu-seqlens-q",
            "0,5,12",
            "--rows",
            "0:13",
        ],
        &["out of range"],
    );
}
