"""NNX: keeping a `flax.nnx` model's variables (BatchNorm statistics) on a skipped step.

`snapshot_state` takes the values before the forward pass; `restore_if_skipped` puts them
back when `loss_scaled` skipped the step (the decision `keep_if_skipped` reads). This module
imports Flax, so it belongs to the Flax layer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flax import nnx

from mpjax.scaling.model_state import keep_if_skipped

__all__ = ["StateSnapshot", "restore_if_skipped", "snapshot_state"]


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
      >>> saved = mpjax.snapshot_state(model, nnx.BatchStat)
    """
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
      >>> saved = mpjax.snapshot_state(model, nnx.BatchStat)
      >>> grads = nnx.grad(loss_fn)(model, x, y)
      >>> optimizer.update(model, grads)
      >>> mpjax.restore_if_skipped(model, saved, optimizer.opt_state)
    """
    if not isinstance(saved, StateSnapshot):
        raise ValueError(
            "restore_if_skipped: `saved` must come from mpjax.snapshot_state(model, nnx.BatchStat)"
            f", got {type(saved).__name__} (nnx.state(...) holds live references, not values)"
        )
    live = nnx.state(model, saved.filter)
    kept = keep_if_skipped(nnx.to_pure_dict(live), saved.values, opt_state)
    nnx.replace_by_pure_dict(live, kept)
    nnx.update(model, live)
