"""The packed documents' tile plan of the Hopper kernels in two launches a pass (docs/DESIGN.md §3, segment ids
on the Hopper kernels: "The documents' plan"): the tile ranges the segment ids leave (`host.segment_ranges`) and
the order of the tiles by their work (`host.tile_order`, `host.bwd_order`), bit for bit what those jnp functions
give. In jnp they are 8-9 small XLA
kernels a pass, each ~1.1 us on an H200 whatever its size (session 35 trace, 8k tokens with 8 documents: 17 of them
and a copy ahead of the forward of a forward+backward call, ~21 us of its 0.65 ms).

`ranges_kernel`: one program per BR outer tiles of a batch row (the forward's query tiles, the backward's key
blocks) takes every inner tile at once: each tile's least and greatest id and whether it holds padding,
from the ids themselves (`block_mask.Segments`), then the kinds, the range of visited tiles and the first run of full
ones (`block_mask.tile_ranges(..., longest=False)`), and the tile's work as the order counts it. `order_kernel`: one
program per BR_ORDER of the (tile, batch row) entries counts the entries ahead of each (more work, or as much and an
earlier index: the rank `host._rank` gives), and writes each of its heads' places (the forward's snake over its
programs, `host.order_by_work`; the backward's plain list, `host.programs_by_work`).

Plain Triton, not Gluon: they run in Triton's interpreter on the CPU (tests/attention/test_gluon_plan.py).
"""

import triton
import triton.language as tl

BIG = tl.constexpr(2**31 - 1)  # tile_bounds' "no id" (int32 max)
BR = 16  # outer tiles a program (ranges)
BR_ORDER = 64  # entries a program (order)
CH = 64  # entries a step (order)
WARPS = 8  # (64 ids a thread at the most)


@triton.jit
def _tile_stats(ids, tiles, S: tl.constexpr, BLOCK: tl.constexpr):
    """(least id, greatest id, whether any id is real (>= 0), whether any is padding (< 0)) of each tile of ``tiles``
    (int32 [T]) over one batch row's ids; rows past S are neither (`block_mask.Segments._per_tile`)."""
    pos = tiles[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    inside = pos < S
    x = tl.load(ids + pos, mask=inside, other=0)
    real = inside & (x >= 0)
    lo = tl.min(tl.where(real, x, BIG), axis=1)
    hi = tl.max(tl.where(real, x, -BIG), axis=1)
    pad = tl.max((inside & (x < 0)).to(tl.int32), axis=1)
    return lo, hi, (lo <= hi).to(tl.int32), pad


@triton.jit
def _kinds(olo, ohi, oany, opad, ilo, ihi, iany, ipad, valid):
    """(any visible, all visible) as int32 [BR, CH] of outer x inner tiles (`block_mask.Segments.kinds`, symmetric in
    queries and keys); ``valid``: inner tiles that exist."""
    any_v = (oany[:, None] * iany[None, :] * valid[None, :]) * ((olo[:, None] <= ihi[None, :]) &
                                                                  (ilo[None, :] <= ohi[:, None])).to(tl.int32)
    same = (olo == ohi)[:, None] & (ilo == ihi)[None, :] & (olo[:, None] == ilo[None, :])
    all_v = any_v * (1 - opad[:, None]) * (1 - ipad[None, :]) * same.to(tl.int32)
    return any_v, all_v


@triton.jit
def ranges_kernel(OUTER, INNER, RANGES, WORK, B: tl.constexpr, S: tl.constexpr, N_O: tl.constexpr,
                  N_I: tl.constexpr, N_I_PAD: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
                  BACKWARD: tl.constexpr, CAUSAL: tl.constexpr, FWD_BLOCK_N: tl.constexpr, BR: tl.constexpr):
    """RANGES int32 [B, N_O, 4] (lo, hi, full lo, full hi) and WORK int32 [N_O * B] (entry t * B + b) of the outer
    tiles t of batch row program_id(1): OUTER, INNER [B, S] the outer and inner tiles' ids (the forward: query ids
    in BLOCK_O, key ids in BLOCK_I; the backward: the other way round). Every inner tile at once (N_I_PAD of them,
    one load: a loop over chunks of them waits on each chunk's load in turn, 8-44 us at 8k-32k tokens on an H200).
    Work: the forward's key blocks (causal: up to its diagonal's FWD_BLOCK_N block; at least 1, `host.tile_order`),
    the backward's query blocks (causal: from its diagonal, `host.bwd_order`)."""
    b = tl.program_id(1)
    t = tl.program_id(0) * BR + tl.arange(0, BR)
    olo, ohi, oany, opad = _tile_stats(OUTER + b * S, t, S, BLOCK_O)
    j = tl.arange(0, N_I_PAD)
    valid = (j < N_I).to(tl.int32)
    ilo, ihi, iany, ipad = _tile_stats(INNER + b * S, j, S, BLOCK_I)
    any_v, all_v = _kinds(olo, ohi, oany, opad, ilo, ihi, iany, ipad, valid)
    lo = tl.min(tl.where(any_v > 0, j[None, :], N_I), axis=1)
    hi = tl.max(tl.where(any_v > 0, j[None, :] + 1, 0), axis=1)
    flo = tl.min(tl.where(all_v > 0, j[None, :], N_I), axis=1)
    after = (all_v == 0) & (valid[None, :] > 0) & (j[None, :] > flo[:, None])  # where the first full run ends
    fhi = tl.min(tl.where(after, j[None, :], N_I), axis=1)
    lo = tl.where(hi > 0, lo, 0)
    none = flo >= N_I
    flo = tl.where(none, lo, flo)
    fhi = tl.where(none, lo, fhi)
    keep = t < N_O
    out = RANGES + (b * N_O + t) * 4
    tl.store(out, lo, mask=keep)
    tl.store(out + 1, hi, mask=keep)
    tl.store(out + 2, flo, mask=keep)
    tl.store(out + 3, fhi, mask=keep)
    if BACKWARD:
        if CAUSAL:
            lo = tl.maximum(lo, t * BLOCK_O // BLOCK_I)
        work = tl.maximum(hi - lo, 0)
    else:
        if CAUSAL:
            hi = tl.minimum(hi, (t * BLOCK_O + BLOCK_O + FWD_BLOCK_N - 1) // FWD_BLOCK_N)
        work = tl.maximum(hi - lo, 1)
    tl.store(WORK + t * B + b, work, mask=keep)


@triton.jit
def order_kernel(WORK, ORDER, N: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, PROGRAMS: tl.constexpr,
                 SNAKE: tl.constexpr, BR: tl.constexpr, CH: tl.constexpr):
    """ORDER int32 [N * H]: entry i * H + h (i: a WORK entry, h: a head) at place rank(i) * H + h, rank(i) the
    entries with more work or as much and a smaller index; SNAKE: dealt to PROGRAMS programs, every other full
    wave backwards (`host.order_by_work`)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    wi = tl.load(WORK + i, mask=i < N, other=0)
    rank = tl.zeros([BR], tl.int32)
    for c in range(0, N, CH):
        j = c + tl.arange(0, CH)
        wj = tl.load(WORK + j, mask=j < N, other=0)
        ahead = (wj[None, :] > wi[:, None]) | ((wj[None, :] == wi[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & (j < N)[None, :]).to(tl.int32), axis=1)
    h = tl.arange(0, H_PAD)
    k = rank[:, None] * H + h[None, :]
    if SNAKE:
        wave = k // PROGRAMS
        j = k % PROGRAMS
        full_wave = (wave + 1) * PROGRAMS <= N * H  # a last, partial wave is dealt forwards: its slots exist
        k = wave * PROGRAMS + tl.where((wave % 2 == 1) & full_wave, PROGRAMS - 1 - j, j)
    tl.store(ORDER + k, i[:, None] * H + h[None, :], mask=(i < N)[:, None] & (h < H)[None, :])
