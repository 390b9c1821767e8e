"""Delayed fp8 scaling (Transformer Engine's `DelayedScaling`): per-tensor amax history state.

Each fp8 GEMM site keeps, in the `"fp8_meta"` variable collection, an `amax_history` of
shape `[3, amax_history_len]` (rows: input x, kernel w, output gradient g; newest amax in
column 0) and a `scale` of shape `[3]`. A step quantises with the stored scales (computed
from earlier steps' amaxes), and the amaxes it observes leave through the cotangent of
`scale`: differentiate the loss with respect to the fp8 meta too and pass that cotangent
to `update_fp8_meta`, which rolls the histories and recomputes the scales.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax._src.core.sharding import transposed_sharding
from mpjax._src.fp8.dot import scaled_gemm
from mpjax._src.fp8.layouts import grad_lhs_layout, grad_rhs_layout
from mpjax._src.fp8.quant import compute_scale, fp8_max, quantize
from mpjax._src.fp8.recipe import Fp8Recipe, Fp8Site

__all__ = [
    "FP8_META",
    "delayed_fp8_dot_general",
    "delayed_site_dot",
    "excluded_by_name",
    "init_fp8_meta",
    "kernel_eligible",
    "update_fp8_meta",
]

FP8_META = "fp8_meta"  # the variable collection of the delayed-scaling state
_F32 = jnp.float32


def _amax(x):
    """max |x| reduced in x's own dtype (exact), then float32: no float32 copy of x."""
    return jnp.max(jnp.abs(x)).astype(_F32)


def _quantize_keep_inf(x, scale, dtype):
    """`quantize` (saturating), but an inf becomes NaN instead of +-fp8_max.

    For the output gradient: a stored scale saturates large finite values on purpose; an
    inf gradient saturated the same way would leave the weight gradients finite and hide
    an overflow from loss scaling. Forward operands saturate as specified (doing this
    there too slowed the wide LM's step on the H100 cost model).
    """
    y = x.astype(_F32)
    top = np.float32(fp8_max(dtype))
    # `y - y` is 0, or NaN for an inf (and a NaN): added after the clip, it keeps the
    # saturation of finite values and turns an inf into NaN, in plain arithmetic that XLA
    # fuses into the GEMM's operand pass (a select there made the step slower).
    return (jnp.clip(y * scale, -top, top) + (y - y)).astype(dtype)


def init_fp8_meta(recipe: Fp8Recipe) -> dict:
    """One site's initial state: an all-zero `amax_history` `[3, L]` and unit `scale` `[3]`."""
    return {
        "amax_history": jnp.zeros((3, recipe.amax_history_len), _F32),
        "scale": jnp.ones((3,), _F32),
    }


def delayed_fp8_dot_general(
    lhs, rhs, dimension_numbers, scale, recipe: Fp8Recipe, compute_dtype: Any, axis_name=None
):
    """`lax.dot_general(lhs, rhs)` with fp8 GEMMs quantised with stored (delayed) scales.

    Forward: `lhs` and `rhs` quantised to `recipe.forward_dtype` with `scale[0]` and
    `scale[1]`; backward: the output gradient quantised to `recipe.backward_dtype` with
    `scale[2]` (e5m2 x e4m3 input-gradient GEMM, e4m3 x e5m2 weight-gradient GEMM, as
    `fp8_dot_general`). The cotangent of `scale` is this call's `[amax(x), amax(w),
    amax(g)]` (float32; `lax.pmax` over `axis_name` when given), for `update_fp8_meta`.

    Args:
      lhs: left operand (activations).
      rhs: right operand (weights).
      dimension_numbers: `dot_general` dimension numbers without batch dimensions.
      scale: float32 `[3]` scales of x, w and g.
      recipe: the delayed-scaling `Fp8Recipe`.
      compute_dtype: the output dtype of every GEMM.
      axis_name: a pmap/shard_map axis name to reduce the amaxes over, or None.

    Returns:
      The product in `compute_dtype`.
    """
    (lc0, rc0), (lb0, rb0) = dimension_numbers
    dims = ((tuple(lc0), tuple(rc0)), (tuple(lb0), tuple(rb0)))
    compute = np.dtype(compute_dtype)
    fwd_t, bwd_t = recipe.forward_dtype, recipe.backward_dtype
    a_ndim, b_ndim = np.ndim(lhs), np.ndim(rhs)
    a_dtype, b_dtype = lhs.dtype, rhs.dtype

    def reduce(amaxes):
        return amaxes if axis_name is None else lax.pmax(amaxes, axis_name)

    def forward(a, b, s):
        qa, qb = quantize(a, s[0], fwd_t), quantize(b, s[1], fwd_t)
        out = scaled_gemm(qa, s[0], qb, s[1], dims, compute)
        seen = (_amax(a), _amax(b))
        hi = a if recipe.high_precision_grad_weight else None
        return out, (qa, qb, s, seen, hi)

    def backward(saved, g):
        qa, qb, s, (amax_a, amax_b), hi = saved
        qg = _quantize_keep_inf(g, s[2], bwd_t)
        gdims, perm = grad_lhs_layout(dims, a_ndim, b_ndim)
        a_sharding = transposed_sharding(qa, perm)
        da = jnp.transpose(scaled_gemm(qg, s[2], qb, s[1], gdims, compute, a_sharding), perm)
        gdims, perm = grad_rhs_layout(dims, a_ndim, b_ndim)
        b_sharding = transposed_sharding(qb, perm)
        if hi is not None:
            db = lax.dot_general(
                hi.astype(compute), g.astype(compute), gdims, out_sharding=b_sharding
            )
        else:
            db = scaled_gemm(qa, s[0], qg, s[2], gdims, compute, b_sharding)
        db = jnp.transpose(db, perm)
        seen = reduce(jnp.stack([amax_a, amax_b, _amax(g)]))
        return da.astype(a_dtype), db.astype(b_dtype), seen

    op = jax.custom_vjp(lambda a, b, s: forward(a, b, s)[0])
    op.defvjp(forward, backward)
    return op(lhs, rhs, jnp.asarray(scale, _F32))


def kernel_eligible(recipe: Fp8Recipe, site: Fp8Site, ask_exclude: bool = True) -> bool:
    """Whether a GEMM site gets delayed-scaling state: judged on its kernel (`rhs`) only.

    No batch dimensions; the kernel's contracting and output sizes multiples of 16 and at
    least `recipe.min_dim`; not excluded by `recipe.exclude` / `exclude_if` (unless
    `ask_exclude` is False). The activation's shape plays no part, so the state exists
    whatever the input (linen `init` and `apply` agree; NNX creates it in `apply_policy`);
    `delayed_site_dot` checks the activation's free size at call time.
    """
    (_, rc), (lb, _) = site.dimension_numbers
    if lb:
        return False
    rhs = site.rhs_shape
    k = math.prod(rhs[i] for i in rc)
    n = math.prod(s for i, s in enumerate(rhs) if i not in rc)
    if any(s < recipe.min_dim or s % 16 for s in (k, n)):
        return False
    return not (ask_exclude and recipe.excludes(site))


def excluded_by_name(recipe: Fp8Recipe, name: str) -> bool:
    """Whether `recipe.exclude`'s patterns (not `exclude_if`, which needs shapes) match `name`."""
    return dataclasses.replace(recipe, exclude_if=None).excludes(Fp8Site(name, (), (), None))


def delayed_site_dot(
    lhs, rhs, dims, scale, recipe: Fp8Recipe, axis_name=None, precision=None, preferred=None
):
    """An eligible site's GEMM: `delayed_fp8_dot_general` if the activation's free size is a
    multiple of 16, else `lax.dot_general` in the compute dtype (recording amax 0)."""
    (lc, _), _ = dims
    m = math.prod(s for i, s in enumerate(np.shape(lhs)) if i not in lc)
    if m % 16:
        return lax.dot_general(lhs, rhs, dims, precision, preferred)
    compute = preferred or lhs.dtype
    return delayed_fp8_dot_general(lhs, rhs, dims, scale, recipe, compute, axis_name)


def _is_site(node: Any) -> bool:
    return isinstance(node, Mapping) and "amax_history" in node and "scale" in node


def _update_site(site: Mapping, seen: jnp.ndarray, recipe: Fp8Recipe) -> dict:
    """One site's new state; leading axes (stacked layers: `[..., 3, L]`) are batched over."""
    history = jnp.asarray(site["amax_history"], _F32)
    old_scale = jnp.asarray(site["scale"], _F32)
    seen = jnp.asarray(seen, _F32)
    finite = jnp.isfinite(seen)
    rolled = jnp.roll(history, 1, axis=-1).at[..., 0].set(seen)
    history = jnp.where(finite[..., None], rolled, history)  # a NaN/inf amax is never recorded
    if recipe.amax_compute == "max":
        reduced = jnp.max(history, axis=-1)
    else:
        reduced = history[..., 0]
    pow2 = recipe.power_of_two
    scale = jnp.concatenate(
        [
            compute_scale(reduced[..., :2], recipe.forward_dtype, recipe.margin, pow2),
            compute_scale(reduced[..., 2:], recipe.backward_dtype, recipe.margin, pow2),
        ],
        axis=-1,
    )
    scale = jnp.where(reduced > 0, scale, old_scale)  # amax 0: keep the last (finite) scale
    return {"amax_history": history, "scale": scale}


def update_fp8_meta(fp8_meta: Any, fp8_meta_grads: Any, recipe: Fp8Recipe) -> dict:
    """The fp8 meta after a step: each history rolled by the step's amaxes, scales recomputed.

    For every site, the amaxes `[x, w, g]` that `jax.grad` returned as the cotangent of its
    `scale` go into column 0 of `amax_history` (the oldest column drops out); a non-finite
    amax is not recorded (that tensor's history and scale stay as they were). The new scale
    is `fp8_max / reduced_amax / 2**margin` (e4m3 max for x and w, the backward format's for
    g), `reduced_amax` the history's max (`amax_compute="max"`) or its newest entry
    (`"most_recent"`); where that amax is 0 the previous scale is kept (it starts at 1).
    Call it inside the jitted train step, after `jax.grad`; under `loss_scaled`, wrap it in
    `mpjax.keep_if_skipped(new_meta, old_meta, opt_state)` so a skipped step leaves the meta
    bit-identical. A module called twice in one step gets the sum of its calls' amaxes (an
    upper bound of their max). A site with leading axes (`[..., 3, L]`: stacked layers) is
    updated layer by layer.

    Args:
      fp8_meta: the `"fp8_meta"` collection (from `model.init`).
      fp8_meta_grads: the gradient of the loss with respect to `fp8_meta`.
      recipe: the delayed-scaling `Fp8Recipe` the model runs with.

    Returns:
      The new `"fp8_meta"` collection (nested dicts, same structure).

    Raises:
      ValueError: the two trees differ in structure, or hold no fp8 site.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import flax.linen as nn
      >>> import mpjax
      >>> from mpjax.fp8 import update_fp8_meta
      >>> recipe = mpjax.Fp8Recipe(scaling="delayed", amax_history_len=4, min_dim=16)
      >>> model = mpjax.apply_policy(nn.Dense(16), "compute=bfloat16", fp8=recipe)
      >>> x = jnp.full((16, 16), 2.0)
      >>> variables = model.init(jax.random.key(0), x)
      >>> params, fp8_meta = variables["params"], variables["fp8_meta"]
      >>> def loss(params, fp8_meta):
      ...     return jnp.mean(model.apply({"params": params, "fp8_meta": fp8_meta}, x))
      >>> grads, meta_grads = jax.grad(loss, argnums=(0, 1))(params, fp8_meta)
      >>> fp8_meta = update_fp8_meta(fp8_meta, meta_grads, recipe)
      >>> fp8_meta["amax_history"][0], fp8_meta["scale"][0]  # input: amax 2, scale 448 / 2
      (Array([2., 0., 0., 0.], dtype=float32), Array(224., dtype=float32))
    """
    if not isinstance(recipe, Fp8Recipe) or recipe.scaling != "delayed":
        raise ValueError(f"update_fp8_meta: needs an Fp8Recipe(scaling='delayed'), got {recipe!r}")
    if jax.tree.structure(fp8_meta) != jax.tree.structure(fp8_meta_grads):
        raise ValueError(
            "update_fp8_meta: fp8_meta_grads must be the gradient of the loss with respect to "
            "fp8_meta (same tree); got a different structure"
        )
    found = []

    def walk(meta, grads):
        if _is_site(meta):
            found.append(True)
            return _update_site(meta, grads["scale"], recipe)
        if isinstance(meta, Mapping):
            return {k: walk(v, grads[k]) for k, v in meta.items()}
        raise ValueError(f"update_fp8_meta: unexpected leaf {type(meta).__name__} in fp8_meta")

    out = walk(fp8_meta, fp8_meta_grads)
    if not found:
        raise ValueError("update_fp8_meta: fp8_meta holds no fp8 site (amax_history, scale)")
    return out
