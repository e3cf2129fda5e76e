#!/usr/bin/env bash
# Builds the `compilemask` Python wheel (PyO3 abi3: one wheel for CPython >= 3.11) into
# dist/. Creates .venv-build with maturin (pinned) on first use; needs a Rust toolchain and
# python3 >= 3.11. Prints the wheel's path as the last line.
#
# The CUDA kernels are embedded (so the wheel runs `compilemask.attention` on Hopper GPUs)
# when NVRTC is at hand: CM_NVRTC_DIR as set, else the pinned wheel that
# scripts/install-nvrtc.sh installs (from PyPI). When neither works the wheel is built
# without kernels, with a warning: it imports and runs everything but the CUDA path, which
# raises a RuntimeError saying how to rebuild. CUBINs are cached by source hash under
# target/cm-kernels-cache, so a rebuild with unchanged kernels compiles nothing.
#   scripts/build-wheel.sh            # release build
#   PROFILE=dev scripts/build-wheel.sh
#   CM_KERNELS=0 scripts/build-wheel.sh   # never embed kernels (no NVRTC install attempt)
set -euo pipefail
cd "$(dirname "$0")/.."

MATURIN_VERSION=1.16.0
VENV=.venv-build
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/maturin" ] || ! "$VENV/bin/maturin" --version | grep -q " $MATURIN_VERSION\$"; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==$MATURIN_VERSION"
fi

if [ "${CM_KERNELS:-1}" = 0 ]; then
    unset CM_NVRTC_DIR
elif [ -z "${CM_NVRTC_DIR:-}" ]; then
    if CM_NVRTC_DIR="$(bash scripts/install-nvrtc.sh | tail -n 1)"; then
        export CM_NVRTC_DIR
    else
        unset CM_NVRTC_DIR
        echo "build-wheel: warning: NVRTC could not be installed; building without CUDA kernels" >&2
    fi
fi
if [ -n "${CM_NVRTC_DIR:-}" ]; then
    echo "build-wheel: CUDA kernels embedded (NVRTC: $CM_NVRTC_DIR)" >&2
else
    echo "build-wheel: CUDA kernels not embedded" >&2
fi

rm -f dist/compilemask-*.whl
mkdir -p dist
args=(build --manifest-path crates/cm-py/Cargo.toml --out dist --locked
      --interpreter "$VENV/bin/python")
if [ "${PROFILE:-release}" = release ]; then
    args+=(--release)
fi
"$VENV/bin/maturin" "${args[@]}" >&2
ls dist/compilemask-*.whl
