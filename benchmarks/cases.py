"""The benchmark suite: every model, variant and case, registered once.

`MODELS` maps a model name to its sizes and variants (the builders of
`benchmarks/train_variants.py`, `fp8_variants.py` and `state_variants.py`); `CASES` lists
what `python benchmarks/run.py` measures. To add a benchmark:

1. add the variant's builder `fn(cfg) -> TrainProgram` to its model's mapping (e.g.
   `LM_VARIANTS` in `train_variants.py`);
2. add a line here, e.g. `Case("cost", "lm", "my-variant")` (a row of the H100 cost table,
   against the `bf16` anchor), or extend a `_grid(...)` below;
3. run `python benchmarks/run.py --only my-variant --resume` to add its record to the
   results file; `benchmarks/tables.py` puts it in its table and plot.

A study that is not one program (a training run, a timing of alternatives) is a case with
its own `measure=fn(case, quick) -> figures`: a function of `hlo_studies.py` (read from
compiled programs), `timing_studies.py` (timed on this host), `training_studies.py`
(training runs) or `gpu.py` (a real GPU), listed in `STUDIES`. Its models are in `train_models.py`.
"""

from __future__ import annotations

from types import MappingProxyType

from benchmarks import gpu
from benchmarks import hlo_studies as hlo
from benchmarks import timing_studies as timing
from benchmarks import training_studies as training
from benchmarks.blockwise_gemm_gpu import blockwise_gemm_gpu
from benchmarks.fp8_variants import (
    BLOCK_VARIANTS,
    FP8_CONV_VARIANTS,
    FP8_VARIANTS,
    NNX_VARIANTS,
)
from benchmarks.harness import Case, Model
from benchmarks.memory_switches import memory_switches
from benchmarks.state_variants import (
    MEMORY_LM_VARIANTS,
    MEMORY_MODES,
    MLP_VARIANTS,
    MULTI_LM_VARIANTS,
    MULTI_RESNET_VARIANTS,
    OPT_LM_VARIANTS,
    OPT_VARIANTS,
)
from benchmarks.train_models import LM_SIZES, RESNET_SIZES
from benchmarks.train_variants import (
    LM_FUSED_LOSS_VARIANTS,
    LM_VARIANTS,
    RESNET_VARIANTS,
    lm_config,
)

__all__ = ["CASES", "MODELS"]

LM_ALL = {**LM_VARIANTS, **LM_FUSED_LOSS_VARIANTS, **FP8_VARIANTS, **MULTI_LM_VARIANTS}
LM_ALL.update({**MEMORY_LM_VARIANTS, **BLOCK_VARIANTS})
RESNET_ALL = {**RESNET_VARIANTS, **FP8_CONV_VARIANTS, **MULTI_RESNET_VARIANTS}
MODELS = MappingProxyType(
    {
        "resnet": Model(RESNET_SIZES, "quick", "full", RESNET_ALL, split="replicated"),
        "lm": Model(LM_SIZES, "quick", "gpt2", LM_ALL, lm_config),
        "lm-nnx": Model(LM_SIZES, "quick", "gpt2", NNX_VARIANTS, lm_config),
        "opt-lm": Model(LM_SIZES, "quick", "gpt2", OPT_LM_VARIANTS, lm_config),
        "opt-blocks": Model({"120": {"blocks": 30, "width": 256}}, "120", "120", OPT_VARIANTS),
        "mlp": Model({"quick": timing.QUICK, "full": timing.FULL}, "quick", "full", MLP_VARIANTS),
    }
)


# Studies: cases that are not one program, each `measure(case, quick) -> figures` (a table:
# `title`, `columns`, `rows`, `notes`; the docs' tables read it by the table name).
STUDIES = (  # (table, target, measure)
    ("policy-cpu", "cpu", hlo.policy_cost),
    ("autocast-cpu", "cpu", hlo.autocast_hlo),
    ("step-overhead", "cpu", timing.step_overhead),
    ("inference", "cpu", timing.inference),
    ("data-parallel", "cpu", timing.data_parallel),  # 8 CPU devices in a child process
    ("reduce-dtype", "cpu", training.reduce_dtype),  # the same
    ("reduce-dtype-h100", "h100x8", training.reduce_dtype_h100),
    ("convergence", "cpu", training.memory_convergence),
    # Issue 29: per-GPU memory by switch (GPT-2 FSDP), the fused loss alone, the char-LM row.
    ("memory-switches", "h100x8", memory_switches),
    ("memory-switches-char-lm", "cpu", training.memory_switches_char_lm),
    ("lce-loss", "h100x8", hlo.lce_loss),
    ("kernels-gpu", "gpu", gpu.kernels_gpu),
    # Issue 45: the blockwise GEMM kernels alone (Mosaic GPU, Triton) against cuBLAS bf16/fp8.
    ("blockwise-gemm-gpu", "gpu", blockwise_gemm_gpu),
    # Issue 30: the forms of a blockwise fp8 GEMM on Hopper (the Pallas kernel ships).
    ("blockwise-hopper", "h100", hlo.blockwise_hopper_cost),
    ("blocks-convergence", "cpu", training.blocks_convergence),
)


def _grid(table, model, variants, targets=("h100",), **kw):
    return tuple(Case(table, model, v, t, **kw) for t in targets for v in variants)


BASE = ("fp32", "bf16", "policy", "policy-rules", "autocast", "fp16-scaled", "fp16-bare")
CONVBN = ("convbn", "convbn-xla", "convbn-rules", "convbn-rules-xla")
# The multi-GPU rows: some base variants, and every variant of state_variants.py's mappings.
MULTI_LM = ("bf16", "bf16-xla", "autocast", "fp16-scaled", *MULTI_LM_VARIANTS)
MULTI_LM += (*LM_FUSED_LOSS_VARIANTS, "fp8-delayed", "fp8-tensorwise")
MULTI_RESNET = ("bf16", "policy", "fp16-bare", "fp16-scaled", "convbn-xla")
MULTI_RESNET += tuple(MULTI_RESNET_VARIANTS)
HSDP_LM = ("bf16", "policy-noop-scaled", "fp16-scaled", "fp16-scaled-pallas")
X8 = ("h100x8", "h100x2x4")
BLOCKS_H100 = ("bf16", "fp8-tensorwise", "fp8-blockwise", "fp8-blockwise-emulated")
BLOCKS_H100 += ("fp8-blockwise-roofline", "fp8-blockwise-copies")
BLOCKS_B200 = ("bf16", "fp8-tensorwise", "fp8-mxfp8", "fp8-nvfp4")
BLOCKS_B200 += ("fp8-mxfp8-roofline", "fp8-nvfp4-roofline", "fp8-mxfp8-copies", "fp8-nvfp4-copies")

CASES = (
    # Full train steps on one H100 vs hand-written Flax bf16 (was gpu_cost_model.py).
    # Every base variant (train_variants.py) is a row: a new one appears here by itself.
    *_grid("cost", "resnet", RESNET_VARIANTS, report=True),
    *_grid("cost", "lm", LM_VARIANTS, report=True),
    *_grid("cost", "lm", LM_FUSED_LOSS_VARIANTS, report=True),  # the fused loss (issue 29)
    # fp8 (was fp8_cost.py, fp8_conv_cost.py, fp8_nnx_cost.py).
    *_grid("fp8", "lm", ("bf16", *FP8_VARIANTS)),
    *_grid("fp8", "lm", ("bf16", *FP8_VARIANTS), sizes=("quick", "wide")),
    *_grid("fp8-conv", "resnet", ("bf16", *FP8_CONV_VARIANTS)),
    # Block-scaled recipes against bf16 on their GPU (issue 30): GPT-2 small and the wide LM.
    *(
        c
        for sizes in (None, ("quick", "wide"))
        for c in (
            *_grid("blocks", "lm", BLOCKS_H100, ("h100",), sizes=sizes),
            *_grid("blocks", "lm", BLOCKS_B200, ("b200",), sizes=sizes),
        )
    ),
    *_grid("fp8-nnx", "lm-nnx", NNX_VARIANTS, anchor="nnx-bf16"),
    *_grid("fp8-nnx", "lm-nnx", NNX_VARIANTS, anchor="nnx-bf16", sizes=("quick", "wide")),
    # Loss scaling: optimizer step and fp16 train step (was kernel_count.py).
    *_grid("opt-step", "opt-blocks", OPT_VARIANTS, anchor="optax-adam"),
    *_grid("opt-step", "mlp", MLP_VARIANTS, anchor="bare"),
    # Memory modes: state, optimizer step, train step (was memory.py).
    *(
        Case("memory", m, v, anchor="state-master", label=MEMORY_MODES[v][0])
        for m in ("opt-lm", "lm")
        for v in MEMORY_MODES
    ),
    # 8 H100s: LM FSDP, ResNet data parallel, LM HSDP (was multi_gpu_cost.py).
    *_grid("multi-gpu", "lm", MULTI_LM, X8, sizes=("quickx8", "gpt2x8")),
    *_grid("multi-gpu", "resnet", MULTI_RESNET, X8, sizes=("quickx8", "fullx8")),
    *_grid("multi-gpu", "lm", HSDP_LM, ("h100x2x4-hsdp",), sizes=("quickx8", "gpt2x8")),
    # Throughput on a real GPU (skipped without one; was gpu.py).
    *_grid("gpu", "resnet", BASE[:-1] + CONVBN[:2], ("gpu",)),
    *_grid("gpu", "lm", BASE[:-1], ("gpu",)),
    *_grid("gpu", "lm", ("bf16", *FP8_VARIANTS), ("gpu",), sizes=("quick", "wide")),
    *_grid("gpu", "lm", ("fp8-blockwise",), ("gpu",), sizes=("quick", "wide")),
    *_grid("gpu", "lm", ("fp8-blockwise-emulated",), ("gpu",), sizes=("quick", "wide")),
    # Studies with their own measurement (timings on this host, training runs, a GPU).
    *(Case(t, "study", fn.__name__, target, anchor=None, measure=fn) for t, target, fn in STUDIES),
)
