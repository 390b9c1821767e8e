"""Compile targets of `mpjax.report`: the current backend, or deviceless H100s.

`None` compiles for the backend JAX runs on. `"h100"` compiles for one H100 without a GPU;
`"h100xN"` (N in 2, 4, 8) for N H100s of one host (topology `1x1xN`). Deviceless targets need
the `gpu-aot` extra and `JAX_PLATFORMS=cpu`. On an `"h100xN"` target every argument leaf whose
sharding is a `NamedSharding` keeps its `PartitionSpec` on a mesh of the same shape and axis
names over the N H100s (write the step with a mesh of N CPU devices, as for the GPUs); every
other leaf is replicated. Shardings named inside `fn` (`with_sharding_constraint` on a CPU
mesh, `jit(in_shardings=...)`) are not moved: pass them through the arguments instead.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import numpy as np

from mpjax._src.analysis.target import h100_topology

__all__ = [
    "KNOWN_TARGETS",
    "Target",
    "compile_hint",
    "gpu_aot_install",
    "place_args",
    "resolve_target",
]

KNOWN_TARGETS = (None, "h100", "h100x2", "h100x4", "h100x8")
_H100 = re.compile(r"^h100(?:x(\d+))?$")


class Target(NamedTuple):
    """A resolved compile target."""

    name: str  # "cpu", "gpu", ..., "h100", "h100x8"
    devices: tuple  # the deviceless devices; () for the current backend
    gpu: bool  # a roofline estimate applies


def gpu_aot_install(jaxlib_version: str | None = None) -> str:
    """How to install the deviceless CUDA compiler matching `jaxlib_version` (the installed one).

    The plugin wheels must be exactly jaxlib's version; jaxlib 0.12.1 ships CUDA 13 plugins only.
    """
    if jaxlib_version is None:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    release = tuple(int(p) for p in re.findall(r"\d+", jaxlib_version)[:3])
    cuda = 13 if release >= (0, 12, 1) else 12
    return (
        f"pip install --no-deps jax-cuda{cuda}-plugin=={jaxlib_version} "
        f"jax-cuda{cuda}-pjrt=={jaxlib_version} (the gpu-aot extra, best in a separate "
        "environment) and run with JAX_PLATFORMS=cpu"
    )


def compile_hint(message: str) -> str:
    """What to do about a deviceless compile error `message`; "" when mpjax knows nothing."""
    if "deviceless cudnn compilation" in message.lower():
        return (
            ". On jaxlib >= 0.12 XLA compiles cuDNN calls (fused attention, block-scaled GEMMs) "
            "only with a GPU driver present. Compile in an environment on jax 0.10.2: "
            f"{gpu_aot_install('0.10.2')}; or ask for "
            'jax.nn.dot_product_attention(..., implementation="xla").'
        )
    return ""


def resolve_target(target: str | None) -> Target:
    """The `Target` named by `target`; a clear error for unknown names or a missing plugin."""
    if target is None:
        backend = jax.default_backend()
        return Target(backend, (), backend in ("gpu", "cuda", "rocm"))
    m = _H100.match(target) if isinstance(target, str) else None
    if m is None or target not in KNOWN_TARGETS:
        known = ", ".join(repr(t) for t in KNOWN_TARGETS)
        raise ValueError(f"mpjax.report: unknown target {target!r}; known targets: {known}")
    n = int(m.group(1) or 1)
    try:
        topology = h100_topology(f"1x1x{n}")
    except Exception as err:  # noqa: BLE001 - no plugin, or JAX cannot describe the target
        raise RuntimeError(
            f"mpjax.report: target {target!r} needs the deviceless CUDA compiler, which this "
            f"environment cannot load ({type(err).__name__}: {str(err).splitlines()[0]}). "
            f"Install it with: {gpu_aot_install()}."
        ) from err
    return Target(target, tuple(topology.devices), True)


def _named(leaf: Any, devices: tuple) -> jax.sharding.Sharding:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        if mesh.devices.size != len(devices):
            raise ValueError(
                f"mpjax.report: an argument is sharded over a mesh of {mesh.devices.size} "
                f"devices {dict(mesh.shape)}; the target has {len(devices)}"
            )
        grid = np.array(devices, dtype=object).reshape(mesh.devices.shape)
        return jax.sharding.NamedSharding(jax.sharding.Mesh(grid, mesh.axis_names), sharding.spec)
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("devices",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def place_args(tree: Any, target: Target) -> Any:
    """`tree`'s array leaves as `ShapeDtypeStruct`s placed on `target`'s devices."""
    if not target.devices:
        return tree

    def place(leaf):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            return leaf
        if len(target.devices) == 1:
            sharding = jax.sharding.make_single_device_sharding(target.devices[0])
        else:
            sharding = _named(leaf, target.devices)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree.map(place, tree)
