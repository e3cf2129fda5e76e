//! Shared by the tests: programs, the brute-force rows of a step from the pairwise
//! semantics, and a deterministic generator.

#![allow(dead_code)]

use cm_ir::{Program, Shape, Value};
use cm_serve::StepPlan;
use proptest::prelude::Rng as _;
use proptest::test_runner::{RngAlgorithm, TestRng};
use std::collections::BTreeMap;
use std::sync::Arc;

pub type Params = BTreeMap<String, Value>;
pub type Rows = Vec<Vec<(u32, u32)>>;

pub fn compile(src: &str) -> Arc<Program> {
    match cm_stdlib::compile(src) {
        (Some(p), _) => Arc::new(p),
        (None, diags) => panic!("{src} failed to compile: {diags:?}"),
    }
}

pub fn builtin(name: &str) -> Arc<Program> {
    compile(cm_stdlib::get(name).expect("a built-in").source)
}

pub fn params(list: &[(&str, Value)]) -> Params {
    list.iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// Every row of a step by the pairwise semantics: sequence `s` is the program bound at
/// `q_len = kv_len = kv_len[s]`, `batch = num_seqs`, with batch index `s`, and its new row
/// `i` is the program's row `kv_len[s] - q_len[s] + i`.
pub fn brute_rows(
    program: &Program,
    shared: &Params,
    own: Option<&[Params]>,
    q_len: &[i64],
    kv_len: &[i64],
) -> Rows {
    let num_seqs = q_len.len() as i64;
    let mut out = Vec::new();
    for (s, (&q, &kv)) in q_len.iter().zip(kv_len).enumerate() {
        let mut values = shared.clone();
        if let Some(own) = own {
            values.extend(own[s].clone());
        }
        let shape = Shape {
            q_len: kv,
            kv_len: kv,
            batch: num_seqs,
            num_heads: 1,
        };
        let bound = program
            .bind(shape, &values)
            .unwrap_or_else(|e| panic!("bind of sequence {s}: {e}"));
        for p in kv - q..kv {
            out.push(
                bound
                    .brute_force_row(p, s as i64, 0)
                    .unwrap_or_else(|e| panic!("row {p} of sequence {s}: {e}")),
            );
        }
    }
    out
}

/// Every row of a planned step.
pub fn step_rows(plan: &StepPlan) -> Rows {
    (0..plan.total_q()).map(|r| plan.row(r).collect()).collect()
}

/// A deterministic generator.
pub struct Gen(TestRng);

impl Gen {
    pub fn new(seed: u8) -> Gen {
        let mut key = [0u8; 32];
        key[0] = seed;
        Gen(TestRng::from_seed(RngAlgorithm::ChaCha, &key))
    }

    /// Uniform in `[0, n)`, `n > 0`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.next_u64() % n
    }

    /// Uniform in `[-1, 1)`.
    pub fn signed_unit(&mut self) -> f64 {
        (self.0.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// A random permutation of `0..n` (Fisher-Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i as u64 + 1) as usize);
        }
        p
    }
}
