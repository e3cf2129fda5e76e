#!/usr/bin/env bash
# The issues' same-run benchmark on the GPU machine: the peers of ../shared/peers and our
# `compilemask bench --bwd --deterministic` in one device call, per configuration, with the
# JSON named as the issues name it (<gpu>-<commit>-<cfg>-{peers,bench}.json).
#
# Before it, on the same warm machine (a transfer holds 64 MiB, so each half goes alone):
#   call A, carry .peers/a:  mkdir -p /tmp/peers && cp .peers/a/* /tmp/peers/
#   call B, carry .peers/b:  bash .peers/b/install.sh
# then call C with this repository's release binary carried (it has no Rust there):
#   BIN=/tmp/compilemask COMMIT=abc1234 scripts/same-run.sh "$OUT" h16d128 gqa32x8 h16d64
#
# Configurations: h16d128 (8192 and 32768 tokens), gqa32x8 and h16d64 (32768). Peers and
# ours each stop at PEERS_TIMEOUT / OURS_TIMEOUT seconds (run_peers.py rewrites its JSON
# after every row, so a stopped run keeps what it measured). Prints both tables.
set -u
out=${1:?usage: scripts/same-run.sh OUT_DIR CFG...}
shift
bin=${BIN:?BIN: the compilemask binary to time}
commit=${COMMIT:?COMMIT: the commit the binary was built from}
[ -d /tmp/peers/site ] || { echo "same-run: /tmp/peers/site is missing: stage the peers first (see the header)" >&2; exit 2; }
mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
case $gpu in *H100*) g=h100 ;; *H200*) g=h200 ;; *) g=gpu ;; esac
export PYTHONPATH=/tmp/peers/site:/tmp/peers/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
for cfg in "$@"; do
    case $cfg in
        h16d128) peers=(--sizes 8192,32768); ours=(--sizes 8192,32768) ;;
        gqa32x8) peers=(--sizes 32768 --heads 32,8); ours=(--sizes 32768 --heads 32 --kv-heads 8) ;;
        h16d64) peers=(--sizes 32768 --head-dim 64); ours=(--sizes 32768 --head-dim 64) ;;
        *) echo "same-run: unknown configuration '$cfg' (h16d128, gqa32x8 or h16d64)" >&2; exit 2 ;;
    esac
    echo "== $cfg on $gpu"
    (cd /tmp/peers && timeout "${PEERS_TIMEOUT:-300}" python3 run_peers.py "${peers[@]}" \
        --json "$out/$g-$commit-$cfg-peers.json") > "$out/peers-$cfg.txt" 2>&1
    grep -A 20 "^effective TFLOP/s" "$out/peers-$cfg.txt" || tail -n 5 "$out/peers-$cfg.txt"
    timeout "${OURS_TIMEOUT:-220}" "$bin" bench --bwd --deterministic "${ours[@]}" \
        -o "$out/$g-$commit-$cfg-bench.json" > "$out/bench-$cfg.txt" 2>&1
    grep -E "^(id|W[0-9])" "$out/bench-$cfg.txt" || tail -n 5 "$out/bench-$cfg.txt"
done
