"""tests/conftest.py: the session compiles into one persistent compilation cache."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def test_the_session_writes_compiles_to_one_persistent_cache():
    path = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert path.is_dir() and jax.config.jax_compilation_cache_dir == str(path)
    before = set(path.iterdir())
    kept = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:  # a program no other test compiles (its constant is this test's own)
        out = jax.jit(lambda x: jnp.sin(x) * 0.123456789)(np.arange(3.0))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", kept)
    np.testing.assert_allclose(out, np.sin(np.arange(3.0)) * 0.123456789, rtol=1e-6)
    assert set(path.iterdir()) - before  # the executable was written there
