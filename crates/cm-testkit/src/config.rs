//! Proptest configurations for the property and fuzz tests.
//!
//! Without the environment variable, a test runs its default case count with a fixed seed,
//! so CI is reproducible; with it, that many cases with proptest's default seed (random, or
//! `PROPTEST_RNG_SEED`). Failures are never persisted: reproductions live as named tests.

use proptest::test_runner::{Config as ProptestConfig, RngSeed};

/// The variable that sets the case count of the fuzz tests.
pub const FUZZ_CASES: &str = "CM_FUZZ_CASES";

/// The variable that sets the case count of the property tests.
pub const PROPTEST_CASES: &str = "CM_PROPTEST_CASES";

/// The fixed seed of the fuzz tests' quick run.
pub const FUZZ_SEED: u64 = 0x5eed_c0de;

/// The case count in `var`, when it is set to a number.
pub fn env_cases(var: &str) -> Option<u32> {
    std::env::var(var).ok().and_then(|s| s.parse().ok())
}

/// `default` cases with the fixed `seed`, or the count in `var` with proptest's seed.
pub fn env_config(var: &str, default: u32, seed: u64) -> ProptestConfig {
    let long = env_cases(var);
    ProptestConfig {
        cases: long.unwrap_or(default),
        failure_persistence: None,
        rng_seed: match long {
            None => RngSeed::Fixed(seed),
            Some(_) => ProptestConfig::default().rng_seed,
        },
        ..ProptestConfig::default()
    }
}

/// The fuzz tests' configuration: [`FUZZ_CASES`] cases, else `default` with [`FUZZ_SEED`].
pub fn fuzz_config(default: u32) -> ProptestConfig {
    env_config(FUZZ_CASES, default, FUZZ_SEED)
}
