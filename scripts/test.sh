#!/usr/bin/env bash
# The whole CPU test suite: formatting, lints, Rust tests (property tests and a short fuzz
# run included), every CUDA kernel variant compiled for sm_90a, the CLI against the
# independent Python implementation of workloads.md, and the explorer page in a headless
# browser. Needs a Rust toolchain and Python 3.11+ (and PyPI for the pinned NVRTC wheel and
# Selenium); the one system-wide install is Debian's chromium and chromium-driver, by
# scripts/test-browser.sh when they are missing (as root). Needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every cargo command below builds cm-cuda with NVRTC, so a kernel that fails to compile or
# a forward kernel that spills registers fails the first of them. CUBINs are cached by source
# hash under target/cm-kernels-cache: unchanged kernels are not recompiled.
echo "== NVRTC (scripts/install-nvrtc.sh)"
CM_NVRTC_DIR="$(bash scripts/install-nvrtc.sh | tail -n 1)"
export CM_NVRTC_DIR
# Incremental state is only worth its disk on a machine that rebuilds.
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi
echo "== disk: $(df -h . | tail -n 1)"

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --workspace --locked

# The debug and test builds are not read past this point; on CI the release builds below
# need the disk they held (CI machines may have little).
echo "== disk after the test build: $(du -sh target | cut -f1)"
if [ -n "${CI:-}" ]; then rm -rf target/debug; fi

echo "== kernels: every variant for sm_90a, no spills (ptxas facts)"
bash scripts/build-kernels.sh

echo "== CLI vs the independent workloads.md oracle"
cargo build --release --locked -p cm-cli
python3 tests/workloads/check_cli.py target/release/compilemask

echo "== demo"
target/release/compilemask demo --out target/demo >/dev/null

echo "== explorer page in headless Chromium (scripts/test-browser.sh)"
bash scripts/test-browser.sh target/release/compilemask

echo "== Python package (wheel in a fresh venv, pytest)"; scripts/test-python.sh
echo "all tests passed"
