"""`decompose`: each kernel of a compiled step in one part, the parts summing to the roofline."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from mpjax._src.analysis.decomposition import PARTS, decompose, part_of
from mpjax._src.analysis.hlo_cost import Kernel, analyze
from mpjax._src.analysis.peaks import B200, H100, roofline_seconds

X = jnp.ones((256, 512))


def _report(fn, *args):
    return analyze(jax.jit(fn).trace(*args).lower().compile().as_text())


PROGRAMS = {
    "other gemms": lambda x: x @ x.T,
    "quantise": lambda x: jax.lax.optimization_barrier((x * 2.0).astype(jnp.float8_e4m3fn)),
    "transpose": lambda x: jax.lax.optimization_barrier(jnp.transpose(x * 2.0)),
    "amax": lambda x: jnp.max(jnp.abs(x), axis=0),
    "other": lambda x: jnp.sum(x * 3.0, axis=0),
}


@pytest.mark.parametrize("part", sorted(PROGRAMS))
def test_a_kernel_lands_in_its_part(part):
    parts = decompose(_report(PROGRAMS[part], X))
    assert set(parts) == set(PARTS)
    assert parts[part] > 0, parts


@pytest.mark.parametrize("peaks", [H100, B200])
def test_the_parts_sum_to_the_roofline(peaks):
    report = _report(lambda x: jnp.max((x @ x.T).astype(jnp.float8_e4m3fn).astype(jnp.float32)), X)
    assert sum(decompose(report, peaks).values()) == pytest.approx(roofline_seconds(report, peaks))


@pytest.mark.parametrize(
    ("flops", "part"),
    [
        ({"f8e4m3fn": 10}, "low-precision gemms"),  # fp8, MXFP8, blockwise
        ({"f4e2m1fn": 10}, "low-precision gemms"),  # NVFP4
        ({"f8e4m3fnxf8e5m2": 10}, "low-precision gemms"),
        ({"bf16": 10}, "other gemms"),
    ],
)
def test_a_gemm_is_low_precision_by_its_operands(flops, part):
    # XLA:CPU upcasts fp8 dots: the GPU kernels' FLOP keys are given here
    kernel = Kernel("k", "cublas gemm", 1, flops, flops, {}, 0, 1e-6, False)
    assert part_of(kernel) == part
