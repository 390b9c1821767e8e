"""Runs a per-leaf kernel on the shards of its operands: XLA cannot partition a Pallas call.

A Pallas kernel is a custom call: given sharded operands, XLA's SPMD partitioner would gather
every operand onto every device and run the whole kernel there. `per_shard` wraps an
elementwise-and-flag kernel in `custom_partitioning`: the partitioner hands each device its
shards (in the shardings the operands already have), the kernel runs on them, and the one
cross-device value is the finiteness flag, combined with a scalar `pmin` over the mesh axes
the operands are split on. Operands whose types are sharded over Explicit mesh axes run under
`jax.shard_map` instead (the same shards, the same `pmin`). On one device the kernel runs as
it is.

`per_row_shard` does the same for the channel kernels of a channels-last tensor (BatchNorm
statistics, the conv epilogue): each device runs them on its rows (data parallelism splits the
batch) and the per-channel sums they return are added over the devices with a `psum`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["per_row_shard", "per_shard"]


def _axes(shardings) -> tuple:
    """The mesh axis names any of `shardings` splits a dimension over, in mesh order."""
    used = set()
    for s in shardings:
        for entry in getattr(s, "spec", ()):
            if entry is None:
                continue
            used.update(entry if isinstance(entry, tuple) else (entry,))
    mesh = shardings[0].mesh if shardings else None
    return tuple(a for a in mesh.axis_names if a in used) if mesh is not None else ()


def _rule(shapes: list, write: bool) -> SdyShardingRule:
    """Every leaf dimension its own factor; outputs like inputs; the scale and flag scalars."""
    leaves = [ArrayMapping(*(f"l{i}d{d}" for d in range(len(s)))) for i, s in enumerate(shapes)]
    results = (*(leaves if write else []), ArrayMapping())
    return SdyShardingRule((ArrayMapping(), *leaves), tuple(results))


def per_shard(
    kernel: Callable[[list, jax.Array], tuple[list, jax.Array]],
    leaves: list,
    scale: jax.Array,
    *,
    write: bool,
) -> tuple[list, jax.Array]:
    """`kernel(leaves, scale)` run on each device's shards of `leaves`, its flag combined.

    Args:
      kernel: `(leaves, scale) -> (outputs, flag)`: elementwise outputs (one per leaf, same
        shape, if `write`; else an empty list) and a scalar bool flag that is the AND of a
        flag per element.
      leaves: the arrays, in any shardings.
      scale: a scalar (replicated).
      write: whether `kernel` returns one output per leaf.

    Returns:
      `(outputs, flag)`: the outputs sharded as `leaves`, the flag AND-ed over all shards.
    """
    if not leaves:
        return kernel(leaves, scale)
    explicit = _explicit_specs(leaves)
    if explicit is not None:
        return _per_explicit_shard(kernel, leaves, scale, *explicit, write=write)

    def body(scale, *xs):
        outs, flag = kernel(list(xs), scale)
        return (*outs, flag)

    # `custom_partitioning` has no batching rule: under `jax.vmap` (an ensemble of models,
    # each with its own skip decision) the kernel runs vmapped as it is.
    @jax.custom_batching.custom_vmap
    def run(scale, *xs):
        return _partitioned(body, kernel, [x.shape for x in xs], write)(scale, *xs)

    @run.def_vmap
    def run_batched(axis_size, in_batched, scale, *xs):
        in_axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(body, in_axes=in_axes, axis_size=axis_size)(scale, *xs)
        return out, tuple(True for _ in out)

    *outs, flag = run(scale, *leaves)
    return list(outs), flag


def _explicit_specs(leaves: list):
    """`(mesh, specs)` when the leaves' types are sharded over Explicit mesh axes, else None.

    Under Explicit axes a sharding is part of the type, known while tracing: the kernel
    runs under `jax.shard_map` (custom_partitioning's body would be traced on the global,
    sharded types, whose reshapes need their result's sharding spelled out).
    """
    shardings = [jax.typeof(x).sharding for x in leaves]
    if not any(s is not None and not s.mesh.empty and _axes([s]) for s in shardings):
        return None
    return shardings[0].mesh, [s.spec for s in shardings]


def _per_explicit_shard(kernel, leaves: list, scale, mesh, specs: list, *, write: bool):
    """`kernel` on each device's shards under `jax.shard_map`; the flag AND-ed with `pmin`."""
    axes = _axes([NamedSharding(mesh, s) for s in specs])

    def local(scale, *xs):
        outs, flag = kernel(list(xs), scale)
        return (*outs, jax.lax.pmin(flag.astype(jnp.int32), axes) > 0)

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), *specs),
        out_specs=(*(specs if write else ()), P()),
        axis_names=set(axes),
    )
    *outs, flag = mapped(scale, *leaves)
    return list(outs), flag


def _partitioned(body, kernel, shapes: list, write: bool):
    """`body` wrapped in `custom_partitioning`: run on each device's shards, flag AND-ed."""
    wrapped = custom_partitioning(body)

    def shardings(mesh, arg_shapes):
        leaf_shardings = tuple(a.sharding for a in arg_shapes[1:])
        replicated = NamedSharding(mesh, P())
        results = (*(leaf_shardings if write else ()), replicated)
        return (replicated, *leaf_shardings), results

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        args, results = shardings(mesh, arg_shapes)
        axes = _axes(args[1:])

        def lower(scale, *xs):
            outs, flag = kernel(list(xs), scale)
            if axes:
                flag = jax.lax.pmin(flag.astype(jnp.int32), axes) > 0
            return (*outs, flag)

        return mesh, lower, results, args

    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_rule(shapes, write),
    )
    return wrapped


def _entry_axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _split_entry(sharding, dim: int, size: int):
    """`sharding`'s spec entry for `dim` if its axes divide `size` evenly, else None."""
    spec = tuple(getattr(sharding, "spec", ())) + (None,) * (dim + 1)
    entry = spec[dim]
    ways = 1
    for a in _entry_axes(entry):
        ways *= sharding.mesh.shape[a]
    return entry if ways > 1 and size % ways == 0 else None


def per_row_shard(
    kernel: Callable[[list, list], tuple[list, list]],
    rows: list,
    vectors: list,
    *,
    n_row_outputs: int,
    n_sums: int,
) -> tuple[list, list]:
    """`kernel(rows, vectors)` run on each device's row block, its channel sums psum-ed.

    For the kernels of a channels-last tensor flattened to `(R, C)` (BatchNorm statistics,
    the conv epilogue): rows split over devices (data parallelism splits the batch, the
    leading dimension) stay where they are; each device runs the kernel on its rows and the
    per-channel sums it returns are added over the mesh axes the rows are split on, as a
    BatchNorm with `axis_name` does. The channel dimension may be split too (it is carried
    through); an uneven split is gathered first.

    Args:
      kernel: `(rows, vectors) -> (row_outputs, sums)`: `n_row_outputs` arrays `(R, C)`
        computed row by row, and arrays `(C,)` that are sums over the rows.
      rows: arrays `(R, C)`, in any shardings (all are given the first one's).
      vectors: arrays `(C,)`.
      n_row_outputs: how many row outputs `kernel` returns.
      n_sums: how many sums `kernel` returns.

    Returns:
      `(row_outputs, sums)`: the row outputs split as `rows[0]`, the sums over all rows.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax._src.kernels.sharded import per_row_shard
      >>> kernel = lambda rows, vecs: ([rows[0] * vecs[0]], [rows[0].sum(axis=0)])
      >>> outs, sums = per_row_shard(
      ...     kernel, [jnp.ones((4, 2))], [jnp.full(2, 3.0)], n_row_outputs=1, n_sums=1)
      >>> sums[0].tolist(), outs[0].shape
      ([4.0, 4.0], (4, 2))
    """
    n_rows = len(rows)

    def body(*args):
        outs, sums = kernel(list(args[:n_rows]), list(args[n_rows:]))
        return (*outs, *sums)

    @jax.custom_batching.custom_vmap
    def run(*args):
        shape, n_args = rows[0].shape, len(args)
        return _rows_partitioned(body, shape, n_rows, n_args, n_row_outputs, n_sums)(*args)

    @run.def_vmap
    def run_batched(axis_size, in_batched, *args):
        in_axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(body, in_axes=in_axes, axis_size=axis_size)(*args)
        return out, tuple(True for _ in out)

    out = run(*rows, *vectors)
    return list(out[:n_row_outputs]), list(out[n_row_outputs:])


def _rows_partitioned(body, shape: tuple, n_rows: int, n_args: int, n_row_outputs: int, n_sums):
    """`body` in `custom_partitioning`: rows on each device, sums psum-ed over the row axes."""
    wrapped = custom_partitioning(body)

    def shardings(mesh, arg_shapes):
        first = arg_shapes[0].sharding
        r, c = _split_entry(first, 0, shape[0]), _split_entry(first, 1, shape[1])
        row, vec = NamedSharding(mesh, P(r, c)), NamedSharding(mesh, P(c))
        args = (row,) * n_rows + (vec,) * (n_args - n_rows)
        return args, (row,) * n_row_outputs + (vec,) * n_sums, _entry_axes(r)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        args, results, axes = shardings(mesh, arg_shapes)

        def lower(*xs):
            out = body(*xs)
            if not axes:
                return out
            sums = jax.lax.psum(tuple(out[n_row_outputs:]), axes)
            return (*out[:n_row_outputs], *sums)

        return mesh, lower, results, args

    row, vec = ArrayMapping("r", "c"), ArrayMapping("c")
    rule = SdyShardingRule(
        (row,) * n_rows + (vec,) * (n_args - n_rows),
        (row,) * n_row_outputs + (vec,) * n_sums,
    )
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
    )
    return wrapped
