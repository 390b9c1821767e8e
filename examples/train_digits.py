"""Trains a small ResNet on scikit-learn's digits under fp32, bf16 and fp16 with loss scaling.

Run from the repository root:

    python examples/train_digits.py                 # fp32, bf16, fp16; table + results/digits.png
    python examples/train_digits.py --precisions fp32 fp16 fp16-noscale --loss-multiplier 6.1e-5
    python examples/train_digits.py --precisions bf16 --optimizer-state bf16  # bf16 AdamW state

The model is a plain float32 Flax module; `apply_precision` wraps it with
`mpjax.apply_policy`, and the optimiser is `mpjax.loss_scaled(optax.adamw(...))`. The
training function is importable (`train`, `build_model`, `load_data`, ...) so tests and
fault-injection experiments can run it at tiny sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax
from examples.common import (
    DEFAULT_PRECISIONS,
    OPTIMIZER_STATES,
    PRECISIONS,
    RunResult,
    divergence_check,
    format_table,
    jit_on_this_backend,
    loss_scale_for,
    optimizer_with_state,
    plot_runs,
    policy_for,
    run_arg_parser,
    run_kwargs,
    summarise,
    timed,
    train_loop,
)

__all__ = [
    "DigitsConfig",
    "DigitsData",
    "DigitsResNet",
    "TrainFns",
    "apply_precision",
    "build_model",
    "build_optimizer",
    "load_data",
    "main",
    "make_train_fns",
    "run_experiment",
    "train",
]


@dataclasses.dataclass(frozen=True)
class DigitsConfig:
    """Hyper-parameters of one digits run (hashable, so it can key compiled steps).

    Attributes:
      precision: "fp32", "bf16", "fp16" (dynamic loss scaling) or "fp16-noscale".
      steps: optimiser steps.
      batch_size: examples per step.
      learning_rate: peak AdamW learning rate (cosine decay to 0 over `steps`).
      weight_decay: AdamW weight decay.
      adam_eps: AdamW epsilon.
      width: channels of the convolutions.
      num_blocks: residual blocks.
      loss_multiplier: constant the loss is multiplied by before differentiation (the
        reported loss is the plain cross-entropy). Small values push gradients below
        fp16's smallest subnormal, the regime loss scaling exists for.
      initial_scale: initial dynamic loss scale (fp16 only).
      growth_interval: finite steps between loss-scale doublings (fp16 only).
      optimizer_state: "f32" (AdamW moments in float32), "bf16" (bfloat16, stochastic
        rounding: `mpjax.low_precision_state`), "bf16-nearest", "int8" (blockwise 8-bit
        codes, nearest rounding) or "int8-stochastic". The params are stored
        in float32 under every precision, so `loss_scaled` keeps no master copy.
    """

    precision: str = "fp16"
    steps: int = 300
    batch_size: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    width: int = 32
    num_blocks: int = 2
    loss_multiplier: float = 1.0
    initial_scale: float = 2.0**15
    growth_interval: int = 50
    optimizer_state: str = "f32"

    def __post_init__(self):
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"DigitsConfig.optimizer_state={self.optimizer_state!r}; choose from "
                f"{', '.join(OPTIMIZER_STATES)}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"DigitsConfig.precision={self.precision!r}; choose from {', '.join(PRECISIONS)}"
            )
        for name in ("steps", "batch_size", "width", "num_blocks", "growth_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"DigitsConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.loss_multiplier > 0:
            raise ValueError(
                f"DigitsConfig.loss_multiplier must be > 0, got {self.loss_multiplier}"
            )


class DigitsData(NamedTuple):
    """The digits split: NHWC float32 images in [0, 1] and int32 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_data(test_size: float = 0.5, split_seed: int = 0) -> DigitsData:
    """Loads scikit-learn's 8x8 digits (1797 images, shipped with sklearn) and splits them.

    Half is held out: with a quarter (450 images) this ResNet scores 100% on some seeds,
    and a ceiling hides any gap between precisions.

    Args:
      test_size: fraction held out for testing (stratified).
      split_seed: seed of the split (kept fixed so precisions are compared on one test set).

    Returns:
      A `DigitsData`.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_size, random_state=split_seed, stratify=y
    )
    return DigitsData(x_tr, y_tr, x_te, y_te)


class ResidualBlock(nn.Module):
    """Conv -> BatchNorm -> ReLU -> Conv -> BatchNorm, plus the input, then ReLU."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        y = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, scale_init=nn.initializers.zeros
        )(y)
        return nn.relu(x + y)


class DigitsResNet(nn.Module):
    """A small ResNet: stem Conv-BN-ReLU, residual blocks, global average pool, Dense head.

    A plain float32 Flax module: precision is applied from outside (`apply_precision`).
    """

    width: int = 32
    num_blocks: int = 2
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for _ in range(self.num_blocks):
            x = ResidualBlock(self.width)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


def apply_precision(model: nn.Module, policy: mpjax.Policy) -> nn.Module:
    """Wraps `model` with `mpjax.apply_policy` under `policy`.

    Params stay in `policy.param_dtype`; convolutions and the Dense head run in
    `policy.compute_dtype`, and activations pass between layers in it; BatchNorm computes
    in float32 and the logits leave in float32 (`mpjax.DEFAULTS`).
    """
    per_layer = dataclasses.replace(policy, output_dtype=policy.compute_dtype)
    return mpjax.apply_policy(model, per_layer)


def build_model(config: DigitsConfig) -> nn.Module:
    """Builds the digits ResNet with the precision policy of `config` applied."""
    model = DigitsResNet(width=config.width, num_blocks=config.num_blocks)
    return apply_precision(model, policy_for(config.precision))


def build_optimizer(config: DigitsConfig) -> optax.GradientTransformation:
    """`mpjax.loss_scaled(optax.adamw(...))` with the loss scale of `config.precision`.

    The AdamW state is kept in `config.optimizer_state` (`optimizer_with_state`).
    """
    schedule = optax.cosine_decay_schedule(config.learning_rate, config.steps)
    inner = optimizer_with_state(
        optax.adamw(schedule, eps=config.adam_eps, weight_decay=config.weight_decay),
        config.optimizer_state,
    )
    loss_scale = loss_scale_for(
        config.precision,
        initial_scale=config.initial_scale,
        growth_interval=config.growth_interval,
    )
    return mpjax.loss_scaled(inner, loss_scale)


class TrainFns(NamedTuple):
    """Compiled pieces of a run; build once per config and reuse across seeds.

    Attributes:
      model: the policy-wrapped model.
      tx: the optimiser.
      init: `(rng, example_x) -> (params, batch_stats, opt_state)`.
      step: `((params, batch_stats, opt_state), (x, y), step) -> (carry, metrics)`.
      predict: `(params, batch_stats, x) -> logits` (inference mode).
    """

    model: nn.Module
    tx: optax.GradientTransformation
    init: Callable
    step: Callable
    predict: Callable


def make_train_fns(
    config: DigitsConfig, grad_fault: Callable[[jax.Array, Any], Any] | None = None
) -> TrainFns:
    """Builds the jitted init / train step / predict functions of a digits run.

    Args:
      config: the run's hyper-parameters.
      grad_fault: optional `(step, grads) -> grads`, traced inside the jitted step and
        applied to the (scaled) gradients before the optimiser sees them; `step` is an
        int32 scalar array. Use `jnp.where(step == k, ...)` to inject inf/NaN at step k.

    Returns:
      A `TrainFns`.
    """
    model = build_model(config)
    tx = build_optimizer(config)

    def init(rng, example_x):
        variables = model.init(rng, example_x, train=False)
        params, batch_stats = variables["params"], variables["batch_stats"]
        return params, batch_stats, tx.init(params)

    def step(carry, batch, step_index):
        params, batch_stats, opt_state = carry
        x, y = batch

        def loss_fn(p):
            logits, updates = model.apply(
                {"params": p, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
            ce = ce.mean()
            scaled = mpjax.scale_loss(ce * config.loss_multiplier, opt_state)
            return scaled, (ce, updates["batch_stats"])

        grads, (ce, new_stats) = jax.grad(loss_fn, has_aux=True)(params)
        if grad_fault is not None:
            grads = grad_fault(step_index, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # A skipped step leaves the BatchNorm statistics alone too (a NaN batch would
        # otherwise poison them for good).
        batch_stats = mpjax.keep_if_skipped(new_stats, batch_stats, opt_state)
        m = mpjax.scaling_metrics(opt_state)
        metrics = {
            "loss": ce,
            "loss_scale": m["loss_scale"],
            "grads_finite": m["grads_finite"],
            "skipped": m["skipped"],
            "skipped_steps": m["skipped_steps"],
        }
        return (params, batch_stats, opt_state), metrics

    def predict(params, batch_stats, x):
        return model.apply({"params": params, "batch_stats": batch_stats}, x, train=False)

    return TrainFns(
        model,
        tx,
        jit_on_this_backend(init),
        jit_on_this_backend(step, donate_argnums=0),
        jit_on_this_backend(predict),
    )


def _batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int) -> Iterator:
    """Endless shuffled minibatches, reshuffled every epoch; the last partial batch is dropped."""
    rng = np.random.default_rng(seed)
    n = len(x)
    batch_size = min(batch_size, n)
    while True:
        order = rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]


def accuracy(fns: TrainFns, params: Any, batch_stats: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Test accuracy in percent."""
    logits = fns.predict(params, batch_stats, x)
    return float(np.mean(np.asarray(jnp.argmax(logits, -1)) == y) * 100.0)


def train(
    config: DigitsConfig,
    seed: int = 0,
    *,
    data: DigitsData | None = None,
    fns: TrainFns | None = None,
    batch_fault: Callable[[int, tuple[np.ndarray, np.ndarray]], Any] | None = None,
    grad_fault: Callable[[jax.Array, Any], Any] | None = None,
    progress: bool = False,
) -> RunResult:
    """Trains the digits ResNet once and evaluates it on the test split.

    Args:
      config: hyper-parameters, including the precision.
      seed: seeds the initialisation and the batch order.
      data: the split; None loads it with `load_data()`.
      fns: compiled functions from `make_train_fns(config)` to reuse; None builds them.
      batch_fault: optional host-side `(step, (x, y)) -> (x, y)` applied to each batch
        before the step (e.g. put NaN into `x` at step k).
      grad_fault: optional traced `(step, grads) -> grads` (see `make_train_fns`); only
        used when `fns` is None.
      progress: show a tqdm bar.

    Returns:
      A `RunResult` with the test accuracy (%) as `metric`, the per-step history, the
      final `params`, `opt_state`, and `extra={"batch_stats": ...}`.

    Example:
      >>> r = train(DigitsConfig(precision="fp16", steps=20, width=8, num_blocks=1))
      >>> r.history["loss"].shape
      (20,)
    """
    if fns is not None and grad_fault is not None:
        raise ValueError("train: pass grad_fault to make_train_fns when you pass fns")
    data = load_data() if data is None else data

    def run():
        f = make_train_fns(config, grad_fault) if fns is None else fns
        carry = f.init(jax.random.key(seed), data.x_train[:1])
        batches = _batches(data.x_train, data.y_train, config.batch_size, seed)
        carry, history = train_loop(
            f.step,
            carry,
            batches,
            config.steps,
            desc=f"{config.precision} seed {seed}",
            progress=progress,
            batch_fault=batch_fault,
            check_diverged=divergence_check(config.precision),
        )
        params, batch_stats, opt_state = carry
        acc = accuracy(f, params, batch_stats, data.x_test, data.y_test)
        return acc, history, carry

    (acc, history, (params, batch_stats, opt_state)), wall = timed(run)
    return RunResult(
        precision=config.precision,
        seed=seed,
        metric=acc,
        history=history,
        wall_s=wall,
        params=params,
        opt_state=opt_state,
        extra={"batch_stats": batch_stats},
    )


def run_experiment(
    precisions: Sequence[str] = DEFAULT_PRECISIONS,
    seeds: int = 3,
    *,
    png: str | Path | None = "results/digits.png",
    progress: bool = True,
    **config_kwargs: Any,
) -> tuple[list[RunResult], str]:
    """Trains every precision for `seeds` seeds, prints nothing, returns runs and table.

    Args:
      precisions: precision names.
      seeds: seeds per precision (0 .. seeds-1).
      png: where to write the loss / loss-scale plot; None writes none.
      progress: show a tqdm bar per run.
      **config_kwargs: `DigitsConfig` fields other than `precision`.

    Returns:
      `(runs, markdown_table)`.
    """
    data = load_data()
    results = []
    for precision in precisions:
        config = DigitsConfig(precision=precision, **config_kwargs)
        fns = make_train_fns(config)
        for seed in range(seeds):
            results.append(train(config, seed, data=data, fns=fns, progress=progress))
    columns, rows = summarise(results, "test accuracy %")
    table = format_table(columns, rows)
    if png is not None:
        plot_runs(results, png, "digits ResNet: mixed precision vs float32")
    return results, table


def _parser() -> argparse.ArgumentParser:
    d = DigitsConfig()
    p = run_arg_parser(
        __doc__.split("\n\n")[0],
        d,
        seeds=3,
        png="results/digits.png",
        batch_help="examples per step",
    )
    p.add_argument("--width", type=int, default=d.width, help="convolution channels")
    p.add_argument("--blocks", type=int, default=d.num_blocks, help="residual blocks")
    p.add_argument(
        "--loss-multiplier",
        type=float,
        default=d.loss_multiplier,
        help="multiply the loss by this before differentiating (e.g. 6.1e-5 = 2^-14 "
        "makes fp16 gradients underflow without loss scaling; see underflow_demo.py)",
    )
    p.add_argument(
        "--optimizer-state",
        choices=OPTIMIZER_STATES,
        default="f32",
        help="AdamW moments in float32, bfloat16 (stochastic or nearest rounding) or 8 bits "
        "(nearest or stochastic rounding); the "
        "params are float32 under every precision, so there is no --master-weights",
    )
    return p


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    """Command-line entry point: trains, prints the results table, writes the PNG."""
    args = _parser().parse_args(argv)
    results, table = run_experiment(
        args.precisions,
        args.seeds,
        width=args.width,
        num_blocks=args.blocks,
        loss_multiplier=args.loss_multiplier,
        optimizer_state=args.optimizer_state,
        **run_kwargs(args),
    )
    print()
    print(table)
    print(f"\nwrote {args.png}")
    return results


if __name__ == "__main__":
    main()
