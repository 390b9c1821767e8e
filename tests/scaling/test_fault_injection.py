"""Fault injection in a real run: the digits ResNet of examples/train_digits.py, fp16 compute with
dynamic loss scaling, trained once clean and once with faults injected at known steps:

- batches holding one NaN, one inf, one -inf (first, middle and last element of the batch),
- an all-NaN batch,
- an exploding batch: finite float32 inputs x 1e5, beyond fp16's range once the model casts them,
- an inf written into one gradient leaf inside the jitted step (the example's `grad_fault` hook).

Every injected step is skipped and no other, the final parameters and state are finite, and the
test accuracy is within 0.5 percentage points of the clean run with the same seed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.train_digits import DigitsConfig, load_data, make_train_fns, train

pytestmark = pytest.mark.slow

SEED = 0
CONFIG = DigitsConfig(precision="fp16", steps=400, width=24, num_blocks=1, initial_scale=2.0**10)
BATCH_FAULTS = {40: "nan", 100: "inf", 160: "all_nan", 220: "explode", 340: "-inf"}
GRAD_FAULT_STEP = 280
INJECTED = sorted([*BATCH_FAULTS, GRAD_FAULT_STEP])


def _corrupt(kind: str, x: np.ndarray) -> np.ndarray:
    x = np.array(x, np.float32, copy=True)
    flat = x.reshape(-1)
    if kind == "nan":
        flat[flat.size // 2] = np.nan
    elif kind == "inf":
        flat[0] = np.inf
    elif kind == "-inf":
        flat[-1] = -np.inf
    elif kind == "all_nan":
        flat[:] = np.nan
    elif kind == "explode":
        x = x * np.float32(1e5)
        assert np.all(np.isfinite(x)) and np.abs(x).max() > np.finfo(np.float16).max
    return x


def batch_fault(step: int, batch):
    x, y = batch
    if step in BATCH_FAULTS:
        return _corrupt(BATCH_FAULTS[step], x), y
    return x, y


def grad_fault(step, grads):
    """Inside the jitted step: an inf in the last element of the first kernel at one step."""
    leaves, treedef = jax.tree.flatten(grads)
    i = next(i for i, g in enumerate(leaves) if g.ndim >= 2)
    flat = leaves[i].reshape(-1)
    bad = flat.at[-1].set(jnp.inf).reshape(leaves[i].shape)
    leaves[i] = jnp.where(step == GRAD_FAULT_STEP, bad, leaves[i])
    return jax.tree.unflatten(treedef, leaves)


@pytest.fixture(scope="module")
def runs():
    data = load_data()
    clean = train(CONFIG, SEED, data=data, fns=make_train_fns(CONFIG))
    faulty = train(CONFIG, SEED, data=data, batch_fault=batch_fault, grad_fault=grad_fault)
    return clean, faulty


def test_clean_run_learns_and_skips_nothing(runs):
    clean, _ = runs
    assert clean.skipped_steps == 0
    assert clean.metric > 85.0  # a trained model, so the comparison below means something


def test_skipped_steps_are_exactly_the_injections(runs):
    _, faulty = runs
    assert faulty.skipped_steps == len(INJECTED)
    skipped_at = np.flatnonzero(~faulty.history["grads_finite"]).tolist()
    assert skipped_at == INJECTED
    np.testing.assert_array_equal(
        faulty.history["skipped_steps"], np.cumsum(~faulty.history["grads_finite"])
    )


def test_injected_batches_reach_the_loss(runs):
    """The faulty batches (the exploding one included) make the loss itself non-finite; the
    gradient fault leaves the loss finite and still skips."""
    _, faulty = runs
    loss = faulty.history["loss"]
    for t in BATCH_FAULTS:
        assert not np.isfinite(loss[t]), (t, loss[t])
    assert np.isfinite(loss[GRAD_FAULT_STEP])
    others = np.setdiff1d(np.arange(CONFIG.steps), INJECTED)
    assert np.all(np.isfinite(loss[others]))


def test_loss_scale_backs_off_at_each_injection_only(runs):
    _, faulty = runs
    scale = faulty.history["loss_scale"]
    before = np.concatenate([[CONFIG.initial_scale], scale[:-1]])
    for t in INJECTED:
        assert scale[t] == max(before[t] / 2, 1.0), t
    changed = np.flatnonzero(scale != before).tolist()
    assert set(INJECTED) <= set(changed)
    for t in set(changed) - set(INJECTED):  # any other change is a growth
        assert scale[t] == 2 * before[t], t
    assert np.all(np.isfinite(scale)) and np.all(scale >= 1.0)


def test_final_params_and_state_finite(runs):
    _, faulty = runs
    trees = {
        "params": faulty.params,
        "opt_state": faulty.opt_state,
        "batch_stats": faulty.extra["batch_stats"],
    }
    for name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            leaf = np.asarray(leaf)
            if leaf.dtype.kind == "f":
                assert np.all(np.isfinite(leaf)), name + jax.tree_util.keystr(path)


def test_test_accuracy_within_half_a_point_of_clean_run(runs):
    clean, faulty = runs
    assert abs(faulty.metric - clean.metric) <= 0.5, (faulty.metric, clean.metric)
