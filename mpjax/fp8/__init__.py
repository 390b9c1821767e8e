"""Float8 training: `Fp8Recipe`, quantisation with current scaling and the fp8 `dot_general`."""

from mpjax.fp8.conv import fp8_conv_1x1
from mpjax.fp8.delayed import FP8_META, delayed_fp8_dot_general, init_fp8_meta, update_fp8_meta
from mpjax.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax.fp8.nnx_delayed import Fp8Meta, update_nnx_fp8_meta
from mpjax.fp8.quant import amax, compute_scale, dequantize, fp8_max, quantize
from mpjax.fp8.recipe import FP8_DTYPES, Fp8Recipe, Fp8Site
from mpjax.fp8.report import Fp8Op, fp8_ops

__all__ = [
    "FP8_DTYPES",
    "FP8_META",
    "Fp8Meta",
    "Fp8Op",
    "Fp8Recipe",
    "Fp8Site",
    "amax",
    "compute_scale",
    "delayed_fp8_dot_general",
    "dequantize",
    "fp8_conv_1x1",
    "fp8_dot_general",
    "fp8_eligible",
    "fp8_max",
    "fp8_ops",
    "init_fp8_meta",
    "quantize",
    "update_fp8_meta",
    "update_nnx_fp8_meta",
]
