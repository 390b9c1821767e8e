"""Deviceless H100 compiles of `quantize_orientations`' XLA reference, for
tests/fp8/test_quantize_xla_gpu.py (under the gpu-aot python).

Writes one JSON object to `--json PATH`: for each block-scaled recipe and each way a step
quantises a GEMM operand (`x`: an activation, both copies; `w`: a weight's 2-D blocks; `g`: an
output gradient, NVFP4's columns Hadamard-rotated and stochastically rounded), the kernels of
the compiled program (`[name, bytes, dtypes written]`), the bytes of `x`, the arrays each
kernel writes with as many elements as `x` (`"dtype[shape] kernel"`), and `quantise_io`'s
float32 copies and transposes. The XLA reference is what every block-scaled step runs where
the fused kernel does not: the emulated lowering, and the native one on jax >= 0.11.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.quantise_io import quantise_io  # noqa: E402
from mpjax._src.analysis.target import compile_step, h100_sharding  # noqa: E402
from mpjax.fp8 import quantize_orientations  # noqa: E402

SHAPE = (1024, 2048)  # [M, K]: 16 blockwise blocks down M, 64 MXFP8 blocks along K
ROLES = {
    "x": {"role": "activation"},
    "w": {"role": "weight"},
    "g": {"role": "gradient", "hadamard": True},
}
# an array HLO text names: `f32[1024,2048]{1,0}` (its layout dropped)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _quantise(scaling: str, role: str, hadamard: bool):
    nvfp4 = scaling == "nvfp4"

    def quantise(x, seed):
        q = quantize_orientations(
            x,
            scaling,
            role=role,
            column_hadamard=hadamard and nvfp4,
            column_seed=seed if hadamard and nvfp4 else None,
            impl="xla",
        )
        return q

    return quantise


def _full_size_outputs(text: str, elements: int) -> list[str]:
    """`"dtype[shape] kernel"` of each array a kernel of the entry computation writes with at
    least `elements` elements (tuple outputs one by one)."""
    entry = text[text.index("\nENTRY") :]
    out = []
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.-]+) = (.*?) (fusion|custom-call)\(", line)
        if not m:
            continue
        for dtype, dims in _ARRAY.findall(m.group(2)):
            n = math.prod(int(d) for d in dims.split(",") if d)
            if dims and n >= elements:
                out.append(f"{dtype}[{dims}] {m.group(1)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    sharding = h100_sharding()
    x = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
    seed = jax.ShapeDtypeStruct((), jnp.uint32)
    out = {"jax": jax.__version__, "x_bytes": math.prod(SHAPE) * 2}
    for scaling in ("blockwise", "mxfp8", "nvfp4"):
        for name, spec in ROLES.items():
            step = _quantise(scaling, spec["role"], spec.get("hadamard", False))
            text = compile_step(step, (x, seed), sharding, donate_argnums=()).as_text()
            report = hlo_cost.analyze(text)
            io = quantise_io(text)
            out[f"{scaling}/{name}"] = {
                "kernels": [[k.name, k.bytes, list(k.results)] for k in report.kernels],
                "bytes": report.bytes,
                "full_size": _full_size_outputs(text, math.prod(SHAPE)),
                "float32_copies": list(io.float32_copies),
                "transposes": list(io.transposes),
            }
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
