"""`linear_cross_entropy`: a float32 cross-entropy loss that never holds the float32 logits.

The mixed-precision recipe computes the logits GEMM in the compute dtype and the softmax and
loss in float32: written directly, that is a float32 `[tokens, vocab]` array (and its
gradient), the largest temporary of a language model's step. Here the vocabulary is
processed a tile of columns at a time in a `lax.scan` (Apple's Cut Cross-Entropy): each
tile's logits GEMM runs in the compute dtype with a float32 result, an online logsumexp
(running maximum and sum) and the label's logit accumulate in float32 per token; the
backward pass (a `custom_vjp`) recomputes each tile's logits, forms the float32 softmax
gradient, casts it to the compute dtype for the two backward GEMMs, accumulates the
tokens' gradient in float32 and writes each tile's kernel gradient once. Only one tile's
`[tokens, tile]` logits are live at a time; the kernel and its gradient are read and
written once per pass, whatever the tile (a loop over chunks of tokens would read the
whole kernel and a float32 kernel-gradient accumulator once per chunk).

The tokens stay in their order and sharding: a batch split over devices is processed by
each device on its own tokens. A kernel split over devices (FSDP) is gathered once, before
the loop (on any mesh: Explicit or Auto axes, inside `shard_map` over some of them), and
each tile's kernel gradient is summed over the devices' tokens in the backward loop.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpjax._src.core.policy import as_policy_dtype

__all__ = ["linear_cross_entropy"]

_F32 = jnp.float32
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # what dtype=None picks


def _check(x, kernel, labels, chunk_size, ignore_index, z_loss, dtype) -> Any:
    name = "linear_cross_entropy"
    for arg, v in (("x", x), ("kernel", kernel)):
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            got = getattr(v, "dtype", type(v).__name__)
            raise TypeError(f"{name}: {arg} must be a floating array, got {got}")
    if kernel.ndim != 2:
        raise ValueError(
            f"{name}: kernel must be [d, vocab], got shape {kernel.shape} (for a tied "
            "embedding table [vocab, d], pass its transpose `embedding.T`)"
        )
    if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"{name}: x must be [..., d] with d == kernel.shape[0] == {kernel.shape[0]}, "
            f"got x.shape={x.shape}"
        )
    if 0 in kernel.shape:
        raise ValueError(
            f"{name}: kernel must be [d, vocab] with d >= 1 and vocab >= 1, got shape "
            f"{kernel.shape} (a loss over {kernel.shape[1]} classes of {kernel.shape[0]} "
            "features is undefined)"
        )
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        got = getattr(labels, "dtype", type(labels).__name__)
        raise TypeError(f"{name}: labels must be an integer array, got {got}")
    if labels.shape != x.shape[:-1]:
        raise ValueError(
            f"{name}: labels must have x's leading shape {x.shape[:-1]}, got {labels.shape}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(f"{name}: chunk_size must be an int, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int | np.integer)
    ):
        raise TypeError(f"{name}: ignore_index must be an int or None, got {ignore_index!r}")
    if isinstance(z_loss, bool) or not isinstance(z_loss, int | float | np.floating):
        raise TypeError(f"{name}: z_loss must be a Python float, got {z_loss!r}")
    if not np.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"{name}: z_loss must be a finite float >= 0, got {z_loss}")
    return _compute_dtype(x.dtype, kernel.dtype, dtype)


def _compute_dtype(x_dtype, kernel_dtype, dtype) -> np.dtype:
    """`dtype` (a dtype or a policy alias such as "bf16"), or with None the 16-bit one of
    `x`'s and `kernel`'s dtypes; raises where None would silently mean float32 GEMMs."""
    if dtype is not None:
        return as_policy_dtype(dtype, "linear_cross_entropy: dtype")
    half = {jnp.dtype(d) for d in (x_dtype, kernel_dtype)} & set(_HALF)
    if len(half) == 1:
        return half.pop()
    raise ValueError(
        f"linear_cross_entropy: dtype=None with x {jnp.dtype(x_dtype).name} and kernel "
        f"{jnp.dtype(kernel_dtype).name} names no compute dtype (None takes the 16-bit one "
        "of the two). Pass dtype= the compute dtype, e.g. dtype=policy.compute_dtype: "
        "apply_policy with output=float32 returns float32 hidden states, a float32 param "
        "kernel and autocast (which traces in float32) would run the head's GEMMs in "
        "float32; pass dtype=jnp.float32 if that is what you want."
    )


def _label_masks(labels, vocab: int, ignore_index: int | None):
    """(counted, out_of_range): the tokens that count (label != ignore_index) and those of
    them whose label is outside [0, vocab), compared in the labels' own dtype (a bound it
    cannot hold is never equal, or always above)."""
    info = jnp.iinfo(labels.dtype)
    in_range = labels >= 0
    if vocab <= info.max:
        in_range = in_range & (labels < vocab)
    counted = jnp.ones_like(in_range)
    if ignore_index is not None and info.min <= ignore_index <= info.max:
        counted = labels != ignore_index
    return counted, counted & ~in_range


def _sharded(a: jax.Array) -> bool:
    """Whether `a`'s type says it is sharded (over Explicit mesh axes)."""
    spec = getattr(getattr(jax.typeof(a), "sharding", None), "spec", ())
    return any(s is not None for s in spec)


def _replicated(a: jax.Array, ndim: int) -> jax.sharding.NamedSharding:
    """Replicated over `a`'s mesh (its type's: no `jax.set_mesh` needed), `ndim` dims."""
    mesh = jax.typeof(a).sharding.mesh
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * ndim)))


def _gathered(a: jax.Array, looped: bool = True) -> jax.Array:
    """`a` replicated over the axes of its mesh that the program partitions (FSDP gathers a
    weight once before its use). A no-op without a mesh (one device), with axes of size 1
    or all Manual (inside `shard_map`: the arrays are the device's own).

    Explicit axes are resharded; Auto axes (a `jit` of `NamedSharding` arguments, with or
    without `jax.set_mesh`) are constrained when the vocabulary runs in a loop (`looped`):
    left to the partitioner, a weight sharded along the vocabulary is cut into tiles
    sharded along the loop, and every step of the loop gathers the whole weight to slice
    its tile (XLA hoists no gather out of a loop). With one tile there is no loop and the
    partitioner's own plan stays (GPT-2 at quick size on 8 H100s: 30 % fewer collective
    bytes than gathering the weight).
    """
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        return a
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    split = [n for n in mesh.axis_names if mesh.shape[n] > 1]
    everywhere = _replicated(a, a.ndim)
    if _sharded(a):
        a = jax.sharding.reshard(a, everywhere)
    if looped and any(types[n] == jax.sharding.AxisType.Auto for n in split):
        a = _replicate_forward(a, everywhere)
    return a


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _replicate_forward(a: jax.Array, everywhere: jax.sharding.NamedSharding) -> jax.Array:
    """`a` constrained to `everywhere`, its cotangent left free: a constraint's transpose
    would replicate the weight's gradient too (the whole gradient held on every device);
    free, it takes the weight's sharding, each tile's gradient kept by the device that
    holds the tile."""
    return lax.with_sharding_constraint(a, everywhere)


_replicate_forward.defvjp(lambda a, s: (_replicate_forward(a, s), None), lambda s, _, g: (g,))


def _varying_alike(*arrays: jax.Array) -> tuple:
    """The arrays cast to vary over the same Manual axes (inside `shard_map`, the axes the
    tokens vary over): a `custom_vjp`'s gradient has its input's type, and the gradient of
    a kernel replicated over the tokens' axes is then summed over them (the cast's
    transpose). A no-op outside `shard_map`."""
    vma = [jax.typeof(a).mat.varying for a in arrays]
    every = frozenset().union(*vma)
    return tuple(
        jax.lax.pcast(a, tuple(sorted(every - v)), to="varying") if every - v else a
        for a, v in zip(arrays, vma, strict=True)
    )


_TOKEN_LOGITS = (((1,), (0,)), ((), ()))  # [N, d] @ [d, t]
_TOKEN_DX = (((1,), (1,)), ((), ()))  # [N, t] @ [d, t]^T
_TILE_DK = (((0,), (0,)), ((), ()))  # [N, d]^T @ [N, t]


def _make(z_loss: float):
    """The loss as a `custom_vjp` of (x [N, d], kernel tiles [T, d, t], bias tiles [T, t]
    float32 (-inf past the vocabulary), labels [N], valid [N], bad [N]: valid with a label
    outside the vocabulary, NaN loss and gradient), looping over vocabulary
    tiles with an online logsumexp; x and kernel in the compute dtype."""

    def tile_logits(x, k, b):
        return lax.dot_general(x, k, _TOKEN_LOGITS, preferred_element_type=_F32) + b[None, :]

    def tile_hits(labels, off, width):
        vocab = lax.broadcasted_iota(jnp.int32, (labels.shape[0], width), 1) + off
        return vocab == labels[:, None]

    def forward(x, kt, bt, labels, valid, bad):
        width = kt.shape[2]
        offsets = jnp.arange(kt.shape[0], dtype=jnp.int32) * width

        def body(carry, tile):
            m, s, hit = carry
            k, b, off = tile
            logits = tile_logits(x, k, b)
            m2 = jnp.maximum(m, jnp.max(logits, axis=1))
            # a running maximum still -inf (every logit so far -inf) shifts by 0, not by
            # -inf: exp(-inf - -inf) would be NaN where the sum is exactly 0
            shift = jnp.where(jnp.isneginf(m2), 0.0, m2)
            s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(logits - shift[:, None]), axis=1)
            hit = hit + jnp.sum(jnp.where(tile_hits(labels, off, width), logits, 0.0), axis=1)
            return (m2, s, hit), None

        zero = jnp.zeros_like(x[:, 0], dtype=_F32)  # per token, sharded like the tokens
        init = (zero - jnp.inf, zero, zero)
        (m, s, hit), _ = lax.scan(body, init, (kt, bt, offsets))
        lse = m + jnp.log(s)
        per_token = jnp.where(bad, jnp.nan, lse - hit + z_loss * lse * lse)
        return jnp.sum(jnp.where(valid, per_token, 0.0)), lse

    @jax.custom_vjp
    def tiled(x, kt, bt, labels, valid, bad):
        return forward(x, kt, bt, labels, valid, bad)[0]

    def fwd(x, kt, bt, labels, valid, bad):
        total, lse = forward(x, kt, bt, labels, valid, bad)
        return total, (x, kt, bt, labels, valid, bad, lse)

    def bwd(res, g):
        x, kt, bt, labels, valid, bad, lse = res
        width = kt.shape[2]
        offsets = jnp.arange(kt.shape[0], dtype=jnp.int32) * width
        coef = jnp.where(valid, g.astype(_F32), 0.0)[:, None]
        # a label outside [0, vocab) has no gradient: NaN, never a plausible number
        grow = jnp.where(bad, jnp.nan, coef[:, 0] * (1.0 + 2.0 * z_loss * lse))[:, None]

        def body(dx, tile):
            k, b, off = tile
            p = jnp.exp(tile_logits(x, k, b) - lse[:, None])
            dlogits = grow * p - jnp.where(tile_hits(labels, off, width), coef, 0.0)
            # an ignored token adds nothing, even where its logits are all -inf (p NaN)
            dlogits = jnp.where(valid[:, None], dlogits, 0.0)
            db = jnp.sum(dlogits, axis=0)
            dlogits = dlogits.astype(x.dtype)
            dx = dx + lax.dot_general(dlogits, k, _TOKEN_DX, preferred_element_type=_F32)
            dk = lax.dot_general(
                x,
                dlogits,
                _TILE_DK,
                preferred_element_type=_F32,
                # tokens over Explicit axes: each device's sum is all-reduced
                out_sharding=_replicated(x, 2) if _sharded(x) else None,
            )
            return dx, (dk.astype(kt.dtype), db)

        dx, (dk, db) = lax.scan(body, jnp.zeros_like(x, dtype=_F32), (kt, bt, offsets))
        return dx.astype(x.dtype), dk, db, None, None, None

    tiled.defvjp(fwd, bwd)
    return tiled


def linear_cross_entropy(
    x: jax.Array,
    kernel: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    chunk_size: int = 1024,
    ignore_index: int | None = None,
    z_loss: float = 0.0,
    dtype: Any = None,
) -> jax.Array:
    """The mean float32 cross-entropy of `x @ kernel` against `labels`, without the logits.

    Equals `optax.softmax_cross_entropy_with_integer_labels(
    (x @ kernel).astype(float32), labels)` averaged over the non-ignored tokens (plus
    `z_loss * mean(logsumexp(logits) ** 2)`, PaLM's auxiliary loss; logits plus `bias`
    when given), value and gradients,
    but processes the vocabulary a tile at a time: the logits GEMM runs in the compute dtype
    with a float32 result, the log-softmax and loss in float32, and the backward pass
    recomputes each tile's logits, so no `[tokens, vocab]` array is ever held. The
    gradients of `x` and `kernel` are accumulated in float32 and rounded to the compute
    dtype (as the GEMMs of the unfused loss give them), then cast to their own dtypes.

    Pass `dtype=policy.compute_dtype` so the GEMMs run in the compute dtype: `apply_policy`
    with `output=float32` returns float32 hidden states, a param kernel is float32, and
    `mpjax.autocast` traces in float32 (and keeps a `custom_vjp` as traced). `dtype=None`
    takes the 16-bit one of `x`'s and `kernel`'s dtypes and raises when there is none,
    rather than run the largest GEMM of a language model in float32 unasked.

    A counted token whose label is outside `[0, vocab)` has a NaN loss (the mean is NaN,
    as with optax) and NaN gradients, whatever `chunk_size`; so has one whose logits are
    all -inf (as with optax). -inf logits elsewhere (a -inf bias) are exact.

    Args:
      x: `[..., d]` floating: the final hidden states.
      kernel: `[d, vocab]` floating: the output projection (for a tied embedding table
        `[vocab, d]`, its transpose `embedding.T`).
      labels: integer `[...]` (x's leading shape, any integer dtype): the target class of
        each token, in `[0, vocab)` (or `ignore_index`); any other label gives NaN.
      bias: None, or the head's `[vocab]` bias (a Flax `Dense` head's), added to the
        logits in float32; its gradient is accumulated in float32.
      chunk_size: the size of each step's float32 logits, in tokens of the whole
        vocabulary: the loop takes vocabulary tiles of `ceil(chunk_size * vocab / tokens)`
        columns, so each step holds `[tokens, tile]` logits, about `chunk_size * vocab`
        elements (of the global batch: with `x` sharded over `n` devices, each holds
        1/n of them). Smaller is leaner, at more steps over the tokens.
      ignore_index: tokens whose label equals it contribute neither loss nor gradient, and
        are not counted in the mean (None: every token counts).
      z_loss: the weight of `mean(logsumexp(logits) ** 2)` added to the loss (0 disables
        it; PaLM used 1e-4).
      dtype: the compute dtype of the GEMMs (a dtype or a policy name such as "bf16");
        None (default) is the 16-bit one of `x`'s and `kernel`'s dtypes (bfloat16 for
        bfloat16 activations and a float32 kernel), an error when both are float32 or
        they are two different 16-bit dtypes.

    Returns:
      A float32 scalar: the mean loss over the non-ignored tokens (0 when there are none,
        an empty batch included).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mpjax.nn import linear_cross_entropy
      >>> x = jax.random.normal(jax.random.key(0), (2, 5, 8), jnp.bfloat16)
      >>> kernel = jax.random.normal(jax.random.key(1), (8, 11), jnp.bfloat16)
      >>> labels = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, -1]])
      >>> loss = linear_cross_entropy(x, kernel, labels, chunk_size=4, ignore_index=-1)
      >>> loss.dtype, loss.shape
      (dtype('float32'), ())
    """
    dtype = _check(x, kernel, labels, chunk_size, ignore_index, z_loss, dtype)
    vocab = kernel.shape[1]
    if bias is not None and (
        not hasattr(bias, "dtype")
        or not jnp.issubdtype(bias.dtype, jnp.floating)
        or bias.shape != (vocab,)
    ):
        got = f"{getattr(bias, 'dtype', type(bias).__name__)}{getattr(bias, 'shape', '')}"
        raise ValueError(
            f"linear_cross_entropy: bias must be None or a floating [vocab] = [{vocab}] "
            f"array, got {got}"
        )
    d = x.shape[-1]
    tokens = int(np.prod(x.shape[:-1], dtype=np.int64))
    flat_x = x.reshape(tokens, d).astype(dtype)
    valid, bad = _label_masks(labels.reshape(tokens), vocab, ignore_index)
    flat_labels = jnp.where(bad, -1, labels.reshape(tokens).astype(jnp.int32))
    # vocabulary tiles of `width` columns: [tokens, width] logits per step, as many
    # elements as `chunk_size` tokens of the whole vocabulary
    width = min(vocab, max(1, -(-chunk_size * vocab // max(tokens, 1))))
    tiles = -(-vocab // width)
    pad = tiles * width - vocab
    # Cast outside the custom_vjp: the gradients leave it in the compute dtype (as a GEMM's
    # would), so a sharded kernel's gradient is reduced across devices in that dtype.
    k = _gathered(kernel.astype(dtype), looped=tiles > 1)
    b32 = jnp.zeros((vocab,), _F32)
    if bias is not None:
        b32 = _gathered(bias.astype(_F32), looped=tiles > 1)
    k = jnp.pad(k, ((0, 0), (0, pad))).reshape(d, tiles, width).transpose(1, 0, 2)
    b32 = jnp.pad(b32, (0, pad), constant_values=-jnp.inf).reshape(tiles, width)
    args = _varying_alike(flat_x, k, b32, flat_labels, valid, bad)
    total = _make(float(z_loss))(*args)
    count = jnp.sum(valid, dtype=jnp.int32)
    return total / jnp.maximum(count, 1).astype(_F32)
