"""The master weights of `loss_scaled`: kept in float32, as int16 remainders, or not at all.

A master leaf is `NoMaster()` (no master: the param itself, widened, is the master), a
float32 (or float64) array (the master), or, with `master_weights="remainder"`, a
`Remainder` node holding an int16 array: the low half of the float32 master of a bfloat16
param (see `remainder.py`). The two kinds that are not plain arrays are pytree nodes of
their own, so a checkpoint records which kind each leaf is: restoring a remainder into a
float32 master (or back) fails on the tree structure instead of casting int16 bits to
float32 numbers (see `mpjax/_src/flax/serialization.py` and `with_master_weights`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.core.dtypes import wide_dtype as _wide_dtype
from mpjax._src.scaling.remainder import join_master, split_master

__all__ = [
    "MASTER_MODES",
    "NoMaster",
    "Remainder",
    "init_master",
    "next_master",
    "rounded",
    "view",
]

MASTER_MODES = ("auto", True, False, "remainder")


@jax.tree_util.register_pytree_with_keys_class
class NoMaster:
    """The master leaf of a param that keeps none: a pytree node without children.

    It records (statically, in the tree definition) the dtype and shape of the param it
    was made for, so that params cast, promoted or reshaped after `init` are caught by name.

    Attributes:
      dtype: the param's dtype name, or None.
      shape: the param's shape, or None.
    """

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: str | None = None, shape: tuple[int, ...] | None = None):
        self.dtype, self.shape = dtype, shape

    def tree_flatten_with_keys(self):
        return (), (self.dtype, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        del children
        return cls(*aux)

    def __eq__(self, other):
        return isinstance(other, NoMaster) and (other.dtype, other.shape) == (
            self.dtype,
            self.shape,
        )

    def __hash__(self):
        return hash((NoMaster, self.dtype, self.shape))

    def __repr__(self):
        return f"NoMaster({self.dtype!r}, {self.shape!r})"


@jax.tree_util.register_pytree_with_keys_class
class Remainder:
    """The master of a bfloat16 param kept as the int16 low half of its float32 bits.

    Attributes:
      remainder: the int16 array (see `mpjax._src.scaling.remainder`).
    """

    __slots__ = ("remainder",)

    def __init__(self, remainder: Any):
        self.remainder = remainder

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("remainder"), self.remainder),), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)

    def __repr__(self):
        return f"Remainder({self.remainder!r})"


def _is_masked(x: Any) -> bool:
    """Whether a master leaf keeps no master (`optax.MaskedNode` was the old spelling)."""
    return isinstance(x, (NoMaster, optax.MaskedNode))


def _is_remainder(m: Any) -> bool:
    return isinstance(m, Remainder)


def _wide(x: jax.Array) -> jax.Array:
    wide = _wide_dtype(x.dtype)
    return x if x.dtype == wide else x.astype(wide)


def _keeps_master(p: Any, master_weights: bool | str) -> bool:
    if not _is_floating(p):
        return False
    if master_weights in ("auto", "remainder"):
        return jnp.dtype(p.dtype).itemsize < 4
    return bool(master_weights)


def init_master(p: Any, master_weights: bool | str) -> Any:
    """The master leaf of param `p`: a `Remainder`, a float32 copy, or `NoMaster()`."""
    if not _keeps_master(p, master_weights):
        if not hasattr(p, "dtype"):
            return NoMaster()
        return NoMaster(jnp.dtype(p.dtype).name, tuple(jnp.shape(p)))
    if master_weights == "remainder" and p.dtype == jnp.bfloat16:
        return Remainder(split_master(p.astype(jnp.float32))[1])  # zeros: a bf16 is exact
    # Copy, so that a master never aliases a float32 param buffer.
    return jnp.array(_wide(p), copy=True)


def view(params: Any, master: Any) -> Any:
    """The float32 view the inner optimizer works on; non-floating leaves are masked."""

    def one(p, m):
        if not _is_floating(p):
            return optax.MaskedNode()
        if _is_masked(m):
            return _wide(p)
        return join_master(p, m.remainder) if _is_remainder(m) else m

    return jax.tree.map(one, params, master)


def rounded(p: Any, m: Any, value: jax.Array) -> jax.Array:
    """A new wide value rounded to the param's dtype.

    A bfloat16 param with a float32 master, kept whole or as a remainder, is rounded by the
    remainder's rule (nearest, ties away from zero), so the two modes give the same params
    bit for bit, hence the same training. A NaN master keeps a NaN param (the remainder's
    split may carry a NaN's top half into a zero; its join restores the NaN master).
    Other params are rounded to nearest even.
    """
    if _is_remainder(m):
        return split_master(value)[0]
    cast = value.astype(p.dtype)
    if _is_masked(m) or p.dtype != jnp.bfloat16 or value.dtype != jnp.float32:
        return cast
    return jnp.where(jnp.isnan(value), cast, split_master(value)[0])


def next_master(ok: jax.Array, m: Any, value: jax.Array) -> Any:
    """The master leaf after a step: the new value where `ok`, else the old leaf."""
    if _is_masked(m):
        return m
    if _is_remainder(m):
        return Remainder(jnp.where(ok, split_master(value)[1], m.remainder))
    return jnp.where(ok, value, m)
