"""Triton helpers shared by every generated kernel module (``generated/<name>/triton_kernels.py``):
index arithmetic, guarded loads, dots, and the block ranges of the mask analysis. Nothing here depends
on a spec; the kernels that do are emitted per spec and import these.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _floordiv(x, y: tl.constexpr):
    """Python's floor division (Triton's `//` truncates toward zero)."""
    r = ((x % y) + y) % y
    return (x - r) // y


@triton.jit
def _load(ptr, m_a, m_b, CHECK: tl.constexpr):
    """A tile load, bounds-checked only where a block can cross an edge (CHECK)."""
    if CHECK:
        return tl.load(ptr, mask=m_a & m_b, other=0.0)
    else:
        return tl.load(ptr)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in float32. UPCAST (CPU interpreter only) widens bf16 operands first: Triton 3.9's
    interpreter multiplies the raw bits of bf16 tiles. Exact: bf16 products fit in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, accumulated in place by the tensor cores (UPCAST as in `_dot`)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _tighten(lo, hi, flo, fhi, A: tl.constexpr, B: tl.constexpr, c, x0, x1):
    """Bounds on y from A * x + B * y + c >= 0 for x in [x0, x1]: some x (lo, hi), every x (flo, fhi)."""
    if A > 0:
        t_any = A * x1 + c
        t_all = A * x0 + c
    else:
        t_any = A * x0 + c
        t_all = A * x1 + c
    if B > 0:
        lo = tl.maximum(lo, -_floordiv(t_any, B))
        flo = tl.maximum(flo, -_floordiv(t_all, B))
    elif B < 0:
        hi = tl.minimum(hi, _floordiv(t_any, -B))
        fhi = tl.minimum(fhi, _floordiv(t_all, -B))
    else:
        hi = tl.where(t_any >= 0, hi, -1)
        fhi = tl.where(t_all >= 0, fhi, -1)
    return lo, hi, flo, fhi


@triton.jit
def _to_blocks(lo, hi, flo, fhi, BLOCK: tl.constexpr, n_blocks):
    """Half-open block ranges: visit [lo, hi), no element mask in [flo, fhi) ⊆ [lo, hi)."""
    blo = tl.minimum(tl.maximum(_floordiv(lo, BLOCK), 0), n_blocks)
    bhi = tl.minimum(tl.maximum(_floordiv(hi, BLOCK) + 1, blo), n_blocks)
    bhi = tl.where(hi < lo, blo, bhi)
    bflo = tl.minimum(tl.maximum(-_floordiv(-flo, BLOCK), blo), bhi)
    bfhi = tl.minimum(tl.maximum(_floordiv(fhi + 1, BLOCK), bflo), bhi)
    some_full = bfhi > bflo  # else one masked loop, not two
    bflo = tl.where(some_full, bflo, blo)
    bfhi = tl.where(some_full, bfhi, blo)
    return blo, bhi, bflo, bfhi


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
