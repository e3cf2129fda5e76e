"""An HSTU-style training step with jagged users (workloads.md W2), checked against
PyTorch SDPA with a dense mask.

Each step packs a new batch of users of different lengths into one sequence (batch 1). The
`hstu` mask is compiled once; every step only re-plans it for the new `lengths` (no
recompilation, well under a millisecond). The same model runs once with
`compilemask.attention` and once with `scaled_dot_product_attention` and a dense mask built
here straight from the rule, and the losses, gradients and updated weights must agree (float32,
on the CPU reference). On a Hopper GPU the last step's plan also runs through the CUDA
kernels in bfloat16 against SDPA.

Run: python examples/hstu_training_step.py   (needs torch)
"""

import copy

import torch
import torch.nn.functional as F

import compilemask as cm

torch.manual_seed(0)
DIM, HEADS, CONTEXTUAL, TARGET_DIVISOR = 64, 4, 8, 8


def check_cuda_kernels(plan, dense: torch.Tensor, heads: int = 4) -> None:
    """On a Hopper GPU: the same plan through the CompileMask CUDA kernels (bfloat16,
    head_dim 64) against SDPA with the dense mask in float32, outputs and gradients."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("CUDA kernels: skipped (they need a Hopper GPU)")
        return
    n = plan.q_len
    q, k, v = (torch.randn(1, heads, n, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = cm.attention(q, k, v, plan)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=dense.cuda())
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.bfloat16())
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
    err = (out.float() - ref).abs().max().item()
    grad_err = max(((a.float() - b).abs().max() / b.abs().max()).item()
                   for a, b in zip(grads, ref_grads))
    print(f"CUDA kernels (bfloat16, {heads} heads, head_dim 64): max output diff {err:.2e}, "
          f"max relative grad diff {grad_err:.2e}")
    assert err < 2e-2 and grad_err < 3e-2


def hstu_dense(lengths: list[int]) -> torch.Tensor:
    """The W2 rule, pair by pair: per user at offset o of length n, T = max(1, n // 8)
    targets at the end see the history [o, o + n - T) and themselves; the first 8 rows see
    the history; other rows see [o, q]."""
    total = sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.bool)
    o = 0
    for n in lengths:
        t = max(1, n // TARGET_DIVISOR)
        end_hist = o + n - t
        for q in range(o, o + n):
            if q >= end_hist:
                mask[q, o:end_hist] = True
                mask[q, q] = True
            elif q - o < CONTEXTUAL:
                mask[q, o:end_hist] = True
            else:
                mask[q, o:q + 1] = True
        o += n
    return mask


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x, attend):
        n = x.shape[1]
        q, k, v = self.qkv(x).view(1, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        o = attend(q, k, v)  # [1, heads, n, head_dim]
        return x + self.out(o.transpose(1, 2).reshape(1, n, DIM))


def main() -> None:
    device = "cpu"  # the float32 model runs the CPU reference; check_cuda_kernels the GPU
    program = cm.builtin("hstu", contextual=CONTEXTUAL, target_divisor=TARGET_DIVISOR)
    ours = Block().to(device)
    ref = copy.deepcopy(ours)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        lengths = torch.randint(40, 400, (6,)).tolist()
        total = sum(lengths)
        plan = program.plan(total, lengths=lengths)
        dense = hstu_dense(lengths).to(device)
        assert torch.equal(plan.to_dense(format="torch")[0, 0].to(device), dense)
        x = torch.randn(1, total, DIM, device=device)
        target = torch.randn(1, total, DIM, device=device)

        loss = F.mse_loss(ours(x, lambda q, k, v: cm.attention(q, k, v, plan)), target)
        loss_ref = F.mse_loss(
            ref(x, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)),
            target,
        )
        for opt, l in ((opt_ours, loss), (opt_ref, loss_ref)):
            opt.zero_grad()
            l.backward()
        grad_err = max((a.grad - b.grad).abs().max().item()
                       for a, b in zip(ours.parameters(), ref.parameters()))
        print(f"step {step}: {len(lengths)} users, {total} tokens, plan "
              f"{plan.compile_ms:.3f} ms, visible {plan.visible_pairs / total**2:.3f}, "
              f"loss {loss.item():.6f} (sdpa {loss_ref.item():.6f}), max grad diff {grad_err:.2e}")
        assert abs(loss.item() - loss_ref.item()) < 1e-5
        assert grad_err < 1e-4
        opt_ours.step()
        opt_ref.step()
    weight_err = max((a - b).abs().max().item()
                     for a, b in zip(ours.parameters(), ref.parameters()))
    assert weight_err < 1e-5, weight_err
    check_cuda_kernels(plan, dense)
    print(f"hstu training step: OK on {device} (weights agree to {weight_err:.1e})")


if __name__ == "__main__":
    main()
