"""`convert_for_inference`: fold BatchNorm into its Conv/Dense, cast, drop training state."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.errors
import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
from flax.core import meta, unfreeze

from mpjax.inference.trace import (
    LINEAR_TYPES,
    NORM_TYPES,
    FoldReport,
    Path,
    lookup,
    path_str,
    trace_model,
)
from mpjax.policy.policy import Policy, cast_floating, get_policy

__all__ = ["InferenceModel", "convert_for_inference", "fold_batchnorm_params"]


class InferenceModel(NamedTuple):
    """A converted model: a pure inference function, its variables, and what was folded.

    Attributes:
      apply: `apply(variables, *inputs) -> outputs`, pure and `jax.jit`/`jax.export`-able.
      variables: the converted variables (plain nested dicts).
      report: the `FoldReport`.
      policy: the `Policy` it was converted for.
    """

    apply: Callable[..., Any]
    variables: dict
    report: FoldReport
    policy: Policy

    def __call__(self, *inputs):
        """`self.apply(self.variables, *inputs)`."""
        return self.apply(self.variables, *inputs)


def fold_batchnorm_params(
    kernel: jax.Array,
    bias: jax.Array | None,
    mean: jax.Array,
    var: jax.Array,
    scale: jax.Array | None,
    offset: jax.Array | None,
    epsilon: float,
) -> tuple[jax.Array, jax.Array]:
    """Folds an inference-mode BatchNorm into the kernel and bias before it, in float32.

    `BN(x @ kernel + bias) == x @ kernel' + bias'` with `s = scale / sqrt(var + eps)`,
    `kernel' = kernel * s` (over the kernel's last, output-channel axis) and
    `bias' = (bias - mean) * s + offset`.

    Args:
      kernel: `[..., C]` Conv/Dense kernel.
      bias: `[C]` bias, or None for `use_bias=False`.
      mean, var: `[C]` running statistics.
      scale, offset: `[C]` BatchNorm scale and bias, or None when not used.
      epsilon: the BatchNorm's epsilon.

    Returns:
      `(kernel', bias')`, in float32 (or wider if the inputs are wider).

    Example:
      >>> k, b = fold_batchnorm_params(k, None, mean, var, gamma, beta, 1e-5)
    """
    dtype = jnp.promote_types(jnp.float32, kernel.dtype)
    f = lambda a: jnp.asarray(a, dtype)
    s = jax.lax.rsqrt(f(var) + jnp.asarray(epsilon, dtype))
    if scale is not None:
        s = s * f(scale)
    b = -f(mean) if bias is None else f(bias) - f(mean)
    b = b * s
    if offset is not None:
        b = b + f(offset)
    return f(kernel) * s, b


class _Runner:
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


def _cast_params(node: Any, path: Path, norm_paths: set, storage, norm_dtype) -> Any:
    """Casts params to `storage`, except the own leaves of norm modules (to `norm_dtype`)."""
    if not isinstance(node, Mapping):
        return cast_floating(node, storage)
    own = norm_dtype if path in norm_paths else storage
    return {
        k: _cast_params(v, (*path, k), norm_paths, storage, norm_dtype)
        if isinstance(v, Mapping)
        else cast_floating(v, own)
        for k, v in node.items()
    }


def _set(tree: dict, path: Path, key: str, value: Any) -> None:
    for k in path:
        tree = tree[k]
    tree[key] = value


def _delete(tree: dict, path: Path) -> None:
    """Deletes `tree[path]` and every mapping left empty above it."""
    if not path or lookup(tree, path) is None:
        return
    parent = lookup(tree, path[:-1]) if len(path) > 1 else tree
    del parent[path[-1]]
    if len(path) > 1 and not parent:
        _delete(tree, path[:-1])


def _used_collections(fn, variables: dict, inputs: Sequence[Any]) -> set[str]:
    """The collections of `variables` that the jaxpr of `fn(variables, *inputs)` reads."""
    closed = jax.make_jaxpr(fn)(variables, *inputs)
    jaxpr = closed.jaxpr
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, jex.Var)}
    used |= {v for v in jaxpr.outvars if isinstance(v, jex.Var)}
    leaves = jax.tree_util.tree_flatten_with_path((variables, tuple(inputs)))[0]
    names = set()
    for (key_path, _), var in zip(leaves, jaxpr.invars, strict=True):
        if key_path[0].idx == 0 and var in used:
            names.add(key_path[1].key)
    return names


def convert_for_inference(
    model: nn.Module,
    variables: Mapping[str, Any],
    policy: str | Policy = "compute=bfloat16",
    *,
    example_inputs: Any,
    fold_batchnorm: bool = True,
    apply_kwargs: Mapping[str, Any] | None = None,
) -> InferenceModel:
    """Converts a trained float32 linen model into a mixed-precision inference model.

    Every `nn.Conv`/`nn.Dense` → `nn.BatchNorm` pair (the BatchNorm's input is the
    layer's direct output and nothing else reads that output; see
    `mpjax.inference.trace`) is folded into the layer's kernel and bias in float32,
    then stored in the narrower of the policy's param and compute dtypes; the
    BatchNorm becomes the identity. Norms that cannot be folded (and every other
    `LayerNorm`/`GroupNorm`/`RMSNorm`/`InstanceNorm`) keep float32 parameters and
    statistics. Collections the inference pass does not read (folded `batch_stats`,
    `intermediates`, ...) are dropped. The returned `apply` casts floating inputs to
    the compute dtype, runs every Conv/Dense in the compute dtype, norms in float32
    (their result cast back to the compute dtype), and casts outputs to the policy's
    output dtype.

    Args:
      model: the linen module.
      variables: its trained variables (`params`, `batch_stats`, ...).
      policy: a `Policy` or spec string; the default gives bfloat16 weights and compute.
      example_inputs: an input array or `jax.ShapeDtypeStruct` (or a tuple of them for
        several positional inputs); used once, to trace the model.
      fold_batchnorm: fold BatchNorms (True) or only cast (False).
      apply_kwargs: keyword arguments for `model.apply` that select inference mode,
        e.g. `{"train": False}`; baked into `apply`.

    Returns:
      An `InferenceModel(apply, variables, report, policy)`; `apply(variables, *inputs)`.

    Raises:
      TypeError: `model` is not a linen module.
      ValueError: no `params` collection, or a BatchNorm runs in training mode.

    Example:
      >>> infer = mpjax.convert_for_inference(model, variables, "compute=bfloat16",
      ...                                     example_inputs=x[:1],
      ...                                     apply_kwargs={"train": False})
      >>> logits = jax.jit(infer.apply)(infer.variables, x)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"convert_for_inference: model must be a flax.linen Module, got {type(model).__name__}"
        )
    if not isinstance(variables, Mapping) or "params" not in variables:
        got = list(variables) if isinstance(variables, Mapping) else type(variables).__name__
        raise ValueError(
            f"convert_for_inference: variables must be a mapping with a 'params' collection, "
            f"got {got}"
        )
    if apply_kwargs is not None and not isinstance(apply_kwargs, Mapping):
        raise TypeError(
            f"convert_for_inference: apply_kwargs must be a mapping, got "
            f"{type(apply_kwargs).__name__}"
        )
    policy = get_policy(policy)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    apply = functools.partial(model.apply, **dict(apply_kwargs or {}))
    variables = unfreeze(meta.unbox(variables))
    trace = trace_model(apply, variables, example_inputs, fold_batchnorm)

    compute = policy.compute_dtype
    storage = min(policy.compute_dtype, policy.param_dtype, key=lambda d: d.itemsize)
    norm_dtype = jnp.promote_types(jnp.float32, compute)
    norm_paths = {c.path for c in trace.calls if c.kind in NORM_TYPES}

    params = _cast_params(variables["params"], (), norm_paths, storage, norm_dtype)
    stats = cast_floating(unfreeze(variables.get("batch_stats", {})), norm_dtype)
    for bn, lin in trace.pairs.items():
        src = variables["params"]
        bn_params = lookup(src, bn) or {}
        use = _bn_attrs(trace, bn)
        kernel, bias = fold_batchnorm_params(
            lookup(src, (*lin, "kernel")),
            lookup(src, (*lin, "bias")),
            lookup(variables, ("batch_stats", *bn, "mean")),
            lookup(variables, ("batch_stats", *bn, "var")),
            bn_params.get("scale") if use["use_scale"] else None,
            bn_params.get("bias") if use["use_bias"] else None,
            use["epsilon"],
        )
        _set(params, lin, "kernel", kernel.astype(storage))
        _set(params, lin, "bias", bias.astype(storage))
        _delete(params, bn)
        _delete(stats, bn)

    converted = {"params": params}
    if stats:
        converted["batch_stats"] = stats
    for name, value in variables.items():
        if name not in ("params", "batch_stats"):
            converted[name] = unfreeze(value)

    folded_norms = frozenset(trace.pairs)
    folded_linears = frozenset(trace.pairs.values())
    output_dtype = policy.output_dtype

    def infer(variables, *inputs):
        runner = _Runner(folded_norms, folded_linears, compute, storage)
        with nn.intercept_methods(runner):
            out = apply(variables, *cast_floating(inputs, compute))
        return cast_floating(out, output_dtype)

    used = _used_collections(infer, converted, example_inputs)
    pruned = {k: v for k, v in converted.items() if k == "params" or k in used}
    if pruned.keys() != converted.keys():
        try:
            jax.eval_shape(infer, pruned, *example_inputs)
            converted = pruned
        except flax.errors.FlaxError:  # a module declares a variable it does not read
            pass
    return InferenceModel(infer, converted, trace.report, policy)


def _bn_attrs(trace, path: Path) -> dict[str, Any]:
    """The recorded attributes of the BatchNorm call at `path`."""
    for call in trace.calls:
        if call.path == path and call.kind is nn.BatchNorm:
            return call.attrs
    raise KeyError(path_str(path))
