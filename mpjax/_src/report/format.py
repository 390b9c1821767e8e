"""Text and Markdown forms of a `Report` (grouped by module) and its summary line."""

from __future__ import annotations

from collections import Counter, defaultdict

from mpjax._src.core.calibration import UNMEASURED_EFFICIENCY

__all__ = ["convert_totals", "cpu_note", "human", "markdown", "summary", "text"]

_UNITS = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def human(value: float, unit: str) -> str:
    """`1.2e12, "FLOP"` -> `"1.2 TFLOP"`."""
    for scale, prefix in _UNITS:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _short(dtype) -> str:
    return "-" if dtype is None else dtype.name


def summary(report) -> str:
    """ "1.2 GFLOP of GEMMs in bfloat16, 0.3 % in float32: head; ..." for a `Report`."""
    asks = report.flops_by_dtype(runs=False)
    total = sum(asks.values())
    parts = []
    if total:
        top = max(asks, key=asks.get)
        line = f"{human(total, 'FLOP')} of GEMMs in {top}"
        flagged = [g for g in report.gemms if g.flagged]
        if flagged:
            share = 100 * sum(g.flops for g in flagged) / total
            paths = ", ".join(dict.fromkeys(g.path for g in flagged))
            line += f", {share:.3g} % in float32: {paths}"
        runs = report.flops_by_dtype(runs=True)
        if runs and max(runs, key=runs.get) != top:
            line += f" (runs as {max(runs, key=runs.get)} on {report.target})"
        parts.append(line)
    else:
        parts.append("no GEMMs")
    fp8 = [g for g in report.gemms if g.fp8]
    if fp8:
        paths = ", ".join(dict.fromkeys(g.path for g in fp8))
        runs = sum(g.runs_fp8 for g in fp8)
        parts.append(f"{len(fp8)} fp8 GEMMs ({paths}), {runs} run as fp8 on {report.target}")
    kept = [g for g in report.gemms if g.high_precision_last]
    if kept:
        paths = ", ".join(dict.fromkeys(g.path for g in kept))
        parts.append(f"{len(kept)} GEMMs kept by Fp8Recipe.high_precision_last ({paths})")
    count, kernels = convert_totals(report)
    parts.append(f"{count} converts, {kernels} in convert-only kernels")
    by_op: Counter = Counter()
    for c in report.collectives:
        by_op[(c.op, c.dtype.name)] += c.bytes
    parts += [f"{op} {dtype} {human(b, 'B')}" for (op, dtype), b in by_op.items()]
    if report.memory.roofline_s is not None:
        parts.append(f"roofline {report.memory.roofline_s * 1e3:.3g} ms (calibrated)")
    if report.memory.unmeasured:
        parts.append(
            f"unmeasured kernels ({', '.join(report.memory.unmeasured)}) costed at "
            f"{UNMEASURED_EFFICIENCY} of their peak"
        )
    if report.memory_plan is not None:
        parts.append(f"{report.memory_plan.summary()}")
    return "; ".join(parts)


def convert_totals(report) -> tuple[int, int]:
    """(convert instructions, convert-only kernels) of the whole step: the table's total row."""
    return sum(c.count for c in report.converts), sum(c.kernels for c in report.converts)


def cpu_note(report) -> str | None:
    """What a report compiled for XLA:CPU can and cannot tell (None for a GPU target)."""
    if report.memory.roofline_s is not None:
        return None
    return (
        f"On {report.target}: the dtypes asked for, FLOPs, converts, collectives and memory "
        "are this program's.\nXLA:CPU may run float16/bfloat16 GEMMs in float32 ('runs as') "
        "and has no GPU time model\n(roofline n/a): compile for target='h100' to see what "
        "a GPU runs."
    )


def _convert_rows(report) -> list[list[str]]:
    rows = [[c.path, str(c.count), str(c.kernels)] for c in report.converts]
    if rows:
        rows.append(["total", *map(str, convert_totals(report))])
    return rows


def _flag(g) -> str:
    if g.flagged:
        return "float32!"
    return "fp8" if g.runs_fp8 else ("high_precision_last" if g.high_precision_last else "")


def _gemm_rows(report) -> list[list[str]]:
    groups = defaultdict(list)
    for g in report.gemms:
        groups[g.path].append(g)
    rows = []
    for path, gemms in groups.items():
        for g in gemms:
            asks = f"{g.lhs_dtype.name} x {g.rhs_dtype.name} -> {g.out_dtype.name}"
            rows.append(
                [path, g.kind, g.direction, asks, _short(g.runs_as), human(g.flops, "FLOP")]
                + [_flag(g)]
            )
    if rows:  # the headline's total
        rows.append(["total", "", "", "", "", human(sum(g.flops for g in report.gemms), "FLOP")])
        rows[-1].append("")
    return rows


def _tables(report) -> list[tuple[str, list[str], list[list[str]]]]:
    m = report.memory
    memory = [[human(m.temp_bytes, "B"), human(m.argument_bytes, "B"), human(m.output_bytes, "B")]]
    memory[0].append("n/a on cpu" if m.roofline_s is None else f"{m.roofline_s * 1e3:.3g} ms")
    return [
        (
            "GEMMs",
            ["module", "kind", "pass", "asks for", "runs as", "FLOPs", "flag"],
            _gemm_rows(report),
        ),
        (
            "converts",
            ["module", "converts", "convert-only kernels"],
            _convert_rows(report),
        ),
        (
            "collectives",
            ["module", "op", "dtype", "bytes"],
            [[c.path, c.op, c.dtype.name, human(c.bytes, "B")] for c in report.collectives],
        ),
        ("memory", ["temp", "arguments", "outputs", "roofline"], memory),
        *_plan_table(report),
    ]


def _plan_table(report) -> list:
    plan = report.memory_plan
    if plan is None:
        return []
    return [(f"memory plan (budget {human(plan.budget, 'B')})", list(plan.HEADER), plan.rows())]


def text(report) -> str:
    """The report as aligned plain-text tables under its summary line."""
    out = [f"mpjax.report ({report.target}): {summary(report)}"]
    if note := cpu_note(report):
        out.append(note)
    for title, header, rows in _tables(report):
        if not rows:
            continue
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        out += ["", title]
        for r in [header, *rows]:
            out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(out)


def markdown(report) -> str:
    """The report as Markdown tables under its summary line."""
    out = [f"**mpjax.report ({report.target})**: {summary(report)}"]
    if note := cpu_note(report):
        out += ["", note]
    for title, header, rows in _tables(report):
        if not rows:
            continue
        out += ["", f"*{title}*", "", "| " + " | ".join(header) + " |"]
        out.append("|" + "---|" * len(header))
        out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)
