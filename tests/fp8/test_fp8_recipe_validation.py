"""Issue 27: every `Fp8Recipe` field is validated at construction, naming field and value."""

import jax.numpy as jnp
import numpy as np
import pytest

from mpjax import Fp8Recipe


@pytest.mark.parametrize(
    "kwargs, error, culprit",
    [
        ({"power_of_two_scale": "no"}, TypeError, "power_of_two_scale='no'"),  # read as True
        ({"power_of_two_scale": 0}, TypeError, "power_of_two_scale=0"),
        ({"high_precision_grad_weight": "yes"}, TypeError, "high_precision_grad_weight='yes'"),
        ({"margin": 200}, ValueError, "margin=200"),  # 2**-200 is 0 in float32: scales inf
        ({"margin": 15}, ValueError, "margin=15"),  # amax below e4m3's smallest normal
        ({"margin": "1"}, TypeError, "margin='1'"),
        ({"margin": True}, TypeError, "margin=True"),
        ({"exclude": [1, 2]}, TypeError, r"exclude=\[1, 2\]"),
        ({"exclude": 5}, TypeError, "exclude=5"),
        ({"amax_history_len": 2.0}, TypeError, "amax_history_len=2.0"),
        ({"min_dim": "64"}, TypeError, "min_dim='64'"),
        ({"scaling": ["rowwise"]}, ValueError, r"scaling=\['rowwise'\]"),
        ({"exclude_if": "*/head"}, TypeError, "exclude_if='\\*/head'"),
        # block-scaled recipes take no margin (it was ignored): refused, naming it
        ({"scaling": "mxfp8", "margin": 2}, ValueError, "margin=2 with scaling='mxfp8'"),
        ({"scaling": "nvfp4", "margin": 1}, ValueError, "margin=1 with scaling='nvfp4'"),
        ({"scaling": "blockwise", "margin": 0.5}, ValueError, "margin=0.5 with scaling="),
    ],
)
def test_recipe_refuses_bad_field_naming_it(kwargs, error, culprit):
    with pytest.raises(error, match=culprit):
        Fp8Recipe(**kwargs)


def test_recipe_accepts_numpy_scalars_and_the_margin_bound():
    r = Fp8Recipe(margin=np.int64(14), amax_history_len=np.int32(8), power_of_two_scale=np.True_)
    assert r.margin == 14.0 and type(r.amax_history_len) is int and r.power_of_two is True
    # 448 * 2**-14 is still a normal float8_e4m3fn value (smallest normal 2**-6).
    assert 448 * 2.0**-14 >= float(jnp.finfo(jnp.float8_e4m3fn).smallest_normal)
    assert Fp8Recipe(exclude="*/head").exclude == ("*/head",)
    assert Fp8Recipe(power_of_two_scale=False).power_of_two is False
    assert Fp8Recipe("mxfp8", margin=0).margin == 0.0  # the default stays accepted
