"""Precision policies and the jaxpr-level `autocast`."""

from mpjax.policy.autocast import autocast
from mpjax.policy.op_lists import ConditionalFP32, OpLists
from mpjax.policy.policy import DTYPE_NAMES, Policy, cast_floating, get_policy

__all__ = [
    "DTYPE_NAMES",
    "ConditionalFP32",
    "OpLists",
    "Policy",
    "autocast",
    "cast_floating",
    "get_policy",
]
