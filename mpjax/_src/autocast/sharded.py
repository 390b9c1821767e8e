"""Autocast rules for `jax.shard_map` and `jax.pmap` bodies: rewritten like any other body.

Each rule takes `(evaluate, ctx, eqn, vals, origins)` (see `autocast_rules`) and rebinds the
primitive through its public API with a body that runs under autocast, so the GEMMs inside
run in the compute dtype and the collectives see the dtypes the rewritten body produces.
"""

from __future__ import annotations

import jax

from mpjax._src.autocast.rules import STRONG

__all__ = ["SHARDED_RULES"]


def _body(evaluate, ctx, body, origins):
    """The autocast evaluation of a mapped body, as a function of its per-device arguments."""

    def local(*args):
        return tuple(evaluate(ctx, body, (), args, origins)[0])

    return local


def _shard_map(evaluate, ctx, eqn, vals, origins):
    """`jax.shard_map` of the autocast body, with the same mesh, specs and axes."""
    p = eqn.params
    mapped = jax.shard_map(
        _body(evaluate, ctx, p["jaxpr"], origins),
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=set(p["newly_manual_axes"]),
        check_vma=p["check_vma"],
    )
    outs = mapped(*vals)
    return list(outs), [STRONG] * len(outs)


def _pmap(evaluate, ctx, eqn, vals, origins):
    """`jax.pmap` of the autocast body, with the same axis, in/out axes and devices."""
    p = eqn.params
    mapped = jax.pmap(
        _body(evaluate, ctx, p["call_jaxpr"], origins),
        axis_name=p["axis_name"],
        in_axes=tuple(p["in_axes"]),
        out_axes=tuple(p["out_axes"]),
        devices=p["devices"],
        backend=p["backend"],
        axis_size=p["global_axis_size"] if p["is_explicit_global_axis_size"] else None,
    )
    outs = mapped(*vals)
    return list(outs), [STRONG] * len(outs)


SHARDED_RULES = {"shard_map": _shard_map, "xla_pmap": _pmap}
