"""The records of `mpjax.report` (frozen dataclasses) and their dict form."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

__all__ = ["Collective", "Converts", "Gemm", "Memory", "dtype_name", "to_plain"]


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One dot or convolution of the step.

    Attributes:
      path: the Flax module path (`"blk/Dense_0"`) or the function's name, from the HLO
        metadata.
      kind: `"dot"` or `"conv"`.
      direction: `"forward"` or `"backward"` (a transposed op of `jax.grad`).
      lhs_dtype, rhs_dtype, out_dtype: what the program asks for (the lowered HLO).
      runs_as: the operand dtype the compiled target runs (the wider operand's); `None` when
        the compiler turned the op into something else. XLA:CPU runs f16 GEMMs in float32, and
        bf16 ones too up to jaxlib 0.10 (0.12 runs bf16 dots in bf16, bf16 convolutions in f32).
      flops: 2 x multiply-adds, of the whole program.
      device_flops: those of the op that runs it on one device (`flops` divided by its
        shards under SPMD partitioning); `None` with `runs_as`.
      flagged: runs (or asks for) float32 while most of the step's GEMM FLOPs are narrower.
      high_precision_last: an fp8-eligible GEMM that `autocast` kept in the compute dtype
        because it is one of the program's last (`Fp8Recipe.high_precision_last`: NVFP4's
        default keeps about 15 %).
    """

    path: str
    kind: str
    direction: str
    lhs_dtype: jnp.dtype
    rhs_dtype: jnp.dtype
    out_dtype: jnp.dtype
    runs_as: jnp.dtype | None
    flops: int
    device_flops: int | None
    flagged: bool = False
    high_precision_last: bool = False

    @property
    def asks_for(self) -> jnp.dtype:
        """The operand dtype the program asks for (the wider operand's)."""
        return wider(self.lhs_dtype, self.rhs_dtype)

    @property
    def fp8(self) -> bool:
        """Whether the program asks for an fp8 GEMM (both operands fp8)."""
        return is_fp8(self.lhs_dtype) and is_fp8(self.rhs_dtype)

    @property
    def runs_fp8(self) -> bool:
        """Whether the compiled target runs it as an fp8 GEMM (XLA:CPU never does)."""
        return self.runs_as is not None and is_fp8(self.runs_as)


@dataclasses.dataclass(frozen=True)
class Converts:
    """The dtype conversions one module's code compiled to."""

    path: str
    count: int  # convert instructions, fused ones included
    kernels: int  # kernels that only convert: a cast written to memory and read back


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the optimized program (one per dtype of a combined collective)."""

    path: str
    op: str  # all-gather | all-reduce | reduce-scatter | collective-permute | all-to-all
    dtype: jnp.dtype
    bytes: int  # of the result on one device


@dataclasses.dataclass(frozen=True)
class Memory:
    """XLA's buffer assignment of the step, and a roofline estimate for GPU targets."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    # The calibrated H100 time (`mpjax._src.analysis.calibrated`: each kernel's roofline over
    # its class's measured efficiency); None on CPU
    roofline_s: float | None
    peak_roofline_s: float | None = None  # every kernel at the data-sheet peaks
    # kernel classes the step runs that no GPU measured (costed at UNMEASURED_EFFICIENCY)
    unmeasured: tuple = ()


def dtype_name(dtype) -> str:
    """`jnp.dtype` name of a dtype or HLO dtype name (`"bf16"` -> `"bfloat16"`)."""
    return jnp.dtype(_HLO.get(dtype, dtype)).name


_HLO = {
    "pred": "bool",
    "s8": "int8",
    "u8": "uint8",
    "s16": "int16",
    "u16": "uint16",
    "s32": "int32",
    "u32": "uint32",
    "s64": "int64",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e5m2fnuz": "float8_e5m2fnuz",
    "c64": "complex64",
    "c128": "complex128",
}


def as_dtype(hlo_dtype: str) -> jnp.dtype:
    """The `jnp.dtype` of an HLO dtype name."""
    return jnp.dtype(_HLO.get(hlo_dtype, hlo_dtype))


def is_fp8(dtype) -> bool:
    """Whether `dtype` is one of the 8-bit floating-point formats."""
    return jnp.dtype(dtype).name.startswith("float8")


def wider(a: jnp.dtype, b: jnp.dtype) -> jnp.dtype:
    """The wider of two dtypes (`a` on a tie)."""
    return b if jnp.dtype(b).itemsize > jnp.dtype(a).itemsize else a


def to_plain(value):
    """Dataclasses, tuples and dtypes as JSON-ready dicts, lists and names."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, jnp.dtype):
        return value.name
    if callable(value):  # a memory plan's `make_step`, a checkpoint policy
        return getattr(value, "__qualname__", None) or repr(value)
    return value
