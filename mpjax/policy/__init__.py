"""Precision policies: `Policy`, per-module `apply_policy`, and the jaxpr-level `autocast`."""

from mpjax.policy.apply import apply_policy
from mpjax.policy.autocast import autocast
from mpjax.policy.defaults import DEFAULTS, NO_DEFAULTS, Defaults
from mpjax.policy.linen import PolicyModule, linen_module_policies
from mpjax.policy.nnx import module_policies
from mpjax.policy.op_lists import ConditionalFP32, OpLists
from mpjax.policy.policy import (
    DTYPE_NAMES,
    KERAS_POLICY_NAMES,
    Policy,
    cast_floating,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from mpjax.policy.rules import parse_rules

__all__ = [
    "DEFAULTS",
    "DTYPE_NAMES",
    "KERAS_POLICY_NAMES",
    "NO_DEFAULTS",
    "ConditionalFP32",
    "Defaults",
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
