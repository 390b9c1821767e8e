"""Every Pallas kernel lowers for CUDA on this CPU-only machine, as a Triton custom call.

Lowering runs the Pallas-to-Triton translation (block shapes, masks, reductions, loops), which
interpret mode never exercises; compiling the Triton IR to PTX needs the GPU toolchain (see
the benchmark suite's `opt-step` cases for a deviceless H100 compile).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from mpjax._src.kernels import common
from mpjax.pallas import channel_stats, conv_epilogue, unscale_and_check

TRITON = "__gpu$xla.gpu.triton"


def _cuda_text(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _kernels(text):
    """Names of the Triton kernels in a lowered module."""
    return sorted(
        line.split('name = "')[1].split('"')[0]
        for line in text.splitlines()
        if TRITON in line and 'name = "' in line
    )


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_unscale_and_check(impl):
    grads = {
        "a": jnp.ones((3,), jnp.float16),
        "b": jnp.ones((33, 70), jnp.bfloat16),
        "c": jnp.ones((9000,), jnp.float32),
        "i": jnp.ones((2,), jnp.int32),
    }
    fn = functools.partial(unscale_and_check, impl=impl)
    text = _cuda_text(fn, grads, jnp.float32(2.0))
    assert _kernels(text) == ["mpjax_unscale_and_check"]
    if impl == "auto":  # the CPU lowering of "auto" is the XLA path
        cpu = jax.jit(fn).trace(grads, jnp.float32(2.0)).lower(lowering_platforms=("cpu",))
        assert TRITON not in cpu.as_text()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("activation", ["relu", "silu", "none"])
def test_conv_epilogue_forward_and_backward(activation, residual):
    y = jnp.ones((2, 5, 7, 300), jnp.bfloat16)
    v = jnp.ones((300,), jnp.float32)
    res = y if residual else None

    def loss(y, scale, shift, res):
        out = conv_epilogue(y, scale, shift, res, activation=activation, impl="pallas")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    text = _cuda_text(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), y, v, v, res)
    assert _kernels(text) == ["mpjax_conv_epilogue_bwd", "mpjax_conv_epilogue_fwd"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_conv_epilogue_dtypes_and_auto(dtype):
    y = jnp.ones((3, 3, 3, 24), dtype)
    v = jnp.ones((24,), jnp.float32)
    fn = functools.partial(conv_epilogue, activation="relu", out_dtype=jnp.float32, impl="auto")
    assert _kernels(_cuda_text(fn, y, v, v)) == ["mpjax_conv_epilogue_fwd"]


def test_channel_stats_forward_and_backward():
    y = jnp.ones((4, 6, 6, 96), jnp.bfloat16)
    assert _kernels(_cuda_text(functools.partial(channel_stats, impl="pallas"), y)) == [
        "mpjax_channel_stats"
    ]

    def loss(y):
        s, ss = channel_stats(y, impl="pallas")
        return jnp.sum(s) + jnp.sum(ss)

    assert _kernels(_cuda_text(jax.value_and_grad(loss), y)) == ["mpjax_channel_stats"]


def test_reducing_kernels_with_row_group_loops(monkeypatch):
    # Large inputs make each program loop over several row blocks; force that on a small one.
    monkeypatch.setattr(common, "MAX_ROW_GROUPS", 2)
    y = jnp.ones((1, 9, 8, 300), jnp.bfloat16)
    v = jnp.ones((300,), jnp.float32)

    def loss(y, scale, shift):
        s, ss = channel_stats(y, impl="pallas")
        out = conv_epilogue(y, scale * s, shift + ss, y, activation="silu", impl="pallas")
        return jnp.sum(out.astype(jnp.float32))

    # value_and_grad: with `jax.grad` alone the forward epilogue's output is dead code.
    text = _cuda_text(jax.value_and_grad(loss, argnums=(0, 1, 2)), y, v, v)
    assert _kernels(text) == [
        "mpjax_channel_stats",
        "mpjax_conv_epilogue_bwd",
        "mpjax_conv_epilogue_fwd",
    ]
