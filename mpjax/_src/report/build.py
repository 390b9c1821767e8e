"""`report`: what a step asks for and what its compiled program really runs."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Any

import jax

from mpjax._src.analysis import collectives as hlo_collectives
from mpjax._src.analysis import hlo_cost
from mpjax._src.analysis.calibrated import calibrated_seconds
from mpjax._src.autocast.fp8_last import KEPT_SCOPE
from mpjax._src.report import format as fmt
from mpjax._src.report.paths import library_last, split_op_name
from mpjax._src.report.records import (
    Collective,
    Converts,
    Gemm,
    Memory,
    as_dtype,
    to_plain,
    wider,
)
from mpjax._src.report.targets import compile_hint, place_args, resolve_target

__all__ = ["UNNAMED", "Report", "build_report", "report"]

UNNAMED = "(made by XLA)"  # instructions the compiler made, with no JAX name stack to read


@dataclasses.dataclass(frozen=True)
class Report:
    """What one compiled step runs: GEMMs by module, converts, collectives, memory.

    Attributes:
      target: what it was compiled for (`"cpu"`, `"h100"`, `"h100x8"`, ...).
      gemms: a `Gemm` per dot/convolution, in program order.
      converts: a `Converts` per module with dtype conversions in the optimized program.
      collectives: a `Collective` per collective of the optimized program.
      memory: the `Memory` of the executable.
      memory_plan: the `MemoryPlan` the step was built from (`report(...,
        memory_plan=plan)`): what it chose, what each rung saved and cost; or None.
    """

    target: str
    gemms: tuple[Gemm, ...]
    converts: tuple[Converts, ...]
    collectives: tuple[Collective, ...]
    memory: Memory
    memory_plan: Any = None

    def flops_by_dtype(self, runs: bool = True) -> dict:
        """GEMM/conv FLOPs by dtype name: run per device (`runs=True`) or asked for."""
        out: Counter = Counter()
        for g in self.gemms:
            if runs and g.runs_as is not None:
                out[g.runs_as.name] += g.device_flops
            elif not runs:
                out[g.asks_for.name] += g.flops
        return dict(out)

    def summary(self) -> str:
        """One line: GEMM FLOPs by dtype, the float32 modules, converts, collectives."""
        return fmt.summary(self)

    def to_dict(self) -> dict:
        """The report as plain dicts, lists, numbers and dtype names (JSON-ready)."""
        return {**to_plain(self), "summary": self.summary()}

    def to_markdown(self) -> str:
        """The tables of `str(report)` as Markdown."""
        return fmt.markdown(self)

    def __str__(self) -> str:
        return fmt.text(self)


def _runs(asked, optimized) -> bool:
    """Whether `optimized` can run (a per-device part of) `asked`: its FLOPs divide them."""
    return optimized.flops > 0 and asked.flops % optimized.flops == 0


def _match(asked: list, optimized: list) -> list:
    """Pairs each asked-for GEMM with the optimized GEMM running it (or None).

    Candidates share the module path and pass, and have FLOPs dividing the asked-for ones
    (equal, or a per-device part under SPMD partitioning); the same op_name wins, then equal
    FLOPs (the compiler may rename a dot it rewrites, e.g. folding a transpose); then GEMMs
    without metadata of the same kind; then GEMMs XLA merged. Optimized GEMMs left over
    (made by the compiler) follow, paired with themselves.
    """
    pool = defaultdict(list)
    for g in optimized:
        pool[split_op_name(g.op_name)].append(g)
    pairs = []
    for g in asked:
        cands = [o for o in pool[split_op_name(g.op_name)] if _runs(g, o)]
        hit = next((o for o in cands if o.op_name == g.op_name), None)
        hit = hit or next((o for o in cands if o.flops == g.flops), None)
        hit = hit or (cands[0] if cands else None)
        if hit is not None:
            pool[split_op_name(g.op_name)].remove(hit)
        pairs.append((g, hit))
    # The compiler may drop the metadata of what it rewrites (XLA:CPU's float16 convolutions).
    anonymous = pool[("", "forward")]
    for i, (g, hit) in enumerate(pairs):
        if hit is None:
            hit = next((o for o in anonymous if o.kind == g.kind and _runs(g, o)), None)
            if hit is not None:
                anonymous.remove(hit)
                pairs[i] = (g, hit)
    _merged(pairs, pool)
    leftover = [o for cands in pool.values() for o in cands]
    return pairs + [(o, o) for o in leftover]


def _parent(key: tuple) -> tuple:
    return key[0].rpartition("/")[0], key[1]


def _merged(pairs: list, pool: dict) -> None:
    """Pairs GEMMs XLA merged (q/k/v projections of one input) with the one GEMM running them.

    An unmatched optimized GEMM whose FLOPs are exactly those of consecutive unmatched
    asked-for GEMMs of the same kind, pass and parent module runs all of them.
    """
    for key, cands in pool.items():
        for o in list(cands):
            group, total = [], 0
            for i, (g, hit) in enumerate(pairs):
                if hit is not None or g.kind != o.kind:
                    continue
                if _parent(split_op_name(g.op_name)) != _parent(key):
                    continue
                group.append(i)
                total += g.flops
                if total >= o.flops:
                    break
            if total == o.flops and len(group) > 1:
                cands.remove(o)
                for i in group:
                    pairs[i] = (pairs[i][0], o._replace(flops=pairs[i][0].flops))


def _dominant(counter: Counter):
    return max(counter, key=counter.get) if counter else None


def _gemms(lowered_text: str, optimized) -> tuple[Gemm, ...]:
    asked = list(hlo_cost.analyze(lowered_text).gemms)
    rows = []
    pairs = list(_match(asked, list(optimized.gemms)))
    for g, o in pairs:
        path, direction = split_op_name(g.op_name)
        path = path or UNNAMED
        runs = wider(as_dtype(o.lhs_dtype), as_dtype(o.rhs_dtype)) if o is not None else None
        lhs, rhs = as_dtype(g.lhs_dtype), as_dtype(g.rhs_dtype)
        device = o.flops if o is not None else None
        rows.append(
            [path, g.kind, direction, lhs, rhs, as_dtype(g.out_dtype), runs, g.flops, device]
        )
    runs_mix = Counter({r[6]: 0 for r in rows if r[6] is not None})
    asks_mix = Counter()
    for r in rows:
        asks_mix[wider(r[3], r[4])] += r[7]
        if r[6] is not None:
            runs_mix[r[6]] += r[8]
    top_runs, top_asks = _dominant(runs_mix), _dominant(asks_mix)

    def flag(r) -> bool:
        def f32_vs(dtype, top):
            return dtype is not None and top is not None and dtype.itemsize >= 4 > top.itemsize

        return f32_vs(r[6], top_runs) or f32_vs(wider(r[3], r[4]), top_asks)

    kept = [KEPT_SCOPE in g.op_name for g, _ in pairs]  # Fp8Recipe.high_precision_last
    return tuple(
        Gemm(*r, flagged=flag(r), high_precision_last=k) for r, k in zip(rows, kept, strict=True)
    )


def _path(op_name: str) -> str:
    return split_op_name(op_name)[0] or UNNAMED


def _converts(optimized) -> tuple[Converts, ...]:
    count, kernels = Counter(), Counter()
    for name, n in optimized.converts_by_op.items():
        count[_path(name)] += n
    for k in optimized.kernels:
        if k.only_converts:
            kernels[_path(k.op_name)] += 1
    paths = sorted(set(count) | set(kernels), key=library_last)
    return tuple(Converts(p, count[p], kernels[p]) for p in paths)


def build_report(lowered, compiled, target: str, gpu: bool) -> Report:
    """The `Report` of a lowered step and its compiled executable.

    Args:
      lowered: `jax.jit(fn).trace(...).lower()`.
      compiled: `lowered.compile()`.
      target: the target's name, for display.
      gpu: whether to add the H100 time estimate (the calibrated roofline,
        `analysis.calibrated`; kernel classes never measured on Hopper are named in
        `memory.unmeasured`).

    Returns:
      A `Report`.
    """
    text = compiled.as_text()
    optimized = hlo_cost.analyze(text)
    lowered_text = lowered.as_text(dialect="hlo", debug_info=True)
    memory = compiled.memory_analysis()
    colls = tuple(
        Collective(_path(c.op_name), c.op, as_dtype(c.dtype), c.bytes)
        for c in hlo_collectives.collectives(text)
    )
    model = calibrated_seconds(optimized, "h100") if gpu else None
    return Report(
        target=target,
        gemms=_gemms(lowered_text, optimized),
        converts=_converts(optimized),
        collectives=colls,
        memory=Memory(
            int(memory.temp_size_in_bytes),
            int(memory.argument_size_in_bytes),
            int(memory.output_size_in_bytes),
            model and model.seconds,
            model and model.peak_seconds,
            model.unmeasured if model else (),
        ),
    )


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def report(fn, *args, target: str | None = None, memory_plan: Any = None, **kwargs: Any) -> Report:
    """Compiles `fn(*args, **kwargs)` and reports what it runs, module by module.

    The precision each dot/convolution asks for comes from the lowered program; what runs,
    the converts, the collectives and the memory come from the optimized one. XLA:CPU runs
    float16 GEMMs in float32 (`runs_as`), and bfloat16 ones too up to jaxlib 0.10 (from 0.12
    it runs bfloat16 dots in bfloat16, convolutions still in float32); a GPU target runs them
    as asked.

    Args:
      fn: the step (a function or a `jax.jit`-wrapped one; non-array arguments go in with
        `functools.partial`).
      *args: its arguments (arrays or `jax.ShapeDtypeStruct` values).
      target: `None` (the current backend), `"h100"` (one H100, deviceless: needs the
        gpu-aot extra and `JAX_PLATFORMS=cpu`) or `"h100x2"`, `"h100x4"`, `"h100x8"` (one
        host of H100s; arguments with a `NamedSharding` keep their specs, other leaves are
        replicated).
      memory_plan: the `mpjax.MemoryPlan` `fn` was built from (`plan.step`): the report
        lists its choice and what every rung saved and cost.
      **kwargs: keyword arguments of `fn` (arrays).

    Returns:
      A `Report`; `print` it for the table, `.to_dict()` / `.to_markdown()` for logs.

    Raises:
      RuntimeError: `fn` does not compile for the target (naming `fn` and the cause; on a
        deviceless target, the plugin wheels to install or, for a cuDNN call on jaxlib 0.12,
        where it does compile: docs/guides/errors.md).

    Example:
      >>> import jax.numpy as jnp
      >>> import mpjax
      >>> def f(x, w):
      ...     return x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
      >>> r = mpjax.report(f, jnp.ones((8, 16)), jnp.ones((16, 4)))
      >>> [(g.path, g.asks_for.name, g.flops) for g in r.gemms]
      [('f', 'bfloat16', 1024)]
    """
    resolved = resolve_target(target)
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    placed_args = place_args(args, resolved)
    placed_kwargs = place_args(kwargs, resolved)
    try:
        lowered = jitted.trace(*placed_args, **placed_kwargs).lower()
        compiled = lowered.compile()
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise RuntimeError(
            f"mpjax.report: {_name(fn)} does not compile for {resolved.name}: "
            f"{type(err).__name__}: {first}{compile_hint(str(err))}"
        ) from err
    built = build_report(lowered, compiled, resolved.name, resolved.gpu)
    return dataclasses.replace(built, memory_plan=memory_plan)
