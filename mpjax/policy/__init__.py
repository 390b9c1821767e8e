"""Precision policies."""

from mpjax.policy.apply import apply_policy
from mpjax.policy.defaults import DEFAULTS, NO_DEFAULTS, Defaults
from mpjax.policy.linen import PolicyModule, linen_module_policies
from mpjax.policy.nnx import module_policies
from mpjax.policy.policy import DTYPE_NAMES, Policy, cast_floating, get_policy
from mpjax.policy.rules import parse_rules

__all__ = [
    "DEFAULTS",
    "DTYPE_NAMES",
    "NO_DEFAULTS",
    "Defaults",
    "Policy",
    "PolicyModule",
    "apply_policy",
    "cast_floating",
    "get_policy",
    "linen_module_policies",
    "module_policies",
    "parse_rules",
]
