//! `compilemask bench` end to end on any machine: bad arguments are refused before the GPU is
//! touched, and a machine without a GPU or without embedded kernels gets a clear error.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_compilemask");

fn bench(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the binary runs")
}

/// Exit code 1 or 2 (clap), no panic, every needle on stderr.
fn refused(args: &[&str], needles: &[&str]) {
    let o = bench(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        matches!(o.status.code(), Some(1) | Some(2)),
        "{args:?}: {:?}\n{err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: stderr lacks {n:?}:\n{err}");
    }
}

#[test]
fn bad_arguments_are_refused_before_the_gpu() {
    refused(&["--sizes", "0"], &["--sizes: 0 is out of range"]);
    refused(&["--sizes", "8k"], &["invalid value '8k'"]);
    refused(
        &["--heads", "6", "--kv-heads", "4"],
        &["must divide --heads"],
    );
    refused(&["--heads", "0"], &["must be positive"]);
    refused(
        &["--head-dim", "96"],
        &["--head-dim 96 is not built", "64, 128"],
    );
    refused(
        &["--workloads", "causal,nope"],
        &["unknown built-in mask `nope`"],
    );
    refused(&["--runs", "0"], &["--runs must be at least 1"]);
    refused(&["--dtype", "fp8"], &["invalid value 'fp8'"]);
    refused(&["--deterministic"], &["--bwd"]);
    refused(
        &["--bwd", "--head-dim", "96"],
        &["--head-dim 96 is not built"],
    );
    refused(&["--bwd", "--runs", "0"], &["--runs must be at least 1"]);
}

/// Without an H100 / H200 (CI), the run stops with a message that says what is missing; on a
/// GPU machine with embedded kernels it checks and times one small workload, forward only and
/// forward + backward (both backward modes).
#[test]
fn no_gpu_is_a_clear_error() {
    let small = ["--sizes", "256", "--workloads", "causal", "--runs", "3"];
    for extra in [&[][..], &["--bwd", "--deterministic"][..]] {
        let o = bench(&[&small[..], extra].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        if o.status.success() {
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains("W1") && out.contains("PASS"), "{out}");
            continue;
        }
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            err.contains("CM_NVRTC_DIR")
                || err.contains("libcuda.so")
                || err.contains("compute capability"),
            "{err}"
        );
    }
}
