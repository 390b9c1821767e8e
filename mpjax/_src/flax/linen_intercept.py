"""`PolicyModule` and its method interceptor: the per-call policy of every covered linen module.

What a covered module's call does under its policy is described in `mpjax._src.flax.linen`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

import flax.linen as nn
from flax.linen.module import TestScope
from mpjax._src.autocast.activation_residuals import keep_activation_inputs
from mpjax._src.core.policy import cast_floating
from mpjax._src.flax.defaults import DEFAULTS, Defaults
from mpjax._src.flax.float32_only import (
    Float32OnlyOpError,
    LinenScopeSnapshot,
    final_float32_only_error,
    is_narrow,
    may_call_float32_only_ops,
    naming_float32_only_ops,
)
from mpjax._src.flax.fp8_linen import DelayedFp8, delayed_fp8_override
from mpjax._src.flax.fused_attention import fused_or
from mpjax._src.flax.linen_attention import float32_softmax_attention
from mpjax._src.flax.linen_scope import _changed, _own_cast, rewind, scope_path, variable_paths
from mpjax._src.flax.loops import in_lifted_loop, keep_carry_dtype
from mpjax._src.flax.rules import (
    Resolved,
    Rules,
    check_path_rules,
    field_overrides,
    resolve,
)

# Set only by `linen_module_policies`: a dict the interceptor records resolutions into.
_RECORDER: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "mpjax_linen_policy_recorder", default=None
)


class _Interceptor:
    """The method interceptor of one `PolicyModule` call: per-call state only."""

    def __init__(
        self, rules: Rules, defaults: Defaults, root: nn.Module, fp8: DelayedFp8 | None = None
    ):
        self.rules = rules
        self.fp8 = fp8
        self.defaults = defaults
        self.root = root
        self.root_path = scope_path(root.scope, {})
        # scope.path as Flax recorded it -> the path in the variable tree (see `scope_path`)
        self.true_paths: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.resolved: dict[tuple[type, tuple[str, ...]], Resolved | None] = {}
        self.by_path: dict[tuple[str, ...], Resolved | None] = {}
        self.cast_done: dict[int, tuple] = {}  # id(scope variables) -> (it, uncast params)
        self.stack: list[nn.Module] = []

    def rel_path(self, module: nn.Module) -> tuple[str, ...] | None:
        path = scope_path(module.scope, self.true_paths)
        n = len(self.root_path)
        return path[n:] if path[:n] == self.root_path else None

    def resolve(self, module: nn.Module) -> Resolved | None:
        path = self.rel_path(module)
        key = (type(module), path)
        if key in self.resolved:
            return self.resolved[key]
        is_root = module is self.root
        parent = None
        if not is_root:
            up = module.parent
            if (
                isinstance(up, nn.Module)
                and up.scope is not None
                and not isinstance(up, PolicyModule)
                and self.rel_path(up) is not None
            ):
                parent = self.resolve(up)
            elif path in self.by_path:
                # A clone made by a lifted transform (nn.vmap, nn.scan, nn.remat, ...) is
                # parented by a bare Scope at the path of the lifted module that made it: it
                # is that module, in the variable tree and for the rules (a lifted root too).
                res = self.by_path[path]
                self.resolved[key] = res
                return res
            elif not path:
                # The clone a lifted root (`nn.vmap(Net, ...)`) runs its code in; the
                # lifted root's own call is not intercepted.
                is_root = True
            else:
                # Otherwise take the nearest ancestor resolved so far in this call.
                for k in range(len(path) - 1, -1, -1):
                    if path[:k] in self.by_path:
                        parent = self.by_path[path[:k]]
                        break
        text = "/".join(path)
        res = resolve(self.rules, self.defaults, type(module), text, parent, is_root)
        self.resolved[key] = res
        self.by_path[path] = res
        recorder = _RECORDER.get()
        if recorder is not None and res is not None:
            recorder[text] = res.policy
        return res

    def cast_params_to_compute(self, module: nn.Module, res: Resolved) -> None:
        """Gives the module's scope a view of its own params cast to the compute dtype.

        Flax has no public hook for this, so it replaces the scope's `params` entry
        (`Scope._variables`, a per-scope dict that rewound copies of the scope share,
        which is what makes the cast once per apply). Only done when `params` is
        immutable, so nothing cast is ever written back; Flax is pinned below 0.13 and
        the dtype tests fail if this stops working.
        """
        scope = module.scope
        if scope.is_mutable_collection("params"):
            return
        variables = scope._variables  # the scope's own dict; shared by its rewound copies
        if id(variables) in self.cast_done:
            return
        collection = scope._collection("params")
        cast = _own_cast(collection, res.policy.compute_dtype)
        # (the dict, kept alive; the params it held before the cast, or None)
        self.cast_done[id(variables)] = (variables, collection if cast is not None else None)
        if cast is not None:
            variables["params"] = cast

    def cast_params_to_param_dtype(self, module: nn.Module, res: Resolved) -> None:
        scope = module.scope
        if not scope.is_mutable_collection("params"):
            return
        collection = scope._collection("params")
        for name, value in list(collection.items()):
            if isinstance(value, Mapping):
                continue
            cast = cast_floating(value, res.policy.param_dtype)
            if _changed(cast, value):
                scope.put_variable("params", name, cast)

    def __call__(self, next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, PolicyModule):
            raise ValueError(
                "apply_policy: a policy-wrapped module cannot be called inside another "
                "policy-wrapped module; pass one rule mapping to the outer apply_policy"
            )
        scope = module.scope
        if scope is None or isinstance(scope.root, TestScope) or self.rel_path(module) is None:
            return next_fun(*args, **kwargs)
        res = self.resolve(module)
        if res is None:
            self.stack.append(module)
            try:
                return next_fun(*args, **kwargs)
            finally:
                self.stack.pop()
        setup = context.method_name == "setup"
        external = not setup and not (self.stack and self.stack[-1] is module)
        retry = external and is_narrow(res.policy.compute_dtype)
        if not (retry and may_call_float32_only_ops(module)):
            return self.run(module, res, external, next_fun, args, kwargs, context)
        snapshot = LinenScopeSnapshot(scope)
        try:
            return self.run(module, res, external, next_fun, args, kwargs, context)
        except Float32OnlyOpError as e:
            if not e.retryable:
                raise
            error = e
        # The module calls a float32-only op (an FFT): undo the attempt, run it in float32.
        snapshot.restore()
        rewind(module)
        self.uncast_params(module)
        res = self.float32_resolution(module, res)
        try:
            return self.run(module, res, external, next_fun, args, kwargs, context)
        except Float32OnlyOpError as e:
            raise final_float32_only_error(error) from e

    def run(self, module, res, external, next_fun, args, kwargs, context):
        """One intercepted call of `module` under its resolved policy `res`."""
        if context.method_name == "setup" or external:
            self.cast_params_to_compute(module, res)
        carry = args[0] if external and args and in_lifted_loop(module) else None
        if external:
            args, kwargs = cast_floating((args, kwargs), res.policy.compute_dtype)
        overrides = field_overrides(
            module if external else None,
            res.policy.compute_dtype,
            res.float32_softmax,
            nn.dot_product_attention,
            functools.partial(fused_or, float32_softmax_attention),
            res.policy.reduce_dtype,
            # delayed fp8 (`fp8=`) replaces the Dense GEMMs: their own residuals apply.
            res.policy.saved_activations if self.fp8 is None else None,
        )
        fp8 = self.fp8 if context.method_name == "__call__" else None
        fp8_name = f"{type(self.root).__name__}/{'/'.join(self.rel_path(module))}"
        self.stack.append(module)
        try:
            with (
                overrides,
                delayed_fp8_override(module, fp8_name, fp8),
                naming_float32_only_ops(module, fp8_name, res.policy.compute_dtype),
            ):
                out = next_fun(*args, **kwargs)
        finally:
            self.stack.pop()
        self.cast_params_to_param_dtype(module, res)
        if external:
            out = cast_floating(out, res.policy.output_dtype)
        if carry is not None:
            out = keep_carry_dtype(carry, out)
        return out

    def uncast_params(self, module: nn.Module) -> None:
        """Puts back the module's own params that `cast_params_to_compute` replaced."""
        entry = self.cast_done.pop(id(module.scope._variables), None)
        if entry is not None and entry[1] is not None:
            entry[0]["params"] = entry[1]

    def float32_resolution(self, module: nn.Module, res: Resolved) -> Resolved:
        """`res` computing in float32 from now on, for the module and its children.

        As the rule `{type(module): "float32"}` would, except that the module's outputs
        keep `res`'s output dtype. Resolutions of its children made by the failed call
        are dropped, so they inherit float32.
        """
        f32 = np.dtype(np.float32)
        new = dataclasses.replace(
            res,
            policy=dataclasses.replace(res.policy, compute_dtype=f32),
            inherited=dataclasses.replace(res.inherited, compute_dtype=f32, output_dtype=f32),
            float32_softmax=False,
        )
        path = self.rel_path(module)
        n = len(path)
        for key in [k for k in self.resolved if len(k[1]) > n and k[1][:n] == path]:
            del self.resolved[key]
            self.by_path.pop(key[1], None)
        self.resolved[(type(module), path)] = new
        self.by_path[path] = new
        recorder = _RECORDER.get()
        if recorder is not None:
            recorder["/".join(path)] = new.policy
        return new


def _unbound(method: Any) -> Any:
    if callable(method) and hasattr(method, "__self__") and isinstance(method.__self__, nn.Module):
        return method.__func__
    return method


class PolicyModule(nn.Module):
    """A linen module run under per-module precision policies (see `apply_linen_policy`).

    Shares its scope with `module`, so its variables are exactly `module`'s. `init`,
    `init_with_output` and `apply` accept `method=` naming a method of `module` (a
    string, or a function taking `module` as first argument).

    Attributes:
      module: the wrapped module.
      rules: the parsed rules (see `mpjax._src.flax.rules.parse_rules`).
      defaults: the default lists (see `mpjax._src.flax.defaults.Defaults`).
      fp8: delayed fp8 scaling of its `Dense`/`DenseGeneral` GEMMs, or None.
    """

    module: nn.Module
    rules: Rules
    defaults: Defaults = DEFAULTS
    fp8: DelayedFp8 | None = None

    def setup(self):
        nn.share_scope(self, self.module)

    def __call__(self, *args, **kwargs):
        return self.policy_call(None, args, kwargs)

    def policy_call(self, method: Any, args: tuple, kwargs: dict) -> Any:
        """Calls `method` of the wrapped module under the policy.

        `method` is None (`__call__`), a method name, or a function taking the module.
        """
        inner = self.module
        interceptor = _Interceptor(self.rules, self.defaults, inner, self.fp8)
        with nn.intercept_methods(interceptor):
            if method is None:
                out = inner(*args, **kwargs)
            elif isinstance(method, str):
                out = getattr(inner, method)(*args, **kwargs)
            else:
                out = _unbound(method)(inner, *args, **kwargs)
        if self.rules.path_rules:
            ran = {"/".join(path) for path in interceptor.by_path}
            check_path_rules(self.rules, ran | variable_paths(self.variables), type(inner).__name__)
        return out

    @staticmethod
    def _outer_method(method: Any) -> Any:
        if method is None:
            return None
        return lambda self, *args, **kwargs: self.policy_call(method, args, kwargs)

    def init_with_output(self, rngs, *args, method=None, **kwargs):
        """`nn.Module.init_with_output`; `method` names a method of the wrapped module."""
        return super().init_with_output(rngs, *args, method=self._outer_method(method), **kwargs)

    def apply(self, variables, *args, method=None, **kwargs):
        """`nn.Module.apply`; `method` names a method of the wrapped module.

        Under a transformation, activation chains only a GEMM reads (gelu, SwiGLU) keep only
        their inputs for the backward pass (`keep_activation_inputs`).
        """
        apply = functools.partial(nn.Module.apply, self, method=self._outer_method(method))
        return keep_activation_inputs(apply)(variables, *args, **kwargs)
