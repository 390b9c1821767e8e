"""Train steps of every precision variant of the GPU benchmarks, from one registry.

A variant is a builder `fn(cfg) -> TrainProgram` in `RESNET_VARIANTS` or `LM_VARIANTS`
(read-only mappings; `VARIANTS[model]` picks one). `cfg` is a size entry of
`benchmarks/train_models.py` plus `"vocab"` for the LM. The cost model
(the suite's cases, `benchmarks/cases.py`) compiles `jax.jit(program.step, donate_argnums=0)` on
abstract `init`/`batch` outputs; the `gpu` target times the same steps on a GPU.

To add variants in another file (e.g. fp8), write builders with `resnet_program` /
`lm_program` and merge: `{**LM_VARIANTS, "fp8": build_fp8}`; the cost model's
`--variants` accepts any name of the mapping it is given.

The variants (mpjax's own paths against the hand-written anchor):
- `fp32`: the float32 model;
- `bf16`: hand-written Flax bf16 (`dtype=bfloat16, param_dtype=float32`): the anchor; the
  LM's is the expert's, its attention `jax.nn.dot_product_attention(implementation="cudnn")`
  (`train_models.cudnn_attention`); `bf16-xla` (LM): with Flax's default (XLA) attention, the
  anchor before;
- `policy`: `apply_policy(model, ONE_STRING)`;
- `policy-rules`: `apply_policy(model, RULES)` (bf16 outputs inside, float32 at the head);
- `autocast`: `autocast(model.apply, ONE_STRING)` (the LM's float32 model written with the
  expert's cuDNN attention, as a torch user writes `scaled_dot_product_attention`);
- `fp16-scaled`: `apply_policy(model, FP16)` + `loss_scaled(tx)` (dynamic) + `scale_loss`;
- `fp16-bare`: the same without loss scaling (the bare step the loss-scaled one is paid
  against; not a usable training recipe);
- `LM_FUSED_LOSS_VARIANTS` (LM): `bf16-lce` / `policy-lce`: `bf16` / `policy`, the loss computed by
  `mpjax.nn.linear_cross_entropy` from the final hidden states and the head's kernel (a
  head without bias, as GPT-2's), never holding the float32 logits;
- ResNet only: `convbn` / `convbn-xla`: the net on `mpjax.nn.ConvBN` under `ONE_STRING`
  (impl "auto", which is the Pallas kernels on CUDA, and impl "xla"); `convbn-rules` /
  `convbn-rules-xla`: the same under `RULES` (a clean bf16 net: bf16 between the layers).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import mpjax
from benchmarks.train_models import LM, VOCAB, ConvBNResNet, ResNet, cudnn_attention
from mpjax.nn import linear_cross_entropy

__all__ = [
    "FP16",
    "LM_FUSED_LOSS_VARIANTS",
    "LM_VARIANTS",
    "ONE_STRING",
    "RESNET_VARIANTS",
    "RULES",
    "VARIANTS",
    "TrainProgram",
    "lm_config",
    "lm_program",
    "resnet_program",
]

BF16 = jnp.bfloat16
ONE_STRING = "params=float32,compute=bfloat16,output=float32"
FP16 = "params=float32,compute=float16,output=float32"
RULES = MappingProxyType(
    {
        "*": "params=float32,compute=bfloat16,output=bfloat16",
        "head": "params=float32,compute=bfloat16,output=float32",
    }
)


class TrainProgram(NamedTuple):
    """One train step and how to make its inputs.

    Attributes:
      init: `init(key) -> state` (float32 params, model state, optimizer state).
      batch: `batch(key) -> batch` (synthetic data of the benchmark's shapes).
      step: `step(state, batch) -> (state, loss)`; jit it with `donate_argnums=0`.
      items: images or tokens per step (for throughput).
    """

    init: Callable[[jax.Array], Any]
    batch: Callable[[jax.Array], Any]
    step: Callable[[Any, Any], tuple[Any, jax.Array]]
    items: int


def lm_config(cfg: dict, size: str) -> dict:
    """An `LM_SIZES` entry named `size` with its vocabulary (`"vocab"`), as `lm_program` needs."""
    vocab = VOCAB[size if size in ("quick", "smoke") else "quick" if "quick" in size else "full"]
    return {**cfg, "vocab": vocab}


def _scaled_grad(loss_fn, params, opt_state, scaled: bool):
    def objective(p):
        loss, aux = loss_fn(p)
        return (mpjax.scale_loss(loss, opt_state) if scaled else loss), (loss, aux)

    return jax.grad(objective, has_aux=True)(params)


def resnet_program(
    cfg: dict, apply: Callable, init_model, *, tx=None, scaled: bool = False
) -> TrainProgram:
    """The ResNet train step (SGD momentum 0.9, BatchNorm statistics updated).

    Args:
      cfg: a `RESNET_SIZES` entry.
      apply: `apply(variables, images) -> (logits, {"batch_stats": ...})`.
      init_model: the float32 module whose `init` gives the variables.
      tx: the optimizer (default `optax.sgd(0.1, momentum=0.9)`).
      scaled: scale the loss with `mpjax.scale_loss` (tx must be `loss_scaled`).
      fused_loss: `apply` returns the final hidden states; the loss is
        `mpjax.nn.linear_cross_entropy` of them and `params["head"]["kernel"]` in bfloat16.
    """
    tx = tx or optax.sgd(0.1, momentum=0.9)
    shape = (cfg["batch"], cfg["image"], cfg["image"], 3)

    def init(key):
        variables = init_model.init(key, jnp.zeros((1, *shape[1:])), train=False)
        return variables["params"], variables["batch_stats"], tx.init(variables["params"])

    def batch(key):
        k1, k2 = jax.random.split(key)
        return jax.random.normal(k1, shape), jax.random.randint(k2, shape[:1], 0, cfg["classes"])

    def step(state, batch):
        params, stats, opt_state = state
        images, labels = batch

        def loss_fn(p):
            logits, new_vars = apply({"params": p, "batch_stats": stats}, images)
            logits = logits.astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, new_vars["batch_stats"]

        grads, (loss, new_stats) = _scaled_grad(loss_fn, params, opt_state, scaled)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_stats, opt_state), loss

    return TrainProgram(init, batch, step, cfg["batch"])


def lm_program(
    cfg: dict, apply: Callable, init_model, *, tx=None, scaled=False, fused_loss=False
) -> TrainProgram:
    """The LM train step (AdamW, next-token cross-entropy with a padding mask).

    Args:
      cfg: an `LM_SIZES` entry plus `"vocab"`.
      apply: `apply(variables, tokens, padding) -> logits`.
      init_model: the float32 module whose `init` gives the params.
      tx: the optimizer (default AdamW, lr 3e-4, b2 0.95, weight decay 0.1).
      scaled: scale the loss with `mpjax.scale_loss` (tx must be `loss_scaled`).
      fused_loss: `apply` returns the final hidden states; the loss is
        `mpjax.nn.linear_cross_entropy` of them and `params["head"]["kernel"]` in bfloat16.
    """
    tx = tx or optax.adamw(3e-4, b2=0.95, weight_decay=0.1)
    shape = (cfg["batch"], cfg["seq"])

    def init(key):
        tokens = jnp.zeros(shape, jnp.int32)
        params = init_model.init(key, tokens, tokens > 0)["params"]
        return params, tx.init(params)

    def batch(key):
        k1, k2 = jax.random.split(key)
        tokens = jax.random.randint(k1, (shape[0], shape[1] + 1), 0, cfg["vocab"])
        lengths = jax.random.randint(k2, (shape[0], 1), shape[1] // 2, shape[1] + 1)
        return tokens, jnp.arange(shape[1])[None, :] < lengths

    def step(state, batch):
        params, opt_state = state
        tokens, padding = batch

        def loss_fn(p):
            if fused_loss:
                hidden = apply({"params": p}, tokens[:, :-1], padding)
                labels = jnp.where(padding, tokens[:, 1:], -1)
                kernel = p["head"]["kernel"]
                ce = linear_cross_entropy(hidden, kernel, labels, ignore_index=-1, dtype=BF16)
                return ce, None
            logits = apply({"params": p}, tokens[:, :-1], padding).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            return jnp.sum(ce * padding) / jnp.maximum(jnp.sum(padding), 1), None

        grads, (loss, _) = _scaled_grad(loss_fn, params, opt_state, scaled)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return TrainProgram(init, batch, step, cfg["batch"] * cfg["seq"])


# --- ResNet variants ------------------------------------------------------------------------


def _resnet(cfg, **kw):
    return ResNet(cfg["stages"], cfg["classes"], cfg["width"], **kw)


def _resnet_apply(module):
    return lambda v, x: module.apply(v, x, train=True, mutable=["batch_stats"])


def _resnet_with(module_fn, *, tx=None, scaled=False, init_fn=_resnet):
    def build(cfg):
        module = module_fn(cfg)
        return resnet_program(cfg, _resnet_apply(module), init_fn(cfg), tx=tx, scaled=scaled)

    return build


def _resnet_autocast(cfg):
    model = _resnet(cfg)
    apply = mpjax.autocast(model.apply, ONE_STRING)
    return resnet_program(cfg, lambda v, x: apply(v, x, train=True, mutable=["batch_stats"]), model)


def _resnet_fp16_scaled(cfg):
    tx = mpjax.loss_scaled(optax.sgd(0.1, momentum=0.9))
    return _resnet_with(lambda c: mpjax.apply_policy(_resnet(c), FP16), tx=tx, scaled=True)(cfg)


def _convbn(impl, policy):
    def init_fn(cfg):
        return ConvBNResNet(cfg["stages"], cfg["classes"], cfg["width"], impl=impl)

    return _resnet_with(lambda c: mpjax.apply_policy(init_fn(c), policy), init_fn=init_fn)


RESNET_VARIANTS = MappingProxyType(
    {
        "fp32": _resnet_with(_resnet),
        "bf16": _resnet_with(lambda c: _resnet(c, dtype=BF16)),
        "policy": _resnet_with(lambda c: mpjax.apply_policy(_resnet(c), ONE_STRING)),
        "policy-rules": _resnet_with(lambda c: mpjax.apply_policy(_resnet(c), dict(RULES))),
        "autocast": _resnet_autocast,
        "fp16-scaled": _resnet_fp16_scaled,
        "fp16-bare": _resnet_with(lambda c: mpjax.apply_policy(_resnet(c), FP16)),
        "convbn": _convbn("auto", ONE_STRING),
        "convbn-xla": _convbn("xla", ONE_STRING),
        "convbn-rules": _convbn("auto", dict(RULES)),
        "convbn-rules-xla": _convbn("xla", dict(RULES)),
    }
)


# --- LM variants ----------------------------------------------------------------------------


def _lm(cfg, **kw):
    keys = ("layers", "d", "heads", "mlp", "seq")
    return LM(cfg["vocab"], **{k: cfg[k] for k in keys}, **kw)


def _lm_with(module_fn, *, tx=None, scaled=False):
    def build(cfg):
        return lm_program(cfg, module_fn(cfg).apply, _lm(cfg), tx=tx, scaled=scaled)

    return build


def _lm_fused_loss(module_fn):
    """`module_fn(cfg)`'s LM returns its hidden states; the loss is the fused one."""

    def build(cfg):
        init = _lm(cfg, head_bias=False)
        return lm_program(cfg, module_fn(cfg).apply, init, fused_loss=True)

    return build


def _lm_autocast(cfg):
    model = _lm(cfg, attention_fn=cudnn_attention)
    return lm_program(cfg, mpjax.autocast(model.apply, ONE_STRING), _lm(cfg))


def _lm_fp16_scaled(cfg):
    tx = mpjax.loss_scaled(optax.adamw(3e-4, b2=0.95, weight_decay=0.1))
    return _lm_with(lambda c: mpjax.apply_policy(_lm(c), FP16), tx=tx, scaled=True)(cfg)


LM_VARIANTS = MappingProxyType(
    {
        "fp32": _lm_with(_lm),
        "bf16": _lm_with(lambda c: _lm(c, dtype=BF16, attention_fn=cudnn_attention)),
        "bf16-xla": _lm_with(lambda c: _lm(c, dtype=BF16)),
        "policy": _lm_with(lambda c: mpjax.apply_policy(_lm(c), ONE_STRING)),
        "policy-rules": _lm_with(lambda c: mpjax.apply_policy(_lm(c), dict(RULES))),
        "autocast": _lm_autocast,
        "fp16-scaled": _lm_fp16_scaled,
        "fp16-bare": _lm_with(lambda c: mpjax.apply_policy(_lm(c), FP16)),
    }
)

# The LM with the fused loss (not in `VARIANTS`: the cost model's quick run stays as it was;
# `multi_gpu_cost.py` and `lce_int8_cost.py` measure them).
LM_FUSED_LOSS_VARIANTS = MappingProxyType(
    {
        "bf16-lce": _lm_fused_loss(lambda c: _lm(c, dtype=BF16, head_bias=False, hidden_only=True)),
        "policy-lce": _lm_fused_loss(
            lambda c: mpjax.apply_policy(_lm(c, head_bias=False, hidden_only=True), ONE_STRING)
        ),
    }
)

VARIANTS = MappingProxyType({"resnet": RESNET_VARIANTS, "lm": LM_VARIANTS})
