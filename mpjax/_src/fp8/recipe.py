"""`Fp8Recipe`: how mpjax runs GEMMs in float8 (scaling mode, formats, history, exclusions)."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from mpjax._src.fp8.blocks import BLOCK_SCALINGS

__all__ = [
    "FP8_DTYPES",
    "NVFP4_HIGH_PRECISION_FIRST",
    "NVFP4_HIGH_PRECISION_LAST",
    "Fp8Recipe",
    "Fp8Site",
]

# The two OCP float8 formats Hopper tensor cores multiply (e4m3fn: max 448; e5m2: max 57344).
FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
_SCALINGS = ("tensorwise", "rowwise", "delayed", "mxfp8", "nvfp4", "blockwise")
_AMAX_COMPUTE = ("max", "most_recent")
_CONVS = ("none", "1x1")
_BLOCK_LOWERINGS = ("auto", "native", "emulated")
_CHOOSE = ("fixed", "roofline")
_TARGETS = ("h100", "b200")
# NVFP4's default `high_precision_last`: NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149)
# keeps about 15 % of the linear layers, the last blocks, and the LM head in BF16.
NVFP4_HIGH_PRECISION_LAST = 0.15
# NVFP4's default `high_precision_first`: NVIDIA's recipe keeps its first blocks in BF16 too
# (Megatron-LM's `--num-layers-at-start-in-bf16`).
NVFP4_HIGH_PRECISION_FIRST = 0


class Fp8Site(NamedTuple):
    """A GEMM that fp8 may take, as given to `Fp8Recipe.exclude_if`.

    Attributes:
      name: the name stack of the op (a Flax module path such as `"Model/head"`; empty for
        plain `jnp` code outside any `jax.named_scope`).
      lhs_shape: shape of the left operand.
      rhs_shape: shape of the right operand.
      dimension_numbers: the `dot_general` dimension numbers.
      kind: `"dot_general"`, or `"conv"` for a 1x1 convolution run as the GEMM above
        (`lhs_shape` is then `[N*H*W, C_in]`, `rhs_shape` `[C_in, C_out]`).
    """

    name: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    dimension_numbers: Any
    kind: str = "dot_general"


def _fp8_dtype(value: Any, field: str) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise ValueError(f"Fp8Recipe: {field}={value!r} is not a dtype") from e
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"Fp8Recipe: {field}={dtype.name} is not an fp8 format; use float8_e4m3fn or "
            "float8_e5m2"
        )
    return dtype


def _choice(value: Any, field: str, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Fp8Recipe: {field}={value!r}; expected one of {choices}")


def _integer(value: Any, field: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Fp8Recipe: {field}={value!r} must be an int")
    return int(value)


def _flag(value: Any, field: str) -> bool | None:
    """A bool (NumPy's too) or, for `power_of_two_scale`, None; anything else is refused."""
    if value is None and field == "power_of_two_scale":
        return None
    if not isinstance(value, (bool, np.bool_)):
        allowed = "True, False or None (the default)" if field == "power_of_two_scale" else "a bool"
        hint = f" (a non-empty string such as {value!r} would read as True)" if value else ""
        raise TypeError(f"Fp8Recipe: {field}={value!r} must be {allowed}{hint}")
    return bool(value)


def _max_margin(dtype: np.dtype) -> int:
    """The largest margin that keeps the amax at or above `dtype`'s smallest normal."""
    info = jnp.finfo(dtype)
    return int(np.floor(np.log2(float(info.max) / float(info.smallest_normal))))


def _margin(value: Any, *dtypes: np.dtype) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"Fp8Recipe: margin={value!r} must be a number (a power-of-two exponent)")
    margin = float(value)
    bound = min(_max_margin(d) for d in dtypes)
    if not np.isfinite(margin) or margin < 0 or margin > bound:
        raise ValueError(
            f"Fp8Recipe: margin={value!r} must be finite and in [0, {bound}]: scales are "
            f"divided by 2**margin, and beyond {bound} the amax itself lands below the "
            f"smallest normal {' / '.join(d.name for d in dtypes)} value (0 is TE's and "
            "torchao's default; 1 or 2 is usual headroom)"
        )
    return margin


def _high_precision(value: Any, field: str) -> int | float | None:
    """None (the recipe's default), a count (int >= 0) or a fraction (float in [0, 1))."""
    if value is None:
        return None
    said = f"Fp8Recipe: {field}={value!r}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(
            f"{said} must be None (the recipe's default), an int count of GEMMs or a float "
            "fraction of them in [0, 1)"
        )
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise ValueError(f"{said}: a count of GEMMs must be >= 0")
        return int(value)
    fraction = float(value)
    if not 0.0 <= fraction < 1.0:  # NaN fails too
        raise ValueError(
            f"{said}: a fraction of the GEMMs must be in [0, 1) (pass an int for a count; "
            "to keep every GEMM in the compute dtype, drop fp8=)"
        )
    return fraction


def _patterns(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        patterns = None
    if patterns is None or not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            f"Fp8Recipe: exclude={value!r} must be a str or a sequence of str fnmatch "
            "patterns on op names, e.g. exclude=('*/head',)"
        )
    return patterns


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How GEMMs run in float8: a frozen, hashable config (like TE's `DelayedScaling`).

    Each eligible `dot_general` quantises its operands to fp8 with a scale
    (`q = saturate(x * scale)`, `scale = fp8_max / amax * 2**-margin`), multiplies in fp8 with
    float32 accumulation and returns the compute dtype with the scales divided back out. The
    forward GEMM takes `forward_dtype` operands; the two backward GEMMs take the output
    gradient in `backward_dtype` and the other operand in `forward_dtype`.

    Attributes:
      scaling: `"mxfp8"`, `"nvfp4"` or `"blockwise"` (block-scaled formats: see
        `mpjax.fp8.quantize_blocks`), or `"tensorwise"` (one scale per tensor from its
        current amax: torchao's default, stateless and robust), `"rowwise"` (one scale per row
        along the contracting dimension: torchao's most accurate recipe, tolerant of outlier
        rows) or `"delayed"` (scale from an amax history kept in a variable collection,
        TE's `DelayedScaling`; only through `apply_policy`, since it needs state).
      forward_dtype: activations and weights; e4m3 (3 mantissa bits) is the precise format.
      backward_dtype: output gradients; e5m2 by default (TE's HYBRID format): gradients span
        a wider range than they need precision. Pass float8_e4m3fn for all-e4m3.
      amax_history_len: delayed scaling's history length; 1024 is TE's default (a long
        window guards against one step's spike dropping the scale).
      amax_compute: `"max"` (the maximum over the history: TE's default, the safest against
        overflow) or `"most_recent"` (the last step's amax: tracks a shrinking range).
      margin: scales are divided by `2**margin`, headroom against next step's growth; 0 is
        TE's and torchao's default (current scaling needs none). Tensorwise, rowwise and
        delayed scaling only: the block-scaled recipes refuse a non-zero margin.
      power_of_two_scale: round each scale down to a power of two, so scaling is exact
        (only the exponent changes); `None` means on for rowwise (torchao's rowwise recipe)
        and off otherwise.
      high_precision_grad_weight: run the weight-gradient GEMM (the gradient of the right
        operand, the kernel of `x @ w`) in the compute dtype; torchao's "rowwise with
        high-precision grad_weight", for when weight gradients need more precision.
      min_dim: the smallest contracting and free size (each a multiple of 16, as fp8
        tensor-core GEMMs require) a `dot_general` needs to run in fp8; smaller GEMMs are
        memory bound, where quantising costs more than it saves.
      exclude: `fnmatch` patterns on an op's name stack (module path, e.g. `"*/head"`,
        `"*/Dense_0"`); a matching op stays in the compute dtype. NNX modules push no name
        scope: under `mpjax.autocast`, a GEMM reading a Variable of an NNX module passed as
        an argument is named by that module's path (`"Model/head"`, `"Model/layers/1"`); an
        `exclude` that matches no GEMM of a call where some GEMM has no name (an NNX model
        closed over) is refused at the call.
      exclude_if: a predicate on an `Fp8Site`; `True` keeps the op in the compute dtype.
      convs: which convolutions `autocast` runs in fp8. `"none"` (default): every
        convolution keeps the compute dtype. `"1x1"`: a 1x1 convolution (any stride, no
        padding or input dilation, one group) is a GEMM over the channels and runs as one
        through `fp8_dot_general`, forward and backward, when that GEMM is eligible (sizes
        as for `dot_general`; `exclude`/`exclude_if` see an `Fp8Site` with `kind="conv"`).
        Off by default because it does not pay on ResNet-50 on the H100 cost model (see
        the performance guide): its 1x1 convs are memory bound and current scaling adds
        amax and quantise passes.
        Other convolutions (3x3, 7x7, grouped, dilated) always keep the compute dtype:
        XLA:GPU runs fp8 forward and stride-1 input-gradient convolutions (cuDNN fp8
        graphs) but no fp8 weight-gradient convolution (its cuDNN backward-filter conv
        upcasts fp8 operands); see `mpjax/fp8/conv.py`. `mpjax.fp8.fp8_ops` lists each
        op's choice and why.

      block_lowering: how the block-scaled recipes' GEMMs run: `"native"` (cuDNN
        block-scaled GEMMs through `jax.nn.scaled_matmul`, MXFP8 and NVFP4 on Blackwell;
        blockwise: mpjax's Pallas Mosaic GPU kernel, fp8 `wgmma` promoted per 128-wide K
        block on Hopper, or its Pallas Triton kernel on a JAX without the Mosaic GPU API
        it uses), `"emulated"` (operands dequantised to the compute dtype: the format's
        numbers on any device) or `"auto"` (native on a GPU of compute capability 10 or
        above, for MXFP8 and NVFP4; blockwise, mpjax's own Pallas GEMM, natively only on a
        GPU class where a measurement in the calibration table says it is faster, which on
        Hopper none does yet: emulated there, see the fp8 guide). Ignored by the other
        scalings.
      high_precision_last: how many of the program's last eligible GEMMs (those left after
        `min_dim`, `exclude` and `exclude_if`; before `choose`) keep the compute dtype
        (forward and both gradients), counted in the order they run in the forward program:
        an int (a count) or a float in `[0, 1)` (a fraction of the eligible GEMMs, rounded
        to the nearest count, halves up). `None` (default): `0.15` for `"nvfp4"`
        (`NVFP4_HIGH_PRECISION_LAST`: NVIDIA's NVFP4 recipe keeps about 15 % of the linear
        layers, the last blocks, and the LM head in BF16), `0` for the other scalings. An
        LM's head, the last GEMM, is the first to stay. GEMMs inside a `lax.scan` / `while`
        body (layers stacked by `nn.scan`) run once for every layer and cannot stay for the
        last layers only: the count stops at the first one it meets from the end, so a
        scanned model keeps the GEMMs after its scan (the head). Read by `autocast` and
        `fp8_ops`, which see the whole program; `apply_policy` (module by module) refuses a
        rule that keeps any GEMM: use `exclude=` there. `fp8_ops` gives each kept GEMM's
        reason.
      high_precision_first: the same from the start of the program (the first GEMMs, after
        the embedding); `None` (default): `NVFP4_HIGH_PRECISION_FIRST` for `"nvfp4"`, `0`
        for the other scalings.

    Raises:
      ValueError: for a non-fp8 dtype, an unknown scaling, amax_compute or convs, a negative
        `high_precision_last` / `high_precision_first` count or a fraction outside `[0, 1)`,
        a margin
        with a block-scaled recipe or outside `[0, 14]` (the bound of float8_e4m3fn: beyond
        it the amax falls below the smallest normal), a history length below 1 or a
        `min_dim` below 16, naming the field.
      TypeError: a field of the wrong type (a string margin, `power_of_two_scale="no"`,
        `exclude=5` or a list of non-strings, `high_precision_last="last"`), naming the field
        and its value.

    Example:
      >>> from mpjax import Fp8Recipe
      >>> recipe = Fp8Recipe(scaling="rowwise", exclude=("*/head",))
      >>> recipe.power_of_two
      True
      >>> nvfp4 = Fp8Recipe(scaling="nvfp4")  # the last 15 % of the GEMMs keep bf16
      >>> nvfp4.high_precision_count(12), nvfp4.high_precision_count(4)
      (2, 1)
      >>> Fp8Recipe(scaling="nvfp4", high_precision_last=0).high_precision_count(12)
      0
    """

    scaling: str = "tensorwise"
    forward_dtype: Any = jnp.float8_e4m3fn
    backward_dtype: Any = jnp.float8_e5m2
    amax_history_len: int = 1024
    amax_compute: str = "max"
    margin: float = 0.0
    power_of_two_scale: bool | None = None
    high_precision_grad_weight: bool = False
    min_dim: int = 64
    exclude: tuple[str, ...] = ()
    exclude_if: Callable[[Fp8Site], bool] | None = None
    convs: str = "none"
    block_lowering: str = "auto"
    choose: str = "fixed"
    target: str | None = None
    high_precision_last: int | float | None = None
    high_precision_first: int | float | None = None

    def __post_init__(self):
        _choice(self.scaling, "scaling", _SCALINGS)
        _choice(self.choose, "choose", _CHOOSE)
        if self.choose == "roofline":
            if self.target not in _TARGETS:
                raise ValueError(
                    f"Fp8Recipe: target={self.target!r}; choose='roofline' plans for a GPU: "
                    f"pass target= one of {_TARGETS}"
                )
            if self.scaling == "delayed":
                raise ValueError(
                    "Fp8Recipe: choose='roofline' with scaling='delayed'; the per-GEMM choice "
                    "needs a stateless scaling ('tensorwise', 'rowwise', 'mxfp8', 'nvfp4', "
                    "'blockwise')"
                )
        elif self.target is not None:
            raise ValueError(
                f"Fp8Recipe: target={self.target!r} is read only with choose='roofline'; "
                "pass choose='roofline' or drop target"
            )
        _choice(self.block_lowering, "block_lowering", _BLOCK_LOWERINGS)
        _choice(self.amax_compute, "amax_compute", _AMAX_COMPUTE)
        _choice(self.convs, "convs", _CONVS)
        forward = _fp8_dtype(self.forward_dtype, "forward_dtype")
        backward = _fp8_dtype(self.backward_dtype, "backward_dtype")
        object.__setattr__(self, "forward_dtype", forward)
        object.__setattr__(self, "backward_dtype", backward)
        history = _integer(self.amax_history_len, "amax_history_len")
        if history < 1:
            raise ValueError(f"Fp8Recipe: amax_history_len={history} must be at least 1")
        object.__setattr__(self, "amax_history_len", history)
        object.__setattr__(self, "margin", _margin(self.margin, forward, backward))
        if self.margin and self.scaling in BLOCK_SCALINGS:
            raise ValueError(
                f"Fp8Recipe: margin={self.margin:g} with scaling={self.scaling!r}; the block-"
                "scaled recipes take each block's scale from its own amax (their specs have no "
                "margin), so it would be ignored: drop margin= (or use scaling='tensorwise', "
                "'rowwise' or 'delayed', which divide their scales by 2**margin)"
            )
        for field in ("power_of_two_scale", "high_precision_grad_weight"):
            object.__setattr__(self, field, _flag(getattr(self, field), field))
        min_dim = _integer(self.min_dim, "min_dim")
        if min_dim < 16:
            raise ValueError(
                f"Fp8Recipe: min_dim={min_dim} must be >= 16 (fp8 GEMM sizes are multiples of 16)"
            )
        object.__setattr__(self, "min_dim", min_dim)
        object.__setattr__(self, "exclude", _patterns(self.exclude))
        for field in ("high_precision_last", "high_precision_first"):
            object.__setattr__(self, field, _high_precision(getattr(self, field), field))
        if self.exclude_if is not None and not callable(self.exclude_if):
            raise TypeError(
                f"Fp8Recipe: exclude_if={self.exclude_if!r} must be a callable taking an "
                "Fp8Site (True keeps the op in the compute dtype), or None"
            )

    @property
    def power_of_two(self) -> bool:
        """Whether scales are rounded down to powers of two (default: rowwise only)."""
        if self.power_of_two_scale is None:
            return self.scaling == "rowwise"
        return bool(self.power_of_two_scale)

    @property
    def high_precision_rule(self) -> int | float:
        """`high_precision_last` with its default resolved (0.15 for NVFP4, else 0)."""
        if self.high_precision_last is None:
            return NVFP4_HIGH_PRECISION_LAST if self.scaling == "nvfp4" else 0
        return self.high_precision_last

    @property
    def high_precision_first_rule(self) -> int | float:
        """`high_precision_first` with its default resolved (NVFP4: `NVFP4_HIGH_PRECISION_FIRST`,
        else 0)."""
        if self.high_precision_first is None:
            return NVFP4_HIGH_PRECISION_FIRST if self.scaling == "nvfp4" else 0
        return self.high_precision_first

    def high_precision_count(self, eligible: int, end: str = "last") -> int:
        """How many of a program's `eligible` GEMMs, at one end, keep the compute dtype.

        Args:
          eligible: the number of GEMMs the recipe would run in its format.
          end: `"last"` (`high_precision_last`) or `"first"` (`high_precision_first`).

        Returns:
          The rule as a count (a fraction rounded to nearest, halves up), at most `eligible`.
        """
        _choice(end, "high_precision_count end", ("last", "first"))
        rule = self.high_precision_rule if end == "last" else self.high_precision_first_rule
        if isinstance(rule, int):
            return min(rule, eligible)
        return min(int(np.floor(rule * eligible + 0.5)), eligible)

    def excludes(self, site: Fp8Site) -> bool:
        """Whether the user excluded `site` by name pattern or predicate."""
        if any(fnmatch.fnmatchcase(site.name, p) for p in self.exclude):
            return True
        return bool(self.exclude_if(site)) if self.exclude_if is not None else False
