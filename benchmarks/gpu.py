"""Real-GPU step times: mpjax's paths against the hand-written anchor, on the GPU it runs on.

    python benchmarks/gpu.py                   # writes benchmarks/results-gpu.json
    python benchmarks/gpu.py --budget 420 --json /tmp/gpu.json

Runs the suite's `gpu` cases (`benchmarks/cases.py`, target `gpu`), most telling first: the
wide LM's fp8 rows (tensorwise, rowwise, delayed, Flax's fp8 ops, blockwise through mpjax's
Pallas kernel) against hand-written bf16 with cuDNN attention, GPT-2 small's base rows, the
Pallas kernels study, then ResNet-50. Each program is timed in rounds alternating with its
anchor's (ratios paired round by round). Cases not started within `--budget` seconds are
recorded as skipped with that reason; without a GPU every case is skipped. The docs' `gpu`
and `kernels-gpu` tables are read from this file (`benchmarks/tables.py`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_JSON = ROOT / "benchmarks" / "results-gpu.json"
ORDER = ("gpu/lm:wide/", "gpu/lm/", "kernels-gpu/", "gpu/resnet/")


def ordered_cases(cases) -> list:
    """The `gpu`-target cases, in the order of `ORDER`'s prefixes."""
    gpu = [c for c in cases if c.target == "gpu"]
    return sorted(gpu, key=lambda c: next(i for i, p in enumerate(ORDER) if c.name.startswith(p)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the results file")
    p.add_argument("--budget", type=float, default=3600.0, help="seconds to start cases in")
    p.add_argument("--rounds", type=int, default=7, help="timing rounds per case")
    p.add_argument("--steps", type=int, default=3, help="steps timed per round")
    p.add_argument("--only", default="", help="comma-separated name patterns")
    args = p.parse_args(argv)

    from benchmarks import harness
    from benchmarks.cases import CASES, MODELS
    from benchmarks.common import machine_info

    cases = ordered_cases(harness.select(CASES, args.only))
    results = {
        "command": " ".join(["python benchmarks/gpu.py", *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "quick": False,
        "records": [],
    }
    start = time.perf_counter()
    for case in cases:
        if time.perf_counter() - start > args.budget:
            record = harness.record_of(case, None, 0.0, "skipped", f"over --budget {args.budget}")
        else:
            print(f"[run] {case.name} ...", flush=True)
            record = harness.run_case(case, MODELS, False, (args.rounds, args.steps))
        print(
            f"[{record['status']}] {case.name} ({record['seconds']} s) {record.get('reason', '')}",
            flush=True,
        )
        results["records"].append(record)
        harness.save_results(args.json, results)
    _print_table(results["records"])
    return 0


def _print_table(records) -> None:
    for r in records:
        f = r.get("figures") or {}
        if "time_vs_anchor" in f:
            ms = f["time_s"]["median"] * 1e3
            print(f"{r['name']:40s} {ms:9.2f} ms  x{f['time_vs_anchor']['median']:.3f} vs anchor")
        elif r["status"] != "ok":
            print(f"{r['name']:40s} {r['status']}: {r.get('reason', '').splitlines()[0][:80]}")


if __name__ == "__main__":
    sys.exit(main())
