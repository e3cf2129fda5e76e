//! The `compilemask` binary end to end: every bad input exits non-zero with a clear
//! message and never panics; the happy paths follow docs/design.md's contracts (plan --json
//! fields, intervals --json format, --set from @file, show writes a PNG, exports parse).

mod common;

use common::*;

use serde_json::{json, Value};

/// A scratch folder per test.
fn scratch(test: &str) -> std::path::PathBuf {
    common::scratch("cli", test)
}

/// Deterministic pseudo-random bytes.
fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

// ---- check ------------------------------------------------------------------------------

#[test]
fn check_exits_0_on_a_good_file() {
    let dir = scratch("check_good");
    let f = write(&dir, "good.cmask", "# causal\nmask = k <= q;\n");
    let out = ok(&["check", &f]);
    assert!(out.starts_with("ok: "), "{out}");
    assert!(out.contains("parameters: none"), "{out}");
    let f = write(
        &dir,
        "params.cmask",
        "param window: int = 4;\nparam lens: [int] = [3];\nsegments d = lens;\nmask = k in d(q) & q - window < k <= q;\n",
    );
    let out = ok(&["check", &f]);
    assert!(
        out.contains("window: int") && out.contains("lens: [int]"),
        "{out}"
    );
}

#[test]
fn check_exits_1_on_a_bad_file() {
    let dir = scratch("check_bad");
    let f = write(&dir, "bad.cmask", "mask = k <= q\n");
    let o = run(&["check", &f]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    // The end of input, after the line break: the header and the note agree.
    assert!(
        err.contains("CM0104") && err.contains("[ ") && err.matches("bad.cmask:2:1").count() == 2,
        "{err}"
    );
    assert!(!err.contains("panicked"));
}

#[test]
fn check_warns_but_succeeds() {
    let dir = scratch("check_warn");
    let f = write(&dir, "warn.cmask", "let unused = 3;\nmask = k <= q;\n");
    let o = run(&["check", &f]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("CM0250"));
    assert!(
        stdout(&o).contains("(1 warning; parameters"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn check_missing_file() {
    fails(&["check", "/nonexistent/mask.cmask"], &["cannot read"]);
}

// ---- bad inputs ----------------------------------------------------------------------------

#[test]
fn random_bytes_never_panic() {
    let dir = scratch("random_bytes");
    for seed in 0..24u64 {
        let mut bytes = random_bytes(seed, 64 + 37 * seed as usize);
        if seed % 2 == 1 {
            // Printable garbage gets past the UTF-8 check into the lexer and parser.
            let alphabet = b" \n\tqk<=;()[]{}+-*/%#\"abcmaskparamlet0123456789.,:=!&|";
            for b in &mut bytes {
                *b = alphabet[(*b as usize) % alphabet.len()];
            }
        }
        let f = write(&dir, &format!("r{seed}.cmask"), &bytes);
        fails(&["check", &f], &[]);
        fails(&["plan", &f, "--q-len", "16"], &[]);
    }
}

#[test]
fn bad_utf8() {
    let dir = scratch("bad_utf8");
    let f = write(&dir, "latin1.cmask", b"mask = k <= q; # caf\xe9\n");
    fails(&["check", &f], &["CM0100", "not valid UTF-8", "offset 20"]);
    fails(&["plan", &f, "--q-len", "4"], &["CM0100"]);
}

#[test]
fn syntax_errors() {
    let dir = scratch("syntax");
    let deep = format!("mask = {}q{};", "(".repeat(200), ")".repeat(200));
    for (src, code) in [
        ("mask = k <= q $;", "CM0101"),
        ("require true else \"open;\nmask = k <= q;", "CM0102"),
        ("mask = k <= 99999999999999999999;", "CM0103"),
        ("mask = k <= ;", "CM0104"),
        (deep.as_str(), "CM0105"),
        ("window = 3;\nmask = k <= q;", "CM0106"),
        ("", "CM0205"),
    ] {
        let f = write(&dir, "s.cmask", src);
        fails(&["check", &f], &[code]);
        fails(&["plan", &f, "--q-len", "8"], &[code]);
    }
}

#[test]
fn unknown_names() {
    let dir = scratch("unknown_names");
    let f = write(
        &dir,
        "u.cmask",
        "param window: int = 4;\nmask = q - windw < k <= q;\n",
    );
    fails(
        &["check", &f],
        &[
            "CM0201",
            "unknown name `windw`",
            "did you mean `window`?",
            "u.cmask:2:12",
        ],
    );
}

#[test]
fn unknown_builtin() {
    fails(
        &["plan", "--builtin", "causl", "--q-len", "8"],
        &["CM0201", "unknown built-in mask `causl`", "causal", "hstu"],
    );
}

#[test]
fn unknown_or_ill_typed_parameters() {
    let dir = scratch("params");
    fails(
        &[
            "plan",
            "--builtin",
            "sliding_window",
            "--q-len",
            "8",
            "--set",
            "windw=3",
        ],
        &[
            "CM0309",
            "unknown parameter `windw`",
            "did you mean `window`?",
        ],
    );
    fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--q-len",
            "8",
            "--set",
            "x=3",
        ],
        &["CM0309", "takes no parameters"],
    );
    fails(
        &[
            "plan",
            "--builtin",
            "sliding_window",
            "--q-len",
            "8",
            "--set",
            "window=abc",
        ],
        &["--set window", "`abc` is not an integer"],
    );
    fails(
        &[
            "plan",
            "--builtin",
            "sliding_window",
            "--q-len",
            "8",
            "--set",
            "window=1,2",
        ],
        &["CM0308", "`window` is an integer, got a list"],
    );
    // One integer is accepted as a one-element array.
    let out = run(&[
        "plan",
        "--builtin",
        "document_causal",
        "--q-len",
        "8",
        "--set",
        "lengths=4",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Files after `@` are named once, by the reader: no context repeating it.
    for args in [
        &["--q-len", "8", "--set", "lengths=@missing_file"][..],
        &["--cu-seqlens-q", "@missing_file"][..],
    ] {
        let err = fails(
            &[&["plan", "--builtin", "document_causal"][..], args].concat(),
            &["cannot read", "missing_file"],
        );
        assert_eq!(err.matches("missing_file").count(), 1, "{err}");
    }
    let bad = write(&dir, "bad_lengths.txt", "4 four 4\n");
    let bad_set = format!("lengths=@{bad}");
    // Each --set of a built-in at q_len 8, and what its error must say.
    for (builtin, set, expected) in [
        (
            "document_causal",
            "lengths=@missing_file",
            &["cannot read the --set lengths file `missing_file`: "][..],
        ),
        (
            "document_causal",
            bad_set.as_str(),
            &["--set lengths", "entry 1, `four`, is not an integer"][..],
        ),
        ("document_causal", "lengths", &["expected NAME=VALUE"][..]),
        // An empty name was reported as "unknown parameter ``".
        (
            "document_causal",
            "=3",
            &["--set `=3`: the parameter name before `=` is empty"][..],
        ),
        (
            "document_causal",
            "lengths=3,-1",
            &["CM0307", "negative"][..],
        ),
        ("document_causal", "lengths=0,0", &["CM0306"][..]),
        ("document_causal", "lengths=1,,2", &["lengths"][..]),
        (
            "sliding_window",
            "window=0",
            &["CM0305", "window must be >= 1, got 0"][..],
        ),
        (
            "sliding_window",
            "window=99999999999999999999",
            &["outside the 64-bit integer range"][..],
        ),
    ] {
        fails(
            &["plan", "--builtin", builtin, "--q-len", "8", "--set", set],
            expected,
        );
    }
    let f = write(
        &dir,
        "nodefault.cmask",
        "param w: int;\nmask = q - w < k <= q;\n",
    );
    fails(
        &["plan", &f, "--q-len", "8"],
        &["CM0308", "has no default and no value", "--set w="],
    );
}

#[test]
fn largest_batch_and_heads_do_not_abort() {
    let o = run(&[
        "plan",
        "--builtin",
        "causal",
        "--q-len",
        "8",
        "--batch",
        "1048576",
        "--num-heads",
        "65536",
        "--json",
    ]);
    assert!(
        matches!(o.status.code(), Some(0) | Some(1)),
        "status {:?}:\n{}",
        o.status,
        stderr(&o)
    );
}

#[test]
fn export_dense_above_the_limit_has_a_code() {
    fails(
        &[
            "export",
            "--builtin",
            "causal",
            "--q-len",
            "20000",
            "--format",
            "dense",
        ],
        &["CM0403"],
    );
}

#[test]
fn bad_lengths() {
    for (flag, v, name) in [
        ("--q-len", "0", "q_len = 0"),
        ("--q-len", "-5", "q_len = -5"),
        ("--q-len", "99999999999999", "q_len = 99999999999999"),
        ("--kv-len", "0", "kv_len = 0"),
        ("--kv-len", "-1", "kv_len = -1"),
        ("--kv-len", "67108865", "kv_len = 67108865"),
        ("--batch", "0", "batch = 0"),
        ("--num-heads", "-1", "num_heads = -1"),
    ] {
        let mut args = vec!["plan", "--builtin", "causal"];
        if flag != "--q-len" {
            args.extend(["--q-len", "8"]);
        }
        args.extend([flag, v]);
        let limit = match flag {
            "--batch" => "1048576",
            "--num-heads" => "65536",
            _ => "67108864",
        };
        fails(&args, &["CM0402", name, "out of range", limit]);
    }
    // Beyond i64: rejected by the argument parser (exit 2), no panic.
    fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--q-len",
            "99999999999999999999999",
        ],
        &["--q-len"],
    );
    fails(
        &["plan", "--builtin", "causal", "--q-len", "ten"],
        &["--q-len"],
    );
    fails(&["plan", "--builtin", "causal"], &["--q-len"]);
}

#[test]
fn bad_row_ranges() {
    let base = ["intervals", "--builtin", "causal", "--q-len", "10"];
    for rows in [
        "5:3",
        "0:0",
        "a:b",
        "3",
        "-1:2",
        ":4",
        "2:",
        "0:99999999999",
    ] {
        let arg = format!("--rows={rows}");
        let mut args = base.to_vec();
        args.push(&arg);
        fails(&args, &["not a row range", "A:B"]);
    }
    // A value after a space that starts with '-' reaches the range parser too, not clap's
    // "unexpected argument".
    let mut args = base.to_vec();
    args.extend(["--rows", "-1:2"]);
    fails(&args, &["not a row range", "-1:2"]);
    for rows in ["0:11", "10:12"] {
        let arg = format!("--rows={rows}");
        let mut args = base.to_vec();
        args.push(&arg);
        fails(&args, &["out of range", "q_len = 10"]);
    }
    fails(&base, &["--rows"]);
}

#[test]
fn bad_tile_shapes() {
    for tile in [
        "0x5",
        "5x0",
        "5",
        "128x",
        "x",
        "-1x4",
        "1x99999999999",
        "4x4x4",
        "ax4",
    ] {
        let arg = format!("--tile={tile}");
        fails(
            &["plan", "--builtin", "causal", "--q-len", "10", &arg],
            &["not a tile shape", "BLOCK_MxBLOCK_N"],
        );
    }
}

#[test]
fn clear_without_a_grid_names_the_nearest_lengths() {
    fails(
        &[
            "plan",
            "--builtin",
            "clear",
            "--q-len",
            "40",
            "--set",
            "text=3",
            "--set",
            "radius=3",
        ],
        &["CM0305", "q_len = 40", "nearest valid lengths: 39 and 52"],
    );
    fails(
        &["plan", "--builtin", "clear", "--q-len", "33000"],
        &["CM0305", "nearest valid lengths: 32912 and 33273"],
    );
}

#[test]
fn export_dense_above_the_limit() {
    fails(
        &[
            "export",
            "--builtin",
            "causal",
            "--q-len",
            "20000",
            "--format",
            "dense",
        ],
        &["20000 x 20000", "CM0403", "too large"],
    );
}

#[test]
fn export_flex_block_table_above_the_limit() {
    // Flex's dense [num_m_blocks, num_n_blocks] tables would hold 4e8 entries; the CLI
    // refuses before planning.
    let dir = scratch("flex_limit");
    let f = write(&dir, "diag.cmask", "mask = k == q;\n");
    fails(
        &[
            "export", &f, "--q-len", "20000", "--tile", "1x1", "--format", "flex",
        ],
        &["block table", "20000 x 20000", "CM0403", "too large"],
    );
}

#[test]
fn export_flashmask_not_expressible() {
    let dir = scratch("flashmask");
    // Column 0 is visible, hidden, visible, hidden: three masked runs.
    let f = write(&dir, "stripes.cmask", "mask = q % 2 == 0;\n");
    fails(
        &["export", &f, "--q-len", "6", "--format", "flashmask"],
        &["FlashMask cannot express this mask", "column 0"],
    );
}

#[test]
fn intervals_batch_and_head_out_of_range() {
    fails(
        &[
            "intervals",
            "--builtin",
            "causal",
            "--q-len",
            "10",
            "--rows",
            "0:2",
            "--b",
            "1",
        ],
        &["out of range", "batch = 1"],
    );
    fails(
        &[
            "intervals",
            "--builtin",
            "causal",
            "--q-len",
            "10",
            "--rows",
            "0:2",
            "--num-heads",
            "2",
            "--h",
            "2",
        ],
        &["out of range", "num_heads = 2"],
    );
    fails(
        &[
            "intervals",
            "--builtin",
            "causal",
            "--q-len",
            "10",
            "--rows=0:2",
            "--b=-1",
        ],
        &["--b"],
    );
}

#[test]
fn plan_time_errors_are_rendered_against_the_source() {
    let dir = scratch("plan_errors");
    let f = write(
        &dir,
        "div.cmask",
        "param c: int = 0;\nmask = k / c == q / c;\n",
    );
    fails(
        &["plan", &f, "--q-len", "8"],
        &["CM0301", "division by zero", "div.cmask:2:"],
    );
    let f = write(
        &dir,
        "grid.cmask",
        "grid img = [2, 2] at 2;\nmask = k <= img.x(q);\n",
    );
    fails(
        &["intervals", &f, "--q-len", "6", "--rows", "0:1"],
        &["CM0310", "not in grid `img`"],
    );
}

#[test]
fn unwritable_outputs() {
    fails(
        &[
            "show",
            "--builtin",
            "causal",
            "--q-len",
            "8",
            "-o",
            "/nonexistent/dir/x.png",
        ],
        &["cannot write", "/nonexistent/dir/x.png"],
    );
    fails(
        &[
            "export",
            "--builtin",
            "causal",
            "--q-len",
            "8",
            "--format",
            "cudnn",
            "-o",
            "/nonexistent/dir/x.json",
        ],
        &["cannot write"],
    );
}

#[test]
fn no_arguments_and_unknown_subcommands() {
    fails(&[], &["Usage"]);
    fails(&["frobnicate"], &["frobnicate"]);
    // Neither a file nor --builtin (the message names only <FILE>; see the report).
    fails(&["plan", "--q-len", "8"], &["--builtin NAME"]);
    fails(
        &[
            "export",
            "--builtin",
            "causal",
            "--q-len",
            "8",
            "--format",
            "png",
        ],
        &["png"],
    );
}

// ---- happy paths ------------------------------------------------------------------------------

#[test]
fn plan_json_fields_and_types() {
    let v = json(&["plan", "--builtin", "causal", "--q-len", "1000", "--json"]);
    let o = v.as_object().expect("one JSON object");
    for key in [
        "q_len",
        "kv_len",
        "visible_pairs",
        "empty_rows",
        "max_intervals_per_row",
        "computed_pairs",
        "descriptor_bytes",
    ] {
        assert!(
            o[key].is_u64(),
            "{key} is not a non-negative integer: {}",
            o[key]
        );
    }
    assert!(o["compile_ms"].is_number() && o["compile_ms"].as_f64().unwrap() >= 0.0);
    let tiles = o["tiles"].as_object().expect("tiles is an object");
    for key in ["full", "partial", "empty"] {
        assert!(tiles[key].is_u64(), "tiles.{key}");
    }
    // Causal at 1000 with 128 x 128 tiles: 8 x 8 tiles, 8 diagonal ones partial.
    assert_eq!(o["q_len"], 1000);
    assert_eq!(o["kv_len"], 1000);
    assert_eq!(o["visible_pairs"], 1000 * 1001 / 2);
    assert_eq!(o["empty_rows"], 0);
    assert_eq!(o["max_intervals_per_row"], 1);
    assert_eq!(tiles["full"], 28);
    assert_eq!(tiles["partial"], 8);
    assert_eq!(tiles["empty"], 28);
    // Work: every tile on or below the diagonal, edge tiles by in-range pairs.
    let side = |i: u64| if i == 7 { 1000 - 7 * 128 } else { 128 };
    let computed: u64 = (0..8u64)
        .flat_map(|m| (0..=m).map(move |n| side(m) * side(n)))
        .sum();
    assert_eq!(o["computed_pairs"], computed);
    assert!(o["descriptor_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn plan_json_follows_lengths_tiles_and_parameters() {
    let v = json(&[
        "plan",
        "--builtin",
        "sliding_window",
        "--q-len",
        "100",
        "--kv-len",
        "100",
        "--tile",
        "16x32",
        "--set",
        "window=10",
        "--json",
    ]);
    // Rows see min(q + 1, 10) keys.
    let visible: u64 = (0..100u64).map(|q| (q + 1).min(10)).sum();
    assert_eq!(v["visible_pairs"], visible);
    assert_eq!(v["tile"], json!([16, 32]));
    let t = &v["tiles"];
    let total =
        t["full"].as_u64().unwrap() + t["partial"].as_u64().unwrap() + t["empty"].as_u64().unwrap();
    assert_eq!(total, 7 * 4);
    // Bottom-right causal with q_len > kv_len: empty rows are counted.
    let v = json(&[
        "plan",
        "--builtin",
        "causal_bottom_right",
        "--q-len",
        "5",
        "--kv-len",
        "2",
        "--json",
    ]);
    assert_eq!(v["empty_rows"], 3);
    assert_eq!(v["visible_pairs"], 3);
}

#[test]
fn plan_text_output() {
    let out = ok(&[
        "plan",
        "--builtin",
        "causal",
        "--q-len",
        "10",
        "--tile",
        "4x3",
    ]);
    for needle in [
        "q_len 10 kv_len 10, tile 4x3",
        "visible pairs   55",
        "4 full, 5 partial, 3 empty",
    ] {
        assert!(out.contains(needle), "missing {needle:?}:\n{out}");
    }
}

#[test]
fn bad_tile_shapes_name_the_value() {
    // A leading '-' is the value's, not a flag.
    for bad in ["-1x5", "0x5", "64x", "x"] {
        fails(
            &[
                "plan",
                "--builtin",
                "causal",
                "--q-len",
                "10",
                "--tile",
                bad,
            ],
            &[
                &format!("invalid value '{bad}' for '--tile"),
                "is not a tile shape",
            ],
        );
    }
}

#[test]
fn intervals_json_format() {
    let v = json(&[
        "intervals",
        "--builtin",
        "causal",
        "--q-len",
        "10",
        "--rows",
        "5:6",
        "--json",
    ]);
    assert_eq!(v, json!({"rows": [{"q": 5, "intervals": [[0, 6]]}]}));
    // Multi-interval and empty rows.
    let v = json(&[
        "intervals",
        "--builtin",
        "causal_bottom_right",
        "--q-len",
        "5",
        "--kv-len",
        "2",
        "--rows",
        "2:5",
        "--json",
    ]);
    assert_eq!(
        v,
        json!({"rows": [
            {"q": 2, "intervals": []},
            {"q": 3, "intervals": [[0, 1]]},
            {"q": 4, "intervals": [[0, 2]]}
        ]})
    );
    let v = json(&[
        "intervals",
        "--builtin",
        "shared_prefix",
        "--q-len",
        "13",
        "--set",
        "prompts=3,2",
        "--set",
        "responses=2,1,3,2",
        "--set",
        "group=2",
        "--rows",
        "11:13",
        "--json",
    ]);
    assert_eq!(
        v,
        json!({"rows": [
            {"q": 11, "intervals": [[6, 8], [11, 12]]},
            {"q": 12, "intervals": [[6, 8], [11, 13]]}
        ]})
    );
}

#[test]
fn intervals_text_format() {
    let out = ok(&[
        "intervals",
        "--builtin",
        "causal_bottom_right",
        "--q-len",
        "5",
        "--kv-len",
        "2",
        "--rows",
        "2:5",
    ]);
    assert_eq!(out, "2: (empty)\n3: [0, 1)\n4: [0, 2)\n");
}

#[test]
fn intervals_per_batch_and_head() {
    let dir = scratch("per_batch");
    let f = write(
        &dir,
        "cut.cmask",
        "param n: [int] = [1, 2];\nmask = if q < n[b] then k <= q else k < kv_len;\n",
    );
    let v = json(&[
        "intervals",
        &f,
        "--q-len",
        "4",
        "--batch",
        "2",
        "--b",
        "1",
        "--rows",
        "0:4",
        "--json",
    ]);
    assert_eq!(
        v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["intervals"].clone())
            .collect::<Vec<_>>(),
        vec![
            json!([[0, 1]]),
            json!([[0, 2]]),
            json!([[0, 4]]),
            json!([[0, 4]])
        ]
    );
}

#[test]
fn set_from_file() {
    let dir = scratch("set_file");
    let lens = write(&dir, "lens.txt", "3, 5\n2\n");
    let from_file = json(&[
        "intervals",
        "--builtin",
        "document_causal",
        "--q-len",
        "10",
        "--set",
        &format!("lengths=@{lens}"),
        "--rows",
        "0:10",
        "--json",
    ]);
    let inline = json(&[
        "intervals",
        "--builtin",
        "document_causal",
        "--q-len",
        "10",
        "--set",
        "lengths=3,5,2",
        "--rows",
        "0:10",
        "--json",
    ]);
    assert_eq!(from_file, inline);
    assert_eq!(from_file["rows"][3], json!({"q": 3, "intervals": [[3, 4]]}));
    assert_eq!(
        from_file["rows"][9],
        json!({"q": 9, "intervals": [[8, 10]]})
    );
    let bracketed = json(&[
        "intervals",
        "--builtin",
        "document_causal",
        "--q-len",
        "10",
        "--set",
        "lengths=[3, 5, 2]",
        "--rows",
        "0:10",
        "--json",
    ]);
    assert_eq!(bracketed, inline);
}

/// The plot's origin and pixels per key / row, from `show`'s report.
fn plot_geometry(out: &str) -> ((u32, u32), (f64, f64)) {
    let at = out.split(" at (").nth(1).expect(out);
    let (x, rest) = at.split_once(", ").unwrap();
    let (y, rest) = rest.split_once("), ").unwrap();
    let (sx, rest) = rest.split_once(" x ").unwrap();
    let sy = rest.split_whitespace().next().unwrap();
    (
        (x.parse().unwrap(), y.parse().unwrap()),
        (sx.parse().unwrap(), sy.parse().unwrap()),
    )
}

/// Decodes `path` as an 8-bit RGB PNG: (width, height, pixels).
fn read_png(path: &std::path::Path) -> (u32, u32, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::Cursor::new(std::fs::read(path).unwrap()));
    let mut reader = decoder.read_info().expect("a decodable PNG");
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).expect("image data");
    (info.width, info.height, buf)
}

#[test]
fn show_writes_a_png() {
    let dir = scratch("show");
    // Ten tokens are upscaled to 48 px each; 5000 are drawn at 640 px.
    for (q_len, plot) in [("10", 480u32), ("5000", 640)] {
        let path = dir.join(format!("causal_{q_len}.png"));
        let out = ok(&[
            "show",
            "--builtin",
            "causal",
            "--q-len",
            q_len,
            "-o",
            path.to_str().unwrap(),
        ]);
        assert!(out.contains("wrote"), "{out}");
        assert!(out.contains(&format!("plot {plot}x{plot} at")), "{out}");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        let (w, h, _) = read_png(&path);
        assert!(out.contains(&format!("({w}x{h} pixels;")), "{out}");
        assert!(w > plot && h > plot, "{w}x{h}");
    }
}

#[test]
fn show_writes_svg_and_zooms() {
    let dir = scratch("show_svg");
    let path = dir.join("m.SVG");
    let out = ok(&[
        "show",
        "--builtin",
        "hstu",
        "--q-len",
        "4096",
        "--set",
        "lengths=1024,2048,1024",
        "--rows",
        "900:1100",
        "--cols",
        "0:1100",
        "-o",
        path.to_str().unwrap(),
    ]);
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
    for text in [
        "hstu",
        "q_len 4096 × kv_len 4096",
        "view: rows 900:1100 × keys 0:1100",
        "segments user: 3 segments, 2 in view",
        "data:image/png;base64,",
    ] {
        assert!(svg.contains(text), "{text} missing");
    }
    assert!(out.contains("wrote"), "{out}");
    fails(
        &[
            "show",
            "--builtin",
            "causal",
            "--q-len",
            "8",
            "--rows",
            "4:9",
            "-o",
            path.to_str().unwrap(),
        ],
        &["rows 4:9 is out of range", "q_len = 8"],
    );
    fails(
        &[
            "show",
            "--builtin",
            "causal",
            "--q-len",
            "8",
            "--h",
            "1",
            "-o",
            path.to_str().unwrap(),
        ],
        &["--h 1 is out of range", "num_heads = 1"],
    );
}

/// `-o NAME.html` writes the explorer page: one HTML file with the data and the script
/// inside (the browser test, tests/browser, drives it); other extensions are refused with
/// the three that are accepted.
#[test]
fn show_writes_the_explorer_page() {
    let dir = scratch("show_html");
    let path = dir.join("m.html");
    let out = ok(&[
        "show",
        "--builtin",
        "sliding_window",
        "--q-len",
        "131072",
        "--rows",
        "1000:2000",
        "-o",
        path.to_str().unwrap(),
    ]);
    let page = std::fs::read_to_string(&path).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"), "{}", &page[..100]);
    assert!(
        out.contains(&format!(
            "wrote {} (explorer page, {} bytes",
            path.display(),
            page.len()
        )),
        "{out}"
    );
    for text in [
        "<script id=\"cm-data\"",
        "\"view\":[1000,2000,0,131072]",
        "window.cmExplorer",
    ] {
        assert!(page.contains(text), "{text} missing");
    }
    assert!(!page.contains("https://") && !page.contains("http://"));
    assert!(page.len() < 128 * 1024, "{} bytes", page.len());
    fails(
        &[
            "show",
            "--builtin",
            "causal",
            "--q-len",
            "8",
            "-o",
            dir.join("m.txt").to_str().unwrap(),
        ],
        &[
            ".png or .svg pictures or an .html explorer page",
            "extension .txt",
        ],
    );
}

#[test]
fn export_flex() {
    let v = json(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "10",
        "--tile",
        "4x3",
        "--format",
        "flex",
    ]);
    let (m, n) = (3usize, 4usize);
    let len = |k: &str| v[k].as_array().unwrap_or_else(|| panic!("{k}")).len();
    assert_eq!(v["block_size"], json!([4, 3]));
    assert_eq!(v["seq_lengths"], json!([10, 10]));
    assert_eq!(len("kv_num_blocks"), m);
    assert_eq!(len("full_kv_num_blocks"), m);
    assert_eq!(len("kv_indices"), m * n);
    assert_eq!(len("full_kv_indices"), m * n);
    assert_eq!(len("q_num_blocks"), n);
    assert_eq!(len("full_q_num_blocks"), n);
    assert_eq!(len("q_indices"), n * m);
    assert_eq!(len("full_q_indices"), n * m);
    // Same classes as the golden plan: rows "PP..", "FPP.", "FFFP".
    assert_eq!(v["kv_num_blocks"], json!([2, 2, 1]));
    assert_eq!(v["full_kv_num_blocks"], json!([0, 1, 3]));
    assert_eq!(v["q_num_blocks"], json!([1, 2, 1, 1]));
    assert_eq!(v["full_q_num_blocks"], json!([2, 1, 1, 0]));
}

#[test]
fn export_cudnn() {
    let v = json(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "5",
        "--format",
        "cudnn",
    ]);
    assert_eq!(
        v,
        json!({"nfunc": 1, "endpoints": [1, 2, 3, 4, 5], "b": 0, "h": 0})
    );
    let v = json(&[
        "export",
        "--builtin",
        "shared_prefix",
        "--q-len",
        "13",
        "--set",
        "prompts=3,2",
        "--set",
        "responses=2,1,3,2",
        "--set",
        "group=2",
        "--format",
        "cudnn",
    ]);
    let nfunc = v["nfunc"].as_u64().unwrap() as usize;
    assert_eq!(nfunc % 2, 1, "nfunc is odd");
    assert_eq!(nfunc, 5, "two intervals, one not starting at 0");
    assert_eq!(v["endpoints"].as_array().unwrap().len(), nfunc * 13);
}

#[test]
fn export_flashmask() {
    let v = json(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "5",
        "--kv-len",
        "7",
        "--format",
        "flashmask",
    ]);
    for key in ["lts", "lte", "uts", "ute"] {
        assert_eq!(v[key].as_array().unwrap().len(), 7, "{key}");
    }
    // Column k < 5 is masked for rows [0, k) (upper part); columns 5 and 6 for every row
    // (lower part).
    assert_eq!(v["uts"], json!([0, 0, 0, 0, 0, 0, 0]));
    assert_eq!(v["ute"], json!([0, 1, 2, 3, 4, 0, 0]));
    assert_eq!(v["lts"], json!([0, 0, 0, 0, 0, 0, 0]));
    assert_eq!(v["lte"], json!([0, 0, 0, 0, 0, 5, 5]));
}

#[test]
fn export_dense_and_to_file() {
    let v = json(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "3",
        "--kv-len",
        "4",
        "--format",
        "dense",
    ]);
    assert_eq!(
        v,
        json!({"q_len": 3, "kv_len": 4, "b": 0, "h": 0, "mask": [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]})
    );
    let dir = scratch("export_file");
    let path = dir.join("flex.json");
    let out = ok(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "10",
        "--tile",
        "4x3",
        "--format",
        "flex",
        "-o",
        path.to_str().unwrap(),
    ]);
    assert!(out.is_empty(), "{out}");
    let written: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let printed = json(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "10",
        "--tile",
        "4x3",
        "--format",
        "flex",
    ]);
    assert_eq!(written, printed);
}

#[test]
fn list_names_every_design_builtin() {
    let out = ok(&["list"]);
    for name in [
        "causal",
        "hstu",
        "shared_prefix",
        "clear",
        "sliding_window",
        "document_causal",
        "trace_documents",
        "trace_prompt_groups",
    ] {
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().next() == Some(name)),
            "{name} missing from list:\n{out}"
        );
    }
}

#[test]
fn builtins_plan_with_defaults() {
    // Every listed built-in plans at a length its defaults accept (clear needs text + n^2).
    let out = ok(&["list"]);
    for line in out.lines().filter(|l| !l.starts_with(' ')) {
        let name = line.split_whitespace().next().unwrap();
        let q_len = match name {
            "clear" => "4608",            // 512 + 64^2
            "neighborhood_3d" => "16384", // 16 x 32 x 32
            "tree" => "127",
            _ => "4096",
        };
        let o = run(&["plan", "--builtin", name, "--q-len", q_len, "--json"]);
        let err = stderr(&o);
        assert!(!err.contains("panicked"), "{name} panicked:\n{err}");
        assert!(o.status.success(), "{name} failed:\n{err}");
    }
}

#[test]
fn intervals_stream_many_rows() {
    // 200 000 rows in both formats; the output is written row by row (the JSON is the
    // same document as before streaming).
    let q_len = "200000";
    let v = json(&[
        "intervals",
        "--builtin",
        "causal",
        "--q-len",
        q_len,
        "--rows",
        "0:200000",
        "--json",
    ]);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 200_000);
    assert_eq!(rows[0], json!({"q": 0, "intervals": [[0, 1]]}));
    assert_eq!(
        rows[199_999],
        json!({"q": 199_999, "intervals": [[0, 200_000]]})
    );
    assert_eq!(v.as_object().unwrap().len(), 1, "only `rows` at the top");
    let text = ok(&[
        "intervals",
        "--builtin",
        "causal",
        "--q-len",
        q_len,
        "--rows",
        "199998:200000",
    ]);
    assert_eq!(text, "199998: [0, 199999)\n199999: [0, 200000)\n");
    let text = ok(&[
        "intervals",
        "--builtin",
        "causal",
        "--q-len",
        q_len,
        "--rows",
        "0:200000",
    ]);
    assert_eq!(text.lines().count(), 200_000);
    // Several intervals in a row, and an empty row, in both formats.
    let dir = scratch("intervals_stream");
    let f = write(&dir, "two.cmask", "mask = k < 2 | k == q;\n");
    let v = json(&[
        "intervals",
        &f,
        "--q-len",
        "5",
        "--kv-len",
        "6",
        "--rows",
        "3:5",
        "--json",
    ]);
    assert_eq!(
        v,
        json!({"rows": [
            {"q": 3, "intervals": [[0, 2], [3, 4]]},
            {"q": 4, "intervals": [[0, 2], [4, 5]]}
        ]})
    );
    let f = write(&dir, "none.cmask", "mask = k < q;\n");
    assert_eq!(
        json(&["intervals", &f, "--q-len", "3", "--rows", "0:1", "--json"]),
        json!({"rows": [{"q": 0, "intervals": []}]})
    );
}

#[test]
fn export_per_batch_and_head() {
    let dir = scratch("export_bh");
    let f = write(
        &dir,
        "heads.cmask",
        "param w: [int] = [1, 2];\nparam n: [int] = [0, 2];\nmask = if q < n[b] then k < kv_len else q - w[h] < k <= q;\n",
    );
    let base = [
        "export",
        f.as_str(),
        "--q-len",
        "4",
        "--batch",
        "2",
        "--num-heads",
        "2",
        "--format",
        "dense",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        json(&a)
    };
    let v = with(&["--b", "0", "--h", "0"]);
    assert_eq!((v["b"].clone(), v["h"].clone()), (json!(0), json!(0)));
    assert_eq!(
        v["mask"],
        json!([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    );
    let v = with(&["--h", "1"]);
    assert_eq!((v["b"].clone(), v["h"].clone()), (json!(0), json!(1)));
    assert_eq!(
        v["mask"],
        json!([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
    );
    let v = with(&["--b", "1", "--h", "1"]);
    assert_eq!((v["b"].clone(), v["h"].clone()), (json!(1), json!(1)));
    assert_eq!(
        v["mask"],
        json!([[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 1, 1]])
    );
    // The default is b = 0, h = 0, with a note on stderr that other indices exist.
    let o = run(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v, with(&["--b", "0", "--h", "0"]));
    assert!(stderr(&o).contains("--b / --h"), "{}", stderr(&o));
    // Every format carries b and h and follows them.
    for format in ["flex", "cudnn", "flashmask"] {
        let args = [
            "export",
            f.as_str(),
            "--q-len",
            "4",
            "--batch",
            "2",
            "--num-heads",
            "2",
            "--tile",
            "2x2",
            "--format",
            format,
        ];
        let at = |b: &str, h: &str| {
            let mut a = args.to_vec();
            a.extend_from_slice(&["--b", b, "--h", h]);
            json(&a)
        };
        let (v00, v11) = (at("0", "0"), at("1", "1"));
        assert_eq!((v11["b"].clone(), v11["h"].clone()), (json!(1), json!(1)));
        assert_ne!(v00, v11, "{format}");
    }
    // The same range checks and messages as `intervals`.
    let out_of_range = |extra: &[&str], needles: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        fails(&a, needles);
    };
    out_of_range(
        &["--b", "2"],
        &["--b 2 is out of range", "batch = 2", "0 ..= 1"],
    );
    out_of_range(
        &["--h", "2"],
        &["--h 2 is out of range", "num_heads = 2", "0 ..= 1"],
    );
    out_of_range(&["--b=-1"], &["--b"]);
    fails(
        &[
            "export",
            "--builtin",
            "causal",
            "--q-len",
            "4",
            "--format",
            "cudnn",
            "--h",
            "1",
        ],
        &["--h 1 is out of range", "num_heads = 1"],
    );
    let help = ok(&["export", "--help"]);
    assert!(
        help.contains("--b <B>") && help.contains("--h <H>"),
        "{help}"
    );
}

#[test]
fn export_limits_in_help_and_advice() {
    // The help names the CLI's limit (2^24), and each refusal's advice fits its format.
    let help = ok(&["export", "--help"]);
    assert!(help.contains("2^24"), "{help}");
    assert!(!help.contains("2^28"), "{help}");
    let err = fails(
        &[
            "export",
            "--builtin",
            "causal",
            "--q-len",
            "4097",
            "--format",
            "dense",
        ],
        &["CM0403", "4097 x 4097", "--format cudnn"],
    );
    assert!(
        !err.contains("--tile"),
        "dense advice mentions --tile:\n{err}"
    );
    // 4096 x 4096 = 2^24 is at the limit and allowed.
    let v = json(&[
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "4096",
        "--kv-len",
        "4096",
        "--format",
        "dense",
    ]);
    assert_eq!(v["mask"].as_array().unwrap().len(), 4096);
    fails(
        &[
            "export",
            "--builtin",
            "causal",
            "--q-len",
            "8200",
            "--tile",
            "2x2",
            "--format",
            "flex",
        ],
        &["CM0403", "block table", "4100 x 4100", "larger --tile"],
    );
}

#[test]
fn repeated_set_is_an_error() {
    fails(
        &[
            "plan",
            "--builtin",
            "sliding_window",
            "--q-len",
            "10",
            "--set",
            "window=1",
            "--set",
            "window=2",
        ],
        &["`window`", "given twice", "window=1", "window=2"],
    );
    // Also with spaces around the name, and for arrays.
    fails(
        &[
            "intervals",
            "--builtin",
            "document_causal",
            "--q-len",
            "10",
            "--rows",
            "0:1",
            "--set",
            "lengths=5,5",
            "--set",
            " lengths =3,7",
        ],
        &["`lengths`", "given twice"],
    );
    // Different parameters are fine.
    ok(&[
        "plan",
        "--builtin",
        "clear",
        "--q-len",
        "12",
        "--set",
        "text=3",
        "--set",
        "radius=2",
    ]);
}

#[test]
fn show_colours_pixels_by_tile_class() {
    // Causal 64 x 64 at 16x16 tiles, 10 pixels per token: below the diagonal tiles are
    // full, on it partial, above it empty.
    let dir = scratch("show_colours");
    let path = dir.join("causal.png");
    let out = ok(&[
        "show",
        "--builtin",
        "causal",
        "--q-len",
        "64",
        "--tile",
        "16x16",
        "-o",
        path.to_str().unwrap(),
    ]);
    let ((x0, y0), (sx, sy)) = plot_geometry(&out);
    assert_eq!((sx, sy), (10.0, 10.0), "{out}");
    let (w, _, buf) = read_png(&path);
    let px = |q: u32, k: u32| -> [u8; 3] {
        let (x, y) = (x0 + k * 10 + 5, y0 + q * 10 + 5);
        let i = ((y * w + x) * 3) as usize;
        [buf[i], buf[i + 1], buf[i + 2]]
    };
    let full_visible = px(63, 0);
    let partial_visible = px(0, 0);
    let partial_hidden = px(0, 1);
    let empty = px(0, 63);
    // Visible pixels: dark green in full tiles, dark amber (red > green > blue) in partial.
    assert!(
        full_visible[1] > full_visible[0] && full_visible[1] > full_visible[2],
        "{full_visible:?}"
    );
    assert!(full_visible[1] < 160, "dark: {full_visible:?}");
    assert!(
        partial_visible[0] > partial_visible[1] && partial_visible[1] > partial_visible[2],
        "{partial_visible:?}"
    );
    assert!(partial_visible[2] < 80, "dark amber: {partial_visible:?}");
    assert_ne!(full_visible, partial_visible);
    // Hidden pairs of partial tiles: a light amber tint; empty tiles light grey.
    assert!(
        partial_hidden.iter().all(|&c| c > 150),
        "{partial_hidden:?}"
    );
    assert!(
        partial_hidden[0] > partial_hidden[2] + 40,
        "amber tint: {partial_hidden:?}"
    );
    assert!(
        empty.iter().all(|&c| c > 200) && empty[0] == empty[1] && empty[1] == empty[2],
        "{empty:?}"
    );
    // Every pixel of a full tile is the same dark green.
    assert_eq!(px(40, 5), full_visible);
}

/// The densities of `--order auto` are the (0, 0) mask's, on which the order is chosen: the
/// same at any batch and head count, and equal to that mask's visible pairs over its computed
/// pairs in each order (a density of 1.6 was reported at 4 heads).
#[test]
fn plan_order_auto_densities_do_not_scale_with_batch_and_heads() {
    const ARGS: [&str; 7] = [
        "plan",
        "--builtin",
        "neighborhood_3d",
        "--q-len",
        "16384",
        "--order",
        "auto",
    ];
    let plan = |extra: &[&str]| json(&[&ARGS[..], extra, &["--json"]].concat());
    let one = plan(&[]);
    let visible = one["visible_pairs"].as_f64().unwrap();
    let before = visible / one["order"]["raster_computed_pairs"].as_f64().unwrap();
    let after = visible / one["computed_pairs"].as_f64().unwrap();
    assert!(before > 0.0 && before < after && after <= 1.0, "{one}");
    for extra in [&["--num-heads", "4"][..], &["--batch", "3"][..]] {
        let many = plan(extra);
        for (field, want) in [
            ("tile_density_before", before),
            ("tile_density_after", after),
        ] {
            let got = many["order"][field].as_f64().unwrap();
            assert!(
                (got - want).abs() < 1e-12,
                "{extra:?} {field}: {got} != {want}"
            );
        }
    }
    let text = ok(&[&ARGS[..], &["--num-heads", "4"]].concat());
    assert!(
        text.contains(&format!("tile density {before:.3} in raster order")),
        "{text}"
    );
}

#[test]
fn plan_order_auto_candidates() {
    // A small grid (5 x 5 after 3 text tokens): patch shapes clip to a few distinct ones,
    // raster wins, and the report names raster as the real patch [1, 1, width].
    let v = json(&[
        "plan",
        "--builtin",
        "clear",
        "--q-len",
        "28",
        "--set",
        "text=3",
        "--set",
        "radius=2",
        "--tile",
        "16x16",
        "--order",
        "auto",
        "--json",
    ]);
    let order = &v["order"];
    assert_eq!(order["patch"], json!([1, 1, 5]), "{order}");
    assert_eq!(order["traversal"], json!("rowmajor"), "{order}");
    let cands = order["candidates"].as_array().unwrap();
    let keys: Vec<(Value, Value)> = cands
        .iter()
        .map(|c| (c["patch"].clone(), c["traversal"].clone()))
        .collect();
    let mut unique = keys.clone();
    unique.sort_by_key(|k| k.0.to_string() + &k.1.to_string());
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "duplicate candidates: {keys:?}");
    assert!(keys.contains(&(json!([1, 1, 5]), json!("rowmajor"))));
    for c in cands {
        for e in c["patch"].as_array().unwrap() {
            let e = e.as_u64().unwrap();
            assert!((1..=5).contains(&e), "patch not clipped to the grid: {c}");
        }
    }
    assert_eq!(cands[0]["computed_pairs"], v["computed_pairs"]);
    // 3D: raster is [1, 1, width] too, and the chosen order is one of the candidates.
    let v = json(&[
        "plan",
        "--builtin",
        "neighborhood_3d",
        "--q-len",
        "96",
        "--set",
        "frames=2",
        "--set",
        "height=6",
        "--set",
        "width=8",
        "--set",
        "radius=1",
        "--set",
        "dt_radius=0",
        "--tile",
        "16x16",
        "--order",
        "auto",
        "--json",
    ]);
    let order = &v["order"];
    let cands = order["candidates"].as_array().unwrap();
    assert!(
        cands
            .iter()
            .any(|c| c["patch"] == json!([1, 1, 8]) && c["traversal"] == json!("rowmajor")),
        "{order}"
    );
    assert!(!order.to_string().contains("4294967295"), "{order}");
    assert!(order["patch"].is_array(), "{order}");
    assert_eq!(cands[0]["computed_pairs"], v["computed_pairs"]);
}

/// Decodes each export by the layout docs/exports.md describes and compares it with the
/// dense export.
#[test]
fn exports_decode_as_documented() {
    let dir = scratch("exports_documented");
    let u = |v: &Value| -> Vec<usize> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect()
    };
    let dense_of = |args: &[&str]| -> Vec<Vec<bool>> {
        let mut a = args.to_vec();
        a.extend_from_slice(&["--format", "dense"]);
        let v = json(&a);
        v["mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| u(r).iter().map(|&x| x == 1).collect())
            .collect()
    };
    let export = |args: &[&str], format: &str| -> Value {
        let mut a = args.to_vec();
        a.extend_from_slice(&["--format", format]);
        json(&a)
    };
    let f = write(
        &dir,
        "mix.cmask",
        "mask = k < 2 | k == q | ((q - k) % 3 == 0 & k <= q);\n",
    );
    let g = write(&dir, "band.cmask", "mask = k < 2 | q - 3 < k <= q;\n");
    for (file, kv) in [(&f, "13"), (&f, "9"), (&g, "11")] {
        let args = [
            "export",
            file.as_str(),
            "--q-len",
            "11",
            "--kv-len",
            kv,
            "--tile",
            "3x4",
        ];
        let dense = dense_of(&args);
        let (q_len, kv_len) = (dense.len(), dense[0].len());
        // cuDNN: endpoints [nfunc][q_len] row-major; visible = [0,F0) U [F1,F2) U ...
        let c = export(&args, "cudnn");
        let nfunc = c["nfunc"].as_u64().unwrap() as usize;
        let ends = u(&c["endpoints"]);
        assert_eq!(nfunc % 2, 1);
        assert_eq!(ends.len(), nfunc * q_len);
        for (q, row) in dense.iter().enumerate() {
            let fq: Vec<usize> = (0..nfunc).map(|j| ends[j * q_len + q]).collect();
            assert!(fq.windows(2).all(|w| w[0] <= w[1]), "row {q}: {fq:?}");
            for (k, &vis) in row.iter().enumerate() {
                let mut got = k < fq[0];
                for p in fq[1..].chunks(2) {
                    got |= p[0] <= k && k < p[1];
                }
                assert_eq!(got, vis, "cudnn ({q}, {k})");
            }
        }
        // Flex: counts [M], [N]; index tables [M * N] / [N * M] row-major; each row the
        // counted blocks ascending, then every other block ascending.
        let x = export(&args, "flex");
        let (bm, bn) = (3usize, 4usize);
        let (m_blocks, n_blocks) = (q_len.div_ceil(bm), kv_len.div_ceil(bn));
        let class = |m: usize, n: usize| -> u8 {
            let mut seen = (false, false);
            for row in &dense[m * bm..((m + 1) * bm).min(q_len)] {
                for &vis in &row[n * bn..((n + 1) * bn).min(kv_len)] {
                    if vis {
                        seen.0 = true;
                    } else {
                        seen.1 = true;
                    }
                }
            }
            match seen {
                (false, _) => 0,
                (true, false) => 2,
                (true, true) => 1,
            }
        };
        for (counts, table, rows, cols, want, transposed) in [
            ("kv_num_blocks", "kv_indices", m_blocks, n_blocks, 1, false),
            (
                "full_kv_num_blocks",
                "full_kv_indices",
                m_blocks,
                n_blocks,
                2,
                false,
            ),
            ("q_num_blocks", "q_indices", n_blocks, m_blocks, 1, true),
            (
                "full_q_num_blocks",
                "full_q_indices",
                n_blocks,
                m_blocks,
                2,
                true,
            ),
        ] {
            let (cnt, idx) = (u(&x[counts]), u(&x[table]));
            assert_eq!(cnt.len(), rows, "{counts}");
            assert_eq!(idx.len(), rows * cols, "{table}");
            for r in 0..rows {
                let row = &idx[r * cols..(r + 1) * cols];
                let (listed, rest) = row.split_at(cnt[r]);
                assert!(listed.windows(2).all(|w| w[0] < w[1]), "{table} row {r}");
                assert!(rest.windows(2).all(|w| w[0] < w[1]), "{table} row {r}");
                let mut all = row.to_vec();
                all.sort_unstable();
                assert_eq!(all, (0..cols).collect::<Vec<_>>(), "{table} row {r}");
                for c in 0..cols {
                    let (m, n) = if transposed { (c, r) } else { (r, c) };
                    assert_eq!(
                        listed.contains(&c),
                        class(m, n) == want,
                        "{table} tile ({m}, {n})"
                    );
                }
            }
        }
        assert_eq!(x["block_size"], json!([3, 4]));
        assert_eq!(x["seq_lengths"], json!([q_len, kv_len]));
    }
    // FlashMask: column k is masked for rows [uts, ute) and [lts, lte).
    let args = ["export", g.as_str(), "--q-len", "11", "--kv-len", "11"];
    let dense = dense_of(&args);
    let fm = export(&args, "flashmask");
    let (uts, ute, lts, lte) = (u(&fm["uts"]), u(&fm["ute"]), u(&fm["lts"]), u(&fm["lte"]));
    for (q, row) in dense.iter().enumerate() {
        for (k, &vis) in row.iter().enumerate() {
            let masked = (uts[k] <= q && q < ute[k]) || (lts[k] <= q && q < lte[k]);
            assert_eq!(!masked, vis, "flashmask ({q}, {k})");
        }
    }
}

/// `plan --order-out FILE` writes the order the plan is in: a tree's depth-first preorder
/// under `--order auto` (computed here from the parents), which `--order FILE` plans to the
/// same counts, and the identity when the plan keeps the program's positions.
#[test]
fn plan_order_out_writes_the_permutation() {
    let dir = scratch("order_out");
    // Node 0's children are 3 and 5, node 3's child is 1, node 5's are 2 and 4: parents
    // numbered after some of their children.
    let parents = [-1i64, 3, 5, 0, 5, 0];
    let src = dir.join("tree.cmask");
    std::fs::write(
        &src,
        format!(
            "tree t = [{}];\nmask = k in t.path(q);\n",
            parents.map(|p| p.to_string()).join(", ")
        ),
    )
    .unwrap();
    let out = dir.join("order.txt");
    let read = |p: &std::path::Path| -> Vec<u32> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect()
    };
    let src_s = src.to_str().unwrap();
    let out_s = out.to_str().unwrap();
    // At 2x2 tiles preorder computes 24 pairs, the program's positions 28.
    let base = ["plan", src_s, "--q-len", "6", "--tile", "2x2", "--json"];
    let mut args = base.to_vec();
    args.extend(["--order", "auto", "--order-out", out_s]);
    let auto = json(&args);
    assert_eq!(auto["order"]["traversal"], json!("preorder"), "{auto}");
    assert_eq!(auto["computed_pairs"], json!(24));
    assert_eq!(auto["order"]["raster_computed_pairs"], json!(28));
    assert_eq!(read(&out), vec![0, 3, 1, 5, 2, 4]);
    let mut args = base.to_vec();
    args.extend(["--order", out_s]);
    let again = json(&args);
    assert_eq!(again["computed_pairs"], auto["computed_pairs"]);
    assert_eq!(again["tiles"], auto["tiles"]);
    let mut args = base.to_vec();
    args.extend(["--order-out", out_s]);
    json(&args);
    assert_eq!(read(&out), (0..6).collect::<Vec<u32>>());
}
