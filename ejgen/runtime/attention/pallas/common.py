"""The Pallas backend's plumbing, shared by every generated variant and by both kernel families:
which kernels run on which platform, constants and tile arithmetic, block metadata tables, TPU
lane layouts, and the param reads and gradient sums that the kernels of a spec with params call.

Nothing here knows a spec: a generated ``pallas.py`` holds the spec's hooks (``hooks.Hooks``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ejgen.runtime.core import sizes
from ejgen.runtime.core.pallas import KERNELS, available, dispatch, interpret_kernels  # noqa: F401 (shared by families)

NUM_LANES = 128
NUM_SUBLANES = 8

NEG_INF = float("-inf")
PAD = 128  # padding granularity of the op: GPU blocks divide it, TPU blocks are multiples of it
NT = (((1,), (1,)), ((), ()))  # a @ b^T
NN = (((1,), (0,)), ((), ()))  # a @ b

class Operands:
    """Kernel operands collected by name: arrays, their BlockSpecs, and the names the kernel body
    uses to find its refs (``dict(zip(names, refs))``). Optional inputs are simply not added."""

    def __init__(self):
        self.names: list[str] = []
        self.arrays: list = []
        self.specs: list = []

    def add(self, name: str, array, spec):
        self.names.append(name)
        self.arrays.append(array)
        self.specs.append(spec)

    def index(self, name: str) -> int:
        return self.names.index(name)


def pow2(n: int, least: int = 16) -> int:
    """A tile's padded size: ``sizes.pow2`` with the tensor cores' floor of 16."""
    return sizes.pow2(n, least)


def precision(dtype):
    """Exact float32 products for float32 inputs (no TF32); the native path for 16-bit inputs."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def head(h, groups):
    """(kv head, group member) of query head ``h`` (lax.div and rem: index maps of non-negative ints)."""
    return lax.div(h, jnp.int32(groups)), lax.rem(h, jnp.int32(groups))


def param_lanes(x):
    """Width of a param's flattened gradient accumulator [1, n]: a power of two of at least 128."""
    return pow2(x.size, NUM_LANES)


# Block metadata, outside the kernels.


def kinds_from_ranges(ranges, n_other: int):
    """``[n, 4]`` ranges (visit [lo, hi), no element mask in [full_lo, full_hi)) to a ``[n, n_other]``
    table of block kinds: 0 skip, 1 element mask, 2 no mask."""
    i = jnp.arange(n_other, dtype=jnp.int32)[None, :]
    lo, hi, flo, fhi = (ranges[:, j:j + 1] for j in range(4))
    visit = jnp.logical_and(i >= lo, i < hi)
    full = jnp.logical_and(i >= flo, i < fhi)
    return jnp.where(full, 2, jnp.where(visit, 1, 0)).astype(jnp.int32)


def fetch_table(kinds):
    """``[n, m]`` block index to fetch at each step of a TPU grid row: the block itself where it
    runs, else the block fetched before it (the first visited one at the start of the row), so
    that a skipped step repeats the previous index and costs no DMA."""
    n, m = kinds.shape
    i = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[None, :], (n, m))
    seen = jnp.where(kinds > 0, i, -1)
    last = lax.cummax(seen, axis=1)
    first = jnp.argmax(kinds > 0, axis=1).astype(jnp.int32)[:, None]
    return jnp.where(last >= 0, last, first)


def to_lanes(x):
    """``[..., S]`` to ``[..., S, 128]``, each value repeated along the lanes (TPU row vectors)."""
    return jnp.broadcast_to(x[..., None], x.shape + (NUM_LANES,))


def to_sublanes(x):
    """``[B, S]`` to ``[B, 8, S]`` (TPU column vectors)."""
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], NUM_SUBLANES, x.shape[1]))


def clamped(x, *indices):
    """``x[indices]`` with every index clamped into its dim (the DSL's rule), broadcast together: a token view
    over whole rows (``hooks.with_token_views``)."""
    return x[tuple(jnp.clip(i, 0, n - 1) for i, n in zip(indices, x.shape))]


# Inside the kernels.


def lanes(x, n: int):
    """A lane-replicated ``[rows, 128]`` value as ``[rows, n]`` (TPU: tile or slice, no relayout)."""
    if n == x.shape[-1]:
        return x
    if n < x.shape[-1]:
        return x[:, :n]
    repeats = -(-n // x.shape[-1])
    return jnp.tile(x, (1, repeats))[:, :n]


def add_sinks(m, l, sinks):
    """(m, l, alpha) once the sinks (scalars) join the softmax denominator; scale acc by alpha."""
    m_all = m
    for a in sinks:
        m_all = jnp.maximum(m_all, a)
    alpha = jnp.exp(m - m_all)
    l = l * alpha
    for a in sinks:
        l = l + jnp.exp(a - m_all)
    return m_all, l, alpha


def round_half_even(x):
    """The DSL's round (half to even, as Python's) from floor and select: Pallas's Triton lowering has no
    `round` primitive (jax 0.11, H200: NotImplementedError), Mosaic has both."""
    r = jnp.floor(x + 0.5)
    odd = (r - 2.0 * jnp.floor(r * 0.5)) != 0.0
    return jnp.where(((r - x) == 0.5) & odd, r - 1.0, r)


def tile_sum(x):
    """Sum of a 2-D tile as ``[1, 1]`` (two one-axis reductions)."""
    return jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=0, keepdims=True)


def gather(ref, index: tuple, pos):
    """``ref[index]`` where the entry ``None`` of ``index`` is taken from the tile ``pos`` (clamped
    into the dim): one select per value of that dim, so a scalar read serves a whole tile."""
    axis = index.index(None)
    at = lambda p: ref[index[:axis] + (p,) + index[axis + 1:]]
    first = at(0)
    shape = jnp.broadcast_shapes(jnp.shape(pos), jnp.shape(first))
    init = jnp.broadcast_to(first, shape)
    return lax.fori_loop(1, ref.shape[axis], lambda p, acc: jnp.where(pos == p, at(p), acc), init)


def scatter(acc, shape: tuple, index: tuple, pos, contrib):
    """Add the sum of ``contrib`` (one tile) into ``acc [1, N]``, the flattened gradient of a param of
    ``shape``, at ``index``; an entry ``None`` takes its value per element from the tile ``pos``.
    Sums run in a fixed order: the result is deterministic."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    lane = lax.broadcasted_iota(jnp.int32, acc.shape, 1)
    base = 0
    for i, (idx, stride) in enumerate(zip(index, strides)):
        if idx is not None:
            base = base + idx * stride
    if pos is None:
        return acc + jnp.where(lane == base, tile_sum(contrib), 0.0)
    axis = index.index(None)

    def add(p, acc):
        part = tile_sum(jnp.where(pos == p, contrib, 0.0))
        return acc + jnp.where(lane == base + p * strides[axis], part, 0.0)

    return lax.fori_loop(0, shape[axis], add, acc)


def visit(lo, hi, flo, fhi, kind_of, step, carry):
    """Run ``step(i, carry, masked)`` over blocks ``[lo, hi)``: by the kind table ``kind_of(i)``
    when there is one (0 skip, 1 masked, 2 unmasked), else masked edges ``[lo, flo)``,
    ``[fhi, hi)`` and an unmasked middle ``[flo, fhi)`` (the Triton tutorial's stages)."""
    if kind_of is None:
        carry = lax.fori_loop(lo, flo, lambda i, c: step(i, c, True), carry)
        carry = lax.fori_loop(flo, fhi, lambda i, c: step(i, c, False), carry)
        return lax.fori_loop(fhi, hi, lambda i, c: step(i, c, True), carry)

    def body(i, c):
        # unmasked only where the kind table and the analysed range (causal, window, the spec's mask) both say so
        inside = jnp.logical_and(i >= flo, i < fhi).astype(jnp.int32)
        kind = jnp.minimum(kind_of(i), 1 + inside)  # arithmetic, not a scalar select (Pallas-Triton, session 8)
        return lax.switch(kind, (lambda c: c, lambda c: step(i, c, True), lambda c: step(i, c, False)), c)

    return lax.fori_loop(lo, hi, body, carry)
