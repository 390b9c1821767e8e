"""Cases that train the examples: convergence by memory mode, by block recipe, with fp8 saved
activations, and the gradient-reduction dtype on 8 simulated devices.

Each case is a set of variants (`CharLMConfig`/`DigitsConfig` fields, a policy) trained by the
examples' own `train` functions, and a measure (`measure(case, quick) -> figures`):

- `memory_convergence`: char-LM bits/byte and digits accuracy under each training-state
  memory mode (`CHAR_LM_MODES`, `DIGITS_MODES`), bytes per parameter of the trained state,
  and that `master_weights="remainder"` trains bit for bit like the float32 master;
- `blocks_convergence`: char-LM bits/byte under each block-scaled recipe (emulated on CPU);
- `memory_switches_char_lm`: char-LM bits/byte with and without fp8 saved activations;
- `reduce_dtype`: gradients summed in float16 vs float32 (a controlled N-way ring sum), and the
  char-LM trained FSDP on 8 CPU devices (a child process) under each reduce dtype;
  `reduce_dtype_h100`: the gradient collectives of that step on 8 deviceless H100s.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import mpjax
from benchmarks.common import in_child, table

E4M3 = "float8_e4m3fn"
QUICK_CHAR_LM = dict(
    steps=20, batch_size=8, seq_len=32, d_model=32, num_layers=1, num_heads=2, eval_windows=8
)
QUICK_DIGITS = dict(steps=30, batch_size=64, width=8, num_blocks=1, learning_rate=2e-2)


def char_lm_runs(quick: bool, variants: dict[str, dict], seeds: int) -> dict[str, list]:
    """label -> the `RunResult`s (seeds 0..seeds-1) of the char-LM with `CharLMConfig(**fields)`."""
    from examples.train_char_lm import CharLMConfig, load_corpus, make_train_fns, train

    corpus = load_corpus(200_000 if quick else 2_000_000)
    runs = {}
    for label, fields in variants.items():
        config = CharLMConfig(**(QUICK_CHAR_LM if quick else {}), **fields)
        fns = make_train_fns(config)
        runs[label] = [train(config, s, corpus=corpus, fns=fns) for s in range(seeds)]
        print(f"[char-LM] {label}: {[round(r.metric, 4) for r in runs[label]]}", flush=True)
    return runs


def char_lm_steps(quick: bool) -> int:
    from examples.train_char_lm import CharLMConfig

    return CharLMConfig(precision="bf16", **(QUICK_CHAR_LM if quick else {})).steps


# --- memory modes ----------------------------------------------------------------------------

# name -> CharLMConfig fields (on top of precision="bf16"); the first is the reference.
_REM = {"param_dtype": "bf16", "master_weights": "remainder"}
CHAR_LM_MODES: dict[str, dict[str, str]] = {
    "float32 state": {},
    "bf16 state, stochastic": {"optimizer_state": "bf16"},
    "bf16 state, nearest": {"optimizer_state": "bf16-nearest"},
    "bf16 params + float32 master": {"param_dtype": "bf16"},
    "bf16 params + remainder": _REM,
    "bf16 params + remainder + bf16 state, stochastic": {**_REM, "optimizer_state": "bf16"},
    "int8 state": {"optimizer_state": "int8"},
    "int8 state, stochastic": {"optimizer_state": "int8-stochastic"},
    "bf16 params + remainder + int8 state": {**_REM, "optimizer_state": "int8"},
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


def bytes_per_param(params: Any, opt_state: Any) -> float:
    """Bytes of params + optimizer state (every leaf) over the number of params."""

    def nbytes(tree):
        return sum(np.size(x) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    return (nbytes(params) + nbytes(opt_state)) / sum(np.size(p) for p in jax.tree.leaves(params))


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
    modes = {name: {"precision": "bf16", **f} for name, f in CHAR_LM_MODES.items()}
    runs = char_lm_runs(quick, modes, seeds)
    ref = np.array([r.metric for r in runs["float32 state"]])
    rows = []
    for name, rs in runs.items():
        fields = {"optimizer_state": "f32", "param_dtype": "f32", "master_weights": "auto"}
        bpb = np.array([r.metric for r in rs])
        rows.append(
            {"mode": name, **fields, **CHAR_LM_MODES[name]}
            | {
                "val_bits_per_byte": float(bpb.mean()),
                "val_bits_per_byte_std": float(bpb.std(ddof=1)) if seeds > 1 else 0.0,
                "vs_float32_state_pct": float(100.0 * (bpb.mean() / ref.mean() - 1.0)),
                "per_seed": [float(b) for b in bpb],
                "bytes_per_param": bytes_per_param(rs[0].params, rs[0].opt_state),
                "wall_s": float(sum(r.wall_s for r in rs)),
            }
        )
    checks = [bit_identical(a, b) for a, b in zip(*(runs[n] for n in IDENTICAL_PAIR), strict=True)]
    same = {k: all(c[k] for c in checks) for k in ("losses", "metric", "masters")}
    return {
        "steps": char_lm_steps(quick),
        "seeds": seeds,
        "rows": rows,
        "bit_identical": {"pair": list(IDENTICAL_PAIR), **same, "per_seed": checks},
    }


def digits(quick: bool = False, seeds: int = 10) -> dict:
    """Every `DIGITS_MODES` run of the digits example over seeds 0..seeds-1."""
    from examples.train_digits import DigitsConfig, load_data, make_train_fns, train

    data, sizes = load_data(), (QUICK_DIGITS if quick else {})
    accs, bytes_pp = {}, {}
    for name, state in DIGITS_MODES.items():
        config = DigitsConfig(precision="bf16", optimizer_state=state, **sizes)
        fns = make_train_fns(config)
        runs = [train(config, s, data=data, fns=fns) for s in range(seeds)]
        accs[name] = np.array([r.metric for r in runs])
        bytes_pp[name] = bytes_per_param(runs[0].params, runs[0].opt_state)
        print(f"[digits] {name}: {accs[name].mean():.2f} % ({seeds} seeds)", flush=True)
    ref = accs["float32 state"].mean()
    rows = [
        {
            "mode": name,
            "optimizer_state": DIGITS_MODES[name],
            "accuracy_mean": float(acc.mean()),
            "accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
            "vs_float32_state_pp": float(acc.mean() - ref),
            "accuracies": [float(a) for a in acc],
            "bytes_per_param": bytes_pp[name],
        }
        for name, acc in accs.items()
    ]
    steps = DigitsConfig(precision="bf16", **sizes).steps
    return {"steps": steps, "seeds": seeds, "test_images": len(data.y_test), "rows": rows}


def memory_convergence(case=None, quick: bool = False, char_lm_seeds=1, digits_seeds=5) -> dict:
    """Both examples' convergence by memory mode (the docs' memory guide)."""
    return {"char_lm": char_lm(quick, char_lm_seeds), "digits": digits(quick, digits_seeds)}


# --- block-scaled recipes and fp8 saved activations -----------------------------------------

RECIPES = ("bf16", "fp8", "mxfp8", "blockwise", "nvfp4")


def blocks_convergence(case=None, quick: bool = False) -> dict:
    """Validation bits/byte of the char-LM under each recipe, and its change against bf16."""
    runs = char_lm_runs(quick, {p: {"precision": p} for p in RECIPES}, 1)
    ref = runs["bf16"][0].metric
    rows = [
        [name, round(r.metric, 4), round(100 * (r.metric / ref - 1), 2), round(r.wall_s, 1)]
        for name, (r,) in runs.items()
    ]
    return table(
        f"Char-LM validation bits/byte by recipe ({char_lm_steps(quick)} steps, seed 0)",
        ["recipe", "val bits/byte", "vs bf16 %", "wall s (CPU, emulated)"],
        rows,
        "fp8: tensorwise current scaling. Block-scaled recipes emulated on the CPU (their "
        "numbers, not their speed); the byte head stays bf16 in every recipe, and nvfp4 keeps "
        "its default high_precision_last (the last 15 % of the GEMMs: the last block's MLP) "
        "in bf16.",
    )


def memory_switches_char_lm(case=None, quick: bool = False, seeds: int = 1) -> dict:
    """Char-LM bits/byte, bf16, with and without fp8 saved activations (the memory guide)."""
    variants = {"bf16": None, "bf16 + fp8 saved activations": E4M3}
    variants = {k: {"precision": "bf16", "saved_activations": v} for k, v in variants.items()}
    runs = {k: [r.metric for r in rs] for k, rs in char_lm_runs(quick, variants, seeds).items()}
    out = {k: {"bits_per_byte": v, "mean": float(np.mean(v))} for k, v in runs.items()}
    ratio = out["bf16 + fp8 saved activations"]["mean"] / out["bf16"]["mean"]
    flags = " --saved-activations float8_e4m3fn"
    command = f"python examples/train_char_lm.py --precisions bf16 --seeds {seeds}[{flags}]"
    details = {"runs": out, "ratio": ratio, "steps": char_lm_steps(quick), "seeds": seeds}
    return {  # not `table`: its `runs` cells are lists (the bits/byte of each seed)
        "title": "char-LM validation bits/byte, bf16 with and without fp8 saved activations",
        "columns": ["mode", "bits/byte (mean)", "runs"],
        "rows": [[k, round(v["mean"], 4), v["bits_per_byte"]] for k, v in out.items()],
        "notes": f"{details['steps']} steps, {seeds} seed(s); fp8 / bf16 = {ratio:.4f}; {command}",
        "details": details | {"command": command},
    }


# --- the gradient reduction dtype ------------------------------------------------------------

N_DEVICES, ELEMENTS = 8, 4096
SUM_COLUMNS = ["ways", "noise / mean", "rel err f16", "rel err f32", "zeroed f16", "zeroed f32"]
SUM_COLUMNS += ["max finite log2 scale f16", "max finite log2 scale f32"]
TRAIN_COLUMNS = ["compute", "reduce", "steps", "skipped", "final scale", "loss (last 10)"]
TRAIN_COLUMNS += ["gradient collectives"]


def _sums(parts: np.ndarray) -> dict:
    """The float16 ring sum, and the float32 ring sum rounded once to float16 (float64)."""

    def ring(dtype):  # adds the rows one by one, rounding the running sum to `dtype`
        acc = parts[0].astype(dtype)
        for row in parts[1:]:
            acc = (acc + row.astype(dtype)).astype(dtype)
        return acc

    with np.errstate(over="ignore", invalid="ignore"):
        f16, f32 = ring(np.float16), ring(np.float32).astype(np.float16)
    return {"f16": f16.astype(np.float64), "f32": f32.astype(np.float64)}


def _max_finite_log2_scale(unit: np.ndarray, method: str) -> int:
    """The largest k such that `method`'s sum of `unit * 2**k` has no inf."""
    lo, hi = 0, 40  # finite at 2**lo, assumed inf at 2**hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if np.all(np.isfinite(_sums(unit * 2.0**mid)[method])) else (lo, mid)
    return lo


def _summation_rows(quick: bool) -> list:
    """Ring sums of `n` per-device partial gradients (log-uniform magnitudes in [1e-8, 1e-1],
    random signs, Gaussian noise of `noise` times the magnitude per device), scaled by 2**12:
    relative error against the float64 sum, elements zeroed, the largest finite scale."""
    median = lambda v: float(np.median(v)) if v else float("nan")  # noqa: E731
    rng, rows = np.random.default_rng(0), []
    for noise in (3.0,) if quick else (3.0, 100.0):
        for n in (64, 1024) if quick else (64, 128, 256, 512, 1024):
            errs, under, top = {"f16": [], "f32": []}, {"f16": [], "f32": []}, []
            for _ in range(3 if quick else 16):
                mag = 10.0 ** rng.uniform(-8, -1, ELEMENTS) * rng.choice([-1.0, 1.0], ELEMENTS)
                unit = (mag + noise * np.abs(mag) * rng.standard_normal((n, ELEMENTS))) / n
                exact = unit.sum(0) * 2.0**12
                for k, s in _sums(unit * 2.0**12).items():
                    if np.all(np.isfinite(s)):
                        errs[k].append(np.linalg.norm(s - exact) / np.linalg.norm(exact))
                    under[k].append(np.mean((s == 0) & (exact != 0)))
                top.append({m: _max_finite_log2_scale(unit, m) for m in ("f16", "f32")})
            rows.append([n, noise, median(errs["f16"]), median(errs["f32"])])
            rows[-1] += [median(under["f16"]), median(under["f32"])]
            rows[-1] += [int(np.median([t[m] for t in top])) for m in ("f16", "f32")]
    return rows


def _lm_step(policy: str, seq: int, d_model: int, scale=None):
    """(step, init) of the char-LM under `mpjax.apply_policy(policy)` and `loss_scaled`
    (by default dynamic loss scaling under float16 compute, none under bfloat16)."""
    import jax.numpy as jnp
    import optax

    from examples.train_char_lm import CharTransformer

    if scale is None and "c=f16" in policy:
        scale = mpjax.DynamicLossScale(initial_scale=2.0**15, growth_interval=25)
    scale = scale or mpjax.NoOpLossScale()
    base = CharTransformer(d_model=d_model, num_layers=2, num_heads=4, max_len=seq)
    model = mpjax.apply_policy(base, policy)
    tx = mpjax.loss_scaled(optax.adamw(3e-3, weight_decay=1e-2), scale)

    def init(rng):
        params = base.init(rng, jnp.zeros((1, seq), jnp.int32))["params"]
        return params, tx.init(params)

    def step(params, opt_state, tokens):
        def scaled(p):
            logits = model.apply({"params": p}, tokens[:, :-1]).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
            return mpjax.scale_loss(ce, opt_state), ce

        grads, ce = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce

    return step, init


def _fsdp_step(policy: str, mesh, state, seq: int, d_model: int, scale=None):
    """The jitted FSDP step (state split along each leaf's largest dimension) and shardings."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.harness import _fsdp_spec

    step, _ = _lm_step(policy, seq, d_model, scale)
    spec = lambda x: NamedSharding(mesh, _fsdp_spec(getattr(x, "shape", ()), mesh.size, "fsdp"))  # noqa: E731
    shard = jax.tree.map(spec, state)
    fn = jax.jit(step, out_shardings=(*shard, None), donate_argnums=(0, 1))
    return fn, shard, NamedSharding(mesh, P("fsdp"))


def _gradient_collectives(text: str) -> str:
    """`"op dtype xCOUNT"` of the reductions of more than 64 bytes (the gradients), and MiB."""
    from mpjax._src.analysis.collectives import collectives

    kinds, total = {}, 0
    for c in collectives(text):
        if c.op in ("all-reduce", "reduce-scatter") and c.bytes > 64:
            kinds[f"{c.op} {c.dtype}"] = kinds.get(f"{c.op} {c.dtype}", 0) + 1
            total += c.bytes
    text = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
    return f"{text}; {total / 2**20:.2f} MiB"


def _train_rows(quick: bool) -> list:
    """The char-LM trained FSDP on 8 host devices under each policy (run in a child)."""
    from jax.sharding import Mesh

    from examples.train_char_lm import _windows, load_corpus

    steps, batch, seq = (12, 16, 64) if quick else (300, 32, 64)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("fsdp",))
    rows = []
    for compute, reduce in (("f16", "f16"), ("f16", "f32"), ("bf16", "bf16"), ("bf16", "f32")):
        policy = f"p=f32,c={compute},o=f32" + ("" if reduce == compute else f",r={reduce}")
        state = jax.jit(_lm_step(policy, seq, 64)[1])(jax.random.key(0))
        fn, shard, data = _fsdp_step(policy, mesh, state, seq, 64)
        params, opt_state = jax.device_put(state, shard)
        tokens = _windows(load_corpus(max_bytes=300_000).train, seq + 1, batch, 0)
        first = jax.device_put(next(tokens), data)
        text = fn.lower(params, opt_state, first).compile().as_text()
        losses = []
        for _ in range(steps):
            params, opt_state, ce = fn(params, opt_state, jax.device_put(next(tokens), data))
            losses.append(float(ce))
        m = mpjax.scaling_metrics(opt_state)
        rows.append([compute, reduce, steps, int(m["skipped_steps"]), float(m["loss_scale"])])
        rows[-1] += [float(np.mean(losses[-10:])), _gradient_collectives(text)]
    return rows


def reduce_dtype(case=None, quick: bool = False) -> dict:
    """The summation and training tables (`SUM_COLUMNS`, `TRAIN_COLUMNS`) as one record."""
    sums = _summation_rows(quick)
    train = in_child(_train_rows, quick, N_DEVICES, JAX_PLATFORMS="cpu")
    rows = [["sum", *map(str, r)] for r in sums]
    rows += [["train", *map(str, r[:6]), "", ""] for r in train]
    notes = "sum: " + ", ".join(SUM_COLUMNS) + "; train: " + ", ".join(TRAIN_COLUMNS[:6])
    title = "Gradient reduction dtype: float16/bfloat16 vs float32"
    return table(title, ["part", *"abcdefgh"], rows, notes, sum=sums, train=train)


def reduce_dtype_h100(case=None, quick: bool = False) -> dict:
    """The gradient collectives of the char-LM FSDP step compiled for 8 deviceless H100s."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from mpjax._src.analysis.target import h100_topology

    mesh = Mesh(np.array(h100_topology("1x1x8").devices), ("fsdp",))
    rows = []
    for policy in ("c=f16", "c=f16,o=f32,r=f32", "c=bf16", "c=bf16,o=f32,r=f32"):
        policy = "p=f32," + policy + ",o=f32" * ("r=" not in policy)
        scale = mpjax.DynamicLossScale()  # in every row (a scalar check: no gradient bytes)
        state = jax.eval_shape(_lm_step(policy, 256, 256, scale)[1], jax.random.key(0))
        fn, shard, data = _fsdp_step(policy, mesh, state, 256, 256, scale)
        args = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shard
        )
        tokens = jax.ShapeDtypeStruct((64, 257), jnp.int32, sharding=data)
        rows.append(
            [policy, _gradient_collectives(fn.trace(*args, tokens).lower().compile().as_text())]
        )
    return table(
        "Gradient collectives of the char-LM FSDP step on 8 deviceless H100s",
        ["policy", "gradient collectives (8 H100s, FSDP)"],
        rows,
        "",
    )
