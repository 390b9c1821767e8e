"""Export a converted inference model with `jax.export`, to bytes and back; and its CLI.

The artifact is one msgpack blob holding the serialised `jax.export.Exported` of
`apply(variables, *inputs)` (variables are an argument, so the StableHLO stays small)
and the converted variables. It can be lowered for platforms other than the one the
exporter runs on (`platforms=("cpu", "cuda")` from a CPU machine) and is called with
`load_inference(blob)(x)` on any of them.

Pallas kernels (the fused epilogue of a folded `mpjax.nn.ConvBN`, `impl="auto"` up to jax 0.10,
where JAX does not deprecate the Triton backend; `epilogue_impl="pallas"` on any jax): a CUDA
artifact carries them as Triton custom calls (lowered from a CPU machine for an H100 on jax >=
0.11, which asks for an abstract GPU device), which JAX does not promise to load on a
different jaxlib; and JAX cannot lower them for several platforms in one artifact
(jax-ml/jax#28594), so export one artifact per platform or convert with
`epilogue_impl="xla"` for a ("cpu", "cuda") one.

CLI::

    python -m mpjax.export my_pkg.models:load_trained --input-shape 1,8,8,1 \\
        --policy compute=bfloat16 --platforms cpu,cuda --apply-kwargs '{"train": false}' \\
        --out model.mpjax

where `load_trained()` returns `(model, variables)`.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import serialization

from mpjax._src.inference.convert import InferenceModel, convert_for_inference
from mpjax._src.kernels.gpu_target import abstract_gpu

__all__ = ["LoadedInference", "export_inference", "load_inference", "serialize_inference"]

_FORMAT = "mpjax-inference-v1"
_TRITON = "__gpu$xla.gpu.triton"


def _spec(x: Any, batch: Any) -> jax.ShapeDtypeStruct:
    shape = tuple(x.shape)
    if batch is not None and shape:
        shape = (batch, *shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype)


def export_inference(
    model: InferenceModel,
    example_inputs: Any,
    *,
    platforms: Sequence[str] | None = None,
    polymorphic_batch: bool = False,
    allow_pallas_kernels: bool = True,
) -> jax.export.Exported:
    """Exports `model.apply(variables, *inputs)` with `jax.export` for the given platforms.

    Args:
      model: an `InferenceModel` from `convert_for_inference`.
      example_inputs: an input (or tuple of inputs) giving shapes and dtypes.
      platforms: e.g. `("cpu", "cuda")`; None exports for the default backend only.
      polymorphic_batch: make the leading dimension of every input symbolic, so the
        artifact accepts any batch size.
      allow_pallas_kernels: allow the Triton custom calls of `mpjax.pallas` kernels (a
        folded `ConvBN`'s epilogue) in a CUDA artifact. JAX gives those no
        compatibility guarantee: load such an artifact with the jaxlib that exported it.

    Returns:
      The `jax.export.Exported`; call it with `exported.call(model.variables, *inputs)`.

    Raises:
      ValueError: a Pallas kernel cannot be lowered for several platforms at once
        (jax-ml/jax#28594); the message says what to do instead.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, mpjax
      >>> from mpjax.export import export_inference
      >>> dense, x = nn.Dense(2), jnp.ones((3, 8))
      >>> infer = mpjax.convert_for_inference(
      ...     dense, dense.init(jax.random.key(0), x), "compute=bfloat16", example_inputs=x[:1]
      ... )
      >>> export_inference(infer, x[:1], platforms=("cpu", "cuda")).platforms
      ('cpu', 'cuda')
    """
    if not isinstance(model, InferenceModel):
        raise TypeError(
            f"export_inference expects the InferenceModel returned by convert_for_inference, "
            f"got {type(model).__name__}"
        )
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    batch = jax.export.symbolic_shape("b")[0] if polymorphic_batch else None
    var_specs = jax.tree.map(lambda v: _spec(v, None), model.variables)
    in_specs = [_spec(x, batch) for x in example_inputs]
    plats = None if platforms is None else tuple(platforms)
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON)] if allow_pallas_kernels else []
    exporter = jax.export.export(jax.jit(model.apply), platforms=plats, disabled_checks=checks)
    try:
        with abstract_gpu(plats):  # jax >= 0.11: the Triton lowering names a GPU, none here
            return exporter(var_specs, *in_specs)
    except ValueError as e:
        if "Only interpret mode is supported" not in str(e):
            raise
        raise ValueError(
            f"export_inference: a Pallas kernel (a folded ConvBN's epilogue with impl='auto') "
            f"cannot be lowered for the platforms {plats} at once (jax-ml/jax#28594); export "
            "one artifact per platform, or convert with epilogue_impl='xla'"
        ) from e


def serialize_inference(
    model: InferenceModel,
    example_inputs: Any,
    *,
    platforms: Sequence[str] | None = None,
    polymorphic_batch: bool = False,
    allow_pallas_kernels: bool = True,
) -> bytes:
    """Exports `model` (see `export_inference`) and packs it with its variables into bytes.

    Args:
      model: an `InferenceModel`.
      example_inputs: an input (or tuple of inputs) giving shapes and dtypes.
      platforms: platforms to lower for; None for the default backend.
      polymorphic_batch: accept any leading (batch) dimension.
      allow_pallas_kernels: see `export_inference`.

    Returns:
      The artifact, for `load_inference`.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, mpjax
      >>> from mpjax.export import load_inference, serialize_inference
      >>> mlp = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
      >>> x = jnp.ones((3, 8))
      >>> params = mlp.init(jax.random.key(1), x)
      >>> infer = mpjax.convert_for_inference(mlp, params, "bf16", example_inputs=x[:1])
      >>> blob = serialize_inference(infer, x[:1], polymorphic_batch=True)
      >>> load_inference(blob)(x).shape  # any batch size
      (3, 2)
    """
    exported = export_inference(
        model,
        example_inputs,
        platforms=platforms,
        polymorphic_batch=polymorphic_batch,
        allow_pallas_kernels=allow_pallas_kernels,
    )
    return serialization.msgpack_serialize(
        {
            "format": _FORMAT,
            "policy": str(model.policy),
            "exported": bytes(exported.serialize()),
            "variables": jax.tree.map(np.asarray, model.variables),
        }
    )


class LoadedInference(NamedTuple):
    """A deserialised inference artifact: call it like the model.

    Attributes:
      exported: the `jax.export.Exported`.
      variables: the converted variables (numpy arrays).
      policy: the policy spec it was converted with.
    """

    exported: jax.export.Exported
    variables: dict
    policy: str

    @property
    def platforms(self) -> tuple[str, ...]:
        """The platforms the artifact was lowered for."""
        return tuple(self.exported.platforms)

    def __call__(self, *inputs):
        """Runs the exported function on the current backend."""
        return self.exported.call(self.variables, *inputs)


def load_inference(blob: bytes) -> LoadedInference:
    """Reads bytes written by `serialize_inference`.

    Args:
      blob: the artifact.

    Returns:
      A `LoadedInference`, callable on inputs.

    Raises:
      ValueError: the bytes are not an mpjax inference artifact.
    """
    try:
        data = serialization.msgpack_restore(bytes(blob))
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"load_inference: not an mpjax inference artifact ({e})") from e
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"load_inference: not an mpjax inference artifact (format {_FORMAT!r})")
    exported = jax.export.deserialize(bytearray(data["exported"]))
    return LoadedInference(exported, data["variables"], data["policy"])


def _load_factory(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise SystemExit(f"--model {spec!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module_name), attr)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: convert a model for inference, export it, write the artifact, check it loads."""
    parser = argparse.ArgumentParser(
        prog="python -m mpjax.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument("model", help="'package.module:function' returning (model, variables)")
    parser.add_argument("--input-shape", required=True, help="e.g. 1,8,8,1")
    parser.add_argument("--input-dtype", default="float32")
    parser.add_argument("--policy", default="compute=bfloat16")
    parser.add_argument(
        "--output-dtype", default="float32", help="of the outputs; 'policy': the policy's own"
    )
    parser.add_argument("--platforms", default=None, help="e.g. cpu,cuda (default: this backend)")
    parser.add_argument("--apply-kwargs", default="{}", help="JSON, e.g. '{\"train\": false}'")
    parser.add_argument("--no-fold", action="store_true", help="do not fold BatchNorm")
    parser.add_argument("--polymorphic-batch", action="store_true")
    parser.add_argument(
        "--epilogue-impl", default=None, help="conv_epilogue impl of folded ConvBNs, e.g. xla"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    model, variables = _load_factory(args.model)()
    shape = tuple(int(d) for d in args.input_shape.split(","))
    example = jax.ShapeDtypeStruct(shape, np.dtype(args.input_dtype))
    converted = convert_for_inference(
        model,
        variables,
        args.policy,
        example_inputs=example,
        fold_batchnorm=not args.no_fold,
        apply_kwargs=json.loads(args.apply_kwargs),
        epilogue_impl=args.epilogue_impl,
        output_dtype=None if args.output_dtype == "policy" else args.output_dtype,
    )
    platforms = args.platforms.split(",") if args.platforms else None
    blob = serialize_inference(
        converted, example, platforms=platforms, polymorphic_batch=args.polymorphic_batch
    )
    with open(args.out, "wb") as f:
        f.write(blob)
    loaded = load_inference(blob)
    for lin, bn in converted.report.folded:
        print(f"folded   {bn} into {lin}")
    for bn, why in converted.report.unfolded:
        print(f"unfolded {bn}: {why}")
    print(f"wrote {args.out}: {len(blob)} bytes, platforms {loaded.platforms}")
    if jax.default_backend() in loaded.platforms:
        x = np.random.default_rng(0).normal(size=shape).astype(args.input_dtype)
        got = loaded(x)
        want = jax.jit(converted.apply)(converted.variables, x)
        diffs = jax.tree.map(
            lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()),
            got,
            want,
        )
        worst = max(jax.tree.leaves(diffs))
        print(f"reloaded and ran on {jax.default_backend()}: max |diff| vs converted {worst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
