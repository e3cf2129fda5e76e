"""The extension's one checked CUDA entry, without a GPU or torch (the refusals run anywhere:
they come before any driver call): every tensor reaches Rust as
(address, shape, strides, dtype, device), and a tensor on another device, of another dtype,
or a descriptor that does not fit the plan is refused with a ValueError naming it, before any
driver call; arguments that pass every check reach the runtime (a RuntimeError here, where
there is no GPU)."""

from __future__ import annotations

import pytest

import compilemask as cm
from compilemask import _native


def _tensor(shape, dtype="bfloat16", device=0, addr=0x1000_0000):
    strides, step = [], 1
    for d in reversed(shape):
        strides.insert(0, step)
        step *= d
    return (addr, tuple(shape), tuple(strides), dtype, device)


def _arrays(plan, dtype="int32", device=0, count=None, addr=0x100_0000):
    """A plan's descriptor arrays as the extension takes them: one int32 tensor holding them
    back to back (each padded to a multiple of 4 elements, at least 4, so every array starts
    16-byte aligned) and each array's length."""
    raw = plan._native.kernel_arrays()[:count]
    lens = [max(-(-len(a) // 16) * 4, 4) for a in raw]
    return (addr, (sum(lens),), (1,), dtype, device), lens


def _descriptor(plan, q_len=None, dtype="int32", device=0, count=None, ws_order=None,
                arrays=None):
    lens = [len(a) // 4 for a in plan._native.kernel_arrays()]
    if ws_order is None:
        ws_order = _native.cuda_ws_order(lens)
    if arrays is None:
        arrays = _arrays(plan, dtype, device, count)
    return (plan.q_len if q_len is None else q_len, plan.kv_len, 1, (1, 1), arrays, ws_order,
            _native.cuda_dq_turns(lens))


def _forward_args(**change):
    plan = cm.builtin("causal").plan(100)
    args = {
        "plan": _descriptor(plan),
        "q": _tensor((1, 2, 100, 64)),
        "k": _tensor((1, 2, 100, 64), addr=0x2000_0000),
        "v": _tensor((1, 2, 100, 64), addr=0x3000_0000),
        "out": _tensor((1, 2, 100, 64), addr=0x4000_0000),
        "lse": _tensor((1, 2, 100), "float32", addr=0x5000_0000),
    }
    args.update(change)
    return plan, args


# No score terms: (softcap, slopes, (q_coef, k_coef, offset), dist_bias, dist_per_head,
# dist_run_end, sinks, dist_bias_grad).
NO_SCORE = (0.0, None, (0.0, 0.0, 0.0), None, False, None, None, None)


def _forward(args, score=NO_SCORE):
    _native.cuda_forward(0, args["plan"], args["q"], args["k"], args["v"], args["out"],
                         args["lse"], 0.125, score)


def test_score_terms_are_checked_before_the_runtime():
    _, args = _forward_args()
    sinks = lambda n, dtype="float32": (0x7000_0000, (n,), (1,), dtype, 0)  # noqa: E731
    length = 100 + 100 - 1
    for score, message in [
        ((0.0, None, (0.0, 0.0, 0.0), None, False, None, sinks(3), None),
         r"score sinks: 3 elements, expected 2"),
        ((0.0, None, (0.0, 0.0, 0.0), None, False, None, sinks(2, "float16"), None),
         r"score sinks: dtype float16"),
        ((0.0, sinks(5), (-1.0, 1.0, 0.0), None, False, None, None, None),
         r"score slopes: 5 elements, expected 2"),
        ((0.0, None, (0.0, 0.0, 0.0), sinks(length), True, None, None, None),
         rf"score dist_bias: {length} elements, expected {2 * length}"),
        ((0.0, None, (0.0, 0.0, 0.0), sinks(length), False, sinks(length), None, None),
         r"score dist_run_end: dtype float32, expected int32"),
        ((-1.0, None, (0.0, 0.0, 0.0), None, False, None, None, None),
         r"score softcap = -1: expected a finite value > 0"),
        ((float("nan"), None, (0.0, 0.0, 0.0), None, False, None, None, None),
         r"score softcap = NaN"),
    ]:
        with pytest.raises(ValueError, match=message):
            _forward(args, score)


def _gpu_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Made-up addresses that pass every check would be launched on a real GPU.
@pytest.mark.skipif(_gpu_present(), reason="would launch on made-up addresses")
def test_arguments_that_pass_every_check_reach_the_runtime():
    _, args = _forward_args()
    # Without a GPU (or without kernels in the wheel) the runtime, not a check, refuses.
    with pytest.raises(RuntimeError, match="compilemask.attention on CUDA"):
        _forward(args)


@pytest.mark.parametrize("change,message", [
    ({"k": _tensor((1, 2, 100, 64), "float16")}, "k: dtype float16, expected bfloat16"),
    ({"v": _tensor((1, 2, 100, 64), device=1)}, "v is on cuda:1, the launch is on cuda:0"),
    ({"out": _tensor((1, 2, 100, 64), device=-1)}, "out is on not a CUDA device"),
    ({"lse": _tensor((1, 2, 100), "bfloat16")}, "lse: dtype bfloat16, expected float32"),
    ({"q": _tensor((1, 2, 100, 64), "float32")}, "q: dtype float32 is not supported on CUDA"),
    ({"v": _tensor((1, 2, 100, 32))},
     "head_dim = 64 with head_dim_v = 32 is not supported by fwd_ws at bf16"),
    ({"v": _tensor((1, 2, 99, 64))}, "v: shape \\[1, 2, 99, 64\\] differs from k's shape"),
    ({"out": _tensor((1, 2, 100, 128))},
     "out: shape \\[1, 2, 100, 128\\], expected \\[batch, num_heads, q_len, head_dim_v\\]"),
    ({"k": _tensor((1, 2, 99, 64)), "v": _tensor((1, 2, 99, 64))},
     "kv_len = 99 .* do not match the plan's q_len = 100 and kv_len = 100"),
    ({"k": _tensor((1, 2, 100, 64), addr=0x2000_0008)}, "k: address 0x20000008 is not 16-byte"),
])
def test_every_tensor_is_checked(change, message):
    _, args = _forward_args(**change)
    with pytest.raises(ValueError, match=message):
        _forward(args)


def test_the_descriptor_is_checked_against_the_plan():
    plan, args = _forward_args()
    for desc, message in [
        (_descriptor(plan, dtype="int64"), "kernel descriptor: dtype int64, expected int32"),
        (_descriptor(plan, dtype="uint8"), "kernel descriptor: dtype uint8, expected int32"),
        (_descriptor(plan, device=1), "plan array m_block_order is on cuda:1"),
        (_descriptor(plan, count=5),
         f"the plan has 5 kernel arrays, expected {len(_native.CUDA_PLAN_ARRAYS)}"),
        (_descriptor(plan, q_len=200), "the descriptor was built for other lengths"),
        (_descriptor(plan, ws_order=[0, 0]), r"tile set order \[0, 0\] is not a permutation"),
        (_descriptor(plan, ws_order=[1]), r"tile set order \[1\] is not a permutation"),
    ]:
        args["plan"] = desc
        with pytest.raises(ValueError, match=message):
            _forward(args)


def test_the_flat_descriptor_is_split_in_bounds():
    """The descriptor's arrays arrive as one tensor and their lengths: lengths that add up
    past the tensor (or overflow) or short of it (another plan's tensor: the arrays would be
    read at the wrong offsets), a strided tensor, a wrong count of lengths, an array moved
    off its alignment and a tensor whose end wraps the address space are refused before any
    driver call; negative lengths never reach Rust."""
    plan, args = _forward_args()
    (addr, (n,), _, dtype, dev), lens = _arrays(plan)
    flat = (addr, (n,), (1,), dtype, dev)
    big = 2 ** 64 - 1
    for arrays, message in [
        ((flat, lens[:-1] + [lens[-1] + 4]), "kernel descriptor holds"),
        (((addr, (n - 4,), (1,), dtype, dev), lens), "kernel descriptor holds"),
        ((flat, [big] + lens[1:]), "kernel descriptor holds"),
        ((flat, [big, 2] + lens[2:]), "kernel descriptor holds"),
        (((addr, (n,), (2,), dtype, dev), lens), "kernel descriptor: stride 2"),
        ((flat, lens[:5]), "kernel descriptor holds"),
        ((flat, lens[:-1]), "kernel descriptor holds"),
        ((flat, [*lens, 0]), f"the plan has {len(lens) + 1} kernel arrays"),
        # A stale tensor: longer than this plan's arrays (a bigger plan's).
        (((addr, (n + 64,), (1,), dtype, dev), lens), "kernel descriptor holds"),
        (((2 ** 64 - 64, (n,), (1,), dtype, dev), lens), "overflows"),
        ((flat, [lens[0] + 1, *lens[1:-1], lens[-1] - 1]), "not 16-byte aligned"),
    ]:
        args["plan"] = _descriptor(plan, arrays=arrays)
        with pytest.raises(ValueError, match=message):
            _forward(args)
    args["plan"] = _descriptor(plan, arrays=(flat, [-4, 4 + lens[0], *lens[1:]]))
    with pytest.raises(OverflowError):
        _forward(args)


def test_the_backward_checks_its_own_tensors():
    _, a = _forward_args()
    grads = (a["q"], a["k"], a["v"])
    ws = (0x6000_0000, (100_000,), (1,), "float32", 0)
    for bad, message in [
        ({"ws": (0x6000_0000, (100_000,), (1,), "float16", 0)}, "workspace: dtype float16"),
        ({"ws": (0x6000_0000, (100_000,), (2,), "float32", 0)}, "workspace: stride 2"),
        ({"dq": _tensor((1, 2, 100, 64), "float16")}, "dq: dtype float16, expected bfloat16"),
        ({"dlse": _tensor((1, 2, 100), "bfloat16")}, "dlse: dtype bfloat16, expected float32"),
        ({"dlse": _tensor((1, 2, 99), "float32")}, r"dlse: shape \[1, 2, 99\] differs from lse's"),
        ({"dlse": (0x5000_0002, (1, 2, 100), (200, 100, 1), "float32", 0)},
         "dlse: .*aligned"),
    ]:
        dq = bad.get("dq", grads[0])
        with pytest.raises(ValueError, match=message):
            _native.cuda_backward(0, a["plan"], a["q"], a["k"], a["v"], a["out"], a["q"],
                                  a["lse"], bad.get("dlse"), dq, grads[1], grads[2],
                                  bad.get("ws", ws), 0.125, False, NO_SCORE)


def test_the_forward_tile_order_follows_the_plans_tiles():
    """The default forward has a 128-row and a 192-row tile set (``ws128x128_*``,
    ``ws192x128_*``); a causal plan ranks the 192-row one first, a 256-key sliding window the
    128-row one (a 192-row block spans 64 more diagonal keys per tile); a wrong count of
    lengths is refused."""
    names = _native.CUDA_PLAN_ARRAYS
    assert "ws128x128_kv_indices" in names and "ws192x128_kv_indices" in names

    def order(plan):
        return _native.cuda_ws_order([len(a) // 4 for a in plan._native.kernel_arrays()])

    assert order(cm.builtin("causal").plan(8192)) == [1, 0]
    assert order(cm.builtin("sliding_window", window=256).plan(8192)) == [0, 1]
    with pytest.raises(ValueError, match="3 array lengths"):
        _native.cuda_ws_order([1, 2, 3])


def test_the_deterministic_dq_path_follows_the_share_of_partial_tiles():
    """The deterministic backward adds dQ in turns where at most 11% of the backward's 64 x 128
    tiles are partial (counted here from the plan at that block size): causal and documents
    do, CLEAR's 2D windows and trace documents (26% partial at 32K) do not."""
    def turns(plan):
        return _native.cuda_dq_turns([len(a) // 4 for a in plan._native.kernel_arrays()])

    cases = [(cm.builtin("causal"), 8192, True), (cm.builtin("document_causal"), 8192, True),
             (cm.builtin("clear"), 8612, False), (cm.builtin("trace_documents"), 32768, False)]
    for program, n, want in cases:
        tiles = program.plan(n, block_size=(64, 128)).tiles
        share = tiles["partial"] / (tiles["partial"] + tiles["full"])
        assert (share <= 0.11) == want, (program, share)
        assert turns(program.plan(n)) == want, (program, share)
    with pytest.raises(ValueError, match="cuda_dq_turns: 3 array lengths"):
        _native.cuda_dq_turns([1, 2, 3])
