"""The int8 state's layout is a function of the shapes: `eval_shape`, `jit(init)` and eager
`init` agree, and under FSDP its update step has the bf16-state step's collectives, however
the state was built (8 simulated CPU devices, and 8 deviceless H100s).

3d03840 chose block lengths from each leaf's sharding at `init`: eager `init` on sharded
params gave other scales' shapes than `jax.eval_shape(tx.init, ...)`/`jax.jit(tx.init)`, and
the jitted init's 256-long blocks straddled the devices (dozens of collectives a step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.helpers.gpu import _run_json
from tests.scaling import int8_layout_steps as steps


def _mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))


def _types(tree) -> list:
    flat = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(k), x.shape, str(x.dtype)) for k, x in flat]


@pytest.mark.parametrize("sharded", [True, False])
def test_eval_shape_and_jit_init_give_the_shapes_of_eager_init(sharded):
    mesh = _mesh()
    params = steps.real_params(mesh)
    if not sharded:
        params = {k: jnp.asarray(jax.device_get(v)) for k, v in params.items()}
    t = steps.tx(jnp.int8)
    eager = _types(t.init(params))
    assert _types(jax.eval_shape(t.init, params)) == eager
    assert _types(jax.jit(t.init)(params)) == eager
    shardings = steps.state_shardings(jax.eval_shape(t.init, params), mesh)
    assert _types(jax.jit(t.init, out_shardings=shardings)(params)) == eager


@pytest.mark.parametrize("way", steps.WAYS)
def test_fsdp_int8_step_has_the_bf16_steps_collectives(way):
    mesh = _mesh()
    params = steps.real_params(mesh)
    got = {}
    for dtype in (jnp.bfloat16, jnp.int8):
        state = steps.built_state(dtype, way, params, mesh)
        got[dtype] = steps.step_collectives(dtype, params, state)
    assert got[jnp.int8] == got[jnp.bfloat16], got


@pytest.mark.slow
def test_fsdp_int8_step_has_the_bf16_steps_collectives_on_8_gpus(tmp_path):
    out = _run_json("tests/scaling/_int8_layout_hlo.py", tmp=tmp_path)
    for way in ("eager", "eval_shape", "jit"):
        assert out[f"int8/{way}"] == out[f"bfloat16/{way}"], (way, out)
