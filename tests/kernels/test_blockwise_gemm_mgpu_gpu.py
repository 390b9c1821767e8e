"""The Mosaic GPU blockwise GEMM compiled for an H100 without one (deviceless, gpu-aot python).

`tests/kernels/_mgpu_hlo.py` runs under `$MPJAX_GPU_AOT_PYTHON` with Mosaic GPU's dumps on:
the kernel alone at a wide-LM shape must assemble for sm_90a to fp8 `wgmma` fed by TMA, with
warp-specialised register counts and no spills; the wide LM's blockwise train step with
`block_lowering="native"` must run every block GEMM (forward, input and weight gradient of
each Dense layer but the bf16 head) as that kernel, and no other fp8 GEMM.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter

import pytest

from mpjax._src.analysis.hlo_flops import BLOCKWISE_GEMM
from mpjax._src.kernels.blockwise_gemm_mgpu import KERNEL_NAME
from tests.helpers.gpu import ROOT, _gpu_aot_python, gpu_aot_env


def _compile(tmp, *args: str) -> dict:
    out, dumps = tmp / "mgpu.json", tmp / "dumps"
    dumps.mkdir()
    env = dict(
        gpu_aot_env(),
        MOSAIC_GPU_DUMP_PTX="1",
        MOSAIC_GPU_DUMP_PTXAS="1",
        MOSAIC_GPU_DUMP_TO=str(dumps),
    )
    proc = subprocess.run(
        [_gpu_aot_python(), str(ROOT / "tests/kernels/_mgpu_hlo.py"), *args, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("mgpu"))


@pytest.fixture(scope="module")
def kernel(compiled):
    return compiled["kernel"]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("mgpu-step"), "--step")["step"]


def test_the_cost_model_counts_the_mosaic_kernel():
    assert f"{BLOCKWISE_GEMM}_mgpu" == KERNEL_NAME


def test_kernel_is_one_mosaic_gpu_call(kernel):
    assert kernel["custom_calls"] == [["mosaic_gpu_v2", f"jit(gemm)/{KERNEL_NAME}/mpmd_map"]]


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
    # forward, input and weight gradient of one dense layer; a B200 has no wgmma: Triton
    assert compiled["routing"]["h100"] == {"mosaic_gpu": 3, "triton": 0}, compiled["routing"]
    assert compiled["routing"]["b200"] == {"mosaic_gpu": 0, "triton": 3}, compiled["routing"]


def _layer(path: str) -> str:
    """`"['DecoderBlock_0']['Dense_0']['kernel']"` -> `"DecoderBlock_0/Dense_0"`."""
    return "/".join(re.findall(r"\['([^']+)'\]", path)[:-1])


def _called_layer(op_name: str) -> str:
    """`"jit(step)/transpose(jvp(LM))/DecoderBlock_3/Dense_1/cond/..."` -> its layer."""
    return re.search(r"\(LM\)\)?/(.*?)/cond/", op_name).group(1)


@pytest.mark.slow
def test_wide_lm_step_runs_every_block_gemm_in_the_mosaic_kernel(step):
    head = "['head']['kernel']"
    layers = {_layer(p) for p, shape in step["kernels"] if len(shape) >= 2 and p != head}
    assert len(layers) == 4 * 6, layers  # 4 blocks: query, key, value, out, 2 MLP Dense
    calls = [name for target, name in step["custom_calls"] if target.startswith("mosaic_gpu")]
    assert all(f"/{KERNEL_NAME}/" in name for name in calls), calls
    # per layer: the forward GEMM and both backward ones (input and weight gradient)
    forward = Counter(_called_layer(n) for n in calls if "transpose(" not in n)
    backward = Counter(_called_layer(n) for n in calls if "transpose(" in n)
    assert forward == dict.fromkeys(layers, 1), forward
    assert backward == dict.fromkeys(layers, 2), backward
    # every fp8 GEMM of the program is the kernel (none left to Triton or XLA)
    fp8 = [g for g in step["gemms"] if "f8" in g[0] or "f8" in g[1]]
    assert len(fp8) == 72 and all(g[3] == "mosaic_gpu_v2" for g in fp8), fp8
    assert all(g[:2] == ["f8e4m3fn", "f8e4m3fn"] for g in fp8), fp8
    # the rest: the head's three bf16 GEMMs and cuDNN attention
    rest = [g for g in step["gemms"] if g not in fp8]
    assert all(
        g[:2] == ["bf16", "bf16"] and ("head" in g[2] or g[3].startswith("__cudnn$fmha"))
        for g in rest
    ), rest
