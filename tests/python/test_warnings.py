"""CompileMaskWarning: plan-time warnings with their code, span and hint."""

from __future__ import annotations

import warnings

import pytest

import compilemask as cm


@pytest.mark.parametrize(
    ("source", "kwargs", "code", "text"),
    [
        ("mask = k > q + 100;", {"q_len": 8}, "CM0260", "the mask sees nothing"),
        ("mask = k < q;", {"q_len": 8, "num_heads": 2}, "CM0261", "2 of 16 query rows"),
        ("mask = k <= q + h;", {"q_len": 8}, "CM0262", "head index `h`"),
        ("mask = k <= q + b;", {"q_len": 8}, "CM0263", "batch index `b`"),
        ("param u: int = 1;\nmask = k <= q;", {"q_len": 8, "u": 2}, "CM0264", "`u` was set"),
        ("mask = elementwise(k <= q);", {"q_len": 1001}, "CM0265", "1002001"),
        (
            "param p: [int] = [-1, 0, 1, 1, 0, 4, 4, 6];\ntree t = p;\nmask = k in t.path(q);",
            {"q_len": 4},
            "CM0266",
            "4 nodes lie past q_len",
        ),
    ],
)
def test_each_warning(source, kwargs, code, text):
    program = cm.compile(source)
    with pytest.warns(cm.CompileMaskWarning, match=text) as record:
        plan = program.plan(**kwargs)
    assert plan.q_len == kwargs["q_len"]
    w = [r.message for r in record if isinstance(r.message, cm.CompileMaskWarning)]
    assert [x.code for x in w] == [code]
    d = w[0].diagnostic
    assert d.severity == "warning" and d.hint and d.line >= 1
    assert code in str(w[0])
    # As errors, on request.
    with warnings.catch_warnings():
        warnings.simplefilter("error", cm.CompileMaskWarning)
        with pytest.raises(cm.CompileMaskWarning):
            program.plan(**kwargs)


def test_no_warning_for_a_sound_plan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm.compile("mask = k <= q + h;").plan(8, num_heads=2)
        cm.builtin("causal").plan(cu_seqlens_q=[0, 3, 8])
        cm.compile("mask = k <= q + b;").plan(cu_seqlens_q=[0, 3, 8])


def test_packed_plan_with_one_sample_warns_for_b():
    with pytest.warns(cm.CompileMaskWarning, match="batch index"):
        cm.compile("mask = k <= q + b;").plan(cu_seqlens_q=[0, 8])
