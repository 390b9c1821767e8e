"""Data-parallel mixed-precision training of a small CNN on the sklearn digits.

Three idioms (``--mode``), each with the same model, data and optimizer:

  pmap       per-device program; gradients averaged with ``lax.pmean``, and
             ``mpjax.loss_scaled(..., axis_name="data")`` takes one skip decision for all devices.
  pjit       ``jax.jit`` over a ``Mesh``: the batch is sharded over the "data" axis with
             ``NamedSharding``, params are replicated, XLA inserts the gradient all-reduce.
             ``--zero`` also shards the fp32 master weights and optimizer state over "data"
             (ZeRO stage 1: each device keeps 1/N of them).
  shard_map  ``jax.shard_map`` over the same mesh; the loss is ``pmean``-ed *before*
             differentiation (see `make_data_parallel`), ``loss_scaled(axis_name="data")``.
  single     one device: the reference the others must match.

Precision (``--precision``): fp16 (float16 params and compute, fp32 master weights in the
optimizer state, dynamic loss scaling; the default), bf16 (bfloat16, fp32 master weights, no
scaling needed), fp32.

Single machine (8 simulated CPU devices):

    python examples/data_parallel.py --mode pjit --cpu-devices 8 --steps 200
    python examples/data_parallel.py --mode pmap --cpu-devices 8 --precision bf16

Several processes (one per host, the same command everywhere; each process feeds its share
of the global batch). Two processes with two CPU devices each on one machine:

    for i in 0 1; do python examples/data_parallel.py --mode pjit --cpu-devices 2 \\
        --num-processes 2 --process-id $i --coordinator 127.0.0.1:12355 & done; wait

On a GPU cluster run one process per host with all its GPUs, the same command on every host:

    python examples/data_parallel.py --mode pjit --num-processes $NUM_HOSTS \\
        --process-id $HOST_RANK --coordinator $HOST0_ADDRESS:12355
    # under SLURM or Open MPI, let jax.distributed detect everything:
    srun --ntasks-per-node=1 python examples/data_parallel.py --mode pjit --distributed

``--inject-inf-step S --inject-inf-process P`` puts an inf into process P's local batch at
step S, to watch every device and process skip that step together.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn
import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from examples.digits_cnn import (
    PRECISIONS,
    global_batch_indices,
    init_state,
    load_data,
    loss_fn,
    make_model,
    make_optimizer,
    precision_policy,
)
from mpjax.scaling import find_loss_scaled_state

AXIS = "data"
MODES = ("single", "pmap", "pjit", "shard_map")


def local_rows(batch_size: int) -> slice:
    """This process's contiguous share of a global batch of `batch_size` rows."""
    count, index = jax.process_count(), jax.process_index()
    if batch_size % jax.device_count():
        raise ValueError(
            f"global batch size {batch_size} is not divisible by the {jax.device_count()} devices"
        )
    local = batch_size // count
    return slice(index * local, (index + 1) * local)


def scaled_grads(model, params, opt_state, x, y, *, loss_axis: str | None = None):
    """``(loss, grads)``: the loss and the gradients of the *scaled* loss.

    With `loss_axis` the loss is ``pmean``-ed over that axis before differentiating.
    """

    def scaled(p):
        loss = loss_fn(model, p, x, y)
        if loss_axis is not None:
            loss = lax.pmean(loss, loss_axis)
        return mpjax.scale_loss(loss, opt_state), loss

    (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    return loss, grads


def apply_grads(tx, params, opt_state, grads, loss):
    """One optimizer step; returns ``(params, opt_state, metrics)``."""
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, **mpjax.scaling_metrics(opt_state)}


def zero_shardings(tree: Any, mesh: Mesh, axis: str = AXIS) -> Any:
    """ZeRO-style shardings: each leaf split over `axis` along its largest divisible dimension.

    Leaves with no dimension divisible by the axis size (scalars, a 10-wide bias) stay
    replicated.
    """
    n = mesh.shape[axis]

    def sharding(x):
        dims = [i for i, d in enumerate(x.shape) if d >= n and d % n == 0]
        if not dims:
            return NamedSharding(mesh, P())
        dim = max(dims, key=lambda i: x.shape[i])
        return NamedSharding(mesh, P(*[axis if i == dim else None for i in range(len(x.shape))]))

    return jax.tree.map(sharding, tree)


class DataParallel(NamedTuple):
    """A training set-up for one mode.

    Attributes:
      mode: one of `MODES`.
      init: ``seed -> (params, opt_state)``, created in place (pmap: one copy per local
        device along a leading axis).
      place: ``(params, opt_state)`` on the host -> placed like `init`'s result.
      step: ``(params, opt_state, x, y) -> (params, opt_state, metrics)``; donates its
        params and state.
      put_batch: ``(x, y)``, this process's rows (numpy) -> device arrays for `step`.
      mesh: the mesh (pjit, shard_map), else None.
    """

    mode: str
    init: Any
    place: Any
    step: Any
    put_batch: Any
    mesh: Mesh | None


def make_data_parallel(
    mode: str,
    precision: str = "fp16",
    *,
    lr: float = 1e-3,
    loss_scale: mpjax.LossScale | None = None,
    inner: optax.GradientTransformation | None = None,
    zero: bool = False,
    devices: list | None = None,
    grad_hook: Any = None,
    model: nn.Module | None = None,
) -> DataParallel:
    """Builds the init, step and batch placement of one data-parallel mode.

    Args:
      mode: "single", "pmap", "pjit" or "shard_map".
      precision: "fp16", "bf16" or "fp32".
      lr: learning rate of the default Adam.
      loss_scale: an mpjax `LossScale`; None picks `default_loss_scale(precision)`.
      inner: the optax optimizer inside `loss_scaled`; None means ``optax.adam(lr)``.
      zero: pjit only: shard master weights and optimizer state over the data axis.
      devices: the devices (default: all; "single" uses the first).
      grad_hook: pmap only: ``grads -> grads`` applied to each device's gradients before the
        ``pmean`` (to inject faults).
      model: the Flax model; None means `make_model(precision_policy(precision))`.

    Returns:
      A `DataParallel`.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if zero and mode != "pjit":
        raise ValueError(f"zero=True shards state with jit shardings: mode 'pjit', not {mode!r}")
    if grad_hook is not None and mode != "pmap":
        raise ValueError(f"grad_hook is supported in mode 'pmap' only, not {mode!r}")
    model = make_model(precision_policy(precision)) if model is None else model
    devices = list(jax.devices() if devices is None else devices)
    per_device = mode in ("pmap", "shard_map")
    tx = make_optimizer(
        precision, lr=lr, loss_scale=loss_scale, inner=inner, axis_name=AXIS if per_device else None
    )
    init_fn = functools.partial(init_state, model, tx)

    def global_body(params, opt_state, x, y):
        loss, grads = scaled_grads(model, params, opt_state, x, y)
        return apply_grads(tx, params, opt_state, grads, loss)

    if mode == "single":
        device = devices[0]
        place = functools.partial(jax.device_put, device=device)
        return DataParallel(
            mode,
            lambda seed: place(jax.jit(init_fn)(jax.random.key(seed))),
            place,
            jax.jit(global_body, donate_argnums=(0, 1)),
            lambda x, y: place((x, y)),
            None,
        )

    if mode == "pmap":
        local = [d for d in devices if d.process_index == jax.process_index()]
        stacked = NamedSharding(Mesh(np.array(local), (AXIS,)), P(AXIS))

        def pmap_body(params, opt_state, x, y):
            loss, grads = scaled_grads(model, params, opt_state, x, y)
            if grad_hook is not None:
                grads = grad_hook(grads)
            grads, loss = lax.pmean((grads, loss), AXIS)
            return apply_grads(tx, params, opt_state, grads, loss)

        def pmap_place(state):
            copies = jax.tree.map(lambda a: np.broadcast_to(a, (len(local),) + np.shape(a)), state)
            return jax.device_put(copies, stacked)

        def pmap_batch(x, y):
            split = lambda a: a.reshape((len(local), -1) + a.shape[1:])
            return jax.device_put((split(x), split(y)), stacked)

        return DataParallel(
            mode,
            lambda seed: pmap_place(jax.device_get(jax.jit(init_fn)(jax.random.key(seed)))),
            pmap_place,
            jax.pmap(pmap_body, axis_name=AXIS, devices=devices, donate_argnums=(0, 1)),
            pmap_batch,
            None,
        )

    mesh = Mesh(np.array(devices), (AXIS,))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(AXIS))
    abstract_params, abstract_opt = jax.eval_shape(init_fn, jax.random.key(0))
    param_sh = jax.tree.map(lambda _: replicated, abstract_params)
    if zero:
        opt_sh = zero_shardings(abstract_opt, mesh)
    else:
        opt_sh = jax.tree.map(lambda _: replicated, abstract_opt)

    if mode == "pjit":
        body = global_body
    else:
        # shard_map: params enter replicated, so `jax.grad` of a per-device loss would
        # return the *sum* of the per-device gradients already (the transpose of the
        # implicit broadcast is a psum) and a `pmean` of them is then a no-op. Averaging the
        # loss over the axis before differentiating gives the global-batch gradient.
        def per_device(params, opt_state, x, y):
            loss, grads = scaled_grads(model, params, opt_state, x, y, loss_axis=AXIS)
            return apply_grads(tx, params, opt_state, grads, loss)

        body = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(), P(AXIS), P(AXIS)),
            out_specs=(P(), P(), P()),
        )

    step = jax.jit(
        body,
        in_shardings=(param_sh, opt_sh, batch_sharding, batch_sharding),
        out_shardings=(param_sh, opt_sh, replicated),
        donate_argnums=(0, 1),
    )
    # Created in place: with zero=True no device ever holds the whole optimizer state.
    init = jax.jit(init_fn, out_shardings=(param_sh, opt_sh))

    def put_batch(x, y):
        # Each process passes its own rows; together they form the global batch.
        return tuple(
            jax.make_array_from_process_local_data(
                batch_sharding, a, (a.shape[0] * jax.process_count(),) + a.shape[1:]
            )
            for a in (x, y)
        )

    return DataParallel(
        mode,
        lambda seed: init(jax.random.key(seed)),
        lambda state: jax.device_put(state, (param_sh, opt_sh)),
        step,
        put_batch,
        mesh,
    )


# ------------------------------------------------------------------------ loop and launcher


def to_host(tree: Any) -> Any:
    """Numpy copies of the leaves, gathering arrays that span other processes."""
    from jax.experimental import multihost_utils

    def get(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            if a.sharding.is_fully_replicated:
                return np.asarray(a.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)

    return jax.tree.map(get, tree)


def unreplicated(dp: DataParallel, tree: Any) -> Any:
    """`to_host`, keeping device 0's copy in pmap mode (whose leaves carry a device axis)."""
    host = to_host(tree)
    return jax.tree.map(lambda a: a[0], host) if dp.mode == "pmap" else host


def train(
    dp: DataParallel,
    train_data,
    *,
    steps: int,
    batch_size: int,
    seed: int = 0,
    inject_inf: tuple[int, int] | None = None,
    callback: Any = None,
):
    """Runs `steps` steps on global batches of `batch_size`; returns ``(params, opt_state)``.

    Args:
      dp: a `DataParallel`.
      train_data: ``(x, y)`` numpy arrays, the same in every process.
      steps: number of steps.
      batch_size: global batch size (all processes together).
      seed: init and batch-order seed.
      inject_inf: ``(step, process)``: an inf goes into the first image of that process's
        local batch at that step.
      callback: called as ``callback(step, params, opt_state, metrics)`` after each step.
    """
    x_all, y_all = train_data
    rows = local_rows(batch_size)
    params, opt_state = dp.init(seed)
    for step in range(steps):
        idx = global_batch_indices(len(y_all), batch_size, step, seed)[rows]
        x, y = x_all[idx], y_all[idx]
        if inject_inf is not None and inject_inf == (step, jax.process_index()):
            x = x.copy()
            x[0, 0, 0, 0] = np.inf
        params, opt_state, metrics = dp.step(params, opt_state, *dp.put_batch(x, y))
        if callback is not None:
            callback(step, params, opt_state, metrics)
    return params, opt_state


def accuracy(model: nn.Module, params: Any, data) -> float:
    """Test accuracy of host `params` on ``(x, y)``."""
    x, y = data
    logits = jax.jit(model.apply)({"params": params}, x)
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=MODES, default="pjit")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp16")
    parser.add_argument("--zero", action="store_true", help="pjit: shard master + opt state")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--cpu-devices", type=int, default=0, help="simulate N CPU devices")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default=None, help="host:port of process 0")
    parser.add_argument(
        "--distributed", action="store_true", help="jax.distributed.initialize() (auto-detect)"
    )
    parser.add_argument("--inject-inf-step", type=int, default=None)
    parser.add_argument("--inject-inf-process", type=int, default=0)
    parser.add_argument("--save", default=None, help="npz of per-step params and metrics")
    return parser.parse_args(argv)


# Simulated CPU devices share one thread pool of XLA:CPU, sized (on a 2-core machine) to
# exactly the device count; a collective blocks a pool thread per device until all arrive, so
# when one device's part waits behind a blocked thread the program deadlocks, and XLA ends it
# after 40 s ("Expected 8 threads to join the rendezvous, but only 7 of them arrived on time",
# exit 134; seen 1 run in 4 on a loaded 2-core machine, and once with a 600 s wait). A pool of
# twice the devices (XLA reads its size from NPROC) leaves threads free for the late device.
def simulated_device_env(environ: dict, devices: int) -> dict:
    """The variables to set before JAX starts `devices` simulated CPU devices: a thread pool
    of at least twice the devices (`NPROC`), unless `environ` sets one already."""
    if "NPROC" in environ:
        return {}
    return {"NPROC": str(max(16, 2 * devices))}


def initialize(args: argparse.Namespace) -> None:
    """Sets up CPU devices and, for several processes, `jax.distributed`."""
    if args.cpu_devices:
        # read by XLA when the CPU client is created, which has not happened yet
        os.environ.update(simulated_device_env(os.environ, args.cpu_devices))
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.num_processes > 1 or args.distributed:
        # Cross-process collectives of the CPU backend (GPUs use NCCL regardless).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if args.num_processes > 1:
            jax.distributed.initialize(
                coordinator_address=args.coordinator or "127.0.0.1:12355",
                num_processes=args.num_processes,
                process_id=args.process_id,
            )
        else:
            jax.distributed.initialize()


def main(argv=None) -> dict:
    """Trains from the command line; returns the final metrics."""
    args = parse_args(argv)
    initialize(args)
    lead = jax.process_index() == 0
    policy = precision_policy(args.precision)
    model = make_model(policy)
    dp = make_data_parallel(args.mode, args.precision, lr=args.lr, zero=args.zero, model=model)
    train_data, test_data = load_data()
    if lead:
        print(
            f"mode={args.mode} precision={args.precision} policy=[{policy}] zero={args.zero} "
            f"processes={jax.process_count()} devices={jax.device_count()}"
        )
    record: dict[str, list] = {"params": [], "master": [], "metrics": []}

    def log(step, params, opt_state, metrics):
        last = step == args.steps - 1
        printing = lead and args.log_every and (step % args.log_every == 0 or last)
        if not (printing or args.save):
            return  # no host sync on this step
        m = unreplicated(dp, metrics)
        if args.save:
            record["params"].append(unreplicated(dp, params))
            master = find_loss_scaled_state(opt_state).master
            record["master"].append(unreplicated(dp, master))
            record["metrics"].append(m)
        if printing:
            mpjax.raise_if_diverged(opt_state)  # stops a dead run (every step skipped)
            print(
                f"step {step:5d}  loss {float(m['loss']):.4f}  "
                f"scale {float(m['loss_scale']):g}  finite {bool(m['grads_finite'])}  "
                f"skipped {int(m['skipped_steps'])}"
            )

    inject = None
    if args.inject_inf_step is not None:
        inject = (args.inject_inf_step, args.inject_inf_process)
    params, opt_state = train(
        dp,
        train_data,
        steps=args.steps,
        batch_size=args.batch_size,
        seed=args.seed,
        inject_inf=inject,
        callback=log,
    )
    acc = accuracy(model, unreplicated(dp, params), test_data)
    final = jax.tree.map(np.asarray, mpjax.scaling_metrics(unreplicated(dp, opt_state)))
    final["test_accuracy"] = acc
    if lead:
        print(f"test accuracy {acc:.3f}")
    if args.save:
        flat = {"test_accuracy": acc}
        for key in ("params", "master"):
            for i, tree in enumerate(record[key]):
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                    flat[f"{key}/{i}/{jax.tree_util.keystr(path)}"] = leaf
        for name in record["metrics"][0]:
            flat[f"metrics/{name}"] = np.stack([m[name] for m in record["metrics"]])
        np.savez(args.save, **flat)
    return final


if __name__ == "__main__":
    main()
