"""Block-scaled recipes compile to native block-scaled GEMMs: B200 (MXFP8, NVFP4), H100
(blockwise).

`tests/fp8/_block_hlo.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
`gpu-aot` wheels, no GPU needed) and compiles one training step of a small transformer LM
under `autocast(..., fp8=Fp8Recipe(scaling, block_lowering="native"))`: for the B200 target
(cuDNN 9.10) the GEMMs become `__cudnn$blockScaledDot` custom calls; for the H100 target
blockwise's become mpjax's Pallas kernel (fp8 GEMMs promoted per 128-wide K block: the Mosaic
GPU kernel for `block_lowering="native"`, the Triton one for `"auto"`).
"""

from __future__ import annotations

import pytest

from mpjax._src.analysis.hlo_flops import BLOCKWISE_GEMM
from mpjax._src.kernels.blockwise_gemm import KERNEL_NAME
from tests.helpers.gpu import _run_json

BLOCK_DTYPES = {"mxfp8": "f8e4m3fn", "nvfp4": "f4e2m1fn", "blockwise": "f8e4m3fn"}


@pytest.fixture(scope="module")
def flops(tmp_path_factory):
    return _run_json("tests/fp8/_block_hlo.py", tmp=tmp_path_factory.mktemp("blocks"))


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_b200_step_runs_90_percent_of_gemm_flops_block_scaled(flops, scaling):
    by_dtype = flops[f"b200/{scaling}"]["flops"]
    block = by_dtype.get(BLOCK_DTYPES[scaling], 0)
    total = sum(by_dtype.values())
    # the rest: attention's batched products (bf16) and NVFP4's Hadamard transforms
    assert block / total >= 0.9, by_dtype


# The LM's dense GEMMs: qkv, proj, up, down, head, each forward, input and weight gradient.
DENSE_GEMMS = 5 * 3


@pytest.mark.slow
def test_h100_step_runs_every_dense_gemm_of_blockwise_in_fp8(flops):
    step = flops["h100/blockwise"]
    kernels = [g for g in step["gemms"] if BLOCKWISE_GEMM in g[2]]
    assert len(kernels) == DENSE_GEMMS, step["gemms"]
    assert all(g[:2] == ["f8e4m3fn", "f8e4m3fn"] for g in kernels), kernels
    # every other GEMM is attention's batched product (vmap'd einsums over heads)
    others = [g for g in step["gemms"] if g not in kernels]
    assert others and all("vmap(" in g[2] for g in others), others
    assert step["flops"]["f8e4m3fn"] > 0.9 * sum(step["flops"].values())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "scaling", "placed", "want"),
    [("b200", "mxfp8", "mesh", "native"), ("h100", "blockwise", "lower_step", "emulated")],
)
def test_auto_lowering_compiled_for_the_gpu(flops, target, scaling, placed, want):
    """`block_lowering="auto"` with the arguments on the deviceless GPU's mesh, or through
    `lower_step` (`mpjax.report`), lowers to exactly the program of the lowering auto picks
    for that GPU: MXFP8's cuDNN GEMMs natively on the B200 (emulated off a GPU); blockwise
    emulated on the H100, since the calibration table's one Hopper measurement timed the
    native Pallas GEMM slower than bf16 (`core.calibration.native_measured_faster`). The
    native step's FLOPs are checked above (`test_b200_step_runs_...`, `test_h100_step_...`)."""
    digests = flops[f"{target}/{scaling}/auto/{placed}"]
    other = "emulated" if want == "native" else "native"
    assert digests["auto"] == digests[want] != digests[other], digests
    native = flops[f"{target}/{scaling}"]["flops"]
    assert native.get(BLOCK_DTYPES[scaling], 0) > 0.9 * sum(native.values())


@pytest.mark.slow
def test_blockwise_native_on_the_h100_takes_mosaic_gpu_auto_runs_no_pallas_gemm(flops):
    """Blockwise through `lower_step` (`mpjax.report`) for the H100: `"native"` runs all 15
    dense GEMMs (forward, input and weight gradient) in the Mosaic GPU kernel, none left to
    Triton; `"auto"` runs none in a Pallas kernel (emulated, as the calibration decides)."""
    kernels = flops["h100/blockwise/auto/lower_step"]["kernels"]
    assert kernels["native"] == {"mosaic_gpu": DENSE_GEMMS, "triton": 0}, kernels
    assert kernels["auto"] == kernels["emulated"] == {"mosaic_gpu": 0, "triton": 0}, kernels


def test_the_cost_model_knows_the_kernel_by_its_name():
    assert BLOCKWISE_GEMM == KERNEL_NAME


@pytest.mark.slow
@pytest.mark.parametrize("key", ["b200/mxfp8", "b200/nvfp4", "h100/blockwise"])
def test_native_step_quantises_each_tensor_in_one_fused_kernel(flops, key):
    """Each dense GEMM's x and w (forward) and g (backward) go through the fused quantiser
    (`mpjax_block_quantize`, a Triton custom call): one launch per tensor, both copies
    (NVFP4's output gradients too: their stochastically rounded Hadamard columns)."""
    launches = flops[key]["quantize"]
    assert len(launches) == DENSE_GEMMS, launches
    assert all(nbytes > 0 for nbytes in launches)


# What the quantisations read and write (`_block_hlo.py`'s `io`, `mpjax._src.analysis.
# quantise_io`), per role of the quantised tensor.
ROLES = [(key, role) for key in ("b200/mxfp8", "b200/nvfp4", "h100/blockwise") for role in "xwg"]


def _float32(arrays: list, role: str) -> list:
    """The float32 arrays (`"roles dtype[shape] kernel (op)"`) that `role`'s quantisations
    read or write (or that no quantisation was found to touch)."""
    return [
        a
        for a in arrays
        if a.split()[1].startswith("f32[") and (role in a.split()[0] or a.split()[0] == "?")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("key", "role"), ROLES)
def test_native_step_has_no_float32_transpose_of_a_quantised_operand(flops, key, role):
    """No float32 array that a quantisation of an x, w or g reads or writes is a transposed
    copy (the fused quantiser transposes in its kernel; the bf16 ones are the attention's)."""
    transposes = flops[key]["io"]["transposes"]
    assert _float32(transposes, role) == [], transposes


@pytest.mark.slow
@pytest.mark.parametrize(("key", "role"), ROLES)
def test_native_step_has_no_float32_copy_of_a_quantised_operand(flops, key, role):
    """No float32 array as big as a quantised tensor is written by its quantisation, or
    only for it (the float32 tensors the fused quantiser reads are the model's own)."""
    copies = flops[key]["io"]["f32_copies"]
    assert _float32(copies, role) == [], copies


@pytest.mark.slow
@pytest.mark.parametrize(("key", "role"), ROLES)
def test_native_step_quantises_each_tensor_in_one_kernel(flops, key, role):
    """x, w and g of each of the 5 dense GEMMs: each quantised by one fused kernel launch."""
    tensors = [t for t in flops[key]["io"]["tensors"] if t[0] == role]
    assert tensors == [[role, 1, True]] * 5, flops[key]["io"]["tensors"]
