"""`Policy.reduce_dtype`: the dtype gradients are summed across devices in (8 CPU devices)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.analysis.collectives import collectives
from tests.helpers.gpu import _run_json
from tests.helpers.models import TanhMLP

WIDTH, BATCH, LAYERS = 64, 512, 3
HLO_DTYPE = {None: "f16", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _mesh():
    return Mesh(np.array(jax.devices()[:8]), ("fsdp",))


def _data():
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (BATCH, WIDTH), jnp.float32)
    return x, y


def _linen_step(policy: str):
    model = mpjax.apply_policy(TanhMLP(WIDTH, LAYERS), policy)
    x, y = _data()
    params = TanhMLP(WIDTH, LAYERS).init(jax.random.key(0), x)["params"]

    def loss(p, x, y):
        out = model.apply({"params": p}, x).astype(jnp.float32)
        return 2.0**12 * jnp.mean((out - y) ** 2)

    return jax.grad(loss), params, (x, y)


def _compile(grad, params, batch):
    mesh = _mesh()
    ps = jax.tree.map(lambda _: NamedSharding(mesh, P("fsdp")), params)
    xs = NamedSharding(mesh, P("fsdp"))
    fn = jax.jit(grad, in_shardings=(ps, xs, xs), out_shardings=ps)
    return fn, fn.lower(params, *batch).compile()


def _gradient_reductions(compiled) -> list:
    """The all-reduces / reduce-scatters of kernel-sized arrays (the weight gradients)."""
    return [
        c
        for c in collectives(compiled.as_text())
        if c.op in ("all-reduce", "reduce-scatter") and int(np.prod(c.shape)) == WIDTH * WIDTH
    ]


def _f64_grads(params, batch):
    """The loss's gradient in float64 NumPy (forward and backward by hand)."""
    ws = [np.asarray(params[f"Dense_{i}"]["kernel"], np.float64) for i in range(LAYERS)]
    x, y = (np.asarray(a, np.float64) for a in batch)
    hs = [x]
    for w in ws:
        hs.append(np.tanh(hs[-1] @ w))
    dh = 2.0**12 * 2 * (hs[-1] - y) / y.size
    grads = {}
    for i in reversed(range(LAYERS)):
        dz = dh * (1 - hs[i + 1] ** 2)
        grads[f"Dense_{i}"] = {"kernel": hs[i].T @ dz}
        dh = dz @ ws[i].T
    return grads


def _rel_err(got, want) -> float:
    g = np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(got)])
    w = np.concatenate([np.ravel(a) for a in jax.tree.leaves(want)])
    return float(np.linalg.norm(g - w) / np.linalg.norm(w))


@pytest.mark.parametrize("reduce", [None, "float32", "float16", "bfloat16"])
def test_linen_gradient_reduction_dtype_is_the_policys(reduce):
    policy = "p=f32,c=f16,o=f32" + (f",reduce={reduce}" if reduce else "")
    grad, params, batch = _linen_step(policy)
    fn, compiled = _compile(grad, params, batch)
    reductions = _gradient_reductions(compiled)
    assert len(reductions) >= LAYERS, [c[:3] for c in collectives(compiled.as_text())]
    want = HLO_DTYPE[reduce]
    if reduce == "bfloat16" and jax.default_backend() == "cpu":
        # XLA:CPU promotes bf16 all-reduces to f32; the GEMM result is bf16 (checked below).
        want = "f32"
    assert {c.dtype for c in reductions} == {want}
    err = _rel_err(fn(params, *batch), _f64_grads(params, batch))
    assert err < (2e-2 if reduce == "bfloat16" else 5e-3), err


def test_bfloat16_reduce_rounds_the_weight_gradient_gemm_to_bfloat16():
    """On CPU the collective is promoted; the HLO still rounds the partial sums to bf16."""
    grad, params, batch = _linen_step("p=f32,c=f16,o=f32,reduce=bf16")
    hlo = jax.jit(grad).lower(params, *batch).as_text()
    gemms = re.findall(r"stablehlo.dot_general .*-> tensor<64x64x(\w+)>", hlo)
    assert sorted(gemms) == ["bf16"] * LAYERS


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs) for _ in range(LAYERS)]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


@pytest.mark.parametrize("reduce", [None, "float32"])
def test_nnx_gradient_reduction_dtype_is_the_policys(reduce):
    policy = "p=f32,c=f16,o=f32" + (f",reduce={reduce}" if reduce else "")
    model = mpjax.apply_policy(NNXMLP(nnx.Rngs(0)), policy)
    graphdef, params = nnx.split(model)
    x, y = _data()

    def loss(p, x, y):
        out = nnx.merge(graphdef, p)(x).astype(jnp.float32)
        return 2.0**12 * jnp.mean((out - y) ** 2)

    _, compiled = _compile(jax.grad(loss), params, (x, y))
    reductions = _gradient_reductions(compiled)
    assert len(reductions) >= LAYERS
    assert {c.dtype for c in reductions} == {HLO_DTYPE[reduce]}


def test_single_device_forward_program_is_unchanged():
    """The forward pass (no gradient) is the same program with and without reduce_dtype."""
    x, _ = _data()
    params = TanhMLP(WIDTH, LAYERS).init(jax.random.key(0), x)["params"]
    texts = [
        jax.jit(mpjax.apply_policy(TanhMLP(WIDTH, LAYERS), p).apply)
        .lower({"params": params}, x)
        .as_text()
        for p in ("p=f32,c=f16,o=f32", "p=f32,c=f16,o=f32,reduce=f32")
    ]
    strip = [t.split("\n", 1)[1] for t in texts]  # the module name line differs
    assert strip[0] == strip[1]


def _plain_mlp(params, x):
    for i in range(LAYERS):
        x = jnp.tanh(x @ params[f"Dense_{i}"]["kernel"])
    return x


@pytest.mark.parametrize("reduce", [None, "float32", "float16"])
def test_autocast_gradient_reduction_dtype_is_the_policys(reduce):
    policy = "p=f32,c=f16,o=f32" + (f",reduce={reduce}" if reduce else "")
    fwd = mpjax.autocast(_plain_mlp, policy)
    x, y = _data()
    params = TanhMLP(WIDTH, LAYERS).init(jax.random.key(0), x)["params"]

    def loss(p, x, y):
        return 2.0**12 * jnp.mean((fwd(p, x).astype(jnp.float32) - y) ** 2)

    fn, compiled = _compile(jax.grad(loss), params, (x, y))
    reductions = _gradient_reductions(compiled)
    assert len(reductions) >= LAYERS
    assert {c.dtype for c in reductions} == {HLO_DTYPE[reduce]}
    assert _rel_err(fn(params, x, y), _f64_grads(params, (x, y))) < 5e-3


def test_h100_gradient_reductions_have_the_policys_dtype(tmp_path):
    """On 8 deviceless H100s: the weight-gradient reduce-scatters run in the chosen dtype."""
    got = _run_json("tests/flax/_reduce_dtype_h100.py", tmp=tmp_path)
    want = {"r=f32": "f32", "r=bf16": "bf16"}
    for name, dtypes in got.items():
        policy = name.split(" ", 1)[1]
        compute = "f16" if "c=f16" in policy else "bf16"
        reduce = policy.rsplit(",", 1)[1]
        assert len(dtypes) >= LAYERS, name
        assert set(dtypes) == {want.get(reduce, compute)}, (name, dtypes)


def test_guide_code_blocks_run(capsys):
    """docs/guides/sharding_dtypes.md's ```python blocks run as written (8 CPU devices)."""
    guide = Path(__file__).resolve().parents[2] / "docs" / "guides" / "sharding_dtypes.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], guide.name, "exec"), {"__name__": "guide"})
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "['f16']",
        "['f32']",
        "params=float32,compute=float16,output=float16,reduce=float32",
    ]
