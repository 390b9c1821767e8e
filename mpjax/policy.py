"""Precision policies: `Policy`, per-module `apply_policy`, and the jaxpr-level `autocast`."""

from mpjax._src.autocast.autocast import autocast
from mpjax._src.autocast.op_lists import ConditionalFP32, OpLists
from mpjax._src.core.policy import (
    DTYPE_NAMES,
    KERAS_POLICY_NAMES,
    Policy,
    cast_floating,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from mpjax._src.flax.apply import apply_policy
from mpjax._src.flax.defaults import DEFAULTS, NO_DEFAULTS, Defaults
from mpjax._src.flax.linen import linen_module_policies
from mpjax._src.flax.linen_intercept import PolicyModule
from mpjax._src.flax.nnx import module_policies
from mpjax._src.flax.rules import parse_rules

__all__ = [
    "ConditionalFP32",
    "DEFAULTS",
    "DTYPE_NAMES",
    "Defaults",
    "KERAS_POLICY_NAMES",
    "NO_DEFAULTS",
    "OpLists",
    "Policy",
    "PolicyModule",
    "apply_policy",
    "autocast",
    "cast_floating",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "linen_module_policies",
    "module_policies",
    "parse_rules",
]
