"""Host time of the CUDA kernels' descriptor of a plan (`Plan.kernel_arrays`: every tile list
and partial-tile bit array the forward and backward kernels read, `cm_cuda::HostPlan`), the
host work of each training step whose mask changes (packed documents): best of 7 calls after
one `Program.plan`; with torch installed, also the Python side that turns the arrays into
the kernels' tensors (`compilemask._torch._kernel_tensors`, on the CPU: everything before
the transfer to the GPU). CPU only.

    python scripts/bench-descriptor.py
"""

import time, random, sys, compilemask as cm
random.seed(0)
def docs(total):
    out=[]
    while sum(out) < total:
        out.append(random.randint(256, 4096))
    out[-1] -= sum(out)-total
    return out
try:
    import torch
    from compilemask._torch import _kernel_tensors
except ImportError:
    torch = None
print("| mask | q_len = kv_len | plan ms | descriptor ms (best of 7) | MiB | tensors ms |")
print("|---|---|---|---|---|---|")
for total in (8192, 32768, 131072):
    for name, prog in [("causal", cm.builtin("causal")), ("document_causal", cm.builtin("document_causal", lengths=docs(total))),
                       ("sliding_window 1024", cm.builtin("sliding_window", window=1024))]:
        t0=time.perf_counter(); plan = prog.plan(total); tp=time.perf_counter()-t0
        best=1e9
        for _ in range(7):
            t0=time.perf_counter(); arrs = plan._native.kernel_arrays(); best=min(best, time.perf_counter()-t0)
        tensors = "-"
        if torch is not None:
            t_best = 1e9
            for _ in range(7):
                t0 = time.perf_counter()
                _kernel_tensors(torch, arrs, torch.device("cpu"))
                t_best = min(t_best, time.perf_counter() - t0)
            tensors = f"{t_best * 1e3:.2f}"
        print(f"| {name} | {total} | {tp*1e3:.2f} | {best*1e3:.2f} | "
              f"{sum(len(a) for a in arrs)/2**20:.1f} | {tensors} |")
