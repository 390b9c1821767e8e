"""The benchmark suite's harness: cases, targets, the measurements and the results file.

A case is one program measured on one target: `Case(table, model, variant, target)`. The
program is `models[model].variants[variant](config)`, a `TrainProgram` (`init`, `batch`,
`step`) of `benchmarks/train_variants.py`; every case of a target is measured by the same
function (`measure_program`): the step is compiled with its state donated and read for

- temp and argument memory (XLA's buffer assignment), parameter count and state bytes;
- the seconds to trace and lower the step (`trace_s`, where mpjax's rewrites run) and
  XLA's compile of it (`compile_s`), on this machine and its load at the time;
- on an H100 target (deviceless compile): kernels by kind, GEMM/conv FLOPs by operand
  dtype, converts, bytes and the roofline (`mpjax/_src/analysis/hlo_cost.py`), and on 8
  H100s the collectives by op and dtype with a ring estimate of their time;
- on this host's CPU or GPU (`cpu`, `gpu`): XLA's bytes accessed and the step time, timed
  in rounds alternating with the anchor's step (ratios paired per round).

A case with its own `measure(case, quick) -> figures` (a table of rows for a study that is
not one program, e.g. a training run) is run the same way and stored the same way.

Registering a benchmark is one line in `benchmarks/cases.py`, e.g.

    Case("cost", "lm", "my-variant", "h100")

after adding the variant's builder to `LM_VARIANTS` (`benchmarks/train_variants.py`); the
docs tables and plots (`benchmarks/tables.py`) pick the case up by its table name.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

NVLINK_BYTES_PER_S, INTER_HOST_BYTES_PER_S = 450e9, 50e9
# target -> (deviceless H100 topology or None for the host CPU, mesh layout)
TARGETS = {
    "h100": ("1x1x1", None),
    "h100x8": ("1x1x8", "fsdp"),
    "h100x2x4": ("2x1x4", "fsdp"),
    "h100x2x4-hsdp": ("2x1x4", "hsdp"),
    "b200": ("1x1x1", None),  # a deviceless B200 (cuDNN block-scaled GEMMs), B200 peaks
    "cpu": (None, None),
    "gpu": (None, None),  # a real GPU: cases with their own `measure` (skipped without one)
}


class Model(NamedTuple):
    """A model of the registry: its size table, the quick and full size, its variants."""

    sizes: Mapping[str, dict]
    quick: str
    full: str
    variants: Mapping[str, Callable]
    config: Callable[[dict, str], dict] = lambda cfg, size: dict(cfg)
    split: str = "fsdp"  # how multi-GPU targets place the state: "fsdp" or "replicated"


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: `variant` of `model` on `target`, a row of table `table`.

    Attributes:
      table: the table (and plot) the case belongs to.
      model: a key of the model registry (`benchmarks/cases.py`'s `MODELS`).
      variant: a key of that model's variants.
      target: a key of `TARGETS`.
      sizes: `(quick, full)` size names overriding the model's.
      anchor: the variant this one's ratios are taken against (same table, model, sizes).
      measure: `measure(case, quick) -> dict` instead of compiling the program.
      report: also record what `mpjax.report` says of the compile (H100 only).
      label: the row's name in the docs' tables (default: the variant).
    """

    table: str
    model: str
    variant: str
    target: str = "h100"
    sizes: tuple[str, str] | None = None
    anchor: str | None = "bf16"
    measure: Callable[[Case, bool], dict] | None = None
    report: bool = False
    label: str = ""

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"Case target={self.target!r}: expected one of {sorted(TARGETS)}")

    @property
    def name(self) -> str:
        sizes = f":{self.sizes[1]}" if self.sizes else ""
        return f"{self.table}/{self.model}{sizes}/{self.variant}@{self.target}"

    def size(self, models: Mapping[str, Model], quick: bool) -> str:
        if self.sizes:
            return self.sizes[0 if quick else 1]
        m = models[self.model]
        return m.quick if quick else m.full


def select(cases: Iterable[Case], only: str = "", targets: str = "") -> list[Case]:
    """The cases whose name matches one of the comma-separated glob `only` patterns (a
    pattern without `*` matches as a substring) and whose target is in `targets`."""
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    wanted = {t.strip() for t in targets.split(",") if t.strip()}
    unknown = wanted - set(TARGETS)
    if unknown:
        raise ValueError(f"--target {sorted(unknown)}: expected some of {sorted(TARGETS)}")

    def match(name: str) -> bool:
        return not patterns or any(
            fnmatch.fnmatch(name, p if "*" in p else f"*{p}*") for p in patterns
        )

    return [c for c in cases if match(c.name) and (not wanted or c.target in wanted)]


def dedup(cases: Iterable[Case], models: Mapping[str, Model], quick: bool) -> list[Case]:
    """The cases less those measuring the same program as an earlier one at this size (a
    quick run measures the `gpt2` and `wide` LM cases at the same quick size once)."""
    seen, out = set(), []
    for c in cases:
        key = (c.table, c.model, c.variant, c.target, c.measure or c.size(models, quick))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def needs_cuda_plugin(case: Case) -> bool:
    """Whether the case compiles for a deviceless H100 (the gpu-aot environment)."""
    return case.target.startswith("h100") or case.target == "b200"


# --- compiling a program for a target ------------------------------------------------------


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _fsdp_spec(shape: tuple, n: int, axis: str):
    """Split along the largest dimension divisible by `n` (the first of equals); else none."""
    from jax.sharding import PartitionSpec as P

    dims = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
    if not dims:
        return P()
    best = max(dims, key=lambda i: (shape[i], -i))
    return P(*(axis if i == best else None for i in range(len(shape))))


def _mesh(topology: str, layout: str):
    """One `fsdp` axis over the devices, or (`hsdp`) `("replica", "fsdp")`, a row per host."""
    import numpy as np
    from jax.sharding import Mesh

    from mpjax._src.analysis.target import h100_topology

    devices = h100_topology(topology).devices
    if layout == "hsdp":
        hosts = len({d.process_index for d in devices})
        return Mesh(np.array(devices).reshape(hosts, -1), ("replica", "fsdp"))
    return Mesh(np.array(devices), ("fsdp",))


def _placed_args(program, mesh, split: str):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mpjax.scaling import Blockwise8

    def one(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    def node(x, spec_fn):
        if not isinstance(x, Blockwise8):
            return one(x, spec_fn(x))
        # int8 state: the scales split like their codes (whole blocks on each device)
        spec = spec_fn(x.codes)
        fits = [
            a if a is None or x.scales.shape[i] % mesh.shape[a] == 0 else None
            for i, a in enumerate(spec)
        ]
        return Blockwise8(one(x.codes, spec), one(x.scales, P(*fits)))

    def place(tree, spec):
        return jax.tree.map(
            lambda x: node(x, spec), tree, is_leaf=lambda x: isinstance(x, Blockwise8)
        )

    key = jax.random.key(0)
    n = mesh.shape["fsdp"]
    state_spec = (lambda x: _fsdp_spec(x.shape, n, "fsdp")) if split == "fsdp" else (lambda x: P())
    state = place(jax.eval_shape(program.init, key), state_spec)
    axes = tuple(mesh.axis_names)
    batch = place(jax.eval_shape(program.batch, key), lambda x: P(axes) if x.ndim else P())
    return state, batch


def compile_program(program, target: str, split: str = "fsdp", seconds: dict | None = None):
    """`(lowered, compiled, abstract state)` of `jit(program.step, donate_argnums=0)`.

    `seconds`, if given, receives `trace_s` (tracing and lowering to StableHLO, where
    mpjax's rewrites run) and `compile_s` (XLA's compile of the lowered step).
    """
    topology, _ = TARGETS[target]
    seconds = {} if seconds is None else seconds
    if topology is not None:  # deviceless H100s: cuDNN attention traces as on a real one
        from mpjax._src.analysis.target import target_cudnn

        with target_cudnn():
            return _compile(program, target, split, seconds)
    return _compile(program, target, split, seconds)


def _compile(program, target: str, split: str, seconds: dict):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    topology, layout = TARGETS[target]
    key = jax.random.key(0)
    start = time.perf_counter()
    if topology is None:
        state, batch = jax.eval_shape(program.init, key), jax.eval_shape(program.batch, key)
        lowered = jax.jit(program.step, donate_argnums=0).trace(state, batch).lower()
    elif layout is None:
        from mpjax._src.analysis.target import B200_TARGET, H100_TARGET, h100_topology, lower_step

        device = h100_topology(target=B200_TARGET if target == "b200" else H100_TARGET).devices[0]
        state = jax.eval_shape(program.init, key)
        lowered = lower_step(
            program.step,
            (state, jax.eval_shape(program.batch, key)),
            jax.sharding.make_single_device_sharding(device),
        )
    else:
        mesh = _mesh(topology, layout)
        state, batch = _placed_args(program, mesh, split)
        out = (jax.tree.map(lambda x: x.sharding, state), NamedSharding(mesh, P()))
        step = jax.jit(program.step, out_shardings=out, donate_argnums=0)
        lowered = step.trace(state, batch).lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    seconds["trace_s"] = lowered_at - start
    seconds["compile_s"] = time.perf_counter() - lowered_at
    return lowered, compiled, state


# --- the measurements ----------------------------------------------------------------------


def memory_figures(compiled, state) -> dict:
    """Temp and argument memory, parameter count (`state[0]`) and state bytes."""
    import jax
    import numpy as np

    memory = compiled.memory_analysis()
    return {
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state[0])),
        "param_bytes": _nbytes(state[0]),
        "state_bytes": _nbytes(state),
    }


def hlo_figures(hlo_text: str, target: str = "h100") -> dict:
    """Kernels, FLOPs by dtype, converts, bytes and roofline (on the target's GPU: H100 or
    B200 peaks) of optimized XLA:GPU HLO. `roofline_s` is the calibrated model's
    (`analysis.calibrated`: each kernel class's roofline over its measured efficiency on the
    GPU's class, `UNMEASURED_EFFICIENCY` for a class never measured there, listed in
    `unmeasured`); `peak_roofline_s` every kernel at the data-sheet peaks (the model before
    calibration); `roofline_by_part` is at the peaks too."""
    from mpjax._src.analysis import hlo_cost
    from mpjax._src.analysis.calibrated import calibrated_seconds
    from mpjax._src.analysis.decomposition import decompose
    from mpjax._src.analysis.peaks import B200, H100, roofline_seconds

    r = hlo_cost.analyze(hlo_text)
    peaks = B200 if target == "b200" else H100
    model = calibrated_seconds(r, "b200" if target == "b200" else "h100")
    return {
        "roofline_s": model.seconds,  # calibrated: each kernel class over its efficiency
        "peak_roofline_s": roofline_seconds(r, peaks),  # every kernel at the peaks
        "roofline_by_class": model.by_class,
        "unmeasured": list(model.unmeasured),
        "roofline_by_part": decompose(r, peaks),
        "bytes": r.bytes,
        "kernels": len(r.kernels),
        "kernels_by_kind": r.kernels_by_kind,
        "gemm_flops": r.gemm_flops,
        "conv_flops": r.conv_flops,
        "gemms_by_dtype": r.gemms_by_dtype,
        "convs_by_dtype": r.convs_by_dtype,
        "converts": r.converts,
        "convert_kernels": r.convert_kernels,
    }


def model_figures(compiled, anchor_compiled=None) -> dict:
    """Roofline seconds per kernel class (`analysis.calibrated`) of a program compiled for
    the GPU it runs on, and of its anchor, at that GPU's peaks: what the calibration fits
    (`benchmarks/calibrate.py`). Empty for a GPU the cost model does not know."""
    import jax

    from benchmarks.calibrate import gpu_of
    from mpjax._src.analysis.calibrated import seconds_by_class
    from mpjax._src.analysis.hlo_cost import analyze

    gpu = gpu_of(jax.devices()[0].device_kind)
    if gpu is None:
        return {}
    out = {"model_class_s": {gpu: seconds_by_class(analyze(compiled.as_text()), gpu)}}
    if anchor_compiled is not None:
        anchor = seconds_by_class(analyze(anchor_compiled.as_text()), gpu)
        out["anchor_model_class_s"] = {gpu: anchor}
    return out


def collective_figures(hlo_text: str, mesh_devices) -> dict:
    """Collectives by op and dtype, their bytes, and ring estimates of their time."""
    from mpjax._src.analysis import collectives as c

    records = c.collectives(hlo_text)
    hosts = [d.process_index for d in mesh_devices]
    n = len(hosts)
    return {
        "collectives": len(records),
        "collective_bytes": sum(r.bytes for r in records),
        "comm_s_nvlink": c.comm_seconds(records, n, NVLINK_BYTES_PER_S),
        "comm_s_inter_host": c.comm_seconds(records, n, INTER_HOST_BYTES_PER_S),
        "comm_s_links": c.link_seconds(records, hosts, NVLINK_BYTES_PER_S, INTER_HOST_BYTES_PER_S),
        "link_bytes": c.link_bytes(records, hosts),
        "by_op_dtype": c.summary(records),
    }


def report_figures(lowered, compiled) -> dict:
    """What `mpjax.report` says of a step: FLOPs by dtype run, float32 modules, summary."""
    from mpjax._src.report.build import build_report

    report = build_report(lowered, compiled, "h100", True)
    return {
        "flops_by_dtype": report.flops_by_dtype(runs=True),
        "asked_flops_by_dtype": report.flops_by_dtype(runs=False),
        "unmatched_gemms": sum(g.runs_as is None for g in report.gemms),
        "float32_modules": sorted({g.path for g in report.gemms if g.flagged}),
        "convert_kernels": sum(c.kernels for c in report.converts),
        "summary": report.summary(),
    }


def time_pair(program, anchor_program, quick: bool, timing: tuple[int, int] | None = None) -> dict:
    """Step seconds of `program` and its anchor, interleaved round by round on this host
    (`timing`: `(rounds, steps per round)`, default by `quick`)."""
    import jax

    from benchmarks.common import paired_ratio, summary, time_train_steps

    key = jax.random.key(0)
    progs = {"case": program, "anchor": anchor_program or program}
    steps = {k: jax.jit(p.step, donate_argnums=0) for k, p in progs.items()}
    states = {k: p.init(key) for k, p in progs.items()}
    batch = program.batch(key)
    rounds, per_round = timing or ((3, 2) if quick else (15, 5))
    times, _ = time_train_steps(steps, states, batch, rounds=rounds, steps_per_round=per_round)
    return {
        "time_s": summary(times["case"]),
        "time_vs_anchor": paired_ratio(times, "case", "anchor"),
    }


def measure_program(
    case: Case, models: Mapping[str, Model], quick: bool, timing: tuple[int, int] | None = None
) -> dict:
    """The figures of one registered program on the case's target (module docstring)."""
    model = models[case.model]
    if case.variant not in model.variants:
        raise ValueError(
            f"case {case.name}: no variant {case.variant!r} of {case.model!r}; "
            f"known: {sorted(model.variants)}"
        )
    size = case.size(models, quick)
    cfg = model.config(model.sizes[size], size)
    program = model.variants[case.variant](cfg)
    seconds: dict = {}
    lowered, compiled, state = compile_program(program, case.target, model.split, seconds)
    figures = {"config": cfg, **seconds, **memory_figures(compiled, state)}
    topology, layout = TARGETS[case.target]
    if topology is None:
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
        figures["bytes"] = float(cost.get("bytes accessed", float("nan")))
        figures["items"] = program.items
        anchor = model.variants.get(case.anchor) if case.anchor else None
        figures.update(time_pair(program, anchor and anchor(cfg), quick, timing))
        if case.target == "gpu":
            anchor_compiled = anchor and compile_program(anchor(cfg), "gpu", model.split, {})[1]
            figures.update(model_figures(compiled, anchor_compiled))
        return figures
    text = compiled.as_text()
    figures.update(hlo_figures(text, case.target))
    if layout is not None:
        mesh = _mesh(topology, layout)
        figures["mesh"] = ",".join(f"{a}={k}" for a, k in mesh.shape.items())
        figures.update(collective_figures(text, list(mesh.devices.flat)))
    if case.report:
        figures["report"] = report_figures(lowered, compiled)
    return figures


# --- running cases and the results file ----------------------------------------------------


def record_of(case: Case, figures: dict | None, seconds: float, status="ok", reason="") -> dict:
    """One entry of the results file."""
    out = {k: getattr(case, k) for k in ("table", "model", "variant", "target", "anchor")}
    out["label"] = case.label or case.variant
    out["size"] = case.sizes[1] if case.sizes else None
    out.update(name=case.name, status=status, seconds=round(seconds, 1))
    if reason:
        out["reason"] = reason
    if figures is not None:
        out["figures"] = figures
    return out


def run_case(
    case: Case, models: Mapping[str, Model], quick: bool, timing: tuple[int, int] | None = None
) -> dict:
    """Measures one case; every failure becomes an `error` record (a `Skip`: `skipped`).
    `timing` (`(rounds, steps per round)`) overrides the step timing of CPU/GPU targets."""
    start = time.perf_counter()
    try:
        if case.target == "gpu":
            import jax

            if jax.default_backend() != "gpu":
                return record_of(case, None, 0.0, "skipped", "needs a GPU")
        figures = (
            case.measure(case, quick)
            if case.measure
            else measure_program(case, models, quick, timing)
        )
    except Exception as exc:  # noqa: BLE001 - reported in the results, not raised
        status = "skipped" if type(exc).__name__ == "Skip" else "error"
        reason = f"{type(exc).__name__}: {exc}"
        if status == "error":
            reason += "\n" + traceback.format_exc(limit=6)
        return record_of(case, None, time.perf_counter() - start, status, reason)
    return record_of(case, figures, time.perf_counter() - start)


def load_results(path: Path) -> dict:
    """The results file at `path`, or an empty one."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {"records": []}


def save_results(path: Path, results: dict) -> None:
    """Writes the results file atomically (a run killed midway leaves the last good file)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str, sort_keys=False) + "\n")
    os.replace(tmp, path)


def run_cases(
    cases: Iterable[Case],
    models: Mapping[str, Model],
    quick: bool,
    path: Path,
    header: dict,
    resume: bool = False,
    log: Callable[[str], Any] = print,
) -> dict:
    """Runs `cases` and writes the results file after each (so a run can be resumed).

    With `resume`, cases already recorded `ok` in `path` (with the same `quick`) are kept
    and not run again; other records of the file not among `cases` are kept too.
    """
    old = load_results(path) if resume else {"records": []}
    if resume and old.get("quick", quick) != quick:
        raise ValueError(f"--resume: {path} holds a {'quick' if old['quick'] else 'full'} run")
    records = {r["name"]: r for r in old["records"]}
    results = {**header, "quick": quick, "records": list(records.values())}
    for case in cases:
        if resume and records.get(case.name, {}).get("status") == "ok":
            continue
        log(f"[run] {case.name} ...")
        record = run_case(case, models, quick)
        records[case.name] = record
        log(f"[{record['status']}] {case.name} ({record['seconds']} s) {record.get('reason', '')}")
        results["records"] = list(records.values())
        save_results(path, results)
    save_results(path, results)
    return results
