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

from mpjax.inference.runtime import PolicyRunner, Runner
from mpjax.inference.trace import (
    NORM_TYPES,
    FoldReport,
    Path,
    lookup,
    path_str,
    trace_model,
)
from mpjax.nn import ConvBN
from mpjax.pallas.dispatch import check_impl
from mpjax.policy.apply import apply_policy
from mpjax.policy.linen import PolicyModule, linen_module_policies
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


def _cast_params(node: Any, path: Path, own_dtype: Callable[[Path], Any]) -> Any:
    """Casts each module's own floating params to `own_dtype(path)` (None: left as they are)."""
    dtype = own_dtype(path)
    return {
        k: _cast_params(v, (*path, k), own_dtype)
        if isinstance(v, Mapping)
        else (v if dtype is None else cast_floating(v, dtype))
        for k, v in node.items()
    }


def _narrower(policy: Policy) -> Any:
    """The dtype inference stores weights in: the narrower of param and compute dtypes."""
    return min(policy.compute_dtype, policy.param_dtype, key=lambda d: d.itemsize)


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
    policy: str | Policy | Mapping | None = None,
    *,
    example_inputs: Any,
    fold_batchnorm: bool = True,
    apply_kwargs: Mapping[str, Any] | None = None,
    epilogue_impl: str | None = None,
) -> InferenceModel:
    """Converts a trained float32 linen model into a mixed-precision inference model.

    Every `nn.Conv`/`nn.Dense` → `nn.BatchNorm` pair (the BatchNorm's input is the
    layer's direct output and nothing else reads that output; see
    `mpjax.inference.trace`) and every `mpjax.nn.ConvBN` is folded into the conv's
    kernel and bias in float32, then stored in the narrower of the param and compute
    dtypes; the BatchNorm becomes the identity. A folded `ConvBN` runs its conv on the
    folded kernel, then the fused `mpjax.pallas.conv_epilogue` for the folded shift
    (kept in float32) + residual + activation; a plain Conv/Dense adds its folded bias
    itself (XLA fuses that add with the activation after it). Collections the
    inference pass does not read (folded `batch_stats`, `intermediates`, ...) are
    dropped.

    With a single policy (a `Policy` or spec string), `apply` casts floating inputs to
    the compute dtype, runs every Conv/Dense in the compute dtype (whatever `dtype`
    the model set), every norm (`BatchNorm` left unfolded, `LayerNorm`, `GroupNorm`,
    `RMSNorm`, `InstanceNorm`) on float32 parameters and statistics (its result cast
    back to the compute dtype), and casts outputs to the output dtype.

    With per-module rules (`model` wrapped by `mpjax.apply_policy`, or `policy` a rule
    mapping as `apply_policy` takes), the inference pass runs under those rules and
    their default lists exactly as `apply_policy` runs training, and each module's
    weights are stored in the narrower of its own resolved param and compute dtypes
    (so float32-listed norms keep float32).

    Args:
      model: the linen module, or the result of `mpjax.apply_policy(model, rules)`.
      variables: its trained variables (`params`, `batch_stats`, ...).
      policy: a `Policy`, spec string or `apply_policy` rule mapping; None means
        `"compute=bfloat16"` (bfloat16 weights and compute), or for a model wrapped by
        `apply_policy`, its own rules.
      example_inputs: an input array or `jax.ShapeDtypeStruct` (or a tuple of them for
        several positional inputs); used once, to trace the model.
      fold_batchnorm: fold BatchNorms (True) or only cast (False).
      apply_kwargs: keyword arguments for `model.apply` that select inference mode,
        e.g. `{"train": False}`; baked into `apply`.
      epilogue_impl: the `conv_epilogue` implementation of folded `ConvBN`s ("auto",
        "pallas", "interpret", "xla"); None keeps each module's `impl`. Use "xla" for
        an artifact exported for several platforms at once (see `mpjax.export`).

    Returns:
      An `InferenceModel(apply, variables, report, policy)`; `apply(variables, *inputs)`.
      `policy` is the single policy, or under rules the root module's policy.

    Raises:
      TypeError: `model` is not a linen module.
      ValueError: no `params` collection, a BatchNorm runs in training mode, or a
        policy is given for a model already wrapped by `apply_policy`.

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
    if epilogue_impl is not None:
        check_impl(epilogue_impl, "convert_for_inference: epilogue_impl")
    if isinstance(model, PolicyModule) and policy is not None:
        raise ValueError(
            "convert_for_inference: the model is wrapped by apply_policy, which sets its "
            f"policies; pass policy=None (got {policy!r})"
        )
    if isinstance(policy, Mapping):
        model = apply_policy(model, policy)
    wrapped = model if isinstance(model, PolicyModule) else None
    if wrapped is not None:
        model = wrapped.module
    else:
        policy = get_policy("compute=bfloat16" if policy is None else policy)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    apply_kwargs = dict(apply_kwargs or {})
    apply = functools.partial(model.apply, **apply_kwargs)
    variables = unfreeze(meta.unbox(variables))
    trace = trace_model(apply, variables, example_inputs, fold_batchnorm)

    if wrapped is None:
        compute, storage = policy.compute_dtype, _narrower(policy)
        norm_dtype = jnp.promote_types(jnp.float32, compute)
        norm_paths = {c.path for c in trace.calls if c.kind in NORM_TYPES or c.kind is ConvBN}
        own_dtype = lambda path: norm_dtype if path in norm_paths else storage
    else:
        concrete = [jnp.zeros(x.shape, x.dtype) for x in example_inputs]
        policies = linen_module_policies(wrapped, variables, *concrete, **apply_kwargs)
        policy = policies.get("")
        norm_dtype = jnp.float32
        convbn_paths = {c.path for c in trace.calls if c.kind is ConvBN}

        def own_dtype(path):
            if path in convbn_paths:  # its scale/shift feed the float32 epilogue
                return norm_dtype
            rule = policies.get(path_str(path, ""))
            return None if rule is None else _narrower(rule)

    params = _cast_params(variables["params"], (), own_dtype)
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
        dtype = own_dtype(lin) or kernel.dtype
        _set(params, lin, "kernel", kernel.astype(dtype))
        if use["kind"] is ConvBN:  # the BatchNorm becomes the epilogue's float32 shift
            _delete(params, (*bn, "scale"))
            _set(params, bn, "bias", bias.astype(norm_dtype))
        else:
            _set(params, lin, "bias", bias.astype(dtype))
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

    if wrapped is None:
        output_dtype = policy.output_dtype

        def infer(variables, *inputs):
            runner = Runner(folded_norms, folded_linears, compute, storage, epilogue_impl)
            with nn.intercept_methods(runner):
                out = apply(variables, *cast_floating(inputs, compute))
            return cast_floating(out, output_dtype)

    else:
        policy_apply = functools.partial(wrapped.apply, **apply_kwargs)
        convbn_policies = {p: policies.get(path_str(p, "")) for p in convbn_paths}

        def infer(variables, *inputs):
            runner = PolicyRunner(folded_norms, folded_linears, convbn_policies, epilogue_impl)
            with nn.intercept_methods(runner):
                return policy_apply(variables, *inputs)

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
    """The recorded attributes of the BatchNorm (or ConvBN) call at `path`, and its kind."""
    for call in trace.calls:
        if call.path == path and call.kind in (nn.BatchNorm, ConvBN):
            return {**call.attrs, "kind": call.kind}
    raise KeyError(path_str(path))
