"""The dtype gradients are summed across devices in (`Policy.reduce_dtype`): float16 vs float32.

Three measurements (``python benchmarks/run.py --only reduce-dtype [--quick]``):

  sum     a controlled N-way summation (N = 64 ... 1024) of per-device partial scaled gradients,
          as a ring reduce-scatter adds them: in float16 (each partial rounded to float16, each
          addition rounded), or in float32 and rounded once to float16 (what
          `reduce="float32"` does under an fp16 policy). Overflow rate (tensors of 4096
          elements with an inf) and the norm-wise relative error against the float64 sum.
  fp16    the char-LM (`examples/train_char_lm.py`'s `CharTransformer` under
          `mpjax.apply_policy`) trained FSDP-sharded on 8 simulated CPU devices with dynamic
          loss scaling, float16 vs float32 reduction: skipped steps, final loss scale, loss.
  bf16    the same with bfloat16 compute and no loss scaling: bfloat16 vs float32 reduction.

The training runs happen in a child process started with 8 host devices. The suite's
``reduce-dtype-h100`` case (``_h100_rows``) reads the gradient collectives of the same train
step compiled for 8 deviceless H100s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_DEVICES = 8
ELEMENTS = 4096
_MARK = "REDUCE_DTYPE_RESULT "


# ------------------------------------------------------------------ controlled N-way summation


def _ring_sum(partials: np.ndarray, dtype) -> np.ndarray:
    """Adds the rows of `partials` one by one, rounding the running sum to `dtype`."""
    acc = partials[0].astype(dtype)
    for row in partials[1:]:
        acc = (acc + row.astype(dtype)).astype(dtype)
    return acc


def _partials(rng, n: int, scale: float, noise: float) -> np.ndarray:
    """`n` per-device partial gradients of one tensor, scaled by `scale`, in float64.

    Each element's mean gradient has a log-uniform magnitude in [1e-8, 1e-1] and a random sign;
    each device's mean over its local batch adds Gaussian noise of `noise` times that
    magnitude; a device's partial is its local mean times `scale / n` (the loss is the mean
    over the global batch).
    """
    mag = 10.0 ** rng.uniform(-8, -1, ELEMENTS) * rng.choice([-1.0, 1.0], ELEMENTS)
    local = mag + noise * np.abs(mag) * rng.standard_normal((n, ELEMENTS))
    return local * (scale / n)


def _sums(parts: np.ndarray) -> dict:
    """The float16 ring sum, and the float32 ring sum rounded once to float16."""
    with np.errstate(over="ignore", invalid="ignore"):
        return {
            "f16": _ring_sum(parts, np.float16).astype(np.float64),
            "f32": _ring_sum(parts, np.float32).astype(np.float16).astype(np.float64),
        }


def _max_finite_log2_scale(unit: np.ndarray) -> dict:
    """Per method, the largest k such that the sum of `unit * 2**k` has no inf."""
    out = {}
    for method in ("f16", "f32"):
        lo, hi = 0, 40  # finite at 2**lo, assumed inf at 2**hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            finite = np.all(np.isfinite(_sums(unit * 2.0**mid)[method]))
            lo, hi = (mid, hi) if finite else (lo, mid)
        out[method] = lo
    return out


def _summation_rows(quick: bool) -> list:
    ways = (64, 1024) if quick else (64, 128, 256, 512, 1024)
    noises = (3.0,) if quick else (3.0, 100.0)
    trials = 3 if quick else 16
    scale = 2.0**12  # below the largest finite scale of every row
    rows = []
    rng = np.random.default_rng(0)
    for noise in noises:
        for n in ways:
            errs, under, top = {"f16": [], "f32": []}, {"f16": [], "f32": []}, []
            for _ in range(trials):
                unit = _partials(rng, n, 1.0, noise)
                exact = unit.sum(0) * scale
                for k, s in _sums(unit * scale).items():
                    if np.all(np.isfinite(s)):
                        errs[k].append(np.linalg.norm(s - exact) / np.linalg.norm(exact))
                    under[k].append(np.mean((s == 0) & (exact != 0)))
                top.append(_max_finite_log2_scale(unit))
            rows.append(
                [
                    n,
                    noise,
                    _median(errs["f16"]),
                    _median(errs["f32"]),
                    _median(under["f16"]),
                    _median(under["f32"]),
                    int(np.median([t["f16"] for t in top])),
                    int(np.median([t["f32"] for t in top])),
                ]
            )
    return rows


def _median(values: list) -> float:
    return float(np.median(values)) if values else float("nan")


# ------------------------------------------------------------------ char-LM on 8 CPU devices


def _fsdp_sharding(mesh, leaf):
    """Splits a leaf along its largest dimension divisible by the mesh size (else replicated)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shape = getattr(leaf, "shape", ())
    dims = sorted(range(len(shape)), key=lambda d: -shape[d])
    for d in dims:
        if shape[d] % mesh.size == 0:
            spec = [None] * len(shape)
            spec[d] = "fsdp"
            return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def _lm_step(policy: str, loss_scale, seq: int, d_model: int, lr: float):
    """(step, init) of the char-LM under `mpjax.apply_policy(policy)` and `loss_scaled`."""
    import jax
    import jax.numpy as jnp
    import optax

    import mpjax
    from examples.train_char_lm import CharTransformer

    base = CharTransformer(d_model=d_model, num_layers=2, num_heads=4, max_len=seq)
    model = mpjax.apply_policy(base, policy)
    tx = mpjax.loss_scaled(optax.adamw(lr, weight_decay=1e-2), loss_scale)

    def init(rng):
        params = base.init(rng, jnp.zeros((1, seq), jnp.int32))["params"]
        return params, tx.init(params)

    def step(params, opt_state, tokens):
        def scaled(p):
            logits = model.apply({"params": p}, tokens[:, :-1]).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
            return mpjax.scale_loss(ce, opt_state), ce

        grads, ce = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce

    return step, init


def _gradient_collectives(text: str) -> str:
    """`"op dtype xCOUNT"` of the reductions of more than 64 bytes (the gradients), and bytes."""
    from mpjax._src.analysis.collectives import collectives

    kinds, total = {}, 0
    for c in collectives(text):
        if c.op in ("all-reduce", "reduce-scatter") and c.bytes > 64:
            kinds[f"{c.op} {c.dtype}"] = kinds.get(f"{c.op} {c.dtype}", 0) + 1
            total += c.bytes
    text = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
    return f"{text}; {total / 2**20:.2f} MiB"


def _train(policy: str, loss_scale, steps: int, batch: int, seq: int = 64, d_model: int = 64):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import mpjax
    from examples.train_char_lm import _windows, load_corpus

    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("fsdp",))
    step, init = _lm_step(policy, loss_scale, seq, d_model, 3e-3)
    state = jax.jit(init)(jax.random.key(0))
    shard = jax.tree.map(lambda x: _fsdp_sharding(mesh, x), state)
    state = jax.device_put(state, shard)
    data = NamedSharding(mesh, P("fsdp"))
    fn = jax.jit(
        step, in_shardings=(*shard, data), out_shardings=(*shard, None), donate_argnums=(0, 1)
    )
    tokens = _windows(load_corpus(max_bytes=300_000).train, seq + 1, batch, 0)
    first = jax.device_put(next(tokens), data)
    collectives = _gradient_collectives(fn.lower(*state, first).compile().as_text())
    params, opt_state = state
    losses = []
    for _ in range(steps):
        params, opt_state, ce = fn(params, opt_state, jax.device_put(next(tokens), data))
        losses.append(float(ce))
    m = mpjax.scaling_metrics(opt_state)
    return {
        "skipped": int(m["skipped_steps"]),
        "scale": float(m["loss_scale"]),
        "loss": float(np.mean(losses[-10:])),
        "collectives": collectives,
    }


def _worker(quick: bool) -> dict:
    import mpjax

    steps, batch = (12, 16) if quick else (300, 32)
    rows = []
    for compute, reduces in (("f16", ("f16", "f32")), ("bf16", ("bf16", "f32"))):
        for reduce in reduces:
            policy = f"p=f32,c={compute},o=f32" + ("" if reduce == compute else f",r={reduce}")
            scale = (
                mpjax.DynamicLossScale(initial_scale=2.0**15, growth_interval=25)
                if compute == "f16"
                else mpjax.NoOpLossScale()
            )
            r = _train(policy, scale, steps, batch)
            rows.append([compute, reduce, steps, r["skipped"], r["scale"], r["loss"]])
            rows[-1].append(r["collectives"])
    return {"rows": rows}


def _trajectory_rows(quick: bool) -> list:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, "--worker"] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(_MARK)]
    if out.returncode or not lines:
        raise RuntimeError(f"worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len(_MARK) :])["rows"]


# ------------------------------------------------------------------ deviceless H100 check


def _h100_rows() -> list:
    """The gradient collectives of the char-LM FSDP step compiled for 8 deviceless H100s."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import mpjax
    from mpjax._src.analysis.target import h100_topology

    devices = h100_topology("1x1x8").devices
    mesh = Mesh(np.array(devices), ("fsdp",))
    rows = []
    for policy in (
        "p=f32,c=f16,o=f32",
        "p=f32,c=f16,o=f32,r=f32",
        "p=f32,c=bf16,o=f32",
        "p=f32,c=bf16,o=f32,r=f32",
    ):
        scale = mpjax.DynamicLossScale() if "f16" in policy.split(",")[1] else mpjax.NoOpLossScale()
        step, init = _lm_step(policy, scale, 256, 256, 3e-3)
        state = jax.eval_shape(init, jax.random.key(0))
        shard = jax.tree.map(lambda x: _fsdp_sharding(mesh, x), state)
        args = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shard
        )
        tokens = jax.ShapeDtypeStruct((64, 257), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))
        fn = jax.jit(step, out_shardings=(*shard, None), donate_argnums=(0, 1))
        rows.append(
            [policy, _gradient_collectives(fn.trace(*args, tokens).lower().compile().as_text())]
        )
    return rows


# ------------------------------------------------------------------ tables


SUM_COLUMNS = [
    "ways",
    "noise / mean",
    "rel err f16",
    "rel err f32",
    "zeroed f16",
    "zeroed f32",
    "max finite log2 scale f16",
    "max finite log2 scale f32",
]
TRAIN_COLUMNS = [
    "compute",
    "reduce",
    "steps",
    "skipped",
    "final scale",
    "loss (last 10)",
    "gradient collectives",
]


def run(quick: bool = False) -> dict:
    """The summation and trajectory tables, as one benchmark record."""
    sums = _summation_rows(quick)
    train = _trajectory_rows(quick)
    rows = [["sum", *map(str, r)] for r in sums]
    rows += [["train", *map(str, r[:6]), "", ""] for r in train]
    return {
        "title": "Gradient reduction dtype: float16/bfloat16 vs float32",
        "columns": ["part", "a", "b", "c", "d", "e", "f", "g", "h"],
        "rows": rows,
        "notes": "sum: " + ", ".join(SUM_COLUMNS) + "; train: " + ", ".join(TRAIN_COLUMNS[:6]),
        "sum": sums,
        "train": train,
    }


if __name__ == "__main__" and "--worker" in sys.argv:  # the 8-device child of `run`
    print(_MARK + json.dumps(_worker("--quick" in sys.argv)))
