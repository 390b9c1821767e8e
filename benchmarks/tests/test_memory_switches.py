"""The per-switch memory table's registry and categories (no compile: see the benchmark)."""

from benchmarks import memory_switches as ms
from mpjax._src.analysis.liveness import Buffer

CFG = {"batch": 16, "seq": 8, "d": 4, "mlp": 16, "vocab": 64, "heads": 1, "layers": 1}


def test_every_switch_is_a_row_and_pending_ones_are_marked():
    rows = ms.rows()
    for name in ms.SWITCHES:
        assert rows[f"+ {name}"] is not None
    for name in ms.PENDING:
        assert (rows[f"+ {name}"] is None) == (name not in ms.SWITCHES)
    assert rows["all switches"] is not None
    results = [{"row": "+ fused loss", "missing": True}]
    _, table = ms.table(results, {a: None for a in ms.ANCHORS})
    assert table[0][:2] == ["+ fused loss", "not on this branch"]


def test_categories_by_shape():
    cat = ms.lm_category(CFG, {5 * 16})
    tokens = CFG["batch"] // ms.DEVICES * CFG["seq"]  # 16 per device

    def buf(dtype, dims):
        return Buffer("b", "fusion", ((dtype, dims),), 0, "")

    assert cat(buf("bf16", (2, 1, 8, 8))).startswith("attention scores")
    assert cat(buf("f32", (2, 8, 64))) == "float32 logits"
    assert cat(buf("bf16", (tokens, 16))) == "MLP hidden"
    assert cat(buf("bf16", (2, 8, 4))) == "model-width hidden states"
    assert cat(buf("f8e4m3fn", (tokens, 16))) == "fp8 saved activations"
    assert cat(buf("bf16", (5, 16))) == "weight copies"
    assert cat(buf("s32", (3,))) == "other"


def test_issue29_switches_and_both_anchors_are_in_the_suite():
    from benchmarks.cases import CASES, MODELS

    assert list(ms.SWITCHES)[:2] == ["fused attention", "fused loss"]
    assert all(ms.rows()[f"+ {n}"] is not None for n in ms.PENDING)
    assert set(ms.ANCHORS.values()) <= set(MODELS["lm"].variants)
    tables = {c.table for c in CASES}
    assert {"memory-switches", "memory-switches-char-lm", "lce-loss"} <= tables


def test_int8_fsdp_blocks_never_straddle_devices():
    from benchmarks.state_variants import fsdp_block_size

    assert fsdp_block_size((768, 3072)) == 192  # 3072 split by 8: 384 per device
    assert fsdp_block_size((1024, 768)) == 256  # the first axis is split: the last is whole
    assert fsdp_block_size((50304, 8)) == 8
    assert fsdp_block_size((40,)) == 5  # 40 split by 8


def test_docs_read_the_switch_table_from_the_results_file(tmp_path):
    import json

    from docs.memory_switch_tables import write_memory_switch_tables

    anchor = {"row": "anchor: hand-written bf16, XLA attention", "walk_peak_bytes": 2**30}
    anchor.update(temp_bytes=2**30, argument_bytes=2**29, by_category={"other": 2**30})
    figures = {"columns": ["step"] + ["c"] * 6, "rows": [["r"] * 7], "notes": "n"}
    records = [
        {"table": "memory-switches", "status": "ok", "figures": {**figures, "details": [anchor]}}
    ]
    (tmp_path / "results.json").write_text(json.dumps({"records": records}))
    paths = write_memory_switch_tables(tmp_path / "results.json", tmp_path / "out")
    where, frontier, switches = (p.read_text() for p in paths)
    assert "1.00" in where and "0.50" in where
    assert "rerun" in frontier  # a file from before the roofline column
    assert "| r |" in switches and "memory-switches-char-lm" in switches


def test_chunked_cross_entropy_is_the_mean_float32_loss():
    import jax
    import jax.numpy as jnp
    import optax

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k1, (2, 12, 8))
    kernel = jax.random.normal(k2, (8, 40))
    labels = jax.random.randint(k3, (2, 12), 0, 40).at[1, 5:].set(-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(hidden @ kernel, jnp.maximum(labels, 0))
    want = jnp.sum(jnp.where(labels >= 0, ce, 0)) / jnp.sum(labels >= 0)
    got = ms.chunked_cross_entropy(hidden, kernel, labels, chunk=4)  # 3 chunks of 4
    assert abs(float(got) - float(want)) < 1e-5
    grad = jax.grad(ms.chunked_cross_entropy)(hidden, kernel, labels, 4)
    assert grad.shape == hidden.shape and bool(jnp.all(jnp.isfinite(grad)))


def test_the_strong_anchors_and_mpjax_remat_points_are_rows():
    rows = ms.rows()
    assert all(rows[name] is not None for name in ms.STRONG_ANCHORS)
    assert ms.STRONG in ms.RATIO_ANCHORS
    assert all(rows[f"all switches + {name}"] is not None for name in ms.REMAT)


def _detail(row, gib, ms_, hand):
    return {"row": row, "temp_bytes": int(gib * 2**30), "argument_bytes": 0,
            "roofline_s": ms_ / 1e3, "hand_written": hand}  # fmt: skip


def test_frontier_names_the_smallest_mpjax_step_at_no_more_time(tmp_path):
    from benchmarks.tables_plots import plot_frontier
    from docs.memory_switch_tables import frontier_section

    details = [
        _detail("anchor: fast", 4.0, 9.0, True),
        _detail("anchor: slow", 1.0, 12.0, True),
        _detail("mpjax a", 3.0, 8.0, False),
        _detail("mpjax b", 2.0, 8.5, False),
        _detail("mpjax c", 0.5, 11.0, False),
        _detail("mpjax d", 0.1, 20.0, False),  # smaller, but slower than every anchor
    ]
    text = frontier_section({"details": details})
    fast, slow = text.splitlines()[2:4]
    assert "| mpjax b |" in fast and "**0.500**" in fast
    assert "| mpjax c |" in slow and "**0.500**" in slow
    # the time compared leaves the collectives out
    e = {**_detail("mpjax e", 1.0, 30.0, False), "roofline_s_no_collectives": 8.0 / 1e3}
    fast = frontier_section({"details": [*details, e]}).splitlines()[2]
    assert "| mpjax e |" in fast and "**0.250**" in fast
    records = [{"figures": {"details": details, "config": {"d": 4, "layers": 1}}}]
    plot_frontier(records, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 1000
