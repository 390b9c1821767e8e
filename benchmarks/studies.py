"""Studies: benchmarks that are not one compiled program, each a case with its own measure.

Each returns its table (`title`, `columns`, `rows`, `notes`) as the case's figures:
timings of alternatives on this host (interleaved rounds, ratios paired per round), training
runs to convergence, and kernel timings on a real GPU (skipped without one). `data_parallel` and
`reduce_dtype` train on 8 simulated CPU devices in a child process: XLA's host device count
is fixed when jax starts, so that part cannot run in the suite's process.
"""

from __future__ import annotations

import importlib

__all__ = ["STUDIES"]


def _script(name: str, **kw):
    """`measure` calling `benchmarks/<name>.py`'s `run(quick)` (its table)."""

    def measure(case, quick: bool) -> dict:
        from benchmarks.common import check_result

        result = importlib.import_module(f"benchmarks.{name}").run(quick=quick, **kw)
        check_result(result)
        return dict(result)

    measure.__name__ = name
    return measure


def reduce_dtype_h100(case, quick: bool) -> dict:
    from benchmarks import reduce_dtype

    return {
        "title": "Gradient collectives of the char-LM FSDP step on 8 deviceless H100s",
        "columns": ["policy", "gradient collectives (8 H100s, FSDP)"],
        "rows": [list(map(str, r)) for r in reduce_dtype._h100_rows()],
        "notes": "",
    }


def memory_convergence(case, quick: bool) -> dict:
    from benchmarks import memory_convergence

    return memory_convergence.run(quick)


def memory_switches_char_lm(case, quick: bool) -> dict:
    from benchmarks import memory_switches

    return memory_switches.run_char_lm(quick)


# (table, target, measure)
STUDIES = (
    ("policy-cpu", "cpu", _script("policy_cost")),
    ("autocast-cpu", "cpu", _script("autocast_hlo")),
    ("step-overhead", "cpu", _script("step_overhead")),
    ("inference", "cpu", _script("inference")),
    ("data-parallel", "cpu", _script("data_parallel")),
    ("reduce-dtype", "cpu", _script("reduce_dtype")),
    ("reduce-dtype-h100", "h100x8", reduce_dtype_h100),
    ("convergence", "cpu", memory_convergence),
    # Issue 29: per-GPU memory by switch (GPT-2 FSDP), the fused loss alone, the char-LM row.
    ("memory-switches", "h100x8", _script("memory_switches")),
    ("memory-switches-char-lm", "cpu", memory_switches_char_lm),
    ("lce-loss", "h100x8", _script("lce_loss")),
    ("kernels-gpu", "gpu", _script("kernels_gpu")),
    # Issue 30: the forms of a blockwise fp8 GEMM on Hopper (the Pallas kernel ships).
    ("blockwise-hopper", "h100", _script("blockwise_hopper_cost")),
    ("blocks-convergence", "cpu", _script("blocks_convergence")),
)
