"""Every cell of the short tables the pages lead with is the figure the full tables give for
the same model, variant and target (issue 44: the performance page's GPT-2-small table showed
ResNet-50's figures in five rows), read from the committed results files as the docs build
reads them (`docs/conf.py`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import tables
from benchmarks.tables_lead import lead_fp8, lead_memory, lead_performance

ROOT = Path(__file__).resolve().parents[2]
NEWER = [ROOT / "benchmarks" / f"results-{name}.json" for name in ("gpu", "blocks", "frontier")]
ANCHOR = "1 (anchor)"


def rows(markdown: str) -> list[dict[str, str]]:
    """A pipe table's rows as {column: cell} (an escaped `\\|` stays inside its cell)."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]

    def cells(line: str) -> list[str]:
        return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]

    columns = cells(lines[0])
    return [dict(zip(columns, cells(line), strict=True)) for line in lines[2:]]


def variant_of(name: str) -> str:
    """`float32 model <small>fp32</small>` -> `fp32`."""
    return re.search(r"<small>(.*?)</small>", name).group(1)


def number(text: str) -> float:
    return float(re.match(r"\*{0,2}([-\d.]+)", text).group(1))


@pytest.fixture(scope="module")
def committed():
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    results = tables.with_records(results, *NEWER)
    return results["records"], tables.pages(results)


def full_cells(page: str, select: dict[str, str], variant: str, column: str) -> list[str]:
    """The `column` cells of the rows of full table `page` whose columns hold `select`'s
    values and whose variant (a `variant` column, or the id in a `path` column) is
    `variant`."""
    out = []
    for row in rows(page):
        name = row.get("variant") or variant_of(row.get("path", "<small></small>"))
        if name == variant and all(row[k] == v for k, v in select.items()):
            out.append(row[column])
    return out


def check(lead: str, full: list[str], tolerance: float, what: str) -> None:
    """`lead` (`0.93x`, `5.40 GiB`, `1 (anchor)` or `-`) against every full-table cell of the
    same fact (`full`: one per full table holding it, each as a number in the lead's unit)."""
    if lead == "-":
        assert not full, f"{what}: the lead reads '-', the full tables {full}"
        return
    assert full, f"{what}: the lead reads {lead!r}, no full table has the figure"
    for f in full:
        if lead == ANCHOR:
            assert f is None or abs(f - 1) <= tolerance, f"{what}: anchor, full table {f}"
        else:
            got = number(lead)
            assert abs(got - f) <= tolerance, f"{what}: lead {lead}, full table {f}"


RATIO = 0.0051  # the lead rounds to 2 decimals, the full tables to 3
GIB_TOL = 0.0052


def test_performance_lead_reads_gpt2_small_in_every_cell(committed):
    records, pages = committed
    for row in rows(lead_performance(records)):
        v = variant_of(row["GPT-2 small, path"])
        gpu = full_cells(pages["gpu_full"], {"model": "GPT-2 small"}, v, "time vs anchor")
        # The anchor's real-GPU row is timed against itself (not exactly 1): only its presence.
        gpu = [None if row["step time, real GPU"] == ANCHOR else number(c) for c in gpu]
        check(row["step time, real GPU"], gpu, RATIO, f"{v}: real GPU")
        roofline = full_cells(pages["cost_full"], {"model": "lm"}, v, "roofline vs anchor")
        roofline += full_cells(pages["fp8_full"], {"size": "lm"}, v, "vs anchor")
        check(row["H100 cost model (roofline)"], [number(c) for c in roofline], RATIO, v)
        temp = full_cells(pages["cost_full"], {"model": "lm"}, v, "temp GiB")
        temp += full_cells(pages["fp8_full"], {"size": "lm"}, v, "temp GiB")
        check(row["temp memory, 1 GPU"], [number(c) for c in temp], GIB_TOL, f"{v}: temp")
        select = {"model": "lm", "target": "h100x8"}
        fsdp = [
            (number(t) + number(a)) / 1024
            for t, a in zip(
                full_cells(pages["multi-gpu_full"], select, v, "temp MiB/dev"),
                full_cells(pages["multi-gpu_full"], select, v, "args MiB/dev"),
                strict=True,
            )
        ]
        check(row["memory per GPU, 8 GPUs (FSDP)"], fsdp, GIB_TOL, f"{v}: 8 GPUs")


def test_fp8_lead_reads_the_wide_lm_on_each_gpu_in_every_cell(committed):
    records, pages = committed
    for row in rows(lead_fp8(records)):
        v = variant_of(row["recipe"])
        gpu = full_cells(pages["gpu_full"], {"model": "wide LM"}, v, "time vs anchor")
        gpu = [None if row["step time, real H200"] == ANCHOR else number(c) for c in gpu]
        check(row["step time, real H200"], gpu, RATIO, f"{v}: real GPU")
        for column, target in (("H100 cost model", "H100"), ("B200 cost model", "B200")):
            # one number per fact: the blocks and fp8 tables agree where both hold the step
            cost = full_cells(pages["blocks_full"], {"GPU": target, "size": "wide"}, v, "vs bf16")
            if target == "H100":
                cost += full_cells(pages["fp8_full"], {"size": "wide"}, v, "vs anchor")
            check(row[column], [number(c) for c in cost], RATIO, f"{v}: {column}")


def test_memory_lead_reads_the_memory_tables(committed):
    records, pages = committed
    state = {r["set-up"]: r for r in rows(pages["memory_state"])}
    step = {r["set-up"]: r for r in rows(pages["memory_step"])}
    lead = rows(lead_memory(records))
    assert lead
    for row in lead:
        label = row["training state"].split(" <small>")[0]
        assert row["bytes / param"] == state[label]["bytes / param"].strip("*"), label
        gib = number(row["per GPU, 8-way FSDP"])
        assert gib == number(state[label]["GiB per device, 8-way FSDP"]), label
        check(row["optimizer step bytes"], [number(step[label]["bytes vs today's"])], RATIO, label)


def test_a_lead_cell_of_another_models_record_is_caught():
    """The lookup the performance lead once made (the first ok record of the variant, any
    model) is what these tests catch: ResNet-50's record first gives ResNet's figure."""
    figures = {"roofline_s": 2.0, "temp_bytes": 2**30}
    recs = [
        {"table": "cost", "model": m, "variant": v, "anchor": "bf16", "status": "ok",
         "target": "h100", "size": None, "figures": dict(figures, roofline_s=s)}
        for m, v, s in (("resnet", "bf16", 1.0), ("resnet", "fp32", 1.9), ("lm", "bf16", 1.0),
                        ("lm", "fp32", 2.8))
    ]  # fmt: skip
    (fp32,) = [r for r in rows(lead_performance(recs)) if "<small>fp32</small>" in r[
        "GPT-2 small, path"]]  # fmt: skip
    assert fp32["H100 cost model (roofline)"] == "2.80x"


@pytest.mark.parametrize(
    "name", ["perf_ratios.png", "memory_per_device.png", "memory_frontier.png", "fp8_recipes.png"]
)
def test_every_label_of_a_docs_plot_is_whole(committed, monkeypatch, tmp_path, name):
    """Each text of the plot (title, axis labels, ticks, value labels, legend) lies inside the
    figure: the memory guide's lead plot cut its axis label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    records, _ = committed
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plots = {
        "perf_ratios.png": (tables.plot_ratios, "cost"),
        "memory_per_device.png": (tables.plot_memory, "memory"),
        "memory_frontier.png": (tables.plot_frontier, "memory-switches"),
    }
    if name == "fp8_recipes.png":
        tables.plot_fp8(records, tmp_path / name)
    else:
        plot, table = plots[name]
        plot([r for r in records if r["table"] == table and r["status"] == "ok"], tmp_path / name)
    (fig,) = kept
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    drawn = fig.get_tightbbox(renderer)  # inches, every artist drawn (ticks in view only)
    width, height = fig.get_size_inches()
    tol = 1 / fig.dpi  # a pixel
    inside = drawn.x0 >= -tol and drawn.y0 >= -tol
    assert inside and drawn.x1 <= width + tol and drawn.y1 <= height + tol, (
        f"{name}: its texts reach {drawn}, outside the {width}x{height} in figure: "
        + "; ".join(
            f"{t.get_text()!r} {t.get_window_extent(renderer)}"
            for t in fig.findobj(Text)
            if t.get_visible()
            and t.get_text().strip()
            and not fig.bbox.contains(*t.get_window_extent(renderer).p1)
        )
    )
    plt.close(fig)
