"""A small mixed-precision training loop that checkpoints and resumes; run by
tests/scaling/test_resume.py.

Each invocation is its own process. It trains steps `[start, stop)` of a fixed run (fp16 params with
float32 master weights, fp16 compute, dropout drawn from a JAX key, AdamW under `mpjax.loss_scaled`
with a non-default `DynamicLossScale`, NaN/inf batches at `--bad-steps`) and can

- start fresh (`--start 0`) or restore step `start` from a checkpoint (`--restore-orbax DIR` or
  `--restore-bytes FILE`);
- save a checkpoint after step `--save-at` in both formats (orbax `StandardCheckpointer` and
  `flax.serialization.to_bytes`), print `SAVED <step>` once it is on disk, and then go on training
  with nothing more saved, until the caller kills it (`--hang-after-save`);
- write its final state to `--out FILE.npz` (every leaf of params, opt_state, RNG key data and step,
  by path) for a bitwise comparison.

Usage:
  python tests/scaling/resume_worker.py --stop 12 --out full.npz
  python tests/scaling/resume_worker.py --stop 12 --save-at 5 --ckpt-dir D --hang-after-save
  python tests/scaling/resume_worker.py --start 5 --stop 12 --restore-orbax D/orbax \
    --out resumed.npz
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import flax.serialization  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpjax  # noqa: E402

# Non-default on purpose: a resume that lost them would follow another scale trajectory.
LOSS_SCALE_CONFIG = dict(
    initial_scale=2.0**6,
    growth_interval=3,
    growth_factor=2.0,
    backoff_factor=0.5,
    min_scale=2.0**4,
    max_scale=2.0**12,
)
SEED = 17
BATCH, D_IN, D_HIDDEN = 32, 8, 16
POLICY = mpjax.get_policy("params=float16,compute=float16,output=float32")


def make_optimizer() -> optax.GradientTransformation:
    return mpjax.loss_scaled(
        optax.adamw(3e-3, weight_decay=1e-2), mpjax.DynamicLossScale(**LOSS_SCALE_CONFIG)
    )


def init_params() -> dict:
    rng = np.random.default_rng(SEED)
    return {
        "dense1": {
            "kernel": jnp.asarray(rng.normal(size=(D_IN, D_HIDDEN)) / np.sqrt(D_IN), jnp.float16),
            "bias": jnp.zeros((D_HIDDEN,), jnp.float16),
        },
        "dense2": {
            "kernel": jnp.asarray(rng.normal(size=(D_HIDDEN, 1)) / 4, jnp.float16),
            "bias": jnp.zeros((1,), jnp.float32),  # float32: no master copy kept
        },
    }


def batch(step: int, bad_steps: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """The batch of `step`, the same in every process; a bad step holds a NaN or an inf."""
    rng = np.random.default_rng([SEED, step])
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    if step in bad_steps:
        x[BATCH // 2, D_IN // 2] = bad_steps[step]
    return x, y


def loss_fn(params, x, y, key):
    p, x = POLICY.cast_to_compute((params, x))
    h = jnp.tanh(x @ p["dense1"]["kernel"] + p["dense1"]["bias"])
    keep = jax.random.bernoulli(key, 0.9, h.shape)  # dropout: the RNG state matters
    h = jnp.where(keep, h / jnp.float16(0.9), jnp.zeros_like(h))
    pred = POLICY.cast_to_output(h @ p["dense2"]["kernel"]) + params["dense2"]["bias"]
    return jnp.mean((pred - y) ** 2)


def make_step(tx):
    @jax.jit
    def step(params, opt_state, key, x, y):
        key, sub = jax.random.split(key)
        grads = jax.grad(lambda p: mpjax.scale_loss(loss_fn(p, x, y, sub), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key

    return step


def to_checkpoint(params, opt_state, key, step: int) -> dict:
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.key_data(key),
        "step": jnp.asarray(step, jnp.int32),
    }


def from_checkpoint(tree: dict):
    return tree["params"], tree["opt_state"], jax.random.wrap_key_data(tree["rng"]), tree["step"]


def save(ckpt_dir: Path, tree: dict) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((ckpt_dir / "orbax").absolute(), tree)
        ckptr.wait_until_finished()
    tmp = ckpt_dir / "state.msgpack.tmp"
    tmp.write_bytes(flax.serialization.to_bytes(tree))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / "state.msgpack")


def restore(target: dict, orbax_dir: str | None, bytes_file: str | None) -> dict:
    if orbax_dir is not None:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(Path(orbax_dir).absolute(), target)
    return flax.serialization.from_bytes(target, Path(bytes_file).read_bytes())


def flat_leaves(tree) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stop", type=int, required=True)
    ap.add_argument("--bad-steps", default="{}", help='JSON {"step": value}, e.g. {"2": NaN}')
    ap.add_argument("--restore-orbax")
    ap.add_argument("--restore-bytes")
    ap.add_argument("--save-at", type=int)
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--hang-after-save", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    bad_steps = {int(k): float(v) for k, v in json.loads(args.bad_steps).items()}

    tx = make_optimizer()
    params = init_params()
    opt_state = tx.init(params)
    key = jax.random.key(SEED)
    if args.start:
        target = to_checkpoint(params, opt_state, key, 0)
        params, opt_state, key, step = from_checkpoint(
            restore(target, args.restore_orbax, args.restore_bytes)
        )
        assert int(step) == args.start, (int(step), args.start)
        # the configuration comes back with the restore target, not the library defaults
        restored = mpjax.find_loss_scaled_state(opt_state).loss_scale
        assert restored.config == mpjax.DynamicLossScale(**LOSS_SCALE_CONFIG).config

    train_step = make_step(tx)
    scales = []
    for step in range(args.start, args.stop):
        x, y = batch(step, bad_steps)
        params, opt_state, key = train_step(params, opt_state, key, x, y)
        scales.append(float(mpjax.get_loss_scale(opt_state)))
        if args.save_at is not None and step + 1 == args.save_at:
            save(Path(args.ckpt_dir), to_checkpoint(params, opt_state, key, step + 1))
            print(f"SAVED {step + 1}", flush=True)
            if args.hang_after_save:  # train on, unsaved, until killed
                for later in range(step + 1, step + 10_000):
                    x, y = batch(later, bad_steps)
                    params, opt_state, key = train_step(params, opt_state, key, x, y)
                    jax.block_until_ready(params)
                    print(f"TRAINED {later + 1}", flush=True)
                    time.sleep(0.05)
                return 1  # not reached when the caller kills us

    if args.out:
        leaves = flat_leaves(to_checkpoint(params, opt_state, key, args.stop))
        leaves["__scales__"] = np.asarray(scales, np.float32)
        np.savez(args.out, **leaves)
    return 0


if __name__ == "__main__":
    sys.exit(main())
