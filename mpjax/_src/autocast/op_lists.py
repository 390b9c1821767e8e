"""`OpLists`: which JAX primitives `mpjax.autocast` runs in low precision and which in float32.

The lists are immutable data (frozensets of primitive names in a frozen dataclass), in the
spirit of MXNet AMP's `target_precision_ops` / `fp32_ops` / `conditional_fp32_ops` and
`torch.autocast`'s op lists. A user reads them, derives a changed copy with `with_added` /
`with_removed` / `replace`, and passes it to `autocast(..., op_lists=...)`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any, NamedTuple

from jax import lax
from jax.extend.core import Primitive
from jax.extend.core import primitives as _prims

__all__ = [
    "ConditionalFP32",
    "DEFAULT_CONDITIONAL_FP32",
    "DEFAULT_EPILOGUE",
    "DEFAULT_FP32",
    "DEFAULT_LOWER_PRECISION",
    "OpLists",
    "STRUCTURAL_PRIMITIVES",
]

# Primitives autocast recurses into; they carry sub-jaxprs and cannot be put in a list.
STRUCTURAL_PRIMITIVES: frozenset[str] = frozenset(
    {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "scan", "while", "cond", "remat2"}
)

# Matmul-like ops: compute-dtype operands and result, float32 accumulation.
DEFAULT_LOWER_PRECISION: frozenset[str] = frozenset({"dot_general", "conv_general_dilated"})

# Precision-sensitive ops: run in float32 (or wider, if an input is wider).
DEFAULT_FP32: frozenset[str] = frozenset(
    {
        # exponentials, logarithms, powers
        "exp", "exp2", "log", "log1p", "expm1", "pow", "square", "rsqrt", "logistic",
        # x ** n, jnp.reciprocal, jnp.square of a weak exponent (torch: pow, reciprocal)
        "integer_pow",
        # trigonometric / hyperbolic ops with large relative error near their poles
        "tan", "acos", "asin", "acosh", "asinh", "atanh", "cosh", "sinh", "atan2",
        # special functions
        "erf_inv", "lgamma", "digamma", "igamma", "igammac", "polygamma", "zeta",
        "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "igamma_grad_a",
        # reductions (softmax, norms, losses) and scans
        "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin",
        "cumsum", "cumprod", "cumlogsumexp", "cummax", "cummin",
        # scatter reductions: a segment sum (jax.ops.segment_sum, GNN message aggregation)
        # is a sum, not data movement (torch promotes scatter_add/index_put; a sum runs in
        # float32 there, as here)
        "scatter-add", "scatter-mul",
        # linear algebra and FFT (no low-precision kernels, ill-conditioned in bf16)
        "cholesky", "eig", "eigh", "lu", "qr", "svd", "schur", "hessenberg",
        "householder_product", "triangular_solve", "tridiagonal", "tridiagonal_solve", "fft",
    }
)  # fmt: skip


# Ops that, as the bias add of a lower-precision op, stay in the compute dtype.
DEFAULT_EPILOGUE: frozenset[str] = frozenset({"add"})


class ConditionalFP32(NamedTuple):
    """A primitive that runs in float32 when `params[param]` is one of `values`.

    Attributes:
      primitive: primitive name, e.g. `"dot_general"`.
      param: name of the primitive's parameter to look at, e.g. `"precision"`.
      values: parameter values that force float32.
    """

    primitive: str
    param: str
    values: tuple


_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)

# A matmul the user asked for at HIGHEST precision keeps float32 operands.
DEFAULT_CONDITIONAL_FP32: tuple[ConditionalFP32, ...] = (
    ConditionalFP32("dot_general", "precision", (_HIGHEST,)),
    ConditionalFP32("conv_general_dilated", "precision", (_HIGHEST,)),
)


def _known_primitive_names() -> frozenset[str]:
    names = {p.name for p in vars(_prims).values() if isinstance(p, Primitive)}
    return frozenset(names | STRUCTURAL_PRIMITIVES | {"ragged_dot_general"})


_KNOWN = _known_primitive_names()


def _op_name(op: Any, where: str) -> str:
    """Normalises a list entry (a primitive name or a `Primitive`) to its name."""
    if isinstance(op, Primitive):
        name = op.name
    elif isinstance(op, str):
        name = op.strip()
        if not name:
            raise ValueError(f"OpLists.{where}: empty primitive name")
        if name not in _KNOWN:
            close = difflib.get_close_matches(name, sorted(_KNOWN), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"OpLists.{where}: unknown primitive {name!r}{hint} (for a primitive that "
                "jax.extend.core.primitives does not list, pass the Primitive object)"
            )
    else:
        raise TypeError(
            f"OpLists.{where}: entries must be primitive names (str) or jax Primitives, "
            f"got {op!r} of type {type(op).__name__}"
        )
    if name in STRUCTURAL_PRIMITIVES:
        raise ValueError(
            f"OpLists.{where}: {name!r} holds sub-jaxprs that autocast recurses into; "
            "it cannot be listed (list the primitives inside it instead)"
        )
    return name


def _name_set(ops: Any, where: str) -> frozenset[str]:
    if isinstance(ops, (str, Primitive)) or not isinstance(ops, Iterable):
        raise TypeError(
            f"OpLists.{where}: expected an iterable of primitive names, got {ops!r}; "
            f"wrap a single name in a tuple, e.g. ({ops!r},)"
        )
    return frozenset(_op_name(op, where) for op in ops)


def _conditional(entries: Any) -> tuple[ConditionalFP32, ...]:
    if isinstance(entries, (str, ConditionalFP32)) or not isinstance(entries, Iterable):
        raise TypeError(
            f"OpLists.conditional_fp32: expected an iterable of (primitive, param, values) "
            f"triples, got {entries!r}"
        )
    out = []
    for entry in entries:
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise TypeError(
                "OpLists.conditional_fp32: each entry is a (primitive, param, values) triple, "
                f"got {entry!r}"
            )
        prim, param, values = entry
        name = _op_name(prim, "conditional_fp32")
        if not isinstance(param, str) or not param:
            raise TypeError(
                f"OpLists.conditional_fp32: parameter name of {name!r} must be a non-empty "
                f"str, got {param!r}"
            )
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(
                f"OpLists.conditional_fp32: values for {name}.{param} must be a tuple of "
                f"parameter values, got {values!r}"
            )
        out.append(ConditionalFP32(name, param, tuple(values)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class OpLists:
    """Immutable op lists that steer `mpjax.autocast`.

    A primitive in `lower_precision` takes compute-dtype floating operands (matmul-like ops
    with a `preferred_element_type` parameter accumulate in the accumulation dtype); one in
    `fp32` runs in float32 (never narrower than its widest input); one matching an entry of
    `conditional_fp32` runs in float32 when its parameter has one of the listed values (this
    takes precedence over `lower_precision`). Every other primitive runs in the widest dtype of
    its floating inputs, except an `epilogue` op that adds a smaller, broadcast operand (a
    bias) to the output of a lower-precision op: it stays in the compute dtype, as the bias
    add inside torch's `linear`/`conv` does. Integer and boolean values are never cast.

    Attributes:
      lower_precision: primitive names run in the compute dtype (MXNet `target_precision_ops`).
      fp32: primitive names run in float32 (MXNet `fp32_ops`).
      conditional_fp32: `ConditionalFP32(primitive, param, values)` entries (MXNet
        `conditional_fp32_ops`).
      epilogue: primitive names kept in the compute dtype as the bias add of a
        lower-precision op; `frozenset()` gives the plain widest-input rule everywhere
        (it also turns off autocast's normalisation rule, which keeps a compute-dtype
        value normalised by broadcast float32 statistics in the compute dtype).

    Example:
      >>> from mpjax import OpLists
      >>> lists = OpLists().with_added(fp32=["tanh"]).with_removed("argmax")
      >>> "tanh" in lists.fp32, "argmax" in lists.fp32
      (True, False)
    """

    lower_precision: frozenset[str] = DEFAULT_LOWER_PRECISION
    fp32: frozenset[str] = DEFAULT_FP32
    conditional_fp32: tuple[ConditionalFP32, ...] = DEFAULT_CONDITIONAL_FP32
    epilogue: frozenset[str] = DEFAULT_EPILOGUE

    def __post_init__(self):
        lower = _name_set(self.lower_precision, "lower_precision")
        fp32 = _name_set(self.fp32, "fp32")
        both = sorted(lower & fp32)
        if both:
            raise ValueError(
                f"OpLists: {', '.join(map(repr, both))} listed in both lower_precision and "
                "fp32; an op runs in one precision (use with_added, which moves an op)"
            )
        object.__setattr__(self, "lower_precision", lower)
        object.__setattr__(self, "fp32", fp32)
        object.__setattr__(self, "conditional_fp32", _conditional(self.conditional_fp32))
        object.__setattr__(self, "epilogue", _name_set(self.epilogue, "epilogue"))

    def replace(self, **changes: Any) -> OpLists:
        """Returns a copy with the given fields replaced (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    def with_added(
        self,
        *,
        lower_precision: Iterable[Any] = (),
        fp32: Iterable[Any] = (),
        conditional_fp32: Iterable[Any] = (),
    ) -> OpLists:
        """Returns a copy with ops added; an op added to one list leaves the other.

        Args:
          lower_precision: primitives (names or objects) to run in the compute dtype.
          fp32: primitives to run in float32.
          conditional_fp32: `(primitive, param, values)` triples to append.

        Returns:
          The new `OpLists`.
        """
        add_lower = _name_set(lower_precision, "lower_precision")
        add_fp32 = _name_set(fp32, "fp32")
        both = sorted(add_lower & add_fp32)
        if both:
            raise ValueError(
                f"OpLists.with_added: {', '.join(map(repr, both))} given for both "
                "lower_precision and fp32"
            )
        return OpLists(
            lower_precision=(self.lower_precision - add_fp32) | add_lower,
            fp32=(self.fp32 - add_lower) | add_fp32,
            conditional_fp32=self.conditional_fp32 + _conditional(conditional_fp32),
            epilogue=self.epilogue,
        )

    def with_removed(self, *ops: Any) -> OpLists:
        """Returns a copy without `ops` in any list (they then follow the widest-input rule).

        Args:
          *ops: primitive names or objects.

        Returns:
          The new `OpLists`.
        """
        names = _name_set(ops, "with_removed")
        return OpLists(
            lower_precision=self.lower_precision - names,
            fp32=self.fp32 - names,
            conditional_fp32=tuple(c for c in self.conditional_fp32 if c.primitive not in names),
            epilogue=self.epilogue - names,
        )

    def category(self, name: str, params: Any) -> str | None:
        """Returns `"fp32"`, `"lower"` or `None` for a primitive `name` with `params`."""
        for cond in self.conditional_fp32:
            if cond.primitive == name and any(params.get(cond.param) == v for v in cond.values):
                return "fp32"
        if name in self.fp32:
            return "fp32"
        if name in self.lower_precision:
            return "lower"
        return None
