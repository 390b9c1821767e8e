"""Runs every benchmark in this folder and writes `RESULTS.md` and `results.json`.

A benchmark is a script `benchmarks/<name>.py` exposing `run(quick: bool = False) -> dict`
(see `benchmarks/common.py`). Each one runs in its own Python process (so its XLA flags,
device count and memory do not leak into the next) and is reported as one of:

- ok: its table goes into RESULTS.md;
- skipped: it needs a GPU (`REQUIRES_GPU = True`, or a file name containing "gpu" when
  the attribute is absent) and jax has none here, it needs an optional package that is
  not installed, or it raised `benchmarks.common.Skip`;
- error: it raised, returned a malformed result or ran past its time limit (the exit
  status is then 1). A script may set a module-level literal `TIMEOUT_SCALE = k` to get k
  times the limit (read from its source, not imported).

Usage:
  python benchmarks/run.py            # every benchmark, full sizes
  python benchmarks/run.py --quick    # tiny sizes (a few minutes on 2 cores)
  python benchmarks/run.py --only step_overhead,gpu --out /tmp/results
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOT_BENCHMARKS = {"run", "common", "__init__", "conftest"}


def discover(bench_dir: Path) -> list[str]:
    """Names of the candidate benchmark scripts in `bench_dir`, sorted."""
    return sorted(
        p.stem
        for p in bench_dir.glob("*.py")
        if p.stem not in NOT_BENCHMARKS and not p.stem.startswith(("_", "test_"))
    )


def _missing_extra(exc: BaseException) -> str | None:
    """The optional package an ImportError is about, or None if it is a bug in the repo."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if top in ("mpjax", "benchmarks"):
        return None
    return exc.name


# --- child: run one benchmark in this process and write its record as JSON ---------------


def _run_child(name: str, bench_dir: Path, quick: bool, result_file: Path) -> None:
    # Scripts may import `benchmarks.common` (repo root on the path) or, as when run from
    # inside benchmarks/, plain `common` (this folder on the path).
    for path in (str(HERE), str(ROOT), str(bench_dir)):
        if path not in sys.path:
            sys.path.insert(0, path)
    record: dict = {"name": name, "status": "error"}
    start = time.perf_counter()
    try:
        record.update(_child_body(name, bench_dir, quick))
    except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
        record.update(status="error", reason=f"{type(exc).__name__}: {exc}")
        record["traceback"] = traceback.format_exc(limit=8)
    record["seconds"] = round(time.perf_counter() - start, 1)
    result_file.write_text(json.dumps(record, default=str))


def _is_skip(exc: BaseException) -> bool:
    # By name, so that `common.Skip` imported as a top-level `common` module (when a script
    # is run from inside benchmarks/) counts as well as `benchmarks.common.Skip`.
    return type(exc).__name__ == "Skip"


def _skip_reason(exc: BaseException) -> str | None:
    """Why `exc` means "skipped" (missing optional package, or Skip), or None for an error."""
    if _is_skip(exc):
        return str(exc)
    if isinstance(exc, ImportError):
        missing = _missing_extra(exc)
        if missing is not None:
            return f"optional package {missing!r} is not installed"
    return None


def _child_body(name: str, bench_dir: Path, quick: bool) -> dict:
    from benchmarks.common import check_result

    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", bench_dir / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        reason = _skip_reason(exc)
        if reason is None:
            raise
        return {"status": "skipped", "reason": reason}
    run = getattr(module, "run", None)
    if not callable(run):
        return {"status": "ignored", "reason": "no run(quick) function: not a benchmark"}

    requires_gpu = getattr(module, "REQUIRES_GPU", None)
    if requires_gpu is None:
        requires_gpu = "gpu" in name
    if requires_gpu:
        import jax

        backend = jax.default_backend()
        if backend != "gpu":
            return {
                "status": "skipped",
                "reason": f"GPU-only benchmark; jax's platform here is {backend!r}",
            }
    try:
        result = run(quick=quick)
    except Exception as exc:
        reason = _skip_reason(exc)
        if reason is None:
            raise
        return {"status": "skipped", "reason": reason}
    check_result(result)
    return {"status": "ok", "result": result}


# --- parent: one process per benchmark, then the reports ----------------------------------


def timeout_scale(path: Path) -> float:
    """The literal `TIMEOUT_SCALE = k` of a benchmark script, or 1."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return 1.0
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["TIMEOUT_SCALE"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, (int, float))
        ):
            return float(node.value.value)
    return 1.0


def run_one(name: str, bench_dir: Path, quick: bool, timeout: float) -> dict:
    """Runs one benchmark in a fresh Python process and returns its record."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            name,
            "--bench-dir",
            str(bench_dir),
            "--result-file",
            str(result_file),
        ]
        if quick:
            cmd.append("--quick")
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return {
                "name": name,
                "status": "error",
                "reason": f"timed out after {timeout:.0f} s",
                "seconds": round(time.perf_counter() - start, 1),
            }
        if result_file.exists():
            record = json.loads(result_file.read_text())
        else:
            tail = (proc.stdout + proc.stderr)[-2000:]
            record = {
                "name": name,
                "status": "error",
                "reason": f"the benchmark process exited with status {proc.returncode}",
                "traceback": tail,
                "seconds": round(time.perf_counter() - start, 1),
            }
        return record


def machine_info() -> dict:
    from benchmarks.common import machine_info as info

    return info()


def _md_cell(x) -> str:
    return str(x).replace("|", "\\|")


def write_reports(records: list[dict], machine: dict, quick: bool, out_dir: Path) -> None:
    """Writes `RESULTS.md` and `results.json` into `out_dir`."""
    from benchmarks.common import format_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/run.py" + (" --quick" if quick else "")
    payload = {
        "command": command,
        "quick": quick,
        "machine": machine,
        "benchmarks": {r["name"]: r for r in records},
    }
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")

    load = machine.get("load_average_start", []), machine.get("load_average_end", [])
    lines = [
        "# mpjax benchmark results",
        "",
        f"Generated on {machine['date']} (finished {machine['finished']}) by `{command}`"
        + (" (quick mode: tiny sizes, for smoke-testing only)." if quick else "."),
        "Ratios compare alternatives measured in the same run; times are medians over "
        "interleaved rounds with min-max.",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPUs | {machine['cpu_count']} (usable: {machine['usable_cpus']}) |",
        f"| processor | {_md_cell(machine['processor'])} |",
        f"| load average (1/5/15 min) at start / end | {load[0]} / {load[1]} |",
        f"| jax / jaxlib | {machine['jax']} / {machine['jaxlib']} |",
        f"| platform | {machine['platform']} ({_md_cell(machine['device_kind'])}, "
        f"{machine['device_count']} device(s)) |",
        f"| python | {machine['python']} |",
        f"| os | {_md_cell(machine['os'])} |",
        "",
    ]
    peak_load = max([*load[0][:1], *load[1][:1], 0.0])
    if machine.get("usable_cpus") and peak_load > 0.75 * machine["usable_cpus"]:
        lines += [
            f"> **Loaded machine**: the 1-minute load average was {load[0][0]} at the start "
            f"and {load[1][0]} at the end, on {machine['usable_cpus']} CPUs: other processes "
            "competed for the CPU during this run. Absolute times are inflated and noisy; "
            "paired per-round ratios and compiled byte counts are the figures to read.",
            "",
        ]
    for r in records:
        if r["status"] != "ok":
            continue
        result = r["result"]
        lines += [
            f"## {result['title']}",
            "",
            f"`benchmarks/{r['name']}.py`, {r['seconds']} s.",
            "",
            format_markdown(result),
            "",
        ]
    others = [r for r in records if r["status"] != "ok"]
    if others:
        lines += ["## Not run", ""]
        for r in others:
            lines.append(f"- `{r['name']}.py`: {r['status']}: {_md_cell(r.get('reason', ''))}")
        lines.append("")
    (out_dir / "RESULTS.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--out", default=str(HERE), help="folder for RESULTS.md/results.json")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per benchmark")
    parser.add_argument("--bench-dir", default=str(HERE), help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bench_dir = Path(args.bench_dir).resolve()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))

    if args.child:
        _run_child(args.child, bench_dir, args.quick, Path(args.result_file))
        return 0

    names = discover(bench_dir)
    if args.only:
        wanted = [n.strip().removesuffix(".py") for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"--only: no benchmark named {unknown}; found {names}")
        names = [n for n in names if n in wanted]
    timeout = args.timeout or (150.0 if args.quick else 900.0)

    machine = machine_info()
    machine["load_average_start"] = machine.pop("load_average")
    records = []
    for name in names:
        print(f"[run] {name} ...", flush=True)
        scale = timeout_scale(bench_dir / f"{name}.py")
        record = run_one(name, bench_dir, args.quick, timeout * scale)
        status, secs = record["status"], record.get("seconds", "?")
        reason = f": {record['reason']}" if record.get("reason") else ""
        print(f"[{status}] {name} ({secs} s){reason}", flush=True)
        if status == "error" and record.get("traceback"):
            print(record["traceback"], flush=True)
        if status != "ignored":
            records.append(record)
    try:
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        machine["load_average_end"] = []
    machine["finished"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")

    from benchmarks.common import format_text

    for r in records:
        if r["status"] == "ok":
            print()
            print(format_text(r["result"]))
    out_dir = Path(args.out)
    write_reports(records, machine, args.quick, out_dir)
    print(f"\nwrote {out_dir / 'RESULTS.md'} and {out_dir / 'results.json'}")
    return 1 if any(r["status"] == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
