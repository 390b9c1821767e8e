"""Diagnostics: which leaves of a gradient tree hold inf/NaN, usable inside `jax.jit`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.core.dtypes import is_floating as _is_floating

__all__ = ["NonfiniteReport", "nonfinite_report", "TrainingDivergedError"]


class TrainingDivergedError(RuntimeError):
    """Raised when a run has had too many non-finite (skipped) steps in a row.

    `mpjax.raise_if_diverged(opt_state)` raises it on the host. With
    `loss_scaled(..., max_consecutive_skips=N)` it is raised from inside the compiled step
    and reaches Python as a `jax.errors.JaxRuntimeError` (a `RuntimeError`) whose message
    starts with this class's name: catch `RuntimeError`.
    """


def diverged_message(
    consecutive: int, limit: int, loss_scale: float, source: str, min_scale: float | None = None
) -> str:
    """The `TrainingDivergedError` message: who checked, the skips in a row, limit, scale.

    `min_scale`: the dynamic scale's floor; when the scale sits on it, the message says
    that scaling can do no more and how to let it go lower.
    """
    msg = (
        f"TrainingDivergedError: {source} saw {consecutive} non-finite steps in a row "
        f"(max_consecutive_skips={limit}; loss scale {loss_scale:g}). "
    )
    if min_scale is not None and loss_scale <= min_scale:
        return msg + (
            f"The scale sits at its floor, min_scale={min_scale:g}: the gradients overflow "
            "even at that scale. Let it go lower (DynamicLossScale(min_scale=2.0**-14)), "
            "compute the overflowing layer in float32 (find it with "
            "mpjax.scaling.nonfinite_report(grads), then a policy rule), or train in "
            "bfloat16 (float32's range); NaN gradients mean a broken loss or input, which "
            "no scale fixes."
        )
    return msg + (
        "The model produces inf/NaN gradients at every scale: check the loss and the "
        "inputs, or find the overflowing layer with mpjax.scaling.nonfinite_report(grads)."
    )


@jax.tree_util.register_pytree_with_keys_class
class NonfiniteReport:
    """Per-leaf counts of NaN and inf values in a pytree; a pytree itself, so jit can return it.

    Attributes:
      paths: the leaf paths (static), in tree-flatten order, floating leaves only.
      nan_counts: int32 array, NaNs per leaf.
      inf_counts: int32 array, infs per leaf.
    """

    def __init__(self, paths: tuple[str, ...], nan_counts: jax.Array, inf_counts: jax.Array):
        self.paths = tuple(paths)
        self.nan_counts = nan_counts
        self.inf_counts = inf_counts

    def tree_flatten_with_keys(self):
        children = (
            (jax.tree_util.GetAttrKey("nan_counts"), self.nan_counts),
            (jax.tree_util.GetAttrKey("inf_counts"), self.inf_counts),
        )
        return children, self.paths

    @classmethod
    def tree_unflatten(cls, paths, children):
        obj = object.__new__(cls)
        obj.paths = paths
        obj.nan_counts, obj.inf_counts = children
        return obj

    @property
    def any_nonfinite(self) -> jax.Array:
        """Scalar bool: whether any leaf holds a NaN or an inf."""
        if not self.paths:
            return jnp.array(False)
        return jnp.any((self.nan_counts + self.inf_counts) > 0)

    def offenders(self) -> dict[str, tuple[int, int]]:
        """Outside jit: `{path: (nan_count, inf_count)}` for each leaf that holds any."""
        nans = np.asarray(self.nan_counts).reshape(-1)
        infs = np.asarray(self.inf_counts).reshape(-1)
        return {
            p: (int(n), int(i)) for p, n, i in zip(self.paths, nans, infs, strict=True) if n or i
        }

    def __str__(self) -> str:
        bad = self.offenders()
        if not bad:
            return f"NonfiniteReport: all {len(self.paths)} floating leaves finite"
        lines = [f"NonfiniteReport: {len(bad)} of {len(self.paths)} leaves hold inf/NaN"]
        lines += [f"  {p}: {n} NaN, {i} inf" for p, (n, i) in bad.items()]
        return "\n".join(lines)

    __repr__ = __str__


def nonfinite_report(tree: Any) -> NonfiniteReport:
    """Counts NaNs and infs in each floating leaf of `tree`, by path.

    Usable inside `jax.jit` (the counts are arrays); print it, or call `.offenders()`,
    outside to find the layer that overflows.

    Args:
      tree: a pytree, e.g. gradients.

    Returns:
      A `NonfiniteReport`.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from mpjax import nonfinite_report
      >>> report = jax.jit(nonfinite_report)({"a": jnp.ones(2), "b": jnp.array([jnp.inf])})
      >>> report.offenders()
      {"['b']": (0, 1)}
    """
    paths, nans, infs = [], [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_floating(leaf):
            continue
        paths.append(jax.tree_util.keystr(path))
        nans.append(jnp.sum(jnp.isnan(leaf), dtype=jnp.int32))
        infs.append(jnp.sum(jnp.isinf(leaf), dtype=jnp.int32))
    if not paths:
        empty = jnp.zeros((0,), jnp.int32)
        return NonfiniteReport((), empty, empty)
    return NonfiniteReport(tuple(paths), jnp.stack(nans), jnp.stack(infs))


def raise_in_step_if_diverged(
    consecutive: jax.Array, scale: jax.Array, limit: int, min_scale: float | None = None
) -> None:
    """Raises `TrainingDivergedError` from a traced step once `consecutive >= limit`.

    Through a host callback, which takes the step off JAX's C++ dispatch path.
    """

    def fail(n, s):
        # Under vmap, lax.cond becomes a select and this runs on every step: check again.
        n, s = np.asarray(n), np.asarray(s)
        if not np.any(n >= limit):
            return
        raise TrainingDivergedError(
            diverged_message(
                int(np.max(n)), limit, float(np.min(s)), "mpjax.loss_scaled", min_scale
            )
        )

    jax.lax.cond(
        consecutive >= limit,
        lambda: jax.debug.callback(fail, consecutive, scale),
        lambda: None,
    )
