"""Variants about the training state: multi-GPU paths, memory modes, optimizer steps.

- `MULTI_LM_VARIANTS` / `MULTI_RESNET_VARIANTS`: the LM paths compared under FSDP on 8 H100s
  (the loss-scaled paths, bf16-stored params with a float32 master or its int16 remainder)
  and ResNet data parallel (`fp16-hand`: hand-written Flax float16; the Pallas kernels);
- `MEMORY_MODES`: the training-state modes of the memory guide (label, param dtype,
  optimizer), as LM train-step variants (`state-*`, bf16 compute, params stored in the
  mode's dtype) and as optimizer steps on the LM's params (model `opt-lm`);
- `OPT_VARIANTS` (model `opt-blocks`, 120 leaves): one optimizer step, gradients given,
  under bare optax, the Flax DynamicScale pattern, `apply_if_finite`, `loss_scaled`;
- `MLP_VARIANTS` (model `mlp`): the full fp16 train step of `benchmarks/timing_studies.py`'s
  MLP under each loss-scaling pattern.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import jax
import jax.numpy as jnp
import optax

import mpjax
from benchmarks import timing_studies as so
from benchmarks.train_models import LM
from benchmarks.train_variants import (
    FP16,
    ONE_STRING,
    TrainProgram,
    _convbn,
    _lm,
    _lm_with,
    _resnet,
    _resnet_with,
    lm_program,
)

__all__ = [
    "MEMORY_MODES",
    "MLP_VARIANTS",
    "MULTI_LM_VARIANTS",
    "MULTI_RESNET_VARIANTS",
    "OPT_LM_VARIANTS",
    "OPT_VARIANTS",
]

BF16_PARAMS = "params=bfloat16,compute=bfloat16,output=float32"


def _adamw(b2=0.95):
    return optax.adamw(3e-4, b2=b2, weight_decay=0.1)


def _scaled(module_fn, loss_scale=None, **kw):
    return _lm_with(module_fn, tx=mpjax.loss_scaled(_adamw(), loss_scale, **kw), scaled=True)


def fsdp_block_size(shape: tuple, n: int = 8) -> int:
    """int8 state blocks (along the last axis) that the FSDP split never cuts.

    A divisor of each device's piece of the last axis when that axis is the one split
    (`harness._fsdp_spec`), else up to 256.
    """
    from benchmarks.harness import _fsdp_spec

    last = shape[-1] if shape else 1
    spec = _fsdp_spec(tuple(shape), n, "fsdp")
    split = bool(shape) and len(spec) == len(shape) and spec[-1] == "fsdp"
    piece = last // n if split else last
    return max(b for b in range(1, min(256, piece) + 1) if piece % b == 0)


def _bf16_params(master_weights: str, state=None):
    """bf16-stored params (policy `param_dtype=bfloat16`) with `loss_scaled`'s master.

    `state`: None (float32 Adam state), `jnp.bfloat16` or `jnp.int8` (`low_precision_state`;
    int8 blocks of `fsdp_block_size`, so no block straddles two devices).
    """

    def build(cfg):
        inner = _adamw()
        if state is not None:
            kw = {"block_size": fsdp_block_size} if state == jnp.int8 else {}
            inner = mpjax.low_precision_state(inner, state, **kw)
        tx = mpjax.loss_scaled(inner, mpjax.NoOpLossScale(), master_weights=master_weights)
        model = lambda c: mpjax.apply_policy(_lm(c), BF16_PARAMS)  # noqa: E731
        program = _lm_with(model, tx=tx, scaled=True)(cfg)

        def init(key):
            params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), program.init(key)[0])
            return params, tx.init(params)

        return program._replace(init=init)

    return build


MULTI_LM_VARIANTS = MappingProxyType(
    {
        "policy-noop-scaled": _scaled(
            lambda c: mpjax.apply_policy(_lm(c), ONE_STRING), mpjax.NoOpLossScale()
        ),
        "fp16-scaled-pallas": _scaled(lambda c: mpjax.apply_policy(_lm(c), FP16), impl="pallas"),
        "bf16-params-master": _bf16_params("auto"),
        "bf16-params-remainder": _bf16_params("remainder"),
        "bf16-params-remainder-bf16-state": _bf16_params("remainder", jnp.bfloat16),
        "bf16-params-remainder-int8-state": _bf16_params("remainder", jnp.int8),
    }
)
MULTI_RESNET_VARIANTS = MappingProxyType(
    {
        # Hand-written Flax float16 (no loss scaling): what XLA does with a float16 net.
        "fp16-hand": _resnet_with(lambda c: _resnet(c, dtype=jnp.float16)),
        "fp16-scaled-pallas": _resnet_with(
            lambda c: mpjax.apply_policy(_resnet(c), FP16),
            tx=mpjax.loss_scaled(optax.sgd(0.1, momentum=0.9), impl="pallas"),
            scaled=True,
        ),
        "convbn-pallas": _convbn("pallas", ONE_STRING),
    }
)


# --- memory modes --------------------------------------------------------------------------


def _lp(dtype=jnp.bfloat16):
    return mpjax.low_precision_state(optax.adamw(3e-4, weight_decay=0.1), dtype)


def _adamw_mem():
    return optax.adamw(3e-4, weight_decay=0.1)


# variant -> (label, param dtype, optimizer factory); "state-master" is today's default
MEMORY_MODES = MappingProxyType(
    {
        "state-adamw": ("optax.adamw, float32 params", jnp.float32, _adamw_mem),
        "state-scaled": (
            "loss_scaled(adamw), float32 params",
            jnp.float32,
            lambda: mpjax.loss_scaled(_adamw_mem()),
        ),
        "state-master": (
            "bf16 params + float32 master (today)",
            jnp.bfloat16,
            lambda: mpjax.loss_scaled(_adamw_mem()),
        ),
        "state-remainder": (
            "bf16 params + remainder master",
            jnp.bfloat16,
            lambda: mpjax.loss_scaled(_adamw_mem(), master_weights="remainder"),
        ),
        "state-master-bf16": (
            "bf16 params + float32 master + bf16 state",
            jnp.bfloat16,
            lambda: mpjax.loss_scaled(_lp()),
        ),
        "state-remainder-bf16": (
            "bf16 params + remainder + bf16 state",
            jnp.bfloat16,
            lambda: mpjax.loss_scaled(_lp(), master_weights="remainder"),
        ),
        "state-remainder-int8": (
            "bf16 params + remainder + int8 state",
            jnp.bfloat16,
            lambda: mpjax.loss_scaled(_lp(jnp.int8), master_weights="remainder"),
        ),
    }
)


def _lm_module(cfg, param_dtype):
    keys = ("layers", "d", "heads", "mlp", "seq")
    return LM(
        cfg["vocab"], **{k: cfg[k] for k in keys}, dtype=jnp.bfloat16, param_dtype=param_dtype
    )


def _memory_train_step(name):
    _, dtype, make = MEMORY_MODES[name]

    def build(cfg):
        model = _lm_module(cfg, dtype)
        return lm_program(cfg, model.apply, model, tx=make(), scaled=name != "state-adamw")

    return build


MEMORY_LM_VARIANTS = MappingProxyType({n: _memory_train_step(n) for n in MEMORY_MODES})


# --- optimizer steps (gradients given) -----------------------------------------------------


def opt_program(params_fn, make_tx, step_fn=None, carry=None) -> TrainProgram:
    """One optimizer step as a program: state `(params, opt_state)`, batch the gradients.

    `carry(params)` extends the params with the pattern's own leaves (a loss scale...);
    `step_fn(tx)` gives `step(carry, opt_state, grads) -> (carry, opt_state)`.
    """
    tx = make_tx()

    def zeros():
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params_fn())

    def init(key):
        params = zeros()
        return (carry(params) if carry else params), tx.init(params)

    def step(state, grads):
        if step_fn is None:
            params, opt_state = state
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None
        return step_fn(tx)(*state, grads), None  # no loss: a constant output is a kernel

    return TrainProgram(init, lambda key: zeros(), step, 0)


def _dynamic_scale_step(tx):
    """Flax DynamicScale's documented pattern: unscale, all-finite check leaf by leaf,
    update, `jnp.where` over params and opt_state, the scale update."""

    def step(carry, opt_state, grads):
        params, scale, fin_steps = carry
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = jnp.array(True)
        for g in jax.tree.leaves(grads):
            finite &= jnp.all(jax.lax.is_finite(g))
        updates, new_opt_state = tx.update(grads, opt_state, params)
        select = functools.partial(jnp.where, finite)
        new_params = jax.tree.map(select, optax.apply_updates(params, updates), params)
        new_opt_state = jax.tree.map(select, new_opt_state, opt_state)
        grow = fin_steps + 1 >= 2000
        new_scale = jnp.where(finite, jnp.where(grow, scale * 2.0, scale), scale * 0.5)
        return (new_params, new_scale, jnp.where(finite & ~grow, fin_steps + 1, 0)), new_opt_state

    return step


def _blocks(cfg, dtype):
    """4 leaves per block: a (width, width) kernel, a bias and a norm scale and bias."""
    w = cfg["width"]
    shapes = {"kernel": (w, w), "bias": (w,), "norm_scale": (w,), "norm_bias": (w,)}
    return {
        f"block{i}": {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}
        for i in range(cfg["blocks"])
    }


def _opt_blocks(make_tx, dtype=jnp.float32, **kw):
    return lambda cfg: opt_program(lambda: _blocks(cfg, dtype), make_tx, **kw)


def _adam():
    return optax.adam(1e-3)


def _carry(params):
    return params, jnp.float32(2.0**15), jnp.int32(0)


OPT_VARIANTS = MappingProxyType(
    {
        "optax-adam": _opt_blocks(_adam),
        "flax-dynamic-scale": _opt_blocks(_adam, step_fn=_dynamic_scale_step, carry=_carry),
        "apply-if-finite": _opt_blocks(lambda: optax.apply_if_finite(_adam(), 10)),
        "loss-scaled": _opt_blocks(lambda: mpjax.loss_scaled(_adam())),
        "loss-scaled-pallas": _opt_blocks(lambda: mpjax.loss_scaled(_adam(), impl="pallas")),
        "loss-scaled-bf16-params": _opt_blocks(lambda: mpjax.loss_scaled(_adam()), jnp.bfloat16),
        "loss-scaled-pallas-bf16-params": _opt_blocks(
            lambda: mpjax.loss_scaled(_adam(), impl="pallas"), jnp.bfloat16
        ),
    }
)


def _lm_params(cfg, dtype):
    model = _lm_module(cfg, dtype)
    tokens = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"]), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)["params"]


OPT_LM_VARIANTS = MappingProxyType(
    {
        name: (lambda cfg, d=dtype, m=make: opt_program(lambda: _lm_params(cfg, d), m))
        for name, (_, dtype, make) in MEMORY_MODES.items()
    }
)


# --- the fp16 MLP train step of `timing_studies.step_overhead` -----------------------------


# `mpjax_step` with the finite check forced onto the Pallas kernel
_pallas_train_step = so._opt_step(
    lambda: mpjax.loss_scaled(optax.adam(so.LR), impl="pallas"), mpjax.scale_loss
)


def _mlp(init_fn, step):
    def build(cfg):
        def batch(key):
            shape = (cfg["batch"], cfg["width"])
            return tuple(jax.random.normal(k, shape) for k in jax.random.split(key))

        def init(key):
            return init_fn(so.init_params(key, cfg["depth"], cfg["width"]))

        return TrainProgram(init, batch, step, cfg["batch"])

    return build


MLP_VARIANTS = MappingProxyType(
    {
        "bare": _mlp(so.bare_init, so.bare_step),
        "loss-scaled": _mlp(so.mpjax_init, so.mpjax_step),
        "flax-dynamic-scale": _mlp(so.flax_init, so.flax_step),
        "apply-if-finite": _mlp(so.if_finite_init, so.if_finite_step),
        "loss-scaled-pallas": _mlp(so.mpjax_init, _pallas_train_step),
        **({"jmp": _mlp(so.jmp_init, so.jmp_step)} if so.jmp is not None else {}),
    }
)
