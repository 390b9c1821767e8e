"""Issue 27: path rules name modules as the params tree does, for every way a submodule is
attached (setup, compact, `nn.Sequential`, a submodule passed in as an attribute, modules
lifted by `nn.scan`/`nn.remat`/`nn.vmap`, NNX attributes and lists); a lifted root
(`nn.vmap(Net, ...)`, as in Flax's ensemble and S5 examples) gets the policy; a path rule
that matches no module raises, naming the rule and listing the module paths."""

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

import mpjax
from mpjax.policy import module_policies

BF16 = jnp.dtype("bfloat16")
X = jnp.ones((2, 4))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return nn.Dense(4, name="fc")(x), None


class Model(nn.Module):
    attr: nn.Module  # a submodule passed in as an attribute

    def setup(self):
        self.stem = nn.Dense(4)
        self.seq = nn.Sequential([nn.Dense(4), nn.Dense(4)])

    @nn.compact
    def __call__(self, x):
        x = self.seq(self.stem(x))
        x = self.attr(x)
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        x, _ = scan(name="scanned")(x, None)
        x, _ = nn.remat(Block)(name="remat")(x)
        vmap = nn.vmap(
            Block,
            in_axes=0,
            out_axes=0,
            variable_axes={"params": None},
            split_rngs={"params": False},
        )
        x, _ = vmap(name="vm")(x)
        x = nn.Sequential([nn.Dense(4), nn.Dense(4)])(x)  # its layers are Model's Dense_0/1
        return nn.Dense(2, name="head")(x)


def _module_paths(params):
    return {"/".join(k[:-1]) for k in flax.traverse_util.flatten_dict(params)}


def test_linen_paths_as_in_the_params_tree_for_every_attachment():
    model = Model(attr=nn.Sequential([nn.Dense(4), nn.relu]))
    variables = jax.eval_shape(mpjax.apply_policy(model, "float32").init, jax.random.key(0), X)
    paths = _module_paths(variables["params"])
    chosen = ["stem", "seq/layers_1", "attr/layers_0", "scanned/fc", "remat/fc", "vm/fc", "Dense_1"]
    assert set(chosen) <= paths
    # (the scanned layer's output is a scan carry: it must leave in float32)
    rules = {p: "p=f32,c=bf16,o=f32" for p in chosen}
    policed = mpjax.apply_policy(model, rules)
    # One bfloat16 GEMM per chosen module (the scanned one once in the scan body), none
    # elsewhere; at 6a474e7 `seq/layers_1` and `attr/layers_0` stayed float32.
    dots = _dots(jax.make_jaxpr(lambda v: policed.apply(v, X))(variables).jaxpr)
    assert len(dots) == 10 and dots.count(BF16) == len(chosen), dots


def _dots(jaxpr):
    """The left-operand dtype of every `dot_general` of `jaxpr`, sub-jaxprs included."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append(e.invars[0].aval.dtype)
        for sub in jaxprs_in_params(e.params):
            out.extend(_dots(sub))
    return out


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def test_lifted_root_gets_the_policy():
    ensemble = nn.vmap(
        Net,
        in_axes=None,
        out_axes=0,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        axis_size=3,
    )
    model = mpjax.apply_policy(ensemble(), "params=float32,compute=bfloat16,output=float32")
    variables = jax.eval_shape(model.init, jax.random.key(0), X)
    closed = jax.make_jaxpr(lambda v: model.apply(v, X))(variables)
    (out,) = closed.out_avals
    assert out.shape == (3, 2, 3) and out.dtype == jnp.float32
    dots = _dots(closed.jaxpr)  # at 6a474e7: all float32
    assert len(dots) == 2 and all(d == BF16 for d in dots), dots


def test_root_sequential_layer_rule():
    """The issue's case: `{"layers_0": ...}` on an `nn.Sequential` root (6a474e7: float32)."""
    model = mpjax.apply_policy(
        nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(3)]), {"layers_0": "p=f32,c=bf16,o=f32"}
    )
    variables = jax.eval_shape(model.init, jax.random.key(0), X)
    assert _dots(jax.make_jaxpr(lambda v: model.apply(v, X))(variables).jaxpr) == [
        BF16,
        jnp.dtype("float32"),
    ]


def test_linen_rule_matching_nothing_raises_naming_rule_and_paths():
    model = mpjax.apply_policy(nn.Sequential([nn.Dense(4), nn.Dense(3)]), {"layer_0": "c=bf16"})
    with pytest.raises(ValueError, match=r"path rule 'layer_0' matches no module") as e:
        model.init(jax.random.key(0), X)
    assert "layers_0, layers_1" in str(e.value) and "did you mean 'layers_0'" in str(e.value)


class NnxModel(nnx.Module):
    def __init__(self, inner, rngs):
        self.inner = inner  # passed in as an attribute
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
        self.seq = nnx.Sequential(
            nnx.Linear(4, 4, rngs=rngs), nnx.relu, nnx.Linear(4, 4, rngs=rngs)
        )

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.seq(self.inner(x))


def test_nnx_paths_and_a_rule_matching_nothing():
    make = lambda: NnxModel(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Rngs(1))  # noqa: E731
    chosen = ["inner", "blocks/1", "seq/layers/2"]
    model = mpjax.apply_policy(make(), {p: "c=bf16" for p in chosen})
    assert {p for p, pol in module_policies(model).items() if pol.compute_dtype == BF16} == set(
        chosen
    )
    fresh = make()
    with pytest.raises(ValueError, match=r"path rule 'block/1' matches no module") as e:
        mpjax.apply_policy(fresh, {"block/1": "c=bf16"})
    assert "blocks/1" in str(e.value)
    assert module_policies(fresh) == {}  # nothing was changed before the error
