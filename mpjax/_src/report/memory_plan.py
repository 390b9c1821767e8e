"""`memory_plan`: the fastest rung of the memory ladder whose step fits a byte budget.

Each rung of the ladder (`mpjax/_src/flax/remat_ladder.py`) is one program: `make_step(rung)`,
compiled for the target (a deviceless H100 for `"h100"`; the current backend for None) on
the example arguments, read for XLA's per-device temporaries plus arguments
(`compiled.memory_analysis()`) and for its roofline time (`mpjax/_src/analysis/hlo_cost.py`
at H100 peaks, calibrated by `mpjax/_src/analysis/calibrated.py`: each kernel class over its
measured efficiency on Hopper; on a CPU target that is the H100 roofline of the CPU program,
a proxy). The plan is the least roofline time among the rungs within the budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mpjax._src.analysis import hlo_cost
from mpjax._src.analysis.calibrated import calibrated_seconds
from mpjax._src.flax.remat_ladder import MEMORY_LADDER, MemoryRung

__all__ = ["MemoryCandidate", "MemoryPlan", "memory_plan"]

GIB = 2**30


def _size(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.4g} MiB"


@dataclasses.dataclass(frozen=True)
class MemoryCandidate:
    """One compiled rung: XLA's memory per device and the roofline time.

    Attributes:
      rung: the rung's name.
      temp_bytes: XLA's temporaries (buffer assignment), per device.
      argument_bytes: the arguments, per device.
      roofline_s: the roofline time of the optimized program (seconds).
    """

    rung: str
    temp_bytes: int
    argument_bytes: int
    roofline_s: float

    @property
    def total_bytes(self) -> int:
        """Temporaries plus arguments: what the budget bounds."""
        return self.temp_bytes + self.argument_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What `memory_plan` chose and what every rung saved and cost.

    Attributes:
      budget: the byte budget (temporaries plus arguments, per device).
      target: what the rungs were compiled for (`"h100"`, `"cpu"`, ...).
      choice: the chosen `MemoryRung` (``.remat``, ``.saved_activations``, ``.wrap_module``, ...).
      candidates: a `MemoryCandidate` per rung, in ladder order (the first is the baseline of
        "saved" and "cost").
      rungs: the ladder, a `MemoryRung` per candidate.
      make_step: the `make_step` the plan was made for.
    """

    budget: int
    target: str
    choice: MemoryRung
    candidates: tuple[MemoryCandidate, ...]
    rungs: tuple[MemoryRung, ...] = dataclasses.field(repr=False)
    make_step: Callable = dataclasses.field(repr=False, compare=False)

    def with_budget(self, budget: int) -> MemoryPlan:
        """The plan for another `budget`, from the same compiled candidates (no compile).

        Raises:
          ValueError: as `memory_plan`: a bad budget, or no rung fits it.
        """
        budget = _check_budget(budget)
        choice = _choose(self.candidates, self.rungs, budget, self.target)
        return dataclasses.replace(self, budget=budget, choice=choice)

    @property
    def chosen(self) -> MemoryCandidate:
        """The chosen rung's `MemoryCandidate`."""
        return next(c for c in self.candidates if c.rung == self.choice.name)

    @property
    def step(self) -> Callable:
        """The step of the chosen rung: `make_step(choice)`."""
        return self.make_step(self.choice)

    def rows(self) -> list[list[str]]:
        """One row per rung: name, memory, roofline, saved and cost against the first rung."""
        base = self.candidates[0]
        out = []
        for c in self.candidates:
            mark = "chosen" if c.rung == self.choice.name else ""
            if c.total_bytes > self.budget:
                mark = "over budget"
            saved = base.total_bytes - c.total_bytes
            cost = c.roofline_s - base.roofline_s
            out.append(
                [c.rung, _size(c.total_bytes), f"{c.roofline_s * 1e3:.4g} ms", _size(saved)]
                + [f"{cost * 1e3:+.3g} ms{_percent(cost, base.roofline_s)}", mark]
            )
        return out

    HEADER = ("rung", "temp + args", "roofline", "saved", "cost", "")

    def summary(self) -> str:
        """One line: the choice, its memory against the budget, its saving and cost."""
        c, base = self.chosen, self.candidates[0]
        return (
            f"memory plan ({self.target}): {self.choice.name} ({self.choice.description}), "
            f"{_size(c.total_bytes)} of a {_size(self.budget)} budget, saves "
            f"{_size(base.total_bytes - c.total_bytes)} for "
            f"{(c.roofline_s - base.roofline_s) * 1e3:+.3g} ms roofline against {base.rung}"
        )

    def __str__(self) -> str:
        rows = [list(self.HEADER), *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEADER))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([self.summary(), *(line.rstrip() for line in lines)])


def _measure(make_step, rung, args, target, donate_argnums) -> MemoryCandidate:
    from mpjax._src.analysis.target import target_cudnn
    from mpjax._src.report.targets import place_args

    step = make_step(rung)
    jitted = step if hasattr(step, "trace") else jax.jit(step, donate_argnums=donate_argnums)
    with target_cudnn() if target.devices else contextlib.nullcontext():
        compiled = jitted.trace(*place_args(args, target)).lower().compile()
    memory = compiled.memory_analysis()
    return MemoryCandidate(
        rung.name,
        int(memory.temp_size_in_bytes),
        int(memory.argument_size_in_bytes),
        calibrated_seconds(hlo_cost.analyze(compiled.as_text()), "h100").seconds,
    )


def memory_plan(
    make_step: Callable[[MemoryRung], Callable],
    *example_args: Any,
    budget: int,
    target: str | None = "h100",
    ladder: Sequence[MemoryRung] = MEMORY_LADDER,
    donate_argnums: int | tuple[int, ...] = (0,),
) -> MemoryPlan:
    """The rung of `ladder` whose step fits `budget` bytes per device at the least roofline time.

    Compiles `make_step(rung)` on `example_args` for every rung (a handful of compiles),
    reads XLA's temporaries plus arguments per device and the roofline time, and chooses
    the fastest rung within `budget`.

    Args:
      make_step: `make_step(rung) -> step`: the train step with `rung` applied (its blocks
        under `rung.wrap_module(Block)` or `rung.wrap(fn)`, its policy
        `rung.with_policy(policy)`).
      *example_args: the step's arguments (arrays or `jax.ShapeDtypeStruct` values).
      budget: bytes per device for temporaries plus arguments: a positive Python or NumPy
        integer (not a bool, not a float).
      target: `"h100"` (one deviceless H100, needs the gpu-aot extra and
        `JAX_PLATFORMS=cpu`), `"h100x2"`, `"h100x4"` or `"h100x8"` (as `mpjax.report`), or None
        (the current backend; the time is the H100 roofline of its program, a proxy).
      ladder: the rungs to try (default `mpjax.MEMORY_LADDER`: keep, fp8 saved, remat
        keeping GEMM outputs, remat keeping fp8 GEMM inputs, full remat).
      donate_argnums: the step's donated arguments (the state), as `jax.jit` takes them.

    Returns:
      A `MemoryPlan`: ``.choice`` (the `MemoryRung`), ``.step`` (``make_step(choice)``),
      ``.candidates``.

    Raises:
      ValueError: `budget` is not a positive integer, `ladder` is empty, or no rung fits
        (the message names the smallest rung and its bytes).

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> def make_step(rung):
      ...     layer = rung.wrap(lambda w, x: jnp.tanh(x @ w))
      ...     def loss(w, x):
      ...         for _ in range(4):
      ...             x = layer(w, x)
      ...         return jnp.sum(x)
      ...     return lambda w, x: w - 0.1 * jax.grad(loss)(w, x)
      >>> w, x = jnp.ones((64, 64)), jnp.ones((512, 64))
      >>> plan = mpjax.memory_plan(make_step, w, x, budget=2**30, target=None)
      >>> plan.choice.name
      'keep'
    """
    from mpjax._src.report.targets import resolve_target

    budget = _check_budget(budget)
    ladder = tuple(ladder)
    if not ladder or not all(isinstance(r, MemoryRung) for r in ladder):
        raise ValueError(
            f"memory_plan: ladder={ladder!r}: expected a non-empty sequence of MemoryRung"
        )
    resolved = resolve_target(target)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    candidates = tuple(_measure(make_step, r, example_args, resolved, donate) for r in ladder)
    choice = _choose(candidates, ladder, budget, resolved.name)
    return MemoryPlan(budget, resolved.name, choice, candidates, ladder, make_step)


def _percent(cost: float, base: float) -> str:
    """` (+x %)` of `cost` against `base`; nothing where `base` is zero (a step with a zero
    roofline: a percentage of it is undefined)."""
    return f" ({100 * cost / base:+.3g} %)" if base > 0 else ""


def _check_budget(budget: Any) -> int:
    """`budget` as a Python int: any positive integer (Python or NumPy), not a bool."""
    if (
        isinstance(budget, (bool, np.bool_))
        or not isinstance(budget, (int, np.integer))
        or budget <= 0
    ):
        raise ValueError(
            f"memory_plan: budget={budget!r}: expected a positive integer number of bytes "
            "(a Python or NumPy integer, e.g. budget=2**30)"
        )
    return int(budget)


def _choose(candidates, rungs, budget: int, target: str) -> MemoryRung:
    """The rung of the least roofline time (then the least memory) within `budget`."""
    _check_budget(budget)
    fits = [(c, r) for c, r in zip(candidates, rungs, strict=True) if c.total_bytes <= budget]
    if not fits:
        smallest = min(candidates, key=lambda c: c.total_bytes)
        raise ValueError(
            f"memory_plan: no rung fits budget={budget} bytes ({_size(budget)}) per device on "
            f"{target}; the smallest is {smallest.rung!r}: {smallest.total_bytes} bytes "
            f"({_size(smallest.total_bytes)}, temp + args)"
        )
    return min(fits, key=lambda cr: (cr[0].roofline_s, cr[0].total_bytes))[1]
