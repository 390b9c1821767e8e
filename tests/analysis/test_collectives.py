"""The collectives parser: ops, dtypes and bytes of optimized HLO, async forms counted once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax._src.analysis.collectives import Collective, collectives, comm_seconds, summary

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: bf16[4,8], q: f32[64], r: f32[]) -> f32[] {
  %p = bf16[4,8]{1,0} parameter(0)
  %q = f32[64]{0} parameter(1)
  %r = f32[] parameter(2)
  %ags = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(%p), dimensions={0}
  %agd = bf16[32,8]{1,0} all-gather-done(%ags)
  %rs = f32[8]{0} reduce-scatter(%q), dimensions={0}, to_apply=%add
  %ars = (f32[], f32[8]{0}) all-reduce-start(%r, %rs), to_apply=%add
  %ard = (f32[], f32[8]{0}) all-reduce-done(%ars)
  %cp = f32[64]{0} collective-permute(%q), source_target_pairs={{0,1}}
  ROOT %o = f32[] get-tuple-element(%ard), index=0
}
"""


def test_records_ops_dtypes_and_bytes():
    assert [Collective(*c[:4]) for c in collectives(HLO)] == [
        Collective("all-gather", "bf16", (32, 8), 512),
        Collective("reduce-scatter", "f32", (64,), 256),
        Collective("all-reduce", "f32", (), 4),
        Collective("all-reduce", "f32", (8,), 32),
        Collective("collective-permute", "f32", (64,), 256),
    ]
    assert [c.name for c in collectives(HLO)] == ["ags", "rs", "ars", "ars", "cp"]


def test_summary_and_ring_time():
    records = collectives(HLO)
    assert summary(records)["all-reduce f32"] == {"count": 2, "bytes": 36}
    # 8 devices: all-gather and reduce-scatter 7/8, all-reduce 2*7/8, permute 1.
    expected = (512 + 256) * 7 / 8 + 36 * 2 * 7 / 8 + 256
    assert comm_seconds(records, 8, 1.0) == pytest.approx(expected)
    assert comm_seconds(records, 1, 1.0) == 0.0


def test_compiled_fsdp_matmul_gathers_its_shard():
    """On 8 CPU devices, x @ w with w split on its first axis all-gathers w (or reduces)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    w_sh = NamedSharding(mesh, P("fsdp", None))
    x_sh = NamedSharding(mesh, P())
    f = jax.jit(lambda x, w: x @ w, in_shardings=(x_sh, w_sh), out_shardings=x_sh)
    args = (jnp.ones((4, 64), jnp.float32), jnp.ones((64, 16), jnp.float32))
    records = collectives(f.lower(*args).compile().as_text())
    assert records, "a replicated result of a sharded contraction needs a collective"
    assert {r.op for r in records} <= {"all-gather", "all-reduce", "reduce-scatter"}
    assert all(r.dtype == "f32" for r in records)
