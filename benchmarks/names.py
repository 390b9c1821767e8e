"""The benchmark suite's run names in words, and figures in units a person reads.

The docs' tables name each row in words with its variant id in small text after it (the id
is what `python benchmarks/run.py --only` takes); sizes are GiB or MiB, never byte counts.

>>> words("fp16-bare")
'float16 policy, no loss scaling'
>>> human_bytes(689213824)
'657 MiB'
"""

from __future__ import annotations

import ast
import re

GIB, MIB = 2**30, 2**20

# variant id -> what it is, in words (the programs are in train_variants.py, fp8_variants.py
# and state_variants.py).
WORDS = {
    "fp32": "float32 model",
    "bf16": "hand-written Flax bf16 (the anchor)",
    "bf16-xla": "hand-written Flax bf16, XLA attention",
    "policy": "apply_policy, one bf16 policy",
    "policy-rules": "apply_policy, per-module rules",
    "autocast": "autocast (jaxpr rewrite)",
    "fp16-scaled": "float16 policy + loss scaling",
    "fp16-bare": "float16 policy, no loss scaling",
    "fp16-hand": "hand-written Flax float16, no loss scaling",
    "fp16-scaled-pallas": "float16 + loss scaling, Pallas finite check",
    "policy-noop-scaled": "bf16 policy + loss_scaled, no scaling",
    "convbn": "fused Conv+BatchNorm (ConvBN)",
    "convbn-xla": "fused Conv+BatchNorm, XLA epilogue",
    "convbn-pallas": "fused Conv+BatchNorm, Pallas epilogue",
    "convbn-rules": "fused Conv+BatchNorm, per-module rules",
    "convbn-rules-xla": "fused Conv+BatchNorm, rules, XLA epilogue",
    "bf16-lce": "hand-written bf16 + fused loss",
    "policy-lce": "apply_policy + fused loss",
    "bf16-params-master": "bf16 params, float32 master",
    "bf16-params-remainder": "bf16 params, remainder master",
    "bf16-params-remainder-bf16-state": "bf16 params, remainder, bf16 AdamW state",
    "bf16-params-remainder-int8-state": "bf16 params, remainder, int8 AdamW state",
    "fp8-tensorwise": "fp8, tensorwise current scaling",
    "fp8-rowwise": "fp8, rowwise current scaling",
    "fp8-delayed": "fp8, delayed scaling (apply_policy)",
    "flax-fp8": "Flax fp8_ops (quantise-dequantise)",
    "flax-fp8-direct": "Flax fp8_ops, fp8 operands",
    "fp8-blockwise": "fp8 blockwise (DeepSeek-V3), Pallas kernel",
    "fp8-blockwise-emulated": "fp8 blockwise, emulated in bf16",
    "fp8-mxfp8": "MXFP8 (block-scaled fp8)",
    "fp8-nvfp4": "NVFP4 (block-scaled fp4)",
    "fp8-blockwise-roofline": "fp8 blockwise, per-GEMM choice from the H100 roofline",
    "fp8-mxfp8-roofline": "MXFP8, per-GEMM choice from the B200 roofline",
    "fp8-nvfp4-roofline": "NVFP4, per-GEMM choice from the B200 roofline",
    "fp8-blockwise-copies": "fp8 blockwise, weights quantised once per accumulated step",
    "fp8-mxfp8-copies": "MXFP8, weights quantised once per accumulated step",
    "fp8-nvfp4-copies": "NVFP4, weights quantised once per accumulated step",
    "fp8-conv": "fp8 recipe, convolutions in bf16",
    "fp8-1x1": "fp8 1x1 convolutions",
    "fp8-1x1-min256": "fp8 1x1 convolutions of 256+ channels",
    "fp8-1x1-min512": "fp8 1x1 convolutions of 512+ channels",
    "nnx-bf16": "Flax NNX, bf16 policy (the anchor)",
    "nnx-fp8-delayed": "Flax NNX, fp8 delayed scaling",
    "optax-adam": "bare optax Adam (the anchor)",
    "bare": "bare optax step (the anchor)",
    "flax-dynamic-scale": "Flax DynamicScale",
    "apply-if-finite": "optax.apply_if_finite + static scale",
    "loss-scaled": "mpjax.loss_scaled",
    "loss-scaled-pallas": "mpjax.loss_scaled, Pallas finite check",
    "loss-scaled-bf16-params": "mpjax.loss_scaled, bf16 params",
    "loss-scaled-pallas-bf16-params": "loss_scaled, Pallas check, bf16 params",
    "jmp": "the jmp pattern",
}

MODELS = {"lm": "GPT-2 small", "wide": "wide LM", "resnet": "ResNet-50", "lm-nnx": "GPT-2 small"}


def words(variant: str) -> str:
    """The variant's description in words, or the id itself when it has none.

    Args:
      variant: a variant id of `benchmarks/cases.py` (`"fp16-bare"`).

    Returns:
      The words (`"float16 policy, no loss scaling"`).

    >>> words("no-such-variant")
    'no-such-variant'
    """
    return WORDS.get(variant, variant)


def named(variant: str) -> str:
    """A table cell: the variant in words, its id in small text after it (HTML).

    Args:
      variant: a variant id.

    Returns:
      `"words <small>id</small>"`, or the id alone when it has no words.

    >>> named("convbn-xla")
    'fused Conv+BatchNorm, XLA epilogue <small>convbn-xla</small>'
    """
    said = words(variant)
    return variant if said == variant else f"{said} <small>{variant}</small>"


def human_bytes(n: float) -> str:
    """A byte count in GiB (2 decimals) from 1 GiB up, else MiB (3 significant digits).

    Args:
      n: bytes.

    Returns:
      The size with its unit.

    >>> human_bytes(10.11 * 2**30), human_bytes(3 * 2**20), human_bytes(2**20 * 0.5)
    ('10.11 GiB', '3 MiB', '0.5 MiB')
    """
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.3g} MiB"


def number(value: float) -> str:
    """A float for a table: 4 significant digits, never an exponent from 1e4 up.

    Args:
      value: the number.

    Returns:
      `10350` for 1.035e4, `0.964` for 0.964, `1.5e-05` for tiny values.

    >>> number(10350.4), number(0.96412), number(5761.0)
    ('10350', '0.9641', '5761')
    """
    if abs(value) >= 1e4:
        return f"{value:.0f}"
    return f"{value:.4g}"


_SIZE_WORDS = {
    "layers": "{} layers", "d": "width {}", "heads": "{} heads", "mlp": "MLP width {}",
    "seq": "sequence {}", "batch": "batch {}", "vocab": "vocabulary {}",
}  # fmt: skip
_SIZES = re.compile(r"\{'layers'[^{}]*\}")


def sizes_in_words(text: str) -> str:
    """`text` with each model-size dict a study printed (`{'layers': 12, 'd': 768, ...}`)
    written out in words.

    Args:
      text: a study's notes.

    Returns:
      The notes, every size dict replaced.

    >>> sizes_in_words("sizes {'layers': 12, 'd': 768, 'vocab': 50304} (batch: global).")
    'sizes 12 layers, width 768, vocabulary 50304 (batch: global).'
    """

    def say(m: re.Match) -> str:
        sizes = ast.literal_eval(m.group(0))
        return ", ".join(_SIZE_WORDS.get(k, k + " {}").format(v) for k, v in sizes.items())

    return _SIZES.sub(say, text)
