"""`quantise_io`: the tensors a program quantises, and the transposes and float32 copies of
their operands (the rules on a hand-written optimized-HLO module shaped like the NVFP4 step's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mpjax._src.analysis.quantise_io import QUANTISE_SCOPE, QUANTISER, quantise_io
from mpjax._src.fp8.block_quantize_kernel import KERNEL_NAME
from mpjax._src.fp8.orientations import QUANTIZE_NAME
from mpjax.fp8 import quantize_orientations

_FWD = f"jit(step)/jvp(jit({QUANTISE_SCOPE}))"
_BWD = f"jit(step)/transpose(jvp(jit({QUANTISE_SCOPE})))"


def _meta(name: str) -> str:
    return f'metadata={{op_name="{name}"}}'


_KERNEL = f'custom_call_target="__gpu$xla.gpu.triton", backend_config={{name = "{QUANTISER}"}}'

# x: a LayerNorm output in float32, which its fusion also writes transposed for an amax;
# w: a parameter whose amax pass writes |w| in float32; g: bfloat16, quantised by XLA.
HLO = f"""HloModule step

%fused_ln (p0: f32[64,32]) -> (f32[64,32], f32[32,64]) {{
  %p0 = f32[64,32]{{1,0}} parameter(0)
  %m = f32[64,32]{{1,0}} multiply(%p0, %p0)
  %t = f32[32,64]{{1,0}} transpose(%m), dimensions={{1,0}}
  ROOT %r = (f32[64,32]{{1,0}}, f32[32,64]{{1,0}}) tuple(%m, %t)
}}

%fused_abs (p0: f32[64,32]) -> f32[64,32] {{
  %p0 = f32[64,32]{{1,0}} parameter(0)
  ROOT %a = f32[64,32]{{1,0}} abs(%p0)
}}

%fused_add (p0: bf16[64,32]) -> bf16[64,32] {{
  %p0 = bf16[64,32]{{1,0}} parameter(0)
  ROOT %a = bf16[64,32]{{1,0}} add(%p0, %p0)
}}

%fused_q (p0: bf16[64,32]) -> f8e4m3fn[64,32] {{
  %p0 = bf16[64,32]{{1,0}} parameter(0)
  ROOT %c = f8e4m3fn[64,32]{{1,0}} convert(%p0)
}}

ENTRY %main (x: f32[64,32], w: f32[64,32], g: bf16[64,32]) -> f32[] {{
  %x = f32[64,32] parameter(0)
  %w = f32[64,32] parameter(1)
  %g = bf16[64,32] parameter(2)
  %ln = (f32[64,32], f32[32,64]) fusion(%x), kind=kInput, calls=%fused_ln, {_meta("jit(step)/mul")}
  %ln0 = f32[64,32] get-tuple-element(%ln), index=0
  %ln1 = f32[32,64] get-tuple-element(%ln), index=1
  %amax_x = f32[32] fusion(%ln1), kind=kInput, calls=%fused_abs, {_meta(_FWD + "/reduce_max")}
  %qx = (u8[64,32], u8[32,64]) custom-call(%ln0, %amax_x), {_KERNEL}, {_meta(_FWD)}
  %mag = f32[64,32] fusion(%w), kind=kLoop, calls=%fused_abs, {_meta(_FWD + "/select_n")}
  %amax_w = f32[32] fusion(%mag), kind=kInput, calls=%fused_abs, {_meta(_FWD + "/reduce_max")}
  %qw = (u8[64,32], u8[32,64]) custom-call(%w, %amax_w), {_KERNEL}, {_meta(_FWD)}
  %dy = bf16[64,32] fusion(%g), kind=kLoop, calls=%fused_add, {_meta("jit(step)/add_any")}
  %qg = f8e4m3fn[64,32] fusion(%dy), kind=kLoop, calls=%fused_q, {_meta(_BWD + "/convert")}
  ROOT %out = f32[] custom-call(%qx, %qw, %qg), custom_call_target="gemms"
}}
"""


def test_the_names_are_the_fp8_layers():
    assert (QUANTISE_SCOPE, QUANTISER) == (QUANTIZE_NAME, KERNEL_NAME)


def test_each_tensor_its_role_and_quantise_kernels():
    io = quantise_io(HLO)
    got = sorted((t.role, t.kernels, t.fused) for t in io.tensors)
    assert got == [("g", ("qg",), False), ("w", ("qw",), True), ("x", ("qx",), True)]
    # x's kernel reads ln#0, and ln#1 through the amax pass
    x_sources = ("f32[32,64] ln#1 (mul)", "f32[64,32] ln#0 (mul)")
    assert [t.sources for t in io.tensors if t.role == "x"] == [x_sources]


def test_a_transposed_float32_copy_beside_the_operand_is_both():
    io = quantise_io(HLO)
    assert io.transposes == ("x f32[32,64] ln#1 (mul)",)
    # ln#1: made outside the work only for it; mag: written by the work (|w| in float32)
    assert io.float32_copies == ("x f32[32,64] ln#1 (mul)", "w f32[64,32] mag (select_n)")
    # the fused quantiser's own float32 operand is the tensor, not a copy
    assert io.float32_operands == ("f32[64,32] ln#0 (mul)",)


def test_a_program_without_quantisation_has_nothing():
    text = jax.jit(lambda x: (x @ x).T).trace(jnp.ones((64, 64))).lower().compile().as_text()
    assert quantise_io(text) == ((), (), (), ())


def test_a_quantised_transpose_on_cpu():
    """XLA:CPU, the reference quantiser: the transposed operand (`x.T * 2`) shows."""
    f = jax.jit(lambda x: quantize_orientations(x.T * 2, "mxfp8").rows.data)
    io = quantise_io(f.trace(jnp.ones((64, 128))).lower().compile().as_text())
    assert any(t.split()[1] == "f32[128,64]" for t in io.transposes), io
    g = jax.jit(lambda x: quantize_orientations(x * 2, "mxfp8").rows.data)
    assert quantise_io(g.trace(jnp.ones((64, 128))).lower().compile().as_text()).transposes == ()


CAST = f"""HloModule step

%fused_add (p0: bf16[64,32]) -> bf16[64,32] {{
  %p0 = bf16[64,32] parameter(0)
  ROOT %a = bf16[64,32] add(%p0, %p0)
}}

%fused_cast (p0: bf16[64,32]) -> f32[64,32] {{
  %p0 = bf16[64,32] parameter(0)
  ROOT %c = f32[64,32] convert(%p0)
}}

ENTRY %main (g: bf16[64,32]) -> (u8[64,32], u8[32,64]) {{
  %g = bf16[64,32] parameter(0)
  %dy = bf16[64,32] fusion(%g), kind=kLoop, calls=%fused_add, {_meta("jit(step)/add_any")}
  %dy32 = f32[64,32] fusion(%dy), kind=kLoop, calls=%fused_cast, {_meta("jit(step)/convert")}
  ROOT %q = (u8[64,32], u8[32,64]) custom-call(%dy32), {_KERNEL}, {_meta(_BWD)}
}}
"""


def test_a_float32_cast_made_for_the_fused_quantiser_is_a_copy():
    io = quantise_io(CAST)
    assert [t.role for t in io.tensors] == ["g"]
    assert io.float32_copies == ("g f32[64,32] dy32 (convert)",)
    assert (io.transposes, io.float32_operands) == ((), ())


def test_a_weight_moved_before_its_quantiser_keeps_its_role():
    """A transposed float32 copy of a parameter made for the quantiser: `w`, a transpose and
    a float32 copy."""
    hlo = f"""HloModule step

%fused_t (p0: f32[64,32]) -> f32[32,64] {{
  %p0 = f32[64,32] parameter(0)
  ROOT %t = f32[32,64] transpose(%p0), dimensions={{1,0}}
}}

ENTRY %main (w: f32[64,32]) -> (u8[32,64], u8[64,32]) {{
  %w = f32[64,32] parameter(0)
  %wt = f32[32,64] fusion(%w), kind=kInput, calls=%fused_t, {_meta("jit(step)/transpose")}
  ROOT %q = (u8[32,64], u8[64,32]) custom-call(%wt), {_KERNEL}, {_meta(_FWD)}
}}
"""
    io = quantise_io(hlo)
    assert [t.role for t in io.tensors] == ["w"]
    assert io.transposes == io.float32_copies == ("w f32[32,64] wt (transpose)",)
