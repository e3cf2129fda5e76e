"""A reward model scoring 8 responses that share one prompt (workloads.md W3), checked
against PyTorch SDPA with a dense mask.

The prompt and its 8 responses are packed into one sequence: prompt rows are causal;
each response sees the whole prompt and itself causally, never another response. So the
prompt is encoded once instead of 8 times. Each response's score is read at its last
token. `compilemask.attention` and SDPA with a dense mask (built here from the rule) must
give the same scores and gradients (float32, on the CPU reference). Where a GPU is present,
the same compiled mask also runs through FlexAttention (`plan.to_block_mask()`), and on a
Hopper GPU through the CompileMask CUDA kernels in bfloat16.

Run: python examples/reward_model_shared_prefix.py   (needs torch)
"""

import copy

import torch
import torch.nn.functional as F

import compilemask as cm

torch.manual_seed(0)
VOCAB, DIM, HEADS = 1000, 64, 4
PROMPT = 1536
RESPONSES = [384, 512, 640, 256, 768, 448, 320, 576]


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


def shared_prefix_dense(prompt: int, responses: list[int]) -> torch.Tensor:
    total = prompt + sum(responses)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:prompt, :prompt] = torch.ones(prompt, prompt, dtype=torch.bool).tril()
    o = prompt
    for n in responses:
        mask[o:o + n, :prompt] = True
        mask[o:o + n, o:o + n] = torch.ones(n, n, dtype=torch.bool).tril()
        o += n
    return mask


class RewardModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.score = torch.nn.Linear(DIM, 1)

    def forward(self, tokens, last_rows, attend):
        x = self.embed(tokens)[None]  # [1, n, DIM]
        n = x.shape[1]
        q, k, v = self.qkv(x).view(1, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        h = x + self.out(attend(q, k, v).transpose(1, 2).reshape(1, n, DIM))
        return self.score(h[0, last_rows]).squeeze(-1)  # one score per response


def main() -> None:
    device = "cpu"  # the float32 model runs the CPU reference; check_cuda_kernels the GPU
    total = PROMPT + sum(RESPONSES)
    plan = cm.builtin("shared_prefix", prompts=[PROMPT], responses=RESPONSES,
                      group=len(RESPONSES)).plan(total)
    dense = shared_prefix_dense(PROMPT, RESPONSES)
    assert torch.equal(plan.to_dense(format="torch")[0, 0], dense)
    print(f"{total} tokens: visible pairs {plan.visible_pairs} "
          f"({plan.visible_pairs / total**2:.3f} of the square), tiles {plan.tiles}, "
          f"plan {plan.compile_ms:.3f} ms")

    ends = torch.tensor(RESPONSES).cumsum(0) + PROMPT - 1
    tokens = torch.randint(0, VOCAB, (total,), device=device)
    preferred = torch.tensor([1.0, 0, 0, 1, 0, 1, 0, 0], device=device)
    ours = RewardModel().to(device)
    ref = copy.deepcopy(ours)

    scores = ours(tokens, ends, lambda q, k, v: cm.attention(q, k, v, plan))
    mask = dense.to(device)
    scores_ref = ref(tokens, ends,
                     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    print("scores      ", [round(s, 4) for s in scores.tolist()])
    print("scores (sdpa)", [round(s, 4) for s in scores_ref.tolist()])
    assert (scores - scores_ref).abs().max().item() < 1e-5
    F.binary_cross_entropy_with_logits(scores, preferred).backward()
    F.binary_cross_entropy_with_logits(scores_ref, preferred).backward()
    grad_err = max((a.grad - b.grad).abs().max().item()
                   for a, b in zip(ours.parameters(), ref.parameters()))
    print(f"max grad diff {grad_err:.2e}")
    assert grad_err < 1e-5

    if torch.cuda.is_available():
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = torch.randn(3, 1, HEADS, total, DIM // HEADS, device="cuda").unbind(0)
        block_mask = plan.to_block_mask("cuda")
        out = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
        out_ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense.cuda())
        err = (out - out_ref).abs().max().item()
        print(f"FlexAttention with the compiled block mask on CUDA: max diff {err:.2e}")
        assert err < 1e-3
    check_cuda_kernels(plan, dense)
    print(f"reward model: OK on {device}")


if __name__ == "__main__":
    main()
