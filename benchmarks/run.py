"""Runs the benchmark suite (`benchmarks/cases.py`) and writes one results file.

    python benchmarks/run.py --jobs 2           # every case, full sizes (about 1.5 h, 2 cores)
    python benchmarks/run.py --quick            # every case at quick size (the CI smoke run)
    python benchmarks/run.py --only cost/lm,fp8-conv --target h100
    python benchmarks/run.py --resume           # run only the cases not yet `ok` in the file
    python benchmarks/run.py --list             # the case names
    python benchmarks/run.py --jobs 2           # the H100 cases in 2 gpu-aot processes

`--json FILE` (default `benchmarks/results.json`) is rewritten after every case, so an
interrupted run keeps what it measured and `--resume` finishes it. The docs' tables and plots
are generated from that file (`benchmarks/tables.py`, run by `docs/conf.py`).

The H100 cases compile for a deviceless H100 and need jax's CUDA plugin (the `gpu-aot`
environment, see CONTRIBUTING.md). When this python has no plugin they run in one child
process under the python named by `$MPJAX_GPU_AOT_PYTHON` (with `JAX_PLATFORMS=cpu`); run
this script with that python to measure everything in one process (the `jmp` comparison of
`step-overhead` is then left out if jmp is not installed there). Without either, the H100
cases are recorded as skipped.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # an H100 target is compiled, never run here

ENV_PYTHON = "MPJAX_GPU_AOT_PYTHON"
DEFAULT_JSON = ROOT / "benchmarks" / "results.json"


def plugin_available() -> bool:
    """Whether jax here can describe the deviceless CUDA target."""
    try:
        from mpjax._src.analysis.target import h100_sharding

        h100_sharding()
    except Exception:  # noqa: BLE001 - no plugin, or it cannot describe the target
        return False
    return True


def _header(argv: list[str]) -> dict:
    from benchmarks.common import machine_info

    shown = [a for i, a in enumerate(argv) if a != "--json" and argv[i - 1 : i] != ["--json"]]
    return {"command": " ".join(["python benchmarks/run.py", *shown]), "machine": machine_info()}


def _start_children(names: list[str], args) -> tuple[list, str | None]:
    """Starts `names` under `$MPJAX_GPU_AOT_PYTHON` in `args.jobs` child processes (each
    writing a part file of the results file); returns them, or why not if it cannot."""
    python = os.environ.get(ENV_PYTHON)
    if not python:
        return [], (
            f"deviceless H100 compile unavailable: no CUDA plugin here and {ENV_PYTHON} is not "
            "set (see CONTRIBUTING.md, the gpu-aot environment)"
        )

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    procs = []
    for i in range(min(args.jobs, len(names))):
        part = args.json.with_suffix(f".part{i}.json")
        part.unlink(missing_ok=True)  # an interrupted run's: merged first by --resume
        cmd = [python, str(Path(__file__).resolve()), "--child", "--json", str(part)]
        cmd += ["--only", ",".join(names[i :: args.jobs])] + ["--quick"] * args.quick
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    return procs, None


def _merge_parts(path: Path) -> None:
    """Adds the records of the children's part files (`<path>.part<i>.json`) to `path`."""
    from benchmarks import harness

    results = harness.load_results(path)
    by_name = {r["name"]: r for r in results["records"]}
    for part in sorted(path.parent.glob(f"{path.stem}.part*.json")):
        by_name.update({r["name"]: r for r in harness.load_results(part)["records"]})
        part.unlink()
    if path.exists() or by_name:
        results["records"] = list(by_name.values())
        harness.save_results(path, results)


def _unregistered(name: str, why: str) -> dict:
    """The `skipped` record of a case the child process does not know."""
    table, model, rest = name.split("/", 2)
    variant, target = rest.rsplit("@", 1)
    model = model.split(":")[0]
    return dict(table=table, model=model, variant=variant, target=target, name=name) | {
        "status": "skipped",
        "reason": why,
        "seconds": 0.0,
        "anchor": None,
        "size": None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="quick sizes (minutes)")
    p.add_argument("--only", default="", help="comma-separated name patterns (glob or substring)")
    p.add_argument("--target", default="", help="comma-separated targets: h100,h100x8,cpu,...")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the results file")
    p.add_argument("--resume", action="store_true", help="keep the file's ok records")
    p.add_argument("--list", action="store_true", help="print the selected case names")
    p.add_argument("--jobs", type=int, default=1, help="child processes for the H100 cases")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: expected at least 1")
    from benchmarks import harness
    from benchmarks.cases import CASES, MODELS

    if args.child:  # exact names from the parent, added to its file
        names = set(args.only.split(","))
        cases = [c for c in CASES if c.name in names]
        results = harness.load_results(args.json)
        header = {k: v for k, v in results.items() if k not in ("records", "quick")}
        results = harness.run_cases(cases, MODELS, args.quick, args.json, header, resume=True)
        why = "not registered under this python (an optional package, e.g. jmp, is missing)"
        missing = names - {c.name for c in cases}
        skipped = [_unregistered(n, why) for n in sorted(missing)]
        results["records"] = [r for r in results["records"] if r["name"] not in missing] + skipped
        harness.save_results(args.json, results)
        return 0
    try:
        cases = harness.select(CASES, args.only, args.target)
    except ValueError as e:
        p.error(str(e))
    cases = harness.dedup(cases, MODELS, args.quick)
    if not cases:
        p.error(f"--only {args.only!r} --target {args.target!r}: no case; see --list")
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    if args.resume:  # what the children of an interrupted run measured
        _merge_parts(args.json)
    here = plugin_available()
    local = [c for c in cases if here or not harness.needs_cuda_plugin(c)]
    remote = [c for c in cases if c not in local]
    if args.resume:  # the children start from empty files: skip what is already ok here
        done = {
            r["name"] for r in harness.load_results(args.json)["records"] if r["status"] == "ok"
        }
        remote = [c for c in remote if c.name not in done]
    # The children compile the H100 cases while this process runs the local ones.
    procs, why = _start_children([c.name for c in remote], args) if remote else ([], None)
    header = _header(argv)
    harness.run_cases(local, MODELS, args.quick, args.json, header, args.resume)
    for proc in procs:
        proc.wait()
    _merge_parts(args.json)
    if why:
        results = harness.load_results(args.json)
        skipped = [harness.record_of(c, None, 0.0, "skipped", why) for c in remote]
        by_name = {r["name"]: r for r in results["records"]}
        by_name.update({r["name"]: r for r in skipped if r["name"] not in by_name})
        results["records"] = list(by_name.values())
        harness.save_results(args.json, results)
    results = harness.load_results(args.json)
    known = {c.name for c in CASES}  # records of cases no longer registered are dropped
    order = {c.name: i for i, c in enumerate(CASES)}  # registration order, whatever the jobs
    results["records"] = sorted(
        (r for r in results["records"] if r["name"] in known), key=lambda r: order[r["name"]]
    )
    results["finished"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    harness.save_results(args.json, results)
    bad = [r["name"] for r in results["records"] if r["status"] == "error"]
    print(f"wrote {args.json}: {len(results['records'])} records, {len(bad)} errors {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
