"""Where the memory of a GPT-2-small FSDP train step goes, and what each mpjax switch saves.

The suite's `memory-switches` case (8 deviceless H100s, one FSDP axis, 8 sequences of 1024
per GPU; its char-LM row, `memory-switches-char-lm`, is in `benchmarks/training_studies.py`):

    python benchmarks/run.py --only memory-switches --resume

Each row is one train step (forward, backward, AdamW) compiled by XLA for the 8 H100s, with
its per-GPU temporaries and arguments from XLA's buffer assignment, and the temporaries
live at the peak attributed to categories by shape by a liveness walk of the optimized HLO
(`mpjax/_src/analysis/liveness.py`): attention scores (T x T), logits (vocabulary-wide),
MLP hidden, model-width hidden states, weight copies (a parameter's size or its FSDP
shard), fp8 saved activations, other. The rows: the two anchors (the hand-written Flax
bf16 LM with XLA attention, and the expert's with cuDNN attention), the strong hand-written
anchors of issue 36 (the expert's with a 15-line chunked cross-entropy, `STRONG_ANCHORS`:
alone, with every block under `nn.remat(dots_with_no_batch_dims_saveable)`, under full
remat), mpjax's `apply_policy` path without any switch, each switch alone, all switches
together, and all switches with every block under each remat policy of `REMAT`. Every row
also records its roofline (`hlo_cost` at H100 peaks) and compile time; the docs plot memory
against roofline time for every row (`benchmarks/tables_plots.plot_frontier`).

A switch is a function `Knobs -> Knobs` in `SWITCHES` (a few lines): it changes the
policy, the LM's fields, the loss or the training state. A switch or anchor whose code is
not on this branch is reported as such (see `PENDING`, `ANCHORS`). `--quick`: the quick LM
(`quickx8`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpjax
from benchmarks.harness import _mesh, collective_figures, compile_program
from benchmarks.train_models import LM_SIZES, cudnn_attention
from benchmarks.train_variants import LM_VARIANTS, ONE_STRING, TrainProgram, _lm, lm_config
from mpjax._src.analysis import hlo_cost
from mpjax._src.analysis.liveness import Buffer, attribute, peak_buffers
from mpjax.fp8 import saved_activations_policy
from mpjax.nn import linear_cross_entropy

GIB = 2**30
E4M3 = "float8_e4m3fn"
DEVICES = 8


class Knobs(NamedTuple):
    """What a switch may change in mpjax's LM train step.

    Attributes:
      policy: the `apply_policy` policy; None: the hand-written bf16 LM (`dtype=bfloat16`,
        cuDNN attention), no `apply_policy`.
      module_kw: extra fields of the LM module (`benchmarks/train_models.py`; `remat`:
        every block under `nn.remat`, `"full"` or a checkpoint policy).
      loss: `loss(model, variables, tokens, padding) -> mean float32 loss` (`model` is the
        policy-wrapped LM, `tokens` include the next token); None: logits, then optax's
        softmax cross-entropy in float32 (the unfused loss).
      state: `"f32"` (float32 params, AdamW state in float32) or `"bf16-remainder"`
        (bfloat16 params, `loss_scaled`'s int16 remainder master, AdamW state in bfloat16).
    """

    policy: mpjax.Policy | None = mpjax.get_policy(ONE_STRING)
    module_kw: dict = {}
    loss: Callable | None = None
    state: str = "f32"


def _fused_loss(model, variables, tokens, padding):
    """`mpjax.nn.linear_cross_entropy` of the LM's final hidden states and head kernel."""
    hidden = model.apply(variables, tokens[:, :-1], padding)  # the LM has `hidden_only`
    labels = jnp.where(padding, tokens[:, 1:], -1)
    kernel = variables["params"]["head"]["kernel"]
    return linear_cross_entropy(hidden, kernel, labels, ignore_index=-1, dtype=jnp.bfloat16)


CHUNK = 128  # tokens of a sequence per chunk of the hand-written loss


def chunked_cross_entropy(hidden, kernel, labels, chunk: int = CHUNK):
    """Mean float32 cross-entropy of `hidden @ kernel` (labels < 0 ignored), a sequence chunk
    at a time under `jax.checkpoint`: no `[tokens, vocab]` logits live, only a chunk's.

    The hand-written anchor's loss (what an expert writes in 15 lines). `hidden` is
    `[batch, T, d]`, `kernel` `[d, vocab]`, `labels` `[batch, T]`."""
    b, t, d = hidden.shape
    c = math.gcd(t, chunk)
    xs = (
        hidden.reshape(b, t // c, c, d).swapaxes(0, 1),
        labels.reshape(b, t // c, c).swapaxes(0, 1),
    )
    w = kernel.astype(hidden.dtype)

    @jax.checkpoint
    def one(total, x):
        h, y = x
        logits = jnp.einsum("bcd,dv->bcv", h, w).astype(jnp.float32)  # fuses into the reductions
        picked = jnp.take_along_axis(logits, jnp.maximum(y, 0)[..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        return total + jnp.sum(jnp.where(y >= 0, nll, 0.0)), None

    total, _ = jax.lax.scan(one, jnp.zeros((), jnp.float32), xs)
    return total / jnp.maximum(jnp.sum(labels >= 0), 1)


def _chunked_loss(model, variables, tokens, padding):
    """The hand-written chunked cross-entropy of the LM's final hidden states and head kernel."""
    hidden = model.apply(variables, tokens[:, :-1], padding)
    labels = jnp.where(padding, tokens[:, 1:], -1)
    return chunked_cross_entropy(hidden, variables["params"]["head"]["kernel"], labels)


# name -> Knobs -> Knobs. Each switch is a few lines; they compose in this order.
SWITCHES: dict[str, Callable[[Knobs], Knobs]] = {
    # Flax users' one-line switch: cuDNN flash attention in the compute dtype
    "fused attention": lambda k: k._replace(
        module_kw={**k.module_kw, "attention_fn": mpjax.nn.dot_product_attention}
    ),
    "fused loss": lambda k: k._replace(
        module_kw={**k.module_kw, "head_bias": False, "hidden_only": True}, loss=_fused_loss
    ),
    "fp8 saved activations": lambda k: k._replace(policy=k.policy.with_saved_activations(E4M3)),
    "remainder + bf16 state": lambda k: k._replace(state="bf16-remainder"),
}
# Switches of issue 29 whose code lands on other branches: a row "not on this branch" until
# SWITCHES has an entry of the same name (insert them first, in this order), e.g.
#   "fused attention": lambda k: k._replace(policy=...) or k._replace(module_kw={...}),
#   "fused loss": lambda k: k._replace(loss=a loss(model, variables, tokens, padding) calling
#       mpjax.nn.linear_cross_entropy on the LM's final hidden states and head kernel),
PENDING = ("fused attention", "fused loss")
# row name -> LM_VARIANTS name (hand-written programs).
ANCHORS = {
    "anchor: hand-written bf16, XLA attention": "bf16-xla",
    "anchor: expert, cuDNN attention": "bf16",
}
# The strong hand-written anchors of issue 36 (row name -> Knobs, policy None): the expert's
# step with a chunked cross-entropy (no float32 logits), then each block under `nn.remat`.
STRONG = "anchor: expert + chunked cross-entropy"
_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
_EXPERT = Knobs(
    policy=None,
    module_kw={"attention_fn": cudnn_attention, "head_bias": False, "hidden_only": True},
    loss=_chunked_loss,
)
STRONG_ANCHORS = {
    STRONG: _EXPERT,
    f"{STRONG} + remat(dots saveable)": _EXPERT._replace(
        module_kw={
            **_EXPERT.module_kw,
            "remat": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        }
    ),
    f"{STRONG} + full remat": _EXPERT._replace(module_kw={**_EXPERT.module_kw, "remat": "full"}),
}
# The anchors of the ratio columns.
RATIO_ANCHORS = (*ANCHORS, STRONG)
# mpjax's remat choices on top of all switches: row suffix -> the blocks' `remat`.
REMAT = {
    "remat(fp8 saved)": saved_activations_policy(),
    "remat(fp8 saved + dots saveable)": saved_activations_policy(_DOTS),
    "full remat": "full",
}
CATEGORIES = (
    "attention scores and probabilities (T x T)",
    "float32 logits",
    "bf16 logits",
    "MLP hidden",
    "model-width hidden states",
    "fp8 saved activations",
    "weight copies",
    "other",
)


def _unfused_loss(model, variables, tokens, padding):
    logits = model.apply(variables, tokens[:, :-1], padding).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * padding) / jnp.maximum(jnp.sum(padding), 1)


def _adamw():
    return optax.adamw(3e-4, b2=0.95, weight_decay=0.1)


def program(cfg: dict, knobs: Knobs) -> TrainProgram:
    """The LM train step of `knobs` (`benchmarks/train_variants.lm_program`'s data)."""
    base = LM_VARIANTS["bf16"](cfg)  # batch() and the shapes
    # `hidden_only` (the fused loss) leaves the head to the loss: init makes it all the same
    hand_written = knobs.policy is None
    module_kw = {**knobs.module_kw, **({"dtype": jnp.bfloat16} if hand_written else {})}
    init_model = _lm(cfg, **{k: v for k, v in module_kw.items() if k != "hidden_only"})
    apply_model = _lm(cfg, **module_kw)
    policy, tx = knobs.policy or mpjax.get_policy("float32"), _adamw()
    if knobs.state == "bf16-remainder":
        policy = policy.with_param_dtype(jnp.bfloat16)
        tx = mpjax.loss_scaled(
            mpjax.low_precision_state(tx, jnp.bfloat16),
            mpjax.NoOpLossScale(),
            master_weights="remainder",
        )
    elif knobs.state != "f32":
        raise ValueError(f"Knobs.state={knobs.state!r}; use 'f32' or 'bf16-remainder'")
    model = apply_model if hand_written else mpjax.apply_policy(apply_model, policy)
    loss_fn = knobs.loss or _unfused_loss
    scaled = knobs.state != "f32"

    def init(key):
        tokens = jnp.zeros((cfg["batch"], cfg["seq"]), jnp.int32)
        params = init_model.init(key, tokens, tokens > 0)["params"]
        params = policy.cast_to_param(params)
        return params, tx.init(params)

    def step(state, batch):
        params, opt_state = state
        tokens, padding = batch

        def objective(p):
            loss = loss_fn(model, {"params": p}, tokens, padding)
            return (mpjax.scale_loss(loss, opt_state) if scaled else loss), loss

        grads, loss = jax.grad(objective, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return TrainProgram(init, base.batch, step, base.items)


def rows() -> dict[str, Callable[[dict], TrainProgram] | None]:
    """Row name -> program builder (None: not on this branch)."""
    out: dict[str, Callable | None] = {r: LM_VARIANTS.get(v) for r, v in ANCHORS.items()}
    for name, anchor in STRONG_ANCHORS.items():
        out[name] = lambda cfg, k=anchor: program(cfg, k)
    knobs = Knobs()
    out["mpjax apply_policy, no switch"] = lambda cfg, k=knobs: program(cfg, k)
    for name in PENDING:
        if name not in SWITCHES:
            out[f"+ {name}"] = None
    for name, switch in SWITCHES.items():
        alone = switch(knobs)
        out[f"+ {name}"] = lambda cfg, k=alone: program(cfg, k)
    every = knobs
    for switch in SWITCHES.values():
        every = switch(every)
    out["all switches"] = lambda cfg, k=every: program(cfg, k)
    for name, remat in REMAT.items():
        k = every._replace(module_kw={**every.module_kw, "remat": remat})
        out[f"all switches + {name}"] = lambda cfg, k=k: program(cfg, k)
    return out


def lm_category(cfg: dict, param_sizes: set[int]) -> Callable[[Buffer], str]:
    """Names the category of a buffer of the per-device LM step by its shape and dtype."""
    tokens = cfg["batch"] // DEVICES * cfg["seq"]
    seq, d, mlp, vocab = cfg["seq"], cfg["d"], cfg["mlp"], cfg["vocab"]

    def category(buf: Buffer) -> str:
        dtype, dims = max(buf.shapes, key=lambda s: math.prod(s[1]))
        n = math.prod(dims)
        if dtype.startswith("f8"):
            return "fp8 saved activations"
        if list(dims).count(seq) >= 2:
            return "attention scores and probabilities (T x T)"
        if vocab in dims and n >= tokens * vocab // 2:
            return "float32 logits" if dtype == "f32" else "bf16 logits"
        if n == tokens * mlp:
            return "MLP hidden"
        if n in (tokens * d, 3 * tokens * d):
            return "model-width hidden states"
        if n in param_sizes:
            return "weight copies"
        return "other"

    return category


def _collective(kind: str) -> bool:
    return any(op in kind for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                                     "collective-permute"))  # fmt: skip


def measure(name: str, build: Callable, cfg: dict) -> dict:
    """One row: XLA's per-GPU temp and arguments, and the peak's attribution."""
    t0 = time.time()
    _, compiled, state = compile_program(build(cfg), "h100x8")
    compile_s = time.time() - t0
    memory = compiled.memory_analysis()
    sizes = {int(np.prod(x.shape)) for x in jax.tree.leaves(state[0])}
    sizes |= {s // DEVICES for s in sizes if s % DEVICES == 0}
    text = compiled.as_text()
    kernels = hlo_cost.analyze(text).kernels
    comm = collective_figures(text, list(_mesh("1x1x8", "fsdp").devices.flat))
    peak, buffers = peak_buffers(text)
    by_category = attribute(buffers, lm_category(cfg, sizes))
    print(f"[memory-switches] {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return {
        "row": name,
        "hand_written": name.startswith("anchor:"),
        "roofline_s": sum(k.time_s for k in kernels),
        "roofline_s_no_collectives": sum(k.time_s for k in kernels if not _collective(k.kind)),
        "comm_s_nvlink": comm["comm_s_nvlink"],
        "compile_s": round(compile_s, 1),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "walk_peak_bytes": int(peak),
        "by_category": by_category,
    }


def _gib(x: float) -> float:
    return round(x / GIB, 3)


def _ms(seconds: float) -> float:
    return float(f"{1e3 * seconds:.4g}")


def table(results: list[dict], anchors: dict) -> tuple[list, list]:
    """Columns and rows of the per-GPU memory table (GiB; ratios to each anchor)."""
    columns = ["step", "temp GiB", "args GiB", "temp + args GiB", "roofline ms"]
    columns += ["of it collectives ms", "NVLink ring ms", "compile s"]
    columns += [f"vs {a.split(': ', 1)[1]}" for a in anchors]
    columns += list(CATEGORIES)
    out = []
    for r in results:
        if r.get("missing"):
            out.append([r["row"], "not on this branch", *["-"] * (len(columns) - 2)])
            continue
        total = r["temp_bytes"] + r["argument_bytes"]
        ratios = [
            round(total / (a["temp_bytes"] + a["argument_bytes"]), 3) if a else "-"
            for a in anchors.values()
        ]
        cats = [_gib(r["by_category"].get(c, 0)) for c in CATEGORIES]
        out.append(
            [
                r["row"],
                _gib(r["temp_bytes"]),
                _gib(r["argument_bytes"]),
                _gib(total),
                _ms(r["roofline_s"]),
                _ms(r["roofline_s"] - r["roofline_s_no_collectives"]),
                _ms(r["comm_s_nvlink"]),
                r["compile_s"],
                *ratios,
                *cats,
            ]
        )
    return columns, out


def compile_rows(quick: bool, only: tuple[str, ...] = ()) -> dict:
    """Every row (or those named in `only`) compiled and measured (needs the CUDA plugin)."""
    t0 = time.time()
    size = "quickx8" if quick else "gpt2x8"
    cfg = lm_config(LM_SIZES[size], size)
    results = []
    for name, build in rows().items():
        if only and name not in only:
            continue
        missing = {"row": name, "missing": True}
        results.append(missing if build is None else measure(name, build, cfg))
    anchors = {
        a: next((r for r in results if r["row"] == a and not r.get("missing")), None)
        for a in RATIO_ANCHORS
    }
    columns, table_rows = table(results, anchors)
    return {
        "title": "Per-GPU memory of the GPT-2-small FSDP step, by switch"
        + (" (quick sizes)" if quick else ""),
        "columns": columns,
        "rows": table_rows,
        "details": results,
        "config": cfg,
        "notes": (
            f"jax {jax.__version__}; 8 deviceless H100s (1x1x8), one FSDP axis, state split "
            "along each leaf's largest dimension divisible by 8, batch split, state donated; "
            f"sizes {cfg} (batch: global). temp/args: XLA's buffer assignment per GPU; the "
            "categories: buffers live at the peak of a liveness walk of the optimized HLO "
            "(an upper estimate of temp: no buffer packing), by shape. roofline: "
            "`mpjax/_src/analysis/hlo_cost.py` at H100 peaks, every kernel of the program "
            "summed, its collectives' start/done ops counted by their bytes at HBM bandwidth "
            "(the 'of it collectives' column; NVLink ring: the suite's ring estimate of the "
            "collectives at 450 GB/s, not added); compile s: lowering and XLA compile of the "
            "row on this host, loaded by other jobs."
        ),
        "seconds": round(time.time() - t0),
    }


def memory_switches(case=None, quick: bool = False) -> dict:
    """The per-switch table (the suite's `memory-switches` case, on 8 deviceless H100s)."""
    return compile_rows(quick)
