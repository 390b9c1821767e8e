"""The benchmarks' shared helpers, a study through the runner."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "benchmarks" / "run.py"


def _run_runner(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(RUNNER), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# --- common helpers ------------------------------------------------------------------------


def test_interleaved_times_rotates_order_and_returns_one_sample_per_round():
    calls = []
    fns = {n: (lambda n=n: calls.append(n) or jnp.zeros(())) for n in ("a", "b", "c")}
    times = common.interleaved_times(fns, rounds=3, steps_per_round=2, warmup=1)
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t > 0 for v in times.values() for t in v)
    timed = calls[3:]  # after one warm-up call each
    firsts = [timed[i * 6] for i in range(3)]
    assert firsts == ["a", "b", "c"]  # each round starts with the next function
    assert timed[:6] == ["a", "a", "b", "b", "c", "c"]


def test_summary_and_paired_ratio():
    times = {"x": [2.0, 4.0, 9.0], "base": [1.0, 2.0, 3.0]}
    assert common.summary(times["x"]) == {"median": 4.0, "min": 2.0, "max": 9.0}
    assert common.paired_ratio(times, "x", "base") == {"median": 2.0, "min": 2.0, "max": 3.0}
    with pytest.raises(ValueError, match="no samples"):
        common.summary([])


def test_cost_analysis_counts_bytes_and_copies():
    x = jnp.arange(1024, dtype=jnp.float32)
    small = common.cost_analysis(lambda v: v + 1.0, x)
    big = common.cost_analysis(lambda v: v + 1.0, jnp.arange(8 * 1024, dtype=jnp.float32))
    assert small["bytes accessed"] >= 2 * x.nbytes  # read and write of the array
    assert big["bytes accessed"] > 4 * small["bytes accessed"]
    assert small["copies"] == 0


def test_entry_op_counts_reads_the_entry_computation():
    hlo = textwrap.dedent(
        """\
        %fused (p: f32[4]) -> f32[4] {
          %p = f32[4]{0} parameter(0)
          ROOT %copy.9 = f32[4]{0} copy(%p)
        }

        ENTRY %main (a: f32[4]) -> (f32[4], f32[4]) {
          %a = f32[4]{0} parameter(0)
          %copy.1 = f32[4]{0} copy(%a)
          %fusion = f32[4]{0} fusion(%copy.1), kind=kLoop, calls=%fused
          ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(%copy.1, %fusion)
        }
        """
    )
    counts = common.entry_op_counts(hlo)
    assert counts == {"copy": 1, "fusion": 1, "tuple": 1}
    with pytest.raises(ValueError, match="ENTRY"):
        common.entry_op_counts("HloModule m")


def test_check_result_names_the_culprit():
    good = {"title": "t", "columns": ["a", "b"], "rows": [["x", 1.0]], "notes": ""}
    common.check_result(good)
    with pytest.raises(ValueError, match="'rows'"):
        common.check_result({**good, "rows": None})
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        common.check_result({**good, "rows": [["x"]]})
    with pytest.raises(ValueError, match="list cell"):
        common.check_result({**good, "rows": [["x", [1]]]})


@pytest.mark.slow
def test_quick_suite_writes_step_overhead_table(tmp_path):
    out = tmp_path / "results.json"
    # "gpu/*", not "gpu/": a pattern without `*` matches as a substring, and "gpu/" also
    # selected the 48 multi-gpu/ cases (8-H100 compiles, minutes of CI for no assertion).
    proc = _run_runner("--quick", "--only", "step-overhead,gpu/*", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    data = json.loads(out.read_text())
    machine = data["machine"]
    assert machine["jax"] == jax.__version__
    assert isinstance(machine["cpu_count"], int) and machine["cpu_count"] >= 1
    assert machine["platform"] == jax.default_backend()

    records = {r["table"]: r for r in data["records"]}
    assert set(records) == {"step-overhead", "gpu"}, sorted(records)
    rec = records["step-overhead"]
    assert rec["status"] == "ok", rec
    result = rec["figures"]
    common.check_result(result)
    cols = result["columns"]
    # Every variant is timed with and without donation, each against bare optax in its mode.
    for donated in ("yes", "no"):
        rows = {
            row[0]: dict(zip(cols, row, strict=True)) for row in result["rows"] if row[1] == donated
        }
        names = list(rows)
        assert names[0] == "bare optax adam"
        assert {"mpjax.loss_scaled(adam)", "flax DynamicScale"} <= set(names)
        assert any("apply_if_finite" in n for n in names)
        base = rows["bare optax adam"]
        assert base["bytes ratio"] == 1.0 and base["time ratio"] == 1.0
        for row in rows.values():
            assert row["bytes accessed (MB)"] > 0 and row["median ms/step"] > 0
            assert 0.5 < row["bytes ratio"] < 10
        # Every loss-scaling pattern does more memory traffic than the bare step.
        assert all(rows[n]["bytes ratio"] > 1.0 for n in names[1:])
    assert "not donated, mpjax / flax DynamicScale" in result["notes"]

    gpu = records["gpu"]
    if jax.default_backend() != "gpu":
        assert gpu["status"] == "skipped" and "GPU" in gpu["reason"]
    assert data["quick"] and data["command"].startswith("python benchmarks/run.py --quick")


def device_count(quick: bool) -> dict:
    """Run by `in_child` below (a module-level function of an importable module)."""
    return {"devices": jax.device_count(), "quick": quick}


def fails(quick: bool) -> None:
    raise ValueError("this child fails")


def test_in_child_runs_a_function_with_n_host_devices():
    got = common.in_child(device_count, True, devices=3, JAX_PLATFORMS="cpu")
    assert got == {"devices": 3, "quick": True}
    with pytest.raises(RuntimeError, match=r"(?s)fails in a child failed \(1\).*this child fails"):
        common.in_child(fails, False, devices=2, JAX_PLATFORMS="cpu")


def test_table_checks_the_study_contract():
    assert common.table("t", ["a"], [[1]], "n", details={"x": 1})["details"] == {"x": 1}
    with pytest.raises(ValueError, match="row 0 has 2 cells"):
        common.table("t", ["a"], [[1, 2]], "n")
