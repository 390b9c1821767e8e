"""Run under the gpu-aot python (tests/report/test_memory_plan_gpu.py): `mpjax.memory_plan` on
a deviceless H100 for the tiny stack of `tests/helpers/memory_plan.py`.

Writes JSON to `--json PATH`: every candidate's memory and roofline; the plans for a roomy
budget, for a budget one byte under the roomy choice's memory, and the error for one byte under
the smallest candidate; the chosen rung's step recompiled (temp + args), and what
`mpjax.report(plan.step, ..., memory_plan=plan)` says.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

import mpjax  # noqa: E402
from mpjax._src.report.targets import place_args, resolve_target  # noqa: E402
from tests.helpers.memory_plan import example_args, make_step  # noqa: E402


def _plan(plan) -> dict:
    return {"choice": plan.choice.name, "budget": plan.budget}


def main() -> dict:
    args = example_args()
    plan = mpjax.memory_plan(make_step, *args, budget=2**40, target="h100")
    candidates = {c.rung: [c.total_bytes, c.roofline_s] for c in plan.candidates}
    tighter = plan.with_budget(plan.chosen.total_bytes - 1)
    smallest = min(c.total_bytes for c in plan.candidates)
    tight = plan.with_budget(smallest)
    try:
        plan.with_budget(smallest - 1)
        error = None
    except ValueError as err:
        error = str(err)
    placed = place_args(args, resolve_target("h100"))
    compiled = jax.jit(tight.step, donate_argnums=0).trace(*placed).lower().compile()
    memory = compiled.memory_analysis()
    report = mpjax.report(tight.step, *args, target="h100", memory_plan=tight)
    return {
        "candidates": candidates,
        "roomy": _plan(plan),
        "tighter": _plan(tighter),
        "tight": _plan(tight),
        "tight_recompiled_bytes": memory.temp_size_in_bytes + memory.argument_size_in_bytes,
        "error": error,
        "report_text": str(report),
        "report_summary": report.summary(),
        "report_markdown": report.to_markdown(),
        "report_dict_plan": report.to_dict()["memory_plan"]["choice"]["name"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    Path(parser.parse_args().json).write_text(json.dumps(main()))
