"""What `numerics` says of delayed-fp8 state: each tensor's scale, amax history and headroom.

A delayed-fp8 site (`"fp8_meta"` collection of `apply_policy(..., fp8=Fp8Recipe(scaling=
"delayed"))`) holds `amax_history` `[3, L]` (rows: input x, kernel w, output gradient g;
newest in column 0) and `scale` `[3]`. The headroom of a tensor is `fp8_max / (amax * scale)`
with its newest amax: above 1 its values fit the fp8 format with that factor to spare, below 1
the largest ones saturated (x, w) or overflowed (g) at the last step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.fp8.quant import fp8_max
from mpjax._src.fp8.recipe import Fp8Recipe

__all__ = ["Fp8TensorMeta", "fp8_meta_records", "is_fp8_site"]

TENSORS = ("x", "w", "g")


@dataclasses.dataclass(frozen=True)
class Fp8TensorMeta:
    """The delayed-scaling state of one tensor of one fp8 GEMM site.

    Attributes:
      path: the site's path in the tree (`"fp8_meta/Dense_0"`).
      tensor: `"x"` (input), `"w"` (kernel) or `"g"` (output gradient).
      dtype: the fp8 format it is quantised to.
      scale: the stored scale (values are multiplied by it before the cast).
      amax_history: the recorded amaxes, newest first.
      headroom: `fp8_max(dtype) / (newest amax * scale)`; inf before any amax is recorded.
    """

    path: str
    tensor: str
    dtype: jnp.dtype
    scale: float
    amax_history: tuple
    headroom: float


def is_fp8_site(node: Any) -> bool:
    """Whether `node` is a delayed-fp8 site: `{"amax_history": [3, L], "scale": [3]}`."""
    if not isinstance(node, Mapping) or set(node) != {"amax_history", "scale"}:
        return False
    history, scale = node["amax_history"], node["scale"]
    return np.ndim(history) == 2 and np.shape(history)[0] == 3 and np.shape(scale) == (3,)


def _site_records(path: str, site: Mapping, recipe: Fp8Recipe) -> list[Fp8TensorMeta]:
    history = np.asarray(site["amax_history"], np.float64)
    scale = np.asarray(site["scale"], np.float64)
    dtypes = (recipe.forward_dtype, recipe.forward_dtype, recipe.backward_dtype)
    out = []
    for i, (tensor, dtype) in enumerate(zip(TENSORS, dtypes, strict=True)):
        newest = history[i, 0] * scale[i]
        headroom = float(fp8_max(dtype) / newest) if newest > 0 else float("inf")
        out.append(
            Fp8TensorMeta(
                path,
                tensor,
                jnp.dtype(dtype),
                float(scale[i]),
                tuple(float(a) for a in history[i]),
                headroom,
            )
        )
    return out


def fp8_meta_records(tree: Any, recipe: Fp8Recipe | None, key_name) -> tuple:
    """An `Fp8TensorMeta` per tensor of every delayed-fp8 site in `tree`."""
    recipe = recipe or Fp8Recipe(scaling="delayed")
    nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_fp8_site)
    out = []
    for keys, node in nodes:
        if is_fp8_site(node):
            out += _site_records("/".join(key_name(k) for k in keys), node, recipe)
    return tuple(out)
