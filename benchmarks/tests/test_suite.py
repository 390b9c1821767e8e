"""The benchmark suite's harness on a tiny fake registry, its tables and plots, and the
registry of the real suite (every case names a known model, variant and target).

No timings are asserted; figures are checked for their structure and against each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks import harness, tables
from benchmarks.harness import Case, Model
from benchmarks.train_variants import TrainProgram

ROOT = Path(__file__).resolve().parents[2]


def _program(width: int, dtype=jnp.float32):
    """A one-matrix least-squares step: state (w, ), batch (x, y)."""

    def init(key):
        return (jax.random.normal(key, (width, width), dtype),)

    def batch(key):
        x = jax.random.normal(key, (4, width))
        return x, x

    def step(state, batch):
        (w,) = state
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w.astype(x.dtype) - y) ** 2))(w)
        return (w - 0.1 * g.astype(w.dtype),), loss

    return TrainProgram(init, batch, step, 4)


def _boom(cfg):
    raise RuntimeError("this variant is broken")


MODELS = {
    "toy": Model(
        {"small": {"width": 8}, "big": {"width": 16}},
        "small",
        "big",
        {
            "f32": lambda cfg: _program(cfg["width"]),
            "bf16": lambda cfg: _program(cfg["width"], jnp.bfloat16),
            "broken": _boom,
        },
    )
}


def test_case_rejects_an_unknown_target_at_construction():
    with pytest.raises(ValueError, match=r"target='tpu'.*expected one of"):
        Case("t", "toy", "f32", "tpu")


def test_select_by_pattern_and_target():
    cases = [
        Case("cost", "lm", "bf16"),
        Case("cost", "lm", "policy"),
        Case("fp8", "lm", "bf16", sizes=("quick", "wide")),
        Case("multi", "lm", "bf16", "h100x8"),
    ]
    names = [c.name for c in harness.select(cases, "cost/lm")]
    assert names == ["cost/lm/bf16@h100", "cost/lm/policy@h100"]
    assert [c.name for c in harness.select(cases, "*bf16@h100")] == [
        "cost/lm/bf16@h100",
        "fp8/lm:wide/bf16@h100",
    ]
    assert [c.target for c in harness.select(cases, "", "h100x8")] == ["h100x8"]
    assert len(harness.select(cases, "policy,multi")) == 2
    with pytest.raises(ValueError, match=r"--target \['h200'\]"):
        harness.select(cases, "", "h200")


def test_dedup_measures_a_program_once_per_size():
    models = {"lm": Model({}, "quick", "gpt2", {})}
    cases = [Case("fp8", "lm", "bf16"), Case("fp8", "lm", "bf16", sizes=("quick", "wide"))]
    assert harness.dedup(cases, models, quick=True) == cases[:1]
    assert harness.dedup(cases, models, quick=False) == cases


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("suite") / "results.json"
    cases = [
        Case("toy", "toy", "f32", "cpu", anchor="f32"),
        Case("toy", "toy", "bf16", "cpu", anchor="f32"),
        Case("toy", "toy", "broken", "cpu"),
        Case("toy", "toy", "gpu-only", "gpu", measure=lambda c, q: {"never": 1}),
    ]
    logs: list[str] = []
    results = harness.run_cases(cases, MODELS, True, path, {"command": "x"}, log=logs.append)
    return cases, results, path, logs


def test_run_measures_every_case_with_the_same_figures(toy_run):
    _, results, path, _ = toy_run
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    by = {r["variant"]: r for r in results["records"]}
    assert [by[v]["status"] for v in ("f32", "bf16", "broken", "gpu-only")] == [
        "ok",
        "ok",
        "error",
        "skipped" if jax.default_backend() != "gpu" else "ok",
    ]
    assert "this variant is broken" in by["broken"]["reason"]
    f32, bf16 = by["f32"]["figures"], by["bf16"]["figures"]
    assert set(f32) == set(bf16)
    assert f32["config"] == {"width": 8} and f32["params"] == bf16["params"] == 64
    assert (f32["state_bytes"], bf16["state_bytes"]) == (64 * 4, 64 * 2)
    assert f32["param_bytes"] == f32["state_bytes"]
    assert f32["bytes"] > 0 and f32["temp_bytes"] >= 0
    assert f32["time_s"]["median"] > 0 and bf16["time_vs_anchor"]["median"] > 0


def test_resume_runs_only_what_is_missing(toy_run):
    cases, results, path, _ = toy_run
    logs: list[str] = []
    again = harness.run_cases(cases, MODELS, True, path, {"command": "y"}, True, logs.append)
    ran = [line for line in logs if line.startswith("[run]")]
    assert ran == ["[run] toy/toy/broken@cpu ...", "[run] toy/toy/gpu-only@gpu ..."]
    ok = {r["name"]: r for r in results["records"] if r["status"] == "ok"}
    assert {r["name"]: r for r in again["records"] if r["name"] in ok} == ok
    with pytest.raises(ValueError, match="holds a quick run"):
        harness.run_cases(cases, MODELS, False, path, {}, resume=True)


def _record(table, model, variant, anchor="bf16", **figures):
    base = {"gemm_flops": {"bf16": 1e12}, "conv_flops": {}, "gemms_by_dtype": {"bf16": 3}}
    base.update(convs_by_dtype={}, kernels=10, kernels_by_kind={"gemm": 3, "loop": 7})
    base.update(converts=5, convert_kernels=1, bytes=2e9, temp_bytes=2**30, roofline_s=1e-3)
    base.update(figures)
    return {
        "table": table,
        "model": model,
        "variant": variant,
        "target": "h100",
        "anchor": anchor,
        "size": None,
        "label": variant,
        "name": f"{table}/{model}/{variant}@h100",
        "status": "ok",
        "figures": base,
    }


def test_tables_and_plots_come_from_the_results(tmp_path):
    records = [
        _record("cost", "lm", "bf16"),
        _record("cost", "lm", "policy", roofline_s=1.5e-3, temp_bytes=2**29),
        _record("memory", "opt-lm", "m", "m", params=100, param_bytes=200, state_bytes=1400),
        {**_record("gpu", "study", "gpu"), "status": "skipped", "reason": "needs a GPU"},
    ]
    results = {"command": "python benchmarks/run.py --quick", "quick": True, "records": records}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    written = {p.name for p in tables.write_docs(path, tmp_path / "out")}
    assert {"cost.md", "cost_full.md", "machine.md", "perf_ratios.png"} <= written
    assert {"memory_state.md", "memory_per_device.png", "gpu.md"} <= written
    out = tmp_path / "out"
    short = out.joinpath("cost.md").read_text().splitlines()
    assert short[0].count("|") == 7  # six short columns
    assert short[3].startswith(
        "| GPT-2 small | apply_policy, one bf16 policy <small>policy</small> "
        "| 1.5 | 0.5 | 0/0 | 1 |"
    )
    assert out.joinpath("cost_full.md").read_text().count(" | ") > 2 * 13
    assert "| m | 2 | 12 | **14** |" in out.joinpath("memory_state.md").read_text()
    assert "needs a GPU" in out.joinpath("gpu.md").read_text()
    assert "Quick run" in out.joinpath("machine.md").read_text()
    assert out.joinpath("perf_ratios.png").read_bytes()[:4] == b"\x89PNG"


def test_every_registered_case_names_a_known_model_variant_and_target():
    from benchmarks.cases import CASES, MODELS

    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    for c in CASES:
        if c.measure is None:
            model = MODELS[c.model]
            assert c.variant in model.variants, c.name
            assert c.anchor in model.variants, c.name
            for size in c.sizes or (model.quick, model.full):
                assert size in model.sizes, c.name


def test_runner_rejects_a_pattern_with_no_case(capsys):
    from benchmarks import run

    with pytest.raises(SystemExit) as exc:
        run.main(["--only", "no-such-case", "--json", "unused.json"])
    assert exc.value.code == 2 and "no case" in capsys.readouterr().err
