"""`weight_copies`: each weight's block-quantised copies made once per step, and read by its
GEMMs instead of quantising it again (gradient accumulation: `optax.MultiSteps`, a scanned
micro-batch loop): the numbers of the step without copies, no weight quantised per micro-batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax import Fp8Recipe
from mpjax.fp8 import WeightCopies, block_scaled_dot_general, quantize_blocks, weight_copies
from tests.helpers.fp8 import assert_equal_trees, quantize_shapes
from tests.helpers.sharding import AXIS, make_mesh

SCALINGS = ("mxfp8", "nvfp4", "blockwise")
D, H, TOKENS = 64, 128, 256  # the MLP's width, hidden width and tokens per micro-batch


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(H, name="up")(x))
        return nn.Dense(D, name="down")(h)


MODEL = _Mlp()


def _loss_fn(params, x):
    return jnp.mean((MODEL.apply(params, x) - x) ** 2)


def _recipe(scaling):
    return Fp8Recipe(scaling, block_lowering="emulated")


def _data(seed=0, batches=None):
    shape = (TOKENS, D) if batches is None else (batches, TOKENS, D)
    return jax.random.normal(jax.random.key(seed), shape)


def _params():
    return MODEL.init(jax.random.key(1), _data())


_quantize_shapes, _assert_equal_trees = quantize_shapes, assert_equal_trees


@pytest.mark.parametrize("scaling", SCALINGS)
def test_each_copy_is_the_weight_quantised_as_its_gemm_reads_it(scaling):
    # the forward GEMM reads the kernel [K, N] along K (columns copy, [N, K]); the input
    # gradient along N (rows copy): each bit for bit quantize_blocks of the oriented kernel
    params, x = _params(), _data()
    copies = weight_copies(mpjax.autocast(_loss_fn, fp8=_recipe(scaling)), params, x)
    kernels = jax.tree.leaves(params)
    sites = sorted((leaf, contract) for leaf, contract, _, _ in copies.sites)
    assert sites == [(1, (0,)), (3, (0,))]
    for (leaf, _, _, _), copy in zip(copies.sites, copies.copies, strict=True):
        w = kernels[leaf]
        for got, oriented in ((copy.rows, w), (copy.columns, w.T)):
            want = jax.jit(lambda t: quantize_blocks(t, scaling, axis=1, role="weight"))(oriented)
            _assert_equal_trees((got.data, got.scales), (want.data, want.scales))


@pytest.mark.parametrize(
    ("scaling", "jit"),
    [(s, True) for s in SCALINGS] + [("mxfp8", False)],  # eager: op by op, slow on 2 cores
    ids=lambda v: {True: "jit", False: "eager"}.get(v, v),
)
def test_a_step_with_copies_has_the_numbers_of_the_step_without(scaling, jit):
    params, x = _params(), _data()
    loss = mpjax.autocast(_loss_fn, fp8=_recipe(scaling))

    def with_copies(params, x):
        copies = weight_copies(loss, params, x)
        fast = mpjax.autocast(_loss_fn, fp8=_recipe(scaling), fp8_weights=copies)
        return jax.value_and_grad(fast)(params, x)

    plain = jax.value_and_grad(loss)
    if jit:
        plain, with_copies = jax.jit(plain), jax.jit(with_copies)
    _assert_equal_trees(with_copies(params, x), plain(params, x))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_gemms_given_copies_quantise_no_weight(scaling):
    params, x = _params(), _data()
    copies = weight_copies(mpjax.autocast(_loss_fn, fp8=_recipe(scaling)), params, x)
    fast = mpjax.autocast(_loss_fn, fp8=_recipe(scaling), fp8_weights=copies)
    plain = mpjax.autocast(_loss_fn, fp8=_recipe(scaling))
    without = _quantize_shapes(jax.make_jaxpr(jax.grad(plain))(params, x).jaxpr)
    got = _quantize_shapes(jax.make_jaxpr(jax.grad(fast))(params, x).jaxpr)
    assert without[(D, H)] == 1 and without[(H, D)] == 1  # each kernel, at its GEMM
    assert (D, H) not in got and (H, D) not in got  # the kernels: read from the copies
    assert got[(TOKENS, D)] == without[(TOKENS, D)]  # x and g still quantised at the GEMMs


def _multisteps_run(scaling, steps, k, use_copies, refresh_rule=None):
    """`steps` micro-steps of SGD under `optax.MultiSteps(every_k_schedule=k)`, the copies
    kept in the state and made again when `refresh_rule(opt_state)`; the losses and params."""
    recipe = _recipe(scaling)
    opt = optax.MultiSteps(optax.sgd(0.5), every_k_schedule=k)
    loss = mpjax.autocast(_loss_fn, fp8=recipe)
    refresh_rule = refresh_rule or (lambda state: state.mini_step == 0)

    def step(params, opt_state, copies, x):
        if use_copies:
            copies = weight_copies(
                loss, params, x, previous=copies, refresh=refresh_rule(opt_state)
            )
            value, grads = jax.value_and_grad(
                mpjax.autocast(_loss_fn, fp8=recipe, fp8_weights=copies)
            )(params, x)
        else:
            value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, copies, value

    params, data = _params(), _data(seed=3, batches=steps)
    opt_state = opt.init(params)
    copies = weight_copies(loss, params, data[0]) if use_copies else None
    step = jax.jit(step)
    losses = []
    for x in data:
        params, opt_state, copies, value = step(params, opt_state, copies, x)
        losses.append(value)
    return np.asarray(losses), params, step.trace(params, opt_state, copies, data[0]).jaxpr


@pytest.mark.parametrize("scaling", SCALINGS)
def test_multisteps_quantises_each_weight_once_per_step(scaling):
    steps, k = 6, 3
    losses, params, jaxpr = _multisteps_run(scaling, steps, k, use_copies=True)
    want_losses, want_params, plain = _multisteps_run(scaling, steps, k, use_copies=False)
    # the micro-batches of one step read the copies made at its first micro-batch: the
    # numbers of quantising the (unchanged) weights at every micro-batch
    np.testing.assert_array_equal(losses, want_losses)
    _assert_equal_trees(params, want_params)
    kernels = {(D, H), (H, D)}
    assert kernels <= set(_quantize_shapes(plain.jaxpr))  # without copies: per micro-batch
    # each kernel quantised once in the step's program, in the branch that makes copies
    in_cond = _quantize_shapes(jaxpr.jaxpr, inside="cond")
    assert in_cond == {(D, H): 1, (H, D): 1}
    assert {s: _quantize_shapes(jaxpr.jaxpr)[s] for s in kernels} == in_cond


def test_stale_copies_change_the_numbers():
    # the same run never making the copies again trains on the first weights' copies: the
    # losses part from the run above's after the first update (the refresh is what keeps
    # the test above equal)
    stale, _, _ = _multisteps_run("mxfp8", 6, 3, True, refresh_rule=lambda state: False)
    fresh, _, _ = _multisteps_run("mxfp8", 6, 3, True)
    np.testing.assert_array_equal(stale[:3], fresh[:3])
    assert not np.array_equal(stale[3:], fresh[3:])


@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_scanned_micro_batch_loop_quantises_no_weight_in_the_loop(scaling):
    recipe = _recipe(scaling)
    params, data = _params(), _data(seed=4, batches=4)
    loss = mpjax.autocast(_loss_fn, fp8=recipe)

    def accumulate(params, data, copies=None):
        grad = jax.grad(
            loss if copies is None else mpjax.autocast(_loss_fn, fp8=recipe, fp8_weights=copies)
        )

        def micro(total, x):
            return jax.tree.map(jnp.add, total, grad(params, x)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        return jax.lax.scan(micro, zeros, data)[0]

    def once(params, data):
        return accumulate(params, data, weight_copies(loss, params, data[0]))

    _assert_equal_trees(jax.jit(once)(params, data), jax.jit(accumulate)(params, data))
    in_loop = _quantize_shapes(jax.make_jaxpr(once)(params, data).jaxpr, inside="scan")
    plain_loop = _quantize_shapes(jax.make_jaxpr(accumulate)(params, data).jaxpr, inside="scan")
    assert plain_loop[(D, H)] == 1 and plain_loop[(H, D)] == 1  # without: every micro-batch
    assert (D, H) not in in_loop and (H, D) not in in_loop
    assert _quantize_shapes(jax.make_jaxpr(once)(params, data).jaxpr)[(D, H)] == 1


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(D, use_bias=False)(x)), None


class _ScannedLm(nn.Module):
    """Layers stacked by `nn.scan` (as MaxText/Gemma scan theirs), then an unscanned head."""

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return nn.Dense(H)(layers()(x, None)[0])


@pytest.mark.parametrize("scaling", SCALINGS)
def test_nn_scan_layers_read_copies_made_for_every_layer_at_once(scaling):
    model, x = _ScannedLm(), _data()
    params = model.init(jax.random.key(0), x)
    recipe = Fp8Recipe(scaling, block_lowering="emulated", high_precision_last=0)

    def loss_fn(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    loss = mpjax.autocast(loss_fn, fp8=recipe)
    copies = weight_copies(loss, params, x)
    layered = sorted(
        (c.columns.data.shape, s[3]) for s, c in zip(copies.sites, copies.copies, strict=True)
    )
    assert layered == [((3, D, D), True), ((H, D), False)]  # stacked [layers, N, K]; the head
    fast = mpjax.autocast(loss_fn, fp8=recipe, fp8_weights=copies)
    _assert_equal_trees(
        jax.jit(jax.value_and_grad(fast))(params, x), jax.jit(jax.value_and_grad(loss))(params, x)
    )
    in_scan = _quantize_shapes(jax.make_jaxpr(jax.grad(fast))(params, x).jaxpr, inside="scan")
    plain = _quantize_shapes(jax.make_jaxpr(jax.grad(loss))(params, x).jaxpr, inside="scan")
    assert plain[(D, D)] == 1 and (D, D) not in in_scan  # no layer's weight quantised in the loop
    assert in_scan[(TOKENS, D)] == plain[(TOKENS, D)]  # its x and g still are


def test_weights_over_explicit_axes_keep_their_gradient_sharding():
    recipe = Fp8Recipe("mxfp8", block_lowering="emulated")
    params = {"w": jax.random.normal(jax.random.key(2), (D, H)) * 0.1}
    x = _data()
    # float32 compute, as tests/fp8/test_block_sharded.py: XLA:CPU keeps or drops the
    # bfloat16 rounding of a GEMM's output depending on the partitioned program
    loss = mpjax.autocast(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) ** 2), "float32", fp8=recipe)

    def with_copies(params, x):
        copies = weight_copies(loss, params, x)
        return jax.value_and_grad(loss.with_fp8_weights(fp8_weights=copies))(params, x)

    unsharded = jax.jit(jax.value_and_grad(loss))(params, x)
    with jax.set_mesh(make_mesh("explicit")):
        sharded = {"w": jax.sharding.reshard(params["w"], P(None, AXIS))}
        xs = jax.sharding.reshard(x, P())
        got = jax.jit(with_copies)(sharded, xs)
        want = jax.jit(jax.value_and_grad(loss))(sharded, xs)
        assert jax.typeof(got[1]["w"]).sharding.spec == P(None, AXIS)
    _assert_equal_trees(got, want)  # the sharded step without copies, bit for bit
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(unsharded), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


def test_copies_inside_shard_map_with_check_vma_give_its_gradients():
    # data parallel: the weights and their copies replicated, the tokens split over devices
    recipe = Fp8Recipe("mxfp8", block_lowering="emulated")
    loss = mpjax.autocast(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) ** 2), "float32", fp8=recipe)
    params = {"w": jax.random.normal(jax.random.key(1), (H, H)) * 0.1}
    x = jax.random.normal(jax.random.key(0), (8 * 64, H))
    copies = weight_copies(loss, params, x[:64])

    def local(p, x, copies=None):
        fn = loss if copies is None else loss.with_fp8_weights(fp8_weights=copies)
        return jax.lax.psum(jax.grad(fn)(p, x)["w"], AXIS)

    mesh = make_mesh("explicit")
    specs = (P(), P(AXIS), P())
    with_copies = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=True)
    plain = jax.shard_map(local, mesh=mesh, in_specs=specs[:2], out_specs=P(), check_vma=True)
    with jax.set_mesh(mesh):
        xs = jax.sharding.reshard(x, P(AXIS))
        _assert_equal_trees(jax.jit(with_copies)(params, xs, copies), jax.jit(plain)(params, xs))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_weights_with_extreme_values_give_the_numbers_without_copies(scaling):
    # inf, NaN, 1e-38, 3e38 and zero blocks in the weights: the copies are the GEMM's own
    # quantisation, non-finite results in the same places
    params, x = _params(), _data()
    kernel = params["params"]["up"]["kernel"]
    kernel = kernel.at[0, 0].set(jnp.inf).at[1, 5].set(jnp.nan).at[2:34, 8].set(1e-38)
    kernel = kernel.at[40, 70].set(3e38).at[:32, 96:].set(0.0)
    params = {"params": {**params["params"], "up": {**params["params"]["up"], "kernel": kernel}}}
    loss = mpjax.autocast(_loss_fn, fp8=_recipe(scaling))
    copies = weight_copies(loss, params, x)
    fast = loss.with_fp8_weights(fp8_weights=copies)
    got = jax.jit(jax.value_and_grad(fast))(params, x)
    want = jax.jit(jax.value_and_grad(loss))(params, x)
    _assert_equal_trees(got, want)


def test_non_block_recipes_and_non_gemm_leaves_make_no_copies():
    params, x = _params(), _data()
    tensorwise = weight_copies(mpjax.autocast(_loss_fn, fp8=Fp8Recipe()), params, x)
    assert tensorwise.copies == () and tensorwise.sites == ()
    # a scalar and an empty leaf beside the kernels: only the kernels get copies
    extra = {**params, "scale": jnp.float32(2.0), "empty": jnp.zeros((0, 4))}

    def loss_fn(p, x):
        return _loss_fn({"params": p["params"]}, x) * p["scale"] + jnp.sum(p["empty"])

    loss = mpjax.autocast(loss_fn, fp8=_recipe("mxfp8"))
    copies = weight_copies(loss, extra, x)
    assert len(copies.copies) == 2
    fast = mpjax.autocast(loss_fn, fp8=_recipe("mxfp8"), fp8_weights=copies)
    _assert_equal_trees(jax.grad(fast)(extra, x), jax.grad(loss)(extra, x))


def test_bad_inputs_are_refused_by_name():
    params, x = _params(), _data()
    loss = mpjax.autocast(_loss_fn, fp8=_recipe("mxfp8"))
    copies = weight_copies(loss, params, x)
    with pytest.raises(TypeError, match="returned by mpjax.autocast"):
        weight_copies(_loss_fn, params, x)
    with pytest.raises(ValueError, match="argnum=2"):
        weight_copies(loss, params, x, argnum=2)
    with pytest.raises(ValueError, match="needs refresh="):
        weight_copies(loss, params, x, previous=copies)
    other = {"w": params["params"]["up"]["kernel"]}
    matmul = mpjax.autocast(lambda p, x: jnp.sum(x @ p["w"]), fp8=_recipe("mxfp8"))
    with pytest.raises(ValueError, match="other weights"):
        weight_copies(matmul, other, x, previous=copies, refresh=True)
    with pytest.raises(ValueError, match="need fp8="):
        mpjax.autocast(_loss_fn, fp8_weights=copies)
    with pytest.raises(ValueError, match="another structure"):
        mpjax.autocast(_loss_fn, fp8=_recipe("mxfp8"), fp8_weights=copies)(other, x)
    with pytest.raises(TypeError, match="WeightCopies"):
        mpjax.autocast(_loss_fn, fp8=_recipe("mxfp8"), fp8_weights=copies.copies)(params, x)
    dims = (((1,), (0,)), ((), ()))
    w = params["params"]["up"]["kernel"]  # [D, H]; copies.copies[1] are of [H, D]
    with pytest.raises(ValueError, match="rhs_copies"):
        block_scaled_dot_general(
            x, w, dims, _recipe("mxfp8"), jnp.float32, rhs_copies=copies.copies[1]
        )
    assert isinstance(copies, WeightCopies)
