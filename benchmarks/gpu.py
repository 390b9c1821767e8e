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

`kernels_gpu` (the `kernels-gpu` case): mpjax's Pallas kernels against XLA and a
device-to-device copy, and a ResNet-50 train step of `ConvBN` with and without them; without
a GPU, tiny shapes in Pallas interpret mode (a check that the case runs, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import statistics
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
