"""Tests for `mpjax.Policy` and `mpjax.get_policy`."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax import Policy, get_policy

F32, BF16, F16, F64 = (jnp.dtype(d) for d in ("float32", "bfloat16", "float16", "float64"))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        (" p = f32 , c = half ", (F32, BF16, BF16)),
        ("c=f16", (F32, F16, F16)),
        ("p=bf16", (BF16, BF16, BF16)),
        ("params=full,compute=float16,output=full", (F32, F16, F32)),
        ("float16", (F16, F16, F16)),
        ("bf16", (BF16, BF16, BF16)),
        ("half", (BF16, BF16, BF16)),
        ("full", (F32, F32, F32)),
        ("f64", (F64, F64, F64)),
        ("o=f16", (F32, F32, F16)),
        ("PARAMS=F32,COMPUTE=BF16", (F32, BF16, BF16)),
    ],
)
def test_get_policy_grammar(spec, expected):
    p = get_policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


NAMES = ["float32", "bfloat16", "float16", "float64"]


@pytest.mark.parametrize("dtypes", list(itertools.product(NAMES, repeat=3)))
def test_str_round_trip(dtypes):
    p = Policy(*dtypes)
    assert get_policy(str(p)) == p
    assert hash(get_policy(str(p))) == hash(p)


def test_policy_normalises_dtypes_and_is_hashable():
    p = Policy(np.float32, "bfloat16", jnp.float16)
    assert p.param_dtype == F32 and p.compute_dtype == BF16 and p.output_dtype == F16
    assert isinstance(p.compute_dtype, np.dtype)
    assert p == Policy("float32", jnp.bfloat16, "float16")
    assert len({p, Policy("f32", "bf16", "f16")}) == 1
    with pytest.raises(dataclasses_frozen_error()):
        p.param_dtype = F16


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_policy_as_static_jit_argument():
    calls = []

    def f(x, policy):
        calls.append(policy)
        return policy.cast_to_compute(x)

    jf = jax.jit(f, static_argnums=1)
    x = jnp.asarray(np.random.default_rng(0).normal(size=4), jnp.float32)
    assert jf(x, get_policy("c=bf16")).dtype == BF16
    assert jf(x, Policy("f32", "bf16", "bf16")).dtype == BF16
    assert len(calls) == 1  # equal policies hit the jit cache
    assert jf(x, get_policy("c=f16")).dtype == F16
    assert len(calls) == 2


@pytest.mark.parametrize(
    "spec, culprit",
    [
        ("params=float32,compute=bfloat17", "bfloat17"),
        ("parms=float32", "parms"),
        ("p=f32,,c=bf16", "empty"),
        ("p=f32,p=bf16", "twice"),
        ("int32", "int32"),
        ("p=f32,c", "'c'"),
        ("", "empty"),
    ],
)
def test_bad_spec_names_culprit(spec, culprit):
    with pytest.raises(ValueError, match=culprit) as err:
        get_policy(spec)
    if culprit in ("bfloat17", "int32"):
        assert "bfloat16" in str(err.value) and "float32" in str(err.value)  # lists valid ones
    if culprit == "parms":
        assert "compute" in str(err.value)


@pytest.mark.parametrize("bad", [jnp.int32, "int8", jnp.bool_, "uint16"])
def test_non_floating_dtypes_refused(bad):
    with pytest.raises(ValueError, match="floating|not a"):
        Policy(jnp.float32, bad, jnp.float32)


def test_non_string_spec_is_type_error():
    with pytest.raises(TypeError, match="int"):
        get_policy(3)


def _tree(rng):
    return {
        "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
        "np": rng.normal(size=(2,)).astype(np.float64),
        "h": jnp.asarray(rng.normal(size=(5,)), jnp.float16),
        "i": jnp.arange(3, dtype=jnp.int32),
        "b": jnp.array([True, False]),
        "none": None,
        "py": 1.5,
        "pyint": 7,
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(1),
    }


@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
@pytest.mark.parametrize("target", ["float32", "bfloat16", "float16"])
def test_cast_methods_cast_floating_leaves_only(method, target):
    rng = np.random.default_rng(1)
    tree = _tree(rng)
    policy = Policy(target, target, target)
    out = getattr(policy, method)(tree)
    for k in ("w", "np", "h"):
        assert out[k].dtype == jnp.dtype(target)
        np.testing.assert_allclose(
            np.asarray(out[k], np.float64), np.asarray(tree[k], np.float64), rtol=1e-2
        )
    for k in ("i", "b", "raw_key"):
        assert out[k] is tree[k]
    assert out["none"] is None and out["py"] == 1.5 and out["pyint"] == 7
    assert out["key"] is tree["key"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cast_to_same_dtype_adds_no_convert(dtype):
    policy = Policy(dtype, dtype, dtype)
    x = jnp.ones((4,), dtype) * 3
    jaxpr = jax.make_jaxpr(policy.cast_to_compute)({"a": x, "n": jnp.arange(2)})
    assert not [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    other = Policy("float32", "float16" if dtype != "float16" else "bfloat16", "float32")
    jaxpr = jax.make_jaxpr(other.cast_to_compute)({"a": x, "n": jnp.arange(2)})
    converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert len(converts) == 1  # the int leaf is not converted


def test_public_names():
    assert mpjax.Policy is Policy and mpjax.get_policy is get_policy
