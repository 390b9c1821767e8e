"""Deviceless H100 compiles for tests/autocast/test_fp8_conv_gpu.py (run under the gpu-aot python).

Prints one JSON object: per program, the cuDNN convolution call targets and the GEMM and
convolution FLOPs by operand dtype (`benchmarks/hlo_cost.py`) of the optimized HLO:

- `autocast`: `jax.grad` of `autocast(fp8=Fp8Recipe(convs="1x1"))` over a 1x1 conv then a 3x3 conv;
- `fwd`, `dgrad`, `wgrad`: the forward, input-gradient and weight-gradient convolutions of
  a 3x3 NHWC/HWIO conv written directly on e4m3 operands (`preferred_element_type=bf16`);
- `dgrad_deq`, `dgrad_deq_flip_after`, `wgrad_deq`: the dequantise form (e5m2 gradient);
- `dgrad_stride2`: the input gradient of a stride-2 conv, direct form.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import mpjax  # noqa: E402
from mpjax._src.analysis import hlo_cost  # noqa: E402
from mpjax._src.analysis.target import compile_step, h100_sharding  # noqa: E402

N, HW, C = 8, 16, 128
E4, E5, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
POLICY = "params=float32,compute=bfloat16,output=float32"


def figures(fn, *args) -> dict:
    text = compile_step(fn, args, h100_sharding(), donate_argnums=()).as_text()
    report = hlo_cost.analyze(text)
    return {
        "targets": sorted(set(re.findall(r'custom_call_target="(__cudnn\$conv\w*)"', text))),
        "gemm_flops": report.gemm_flops,
        "conv_flops": report.conv_flops,
    }


def conv(x, w, dn, padding, pet=None):
    return lax.conv_general_dilated(
        x, w, (1, 1), padding, dimension_numbers=dn, preferred_element_type=pet
    )


def main() -> None:
    f32 = jnp.float32
    x = jax.ShapeDtypeStruct((N, HW, HW, C), f32)
    w1, w3 = jax.ShapeDtypeStruct((1, 1, C, C), f32), jax.ShapeDtypeStruct((3, 3, C, C), f32)

    def model(x, w1, w3):
        h = jax.nn.relu(conv(x, w1, ("NHWC", "HWIO", "NHWC"), "VALID"))
        return jnp.mean(conv(h, w3, ("NHWC", "HWIO", "NHWC"), "SAME") ** 2)

    f8 = mpjax.autocast(model, POLICY, fp8=mpjax.Fp8Recipe(convs="1x1"))
    out = {"autocast": figures(jax.grad(f8, (0, 1, 2)), x, w1, w3)}

    q_x = jax.ShapeDtypeStruct((N, HW, HW, C), E4)
    q_w = jax.ShapeDtypeStruct((3, 3, C, C), E4)
    # forward; d input = g conv flipped kernel (in/out features swapped); d kernel = x conv g
    # with the batch as the contraction: the convolutions jax's transpose rules emit.
    chwn = ("CHWN", "IHWO", "HWNC")
    out["fwd"] = figures(lambda a, b: conv(a, b, ("NHWC", "HWIO", "NHWC"), "SAME", BF16), q_x, q_w)
    out["dgrad"] = figures(
        lambda g, b: conv(g, lax.rev(b, (0, 1)), ("NHWC", "HWOI", "NHWC"), "SAME", BF16), q_x, q_w
    )
    out["wgrad"] = figures(lambda a, g: conv(a, g, chwn, ((1, 1), (1, 1)), BF16), q_x, q_x)
    # the dequantise form (`q -> f32 * s`), mixed formats: e5m2 gradient, e4m3 kernel; the
    # kernel flipped in fp8 before dequantising, or after (the order of jax's transpose rule)
    q_g = jax.ShapeDtypeStruct((N, HW, HW, C), E5)
    s = jax.ShapeDtypeStruct((), f32)
    deq = lambda q, scale: q.astype(f32) * scale  # noqa: E731
    hwoi = ("NHWC", "HWOI", "NHWC")
    out["dgrad_deq"] = figures(
        lambda g, b, sg, sb: conv(deq(g, sg), deq(lax.rev(b, (0, 1)), sb), hwoi, "SAME"),
        *(q_g, q_w, s, s),
    )
    out["dgrad_deq_flip_after"] = figures(
        lambda g, b, sg, sb: conv(deq(g, sg), lax.rev(deq(b, sb), (0, 1)), hwoi, "SAME"),
        *(q_g, q_w, s, s),
    )
    out["wgrad_deq"] = figures(
        lambda a, g, sa, sg: conv(deq(a, sa), deq(g, sg), chwn, ((1, 1), (1, 1))),
        *(q_x, q_g, s, s),
    )
    # input gradient of a stride-2 3x3 SAME conv (16 -> 8): the 8x8 e4m3 gradient dilated by 2
    q_g2 = jax.ShapeDtypeStruct((N, HW // 2, HW // 2, C), E4)
    out["dgrad_stride2"] = figures(
        lambda g, b: lax.conv_general_dilated(
            g,
            lax.rev(b, (0, 1)),
            (1, 1),
            ((2, 1), (2, 1)),
            lhs_dilation=(2, 2),
            dimension_numbers=hwoi,
            preferred_element_type=BF16,
        ),
        *(q_g2, q_w),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
