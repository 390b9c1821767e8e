"""fp8 in `mpjax.report` (which GEMMs ask for fp8, which run as fp8) and `mpjax.numerics` on
the delayed-fp8 meta (scale, amax history, headroom). The H100 half: test_report_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from tests.helpers.report import fp8_step

E4, E5 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def test_report_names_the_fp8_gemms_and_that_cpu_runs_none_in_fp8():
    step, variables, x = fp8_step()
    r = mpjax.report(step, variables, x)
    fp8 = [g for g in r.gemms if g.fp8]
    assert sorted({g.path for g in fp8}) == ["Dense_0", "mid"]  # `head` excluded, conv not fp8
    assert all(g.path in ("Dense_0", "mid") for g in r.gemms if g.fp8)
    assert not any(g.fp8 for g in r.gemms if g.path in ("head", "conv"))
    forward = {(g.lhs_dtype, g.rhs_dtype) for g in fp8 if g.direction == "forward"}
    backward = {(g.lhs_dtype, g.rhs_dtype) for g in fp8 if g.direction == "backward"}
    assert forward == {(E4, E4)} and backward <= {(E5, E4), (E4, E5)}
    assert len(fp8) == 5  # Dense_0: forward, weight gradient; mid: forward and both gradients
    assert not any(g.runs_fp8 for g in r.gemms)  # XLA:CPU runs them in float32
    assert "5 fp8 GEMMs (Dense_0, mid), 0 run as fp8 on cpu" in r.summary()


@pytest.fixture(scope="module")
def updated_meta():
    step, variables, x = fp8_step()
    recipe = mpjax.Fp8Recipe(scaling="delayed", exclude=("*/head",))
    grads = jax.jit(step)(variables, x)
    meta = mpjax.fp8.update_fp8_meta(variables["fp8_meta"], grads["fp8_meta"], recipe)
    return variables["fp8_meta"], meta, recipe


def test_numerics_on_initial_meta(updated_meta):
    initial, _, recipe = updated_meta
    n = mpjax.numerics({"fp8_meta": initial}, fp8_recipe=recipe)
    assert [(m.path, m.tensor) for m in n.fp8] == [
        (f"fp8_meta/{site}", t) for site in ("Dense_0", "mid") for t in ("x", "w", "g")
    ]
    assert all(m.scale == 1.0 and m.headroom == np.inf for m in n.fp8)
    assert [m.dtype for m in n.fp8[:3]] == [E4, E4, E5]


def test_numerics_on_updated_meta_shows_scale_history_and_headroom(updated_meta):
    _, meta, recipe = updated_meta
    n = mpjax.numerics({"fp8_meta": meta}, fp8_recipe=recipe)
    assert len(n.fp8) == 6
    for m in n.fp8:
        site = meta[m.path.split("/")[1]]
        row = "xwg".index(m.tensor)
        history = np.asarray(site["amax_history"][row], np.float64)
        scale = float(site["scale"][row])
        assert m.amax_history == tuple(history) and history[0] > 0
        assert m.scale == scale
        top = 448.0 if m.tensor in "xw" else 57344.0
        assert m.headroom == pytest.approx(top / (history[0] * scale), rel=1e-12)
        # The scale was just computed from this amax (margin 0): the newest tensor just fits
        # (float32 rounding of the scale aside; a power-of-two scale leaves < 2x spare).
        assert 1.0 - 1e-6 <= m.headroom < 2.0
    assert "fp8 fp8_meta/Dense_0 x (float8_e4m3fn): scale" in str(n)
    d = n.to_dict()["fp8"][0]
    assert d["dtype"] == "float8_e4m3fn" and len(d["amax_history"]) == recipe.amax_history_len
