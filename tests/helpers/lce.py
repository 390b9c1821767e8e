"""The float64 reference of `mpjax.nn.linear_cross_entropy` and a StableHLO GEMM reader,
shared by its tests.

The reference is written from the spec: logits = x @ kernel + bias (the inputs as given,
the product in float64), per-token loss logsumexp - logit[label] + z * lse**2, the mean
over the tokens whose label is not `ignore_index`.
"""

from __future__ import annotations

import re

import numpy as np


def reference(x, k, labels, ignore_index=None, z_loss=0.0, bias=None):
    """The unfused loss in float64 (numpy), and its gradients (x [N, d], kernel, bias)."""
    k = np.asarray(k, np.float64)
    x = np.asarray(x, np.float64).reshape(-1, k.shape[0])
    bias = np.zeros(k.shape[1]) if bias is None else np.asarray(bias, np.float64)
    labels = np.asarray(labels).reshape(-1)
    valid = np.ones_like(labels, bool) if ignore_index is None else labels != ignore_index
    logits = x @ k + bias
    m = logits.max(1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(1, keepdims=True)))[:, 0]
    safe = np.where(valid, labels, 0)
    per = lse - logits[np.arange(len(labels)), safe] + z_loss * lse**2
    n = max(valid.sum(), 1)
    loss = per[valid].sum() / n
    p = np.exp(logits - lse[:, None])
    dlogits = (1 + 2 * z_loss * lse)[:, None] * p
    dlogits[np.arange(len(labels)), safe] -= 1.0
    dlogits *= valid[:, None] / n
    return loss, dlogits @ k.T, x.T @ dlogits, dlogits.sum(0)


def gemm_types(stablehlo: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) tensor types of every `dot_general` of a StableHLO text."""
    pattern = r"dot_general.*: \((tensor<\S+>), (tensor<\S+>)\) -> (tensor<\S+>)"
    return re.findall(pattern, stablehlo)


def assert_gemms_bf16(stablehlo: str, count: int = 4, only: str | None = None) -> None:
    """`count` GEMMs (the loss alone: two forward, as the backward recomputes, and two
    backward), each with bfloat16 operands and a float32 result; with `only`, the GEMMs
    with a tensor type containing it (e.g. the vocabulary size, `"x37x"`)."""
    dots = [t for t in gemm_types(stablehlo) if only is None or any(only in s for s in t)]
    assert len(dots) == count, dots
    assert all(a.endswith("xbf16>") and b.endswith("xbf16>") for a, b, _ in dots), dots
    assert all(out.endswith("xf32>") for _, _, out in dots), dots
