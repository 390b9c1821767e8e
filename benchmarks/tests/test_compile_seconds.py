"""Every cost-model row records its compile seconds, and the cost tables show them."""

from __future__ import annotations

from benchmarks import harness, tables_builders
from benchmarks.tables_format import COMPILE
from benchmarks.tests.test_suite import MODELS, _record


def test_measure_program_records_trace_and_compile_seconds():
    figures = harness.measure_program(
        harness.Case("toy", "toy", "f32", "cpu", anchor="f32"), MODELS, True, (1, 1)
    )
    assert figures["trace_s"] > 0 and figures["compile_s"] > 0


def _full_rows(builder, records):
    _, _, cols, rows = builder(records)
    return cols, {row[cols.index("variant")]: row for row in rows}


# The other figures the fp8, blocks and multi-GPU tables read.
OTHER = {
    "config": {"batch": 2, "seq": 8, "d": 16, "layers": 1, "mlp": 64},
    "collective_bytes": 2**20,
    "collectives": 4,
    "comm_s_links": 1e-3,
    "comm_s_nvlink": 1e-3,
    "comm_s_inter_host": 0.0,
    "argument_bytes": 2**20,
    "state_bytes": 400,
    "params": 100,
    "mesh": "fsdp=8",
    "by_op_dtype": {},
}


def test_cost_tables_show_compile_seconds_with_the_ratio_to_the_anchor():
    records = [
        _record("cost", "lm", "bf16", trace_s=1.0, compile_s=3.0, **OTHER),
        _record("cost", "lm", "policy", trace_s=2.0, compile_s=6.0, **OTHER),
        _record("cost", "lm", "old-record", **OTHER),  # from before compile times were kept
    ]
    cols, rows = _full_rows(tables_builders.cost_table, records)
    at = cols.index(COMPILE)
    assert rows["bf16"][at] == "4.0 (1.00x)"
    assert rows["policy"][at] == "8.0 (2.00x)"
    assert rows["old-record"][at] == "-"
    for builder in (
        tables_builders.fp8_table,
        tables_builders.blocks_table,
        tables_builders.multi_gpu_table,
    ):
        cols, rows = _full_rows(builder, records)
        assert rows["policy"][cols.index(COMPILE)] == "8.0 (2.00x)"
