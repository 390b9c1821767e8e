"""Shared pieces of the examples: precision set-ups, the training loop, the table and the plot."""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax

__all__ = [
    "OPTIMIZER_STATES",
    "PRECISIONS",
    "RunResult",
    "format_table",
    "jit_on_this_backend",
    "loss_scale_for",
    "optimizer_with_state",
    "divergence_check",
    "plot_runs",
    "policy_for",
    "summarise",
    "train_loop",
]

# name -> (policy spec, loss scaling). "auto" is `mpjax.loss_scale_for(name)` (dynamic for
# fp16, NoOpLossScale for fp32/bf16); "skip-only" is StaticLossScale(1.0): no scaling, but
# non-finite steps are still skipped (the ablation that shows what scaling buys).
PRECISIONS: dict[str, tuple[str, str]] = {
    "fp32": ("params=float32,compute=float32,output=float32", "auto"),
    "bf16": ("params=float32,compute=bfloat16,output=float32", "auto"),
    "fp16": ("params=float32,compute=float16,output=float32", "auto"),
    "fp16-noscale": ("params=float32,compute=float16,output=float32", "skip-only"),
}


DEFAULT_PRECISIONS = ("fp32", "bf16", "fp16")

# XLA:CPU in jaxlib 0.12 fuses a bf16 network's convolutions, ReLUs and reductions into one
# YNNPACK graph that computes NaN when two ReLUs share one broadcast zero (the digits ResNet's
# inference: NaN logits, eagerly 99 %); no YNNPACK fusions there, nothing changed elsewhere.
# Found 2026-12-06 on jaxlib 0.12.1; reproducer: tests/integration/test_xla_cpu_bf16.py.
XLA_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def jit_on_this_backend(fn: Callable, **kwargs: Any) -> Callable:
    """`jax.jit(fn, **kwargs)`, on XLA:CPU without its YNNPACK fusions (`XLA_CPU_OPTIONS`)."""
    if jax.default_backend() == "cpu":
        kwargs["compiler_options"] = {**XLA_CPU_OPTIONS, **kwargs.get("compiler_options", {})}
    return jax.jit(fn, **kwargs)


# --optimizer-state: the optimizer's state in float32, or by `mpjax.low_precision_state`
# in bfloat16 (rounded stochastically, "bf16", or to nearest, "bf16-nearest") or in 8 bits
# (blockwise int8 codes, rounded to nearest, "int8", or stochastically, "int8-stochastic").
OPTIMIZER_STATES = ("f32", "bf16", "bf16-nearest", "int8", "int8-stochastic")


def optimizer_with_state(
    inner: optax.GradientTransformation, optimizer_state: str
) -> optax.GradientTransformation:
    """`inner` with its state in float32 ("f32"), bfloat16 ("bf16") or 8 bits ("int8").

    Args:
      inner: the optimizer.
      optimizer_state: one of `OPTIMIZER_STATES`.

    Returns:
      `inner` itself for "f32", else `mpjax.low_precision_state(inner, dtype, ...)` with
      `dtype` bfloat16 or int8.
    """
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(
            f"unknown optimizer state {optimizer_state!r}; choose from "
            f"{', '.join(OPTIMIZER_STATES)}"
        )
    if optimizer_state == "f32":
        return inner
    dtype, rounding = {
        "bf16": (jnp.bfloat16, "stochastic"),
        "bf16-nearest": (jnp.bfloat16, "nearest"),
        "int8": (jnp.int8, "nearest"),
        "int8-stochastic": (jnp.int8, "stochastic"),
    }[optimizer_state]
    return mpjax.low_precision_state(inner, dtype, rounding=rounding)


def _check_precision(name: str) -> None:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)}")


def policy_for(precision: str) -> mpjax.Policy:
    """Returns the `mpjax.Policy` of a precision name ("fp32", "bf16", "fp16", "fp16-noscale")."""
    _check_precision(precision)
    return mpjax.get_policy(PRECISIONS[precision][0])


def loss_scale_for(
    precision: str, *, initial_scale: float = 2.0**15, growth_interval: int = 200
) -> mpjax.LossScale:
    """Returns the loss scale a precision trains with: dynamic for "fp16", none otherwise."""
    _check_precision(precision)
    if PRECISIONS[precision][1] == "skip-only":
        return mpjax.StaticLossScale(1.0)
    return mpjax.loss_scale_for(
        precision, initial_scale=initial_scale, growth_interval=growth_interval
    )


def divergence_check(precision: str) -> Callable[[Any], None] | None:
    """`train_loop`'s `check_diverged`: `raise_if_diverged` on the carry's last item.

    The carry's last item is the optimizer state. fp16 without scaling skips long runs of
    steps by design (that is what it shows), so it gets None; every other precision stops
    a run that has died.
    """
    _check_precision(precision)
    if PRECISIONS[precision][1] == "skip-only":
        return None
    return lambda carry: mpjax.raise_if_diverged(carry[-1])


@dataclasses.dataclass
class RunResult:
    """One training run.

    Attributes:
      precision: the precision name.
      seed: the run's seed.
      metric: the evaluation figure (test accuracy in %, or validation bits per byte).
      history: per-step numpy arrays: "loss" (unscaled), "loss_scale", "grads_finite",
        "skipped" (the step was skipped, for any reason), "skipped_steps".
      wall_s: wall-clock seconds of the run, compilation included.
      params: final parameters.
      opt_state: final optimiser state.
      extra: other final state (e.g. BatchNorm statistics).
    """

    precision: str
    seed: int
    metric: float
    history: dict[str, np.ndarray]
    wall_s: float
    params: Any = None
    opt_state: Any = None
    extra: Any = None

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last 10% of steps (at least one step), finite steps only."""
        loss = self.history["loss"]
        tail = loss[-max(1, len(loss) // 10) :]
        tail = tail[np.isfinite(tail)]
        return float(tail.mean()) if tail.size else math.nan

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients."""
        return int(self.history["skipped_steps"][-1])

    @property
    def final_loss_scale(self) -> float:
        """The loss scale after the last step."""
        return float(self.history["loss_scale"][-1])


def train_loop(
    step_fn: Callable[[Any, Any, jax.Array], tuple[Any, dict[str, jax.Array]]],
    carry: Any,
    batches: Iterator[Any],
    num_steps: int,
    *,
    desc: str = "",
    progress: bool = True,
    batch_fault: Callable[[int, Any], Any] | None = None,
    log_every: int = 10,
    check_diverged: Callable[[Any], None] | None = None,
) -> tuple[Any, dict[str, np.ndarray]]:
    """Runs `num_steps` steps of `step_fn` with a tqdm bar showing loss and loss scale.

    Args:
      step_fn: `(carry, batch, step) -> (carry, metrics)`, with scalar metrics "loss",
        "loss_scale", "grads_finite" and "skipped_steps".
      carry: the initial training state.
      batches: an iterator of host batches.
      num_steps: how many steps to run.
      desc: the bar's label.
      progress: whether to show the bar.
      batch_fault: optional `(step, batch) -> batch`, applied on the host before each step
        (e.g. to inject inf/NaN inputs at chosen steps).
      log_every: steps between bar refreshes (each refresh waits for the device).
      check_diverged: optional `carry -> None` run every `log_every` steps and after the
        last, e.g.
        `lambda c: mpjax.raise_if_diverged(c[-1])` to stop a dead run.

    Returns:
      `(carry, history)`, history holding one numpy array per metric.
    """
    from tqdm.auto import tqdm

    metrics: list[dict[str, jax.Array]] = []
    with tqdm(total=num_steps, desc=desc, disable=not progress, leave=True) as bar:
        for step in range(num_steps):
            batch = next(batches)
            if batch_fault is not None:
                batch = batch_fault(step, batch)
            carry, m = step_fn(carry, batch, np.int32(step))
            metrics.append(m)
            refresh = (step + 1) % log_every == 0 or step + 1 == num_steps
            if check_diverged is not None and refresh:
                check_diverged(carry)
            if progress and refresh:
                last = jax.device_get(m)
                bar.set_postfix(
                    loss=f"{float(last['loss']):.4f}",
                    scale=f"{float(last['loss_scale']):g}",
                    skipped=int(last["skipped_steps"]),
                    refresh=False,
                )
                bar.update((step + 1) - bar.n)
    history = {k: np.asarray([m[k] for m in jax.device_get(metrics)]) for k in metrics[0]}
    return carry, history


def summarise(
    results: Sequence[RunResult], metric_name: str, metric_format: str = "{:.2f}"
) -> tuple[list[str], list[list[str]]]:
    """Groups runs by precision (in first-seen order) into table rows.

    Args:
      results: the runs.
      metric_name: the metric column's header.
      metric_format: format of the metric's mean and std.

    Returns:
      `(columns, rows)`: precision, metric mean ± std over seeds, final loss, skipped
      steps (mean per run), final loss scale (mean), wall time (s, all seeds).
    """
    order: list[str] = []
    for r in results:
        if r.precision not in order:
            order.append(r.precision)
    columns = [
        "precision",
        f"{metric_name} (mean ± std)",
        "final loss",
        "skipped steps",
        "final loss scale",
        "wall time (s)",
    ]
    rows = []
    for name in order:
        runs = [r for r in results if r.precision == name]
        metric = np.array([r.metric for r in runs])
        shown = metric_format.format(metric.mean())
        if len(runs) > 1:
            shown += f" ± {metric_format.format(metric.std(ddof=1))}"
        rows.append(
            [
                name,
                f"{shown} (n={len(runs)})",
                f"{np.mean([r.final_loss for r in runs]):.4f}",
                f"{np.mean([r.skipped_steps for r in runs]):g}",
                _format_scale(float(np.mean([r.final_loss_scale for r in runs]))),
                f"{sum(r.wall_s for r in runs):.1f}",
            ]
        )
    return columns, rows


def _format_scale(scale: float) -> str:
    """`2^k` for a power of two, else the number."""
    if scale > 0 and math.isfinite(scale):
        exponent = math.log2(scale)
        if exponent == int(exponent):
            return "1" if exponent == 0 else f"2^{int(exponent)}"
    return f"{scale:g}"


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Formats a Markdown table with padded columns."""
    cells = [[str(c) for c in columns]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _smooth(x: np.ndarray, window: int) -> np.ndarray:
    x = np.where(np.isfinite(x), x, np.nan)
    if window <= 1 or len(x) < window:
        return x
    kernel = np.ones(window)
    valid = np.isfinite(x)
    num = np.convolve(np.where(valid, x, 0.0), kernel, mode="valid")
    den = np.convolve(valid.astype(float), kernel, mode="valid")
    with np.errstate(invalid="ignore", divide="ignore"):
        out = num / den
    return np.concatenate([np.full(window - 1, np.nan), out])


def plot_runs(results: Sequence[RunResult], path: str | Path, title: str) -> Path:
    """Writes a PNG: training loss per precision (left) and loss-scale trajectory (right).

    Each loss curve is the mean over the precision's seeds, smoothed over ~2% of the
    steps; the loss-scale panel shows the first seed of each precision that scales, with
    its skipped steps marked.

    Args:
      results: the runs.
      path: where to write the PNG (parent folders are created).
      title: the figure's title.

    Returns:
      The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    order: list[str] = []
    for r in results:
        if r.precision not in order:
            order.append(r.precision)

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    unscaled: list[str] = []
    styles = ("-", "--", ":", "-.")
    for i, name in enumerate(order):
        runs = [r for r in results if r.precision == name]
        loss = np.nanmean(
            np.stack(
                [np.where(np.isfinite(r.history["loss"]), r.history["loss"], np.nan) for r in runs]
            ),
            axis=0,
        )
        window = max(1, len(loss) // 50)
        steps = np.arange(1, len(loss) + 1)
        ax_loss.plot(steps, _smooth(loss, window), styles[i % len(styles)], label=name)
        first = runs[0]
        scale = first.history["loss_scale"]
        if np.all(scale == 1.0):
            unscaled.append(name)
            continue
        (line,) = ax_scale.plot(steps, scale, label=f"{name} (seed {first.seed})")
        skipped = first.history["skipped"].astype(bool)
        if skipped.any():
            ax_scale.plot(
                steps[skipped], scale[skipped], "x", color=line.get_color(), label="skipped step"
            )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (smoothed)")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_scale.set_xlabel("step")
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_yscale("log", base=2)
    scaled = [name for name in order if name not in unscaled]
    ax_scale.set_title(f"loss scale: {', '.join(scaled) or 'none'}", fontsize=9)
    if unscaled:  # a legend entry: the panel plots only the precisions that scale
        note = f"{', '.join(unscaled)}: no loss scaling (scale 1)"
        ax_scale.plot([], [], " ", label=note)
    ax_scale.legend()
    ax_scale.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Calls `fn()` and returns `(result, wall seconds)`."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_arg_parser(
    description: str, config: Any, *, seeds: int, png: str, batch_help: str
) -> argparse.ArgumentParser:
    """The command-line flags every example shares; each example adds its model's own.

    Args:
      description: the parser's description.
      config: the example's default config (its `steps`, `batch_size`, `learning_rate`,
        `weight_decay`, `initial_scale` and `growth_interval` give the defaults).
      seeds: default number of seeds per precision.
      png: default path of the plot.
      batch_help: help text of `--batch-size`.
    """
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        default=list(DEFAULT_PRECISIONS),
        choices=list(PRECISIONS),
        help="precisions to train: fp32; bf16 = params fp32, compute bf16; fp16 = compute "
        "fp16 with dynamic loss scaling; fp16-noscale = compute fp16, no loss scaling",
    )
    p.add_argument("--seeds", type=int, default=seeds, help="seeds per precision (mean ± std)")
    p.add_argument("--steps", type=int, default=config.steps, help="optimiser steps per run")
    p.add_argument("--batch-size", type=int, default=config.batch_size, help=batch_help)
    p.add_argument(
        "--lr", type=float, default=config.learning_rate, help="peak AdamW learning rate"
    )
    p.add_argument("--weight-decay", type=float, default=config.weight_decay, help="AdamW decay")
    p.add_argument(
        "--initial-scale", type=float, default=config.initial_scale, help="initial fp16 loss scale"
    )
    p.add_argument(
        "--growth-interval",
        type=int,
        default=config.growth_interval,
        help="finite steps between loss-scale doublings",
    )
    p.add_argument("--png", default=png, help="where to write the plot")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p


def run_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The shared flags as keyword arguments of an example's `run_experiment`."""
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    return dict(
        png=args.png,
        progress=not args.no_progress,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        initial_scale=args.initial_scale,
        growth_interval=args.growth_interval,
    )
