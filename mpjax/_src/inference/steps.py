"""The four steps of `convert_for_inference`, each readable and testable on its own.

1. `trace_conversion`: resolve the policy (one policy, or `apply_policy` rules) and the
   output dtype, trace the model once, decide which BatchNorms fold (`trace_model`) and the
   dtype each module's params are stored in: a `ConversionPlan`.
2. `cast_variables`: every module's params in its storage dtype, `batch_stats` in the
   norm dtype (float32).
3. `fold_variables` (in `mpjax._src.inference.fold`): each folded pair's kernel and bias
   recomputed from the float32 originals (`fold_batchnorm_params`); the BatchNorm's params
   and statistics removed.
4. `assemble`: the converted variables, the pure inference function, and the collections
   it does not read dropped: an `InferenceModel`.

Each step returns new containers and leaves its inputs as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.errors
import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from flax.core import meta, unfreeze

from mpjax._src.core.policy import Policy, as_float_dtype, cast_floating, get_policy
from mpjax._src.flax.apply import apply_policy
from mpjax._src.flax.conv_bn import ConvBN
from mpjax._src.flax.linen import linen_module_policies
from mpjax._src.flax.linen_intercept import PolicyModule
from mpjax._src.inference.runtime import PolicyRunner, Runner
from mpjax._src.inference.trace import NORM_TYPES, FoldReport, Path, Trace, path_str, trace_model

__all__ = [
    "ConversionPlan",
    "InferenceModel",
    "assemble",
    "cast_variables",
    "trace_conversion",
]

# The policy of `convert_for_inference(..., policy=None)` for a model not wrapped by rules.
DEFAULT_POLICY = "compute=bfloat16"


class InferenceModel(NamedTuple):
    """A converted model: a pure inference function, its variables, and what was folded.

    Attributes:
      apply: `apply(variables, *inputs) -> outputs`, pure and `jax.jit`/`jax.export`-able.
      variables: the converted variables (plain nested dicts).
      report: the `FoldReport`.
      policy: the `Policy` it was converted for, its `output_dtype` the dtype `apply`
        returns (under rules: the root module's policy).
    """

    apply: Callable[..., Any]
    variables: dict
    report: FoldReport
    policy: Policy

    def __call__(self, *inputs):
        """`self.apply(self.variables, *inputs)`."""
        return self.apply(self.variables, *inputs)


class ConversionPlan(NamedTuple):
    """What `trace_conversion` decided, read by the other steps.

    Attributes:
      apply: the unwrapped module's `apply`, inference-mode keyword arguments bound.
      variables: the original variables, unboxed plain dicts (never modified).
      example_inputs: the example inputs, a tuple.
      trace: the `Trace`: recorded module calls and the `{batchnorm: linear}` pairs to fold.
      policy: the single policy, or under rules the root module's policy; its
        `output_dtype` is the output dtype (None under rules without a root policy).
      rules: the `apply_policy` wrapper when per-module rules apply, else None.
      module_policies: `{module path: Policy}` under rules, `{}` otherwise.
      norm_dtype: the dtype norm parameters, statistics and folded ConvBN shifts keep.
      norm_paths: module paths whose params are stored in `norm_dtype`.
      output_dtype: the dtype floating outputs are cast to (None: as the rules leave them).
    """

    apply: Callable[..., Any]
    variables: dict
    example_inputs: tuple
    trace: Trace
    policy: Policy | None
    rules: PolicyModule | None
    module_policies: Mapping[str, Policy]
    norm_dtype: np.dtype
    norm_paths: frozenset
    output_dtype: np.dtype | None

    def param_dtype(self, path: Path) -> np.dtype | None:
        """The dtype the params of the module at `path` are stored in (None: as given).

        Norms (and, under rules, folded ConvBNs) keep `norm_dtype`; every other module the
        narrower of its param and compute dtypes.
        """
        if path in self.norm_paths:
            return self.norm_dtype
        if self.rules is None:
            return _narrower(self.policy)
        rule = self.module_policies.get(path_str(path, ""))
        return None if rule is None else _narrower(rule)


def _narrower(policy: Policy) -> np.dtype:
    """The dtype inference stores weights in: the narrower of param and compute dtypes."""
    return min(policy.compute_dtype, policy.param_dtype, key=lambda d: d.itemsize)


# ----------------------------------------------------------------------------- 1. trace


def _check_arguments(model, variables, policy, apply_kwargs) -> None:
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
    if isinstance(model, PolicyModule) and policy is not None:
        raise ValueError(
            "convert_for_inference: the model is wrapped by apply_policy, which sets its "
            f"policies; pass policy=None (got {policy!r})"
        )


def trace_conversion(
    model: nn.Module,
    variables: Mapping[str, Any],
    policy: str | Policy | Mapping | None,
    example_inputs: Any,
    *,
    fold_batchnorm: bool = True,
    apply_kwargs: Mapping[str, Any] | None = None,
    output_dtype: Any = jnp.float32,
) -> ConversionPlan:
    """Step 1: resolves the policy, traces the model once and plans the conversion.

    Args and Raises: as `convert_for_inference`.

    Returns:
      The `ConversionPlan`.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from mpjax._src.inference.steps import trace_conversion
      >>> seq = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=True)])
      >>> images = jnp.ones((2, 8))
      >>> plan = trace_conversion(seq, seq.init(jax.random.key(0), images), "bf16", images)
      >>> plan.trace.report.folded
      (('layers_0', 'layers_1'),)
    """
    _check_arguments(model, variables, policy, apply_kwargs)
    if output_dtype is not None:
        output_dtype = as_float_dtype(output_dtype, "convert_for_inference: output_dtype")
    if isinstance(policy, Mapping):
        model = apply_policy(model, policy)
    rules = model if isinstance(model, PolicyModule) else None
    if rules is not None:
        model = rules.module
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    apply_kwargs = dict(apply_kwargs or {})
    apply = functools.partial(model.apply, **apply_kwargs)
    variables = unfreeze(meta.unbox(variables))
    trace = trace_model(apply, variables, example_inputs, fold_batchnorm)

    if rules is None:
        policy = get_policy(DEFAULT_POLICY if policy is None else policy)
        module_policies = {}
        norm_dtype = jnp.promote_types(jnp.float32, policy.compute_dtype)
        norm_kinds = (*NORM_TYPES, ConvBN)
    else:
        concrete = [jnp.zeros(x.shape, x.dtype) for x in example_inputs]
        module_policies = linen_module_policies(rules, variables, *concrete, **apply_kwargs)
        policy = module_policies.get("")
        norm_dtype = jnp.float32
        norm_kinds = (ConvBN,)  # its scale/shift feed the float32 epilogue
    if policy is not None and output_dtype is not None:
        policy = policy.with_output_dtype(output_dtype)
    elif rules is None:
        output_dtype = policy.output_dtype
    return ConversionPlan(
        apply=apply,
        variables=variables,
        example_inputs=example_inputs,
        trace=trace,
        policy=policy,
        rules=rules,
        module_policies=module_policies,
        norm_dtype=np.dtype(norm_dtype),
        norm_paths=frozenset(c.path for c in trace.calls if c.kind in norm_kinds),
        output_dtype=output_dtype,
    )


# ----------------------------------------------------------------------------- 2. cast


def _cast_params(node: Any, path: Path, dtype_at: Callable[[Path], Any]) -> Any:
    """Casts each module's own floating params to `dtype_at(path)` (None: left as they are)."""
    dtype = dtype_at(path)
    return {
        k: _cast_params(v, (*path, k), dtype_at)
        if isinstance(v, Mapping)
        else (v if dtype is None else cast_floating(v, dtype))
        for k, v in node.items()
    }


def cast_variables(plan: ConversionPlan) -> tuple[dict, dict]:
    """Step 2: the params in their storage dtypes and the `batch_stats` in `norm_dtype`.

    Args:
      plan: from `trace_conversion`.

    Returns:
      `(params, batch_stats)`, new nested dicts (`batch_stats` `{}` when there are none).
    """
    params = _cast_params(plan.variables["params"], (), plan.param_dtype)
    stats = cast_floating(unfreeze(plan.variables.get("batch_stats", {})), plan.norm_dtype)
    return params, stats


# ----------------------------------------------------------------------------- 4. assemble


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


def _inference_fn(plan: ConversionPlan, epilogue_impl: str | None) -> Callable[..., Any]:
    """The pure `infer(variables, *inputs)` running the converted variables."""
    folded_norms = frozenset(plan.trace.pairs)
    folded_linears = frozenset(plan.trace.pairs.values())
    output_dtype = plan.output_dtype

    def leave(out):
        return out if output_dtype is None else cast_floating(out, output_dtype)

    if plan.rules is None:
        compute, storage, apply = plan.policy.compute_dtype, _narrower(plan.policy), plan.apply

        def infer(variables, *inputs):
            runner = Runner(folded_norms, folded_linears, compute, storage, epilogue_impl)
            with nn.intercept_methods(runner):
                return leave(apply(variables, *cast_floating(inputs, compute)))

        return infer

    policy_apply = functools.partial(plan.rules.apply, **plan.apply.keywords)
    convbn = {c.path for c in plan.trace.calls if c.kind is ConvBN}
    convbn_policies = {p: plan.module_policies.get(path_str(p, "")) for p in convbn}

    def infer(variables, *inputs):
        runner = PolicyRunner(folded_norms, folded_linears, convbn_policies, epilogue_impl)
        with nn.intercept_methods(runner):
            return leave(policy_apply(variables, *inputs))

    return infer


def assemble(
    plan: ConversionPlan, params: dict, stats: dict, *, epilogue_impl: str | None = None
) -> InferenceModel:
    """Step 4: the converted variables and inference function, unread collections dropped.

    Collections other than `params` and `batch_stats` are carried over, then every one the
    inference function does not read (e.g. `intermediates`, fully folded `batch_stats`) is
    dropped, unless a module declares a variable it does not read.

    Args:
      plan: from `trace_conversion`.
      params, stats: from `fold_variables` (or `cast_variables` for no folding).
      epilogue_impl: as `convert_for_inference`.

    Returns:
      The `InferenceModel`.
    """
    converted = {"params": params}
    if stats:
        converted["batch_stats"] = stats
    for name, value in plan.variables.items():
        if name not in ("params", "batch_stats"):
            converted[name] = unfreeze(value)
    infer = _inference_fn(plan, epilogue_impl)
    used = _used_collections(infer, converted, plan.example_inputs)
    pruned = {k: v for k, v in converted.items() if k == "params" or k in used}
    if pruned.keys() != converted.keys():
        try:
            jax.eval_shape(infer, pruned, *plan.example_inputs)
            converted = pruned
        except flax.errors.FlaxError:  # a module declares a variable it does not read
            pass
    return InferenceModel(infer, converted, plan.trace.report, plan.policy)
