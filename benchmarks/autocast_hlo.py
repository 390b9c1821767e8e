"""HLO of `mpjax.autocast` vs a hand-written Flax `dtype=bfloat16` model (forward + backward).

For a ResNet-style CNN (Conv, BatchNorm, Dense) and a transformer block (attention, LayerNorm,
MLP), the jitted `value_and_grad` of a cross-entropy / regression loss is lowered and compiled
for each variant:

* `flax bf16`: the same modules written with `dtype=bfloat16, param_dtype=float32`;
* `autocast`: the float32 model under `mpjax.autocast` with the default `OpLists`;
* `autocast, acc=None`: the same with `accumulation_dtype=None` (no explicit float32
  accumulation; the backend's own);
* `autocast, no epilogue`: the plain widest-input rule (`OpLists(epilogue=frozenset())`);
* `float32`: the model as written.

`--quick` measures tiny models and only `flax bf16`, `autocast` and `float32`.

Columns: matmuls (dot_general + convolution) with low-precision operands out of all, in the
lowered StableHLO (backend independent); convert ops in the lowered StableHLO and in the
optimised HLO of this backend; XLA's `bytes accessed` and temp memory of the compiled program,
and step time (median and min-max of alternating runs), each also as a ratio to `flax bf16`.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mpjax import OpLists, autocast  # noqa: E402

BF16 = jnp.bfloat16


class ResNetish(nn.Module):
    """Conv-BN-ReLU stem, one residual block of two Conv-BN, global pool, Dense head."""

    width: int
    classes: int = 10
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        conv = lambda: nn.Conv(self.width, (3, 3), use_bias=False, dtype=self.dtype)  # noqa: E731
        norm = lambda: nn.BatchNorm(use_running_average=False, dtype=self.dtype)  # noqa: E731
        x = nn.relu(norm()(conv()(x)))
        h = nn.relu(norm()(conv()(x)))
        h = norm()(conv()(h))
        x = nn.relu(x + h)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, dtype=self.dtype)(x)


class Block(nn.Module):
    """Pre-LN transformer block: LayerNorm, attention, LayerNorm, GELU MLP."""

    heads: int
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(h, h)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.gelu(nn.Dense(4 * d, dtype=self.dtype)(h))
        return x + nn.Dense(d, dtype=self.dtype)(h)


def _cnn_case(quick: bool):
    n, hw, c, width = (4, 8, 3, 8) if quick else (32, 32, 3, 64)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (n, hw, hw, c))
    labels = jax.random.randint(k2, (n,), 0, 10)
    variables = jax.jit(ResNetish(width).init)(k3, x)

    def make_loss(model):
        def loss(params, batch_stats, x):
            logits, _ = model.apply(
                {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
            )
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

        return loss

    args = (variables["params"], variables["batch_stats"], x)
    return make_loss(ResNetish(width)), make_loss(ResNetish(width, dtype=BF16)), args


def _block_case(quick: bool):
    n, seq, d, heads = (2, 8, 16, 2) if quick else (8, 128, 256, 4)
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k1, (n, seq, d))
    target = jax.random.normal(k2, (n, seq, d))
    params = jax.jit(Block(heads).init)(k3, x)["params"]

    def make_loss(model):
        def loss(params, x):
            out = model.apply({"params": params}, x)
            return jnp.mean((out.astype(jnp.float32) - target) ** 2)

        return loss

    return make_loss(Block(heads)), make_loss(Block(heads, dtype=BF16)), (params, x)


_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*([a-z]+[0-9]*)>")


def _stablehlo_counts(text: str) -> tuple[int, int, int]:
    """(low-precision matmuls, all matmuls, converts) in lowered StableHLO text."""
    low = total = converts = 0
    for line in text.splitlines():
        if "stablehlo.convert" in line:
            converts += 1
        if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
            total += 1
            operand_types = _TYPE.findall(line.rsplit(":", 1)[-1].split("->")[0])
            if operand_types and all(t in ("bf16", "f16") for t in operand_types):
                low += 1
    return low, total, converts


def _optimized_converts(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.search(r"\sconvert\(", line))


def _cost(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("bytes accessed", float("nan")))


def _time(fns, args, reps: int) -> list[list[float]]:
    """Alternating A/B/... timings of already-compiled functions, seconds per call."""
    for fn in fns:  # warm-up
        jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - start)
    return times


def run(quick: bool = False) -> dict:
    """Measures every variant on both models; returns the benchmark table."""
    rows = []
    reps = 3 if quick else 15
    for model_name, case in (("ResNet-style CNN", _cnn_case), ("transformer block", _block_case)):
        loss32, loss_flax_bf16, args = case(quick)
        variants = {"flax bf16": loss_flax_bf16, "autocast": autocast(loss32)}
        if not quick:
            variants["autocast, acc=None"] = autocast(loss32, accumulation_dtype=None)
            variants["autocast, no epilogue"] = autocast(
                loss32, op_lists=OpLists(epilogue=frozenset())
            )
        variants["float32"] = loss32
        stats, compiled_fns = {}, []
        for name, loss in variants.items():
            step = jax.jit(jax.value_and_grad(loss))
            lowered = step.lower(*args)
            compiled = lowered.compile()
            low, total, converts = _stablehlo_counts(lowered.as_text())
            stats[name] = {
                "matmuls": f"{low}/{total}",
                "converts": converts,
                "opt_converts": _optimized_converts(compiled.as_text()),
                "bytes": _cost(compiled),
                "temp": float(compiled.memory_analysis().temp_size_in_bytes),
            }
            compiled_fns.append(compiled)
        times = _time(compiled_fns, args, reps)
        base = stats["flax bf16"]
        base_time = float(np.median(times[0]))
        for (name, s), t in zip(stats.items(), times, strict=True):
            med = float(np.median(t))
            rows.append(
                [
                    model_name,
                    name,
                    s["matmuls"],
                    s["converts"],
                    s["opt_converts"],
                    int(s["bytes"]),
                    round(s["bytes"] / base["bytes"], 3),
                    int(s["temp"]),
                    round(s["temp"] / base["temp"], 3) if base["temp"] else float("nan"),
                    f"{med * 1e3:.2f} ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f})",
                    round(med / base_time, 3),
                ]
            )
    return {
        "title": "autocast vs hand-written Flax bf16: forward+backward HLO"
        + (" (quick sizes)" if quick else ""),
        "columns": [
            "model",
            "variant",
            "low-precision matmuls (StableHLO)",
            "converts (StableHLO)",
            f"converts (optimised {jax.default_backend()} HLO)",
            "bytes accessed",
            "bytes ratio vs flax bf16",
            "temp bytes",
            "temp ratio vs flax bf16",
            "step ms median (min-max)",
            "time ratio vs flax bf16",
        ],
        "rows": rows,
        "notes": (
            f"backend {jax.default_backend()}; jitted value_and_grad w.r.t. float32 params; "
            f"{reps} alternating timing runs per variant. A CPU backend upcasts bf16 matmuls "
            "to float32 in its optimised HLO, so the low-precision matmul count is read from "
            "the lowered StableHLO. autocast keeps softmax, norm statistics and the loss in "
            "float32 by design (flax bf16 runs its softmax in bf16), which costs bytes."
        ),
    }
