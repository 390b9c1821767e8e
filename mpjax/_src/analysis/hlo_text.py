"""Parsing XLA HLO text: computations, instructions, shapes and attributes.

`parse_module` reads optimized (`compiled.as_text()`) or lowered HLO into
`{computation: {name: Instr}}`; the helpers read an instruction's attributes.
`mpjax._src.analysis.hlo_cost` and `mpjax._src.analysis.collectives` build on it.
"""

from __future__ import annotations

import json
import math
import re
from typing import NamedTuple

__all__ = [
    "DTYPE_BYTES",
    "Instr",
    "attr",
    "backend_config",
    "dims_attr",
    "shapes_bytes",
    "op_name",
    "parse_module",
    "source_op_name",
    "split_top",
]

DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
}

_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
# Optimized HLO prints `%name (params) -> type {`; lowered HLO (`Lowered.as_text("hlo")`) `name {`.
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMMENT = re.compile(r"/\*.*?\*/")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')


class Instr(NamedTuple):
    """One HLO instruction: name, result shapes [(dtype, dims)], opcode, operands, attrs."""

    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    opcode: str
    operands: tuple[str, ...]
    attrs: str


def split_top(text: str) -> list[str]:
    """Splits at commas not nested in (), [], {}."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]!r}")


def _shapes(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(
        (dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in _SHAPE.findall(type_text)
        if dt in DTYPE_BYTES
    )


def _operand_name(text: str) -> str:
    """`%p` / `bf16[8]{0} %p` / `/*index=5*/%p` / `p` (lowered HLO) -> `p`."""
    text = _COMMENT.sub("", text).strip()
    return text.rsplit("%", 1)[-1] if "%" in text else (text.split() or [""])[-1]


def _parse_instr(line: str) -> Instr | None:
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    paren = rest.index("(")
    opcode = rest[:paren]
    close = _balanced(rest, paren)
    operands = tuple(
        _operand_name(o) for o in split_top(rest[paren + 1 : close - 1]) if _operand_name(o)
    )
    return Instr(m.group(1), _shapes(type_text), opcode, operands, rest[close:])


def parse_module(text: str) -> tuple[dict, str]:
    """({computation name: {instr name: Instr}}, entry computation name) of HLO text."""
    comps: dict[str, dict[str, Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = {}
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            comps[current][instr.name] = instr
    if entry is None:
        raise ValueError("parse_module: no ENTRY computation in the HLO text")
    return comps, entry


def op_name(attrs: str) -> str:
    """The `op_name` of an instruction's metadata ("" without one)."""
    m = _OP_NAME.search(attrs)
    return m.group(1) if m else ""


def source_op_name(comp: dict, instr: Instr, depth: int = 8) -> str:
    """The `op_name` of `instr`, else of the nearest operand in `comp` that has one.

    XLA names nothing it inserts itself (a convert XLA:CPU adds to run float16 math in
    float32, a bitcast): such an instruction belongs to the code whose value it reads.

    Args:
      comp: the computation holding `instr` (`{name: Instr}` of `parse_module`).
      instr: the instruction.
      depth: how many operand levels to search.

    Returns:
      The name stack (`""` when no instruction within `depth` levels has one).

    Example:
      >>> from mpjax._src.analysis.hlo_text import parse_module, source_op_name
      >>> hlo = chr(10).join([
      ...     "ENTRY %main (p: f16[2]) -> f32[2] {",
      ...     "  %p = f16[2]{0} parameter(0)",
      ...     '  %neg = f16[2]{0} negate(%p), metadata={op_name="jit(f)/neg"}',
      ...     "  ROOT %c = f32[2]{0} convert(%neg)",
      ...     "}",
      ... ])
      >>> comps, entry = parse_module(hlo)
      >>> source_op_name(comps[entry], comps[entry]["c"])
      'jit(f)/neg'
    """
    frontier, seen = [instr], set()
    for _ in range(depth):
        for i in frontier:  # a parameter's op_name is its argument's path, not a name stack
            if i.opcode != "parameter" and (name := op_name(i.attrs)):
                return name
        seen.update(i.name for i in frontier)
        frontier = [comp[o] for i in frontier for o in i.operands if o in comp and o not in seen]
    return ""


def shapes_bytes(shapes) -> int:
    """Bytes of a tuple of `(dtype, dims)` shapes."""
    return int(sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shapes))


def attr(attrs: str, key: str) -> str | None:
    """The value of attribute `key` in an instruction's attribute text, or None."""
    m = re.search(rf"\b{key}=([^\s,]+(?:\{{[^}}]*\}})?)", attrs)
    return m.group(1) if m else None


def dims_attr(attrs: str, key: str) -> tuple[int, ...]:
    """A `key={1,2}` attribute as a tuple of ints (empty if absent)."""
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def backend_config(attrs: str) -> dict:
    """An instruction's `backend_config` JSON as a dict (empty if absent or unreadable)."""
    i = attrs.find("backend_config=")
    if i < 0:
        return {}
    start = i + len("backend_config=")
    if attrs[start] != "{":
        return {}
    try:
        return json.loads(attrs[start : _balanced(attrs, start)])
    except ValueError:
        return {}
