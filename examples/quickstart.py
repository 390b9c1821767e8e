"""The README quick start, runnable: an MLP regression with fp16 compute and loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax

policy = mpjax.get_policy("params=float32,compute=float16,output=float32")
rng = np.random.default_rng(0)
x = jnp.asarray(rng.normal(size=(256, 8)), jnp.float32)
y = jnp.sin(x @ jnp.asarray(rng.normal(size=(8, 1)), jnp.float32))
params = {
    "w1": jnp.asarray(rng.normal(size=(8, 64)) / np.sqrt(8), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(64, 1)) / 8, jnp.float32),
}


def loss_fn(params, x, y):
    p, x = policy.cast_to_compute((params, x))  # fp16 matmuls
    pred = jnp.tanh(x @ p["w1"]) @ p["w2"]
    return jnp.mean((policy.cast_to_output(pred) - y) ** 2)  # loss in float32


tx = mpjax.loss_scaled(optax.adam(1e-2))  # dynamic loss scale, skips non-finite steps
opt_state = tx.init(params)


@jax.jit
def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: mpjax.scale_loss(loss_fn(p, x, y), opt_state))(
        params
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


for i in range(301):
    params, opt_state, _ = step(params, opt_state)
    if i % 100 == 0:
        mpjax.raise_if_diverged(opt_state)  # stops a run whose every step is skipped
        m = mpjax.scaling_metrics(opt_state)
        print(
            f"step {i:3d} loss {float(loss_fn(params, x, y)):.4f} "
            f"scale {float(m['loss_scale']):.0f} skipped {int(m['skipped_steps'])}"
        )
