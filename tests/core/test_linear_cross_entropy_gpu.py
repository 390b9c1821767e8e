"""`mpjax.nn.linear_cross_entropy` under FSDP on 8 deviceless H100s: the head kernel is
gathered once, before the loop over vocabulary tiles (issue 36).

`tests/core/_lce_fsdp_hlo.py` runs under the python named by `$MPJAX_GPU_AOT_PYTHON` (the
environment with the `gpu-aot` wheels, as for tests/integration/test_gpu_cost_guard.py),
with `JAX_PLATFORMS=cpu`. Without the variable these tests fail under CI (`CI=true`) and are
skipped elsewhere, saying why.

Before the fix the partitioner cut the vocabulary-split kernel into tiles split along the
loop, and every step of the forward and backward loops gathered the whole kernel to slice
its tile: 16 gathers of the kernel where one does (XLA:GPU hoists no gather out of a loop;
XLA:CPU does, so tests/core/test_linear_cross_entropy_sharded.py sees two, not sixteen).
"""

from __future__ import annotations

import pytest

from tests.helpers.gpu import _run_json

D, VOCAB, TILES = 128, 4096, 8  # as in tests/core/_lce_fsdp_hlo.py
KERNEL_BF16 = 2 * D * VOCAB


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    return _run_json("tests/core/_lce_fsdp_hlo.py", tmp=tmp_path_factory.mktemp("lce"))


def _collectives(figures: dict, axis_type: str) -> list:
    """The program's collectives; a program that did not compile fails with its error."""
    if "error" in figures[axis_type]:
        pytest.fail(f"the {axis_type} program did not compile: {figures[axis_type]['error']}")
    return figures[axis_type]["collectives"]


def _bytes(collectives: list, op: str) -> int:
    """The bytes `op` moves in one step, a loop's collectives once per trip."""
    return sum(b * runs for name, _, _, b, runs, _ in collectives if name == op)


AXIS_TYPES = pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])


@AXIS_TYPES
def test_no_gather_inside_the_vocabulary_loops(figures, axis_type):
    looped = [c for c in _collectives(figures, axis_type) if c[5]]
    assert looped, "the backward loop reduces each tile's kernel gradient: no loop found"
    assert all(runs == TILES for *_, runs, _ in looped), looped
    assert not [c for c in looped if c[0] == "all-gather"], looped


@AXIS_TYPES
def test_the_kernel_is_gathered_once_in_bf16(figures, axis_type):
    collectives = _collectives(figures, axis_type)
    assert _bytes(collectives, "all-gather") == KERNEL_BF16, collectives


@AXIS_TYPES
def test_the_kernel_gradient_is_reduced_once(figures, axis_type):
    """Tile by tile, each tile's float32 sum over the devices' tokens once."""
    collectives = _collectives(figures, axis_type)
    assert _bytes(collectives, "all-reduce") <= 2 * KERNEL_BF16 + 64, collectives


def test_one_tile_keeps_the_partitioners_plan(figures):
    """Without a loop the kernel is not forced to be gathered: the partitioner gathers the
    hidden states and splits the vocabulary, fewer bytes than the looped program's gather
    of the kernel and reduction of its gradient (forcing the gather there: 4.2 MB against
    3.1 MB; the hand-written unfused loss: 11 MB)."""
    total = {
        name: sum(b * runs for _, _, _, b, runs, _ in _collectives(figures, name))
        for name in ("Auto", "Auto/one-tile", "Auto/unfused")
    }
    assert total["Auto/one-tile"] < total["Auto"] < total["Auto/unfused"], total
