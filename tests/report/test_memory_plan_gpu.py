"""`mpjax.memory_plan` on a deviceless H100: the plan fits its budget, a tighter budget picks
a smaller rung, an impossible one names the smallest, and `mpjax.report` lists the choice.

`tests/report/_memory_plan_h100.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON`
(as tests/report/test_report_gpu.py), with `JAX_PLATFORMS=cpu`.
"""

from __future__ import annotations

import pytest

from tests.helpers.gpu import _run_json


@pytest.fixture(scope="module")
def h100(tmp_path_factory):
    return _run_json("tests/report/_memory_plan_h100.py", tmp=tmp_path_factory.mktemp("plan"))


def _fastest_within(candidates: dict, budget: int) -> str:
    fits = {k: v for k, v in candidates.items() if v[0] <= budget}
    return min(fits, key=lambda k: (fits[k][1], fits[k][0]))


def test_the_ladder_spans_memory_on_the_h100(h100):
    sizes = [b for b, _ in h100["candidates"].values()]
    assert len(sizes) == 5 and min(sizes) < 0.6 * max(sizes)
    assert all(t > 0 for _, t in h100["candidates"].values())


def test_the_plan_is_the_fastest_rung_within_its_budget(h100):
    c = h100["candidates"]
    for key in ("roomy", "tighter", "tight"):
        plan = h100[key]
        assert c[plan["choice"]][0] <= plan["budget"], key
        assert plan["choice"] == _fastest_within(c, plan["budget"]), key


def test_a_tighter_budget_picks_a_smaller_rung(h100):
    c = h100["candidates"]
    roomy, tighter = h100["roomy"]["choice"], h100["tighter"]["choice"]
    assert tighter != roomy and c[tighter][0] < c[roomy][0]
    assert c[h100["tight"]["choice"]][0] == min(b for b, _ in c.values())


def test_the_planned_step_compiles_within_the_budget(h100):
    assert h100["tight_recompiled_bytes"] <= h100["tight"]["budget"]


def test_an_impossible_budget_names_the_smallest_rung(h100):
    c = h100["candidates"]
    smallest = min(c, key=lambda k: c[k][0])
    assert f"the smallest is {smallest!r}: {c[smallest][0]} bytes" in h100["error"]
    assert f"budget={c[smallest][0] - 1} bytes" in h100["error"]


def test_report_lists_the_choice_and_every_rung(h100):
    choice = h100["tight"]["choice"]
    assert f"memory plan (h100): {choice}" in h100["report_summary"]
    assert "memory plan (budget" in h100["report_text"]
    for rung in h100["candidates"]:
        assert rung in h100["report_text"] and rung in h100["report_markdown"]
    assert h100["report_dict_plan"] == choice
