"""`weight_copies`: each weight's block-quantised copies, made once per training step.

A block-scaled GEMM (`block_scaled_dot_general`) quantises its weight in the forward pass:
both copies (`quantize_weight`: the forward GEMM's along `K`, the input gradient's along
`N`). A step that runs the model several times on the same weights (gradient accumulation:
`optax.MultiSteps`, or a `lax.scan` over micro-batches) would quantise every weight once per
micro-batch. `weight_copies` makes the copies once, from the weights as an `autocast`
function's GEMMs read them, and `autocast(..., fp8_weights=copies)` hands them to those
GEMMs instead (Transformer Engine keeps fp8 weights across micro-batches the same way).

Which GEMMs: a `dot_general` that runs in the recipe's block format and reads a leaf of the
weights argument directly (Flax `Dense`/`DenseGeneral` kernels, `Embed.attend`, `x @ w` in
plain JAX), also inside a `lax.scan` that closes over it (a scanned micro-batch loop), or
one layer of a leaf stacked along axis 0 that a `lax.scan` runs over (`nn.scan` layers: the
copies are made for every layer at once and scanned over beside the weights), and inside a
`jax.checkpoint` / `nn.remat` body (remat'ed layers, also within a scan over layers). A
weight read through a `jax.jit` boundary, a nested scan over layers, or any op before the
GEMM is quantised at its GEMM as without copies.

The copies are only as fresh as the weights they were made from: make them again whenever
the weights change (`refresh=` below, e.g. `MultiStepsState.mini_step == 0`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from mpjax._src.core.dataclass import field, pytree_dataclass
from mpjax._src.fp8.block_dot import native_block_gemms, quantize_weight

__all__ = ["WeightCopies", "WeightLookup", "WeightRecorder", "weight_copies"]


@pytree_dataclass
class WeightCopies:
    """The block-quantised copies of the weights one `autocast` function's GEMMs read.

    Attributes:
      copies: one `OrientedBlocks` (both copies) per site, in `sites`' order.
      sites: `(leaf index, contracted axes, recipe, layered)` of each copy: which leaf of
        the weights argument, contracted how, in which block format, and whether of each
        layer of a leaf stacked along axis 0 that a `lax.scan` runs over (the copies
        stacked the same way) (static).
      treedef: the weights argument's tree structure (static).
      argnum: the position of the weights among the function's arguments (static).
    """

    copies: tuple
    sites: tuple = field(static=True)
    treedef: Any = field(static=True)
    argnum: int = field(static=True)


class WeightRecorder:
    """Collects the sites of one trace (what `weight_copies` asks `autocast` for)."""

    def __init__(self, argnum: int):
        self.argnum = argnum
        self.sites: list = []


class WeightLookup:
    """One `autocast` call's weights: which traced values are leaves of the weights argument
    (or, inside a `lax.scan` over a stacked leaf, one layer of it), and their copies (or the
    recorder that collects the sites).

    A site is `(leaf, contracted axes, recipe, layered)`; `layered` sites are of one layer of
    a leaf stacked along axis 0 and scanned over, their copies stacked the same way.
    """

    def __init__(self, ids: dict, spec: WeightCopies | WeightRecorder, layers: dict | None = None):
        self._ids = ids  # id(value) -> (leaf index, layered)
        self._spec = spec
        self._layers = layers or {}  # layered site -> the copies of the current layer

    def __call__(self, rhs: Any, contract: tuple, recipe: Any) -> Any:
        """`rhs`'s copies for a GEMM contracting `contract` in `recipe`'s format, or None."""
        entry = self._ids.get(id(rhs))
        if entry is None:
            return None
        site = (entry[0], tuple(contract), recipe, entry[1])
        if isinstance(self._spec, WeightRecorder):
            if site not in self._spec.sites:
                self._spec.sites.append(site)
            return None
        if entry[1]:
            return self._layers.get(site)
        if site not in self._spec.sites:
            return None
        return self._spec.copies[self._spec.sites.index(site)]

    def passed(self, outer: list, inner: list) -> WeightLookup:
        """The lookup of a body that receives `outer` as its arguments `inner` (a
        `jax.checkpoint` / `nn.remat` body): a weight passed in is still the weight there."""
        ids = dict(self._ids)
        for o, i in zip(outer, inner, strict=True):
            if id(o) in self._ids:
                ids[id(i)] = self._ids[id(o)]
        return WeightLookup(ids, self._spec, self._layers)

    def scanned(self, xs: list) -> tuple[list, Callable[[list, list], WeightLookup]]:
        """For a `lax.scan` over `xs`: the stacked copies to scan over beside them, and
        `child(x, extra)` giving the lookup of the body (whose `x` are the slices of `xs`
        and `extra` the slices of the stacked copies)."""
        stacked = {
            i: self._ids[id(x)][0]
            for i, x in enumerate(xs)
            if id(x) in self._ids and not self._ids[id(x)][1]
        }
        sites = []
        if isinstance(self._spec, WeightCopies):
            leaves = set(stacked.values())
            sites = [s for s in self._spec.sites if s[3] and s[0] in leaves]
        extra = [self._spec.copies[self._spec.sites.index(s)] for s in sites]

        def child(x: list, extra_slices: list) -> WeightLookup:
            ids = {k: v for k, v in self._ids.items() if not v[1]}  # closed-over weights
            ids.update({id(x[i]): (leaf, True) for i, leaf in stacked.items()})
            return WeightLookup(ids, self._spec, dict(zip(sites, extra_slices, strict=True)))

        return extra, child


def weight_lookup(spec: Any, args: tuple, leaves: list, dynamic: list) -> WeightLookup:
    """The `WeightLookup` of one call of an autocast function with `fp8_weights=spec`.

    Args:
      spec: a `WeightCopies` (or a `WeightRecorder`).
      args: the call's positional arguments.
      leaves: the leaves of `(args, kwargs)`, as the call traces them.
      dynamic: the indices of the array leaves among `leaves`.

    Returns:
      A `WeightLookup` over the leaves of `args[spec.argnum]`.
    """
    if not isinstance(spec, (WeightCopies, WeightRecorder)):
        raise TypeError(
            f"autocast: fp8_weights must be a WeightCopies (mpjax.fp8.weight_copies), got "
            f"{type(spec).__name__}"
        )
    if not 0 <= spec.argnum < len(args):
        raise ValueError(
            f"autocast: fp8_weights are of positional argument {spec.argnum}, but the call "
            f"has {len(args)} positional arguments"
        )
    weights = args[spec.argnum]
    treedef = jax.tree.structure(weights)
    if isinstance(spec, WeightCopies) and treedef != spec.treedef:
        raise ValueError(
            f"autocast: fp8_weights were made for weights of another structure than argument "
            f"{spec.argnum} of this call ({spec.treedef.num_leaves} leaves there, "
            f"{treedef.num_leaves} here): make them with weight_copies from these weights"
        )
    offset = len(jax.tree.leaves(args[: spec.argnum]))
    arrays = set(dynamic)
    ids = {
        id(leaves[offset + j]): (j, False)
        for j in range(treedef.num_leaves)
        if offset + j in arrays
    }
    return WeightLookup(ids, spec)


def _sites(fn: Callable, argnum: int, args: tuple, kwargs: dict) -> tuple:
    """The GEMM sites of `fn(*args, **kwargs)` that read a leaf of `args[argnum]` (a trace
    with abstract arrays: nothing is computed)."""
    rebuild = getattr(fn, "with_fp8_weights", None)
    if rebuild is None:
        raise TypeError(
            f"weight_copies: fn must be a function returned by mpjax.autocast(..., fp8=...), got "
            f"{getattr(fn, '__qualname__', type(fn).__name__)}"
        )
    recorder = WeightRecorder(argnum)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

    def trace(*values):
        full = list(leaves)
        for i, value in zip(dynamic, values, strict=True):
            full[i] = value
        a, k = jax.tree.unflatten(treedef, full)
        return rebuild(fp8_weights=recorder)(*a, **k)

    jax.eval_shape(trace, *[leaves[i] for i in dynamic])
    return tuple(recorder.sites)


def _check_previous(previous: tuple, expected: tuple, sites: tuple, weights: Any) -> None:
    """Refuses `previous` copies whose arrays differ in shape or dtype from the copies made
    now (weights of other shapes, or another recipe's dtypes), naming the weight leaf."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(weights)[0]]
    for site, old, new in zip(sites, previous, expected, strict=True):
        old_leaves = jax.tree_util.tree_flatten_with_path(old)[0]
        new_leaves = jax.tree.leaves(new)
        if len(old_leaves) != len(new_leaves):
            raise ValueError(
                f"weight_copies: previous copies of weight {paths[site[0]] or '(the leaf)'} "
                "have other parts than the copies made now: make them with weight_copies "
                "from these weights"
            )
        for (path, a), b in zip(old_leaves, new_leaves, strict=True):
            if tuple(np.shape(a)) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(b.dtype):
                raise ValueError(
                    f"weight_copies: previous copies of weight {paths[site[0]] or '(the leaf)'}"
                    f" ({jax.tree_util.keystr(path)}) are {np.dtype(a.dtype)}"
                    f"{list(np.shape(a))}, the copies of the weights given now "
                    f"{np.dtype(b.dtype)}{list(b.shape)}: the weights changed shape since "
                    "previous was made; make the copies again without previous= (or from "
                    "weights of the previous shapes)"
                )


def weight_copies(
    fn: Callable,
    *args: Any,
    argnum: int = 0,
    previous: WeightCopies | None = None,
    refresh: Any = None,
    **kwargs: Any,
) -> WeightCopies:
    """The block-quantised copies of the weights that `fn`'s block-scaled GEMMs read.

    `fn` is traced (abstractly, nothing runs) on `args` to find its GEMMs that read a leaf
    of `args[argnum]` directly in a block-scaled format; each such weight is quantised as
    that GEMM would (both copies, `quantize_weight`). Pass the result to
    `mpjax.autocast(..., fp8_weights=copies)`: those GEMMs then read the copies instead of
    quantising their weight, bit for bit the same copies, and the gradients still reach the
    weights. Under gradient accumulation, keep the copies in the training state and make
    them again only when the weights change (`previous`, `refresh`).

    Args:
      fn: a function returned by `mpjax.autocast(..., fp8=<block-scaled recipe>)`.
      *args: `fn`'s positional arguments (arrays or `jax.ShapeDtypeStruct` values, except
        the weights, which must be arrays).
      argnum: the position of the weights among `args`.
      previous: the copies of the previous call, to keep where `refresh` is false.
      refresh: with `previous`, a boolean scalar (traced or not): make the copies again
        (True) or return the copies of `previous` (False), under `lax.cond`.
      **kwargs: `fn`'s keyword arguments.

    Returns:
      A `WeightCopies`.

    Raises:
      TypeError / ValueError: `fn` not an autocast function, `previous` made for other
        weights or another function, `previous` whose copies differ in shape or dtype from
        those of the weights given (the message names the weight leaf and both shapes),
        `previous` without `refresh`.

    Example:
      >>> import jax, jax.numpy as jnp, mpjax
      >>> from mpjax.fp8 import weight_copies
      >>> recipe = mpjax.Fp8Recipe("mxfp8", block_lowering="emulated")
      >>> loss = lambda w, x: jnp.sum(x @ w["kernel"])
      >>> w, x = {"kernel": jnp.ones((128, 128))}, jnp.ones((64, 128))
      >>> copies = weight_copies(mpjax.autocast(loss, fp8=recipe), w, x)
      >>> len(copies.copies), copies.copies[0].columns.data.dtype
      (1, dtype(float8_e4m3fn))
      >>> fast = mpjax.autocast(loss, fp8=recipe, fp8_weights=copies)
      >>> float(jax.grad(fast)(w, x)["kernel"][0, 0])
      64.0
    """
    if not 0 <= argnum < len(args):
        raise ValueError(f"weight_copies: argnum={argnum}, but {len(args)} positional arguments")
    sites = _sites(fn, argnum, args, kwargs)
    weights, treedef = jax.tree.flatten(args[argnum])

    def make() -> tuple:
        out = []
        for leaf, contract, recipe, layered in sites:
            w = weights[leaf]
            impl = "auto" if native_block_gemms(recipe, w) else "xla"

            def quantize(w, contract=contract, recipe=recipe, impl=impl):
                return quantize_weight(w, contract, recipe, impl)

            out.append(jax.vmap(quantize)(w) if layered else quantize(w))
        return tuple(out)

    if previous is None:
        return WeightCopies(make(), sites, treedef, argnum)
    if refresh is None:
        raise ValueError("weight_copies: previous= needs refresh= (when to make them again)")
    if not isinstance(previous, WeightCopies):
        raise TypeError(
            f"weight_copies: previous must be a WeightCopies, got {type(previous).__name__}"
        )
    if (previous.sites, previous.treedef, previous.argnum) != (sites, treedef, argnum):
        raise ValueError(
            "weight_copies: previous copies were made for other weights or another function "
            f"({len(previous.sites)} sites there, {len(sites)} here)"
        )
    _check_previous(previous.copies, jax.eval_shape(make), sites, args[argnum])
    copies = lax.cond(refresh, make, lambda: previous.copies)
    return WeightCopies(copies, sites, treedef, argnum)
