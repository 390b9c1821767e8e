"""Loss scales: `NoOpLossScale`, `StaticLossScale` and `DynamicLossScale`, and tree helpers.

Loss scales are immutable pytrees. Their numeric state (the current scale as a float32
scalar, the growth counter as int32) are the leaves; their configuration lives in the
tree definition, so it survives `jax.jit`, flatten/unflatten, `.lower()` and
checkpoint round-trips. Configuration is validated at construction only.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.core.dataclass import _replace, field, pytree_dataclass
from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.core.dtypes import unscale as _unscale
from mpjax._src.core.dtypes import wide_dtype as _wide_dtype
from mpjax._src.scaling.leaves import _check_flag, _map_floating, _widen_tree

__all__ = [
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
    "unscale_tree",
]


def _check_positive_finite(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    if value > float(np.finfo(np.float32).max):
        raise ValueError(f"{name}={value} does not fit in float32")
    if value < float(np.finfo(np.float32).tiny):
        raise ValueError(f"{name}={value} is denormal or underflows in float32")
    return value


def all_finite(tree: Any) -> jax.Array:
    """Returns a scalar bool array: whether every floating leaf of `tree` is finite.

    Python floats are checked too (`float("inf")` is not finite); non-floating leaves
    (ints, bools, float0) are ignored; an empty tree is finite.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import all_finite
      >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([jnp.inf])}))
      False
    """
    leaves = [
        jnp.asarray(x, jnp.float32) if isinstance(x, float) else x for x in jax.tree.leaves(tree)
    ]
    leaves = [x for x in leaves if _is_floating(x)]
    if not leaves:
        return jnp.array(True)
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves]
    return jnp.all(jnp.stack(flags))


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """Selects `on_true` where the scalar `pred` holds, else `on_false`, leaf by leaf.

    Args:
      pred: a scalar boolean (array).
      on_true: a pytree.
      on_false: a pytree of the same structure, shapes and dtypes.

    Returns:
      A pytree of that structure.
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(f"select_tree needs a scalar bool predicate, got {pred.dtype}{pred.shape}")
    t_struct, f_struct = jax.tree.structure(on_true), jax.tree.structure(on_false)
    if t_struct != f_struct:
        raise ValueError(f"select_tree: trees differ in structure: {t_struct} vs {f_struct}")

    def select(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(
                f"select_tree: leaves differ: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
            )
        return jax.lax.select(pred, a, b) if a.shape == () else jnp.where(pred, a, b)

    return jax.tree.map(select, on_true, on_false)


def unscale_tree(tree: Any, loss_scale: jax.Array) -> Any:
    """Divides every floating leaf (and Python number) by `loss_scale`, in at least float32.

    The division is a multiply by `1 / loss_scale` rounded once, as `torch.amp.GradScaler`'s
    and `mpjax.pallas.unscale_and_check`'s (exactly `g / loss_scale` for a power of two; see
    `mpjax._src.core.dtypes.unscale_factors`). Int and bool leaves pass through; complex and
    non-numeric leaves raise a TypeError naming the leaf.
    """
    loss_scale = jnp.asarray(loss_scale, jnp.float32)

    def unscale(g):
        wide = _wide_dtype(g.dtype)
        return _unscale(g.astype(wide), loss_scale.astype(wide))

    return _map_floating(unscale, tree, "unscale")


def _scale_tree(tree: Any, loss_scale: jax.Array) -> Any:
    def scale(x):
        wide = _wide_dtype(x.dtype)
        return x.astype(wide) * loss_scale.astype(wide)

    return _map_floating(scale, tree, "scale")


class LossScale:
    """Base class of the loss scales: `loss_scale`, `scale`, `unscale`, `adjust`."""

    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiplies the floating leaves of `tree` by the scale, in (at least) float32.

        Python numbers (and numbers in lists, tuples, dicts) are scaled too, as float32
        arrays; int and bool arrays pass through; complex or non-numeric leaves raise.
        """
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Any) -> Any:
        """Divides the floating leaves of `tree` by the scale, returning (at least) float32."""
        return unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> LossScale:
        """Returns the loss scale for the next step (`grads_finite`: a scalar bool)."""
        _check_flag(grads_finite)
        return self


def _scalar(value: Any, dtype) -> jax.Array:
    return jnp.asarray(value, dtype)


@pytree_dataclass
class NoOpLossScale(LossScale):
    """A loss scale that does not scale: `scale`/`unscale` only widen to float32.

    In `loss_scaled` it also turns the finite check off: the step is the inner step
    (for fp32 and bf16 training, whose range is float32's). `StaticLossScale(1.0)`
    scales by nothing and still skips non-finite steps.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import NoOpLossScale
      >>> NoOpLossScale().scale(jnp.float16(3.0)).dtype
      dtype('float32')
    """

    @property
    def loss_scale(self) -> jax.Array:
        """The scale, 1.0 as a float32 scalar (not a leaf: the tree has none)."""
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        """Widens the floating leaves of `tree` to (at least) float32; scales by nothing."""
        return _widen_tree(tree, "scale")

    def unscale(self, tree: Any) -> Any:
        """Widens the floating leaves of `tree` to (at least) float32; divides by nothing."""
        return _widen_tree(tree, "unscale")


@pytree_dataclass
class StaticLossScale(LossScale):
    """A fixed loss scale.

    Args:
      scale: the scale, a finite number > 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import StaticLossScale
      >>> StaticLossScale(128.0).unscale(jnp.float16(256.0))
      Array(2., dtype=float32)
    """

    loss_scale: jax.Array

    def __init__(self, scale: float = 2.0**15):
        _check_positive_finite("StaticLossScale: scale", scale)
        self._set(loss_scale=_scalar(scale, jnp.float32))

    def __repr__(self):
        return f"StaticLossScale({self.loss_scale!r})"


@pytree_dataclass
class DynamicLossScale(LossScale):
    """A loss scale that backs off on non-finite gradients and grows after finite runs.

    Semantics match `torch.amp.GradScaler` where the parameters coincide: on a
    non-finite step the scale is multiplied by `backoff_factor` (not below
    `min_scale`) and the counter resets; on a finite step the counter grows, and when
    it reaches `growth_interval` the scale is multiplied by `growth_factor` (not above
    `max_scale`, and never to inf) and the counter resets.

    Args:
      initial_scale: starting scale.
      growth_interval: finite steps between growths (>= 1).
      growth_factor: multiplier on growth (> 1).
      backoff_factor: multiplier on a non-finite step, in (0, 1).
      min_scale: lower bound of the scale (> 0).
      max_scale: upper bound of the scale, or None for no cap (growth still stops
        short of inf).

    Attributes:
      loss_scale: the current scale, a float32 scalar array.
      counter: finite steps since the last growth or backoff, an int32 scalar array.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import DynamicLossScale
      >>> ls = DynamicLossScale(initial_scale=2.0**4, growth_interval=1)
      >>> float(ls.adjust(jnp.array(True)).loss_scale)
      32.0
    """

    loss_scale: jax.Array
    counter: jax.Array
    growth_interval: int = field(static=True)
    growth_factor: float = field(static=True)
    backoff_factor: float = field(static=True)
    min_scale: float = field(static=True)
    max_scale: float | None = field(static=True)

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float | None = 2.0**24,
    ):
        initial_scale = _check_positive_finite("DynamicLossScale: initial_scale", initial_scale)
        min_scale = _check_positive_finite("DynamicLossScale: min_scale", min_scale)
        if max_scale is not None:
            max_scale = _check_positive_finite("DynamicLossScale: max_scale", max_scale)
            if max_scale < min_scale:
                raise ValueError(
                    f"DynamicLossScale: max_scale={max_scale} is below min_scale={min_scale}"
                )
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer)):
            raise TypeError(
                f"DynamicLossScale: growth_interval must be an int, "
                f"got {type(growth_interval).__name__}"
            )
        if not 1 <= int(growth_interval) <= np.iinfo(np.int32).max:
            raise ValueError(
                f"DynamicLossScale: growth_interval must be between 1 and 2**31 - 1 "
                f"(the growth counter is an int32), got {growth_interval}; a scale that "
                f"should never grow is StaticLossScale(scale)"
            )
        growth_factor = _check_positive_finite("DynamicLossScale: growth_factor", growth_factor)
        if np.float32(growth_factor) <= 1:  # the scale is computed in float32
            raise ValueError(
                f"DynamicLossScale: growth_factor must be > 1 in float32, got {growth_factor}"
            )
        backoff_factor = _check_positive_finite("DynamicLossScale: backoff_factor", backoff_factor)
        if not 0 < np.float32(backoff_factor) < 1:  # the scale is computed in float32
            raise ValueError(
                f"DynamicLossScale: backoff_factor must be in (0, 1), got {backoff_factor}"
            )
        if initial_scale < min_scale or (max_scale is not None and initial_scale > max_scale):
            raise ValueError(
                f"DynamicLossScale: initial_scale={initial_scale} is outside "
                f"[min_scale={min_scale}, max_scale={max_scale}]"
            )
        self._set(
            loss_scale=_scalar(initial_scale, jnp.float32),
            counter=_scalar(0, jnp.int32),
            growth_interval=int(growth_interval),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            min_scale=min_scale,
            max_scale=max_scale,
        )

    @property
    def config(self) -> tuple:
        """The static configuration, as a hashable tuple."""
        return (
            self.growth_interval,
            self.growth_factor,
            self.backoff_factor,
            self.min_scale,
            self.max_scale,
        )

    def replace(self, *, loss_scale: Any = None, counter: Any = None) -> DynamicLossScale:
        """Returns a copy with new numeric state and the same configuration."""
        if loss_scale is not None:
            loss_scale = jnp.asarray(loss_scale, jnp.float32)
        if counter is not None:
            counter = jnp.asarray(counter, jnp.int32)
        return _replace(
            self,
            loss_scale=self.loss_scale if loss_scale is None else loss_scale,
            counter=self.counter if counter is None else counter,
        )

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the scale after a step whose gradients were finite or not.

        Args:
          grads_finite: scalar bool array.

        Returns:
          A new `DynamicLossScale` with the same configuration.
        """
        grads_finite = _check_flag(grads_finite)
        scale = self.loss_scale.astype(jnp.float32)
        counter = self.counter.astype(jnp.int32)
        min_scale = jnp.float32(self.min_scale)

        grown_counter = counter + 1
        do_grow = grown_counter >= self.growth_interval
        grown = scale * jnp.float32(self.growth_factor)
        if self.max_scale is not None:
            grown = jnp.minimum(grown, jnp.float32(self.max_scale))
        # Growth never reaches inf: keep the current scale if it would overflow.
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        finite_scale = jnp.where(do_grow, grown, scale)
        finite_counter = jnp.where(do_grow, 0, grown_counter)

        backed_off = jnp.maximum(scale * jnp.float32(self.backoff_factor), min_scale)

        new_scale = jnp.where(grads_finite, finite_scale, backed_off)
        new_counter = jnp.where(grads_finite, finite_counter, 0).astype(jnp.int32)
        return self.replace(loss_scale=new_scale, counter=new_counter)
