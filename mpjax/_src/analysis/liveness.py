"""Where a compiled program's temporary memory goes: a liveness walk of its optimized HLO.

`peak_buffers(hlo_text)` walks the ENTRY computation of a scheduled HLO module
(`compiled.as_text()`: instructions print in execution order) and returns the buffers live
at the point where the most temporary bytes are live. A buffer is an instruction's result;
it lives from that instruction to its last reader. Ops that only alias their operands
(`get-tuple-element`, `bitcast`, `tuple`, the `-done` half of an async pair, the
`optimization-barrier`) define no buffer but extend their sources' lives; parameters
(arguments), constants and the values the program returns are not temporaries. The
`-start` half of an async op counts its last result (the destination buffer).

This is the heap simulator's view without its packing (buffers reusing each other's
space, in-place updates): its peak is an upper estimate of XLA's `temp_size_in_bytes`,
close on straight-line training steps, and the point is the attribution: which arrays
(by shape and dtype) hold the memory at the peak. `attribute` sums them by category.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from mpjax._src.analysis.hlo_text import op_name, parse_module, shapes_bytes

__all__ = ["Buffer", "attribute", "peak_buffers"]

_ALIASING = frozenset({"get-tuple-element", "bitcast", "tuple", "optimization-barrier"})
_NOT_TEMP = frozenset({"parameter", "constant"})


class Buffer(NamedTuple):
    """One live buffer at the peak: the instruction, its result shapes, bytes and op name."""

    name: str
    opcode: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int
    op_name: str


def _result_shapes(instr) -> tuple:
    if instr.opcode.endswith("-start") and len(instr.shapes) > 1:
        return instr.shapes[-1:]
    return instr.shapes


def peak_buffers(hlo_text: str) -> tuple[int, list[Buffer]]:
    """The peak of live temporary bytes of the ENTRY computation, and the buffers live there.

    Args:
      hlo_text: optimized, scheduled HLO (`jax.jit(f).lower(...).compile().as_text()`).

    Returns:
      `(peak bytes, buffers live at the peak, largest first)`.

    Example:
      >>> from mpjax._src.analysis.liveness import peak_buffers
      >>> hlo = '''HloModule m, is_scheduled=true
      ... ENTRY %main (p: f32[4]) -> f32[] {
      ...   %p = f32[4]{0} parameter(0)
      ...   %a = f32[4]{0} exponential(f32[4]{0} %p)
      ...   %b = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %p)
      ...   ROOT %c = f32[] reduce(f32[4]{0} %b, f32[] %p), to_apply=%sum
      ... }'''
      >>> peak_buffers(hlo)[0]  # a and b are both live at b
      32
    """
    comps, entry = parse_module(hlo_text)
    instrs = list(comps[entry].values())
    index = {ins.name: i for i, ins in enumerate(instrs)}
    sources: dict[str, tuple[str, ...]] = {}  # value -> the buffers it is made of
    for ins in instrs:
        aliasing = ins.opcode in _ALIASING or (ins.opcode.endswith("-done") and ins.operands)
        if ins.opcode in _NOT_TEMP:
            sources[ins.name] = ()
        elif aliasing:
            sources[ins.name] = tuple(s for o in ins.operands for s in sources.get(o, ()))
        else:
            sources[ins.name] = (ins.name,)
    last = {}
    for i, ins in enumerate(instrs):
        for o in ins.operands:
            for s in sources.get(o, ()):
                last[s] = i
    returned = set(sources.get(instrs[-1].name, ())) if instrs else set()
    births: dict[int, list[str]] = {}
    deaths: dict[int, list[str]] = {}
    sizes = {}
    for ins in instrs:
        if sources.get(ins.name) != (ins.name,) or ins.name in returned:
            continue
        sizes[ins.name] = shapes_bytes(_result_shapes(ins))
        start = index[ins.name]
        births.setdefault(start, []).append(ins.name)
        deaths.setdefault(max(last.get(ins.name, start), start), []).append(ins.name)
    live: set[str] = set()
    total = peak = 0
    peak_set: set[str] = set()
    for i in range(len(instrs)):
        for name in births.get(i, ()):
            live.add(name)
            total += sizes[name]
        if total > peak:
            peak, peak_set = total, set(live)
        for name in deaths.get(i, ()):
            live.discard(name)
            total -= sizes[name]
    by_name = {ins.name: ins for ins in instrs}
    buffers = [
        Buffer(
            n, by_name[n].opcode, _result_shapes(by_name[n]), sizes[n], op_name(by_name[n].attrs)
        )
        for n in peak_set
    ]
    return peak, sorted(buffers, key=lambda b: (-b.bytes, b.name))


def attribute(buffers: list[Buffer], category: Callable[[Buffer], str]) -> dict[str, int]:
    """Bytes of `buffers` by `category(buffer)`, largest first.

    Example:
      >>> from mpjax._src.analysis.liveness import Buffer, attribute
      >>> b = [Buffer("a", "fusion", (("f32", (4,)),), 16, ""),
      ...      Buffer("b", "fusion", (("bf16", (4,)),), 8, "")]
      >>> attribute(b, lambda buf: buf.shapes[0][0])
      {'f32': 16, 'bf16': 8}
    """
    out: dict[str, int] = {}
    for b in buffers:
        key = category(b)
        out[key] = out.get(key, 0) + b.bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
