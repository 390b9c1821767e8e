"""int8 states of mpjax 3d03840 written on 8 devices restore on 1, 4 and 8, in today's layout.

3d03840 chose each int8 leaf's block length from its sharding at `init` (and 256 where it saw
none, e.g. under `jax.jit(tx.init)`), so a checkpoint of 8 devices had scales of shapes that
1 or 4 devices could not take (orbax refused them; `upgrade_state` had no `block_size` that
worked). The fixtures (`tests/fixtures/checkpoints_3d03840/`, written by that release with
`tests/fixtures/write_checkpoints_3d03840.py` on 8 simulated devices) come back through
`mpjax.upgrade_state(restored_raw, template)` in today's layout from the shape, each moment
within the requantisation bound of the values 3d03840 stored, and a jitted step runs.
"""

from __future__ import annotations

import pathlib

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import mpjax
from mpjax._src.scaling.blockwise8 import Blockwise8, dequantize, quantize, scales_shape
from tests.fixtures import write_checkpoints_3d03840 as writer

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "checkpoints_3d03840"
HALF_GAP = 0.9 / 128  # half the top decade's gap between codes, in units of the scale
is_q = lambda x: isinstance(x, Blockwise8)  # noqa: E731


def _restore_raw(name: str, fmt: str):
    """The checkpoint restored as a user would without a target (orbax, or flax msgpack)."""
    if fmt == "orbax":
        return ocp.StandardCheckpointer().restore((FIXTURES / "orbax" / name).absolute())
    return flax.serialization.msgpack_restore(
        (FIXTURES / "msgpack" / f"{name}.msgpack").read_bytes()
    )


def _types(tree) -> list:
    """(path, shape, dtype name) of each leaf."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(k), x.shape, str(x.dtype)) for k, x in flat]


def _mesh(devices: int):
    return jax.make_mesh(
        (devices,),
        ("fsdp",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:devices],
    )


# every device count through orbax; msgpack (how the bytes are read back, the same on any
# device count) on one device, the farthest from the 8 that wrote it
@pytest.mark.parametrize(
    ("devices", "fmt"), [(1, "orbax"), (4, "orbax"), (8, "orbax"), (1, "msgpack")]
)
@pytest.mark.parametrize("name", writer.NAMES)
def test_int8_state_of_8_devices_restores_on_1_4_and_8(name, devices, fmt):
    p = writer.params(_mesh(devices))
    template = {"params": p, "opt_state": writer.tx(name).init(p)}
    tree = mpjax.upgrade_state(_restore_raw(name, fmt), template)
    expected = np.load(FIXTURES / "expected" / f"{name}.npz")
    assert _types(tree) == _types(template)
    for x, t in zip(jax.tree.leaves(tree), jax.tree.leaves(template), strict=True):
        if x.ndim:  # placed like the template (its scalars: replicated over the mesh)
            assert x.sharding.is_equivalent_to(t.sharding, x.ndim)
    adam = writer.inner_state(name, tree["opt_state"]).inner_state[0]
    converted = 0
    for moment in ("mu", "nu"):
        for k, q in getattr(adam, moment).items():
            old = expected[f"{moment}/{k}"]
            shape = old.shape
            assert q.scales.shape == scales_shape(shape)  # today's layout, from the shape
            if tuple(expected[f"scales/{moment}/{k}"]) != q.scales.shape:
                converted += 1
            # requantised to nearest from the old values: each new scale is the largest old
            # value of its block, each element within half a code gap of the scale of it
            want = quantize(jnp.asarray(old))
            np.testing.assert_array_equal(q.scales, want.scales)
            np.testing.assert_array_equal(q.codes, want.codes)
            per_element = dequantize(Blockwise8(jnp.full(shape, 127, jnp.int8), q.scales), shape)
            err = np.abs(np.asarray(dequantize(q, shape)) - old)
            assert (err <= HALF_GAP * np.asarray(per_element) * (1 + 1e-6)).all(), k
    assert converted >= 3  # the fixtures' layouts differ from today's for most leaves
    step = writer.train_step(name)
    params, state = tree["params"], tree["opt_state"]
    # eager `init` leaves its scalars (counts, the loss scale) on one device: replicate them
    replicated = jax.sharding.NamedSharding(_mesh(devices), jax.sharding.PartitionSpec())
    state = jax.tree.map(lambda x: jax.device_put(x, replicated) if not x.ndim else x, state)
    for i in range(2):
        params, state = step(params, state, writer.grads(10 + i, params))
    assert all(bool(jnp.isfinite(v).all()) for v in params.values())
    assert _types(state) == _types(template["opt_state"])


def test_a_leaf_whose_old_blocks_are_todays_is_kept_bit_for_bit():
    """3d03840's 125-long blocks of a 1000-wide leaf split 8 ways are today's blocks too."""
    raw = _restore_raw("scaled-eager", "msgpack")
    p = writer.params(_mesh(8))
    tree = mpjax.upgrade_state(raw, {"params": p, "opt_state": writer.tx("scaled-eager").init(p)})
    old = raw["opt_state"]["inner_state"]["inner_state"]["0"]["mu"]["odd"]
    new = tree["opt_state"].inner_state.inner_state[0].mu["odd"]
    np.testing.assert_array_equal(new.codes, old["codes"])
    np.testing.assert_array_equal(new.scales, old["scales"])


def test_restoring_an_old_layout_straight_into_a_template_is_refused_at_update():
    """msgpack restores the old scales into the new target's fields; the update refuses the
    layout, naming `upgrade_state` (3d03840 read the 8-device blocks on one device)."""
    raw = _restore_raw("plain-eager", "msgpack")
    p = writer.params(_mesh(1))
    target = {"params": p, "opt_state": writer.tx("plain-eager").init(p)}
    state = flax.serialization.from_state_dict(target, raw)["opt_state"]
    with pytest.raises(ValueError, match=r"scales of shape \(2, 8\), not \(2, 16\).*upgrade_state"):
        writer.tx("plain-eager").update(p, state, p)
