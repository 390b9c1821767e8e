"""`mpjax.nn.linear_cross_entropy` under FSDP on 8 simulated devices: the kernel, split
along the vocabulary, is gathered once before the loop over vocabulary tiles, never per
tile (issue 36: under Auto axes the partitioner split the tiles along the loop and every
step gathered the whole kernel to slice its tile), on every kind of mesh; values as on
one device.

The optimized HLO is read with `mpjax._src.analysis.collectives` (the collectives inside
`while` bodies, with their trip counts).
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax._src.analysis.collectives import collectives, loop_collectives
from mpjax.nn import linear_cross_entropy

D, V, TOKENS, CHUNK = 16, 256, 64, 4  # 64 tokens, 256 classes: 16 tiles of 16 columns


def _inputs(dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((TOKENS, D)), dtype)
    k = jnp.asarray(rng.standard_normal((D, V)) * 0.5, dtype)
    labels = jnp.asarray(rng.integers(0, V, TOKENS), jnp.int32)
    return x, k, labels


def _loss(x, k, labels):
    return linear_cross_entropy(x, k, labels, chunk_size=CHUNK, dtype=x.dtype)


STEP = jax.jit(jax.value_and_grad(_loss, (0, 1)))


def _place(mesh, x, k, labels, token_axes, kernel_axis):
    tokens = NamedSharding(mesh, P(token_axes))
    return (
        jax.device_put(x, tokens),
        jax.device_put(k, NamedSharding(mesh, P(None, kernel_axis))),
        jax.device_put(labels, tokens),
    )


def _trips(text: str) -> list[int]:
    """The known trip counts of the `while` loops of optimized HLO text."""
    return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text)]


def _loop_gathers(text: str) -> list:
    """(shape, runs) of the all-gathers inside `while` loops."""
    return [(c.shape, runs) for c, runs in loop_collectives(text) if c.op == "all-gather"]


def _gathered_bytes(text: str) -> int:
    return sum(c.bytes for c in collectives(text) if c.op == "all-gather")


@pytest.mark.parametrize("set_mesh", [False, True], ids=["jit-shardings", "set_mesh"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_fsdp_kernel_is_gathered_once_before_the_vocabulary_loop(axis_type, set_mesh):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(getattr(AxisType, axis_type),))
    x, k, labels = _inputs()
    want = STEP(x, k, labels)
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        args = _place(mesh, x, k, labels, "fsdp", "fsdp")
        compiled = STEP.lower(*args).compile()
        got = compiled(*args)
    text = compiled.as_text()
    assert _trips(text) == [16, 16]  # the forward and backward loops
    assert not _loop_gathers(text), f"gathered inside the vocabulary loop: {_loop_gathers(text)}"
    assert 0 < _gathered_bytes(text) <= 4 * k.size  # once (XLA:CPU moves bfloat16 as float32)
    if axis_type == "Explicit":  # the kernel's gradient comes back split like the kernel
        assert got[1][1].sharding.is_equivalent_to(args[1].sharding, 2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-6), got, want)


def test_shard_map_over_the_batch_gathers_the_kernel_of_its_auto_axis_before_the_loop():
    """Inside `shard_map` over `data`, the kernel split over the Auto axis `fsdp` is
    gathered before the loops, not in them (float32: XLA:CPU aborts on the bfloat16
    all-reduce of the kernel's gradient over `data`, AllReducePromotion)."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    x, k, labels = _inputs(jnp.float32)

    @jax.jit
    @jax.value_and_grad
    def step(k, x, labels):
        @jax.shard_map(in_specs=(P("data"), P(), P("data")), out_specs=P(), axis_names={"data"})
        def local(x, k, labels):
            return jax.lax.pmean(_loss(x, k, labels), "data")

        return local(x, k, labels)

    want = jax.value_and_grad(_loss, 1)(x, k, labels)
    with jax.set_mesh(mesh):
        xs, ks, ls = _place(mesh, x, k, labels, ("data", "fsdp"), "fsdp")
        compiled = step.lower(ks, xs, ls).compile()
        got = compiled(ks, xs, ls)
    text = compiled.as_text()
    assert not _loop_gathers(text), _loop_gathers(text)
    kernels = [c for c in collectives(text) if c.op == "all-gather" and c.shape == (D, V)]
    assert 1 <= len(kernels) <= 2, kernels  # for the forward loop (and the backward's)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-6), got, want)


def test_shard_map_over_every_axis_with_a_replicated_kernel():
    """Every axis Manual, the kernel replicated (data parallel): each device's loss is its
    own tokens', the kernel's gradient summed over the devices once (crashed before: the
    `custom_vjp`'s kernel gradient varied over the axis its kernel did not)."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    x, k, labels = _inputs()

    def one(x, k, labels):
        loss, (gx, gk) = jax.value_and_grad(_loss, (0, 1))(x, k, labels)
        return loss[None], gx, gk

    local = jax.shard_map(
        one, mesh=mesh, in_specs=(P("fsdp"), P(), P("fsdp")), out_specs=(P("fsdp"), P("fsdp"), P())
    )
    args = _place(mesh, x, k, labels, "fsdp", None)
    compiled = jax.jit(local).lower(*args).compile()
    text = compiled.as_text()
    assert not loop_collectives(text), loop_collectives(text)
    assert [c.op for c in collectives(text)] == ["all-reduce"]  # the kernel's gradient
    losses, gx, gk = compiled(*args)
    shards = [slice(i * TOKENS // 8, (i + 1) * TOKENS // 8) for i in range(8)]
    want = [jax.value_and_grad(_loss, (0, 1))(x[s], k, labels[s]) for s in shards]
    close = {"rtol": 2e-2, "atol": 1e-6}
    np.testing.assert_allclose(losses, [float(w[0]) for w in want], **close)
    np.testing.assert_allclose(gx, jnp.concatenate([w[1][0] for w in want]), **close)
    np.testing.assert_allclose(gk, sum(w[1][1].astype(jnp.float32) for w in want), **close)
