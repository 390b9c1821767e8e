"""Helpers that find `loss_scaled`'s state anywhere in an optimizer state tree."""

from __future__ import annotations

from typing import Any

import jax

from mpjax.scaling.loss_scaled import LossScaledState

__all__ = ["find_loss_scaled_state", "get_loss_scale", "scale_loss", "scaling_metrics"]


def _unwrap(x: Any) -> Any:
    """Unwraps flax.nnx Variables (nnx.Optimizer stores opt_state leaves in them)."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return x
    if isinstance(x, nnx.Variable):
        return x.get_value() if hasattr(x, "get_value") else x.value
    return x


def find_loss_scaled_state(opt_state: Any) -> LossScaledState:
    """Finds the one `LossScaledState` anywhere in an optimizer state tree.

    Works through `optax.chain`, `optax.MultiSteps`, flax `TrainState.opt_state` and
    `flax.nnx.Optimizer.opt_state`.

    Raises:
      ValueError: if there is none, or more than one.
    """
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, LossScaledState))
        if isinstance(x, LossScaledState)
    ]
    if not found:
        raise ValueError(
            "no mpjax.loss_scaled state found in this optimizer state "
            f"({type(opt_state).__name__}); build the optimizer with mpjax.loss_scaled(...)"
        )
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} mpjax.loss_scaled states found in this optimizer state; "
            "pass the sub-state of the one you mean"
        )
    return jax.tree.map(_unwrap, found[0], is_leaf=lambda x: _unwrap(x) is not x)


def get_loss_scale(opt_state: Any) -> jax.Array:
    """Returns the current loss scale held anywhere in `opt_state`, a float32 scalar array.

    Ready to log (`float(get_loss_scale(opt_state))`); the `LossScale` object itself (to
    call `.scale`/`.unscale`, or read a dynamic scale's counter) is
    `find_loss_scaled_state(opt_state).loss_scale`.

    Example:
      >>> float(get_loss_scale(loss_scaled(optax.sgd(0.1)).init({"w": jnp.ones(2)})))
      32768.0
    """
    return find_loss_scaled_state(opt_state).loss_scale.loss_scale


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Multiplies `loss` by the current loss scale of `opt_state`, in float32.

    A Python number is scaled too (as a float32 array).

    Example:
      >>> grads = jax.grad(lambda p: scale_loss(loss_fn(p), opt_state))(params)
    """
    return find_loss_scaled_state(opt_state).loss_scale.scale(loss)


def scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Scalar arrays ready to log: `loss_scale`, `grads_finite`, `skipped_steps`,
    `consecutive_skips`."""
    state = find_loss_scaled_state(opt_state)
    return {
        "loss_scale": state.loss_scale.loss_scale,
        "grads_finite": state.grads_finite,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
    }
