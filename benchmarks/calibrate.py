"""Derives the calibration table from the measured rows of `results-gpu.json`.

    MPJAX_GPU_AOT_PYTHON=... python benchmarks/calibrate.py      # the gpu-aot environment

For every measured (`ok`) row of `benchmarks/results-gpu.json` and its anchor, the model
needs the program's kernels: a row measured by `benchmarks/gpu.py` since this script exists
carries them (`figures.model_class_s`: the roofline seconds per kernel class of the program
it timed, at its GPU's peaks); for older rows the same program is compiled here for the
deviceless H100 (compute capability 9.0, the H200's too) and its kernels timed at the
measuring GPU's peaks (`analysis.peaks.PEAKS`, e.g. the H200's 4.8 TB/s). Then:

1. `analysis.calibrated.fit_efficiencies` fits, per GPU class, each kernel class's efficiency
   to the rows' measured step times (bounded least squares; classes too small to identify
   stay unmeasured);
2. the block-scaled lowerings measured (`LOWERINGS`: variant -> recipe, lowering) are
   recorded with their step ratios (what `block_lowering="auto"` reads);
3. the table is written to `mpjax/_src/core/calibration.json`, and every measured row gets
   `figures.model_vs_anchor`: the calibrated model's step ratio against its anchor on the
   measuring GPU, beside the measured `time_vs_anchor`.

`--hlo-cache DIR` keeps the compiled programs' HLO text, so a rerun does not recompile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

RESULTS = ROOT / "benchmarks" / "results-gpu.json"
# variant -> (recipe scaling, its lowering): the block-scaled rows `auto` decides from
LOWERINGS = {
    "fp8-blockwise": ("blockwise", "native"),
    "fp8-blockwise-emulated": ("blockwise", "emulated"),
    "fp8-mxfp8": ("mxfp8", "native"),
    "fp8-nvfp4": ("nvfp4", "native"),
}
# device kind substrings -> cost-model target
DEVICES = (("H200", "h200"), ("H100", "h100"), ("H800", "h100"), ("B200", "b200"))


def gpu_of(device_kind: str) -> str | None:
    """The cost-model target of a device kind (`"NVIDIA H200"` -> `"h200"`), else None."""
    return next((t for name, t in DEVICES if name in device_kind.upper()), None)


def run_of(record: dict, runs: list) -> dict:
    """The run that measured a row: the last whose `--only` patterns name it, else the first
    run without `--only` (results files merged from several commands list them in `runs`)."""
    found = None
    for run in runs:
        words = run["command"].split()
        only = words[words.index("--only") + 1].split(",") if "--only" in words else None
        if only is None and found is None or only and any(p in record["name"] for p in only):
            found = run
    return found or runs[0]


def _key(r: dict) -> tuple:
    return (r["model"], r.get("size"), r["variant"])


def _class_seconds(record: dict, gpu: str, cache: Path | None) -> dict:
    """`{class: peak seconds on gpu}` of a row's program: its own, else a deviceless compile."""
    saved = (record.get("figures") or {}).get("model_class_s", {})
    if gpu in saved:
        return saved[gpu]
    from benchmarks.cases import MODELS
    from benchmarks.harness import compile_program
    from mpjax._src.analysis.calibrated import seconds_by_class
    from mpjax._src.analysis.hlo_cost import analyze

    model = MODELS[record["model"]]
    size = record.get("size") or model.full
    name = f"{record['model']}-{size}-{record['variant']}.hlo.txt"
    path = cache / name if cache else None
    if path is not None and path.exists():
        text = path.read_text()
    else:
        cfg = model.config(model.sizes[size], size)
        program = model.variants[record["variant"]](cfg)
        print(f"[compile] {name} for the deviceless H100 ...", flush=True)
        _, compiled, _ = compile_program(program, "h100", model.split, {})
        text = compiled.as_text()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return seconds_by_class(analyze(text), gpu)


def _anchor_of(record: dict, records: list) -> dict:
    """The anchor's row (same model and size), or a stand-in record to compile."""
    want = (record["model"], record.get("size"), record["anchor"])
    found = [r for r in records if _key(r) == want]
    return found[0] if found else {**record, "variant": record["anchor"], "figures": {}}


def calibrate(results: dict, cache: Path | None = None) -> dict:
    """The calibration table from `results` (mutated: class seconds and model_vs_anchor)."""
    from mpjax._src.analysis.calibrated import MIN_SHARE, fit_efficiencies, model_seconds
    from mpjax._src.core.calibration import GPU_CLASSES

    runs = results.get("runs") or [{"command": results["command"], "machine": results["machine"]}]
    by_class: dict = {}
    for r in results["records"]:
        if r["status"] != "ok" or "time_vs_anchor" not in (r.get("figures") or {}):
            continue
        run = run_of(r, runs)
        gpu = gpu_of(run["machine"].get("device_kind", ""))
        if gpu is None:
            continue
        f = r["figures"]
        f.setdefault("model_class_s", {})[gpu] = _class_seconds(r, gpu, cache)
        anchor = _anchor_of(r, results["records"])
        if gpu in f.get("anchor_model_class_s", {}):  # timed beside it in the same run
            anchor = {"name": r["anchor"], "figures": {"model_class_s": f["anchor_model_class_s"]}}
        elif anchor is not r:
            anchor.setdefault("figures", {}).setdefault("model_class_s", {})[gpu] = _class_seconds(
                anchor, gpu, cache
            )
        row = (f["time_s"]["median"], f["model_class_s"][gpu], r, anchor, gpu, run)
        by_class.setdefault(GPU_CLASSES[gpu], []).append(row)
    table: dict = {
        "about": (
            "Measured kernel efficiencies (fraction of the data-sheet roofline peak) per GPU "
            "class and kernel class, written by benchmarks/calibrate.py from "
            "benchmarks/results-gpu.json (mpjax/_src/core/calibration.py reads it)."
        ),
        "entries": {},
        "lowerings": {},
    }
    for cls, rows in by_class.items():
        fitted = fit_efficiencies([(t, s) for t, s, *_ in rows])
        entries = table["entries"].setdefault(cls, {})
        for kc, (eff, joint) in fitted.items():
            used = [row for row in rows if row[1].get(kc, 0.0) >= MIN_SHARE * sum(row[1].values())]
            runs_used = {id(row[5]): row[5] for row in used}.values()
            entries[kc] = {
                "efficiency": round(eff, 4),
                "gpu": sorted({row[5]["machine"]["device_kind"] for row in used})[0],
                "date": ", ".join(sorted({run["machine"]["date"] for run in runs_used})),
                "command": "; ".join(run["command"] for run in runs_used),
                "rows": [row[2]["name"] for row in used],
                "joint_with": list(joint),
                "method": (
                    f"fit_efficiencies over the {len(rows)} measured {cls} step rows "
                    "(their kernels timed at the measuring GPU's peaks)"
                    + (
                        f"; one efficiency with {', '.join(joint)}: no row tells them apart"
                        if joint
                        else ""
                    )
                ),
            }
        for _, _, r, _, _, run in rows:
            if r["variant"] in LOWERINGS:
                scaling, lowering = LOWERINGS[r["variant"]]
                table["lowerings"].setdefault(cls, {}).setdefault(scaling, {})[lowering] = {
                    "ratio": round(r["figures"]["time_vs_anchor"]["median"], 4),
                    "row": r["name"],
                    "gpu": run["machine"]["device_kind"],
                    "date": run["machine"]["date"],
                    "command": run["command"],
                }
    for rows in by_class.values():
        for _, s, r, anchor, gpu, _ in rows:
            model = model_seconds(s, gpu, table)
            base = model_seconds(anchor["figures"]["model_class_s"][gpu], gpu, table)
            r["figures"]["model_vs_anchor"] = round(model.seconds / base.seconds, 4)
            r["figures"]["model_gpu"] = gpu
            r["figures"]["model_unmeasured"] = list(model.unmeasured)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=RESULTS, help="the measured results file")
    p.add_argument("--table", type=Path, default=None, help="the table (default: mpjax's)")
    p.add_argument("--hlo-cache", type=Path, default=None, help="keep compiled HLO text here")
    args = p.parse_args(argv)
    from mpjax._src.core.calibration import TABLE_PATH

    results = json.loads(args.json.read_text())
    table = calibrate(results, args.hlo_cache)
    (args.table or TABLE_PATH).write_text(json.dumps(table, indent=1) + "\n")
    args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    for cls, entries in table["entries"].items():
        for kc, e in entries.items():
            print(f"{cls:10s} {kc:24s} efficiency {e['efficiency']:.3f}")
    for r in results["records"]:
        f = r.get("figures") or {}
        if "model_vs_anchor" in f:
            measured = f["time_vs_anchor"]["median"]
            print(f"{r['name']:40s} measured x{measured:.3f}  model x{f['model_vs_anchor']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
