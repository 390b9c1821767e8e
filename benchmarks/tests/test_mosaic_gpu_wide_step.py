"""The wide LM's blockwise step (`block_lowering="native"`) compiled for one H100 without one:
every block GEMM (forward, input and weight gradient of each Dense layer but the bf16 head)
runs in mpjax's Mosaic GPU kernel, and no other fp8 GEMM (`_mgpu_step_hlo.py`, gpu-aot)."""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter

import pytest

from mpjax._src.kernels.blockwise_gemm_mgpu import KERNEL_NAME
from tests.helpers.gpu import ROOT, _gpu_aot_python, gpu_aot_env


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    out = tmp_path_factory.mktemp("mgpu-step") / "step.json"
    proc = subprocess.run(
        [_gpu_aot_python(), str(ROOT / "benchmarks/tests/_mgpu_step_hlo.py"), "--json", str(out)],
        cwd=ROOT,
        env=gpu_aot_env(),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["step"]


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
