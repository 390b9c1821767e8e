"""Issue 27: a scatter-add (`jax.ops.segment_sum`, GNN message aggregation) is a reduction:
under autocast it accumulates in float32, as `jnp.sum` does; and an autocast function that
returns a non-array names itself and the output.

The GNN is jraph's own `GraphNetwork` with mean aggregation (`jraph.segment_mean`: a segment
sum divided by a segment count), as in jraph's examples, on a star graph: the hub's 1024
incoming messages of ~100 sum past float16's 65504. Its features and params are float16 (half-
precision graph data; params stored in float16 next to a float32 master), so the traced
program's messages are float16, as the values autocast is given.
"""

import jax
import jax.numpy as jnp
import jraph
import numpy as np
import pytest

import mpjax
from tests.helpers.numerics import f64_reference, tree_rel_err

F16, F32 = jnp.dtype("float16"), jnp.dtype("float32")
POLICY = "params=float32,compute=float16,output=float32"


def _scatters(jaxpr):
    """The floating scatters of `jaxpr` (jraph also scatters integer node indices)."""
    return [
        e
        for e in jaxpr.eqns
        if e.primitive.name.startswith("scatter")
        and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)
    ]


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_segment_reduction_of_float16_values_accumulates_in_float32(op):
    x = jnp.full((64, 4), 2000.0 if op == "sum" else 1.25)
    seg = jnp.zeros(64, jnp.int32)
    segment = {"sum": jax.ops.segment_sum, "prod": jax.ops.segment_prod}[op]
    reduce = {"sum": jnp.sum, "prod": jnp.prod}[op]

    def fn(x):  # values that are float16 (a GEMM output, an fp16 activation)
        h = x.astype(jnp.float16)
        return segment(h, seg, num_segments=2)[0], reduce(h, axis=0)

    f = mpjax.autocast(fn, POLICY)
    seg_out, red_out = f(x)
    want = 2000.0 * 64 if op == "sum" else 1.25**64  # both beyond float16's 65504
    np.testing.assert_allclose(np.asarray(seg_out), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(seg_out), np.asarray(red_out))
    (scatter,) = _scatters(jax.make_jaxpr(f)(x).jaxpr)
    assert [v.aval.dtype for v in (*scatter.invars[::2], *scatter.outvars)] == [F32] * 3


def test_scatter_add_can_be_taken_off_the_float32_list():
    lists = mpjax.OpLists().with_removed("scatter-add")
    f = mpjax.autocast(
        lambda h: jax.ops.segment_sum(h.astype(jnp.float16), jnp.zeros(4, jnp.int32), 1),
        POLICY,
        op_lists=lists,
    )
    (scatter,) = _scatters(jax.make_jaxpr(f)(jnp.ones((4, 2))).jaxpr)
    assert scatter.outvars[0].aval.dtype == F16


# ----------------------------------------------------------------------------- jraph GNN


def _star_graph(n_leaves=1024, features=8, seed=0):
    rng = np.random.default_rng(seed)
    n = n_leaves + 1  # node 0 is the hub; every other node sends it one message
    return jraph.GraphsTuple(
        nodes=jnp.asarray(rng.uniform(1.0, 2.0, (n, features)), jnp.float32),
        edges=jnp.asarray(rng.uniform(1.0, 2.0, (n_leaves, features)), jnp.float32),
        senders=jnp.arange(1, n, dtype=jnp.int32),
        receivers=jnp.zeros(n_leaves, jnp.int32),
        n_node=jnp.array([n]),
        n_edge=jnp.array([n_leaves]),
        globals=jnp.zeros((1, features), jnp.float32),
    )


def _params(features=8, seed=1):
    rng = np.random.default_rng(seed)

    def dense(fan_in, scale):
        return jnp.asarray(rng.uniform(0.5, 1.5, (fan_in, features)) * scale, jnp.float32)

    # Edge messages of ~100 (a hub's sum is ~1e5), nodes and globals of order 1.
    return {
        "edge": dense(3 * features, 4.0),
        "node": dense(2 * features, 0.01),
        "glob": dense(features, 0.1),
    }


def _gnn(params, graph):
    """One jraph `GraphNetwork` step (edge, node and global MLPs), mean aggregation."""

    def update_edge(edges, senders, receivers, globals_):
        return jax.nn.relu(jnp.concatenate([edges, senders, receivers], -1) @ params["edge"])

    def update_node(nodes, sent, received, globals_):
        return jnp.tanh(jnp.concatenate([nodes, received], -1) @ params["node"])

    def update_global(nodes, edges, globals_):
        return nodes @ params["glob"]

    net = jraph.GraphNetwork(
        update_edge_fn=update_edge,
        update_node_fn=update_node,
        update_global_fn=update_global,
        aggregate_edges_for_nodes_fn=jraph.segment_mean,
        aggregate_nodes_for_globals_fn=jraph.segment_mean,
        aggregate_edges_for_globals_fn=jraph.segment_mean,
    )
    return net(graph).globals


def test_jraph_graph_network_under_float16_autocast_matches_float64():
    """Forward (the globals) and gradient of a jraph GraphNetwork: finite, float64-close."""
    half = mpjax.get_policy("float16")
    graph = _star_graph()
    graph = graph._replace(**half.cast_to_param({"nodes": graph.nodes, "edges": graph.edges}))
    params = half.cast_to_param(_params())

    def loss(params, graph):
        out = _gnn(params, graph)
        return jnp.sum(out**2), out

    step = jax.value_and_grad(loss, has_aux=True)
    f = mpjax.autocast(loss, "p=f16,c=f16,o=f32")
    (_, out), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params, graph)
    (_, ref_out), ref_grads = f64_reference(step, params, graph)
    for x in (out, *jax.tree.leaves(grads)):
        assert np.all(np.isfinite(np.asarray(x))), x
    assert tree_rel_err(out, ref_out) < 1e-2
    assert tree_rel_err(grads, ref_grads) < 3e-2
    jaxpr = jax.make_jaxpr(f)(params, graph).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.invars[0].aval.dtype == F16 for e in dots)  # GEMMs stay float16
    scatters = _scatters(jaxpr)
    assert scatters and all(e.outvars[0].aval.dtype == F32 for e in scatters)


# ----------------------------------------------------------------------------- outputs


def test_non_array_output_names_the_function_and_the_output():
    def model(x):
        return {"logits": x * 2, "name": "resnet"}

    with pytest.raises(TypeError, match=r"model returned 'resnet' \(str\) as output\['name'\]"):
        mpjax.autocast(model)(jnp.ones(2))
