"""Training-state memory per mode on the GPT-2-small LM, and the optimizer step's cost on H100.

One command:

    MPJAX_GPU_AOT_PYTHON=/path/to/gpu-aot/python python benchmarks/memory.py

1. Bytes per parameter of the training state (params + optimizer state, read from the state
   pytree of `jax.eval_shape(tx.init, params)`), for each mode, and per device when the
   state is sharded over 8 GPUs (FSDP: every leaf split 8 ways).
2. The optimizer step (`tx.update` + `optax.apply_updates`, gradients given, donated) of
   each mode compiled deviceless for H100 and read by the GPU cost model
   (`mpjax/_src/analysis`): bytes accessed and roofline, as ratios to today's loss-scaled
   step (bf16 params, float32 master, float32 Adam state). Runs under
   `$MPJAX_GPU_AOT_PYTHON` when this python has no CUDA plugin; reported as skipped
   otherwise.
3. The whole train step (forward, backward, optimizer; the GPT-2-like LM computing in
   bfloat16, params stored in each mode's dtype, state donated) on the same cost model:
   roofline and bytes vs today's step with bf16 params and a float32 master.

4. Convergence (`benchmarks/memory_convergence.py`): the char-LM and digits examples,
   trained by their `train` functions in each mode, against the float32-state run; the
   float32-master and remainder char-LM runs must be bit-identical (losses, metric,
   masters), which is checked and reported. `--no-convergence` skips it.

`--quick` uses the small LM and short, small training runs (for tests); `--json PATH`
writes everything, and docs/guides/memory.md's tables are generated from
`benchmarks/memory_results.json` (written by the command above with
`--json benchmarks/memory_results.json`) by `docs/memory_tables.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import benchmarks.gpu_cost_model as gcm  # noqa: E402
import mpjax  # noqa: E402
from benchmarks.train_models import LM, LM_SIZES, VOCAB  # noqa: E402
from benchmarks.train_variants import lm_program  # noqa: E402
from mpjax._src.analysis.target import compile_step, h100_sharding  # noqa: E402

LR = 3e-4
FSDP_DEVICES = 8


def _adamw():
    return optax.adamw(LR, weight_decay=0.1)


# name -> (param dtype, optimizer factory)
MODES = {
    "optax.adamw, float32 params": (jnp.float32, _adamw),
    "loss_scaled(adamw), float32 params": (jnp.float32, lambda: mpjax.loss_scaled(_adamw())),
    "bf16 params + float32 master (today)": (jnp.bfloat16, lambda: mpjax.loss_scaled(_adamw())),
    "bf16 params + remainder master": (
        jnp.bfloat16,
        lambda: mpjax.loss_scaled(_adamw(), master_weights="remainder"),
    ),
    "bf16 params + float32 master + bf16 state": (
        jnp.bfloat16,
        lambda: mpjax.loss_scaled(mpjax.low_precision_state(_adamw())),
    ),
    "bf16 params + remainder + bf16 state": (
        jnp.bfloat16,
        lambda: mpjax.loss_scaled(mpjax.low_precision_state(_adamw()), master_weights="remainder"),
    ),
    "bf16 params + remainder + int8 state": (
        jnp.bfloat16,
        lambda: mpjax.loss_scaled(
            mpjax.low_precision_state(_adamw(), jnp.int8), master_weights="remainder"
        ),
    ),
}
ANCHOR = "bf16 params + float32 master (today)"


def lm_params(size: str, param_dtype) -> dict:
    """Shapes of the GPT-2-like LM's params (no memory is allocated)."""
    cfg = dict(LM_SIZES[size])
    batch = cfg.pop("batch")
    model = LM(vocab=VOCAB["full" if size == "gpt2" else "quick"], param_dtype=param_dtype, **cfg)
    tokens = jax.ShapeDtypeStruct((batch, cfg["seq"]), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)
    return variables["params"]


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes(size: str) -> list[dict]:
    rows = []
    for name, (dtype, make) in MODES.items():
        params = lm_params(size, dtype)
        opt_state = jax.eval_shape(make().init, params)
        n = sum(x.size for x in jax.tree.leaves(params))
        total = _nbytes(params) + _nbytes(opt_state)
        rows.append(
            {
                "mode": name,
                "params": n,
                "param_bytes": _nbytes(params) / n,
                "opt_state_bytes": _nbytes(opt_state) / n,
                "bytes_per_param": total / n,
                "GiB_per_device_fsdp8": total / FSDP_DEVICES / 2**30,
            }
        )
    return rows


def _step(tx):
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def step_costs(size: str) -> list[dict]:
    sharding = h100_sharding()
    rows = []
    for name, (dtype, make) in MODES.items():
        tx = make()
        params = lm_params(size, dtype)
        opt_state = jax.eval_shape(tx.init, params)
        compiled = compile_step(_step(tx), (params, opt_state, params), sharding, (0, 1))
        m = gcm.measure(compiled)
        rows.append({"mode": name, "bytes": m["bytes"], "roofline_s": m["roofline_s"]})
    anchor = next(r for r in rows if r["mode"] == ANCHOR)
    for r in rows:
        r["bytes_vs_today"] = r["bytes"] / anchor["bytes"]
        r["roofline_vs_today"] = r["roofline_s"] / anchor["roofline_s"]
    return rows


def lm_config(size: str) -> dict:
    """The LM size entry of `size` with its vocabulary (`lm_program`'s `cfg`)."""
    cfg = dict(LM_SIZES[size])
    cfg["vocab"] = VOCAB["full" if size == "gpt2" else "quick"]
    return cfg


def train_step_costs(size: str) -> list[dict]:
    """The whole train step of each mode on the H100 cost model, vs today's."""
    sharding = h100_sharding()
    cfg = lm_config(size)
    keys = ("layers", "d", "heads", "mlp", "seq")
    rows = []
    for name, (dtype, make) in MODES.items():
        model = LM(cfg["vocab"], **{k: cfg[k] for k in keys}, dtype=jnp.bfloat16, param_dtype=dtype)
        scaled = name != "optax.adamw, float32 params"
        program = lm_program(cfg, model.apply, model, tx=make(), scaled=scaled)
        key = jax.random.key(0)
        args = (jax.eval_shape(program.init, key), jax.eval_shape(program.batch, key))
        m = gcm.measure(compile_step(program.step, args, sharding))
        row = {"mode": name, "bytes": m["bytes"], "roofline_s": m["roofline_s"]}
        rows.append({**row, "temp_bytes": m["temp_bytes"], "kernels": m["kernels"]})
        print(f"[memory] train step {name}: {m['roofline_s'] * 1e3:.2f} ms", flush=True)
    anchor = next(r for r in rows if r["mode"] == ANCHOR)
    for r in rows:
        r["roofline_ms"] = r["roofline_s"] * 1e3
        r["temp_GiB"] = r["temp_bytes"] / 2**30
        r["bytes_vs_today"] = r["bytes"] / anchor["bytes"]
        r["roofline_vs_today"] = r["roofline_s"] / anchor["roofline_s"]
    return rows


def _table(rows: list[dict], keys: list[str]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _about(argv: list[str]) -> dict:
    """The command, date and software of a run (no paths of the machine)."""
    import platform

    import jaxlib

    return {
        "command": " ".join(["python benchmarks/memory.py", *argv]),
        "date": time.strftime("%Y-%m-%d"),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }


def run(
    quick: bool = False,
    costs: bool = True,
    convergence: bool = True,
    char_lm_seeds: int = 2,
    digits_seeds: int = 10,
) -> dict:
    size = "quick" if quick else "gpt2"
    out = {"size": size, "state": state_bytes(size)}
    if costs:
        if gcm.plugin_available():
            out["step"] = step_costs(size)
            out["train_step"] = train_step_costs(size)
        else:
            try:
                args = ["--no-convergence"]
                delegated = gcm.delegate_to_gpu_aot(Path(__file__), quick, args)
                out["step"], out["train_step"] = delegated["step"], delegated["train_step"]
            except gcm.Skip as e:
                out["step_skipped"] = str(e)
    if convergence:
        from benchmarks import memory_convergence

        out["convergence"] = memory_convergence.run(quick, char_lm_seeds, digits_seeds)
    return out


def print_convergence(conv: dict) -> None:
    """The convergence tables and the bit-identity check, on stdout."""
    lm = conv["char_lm"]
    print(f"\nchar-LM, bf16 compute, {lm['steps']} steps, {lm['seeds']} seed(s)")
    keys = ["mode", "val_bits_per_byte", "vs_float32_state_pct", "bytes_per_param"]
    print(_table(lm["rows"], keys))
    same = lm["bit_identical"]
    verdict = "bit-identical" if all(same[k] for k in ("losses", "metric", "masters")) else "DIFFER"
    print(f"{' vs '.join(same['pair'])}: {verdict} ({same})")
    d = conv["digits"]
    print(f"\ndigits, bf16 compute, {d['steps']} steps, {d['seeds']} seeds")
    keys = ["mode", "accuracy_mean", "accuracy_std", "vs_float32_state_pp", "bytes_per_param"]
    print(_table(d["rows"], keys))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models and runs, for tests")
    p.add_argument("--no-costs", action="store_true", help="skip the H100 cost model")
    p.add_argument("--no-convergence", action="store_true", help="skip the training runs")
    p.add_argument("--char-lm-seeds", type=int, default=2, help="char-LM seeds per mode")
    p.add_argument("--digits-seeds", type=int, default=10, help="digits seeds per mode")
    p.add_argument("--json", type=Path, help="write the result here")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if min(args.char_lm_seeds, args.digits_seeds) < 1:
        p.error("--char-lm-seeds and --digits-seeds must be >= 1")
    start = time.perf_counter()
    result = run(
        args.quick,
        not args.no_costs,
        not args.no_convergence,
        args.char_lm_seeds,
        args.digits_seeds,
    )
    shown = [a for i, a in enumerate(argv) if a != "--json" and argv[i - 1 : i] != ["--json"]]
    result["about"] = {**_about(shown), "seconds": round(time.perf_counter() - start)}
    keys = ["mode", "param_bytes", "opt_state_bytes", "bytes_per_param", "GiB_per_device_fsdp8"]
    print(f"Training state, {result['size']} LM ({result['state'][0]['params']:,} params)")
    print(_table(result["state"], keys))
    if "step" in result:
        print("\nOptimizer step on the H100 cost model")
        print(_table(result["step"], ["mode", "bytes", "bytes_vs_today", "roofline_vs_today"]))
        batch = lm_config(result["size"])["batch"]
        print(f"\nWhole train step on the H100 cost model (batch {batch})")
        keys = ["mode", "roofline_ms", "roofline_vs_today", "bytes_vs_today", "temp_GiB"]
        print(_table(result["train_step"], keys))
    elif args.no_costs:
        print("\nH100 cost model: not run (--no-costs)")
    else:
        print("\nH100 cost model skipped:", result.get("step_skipped"))
    if "convergence" in result:
        print_convergence(result["convergence"])
    print(f"\n{result['about']['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
