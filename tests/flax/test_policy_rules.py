"""Rule parsing and resolution for per-module policies (framework-independent parts)."""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mpjax
from mpjax._src.flax.defaults import DEFAULTS, NO_DEFAULTS, Defaults
from mpjax._src.flax.rules import match, parse_rules, resolve

F32 = mpjax.Policy("float32", "float32", "float32")
BF16 = mpjax.get_policy("params=float32,compute=bfloat16")  # output bf16
F16 = mpjax.get_policy("params=float32,compute=float16")


class Block(nn.Module):
    pass


class SubDense(nn.Dense):
    pass


class MixA(nn.Module):
    pass


class MixB(nn.Module):
    pass


class Both(MixA, MixB):
    pass


class MyNorm(nn.LayerNorm):
    pass


def test_policy_and_spec_mean_default_rule():
    for spec in (BF16, str(BF16)):
        rules = parse_rules(spec, nn.Module)
        assert rules.default.policy == BF16
        assert rules.path_rules == () and rules.class_rules == ()


def test_mapping_kinds_and_policies():
    rules = parse_rules({nn.Dense: "f16", "enc/.*": BF16, "*": "float32"}, nn.Module)
    assert [r.selector for r in rules.class_rules] == [nn.Dense]
    assert rules.class_rules[0].policy == mpjax.get_policy("f16")
    assert [r.selector for r in rules.path_rules] == ["enc/.*"]
    assert rules.default.policy == F32


@pytest.mark.parametrize("bad", [int, dict, nnx.Linear])
def test_non_module_class_selector_is_refused(bad):
    with pytest.raises(TypeError, match=bad.__qualname__) as info:
        parse_rules({bad: "bf16"}, nn.Module)
    assert "flax.linen.module.Module" in str(info.value)


def test_linen_class_refused_for_nnx():
    with pytest.raises(TypeError, match="Dense"):
        parse_rules({nn.Dense: "bf16"}, nnx.Module)


def test_invalid_regex_is_named():
    with pytest.raises(ValueError, match=r"'enc/\[0-' is not a valid regular expression"):
        parse_rules({"enc/[0-": "bf16"}, nn.Module)


@pytest.mark.parametrize(
    "spec, culprit",
    [("params=float32,compute=bfloat17", "bfloat17"), ("compute", "compute"), ("p=int8", "int8")],
)
def test_invalid_policy_spec_names_selector_and_value(spec, culprit):
    with pytest.raises(ValueError) as info:
        parse_rules({nn.Dense: spec}, nn.Module)
    assert culprit in str(info.value) and "Dense" in str(info.value)


@pytest.mark.parametrize("bad", [3, ("a", "b"), None])
def test_bad_selector_or_value_types(bad):
    with pytest.raises(TypeError, match="selector"):
        parse_rules({bad: "bf16"}, nn.Module)
    with pytest.raises(TypeError, match="must be a Policy or a spec string"):
        parse_rules({nn.Dense: 3.0}, nn.Module)
    with pytest.raises(TypeError, match="mapping"):
        parse_rules(42, nn.Module)


def test_path_rule_beats_class_rule():
    rules = parse_rules({nn.Dense: "f16", "head": BF16}, nn.Module)
    assert match(rules, nn.Dense, "head").policy == BF16
    assert match(rules, nn.Dense, "body").policy == mpjax.get_policy("f16")
    assert match(rules, Block, "body") is None


def test_regex_uses_fullmatch():
    rules = parse_rules({"enc": BF16}, nn.Module)
    assert match(rules, Block, "enc") is not None
    assert match(rules, Block, "enc/layers_0") is None
    assert match(rules, Block, "my_enc") is None


def test_most_derived_class_wins():
    rules = parse_rules({nn.Module: F32, nn.Dense: BF16, SubDense: F16}, nn.Module)
    assert match(rules, SubDense, "x").policy == F16
    assert match(rules, nn.Dense, "x").policy == BF16
    assert match(rules, Block, "x").policy == F32


def test_two_path_rules_are_ambiguous_and_named():
    rules = parse_rules({"enc/.*": BF16, ".*/attn": F16}, nn.Module)
    assert match(rules, Block, "enc/mlp").policy == BF16
    with pytest.raises(ValueError) as info:
        match(rules, Block, "enc/attn")
    text = str(info.value)
    assert "'enc/.*'" in text and "'.*/attn'" in text and "enc/attn" in text


def test_unrelated_class_rules_are_ambiguous_and_named():
    rules = parse_rules({MixA: BF16, MixB: F16}, nn.Module)
    with pytest.raises(ValueError) as info:
        match(rules, Both, "x")
    assert "MixA" in str(info.value) and "MixB" in str(info.value)
    assert match(rules, MixA, "x").policy == BF16


def _resolve(spec, cls, path="x", parent=None, is_root=False, defaults=NO_DEFAULTS):
    return resolve(parse_rules(spec, nn.Module), defaults, cls, path, parent, is_root)


def test_parent_policy_covers_children_and_star_only_the_root():
    root = _resolve({"*": BF16}, Block, "", is_root=True)
    assert root.policy == BF16 and not root.own_rule
    child = _resolve({"*": BF16}, nn.Dense, "Dense_0", parent=root)
    assert child.policy == BF16
    # without a parent resolution, "*" does not apply to non-root modules
    assert _resolve({"*": BF16}, nn.Dense, "Dense_0") is None
    # a child's own class rule beats the inherited policy; its children inherit it
    sub = _resolve({"*": BF16, Block: F16}, Block, "blk", parent=root)
    assert sub.policy == F16
    assert _resolve({"*": BF16, Block: F16}, nn.Dense, "blk/d", parent=sub).policy == F16


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm, MyNorm])
def test_norms_compute_in_float32_under_low_precision(norm, compute):
    policy = mpjax.Policy("float32", compute, compute)
    res = _resolve({"*": policy}, norm, "", is_root=True, defaults=DEFAULTS)
    assert res.policy.compute_dtype == np.float32
    assert res.policy.param_dtype == np.float32
    assert res.inherited == policy  # children inherit the rule's policy, not the override
    plain = _resolve({"*": policy}, nn.Dense, "", is_root=True, defaults=DEFAULTS)
    assert plain.policy.compute_dtype == jnp.dtype(compute)


def test_norm_defaults_do_not_touch_full_precision_policies():
    res = _resolve({"*": "float64"}, nn.LayerNorm, "", is_root=True, defaults=DEFAULTS)
    assert res.policy.compute_dtype == np.float64


def test_user_rules_override_default_lists():
    # naming the class (or a subclass) or the path says otherwise ...
    by_class = _resolve({nn.LayerNorm: BF16}, MyNorm, "ln", defaults=DEFAULTS)
    assert by_class.policy.compute_dtype == jnp.bfloat16
    by_path = _resolve({"ln": BF16}, nn.LayerNorm, "ln", defaults=DEFAULTS)
    assert by_path.policy.compute_dtype == jnp.bfloat16
    # ... a rule on a broader class does not
    broad = _resolve({nn.Module: BF16}, nn.LayerNorm, "ln", defaults=DEFAULTS)
    assert broad.policy.compute_dtype == np.float32


def test_softmax_flag_and_final_output():
    mha = nn.MultiHeadDotProductAttention
    root = _resolve({"*": BF16}, mha, "", is_root=True, defaults=DEFAULTS)
    assert root.float32_softmax
    assert root.policy.output_dtype == np.float32  # logits widened on the root only
    child = _resolve({"*": BF16}, nn.Dense, "d", parent=root, defaults=DEFAULTS)
    assert child.policy.output_dtype == jnp.bfloat16
    assert not child.float32_softmax
    no = _resolve({"*": BF16}, nn.MultiHeadDotProductAttention, "", is_root=True)
    assert not no.float32_softmax and no.policy.output_dtype == jnp.bfloat16


def test_defaults_are_immutable_data_and_validated():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.final_output_dtype = None
    assert isinstance(DEFAULTS.float32_modules, tuple)
    d = Defaults(float32_modules=[MyNorm], float32_softmax_modules=(), final_output_dtype=None)
    assert d.float32_modules == (MyNorm,)
    with pytest.raises(TypeError, match="float32_modules"):
        Defaults(float32_modules=(int,))
    with pytest.raises(ValueError, match="int32"):
        Defaults(final_output_dtype=jnp.int32)
