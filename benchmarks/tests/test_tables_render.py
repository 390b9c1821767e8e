"""The docs' tables and plots read as a newcomer reads them (issue 37): rows named in words,
sizes in GiB/MiB, no exponents, long tables folded, plot labels beside their bars and inside
the plot, one distinct line per table not measured."""

from __future__ import annotations

import json

import pytest

from benchmarks import tables, tables_format, tables_plots, tables_studies
from benchmarks.tests.test_suite import _record


def _ratios_figure(monkeypatch, tmp_path, records):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    tables_plots.plot_ratios(records, tmp_path / "p.png")
    (fig,) = kept
    fig.canvas.draw()
    return fig


def test_ratio_plot_labels_sit_beside_their_bars_inside_the_plot(monkeypatch, tmp_path):
    records = [
        _record("cost", "lm", "bf16"),
        _record("cost", "lm", "policy", roofline_s=0.964e-3, temp_bytes=0.645 * 2**30),
        _record("cost", "lm", "fp32", roofline_s=2.85e-3, temp_bytes=0.959 * 2**30),
        _record("cost", "lm", "autocast", roofline_s=1.01e-3, temp_bytes=2**30),
    ]
    fig = _ratios_figure(monkeypatch, tmp_path, records)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        bars = [b.get_window_extent(renderer) for b in ax.patches]
        for text in ax.texts:
            t = text.get_window_extent(renderer)
            assert box.x0 <= t.x0 and t.x1 <= box.x1, f"label {text.get_text()!r} leaves the plot"
            for b in bars:
                if b.width > 1:
                    assert not t.overlaps(b), f"label {text.get_text()!r} sits on a bar"
        labels = {t.get_text().strip() for t in ax.texts}
        assert labels & {"0.964", "0.645"}, labels
    assert "apply_policy, one bf16 policy" in {t.get_text() for t in fig.axes[0].get_yticklabels()}


def test_cells_never_print_an_exponent():
    assert tables_format.cell(1.035e4) == "10350"
    assert tables_format.cell(0.9641) == "0.9641"


def test_study_byte_counts_read_in_mib_and_the_short_table_keeps_what_is_compared():
    columns = ["model", "variant", "bytes accessed", "bytes ratio vs flax bf16", "temp bytes"]
    columns += ["temp ratio vs flax bf16", "time ratio vs flax bf16", "converts (StableHLO)"]
    rows = [["cnn", "autocast", 689213824, 0.988, 88770560, 0.914, 1.041, 40]]
    figures = {"title": "autocast vs Flax", "columns": columns, "rows": rows, "notes": ""}
    record = {"table": "autocast-cpu", "status": "ok", "figures": figures}
    s_cols, s_rows, f_cols, f_rows = tables_studies.study_table([record])
    assert "accessed (MiB)" in f_cols and "temp (MiB)" in f_cols
    assert f_rows[0][f_cols.index("accessed (MiB)")] == "657.3"
    assert len(s_cols) == 5 and "converts (StableHLO)" not in s_cols
    page = tables.pages({"records": [record]})
    assert page["autocast-cpu"].startswith("**autocast vs Flax**")  # captioned
    assert "689213824" not in page["autocast-cpu_full"]


def test_sizes_dicts_are_written_in_words():
    record = {
        "table": "lce-loss",
        "status": "ok",
        "figures": {"columns": ["a"], "rows": [[1]], "notes": "size {'layers': 12, 'd': 768}."},
    }
    full = tables.pages({"records": [record]})["lce-loss_full"]
    assert "12 layers, width 768" in full and "{" not in full


def test_two_tables_not_measured_read_differently():
    records = [
        {**_record(t, "study", t), "status": "skipped", "reason": "needs a GPU"}
        for t in ("gpu", "kernels-gpu")
    ]
    page = tables.pages({"records": records})
    assert page["gpu"] != page["kernels-gpu"]
    assert "needs a GPU" in page["gpu"] and "needs a GPU" in page["kernels-gpu"]
    assert page["gpu_folded"] == ""


def test_multi_gpu_leads_with_one_host_and_folds_the_full_table():
    figures = dict(collective_bytes=2**20, comm_s_links=1e-3, comm_s_nvlink=1e-3)
    figures.update(comm_s_inter_host=0.0, temp_bytes=10 * 2**30, argument_bytes=2**29)
    figures.update(state_bytes=8, params=1, collectives=3, mesh="1x1x8", by_op_dtype={})
    records = []
    for target in ("h100x8", "h100x2x4"):
        for variant in ("bf16", "fp8-delayed"):
            records.append({**_record("multi-gpu", "lm", variant, **figures), "target": target})
    page = tables.pages({"records": records})
    short = page["multi-gpu"].splitlines()
    assert len(short) == 2 + 2  # header, rule, the two one-host rows
    assert "10.50 GiB" in short[2] and "fp8, delayed scaling" in short[3]
    assert page["multi-gpu_folded"].startswith("<details>")
    assert page["multi-gpu_folded"].count("| lm |") == 4


def test_rows_are_named_in_words_with_the_id_in_small_text():
    page = tables.pages({"records": [_record("cost", "resnet", "bf16"), _record(
        "cost", "resnet", "convbn-xla")]})  # fmt: skip
    assert "fused Conv+BatchNorm, XLA epilogue <small>convbn-xla</small>" in page["cost"]


@pytest.fixture(scope="module")
def committed():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    results = json.loads((root / "benchmarks" / "results.json").read_text())
    gpu = root / "benchmarks" / "results-gpu.json"
    return tables.with_gpu_records(results, gpu)["records"]


def test_each_page_leads_with_a_short_table_in_units_a_person_reads(committed):
    from benchmarks.tables_lead import lead_fp8, lead_memory, lead_performance

    for lead, unit in ((lead_performance, "GiB"), (lead_memory, "GiB"), (lead_fp8, "x")):
        text = lead(committed)
        rows = text.splitlines()[2:]
        assert 5 <= len(rows) <= 10, lead.__name__
        assert all("<small>" in r for r in rows)  # named in words, the id small
        assert unit in text and "e+" not in text
    assert "| fp8, tensorwise current scaling <small>fp8-tensorwise</small> | 0.78x |" in lead_fp8(
        committed
    )


def test_memory_guide_switch_tables_read_in_words(tmp_path):
    from docs.memory_switch_tables import write_memory_switch_tables

    anchor = {"row": "anchor: hand-written bf16, XLA attention", "walk_peak_bytes": 2**30}
    anchor.update(temp_bytes=2**30, argument_bytes=2**29, by_category={"other": 2**30})
    columns = ["step", "temp", "args", "temp + args GiB", "vs a", "vs b", "logits", "other"]
    notes = "sizes {'layers': 12, 'd': 768, 'vocab': 50304} (batch: global)."
    switches = {"columns": columns, "rows": [["r", 1, 1, 2, 1, 1, 3.07, 0]], "notes": notes}
    run = {"mean": 2.72, "bits_per_byte": [2.72]}
    command = "python examples/train_char_lm.py --seeds 1[ --saved-activations float8_e4m3fn]"
    char_lm = {"runs": {"bf16": run}, "ratio": 1.0005, "steps": 500, "seeds": 1}
    records = [
        {"table": "memory-switches", "status": "ok", "figures": {**switches, "details": [anchor]}},
        {
            "table": "memory-switches-char-lm",
            "status": "ok",
            "figures": {"details": {**char_lm, "command": command}},
        },
    ]
    (tmp_path / "results.json").write_text(json.dumps({"records": records}))
    paths = write_memory_switch_tables(tmp_path / "results.json", tmp_path / "out")
    (path,) = [p for p in paths if p.name == "memory_switches.md"]
    text = path.read_text()
    assert "12 layers, width 768, vocabulary 50304" in text and "{'layers'" not in text
    assert "1 seeds" not in text and "seed 0" in text and "[" not in text
    assert "`python examples/train_char_lm.py --seeds 1 --saved-activations float8_e4m3fn`" in text
    short, folded = text.split("<details>")
    assert "logits" not in short.splitlines()[0] and "logits" in folded
