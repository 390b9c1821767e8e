"""Moving a Flax `DynamicScale` state into `loss_scaled`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.scaling.loss_scale import DynamicLossScale, LossScale
from mpjax._src.scaling.loss_scaled import LossScaledState
from mpjax._src.scaling.master import (
    MASTER_MODES,
    Remainder,
    _wide,
    init_master,
    rounded,
)
from mpjax._src.scaling.master_check import master_kind
from mpjax._src.scaling.remainder import join_master, split_master

__all__ = ["loss_scale_from_flax", "with_loss_scale", "with_master_weights"]


def loss_scale_from_flax(dynamic_scale: Any) -> DynamicLossScale:
    """Returns the `DynamicLossScale` that continues a Flax `DynamicScale` exactly.

    Flax grows the scale when a finite step finds `fin_steps == growth_interval`, i.e.
    after `growth_interval + 1` finite steps in a row; mpjax grows after
    `growth_interval` of them. So the result has `growth_interval + 1`, the counter
    `fin_steps`, the current `scale`, the same factors and `minimum_scale` (float32's
    smallest normal number when Flax's is None), and no `max_scale` (Flax caps growth at
    float32's largest number; mpjax stops short of inf). From then on both follow the
    same scale sequence. Works under `jit` (the scale and counter may be arrays).

    Args:
      dynamic_scale: a `flax.training.dynamic_scale.DynamicScale`.

    Returns:
      A `DynamicLossScale`; pass it to `loss_scaled(inner, ...)` before `init`, or put it
      into an existing state with `with_loss_scale`.

    Example:
      >>> from flax.training.dynamic_scale import DynamicScale
      >>> from mpjax import loss_scale_from_flax
      >>> ls = loss_scale_from_flax(DynamicScale(growth_interval=100, scale=2.0**10))
      >>> float(ls.loss_scale), ls.growth_interval
      (1024.0, 101)
    """
    missing = [
        name
        for name in ("scale", "fin_steps", "growth_interval", "growth_factor", "backoff_factor")
        if not hasattr(dynamic_scale, name)
    ]
    if missing:
        raise TypeError(
            "loss_scale_from_flax: expected a flax.training.dynamic_scale.DynamicScale, "
            f"got {type(dynamic_scale).__name__} (lacks {missing})"
        )
    minimum = dynamic_scale.minimum_scale
    if minimum is None:
        minimum = float(np.finfo(np.float32).tiny)
    template = DynamicLossScale(
        initial_scale=float(minimum),
        growth_interval=int(dynamic_scale.growth_interval) + 1,
        growth_factor=float(dynamic_scale.growth_factor),
        backoff_factor=float(dynamic_scale.backoff_factor),
        min_scale=float(minimum),
        max_scale=None,
    )
    return template.replace(loss_scale=dynamic_scale.scale, counter=dynamic_scale.fin_steps)


def with_loss_scale(opt_state: Any, loss_scale: LossScale) -> Any:
    """Returns `opt_state` with the `loss_scaled` state's loss scale replaced.

    The one `LossScaledState` anywhere in `opt_state` (an `optax.chain` state, a
    `TrainState.opt_state`) gets `loss_scale`; everything else is kept. `loss_scaled`
    adjusts the scale held in its state, so the new scale's configuration takes over.

    Args:
      opt_state: an optimizer state holding one `LossScaledState`.
      loss_scale: the new `LossScale` (e.g. from `loss_scale_from_flax`).

    Returns:
      The new optimizer state.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from flax.training.dynamic_scale import DynamicScale
      >>> from mpjax import get_loss_scale, loss_scale_from_flax, loss_scaled, with_loss_scale
      >>> opt_state = loss_scaled(optax.adam(1e-3)).init({"w": jnp.ones(2)})
      >>> dynamic_scale = DynamicScale(scale=2.0**10)  # a Flax run's state
      >>> opt_state = with_loss_scale(opt_state, loss_scale_from_flax(dynamic_scale))
      >>> float(get_loss_scale(opt_state))
      1024.0
    """
    from mpjax._src.scaling.state_helpers import find_loss_scaled_state

    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            f"with_loss_scale: loss_scale must be an mpjax LossScale, got "
            f"{type(loss_scale).__name__}"
        )
    find_loss_scaled_state(opt_state)  # exactly one, or a clear error
    is_state = lambda x: isinstance(x, LossScaledState)  # noqa: E731
    return jax.tree.map(
        lambda x: x._replace(loss_scale=loss_scale) if is_state(x) else x,
        opt_state,
        is_leaf=is_state,
    )


def _master_value(p: Any, m: Any) -> jax.Array:
    """The float32 master a param and its master leaf (of any mode) stand for."""
    kind = master_kind(m)
    if kind == "none":
        return _wide(p)
    if kind in ("remainder", "old-remainder"):
        if isinstance(m, Remainder):
            rem = m.remainder
        else:
            rem = m["remainder"] if isinstance(m, dict) else m
        return join_master(p, jnp.asarray(rem, jnp.int16))
    if kind == "float":
        return jnp.asarray(m, _wide(p).dtype)
    raise ValueError(f"with_master_weights: {type(m).__name__} is not a master leaf")


def _convert_leaf(p: Any, m: Any, master_weights: bool | str) -> Any:
    if not _is_floating(p):
        return init_master(p, master_weights)
    value = _master_value(p, m)
    new = init_master(p, master_weights)
    if isinstance(new, Remainder):
        # Exact when the param is its master rounded (as every mode rounds it); a param
        # edited outside the optimizer is its own master again, as `init` would make it.
        fits = split_master(value)[0] == p
        return Remainder(jnp.where(fits, split_master(value)[1], new.remainder))
    if isinstance(new, jax.Array):
        fits = rounded(p, new, value) == p
        return jnp.where(fits, value, new)
    return new


def with_master_weights(opt_state: Any, params: Any, master_weights: bool | str) -> Any:
    """Returns `opt_state` with its `loss_scaled` master weights converted to another mode.

    For a checkpoint taken with one `master_weights` mode and resumed with another: restore
    it into a target built with the checkpoint's mode, then convert. Every conversion into
    "auto", True or "remainder" is exact (the float32 master is rebuilt bit for bit; a
    param without master is its own master); converting into False drops the masters.
    The inner optimizer's state is kept as it is (it was built on the float32 master
    either way).

    Args:
      opt_state: an optimizer state holding one `loss_scaled` state anywhere.
      params: the params that state belongs to.
      master_weights: the mode of the optimizer that will continue: "auto", True, False
        or "remainder".

    Returns:
      The converted optimizer state.

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}
      >>> state = mpjax.loss_scaled(optax.sgd(0.1), master_weights="remainder").init(params)
      >>> state = mpjax.with_master_weights(state, params, "auto")
      >>> tx = mpjax.loss_scaled(optax.sgd(0.1))  # "auto": float32 masters
      >>> updates, state = tx.update({"w": jnp.zeros((2,), jnp.bfloat16)}, state, params)
    """
    from mpjax._src.scaling.state_helpers import find_loss_scaled_state

    if master_weights not in MASTER_MODES:
        raise ValueError(
            "with_master_weights: master_weights must be 'auto', True, False or "
            f"'remainder', got {master_weights!r}"
        )
    master = find_loss_scaled_state(opt_state).master  # exactly one, or a clear error
    try:
        masters = jax.tree.structure(params).flatten_up_to(master)
    except (ValueError, TypeError):
        raise ValueError(
            "with_master_weights: params do not match the tree of the state's master "
            "weights; pass the params this state belongs to"
        ) from None
    leaves, treedef = jax.tree.flatten(params)
    new_master = treedef.unflatten(
        [_convert_leaf(p, m, master_weights) for p, m in zip(leaves, masters, strict=True)]
    )
    is_state = lambda x: isinstance(x, LossScaledState)  # noqa: E731
    return jax.tree.map(
        lambda x: x._replace(master=new_master) if is_state(x) else x,
        opt_state,
        is_leaf=is_state,
    )
