#!/usr/bin/env bash
# Builds the `compilemask` Python wheel (PyO3 abi3: one wheel for CPython >= 3.11) into
# dist/. Creates .venv-build with maturin (pinned) on first use; needs a Rust toolchain and
# python3 >= 3.11. Prints the wheel's path as the last line.
#   scripts/build-wheel.sh            # release build
#   PROFILE=dev scripts/build-wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."

MATURIN_VERSION=1.16.0
VENV=.venv-build
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/maturin" ] || ! "$VENV/bin/maturin" --version | grep -q " $MATURIN_VERSION\$"; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==$MATURIN_VERSION"
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
