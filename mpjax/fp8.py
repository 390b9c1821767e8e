"""Float8 training: `Fp8Recipe`, quantisation with current scaling, the fp8 `dot_general`, and
fp8 saved activations (`Policy.saved_activations`)."""

from mpjax._src.autocast.fp8_report import Fp8Op, fp8_ops
from mpjax._src.flax.fp8_nnx import Fp8Meta, update_nnx_fp8_meta
from mpjax._src.fp8.block_dot import block_scaled_dot_general, native_block_gemms
from mpjax._src.fp8.blocks import (
    BLOCK_SCALINGS,
    BlockQuantized,
    block_shape,
    dequantize_blocks,
    quantize_blocks,
)
from mpjax._src.fp8.conv import fp8_conv_1x1
from mpjax._src.fp8.delayed import FP8_META, delayed_fp8_dot_general, init_fp8_meta, update_fp8_meta
from mpjax._src.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax._src.fp8.hadamard import random_hadamard
from mpjax._src.fp8.orientations import OrientedBlocks, quantize_orientations
from mpjax._src.fp8.quant import amax, compute_scale, dequantize, fp8_max, quantize
from mpjax._src.fp8.recipe import (
    FP8_DTYPES,
    NVFP4_HIGH_PRECISION_FIRST,
    NVFP4_HIGH_PRECISION_LAST,
    Fp8Recipe,
    Fp8Site,
)
from mpjax._src.fp8.saved import (
    SAVED_FP8_NAME,
    fp8_saved_conv,
    fp8_saved_dot_general,
    saved_activations_policy,
    saved_in_fp8,
)
from mpjax._src.fp8.weight_copies import WeightCopies, weight_copies

__all__ = [
    "BLOCK_SCALINGS",
    "BlockQuantized",
    "FP8_DTYPES",
    "FP8_META",
    "Fp8Meta",
    "Fp8Op",
    "Fp8Recipe",
    "Fp8Site",
    "NVFP4_HIGH_PRECISION_FIRST",
    "NVFP4_HIGH_PRECISION_LAST",
    "OrientedBlocks",
    "SAVED_FP8_NAME",
    "WeightCopies",
    "amax",
    "block_scaled_dot_general",
    "block_shape",
    "compute_scale",
    "delayed_fp8_dot_general",
    "dequantize_blocks",
    "dequantize",
    "fp8_conv_1x1",
    "fp8_dot_general",
    "fp8_eligible",
    "fp8_max",
    "fp8_ops",
    "fp8_saved_conv",
    "fp8_saved_dot_general",
    "init_fp8_meta",
    "native_block_gemms",
    "quantize",
    "quantize_blocks",
    "quantize_orientations",
    "random_hadamard",
    "saved_activations_policy",
    "saved_in_fp8",
    "update_fp8_meta",
    "update_nnx_fp8_meta",
    "weight_copies",
]
