"""Tests for the liveness walk of optimized HLO (`mpjax._src.analysis.liveness`)."""

import jax
import jax.numpy as jnp

from mpjax._src.analysis.liveness import attribute, peak_buffers

HLO = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (p: f32[8]) -> (f32[], f32[64]) {
  %p = f32[8]{0} parameter(0)
  %ag = (f32[8]{0}, f32[64]{0}) all-gather-start(f32[8]{0} %p), dimensions={0}
  %big = bf16[1024]{0} fusion(f32[8]{0} %p), kind=kLoop, calls=%add
  %done = f32[64]{0} all-gather-done((f32[8]{0}, f32[64]{0}) %ag)
  %pair = (f32[64]{0}, bf16[1024]{0}) tuple(f32[64]{0} %done, bf16[1024]{0} %big)
  %g = bf16[1024]{0} get-tuple-element((f32[64]{0}, bf16[1024]{0}) %pair), index=1
  %small = f32[16]{0} fusion(bf16[1024]{0} %g), kind=kLoop, calls=%add
  %r = f32[] reduce(f32[16]{0} %small, f32[] %p), dimensions={0}, to_apply=%add
  ROOT %out = (f32[], f32[64]{0}) tuple(f32[] %r, f32[64]{0} %done)
}
"""


def test_peak_follows_aliases_async_pairs_and_excludes_outputs():
    """The peak is at `small`: `big` (2048 B, alive through the tuple and its
    get-tuple-element) and `small` (64 B); the gathered buffer (256 B) is returned, so not
    a temporary; the parameter is an argument."""
    peak, buffers = peak_buffers(HLO)
    assert peak == 2048 + 64
    assert [(b.name, b.bytes) for b in buffers] == [("big", 2048), ("small", 64)]
    assert attribute(buffers, lambda b: b.shapes[0][0]) == {"bf16": 2048, "f32": 64}


def test_peak_of_a_compiled_step_bounds_xla_temp():
    """On a compiled gradient the walk finds the hidden activations at the peak, and its
    peak (no buffer packing) is at least XLA's temp size."""

    def f(w1, w2, x):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))

    args = (jnp.ones((64, 256)), jnp.ones((256, 64)), jnp.ones((128, 64)))
    compiled = jax.jit(jax.grad(f, (0, 1))).lower(*args).compile()
    peak, buffers = peak_buffers(compiled.as_text())
    assert peak >= compiled.memory_analysis().temp_size_in_bytes
    assert buffers[0].shapes == (("f32", (128, 256)),)
