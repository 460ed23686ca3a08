"""Triton helpers shared by every generated kernel module (``generated/<name>/triton_kernels.py``):
the groups its helpers take their constexprs in, index arithmetic, guarded loads, dots, and the block
ranges of the mask analysis. Nothing here depends on a spec; the kernels that do are emitted per spec
and import these.
"""

from typing import NamedTuple

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


# The constexpr groups. A kernel takes its constexprs one by one (the host passes them by name) and
# builds each group once, as `DIMS: tl.constexpr = Dims(B, HQ, ...)`; its helpers take the groups they
# need and read fields (`DIMS.BLOCK_N`, `MASKS.CAUSAL`), which stay compile-time constants.


class Dims(NamedTuple):
    """Sizes: batch, query and kv heads, the sequences (the longest one with varlen), the head dims of q, k
    (D) and v (DV) and the same padded to a power of two, the query and key rows of a tile."""
    B: tl.constexpr
    HQ: tl.constexpr
    HKV: tl.constexpr
    SEQ_Q: tl.constexpr
    SEQ_K: tl.constexpr
    D: tl.constexpr
    DV: tl.constexpr
    D_PAD: tl.constexpr
    DV_PAD: tl.constexpr
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr


class Masks(NamedTuple):
    """Which keys a query sees: causal, a sliding window, segment ids, a dense mask (over MASK_BATCH x MASK_HEADS,
    one entry per MASK_BQ x MASK_BK elements: 1 x 1 for an element mask, a block layout's blocks otherwise);
    RUNTIME_MASK: a mask known only at run time, so that every block takes the element mask; POSITIONS: explicit
    positions place the tokens (`_placed`), so that the analysed block ranges do not hold."""
    CAUSAL: tl.constexpr
    WINDOW: tl.constexpr
    SEGMENTS: tl.constexpr
    DENSE: tl.constexpr
    MASK_BATCH: tl.constexpr
    MASK_HEADS: tl.constexpr
    MASK_BQ: tl.constexpr
    MASK_BK: tl.constexpr
    RUNTIME_MASK: tl.constexpr
    POSITIONS: tl.constexpr


class Logits(NamedTuple):
    """What a logit is made of: a soft cap, a bias (broadcast over BIAS_BATCH, BIAS_HEADS); PLAIN: neither,
    nor a score hook, so that the softmax scale folds into the base-2 exponent."""
    SOFTCAP: tl.constexpr
    BIAS_ON: tl.constexpr
    BIAS_BATCH: tl.constexpr
    BIAS_HEADS: tl.constexpr
    PLAIN: tl.constexpr


class Schedule(NamedTuple):
    """How the loops and dots run: three key loops or one (STAGED), tensor descriptors (TMA), a warp-specialised
    forward (WS), dQ by atomics (ATOMIC_DQ) or over the dS band (BAND, BAND_BLOCKS wide, stored by descriptor
    with BAND_TMA), the dots' input precision and the interpreter's upcast (`_dot`), loops over tile lists (LISTS,
    `_tile_range`)."""
    STAGED: tl.constexpr
    TMA: tl.constexpr
    WS: tl.constexpr
    ATOMIC_DQ: tl.constexpr
    BAND: tl.constexpr
    BAND_BLOCKS: tl.constexpr
    BAND_TMA: tl.constexpr
    PRECISION: tl.constexpr
    UPCAST: tl.constexpr
    LISTS: tl.constexpr


@triton.jit
def _load(ptr, m_a, m_b, CHECK: tl.constexpr):
    """A tile load, bounds-checked only where a block can cross an edge (CHECK)."""
    if CHECK:
        return tl.load(ptr, mask=m_a & m_b, other=0.0)
    else:
        return tl.load(ptr)


@triton.jit
def _dot(a, b, SCHEDULE: tl.constexpr):
    """a @ b in float32 at SCHEDULE.PRECISION. UPCAST (CPU interpreter only) widens bf16 operands first:
    Triton 3.9's interpreter multiplies the raw bits of bf16 tiles. Exact: bf16 products fit in float32."""
    if SCHEDULE.UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=SCHEDULE.PRECISION)


@triton.jit
def _dot_acc(a, b, acc, SCHEDULE: tl.constexpr):
    """acc + a @ b, accumulated in place by the tensor cores (PRECISION, UPCAST as in `_dot`)."""
    if SCHEDULE.UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=SCHEDULE.PRECISION)


@triton.jit
def _int_div(a, b):
    """Python's ``a // b`` on ints, 0 where b == 0 (the DSL's, docs/DESIGN.md §2; also the range arithmetic's, whose
    divisors are constants): the floor whether Triton's own ``//`` truncates (compiled) or floors, the remainder's
    sign decides the correction. ``a`` and ``b`` are tensors or constants, not both constants."""
    safe = tl.where(b == 0, 1, b)
    q = a // safe
    r = a - q * safe
    q = tl.where((r != 0) & ((r < 0) != (safe < 0)), q - 1, q)
    return tl.where(b == 0, 0, q)


@triton.jit
def _int_mod(a, b):
    """The DSL's ``a % b`` on ints: ``a - (a // b) * b`` (the divisor's sign, Python's; a where b == 0)."""
    return a - _int_div(a, b) * b


@triton.jit
def _round(x):
    """The DSL's round: half to even, as Python's round and jnp.round."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _sign(x):
    """-1, 0 or 1 in x's type."""
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _ipow(x, N: tl.constexpr):
    """x ** N for a constant integer N >= 1, by repeated products: exact signs for a negative x."""
    r = x
    for _ in tl.static_range(N - 1):
        r = r * x
    return r


@triton.jit
def _pow(x, y):
    """x ** y as Python and jnp.power give it for floats: |x| ** y, negative for a negative x and an odd
    integer y, NaN for a negative x and a y that is not an integer, 1 for 0 ** 0."""
    y = tl.zeros_like(x) + y  # a float tile, whatever y was (x * 0.0 would be NaN for an infinite x)
    r = tl.exp2(y * tl.log2(tl.abs(x)))
    whole = tl.floor(y) == y
    odd = whole & (tl.floor(y * 0.5) * 2.0 != y)
    r = tl.where((x < 0.0) & odd, -r, r)
    r = tl.where((x < 0.0) & (~whole), float("nan"), r)
    return tl.where((x == 0.0) & (y == 0.0), 1.0, r)


@triton.jit
def _tighten(lo, hi, flo, fhi, A_Q: tl.constexpr, A_K: tl.constexpr, c, x0, x1, X_IS_Q: tl.constexpr):
    """Bounds on y from the constraint A_Q * q_idx + A_K * kv_idx + c >= 0 over x in [x0, x1]: for some x
    (lo, hi), for every x (flo, fhi). x is the query index and y the key index (X_IS_Q), or the other way
    round; the constraint as A * x + B * y + c >= 0."""
    A: tl.constexpr = A_Q if X_IS_Q else A_K
    B: tl.constexpr = A_K if X_IS_Q else A_Q
    if A > 0:
        t_any = A * x1 + c
        t_all = A * x0 + c
    else:
        t_any = A * x0 + c
        t_all = A * x1 + c
    if B > 0:
        lo = tl.maximum(lo, -_int_div(t_any, B))
        flo = tl.maximum(flo, -_int_div(t_all, B))
    elif B < 0:
        hi = tl.minimum(hi, _int_div(t_any, -B))
        fhi = tl.minimum(fhi, _int_div(t_all, -B))
    else:
        hi = tl.where(t_any >= 0, hi, -1)
        fhi = tl.where(t_all >= 0, fhi, -1)
    return lo, hi, flo, fhi


@triton.jit
def _to_blocks(lo, hi, flo, fhi, BLOCK: tl.constexpr, n_blocks):
    """Half-open block ranges: visit [lo, hi), no element mask in [flo, fhi) ⊆ [lo, hi)."""
    blo = tl.minimum(tl.maximum(_int_div(lo, BLOCK), 0), n_blocks)
    bhi = tl.minimum(tl.maximum(_int_div(hi, BLOCK) + 1, blo), n_blocks)
    bhi = tl.where(hi < lo, blo, bhi)
    bflo = tl.minimum(tl.maximum(-_int_div(-flo, BLOCK), blo), bhi)
    bfhi = tl.minimum(tl.maximum(_int_div(fhi + 1, BLOCK), bflo), bhi)
    some_full = bfhi > bflo  # else one masked loop, not two
    bflo = tl.where(some_full, bflo, blo)
    bfhi = tl.where(some_full, bfhi, blo)
    return blo, bhi, bflo, bfhi


@triton.jit
def _tile_range(lo, hi, flo, fhi, TILES, off_b, off_h, i, n, ON: tl.constexpr, NB: tl.constexpr, NH: tl.constexpr,
                LISTS: tl.constexpr, COLS: tl.constexpr):
    """(lo, hi, flo, fhi, the row's tile list) of program tile i (docs/DESIGN.md §3 block masks).
    ON (TILE_RANGES): the analysed block range intersected with the block mask's, TILES [NB, NH, n, 4] int32
    (lo, hi, full_lo, full_hi over the other axis's tiles): visit what both visit, skip the element mask only
    where both say full. LISTS (TILE_LISTS): TILES [NB, NH, n, 2 + COLS] holds each row's count of partial and
    of full tiles, then their indices (partial first): the loops walk list positions, [0, partial) with the
    element mask and [partial, partial + full) without (the loops read the tile at each position)."""
    p_list = TILES
    if ON:
        row = i
        if NH > 1:
            row += off_h * n
        if NB > 1:
            row += off_b * (NH * n)
        if LISTS:
            p = TILES + row.to(tl.int64) * (2 + COLS)
            flo = tl.load(p)
            hi = flo + tl.load(p + 1)
            lo = flo * 0
            fhi = hi
            p_list = p + 2
        else:
            p = TILES + row.to(tl.int64) * 4
            lo = tl.maximum(lo, tl.load(p))
            hi = tl.maximum(tl.minimum(hi, tl.load(p + 1)), lo)
            flo = tl.minimum(tl.maximum(tl.maximum(flo, tl.load(p + 2)), lo), hi)
            fhi = tl.maximum(tl.minimum(tl.minimum(fhi, tl.load(p + 3)), hi), flo)
    return lo, hi, flo, fhi, p_list


@triton.jit
def _placed(p_pos, o_pos, n):
    """The explicit positions of rows o_pos (rows at or past n read 0); kernels without positions use o_pos itself
    (an inline `if`: a call per loop step costs the interpreter dearly)."""
    return tl.load(p_pos + o_pos, mask=o_pos < n, other=0)


@triton.jit
def _rows(base, B: tl.constexpr, SEQ: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr):
    """Tensor descriptor over the caller's [B, SEQ, H, D] as [B, SEQ, WIDTH = H * D], in tiles of BLOCK
    rows and COLS columns: rows past a sequence's end read as zeros."""
    return tl.make_tensor_descriptor(base, shape=[B, SEQ, WIDTH], strides=[SEQ * WIDTH, WIDTH, 1],
                                     block_shape=[1, BLOCK, COLS])


@triton.jit
def _tile(desc, off_b, row, col, BLOCK: tl.constexpr, COLS: tl.constexpr):
    """The [BLOCK, COLS] tile of sequence off_b from `row`, columns from `col` (a head's first)."""
    return desc.load([off_b, row, col]).reshape(BLOCK, COLS)
