"""The models of the GPU benchmarks: ResNet-50 (plain Flax and on `mpjax.nn.ConvBN`) and a
GPT-2-like LM, each with a size table (`RESNET_SIZES`, `LM_SIZES`).

`benchmarks/train_variants.py` builds the train steps of every precision variant from these;
the benchmark suite (`benchmarks/cases.py`) compiles them for an H100 without a device and
its `gpu` target times them on a real GPU, so both measure the same programs.

ResNet follows Flax's ImageNet example (ResNet v1.5, NHWC, BatchNorm momentum 0.9, last BN of
each block zero-initialised); the LM is a pre-LayerNorm decoder (learned positions, GELU MLP,
causal + padding attention mask, untied head). The classifier / LM head is the submodule
named `head` (per-module policy rules select it by that path). The LM's `attention_fn` is
Flax's default (XLA, materialised) unless given, e.g. `cudnn_attention`: what an expert writes,
`jax.nn.dot_product_attention(..., implementation="cudnn")` (one fused kernel each way).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import mpjax

__all__ = [
    "LM",
    "LM_SIZES",
    "RESNET_SIZES",
    "ConvBNResNet",
    "ResNet",
    "SmallCNN",
    "SmallResNet",
    "TransformerBlock",
    "cudnn_attention",
]

RESNET_SIZES = {
    # ResNet-50, ImageNet-shaped, batch 128.
    "full": {"stages": (3, 4, 6, 3), "width": 64, "classes": 1000, "image": 224, "batch": 128},
    # A two-stage ResNet at 64x64: compiles in seconds, same kinds of layers.
    "quick": {"stages": (1, 1), "width": 16, "classes": 100, "image": 64, "batch": 16},
    # Tiny, for a CPU smoke run of the GPU benchmark.
    "smoke": {"stages": (1,), "width": 4, "classes": 10, "image": 16, "batch": 2},
    # Data parallel on 8 GPUs: the same per device (global batch 8x).
    "fullx8": {"stages": (3, 4, 6, 3), "width": 64, "classes": 1000, "image": 224, "batch": 1024},
    "quickx8": {"stages": (1, 1), "width": 16, "classes": 100, "image": 64, "batch": 128},
}
LM_SIZES = {
    # GPT-2 small: 12 layers, d 768, 12 heads, MLP 3072, seq 1024, batch 8.
    "gpt2": {"layers": 12, "d": 768, "heads": 12, "mlp": 3072, "seq": 1024, "batch": 8},
    # Where GEMMs dominate (issue 15's fp8 comparison).
    "wide": {"layers": 4, "d": 4096, "heads": 32, "mlp": 16384, "seq": 2048, "batch": 4},
    "quick": {"layers": 2, "d": 128, "heads": 4, "mlp": 512, "seq": 128, "batch": 4},
    "smoke": {"layers": 1, "d": 32, "heads": 2, "mlp": 64, "seq": 16, "batch": 2},
    # FSDP on 8 GPUs: GPT-2 small at global batch 64, the quick LM at 8.
    "gpt2x8": {"layers": 12, "d": 768, "heads": 12, "mlp": 3072, "seq": 1024, "batch": 64},
    "quickx8": {"layers": 2, "d": 128, "heads": 4, "mlp": 512, "seq": 128, "batch": 8},
}
VOCAB = {"full": 50304, "quick": 2048, "smoke": 64}


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck block (stride on the 3x3 convolution)."""

    filters: int
    strides: int = 1
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
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
        return nn.Dense(
            self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="head"
        )(x)


class ConvBNBottleneck(nn.Module):
    """The bottleneck block on `mpjax.nn.ConvBN` (conv + BatchNorm + residual + ReLU fused)."""

    filters: int
    strides: int = 1
    dtype: Any = jnp.float32
    impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        cbn = partial(
            mpjax.nn.ConvBN,
            use_running_average=not train,
            momentum=0.9,
            dtype=self.dtype,
            impl=self.impl,
        )
        y = cbn(self.filters, (1, 1))(x)
        y = cbn(self.filters, (3, 3), strides=self.strides)(y)
        shortcut = x
        if x.shape[-1] != 4 * self.filters or self.strides != 1:
            shortcut = cbn(4 * self.filters, (1, 1), strides=self.strides, activation="none")(x)
        return cbn(4 * self.filters, (1, 1), scale_init=nn.initializers.zeros)(y, residual=shortcut)


class ConvBNResNet(nn.Module):
    """`ResNet` with every Conv + BatchNorm (+ residual + ReLU) as one `mpjax.nn.ConvBN`."""

    stages: Sequence[int]
    num_classes: int
    width: int = 64
    dtype: Any = jnp.float32
    impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = mpjax.nn.ConvBN(
            self.width,
            (7, 7),
            strides=2,
            padding=[(3, 3), (3, 3)],
            use_running_average=not train,
            momentum=0.9,
            dtype=self.dtype,
            impl=self.impl,
        )(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                x = ConvBNBottleneck(
                    self.width * 2**i,
                    strides=2 if i > 0 and j == 0 else 1,
                    dtype=self.dtype,
                    impl=self.impl,
                )(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


def cudnn_attention(query, key, value, bias=None, mask=None, **_):
    """A Flax `attention_fn`: cuDNN's fused attention (fp16/bf16 operands; the mask as its bias).

    Where no cuDNN is found (a CPU smoke run), JAX's default (XLA) implementation instead.
    """
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

    try:
        check_cudnn_version()  # the deviceless target declares one (mpjax's target_cudnn)
        implementation = "cudnn"
    except RuntimeError:
        implementation = None
    mask = None if mask is None else mask.astype(jnp.bool_)
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, implementation=implementation
    )


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: LayerNorm, masked self-attention, LayerNorm, GELU MLP."""

    heads: int
    mlp: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    dot_general_cls: Any = None  # the block GEMMs' dot_general (Flax fp8_ops anchors)
    attention_fn: Any = None  # None: Flax's default

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        dot = self.dot_general_cls
        attn_kw = {} if dot is None else {"qkv_dot_general_cls": dot, "out_dot_general_cls": dot}
        if self.attention_fn is not None:
            attn_kw["attention_fn"] = self.attention_fn
        dense_kw = {} if dot is None else {"dot_general_cls": dot}
        h = nn.LayerNorm(**kw)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, **kw, **attn_kw)(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(**kw)(x)
        h = nn.gelu(nn.Dense(self.mlp, **kw, **dense_kw)(h))
        return x + nn.Dense(x.shape[-1], **kw, **dense_kw)(h)


class LM(nn.Module):
    """GPT-2-like decoder-only LM: token + learned position embeddings, blocks, LN, head."""

    vocab: int
    layers: int
    d: int
    heads: int
    mlp: int
    seq: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    dot_general_cls: Any = None  # passed to every block's GEMMs (not the head)
    head_bias: bool = True
    hidden_only: bool = False  # return the final LayerNorm's output (the head is the loss's)
    attention_fn: Any = None  # every block's attention (None: Flax's default)
    # each block under `nn.remat`: None (no remat), "full" (recompute all), or a policy
    remat: Any = None

    @nn.compact
    def __call__(self, tokens: jax.Array, padding: jax.Array) -> jax.Array:
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = nn.Embed(self.vocab, self.d, **kw)(tokens)
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (self.seq, self.d), self.param_dtype
        )
        x = x + jnp.asarray(positions, self.dtype)[None, : tokens.shape[1]]
        mask = nn.combine_masks(
            nn.make_causal_mask(tokens), nn.make_attention_mask(padding, padding)
        )
        block = DecoderBlock
        if self.remat is not None:
            policy = None if self.remat == "full" else self.remat
            block = nn.remat(DecoderBlock, policy=policy)
        for i in range(self.layers):
            x = block(
                self.heads,
                self.mlp,
                **kw,
                dot_general_cls=self.dot_general_cls,
                attention_fn=self.attention_fn,
                name=f"DecoderBlock_{i}",
            )(x, mask)
        x = nn.LayerNorm(**kw)(x)
        if self.hidden_only:
            return x
        return nn.Dense(self.vocab, name="head", use_bias=self.head_bias, **kw)(x)


# --- the small models of the CPU studies (`benchmarks/hlo_studies.py`, `timing_studies.py`) ---


class _ResBlock(nn.Module):
    features: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = partial(nn.BatchNorm, use_running_average=not train, dtype=self.dtype)
        conv = partial(nn.Conv, self.features, (3, 3), use_bias=False, dtype=self.dtype)
        y = nn.relu(norm()(conv()(x)))
        return nn.relu(x + norm()(conv()(y)))


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stem, `blocks` residual blocks of two Conv-BN, global pool, Dense head."""

    features: int
    blocks: int = 1
    classes: int = 10
    dtype: Any = None  # None: the inputs' (a Flax bf16 model: bfloat16)

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.features, (3, 3), use_bias=False, dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x))
        for _ in range(self.blocks):
            x = _ResBlock(self.features, self.dtype)(x, train)
        return nn.Dense(self.classes, dtype=self.dtype)(x.mean(axis=(1, 2)))


class TransformerBlock(nn.Module):
    """Pre-LN transformer block (attention, GELU MLP); with `classes`, a LayerNorm + Dense head."""

    heads: int
    classes: int | None = None
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(h, h)
        h = nn.gelu(nn.Dense(4 * x.shape[-1], dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x)))
        x = x + nn.Dense(x.shape[-1], dtype=self.dtype)(h)
        if self.classes is None:
            return x
        return nn.Dense(self.classes)(nn.LayerNorm()(x))


class _Block(nn.Module):
    features: int
    strides: int = 1
    convbn: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        s = (self.strides, self.strides)
        project = x.shape[-1] != self.features or self.strides != 1
        if self.convbn:  # the same block from mpjax.nn.ConvBN layers
            cb = partial(mpjax.nn.ConvBN, use_running_average=not train)
            y = cb(self.features, strides=s)(x)
            if project:
                x = cb(self.features, (1, 1), strides=s, activation="none")(x)
            return cb(self.features)(y, residual=x)
        bn = partial(nn.BatchNorm, use_running_average=not train)
        y = nn.relu(bn()(nn.Conv(self.features, (3, 3), s, use_bias=False)(x)))
        y = bn()(nn.Conv(self.features, (3, 3), use_bias=False)(y))
        if project:
            x = bn()(nn.Conv(self.features, (1, 1), s, use_bias=False)(x))
        return nn.relu(x + y)


class SmallResNet(nn.Module):
    """Stem, two basic residual blocks per width (projection shortcuts), pool, Dense head;
    `convbn`: every Conv + BatchNorm (+ residual + ReLU) as one `mpjax.nn.ConvBN`."""

    widths: tuple[int, ...] = (16, 32)
    classes: int = 10
    convbn: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        if self.convbn:
            x = mpjax.nn.ConvBN(self.widths[0], use_running_average=not train)(x)
        else:
            x = nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        for i, w in enumerate(self.widths):
            x = _Block(w, strides=1 if i == 0 else 2, convbn=self.convbn)(x, train)
            x = _Block(w, convbn=self.convbn)(x, train)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))
