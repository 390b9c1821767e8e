"""`mpjax.numerics` against NumPy float64 references: zeros, under/subnormal/overflow, histogram.

References cast the values with ml_dtypes (round to nearest even) and count what became zero,
subnormal or non-finite; the implementation compares magnitudes with thresholds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.report import numerics as numerics_module
from mpjax._src.report.formats import format_range
from mpjax._src.report.numerics import LOG2_RANGE

FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _values(seed: int = 0) -> np.ndarray:
    """Zeros, +-inf, NaN, float32 subnormals, every format's cast thresholds and neighbours,
    and log-uniform magnitudes of both signs over float32's range."""
    rng = np.random.default_rng(seed)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-40, 3e38]
    for name in FORMATS:
        r = format_range(name)
        for t in (r.flush_below, r.normal_from, r.overflow_from, r.max, r.smallest_subnormal):
            t32 = np.float32(t)
            down, up = np.nextafter(t32, np.float32(0)), np.nextafter(t32, np.float32(np.inf))
            special += [t32, down, up]
    random = np.exp2(rng.uniform(-149, 127, 4000)) * rng.choice([-1.0, 1.0], 4000)
    return np.concatenate([np.array(special, np.float32), random.astype(np.float32)])


def _reference(x: np.ndarray, fmt: str) -> dict:
    x32 = np.asarray(x, np.float32)
    x64 = x32.astype(np.float64)
    finite = np.isfinite(x64)
    nonzero = finite & (x64 != 0)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = x32.astype(getattr(ml_dtypes, fmt, None) or fmt).astype(np.float64)
    tiny = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt, None) or fmt).smallest_normal)
    n = max(nonzero.sum(), 1)
    return {
        "underflow": (nonzero & (cast == 0)).sum() / n,
        "subnormal": (nonzero & (cast != 0) & (np.abs(cast) < tiny)).sum() / n,
        "overflow": (finite & ~np.isfinite(cast)).sum() / n,
    }


def _histogram(x: np.ndarray) -> tuple:
    a = np.abs(np.asarray(x, np.float64))
    a = a[np.isfinite(a) & (a > 0)]
    lo, hi = LOG2_RANGE
    bins = np.clip(np.floor(np.log2(a)).astype(int), lo, hi - 1) - lo
    return tuple(np.bincount(bins, minlength=hi - lo).tolist())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matches_float64_reference(dtype):
    """Float32 subnormals count (XLA:CPU flushes them to zero in float arithmetic)."""
    with np.errstate(over="ignore"):  # float16 turns float32's large values into inf
        x = jnp.asarray(_values(), dtype)
    xn = np.asarray(x, np.float64)
    r = mpjax.numerics({"layer": {"g": x}}, formats=FORMATS)["layer/g"]
    finite = np.isfinite(xn)
    assert r.dtype == jnp.dtype(dtype) and r.size == x.size
    assert r.zeros == (xn == 0).mean()
    assert r.nonfinite == (~finite).mean()
    assert r.max_abs == np.abs(xn[finite]).max()
    assert r.histogram == _histogram(xn)
    for fmt in FORMATS:
        ref = _reference(xn, fmt)
        assert r.underflow[fmt] == pytest.approx(ref["underflow"], abs=1e-12), fmt
        assert r.subnormal[fmt] == pytest.approx(ref["subnormal"], abs=1e-12), fmt
        assert r.overflow[fmt] == pytest.approx(ref["overflow"], abs=1e-12), fmt
    if dtype == "float32":  # the thresholds' neighbours make every kind non-empty
        assert all(r.underflow[f] > 0 and r.subnormal[f] > 0 for f in FORMATS)
        assert all(r.overflow[f] > 0 for f in FORMATS if f != "bfloat16")


def _recording(monkeypatch) -> list:
    shapes = []
    real = numerics_module._stats_jit

    def record(x, ranges):
        shapes.append((x.shape, x.devices()))
        return real(x, ranges)

    monkeypatch.setattr(numerics_module, "_stats_jit", record)
    return shapes


@pytest.mark.parametrize("spec, shard", [(P("a", None), (32, 32)), (P("a", "b"), (32, 8))])
def test_sharded_arrays_are_reduced_per_shard(monkeypatch, spec, shard):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    host = _values(1)[: 64 * 32].reshape(64, 32)
    x = jax.device_put(host, NamedSharding(mesh, spec))
    shapes = _recording(monkeypatch)
    got = mpjax.numerics(x)
    distinct = 2 if spec == P("a", None) else 8  # replicas of a shard are counted once
    assert [s for s, _ in shapes] == [shard] * distinct
    assert all(len(d) == 1 for _, d in shapes)  # each on its own device: nothing gathered
    assert got == mpjax.numerics(host)


def test_bad_format_and_path_are_named():
    with pytest.raises(ValueError, match="'float7' is not a floating-point format"):
        mpjax.numerics(jnp.ones(2), formats=("float7",))
    with pytest.raises(KeyError, match=r"no leaf 'w'; paths: \['b'\]"):
        mpjax.numerics({"b": jnp.ones(2)})["w"]


def test_plot_shades_each_format(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    n = mpjax.numerics({"g": jnp.asarray(_values()[8:], jnp.float32)}, formats=FORMATS)
    ax = n.plot("g")
    labels = ax.get_legend_handles_labels()[1]
    assert sorted(labels) == sorted(["g values", *FORMATS])
    png = tmp_path / "h.png"
    ax.figure.savefig(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_to_dict_and_table():
    n = mpjax.numerics({"a": jnp.array([0.0, 1e-9, 1.0])}, formats=("float16",))
    d = n.to_dict()
    assert d["formats"] == ["float16"] and d["records"][0]["underflow"] == {"float16": 0.5}
    assert str(n).splitlines()[1].split()[:4] == ["a", "float32", "3", "33.33%"]
