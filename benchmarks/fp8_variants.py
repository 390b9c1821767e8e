"""fp8 variants of the benchmark models: the LM (autocast, apply_policy delayed, Flax's
`fp8_ops`), ResNet's 1x1 convolutions, the block-scaled recipes, and the LM written in Flax NNX.

LM (against the hand-written Flax bf16 step `bf16`, default compile options; every variant
with the anchor's cuDNN attention, `jax.nn.dot_product_attention(implementation="cudnn")`):
- `fp8-tensorwise` / `fp8-rowwise`: `autocast(model.apply, ONE_STRING, fp8=Fp8Recipe(
  scaling=..., exclude=("*/head",)))` (the LM head stays bf16);
- `flax-fp8`: Flax `fp8_ops.Fp8DotGeneralOp` (delayed scaling, quantise-dequantise form) in
  every block GEMM; `flax-fp8-direct`: `Fp8DirectDotGeneralOp` (fp8 operands into the dot),
  their `_overwrite_with_gradient` variables replaced by their gradients each step;
- `fp8-delayed`: `apply_policy(model, RULES, fp8=Fp8Recipe(scaling="delayed", ...))`, the
  `"fp8_meta"` collection updated in the step by `mpjax.fp8.update_fp8_meta`.

Block-scaled (`BLOCK_VARIANTS`, issue 30): `fp8-blockwise` (DeepSeek-V3's 1x128 / 128x128
recipe; on the H100 mpjax's Pallas kernel runs each GEMM in fp8), `fp8-blockwise-emulated`
(the same numbers dequantised to bf16), `fp8-mxfp8` and `fp8-nvfp4` (cuDNN block-scaled
GEMMs on the B200 target); the LM head stays bf16. `-roofline`: the same recipe with
`choose="roofline"` for its GPU (each GEMM in the recipe's format, in tensorwise fp8 or in
bf16, whichever the roofline prefers). `-copies`: the step reads its weights' block-quantised
copies (`mpjax.fp8.weight_copies`, kept in the state) instead of quantising them: the program
of every micro-batch but the first under gradient accumulation, where the copies are made once
per optimizer step (optimizer update included, as in the other rows).

ResNet: `fp8-conv` (`Fp8Recipe(convs="none")`, every convolution bf16), `fp8-1x1` (each 1x1
convolution an fp8 GEMM forward and backward) and `fp8-1x1-min256` / `-min512` (only those
whose channels and pixels are at least that many). XLA:GPU has no fp8 weight-gradient
convolution, so 3x3/7x7 convolutions stay bf16.

NNX (`NNX_VARIANTS`, model `lm-nnx`): pre-LN blocks of `nnx.MultiHeadAttention` and an
`nnx.Linear` MLP under `apply_policy(model, {"*": ONE_STRING})`: `nnx-bf16`, and
`nnx-fp8-delayed` (the `Fp8Meta` state differentiated with the params, `nnx.DiffState`,
updated by `mpjax.fp8.update_nnx_fp8_meta`).
"""

from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.linen import fp8_ops

import mpjax
from benchmarks.train_models import cudnn_attention
from benchmarks.train_variants import (
    LM_VARIANTS,
    ONE_STRING,
    RESNET_VARIANTS,
    RULES,
    TrainProgram,
    _lm,
    _resnet,
    lm_program,
    resnet_program,
)

__all__ = [
    "BLOCK_VARIANTS",
    "FP8_CONV_VARIANTS",
    "FP8_VARIANTS",
    "NNX_VARIANTS",
    "block_gemm_flops",
]

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT


def block_gemm_flops(cfg: dict) -> float:
    """FLOPs of the LM's block GEMMs (QKV, out, MLP up/down), forward + both backward."""
    tokens, d = cfg["batch"] * cfg["seq"], cfg["d"]
    return 3 * 2 * tokens * cfg["layers"] * (4 * d * d + 2 * d * cfg["mlp"])


def _adamw():
    return optax.adamw(3e-4, b2=0.95, weight_decay=0.1)


def _autocast_fp8(scaling):
    def build(cfg):
        model = _lm(cfg, attention_fn=cudnn_attention)  # the anchor's attention
        recipe = mpjax.Fp8Recipe(scaling=scaling, block_lowering="native", exclude=("*/head",))
        return lm_program(cfg, mpjax.autocast(model.apply, ONE_STRING, fp8=recipe), _lm(cfg))

    return build


def _overwrite() -> optax.GradientTransformation:
    """Updates that make `param + update` the gradient (Flax's overwrite-with-gradient)."""

    def update(grads, state, params):
        return jax.tree.map(lambda g, p: g - p, grads, params), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


class _Nested:
    """`init` returning {"params": {"params": ..., OWG: ...}}, as `lm_program` expects."""

    def __init__(self, model):
        self.model = model

    def init(self, key, *args):
        return {"params": dict(self.model.init(key, *args))}


def _flax_fp8(dot_cls):
    def build(cfg):
        model = _lm(cfg, dtype=jnp.bfloat16, dot_general_cls=dot_cls, attention_fn=cudnn_attention)
        tx = optax.multi_transform(
            {"adamw": _adamw(), "owg": _overwrite()},
            lambda tree: {
                k: jax.tree.map(lambda _, k=k: "owg" if k == OWG else "adamw", v)
                for k, v in tree.items()
            },
        )
        return lm_program(cfg, lambda v, *a: model.apply(v["params"], *a), _Nested(model), tx=tx)

    return build


def _mpjax_delayed(cfg):
    """`apply_policy(..., fp8=delayed)`: fp8 meta in the state, updated inside the step."""
    recipe = mpjax.Fp8Recipe(scaling="delayed", exclude=("*/head",))
    model = mpjax.apply_policy(_lm(cfg), dict(RULES), fp8=recipe)
    tx = _adamw()
    base = lm_program(cfg, model.apply, model, tx=tx)

    def init(key):
        tokens = jnp.zeros((cfg["batch"], cfg["seq"]), jnp.int32)
        variables = model.init(key, tokens, tokens > 0)
        return variables["params"], variables["fp8_meta"], tx.init(variables["params"])

    def step(state, batch):
        params, meta, opt_state = state
        tokens, padding = batch

        def loss_fn(p, m):
            logits = model.apply({"params": p, "fp8_meta": m}, tokens[:, :-1], padding)
            ce = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens[:, 1:]
            )
            return jnp.sum(ce * padding) / jnp.maximum(jnp.sum(padding), 1)

        loss, (grads, meta_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta)
        updates, opt_state = tx.update(grads, opt_state, params)
        meta = mpjax.fp8.update_fp8_meta(meta, meta_grads, recipe)
        return (optax.apply_updates(params, updates), meta, opt_state), loss

    return TrainProgram(init, base.batch, step, base.items)


FP8_VARIANTS = MappingProxyType(
    {
        "fp8-tensorwise": _autocast_fp8("tensorwise"),
        "fp8-rowwise": _autocast_fp8("rowwise"),
        "flax-fp8": _flax_fp8(fp8_ops.Fp8DotGeneralOp),
        "flax-fp8-direct": _flax_fp8(fp8_ops.Fp8DirectDotGeneralOp),
        "fp8-delayed": _mpjax_delayed,
    }
)
assert not set(FP8_VARIANTS) & set(LM_VARIANTS)


def _autocast_blocks(scaling: str, lowering: str = "native", roofline_for: str | None = None):
    """`roofline_for`: a GPU; each GEMM then takes the format its roofline there prefers
    (`choose="roofline"`: the recipe's, tensorwise fp8 where it is faster, or bf16 where
    quantising costs more than it saves)."""

    def build(cfg):
        model = _lm(cfg, attention_fn=cudnn_attention)
        choice = {"choose": "roofline", "target": roofline_for} if roofline_for else {}
        recipe = mpjax.Fp8Recipe(
            scaling=scaling, block_lowering=lowering, exclude=("*/head",), **choice
        )
        return lm_program(cfg, mpjax.autocast(model.apply, ONE_STRING, fp8=recipe), _lm(cfg))

    return build


def _blocks_with_copies(scaling: str):
    """The step with the weights' copies made beforehand (`weight_copies`, in the state)."""

    def build(cfg):
        model = _lm(cfg, attention_fn=cudnn_attention)
        recipe = mpjax.Fp8Recipe(scaling=scaling, block_lowering="native", exclude=("*/head",))
        apply = mpjax.autocast(model.apply, ONE_STRING, fp8=recipe)
        base = lm_program(cfg, apply, _lm(cfg))

        def init(key):
            params, opt_state = base.init(key)
            tokens, padding = base.batch(key)
            copies = mpjax.fp8.weight_copies(apply, {"params": params}, tokens[:, :-1], padding)
            return params, opt_state, copies

        def step(state, batch):
            params, opt_state, copies = state
            fast = apply.with_fp8_weights(fp8_weights=copies)
            (params, opt_state), loss = lm_program(cfg, fast, _lm(cfg)).step(
                (params, opt_state), batch
            )
            return (params, opt_state, copies), loss

        return TrainProgram(init, base.batch, step, base.items)

    return build


# Block-scaled recipes (issue 30), the LM head in bf16 as for tensorwise: blockwise on the
# H100 (mpjax's Pallas fp8 kernel; `-emulated`: dequantised to bf16), MXFP8 and NVFP4 on
# the B200 (cuDNN block-scaled GEMMs).
BLOCK_VARIANTS = MappingProxyType(
    {
        "fp8-blockwise": _autocast_blocks("blockwise"),
        "fp8-blockwise-emulated": _autocast_blocks("blockwise", "emulated"),
        "fp8-mxfp8": _autocast_blocks("mxfp8"),
        "fp8-nvfp4": _autocast_blocks("nvfp4"),
        "fp8-blockwise-roofline": _autocast_blocks("blockwise", roofline_for="h100"),
        "fp8-mxfp8-roofline": _autocast_blocks("mxfp8", roofline_for="b200"),
        "fp8-nvfp4-roofline": _autocast_blocks("nvfp4", roofline_for="b200"),
        "fp8-blockwise-copies": _blocks_with_copies("blockwise"),
        "fp8-mxfp8-copies": _blocks_with_copies("mxfp8"),
        "fp8-nvfp4-copies": _blocks_with_copies("nvfp4"),
    }
)


def _conv_fp8(convs: str, min_dim: int = 64):
    def build(cfg):
        model = _resnet(cfg)
        recipe = mpjax.Fp8Recipe(convs=convs, min_dim=min_dim, exclude=("*/head",))
        apply = mpjax.autocast(model.apply, ONE_STRING, fp8=recipe)
        return resnet_program(
            cfg, lambda v, x: apply(v, x, train=True, mutable=["batch_stats"]), model
        )

    return build


FP8_CONV_VARIANTS = MappingProxyType(
    {
        "fp8-conv": _conv_fp8("none"),
        "fp8-1x1": _conv_fp8("1x1"),
        "fp8-1x1-min256": _conv_fp8("1x1", 256),
        "fp8-1x1-min512": _conv_fp8("1x1", 512),
    }
)
assert not set(FP8_CONV_VARIANTS) & set(RESNET_VARIANTS)


# --- the LM in Flax NNX --------------------------------------------------------------------


class _Block(nnx.Module):
    def __init__(self, cfg: dict, rngs: nnx.Rngs):
        d = cfg["d"]
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg["heads"], d, decode=False, rngs=rngs)
        self.up = nnx.Linear(d, cfg["mlp"], rngs=rngs)
        self.down = nnx.Linear(cfg["mlp"], d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class NnxLM(nnx.Module):
    """The LM of `train_models.LM` in NNX (no padding mask), head named `head`."""

    def __init__(self, cfg: dict, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg["vocab"], cfg["d"], rngs=rngs)
        self.blocks = nnx.List([_Block(cfg, rngs) for _ in range(cfg["layers"])])
        self.ln = nnx.LayerNorm(cfg["d"], rngs=rngs)
        self.head = nnx.Linear(cfg["d"], cfg["vocab"], rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def _nnx_program(fp8: bool):
    def build(cfg):
        recipe = mpjax.Fp8Recipe(scaling="delayed", exclude=("*/head",)) if fp8 else None
        rules = {"*": ONE_STRING}

        def make():
            return mpjax.apply_policy(NnxLM(cfg, nnx.Rngs(0)), rules, fp8=recipe)

        graphdef, _ = nnx.split(nnx.eval_shape(make))
        tx = _adamw()
        diff = nnx.DiffState(0, (nnx.Param, mpjax.fp8.Fp8Meta))

        def init(key):
            model = make()
            return nnx.state(model), tx.init(nnx.state(model, nnx.Param))

        def batch(key):
            return jax.random.randint(key, (cfg["batch"], cfg["seq"] + 1), 0, cfg["vocab"])

        def step(carry, tokens):
            state, opt_state = carry
            model = nnx.merge(graphdef, state)

            def loss_fn(model):
                logits = model(tokens[:, :-1]).astype(jnp.float32)
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
                return ce.mean()

            loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
            params = nnx.state(model, nnx.Param)
            updates, opt_state = tx.update(nnx.state(grads, nnx.Param), opt_state, params)
            nnx.update(model, optax.apply_updates(params, updates))
            if fp8:
                mpjax.fp8.update_nnx_fp8_meta(model, grads, recipe)
            return (nnx.state(model), opt_state), loss

        return TrainProgram(init, batch, step, cfg["batch"] * cfg["seq"])

    return build


NNX_VARIANTS = MappingProxyType(
    {"nnx-bf16": _nnx_program(False), "nnx-fp8-delayed": _nnx_program(True)}
)
