"""Trains a small decoder-only transformer on the Python standard library's own sources.

The text is every top-level `.py` file of this interpreter's standard library (found with
`sysconfig`), concatenated in sorted order: real text, offline, no download. Tokens are
bytes (vocabulary 256); the metric is validation loss in bits per byte.

The model is a plain float32 Flax module; `apply_precision` rewrites its `apply` with
`mpjax.autocast` (a jaxpr-level rewrite, like `torch.autocast`). `train_digits.py` shows
the module-level alternative, `mpjax.apply_policy`.

Run from the repository root:

    python examples/train_char_lm.py                # fp32, bf16, fp16; table + results/char_lm.png
    python examples/train_char_lm.py --precisions bf16 --optimizer-state bf16  # bf16 AdamW state

The loss is `mpjax.nn.linear_cross_entropy` (the head GEMM in the compute dtype, the float32
softmax a vocabulary tile at a time, never the float32 logits); `--no-fused-loss` computes
the head's logits and optax's cross-entropy instead.
`--saved-activations float8_e4m3fn` keeps every GEMM input saved for the backward pass in
fp8 (`Policy(saved_activations=...)`; the GEMMs still run in the policy's compute dtype).

`--param-dtype bf16` stores the params in bfloat16 (`loss_scaled` then keeps their float32
master; `--master-weights remainder` keeps it as an int16 remainder: with bf16 state, 8
bytes per param of training state).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax
from examples.common import (
    DEFAULT_PRECISIONS,
    OPTIMIZER_STATES,
    PRECISIONS,
    RunResult,
    divergence_check,
    format_table,
    loss_scale_for,
    optimizer_with_state,
    plot_runs,
    policy_for,
    run_arg_parser,
    run_kwargs,
    summarise,
    timed,
    train_loop,
)
from mpjax.nn import linear_cross_entropy

__all__ = [
    "CharLMConfig",
    "CharTransformer",
    "FP8_RECIPE",
    "FP8_RECIPES",
    "PARAM_DTYPES",
    "SAVED_ACTIVATIONS",
    "Corpus",
    "apply_precision",
    "load_corpus",
    "main",
    "make_train_fns",
    "run_experiment",
    "train",
]

_LN2 = float(np.log(2.0))

# "fp8": the bf16 policy plus fp8 GEMMs (tensorwise current scaling, e4m3 forward, e5m2
# gradients). min_dim=16 so this small model's 64-wide GEMMs take part; the byte head
# (the top-level Dense) stays in bf16, as LM heads usually do.
FP8 = "fp8"
FP8_RECIPE = mpjax.Fp8Recipe(min_dim=16, exclude=("CharTransformer/Dense_0",))
# The block-scaled recipes (emulated on CPU: the format's numbers, not its speed), same GEMMs;
# NVFP4 keeps its default `high_precision_last` (the last 15 % of them, here the last block's
# MLP, in bf16, as NVIDIA's NVFP4 recipe keeps its last layers).
FP8_RECIPES = {
    FP8: FP8_RECIPE,
    **{
        name: mpjax.Fp8Recipe(scaling=name, min_dim=16, exclude=("CharTransformer/Dense_0",))
        for name in ("mxfp8", "nvfp4", "blockwise")
    },
}

# --saved-activations: how GEMM inputs are kept for the backward pass (None: as computed).
SAVED_ACTIVATIONS = (None, "float8_e4m3fn", "float8_e5m2")

# --param-dtype: the dtype the params are stored (and trained) in.
PARAM_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class CharLMConfig:
    """Hyper-parameters of one character-LM run.

    Attributes:
      precision: "fp32", "bf16", "fp16" (dynamic loss scaling), "fp16-noscale" or "fp8"
        (bf16 plus fp8 GEMMs, `FP8_RECIPE`), or a block-scaled recipe ("mxfp8", "nvfp4",
        "blockwise": `FP8_RECIPES`).
      steps: optimiser steps.
      batch_size: sequences per step.
      seq_len: tokens per sequence (also the model's maximum length).
      d_model: width of the residual stream.
      num_layers: transformer blocks.
      num_heads: attention heads.
      learning_rate: peak AdamW learning rate (linear warm-up, cosine decay).
      weight_decay: AdamW weight decay.
      eval_windows: validation sequences the metric averages over.
      initial_scale: initial dynamic loss scale (fp16 only).
      growth_interval: finite steps between loss-scale doublings (fp16 only).
      optimizer_state: "f32" (AdamW moments in float32), "bf16" (bfloat16, stochastic
        rounding: `mpjax.low_precision_state`), "bf16-nearest", "int8" (blockwise 8-bit codes,
        nearest rounding) or "int8-stochastic".
      master_weights: `loss_scaled`'s `master_weights` ("auto" or "remainder"; the
        remainder applies to bfloat16-stored params).
      param_dtype: how the params are stored: "f32", or "bf16" (initialised in float32,
        then rounded to bfloat16; `loss_scaled` keeps their float32 master, whole or as a
        remainder per `master_weights`).
      fused_loss: compute the loss with `mpjax.nn.linear_cross_entropy` from the final
        hidden states and the head's kernel and bias (the head GEMM in the compute dtype,
        the float32 softmax a vocabulary tile at a time, never the whole float32 logits);
        False: the head's logits, then optax's cross-entropy.
      saved_activations: None, or an fp8 format ("float8_e4m3fn"): the policy's
        `saved_activations` (GEMM inputs kept for the backward pass in fp8).
    """

    precision: str = "fp16"
    steps: int = 500
    batch_size: int = 32
    seq_len: int = 64
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    learning_rate: float = 1e-2
    weight_decay: float = 1e-2
    eval_windows: int = 128
    initial_scale: float = 2.0**15
    growth_interval: int = 100
    optimizer_state: str = "f32"
    master_weights: str = "auto"
    param_dtype: str = "f32"
    fused_loss: bool = True
    saved_activations: str | None = None

    def __post_init__(self):
        if self.saved_activations not in SAVED_ACTIVATIONS:
            raise ValueError(
                f"CharLMConfig.saved_activations={self.saved_activations!r}; choose from "
                f"{SAVED_ACTIVATIONS}"
            )
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"CharLMConfig.optimizer_state={self.optimizer_state!r}; choose from "
                f"{', '.join(OPTIMIZER_STATES)}"
            )
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(
                f"CharLMConfig.param_dtype={self.param_dtype!r}; choose from "
                f"{', '.join(PARAM_DTYPES)}"
            )
        if self.precision not in PRECISIONS and self.precision not in FP8_RECIPES:
            raise ValueError(
                f"CharLMConfig.precision={self.precision!r}; choose from "
                f"{', '.join([*PRECISIONS, *FP8_RECIPES])}"
            )
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "d_model",
            "num_layers",
            "num_heads",
            "eval_windows",
            "growth_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"CharLMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"CharLMConfig.d_model={self.d_model} is not divisible by "
                f"num_heads={self.num_heads}"
            )


class Corpus(NamedTuple):
    """Byte tokens (uint8) of the training and validation text, and the files they came from."""

    train: np.ndarray
    val: np.ndarray
    files: tuple[str, ...]


def load_corpus(max_bytes: int = 2_000_000, val_fraction: float = 0.1) -> Corpus:
    """Reads the standard library's top-level `.py` files, sorted, as one byte string.

    Args:
      max_bytes: keep at most this many bytes (the first ones, in file order).
      val_fraction: the last fraction of the bytes is the validation text.

    Returns:
      A `Corpus`.

    Raises:
      FileNotFoundError: when the interpreter ships no `.py` sources.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no .py files in the standard library directory {root} (sysconfig 'stdlib'); "
            "this example needs an interpreter that ships its sources"
        )
    chunks, total, used = [], 0, []
    for f in files:
        data = f.read_bytes()
        chunks.append(data)
        used.append(f.name)
        total += len(data)
        if total >= max_bytes:
            break
    tokens = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    split = int(len(tokens) * (1.0 - val_fraction))
    return Corpus(tokens[:split].copy(), tokens[split:].copy(), tuple(used))


class DecoderBlock(nn.Module):
    """Pre-LayerNorm block: causal self-attention and a GELU MLP, each with a residual."""

    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        d_model = x.shape[-1]
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(self.num_heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(d_model)(nn.gelu(nn.Dense(4 * d_model)(h)))
        return x + h


class CharTransformer(nn.Module):
    """A decoder-only transformer over bytes: embeddings, `num_layers` blocks, LayerNorm, head.

    A plain float32 Flax module: precision is applied from outside (`apply_precision`).
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_len: int = 64
    hidden_only: bool = False  # return the final LayerNorm's output (the loss owns the head)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        length = tokens.shape[-1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        x = x + nn.Embed(self.max_len, self.d_model)(jnp.arange(length))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.num_layers):
            x = DecoderBlock(self.num_heads)(x, mask)
        x = nn.LayerNorm()(x)
        return x if self.hidden_only else nn.Dense(self.vocab_size)(x)


def apply_precision(
    model: nn.Module, policy: mpjax.Policy, fp8: mpjax.Fp8Recipe | None = None
) -> Callable:
    """Returns `model.apply` rewritten by `mpjax.autocast` to run under `policy`.

    Params are used in the dtype they are given in (float32 here; their gradients come
    back in it); matmuls take `policy.compute_dtype` operands and accumulate in float32;
    LayerNorm statistics, softmax and other reductions run in float32; the logits leave
    in `policy.output_dtype`. `mpjax.apply_policy(model, policy)` is the module-level
    alternative (see `train_digits.py`). With an `fp8` recipe, the block GEMMs run in fp8
    (forward and backward; XLA:CPU emulates the fp8 arithmetic).
    """
    return mpjax.autocast(model.apply, policy, fp8=fp8)


class TrainFns(NamedTuple):
    """Compiled pieces of a run; build once per config and reuse across seeds.

    Attributes:
      tx: the optimiser.
      init: `(rng) -> (params, opt_state)`.
      step: `((params, opt_state), tokens, step) -> (carry, metrics)`.
      loss: `(params, tokens) -> mean cross-entropy (nats)`, for evaluation.
    """

    tx: optax.GradientTransformation
    init: Callable
    step: Callable
    loss: Callable


def make_train_fns(config: CharLMConfig) -> TrainFns:
    """Builds the jitted init / train step / eval loss of a character-LM run."""
    model = CharTransformer(
        d_model=config.d_model,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        max_len=config.seq_len,
    )
    fp8 = FP8_RECIPES.get(config.precision)
    base = "bf16" if fp8 else config.precision
    policy = policy_for(base).with_saved_activations(config.saved_activations)
    body = model.clone(hidden_only=True) if config.fused_loss else model
    apply = apply_precision(body, policy, fp8)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, max(1, config.steps // 10), config.steps
    )
    tx = mpjax.loss_scaled(
        optimizer_with_state(
            optax.adamw(schedule, weight_decay=config.weight_decay), config.optimizer_state
        ),
        loss_scale_for(
            base,
            initial_scale=config.initial_scale,
            growth_interval=config.growth_interval,
        ),
        master_weights=config.master_weights,
    )

    def loss(params, tokens):
        if config.fused_loss:  # the head (`Dense_0`) is applied by the loss
            hidden = apply({"params": params}, tokens[:, :-1])
            head = params["Dense_0"]
            return linear_cross_entropy(
                hidden, head["kernel"], tokens[:, 1:], bias=head["bias"], dtype=policy.compute_dtype
            )
        logits = apply({"params": params}, tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return ce.mean()

    def init(rng):
        params = model.init(rng, jnp.zeros((1, config.seq_len), jnp.int32))["params"]
        dtype = PARAM_DTYPES[config.param_dtype]
        params = jax.tree.map(lambda p: p.astype(dtype), params)
        return params, tx.init(params)

    def step(carry, tokens, step_index):
        del step_index
        params, opt_state = carry

        def scaled_loss(p):
            ce = loss(p, tokens)
            return mpjax.scale_loss(ce, opt_state), ce

        grads, ce = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        m = mpjax.scaling_metrics(opt_state)
        metrics = {
            "loss": ce,
            "loss_scale": m["loss_scale"],
            "grads_finite": m["grads_finite"],
            "skipped": m["skipped"],
            "skipped_steps": m["skipped_steps"],
        }
        return (params, opt_state), metrics

    return TrainFns(tx, jax.jit(init), jax.jit(step, donate_argnums=0), jax.jit(loss))


def _windows(tokens: np.ndarray, length: int, batch_size: int, seed: int) -> Iterator:
    """Endless batches of random windows of `length` tokens, as int32."""
    rng = np.random.default_rng(seed)
    if len(tokens) < length + 1:
        raise ValueError(f"text of {len(tokens)} bytes is shorter than a window of {length + 1}")
    while True:
        starts = rng.integers(0, len(tokens) - length, size=batch_size)
        yield np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def val_bits_per_byte(fns: TrainFns, params: Any, corpus: Corpus, config: CharLMConfig) -> float:
    """Validation cross-entropy in bits per byte over `eval_windows` evenly spaced windows."""
    length = config.seq_len + 1
    starts = np.linspace(0, len(corpus.val) - length, config.eval_windows).astype(int)
    windows = np.stack([corpus.val[s : s + length] for s in starts]).astype(np.int32)
    return float(fns.loss(params, windows)) / _LN2


def train(
    config: CharLMConfig,
    seed: int = 0,
    *,
    corpus: Corpus | None = None,
    fns: TrainFns | None = None,
    progress: bool = False,
) -> RunResult:
    """Trains the character LM once and evaluates it on the validation text.

    Args:
      config: hyper-parameters, including the precision.
      seed: seeds the initialisation and the windows drawn.
      corpus: the text; None loads it with `load_corpus()`.
      fns: compiled functions from `make_train_fns(config)` to reuse; None builds them.
      progress: show a tqdm bar.

    Returns:
      A `RunResult` with validation bits per byte as `metric` (lower is better).

    Example:
      >>> r = train(CharLMConfig(precision="bf16", steps=10, d_model=32, num_layers=1))
      >>> r.history["loss"].shape
      (10,)
    """
    corpus = load_corpus() if corpus is None else corpus

    base_precision = "bf16" if config.precision in FP8_RECIPES else config.precision

    def run():
        f = make_train_fns(config) if fns is None else fns
        carry = f.init(jax.random.key(seed))
        batches = _windows(corpus.train, config.seq_len + 1, config.batch_size, seed)
        carry, history = train_loop(
            f.step,
            carry,
            batches,
            config.steps,
            desc=f"{config.precision} seed {seed}",
            progress=progress,
            check_diverged=divergence_check(base_precision),
        )
        return val_bits_per_byte(f, carry[0], corpus, config), history, carry

    (bpb, history, (params, opt_state)), wall = timed(run)
    return RunResult(config.precision, seed, bpb, history, wall, params, opt_state)


def run_experiment(
    precisions: Sequence[str] = DEFAULT_PRECISIONS,
    seeds: int = 1,
    *,
    png: str | Path | None = "results/char_lm.png",
    progress: bool = True,
    max_bytes: int = 2_000_000,
    **config_kwargs: Any,
) -> tuple[list[RunResult], str]:
    """Trains every precision for `seeds` seeds; returns the runs and a Markdown table.

    Args:
      precisions: precision names.
      seeds: seeds per precision (0 .. seeds-1).
      png: where to write the loss / loss-scale plot; None writes none.
      progress: show a tqdm bar per run.
      max_bytes: bytes of standard-library source to use.
      **config_kwargs: `CharLMConfig` fields other than `precision`.

    Returns:
      `(runs, markdown_table)`.
    """
    corpus = load_corpus(max_bytes)
    results = []
    for precision in precisions:
        config = CharLMConfig(precision=precision, **config_kwargs)
        fns = make_train_fns(config)
        for seed in range(seeds):
            results.append(train(config, seed, corpus=corpus, fns=fns, progress=progress))
    columns, rows = summarise(results, "val bits/byte", "{:.3f}")
    table = format_table(columns, rows)
    if png is not None:
        plot_runs(results, png, "byte-level transformer on the Python stdlib: mixed precision")
    return results, table


def _parser() -> argparse.ArgumentParser:
    d = CharLMConfig()
    p = run_arg_parser(
        __doc__.split("\n\n")[0],
        d,
        seeds=1,
        png="results/char_lm.png",
        batch_help="sequences per step",
    )
    precisions = next(a for a in p._actions if a.dest == "precisions")
    precisions.choices = [*precisions.choices, *FP8_RECIPES]  # fp8 and block formats: here only
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=d.d_model, help="residual stream width")
    p.add_argument("--layers", type=int, default=d.num_layers, help="transformer blocks")
    p.add_argument("--heads", type=int, default=d.num_heads, help="attention heads")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="bytes of stdlib source to use")
    p.add_argument(
        "--optimizer-state",
        choices=OPTIMIZER_STATES,
        default="f32",
        help="AdamW moments in float32, bfloat16 (stochastic or nearest rounding) or 8 bits "
        "(nearest or stochastic rounding)",
    )
    p.add_argument(
        "--master-weights",
        choices=("auto", "remainder"),
        default="auto",
        help="loss_scaled's master weights (remainder: bf16-stored params only)",
    )
    p.add_argument(
        "--no-fused-loss",
        dest="fused_loss",
        action="store_false",
        help="compute the head's float32 logits and optax's cross-entropy (default: "
        "mpjax.nn.linear_cross_entropy, without the float32 logits)",
    )
    p.add_argument(
        "--param-dtype",
        choices=tuple(PARAM_DTYPES),
        default=d.param_dtype,
        help="how the params are stored (bf16: loss_scaled keeps a float32 master)",
    )
    p.add_argument(
        "--saved-activations",
        choices=[s for s in SAVED_ACTIVATIONS if s],
        default=None,
        help="keep every GEMM input saved for the backward pass in this fp8 format",
    )
    return p


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    """Command-line entry point: trains, prints the results table, writes the PNG."""
    args = _parser().parse_args(argv)
    results, table = run_experiment(
        args.precisions,
        args.seeds,
        max_bytes=args.max_bytes,
        seq_len=args.seq_len,
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=args.heads,
        optimizer_state=args.optimizer_state,
        master_weights=args.master_weights,
        param_dtype=args.param_dtype,
        fused_loss=args.fused_loss,
        saved_activations=args.saved_activations,
        **run_kwargs(args),
    )
    print()
    print(table)
    print(f"\nwrote {args.png}")
    return results


if __name__ == "__main__":
    main()
