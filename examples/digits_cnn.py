"""The digits data, a small CNN and the precision set-ups the data-parallel example trains with.

Kept apart from the data-parallel code so another model can be swapped in at `make_model`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax

PRECISIONS = {
    "fp32": "params=float32,compute=float32,output=float32",
    "bf16": "params=bfloat16,compute=bfloat16,output=float32",
    "fp16": "params=float16,compute=float16,output=float32",
}


def precision_policy(precision: str) -> mpjax.Policy:
    """The mpjax `Policy` of a ``--precision`` name (fp32, bf16, fp16)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return mpjax.get_policy(PRECISIONS[precision])


def default_loss_scale(precision: str) -> mpjax.LossScale:
    """Dynamic loss scaling for fp16; bf16 and fp32 have the range of fp32 and need none."""
    precision_policy(precision)
    return mpjax.DynamicLossScale() if precision == "fp16" else mpjax.NoOpLossScale()


def flax_dtypes(policy: mpjax.Policy) -> dict[str, Any]:
    """The Flax ``dtype``/``param_dtype`` fields a policy sets (until `mpjax.apply_policy`)."""
    return {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype}


class CNN(nn.Module):
    """A small CNN for 8x8 digits; every layer runs in `dtype` with params in `param_dtype`."""

    num_classes: int = 10
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = x.astype(self.dtype)
        x = nn.relu(nn.Conv(16, (3, 3), **kw)(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2), **kw)(x))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64, **kw)(x))
        return nn.Dense(self.num_classes, **kw)(x).astype(self.output_dtype)


def make_model(policy: mpjax.Policy) -> nn.Module:
    """The model, in the dtypes of `policy` (the one place to swap in another model)."""
    return CNN(**flax_dtypes(policy), output_dtype=policy.output_dtype)


def load_data(test_fraction: float = 0.25, seed: int = 0):
    """sklearn digits as ``((x_train, y_train), (x_test, y_test))``; x is (N, 8, 8, 1) in [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def global_batch_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """The example indices of the global batch of `step`: the same in every process."""
    return np.random.default_rng([seed, step]).choice(n, batch_size, replace=False)


def make_optimizer(
    precision: str,
    *,
    lr: float = 1e-3,
    loss_scale: mpjax.LossScale | None = None,
    axis_name: str | None = None,
    inner: optax.GradientTransformation | None = None,
) -> optax.GradientTransformation:
    """`inner` (default Adam) inside `mpjax.loss_scaled`: fp32 master weights, skip steps.

    `axis_name` is the mapped axis (pmap, shard_map) the skip decision is combined over.
    """
    if loss_scale is None:
        loss_scale = default_loss_scale(precision)
    inner = optax.adam(lr) if inner is None else inner
    return mpjax.loss_scaled(inner, loss_scale, axis_name=axis_name)


def loss_fn(model: nn.Module, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy, in float32."""
    logits = model.apply({"params": params}, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def init_state(model: nn.Module, tx: optax.GradientTransformation, key: jax.Array):
    """Fresh ``(params, opt_state)``."""
    params = model.init(key, jnp.zeros((1, 8, 8, 1), jnp.float32))["params"]
    return params, tx.init(params)
