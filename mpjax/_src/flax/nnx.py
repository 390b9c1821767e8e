"""Per-module precision policies for Flax NNX modules.

`apply_nnx_policy(model, policy)` resolves a policy for every module of the object
graph, casts each `nnx.Param` to its module's `param_dtype`, and gives each covered
module a policy-aware class: a subclass of its own class (same name, `isinstance`
still holds) whose public methods, when called from outside the module,

- cast floating inputs to the module's compute dtype and floating outputs to its
  output dtype (the inherited compute dtype for a module without its own rule; see
  `mpjax._src.flax.rules`), and set a `dtype` attribute (Flax's computation dtype; NNX layers such
  as `Embed` fix it at construction) to the compute dtype for the call;
- on the outermost policy-aware call (e.g. `model(x)` in a train step) cast every
  `nnx.Param` of the called subtree to its owning module's compute dtype once, run,
  and restore the original values afterwards, so a parameter used twice (tied
  embeddings) is cast once per step and gradients reach the stored parameters
  (parameters are therefore not meant to be assigned inside a call; optimizers
  update them between calls);
- for attention modules in `Defaults.float32_softmax_modules` that use Flax's default
  `attention_fn`, run cuDNN's fused attention on CUDA where it applies (softmax in float32
  inside the kernel; `mpjax._src.flax.fused_attention`), else `float32_softmax_attention`
  (softmax in float32);
- a module whose own code hands an op that takes only float32 (an FFT) its
  low-precision inputs is run again in float32, as in the linen integration (the
  failed attempt's writes to its variables undone; `module_policies` shows the
  rules' policies, not this call-time change).

The resolved policy is stored as a static attribute `_mpjax_policy`, so `nnx.split`,
`nnx.jit`, `nnx.grad` and `nnx.Optimizer` carry it; the `nnx.state` (and so any
checkpoint) is unchanged apart from parameter dtypes. Container modules (`nnx.List`,
`nnx.Dict`) pass their policy on to their elements but are not wrapped themselves.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from flax import nnx
from mpjax._src.core.policy import Policy, is_floating_array
from mpjax._src.flax.defaults import DEFAULTS, Defaults
from mpjax._src.flax.float32_only import (
    Float32OnlyOpError,
    final_float32_only_error,
    is_narrow,
    may_call_float32_only_ops,
    naming_float32_only_ops,
)
from mpjax._src.flax.fp8_linen import DelayedFp8
from mpjax._src.flax.fp8_nnx import (
    has_delayed_fp8,
    nnx_delayed_override,
    plan_nnx_fp8,
    set_nnx_fp8,
)
from mpjax._src.flax.fused_attention import fused_or
from mpjax._src.flax.loops import current_trace, keep_carry_dtype
from mpjax._src.flax.nnx_attention import float32_softmax_attention
from mpjax._src.flax.nnx_snapshot import NnxSnapshot
from mpjax._src.flax.rules import check_path_rules, field_overrides, parse_rules, resolve

__all__ = ["apply_nnx_policy", "float32_softmax_attention", "module_policies"]

# Modules whose policy-aware calls are in progress on this thread (innermost last). The
# outermost call casts parameters; calls from a module to itself are not re-cast.
_CALL_STACK: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "mpjax_nnx_policy_calls", default=()
)

# Set only by `_policy_method` while it re-runs a module in float32: (the rule whose
# modules inside that call compute in float32, the module; see `_effective`).
_FLOAT32_RULE: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "mpjax_nnx_float32_rule", default=None
)
# Set by the outermost policy-aware call: id(variable) -> its stored value, for re-views.
_ORIGINALS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "mpjax_nnx_stored_values", default=None
)
# The JAX trace the innermost policy-aware call runs in (see `_policy_call`).
_CALL_TRACE: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "mpjax_nnx_policy_trace", default=None
)
_CONTAINERS = (nnx.List, nnx.Dict)
_ATTR = "_mpjax_policy"


@dataclasses.dataclass(frozen=True)
class _ModulePolicy:
    """The static per-module record: its effective policy and where it came from."""

    policy: Policy
    float32_softmax: bool
    path: str
    rule: str


def _cast(tree: Any, dtype: Any) -> Any:
    """Casts floating array leaves; NNX objects and Variables in `tree` are left alone."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        if is_floating_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree, is_leaf=lambda x: isinstance(x, (nnx.Pytree, nnx.Variable)))


def _is_module_node(node: Any) -> bool:
    return isinstance(node, nnx.Module)


def _owner(path: tuple, module_paths: set) -> tuple | None:
    for k in range(len(path) - 1, -1, -1):
        if path[:k] in module_paths:
            return path[:k]
    return None


def _params_by_owner(root: nnx.Module, kind: type = nnx.Param):
    """Yields `(variable, owner_module)` for every `kind` variable under `root`, each once."""
    nodes = list(nnx.iter_graph(root))
    modules = {
        path: node
        for path, node in nodes
        if _is_module_node(node) and not isinstance(node, _CONTAINERS)
    }
    module_paths = set(modules)
    for path, node in nodes:
        if isinstance(node, kind):
            owner = _owner(path, module_paths)
            if owner is not None:
                yield node, modules[owner]


def _policy_of(module: Any) -> _ModulePolicy | None:
    return vars(module).get(_ATTR)


def _swap_raw(param: nnx.Variable, value: Any) -> None:
    """Sets a Variable's raw value without NNX's trace-level check.

    Only used for the temporary compute-dtype view of a parameter, which is restored
    before the call returns; skipping the check lets a policy-aware model also be
    traced when closed over (e.g. `jax.jit(lambda x: model(x))`), where reading it is
    legal and a permanent write would not be.
    """
    object.__setattr__(param, "_raw_value", value)


def _policy_method(self, fn, args, kwargs):
    info = _policy_of(self)
    stack = _CALL_STACK.get()
    if info is None or (stack and stack[-1] is self):
        return fn(self, *args, **kwargs)
    info = _effective(info, self)
    if not (is_narrow(info.policy.compute_dtype) and may_call_float32_only_ops(self)):
        return _policy_call(self, fn, args, kwargs, info, stack)
    snapshot = NnxSnapshot(self)
    try:
        return _policy_call(self, fn, args, kwargs, info, stack)
    except Float32OnlyOpError as e:
        if not e.retryable:
            raise
        error = e
    # The module calls a float32-only op (an FFT): undo the attempt, run it in float32.
    snapshot.restore()
    token = _FLOAT32_RULE.set((info.rule, self))
    try:
        if stack:
            _float32_views(self, nnx.Param)
            _float32_views(self, nnx.Cache)
        return _policy_call(self, fn, args, kwargs, _effective(info, self), stack)
    except Float32OnlyOpError as e:
        raise final_float32_only_error(error) from e
    finally:
        _FLOAT32_RULE.reset(token)


def _effective(info: _ModulePolicy, module: Any = None) -> _ModulePolicy:
    """`info` of `module`, computing in float32 inside a float32 retry under its rule.

    The retried module keeps its output dtype; modules inheriting the same rule inside
    it run as under the rule `{cls: "float32"}`: float32 in and out.
    """
    retry = _FLOAT32_RULE.get()
    if retry is None or info.rule != retry[0]:
        return info
    f32 = jnp.dtype(jnp.float32)
    output = info.policy.output_dtype if module is retry[1] else f32
    policy = dataclasses.replace(info.policy, compute_dtype=f32, output_dtype=output)
    return dataclasses.replace(info, policy=policy, float32_softmax=False)


def _float32_views(root: nnx.Module, kind: type) -> None:
    """Re-views the `kind` variables under `root` from their stored values, in float32."""
    originals = _ORIGINALS.get() or {}
    for var, owner in _params_by_owner(root, kind):
        owner_info = _policy_of(owner)
        raw = originals.get(id(var))
        if owner_info is not None and raw is not None:
            _swap_raw(var, _cast(raw, _effective(owner_info).policy.compute_dtype))


def _policy_call(self, fn, args, kwargs, info: _ModulePolicy, stack: tuple):
    """One external call of a policy-aware module under its effective policy `info`."""
    restore, caches, originals = [], [], None
    if not stack:
        restore = _compute_views(self, nnx.Param)
        caches = _compute_views(self, nnx.Cache)
        originals = _ORIGINALS.set({id(v): raw for v, raw, _ in restore + caches})
    overrides = field_overrides(
        self,
        info.policy.compute_dtype,
        info.float32_softmax,
        nnx.dot_product_attention,
        functools.partial(fused_or, float32_softmax_attention),
        info.policy.reduce_dtype,
        # delayed fp8 replaces the module's GEMM: its own residuals apply.
        None if has_delayed_fp8(self) else info.policy.saved_activations,
    )
    fp8 = nnx_delayed_override(self) if fn.__name__ == "__call__" else contextlib.nullcontext()
    # Called from another module's call, inside a JAX transform that module started (the
    # body of `nnx.scan`, `nnx.fori_loop`, `nnx.remat`, ...): what mirrors its first
    # argument leaves in that argument's dtype, so a loop carry keeps its dtype.
    trace = current_trace()
    carry = args[0] if stack and args and _CALL_TRACE.get() != trace else None
    token = _CALL_STACK.set(stack + (self,))
    trace_token = _CALL_TRACE.set(trace)
    try:
        where = type(self).__name__
        with overrides, fp8, naming_float32_only_ops(self, where, info.policy.compute_dtype):
            args, kwargs = _cast((args, kwargs), info.policy.compute_dtype)
            out = fn(self, *args, **kwargs)
    finally:
        _CALL_TRACE.reset(trace_token)
        _CALL_STACK.reset(token)
        if originals is not None:
            _ORIGINALS.reset(originals)
        for param, raw, _ in reversed(restore):
            _swap_raw(param, raw)
        for cache, raw, view in reversed(caches):
            _store_cache(cache, raw, view)
    out = _cast(out, info.policy.output_dtype)
    return out if carry is None else keep_carry_dtype(carry, out)


def _compute_views(root: nnx.Module, kind: type) -> list:
    """Gives each floating `kind` variable under `root` a compute-dtype view for a call.

    Returns `(variable, raw, view)` for each variable changed, to restore after the call:
    parameters run in their module's compute dtype, and so does a decoding cache made
    by Flax's `init_cache` (float32 by default), so the keys written into it match.
    """
    views = []
    for var, owner in _params_by_owner(root, kind):
        owner_info = _policy_of(owner)
        if owner_info is None:
            continue
        raw = var.get_raw_value()
        view = _cast(raw, _effective(owner_info).policy.compute_dtype)
        if view is not raw:
            views.append((var, raw, view))
            _swap_raw(var, view)
    return views


def _store_cache(cache: nnx.Variable, raw: Any, view: Any) -> None:
    """Keeps a cache in the dtype it was made in: the call's new value, cast back."""
    current = cache.get_raw_value()
    _swap_raw(cache, raw if current is view else _cast(current, raw.dtype))


def _wrap(fn):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        return _policy_method(self, fn, args, kwargs)

    return method


def _method_names(cls: type) -> list[str]:
    """`__call__` and the public methods `cls` defines below `nnx.Module`."""
    base = set(dir(nnx.Module))
    names = []
    for klass in cls.__mro__:
        if klass is nnx.Module or not issubclass(klass, nnx.Module):
            continue
        for name, attr in vars(klass).items():
            public = name == "__call__" or not name.startswith("_")
            if public and inspect.isfunction(attr) and name not in names:
                if name == "__call__" or name not in base:
                    names.append(name)
    return names


@functools.cache
def _policy_class(cls: type) -> type:
    """The policy-aware subclass of `cls`, created once per class.

    Cached because JAX pytree registration of a class is global and happens once.
    """
    namespace = {name: _wrap(getattr(cls, name)) for name in _method_names(cls)}
    namespace.update(
        __module__=cls.__module__,
        __qualname__=cls.__qualname__,
        __doc__=cls.__doc__,
        _mpjax_base=cls,
    )
    return type(cls)(cls.__name__, (cls,), namespace, pytree=cls._pytree__is_pytree)


def _base_class(cls: type) -> type:
    return cls.__dict__.get("_mpjax_base", cls)


def apply_nnx_policy(
    model: nnx.Module,
    policy: Any,
    *,
    defaults: Defaults = DEFAULTS,
    fp8: DelayedFp8 | None = None,
):
    """Applies per-module precision policies to an NNX model, in place.

    Re-applying replaces the previous policies; modules no rule covers get their
    original class back (and lose any fp8 state).

    Args:
      model: an `nnx.Module`; modified in place.
      policy: a `Policy`, a spec string, or a `{selector: policy}` mapping (see
        `mpjax._src.flax.rules`); paths are attribute paths joined by "/" (list
        elements by index, e.g. `"blocks/0/attn"`).
      defaults: the default lists (`mpjax.DEFAULTS`; `mpjax.NO_DEFAULTS` for none).
      fp8: delayed fp8 scaling of the covered `nnx.Linear` / `nnx.LinearGeneral` GEMMs
        (see `mpjax._src.flax.fp8_nnx`), or None.

    Returns:
      `model`.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from mpjax._src.flax.nnx import apply_nnx_policy
      >>> model = apply_nnx_policy(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), "p=f32,c=bf16")
      >>> model(jnp.ones((1, 2))).dtype  # matmul in bfloat16, logits leave in float32
      dtype('float32')
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"expected a flax.nnx.Module, got {type(model).__name__}")
    if not isinstance(defaults, Defaults):
        raise TypeError(f"defaults must be a mpjax Defaults, got {type(defaults).__name__}")
    rules = parse_rules(policy, nnx.Module)
    modules = [(p, n) for p, n in nnx.iter_graph(model) if _is_module_node(n)]
    modules.sort(key=lambda item: len(item[0]))
    module_paths = {path for path, _ in modules}
    root_name = _base_class(type(model)).__name__
    resolved, plans = {}, []
    for path, module in modules:  # resolve and validate everything before changing anything
        base = _base_class(type(module))
        owner = _owner(path, module_paths)
        parent = resolved.get(owner) if owner is not None else None
        text = "/".join(str(part) for part in path)
        res = resolve(rules, defaults, base, text, parent, is_root=path == ())
        resolved[path] = res
        site = plan_nnx_fp8(module, f"{root_name}/{text}", fp8 if res is not None else None)
        plans.append((module, base, text, res, site))
    check_path_rules(rules, [text for _, _, text, _, _ in plans], root_name)
    for module, base, text, res, site in plans:
        set_nnx_fp8(module, site)
        if res is None or isinstance(module, _CONTAINERS):
            object.__setattr__(module, "__class__", base)
            if _ATTR in vars(module):
                setattr(module, _ATTR, None)
            continue
        info = _ModulePolicy(res.policy, res.float32_softmax, text, res.rule.describe())
        object.__setattr__(module, "__class__", _policy_class(base))
        setattr(module, _ATTR, info)
    for param, owner in _params_by_owner(model):
        info = _policy_of(owner)
        if info is None:
            continue
        raw = param.get_raw_value()
        cast = _cast(raw, info.policy.param_dtype)
        if cast is not raw:
            param.set_raw_value(cast)
    return model


def module_policies(model: nnx.Module) -> dict[str, Policy]:
    """The effective policy of every policy-aware module of `model`, by path.

    Args:
      model: a model `apply_nnx_policy` was applied to.

    Returns:
      A dict from each wrapped module's path to its `Policy` (`""` is the root).
    """
    out = {}
    for _, node in nnx.iter_graph(model):
        info = _policy_of(node) if _is_module_node(node) else None
        if info is not None:
            out[info.path] = info.policy
    return out
