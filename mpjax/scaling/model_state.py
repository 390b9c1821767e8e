"""Keeping model state (BatchNorm statistics, counters) unchanged on a skipped step.

`loss_scaled` skips the parameter update of a step whose gradients are not finite, but the
model state the same forward pass returned (linen ``batch_stats``, NNX ``nnx.BatchStat``, a
Haiku/Equinox ``state``) is the caller's to commit. A forward overflow makes those statistics
inf/NaN; committed, they stay so for good. These helpers read the step's decision from the new
optimizer state and keep the old model state, bit for bit, when the step was skipped.
"""

from __future__ import annotations

from typing import Any

from mpjax.scaling.loss_scale import select_tree
from mpjax.scaling.state_helpers import find_loss_scaled_state

__all__ = ["keep_if_skipped"]

# The NNX helpers (`snapshot_state`, `restore_if_skipped`) import Flax and live in
# `mpjax/nnx_model_state.py`, bound for the Flax layer.


def keep_if_skipped(new_state: Any, old_state: Any, opt_state: Any) -> Any:
    """Returns `new_state` if the step applied its update, else `old_state`, leaf by leaf.

    The decision is the `grads_finite` flag of the `loss_scaled` state in `opt_state` (the state
    `tx.update` just returned), so it is the same decision that skipped or applied the
    parameter update, already combined over `axis_name` under pmap/shard_map and global under
    jit with sharded inputs. One `select` per leaf, fused by XLA into the step.

    Args:
      new_state: the model state the step's forward pass returned (a pytree).
      old_state: the model state before the step (same structure, shapes and dtypes).
      opt_state: the optimizer state after `tx.update` (anything `find_loss_scaled_state`
        accepts: a `loss_scaled` state, a chain or `MultiSteps` of one, `TrainState.opt_state`,
        `nnx.Optimizer.opt_state`).

    Returns:
      A pytree like `new_state`.

    Example:
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> batch_stats = mpjax.keep_if_skipped(new_batch_stats, batch_stats, opt_state)
    """
    grads_finite = find_loss_scaled_state(opt_state).grads_finite
    return select_tree(grads_finite, new_state, old_state)
