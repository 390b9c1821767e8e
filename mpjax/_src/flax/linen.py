"""Per-module precision policies for Flax linen modules.

`apply_linen_policy(module, policy)` returns a `PolicyModule`, a linen module with the
same `init`/`apply` API and the same variable tree as `module` (checkpoints
interchange). It works through `flax.linen.intercept_methods`; for every method call
of a covered module, coming from outside that module:

- on the module's first call in an `apply`, its own parameters are cast to its
  compute dtype once (and the cast values reused by every later call in that apply,
  so a tied embedding is cast once per step);
- floating inputs are cast to the compute dtype, floating outputs to the output dtype
  (the inherited compute dtype for a module without its own rule; see
  `mpjax._src.flax.rules`), and a `dtype` field (Flax's computation dtype) is set to
  the compute dtype for the call, so an explicit `dtype=` on a layer does not override the policy;
- attention modules in `Defaults.float32_softmax_modules` that use Flax's default
  `attention_fn` run cuDNN's fused attention on CUDA where it applies (its softmax in
  float32 inside the kernel; `mpjax._src.flax.fused_attention`), else
  `float32_softmax_attention` (softmax in float32, both matmuls on compute-dtype operands);
- a module whose own code hands an op that takes only float32 (an FFT) its
  low-precision inputs is run again in float32, its children inheriting float32 and
  its outputs in its policy's output dtype; the failed attempt is undone first
  (variables and RNG counters of its scope; see `mpjax._src.flax.float32_only`).

At `init` (and whenever the `params` collection is mutable) parameters are created as
the module creates them and then cast to the policy's `param_dtype`; the forward pass
of `init` itself uses them as created.

`PolicyModule` and its interceptor live in `mpjax._src.flax.linen_intercept`, the float32
softmax in `linen_attention`, the scope helpers in `linen_scope`; this module re-exports
the first two.
"""

from __future__ import annotations

from typing import Any

import jax

import flax.linen as nn
from mpjax._src.flax.defaults import DEFAULTS, Defaults
from mpjax._src.flax.fp8_linen import DelayedFp8
from mpjax._src.flax.linen_attention import float32_softmax_attention
from mpjax._src.flax.linen_intercept import _RECORDER, PolicyModule
from mpjax._src.flax.rules import parse_rules

__all__ = [
    "PolicyModule",
    "apply_linen_policy",
    "float32_softmax_attention",
    "linen_module_policies",
]


def apply_linen_policy(
    module: nn.Module, policy: Any, *, defaults: Defaults = DEFAULTS, fp8: DelayedFp8 | None = None
) -> PolicyModule:
    """Wraps a linen module so that it runs under per-module precision policies.

    Args:
      module: an unbound `flax.linen.Module` (a `PolicyModule` is re-wrapped with
        the new rules).
      policy: a `Policy`, a spec string, or a `{selector: policy}` mapping (see
        `mpjax._src.flax.rules`).
      defaults: the default lists (`mpjax.DEFAULTS`; `mpjax.NO_DEFAULTS` for none).
      fp8: delayed fp8 scaling (see `mpjax._src.flax.fp8_linen`), or None.

    Returns:
      A `PolicyModule` with the same `init`/`apply` API and variable tree (plus the
      `"fp8_meta"` collection under `fp8`).

    Example:
      >>> from mpjax._src.flax.linen import apply_linen_policy
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> model = apply_linen_policy(nn.Dense(3), "params=float32,compute=bfloat16")
      >>> v = model.init(jax.random.key(0), jnp.ones((1, 2)))
      >>> model.apply(v, jnp.ones((1, 2))).dtype  # logits leave in float32
      dtype('float32')
    """
    if isinstance(module, PolicyModule):
        module = module.module
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a flax.linen.Module, got {type(module).__name__}")
    if not isinstance(defaults, Defaults):
        raise TypeError(f"defaults must be a mpjax Defaults, got {type(defaults).__name__}")
    return PolicyModule(module, parse_rules(policy, nn.Module), defaults, fp8)


def linen_module_policies(
    model: PolicyModule, variables: Any, *args, method: Any = None, **kwargs
) -> dict[str, Any]:
    """The effective policy of every module a call of `model` runs, by path.

    Traces `model.apply(variables, *args, method=method, **kwargs)` abstractly (no
    computation) and records what each covered module resolved to.

    Args:
      model: a `PolicyModule` from `apply_policy`.
      variables: its variables (arrays or `jax.ShapeDtypeStruct` values).
      *args: the call's arguments (concrete values: they are closed over).
      method: as for `apply`.
      **kwargs: the call's keyword arguments (e.g. `mutable=`, `rngs=`).

    Returns:
      A dict from each module path to its `Policy` (`""` is the root).
    """
    if not isinstance(model, PolicyModule):
        raise TypeError(f"expected a PolicyModule from apply_policy, got {type(model).__name__}")
    record: dict[str, Any] = {}
    token = _RECORDER.set(record)
    try:
        jax.eval_shape(lambda v: model.apply(v, *args, method=method, **kwargs), variables)
    finally:
        _RECORDER.reset(token)
    return record
