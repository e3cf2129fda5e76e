"""Serving steps over a paged KV cache: `Program.plan_step`, `Step.append` and
`compilemask.paged_attention`.

The rows are checked against the pairwise semantics (`Program.brute_force_row` of each
sequence bound at its own length) without torch; `paged_attention` on CPU against a torch
float64 dense softmax built from the step's rows over the gathered pages (those tests skip
without torch)."""

from __future__ import annotations

import math
import random

import pytest

import compilemask as cm


def brute_rows(program, q_len, kv_len, per_seq=None, **shared):
    """Every row of a step by brute force: sequence s bound at q_len = kv_len = kv_len[s],
    batch = num_seqs, b = s; its new rows are the positions kv_len[s] - q_len[s] ..."""
    rows = []
    for s, (q, kv) in enumerate(zip(q_len, kv_len)):
        params = dict(shared)
        if per_seq is not None:
            params.update(per_seq[s])
        for p in range(kv - q, kv):
            rows.append(program.brute_force_row(p, kv, kv, batch=len(q_len), b=s, **params))
    return rows


PROGRAMS = {
    "causal": (cm.builtin("causal"), {}),
    "sliding_window": (cm.builtin("sliding_window"), {"window": 50}),
    "dilated_window": (cm.builtin("dilated_window"), {"window": 30, "dilation": 3}),
    "causal_bottom_right": (cm.builtin("causal_bottom_right"), {}),
    "tree_decode": (cm.builtin("tree_decode"), {}),
    "reads_b": (cm.compile("mask = k <= q & (k + b) % 3 != 0;"), {}),
    "recent_and_sinks": (cm.compile("mask = k < 4 | k >= kv_len - 8;"), {}),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_step_rows_equal_brute_force(name):
    program, params = PROGRAMS[name]
    q_len, kv_len = [1, 7, 64, 1, 7], [127, 129, 129, 4097, 7]
    step = program.plan_step(q_len, kv_len, **params)
    assert (step.num_seqs, step.total_q) == (5, sum(q_len))
    assert step.q_len == q_len and step.kv_len == kv_len
    assert step.cu_q == [0, 1, 8, 72, 73, 80]
    want = brute_rows(program, q_len, kv_len, **params)
    got = [step.row(r) for r in range(step.total_q)]
    assert got == want
    # The flat arrays say the same.
    rp, iv = step.row_ptr, step.intervals
    assert len(rp) == step.total_q + 1 and len(iv) == 2 * step.num_intervals
    for r in range(step.total_q):
        pairs = iv[2 * rp[r]:2 * rp[r + 1]]
        assert list(zip(pairs[::2], pairs[1::2])) == got[r]
    assert step.positions()[:3] == [126, 122, 123]
    cached = ("causal", "sliding_window", "dilated_window", "causal_bottom_right")
    assert step.caches_pieces == (name in cached)


def test_append_plans_the_next_step():
    program = cm.builtin("sliding_window", window=100)
    step = program.plan_step(1, [4090, 30, 500])
    rng = random.Random(5)
    kv = [4090, 30, 500]
    for _ in range(10):
        new = [rng.randint(1, 4) for _ in kv]
        assert step.append(new) is step
        kv = [k + n for k, n in zip(kv, new)]
        assert step.kv_len == kv and step.q_len == new
        assert [step.row(r) for r in range(step.total_q)] == brute_rows(program, new, kv)
    step.append()  # one token each
    assert step.q_len == [1, 1, 1] and step.kv_len == [k + 1 for k in kv]
    step.replan([2, 1], [50, 9000])
    assert [step.row(r) for r in range(3)] == brute_rows(program, [2, 1], [50, 9000])


def test_trees_per_sequence():
    program = cm.builtin("tree_decode")
    trees = [[-1, 0, 0, 1, 1, 2, 2], [-1, 0, 1], [-1] + [i // 4 for i in range(63)]]
    per_seq = [{"parents": t} for t in trees]
    q_len = [len(t) for t in trees]
    kv_len = [1000, 3, 4097]
    step = program.plan_step(q_len, kv_len, params=per_seq)
    assert [step.row(r) for r in range(step.total_q)] == brute_rows(program, q_len, kv_len,
                                                                       per_seq)
    # Node 3 (parent 1, grandparent 0) of the first tree: the prefix, 0, 1 and itself.
    assert step.row(3) == [(0, 995), (996, 997)]
    assert step.row(7) == [(0, 1)]  # the second tree fills its sequence: no prefix


def test_bad_steps_raise():
    causal = cm.builtin("causal")
    with pytest.raises(ValueError, match=r"q_len\[1\] = 0: every sequence of a step"):
        causal.plan_step([1, 0], [4, 4])
    with pytest.raises(ValueError, match=r"q_len\[0\] = 5 is more than kv_len\[0\] = 4"):
        causal.plan_step(5, [4])
    with pytest.raises(ValueError, match="kv_len has 1 entries for 2 sequences"):
        causal.plan_step([1, 1], [4])
    with pytest.raises(ValueError, match="a step needs at least one sequence"):
        causal.plan_step([], [])
    with pytest.raises(ValueError, match="q_len has 0 entries for 2 sequences"):
        causal.plan_step([], [4, 8])
    with pytest.raises(ValueError, match=r"new_tokens\[1\] = 1099511627776 would take "
                                         r"kv_len\[1\] = 8 past the longest supported"):
        causal.plan_step(1, [4, 8]).append([1, 2 ** 40])
    with pytest.raises(TypeError, match="kv_len must be a sequence of ints"):
        causal.plan_step(1, {3, 4})
    with pytest.raises(ValueError, match="one mask for every head"):
        cm.compile("mask = k <= q - h;").plan_step(1, [3])
    with pytest.raises(ValueError, match="score"):
        cm.builtin("causal_alibi").plan_step(1, [3])
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("tree_decode").plan_step([7, 3], [100, 5])
    assert e.value.code == "CM0305"
    assert "(sequence 1: q_len = 3, kv_len = 5)" in str(e.value)
    # Integers past 64 bits are out of range like any other bad index or length, not
    # the binding layer's OverflowError.
    step = causal.plan_step(1, [3, 4])
    for r in (2, -1):
        with pytest.raises(IndexError, match=f"row {r} is out of range; the step has total_q = 2"):
            step.row(r)
    for r in (2 ** 64, -(2 ** 64)):
        with pytest.raises(IndexError, match=f"r = {r} is out of range; expected 0 <= r < 2"):
            step.row(r)
    for heads in (2 ** 64, 0):
        with pytest.raises(cm.PlanError) as e:
            causal.plan_step(1, [3], num_heads=heads)
        assert e.value.code == "CM0402" and f"num_heads = {heads}" in str(e.value)
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("sliding_window").plan_step(1, [9], params=[{"widow": 3}])
    assert e.value.code == "CM0309"
    step = causal.plan_step(1, [4, 9])
    with pytest.raises(ValueError, match="new_tokens has 3 entries for 2 sequences"):
        step.append([1, 1, 1])
    with pytest.raises(ValueError, match=r"new_tokens\[0\] = 0: every sequence gains at "
                                         r"least one new token"):
        step.append(0)
    # A plain int is allowed, so a float names both forms.
    with pytest.raises(TypeError, match=r"new_tokens must be an int \(the same for every "
                                        r"sequence\) or a sequence of ints, one per sequence, "
                                        r"got float"):
        step.append(1.5)
    with pytest.raises(TypeError, match=r"new_tokens\[1\] must be an int, got float 2.5"):
        step.append([1, 2.5])
    with pytest.raises(TypeError, match=r"new_tokens\[0\] must be an int, got bool True"):
        step.append([True, 1])
    with pytest.raises(ValueError, match=f"new_tokens = {2 ** 63} is out of range"):
        step.append(2 ** 63)
    with pytest.raises(ValueError, match=fr"new_tokens\[1\] = {-2 ** 63 - 1} is out of range"):
        step.append([1, -2 ** 63 - 1])
    with pytest.raises(TypeError, match=r"q_len must be an int \(the same for every sequence\)"):
        causal.plan_step(1.5, [4])
    # A value that is neither form is named with its value, also a numpy / torch scalar
    # (as the caller gave it) or a bool.
    for bad, text in ((1.5, "float 1.5"), (True, "bool True"), (None, "NoneType None"),
                      ("2", "str '2'")):
        with pytest.raises(TypeError, match=f"new_tokens must be an int .*, got {text}$"):
            step.append(bad)
        with pytest.raises(TypeError, match=f"kv_len must be a sequence of ints, one per "
                                            f"sequence, got {text}$"):
            causal.plan_step(1, bad)
    # Integers too long for Python to print are named by their size, not lost to str()'s
    # digit limit.
    huge = 10 ** 5000
    with pytest.raises(ValueError, match=r"new_tokens = \(an int of 16610 bits\) is out of range"):
        step.append(huge)
    with pytest.raises(ValueError, match=r"kv_len\[1\] = \(an int of 16610 bits\) is out"):
        causal.plan_step(1, [4, huge])
    assert step.kv_len == [4, 9]
    with pytest.raises(IndexError, match="row 2 is out of range"):
        step.row(2)
    with pytest.raises(IndexError, match="row -1 is out of range"):
        step.row(-1)


# --------------------------------------------------------------------------- torch


def test_kernel_choice_for_paged_attention():
    """`kernel="auto"` takes the paged forward exactly where it runs and the step averages
    PREFILL_MIN_ROWS_PER_SEQ new rows per sequence; `kernel="prefill"` names what stops it;
    a Step whose sequence outgrows its block-table row is refused whatever the kernel. Only
    shapes are read, so this runs without torch."""
    from types import SimpleNamespace

    from compilemask import _serve

    min_rows = _serve.PREFILL_MIN_ROWS_PER_SEQ
    assert min_rows == 64
    causal = cm.builtin("causal")
    big = causal.plan_step([min_rows, min_rows], [900, 700])
    small = causal.plan_step([min_rows, min_rows - 1], [900, 700])
    run = _serve._runs_prefill
    assert run("auto", big, 16)
    assert not run("auto", small, 16)
    assert run("prefill", small, 16)
    assert not run("decode", big, 16)
    # What the paged forward cannot run: "auto" falls back, "prefill" says why.
    for why, page_size in [
        ("page_size = 12 is not a power of two of at least 8", 12),
        ("page_size = 4 is not a power of two", 4),
    ]:
        assert not run("auto", big, page_size)
        assert run("decode", big, page_size) is False
        with pytest.raises(ValueError, match=why + ".*kernel='decode' takes it"):
            run("prefill", big, page_size)
    with pytest.raises(ValueError, match="needs a compilemask.Step"):
        run("prefill", SimpleNamespace(total_q=128, num_seqs=2), 16)
    # Block-table rows too short for a sequence's keys: refused, not clamped.
    _serve._check_pages(big, 16, 57)
    with pytest.raises(ValueError, match=r"kv_len\[0\] = 900 needs 57 pages of 16, but "
                                         r"block_table rows hold max_pages_per_seq = 50"):
        _serve._check_pages(big, 16, 50)


def make_cache(torch, kv_len, page_size, num_kv_heads, head_dim, head_dim_v, shared, seed):
    """A paged cache over random contiguous K / V per sequence (kept for the reference):
    shuffled pages, sequence s with shared[s] = (t, n) sharing its first n pages with t, NaN
    in every slot no sequence owns, -1 past each sequence's pages."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-kv // page_size) for kv in kv_len]
    max_pages = max(needed) + 1
    owned = sum(n - (sh[1] if sh else 0) for n, sh in zip(needed, shared))
    num_pages = owned + 2
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(kv_len), max_pages), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for s, kv in enumerate(kv_len):
        k = torch.randn(kv, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
        v = torch.randn(kv, num_kv_heads, head_dim_v, generator=g, dtype=torch.float64)
        for j in range(needed[s]):
            if shared[s] and j < shared[s][1]:
                table[s, j] = table[shared[s][0], j]
            else:
                table[s, j] = order.pop()
        if shared[s]:
            t, n = shared[s]
            k[:n * page_size] = dense_k[t][:n * page_size]
            v[:n * page_size] = dense_v[t][:n * page_size]
        dense_k.append(k)
        dense_v.append(v)
    kc = torch.full((num_pages, page_size, num_kv_heads, head_dim), math.nan, dtype=torch.float64)
    vc = torch.full((num_pages, page_size, num_kv_heads, head_dim_v), math.nan,
                    dtype=torch.float64)
    for s, kv in enumerate(kv_len):
        p = torch.arange(kv)
        pages = table[s, p // page_size].long()
        kc[pages, p % page_size] = dense_k[s]
        vc[pages, p % page_size] = dense_v[s]
    return kc, vc, table


def dense_reference(torch, q, kc, vc, table, step, scale):
    """float64 attention of every step row over its sequence's gathered pages, the mask from
    the step's rows."""
    total_q, hq, d = q.shape
    page_size, hk = kc.shape[1], kc.shape[2]
    out = torch.zeros(total_q, hq, vc.shape[3], dtype=torch.float64)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64)
    cu = step.cu_q
    for s, kv in enumerate(step.kv_len):
        p = torch.arange(kv)
        pages = table[s, p // page_size].long()
        k = kc[pages, p % page_size].repeat_interleave(hq // hk, dim=1)  # [kv, hq, d]
        v = vc[pages, p % page_size].repeat_interleave(hq // hk, dim=1)
        for r in range(cu[s], cu[s + 1]):
            visible = torch.zeros(kv, dtype=torch.bool)
            for a, b in step.row(r):
                visible[a:b] = True
            if not visible.any():
                continue
            logits = scale * torch.einsum("hd,khd->hk", q[r].double(), k)
            logits = logits.masked_fill(~visible, -math.inf)
            lse[r] = torch.logsumexp(logits, dim=-1)
            out[r] = torch.einsum("hk,khd->hd", torch.softmax(logits, dim=-1), v)
    return out, lse


SERVING = [
    ("causal", {}),
    ("sliding_window", {"window": 100}),
    ("dilated_window", {"window": 40, "dilation": 3}),
]


@pytest.mark.parametrize("page_size", [16, 64, 4097])
@pytest.mark.parametrize("heads", [(4, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize("name,params", SERVING)
def test_paged_attention_equals_dense(torch, name, params, heads, page_size):
    hq, hk = heads
    q_len, kv_len = [1, 7, 64, 1, 7, 1], [1, 127, 129, 4097, 7, 129]
    step = cm.builtin(name, **params).plan_step(q_len, kv_len)
    kc, vc, table = make_cache(torch, kv_len, page_size, hk, 8, 5, [None] * 6, page_size + hq)
    q = torch.randn(step.total_q, hq, 8, dtype=torch.float64)
    out, lse = cm.paged_attention(q, kc, vc, table, step, return_lse=True)
    want, want_lse = dense_reference(torch, q, kc, vc, table, step, 1 / math.sqrt(8))
    assert out.shape == (step.total_q, hq, 5) and out.dtype == torch.float64
    assert lse.shape == (step.total_q, hq) and lse.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    # float32 inputs: the same computation from rounded values; StepTensors instead of Step.
    out32 = cm.paged_attention(q.float(), kc.float(), vc.float(), table, step.to_tensors(),
                               scale=0.3)
    want32, _ = dense_reference(torch, q.float().double(), kc.float().double(),
                                vc.float().double(), table, step, 0.3)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want32, rtol=0, atol=1e-5)


def test_a_mask_reading_num_heads_runs_with_the_heads_it_was_planned_for(torch):
    # A window of num_heads keys: one mask for every head, bound with the step's num_heads.
    program = cm.compile("mask = q - num_heads < k <= q;")
    with pytest.raises(ValueError, match="reads num_heads.*pass num_heads="):
        program.plan_step(1, [10])
    kv_len = [10, 3]
    step = program.plan_step(1, kv_len, num_heads=4)
    assert [step.row(r) for r in range(2)] == [[(6, 10)], [(0, 3)]]
    kc, vc, table = make_cache(torch, kv_len, 4, 2, 8, 8, [None, None], 1)
    q = torch.randn(step.total_q, 4, 8, dtype=torch.float64)
    out = cm.paged_attention(q, kc, vc, table, step)
    want, _ = dense_reference(torch, q, kc, vc, table, step, 1 / math.sqrt(8))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="planned with num_heads = 4.*q has num_heads = 2"):
        cm.paged_attention(q[:, :2], kc, vc, table, step)
    # A mask that does not read it runs with any heads, whatever the step was given.
    causal = cm.builtin("causal").plan_step(1, kv_len, num_heads=3)
    cm.paged_attention(q[:, :2], kc, vc, table, causal)


def test_shared_prompt_pages_and_trees(torch):
    trees = [[-1, 0, 0, 1, 1, 2, 2], [-1, 0, 1, 2], [-1] + [i // 3 for i in range(63)]]
    kv_len = [256 + 40 + 7, 256 + 4, 256 + 1 + 64]
    step = cm.builtin("tree_decode").plan_step([len(t) for t in trees], kv_len,
                                               params=[{"parents": t} for t in trees])
    kc, vc, table = make_cache(torch, kv_len, 16, 2, 8, 8, [None, (0, 16), (0, 16)], 1)
    assert table[0, :16].tolist() == table[1, :16].tolist() == table[2, :16].tolist()
    q = torch.randn(step.total_q, 8, 8, dtype=torch.float64)
    out = cm.paged_attention(q, kc, vc, table, step)
    want, _ = dense_reference(torch, q, kc, vc, table, step, 1 / math.sqrt(8))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_prefill_layout_arguments(torch):
    """prefill_tensors names a bad row group; None is the CPU, as for to_tensors; a layout
    of too many tiles is refused by name, not built."""
    step = cm.builtin("causal").plan_step([5, 3], [40, 9])
    for bad, err in [(0, ValueError), (-1, ValueError), (257, ValueError), (2 ** 40, ValueError),
                     (True, TypeError), (2.0, TypeError), ("2", TypeError), (None, TypeError)]:
        with pytest.raises(err, match="row_group"):
            step.prefill_tensors("cpu", bad)
    pt = step.prefill_tensors(None, 4)
    assert pt.row_index.device.type == "cpu" and pt.q_rows == 256
    huge = cm.builtin("causal").plan_step(2 ** 20, [2 ** 26])
    with pytest.raises(ValueError, match="tiles of 128 x 128; at most"):
        huge.prefill_tensors("cpu", 1)


def test_paged_attention_scale_checks(torch):
    step = cm.builtin("causal").plan_step([2], [9])
    kc, vc, table = make_cache(torch, [9], 8, 1, 4, 4, [None], 1)
    q = torch.randn(2, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"scale = 1e\+308 must be finite and fit float32"):
        cm.paged_attention(q, kc, vc, table, step, scale=1e308)
    with pytest.raises(TypeError, match="scale must be a number, got True"):
        cm.paged_attention(q, kc, vc, table, step, scale=True)


def test_paged_attention_under_torch_compile_on_cpu(torch):
    """The CPU reference reads host bytes, which torch.compile cannot trace: it runs eagerly
    inside a compiled function (a graph break) and gives the eager result."""
    step = cm.builtin("causal").plan_step([3, 1], [40, 9])
    kc, vc, table = make_cache(torch, [40, 9], 8, 2, 8, 8, [None, None], 5)
    q = torch.randn(step.total_q, 4, 8, dtype=torch.float64)
    tensors = step.to_tensors()

    def run(q, kc, vc, table):
        return cm.paged_attention(q, kc, vc, table, tensors, return_lse=True)

    want = run(q, kc, vc, table)
    got = torch.compile(run)(q, kc, vc, table)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_eager_paged_calls_skip_the_dispatcher_only_where_nothing_records_ops(torch):
    """`_ops._bypasses_dispatcher` (CPU-checkable): a plain eager call may run the op's
    function directly; torch.jit.trace, a torch-function or dispatch mode, a functorch
    transform, the profiler or a gradient asked for send it through the custom op (the
    tracer records ops at the dispatcher: a direct call would trace only the empty outputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask import _ops

    x = torch.ones(3)
    assert _ops._bypasses_dispatcher(x)
    seen = []

    def traced(t):
        seen.append(_ops._bypasses_dispatcher(t))
        return t * 2

    torch.jit.trace(traced, (x,), check_trace=False)
    assert seen == [False]
    with torch.device("cpu"):
        assert not _ops._bypasses_dispatcher(x)
    with FakeTensorMode():
        assert not _ops._bypasses_dispatcher(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not _ops._bypasses_dispatcher(x)
    torch.func.vmap(lambda t: seen.append(_ops._bypasses_dispatcher(t)) or t)(torch.ones(2, 3))
    assert seen == [False, False]
    assert not _ops._bypasses_dispatcher(x.clone().requires_grad_())
    with torch.no_grad():
        assert _ops._bypasses_dispatcher(x.clone().requires_grad_())


def test_empty_rows_are_zero_and_minus_inf(torch):
    step = cm.compile("mask = k < q - 200;").plan_step([3, 1], [150, 300])
    kc, vc, table = make_cache(torch, [150, 300], 16, 1, 4, 4, [None, None], 2)
    q = torch.randn(4, 2, 4, dtype=torch.float64)
    out, lse = cm.paged_attention(q, kc, vc, table, step, return_lse=True)
    assert torch.equal(out[:3], torch.zeros(3, 2, 4, dtype=torch.float64))
    assert lse[:3].isneginf().all() and lse[3].isfinite().all()


def test_step_tensors(torch):
    step = cm.builtin("dilated_window", window=9, dilation=2).plan_step([2, 1], [12, 3])
    t = step.to_tensors()
    assert all(x.dtype == torch.int32 for x in t[:4])
    assert t.cu_q.tolist() == [0, 2, 3] and t.kv_len.tolist() == [12, 3]
    assert t.row_ptr.tolist() == step.row_ptr and t.intervals.tolist() == step.intervals
    assert t.intervals.tolist()[:4] == [2, 3, 4, 5]
    assert (t.num_seqs, t.total_q) == (2, 3)
    assert step.to_tensors() is t
    step.append(1)
    assert step.to_tensors() is not t and step.to_tensors().kv_len.tolist() == [13, 4]


def test_step_tensors_with_room_are_rewritten_in_place(torch):
    """to_tensors(max_intervals=N) pads intervals with zero pairs; write_tensors puts each
    later step of the same shape into those very tensors (on CUDA one copy into the buffer
    they share: the GPU test of the captured loop), equal to that step's own tensors and
    giving paged_attention its results; what does not fit is refused, naming it."""
    step = cm.builtin("dilated_window", window=9, dilation=2).plan_step(1, [12, 3, 40])
    t = step.to_tensors(max_intervals=20)
    assert t.intervals.shape == (40,) and t.intervals[2 * step.num_intervals:].eq(0).all()
    assert step.to_tensors(max_intervals=20) is t and step.to_tensors() is not t
    own = step.to_tensors()
    hand = cm.StepTensors(*(x.clone() for x in t[:4]), *t[4:])
    addresses = [x.data_ptr() for x in t[:4] + hand[:4]]
    kc = torch.randn(10, 16, 2, 8, dtype=torch.float64)
    vc = torch.randn_like(kc)
    table = torch.arange(9, dtype=torch.int32).reshape(3, 3)
    for _ in range(3):
        step.append(1)
        # hand twice: the second write finds its layout checked by the first.
        assert step.write_tensors(t) is t and step.write_tensors(hand) is hand
        assert step.write_tensors(hand) is hand
        assert [x.data_ptr() for x in t[:4] + hand[:4]] == addresses
        own = step.to_tensors()
        n = 2 * step.num_intervals
        for got in (t, hand):
            assert all(torch.equal(a, b) for a, b in zip(got[:3], own[:3]))
            assert torch.equal(got.intervals[:n], own.intervals)
        q = torch.randn(3, 4, 8, dtype=torch.float64)
        want = cm.paged_attention(q, kc, vc, table, step)
        assert torch.equal(cm.paged_attention(q, kc, vc, table, t), want)
    with pytest.raises(ValueError, match=r"max_intervals = 3 is out of range; expected \d+ "
                                         r"\(the step's num_intervals\)"):
        step.to_tensors(max_intervals=3)
    with pytest.raises(TypeError, match="max_intervals must be an int, got bool"):
        step.to_tensors(max_intervals=True)
    n = step.num_intervals
    with pytest.raises(ValueError, match=f"this step has {n} intervals but tensors.intervals "
                                         f"has room for {n - 1}"):
        step.write_tensors(own._replace(intervals=torch.zeros(2 * n - 2, dtype=torch.int32)))
    with pytest.raises(ValueError, match="tensors hold a step of num_seqs = 2, but this step "
                                         "has 3"):
        step.write_tensors(cm.builtin("causal").plan_step(1, [4, 5]).to_tensors())
    step.append([1, 2, 1])
    with pytest.raises(ValueError, match="total_q = 3, but this step has 4"):
        step.write_tensors(t)
    with pytest.raises(TypeError, match="must be the StepTensors of Step.to_tensors, got tuple"):
        step.write_tensors(tuple(t))
    with pytest.raises(TypeError, match=r"tensors.kv_len must be a 1-D int32 tensor, got "
                                        r"torch.int64 tensor"):
        step.write_tensors(t._replace(kv_len=t.kv_len.long()))


def test_write_tensors_refuses_before_writing_and_leaves_other_steps_alone(torch):
    """write_tensors checks what a write could fill only in part before it writes anything (a
    mixed inference tensor, an expand, overlapping tensors: the tensors stay unchanged), names
    a hand-made StepTensors' non-int shapes, and writing another Step's cached tensors takes
    them out of that Step's cache instead of changing what it computes; max_intervals stops
    at the most intervals a step holds (2^31 took 16 GiB of host memory to pad)."""
    causal = cm.builtin("causal")
    step = causal.plan_step([2, 1, 1], [6, 18, 34])
    t = causal.plan_step([1, 1, 2], [5, 17, 33]).to_tensors(max_intervals=10)
    before = [x.clone() for x in t[:4]]
    with torch.inference_mode():
        frozen = torch.zeros(20, dtype=torch.int32)
    with pytest.raises(ValueError, match="tensors.intervals is an inference tensor"):
        step.write_tensors(t._replace(intervals=frozen))
    with pytest.raises(ValueError, match=r"tensors.kv_len has elements that share memory"):
        step.write_tensors(t._replace(kv_len=torch.zeros(1, dtype=torch.int32).expand(3)))
    buf = torch.zeros(40, dtype=torch.int32)
    with pytest.raises(ValueError, match="tensors.cu_q and tensors.row_ptr overlap in memory"):
        step.write_tensors(cm.StepTensors(buf[0:4], buf[4:7], buf[1:6], buf[10:30], 3, 4, 2))
    assert all(torch.equal(a, b) for a, b in zip(before, t[:4])) and buf.eq(0).all()
    with pytest.raises(TypeError, match=r"tensors.num_seqs must be an int, got str '3'"):
        step.write_tensors(t._replace(num_seqs="3"))
    with torch.inference_mode():  # inside inference mode, inference tensors are written
        own = step.to_tensors(max_intervals=10)
        assert step.write_tensors(own) is own
    # The same tensors again, their layout remembered: outside inference mode still refused.
    with pytest.raises(ValueError, match="tensors.cu_q is an inference tensor"):
        step.write_tensors(own)
    # Moved in place (set_) after a write: checked again, not written through the old layout.
    mine = step.to_tensors(max_intervals=11)
    step.write_tensors(mine)
    mine.kv_len.set_(mine.cu_q.untyped_storage(), mine.cu_q.storage_offset(), (3,), (1,))
    with pytest.raises(ValueError, match="tensors.kv_len and tensors.cu_q overlap in memory"):
        step.write_tensors(mine)

    # Another step's cached tensors: written, they leave its cache.
    kc = torch.randn(40, 4, 1, 8, dtype=torch.float64)
    vc = torch.randn_like(kc)
    table = torch.arange(36, dtype=torch.int32).reshape(3, 12)
    q = torch.randn(3, 2, 8, dtype=torch.float64)
    first = causal.plan_step(1, [5, 17, 33])
    want = cm.paged_attention(q, kc, vc, table, first)
    cached = first.to_tensors()
    causal.plan_step(1, [6, 18, 34]).write_tensors(cached)
    assert cached.kv_len.tolist() == [6, 18, 34]
    assert first.to_tensors() is not cached and first.to_tensors().kv_len.tolist() == [5, 17, 33]
    assert torch.equal(cm.paged_attention(q, kc, vc, table, first), want)

    with pytest.raises(ValueError, match=r"max_intervals = 134217729 is out of range; expected "
                                         r"3 \(the step's num_intervals\) ..= 134217728"):
        first.to_tensors(max_intervals=(1 << 27) + 1)
    with pytest.raises(ValueError, match=r"max_intervals = \(an int of 16610 bits\) is out"):
        first.to_tensors(max_intervals=10**5000)


def test_paged_attention_names_a_bad_hand_made_step_tensors(torch):
    step = cm.builtin("causal").plan_step(1, [5, 17, 33])
    st = step.to_tensors()
    kc = torch.randn(40, 4, 1, 8)
    args = (torch.randn(3, 2, 8), kc, torch.randn_like(kc),
            torch.arange(36, dtype=torch.int32).reshape(3, 12))
    with pytest.raises(ValueError, match=r"step.cu_q has shape \(3,\); expected "
                                         r"\[num_seqs \+ 1\] = \[4\]"):
        cm.paged_attention(*args, st._replace(cu_q=st.cu_q[:3]))
    with pytest.raises(TypeError, match="step.num_seqs must be an int, got float 3.0"):
        cm.paged_attention(*args, st._replace(num_seqs=3.0))
    with pytest.raises(TypeError, match="step.max_q_len must be an int, got str 'x'"):
        cm.paged_attention(*args, st._replace(max_q_len="x"))
    with pytest.raises(ValueError, match="step.max_q_len = 0; it must be at least 1"):
        cm.paged_attention(*args, st._replace(max_q_len=0))
    with pytest.raises(ValueError, match="step.kv_len is on meta but q is on cpu"):
        cm.paged_attention(*args, st._replace(kv_len=st.kv_len.to("meta")))


def test_bad_tensor_scalars_are_named_as_given(torch):
    step = cm.builtin("causal").plan_step(1, [4, 9])
    with pytest.raises(TypeError, match=r"new_tokens must be an int .*, got Tensor "
                                        r"tensor\(1.5000\)$"):
        step.append(torch.tensor(1.5))
    with pytest.raises(TypeError, match=r"q_len must be an int .*, got Tensor tensor\(True\)$"):
        cm.builtin("causal").plan_step(torch.tensor(True), [4])
    assert step.append(torch.tensor(2)).q_len == [2, 2]


def test_cpu_step_tensors_pickle_alone(torch):
    """CPU StepTensors are four tensors of their own (what Step's pickling error tells users
    to send): each pickles, and holds once loaded, its own array, not all four."""
    import pickle

    step = cm.builtin("sliding_window", window=50).plan_step([64] * 16, [4096] * 16)
    t = step.to_tensors()
    arrays = t[:4]
    assert [x.untyped_storage().nbytes() for x in arrays] == [4 * x.numel() for x in arrays]
    loaded = pickle.loads(pickle.dumps(t))
    assert all(torch.equal(a, b) for a, b in zip(arrays, loaded[:4]))
    assert [x.untyped_storage().nbytes() for x in loaded[:4]] == [4 * x.numel() for x in arrays]
    assert len(pickle.dumps(t)) < 2 * 4 * sum(x.numel() for x in arrays)


@pytest.mark.parametrize("q_len,kv_len,heads", [
    ([3, 130, 1], [40, 300, 9], (8, 2)),
    ([128, 128], [128, 256], (4, 4)),
    ([64] * 3, [700] * 3, (6, 1)),
])
def test_prefill_virtual_rows_round_trip(torch, q_len, kv_len, heads):
    """The paged forward's rows: query head kv_head * group + j of step row r sits at virtual
    row row_index[r * group + j] of kv head kv_head, padding rows are zero, every sequence
    starts a 128-row tile, and the kernel's outputs come back to each (row, head) whole."""
    from compilemask import _ops

    num_heads, num_kv_heads = heads
    group = num_heads // num_kv_heads
    step = cm.builtin("causal").plan_step(q_len, kv_len)
    pt = step.prefill_tensors("cpu", group)
    assert pt.row_group == group and pt.row_index.shape == (step.total_q * group,)
    starts = [0]
    for n in q_len:
        starts.append(starts[-1] + -(-n * group // 128) * 128)
    assert pt.q_rows == starts[-1]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(step.total_q, num_heads, 16, generator=g)
    qv = _ops.to_virtual_rows(q, pt.row_index, pt.q_rows, group)
    assert qv.shape == (pt.q_rows, num_kv_heads, 16) and qv.is_contiguous()
    seen = torch.zeros(pt.q_rows, dtype=torch.bool)
    for s, n in enumerate(q_len):
        for i in range(n):
            r = sum(q_len[:s]) + i
            for h in range(num_heads):
                v = pt.row_index[r * group + h % group].item()
                assert v == starts[s] + i * group + h % group
                assert torch.equal(qv[v, h // group], q[r, h])
                seen[v] = True
    assert not qv[~seen].any()
    out_v = torch.randn(pt.q_rows, num_kv_heads, 16, generator=g)
    lse_v = torch.randn(num_kv_heads, pt.q_rows, generator=g)
    out, lse = _ops.from_virtual_rows(out_v, lse_v, pt.row_index, group)
    assert out.shape == q.shape and lse.shape == (step.total_q, num_heads)
    for r in range(step.total_q):
        for h in range(num_heads):
            v = pt.row_index[r * group + h % group].item()
            assert torch.equal(out[r, h], out_v[v, h // group])
            assert lse[r, h].item() == lse_v[h // group, v].item()


def test_paged_attention_bad_inputs(torch):
    step = cm.builtin("causal").plan_step([1, 2], [20, 5])
    kc, vc, table = make_cache(torch, [20, 5], 8, 2, 4, 4, [None, None], 3)
    q = torch.randn(3, 4, 4, dtype=torch.float64)
    bad = table.clone()
    bad[0, 1] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0\]\[1\] = .* is out of range; "
                                         r"sequence 0 reads it"):
        cm.paged_attention(q, kc, vc, bad, step)
    with pytest.raises(ValueError, match="block_table must be int32"):
        cm.paged_attention(q, kc, vc, table.long(), step)
    with pytest.raises(ValueError, match="the step has total_q = 3 rows, but q has 2"):
        cm.paged_attention(q[:2], kc, vc, table, step)
    with pytest.raises(ValueError, match="block_table has 1 rows"):
        cm.paged_attention(q, kc, vc, table[:1], step)
    with pytest.raises(ValueError, match="q must be"):
        cm.paged_attention(q[None], kc, vc, table, step)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        cm.paged_attention(torch.randn(3, 3, 4, dtype=torch.float64), kc, vc, table, step)
    with pytest.raises(ValueError, match="one dtype"):
        cm.paged_attention(q.float(), kc, vc, table, step)
    with pytest.raises(ValueError, match="needs 3 pages of 8 slots"):
        cm.paged_attention(q, kc, vc, table[:, :2].contiguous(), step)
    with pytest.raises(TypeError, match="step must be a compilemask.Step"):
        cm.paged_attention(q, kc, vc, table, [0, 1])
    with pytest.raises(ValueError, match="kernel must be 'auto', 'decode' or 'prefill', got 'fast'"):
        cm.paged_attention(q, kc, vc, table, step, kernel="fast")
    # Each zero size is named with where it comes from (one message listed all five).
    for args, name in [((q, kc, vc[..., :0]), r"head_dim_v \(v_cache.shape\[3\]\)"),
                       ((q, kc[:, :0], vc[:, :0]), r"page_size \(k_cache.shape\[1\]\)")]:
        with pytest.raises(ValueError, match=name + " = 0; it must be at least 1"):
            cm.paged_attention(*args, table, step)
    # Hand-made StepTensors: each array an int32 tensor, named otherwise.
    tensors = step.to_tensors()
    for name, value in [("kv_len", None), ("kv_len", tensors.kv_len.float()),
                        ("intervals", [0, 1])]:
        with pytest.raises(TypeError, match=f"step.{name} must be an int32 tensor"):
            cm.paged_attention(q, kc, vc, table, tensors._replace(**{name: value}))


@pytest.mark.parametrize("name,params", SERVING + [("tree_decode", None)])
def test_cuda_matches_the_float64_reference(torch, name, params):
    """The decode kernel through the public API (bf16, head_dim 64 and 128, GQA, shared and
    shuffled pages, NaN in every slot no sequence owns) against the float64 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = "cuda"
    q_len, kv_len = [1, 7, 64, 1, 5], [1, 127, 129, 4097, 600]
    if params is None:
        trees = [[-1], [-1, 0, 0, 1, 1, 2, 2], [-1] + [i // 2 for i in range(63)], [-1],
                 [-1, 0, 1, 2, 3]]
        step = cm.builtin(name).plan_step(q_len, kv_len, params=[{"parents": t} for t in trees])
    else:
        step = cm.builtin(name, **params).plan_step(q_len, kv_len)
    for d, (hq, hk) in [(128, (32, 8)), (64, (8, 1))]:
        kc, vc, table = make_cache(torch, kv_len, 16, hk, d, d, [None, None, (1, 7), None, None], d)
        q = torch.randn(step.total_q, hq, d, dtype=torch.float64)
        bf = torch.bfloat16
        q, kc, vc = (x.to(bf).double() for x in (q, kc, vc))
        want, want_lse = dense_reference(torch, q, kc, vc, table, step, 1 / math.sqrt(d))
        for kernel in ("auto", "decode", "prefill"):
            out, lse = cm.paged_attention(q.to(bf).to(dev), kc.to(bf).to(dev),
                                          vc.to(bf).to(dev), table.to(dev), step,
                                          return_lse=True, kernel=kernel)
            assert out.dtype == bf and out.device.type == "cuda"
            assert (out.double().cpu() - want).abs().max().item() <= 2e-2, kernel
            finite = want_lse.isfinite()
            assert torch.equal(lse.cpu().isfinite(), finite), kernel
            assert (lse.double().cpu()[finite] - want_lse[finite]).abs().max().item() <= 1e-3


PREFILL = [
    # name, params, page_size, (hq, hk), head_dim, dtype
    ("causal", {}, 16, (8, 2), 128, "bfloat16"),
    ("causal", {}, 8, (4, 4), 64, "float16"),
    ("sliding_window", {"window": 100}, 128, (8, 1), 128, "float16"),
    ("dilated_window", {"window": 300, "dilation": 3}, 256, (4, 2), 64, "bfloat16"),
]


@pytest.mark.parametrize("name,params,page_size,heads,d,dtype", PREFILL)
def test_cuda_prefill_chunks_match_the_float64_reference(torch, name, params, page_size, heads,
                                                         d, dtype):
    """Prefill chunks (hundreds of new rows per sequence, lengths ending inside a 128-key
    block, query tiles holding two sequences' rows, a shared prompt's pages, NaN in every
    slot no sequence owns) through the paged forward, chosen by "auto", against the float64
    reference; the decode kernel on the same step agrees."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev, dt = "cuda", getattr(torch, dtype)
    q_len, kv_len = [300, 513, 128, 65], [1000, 513, 2049, 193]
    step = cm.builtin(name, **params).plan_step(q_len, kv_len)
    hq, hk = heads
    shared = [None, None, (0, 3), None]
    kc, vc, table = make_cache(torch, kv_len, page_size, hk, d, d, shared, page_size + d)
    q = torch.randn(step.total_q, hq, d, dtype=torch.float64)
    q, kc, vc = (x.to(dt).double() for x in (q, kc, vc))
    want, want_lse = dense_reference(torch, q, kc, vc, table, step, 1 / math.sqrt(d))
    args = (q.to(dt).to(dev), kc.to(dt).to(dev), vc.to(dt).to(dev), table.to(dev), step)
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    outs = {}
    for kernel in ("auto", "decode"):
        out, lse = cm.paged_attention(*args, return_lse=True, kernel=kernel)
        assert out.shape == (step.total_q, hq, d) and lse.shape == (step.total_q, hq)
        assert lse.is_contiguous()
        assert (out.double().cpu() - want).abs().max().item() <= tol, kernel
        assert (lse.double().cpu() - want_lse).abs().max().item() <= 1e-3, kernel
        outs[kernel] = out
    assert (outs["auto"].float() - outs["decode"].float()).abs().max().item() <= 2 * tol


def test_cuda_prefill_compiles_and_refuses_what_it_lacks(torch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = "cuda"
    step = cm.builtin("causal").plan_step([200, 90], [700, 90])
    kc, vc, table = make_cache(torch, [700, 90], 16, 2, 64, 64, [None, None], 11)
    q = torch.randn(step.total_q, 4, 64, dtype=torch.float64)
    want, _ = dense_reference(torch, q.half().double(), kc.half().double(), vc.half().double(),
                              table, step, 0.125)
    q, kc, vc, table = q.half().to(dev), kc.half().to(dev), vc.half().to(dev), table.to(dev)

    def run(q):
        return cm.paged_attention(q, kc, vc, table, step, scale=0.125, kernel="prefill") * 2

    got = torch.compile(run, fullgraph=False)(q)
    assert (got.double().cpu() / 2 - want).abs().max().item() <= 8e-3
    with pytest.raises(ValueError, match="needs a compilemask.Step"):
        cm.paged_attention(q, kc, vc, table, step.to_tensors(dev), kernel="prefill")
    with pytest.raises(ValueError, match="needs 44 pages of 16, but block_table rows hold "
                                         "max_pages_per_seq = 40"):
        cm.paged_attention(q, kc, vc, table[:, :40].contiguous(), step, kernel="prefill")
    with pytest.raises(ValueError, match="needs 44 pages of 16"):
        cm.paged_attention(q, kc, vc, table[:, :40].contiguous(), step, kernel="decode")
    odd = cm.builtin("causal").plan_step([100], [100])
    kc12 = torch.zeros(20, 12, 2, 64, dtype=torch.float16, device=dev)
    t12 = torch.arange(10, dtype=torch.int32, device=dev)[None]
    with pytest.raises(ValueError, match="page_size = 12 is not a power of two"):
        cm.paged_attention(q[:100], kc12, kc12, t12, odd, kernel="prefill")
    # "auto" takes the decode kernel where the paged forward cannot run.
    out = cm.paged_attention(q[:100], kc12, kc12, t12, odd)
    assert torch.equal(out, torch.zeros_like(out))


def test_cuda_steps_queued_behind_other_work(torch):
    """A decode loop whose steps are laid out and copied while earlier kernels still run
    (the copies are queued on the stream, not waited for): each step, through both kernels,
    equals the float64 reference. Under CUDA graph capture StepTensors made before it are
    captured (and replay right); a Step is refused, and so are tensors first made inside."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    kv_len = [100, 137, 600]
    step = cm.builtin("sliding_window", window=50).plan_step([65, 70, 64], kv_len)
    kc, vc, table = make_cache(torch, [kv + 3 for kv in kv_len], 16, 2, 64, 64, [None] * 3, 6)
    bf = torch.bfloat16
    kc, vc = kc.to(bf).double(), vc.to(bf).double()
    on_dev = [x.to(dev) for x in (kc.to(bf), vc.to(bf), table)]
    busy = torch.randn(2048, 2048, device=dev)
    for i, kernel in enumerate(("prefill", "decode", "decode")):
        if i:
            step.append(1)
        for _ in range(30):
            busy = torch.tanh(busy @ busy)
        q = torch.randn(step.total_q, 8, 64, dtype=torch.float64).to(bf).double()
        want, _ = dense_reference(torch, q, kc, vc, table, step, 0.125)
        out = cm.paged_attention(q.to(bf).to(dev), *on_dev, step, scale=0.125, kernel=kernel)
        assert (out.double().cpu() - want).abs().max().item() <= 2e-2, (i, kernel)
    q = torch.randn(step.total_q, 8, 64, dtype=torch.float64).to(bf).double()
    want, _ = dense_reference(torch, q, kc, vc, table, step, 0.125)
    q_dev = q.to(bf).to(dev)
    tensors = step.to_tensors(dev)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="a Step cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cm.paged_attention(q_dev, *on_dev, step, scale=0.125, kernel="decode")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = cm.paged_attention(q_dev, *on_dev, tensors, scale=0.125, kernel="decode")
    graph.replay()
    assert (static.double().cpu() - want).abs().max().item() <= 2e-2
    step.append(1)
    with pytest.raises(RuntimeError, match="make them before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step.to_tensors(dev)


def test_cuda_calls_with_and_without_the_dispatcher_agree(torch):
    """An eager call runs the op's function directly; under a torch-function mode (here
    `with torch.device`), the profiler or with a gradient asked for it goes through the
    custom op: the same bits either way, and the profiler names the op."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    step = cm.builtin("causal").plan_step([1, 3, 70], [40, 300, 700])
    kc, vc, table = make_cache(torch, [40, 300, 700], 16, 2, 128, 128, [None] * 3, 8)
    args = [x.to(dev) for x in (kc.half(), vc.half(), table)]
    q = torch.randn(step.total_q, 4, 128, device=dev, dtype=torch.float16)
    for kernel in ("decode", "prefill"):
        plain = cm.paged_attention(q, *args, step, kernel=kernel)
        with torch.device(dev):
            assert torch.equal(cm.paged_attention(q, *args, step, kernel=kernel), plain)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert torch.equal(cm.paged_attention(q, *args, step, kernel=kernel), plain)
        op = "compilemask::paged_prefill" if kernel == "prefill" else "compilemask::paged_attention"
        assert any(e.name == op for e in prof.events()), kernel
        assert torch.equal(cm.paged_attention(q.requires_grad_(), *args, step, kernel=kernel),
                           plain)
        q = q.detach()


def test_cuda_graph_replays_steps_written_in_place(torch):
    """The serving loop of a captured CUDA graph: tensors with room for intervals, captured
    once; each later step (rows of several intervals, their number changing) is appended,
    written into them and replayed, and equals the float64 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    kv_len = [70, 300, 129]
    step = cm.builtin("dilated_window", window=40, dilation=3).plan_step(1, kv_len)
    kc, vc, table = make_cache(torch, [kv + 4 for kv in kv_len], 16, 2, 128, 128, [None] * 3, 9)
    bf = torch.bfloat16
    kc, vc = kc.to(bf).double(), vc.to(bf).double()
    on_dev = [x.to(dev) for x in (kc.to(bf), vc.to(bf), table)]
    tensors = step.to_tensors(dev, max_intervals=4 * step.num_intervals)
    q = torch.zeros(step.total_q, 8, 128, device=dev, dtype=bf)
    cm.paged_attention(q, *on_dev, tensors, scale=0.1)  # loads the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = cm.paged_attention(q, *on_dev, tensors, scale=0.1)
    for _ in range(4):
        step.append(1)
        step.write_tensors(tensors)
        q_host = torch.randn(step.total_q, 8, 128, dtype=torch.float64).to(bf).double()
        q.copy_(q_host.to(bf))
        graph.replay()
        want, _ = dense_reference(torch, q_host, kc, vc, table, step, 0.1)
        assert (static.double().cpu() - want).abs().max().item() <= 2e-2


def test_cuda_refuses_what_the_kernel_lacks(torch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = "cuda"
    step = cm.builtin("causal").plan_step(1, [4])
    kc, vc, table = make_cache(torch, [4], 4, 1, 8, 4, [None], 4)
    with pytest.raises(NotImplementedError, match="head_dim 64 or 128"):
        cm.paged_attention(torch.zeros(1, 1, 8, device=dev, dtype=torch.float16),
                           kc.half().to(dev), vc.half().to(dev), table.to(dev), step)
    # Neither kernel runs these, whichever is asked for: the same error, before any layout.
    for kernel in ("auto", "prefill", "decode"):
        with pytest.raises(NotImplementedError, match="head_dim 64 or 128"):
            cm.paged_attention(torch.zeros(1, 1, 8, device=dev, dtype=torch.float16),
                               kc.half().to(dev), vc.half().to(dev), table.to(dev), step,
                               kernel=kernel)
        with pytest.raises(NotImplementedError, match="got float32"):
            cm.paged_attention(torch.zeros(1, 1, 8, device=dev), kc.float().to(dev),
                               vc.float().to(dev), table.to(dev), step, kernel=kernel)


def test_one_step_shared_between_threads():
    """Appends from several threads, with readers between them, on one Step: every call
    succeeds (no "Already mutably borrowed"), no append is lost, and the step ends as the same
    appends made one after another leave it."""
    import sys
    import threading

    # A mask that reads b: rows are planned, not looked up, so each append holds the step
    # (with the GIL released) long enough for the other threads to reach it.
    program = cm.compile("mask = k <= q & (k + b) % 3 != 0;")
    q_len, kv_len = [1] * 6, [3000, 2000, 4000, 1000, 2500, 3500]
    step = program.plan_step(q_len, kv_len)
    writers, appends, readers = 3, 40, 2
    errors: list = []
    done = threading.Event()
    start = threading.Barrier(writers + readers)

    def write():
        try:
            start.wait()
            for _ in range(appends):
                step.append(1)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def read():
        try:
            start.wait()
            while not done.is_set():
                assert len(step.row(0)) > 0
                kv = step.kv_len
                assert step.q_len == q_len and len(kv) == 6
                assert step.total_q == 6 and step.num_seqs == 6
                step._native.prefill_arrays(2)
                step._native.arrays()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=write) for _ in range(writers)]
        reading = [threading.Thread(target=read) for _ in range(readers)]
        for t in threads + reading:
            t.start()
        for t in threads:
            t.join()
        done.set()
        for t in reading:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []

    sequential = program.plan_step(q_len, kv_len)
    for _ in range(writers * appends):
        sequential.append(1)
    assert step.kv_len == sequential.kv_len == [n + writers * appends for n in kv_len]
    assert step._native.arrays() == sequential._native.arrays()
    assert [step.row(r) for r in range(step.total_q)] == [
        sequential.row(r) for r in range(sequential.total_q)]


def test_tensors_of_a_shared_step_follow_its_appends():
    """`to_tensors` racing `append` on one Step never caches an older step's tensors: after
    the threads stop, the cached tensors are the final step's."""
    torch = pytest.importorskip("torch")
    import threading

    step = cm.builtin("causal").plan_step(1, [300, 200, 400])
    done = threading.Event()
    errors: list = []

    def read():
        try:
            while not done.is_set():
                step.to_tensors()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for _ in range(200):
        step.append(1)
    done.set()
    for t in readers:
        t.join()
    assert errors == []
    cached = step.to_tensors()
    assert cached.kv_len.tolist() == [500, 400, 600] == step.kv_len
    fresh = cm.builtin("causal").plan_step(1, [500, 400, 600]).to_tensors()
    for name in ("cu_q", "kv_len", "row_ptr", "intervals"):
        assert torch.equal(getattr(cached, name), getattr(fresh, name)), name
