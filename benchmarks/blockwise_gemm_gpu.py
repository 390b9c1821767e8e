"""The blockwise fp8 GEMM kernels on a real GPU: Mosaic GPU vs Triton vs cuBLAS, with numerics.

    python benchmarks/blockwise_gemm_gpu.py                 # a GPU: the wide LM's shapes
    python benchmarks/blockwise_gemm_gpu.py --json out.json
    python benchmarks/blockwise_gemm_gpu.py --smoke         # any device: tiny, interpret mode

`blockwise_gemm_gpu` (a study: `(case=None, quick=False, smoke=False) -> table`) times, at the
wide LM's GEMM shapes (tokens 8192, d 4096, MLP 16384: forward and input gradient `a [M, K] @
b [N, K].T`, and the weight gradient, contracted over the tokens), in alternating rounds:
- `mosaic_gpu`: `blockwise_fp8_gemm(kernel="mosaic_gpu")` (what `block_lowering="native"` runs);
- `triton`: `blockwise_fp8_gemm(kernel="triton")` (what `"auto"` runs on Hopper today);
- `xla`: its XLA reference (both operands dequantised to float32, one float32 GEMM);
- `bf16`: a bfloat16 cuBLAS GEMM of the same shape (the anchor of "x bf16");
- `fp8-tensorwise`: one scale per operand, XLA's cuBLASLt fp8 GEMM.
Each row also gives the kernel's largest error against the `xla` result, over that result's
largest magnitude (a check of the kernel's numbers on the GPU, which no CPU test can run).
Without a GPU (or `--smoke`): tiny shapes, the kernels in Pallas interpret mode, not a
measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (name, M, N, K) of `a [M, K] @ b [N, K].T` in the wide LM's step (benchmarks' "wide" size)
WIDE_SHAPES = (
    ("attention q/k/v/out fwd", 8192, 4096, 4096),
    ("MLP up fwd", 8192, 16384, 4096),
    ("MLP down fwd / up dgrad", 8192, 4096, 16384),
    ("MLP up wgrad (over tokens)", 4096, 16384, 8192),
)
SMOKE_SHAPES = (("smoke", 200, 136, 256),)


def _operands(m: int, n: int, k: int, seed: int = 0):
    """fp8 operands and per-(row, 128 of K) scales of a realistic spread."""
    import jax
    import jax.numpy as jnp

    ka, kb, ksa, ksb = jax.random.split(jax.random.key(seed), 4)
    fp8 = jnp.float8_e4m3fn
    a = (jax.random.normal(ka, (m, k)) * 64).astype(fp8)
    b = (jax.random.normal(kb, (n, k)) * 64).astype(fp8)
    sa = 2.0 ** jax.random.randint(ksa, (m, k // 128), -12, 0).astype(jnp.float32)
    sb = 2.0 ** jax.random.randint(ksb, (n, k // 128), -12, 0).astype(jnp.float32)
    return a, sa, b, sb


def blockwise_gemm_gpu(case=None, quick: bool = False, smoke: bool = False) -> dict:
    """Times the kernels against cuBLAS (module docstring); quick/smoke or no GPU: tiny."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import interleaved_times, table
    from mpjax._src.kernels import blockwise_gemm_mgpu as mgpu
    from mpjax._src.kernels.blockwise_gemm import blockwise_fp8_gemm

    on_gpu = jax.default_backend() == "gpu"
    small = quick or smoke or not on_gpu
    impl = "interpret" if small else "pallas"
    rounds, iters = (2, 1) if small else (7, 20)
    rows = []
    for name, m, n, k in SMOKE_SHAPES if small else WIDE_SHAPES:
        a, sa, b, sb = _operands(m, n, k)
        gemm = functools.partial(blockwise_fp8_gemm, out_dtype=jnp.bfloat16)
        fns = {
            "triton": jax.jit(functools.partial(gemm, impl=impl, kernel="triton")),
            "xla": jax.jit(functools.partial(gemm, impl="xla")),
        }
        if not small or mgpu.INTERPRET_AVAILABLE:
            fns["mosaic_gpu"] = jax.jit(functools.partial(gemm, impl=impl, kernel="mosaic_gpu"))
        args = {name: (a, sa, b, sb) for name in fns}
        a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        fns["bf16"], args["bf16"] = jax.jit(lambda x, y: x @ y.T), (a16, b16)

        def tensorwise(x, sx, y, sy):
            return ((x.astype(jnp.bfloat16) * sx) @ (y.astype(jnp.bfloat16) * sy).T).astype(
                jnp.bfloat16
            )

        fns["fp8-tensorwise"] = jax.jit(tensorwise)
        args["fp8-tensorwise"] = (a, jnp.bfloat16(0.5), b, jnp.bfloat16(0.25))
        want = fns["xla"](*args["xla"]).astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(want)))
        times = interleaved_times(
            {i: functools.partial(f, *args[i]) for i, f in fns.items()},
            rounds=rounds,
            steps_per_round=iters,
        )
        bf16 = statistics.median(times["bf16"])
        for i, t in times.items():
            med = statistics.median(t)
            err = ""
            if i in ("mosaic_gpu", "triton"):
                got = fns[i](*args[i]).astype(jnp.float32)
                err = f"{float(jnp.max(jnp.abs(got - want))) / scale:.2e}"
            tflops = 2 * m * n * k / med / 1e12
            rows.append([f"{name} [{m}x{k}]x[{n}x{k}]^T", i, round(med * 1e3, 4)])
            rows[-1] += [round(tflops, 1), round(med / bf16, 3), err]
    notes = (
        f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; medians of {rounds} "
        f"alternating rounds of {iters} calls; bfloat16 out. 'x bf16' is the time over the "
        "bf16 cuBLAS GEMM's; 'max err' is against the xla (dequantised float32) result, "
        "over its largest magnitude (bf16 output: ~4e-3 is one rounding)."
    )
    if small:
        notes = "SMOKE RUN, NOT A MEASUREMENT: tiny shapes, kernels interpreted. " + notes
    cols = ["GEMM", "impl", "ms median", "TFLOPS", "x bf16", "max err"]
    return table("Blockwise fp8 GEMM kernels vs cuBLAS", cols, rows, notes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the table here too")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode")
    args = p.parse_args(argv)
    result = blockwise_gemm_gpu(smoke=args.smoke)
    for row in result["rows"]:
        print("  ".join(str(c) for c in row), flush=True)
    print(result["notes"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
