"""The Gluon kernels of `gluon_attention`, forward and backward (imported only where they run or are compiled:
they need Triton's Gluon). Both were checked on an H200 against the float64 oracle (tests/attention/test_gluon.py).

The forward is persistent (one program per SM walking query tiles: `_tile`; its barrier protocol across tiles is
described in notes/gluon-persistent-fwd.md and checked by a CPU model in tests/attention/test_gluon_protocol.py;
DYNAMIC: the tiles from a shared counter, each index handed to the consumers with its Q buffers, "Dynamic tile
queue" there). The
backward runs one program per 128 keys of a kv head, except for causal sliding windows: there a persistent form (at
the end of this file; one program per SM, tiles from an atomic counter) is 15-20% faster, while on causal and
unmasked calls the per-program kernel stays ahead (notes/gluon-persistent-bwd.md). Which calls these kernels take:
the kernel-set contract, docs/DESIGN.md §6 (`host.ineligible`).

Triton 3.6 names the bulk copies async_copy_global_to_shared / async_copy_shared_to_global, 3.9 async_load /
async_store (the old names raise there): `tma_load` / `tma_store` are whichever this Triton has; the bulk
reduce-add is 3.9's async_atomic_add or, on 3.6, a builtin over the builder's op.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6: thread_barrier, 3.9: barrier

if hasattr(tma, "async_atomic_add"):  # Triton 3.9
    tma_reduce_add = tma.async_atomic_add
else:  # Triton 3.6: its builder has the bulk reduce (the op 3.9's async_atomic_add emits) but no Python wrapper

    @builtin
    def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        from triton._C.libtriton import ir

        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _blocks(q_lo, left, right, SEQ_K: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
            CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """Key blocks [lo, hi) meeting the visible band of query rows [q_lo, q_lo + ROWS), and [f0, f1): the
    blocks visible to every one of those rows and inside the keys (SEQ_K of them; no element mask)."""
    q_hi = q_lo + ROWS
    hi_key = q_lo * 0 + SEQ_K
    lo_key = q_lo * 0
    fe = q_lo * 0 + SEQ_K // BLOCK_N  # blocks below fe have no key past a row's reach (nor past SEQ_K)
    fs = q_lo * 0  # blocks from fs have no key before a row's reach
    if CAUSAL:
        hi_key = gl.minimum(hi_key, q_hi)
        fe = gl.minimum(fe, (q_lo + 1) // BLOCK_N)
    if WINDOW:
        hi_key = gl.minimum(hi_key, q_hi + right)
        lo_key = gl.maximum(q_lo - left, 0)
        fe = gl.minimum(fe, (q_lo + right + 1) // BLOCK_N)
        fs = (gl.maximum(q_hi - 1 - left, 0) + BLOCK_N - 1) // BLOCK_N
    lo = lo_key // BLOCK_N
    hi = (hi_key + BLOCK_N - 1) // BLOCK_N
    f0 = gl.minimum(gl.maximum(lo, fs), hi)
    f1 = gl.maximum(f0, gl.minimum(fe, hi))
    return lo, hi, f0, f1

@gluon.jit
def _tile_blocks(i_m, off_b, left, right, RANGES, SEQ: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SEGMENTS: gl.constexpr, SEQ_K: gl.constexpr,
                 SPANS: gl.constexpr):
    """`_blocks` of query tile i_m of batch row off_b; with SEGMENTS joined with the tile's range of the segment ids
    (RANGES [B, N_M, 4]: lo, hi, full lo, full hi, `block_mask.tile_ranges`): visited in both, full in both. A tile
    whose ranges do not meet (padding rows) still visits one block, under the element mask: the loops need one.
    SPANS: RANGES [B, N_M, 4] are the tiles' own spans of key blocks, no ids (`host.layout_spans`): a tile with
    none (hi <= lo) is never run (`_next_spanned`)."""
    lo, hi, f0, f1 = _blocks(i_m * BLOCK_M, left, right, SEQ_K, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if SEGMENTS or SPANS:
        N_M: gl.constexpr = (SEQ + BLOCK_M - 1) // BLOCK_M
        r = RANGES + (off_b * N_M + i_m) * 4
        lo = gl.maximum(lo, gl.load(r))
        if SPANS:
            hi = gl.minimum(hi, gl.load(r + 1))
        else:
            hi = gl.maximum(gl.minimum(hi, gl.load(r + 1)), lo + 1)
        f0 = gl.maximum(f0, gl.load(r + 2))
        f1 = gl.minimum(f1, gl.load(r + 3))  # f1 <= f0: every block masked
    return lo, hi, f0, f1


@gluon.jit
def _list_row(LISTS, off_b, off_h, i, N_I: gl.constexpr, N_J: gl.constexpr, LIST_BATCH: gl.constexpr,
              LIST_HEADS: gl.constexpr, SUB_Q: gl.constexpr):
    """LIST: the row of tile i (of N_I) of batch row off_b, head off_h in the launch's block lists LISTS [LIST_BATCH,
    LIST_HEADS, N_I, 1 + N_J (+ N_J with SUB_Q)] (int32; 1: shared by every batch row / head): its count, then the
    entries (block * 2 + 1 where the block takes the element mask), then (SUB_Q) each entry's word of visible
    sub-blocks (`host.fwd_lists`, `host.bwd_lists`)."""
    if SUB_Q > 0:
        ROW: gl.constexpr = 1 + 2 * N_J
    else:
        ROW: gl.constexpr = 1 + N_J
    return LISTS + (((off_b % LIST_BATCH) * LIST_HEADS + off_h % LIST_HEADS) * N_I + i).to(gl.int64) * ROW


@gluon.jit
def _list_entry(lrow, slot, N_J: gl.constexpr, SUB_Q: gl.constexpr):
    """LIST: entry ``slot`` of a list row: (block, whether it takes the element mask (0 / 1), its word of visible
    sub-blocks (0 without SUB_Q))."""
    e = gl.load(lrow + 1 + slot)
    bits = e * 0
    if SUB_Q > 0:
        bits = gl.load(lrow + 1 + N_J + slot)
    return e >> 1, e & 1, bits


@gluon.jit
def _sub_blocks(bits, rows, cols, SUB_Q: gl.constexpr, SUB_K: gl.constexpr, TILE_M: gl.constexpr,
                TILE_N: gl.constexpr):
    """LIST with SUB_Q: bool [rows, cols] of the sub-blocks (SUB_Q x SUB_K of a TILE_M x TILE_N tile) a list entry's
    word marks visible (bit (row // SUB_Q) * (TILE_N // SUB_K) + col // SUB_K, offsets in the tile): a block
    layout finer than the kernel's tiles. ``rows`` / ``cols``: offsets in the sequence, [R, 1] and [1, C]."""
    sub = ((rows % TILE_M) // SUB_Q) * (TILE_N // SUB_K) + (cols % TILE_N) // SUB_K
    return ((bits >> sub) & 1) != 0


@gluon.jit
def _tile(t, N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr, CAUSAL: gl.constexpr):
    """Tile t -> (query tile, batch * head): sections of HS heads, query tiles slow (reversed for causal), heads
    fast; the last section may hold fewer than HS heads."""
    sec = t // (HS * N_M)
    h0 = sec * HS
    hs = gl.minimum(BH - h0, HS)
    r = t - sec * (HS * N_M)
    i_m = r // hs
    bh = h0 + (r - i_m * hs)
    if CAUSAL:
        i_m = N_M - 1 - i_m
    return i_m, bh


@gluon.jit
def _tile_at(t, ORDER, N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr, CAUSAL: gl.constexpr,
             ORDERED: gl.constexpr):
    """Tile t -> (query tile, batch * head): ORDERED, entry t of the launch's tile order (i_m * BH + bh: heaviest
    tiles first, dealt so every program gets a like share, `host.tile_order`), else `_tile`."""
    if ORDERED:
        e = gl.load(ORDER + t)
        return e // BH, e % BH
    else:
        return _tile(t, N_M, BH, HS, CAUSAL)


@gluon.jit
def _next_spanned(t, tile_ctr, RANGES, ORDER, N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr,
                  CAUSAL: gl.constexpr, ORDERED: gl.constexpr, HQ: gl.constexpr):
    """SPANS (the producer, DYNAMIC): tile t of the queue if its span of key blocks (RANGES, `_tile_blocks`) holds
    one, else the next such tile, each passed over for another fetch-and-add; or one past the last, the end. Nobody
    runs a tile passed over: its rows keep what the outputs held (with MERGE, aliased: their earlier result)."""
    r = _span_of(gl.minimum(t, N_M * BH - 1), RANGES, ORDER, N_M, BH, HS, CAUSAL, ORDERED, HQ)
    empty = gl.load(r + 1) <= gl.load(r)
    while (t < N_M * BH) & empty:
        t = gl.atomic_add(tile_ctr, 1, sem="relaxed", scope="gpu")
        r = _span_of(gl.minimum(t, N_M * BH - 1), RANGES, ORDER, N_M, BH, HS, CAUSAL, ORDERED, HQ)
        empty = gl.load(r + 1) <= gl.load(r)
    return t


@gluon.jit
def _span_of(t, RANGES, ORDER, N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr, CAUSAL: gl.constexpr,
             ORDERED: gl.constexpr, HQ: gl.constexpr):
    """SPANS: the address of tile t's row of RANGES [B, N_M, 4] (lo, hi, full lo, full hi)."""
    i_m, bh = _tile_at(t, ORDER, N_M, BH, HS, CAUSAL, ORDERED)
    return RANGES + ((bh // HQ) * N_M + i_m) * 4


@gluon.jit
def _tile_post(slot, t):
    """Producer (one warp): tile index t into a Q buffer's tile slot (DYNAMIC), every lane's store ordered before
    the (single-thread) arrive that publishes it: that arrive (plain or expect-tx) has release semantics, the
    consumers' wait acquire (PTX mbarrier), so they read t after their wait on the same barrier."""
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    slot.store(gl.full([1], t, gl.int32, layout=one_l))
    cta_barrier()


@gluon.jit
def _tile_take(q_ready, tile_smem, tc, HALF: gl.constexpr):
    """Consumer HALF (DYNAMIC): the tile index of this program's tile tc, from the tile slot of its Q buffer once
    that buffer's q_ready phase completed (>= the number of tiles: stop). The slot is next written for tile tc + 2,
    after this half released the Q buffer (q_empty) at the end of tile tc."""
    qi = (tc % 2) * 2 + HALF
    mbarrier.wait(q_ready.index(qi), (tc // 2) & 1)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(tile_smem.index(qi).load(one_l), axis=0)


@gluon.constexpr_function
def _pow2(n):
    return 1 << (n - 1).bit_length()


@gluon.jit
def _terms_load(TERMS, j, seq, KV_TERMS: gl.constexpr, BLOCK_N: gl.constexpr, ids_l: gl.constexpr):
    """Block j's columns of KV_TERMS rows of the position terms' table from TERMS (`_spec_options_terms`: rows of
    the positions 0 .. seq - 1 rounded up to 256, the key side's first): [pow2(KV_TERMS), BLOCK_N] int32 in the
    producer's layout (the forward's key side; the backward's query side, BLOCK_N its query block)."""
    stride = (seq + 255) // 256 * 256
    rows = gl.expand_dims(gl.arange(0, _pow2(KV_TERMS), layout=gl.SliceLayout(1, ids_l)), 1)
    cols = j * BLOCK_N + gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ids_l)), 0)
    return gl.load(TERMS + rows * stride + cols, mask=rows < KV_TERMS, other=0)


@gluon.jit
def _terms_read(terms_smem, KV_TERMS: gl.constexpr, s_layout: gl.constexpr):
    """The terms the producer staged for a block ([pow2(KV_TERMS), N] in shared memory) as a tuple of four [1, N]
    tiles in the S layout (its KV_TERMS rows; repeats past them, unread)."""
    k0 = terms_smem.slice(0, 1).load(s_layout)
    k1 = k0
    k2 = k0
    k3 = k0
    if KV_TERMS > 1:
        k1 = terms_smem.slice(1, 1).load(s_layout)
    if KV_TERMS > 2:
        k2 = terms_smem.slice(2, 1).load(s_layout)
    if KV_TERMS > 3:
        k3 = terms_smem.slice(3, 1).load(s_layout)
    return (k0, k1, k2, k3)


@gluon.jit
def _producer_tile(t, g, tc, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                   k_empty, v_empty, tile_smem, tile_ctr, left, right, RANGES, ORDER, KSEG, kseg_smem, HQ: gl.constexpr,
                   HKV: gl.constexpr, SEQ: gl.constexpr, N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, NUM_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SEGMENTS: gl.constexpr, ORDERED: gl.constexpr,
                   ITEM: gl.constexpr, DYNAMIC: gl.constexpr, LIST: gl.constexpr, LIST_BATCH: gl.constexpr,
                   LIST_HEADS: gl.constexpr, SUB_Q: gl.constexpr, SEQ_K: gl.constexpr, KV_TERMS: gl.constexpr,
                   TERMS_AT: gl.constexpr, SPANS: gl.constexpr):
    """Tile t, this program's tile tc, whose first K/V block is ring block g: its two Q halves into Q set tc % 2
    (DYNAMIC: t into each half's tile slot first), then (DYNAMIC) the fetch-and-add that takes the program's next
    tile, then its K/V blocks (LIST: the blocks of its list, RANGES, in order; an entry past the last block, the
    empty row's, loads the last one, which the consumers' element mask then hides whole). Returns (the tile's
    blocks, the next tile; static: t, unused)."""
    ROWS: gl.constexpr = BLOCK_M // 2
    ids_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, BLOCK_N // 32], threads_per_warp=[1, 32],
                                           warps_per_cta=[1, 1], order=[1, 0])
    i_m, bh = _tile_at(t, ORDER, N_M, BH, HS, CAUSAL, ORDERED)
    off_b = bh // HQ
    off_h = bh % HQ
    kv_col = (off_h // (HQ // HKV)) * D
    q_row0 = i_m * BLOCK_M
    N_N: gl.constexpr = (SEQ_K + BLOCK_N - 1) // BLOCK_N
    if LIST:
        lrow = _list_row(RANGES, off_b, off_h, i_m, N_M, N_N, LIST_BATCH, LIST_HEADS, SUB_Q)
        hi = gl.load(lrow)  # >= 1 (`host.fwd_lists`)
        lo = hi * 0
    else:
        lo, hi, f0, f1 = _tile_blocks(i_m, off_b, left, right, RANGES, SEQ, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                                      SEGMENTS, SEQ_K, SPANS)
    qb = (tc % 2) * 2
    q_phase = (tc // 2) & 1
    for h in gl.static_range(2):
        mbarrier.wait(q_empty.index(qb + h), q_phase ^ 1)
        if DYNAMIC:
            _tile_post(tile_smem.index(qb + h), t)  # published by the expect's arrive below
        mbarrier.expect(q_ready.index(qb + h), ROWS * D * ITEM)
        tma_load(q_desc, [off_b, q_row0 + h * ROWS, off_h * D], q_ready.index(qb + h), q_smem.index(qb + h))
    nxt = t
    if DYNAMIC:
        # the program's next tile, taken here: the warp waits for the atomic's result at once, and its next wait
        # (this tile's first K stage, freed by the consumers' work on the previous tile) usually blocks longer.
        # Relaxed: only the count matters (the tile's data are read-only, its outputs the program's own)
        nxt = gl.atomic_add(tile_ctr, 1, sem="relaxed", scope="gpu")
    for it in range(hi - lo):
        j = lo + it
        if LIST:
            j = gl.minimum(gl.load(lrow + 1 + it) >> 1, N_N - 1)
        gi = g + it
        idx = gi % NUM_STAGES
        phase = (gi // NUM_STAGES) & 1
        if SEGMENTS:
            cols = j * BLOCK_N + gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ids_l)), 0)
            ids = gl.load(KSEG + off_b.to(gl.int64) * SEQ_K + cols, mask=cols < SEQ_K, other=-2)
            if SEGMENTS == 2:  # the DOCS form (`host.DOCS_MASKS`): padding keys INT_MIN + 1, an id no row holds
                ids = gl.where(ids < 0, -2147483647, ids)
        if KV_TERMS > 0:  # the block's key-side position terms: rows of the table in I32 (passed as KSEG too)
            terms = _terms_load(KSEG + TERMS_AT, j, SEQ_K, KV_TERMS, BLOCK_N, ids_l)
        mbarrier.wait(k_empty.index(idx), phase ^ 1)
        mbarrier.expect(k_ready.index(idx), BLOCK_N * D * ITEM)
        tma_load(k_desc, [off_b, j * BLOCK_N, kv_col], k_ready.index(idx), k_smem.index(idx))
        if SEGMENTS:
            kseg_smem.index(idx).store(ids)
            cta_barrier()  # every lane's ids stored before the (single-thread) arrive
            mbarrier.arrive(k_ready.index(idx), count=1)
        if KV_TERMS > 0:
            kseg_smem.index(idx).store(terms)
            cta_barrier()  # every lane's terms stored before the (single-thread) arrive
            mbarrier.arrive(k_ready.index(idx), count=1)
        mbarrier.wait(v_empty.index(idx), phase ^ 1)
        mbarrier.expect(v_ready.index(idx), BLOCK_N * D * ITEM)
        tma_load(v_desc, [off_b, j * BLOCK_N, kv_col], v_ready.index(idx), v_smem.index(idx))
    return hi - lo, nxt


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              tile_smem, tile_ctr, pid, nprog, left, right, RANGES, ORDER, KSEG, kseg_smem, HQ: gl.constexpr,
              HKV: gl.constexpr, SEQ: gl.constexpr,
              N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              SEGMENTS: gl.constexpr, ORDERED: gl.constexpr, ITEM: gl.constexpr, DYNAMIC: gl.constexpr,
              LIST: gl.constexpr, LIST_BATCH: gl.constexpr, LIST_HEADS: gl.constexpr, SUB_Q: gl.constexpr,
              SEQ_K: gl.constexpr, KV_TERMS: gl.constexpr, TERMS_AT: gl.constexpr, SPANS: gl.constexpr):
    """Per tile: its two Q halves into Q set tc % 2 (once the consumers released that set, two tiles ago), then
    its K/V blocks into the ring; with SEGMENTS each block's key ids too, into kseg_smem next to its K (read before
    the stage is free, stored after; k_ready then counts this warp's arrive as well). Empty barriers start free:
    waiting for the parity before their first phase returns at once. Static: tiles pid, pid + nprog, ... DYNAMIC:
    every tile from a fetch-and-add on the launch's zeroed counter (the first one too: a program that starts late
    takes what is left), its index handed to the consumers in the tile slots of its Q buffers; the final index
    (>= the number of tiles) goes in the next Q set's slots with plain arrives on its q_ready barriers: stop."""
    g = pid * 0  # K/V blocks issued so far (all tiles of this program)
    tc = pid * 0  # tiles started so far
    gl.static_assert(DYNAMIC or not SPANS, "SPANS: the tiles with no key block are passed over in the dynamic queue")
    if DYNAMIC:
        t = gl.atomic_add(tile_ctr, 1, sem="relaxed", scope="gpu")
        if SPANS:
            t = _next_spanned(t, tile_ctr, RANGES, ORDER, N_M, BH, HS, CAUSAL, ORDERED, HQ)
        while t < N_M * BH:
            n, t = _producer_tile(t, g, tc, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, tile_smem, tile_ctr, left, right, RANGES, ORDER, KSEG,
                                  kseg_smem, HQ, HKV, SEQ, N_M, BH, HS, BLOCK_M, BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW,
                                  SEGMENTS, ORDERED, ITEM, DYNAMIC, LIST, LIST_BATCH, LIST_HEADS, SUB_Q, SEQ_K,
                                  KV_TERMS, TERMS_AT, SPANS)
            if SPANS:
                t = _next_spanned(t, tile_ctr, RANGES, ORDER, N_M, BH, HS, CAUSAL, ORDERED, HQ)
            g += n
            tc += 1
        qb = (tc % 2) * 2
        for h in gl.static_range(2):  # the stop index, in step with the Q sets (the wait keeps the phases apart)
            mbarrier.wait(q_empty.index(qb + h), ((tc // 2) & 1) ^ 1)
            _tile_post(tile_smem.index(qb + h), t)
            mbarrier.arrive(q_ready.index(qb + h), count=1)
    else:
        for t in range(pid, N_M * BH, nprog):
            n, _ = _producer_tile(t, g, tc, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, tile_smem, tile_ctr, left, right, RANGES, ORDER, KSEG,
                                  kseg_smem, HQ, HKV, SEQ, N_M, BH, HS, BLOCK_M, BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW,
                                  SEGMENTS, ORDERED, ITEM, DYNAMIC, LIST, LIST_BATCH, LIST_HEADS, SUB_Q, SEQ_K,
                                  KV_TERMS, TERMS_AT, SPANS)
            g += n
            tc += 1


@gluon.jit
def _tanh(x, FAST: gl.constexpr):
    """tanh x = 1 - 2 / (e^{2x} + 1), the divide approximate (2 ulp): -1 and 1 at the ends (no inf / inf); within
    about 3e-7 of tanh everywhere, as the generated kernels' (lib._tanh). Two MUFU operations an element (exp2,
    reciprocal).
    FAST: the hardware's tanh.approx.f32, one MUFU operation, relative error about 2^-11 (the fast_tanh setting)."""
    if FAST:
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)
    return 1.0 - gl.fdiv(gl.full_like(x, 2.0), gl.exp2(x * 2.8853900817779268) + 1.0)


@gluon.jit
def _logits2(s, scale, cap_out, SOFTCAP: gl.constexpr):
    """Scaled logits in log2 units from S: s * scale (scale: the softmax scale times log2 e), or with SOFTCAP (1: the
    exact tanh, 2: the hardware's approximate one, `_tanh`) the capped ones, cap tanh(scale s / cap) log2 e (scale:
    the softmax scale / cap, cap_out: cap log2 e)."""
    if SOFTCAP:
        return _tanh(s * scale, SOFTCAP == 2) * cap_out
    return s * scale


@gluon.jit
def _scales(sm_scale, cap, SOFTCAP: gl.constexpr):
    """(scale, cap_out) of `_logits2`, forward and backward: the softmax scale times log2 e (cap_out unused), or with
    SOFTCAP the scale / cap and cap log2 e."""
    if SOFTCAP:
        return sm_scale / cap, cap * 1.4426950408889634
    return sm_scale * 1.4426950408889634, sm_scale * 0.0


@gluon.jit
def _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, cap_out, qs, ks, bits, off_b, off_h, opts,
             MASKED: gl.constexpr, SEQ_K: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
             SEGMENTS: gl.constexpr,
             ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, SUB_Q: gl.constexpr,
             SUB_K: gl.constexpr, SPEC_MASK: gl.constexpr, SOFTCAP: gl.constexpr, KV_TERMS: gl.constexpr):
    """Online softmax of one block in exp2 (scale * log2 e folded in): (p, alpha, m, l). SOFTCAP: the logits capped
    first, cap tanh(scale s / cap) (`_logits2`), so the mask's -inf stays -inf. With SEGMENTS the element
    mask also compares the rows' segment ids qs with the block's keys' ks ([1, BLOCK_N]; padding, negative, sees
    nothing); with SUB_Q it keeps only the sub-blocks the list entry's word ``bits`` marks (`_sub_blocks`); with
    SPEC_MASK (a spec's `_spec_mask`) it is the spec's mask too, on positions, of batch row off_b and query head off_h
    and the options opts (`_spec_options`; q_len = kv_len = SEQ_K: a spec mask is not taken where Sq != Sk). SEQ_K: the
    keys' count (the element mask hides the last block's keys past it)."""
    scale = qk_scale
    if SOFTCAP:  # the logits in log2 units from here
        s = _logits2(s, qk_scale, cap_out, SOFTCAP)
        scale = 1.0
    if MASKED:
        rows = q_row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        c2 = gl.expand_dims(cols, 0)
        dist = c2 - gl.expand_dims(rows, 1)  # key - query
        keep = c2 < SEQ_K
        if CAUSAL:
            keep = keep & (dist <= 0)
        if WINDOW:
            keep = keep & (dist >= -left) & (dist <= right)
        if SEGMENTS:
            q2 = gl.expand_dims(qs, 1)
            keep = keep & (q2 == ks) & (q2 >= 0)
        if SUB_Q > 0:
            keep = keep & _sub_blocks(bits, gl.expand_dims(rows, 1), c2, SUB_Q, SUB_K, 2 * ROWS, BLOCK_N)
        if KV_TERMS > 0:  # the spec's mask with its terms given: the tile's query side qs, the block's key side ks
            keep = keep & SPEC_MASK(gl.expand_dims(rows, 1), c2, qs, ks, off_b, off_h, off_b * 0 + SEQ_K,
                                    off_b * 0 + SEQ_K, opts)
        elif SPEC_MASK is not None:
            keep = keep & SPEC_MASK(gl.expand_dims(rows, 1), c2, off_b, off_h, off_b * 0 + SEQ_K, off_b * 0 + SEQ_K,
                                    opts)
        s = gl.where(keep, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)  # a row with no visible key yet: no inf - inf
    p = gl.exp2(s * scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

@gluon.jit
def _softmax_ids(s, m_i, l_i, j, q_row0, qk_scale, qs, ks, DIAGONAL: gl.constexpr, ROWS: gl.constexpr,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """`_softmax` of a masked block of segment ids under causal alone (`_block_softmax`'s DOCS form): the ids' equality
    (padding rows hold INT_MIN, padding keys and keys past the end INT_MIN + 1: no compare of their own), and on a
    block that reaches past the half's first row (DIAGONAL) the causal bound. Below the diagonal one setp and one selp
    an element (inline PTX: LLVM lowers a select of an and into a chain of selects and packs the i1 tiles into bytes);
    on it a plain where (the same PTX form there spilled 32 B a thread at tile start on Triton 3.9). sm_90 SASS, Triton
    3.6, a consumer warp's masked path over the unmasked 286 instructions: +151 / +354, against +702 before."""
    q2, k2 = gl.broadcast(gl.expand_dims(qs, 1), ks)
    if DIAGONAL:
        rows = q_row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1)) & (q2 == k2), s, -float("inf"))
    else:
        s = gl.inline_asm_elementwise("{ .reg .pred p; setp.eq.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }",
                                      "=r,r,r,r", [s, q2, k2], dtype=gl.float32, is_pure=True, pack=1)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)  # a row with no visible key yet: no inf - inf
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _block_softmax(s, m_i, l_i, j, f0, f1, q_row0, left, right, qk_scale, cap_out, qs, kseg_smem, k_empty, idx, bits,
                   off_b, off_h, opts, SEQ_K: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                   SEGMENTS: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                   SUB_Q: gl.constexpr, SUB_K: gl.constexpr, SPEC_MASK: gl.constexpr, SOFTCAP: gl.constexpr,
                   KV_TERMS: gl.constexpr, DOCS: gl.constexpr = False):
    """K stage idx back to the producer (S_j has retired), then block j's softmax, under the element mask outside
    [f0, f1); with SEGMENTS a masked block's key ids are read from the stage's kseg_smem first. Two shapes on
    purpose: with SEGMENTS the release waits for that read, inside the branch; without, it stays ahead of the branch
    as in the kernel measured against cuDNN (one form for both changes that kernel's code: PTX compared).
    DOCS (segment ids under causal alone, `_consumer_tile`): a masked block compares the ids, and the causal bound
    only where it reaches past the half's first row (`_softmax_ids`)."""
    if DOCS:
        if (j < f0) | (f1 <= j):
            ks = kseg_smem.index(idx).load(s_layout)  # [1, BLOCK_N]
            mbarrier.arrive(k_empty.index(idx), count=1)
            if (j + 1) * BLOCK_N > q_row0 + 1:
                p, alpha, m_i, l_i = _softmax_ids(s, m_i, l_i, j, q_row0, qk_scale, qs, ks, True, ROWS, BLOCK_N,
                                                  s_layout)
            else:
                p, alpha, m_i, l_i = _softmax_ids(s, m_i, l_i, j, q_row0, qk_scale, qs, ks, False, ROWS, BLOCK_N,
                                                  s_layout)
        else:
            mbarrier.arrive(k_empty.index(idx), count=1)
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, cap_out, qs, qs, bits, off_b,
                                          off_h, opts, False, SEQ_K, CAUSAL, WINDOW, SEGMENTS, ROWS, BLOCK_N, s_layout,
                                          SUB_Q, SUB_K, SPEC_MASK, SOFTCAP, KV_TERMS)
    elif SEGMENTS | (KV_TERMS > 0):
        if (j < f0) | (f1 <= j):
            if KV_TERMS > 0:  # the block's key-side position terms, staged by the producer
                ks = _terms_read(kseg_smem.index(idx), KV_TERMS, s_layout)
            else:
                ks = kseg_smem.index(idx).load(s_layout)  # [1, BLOCK_N]
            mbarrier.arrive(k_empty.index(idx), count=1)
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, cap_out, qs, ks, bits, off_b,
                                          off_h, opts, True, SEQ_K, CAUSAL, WINDOW, SEGMENTS, ROWS, BLOCK_N, s_layout,
                                          SUB_Q,
                                          SUB_K, SPEC_MASK, SOFTCAP, KV_TERMS)
        else:
            mbarrier.arrive(k_empty.index(idx), count=1)
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, cap_out, qs, qs, bits, off_b,
                                          off_h, opts, False, SEQ_K, CAUSAL, WINDOW, SEGMENTS, ROWS, BLOCK_N, s_layout,
                                          SUB_Q,
                                          SUB_K, SPEC_MASK, SOFTCAP, KV_TERMS)
    else:
        mbarrier.arrive(k_empty.index(idx), count=1)
        if (j < f0) | (f1 <= j):
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, cap_out, qs, qs, bits, off_b,
                                          off_h, opts, True, SEQ_K, CAUSAL, WINDOW, SEGMENTS, ROWS, BLOCK_N, s_layout,
                                          SUB_Q,
                                          SUB_K, SPEC_MASK, SOFTCAP, KV_TERMS)
        else:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, cap_out, qs, qs, bits, off_b,
                                          off_h, opts, False, SEQ_K, CAUSAL, WINDOW, SEGMENTS, ROWS, BLOCK_N, s_layout,
                                          SUB_Q,
                                          SUB_K, SPEC_MASK, SOFTCAP, KV_TERMS)
    return p, alpha, m_i, l_i


@gluon.jit
def _consumer_tile(t, g, tc, s_zero, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                   o_desc, lse_ptr, o_prev, lse_prev, left, right, qk_scale, cap_out, turn_mine, turn_other, QSEG,
                   kseg_smem, RANGES,
                   ORDER, opts, HQ: gl.constexpr, SEQ: gl.constexpr, N_M: gl.constexpr, BH: gl.constexpr,
                   HS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                   NUM_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SEGMENTS: gl.constexpr, ORDERED: gl.constexpr,
                   HALF: gl.constexpr, DYNAMIC: gl.constexpr, LIST: gl.constexpr, LIST_BATCH: gl.constexpr,
                   LIST_HEADS: gl.constexpr, SUB_Q: gl.constexpr, SUB_K: gl.constexpr, SPEC_MASK: gl.constexpr,
                   SEQ_K: gl.constexpr, SOFTCAP: gl.constexpr, KV_TERMS: gl.constexpr, SPEC_QTERMS: gl.constexpr,
                   MERGE: gl.constexpr, SPANS: gl.constexpr):
    """Tile t, this program's tile tc whose first K/V block is ring block g, for consumer HALF (see _consumer).
    LIST: the blocks of the tile's list (RANGES), each under the element mask where its entry says so and then, with
    SUB_Q, also under its word of visible sub-blocks; the empty row's entry (block N_N, past the end) hides every key.
    MERGE: the rows' result merged into their earlier one (o_prev, lse_prev: the kernel's own outputs' buffers) by
    the two lse's weights, as `ring._merge` does. Returns the tile's number of key blocks."""
    ROWS: gl.constexpr = BLOCK_M // 2
    TURN0: gl.constexpr = 1 if HALF == 0 else 0  # the first consumer's first wait passes at once
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    i_m, bh = _tile_at(t, ORDER, N_M, BH, HS, CAUSAL, ORDERED)
    off_b = bh // HQ
    off_h = bh % HQ
    N_N: gl.constexpr = (SEQ_K + BLOCK_N - 1) // BLOCK_N
    if LIST:
        lrow = _list_row(RANGES, off_b, off_h, i_m, N_M, N_N, LIST_BATCH, LIST_HEADS, SUB_Q)
        hi = gl.load(lrow)  # >= 1 (`host.fwd_lists`)
        lo = hi * 0
        f0 = lo
        f1 = lo
    else:
        lo, hi, f0, f1 = _tile_blocks(i_m, off_b, left, right, RANGES, SEQ, BLOCK_M, BLOCK_N, CAUSAL, WINDOW,
                                      SEGMENTS, SEQ_K, SPANS)
    q_row0 = i_m * BLOCK_M + HALF * ROWS
    # the rows' segment ids (SEGMENTS; else unused), read once per tile
    seg_rows = q_row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    qs = seg_rows
    # DOCS (SEGMENTS 2, `host.constexprs`' choice: segment ids under causal alone): masked blocks compare the ids (and
    # on the diagonal causal)
    DOCS: gl.constexpr = SEGMENTS == 2
    gl.static_assert(not DOCS or (CAUSAL and not WINDOW and not SOFTCAP and SUB_Q == 0 and SPEC_MASK is None
                                  and KV_TERMS == 0), "SEGMENTS 2: segment ids under causal alone")
    if SEGMENTS:
        qs = gl.load(QSEG + off_b.to(gl.int64) * SEQ + seg_rows, mask=seg_rows < SEQ, other=-1)
        if DOCS:  # padding rows: INT_MIN, an id no key holds
            qs = gl.where(qs < 0, -2147483647 - 1, qs)
    if KV_TERMS > 0:  # the spec mask's query-side position terms of the tile's rows, once per tile
        qs = SPEC_QTERMS(gl.expand_dims(seg_rows, 1), off_b * 0 + SEQ_K, off_b * 0 + SEQ_K, opts)
    qi = (tc % 2) * 2 + HALF
    q_buf = q_smem.index(qi)
    q_view = q_buf.reshape([ROWS, D])
    m_i = gl.full([ROWS], -float("inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    n = hi - lo  # >= 1: every row sees its own key (left, right >= 0)
    if not DYNAMIC:  # DYNAMIC: waited for in _tile_take, before the tile was known
        mbarrier.wait(q_ready.index(qi), (tc // 2) & 1)

    # block lo: S only (names apart from the loop's: loop-carried, they would change the kernel without LIST)
    j0 = lo
    fa0 = f0
    fb0 = f1
    w0 = lo
    if LIST:  # the entry: its block, and [fa, fb) = [0, j + 1) unless it takes the element mask
        j0, masked0, w0 = _list_entry(lrow, 0, N_N, SUB_Q)
        fb0 = j0 + 1 - masked0
    idx = g % NUM_STAGES
    mbarrier.wait(turn_mine, (g + TURN0) & 1)
    mbarrier.wait(k_ready.index(idx), (g // NUM_STAGES) & 1)
    s_tok = warpgroup_mma(q_view, k_smem.index(idx).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    mbarrier.arrive(turn_other, count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    p, alpha, m_i, l_i = _block_softmax(s, m_i, l_i, j0, fa0, fb0, q_row0, left, right, qk_scale, cap_out, qs,
                                        kseg_smem, k_empty, idx, w0, off_b, off_h, opts, SEQ_K, CAUSAL, WINDOW,
                                        SEGMENTS, ROWS, BLOCK_N, s_layout, SUB_Q, SUB_K, SPEC_MASK, SOFTCAP,
                                        KV_TERMS, DOCS)
    p16 = gl.convert_layout(p.to(dtype), p_layout)

    # block j: issue S_j and P_{j-1} V_{j-1}; the softmax of S_j runs while the second is in flight
    for it in range(1, n):
        j = lo + it
        fa = f0
        fb = f1
        w = lo
        if LIST:
            j, masked, w = _list_entry(lrow, it, N_N, SUB_Q)
            fb = j + 1 - masked
        gi = g + it
        idx = gi % NUM_STAGES
        phase = (gi // NUM_STAGES) & 1
        prev = (gi - 1) % NUM_STAGES
        prev_phase = ((gi - 1) // NUM_STAGES) & 1
        mbarrier.wait(turn_mine, (gi + TURN0) & 1)
        mbarrier.wait(k_ready.index(idx), phase)
        s_tok = warpgroup_mma(q_view, k_smem.index(idx).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        acc_tok = warpgroup_mma(p16, v_smem.index(prev).reshape([BLOCK_N, D]), acc, is_async=True)
        mbarrier.arrive(turn_other, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        p, alpha, m_i, l_i = _block_softmax(s, m_i, l_i, j, fa, fb, q_row0, left, right, qk_scale, cap_out, qs,
                                            kseg_smem, k_empty, idx, w, off_b, off_h, opts, SEQ_K, CAUSAL, WINDOW,
                                            SEGMENTS, ROWS, BLOCK_N, s_layout, SUB_Q, SUB_K, SPEC_MASK, SOFTCAP,
                                            KV_TERMS, DOCS)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p16))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)

    # the last P V
    gl_ = g + n - 1
    last = gl_ % NUM_STAGES
    mbarrier.wait(v_ready.index(last), (gl_ // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p16, v_smem.index(last).reshape([BLOCK_N, D]), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p16))
    mbarrier.arrive(v_empty.index(last), count=1)

    # epilogue: O / l through this half's Q buffer (its wgmmas have all retired), lse = (m + log2 l) ln 2
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    inv = gl.convert_layout(1.0 / l_safe, row_o)
    rows = q_row0 + gl.arange(0, ROWS, layout=row_o)
    lse2 = gl.convert_layout(m_i + gl.log2(l_safe), row_o)  # (log2 units: -inf where the row saw no key)
    if MERGE:  # into the rows' earlier result: o = (o_prev w_prev + O / l w_new) / (w_prev + w_new), w = 2^lse2 / 2^top
        prev2 = gl.load(lse_prev + bh.to(gl.int64) * SEQ + rows, mask=rows < SEQ,
                        other=-float("inf")) * 1.4426950408889634
        top = gl.maximum(prev2, lse2)
        base = gl.where(top == -float("inf"), 0.0, top)
        w_prev = gl.exp2(prev2 - base)
        w_new = gl.exp2(lse2 - base)
        den = w_prev + w_new
        den_safe = gl.where(den == 0.0, 1.0, den)  # neither saw a key: o 0, lse -inf
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        at = ((off_b.to(gl.int64) * SEQ + gl.expand_dims(rows, 1)) * HQ + off_h) * D + gl.expand_dims(cols, 0)
        older = gl.load(o_prev + at, mask=gl.expand_dims(rows < SEQ, 1), other=0.0)
        o = (older.to(gl.float32) * gl.expand_dims(w_prev / den_safe, 1)
             + acc * gl.expand_dims(inv * (w_new / den_safe), 1)).to(dtype)
        lse2 = gl.where(den == 0.0, -float("inf"), base + gl.log2(den_safe))
    else:
        o = (acc * gl.expand_dims(inv, 1)).to(dtype)
    lse = lse2 * 0.6931471805599453
    gl.store(lse_ptr + bh.to(gl.int64) * SEQ + rows, lse, mask=rows < SEQ)
    q_view.store(o)
    fence_async_shared()
    tma_store(o_desc, [off_b, q_row0, off_h * D], q_buf)
    tma.store_wait(0)  # the bulk store has read the buffer (cp.async.bulk.wait_group.read 0)
    cta_barrier()  # every thread past the wait before the (single-thread) release
    mbarrier.arrive(q_empty.index(qi), count=1)  # the producer may load tile tc + 2's Q half here
    return n


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, lse_ptr, pid,
              o_prev, lse_prev,
              nprog, left, right, qk_scale, cap_out, turn_mine, turn_other, QSEG, kseg_smem, RANGES, ORDER, tile_smem,
              opts, HQ: gl.constexpr, SEQ: gl.constexpr, N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, WINDOW: gl.constexpr, SEGMENTS: gl.constexpr, ORDERED: gl.constexpr,
              HALF: gl.constexpr, DYNAMIC: gl.constexpr, LIST: gl.constexpr, LIST_BATCH: gl.constexpr,
              LIST_HEADS: gl.constexpr, SUB_Q: gl.constexpr, SUB_K: gl.constexpr, SPEC_MASK: gl.constexpr,
              SEQ_K: gl.constexpr, SOFTCAP: gl.constexpr, KV_TERMS: gl.constexpr, SPEC_QTERMS: gl.constexpr,
              MERGE: gl.constexpr, SPANS: gl.constexpr):
    """One 64-row half (HALF 0: the first to issue) of every tile of this program: the pipelined loop (softmax
    of block j under P_{j-1} V_{j-1}), then the epilogue through this half's Q buffer of the tile. The two halves
    take turns issuing their matmuls (turn_mine / turn_other: a token passed back and forth, its phase from the
    running block counter), so one half's softmax overlaps the other's matmuls. Static: tiles pid, pid + nprog,
    ...; DYNAMIC: each tile's index from its Q buffer's tile slot (`_tile_take`), until one >= the number of tiles."""
    ROWS: gl.constexpr = BLOCK_M // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    g = pid * 0  # K/V blocks consumed so far (all tiles of this program): ring stage / phase and turn phase
    tc = pid * 0  # tiles done so far: Q set tc % 2, parity (tc // 2) & 1
    if DYNAMIC:
        t = _tile_take(q_ready, tile_smem, tc, HALF)
        while t < N_M * BH:
            g += _consumer_tile(t, g, tc, s_zero, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                                v_empty, o_desc, lse_ptr, o_prev, lse_prev, left, right, qk_scale, cap_out, turn_mine,
                                turn_other, QSEG, kseg_smem, RANGES, ORDER, opts, HQ, SEQ, N_M, BH, HS, BLOCK_M,
                                BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW, SEGMENTS, ORDERED, HALF, DYNAMIC, LIST,
                                LIST_BATCH, LIST_HEADS, SUB_Q, SUB_K, SPEC_MASK, SEQ_K, SOFTCAP, KV_TERMS, SPEC_QTERMS,
                                MERGE, SPANS)
            tc += 1
            t = _tile_take(q_ready, tile_smem, tc, HALF)
    else:
        for t in range(pid, N_M * BH, nprog):
            g += _consumer_tile(t, g, tc, s_zero, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                                v_empty, o_desc, lse_ptr, o_prev, lse_prev, left, right, qk_scale, cap_out, turn_mine,
                                turn_other, QSEG, kseg_smem, RANGES, ORDER, opts, HQ, SEQ, N_M, BH, HS, BLOCK_M,
                                BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW, SEGMENTS, ORDERED, HALF, DYNAMIC, LIST,
                                LIST_BATCH, LIST_HEADS, SUB_Q, SUB_K, SPEC_MASK, SEQ_K, SOFTCAP, KV_TERMS, SPEC_QTERMS,
                                MERGE, SPANS)
            tc += 1


@gluon.jit
def _kv_pointers(K, V, I32, dtype: gl.constexpr, KV_AT: gl.constexpr, KV_OFF_AT: gl.constexpr, ROW: gl.constexpr):
    """Both kernels' K and V: as given, or (KV_AT > 0) out of one buffer of 16-bit items of any type (ring attention's
    received block as it came: no copy of its slices before the call), K from its first item, V from item KV_AT
    (a multiple of 8: 16-byte aligned for TMA), both from row I32[KV_OFF_AT] on (0: from row 0; ROW items a row)."""
    if KV_AT > 0:
        gl.static_assert(KV_AT % 8 == 0, "V's address must stay 16-byte aligned")
        K = K.to(gl.pointer_type(dtype), bitcast=True)
        V = K + KV_AT
        if KV_OFF_AT > 0:  # (ROW * 2 bytes a row: 16-byte aligned)
            row = gl.load(I32 + KV_OFF_AT).to(gl.int64) * ROW
            K = K + row
            V = V + row
    return K, V


@gluon.jit
def gluon_attention_fwd_kernel(Q, K, V, F32, I32, QSEG, KSEG, RANGES, ORDER, O_PREV, LSE_PREV, O, LSE, TILE_CTR,
                               SCRATCH,
                               B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr,
                               D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                               SEGMENTS: gl.constexpr, ORDERED: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr, HEAD_GROUP: gl.constexpr, DYNAMIC: gl.constexpr,
                               LIST: gl.constexpr, LIST_BATCH: gl.constexpr, LIST_HEADS: gl.constexpr,
                               SUB_Q: gl.constexpr, SUB_K: gl.constexpr, SPEC_MASK: gl.constexpr,
                               SPEC_OPTIONS: gl.constexpr, SEQ_K: gl.constexpr, SOFTCAP: gl.constexpr,
                               KV_TERMS: gl.constexpr, TERMS_AT: gl.constexpr, SPEC_QTERMS: gl.constexpr,
                               KV_AT: gl.constexpr, MERGE: gl.constexpr, SPANS: gl.constexpr):
    """Q [B, SEQ, HQ, D], K and V [B, SEQ_K, HKV, D] -> O like Q, LSE [B, HQ, SEQ] (float32); SEQ_K = SEQ but where
    the host takes Sq != Sk (no causal, window, segment ids, lists or spec mask: `host.ineligible`, gluon_cross).
    F32 = [scale, soft cap, ...], I32 = [window left, window right, ...]; SCRATCH: the descriptors' global scratch
    (unused by the body). SOFTCAP: the logits capped, cap tanh(scale s / cap) (docs/DESIGN.md §3).
    SEGMENTS: segment ids QSEG, KSEG [B, SEQ] (int32, negative = padding) and their tile ranges RANGES [B, N_M, 4]
    (int32, in key blocks: `_tile_blocks`); without it those three are placeholders. ORDERED: the tiles in the
    order ORDER [N_M * B * HQ] gives (`_tile_at`), else `_tile`'s (ORDER a placeholder).
    DYNAMIC: the programs take their tiles (in that order) from a fetch-and-add on TILE_CTR (one int32, zero at
    launch; left at the number of tiles + the number of programs, so it must be zeroed before every launch), not
    pid, pid + P, ...: a program that starts late takes fewer tiles (notes/gluon-persistent-fwd.md, "Dynamic tile
    queue"); else TILE_CTR is unused.
    LIST: each query tile walks a list of key blocks instead of a range (a block layout, joined with causal, the window
    and the segment ids' tiles): RANGES is then the lists [LIST_BATCH, LIST_HEADS, N_M, 1 + N_N (+ N_N)] (`_list_row`,
    `host.fwd_lists`); a listed block takes the element mask (causal, window, segment ids, the sequence's end and,
    with SUB_Q x SUB_K sub-blocks, the entry's word of visible ones) where its entry says so, none otherwise.
    SPEC_MASK (LIST): a spec's mask, `_spec_mask` of its kernel module (elementwise on tiles of positions), joins the
    element mask, with the options it reads loaded once by SPEC_OPTIONS (`_spec_options`: from F32 / I32, as the
    generated kernels lay them out); None, None without. KV_TERMS > 0 (no SEGMENTS): the mask's costly one-position
    terms are given to it (`_spec_mask_staged`, docs/DESIGN.md §6, position terms): the key side's KV_TERMS rows of
    the table at I32[TERMS_AT] (KSEG is I32 then) staged per key block by the producer next to its K, the query
    side's read once per tile (SPEC_QTERMS, `_spec_q_terms`).
    KV_AT > 0: K and V are one buffer of 16-bit items of any type (ring attention's received block, `ring.Wire`,
    unsigned): K its first B * SEQ_K * HKV * D items, V those from KV_AT on (V's own argument unread; KV_AT a
    multiple of 8, so V's address stays 16-byte aligned for TMA).
    MERGE: the result merged into an earlier one of the same rows, O_PREV like O and LSE_PREV like LSE (the host
    aliases them to O and LSE: each row read before it is written), by the two lse's weights (ring attention's last
    step, `ring.MERGE_IN_KERNEL`); without it O_PREV and LSE_PREV are placeholders.
    SPANS (DYNAMIC; no LIST, SEGMENTS, causal or window): RANGES [B, N_M, 4] gives each query tile's own span of key
    blocks (lo, hi, full lo, full hi: `host.layout_spans`, a block layout of at most two key columns); the queue
    passes over a tile whose span is empty (`_next_spanned`), whose rows then keep what O and LSE held: with MERGE,
    their earlier result (the ring's wide step, `host.LAYOUT_SPANS`).
    Grid (P,), P <= number of tiles (`grid`); 4 warps asked, 12 run (two consumers, a producer)."""
    gl.static_assert(not SPANS or not (LIST or SEGMENTS or CAUSAL or WINDOW), "SPANS: the tiles' spans alone")
    ROWS: gl.constexpr = BLOCK_M // 2
    N_M: gl.constexpr = (SEQ + BLOCK_M - 1) // BLOCK_M
    BH: gl.constexpr = B * HQ
    dtype: gl.constexpr = Q.dtype.element_ty
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    qk_scale, cap_out = _scales(gl.load(F32), gl.load(F32 + 1), SOFTCAP)  # F32[1]: the soft cap (read with SOFTCAP)
    left = gl.load(I32)
    right = gl.load(I32 + 1)
    opts = 0  # SPEC_MASK: the options the spec's mask reads (a tuple)
    if SPEC_MASK is not None:
        opts = SPEC_OPTIONS(F32, I32)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, ROWS, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, D], dtype)
    q_desc = tma.make_tensor_descriptor(Q, shape=[B, SEQ, HQ * D], strides=[SEQ * HQ * D, HQ * D, 1],
                                        block_shape=[1, ROWS, D], layout=q_layout)
    o_desc = tma.make_tensor_descriptor(O, shape=[B, SEQ, HQ * D], strides=[SEQ * HQ * D, HQ * D, 1],
                                        block_shape=[1, ROWS, D], layout=q_layout)
    K, V = _kv_pointers(K, V, I32, dtype, KV_AT, 0, HKV * D)
    k_desc = tma.make_tensor_descriptor(K, shape=[B, SEQ_K, HKV * D], strides=[SEQ_K * HKV * D, HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[B, SEQ_K, HKV * D], strides=[SEQ_K * HKV * D, HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_smem = gl.allocate_shared_memory(dtype, [4, 1, ROWS, D], q_layout)  # [set * 2 + half]
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, D], kv_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    ids_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    ID_ROWS: gl.constexpr = _pow2(KV_TERMS) if KV_TERMS > 0 else 1  # segment ids, or the key-side terms
    kseg_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, ID_ROWS, BLOCK_N if SEGMENTS or KV_TERMS > 0 else 32],
                                          ids_layout)
    if DYNAMIC:  # each Q buffer's tile slot: the index of the tile whose Q it holds (16 B)
        tile_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        tile_smem = gl.allocate_shared_memory(gl.int32, [4, 1], tile_layout)
    else:
        tile_smem = kseg_smem  # unused
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=2 if SEGMENTS or KV_TERMS > 0 else 1)  # the K load (and the
        # producer's key ids or terms)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(4):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # the consumer of that half
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, LSE, pid,
                     O_PREV, LSE_PREV, nprog, left, right, qk_scale, cap_out, turn.index(0), turn.index(1),
                     QSEG, kseg_smem, RANGES, ORDER, tile_smem, opts, HQ, SEQ, N_M, BH, HEAD_GROUP, BLOCK_M, BLOCK_N,
                     D, NUM_STAGES, CAUSAL, WINDOW, SEGMENTS, ORDERED, 0, DYNAMIC, LIST, LIST_BATCH, LIST_HEADS,
                     SUB_Q, SUB_K, SPEC_MASK, SEQ_K, SOFTCAP, KV_TERMS, SPEC_QTERMS, MERGE, SPANS)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, LSE, pid,
                     O_PREV, LSE_PREV, nprog, left, right, qk_scale, cap_out, turn.index(1), turn.index(0),
                     QSEG, kseg_smem, RANGES, ORDER, tile_smem, opts, HQ, SEQ, N_M, BH, HEAD_GROUP, BLOCK_M, BLOCK_N,
                     D, NUM_STAGES, CAUSAL, WINDOW, SEGMENTS, ORDERED, 1, DYNAMIC, LIST, LIST_BATCH, LIST_HEADS,
                     SUB_Q, SUB_K, SPEC_MASK, SEQ_K, SOFTCAP, KV_TERMS, SPEC_QTERMS, MERGE, SPANS)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                     v_empty, tile_smem, TILE_CTR, pid, nprog, left, right, RANGES, ORDER, KSEG, kseg_smem, HQ, HKV,
                     SEQ, N_M, BH, HEAD_GROUP, BLOCK_M, BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW, SEGMENTS, ORDERED,
                     dtype.primitive_bitwidth // 8, DYNAMIC, LIST, LIST_BATCH, LIST_HEADS, SUB_Q, SEQ_K, KV_TERMS,
                     TERMS_AT, SPANS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --- Backward ------------------------------------------------------------------------------------------------
# FA3's shape: one program per 128 keys of one kv head, two consumer warpgroups owning 64 keys each (dK, dV
# accumulators in registers), a producer warp loading Q, dO (TMA) and the lse / delta rows into a ring; per
# query block of 64 rows S^T and dP^T are issued together (the exp of S^T under dP^T), dV and dK updated
# asynchronously, dS^T halves joined in shared memory, and dQ = dS K (each warpgroup half of the head dim)
# added to a float32 accumulator by bulk reduce-adds. DQ_MODE: 1 splits dQ's columns by slicing K in shared
# memory (head dim 128), 0 alternates whole tiles between the warpgroups (head dim 64: half a swizzle atom cannot
# be sliced).

@gluon.jit
def _qblock_range(n, S, SK, WINDOW_LEFT, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr):
    """Query blocks [m_lo, m_hi) that see some key of key block n, and [f0, f1) inside it: the blocks that need no
    element mask (every (query, key) pair visible, all rows < S and keys < SK; SK = S but for the cross backward,
    whose MASK is 0)."""
    num_m = (S + BLOCK_M - 1) // BLOCK_M
    k_lo = n * BLOCK_N
    m_lo = n * 0
    m_hi = num_m
    full_lo = m_lo
    full_hi = S // BLOCK_M
    if MASK >= 1:  # causal part: query i >= key j
        m_lo = k_lo // BLOCK_M
        full_lo = (k_lo + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M
    if MASK == 2:  # window: i - j <= WINDOW_LEFT
        m_hi = gl.minimum(m_hi, (k_lo + BLOCK_N - 1 + WINDOW_LEFT) // BLOCK_M + 1)
        full_hi = gl.minimum(full_hi, (k_lo + WINDOW_LEFT + 1) // BLOCK_M)
    # a key block reaching past SK: every query block masked
    full_hi = full_hi * gl.minimum((SK - k_lo) // BLOCK_N, 1)
    f0 = gl.minimum(gl.maximum(m_lo, full_lo), m_hi)
    f1 = gl.maximum(f0, gl.minimum(full_hi, m_hi))
    return m_lo, m_hi, f0, f1


@gluon.jit
def _opaque_zero():
    """0 from a volatile inline-asm move: LLVM can neither see through it nor hoist it out of a loop, so views
    made from it inside the loop stay there (ptxas folds the move). The backward's consumers make their K / V
    views from it per query block: hoisted, the views' wgmma descriptors held ~24 registers across the loop and
    spilled 52-84 B at head dim 128 (found with the persistent backward's prototype, notes/gluon-persistent-bwd.md)."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready,
                  do_ready, qd_empty, kv_bar, lse_ptr, delta_ptr, off_b, off_hk, n, S, m_lo, nm, H, GROUP, QSEG,
                  qs_smem, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  SEGMENTS: gl.constexpr, lrow, LIST: gl.constexpr, N_MQ: gl.constexpr, LIST_W: gl.constexpr,
                  SUB_Q: gl.constexpr, Q_TERMS: gl.constexpr, TERMS_AT: gl.constexpr, Q_FIRST: gl.constexpr):
    """The program's K and V once, then per (query head, query block) Q and dO by TMA into the ring and the
    block's lse * log2 e and delta rows (SEGMENTS: and segment ids; Q_TERMS: the spec mask's query-side position
    terms) into shared memory. LIST: the items of the key block's list (`_bwd_list_item`)."""
    qseg = QSEG + off_b.to(gl.int64) * S
    if Q_TERMS > 0:  # QSEG is I32: the terms' table at TERMS_AT, its query-side rows from row Q_FIRST
        qseg = QSEG + TERMS_AT + Q_FIRST * ((S + 255) // 256 * 256)
    KV_BYTES: gl.constexpr = BLOCK_N * D * 2
    mbarrier.expect(kv_bar, 2 * KV_BYTES)
    tma_load(k_desc, [off_b, n * BLOCK_N, off_hk * D], kv_bar, k_smem.index(0))
    tma_load(v_desc, [off_b, n * BLOCK_N, off_hk * D], kv_bar, v_smem.index(0))
    n_items = GROUP * nm
    if LIST == 2:  # the entries name their heads
        n_items = nm
    for it in range(n_items):
        hq = it // nm
        m = m_lo + it % nm
        if LIST:
            hq, m, _, _ = _bwd_list_item(lrow, it, nm, N_MQ, LIST_W, LIST, SUB_Q)
        _bwd_load_item(q_desc, do_desc, q_smem, do_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty, lse_ptr,
                       delta_ptr, off_b, m, off_hk * GROUP + hq, it % NUM_STAGES, (it // NUM_STAGES) & 1, H, S, qseg,
                       qs_smem, D, BLOCK_M, SEGMENTS, Q_TERMS)


@gluon.jit
def _bwd_list_item(lrow, it, cnt, N_MQ: gl.constexpr, LIST_W: gl.constexpr, LIST: gl.constexpr,
                   SUB_Q: gl.constexpr):
    """LIST: item ``it`` of a key block's list of ``cnt`` entries (a row of `_list_row` with LIST_W entries,
    `host.bwd_lists`): (query head in the kv head's group, query block, whether it takes the element mask (0 / 1),
    its word of visible sub-blocks). LIST 1: one list for every query head of the group, walked once per head
    (item hq * cnt + slot); LIST 2: each entry names its head and block (hq * N_MQ + m)."""
    if LIST == 2:
        v, masked, bits = _list_entry(lrow, it, LIST_W, SUB_Q)
        hq = v // N_MQ
        m = v % N_MQ
    else:
        hq = it // cnt
        m, masked, bits = _list_entry(lrow, it % cnt, LIST_W, SUB_Q)
    return hq, m, masked, bits


@gluon.jit
def _bwd_mask(pT, keys, rows, S, SK, WINDOW_LEFT, MASK: gl.constexpr):
    """P^T with invisible (key, query) pairs and rows past S or keys past SK set to 0."""
    k2 = gl.expand_dims(keys, 1)  # [HALF, 1]
    r2 = gl.expand_dims(rows, 0)  # [1, BLOCK_M]
    dist = r2 - k2  # query - key  [HALF, BLOCK_M]
    keep = (k2 < SK) & (r2 < S)
    if MASK >= 1:
        keep = keep & (dist >= 0)
    if MASK == 2:
        keep = keep & (dist <= WINDOW_LEFT)
    return gl.where(keep, pT, 0.0)


@gluon.jit
def _bwd_load_item(q_desc, do_desc, q_smem, do_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty, lse_ptr,
                   delta_ptr, off_b, m, h, s, ph, H, S, qseg, qs_smem, D: gl.constexpr, BLOCK_M: gl.constexpr,
                   SEGMENTS: gl.constexpr, Q_TERMS: gl.constexpr):
    """Producer, one ring item: Q and dO of query block m of head h by TMA into stage s (once both consumers
    released it: empty barriers start free, waiting on the parity before their first phase returns at once), and
    the block's lse * log2 e and delta rows into shared memory (plain loads; do_ready counts this arrival too);
    SEGMENTS: its rows' segment ids as well (qseg: this batch row's), into qs_smem; Q_TERMS: its rows' columns of
    the spec mask's query-side position terms instead (qseg: their first row in the table)."""
    QT_BYTES: gl.constexpr = BLOCK_M * D * (q_smem.dtype.primitive_bitwidth // 8)
    row_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, BLOCK_M // 32], threads_per_warp=[1, 32],
                                           warps_per_cta=[1, 1], order=[1, 0])
    mbarrier.wait(qd_empty.index(s), ph ^ 1)
    mbarrier.expect(q_ready.index(s), QT_BYTES)
    tma_load(q_desc, [off_b, m * BLOCK_M, h * D], q_ready.index(s), q_smem.index(s))
    mbarrier.expect(do_ready.index(s), QT_BYTES)
    tma_load(do_desc, [off_b, m * BLOCK_M, h * D], do_ready.index(s), do_smem.index(s))
    rows = m * BLOCK_M + gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, row_l)), 0)  # [1, BM]
    rbase = (off_b * H + h).to(gl.int64) * S
    lse = gl.load(lse_ptr + rbase + rows, mask=rows < S, other=0.0)
    dlt = gl.load(delta_ptr + rbase + rows, mask=rows < S, other=0.0)
    lse_smem.index(s).store(lse * 1.4426950408889634)
    dlt_smem.index(s).store(dlt)
    if SEGMENTS:
        qs_smem.index(s).store(gl.load(qseg + rows, mask=rows < S, other=-1))
    if Q_TERMS > 0:
        qs_smem.index(s).store(_terms_load(qseg, m, S, Q_TERMS, BLOCK_M, row_l))
    mbarrier.arrive(do_ready.index(s), count=1)


@gluon.jit
def _bwd_item_mask(pT, cols_smem, qs_smem, ks, bits, m, n, s, off_b, h, S, SK, WINDOW_LEFT, opts, WG: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr, SEGMENTS: gl.constexpr,
                   SUB_Q: gl.constexpr, SUB_K: gl.constexpr, SPEC_MASK: gl.constexpr, Q_TERMS: gl.constexpr):
    """P^T [HALF keys, BLOCK_M queries] of a masked item (query block m, key block n, stage s) under the element mask:
    causal / window and the ends (`_bwd_mask`), SEGMENTS the ids, SUB_Q the entry's word, SPEC_MASK the spec's (see
    `_bwd_item`)."""
    HALF: gl.constexpr = BLOCK_N // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    # the query offsets of this thread's columns come from shared memory (a load is not hoisted): as an
    # arange they were hoisted out of the item loop into 16 registers
    keys = n * BLOCK_N + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    rows = m * BLOCK_M + cols_smem.load(gl.SliceLayout(0, s_layout))
    pT = _bwd_mask(pT, keys, rows, S, SK, WINDOW_LEFT, MASK)
    if SEGMENTS:
        qs = qs_smem.index(s).load(s_layout)  # [1, BM]
        pT = gl.where((gl.expand_dims(ks, 1) == qs) & (qs >= 0), pT, 0.0)
    if SUB_Q > 0:
        pT = gl.where(_sub_blocks(bits, gl.expand_dims(rows, 0), gl.expand_dims(keys, 1), SUB_Q, SUB_K, BLOCK_M,
                                  BLOCK_N), pT, 0.0)
    if Q_TERMS > 0:  # the spec's mask with its terms given: the item's query side staged, the keys' ks
        qt = _terms_read(qs_smem.index(s), Q_TERMS, s_layout)
        pT = gl.where(SPEC_MASK(gl.expand_dims(rows, 0), gl.expand_dims(keys, 1), qt, ks, off_b, h, off_b * 0 + S,
                                off_b * 0 + SK, opts), pT, 0.0)
    elif SPEC_MASK is not None:
        pT = gl.where(SPEC_MASK(gl.expand_dims(rows, 0), gl.expand_dims(keys, 1), off_b, h, off_b * 0 + S,
                                off_b * 0 + SK, opts), pT, 0.0)
    return pT


@gluon.jit
def _bwd_item(dk, dv, k_mine, v_mine, k_dq, q_smem, do_smem, ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready,
              do_ready, qd_empty, ds_bar, v_empty, vb, it, n_it, dq_desc, s_zero, dq_zero, qk2, cap_out, sm_scale, gi,
              s, ph, m, h, n, f0, f1, off_b, S, SK, WINDOW_LEFT, qs_smem, ks, WG: gl.constexpr, D: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr, DQ_MODE: gl.constexpr,
              RELEASE_V: gl.constexpr,
              SEGMENTS: gl.constexpr, bits, SUB_Q: gl.constexpr, SUB_K: gl.constexpr, opts, SPEC_MASK: gl.constexpr,
              SOFTCAP: gl.constexpr, Q_TERMS: gl.constexpr):
    """Consumer warpgroup WG, one ring item gi (query block m of head h in stage s, parity ph) against its 64 keys
    of key block n (views k_mine, v_mine; k_dq: K for its share of dQ): S^T and dP^T, P^T and dS^T, dV += P^T dO and
    dK += dS^T Q, the dS^T half into dS buffer gi % 2 for the joint dQ = dS K (DQ_MODE 0: whole tiles alternating
    between the warpgroups, else this warpgroup's half of dQ's columns), dQ * scale reduce-added into the float32
    accumulator. RELEASE_V: V buffer vb goes back to the producer (v_empty) once the dP^T of the tile's last item
    (it == n_it - 1) retired. SEGMENTS: masked items also compare segment ids (qs_smem: the stage's query rows' ids,
    from the producer; ks: the warpgroup's keys' ids; padding, negative, sees nothing). SUB_Q: masked items keep only
    the sub-blocks their list entry's word ``bits`` marks (`_sub_blocks`); SPEC_MASK: the spec's mask too (`_spec_mask`,
    on positions: [1, BLOCK_M] queries by [HALF, 1] keys, batch row off_b, query head h, the options opts).
    SOFTCAP: P from the capped logits (`_logits2`: qk2 the scale / cap, cap_out cap log2 e) and dS^T times the cap's
    derivative 1 - t^2, t = tanh(scale s / cap) read back from P (log2 P = cap_out t - lse log2 e: no tile of t held
    across dP^T). Returns (dk, dv)."""
    HALF: gl.constexpr = BLOCK_N // 2
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    dq_stage = dq_smem.reshape([BLOCK_M, DQ_N])
    q_view = q_smem.index(s).reshape([BLOCK_M, D])
    do_view = do_smem.index(s).reshape([BLOCK_M, D])

    # S^T and dP^T issued back to back; the exp of S^T runs while dP^T is on the tensor cores
    mbarrier.wait(q_ready.index(s), ph)
    st_tok = warpgroup_mma(k_mine, q_view.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if SPEC_MASK is not None and ((m < f0) | (m >= f1)):
        # the spec's mask before dP^T is issued: the registers dP^T holds in flight are the mask's meanwhile (sm_90,
        # Triton 3.9, spilled bytes a thread: NATTEN 2-D 48 -> 0, sliding tile 560 -> 168; not measured for time).
        # do_ready first: the producer's lse rows and staged terms are plain stores that barrier releases (read after
        # q_ready alone, the previous round's rows were seen: NATTEN 2-D dK 4.5e-2 off on an H200, session 27)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st_tok, ))
        mbarrier.wait(do_ready.index(s), ph)
        pT = _bwd_item_mask(gl.exp2(_logits2(st, qk2, cap_out, SOFTCAP) - lse_smem.index(s).load(s_layout)),
                            cols_smem, qs_smem, ks, bits, m, n, s, off_b, h, S, SK, WINDOW_LEFT, opts, WG, BLOCK_M,
                            BLOCK_N,
                            MASK, SEGMENTS, SUB_Q, SUB_K, SPEC_MASK, Q_TERMS)
        dp_tok = warpgroup_mma(v_mine, do_view.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        mbarrier.wait(do_ready.index(s), ph)
        dp_tok = warpgroup_mma(v_mine, do_view.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
        lse2 = lse_smem.index(s).load(s_layout)  # [1, BM]: lse * log2(e), written by the producer before do_ready
        pT = gl.exp2(_logits2(st, qk2, cap_out, SOFTCAP) - lse2)  # (with SOFTCAP: 8-88 B spilled a thread, sm_90)
        if (m < f0) | (m >= f1):
            pT = _bwd_item_mask(pT, cols_smem, qs_smem, ks, bits, m, n, s, off_b, h, S, SK, WINDOW_LEFT, opts, WG,
                                BLOCK_M, BLOCK_N, MASK, SEGMENTS, SUB_Q, SUB_K, SPEC_MASK, Q_TERMS)
    dpT = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
    if RELEASE_V:
        mbarrier.arrive(v_empty.index(vb), count=1, pred=it == n_it - 1)
    dlt = dlt_smem.index(s).load(s_layout)  # [1, BM]
    ds = pT * (dpT - dlt)
    if SOFTCAP:  # d (cap tanh(x / cap)) / dx = 1 - t^2; where P is 0 (masked, or too small) dS is 0 anyway
        t = (gl.log2(pT) + lse_smem.index(s).load(s_layout)) * (1.0 / cap_out)
        ds = gl.where(pT > 0.0, ds * gl.maximum(1.0 - t * t, 0.0), 0.0)  # (|t| read back a hair over 1: 0)
    dsT = ds.to(dtype)
    pT16 = gl.convert_layout(pT.to(dtype), a_layout)
    dv_tok = warpgroup_mma(pT16, do_view, dv, is_async=True)
    dsT_a = gl.convert_layout(dsT, a_layout)
    dk_tok = warpgroup_mma(dsT_a, q_view, dk, is_async=True)
    # dS^T half -> smem for dQ (both warpgroups' halves are needed)
    ds_buf = ds_smem.index(gi % 2)
    ds_buf.slice(WG * HALF, HALF, dim=0).store(dsT)
    fence_async_shared()
    mbarrier.arrive(ds_bar, count=1)
    mbarrier.wait(ds_bar, gi & 1)  # both halves of dS_i are in smem
    if DQ_MODE == 0:
        if (gi % 2) == WG:
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_dq, dq_zero, use_acc=False, is_async=True)
            dq, dv, pT16, dk, dsT_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, dv_tok, pT16, dk_tok, dsT_a))
            mbarrier.arrive(qd_empty.index(s), count=1)
            tma.store_wait(0)  # the previous reduce from dq_stage has read it
            dq_stage.store(dq * sm_scale)
            fence_async_shared()
            tma_reduce_add(dq_desc, [off_b, m * BLOCK_M, h * D], dq_smem)
        else:
            dv, pT16, dk, dsT_a = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, pT16, dk_tok, dsT_a))
            mbarrier.arrive(qd_empty.index(s), count=1)
    else:
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_dq, dq_zero, use_acc=False, is_async=True)
        dq, dv, pT16, dk, dsT_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, dv_tok, pT16, dk_tok, dsT_a))
        mbarrier.arrive(qd_empty.index(s), count=1)
        tma.store_wait(0)
        dq_stage.store(dq * sm_scale)
        fence_async_shared()
        tma_reduce_add(dq_desc, [off_b, m * BLOCK_M, h * D + WG * DQ_N], dq_smem)
    return dk, dv


@gluon.jit
def _bwd_zeros(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, DQ_MODE: gl.constexpr):
    """The zero accumulators a consumer warpgroup's matmuls start from: S^T [BLOCK_N / 2, BLOCK_M] and its dQ part
    [BLOCK_M, DQ_N] (DQ_N: D, or D / 2 with DQ_MODE 1), in the wgmma layouts."""
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_N, 16])
    return (gl.zeros([BLOCK_N // 2, BLOCK_M], gl.float32, layout=s_layout),
            gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout))


@gluon.jit
def _bwd_store_dkdv(dk, dv, dk_ptr, dv_ptr, off_b, off_hk, n, sm_scale, SK, HKV, WG: gl.constexpr, D: gl.constexpr,
                    BLOCK_N: gl.constexpr, ROWS: gl.constexpr, add, ADD: gl.constexpr):
    """Warpgroup WG's dK (scaled) and dV rows of key block n of SK keys, straight from registers (rows past SK
    masked), ROWS rows a batch row. ADD: where ``add`` is nonzero, added in float32 to what those rows hold, one
    rounding (ring attention's pairs writing dK / dV into one buffer, `ring.DKV_INTO`: each row is one program's, the
    pairs consecutive launches, so the read-add-write races nothing)."""
    HALF: gl.constexpr = BLOCK_N // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    dtype: gl.constexpr = dk_ptr.dtype.element_ty
    r_o = n * BLOCK_N + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    c_o = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offs = ((off_b * ROWS + gl.expand_dims(r_o, 1)).to(gl.int64) * HKV + off_hk) * D + gl.expand_dims(c_o, 0)
    omask = (gl.expand_dims(r_o, 1) < SK) & (gl.expand_dims(c_o, 0) < D)
    if ADD:  # (dK's old rows read and added before dV's: one old tile live at a time)
        old = omask & (add != 0)
        gl.store(dk_ptr + offs, (dk * sm_scale + gl.load(dk_ptr + offs, mask=old, other=0.0).to(gl.float32)).to(dtype),
                 mask=omask)
        gl.store(dv_ptr + offs, (dv + gl.load(dv_ptr + offs, mask=old, other=0.0).to(gl.float32)).to(dtype),
                 mask=omask)
    else:
        gl.store(dk_ptr + offs, (dk * sm_scale).to(dtype), mask=omask)
        gl.store(dv_ptr + offs, dv.to(dtype), mask=omask)


@gluon.jit
def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready,
                  do_ready, qd_empty, kv_bar, ds_bar, dq_desc, dk_ptr, dv_ptr, dkv_add, off_b, off_hk, n, S, SK, m_lo,
                  nm, f0, f1, sm_scale, cap, H, HKV, GROUP, WINDOW_LEFT, qs_smem, KSEG, WG: gl.constexpr,
                  D: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
                  DQ_MODE: gl.constexpr, SEGMENTS: gl.constexpr, lrow, LIST: gl.constexpr, N_MQ: gl.constexpr,
                  LIST_W: gl.constexpr, SUB_Q: gl.constexpr, SUB_K: gl.constexpr, opts, SPEC_MASK: gl.constexpr,
                  SOFTCAP: gl.constexpr, Q_TERMS: gl.constexpr, SPEC_KVTERMS: gl.constexpr, DK_ROWS: gl.constexpr,
                  DKV_ADD: gl.constexpr):
    """Warpgroup WG's 64 keys: dK, dV over the program's query blocks (S^T, dP^T, P^T, dS^T; dV += P^T dO,
    dK += dS^T Q), its dS^T half into shared memory for the joint dQ = dS K (DQ_MODE: how the two warpgroups
    share it), dQ * scale reduce-added into the float32 accumulator; then dK * scale and dV stored. LIST: the
    items of the key block's list, each under the element mask where its entry says so (`_bwd_list_item`)."""
    HALF: gl.constexpr = BLOCK_N // 2
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    dk = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    s_zero, dq_zero = _bwd_zeros(BLOCK_M, BLOCK_N, D, DQ_MODE)
    qk2, cap_out = _scales(sm_scale, cap, SOFTCAP)
    # SEGMENTS: this warpgroup's keys' segment ids, read once (else unused)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    keys = n * BLOCK_N + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    ks = keys
    if SEGMENTS:
        ks = gl.load(KSEG + off_b.to(gl.int64) * SK + keys, mask=keys < SK, other=-2)
    if Q_TERMS > 0:  # the spec mask's key-side position terms of this warpgroup's keys, once
        ks = SPEC_KVTERMS(gl.expand_dims(keys, 1), off_b * 0 + S, off_b * 0 + SK, opts)
    mbarrier.wait(kv_bar, 0)

    n_items = GROUP * nm
    if LIST == 2:  # the entries name their heads
        n_items = nm
    for it in range(n_items):
        hq = it // nm
        m = m_lo + it % nm
        fa = f0
        fb = f1
        w = f0
        if LIST:  # [fa, fb) = [0, m + 1) unless the entry takes the element mask
            hq, m, masked, w = _bwd_list_item(lrow, it, nm, N_MQ, LIST_W, LIST, SUB_Q)
            fb = m + 1 - masked
        h = off_hk * GROUP + hq
        s = it % NUM_STAGES
        ph = (it // NUM_STAGES) & 1
        # K / V views made per query block from an opaque zero: their wgmma descriptors are computed at each
        # use instead of hoisted into ~24 registers across the loop (_opaque_zero)
        zero = _opaque_zero()
        k_view = k_smem.index(zero).reshape([BLOCK_N, D])
        k_mine = k_view.slice(WG * HALF, HALF, dim=0)
        v_mine = v_smem.index(zero).reshape([BLOCK_N, D]).slice(WG * HALF, HALF, dim=0)
        if DQ_MODE == 0:
            k_dq = k_view
        else:
            k_dq = k_view.slice(WG * DQ_N, DQ_N, dim=1)
        dk, dv = _bwd_item(dk, dv, k_mine, v_mine, k_dq, q_smem, do_smem, ds_smem, dq_smem, lse_smem, dlt_smem,
                           cols_smem, q_ready, do_ready, qd_empty, ds_bar, None, 0, it, 0, dq_desc, s_zero, dq_zero,
                           qk2, cap_out, sm_scale, it, s, ph, m, h, n, fa, fb, off_b, S, SK, WINDOW_LEFT, qs_smem, ks,
                           WG, D, BLOCK_M, BLOCK_N, MASK, DQ_MODE, False, SEGMENTS, w, SUB_Q, SUB_K, opts, SPEC_MASK,
                           SOFTCAP, Q_TERMS)

    # epilogue: dK (scaled) and dV of this WG's 64 keys, straight from registers
    _bwd_store_dkdv(dk, dv, dk_ptr, dv_ptr, off_b, off_hk, n, sm_scale, SK, HKV, WG, D, BLOCK_N, DK_ROWS, dkv_add,
                    DKV_ADD)
    tma.store_wait(0)


@gluon.jit
def _bwd_buffers(Q, K, V, DO, DQ_ACC, B: gl.constexpr, SEQ: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                 D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                 DQ_MODE: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, SEQ_K: gl.constexpr,
                 DQ_ROWS: gl.constexpr, KV_ROWS: gl.constexpr, QDO_ROWS: gl.constexpr):
    """Both backwards' tensor descriptors (Q, dO over [B, SEQ, heads * D], SEQ of their QDO_ROWS rows a batch row from
    Q, DO on; K, V over [B, SEQ_K, heads * D]; the float32 dQ accumulator in tiles of DQ_N columns: D, or D / 2 with
    DQ_MODE 1, SEQ of its DQ_ROWS rows a batch row from DQ_ACC on; K and V likewise SEQ_K of KV_ROWS rows) and shared
    buffers (K_STAGES K,
    V_STAGES V, NUM_STAGES Q and dO with their lse and delta rows, two dS^T and two dQ staging tiles, the column
    offsets 0 .. BLOCK_M - 1, the Q / dO ring's barriers), in the order both kernels allocate them."""
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, DQ_N], gl.float32)

    q_desc = tma.make_tensor_descriptor(Q, shape=[B, SEQ, HQ * D], strides=[QDO_ROWS * (HQ * D), HQ * D, 1],
                                        block_shape=[1, BLOCK_M, D], layout=q_layout)
    do_desc = tma.make_tensor_descriptor(DO, shape=[B, SEQ, HQ * D], strides=[QDO_ROWS * (HQ * D), HQ * D, 1],
                                         block_shape=[1, BLOCK_M, D], layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[B, SEQ_K, HKV * D], strides=[KV_ROWS * (HKV * D), HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[B, SEQ_K, HKV * D], strides=[KV_ROWS * (HKV * D), HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC, shape=[B, SEQ, HQ * D], strides=[DQ_ROWS * (HQ * D), HQ * D, 1],
                                         block_shape=[1, BLOCK_M, DQ_N], layout=dq_layout)

    k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, 1, BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, 1, BLOCK_N, D], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, D], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, D], q_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, DQ_N], dq_layout)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], row_layout)
    dlt_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], row_layout)
    # 0 .. BLOCK_M - 1: the consumers' masks read their query offsets from here (_bwd_mask)
    cols_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    cols_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_M], cols_layout)
    cols_smem.store(gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0])))

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()  # the Q / dO ring's barriers (initialised by the kernel)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    return (q_desc, do_desc, k_desc, v_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, lse_smem,
            dlt_smem, cols_smem, q_ready, do_ready, qd_empty)


@gluon.jit
def gluon_attention_bwd_kernel(Q, K, V, DO, LSE, DELTA, F32, I32, QSEG, KSEG, RANGES, ORDER, DQ_IN, DKV_IN, DQ_ACC,
                               DK, DV, SCRATCH,
                               B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr,
                               D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                               MASK: gl.constexpr, DQ_MODE: gl.constexpr, SEGMENTS: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LIST: gl.constexpr,
                               LIST_BATCH: gl.constexpr, LIST_HEADS: gl.constexpr, SUB_Q: gl.constexpr,
                               SUB_K: gl.constexpr, SPEC_MASK: gl.constexpr, SPEC_OPTIONS: gl.constexpr,
                               SOFTCAP: gl.constexpr, SEQ_K: gl.constexpr, Q_TERMS: gl.constexpr,
                               TERMS_AT: gl.constexpr, Q_FIRST: gl.constexpr, SPEC_KVTERMS: gl.constexpr,
                               DQ_ROWS: gl.constexpr, DQ_OFF_AT: gl.constexpr, KV_AT: gl.constexpr,
                               KV_ROWS: gl.constexpr, KV_OFF_AT: gl.constexpr, QDO_IN_PLACE: gl.constexpr,
                               DKV_AT: gl.constexpr, DKV_ADD_AT: gl.constexpr):
    """One key block of BLOCK_N keys of one kv head: dK, dV over its query heads (deterministic), dQ added in
    float32 to DQ_ACC (zeroed, [B, SEQ, HQ, D], scale applied) by bulk reduce-adds. DQ_ROWS > SEQ: DQ_ACC is a
    larger accumulator [B, DQ_ROWS, HQ, D] that the call adds its rows into from row I32[DQ_OFF_AT] on (0: from
    row 0; ring attention's pairs adding into one dQ of every local row, the host aliasing DQ_IN, that accumulator
    as given, to DQ_ACC; else DQ_IN a placeholder). KV_AT > 0: K and V are one buffer of 16-bit items of any type
    (ring attention's received block, `ring.KV_FROM_WIRE_BWD`): K [B, KV_ROWS, HKV, D] from its first item, V from
    item KV_AT, the call's SEQ_K keys from row I32[KV_OFF_AT] on (0: from row 0); V's own argument unread.
    QDO_IN_PLACE: Q and DO are [B, DQ_ROWS, HQ, D] like the dQ accumulator, the call's rows from its row
    I32[DQ_OFF_AT] on (ring attention's pairs reading their queries where they lie, `ring.Q_IN_PLACE`).
    DKV_AT > 0 (with KV_AT): dK and dV go into one buffer of 16-bit items of any type laid out as the K/V wire (ring
    attention's dK / dV wire, `ring.DKV_INTO`: the host aliasing DKV_IN, the buffer as given, to DK; else DKV_IN a
    placeholder): dK [B, KV_ROWS, HKV, D] from its first item, dV from item DKV_AT, the call's rows from row
    I32[KV_OFF_AT] on (its keys' row in the block); DV's own output a placeholder. DKV_ADD_AT > 0: where
    I32[DKV_ADD_AT] != 0 they are added to what those rows hold (`_bwd_store_dkdv`).
    LSE, DELTA: [B, HQ, SEQ] (DELTA = rowsum(dO * O) - d lse). K, V, DK, DV: [B, SEQ_K, HKV, D]; SEQ_K = SEQ but
    where the host takes Sq != Sk (MASK 0, no segment ids, lists or spec mask: `host.ineligible`, gluon_cross).
    MASK: 0 none, 1 causal, 2 causal with a window of I32[0] keys to the left.
    F32 = [scale, soft cap, ...] (SOFTCAP: the logits capped, `_logits2`). SEGMENTS: segment ids QSEG, KSEG [B, SEQ]
    (int32, negative = padding) and each key block's
    range of query blocks under them, RANGES [B, cdiv(SEQ, BLOCK_N), 4] (lo, hi, full lo, full hi), joined with the
    mask's (a key block no query sees: dK = dV = 0), and the programs' order ORDER [cdiv(SEQ, BLOCK_N) * B * HKV]
    (`host.bwd_order`: the most work first); without it placeholders. LIST (1: one list for the kv head's query
    heads, 2: a list of (query head, query block) items per kv head): each key block walks a list of query blocks
    instead (a block layout, joined with causal and the segment ids' tiles): RANGES is then the lists [LIST_BATCH,
    LIST_HEADS, N_N, 1 + W (+ W)] (`_list_row`, `_bwd_list_item`, `host.bwd_lists`), ORDER the programs' order by
    their work; an item takes the element mask (the mask, segment ids, the
    sequence's end and, with SUB_Q x SUB_K sub-blocks, the entry's word of visible ones) where its entry says so.
    SPEC_MASK, SPEC_OPTIONS (LIST): a spec's mask and its options' loader (`_spec_mask`, `_spec_options`; the
    forward's), joined with the element mask; None, None without. Q_TERMS > 0 (no SEGMENTS): the mask's costly
    one-position terms are given to it (`_spec_mask_staged`, docs/DESIGN.md §6, position terms): the query side's
    Q_TERMS rows of the table at I32[TERMS_AT] from row Q_FIRST (QSEG is I32 then), staged per item by
    the producer next to the lse and delta rows, the key side's read once per program (SPEC_KVTERMS, `_spec_kv_terms`).
    Grid (cdiv(SEQ_K, BLOCK_N), B * HKV); 4 warps asked, 12 run (two consumers, a producer)."""
    gl.static_assert(DQ_MODE < 2, "DQ_MODE: 0 (whole dQ tiles alternating) or 1 (half of dQ's columns each)")
    gl.static_assert(SEQ_K == SEQ or (MASK == 0 and not SEGMENTS and not LIST and SPEC_MASK is None),
                     "keys of another length only without masks, segment ids or lists (their ranges and lists are "
                     "in query positions and key blocks of SEQ)")
    sm_scale = gl.load(F32)
    cap = gl.load(F32 + 1)  # SOFTCAP (else unused)
    WINDOW_LEFT = gl.load(I32)
    opts = 0  # SPEC_MASK: the options the spec's mask reads (a tuple)
    if SPEC_MASK is not None:
        opts = SPEC_OPTIONS(F32, I32)
    GROUP = HQ // HKV
    n = gl.program_id(0)  # causal / window: small n has the most query blocks -> scheduled first
    pid_bh = gl.program_id(1)
    if SEGMENTS or LIST:  # programs start in launch order (n fast): take the n-th entry of the order
        N_PROG: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
        e = gl.load(ORDER + pid_bh * N_PROG + n)
        n = e // (B * HKV)
        pid_bh = e % (B * HKV)
    off_b = pid_bh // HKV
    off_hk = pid_bh % HKV
    gl.static_assert(DQ_ROWS >= SEQ, "the dQ accumulator holds the call's rows")
    dq_base = DQ_ACC
    q_base = Q
    do_base = DO
    if DQ_OFF_AT > 0:  # the call's rows from a row of a larger accumulator on (16-byte aligned: HQ * D * 4 bytes a row)
        row = gl.load(I32 + DQ_OFF_AT).to(gl.int64) * (HQ * D)
        dq_base = DQ_ACC + row
        if QDO_IN_PLACE:  # and of Q and dO, where they lie (HQ * D * 2 bytes a row: 16-byte aligned)
            q_base = Q + row
            do_base = DO + row
    gl.static_assert(KV_ROWS >= SEQ_K, "K and V hold the call's keys")
    K, V = _kv_pointers(K, V, I32, Q.dtype.element_ty, KV_AT, KV_OFF_AT, HKV * D)
    gl.static_assert(DKV_AT == 0 or KV_AT > 0, "dK / dV into a wire take the K/V wire's rows")
    gl.static_assert(DKV_ADD_AT == 0 or DKV_AT > 0, "dK / dV added into a wire's rows need that wire")
    dkv_add = 0  # DKV_ADD_AT: whether this call adds into the rows (else unused)
    if DKV_AT > 0:  # (the same pointers as K's and V's in the wire: the rows' items alike)
        DK, DV = _kv_pointers(DK, DV, I32, Q.dtype.element_ty, DKV_AT, KV_OFF_AT, HKV * D)
        if DKV_ADD_AT > 0:
            dkv_add = gl.load(I32 + DKV_ADD_AT)
    DK_ROWS: gl.constexpr = KV_ROWS if DKV_AT > 0 else SEQ_K
    DKV_ADD: gl.constexpr = DKV_ADD_AT > 0

    (q_desc, do_desc, k_desc, v_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, lse_smem, dlt_smem,
     cols_smem, q_ready, do_ready, qd_empty) = _bwd_buffers(q_base, K, V, do_base, dq_base, B, SEQ, HQ, HKV, D,
                                                            BLOCK_M, BLOCK_N, NUM_STAGES, DQ_MODE, 1, 1, SEQ_K,
                                                            DQ_ROWS, KV_ROWS, DQ_ROWS if QDO_IN_PLACE else SEQ)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    misc_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)  # 0: K/V loaded, 1: dS^T halves written
    ids_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    Q_ROWS: gl.constexpr = _pow2(Q_TERMS) if Q_TERMS > 0 else 1  # segment ids, or the query-side terms
    qs_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, Q_ROWS, BLOCK_M if SEGMENTS or Q_TERMS > 0 else 32],
                                        ids_layout)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=2)  # dO TMA (expect-tx) + the producer's lse/delta stores
        mbarrier.init(qd_empty.index(i), count=2)
    mbarrier.init(misc_bar.index(0), count=1)
    mbarrier.init(misc_bar.index(1), count=2)
    fence_async_shared()

    N_MQ: gl.constexpr = (SEQ + BLOCK_M - 1) // BLOCK_M
    if LIST == 2:  # one list per kv head: its query heads' items
        LIST_W: gl.constexpr = (HQ // HKV) * N_MQ
    else:
        LIST_W: gl.constexpr = N_MQ
    lrow = 0  # LIST: the key block's list (a pointer: the partitions capture it only then)
    m_lo, m_hi, f0, f1 = _qblock_range(n, SEQ, SEQ_K, WINDOW_LEFT, BLOCK_M, BLOCK_N, MASK)
    if LIST:  # m_hi - m_lo: the list's count (items: GROUP * count, or count with LIST 2)
        lrow = _list_row(RANGES, off_b, off_hk, n, (SEQ + BLOCK_N - 1) // BLOCK_N, LIST_W, LIST_BATCH, LIST_HEADS,
                         SUB_Q)
        m_hi = gl.load(lrow)
        m_lo = m_hi * 0
        f0 = m_lo
        f1 = m_lo
    elif SEGMENTS:
        N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
        r = RANGES + (off_b * N_N + n) * 4
        m_lo = gl.maximum(m_lo, gl.load(r))
        m_hi = gl.maximum(gl.minimum(m_hi, gl.load(r + 1)), m_lo)
        f0 = gl.maximum(f0, gl.load(r + 2))
        f1 = gl.minimum(f1, gl.load(r + 3))  # f1 <= f0: every item masked
    nm = m_hi - m_lo
    gl.warp_specialize([
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(0), lse_smem, dlt_smem, cols_smem,
                         q_ready, do_ready, qd_empty, misc_bar.index(0), misc_bar.index(1), dq_desc, DK, DV, dkv_add,
                         off_b, off_hk, n, SEQ, SEQ_K, m_lo, nm, f0, f1, sm_scale, cap, HQ, HKV, GROUP, WINDOW_LEFT,
                         qs_smem, KSEG, 0,
                         D, BLOCK_M, BLOCK_N, NUM_STAGES, MASK, DQ_MODE, SEGMENTS, lrow, LIST, N_MQ, LIST_W, SUB_Q,
                         SUB_K, opts, SPEC_MASK, SOFTCAP, Q_TERMS, SPEC_KVTERMS, DK_ROWS, DKV_ADD)),
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(1), lse_smem, dlt_smem, cols_smem,
                         q_ready, do_ready, qd_empty, misc_bar.index(0), misc_bar.index(1), dq_desc, DK, DV, dkv_add,
                         off_b, off_hk, n, SEQ, SEQ_K, m_lo, nm, f0, f1, sm_scale, cap, HQ, HKV, GROUP, WINDOW_LEFT,
                         qs_smem, KSEG, 1,
                         D, BLOCK_M, BLOCK_N, NUM_STAGES, MASK, DQ_MODE, SEGMENTS, lrow, LIST, N_MQ, LIST_W, SUB_Q,
                         SUB_K, opts, SPEC_MASK, SOFTCAP, Q_TERMS, SPEC_KVTERMS, DK_ROWS, DKV_ADD)),
        (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready,
                         do_ready, qd_empty, misc_bar.index(0), LSE, DELTA, off_b, off_hk, n, SEQ, m_lo, nm, HQ, GROUP,
                         QSEG, qs_smem, D, BLOCK_M, BLOCK_N, NUM_STAGES, SEGMENTS, lrow, LIST, N_MQ, LIST_W,
                         SUB_Q, Q_TERMS, TERMS_AT, Q_FIRST)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --- Persistent backward (causal sliding windows) -------------------------------------------------------------
# The backward above with one program per SM walking (key block, batch * kv head) tiles in kv-head order (one
# (batch, kv head)'s key blocks back to back), each program's next tile taken from an atomic tile counter: K
# double-buffered, V too where shared memory allows (`host.pbwd_v_stages`), V released after a tile's last dP^T,
# the Q / dO ring and the dS buffers counted across tiles, so the next tile's K / V / Q / dO load under the current
# tile's tail and its dK / dV stores. Written as a prototype (design, barrier protocol and measurements:
# notes/gluon-persistent-bwd.md; the protocol's CPU model: tests/attention/test_gluon_protocol.py) and verified on
# an H200 (116/116 against a float32 reference, dK / dV bit-identical to the per-program kernel). Measured there
# (backward kernel alone, three repetitions): window (16k, 1024) 15-20% faster than the per-program kernel; causal
# and no mask not faster, so `host` takes it for windows only.

@gluon.jit
def _pbwd_tile_post(tile_smem, tile_ready, tile_empty, tc, t, TILE_STAGES: gl.constexpr):
    """Producer: tile index t of this program's tile tc into slot tc % TILE_STAGES of the tile ring (once both
    consumers read what it held, TILE_STAGES tiles ago), then tile_ready (its arrive releases the store)."""
    slot = tc % TILE_STAGES
    mbarrier.wait(tile_empty.index(slot), ((tc // TILE_STAGES) & 1) ^ 1)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_smem.index(slot).store(gl.full([1], t, gl.int32, layout=one_l))
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def _pbwd_tile_take(tile_smem, tile_ready, tile_empty, tc, TILE_STAGES: gl.constexpr):
    """Consumer: the tile index of this program's tile tc from the tile ring (>= the number of tiles: stop); the
    slot is released at once (the value is in registers)."""
    slot = tc % TILE_STAGES
    mbarrier.wait(tile_ready.index(slot), (tc // TILE_STAGES) & 1)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    t = gl.max(tile_smem.index(slot).load(one_l), axis=0)
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return t


@gluon.jit
def _pbwd_tile_range(t, RANGES, WINDOW_LEFT, B: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MASK: gl.constexpr, SEGMENTS: gl.constexpr):
    """Tile t -> (key block n, batch row, kv head) and its query blocks [m_lo, m_hi) with the unmasked ones
    [f0, f1) (`_qblock_range`). Without SEGMENTS t is a place in the kv-head order (`_tile`); with SEGMENTS it is
    an entry n * B * HKV + b * HKV + kv head of `host.bwd_order` (the producer posts ORDER[place]), and the range is
    joined with the segment ids' RANGES [B, N_N, 4] (lo, hi, full lo, full hi) as the per-program kernel joins it:
    a key block no query sees gets m_hi = m_lo (no item; its dK, dV are 0)."""
    N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
    BH: gl.constexpr = B * HKV
    if SEGMENTS:
        n = t // BH
        bh = t % BH
    else:
        n, bh = _tile(t, N_N, BH, 1, False)  # kv-head order: sections of one (batch, kv head)
    off_b = bh // HKV
    off_hk = bh % HKV
    m_lo, m_hi, f0, f1 = _qblock_range(n, SEQ, SEQ, WINDOW_LEFT, BLOCK_M, BLOCK_N, MASK)
    if SEGMENTS:
        r = RANGES + (off_b * N_N + n) * 4
        m_lo = gl.maximum(m_lo, gl.load(r))
        m_hi = gl.maximum(gl.minimum(m_hi, gl.load(r + 1)), m_lo)
        f0 = gl.maximum(f0, gl.load(r + 2))
        f1 = gl.minimum(f1, gl.load(r + 3))  # f1 <= f0: every item masked
    return n, off_b, off_hk, m_lo, m_hi, f0, f1


@gluon.jit
def _pbwd_producer_tile(t, g, tc, tile_ctr, nprog, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                        lse_smem, dlt_smem, q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, lse_ptr,
                        delta_ptr, WINDOW_LEFT, B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr,
                        D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                        K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, MASK: gl.constexpr, QSEG=None,
                        RANGES=None, qs_smem=None, SEGMENTS: gl.constexpr = False):
    """Tile t, the program's tile tc, whose first ring item is g: its K and V, then its items' Q / dO / lse /
    delta (SEGMENTS: and their rows' segment ids from QSEG into qs_smem). Returns the number of ring items of the
    tile and the program's next tile (nprog + a fetch-and-add on the tile counter)."""
    GROUP: gl.constexpr = HQ // HKV
    N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
    BH: gl.constexpr = B * HKV
    ITEM: gl.constexpr = q_smem.dtype.primitive_bitwidth // 8
    KV_BYTES: gl.constexpr = BLOCK_N * D * ITEM
    if SEGMENTS:
        n, off_b, off_hk, m_lo, m_hi, f0, f1 = _pbwd_tile_range(t, RANGES, WINDOW_LEFT, B, HKV, SEQ, BLOCK_M, BLOCK_N,
                                                                MASK, SEGMENTS)
        qseg = QSEG + off_b.to(gl.int64) * SEQ
    else:
        n, bh = _tile(t, N_N, BH, 1, False)  # kv-head order: sections of one (batch, kv head)
        off_b = bh // HKV
        off_hk = bh % HKV
        m_lo, m_hi, f0, f1 = _qblock_range(n, SEQ, SEQ, WINDOW_LEFT, BLOCK_M, BLOCK_N, MASK)
    nm = m_hi - m_lo
    kb = tc % K_STAGES
    mbarrier.wait(k_empty.index(kb), ((tc // K_STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(kb), KV_BYTES)
    tma_load(k_desc, [off_b, n * BLOCK_N, off_hk * D], k_ready.index(kb), k_smem.index(kb))
    # the next tile. The warp waits for the atomic's result right away (one lane does it, a shuffle broadcasts it),
    # so it is made here, after K, just before the V wait, which usually blocks for longer (this tile's V waits for
    # the last dP^T of the previous tile); relaxed: only the count matters
    nxt = nprog + gl.atomic_add(tile_ctr, 1, sem="relaxed", scope="gpu")
    vb = tc % V_STAGES
    mbarrier.wait(v_empty.index(vb), ((tc // V_STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(vb), KV_BYTES)
    tma_load(v_desc, [off_b, n * BLOCK_N, off_hk * D], v_ready.index(vb), v_smem.index(vb))
    for it in range(GROUP * nm):
        hq = it // nm
        m = m_lo + it % nm
        h = off_hk * GROUP + hq
        gi = g + it
        if SEGMENTS:
            _bwd_load_item(q_desc, do_desc, q_smem, do_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty, lse_ptr,
                           delta_ptr, off_b, m, h, gi % NUM_STAGES, (gi // NUM_STAGES) & 1, HQ, SEQ, qseg, qs_smem, D,
                           BLOCK_M, True, 0)
        else:
            _bwd_load_item(q_desc, do_desc, q_smem, do_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty, lse_ptr,
                           delta_ptr, off_b, m, h, gi % NUM_STAGES, (gi // NUM_STAGES) & 1, HQ, SEQ, lse_ptr, lse_smem,
                           D, BLOCK_M, False, 0)
    return GROUP * nm, nxt


@gluon.jit
def _pbwd_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready,
                   do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, tile_smem, tile_ready, tile_empty, tile_ctr,
                   lse_ptr, delta_ptr, pid, nprog, WINDOW_LEFT, B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                   SEQ: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, MASK: gl.constexpr,
                   TILE_STAGES: gl.constexpr, QSEG=None, RANGES=None, ORDER=None, qs_smem=None,
                   SEGMENTS: gl.constexpr = False):
    """Per tile tc of this program: its K into K buffer tc % K_STAGES and its V into V buffer tc % V_STAGES (each
    once the consumers released the tile that held it before), then per (query head, query block) -- ring item g,
    counted over all tiles -- Q and dO by TMA into stage g % NUM_STAGES and the block's lse * log2 e and delta
    rows into shared memory. Empty barriers start free: waiting for the parity before their first phase returns at
    once. The first tile is pid, each next one nprog + a fetch-and-add on the launch's zeroed tile counter, made
    after the current tile's K load (see _pbwd_producer_tile); every tile index, and the final one (>= the number
    of tiles: stop), goes to the consumers through the tile ring. SEGMENTS: the tiles are taken in ORDER's order
    (`host.bwd_order`, the most query blocks first): place t is the tile ORDER[t], which is what the ring carries."""
    N_T: gl.constexpr = ((SEQ + BLOCK_N - 1) // BLOCK_N) * B * HKV
    g = pid * 0  # ring items issued so far (all tiles of this program)
    tc = pid * 0  # tiles started so far
    t = pid
    while t < N_T:
        if SEGMENTS:  # place t of the order -> its tile
            e = gl.load(ORDER + t)
            _pbwd_tile_post(tile_smem, tile_ready, tile_empty, tc, e, TILE_STAGES)
            n_it, nxt = _pbwd_producer_tile(e, g, tc, tile_ctr, nprog, q_desc, do_desc, k_desc, v_desc, q_smem,
                                            do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty,
                                            k_ready, k_empty, v_ready, v_empty, lse_ptr, delta_ptr, WINDOW_LEFT, B, HQ,
                                            HKV, SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, QSEG,
                                            RANGES, qs_smem, SEGMENTS)
        else:
            _pbwd_tile_post(tile_smem, tile_ready, tile_empty, tc, t, TILE_STAGES)
            n_it, nxt = _pbwd_producer_tile(t, g, tc, tile_ctr, nprog, q_desc, do_desc, k_desc, v_desc, q_smem,
                                            do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty,
                                            k_ready, k_empty, v_ready, v_empty, lse_ptr, delta_ptr, WINDOW_LEFT, B, HQ,
                                            HKV, SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK)
        g += n_it
        tc += 1
        t = nxt
    _pbwd_tile_post(tile_smem, tile_ready, tile_empty, tc, t, TILE_STAGES)  # the stop index


@gluon.jit
def _pbwd_consumer_tile(t, g, tc, s_zero, dq_zero, qk2, cap_out, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                        lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty,
                        ds_bar, dq_desc, dk_ptr, dv_ptr, sm_scale, WINDOW_LEFT, WG: gl.constexpr, B: gl.constexpr,
                        HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, K_STAGES: gl.constexpr,
                        V_STAGES: gl.constexpr, MASK: gl.constexpr, DQ_MODE: gl.constexpr, SOFTCAP: gl.constexpr,
                        KSEG=None, RANGES=None, qs_smem=None, SEGMENTS: gl.constexpr = False):
    """Tile t, the program's tile tc whose first ring item is g, for warpgroup WG (see _pbwd_consumer). Returns the
    number of ring items of the tile. SEGMENTS: t is a tile of `host.bwd_order` (`_pbwd_tile_range`), masked items
    compare the rows' ids (qs_smem, from the producer) with the warpgroup's keys' (KSEG) as the per-program kernel
    does (`_bwd_item_mask`), and a tile of no item releases its V buffer at once."""
    GROUP: gl.constexpr = HQ // HKV
    N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
    BH: gl.constexpr = B * HKV
    HALF: gl.constexpr = BLOCK_N // 2
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])

    if SEGMENTS:
        n, off_b, off_hk, m_lo, m_hi, f0, f1 = _pbwd_tile_range(t, RANGES, WINDOW_LEFT, B, HKV, SEQ, BLOCK_M, BLOCK_N,
                                                                MASK, SEGMENTS)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        keys = n * BLOCK_N + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        ks = gl.load(KSEG + off_b.to(gl.int64) * SEQ + keys, mask=keys < SEQ, other=-2)  # this warpgroup's keys' ids
    else:
        n, bh = _tile(t, N_N, BH, 1, False)  # kv-head order, as in _pbwd_producer_tile
        off_b = bh // HKV
        off_hk = bh % HKV
        m_lo, m_hi, f0, f1 = _qblock_range(n, SEQ, SEQ, WINDOW_LEFT, BLOCK_M, BLOCK_N, MASK)
    nm = m_hi - m_lo
    n_it = GROUP * nm  # >= 1: every key block below SEQ meets some query block (SEGMENTS: >= 0)
    kb = tc % K_STAGES
    vb = tc % V_STAGES
    dk = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF, D], gl.float32, layout=acc_layout)
    mbarrier.wait(k_ready.index(kb), (tc // K_STAGES) & 1)
    mbarrier.wait(v_ready.index(vb), (tc // V_STAGES) & 1)

    for gi in range(g, g + n_it):
        it = gi - g
        hq = it // nm
        m = m_lo + it % nm
        h = off_hk * GROUP + hq
        s = gi % NUM_STAGES
        ph = (gi // NUM_STAGES) & 1
        # K / V views made per item from an opaque zero: their wgmma descriptors are computed at each use
        # instead of hoisted out of the loop into ~24 registers (which spilled; see _opaque_zero)
        zero = _opaque_zero()
        k_view = k_smem.index(kb + zero).reshape([BLOCK_N, D])
        k_mine = k_view.slice(WG * HALF, HALF, dim=0)
        v_mine = v_smem.index(vb + zero).reshape([BLOCK_N, D]).slice(WG * HALF, HALF, dim=0)
        if DQ_MODE == 0:
            k_dq = k_view
        else:
            k_dq = k_view.slice(WG * DQ_N, DQ_N, dim=1)
        # V goes back to the producer after the tile's last dP^T (the next tile's V lands under the rest)
        if SEGMENTS:
            dk, dv = _bwd_item(dk, dv, k_mine, v_mine, k_dq, q_smem, do_smem, ds_smem, dq_smem, lse_smem, dlt_smem,
                               cols_smem, q_ready, do_ready, qd_empty, ds_bar, v_empty, vb, it, n_it, dq_desc, s_zero,
                               dq_zero, qk2, cap_out, sm_scale, gi, s, ph, m, h, n, f0, f1, off_b, SEQ, SEQ,
                               WINDOW_LEFT, qs_smem, ks, WG, D, BLOCK_M, BLOCK_N, MASK, DQ_MODE, True, True, 0, 0, 0,
                               0, None, SOFTCAP, 0)
        else:
            dk, dv = _bwd_item(dk, dv, k_mine, v_mine, k_dq, q_smem, do_smem, ds_smem, dq_smem, lse_smem, dlt_smem,
                               cols_smem, q_ready, do_ready, qd_empty, ds_bar, v_empty, vb, it, n_it, dq_desc, s_zero,
                               dq_zero, qk2, cap_out, sm_scale, gi, s, ph, m, h, n, f0, f1, off_b, SEQ, SEQ,
                               WINDOW_LEFT, lse_smem, 0, WG, D, BLOCK_M, BLOCK_N, MASK, DQ_MODE, True, False, 0, 0, 0,
                               0, None, SOFTCAP, 0)
    if SEGMENTS:  # a tile of no item (a key block no query sees): no last dP^T releases V, so it goes back here
        mbarrier.arrive(v_empty.index(vb), count=1, pred=n_it == 0)
    # every wgmma of the tile has retired (each item ends with a full wait): K is free for the producer
    mbarrier.arrive(k_empty.index(kb), count=1)

    # epilogue: dK (scaled) and dV of this warpgroup's 64 keys
    _bwd_store_dkdv(dk, dv, dk_ptr, dv_ptr, off_b, off_hk, n, sm_scale, SEQ, HKV, WG, D, BLOCK_N, SEQ, 0, False)
    return n_it


@gluon.jit
def _pbwd_consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready,
                   qd_empty, k_ready, k_empty, v_ready, v_empty, ds_bar, tile_smem, tile_ready, tile_empty, dq_desc,
                   dk_ptr, dv_ptr, pid, sm_scale, cap, WINDOW_LEFT, WG: gl.constexpr, B: gl.constexpr, HQ: gl.constexpr,
                   HKV: gl.constexpr, SEQ: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                   MASK: gl.constexpr, DQ_MODE: gl.constexpr, TILE_STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
                   KSEG=None, RANGES=None, qs_smem=None, SEGMENTS: gl.constexpr = False):
    """Warpgroup WG's 64 keys of every tile of this program: dK, dV over the tile's query blocks (S^T, dP^T, P^T,
    dS^T; dV += P^T dO, dK += dS^T Q), its dS^T half into shared memory for the joint dQ = dS K (DQ_MODE 1: each
    warpgroup half of dQ's columns, 0: whole tiles alternating between the warpgroups), dQ * scale reduce-added
    into the float32 accumulator; V released after the tile's last dP^T, K after its last dQ; then dK * scale and
    dV stored. The tiles come from the producer through the tile ring, until an index >= the number of tiles."""
    N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
    BH: gl.constexpr = B * HKV
    s_zero, dq_zero = _bwd_zeros(BLOCK_M, BLOCK_N, D, DQ_MODE)
    qk2, cap_out = _scales(sm_scale, cap, SOFTCAP)

    g = pid * 0  # ring items consumed so far (all tiles): Q / dO stage and phase, dS buffer, join parity
    tc = pid * 0  # tiles done so far: K buffer tc % K_STAGES, V buffer tc % V_STAGES
    t = _pbwd_tile_take(tile_smem, tile_ready, tile_empty, tc, TILE_STAGES)
    while t < N_N * BH:
        if SEGMENTS:
            g += _pbwd_consumer_tile(t, g, tc, s_zero, dq_zero, qk2, cap_out, q_smem, do_smem, k_smem, v_smem,
                                     ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty,
                                     k_ready, k_empty, v_ready, v_empty, ds_bar, dq_desc, dk_ptr, dv_ptr, sm_scale,
                                     WINDOW_LEFT, WG, B, HQ, HKV, SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES,
                                     V_STAGES, MASK, DQ_MODE, SOFTCAP, KSEG, RANGES, qs_smem, SEGMENTS)
        else:
            g += _pbwd_consumer_tile(t, g, tc, s_zero, dq_zero, qk2, cap_out, q_smem, do_smem, k_smem, v_smem,
                                     ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty,
                                     k_ready, k_empty, v_ready, v_empty, ds_bar, dq_desc, dk_ptr, dv_ptr, sm_scale,
                                     WINDOW_LEFT, WG, B, HQ, HKV, SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES,
                                     V_STAGES, MASK, DQ_MODE, SOFTCAP)
        tc += 1
        t = _pbwd_tile_take(tile_smem, tile_ready, tile_empty, tc, TILE_STAGES)
    tma.store_wait(0)


@gluon.jit
def _pbwd_shared(Q, K, V, DO, F32, I32, DQ_ACC, B: gl.constexpr, SEQ: gl.constexpr, HQ: gl.constexpr,
                 HKV: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr, DQ_MODE: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                 TILE_STAGES: gl.constexpr):
    """The persistent backwards' scalars (scale, soft cap, the window's left reach, program id and count) and their
    descriptors, buffers and barriers (`_bwd_buffers`' and the K / V rings', dS^T's and the tile ring's), the barriers
    initialised and fenced."""
    gl.static_assert(DQ_MODE < 2, "DQ_MODE: 0 (whole dQ tiles alternating) or 1 (half of dQ's columns each)")
    gl.static_assert(BLOCK_N == 128, "two consumer warpgroups of 64 keys")
    sm_scale = gl.load(F32)
    cap = gl.load(F32 + 1)  # SOFTCAP (else unused)
    window_left = gl.load(I32)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    (q_desc, do_desc, k_desc, v_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, lse_smem, dlt_smem,
     cols_smem, q_ready, do_ready, qd_empty) = _bwd_buffers(Q, K, V, DO, DQ_ACC, B, SEQ, HQ, HKV, D, BLOCK_M, BLOCK_N,
                                                            NUM_STAGES, DQ_MODE, K_STAGES, V_STAGES, SEQ, SEQ, SEQ,
                                                            SEQ)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar_layout)
    ds_bar = gl.allocate_shared_memory(gl.int64, [1, 1], bar_layout)  # both dS^T halves written
    tile_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    tile_smem = gl.allocate_shared_memory(gl.int32, [TILE_STAGES, 1], tile_layout)
    tile_ready = gl.allocate_shared_memory(gl.int64, [TILE_STAGES, 1], bar_layout)
    tile_empty = gl.allocate_shared_memory(gl.int64, [TILE_STAGES, 1], bar_layout)
    for i in gl.static_range(TILE_STAGES):
        mbarrier.init(tile_ready.index(i), count=1)  # the producer's store
        mbarrier.init(tile_empty.index(i), count=2)  # both consumers read it
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=2)  # dO TMA (expect-tx) + the producer's lse / delta (/ id) stores
        mbarrier.init(qd_empty.index(i), count=2)  # both consumers
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(ds_bar.index(0), count=2)
    fence_async_shared()
    return (sm_scale, cap, window_left, pid, nprog, q_desc, do_desc, k_desc, v_desc, dq_desc, k_smem, v_smem, q_smem,
            do_smem, ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty, k_ready, k_empty,
            v_ready, v_empty, ds_bar, tile_smem, tile_ready, tile_empty)


@gluon.jit
def gluon_attention_bwd_persistent_kernel(Q, K, V, DO, LSE, DELTA, F32, I32, QSEG, KSEG, RANGES, ORDER, DQ_ACC, DK, DV,
                                          TILE_CTR, SCRATCH, B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
                                          SEQ: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                                          BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
                                          DQ_MODE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                          PRODUCER_REGS: gl.constexpr, V_STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
                                          SEGMENTS: gl.constexpr):
    """gluon_attention_bwd_kernel's arguments and results (dK, dV deterministic; dQ * scale reduce-added in float32
    into the zeroed DQ_ACC [B, SEQ, HQ, D]; LSE, DELTA [B, HQ, SEQ]; MASK 0 none, 1 causal, 2 causal with a window
    of I32[0] keys to the left; F32 = [scale, soft cap, ...]; SOFTCAP as there). Persistent: grid (P,), P <= the
    number of (key block, batch * kv head) tiles (`host.pbwd_grid`); 4 warps asked, 12 run (two consumers, a
    producer). Program pid's first tile is pid, each next one P + atomic_add(TILE_CTR, 1) (TILE_CTR: one int32, zero
    at launch, like DQ_ACC; left at the number of tiles fetched, so it must be zeroed again before the next launch).
    K double-buffered; V_STAGES (1 or 2) V buffers (`host.pbwd_v_stages`). Without SEGMENTS (a causal window) the
    tiles go in kv-head order (one (batch, kv head)'s key blocks back to back) and QSEG, KSEG, RANGES, ORDER are
    placeholders. SEGMENTS (packed documents, `host.PERSISTENT_SEGMENTS_BWD`; MASK 0 or 1: windows with segment ids
    walk lists, `host.listed`): QSEG, KSEG [B, SEQ] (int32, negative = padding), RANGES [B, cdiv(SEQ, BLOCK_N), 4]
    (each key block's query blocks under the ids, `host.segment_ranges(..., "bwd")`, joined with the mask's:
    `_pbwd_tile_range`) and ORDER [cdiv(SEQ, BLOCK_N) * B * HKV] (`host.bwd_order`: entries n * B * HKV + b * HKV +
    kv head, the most query blocks first), the places the counter hands out (longest-processing-time first); a
    masked item compares the ids as the per-program kernel does (`_bwd_item_mask`); a key block no query sees stores
    dK = dV = 0."""
    gl.static_assert(not SEGMENTS or MASK < 2, "windows with segment ids walk lists (host.listed)")
    K_STAGES: gl.constexpr = 2  # K is needed first in a tile and released last
    TILE_STAGES: gl.constexpr = 2  # the ring of tile indices, producer -> consumers (8 B + 4 barriers)
    (sm_scale, cap, WINDOW_LEFT, pid, nprog, q_desc, do_desc, k_desc, v_desc, dq_desc, k_smem, v_smem, q_smem, do_smem,
     ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty,
     ds_bar, tile_smem, tile_ready, tile_empty) = _pbwd_shared(Q, K, V, DO, F32, I32, DQ_ACC, B, SEQ, HQ, HKV, D,
                                                               BLOCK_M, BLOCK_N, NUM_STAGES, DQ_MODE, K_STAGES,
                                                               V_STAGES, TILE_STAGES)
    if SEGMENTS:  # the ring items' query rows' segment ids, staged by the producer next to their lse and delta rows
        ids_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        qs_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 1, BLOCK_M], ids_layout)
    else:
        qs_smem = tile_smem  # unused

    gl.warp_specialize([
        (_pbwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(0), lse_smem, dlt_smem, cols_smem,
                          q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, ds_bar.index(0), tile_smem,
                          tile_ready, tile_empty, dq_desc, DK, DV, pid, sm_scale, cap, WINDOW_LEFT, 0, B, HQ, HKV,
                          SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, DQ_MODE, TILE_STAGES,
                          SOFTCAP, KSEG, RANGES, qs_smem, SEGMENTS)),
        (_pbwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(1), lse_smem, dlt_smem, cols_smem,
                          q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, ds_bar.index(0), tile_smem,
                          tile_ready, tile_empty, dq_desc, DK, DV, pid, sm_scale, cap, WINDOW_LEFT, 1, B, HQ, HKV,
                          SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, DQ_MODE, TILE_STAGES,
                          SOFTCAP, KSEG, RANGES, qs_smem, SEGMENTS)),
        (_pbwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready,
                          do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, tile_smem, tile_ready, tile_empty,
                          TILE_CTR, LSE, DELTA, pid, nprog, WINDOW_LEFT, B, HQ, HKV, SEQ, D, BLOCK_M, BLOCK_N,
                          NUM_STAGES, K_STAGES, V_STAGES, MASK, TILE_STAGES, QSEG, RANGES, ORDER, qs_smem, SEGMENTS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
