"""Train a small CNN on sklearn's digits, convert it for bf16 inference, export it, reload it.

    python examples/export_inference.py [--steps 300] [--out results/digits.mpjax]

Steps: train a Conv->BN->ReLU CNN with a residual block in float32; fold its BatchNorms
into the convolutions and cast to bfloat16 (`mpjax.convert_for_inference`); export the
converted function with `jax.export` for CPU and CUDA (lowered here, whatever the
machine); write the artifact; read it back and run it on this machine; compare test
accuracy of the three.
"""

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import mpjax  # noqa: E402
from mpjax.export import load_inference, serialize_inference  # noqa: E402


class DigitsCNN(nn.Module):
    """Conv->BN->ReLU stem, a residual block, global average pool, Dense head."""

    width: int = 32
    momentum: float = 0.9

    @nn.compact
    def __call__(self, x, train=False):
        bn = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=self.momentum)
        x = nn.relu(bn()(nn.Conv(self.width, (3, 3), use_bias=False)(x)))
        y = nn.relu(bn()(nn.Conv(self.width, (3, 3), use_bias=False)(x)))
        y = bn()(nn.Conv(self.width, (3, 3))(y))  # with a bias of its own
        x = nn.relu(x + y)
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def train(
    steps: int, *, width: int = 32, momentum: float = 0.9, lr: float = 3e-3, log: bool = True
):
    """Trains a `DigitsCNN` on sklearn's digits (80/20 split); returns the model, its
    variables and the held-out `(x, y)`."""
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n = int(0.8 * len(x))
    model = DigitsCNN(width=width, momentum=momentum)
    variables = model.init(jax.random.key(0), x[:2])
    tx = optax.adam(lr)
    opt_state = tx.init(variables["params"])

    @jax.jit
    def step(params, stats, opt_state, xb, yb):
        def loss_fn(p):
            logits, upd = model.apply(
                {"params": p, "batch_stats": stats}, xb, train=True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
            return loss, upd["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    params, stats = variables["params"], variables["batch_stats"]
    rng = np.random.default_rng(1)
    for i in range(steps):
        idx = rng.integers(0, n, 128)
        params, stats, opt_state, loss = step(params, stats, opt_state, x[idx], y[idx])
        if log and (i + 1) % 100 == 0:
            print(f"step {i + 1}: loss {float(loss):.4f}")
    return model, {"params": params, "batch_stats": stats}, (x[n:], y[n:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--policy", default="compute=bfloat16")
    parser.add_argument("--out", default="results/digits.mpjax", help="the artifact to write")
    args = parser.parse_args()

    model, variables, (x_test, y_test) = train(args.steps)
    converted = mpjax.convert_for_inference(
        model, variables, args.policy, example_inputs=x_test[:1], apply_kwargs={"train": False}
    )
    for lin, bn in converted.report.folded:
        print(f"folded {bn} into {lin}")
    for bn, why in converted.report.unfolded:
        print(f"kept {bn}: {why}")

    blob = serialize_inference(
        converted, x_test[:1], platforms=("cpu", "cuda"), polymorphic_batch=True
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(blob)
    loaded = load_inference(Path(args.out).read_bytes())
    print(f"wrote {args.out} ({len(blob)} bytes) for platforms {loaded.platforms}")

    def accuracy(logits):
        return float(np.mean(np.argmax(np.asarray(logits, np.float32), -1) == y_test))

    nbytes = lambda t: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(t))
    print(f"variables: {nbytes(variables)} bytes float32 -> {nbytes(converted.variables)} bytes")
    print(f"float32 accuracy:   {accuracy(jax.jit(model.apply)(variables, x_test)):.4f}")
    logits = jax.jit(converted.apply)(converted.variables, x_test)
    print(f"converted accuracy: {accuracy(logits):.4f}")
    if jax.default_backend() in loaded.platforms:
        print(f"reloaded accuracy:  {accuracy(loaded(x_test)):.4f} (on {jax.default_backend()})")


if __name__ == "__main__":
    main()
