"""The calibrated cost model against the real-GPU measurements it was fitted to.

`benchmarks/results-gpu.json` holds the measured rows (each with the roofline seconds per
kernel class of its program, `figures.model_class_s`); `mpjax/_src/core/calibration.json` the
efficiencies `benchmarks/calibrate.py` fitted to them. The tests read both: nothing here
hard-codes a ratio or an efficiency.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mpjax
from mpjax._src.analysis.calibrated import (
    MIN_SHARE,
    fit_efficiencies,
    kernel_class,
    model_seconds,
)
from mpjax._src.analysis.hlo_cost import Kernel
from mpjax._src.core.calibration import (
    GPU_CLASSES,
    KERNEL_CLASSES,
    UNMEASURED_EFFICIENCY,
    efficiency,
    load_table,
    native_measured_faster,
)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = json.loads((ROOT / "benchmarks" / "results-gpu.json").read_text())
TABLE = load_table()


def _measured():
    """(record, gpu, its class seconds, its anchor's class seconds) per modelled row."""
    rows = []
    for r in RESULTS["records"]:
        f = r.get("figures") or {}
        if r["status"] != "ok" or "model_class_s" not in f or "time_vs_anchor" not in f:
            continue
        gpu = f["model_gpu"]
        anchor = f.get("anchor_model_class_s", {}).get(gpu)
        if anchor is None:
            (a,) = [
                x
                for x in RESULTS["records"]
                if (x["model"], x.get("size"), x["variant"])
                == (r["model"], r.get("size"), r["anchor"])
            ]
            anchor = a["figures"]["model_class_s"][gpu]
        rows.append((r, gpu, f["model_class_s"][gpu], anchor))
    return rows


MEASURED = _measured()


def test_every_measured_row_is_modelled():
    ok = [
        r
        for r in RESULTS["records"]
        if r["status"] == "ok" and "time_vs_anchor" in (r.get("figures") or {})
    ]
    assert ok and len(MEASURED) == len(ok)
    for r in ok:
        assert isinstance(r["figures"]["model_vs_anchor"], float)


@pytest.mark.parametrize("row", MEASURED, ids=lambda row: row[0]["name"])
def test_calibrated_model_reproduces_the_measured_ratio_within_10_percent(row):
    r, gpu, classes, anchor = row
    model = model_seconds(classes, gpu).seconds / model_seconds(anchor, gpu).seconds
    measured = r["figures"]["time_vs_anchor"]["median"]
    assert abs(model / measured - 1) <= 0.10, (r["name"], model, measured)
    assert model == pytest.approx(r["figures"]["model_vs_anchor"], abs=1e-3)


def test_table_is_the_fit_of_the_measured_rows():
    by_class: dict = {}
    for r, gpu, classes, _ in MEASURED:
        by_class.setdefault(GPU_CLASSES[gpu], []).append(
            (r["figures"]["time_s"]["median"], classes)
        )
    assert set(by_class) == set(TABLE["entries"])
    for cls, rows in by_class.items():
        fitted = fit_efficiencies(rows)
        entries = TABLE["entries"][cls]
        assert set(fitted) == set(entries)
        for kc, (e, joint) in fitted.items():
            assert entries[kc]["efficiency"] == pytest.approx(e, abs=1e-4)
            assert entries[kc]["joint_with"] == list(joint)


def test_every_entry_names_gpu_command_date_and_rows():
    names = {r["name"] for r in RESULTS["records"] if r["status"] == "ok"}
    for entries in TABLE["entries"].values():
        for kc, e in entries.items():
            assert kc in KERNEL_CLASSES and 0 < e["efficiency"] <= 1
            assert e["gpu"].startswith("NVIDIA") and e["date"][:4].isdigit()
            assert e["command"].startswith("python benchmarks/gpu.py")
            assert e["rows"] and set(e["rows"]) <= names


def test_unmeasured_class_is_pessimistic_and_named():
    unmeasured = [
        (t, kc)
        for t in GPU_CLASSES
        for kc in KERNEL_CLASSES
        if kc not in TABLE["entries"].get(GPU_CLASSES[t], {})
    ]
    assert unmeasured  # e.g. every class on Blackwell
    target, kc = unmeasured[0]
    eff = efficiency(target, kc)
    assert eff.value == UNMEASURED_EFFICIENCY < 1 and not eff.measured
    model = model_seconds({kc: 1.0, "fusion": 0.0}, target)
    assert model.seconds == pytest.approx(1 / UNMEASURED_EFFICIENCY)
    assert model.peak_seconds == 1.0 and model.unmeasured == (kc,)


def test_measured_classes_are_identifiable():
    """A fitted class is a sizeable share of some row it was fitted on."""
    for r, gpu, classes, _ in MEASURED:
        for kc in TABLE["entries"].get(GPU_CLASSES[gpu], {}):
            if classes.get(kc, 0) >= MIN_SHARE * sum(classes.values()):
                assert r["name"] in TABLE["entries"][GPU_CLASSES[gpu]][kc]["rows"]


def test_auto_lowering_follows_the_measured_lowerings():
    for cls, recipes in TABLE["lowerings"].items():
        for scaling, lowerings in recipes.items():
            native = lowerings["native"]["ratio"]
            emulated = (lowerings.get("emulated") or {}).get("ratio", 1.0)
            assert native_measured_faster(scaling, cls) == (native < emulated)
    # the one Hopper measurement: blockwise natively slower than bf16, so auto emulates
    assert TABLE["lowerings"]["hopper"]["blockwise"]["native"]["ratio"] > 1
    assert not native_measured_faster("blockwise", "hopper")
    assert not native_measured_faster("blockwise", None)  # no GPU
    # a synthetic table: native measured faster than bf16 (emulated unmeasured), then slower
    # than a measured emulated lowering
    fast = {"lowerings": {"hopper": {"blockwise": {"native": {"ratio": 0.8}}}}}
    assert native_measured_faster("blockwise", "hopper", fast)
    fast["lowerings"]["hopper"]["blockwise"]["emulated"] = {"ratio": 0.7}
    assert not native_measured_faster("blockwise", "hopper", fast)


def test_kernel_class_sorts_the_kinds():
    def k(kind, tensor=None, conv=None, op=""):
        return Kernel("k", kind, 1, tensor or {}, tensor or {}, conv or {}, 0, 0.0, False, op)

    assert kernel_class(k("triton gemm", {"bf16": 10})) == "bf16 gemm"
    assert kernel_class(k("cublas gemm", {"f8e4m3fnxf8e5m2": 10})) == "fp8 gemm"
    assert kernel_class(k("cublas gemm", {"f32": 10})) == "f32 gemm"
    assert kernel_class(k("cudnn attention", {"bf16": 10})) == "attention"
    assert kernel_class(k("pallas/triton call", {"f8e4m3fn": 10})) == "pallas blockwise gemm"
    assert kernel_class(k("pallas/triton call", op="jit(f)/block_quantize")) == (
        "pallas block quantise"
    )
    assert kernel_class(k("pallas/triton call", op="unscale")) == "pallas kernel"
    assert kernel_class(k("cudnn conv", conv={"bf16": 1})) == "conv"
    assert kernel_class(k("loop fusion")) == "fusion"


def test_bad_names_raise():
    with pytest.raises(ValueError, match="target='a100'"):
        efficiency("a100", "fusion")
    with pytest.raises(ValueError, match="kernel_class='gemm'"):
        efficiency("h100", "gemm")
    with pytest.raises(ValueError, match="rows is empty"):
        fit_efficiencies([])


def test_choose_roofline_h100_never_picks_a_recipe_measured_slower_on_the_wide_lm():
    """Each wide-LM GEMM (its forward sizes from the measured row's config) under every
    block-lowering: no choice is a format whose wide-LM row measured slower than bf16."""
    from mpjax._src.fp8.choose import choose_gemm_format
    from mpjax._src.fp8.recipe import Fp8Site

    formats = {"fp8-blockwise": "blockwise", "fp8-tensorwise": "tensorwise"}
    formats["fp8-rowwise"] = "rowwise"
    wide = [r for r, *_ in MEASURED if r.get("size") == "wide" and r["variant"] in formats]
    slower = {formats[r["variant"]] for r in wide if r["figures"]["time_vs_anchor"]["median"] > 1}
    assert "blockwise" in slower
    cfg = wide[0]["figures"]["config"]
    m, d, mlp = cfg["batch"] * cfg["seq"], cfg["d"], cfg["mlp"]
    dims = (((1,), (0,)), ((), ()))
    import jax.numpy as jnp

    for lowering in ("auto", "native", "emulated"):
        for scaling in formats.values():
            recipe = mpjax.Fp8Recipe(
                scaling, choose="roofline", target="h100", block_lowering=lowering
            )
            for k, n in ((d, 3 * d), (d, d), (d, mlp), (mlp, d)):
                site = Fp8Site("", (m, k), (k, n), dims)
                choice = choose_gemm_format(recipe, site, jnp.bfloat16)
                assert choice.format not in slower, (scaling, lowering, (m, k, n), choice)


def test_report_names_the_unmeasured_kernels_in_its_summary():
    from mpjax._src.report.build import Report
    from mpjax._src.report.records import Memory

    memory = Memory(1, 2, 3, 2e-3, 1e-3, ("pallas kernel",))
    text = Report("h100", (), (), (), memory).summary()
    assert "roofline 2 ms (calibrated)" in text
    assert f"unmeasured kernels (pallas kernel) costed at {UNMEASURED_EFFICIENCY}" in text
    measured = Report("h100", (), (), (), Memory(1, 2, 3, 2e-3, 1e-3, ())).summary()
    assert "unmeasured" not in measured


def test_unmeasured_efficiency_is_below_every_measured_library_kernel():
    """Pessimistic: no unmeasured class is credited with more than a measured class of XLA's
    or a library's (mpjax's Pallas kernels measured lower still)."""
    library = [
        e["efficiency"]
        for entries in TABLE["entries"].values()
        for kc, e in entries.items()
        if not kc.startswith("pallas")
    ]
    assert library and UNMEASURED_EFFICIENCY < min(library)


def test_the_table_ships_with_the_package():
    import tomllib
    from fnmatch import fnmatch

    from mpjax._src.core.calibration import TABLE_PATH

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["mpjax._src.core"]
    assert TABLE_PATH.parent == ROOT / "mpjax" / "_src" / "core"
    assert any(fnmatch(TABLE_PATH.name, p) for p in patterns)
