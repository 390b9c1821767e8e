"""Flax linen layers built on the `mpjax.pallas` kernels: `ConvBN`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import flax.linen as nn
from mpjax._src.kernels.epilogue import ACTIVATIONS, conv_epilogue
from mpjax._src.kernels.stats import channel_stats

__all__ = ["ConvBN", "nchw_to_nhwc"]

LAYOUTS = ("NHWC", "NCHW")


def nchw_to_nhwc(x: jax.Array) -> jax.Array:
    """Transposes a rank-4 NCHW array to NHWC (the layout every mpjax layer keeps inside)."""
    if x.ndim != 4:
        raise ValueError(f"nchw_to_nhwc: expected a rank-4 NCHW array, got shape {x.shape}")
    return jnp.transpose(x, (0, 2, 3, 1))


class ConvBN(nn.Module):
    """Conv (no bias) -> BatchNorm -> optional residual add -> activation, on fused kernels.

    Training mode reads the conv output once for the per-channel statistics
    (`mpjax.pallas.channel_stats`, float32 sums) and once for the fused BatchNorm-apply +
    residual + activation epilogue (`mpjax.pallas.conv_epilogue`); eval mode uses the running
    statistics. BatchNorm semantics follow `flax.linen.BatchNorm` (fast variance
    `E[y^2] - E[y]^2` clipped at 0, biased running variance, statistics in float32, no running
    update while initializing).

    Layout: NHWC inside. With `input_layout="NCHW"` the input is transposed once to NHWC and
    the output stays NHWC; use it on the first layer of a model only (MXNet-style layout
    management: one transpose at the model boundary, none between layers). A `residual` is
    always NHWC, like the output.

    Mixed precision: `dtype` is the compute dtype of the conv and the epilogue's output dtype
    (None: inferred from the input and params, as in Flax); `param_dtype` is the dtype of the
    conv kernel and the BatchNorm scale and bias. A policy sets both, as for any Flax layer.

    Attributes:
      features: output channels.
      kernel_size: conv window.
      strides: conv strides.
      padding: conv padding, as for `flax.linen.Conv`.
      activation: "relu", "none" or "silu".
      use_running_average: eval mode (running statistics) if True; may be passed to
        `__call__` instead.
      momentum: decay of the running statistics.
      epsilon: added to the variance.
      axis_name: mapped axis over which batch statistics are combined (pmap/shard_map).
      dtype: compute dtype, or None.
      param_dtype: parameter dtype.
      input_layout: "NHWC" or "NCHW".
      impl: kernel implementation: "auto", "pallas", "interpret" or "xla". "auto" runs
        the XLA forms of the statistics and the epilogue, which beat the Pallas pair on
        the H100 cost model's ResNet-50 train step (the suite's `cost` table; see
        the performance guide). `"pallas"` opts in to the kernels.
      kernel_init, scale_init, bias_init: initializers.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from mpjax.nn import ConvBN
      >>> layer = ConvBN(features=16, dtype=jnp.bfloat16, input_layout="NCHW")
      >>> x = jnp.ones((2, 3, 8, 8))  # NCHW
      >>> variables = layer.init(jax.random.key(0), x, use_running_average=False)
      >>> y, updates = layer.apply(
      ...     variables, x, use_running_average=False, mutable=["batch_stats"])
      >>> y.shape  # NHWC
      (2, 8, 8, 16)
    """

    features: int
    kernel_size: Sequence[int] = (3, 3)
    strides: int | Sequence[int] = 1
    padding: Any = "SAME"
    activation: str = "relu"
    use_running_average: bool | None = None
    momentum: float = 0.99
    epsilon: float = 1e-5
    axis_name: str | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    input_layout: str = "NHWC"
    impl: str = "auto"
    kernel_init: Callable = nn.initializers.lecun_normal()
    scale_init: Callable = nn.initializers.ones
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        residual: jax.Array | None = None,
        use_running_average: bool | None = None,
    ) -> jax.Array:
        """Applies the layer.

        Args:
          x: input, NHWC (or NCHW with `input_layout="NCHW"`).
          residual: None, or an NHWC array of the output's shape added before the activation.
          use_running_average: overrides the attribute of the same name.

        Returns:
          The NHWC output.
        """
        # See `impl` above: the fused kernels are opt-in ("pallas"); "auto" is XLA here.
        impl = "xla" if self.impl == "auto" else self.impl
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ConvBN: activation must be one of {ACTIVATIONS}, got {self.activation!r}"
            )
        if self.input_layout not in LAYOUTS:
            raise ValueError(
                f"ConvBN: input_layout must be one of {LAYOUTS}, got {self.input_layout!r}"
            )
        if self.input_layout == "NCHW":
            x = nchw_to_nhwc(x)
        y = nn.Conv(
            self.features,
            tuple(self.kernel_size),
            strides=self.strides,
            padding=self.padding,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            name="conv",
        )(x)
        if residual is not None and residual.shape != y.shape:
            raise ValueError(
                f"ConvBN: residual has shape {residual.shape}, the conv output has {y.shape} "
                "(the residual is NHWC)"
            )

        shape = (self.features,)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, shape, jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, shape, jnp.float32)
        gamma = self.param("scale", self.scale_init, shape, self.param_dtype)
        beta = self.param("bias", self.bias_init, shape, self.param_dtype)

        if use_running_average:
            mean, var = ra_mean.value, ra_var.value
        else:
            total, total_sq = channel_stats(y, impl=impl)
            count = y.size // self.features
            if self.axis_name is not None and not self.is_initializing():
                total, total_sq = jax.lax.psum((total, total_sq), self.axis_name)
                count = count * jax.lax.psum(1, self.axis_name)
            mean = total / count
            var = jnp.maximum(total_sq / count - jnp.square(mean), 0.0)
            if not self.is_initializing():
                m = self.momentum
                ra_mean.value = m * ra_mean.value + (1 - m) * jax.lax.stop_gradient(mean)
                ra_var.value = m * ra_var.value + (1 - m) * jax.lax.stop_gradient(var)

        stats_dtype = jnp.promote_types(mean.dtype, jnp.float32)
        scale = gamma.astype(stats_dtype) * jax.lax.rsqrt(var.astype(stats_dtype) + self.epsilon)
        shift = beta.astype(stats_dtype) - mean.astype(stats_dtype) * scale
        return conv_epilogue(y, scale, shift, residual, activation=self.activation, impl=impl)
