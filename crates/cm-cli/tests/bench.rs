//! `compilemask bench` end to end on any machine: bad arguments are refused before the GPU is
//! touched, and a machine without a GPU or without embedded kernels gets a clear error.

mod common;

use common::{fails, run, stderr, stdout};
use std::process::Output;

fn bench(args: &[&str]) -> Output {
    run(&[&["bench"][..], args].concat())
}

/// Exit code 1 or 2 (clap), no panic, every needle on stderr.
fn refused(args: &[&str], needles: &[&str]) {
    fails(&[&["bench"][..], args].concat(), needles);
}

#[test]
fn bad_arguments_are_refused_before_the_gpu() {
    // Sizes out of range, negative or not numbers: one message naming the flag and the range.
    refused(
        &["--sizes", "0"],
        &["invalid value '0' for '--sizes", "not in 1..=1048576"],
    );
    refused(
        &["--sizes", "8192,2000000"],
        &["invalid value '2000000' for '--sizes", "not in 1..=1048576"],
    );
    refused(&["--sizes", "8k"], &["invalid value '8k'"]);
    refused(
        &["--sizes", "-5"],
        &["invalid value '-5' for '--sizes", "not in 1..=1048576"],
    );
    // Counts name the range they take: 0 and negatives alike.
    for (flag, value) in [
        ("--heads", "-2"),
        ("--heads", "0"),
        ("--kv-heads", "0"),
        ("--runs", "0"),
        ("--runs", "-1"),
    ] {
        refused(
            &[flag, value],
            &[
                &format!("invalid value '{value}' for '{flag}"),
                &format!("`{value}` is not a count; expected an integer in 1..="),
            ],
        );
    }
    for (extra, flag, value) in [
        (&[][..], "--head-dim", "-3"),
        (&[][..], "--head-dim", "0"),
        (&[][..], "--head-dim-v", "0"),
        (&["--decode"][..], "--batch", "0"),
        (&["--decode"][..], "--page-sizes", "16,0"),
    ] {
        refused(
            &[extra, &[flag, value][..]].concat(),
            &[&format!("for '{flag}"), "1..="],
        );
    }
    refused(&["--fwd-tile", "-3x4"], &["--fwd-tile \"-3x4\""]);
    refused(
        &["--heads", "6", "--kv-heads", "4"],
        &["must divide --heads"],
    );
    refused(
        &["--head-dim", "96"],
        &[
            "--head-dim 96 --head-dim-v 96 is not built",
            "64, 128, 192 (head_dim_v 128), 256",
        ],
    );
    refused(
        &["--head-dim", "192"],
        &["--head-dim 192 --head-dim-v 192 is not built"],
    );
    refused(
        &["--decode", "--head-dim", "192", "--head-dim-v", "128"],
        &["--decode reads V at head_dim"],
    );
    refused(
        &["--workloads", "causal,nope"],
        &["unknown built-in mask `nope`"],
    );
    refused(&["--dtype", "fp8"], &["invalid value 'fp8'"]);
    refused(&["--deterministic"], &["--bwd"]);
    refused(
        &["--bwd", "--head-dim", "96"],
        &["--head-dim 96 --head-dim-v 96 is not built"],
    );
    refused(
        &["--bwd", "--runs", "0"],
        &["`0` is not a count; expected an integer in 1..="],
    );
    refused(
        &["--fwd-tile", "192x128"],
        &[
            "--fwd-tile \"192x128\": expected one of 128x128",
            "head_dim 128",
        ],
    );
    refused(
        &["--head-dim", "64", "--fwd-tile", "192"],
        &["--fwd-tile \"192\": expected one of 128x128, 192x128"],
    );
    refused(
        &["--head-dim", "64", "--fwd-tile=-1x128"],
        &["expected one of 128x128, 192x128"],
    );
}

/// Without an H100 / H200 (CI), the run stops with a message that says what is missing; on a
/// GPU machine with embedded kernels it checks and times one small workload, forward only and
/// forward + backward (both backward modes).
#[test]
fn no_gpu_is_a_clear_error() {
    let small = ["--sizes", "256", "--workloads", "causal", "--runs", "3"];
    for extra in [&[][..], &["--bwd", "--deterministic"][..]] {
        let o = bench(&[&small[..], extra].concat());
        let err = stderr(&o);
        if o.status.success() {
            let out = stdout(&o);
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
