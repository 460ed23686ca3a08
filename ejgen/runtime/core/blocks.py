"""Block-range arithmetic on traced int32 values, shared by the generated XLA and Pallas modules
(their ``kv_blocks`` and ``q_blocks`` hooks, which import it as ``blocks``).

Mirrors ``ejgen.ir.passes.mask`` (which evaluates the same arithmetic in Python): bounds are
inclusive element ranges ``(lo, hi, full_lo, full_hi)`` tightened one affine constraint
``a * x + b * y + c >= 0`` at a time, then turned into half-open block ranges.
"""

from __future__ import annotations

import jax.numpy as jnp


def ceildiv(x, y):
    return -((-x) // y)


def initial(n_other):
    n = jnp.int32(n_other)
    return (jnp.int32(0), n - 1, jnp.int32(0), n - 1)


def tighten(bounds, a: int, b: int, c, x0, x1):
    """Tighten ``bounds`` on y by ``a * x + b * y + c >= 0`` for x in [x0, x1]; a, b static ints."""
    lo, hi, flo, fhi = bounds
    for for_all in (False, True):
        pick_hi = (a > 0) != for_all
        total = a * (x1 if pick_hi else x0) + c
        if b > 0:
            low = ceildiv(-total, b)
            lo, flo = (lo, jnp.maximum(flo, low)) if for_all else (jnp.maximum(lo, low), flo)
        elif b < 0:
            high = total // (-b)
            hi, fhi = (hi, jnp.minimum(fhi, high)) if for_all else (jnp.minimum(hi, high), fhi)
        elif for_all:
            fhi = jnp.where(total >= 0, fhi, -1)
        else:
            hi = jnp.where(total >= 0, hi, -1)
    return lo, hi, flo, fhi


def to_blocks(bounds, block: int, n_blocks: int):
    """Half-open block ranges: visit [lo, hi), no element mask in [full_lo, full_hi) ⊆ [lo, hi)."""
    lo, hi, flo, fhi = bounds
    blo = jnp.clip(lo // block, 0, n_blocks)
    bhi = jnp.clip(hi // block + 1, blo, n_blocks)
    bhi = jnp.where(hi < lo, blo, bhi)
    bflo = jnp.clip(ceildiv(flo, block), blo, bhi)
    bfhi = jnp.clip((fhi + 1) // block, bflo, bhi)
    return blo, bhi, bflo, bfhi
