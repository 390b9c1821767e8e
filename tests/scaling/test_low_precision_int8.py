"""8-bit optimizer state: `low_precision_state(inner, jnp.int8)` and its blockwise codes.

Blocks run along each leaf's last axis; nearest rounding picks the nearest value of the
decade code of each element (checked against the code written from its spec in float64),
computed arithmetically (no gather, no search); under 8-device FSDP the int8 step has the
bf16-state step's collectives and no other;
stochastic rounding is unbiased and deterministic given the seed; the state takes
1 + 4 / block_size bytes per moment element (6.03 bytes per param of AdamW state with bf16
params and remainders); it trains adam, adamw, lion and adafactor; inside `loss_scaled` a
skipped step leaves it bit-identical, and a resumed run is bitwise identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
from mpjax._src.analysis.collectives import collectives
from mpjax._src.scaling.blockwise8 import CODEBOOK, Blockwise8, dequantize, quantize
from tests.helpers.optim import LP_INNERS
from tests.helpers.optim import apply_update as _apply
from tests.helpers.optim import assert_bits_equal as _assert_bits_equal
from tests.helpers.optim import quadratic_run as _quadratic_run


def _moments(n: int, seed: int) -> np.ndarray:
    """Signed values spanning eight decades, zeros, and a ragged last block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 0, n)
    x[:3] = [0.0, -0.0, 0.0]
    return x.astype(np.float32)


def _spec_code() -> np.ndarray:
    """The 128 magnitudes in float64 from the spec: zero, then decade k = 6 .. 0 holding
    2 ** (6 - k) points 10**-k * (0.1 + 0.9 * (j + 1) / n)."""
    mags = [0.0]
    for k in range(6, -1, -1):
        n = 2 ** (6 - k)
        mags += [10.0**-k * (0.1 + 0.9 * (j + 1) / n) for j in range(n)]
    return np.asarray(mags)


def test_codebook_is_dense_near_the_top_and_spans_six_decades():
    assert CODEBOOK.shape == (128,) and CODEBOOK[0] == 0.0 and CODEBOOK[-1] == 1.0
    assert (np.diff(CODEBOOK) > 0).all()
    assert CODEBOOK[1] == pytest.approx(1e-6)
    assert ((CODEBOOK > 0.1) & (CODEBOOK <= 1.0)).sum() == 64
    # the arithmetic decode of every code is the spec's magnitude, to float32 rounding
    codes = jnp.arange(-127, 128, dtype=jnp.int8).reshape(1, -1)
    got = np.asarray(dequantize(Blockwise8(codes, jnp.ones((1, 1))), (1, 255), 255), np.float64)
    spec = _spec_code()
    want = np.concatenate([-spec[:0:-1], spec])
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=0)


def test_quantize_and_dequantize_have_no_gather_or_search():
    """The code is computed with elementwise arithmetic (the old one: searchsorted + gathers)."""
    x = jnp.ones((64, 48), jnp.float32)
    for fn, arg in ((quantize, x), (lambda q: dequantize(q, x.shape), quantize(x))):
        text = str(jax.make_jaxpr(fn)(arg))
        for primitive in ("gather", "sort", "searchsorted", "while", "scatter"):
            assert primitive not in text, (primitive, text)


def _reference_nearest(x: np.ndarray, block: int) -> tuple:
    """float64: each block (along the last axis) scaled by its absmax, and the distance to
    the nearest spec code of each element (times the scale)."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    pad = (-rows.shape[1]) % block
    blocks = np.pad(rows, ((0, 0), (0, pad))).reshape(rows.shape[0], -1, block)
    scale = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(scale > 0, scale, 1.0)
    scale = np.broadcast_to(scale, blocks.shape).reshape(rows.shape[0], -1)[:, : rows.shape[1]]
    spec = _spec_code()
    best = np.abs(np.abs(rows)[..., None] - spec * scale[..., None]).min(-1)
    return rows, scale, best


@pytest.mark.parametrize(
    ("block_size", "jit"), [(256, True), (10, True), (7, False)], ids=["256", "10", "7-eager"]
)
def test_nearest_picks_the_nearest_code_of_each_element(block_size, jit):
    x = _moments(1000, 0).reshape(40, 25)
    q = (jax.jit(quantize, static_argnums=1) if jit else quantize)(jnp.asarray(x), block_size)
    block = min(block_size, 25)
    assert q.codes.dtype == jnp.int8 and q.codes.shape == x.shape
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (40, -(-25 // block))
    got = np.asarray(dequantize(q, x.shape, block_size)).astype(np.float64)
    rows, scale, best = _reference_nearest(x, block)
    err = np.abs(got - rows)
    assert (err <= best + 1e-6 * scale).all()  # the nearest, up to float32 rounding
    top = np.abs(rows) >= 0.1 * scale  # the top decade: steps of 0.9 / 64 of the scale
    assert (err[top] <= (0.45 / 64 + 1e-6) * scale[top]).all()
    # each block's largest element is kept exactly (its scale is the code 1.0)
    peaks = np.abs(rows) == scale
    np.testing.assert_array_equal(got[peaks], rows[peaks])
    assert (np.sign(got) == np.sign(rows))[got != 0].all()


def test_old_flattened_checkpoints_are_read_and_a_mismatch_fails_loudly():
    """State written with 256-element blocks of the flattened leaf (mpjax before the
    last-axis layout) dequantizes as it was written; scales of neither layout raise."""
    rng = np.random.default_rng(3)
    codes = rng.integers(-127, 128, (12, 50)).astype(np.int8)
    scales = rng.uniform(0.5, 2.0, 3).astype(np.float32)  # ceil(600 / 256) flat blocks
    got = dequantize(Blockwise8(jnp.asarray(codes), jnp.asarray(scales)), (12, 50), 256)
    spec = _spec_code()
    flat = codes.reshape(-1).astype(np.int64)
    want = np.sign(flat) * spec[np.abs(flat)] * scales[np.arange(flat.size) // 256]
    np.testing.assert_allclose(np.asarray(got, np.float64).reshape(-1), want, rtol=1e-6)
    with pytest.raises(ValueError, match=r"scales of shape \(5,\).*expected \(12, 1\)"):
        dequantize(Blockwise8(jnp.asarray(codes), jnp.ones((5,))), (12, 50), 256)


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = _moments(256, 1)
    key = jnp.asarray(x)
    draw = jax.jit(jax.vmap(lambda s: dequantize(quantize(key, 256, s), x.shape, 256)))
    draws = np.asarray(draw(jnp.arange(1500, dtype=jnp.uint32)), np.float64)
    # a draw is one of the two codes around x; their mean is x within 5 standard errors
    scale = np.abs(x).max()
    a = np.abs(x.astype(np.float64)) / scale
    book = CODEBOOK.astype(np.float64)
    lo = np.clip(np.searchsorted(book, a, side="right") - 1, 0, 126)
    down, up = book[lo] * scale, book[lo + 1] * scale
    near = lambda v: np.isclose(np.abs(draws), v, rtol=1e-6, atol=0)  # noqa: E731
    assert (near(down) | near(up)).all()
    p = (np.abs(x) - down) / (up - down)
    se = (up - down) * np.sqrt(np.maximum(p * (1 - p), 1e-12) / len(draws))
    err = np.abs(draws.mean(0) - x.astype(np.float64))
    assert (err <= 5 * se + 1e-12 * scale).all(), (err / se).max()
    a1, a2 = quantize(key, 256, jnp.uint32(7)), jax.jit(quantize, static_argnums=1)(key, 256, 7)
    _assert_bits_equal(a1, a2)
    assert (np.asarray(a1.codes) != np.asarray(quantize(key, 256, jnp.uint32(8)).codes)).any()


def test_adamw_state_is_6_bytes_per_param_with_exact_master():
    """bf16 params + int16 remainders + 8-bit mu and nu (+ a float32 scale per block: the
    default layout cuts a 256-wide row into 8 blocks of 32, a 128-long bias into 4)."""
    params = {"w": jnp.zeros((128, 256), jnp.bfloat16), "b": jnp.zeros((128,), jnp.bfloat16)}
    inner = mpjax.low_precision_state(optax.adamw(1e-3), jnp.int8)
    state = mpjax.loss_scaled(inner, master_weights="remainder").init(params)
    mu = state.inner_state.inner_state[0].mu
    assert isinstance(mu["w"], mpjax.scaling.Blockwise8)
    assert mu["w"].codes.dtype == jnp.int8 and mu["w"].codes.shape == (128, 256)
    assert mu["w"].scales.shape == (128, 8) and mu["b"].scales.shape == (4,)
    n = sum(x.size for x in jax.tree.leaves(params))
    big = sum(x.nbytes for x in jax.tree.leaves((params, state)) if x.ndim)  # no counters
    assert big == 6 * n + 2 * 4 * (128 * 8 + 4)  # 6 bytes each, and two scales per block


@pytest.mark.parametrize("name", sorted(LP_INNERS))
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_int8_state_trains(name, rounding):
    f32_loss, _ = _quadratic_run(LP_INNERS[name]())
    tx = mpjax.low_precision_state(LP_INNERS[name](), jnp.int8, rounding=rounding, block_size=32)
    loss, state = _quadratic_run(tx)
    leaves = jax.tree.leaves(state.inner_state, is_leaf=lambda x: isinstance(x, Blockwise8))
    assert any(isinstance(x, Blockwise8) for x in leaves)
    # every floating array of the inner state is stored as codes (scalars stay as they are)
    for x in leaves:
        if isinstance(x, Blockwise8):
            assert x.codes.dtype == jnp.int8 and x.scales.dtype == jnp.float32
        else:
            assert x.ndim == 0 or not jnp.issubdtype(x.dtype, jnp.floating)
    start, _ = _quadratic_run(LP_INNERS[name](), steps=0)
    assert loss < 0.5 * start and abs(loss - f32_loss) <= 0.1 * start


def test_int8_state_inside_loss_scaled_skip_is_bit_identical():
    inner = mpjax.low_precision_state(optax.adamw(1e-2), jnp.int8)
    tx = mpjax.loss_scaled(inner, master_weights="remainder")
    params = {"w": jnp.asarray(np.random.default_rng(4).standard_normal((8, 40)), jnp.bfloat16)}
    state = tx.init(params)
    good = {"w": jnp.asarray(np.random.default_rng(5).standard_normal((8, 40)), jnp.bfloat16)}
    params, state = _apply(tx, params, state, good)
    before = (params, state.inner_state, state.master)
    params2, state2 = _apply(tx, params, state, {"w": good["w"].at[3, 3].set(jnp.inf)})
    assert bool(state2.skipped)
    _assert_bits_equal((params2, state2.inner_state, state2.master), before)


def test_int8_bad_arguments_name_the_culprit():
    with pytest.raises(ValueError, match=r"block_size must be None \(from each leaf's shape\)"):
        mpjax.low_precision_state(optax.adam(1e-3), jnp.int8, block_size=0)
    tx = mpjax.low_precision_state(optax.adam(1e-3), jnp.int8, block_size=lambda shape: 0)
    with pytest.raises(ValueError, match=r"block length of shape \(3,\) must be an int >= 1"):
        tx.init({"w": jnp.ones((3,))})
    with pytest.raises(TypeError, match="floating dtype or int8"):
        mpjax.low_precision_state(optax.adam(1e-3), dtype=jnp.int16, rounding="nearest")


def test_int8_rounds_to_nearest_by_default():
    def run(**kw):
        return _quadratic_run(mpjax.low_precision_state(optax.adam(1e-2), jnp.int8, **kw), 5)[1]

    _assert_bits_equal(run(), run(rounding="nearest"))
    stochastic = run(rounding="stochastic")
    codes = lambda s: np.asarray(s.inner_state[0].mu["w"].codes)  # noqa: E731
    assert (codes(stochastic) != codes(run())).any()


# --- FSDP: the int8 step moves what the bf16-state step moves, and nothing else -------------

FSDP_SHAPES = {"up": (16, 64), "down": (64, 16), "bias": (64,), "vec": (16, 8)}


def _fsdp_axis(shape) -> int | None:
    """The axis split over the 8 devices: the largest one divisible by 8 (as
    benchmarks/multi_gpu_cost.py does), None for none."""
    dims = [i for i, d in enumerate(shape) if d % 8 == 0]
    return max(dims, key=lambda i: (shape[i], -i)) if dims else None


def _fsdp_block(shape) -> int:
    """Blocks that divide each device's piece of a last axis split 8 ways."""
    last = shape[-1]
    piece = last // 8 if _fsdp_axis(shape) == len(shape) - 1 else last
    return max(b for b in range(1, min(256, piece) + 1) if piece % b == 0)


def _fsdp_collectives(dtype, block_size=256) -> list:
    """The collectives (op, dtype, bytes) of the sharded AdamW step with `dtype` state."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

    def spec(shape, like):
        axis = _fsdp_axis(like)
        axis = axis if axis is not None and shape[axis] % 8 == 0 else None
        return NamedSharding(mesh, P(*("fsdp" if i == axis else None for i in range(len(shape)))))

    def place(x, like=None):
        """`x` split like `like` (default: itself); a `Blockwise8`'s scales like its codes."""
        like = x if like is None else like
        if isinstance(x, Blockwise8):
            return Blockwise8(place(x.codes), place(x.scales, x.codes))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x.shape, like.shape))

    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in FSDP_SHAPES.items()}
    kw = {"block_size": block_size} if dtype == jnp.int8 else {}
    tx = mpjax.low_precision_state(optax.adamw(1e-3), dtype, **kw)
    is_q = lambda x: isinstance(x, Blockwise8)  # noqa: E731
    state = jax.tree.map(place, jax.eval_shape(tx.init, params), is_leaf=is_q)

    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    args = (jax.tree.map(place, params), state, jax.tree.map(place, params))
    shardings = jax.tree.map(lambda x: x.sharding, args[:2])
    compiled = jax.jit(step, out_shardings=shardings).lower(*args).compile()
    return sorted((c.op, c.dtype, c.bytes) for c in collectives(compiled.as_text()))


def test_int8_state_under_fsdp_adds_no_collective():
    bf16 = _fsdp_collectives(jnp.bfloat16)
    assert _fsdp_collectives(jnp.int8, _fsdp_block) == bf16
    # the check sees blocks that straddle the devices: 64-element blocks of a last axis
    # split 8 ways need collectives (the old flattened blocks did so for every leaf)
    straddling = _fsdp_collectives(jnp.int8, 256)
    assert len(straddling) > len(bf16), (bf16, straddling)
