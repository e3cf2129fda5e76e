#!/usr/bin/env bash
# The explorer page (`compilemask show ... -o NAME.html`) in a real headless browser:
# Chromium and its driver from the Debian packages `chromium` and `chromium-driver`
# (installed with apt-get when missing, which needs root), driven by Selenium from PyPI in
# a virtual environment (.venv-browser, made once and reused), pytest over tests/browser.
# Idempotent: a second run installs nothing.
#
# Usage: scripts/test-browser.sh [COMPILEMASK]   (default: target/release/compilemask)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/compilemask}
[ -x "$BIN" ] || { echo "test-browser: no compilemask binary at '$BIN' (cargo build --release -p cm-cli)" >&2; exit 2; }

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
        echo "test-browser: chromium and chromedriver are missing; install the Debian packages chromium and chromium-driver (as root)" >&2
        exit 2
    fi
    echo "test-browser: installing chromium and chromium-driver (Debian)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver >/dev/null
fi

VENV=.venv-browser
if ! "$VENV/bin/python" -c "import selenium, PIL, pytest" 2>/dev/null; then
    rm -rf "$VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "selenium>=4.20,<5" "pillow>=10" "pytest>=7"
fi
chromium --version
CM_BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN") \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/browser
