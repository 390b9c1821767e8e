"""Fp8 GEMMs for Flax NNX `Linear`/`LinearGeneral` under `apply_policy(fp8=...)`.

A stateless recipe (tensorwise, rowwise, `"mxfp8"`, `"nvfp4"`, `"blockwise"`) gives a covered
module with an eligible kernel a static record only; each call that `fp8_eligible` takes runs
through `mpjax.fp8.fp8_dot_general`. The rest of this note is about delayed scaling.

`apply_policy(model, policy, fp8=Fp8Recipe(scaling="delayed"))` gives every covered
`nnx.Linear` / `nnx.LinearGeneral` with an eligible kernel an attribute `fp8_meta`, an
`nnx.Dict` of two `Fp8Meta` variables: `amax_history` `[3, amax_history_len]` (rows: input
x, kernel w, output gradient g; newest first) and `scale` `[3]`, the layout of the linen
`"fp8_meta"` collection. `Fp8Meta` is its own `nnx.Variable` type, not an `nnx.Param`, so
`nnx.state(model, Fp8Meta)` / `nnx.split(model, nnx.Param, Fp8Meta, ...)` select it (to
checkpoint it), and `nnx.Optimizer(model, tx, wrt=nnx.Param)` never sees it.

How the amaxes get out of the step: the forward pass reads `scale` and quantises with it
(`delayed_fp8_dot_general`, a custom VJP); the step's amaxes `[x, w, g]` leave as the
cotangent of `scale`, because the output gradient's amax exists only inside the backward
pass, where nothing can be written to a Variable (a custom VJP has no side effects). So
differentiate with respect to the fp8 state too, `nnx.grad(loss, argnums=nnx.DiffState(0,
(nnx.Param, Fp8Meta)))`: the returned `grads` hold the params' gradients and the amaxes;
`optimizer.update(model, grads)` takes only the `wrt` entries, and `update_nnx_fp8_meta(model,
grads, recipe)` rolls the histories and writes the new scales into the model in place (the
math of `mpjax.fp8.update_fp8_meta`). This works the same under `nnx.jit` (in-place updates
propagate) and under `jax.jit` with `nnx.split` / `nnx.merge` (return `nnx.state(model)` or
`nnx.split(model)` from the step), under `pmap` with `fp8_axis_name`, and with
`mpjax.snapshot_state(model, Fp8Meta)` / `mpjax.restore_if_skipped`. (The input and kernel
amaxes could be written during the forward pass, the output gradient's cannot; taking all
three from the cotangent keeps the roll of each history in one place, once per step.)

Layers stacked by `nnx.vmap` (kernel `[layers, in, out]`, run under `nnx.scan`) get stacked
state, split by the transform along the layer axis like their kernel. Not covered:
`nnx.Einsum` (no `dot_general`; it stays in the compute dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flax import nnx
from mpjax._src.flax.fp8_linen import DelayedFp8
from mpjax._src.fp8.delayed import (
    delayed_site_dot,
    excluded_by_name,
    init_fp8_meta,
    kernel_eligible,
    update_fp8_meta,
)
from mpjax._src.fp8.dot import fp8_dot_general, fp8_eligible
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = [
    "NNX_DELAYED_MODULES",
    "Fp8Meta",
    "has_delayed_fp8",
    "nnx_delayed_override",
    "plan_nnx_fp8",
    "set_nnx_fp8",
    "update_nnx_fp8_meta",
]

# The NNX modules whose GEMM goes through a `dot_general` attribute, which delayed fp8
# replaces. `nnx.Einsum` calls `einsum_op` (no dot_general) and is not covered.
NNX_DELAYED_MODULES = (nnx.Linear, nnx.LinearGeneral)
META_ATTR = "fp8_meta"  # the nnx.Dict holding a module's Fp8Meta variables
_SITE_ATTR = "_mpjax_fp8"  # the static per-module record (config and site name)


class Fp8Meta(nnx.Variable):
    """NNX variable type of the delayed fp8 state (`amax_history` and `scale` of a GEMM).

    Not an `nnx.Param`: optimizers over `nnx.Param` leave it alone; filter it with
    `nnx.state(model, Fp8Meta)` to checkpoint it, and differentiate with respect to it
    (`nnx.DiffState(0, (nnx.Param, Fp8Meta))`) to collect the step's amaxes.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import mpjax
      >>> from mpjax.fp8 import Fp8Meta
      >>> recipe = mpjax.Fp8Recipe(scaling="delayed", amax_history_len=16)
      >>> model = mpjax.apply_policy(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), "c=bf16", fp8=recipe)
      >>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(model, Fp8Meta)))
      {'fp8_meta': {'amax_history': (3, 16), 'scale': (3,)}}
    """


@dataclasses.dataclass(frozen=True)
class _Fp8Record:
    """Static record on a covered module: its delayed-fp8 config, site name and the kernel's
    stacked leading shape (`()`, or `(layers,)` for layers made by `nnx.vmap`)."""

    config: DelayedFp8
    name: str
    stacked: tuple[int, ...] = ()


def has_delayed_fp8(module: nnx.Module) -> bool:
    """Whether `apply_policy(fp8=...)` runs this module's GEMM in fp8 (delayed scaling)."""
    return _SITE_ATTR in vars(module)


def _custom_dot(module: nnx.Module) -> bool:
    """Whether the module brings its own dot_general (Linear defaults to lax.dot_general)."""
    dot, cls = getattr(module, "dot_general", None), getattr(module, "dot_general_cls", None)
    return dot not in (None, lax.dot_general) or cls is not None


def _kernel_site(module: nnx.Module, name: str) -> tuple[Fp8Site, int]:
    """The module's GEMM as far as its kernel tells, and how many stacked leading axes the
    kernel has beyond the layer's own (layers made by `nnx.vmap` / `nnx.scan`)."""
    shape = tuple(module.kernel.shape)
    if isinstance(module, nnx.Linear):
        extra = len(shape) - 2
        return Fp8Site(name, (), shape[extra:], (((), (0,)), ((), ()))), extra
    n_batch = len(module.batch_axis)
    extra = len(shape) - n_batch - len(module.in_features) - len(module.out_features)
    contract = tuple(range(n_batch, n_batch + len(module.axis)))
    dims = (((), contract), (tuple(module.batch_axis), tuple(range(n_batch))))
    return Fp8Site(name, (), shape[extra:], dims), extra


def _is_ours(value: Any) -> bool:
    return isinstance(value, nnx.Dict) and all(
        isinstance(v, Fp8Meta) for v in (value.get("amax_history"), value.get("scale"))
    )


def _detach(module: nnx.Module) -> None:
    if _is_ours(vars(module).get(META_ATTR)):
        delattr(module, META_ATTR)
    if _SITE_ATTR in vars(module):
        delattr(module, _SITE_ATTR)


def plan_nnx_fp8(module: nnx.Module, name: str, config: DelayedFp8 | None) -> _Fp8Record | None:
    """Whether a module gets `Fp8Meta` state under `config` (its record), or None; no changes.

    A covered `Linear`/`LinearGeneral` whose kernel's contracting and output sizes are
    multiples of 16 and at least `recipe.min_dim`, without batch axes and not matched by
    `recipe.exclude` (patterns on `name`, e.g. `"Model/blocks/0/head"`), gets state;
    `recipe.exclude_if` sees the input's shape, so it is asked at call time (an excluded call
    runs in the compute dtype and records amax 0). Layers stacked by `nnx.vmap` (a kernel
    with leading layer axes, run under `nnx.scan` / `nnx.vmap`) are judged on one layer's
    kernel and get stacked state (`[layers, 3, L]`, `[layers, 3]`), which the transform
    must split along the layer axis like the kernel.

    Args:
      module: any NNX module (others than `NNX_DELAYED_MODULES` get nothing).
      name: the site name, `"<root class>/<path>"`.
      config: the delayed-fp8 configuration, or None (no state).

    Raises:
      ValueError: the module sets its own `dot_general`, or already has an unrelated
        attribute named `fp8_meta`.
    """
    if config is None or not isinstance(module, NNX_DELAYED_MODULES):
        return None
    site, stacked = _kernel_site(module, name)
    if excluded_by_name(config.recipe, name) or not kernel_eligible(config.recipe, site, False):
        return None
    if _custom_dot(module):
        raise ValueError(
            f"apply_policy(fp8=...): module {name!r} sets its own dot_general/dot_general_cls; "
            "exclude it with Fp8Recipe(exclude=...) or drop its custom dot_general"
        )
    existing = vars(module).get(META_ATTR)
    if existing is not None and not _is_ours(existing):
        raise ValueError(
            f"apply_policy(fp8=...): module {name!r} already has an attribute {META_ATTR!r}"
        )
    return _Fp8Record(config, name, tuple(module.kernel.shape)[:stacked])


def set_nnx_fp8(module: nnx.Module, record: _Fp8Record | None) -> None:
    """Gives `module` the `Fp8Meta` state of a `plan_nnx_fp8` record, or removes it (None).

    Existing state of the same shape is kept (re-applying a policy does not reset it).
    """
    if record is None:
        _detach(module)
        return
    if record.config.recipe.scaling != "delayed":  # stateless: the record only
        if _is_ours(vars(module).get(META_ATTR)):
            delattr(module, META_ATTR)
        setattr(module, _SITE_ATTR, record)
        return
    fresh = {
        k: jnp.broadcast_to(v, record.stacked + v.shape)
        for k, v in init_fp8_meta(record.config.recipe).items()
    }
    existing = vars(module).get(META_ATTR)
    if existing is None or any(
        np.shape(existing[k][...]) != fresh[k].shape for k in ("amax_history", "scale")
    ):
        setattr(module, META_ATTR, nnx.Dict({k: Fp8Meta(v) for k, v in fresh.items()}))
    setattr(module, _SITE_ATTR, record)


@contextlib.contextmanager
def nnx_delayed_override(module: nnx.Module):
    """For one call of a module with `Fp8Meta` state, sets its `dot_general` to the fp8 one.

    The GEMM runs in fp8 with the stored scales when `recipe.exclude_if` does not exclude the
    call and the activation's free size is a multiple of 16; else in the compute dtype.

    Raises:
      ValueError: the call passes `out_sharding` to an fp8 GEMM; the module got its own
        `dot_general` after `apply_policy`; a stacked layer's scale reaches the call
        unsplit (a scan that splits the params but not the `Fp8Meta`).
    """
    record = vars(module).get(_SITE_ATTR)
    if record is None:
        yield
        return
    if _custom_dot(module):
        raise ValueError(
            f"apply_policy(fp8=...): module {record.name!r} sets its own dot_general/"
            "dot_general_cls; exclude it with Fp8Recipe(exclude=...)"
        )
    recipe, axis_name = record.config.recipe, record.config.axis_name
    stateless = recipe.scaling != "delayed"

    def dot(lhs, rhs, dims, precision=None, preferred_element_type=None, out_sharding=None):
        site = Fp8Site(record.name, np.shape(lhs), np.shape(rhs), dims)
        if not kernel_eligible(recipe, site) or (stateless and not fp8_eligible(recipe, site)):
            return lax.dot_general(
                lhs, rhs, dims, precision, preferred_element_type, out_sharding=out_sharding
            )
        if out_sharding is not None:
            raise ValueError(
                f"apply_policy(fp8=...): module {record.name!r} was called with out_sharding, "
                "which the fp8 GEMM does not take; exclude it with Fp8Recipe(exclude=...)"
            )
        if stateless:
            return fp8_dot_general(lhs, rhs, dims, recipe, preferred_element_type or lhs.dtype)
        scale = getattr(module, META_ATTR)["scale"][...]
        if np.shape(scale) != (3,):
            raise ValueError(
                f"apply_policy(fp8=...): module {record.name!r} sees an fp8 scale of shape "
                f"{np.shape(scale)}, not (3,): run stacked layers under nnx.scan / nnx.vmap "
                "with their Fp8Meta split along the layer axis, as their nnx.Param"
            )
        return delayed_site_dot(
            lhs, rhs, dims, scale, recipe, axis_name, precision, preferred_element_type
        )

    saved = vars(module).get("dot_general")
    object.__setattr__(module, "dot_general", dot)
    try:
        yield
    finally:
        object.__setattr__(module, "dot_general", saved)


def _records(model: nnx.Module) -> list[tuple[str, _Fp8Record]]:
    out = []
    for _, node in nnx.iter_graph(model):
        record = vars(node).get(_SITE_ATTR) if isinstance(node, nnx.Module) else None
        if record is not None:
            out.append((record.name, record))
    return out


def update_nnx_fp8_meta(model: nnx.Module, grads: Any, recipe: Fp8Recipe) -> None:
    """NNX: rolls every `Fp8Meta` amax history of `model` by the step's amaxes, in place.

    The NNX counterpart of `mpjax.fp8.update_fp8_meta`, with the same rules: for each fp8
    GEMM the amaxes `[x, w, g]` that the gradient holds for its `scale` go into column 0 of
    `amax_history` (the oldest drops out); a NaN/inf amax is not recorded; the new scale is
    `fp8_max / reduced_amax / 2**margin` with `reduced_amax` the history's max
    (`amax_compute="max"`) or newest entry (`"most_recent"`); an amax of 0 keeps the
    previous scale. A module called twice in a step records the sum of its amaxes (an
    upper bound of their max). Call it inside the jitted step, after `nnx.grad`; under
    `loss_scaled`, take `saved = mpjax.snapshot_state(model, Fp8Meta)` before the forward
    pass and call `mpjax.restore_if_skipped(model, saved, optimizer.opt_state)` after this,
    so a skipped step leaves the state bit-identical.

    Args:
      model: the model `apply_policy(..., fp8=recipe)` was applied to; updated in place.
      grads: the `nnx.State` from `nnx.grad(loss, argnums=nnx.DiffState(0, (nnx.Param,
        Fp8Meta)))(model, ...)` (entries of other types are ignored), or the gradient of
        `nnx.split(model, Fp8Meta, ...)`'s `Fp8Meta` state under `jax.grad`.
      recipe: the `Fp8Recipe` the model was given.

    Returns:
      None; `model`'s `Fp8Meta` variables are updated.

    Raises:
      TypeError: `model` is not an NNX module.
      ValueError: `recipe` is not the model's delayed recipe; the model has no fp8 state;
        `grads` holds no `Fp8Meta` gradient or a different tree.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from flax import nnx
      >>> import mpjax
      >>> recipe = mpjax.Fp8Recipe(scaling="delayed", amax_history_len=4, min_dim=16)
      >>> model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
      >>> model = mpjax.apply_policy(model, "compute=bfloat16", fp8=recipe)
      >>> optimizer = nnx.Optimizer(model, mpjax.loss_scaled(optax.sgd(0.1)), wrt=nnx.Param)
      >>> x = jnp.full((16, 16), 2.0)
      >>> def loss_fn(model):
      ...     return mpjax.scale_loss(jnp.mean(model(x)), optimizer.opt_state)
      >>> diff = nnx.DiffState(0, (nnx.Param, mpjax.fp8.Fp8Meta))
      >>> grads = nnx.grad(loss_fn, argnums=diff)(model)
      >>> _ = optimizer.update(model, grads)  # takes the nnx.Param entries only
      >>> mpjax.fp8.update_nnx_fp8_meta(model, grads, recipe)
      >>> model.fp8_meta["scale"][0]  # the input's: 448 / amax 2
      Array(224., dtype=float32)
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"update_nnx_fp8_meta: expected an NNX module, got {type(model).__name__}")
    if not isinstance(recipe, Fp8Recipe) or recipe.scaling != "delayed":
        raise ValueError(
            f"update_nnx_fp8_meta: needs an Fp8Recipe(scaling='delayed'), got {recipe!r}"
        )
    records = _records(model)
    if not records:
        raise ValueError(
            "update_nnx_fp8_meta: the model has no fp8 state; apply "
            "mpjax.apply_policy(model, policy, fp8=Fp8Recipe(scaling='delayed')) first"
        )
    for name, record in records:
        if record.config.recipe != recipe:
            raise ValueError(
                f"update_nnx_fp8_meta: module {name!r} runs with {record.config.recipe!r}, "
                f"not the given {recipe!r}"
            )
    meta = nnx.state(model, Fp8Meta)
    meta_grads = nnx.state(grads, Fp8Meta) if isinstance(grads, nnx.State) else None
    if meta_grads is None or not jax.tree.leaves(meta_grads):
        raise ValueError(
            "update_nnx_fp8_meta: grads hold no Fp8Meta gradient (the amaxes); differentiate "
            "with nnx.grad(loss, argnums=nnx.DiffState(0, (nnx.Param, mpjax.fp8.Fp8Meta)))"
        )
    new = update_fp8_meta(nnx.to_pure_dict(meta), nnx.to_pure_dict(meta_grads), recipe)
    nnx.replace_by_pure_dict(meta, new)
    nnx.update(model, meta)
