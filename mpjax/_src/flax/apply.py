"""`apply_policy`: per-module precision policies for Flax linen and NNX models."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx
from mpjax._src.flax.defaults import DEFAULTS, Defaults
from mpjax._src.flax.fp8_linen import check_policy_fp8
from mpjax._src.flax.linen import apply_linen_policy
from mpjax._src.flax.nnx import apply_nnx_policy

__all__ = ["apply_policy"]


def apply_policy(
    module: Any,
    policy: Any,
    *,
    defaults: Defaults = DEFAULTS,
    fp8: Any = None,
    fp8_axis_name: Any = None,
) -> Any:
    """Runs a Flax model under per-module precision policies.

    `policy` is a `Policy`, a spec string, or a `{selector: policy}` mapping whose
    selectors are module classes (subclasses match), regexes `re.fullmatch`-ed against
    the module path as in the params tree (`"encoder/layers_3/attn"`, `"layers_0"` in a
    wrapped `nn.Sequential`; the root is `""`) or `"*"`. A module's
    own path rule beats its class rule, which beats its parent's policy; the root
    falls back to `"*"`. Then `defaults` keep normalisation layers, attention softmax
    and the final logits in float32 under low-precision compute (see `Defaults`).

    A policy's `output_dtype` applies at the boundary of the module(s) its rule selects:
    the wrapped model for a one-string policy or the `"*"` rule, each matching module for
    a class or path rule; a module that only inherits a policy returns its compute dtype
    (`autocast` means the same: `output_dtype` where values leave the function).

    Args:
      module: a `flax.linen.Module` (a `PolicyModule` with the same `init`/`apply` and
        variable tree is returned) or a `flax.nnx.Module` (changed in place and
        returned).
      policy: the policy or rule mapping.
      defaults: the default lists (`mpjax.DEFAULTS`; `mpjax.NO_DEFAULTS` for none).
      fp8: an `Fp8Recipe`; every linen `nn.Dense` / `nn.DenseGeneral`
        or NNX `nnx.Linear` / `nnx.LinearGeneral` the policy covers whose kernel is
        eligible (sizes multiples of 16, at least `min_dim`, no batch axes; not excluded
        by `exclude` patterns on `"Model/path"`) runs fp8 GEMMs. A stateless recipe
        (`"tensorwise"`, `"rowwise"`, `"mxfp8"`, `"nvfp4"`, `"blockwise"`) runs each call
        that `mpjax.fp8.fp8_eligible` takes through `mpjax.fp8.fp8_dot_general` (what
        `autocast(fp8=recipe)` does to the same GEMM) and adds no state. Delayed scaling
        keeps the state in the `"fp8_meta"` collection (see `mpjax.fp8.update_fp8_meta`);
        NNX in `mpjax.fp8.Fp8Meta` variables, created here (see
        `mpjax.fp8.update_nnx_fp8_meta`). `nn.Einsum` / `nnx.Einsum` stay in the compute
        dtype. A recipe that sets `high_precision_last`/`high_precision_first` above 0 is
        refused (module by module the last GEMMs are unknown); NVFP4's default rule is not
        applied here: `exclude=` the last layers by name instead.
      fp8_axis_name: the pmap/shard_map axis name the amaxes are reduced over (`pmax`),
        so every replica uses the same scale; under jit with sharded (global) arrays
        the amaxes are global already. Delayed scaling only.

    Returns:
      The policy-wrapped linen module, or the NNX model itself.

    Raises:
      TypeError: `module` is not a Flax module; a selector is not a module class of
        the same framework, a string, or `"*"`.
      ValueError: an invalid regex or policy spec, naming the selector; a path rule that
        matches no module, naming it and listing the module paths (NNX: here; linen: at the
        first `init`/`apply`, when the module tree is known); at call time,
        a module matched by two rules of the same kind, naming both; `fp8_axis_name`
        with a stateless recipe, an `fp8` recipe that sets `high_precision_last` or `_first`,
        or a Dense/Linear with its own `dot_general` that no `exclude` pattern excludes.

    Example:
      >>> import flax.linen as nn
      >>> from mpjax import apply_policy
      >>> model = apply_policy(nn.Dense(3), {"*": "p=f32,c=bf16", nn.LayerNorm: "f32"})
    """
    fp8_config = check_policy_fp8(fp8, fp8_axis_name)
    if isinstance(module, nn.Module):
        return apply_linen_policy(module, policy, defaults=defaults, fp8=fp8_config)
    if isinstance(module, nnx.Module):
        return apply_nnx_policy(module, policy, defaults=defaults, fp8=fp8_config)
    raise TypeError(
        "apply_policy expects a flax.linen.Module or a flax.nnx.Module, "
        f"got {type(module).__name__}"
    )
