"""Per-GEMM records and collectives of `mpjax._src.analysis` on lowered and optimized HLO."""
# ruff: noqa: E501 - HLO lines are as long as XLA prints them

import textwrap

import jax
import jax.numpy as jnp

from mpjax._src.analysis import hlo_cost
from mpjax._src.analysis.collectives import collectives


def test_lowered_hlo_records_name_the_nested_jit_they_come_from():
    def g(a, b):
        return jnp.tanh(a @ b)

    def f(a, b):
        return jax.jit(g)(a, b).astype(jnp.bfloat16) @ b.astype(jnp.bfloat16)

    x = jnp.ones((4, 8))
    y = jnp.ones((8, 8))
    text = jax.jit(f).trace(x, y).lower().as_text(dialect="hlo", debug_info=True)
    gemms = hlo_cost.analyze(text).gemms
    assert [(g.op_name, g.lhs_dtype, g.out_dtype, g.flops) for g in gemms] == [
        ("jit(f)/jit(g)/dot_general", "f32", "f32", 2 * 4 * 8 * 8),
        ("jit(f)/dot_general", "bf16", "bf16", 2 * 4 * 8 * 8),
    ]


ASYNC = textwrap.dedent(
    """\
    HloModule m

    %add (x: f32[], y: f32[]) -> f32[] {
      %x = f32[] parameter(0)
      %y = f32[] parameter(1)
      ROOT %s = f32[] add(%x, %y)
    }

    ENTRY %main (p: bf16[16,128], q: f32[64], r: bf16[32]) -> (bf16[128,128], f32[64], bf16[32]) {
      %p = bf16[16,128]{1,0} parameter(0)
      %q = f32[64]{0} parameter(1)
      %r = bf16[32]{0} parameter(2)
      %ag-start = (bf16[16,128]{1,0}, bf16[128,128]{1,0}) all-gather-start(%p), dimensions={0}, metadata={op_name="jit(step)/Dense_0/all_gather"}
      %ag-done = bf16[128,128]{1,0} all-gather-done(%ag-start), metadata={op_name="jit(step)/Dense_0/all_gather"}
      %ar = (f32[64]{0}, bf16[32]{0}) all-reduce(%q, %r), to_apply=%add
      %a = f32[64]{0} get-tuple-element(%ar), index=0
      %b = bf16[32]{0} get-tuple-element(%ar), index=1
      ROOT %t = (bf16[128,128]{1,0}, f32[64]{0}, bf16[32]{0}) tuple(%ag-done, %a, %b)
    }
    """
)


def test_async_pairs_count_once_and_combined_collectives_split_by_dtype():
    got = [(c.op, c.dtype, c.bytes, c.op_name) for c in collectives(ASYNC)]
    assert got == [
        ("all-gather", "bf16", 128 * 128 * 2, "jit(step)/Dense_0/all_gather"),
        ("all-reduce", "f32", 64 * 4, ""),
        ("all-reduce", "bf16", 32 * 2, ""),
    ]


SIX = textwrap.dedent(
    """\
    HloModule m

    %fused (a: f32[8], b: f32[8], c: f32[8], d: f32[8], e: f32[8], f: f32[1024]) -> f32[8] {
      %a = f32[8]{0} parameter(0)
      %b = f32[8]{0} parameter(1)
      %c = f32[8]{0} parameter(2)
      %d = f32[8]{0} parameter(3)
      %e = f32[8]{0} parameter(4)
      %f = f32[1024]{0} parameter(5)
      %s = f32[8]{0} slice(%f), slice={[0:8]}
      ROOT %r = f32[8]{0} add(%a, %s)
    }

    ENTRY %main (p0: f32[8], p1: f32[8], p2: f32[8], p3: f32[8], p4: f32[8], p5: f32[1024]) -> f32[8] {
      %p0 = f32[8]{0} parameter(0)
      %p1 = f32[8]{0} parameter(1)
      %p2 = f32[8]{0} parameter(2)
      %p3 = f32[8]{0} parameter(3)
      %p4 = f32[8]{0} parameter(4)
      %p5 = f32[1024]{0} parameter(5)
      ROOT %k = f32[8]{0} fusion(%p0, %p1, %p2, %p3, %p4, /*index=5*/%p5), kind=kLoop, calls=%fused
    }
    """
)


def test_operands_after_the_fifth_keep_their_bytes():
    # XLA prints `/*index=5*/` before the sixth operand; it must still count, as the 8
    # elements the fusion slices out of it (a fusion reads the slices of a sliced operand).
    (kernel,) = hlo_cost.analyze(SIX).kernels
    assert kernel.bytes == 5 * 8 * 4 + 8 * 4 + 8 * 4


UNNAMED_CONVERTS = """HloModule m

%fused_convert (param_0: f16[4]) -> f32[4] {
  %param_0 = f16[4]{0} parameter(0)
  ROOT %convert.1 = f32[4]{0} convert(%param_0)
}

ENTRY %main (p: f16[4], q: f16[4]) -> (f32[4], f32[4]) {
  %p = f16[4]{0} parameter(0), metadata={op_name="params['w']"}
  %q = f16[4]{0} parameter(1)
  %neg = f16[4]{0} negate(%p), metadata={op_name="jit(step)/Dense_0/neg"}
  %convert.2 = f32[4]{0} convert(%neg)
  %wrapped = f32[4]{0} fusion(%q), kind=kLoop, calls=%fused_convert, metadata={op_name="jit(step)/head/convert_element_type"}
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%convert.2, %wrapped)
}
"""


def test_a_convert_xla_made_counts_for_the_code_it_reads():
    report = hlo_cost.analyze(UNNAMED_CONVERTS)
    # the entry convert reads `neg` (Dense_0); the fused one only a parameter: its kernel's name
    assert report.converts_by_op == {
        "jit(step)/Dense_0/neg": 1,
        "jit(step)/head/convert_element_type": 1,
    }
    names = {k.name: k.op_name for k in report.kernels if k.only_converts}
    assert names == {
        "convert.2": "jit(step)/Dense_0/neg",
        "wrapped": "jit(step)/head/convert_element_type",
    }
