//! Problems a fresh user hit, each pinned: `--cu-seqlens-k` without `--cu-seqlens-q`,
//! unbounded file reads, a closed standard error, built-in parameters out of range,
//! misleading limits of `--tile` / `--rows`, floods of diagnostics and `show -o x.jpg`.
//! Every bad input exits 1 or 2 with a message naming the value, never a panic.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

fn scratch(test: &str) -> std::path::PathBuf {
    common::scratch("cli-fresh-user", test)
}

#[test]
fn cu_seqlens_k_needs_cu_seqlens_q() {
    let base = [
        "--builtin",
        "causal",
        "--cu-seqlens-k",
        "0,5,12",
        "--q-len",
        "12",
    ];
    let needles = ["--cu-seqlens-k 0,5,12", "needs --cu-seqlens-q"];
    fails(&[&["plan"][..], &base].concat(), &needles);
    fails(
        &[&["intervals"][..], &base, &["--rows", "0:2"]].concat(),
        &needles,
    );
    let dir = scratch("cu_seqlens_k");
    let png = dir.join("m.png");
    fails(
        &[&["show"][..], &base, &["-o", png.to_str().unwrap()]].concat(),
        &needles,
    );
    assert!(!png.exists());
    fails(
        &[&["export"][..], &base, &["--format", "cudnn"]].concat(),
        &needles,
    );
    // Without --q-len too: clap asked for both --q-len and --cu-seqlens-q, which cannot go
    // together.
    for extra in [&[][..], &["--ranks", "2"]] {
        let command = if extra.is_empty() { "plan" } else { "shard" };
        let args = [
            &[command, "--builtin", "causal", "--cu-seqlens-k", "0,5"][..],
            extra,
        ]
        .concat();
        let e = fails(&args, &needles[1..]);
        assert!(!e.contains("--q-len <Q_LEN>"), "{e}");
    }
    // Both together still plan.
    ok(&[
        "plan",
        "--builtin",
        "causal",
        "--cu-seqlens-q",
        "0,5,12",
        "--cu-seqlens-k",
        "0,5,12",
    ]);
}

/// Every file the CLI reads is capped at 64 MiB, devices and pipes included.
#[test]
fn input_files_are_capped() {
    if !Path::new("/dev/zero").exists() {
        return;
    }
    let z = "/dev/zero";
    fails(&["check", z], &["the mask program `/dev/zero`", "64 MiB"]);
    fails(&["plan", z, "--q-len", "4"], &["`/dev/zero`", "64 MiB"]);
    let causal = ["--builtin", "causal", "--q-len", "4"];
    fails(
        &[&["plan"][..], &causal, &["--set", "x=@/dev/zero"]].concat(),
        &["--set x", "`/dev/zero`", "64 MiB"],
    );
    fails(
        &[&["plan"][..], &causal, &["--order", z]].concat(),
        &["--order", "`/dev/zero`", "64 MiB"],
    );
    fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--cu-seqlens-q",
            "@/dev/zero",
        ],
        &["--cu-seqlens-q", "`/dev/zero`", "64 MiB"],
    );
    fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--cu-seqlens-q",
            "0,4",
            "--cu-seqlens-k",
            "@/dev/zero",
        ],
        &["--cu-seqlens-k", "`/dev/zero`", "64 MiB"],
    );
    // A regular file just over the limit; one at it would still be read.
    let dir = scratch("capped");
    let big = write(&dir, "big.cmask", vec![b' '; (64 << 20) + 1]);
    fails(&["check", &big], &["big.cmask", "64 MiB"]);
}

/// A closed standard error (`2>&1 | head` after head exits) must not panic: the error
/// path ends with exit status 1, silently.
#[cfg(unix)]
#[test]
fn closed_stderr_does_not_panic() {
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;
    use std::process::Stdio;
    for args in [
        &[
            "plan",
            "--builtin",
            "sliding_window",
            "--q-len",
            "10",
            "--set",
            "window=0",
        ][..],
        &["check", "/nonexistent/m.cmask"][..],
    ] {
        // A socket whose peer is closed: every write fails with EPIPE, deterministically.
        let (ours, theirs) = UnixStream::pair().unwrap();
        drop(ours);
        let o = Command::new(BIN)
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::null())
            .stderr(Stdio::from(OwnedFd::from(theirs)))
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}: {:?}", o.status);
    }
}

/// Built-in parameters that divided by zero or were out of range get a `require`.
#[test]
fn builtin_parameters_are_checked() {
    for (builtin, q_len, set, needle) in [
        (
            "hstu",
            "64",
            "target_divisor=0",
            "target_divisor must be >= 1, got 0",
        ),
        (
            "hstu",
            "64",
            "contextual=-1",
            "contextual must be >= 0, got -1",
        ),
        (
            "dilated_window",
            "16",
            "window=0",
            "window must be >= 1, got 0",
        ),
        ("sink_local", "16", "window=0", "window must be >= 1, got 0"),
        ("sink_local", "16", "sink=-1", "sink must be >= 0, got -1"),
        (
            "global_local",
            "16",
            "radius=-1",
            "radius must be >= 0, got -1",
        ),
        (
            "global_local",
            "16",
            "global=-1",
            "global must be >= 0, got -1",
        ),
        (
            "prefix_lm",
            "16",
            "prefix=-1",
            "prefix must be >= 0, got -1",
        ),
        (
            "neighborhood_2d",
            "16",
            "kernel=0",
            "kernel must be >= 1, got 0",
        ),
        (
            "neighborhood_3d",
            "16",
            "radius=-1",
            "radius must be >= 0, got -1",
        ),
        (
            "neighborhood_3d",
            "16",
            "dt_radius=-1",
            "dt_radius must be >= 0, got -1",
        ),
    ] {
        fails(
            &["plan", "--builtin", builtin, "--q-len", q_len, "--set", set],
            &["CM0305", needle],
        );
    }
    // Malformed tree parents: the error names the node and what it needs.
    for (q_len, parents, needle) in [
        ("3", "parents=-1,0,5", "node 2 of tree `t` has parent 5"),
        ("3", "parents=-1,2,1", "tree `t` has a cycle: 1 -> 2 -> 1"),
        ("2", "parents=0,-1", "tree `t` has a cycle: 0 -> 0"),
    ] {
        fails(
            &[
                "plan",
                "--builtin",
                "tree",
                "--q-len",
                q_len,
                "--set",
                parents,
            ],
            &["CM0313", needle],
        );
    }
    // Well-formed trees still plan: a chain, a root with two leaves, a tree in any order.
    for parents in ["parents=-1,0,1", "parents=-1,0,0", "parents=2,2,-1"] {
        ok(&[
            "plan",
            "--builtin",
            "tree",
            "--q-len",
            "3",
            "--set",
            parents,
        ]);
    }
    ok(&["plan", "--builtin", "tree", "--q-len", "64"]);
}

/// Numbers too large for u32 name the limit, not "positive" or "0 <= A < B".
#[test]
fn tile_and_rows_limits() {
    let e = fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--q-len",
            "4",
            "--tile",
            "4294967296x1",
        ],
        &["4294967296", "at most 4294967295"],
    );
    assert!(!e.contains("positive integers"), "{e}");
    fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--q-len",
            "4",
            "--tile",
            "0x128",
        ],
        &["positive integers"],
    );
    let e = fails(
        &[
            "intervals",
            "--builtin",
            "causal",
            "--q-len",
            "4",
            "--rows",
            "0:99999999999999999999",
        ],
        &["99999999999999999999", "at most 4294967295"],
    );
    assert!(!e.contains("0 <= A < B"), "{e}");
}

/// A chain of thousands of errors prints the first 50 and one line counting the rest.
#[test]
fn diagnostics_are_capped() {
    let dir = scratch("flood");
    // 5,000 independent errors (a `let` depth error is reported once, see below).
    let mut src = String::new();
    for i in 0..5000 {
        src.push_str(&format!("let a{i} = b{i} + 1;\n"));
    }
    src.push_str("mask = k <= q;\n");
    let f = write(&dir, "chain.cmask", src);
    for args in [&["check", &f][..], &["plan", &f, "--q-len", "4"][..]] {
        let e = fails(args, &["CM0201", "more errors"]);
        assert_eq!(e.matches("[CM0201]").count(), 50, "{e}");
        let last = e.trim_end().lines().last().unwrap();
        assert!(
            last.starts_with("... and ") && last.ends_with(" more errors"),
            "{last}"
        );
    }
}

/// `show` writes PNG or SVG only: another extension is refused before planning.
#[test]
fn show_refuses_other_extensions() {
    let dir = scratch("show_ext");
    let causal = ["show", "--builtin", "causal", "--q-len", "8", "-o"];
    for name in ["m.jpg", "m.JPEG", "m", "m.png.gif"] {
        let p = dir.join(name);
        fails(
            &[&causal[..], &[p.to_str().unwrap()]].concat(),
            &[name, ".png or .svg"],
        );
        assert!(!p.exists(), "{name} was written");
    }
    for name in ["m.png", "m.PNG"] {
        let p = dir.join(name);
        ok(&[&causal[..], &[p.to_str().unwrap()]].concat());
        assert!(std::fs::read(&p).unwrap().starts_with(b"\x89PNG"));
    }
}

/// Integer lists read the same everywhere (`--cu-seqlens-q` inline or `@FILE`, `--set
/// NAME=@FILE`, `--order FILE`): an empty entry is an error naming its position, not
/// silently dropped, and a bad or out-of-range entry is named.
#[test]
fn integer_lists_reject_empty_and_bad_entries() {
    let dir = scratch("integer_lists");
    let plan = |extra: &[&str]| -> Vec<String> {
        ["plan", "--builtin", "causal", "--json"]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    fn args(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    for bad in ["0,,5,12", ",0,5,12", "0,5,12,"] {
        let v = plan(&["--cu-seqlens-q", bad]);
        fails(&args(&v), &["--cu-seqlens-q", "empty entry at position"]);
    }
    let f = write(&dir, "offsets.txt", "0,\n,5,12\n");
    let v = plan(&["--cu-seqlens-q", &format!("@{f}")]);
    fails(&args(&v), &["empty entry at position 1"]);
    // One per line, or comma and whitespace separated, is fine: 5 + 7 causal rows.
    let f = write(&dir, "lines.txt", "0\n5\n12\n");
    let v = plan(&["--cu-seqlens-q", &format!("@{f}")]);
    let out = ok(&args(&v));
    assert!(out.contains("\"visible_pairs\":43"), "{out}");
    let v = plan(&["--cu-seqlens-q", "0,5,x"]);
    fails(&args(&v), &["entry 2, `x`, is not an integer"]);
    let v = plan(&["--cu-seqlens-q", "0,99999999999999999999"]);
    fails(&args(&v), &["entry 1", "outside the 64-bit integer range"]);

    let f = write(&dir, "lengths.txt", "3,,4");
    let set = format!("lengths=@{f}");
    fails(
        &[
            "plan",
            "--builtin",
            "document_causal",
            "--q-len",
            "7",
            "--set",
            &set,
        ],
        &["--set lengths", "empty entry at position 1"],
    );
    fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--q-len",
            "7",
            "--set",
            "x=99999999999999999999",
        ],
        &["outside the 64-bit integer range"],
    );

    for (name, text, needle) in [
        ("dup.txt", "0,1,,2", "empty entry at position 2"),
        ("word.txt", "0 1 x 3", "entry 2, `x`, is not an integer"),
        ("neg.txt", "0 1 -2 3", "entry 2 is -2"),
        ("big.txt", "0 99999999999999999999", "entry 1"),
    ] {
        let f = write(&dir, name, text);
        fails(
            &["plan", "--builtin", "causal", "--q-len", "4", "--order", &f],
            &["--order", needle],
        );
    }
}

/// Integer-list files written by Windows editors start with a UTF-8 byte-order mark (and
/// end lines with CRLF): the mark is skipped in every @FILE / FILE list, while one later in
/// the text is an error that shows it escaped.
#[test]
fn integer_list_files_may_start_with_a_byte_order_mark() {
    let dir = scratch("bom");
    let bom = "\u{feff}";
    let visible = |args: &[&str]| json(args)["visible_pairs"].as_u64();
    // Documents of 2 and 3 tokens, causal in each: 1 + 2 and 1 + 2 + 3 pairs.
    let f = write(&dir, "lengths.txt", format!("{bom}2\r\n3\r\n"));
    let set = format!("lengths=@{f}");
    let doc = [
        "plan",
        "--builtin",
        "document_causal",
        "--q-len",
        "5",
        "--json",
    ];
    assert_eq!(visible(&[&doc[..], &["--set", &set]].concat()), Some(9));
    // Samples of 2 and 3 rows, causal: the same 9 pairs.
    let f = write(&dir, "cu.txt", format!("{bom}0,2,5"));
    let cu = format!("@{f}");
    let causal = ["plan", "--builtin", "causal", "--json"];
    assert_eq!(
        visible(&[&causal[..], &["--cu-seqlens-q", &cu]].concat()),
        Some(9)
    );
    // A token order keeps the pairs: causal over 4 tokens has 10 in any order.
    let f = write(&dir, "order.txt", format!("{bom}3\n2\n1\n0\n"));
    assert_eq!(
        visible(&[&causal[..], &["--q-len", "4", "--order", &f]].concat()),
        Some(10)
    );
    let f = write(&dir, "late.txt", format!("2\n{bom}3\n"));
    let set = format!("lengths=@{f}");
    fails(
        &[&doc[..], &["--set", &set]].concat(),
        &["CM0308", "entry 1, `\\u{feff}3`, is not an integer"],
    );
}

/// `_` groups digits in list entries as in the language's integer literals: `1_0` is 10
/// (inline and in files), `_10` is an error saying where `_` may go.
#[test]
fn integer_list_entries_take_underscores_as_literals_do() {
    let dir = scratch("underscores");
    let visible = |args: &[&str]| json(args)["visible_pairs"].as_u64();
    // Documents of 10 and 2 tokens: 55 + 3 pairs.
    let doc = [
        "plan",
        "--builtin",
        "document_causal",
        "--q-len",
        "12",
        "--json",
    ];
    assert_eq!(
        visible(&[&doc[..], &["--set", "lengths=1_0,2"]].concat()),
        Some(58)
    );
    let f = write(&dir, "lengths.txt", "1_0\n2\n");
    let set = format!("lengths=@{f}");
    assert_eq!(visible(&[&doc[..], &["--set", &set]].concat()), Some(58));
    fails(
        &[&doc[..], &["--set", "lengths=_10,2"]].concat(),
        &[
            "CM0308",
            "entry 0, `_10`, is not an integer: `_` must sit between two digits",
        ],
    );
    fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--json",
            "--cu-seqlens-q",
            "0,_5",
        ],
        &["--cu-seqlens-q", "entry 1, `_5`"],
    );
}

/// A diagnostic on a line of megabytes shows a window of it, not the whole line per
/// diagnostic; the note still gives the true position.
#[test]
fn long_lines_are_cut_in_diagnostics() {
    let dir = scratch("long_lines");
    let program = format!("mask = q >= k{} & zz;\n", " & q >= k".repeat(20_000));
    let f = write(&dir, "long.cmask", &program);
    let err = fails(&["check", &f], &["CM0105", "...", "long.cmask:1:1156"]);
    assert!(err.len() < 2_000, "{} bytes:\n{err}", err.len());
    // Short lines are shown whole.
    let f = write(&dir, "short.cmask", "mask = q >= k & zz;\n");
    fails(&["check", &f], &["mask = q >= k & zz;", "short.cmask:1:17"]);
}

/// A descriptor over the entry limit says what to change (tiles or lengths) and no
/// misleading total: the builder stops counting at the limit.
#[test]
fn descriptor_limit_names_the_remedies() {
    let err = fails(
        &[
            "plan",
            "--builtin",
            "causal",
            "--q-len",
            "100000",
            "--tile",
            "8x8",
        ],
        &[
            "CM0404",
            "more than 67108864 entries at 8x8 tiles",
            "larger tiles or shorter sequences",
        ],
    );
    assert!(!err.contains("67108865"), "{err}");
}

/// Runs the binary with `input` on standard input.
fn run_stdin(args: &[&str], input: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// Every command that reads a program takes `--builtin NAME` or a file, and `-` is
/// standard input.
#[test]
fn check_takes_builtins_and_every_command_reads_stdin() {
    let out = ok(&["check", "--builtin", "hstu"]);
    assert!(out.starts_with("ok: <builtin hstu>"), "{out}");
    assert!(out.contains("lengths: [int]"), "{out}");
    fails(
        &["check", "--builtin", "nope"],
        &["CM0201", "unknown built-in"],
    );
    fails(&["check"], &["--builtin NAME", "`-` for standard input"]);
    let src = b"mask = k <= q;\n";
    let o = run_stdin(&["check", "-"], src);
    assert!(
        o.status.success() && stdout(&o).starts_with("ok: <stdin>"),
        "{o:?}"
    );
    let o = run_stdin(&["plan", "-", "--q-len", "10", "--json"], src);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["visible_pairs"], 55);
    let o = run_stdin(&["intervals", "-", "--q-len", "10", "--rows", "3:4"], src);
    assert_eq!(stdout(&o), "3: [0, 4)\n");
    let o = run_stdin(&["export", "-", "--q-len", "2", "--format", "dense"], src);
    assert!(stdout(&o).contains("[[1,0],[1,1]]"), "{o:?}");
    let dir = scratch("stdin_show");
    let png = dir.join("m.png");
    let o = run_stdin(
        &["show", "-", "--q-len", "4", "-o", png.to_str().unwrap()],
        src,
    );
    assert!(o.status.success(), "{o:?}");
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    // An error in a program from standard input names it `<stdin>`.
    let o = run_stdin(&["check", "-"], b"mask = k <= ;\n");
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("<stdin>:1:"), "{}", stderr(&o));
}

/// `list --json`: every built-in with its summary and parameters, each default as the
/// built-in's source writes it (read here from the `.cmask` files themselves).
#[test]
fn list_json_names_parameters_types_and_defaults() {
    let v = json(&["list", "--json"]);
    let items = v.as_array().unwrap();
    let masks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cm-stdlib/masks");
    let mut files: Vec<_> = std::fs::read_dir(&masks)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cmask"))
        .collect();
    files.sort();
    assert_eq!(items.len(), files.len());
    for item in items {
        let name = item["name"].as_str().unwrap();
        assert!(!item["summary"].as_str().unwrap().is_empty(), "{name}");
        let src = std::fs::read_to_string(masks.join(format!("{name}.cmask"))).unwrap();
        let declared: Vec<(String, String, Option<String>)> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("param "))
            .map(|l| {
                let l = l.trim_end().trim_end_matches(';');
                let (head, default) = match l.split_once(" = ") {
                    Some((h, d)) => (h, Some(d.trim().to_string())),
                    None => (l, None),
                };
                let (n, ty) = head.split_once(':').unwrap();
                (n.trim().to_string(), ty.trim().to_string(), default)
            })
            .collect();
        let params = item["parameters"].as_array().unwrap();
        assert_eq!(params.len(), declared.len(), "{name}");
        for (p, (n, ty, default)) in params.iter().zip(&declared) {
            assert_eq!(p["name"], n.as_str(), "{name}");
            assert_eq!(p["type"], ty.as_str(), "{name}.{n}");
            assert_eq!(p["default"].as_str(), default.as_deref(), "{name}.{n}");
            if let Some(d) = default.as_deref().and_then(|d| d.parse::<i64>().ok()) {
                assert_eq!(p["default_value"], d, "{name}.{n}");
            }
        }
    }
    let hstu = items.iter().find(|i| i["name"] == "hstu").unwrap();
    assert_eq!(
        hstu["parameters"][0]["default_value"],
        serde_json::json!([2048, 1536, 3072, 1024, 2560, 512, 4096, 1280])
    );
    let text = ok(&["list"]);
    assert!(text.contains("lengths: [int] = [2048, 1536"), "{text}");
}

/// File names are taken as the OS gives them: bytes that are not UTF-8 are fine in a
/// program path, `--set NAME=@FILE`, `--order FILE` and `--cu-seqlens-q @FILE`.
#[cfg(unix)]
#[test]
fn paths_need_not_be_utf8() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let dir = scratch("non_utf8");
    let name = |s: &[u8]| dir.join(OsStr::from_bytes(s));
    let prog = name(b"m\xff.cmask");
    std::fs::write(&prog, "param w: int = 2;\nmask = q - w < k <= q;\n").unwrap();
    let window = name(b"w\xfe.txt");
    std::fs::write(&window, "3").unwrap();
    let order = name(b"o\xfd.txt");
    std::fs::write(&order, "3 2 1 0").unwrap();
    let cu = name(b"c\xfc.txt");
    std::fs::write(&cu, "0,2,4").unwrap();
    let run = |extra: &[&OsStr]| {
        let o = Command::new(BIN).args(extra).output().unwrap();
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        stdout(&o)
    };
    let out = run(&[OsStr::new("check"), prog.as_os_str()]);
    assert!(out.contains("ok: ") && out.contains(".cmask"), "{out}");
    let mut set = std::ffi::OsString::from("w=@");
    set.push(window.as_os_str());
    let out = run(&[
        OsStr::new("plan"),
        prog.as_os_str(),
        OsStr::new("--q-len"),
        OsStr::new("4"),
        OsStr::new("--set"),
        &set,
        OsStr::new("--json"),
    ]);
    // w = 3: rows see 1, 2, 3, 3 keys.
    assert!(out.contains("\"visible_pairs\":9"), "{out}");
    let out = run(&[
        OsStr::new("plan"),
        prog.as_os_str(),
        OsStr::new("--q-len"),
        OsStr::new("4"),
        OsStr::new("--order"),
        order.as_os_str(),
        OsStr::new("--json"),
    ]);
    assert!(out.contains("\"visible_pairs\":7"), "{out}");
    let mut cu_arg = std::ffi::OsString::from("@");
    cu_arg.push(cu.as_os_str());
    let out = run(&[
        OsStr::new("plan"),
        OsStr::new("--builtin"),
        OsStr::new("causal"),
        OsStr::new("--cu-seqlens-q"),
        &cu_arg,
        OsStr::new("--json"),
    ]);
    assert!(out.contains("\"visible_pairs\":6"), "{out}");
}

/// A chain of `let`s past the depth limit: one error, at the `let` that first exceeds
/// it, however long the file (10 MB here). One error is also the bound on the work: the
/// links after it name a failed `let` and are not lowered, and checking the 4096 unused
/// links before it one by one (quadratic) would pass the checker's node limit, a second
/// error.
#[test]
fn let_depth_error_is_reported_once_at_its_let() {
    let dir = scratch("let_depth");
    let mut src = String::from("let a0 = k == q;\n");
    let mut i = 1;
    while src.len() < 10_000_000 {
        src.push_str(&format!("let a{i} = a{} | k == q - {};\n", i - 1, i % 7));
        i += 1;
    }
    src.push_str(&format!("mask = a{};\n", i - 1));
    let path = write(&dir, "chain.cmask", &src);
    let err = fails(&["check", &path], &["CM0105", "`a4096` nests too deeply"]);
    assert_eq!(err.matches("Error").count(), 1, "{err}");
    assert!(err.contains("chain.cmask:4097:5"), "{err}");
}

/// Limits compose: a union of 1,000 terms written as a chain of `let`s (the CM0105 hint
/// for a long operator chain) plans, with the visible pairs counted here.
#[test]
fn a_thousand_term_union_written_with_let_plans() {
    let dir = scratch("union1000");
    let mut src = String::from("let u0 = k == q;\n");
    for i in 1..1000 {
        src.push_str(&format!("let u{i} = u{} | k == q - {i};\n", i - 1));
    }
    src.push_str("mask = u999;\n");
    let path = write(&dir, "u.cmask", &src);
    let v = json(&["plan", &path, "--q-len", "3000", "--json"]);
    let want: u64 = (0..3000u64).map(|q| (q + 1).min(1000)).sum();
    assert_eq!(v["visible_pairs"], want);
}

/// Plan-time warnings: each silent mistake gets its code on standard error with the span
/// it is about, the plan still succeeds, and `--deny-warnings` turns any into exit 1.
#[test]
fn silent_mistakes_warn() {
    let cases: &[(&str, &[&str], Option<&str>, &str)] = &[
        (
            "mask = k > q + 100;",
            &["--q-len", "8"],
            Some("CM0260"),
            "the mask sees nothing",
        ),
        (
            "mask = k < q;",
            &["--q-len", "8"],
            Some("CM0261"),
            "1 of 8 query rows see no key",
        ),
        (
            "mask = k < q;",
            &["--q-len", "8", "--num-heads", "3"],
            Some("CM0261"),
            "3 of 24 query rows",
        ),
        (
            "mask = k <= q + h;",
            &["--q-len", "8"],
            Some("CM0262"),
            "reads the head index `h`",
        ),
        (
            "mask = k <= q + h;",
            &["--q-len", "8", "--num-heads", "2"],
            None,
            "",
        ),
        (
            "mask = k <= q + b;",
            &["--q-len", "8"],
            Some("CM0263"),
            "reads the batch index `b`",
        ),
        (
            "mask = k <= q + b;",
            &["--cu-seqlens-q", "0,8"],
            Some("CM0263"),
            "one batch",
        ),
        ("mask = k <= q + b;", &["--cu-seqlens-q", "0,4,8"], None, ""),
        (
            "param unused: int = 3;\nmask = k <= q;",
            &["--q-len", "8", "--set", "unused=4"],
            Some("CM0264"),
            "parameter `unused` was set, but nothing in the program reads it",
        ),
        (
            "param unused: int = 3;\nmask = k <= q;",
            &["--q-len", "8"],
            None,
            "",
        ),
        (
            "mask = elementwise(k <= q);",
            &["--q-len", "1001"],
            Some("CM0265"),
            "`elementwise` evaluated 1002001 (q, k) pairs",
        ),
        (
            "mask = elementwise(k <= q);",
            &["--q-len", "1000"],
            None,
            "",
        ),
        ("mask = k <= q;", &["--q-len", "8"], None, ""),
    ];
    for (src, args, code, text) in cases {
        let o = run_stdin(&[&["plan", "-"][..], args].concat(), src.as_bytes());
        let err = stderr(&o);
        assert!(o.status.success(), "{src} {args:?}: {err}");
        match code {
            Some(code) => {
                assert!(
                    err.contains(&format!("[{code}] Warning")),
                    "{src} {args:?}: {err}"
                );
                assert!(err.contains(text), "{src} {args:?}: {err}");
                assert!(err.contains("<stdin>:"), "no span: {err}");
                let o = run_stdin(
                    &[&["plan", "-", "--deny-warnings"][..], args].concat(),
                    src.as_bytes(),
                );
                assert_eq!(o.status.code(), Some(1), "{src} {args:?}");
                assert!(stderr(&o).contains("--deny-warnings"), "{}", stderr(&o));
            }
            None => assert!(!err.contains("Warning"), "{src} {args:?}: {err}"),
        }
    }
    // The program's own warnings, too: an unused `let`.
    let src = b"let x = 3;\nmask = k <= q;\n";
    let o = run_stdin(&["check", "-"], src);
    assert!(o.status.success() && stderr(&o).contains("CM0250"), "{o:?}");
    let o = run_stdin(&["check", "-", "--deny-warnings"], src);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
}

/// examples/masks/tree.cmask declares 8 nodes: planned at q_len 4 the last 4 nodes have no
/// row and are no key, which plans (out-of-range positions contribute nothing) but warns
/// with the numbers; at 8 (the tree exactly) and 12 (rows past the tree) it does not.
#[test]
fn a_tree_past_the_lengths_warns() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/masks/tree.cmask");
    let example = example.to_str().unwrap();
    let o = run(&["plan", example, "--q-len", "4", "--json"]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // Rows 0..4 see their ancestors among nodes 0..4 (parents -1, 0, 1, 1): 1 + 2 + 3 + 3.
    assert_eq!(
        (v["q_len"].as_u64(), v["visible_pairs"].as_u64()),
        (Some(4), Some(9))
    );
    assert_eq!(err.matches("[CM0266] Warning").count(), 1, "{err}");
    assert!(
        err.contains(
            "tree `t` has 8 nodes at offset 0 (positions 0 ..= 7), but q_len = 4 and kv_len = 4: \
             4 nodes lie past q_len (no query row) and 4 past kv_len (no key)"
        ),
        "{err}"
    );
    assert!(
        err.contains("tree.cmask:4:1"),
        "the span is the tree's line: {err}"
    );
    assert!(
        err.contains(
            "give q_len >= 8 and kv_len >= 8, or a shorter parents list (4 nodes fit at offset 0)"
        ),
        "{err}"
    );
    let o = run(&["plan", example, "--q-len", "4", "--deny-warnings"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    for q_len in ["8", "12"] {
        let o = run(&["plan", example, "--q-len", q_len, "--json"]);
        let err = stderr(&o);
        assert!(o.status.success(), "{err}");
        assert!(!err.contains("CM0266"), "q_len {q_len}: {err}");
    }
}

/// A full device on standard output (Linux's `/dev/full`) fails every command that prints,
/// naming the error, instead of exiting 0 with the output lost; a closed pipe (`| head`)
/// still ends quietly.
#[test]
fn a_failed_write_to_standard_output_is_an_error() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        return;
    };
    for args in [
        &["plan", "--builtin", "causal", "--q-len", "100", "--json"][..],
        &["plan", "--builtin", "causal", "--q-len", "100"],
        &["list"],
        &["list", "--json"],
        &["check", "--builtin", "causal"],
        &[
            "shard",
            "--builtin",
            "causal",
            "--q-len",
            "4096",
            "--ranks",
            "2",
        ],
        &[
            "intervals",
            "--builtin",
            "causal",
            "--q-len",
            "10",
            "--rows",
            "0:3",
        ],
    ] {
        let o = Command::new(BIN)
            .args(args)
            .stdout(full.try_clone().unwrap())
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("No space left on device"), "{args:?}: {err}");
    }
    let mut child = Command::new(BIN)
        .args(["list"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success() && o.stderr.is_empty(), "{o:?}");
}

/// `-o -` is standard output, as `-` for an input file is standard input: `export` writes
/// its JSON there (no file named `-`); `show`, whose format is the file's extension, and
/// `plan --order-out`, whose standard output is the report, refuse it saying why.
#[test]
fn dash_output_is_standard_output() {
    let dir = scratch("dash_output");
    let at = |args: &[&str]| {
        std::process::Command::new(BIN)
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap()
    };
    let args = [
        "export",
        "--builtin",
        "causal",
        "--q-len",
        "4",
        "--format",
        "cudnn",
    ];
    let o = at(&[&args[..], &["-o", "-"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let plain = at(&args);
    assert_eq!(stdout(&o), stdout(&plain));
    assert_eq!(
        stdout(&o).trim(),
        r#"{"b":0,"endpoints":[1,2,3,4],"h":0,"nfunc":1}"#
    );
    let o = at(&["show", "--builtin", "causal", "--q-len", "4", "-o", "-"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("-o -: `show` picks the format by the file's extension"),
        "{}",
        stderr(&o)
    );
    let o = at(&[
        "plan",
        "--builtin",
        "causal",
        "--q-len",
        "4",
        "--order-out",
        "-",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--order-out -: standard output holds the plan's report"),
        "{}",
        stderr(&o)
    );
    assert!(!dir.join("-").exists(), "a file named `-` was written");
}

/// Counts name the range they take: `--ranks` and `--chunk` from 1.
#[test]
fn ranks_and_chunk_name_their_range() {
    for (flag, value) in [
        ("--ranks", "-2"),
        ("--ranks", "0"),
        ("--ranks", "4294967296"),
        ("--chunk", "0"),
    ] {
        let mut args = vec!["shard", "--builtin", "causal", "--q-len", "100"];
        if flag == "--chunk" {
            args.extend(["--ranks", "2"]);
        }
        args.extend([flag, value]);
        let err = fails(&args, &[&format!("invalid value '{value}' for '{flag}")]);
        assert!(err.contains("not in 1..=4294967295"), "{err}");
        assert!(!err.contains("0..="), "{err}");
    }
}

/// A number followed by letters is named as the literal it starts: `1e` is a float whose
/// exponent has no digits, not a "malformed integer".
#[test]
fn malformed_floats_are_called_floats() {
    let dir = scratch("malformed_float");
    for (lit, message) in [
        (
            "1e",
            "malformed float literal `1e`: its exponent needs digits",
        ),
        (
            "1.5e",
            "malformed float literal `1.5e`: its exponent needs digits",
        ),
        ("2.5x", "malformed float literal `2.5x`"),
    ] {
        let f = write(
            &dir,
            "m.cmask",
            format!("mask = k <= q;\nscore = softcap(score, {lit});\n"),
        );
        let err = fails(&["check", &f], &["[CM0103]", message]);
        assert!(!err.contains("integer"), "{err}");
    }
}

/// Counted nouns agree with their count: `1 head`, `1 sample`, `1 token`, `1 warning`.
#[test]
fn counts_are_pluralised() {
    let out = ok(&[
        "plan",
        "--builtin",
        "causal_alibi",
        "--q-len",
        "4",
        "--num-heads",
        "1",
    ]);
    assert!(out.contains("slopes [-0.00390625] (1 head)"), "{out}");
    let out = ok(&["plan", "--builtin", "causal", "--cu-seqlens-q", "0,5"]);
    assert!(
        out.contains("packed          1 sample, cu_seqlens_q [0, 5]"),
        "{out}"
    );
    let out = ok(&[
        "shard",
        "--builtin",
        "causal",
        "--q-len",
        "1",
        "--ranks",
        "1",
    ]);
    assert!(out.contains(": 1 token over 1 rank in chunks of"), "{out}");
    let out = ok(&[
        "shard",
        "--builtin",
        "causal",
        "--q-len",
        "9",
        "--ranks",
        "3",
    ]);
    assert!(
        out.contains(": 9 tokens over 3 ranks in chunks of"),
        "{out}"
    );
    let dir = scratch("plurals");
    let f = write(&dir, "w.cmask", "let unused = 3;\nmask = k <= q;\n");
    assert!(ok(&["check", &f]).contains("(1 warning; parameters: none)"));
    fails(
        &["check", &f, "--deny-warnings"],
        &["1 warning and --deny-warnings: treating it as errors"],
    );
    let o = ok(&["check", "--builtin", "causal"]);
    assert!(o.contains("(0 warnings; parameters: none)"), "{o}");
}

/// `demo --out` naming a file (not a directory) says so, before anything is written.
#[test]
fn demo_out_must_be_a_directory() {
    let dir = scratch("demo_out_file");
    let file = dir.join("taken");
    std::fs::write(&file, "mine").unwrap();
    let path = file.to_str().unwrap();
    fails(
        &["demo", "--out", path],
        &[&format!("--out `{path}` is a file"), "expected a directory"],
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
}
