"""Token orders (issue 6): `program.plan(order=...)`, `plan.order`, the density numbers, and
`compilemask.permute` / `unpermute`.

The densities are checked against an independent count from the raster plan's intervals
and the permutation; the attention tests (torch, float64, CPU reference) check that
attention with an ordered plan on permuted tensors, un-permuted, equals raster attention.
"""

from __future__ import annotations

import math
import random

import pytest

import compilemask as cm

# A CLEAR grid small enough for the CPU reference where a patch order beats raster order at
# 32 x 32 tiles: 16 text tokens, a 32 x 32 grid, radius 5.
TEXT, GRID, RADIUS, BLOCK = 16, 32, 5, 32
N = TEXT + GRID * GRID


def clear(**kw):
    return cm.builtin("clear", text=TEXT, grid=GRID, radius=RADIUS).plan(
        N, block_size=BLOCK, **kw)


def order_list(plan) -> list[int]:
    o = plan.order
    return o if isinstance(o, list) else o.tolist()


def computed_pairs_in_order(raster, order: list[int], block: int) -> int:
    """In-range pairs of the tiles that hold a visible pair, with the raster plan's rows and
    keys moved to their new positions (new position i holds original token order[i])."""
    n = raster.q_len
    inverse = [0] * n
    for i, o in enumerate(order):
        inverse[o] = i
    tiles = set()
    for i, o in enumerate(order):
        for s, e in raster.intervals(o):
            for k in range(s, e):
                tiles.add((i // block, inverse[k] // block))
    side = lambda t: min(block, n - t * block)  # noqa: E731
    return sum(side(m) * side(j) for m, j in tiles)


def test_auto_order_keeps_visible_pairs_and_raises_density():
    raster, auto = clear(), clear(order="auto")
    assert raster.order is None and raster.order_info() is None
    assert raster.order_candidates == []
    order = order_list(auto)
    assert sorted(order) == list(range(N))
    assert order[:TEXT] == list(range(TEXT)), "the text prefix keeps its place"
    assert order != list(range(N))
    assert auto.visible_pairs == raster.visible_pairs == 95216
    # Exact computed pairs, by an independent count.
    assert raster.computed_pairs == computed_pairs_in_order(raster, list(range(N)), BLOCK)
    assert auto.computed_pairs == computed_pairs_in_order(raster, order, BLOCK)
    assert (auto.raster_computed_pairs, auto.computed_pairs) == (389376, 303360)
    info = auto.order_info()
    assert info["raster_computed_pairs"] == raster.computed_pairs
    assert info["tile_density_before"] == pytest.approx(raster.tile_density)
    assert info["tile_density_after"] == pytest.approx(auto.tile_density)
    assert round(info["tile_density_before"], 4) == 0.2445
    assert round(info["tile_density_after"], 4) == 0.3139
    assert info["traversal"] in ("rowmajor", "boustrophedon", "hilbert")
    assert len(info["patch"]) == 3
    cands = auto.order_candidates
    assert [c["computed_pairs"] for c in cands] == sorted(c["computed_pairs"] for c in cands)
    assert cands[0]["computed_pairs"] == auto.computed_pairs
    assert raster.computed_pairs in [c["computed_pairs"] for c in cands]
    assert auto.stats()["order"] == info
    assert "order" not in raster.stats()


def test_explicit_order_plans_the_permuted_mask():
    raster = clear()
    rng = random.Random(0)
    order = list(range(N))
    rng.shuffle(order)
    plan = clear(order=order)
    assert order_list(plan) == order
    assert plan.order_info()["traversal"] is None
    assert plan.computed_pairs == computed_pairs_in_order(raster, order, BLOCK)
    inverse = {o: i for i, o in enumerate(order)}
    for i in (0, 1, 17, 500, N - 1):
        keys = sorted(inverse[k] for s, e in raster.intervals(order[i]) for k in range(s, e))
        assert [k for s, e in plan.intervals(i) for k in range(s, e)] == keys
    # Any sequence of ints works: a tuple, a range.
    assert clear(order=tuple(order)).computed_pairs == plan.computed_pairs
    assert clear(order=range(N)).computed_pairs == raster.computed_pairs
    assert clear(order="raster").order is None


def shuffled_tree(n: int, seed: int) -> list[int]:
    """A 3-ary tree of ``n`` nodes (heap numbering) with its labels shuffled, so that parents
    may come after their children: ``parents[i]`` is node i's parent, -1 for the root."""
    perm = list(range(n))
    random.Random(seed).shuffle(perm)
    parents = [-1] * n
    for i in range(1, n):
        parents[perm[i]] = perm[(i - 1) // 3]
    return parents


TREE_PROMPT, TREE_NODES = 7, 300
TREE_SRC = ("param parents: [int];\nparam prompt: int;\ntree t = parents at prompt;\n"
            "mask = k < prompt & k <= q | k in t.path(q);")


def tree_plan(**kw):
    parents = shuffled_tree(TREE_NODES, 3)
    return cm.compile(TREE_SRC).plan(TREE_PROMPT + TREE_NODES, block_size=16,
                                     parents=parents, prompt=TREE_PROMPT, **kw)


def test_auto_order_of_a_tree_is_its_preorder():
    raster, auto = tree_plan(), tree_plan(order="auto")
    n = TREE_PROMPT + TREE_NODES
    order = order_list(auto)
    assert sorted(order) == list(range(n))
    assert order[:TREE_PROMPT] == list(range(TREE_PROMPT)), "the prompt keeps its place"
    parents = shuffled_tree(TREE_NODES, 3)
    # Preorder: every node comes right after its parent or after a subtree of an earlier
    # sibling, so each node's parent precedes it, and the root comes first.
    position = {o: i for i, o in enumerate(order)}
    for node, p in enumerate(parents):
        if p >= 0:
            assert position[TREE_PROMPT + p] < position[TREE_PROMPT + node]
        else:
            assert position[TREE_PROMPT + node] == TREE_PROMPT
    assert auto.visible_pairs == raster.visible_pairs
    assert auto.computed_pairs == computed_pairs_in_order(raster, order, 16)
    assert auto.computed_pairs < raster.computed_pairs
    info = auto.order_info()
    assert info["traversal"] == "preorder" and info["patch"] is None
    assert info["raster_computed_pairs"] == raster.computed_pairs
    inverse = {o: i for i, o in enumerate(order)}
    for i in (0, TREE_PROMPT, TREE_PROMPT + 1, 150, n - 1):
        keys = sorted(inverse[k] for s, e in raster.intervals(order[i]) for k in range(s, e))
        assert [k for s, e in auto.intervals(i) for k in range(s, e)] == keys


@pytest.mark.parametrize("kwargs,code", [
    ({"order": [0, 0, 1]}, "CM0407"),
    ({"order": [0, 1]}, "CM0407"),
    ({"order": [0, 1, -1]}, "CM0407"),
    ({"order": "auto"}, "CM0406"),
    ({"order": "auto", "kv_len": 4}, "CM0405"),
])
def test_order_errors(kwargs, code):
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("causal").plan(3, **kwargs)
    assert e.value.code == code


def test_order_type_errors():
    with pytest.raises(ValueError, match="raster"):
        cm.builtin("causal").plan(3, order="hilbert")
    with pytest.raises(TypeError, match="order"):
        cm.builtin("causal").plan(3, order=3)
    with pytest.raises(TypeError, match=r"order\[1\]"):
        cm.builtin("causal").plan(3, order=[0, 1.5, 2])


# ------------------------------------------------------------------ torch

def _qkv(torch, b, h, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(3)]


def test_order_tensor_and_permute_helpers(torch):
    auto = clear(order="auto")
    order = auto.order
    assert order.dtype == torch.int64 and order.shape == (N,)
    x = torch.randn(2, 3, N, 4, dtype=torch.float64)
    p = cm.permute(x, auto)
    assert torch.equal(p[:, :, 5], x[:, :, order[5]])
    assert torch.equal(cm.unpermute(p, auto), x)
    # Other layouts: tokens along dim 1 of [batch, seq, features].
    y = torch.randn(2, N, 8)
    assert torch.equal(cm.unpermute(cm.permute(y, auto, dim=1), auto, dim=1), y)
    raster = clear()
    assert cm.permute(x, raster) is x and cm.unpermute(x, raster) is x
    # An auto order that found raster order best, and an explicit identity, are raster
    # plans: order None (it was an identity tensor, and permute copied). Their reports
    # still say what was chosen, as `compilemask plan --json` does: auto's raster as the
    # patch (1, 1, width) row-major among its candidates, the identity as a permutation.
    small = cm.builtin("clear", text=5, grid=9, radius=2)
    auto_raster = small.plan(86, order="auto", block_size=16)
    identity = small.plan(86, order=list(range(86)), block_size=16)
    for kept in (auto_raster, identity):
        assert kept.order is None
        info = kept.order_info()
        assert info["tile_density_before"] == info["tile_density_after"] == pytest.approx(kept.tile_density)
        assert kept.stats()["order"] == info
        z = torch.randn(1, 1, 86, 2)
        assert cm.permute(z, kept) is z
    assert (auto_raster.order_info()["patch"], auto_raster.order_info()["traversal"]) == ((1, 1, 9), "rowmajor")
    assert auto_raster.order_info()["candidates"][0]["computed_pairs"] == auto_raster.computed_pairs
    assert identity.order_info()["traversal"] is None and identity.order_info()["candidates"] == []
    with pytest.raises(ValueError, match="q_len"):
        cm.permute(x[:, :, :-1], auto)
    with pytest.raises(IndexError, match=r"dim = 4 is out of range for a 4-D tensor; expected -4 \.\.= 3"):
        cm.permute(x, auto, dim=4)
    with pytest.raises(IndexError, match="dim = -5"):
        cm.unpermute(x, auto, dim=-5)
    with pytest.raises(TypeError, match="dim must be an int, got float 1.0"):
        cm.permute(x, auto, dim=1.0)
    with pytest.raises(TypeError, match="Plan"):
        cm.permute(x, auto.to_tensors())  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["auto", "random", "tree"])
def test_attention_in_order_equals_raster_attention(torch, order):
    raster = clear()
    n = N
    if order == "random":
        perm = list(range(N))
        random.Random(1).shuffle(perm)
        plan = clear(order=perm)
    elif order == "tree":
        raster, plan = tree_plan(), tree_plan(order="auto")
        n = raster.q_len
    else:
        plan = clear(order="auto")
    q, k, v = _qkv(torch, 1, 2, n, 8)
    out, lse = cm.attention(q, k, v, raster, return_lse=True)
    pout, plse = cm.attention(cm.permute(q, plan), cm.permute(k, plan), cm.permute(v, plan),
                              plan, return_lse=True)
    assert (cm.unpermute(pout, plan) - out).abs().max().item() < 1e-12
    assert (cm.unpermute(plse, plan, dim=2) - lse).abs().max().item() < 1e-12
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    pgrads = torch.autograd.grad((cm.unpermute(pout, plan) * w).sum(), (q, k, v))
    for a, b in zip(grads, pgrads):
        assert (a - b).abs().max().item() < 1e-10
    assert math.isfinite(lse.sum().item())
