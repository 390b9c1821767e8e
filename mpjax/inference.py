"""Inference conversion: fold BatchNorm into Conv/Dense, cast to a policy, drop training state."""

from mpjax._src.inference.convert import (
    InferenceModel,
    convert_for_inference,
    fold_batchnorm_params,
)
from mpjax._src.inference.trace import FoldReport

__all__ = [
    "convert_for_inference",
    "fold_batchnorm_params",
    "FoldReport",
    "InferenceModel",
]
