"""`mpjax.report` of a plain loss-scaled training step reads as a user's report.

The library's own ops are one row, every convert is attributed to the code it belongs to,
the headline's numbers are the table's total row, and a CPU report says what it cannot tell.
"""

from __future__ import annotations

import re

import jax
import pytest

import mpjax
from mpjax._src.analysis import hlo_cost
from mpjax._src.report.build import UNNAMED
from mpjax._src.report.format import human
from mpjax._src.report.paths import LOSS_SCALING, OPTIMIZER
from tests.helpers.report import loss_scaled_step


@pytest.fixture(scope="module")
def step_and_report():
    step, params, opt_state = loss_scaled_step()
    return (step, params, opt_state), mpjax.report(step, params, opt_state)


def test_loss_scaling_internals_are_one_named_row(step_and_report):
    _, r = step_and_report
    paths = [c.path for c in r.converts] + [g.path for g in r.gemms]
    assert not [p for p in paths if "cond" in p or "branch_" in p or "mpjax_" in p], paths
    assert LOSS_SCALING in {c.path for c in r.converts}
    # the model's own modules keep their rows; the wrapped optimizer (adam) is its own row
    assert {"layers_0", "layers_2", OPTIMIZER} <= set(paths)
    assert [c.path for c in r.converts][-2:] == [OPTIMIZER, LOSS_SCALING]


def test_every_convert_is_attributed_to_a_module(step_and_report):
    (step, params, opt_state), r = step_and_report
    assert UNNAMED not in {c.path for c in r.converts}
    compiled = jax.jit(step).trace(params, opt_state).lower().compile()
    cost = hlo_cost.analyze(compiled.as_text())
    assert sum(c.count for c in r.converts) == cost.converts > 0
    assert sum(c.kernels for c in r.converts) == cost.convert_kernels


def test_headline_numbers_are_the_converts_total_row(step_and_report):
    _, r = step_and_report
    count = sum(c.count for c in r.converts)
    kernels = sum(c.kernels for c in r.converts)
    assert f"; {count} converts, {kernels} in convert-only kernels" in r.summary()
    text = str(r)
    assert re.search(rf"^total\s+{count}\s+{kernels}$", text, re.M), text
    assert f"| total | {count} | {kernels} |" in r.to_markdown()
    flops = human(sum(g.flops for g in r.gemms), "FLOP")
    assert r.summary().startswith(f"{flops} of GEMMs in float16")
    assert re.search(rf"^total\s+{flops}$", text, re.M), text


def test_a_cpu_report_says_what_it_cannot_tell(step_and_report):
    _, r = step_and_report
    lines = str(r).splitlines()
    assert lines[1].startswith("On cpu: the dtypes asked for, FLOPs, converts")
    assert "may run float16/bfloat16 GEMMs in float32" in lines[2]
    assert "no GPU time model" in lines[2] and "target='h100'" in lines[3]
    assert re.search(r"^temp .* roofline$", str(r), re.M)
    assert str(r).rstrip().endswith("n/a on cpu")
