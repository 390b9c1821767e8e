"""`quantize_orientations`' XLA reference compiled for a deviceless H100 moves 8-bit and 4-bit
arrays, not float32 ones.

The reference is what every block-scaled step quantises with where the fused kernel does not
run: the emulated lowering, and the native one on jax >= 0.11 (which deprecates the Triton
backend the kernel lowers through). `tests/fp8/_quantize_xla_hlo.py` compiles it under the
gpu-aot python for a bfloat16 `x` `[1024, 2048]` as a step quantises an activation (`x`, both
copies), a weight (`w`) and an output gradient (`g`). Before 0.2 XLA wrote the NaN mask, a
float32 `|x|` and each block scale broadcast to `x`'s shape out to memory: 13x to 29x the
bytes of `x` per quantisation, where it now moves 5.1x to 5.6x (3x for 2-D weight blocks).
"""

from __future__ import annotations

import pytest

from tests.helpers.gpu import _run_json

KEYS = [f"{scaling}/{role}" for scaling in ("blockwise", "mxfp8", "nvfp4") for role in "xwg"]
# NVFP4's gradient columns are Hadamard-rotated before they are quantised: XLA writes the
# rotated float32 copy once (3 reductions and the quantisation read it)
ROTATED = "nvfp4/g"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return _run_json("tests/fp8/_quantize_xla_hlo.py", tmp=tmp_path_factory.mktemp("qx"))


@pytest.mark.parametrize("key", KEYS)
def test_reference_writes_no_wide_array_of_x_size_but_the_rotated_columns(compiled, key):
    """Every array a kernel writes with as many elements as `x` is an 8-bit or 4-bit copy
    (no NaN mask, no float32 `|x|`, no broadcast scales); NVFP4's gradient adds its
    Hadamard-rotated columns in float32, once."""
    wide = [a for a in compiled[key]["full_size"] if not a.startswith(("f8", "f4", "u8["))]
    if key == ROTATED:
        assert len(wide) == 1 and wide[0].startswith("f32["), wide
    else:
        assert wide == [], compiled[key]["full_size"]


@pytest.mark.parametrize("key", KEYS)
def test_reference_makes_no_float32_copy_or_transpose(compiled, key):
    """`quantise_io` finds no float32 copy of the quantised tensor (but NVFP4's rotated
    gradient columns) and no bfloat16 or float32 transpose of it: the columns copy is
    transposed in its 8-bit or 4-bit form."""
    copies = compiled[key]["float32_copies"]
    assert len(copies) == (key == ROTATED), copies
    assert compiled[key]["transposes"] == [], compiled[key]["transposes"]


@pytest.mark.parametrize("key", KEYS)
def test_reference_reads_and_writes_a_few_times_the_bytes_of_x(compiled, key):
    """Per copy XLA reads `x` twice (the block amaxes, then the quantisation) and writes the
    copy (at most half of `x`'s bytes), and may transpose one copy in its 8-bit form: at most
    6x the bytes of `x` for both copies; 3.5x for 2-D weight blocks (one quantisation, its
    transpose the other copy); NVFP4's rotated gradient columns at most 17x."""
    limit = {"blockwise/w": 3.5, "nvfp4/w": 3.5, ROTATED: 17.0}.get(key, 6.0)
    ratio = compiled[key]["bytes"] / compiled["x_bytes"]
    assert ratio <= limit, (ratio, compiled[key]["kernels"])
