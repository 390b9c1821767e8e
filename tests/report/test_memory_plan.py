"""`mpjax.memory_plan` on the current backend and its choice rule (no GPU needed).

The deviceless-H100 tests are in tests/report/test_memory_plan_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from tests.helpers.memory_plan import example_args, make_step

MIB = 2**20


def _fake_plan(budget: int) -> mpjax.MemoryPlan:
    """A plan over made-up candidates: (MiB, ms) keep 10/1.0, fp8 8/1.2, dots 6/0.9, full 3/1.5."""
    rungs = tuple(r for r in mpjax.MEMORY_LADDER if r.name != "remat, keep fp8 GEMM inputs")
    figures = [(10, 1.0), (8, 1.2), (6, 0.9), (3, 1.5)]
    candidates = tuple(
        mpjax.MemoryCandidate(r.name, mib * MIB - 100, 100, ms / 1e3)
        for r, (mib, ms) in zip(rungs, figures, strict=True)
    )
    big = mpjax.MemoryPlan(2**40, "h100", rungs[0], candidates, rungs, make_step)
    return big.with_budget(budget)


@pytest.mark.parametrize(
    "budget_mib,choice",
    [(100, "remat, keep GEMM outputs"), (6, "remat, keep GEMM outputs"), (5, "full remat")],
)
def test_the_fastest_rung_within_the_budget_is_chosen(budget_mib, choice):
    plan = _fake_plan(budget_mib * MIB)
    assert plan.choice.name == choice
    assert plan.chosen.total_bytes <= plan.budget


def test_an_impossible_budget_names_the_smallest_rung():
    with pytest.raises(ValueError, match=r"the smallest is 'full remat': 3145728 bytes"):
        _fake_plan(3 * MIB - 1)


@pytest.mark.parametrize("budget", [0, -5, 1.5e9, "8GB", True, None])
def test_a_bad_budget_is_refused_before_compiling(budget):
    def never(rung):
        raise AssertionError("compiled")

    with pytest.raises(ValueError, match="budget="):
        mpjax.memory_plan(never, jnp.ones(2), budget=budget, target=None)


def test_an_empty_or_foreign_ladder_is_refused():
    with pytest.raises(ValueError, match="ladder="):
        mpjax.memory_plan(make_step, jnp.ones(2), budget=2**30, target=None, ladder=())
    with pytest.raises(ValueError, match="ladder="):
        mpjax.memory_plan(make_step, jnp.ones(2), budget=2**30, target=None, ladder=["keep"])


def test_rungs_apply_remat_and_fp8_saved_activations():
    keep, fp8, dots, fp8_remat, full = mpjax.MEMORY_LADDER
    f = jnp.sin
    assert keep.wrap(f) is f and keep.wrap_module(nn_block()) is nn_block()
    jaxpr = str(jax.make_jaxpr(jax.grad(full.wrap(f)))(1.0))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
    policy = mpjax.get_policy("c=bf16")
    assert fp8.with_policy(policy).saved_activations == "float8_e4m3fn"
    assert fp8_remat.with_policy(policy).saved_activations == "float8_e4m3fn"
    assert dots.with_policy(policy) is policy


def nn_block():
    from tests.helpers.memory_plan import Block

    return Block


def test_a_plan_on_the_current_backend_fits_and_report_lists_it():
    """The smaller of two rungs is chosen at its own size, and `report` lists the choice.

    Which rung is smaller depends on the backend: on XLA:CPU this stack under full remat
    takes more than keeping its activations (34.7 against 23.0 MB, since activations keep
    only their inputs; 35.6 MB before), on the deviceless H100 less
    (`test_memory_plan_gpu.py`)."""
    keep, *_, full = mpjax.MEMORY_LADDER
    args = example_args()
    roomy = mpjax.memory_plan(make_step, *args, budget=2**40, target=None, ladder=(keep, full))
    sizes = {c.rung: c.total_bytes for c in roomy.candidates}
    assert set(sizes) == {"keep", "full remat"} and sizes["keep"] != sizes["full remat"]
    small = min(sizes, key=sizes.get)
    plan = roomy.with_budget(sizes[small])
    assert plan.choice.name == small
    report = mpjax.report(plan.step, *args, memory_plan=plan)
    text = str(report)
    assert "memory plan (budget" in text and "full remat" in text and "keep" in text
    assert f"memory plan (cpu): {small}" in report.summary()
    assert report.to_dict()["memory_plan"]["choice"]["name"] == small
    with pytest.raises(ValueError, match=f"the smallest is '{small}': {sizes[small]}"):
        mpjax.memory_plan(make_step, *args, budget=1, target=None, ladder=(keep, full))


def test_a_zero_roofline_step_prints_without_a_percentage():
    """A base rung whose roofline is 0 (a step of no flops and no bytes): the table prints its
    costs in ms and leaves the percentage out (it is undefined), instead of dividing by zero."""
    rungs = tuple(mpjax.MEMORY_LADDER[:2])
    candidates = (
        mpjax.MemoryCandidate(rungs[0].name, 10 * MIB, 0, 0.0),
        mpjax.MemoryCandidate(rungs[1].name, 5 * MIB, 0, 0.0),
    )
    plan = mpjax.MemoryPlan(8 * MIB, "h100", rungs[1], candidates, rungs, make_step)
    text = str(plan)
    assert "+0 ms" in text and "%" not in text
    assert plan.rows()[1][4] == "+0 ms"
    assert plan.rows()[1][5] == "chosen"


@pytest.mark.parametrize("budget", [np.int64(6 * MIB), np.int32(6 * MIB), np.uint64(6 * MIB)])
def test_a_numpy_integer_budget_is_accepted(budget):
    plan = _fake_plan(budget)
    assert plan.choice.name == _fake_plan(6 * MIB).choice.name
    assert type(plan.budget) is int and plan.budget == 6 * MIB


def test_a_numpy_integer_budget_reaches_memory_plan():
    ladder = mpjax.MEMORY_LADDER[:1]
    plan = mpjax.memory_plan(
        make_step, *example_args(), budget=np.int64(2**30), target=None, ladder=ladder
    )
    assert plan.budget == 2**30 and type(plan.budget) is int


@pytest.mark.parametrize("budget", [np.bool_(True), np.float64(2**30), np.int64(0)])
def test_a_numpy_non_integer_or_bool_budget_is_refused(budget):
    def never(rung):
        raise AssertionError("compiled")

    with pytest.raises(ValueError, match="expected a positive integer number of bytes"):
        mpjax.memory_plan(never, jnp.ones(2), budget=budget, target=None)
