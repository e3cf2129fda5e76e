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
    let mut src = String::from("let a0 = 1;\n");
    for i in 1..5000 {
        src.push_str(&format!("let a{i} = a{} + 1;\n", i - 1));
    }
    src.push_str("mask = k <= q;\n");
    let f = write(&dir, "chain.cmask", src);
    for args in [&["check", &f][..], &["plan", &f, "--q-len", "4"][..]] {
        let e = fails(args, &["CM0105", "more errors"]);
        assert_eq!(e.matches("[CM0105]").count(), 50, "{e}");
        let last = e.trim_end().lines().last().unwrap();
        assert!(
            last.starts_with("... and ") && last.ends_with(" more errors"),
            "{last}"
        );
    }
}

/// `show` writes PNG only: another extension is refused before planning.
#[test]
fn show_refuses_other_extensions() {
    let dir = scratch("show_ext");
    let causal = ["show", "--builtin", "causal", "--q-len", "8", "-o"];
    for name in ["m.jpg", "m.JPEG", "m", "m.png.gif"] {
        let p = dir.join(name);
        fails(
            &[&causal[..], &[p.to_str().unwrap()]].concat(),
            &[name, ".png"],
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
