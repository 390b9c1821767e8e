"""Helpers shared by the Pallas kernels: block sizes, Triton compiler parameters, masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pltriton

__all__ = [
    "FLOAT_DTYPES",
    "MAX_ELEMENTS",
    "compiler_params",
    "compute_dtype",
    "reciprocal",
    "next_pow2",
    "offsets",
]

# Floating dtypes the kernels take (the Triton backend supports all four).
FLOAT_DTYPES = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))

# Arrays at least this large are left to XLA: the kernels index with int32 offsets.
MAX_ELEMENTS = 2**31 - 1


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def compiler_params(num_warps: int = 4) -> pltriton.CompilerParams:
    """Triton compiler parameters; passing them selects the Triton backend of Pallas."""
    return pltriton.CompilerParams(num_warps=num_warps)


def compute_dtype(dtype) -> np.dtype:
    """float32 for half types, the dtype itself for float32/float64."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def offsets(block: int, axis: int, shape: tuple[int, ...], block_index) -> jax.Array:
    """Global indices along `axis` of the elements of a block of `shape`."""
    return block_index * block + jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def reciprocal(x: jax.Array, *, interpret: bool) -> jax.Array:
    """`1 / x` rounded to nearest, as XLA computes it.

    Triton lowers `/` on float32 to the approximate `div.full.f32`; on the GPU this uses the
    correctly rounded `rcp.rn` instruction instead.
    """
    if interpret:
        return 1 / x
    if x.dtype == jnp.float32:
        asm, constraints = "rcp.rn.f32 $0, $1;", "=r,r"
    elif x.dtype == jnp.float64:
        asm, constraints = "rcp.rn.f64 $0, $1;", "=l,l"
    else:
        raise TypeError(f"reciprocal: float32/float64 only, got {x.dtype}")
    [out] = pltriton.elementwise_inline_asm(
        asm,
        args=[x],
        constraints=constraints,
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
    )
    return out


# Channel-tiled kernels over an (R, C) view (R = N*H*W rows, C channels contiguous).
TILE_ELEMENTS = 4096  # elements per loaded tile (a power of two)
MAX_BLOCK_C = 256  # widest channel block
MAX_ROW_GROUPS = 512  # row groups of the reducing kernels: the partial sums are (groups, C)


def channel_tiles(rows: int, channels: int) -> tuple[int, int]:
    """Power-of-two tile `(block_rows, block_channels)` for an (R, C) channels-last view."""
    block_c = min(next_pow2(channels), MAX_BLOCK_C)
    block_r = min(next_pow2(rows), max(1, TILE_ELEMENTS // block_c))
    return block_r, block_c


def row_groups(rows: int, block_r: int) -> tuple[int, int]:
    """`(groups, steps)`: the row blocks split into `groups` programs of `steps` blocks each."""
    nblocks = -(-rows // block_r)
    steps = -(-nblocks // min(nblocks, MAX_ROW_GROUPS))
    return -(-nblocks // steps), steps


def check_channels_last(where: str, name: str, x, channels: int | None = None):
    """Checks that `x` is a floating array with a channel axis last; returns it as an array."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{where}: {name} must be floating, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{where}: {name} needs a channel axis, got shape {x.shape}")
    if channels is not None and x.shape[-1] != channels:
        raise ValueError(f"{where}: {name} has {x.shape[-1]} channels, expected {channels}")
    return x
