"""The steps of `convert_for_inference` one by one (trace, cast, fold, assemble), and the
dtype its outputs leave in."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
from mpjax._src.inference.fold import fold_batchnorm_params, fold_variables
from mpjax._src.inference.steps import ConversionPlan, assemble, cast_variables, trace_conversion
from tests.helpers.inference import TOL, ConvBNNet, DenseBN, randomize_stats, reference64, rel_err

F32, BF16, F16 = jnp.dtype("float32"), jnp.dtype("bfloat16"), jnp.dtype("float16")
EVAL = {"train": False}


def dense_setup(seed=0):
    model = DenseBN()
    x = jax.random.normal(jax.random.key(seed), (16, 12)) * 2.0
    variables = randomize_stats(jax.jit(model.init)(jax.random.key(seed + 1), x), seed=seed + 2)
    return model, variables, x


def dtypes(tree):
    return {jax.tree_util.keystr(p): jnp.dtype(v.dtype) for p, v in jax.tree.leaves_with_path(tree)}


def plan_for(policy="compute=bfloat16", **kw):
    model, variables, x = dense_setup()
    return trace_conversion(model, variables, policy, x[:1], apply_kwargs=EVAL, **kw), x


# ----------------------------------------------------------------------------- 1. trace


def test_trace_conversion_plans_pairs_dtypes_and_output():
    plan, _ = plan_for()
    assert isinstance(plan, ConversionPlan)
    assert plan.trace.pairs == {("BatchNorm_0",): ("Dense_0",), ("BatchNorm_1",): ("Dense_1",)}
    assert plan.param_dtype(("Dense_0",)) == BF16 and plan.param_dtype(("Dense_2",)) == BF16
    assert plan.param_dtype(("LayerNorm_0",)) == F32 and plan.norm_dtype == F32
    assert plan.output_dtype == F32 and plan.policy.output_dtype == F32
    assert plan.policy.compute_dtype == BF16 and plan.rules is None
    keep, _ = plan_for(output_dtype=None)
    assert keep.output_dtype == BF16 and keep.policy == mpjax.get_policy("compute=bfloat16")
    unfolded, _ = plan_for(fold_batchnorm=False)
    assert unfolded.trace.pairs == {}


def test_trace_conversion_under_rules():
    rules = {"*": "compute=bfloat16", "Dense_2": "f32"}
    plan, _ = plan_for(rules)
    assert plan.rules is not None and plan.norm_dtype == F32
    assert plan.param_dtype(("Dense_0",)) == BF16 and plan.param_dtype(("Dense_2",)) == F32
    assert plan.policy.output_dtype == F32 and plan.output_dtype == F32


# ----------------------------------------------------------------------------- 2. cast


def test_cast_variables_stores_each_module_in_its_dtype_and_leaves_the_original():
    plan, _ = plan_for(fold_batchnorm=False)
    before = dtypes(plan.variables)
    params, stats = cast_variables(plan)
    for path, dtype in dtypes(params).items():
        want = F32 if ("LayerNorm" in path or "BatchNorm" in path) else BF16
        assert dtype == want, path
    assert set(dtypes(stats).values()) == {F32}
    assert dtypes(plan.variables) == before  # nothing modified in place
    np.testing.assert_array_equal(
        np.asarray(params["Dense_0"]["kernel"], np.float32),
        np.asarray(plan.variables["params"]["Dense_0"]["kernel"].astype(BF16), np.float32),
    )


# ----------------------------------------------------------------------------- 3. fold


def test_fold_variables_folds_from_the_float32_originals():
    plan, _ = plan_for()
    params, stats = cast_variables(plan)
    snapshot = jax.tree.map(lambda a: a, (params, stats))
    folded, folded_stats = fold_variables(plan, params, stats)
    assert not any(k.startswith("BatchNorm") for k in folded) and folded_stats == {}
    src = plan.variables
    kernel, bias = fold_batchnorm_params(
        src["params"]["Dense_1"]["kernel"],
        None,  # Dense_1 has use_bias=False
        src["batch_stats"]["BatchNorm_1"]["mean"],
        src["batch_stats"]["BatchNorm_1"]["var"],
        src["params"]["BatchNorm_1"]["scale"],
        src["params"]["BatchNorm_1"]["bias"],
        nn.BatchNorm.epsilon,
    )
    chex.assert_trees_all_equal(
        folded["Dense_1"], {"kernel": kernel.astype(BF16), "bias": bias.astype(BF16)}
    )
    chex.assert_trees_all_equal((params, stats), snapshot)  # inputs untouched
    assert "BatchNorm_0" in params and "BatchNorm_0" in stats


def test_fold_variables_keeps_the_convbn_shift_in_float32():
    model = ConvBNNet(impl="xla")
    x = np.asarray(jax.random.normal(jax.random.key(3), (2, 3, 6, 6)))
    rng = np.random.default_rng(4)
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)  # no compile of the init
    variables = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), s.dtype), shapes)
    variables = randomize_stats(variables, seed=5)
    plan = trace_conversion(model, variables, "compute=bfloat16", x[:1], apply_kwargs=EVAL)
    params, stats = fold_variables(plan, *cast_variables(plan))
    for name in ("ConvBN_0", "ConvBN_1", "ConvBN_2", "ConvBN_3"):
        assert params[name]["conv"]["kernel"].dtype == BF16
        assert params[name]["bias"].dtype == F32 and "scale" not in params[name]
    assert stats == {}


# ----------------------------------------------------------------------------- 4. assemble


@pytest.mark.parametrize("fold", [True, False])
def test_steps_compose_to_convert_for_inference(fold):
    model, variables, x = dense_setup(seed=4)
    plan = trace_conversion(
        model, variables, "compute=bfloat16", x[:1], apply_kwargs=EVAL, fold_batchnorm=fold
    )
    params, stats = cast_variables(plan)
    if fold:
        params, stats = fold_variables(plan, params, stats)
    ours = assemble(plan, params, stats)
    theirs = mpjax.convert_for_inference(
        model,
        variables,
        "compute=bfloat16",
        example_inputs=x[:1],
        apply_kwargs=EVAL,
        fold_batchnorm=fold,
    )
    chex.assert_trees_all_equal(ours.variables, theirs.variables)
    chex.assert_trees_all_equal(ours(x), theirs(x))
    assert ours.policy == theirs.policy and ours.report == theirs.report
    assert ("batch_stats" in ours.variables) == (not fold)  # read only when not folded


# ----------------------------------------------------------------------------- output dtype


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_outputs_are_float32_by_default(compute):
    """The issue's case: a `compute=bfloat16` conversion returned bfloat16 logits."""
    model, variables, x = dense_setup(seed=6)
    infer = mpjax.convert_for_inference(
        model, variables, f"compute={compute}", example_inputs=x[:1], apply_kwargs=EVAL
    )
    out = jax.jit(infer.apply)(infer.variables, x)
    assert out.dtype == F32 and infer.policy.output_dtype == F32
    assert str(infer.policy) == f"params=float32,compute={compute},output=float32"
    assert rel_err(out, reference64(model, variables, x, train=False)) < TOL[compute]


@pytest.mark.parametrize(
    "policy, output_dtype, want",
    [
        ("compute=bfloat16", None, BF16),
        ("compute=float16", None, F16),
        ("p=f32,c=bf16,o=f32", None, F32),
        ("compute=bfloat16", "float16", F16),
        ("f32", jnp.bfloat16, BF16),
        ({"*": "compute=bfloat16"}, None, F32),  # apply_policy's defaults: float32 logits
        ({"*": "compute=bfloat16"}, "bfloat16", BF16),
    ],
)
def test_output_dtype_parameter(policy, output_dtype, want):
    model, variables, x = dense_setup(seed=7)
    infer = mpjax.convert_for_inference(
        model, variables, policy, example_inputs=x[:1], apply_kwargs=EVAL, output_dtype=output_dtype
    )
    out = infer(x)
    assert out.dtype == want and infer.policy.output_dtype == want
    ref = reference64(model, variables, x, train=False)
    low = {infer.policy.compute_dtype.name, want.name} - {"float32"}
    assert rel_err(out, ref) < max([TOL["float32"], *(TOL[name] for name in low)])


def test_bad_output_dtype_is_named():
    model, variables, x = dense_setup()
    with pytest.raises(ValueError, match="output_dtype: int32 is not a floating dtype"):
        mpjax.convert_for_inference(
            model, variables, example_inputs=x[:1], apply_kwargs=EVAL, output_dtype=jnp.int32
        )
