"""One number per fact, for the benchmark figures: every cost-model ratio the docs' prose
quotes is the results files' (issue 44: the wide LM's tensorwise fp8 step read 0.77x, 0.774x
and 0.764x on three pages), the results files read as the docs build reads them
(`docs/conf.py`: results.json, the newer files' records in place of its own)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.tables import with_records

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    names = ("docs/guides/fp8.md", "docs/guides/performance.md")
    return {name: (ROOT / name).read_text() for name in names}


# Cost-model ratios the prose quotes: (page, pattern whose group 1 is the ratio, the record of
# the results files it is, over its bf16 anchor on the same GPU). The results files as the docs
# build reads them: results.json, the newer files' records in place of its own (docs/conf.py).
RATIO_QUOTES = (
    ("docs/guides/fp8.md", r"wide LM tensorwise fp8 \(`Fp8Recipe\(\)`\) is ([\d.]+)x",
     "blocks/lm:wide/fp8-tensorwise@h100"),
    ("docs/guides/fp8.md", r"with copies; tensorwise ([\d.]+)x",
     "blocks/lm:wide/fp8-tensorwise@b200"),
    ("docs/guides/fp8.md", r"tensorwise ([\d.]+)x \([\d.]+x\s+on the B200\)",
     "blocks/lm/fp8-tensorwise@h100"),
    ("docs/guides/fp8.md", r"tensorwise [\d.]+x \(([\d.]+)x\s+on the B200\)",
     "blocks/lm/fp8-tensorwise@b200"),
    ("docs/guides/fp8.md", r"and\s+blockwise ([\d.]+)x \(", "blocks/lm:wide/fp8-blockwise@h100"),
    ("docs/guides/fp8.md", r"\(([\d.]+)x reading its weights' copies, below\)",
     "blocks/lm:wide/fp8-blockwise-copies@h100"),
    ("docs/guides/fp8.md", r"wide LM MXFP8 is ([\d.]+)x bf16", "blocks/lm:wide/fp8-mxfp8@b200"),
    ("docs/guides/fp8.md", r"and ([\d.]+)x reading its weights'\s+copies; NVFP4",
     "blocks/lm:wide/fp8-mxfp8-copies@b200"),
    ("docs/guides/fp8.md", r"copies; NVFP4 ([\d.]+)x", "blocks/lm:wide/fp8-nvfp4@b200"),
    ("docs/guides/fp8.md", r"and ([\d.]+)x with copies", "blocks/lm:wide/fp8-nvfp4-copies@b200"),
    ("docs/guides/performance.md", r"the cost model predicted ([\d.]+)x for tensorwise",
     "fp8/lm:wide/fp8-tensorwise@h100"),
)  # fmt: skip


def newest_records() -> dict[str, dict]:
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    newer = [ROOT / "benchmarks" / f"results-{n}.json" for n in ("gpu", "blocks", "frontier")]
    return {r["name"]: r for r in with_records(results, *newer)["records"]}


def ratio_mismatches(pages: dict[str, str], records: dict[str, dict]) -> list[str]:
    """Every quoted ratio of RATIO_QUOTES that is not its record's roofline over its anchor's,
    rounded to the digits quoted (or that the page no longer quotes)."""
    bad = []
    for page_name, pattern, name in RATIO_QUOTES:
        found = re.findall(pattern, pages[page_name])
        if not found:
            bad.append(f"{page_name}: no quote {pattern!r} (update RATIO_QUOTES)")
        r = records[name]
        anchor = records[name.rsplit("/", 1)[0] + f"/{r['anchor']}@{r['target']}"]
        ratio = r["figures"]["roofline_s"] / anchor["figures"]["roofline_s"]
        for quoted in found:
            digits = len(quoted.split(".")[1])
            if f"{ratio:.{digits}f}" != quoted:
                bad.append(f"{page_name}: {quoted}x for {name}, the results files: {ratio:.4f}x")
    return bad


def test_quoted_cost_model_ratios_are_the_results_files(pages):
    assert not ratio_mismatches(pages, newest_records())


def test_a_stale_ratio_is_caught(pages):
    """The fp8 guide once quoted the wide LM's tensorwise step as 0.774x (the row before the
    amax fix) beside 0.764x: a page quoting a figure its results file does not hold fails."""
    edited = dict(pages)
    edited["docs/guides/fp8.md"] = pages["docs/guides/fp8.md"].replace(
        "(`Fp8Recipe()`) is 0.764x", "(`Fp8Recipe()`) is 0.774x"
    )
    assert edited["docs/guides/fp8.md"] != pages["docs/guides/fp8.md"]
    assert ratio_mismatches(edited, newest_records())
