"""The Mosaic GPU blockwise GEMM compiled for an H100 without one (deviceless, gpu-aot python).

`tests/kernels/_mgpu_hlo.py` runs under `$MPJAX_GPU_AOT_PYTHON` with Mosaic GPU's dumps on:
the kernel alone at a wide-LM shape must assemble for sm_90a to fp8 `wgmma` fed by TMA, with
warp-specialised register counts and no spills; `block_lowering="native"` runs it on Hopper
only. The wide LM's whole step: benchmarks/tests/test_mosaic_gpu_wide_step.py.
"""

from __future__ import annotations

import re

import pytest

from mpjax._src.analysis.hlo_flops import BLOCKWISE_GEMM
from mpjax._src.kernels.blockwise_gemm_mgpu import KERNEL_NAME
from tests.helpers.gpu import _run_json


def _compile(tmp, *args: str) -> dict:
    dumps = tmp / "dumps"
    dumps.mkdir()
    env = {"MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1"}
    env["MOSAIC_GPU_DUMP_TO"] = str(dumps)
    return _run_json("tests/kernels/_mgpu_hlo.py", *args, tmp=tmp, env=env, timeout=1800)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("mgpu"))


@pytest.fixture(scope="module")
def kernel(compiled):
    return compiled["kernel"]


def test_the_cost_model_counts_the_mosaic_kernel():
    assert f"{BLOCKWISE_GEMM}_mgpu" == KERNEL_NAME


def test_kernel_is_one_mosaic_gpu_call(kernel):
    # inside the kernel's own jit (`_padded_gemm`: one lowering per shape in a program)
    name = f"jit(gemm)/jit(_padded_gemm)/{KERNEL_NAME}/mpmd_map"
    assert kernel["custom_calls"] == [["mosaic_gpu_v2", name]]


def test_kernel_assembles_for_hopper_to_fp8_wgmma_fed_by_tma(kernel):
    (ptx,) = kernel["ptx"].values()
    assert ptx["target"] == ["sm_90a"]
    # one 64x128 fp8 x fp8 -> f32 wgmma per 32 of K (4 per promoted 128-wide slice)
    assert ptx["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"]
    assert ptx["tma_loads"] > 0  # bulk tensor copies into shared memory
    # warp specialisation: the memory warpgroup gives registers to the consumers
    assert ptx["setmaxnreg"] == ["setmaxnreg.dec", "setmaxnreg.inc"]


def test_kernel_spills_nothing(kernel):
    report = kernel["ptxas"]
    assert "for 'sm_90a'" in report, report
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers * 128 * 3 <= 65536, report  # 3 warpgroups fit one SM's register file


def test_native_blockwise_takes_the_mosaic_kernel_on_hopper_only(compiled):
    # forward, input and weight gradient of one dense layer; a B200 has no wgmma: the Triton
    # kernel, or XLA's reference on a jax that deprecates Triton (the compiling jax's version)
    triton = 0 if tuple(map(int, compiled["jax"].split(".")[:2])) >= (0, 11) else 3
    assert compiled["routing"]["h100"] == {"mosaic_gpu": 3, "triton": 0}, compiled["routing"]
    assert compiled["routing"]["b200"] == {"mosaic_gpu": 0, "triton": triton}, compiled["routing"]
