"""The memory figures of the suite: the committed results' bytes per parameter per mode, and
the convergence study (`benchmarks/training_studies.py`'s `memory_convergence`).

The convergence study runs here in quick form (small models, short runs): its structure,
the bytes per parameter of each mode's trained state, and that the char-LM with a float32
master and with `master_weights="remainder"` train bit for bit alike (seed 0).
No timings are asserted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import tables
from benchmarks import training_studies as memory_convergence

ROOT = Path(__file__).resolve().parents[2]

# Bytes per param of each mode's state: scalar counters add < 0.05; int8 state adds a
# float32 scale per block of up to 256 elements of each leaf (more on small leaves).
CHAR_LM_BYTES = {
    "float32 state": 12,  # f32 params, f32 mu and nu, no master
    "bf16 state, stochastic": 8,
    "bf16 state, nearest": 8,
    "bf16 params + float32 master": 14,
    "bf16 params + remainder": 12,
    "bf16 params + remainder + bf16 state, stochastic": 8,
    "int8 state": 6,  # f32 params, 8-bit mu and nu (+ a float32 scale per 256)
    "int8 state, stochastic": 6,
    "bf16 params + remainder + int8 state": 6,
}
DIGITS_BYTES = {
    "float32 state": 12,
    "bf16 state, stochastic": 8,
    "bf16 state, nearest": 8,
    # int8 blocks run along each leaf's last axis: the quick digits ResNet (width 8) has
    # 8-wide last axes, so a float32 scale per 8 codes: 4 + 2 x (1 + 4 / 8) = 7.
    "int8 state": 7,
}


def _slack(mode: str) -> float:
    return 0.5 if "int8" in mode else 0.05


# Bytes per param of each memory mode's state (benchmarks/state_variants.py MEMORY_MODES).
STATE_BYTES = {
    "state-adamw": 12,
    "state-scaled": 12,
    "state-master": 14,
    "state-remainder": 12,
    "state-master-bf16": 10,
    "state-remainder-bf16": 8,
    "state-remainder-int8": 6,
}


@pytest.fixture(scope="module")
def quick():
    return memory_convergence.memory_convergence(None, True, char_lm_seeds=1, digits_seeds=2)


def test_quick_convergence_rows(quick):
    result = json.loads(json.dumps(quick))
    assert not re.search(r"(?<![\w.])/[A-Za-z]", json.dumps(result))  # no absolute paths
    lm = result["char_lm"]
    assert [r["mode"] for r in lm["rows"]] == list(memory_convergence.CHAR_LM_MODES)
    assert lm["steps"] == memory_convergence.QUICK_CHAR_LM["steps"] and lm["seeds"] == 1
    for r in lm["rows"]:
        assert r["bytes_per_param"] == pytest.approx(
            CHAR_LM_BYTES[r["mode"]], abs=_slack(r["mode"])
        )
        assert 0.0 < r["val_bits_per_byte"] < 8.0
        assert r["vs_float32_state_pct"] == pytest.approx(
            100 * (r["val_bits_per_byte"] / lm["rows"][0]["val_bits_per_byte"] - 1)
        )
    assert lm["rows"][0]["vs_float32_state_pct"] == 0.0

    d = result["digits"]
    assert [r["mode"] for r in d["rows"]] == list(memory_convergence.DIGITS_MODES)
    assert d["seeds"] == 2 and d["test_images"] > 0
    for r in d["rows"]:
        assert r["bytes_per_param"] == pytest.approx(DIGITS_BYTES[r["mode"]], abs=_slack(r["mode"]))
        assert len(r["accuracies"]) == 2 and all(0 <= a <= 100 for a in r["accuracies"])
        ref = d["rows"][0]["accuracy_mean"]
        assert r["vs_float32_state_pp"] == pytest.approx(r["accuracy_mean"] - ref)


def test_remainder_trains_bit_for_bit_like_the_float32_master(quick):
    """Seed 0 of the quick char-LM: every loss, the metric and the masters bit for bit.

    Deterministic for a given XLA build. Not a law of every build: the two train steps are
    different programs, and XLA may contract a multiply-add into an FMA in one and not the
    other (seed 1 of this configuration has one master element 1 ulp apart after step 3
    on XLA:CPU with AVX2; none with `--xla_cpu_max_isa=SSE4_2`). `tests/scaling/test_memory.py`
    checks the update itself bit for bit, fed the same gradients.
    """
    lm = quick["char_lm"]
    check = lm["bit_identical"]
    assert check["pair"] == list(memory_convergence.IDENTICAL_PAIR)
    assert check["losses"] and check["metric"] and check["masters"]
    rows = {r["mode"]: r for r in lm["rows"]}
    a, b = (rows[name] for name in memory_convergence.IDENTICAL_PAIR)
    assert a["per_seed"] == b["per_seed"]


def test_bit_identical_tells_runs_apart():
    """The check itself fails on runs that differ (so its True above means something)."""
    from examples.train_char_lm import CharLMConfig, load_corpus, make_train_fns, train

    corpus = load_corpus(200_000)
    config = CharLMConfig(precision="bf16", param_dtype="bf16", **memory_convergence.QUICK_CHAR_LM)
    fns = make_train_fns(config)  # one compile for both seeds
    a, b = (train(config, seed, corpus=corpus, fns=fns) for seed in (0, 1))
    same = memory_convergence.bit_identical(a, a)
    assert same == {"losses": True, "metric": True, "masters": True, "differing_master_elements": 0}
    other = memory_convergence.bit_identical(a, b)
    assert not (other["losses"] or other["metric"] or other["masters"])
    assert other["differing_master_elements"] > 0


def test_docs_tables_generate_from_the_results(quick):
    record = {"table": "convergence", "status": "ok", "figures": quick}
    text = tables.pages({"records": [record]})
    assert "bit for bit identical" in text["memory_char_lm"]
    assert text["memory_char_lm"].count("\n|") == 1 + len(memory_convergence.CHAR_LM_MODES)
    assert text["memory_digits"].count("\n|") == 1 + len(memory_convergence.DIGITS_MODES)
    assert "not measured in this run" in text["memory_step"]


def test_committed_gpu_results_cover_every_gpu_case():
    """benchmarks/results-gpu.json (the docs' GPU tables): benchmarks/gpu.py on a real GPU."""
    from benchmarks.cases import CASES

    results = json.loads((ROOT / "benchmarks" / "results-gpu.json").read_text())
    assert results["quick"] is False
    assert all(run["machine"]["platform"] == "gpu" for run in results["runs"])
    assert all(run["command"].startswith("python benchmarks/gpu.py") for run in results["runs"])
    records = {r["name"]: r for r in results["records"]}
    assert set(records) == {c.name for c in CASES if c.target == "gpu"}
    assert {r["status"] for r in records.values()} <= {"ok", "skipped"}
    assert any(r["status"] == "ok" for r in records.values())
    assert not re.search(r"(?<![\w.])/[A-Za-z]", json.dumps(results))  # no absolute paths


def test_committed_results_are_one_full_run_of_the_suite():
    """benchmarks/results.json (the docs' source): one full `run.py` command, every case."""
    from benchmarks.cases import CASES

    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    assert results["quick"] is False  # full sizes
    records = {r["name"]: r for r in results["records"]}
    # every registered case but the real-GPU ones (benchmarks/gpu.py's file), nothing else;
    # a case added since the full run is measured in a newer file (results-blocks.json...)
    newer = set()
    for name in ("blocks", "frontier"):
        path = ROOT / "benchmarks" / f"results-{name}.json"
        newer |= {r["name"] for r in json.loads(path.read_text())["records"]}
    registered = {c.name for c in CASES if c.target != "gpu"}
    assert set(records) - {c.name for c in CASES if c.target == "gpu"} <= registered
    assert registered - set(records) <= newer, sorted(registered - set(records) - newer)
    bad = {n: r["status"] for n, r in records.items() if r["status"] not in ("ok", "skipped")}
    assert not bad
    skipped = {n: r["reason"] for n, r in records.items() if r["status"] == "skipped"}
    # skipped: the real-GPU cases (no GPU here), and the jmp comparison where the gpu-aot
    # environment lacks the optional package
    for name, reason in skipped.items():
        assert records[name]["target"] == "gpu" or "jmp" in name, (name, reason)
    assert results["command"].startswith("python benchmarks/run.py")
    assert "--only" not in results["command"] and "--resume" not in results["command"]
    assert "finished" in results
    assert not re.search(r"(?<![\w.])/[A-Za-z]", json.dumps(results))  # no absolute paths
    memory = [r for r in results["records"] if r["table"] == "memory" and r["model"] == "opt-lm"]
    assert {r["variant"] for r in memory} == set(STATE_BYTES)
    for r in memory:
        f = r["figures"]
        slack = 0.5 if "int8" in r["variant"] else 0.05
        assert f["state_bytes"] / f["params"] == pytest.approx(STATE_BYTES[r["variant"]], abs=slack)
    (conv,) = [r for r in results["records"] if r["table"] == "convergence"]
    lm = conv["figures"]["char_lm"]
    check = lm["bit_identical"]
    assert len(check["per_seed"]) == lm["seeds"] >= 1
    for r in lm["rows"]:
        assert r["bytes_per_param"] == pytest.approx(
            CHAR_LM_BYTES[r["mode"]], abs=_slack(r["mode"])
        )
