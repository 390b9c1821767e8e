"""The character-LM example with `--precision fp8`: fp8 GEMMs, and it trains like bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal, jaxprs_in_params

from examples import train_char_lm

E4, E5 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
TINY = dict(steps=40, batch_size=16, seq_len=32, d_model=64, num_layers=1, num_heads=2)


def gemm_operand_dtypes(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(
                tuple(np.dtype(v.aval.dtype) for v in eqn.invars if not isinstance(v, Literal))
            )
        for sub in jaxprs_in_params(eqn.params):
            found.extend(gemm_operand_dtypes(sub))
    return found


@pytest.fixture(scope="module")
def corpus():
    return train_char_lm.load_corpus(max_bytes=200_000)


@pytest.mark.slow
def test_fp8_char_lm_runs_fp8_gemms_and_trains_like_bf16(corpus):
    runs = {}
    for precision in ("bf16", "fp8"):
        config = train_char_lm.CharLMConfig(precision=precision, eval_windows=16, **TINY)
        fns = train_char_lm.make_train_fns(config)
        if precision == "fp8":
            carry = fns.init(jax.random.key(0))
            tokens = jnp.zeros((TINY["batch_size"], TINY["seq_len"] + 1), jnp.int32)
            step = jax.make_jaxpr(fns.step)(carry, tokens, 0).jaxpr
            dtypes = gemm_operand_dtypes(step)
            # QKV (3) + attention out + MLP up/down = 6 forward GEMMs, each with 2 backward
            assert dtypes.count((E4, E4)) == 6 and dtypes.count((E5, E4)) == 6, dtypes
            assert dtypes.count((E4, E5)) == 6, dtypes  # weight gradients
        runs[precision] = train_char_lm.train(config, seed=0, corpus=corpus, fns=fns)
    fp8, bf16 = runs["fp8"], runs["bf16"]
    assert np.all(np.isfinite(fp8.history["loss"]))
    assert fp8.history["loss"][-5:].mean() < 0.75 * fp8.history["loss"][:5].mean()
    # a short run: within 3 % of bf16's bits per byte (the full run's 1 % is in the README)
    assert abs(fp8.metric - bf16.metric) / bf16.metric < 0.03, (fp8.metric, bf16.metric)


def test_fp8_precision_flag_is_accepted():
    args = train_char_lm._parser().parse_args(["--precision", "fp8"])
    assert args.precisions == ["fp8"]
    with pytest.raises(ValueError, match="fp8"):
        train_char_lm.CharLMConfig(precision="fp4")
