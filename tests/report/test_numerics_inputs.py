"""Issue 27: `numerics` takes one format name, and its result iterates like a Mapping."""

import jax.numpy as jnp
import pytest

import mpjax

TREE = {"g": jnp.array([0.0, 1e-8, 1e-3, 1e5]), "h": jnp.ones(2)}


@pytest.mark.parametrize("formats", ["float16", "f16", jnp.float16, ["float16"]])
def test_one_format_name_or_dtype_is_one_format(formats):
    n = mpjax.numerics(TREE, formats=formats)
    assert n.formats == ("float16",)
    # 1e-8 flushes to zero, 1e5 overflows in float16 (of the three non-zero values).
    assert n["g"].underflow == {"float16": pytest.approx(1 / 3)}
    assert n["g"].overflow == {"float16": pytest.approx(1 / 3)}


def test_result_iterates_its_paths_like_a_mapping():
    n = mpjax.numerics(TREE)
    assert list(n) == ["g", "h"] == n.keys()
    assert len(n) == 2 and "g" in n and "x" not in n
    assert dict(n.items())["h"] is n["h"] and n.values() == list(n.records)


def test_bad_key_and_bad_format_name_the_culprit():
    n = mpjax.numerics(TREE)
    with pytest.raises(TypeError, match="indexed by leaf path"):
        n[0]
    with pytest.raises(ValueError, match="'float128' is float128"):
        mpjax.numerics(TREE, formats="float128")
    with pytest.raises(TypeError, match="is not a dtype or dtype name"):
        mpjax.numerics(TREE, formats=[3.5])
