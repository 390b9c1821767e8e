"""GPU training throughput: ResNet-50 (Flax linen) under fp32, bf16 and fp16 + dynamic scaling.

On a real GPU, with synthetic ImageNet-shaped data already on the device (224x224x3, 1000
classes), SGD with momentum, BatchNorm statistics updated, the train step jitted with its
state donated:

- fp32: the model with `dtype=float32` (XLA's default matmul/conv precision, which is
  TF32 on Ampere and newer: the baseline NVIDIA quotes its mixed-precision speed-up over).
- bf16 (mpjax Policy): `mpjax.get_policy("params=float32,compute=bfloat16,output=float32")`
  turned into the model's `dtype`/`param_dtype`, logits cast with `policy.cast_to_output`.
- fp16 + dynamic scaling (mpjax): the same with `compute=float16`, the optimizer wrapped in
  `mpjax.loss_scaled` (DynamicLossScale) and the loss scaled with `mpjax.scale_loss`.
- bf16 hand-written Flax (anchor): the model written with `dtype=jnp.bfloat16` directly.

Ceilings measured on the same device: elementwise read+write bandwidth (`x + 1` on a 1 GiB
array) and bf16 matmul throughput (8192^3). Images/s are medians over interleaved rounds
with min-max; ratios are paired per round. Targets (H100/H200): bf16 >= 2.2x fp32, mpjax bf16
within 2 % of the hand-written anchor.

`python benchmarks/gpu.py` runs it (a few minutes); `--quick` uses a smaller batch and
fewer steps; `--smoke` runs a tiny ResNet on whatever device jax has (CPU included), only
to check that the script works.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpjax  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Skip,
    check_result,
    format_text,
    gpu_available,
    paired_ratio,
    summary,
    time_train_steps,
)

REQUIRES_GPU = True

FULL = {
    "stages": (3, 4, 6, 3),
    "width": 64,
    "classes": 1000,
    "image": 224,
    "batch": 256,
    "rounds": 5,
    "steps": 10,
    "copy_mib": 1024,
    "matmul_n": 8192,
}
QUICK = dict(FULL, batch=64, rounds=3, steps=5, copy_mib=256, matmul_n=4096)
SMOKE = {
    "stages": (1,),
    "width": 4,
    "classes": 10,
    "image": 16,
    "batch": 2,
    "rounds": 2,
    "steps": 2,
    "copy_mib": 4,
    "matmul_n": 256,
}


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck block (stride on the 3x3 convolution)."""

    filters: int
    strides: int = 1
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        conv = partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
        y = nn.relu(norm()(conv(self.filters, (3, 3), strides=self.strides)(y)))
        y = norm(scale_init=nn.initializers.zeros)(conv(4 * self.filters, (1, 1))(y))
        if x.shape != y.shape:
            x = norm()(conv(4 * self.filters, (1, 1), strides=self.strides)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """ResNet with bottleneck blocks; `stages=(3, 4, 6, 3)`, `width=64` is ResNet-50."""

    stages: Sequence[int]
    num_classes: int
    width: int = 64
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(
            self.width,
            (7, 7),
            strides=2,
            padding=[(3, 3), (3, 3)],
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(x)
        x = nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                x = Bottleneck(
                    self.width * 2**i,
                    strides=2 if i > 0 and j == 0 else 1,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                )(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)


def policy_model(cfg: dict, policy: mpjax.Policy) -> tuple[ResNet, Callable]:
    """The model configured from an mpjax Policy, and the cast applied to its logits."""
    model = ResNet(
        cfg["stages"],
        cfg["classes"],
        cfg["width"],
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
    )
    return model, policy.cast_to_output


def make_variant(cfg: dict, kind: str) -> tuple[Callable, Callable]:
    """(init(variables) -> state, step(state, batch) -> (state, loss)) for one variant.

    `variables` are float32 {"params", "batch_stats"} from `init_variables` (every variant
    keeps float32 params, so all start from the same values).
    """
    tx = optax.sgd(0.1, momentum=0.9)
    if kind == "fp32":
        model = ResNet(cfg["stages"], cfg["classes"], cfg["width"])
        out = lambda y: y
    elif kind == "bf16-mpjax":
        model, out = policy_model(cfg, mpjax.get_policy("p=f32,c=bf16,o=f32"))
    elif kind == "fp16-mpjax":
        model, out = policy_model(cfg, mpjax.get_policy("p=f32,c=f16,o=f32"))
        tx = mpjax.loss_scaled(tx)
    elif kind == "bf16-flax":
        model = ResNet(cfg["stages"], cfg["classes"], cfg["width"], dtype=jnp.bfloat16)
        out = lambda y: y.astype(jnp.float32)
    else:
        raise ValueError(f"unknown variant {kind!r}")
    scaled = kind == "fp16-mpjax"

    def init(variables):
        params = jax.tree.map(jnp.copy, variables["params"])
        return (params, jax.tree.map(jnp.copy, variables["batch_stats"]), tx.init(params))

    def step(state, batch):
        params, batch_stats, opt_state = state
        images, labels = batch

        def loss_fn(p):
            logits, new_vars = model.apply(
                {"params": p, "batch_stats": batch_stats},
                images,
                train=True,
                mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(out(logits), labels).mean()
            objective = mpjax.scale_loss(loss, opt_state) if scaled else loss
            return objective, (loss, new_vars["batch_stats"])

        grads, (loss, new_stats) = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_stats, opt_state), loss

    return init, step


def init_variables(cfg: dict, key: jax.Array, images: jax.Array) -> dict:
    """float32 params and batch statistics of the model (the same for every variant)."""
    model = ResNet(cfg["stages"], cfg["classes"], cfg["width"])
    return jax.jit(partial(model.init, train=False))(key, images)


VARIANTS = {
    "fp32": "fp32",
    "bf16 (mpjax Policy)": "bf16-mpjax",
    "fp16 + dynamic loss scale (mpjax)": "fp16-mpjax",
    "bf16 hand-written Flax (anchor)": "bf16-flax",
}

_CONV = re.compile(r"stablehlo\.convolution.*->\s*tensor<[^>]*x(\w+)>")


def conv_dtypes(lowered_text: str) -> dict[str, int]:
    """Result dtype -> count of the convolutions in a lowered (StableHLO) program."""
    counts: dict[str, int] = {}
    for line in lowered_text.splitlines():
        match = _CONV.search(line)
        if match:
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def ceilings(cfg: dict) -> dict[str, float]:
    """Measured elementwise read+write bandwidth (GB/s) and bf16 matmul rate (TFLOP/s)."""
    n = cfg["copy_mib"] * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    add = jax.jit(lambda v: v + 1.0)
    bandwidth = 2 * x.nbytes / _median_seconds(lambda: add(x), 20) / 1e9

    m = cfg["matmul_n"]
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (m, m), jnp.bfloat16)
    b = jax.random.normal(kb, (m, m), jnp.bfloat16)
    matmul = jax.jit(lambda p, q: p @ q)
    tflops = 2 * m**3 / _median_seconds(lambda: matmul(a, b), 20) / 1e12
    return {"bandwidth_gbs": bandwidth, "bf16_tflops": tflops}


def run(quick: bool = False, smoke: bool = False) -> dict:
    """Runs the benchmark (a GPU is required unless `smoke`)."""
    if not smoke and not gpu_available():
        raise Skip(f"needs a GPU; jax's platform here is {jax.default_backend()!r}")
    cfg = SMOKE if smoke else (QUICK if quick else FULL)
    key_i, key_l, key_p = jax.random.split(jax.random.key(0), 3)
    images = jax.random.normal(key_i, (cfg["batch"], cfg["image"], cfg["image"], 3))
    labels = jax.random.randint(key_l, (cfg["batch"],), 0, cfg["classes"])
    batch = (images, labels)

    variables = init_variables(cfg, key_p, images)
    steps, states, convs = {}, {}, {}
    for name, kind in VARIANTS.items():
        init, step = make_variant(cfg, kind)
        state = init(variables)
        lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
        convs[name] = conv_dtypes(lowered.as_text())
        steps[name], states[name] = lowered.compile(), state

    times, losses = time_train_steps(
        steps, states, batch, rounds=cfg["rounds"], steps_per_round=cfg["steps"]
    )
    limits = ceilings(cfg)

    base, anchor = "fp32", "bf16 hand-written Flax (anchor)"
    rows = []
    for name in steps:
        ips = [cfg["batch"] / t for t in times[name]]
        s = summary(ips)
        # Throughput ratios are the inverse of the paired time ratios.
        vs_fp32 = paired_ratio(times, base, name)
        vs_anchor = paired_ratio(times, anchor, name)
        total = sum(convs[name].values())
        low = sum(v for k, v in convs[name].items() if k in ("bf16", "f16"))
        rows.append(
            [
                name,
                s["median"],
                f"{s['min']:.4g}-{s['max']:.4g}",
                vs_fp32["median"],
                vs_anchor["median"],
                f"{low}/{total}",
            ]
        )
        if not np.isfinite(float(losses[name])):
            raise RuntimeError(f"gpu benchmark: {name} produced a non-finite loss")
    fp16 = "fp16 + dynamic loss scale (mpjax)"
    metrics = mpjax.scaling_metrics(states[fp16][2])
    device = jax.devices()[0]
    model_desc = (
        "ResNet-50"
        if tuple(cfg["stages"]) == (3, 4, 6, 3) and cfg["width"] == 64
        else f"tiny ResNet (stages {tuple(cfg['stages'])}, width {cfg['width']})"
    )
    notes = [
        f"{model_desc}, {cfg['image']}x{cfg['image']}x3 synthetic images on device, "
        f"{cfg['classes']} classes, batch {cfg['batch']}, SGD momentum 0.9, BatchNorm, "
        f"state donated; {cfg['rounds']} interleaved rounds of {cfg['steps']} steps.",
        f"Device: {device.device_kind} ({jax.default_backend()}).",
        f"Ceilings: elementwise read+write bandwidth {limits['bandwidth_gbs']:.1f} GB/s "
        f"(x + 1 on {cfg['copy_mib']} MiB), bf16 matmul {limits['bf16_tflops']:.2f} TFLOP/s "
        f"({cfg['matmul_n']}^3).",
        f"fp16 run: final loss scale {float(metrics['loss_scale']):g}, "
        f"{int(metrics['skipped_steps'])} skipped steps.",
        "'low-precision convs': convolutions whose result is bf16/f16 in the lowered program.",
        "Targets on H100/H200: bf16 >= 2.2x fp32; mpjax bf16 within 2 % of the anchor.",
    ]
    if smoke:
        notes.insert(0, "SMOKE RUN (tiny model; checks the script works, not a measurement).")
    return {
        "title": f"GPU training throughput: {model_desc}, fp32 vs bf16 vs fp16 + dynamic scaling",
        "columns": [
            "variant",
            "images/s (median)",
            "images/s min-max",
            "x fp32",
            "x anchor",
            "low-precision convs",
        ],
        "rows": rows,
        "notes": " ".join(notes),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batch, fewer steps")
    parser.add_argument("--smoke", action="store_true", help="tiny ResNet on any device")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = run(quick=args.quick, smoke=args.smoke)
    except Skip as exc:
        raise SystemExit(
            f"gpu.py: skipped: {exc} (use --smoke to check the script on CPU)"
        ) from None
    check_result(result)
    print(format_text(result))
    return result


if __name__ == "__main__":
    main()
