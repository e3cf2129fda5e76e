#!/usr/bin/env bash
# The whole CPU test suite: formatting, lints, Rust tests (property tests and a short fuzz
# run included), and the CLI against the independent Python implementation of workloads.md.
# Needs only a Rust toolchain and Python 3.11+; installs nothing system-wide.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --workspace --locked

echo "== CLI vs the independent workloads.md oracle"
cargo build --release --locked -p cm-cli
python3 tests/workloads/check_cli.py target/release/compilemask

echo "== demo"
target/release/compilemask demo --out target/demo >/dev/null

echo "all tests passed"
