"""Convergence of each training-state memory mode: the char-LM and digits examples.

Trained by the examples' own `train` functions (imported, not run as scripts), bfloat16
compute, against the run with float32 AdamW state:

- char-LM (`examples/train_char_lm.py`, its default 500 steps, seeds 0..n-1): validation bits
  per byte with the AdamW state in float32, bfloat16 stochastic and bfloat16 nearest
  (float32 params); then bfloat16-stored params with a float32 master, with
  `master_weights="remainder"` (which must train bit for bit like the float32 master:
  same losses, same metric, same masters) and with the remainder and bfloat16 stochastic
  state (the 8 bytes/param mode); then 8-bit (int8 blockwise) state with float32 params,
  rounded to nearest and stochastically, and with bfloat16 params and the remainder (the
  6 bytes/param mode).
- digits (`examples/train_digits.py`, its default 300 steps, seeds 0..n-1, the same
  seeds for every mode): test accuracy with the state in float32 / bfloat16 stochastic /
  bfloat16 nearest / int8.

Each row also gives the bytes per parameter of its trained state (params + optimizer
state, every leaf of the pytree, over the number of params).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import mpjax

__all__ = ["CHAR_LM_MODES", "DIGITS_MODES", "char_lm", "digits", "run"]

# name -> CharLMConfig fields (on top of precision="bf16"); the first is the reference.
CHAR_LM_MODES: dict[str, dict[str, str]] = {
    "float32 state": {},
    "bf16 state, stochastic": {"optimizer_state": "bf16"},
    "bf16 state, nearest": {"optimizer_state": "bf16-nearest"},
    "bf16 params + float32 master": {"param_dtype": "bf16"},
    "bf16 params + remainder": {"param_dtype": "bf16", "master_weights": "remainder"},
    "bf16 params + remainder + bf16 state, stochastic": {
        "param_dtype": "bf16",
        "master_weights": "remainder",
        "optimizer_state": "bf16",
    },
    "int8 state": {"optimizer_state": "int8"},
    "int8 state, stochastic": {"optimizer_state": "int8-stochastic"},
    "bf16 params + remainder + int8 state": {
        "param_dtype": "bf16",
        "master_weights": "remainder",
        "optimizer_state": "int8",
    },
}
# The pair that must train bit for bit alike.
IDENTICAL_PAIR = ("bf16 params + float32 master", "bf16 params + remainder")
# name -> DigitsConfig.optimizer_state; the first is the reference.
DIGITS_MODES = {
    "float32 state": "f32",
    "bf16 state, stochastic": "bf16",
    "bf16 state, nearest": "bf16-nearest",
    "int8 state": "int8",
}
QUICK_CHAR_LM = dict(
    steps=20, batch_size=8, seq_len=32, d_model=32, num_layers=1, num_heads=2, eval_windows=8
)
QUICK_DIGITS = dict(steps=30, batch_size=64, width=8, num_blocks=1, learning_rate=2e-2)


def bytes_per_param(params: Any, opt_state: Any) -> float:
    """Bytes of params + optimizer state (every leaf) over the number of params."""

    def nbytes(tree):
        return sum(np.size(x) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    n = sum(np.size(p) for p in jax.tree.leaves(params))
    return (nbytes(params) + nbytes(opt_state)) / n


def _differing(a: Any, b: Any) -> int:
    """How many elements of two same-structured pytrees differ in their bits."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise ValueError("differently structured pytrees")
    count = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            raise ValueError(f"{x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
        count += int((x.view(width) != y.view(width)).sum())
    return count


def bit_identical(a, b) -> dict[str, Any]:
    """How alike two `RunResult`s trained: losses and metric equal, differing master elements."""
    masters = [mpjax.master_params(r.opt_state, r.params) for r in (a, b)]
    return {
        "losses": _differing(a.history["loss"], b.history["loss"]) == 0,
        "metric": a.metric == b.metric,
        "masters": _differing(*masters) == 0,
        "differing_master_elements": _differing(*masters),
    }


def char_lm(quick: bool = False, seeds: int = 1) -> dict:
    """Every `CHAR_LM_MODES` run of the char-LM example; rows and the bit-identity check."""
    from examples.train_char_lm import CharLMConfig, load_corpus, make_train_fns, train

    corpus = load_corpus(200_000 if quick else 2_000_000)
    sizes = QUICK_CHAR_LM if quick else {}
    runs = {}
    for name, fields in CHAR_LM_MODES.items():
        config = CharLMConfig(precision="bf16", **sizes, **fields)
        fns = make_train_fns(config)
        runs[name] = [train(config, s, corpus=corpus, fns=fns) for s in range(seeds)]
        bpb = np.mean([r.metric for r in runs[name]])
        print(f"[memory] char-LM {name}: {bpb:.4f} bits/byte ({seeds} seeds)", flush=True)
    ref = np.array([r.metric for r in next(iter(runs.values()))])
    rows = []
    for name, rs in runs.items():
        fields = {"optimizer_state": "f32", "param_dtype": "f32", "master_weights": "auto"}
        fields.update(CHAR_LM_MODES[name])
        bpb = np.array([r.metric for r in rs])
        rows.append(
            {
                "mode": name,
                **fields,
                "val_bits_per_byte": float(bpb.mean()),
                "val_bits_per_byte_std": float(bpb.std(ddof=1)) if seeds > 1 else 0.0,
                "vs_float32_state_pct": float(100.0 * (bpb.mean() / ref.mean() - 1.0)),
                "per_seed": [float(b) for b in bpb],
                "bytes_per_param": bytes_per_param(rs[0].params, rs[0].opt_state),
                "wall_s": float(sum(r.wall_s for r in rs)),
            }
        )
    checks = [bit_identical(a, b) for a, b in zip(*(runs[n] for n in IDENTICAL_PAIR), strict=True)]
    config = CharLMConfig(precision="bf16", **sizes)
    return {
        "steps": config.steps,
        "seeds": seeds,
        "rows": rows,
        "bit_identical": {
            "pair": list(IDENTICAL_PAIR),
            **{k: all(c[k] for c in checks) for k in ("losses", "metric", "masters")},
            "per_seed": checks,
        },
    }


def digits(quick: bool = False, seeds: int = 10) -> dict:
    """Every `DIGITS_MODES` run of the digits example over seeds 0..seeds-1."""
    from examples.train_digits import DigitsConfig, load_data, make_train_fns, train

    data = load_data()
    sizes = QUICK_DIGITS if quick else {}
    accs, bytes_pp = {}, {}
    for name, state in DIGITS_MODES.items():
        config = DigitsConfig(precision="bf16", optimizer_state=state, **sizes)
        fns = make_train_fns(config)
        runs = [train(config, s, data=data, fns=fns) for s in range(seeds)]
        accs[name] = np.array([r.metric for r in runs])
        bytes_pp[name] = bytes_per_param(runs[0].params, runs[0].opt_state)
        print(f"[memory] digits {name}: {accs[name].mean():.2f} % ({seeds} seeds)", flush=True)
    ref = next(iter(accs.values()))
    rows = []
    for name, acc in accs.items():
        rows.append(
            {
                "mode": name,
                "optimizer_state": DIGITS_MODES[name],
                "accuracy_mean": float(acc.mean()),
                "accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
                "vs_float32_state_pp": float(acc.mean() - ref.mean()),
                "accuracies": [float(a) for a in acc],
                "bytes_per_param": bytes_pp[name],
            }
        )
    config = DigitsConfig(precision="bf16", **sizes)
    return {"steps": config.steps, "seeds": seeds, "test_images": len(data.y_test), "rows": rows}


def run(quick: bool = False, char_lm_seeds: int = 1, digits_seeds: int = 5) -> dict:
    """Both examples' convergence sections."""
    return {"char_lm": char_lm(quick, char_lm_seeds), "digits": digits(quick, digits_seeds)}
