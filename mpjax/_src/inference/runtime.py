"""The interceptors that run a converted model: folded BatchNorms become the identity."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from mpjax._src.core.policy import cast_floating
from mpjax._src.flax.conv_bn import ConvBN, nchw_to_nhwc
from mpjax._src.inference.trace import LINEAR_TYPES, NORM_TYPES
from mpjax._src.kernels.epilogue import conv_epilogue

__all__ = ["PolicyRunner", "Runner", "folded_conv_bn"]


def folded_conv_bn(module: ConvBN, args, kwargs, compute, storage, out_dtype, impl=None):
    """A folded `ConvBN`: its conv on the folded kernel, then the fused epilogue.

    The epilogue `conv_epilogue(y, 1, shift, residual, activation)` adds the folded
    BatchNorm (the float32 `bias` param), the residual and the activation in one pass,
    with `impl` (None: the module's own `impl`).
    """
    x = args[0]
    residual = args[1] if len(args) > 1 else kwargs.get("residual")
    if module.input_layout == "NCHW":
        x = nchw_to_nhwc(x)
    params = module.variables["params"]
    conv = nn.Conv(
        module.features,
        tuple(module.kernel_size),
        strides=module.strides,
        padding=module.padding,
        use_bias=False,
        dtype=compute,
        param_dtype=storage,
        parent=None,
    )
    y = conv.apply({"params": params["conv"]}, cast_floating(x, compute))
    shift = params["bias"]
    return conv_epilogue(
        y,
        jnp.ones(shift.shape, shift.dtype),
        shift,
        residual,
        activation=module.activation,
        out_dtype=out_dtype,
        impl=module.impl if impl is None else impl,
    )


class Runner:
    """The interceptor of the converted forward pass: per-call state only."""

    def __init__(self, folded_norms, folded_linears, compute_dtype, storage_dtype, impl=None):
        self.folded_norms = folded_norms
        self.impl = impl
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
        if kind is ConvBN and path in self.folded_norms:
            self.inner = True
            try:
                cd, sd = self.compute_dtype, self.storage_dtype
                return folded_conv_bn(module, args, kwargs, cd, sd, cd, self.impl)
            finally:
                self.inner = False
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
    the folded bias of a `use_bias=False` Conv/Dense; a folded `ConvBN` runs as
    `folded_conv_bn` under its own resolved policy (`convbn_policies[path]`, or its
    stored kernel dtype when no rule covers it).
    """

    def __init__(self, folded_norms, folded_linears, convbn_policies, impl=None):
        self.folded_norms = folded_norms
        self.impl = impl
        self.folded_linears = folded_linears
        self.convbn_policies = convbn_policies

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        kind = type(module)
        if context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(module.scope.path)
        if kind is nn.BatchNorm and path in self.folded_norms:
            return args[0]
        if kind is ConvBN and path in self.folded_norms:
            rule = self.convbn_policies.get(path)
            if rule is None:
                dtype = module.variables["params"]["conv"]["kernel"].dtype
                compute = storage = out = dtype
            else:
                compute = rule.compute_dtype
                storage = min(compute, rule.param_dtype, key=lambda d: d.itemsize)
                out = rule.output_dtype
            return folded_conv_bn(module, args, kwargs, compute, storage, out, self.impl)
        if kind in LINEAR_TYPES and path in self.folded_linears and not module.use_bias:
            y = next_fun(*args, **kwargs)
            return y + module.variables["params"]["bias"].astype(y.dtype)
        return next_fun(*args, **kwargs)
