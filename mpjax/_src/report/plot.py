"""The log2-magnitude histogram of one array against the formats' representable ranges."""

from __future__ import annotations

import numpy as np

from mpjax._src.report.formats import format_range

__all__ = ["plot_histogram"]

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def plot_histogram(record, formats, ax=None, title: str | None = None):
    """Bars of floor(log2 |x|) of `record` (a `TensorNumerics`), each format's range shaded.

    A format's strip (at the top) spans its smallest subnormal to its largest finite value,
    the subnormal part hatched; dotted lines mark the ends. Values left of a strip flush to
    zero in that format, values right of it overflow.

    Args:
      record: the leaf's `TensorNumerics`.
      formats: format names to shade.
      ax: a matplotlib `Axes` (a new figure's when None).
      title: the title (the leaf's path when None).

    Returns:
      The `Axes`.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    counts = np.asarray(record.histogram, dtype=np.float64)
    bins = record.log2_bins
    used = np.nonzero(counts)[0]
    total = max(counts.sum(), 1.0)
    ax.bar(bins + 0.5, counts / total, width=1.0, color="0.25", label=f"{record.path} values")
    lows = [bins[used[0]] - 2] if used.size else []
    highs = [bins[used[-1]] + 3] if used.size else []
    for i, name in enumerate(formats):
        r = format_range(name)
        color = _COLORS[i % len(_COLORS)]
        sub, tiny, top = np.log2([r.smallest_subnormal, r.smallest_normal, r.max])
        y0, y1 = 1.0 - (i + 1) * 0.08, 1.0 - i * 0.08  # one strip per format at the top
        ax.axvspan(tiny, top, ymin=y0, ymax=y1, color=color, alpha=0.55, label=name)
        ax.axvspan(sub, tiny, ymin=y0, ymax=y1, color=color, alpha=0.25, hatch="//")
        ax.axvline(sub, color=color, linestyle=":", linewidth=1)
        ax.axvline(top, color=color, linestyle=":", linewidth=1)
        lows.append(sub - 2)
        highs.append(top + 2)
    peak = (counts / total).max() if used.size else 1.0
    ax.set_ylim(0, peak / max(1.0 - 0.08 * len(formats) - 0.05, 0.2))  # strips above the bars
    if used.size:
        ax.set_xlim(max(min(lows), bins[used[0]] - 40), min(max(highs), bins[used[-1]] + 40))
    ax.set_xlabel("log2 |x|  (strips: each format's range, subnormals hatched)")
    ax.set_ylabel("fraction of non-zero values")
    ax.set_title(title if title is not None else record.path)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return ax
