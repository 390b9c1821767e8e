"""Run under the gpu-aot python (tests/report/test_report_gpu.py): `mpjax.report` on H100s.

Writes JSON to `--json PATH`: for the rule model (`tests/helpers/report.py`) under bf16 and
fp16 compute on `"h100"`, each GEMM's (path, asked dtype, runs_as, device FLOPs), the report's
FLOPs by run dtype and `hlo_cost`'s for the same compile; for the sharded step on `"h100x8"`,
the report's collectives and those of the optimized HLO; for the delayed-fp8 step, each
GEMM's (path, pass, asks for fp8, runs as fp8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# The sharded step is written on a mesh of 8 CPU devices, as for 8 GPUs.
_FLAG = " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + _FLAG

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

import mpjax  # noqa: E402
from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.calibrated import calibrated_seconds  # noqa: E402
from mpjax._src.analysis.collectives import collectives  # noqa: E402
from mpjax._src.report.build import build_report  # noqa: E402
from mpjax._src.report.targets import place_args, resolve_target  # noqa: E402
from tests.helpers.report import fp8_step, rule_step, sharded_step  # noqa: E402


def _rule(compute: str) -> dict:
    step, params, x = rule_step(compute)
    target = resolve_target("h100")
    lowered = jax.jit(step).trace(*place_args((params, x), target)).lower()
    compiled = lowered.compile()
    r = build_report(lowered, compiled, "h100", True)
    cost = hlo_cost.analyze(compiled.as_text())
    public = mpjax.report(step, params, x, target="h100")
    return {
        "gemms": [[g.path, g.asks_for.name, getattr(g.runs_as, "name", None)] for g in r.gemms],
        "flagged": sorted({g.path for g in r.gemms if g.flagged}),
        "runs": r.flops_by_dtype(runs=True),
        "cost": {"gemm": cost.gemm_flops, "conv": cost.conv_flops},
        "convert_kernels": [sum(c.kernels for c in r.converts), cost.convert_kernels],
        "roofline": [r.memory.roofline_s, calibrated_seconds(cost, "h100").seconds],
        "peak_roofline": [r.memory.peak_roofline_s, cost.roofline_s],
        "unmeasured": [list(r.memory.unmeasured), list(calibrated_seconds(cost).unmeasured)],
        "public_equal": public.to_dict() == r.to_dict(),
        "summary": r.summary(),
    }


def _sharded() -> dict:
    step, w, x = sharded_step(jax.devices("cpu")[:8])
    r = mpjax.report(step, w, x, target="h100x8")
    target = resolve_target("h100x8")
    text = jax.jit(step).trace(*place_args((w, x), target)).lower().compile().as_text()
    return {
        "report": sorted([c.op, c.dtype.name, c.bytes] for c in r.collectives),
        "hlo": sorted([c.op, c.dtype, c.bytes] for c in collectives(text)),
    }


def _fp8() -> dict:
    step, variables, x = fp8_step()
    r = mpjax.report(step, variables, x, target="h100")
    return {
        "gemms": [[g.path, g.direction, g.fp8, g.runs_fp8] for g in r.gemms],
        "summary": r.summary(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    args = p.parse_args()
    out = {"bfloat16": _rule("bfloat16"), "float16": _rule("float16"), "sharded": _sharded()}
    out["fp8"] = _fp8()
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
