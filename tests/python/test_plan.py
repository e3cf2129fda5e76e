"""Planning: statistics and row intervals against the independent workloads.md oracle
(tests/workloads/oracle.py), against brute force, and the error cases."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import oracle
import pytest
from conftest import runs
from dense_reference import dense_predicate

import compilemask as cm

PLAN_FIELDS = ("q_len", "kv_len", "visible_pairs", "empty_rows", "max_intervals_per_row",
               "tiles", "computed_pairs")

# Small and odd sizes with scaled-down parameters, so that segment boundaries, cut
# segments, zero lengths and merged intervals all occur (the oracle's own self-test cases).
CASES = [c for c in oracle.SELFTEST_CASES
         if not (c[0] == "trace_prompt_groups" and c[2])  # the built-in fixes group = 8
         and c[2].get("window") != 0]  # the built-in requires window >= 1 (tested below)

TILES = [(128, 128), (64, 96), (7, 13), (16, 16)]


@pytest.mark.parametrize("case", CASES,
                         ids=[f"{n}-{s}-{i}" for i, (n, s, _) in enumerate(CASES)])
def test_rows_and_stats_match_oracle(case):
    name, q_len, params = case
    want = oracle.BUILTINS[name](q_len, **params)
    program = cm.builtin(name, **params)
    plan = program.plan(q_len)
    assert plan.rows() == want.rows(0, q_len)
    for tile in TILES:
        got = program.plan(q_len, block_size=tile).stats()
        expected = oracle.plan_stats(want, *tile)
        assert {f: got[f] for f in PLAN_FIELDS} == expected, tile


@pytest.mark.parametrize("name", list(oracle.BUILTINS))
def test_defaults_at_4k_match_oracle(name):
    q_len = oracle.clear_length(64) if name == "clear" else 4097
    want = oracle.BUILTINS[name](q_len)
    plan = cm.builtin(name).plan(q_len)
    stats = plan.stats()
    assert {f: stats[f] for f in PLAN_FIELDS} == oracle.plan_stats(want)
    # Rows around every segment boundary, and the first and last rows.
    rows = {0, 1, q_len - 2, q_len - 1}
    for b in want.boundaries():
        rows.update(r for r in range(b - 2, b + 2) if 0 <= r < q_len)
    for q in sorted(rows):
        assert plan.intervals(q) == want.rows(q, q + 1)[0], q


@pytest.mark.parametrize("radius", [16, 5, 3, 1])
@pytest.mark.parametrize("grid", range(1, 41))
def test_clear_grids_match_oracle(grid, radius):
    # Every small grid, including grids narrower than the disc (a planner regression of
    # 29d3029, fixed in 43b1fcb, merged image-row runs there).
    text = 24
    q_len = text + grid * grid
    plan = cm.builtin("clear", radius=radius, text=text).plan(q_len)
    assert plan.rows() == oracle.clear(q_len, radius=radius, text=text).rows(0, q_len)


def test_sliding_window_requires_a_positive_window():
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("sliding_window").plan(100, window=0)
    assert e.value.code == "CM0305"
    assert "window must be >= 1" in str(e.value)


@pytest.mark.parametrize("name,q_len,params", [
    ("causal", 97, {}),
    ("sliding_window", 130, {"window": 17}),
    ("document_causal", 150, {"lengths": [20, 0, 7, 50, 1]}),
    ("hstu", 160, {"lengths": [40, 9, 3, 60], "contextual": 3, "target_divisor": 4}),
    ("shared_prefix", 170, {"prompts": [15, 9], "responses": [4, 0, 7, 2, 5], "group": 3}),
    ("clear", 16 + 9 * 9, {"text": 16, "radius": 3}),
    ("trace_documents", 200, {}),
])
def test_dense_matches_brute_force(name, q_len, params):
    visible = dense_predicate(name, q_len, **params)
    plan = cm.builtin(name, **params).plan(q_len)
    dense = plan.to_dense(0, 0, format="list")
    for q in range(q_len):
        want = [visible(q, k) for k in range(q_len)]
        assert dense[q] == want, q
        assert plan.intervals(q) == runs(want), q


# Masks from docs/language.md and docs/python.md, each with an independent predicate.
CUSTOM = {
    "cross_documents": (
        "param qlens: [int] = [150, 150];\nparam klens: [int] = [70, 110];\n"
        "segments qdoc = qlens;\nsegments kdoc = klens fill kv_len;\n"
        "mask = k in kdoc[qdoc.index(q)];",
        300, 180, lambda q, k: (q < 150) == (k < 70)),
    "bottom_right_causal_tall": ("mask = k <= q + kv_len - q_len;", 5, 2,
                                 lambda q, k: k <= q - 3),
    "bottom_right_causal_wide": ("mask = k <= q + kv_len - q_len;", 2, 5,
                                 lambda q, k: k <= q + 3),
    "top_left_causal_tall": ("mask = k <= q;", 5, 2, lambda q, k: k <= q),
    "chunked": ("param chunk: int = 7;\nmask = k / chunk == q / chunk & k <= q;", 50, 50,
                lambda q, k: k // 7 == q // 7 and k <= q),
    "dilated": ("mask = (q - k) % 3 == 0 & q - 12 < k <= q;", 40, 40,
                lambda q, k: (q - k) % 3 == 0 and q - 12 < k <= q),
    "sink_local": ("mask = k < 4 | q - 5 < k <= q;", 40, 40,
                   lambda q, k: k < 4 or q - 5 < k <= q),
    "elementwise": ("mask = elementwise((q * 7 + k * 3) % 5 < 2);", 23, 31,
                    lambda q, k: (q * 7 + k * 3) % 5 < 2),
    "l2_disc": ("grid img = [6, 6] at 4;\n"
                "mask = if q in img then k < 4 | l2(img) < 2 else k < kv_len;", 40, 40,
                lambda q, k: True if q < 4 else (k < 4 or (
                    k >= 4 and ((q - 4) // 6 - (k - 4) // 6) ** 2
                    + ((q - 4) % 6 - (k - 4) % 6) ** 2 < 4))),
}


@pytest.mark.parametrize("key", list(CUSTOM))
def test_custom_masks_against_predicates(key):
    source, q_len, kv_len, visible = CUSTOM[key]
    program = cm.compile(source, name=key)
    plan = program.plan(q_len, kv_len)
    for q in range(q_len):
        want = runs(visible(q, k) for k in range(kv_len))
        assert plan.intervals(q) == want, q
        assert program.brute_force_row(q, q_len, kv_len) == want, q
    if key == "elementwise":
        assert plan.elementwise_pairs > 0
    else:
        assert plan.elementwise_pairs == 0


def test_alignment_cases_al01():
    # workloads: AL-01 of the public reports, exact visible sets.
    br = cm.builtin("causal_bottom_right")
    tall = br.plan(5, 2)
    assert [tall.intervals(q) for q in range(5)] == [[], [], [], [(0, 1)], [(0, 2)]]
    assert tall.empty_rows == 3
    wide = br.plan(2, 5)
    assert [wide.intervals(q) for q in range(2)] == [[(0, 4)], [(0, 5)]]
    tl = cm.builtin("causal").plan(5, 2)
    assert [tl.intervals(q) for q in range(5)] == [[(0, 1)]] + [[(0, 2)]] * 4


@pytest.mark.parametrize("block", [8, 7, 60, 128])
def test_cross_attention_blocks_bd01(block):
    source, q_len, kv_len, visible = CUSTOM["cross_documents"]
    plan = cm.compile(source).plan(q_len, kv_len, block_size=block)
    assert plan.rows(0, 1) == [[(0, 70)]] and plan.rows(299, 300) == [[(70, 180)]]
    assert plan.empty_rows == 0
    tables = plan.block_tensors()
    m, n = -(-q_len // block), -(-kv_len // block)
    assert len(tables["kv_num_blocks"][0][0]) == m
    assert len(tables["kv_indices"][0][0][0]) == n


def test_per_head_masks():
    program = cm.compile("param windows: [int] = [2, 4];\n"
                         "mask = q - windows[h % count(windows)] < k <= q;")
    plan = program.plan(20, num_heads=4, batch=2)
    assert plan.num_masks == 2
    assert plan.mask_index == [0, 1, 0, 1] * 2
    assert plan.intervals(10, b=1, h=2) == [(9, 11)]
    assert plan.intervals(10, b=1, h=3) == [(7, 11)]
    assert plan.mask_id(1, 3) == 1
    assert plan.visible_pairs == 2 * 2 * (sum(min(q + 1, 2) for q in range(20))
                                          + sum(min(q + 1, 4) for q in range(20)))
    with pytest.raises(ValueError, match="distinct masks"):
        plan.to_cudnn_endpoints()
    assert plan.to_cudnn_endpoints(b=0, h=1)["nfunc"] == 3


def test_per_batch_lengths_replan_without_recompiling():
    program = cm.builtin("document_causal")
    for lengths in ([5, 5, 10], [20], [1] * 20, [0, 3, 17]):
        plan = program.plan(20, lengths=lengths)
        starts = [0]
        for n in lengths:
            if n:
                starts.append(starts[-1] + n)
        for q in range(20):
            doc_start = max(s for s in starts if s <= q)
            assert plan.intervals(q) == [(doc_start, q + 1)]


def test_planning_from_threads():
    program = cm.builtin("hstu")
    with ThreadPoolExecutor(4) as pool:
        plans = list(pool.map(lambda s: program.plan(s), [8192, 8192, 4096, 8192]))
    assert plans[0].rows() == plans[1].rows() == plans[3].rows()
    assert plans[2].q_len == 4096
    assert plans[0].compile_ms >= 0.0


def test_plan_properties():
    plan = cm.builtin("causal").plan(1000, 1200, block_size=(64, 32))
    assert (plan.q_len, plan.kv_len, plan.batch, plan.num_heads) == (1000, 1200, 1, 1)
    assert plan.block_size == (64, 32)
    assert plan.max_intervals_per_row == 1
    assert plan.descriptor_bytes > 0
    assert sum(plan.tiles.values()) == 16 * 38
    assert "causal" in repr(plan)
    assert plan.program.name == "<builtin causal>"
    stats = plan.stats()
    assert stats["tile"] == [64, 32] and stats["distinct_masks"] == 1


@pytest.mark.parametrize("kwargs,code", [
    ({"q_len": 0}, "CM0402"),
    ({"q_len": -5}, "CM0402"),
    ({"q_len": 10, "kv_len": 0}, "CM0402"),
    ({"q_len": 2**27}, "CM0402"),
    ({"q_len": 10, "block_size": 0}, "CM0401"),
    ({"q_len": 10, "block_size": (16, -1)}, "CM0401"),
    ({"q_len": 10, "batch": 0}, "CM0402"),
])
def test_bad_lengths(kwargs, code):
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("causal").plan(**kwargs)
    assert e.value.code == code
    assert code in str(e.value)


def test_require_failure_names_nearest_lengths():
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("clear").plan(1000)
    err = e.value
    assert err.code == "CM0305"
    assert "996" in str(err) and "1041" in str(err)
    (d,) = err.diagnostics
    assert d.line > 1  # points at the `require` in the built-in's source


@pytest.mark.parametrize("params,code", [
    ({"lengths": [10, -1]}, "CM0307"),
    ({"lengths": [0, 0]}, "CM0306"),
])
def test_bad_parameter_values(params, code):
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("document_causal").plan(100, **params)
    assert e.value.code == code


def test_integer_for_an_array_parameter_is_one_element():
    program = cm.builtin("document_causal")
    assert program.plan(100, lengths=7).rows() == program.plan(100, lengths=[7]).rows()


def test_scalar_given_an_array():
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("sliding_window").plan(100, window=[1, 2])
    assert e.value.code == "CM0308"


def test_plan_time_arithmetic_error_has_span():
    program = cm.compile("param d: int = 0;\nmask = k / d == q / d;")
    with pytest.raises(cm.PlanError) as e:
        program.plan(10)
    assert e.value.code == "CM0301"
    assert e.value.diagnostics[0].line == 2


def test_index_errors():
    plan = cm.builtin("causal").plan(10)
    with pytest.raises(IndexError):
        plan.intervals(10)
    with pytest.raises(IndexError):
        plan.intervals(-1)
    with pytest.raises(IndexError):
        plan.intervals(0, b=1)
    with pytest.raises(IndexError):
        plan.rows(5, 11)
    with pytest.raises(IndexError):
        cm.builtin("causal").brute_force_row(10, 10)


def _same_plan(a, b):
    assert (a.q_len, a.kv_len, a.batch, a.num_heads, a.block_size, a.cu_seqlens_q) == (
        b.q_len, b.kv_len, b.batch, b.num_heads, b.block_size, b.cu_seqlens_q)
    assert a.interval_arrays() == b.interval_arrays()
    assert a.mask_index == b.mask_index
    assert a.tiles == b.tiles


def test_programs_and_plans_pickle():
    # Both raised "cannot pickle 'compilemask._native...'", which rules out DataLoader
    # workers and multiprocessing. A program pickles as its source, name and bound
    # parameters; a plan as its program and plan arguments, planned again when loaded.
    import copy
    import pickle

    program = cm.compile("param w: [int] = [2, 5, 9];\nmask = q - w[h] < k <= q & k >= b;",
                         name="windows")
    for original in (program, program.with_params(w=[1, 2, 3]), cm.builtin("causal"),
                     cm.builtin("document_causal", lengths=[3, 4])):
        loaded = pickle.loads(pickle.dumps(original))
        assert (loaded.source, loaded.name, loaded.defaults) == (
            original.source, original.name, original.defaults)
        _same_plan(loaded.plan(7, num_heads=3), original.plan(7, num_heads=3))
        assert copy.deepcopy(original) is original
    plans = [program.plan(9, 11, batch=2, num_heads=3, block_size=(4, 8), w=[1, 3, 4]),
             cm.builtin("clear", text=3, grid=4, radius=1).plan(19, order="auto",
                                                                block_size=16),
             program.plan(cu_seqlens_q=[0, 3, 8], cu_seqlens_k=[0, 4, 9], num_heads=3)]
    for plan in plans:
        loaded = pickle.loads(pickle.dumps(plan))
        _same_plan(loaded, plan)
        orders = [None if p.order is None else [int(i) for i in p.order] for p in (loaded, plan)]
        assert orders[0] == orders[1]
        assert copy.deepcopy(plan) is plan


def test_a_pickled_plan_is_the_plan_made_not_the_arguments_now():
    # The plan kept the caller's objects: a lengths list changed after planning, or an
    # iterator already used up, gave another plan (or an error) when loaded.
    import pickle
    import warnings

    lengths = [40, 56]
    plan = cm.builtin("document_causal").plan(96, lengths=lengths, block_size=16)
    lengths[:] = [10, 86]
    assert pickle.loads(pickle.dumps(plan)).intervals(50) == plan.intervals(50) == [(40, 51)]
    order = list(range(20))[::-1]
    plan = cm.builtin("causal").plan(20, order=order)
    order.reverse()
    assert list(pickle.loads(pickle.dumps(plan)).order) == list(range(20))[::-1]
    plan = cm.builtin("document_causal").plan(96, lengths=iter([40, 56]))
    assert pickle.loads(pickle.dumps(plan)).intervals(50) == [(40, 51)]
    # Warnings were shown where it was planned; a worker that makes them errors loads it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warned = cm.compile("mask = k <= q + h;").plan(21)  # CM0262: reads h, one head
    with warnings.catch_warnings():
        warnings.simplefilter("error", cm.CompileMaskWarning)
        assert pickle.loads(pickle.dumps(warned)).intervals(3) == warned.intervals(3)
