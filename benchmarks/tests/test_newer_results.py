"""The results files re-measured since the suite's full run (results-blocks.json,
results-frontier.json): each from one `run.py --only` command, and the docs read their
records in place of results.json's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import tables

ROOT = Path(__file__).resolve().parents[2]
NEWER = ("blocks", "frontier")


@pytest.mark.parametrize("name", NEWER)
def test_a_newer_results_file_is_one_run_py_command(name):
    results = json.loads((ROOT / "benchmarks" / f"results-{name}.json").read_text())
    assert results["command"].startswith("python benchmarks/run.py --only ")
    assert results["quick"] is False and "finished" in results
    assert results["records"] and all(r["status"] == "ok" for r in results["records"])
    assert not re.search(r"(?<![\w.])/[A-Za-z]", json.dumps(results))  # no absolute paths
    from benchmarks.cases import CASES

    assert {r["name"] for r in results["records"]} <= {c.name for c in CASES}  # suite cases


def test_newer_records_replace_the_full_runs(tmp_path):
    old = {"records": [{"name": "a", "v": 1}, {"name": "b", "v": 1}]}
    (tmp_path / "new.json").write_text(json.dumps({"records": [{"name": "b", "v": 2}]}))
    got = tables.with_records(old, tmp_path / "new.json", tmp_path / "missing.json", None)
    assert sorted((r["name"], r["v"]) for r in got["records"]) == [("a", 1), ("b", 2)]
    assert old["records"][1]["v"] == 1  # the input is not changed
