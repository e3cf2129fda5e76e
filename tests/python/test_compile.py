"""Compiling programs: built-ins, parameters and diagnostics."""

from __future__ import annotations

import pytest

import compilemask as cm

WORKLOAD_BUILTINS = [
    "causal", "hstu", "shared_prefix", "clear", "sliding_window", "document_causal",
    "trace_documents", "trace_prompt_groups",
]


def test_builtins_listed():
    names = [n for n, _ in cm.builtins()]
    for name in WORKLOAD_BUILTINS:
        assert name in names
    assert all(isinstance(s, str) and s for _, s in cm.builtins())


@pytest.mark.parametrize("name", [n for n, _ in cm.builtins()])
def test_every_builtin_compiles(name):
    program = cm.builtin(name)
    assert program.name == f"<builtin {name}>"
    assert "mask" in program.source
    assert program.warnings == []


def test_builtin_parameters_and_defaults():
    hstu = cm.builtin("hstu")
    params = {p.name: p for p in hstu.parameters}
    assert set(params) == {"lengths", "contextual", "target_divisor"}
    assert params["lengths"].is_array and not params["contextual"].is_array
    bound = cm.builtin("hstu", lengths=[100, 50], contextual=2)
    assert bound.defaults == {"lengths": [100, 50], "contextual": 2}
    # Defaults apply to every plan, and plan() arguments override them.
    assert bound.plan(150).intervals(101) == hstu.plan(150, lengths=[100, 50],
                                                        contextual=2).intervals(101)
    assert bound.plan(150, contextual=0).intervals(101) == [(100, 102)]
    # with_params keeps the original untouched.
    assert bound.with_params(target_divisor=2).defaults["target_divisor"] == 2
    assert "target_divisor" not in bound.defaults


def test_params_accept_sequences_and_reject_other_types():
    program = cm.builtin("document_causal")
    a = program.plan(100, lengths=(30, 70))
    b = program.plan(100, lengths=range(30, 101, 40))  # 30, 70
    assert a.rows() == b.rows()
    with pytest.raises(TypeError, match="lengths"):
        program.plan(100, lengths=[30.0, 70])
    with pytest.raises(TypeError, match="lengths"):
        program.plan(100, lengths="30,70")
    with pytest.raises(TypeError):
        program.plan(100, lengths=[True, 70])


def test_unknown_parameter_is_a_plan_error():
    with pytest.raises(cm.PlanError) as e:
        cm.builtin("causal", window=3)
    assert e.value.code == "CM0309"
    assert isinstance(e.value, ValueError)
    with pytest.raises(cm.PlanError, match="CM0309"):
        cm.builtin("sliding_window").plan(100, windw=3)


def test_unknown_builtin():
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.builtin("casual")
    assert e.value.diagnostics[0].code == "CM0201"
    assert "causal" in str(e.value)  # the hint lists the available names


def test_syntax_error_diagnostics():
    source = "param w: int = 4;\nmask = q - w < k <= q\n"
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile(source)
    err = e.value
    assert isinstance(err, ValueError)
    assert err.rendered == str(err)
    assert "CM0104" in str(err)
    (d,) = err.diagnostics
    assert d.code == "CM0104"
    assert d.severity == "error"
    assert (d.line, d.column) == (3, 1)  # end of input, after the last newline
    assert "`;`" in d.message
    as_dict = d.to_dict()
    assert as_dict["code"] == "CM0104" and as_dict["line"] == 3


def test_many_errors_stop_reading_and_positions_follow_every_line_break():
    """Reading stops after 1000 errors with one CM0107 (a file of stray `;` took a minute and
    gigabytes); every diagnostic's line and column come from one index of the source (each
    was a scan from the start: 40000 diagnostics took 12 s), with `\r` line endings read as
    the rendered excerpt reads them."""
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile("mask = k <= q;\n" + ";\n" * 5000)
    *errors, stop = e.value.diagnostics
    assert len(errors) == 1000 and {d.code for d in errors} == {"CM0106"}
    assert stop.code == "CM0107" and (stop.line, stop.column) == (1002, 1)
    assert [(d.line, d.column) for d in errors[:3]] == [(2, 1), (3, 1), (4, 1)]
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile("mask = k <= q;\n" + "let a = 1;\n" * 3000)
    duplicates = [d for d in e.value.diagnostics if d.code == "CM0202"]
    assert [d.line for d in duplicates] == list(range(3, 3002))
    source = "# w\rparam w: int = 4;\rmask = q - w < k <= qq;\r"
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile(source, name="cr.cmask")
    (d,) = e.value.diagnostics
    assert (d.code, d.line, d.column) == ("CM0201", 3, 21)
    assert "cr.cmask:3:21" in str(e.value) and "at cr.cmask:3:21" in str(e.value)


def test_check_error_has_span_and_hint():
    source = "# comment\nmask = k <= qq;\n"
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile(source, name="example.cmask")
    d = e.value.diagnostics[0]
    assert d.code == "CM0201"
    assert (d.line, d.column) == (2, 13)
    assert source[d.start:d.end] == "qq"
    assert d.hint  # a suggestion
    assert "example.cmask:2:13" in str(e.value)


def test_unsolvable_k_points_to_elementwise():
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile("mask = k * k * q < 64;")
    d = e.value.diagnostics[0]
    assert d.code == "CM0207"
    assert "elementwise" in (d.hint or "")


def test_several_errors_are_all_reported():
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile("param x: int = foo;\nparam y: int = bar;\nmask = k <= q;")
    diagnostics = e.value.diagnostics
    assert [(d.code, d.line) for d in diagnostics] == [("CM0201", 1), ("CM0201", 2)]
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile("mask = k <= q\nmask = = 3;\nlet = 4;")  # the parser recovers
    assert len(e.value.diagnostics) >= 2


def test_warnings_do_not_fail():
    program = cm.compile("let unused = 3;\nmask = k <= q;")
    (w,) = program.warnings
    assert w.code == "CM0250" and w.severity == "warning"


@pytest.mark.parametrize("source", ["", "\x00\xff", "mask = ", "(((((((((", "mask = k in ..;",
                                    "param x: [int] = [1, 2, ;", "mask = q ** k;" * 50])
def test_garbage_raises_cleanly(source):
    with pytest.raises(cm.MaskSyntaxError) as e:
        cm.compile(source)
    assert e.value.diagnostics
    assert all(d.code.startswith("CM") for d in e.value.diagnostics)


def test_compile_rejects_non_str():
    with pytest.raises(TypeError):
        cm.compile(b"mask = k <= q;")  # type: ignore[arg-type]


def test_program_flags():
    assert not cm.builtin("causal").uses_batch
    per_head = cm.compile("param windows: [int] = [2, 4];\n"
                          "mask = q - windows[h % count(windows)] < k <= q;")
    assert per_head.uses_head and not per_head.uses_batch
    assert cm.compile("mask = elementwise((q + k) % 3 == 0);").uses_elementwise
