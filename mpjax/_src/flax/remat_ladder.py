"""The memory/time ladder of `mpjax.memory_plan`: what every block keeps for its backward pass.

A `MemoryRung` is one choice: keep every residual, keep the GEMM inputs in fp8, recompute all but
the GEMM outputs, keep only the fp8 GEMM inputs, or recompute everything. A step written as
`make_step(rung)` applies it with `rung.wrap_module` (a Flax block class under `nn.remat`),
`rung.wrap` (a function under `jax.checkpoint`) and `rung.with_policy` (the mpjax policy's
`saved_activations`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

import flax.linen as nn
from mpjax._src.fp8.saved import saved_activations_policy

__all__ = ["MEMORY_LADDER", "MemoryRung"]

E4M3 = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class MemoryRung:
    """One memory/time choice for every block of a step.

    Attributes:
      name: a short name (`"keep"`, `"fp8 saved"`, ...), as `report` lists it.
      remat: None (no remat: every residual is kept), `"full"` (recompute everything in the
        backward pass) or a `jax.checkpoint` policy (what to keep; the rest is recomputed).
      saved_activations: the GEMM inputs' saved dtype (`"float8_e4m3fn"`) or None (as the
        policy has it).
      description: what the rung keeps, in words.
    """

    name: str
    remat: Callable | str | None = None
    saved_activations: str | None = None
    description: str = ""

    def with_policy(self, policy: Any) -> Any:
        """`policy` (an `mpjax.Policy`) with this rung's fp8 saved activations, if any."""
        if self.saved_activations is None:
            return policy
        return policy.with_saved_activations(self.saved_activations)

    def wrap(self, fn: Callable) -> Callable:
        """`fn` under `jax.checkpoint` with this rung's policy (`fn` itself without remat)."""
        if self.remat is None:
            return fn
        return jax.checkpoint(fn, policy=None if self.remat == "full" else self.remat)

    def wrap_module(self, module_cls: type) -> type:
        """A Flax linen module class under `nn.remat` with this rung's policy (or itself)."""
        if self.remat is None:
            return module_cls
        return nn.remat(module_cls, policy=None if self.remat == "full" else self.remat)


_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

# From the most memory (and least recomputation) to the least.
MEMORY_LADDER = (
    MemoryRung("keep", None, None, "every residual kept"),
    MemoryRung("fp8 saved", None, E4M3, "GEMM inputs kept in fp8, the rest kept"),
    MemoryRung("remat, keep GEMM outputs", _DOTS, None, "GEMM outputs kept, the rest recomputed"),
    MemoryRung(
        "remat, keep fp8 GEMM inputs",
        saved_activations_policy(),
        E4M3,
        "GEMM inputs kept in fp8, the rest recomputed",
    ),
    MemoryRung("full remat", "full", None, "nothing kept inside a block: all recomputed"),
)
