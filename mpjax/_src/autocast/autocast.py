"""`autocast`: rewrites a JAX function at the jaxpr level to run in mixed precision.

Like `torch.autocast`, but as a function transformation: the function is traced to a jaxpr
and re-evaluated equation by equation, each primitive rebound with operands cast by the
rules of an `OpLists`:

* `lower_precision` ops (`dot_general`, `conv_general_dilated`) take compute-dtype operands
  and return the compute dtype, accumulating in float32 (the backends' low-precision GEMMs
  and convolutions accumulate in float32; see `lower_precision_op`);
* a compute-dtype value normalised by broadcast float32 statistics (BatchNorm, LayerNorm)
  is computed in float32 and counts as the compute dtype (see `continues_narrow`); rows
  gathered from a floating argument (an embedding table) are gathered in the compute dtype;
* `fp32` ops (exp, log, rsqrt, reductions, ...) run in float32;
* every other op runs in the widest dtype of its floating inputs; scalar literals and values
  computed from literals alone adapt to their partner (like JAX's weak types);
* integer and boolean values are never cast;
* constants (literals, captured arrays and values computed from them alone) saturate when
  cast to a narrower dtype: `jnp.finfo(jnp.float32).min` becomes the most negative finite
  bfloat16/float16, not -inf. Values computed from the inputs overflow to inf as IEEE casts
  do (torch.autocast does the same), so an fp16 overflow stays visible to loss scaling.

Higher-order primitives are rewritten recursively (see `_rules`). The function's floating
outputs leave in the policy's `output_dtype`; its inputs are not cast (parameters stay in the
dtype they are given in, so gradients reach float32 parameters in float32).

The interpreter that re-evaluates the jaxpr is `mpjax._src.autocast.interpreter`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpjax._src.autocast.attention import attention_in
from mpjax._src.autocast.fp8_hook import check_autocast_recipe
from mpjax._src.autocast.fp8_last import kept_last
from mpjax._src.autocast.gemm_names import GemmNames, nnx_leaf_names
from mpjax._src.autocast.interpreter import _eval_jaxpr, _lower, _wide
from mpjax._src.autocast.op_decisions import AutocastContext
from mpjax._src.autocast.op_lists import OpLists
from mpjax._src.autocast.regions import REGION_SCOPE, is_nested, tracing
from mpjax._src.autocast.rules import ARG, cast, dtype_of
from mpjax._src.core.policy import Policy, as_float_dtype, get_policy
from mpjax._src.fp8.recipe import Fp8Recipe
from mpjax._src.fp8.weight_copies import weight_lookup

__all__ = ["autocast"]

DEFAULT_AUTOCAST_POLICY = "params=float32,compute=bfloat16,output=float32"

# ----------------------------------------------------------------------------- public API


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


_OUTPUT_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _check_outputs(fun: Callable, out: Any, leaves: list) -> None:
    """Raises a TypeError naming `fun` and the output that is not an array (a str, None...)."""
    if all(isinstance(leaf, _OUTPUT_TYPES) for leaf in leaves):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, _OUTPUT_TYPES):
            where = f"output{jax.tree_util.keystr(path)}" if path else "its output"
            name = getattr(fun, "__qualname__", None) or repr(fun)
            raise TypeError(
                f"autocast: {name} returned {leaf!r} ({type(leaf).__name__}) as {where}; an "
                "autocast function must return arrays (a pytree of arrays): return other "
                "values from a function outside autocast, or register the type as a pytree"
            )


def autocast(
    fun: Callable | None = None,
    policy: str | Policy = DEFAULT_AUTOCAST_POLICY,
    *,
    op_lists: OpLists | None = None,
    accumulation_dtype: Any = jnp.float32,
    fp8: Fp8Recipe | None = None,
    fp8_weights: Any = None,
) -> Callable:
    """Returns `fun` rewritten to run in mixed precision, like `torch.autocast`.

    `fun` (any JAX function: a Flax `apply`, a Haiku or Equinox forward, plain `jnp` code) is
    traced to a jaxpr at each call and re-evaluated with casts: ops in
    `op_lists.lower_precision` take `policy.compute_dtype` operands, accumulate in
    `accumulation_dtype` and return the compute dtype; ops in `op_lists.fp32` run in
    float32; other ops run in the widest dtype of their floating inputs; integers and
    booleans are never cast. A constant cast to a narrower dtype saturates to its finite
    range (a `finfo(float32).min` mask stays finite); a value computed from the arguments
    overflows to inf. It recurses into `jit`, `custom_jvp`, `scan`, `while`, `cond` and
    `checkpoint`; `custom_vjp` functions keep their own rules and traced dtypes.
    `jax.nn.dot_product_attention` runs as written in the compute dtype (a bfloat16/float16
    one): query, key, value and bias cast to it, its implementation (cuDNN's fused kernel
    with `implementation="cudnn"`) and result dtype those of the hand-written call. Array
    arguments (and their gradients) keep their dtype; other arguments (Python scalars,
    strings, flags) are static. Floating outputs are cast to `policy.output_dtype`.
    Composes with `jax.jit`, `jax.grad` and `jax.vmap`. `fun` is traced with
    `jax.make_jaxpr` at every call, so, as under `jax.jit`, it cannot branch on array
    values; wrap the result in `jax.jit` to trace once.

    Args:
      fun: the function; omit it to use `autocast(policy=...)` as a decorator.
      policy: a `Policy` or spec string; `compute_dtype` and `output_dtype` are used
        (`param_dtype` is not: arguments are not cast); with `reduce_dtype` set, the
        gradients of the array arguments that are `dot_general` operands (the weights) leave
        their GEMM in `reduce_dtype`, the dtype XLA sums them across devices in.
        `output_dtype` applies where values leave `fun`, as it applies at the boundary of
        the model for `apply_policy`.
      op_lists: an `OpLists`; defaults to `OpLists()`.
      accumulation_dtype: the accumulation dtype of lower-precision ops. float32 (the
        default) is what every XLA backend's bf16/fp16 GEMMs and convolutions do, so the ops
        are bound with a compute-dtype result (no float32 output to convert); `None` leaves
        accumulation to the backend (the same binding); another dtype is requested with
        `preferred_element_type` and the result converted to the compute dtype.
      fp8: an `Fp8Recipe` (tensorwise or rowwise scaling) to run eligible `dot_general`s
        as fp8 GEMMs, forward and backward (see `mpjax.fp8.fp8_eligible`), and 1x1
        convolutions too with `convs="1x1"`; the other lower-precision ops (other
        convolutions included, see `Fp8Recipe.convs`) keep the compute dtype.
        `mpjax.fp8.fp8_ops` lists which ops run in fp8. A pointwise chain with a
        transcendental op (a GELU) that only such a GEMM reads is recomputed in the
        backward pass instead of keeping its intermediates (`mpjax._src.autocast.fp8_recompute`).
      fp8_weights: a `WeightCopies` (`mpjax.fp8.weight_copies`): the block-scaled GEMMs that
        read a weight it has copies of take them instead of quantising the weight (once per
        step under gradient accumulation).

    Returns:
      A function with `fun`'s signature.

    Raises:
      TypeError / ValueError: for a non-callable `fun`, a bad policy, `op_lists` or
        accumulation dtype, naming the culprit.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import autocast
      >>> f = autocast(lambda x, w: jnp.tanh(x @ w), "p=f32,c=bf16,o=f32")
      >>> f(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
      dtype('float32')
    """
    if fun is None:
        return functools.partial(
            autocast,
            policy=policy,
            op_lists=op_lists,
            accumulation_dtype=accumulation_dtype,
            fp8=fp8,
            fp8_weights=fp8_weights,
        )
    if not callable(fun):
        raise TypeError(f"autocast: fun must be callable, got {type(fun).__name__}")
    try:
        pol = get_policy(policy)
    except (TypeError, ValueError) as e:
        raise type(e)(f"autocast: bad policy: {e}") from e
    lists = OpLists() if op_lists is None else op_lists
    if not isinstance(lists, OpLists):
        raise TypeError(
            f"autocast: op_lists must be an mpjax OpLists, got {type(lists).__name__}; "
            "build one with OpLists(...) or OpLists().with_added(...)"
        )
    accum = (
        None
        if accumulation_dtype is None
        else as_float_dtype(accumulation_dtype, "autocast accumulation_dtype")
    )
    # float64 is never autocast (as in torch), unless the policy itself names float64: then
    # float64 was asked for, and the output dtype it names is honoured.
    keep_wide = not any(_wide(d) for d in (pol.param_dtype, pol.compute_dtype, pol.output_dtype))
    if fp8_weights is not None and fp8 is None:
        raise ValueError(
            "autocast: fp8_weights (block-quantised weight copies) need fp8=<the block-scaled "
            "Fp8Recipe they were made for>"
        )
    ctx = AutocastContext(
        pol.compute_dtype,
        accum,
        lists,
        check_autocast_recipe(fp8),
        pol.reduce_dtype,
        pol.saved_activations,
    )

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
        out_tree = []

        def flat_fun(*dyn):
            full = list(leaves)
            for i, value in zip(dynamic, dyn, strict=True):
                full[i] = value
            a, k = jax.tree.unflatten(treedef, full)
            out = fun(*a, **k)
            out_leaves, tree = jax.tree.flatten(out)
            _check_outputs(fun, out, out_leaves)
            out_tree.append(tree)
            return out_leaves

        dyn_vals = [leaves[i] for i in dynamic]
        weights = None if fp8_weights is None else weight_lookup(fp8_weights, args, leaves, dynamic)
        nested = is_nested()
        with tracing(), attention_in(pol.compute_dtype):
            closed = jax.make_jaxpr(flat_fun)(*dyn_vals)
        # Inside another autocast's trace, this region's equations are marked so that the
        # outer rewrite keeps their dtypes (the innermost region's policy wins).
        region = jax.named_scope(REGION_SCOPE) if nested else contextlib.nullcontext()
        lower = functools.partial(_lower, lists)
        kept = frozenset(kept_last(ctx.fp8, closed.jaxpr, lower))
        names = None
        if ctx.fp8 is not None:
            paths = nnx_leaf_names(args, kwargs)
            names = GemmNames({id(leaves[i]): paths[i] for i in dynamic if i in paths})
        run = ctx._replace(fp8_kept=kept, fp8_weights=weights, fp8_names=names)
        with region:
            outs, _ = _eval_jaxpr(run, closed.jaxpr, closed.consts, dyn_vals, [ARG] * len(dyn_vals))
            outs = [
                o if keep_wide and _wide(dtype_of(o)) else cast(o, pol.output_dtype) for o in outs
            ]
        if names is not None:
            names.check(ctx.fp8, getattr(fun, "__qualname__", type(fun).__name__))
        return jax.tree.unflatten(out_tree[0], outs)

    wrapped.policy = pol
    wrapped.op_lists = lists
    wrapped.with_fp8_weights = functools.partial(
        autocast,
        fun,
        policy,
        op_lists=op_lists,
        accumulation_dtype=accumulation_dtype,
        fp8=fp8,
    )
    return wrapped
