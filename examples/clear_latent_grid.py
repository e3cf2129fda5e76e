"""A CLEAR attention block (workloads.md W4) on a 64 x 64 latent grid after 512 text
tokens, checked against PyTorch SDPA with a dense mask.

Text tokens see everything; image tokens see all text and the image tokens within
Euclidean distance < 16 on the grid. The mask is the built-in `clear` (a language-level
`l2(img) < radius` ball, solved row by row with integer square roots, no pair testing).
Forward and backward of one transformer-style block (float32, on the CPU reference) must
match SDPA with a dense mask built here from the rule; on a Hopper GPU the same plan also
runs through the CUDA kernels in bfloat16 against SDPA.

Run: python examples/clear_latent_grid.py   (needs torch)
"""

import copy

import torch
import torch.nn.functional as F

import compilemask as cm

torch.manual_seed(0)
TEXT, GRID, RADIUS = 512, 64, 16
DIM, HEADS = 64, 2


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


def clear_dense(text: int, grid: int, radius: int) -> torch.Tensor:
    n = text + grid * grid
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:text] = True
    mask[:, :text] = True
    y, x = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    y, x = y.reshape(-1), x.reshape(-1)
    d2 = (y[:, None] - y[None, :]) ** 2 + (x[:, None] - x[None, :]) ** 2
    mask[text:, text:] = d2 < radius * radius
    return mask


class ClearBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x, attend):
        n = x.shape[1]
        q, k, v = self.qkv(self.norm(x)).view(1, n, 3, HEADS, DIM // HEADS).permute(
            2, 0, 3, 1, 4)
        return x + self.out(attend(q, k, v).transpose(1, 2).reshape(1, n, DIM))


def main() -> None:
    device = "cpu"  # the float32 model runs the CPU reference; check_cuda_kernels the GPU
    n = TEXT + GRID * GRID
    plan = cm.builtin("clear", text=TEXT, radius=RADIUS).plan(n)  # grid defaults to 64
    dense = clear_dense(TEXT, GRID, RADIUS)
    assert torch.equal(plan.to_dense(format="torch")[0, 0], dense)
    print(f"{n} tokens: visible {plan.visible_pairs / n**2:.3f} of the square, up to "
          f"{plan.max_intervals_per_row} intervals per row, tiles {plan.tiles}, "
          f"plan {plan.compile_ms:.3f} ms")

    block = ClearBlock().to(device)
    ref = copy.deepcopy(block)
    x = torch.randn(1, n, DIM, device=device)
    mask = dense.to(device)
    y = block(x, lambda q, k, v: cm.attention(q, k, v, plan))
    y_ref = ref(x, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    err = (y - y_ref).abs().max().item()
    print(f"max output diff {err:.2e}")
    assert err < 1e-5
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    y_ref.backward(grad_out)
    grad_err = max((a.grad - b.grad).abs().max().item()
                   for a, b in zip(block.parameters(), ref.parameters()))
    print(f"max grad diff {grad_err:.2e}")
    assert grad_err < 1e-3
    check_cuda_kernels(plan, dense, heads=HEADS)
    print(f"clear block: OK on {device}")


if __name__ == "__main__":
    main()
