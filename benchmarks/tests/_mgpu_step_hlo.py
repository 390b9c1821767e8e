"""The wide LM's blockwise train step compiled for one H100 without one (gpu-aot python), for
benchmarks/tests/test_mosaic_gpu_wide_step.py.

Writes one JSON object to `--json PATH`: the step (benchmarks' `fp8-blockwise`:
`Fp8Recipe("blockwise", block_lowering="native")`, the head in bf16) compiled for one H100:
its GEMMs (`[lhs dtype, rhs dtype, op_name, custom call target or ""]`), its custom calls
(`[target, op_name]`) and its Dense kernels (`[path, shape]`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from benchmarks.fp8_variants import BLOCK_VARIANTS  # noqa: E402
from benchmarks.harness import compile_program  # noqa: E402
from benchmarks.train_models import LM_SIZES, VOCAB  # noqa: E402
from mpjax._src.analysis import hlo_cost  # noqa: E402


def wide_step() -> dict:
    program = BLOCK_VARIANTS["fp8-blockwise"]({**LM_SIZES["wide"], "vocab": VOCAB["full"]})
    _, compiled, state = compile_program(program, "h100")
    text = compiled.as_text()
    report = hlo_cost.analyze(text)
    targets = dict(re.findall(r"%?([\w.\-]+) = [^\n]*custom_call_target=\"([^\"]+)\"", text))
    gemms = [[g.lhs_dtype, g.rhs_dtype, g.op_name, targets.get(g.name, "")] for g in report.gemms]
    calls = re.findall(r'custom_call_target="([^"]+)"[^\n]*?op_name="([^"]*)"', text)
    params = state[0] if isinstance(state, tuple) else state
    kernels = [
        [jax.tree_util.keystr(path), list(leaf.shape)]
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if "kernel" in jax.tree_util.keystr(path)
    ]
    return {"gemms": gemms, "kernels": kernels, "custom_calls": [list(c) for c in calls]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    Path(args.json).write_text(json.dumps({"jax": jax.__version__, "step": wide_step()}))


if __name__ == "__main__":
    main()
