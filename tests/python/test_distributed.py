"""Context parallelism (`compilemask.distributed`): the sharding's balance and errors (no
torch needed), and with torch the simulated ranks and real ranks over torch.distributed
(gloo processes on CPU; NCCL on GPUs runs the same code) against `compilemask.attention` on
the whole sequence: output, lse and gradients, for W1, W2, W3, W6, W7 and W8 at odd lengths
and 2 and 4 ranks."""

from __future__ import annotations

import math
import os

import pytest

import compilemask as cm
from compilemask.distributed import ContextParallel

# The workloads context parallelism is for, at small odd lengths (docs/workloads.md's
# builtins with shorter documents).
WORKLOADS = [
    ("W1 causal", lambda n: cm.builtin("causal").plan(n)),
    ("W2 hstu", lambda n: cm.builtin("hstu", lengths=[n // 3, n // 4, n - n // 3 - n // 4],
                                     contextual=2, target_divisor=4).plan(n)),
    ("W3 shared_prefix", lambda n: cm.builtin(
        "shared_prefix", prompts=[n // 4, n // 5], responses=[n // 8, n // 8, n // 7,
                                                             n - n // 4 - n // 5 - n // 4 - n // 7],
        group=2).plan(n)),
    ("W6 document_causal", lambda n: cm.builtin(
        "document_causal", lengths=[n // 2, n // 7, n - n // 2 - n // 7]).plan(n)),
    ("W7 trace_documents", lambda n: cm.builtin("trace_documents").plan(n)),
    ("W8 trace_prompt_groups", lambda n: cm.builtin("trace_prompt_groups").plan(n)),
]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_causal_work_is_balanced(ranks):
    cp = ContextParallel(cm.builtin("causal").plan(65536), ranks=ranks)
    mean = sum(cp.work) / ranks
    assert all(abs(w - mean) <= 0.01 * mean for w in cp.work), cp.work
    mean_c = sum(cp.computed_pairs) / ranks
    assert all(abs(c - mean_c) <= 0.05 * mean_c for c in cp.computed_pairs)
    assert sum(cp.work) == cm.builtin("causal").plan(65536).visible_pairs
    assert [cp.shard_len(r) for r in range(ranks)] == [65536 // ranks] * ranks


def test_documents_fetch_fewer_keys_than_ring_attention():
    plan = cm.builtin("document_causal", lengths=[4096, 1024, 8192, 512] * 4).plan(55296)
    cp = ContextParallel(plan, ranks=4)
    for r in range(4):
        assert cp.fetched(r) < cp.ring_fetched(r) == 55296 - cp.shard_len(r)
        assert cp.keys(r, r)  # its own rows see some of its own keys


def test_the_default_chunk_gives_the_deal_room():
    """The CLI's default (one rule, ``cm_shard::default_chunk``): the largest of 512, 256, 128,
    64 with 4 chunks per rank, else 64, or len // ranks when 64 gives fewer chunks than ranks."""
    for q_len, ranks, chunk in [(1000, 2, 128), (1000, 3, 64), (4096, 2, 512), (4096, 8, 128),
                                (200, 5, 40), (100, 64, 1)]:
        cp = ContextParallel(cm.builtin("causal").plan(q_len), ranks=ranks)
        assert cp.chunk == chunk, (q_len, ranks, cp.chunk)
    # Causal 1000 over 2 balances (2 chunks of 512 kept the split by positions' 1.5x).
    cp = ContextParallel(cm.builtin("causal").plan(1000), ranks=2)
    assert max(cp.work) / (sum(cp.work) / 2) < 1.02


def test_errors_name_the_value():
    causal = cm.builtin("causal").plan(100)
    with pytest.raises(ValueError, match="fewer than ranks = 8"):
        ContextParallel(causal, ranks=8, chunk=64)
    with pytest.raises(ValueError, match=r"ranks must be in \[1, 4294967295\], got 0"):
        ContextParallel(causal, ranks=0)
    with pytest.raises(ValueError, match=r"chunk must be in \[1, 4294967295\], got 0"):
        ContextParallel(causal, ranks=2, chunk=0)
    # Past 32 bits: the same error, not the native conversion's OverflowError.
    with pytest.raises(ValueError, match=f"ranks must be in .*, got {2**70}"):
        ContextParallel(causal, ranks=2**70)
    with pytest.raises(ValueError, match=f"chunk must be in .*, got {2**32}"):
        ContextParallel(causal, ranks=1, chunk=2**32)
    # Wrong types are TypeErrors, bools included.
    with pytest.raises(TypeError, match="ranks must be an int, got float 1.5"):
        ContextParallel(causal, ranks=1.5)
    with pytest.raises(TypeError, match="chunk must be an int, got bool True"):
        ContextParallel(causal, ranks=2, chunk=True)
    with pytest.raises(ValueError, match="q_len = 100 and kv_len = 120 differ"):
        ContextParallel(cm.builtin("causal").plan(100, 120), ranks=2)
    per_batch = cm.compile("mask = k <= q + b;").plan(64, batch=2)
    with pytest.raises(ValueError, match="batch = 2 and 2 distinct masks"):
        ContextParallel(per_batch, ranks=2)
    # Biases read the positions a part renumbers, each named; softcaps, sinks and constant biases are carried.
    for name, reason in [
        ("causal_alibi", "the linear bias reads the positions q and k, which a part renumbers"),
        ("t5_relative_bias", "the bias table reads the distance q - k, which a part renumbers"),
    ]:
        with pytest.raises(ValueError, match="score terms") as e:
            ContextParallel(cm.builtin(name).plan(100), ranks=2)
        assert reason in str(e.value), (name, str(e.value))
    for name in ("causal_softcap", "sliding_window_sinks"):
        ContextParallel(cm.builtin(name).plan(100, num_heads=4), ranks=2)
    ContextParallel(cm.compile("mask = k <= q;\nscore = score + [0.5, -1][h];").plan(
        100, num_heads=2), ranks=2)
    with pytest.raises(TypeError, match="compilemask.Plan"):
        ContextParallel("causal", ranks=2)
    cp = ContextParallel(causal, ranks=2, chunk=10)
    with pytest.raises(IndexError, match="rank = 2 is out of range"):
        cp.fetched(2)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        cp.shard([0] * 100, 0)


# Every public method taking a rank or source index, as (name, call with (rank, source)); the
# others of a call get a valid rank. shard, key_index and order need torch: below.
RANK_METHODS = [
    ("shard_len", ("rank",), lambda cp, r, s: cp.shard_len(r)),
    ("fetched", ("rank",), lambda cp, r, s: cp.fetched(r)),
    ("ring_fetched", ("rank",), lambda cp, r, s: cp.ring_fetched(r)),
    ("keys", ("rank", "source"), lambda cp, r, s: cp.keys(r, s)),
    ("part_plan", ("rank", "source"), lambda cp, r, s: cp.part_plan(r, s)),
]


def _same(a, b):
    """Equal results of two calls (plans by their intervals)."""
    if isinstance(a, cm.Plan):
        return a.intervals(0) == b.intervals(0) and a.visible_pairs == b.visible_pairs
    return a == b


def _check_rank_arguments(cp, methods, numpy=None):
    """Each rank / source argument of ``methods``: wrong types are ``TypeError`` naming it,
    values outside ``0 .. ranks`` (past 64 bits included) ``IndexError`` naming it and the
    range, NumPy ints the same as ints."""
    ranks = cp.ranks
    for name, args, call in methods:
        for pos, arg in enumerate(args):
            def at(value, pos=pos):
                return call(cp, *[value if i == pos else 1 for i in range(2)])

            for bad, shown in ((True, "bool True"), (False, "bool False"), (1.0, "float 1.0"),
                               (None, "NoneType None"), ("1", "str '1'")):
                with pytest.raises(TypeError, match=f"^{arg} must be an int, got {shown}$"):
                    at(bad)
            for bad in (2**64, -(2**64), 2**63, -1, ranks):
                with pytest.raises(IndexError, match=rf"^{arg} = {bad} is out of range; "
                                                     rf"expected 0 \.\. {ranks} "):
                    at(bad)
            want = [at(r) for r in range(ranks)]
            if numpy is not None:
                for r in range(ranks):
                    for t in (numpy.int64, numpy.int32, numpy.uint8):
                        assert _same(at(t(r)), want[r]), (name, arg, t, r)
                with pytest.raises(IndexError, match=f"^{arg} = {ranks} is out of range"):
                    at(numpy.int64(ranks))
                with pytest.raises(TypeError, match=f"^{arg} must be an int, got float64"):
                    at(numpy.float64(1))


def test_rank_arguments_are_checked():
    plan = cm.builtin("document_causal", lengths=[30, 50, 44]).plan(124)
    cp = ContextParallel(plan, ranks=3, chunk=8)
    _check_rank_arguments(cp, RANK_METHODS)
    # Results of valid ranks are those of the native sharding, whatever the caller's int type.
    assert cp.keys(1, 0) == cp._native.keys(1, 0)
    assert cp.shard_len(2) == cp.offsets[3] - cp.offsets[2]
    # A bool must not reach the plan cache as the rank it hashes as.
    with pytest.raises(TypeError, match="rank must be an int, got bool True"):
        cp.part_plan(True, 0)


def test_rank_arguments_accept_numpy_ints():
    np = pytest.importorskip("numpy")
    plan = cm.builtin("document_causal", lengths=[30, 50, 44]).plan(124)
    cp = ContextParallel(plan, ranks=3, chunk=8)
    _check_rank_arguments(cp, RANK_METHODS, np)
    same = ContextParallel(plan, ranks=np.int64(3), chunk=np.int32(8))
    assert (same.ranks, same.chunk, same.offsets) == (3, 8, cp.offsets)
    with pytest.raises(ValueError, match=r"ranks must be in \[1, 4294967295\], got 0"):
        ContextParallel(plan, ranks=np.int64(0))
    with pytest.raises(TypeError, match="chunk must be an int, got float64"):
        ContextParallel(plan, ranks=2, chunk=np.float64(8))


# Not pytest.importorskip at module level: that would skip the tests above too.
try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _inputs(n, dtype, device, seed, head_dim=16, head_dim_v=24):
    """GQA 4/2 inputs; the CPU reference takes any head dims, the kernels only theirs."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = ((1, 4, n, head_dim), (1, 2, n, head_dim), (1, 2, n, head_dim_v))
    return [torch.randn(s, generator=g, device=device, dtype=dtype).requires_grad_()
            for s in shapes]


def _grads(out, lse, q, k, v, seed):
    g = torch.Generator(device=out.device).manual_seed(seed)
    w = torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, device=out.device, dtype=torch.float64)
    w_lse = w_lse.masked_fill(torch.isinf(lse), 0)
    loss = (out.double() * w).sum() + (lse.double().masked_fill(torch.isinf(lse), 0) * w_lse).sum()
    return torch.autograd.grad(loss, (q, k, v))


@needs_torch
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name,make", WORKLOADS)
def test_simulated_ranks_match_the_whole_sequence(name, make, ranks):
    plan = make(301)
    cp = ContextParallel(plan, ranks=ranks, chunk=16)
    q, k, v = _inputs(301, torch.float64, "cpu", seed=ranks)
    out, lse = cm.distributed.simulate(q, k, v, cp, enable_gqa=True, return_lse=True)
    ref, ref_lse = cm.attention(q, k, v, plan, enable_gqa=True, return_lse=True)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (out - ref).abs().max().item() < 1e-12
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-12
    for a, b in zip(_grads(out, lse, q, k, v, 1), _grads(ref, ref_lse, q, k, v, 1)):
        assert torch.isfinite(a).all() and (a - b).abs().max().item() < 1e-12


SCORED = {
    "softcap": "mask = k <= q;\nscore = softcap(score, 3);",
    "sinks": "tensor sinks: [num_heads];\nmask = q >= 5 & q - 40 < k <= q;\nsink = sinks[h];",
    "softcap and sinks": "tensor sinks: [num_heads];\nmask = q >= 9 & k <= q;\n"
                         "score = softcap(score, 2);\nsink = sinks[h];",
    # A bias that reads no position moves each head's lse only: the merge adds it, before
    # the sink, which it must not move.
    "constant bias": "mask = k <= q;\nscore = score + [0.5, -1, 2, 0.25][h] - 1.5;",
    "constant bias, softcap and sinks": "tensor sinks: [num_heads];\nmask = q >= 9 & k <= q;\n"
                                        "score = softcap(score, 2) + [0.5, -1, 2, 0.25][h] * 3;"
                                        "\nsink = sinks[h];",
    "one constant and sinks": "tensor sinks: [num_heads];\nmask = q >= 5 & q - 40 < k <= q;\n"
                              "score = score + 0.75;\nsink = sinks[h];",
}


@needs_torch
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("name", sorted(SCORED))
def test_softcaps_and_sinks_across_ranks_match_the_whole_sequence(name, ranks):
    """A softcap goes into every part, each row's sink and constant bias into the merge, once: output, lse and
    the gradients of q, k, v and the sinks equal cm.attention's on the whole sequence (float64,
    the CPU reference), with logits large enough for the softcap to bite, rows that see no key
    (output 0, lse the sink's) and a head whose sink is -inf (no sink, gradient 0)."""
    n = 257
    plan = cm.compile(SCORED[name]).plan(n, num_heads=4)
    cp = ContextParallel(plan, ranks=ranks, chunk=16)
    q, k, v = _inputs(n, torch.float64, "cpu", seed=ranks + 7)
    sinks = torch.tensor([0.3, -math.inf, 1.5, -0.7], dtype=torch.float64, requires_grad=True)
    given = {"sinks": sinks} if "sinks" in name else None
    out, lse = cm.distributed.simulate(q, k, v, cp, scale=2.0, enable_gqa=True, return_lse=True,
                                       score_tensors=given)
    ref, ref_lse = cm.attention(q, k, v, plan, scale=2.0, enable_gqa=True, return_lse=True,
                                score_tensors=given)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (out - ref).abs().max().item() < 1e-12
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-12
    inputs = (q, k, v) + ((sinks,) if given else ())
    g = torch.Generator().manual_seed(2)
    w, w_lse = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(
        lse.shape, generator=g, dtype=torch.float64).masked_fill(~finite, 0)

    def grads(o, l):
        loss = (o * w).sum() + (l.masked_fill(~finite, 0) * w_lse).sum()
        return torch.autograd.grad(loss, inputs)

    ours = grads(out, lse)
    for a, b in zip(ours, grads(ref, ref_lse)):
        assert torch.isfinite(a).all() and (a - b).abs().max().item() < 1e-12
    if given:
        assert ours[3][1].item() == 0.0 and ours[3][[0, 2, 3]].abs().min().item() > 0


@needs_torch
def test_sinks_across_ranks_are_checked():
    plan = cm.builtin("sliding_window_sinks").plan(64, num_heads=4)
    cp = ContextParallel(plan, ranks=2, chunk=16)
    q, k, v = _inputs(64, torch.float64, "cpu", seed=1)
    with pytest.raises(ValueError, match="score_tensors is missing 'sinks'"):
        cm.distributed.simulate(q, k, v, cp, enable_gqa=True)
    with pytest.raises(ValueError, match=r"shape \(3,\), expected \(4,\)"):
        cm.distributed.simulate(q, k, v, cp, enable_gqa=True,
                                score_tensors={"sinks": torch.zeros(3, dtype=torch.float64)})
    causal = ContextParallel(cm.builtin("causal").plan(64), ranks=2, chunk=16)
    with pytest.raises(ValueError, match="has no score or sink statement"):
        cm.distributed.simulate(q, k, v, causal, enable_gqa=True,
                                score_tensors={"sinks": torch.zeros(4, dtype=torch.float64)})
    # Anything but a mapping is a TypeError naming its type, with or without score terms.
    for not_a_map, named in (([("sinks", 1)], "list"), (torch.zeros(4), "Tensor"), (0, "int")):
        for target, call in ((causal, cm.distributed.simulate), (causal.plan, cm.attention),
                             (cp, cm.distributed.simulate), (cp.plan, cm.attention)):
            with pytest.raises(TypeError, match=f"score_tensors must map .* got {named}"):
                call(q, k, v, target, enable_gqa=True, score_tensors=not_a_map)


@needs_torch
def test_ranks_that_see_no_key_match_the_whole_sequence():
    """A rank whose rows see no key gives output 0 of the values' head dim (head_dim_v 3, not
    head_dim 8) and lse -inf (its sink's with sinks), and a mask where no row sees a key
    still differentiates: zero gradients, as compilemask.attention's."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn((1, 2, 9, 8), generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(2))
    v = torch.randn((1, 2, 9, 3), generator=g, dtype=torch.float64).requires_grad_()
    sinks = torch.tensor([0.5, -math.inf], dtype=torch.float64, requires_grad=True)
    cases = [(cm.compile("mask = k < q;").plan(9), None, 4),
             (cm.compile("mask = k > q + kv_len;").plan(9), None, 1),
             (cm.compile("mask = k > q + kv_len;").plan(9), None, 3),
             (cm.compile("tensor sinks: [num_heads];\nmask = k > q + kv_len;\nsink = sinks[h];")
              .plan(9, num_heads=2), {"sinks": sinks}, 3)]
    for plan, given, ranks in cases:
        cp = ContextParallel(plan, ranks=ranks, chunk=1)
        out, lse = cm.distributed.simulate(q, k, v, cp, return_lse=True, score_tensors=given)
        ref, ref_lse = cm.attention(q, k, v, plan, return_lse=True, score_tensors=given)
        assert out.shape == ref.shape == (1, 2, 9, 3)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert torch.allclose(out, ref, rtol=0, atol=1e-12)
        assert torch.allclose(lse.clamp(min=-1), ref_lse.clamp(min=-1), rtol=0, atol=1e-12)
        inputs = (q, k, v) + ((sinks,) if given else ())
        for a, b in zip(torch.autograd.grad((out.sum() + lse.clamp(min=-1).sum()), inputs),
                        torch.autograd.grad((ref.sum() + ref_lse.clamp(min=-1).sum()), inputs)):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)


@needs_torch
def test_heads_and_sink_values_are_checked_as_attention_checks_them():
    q, k, v = _inputs(64, torch.float64, "cpu", seed=1)
    two = ContextParallel(cm.builtin("causal").plan(64, num_heads=2), ranks=2, chunk=16)
    with pytest.raises(ValueError, match="the plan was built for num_heads = 2, but the query "
                                         "has num_heads = 4"):
        cm.distributed.simulate(q, k, v, two, enable_gqa=True)
    sinks_plan = cm.builtin("sliding_window_sinks").plan(64, num_heads=1)
    one = ContextParallel(sinks_plan, ranks=2, chunk=16)
    with pytest.raises(ValueError, match="bound for num_heads = 1 .* the query has 4 heads"):
        cm.distributed.simulate(q, k, v, one, enable_gqa=True,
                                score_tensors={"sinks": torch.zeros(4, dtype=torch.float64)})
    cp = ContextParallel(cm.builtin("sliding_window_sinks").plan(64, num_heads=4), ranks=2,
                         chunk=16)
    for bad, shown in ((math.nan, "NaN"), (math.inf, "inf")):
        s = torch.tensor([0.0, bad, -math.inf, 1.0], dtype=torch.float64)
        for call in (cm.distributed.simulate, cm.attention):
            plan_or_cp = cp if call is cm.distributed.simulate else cp.plan
            with pytest.raises(ValueError, match=rf"sinks\[1\] of \[num_heads\] is {shown}; "
                                                 "a sink must be finite, or -inf for no sink"):
                call(q, k, v, plan_or_cp, enable_gqa=True, score_tensors={"sinks": s})


def _gloo_worker(rank, ranks, init, outdir, n):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    try:
        plan = cm.builtin("document_causal", lengths=[n // 2, n // 7, n - n // 2 - n // 7]).plan(n)
        cp = ContextParallel(plan, ranks=ranks, chunk=16)
        full = _inputs(n, torch.float64, "cpu", seed=5)
        local = [cp.shard(t.detach(), rank).requires_grad_() for t in full]
        out, lse = cm.distributed.attention(*local, cp, enable_gqa=True, return_lse=True)
        g = torch.Generator().manual_seed(9)
        w = torch.randn((1, 4, n, 24), generator=g, dtype=torch.float64)
        loss = (out * cp.shard(w, rank)).sum()
        grads = torch.autograd.grad(loss, local)
        torch.save({"out": out.detach(), "lse": lse.detach(), "grads": grads},
                   os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@needs_torch
@pytest.mark.parametrize("ranks", [2, 3])
def test_gloo_ranks_match_the_whole_sequence(tmp_path, ranks):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    n = 203
    init = f"file://{tmp_path / 'init'}"
    mp.spawn(_gloo_worker, args=(ranks, init, str(tmp_path), n), nprocs=ranks, join=True)
    plan = cm.builtin("document_causal", lengths=[n // 2, n // 7, n - n // 2 - n // 7]).plan(n)
    cp = ContextParallel(plan, ranks=ranks, chunk=16)
    q, k, v = _inputs(n, torch.float64, "cpu", seed=5)
    ref, ref_lse = cm.attention(q, k, v, plan, enable_gqa=True, return_lse=True)
    g = torch.Generator().manual_seed(9)
    w = torch.randn((1, 4, n, 24), generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(ranks)]
    out = cp.unshard([r["out"] for r in results])
    lse = cp.unshard([r["lse"] for r in results], -1)
    assert (out - ref).abs().max().item() < 1e-12
    assert (lse - ref_lse).abs().max().item() < 1e-12
    for i, want in enumerate(ref_grads):
        got = cp.unshard([r["grads"][i] for r in results])
        assert (got - want).abs().max().item() < 1e-12, "qkv"[i]


@needs_torch
def test_shard_and_unshard_are_inverse():
    cp = ContextParallel(cm.builtin("causal").plan(1000), ranks=3, chunk=64)
    x = torch.arange(1000.0).view(1, 1, 1000, 1)
    shards = [cp.shard(x, r) for r in range(3)]
    assert [s.shape[2] for s in shards] == [cp.shard_len(r) for r in range(3)]
    assert torch.equal(cp.unshard(shards), x)
    order = cp.order()
    assert torch.equal(torch.sort(order).values, torch.arange(1000))


@needs_torch
def test_shard_and_unshard_refuse_bad_ranks_and_shapes():
    cp = ContextParallel(cm.builtin("causal").plan(300), ranks=3, chunk=32)
    x = torch.zeros(1, 2, 300, 8)
    for rank in (-1, 3, 2**64):
        with pytest.raises(IndexError, match=rf"rank = {rank} is out of range; expected 0 \.\. 3 "
                                             r"\(half-open: the sharding has ranks = 3\)"):
            cp.shard(x, rank)
    for rank, shown in ((True, "bool True"), (1.0, "float 1.0"), (None, "NoneType None")):
        with pytest.raises(TypeError, match=f"rank must be an int, got {shown}"):
            cp.shard(x, rank)
    with pytest.raises(IndexError, match="rank = -1 is out of range"):
        cp.shard_len(-1)
    # key_index and shard take the checks of the methods without torch.
    _check_rank_arguments(cp, [
        ("key_index", ("rank", "source"), lambda cp, r, s: cp.key_index(r, s).tolist()),
        ("shard", ("rank",), lambda cp, r, s: cp.shard(x + torch.arange(300.0)[:, None], r)
         .tolist()),
    ])
    with pytest.raises(ValueError, match=r"300 positions \(the plan's q_len\), got shape \(1, 2, 299, 8\)"):
        cp.shard(torch.zeros(1, 2, 299, 8), 0)
    with pytest.raises(ValueError, match="along dim 0"):
        cp.shard(x, 0, dim=0)
    for dim in (7, -5, 2**64):
        with pytest.raises(IndexError, match=rf"dim = {dim} is not a dimension of a tensor of "
                                             r"shape \(1, 2, 300, 8\) \(expected -4 to 3\)"):
            cp.shard(x, 0, dim=dim)
    for dim, shown in ((1.0, "float 1.0"), (True, "bool True"), (None, "NoneType None")):
        with pytest.raises(TypeError, match=f"dim must be an int, got {shown}"):
            cp.shard(x, 0, dim=dim)
    with pytest.raises(ValueError, match="200 tokens cannot give each of ranks = 300 a token"):
        ContextParallel(cm.builtin("causal").plan(200), ranks=300, chunk=1)
    shards = [cp.shard(x, r) for r in range(3)]
    assert shards[0].shape[2] != shards[2].shape[2], [s.shape for s in shards]
    with pytest.raises(ValueError, match=f"shard 0 must hold rank 0's {cp.shard_len(0)} positions"):
        cp.unshard([shards[2], shards[1], shards[0]])


CUDA = (torch is not None and torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0))


@needs_torch
@pytest.mark.skipif(not CUDA, reason="needs a Hopper GPU (compute capability 9.0)")
@pytest.mark.parametrize("name,make", WORKLOADS)
def test_simulated_ranks_on_the_gpu(name, make):
    """bf16 on the kernels: within twice the whole sequence's own error against float64
    plus 1e-3 (the merge adds one rounding of each part's output)."""
    plan = make(1001)
    cp = ContextParallel(plan, ranks=4, chunk=64)
    q, k, v = _inputs(1001, torch.bfloat16, "cuda", seed=2, head_dim=64, head_dim_v=64)
    out, lse = cm.distributed.simulate(q, k, v, cp, enable_gqa=True, return_lse=True)
    ref, ref_lse = cm.attention(q, k, v, plan, enable_gqa=True, return_lse=True)
    exact, exact_lse = cm.attention(*(t.detach().double().cpu() for t in (q, k, v)), plan,
                                    enable_gqa=True, return_lse=True)
    own = (ref.double().cpu() - exact).abs().max().item()
    assert (out.double().cpu() - exact).abs().max().item() <= 2 * own + 1e-3
    finite = torch.isfinite(exact_lse)
    assert (lse.double().cpu()[finite] - exact_lse[finite]).abs().max().item() <= 1e-3
    assert math.isfinite(sum(g.double().sum().item() for g in _grads(out, lse, q, k, v, 3)))


@needs_torch
@pytest.mark.skipif(not CUDA, reason="needs a Hopper GPU (compute capability 9.0)")
def test_softcaps_and_sinks_across_ranks_on_the_gpu():
    """bf16 on the kernels (the parts on the softcap variants, the sinks in the merge): within
    twice the whole sequence's own error against float64 plus 1e-3, finite gradients."""
    n = 1001
    plan = cm.compile(SCORED["softcap and sinks"]).plan(n, num_heads=4)
    cp = ContextParallel(plan, ranks=4, chunk=64)
    q, k, v = _inputs(n, torch.bfloat16, "cuda", seed=4, head_dim=64, head_dim_v=64)
    sinks = torch.tensor([0.3, -math.inf, 1.5, -0.7], device="cuda", requires_grad=True)
    given = {"sinks": sinks}
    out, lse = cm.distributed.simulate(q, k, v, cp, enable_gqa=True, return_lse=True,
                                       score_tensors=given)
    ref = cm.attention(q, k, v, plan, enable_gqa=True, score_tensors=given)
    exact, exact_lse = cm.attention(*(t.detach().double().cpu() for t in (q, k, v)), plan,
                                    enable_gqa=True, return_lse=True,
                                    score_tensors={"sinks": sinks.detach().double().cpu()})
    own = (ref.double().cpu() - exact).abs().max().item()
    assert (out.double().cpu() - exact).abs().max().item() <= 2 * own + 1e-3
    finite = torch.isfinite(exact_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (lse.double().cpu()[finite] - exact_lse[finite]).abs().max().item() <= 1e-3
    loss = (out.double() * torch.randn(out.shape, device="cuda", dtype=torch.float64)).sum()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(loss, (q, k, v, sinks)))


def test_context_parallel_pickles_and_a_step_says_what_to_send():
    import pickle

    cp = ContextParallel(cm.builtin("causal").plan(301), ranks=3)
    loaded = pickle.loads(pickle.dumps(cp))
    assert (loaded.ranks, loaded.chunk, loaded.offsets) == (cp.ranks, cp.chunk, cp.offsets)
    assert loaded.work == cp.work
    step = cm.builtin("causal").plan_step([1, 2], [20, 5])
    with pytest.raises(TypeError, match=r"send its StepTensors \(step.to_tensors\(\)"):
        pickle.dumps(step)
