"""FLOPs of one HLO dot, convolution, cuBLAS/cuDNN call or cuDNN attention, recorded as a `Gemm`."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from mpjax._src.analysis.hlo_text import Instr, attr, backend_config, dims_attr, op_name

# The name of mpjax's blockwise fp8 GEMM kernel (`mpjax._src.kernels.blockwise_gemm`, a layer
# this one does not import; a test ties the two): its FLOPs count as fp8 GEMM FLOPs. The
# Mosaic GPU kernel (`blockwise_gemm_mgpu`) is this name + "_mgpu" in its op_name.
BLOCKWISE_GEMM = "mpjax_blockwise_fp8_gemm"


class Gemm(NamedTuple):
    """One dot or convolution (a cuBLAS/cuDNN call counts as one) of an HLO module."""

    name: str
    kind: str  # "dot" | "conv"
    lhs_dtype: str  # HLO dtype names ("bf16", "f32", ...)
    rhs_dtype: str
    out_dtype: str
    flops: int
    op_name: str  # JAX's name stack from the metadata, prefixed by its callers' in lowered HLO


def _dtype_key(*dtypes: str) -> str:
    return dtypes[0] if len(set(dtypes)) == 1 else "x".join(dtypes)


def _dot_flops(lhs, result, contracting) -> int:
    return 2 * math.prod(result[1]) * math.prod(lhs[1][d] for d in contracting)


def _conv_flops(x, w, y, attrs: str) -> int:
    """2 x MACs of the convolution x (*) w = y, from its dim_labels and window."""
    labels = attr(attrs, "dim_labels") or ""
    m = re.match(r"(\w+)_(\w+)->(\w+)", labels)
    window = re.search(r"size=([0-9x]+)", attrs)
    if not m or not window:
        return 0
    x_labels = m.group(1)
    groups = int(attr(attrs, "feature_group_count") or 1)
    in_features = x[1][x_labels.index("f")] // groups
    k = math.prod(int(s) for s in window.group(1).split("x"))
    dilation = re.search(r"lhs_dilate=([0-9x]+)", attrs)
    dil = math.prod(int(s) for s in dilation.group(1).split("x")) if dilation else 1
    return 2 * math.prod(y[1]) * k * in_features // dil


def _shape_of(comp: dict, name: str):
    instr = comp.get(name)
    return instr.shapes[0] if instr and instr.shapes else ("f32", ())


def _record(out: dict, instr: Instr, kind: str, ops, flops: int, prefix: str) -> None:
    key = _dtype_key(ops[0][0], ops[1][0])
    out[kind][key] += flops
    out["n" + kind][key] += 1
    name = _prefixed(prefix, instr.attrs)
    out["records"].append(
        Gemm(
            instr.name,
            "dot" if kind == "gemm" else "conv",
            ops[0][0],
            ops[1][0],
            instr.shapes[0][0],
            flops,
            name,
        )
    )


def _matmul_flops(comp: dict, instr: Instr, out: dict, prefix: str = "") -> None:
    """Adds the FLOPs of a dot/convolution/cuBLAS/cuDNN instruction to out[kind][dtype]."""
    ops = [_shape_of(comp, o) for o in instr.operands]
    if instr.opcode == "dot":
        lhs = ops[0]
        flops = _dot_flops(lhs, instr.shapes[0], dims_attr(instr.attrs, "lhs_contracting_dims"))
        _record(out, instr, "gemm", ops, flops, prefix)
    elif instr.opcode == "convolution":
        flops = _conv_flops(ops[0], ops[1], instr.shapes[0], instr.attrs)
        _record(out, instr, "conv", ops, flops, prefix)
    elif instr.opcode == "custom-call":
        target = attr(instr.attrs, "custom_call_target") or ""
        target = target.strip('"')
        if target.startswith("__cublas"):
            cfg = backend_config(instr.attrs).get("gemm_backend_config", {})
            dnums = cfg.get("dot_dimension_numbers", {})
            contracting = [int(d) for d in dnums.get("lhs_contracting_dimensions", [])]
            flops = _dot_flops(ops[0], instr.shapes[0], contracting)
            _record(out, instr, "gemm", ops, flops, prefix)
        elif target == "__cudnn$blockScaledDot":  # [B, M, K] x [B, N, K] -> [B, M, N]
            flops = 2 * math.prod(instr.shapes[0][1]) * ops[0][1][-1]
            _record(out, instr, "gemm", ops, flops, prefix)
        elif ("triton" in target and f'name = "{BLOCKWISE_GEMM}"' in instr.attrs) or (
            target.startswith("mosaic_gpu") and f"/{BLOCKWISE_GEMM}_mgpu/" in op_name(instr.attrs)
        ):
            # mpjax's blockwise fp8 GEMM (Triton, or Mosaic GPU: named in its metadata):
            # a [M, K], scales, b [N, K], scales -> [M, N]
            flops = 2 * math.prod(instr.shapes[0][1]) * ops[0][1][-1]
            _record(out, instr, "gemm", (ops[0], ops[2]), flops, prefix)
        elif target.startswith("__cudnn$conv"):
            result = instr.shapes[0]
            if "BackwardInput" in target:
                x, w, y = result, ops[1], ops[0]
            elif "BackwardFilter" in target:
                x, w, y = ops[0], result, ops[1]
            else:
                x, w, y = ops[0], ops[1], result
            dtypes = (x, w) if "BackwardFilter" not in target else (y, y)
            _record(out, instr, "conv", dtypes, _conv_flops(x, w, y, instr.attrs), prefix)
        elif target.startswith("__cudnn$fmha"):
            _record(out, instr, "gemm", ops[:2], _fmha_flops(instr, ops[0]), prefix)


def _fmha_flops(instr: Instr, query: tuple) -> int:
    """The GEMM FLOPs of a cuDNN fused attention: 2 GEMMs forward, 5 backward (with the
    logits recomputed), each 2 x batch x heads x T x S x head dim (masked blocks counted)."""
    cfg = backend_config(instr.attrs).get("cudnn_fmha_backend_config", {})
    scores = cfg.get("intermediate_tensor_shape", {}).get("dimensions", [])
    target = attr(instr.attrs, "custom_call_target") or ""
    gemms = 5 if "Backward" in target else 2
    return 2 * gemms * math.prod(int(d) for d in scores) * query[1][-1]  # head dim: last


def _prefixed(prefix: str, attrs: str) -> str:
    name = op_name(attrs)
    if prefix and not name.startswith(prefix):
        return f"{prefix}/{name}" if name else prefix
    return name
