"""The interceptors that run a converted model: folded BatchNorms become the identity."""

from __future__ import annotations

import flax.linen as nn

from mpjax.inference.trace import LINEAR_TYPES, NORM_TYPES
from mpjax.policy.policy import cast_floating

__all__ = ["PolicyRunner", "Runner"]


class Runner:
    """The interceptor of the converted forward pass: per-call state only."""

    def __init__(self, folded_norms, folded_linears, compute_dtype, storage_dtype):
        self.folded_norms = folded_norms
        self.folded_linears = folded_linears
        self.compute_dtype = compute_dtype
        self.storage_dtype = storage_dtype
        self.inner = False

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        kind = type(module)
        if self.inner or context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(module.scope.path)
        if kind is nn.BatchNorm and path in self.folded_norms:
            return args[0]  # folded into the preceding Conv/Dense
        if kind in LINEAR_TYPES:
            # Re-run the layer as an unbound clone: compute in the policy's dtype whatever
            # `dtype` the model set, and with a bias when a BatchNorm was folded into it.
            clone = module.clone(
                parent=None,
                dtype=self.compute_dtype,
                param_dtype=self.storage_dtype,
                use_bias=module.use_bias or path in self.folded_linears,
            )
            params = module.variables.get("params", {})
            self.inner = True
            try:
                return clone.apply(
                    {"params": params}, *cast_floating(args, self.compute_dtype), **kwargs
                )
            finally:
                self.inner = False
        if kind in NORM_TYPES:
            # float32 statistics and parameters; the result goes on in the compute dtype.
            return cast_floating(next_fun(*args, **kwargs), self.compute_dtype)
        return next_fun(*args, **kwargs)


class PolicyRunner:
    """The interceptor of a converted model run under `mpjax.apply_policy`'s rules.

    Sits outside the policy wrapper's interceptor, which casts each module's inputs,
    parameters and outputs; this one only makes folded BatchNorms the identity and adds
    the folded bias of a `use_bias=False` Conv/Dense.
    """

    def __init__(self, folded_norms, folded_linears):
        self.folded_norms = folded_norms
        self.folded_linears = folded_linears

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        kind = type(module)
        if context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(module.scope.path)
        if kind is nn.BatchNorm and path in self.folded_norms:
            return args[0]
        if kind in LINEAR_TYPES and path in self.folded_linears and not module.use_bias:
            y = next_fun(*args, **kwargs)
            return y + module.variables["params"]["bias"].astype(y.dtype)
        return next_fun(*args, **kwargs)
