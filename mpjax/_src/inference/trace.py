"""Finds the BatchNorms of a linen model that can be folded into the Conv/Dense feeding them.

The model is traced once (`jax.make_jaxpr`, nothing is computed) under a
`flax.linen.intercept_methods` interceptor that records every module call and tags two
values with `jax.ad_checkpoint.checkpoint_name` (an identity that stays visible in the
jaxpr as a `name` equation):

- the output of every `nn.Conv` / `nn.Dense` call (`<tag>out:<i>`);
- the input of every `nn.BatchNorm` call (`<tag>in:<i>`).

The folding rule, read off the jaxpr: a BatchNorm is folded into a Conv/Dense when

1. its input variable IS the Conv/Dense output variable: the `in` tag's operand is the
   `out` tag's result, so no operation (activation, residual add, cast, ...) lies in
   between;
2. that Conv/Dense output has no other consumer: the variable is used exactly once
   in its jaxpr (by the BatchNorm's tag) and is not an output of it;
3. both modules are called exactly once per forward pass (a shared Conv could not
   carry two different folds), the BatchNorm runs on its running statistics, and it
   normalises the last (channel) axis only, which is the kernel's output axis.

An `mpjax.nn.ConvBN` holds its own pair (its conv feeds its BatchNorm by construction),
so it folds whenever it is called once and runs on its running statistics.

Anything else leaves the BatchNorm as it is, with the reason recorded.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core as jex
from jax.ad_checkpoint import checkpoint_name

from mpjax._src.flax.conv_bn import ConvBN

__all__ = ["FoldReport", "LINEAR_TYPES", "NORM_TYPES", "Trace", "trace_model"]

# Modules whose kernel's last axis is the output channel axis, so a per-channel
# affine map after them folds into (kernel, bias).
LINEAR_TYPES: tuple[type, ...] = (nn.Conv, nn.Dense)
# Normalisations whose parameters and statistics stay in float32 when not folded.
NORM_TYPES: tuple[type, ...] = (
    nn.BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.InstanceNorm,
)

_TAG = "mpjax.inference:"

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FoldReport:
    """Which BatchNorms were folded, and why the others were not.

    Attributes:
      folded: `(linear_path, batchnorm_path)` pairs, paths as "Block_0/Conv_0".
      unfolded: `(batchnorm_path, reason)` for every BatchNorm left in place.
    """

    folded: tuple[tuple[str, str], ...] = ()
    unfolded: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class _Call:
    path: Path
    kind: type
    attrs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one trace of the model found.

    Attributes:
      calls: every recorded call of a Conv/Dense/norm module, in call order.
      pairs: `{batchnorm_path: linear_path}` for the pairs that fold.
      report: the `FoldReport`.
    """

    calls: tuple[_Call, ...]
    pairs: dict[Path, Path]
    report: FoldReport


def path_str(path: Path, root: str = "<root>") -> str:
    """`path` joined by "/", `root` for the empty path."""
    return "/".join(path) if path else root


class _Recorder:
    """The interceptor of the tracing pass: per-trace state only."""

    def __init__(self):
        self.calls: list[_Call] = []

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        kind = type(module)
        if context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(module.scope.path)
        index = len(self.calls)
        if kind is nn.BatchNorm:
            x = args[0]
            call_ura = args[1] if len(args) > 1 else kwargs.get("use_running_average")
            use_ra = nn.merge_param("use_running_average", module.use_running_average, call_ura)
            if not use_ra:
                raise ValueError(
                    f"convert_for_inference: BatchNorm {path_str(path)!r} runs in training "
                    "mode (use_running_average=False) in the traced call; pass the apply "
                    "arguments that select inference mode, e.g. apply_kwargs={'train': False}"
                )
            self.calls.append(
                _Call(
                    path,
                    kind,
                    {
                        "axis": module.axis,
                        "epsilon": module.epsilon,
                        "use_scale": module.use_scale,
                        "use_bias": module.use_bias,
                        "ndim": x.ndim,
                        "features": x.shape[-1] if x.ndim else None,
                    },
                )
            )
            return next_fun(checkpoint_name(x, f"{_TAG}in:{index}"), *args[1:], **kwargs)
        if kind is ConvBN:
            call_ura = args[2] if len(args) > 2 else kwargs.get("use_running_average")
            use_ra = nn.merge_param("use_running_average", module.use_running_average, call_ura)
            if not use_ra:
                raise ValueError(
                    f"convert_for_inference: ConvBN {path_str(path)!r} runs in training mode "
                    "(use_running_average=False) in the traced call; pass the apply arguments "
                    "that select inference mode, e.g. apply_kwargs={'train': False}"
                )
            attrs = {"epsilon": module.epsilon, "features": module.features}
            attrs.update(use_scale=True, use_bias=True)
            self.calls.append(_Call(path, kind, attrs))
            return next_fun(*args, **kwargs)
        if kind in LINEAR_TYPES:
            y = next_fun(*args, **kwargs)
            self.calls.append(_Call(path, kind, {"use_bias": module.use_bias}))
            return checkpoint_name(y, f"{_TAG}out:{index}")
        if kind in NORM_TYPES:
            self.calls.append(_Call(path, kind, {}))
        return next_fun(*args, **kwargs)


def _walk(jaxpr: jex.Jaxpr):
    """Yields `jaxpr` and every jaxpr nested in its equations' parameters."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from _walk(sub)


def _links(closed: jex.ClosedJaxpr) -> dict[int, tuple[int, int]]:
    """`{bn_call_index: (linear_call_index, uses_of_the_linear_output)}` from the tags."""
    links = {}
    for jaxpr in _walk(closed.jaxpr):
        produced: dict[Any, int] = {}
        uses: Counter = Counter()
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, jex.Var):
                    uses[v] += 1
            tag = eqn.params.get("name") if eqn.primitive.name == "name" else None
            if isinstance(tag, str) and tag.startswith(_TAG + "out:"):
                produced[eqn.outvars[0]] = int(tag.rsplit(":", 1)[1])
        for v in jaxpr.outvars:
            if isinstance(v, jex.Var):
                uses[v] += 1
        for eqn in jaxpr.eqns:
            tag = eqn.params.get("name") if eqn.primitive.name == "name" else None
            if isinstance(tag, str) and tag.startswith(_TAG + "in:"):
                src = eqn.invars[0]
                if isinstance(src, jex.Var) and src in produced:
                    links[int(tag.rsplit(":", 1)[1])] = (produced[src], uses[src])
    return links


def _feature_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    axes = axis if isinstance(axis, Sequence) else (axis,)
    return tuple(sorted(a % ndim for a in axes))


def lookup(tree: Any, path: Path) -> Any:
    """`tree[path[0]][path[1]]...`, or None where a key is missing."""
    for key in path:
        if not hasattr(tree, "get"):
            return None
        tree = tree.get(key)
        if tree is None:
            return None
    return tree


def _shape_mismatch(variables: Any, lin: Path, bn: _Call) -> str | None:
    """Why the stored variables cannot take the fold, or None when they can."""
    c = bn.attrs["features"]
    lin_params = lookup(variables, ("params", *lin))
    kernel = lookup(lin_params, ("kernel",))
    bias = lookup(lin_params, ("bias",))
    shapes = {
        "kernel": (getattr(kernel, "shape", None) or (None,))[-1:],
        "bias": getattr(bias, "shape", (c,)),
        "mean": getattr(lookup(variables, ("batch_stats", *bn.path, "mean")), "shape", None),
        "var": getattr(lookup(variables, ("batch_stats", *bn.path, "var")), "shape", None),
    }
    for name in ("scale", "bias"):
        if bn.attrs["use_" + name]:
            value = lookup(variables, ("params", *bn.path, name))
            shapes["bn " + name] = getattr(value, "shape", None)
    bad = {k: v for k, v in shapes.items() if v != (c,)}
    if bad:
        return (
            f"stored variable shapes {bad} do not match its {c} channels "
            "(e.g. stacked by a lifted transform)"
        )
    return None


def trace_model(
    apply: Callable[..., Any], variables: Any, inputs: Sequence[Any], fold: bool
) -> Trace:
    """Traces `apply(variables, *inputs)` and decides which BatchNorms fold.

    Args:
      apply: `model.apply` with the inference-mode keyword arguments bound.
      variables: the model's variables (arrays or `jax.ShapeDtypeStruct` values).
      inputs: example inputs (arrays or `jax.ShapeDtypeStruct` values).
      fold: whether folding is wanted at all (`False` reports every BatchNorm unfolded).

    Returns:
      The `Trace`.
    """
    recorder = _Recorder()

    def run(variables, *inputs):
        with nn.intercept_methods(recorder):
            return apply(variables, *inputs)

    closed = jax.make_jaxpr(run)(variables, *inputs)
    calls = tuple(recorder.calls)
    links = _links(closed)
    counts = Counter(c.path for c in calls)
    pairs: dict[Path, Path] = {}
    unfolded: list[tuple[str, str]] = []
    seen: set[Path] = set()
    for i, call in enumerate(calls):
        if call.kind not in (nn.BatchNorm, ConvBN) or call.path in seen:
            continue
        seen.add(call.path)
        reason = None
        if not fold:
            reason = "fold_batchnorm=False"
        elif counts[call.path] > 1:
            reason = f"called {counts[call.path]} times per forward pass"
        elif call.kind is ConvBN:
            conv = (*call.path, "conv")
            reason = _shape_mismatch(variables, conv, call)
            if reason is None:
                pairs[call.path] = conv
        elif i not in links:
            reason = "its input is not the direct output of a Conv/Dense"
        else:
            j, uses = links[i]
            src = calls[j]
            if uses > 1:
                reason = (
                    f"the output of {src.kind.__name__} {path_str(src.path)!r} has "
                    f"{uses - 1} other consumer(s)"
                )
            elif counts[src.path] > 1:
                reason = (
                    f"{src.kind.__name__} {path_str(src.path)!r} is called "
                    f"{counts[src.path]} times per forward pass"
                )
            elif _feature_axes(call.attrs["axis"], call.attrs["ndim"]) != (call.attrs["ndim"] - 1,):
                reason = f"it normalises axis {call.attrs['axis']}, not the last (channel) axis"
            else:
                reason = _shape_mismatch(variables, src.path, call)
                if reason is None:
                    pairs[call.path] = src.path
        if reason is not None:
            unfolded.append((path_str(call.path), reason))
    report = FoldReport(
        folded=tuple((path_str(lin), path_str(bn)) for bn, lin in pairs.items()),
        unfolded=tuple(unfolded),
    )
    return Trace(calls=calls, pairs=pairs, report=report)
