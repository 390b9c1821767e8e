"""The collectives of an optimized (SPMD-partitioned, per-device) HLO module, with their bytes.

Every cross-device op of every computation (`while` bodies and branches counted once each;
`loop_collectives` lists those inside loops with their trip counts) is one record per array
it moves: its op (`all-gather`, `all-reduce`, `reduce-scatter`,
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
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from mpjax._src.analysis.hlo_cost import DTYPE_BYTES, op_name, parse_module
from mpjax._src.analysis.hlo_text import attr

__all__ = [
    "COLLECTIVE_OPS",
    "RING_FACTORS",
    "Collective",
    "collectives",
    "comm_seconds",
    "link_bytes",
    "link_seconds",
    "loop_collectives",
    "replica_groups",
    "summary",
]

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
      groups: the device groups it runs over (device ids of the program's device
        assignment; a collective-permute's (source, target) pairs); () means all devices
        (or a form `replica_groups` does not read).
    """

    op: str
    dtype: str
    shape: tuple
    bytes: int
    name: str = ""
    op_name: str = ""
    groups: tuple = ()


def _op(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_OPS else None


def _arrays(op: str, opcode: str, instr, comp: dict) -> list:
    """(dtype, shape) of the buffers an instruction moves."""
    shapes = list(instr.shapes)
    if opcode.endswith("-start") and op in ("all-gather", "collective-permute"):
        # (operands..., results...) tuples: keep the results (the second half).
        shapes = shapes[len(shapes) // 2 :] if op == "all-gather" else shapes[:1]
    if opcode == "all-reduce-start" and len(shapes) == 2 * len(instr.operands):
        # jaxlib >= 0.12 writes ((operands...), results...) where 0.10 wrote the results only
        shapes = shapes[len(shapes) // 2 :]
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
    return [r for comp in comps.values() for instr in comp.values() for r in _moved(instr, comp)]


def _moved(instr, comp: dict) -> list[Collective]:
    """The records of one instruction (none if it is not a collective)."""
    op = _op(instr.opcode)
    if op is None:
        return []
    groups = replica_groups(instr.attrs)
    name = op_name(instr.attrs)
    return [
        Collective(op, dtype, tuple(dims), int(DTYPE_BYTES[dtype] * math.prod(dims)),
                   instr.name, name, groups)
        for dtype, dims in _arrays(op, instr.opcode, instr, comp)
    ]  # fmt: skip


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = ("to_apply", "calls", "body", "condition", "true_computation", "false_computation")


def loop_collectives(hlo_text: str) -> list[tuple[Collective, int]]:
    """The collectives that run inside `while` loops, each with its runs per program run.

    `collectives` (and the ring estimates) count a loop body's collective once; here it
    comes with the product of the known trip counts of the loops around it (a loop of
    unknown trip count counts 1). A loop-invariant array gathered in a loop body is
    gathered once per trip.

    Args:
      hlo_text: `compiled.as_text()` of an SPMD-partitioned program.

    Returns:
      `(Collective, runs)` pairs, for the computations reached from the entry through
      `while`, `call` and `conditional` (each computation once per path).

    Example:
      >>> from mpjax._src.analysis.collectives import loop_collectives
      >>> trips = '"known_trip_count":{"n":"16"}'
      >>> hlo = f'''%body (p: f32[4]) -> f32[4] {{
      ...   %p = f32[4]{{0}} parameter(0)
      ...   %ag = f32[32]{{0}} all-gather(%p), replica_groups={{}}, dimensions={{0}}
      ...   ROOT %s = f32[4]{{0}} slice(%ag), slice={{[0:4]}}
      ... }}
      ... %cond (c: f32[4]) -> pred[] {{
      ...   %c = f32[4]{{0}} parameter(0)
      ...   ROOT %t = pred[] constant(true)
      ... }}
      ... ENTRY %main (x: f32[4]) -> f32[4] {{
      ...   %x = f32[4]{{0}} parameter(0)
      ...   ROOT %w = f32[4]{{0}} while(%x), condition=%cond, body=%body, backend_config={{{trips}}}
      ... }}'''
      >>> [(c.op, c.shape, runs) for c, runs in loop_collectives(hlo)]
      [('all-gather', (32,), 16)]
    """
    comps, entry = parse_module(hlo_text)
    out: list[tuple[Collective, int]] = []

    def visit(name: str, runs: int, looped: bool, path: tuple) -> None:
        comp = comps.get(name)
        if comp is None or name in path:
            return
        for instr in comp.values():
            if looped:
                out.extend((r, runs) for r in _moved(instr, comp))
            inner, loop = runs, looped
            if instr.opcode == "while":
                trips = _TRIP_COUNT.search(instr.attrs)
                inner, loop = runs * (int(trips.group(1)) if trips else 1), True
            elif instr.opcode not in ("call", "conditional"):
                continue
            called = [attr(instr.attrs, key) for key in _CALLED]
            branches = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
            called += re.findall(r"%?([\w.\-]+)", branches.group(1) if branches else "")
            for target in filter(None, called):
                visit(target.lstrip("%"), inner, loop, (*path, name))

    visit(entry, 1, False, ())
    return out


def comm_seconds(records: list, n_devices: int, bytes_per_s: float) -> float:
    """Ring-algorithm communication time of `records` over `n_devices` at `bytes_per_s`.

    Args:
      records: `Collective` records (of one device's program).
      n_devices: the devices a collective without `groups` spans (a record with groups
        spans its group's size).
      bytes_per_s: the per-device link bandwidth.

    Returns:
      Seconds, summed over records (no overlap with compute or between collectives).
    """
    if n_devices < 2:
        return 0.0
    sent = 0.0
    for r in records:
        n = _group_size(r, n_devices)
        sent += r.bytes * RING_FACTORS[r.op](n) if n > 1 else 0.0
    return sent / bytes_per_s


def summary(records: list) -> dict:
    """`{"op dtype": {"count": int, "bytes": int}}` of `records`, sorted by key."""
    acc: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for r in records:
        acc[f"{r.op} {r.dtype}"]["count"] += 1
        acc[f"{r.op} {r.dtype}"]["bytes"] += r.bytes
    return dict(sorted(acc.items()))


_IOTA = re.compile(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH_AXIS = re.compile(r"'([^']+)'=([0-9]+)")
_DEVICE_IDS = re.compile(r"\((?:\[[0-9,]+\]<=)?\[([0-9,]+)\](?:T\(([0-9,]+)\))?\)")
_SUB_AXIS = re.compile(r"'([^']+)'(?::\(([0-9]+)\)([0-9]+))?")


def _ints(text: str) -> list:
    return [int(t) for t in text.split(",") if t.strip()]


def _iota(shape: str, dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `[shape]<=[dims]T(perm)`: iota reshaped, transposed, reshaped."""
    ids = np.arange(math.prod(_ints(dims))).reshape(_ints(dims))
    if perm:
        ids = ids.transpose(_ints(perm))
    return ids.reshape(_ints(shape))


def _balanced_end(text: str, start: int) -> int:
    """The index after the bracket that closes the one at `start`."""
    depth, pairs = 0, {"(": ")", "[": "]", "{": "}"}
    opening = text[start]
    for i in range(start, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _mesh_groups(text: str) -> tuple:
    """`mesh['a'=4,'b'=2], device_ids=(<iota>) {'a'}`: the groups varying the named axes."""
    end = _balanced_end(text, 4)
    axes = [(n, int(k)) for n, k in _MESH_AXIS.findall(text[5 : end - 1])]
    rest = text[end:]
    ids = np.arange(math.prod(k for _, k in axes))
    if rest.startswith(", device_ids=("):
        inner = rest[len(", device_ids=") : _balanced_end(rest, len(", device_ids="))]
        m = _DEVICE_IDS.fullmatch(inner)
        if m is None:
            return ()
        ids = _iota(str(ids.size), *m.groups()).reshape(-1)
        rest = rest[len(", device_ids=") + len(inner) :]
    brace = rest.find("{")
    if brace < 0:
        return ()
    # Split sub-axes ('a':(pre)size) into their own mesh dimensions, then keep the named ones.
    shape, names = [], []
    wanted = _SUB_AXIS.findall(rest[brace : _balanced_end(rest, brace)])
    for name, size in axes:
        subs = [(int(p), int(k)) for n, p, k in wanted if n == name and p]
        if not subs:
            shape.append(size)
            names.append(name if (name, "", "") in wanted else None)
            continue
        pre, sub = subs[0]
        shape += [pre, sub, size // (pre * sub)]
        names += [None, name, None]
    grid = ids.reshape(shape)
    keep = [i for i, n in enumerate(names) if n is not None]
    other = [i for i, n in enumerate(names) if n is None]
    grid = grid.transpose(other + keep).reshape(-1, math.prod(shape[i] for i in keep))
    return tuple(tuple(int(d) for d in g) for g in grid)


def replica_groups(attrs: str) -> tuple:
    """The device groups of one collective instruction's attributes, () if all or unknown.

    Reads the explicit (`{{0,1},{2,3}}`), iota (`[2,4]<=[4,2]T(1,0)`) and mesh-axes
    (`mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`) forms of `replica_groups`, and a
    collective-permute's `source_target_pairs` (one group per pair).

    Args:
      attrs: the instruction's text after its operands.

    Returns:
      A tuple of groups, each a tuple of device ids.

    Example:
      >>> from mpjax._src.analysis.collectives import replica_groups
      >>> replica_groups("channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}")
      ((0, 1, 2, 3), (4, 5, 6, 7))
    """
    for key in ("source_target_pairs=", "replica_groups="):
        i = attrs.find(key)
        if i < 0:
            continue
        text = attrs[i + len(key) :]
        if text.startswith("{"):
            inner = text[1 : _balanced_end(text, 0) - 1]
            return tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", inner))
        if text.startswith("mesh["):
            return _mesh_groups(text)
        m = _IOTA.match(text)
        if m:
            return tuple(tuple(int(d) for d in g) for g in _iota(*m.groups()))
        return ()
    return ()


def _spans_hosts(record: Collective, hosts: Sequence[int]) -> bool:
    groups = record.groups or (tuple(range(len(hosts))),)
    return any(len({hosts[d] for d in g}) > 1 for g in groups)


def _group_size(record: Collective, n_devices: int) -> int:
    if record.op == "collective-permute":
        return 2
    return len(record.groups[0]) if record.groups and record.groups[0] else n_devices


def link_bytes(records: list, hosts: Sequence[int]) -> dict:
    """Bytes each device sends per collective ring, split by the link the ring is limited by.

    A collective whose group holds devices of two hosts runs a ring across the hosts: the
    inter-host link is its bottleneck ("inter"); a group within one host runs on NVLink
    ("intra"). Each record sends its ring factor (for its group's size) times its bytes.

    Args:
      records: `Collective` records of one device's program, with their `groups`.
      hosts: the host of each device id (the program's device assignment order).

    Returns:
      `{"intra": bytes, "inter": bytes}`.

    Example:
      >>> from mpjax._src.analysis.collectives import Collective, link_bytes
      >>> within = Collective("all-reduce", "f32", (8,), 32, groups=((0, 1), (2, 3)))
      >>> across = Collective("all-reduce", "f32", (8,), 32, groups=((0, 2), (1, 3)))
      >>> link_bytes([within, across], hosts=[0, 0, 1, 1])
      {'intra': 32.0, 'inter': 32.0}
    """
    out = {"intra": 0.0, "inter": 0.0}
    for r in records:
        n = _group_size(r, len(hosts))
        if n < 2:
            continue
        sent = r.bytes * RING_FACTORS[r.op](n)
        out["inter" if _spans_hosts(r, hosts) else "intra"] += sent
    return out


def link_seconds(
    records: list, hosts: Sequence[int], intra_bytes_per_s: float, inter_bytes_per_s: float
) -> float:
    """Ring communication time with each collective charged at its bottleneck link.

    Args:
      records: `Collective` records of one device's program, with their `groups`.
      hosts: the host of each device id (the program's device assignment order).
      intra_bytes_per_s: the per-device bandwidth within a host (NVLink).
      inter_bytes_per_s: the per-device bandwidth between hosts.

    Returns:
      Seconds, summed over records (no overlap).

    Example:
      >>> from mpjax._src.analysis.collectives import Collective, link_seconds
      >>> across = Collective("all-reduce", "f32", (8,), 32, groups=((0, 2), (1, 3)))
      >>> link_seconds([across], hosts=[0, 0, 1, 1], intra_bytes_per_s=8.0, inter_bytes_per_s=1.0)
      32.0
    """
    sent = link_bytes(records, hosts)
    return sent["intra"] / intra_bytes_per_s + sent["inter"] / inter_bytes_per_s
