"""Client code: JAX's "Training cookbook" train step, with mpjax's autocast and loss_scaled.

Modelled on the cookbook's companion script (docs/the-training-cookbook.py in jax-ml/jax): a
`dot_dict` (a dict whose attributes are its items, a pytree with keys) holds the params and
optimizer state, `jax.make_mesh` makes Explicit "fsdp" axes set with `jax.set_mesh`, params
are created sharded by their initialisers, the model's einsums name their output shardings,
and one `jax.jit` train step takes the loss's gradient. mpjax's part: the loss runs under
`autocast`, the optimizer is `loss_scaled(optax.adam(...))` with a dynamic loss scale, the loss
is scaled with `scale_loss`. On 8 CPU devices the run equals the same program on one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import mpjax
from tests.helpers.sharding import assert_trees_close

SEQ, BATCH, EMBED, MLP, VOCAB, HEADS, HEAD_DIM = 8, 8, 16, 32, 32, 8, 4
STEPS = 3


@jax.tree_util.register_pytree_with_keys_class
class dot_dict(dict):  # noqa: N801 (the cookbook's name)
    __setattr__ = dict.__setitem__
    __getattr__ = dict.__getitem__

    def tree_flatten_with_keys(self):
        keys = tuple(sorted(self))
        return tuple((jax.tree_util.DictKey(k), self[k]) for k in keys), keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values, strict=True))


# The cookbook's shardings: weights split over "fsdp" on one axis, activations on the batch.
SPECS = dot_dict(
    embed=P(None, None),
    qkv=P(None, "fsdp", None, None),
    att_out=P("fsdp", None, None),
    mlp_in=P("fsdp", None),
    mlp_out=P(None, "fsdp"),
    out_kernel=P("fsdp", None),
    act_seq=P("fsdp", None, None),
    act_att=P("fsdp", None, None, None),
    act_hidden=P("fsdp", None, None),
)


def init_params() -> dot_dict:
    key = map(functools.partial(jax.random.fold_in, jax.random.key(0)), range(100))
    he_init = jax.nn.initializers.he_normal(1, 1)
    dtype = jnp.bfloat16
    params = dot_dict(layer=dot_dict())
    params.embedding = he_init(next(key), (VOCAB, EMBED), dtype, SPECS.embed)
    params.linear_out = dot_dict(kernel=he_init(next(key), (EMBED, VOCAB), dtype, SPECS.out_kernel))
    params.layer.attention = dot_dict(
        qkv=he_init(next(key), (3, EMBED, HEADS, HEAD_DIM), dtype, SPECS.qkv),
        out=he_init(next(key), (HEADS, HEAD_DIM, EMBED), dtype, SPECS.att_out),
    )
    params.layer.mlp = dot_dict(
        in_kernel=he_init(next(key), (EMBED, MLP), dtype, SPECS.mlp_in),
        out_kernel=he_init(next(key), (MLP, EMBED), dtype, SPECS.mlp_out),
    )
    return params


def model_apply(params: dot_dict, tokens: jax.Array) -> jax.Array:
    out = params.embedding.at[tokens].get(out_sharding=SPECS.act_seq)
    block = params.layer
    att_skip = out
    qkv = jnp.einsum("bsd,3dkh->bs3kh", out, block.attention.qkv, out_sharding=SPECS.act_att)
    out = jax.nn.dot_product_attention(
        qkv[:, :, 0, :], qkv[:, :, 1, :], qkv[:, :, 2, :], is_causal=True
    )
    out = jnp.einsum("bskh,khd->bsd", out, block.attention.out, out_sharding=SPECS.act_seq)
    out += att_skip
    out *= jax.lax.rsqrt(jnp.mean(out**2, axis=-1, keepdims=True) + 1e-6)
    mlp_skip = out
    out = jnp.einsum("bsd,dh->bsh", out, block.mlp.in_kernel, out_sharding=SPECS.act_hidden)
    out = jax.nn.gelu(out)
    out = jnp.einsum("bsh,hd->bsd", out, block.mlp.out_kernel, out_sharding=SPECS.act_seq)
    out += mlp_skip
    out *= jax.lax.rsqrt(jnp.mean(out**2, axis=-1, keepdims=True) + 1e-6)
    return jnp.einsum("bsd,dl->bsl", out, params.linear_out.kernel, out_sharding=SPECS.act_seq)


OPT = mpjax.loss_scaled(
    optax.adam(1e-2), mpjax.DynamicLossScale(initial_scale=2.0**8, growth_interval=2)
)


@jax.jit
def init_train_state() -> dot_dict:
    state = dot_dict(params=init_params())
    state.opt = OPT.init(state.params)
    return state


@jax.jit
def train_step(state: dot_dict, batch: dict) -> tuple[dot_dict, dict]:
    def loss_fn(params):
        logits = mpjax.autocast(model_apply, "p=bf16,c=bf16,o=f32")(params, batch["observed_ids"])
        labels = jax.nn.one_hot(batch["target_ids"], VOCAB)
        loss = -(labels * jax.nn.log_softmax(logits)).sum(axis=-1).mean()
        return mpjax.scale_loss(loss, state.opt), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(state.params)
    updates, opt = OPT.update(grads, state.opt, state.params)
    new = dot_dict(params=optax.apply_updates(state.params, updates), opt=opt)
    return new, {"train_loss": loss, "loss_scale": mpjax.get_loss_scale(opt)}


def _batch(step: int) -> dict:
    rng = np.random.default_rng(step)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    sharding = P("fsdp")
    put = functools.partial(jax.make_array_from_process_local_data, sharding)
    return {"observed_ids": put(ids[:, :-1]), "target_ids": put(ids[:, 1:])}


def _train(devices: int):
    mesh = jax.make_mesh(
        (devices,), ("fsdp",), (AxisType.Explicit,), devices=jax.devices()[:devices]
    )
    with jax.set_mesh(mesh):
        state = init_train_state()
        metrics = []
        for step in range(STEPS):
            state, m = train_step(state, _batch(step))
            metrics.append(m)
        sharding = jax.typeof(state.params.layer.mlp.in_kernel).sharding.spec
        return jax.device_get((state.params, metrics)), sharding


def test_cookbook_train_step_with_autocast_and_loss_scaled_on_8_devices_matches_1():
    (params, metrics), spec = _train(8)
    (want_params, want_metrics), _ = _train(1)
    assert spec == SPECS.mlp_in  # the params stay sharded as initialised
    assert isinstance(params, dot_dict) and params.layer.mlp.in_kernel.dtype == jnp.bfloat16
    losses = [float(m["train_loss"]) for m in metrics]
    assert losses[-1] < losses[0], losses
    np.testing.assert_allclose(losses, [float(m["train_loss"]) for m in want_metrics], rtol=2e-2)
    assert [float(m["loss_scale"]) for m in metrics] == [2.0**8, 2.0**9, 2.0**9]
    assert_trees_close(params, want_params, 2e-2, what="params")
