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
from mpjax._src.flax.linen import PolicyModule, linen_module_policies
from mpjax._src.flax.nnx import module_policies
from mpjax._src.flax.rules import parse_rules

__all__ = [
    "apply_policy",
    "autocast",
    "cast_floating",
    "cast_to_full",
    "cast_to_half",
    "ConditionalFP32",
    "DEFAULTS",
    "Defaults",
    "DTYPE_NAMES",
    "get_policy",
    "half_dtype",
    "KERAS_POLICY_NAMES",
    "linen_module_policies",
    "module_policies",
    "NO_DEFAULTS",
    "OpLists",
    "parse_rules",
    "Policy",
    "PolicyModule",
]
