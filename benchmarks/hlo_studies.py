"""Cases read from compiled programs: what a policy or autocast costs on this host's CPU, the
forms of a blockwise fp8 GEMM and the fused loss on deviceless H100s.

- `policy_cost`: a bf16 `apply_policy` vs float32 (`SmallCNN`, `TransformerBlock`): narrowing
  parameter casts in the lowered and the optimized HLO, those written to memory, temp memory,
  and the bytes `jax.vjp` saves for the backward (a backend-free memory proxy).
- `autocast_hlo`: `mpjax.autocast` of the float32 models vs the hand-written Flax bf16 model:
  low-precision matmuls and converts in the lowered StableHLO, converts in the optimized HLO,
  bytes accessed, temp memory and step time (alternating runs), each against Flax bf16.
- `blockwise_hopper_cost`: the lowerings of `Fp8Recipe("blockwise")` for one forward GEMM
  (mpjax's Pallas kernel, emulated, a batched per-K-block fp8 GEMM in XLA) against bf16 and
  tensorwise fp8: roofline, FLOPs by dtype, bytes.
- `lce_loss`: `jax.value_and_grad` of GPT-2 small's loss alone, FSDP over 8 H100s: the float32
  loss against `mpjax.nn.linear_cross_entropy` (chunks of 512, 1024): temp, bytes, roofline.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpjax
from benchmarks.common import interleaved_times, table
from benchmarks.train_models import SmallCNN, TransformerBlock

__all__ = ["autocast_hlo", "blockwise_hopper_cost", "lce_loss", "policy_cost"]

BF16 = jnp.bfloat16


# --- policy_cost -----------------------------------------------------------------------------


def _loss(model, variables, x, mutable):
    def loss(params):
        v = dict(variables, params=params)
        logits = model.apply(v, x, mutable=mutable)[0] if mutable else model.apply(v, x)
        return jnp.mean(logits.astype(jnp.float32) ** 2)

    return loss


def _policy_row(name, model, x, mutable, policy, defaults=mpjax.DEFAULTS) -> list:
    from mpjax._src.analysis.param_casts import param_casts

    variables = model.init(jax.random.key(0), x)
    num = len(jax.tree.leaves(variables["params"]))
    wrapped = mpjax.apply_policy(model, policy, defaults=defaults)
    lowered = {
        m: jax.jit(jax.grad(_loss(m, variables, x, mutable))).lower(variables["params"])
        for m in (model, wrapped)
    }
    ref, compiled = (lowered[m].compile() for m in (model, wrapped))
    narrow = {"bfloat16": "bf16", "float16": "f16"}[mpjax.get_policy(policy).compute_dtype.name]
    low = param_casts(lowered[wrapped].as_text(dialect="hlo"), num, narrow)
    opt = param_casts(compiled.as_text(), num, narrow)
    temp = [c.memory_analysis().temp_size_in_bytes for c in (ref, compiled)]

    def residual_bytes(m):  # what `jax.vjp` keeps for the backward pass, before XLA
        loss = _loss(m, variables, x, mutable)
        vjp = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], variables["params"])
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(vjp))

    per_param = lambda casts, i: round(sum(c[i] for c in casts) / num, 3)  # noqa: E731
    return [
        name,
        num,
        per_param(low, 0),
        max(c for c, _ in low),
        per_param(opt, 0),
        max(c for c, _ in opt),
        per_param(opt, 1),
        *temp,
        round(temp[1] / temp[0], 3),
        round(residual_bytes(wrapped) / residual_bytes(model), 3),
    ]


def policy_cost(case=None, quick: bool = False) -> dict:
    """Parameter casts and temp memory of a bf16 policy vs float32 (module docstring)."""
    policy = "params=float32,compute=bfloat16"
    cnn, cnn_x = (SmallCNN(8, 1), (2, 8, 8, 3)) if quick else (SmallCNN(64, 3), (32, 32, 32, 3))
    tfm, tfm_x = (16, 2), (2, 8, 16)
    if not quick:
        tfm, tfm_x = (256, 4), (16, 256, 256)
    tfm = TransformerBlock(tfm[1], classes=10)
    x, key = jax.random.normal, jax.random.key(1)
    rows = [
        _policy_row("resnet", cnn, x(key, cnn_x), ["batch_stats"], policy),
        _policy_row("transformer", tfm, x(key, tfm_x), None, policy),
        _policy_row(
            "transformer, NO_DEFAULTS", tfm, x(key, tfm_x), None, policy, mpjax.NO_DEFAULTS
        ),
    ]
    columns = ["model", "params", "casts/param lowered", "max casts lowered"]
    columns += ["casts/param optimized", "max casts optimized", "materialized/param optimized"]
    columns += ["temp bytes f32", "temp bytes bf16", "temp ratio", "residual ratio"]
    return table(
        f"bf16 policy ({policy}) vs float32: forward+backward HLO",
        columns,
        rows,
        f"backend={jax.default_backend()}; targets: casts/param <= 1, temp ratio <= 0.55. "
        "Casts are narrowing converts (f32->bf16) whose operand is a parameter. On CPU, "
        "XLA emulates bf16 arithmetic in f32 (extra converts, f32 temporaries) and may "
        "re-inline a cast into several consumer fusions, so optimized-HLO counts and "
        "temp memory there do not reflect GPU/TPU behaviour; the residual ratio does not "
        "depend on the backend. NO_DEFAULTS: softmax and LayerNorm follow the bf16 policy "
        "(Flax still reduces norm statistics in f32).",
    )


# --- autocast_hlo ----------------------------------------------------------------------------


def _autocast_models(quick: bool):
    """Per model: its name, the float32 loss, the Flax bf16 loss, their arguments."""
    n, hw, width = (4, 8, 8) if quick else (32, 32, 64)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (n, hw, hw, 3))
    labels = jax.random.randint(k2, (n,), 0, 10)
    variables = jax.jit(SmallCNN(width).init)(k3, x)

    def cnn_loss(model):
        def loss(params, batch_stats, x):
            v = {"params": params, "batch_stats": batch_stats}
            logits, _ = model.apply(v, x, mutable=["batch_stats"])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

        return loss

    yield (
        "ResNet-style CNN",
        *(cnn_loss(SmallCNN(width, dtype=d)) for d in (None, BF16)),
        (
            variables["params"],
            variables["batch_stats"],
            x,
        ),
    )
    n, seq, d, heads = (2, 8, 16, 2) if quick else (8, 128, 256, 4)
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    x, target = jax.random.normal(k1, (n, seq, d)), jax.random.normal(k2, (n, seq, d))
    params = jax.jit(TransformerBlock(heads).init)(k3, x)["params"]

    def block_loss(model):
        def loss(params, x):
            out = model.apply({"params": params}, x)
            return jnp.mean((out.astype(jnp.float32) - target) ** 2)

        return loss

    yield (
        "transformer block",
        *(block_loss(TransformerBlock(heads, dtype=d)) for d in (None, BF16)),
        (
            params,
            x,
        ),
    )


_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*([a-z]+[0-9]*)>")


def _stablehlo_counts(text: str) -> tuple[str, int]:
    """`"low/all"` matmuls (dot_general, convolution) and converts in lowered StableHLO."""
    low = total = converts = 0
    for line in text.splitlines():
        converts += "stablehlo.convert" in line
        if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
            total += 1
            types = _TYPE.findall(line.rsplit(":", 1)[-1].split("->")[0])
            low += bool(types) and all(t in ("bf16", "f16") for t in types)
    return f"{low}/{total}", converts


def autocast_hlo(case=None, quick: bool = False) -> dict:
    """Every autocast variant against Flax bf16 on both models (module docstring)."""
    rows, reps = [], 3 if quick else 15
    for model_name, loss32, loss_bf16, args in _autocast_models(quick):
        variants = {"flax bf16": loss_bf16, "autocast": mpjax.autocast(loss32)}
        if not quick:
            variants["autocast, acc=None"] = mpjax.autocast(loss32, accumulation_dtype=None)
            no_epilogue = mpjax.OpLists(epilogue=frozenset())
            variants["autocast, no epilogue"] = mpjax.autocast(loss32, op_lists=no_epilogue)
        variants["float32"] = loss32
        stats, fns = {}, {}
        for name, loss in variants.items():
            lowered = jax.jit(jax.value_and_grad(loss)).lower(*args)
            fns[name] = compiled = lowered.compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            text = compiled.as_text().splitlines()
            stats[name] = (
                *_stablehlo_counts(lowered.as_text()),
                sum(1 for line in text if re.search(r"\sconvert\(", line)),
                float(cost.get("bytes accessed", float("nan"))),
                float(compiled.memory_analysis().temp_size_in_bytes),
            )
        times = interleaved_times(
            {k: functools.partial(f, *args) for k, f in fns.items()}, rounds=reps
        )
        base, base_t = stats["flax bf16"], float(np.median(times["flax bf16"]))
        for name, (matmuls, converts, opt_converts, nbytes, temp) in stats.items():
            t = times[name]
            med = float(np.median(t))
            rows.append([model_name, name, matmuls, converts, opt_converts, int(nbytes)])
            rows[-1] += [round(nbytes / base[3], 3), int(temp)]
            rows[-1] += [round(temp / base[4], 3) if base[4] else float("nan")]
            rows[-1] += [f"{med * 1e3:.2f} ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f})"]
            rows[-1] += [round(med / base_t, 3)]
    backend = jax.default_backend()
    columns = ["model", "variant", "low-precision matmuls (StableHLO)", "converts (StableHLO)"]
    columns += [f"converts (optimised {backend} HLO)", "bytes accessed", "bytes ratio vs flax bf16"]
    columns += ["temp bytes", "temp ratio vs flax bf16", "step ms median (min-max)"]
    columns += ["time ratio vs flax bf16"]
    return table(
        "autocast vs hand-written Flax bf16: forward+backward HLO" + " (quick sizes)" * quick,
        columns,
        rows,
        f"backend {backend}; jitted value_and_grad w.r.t. float32 params; "
        f"{reps} alternating timing runs per variant. A CPU backend upcasts bf16 matmuls "
        "to float32 in its optimised HLO, so the low-precision matmul count is read from "
        "the lowered StableHLO. autocast keeps softmax, norm statistics and the loss in "
        "float32 by design (flax bf16 runs its softmax in bf16), which costs bytes.",
    )


# --- blockwise_hopper_cost -------------------------------------------------------------------

B = 128
DIMS = (((1,), (0,)), ((), ()))


def _fp8(recipe: str, **kw):
    from mpjax import Fp8Recipe
    from mpjax.fp8 import fp8_dot_general

    return lambda x, w: fp8_dot_general(x, w, DIMS, Fp8Recipe(recipe, **kw), BF16)


def batched_fp8(x, w):
    """Blockwise fp8 in XLA: one fp8 GEMM batched over the K/128 blocks (`[K/128, M, N]`
    partial products), each scaled by its float32 block scales and summed."""
    (M, K), N = x.shape, w.shape[1]
    kb = K // B
    x3 = x.reshape(M, kb, B).astype(jnp.float32)
    sx = jnp.max(jnp.abs(x3), axis=2, keepdims=True) / 448 + 1e-30  # [M, kb, 1]
    qx = (x3 / sx).astype(jnp.float8_e4m3fn)
    w4 = w.reshape(kb, B, N // B, B).astype(jnp.float32)
    sw = jnp.max(jnp.abs(w4), axis=(1, 3), keepdims=True) / 448 + 1e-30  # [kb, 1, nb, 1]
    qw = (w4 / sw).astype(jnp.float8_e4m3fn).reshape(kb, B, N)
    dims = (((2,), (1,)), ((1,), (0,)))  # batched over the K blocks: [kb, M, N]
    part = lax.dot_general(qx, qw, dims, preferred_element_type=BF16)
    row = jnp.transpose(sx[..., 0], (1, 0))[:, :, None]
    col = jnp.repeat(sw[:, 0, :, 0], B, axis=1)[:, None, :]
    return jnp.sum(part.astype(jnp.float32) * (row * col), axis=0).astype(BF16)


def blockwise_hopper_cost(case=None, quick: bool = False) -> dict:
    """The roofline of each form of the GEMM on the deviceless H100, against bf16."""
    from mpjax._src.analysis.hlo_cost import analyze
    from mpjax._src.analysis.target import compile_step, h100_sharding

    m, k, n = (1024, 512, 512) if quick else (8192, 4096, 4096)
    args = (jax.ShapeDtypeStruct((m, k), BF16), jax.ShapeDtypeStruct((k, n), BF16))
    forms = {
        "bf16": lambda x, w: lax.dot_general(x, w, DIMS, preferred_element_type=BF16),
        "tensorwise fp8": _fp8("tensorwise"),
        "blockwise Pallas kernel (ships)": _fp8("blockwise", block_lowering="native"),
        "blockwise emulated": _fp8("blockwise", block_lowering="emulated"),
        "blockwise batched fp8 (XLA)": batched_fp8,
    }
    rows, base = [], None
    for name, fn in forms.items():
        report = analyze(compile_step(fn, args, h100_sharding(), donate_argnums=()).as_text())
        base = base or report.roofline_s
        flops = ", ".join(f"{d} {v / 1e9:.1f}" for d, v in sorted(report.gemm_flops.items()))
        rows.append([name, round(report.roofline_s * 1e6, 1), round(report.roofline_s / base, 3)])
        rows[-1] += [flops, round(report.bytes / 1e9, 3)]
    return table(
        f"Blockwise fp8 forward GEMM [{m}, {k}] x [{k}, {n}] on the H100 cost model",
        ["form", "roofline us", "vs bf16", "GEMM GFLOP by dtype", "GB accessed"],
        rows,
        "Forward only, bf16 compute, quantisation included (deviceless H100).",
    )


# --- lce_loss --------------------------------------------------------------------------------


def _unfused(x, kernel, labels, padding):
    import optax

    logits = (x @ kernel.astype(BF16)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * padding) / jnp.maximum(jnp.sum(padding), 1)


def _fused(chunk_size):
    from mpjax.nn import linear_cross_entropy

    def loss(x, kernel, labels, padding):
        labels = jnp.where(padding, labels, -1)
        return linear_cross_entropy(
            x, kernel, labels, ignore_index=-1, chunk_size=chunk_size, dtype=BF16
        )

    return loss


def lce_loss(case=None, quick: bool = False) -> dict:
    """The loss table (temp, bytes, roofline per GPU; ratios to the unfused float32 loss)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.harness import TARGETS, _fsdp_spec, _mesh, hlo_figures
    from benchmarks.train_models import LM_SIZES
    from benchmarks.train_variants import lm_config

    size = "quickx8" if quick else "gpt2x8"
    cfg = lm_config(LM_SIZES[size], size)
    mesh = _mesh(TARGETS["h100x8"][0], "fsdp")
    b, t, d, v = cfg["batch"], cfg["seq"], cfg["d"], cfg["vocab"]

    def placed(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (
        placed((b, t, d), BF16, P("fsdp")),
        placed((d, v), jnp.float32, _fsdp_spec((d, v), mesh.shape["fsdp"], "fsdp")),
        placed((b, t), jnp.int32, P("fsdp")),
        placed((b, t), jnp.bool_, P("fsdp")),
    )
    losses = {"unfused float32 loss": _unfused}
    losses.update({f"linear_cross_entropy chunk {c}": _fused(c) for c in (512, 1024)})
    figures = {}
    for name, fn in losses.items():
        compiled = jax.jit(jax.value_and_grad(fn, (0, 1))).trace(*args).lower().compile()
        hlo = hlo_figures(compiled.as_text())
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        figures[name] = {"temp_bytes": temp, "bytes": hlo["bytes"], "roofline_s": hlo["roofline_s"]}
    ref, mib = figures["unfused float32 loss"], 2**20
    rows = [
        [name, round(f["temp_bytes"] / mib, 1), round(f["roofline_s"] * 1e3, 3)]
        + [round(f["bytes"] / mib, 1), round(f["temp_bytes"] / ref["temp_bytes"], 3)]
        + [round(f["roofline_s"] / ref["roofline_s"], 3)]
        for name, f in figures.items()
    ]
    return table(
        "The loss alone (value and grad), per GPU: fused vs the float32 loss",
        ["loss", "temp MiB", "roofline ms", "bytes MiB", "temp vs f32", "roofline vs f32"],
        rows,
        f"jax {jax.__version__}; 8 deviceless H100s, FSDP; LM size {size}: {cfg}.",
        details=figures,
    )
