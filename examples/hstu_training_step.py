"""An HSTU-style training step with jagged users (workloads.md W2), checked against
PyTorch SDPA with a dense mask.

Each step packs a new batch of users of different lengths into one sequence (batch 1). The
`hstu` mask is compiled once; every step only re-plans it for the new `lengths` (no
recompilation, well under a millisecond). The same model runs once with
`compilemask.attention` and once with `scaled_dot_product_attention` and a dense mask built
here straight from the rule, and the losses, gradients and updated weights must agree.

Run: python examples/hstu_training_step.py   (needs torch)
"""

import copy

import torch
import torch.nn.functional as F

import compilemask as cm

torch.manual_seed(0)
DIM, HEADS, CONTEXTUAL, TARGET_DIVISOR = 64, 4, 8, 8


def device_for_compilemask() -> str:
    """CUDA when compilemask's kernels run there, else CPU (the Rust CPU reference)."""
    if torch.cuda.is_available():
        x = torch.zeros(1, 1, 16, 16, device="cuda")
        try:
            cm.attention(x, x, x, cm.builtin("causal").plan(16))
            return "cuda"
        except NotImplementedError:
            pass
    return "cpu"


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
    device = device_for_compilemask()
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
    print(f"hstu training step: OK on {device} (weights agree to {weight_err:.1e})")


if __name__ == "__main__":
    main()
