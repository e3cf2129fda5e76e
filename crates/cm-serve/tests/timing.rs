//! Host time of planning serving steps (BENCHMARKS.md, "Serving steps"). Timings only, no
//! timed assertion; run with
//! `cargo test --release -p cm-serve --test timing -- --ignored --nocapture`.

mod common;

use cm_ir::Value;
use cm_serve::{Step, StepPlanner};
use common::*;
use std::time::Instant;

/// Best and median of `runs` timings of `f`, in microseconds.
fn time(runs: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[0], t[runs / 2])
}

#[test]
#[ignore = "timing: run with --release -- --ignored --nocapture"]
fn decode_step_host_time() {
    let window = params(&[("window", Value::Int(4096))]);
    for (name, program, shared, per_seq) in [
        (
            "causal, piece cache",
            builtin("causal"),
            Params::new(),
            false,
        ),
        (
            "sliding_window 4096, piece cache",
            builtin("sliding_window"),
            window.clone(),
            false,
        ),
        (
            "causal_bottom_right (lengths that cancel: piece cache)",
            builtin("causal_bottom_right"),
            Params::new(),
            false,
        ),
        (
            "sliding_window 4096, per-sequence parameters (one binding per sequence)",
            builtin("sliding_window"),
            Params::new(),
            true,
        ),
    ] {
        let planner = StepPlanner::new(program, shared).unwrap();
        let kv: Vec<i64> = (0..64).map(|s| 32_768 - 512 + 5 * s).collect();
        let own = per_seq.then(|| vec![window.clone(); 64]);
        let mut step = Step::new(planner, &[1; 64], &kv, own).unwrap();
        // Steps before timing: the pieces of the first step are solved then.
        for _ in 0..100 {
            step.append(&[1; 64]).unwrap();
        }
        let (best, median) = time(2000, || step.append(&[1; 64]).unwrap());
        println!(
            "batch 64, one new token each, kv_len ~32K, {name}: append best {best:.2} us, \
             median {median:.2} us per step"
        );
    }
}

#[test]
#[ignore = "timing: run with --release -- --ignored --nocapture"]
fn tree_step_host_time() {
    // 16 sequences, a 64-node tree each over a 32K prefix (a 4-ary tree, breadth first).
    let parents: Vec<i64> = (0..64)
        .map(|i| if i == 0 { -1 } else { (i - 1) / 4 })
        .collect();
    let own = vec![params(&[("parents", Value::Array(parents.into()))]); 16];
    let kv: Vec<i64> = (0..16).map(|s| 32_768 + 64 + s).collect();
    let mut planner = StepPlanner::new(builtin("tree_decode"), Params::new()).unwrap();
    let (best, median) = time(500, || {
        planner.plan_each(&[64; 16], &kv, &own).unwrap();
    });
    println!(
        "batch 16, 64-node trees over a 32K prefix (tree_decode): plan best {best:.1} us, \
         median {median:.1} us per step"
    );
}
