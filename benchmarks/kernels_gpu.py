"""GPU timing of the mpjax Pallas kernels against the XLA path and a device-to-device copy.

On a GPU (`jax.default_backend() == "gpu"`) it times, alternating the implementations round by
round: a device-to-device copy (the bandwidth reference), `unscale_and_check` over ResNet-50's
161 gradient leaves, `conv_epilogue` forward and backward and `channel_stats` on a ResNet-50
activation, each as "pallas" vs "xla", and a ResNet-50 training step built from `mpjax.nn.ConvBN`
in float32 and bfloat16, with the Pallas kernels ("auto") and without ("xla"). Finishes in one
call of a few minutes (mostly compilation).

Without a GPU (or with `--smoke`) it runs the same code on tiny shapes with the kernels in Pallas
interpret mode: a check that the script works, not a measurement.

    python benchmarks/run.py --only kernels-gpu   # on a GPU machine
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mpjax  # noqa: E402
from mpjax.nn import ConvBN  # noqa: E402
from mpjax.pallas import channel_stats, conv_epilogue, unscale_and_check  # noqa: E402

TITLE = "mpjax Pallas kernels vs XLA on the GPU"
COLUMNS = [
    "case",
    "impl",
    "ms median",
    "ms min-max",
    "GB/s",
    "% of copy",
    "images/s",
    "xla time / this",
]

# ResNet-50's stages: (bottleneck width, blocks, stride). Its conv kernels, a BatchNorm scale and
# bias per conv and the classifier make 161 gradient leaves.
STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))
TINY_STAGES = ((64, 1, 1), (128, 1, 2))  # smoke runs


def _resnet50_grad_shapes(width: int = 1, stages=STAGES) -> list[tuple[int, ...]]:
    shapes = [(7, 7, 3, 64 // width), (64 // width,), (64 // width,)]
    cin = 64 // width
    for f, blocks, _ in stages:
        f //= width
        for b in range(blocks):
            convs = [(1, 1, cin, f), (3, 3, f, f), (1, 1, f, 4 * f)]
            if b == 0:
                convs.append((1, 1, cin, 4 * f))
            for k in convs:
                shapes += [k, (k[-1],), (k[-1],)]
            cin = 4 * f
    return shapes + [(cin, 1000 // width), (1000 // width,)]


class ResNet50(nn.Module):
    """ResNet-50 (v1.5) of `ConvBN` layers, NHWC; a ConvBN takes the residual add + ReLU."""

    num_classes: int = 1000
    width: int = 1
    stages: tuple = STAGES
    dtype: object = jnp.float32
    impl: str = "auto"

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(
            ConvBN, dtype=self.dtype, impl=self.impl, use_running_average=not train, momentum=0.9
        )
        x = conv(64 // self.width, (7, 7), strides=2)(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for f, blocks, stride in self.stages:
            f //= self.width
            for b in range(blocks):
                s = stride if b == 0 else 1
                shortcut = x
                if b == 0:
                    shortcut = conv(4 * f, (1, 1), strides=s, activation="none")(x)
                y = conv(f, (1, 1))(x)
                y = conv(f, (3, 3), strides=s)(y)
                x = conv(4 * f, (1, 1))(y, shortcut)
        x = jnp.mean(x.astype(jnp.float32), axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=jnp.float32)(x)


def _timed(fns: dict, args: tuple, rounds: int, iters: int) -> dict:
    """Per-call seconds of each function, alternating the functions round by round."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / iters)
    return times


def _rows(case: str, times: dict, nbytes: int | None, copy_gbs: float | None, batch=None) -> list:
    rows = []
    xla = statistics.median(times["xla"]) if "xla" in times else None
    for impl, t in times.items():
        med = statistics.median(t)
        gbs = nbytes / med / 1e9 if nbytes else None
        rows.append(
            [
                case,
                impl,
                round(med * 1e3, 4),
                f"{min(t) * 1e3:.4f}-{max(t) * 1e3:.4f}",
                "" if gbs is None else round(gbs, 1),
                "" if gbs is None or not copy_gbs else round(100 * gbs / copy_gbs, 1),
                "" if batch is None else round(batch / med, 1),
                "" if xla is None else round(xla / med, 3),
            ]
        )
    return rows


def _nbytes(*trees) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trees))


def run(quick: bool = False, smoke: bool = False) -> dict:
    """Times the kernels; see the module docstring. quick/smoke: tiny shapes."""
    on_gpu = jax.default_backend() == "gpu"
    small = quick or smoke or not on_gpu
    kernel_impl = "pallas" if on_gpu and not smoke else "interpret"
    rounds, iters = (2, 2) if small else (7, 20)
    rng = np.random.default_rng(0)
    rows = []

    # Device-to-device copy: the bandwidth reference (read + write).
    x = jnp.asarray(rng.standard_normal(2**14 if small else 2**28), jnp.float32)
    copy = jax.jit(lambda x: jnp.copy(x))
    copy_times = _timed({"xla": copy}, (x,), rounds, iters)
    copy_gbs = 2 * x.nbytes / statistics.median(copy_times["xla"]) / 1e9
    rows += _rows(f"copy f32[{x.size}]", {"copy": copy_times["xla"]}, 2 * x.nbytes, copy_gbs)

    # unscale_and_check over ResNet-50's gradient leaves, bfloat16 in, float32 out.
    shapes = _resnet50_grad_shapes(*((16, TINY_STAGES) if small else (1, STAGES)))
    grads = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes]
    fns = {
        impl: jax.jit(functools.partial(unscale_and_check, impl=impl))
        for impl in (kernel_impl, "xla")
    }
    times = _timed(fns, (grads, jnp.float32(2.0**15)), rounds, iters)
    nbytes = _nbytes(grads) + sum(g.size * 4 for g in grads)
    rows += _rows(f"unscale_and_check {len(grads)} bf16 leaves", times, nbytes, copy_gbs)

    # conv_epilogue and channel_stats on a ResNet-50 stage-1 activation, bfloat16.
    shape = (2, 8, 8, 24) if small else (128, 56, 56, 256)
    y, res, cot = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(3))
    scale = jnp.asarray(rng.uniform(0.5, 2, shape[-1]), jnp.float32)
    shift = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    act_bytes = y.nbytes

    def fwd(impl):
        return jax.jit(functools.partial(conv_epilogue, activation="relu", impl=impl))

    def bwd(impl):
        f = functools.partial(conv_epilogue, activation="relu", impl=impl)
        return jax.jit(lambda y, s, b, r, g: jax.vjp(f, y, s, b, r)[1](g))

    def stats(impl):
        return jax.jit(functools.partial(channel_stats, impl=impl))

    impls = (kernel_impl, "xla")
    args = (y, scale, shift, res)
    rows += _rows(
        f"conv_epilogue fwd bf16{list(shape)} +res relu",
        _timed({i: fwd(i) for i in impls}, args, rounds, iters),
        3 * act_bytes,
        copy_gbs,
    )
    rows += _rows(
        f"conv_epilogue bwd bf16{list(shape)} +res relu",
        _timed({i: bwd(i) for i in impls}, (*args, cot), rounds, iters),
        5 * act_bytes,
        copy_gbs,
    )
    rows += _rows(
        f"channel_stats bf16{list(shape)}",
        _timed({i: stats(i) for i in impls}, (y,), rounds, iters),
        act_bytes,
        copy_gbs,
    )
    rows += _resnet_rows(small, on_gpu and not smoke, rounds, iters)
    where = jax.devices()[0].device_kind
    notes = (
        f"device: {where}; jax {jax.__version__}; medians of {rounds} alternating rounds of "
        f"{iters} calls. GB/s counts the bytes each op must move (reads + writes); % of copy "
        "is against the measured device-to-device copy above; 'xla time / this' > 1 means "
        "faster than the XLA path."
    )
    if kernel_impl == "interpret":
        notes = (
            "SMOKE RUN, NOT A MEASUREMENT: no GPU here (or --smoke), tiny shapes, kernels in "
            "Pallas interpret mode. " + notes
        )
    return {"title": TITLE, "columns": COLUMNS, "rows": rows, "notes": notes}


def _resnet_rows(small: bool, on_gpu: bool, rounds: int, iters: int) -> list:
    """ResNet-50 training steps: f32 / bf16 compute, with ("auto") and without ("xla") kernels."""
    batch, size, width, classes = (2, 16, 16, 10) if small else (64, 224, 1, 1000)
    stages = TINY_STAGES if small else STAGES
    rng = np.random.default_rng(1)
    images = jnp.asarray(rng.standard_normal((batch, size, size, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, classes, batch))
    fused = "auto" if on_gpu else "interpret"
    rows = []
    dtypes = ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))
    for dtype, name in dtypes[1:] if small else dtypes:  # smoke runs: bf16 only
        steps = {}
        state = None
        for impl in (fused, "xla"):
            model = ResNet50(classes, width=width, stages=stages, dtype=dtype, impl=impl)
            check = functools.partial(unscale_and_check, impl=impl)
            tx = mpjax.loss_scaled(optax.sgd(0.1, momentum=0.9), unscale_and_check=check)
            if state is None:
                variables = jax.jit(functools.partial(model.init, train=False))(
                    jax.random.key(0), images
                )
                state = (variables["params"], variables["batch_stats"])
                state = (*state, tx.init(state[0]))

            def step(params, batch_stats, opt_state, images, labels, model=model, tx=tx):
                def loss_fn(p):
                    logits, upd = model.apply(
                        {"params": p, "batch_stats": batch_stats},
                        images,
                        mutable=["batch_stats"],
                    )
                    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
                    return mpjax.scale_loss(loss.mean(), opt_state), upd["batch_stats"]

                grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), new_stats, opt_state

            steps[impl] = jax.jit(step)
        times = _timed(steps, (*state, images, labels), rounds, max(1, iters // 4))
        net = "ResNet-50" if stages == STAGES else "ResNet (2 stages of 1 block)"
        case = f"{net} train step {name}, {batch}x{size}x{size}"
        rows += _rows(case, times, None, None, batch=batch)
    return rows
