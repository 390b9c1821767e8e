"""`numerics`: how the values of concrete arrays fit low-precision formats.

Per leaf: the fraction of zeros, non-finite values, the largest finite magnitude, and per
format the fraction of non-zero finite values a cast would flush to zero, put on a subnormal,
or overflow (thresholds of `formats.format_range`), with a histogram of floor(log2 |x|).
Sharded arrays are reduced shard by shard on their devices (one replica of each shard) and
only the small statistics come to the host: nothing is gathered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.core.policy import DTYPE_NAMES
from mpjax._src.report.formats import FormatRange, format_range
from mpjax._src.report.fp8_meta import Fp8TensorMeta, fp8_meta_records

__all__ = ["DEFAULT_FORMATS", "LOG2_RANGE", "Numerics", "TensorNumerics", "numerics"]

DEFAULT_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
LOG2_RANGE = (-160, 130)  # histogram bins: floor(log2 |x|) = lo, ..., hi - 1 (clipped)


@dataclasses.dataclass(frozen=True)
class TensorNumerics:
    """The statistics of one array.

    Attributes:
      path: the leaf's path in the tree (`"params/Dense_0/kernel"`).
      dtype: its dtype.
      size: its number of values.
      zeros: fraction of values that are exactly zero.
      nonfinite: fraction of values that are inf or NaN.
      max_abs: the largest finite |x| (0 without any).
      underflow: format name -> fraction of the non-zero finite values a cast flushes to 0.
      subnormal: format name -> fraction of them a cast puts on a subnormal.
      overflow: format name -> fraction of them a cast turns to inf/NaN.
      histogram: counts of floor(log2 |x|) of the non-zero finite values, bins `LOG2_RANGE`.
    """

    path: str
    dtype: jnp.dtype
    size: int
    zeros: float
    nonfinite: float
    max_abs: float
    underflow: dict
    subnormal: dict
    overflow: dict
    histogram: tuple

    @property
    def log2_bins(self) -> np.ndarray:
        """The exponent of each histogram bin (its left edge: 2**e <= |x| < 2**(e + 1))."""
        return np.arange(*LOG2_RANGE)


_ABS = 0x7FFFFFFF
_INF = 0x7F800000


def _f32_bits(t: float, up: bool) -> int:
    """The float32 bit pattern nearest `t >= 0` from below (`up=False`) or above."""
    with np.errstate(over="ignore"):
        v = np.float32(t)
    if (float(v) > t and not up) or (float(v) < t and up):
        v = np.nextafter(v, np.float32(np.inf if up else 0))
    return int(np.array(v, np.float32).view(np.uint32))


def _thresholds(r: FormatRange) -> tuple[str, int, int, int]:
    """(name, flush if bits <=, normal from bits >=, overflow from bits >=) of float32 |x|."""
    if r.overflow_at_tie:
        over = _f32_bits(r.overflow_from, up=True)
    else:
        over = _f32_bits(r.overflow_from, up=False) + 1
    flush = _f32_bits(r.flush_below, up=False)
    return r.name, flush, _f32_bits(r.normal_from, up=True), over


def _abs_bits(x: jax.Array) -> jax.Array:
    """float32 bit patterns of |x| (uint32), made without float arithmetic: XLA flushes
    float32 subnormals to zero in arithmetic and comparisons, bit patterns keep them."""
    if x.dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    else:
        if x.dtype != jnp.float32:
            x = x.astype(jnp.float32)  # float16, fp8 and integers: exact, never subnormal
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return bits & jnp.uint32(_ABS)


def _log2_floor(a: jax.Array) -> jax.Array:
    """floor(log2 |x|) of float32 bit patterns of non-zero finite |x|."""
    exponent = (a >> 23).astype(jnp.int32)
    mantissa = (a & jnp.uint32(0x7FFFFF)).astype(jnp.int32)
    subnormal = 31 - jax.lax.clz(jnp.maximum(mantissa, 1)) - 149
    return jnp.where(exponent == 0, subnormal, exponent - 127)


def _stats(x: jax.Array, thresholds: tuple) -> dict:
    """Counts of one shard (int32; a shard has fewer than 2**31 values)."""
    a = _abs_bits(x)
    finite = a < jnp.uint32(_INF)
    nonzero = finite & (a > 0)
    out = {
        "zeros": jnp.sum(a == 0),
        "nonfinite": jnp.sum(~finite),
        "nonzero": jnp.sum(nonzero),
        "max_abs_bits": jnp.max(jnp.where(finite, a, jnp.uint32(0)), initial=jnp.uint32(0)),
    }
    for name, flush, normal, over in thresholds:
        flushed = nonzero & (a <= jnp.uint32(flush))
        out[f"underflow/{name}"] = jnp.sum(flushed)
        out[f"subnormal/{name}"] = jnp.sum(nonzero & ~flushed & (a < jnp.uint32(normal)))
        out[f"overflow/{name}"] = jnp.sum(finite & (a >= jnp.uint32(over)))
    lo, hi = LOG2_RANGE
    bins = jnp.clip(_log2_floor(a), lo, hi - 1) - lo
    weights = nonzero.ravel().astype(jnp.int32)
    out["histogram"] = jnp.bincount(bins.ravel(), weights=weights, length=hi - lo)
    return out


_stats_jit = jax.jit(_stats, static_argnums=1)


def _shards(leaf) -> list:
    """One copy of each distinct shard of `leaf`, on its device (the array itself if unsharded)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_replicated:
        return [s.data for s in leaf.addressable_shards if s.replica_id == 0]
    if isinstance(leaf, jax.Array):
        return [leaf.addressable_shards[0].data]
    return [jnp.asarray(leaf)]


def _combine(parts: list[dict]) -> dict:
    out = {}
    for key in parts[0]:
        values = [np.asarray(p[key]) for p in parts]
        if key == "max_abs_bits":
            top = np.array(max(int(v) for v in values), np.uint32)
            out["max_abs"] = float(top.view(np.float32))
        else:
            out[key] = sum(v.astype(np.int64) for v in values)
    return out


def _record(path: str, leaf, ranges) -> TensorNumerics:
    thresholds = tuple(_thresholds(r) for r in ranges)
    parts = [_stats_jit(s, thresholds) for s in _shards(leaf) if s.size]
    size = int(np.prod(np.shape(leaf)))
    dtype = jnp.dtype(leaf.dtype) if hasattr(leaf, "dtype") else jnp.asarray(leaf).dtype
    if not parts:
        empty = {r.name: 0.0 for r in ranges}
        hist = (0,) * (LOG2_RANGE[1] - LOG2_RANGE[0])
        return TensorNumerics(path, dtype, 0, 0.0, 0.0, 0.0, empty, dict(empty), dict(empty), hist)
    c = _combine(parts)
    nonzero = max(int(c["nonzero"]), 1)

    def frac(kind):
        return {r.name: int(c[f"{kind}/{r.name}"]) / nonzero for r in ranges}

    return TensorNumerics(
        path=path,
        dtype=dtype,
        size=size,
        zeros=int(c["zeros"]) / size,
        nonfinite=int(c["nonfinite"]) / size,
        max_abs=c["max_abs"],
        underflow=frac("underflow"),
        subnormal=frac("subnormal"),
        overflow=frac("overflow"),
        histogram=tuple(int(n) for n in c["histogram"]),
    )


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


@dataclasses.dataclass(frozen=True)
class Numerics:
    """`numerics`' records, by leaf path; `print` it for a table, `.plot(path)` to see one."""

    records: tuple[TensorNumerics, ...]
    formats: tuple[str, ...]
    fp8: tuple[Fp8TensorMeta, ...] = ()  # the delayed-fp8 sites' scales, histories, headroom

    def __getitem__(self, path: str) -> TensorNumerics:
        if not isinstance(path, str):
            raise TypeError(
                f"mpjax.numerics: a result is indexed by leaf path (a str), got {path!r}; "
                "iterate it (or call .keys()) for the paths, or use .records for the list"
            )
        for r in self.records:
            if r.path == path:
                return r
        raise KeyError(f"mpjax.numerics: no leaf {path!r}; paths: {[r.path for r in self.records]}")

    def __iter__(self) -> Iterator[str]:
        """The leaf paths, in tree order (as iterating a Mapping gives its keys)."""
        return (r.path for r in self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, path: object) -> bool:
        return any(r.path == path for r in self.records)

    def keys(self) -> list[str]:
        """The leaf paths, in tree order."""
        return [r.path for r in self.records]

    def values(self) -> list[TensorNumerics]:
        """The records, in tree order."""
        return list(self.records)

    def items(self) -> list[tuple[str, TensorNumerics]]:
        """`(path, record)` pairs, in tree order."""
        return [(r.path, r) for r in self.records]

    def to_dict(self) -> dict:
        """The records as plain dicts (JSON-ready)."""
        rows = []
        for r in self.records:
            row = dataclasses.asdict(r)
            row["dtype"] = r.dtype.name
            row["histogram"] = list(r.histogram)
            rows.append(row)
        fp8 = [{**dataclasses.asdict(m), "dtype": m.dtype.name} for m in self.fp8]
        for m in fp8:
            m["amax_history"] = list(m["amax_history"])
        return {
            "formats": list(self.formats),
            "log2_range": list(LOG2_RANGE),
            "records": rows,
            "fp8": fp8,
        }

    def plot(self, path: str, ax=None, title: str | None = None):
        """Draws the log2 |x| histogram of one leaf, each format's range shaded (matplotlib).

        Returns:
          The matplotlib `Axes`.
        """
        from mpjax._src.report.plot import plot_histogram

        return plot_histogram(self[path], self.formats, ax=ax, title=title)

    def __str__(self) -> str:
        head = ["path", "dtype", "size", "zeros", "max|x|"]
        head += [f"{f} under/sub/over" for f in self.formats]
        rows = [head]
        for r in self.records:
            row = [r.path, r.dtype.name, str(r.size), f"{r.zeros:.2%}", f"{r.max_abs:.3g}"]
            for f in self.formats:
                row.append(f"{r.underflow[f]:.2%} / {r.subnormal[f]:.2%} / {r.overflow[f]:.2%}")
            rows.append(row)
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        for m in self.fp8:
            lines.append(
                f"fp8 {m.path} {m.tensor} ({m.dtype.name}): scale {m.scale:.4g}, amax "
                f"{m.amax_history[0]:.4g} (history max {max(m.amax_history):.4g}), "
                f"headroom {m.headroom:.3g}x"
            )
        return "\n".join(line.rstrip() for line in lines)


def _format_names(formats: Any) -> tuple[str, ...]:
    """`formats` as a tuple of dtype names; one name or dtype is one format."""
    if isinstance(formats, str) or not isinstance(formats, Iterable):
        formats = (formats,)
    names = []
    for f in formats:
        if isinstance(f, str):
            alias = DTYPE_NAMES.get(f.strip().lower())  # "f16", "bf16", ... as in a policy
            names.append(jnp.dtype(alias).name if alias is not None else f)
            continue
        try:
            names.append(np.dtype(f).name)
        except TypeError as e:
            raise TypeError(
                f"mpjax.numerics: formats={formats!r}: {f!r} is not a dtype or dtype name; "
                "pass names such as 'float16' or ('float16', 'float8_e4m3fn')"
            ) from e
    return tuple(names)


def numerics(
    tree: Any, formats: Sequence[str] = DEFAULT_FORMATS, *, fp8_recipe: Any = None
) -> Numerics:
    """How each array of `tree` fits low-precision formats: zeros, under/overflow, histogram.

    Args:
      tree: a pytree of concrete arrays (gradients, activations from `capture_intermediates`,
        fp8 inputs); a sharded `jax.Array` is reduced on its devices, never gathered.
      formats: floating-point dtype names (or dtypes) to check the values against; one
        name means one format.
      fp8_recipe: the `Fp8Recipe` of the delayed-fp8 sites in `tree` (their formats; the
        default recipe's when None). Each site also gets `Fp8TensorMeta` records in `.fp8`.

    Returns:
      A `Numerics`: `result[path].underflow["float16"]`, `print(result)`, `result.plot(path)`.

    Example:
      >>> import jax.numpy as jnp
      >>> import mpjax
      >>> n = mpjax.numerics({"g": jnp.array([0.0, 1e-8, 1e-3, 1e5])})
      >>> n["g"].zeros, n["g"].underflow["float16"], n["g"].overflow["float16"]
      (0.25, 0.3333333333333333, 0.3333333333333333)
    """
    ranges = tuple(format_range(f) for f in _format_names(formats))
    names = tuple(r.name for r in ranges)
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    records = []
    for keys, leaf in leaves:
        if not hasattr(leaf, "shape") and not isinstance(leaf, (int, float)):
            continue
        records.append(_record("/".join(_key(k) for k in keys), leaf, ranges))
    return Numerics(tuple(records), names, fp8_meta_records(tree, fp8_recipe, _key))
