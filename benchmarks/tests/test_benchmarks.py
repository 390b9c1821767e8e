"""The benchmark suite runs end to end and writes well-formed results (so it cannot rot)."""

import json
import math
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


def _run_runner(*args, timeout=300):
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
    md = common.format_markdown(good)
    assert md.splitlines()[:3] == ["| a | b |", "|---|---|", "| x | 1 |"]


# --- the runner ----------------------------------------------------------------------------

FAKE_BENCHMARKS = {
    "ok_bench": """
        def run(quick=False):
            return {"title": "Fake ok", "columns": ["name", "ratio"],
                    "rows": [["a", 1.0], ["b", 0.5 if quick else 2.0]], "notes": "n"}
    """,
    "needs_extra": """
        import mpjax_test_not_installed_pkg  # an optional extra that is missing
        def run(quick=False):
            raise AssertionError("unreachable")
    """,
    "broken": """
        def run(quick=False):
            raise RuntimeError("boom in broken")
    """,
    "malformed": """
        def run(quick=False):
            return {"title": "no columns"}
    """,
    "repo_bug": """
        import mpjax.no_such_submodule  # a bug in the repo, not a missing extra
        def run(quick=False):
            return {}
    """,
    "needs_device": """
        REQUIRES_GPU = True
        def run(quick=False):
            raise AssertionError("must not run without a GPU")
    """,
    "self_skips": """
        import common  # as a script run from inside benchmarks/ would import it
        def run(quick=False):
            raise common.Skip("needs a TPU pod")
    """,
    "helper": """
        X = 1  # no run(): not a benchmark
    """,
}


def test_runner_classifies_every_outcome_and_reports_them(tmp_path):
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    for name, body in FAKE_BENCHMARKS.items():
        (bench_dir / f"{name}.py").write_text(textwrap.dedent(body))
    out = tmp_path / "out"
    proc = _run_runner("--quick", "--bench-dir", str(bench_dir), "--out", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # errors make the run fail

    data = json.loads((out / "results.json").read_text())
    status = {name: rec["status"] for name, rec in data["benchmarks"].items()}
    gpu_status = "ok" if jax.default_backend() == "gpu" else "skipped"
    assert status == {
        "ok_bench": "ok",
        "needs_extra": "skipped",
        "broken": "error",
        "malformed": "error",
        "repo_bug": "error",
        "needs_device": gpu_status if gpu_status == "skipped" else "error",
        "self_skips": "skipped",
    }
    recs = data["benchmarks"]
    assert recs["ok_bench"]["result"]["rows"][1] == ["b", 0.5]  # quick=True reached run()
    assert "mpjax_test_not_installed_pkg" in recs["needs_extra"]["reason"]
    assert "boom in broken" in recs["broken"]["reason"]
    assert "'columns'" in recs["malformed"]["reason"]
    assert "mpjax.no_such_submodule" in recs["repo_bug"]["reason"]
    assert recs["self_skips"]["reason"] == "needs a TPU pod"
    if gpu_status == "skipped":
        assert "GPU-only" in recs["needs_device"]["reason"]
    assert data["quick"] is True

    md = (out / "RESULTS.md").read_text()
    assert "## Fake ok" in md and "| name | ratio |" in md and "| b | 0.5 |" in md
    assert "`needs_extra.py`: skipped" in md and "`broken.py`: error" in md
    assert "helper" not in md
    assert "[skipped] needs_device" in proc.stdout or gpu_status == "ok"


def test_runner_reads_a_literal_timeout_scale(tmp_path):
    from benchmarks import run

    (tmp_path / "slow.py").write_text("TIMEOUT_SCALE = 3\ndef run(quick=False): ...\n")
    (tmp_path / "plain.py").write_text("X = 2\n")
    (tmp_path / "computed.py").write_text("TIMEOUT_SCALE = 1 + 2\n")
    assert run.timeout_scale(tmp_path / "slow.py") == 3.0
    assert run.timeout_scale(tmp_path / "plain.py") == 1.0
    assert run.timeout_scale(tmp_path / "computed.py") == 1.0  # a literal only


def test_runner_rejects_unknown_names(tmp_path):
    proc = _run_runner("--only", "no_such_benchmark", "--out", str(tmp_path))
    assert proc.returncode != 0
    assert "no_such_benchmark" in proc.stderr
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow
def test_quick_suite_writes_step_overhead_table(tmp_path):
    proc = _run_runner("--quick", "--only", "step_overhead,gpu", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    data = json.loads((tmp_path / "results.json").read_text())
    machine = data["machine"]
    assert machine["jax"] == jax.__version__
    assert isinstance(machine["cpu_count"], int) and machine["cpu_count"] >= 1
    assert machine["platform"] == jax.default_backend()

    rec = data["benchmarks"]["step_overhead"]
    assert rec["status"] == "ok", rec
    result = rec["result"]
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

    gpu = data["benchmarks"]["gpu"]
    if jax.default_backend() != "gpu":
        assert gpu["status"] == "skipped" and "GPU" in gpu["reason"]

    md = (tmp_path / "RESULTS.md").read_text()
    assert result["title"] in md
    assert "| variant | donated | bytes accessed (MB) | bytes ratio |" in md
    assert f"| jax / jaxlib | {jax.__version__}" in md
    assert "| CPUs |" in md
    assert "quick mode" in md


@pytest.mark.slow
def test_gpu_script_smoke_mode_runs_each_precision(capsys):
    from benchmarks import gpu, train_variants

    result = gpu.main(["--smoke"])
    assert "SMOKE RUN" in capsys.readouterr().out
    common.check_result(result)
    cols = result["columns"]
    rows = {(row[0], row[1]): dict(zip(cols, row, strict=True)) for row in result["rows"]}
    for model in ("resnet", "lm"):
        # Every registered variant of the model is timed, under its label.
        expected = [k for k, v in gpu.VARIANTS.items() if v in train_variants.VARIANTS[model]]
        assert [label for m, label in rows if m == model] == expected
        for label in expected:
            row = rows[(model, label)]
            assert row["items/s (median)"] > 0
            low, total = map(int, row["low-precision matmuls"].split("/"))
            assert total > 0
            # mpjax's paths really run their matmuls in low precision (fp32 none).
            if label == "fp32":
                assert low == 0
            else:
                assert low > 0, (model, label)
            # Finite everywhere, autocast's LM included (its padding mask constant saturates).
            assert math.isfinite(row["last loss"]), (model, label, row["last loss"])
        assert rows[(model, "fp32")]["x fp32"] == 1.0
        assert rows[(model, gpu.ANCHOR)]["x anchor"] == 1.0
    # fp8: every variant timed; the direct forms really feed fp8 operands to their GEMMs,
    # Flax's quantise-dequantise form none (its GEMMs take bf16).
    fp8 = {label: row for (m, label), row in rows.items() if m == "lm-fp8 quick"}
    assert list(fp8) == list(gpu.FP8_LABELS)
    for label, row in fp8.items():
        assert math.isfinite(row["last loss"]) and row["items/s (median)"] > 0, label
        no_fp8 = label in (gpu.ANCHOR, "Flax Fp8DotGeneralOp")
        assert (row["fp8 matmuls"] == 0) == no_fp8, (label, row["fp8 matmuls"])
