#!/usr/bin/env bash
# The kernel build CI runs: installs the pinned NVRTC (scripts/install-nvrtc.sh), compiles
# every kernel variant for sm_90a into the release build of cm-cuda, which cm-bench's GPU test
# binaries embed (failing on a compile error or a register spill in a forward kernel), and
# prints each variant's ptxas facts.
# CUBINs are cached by source hash under target/cm-kernels-cache (or $CM_KERNEL_CACHE_DIR),
# so a rerun with unchanged kernels compiles nothing.
#
# The artefacts for the GPU machine are target/release/cm-gpu-test (forward) and
# target/release/cm-bwd-test (backward), CUBINs embedded; run them there as
# cm-gpu-test --json results.json and cm-bwd-test --json results.json
set -euo pipefail
cd "$(dirname "$0")/.."

CM_NVRTC_DIR="$(bash scripts/install-nvrtc.sh | tail -n 1)"
export CM_NVRTC_DIR
echo "== NVRTC: $CM_NVRTC_DIR"
cargo build --release --locked -p cm-bench --bins
echo "== embedded kernels (ptxas)"
target/release/cm-gpu-test --kernels
