"""One `loss_scaled` step's pieces: gradient check, candidates, take or skip, next loss scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.core.dtypes import wide_dtype as _wide_dtype
from mpjax._src.kernels.unscale import all_finite_unscaled
from mpjax._src.scaling.loss_scale import all_finite, select_tree, unscale_tree
from mpjax._src.scaling.master import _is_masked, next_master, rounded, view
from mpjax._src.scaling.scopes import INNER_SCOPE

_MASKED = optax.MaskedNode


class _Candidate:
    """One floating param's step and new value (deliberately not a pytree: one leaf)."""

    floating = True

    def __init__(self, step: jax.Array, value: jax.Array):
        self.step, self.value = step, value


class _NotFloating:
    """The candidate of an int/bool param, which is never updated."""

    floating = False


def _checks_new_value(target: Any, check_new_values: bool | str) -> bool:
    if target is None:
        return False
    if check_new_values == "auto":
        return target.dtype == jnp.float16
    return bool(check_new_values)


class _StepConfig(NamedTuple):
    """What `loss_scaled` fixed at construction, as the step functions need it."""

    inner: optax.GradientTransformationExtraArgs
    check_new_values: bool | str
    axis_name: str | tuple[str, ...] | None


def _on_every_device(flag: jax.Array, axis_name) -> jax.Array:
    """`flag` AND-ed over the devices of `axis_name` (a `pmin`); a clear error where the axis
    is not bound (the update called under plain `jax.jit`, not inside `shard_map`/`pmap`)."""
    try:
        return jax.lax.pmin(flag.astype(jnp.int32), axis_name) > 0
    except NameError as e:
        raise NameError(
            f"loss_scaled: axis_name={axis_name!r} is not bound where update runs ({e}). "
            "Call update inside jax.shard_map / jax.pmap over that axis, or build loss_scaled "
            "without axis_name for a global step under jax.jit (sharded params, Explicit or "
            "Auto mesh axes): its finite check already sees every gradient."
        ) from e


def _check_grads(grads, scale, checks, lazy_unscale, unscale_and_check, impl, axis_name):
    """Check: (the gradients the step reads, whether they are all finite, a scalar bool).

    With `lazy_unscale` the gradients are only read here and unscaled inside `_take_step`;
    otherwise `unscale_and_check` returns them unscaled. `checks=False` checks nothing.
    """
    if not checks:
        return grads, jnp.array(True)
    if lazy_unscale:
        # "auto" is the grouped XLA reduction on every platform: it fuses the convert of
        # a float16 gradient, which the Pallas custom call cannot absorb.
        check_impl = "xla" if impl == "auto" else impl
        step_in, grads_finite = grads, all_finite_unscaled(grads, scale, impl=check_impl)
    else:
        step_in, grads_finite = unscale_and_check(grads, scale)
    grads_finite = jnp.asarray(grads_finite, jnp.bool_)
    if axis_name is not None:
        grads_finite = _on_every_device(grads_finite, axis_name)
    return step_in, grads_finite


def _candidate(p, m, v, u):
    """(step in the wide dtype, new wide value) of one floating leaf."""
    if not _is_floating(p):
        return _NotFloating()
    u = u.astype(v.dtype)
    if p.dtype == v.dtype and not _is_masked(m):
        # A float32 param with a float32 master: define the new master as the sum
        # the caller will form, p + d. That add has no multiply beside it, so XLA
        # cannot contract one side into an FMA and not the other.
        d = (v + u) - p
        return _Candidate(d, p + d)
    return _Candidate(u, v + u)


def _param_step(p, c, target):
    """The update that `optax.apply_updates` turns into exactly `target` from `p`."""
    u = c.step
    if p.dtype == u.dtype:
        return u  # p + u is the new value itself
    wide = u.dtype
    step = target.astype(wide) - p.astype(wide)
    # x + (-0.0) == x for every x, signed zeros included; +0.0 is not.
    same_sign = jnp.signbit(target.astype(wide)) == jnp.signbit(p.astype(wide))
    return jnp.where((step == 0) & same_sign, jnp.array(-0.0, wide), step)


def _new_values_ok(targets, config: _StepConfig):
    """Whether no checked param's new value overflows; None when no param is checked."""
    checked = [t for t in jax.tree.leaves(targets) if _checks_new_value(t, config.check_new_values)]
    if not checked:
        return None
    ok = all_finite(checked)
    if config.axis_name is not None:
        ok = _on_every_device(ok, config.axis_name)
    return ok


def _take_step(step_in, state, params, scale, unscale_in_step, extra_args, config: _StepConfig):
    """Take step (finite gradients): (updates, inner state, master, new values finite).

    The gradients are unscaled here when `unscale_in_step`, so the multiply fuses into the
    inner update's kernels instead of writing an unscaled copy of every gradient.
    """
    unscaled = unscale_tree(step_in, scale) if unscale_in_step else step_in
    view_ = view(params, state.master)
    inner_grads = jax.tree.map(lambda p, g: g if _is_floating(p) else _MASKED(), params, unscaled)
    with jax.named_scope(INNER_SCOPE):  # the wrapped optimizer's own ops (mpjax.report)
        inner_updates, new_inner = config.inner.update(
            inner_grads, state.inner_state, view_, **extra_args
        )
    # Mapped over the params' structure (None leaves, tuples and NamedTuples stay
    # nodes); a candidate is one opaque leaf per param.
    cands = jax.tree.map(_candidate, params, state.master, view_, inner_updates)
    targets = jax.tree.map(
        lambda p, m, c: rounded(p, m, c.value) if c.floating else None,
        params,
        state.master,
        cands,
    )
    # A step with finite gradients can still overflow a param near the top of its
    # range: it is then skipped too.
    checked_ok = _new_values_ok(targets, config)
    ok = jnp.array(True) if checked_ok is None else checked_ok
    new_master = jax.tree.map(
        lambda p, m, c: next_master(ok, m, c.value) if c.floating else m,
        params,
        state.master,
        cands,
    )
    updates = jax.tree.map(
        lambda p, c, t: (
            jnp.where(ok, _param_step(p, c, t), jnp.array(-0.0, c.step.dtype))
            if c.floating
            else jnp.zeros_like(p)
        ),
        params,
        cands,
        targets,
    )
    if checked_ok is not None:
        new_inner = select_tree(ok, new_inner, state.inner_state)
    return updates, new_inner, new_master, ok


def _skip_step(state, params):
    """Skip step: updates that leave every param bit-identical, and the state unchanged.

    Each update is typed like its param: its sharding (Explicit mesh axes) and the manual
    axes it varies over (in `jax.shard_map`) too, so it matches the taken step's update.
    """
    updates = jax.tree.map(
        lambda p: (
            jnp.full_like(p, -0.0, _wide_dtype(p.dtype)) if _is_floating(p) else jnp.zeros_like(p)
        ),
        params,
    )
    return updates, state.inner_state, state.master, jnp.array(False)


def _step_or_skip(grads_finite, step_in, take, skip, skip_impl):
    """Runs `take(step_in)` or `skip()` as `grads_finite` says, by `lax.cond` or a select."""

    def by_cond(x):
        return jax.lax.cond(grads_finite, take, lambda _: skip(), x)

    def by_select(x):
        return select_tree(grads_finite, take(x), skip())

    if skip_impl == "cond":
        return by_cond(step_in)
    if skip_impl == "select":
        return by_select(step_in)
    return jax.lax.platform_dependent(step_in, cpu=by_cond, default=by_select)


def _next_loss_scale(loss_scale, grads_finite, ok, values_checked):
    """The adjusted loss scale; unchanged after a step skipped on a new value's overflow.

    Such a step is not a good step (a dynamic scale does not count it towards growth), and
    the scale is not to blame (the unscaled update overflowed), so it does not back off.
    """
    adjusted = loss_scale.adjust(grads_finite)
    if not values_checked:
        return adjusted
    value_skip = jnp.logical_and(grads_finite, jnp.logical_not(ok))
    return select_tree(value_skip, loss_scale, adjusted)
