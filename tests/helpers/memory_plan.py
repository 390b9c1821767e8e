"""A tiny Flax LM-like stack for `mpjax.memory_plan`: 4 pre-LN GELU MLP blocks under a policy.

Activations dominate (2048 tokens, width 64, hidden 256) so every rung of the ladder keeps a
different amount; `make_step(rung)` applies the rung to each block and to the policy.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import mpjax

TOKENS, WIDTH, HIDDEN, LAYERS = 2048, 64, 256, 4
POLICY = "p=f32,c=bf16,o=f32"


class Block(nn.Module):
    """LayerNorm, Dense to HIDDEN, GELU, Dense back, residual."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(HIDDEN)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class Stack(nn.Module):
    block: Any = Block

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = self.block(name=f"block_{i}")(x)
        return x


def make_step(rung):
    """The SGD step of the stack with `rung` applied to every block and to the policy."""
    model = mpjax.apply_policy(Stack(block=rung.wrap_module(Block)), rung.with_policy(
        mpjax.get_policy(POLICY)))  # fmt: skip

    def step(params, x):
        def loss(p):
            return jnp.mean(jnp.square(model.apply({"params": p}, x).astype(jnp.float32)))

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def example_args():
    """Abstract `(params, x)` of the step."""
    x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.float32)
    params = jax.eval_shape(lambda: Stack().init(jax.random.key(0), jnp.zeros(x.shape))["params"])
    return params, x
