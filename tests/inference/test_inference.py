"""convert_for_inference: BatchNorm folding, policy casts, dropped state, export round trip.

Tolerances: outputs are compared with a float64 run of the original model by the
norm-wise relative error ||y - y64|| / ||y64||. float32 (fold only) must be <= 1e-5:
folding reassociates (x*k)*s into x*(k*s), a few float32 roundings per element.
bfloat16 has unit roundoff 2^-9 ~ 2e-3 per rounding (weights, activations after
every layer); through the 3 to 5 layers of these models that accumulates to a few
1e-3, so the bound is 2e-2 (float16: 2^-11, bound 5e-3).
"""

import functools
import sys
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from examples import export_inference as export_example
from mpjax import export as mx
from mpjax._src.kernels.dispatch import TRITON_DEPRECATED
from mpjax.inference import fold_batchnorm_params
from tests.helpers.inference import TOL, ConvBNNet, DenseBN, randomize_stats, reference64, rel_err

POLICY = {"float32": "f32", "bfloat16": "compute=bfloat16", "float16": "compute=float16"}
EVAL = {"train": False}


def nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def all_keys(tree, prefix=()):
    for k, v in tree.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from all_keys(v, (*prefix, k))


# ------------------------------------------------------------------------------ models


class ResNetBlock(nn.Module):
    """A bottleneck block with a strided projection shortcut."""

    features: int = 16

    @nn.compact
    def __call__(self, x, train=False):
        bn = functools.partial(nn.BatchNorm, use_running_average=not train)
        y = nn.relu(bn()(nn.Conv(self.features // 4, (1, 1), use_bias=False)(x)))
        y = nn.relu(bn()(nn.Conv(self.features // 4, (3, 3), (2, 2), use_bias=False)(y)))
        y = bn()(nn.Conv(self.features, (1, 1), use_bias=False)(y))
        shortcut = bn()(nn.Conv(self.features, (1, 1), (2, 2), use_bias=False)(x))
        return nn.relu(y + shortcut)


class SetupSequential(nn.Module):
    """Submodules from `setup`, one pair inside `nn.Sequential`."""

    def setup(self):
        self.conv = nn.Conv(8, (3, 3), use_bias=False)
        self.bn = nn.BatchNorm(use_running_average=True)
        self.seq = nn.Sequential(
            [nn.Conv(8, (3, 3)), nn.BatchNorm(use_running_average=True), nn.relu]
        )
        self.head = nn.Dense(3)

    def __call__(self, x):
        return self.head(self.seq(nn.relu(self.bn(self.conv(x)))).mean(axis=(1, 2)))


# BatchNorms that must stay unfolded, with a fragment of the reason each must report.
class BNOnInput(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Conv(8, (3, 3))(x)


class ReluBetween(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.BatchNorm(use_running_average=not train)(x)


class ResidualBetween(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        y = nn.Conv(x.shape[-1], (3, 3))(x)
        return nn.BatchNorm(use_running_average=not train)(y + x)


class OtherConsumer(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        y = nn.Conv(8, (3, 3))(x)
        return nn.BatchNorm(use_running_average=not train)(y) + jnp.tanh(y)


class SharedConv(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        conv = nn.Conv(x.shape[-1], (3, 3))
        y = nn.BatchNorm(use_running_average=not train)(conv(x))
        return nn.BatchNorm(use_running_average=not train)(conv(nn.relu(y)))


class NotChannelAxis(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        y = nn.Conv(8, (3, 3))(x)
        return nn.BatchNorm(use_running_average=not train, axis=1)(y)


UNFOLDABLE = {
    "bn_on_input": (BNOnInput, "not the direct output"),
    "relu_between": (ReluBetween, "not the direct output"),
    "residual_between": (ResidualBetween, "not the direct output"),
    "other_consumer": (OtherConsumer, "1 other consumer"),
    "shared_conv": (SharedConv, "called 2 times"),
    "not_channel_axis": (NotChannelAxis, "not the last (channel) axis"),
}


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def digits():
    """The export example's DigitsCNN trained briefly on sklearn's digits: non-trivial
    BatchNorm statistics."""
    model, trained, (x_test, y_test) = export_example.train(
        150, width=16, momentum=0.8, lr=1e-2, log=False
    )
    return model, trained, x_test, y_test


def convert(model, variables, dtype, x, **kw):
    return mpjax.convert_for_inference(
        model, variables, POLICY[dtype], example_inputs=x, apply_kwargs=EVAL, **kw
    )


def run(converted, x, use_jit):
    fn = jax.jit(converted.apply) if use_jit else converted.apply
    return fn(converted.variables, x)


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("use_jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_digits_outputs_match_float64_reference(digits, dtype, use_jit):
    model, variables, x_test, _ = digits
    x = x_test[:48]
    ref = reference64(model, variables, x, train=False)
    assert rel_err(model.apply(variables, x, train=False), ref) < 1e-5  # the fp32 model
    converted = convert(model, variables, dtype, x[:1])
    out = run(converted, x, use_jit)
    assert out.dtype == jnp.float32  # logits in float32 whatever the compute dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_digits_bn_stats_are_trained(digits):
    _, variables, _, _ = digits
    for stats in variables["batch_stats"].values():
        assert np.abs(np.asarray(stats["mean"])).max() > 1e-2
        assert np.abs(np.asarray(stats["var"]) - 1).max() > 1e-2


def test_digits_accuracy_within_half_point(digits):
    model, variables, x_test, y_test = digits
    acc32 = np.mean(np.argmax(jax.jit(model.apply)(variables, x_test), -1) == y_test)
    converted = convert(model, variables, "bfloat16", x_test[:1])
    logits = jax.jit(converted.apply)(converted.variables, x_test)
    acc16 = np.mean(np.argmax(np.asarray(logits, np.float32), -1) == y_test)
    assert acc32 > 0.9, acc32  # the model did learn
    assert abs(acc16 - acc32) <= 0.005, (acc32, acc16)


def test_digits_folded_variables(digits):
    model, variables, x_test, _ = digits
    converted = convert(model, variables, "bfloat16", x_test[:1])
    report = converted.report
    assert sorted(report.folded) == [
        ("Conv_0", "BatchNorm_0"),
        ("Conv_1", "BatchNorm_1"),
        ("Conv_2", "BatchNorm_2"),
    ]
    assert report.unfolded == ()
    assert set(converted.variables) == {"params"}  # batch_stats gone with the folds
    assert not any("BatchNorm" in k for key in all_keys(converted.variables) for k in key)
    for name in ("Conv_0", "Conv_1", "Conv_2", "Dense_0"):
        layer = converted.variables["params"][name]
        assert set(layer) == {"kernel", "bias"}  # use_bias=False convs got a bias
        assert layer["kernel"].dtype == jnp.bfloat16 and layer["bias"].dtype == jnp.bfloat16
    assert nbytes(converted.variables["params"]) <= 0.5 * nbytes(variables["params"])
    assert nbytes(converted.variables) <= 0.5 * nbytes(variables)


@pytest.mark.parametrize("use_bias", [True, False])
def test_fold_math_matches_float64(use_bias):
    rng = np.random.default_rng(3)
    c = 6
    kernel = rng.normal(size=(3, 3, 4, c))
    bias = rng.normal(size=c) if use_bias else None
    mean, var = rng.normal(size=c), rng.uniform(0.1, 3, c)
    scale, offset = rng.uniform(0.5, 2, c), rng.normal(size=c)
    s = scale / np.sqrt(var + 1e-3)
    want_k = kernel * s
    want_b = ((bias if use_bias else 0.0) - mean) * s + offset
    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
    k, b = fold_batchnorm_params(
        f32(kernel), f32(bias), f32(mean), f32(var), f32(scale), f32(offset), 1e-3
    )
    assert k.dtype == jnp.float32 and b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(k), want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(b), want_b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resnet_block(dtype):
    model = ResNetBlock()
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 8))
    variables = randomize_stats(model.init(jax.random.key(0), x), seed=0)
    converted = convert(model, variables, dtype, x[:1])
    assert len(converted.report.folded) == 4 and converted.report.unfolded == ()
    ref = reference64(model, variables, x, train=False)
    assert rel_err(jax.jit(converted.apply)(converted.variables, x), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_batchnorm_folds(dtype):
    model = DenseBN()
    x = jax.random.normal(jax.random.key(1), (16, 12))
    variables = randomize_stats(model.init(jax.random.key(0), x), seed=1)
    converted = convert(model, variables, dtype, x[:1])
    assert sorted(converted.report.folded) == [
        ("Dense_0", "BatchNorm_0"),
        ("Dense_1", "BatchNorm_1"),
    ]
    params = converted.variables["params"]
    assert "bias" in params["Dense_1"]  # use_bias=False layer carries the folded shift
    assert all(v.dtype == jnp.float32 for v in params["LayerNorm_0"].values())
    ref = reference64(model, variables, x, train=False)
    assert rel_err(converted(x), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_setup_and_sequential_models_fold(dtype):
    model = SetupSequential()
    x = jax.random.normal(jax.random.key(1), (3, 6, 6, 3))
    variables = randomize_stats(model.init(jax.random.key(0), x), seed=6)
    converted = mpjax.convert_for_inference(model, variables, POLICY[dtype], example_inputs=x[:1])
    assert sorted(converted.report.folded) == [("conv", "bn"), ("seq/layers_0", "seq/layers_1")]
    assert set(converted.variables["params"]["seq"]) == {"layers_0"}
    ref = reference64(model, variables, x)
    assert rel_err(converted(x), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(UNFOLDABLE))
def test_unfoldable_batchnorm_left_in_place(case, dtype):
    cls, reason = UNFOLDABLE[case]
    model = cls()
    x = jax.random.normal(jax.random.key(1), (3, 6, 6, 8))
    variables = randomize_stats(model.init(jax.random.key(0), x), seed=2)
    converted = convert(model, variables, dtype, x[:1])
    assert converted.report.folded == ()
    assert converted.report.unfolded and all(reason in why for _, why in converted.report.unfolded)
    for bn, _ in converted.report.unfolded:
        for leaf in jax.tree.leaves(converted.variables["batch_stats"][bn]):
            assert leaf.dtype == jnp.float32
        for leaf in jax.tree.leaves(converted.variables["params"][bn]):
            assert leaf.dtype == jnp.float32
    ref = reference64(model, variables, x, train=False)
    assert rel_err(jax.jit(converted.apply)(converted.variables, x), ref) < TOL[dtype]


@pytest.mark.parametrize("how", ["wrapped", "rules"])
def test_apply_policy_rules(how):
    model = ResNetBlock()
    x = jax.random.normal(jax.random.key(1), (3, 8, 8, 8))
    variables = randomize_stats(model.init(jax.random.key(0), x), seed=7)
    rules = {"*": "p=f32,c=bf16", "Conv_3": "f32"}  # the shortcut conv stays float32
    if how == "wrapped":
        converted = mpjax.convert_for_inference(
            mpjax.apply_policy(model, rules), variables, example_inputs=x[:1], apply_kwargs=EVAL
        )
    else:
        converted = mpjax.convert_for_inference(
            model, variables, rules, example_inputs=x[:1], apply_kwargs=EVAL
        )
    assert len(converted.report.folded) == 4
    params = converted.variables["params"]
    assert set(converted.variables) == {"params"}
    for name in ("Conv_0", "Conv_1", "Conv_2"):
        assert {v.dtype for v in params[name].values()} == {jnp.dtype(jnp.bfloat16)}
    assert {v.dtype for v in params["Conv_3"].values()} == {jnp.dtype(jnp.float32)}
    out = jax.jit(converted.apply)(converted.variables, x)
    assert out.dtype == jnp.float32  # apply_policy's default: the root's outputs in float32
    ref = reference64(model, variables, x, train=False)
    assert rel_err(out, ref) < TOL["bfloat16"]


def test_apply_policy_wrapped_model_refuses_a_second_policy():
    model = mpjax.apply_policy(DenseBN(), "c=bf16")
    x = jnp.ones((2, 12))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="wrapped by apply_policy"):
        mpjax.convert_for_inference(model, variables, "f32", example_inputs=x, apply_kwargs=EVAL)


CONVBN_FOLDS = [(f"ConvBN_{i}/conv", f"ConvBN_{i}") for i in range(4)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convbn_folds_into_the_fused_epilogue(dtype):
    model = ConvBNNet()
    x = jax.random.normal(jax.random.key(1), (3, 3, 6, 6))  # NCHW
    variables = randomize_stats(model.init(jax.random.key(0), x, train=True), seed=8)
    converted = convert(model, variables, dtype, x[:1])
    assert sorted(converted.report.folded) == CONVBN_FOLDS
    assert set(converted.variables) == {"params"}
    for i in range(4):
        layer = converted.variables["params"][f"ConvBN_{i}"]
        assert set(layer) == {"conv", "bias"}  # BatchNorm scale gone, shift kept
        assert set(layer["conv"]) == {"kernel"}
        assert layer["conv"]["kernel"].dtype == jnp.dtype(dtype)
        assert layer["bias"].dtype == jnp.float32  # the epilogue adds it in float32
    ref = reference64(model, variables, x, train=False)
    assert rel_err(jax.jit(converted.apply)(converted.variables, x), ref) < TOL[dtype]


def test_convbn_epilogue_is_the_pallas_kernel():
    model = ConvBNNet(impl="interpret")  # the Pallas kernel body, runnable on CPU
    x = jax.random.normal(jax.random.key(1), (2, 3, 6, 6))
    variables = randomize_stats(model.init(jax.random.key(0), x, train=True), seed=9)
    converted = convert(model, variables, "bfloat16", x[:1])
    jaxpr = str(jax.make_jaxpr(converted.apply)(converted.variables, x))
    assert jaxpr.count("pallas_call") == 4  # one fused epilogue per folded ConvBN
    ref = reference64(ConvBNNet(impl="xla"), variables, x, train=False)
    assert rel_err(converted(x), ref) < TOL["bfloat16"]
    xla = convert(model, variables, "bfloat16", x[:1], epilogue_impl="xla")
    assert "pallas_call" not in str(jax.make_jaxpr(xla.apply)(xla.variables, x))
    with pytest.raises(ValueError, match="epilogue_impl"):
        convert(model, variables, "bfloat16", x[:1], epilogue_impl="triton")


def test_convbn_unfolded_and_under_apply_policy():
    model = ConvBNNet()
    x = jax.random.normal(jax.random.key(1), (2, 3, 6, 6))
    variables = randomize_stats(model.init(jax.random.key(0), x, train=True), seed=10)
    ref = reference64(model, variables, x, train=False)
    kept = convert(model, variables, "bfloat16", x[:1], fold_batchnorm=False)
    assert kept.report.folded == () and len(kept.report.unfolded) == 4
    assert kept.variables["params"]["ConvBN_0"]["scale"].dtype == jnp.float32
    assert rel_err(kept(x), ref) < TOL["bfloat16"]
    ruled = mpjax.convert_for_inference(
        mpjax.apply_policy(model, "p=f32,c=bf16"), variables, example_inputs=x, apply_kwargs=EVAL
    )
    assert sorted(ruled.report.folded) == CONVBN_FOLDS
    assert ruled.variables["params"]["ConvBN_1"]["conv"]["kernel"].dtype == jnp.bfloat16
    assert rel_err(ruled(x), ref) < TOL["bfloat16"]
    with pytest.raises(ValueError, match="ConvBN_0.*training mode"):
        mpjax.convert_for_inference(
            model, variables, example_inputs=x, apply_kwargs={"train": True}
        )


def test_fold_batchnorm_false_only_casts():
    model = ResNetBlock()
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 8))
    variables = randomize_stats(model.init(jax.random.key(0), x), seed=3)
    converted = convert(model, variables, "bfloat16", x[:1], fold_batchnorm=False)
    assert converted.report.folded == ()
    assert len(converted.report.unfolded) == 4
    assert set(converted.variables["batch_stats"]) == set(variables["batch_stats"])
    ref = reference64(model, variables, x, train=False)
    assert rel_err(converted(x), ref) < TOL["bfloat16"]


def test_training_only_collections_dropped():
    model = ReluBetween()
    x = jax.random.normal(jax.random.key(1), (2, 6, 6, 3))
    variables = dict(randomize_stats(model.init(jax.random.key(0), x), seed=4))
    variables["intermediates"] = {"Conv_0": {"__call__": (jnp.ones((2, 6, 6, 8)),)}}
    converted = convert(model, variables, "bfloat16", x[:1])
    assert set(converted.variables) == {"params", "batch_stats"}  # unfolded BN keeps its stats


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_inputs_propagate_like_the_original(where, bad):
    model = ResNetBlock()
    x = np.asarray(jax.random.normal(jax.random.key(1), (3, 8, 8, 8)))
    variables = randomize_stats(model.init(jax.random.key(0), x), seed=5)
    flat = x.reshape(-1).copy()
    flat[{"first": 0, "middle": flat.size // 2, "last": -1}[where]] = bad
    x = flat.reshape(x.shape)
    converted = convert(model, variables, "bfloat16", x[:1])
    want = np.isfinite(np.asarray(model.apply(variables, x, train=False)))
    got = np.isfinite(np.asarray(jax.jit(converted.apply)(converted.variables, x), np.float32))
    assert not want.all()
    np.testing.assert_array_equal(got, want)


def test_bad_input_errors():
    model = DenseBN()
    x = jnp.ones((2, 12))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="BatchNorm_0.*training mode"):
        mpjax.convert_for_inference(
            model, variables, example_inputs=x, apply_kwargs={"train": True}
        )
    with pytest.raises(TypeError, match="flax.linen Module"):
        mpjax.convert_for_inference(lambda v, x: x, variables, example_inputs=x)
    with pytest.raises(ValueError, match="'params' collection"):
        mpjax.convert_for_inference(model, {"batch_stats": {}}, example_inputs=x)
    with pytest.raises(ValueError, match="unknown dtype 'bf17'"):
        mpjax.convert_for_inference(model, variables, "compute=bf17", example_inputs=x)


# ------------------------------------------------------------------------------ export


def test_export_round_trip_cpu_and_cuda(digits):
    model, variables, x_test, _ = digits
    converted = convert(model, variables, "bfloat16", x_test[:1])
    x = x_test[:8]
    blob = mx.serialize_inference(converted, x, platforms=("cpu", "cuda"))
    assert isinstance(blob, bytes)
    loaded = mx.load_inference(blob)
    assert loaded.platforms == ("cpu", "cuda")
    assert loaded.policy == str(converted.policy)
    got = loaded(x)
    assert got.dtype == jnp.float32
    chex.assert_trees_all_equal(got, jax.jit(converted.apply)(converted.variables, x))


def test_export_cuda_only_and_polymorphic_batch(digits):
    model, variables, x_test, _ = digits
    converted = convert(model, variables, "bfloat16", x_test[:1])
    cuda = mx.load_inference(mx.serialize_inference(converted, x_test[:1], platforms=["cuda"]))
    assert cuda.platforms == ("cuda",)
    with pytest.raises(ValueError, match="cuda"):
        cuda(x_test[:1])  # lowered for CUDA only: refuses to run on this CPU
    poly = mx.load_inference(mx.serialize_inference(converted, x_test[:1], polymorphic_batch=True))
    for n in (3, 5):
        chex.assert_trees_all_equal(
            poly(x_test[:n]), jax.jit(converted.apply)(converted.variables, x_test[:n])
        )
    with pytest.raises(ValueError, match="not an mpjax inference artifact"):
        mx.load_inference(b"not an artifact")


def test_export_convbn_per_platform():
    model = ConvBNNet()
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 3, 6, 6)))
    variables = randomize_stats(model.init(jax.random.key(0), x, train=True), seed=11)
    converted = convert(model, variables, "bfloat16", x[:1])  # epilogue_impl "auto"
    pallas = convert(model, variables, "bfloat16", x[:1], epilogue_impl="pallas")
    # from this CPU machine (jax >= 0.11: for an abstract GPU device, which mpjax names)
    cuda = mx.load_inference(mx.serialize_inference(pallas, x, platforms=["cuda"]))
    assert cuda.platforms == ("cuda",)
    assert "triton" in cuda.exported.mlir_module()  # the fused epilogue, as a Triton kernel
    # "auto" lowers the kernel for CUDA only where JAX does not deprecate the Triton backend,
    # and then with no DeprecationWarning on any jax
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        auto = mx.load_inference(mx.serialize_inference(converted, x, platforms=["cuda"]))
    assert ("triton" in auto.exported.mlir_module()) == (not TRITON_DEPRECATED)
    cpu = mx.load_inference(mx.serialize_inference(converted, x, platforms=["cpu"]))
    chex.assert_trees_all_equal(cpu(x), jax.jit(converted.apply)(converted.variables, x))
    with pytest.raises(ValueError, match="one artifact per platform"):
        mx.serialize_inference(pallas, x, platforms=("cpu", "cuda"))
    xla = convert(model, variables, "bfloat16", x[:1], epilogue_impl="xla")
    both = mx.load_inference(mx.serialize_inference(xla, x, platforms=("cpu", "cuda")))
    chex.assert_trees_all_equal(both(x), jax.jit(xla.apply)(xla.variables, x))


CLI_MODEL = """
import flax.linen as nn
import jax


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.BatchNorm(use_running_average=not train)(nn.Conv(4, (3, 3))(x))
        return nn.Dense(2)(nn.relu(x).mean(axis=(1, 2)))


def load():
    model = Net()
    return model, model.init(jax.random.key(0), jax.numpy.ones((1, 6, 6, 3)))
"""


def test_export_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / "mpjax_cli_model.py").write_text(CLI_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "net.mpjax"
    rc = mx.main(
        [
            "mpjax_cli_model:load",
            "--input-shape=2,6,6,3",
            "--platforms=cpu,cuda",
            '--apply-kwargs={"train": false}',
            "--output-dtype=policy",
            f"--out={out}",
        ]
    )
    sys.modules.pop("mpjax_cli_model", None)
    assert rc == 0
    text = capsys.readouterr().out
    assert "folded   BatchNorm_0 into Conv_0" in text
    assert "max |diff| vs converted 0.0" in text
    loaded = mx.load_inference(out.read_bytes())
    assert loaded.platforms == ("cpu", "cuda")
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype(np.float32)
    assert loaded(x).shape == (2, 2) and loaded(x).dtype == jnp.bfloat16  # the policy's
