"""The collectives of an optimized (SPMD-partitioned, per-device) HLO module, with their bytes.

Every cross-device op of every computation (`while` bodies and branches counted once each) is
one record per array it moves: its op (`all-gather`, `all-reduce`, `reduce-scatter`,
`all-to-all`, `collective-permute`, `collective-broadcast`, `ragged-all-to-all`; the async
`-start` forms count as the op, their `-done` halves not at all), the array's dtype, shape and
the bytes of the buffer the ring cost is quoted on: the gathered result of an all-gather, the
unscattered operand of a reduce-scatter, the array of an all-reduce, all-to-all and permute.

Example:
  >>> from mpjax._src.analysis.collectives import collectives
  >>> hlo = '''ENTRY %main (p: f32[4]) -> f32[32] {
  ...   %p = f32[4]{0} parameter(0)
  ...   ROOT %ag = f32[32]{0} all-gather(%p), replica_groups={}, dimensions={0}
  ... }'''
  >>> [(c.op, c.dtype, c.shape, c.bytes) for c in collectives(hlo)]
  [('all-gather', 'f32', (32,), 128)]
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

from mpjax._src.analysis.hlo_cost import DTYPE_BYTES, op_name, parse_module

__all__ = ["COLLECTIVE_OPS", "RING_FACTORS", "Collective", "collectives", "comm_seconds", "summary"]

COLLECTIVE_OPS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)


def _ring_all_gather(n: int) -> float:
    return (n - 1) / n


def _ring_all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


# Bytes each device sends, as a fraction of the record's buffer, over a ring of n devices.
RING_FACTORS = {
    "all-gather": _ring_all_gather,
    "reduce-scatter": _ring_all_gather,
    "all-reduce": _ring_all_reduce,
    "all-to-all": _ring_all_gather,
    "ragged-all-to-all": _ring_all_gather,
    "collective-permute": lambda n: 1.0,
    "collective-broadcast": _ring_all_gather,
}


class Collective(NamedTuple):
    """One array moved by one collective op.

    Attributes:
      op: the collective's opcode without an async suffix, e.g. "all-gather".
      dtype: the HLO element type, e.g. "bf16".
      shape: the array's dimensions.
      bytes: the buffer size the ring cost is quoted on (see the module docstring).
      name: the HLO instruction's name.
      op_name: JAX's name stack from the instruction's metadata ("" if none).
    """

    op: str
    dtype: str
    shape: tuple
    bytes: int
    name: str = ""
    op_name: str = ""


def _op(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_OPS else None


def _arrays(op: str, opcode: str, instr, comp: dict) -> list:
    """(dtype, shape) of the buffers an instruction moves."""
    shapes = list(instr.shapes)
    if opcode.endswith("-start") and op in ("all-gather", "collective-permute"):
        # (operands..., results...) tuples: keep the results (the second half).
        shapes = shapes[len(shapes) // 2 :] if op == "all-gather" else shapes[:1]
    if op == "reduce-scatter":
        operands = [comp[o].shapes for o in instr.operands if o in comp]
        if operands:
            shapes = [s for ss in operands for s in ss]
    return shapes


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives of optimized HLO text, one record per array moved.

    Args:
      hlo_text: `compiled.as_text()` of an SPMD-partitioned program.

    Returns:
      A list of `Collective`, in the order of the text.
    """
    comps, _ = parse_module(hlo_text)
    out = []
    for comp in comps.values():
        for instr in comp.values():
            op = _op(instr.opcode)
            if op is None:
                continue
            for dtype, dims in _arrays(op, instr.opcode, instr, comp):
                nbytes = int(DTYPE_BYTES[dtype] * math.prod(dims))
                out.append(
                    Collective(op, dtype, tuple(dims), nbytes, instr.name, op_name(instr.attrs))
                )
    return out


def comm_seconds(records: list, n_devices: int, bytes_per_s: float) -> float:
    """Ring-algorithm communication time of `records` over `n_devices` at `bytes_per_s`.

    Args:
      records: `Collective` records (of one device's program).
      n_devices: the devices each collective spans.
      bytes_per_s: the per-device link bandwidth.

    Returns:
      Seconds, summed over records (no overlap with compute or between collectives).
    """
    if n_devices < 2:
        return 0.0
    sent = sum(r.bytes * RING_FACTORS[r.op](n_devices) for r in records)
    return sent / bytes_per_s


def summary(records: list) -> dict:
    """`{"op dtype": {"count": int, "bytes": int}}` of `records`, sorted by key."""
    acc: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for r in records:
        acc[f"{r.op} {r.dtype}"]["count"] += 1
        acc[f"{r.op} {r.dtype}"]["bytes"] += r.bytes
    return dict(sorted(acc.items()))
