"""`loss_scaled`: an optax wrapper with FP32 master weights and loss scaling with skip steps."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpjax._src.core.dtypes import is_floating as _is_floating
from mpjax._src.kernels.unscale import xla_unscale_and_check
from mpjax._src.scaling.checks import _check_arguments, _check_grads_match, _check_param_dtypes
from mpjax._src.scaling.config import default_max_consecutive_skips
from mpjax._src.scaling.diagnostics import raise_in_step_if_diverged
from mpjax._src.scaling.loss_scale import LossScale, NoOpLossScale
from mpjax._src.scaling.loss_scaled_step import (
    _check_grads,
    _checks_new_value,
    _next_loss_scale,
    _skip_step,
    _step_or_skip,
    _StepConfig,
    _take_step,
)
from mpjax._src.scaling.master import init_master, view
from mpjax._src.scaling.master_check import check_master
from mpjax._src.scaling.nnx_nodes import loss_scaled_from_nnx
from mpjax._src.scaling.restored import old_state_message
from mpjax._src.scaling.scopes import LOSS_SCALING_SCOPE

__all__ = ["STATE_LAYOUT_VERSION", "LossScaledState", "loss_scaled", "xla_unscale_and_check"]

# The layout of `LossScaledState` (and the mpjax states inside it) a checkpoint holds: 0 is the
# unversioned layout of 6a474e7 and before (bare int16 remainders, int8 scales in flattened
# blocks), 1 adds this field, `Remainder` nodes and per-row int8 scales (256 long, or from
# the sharding at `init` as of 3d03840), 2 int8 blocks from the leaf's shape alone. Bump it
# with every change of the layout, and teach `mpjax.upgrade_state` to read the previous one.
STATE_LAYOUT_VERSION = 2


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    Attributes:
      inner_state: the inner transformation's state, built on the float32 view of the
        params (master weights where kept, params widened to float32 elsewhere).
      master: a tree shaped like the params holding the float32 master copy of each
        floating param that keeps one (with `master_weights="remainder"`, an int16
        remainder for each bfloat16 param), and `optax.MaskedNode()` elsewhere (so a
        model with float32 params pays no extra memory). `mpjax.master_params` reads it.
      loss_scale: the current `LossScale` (a pytree).
      grads_finite: scalar bool, whether the last step's gradients were all finite. A
        step with finite gradients can still be skipped (a new float16 value that would
        overflow, see `check_new_values`): read `skipped` for the step's decision.
      skipped_steps: scalar int32, how many steps were skipped in total.
      consecutive_skips: scalar int32, how many steps in a row were skipped last.
      layout_version: scalar int32, the layout of this state (`STATE_LAYOUT_VERSION` when
        made): a checkpoint of an older layout is read by `mpjax.upgrade_state`. None (the
        default) only in a state of mpjax 6a474e7 or older rebuilt today (unpickled), which
        mpjax's entry points refuse, naming `mpjax.upgrade_state`.
    """

    inner_state: Any
    master: Any
    loss_scale: LossScale
    grads_finite: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    layout_version: jax.Array | None = None

    @property
    def skipped(self) -> jax.Array:
        """Scalar bool: whether the last step was skipped, whatever the reason.

        Non-finite gradients, or finite ones whose new param value would overflow: the
        params, master and inner state were left bit-identical. `keep_if_skipped`,
        `restore_if_skipped` and `scaling_metrics` read this flag.
        """
        return self.consecutive_skips > 0


def _next_state(state, new_inner, new_master, grads_finite, ok, limit, values_checked):
    """Next state: counters, loss scale and the in-step divergence check."""
    finite = jnp.logical_and(grads_finite, ok)
    skipped = jnp.logical_not(finite).astype(jnp.int32)
    consecutive = jnp.where(finite, 0, state.consecutive_skips + 1).astype(jnp.int32)
    if limit is not None:
        floor = getattr(state.loss_scale, "min_scale", None)
        raise_in_step_if_diverged(consecutive, state.loss_scale.loss_scale, limit, floor)
    return LossScaledState(
        inner_state=new_inner,
        master=new_master,
        loss_scale=_next_loss_scale(state.loss_scale, grads_finite, ok, values_checked),
        grads_finite=grads_finite,
        skipped_steps=state.skipped_steps + skipped,
        consecutive_skips=consecutive,
        layout_version=state.layout_version,
    )


def _refuse_state(state: Any) -> None:
    """Raises for a state `update` cannot run on, naming `mpjax.upgrade_state` for an old or
    target-less restored one."""
    hint = old_state_message("loss_scaled", state)
    if isinstance(state, LossScaledState):
        raise ValueError(hint)
    msg = f"loss_scaled: state must be a LossScaledState, got {type(state).__name__}"
    if hint is None and isinstance(state, dict | list):
        hint = (
            "dicts and lists are what orbax and flax restore without a target: "
            "restore into a target (tx.init(params)), or through "
            "mpjax.upgrade_state(restored, tx.init(params)) (see docs/guides/migration.md)"
        )
    raise TypeError(msg if hint is None else f"{msg}; {hint.removeprefix('loss_scaled: ')}")


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | None = None,
    *,
    master_weights: bool | str = "auto",
    axis_name: str | tuple[str, ...] | None = None,
    unscale_and_check: Any = None,
    max_consecutive_skips: int | str | None = None,
    check_new_values: bool | str = "auto",
    skip_impl: str = "auto",
    impl: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` with loss scaling, FP32 master weights and finite-check skip steps.

    `update(grads, state, params, **extra)` takes gradients of the *scaled* loss (see
    `scale_loss`), unscales them to float32, decides finiteness over all gradients
    (combined across `axis_name` when given, so every device takes the same decision),
    and runs `inner` on float32 gradients and the float32 master weights. On a finite
    step the master is updated and `optax.apply_updates(params, updates)` yields the new
    master cast to each param's dtype. On a non-finite step the updates are zero and the
    inner state and master are left bit-identical. The loss scale is adjusted either way.

    With `NoOpLossScale()` nothing is scaled, checked or skipped (except a float16 param
    that would overflow, see `check_new_values`): for float32 params the compiled step is
    `inner`'s own, and `scale_loss`/`scaling_metrics` still work, so one train step
    serves fp32, bf16 and fp16 (`loss_scaled(inner, loss_scale_for(precision))`). Use
    `StaticLossScale(1.0)` to skip non-finite steps without scaling.

    Params may be any pytree optax accepts: dicts, lists, tuples, NamedTuples, custom
    nodes, and `None` leaves (e.g. an Equinox model filtered with `eqx.is_array`), which
    stay `None` in the updates. Non-floating leaves of the params (ints, bools) are not
    shown to `inner`; their updates are zeros of their own dtype, so they pass through
    untouched.

    `loss_scaled` must be the last transformation of a chain: the master weights follow
    its own step, so a transformation after it that changes the updates would make the
    params and master drift apart. Params changed outside the optimizer (clipped,
    projected, reloaded) need a new `init`: leaves with a master are reset to it.

    For gradient accumulation, put `optax.MultiSteps` inside:
    `loss_scaled(optax.MultiSteps(inner, k))` (accepted as is). Each micro-batch is then
    unscaled and checked before it is accumulated, so an overflowing micro-batch is
    dropped and training goes on. The other nesting, `MultiSteps(loss_scaled(inner), k)`,
    does not recover: optax resets its accumulator by multiplying with 0, and 0 * NaN
    stays NaN, so every later window would be skipped.

    Args:
      inner: the optax transformation to run on unscaled float32 gradients.
      loss_scale: a `LossScale`; None means `DynamicLossScale()`; `NoOpLossScale()` runs
        `inner` with no check (see above).
      master_weights: "auto" keeps a float32 master copy of each floating param stored
        below float32; True keeps one for every floating param; False keeps none (low
        precision params are then widened to float32 for each update and rounded back).
        "remainder" is "auto" with the master of each bfloat16 param kept as the low 16
        bits of the float32 master (an int16 remainder, 2 bytes instead of 4): the master
        rebuilt from the param and its remainder is bit-identical to "auto"'s. In both
        modes a bfloat16 param is its float32 master rounded to nearest, ties away from
        zero, so they train bit for bit alike (see `mpjax.master_params`).
      axis_name: a mapped axis name (pmap, shard_map) over which the finiteness decision
        is combined. The gradients themselves are not averaged here.
      unscale_and_check: a function `(grads, loss_scale) -> (unscaled, all_finite)`
        replacing the built-in check; None (the default) checks with
        `mpjax.pallas.all_finite_unscaled` (which only reads the gradients; see `impl`) and
        divides by the loss scale inside the inner update, where XLA fuses the multiply (and any
        convert) into the optimizer's own elementwise kernels.
      max_consecutive_skips: None (default) puts no dead-run check in the step: call
        `mpjax.raise_if_diverged(opt_state)` where the loop logs (a host-side read of
        one counter). An int N, or "auto" for `default_max_consecutive_skips(loss_scale)`
        (49 for the default `DynamicLossScale`; 25 for a static scale), makes the step
        that would be the N-th non-finite step in a row raise `TrainingDivergedError`
        from inside the compiled step, on every platform (it reaches Python as a
        `jax.errors.JaxRuntimeError`, a `RuntimeError`, naming the error and the loss
        scale). That raise is a host callback, which takes every call of the step off
        JAX's C++ dispatch path (a per-call cost that grows with the state's leaves), so
        it is opt-in.
      check_new_values: whether a step with finite gradients is also skipped when the new
        value of a param would overflow to inf. "auto" checks float16 params (max 65504,
        the one dtype a finite step overflows in practice); True checks every floating
        param (bf16/float32 overflow needs updates near 3e38; the check costs one more
        reduction per leaf); False checks none.
      skip_impl: how a skipped step keeps the state: "select" computes the step and
        selects old or new values (fuses into the update on GPU); "cond" runs the step
        under `lax.cond` (on XLA:CPU, selecting over donated buffers costs a copy of the
        optimizer state per step); "auto" uses "cond" on CPU and "select" elsewhere.
        The results are the same.
      impl: the finite check: "auto" (default) is "xla" on accelerators and, on XLA:CPU,
        unscales once before the step (`xla_unscale_and_check`: faster there than fusing
        the multiply into the update). "xla" checks with a few variadic max-`|g|` XLA
        reductions, one per group of same-sized leaves
        (`mpjax._src.kernels.grouped_check`), which XLA fuses with whatever produced the
        gradients (the convert of float16 gradients of float32 params is not
        materialised); "pallas" (CUDA only) and "interpret" use the multi-tensor Pallas
        kernel, which reads float32 gradients as fast but cannot absorb a convert before it
        (a float32 copy of each float16 gradient is written first). The decision is the
        same: any inf/NaN, or a finite g whose g / loss_scale overflows, skips the step.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a `LossScaledState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from mpjax import loss_scaled
      >>> tx = loss_scaled(optax.adam(1e-3))
      >>> params = {"w": jnp.ones((3,), jnp.bfloat16)}
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.ones((3,), jnp.bfloat16)}  # grads of scale_loss(loss, state)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
    """
    inner, loss_scale = _check_arguments(
        inner,
        loss_scale,
        master_weights=master_weights,
        axis_name=axis_name,
        unscale_and_check=unscale_and_check,
        max_consecutive_skips=max_consecutive_skips,
        check_new_values=check_new_values,
        skip_impl=skip_impl,
        impl=impl,
    )
    lazy_unscale = unscale_and_check is None

    def init_fn(params):
        _check_param_dtypes(params)
        master = jax.tree.map(lambda p: init_master(p, master_weights), params)
        return LossScaledState(
            inner_state=inner.init(view(params, master)),
            master=master,
            loss_scale=loss_scale,
            grads_finite=jnp.array(True),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            layout_version=jnp.asarray(STATE_LAYOUT_VERSION, jnp.int32),
        )

    def update_fn(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "loss_scaled: update needs params (it keeps master weights and returns "
                "updates that land exactly on them); call tx.update(grads, state, params)"
            )
        if not isinstance(state, LossScaledState) or state.layout_version is None:
            _refuse_state(state)
        # Under nnx.Optimizer, the nodes of the last update come back as nnx.States.
        state = loss_scaled_from_nnx(state)
        grads = _check_grads_match(grads, params)
        check_master(params, state.master, master_weights, "loss_scaled")
        if unscale_and_check is not None or impl != "auto":
            return _update(grads, state, params, extra_args, lazy_unscale, unscale_and_check)
        # "auto": on XLA:CPU, unscaling once before the step is cheaper than fusing the
        # multiply into it (the suite's step-overhead table: 1.23x vs 1.44x the bare step's
        # time); elsewhere the check only reads the gradients and the unscale fuses into
        # the inner update (the suite's opt-step table: full fp16 step 1.036x bare bytes).
        return jax.lax.platform_dependent(
            grads,
            state,
            params,
            cpu=lambda g, s, p: _update(g, s, p, extra_args, False, xla_unscale_and_check),
            default=lambda g, s, p: _update(g, s, p, extra_args, True, None),
        )

    config = _StepConfig(inner, check_new_values, axis_name)

    def _update(grads, state, params, extra_args, lazy_unscale, unscale_and_check):
        """One step; `lazy_unscale`: check only, and unscale inside the inner update."""
        # NoOpLossScale neither scales nor checks: the step is the inner step (no extra
        # bytes). Decided by the state's scale, which `with_loss_scale` may have replaced.
        checks = not isinstance(state.loss_scale, NoOpLossScale)
        limit = max_consecutive_skips
        if limit == "auto":
            limit = default_max_consecutive_skips(state.loss_scale) if checks else None
        scale = state.loss_scale.loss_scale
        step_in, grads_finite = _check_grads(
            grads, scale, checks, lazy_unscale, unscale_and_check, impl, axis_name
        )
        take = functools.partial(
            _take_step,
            state=state,
            params=params,
            scale=scale,
            unscale_in_step=checks and lazy_unscale,
            extra_args=extra_args,
            config=config,
        )
        floating = [p for p in jax.tree.leaves(params) if _is_floating(p)]
        values_checked = any(_checks_new_value(p, check_new_values) for p in floating)
        if not checks:  # nothing to skip on (a float16 overflow check may still skip)
            updates, new_inner, new_master, ok = take(step_in)
            if not values_checked:
                # Nothing can skip: the counters are forwarded, not recomputed, so the
                # step is exactly the inner step.
                return updates, state._replace(inner_state=new_inner, master=new_master)
        else:
            skip = functools.partial(_skip_step, state, params)
            updates, new_inner, new_master, ok = _step_or_skip(
                grads_finite, step_in, take, skip, skip_impl
            )
        new_state = _next_state(
            state, new_inner, new_master, grads_finite, ok, limit, values_checked
        )
        return updates, new_state

    # Named so that `mpjax.report` shows these ops as one row, not as `cond/branch_0_fun/...`.
    update = jax.named_scope(LOSS_SCALING_SCOPE)(update_fn)
    return optax.GradientTransformationExtraArgs(init_fn, update)
