"""Keeping model state (BatchNorm statistics, counters) unchanged on a skipped step.

`loss_scaled` skips the parameter update of a step whose gradients are not finite, but the
model state the same forward pass returned (linen ``batch_stats``, NNX ``nnx.BatchStat``, a
Haiku/Equinox ``state``) is the caller's to commit. A forward overflow makes those statistics
inf/NaN; committed, they stay so for good. These helpers read the step's decision from the new
optimizer state and keep the old model state, bit for bit, when the step was skipped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mpjax._src.scaling.loss_scale import select_tree
from mpjax._src.scaling.state_helpers import find_loss_scaled_state

__all__ = ["StateSnapshot", "keep_if_skipped", "restore_if_skipped", "snapshot_state"]


def keep_if_skipped(new_state: Any, old_state: Any, opt_state: Any) -> Any:
    """Returns `new_state` if the step applied its update, else `old_state`, leaf by leaf.

    The decision is the `skipped` flag of the `loss_scaled` state in `opt_state` (the state
    `tx.update` just returned: non-finite gradients, or a new float16 param value that would
    overflow), so it is the same decision that skipped or applied the parameter update, already
    combined over `axis_name` under pmap/shard_map and global under jit with sharded inputs.
    One `select` per leaf, fused by XLA into the step.

    Args:
      new_state: the model state the step's forward pass returned (a pytree).
      old_state: the model state before the step (same structure, shapes and dtypes).
      opt_state: the optimizer state after `tx.update` (anything `find_loss_scaled_state`
        accepts: a `loss_scaled` state, a chain or `MultiSteps` of one, `TrainState.opt_state`,
        `nnx.Optimizer.opt_state`).

    Returns:
      A pytree like `new_state`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import mpjax
      >>> params = {"w": jnp.ones(2)}
      >>> tx = mpjax.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(params)
      >>> grads = {"w": jnp.array([1.0, jnp.inf])}  # an overflowed step: skipped
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> old, new = {"mean": jnp.zeros(2)}, {"mean": jnp.array([0.5, jnp.nan])}
      >>> mpjax.keep_if_skipped(new, old, opt_state)["mean"]
      Array([0., 0.], dtype=float32)
    """
    skipped = find_loss_scaled_state(opt_state).skipped
    return select_tree(skipped, old_state, new_state)


class StateSnapshot(NamedTuple):
    """The values of some of a `flax.nnx` model's variables, taken by `snapshot_state`.

    Attributes:
      filter: the `nnx` filter the values were taken with (e.g. `nnx.BatchStat`).
      values: a pure dict of arrays (`nnx.to_pure_dict` form); arrays are immutable, so later
        in-place updates of the model do not reach it.
    """

    filter: Any
    values: Any


def snapshot_state(model: Any, filter: Any) -> StateSnapshot:
    """NNX: the current values of `model`'s variables matching `filter`, for `restore_if_skipped`.

    In flax 0.12 `nnx.state(model, ...)` holds references to the live variables, which the
    forward pass then updates; this takes the values themselves.

    Args:
      model: a `flax.nnx` module.
      filter: an `nnx` filter, usually `nnx.BatchStat`.

    Returns:
      A `StateSnapshot`.

    Example:
      >>> from flax import nnx
      >>> import mpjax
      >>> model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
      >>> saved = mpjax.snapshot_state(model, nnx.BatchStat)
      >>> saved.values["mean"]
      Array([0., 0.], dtype=float32)
    """
    from flax import nnx

    return StateSnapshot(filter, nnx.to_pure_dict(nnx.state(model, filter)))


def restore_if_skipped(model: Any, saved: StateSnapshot, opt_state: Any) -> None:
    """NNX: puts the `saved` variable values back into `model`, in place, if the step was skipped.

    Take `saved = mpjax.snapshot_state(model, nnx.BatchStat)` before the forward pass and call
    this after `optimizer.update(model, grads)`, inside the same `nnx.jit` step.

    Args:
      model: the `flax.nnx` module the step ran (its variables were updated in place).
      saved: the `StateSnapshot` taken before the step.
      opt_state: `optimizer.opt_state` after `optimizer.update`.

    Returns:
      None; `model` is updated in place.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from flax import nnx
      >>> import mpjax
      >>> model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, mpjax.loss_scaled(optax.sgd(0.1)), wrt=nnx.Param)
      >>> x = jnp.array([[1.0, 2.0], [3.0, jnp.inf]])  # an overflowed activation
      >>> saved = mpjax.snapshot_state(model, nnx.BatchStat)
      >>> def loss_fn(model):
      ...     return mpjax.scale_loss(model(x).sum(), optimizer.opt_state)
      >>> grads = nnx.grad(loss_fn)(model)  # the forward pass wrote inf into model.mean
      >>> _ = optimizer.update(model, grads)  # non-finite gradients: the step is skipped
      >>> mpjax.restore_if_skipped(model, saved, optimizer.opt_state)
      >>> model.mean[...]
      Array([0., 0.], dtype=float32)
    """
    from flax import nnx

    if not isinstance(saved, StateSnapshot):
        raise ValueError(
            "restore_if_skipped: `saved` must come from mpjax.snapshot_state(model, nnx.BatchStat)"
            f", got {type(saved).__name__} (nnx.state(...) holds live references, not values)"
        )
    live = nnx.state(model, saved.filter)
    kept = keep_if_skipped(nnx.to_pure_dict(live), saved.values, opt_state)
    nnx.replace_by_pure_dict(live, kept)
    nnx.update(model, live)
