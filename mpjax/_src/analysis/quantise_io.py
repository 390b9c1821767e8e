"""What a program's block quantisations read and write: per tensor, transposes, float32 copies.

`quantise_io(hlo_text)` reads an optimized XLA:GPU HLO module (`compiled.as_text()`) of a
step with block-scaled GEMMs (`mpjax.fp8`'s MXFP8, NVFP4, blockwise) and reports, from the
arrays its kernels pass each other through HBM:

- the *quantisation work*: every kernel launched under the `block_quantize` name stack (each
  `quantize_orientations` call runs in `jit(block_quantize)`: the fused quantiser
  `mpjax_block_quantize`, the XLA reference, their amax reductions and Hadamard transforms);
- the *quantise kernels*: those of the work that write an 8-bit or 4-bit array;
- the *quantised tensors*: each group of quantise kernels that read (directly, or through
  the work's own intermediates) the same operand-sized floating arrays made outside the work
  (or parameters); its role is `"w"` when those (or the array the fused quantiser reads) are
  parameters or only moved or cast from them, `"g"` when its kernels run under a VJP's
  `transpose(` name stack, else `"x"`;
- *transposes*: operand-sized bfloat16 or float32 arrays read or written by the work whose
  value passes through a transpose (or a layout-changing copy) in the kernel that writes
  them: a transposed copy of an operand (the fused quantiser transposes inside the kernel);
- *float32 copies*: operand-sized float32 arrays the work writes, or that a kernel outside it
  writes only for the work (every reader is quantisation work), other than the operand the
  fused quantiser reads (XLA may compute it in an amax pass) unless the kernel writing that
  only moves or casts data (a transpose, copy or convert): a float32 copy of `x`, `w` or `g`
  made only to be quantised;
- *float32 operands*: the float32 arrays the step writes that the fused quantiser reads as its
  operand (the model's own tensor in float32, e.g. a LayerNorm output; informational).

*Operand-sized*: at least half as many elements as the smallest quantised tensor (so scales,
amaxes and per-block partial results are not copies). Arrays are named
`"roles dtype[shape] kernel (op)"`: the roles of the tensors whose quantisation reads or
writes it (`"?"`: none found), `kernel#i` for output `i` of a multi-output kernel, `op` the
last part of the writer's name stack (float32 operands without roles). XLA may recompute a
tensor's producer inside one of a reference quantisation's fusions: that tensor then shows as
two groups (the fused quantiser reads one array).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from mpjax._src.analysis.hlo_text import attr, op_name, parse_module, source_op_name

__all__ = ["QUANTISE_SCOPE", "QUANTISER", "QuantiseIO", "QuantisedTensor", "quantise_io"]

# The name stack every quantisation runs under (`mpjax._src.fp8.orientations.QUANTIZE_NAME`)
# and the fused quantiser's kernel name (`block_quantize_kernel.KERNEL_NAME`); this layer does
# not import fp8: a test ties the names.
QUANTISE_SCOPE = "block_quantize"
QUANTISER = "mpjax_block_quantize"

_FREE = {"bitcast", "get-tuple-element", "reshape"}
_SKIP = _FREE | {"parameter", "constant", "tuple", "after-all", "partition-id", "replica-id"}
_CONTROL = ("call", "while", "conditional")
_MOVES = {"transpose", "copy", "convert", "broadcast", "slice", "concatenate", "pad"}
_LOW = ("u8", "f8", "f4")
_WIDE = ("f32", "bf16", "f16")


class QuantisedTensor(NamedTuple):
    """One tensor the program quantises: its role, the arrays it is read from, its kernels."""

    role: str  # "x" | "w" | "g"
    sources: tuple[str, ...]  # the arrays made outside the quantisation work
    kernels: tuple[str, ...]  # the quantise kernels that read it
    fused: bool  # quantised by the fused quantiser


class QuantiseIO(NamedTuple):
    """What `quantise_io` reads from one optimized HLO module."""

    tensors: tuple[QuantisedTensor, ...]
    transposes: tuple[str, ...]
    float32_copies: tuple[str, ...]
    float32_operands: tuple[str, ...]


def _root(comp: dict):
    return list(comp.values())[-1]  # XLA prints a computation's ROOT last


def _transposed(comps: dict, instr, index: int, min_elements: int) -> bool:
    """Whether output `index` of kernel `instr` passes through an operand-sized transpose."""
    if instr.opcode in ("transpose", "copy"):  # an unfused copy changes the layout
        return True
    if instr.opcode != "fusion":
        return False
    comp = comps.get((attr(instr.attrs, "calls") or "").lstrip("%"), {})
    if not comp:
        return False
    root = _root(comp)
    frontier = [root.operands[index]] if root.opcode == "tuple" else [root.name]
    seen = set()
    while frontier:
        name = frontier.pop()
        if name in seen or name not in comp:
            continue
        seen.add(name)
        i = comp[name]
        big = i.shapes and math.prod(i.shapes[0][1]) >= min_elements
        if i.opcode in ("transpose", "copy") and big:
            return True
        frontier.extend(i.operands)
    return False


def _moves_only(comps: dict, instr) -> bool:
    """Whether kernel `instr` only moves or converts data (a transpose, copy or cast)."""
    if instr.opcode != "fusion":
        return instr.opcode in _MOVES
    comp = comps.get((attr(instr.attrs, "calls") or "").lstrip("%"), {})
    return bool(comp) and all(i.opcode in _MOVES | _SKIP for i in comp.values())


def _computations(comps: dict, entry: str) -> list[str]:
    """The entry computation and the control-flow bodies it reaches (not fused ones)."""
    out, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name in out or name not in comps:
            continue
        out.append(name)
        for i in comps[name].values():
            if i.opcode in _CONTROL:
                for key in ("to_apply", "body", "condition", "true_computation"):
                    if target := attr(i.attrs, key):
                        todo.append(target.lstrip("%"))
    return out


class _Graph:
    """Arrays `(writer, output index)` of one computation, their readers and the work."""

    def __init__(self, comps: dict, comp: dict):
        self.comps, self.comp = comps, comp
        self.kernels = [i for i in comp.values() if i.opcode not in _SKIP]
        self.readers: dict = {}
        for k in self.kernels:
            for slot, o in enumerate(k.operands):
                self.readers.setdefault(self.array(o), []).append((k.name, slot))
        self.work = {k.name for k in self.kernels if self._in_work(k)}

    def array(self, name: str) -> tuple[str, int]:
        """The array an operand name refers to, through bitcasts and tuple elements."""
        index = 0
        while name in self.comp and self.comp[name].opcode in _FREE:
            i = self.comp[name]
            if i.opcode == "get-tuple-element":
                index = int(attr(i.attrs, "index") or 0)
            name = i.operands[0]
        return name, index

    def _in_work(self, k) -> bool:
        name = op_name(k.attrs) or source_op_name(self.comp, k)
        return QUANTISE_SCOPE in name or self.fused(k)

    def fused(self, k) -> bool:
        return k.opcode == "custom-call" and f'name = "{QUANTISER}"' in k.attrs

    def shape(self, array) -> tuple[str, tuple[int, ...]]:
        i = self.comp[array[0]]
        return i.shapes[array[1]] if len(i.shapes) > array[1] else ("", ())

    def label(self, array) -> str:
        dtype, dims = self.shape(array)
        i = self.comp[array[0]]
        op = (op_name(i.attrs) or source_op_name(self.comp, i)).rsplit("/", 1)[-1]
        suffix = f"#{array[1]}" if len(i.shapes) > 1 else ""
        return f"{dtype}[{','.join(map(str, dims))}] {array[0]}{suffix} ({op})"

    def made_outside(self, array) -> bool:
        return array[0] not in self.work and array[0] in self.comp


def _floating(dtype: str) -> bool:
    return dtype.startswith(_WIDE)


def _reads(g: _Graph, kernel: str) -> set:
    """The arrays `kernel` reads, directly or through the work's intermediates."""
    out, todo, seen = set(), [kernel], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for o in g.comp[name].operands:
            array = g.array(o)
            if array[0] in g.comp:
                out.add(array)
                if array[0] in g.work:
                    todo.append(array[0])
    return out


def _sources(g: _Graph, kernel: str, min_elements: int) -> set:
    """The operand-sized floating arrays made outside the work that `kernel` reads, directly
    or through the work's intermediates."""
    return {
        a
        for a in _reads(g, kernel)
        if a[0] not in g.work
        and _floating(g.shape(a)[0])
        and len(g.shape(a)[1]) >= 2
        and math.prod(g.shape(a)[1]) >= min_elements
    }


def _from_parameters(g: _Graph, array, depth: int = 8) -> bool:
    """Whether `array` is a parameter, or only moved or cast from parameters."""
    i = g.comp[array[0]]
    if i.opcode == "parameter":
        return True
    if depth == 0 or not _moves_only(g.comps, i):
        return False
    arrays = [g.array(o) for o in i.operands if g.array(o)[0] in g.comp]
    return bool(arrays) and all(_from_parameters(g, a, depth - 1) for a in arrays)


def _role(g: _Graph, sources: set, kernels: list) -> str:
    # the fused quantiser's operand decides (XLA may fuse its producer into an amax pass,
    # whose sources are then the producer's inputs)
    fused = [g.array(g.comp[k].operands[0]) for k in kernels if g.fused(g.comp[k])]
    if all(_from_parameters(g, s) for s in fused or sources):
        return "w"
    names = [op_name(g.comp[k].attrs) for k in kernels]
    return "g" if any("transpose(" in n.split(QUANTISE_SCOPE)[0] for n in names) else "x"


def _tensors(g: _Graph, quantise: list, min_elements: int) -> list[QuantisedTensor]:
    groups: list[tuple[set, list]] = []
    for k in quantise:
        src = _sources(g, k, min_elements)
        merged = [grp for grp in groups if grp[0] & src]
        for grp in merged:
            groups.remove(grp)
            src |= grp[0]
        groups.append((src, sorted({k, *[n for grp in merged for n in grp[1]]})))
    return [
        QuantisedTensor(
            _role(g, src, ks),
            tuple(sorted(g.label(s) for s in src)),
            tuple(ks),
            any(g.fused(g.comp[k]) for k in ks),
        )
        for src, ks in groups
    ]


def _role_label(g: _Graph, roles: dict, array) -> str:
    return f"{''.join(sorted(roles.get(array, '?')))} {g.label(array)}"


def quantise_io(hlo_text: str) -> QuantiseIO:
    """The quantised tensors, and the transposes and float32 copies of their operands.

    Args:
      hlo_text: `compiled.as_text()` of a program with block-scaled GEMMs (any HLO parses;
        see the module docstring for the definitions).

    Returns:
      A `QuantiseIO`; empty for a program that quantises nothing.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax.fp8 import quantize_orientations
      >>> from mpjax._src.analysis.quantise_io import quantise_io
      >>> f = jax.jit(lambda x: quantize_orientations(x.T * 2, "mxfp8").rows.data)
      >>> io = quantise_io(f.trace(jnp.ones((64, 128))).lower().compile().as_text())
      >>> len(io.tensors), [t.split()[:2] for t in io.transposes]  # XLA:CPU, the reference
      (1, [['w', 'f32[128,64]']])
    """
    comps, entry = parse_module(hlo_text)
    tensors, transposes, copies, operands = [], [], [], []
    for name in _computations(comps, entry):
        g = _Graph(comps, comps[name])
        quantise = [
            k.name
            for k in g.kernels
            if k.name in g.work and any(dt.startswith(_LOW) for dt, _ in k.shapes)
        ]
        # each quantise kernel's tensor: the largest array it reads from outside the work
        sizes = [
            max(math.prod(g.shape(a)[1]) for a in src)
            for k in quantise
            if (src := _sources(g, k, 1))
        ]
        if not sizes:
            continue
        min_elements = min(sizes) // 2
        found = _tensors(g, quantise, min_elements)
        tensors += found
        roles: dict = {}  # array -> the roles of the tensors whose quantisation touches it
        for t in found:
            for k in t.kernels:
                for a in _reads(g, k) | {(k, i) for i in range(len(g.comp[k].shapes))}:
                    roles.setdefault(a, set()).add(t.role)
        label = functools.partial(_role_label, g, roles)
        # the fused quantiser's operands: the model's tensors, unless only moved or cast there
        fused_x = {g.array(g.comp[k].operands[0]) for k in quantise if g.fused(g.comp[k])}
        fused_x = {a for a in fused_x if not _moves_only(comps, g.comp[a[0]])}
        for k in g.kernels:
            for index, (dtype, dims) in enumerate(k.shapes):
                array = (k.name, index)
                readers = [r for r, _ in g.readers.get(array, [])]
                if not _floating(dtype) or math.prod(dims) < min_elements or not readers:
                    continue
                in_work = k.name in g.work
                for_work = all(r in g.work for r in readers)
                if (in_work or any(r in g.work for r in readers)) and _transposed(
                    comps, k, index, min_elements
                ):
                    transposes.append(label(array))
                if dtype == "f32" and (in_work or for_work) and array not in fused_x:
                    copies.append(label(array))
                if dtype == "f32" and array in fused_x and g.comp[k.name].opcode != "parameter":
                    operands.append(g.label(array))
    return QuantiseIO(tuple(tensors), tuple(transposes), tuple(copies), tuple(operands))
