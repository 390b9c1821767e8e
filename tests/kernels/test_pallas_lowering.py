"""Every Pallas kernel lowers for CUDA on this CPU-only machine, as a Triton custom call.

From jax 0.11 the Triton lowering needs a GPU named (`abstract_gpu`), and `impl="auto"` runs the
XLA reference (`TRITON_DEPRECATED`: JAX deprecates the Triton backend there).

Lowering runs the Pallas-to-Triton translation (block shapes, masks, reductions, loops), which
interpret mode never exercises; compiling the Triton IR to PTX needs the GPU toolchain (see
the benchmark suite's `opt-step` cases for a deviceless H100 compile).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest

from mpjax._src.kernels import common
from mpjax._src.kernels.dispatch import TRITON_DEPRECATED
from mpjax._src.kernels.gpu_target import H100_DEVICE_KIND, abstract_gpu, needs_abstract_gpu
from mpjax.pallas import channel_stats, conv_epilogue, unscale_and_check

TRITON = "__gpu$xla.gpu.triton"


def _cuda_text(fn, *args):
    with abstract_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _auto_kernels(names):
    """The kernels `impl="auto"` lowers for CUDA: none where the Triton backend is deprecated."""
    return [] if TRITON_DEPRECATED else names


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
    want = ["mpjax_unscale_and_check"]
    assert _kernels(text) == (want if impl == "pallas" else _auto_kernels(want))
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
    assert _kernels(_cuda_text(fn, y, v, v)) == _auto_kernels(["mpjax_conv_epilogue_fwd"])


def test_auto_lowers_for_cuda_without_deprecation_warnings():
    """`impl="auto"` (the default) lowers for CUDA with no DeprecationWarning on any jax: where
    JAX deprecates the Triton backend it runs the XLA reference, whose numbers match."""
    y = jnp.linspace(-2, 2, 3 * 4 * 24, dtype=jnp.float32).reshape(3, 4, 24)
    v = jnp.linspace(0.5, 1.5, 24, dtype=jnp.float32)
    grads = {"a": y.astype(jnp.bfloat16), "b": jnp.ones((9000,), jnp.float32)}

    def fn(y, v, grads):
        s, ss = channel_stats(y)
        out = conv_epilogue(y, v * s, v + ss, activation="silu")
        return out, unscale_and_check(grads, jnp.float32(2.0))

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        _cuda_text(fn, y, v, grads)
        got = jax.jit(fn)(y, v, grads)

    def reference(y, v):
        s, ss = channel_stats(y, impl="xla")
        return conv_epilogue(y, v * s, v + ss, activation="silu", impl="xla")

    assert jnp.array_equal(got[0], jax.jit(reference)(y, v))
    assert bool(got[1][1]) and jnp.array_equal(got[1][0]["a"], grads["a"] / 2)


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


def test_abstract_gpu_names_a_gpu_only_where_jax_asks_for_one():
    """jax >= 0.11 on a host without a GPU: lowering for "cuda" gets an H100 named, the axes of
    a mesh in context kept; never for CPU-only lowering, a device already named or jax 0.10."""
    asks = TRITON_DEPRECATED and jax.default_backend() != "gpu"
    assert needs_abstract_gpu(("cpu", "cuda")) == asks
    assert not needs_abstract_gpu(("cpu",)) and not needs_abstract_gpu(None)
    mesh = jax.sharding.AbstractMesh((2,), ("data",))
    with jax.sharding.use_abstract_mesh(mesh), abstract_gpu(("cuda",)):
        inner = jax.sharding.get_abstract_mesh()
        assert inner.axis_names == ("data",) and inner.axis_sizes == (2,)
        device = inner.abstract_device
        assert (device is not None and device.device_kind == H100_DEVICE_KIND) == asks
        assert not needs_abstract_gpu(("cuda",))  # named now (or never needed)
