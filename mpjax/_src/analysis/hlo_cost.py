"""A crude cost analysis of optimized XLA:GPU HLO text: kernels, FLOPs, bytes and a roofline.

`compiled.cost_analysis()` is unimplemented for an executable compiled without a device, so
this module reads `compiled.as_text()` (the optimized HLO) instead. Every instruction of the
entry computation (and of the bodies of `call`, `while` and `conditional` it reaches) that
launches work on the GPU is one kernel (in a `while` body with a known trip count, its bytes,
FLOPs and time count once per iteration):

- fusions, by kind: `loop fusion` (kLoop), `input fusion` (kInput: reductions, transposes),
  `output fusion`, and kCustom fusions named by their backend kind (`triton gemm`,
  `triton fusion`, `cudnn fusion`, ...);
- custom calls: `cublas gemm` (`__cublas$gemm`, `__cublas$lt$matmul...`), `cudnn conv`
  (`__cudnn$conv...`), `cudnn attention` (`__cudnn$fmha...`: its GEMMs counted as two
  forward, five backward), `pallas/triton call` (`__gpu$xla.gpu.triton`), other targets by name;
- unfused ops (`copy`, `scatter`, `sort`, ...) by their opcode.

Per kernel: bytes = the sizes of its distinct operands plus its result (what it reads and
writes once; a slice of a big operand is over-counted); tensor FLOPs = 2 x multiply-adds of
the dots and convolutions it runs (inside fusions too), keyed by operand dtype; other FLOPs =
one per output element of each elementwise/reduce instruction it fuses. The roofline time of
a kernel is `max(tensor_flops / peak(dtype) + other_flops / PEAK_VECTOR, bytes / HBM_BW)`,
summed over kernels (no overlap, no launch latency).

Peaks are the H100 SXM data-sheet dense figures (NVIDIA H100 Tensor Core GPU datasheet).
float32 dots and convolutions run as TF32 on tensor cores under XLA's default precision.

`analyze` has a worked example. The FLOPs of one dot, convolution or library call are counted
in `mpjax._src.analysis.hlo_flops`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import NamedTuple

from mpjax._src.analysis.hlo_flops import Gemm, _matmul_flops, _prefixed, _shape_of
from mpjax._src.analysis.hlo_text import (
    DTYPE_BYTES,
    Instr,
    attr,
    backend_config,
    op_name,
    parse_module,
    shapes_bytes,
    source_op_name,
)

__all__ = [
    "DTYPE_BYTES",
    "HBM_BYTES_PER_S",
    "PEAK_FLOPS",
    "PEAK_VECTOR",
    "Gemm",
    "HloReport",
    "Kernel",
    "analyze",
    "op_name",
    "parse_module",
]

HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3
PEAK_FLOPS = {  # dense tensor-core FLOP/s by operand dtype
    "f8e4m3fn": 1979e12,
    "f8e5m2": 1979e12,
    "bf16": 989e12,
    "f16": 989e12,
    "f32": 494e12,  # TF32 (XLA's default precision for float32 dots/convs)
    "f64": 67e12,
}
PEAK_VECTOR = 67e12  # float32, non-tensor-core

# Instructions that launch nothing (aliasing, tuples, constants folded into the binary).
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "add-dependency",
}
_CONTROL = {"call", "while", "conditional"}
# Fused instructions that move data but compute nothing.
_DATA_MOVEMENT = _FREE | {
    "broadcast",
    "reshape",
    "transpose",
    "copy",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "iota",
    "reverse",
    "gather",
    "convert",
    "bitcast-convert",
}


class Kernel(NamedTuple):
    """One GPU kernel launch of the program, with its crude costs."""

    name: str
    kind: str
    bytes: int
    tensor_flops: dict  # operand dtype -> FLOPs of dots/convs
    gemm_flops: dict  # operand dtype -> FLOPs of dots
    conv_flops: dict  # operand dtype -> FLOPs of convolutions
    other_flops: int
    time_s: float
    only_converts: bool  # moves data and converts dtypes, nothing else
    op_name: str = ""  # the launching instruction's `metadata={op_name=...}` (JAX's name stack)
    results: tuple = ()  # the dtypes it writes (HLO names)
    features: frozenset = frozenset()  # "transpose" / "reduce-max" when it runs one


class HloReport(NamedTuple):
    """What `analyze` reads from one optimized HLO module."""

    kernels: tuple[Kernel, ...]
    kernels_by_kind: dict
    gemm_flops: dict
    conv_flops: dict
    gemms_by_dtype: dict  # operand dtype -> number of dot instructions
    convs_by_dtype: dict  # operand dtype -> number of convolutions
    converts: int
    convert_kernels: int  # kernels that only convert (materialised casts)
    bytes: int
    roofline_s: float
    gemms: tuple = ()  # every `Gemm`, in program order
    converts_by_op: dict = {}  # op_name -> convert instructions (fused ones included)


def _kind(instr: Instr) -> str:
    if instr.opcode == "fusion":
        kind = attr(instr.attrs, "kind") or ""
        if kind == "kCustom":
            cfg = backend_config(instr.attrs).get("fusion_backend_config", {})
            name = cfg.get("kind", "custom")
            if "gemm" in name:
                return "triton gemm"
            if "cudnn" in name:
                return "cudnn fusion"
            if "triton" in name:
                return "triton fusion"
            return f"fusion {name}"
        return {"kLoop": "loop fusion", "kInput": "input fusion", "kOutput": "output fusion"}.get(
            kind, f"fusion {kind}"
        )
    if instr.opcode == "custom-call":
        target = (attr(instr.attrs, "custom_call_target") or "").strip('"')
        if target.startswith("__cublas"):
            return "cublas gemm"
        if target.startswith("__cudnn$conv"):
            return "cudnn conv"
        if target == "__cudnn$blockScaledDot":
            return "cudnn block-scaled gemm"
        if target.startswith("__cudnn$fmha"):
            return "cudnn attention"
        if "triton" in target:
            return "pallas/triton call"
        return f"custom-call {target}"
    return instr.opcode


def _count_convert(comp: dict, instr: Instr, acc: dict, prefix: str, launcher: str = "") -> None:
    """Counts a convert under its name stack; one XLA made is its input's (or its kernel's)."""
    if instr.opcode == "convert":
        acc["converts"] += 1
        name = source_op_name(comp, instr)
        name = _prefixed(prefix, f'op_name="{name}"') if name else launcher
        acc["converts_by_op"][name or prefix] += 1


def _features(comps: dict, instr: Instr) -> set:
    """What a kernel's instruction does that the decomposition names: a transpose (or a
    layout-changing copy), a max reduction."""
    if instr.opcode == "transpose":
        return {"transpose"}
    if instr.opcode == "reduce":
        body = comps.get((attr(instr.attrs, "to_apply") or "").lstrip("%"), {})
        return {"reduce-max"} if any(i.opcode == "maximum" for i in body.values()) else set()
    return set()


def _fused_costs(comps: dict, comp_name: str, acc: dict, prefix: str = "", launcher="") -> None:
    comp = comps.get(comp_name, {})
    for instr in comp.values():
        acc["features"] |= _features(comps, instr)
        _count_convert(comp, instr, acc, prefix, launcher)
        if instr.opcode in ("dot", "convolution", "custom-call"):
            _matmul_flops(comp, instr, acc, prefix)
        elif instr.opcode == "fusion":
            _fused_costs(comps, attr(instr.attrs, "calls").lstrip("%"), acc, prefix, launcher)
        elif instr.opcode == "reduce":
            acc["other"] += sum(math.prod(_shape_of(comp, o)[1]) for o in instr.operands[:1])
        elif instr.opcode not in _DATA_MOVEMENT and instr.shapes:
            acc["other"] += math.prod(instr.shapes[0][1])
        if instr.opcode not in _DATA_MOVEMENT:
            acc["compute"] += 1


def _new_acc() -> dict:
    return {
        "gemm": Counter(),
        "conv": Counter(),
        "ngemm": Counter(),
        "nconv": Counter(),
        "other": 0,
        "converts": 0,
        "compute": 0,
        "records": [],
        "converts_by_op": Counter(),
        "features": set(),
    }


def _kernel_time(acc: dict, nbytes: int) -> float:
    compute = acc["other"] / PEAK_VECTOR
    for counter in (acc["gemm"], acc["conv"]):
        for key, flops in counter.items():
            dtypes = key.split("x")
            compute += flops / min(PEAK_FLOPS.get(d, PEAK_VECTOR) for d in dtypes)
    return max(compute, nbytes / HBM_BYTES_PER_S)


def _kernel_name(comp: dict, instr: Instr, acc: dict, prefix: str) -> str:
    """A launch's name stack: its own or its inputs', else that of most of its converts."""
    source = source_op_name(comp, instr)
    if source or not acc["converts_by_op"]:
        return _prefixed(prefix, f'op_name="{source}"')
    return max(acc["converts_by_op"], key=acc["converts_by_op"].get)


def _operand_bytes(comps: dict, comp: dict, instr) -> int:
    """Bytes an instruction reads: its distinct operands, except that a fusion operand read
    only through `slice`/`dynamic-slice` inside the fusion counts as the slices it reads
    (a loop body slicing one step out of a stacked array reads that step)."""
    fused = comps.get((attr(instr.attrs, "calls") or "").lstrip("%"), {})
    params = {
        i.operands[0]: i.name
        for i in fused.values()
        if instr.opcode == "fusion" and i.opcode == "parameter" and i.operands
    }
    users: dict = {}
    for i in fused.values():
        for o in i.operands:
            users.setdefault(o, []).append(i)
    total, seen = 0, set()
    for k, o in enumerate(instr.operands):
        if o in seen or o not in comp:
            continue
        seen.add(o)
        full = shapes_bytes(comp[o].shapes)
        readers = users.get(params.get(str(k)), [])
        if readers and all(
            u.opcode in ("slice", "dynamic-slice") and u.operands[0] == params[str(k)]
            for u in readers
        ):
            full = min(full, sum(shapes_bytes(u.shapes) for u in readers))
        total += full
    return total


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _walk(
    comps: dict, comp_name: str, kernels: list, totals: dict, prefix: str = "", repeat: int = 1
) -> None:
    """Appends a `Kernel` per instruction of `comp_name` (and what it calls) to `kernels`.

    `prefix` is the op_name of the `call` that reached this computation: lowered HLO names
    the instructions of a called computation relative to the call (optimized HLO inlines).
    `repeat`: how many times the computation runs (a `while` body: its known trip count);
    each kernel's bytes, FLOPs and time are multiplied by it.
    """
    comp = comps[comp_name]
    for instr in comp.values():
        if instr.opcode in _FREE:
            continue
        if instr.opcode in _CONTROL:
            inner = _prefixed(prefix, instr.attrs) if instr.opcode == "call" else prefix
            trips = _TRIP_COUNT.search(instr.attrs) if instr.opcode == "while" else None
            times = repeat * (int(trips.group(1)) if trips else 1)
            for key in (
                "to_apply",
                "body",
                "condition",
                "calls",
                "true_computation",
                "false_computation",
            ):
                target = attr(instr.attrs, key)
                if target and target.lstrip("%") in comps:
                    _walk(comps, target.lstrip("%"), kernels, totals, inner, times)
            branches = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
            for branch in re.findall(r"%?([\w.\-]+)", branches.group(1) if branches else ""):
                _walk(comps, branch, kernels, totals, inner, times)
            continue
        acc = _new_acc()
        if instr.opcode == "fusion":
            source = source_op_name(comp, instr)
            launcher = _prefixed(prefix, f'op_name="{source}"') if source else prefix
            _fused_costs(comps, attr(instr.attrs, "calls").lstrip("%"), acc, prefix, launcher)
        else:
            acc["features"] |= _features(comps, instr)
            _count_convert(comp, instr, acc, prefix)
            if instr.opcode in ("dot", "convolution", "custom-call"):
                _matmul_flops(comp, instr, acc, prefix)
            elif instr.opcode not in _DATA_MOVEMENT and instr.shapes:
                acc["other"] += math.prod(instr.shapes[0][1])
            if instr.opcode not in _DATA_MOVEMENT:
                acc["compute"] += 1
        operand_bytes = _operand_bytes(comps, comp, instr)
        nbytes = (operand_bytes + shapes_bytes(instr.shapes)) * repeat
        if repeat != 1:  # FLOPs of every run; the GEMM counts stay per instruction
            for key in ("gemm", "conv"):
                acc[key] = Counter({k: v * repeat for k, v in acc[key].items()})
            acc["other"] *= repeat
        for key in ("gemm", "conv", "ngemm", "nconv"):
            totals[key].update(acc[key])
        totals["converts"] += acc["converts"]
        totals["records"].extend(acc["records"])
        totals["converts_by_op"].update(acc["converts_by_op"])
        tensor = Counter(acc["gemm"]) + Counter(acc["conv"])
        kernels.append(
            Kernel(
                instr.name,
                _kind(instr),
                nbytes,
                dict(tensor),
                dict(acc["gemm"]),
                dict(acc["conv"]),
                acc["other"],
                _kernel_time(acc, nbytes),
                acc["converts"] > 0 and acc["compute"] == 0,
                _kernel_name(comp, instr, acc, prefix),
                tuple(dtype for dtype, _ in instr.shapes),
                frozenset(acc["features"]),
            )
        )


def analyze(hlo_text: str) -> HloReport:
    """Kernels, FLOPs by dtype, converts, bytes and roofline time of an optimized HLO module.

    Args:
      hlo_text: `compiled.as_text()` of an XLA:GPU executable (any HLO text parses:
        `Lowered.as_text("hlo", debug_info=True)` gives what the program asked for).

    Returns:
      An `HloReport`.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from mpjax._src.analysis.hlo_cost import analyze
      >>> x = jnp.ones((64, 64))
      >>> report = analyze(jax.jit(lambda x: x @ x).trace(x).lower().compile().as_text())
      >>> report.gemm_flops  # 2 * 64**3
      {'f32': 524288}
    """
    comps, entry = parse_module(hlo_text)
    kernels: list[Kernel] = []
    totals = _new_acc()
    _walk(comps, entry, kernels, totals)
    return HloReport(
        kernels=tuple(kernels),
        kernels_by_kind=dict(Counter(k.kind for k in kernels)),
        gemm_flops=dict(totals["gemm"]),
        conv_flops=dict(totals["conv"]),
        gemms_by_dtype=dict(totals["ngemm"]),
        convs_by_dtype=dict(totals["nconv"]),
        converts=totals["converts"],
        convert_kernels=sum(k.only_converts for k in kernels),
        bytes=sum(k.bytes for k in kernels),
        roofline_s=sum(k.time_s for k in kernels),
        gemms=tuple(totals["records"]),
        converts_by_op=dict(totals["converts_by_op"]),
    )
