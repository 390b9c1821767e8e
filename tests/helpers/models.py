"""Shared test helpers: small models."""

import flax.linen as nn
import jax.numpy as jnp


class TanhMLP(nn.Module):
    """`layers` bias-free `Dense(width)` layers, each followed by tanh (params `Dense_i`)."""

    width: int
    layers: int = 3

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = jnp.tanh(nn.Dense(self.width, use_bias=False)(x))
        return x
