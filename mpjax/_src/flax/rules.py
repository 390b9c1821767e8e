"""Per-module policy rules: parsing selectors and resolving which policy a module gets.

A rule set maps selectors to policies. Selectors are
- a module class: matches instances of it and of its subclasses;
- a regex string: `re.fullmatch`-ed against the module's path relative to the module
  `apply_policy` was called on, as in its params tree, parts joined by "/" (e.g.
  `"encoder/layers_3/attn"`; the root's path is `""`); one that matches no module is an
  error (`check_path_rules`);
- `"*"`: the default, the policy of the root when it has no rule of its own.

Resolution for one module (most specific wins):
1. a path rule matching its path; two matching path rules are an error naming both;
2. else the class rule of the most derived class among its matching class rules (a
   rule on `nn.Dense` beats one on `nn.Module`); two matching classes neither of which
   subclasses the other are an error naming both;
3. else its parent's policy (a policy on a parent covers children without a rule);
4. else, for the root, the `"*"` rule; else the module is left untouched.
Then the `Defaults` lists adjust low-precision policies (see `defaults.py`).

A policy's `output_dtype` applies where values leave the module(s) its rule selects: the
root for a one-string policy or the `"*"` rule, every matching module for a class or path
rule. A module covered only through its parent returns the inherited policy's compute
dtype (so a one-string `output=float32` casts the model's outputs, not every layer's);
give a module its own rule to cast its outputs. `autocast` means the same by `output`.
`field_overrides` is how the linen and NNX integrations apply a resolved policy to a
module's own dtype-related fields during one call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax._src.core.policy import Policy, get_policy
from mpjax._src.core.reduce_dot import reduce_dot_general
from mpjax._src.core.text import excerpt
from mpjax._src.flax.defaults import Defaults
from mpjax._src.fp8.saved import fp8_saved_conv, fp8_saved_dot_general

__all__ = [
    "Resolved",
    "Rule",
    "Rules",
    "check_path_rules",
    "field_overrides",
    "parse_rules",
    "resolve",
]

DEFAULT_SELECTOR = "*"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One parsed rule: its selector as given, its kind and its policy."""

    selector: Any
    kind: str  # "path", "class" or "default"
    policy: Policy
    pattern: re.Pattern | None = None

    def describe(self) -> str:
        if self.kind == "class":
            return f"class rule {self.selector.__module__}.{self.selector.__qualname__}"
        if self.kind == "path":
            return f"path rule {excerpt(self.selector)}"
        return "default rule '*'"


@dataclasses.dataclass(frozen=True)
class Rules:
    """A parsed, validated rule set (immutable and hashable)."""

    path_rules: tuple[Rule, ...] = ()
    class_rules: tuple[Rule, ...] = ()
    default: Rule | None = None


def _base_names(module_base: tuple[type, ...]) -> str:
    return " or ".join(f"{b.__module__}.{b.__qualname__}" for b in module_base)


def _parse_policy(value: Any, selector: Any) -> Policy:
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        try:
            return get_policy(value)
        except ValueError as e:
            raise ValueError(f"invalid policy for selector {excerpt(selector)}: {e}") from e
    raise TypeError(
        f"the policy for selector {excerpt(selector)} must be a Policy or a spec string, "
        f"got {type(value).__name__}"
    )


def parse_rules(spec: Any, module_base: type | tuple[type, ...]) -> Rules:
    """Parses a policy, a spec string or a `{selector: policy}` mapping into `Rules`.

    Args:
      spec: a `Policy`, a spec string (both mean `{"*": spec}`), or a mapping from
        selectors (module class, path regex, `"*"`) to a `Policy` or spec string.
      module_base: the module base class(es) a class selector must subclass.

    Returns:
      The validated `Rules`.

    Raises:
      TypeError: a selector that is neither a string nor a module class, or a policy
        that is neither a `Policy` nor a string.
      ValueError: an invalid regex or an invalid policy spec, naming the selector.

    Example:
      >>> import flax.linen as nn
      >>> from mpjax.policy import parse_rules
      >>> r = parse_rules({nn.Dense: "bf16", "head": "f32", "*": "p=f32,c=bf16"}, nn.Module)
      >>> [rule.kind for rule in r.path_rules + r.class_rules]
      ['path', 'class']
    """
    if not isinstance(module_base, tuple):
        module_base = (module_base,)
    if isinstance(spec, (Policy, str)):
        spec = {DEFAULT_SELECTOR: spec}
    if not isinstance(spec, Mapping):
        raise TypeError(
            "a policy must be a Policy, a spec string or a {selector: policy} mapping, "
            f"got {type(spec).__name__}"
        )
    path_rules, class_rules, default = [], [], None
    for selector, value in spec.items():
        if isinstance(selector, str):
            policy = _parse_policy(value, selector)
            if selector == DEFAULT_SELECTOR:
                default = Rule(selector, "default", policy)
                continue
            try:
                pattern = re.compile(selector)
            except re.error as e:
                raise ValueError(
                    f"selector {excerpt(selector)} is not a valid regular expression: {e}"
                ) from e
            path_rules.append(Rule(selector, "path", policy, pattern))
        elif isinstance(selector, type):
            if not issubclass(selector, module_base):
                raise TypeError(
                    f"class selector {selector.__module__}.{selector.__qualname__} is not a "
                    f"subclass of {_base_names(module_base)}"
                )
            class_rules.append(Rule(selector, "class", _parse_policy(value, selector)))
        else:
            raise TypeError(
                f"selector {excerpt(selector)} must be a module class, a path regex string or "
                f"'*', got {type(selector).__name__}"
            )
    return Rules(tuple(path_rules), tuple(class_rules), default)


def _ambiguous(path: str, cls: type, a: Rule, b: Rule) -> ValueError:
    return ValueError(
        f"ambiguous policy for module {path or '<root>'!r} ({cls.__qualname__}): it matches "
        f"both {a.describe()} and {b.describe()}; make one of them more specific"
    )


def _most_derived(cls: type, path: str, hits: list[Rule]) -> Rule:
    """The class rule on the most derived class; unrelated classes are ambiguous."""
    best = min(hits, key=lambda r: cls.__mro__.index(r.selector))
    for other in hits:
        if not issubclass(best.selector, other.selector):
            raise _ambiguous(path, cls, best, other)
    return best


def match(rules: Rules, cls: type, path: str) -> Rule | None:
    """The module's own rule: its path rule, else its most specific class rule, else None.

    Raises:
      ValueError: two path rules match, or two class rules on unrelated classes match.
    """
    hits = [r for r in rules.path_rules if r.pattern.fullmatch(path)]
    if len(hits) > 1:
        raise _ambiguous(path, cls, hits[0], hits[1])
    if hits:
        return hits[0]
    classes = [r for r in rules.class_rules if issubclass(cls, r.selector)]
    return _most_derived(cls, path, classes) if classes else None


def check_path_rules(rules: Rules, paths: Any, model: str) -> None:
    """Raises if a path rule matches none of `paths` (a typo would otherwise do nothing).

    Only the user's path rules are checked: a class rule naming a class the model does
    not use is legitimate (one rule set for a family of models), and the `Defaults` lists
    are not rules.

    Args:
      rules: the parsed rules.
      paths: every module path of the model ("/"-joined, `""` for the root).
      model: the model's name, for the message.

    Raises:
      ValueError: naming the first rule that matches nothing and listing the paths.
    """
    paths = sorted(set(paths))
    for rule in rules.path_rules:
        if any(rule.pattern.fullmatch(p) for p in paths):
            continue
        shown = [p for p in paths if p][:40]
        more = f", ... ({len(paths) - 1} in all)" if len(paths) - 1 > len(shown) else ""
        close = difflib.get_close_matches(rule.selector, shown, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"apply_policy: path rule {excerpt(rule.selector)} matches no module of {model} (paths "
            "are relative to the wrapped model, as in its params tree, parts joined by '/', "
            f"matched with re.fullmatch); its module paths are: {', '.join(shown) or '(none)'}"
            f"{more}{hint}"
        )


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The policy one module runs under.

    Attributes:
      policy: the effective policy (after the default lists).
      inherited: the policy its children inherit (the rule's policy, before defaults).
      float32_softmax: whether its attention softmax is forced to float32.
      rule: the rule that selected the policy (own or an ancestor's).
      own_rule: whether `rule` matched this module itself.
    """

    policy: Policy
    inherited: Policy
    float32_softmax: bool
    rule: Rule
    own_rule: bool


def _narrow(dtype: np.dtype) -> bool:
    return np.dtype(dtype).itemsize < 4


def _listed(cls: type, listed: tuple[type, ...]) -> type | None:
    """The most derived class of `listed` that `cls` subclasses, or None."""
    hits = [c for c in listed if issubclass(cls, c)]
    if not hits:
        return None
    return min(hits, key=cls.__mro__.index)


def _user_overrides(rule: Rule, own_rule: bool, listed_cls: type) -> bool:
    if not own_rule:
        return False
    if rule.kind == "path":
        return True
    return rule.kind == "class" and issubclass(rule.selector, listed_cls)


def resolve(
    rules: Rules,
    defaults: Defaults,
    cls: type,
    path: str,
    parent: Resolved | None,
    is_root: bool,
) -> Resolved | None:
    """Resolves the policy of the module of class `cls` at `path`.

    Args:
      rules: the parsed rules.
      defaults: the default lists.
      cls: the module's class.
      path: its path relative to the policy root, parts joined by "/".
      parent: the parent's resolution (None for the root or an uncovered parent).
      is_root: whether this is the module `apply_policy` was called on.

    Returns:
      The `Resolved` policy, or None when no rule covers the module.
    """
    rule = match(rules, cls, path)
    own = rule is not None
    if own:
        base = rule.policy
    elif parent is not None:
        base, rule = parent.inherited, parent.rule
    elif is_root and rules.default is not None:
        base, rule = rules.default.policy, rules.default
    else:
        return None
    policy = base
    softmax = False
    if _narrow(base.compute_dtype):
        f32_cls = _listed(cls, defaults.float32_modules)
        if f32_cls is not None and not _user_overrides(rule, own, f32_cls):
            policy = dataclasses.replace(policy, compute_dtype=np.dtype(np.float32))
        sm_cls = _listed(cls, defaults.float32_softmax_modules)
        softmax = sm_cls is not None and not _user_overrides(rule, own, sm_cls)
    if not own and not is_root:
        # A policy's `output_dtype` is where values leave the module its rule selects (the
        # root for a one-string policy): a module that only inherits the policy returns
        # the inherited compute dtype, so the values between layers stay narrow.
        policy = dataclasses.replace(policy, output_dtype=base.compute_dtype)
    if is_root and defaults.final_output_dtype is not None:
        wide = jnp.promote_types(policy.output_dtype, defaults.final_output_dtype)
        if wide != policy.output_dtype:
            policy = dataclasses.replace(policy, output_dtype=wide)
    return Resolved(policy, base, softmax, rule, own)


def _is_compute_dtype_field(value: Any) -> bool:
    if value is None:
        return True
    try:
        return jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        return False


# Layers whose `dot_general(inputs, kernel, ...)` takes the kernel as its right operand.
_KERNEL_RHS_LAYERS = frozenset({"Dense", "DenseGeneral", "Linear", "LinearGeneral"})


def _reduces_kernel(module: Any) -> bool:
    names = {cls.__name__ for cls in type(module).__mro__}
    return (
        bool(names & _KERNEL_RHS_LAYERS)
        and getattr(module, "dot_general", 0) in (None, lax.dot_general)
        and getattr(module, "dot_general_cls", None) is None
    )


def _own_conv(module: Any) -> bool:
    """A `Conv` (linen or NNX) running `lax.conv_general_dilated` (no custom conv)."""
    names = {cls.__name__ for cls in type(module).__mro__}
    return (
        "Conv" in names
        and getattr(module, "conv_general_dilated", 0) in (None, lax.conv_general_dilated)
        and getattr(module, "conv_general_dilated_cls", None) is None
    )


def _dot_override(module: Any, reduce_dtype: Any, saved_dtype: Any) -> Any:
    """The `dot_general` a `Dense`-like module gets for `reduce_dtype` / `saved_dtype`."""
    if (reduce_dtype is None and saved_dtype is None) or not _reduces_kernel(module):
        return None
    dot = lax.dot_general
    if reduce_dtype is not None:
        dot = functools.partial(reduce_dot_general, reduce_dtype=reduce_dtype)
    if saved_dtype is not None:
        dot = functools.partial(fp8_saved_dot_general, saved_dtype=saved_dtype, inner=dot)
    return dot


@contextlib.contextmanager
def field_overrides(
    module,
    compute_dtype,
    float32_softmax,
    default_attention,
    f32_attention,
    reduce_dtype=None,
    saved_dtype=None,
):
    """Temporarily sets a module's dtype-related fields for one call, then restores them.

    - `dtype` (Flax's "dtype of the computation"), when it is None or a floating dtype,
      is set to `compute_dtype`, so built-in layers promote to it (NNX layers such as
      `Embed` fix it at construction; an explicit `dtype=` would otherwise win);
    - `attention_fn`, when `float32_softmax` and it is Flax's default, is replaced by
      the float32-softmax variant;
    - `dot_general`, when `reduce_dtype` is set and the module is a `Dense`/`DenseGeneral`
      (linen) or `Linear`/`LinearGeneral` (NNX) with no `dot_general` of its own, is
      `reduce_dot_general`: the kernel gradient leaves its GEMM in `reduce_dtype`;
      with `saved_dtype` (the policy's `saved_activations`), wrapped in
      `fp8_saved_dot_general`: the layer's input is kept for the backward pass in fp8;
    - `conv_general_dilated` of a `Conv` with none of its own, when `saved_dtype` is set:
      `fp8_saved_conv` (its input kept in fp8 for the backward pass).

    Args:
      module: the module (its fields are set with `object.__setattr__`, as Flax itself
        does for frozen linen modules); None for no overrides.
      compute_dtype: the module's compute dtype.
      float32_softmax: whether to swap the attention function.
      default_attention: the framework's default attention function.
      f32_attention: its float32-softmax replacement.
      reduce_dtype: the policy's `reduce_dtype` (None: no `dot_general` override).
      saved_dtype: the policy's `saved_activations` (None: activations saved as they are).
    """
    changes = []
    if module is not None:
        if hasattr(module, "dtype") and _is_compute_dtype_field(module.dtype):
            changes.append(("dtype", compute_dtype))
        if float32_softmax and getattr(module, "attention_fn", None) is default_attention:
            changes.append(("attention_fn", f32_attention))
        dot = _dot_override(module, reduce_dtype, saved_dtype)
        if dot is not None:
            changes.append(("dot_general", dot))
        if saved_dtype is not None and _own_conv(module):
            conv = functools.partial(fp8_saved_conv, saved_dtype=saved_dtype)
            changes.append(("conv_general_dilated", conv))
    saved = [(name, module.__dict__[name]) for name, _ in changes if name in module.__dict__]
    try:
        for name, value in changes:
            object.__setattr__(module, name, value)
        yield
    finally:
        for name, _ in changes:
            object.__delattr__(module, name)
        for name, value in saved:
            object.__setattr__(module, name, value)
