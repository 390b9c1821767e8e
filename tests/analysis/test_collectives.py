"""The collectives parser: ops, dtypes and bytes of optimized HLO, async forms counted once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mpjax._src.analysis.collectives import (
    Collective,
    collectives,
    comm_seconds,
    link_bytes,
    link_seconds,
    loop_collectives,
    replica_groups,
    summary,
)

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


def test_async_all_reduce_counts_its_results_in_either_form():
    """jaxlib 0.12's all-reduce-start gives ((operands...), results...), 0.10's the results:
    each array reduced is one record either way (0.12's form was counted twice)."""
    new = HLO.replace(
        "%ars = (f32[], f32[8]{0}) all-reduce-start(%r, %rs)",
        "%ars = ((f32[], f32[8]{0}), f32[], f32[8]{0}) all-reduce-start(%r, %rs)",
    )
    assert new != HLO
    assert collectives(new) == collectives(HLO)
    single = HLO.replace(
        "%ars = (f32[], f32[8]{0}) all-reduce-start(%r, %rs)",
        "%ars = ((f32[8]{0}), f32[8]{0}) all-reduce-start(%rs)",
    ).replace(
        "%ard = (f32[], f32[8]{0}) all-reduce-done(%ars)", "%ard = f32[8]{0} all-reduce-done(%ars)"
    )
    reduced = [c for c in collectives(single) if c.op == "all-reduce"]
    assert [(c.dtype, c.shape, c.bytes) for c in reduced] == [("f32", (8,), 32)]


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


# Two hosts of two devices: ids 0, 1 on host 0; 2, 3 on host 1.
HOSTS = (0, 0, 1, 1)
GROUPS_HLO = """HloModule g

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %in_host = f32[16]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
  %across = f32[16]{0} all-reduce(%in_host), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  %mesh_in = f32[64]{0} all-gather(%across), MESH_GROUPS, dimensions={0}
  %all = f32[16]{0} all-reduce(%p), replica_groups={}, to_apply=%add
  ROOT %cp = f32[16]{0} collective-permute(%all), source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
}
""".replace("MESH_GROUPS", "replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}")


def test_replica_groups_of_every_form():
    groups = {c.name: c.groups for c in collectives(GROUPS_HLO)}
    assert groups == {
        "in_host": ((0, 1), (2, 3)),
        "across": ((0, 2), (1, 3)),
        "mesh_in": ((0, 1), (2, 3)),
        "all": (),
        "cp": ((0, 1), (1, 0), (2, 3), (3, 2)),
    }


@pytest.mark.parametrize(
    ("attrs", "groups"),
    [
        # The H100 compiler's mesh form with a device order: axis 0 (size 4) varies.
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0))"
            " {'axis_0'}, dimensions={0}",
            ((0, 1, 2, 3), (4, 5, 6, 7)),
        ),
        ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, x=1", (tuple(range(8)),)),
        # A sub-axis 'axis_0':(2)2: the middle factor of axis_0 = (2, 2, 2).
        ("replica_groups=mesh['axis_0'=8] {'axis_0':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("replica_groups=[1,4]<=[4], dimensions={0}", ((0, 1, 2, 3),)),
        ("replica_groups=an-unknown-form", ()),
        ("dimensions={0}", ()),
    ],
)
def test_replica_groups_forms(attrs, groups):
    assert replica_groups(attrs) == groups


def test_each_collective_is_charged_at_its_link():
    records = {c.name: c for c in collectives(GROUPS_HLO)}
    # Within a host: ring of 2 (factor 1 for all-gather's 1/2 of 64 floats; 2*1/2 all-reduce).
    assert link_bytes([records["in_host"], records["mesh_in"]], HOSTS) == {
        "intra": 64 * 1 + 256 * 0.5,
        "inter": 0.0,
    }
    # A group holding devices of both hosts (and () = all devices) is limited by the
    # inter-host link; a permute within each host stays on NVLink.
    assert link_bytes([records["across"], records["all"]], HOSTS) == {
        "intra": 0.0,
        "inter": 64 * 1 + 64 * 2 * 3 / 4,
    }
    assert link_bytes([records["cp"]], HOSTS) == {"intra": 64.0, "inter": 0.0}
    every = list(records.values())
    sent = link_bytes(every, HOSTS)
    assert link_seconds(every, HOSTS, 4.0, 1.0) == pytest.approx(sent["intra"] / 4 + sent["inter"])
    # One host: everything on NVLink, as `comm_seconds` charges it at one bandwidth.
    one_host = link_seconds(every, (0, 0, 0, 0), 4.0, 1.0)
    assert link_bytes(every, (0, 0, 0, 0))["inter"] == 0.0
    assert one_host < link_seconds(every, HOSTS, 4.0, 1.0)


def test_compiled_two_axis_mesh_groups_follow_the_axes():
    """8 CPU devices as 2 "hosts" x 4 (device ids in mesh order): a sum over the inner axis
    runs within each host, a sum over the outer axis across the two."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("host", "gpu"))
    hosts = [0] * 4 + [1] * 4
    x = jnp.ones((8, 16), jnp.float32)
    for axis, spec, spans in ((1, P("host", "gpu"), False), (0, P("host", "gpu"), True)):
        f = jax.jit(
            lambda x, axis=axis: jnp.sum(x, axis=axis),
            in_shardings=NamedSharding(mesh, spec),
            out_shardings=NamedSharding(mesh, P()),
        )
        records = collectives(f.lower(x).compile().as_text())
        reduce = [r for r in records if r.op == "all-reduce" and r.groups]
        assert reduce, records
        span = [len({hosts[d] for d in g}) > 1 for r in reduce for g in r.groups]
        assert spans in span, (axis, [r.groups for r in reduce])
        if not spans:
            assert not any(span), (axis, [r.groups for r in reduce])


NESTED = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%branch (t: f32[4]) -> f32[4] {
  %t = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%t), replica_groups={}, to_apply=%add
}

%inner (i: f32[4]) -> f32[4] {
  %i = f32[4]{0} parameter(0)
  %ag = f32[32]{0} all-gather(%i), replica_groups={}, dimensions={0}
  %p = pred[] constant(true)
  ROOT %c = f32[4]{0} conditional(%p, %i), true_computation=%branch, false_computation=%branch
}

%cond (c: f32[4]) -> pred[] {
  %c = f32[4]{0} parameter(0)
  ROOT %t = pred[] constant(true)
}

%outer (o: f32[4]) -> f32[4] {
  %o = f32[4]{0} parameter(0)
  ROOT %w = f32[4]{0} while(%o), condition=%cond, body=%inner, backend_config=TRIPS_3
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %before = f32[32]{0} all-gather(%x), replica_groups={}, dimensions={0}
  ROOT %w = f32[4]{0} while(%x), condition=%cond, body=%outer, backend_config=TRIPS_5
}
"""
for _n in (3, 5):
    NESTED = NESTED.replace(f"TRIPS_{_n}", f'{{"known_trip_count":{{"n":"{_n}"}}}}')


def test_loop_collectives_run_once_per_trip_of_every_loop_around_them():
    looped = [(c.op, c.name, runs) for c, runs in loop_collectives(NESTED)]
    # the gather before the loops is not listed; the branch runs on every inner trip
    # (listed once per path: the conditional's two branches are the same computation)
    assert looped == [("all-gather", "ag", 15), ("all-reduce", "ar", 15), ("all-reduce", "ar", 15)]
    assert len(collectives(NESTED)) == 3  # every computation's ops once
