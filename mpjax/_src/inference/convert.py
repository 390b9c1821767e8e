"""`convert_for_inference`: fold BatchNorm into its Conv/Dense, cast, drop training state.

The conversion runs in four steps that can be called and tested one by one:
`steps.trace_conversion`, `steps.cast_variables`, `fold.fold_variables`, `steps.assemble`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from mpjax._src.core.policy import Policy
from mpjax._src.inference.fold import fold_batchnorm_params, fold_variables
from mpjax._src.inference.steps import InferenceModel, assemble, cast_variables, trace_conversion
from mpjax._src.kernels.dispatch import check_impl

__all__ = ["InferenceModel", "convert_for_inference", "fold_batchnorm_params"]


def convert_for_inference(
    model: nn.Module,
    variables: Mapping[str, Any],
    policy: str | Policy | Mapping | None = None,
    *,
    example_inputs: Any,
    fold_batchnorm: bool = True,
    apply_kwargs: Mapping[str, Any] | None = None,
    epilogue_impl: str | None = None,
    output_dtype: Any = jnp.float32,
) -> InferenceModel:
    """Converts a trained float32 linen model into a mixed-precision inference model.

    Every `nn.Conv`/`nn.Dense` → `nn.BatchNorm` pair (the BatchNorm's input is the
    layer's direct output and nothing else reads that output; see
    `mpjax._src.inference.trace`) and every `mpjax.nn.ConvBN` is folded into the conv's
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
    back to the compute dtype), and casts outputs to `output_dtype`.

    Outputs (the logits) are returned in float32 by default, whatever the compute dtype,
    as `apply_policy`'s defaults return them in training; `output_dtype=None` returns them
    in the policy's own `output_dtype` instead (for a spec such as `"compute=bfloat16"`,
    which fills the output dtype from compute, that is bfloat16).

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
      epilogue_impl: the `conv_epilogue` implementation of folded `ConvBN` layers ("auto",
        "pallas", "interpret", "xla"); None keeps each module's `impl`. Use "xla" for
        an artifact exported for several platforms at once (see `mpjax.export`).
      output_dtype: the dtype of the floating outputs (default float32); None keeps the
        policy's `output_dtype` (under rules: the outputs as the rules leave them).

    Returns:
      An `InferenceModel(apply, variables, report, policy)`; `apply(variables, *inputs)`.
      `policy` is the single policy, or under rules the root module's policy, with
      `output_dtype` replaced by the one `apply` returns.

    Raises:
      TypeError: `model` is not a linen module.
      ValueError: no `params` collection, a BatchNorm runs in training mode, a
        policy is given for a model already wrapped by `apply_policy`, or a
        non-floating `output_dtype`.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import mpjax
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, train):
      ...         h = nn.Dense(4)(x)
      ...         return nn.Dense(2)(nn.BatchNorm(use_running_average=not train)(h))
      >>> model, x = Net(), jnp.ones((3, 8))
      >>> variables = model.init(jax.random.key(0), x, train=False)
      >>> infer = mpjax.convert_for_inference(
      ...     model, variables, "compute=bfloat16", example_inputs=x[:1],
      ...     apply_kwargs={"train": False},
      ... )
      >>> infer.report.folded
      (('Dense_0', 'BatchNorm_0'),)
      >>> jax.jit(infer.apply)(infer.variables, x).dtype  # float32 logits
      dtype('float32')
    """
    if epilogue_impl is not None:
        check_impl(epilogue_impl, "convert_for_inference: epilogue_impl")
    plan = trace_conversion(
        model,
        variables,
        policy,
        example_inputs,
        fold_batchnorm=fold_batchnorm,
        apply_kwargs=apply_kwargs,
        output_dtype=output_dtype,
    )
    params, stats = fold_variables(plan, *cast_variables(plan))
    return assemble(plan, params, stats, epilogue_impl=epilogue_impl)
