"""Inference conversion: latency and compiled bytes accessed, original float32 vs converted.

A small ResNet (Conv->BN->ReLU stem, residual blocks with projection shortcuts, global
pool, Dense head) with random weights and non-trivial BatchNorm statistics, run in
inference mode on the default backend. Variants, all jitted, timed in alternation:

- original: `model.apply(variables, x, train=False)` in float32 (BatchNorm on running stats);
- fold f32: `convert_for_inference(..., "f32")`: BatchNorms folded, float32;
- cast bf16: `convert_for_inference(..., "compute=bfloat16", fold_batchnorm=False)`;
- fold bf16: `convert_for_inference(..., "compute=bfloat16")`: folded and bfloat16.

The same network built from `mpjax.nn.ConvBN` layers is measured too (original f32 vs
fold bf16, where the folded shift + residual + activation run in `conv_epilogue`: its
Pallas kernel on CUDA, XLA elsewhere).

Ratios are against `original f32` in the same run (latency: paired per round). Bytes
accessed are XLA's compiled cost analysis of the whole forward pass (weights +
activations).

Run: `python benchmarks/run.py --only inference` (the benchmark suite; `--quick` for tiny sizes).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mpjax  # noqa: E402
from benchmarks.common import (  # noqa: E402
    cost_analysis,
    interleaved_times,
    paired_ratio,
    summary,
)
from mpjax.nn import ConvBN  # noqa: E402


class _Block(nn.Module):
    features: int
    strides: int = 1
    convbn: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        s = (self.strides, self.strides)
        if self.convbn:  # the same block from mpjax.nn.ConvBN layers
            cb = functools.partial(ConvBN, use_running_average=not train)
            y = cb(self.features, strides=s)(x)
            if x.shape[-1] != self.features or self.strides != 1:
                x = cb(self.features, (1, 1), strides=s, activation="none")(x)
            return cb(self.features)(y, residual=x)
        bn = functools.partial(nn.BatchNorm, use_running_average=not train)
        y = nn.relu(bn()(nn.Conv(self.features, (3, 3), s, use_bias=False)(x)))
        y = bn()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
        if x.shape[-1] != self.features or self.strides != 1:
            x = bn()(nn.Conv(self.features, (1, 1), s, use_bias=False)(x))
        return nn.relu(x + y)


class SmallResNet(nn.Module):
    """Stem, `len(widths)` residual stages, global average pool, Dense head."""

    widths: tuple[int, ...] = (16, 32)
    classes: int = 10
    convbn: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        if self.convbn:
            x = ConvBN(self.widths[0], use_running_average=not train)(x)
        else:
            x = nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        for i, w in enumerate(self.widths):
            x = _Block(w, strides=1 if i == 0 else 2, convbn=self.convbn)(x, train)
            x = _Block(w, convbn=self.convbn)(x, train)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def _random_variables(model, x, seed=0):
    rng = np.random.default_rng(seed)
    variables = model.init(jax.random.key(seed), x)

    def leaf(path, v):
        name = path[-1].key
        if name == "var":
            return jnp.asarray(rng.uniform(0.3, 3.0, v.shape), v.dtype)
        if name == "mean":
            return jnp.asarray(rng.normal(0.0, 0.5, v.shape), v.dtype)
        return v

    return jax.tree_util.tree_map_with_path(leaf, variables)


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def run(quick: bool = False) -> dict:
    """Times and measures the original and converted models; returns the table."""
    if quick:
        batch, size, widths, repeats, iters = 8, 16, (16, 32), 5, 5
    else:
        batch, size, widths, repeats, iters = 32, 32, (32, 64, 128), 9, 10
    x = jnp.asarray(np.random.default_rng(1).normal(size=(batch, size, size, 3)), jnp.float32)
    eval_kw = {"train": False}
    # name -> (jitted fn, variables, baseline name)
    variants: dict[str, tuple] = {}
    for label, convbn, specs in (
        (
            "nn.Conv+BatchNorm",
            False,
            {
                "fold f32": ("f32", True),
                "cast bf16 (no fold)": ("compute=bfloat16", False),
                "fold bf16": ("compute=bfloat16", True),
            },
        ),
        ("mpjax ConvBN", True, {"fold bf16": ("compute=bfloat16", True)}),
    ):
        model = SmallResNet(widths, convbn=convbn)
        variables = _random_variables(model, x[:1])
        base = f"{label}: original f32"
        variants[base] = (jax.jit(functools.partial(model.apply, **eval_kw)), variables, base)
        for name, (policy, fold) in specs.items():
            conv = mpjax.convert_for_inference(
                model,
                variables,
                policy,
                example_inputs=x[:1],
                fold_batchnorm=fold,
                apply_kwargs=eval_kw,
            )
            variants[f"{label}: {name}"] = (jax.jit(conv.apply), conv.variables, base)

    times = interleaved_times(
        {name: functools.partial(fn, v, x) for name, (fn, v, _) in variants.items()},
        rounds=repeats,
        steps_per_round=iters,
    )
    accessed = {
        name: cost_analysis(fn, v, x)["bytes accessed"] for name, (fn, v, _) in variants.items()
    }
    rows = []
    for name, (_, v, base) in variants.items():
        ms = summary([t * 1e3 for t in times[name]])
        rows.append(
            [
                name,
                ms["median"],
                f"{ms['min']:.3f}-{ms['max']:.3f}",
                paired_ratio(times, name, base)["median"],
                int(accessed[name]),
                accessed[name] / accessed[base],
                _nbytes(v),
                _nbytes(v) / _nbytes(variants[base][1]),
            ]
        )
    backend = jax.default_backend()
    return {
        "title": f"Inference conversion on {backend} ({jax.devices()[0].device_kind}): "
        f"SmallResNet{widths}, batch {batch}, {size}x{size}x3",
        "columns": [
            "variant",
            "latency ms (median)",
            "min-max ms",
            "latency ratio",
            "bytes accessed",
            "bytes ratio",
            "variable bytes",
            "variable ratio",
        ],
        "rows": rows,
        "notes": (
            f"{repeats} interleaved rounds of {iters} jitted calls each; latency ratio: median "
            "of per-round ratios vs the same model's 'original f32' in the same run. "
            "Bytes accessed: XLA compiled cost analysis of the forward pass. "
            "Variable bytes: all collections (params + batch_stats). XLA:CPU runs a bf16 "
            "convolution by converting its operands to f32 and the result back (see the "
            "compiled HLO), so on CPU bf16 adds converts and bytes; the bf16 speed-up is a "
            "GPU/TPU effect. "
            "Run on a GPU machine to get the GPU figures (same script)."
        ),
    }
