"""`block_lowering="auto"` follows the GPU a GEMM is traced for, not only JAX's default device.

A step compiled ahead of time for a GPU (arguments placed on a mesh of CUDA devices, a
deviceless topology, or a mesh set with `jax.set_mesh`) gets the native lowering where that GPU
has it; `fp8_ops` says "emulated" wherever it does not. The abstract devices below stand for
those targets on this CPU-only machine (the deviceless H100 compile is checked by the GPU cost
guard, tests/integration/test_gpu_cost_guard.py).
"""

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.fp8.block_dot import target_capability
from mpjax.fp8 import fp8_ops, native_block_gemms

BLOCKS = ("blockwise", "mxfp8", "nvfp4")
# (device kind, platform) -> the block recipes native there under "auto": cuDNN's MXFP8 and
# NVFP4 GEMMs on Blackwell; blockwise (mpjax's own kernel) nowhere, since no measurement in
# the calibration table says it is faster natively (on Hopper it measured 2.09x bf16)
NATIVE = {
    ("NVIDIA H100 80GB HBM3", "cuda"): set(),
    ("NVIDIA H200", "cuda"): set(),
    ("NVIDIA B200", "cuda"): {"mxfp8", "nvfp4"},
    ("NVIDIA A100-SXM4-80GB", "cuda"): set(),
    ("cpu", "cpu"): set(),
}


def _mesh(kind: str, platform: str):
    device = mesh_lib.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    return mesh_lib.AbstractMesh((1,), ("x",), abstract_device=device)


def test_on_this_cpu_auto_is_emulated():
    assert target_capability(jnp.ones(2)) == 0.0
    for scaling in BLOCKS:
        assert not native_block_gemms(mpjax.Fp8Recipe(scaling))


@pytest.mark.parametrize(("kind", "platform"), list(NATIVE))
@pytest.mark.parametrize("scaling", BLOCKS)
def test_auto_follows_the_operands_placement(kind, platform, scaling):
    aval = jax.core.ShapedArray(
        (256, 256), jnp.float32, sharding=NamedSharding(_mesh(kind, platform), P())
    )
    want = scaling in NATIVE[kind, platform]
    assert native_block_gemms(mpjax.Fp8Recipe(scaling), aval, aval) == want
    # an explicit lowering wins over the target
    assert native_block_gemms(mpjax.Fp8Recipe(scaling, block_lowering="emulated"), aval) is False


@pytest.mark.parametrize(("kind", "platform"), list(NATIVE))
def test_fp8_ops_reports_the_lowering_of_the_mesh_in_context(kind, platform):
    x = jnp.ones((256, 256))
    for scaling in BLOCKS:
        with mesh_lib.use_abstract_mesh(_mesh(kind, platform)):
            (op,) = fp8_ops(lambda a, b: a @ b, mpjax.Fp8Recipe(scaling), x, x)
        native = scaling in NATIVE[kind, platform]
        assert op.lowering == f"{'native' if native else 'emulated'} {scaling}"
