"""Verified on an H200, not integrated (README.md: slower than the per-program backward on causal).

Persistent variant of ejgen.runtime.gluon_kernels.gluon_attention_bwd_kernel (Hopper, sm_90a). The grid is
(`grid`: min(#SMs, #tiles),); a tile is (key block n of BLOCK_N keys, batch * kv head), and program pid walks the
tiles t = pid, pid + nprog, ... The signature is the original's plus four constexprs (HEAD_GROUP, K_STAGES, V_STAGES,
EPI_TMA); the semantics are the same: MASK 0 / 1 / 2 (2: causal with a window of I32[0] keys to the left), DQ_MODE
0 / 1 (2, the second copy of K, is not supported: it does not fit next to a double-buffered K), the GQA loop inside
the program (dK / dV deterministic), ragged SEQ, LSE / DELTA inputs, dQ * scale reduce-added in float32 into the
zeroed DQ_ACC, dK scaled.

What changes against the per-program kernel (see README.md for the reasoning and the smem budget):
  * K and V get their own ready / empty barriers and K_STAGES / V_STAGES buffers; the producer loads tile tc's K
    into K buffer tc % K_STAGES and its V into V buffer tc % V_STAGES (parity (tc // STAGES) & 1). Both consumers
    release V right after their last dP^T of the tile has retired and K after their last dQ matmul, so the next
    tile's V (and, with one K buffer, its K) streams in under the tile's tail and epilogue; with two K buffers the
    next tile's K lands while the current tile runs (D=128: K_STAGES=2, V_STAGES=1 fill 225 KB of the 227).
  * The Q / dO / lse / delta ring, the dS double buffer and its join barrier count with one running item counter g
    over all the program's tiles (never reset), so the next tile's first Q / dO load while this tile ends.
  * Descriptors and barriers are made once per program.
  * EPI_TMA: dK / dV go registers -> the warpgroup's own dQ staging buffer -> bulk stores (clipped at SEQ by the
    descriptor) instead of masked stores from registers; the next write of that buffer already waits for its bulk
    reads (tma.store_wait before every dQ staging).
  * Registers (consumers at 240): the K / V views are made per item from `_opaque_zero` and the mask's column
    offsets are loaded from a 64-entry table in shared memory, so LLVM does not hoist ~40 loop-invariant values
    (wgmma descriptors, per-thread column indices) out of the item loop; the item loop counts with the running
    counter itself. ptxas -v: 0 spills for every compiled variant on Triton 3.6 and 3.9 (aot36.log, aot39.log).
Tile order (`_tile` of the forward, never reversed): sections of HEAD_GROUP (batch, kv head) pairs, key blocks slow
(ascending: under causal / window the smallest n has the most query blocks, so this is the longest-first order) and
heads fast. The key blocks of one kv head that run together share their query heads' Q / dO rows in L2;
`head_group` picks a section whose Q and dO fit in a part of L2.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

# the repository root is on sys.path (aot.py, run_gpu.py): the integrated kernels' helpers, tiles and registers
from ejgen.runtime import gluon_attention
from ejgen.runtime.gluon_kernels import _bwd_mask, _qblock_range, _tile, tma_load, tma_reduce_add, tma_store

SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)
SMEM_RESERVE = 1024  # kept free of tiles: barriers, the column table, warp-specialisation captures (784 B)
L2_QDO_BUDGET = 16 << 20  # bytes of Q and dO per head section (H100 / H200 L2: 50 MB)


# --- host side -------------------------------------------------------------------------------------------------

def smem_bytes(d: int, k_stages: int, v_stages: int, dq_mode: int, item: int = 2) -> int:
    """Shared memory of the tiles (no barriers): K and V buffers, the Q / dO ring, the dS double buffer, the two
    warpgroups' float32 dQ staging buffers, the lse / delta rows."""
    t = gluon_attention.BWD_TILES
    bm, bn, stages = t["BLOCK_M"], t["BLOCK_N"], t["NUM_STAGES"]
    dq_n = d if dq_mode == 0 else d // 2
    return ((k_stages + v_stages) * bn * d * item + 2 * stages * bm * d * item + 2 * bn * bm * item
            + 2 * bm * dq_n * 4 + 2 * stages * bm * 4)


def kv_stages(d: int, dq_mode: int, item: int = 2) -> tuple:
    """(K_STAGES, V_STAGES): two of each where they fit, else two K buffers (K is needed first in a tile and
    released last), else one of each."""
    for ks, vs in ((2, 2), (2, 1), (1, 1)):
        if smem_bytes(d, ks, vs, dq_mode, item) + SMEM_RESERVE <= SMEM_LIMIT:
            return ks, vs
    raise ValueError(f"head dim {d}: the backward's tiles do not fit in shared memory")


def head_group(batch: int, hq: int, hkv: int, seq: int, d: int, item: int = 2, budget: int = L2_QDO_BUDGET) -> int:
    """(batch, kv head) pairs per section of the tile order: as many as fit the Q and dO of their query heads (what
    every key block of a kv head reads) in `budget` bytes."""
    per_kv_head = 2 * (hq // hkv) * seq * d * item
    return max(1, min(batch * hkv, budget // per_kv_head))


def num_tiles(batch: int, hkv: int, seq: int) -> int:
    return -(-seq // gluon_attention.BWD_TILES["BLOCK_N"]) * batch * hkv


def grid(batch: int, hkv: int, seq: int, num_sms: int) -> tuple:
    """One program per SM, never more than there are tiles."""
    return (max(1, min(num_sms, num_tiles(batch, hkv, seq))), )


def constexprs(batch: int, hq: int, hkv: int, seq: int, d: int, causal: bool, window: bool, *,
               head_group_: int | None = None, epi_tma: bool = False, dynamic: bool = False, item: int = 2) -> dict:
    """ejgen.runtime.gluon_attention.bwd_constexprs, plus HEAD_GROUP (`head_group`'s choice unless head_group_ is
    given), K_STAGES, V_STAGES (`kv_stages`), EPI_TMA and DYNAMIC (the tile scheduler: 0 static round-robin, 1 a
    global atomic tile counter; the launch then passes a zeroed int32 TILE_CTR)."""
    base = gluon_attention.bwd_constexprs(batch, hq, hkv, seq, d, causal, window)
    ks, vs = kv_stages(d, base["DQ_MODE"], item)
    hg = head_group(batch, hq, hkv, seq, d, item) if head_group_ is None else head_group_
    return dict(base, HEAD_GROUP=hg, K_STAGES=ks, V_STAGES=vs, EPI_TMA=epi_tma, DYNAMIC=int(dynamic))


# --- device side -----------------------------------------------------------------------------------------------

@builtin
def _smem_reinterpret(buf, dtype, shape, layout, _semantic=None):
    """`buf` viewed with another dtype, shape and layout (Triton 3.6 names the method `_reinterpret`, 3.9
    `reinterpret`)."""
    if hasattr(buf, "reinterpret"):
        return buf.reinterpret(dtype, shape, layout, _semantic=_semantic)
    return buf._reinterpret(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def _opaque_zero():
    """0 from a volatile inline-asm move: LLVM cannot see through it nor hoist it out of a loop, so values computed
    from it inside the loop stay there (ptxas folds the move itself). The consumers derive their K / V views from
    it per item: hoisted, the views' wgmma descriptors (8 per operand) held ~24 registers across the loop."""
    return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_post(tile_smem, tile_ready, tile_empty, tc, t, TILE_STAGES: gl.constexpr):
    """Producer: tile index t of this program's tile tc into slot tc % TILE_STAGES of the tile ring (once both
    consumers read what it held, TILE_STAGES tiles ago), then tile_ready (its arrive releases the store)."""
    slot = tc % TILE_STAGES
    mbarrier.wait(tile_empty.index(slot), ((tc // TILE_STAGES) & 1) ^ 1)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_smem.index(slot).store(gl.full([1], t, gl.int32, layout=one_l))
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def _tile_take(tile_smem, tile_ready, tile_empty, tc, TILE_STAGES: gl.constexpr):
    """Consumer: the tile index of this program's tile tc from the tile ring (>= the number of tiles: stop); the
    slot is released at once (the value is in registers)."""
    slot = tc % TILE_STAGES
    mbarrier.wait(tile_ready.index(slot), (tc // TILE_STAGES) & 1)
    one_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    t = gl.max(tile_smem.index(slot).load(one_l), axis=0)
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return t


@gluon.jit
def _producer_tile(t, g, tc, tile_ctr, nprog, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem,
                   q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, lse_ptr, delta_ptr, WINDOW_LEFT,
                   B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr, D: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, K_STAGES: gl.constexpr,
                   V_STAGES: gl.constexpr, MASK: gl.constexpr, HEAD_GROUP: gl.constexpr, DYNAMIC: gl.constexpr):
    """Tile t, the program's tile tc, whose first ring item is g: its K and V, then its items' Q / dO / lse /
    delta. Returns the number of ring items of the tile and the program's next tile (DYNAMIC: nprog + a
    fetch-and-add on the tile counter; else t + nprog)."""
    GROUP: gl.constexpr = HQ // HKV
    N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
    BH: gl.constexpr = B * HKV
    ITEM: gl.constexpr = q_smem.dtype.primitive_bitwidth // 8
    KV_BYTES: gl.constexpr = BLOCK_N * D * ITEM
    QT_BYTES: gl.constexpr = BLOCK_M * D * ITEM
    row_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, BLOCK_M // 32], threads_per_warp=[1, 32],
                                           warps_per_cta=[1, 1], order=[1, 0])
    n, bh = _tile(t, N_N, BH, HEAD_GROUP, False)
    off_b = bh // HKV
    off_hk = bh % HKV
    m_lo, m_hi, f0, f1 = _qblock_range(n, SEQ, WINDOW_LEFT, BLOCK_M, BLOCK_N, MASK)
    nm = m_hi - m_lo
    kb = tc % K_STAGES
    mbarrier.wait(k_empty.index(kb), ((tc // K_STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(kb), KV_BYTES)
    tma_load(k_desc, [off_b, n * BLOCK_N, off_hk * D], k_ready.index(kb), k_smem.index(kb))
    if DYNAMIC:
        # the next tile. The warp waits for the atomic's result right away (one lane does it, a shuffle
        # broadcasts it), so it is made here, after K, just before the V wait, which usually blocks for longer
        # (this tile's V waits for the last dP^T of the previous tile); relaxed: only the count matters
        nxt = nprog + gl.atomic_add(tile_ctr, 1, sem="relaxed", scope="gpu")
    else:
        nxt = t + nprog
    vb = tc % V_STAGES
    mbarrier.wait(v_empty.index(vb), ((tc // V_STAGES) & 1) ^ 1)
    mbarrier.expect(v_ready.index(vb), KV_BYTES)
    tma_load(v_desc, [off_b, n * BLOCK_N, off_hk * D], v_ready.index(vb), v_smem.index(vb))
    for it in range(GROUP * nm):
        hq = it // nm
        m = m_lo + it % nm
        h = off_hk * GROUP + hq
        gi = g + it
        s = gi % NUM_STAGES
        ph = (gi // NUM_STAGES) & 1
        mbarrier.wait(qd_empty.index(s), ph ^ 1)
        mbarrier.expect(q_ready.index(s), QT_BYTES)
        tma_load(q_desc, [off_b, m * BLOCK_M, h * D], q_ready.index(s), q_smem.index(s))
        mbarrier.expect(do_ready.index(s), QT_BYTES)
        tma_load(do_desc, [off_b, m * BLOCK_M, h * D], do_ready.index(s), do_smem.index(s))
        # lse * log2(e) and delta rows of this query block: plain loads -> smem; do_ready counts this arrival
        rows = m * BLOCK_M + gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, row_l)), 0)
        rbase = (off_b * HQ + h).to(gl.int64) * SEQ
        lse = gl.load(lse_ptr + rbase + rows, mask=rows < SEQ, other=0.0)
        dlt = gl.load(delta_ptr + rbase + rows, mask=rows < SEQ, other=0.0)
        lse_smem.index(s).store(lse * 1.4426950408889634)
        dlt_smem.index(s).store(dlt)
        mbarrier.arrive(do_ready.index(s), count=1)
    return GROUP * nm, nxt


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready, do_ready,
              qd_empty, k_ready, k_empty, v_ready, v_empty, tile_smem, tile_ready, tile_empty, tile_ctr, lse_ptr,
              delta_ptr, pid, nprog, WINDOW_LEFT, B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
              SEQ: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, MASK: gl.constexpr,
              HEAD_GROUP: gl.constexpr, DYNAMIC: gl.constexpr, TILE_STAGES: gl.constexpr):
    """Per tile tc of this program: its K into K buffer tc % K_STAGES and its V into V buffer tc % V_STAGES (each
    once the consumers released the tile that held it before), then per (query head, query block) -- ring item g,
    counted over all tiles -- Q and dO by TMA into stage g % NUM_STAGES and the block's lse * log2 e and delta
    rows into shared memory. Empty barriers start free: waiting for the parity before their first phase returns at
    once. DYNAMIC 0: tiles pid, pid + nprog, ...; 1: the first tile is pid, each next one nprog + a fetch-and-add
    on the launch's zeroed tile counter, made after the current tile's K load (see _producer_tile); every tile index, and
    the final one (>= the number of tiles: stop), goes to the consumers through the tile ring."""
    N_T: gl.constexpr = ((SEQ + BLOCK_N - 1) // BLOCK_N) * B * HKV
    g = pid * 0  # ring items issued so far (all tiles of this program)
    tc = pid * 0  # tiles started so far
    if DYNAMIC:
        t = pid
        while t < N_T:
            _tile_post(tile_smem, tile_ready, tile_empty, tc, t, TILE_STAGES)
            n_it, nxt = _producer_tile(t, g, tc, tile_ctr, nprog, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem,
                                       k_smem, v_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty, k_ready,
                                       k_empty, v_ready, v_empty, lse_ptr, delta_ptr, WINDOW_LEFT, B, HQ, HKV, SEQ, D,
                                       BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, HEAD_GROUP, DYNAMIC)
            g += n_it
            tc += 1
            t = nxt
        _tile_post(tile_smem, tile_ready, tile_empty, tc, t, TILE_STAGES)  # the stop index
    else:
        for t in range(pid, N_T, nprog):
            n_it, nxt = _producer_tile(t, g, tc, tile_ctr, nprog, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem,
                                       k_smem, v_smem, lse_smem, dlt_smem, q_ready, do_ready, qd_empty, k_ready,
                                       k_empty, v_ready, v_empty, lse_ptr, delta_ptr, WINDOW_LEFT, B, HQ, HKV, SEQ, D,
                                       BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, HEAD_GROUP, DYNAMIC)
            g += n_it
            tc += 1


@gluon.jit
def _consumer_tile(t, g, tc, s_zero, dq_zero, qk2, dq_stage, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                   lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty,
                   ds_bar, dq_desc, dk_desc, dv_desc, dk_ptr, dv_ptr, sm_scale, WINDOW_LEFT, WG: gl.constexpr,
                   B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr, D: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, K_STAGES: gl.constexpr,
                   V_STAGES: gl.constexpr, MASK: gl.constexpr, DQ_MODE: gl.constexpr, HEAD_GROUP: gl.constexpr,
                   EPI_TMA: gl.constexpr):
    """Tile t, the program's tile tc whose first ring item is g, for warpgroup WG (see _consumer). Returns the
    number of ring items of the tile."""
    GROUP: gl.constexpr = HQ // HKV
    N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
    BH: gl.constexpr = B * HKV
    HALF: gl.constexpr = BLOCK_N // 2
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_N, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    n, bh = _tile(t, N_N, BH, HEAD_GROUP, False)
    off_b = bh // HKV
    off_hk = bh % HKV
    m_lo, m_hi, f0, f1 = _qblock_range(n, SEQ, WINDOW_LEFT, BLOCK_M, BLOCK_N, MASK)
    nm = m_hi - m_lo
    n_it = GROUP * nm  # >= 1: every key block below SEQ meets some query block
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
        q_view = q_smem.index(s).reshape([BLOCK_M, D])
        do_view = do_smem.index(s).reshape([BLOCK_M, D])

        # S^T and dP^T issued back to back; the exp of S^T runs while dP^T is on the tensor cores
        mbarrier.wait(q_ready.index(s), ph)
        st_tok = warpgroup_mma(k_mine, q_view.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(s), ph)
        dp_tok = warpgroup_mma(v_mine, do_view.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok, ))
        lse2 = lse_smem.index(s).load(s_layout)  # [1, BM]: lse * log2(e), written before do_ready
        pT = gl.exp2(st * qk2 - lse2)
        if (m < f0) | (m >= f1):
            # the query offsets of this thread's 16 columns come from shared memory (a load is not hoisted):
            # as an arange they would be hoisted out of the loop into 16 registers
            keys = n * BLOCK_N + WG * HALF + gl.arange(0, HALF, layout=row_l)
            rows = m * BLOCK_M + cols_smem.load(col_l)
            pT = _bwd_mask(pT, keys, rows, SEQ, WINDOW_LEFT, MASK)
        dpT = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        # the tile's last dP^T has retired: V is free for the producer (the next tile's V lands under the rest)
        mbarrier.arrive(v_empty.index(vb), count=1, pred=it == n_it - 1)
        dlt = dlt_smem.index(s).load(s_layout)  # [1, BM]
        dsT = (pT * (dpT - dlt)).to(dtype)
        pT16 = gl.convert_layout(pT.to(dtype), a_layout)
        dv_tok = warpgroup_mma(pT16, do_view, dv, is_async=True)
        dsT_a = gl.convert_layout(dsT, a_layout)
        dk_tok = warpgroup_mma(dsT_a, q_view, dk, is_async=True)
        # dS^T half -> smem for dQ (both warpgroups' halves are needed); buffer and join parity from g
        ds_buf = ds_smem.index(gi % 2)
        ds_buf.slice(WG * HALF, HALF, dim=0).store(dsT)
        fence_async_shared()
        mbarrier.arrive(ds_bar, count=1)
        mbarrier.wait(ds_bar, gi & 1)  # both halves of dS_i are in smem
        if DQ_MODE == 0:
            if (gi % 2) == WG:
                dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_dq, dq_zero, use_acc=False, is_async=True)
                dq, dv, pT16, dk, dsT_a = warpgroup_mma_wait(num_outstanding=0,
                                                             deps=(dq_tok, dv_tok, pT16, dk_tok, dsT_a))
                mbarrier.arrive(qd_empty.index(s), count=1)
                tma.store_wait(0)  # the previous bulk copy out of dq_stage has read it
                dq_stage.store(dq * sm_scale)
                fence_async_shared()
                tma_reduce_add(dq_desc, [off_b, m * BLOCK_M, h * D], dq_smem)
            else:
                dv, pT16, dk, dsT_a = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, pT16, dk_tok, dsT_a))
                mbarrier.arrive(qd_empty.index(s), count=1)
        else:
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_dq, dq_zero, use_acc=False, is_async=True)
            dq, dv, pT16, dk, dsT_a = warpgroup_mma_wait(num_outstanding=0,
                                                         deps=(dq_tok, dv_tok, pT16, dk_tok, dsT_a))
            mbarrier.arrive(qd_empty.index(s), count=1)
            tma.store_wait(0)
            dq_stage.store(dq * sm_scale)
            fence_async_shared()
            tma_reduce_add(dq_desc, [off_b, m * BLOCK_M, h * D + WG * DQ_N], dq_smem)
    # every wgmma of the tile has retired (each item ends with a full wait): K is free for the producer
    mbarrier.arrive(k_empty.index(kb), count=1)

    # epilogue: dK (scaled) and dV of this warpgroup's 64 keys
    if EPI_TMA:
        _epilogue_tma(dk * sm_scale, dv, dq_smem, dk_desc, dv_desc, off_b, n * BLOCK_N + WG * HALF, off_hk * D,
                      HALF, D, BLOCK_M, DQ_N)
    else:
        r_o = n * BLOCK_N + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
        c_o = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        offs = ((off_b * SEQ + gl.expand_dims(r_o, 1)).to(gl.int64) * HKV + off_hk) * D + gl.expand_dims(c_o, 0)
        omask = (gl.expand_dims(r_o, 1) < SEQ) & (gl.expand_dims(c_o, 0) < D)
        gl.store(dk_ptr + offs, (dk * sm_scale).to(dtype), mask=omask)
        gl.store(dv_ptr + offs, dv.to(dtype), mask=omask)
    return n_it


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready,
              qd_empty, k_ready, k_empty, v_ready, v_empty, ds_bar, tile_smem, tile_ready, tile_empty, dq_desc, dk_desc,
              dv_desc, dk_ptr, dv_ptr, pid, nprog, sm_scale, WINDOW_LEFT, WG: gl.constexpr, B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr,
              SEQ: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, MASK: gl.constexpr,
              DQ_MODE: gl.constexpr, HEAD_GROUP: gl.constexpr, EPI_TMA: gl.constexpr, DYNAMIC: gl.constexpr,
              TILE_STAGES: gl.constexpr):
    """Warpgroup WG's 64 keys of every tile of this program: dK, dV over the tile's query blocks (S^T, dP^T, P^T,
    dS^T; dV += P^T dO, dK += dS^T Q), its dS^T half into shared memory for the joint dQ = dS K (DQ_MODE 1: each
    warpgroup half of dQ's columns, 0: whole tiles alternating between the warpgroups), dQ * scale reduce-added
    into the float32 accumulator; V released after the tile's last dP^T, K after its last dQ; then dK * scale and
    dV stored (EPI_TMA: by bulk stores through this warpgroup's dQ staging buffer). DYNAMIC 1: the tiles
    come from the producer through the tile ring, until an index >= the number of tiles."""
    N_N: gl.constexpr = (SEQ + BLOCK_N - 1) // BLOCK_N
    BH: gl.constexpr = B * HKV
    HALF: gl.constexpr = BLOCK_N // 2
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_N, 16])
    dq_stage = dq_smem.reshape([BLOCK_M, DQ_N])
    s_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_N], gl.float32, layout=dq_layout)
    qk2 = sm_scale * 1.4426950408889634

    g = pid * 0  # ring items consumed so far (all tiles): Q / dO stage and phase, dS buffer, join parity
    tc = pid * 0  # tiles done so far: K buffer tc % K_STAGES, V buffer tc % V_STAGES
    if DYNAMIC:
        t = _tile_take(tile_smem, tile_ready, tile_empty, tc, TILE_STAGES)
        while t < N_N * BH:
            g += _consumer_tile(t, g, tc, s_zero, dq_zero, qk2, dq_stage, q_smem, do_smem, k_smem, v_smem, ds_smem,
                                dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready,
                                v_empty, ds_bar, dq_desc, dk_desc, dv_desc, dk_ptr, dv_ptr, sm_scale, WINDOW_LEFT, WG,
                                B, HQ, HKV, SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, DQ_MODE,
                                HEAD_GROUP, EPI_TMA)
            tc += 1
            t = _tile_take(tile_smem, tile_ready, tile_empty, tc, TILE_STAGES)
    else:
        for t in range(pid, N_N * BH, nprog):
            g += _consumer_tile(t, g, tc, s_zero, dq_zero, qk2, dq_stage, q_smem, do_smem, k_smem, v_smem, ds_smem,
                                dq_smem, lse_smem, dlt_smem, cols_smem, q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready,
                                v_empty, ds_bar, dq_desc, dk_desc, dv_desc, dk_ptr, dv_ptr, sm_scale, WINDOW_LEFT, WG,
                                B, HQ, HKV, SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, DQ_MODE,
                                HEAD_GROUP, EPI_TMA)
            tc += 1
    tma.store_wait(0)


@gluon.jit
def _epilogue_tma(dk, dv, dq_smem, dk_desc, dv_desc, off_b, row0, col0, HALF: gl.constexpr, D: gl.constexpr,
                  BLOCK_M: gl.constexpr, DQ_N: gl.constexpr):
    """dK and dV ([HALF, D] float32 accumulators) -> 16-bit -> this warpgroup's dQ staging buffer -> bulk stores at
    (off_b, row0, col0). Both at once where they fit in the buffer (head dim 64), else dK, a wait for its bulk
    read, then dV. Rows past SEQ are clipped by the descriptors. Not waited for here: the next write of the buffer
    (a dQ staging) waits for every earlier bulk read first."""
    dtype: gl.constexpr = dk_desc.dtype
    o_layout: gl.constexpr = dk_desc.layout
    BOTH: gl.constexpr = 2 * HALF * D * (dtype.primitive_bitwidth // 8) <= BLOCK_M * DQ_N * 4
    if BOTH:
        o_bufs = _smem_reinterpret(dq_smem, dtype, [2, 1, HALF, D], o_layout)
        dk_buf = o_bufs.index(0)
        dv_buf = o_bufs.index(1)
    else:
        dk_buf = _smem_reinterpret(dq_smem, dtype, [1, HALF, D], o_layout)
        dv_buf = dk_buf
    tma.store_wait(0)  # the last dQ reduce-add from this buffer has read it
    dk_buf.reshape([HALF, D]).store(dk.to(dtype))
    fence_async_shared()
    tma_store(dk_desc, [off_b, row0, col0], dk_buf)
    if not BOTH:
        tma.store_wait(0)
    dv_buf.reshape([HALF, D]).store(dv.to(dtype))
    fence_async_shared()
    tma_store(dv_desc, [off_b, row0, col0], dv_buf)


@gluon.jit
def gluon_persistent_bwd_kernel(Q, K, V, DO, LSE, DELTA, F32, I32, DQ_ACC, DK, DV, TILE_CTR, SCRATCH,
                                B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr,
                                D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                NUM_STAGES: gl.constexpr, MASK: gl.constexpr, DQ_MODE: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, HEAD_GROUP: gl.constexpr,
                                K_STAGES: gl.constexpr, V_STAGES: gl.constexpr, EPI_TMA: gl.constexpr,
                                DYNAMIC: gl.constexpr):
    """gluon_attention_bwd_kernel's arguments and results (dK, dV deterministic; dQ * scale reduce-added in float32
    into the zeroed DQ_ACC [B, SEQ, HQ, D]; LSE, DELTA [B, HQ, SEQ]; MASK 0 none, 1 causal, 2 causal with a window
    of I32[0] keys to the left; F32 = [scale, ...]). Persistent: grid (P,), P <= the number of (key block, batch *
    kv head) tiles (`grid`); 4 warps asked, 12 run (two consumers, a producer). HEAD_GROUP: (batch, kv head) pairs
    per section of the tile order; K_STAGES / V_STAGES (1 or 2): K and V buffers (`kv_stages`); EPI_TMA: dK / dV
    by bulk stores. DYNAMIC 0: program pid takes tiles pid, pid + P, ...; 1: the first tile is pid, then each
    next one is P + atomic_add(TILE_CTR, 1) (TILE_CTR: one int32, zero at launch, like DQ_ACC; left at the number
    of tiles done by dynamic fetch, so it must be zeroed again before the next launch)."""
    gl.static_assert(DQ_MODE < 2, "DQ_MODE 2 (a second copy of K) is not supported by the persistent backward")
    gl.static_assert(BLOCK_N == 128, "two consumer warpgroups of 64 keys")
    sm_scale = gl.load(F32)
    WINDOW_LEFT = gl.load(I32)
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF: gl.constexpr = BLOCK_N // 2
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    if DQ_MODE == 0:
        DQ_N: gl.constexpr = D
    else:
        DQ_N: gl.constexpr = D // 2
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, DQ_N], gl.float32)

    q_desc = tma.make_tensor_descriptor(Q, shape=[B, SEQ, HQ * D], strides=[SEQ * (HQ * D), HQ * D, 1],
                                        block_shape=[1, BLOCK_M, D], layout=q_layout)
    do_desc = tma.make_tensor_descriptor(DO, shape=[B, SEQ, HQ * D], strides=[SEQ * (HQ * D), HQ * D, 1],
                                         block_shape=[1, BLOCK_M, D], layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[B, SEQ, HKV * D], strides=[SEQ * (HKV * D), HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[B, SEQ, HKV * D], strides=[SEQ * (HKV * D), HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC, shape=[B, SEQ, HQ * D], strides=[SEQ * (HQ * D), HQ * D, 1],
                                         block_shape=[1, BLOCK_M, DQ_N], layout=dq_layout)
    if EPI_TMA:  # dK / dV tiles of one warpgroup (64 keys)
        o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HALF, D], dtype)
        dk_desc = tma.make_tensor_descriptor(DK, shape=[B, SEQ, HKV * D], strides=[SEQ * (HKV * D), HKV * D, 1],
                                             block_shape=[1, HALF, D], layout=o_layout)
        dv_desc = tma.make_tensor_descriptor(DV, shape=[B, SEQ, HKV * D], strides=[SEQ * (HKV * D), HKV * D, 1],
                                             block_shape=[1, HALF, D], layout=o_layout)
    else:
        dk_desc = dq_desc  # unused
        dv_desc = dq_desc

    k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, 1, BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, 1, BLOCK_N, D], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, D], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_M, D], q_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, DQ_N], dq_layout)
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], row_layout)
    dlt_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], row_layout)
    # 0 .. BLOCK_M - 1: the consumers' masks read their column offsets from here (see _consumer)
    cols_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    cols_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_M], cols_layout)
    cols_smem.store(gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0])))

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar_layout)
    ds_bar = gl.allocate_shared_memory(gl.int64, [1, 1], bar_layout)  # both dS^T halves written
    # DYNAMIC: the ring of tile indices, producer -> consumers (8 B + 4 barriers)
    TILE_STAGES: gl.constexpr = 2
    tile_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    tile_smem = gl.allocate_shared_memory(gl.int32, [TILE_STAGES, 1], tile_layout)
    tile_ready = gl.allocate_shared_memory(gl.int64, [TILE_STAGES, 1], bar_layout)
    tile_empty = gl.allocate_shared_memory(gl.int64, [TILE_STAGES, 1], bar_layout)
    if DYNAMIC:
        for i in gl.static_range(TILE_STAGES):
            mbarrier.init(tile_ready.index(i), count=1)  # the producer's store
            mbarrier.init(tile_empty.index(i), count=2)  # both consumers read it
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=2)  # dO TMA (expect-tx) + the producer's lse/delta stores
        mbarrier.init(qd_empty.index(i), count=2)  # both consumers
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(ds_bar.index(0), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(0), lse_smem, dlt_smem, cols_smem,
                     q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, ds_bar.index(0), tile_smem, tile_ready,
                     tile_empty, dq_desc, dk_desc, dv_desc, DK, DV, pid, nprog, sm_scale, WINDOW_LEFT, 0, B, HQ, HKV,
                     SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, DQ_MODE, HEAD_GROUP, EPI_TMA,
                     DYNAMIC, TILE_STAGES)),
        (_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem.index(1), lse_smem, dlt_smem, cols_smem,
                     q_ready, do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, ds_bar.index(0), tile_smem, tile_ready,
                     tile_empty, dq_desc, dk_desc, dv_desc, DK, DV, pid, nprog, sm_scale, WINDOW_LEFT, 1, B, HQ, HKV,
                     SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES, V_STAGES, MASK, DQ_MODE, HEAD_GROUP, EPI_TMA,
                     DYNAMIC, TILE_STAGES)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, dlt_smem, q_ready,
                     do_ready, qd_empty, k_ready, k_empty, v_ready, v_empty, tile_smem, tile_ready, tile_empty, TILE_CTR,
                     LSE, DELTA, pid, nprog, WINDOW_LEFT, B, HQ, HKV, SEQ, D, BLOCK_M, BLOCK_N, NUM_STAGES, K_STAGES,
                     V_STAGES, MASK, HEAD_GROUP, DYNAMIC, TILE_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
