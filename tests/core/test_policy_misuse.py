"""Issue 27: a `Policy` refuses the dtypes it would silently misread, naming field and value;
`autocast` honours `output_dtype` when the policy itself names float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax import Policy


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"param_dtype": None}, "Policy.param_dtype: None"),  # NumPy reads None as float64
        ({"compute_dtype": None}, "Policy.compute_dtype: None"),
        ({"output_dtype": None}, "Policy.output_dtype: None"),
        ({"compute_dtype": jnp.float8_e4m3fn}, "Policy.compute_dtype: float8_e4m3fn"),
        ({"param_dtype": jnp.float8_e5m2}, "Policy.param_dtype: float8_e5m2"),
        ({"reduce_dtype": jnp.float8_e4m3fn}, "Policy.reduce_dtype: float8_e4m3fn"),
    ],
)
def test_policy_refuses_none_and_fp8_naming_field_and_value(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit.replace(".", r"\.")):
        Policy(**kwargs)


def test_positional_fp8_compute_names_the_field_and_points_to_fp8_recipe():
    with pytest.raises(ValueError, match="compute_dtype: float8_e4m3fn") as e:
        Policy("f32", jnp.float8_e4m3fn)
    assert "Fp8Recipe" in str(e.value)


def test_reduce_dtype_none_still_means_unset():
    assert Policy(reduce_dtype=None).reduce_dtype is None


@pytest.mark.parametrize(
    "policy, out",
    [
        ("p=f32,c=f64,o=f32", np.float32),  # the policy names float64: its output dtype holds
        ("p=f64,c=f32,o=f32", np.float32),
        ("p=f32,c=bf16,o=f32", np.float64),  # float64 is never autocast (torch's rule)
    ],
)
def test_autocast_output_dtype_under_x64(policy, out):
    with jax.enable_x64(True):
        x = jnp.asarray(np.linspace(-1, 1, 6).reshape(2, 3), jnp.float64)
        f = mpjax.autocast(lambda x: jnp.tanh(x @ x.T), policy)
        got = f(x)
        assert got.dtype == out
        ref = np.tanh(np.asarray(x) @ np.asarray(x).T)
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-6)


LONG = "params=float32," * 40_000  # 600,000 characters


@pytest.mark.parametrize(
    "spec, culprit",
    [
        (LONG, "key 'params' given twice in policy spec"),
        (LONG + "zz", "given twice"),
        ("c=" + "x" * 600_000, "unknown dtype 'xxxx"),
        ("y" * 600_000, "unknown policy name 'yyyy"),
        ("c=bf16,," + "z" * 600_000, "empty entry in policy spec"),
        ("c=bf16," + "w" * 600_000, "entry 'wwww"),
        ("k" * 600_000 + "=bf16", "unknown key 'kkkk"),
        ("s=" + "e" * 600_000, "Policy.saved_activations: 'eeee"),
    ],
)
def test_long_spec_errors_quote_a_bounded_excerpt(spec, culprit):
    """Issue 34 (11): a 600 KB spec was echoed whole in its error; the message quotes the
    spec's first 200 characters and its length."""
    with pytest.raises(ValueError) as e:
        mpjax.get_policy(spec)
    message = str(e.value)
    assert culprit in message
    assert len(message) < 1000
    assert "... (600" in message and "characters)" in message


def test_short_spec_errors_quote_the_whole_spec():
    with pytest.raises(ValueError, match=r"policy spec 'c=bf16,c=f32'$"):
        mpjax.get_policy("c=bf16,c=f32")


def test_long_selector_error_is_bounded():
    with pytest.raises(ValueError, match=r"characters\)") as e:
        mpjax.policy.parse_rules({")" * 10_000: "bf16"}, object)
    assert len(str(e.value)) < 1000
