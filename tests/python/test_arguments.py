"""Argument checking of the Python API: every bad argument is a clear exception naming it
(never a crash, never a silently different value), and deep programs work on small thread
stacks."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

import compilemask as cm


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter, so that a crash fails the test instead of
    killing pytest."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


NESTED_120 = "mask = k <= " + "(" * 120 + "q" + ")" * 120 + ";"
NESTED_200 = "mask = k <= " + "(" * 200 + "q" + ")" * 200 + ";"
LETS_70 = "let a0 = q;\n" + "".join(f"let a{i} = a{i - 1} + 1;\n" for i in range(1, 70)) \
    + "mask = k <= a69 - 69;"
# Past the limit on a `let`'s inlined depth (8192): one CM0105, at `a4096`.
LETS_5000 = "let a0 = q;\n" + "".join(f"let a{i} = a{i - 1} + 1;\n" for i in range(1, 5000)) \
    + "mask = k <= a4999 - 4999;"


@pytest.mark.parametrize("stack_kib", [256, 512])
def test_deep_programs_on_small_thread_stacks(stack_kib):
    script = f"""
        import threading
        import compilemask as cm
        NESTED_120 = {NESTED_120!r}
        NESTED_200 = {NESTED_200!r}
        LETS_70 = {LETS_70!r}
        LETS_5000 = {LETS_5000!r}
        out = {{}}

        def work():
            try:
                plan = cm.compile(NESTED_120).plan(5)
                out["nested"] = plan.visible_pairs
                out["row"] = cm.compile(NESTED_120).brute_force_row(3, 5)
                out["packed"] = cm.compile(NESTED_120).plan(cu_seqlens_q=[0, 2, 5]).visible_pairs
                out["lets_70"] = cm.compile(LETS_70).plan(5).visible_pairs
                for name, src in (("too_deep", NESTED_200), ("lets", LETS_5000)):
                    try:
                        cm.compile(src)
                        out[name] = "compiled"
                    except cm.MaskSyntaxError as e:
                        out[name] = sorted({{d.code for d in e.diagnostics}})
            except BaseException as e:  # reported below
                out["error"] = repr(e)

        threading.stack_size({stack_kib} * 1024)
        t = threading.Thread(target=work)
        t.start()
        t.join()
        print(out)
    """
    r = _run_isolated(script)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 (our own repr)
    assert "error" not in out, out
    assert out["nested"] == 15
    assert out["row"] == [(0, 4)]
    assert out["packed"] == 3 + 6
    assert out["too_deep"] == ["CM0105"]
    assert out["lets"] == ["CM0105"]
    assert out["lets_70"] == 15


def test_deep_programs_on_the_main_thread():
    assert cm.compile(NESTED_120).plan(5).visible_pairs == 15
    assert cm.compile(LETS_70).plan(5).visible_pairs == 15
    for src in (NESTED_200, LETS_5000):
        with pytest.raises(cm.MaskSyntaxError) as e:
            cm.compile(src)
        assert {d.code for d in e.value.diagnostics} == {"CM0105"}


# ---------------------------------------------------------------------------- token orders
@pytest.mark.parametrize("order", [{4, 3, 2, 1, 0}, frozenset(range(5)),
                                   {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}, {4: 0}.keys()])
def test_unordered_orders_are_rejected(order):
    with pytest.raises(TypeError, match=r"^order must be .*no order"):
        cm.builtin("causal").plan(5, order=order)


@pytest.mark.parametrize("order, error, match", [
    (5, TypeError, "order must be"),
    (2.5, TypeError, "order must be"),
    ([0, 1, 2, 3, 4.0], TypeError, r"order\[4\]"),
    ([0, 1, 2, True, 4], TypeError, r"order\[3\]"),
    ("bogus", ValueError, "order must be"),
    (b"\x00\x01", TypeError, "order must be"),
    ([0, 1, 2, 3], cm.PlanError, "CM0407"),
    ([0, 1, 2, 3, 3], cm.PlanError, "CM0407"),
    ([0, 1, 2, 3, -1], cm.PlanError, "CM0407"),
    ([0, 1, 2, 3, 2**70], cm.PlanError, "CM0407"),
])
def test_bad_orders(order, error, match):
    with pytest.raises(error, match=match):
        cm.builtin("causal").plan(5, order=order)


def test_ordered_iterables_are_accepted():
    program = cm.builtin("causal")
    want = program.plan(5, order=[4, 3, 2, 1, 0]).rows()
    assert program.plan(5, order=(4, 3, 2, 1, 0)).rows() == want
    assert program.plan(5, order=range(4, -1, -1)).rows() == want
    assert program.plan(5, order=iter([4, 3, 2, 1, 0])).rows() == want


def test_order_errors_do_not_quote_cli_flags():
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("causal").plan(5, order="auto")
    assert e.value.code == "CM0406"
    assert "--" not in str(e.value)


def test_sets_are_rejected_for_array_parameters_and_offsets():
    with pytest.raises(TypeError, match="lengths"):
        cm.builtin("document_causal").plan(100, lengths={30, 70})
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        cm.builtin("causal").plan(cu_seqlens_q={0, 3, 5})


# ---------------------------------------------------------------------------- ints
@pytest.mark.parametrize("name", ["q_len", "kv_len", "batch", "num_heads"])
def test_lengths_reject_bools_and_non_ints(name):
    args = {"q_len": 8}
    for bad in (True, False, 8.0, "8", None if name == "q_len" else [8]):
        if bad is None:
            continue
        with pytest.raises(TypeError, match=f"^{name} must be an int"):
            cm.builtin("causal").plan(**{**args, name: bad})


@pytest.mark.parametrize("name", ["q_len", "kv_len", "batch", "num_heads"])
def test_huge_lengths_are_plan_errors(name):
    with pytest.raises(cm.PlanError, match=f"{name} = {2**70} is out of range") as e:
        cm.builtin("causal").plan(**{"q_len": 8, name: 2**70})
    assert e.value.code == "CM0402"
    with pytest.raises(cm.PlanError, match=f"{name} = {-(2**70)} is out of range"):
        cm.builtin("causal").plan(**{"q_len": 8, name: -(2**70)})


@pytest.mark.parametrize("name", ["q_len", "kv_len", "batch", "num_heads"])
def test_python_checks_read_as_the_planner(name):
    """A length too large for the extension is refused in Python, a merely out-of-range one
    by the planner; both name the planner's own limit and read the same (one renderer)."""
    limit = {"q_len": 1 << 26, "kv_len": 1 << 26, "batch": 1 << 20, "num_heads": 1 << 16}[name]
    errors = []
    for bad in (2**70, limit + 1):
        with pytest.raises(cm.PlanError) as e:
            cm.builtin("causal").plan(**{"q_len": 8, name: bad})
        errors.append(e.value)
    for e, bad in zip(errors, (2**70, limit + 1)):
        assert str(e) == f"[CM0402] Error: {name} = {bad} is out of range; expected 1 ..= {limit}"
        assert e.rendered == str(e) and [d.code for d in e.diagnostics] == ["CM0402"]


def test_native_plan_error_refuses_unknown_codes():
    from compilemask import _native

    with pytest.raises(ValueError, match="CM9999"):
        _native.plan_error("CM9999", "message")
    e = _native.plan_error("CM0407", "bad order", "a hint")
    assert isinstance(e, cm.PlanError)
    assert (e.code, e.hint, str(e)) == ("CM0407", "a hint",
                                        "[CM0407] Error: bad order\n    Help: a hint")


def test_packed_num_heads_is_checked():
    with pytest.raises(TypeError, match="num_heads must be an int"):
        cm.builtin("causal").plan(cu_seqlens_q=[0, 3], num_heads=True)


@pytest.mark.parametrize("block_size, error", [
    (True, TypeError), ((True, 8), TypeError), (8.0, TypeError), ({8, 16}, TypeError),
    ((8, 8, 8), TypeError), (2**70, cm.PlanError), ((8, -1), cm.PlanError),
    ((0, 8), cm.PlanError),
])
def test_bad_block_sizes(block_size, error):
    with pytest.raises(error, match="block_size|tile"):
        cm.builtin("causal").plan(8, block_size=block_size)


def test_indices_reject_bools_and_huge_values():
    plan = cm.builtin("causal").plan(8)
    with pytest.raises(TypeError, match="q must be an int"):
        plan.intervals(True)
    with pytest.raises(IndexError, match=r"q = 1180591620717411303424 is out of range; "
                                          r"expected 0 <= q < 8"):
        plan.intervals(2**70)
    with pytest.raises(IndexError, match="b = .* expected 0 <= b < 1"):
        plan.mask_id(2**70, 0)
    with pytest.raises(IndexError, match="h = .* expected 0 <= h < 1"):
        plan.intervals(0, 0, -(2**70))
    with pytest.raises(TypeError, match="stop must be an int"):
        plan.rows(0, 2.0)
    with pytest.raises(TypeError, match="q_len must be an int"):
        cm.builtin("causal").brute_force_row(0, True)


# ---------------------------------------------------------------------------- params, text
@pytest.mark.parametrize("bad", [[1], [("window", 3)], "window", 3])
def test_with_params_needs_a_mapping(bad):
    with pytest.raises(TypeError, match="with_params: params must be a mapping"):
        cm.builtin("sliding_window").with_params(bad)


def test_with_params_accepts_mappings_and_keywords():
    p = cm.builtin("sliding_window")
    assert p.with_params({"window": 3}).defaults == {"window": 3}
    assert p.with_params(window=3).defaults == {"window": 3}
    assert p.with_params(None, window=3).defaults == {"window": 3}


def test_surrogates_in_source_and_names():
    with pytest.raises(ValueError, match=r"^source must be valid Unicode text.*U\+D800") as e:
        cm.compile("mask = k <= q; \ud800")
    assert not isinstance(e.value, UnicodeError)
    with pytest.raises(ValueError, match=r"^name must be valid Unicode text"):
        cm.compile("mask = k <= q;", name="\udfff")
    with pytest.raises(ValueError, match=r"^name must be valid Unicode text"):
        cm.builtin("causal\ud800")
    with pytest.raises(TypeError, match="name must be a str"):
        cm.compile("mask = k <= q;", name=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- namespace
def test_public_namespace_is_clean():
    assert "annotations" not in cm.__all__
    assert not hasattr(cm, "annotations")
    # Subpackages (`compilemask.integrations`) become attributes once any test imports them;
    # they are modules a user imports by name, not names the package exports.
    public = {n for n in dir(cm) if not n.startswith("_") and not inspect.ismodule(getattr(cm, n))}
    assert public == set(cm.__all__) - {"__version__"}
    assert not any(inspect.ismodule(getattr(cm, n)) for n in cm.__all__ if n != "__version__")


# ---------------------------------------------------------------------------- docs
def test_plan_stats_keys_are_those_of_plan_json():
    plan = cm.builtin("causal").plan(100, block_size=16)
    assert set(plan.stats()) == {
        "mask", "q_len", "kv_len", "batch", "num_heads", "tile", "visible_pairs",
        "empty_rows", "max_intervals_per_row", "tiles", "computed_pairs", "descriptor_bytes",
        "distinct_masks", "pieces", "elementwise_pairs", "compile_ms",
    }
    assert plan.stats()["tile"] == [16, 16]
    assert plan.stats()["distinct_masks"] == plan.num_masks


def _hf_t5_bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """transformers' T5Attention._relative_position_bucket, for one `rel = k - q`."""
    import math

    bucket, n = 0, -rel
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact)
                        * (num_buckets - exact))
    return bucket + min(large, num_buckets - 1)


def test_plan_stats_score_is_that_of_plan_json():
    # ALiBi's slopes for 4 heads are 2^-2, 2^-4, 2^-6, 2^-8 (Press et al.), subtracted:
    # `score - slope * (q - k)` is the linear term with slopes -2^-2, ...
    alibi = cm.builtin("causal_alibi").plan(64, num_heads=4).stats()["score"]
    assert alibi == {
        "softcap": None,
        "linear": {"slopes": [-(2.0 ** -2), -(2.0 ** -4), -(2.0 ** -6), -(2.0 ** -8)],
                   "q_coef": 1, "k_coef": -1, "offset": 0},
        "table": None, "sink": None, "reads_positions": True,
    }
    cap = cm.builtin("causal_softcap").plan(64).stats()["score"]
    assert cap == {"softcap": 50.0, "linear": None, "table": None, "sink": None,
                   "reads_positions": False}
    sinks = cm.builtin("sliding_window_sinks").plan(64, num_heads=3).stats()["score"]
    assert sinks["sink"] == {"tensor": "sinks", "shape": [3]}
    assert not sinks["reads_positions"]
    q_len = 300
    t5 = cm.builtin("t5_relative_bias").plan(q_len, num_heads=2).stats()["score"]
    read = {_hf_t5_bucket(k - q, True, 32, 128) for q in range(q_len) for k in range(q_len)}
    assert t5["table"] == {"tensor": "rel_bias", "shape": [2, 32], "num_buckets": 32,
                           "per_head": True, "buckets_read": len(read)}
    assert "score" not in cm.builtin("causal").plan(64).stats()


def test_documented_plan_attributes_exist():
    plan = cm.builtin("causal").plan(100)
    for name in ("q_len", "kv_len", "batch", "num_heads", "block_size", "visible_pairs",
                 "empty_rows", "max_intervals_per_row", "tiles", "computed_pairs",
                 "tile_density", "descriptor_bytes", "elementwise_pairs", "num_masks",
                 "mask_index", "uses_batch", "uses_head", "compile_ms", "program", "is_packed",
                 "cu_seqlens_q", "cu_seqlens_k", "order", "order_candidates",
                 "raster_computed_pairs", "intervals", "rows", "interval_arrays", "mask_id",
                 "order_info", "stats", "to_dense", "block_tensors", "to_block_mask",
                 "mask_mod", "to_cudnn_endpoints", "to_flashmask", "to_tensors"):
        assert hasattr(plan, name), name


def test_one_element_lists_for_int_parameters_are_documented_coercions():
    program = cm.builtin("sliding_window")
    assert program.plan(10, window=[3]).rows() == program.plan(10, window=3).rows()
    with pytest.raises(cm.PlanError) as e:
        program.plan(10, window=[3, 4])
    assert e.value.code == "CM0308"
    # Given as a default, it fails where it is given, not at every later plan.
    with pytest.raises(cm.PlanError) as e:
        program.with_params(window=[3, 4])
    assert e.value.code == "CM0308" and "parameter `window` is an integer" in str(e.value)
    assert program.with_params(window=[3]).plan(10).rows() == program.plan(10, window=3).rows()
    doc = cm.builtin("document_causal")
    assert doc.plan(10, lengths=5).rows() == doc.plan(10, lengths=[5]).rows()


def test_endless_iterators_for_array_parameters_stop_at_the_limit():
    import itertools

    program = cm.builtin("document_causal")
    with pytest.raises(ValueError, match=r"`lengths` has more than 16777216 entries"):
        program.plan(8, lengths=itertools.count(1))
    # An iterator of a reasonable length is an array like any other.
    assert program.plan(8, lengths=iter([3, 5])).rows(0, 8)[3] == [(3, 4)]


# ---------------------------------------------------------------------------- iterators
def test_endless_iterators_stop_at_each_inputs_limit():
    import itertools

    causal = cm.builtin("causal")
    cases = [
        (lambda: causal.plan(cu_seqlens_q=itertools.count()),
         "cu_seqlens_q has more than 1048577"),
        (lambda: causal.plan_step(1, itertools.count(1)), "kv_len has more than 1048576"),
        (lambda: causal.plan_step(itertools.repeat(1), [5]), "q_len has more than 1048576"),
        (lambda: causal.plan_step(1, [5], params=itertools.repeat({})),
         "params has more than 1048576"),
        (lambda: causal.plan_step(1, [5]).append(itertools.repeat(1)),
         "new_tokens has more than 1048576"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    # An order has q_len entries: past them it is a bad order, whatever follows.
    for order in (itertools.count(), range(51)):
        with pytest.raises(cm.PlanError, match="more than q_len = 50 entries") as e:
            causal.plan(50, order=order)
        assert e.value.code == "CM0407"


def test_lengths_are_checked_before_indices_and_names_before_use():
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("causal").brute_force_row(3, 0)
    assert e.value.code == "CM0402" and "q_len = 0 is out of range" in str(e.value)
    with pytest.raises(IndexError, match=r"q = 3 is out of range \[0, 2\)"):
        cm.builtin("causal").brute_force_row(3, 2)
    # Every length check of planning, the product of batch and heads included.
    for lengths, message in (({"batch": 2 ** 12, "num_heads": 2 ** 13},
                              r"batch x num_heads = 33554432 is out of range"),
                             ({"kv_len": 2 ** 27}, r"kv_len = 134217728 is out of range")):
        for call in (lambda: cm.builtin("causal").brute_force_row(0, 4, **lengths),
                     lambda: cm.builtin("causal").plan(4, **lengths)):
            with pytest.raises(cm.PlanError, match=message) as e:
                call()
            assert e.value.code == "CM0402"
    with pytest.raises(ValueError, match="a parameter name must be valid Unicode text"):
        cm.builtin("sliding_window").plan(10, **{"\ud800": 3})
    for side in (2 ** 40, -1):
        with pytest.raises(cm.PlanError, match=r"expected 1 \.\.= 4294967295"):
            cm.builtin("causal").plan(10, block_size=side)


def test_numpy_scalars_are_counts_in_serving_steps():
    np = pytest.importorskip("numpy")
    causal = cm.builtin("causal")
    step = causal.plan_step(np.int64(1), [5, 7])
    assert step.q_len == [1, 1]
    step.append(np.int64(2))
    assert step.kv_len == [7, 9] and step.row(0) == [(0, 6)]
    with pytest.raises(TypeError, match="kv_len must be a sequence of ints, one per sequence, "
                                        "got int64"):
        causal.plan_step(1, np.int64(5))
