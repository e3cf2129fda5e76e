//! The README's commands work as written on a fresh clone: its mask is the file its commands
//! read, and every `compilemask` command it shows (in its shell blocks and its prose) runs,
//! from the repository's root, and succeeds.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

const README: &str = include_str!("../../../README.md");

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The README's `compilemask ...` commands, comments cut: each line of a ```bash block and
/// each `code span` of its prose that starts with `compilemask `.
fn commands() -> Vec<String> {
    let mut out = Vec::new();
    for (i, part) in README.split("```").enumerate() {
        let lines: Vec<&str> = if i % 2 == 1 {
            if !part.starts_with("bash\n") {
                continue;
            }
            part.lines().collect()
        } else {
            // Prose: the inline code spans.
            part.split('`').skip(1).step_by(2).collect()
        };
        for line in lines {
            let line = line.split(" #").next().unwrap_or("").trim();
            if line.starts_with("compilemask ") {
                out.push(line.to_string());
            }
        }
    }
    out
}

#[test]
fn the_readme_mask_is_the_file_its_commands_read() {
    let block = README
        .split("```text\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the README shows a mask in a ```text block");
    let file = std::fs::read_to_string(root().join("examples/hstu.cmask")).unwrap();
    assert_eq!(block, file, "README's mask and examples/hstu.cmask differ");
    assert!(
        commands()
            .iter()
            .any(|c| c == "compilemask check examples/hstu.cmask"),
        "{:?}",
        commands()
    );
}

#[test]
fn every_readme_command_runs() {
    let commands = commands();
    assert!(commands.len() >= 10, "found only {commands:?}");
    // Outputs (`-o clear.png`) go to a scratch folder; paths the README reads are the
    // repository's.
    let dir = scratch("cli-readme", "commands");
    let mut ran = 0;
    for c in &commands {
        let args: Vec<String> = c
            .split_whitespace()
            .skip(1)
            .map(|a| {
                let p = root().join(a);
                if a.contains('/') && p.exists() {
                    p.to_str().unwrap().to_string()
                } else {
                    a.to_string()
                }
            })
            .collect();
        // `bench` needs an H100 / H200 (tests/bench.rs covers its refusal without one).
        if args[0] == "bench" {
            continue;
        }
        let o = Command::new(BIN)
            .args(&args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "README's `{c}` failed ({:?}):\n{}",
            o.status,
            stderr(&o)
        );
        ran += 1;
    }
    assert!(ran >= 10, "ran {ran} of {commands:?}");
    for written in [
        "clear.png",
        "causal_blockmask.json",
        "hstu.png",
        "hstu.html",
    ] {
        assert!(dir.join(written).exists(), "{written} was not written");
    }
}
