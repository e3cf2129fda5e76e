#!/usr/bin/env bash
# Tests the `compilemask` Python package as a user gets it: builds the wheel with
# scripts/build-wheel.sh, installs it into a fresh virtual environment (.venv-test) with
# pytest, and runs tests/python from outside the source tree. Tests that need torch or
# numpy skip when those are missing (CI has neither).
#
# Environment:
#   WHEEL=PATH                 test this wheel instead of building one (no Rust needed)
#   USE_PYTHON_PACKAGES=1      no venv: install the wheel into .venv-test/site on PYTHONPATH
#                              and use $PYTHON's own packages (torch and pytest on the GPU
#                              machine, which has no network)
#   EXAMPLES=1                 also run examples/*.py (they need torch)
#   PYTHON=python3             the interpreter to make the venv from
#   PYTEST_ARGS="..."          extra pytest arguments
#
# On the GPU machine (torch, no Rust, no network), with a wheel built here:
#   WHEEL=$(ls dist/compilemask-*.whl) USE_PYTHON_PACKAGES=1 EXAMPLES=1 scripts/test-python.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONDONTWRITEBYTECODE=1
PYTHON=${PYTHON:-python3}

if [ -z "${WHEEL:-}" ]; then
    WHEEL=$(scripts/build-wheel.sh | tail -n 1)
fi
[ -f "$WHEEL" ] || { echo "test-python: no wheel at '$WHEEL'" >&2; exit 2; }
WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")

VENV=$ROOT/.venv-test
rm -rf "$VENV"
if [ "${USE_PYTHON_PACKAGES:-0}" = 1 ]; then
    PY=$(command -v "$PYTHON")
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
        --target "$VENV/site" "$WHEEL"
    export PYTHONPATH=$VENV/site${PYTHONPATH:+:$PYTHONPATH}
else
    "$PYTHON" -m venv "$VENV"
    PY=$VENV/bin/python
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-index "$WHEEL"
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
    "$PY" -m pip install --quiet --disable-pip-version-check "pytest>=7"
fi

# Run from outside the checkout so `import compilemask` can only find the installed wheel.
cd "$(mktemp -d)"
"$PY" -c "import compilemask, sys; print('compilemask', compilemask.__version__, 'from', compilemask.__file__, 'on Python', sys.version.split()[0])"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null \
    || echo "torch: not installed (torch tests skip)"
# shellcheck disable=SC2086
"$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT/tests/python" "$ROOT/tests/python" ${PYTEST_ARGS:-}

if [ "${EXAMPLES:-0}" = 1 ]; then
    for example in "$ROOT"/examples/*.py; do
        echo "== $(basename "$example")"
        "$PY" "$example"
    done
fi
