"""fp8 on the GPU cost model: ResNet-50 train steps with fp8 1x1 convolutions (H100, deviceless).

Variants of the ResNet of `benchmarks/train_models.py`, each against the hand-written Flax
bf16 step (`bf16`), all with DEFAULT compile options:

- `fp8`: `mpjax.autocast(model.apply, ONE_STRING, fp8=Fp8Recipe(exclude=("*/head",)))`, the
  default `convs="none"`: every convolution in bf16 (ResNet-50 has no other eligible GEMM:
  the head is excluded), i.e. autocast's bf16 program;
- `fp8-1x1`: `Fp8Recipe(convs="1x1", exclude=("*/head",))`: each 1x1 convolution runs as an
  fp8 GEMM forward and backward; 3x3 and 7x7 convolutions in bf16;
- `fp8-1x1-min256` / `fp8-1x1-min512`: the same with `min_dim=256` / `512` (only the 1x1
  convs whose channels and pixels are all at least that many run in fp8).

Reported per variant: roofline and its ratio to bf16, temp memory, the FLOPs of the
convolutions and GEMMs by operand dtype, and the share of those FLOPs run with fp8 operands.

    JAX_PLATFORMS=cpu <gpu-aot python> benchmarks/fp8_conv_cost.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import mpjax  # noqa: E402
from benchmarks import gpu_cost_model as gcm  # noqa: E402
from benchmarks.common import emit  # noqa: E402
from benchmarks.train_variants import (  # noqa: E402
    ONE_STRING,
    RESNET_VARIANTS,
    _resnet,
    resnet_program,
)

REQUIRES_GPU = False
TIMEOUT_SCALE = 4  # five ResNet-50 train steps compiled on 2 cores


def _autocast_fp8(convs: str, min_dim: int = 64):
    def build(cfg):
        model = _resnet(cfg)
        recipe = mpjax.Fp8Recipe(convs=convs, min_dim=min_dim, exclude=("*/head",))
        apply = mpjax.autocast(model.apply, ONE_STRING, fp8=recipe)
        return resnet_program(
            cfg, lambda v, x: apply(v, x, train=True, mutable=["batch_stats"]), model
        )

    return build


FP8_CONV_VARIANTS = MappingProxyType(
    {
        "bf16": RESNET_VARIANTS["bf16"],
        "fp8": _autocast_fp8("none"),
        "fp8-1x1": _autocast_fp8("1x1"),
        "fp8-1x1-min256": _autocast_fp8("1x1", 256),
        "fp8-1x1-min512": _autocast_fp8("1x1", 512),
    }
)


def _matmul_flops(r: dict) -> dict:
    flops = dict(r["gemm_flops"])
    for k, v in r["conv_flops"].items():
        flops[k] = flops.get(k, 0) + v
    return flops


def rows(records: list[dict]) -> list[list]:
    """Table rows, each against the bf16 record."""
    anchor = next(r for r in records if r["variant"] == "bf16")
    out = []
    for r in records:
        flops = _matmul_flops(r)
        fp8 = sum(v for k, v in flops.items() if "f8" in k)
        out.append(
            [
                r["variant"],
                round(r["roofline_s"] * 1e3, 3),
                round(r["roofline_s"] / anchor["roofline_s"], 3),
                round(r["temp_bytes"] / gcm.GIB, 3),
                f"{100 * fp8 / sum(flops.values()):.1f} %",
                gcm._tflop(r["conv_flops"]),
                gcm._tflop(r["gemm_flops"]),
                r["kernels"],
            ]
        )
    return out


def measure(variants, quick: bool) -> dict:
    """The benchmark result for the ResNet `variants`."""
    records = gcm.measure_all(("resnet",), variants, quick, registry={"resnet": FP8_CONV_VARIANTS})
    return {
        "title": "fp8 1x1 convolutions: ResNet-50 train step, H100 compile (deviceless), vs bf16",
        "columns": [
            "variant",
            "roofline ms",
            "vs bf16",
            "temp GiB",
            "conv+GEMM FLOPs in fp8",
            "conv TFLOP by dtype",
            "GEMM TFLOP by dtype",
            "kernels",
        ],
        "rows": rows(records),
        "notes": f"jax {jax.__version__}; config {json.dumps(records[0]['config'])}. Roofline and "
        "FLOP accounting of benchmarks/gpu_cost_model.py. 3x3/7x7 convolutions stay bf16 "
        "(XLA:GPU has no fp8 weight-gradient convolution; see mpjax/fp8/conv.py).",
        "details": records,
    }


def run(quick: bool = False) -> dict:
    """Every variant (the `benchmarks/run.py` entry)."""
    if not gcm.plugin_available():
        return gcm.delegate_to_gpu_aot(Path(__file__), quick)
    return measure(list(FP8_CONV_VARIANTS), quick)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--variants", default="", help="comma-separated variant names")
    parser.add_argument("--json", default=None, help="write the full figures to this file")
    args = parser.parse_args(argv)
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()] or list(FP8_CONV_VARIANTS)
    unknown = sorted(set(wanted) - set(FP8_CONV_VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known {sorted(FP8_CONV_VARIANTS)}")
    result = measure(wanted, args.quick)
    return emit(result, args.json)


if __name__ == "__main__":
    main()
