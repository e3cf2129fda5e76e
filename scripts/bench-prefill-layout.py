"""Host time and size of serving's prefill layouts (`Step.prefill_arrays`: the step laid out
for the paged forward, `cm_serve::StepPlan::prefill` and the descriptor of its 128 x 128
lists). CPU only, no torch: best of `--repeat` calls per step shape, each row repeated
`--row-group` times (the query heads of a kv head packed as rows: 4 for GQA 32/8).

    python scripts/bench-prefill-layout.py [--repeat 5] [--row-group 4]
"""

import argparse
import time

import compilemask as cm

# (name, q_len per sequence, kv_len per sequence): a prefill chunk's shapes, shared-prompt
# scoring (issue 16's target), tree-sized steps, and one row per sequence (decode-shaped,
# which "auto" leaves to the decode kernel).
STEPS = [
    ("shared prompt: 16 responses of 512 over 8K", [512] * 16, [8704] * 16),
    ("chunks: 4 x 2048 rows over 32K", [2048] * 4, [32768] * 4),
    ("64 sequences x 64 rows over 128K", [64] * 64, [131072] * 64),
    ("256 sequences x 1 row over 128K", [1] * 256, [131072] * 256),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--row-group", type=int, default=4)
    args = parser.parse_args()
    causal = cm.builtin("causal")
    print(f"row_group {args.row_group}")
    print("| step | virtual rows / total_q | host ms (best) | descriptor MiB | key_blocks MiB |")
    print("|---|---|---|---|---|")
    for name, q_len, kv_len in STEPS:
        step = causal.plan_step(q_len, kv_len)
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            arrays, blocks, _, _, q_rows = step._native.prefill_arrays(args.row_group)
            best = min(best, time.perf_counter() - t0)
        mib = sum(len(a) for a in arrays) / 2**20
        print(f"| {name} | {q_rows} / {step.total_q} | {best * 1e3:.2f} | {mib:.2f} | "
              f"{len(blocks) / 2**20:.2f} |")


if __name__ == "__main__":
    main()
