"""Real-GPU step times: mpjax's paths against the hand-written anchor, on the GPU it runs on.

    python benchmarks/gpu.py --dry-run         # the plan and its estimated device time (any host)
    python benchmarks/gpu.py                   # runs the plan: results-gpu.json, calibration
    python benchmarks/gpu.py --only gpu/lm/ --json /tmp/gpu.json   # other `gpu` cases

The plan (`PLAN`, most important first) fits `DEVICE_BUDGET_S` (600 s) of device time: the
wide LM's bf16, tensorwise fp8 and blockwise rows (`fp8-blockwise`: `block_lowering="native"`,
mpjax's Mosaic GPU blockwise GEMM on Hopper where this JAX has its API, else the Triton one;
then the emulated lowering), the blockwise GEMM kernels alone at the wide LM's shapes
(`blockwise-gemm-gpu`, `benchmarks/blockwise_gemm_gpu.py`), GPT-2 small's policy,
autocast and fp16-scaled steps, ResNet-50's policy and ConvBN steps, then the microbenchmarks
the calibration reads (`kernels-gpu`: a device copy for the bandwidth, mpjax's Pallas kernels
against XLA). Each program is timed in rounds alternating with its anchor's (ratios paired
round by round); each row also records the roofline seconds per kernel class of the program
it timed (`figures.model_class_s`, read from its optimized HLO) and of its anchor. Cases not
started within `--budget` seconds are recorded as skipped. JAX's persistent compilation
cache (`--cache-dir`) keeps compiled programs across runs: an anchor compiles once.

At the end, `benchmarks/calibrate.py` fits the calibration table
(`mpjax/_src/core/calibration.json`) to the measured rows and writes each row's
`figures.model_vs_anchor` (the calibrated model's ratio beside the measured one). The docs'
`gpu` and `kernels-gpu` tables are read from the results file (`benchmarks/tables.py`).

`--dry-run` prints the plan with each case's estimated device seconds: the seconds that case
took in the results file's last run, else the median of the measured cases of its model and
size (pessimistic: every program compiled cold), else `UNMEASURED_CASE_S`; plus
`STARTUP_S` for the process. Without a GPU every case is skipped.

`kernels_gpu` (the `kernels-gpu` case): mpjax's Pallas kernels (the fused block quantiser
among them) against XLA and a device-to-device copy, and a ResNet-50 train step of `ConvBN`
with and without them; without a GPU, tiny shapes in Pallas interpret mode (a check that the
case runs, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_JSON = ROOT / "benchmarks" / "results-gpu.json"
DEFAULT_CACHE = ROOT / ".jax-cache"
ORDER = ("gpu/lm:wide/", "blockwise-gemm-gpu/", "gpu/lm/", "kernels-gpu/", "gpu/resnet/")
DEVICE_BUDGET_S = 600.0  # one lent GPU's device time per command
STARTUP_S = 30.0  # process start, imports, JAX's GPU client
UNMEASURED_CASE_S = 60.0  # a case of a model and size never measured
PLAN = (
    "gpu/lm:wide/bf16@gpu",
    "gpu/lm:wide/fp8-tensorwise@gpu",
    "gpu/lm:wide/fp8-blockwise@gpu",
    "gpu/lm:wide/fp8-blockwise-emulated@gpu",
    "blockwise-gemm-gpu/study/blockwise_gemm_gpu@gpu",
    "gpu/lm/policy@gpu",
    "gpu/lm/autocast@gpu",
    "gpu/lm/fp16-scaled@gpu",
    "gpu/resnet/policy@gpu",
    "gpu/resnet/convbn@gpu",
    "kernels-gpu/study/kernels_gpu@gpu",
)


def ordered_cases(cases) -> list:
    """The `gpu`-target cases, in the order of `ORDER`'s prefixes."""
    gpu = [c for c in cases if c.target == "gpu"]
    return sorted(gpu, key=lambda c: next(i for i, p in enumerate(ORDER) if c.name.startswith(p)))


def plan_cases(cases) -> list:
    """The cases of `PLAN` that are registered, in its order (a new kernel's row only once
    its variant exists)."""
    by_name = {c.name: c for c in cases if c.target == "gpu"}
    return [by_name[n] for n in PLAN if n in by_name]


def estimate_seconds(case, previous: dict) -> tuple[float, str]:
    """A case's estimated device seconds and what the estimate rests on (module docstring).

    Args:
      case: a `gpu` case.
      previous: a results file (`{"records": [...]}`) of an earlier run.

    Returns:
      `(seconds, basis)`.
    """
    records = [r for r in previous.get("records", []) if r.get("status") == "ok"]
    same = [r for r in records if r["name"] == case.name]
    if same:
        return float(same[-1]["seconds"]), "measured"
    size = case.sizes[1] if case.sizes else None
    alike = [r["seconds"] for r in records if r["model"] == case.model and r.get("size") == size]
    if alike:
        return float(statistics.median(alike)), f"median of {len(alike)} alike"
    return UNMEASURED_CASE_S, "never measured"


def plan(cases, previous: dict) -> tuple[list, float]:
    """`[(case, seconds, basis)]` for `cases` and the total with `STARTUP_S`."""
    rows = [(c, *estimate_seconds(c, previous)) for c in cases]
    return rows, STARTUP_S + sum(s for _, s, _ in rows)


def _print_plan(rows, total: float) -> None:
    print(f"{'case':44s} {'est. s':>7s}  basis")
    for case, seconds, basis in rows:
        print(f"{case.name:44s} {seconds:7.1f}  {basis}")
    print(f"{'startup':44s} {STARTUP_S:7.1f}")
    fits = "fits" if total <= DEVICE_BUDGET_S else "DOES NOT FIT"
    print(f"{'estimated device time':44s} {total:7.1f}  ({fits} {DEVICE_BUDGET_S:.0f} s)")


def _use_compilation_cache(path: Path) -> None:
    """JAX's persistent compilation cache at `path`, for every program however quick."""
    import jax

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the results file")
    p.add_argument("--budget", type=float, default=DEVICE_BUDGET_S, help="seconds to start in")
    p.add_argument("--rounds", type=int, default=7, help="timing rounds per case")
    p.add_argument("--steps", type=int, default=3, help="steps timed per round")
    p.add_argument("--only", default="", help="comma-separated name patterns (else PLAN)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its device time")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="JAX's compile cache")
    p.add_argument("--table", type=Path, default=None, help="the calibration table to write")
    args = p.parse_args(argv)

    from benchmarks import harness
    from benchmarks.cases import CASES, MODELS
    from benchmarks.common import machine_info

    if args.only:
        cases = ordered_cases(harness.select(CASES, args.only))
    else:
        cases = plan_cases(CASES)
    previous = harness.load_results(args.json)
    rows, total = plan(cases, previous)
    if args.dry_run:
        _print_plan(rows, total)
        return 0
    _use_compilation_cache(args.cache_dir)
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
    _calibrate(results, args)
    harness.save_results(args.json, results)
    _print_table(results["records"])
    return 0


def _calibrate(results: dict, args) -> None:
    """Fits the calibration table to the measured rows and writes it (`calibrate.py`)."""
    if not any("model_class_s" in (r.get("figures") or {}) for r in results["records"]):
        print("[calibrate] no measured row: the calibration table is unchanged", flush=True)
        return
    from benchmarks.calibrate import calibrate
    from mpjax._src.core.calibration import TABLE_PATH

    table = calibrate(results)
    path = args.table or TABLE_PATH
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"[calibrate] wrote {path}", flush=True)


def _print_table(records) -> None:
    for r in records:
        f = r.get("figures") or {}
        if "time_vs_anchor" in f:
            ms = f["time_s"]["median"] * 1e3
            model = f.get("model_vs_anchor")
            model = "" if model is None else f"  model x{model:.3f}"
            print(f"{r['name']:40s} {ms:9.2f} ms  x{f['time_vs_anchor']['median']:.3f}{model}")
        elif r["status"] != "ok":
            print(f"{r['name']:40s} {r['status']}: {r.get('reason', '').splitlines()[0][:80]}")


# --- the kernels-gpu case ----------------------------------------------------------------


def _kernel_rows(case: str, times: dict, nbytes=None, copy_gbs=None, batch=None) -> list:
    """Per implementation: ms, GB/s, % of the device copy, images/s, XLA's time over this."""
    rows, xla = [], statistics.median(times["xla"]) if "xla" in times else None
    for impl, t in times.items():
        med = statistics.median(t)
        gbs = nbytes / med / 1e9 if nbytes else None
        rows.append([case, impl, round(med * 1e3, 4), f"{min(t) * 1e3:.4f}-{max(t) * 1e3:.4f}"])
        rows[-1] += ["" if gbs is None else round(gbs, 1)]
        rows[-1] += ["" if gbs is None or not copy_gbs else round(100 * gbs / copy_gbs, 1)]
        rows[-1] += ["" if batch is None else round(batch / med, 1)]
        rows[-1] += ["" if xla is None else round(xla / med, 3)]
    return rows


def _resnet_step(model, tx):
    import jax
    import optax

    import mpjax

    def step(params, batch_stats, opt_state, images, labels):
        def loss_fn(p):
            v = {"params": p, "batch_stats": batch_stats}
            logits, upd = model.apply(v, images, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return mpjax.scale_loss(loss.mean(), opt_state), upd["batch_stats"]

        grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state

    return jax.jit(step)


def kernels_gpu(case=None, quick: bool = False, smoke: bool = False) -> dict:
    """Times the kernels against XLA (module docstring); quick/smoke or no GPU: tiny shapes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import mpjax
    from benchmarks.common import interleaved_times, table
    from benchmarks.train_models import ConvBNResNet
    from mpjax.fp8 import quantize_orientations
    from mpjax.pallas import channel_stats, conv_epilogue, unscale_and_check

    on_gpu = jax.default_backend() == "gpu"
    small = quick or smoke or not on_gpu
    impls = ("pallas" if on_gpu and not smoke else "interpret", "xla")
    rounds, iters = (2, 2) if small else (7, 20)
    timed = lambda fns, args, n=iters: interleaved_times(  # noqa: E731
        {k: functools.partial(f, *args) for k, f in fns.items()}, rounds=rounds, steps_per_round=n
    )
    rng = np.random.default_rng(0)
    # Device-to-device copy: the bandwidth reference (read + write).
    x = jnp.asarray(rng.standard_normal(2**14 if small else 2**28), jnp.float32)
    copy = timed({"copy": jax.jit(jnp.copy)}, (x,))
    copy_gbs = 2 * x.nbytes / statistics.median(copy["copy"]) / 1e9
    rows = _kernel_rows(f"copy f32[{x.size}]", copy, 2 * x.nbytes, copy_gbs)
    # unscale_and_check over ResNet-50's gradient leaves (161), bfloat16 in, float32 out.
    width, stages = (4, (1, 1)) if small else (64, (3, 4, 6, 3))
    net = ConvBNResNet(stages, 1000 * width // 64, width)
    shapes = jax.eval_shape(net.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    grads = [
        jnp.asarray(rng.standard_normal(s.shape), jnp.bfloat16) for s in jax.tree.leaves(shapes)
    ]
    fns = {i: jax.jit(functools.partial(unscale_and_check, impl=i)) for i in impls}
    nbytes = sum(g.nbytes + g.size * 4 for g in grads)
    times = timed(fns, (grads, jnp.float32(2.0**15)))
    rows += _kernel_rows(f"unscale_and_check {len(grads)} bf16 leaves", times, nbytes, copy_gbs)
    # conv_epilogue and channel_stats on a ResNet-50 stage-1 activation, bfloat16.
    shape = (2, 8, 8, 24) if small else (128, 56, 56, 256)
    y, res, cot = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    scale = jnp.asarray(rng.uniform(0.5, 2, shape[-1]), jnp.float32)
    shift = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    epi = lambda i: functools.partial(conv_epilogue, activation="relu", impl=i)  # noqa: E731
    bwd = lambda i: jax.jit(lambda y, s, b, r, g: jax.vjp(epi(i), y, s, b, r)[1](g))  # noqa: E731
    for name, fns, args, moved in (
        ("conv_epilogue fwd", {i: jax.jit(epi(i)) for i in impls}, (y, scale, shift, res), 3),
        ("conv_epilogue bwd", {i: bwd(i) for i in impls}, (y, scale, shift, res, cot), 5),
        (
            "channel_stats",
            {i: jax.jit(functools.partial(channel_stats, impl=i)) for i in impls},
            (y,),
            1,
        ),
    ):
        suffix = " +res relu" if name.startswith("conv") else ""
        case_name = f"{name} bf16{list(shape)}{suffix}"
        rows += _kernel_rows(case_name, timed(fns, args), moved * y.nbytes, copy_gbs)
    # The fused block quantiser (`quantize_orientations`: both copies of a tensor from one
    # read) against XLA's reference, on a wide-LM activation [tokens, d], bfloat16. It moves
    # x once and two 8-bit copies (scales: under 4 %); XLA's reference moved 20x x's bytes
    # for blockwise and 12.5x for MXFP8 in the deviceless H100 program, jaxlib 0.12.1.
    shape = (256, 256) if small else (8192, 4096)
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    for scaling in ("blockwise", "mxfp8"):
        quantise = functools.partial(quantize_orientations, recipe=scaling)
        fns = {i: jax.jit(functools.partial(quantise, impl=i)) for i in impls}
        case_name = f"quantize_orientations {scaling} bf16{list(shape)}"
        rows += _kernel_rows(case_name, timed(fns, (x,)), x.nbytes + 2 * x.size, copy_gbs)
    # ResNet-50 train steps: f32 / bf16, with ("auto") and without ("xla") the kernels.
    batch, size, classes = (2, 16, 10) if small else (64, 224, 1000)
    rng = np.random.default_rng(1)
    images = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, classes, batch))
    for dtype, name in (
        ((jnp.bfloat16, "bf16"),) if small else ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))
    ):
        steps, state = {}, None
        for impl in ("auto" if on_gpu and not smoke else "interpret", "xla"):
            model = ConvBNResNet(stages, classes, width, dtype=dtype, impl=impl)
            check = functools.partial(unscale_and_check, impl=impl)
            tx = mpjax.loss_scaled(optax.sgd(0.1, momentum=0.9), unscale_and_check=check)
            if state is None:
                v = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), images)
                state = (v["params"], v["batch_stats"], tx.init(v["params"]))
            steps[impl] = _resnet_step(model, tx)
        net = "ResNet-50" if stages == (3, 4, 6, 3) else "ResNet (2 stages of 1 block)"
        times = timed(steps, (*state, images, labels), max(1, iters // 4))
        rows += _kernel_rows(f"{net} train step {name}, {batch}x{size}x{size}", times, batch=batch)
    notes = (
        f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; medians of {rounds} "
        f"alternating rounds of {iters} calls. GB/s counts the bytes each op must move (reads "
        "+ writes); % of copy is against the measured device-to-device copy above; 'xla time "
        "/ this' > 1 means faster than the XLA path."
    )
    if impls[0] == "interpret":
        notes = (
            "SMOKE RUN, NOT A MEASUREMENT: no GPU here (or --smoke), tiny shapes, kernels in "
            "Pallas interpret mode. " + notes
        )
    cols = ["case", "impl", "ms median", "ms min-max", "GB/s", "% of copy", "images/s"]
    return table("mpjax Pallas kernels vs XLA on the GPU", cols + ["xla time / this"], rows, notes)


if __name__ == "__main__":
    sys.exit(main())
