"""`block_scaled_dot_general`: a `dot_general` whose three GEMMs see block-scaled operands.

The lowerings of the `"mxfp8"`, `"nvfp4"` and `"blockwise"` recipes. Each operand of each
GEMM (the forward one and both backward ones) is quantised with `quantize_blocks` along that
GEMM's contraction axis. Native: cuDNN block-scaled GEMMs (MXFP8, NVFP4 on Blackwell) or
fp8 GEMMs promoted per 128-wide K block (blockwise: a Pallas kernel, Hopper and later).
Emulated (the reference, any device): the operands dequantised to the compute dtype and
multiplied with float32 accumulation. The numbers are those of a native block-scaled GEMM
(block scales are exact factors of the products); the speed is that of the compute dtype
plus the quantisation, so `fp8_ops` labels these GEMMs "emulated".

Per GEMM, as the recipes prescribe:
- forward `x . w`: `x` as an activation (1-D blocks along K), `w` as a weight (2-D blocks
  for NVFP4 and blockwise when `w` is a 2-D kernel; 1-D along K otherwise);
- input gradient `g . w^T`: `g` as a gradient along N; `w` as a weight along N (a 2-D block
  grid is the same in both orientations, as DeepSeek-V3 relies on);
- weight gradient `x^T . g`: both re-quantised along the token axes (1-D blocks along the
  innermost contracted axis); for NVFP4 both first pass through a 16x16 random Hadamard
  transform along that axis, and `g`'s elements are rounded stochastically, with a key drawn
  from the gradient's own bits (deterministic for a given gradient).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mpjax._src.core.calibration import gpu_class_of_capability, native_measured_faster
from mpjax._src.core.sharding import match_varying
from mpjax._src.fp8.blocks import (
    BLOCK_SCALINGS,
    BlockQuantized,
    dequantize_blocks,
)
from mpjax._src.fp8.orientations import quantize_orientations
from mpjax._src.fp8.oriented import OrientedBlocks
from mpjax._src.fp8.recipe import Fp8Recipe
from mpjax._src.kernels.blockwise_gemm import blockwise_fp8_gemm

__all__ = [
    "block_scaled_dot_general",
    "gradient_seed",
    "native_block_gemms",
    "quantize_weight",
]

_F32 = jnp.float32


def gradient_seed(g: jax.Array) -> jax.Array:
    """The uint32 seed of a gradient's stochastic rounding, from the bits of its sum (no key
    to thread; deterministic for a given gradient)."""
    bits = lax.bitcast_convert_type(jnp.sum(g.astype(_F32)), jnp.uint32)
    return bits ^ jnp.uint32(0x5EED)


# CUDA compute capability by device kind, for a target with no device to ask (a deviceless
# topology's devices); the first name contained in the kind wins.
_KIND_CAPABILITY = (
    ("GB200", 10.0), ("B200", 10.0), ("B100", 10.0), ("GB300", 10.3), ("B300", 10.3),
    ("GH200", 9.0), ("H200", 9.0), ("H100", 9.0), ("H800", 9.0), ("H20", 9.0),
    ("L40", 8.9), ("L4", 8.9), ("RTX 40", 8.9), ("A100", 8.0), ("A10", 8.6),
)  # fmt: skip


def _traced_device(operands: tuple) -> Any:
    """The abstract device (`platform`, `device_kind`) the operands are traced for, from
    their sharding's mesh or the mesh in context (`jax.set_mesh`); None when neither says."""
    from jax._src import mesh as mesh_lib  # get_abstract_mesh: public in jax.sharding >= 0.11

    meshes = [getattr(getattr(_aval(x), "sharding", None), "mesh", None) for x in operands]
    meshes.append(mesh_lib.get_abstract_mesh())
    for mesh in meshes:
        device = getattr(mesh, "abstract_device", None)
        if device is not None and getattr(device, "platform", None):
            return device
    return None


def _aval(x: Any) -> Any:
    return x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)


def target_capability(*operands: Any) -> float:
    """The CUDA compute capability of the GPU that `operands` are traced for (0 off CUDA).

    The target is read from the operands' sharding (`NamedSharding` arguments, also of a
    deviceless topology compiled ahead of time) or the mesh set with `jax.set_mesh`, else
    it is JAX's default device.
    """
    device = _traced_device(operands)
    if device is None:
        return _capability(jax.devices()[0])
    if device.platform not in ("cuda", "gpu"):
        return 0.0
    kind = str(device.device_kind).upper()
    for name, capability in _KIND_CAPABILITY:
        if name in kind:
            return capability
    gpus = [d for d in jax.devices() if d.device_kind == device.device_kind]
    return _capability(gpus[0]) if gpus else 0.0


def _capability(device: Any) -> float:
    """A device's CUDA compute capability (0 for a device without one, e.g. a CPU)."""
    return float(getattr(device, "compute_capability", 0) or 0)


def native_block_gemms(recipe: Fp8Recipe, *operands: Any) -> bool:
    """Whether `recipe`'s GEMMs lower to native block-scaled GEMMs (else emulated).

    `recipe.block_lowering="native"` asks for them: for MXFP8 and NVFP4 cuDNN block-scaled
    GEMMs through `jax.nn.scaled_matmul` (Blackwell), for blockwise fp8 tensor-core GEMMs
    promoted per 128-wide K block (`mpjax._src.kernels.blockwise_gemm`: the Pallas Mosaic
    GPU kernel on Hopper where this JAX has its API, else the Pallas Triton kernel);
    `"emulated"` asks for the dequantised form; `"auto"` picks native when the GPU the GEMM
    is traced for (`target_capability(*operands)`: the operands' sharding, the mesh in
    context, else JAX's default device) has compute capability 10 or above (MXFP8, NVFP4:
    cuDNN's library GEMMs), and, for blockwise (mpjax's own kernel), only where the
    calibration table (`mpjax._src.core.calibration`) holds a measurement on that GPU's class
    saying the native step is faster than the emulated one (`native_measured_faster`). On
    Hopper the one measurement (an H200, 2026-11-28: the wide LM's step 2.09x the bf16 step
    with the Triton kernel) says it is not: auto runs blockwise emulated there (dequantised
    operands into XLA's bf16 GEMMs) until the Mosaic GPU kernel is measured faster.

    Args:
      recipe: a block-scaled `Fp8Recipe`.
      *operands: the GEMM's operands (arrays, tracers or avals), for their target.

    Returns:
      True for native GEMMs.

    Example:
      >>> import mpjax
      >>> from mpjax.fp8 import native_block_gemms
      >>> native_block_gemms(mpjax.Fp8Recipe("mxfp8"))  # on a CPU
      False
    """
    mode = getattr(recipe, "block_lowering", "auto")
    if mode != "auto":
        return mode == "native"
    capability = target_capability(*operands)
    if recipe.scaling == "blockwise":  # mpjax's own kernel: native only where measured faster
        return native_measured_faster("blockwise", gpu_class_of_capability(capability))
    return capability >= 10


def _gpu_lowering_possible() -> bool:
    """Whether this process can lower for a GPU: a GPU backend, or a CUDA plugin installed
    (a deviceless compile for a GPU topology from a host without one)."""
    if jax.default_backend() == "gpu":
        return True
    plugins = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    try:
        return any(importlib.util.find_spec(name) is not None for name in plugins)
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def _check_native(recipe: Fp8Recipe) -> None:
    """Refuses `block_lowering="native"` for MXFP8 and NVFP4 where no GPU can run them."""
    if recipe.block_lowering != "native" or recipe.scaling == "blockwise":
        return
    if not _gpu_lowering_possible():
        raise ValueError(
            f"block_scaled_dot_general: Fp8Recipe(scaling={recipe.scaling!r}, "
            f"block_lowering='native') needs a GPU (cuDNN block-scaled GEMMs through "
            f"jax.nn.scaled_matmul, compute capability 10 or above); the default backend is "
            f"{jax.default_backend()!r}. Use block_lowering='emulated' (the format's numbers "
            "on any device) or 'auto' (native where it can run)"
        )


def _as_rows(x: jax.Array, contract: tuple[int, ...]) -> jax.Array:
    """`x` as a 2-D `[free, contracted]` array (both flattened in axis order)."""
    free = [i for i in range(x.ndim) if i not in contract]
    x = jnp.transpose(x, free + list(contract))
    k = int(np.prod([x.shape[x.ndim - len(contract) + i] for i in range(len(contract))]))
    return x.reshape(-1, k)


def _contracted_rows(x: jax.Array, contract: tuple[int, ...]) -> jax.Array:
    """`x` as a 2-D `[contracted, free]` array, the contracted axes flattened in `contract`'s
    order (the order the forward product pairs them in)."""
    free = [i for i in range(x.ndim) if i not in contract]
    k = int(np.prod([x.shape[i] for i in contract]))
    return jnp.transpose(x, list(contract) + free).reshape(k, -1)


def _rows_scales(bq) -> jax.Array:
    """Per-row 1-D block scales of a `[rows, K]` `BlockQuantized` (2-D blocks repeated)."""
    rows = bq.data.shape[0]
    return jnp.repeat(bq.scales, bq.block[0], axis=0)[:rows]


def _gemm(recipe, qa: BlockQuantized, qb: BlockQuantized, native, compute):
    """`a @ b.T` for 2-D `[M, K]`, `[N, K]` operands, each block-quantised along K."""
    if not native:
        da, db = dequantize_blocks(qa, compute), dequantize_blocks(qb, compute)
        # out in the compute dtype (float32 accumulation on GPUs): XLA:CPU has no bf16 x bf16
        # -> f32 dot, and the result is rounded to the compute dtype anyway
        return lax.dot_general(da, db, (((1,), (1,)), ((), ())), preferred_element_type=compute)
    if recipe.scaling == "blockwise":  # fp8 GEMMs promoted per K block (Pallas, Hopper)
        # block_lowering="native" asks for the Mosaic GPU kernel (Hopper's wgmma: Triton for
        # a target known not to be a Hopper, or where this JAX lacks its API); "auto" keeps
        # the Triton kernel until a GPU measures the new one
        capability = target_capability(qa.data)
        hopper = capability == 0 or 9.0 <= capability < 10.0  # 0: not known, as deviceless
        kernel = "mosaic_gpu" if recipe.block_lowering == "native" and hopper else "triton"
        return blockwise_fp8_gemm(
            qa.data, _rows_scales(qa), qb.data, _rows_scales(qb), out_dtype=compute, kernel=kernel
        )
    k = qa.data.shape[1]
    pad = [(0, 0), (0, -k % qa.block[1])]
    # cuDNN accumulates in float32 and writes the compute dtype (one rounding, as a float32
    # result cast would give, without writing and re-reading float32); NVFP4's tensor
    # scales are divided out of the float32 result
    out = jax.nn.scaled_matmul(
        jnp.pad(qa.data, pad)[None],
        jnp.pad(qb.data, pad)[None],
        _rows_scales(qa)[None],
        _rows_scales(qb)[None],
        preferred_element_type=_F32 if qa.tensor_scale is not None else compute,
    )[0]
    if qa.tensor_scale is not None:
        out = out / qa.tensor_scale / qb.tensor_scale  # their product may overflow
    return out


def _sharding(x: jax.Array):
    """`x`'s sharding when its type is sharded over Explicit mesh axes, else None."""
    sharding = None if x is None else getattr(jax.typeof(x), "sharding", None)
    if sharding is None or sharding.mesh.empty or all(p is None for p in sharding.spec):
        return None
    return sharding


def _replicated(x: jax.Array) -> jax.Array:
    """`x` gathered whole where its type is sharded over Explicit axes (the block reshapes
    need whole rows: a correct program first, at the cost of the gather)."""
    sharding = _sharding(x)
    return x if sharding is None else jax.sharding.reshard(x, sharding.update(spec=P()))


def _like(x: jax.Array, reference: Any) -> jax.Array:
    """`x` given `reference`'s sharding (an array or a ShapeDtypeStruct), where it has one."""
    sharding = _sharding(reference)
    return x if sharding is None else jax.sharding.reshard(x, sharding)


def _plain_product(a, b, contract, compute) -> Any:
    """The type (with sharding) JAX gives `dot_general(a, b)`: the result's sharding."""
    if _sharding(a) is None and _sharding(b) is None:
        return None
    dims = (contract, ((), ()))
    return jax.eval_shape(
        lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=compute), a, b
    )


def quantize_weight(
    rhs: jax.Array,
    contract: tuple[int, ...],
    recipe: Fp8Recipe,
    impl: str,
    *,
    rows: bool = True,
    columns: bool = True,
) -> OrientedBlocks:
    """The copies of a GEMM's right operand its GEMMs read: `rhs` as `[contracted, free]`
    (gathered whole over Explicit axes), `rows` along the free axes (the input gradient's),
    `columns` along the contracted ones (the forward's); 2-D blocks for a 2-D `rhs` where
    the recipe has them (its role is `"weight"`)."""
    role = "weight" if np.ndim(rhs) == 2 else "activation"
    b_kn = _contracted_rows(_replicated(rhs), tuple(contract))
    return quantize_orientations(b_kn, recipe, role=role, rows=rows, columns=columns, impl=impl)


def _check_copies(copies: OrientedBlocks, rhs: Any, contract: tuple[int, ...]) -> None:
    """Refuses copies that are not of an operand shaped like `rhs` (contracted on `contract`)."""
    k = int(np.prod([rhs.shape[i] for i in contract]))
    n = int(np.prod(rhs.shape)) // max(k, 1)
    rows, columns = copies.rows, copies.columns
    got = tuple(None if c is None else c.data.shape for c in (rows, columns))
    if rows is None or columns is None or rows.data.shape[0] != k or columns.data.shape[0] != n:
        raise ValueError(
            f"block_scaled_dot_general: rhs_copies (rows, columns data shapes {got}) are not "
            f"the copies of an rhs {list(rhs.shape)} contracted on axes {contract}: expected "
            f"both copies, rows of {k} and columns of {n} (quantize_weight makes them)"
        )


def block_scaled_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    recipe: Fp8Recipe,
    compute_dtype: Any,
    rhs_copies: OrientedBlocks | None = None,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs)` with block-scaled operands in all three GEMMs.

    Each GEMM sees its operands as 2-D `[free, contracted]` arrays (axes flattened in
    order), quantised with `quantize_blocks` along the contracted axis; it runs as a native
    block-scaled GEMM (`jax.nn.scaled_matmul`, cuDNN on Blackwell) or emulated (dequantised
    to `compute_dtype`), as `native_block_gemms(recipe, lhs, rhs)` says. Float32 accumulation.

    Args:
      lhs: left operand (activations).
      rhs: right operand (weights).
      dimension_numbers: `dot_general` dimension numbers without batch dimensions.
      recipe: an `Fp8Recipe` with scaling `"mxfp8"`, `"nvfp4"` or `"blockwise"`.
      compute_dtype: the output's dtype (and the emulated GEMMs' operand dtype).
      rhs_copies: `rhs`'s copies made beforehand (`quantize_weight(rhs, rc, recipe, impl)`,
        as `mpjax.fp8.weight_copies` makes them once per step): both GEMMs that read `rhs`
        take them and `rhs` is not quantised here; its gradient still flows to `rhs`.

    Returns:
      The product in `compute_dtype`. An operand with a zero-length axis gives the exact
      product (zeros where `K` is 0, an empty array where `M` or `N` is) and exact gradients
      (zeros where the other operand is empty), as `lax.dot_general` does.

    Example:
      >>> import jax.numpy as jnp
      >>> from mpjax import Fp8Recipe
      >>> from mpjax.fp8 import block_scaled_dot_general
      >>> x, w = jnp.ones((64, 128)), jnp.ones((128, 64))
      >>> dims = (((1,), (0,)), ((), ()))
      >>> out = block_scaled_dot_general(x, w, dims, Fp8Recipe("mxfp8"), jnp.bfloat16)
      >>> out.dtype, float(out[0, 0])
      (dtype(bfloat16), 128.0)
    """
    if recipe.scaling not in BLOCK_SCALINGS:
        raise ValueError(
            f"block_scaled_dot_general: scaling={recipe.scaling!r}; expected one of "
            f"{BLOCK_SCALINGS}"
        )
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb or not lc:
        raise ValueError(
            "block_scaled_dot_general: needs contracting axes and no batch axes, got "
            f"dimension_numbers={dimension_numbers!r} (batched products stay in the compute "
            "dtype: see fp8_eligible)"
        )
    lc, rc = tuple(lc), tuple(rc)
    compute = np.dtype(compute_dtype)
    if rhs_copies is not None:
        _check_copies(rhs_copies, rhs, rc)
    _check_native(recipe)
    lhs, rhs = match_varying(lhs, rhs)  # under shard_map(check_vma=True)
    if 0 in lhs.shape or 0 in rhs.shape:
        # an empty product: its value (zeros for K=0, or no elements) and gradients (zeros
        # where the other side is empty) are exact in any precision; there are no blocks
        dims = ((lc, rc), ((), ()))
        return lax.dot_general(lhs.astype(compute), rhs.astype(compute), dims)
    native = native_block_gemms(recipe, lhs, rhs)
    impl = "auto" if native else "xla"  # native: the fused quantiser kernel on CUDA GPUs
    nvfp4 = recipe.scaling == "nvfp4"
    a_shape, a_dtype, a_sharding = lhs.shape, lhs.dtype, _sharding(lhs)
    b_shape, b_dtype, b_sharding = rhs.shape, rhs.dtype, _sharding(rhs)

    def forward(a_in, b_in, copies):
        a = _replicated(a_in)
        # each operand quantised once, in both orientations its GEMMs read: the columns copy
        # of `a` ([K, M] along the tokens) is the weight gradient's, kept for the backward in
        # place of `a`; the rows copy of `b` ([K, N] along N) is the input gradient's
        qa = quantize_orientations(
            _as_rows(a, lc), recipe, columns=a_sharding is None, column_hadamard=nvfp4, impl=impl
        )
        if copies is None:
            qb = quantize_weight(b_in, rc, recipe, impl)
            # emulated: the weight's stored bits dequantised, as from copies made elsewhere
            # (`rhs_copies`); XLA simplifies a quantisation and its dequantisation in one
            # program differently (an ulp, which NVFP4's seeded rounding makes a new draw)
            qb = qb if native else lax.optimization_barrier(qb)
        else:
            qb = copies
        out = _gemm(recipe, qa.rows, qb.columns, native, compute)
        a_free = [a.shape[i] for i in range(a.ndim) if i not in lc]
        b_free = [b_shape[i] for i in range(len(b_shape)) if i not in rc]
        out = out.reshape(a_free + b_free).astype(compute)
        # over Explicit axes the operands are kept as they came (sharded): copies are whole
        kept_a = a_in if a_sharding is not None else qa.columns
        kept_b = b_in if _sharding(b_in) is not None and copies is None else qb.rows
        return _like(out, _plain_product(a_in, b_in, (lc, rc), compute)), (kept_a, kept_b)

    def backward(saved, g):
        kept_a, kept_b = saved
        if not isinstance(kept_a, BlockQuantized):
            a_mk = _as_rows(_replicated(kept_a), lc)
            kept_a = quantize_orientations(
                a_mk, recipe, rows=False, column_hadamard=nvfp4, impl=impl
            ).columns
        if not isinstance(kept_b, BlockQuantized):
            kept_b = quantize_weight(kept_b, rc, recipe, impl, columns=False).rows
        g = _replicated(g)
        na = len(a_shape) - len(lc)
        g_rows = g.reshape(int(np.prod(g.shape[:na])), -1)  # [M, N]
        # g once: rows along N (input gradient), columns along the tokens (weight gradient;
        # NVFP4: Hadamard-rotated along the tokens, rounded stochastically)
        qg = quantize_orientations(
            g_rows,
            recipe,
            role="gradient",
            column_hadamard=nvfp4,
            column_seed=gradient_seed(g) if nvfp4 else None,
            impl=impl,
        )
        # input gradient: g [M, N] . (w as [K, N])^T, both along N
        da = _gemm(recipe, qg.rows, kept_b, native, compute)  # [M, K]
        a_free = [i for i in range(len(a_shape)) if i not in lc]
        da = da.reshape([a_shape[i] for i in a_free] + [a_shape[i] for i in lc])
        da = jnp.transpose(da, np.argsort(a_free + list(lc)))
        # weight gradient: (a as [K, M]) . (g as [N, M])^T along the tokens -> [K, N], the
        # weight's contracted-first layout (no transpose for a [K, N] kernel)
        db = _gemm(recipe, kept_a, qg.columns, native, compute)
        b_free = [i for i in range(len(b_shape)) if i not in rc]
        db = db.reshape([b_shape[i] for i in rc] + [b_shape[i] for i in b_free])
        db = jnp.transpose(db, np.argsort(list(rc) + b_free))
        da = da.astype(a_dtype)
        da = da if a_sharding is None else jax.sharding.reshard(da, a_sharding)
        db = db.astype(b_dtype)
        db = db if b_sharding is None else jax.sharding.reshard(db, b_sharding)
        return da, db, None  # the copies get no gradient

    op = jax.custom_vjp(lambda a, b, copies: forward(a, b, copies)[0])
    op.defvjp(forward, backward)
    return op(lhs, rhs, rhs_copies)
