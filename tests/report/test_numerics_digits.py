"""`mpjax.numerics` on the digits model's gradients reports what underflow_demo.py measures.

The demo multiplies the loss by 2^-14 and counts the float32 gradient's non-zero entries that
float16 training (no loss scaling) returns as exactly zero; `numerics` on the float16
gradient at those entries reports the same fraction as its `zeros`. On the float32 gradient it
shows why: most values sit in float16's subnormal range or below it, and a 2^15 loss scale
moves every one of them into the normal range.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpjax
from examples import train_digits, underflow_demo

SMALL = dict(width=8, num_blocks=1)
M = underflow_demo.DEFAULT_MULTIPLIER


@pytest.fixture(scope="module")
def digits():
    return train_digits.load_data()


def _pooled(result, kind: str, fmt: str = "float16") -> float:
    """A per-leaf fraction of non-zero finite values, pooled over the leaves."""
    nonzero = [r.size * (1 - r.zeros - r.nonfinite) for r in result.records]
    total = sum(nonzero)
    pairs = zip(result.records, nonzero, strict=True)
    return sum(getattr(r, kind)[fmt] * n for r, n in pairs) / total


def test_float16_gradient_zeros_are_the_demos_flushed_fraction(digits):
    flushed, _ = underflow_demo.gradient_underflow("fp16-noscale", M, digits, **SMALL)
    ref, low = underflow_demo.gradients("fp16-noscale", M, digits, **SMALL)
    pairs = enumerate(zip(ref, low, strict=True))
    at_support = {str(i): (g[r != 0]).astype(np.float32) for i, (r, g) in pairs}
    result = mpjax.numerics(at_support, formats=("float16",))
    size = sum(r.size for r in result.records)
    zeros = sum(r.zeros * r.size for r in result.records) / size
    assert flushed > 0.1
    assert zeros == pytest.approx(flushed, rel=1e-12)


def test_loss_scaling_lifts_the_gradient_out_of_float16_underflow(digits):
    ref, _ = underflow_demo.gradients("fp32", M, digits, **SMALL)
    plain = mpjax.numerics([r.astype(np.float32) for r in ref], formats=("float16",))
    scaled = mpjax.numerics([(r * 2.0**15).astype(np.float32) for r in ref], formats=("float16",))
    low = [np.abs(r[r != 0]) for r in ref]
    below_normal = sum((a < 2.0**-14).sum() for a in low) / sum(a.size for a in low)
    assert _pooled(plain, "underflow") + _pooled(plain, "subnormal") == pytest.approx(
        below_normal, rel=1e-12
    )
    assert below_normal > 0.5
    assert _pooled(scaled, "underflow") == 0 and _pooled(scaled, "subnormal") == 0
    flushed, _ = underflow_demo.gradient_underflow("fp16", M, digits, loss_scale=2.0**15, **SMALL)
    assert flushed == 0.0  # the demo agrees: nothing flushes under loss scaling


def test_demo_plot_writes_the_histogram(digits, tmp_path):
    png = tmp_path / "g.png"
    result = underflow_demo.plot_gradient_histogram(png, data=digits, **SMALL)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["unscaled"].subnormal["float16"] > 0.5
    assert result["scaled"].underflow["float16"] == result["scaled"].subnormal["float16"] == 0
