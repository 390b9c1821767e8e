"""Precision policies."""

from mpjax.policy.policy import DTYPE_NAMES, Policy, cast_floating, get_policy

__all__ = ["DTYPE_NAMES", "Policy", "cast_floating", "get_policy"]
