"""Lowering the Pallas kernels for CUDA on a machine without a GPU (jax >= 0.11).

From jax 0.11 the Triton lowering asks which GPU it lowers for, and on a host without one
fails ("No supported GPU devices found, please specify an abstract GPU device using
AbstractDevice"). `abstract_gpu` names that GPU through the abstract mesh in context, as JAX
asks; up to jax 0.10 the lowering needs nothing and `abstract_gpu` does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax

from mpjax._src.kernels.dispatch import jax_version

__all__ = ["H100_DEVICE_KIND", "abstract_gpu", "needs_abstract_gpu"]

# The device kind of an H100 SXM, as a CUDA jaxlib reports it (compute capability 9.0).
H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


def needs_abstract_gpu(platforms: Sequence[str] | None) -> bool:
    """Whether lowering for `platforms` here needs an abstract GPU device.

    Args:
      platforms: the lowering platforms (e.g. `("cpu", "cuda")`); None for the default backend.

    Returns:
      True on jax >= 0.11 when `platforms` holds "cuda", this process has no GPU backend and
      the abstract mesh in context names no device yet.
    """
    if jax_version() < (0, 11) or platforms is None or "cuda" not in tuple(platforms):
        return False
    if jax.default_backend() == "gpu":
        return False
    return jax.sharding.get_abstract_mesh().abstract_device is None


@contextlib.contextmanager
def abstract_gpu(
    platforms: Sequence[str] | None = ("cuda",), device_kind: str = H100_DEVICE_KIND
) -> Iterator[None]:
    """While lowering for `platforms`: the abstract mesh in context names a `device_kind` GPU.

    The mesh's axes (those of `jax.set_mesh` or `jax.sharding.use_abstract_mesh`, if any) are
    kept; only its device is added. Does nothing where `needs_abstract_gpu(platforms)` is
    False (jax <= 0.10, a GPU present, no "cuda" platform, a device already named).

    Args:
      platforms: the platforms the code in the block lowers for.
      device_kind: the GPU the Triton kernels are lowered for (its compute capability picks
        the Triton target), e.g. "NVIDIA H100 80GB HBM3" or "NVIDIA B200".

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax._src.kernels.gpu_target import abstract_gpu
      >>> with abstract_gpu():
      ...     lowered = jax.jit(jnp.sin).trace(1.0).lower(lowering_platforms=("cuda",))
    """
    if not needs_abstract_gpu(platforms):
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = jax.sharding.get_abstract_mesh().update(abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield
