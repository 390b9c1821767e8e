"""Step overhead of loss scaling: a full fp16 train step under each loss-scaling pattern.

The model is a deep MLP (`depth` Dense layers, kernel + bias each, so 2 * depth leaves; 120
by default) with float32 parameters and float16 compute: params are cast to float16 in the
forward pass and the loss is taken in float32, the usual Flax `param_dtype=float32,
dtype=float16` set-up. Every variant runs the same forward + backward + Adam update under
`jax.jit`, once with the train state donated and once without (both in the same interleaved
timing rounds):

- bare optax: `optax.adam`, no loss scaling, no finite check (the baseline).
- mpjax: `mpjax.loss_scaled(optax.adam)` with its default `DynamicLossScale`.
- Flax DynamicScale: `flax.training.dynamic_scale.DynamicScale.value_and_grad`, then
  `TrainState.apply_gradients` and `jnp.where(is_fin, new, old)` over params and opt_state,
  as in Flax's documentation and examples.
- optax.apply_if_finite: `optax.apply_if_finite(optax.adam, 5)` with a *static* loss scale
  applied by hand (loss times 2**15, grads divided by 2**15), because `apply_if_finite` only
  skips non-finite steps and does no scaling. A static scale does strictly less work than a
  dynamic one, so this is a lower bound on its cost.
- (info) mpjax with fp16 params: the params stored in float16, `loss_scaled` keeping a
  float32 master copy; a different storage, shown for the cost of the master-weights mode.
- jmp: the pattern from jmp's README: `policy.cast_to_compute(params)`,
  `loss_scale.scale(loss)`, `policy.cast_to_param(grads)`, `loss_scale.unscale(grads)`,
  `jmp.all_finite`, `loss_scale.adjust`, and `jmp.select_tree(finite, new, old)` over params
  and opt_state. jmp's `DynamicLossScale` breaks `jax.jit(...).lower()`, so its scale and
  counter cross the jit boundary as arrays and the object is rebuilt in the step. Omitted
  (with a note) when jmp is not installed (`pip install mpjax[bench]`).

Reported per variant and donation mode: compiled "bytes accessed" from XLA's cost analysis
and wall time per step (median over interleaved rounds, min-max), each as a ratio to bare optax
with the same donation in the same run (time ratios are medians of per-round ratios, so
machine-wide slow phases cancel), and mpjax's paired time ratio to each anchor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from flax.training.dynamic_scale import DynamicScale  # noqa: E402

import mpjax  # noqa: E402
from benchmarks.common import (  # noqa: E402
    compiled_cost,
    paired_ratio,
    summary,
    time_train_steps,
)

try:  # optional: the `bench` extra
    import jmp
except ImportError:  # pragma: no cover - depends on the environment
    jmp = None

COMPUTE = jnp.float16
LR = 1e-4
STATIC_SCALE = 2.0**15
FP16_PARAMS = "(info) mpjax, fp16 params + fp32 master"
MPJAX = "mpjax.loss_scaled(adam)"
ANCHORS = ("flax DynamicScale", "optax.apply_if_finite + static scale", "jmp pattern")
DONATION = (True, False)

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


# --- the train steps; each takes and returns (state, batch) -> (state, loss) ---------------


def bare_init(params):
    tx = optax.adam(LR)
    return (params, tx.init(params))


def bare_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optax.adam(LR).update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def mpjax_init(params):
    return (params, mpjax.loss_scaled(optax.adam(LR)).init(params))


def mpjax_step(state, batch):
    params, opt_state = state
    tx = mpjax.loss_scaled(optax.adam(LR))

    def scaled(p):
        loss = loss_fn(p, batch)
        return mpjax.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def mpjax_fp16_params_init(params):
    """fp16 params: `loss_scaled` then keeps a float32 master copy ("auto")."""
    return mpjax_init(jax.tree.map(lambda p: p.astype(jnp.float16), params))


def flax_init(params):
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(LR))
    return (ts, DynamicScale())


def flax_step(state, batch):
    ts, dyn_scale = state
    dyn_scale, is_fin, loss, grads = dyn_scale.value_and_grad(loss_fn)(ts.params, batch)
    new_ts = ts.apply_gradients(grads=grads)
    keep = lambda new, old: jnp.where(is_fin, new, old)
    new_ts = new_ts.replace(
        opt_state=jax.tree.map(keep, new_ts.opt_state, ts.opt_state),
        params=jax.tree.map(keep, new_ts.params, ts.params),
    )
    return (new_ts, dyn_scale), loss


def if_finite_init(params):
    return (params, optax.apply_if_finite(optax.adam(LR), 5).init(params))


def if_finite_step(state, batch):
    params, opt_state = state
    tx = optax.apply_if_finite(optax.adam(LR), 5)

    def scaled(p):
        loss = loss_fn(p, batch)
        return loss * STATIC_SCALE, loss

    grads, loss = jax.grad(scaled, has_aux=True)(params)
    grads = jax.tree.map(lambda g: g / STATIC_SCALE, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def jmp_init(params):
    # jmp's DynamicLossScale breaks `jax.jit(...).lower()` (its unflatten validates the
    # placeholder leaves), so its numeric state crosses the jit boundary as plain arrays and
    # the object is rebuilt inside the step; the computation is the same.
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
    grads = policy.cast_to_param(grads)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = optax.adam(LR).update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
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
    # Not the same model storage as the rows above (params held in fp16, plus an fp32
    # master copy): shown for the cost of mpjax's master-weights mode.
    out[FP16_PARAMS] = (mpjax_fp16_params_init, mpjax_step)
    return out


def skipped_steps(name: str, state) -> int | None:
    """How many steps a loss-scaling variant skipped (None for the baseline)."""
    if name.startswith("mpjax") or name == FP16_PARAMS:
        return int(mpjax.scaling_metrics(state[1])["skipped_steps"])
    if name.startswith("optax.apply_if_finite"):
        return int(state[1].total_notfinite)
    return None


def run(quick: bool = False, sizes: dict | None = None) -> dict:
    """Runs the benchmark; `sizes` overrides the depth/width/batch/rounds settings."""
    cfg = dict(QUICK if quick else FULL)
    cfg.update(sizes or {})
    key_p, key_x, key_y = jax.random.split(jax.random.key(0), 3)
    params = init_params(key_p, cfg["depth"], cfg["width"])
    batch = (
        jax.random.normal(key_x, (cfg["batch"], cfg["width"]), jnp.float32),
        jax.random.normal(key_y, (cfg["batch"], cfg["width"]), jnp.float32),
    )
    n_leaves = len(jax.tree.leaves(params))
    n_params = sum(x.size for x in jax.tree.leaves(params))

    steps, states, costs = {}, {}, {}
    for donate in DONATION:
        for name, (init, step) in variants().items():
            key = (name, donate)
            state = init(jax.tree.map(jnp.copy, params))
            jitted = jax.jit(step, donate_argnums=0) if donate else jax.jit(step)
            compiled = jitted.lower(state, batch).compile()  # compiled once: costs and timing
            costs[key] = compiled_cost(compiled)
            states[key] = state
            steps[key] = compiled

    times, losses = time_train_steps(
        steps, states, batch, rounds=cfg["rounds"], steps_per_round=cfg["steps_per_round"]
    )

    rows = []
    skipped = {}
    versus = []
    for key in steps:
        name, donate = key
        base = (next(iter(variants())), donate)
        t = summary(times[key])
        r = paired_ratio(times, key, base)
        rows.append(
            [
                name,
                "yes" if donate else "no",
                costs[key]["bytes accessed"] / 1e6,
                costs[key]["bytes accessed"] / costs[base]["bytes accessed"],
                costs[key]["copies"],
                t["median"] * 1e3,
                f"{t['min'] * 1e3:.3g}-{t['max'] * 1e3:.3g}",
                r["median"],
                f"{r['min']:.3g}-{r['max']:.3g}",
            ]
        )
        if name in ANCHORS:
            v = paired_ratio(times, (MPJAX, donate), key)
            versus.append(
                f"{'donated' if donate else 'not donated'}, mpjax / {name}: "
                f"{v['median']:.3f} ({v['min']:.3g}-{v['max']:.3g})"
            )
        s = skipped_steps(name, states[key])
        if s:
            skipped[f"{name} (donated={donate})"] = s
        if not np.isfinite(float(losses[key])):
            raise RuntimeError(f"step_overhead: {name} produced a non-finite loss")

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
    return {
        "title": "Step overhead of loss scaling (fp16 compute, full train step)",
        "columns": [
            "variant",
            "donated",
            "bytes accessed (MB)",
            "bytes ratio",
            "HLO copies",
            "median ms/step",
            "min-max ms",
            "time ratio",
            "ratio min-max",
        ],
        "rows": rows,
        "notes": " ".join(notes),
    }
