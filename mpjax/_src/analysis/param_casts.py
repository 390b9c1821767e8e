"""How often each parameter of a compiled program is cast to the compute dtype (HLO text)."""

from __future__ import annotations

import re

__all__ = ["param_casts"]

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?(\S+)\s*=\s*(\w+)\[[^\]]*\]\S*\s+(\S+?)\((.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")


def _parse_hlo(text: str):
    """Splits HLO text into computations: name -> (is_entry, [(root, name, dtype, op, rest)])."""
    comps, current = {}, None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m and current is not None:
            root, name, dtype, op, rest = m.groups()
            comps[current][1].append((bool(root), name, dtype, op, rest))
            continue
        head = _HEADER.match(line)
        if head and not m:
            current = head.group(2)
            comps[current] = (bool(head.group(1)), [])
        elif line.strip() == "}":
            current = None
    return comps


def _operands(rest: str) -> list[str]:
    depth, args, cur = 0, [], ""
    for ch in rest:
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            args.append(cur)
            cur = ""
        else:
            cur += ch
    args.append(cur)
    return [a.strip().split()[-1].lstrip("%") for a in args if a.strip()]


def param_casts(hlo_text: str, num_params: int, narrow: str = "bf16") -> list[tuple[int, int]]:
    """Per entry parameter `i < num_params`: (narrowing converts reading it, materialized ones).

    Follows fusion operands into fused computations (and through bitcast/copy), so a
    convert duplicated into several fusions is counted once per fusion. Works on both
    lowered (`.as_text(dialect="hlo")`) and compiled (`.as_text()`) HLO text.

    Args:
      hlo_text: HLO module text.
      num_params: how many leading entry parameters are model parameters.
      narrow: the HLO element type of the compute dtype ("bf16", "f16").

    Returns:
      A list of `(converts, materialized)` per parameter.
    """
    comps = _parse_hlo(hlo_text)
    counts = [[0, 0] for _ in range(num_params)]

    def visit(comp: str, sources: dict[str, int]):
        is_entry, instrs = comps[comp]
        for root, name, dtype, op, rest in instrs:
            if op == "parameter":
                continue
            operands = _operands(rest)
            if op in ("bitcast", "copy", "reshape") and operands and operands[0] in sources:
                sources[name] = sources[operands[0]]
            elif op == "convert" and dtype == narrow and operands and operands[0] in sources:
                i = sources[operands[0]]
                counts[i][0] += 1
                counts[i][1] += int(root or is_entry)
            calls = re.search(r"calls=%([\w.\-]+)", rest)
            if op == "fusion" and calls and calls.group(1) in comps:
                inner = {}
                for j, operand in enumerate(operands):
                    if operand in sources:
                        for _, pname, _, pop, prest in comps[calls.group(1)][1]:
                            if pop == "parameter" and prest.startswith(f"{j})"):
                                inner[pname] = sources[operand]
                if inner:
                    visit(calls.group(1), inner)

    for comp, (is_entry, instrs) in comps.items():
        if not is_entry:
            continue
        sources = {}
        for _, name, _, op, rest in instrs:
            if op == "parameter":
                index = int(rest.split(")")[0])
                if index < num_params:
                    sources[name] = index
        visit(comp, sources)
    return [tuple(c) for c in counts]
