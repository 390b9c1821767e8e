"""The one dispatch point of the Pallas kernels: `impl` in {"auto", "pallas", "interpret", "xla"}.

Every kernel in `mpjax.pallas` calls `dispatch` with a Pallas implementation (the kernel, run
compiled for the GPU or in Pallas interpret mode) and an XLA reference (plain `jax.numpy`).
`"auto"` stages both out behind `jax.lax.platform_dependent`: the Pallas kernel when the program
runs on a CUDA GPU, the XLA reference elsewhere; unsupported inputs go to XLA on every platform.

The kernels are written for Pallas's Triton backend, which JAX deprecates from 0.11 (every
lowering warns "The Pallas Triton backend is deprecated ..."). On those versions
(`TRITON_DEPRECATED`) `"auto"` runs the XLA reference on every platform for a Triton kernel,
so nothing mpjax picks by itself lowers through the deprecated backend; `impl="pallas"` still
lowers the Triton kernel, with JAX's warning. A Mosaic GPU kernel (`triton=False`: the Hopper
blockwise GEMM) is not affected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["IMPLS", "TRITON_DEPRECATED", "check_impl", "dispatch", "jax_version"]

IMPLS = ("auto", "pallas", "interpret", "xla")


def jax_version() -> tuple[int, int]:
    """`(major, minor)` of the installed jax, e.g. `(0, 12)` for 0.12.0.1."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


# jax >= 0.11 deprecates the Pallas Triton backend the kernels lower through.
TRITON_DEPRECATED = jax_version() >= (0, 11)


def check_impl(impl: Any, where: str) -> str:
    """Returns `impl` if it is one of `IMPLS`, else raises a ValueError naming `where`."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{where}: impl must be one of {IMPLS}, got {impl!r}")
    return impl


def dispatch(
    where: str,
    impl: str,
    args: Sequence[Any],
    *,
    kernel: Callable[..., Any],
    reference: Callable[..., Any],
    unsupported: str | None = None,
    triton: bool = True,
) -> Any:
    """Runs `kernel` or `reference` on `args` as `impl` asks.

    Args:
      where: the public function's name, for error messages.
      impl: "pallas" (the kernel compiled for the GPU), "interpret" (the same kernel body in
        Pallas interpret mode, any platform), "xla" (the reference) or "auto" (the kernel on
        CUDA GPUs, the reference elsewhere, chosen when the program is lowered; the reference
        everywhere where JAX deprecates the Triton backend, `TRITON_DEPRECATED`).
      args: positional arguments (pytrees of arrays) for both implementations.
      kernel: `kernel(*args, interpret=bool)`, the Pallas implementation.
      reference: `reference(*args)`, the XLA implementation; same outputs as `kernel`.
      unsupported: None if the kernel takes these inputs, else the reason it does not.
        "auto" then uses the reference; "pallas" and "interpret" raise a ValueError.
      triton: whether `kernel` lowers through Pallas's Triton backend (for "auto": the
        reference where JAX deprecates it); False for a Mosaic GPU kernel.

    Returns:
      The outputs of the chosen implementation.
    """
    impl = check_impl(impl, where)
    if impl == "xla":
        return reference(*args)
    if unsupported is not None:
        if impl == "auto":
            return reference(*args)
        raise ValueError(f"{where}: impl={impl!r} cannot run on these inputs: {unsupported}")
    if impl == "interpret":
        return kernel(*args, interpret=True)
    if impl == "pallas":
        return kernel(*args, interpret=False)
    if TRITON_DEPRECATED and triton:
        return reference(*args)
    return jax.lax.platform_dependent(
        *args, cuda=lambda *a: kernel(*a, interpret=False), default=reference
    )
