"""Emulated low-precision numbers survive XLA:GPU: a quantise -> dequantise round trip is not
simplified away (XLA:GPU drops `f32 -> f8 -> f32` converts under its default excess
precision, which made emulated block-scaled GEMMs on a GPU compute without any rounding).

`tests/fp8/_roundtrip_hlo.py` compiles each program for a deviceless H100 under the python
named by `$MPJAX_GPU_AOT_PYTHON` and counts the HLO instructions of the low-precision format.
"""

from __future__ import annotations

import pytest

from tests.helpers.gpu import _run_json


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return _run_json("tests/fp8/_roundtrip_hlo.py", tmp=tmp_path_factory.mktemp("roundtrip"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "program",
    [
        "tensorwise/roundtrip",
        "mxfp8/roundtrip",
        "nvfp4/roundtrip",
        "blockwise/roundtrip",
        "mxfp8/emulated-step",
        "nvfp4/emulated-step",
        "blockwise/emulated-step",
    ],
)
def test_the_low_precision_values_exist_in_the_h100_program(counts, program):
    assert counts[program] > 0, counts
