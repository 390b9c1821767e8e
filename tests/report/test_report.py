"""`mpjax.report` on CPU: precision of every GEMM by module, totals, collectives, errors.

The H100 half (what the GPU target runs) is in tests/report/test_report_gpu.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import mpjax
from mpjax._src.analysis import hlo_cost
from mpjax._src.report.records import dtype_name
from mpjax._src.report.targets import gpu_aot_install
from tests.helpers.report import KEPT, gemm_counts, rule_step, sharded_step

_HLO_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


@functools.cache
def cpu_runs(kind: str, dtype) -> np.dtype:
    """The dtype this jaxlib's XLA:CPU runs a bare `kind` ("dot"/"conv") of `dtype` operands in,
    read from the optimized HLO by this test's own parse (jaxlib 0.10: float32 for bfloat16 and
    float16; 0.12: bfloat16 dots in bfloat16, convolutions and float16 in float32)."""
    if kind == "dot":
        fn, args = (lambda a, b: a @ b), (jnp.ones((8, 16), dtype), jnp.ones((16, 8), dtype))
    else:
        args = (jnp.ones((1, 4, 6, 6), dtype), jnp.ones((4, 4, 3, 3), dtype))
        fn = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")  # noqa: E731
    text = jax.jit(fn).lower(*args).compile().as_text()
    op = "dot" if kind == "dot" else "convolution"
    (got,) = set(re.findall(rf"= (\w+)\[[^\]]*\]\S* {op}\(", text))
    return np.dtype(_HLO_DTYPES[got])


# Per module: forward GEMM, weight gradient, input gradient (none for the first layer).
COUNTS = {"Dense_0": 2, KEPT: 3, "conv": 3, "head": 3}


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("jitted", [False, True])
def test_rule_keeps_exactly_one_module_float32(compute, jitted):
    step, params, x = rule_step(compute)
    r = mpjax.report(jax.jit(step) if jitted else step, params, x)
    assert gemm_counts(r.gemms) == COUNTS
    for g in r.gemms:
        want = jnp.float32 if g.path == KEPT else jnp.dtype(compute)
        assert (g.lhs_dtype, g.rhs_dtype, g.out_dtype) == (want, want, want), g
        assert g.flagged == (g.path == KEPT), g
        assert g.runs_as == cpu_runs(g.kind, want), g  # XLA:CPU's own choice, see cpu_runs
    assert {g.kind for g in r.gemms if g.path == "conv"} == {"conv"}
    summary = r.summary()
    assert f"GEMMs in {compute}" in summary and f"in float32: {KEPT} " in summary
    assert str(r).startswith("mpjax.report (cpu): " + summary)


def test_asked_flops_are_the_gemm_shapes():
    step, params, x = rule_step()
    r = mpjax.report(step, params, x)
    b, t, d = x.shape
    dense = 2 * b * t * d * d
    want = {"Dense_0": 2 * dense, KEPT: 3 * dense, "head": 3 * dense, "conv": 9 * dense}
    got = {}
    for g in r.gemms:
        got[g.path] = got.get(g.path, 0) + g.flops
    assert got == want


def test_totals_agree_with_hlo_cost_of_the_same_step():
    step, params, x = rule_step()
    r = mpjax.report(step, params, x)
    cost = hlo_cost.analyze(jax.jit(step).trace(params, x).lower().compile().as_text())
    want: dict = {}
    for flops in (cost.gemm_flops, cost.conv_flops):
        for key, n in flops.items():
            want[dtype_name(key)] = want.get(dtype_name(key), 0) + n
    assert r.flops_by_dtype(runs=True) == want
    assert sum(c.kernels for c in r.converts) == cost.convert_kernels
    assert sum(c.count for c in r.converts) == cost.converts


def test_to_dict_and_markdown():
    step, params, x = rule_step()
    r = mpjax.report(step, params, x)
    d = r.to_dict()
    assert d["target"] == "cpu" and d["summary"] == r.summary()
    assert [g["path"] for g in d["gemms"]] == [g.path for g in r.gemms]
    assert {g["lhs_dtype"] for g in d["gemms"] if g["path"] == KEPT} == {"float32"}
    assert set(d["memory"]) == {
        "temp_bytes", "argument_bytes", "output_bytes", "roofline_s", "peak_roofline_s",
        "unmeasured",
    }  # fmt: skip
    assert d["memory"]["roofline_s"] is None and d["memory"]["unmeasured"] == []  # on a CPU
    md = r.to_markdown()
    assert md.count(f"| {KEPT} | ") == COUNTS[KEPT] + 1  # its GEMMs and its converts row


def _collectives_in(text: str) -> list[tuple[str, str, int]]:
    """(op, dtype, bytes) of each single-array collective line of HLO text (test's own parse)."""
    ops = "all-reduce|all-gather|reduce-scatter|all-to-all"
    line = re.compile(rf"= (\w+)\[([0-9,]*)\]\S* ({ops})\(")
    sizes = {"f32": 4, "bf16": 2, "f16": 2}
    out = []
    for m in line.finditer(text):
        dims = [int(d) for d in m.group(2).split(",") if d]
        out.append((m.group(3), m.group(1), sizes[m.group(1)] * int(np.prod(dims))))
    return out


def test_collectives_of_an_8_device_sharded_step():
    assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 host devices"
    step, w, x = sharded_step(jax.devices()[:8])
    r = mpjax.report(step, w, x)
    text = jax.jit(step).trace(w, x).lower().compile().as_text()
    got = sorted((c.op, dtype_name(c.dtype), c.bytes) for c in r.collectives)
    want = sorted((op, dtype_name(dt), n) for op, dt, n in _collectives_in(text))
    assert got == want and got
    # The forward partial sums (x rows / 2 data shards x 128) and the weight gradient's
    # shard (64 rows / 4 model shards x 128), float32 on XLA:CPU (it runs bf16 dots in f32).
    assert sum(c.bytes for c in r.collectives if c.op == "all-reduce") == (16 + 16) * 128 * 4
    assert "all-reduce float32 16.4 kB" in r.summary()


def test_sharded_gemms_report_program_and_device_flops():
    step, w, x = sharded_step(jax.devices()[:8])
    r = mpjax.report(step, w, x)
    assert [g.flops for g in r.gemms] == [2 * 32 * 64 * 128] * 2
    assert all(g.device_flops < g.flops and g.flops % g.device_flops == 0 for g in r.gemms)


def test_unknown_target_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown target 'a100'; known targets: None, 'h100', "):
        mpjax.report(lambda x: x, jnp.ones(2), target="a100")


def test_missing_gpu_aot_says_how_to_install(monkeypatch):
    def no_plugin(topology="1x1x1"):
        raise RuntimeError("Unknown backend cuda")

    monkeypatch.setattr("mpjax._src.report.targets.h100_topology", no_plugin)
    with pytest.raises(RuntimeError, match="pip install --no-deps jax-cuda1") as info:
        mpjax.report(lambda x: x, jnp.ones(2), target="h100x8")
    assert "JAX_PLATFORMS=cpu" in str(info.value) and "Unknown backend cuda" in str(info.value)
    assert f"-plugin=={jaxlib.__version__} " in str(info.value)  # the installed jaxlib's


@pytest.mark.parametrize(
    ("jaxlib_version", "wheels"),
    [
        ("0.10.2", "jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2"),
        ("0.12.0.1", "jax-cuda12-plugin==0.12.0.1 jax-cuda12-pjrt==0.12.0.1"),
        ("0.12.1", "jax-cuda13-plugin==0.12.1 jax-cuda13-pjrt==0.12.1"),
        ("0.13.0", "jax-cuda13-plugin==0.13.0 jax-cuda13-pjrt==0.13.0"),
    ],
)
def test_the_install_hint_names_the_plugin_wheels_of_that_jaxlib(jaxlib_version, wheels):
    assert f"pip install --no-deps {wheels} " in gpu_aot_install(jaxlib_version)


class _FailingCompile:
    """A jitted function whose compile fails as XLA's deviceless cuDNN compile does on 0.12.1."""

    __name__ = "attention_step"

    def __init__(self, message):
        self.message = message

    def trace(self, *args, **kwargs):
        return self

    def lower(self):
        return self

    def compile(self):
        raise jax.errors.JaxRuntimeError(self.message)


@pytest.mark.parametrize(
    "message",
    [
        "FAILED_PRECONDITION: StreamExecutor is null and deviceless cuDNN compilation is not "
        "enabled\n\nSuspected Python Code Location: ...",
        "FAILED_PRECONDITION: Deviceless cuDNN compilation requires cuDNN >= 9.8; failed to "
        "resolve cuDNN support for custom call: __cudnn$fmhaSoftmax",
    ],
)
def test_a_deviceless_cudnn_failure_says_where_it_compiles(message):
    with pytest.raises(RuntimeError, match="attention_step does not compile for cpu") as info:
        mpjax.report(_FailingCompile(message), jnp.ones(2))
    said = str(info.value)
    assert message.split("\n")[0] in said
    assert "jax-cuda12-plugin==0.10.2" in said and 'implementation="xla"' in said


def test_other_compile_failures_get_no_cudnn_hint():
    with pytest.raises(RuntimeError, match="does not compile") as info:
        mpjax.report(_FailingCompile("RESOURCE_EXHAUSTED: out of memory"), jnp.ones(2))
    assert str(info.value).endswith("JaxRuntimeError: RESOURCE_EXHAUSTED: out of memory")


def test_a_function_that_does_not_compile_is_named_with_the_cause():
    def bad_step(x):
        return x @ jnp.ones((3, 5))

    with pytest.raises(RuntimeError, match=r"bad_step does not compile for cpu: TypeError: dot_"):
        mpjax.report(bad_step, jnp.ones((2, 4)))
