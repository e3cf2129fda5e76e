"""Exports: dense, FlexAttention block tables, cuDNN endpoints, FlashMask bounds, each
checked against an independent evaluation from the row intervals or the dense mask."""

from __future__ import annotations

import pytest
from conftest import runs

import compilemask as cm

MASKS = [
    ("causal", 300, 300, {}),
    ("hstu", 333, 333, {"lengths": [100, 7, 60, 1, 90], "contextual": 3}),
    ("shared_prefix", 257, 257, {"prompts": [30, 20], "responses": [5, 9, 0, 4], "group": 3}),
    ("clear", 16 + 12 * 12, 16 + 12 * 12, {"text": 16, "radius": 4}),
    ("sliding_window", 200, 200, {"window": 33}),
    ("causal_bottom_right", 90, 140, {}),
    ("causal_bottom_right", 140, 90, {}),
    # Strided runs (one per row), written out as plain intervals by every export.
    ("dilated_window", 211, 190, {"window": 40, "dilation": 3}),
]
BLOCKS = [(128, 128), (16, 16), (32, 48), (7, 5)]


def _dense(plan):
    return plan.to_dense(0, 0, format="list")


def _tiles_from_dense(dense, bm, bn):
    """(full, partial) key-block lists per query block, by counting."""
    q_len, kv_len = len(dense), len(dense[0])
    full, partial = [], []
    for m0 in range(0, q_len, bm):
        f, p = [], []
        for j, n0 in enumerate(range(0, kv_len, bn)):
            cells = [dense[q][k] for q in range(m0, min(q_len, m0 + bm))
                     for k in range(n0, min(kv_len, n0 + bn))]
            if all(cells):
                f.append(j)
            elif any(cells):
                p.append(j)
        full.append(f)
        partial.append(p)
    return full, partial


@pytest.mark.parametrize("name,q_len,kv_len,params", MASKS)
def test_dense_agrees_with_intervals(name, q_len, kv_len, params):
    plan = cm.builtin(name, **params).plan(q_len, kv_len)
    dense = _dense(plan)
    assert len(dense) == q_len and all(len(r) == kv_len for r in dense)
    for q in range(q_len):
        assert runs(dense[q]) == plan.intervals(q)
    assert sum(map(sum, dense)) == plan.visible_pairs
    nested = plan.to_dense(format="list")
    assert nested[0][0] == dense


@pytest.mark.parametrize("name,q_len,kv_len,params", MASKS)
@pytest.mark.parametrize("block", BLOCKS)
def test_block_tensors_match_dense_counting(name, q_len, kv_len, params, block):
    plan = cm.builtin(name, **params).plan(q_len, kv_len, block_size=block)
    t = plan.block_tensors(0, 0)
    full, partial = _tiles_from_dense(_dense(plan), *block)
    m, n = len(full), -(-kv_len // block[1])
    assert t["block_size"] == block and t["seq_lengths"] == (q_len, kv_len)
    assert t["kv_num_blocks"] == [len(p) for p in partial]
    assert t["full_kv_num_blocks"] == [len(f) for f in full]
    for i in range(m):
        assert len(t["kv_indices"][i]) == n and sorted(t["kv_indices"][i]) == list(range(n))
        assert t["kv_indices"][i][:len(partial[i])] == partial[i]
        assert t["full_kv_indices"][i][:len(full[i])] == full[i]
    # Transposes: per key block, the query blocks, ascending.
    for j in range(n):
        assert t["q_indices"][j][:t["q_num_blocks"][j]] == [i for i in range(m)
                                                            if j in partial[i]]
        assert t["full_q_indices"][j][:t["full_q_num_blocks"][j]] == [i for i in range(m)
                                                                      if j in full[i]]
    counts = plan.tiles
    assert counts["full"] == sum(map(len, full))
    assert counts["partial"] == sum(map(len, partial))
    assert counts["empty"] == m * n - counts["full"] - counts["partial"]
    # Without (b, h): leading [batch][num_heads] dimensions.
    assert plan.block_tensors()["kv_num_blocks"] == [[t["kv_num_blocks"]]]


@pytest.mark.parametrize("name,q_len,kv_len,params", MASKS)
def test_cudnn_endpoints_decode_to_intervals(name, q_len, kv_len, params):
    plan = cm.builtin(name, **params).plan(q_len, kv_len)
    e = plan.to_cudnn_endpoints()
    nfunc, ends = e["nfunc"], e["endpoints"]
    assert nfunc % 2 == 1 and len(ends) == nfunc and all(len(r) == q_len for r in ends)
    for q in range(q_len):
        f = [ends[j][q] for j in range(nfunc)]
        assert f == sorted(f)
        ivs = [(0, f[0])] + [(f[j], f[j + 1]) for j in range(1, nfunc, 2)]
        visible = [any(a <= k < b for a, b in ivs) for k in range(kv_len)]
        assert runs(visible) == plan.intervals(q)


def test_flashmask_bounds_decode_to_dense():
    plan = cm.builtin("hstu", lengths=[40, 25]).plan(65)
    f = plan.to_flashmask()
    dense = _dense(plan)
    for k in range(65):
        for q in range(65):
            masked = f["lts"][k] <= q < f["lte"][k] or f["uts"][k] <= q < f["ute"][k]
            assert dense[q][k] == (not masked), (q, k)


def test_flashmask_refuses_what_it_cannot_express():
    plan = cm.compile("mask = (q - k) % 3 == 0;").plan(12)
    with pytest.raises(cm.PlanError, match="FlashMask") as e:
        plan.to_flashmask()
    assert e.value.code == "CM0408"
    assert str(e.value).count("CM0408") == 1


def test_interval_arrays():
    plan = cm.builtin("hstu", lengths=[10, 6]).plan(16)
    row_ptr, ivs = plan.interval_arrays()
    assert len(row_ptr) == 17 and row_ptr[0] == 0 and row_ptr[-1] == len(ivs)
    for q in range(16):
        assert ivs[row_ptr[q]:row_ptr[q + 1]] == plan.intervals(q)


def test_strided_runs_past_the_expansion_limit():
    """A dilated window at 128K is one strided run per row: its rows read as their keys,
    but the flat interval arrays would need 264M intervals (CM0412)."""
    plan = cm.builtin("dilated_window").plan(131072)
    assert plan.intervals(131071) == [(k, k + 1) for k in range(131071 - 4094, 131072, 2)]
    assert plan.intervals(2) == [(0, 1), (2, 3)]
    for arrays in (plan.interval_arrays, plan._native.kernel_arrays):
        with pytest.raises(cm.PlanError) as e:
            arrays()
        assert e.value.code == "CM0412"
        assert "264243200 unit intervals" in str(e.value)


def test_dense_limit():
    plan = cm.builtin("causal").plan(1 << 15, 1 << 14)
    with pytest.raises(cm.PlanError) as e:
        plan.to_dense(0, 0, format="list")
    assert e.value.code == "CM0403"
    assert "limit" in str(e.value) and str(e.value).count("CM0403") == 1


def test_dense_formats(np):
    plan = cm.builtin("sliding_window", window=3).plan(10)
    a = plan.to_dense(format="numpy")
    assert a.shape == (1, 1, 10, 10) and a.dtype == bool
    assert a[0, 0].tolist() == _dense(plan)


def test_dense_per_head_shape(np):
    plan = cm.compile("param windows: [int] = [1, 3];\n"
                      "mask = q - windows[h % count(windows)] < k <= q;").plan(8, num_heads=2)
    a = plan.to_dense(format="numpy")
    assert a.shape == (1, 2, 8, 8)
    assert a[0, 0].sum() == 8 and a[0, 1].sum() == 8 + 7 + 6
    with pytest.raises(ValueError):
        plan.to_dense(b=0)
    with pytest.raises(ValueError, match="format"):
        plan.to_dense(format="pandas")  # type: ignore[arg-type]


def test_exports_are_visibility_only():
    """A program's score terms are in no export: each equals the plain mask's (causal, by
    an independent rule), as the exports' docstrings say."""
    n = 40
    causal = [[k <= q for k in range(n)] for q in range(n)]
    for name in ("causal_alibi", "causal_softcap"):
        plan = cm.builtin(name).plan(n, num_heads=2)
        assert "score" in plan.stats()
        assert plan.to_dense(0, 0, format="list") == causal
        assert plan.to_cudnn_endpoints(0, 0) == {
            "nfunc": 1, "endpoints": [[q + 1 for q in range(n)]]}
        assert plan.to_flashmask(0, 0)["ute"] == list(range(n))
        for export in ("to_dense", "block_tensors", "to_cudnn_endpoints", "to_flashmask",
                       "to_block_mask"):
            assert "score terms" in getattr(cm.Plan, export).__doc__, export
