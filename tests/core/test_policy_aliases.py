"""The words users bring from jmp and Keras: `with_*_dtype`, `cast_to_full`, `cast_to_half`,
`half_dtype`, and the Keras policy names, checked against jmp itself where jmp has them."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import mpjax
from mpjax import Policy, get_policy

F32, BF16, F16, F64 = (jnp.dtype(d) for d in ("float32", "bfloat16", "float16", "float64"))
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def dtypes_of(policy):
    return tuple(
        jnp.dtype(d) for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    )


# ----------------------------------------------------------------------------- with_*_dtype


@pytest.mark.parametrize("start", ["f32", "p=f32,c=bf16,o=f32", "p=bf16,c=f16,o=f32"])
@pytest.mark.parametrize("field", ["param", "compute", "output"])
@pytest.mark.parametrize("new", [jnp.float32, "bfloat16", np.float16, "f16"])
def test_with_dtype_replaces_one_field(start, field, new):
    policy = get_policy(start)
    out = getattr(policy, f"with_{field}_dtype")(new)
    want = jnp.dtype({"f16": "float16"}.get(new, new))
    assert getattr(out, f"{field}_dtype") == want
    for other in {"param", "compute", "output"} - {field}:
        assert getattr(out, f"{other}_dtype") == getattr(policy, f"{other}_dtype")
    assert isinstance(out, Policy) and get_policy(str(out)) == out


@pytest.mark.parametrize("spec", ["p=f32,c=bf16", "c=f16", "bf16", "p=f32,c=f16,o=f32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_output_dtype_matches_jmp(spec, dtype):
    ours = get_policy(spec).with_output_dtype(dtype)
    theirs = jmp.get_policy(spec).with_output_dtype(dtype)
    assert dtypes_of(ours) == dtypes_of(theirs)


def test_with_dtype_refuses_non_floating():
    with pytest.raises(ValueError, match=r"Policy\.output_dtype: int32 is not a floating dtype"):
        get_policy("f32").with_output_dtype(jnp.int32)
    with pytest.raises(ValueError, match=r"Policy\.compute_dtype: 'bf17' is not a dtype"):
        get_policy("f32").with_compute_dtype("bf17")


# ----------------------------------------------------------------------------- jmp grammar

JMP_SPECS = [
    "f32",
    "bf16",
    "f16",
    "full",
    "c=bf16",
    "c=f16",
    "p=f16,c=f16",
    "p=f32,c=bf16,o=f32",
    "params=float32,compute=float16,output=float32",
    "p=bf16,c=f32",
]


@pytest.mark.parametrize("spec", JMP_SPECS)
def test_get_policy_matches_jmp(spec):
    assert dtypes_of(get_policy(spec)) == dtypes_of(jmp.get_policy(spec))


def test_half_name_differs_from_jmp_as_documented():
    """In a spec, `half` is bfloat16 everywhere; jmp reads it as the backend's half dtype."""
    assert get_policy("c=half").compute_dtype == BF16
    assert jmp.get_policy("c=half").compute_dtype == jmp.half_dtype()
    assert mpjax.half_dtype() == jnp.dtype(jmp.half_dtype())


# ----------------------------------------------------------------------------- cast helpers


def mixed_tree(seed):
    """Floating arrays of every width over a wide range (inf/NaN at first, middle, last
    elements), and leaves that must pass through."""
    rng = np.random.default_rng(seed)

    def wide(n, dtype):
        x = np.exp(rng.uniform(-20, 20, n)) * rng.choice([-1.0, 1.0], n)
        x[0], x[n // 2], x[-1] = np.inf, np.nan, -np.inf
        return x.astype(dtype)

    return {
        "f32": jnp.asarray(wide(33, np.float32)),
        "bf16": jnp.asarray(wide(17, np.float32), jnp.bfloat16),
        "f16": jnp.asarray(wide(9, np.float32), jnp.float16),
        "np64": wide(11, np.float64),
        "int": jnp.arange(4, dtype=jnp.int32),
        "bool": np.array([True, False]),
        "py": 2.5,
        "none": None,
        "key": jax.random.key(0),
    }


def assert_same_tree(ours, theirs):
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating):
            assert jnp.dtype(a.dtype) == jnp.dtype(b.dtype)
            np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
        else:
            assert a is b


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # float64 1e8 -> float16
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["cast_to_full", "cast_to_half"])
def test_cast_helpers_match_jmp(name, seed):
    tree = mixed_tree(seed)
    ours = getattr(mpjax, name)(tree)
    assert_same_tree(ours, getattr(jmp, name)(tree))
    target = F32 if name == "cast_to_full" else mpjax.half_dtype()
    for k in ("f32", "bf16", "f16", "np64"):
        assert ours[k].dtype == target


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_policy_cast_methods_match_jmp(method, dtype):
    tree = mixed_tree(3)
    ours = getattr(Policy(dtype, dtype, dtype), method)(tree)
    assert_same_tree(ours, getattr(jmp.Policy(dtype, dtype, dtype), method)(tree))


def test_half_dtype_matches_jmp():
    assert mpjax.half_dtype() == jnp.dtype(jmp.half_dtype())
    assert mpjax.half_dtype() == (BF16 if jax.default_backend() == "tpu" else F16)


# ----------------------------------------------------------------------------- Keras names

KERAS = {
    "mixed_bfloat16": (F32, BF16, BF16),
    "mixed_float16": (F32, F16, F16),
    "float32": (F32, F32, F32),
    "bfloat16": (BF16, BF16, BF16),
    "float16": (F16, F16, F16),
}


@pytest.mark.parametrize("name, expected", list(KERAS.items()))
@pytest.mark.parametrize("case", [str, str.upper], ids=["lower", "upper"])
def test_keras_policy_names(name, expected, case):
    """Keras: variables in the first dtype, compute (and so layer outputs) in the second."""
    assert dtypes_of(get_policy(case(name))) == expected
    assert dtypes_of(get_policy(f"  {name} ")) == expected


@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16"])
def test_keras_mixed_names_equal_jmp_compute_only_specs(name):
    """`mixed_X` is jmp's `p=f32,c=X` (output follows compute in both)."""
    spec = "p=f32,c=" + name.removeprefix("mixed_")
    assert get_policy(name) == get_policy(spec)
    assert dtypes_of(get_policy(name)) == dtypes_of(jmp.get_policy(spec))


@pytest.mark.parametrize("bad", ["mixed_float32", "mixed-bfloat16", "mixed_bf16x"])
def test_unknown_policy_name_lists_the_valid_ones(bad):
    with pytest.raises(ValueError, match=f"unknown policy name '{bad}'") as err:
        get_policy(bad)
    assert "mixed_bfloat16" in str(err.value) and "float32" in str(err.value)


def test_keras_name_policies_work_under_autocast():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    for name, (_, _, out) in KERAS.items():
        got = mpjax.autocast(lambda a, b: a @ b, name)(x, w)
        assert got.dtype == out


def test_aliases_are_exported():
    for name in ("cast_to_full", "cast_to_half", "half_dtype"):
        assert getattr(mpjax, name) is getattr(mpjax.policy, name)
    assert set(mpjax.policy.KERAS_POLICY_NAMES) <= set(KERAS)
