"""Helpers that find `loss_scaled`'s state anywhere in an optimizer state tree."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from mpjax._src.scaling.config import default_max_consecutive_skips
from mpjax._src.scaling.diagnostics import TrainingDivergedError, diverged_message
from mpjax._src.scaling.loss_scale import NoOpLossScale
from mpjax._src.scaling.loss_scaled import LossScaledState
from mpjax._src.scaling.master import _is_masked, view
from mpjax._src.scaling.master_check import check_master
from mpjax._src.scaling.nnx_nodes import is_flax_nnx, loss_scaled_from_nnx
from mpjax._src.scaling.restored import old_state_message, restored_state_in
from mpjax._src.scaling.scopes import LOSS_SCALING_SCOPE

__all__ = [
    "find_loss_scaled_state",
    "get_loss_scale",
    "master_params",
    "raise_if_diverged",
    "scale_loss",
    "scaling_metrics",
]


def _unwrap(x: Any) -> Any:
    """The value of a flax.nnx Variable; anything else as it is."""
    if not is_flax_nnx(x):
        return x
    get_value = getattr(x, "get_value", None)
    if callable(get_value):
        return get_value()
    if hasattr(x, "value"):
        return x.value  # flax versions whose Variables have no get_value
    return x  # an nnx.State: a node


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
        restored = restored_state_in(opt_state)
        if restored is not None:
            raise ValueError(old_state_message("mpjax", restored[1], restored[0]))
        raise ValueError(
            "no mpjax.loss_scaled state found in this optimizer state "
            f"({type(opt_state).__name__}); build the optimizer with mpjax.loss_scaled(...)"
        )
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} mpjax.loss_scaled states found in this optimizer state; "
            "pass the sub-state of the one you mean"
        )
    _check_not_accumulated(opt_state)
    if found[0].layout_version is None:
        raise ValueError(old_state_message("mpjax", found[0]))
    state = jax.tree.map(_unwrap, found[0], is_leaf=lambda x: _unwrap(x) is not x)
    return loss_scaled_from_nnx(state)


def _check_not_accumulated(opt_state: Any) -> None:
    """Refuses a checked `loss_scaled` state inside `optax.MultiSteps`' inner state: optax
    resets its accumulator by multiplying with 0, so one overflowing micro-batch (0 * NaN)
    would skip every later window."""
    is_multi = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    for multi in jax.tree.leaves(opt_state, is_leaf=is_multi):
        if not is_multi(multi):
            continue
        inner = jax.tree.leaves(
            multi.inner_opt_state, is_leaf=lambda x: isinstance(x, LossScaledState)
        )
        if any(
            isinstance(x, LossScaledState) and not isinstance(x.loss_scale, NoOpLossScale)
            for x in inner
        ):
            raise ValueError(
                "mpjax.loss_scaled is inside optax.MultiSteps (optax.MultiSteps("
                "mpjax.loss_scaled(inner), k)): MultiSteps accumulates the scaled gradients "
                "unchecked and resets its accumulator by multiplying with 0, so one overflowing "
                "micro-batch (0 * NaN = NaN) skips every later step. Nest them the other way: "
                "mpjax.loss_scaled(optax.MultiSteps(inner, k)) checks each micro-batch"
            )


def get_loss_scale(opt_state: Any) -> jax.Array:
    """Returns the current loss scale held anywhere in `opt_state`, a float32 scalar array.

    Ready to log (`float(get_loss_scale(opt_state))`); the `LossScale` object itself (to
    call `.scale`/`.unscale`, or read a dynamic scale's counter) is
    `find_loss_scaled_state(opt_state).loss_scale`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from mpjax import get_loss_scale, loss_scaled
      >>> float(get_loss_scale(loss_scaled(optax.sgd(0.1)).init({"w": jnp.ones(2)})))
      32768.0
    """
    return find_loss_scaled_state(opt_state).loss_scale.loss_scale


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Multiplies `loss` by the current loss scale of `opt_state`, in float32.

    A Python number is scaled too (as a float32 array).

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from mpjax import loss_scaled, scale_loss
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = loss_scaled(optax.sgd(0.1)).init(params)  # scale 2**15
      >>> jax.grad(lambda p: scale_loss(jnp.sum(p["w"]), opt_state))(params)["w"]
      Array([32768., 32768.], dtype=float32)
    """
    with jax.named_scope(LOSS_SCALING_SCOPE):
        return find_loss_scaled_state(opt_state).loss_scale.scale(loss)


def scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Scalar arrays ready to log: `loss_scale`, `grads_finite`, `skipped`, `skipped_steps`,
    `consecutive_skips`.

    `skipped` says whether the last step was skipped for any reason (non-finite gradients,
    or a new float16 param value that would overflow); `grads_finite` only the first.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from mpjax import loss_scaled, scaling_metrics
      >>> sorted(scaling_metrics(loss_scaled(optax.sgd(0.1)).init({"w": jnp.ones(2)})))
      ['consecutive_skips', 'grads_finite', 'loss_scale', 'skipped', 'skipped_steps']
    """
    state = find_loss_scaled_state(opt_state)
    return {
        "loss_scale": state.loss_scale.loss_scale,
        "grads_finite": state.grads_finite,
        "skipped": state.skipped,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
    }


def raise_if_diverged(opt_state: Any, max_consecutive_skips: int | str | None = "auto") -> None:
    """Raises `TrainingDivergedError` if the run has had too many non-finite steps in a row.

    A host-side check, outside `jax.jit`: it reads one counter of the state (a
    device-to-host copy of a scalar), so the compiled step stays free of host callbacks.
    Call it where the training loop logs. Under pmap (a replicated state) the largest
    count over the replicas is checked. The limit is this function's own argument
    (`loss_scaled`'s `max_consecutive_skips` is the in-step raise).

    Args:
      opt_state: an optimizer state holding a `loss_scaled` state anywhere.
      max_consecutive_skips: the limit: an int, "auto" (default) for
        `default_max_consecutive_skips(loss_scale)` (49 for the default
        `DynamicLossScale`; no check for `NoOpLossScale`, which scales nothing), or None
        (no check: one loop can serve runs that skip by design).

    Raises:
      TrainingDivergedError: when `consecutive_skips >= max_consecutive_skips`.
      TypeError: when called on traced values (inside `jax.jit`).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import mpjax
      >>> params = {"w": jnp.ones(2)}
      >>> tx = mpjax.loss_scaled(optax.sgd(0.1), mpjax.StaticLossScale(1.0))
      >>> opt_state = tx.init(params)
      >>> for step in range(30):  # every step overflows
      ...     _, opt_state = tx.update({"w": jnp.full(2, jnp.inf)}, opt_state, params)
      ...     if step % 10 == 9:
      ...         mpjax.raise_if_diverged(opt_state)  # where the loop logs
      Traceback (most recent call last):
      ...
      TrainingDivergedError: ...
    """
    state = find_loss_scaled_state(opt_state)
    limit = max_consecutive_skips
    if limit is None or (limit == "auto" and isinstance(state.loss_scale, NoOpLossScale)):
        return
    if limit == "auto":
        limit = default_max_consecutive_skips(state.loss_scale)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(
            "raise_if_diverged: max_consecutive_skips must be an int >= 1, 'auto' or None, "
            f"got {limit!r}"
        )
    if isinstance(state.consecutive_skips, jax.core.Tracer):
        raise TypeError(
            "raise_if_diverged reads the state on the host: call it outside jax.jit "
            "(loss_scaled(..., max_consecutive_skips=N) raises inside the step instead)"
        )
    consecutive = int(np.max(np.asarray(state.consecutive_skips)))
    if consecutive >= limit:
        scale = float(np.min(np.asarray(state.loss_scale.loss_scale)))
        source = f"mpjax.raise_if_diverged(max_consecutive_skips={max_consecutive_skips!r})"
        floor = getattr(state.loss_scale, "min_scale", None)
        raise TrainingDivergedError(diverged_message(consecutive, limit, scale, source, floor))


def master_params(opt_state: Any, params: Any) -> Any:
    """The float32 master weights of `params`, whatever `loss_scaled`'s `master_weights` mode.

    The master where one is kept (rebuilt bit for bit from the bfloat16 param and its
    remainder with `master_weights="remainder"`), the param widened to float32 where not;
    non-floating leaves pass through. For evaluation in float32, export and tests.

    Args:
      opt_state: an optimizer state holding a `loss_scaled` state anywhere.
      params: the params that state belongs to (the ones `tx.update` was last given,
        updated).

    Returns:
      A pytree like `params`.

    Example:
      >>> import jax.numpy as jnp, optax, mpjax
      >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}
      >>> tx = mpjax.loss_scaled(optax.sgd(1e-3), master_weights="remainder")
      >>> mpjax.master_params(tx.init(params), params)["w"].dtype
      dtype('float32')
    """
    master = find_loss_scaled_state(opt_state).master
    check_master(params, master, None, "master_params")
    views = view(params, master)
    return jax.tree.map(lambda p, v: p if _is_masked(v) else v, params, views)
