//! What every end-to-end test of the `compilemask` binary needs: running it, scratch
//! files, and the two outcomes it asserts (a success with its stdout, a clean failure with
//! its stderr). Each test file uses a part of it.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const BIN: &str = env!("CARGO_BIN_EXE_compilemask");

/// An empty scratch folder `group/test` under the target directory.
pub fn scratch(group: &str, test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(group)
        .join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `bytes` to `dir/name`; returns the path.
pub fn write(dir: &Path, name: &str, bytes: impl AsRef<[u8]>) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.to_str().unwrap().to_string()
}

pub fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the binary runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs a command that must succeed; returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(
        o.status.success(),
        "{args:?} failed ({:?}):\n{}",
        o.status,
        stderr(&o)
    );
    stdout(&o)
}

/// Runs a command that must print JSON and succeed.
pub fn json(args: &[&str]) -> Value {
    let out = ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}):\n{out}"))
}

/// Runs a command that must fail cleanly: exit 1 or 2 (not a crash or signal), no panic,
/// a message on stderr containing every one of `needles`. Returns stderr.
pub fn fails(args: &[&str], needles: &[&str]) -> String {
    let o = run(args);
    let err = stderr(&o);
    assert!(
        matches!(o.status.code(), Some(1) | Some(2)),
        "{args:?}: expected exit 1 or 2, got {:?}\nstderr:\n{err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    assert!(!err.trim().is_empty(), "{args:?}: no message on stderr");
    for n in needles {
        assert!(err.contains(n), "{args:?}: stderr lacks {n:?}:\n{err}");
    }
    err
}
