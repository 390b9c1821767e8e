"""Shared helpers for the benchmarks: interleaved timing, medians and ranges, XLA cost analysis,
a study's table, a function run with N host devices.

A study (a case of `benchmarks/cases.py`'s `STUDIES`) is `measure(case, quick) -> dict`
returning `table(title, columns, rows, notes, **details)`; it may raise `Skip("reason")`
to be recorded as skipped with that reason.

Example:
  >>> times = interleaved_times({"a": step_a, "b": step_b}, rounds=7, steps_per_round=5)
  >>> summary(times["a"])["median"]
  >>> paired_ratio(times, "a", baseline="b")
"""

from __future__ import annotations

import collections
import datetime
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "Skip",
    "check_result",
    "cost_analysis",
    "entry_op_counts",
    "interleaved_times",
    "machine_info",
    "paired_ratio",
    "in_child",
    "summary",
    "table",
]


class Skip(Exception):  # noqa: N818 - reads as `raise Skip("no GPU")`
    """Raised by a benchmark's `run` when it cannot run here (no GPU, missing extra)."""


def interleaved_times(
    fns: Mapping[str, Callable[[], Any]],
    *,
    rounds: int,
    steps_per_round: int = 1,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Times several step functions in alternation and returns seconds per step.

    Each round runs every function `steps_per_round` times back to back (blocking on the
    last result), and the order of the functions rotates from round to round, so slow
    phases of a shared machine hit every variant alike.

    Args:
      fns: name -> a thunk that runs one step and returns something to block on.
      rounds: number of rounds (samples per function).
      steps_per_round: steps timed together per sample.
      warmup: untimed calls of each function first (compilation, caches).

    Returns:
      name -> list of `rounds` per-step times in seconds, in round order.
    """
    import jax

    if rounds < 1 or steps_per_round < 1:
        raise ValueError(
            f"rounds and steps_per_round must be >= 1, got {rounds}, {steps_per_round}"
        )
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            jax.block_until_ready(fns[name]())
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            out = None
            start = time.perf_counter()
            for _ in range(steps_per_round):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / steps_per_round)
    return times


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a list of samples."""
    if not samples:
        raise ValueError("summary of no samples")
    return {
        "median": float(statistics.median(samples)),
        "min": float(min(samples)),
        "max": float(max(samples)),
    }


def paired_ratio(times: Mapping[str, Sequence[float]], name: str, baseline: str) -> dict:
    """Median, min and max of the per-round ratio `times[name] / times[baseline]`.

    Rounds are paired, so machine-wide slow phases cancel out of the ratio.
    """
    ratios = [a / b for a, b in zip(times[name], times[baseline], strict=True)]
    return summary(ratios)


_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9\-]*)\(")


def entry_op_counts(hlo_text: str) -> collections.Counter:
    """Opcode -> count over the top-level instructions of an HLO module's ENTRY computation.

    Fusions count as "fusion"; use it to spot extra passes, e.g. `copy` (buffer copies XLA
    inserted) or `conditional`.
    """
    start = hlo_text.find("\nENTRY")
    if start < 0:
        raise ValueError("entry_op_counts: no ENTRY computation in this HLO text")
    body = hlo_text[start:].split("\n}", 1)[0]
    counts: collections.Counter = collections.Counter()
    for line in body.splitlines()[1:]:
        match = _INSTRUCTION.match(line)
        if match and match.group(1) != "parameter":
            counts[match.group(1)] += 1
    return counts


def cost_analysis(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, float]:
    """Compiled cost of `fn(*args, **kwargs)`: XLA's "bytes accessed" and "flops", and
    the number of `copy` instructions in the optimized HLO's entry computation.

    `fn` may be a plain function (it is wrapped in `jax.jit`) or already jitted (its own
    options, such as donation, are kept).
    """
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return compiled_cost(jitted.lower(*args, **kwargs).compile())


def compiled_cost(compiled: Any) -> dict[str, float]:
    """`cost_analysis`'s figures of an already compiled executable."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return {
        "bytes accessed": float(analysis.get("bytes accessed", float("nan"))),
        "flops": float(analysis.get("flops", float("nan"))),
        "copies": entry_op_counts(compiled.as_text())["copy"],
    }


def machine_info() -> dict[str, Any]:
    """Date, CPU count, load, Python/jax versions and the jax platform of this run."""
    import jax
    import jaxlib

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    devices = jax.devices()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "load_average": load,
        "python": platform.python_version(),
        "os": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def time_train_steps(
    steps: Mapping[str, Callable[[Any, Any], tuple[Any, Any]]],
    states: dict[str, Any],
    batch: Any,
    *,
    rounds: int,
    steps_per_round: int,
    warmup: int = 2,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Times train steps `(state, batch) -> (state, loss)` with `interleaved_times`.

    Each variant's state is threaded through its own steps; `states` is updated in place,
    so donated buffers stay valid.

    Returns:
      `(times, losses)`: per-step seconds per variant, and each variant's last loss.
    """
    losses: dict[str, Any] = {}

    def thunk(name):
        def one_step():
            states[name], losses[name] = steps[name](states[name], batch)
            return losses[name]

        return one_step

    times = interleaved_times(
        {name: thunk(name) for name in steps},
        rounds=rounds,
        steps_per_round=steps_per_round,
        warmup=warmup,
    )
    return times, losses


def check_result(result: Any) -> None:
    """Raises ValueError unless `result` follows the benchmark contract."""
    if not isinstance(result, Mapping):
        raise ValueError(f"a benchmark must return a dict, got {type(result).__name__}")
    for key, kind in (("title", str), ("columns", list), ("rows", list), ("notes", str)):
        if not isinstance(result.get(key), kind):
            raise ValueError(f"benchmark result: {key!r} must be a {kind.__name__}")
    for i, row in enumerate(result["rows"]):
        if not isinstance(row, list) or len(row) != len(result["columns"]):
            raise ValueError(
                f"benchmark result: row {i} has {len(row)} cells, expected {len(result['columns'])}"
            )
        for cell in row:
            if not isinstance(cell, (str, int, float)):
                raise ValueError(
                    f"benchmark result: row {i} has a {type(cell).__name__} cell; "
                    "cells are str, int or float"
                )


def table(title: str, columns: list, rows: list, notes: str, **extra: Any) -> dict:
    """A study's figures: its table (`check_result`'s contract) and any `extra` details."""
    result = {"title": title, "columns": columns, "rows": rows, "notes": notes, **extra}
    check_result(result)
    return result


_MARK = "BENCHMARK_CHILD_RESULT "


def in_child(fn: Callable[[bool], Any], quick: bool, devices: int = 8, **env: str) -> Any:
    """`fn(quick)` (a module-level function returning JSON data) run in a child python with
    `devices` host devices (XLA fixes the count when jax starts) and `env` set; its result."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, **env}
    flag = f"--xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    module = sys.modules[fn.__module__].__file__  # by its file: a test's module has no package
    cmd = [sys.executable, "-m", "benchmarks.common", module, fn.__name__]
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        cmd + ["--quick"] * quick, env=env, capture_output=True, text=True, cwd=root
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(_MARK)]
    if out.returncode or not lines:
        raise RuntimeError(
            f"{fn.__name__} in a child failed ({out.returncode}):\n{out.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len(_MARK) :])


if __name__ == "__main__":  # the child of `in_child`: module file, function, [--quick]
    import importlib.util
    import json
    import sys

    _spec = importlib.util.spec_from_file_location("_in_child", sys.argv[1])
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _fn = getattr(_module, sys.argv[2])
    print(_MARK + json.dumps(_fn("--quick" in sys.argv)), flush=True)
