"""CI guard: mpjax's GPU programs (deviceless H100 compile, GPU cost model) are no worse than
the hand-written Flax bf16 anchor in what the HLO shows.

The benchmark suite's cost-model cases (`benchmarks/run.py --quick --only cost/`) and its
optimizer-step cases (`--only opt-step/`, 120 leaves) run in a subprocess under the python named by
`$MPJAX_GPU_AOT_PYTHON` (a second environment with the `gpu-aot` wheels; `.ci/run` makes it),
with `JAX_PLATFORMS=cpu`, so this suite's environment keeps no CUDA plugin. Without the
variable the guard fails under CI (`CI=true`) and is skipped elsewhere, saying why.

Checks, per (model, mpjax low-precision variant), against the anchor `bf16` of the same run:
- `f32-matmul`: no more float32 dots/convolutions than the anchor has;
- `converts`: convert ops <= 1.05x the anchor's; `convert-kernels` (materialised casts)
  <= ceil(1.05x) the anchor's;
- `temp`: temp memory <= 1.02x; `roofline`: <= 1.01x (fp16 + loss scaling: 1.02x).
Loss scaling: the loss-scaled optimizer step <= 1.15x the bare optax step's bytes and
<= 130 kernels (120 leaves); the full fp16 train step (the cost model's models and
the opt-step MLP) <= 1.05x the same step without scaling.

Checks failing on today's code are marked `xfail(strict=True)` with the reason: when a fix
lands the check passes, strict xfail turns that into a failure, and the mark goes.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers.gpu import quick_rows, run_suite

TEMP_MARGIN, ROOFLINE_MARGIN, FP16_ROOFLINE_MARGIN, CONVERT_MARGIN = 1.02, 1.01, 1.02, 1.05
OPT_BYTES_MARGIN, OPT_MAX_KERNELS, FP16_STEP_BYTES_MARGIN = 1.15, 130, 1.05

KNOWN_FAILING = {
    # Quick size only (14 MiB of temp): the fp16 LM without loss scaling is already 1.054x
    # the bf16 anchor's temp there, with loss scaling 1.072x; at full size 1.001x
    # (benchmarks/results.json), within the margin.
    ("lm", "fp16-scaled", "temp"): "quick-size fp16 LM temp buffers; 1.001x at full size",
    # (The policy, policy-rules and autocast LM temp marks went when their GELU stopped
    # keeping tanh(...) for the backward: tests/autocast/test_activation_residuals.py.)
    # autocast runs the float32 model's `x + positions` in float32 (its widest input, as
    # torch.autocast does) where the expert casts first: 157 converts against 145, none of
    # them materialised (13 convert kernels each).
    ("lm", "autocast", "converts"): "float32 positions add under autocast; fused converts only",
}
MPJAX_PATHS = {
    "resnet": (
        "policy",
        "policy-rules",
        "autocast",
        "fp16-scaled",
        "convbn",
        "convbn-xla",
        "convbn-rules",
        "convbn-rules-xla",
    ),
    "lm": ("policy", "policy-rules", "autocast", "fp16-scaled"),
}
CHECKS = ("f32-matmul", "converts", "convert-kernels", "temp", "roofline")


def _case(model, variant, check):
    reason = KNOWN_FAILING.get((model, variant, check))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(model, variant, check, marks=marks, id=f"{model}-{variant}-{check}")


@pytest.fixture(scope="module")
def cost(tmp_path_factory):
    # the rows the checks read (not the LM's fused-loss ones or bf16-xla: each row a compile)
    # (compiled once per session: tests/report/test_report_gpu.py reads four of them)
    rows = [
        f"cost/{model}/{variant}@h100"
        for model, paths in MPJAX_PATHS.items()
        for variant in ("fp32", "bf16", "fp16-bare", *paths)
    ]
    figures = quick_rows(rows, tmp_path_factory)
    return {(model, variant): f for (model, variant, _), f in figures.items()}


@pytest.fixture(scope="module")
def opt_step(tmp_path_factory):
    """The optimizer step of 120 leaves and the fp16 MLP train step (full size: seconds)."""
    # only the rows the tests read (the table has 13: each is a compile)
    rows = ("opt-blocks/optax-adam", "opt-blocks/loss-scaled", "opt-blocks/loss-scaled-bf16-params")
    rows += ("mlp/bare", "mlp/loss-scaled")
    only = ",".join(f"opt-step/{r}@" for r in rows)
    figures = run_suite("--only", only, tmp=tmp_path_factory.mktemp("k"))
    assert 4 * figures[("opt-blocks", "optax-adam", "h100")]["config"]["blocks"] == 120
    return {(model, variant): f for (model, variant, _), f in figures.items()}


def _f32_matmuls(r: dict) -> int:
    counts = {**r["gemms_by_dtype"]}
    for key, n in r["convs_by_dtype"].items():
        counts[key] = counts.get(key, 0) + n
    return sum(n for key, n in counts.items() if "f32" in key.split("x"))


@pytest.mark.slow
def test_cost_model_sees_float32_matmuls_and_the_anchor_has_none(cost):
    for model in MPJAX_PATHS:
        fp32, anchor = cost[(model, "fp32")], cost[(model, "bf16")]
        assert _f32_matmuls(fp32) > 0 and _f32_matmuls(anchor) == 0, model
        assert fp32["roofline_s"] > 1.2 * anchor["roofline_s"], model  # bf16 pays on the model
        assert fp32["temp_bytes"] > anchor["temp_bytes"], model


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,variant,check",
    [_case(m, v, c) for m, variants in MPJAX_PATHS.items() for v in variants for c in CHECKS],
)
def test_mpjax_path_no_worse_than_hand_written_bf16(cost, model, variant, check):
    r, anchor = cost[(model, variant)], cost[(model, "bf16")]
    if check == "f32-matmul":
        assert _f32_matmuls(r) <= _f32_matmuls(anchor), (r["gemms_by_dtype"], r["convs_by_dtype"])
    elif check == "converts":
        assert r["converts"] <= CONVERT_MARGIN * anchor["converts"], (r, anchor["converts"])
    elif check == "convert-kernels":
        limit = math.ceil(CONVERT_MARGIN * anchor["convert_kernels"])
        assert r["convert_kernels"] <= limit, (r["convert_kernels"], limit)
    elif check == "temp":
        ratio = r["temp_bytes"] / anchor["temp_bytes"]
        assert ratio <= TEMP_MARGIN, f"temp {ratio:.3f}x the anchor's"
    else:
        margin = FP16_ROOFLINE_MARGIN if variant.startswith("fp16") else ROOFLINE_MARGIN
        ratio = r["roofline_s"] / anchor["roofline_s"]
        assert ratio <= margin, f"roofline {ratio:.3f}x the anchor's"


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MPJAX_PATHS))
def test_fp16_train_step_bytes_near_the_unscaled_step(cost, model):
    ratio = cost[(model, "fp16-scaled")]["bytes"] / cost[(model, "fp16-bare")]["bytes"]
    assert ratio <= FP16_STEP_BYTES_MARGIN, f"{ratio:.3f}x the bytes of the unscaled step"


@pytest.mark.slow
def test_fp16_mlp_train_step_bytes_near_the_unscaled_step(opt_step):
    """The full fp16 train step (60-layer MLP): mpjax's default vs the bare step."""
    bare = opt_step[("mlp", "bare")]
    ratio = opt_step[("mlp", "loss-scaled")]["bytes"] / bare["bytes"]
    assert ratio <= FP16_STEP_BYTES_MARGIN, f"{ratio:.3f}x the bytes of the unscaled step"


def _opt_rows(opt_step):
    bare = opt_step[("opt-blocks", "optax-adam")]
    # float32 params, bf16 params with float32 master
    scaled = {p: opt_step[("opt-blocks", v)] for p, v in (("f32", "loss-scaled"),)}
    scaled["bf16"] = opt_step[("opt-blocks", "loss-scaled-bf16-params")]
    return bare, scaled


@pytest.mark.slow
def test_loss_scaled_optimizer_step_bytes(opt_step):
    bare, scaled = _opt_rows(opt_step)
    for params, d in scaled.items():
        ratio = d["bytes"] / bare["bytes"]
        assert ratio <= OPT_BYTES_MARGIN, f"{params}: {ratio:.3f}x bare optax adam's bytes"


@pytest.mark.slow
def test_loss_scaled_optimizer_step_kernels(opt_step):
    bare, scaled = _opt_rows(opt_step)
    assert bare["kernels"] >= 120  # at least one kernel per leaf: the count is real
    for params, d in scaled.items():
        assert d["kernels"] <= OPT_MAX_KERNELS, f"{params}: {d['kernels']} kernels"


MULTI_GPU_BYTES_MARGIN = 1.01
SHARD_SIZED_OPS = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _multi_gpu_quick(tmp, model: str, variants: str, target: str = "h100x8") -> dict:
    """The suite's multi-gpu cases at quick size on 8 deviceless H100s: variant -> figures."""
    size = "gpt2x8" if model == "lm" else "fullx8"
    only = ",".join(f"multi-gpu/{model}:{size}/{v}@{target}" for v in variants.split(","))
    figures = run_suite("--quick", "--only", only, tmp=tmp)
    return {variant: f for (_, variant, _), f in figures.items()}


@pytest.fixture(scope="module")
def multi_gpu(tmp_path_factory):
    variants = "bf16,fp16-scaled,fp16-scaled-pallas,fp8-tensorwise"
    return _multi_gpu_quick(tmp_path_factory.mktemp("m"), "lm", variants)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fp16-scaled", "fp16-scaled-pallas"])
def test_loss_scaled_fsdp_moves_no_more_than_hand_written(multi_gpu, variant):
    """FSDP on 8 H100s: loss scaling adds no gradient- or shard-sized collective."""
    anchor, r = multi_gpu["bf16"], multi_gpu[variant]
    assert r["collective_bytes"] <= MULTI_GPU_BYTES_MARGIN * anchor["collective_bytes"]
    for key, v in r["by_op_dtype"].items():
        if key.split()[0] in SHARD_SIZED_OPS:
            # Same count as the anchor's ops of that kind (float16 where the anchor has bf16).
            twin = anchor["by_op_dtype"].get(key.replace("f16", "bf16"), {"count": 0})
            assert v["count"] <= twin["count"], (key, v, twin)


@pytest.mark.slow
def test_fp8_tensorwise_fsdp_gathers_weight_shards_in_fp8(multi_gpu):
    """FSDP on 8 H100s: current-scaling fp8 (`autocast(fp8=Fp8Recipe())`) quantises each
    weight shard with the combined amax and gathers fp8, fewer gather bytes than the anchor."""

    def gathers(r):
        return {k: v for k, v in r["by_op_dtype"].items() if k.startswith("all-gather")}

    fp8, anchor = gathers(multi_gpu["fp8-tensorwise"]), gathers(multi_gpu["bf16"])
    assert any(k.endswith(("f8e4m3fn", "f8e5m2")) for k in fp8), fp8
    assert sum(v["bytes"] for v in fp8.values()) < sum(v["bytes"] for v in anchor.values())


@pytest.fixture(scope="module")
def resnet_dp(tmp_path_factory):
    # the variants the checks read (they compare with fp16-bare and convbn-xla: no bf16 row)
    variants = "fp16-bare,fp16-scaled,fp16-scaled-pallas,convbn-xla,convbn-pallas"
    return _multi_gpu_quick(tmp_path_factory.mktemp("r"), "resnet", variants)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fp16-scaled", "fp16-scaled-pallas"])
def test_loss_scaled_data_parallel_adds_only_scalar_collectives(resnet_dp, variant):
    """ResNet data parallel on 8 H100s: loss scaling moves no more than the fp16 step it
    wraps (no added gather/scatter; total bytes within 1 %)."""
    bare, r = resnet_dp["fp16-bare"], resnet_dp[variant]
    assert r["collective_bytes"] <= MULTI_GPU_BYTES_MARGIN * bare["collective_bytes"]
    for key, v in r["by_op_dtype"].items():
        if key.split()[0] in SHARD_SIZED_OPS:
            twin = bare["by_op_dtype"].get(key, {"count": 0})
            assert v["count"] <= twin["count"], (key, v, twin)


@pytest.mark.slow
def test_convbn_pallas_data_parallel_gathers_no_activations(resnet_dp):
    """ResNet data parallel on 8 H100s: ConvBN's Pallas kernels run on each GPU's batch shard
    (`per_row_shard`), so they move no more than the XLA forms of the same layer."""
    xla, pallas = resnet_dp["convbn-xla"], resnet_dp["convbn-pallas"]
    gathers = {k: v for k, v in pallas["by_op_dtype"].items() if k.startswith("all-gather")}
    assert not gathers, gathers
    assert pallas["collective_bytes"] <= MULTI_GPU_BYTES_MARGIN * xla["collective_bytes"]


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    variants = "bf16,fp16-scaled,fp16-scaled-pallas"
    return _multi_gpu_quick(tmp_path_factory.mktemp("h"), "lm", variants, "h100x2x4-hsdp")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fp16-scaled", "fp16-scaled-pallas"])
def test_loss_scaled_hsdp_crosses_hosts_no_more_than_hand_written(hsdp, variant):
    """HSDP on 2 hosts x 4 H100s (state split within a host): the parameter gathers and
    gradient reduce-scatters stay on NVLink, and loss scaling adds nothing inter-host
    beyond the anchor's (its flag all-reduce is a few bytes)."""
    anchor, r = hsdp["bf16"], hsdp[variant]
    assert 0 < anchor["link_bytes"]["inter"] < anchor["link_bytes"]["intra"], anchor["link_bytes"]
    assert r["link_bytes"]["inter"] <= MULTI_GPU_BYTES_MARGIN * anchor["link_bytes"]["inter"]
    assert r["comm_s_links"] < r["comm_s_inter_host"]  # the by-link estimate sees NVLink
