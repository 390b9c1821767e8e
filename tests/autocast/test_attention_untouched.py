"""Importing mpjax (and running autocast) leaves `jax.nn.dot_product_attention` as JAX defines it.

Autocast runs the attention in the compute dtype by routing JAX's two private entry points
(`mpjax/_src/autocast/attention.py`) only while it traces; JAX's public function is never
replaced. Checked against a fresh interpreter that never imported mpjax: the function's
identity, pickling (pickle, cloudpickle), signature, docs, and its results and dtypes in
float32, bfloat16 and float16 on CPU; and, across threads, that the routing
lasts exactly as long as some autocast traces.
"""

import inspect
import json
import pickle
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.nn import functions as jax_functions

import mpjax

ENTRIES = ("_dot_product_attention_xla", "cudnn_dot_product_attention")

# Run here and in a fresh interpreter: the function's metadata and, per dtype, its jitted
# results (the bytes, or the error: XLA:CPU rejects JAX's float16 GEMM under jit, so float16
# eagerly too, where JAX falls back to another GEMM).
PROBE = """
import inspect, json, jax, jax.numpy as jnp, numpy as np

def probe():
    f = jax.nn.dot_product_attention
    out = {"module": f.__module__, "qualname": f.__qualname__, "doc": f.__doc__,
           "signature": str(inspect.signature(f))}
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 8, 2, 8)) for key in ks[:3])
    bias = jax.random.normal(ks[3], (1, 2, 8, 8))
    call = lambda q, k, v, b: f(q, k, v, b, is_causal=True)
    runs = [("float32", "jit"), ("bfloat16", "jit"), ("float16", "jit"), ("float16", "eager")]
    for dtype, how in runs:
        args = [x.astype(dtype) for x in (q, k, v, bias)]
        run = jax.jit(call) if how == "jit" else call
        try:
            y = np.asarray(run(*args))
            out[dtype + how] = [str(y.dtype), y.tobytes().hex()]
        except Exception as e:
            out[dtype + how] = [type(e).__name__, str(e).splitlines()[0]]
    return out
"""


def probe_here():
    scope = {}
    exec(PROBE, scope)
    return scope["probe"]()


@pytest.fixture(scope="module")
def fresh():
    """The probe in an interpreter that never imports mpjax."""
    script = PROBE + "\nimport sys\nprint(json.dumps(probe()))\nassert 'mpjax' not in sys.modules"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def inputs():
    return [jax.random.normal(key, (2, 8, 2, 8)) for key in jax.random.split(jax.random.key(1), 3)]


def test_jax_attention_is_jax_own_function_and_pickles_by_reference():
    # Before: importing mpjax replaced it with a wrapper: pickle raised PicklingError ("not the
    # same object as jax._src.nn.functions.dot_product_attention") and cloudpickle "cannot
    # pickle 'Config' object".
    f = jax.nn.dot_product_attention
    assert f is jax_functions.dot_product_attention
    assert pickle.loads(pickle.dumps(f)) is f
    cloudpickle = pytest.importorskip("cloudpickle")
    assert cloudpickle.loads(cloudpickle.dumps(f)) is f


def test_jax_attention_inside_an_autocast_trace_is_jax_own_function_too():
    seen = []

    def traced(q, k, v):
        f = jax.nn.dot_product_attention
        seen.append((f is jax_functions.dot_product_attention, pickle.loads(pickle.dumps(f)) is f))
        return attention(q, k, v)

    jax.jit(mpjax.autocast(traced, "p=f32,c=bf16,o=f32"))(*inputs())
    assert seen == [(True, True)]


def test_jax_attention_matches_a_fresh_interpreter_after_autocast_ran(fresh):
    # An autocast ran in this process (its routing came and went): the metadata, results and
    # dtypes (float32, bfloat16, float16) are those of an interpreter that
    # never imported mpjax, bit for bit.
    before = {name: getattr(jax_functions, name) for name in ENTRIES}
    out = jax.jit(mpjax.autocast(attention, "p=f32,c=bf16,o=f32"))(*inputs())
    assert out.dtype == jnp.float32
    assert {name: getattr(jax_functions, name) for name in ENTRIES} == before
    here = probe_here()
    assert sorted(here) == sorted(fresh)
    for key in fresh:
        assert here[key] == fresh[key], key
    assert fresh["signature"] == str(inspect.signature(jax.nn.dot_product_attention))
    assert fresh["float32jit"][0] == "float32" and fresh["bfloat16jit"][0] == "bfloat16"


def test_overlapping_autocast_traces_in_two_threads_route_until_the_last_ends():
    # Thread A traces an autocast and waits inside it; meanwhile this thread (outside autocast)
    # gets JAX's float32 attention, bit for bit; thread B starts its own autocast trace, A
    # ends, and only then does B call the attention: still the bfloat16 call (a routing undone
    # by the first trace to end would leave B's call float32, rewritten op by op).
    q, k, v = inputs()
    entries = {name: getattr(jax_functions, name) for name in ENTRIES}
    plain = np.asarray(jax.jit(lambda *a: attention(*a))(q, k, v))
    hand = np.asarray(jax.jit(lambda *a: attention(*(x.astype(jnp.bfloat16) for x in a)))(q, k, v))
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    results, errors = {}, []

    def traced_a(q, k, v):
        a_in.set()
        assert b_in.wait(60)
        return attention(q, k, v)

    def traced_b(q, k, v):
        b_in.set()
        assert a_done.wait(60)
        return attention(q, k, v)

    def run(name, fn, done=None):
        try:
            results[name] = np.asarray(mpjax.autocast(fn, "p=f32,c=bf16,o=bf16")(q, k, v))
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)
        finally:
            if done is not None:
                done.set()
            b_in.set()  # never leave the other thread waiting

    thread_a = threading.Thread(target=run, args=("a", traced_a, a_done))
    thread_a.start()
    assert a_in.wait(60)
    during = jax.jit(lambda *a: attention(*a))(q, k, v)  # while A holds the routing
    thread_b = threading.Thread(target=run, args=("b", traced_b))
    thread_b.start()
    thread_a.join(60)
    thread_b.join(60)
    assert not errors, errors
    assert during.dtype == jnp.float32
    np.testing.assert_array_equal(during, plain)
    for name in ("a", "b"):
        assert results[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(results[name], hand)
    assert {name: getattr(jax_functions, name) for name in ENTRIES} == entries
