"""Deviceless XLA:GPU targets: compile a program for H100s on a machine without a GPU.

Needs the `gpu-aot` extra (the CUDA plugin wheels, installed `--no-deps`) and
`JAX_PLATFORMS=cpu`; the target description is the one shipped with mpjax (`h100.txtpb`:
compute capability 9.0, 132 SMs, shared memory, registers, L2, bandwidth of an H100 SXM).

JAX asks the cuDNN library for its version while tracing a cuDNN fused attention
(`jax.nn.dot_product_attention(..., implementation="cudnn")`); the gpu-aot environment has no
cuDNN library (XLA needs none to compile the call), so `lower_step` declares the target's
version, `H100_CUDNN_VERSION` (the oldest the pinned CUDA plugin accepts), where none is found.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "B200_TARGET",
    "H100_CUDNN_VERSION",
    "H100_TARGET",
    "compile_step",
    "h100_sharding",
    "h100_topology",
    "lower_step",
    "target_cudnn",
]

H100_TARGET = Path(__file__).resolve().parent / "h100.txtpb"
# A B200 (compute capability 10.0, 148 SMs, 8 TB/s HBM3e) declaring cuDNN 9.10, so that
# block-scaled GEMMs (`jax.nn.scaled_matmul`) lower to `__cudnn$blockScaledDot`.
B200_TARGET = Path(__file__).resolve().parent / "b200.txtpb"
H100_CUDNN_VERSION = 90800  # cuDNN 9.8: jax-cuda12-plugin 0.10 requires >= 9.8, < 10


@contextlib.contextmanager
def target_cudnn(version: int = H100_CUDNN_VERSION) -> Iterator[None]:
    """While tracing for the deviceless target: cuDNN's version is `version` if none is found.

    Where the cuDNN library is installed, its own version is used and nothing changes.
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa

    check = fa.check_cudnn_version
    try:
        check()
        found = True
    except (RuntimeError, SystemError):  # "cuDNN not found."; the CUDA 13 plugin: SystemError
        found = False
    if found:
        yield
        return
    fa.check_cudnn_version = lambda: version
    try:
        yield
    finally:
        fa.check_cudnn_version = check


def h100_topology(topology: str = "1x1x1", target: Path = H100_TARGET) -> Any:
    """The deviceless H100 topology (`"1x1x1"`, `"1x1x8"`, `"2x1x4"`: hosts x ? x GPUs).

    `target=B200_TARGET` gives B200s instead. Raises whatever JAX raises when the CUDA
    plugin is not installed.
    """
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="cuda", target_config=Path(target).read_text(), topology=topology
    )


def h100_sharding() -> jax.sharding.Sharding:
    """The single-device sharding of a deviceless H100 (raises if the plugin is missing)."""
    return jax.sharding.make_single_device_sharding(h100_topology().devices[0])


def lower_step(step, args, sharding, donate_argnums=(0,)):
    """`jax.jit(step)` lowered for the deviceless target on abstract `args`.

    On one device (a single-device sharding) the trace runs under that device's one-device
    abstract mesh, so that what is traced can tell which GPU it is for (the operands of a
    multi-device `NamedSharding` carry their mesh already): `block_lowering="auto"` then
    lowers as on that GPU.
    """
    placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), args)
    with target_cudnn(), _device_in_context(sharding):
        return jax.jit(step, donate_argnums=donate_argnums).trace(*placed).lower()


@contextlib.contextmanager
def _device_in_context(sharding) -> Iterator[None]:
    """The one-device abstract mesh of a single-device sharding's device, in context."""
    if isinstance(sharding, jax.sharding.NamedSharding) or len(sharding.device_set) != 1:
        yield
        return
    import numpy as np
    from jax._src import mesh as mesh_lib  # use_abstract_mesh: not public in jax 0.10

    (device,) = sharding.device_set
    mesh = jax.sharding.Mesh(np.array([device]), ("device",))
    with mesh_lib.use_abstract_mesh(mesh.abstract_mesh):
        yield


def compile_step(step, args, sharding, donate_argnums=(0,)):
    """`jax.jit(step)` compiled for the deviceless target on abstract `args`."""
    return lower_step(step, args, sharding, donate_argnums).compile()
