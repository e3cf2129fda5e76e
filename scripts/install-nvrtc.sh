#!/usr/bin/env bash
# Installs NVRTC 13.0.88 (the version the GPU machine's CUDA 13.0 driver and torch 2.11 use) and
# the CUDA 13.0 headers into a git-ignored venv, then prints the NVRTC library directory.
#
# Usage: scripts/install-nvrtc.sh [VENV_DIR]   (default: .venv-cuda in the repository root)
#   export CM_NVRTC_DIR="$(scripts/install-nvrtc.sh | tail -n 1)"
# Idempotent: when the pinned versions are already installed it only prints the directory.
# Progress goes to stderr so that stdout's last line is always the directory.
set -euo pipefail

NVRTC_VERSION=13.0.88
# Headers (cuda_bf16.h, cuda_fp16.h) of the same CUDA 13.0 release that torch 2.11 pins.
RUNTIME_VERSION=13.0.96

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.venv-cuda}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "creating venv $venv" >&2
    "$python" -m venv "$venv" >&2
fi

installed() {
    "$venv/bin/python" -m pip show "$1" 2>/dev/null | grep -qx "Version: $2"
}

if installed nvidia-cuda-nvrtc "$NVRTC_VERSION" && installed nvidia-cuda-runtime "$RUNTIME_VERSION"; then
    echo "nvidia-cuda-nvrtc $NVRTC_VERSION and nvidia-cuda-runtime $RUNTIME_VERSION already installed" >&2
else
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
        "nvidia-cuda-nvrtc==$NVRTC_VERSION" "nvidia-cuda-runtime==$RUNTIME_VERSION" >&2
fi

lib_dir="$("$venv/bin/python" - <<'PY'
import pathlib, sysconfig
print(pathlib.Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "lib")
PY
)"
for f in libnvrtc.so.13 libnvrtc-builtins.so.13.0; do
    if [ ! -e "$lib_dir/$f" ]; then
        echo "error: $lib_dir/$f is missing after installing nvidia-cuda-nvrtc==$NVRTC_VERSION" >&2
        exit 1
    fi
done
if [ ! -e "$lib_dir/../include/cuda_bf16.h" ]; then
    echo "error: $lib_dir/../include/cuda_bf16.h is missing after installing nvidia-cuda-runtime==$RUNTIME_VERSION" >&2
    exit 1
fi
echo "$lib_dir"
