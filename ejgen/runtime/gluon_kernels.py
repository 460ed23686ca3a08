"""The Gluon kernel of `gluon_attention` (imported only where it runs or is compiled: it needs Triton's Gluon).

Triton 3.6 names the bulk copies async_copy_global_to_shared / async_copy_shared_to_global, 3.9 async_load /
async_store (the old names raise there): `tma_load` / `tma_store` are whichever this Triton has.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _blocks(q_lo, left, right, SEQ: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
            CAUSAL: gl.constexpr, WINDOW: gl.constexpr):
    """Key blocks [lo, hi) meeting the visible band of query rows [q_lo, q_lo + ROWS), and [f0, f1): the
    blocks visible to every one of those rows and inside the sequence (no element mask)."""
    q_hi = q_lo + ROWS
    hi_key = q_lo * 0 + SEQ
    lo_key = q_lo * 0
    fe = q_lo * 0 + SEQ // BLOCK_N  # blocks below fe have no key past a row's reach (nor past SEQ)
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
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
              off_b, q_row0, q_col, kv_col, lo, hi, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, NUM_STAGES: gl.constexpr, ITEM: gl.constexpr):
    """The two Q halves, then the K/V ring (ITEM: bytes per element). An empty barrier starts free: waiting
    for the parity before its first phase returns at once."""
    mbarrier.expect(q_bar.index(0), ROWS * D * ITEM)
    tma_load(q_desc, [off_b, q_row0, q_col], q_bar.index(0), q_smem.index(0))
    mbarrier.expect(q_bar.index(1), ROWS * D * ITEM)
    tma_load(q_desc, [off_b, q_row0 + ROWS, q_col], q_bar.index(1), q_smem.index(1))
    for it in range(hi - lo):
        j = lo + it
        idx = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        mbarrier.wait(k_empty.index(idx), phase ^ 1)
        mbarrier.expect(k_ready.index(idx), BLOCK_N * D * ITEM)
        tma_load(k_desc, [off_b, j * BLOCK_N, kv_col], k_ready.index(idx), k_smem.index(idx))
        mbarrier.wait(v_empty.index(idx), phase ^ 1)
        mbarrier.expect(v_ready.index(idx), BLOCK_N * D * ITEM)
        tma_load(v_desc, [off_b, j * BLOCK_N, kv_col], v_ready.index(idx), v_smem.index(idx))

@gluon.jit
def _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, MASKED: gl.constexpr, SEQ: gl.constexpr,
             CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
             s_layout: gl.constexpr):
    """Online softmax of one block in exp2 (scale * log2 e folded in): (p, alpha, m, l)."""
    if MASKED:
        rows = q_row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        c2 = gl.expand_dims(cols, 0)
        dist = c2 - gl.expand_dims(rows, 1)  # key - query
        keep = c2 < SEQ
        if CAUSAL:
            keep = keep & (dist <= 0)
        if WINDOW:
            keep = keep & (dist >= -left) & (dist <= right)
        s = gl.where(keep, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)  # a row with no visible key yet: no inf - inf
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, o_desc, lse_ptr, off_b, off_h,
              q_row0, q_col, lo, hi, f0, f1, left, right, qk_scale, turn_mine, turn_other,
              HQ: gl.constexpr, SEQ: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, PP_SYNC: gl.constexpr,
              FIRST: gl.constexpr):
    """One 64-row half: the pipelined loop (softmax of block j under P_{j-1} V_{j-1}), then the epilogue."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_view = q_smem.reshape([ROWS, D])
    m_i = gl.full([ROWS], -float("inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    n = hi - lo

    # block lo: S only
    if PP_SYNC:
        mbarrier.wait(turn_mine, 1 if FIRST else 0)  # the first consumer goes at once
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_view, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    if PP_SYNC:
        mbarrier.arrive(turn_other, count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    if (lo < f0) | (f1 <= lo):
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, lo, q_row0, left, right, qk_scale, True, SEQ, CAUSAL, WINDOW,
                                      ROWS, BLOCK_N, s_layout)
    else:
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, lo, q_row0, left, right, qk_scale, False, SEQ, CAUSAL, WINDOW,
                                      ROWS, BLOCK_N, s_layout)
    p16 = gl.convert_layout(p.to(dtype), p_layout)

    # block j: issue S_j and P_{j-1} V_{j-1}; the softmax of S_j runs while the second is in flight
    for it in range(1, n):
        j = lo + it
        idx = it % NUM_STAGES
        phase = (it // NUM_STAGES) & 1
        prev = (it - 1) % NUM_STAGES
        prev_phase = ((it - 1) // NUM_STAGES) & 1
        if PP_SYNC:
            mbarrier.wait(turn_mine, (it + (1 if FIRST else 0)) & 1)
        mbarrier.wait(k_ready.index(idx), phase)
        s_tok = warpgroup_mma(q_view, k_smem.index(idx).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        acc_tok = warpgroup_mma(p16, v_smem.index(prev).reshape([BLOCK_N, D]), acc, is_async=True)
        if PP_SYNC:
            mbarrier.arrive(turn_other, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(idx), count=1)
        if (j < f0) | (f1 <= j):
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, True, SEQ, CAUSAL,
                                          WINDOW, ROWS, BLOCK_N, s_layout)
        else:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, q_row0, left, right, qk_scale, False, SEQ, CAUSAL,
                                          WINDOW, ROWS, BLOCK_N, s_layout)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p16))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)

    # the last P V
    last = (n - 1) % NUM_STAGES
    mbarrier.wait(v_ready.index(last), ((n - 1) // NUM_STAGES) & 1)
    acc_tok = warpgroup_mma(p16, v_smem.index(last).reshape([BLOCK_N, D]), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p16))
    mbarrier.arrive(v_empty.index(last), count=1)

    # epilogue: O / l through this half's Q buffer (consumed), lse = (m + log2 l) ln 2
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    o = (acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)).to(dtype)
    rows = q_row0 + gl.arange(0, ROWS, layout=row_o)
    lse = gl.convert_layout((m_i + gl.log2(l_safe)) * 0.6931471805599453, row_o)
    gl.store(lse_ptr + (off_b * HQ + off_h).to(gl.int64) * SEQ + rows, lse, mask=rows < SEQ)
    q_smem.reshape([ROWS, D]).store(o)
    fence_async_shared()
    tma_store(o_desc, [off_b, q_row0, q_col], q_smem)
    tma.store_wait(0)

@gluon.jit
def gluon_attention_fwd_kernel(Q, K, V, F32, I32, O, LSE, SCRATCH,
                               B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr,
                               D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                               PP_SYNC: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Q [B, SEQ, HQ, D], K and V [B, SEQ, HKV, D] -> O like Q, LSE [B, HQ, SEQ] (float32). F32 = [scale,
    ...], I32 = [window left, window right, ...]; SCRATCH: the descriptors' global scratch."""
    ROWS: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    i_m = gl.program_id(0)
    if CAUSAL:  # the longest rows first: less idle tail
        i_m = gl.num_programs(0) - 1 - i_m
    i_bh = gl.program_id(1)
    off_b = i_bh // HQ
    off_h = i_bh % HQ
    off_hk = off_h // (HQ // HKV)
    qk_scale = gl.load(F32) * 1.4426950408889634
    left = gl.load(I32)
    right = gl.load(I32 + 1)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, ROWS, D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, D], dtype)
    q_desc = tma.make_tensor_descriptor(Q, shape=[B, SEQ, HQ * D], strides=[SEQ * HQ * D, HQ * D, 1],
                                        block_shape=[1, ROWS, D], layout=q_layout)
    o_desc = tma.make_tensor_descriptor(O, shape=[B, SEQ, HQ * D], strides=[SEQ * HQ * D, HQ * D, 1],
                                        block_shape=[1, ROWS, D], layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[B, SEQ, HKV * D], strides=[SEQ * HKV * D, HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[B, SEQ, HKV * D], strides=[SEQ * HKV * D, HKV * D, 1],
                                        block_shape=[1, BLOCK_N, D], layout=kv_layout)

    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, ROWS, D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, BLOCK_N, D], kv_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()

    q_row0 = i_m * BLOCK_M
    lo, hi, f0, f1 = _blocks(q_row0, left, right, SEQ, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    gl.warp_specialize([
        (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar.index(0), k_ready, v_ready, k_empty, v_empty, o_desc,
                     LSE, off_b, off_h, q_row0, off_h * D, lo, hi, f0, f1, left, right, qk_scale, turn.index(0),
                     turn.index(1), HQ, SEQ, ROWS, BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW, PP_SYNC, True)),
        (_consumer, (q_smem.index(1), k_smem, v_smem, q_bar.index(1), k_ready, v_ready, k_empty, v_empty, o_desc,
                     LSE, off_b, off_h, q_row0 + ROWS, off_h * D, lo, hi, f0, f1, left, right, qk_scale,
                     turn.index(1), turn.index(0), HQ, SEQ, ROWS, BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW, PP_SYNC,
                     False)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                     off_b, q_row0, off_h * D, off_hk * D, lo, hi, ROWS, BLOCK_N, D, NUM_STAGES,
                     dtype.primitive_bitwidth // 8)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
