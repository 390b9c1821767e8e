"""The precision `Policy`: param, compute and output dtypes, and its spec-string grammar."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.core.text import excerpt

__all__ = [
    "DTYPE_NAMES",
    "KERAS_POLICY_NAMES",
    "Policy",
    "cast_floating",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
]

# Names accepted in a policy spec, mapped to canonical dtypes.
DTYPE_NAMES: dict[str, Any] = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "full": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "half": jnp.bfloat16,
    "float16": jnp.float16,
    "f16": jnp.float16,
    "float64": jnp.float64,
    "f64": jnp.float64,
}

# Keras mixed-precision policy names, as Keras means them: variables (params) in the first
# dtype, layers computing in the second, and (Keras layers return their compute dtype) outputs
# in the compute dtype.
KERAS_POLICY_NAMES: dict[str, tuple[Any, Any, Any]] = {
    "mixed_bfloat16": (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    "mixed_float16": (jnp.float32, jnp.float16, jnp.float16),
}

# fp8 formats `Policy.saved_activations` takes (spec key `saved=`), by name.
SAVED_DTYPE_NAMES: dict[str, Any] = {
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "e4m3": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "e5m2": jnp.float8_e5m2,
}

_KEYS = {
    "params": "params",
    "p": "params",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
    "reduce": "reduce",
    "r": "reduce",
    "saved": "saved",
    "s": "saved",
}


# The floating dtypes a policy may hold: fp8 runs through `Fp8Recipe` (scaled), never as a
# plain cast, and float4/float6 formats are storage formats, not compute dtypes.
POLICY_DTYPES = tuple(jnp.dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))


def as_float_dtype(value: Any, what: str) -> np.dtype:
    """Normalises `value` with `jnp.dtype` and refuses anything non-floating.

    `None` is refused too: `jnp.dtype(None)` is NumPy's default, float64.
    """
    if value is None:
        raise ValueError(
            f"{what}: None is not a dtype (NumPy would read it as float64); "
            f"use one of {sorted(DTYPE_NAMES)}"
        )
    if isinstance(value, str) and value.strip().lower() in DTYPE_NAMES:
        value = DTYPE_NAMES[value.strip().lower()]
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(
            f"{what}: {excerpt(value)} is not a dtype; use one of {sorted(DTYPE_NAMES)}"
        ) from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{what}: {dtype.name} is not a floating dtype; a policy holds floating "
            f"dtypes only ({sorted(DTYPE_NAMES)})"
        )
    return dtype


def as_policy_dtype(value: Any, what: str) -> np.dtype:
    """`as_float_dtype`, refusing the floating dtypes a policy cannot hold (fp8, fp4, ...)."""
    dtype = as_float_dtype(value, what)
    if dtype not in POLICY_DTYPES:
        hint = (
            "; fp8 GEMMs are configured with mpjax.fp8.Fp8Recipe (autocast(fp8=...), "
            "apply_policy(fp8=...)), which scales operands before the cast"
            if dtype.itemsize == 1
            else ""
        )
        raise ValueError(
            f"{what}: {dtype.name} cannot be a policy dtype; a policy holds "
            f"{', '.join(d.name for d in POLICY_DTYPES)}{hint}"
        )
    return dtype


def as_saved_dtype(value: Any) -> np.dtype | None:
    """Normalises `Policy.saved_activations`: None, or an fp8 format (e4m3fn or e5m2)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in SAVED_DTYPE_NAMES:
        value = SAVED_DTYPE_NAMES[value.strip().lower()]
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in {jnp.dtype(d) for d in SAVED_DTYPE_NAMES.values()}:
        raise ValueError(
            f"Policy.saved_activations: {excerpt(value)} is not an fp8 format; use None, "
            "'float8_e4m3fn' (e4m3: 3 mantissa bits, the precise one) or 'float8_e5m2'"
        )
    return dtype


def is_floating_array(x: Any) -> bool:
    return (
        isinstance(x, (jax.Array, np.ndarray, np.generic))
        and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
        and jnp.issubdtype(x.dtype, jnp.floating)
    )


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating array leaves of `tree` to `dtype`; every other leaf passes through.

    Leaves already in `dtype` are returned as they are, so no convert op is traced.

    Args:
      tree: any pytree.
      dtype: target floating dtype.

    Returns:
      A pytree of the same structure.
    """
    dtype = jnp.dtype(dtype)

    def cast(x):
        if is_floating_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def half_dtype() -> np.dtype:
    """The half-precision dtype of the default backend, as `jmp.half_dtype`: bfloat16 on TPU,
    float16 elsewhere.

    Note that in a policy spec the name `"half"` always means bfloat16 (jmp reads it as
    `half_dtype()`); write `f"c={half_dtype().name}"` for jmp's meaning.

    Returns:
      `dtype(bfloat16)` when the first local device is a TPU, else `dtype(float16)`.

    Example:
      >>> from mpjax import half_dtype
      >>> half_dtype()  # on CPU or GPU
      dtype('float16')
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return jnp.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def cast_to_full(tree: Any) -> Any:
    """Casts the floating array leaves of `tree` to float32, as `jmp.cast_to_full`.

    Args:
      tree: any pytree; non-floating leaves pass through.

    Returns:
      The same structure with float32 floating arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import cast_to_full
      >>> cast_to_full({"w": jnp.ones(2, jnp.bfloat16), "step": 3})["w"].dtype
      dtype('float32')
    """
    return cast_floating(tree, jnp.float32)


def cast_to_half(tree: Any) -> Any:
    """Casts the floating array leaves of `tree` to `half_dtype()`, as `jmp.cast_to_half`.

    Args:
      tree: any pytree; non-floating leaves pass through.

    Returns:
      The same structure with floating arrays in `half_dtype()` (float16 off TPU).

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import cast_to_half
      >>> cast_to_half(jnp.ones(2)).dtype  # on CPU or GPU
      dtype('float16')
    """
    return cast_floating(tree, half_dtype())


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of parameters, computation and outputs.

    Frozen and hashable, so it can be a static argument of `jax.jit`. Dtypes are
    normalised with `jnp.dtype`; `None` (NumPy's float64), non-floating dtypes and the
    floating dtypes a policy cannot hold (fp8: see `mpjax.fp8.Fp8Recipe`) are refused with
    a `ValueError` naming the field.

    Attributes:
      param_dtype: dtype parameters are stored in.
      compute_dtype: dtype matmuls and convolutions run in.
      output_dtype: dtype a module's outputs leave in.
      reduce_dtype: dtype the weight gradients of `Dense`-like GEMMs leave their GEMM in, so
        the dtype XLA sums them across devices in under data parallelism / FSDP (PyTorch
        FSDP's `reduce_dtype`), then converted once to the compute dtype; None (the default)
        leaves them in the compute dtype, as without a policy.
      saved_activations: None (the default), or an fp8 format (`"float8_e4m3fn"`): the
        activation input of each GEMM (`Dense`, `Conv`, an autocast `dot_general` without
        batch dimensions whose operand is not a parameter) is kept for the backward pass
        as fp8 with a float32 scale per row (current scaling), instead of in the compute
        dtype; the GEMM itself still runs in the compute dtype. Halves the memory of the
        saved GEMM inputs (see the memory guide and `mpjax.fp8.saved_activations_policy`).

    Example:
      >>> from mpjax import Policy
      >>> p = Policy("float32", "bfloat16", "float32")
      >>> str(p)
      'params=float32,compute=bfloat16,output=float32'
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    reduce_dtype: Any = None
    saved_activations: Any = None

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if field == "reduce_dtype" and value is None:
                continue
            object.__setattr__(self, field, as_policy_dtype(value, f"Policy.{field}"))
        object.__setattr__(self, "saved_activations", as_saved_dtype(self.saved_activations))

    def cast_to_param(self, tree: Any) -> Any:
        """Casts floating leaves of `tree` to `param_dtype`; other leaves pass through."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts floating leaves of `tree` to `compute_dtype`; other leaves pass through."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts floating leaves of `tree` to `output_dtype`; other leaves pass through."""
        return cast_floating(tree, self.output_dtype)

    def with_reduce_dtype(self, reduce_dtype: Any) -> Policy:
        """Returns this policy with `reduce_dtype` replaced (a dtype, a name, or None).

        Example:
          >>> import mpjax
          >>> mpjax.get_policy("c=f16").with_reduce_dtype("f32").reduce_dtype
          dtype('float32')
        """
        return dataclasses.replace(self, reduce_dtype=reduce_dtype)

    def with_saved_activations(self, saved_activations: Any) -> Policy:
        """Returns this policy with `saved_activations` replaced (an fp8 format or None).

        Example:
          >>> import mpjax
          >>> str(mpjax.get_policy("c=bf16").with_saved_activations("float8_e4m3fn"))
          'params=float32,compute=bfloat16,output=bfloat16,saved=float8_e4m3fn'
        """
        return dataclasses.replace(self, saved_activations=saved_activations)

    def with_output_param_dtype(self) -> Policy:
        """Returns this policy with `output_dtype` set to `param_dtype`."""
        return dataclasses.replace(self, output_dtype=self.param_dtype)

    def with_param_dtype(self, param_dtype: Any) -> Policy:
        """Returns this policy with `param_dtype` replaced (a dtype or a name such as "f32").

        Example:
          >>> from mpjax import get_policy
          >>> get_policy("c=bf16").with_param_dtype("bf16") == get_policy("bf16")
          True
        """
        return dataclasses.replace(self, param_dtype=param_dtype)

    def with_compute_dtype(self, compute_dtype: Any) -> Policy:
        """Returns this policy with `compute_dtype` replaced (a dtype or a name such as "bf16").

        Example:
          >>> from mpjax import get_policy
          >>> str(get_policy("f32").with_compute_dtype("f16"))
          'params=float32,compute=float16,output=float32'
        """
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """Returns this policy with `output_dtype` replaced, as jmp's `Policy.with_output_dtype`.

        Example:
          >>> import jax.numpy as jnp
          >>> from mpjax import get_policy
          >>> str(get_policy("c=bf16").with_output_dtype(jnp.float32))
          'params=float32,compute=bfloat16,output=float32'
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    @property
    def is_mixed(self) -> bool:
        """Whether compute runs below the parameter precision."""
        return self.compute_dtype.itemsize < self.param_dtype.itemsize

    def __str__(self) -> str:
        text = (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )
        if self.reduce_dtype is not None:
            text += f",reduce={self.reduce_dtype.name}"
        if self.saved_activations is not None:
            text += f",saved={self.saved_activations.name}"
        return text


def get_policy(spec: str | Policy) -> Policy:
    """Parses a policy spec in jmp's grammar, or a Keras policy name.

    `"params=float32,compute=bfloat16,output=float32"`; short keys `p=`, `c=`, `o=`;
    `reduce=`/`r=` sets `Policy.reduce_dtype` (unset: None); `saved=`/`s=` sets
    `Policy.saved_activations` (`float8_e4m3fn`/`e4m3` or `float8_e5m2`/`e5m2`);
    dtype names `float32/f32/full`, `bfloat16/bf16/half`, `float16/f16`,
    `float64/f64`; a bare name sets all three. Params default to float32, compute to
    params, output to compute. `get_policy(str(p)) == p` for every policy. Unlike jmp,
    `half` is always bfloat16 (see `half_dtype`).

    Keras's names mean what they mean in Keras: `"mixed_bfloat16"` and `"mixed_float16"`
    are float32 params with bfloat16 / float16 compute and outputs (a Keras layer returns
    its compute dtype; `apply_policy`'s defaults still give float32 logits); `"float32"`,
    `"bfloat16"`, `"float16"` are one dtype for all three, as bare names already are.

    Args:
      spec: a spec string, or a `Policy` (returned as is).

    Returns:
      The `Policy`.

    Raises:
      ValueError: naming the bad key or value and listing the valid ones.

    Example:
      >>> from mpjax import get_policy
      >>> get_policy("p=f32,c=bf16").output_dtype
      dtype(bfloat16)
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"get_policy expects a spec string or a Policy, got {type(spec).__name__}")
    text = spec.strip()
    quoted = excerpt(spec)  # errors quote at most 200 characters of a long spec
    if not text:
        raise ValueError("empty policy spec; e.g. 'params=float32,compute=bfloat16'")

    def dtype_of(name: str, where: str):
        key = name.strip().lower()
        if key not in DTYPE_NAMES:
            raise ValueError(
                f"unknown dtype {excerpt(name.strip())} in {where} of policy spec {quoted}; "
                f"valid dtypes: {', '.join(sorted(DTYPE_NAMES))}"
            )
        return DTYPE_NAMES[key]

    if text.lower() in KERAS_POLICY_NAMES:
        return Policy(*KERAS_POLICY_NAMES[text.lower()])
    if "=" not in text:
        if text.lower() not in DTYPE_NAMES:
            raise ValueError(
                f"unknown policy name {excerpt(text)}; use a dtype "
                f"({', '.join(sorted(DTYPE_NAMES))}), "
                f"a Keras policy name ({', '.join(KERAS_POLICY_NAMES)}) or key=dtype entries, "
                "e.g. 'params=float32,compute=bfloat16'"
            )
        dtype = dtype_of(text, "the bare name")
        return Policy(dtype, dtype, dtype)

    values: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            raise ValueError(f"empty entry in policy spec {quoted}")
        if "=" not in part:
            raise ValueError(
                f"entry {excerpt(part.strip())} in policy spec {quoted} is not key=dtype; "
                f"valid keys: {', '.join(sorted(_KEYS))}"
            )
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in _KEYS:
            raise ValueError(
                f"unknown key {excerpt(key)} in policy spec {quoted}; "
                f"valid keys: {', '.join(sorted(_KEYS))}"
            )
        canon = _KEYS[key]
        if canon in values:
            raise ValueError(f"key {canon!r} given twice in policy spec {quoted}")
        if canon == "saved":
            values[canon] = as_saved_dtype(value.strip())
            continue
        values[canon] = dtype_of(value, f"key {key!r}")

    params = values.get("params", jnp.float32)
    compute = values.get("compute", params)
    output = values.get("output", compute)
    return Policy(params, compute, output, values.get("reduce"), values.get("saved"))
