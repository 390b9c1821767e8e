"""The fused block quantiser: one read of `x` `[M, K]` writes both orientations and scales.

Transformer Engine's `quantize_mxfp8.cuh` in Pallas (Triton backend: H100, B200). Each program
loads one tile of `x` (bfloat16 or float32) once and writes, for `quantize_orientations`:

- the rows copy (blocks along `K`) and its scales;
- the columns copy (blocks along `M`), transposed in the kernel to `[K, M]`, and its scales;
  for NVFP4 optionally the 16x16 random Hadamard rotation along `M` first (inside the tile:
  a run of 16 rows is one tile's height) and stochastic rounding with the counter hash
  `hash_uniform(seed, k * M + m)`.

No float32 intermediate goes to HBM. Triton has no fp4 or E8M0 type: the kernel writes uint8
(`float8_e4m3fn` bits, E8M0 exponent bits, fp4 codes packed two per byte, the lower `K`/`M`
index in the low nibble) and XLA bitcasts them to the formats afterwards.

NVFP4's tensor scales (one for the rows copy, one for the columns copy: the Hadamard-rotated
copy has another amax) come from a separate XLA reduction over `x` passed into the kernel:
NVFP4 reads `x` twice (the amax pass and the kernel), MXFP8 and blockwise once.

Tiles: MXFP8 `128 x 32` (four 32-row blocks by one 32-wide block), blockwise `128 x 128`,
NVFP4 `16 x 16` loaded as 32 strided pieces of one row's even or odd elements (the pieces
give the Hadamard rotation's fixed summation order and the fp4 pairs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mpjax._src.fp8.block_codes import blockwise_tile, mxfp8_tile, nvfp4_tile
from mpjax._src.fp8.blocks import (
    BlockQuantized,
    _magnitude,
    block_shape,
    hash_uniform,
    nvfp4_tensor_scale,
)
from mpjax._src.fp8.hadamard import hadamard_runs, hadamard_signs
from mpjax._src.fp8.oriented import OrientedBlocks
from mpjax._src.kernels.common import MAX_ELEMENTS

__all__ = ["KERNEL_NAME", "quantize_orientations_kernel", "unsupported"]

KERNEL_NAME = "mpjax_block_quantize"
_F32 = jnp.float32
_U8 = jnp.uint8
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
_MXFP8_ROW_BLOCKS = 4  # 32-row blocks per MXFP8 program


def unsupported(x, scaling: str, role: str, rows: bool, columns: bool, hadamard: bool):
    """Why the kernel cannot quantise `x` this way (the reference then does), or None.

    Stochastic rounding (a `column_seed`) is supported: its codes come from seven compares
    (`block_codes.stochastic_e2m1_code`), which compile for the GPU as fast as nearest
    rounding.
    """
    m, k = x.shape
    if np.dtype(x.dtype) not in _DTYPES:
        return f"x is {x.dtype} (the kernel reads bfloat16 or float32)"
    if x.size == 0 or x.size >= MAX_ELEMENTS:
        return f"x has {x.size} elements (int32 offsets, non-empty)"
    if hadamard and scaling != "nvfp4":
        return f"column_hadamard with {scaling} (the kernel rotates NVFP4's columns copy)"
    if scaling == "nvfp4":
        two_d = block_shape(scaling, 2, 1, role)[0] > 1
        if (rows or (columns and two_d and not hadamard)) and k % 2:
            return f"K={k} is odd (fp4 packs pairs along K)"
        if columns and not hadamard and m % 2:
            return f"M={m} is odd (the columns copy packs fp4 pairs along M)"
    return None


def _iota(rows: int, cols: int, axis: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (rows, cols), axis)


def _at(rows, cols) -> tuple[jax.Array, jax.Array]:
    """Element indices `(rows, cols)` of a tile ref, broadcast to one shape (a strided
    `pl.ds` has no interpret-mode rule; index arrays lower to the same Triton pointers)."""
    rows, cols = jnp.broadcast_arrays(jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32))
    return rows, cols


def _signs(signs: np.ndarray, pr: int, r: int) -> jax.Array:
    """Column `r` of `signs` (`hadamard_signs()`) at rows `pr::2`, as float32 `[8, 1]`, from
    iotas (a kernel captures no array constants): Sylvester's sign `(-1)**popcount(s & r)`
    times the random sign of `r`."""
    v = (pr + 2 * _iota(8, 1, 0)) & r
    odd = (v ^ (v >> 1) ^ (v >> 2) ^ (v >> 3)) & 1
    flip = float(signs[0, r])  # row 0 of H16 is all ones: the random sign of r
    return jnp.where(odd == 1, _F32(-flip), _F32(flip))


def _store(ref, value, mask):
    pltriton.store(ref, value.astype(ref.dtype), mask=mask)


def _dense_kernel(x_ref, *outs, scaling, sb, n, two_d, make_rows, columns, shape, p2, interpret):
    """MXFP8 / blockwise: `n` blocks of `sb x sb`, each loaded once and quantised both ways."""
    i, j = pl.program_id(0), pl.program_id(1)
    it = iter(outs)
    rd, rs = (next(it), next(it)) if make_rows else (None, None)
    cd = next(it) if columns else None
    cs = next(it) if columns and not two_d else None

    def quant(xf, amax):
        if scaling == "mxfp8":
            return mxfp8_tile(xf, amax)
        return blockwise_tile(xf, amax, power_of_two=p2, interpret=interpret)

    for g in range(n):
        row = (i * n + g) * sb + lax.broadcasted_iota(jnp.int32, (sb, 1), 0)
        col = j * sb + lax.broadcasted_iota(jnp.int32, (1, sb), 1)
        row_ok, col_ok = row < shape[0], col < shape[1]
        mask = row_ok & col_ok
        part = pl.ds(g * sb, sb)
        x = pltriton.load(x_ref.at[part, :], mask=mask, other=0)
        xf = jnp.where(mask, x.astype(_F32), 0.0)
        a = _magnitude(xf)
        if make_rows:
            amax = jnp.max(a, axis=1, keepdims=True)
            if two_d:
                amax = jnp.max(amax, axis=0, keepdims=True)
            data, scale = quant(xf, amax)
            _store(rd.at[part, :], data, mask)
            if two_d:
                rs[...] = scale.astype(rs.dtype)
            else:
                _store(rs.at[part, :], scale, row_ok)
        if columns:
            if not two_d:
                data, scale = quant(xf, jnp.max(a, axis=0, keepdims=True))
                _store(cs.at[:, pl.ds(g, 1)], scale.T, col_ok.T)
            _store(cd.at[:, part], data.T, mask.T)


def _fp4_kernel(x_ref, ts_ref, *refs, two_d, make_rows, columns, hadamard, seeded, shape,
                m_cols, interpret):  # fmt: skip
    """NVFP4 on one 16x16 tile, held as its four 8x8 parity quadrants `q[pr][pc]` (rows
    `pr::2`, columns `pc::2`): the fp4 pairs along K and along M are then whole tensors."""
    i, j = pl.program_id(0), pl.program_id(1)
    it = iter(refs)
    seed = next(it)[pl.ds(0, 1)].reshape(1, 1) if seeded else None
    rd, rs = (next(it), next(it)) if make_rows else (None, None)
    cd = next(it) if columns else None
    cs = next(it) if columns and (hadamard or not two_d) else None
    t_rows = ts_ref[pl.ds(0, 1)].reshape(1, 1)
    t_cols = ts_ref[pl.ds(1, 1)].reshape(1, 1)
    lane = _iota(8, 8, 1)  # the tile's pair index along K (or M, transposed)
    half = _iota(8, 8, 0)

    def load(rows, cols):
        mask = (i * 16 + rows < shape[0]) & (j * 16 + cols < shape[1])
        v = pltriton.load(x_ref.at[_at(rows, cols)], mask=mask, other=0)
        return jnp.where(mask, v.astype(_F32), 0.0)

    q = [[load(pr + 2 * half, pc + 2 * lane) for pc in (0, 1)] for pr in (0, 1)]

    def absmax(v, axis):
        return jnp.max(_magnitude(v), axis=axis, keepdims=True)

    def quant(v, amax, t, uniform=None):
        return nvfp4_tile(v, amax, t, uniform, interpret=interpret)

    if make_rows:  # per row: 16 elements, the quadrants q[pr][0] and q[pr][1]
        amax = [jnp.maximum(absmax(q[pr][0], 1), absmax(q[pr][1], 1)) for pr in (0, 1)]
        if two_d:
            amax = [absmax(jnp.maximum(amax[0], amax[1]), 0)] * 2
        byte_ok = j * 8 + lane < shape[1] // 2
        for pr in (0, 1):
            low, scale = quant(q[pr][0], amax[pr], t_rows)
            high, _ = quant(q[pr][1], amax[pr], t_rows)
            row_ok = i * 16 + pr + 2 * half < shape[0]
            _store(rd.at[_at(pr + 2 * half, lane)], low | (high << 4), row_ok & byte_ok)
            if not two_d:
                ok = i * 16 + pr + 2 * _iota(8, 1, 0) < shape[0]
                _store(rs.at[_at(pr + 2 * _iota(8, 1, 0), 0)], scale, ok)
        if two_d:
            rs[...] = scale.astype(rs.dtype)
    if not columns:
        return
    if hadamard:  # c_s = (+-x_0 +- x_1 ... +- x_15) / 4 in that order (`hadamard_runs`)
        signs = hadamard_signs()
        c = [[None, None], [None, None]]
        for pc in (0, 1):
            xs = [load(jnp.full((1, 8), r, jnp.int32), pc + 2 * _iota(1, 8, 1)) for r in range(16)]
            for pr in (0, 1):
                sign = [_signs(signs, pr, r) for r in range(16)]
                acc = sign[0] * xs[0]
                for r in range(1, 16):
                    acc = acc + sign[r] * xs[r]  # = acc +- x_r exactly
                c[pr][pc] = acc * _F32(0.25)
    else:
        c = q
    t = t_cols if hadamard else t_rows
    amax = [jnp.maximum(absmax(c[0][pc], 0), absmax(c[1][pc], 0)) for pc in (0, 1)]
    if two_d:
        amax = [absmax(jnp.maximum(amax[0], amax[1]), 1)] * 2
    for pc in (0, 1):
        k = j * 16 + pc + 2 * lane  # [8 (M pairs), 8 (K)]
        codes = []
        for pr in (0, 1):
            uniform = None
            if seeded:
                m = (i * 16 + pr + 2 * half).astype(jnp.uint32)
                index = k.astype(jnp.uint32) * jnp.uint32(m_cols % 2**32) + m
                uniform = hash_uniform(seed, index)
            code, scale = quant(c[pr][pc], amax[pc], t, uniform)
            codes.append(code)
        # [8 (M pairs), 8 (K)], stored to the `[K, M / 2]` copy through transposed indices
        # (transposed in registers, the kernel took Triton 4 to 9 times longer to compile)
        byte = codes[0] | (codes[1] << 4)
        ok = (k < shape[1]) & (i * 8 + half < m_cols // 2)
        _store(cd.at[_at(pc + 2 * lane, half)], byte, ok)
        if cs is not None and not two_d:
            k_of_scale = pc + 2 * _iota(1, 8, 1)
            _store(cs.at[_at(k_of_scale, 0)], scale, j * 16 + k_of_scale < shape[1])
    if cs is not None and two_d:
        cs[...] = scale.astype(cs.dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dense_call(x, scaling, p2, two_d, make_rows, columns, interpret):
    """The pallas_call for MXFP8 and blockwise: the uint8 / float32 outputs it writes."""
    (m, k), sb = x.shape, (32 if scaling == "mxfp8" else 128)
    n = 1 if two_d or scaling == "blockwise" else _MXFP8_ROW_BLOCKS
    tm, gm, gk = n * sb, _cdiv(m, n * sb), _cdiv(k, sb)
    scale_dtype = _U8 if scaling == "mxfp8" else _F32
    shapes, specs = [], []
    if make_rows:
        shapes.append(jax.ShapeDtypeStruct((m, k), _U8))
        specs.append(pl.BlockSpec((tm, sb), lambda i, j: (i, j)))
        shapes.append(jax.ShapeDtypeStruct((gm, gk) if two_d else (m, gk), scale_dtype))
        specs.append(pl.BlockSpec((1, 1) if two_d else (tm, 1), lambda i, j: (i, j)))
    if columns:
        shapes.append(jax.ShapeDtypeStruct((k, m), _U8))
        specs.append(pl.BlockSpec((sb, tm), lambda i, j: (j, i)))
        if not two_d:
            shapes.append(jax.ShapeDtypeStruct((k, _cdiv(m, sb)), scale_dtype))
            specs.append(pl.BlockSpec((sb, n), lambda i, j: (j, i)))
    kernel = functools.partial(
        _dense_kernel, scaling=scaling, sb=sb, n=n, two_d=two_d, make_rows=make_rows,
        columns=columns, shape=(m, k), p2=p2, interpret=interpret,
    )  # fmt: skip
    return pl.pallas_call(
        kernel,
        out_shape=shapes,
        grid=(gm, gk),
        in_specs=[pl.BlockSpec((tm, sb), lambda i, j: (i, j))],
        out_specs=specs,
        compiler_params=pltriton.CompilerParams(num_warps=4),
        interpret=interpret,
        name=KERNEL_NAME,
    )(x)


def _fp4_call(x, tensor_scales, seed, two_d, make_rows, columns, hadamard, interpret):
    """The pallas_call for NVFP4: packed codes and e4m3 scale bits, as uint8."""
    m, k = x.shape
    m_cols = m + (-m % 16 if hadamard else 0)
    gm, gk = _cdiv(m_cols, 16), _cdiv(k, 16)
    whole = pl.BlockSpec(None, lambda i, j: (0,))
    shapes, specs = [], []
    if make_rows:
        shapes.append(jax.ShapeDtypeStruct((m, k // 2), _U8))
        specs.append(pl.BlockSpec((16, 8), lambda i, j: (i, j)))
        shapes.append(jax.ShapeDtypeStruct((_cdiv(m, 16), gk) if two_d else (m, gk), _U8))
        specs.append(pl.BlockSpec((1, 1) if two_d else (16, 1), lambda i, j: (i, j)))
    if columns:
        shapes.append(jax.ShapeDtypeStruct((k, m_cols // 2), _U8))
        specs.append(pl.BlockSpec((16, 8), lambda i, j: (j, i)))
        if hadamard or not two_d:
            shapes.append(jax.ShapeDtypeStruct((gk, gm) if two_d else (k, gm), _U8))
            specs.append(pl.BlockSpec((1, 1) if two_d else (16, 1), lambda i, j: (j, i)))
    kernel = functools.partial(
        _fp4_kernel, two_d=two_d, make_rows=make_rows, columns=columns, hadamard=hadamard,
        seeded=seed is not None, shape=(m, k), m_cols=m_cols, interpret=interpret,
    )  # fmt: skip
    args = [x, tensor_scales] + ([] if seed is None else [seed.reshape(1)])
    return pl.pallas_call(
        kernel,
        out_shape=shapes,
        grid=(gm, gk),
        in_specs=[pl.BlockSpec((16, 16), lambda i, j: (i, j))] + [whole] * (len(args) - 1),
        out_specs=specs,
        compiler_params=pltriton.CompilerParams(num_warps=1),
        interpret=interpret,
        name=KERNEL_NAME,
    )(*args)


def _rotated_amax(x: jax.Array) -> jax.Array:
    """`max |random_hadamard(x, 0)|` (NaN as inf): the same runs and sums, with axis 0 left
    in place (a run is 16 strided rows), so that XLA reads `x` once in one reduction; through
    `random_hadamard`'s moved axis it wrote a transposed and a rotated float32 copy of `x`.
    The max is exact: the bits are the rotated copy's amax."""
    m, k = x.shape
    runs = jnp.pad(x.astype(_F32), [(0, -m % 16), (0, 0)]).reshape(-1, 16, k)
    rotated = hadamard_runs([runs[:, r, :] for r in range(16)], hadamard_signs())
    # the runs' elementwise max, then one reduction (a stack of them was written out)
    return jnp.max(functools.reduce(jnp.maximum, [_magnitude(r) for r in rotated]))


def _flat_amax(x: jax.Array) -> jax.Array:
    """`max |x|` (NaN as inf) of `x` as 1-D: a weight's. XLA:GPU shares a broadcast constant
    of one shape between parts of a program, and with it the layout one part gives it: of a
    2-D weight, the inf of `_magnitude` with that of a gradient of the same shape in its
    XLA-reference quantisation (laid out transposed), and wrote a transposed float32 `|w|`.
    (An activation's stays 2-D: XLA fuses that amax into its producer.)"""
    return jnp.max(_magnitude(x.reshape(-1)))


def _fp4(packed: jax.Array, n: int) -> jax.Array:
    """uint8 `[R, n // 2]` of packed codes as float4_e2m1fn `[R, n]` (low nibble first)."""
    return lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).reshape(packed.shape[0], n)


def quantize_orientations_kernel(x, column_seed, *, scaling, power_of_two, role, rows, columns,
                                 column_hadamard, interpret):  # fmt: skip
    """`quantize_orientations` through the fused kernel; same outputs as its reference.

    Args:
      x: `[M, K]` bfloat16 or float32 (see `unsupported`).
      column_seed: None or a uint32 seed (NVFP4's stochastic rounding of the columns copy).
      scaling, power_of_two, role, rows, columns, column_hadamard: as `quantize_orientations`.
      interpret: run the kernel in Pallas interpret mode.

    Returns:
      An `OrientedBlocks`.
    """

    m, k = x.shape
    two_d = block_shape(scaling, 2, 1, role)[0] > 1
    row_block = block_shape(scaling, 2, 1, role)
    col_block = block_shape(scaling, 2, 0, role)[::-1]
    make_rows = rows or (columns and two_d and not column_hadamard)
    if scaling != "nvfp4":
        outs = iter(_dense_call(x, scaling, power_of_two, two_d, make_rows, columns, interpret))

        def scales_of(s):
            return lax.bitcast_convert_type(s, jnp.float8_e8m0fnu) if scaling == "mxfp8" else s

        def data_of(d, n):
            return lax.bitcast_convert_type(d, jnp.float8_e4m3fn)

        t_rows = t_cols = None
    else:
        xf = x.astype(_F32)  # a weight's amax as 1-D (`_flat_amax`); an activation's in place
        t_rows = nvfp4_tensor_scale(_flat_amax(xf) if two_d else jnp.max(_magnitude(xf)))
        t_cols = nvfp4_tensor_scale(_rotated_amax(x)) if column_hadamard else t_rows
        seed = None if column_seed is None else jnp.asarray(column_seed, jnp.uint32)
        ts = jnp.stack([t_rows, t_cols])
        outs = iter(_fp4_call(x, ts, seed, two_d, make_rows, columns, column_hadamard, interpret))

        def scales_of(s):
            return lax.bitcast_convert_type(s, jnp.float8_e4m3fn)

        data_of = _fp4
    out_rows = out_cols = None
    if make_rows:
        rd, rs = next(outs), next(outs)
        out_rows = BlockQuantized(data_of(rd, k), scales_of(rs), t_rows, block=row_block)
    if columns:
        cd = next(outs)
        n = cd.shape[1] * (2 if scaling == "nvfp4" else 1)
        if column_hadamard or not two_d:
            cs, t = scales_of(next(outs)), t_cols
        else:  # 2-D blocks: the rows copy's scales, transposed
            cs, t = out_rows.scales.T, t_rows
        out_cols = BlockQuantized(data_of(cd, n), cs, t, block=col_block)
    return OrientedBlocks(out_rows if rows else None, out_cols)
