"""The collectives of an optimized HLO module: op, dtype and bytes of each.

Every `all-gather`, `all-reduce`, `reduce-scatter`, `collective-permute` and `all-to-all`
instruction of every computation (asynchronous pairs count once, at their `-done`, whose
result is the collective's result). `bytes` is the size of the result on one device: the
gathered array of an all-gather, the reduced array of an all-reduce, the shard a
reduce-scatter leaves, the array a permute moves. A combined collective over a tuple of
arrays gives one record per dtype, with the bytes of that dtype's arrays.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from mpjax._src.analysis.collectives import collectives
  >>> text = jax.jit(lambda x: x * 2).trace(jnp.ones(4)).lower().compile().as_text()
  >>> collectives(text)
  ()
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from mpjax._src.analysis.hlo_cost import DTYPE_BYTES, op_name, parse_module

__all__ = ["COLLECTIVE_OPS", "Collective", "collectives"]

COLLECTIVE_OPS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)


class Collective(NamedTuple):
    """One collective of an HLO module (one per dtype of a combined collective)."""

    name: str  # the HLO instruction
    op: str  # one of COLLECTIVE_OPS
    dtype: str  # HLO dtype name ("f32", "bf16", ...)
    bytes: int  # of the result on one device
    op_name: str  # JAX's name stack from the metadata


def _op(opcode: str) -> str | None:
    """The collective an opcode completes (None for `-start` halves and other ops)."""
    if opcode.endswith("-start"):
        return None
    base = opcode.removesuffix("-done")
    return base if base in COLLECTIVE_OPS else None


def collectives(hlo_text: str) -> tuple[Collective, ...]:
    """Every collective of an HLO module, in program order.

    Args:
      hlo_text: `compiled.as_text()`.

    Returns:
      A tuple of `Collective`s.
    """
    comps, _ = parse_module(hlo_text)
    out = []
    for comp in comps.values():
        for instr in comp.values():
            op = _op(instr.opcode)
            if op is None:
                continue
            by_dtype: dict = defaultdict(int)
            for dtype, dims in instr.shapes:
                size = 1
                for d in dims:
                    size *= d
                by_dtype[dtype] += int(DTYPE_BYTES[dtype] * size)
            for dtype, nbytes in by_dtype.items():
                out.append(Collective(instr.name, op, dtype, nbytes, op_name(instr.attrs)))
    return tuple(out)
