"""A study's own table, as its measure returned it, byte counts in MiB/GiB."""

from __future__ import annotations

from benchmarks.names import number
from benchmarks.tables_format import GIB, MIB

# A study's short table: the columns a reader compares (names as the study returns them;
# a study without an entry, or whose columns changed, is shown whole).
STUDY_SHORT = {
    "policy-cpu": ("model", "casts/param optimized", "temp ratio", "residual ratio"),
    "autocast-cpu": (
        "model", "variant", "bytes ratio vs flax bf16", "temp ratio vs flax bf16",
        "time ratio vs flax bf16",
    ),
    "inference": ("variant", "latency ratio", "bytes ratio", "variable bytes", "variable ratio"),
    "step-overhead": ("variant", "donated", "bytes ratio", "HLO copies", "time ratio"),
}  # fmt: skip


def _readable_column(name: str, values: list) -> tuple[str, list]:
    """A byte-count column in MiB or GiB (`bytes accessed` -> `accessed (MiB)`), a MiB
    column of 10 GiB or more in GiB; any other column as it is."""
    nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    words = name.split()
    units = {"MiB", "GiB", "MB", "GB", "(MB)", "(GB)", "ratio", "B/param"}
    if nums and len(nums) == len(values) and "bytes" in words and not units & set(words):
        unit, div = ("GiB", GIB) if max(map(abs, nums)) >= 2 * GIB else ("MiB", MIB)
        label = " ".join(w for w in words if w != "bytes") or "size"
        return f"{label} ({unit})", [number(v / div) for v in values]
    if nums and len(nums) == len(values) and "MiB" in words and max(map(abs, nums)) >= 10240:
        return name.replace("MiB", "GiB"), [f"{v / 1024:.2f}" for v in values]
    return name, values


def _readable(columns: list[str], rows: list[list]) -> tuple[list[str], list[list]]:
    cols = list(zip(*rows, strict=True)) if rows else [[] for _ in columns]
    pairs = [_readable_column(c, list(v)) for c, v in zip(columns, cols, strict=True)]
    return [c for c, _ in pairs], [list(r) for r in zip(*(v for _, v in pairs), strict=True)]


def study_table(records):
    """A study's own table (title, columns, rows, notes as its measure returned them), byte
    counts in MiB/GiB; the short form keeps `STUDY_SHORT`'s columns."""
    f = records[0]["figures"]
    columns, rows = _readable(f["columns"], f["rows"])
    keep = STUDY_SHORT.get(records[0]["table"], ())
    if not keep or not set(keep) <= set(f["columns"]):
        return columns, rows, columns, rows
    idx = [f["columns"].index(c) for c in keep]
    return [columns[i] for i in idx], [[r[i] for i in idx] for r in rows], columns, rows
