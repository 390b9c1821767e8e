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
