"""fp16 without loss scaling loses gradients to underflow; dynamic loss scaling recovers fp32.

The digits ResNet of `train_digits.py` is trained with its loss multiplied by a small
constant (2^-14 by default). That changes nothing for float32 (AdamW is invariant to the
gradients' scale), but pushes many fp16 gradients below fp16's smallest subnormal
(2^-24 ~ 6e-8), where they flush to zero: the regime of large networks whose gradients
are small, as in Micikevicius et al. 2018, fig. 3. fp16 with dynamic loss scaling
multiplies the loss back up before the fp16 backward pass and divides the gradients in
float32 afterwards.

Run from the repository root:

    python examples/underflow_demo.py              # table + results/underflow.png
    python examples/underflow_demo.py --plot docs/_static/gradient_histogram.png
                                                   # the gradients' log2 histogram only
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples.common import RunResult, format_table, plot_runs, summarise
from examples.train_digits import (
    DigitsConfig,
    DigitsData,
    build_model,
    load_data,
    make_train_fns,
    train,
)

__all__ = [
    "DEFAULT_MULTIPLIER",
    "gradient_underflow",
    "gradients",
    "main",
    "plot_gradient_histogram",
    "run_experiment",
]

DEFAULT_MULTIPLIER = 2.0**-14
PRECISIONS = ("fp32", "fp16", "fp16-noscale")


def _gradients(
    config: DigitsConfig, params, batch_stats, x, y, loss_scale: float
) -> list[np.ndarray]:
    model = build_model(config)

    def loss(p):
        logits, _ = model.apply(
            {"params": p, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return ce.mean() * config.loss_multiplier * jnp.float32(loss_scale)

    grads = jax.jit(jax.grad(loss))(params)
    return [np.asarray(g, np.float64) / loss_scale for g in jax.tree.leaves(grads)]


def gradients(
    precision: str,
    loss_multiplier: float,
    data: DigitsData,
    *,
    loss_scale: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
    **config_kwargs,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The float32 gradient and `precision`'s, at the same initial parameters and batch.

    Args:
      precision: a precision name of `examples.common.PRECISIONS`.
      loss_multiplier: constant the loss is multiplied by.
      data: the digits split.
      loss_scale: the loss is also multiplied by this and the gradients divided by it
        (in float64) afterwards, as loss scaling does.
      batch_size: examples in the batch.
      seed: seeds the initialisation.
      **config_kwargs: further `DigitsConfig` fields (e.g. `width`).

    Returns:
      `(reference, low)`: the leaves (float64 NumPy, divided by `loss_scale`) of the float32
      gradient and of the gradient under `precision`.
    """
    ref_cfg = DigitsConfig(precision="fp32", loss_multiplier=loss_multiplier, **config_kwargs)
    cfg = DigitsConfig(precision=precision, loss_multiplier=loss_multiplier, **config_kwargs)
    x, y = data.x_train[:batch_size], data.y_train[:batch_size]
    variables = build_model(ref_cfg).init(jax.random.key(seed), x[:1])
    params, stats = variables["params"], variables["batch_stats"]
    ref = _gradients(ref_cfg, params, stats, x, y, 1.0)
    return ref, _gradients(cfg, params, stats, x, y, loss_scale)


def gradient_underflow(
    precision: str, loss_multiplier: float, data: DigitsData, **kwargs
) -> tuple[float, float]:
    """Measures how many gradient entries `precision` loses to underflow, against float32.

    Both gradients are taken at the same freshly initialised parameters on the same batch.

    Args: as `gradients` (`loss_scale`, `batch_size`, `seed` and `DigitsConfig` fields go in
      `kwargs`).

    Returns:
      `(flushed, rel_error)`: the fraction of the float32 gradient's nonzero entries that
      are exactly zero under `precision`, and the relative L2 error of the whole gradient.
    """
    ref, low = gradients(precision, loss_multiplier, data, **kwargs)
    nonzero = sum(int((r != 0).sum()) for r in ref)
    flushed = sum(int(((r != 0) & (g == 0)).sum()) for r, g in zip(ref, low, strict=True))
    err = np.sqrt(sum(((r - g) ** 2).sum() for r, g in zip(ref, low, strict=True)))
    norm = np.sqrt(sum((r**2).sum() for r in ref))
    return flushed / max(nonzero, 1), float(err / norm)


def run_experiment(
    seeds: int = 1,
    *,
    loss_multiplier: float = DEFAULT_MULTIPLIER,
    png: str | Path | None = "results/underflow.png",
    progress: bool = True,
    **config_kwargs,
) -> tuple[list[RunResult], str]:
    """Trains fp32, fp16 (dynamic loss scaling) and fp16-noscale with a scaled-down loss.

    Args:
      seeds: seeds per precision.
      loss_multiplier: constant the loss is multiplied by.
      png: where to write the loss / loss-scale plot; None writes none.
      progress: show a tqdm bar per run.
      **config_kwargs: further `DigitsConfig` fields.

    Returns:
      `(runs, markdown_table)`; the table adds the gradient underflow measured at
      initialisation (`gradient_underflow`) to the usual columns.
    """
    data = load_data()
    results = []
    for precision in PRECISIONS:
        config = DigitsConfig(precision=precision, loss_multiplier=loss_multiplier, **config_kwargs)
        fns = make_train_fns(config)
        for seed in range(seeds):
            results.append(train(config, seed, data=data, fns=fns, progress=progress))
    columns, rows = summarise(results, "test accuracy %")
    columns = columns + ["grads flushed to 0 at init", "grad rel. error at init"]
    initial_scale = DigitsConfig().initial_scale
    for row in rows:
        scale = initial_scale if row[0] == "fp16" else 1.0
        flushed, err = gradient_underflow(
            row[0], loss_multiplier, data, loss_scale=scale, **config_kwargs
        )
        row += [f"{flushed:.1%}", f"{err:.2g}"]
    table = format_table(columns, rows)
    if png is not None:
        exponent = np.log2(loss_multiplier)
        shown = f"2^{exponent:g}" if exponent == round(exponent) else f"{loss_multiplier:g}"
        plot_runs(results, png, f"digits ResNet, loss x {shown}: fp16 gradients underflow")
    return results, table


def plot_gradient_histogram(
    png: str | Path,
    *,
    loss_multiplier: float = DEFAULT_MULTIPLIER,
    loss_scale: float = 2.0**15,
    data: DigitsData | None = None,
    **config_kwargs,
):
    """Writes the log2 histogram of the float32 gradient against fp16's range (`mpjax.numerics`).

    Two panels: the gradient of the multiplied loss, and the same times `loss_scale` (what
    the float16 backward pass sees under loss scaling).

    Returns:
      The `mpjax.numerics` result of the two panels (paths "unscaled" and "scaled").
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import mpjax

    ref, _ = gradients("fp32", loss_multiplier, data or load_data(), **config_kwargs)
    flat = np.concatenate([r.ravel() for r in ref]).astype(np.float32)
    result = mpjax.numerics(
        {"unscaled": flat, "scaled": flat * np.float32(loss_scale)}, formats=("float16", "bfloat16")
    )
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    exponent = np.log2(loss_multiplier)
    for ax, path, label in zip(
        axes,
        ("unscaled", "scaled"),
        (f"loss x 2^{exponent:g}", f"x loss scale 2^{np.log2(loss_scale):g}"),
        strict=True,
    ):
        r = result[path]
        title = (
            f"digits ResNet gradient, {label}: {r.underflow['float16']:.1%} flush to 0, "
            f"{r.subnormal['float16']:.1%} subnormal in float16"
        )
        result.plot(path, ax=ax, title=title)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return result


def _parser() -> argparse.ArgumentParser:
    d = DigitsConfig()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--loss-multiplier",
        type=float,
        default=DEFAULT_MULTIPLIER,
        help="constant the loss is multiplied by (smaller: more fp16 underflow)",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per precision (mean ± std)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps per run")
    p.add_argument("--width", type=int, default=d.width, help="convolution channels")
    p.add_argument("--blocks", type=int, default=d.num_blocks, help="residual blocks")
    p.add_argument("--png", default="results/underflow.png", help="where to write the plot")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--plot", help="only write the gradients' log2 histogram (mpjax.numerics) here")
    return p


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    """Command-line entry point: trains, prints the table, writes the PNG."""
    p = _parser()
    args = p.parse_args(argv)
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    if not args.loss_multiplier > 0:
        raise SystemExit(f"--loss-multiplier must be > 0, got {args.loss_multiplier}")
    model = {"width": args.width, "num_blocks": args.blocks}
    if args.plot:
        result = plot_gradient_histogram(args.plot, loss_multiplier=args.loss_multiplier, **model)
        print(result)
        print(f"\nwrote {args.plot}")
        return []
    results, table = run_experiment(
        args.seeds,
        loss_multiplier=args.loss_multiplier,
        png=args.png,
        progress=not args.no_progress,
        steps=args.steps,
        **model,
    )
    print()
    print(table)
    print(f"\nwrote {args.png}")
    return results


if __name__ == "__main__":
    main()
