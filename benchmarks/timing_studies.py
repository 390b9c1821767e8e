"""Cases timed on this host: alternatives run in interleaved rounds, ratios paired per round.

- `step_overhead`: a full fp16 train step of a deep MLP (`init_params`, `loss_fn`) under each
  loss-scaling pattern (`variants()`: bare optax, mpjax, Flax `DynamicScale`,
  `optax.apply_if_finite` with a static scale, jmp's README pattern when installed), with and
  without the state donated: XLA's bytes accessed, copies, step time, ratios to bare optax.
- `inference`: `SmallResNet` in float32 against `convert_for_inference` (BatchNorm folded,
  bf16): latency, bytes accessed and variable bytes; the same net of `mpjax.nn.ConvBN` too.
- `data_parallel`: the pjit data-parallel example on 8 simulated CPU devices vs 1 (a child
  process), with ZeRO; on a GPU, one device under fp32, bf16 and fp16.

The real-GPU case `kernels_gpu` is in `benchmarks/gpu.py`.
The MLP's steps are also the `mlp` model of the suite's `opt-step` table
(`benchmarks/state_variants.py`).
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax
from benchmarks.common import (
    compiled_cost,
    cost_analysis,
    in_child,
    interleaved_times,
    paired_ratio,
    summary,
    table,
    time_train_steps,
)

try:  # optional: the `bench` extra
    import jmp
except ImportError:  # pragma: no cover - depends on the environment
    jmp = None

__all__ = ["data_parallel", "inference", "step_overhead"]

# --- step_overhead: the MLP and its loss-scaling variants ------------------------------------

COMPUTE, LR, STATIC_SCALE = jnp.float16, 1e-4, 2.0**15
FP16_PARAMS = "(info) mpjax, fp16 params + fp32 master"
MPJAX = "mpjax.loss_scaled(adam)"
ANCHORS = ("flax DynamicScale", "optax.apply_if_finite + static scale", "jmp pattern")
FULL = {"depth": 60, "width": 256, "batch": 32, "rounds": 21, "steps_per_round": 5}
QUICK = {"depth": 8, "width": 32, "batch": 8, "rounds": 5, "steps_per_round": 2}


def init_params(key: jax.Array, depth: int, width: int) -> dict:
    """float32 MLP params: `depth` layers of {"kernel", "bias"} (2 * depth leaves)."""
    params = {}
    for i, k in enumerate(jax.random.split(key, depth)):
        kk, kb = jax.random.split(k)
        params[f"dense_{i:03d}"] = {
            "kernel": jax.random.normal(kk, (width, width), jnp.float32) / np.sqrt(width),
            "bias": 0.01 * jax.random.normal(kb, (width,), jnp.float32),
        }
    return params


def loss_fn(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """MSE of a tanh MLP run in float16 (params cast per use); the loss is float32."""
    x, y = batch
    h = x.astype(COMPUTE)
    for name in sorted(params):
        layer = params[name]
        h = jnp.tanh(h @ layer["kernel"].astype(COMPUTE) + layer["bias"].astype(COMPUTE))
    return jnp.mean(jnp.square(h.astype(jnp.float32) - y))


def _opt_step(make_tx, scale, unscale=lambda g: g):
    """A `(state, batch) -> (state, loss)` step of `make_tx()`; `scale(loss, opt_state)` is
    what is differentiated, `unscale(grads)` what the optimizer gets."""

    def step(state, batch):
        params, opt_state = state

        def scaled(p):
            loss = loss_fn(p, batch)
            return scale(loss, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = make_tx().update(unscale(grads), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def _tx_init(make_tx):
    # a new optimizer per state: its initial arrays (a loss scale) are never shared, so one
    # variant's donation cannot delete another's
    return lambda params: (params, make_tx().init(params))


def _adam():
    return optax.adam(LR)


def _loss_scaled():
    return mpjax.loss_scaled(optax.adam(LR))


def _if_finite():
    return optax.apply_if_finite(optax.adam(LR), 5)


bare_init, bare_step = _tx_init(_adam), _opt_step(_adam, lambda x, s: x)
mpjax_init, mpjax_step = _tx_init(_loss_scaled), _opt_step(_loss_scaled, mpjax.scale_loss)
if_finite_init = _tx_init(_if_finite)
if_finite_step = _opt_step(
    _if_finite, lambda x, s: x * STATIC_SCALE, lambda g: jax.tree.map(lambda x: x / STATIC_SCALE, g)
)


def mpjax_fp16_params_init(params):
    """fp16 params: `loss_scaled` then keeps a float32 master copy ("auto")."""
    return mpjax_init(jax.tree.map(lambda p: p.astype(jnp.float16), params))


def flax_init(params):
    from flax.training import train_state
    from flax.training.dynamic_scale import DynamicScale

    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(LR))
    return (ts, DynamicScale())


def flax_step(state, batch):
    ts, dyn_scale = state
    dyn_scale, is_fin, loss, grads = dyn_scale.value_and_grad(loss_fn)(ts.params, batch)
    new_ts = ts.apply_gradients(grads=grads)
    keep = lambda new, old: jnp.where(is_fin, new, old)  # noqa: E731
    new_ts = new_ts.replace(
        opt_state=jax.tree.map(keep, new_ts.opt_state, ts.opt_state),
        params=jax.tree.map(keep, new_ts.params, ts.params),
    )
    return (new_ts, dyn_scale), loss


def jmp_init(params):
    # jmp's DynamicLossScale breaks `jax.jit(...).lower()`, so its scale and counter cross
    # the jit boundary as arrays and the object is rebuilt in the step (the same computation).
    ls = jmp.DynamicLossScale(jnp.float32(2.0**15))
    return (params, optax.adam(LR).init(params), (ls.loss_scale, ls.counter))


def jmp_step(state, batch):
    params, opt_state, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter)
    policy = jmp.get_policy("params=float32,compute=float16,output=float32")

    def scaled(p):
        loss = policy.cast_to_output(loss_fn(policy.cast_to_compute(p), batch))
        return loss_scale.scale(loss), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    grads = loss_scale.unscale(policy.cast_to_param(grads))
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = optax.adam(LR).update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt_state)
    params, opt_state = jmp.select_tree(finite, new, (params, opt_state))
    return (params, opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss


def variants() -> dict:
    """name -> (init, step); the first entry is the baseline."""
    out = {
        "bare optax adam": (bare_init, bare_step),
        MPJAX: (mpjax_init, mpjax_step),
        "flax DynamicScale": (flax_init, flax_step),
        "optax.apply_if_finite + static scale": (if_finite_init, if_finite_step),
    }
    if jmp is not None:
        out["jmp pattern"] = (jmp_init, jmp_step)
    # Not the same storage (fp16 params + a float32 master): the master-weights mode's cost.
    out[FP16_PARAMS] = (mpjax_fp16_params_init, mpjax_step)
    return out


def _skipped_steps(name: str, state) -> int | None:
    if name.startswith("mpjax") or name == FP16_PARAMS:
        return int(mpjax.scaling_metrics(state[1])["skipped_steps"])
    if name.startswith("optax.apply_if_finite"):
        return int(state[1].total_notfinite)
    return None


def step_overhead(case=None, quick: bool = False, sizes: dict | None = None) -> dict:
    """Every loss-scaling variant, donated and not, timed against bare optax."""
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    key_p, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    params = init_params(key_p, cfg["depth"], cfg["width"])
    shape = (cfg["batch"], cfg["width"])
    batch = tuple(jax.random.normal(k, shape, jnp.float32) for k in (key_x, key_y))
    steps, states, costs = {}, {}, {}
    for donate in (True, False):
        for name, (init, step) in variants().items():
            states[name, donate] = init(jax.tree.map(jnp.copy, params))
            jitted = jax.jit(step, donate_argnums=0 if donate else ())
            steps[name, donate] = jitted.lower(states[name, donate], batch).compile()
            costs[name, donate] = compiled_cost(steps[name, donate])
    times, losses = time_train_steps(
        steps, states, batch, rounds=cfg["rounds"], steps_per_round=cfg["steps_per_round"]
    )
    rows, skipped, versus = [], {}, []
    for key in steps:
        name, donate = key
        base = ("bare optax adam", donate)
        t, r = summary(times[key]), paired_ratio(times, key, base)
        nbytes = costs[key]["bytes accessed"]
        rows.append([name, "yes" if donate else "no", nbytes / 1e6])
        rows[-1] += [nbytes / costs[base]["bytes accessed"], costs[key]["copies"]]
        rows[-1] += [t["median"] * 1e3, f"{t['min'] * 1e3:.3g}-{t['max'] * 1e3:.3g}"]
        rows[-1] += [r["median"], f"{r['min']:.3g}-{r['max']:.3g}"]
        if name in ANCHORS:
            v = paired_ratio(times, (MPJAX, donate), key)
            versus.append(
                f"{'donated' if donate else 'not donated'}, mpjax / {name}: "
                f"{v['median']:.3f} ({v['min']:.3g}-{v['max']:.3g})"
            )
        if s := _skipped_steps(name, states[key]):
            skipped[f"{name} (donated={donate})"] = s
        if not np.isfinite(float(losses[key])):
            raise RuntimeError(f"step_overhead: {name} produced a non-finite loss")
    n_leaves = len(jax.tree.leaves(params))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    notes = [
        f"MLP: {cfg['depth']} Dense layers of {cfg['width']}x{cfg['width']} "
        f"({n_leaves} leaves, {n_params / 1e6:.2f} M params), batch {cfg['batch']}, "
        "float32 params, float16 compute, Adam, jax.jit with and without the state donated.",
        f"Times: {cfg['rounds']} interleaved rounds of {cfg['steps_per_round']} steps, every "
        "variant in both donation modes in each round; 'time ratio' is the median (min-max) "
        "of per-round ratios to bare optax with the same donation.",
        "mpjax's paired time ratio to each anchor, median (min-max) over rounds: "
        + "; ".join(versus)
        + ".",
        "'HLO copies': copy instructions XLA inserted in the compiled step (extra passes over "
        "state buffers).",
        f"'{FP16_PARAMS}' stores the params in float16 with a float32 master copy in the "
        "optimizer state (mpjax's master-weights mode), so it is a different model storage, "
        "shown for information, not a like-for-like comparison.",
        "optax.apply_if_finite does no scaling itself: it gets a static 2**15 loss scale "
        "applied by hand (a lower bound on a dynamic scale's cost).",
    ]
    if jmp is None:
        notes.append("jmp is not installed: its row is omitted (pip install 'mpjax[bench]').")
    if skipped:
        notes.append(f"Skipped (non-finite) steps during timing: {skipped}.")
    columns = ["variant", "donated", "bytes accessed (MB)", "bytes ratio", "HLO copies"]
    columns += ["median ms/step", "min-max ms", "time ratio", "ratio min-max"]
    title = "Step overhead of loss scaling (fp16 compute, full train step)"
    return table(title, columns, rows, " ".join(notes))


# --- inference -------------------------------------------------------------------------------


def _random_variables(model, x, seed=0):
    """`model.init`'s variables with non-trivial BatchNorm statistics."""
    rng = np.random.default_rng(seed)

    def leaf(path, v):
        if path[-1].key == "var":
            return jnp.asarray(rng.uniform(0.3, 3.0, v.shape), v.dtype)
        if path[-1].key == "mean":
            return jnp.asarray(rng.normal(0.0, 0.5, v.shape), v.dtype)
        return v

    return jax.tree_util.tree_map_with_path(leaf, model.init(jax.random.key(seed), x))


def inference(case=None, quick: bool = False) -> dict:
    """Latency, bytes accessed and variable bytes of each conversion against float32."""
    from benchmarks.train_models import SmallResNet

    batch, size, widths, repeats, iters = (8, 16, (16, 32), 5, 5)
    if not quick:
        batch, size, widths, repeats, iters = 32, 32, (32, 64, 128), 9, 10
    x = jnp.asarray(np.random.default_rng(1).normal(size=(batch, size, size, 3)), jnp.float32)
    nn_specs = {"fold f32": ("f32", True), "cast bf16 (no fold)": ("compute=bfloat16", False)}
    nn_specs["fold bf16"] = ("compute=bfloat16", True)
    variants: dict[str, tuple] = {}  # name -> (jitted fn, variables, baseline name)
    for label, convbn, specs in (
        ("nn.Conv+BatchNorm", False, nn_specs),
        ("mpjax ConvBN", True, {"fold bf16": ("compute=bfloat16", True)}),
    ):
        model = SmallResNet(widths, convbn=convbn)
        variables = _random_variables(model, x[:1])
        base = f"{label}: original f32"
        variants[base] = (jax.jit(functools.partial(model.apply, train=False)), variables, base)
        for name, (policy, fold) in specs.items():
            conv = mpjax.convert_for_inference(
                model, variables, policy, example_inputs=x[:1], fold_batchnorm=fold,
                apply_kwargs={"train": False},
            )  # fmt: skip
            variants[f"{label}: {name}"] = (jax.jit(conv.apply), conv.variables, base)
    thunks = {name: functools.partial(fn, v, x) for name, (fn, v, _) in variants.items()}
    times = interleaved_times(thunks, rounds=repeats, steps_per_round=iters)
    accessed = {n: cost_analysis(fn, v, x)["bytes accessed"] for n, (fn, v, _) in variants.items()}
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    rows = []
    for name, (_, v, base) in variants.items():
        ms = summary([t * 1e3 for t in times[name]])
        rows.append([name, ms["median"], f"{ms['min']:.3f}-{ms['max']:.3f}"])
        rows[-1] += [paired_ratio(times, name, base)["median"], int(accessed[name])]
        rows[-1] += [accessed[name] / accessed[base], nbytes(v)]
        rows[-1] += [nbytes(v) / nbytes(variants[base][1])]
    columns = ["variant", "latency ms (median)", "min-max ms", "latency ratio"]
    columns += ["bytes accessed", "bytes ratio", "variable bytes", "variable ratio"]
    return table(
        f"Inference conversion on {jax.default_backend()} ({jax.devices()[0].device_kind}): "
        f"SmallResNet{widths}, batch {batch}, {size}x{size}x3",
        columns,
        rows,
        f"{repeats} interleaved rounds of {iters} jitted calls each; latency ratio: median "
        "of per-round ratios vs the same model's 'original f32' in the same run. "
        "Bytes accessed: XLA compiled cost analysis of the forward pass. "
        "Variable bytes: all collections (params + batch_stats). XLA:CPU runs a bf16 "
        "convolution by converting its operands to f32 and the result back (see the "
        "compiled HLO), so on CPU bf16 adds converts and bytes; the bf16 speed-up is a "
        "GPU/TPU effect. "
        "Run on a GPU machine to get the GPU figures (same script).",
    )


# --- data_parallel ---------------------------------------------------------------------------

N_DEVICES = 8


def _data_parallel_times(quick: bool) -> dict:
    """In the 8-device child: every configuration timed, alternating round by round."""
    import os
    import time

    from examples import data_parallel as dpx
    from examples.digits_cnn import global_batch_indices, load_data

    batch_size, steps, rounds = (64, 5, 3) if quick else (512, 20, 7)
    gpu = jax.default_backend() == "gpu"
    assert jax.device_count() >= N_DEVICES or gpu, jax.devices()
    x_all, y_all = load_data()[0]
    idx = [global_batch_indices(len(y_all), batch_size, s, seed=0) for s in range(steps)]
    configs = [  # (label, mode, precision, devices, zero)
        ("pjit, 1 device", "pjit", "fp16", 1, False),
        (f"pjit, {N_DEVICES} devices", "pjit", "fp16", N_DEVICES, False),
        (f"pjit, {N_DEVICES} devices, ZeRO", "pjit", "fp16", N_DEVICES, True),
    ]
    configs += [(f"1 GPU, {p}", "single", p, 1, False) for p in ("fp32", "bf16", "fp16")] * gpu
    runs = []
    for label, mode, precision, n, zero in configs:
        dp = dpx.make_data_parallel(mode, precision, zero=zero, devices=jax.devices()[:n])
        batches = [dp.put_batch(x_all[i], y_all[i]) for i in idx]
        state = list(dp.init(0))
        for b in batches[:2]:  # compile and warm up
            state[0], state[1], _ = dp.step(*state, *b)
        jax.block_until_ready(state)
        runs.append({"label": label, "dp": dp, "batches": batches, "state": state, "times": []})
    for r in range(rounds):
        for run_ in runs if r % 2 == 0 else runs[::-1]:
            state, start = run_["state"], time.perf_counter()
            for b in run_["batches"]:
                state[0], state[1], _ = run_["dp"].step(*state, *b)
            jax.block_until_ready(state)
            run_["times"].append((time.perf_counter() - start) / steps)
    out = {"batch_size": batch_size, "steps": steps, "rounds": rounds}
    out.update(backend=jax.default_backend(), cpu_count=os.cpu_count())
    return out | {"runs": [{"label": r["label"], "times": r["times"]} for r in runs]}


def data_parallel(case=None, quick: bool = False) -> dict:
    """Step time of the pjit data-parallel example: 8 CPU devices vs 1, the same global batch."""
    res = in_child(_data_parallel_times, quick, N_DEVICES)
    base, rows = statistics.median(res["runs"][0]["times"]), []
    for r in res["runs"]:
        times_ms = [t * 1e3 for t in r["times"]]
        med = statistics.median(times_ms)
        rows.append([r["label"], res["batch_size"], round(med, 2)])
        rows[-1] += [f"{min(times_ms):.2f}-{max(times_ms):.2f}"]
        rows[-1] += [round(res["batch_size"] / (med / 1e3)), round(med / (base * 1e3), 2)]
    gpu_note = (
        "GPU rows: one GPU, mode single, fp32 vs bf16 vs fp16 with dynamic loss scaling."
        if res["backend"] == "gpu"
        else "No GPU here: the single-GPU fp32 / bf16 / fp16+scaling throughput rows are not "
        "measured (they run when jax's backend is gpu)."
    )
    columns = ["configuration", "global batch", "step ms (median)", "min-max ms", "images/s"]
    return table(
        "Data-parallel example (pjit): step time, 8 devices vs 1 on the same global batch",
        columns + ["time vs 1 device"],
        rows,
        f"Backend {res['backend']}, {res['cpu_count']} CPU cores; fp16 params and compute, "
        f"dynamic loss scaling, Adam; {res['steps']} steps per sample, {res['rounds']} "
        "samples per configuration, configurations alternated. The 8 devices are simulated "
        "on the same CPU cores, so >1x is expected: this checks that sharding works at a "
        "bounded cost, not that it is faster. " + gpu_note,
    )
