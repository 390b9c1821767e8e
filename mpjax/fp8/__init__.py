"""Float8 training: `Fp8Recipe`, quantisation with current scaling and the fp8 `dot_general`."""

from mpjax.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax.fp8.quant import amax, compute_scale, dequantize, fp8_max, quantize
from mpjax.fp8.recipe import FP8_DTYPES, Fp8Recipe, Fp8Site

__all__ = [
    "FP8_DTYPES",
    "Fp8Recipe",
    "Fp8Site",
    "amax",
    "compute_scale",
    "dequantize",
    "fp8_dot_general",
    "fp8_eligible",
    "fp8_max",
    "quantize",
]
