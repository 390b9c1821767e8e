"""Multi-GPU cost model: GPT-2 small (FSDP) and ResNet-50 (data parallel) on 8 deviceless H100s.

Each variant's train step is compiled (no GPU needed; the `gpu-aot` environment, see
`benchmarks/gpu_cost_model.py`) for 8 H100s of `h100_topology("1x1x8")` (one host) or
`"2x1x4"` (two hosts of four) with a `Mesh` of one `fsdp` axis over all 8: every state leaf
(params, optimizer state, master weights, fp8 meta) split along its largest dimension divisible
by 8 (replicated if none is), the batch split on the same axis, the state donated and kept in
its shardings. The optimized per-device HLO is read by `mpjax/_src/analysis/collectives.py`:
collectives by op and dtype with bytes, and a ring estimate of the communication time
(all-gather / reduce-scatter send (n-1)/n of the buffer per device, all-reduce 2(n-1)/n) at
NVLink's 450 GB/s, at the inter-host bandwidth (`--inter-host-gbps`, default 50), and "by
link": each collective classified by its replica groups (a group holding devices of both
hosts rings across them and is limited by the inter-host link; a group within one host runs
on NVLink) and charged at that link's bandwidth; plus XLA's
per-device temp and argument memory and the state bytes per parameter. Ratios are against the
hand-written Flax bf16 + optax.adamw anchor of the same run.

`--model resnet` (or `all`): ResNet-50 data parallel over the same 8 devices: the state
(params, BatchNorm statistics, SGD momentum) replicated, the batch (128 per device) split on
the axis. The step is one global jit program, so BatchNorm's batch statistics are over the
global batch: XLA all-reduces them (synchronised BatchNorm). Anchor: hand-written Flax bf16
ResNet + optax.sgd; the mpjax paths are the policy, fp16 + `loss_scaled` (default check and
`impl="pallas"`) and the net on `mpjax.nn.ConvBN` (XLA and Pallas kernels); `fp16-hand`
(hand-written Flax float16) shows what XLA does with any float16 net: it all-gathers the
batch for the stem max-pool's backward (`select_and_scatter`) in float16, as the fp16
policy does.

`--mesh hsdp`: a `("replica", "fsdp")` mesh of (hosts, GPUs per host), the state split within
a host and replicated across hosts (HSDP), the batch over both axes: on `2x1x4` the "by link"
column shows what stays on NVLink.

    JAX_PLATFORMS=cpu $MPJAX_GPU_AOT_PYTHON benchmarks/multi_gpu_cost.py --quick
    JAX_PLATFORMS=cpu $MPJAX_GPU_AOT_PYTHON benchmarks/multi_gpu_cost.py --quick --model resnet
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpjax  # noqa: E402
from benchmarks.common import emit  # noqa: E402
from benchmarks.fp8_cost import FP8_VARIANTS  # noqa: E402
from benchmarks.gpu_cost_model import delegate_to_gpu_aot, plugin_available  # noqa: E402
from benchmarks.train_models import LM_SIZES, RESNET_SIZES, VOCAB  # noqa: E402
from benchmarks.train_variants import (  # noqa: E402
    FP16,
    LM_VARIANTS,
    ONE_STRING,
    RESNET_VARIANTS,
    _convbn,
    _lm,
    _lm_with,
    _resnet,
    _resnet_with,
)
from mpjax._src.analysis.collectives import (  # noqa: E402
    collectives,
    comm_seconds,
    link_bytes,
    link_seconds,
    summary,
)
from mpjax._src.analysis.target import h100_topology, target_cudnn  # noqa: E402

REQUIRES_GPU = False
TITLE = "Multi-GPU cost model: train steps on 8 deviceless H100s, vs hand-written bf16"
AXIS = "fsdp"
REPLICA = "replica"
NVLINK_BYTES_PER_S = 450e9
ANCHOR = "bf16"
MIB = 2**20
COLUMNS = [
    "model",
    "topology",
    "mesh",
    "variant",
    "collectives",
    "collective MiB",
    "vs anchor",
    "comm ms NVLink",
    "comm ms inter-host",
    "comm ms by link",
    "temp MiB/dev",
    "args MiB/dev",
    "state B/param",
    "by op and dtype (count, MiB)",
]


def _adamw():
    return optax.adamw(3e-4, b2=0.95, weight_decay=0.1)


def _scaled(module_fn, loss_scale=None, **kw):
    return _lm_with(module_fn, tx=mpjax.loss_scaled(_adamw(), loss_scale, **kw), scaled=True)


BF16_PARAMS = "params=bfloat16,compute=bfloat16,output=float32"


def _bf16_params(master_weights: str):
    """bf16-stored params (policy `param_dtype=bfloat16`) with `loss_scaled`'s master.

    `master_weights="auto"`: a float32 master per param; `"remainder"`: its low 16 bits.
    """

    def build(cfg):
        tx = mpjax.loss_scaled(_adamw(), mpjax.NoOpLossScale(), master_weights=master_weights)
        model = lambda c: mpjax.apply_policy(_lm(c), BF16_PARAMS)  # noqa: E731
        program = _lm_with(model, tx=tx, scaled=True)(cfg)

        def init(key):
            params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), program.init(key)[0])
            return params, tx.init(params)

        return program._replace(init=init)

    return build


VARIANTS = {
    "bf16": LM_VARIANTS["bf16"],
    "bf16-xla": LM_VARIANTS["bf16-xla"],
    "autocast": LM_VARIANTS["autocast"],
    "policy-noop-scaled": _scaled(
        lambda c: mpjax.apply_policy(_lm(c), ONE_STRING), mpjax.NoOpLossScale()
    ),
    "fp16-scaled": LM_VARIANTS["fp16-scaled"],
    "fp16-scaled-pallas": _scaled(lambda c: mpjax.apply_policy(_lm(c), FP16), impl="pallas"),
    "bf16-params-master": _bf16_params("auto"),
    "bf16-params-remainder": _bf16_params("remainder"),
    "fp8-delayed": FP8_VARIANTS["fp8-delayed"],
    "fp8-tensorwise": FP8_VARIANTS["fp8-tensorwise"],
}

# ResNet-50 data parallel: hand-written bf16 + SGD momentum (anchor) and mpjax's paths.
RESNET_DP_VARIANTS = {
    "bf16": RESNET_VARIANTS["bf16"],
    "policy": RESNET_VARIANTS["policy"],
    # Hand-written Flax float16 (no loss scaling): what XLA does with a float16 net at all.
    "fp16-hand": _resnet_with(lambda c: _resnet(c, dtype=jnp.float16)),
    "fp16-bare": RESNET_VARIANTS["fp16-bare"],  # the fp16 policy, no loss scaling
    "fp16-scaled": RESNET_VARIANTS["fp16-scaled"],
    "fp16-scaled-pallas": _resnet_with(
        lambda c: mpjax.apply_policy(_resnet(c), FP16),
        tx=mpjax.loss_scaled(optax.sgd(0.1, momentum=0.9), impl="pallas"),
        scaled=True,
    ),
    "convbn-xla": _convbn("xla", ONE_STRING),
    "convbn-pallas": _convbn("pallas", ONE_STRING),
}

# model -> (variants, how the state is split: "fsdp" or "replicated")
MODELS = {"lm": (VARIANTS, "fsdp"), "resnet": (RESNET_DP_VARIANTS, "replicated")}


def config(quick: bool, model: str = "lm") -> dict:
    """GPT-2 small at global batch 64 (8 per device), or the quick LM at batch 8; ResNet-50
    at 128 images per device (global 1024), or the quick ResNet at 16 per device."""
    if model == "resnet":
        cfg = dict(RESNET_SIZES["quick" if quick else "full"])
        cfg["batch"] *= 8
        return cfg
    cfg = dict(LM_SIZES["quick" if quick else "gpt2"])
    cfg["vocab"] = VOCAB["quick" if quick else "full"]
    cfg["batch"] = 8 if quick else 64
    return cfg


def fsdp_spec(shape: tuple, n: int) -> P:
    """Split along the largest dimension divisible by `n` (the first of equals); else none."""
    dims = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
    if not dims:
        return P()
    best = max(dims, key=lambda i: (shape[i], -i))
    return P(*(AXIS if i == best else None for i in range(len(shape))))


def _placed(tree, mesh: Mesh, spec_fn):
    def one(x):
        sharding = NamedSharding(mesh, spec_fn(x))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


MESHES = ("fsdp", "hsdp")


def make_mesh(topology: str, layout: str = "fsdp") -> Mesh:
    """One `fsdp` axis over the topology's devices, or (`"hsdp"`) `("replica", "fsdp")`:
    one row per host (state split within a host, replicated across hosts, as HSDP does)."""
    devices = h100_topology(topology).devices
    if layout == "hsdp":
        hosts = len({d.process_index for d in devices})
        return Mesh(np.array(devices).reshape(hosts, -1), (REPLICA, AXIS))
    return Mesh(np.array(devices).reshape(len(devices)), (AXIS,))


def compile_fsdp(program, mesh: Mesh, split: str = "fsdp"):
    """The train step compiled with its batch split over every mesh axis and its state split
    FSDP-style over the `fsdp` axis (`split="fsdp"`) or replicated (`"replicated"`: data
    parallel)."""
    n = mesh.shape[AXIS]
    key = jax.random.key(0)
    spec = (lambda x: fsdp_spec(x.shape, n)) if split == "fsdp" else (lambda x: P())
    state = _placed(jax.eval_shape(program.init, key), mesh, spec)
    batch_axes = tuple(mesh.axis_names)
    batch = _placed(
        jax.eval_shape(program.batch, key), mesh, lambda x: P(batch_axes) if x.ndim else P()
    )
    out = (jax.tree.map(lambda x: x.sharding, state), NamedSharding(mesh, P()))
    step = jax.jit(program.step, out_shardings=out, donate_argnums=0)
    with target_cudnn():
        return step.trace(state, batch).lower().compile(), state


def _param_count(state) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state[0]))


def measure(
    topology: str,
    variant: str,
    cfg: dict,
    inter_host_bytes_per_s: float,
    model: str = "lm",
    layout: str = "fsdp",
) -> dict:
    """One variant on one topology: collectives, comm time, memory, state bytes per param."""
    mesh = make_mesh(topology, layout)
    devices = list(mesh.devices.flat)
    variants, split = MODELS[model]
    compiled, state = compile_fsdp(variants[variant](cfg), mesh, split)
    records = collectives(compiled.as_text())
    memory = compiled.memory_analysis()
    n = len(devices)
    # The HLO's device ids index the program's device assignment: the mesh's devices in order.
    hosts = [d.process_index for d in mesh.devices.flat]
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return {
        "model": model,
        "topology": topology,
        "mesh": ",".join(f"{a}={k}" for a, k in mesh.shape.items()),
        "variant": variant,
        "collectives": len(records),
        "collective_bytes": sum(r.bytes for r in records),
        "comm_s_nvlink": comm_seconds(records, n, NVLINK_BYTES_PER_S),
        "comm_s_inter_host": comm_seconds(records, n, inter_host_bytes_per_s),
        "comm_s_links": link_seconds(records, hosts, NVLINK_BYTES_PER_S, inter_host_bytes_per_s),
        "link_bytes": link_bytes(records, hosts),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "state_bytes_per_param": state_bytes / _param_count(state),
        "by_op_dtype": summary(records),
        "records": [r._asdict() for r in records],
    }


def _row(r: dict, anchor: dict) -> list:
    ratio = r["collective_bytes"] / anchor["collective_bytes"] if anchor["collective_bytes"] else 0
    ops = "; ".join(
        f"{k} {v['count']}x {v['bytes'] / MIB:.2f}" for k, v in r["by_op_dtype"].items()
    )
    return [
        r["model"],
        r["topology"],
        r["mesh"],
        r["variant"],
        r["collectives"],
        round(r["collective_bytes"] / MIB, 2),
        round(ratio, 4),
        round(r["comm_s_nvlink"] * 1e3, 3),
        round(r["comm_s_inter_host"] * 1e3, 3),
        round(r["comm_s_links"] * 1e3, 3),
        round(r["temp_bytes"] / MIB, 1),
        round(r["argument_bytes"] / MIB, 1),
        round(r["state_bytes_per_param"], 3),
        ops,
    ]


def run(
    quick: bool = False,
    topologies=("1x1x8", "2x1x4"),
    variants=None,
    inter_host_gbps=50.0,
    models=("lm",),
    layout="fsdp",
) -> dict:
    """Every variant of every model on every topology (the `benchmarks/run.py` entry)."""
    if not plugin_available():
        return delegate_to_gpu_aot(Path(__file__), quick)
    results, configs = [], {}
    for model in models:
        configs[model] = cfg = config(quick, model)
        known = MODELS[model][0]
        wanted = [v for v in (variants or known) if v in known]
        if ANCHOR not in wanted:
            wanted.insert(0, ANCHOR)
        for t in topologies:
            for v in wanted:
                results.append(measure(t, v, cfg, inter_host_gbps * 1e9, model, layout))
                print(f"[multi-gpu] {model} {t} {v}", file=sys.stderr, flush=True)
    anchors = {(r["model"], r["topology"]): r for r in results if r["variant"] == ANCHOR}
    return {
        "title": TITLE + (" (quick sizes)" if quick else ""),
        "columns": COLUMNS,
        "rows": [_row(r, anchors[r["model"], r["topology"]]) for r in results],
        "notes": (
            f"jax {jax.__version__}; sizes {configs} (batch: global); mesh '{layout}': "
            + (
                f"('{AXIS}',) over the 8 devices of each topology (2x1x4: every 8-way "
                "collective crosses hosts). "
                if layout == "fsdp"
                else f"('{REPLICA}', '{AXIS}') = (hosts, GPUs per host): state split on "
                f"'{AXIS}' (within a host), replicated over '{REPLICA}', batch over both. "
            )
            + "LM: "
            "FSDP, state leaves split along their largest dimension divisible by 8; ResNet: "
            "data parallel, state replicated, BatchNorm statistics over the global batch. "
            "Batch split on the axis, state donated. "
            "Collectives: one per array moved (a combined all-reduce of k arrays counts k); "
            "bytes: gathered result of an all-gather, operand of a reduce-scatter, array of an "
            "all-reduce. Comm: ring estimate, sum over collectives, no overlap, every "
            f"collective at 450 GB/s (NVLink) and at {inter_host_gbps} GB/s (inter-host); 'by "
            "link': each collective at the bandwidth of its bottleneck link, read from its "
            "replica groups (a group with devices of two hosts: inter-host; within one host: "
            "NVLink), ring factor of its group's size. Memory: XLA's per-device "
            "buffer assignment. State bytes/param: all state leaves (params, optimizer "
            "state, master weights, scale, fp8 meta, BatchNorm statistics) over the "
            "parameter count."
        ),
        "details": [{k: v for k, v in r.items() if k != "records"} for r in results],
    }


def main(argv=None) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--topologies", default="1x1x8,2x1x4")
    parser.add_argument("--model", default="lm", choices=("lm", "resnet", "all"))
    known = sorted(set(VARIANTS) | set(RESNET_DP_VARIANTS))
    parser.add_argument("--variants", default="", help=f"comma-separated, of {known}")
    parser.add_argument("--inter-host-gbps", type=float, default=50.0)
    parser.add_argument(
        "--mesh",
        default="fsdp",
        choices=MESHES,
        help="fsdp: one axis over all 8 GPUs; hsdp: (hosts, GPUs per host), state split "
        "within a host and replicated across hosts",
    )
    parser.add_argument("--json", default=None, help="write the full figures to this file")
    args = parser.parse_args(argv)
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    models = ("lm", "resnet") if args.model == "all" else (args.model,)
    known = set().union(*(MODELS[m][0] for m in models))
    unknown = sorted(set(wanted) - known)
    if unknown:
        parser.error(f"--variants: unknown {unknown} for --model {args.model}; known {known}")
    if not plugin_available():
        raise SystemExit("multi_gpu_cost: deviceless CUDA compile unavailable (no plugin)")
    topologies = tuple(t.strip() for t in args.topologies.split(",") if t.strip())
    result = run(args.quick, topologies, wanted or None, args.inter_host_gbps, models, args.mesh)
    return emit(result, args.json)


if __name__ == "__main__":
    main()
