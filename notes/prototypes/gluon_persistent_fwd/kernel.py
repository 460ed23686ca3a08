"""UNVERIFIED PROTOTYPE (compile-only); not imported by ejgen.

Persistent variant of ejgen.runtime.gluon_kernels.gluon_attention_fwd_kernel (Hopper, sm_90a): grid = (number of
SMs,), each program walks the tiles t = pid, pid + nprog, ... of all (query tile of 128 rows, batch * head) pairs.
Same signature (plus one optional constexpr, HEAD_GROUP) and semantics: causal / window / none, GQA, ragged SEQ
(TMA zero-fill / store clipping), lse in natural log, -inf on rows that see no key.

Cross-tile synchronisation (see README.md for the full reasoning):
  * K/V ring: producer and both consumers count K/V blocks with one running counter g over all the program's
    tiles (stage g % NUM_STAGES, phase (g // NUM_STAGES) & 1), never reset per tile.
  * Q: two buffer sets (4 x 64 rows; tile number tc of this program uses set tc % 2), each half with a q_ready and
    a q_empty barrier (parity (tc // 2) & 1). The producer loads tile tc+1's Q halves while tile tc is being
    computed; it refills set tc % 2 (tile tc+2) only after q_empty, which the consumer arrives after its O bulk
    store out of that buffer has been read (store_wait) -- the O epilogue goes through the consumer's own Q buffer.
  * PP_SYNC turn token: the phase is taken from the same running block counter g (first consumer waits
    (g + 1) & 1, second g & 1), so the alternation continues across tiles.
  * Descriptors and barriers are made once per program.
Tile order (`_tile`): heads are cut into sections of HEAD_GROUP (batch*head) pairs; within a section query tiles
are the slow index (reversed for causal: heaviest first, the longest-processing-time order) and heads the fast
one. HEAD_GROUP = 1 is the original grid's order (one head's query tiles in a row: best K/V reuse in L2);
HEAD_GROUP = B*HQ is the global LPT order. `head_group` picks a section whose K/V fit in a part of L2.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

# the tile range and the softmax step are the integrated kernel's own (the repository root is on sys.path: aot.py,
# run_gpu.py)
from ejgen.runtime.gluon_kernels import _blocks, _softmax, tma_load, tma_store  # noqa: E402

cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6: thread_barrier, 3.9: barrier

from ejgen.runtime import gluon_attention  # noqa: E402  (tiles and registers: the integrated kernel's)

BLOCK_M = gluon_attention.BLOCK_M
L2_KV_BUDGET = 16 << 20  # bytes of K and V per head section (H100/H200 L2: 50 MB)


def head_group(batch: int, hq: int, hkv: int, seq: int, d: int, item: int = 2, budget: int = L2_KV_BUDGET) -> int:
    """(batch, head) pairs per tile section: as many kv heads as fit K and V in `budget` bytes, times the query
    heads per kv head (consecutive query heads share a kv head)."""
    kv_heads = max(1, budget // (2 * seq * d * item))
    return max(1, min(batch * hq, kv_heads * (hq // hkv)))


def constexprs(batch: int, hq: int, hkv: int, seq: int, d: int, causal: bool, window: bool) -> dict:
    """ejgen.runtime.gluon_attention.constexprs, plus HEAD_GROUP."""
    return dict(gluon_attention.constexprs(batch, hq, hkv, seq, d, causal, window),
                HEAD_GROUP=head_group(batch, hq, hkv, seq, d))


def num_tiles(batch: int, hq: int, seq: int) -> int:
    return -(-seq // BLOCK_M) * batch * hq


def grid(batch: int, hq: int, seq: int, num_sms: int) -> tuple:
    return (max(1, min(num_sms, num_tiles(batch, hq, seq))), )


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
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              pid, nprog, left, right, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr, N_M: gl.constexpr,
              BH: gl.constexpr, HS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, ITEM: gl.constexpr):
    """Per tile: its two Q halves into Q set tc % 2 (once the consumers released that set, two tiles ago), then
    its K/V blocks into the ring. Empty barriers start free: waiting for the parity before their first phase
    returns at once."""
    ROWS: gl.constexpr = BLOCK_M // 2
    g = pid * 0  # K/V blocks issued so far (all tiles of this program)
    tc = pid * 0  # tiles started so far
    for t in range(pid, N_M * BH, nprog):
        i_m, bh = _tile(t, N_M, BH, HS, CAUSAL)
        off_b = bh // HQ
        off_h = bh % HQ
        kv_col = (off_h // (HQ // HKV)) * D
        q_row0 = i_m * BLOCK_M
        lo, hi, f0, f1 = _blocks(q_row0, left, right, SEQ, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
        qb = (tc % 2) * 2
        q_phase = (tc // 2) & 1
        for h in gl.static_range(2):
            mbarrier.wait(q_empty.index(qb + h), q_phase ^ 1)
            mbarrier.expect(q_ready.index(qb + h), ROWS * D * ITEM)
            tma_load(q_desc, [off_b, q_row0 + h * ROWS, off_h * D], q_ready.index(qb + h), q_smem.index(qb + h))
        for it in range(hi - lo):
            j = lo + it
            gi = g + it
            idx = gi % NUM_STAGES
            phase = (gi // NUM_STAGES) & 1
            mbarrier.wait(k_empty.index(idx), phase ^ 1)
            mbarrier.expect(k_ready.index(idx), BLOCK_N * D * ITEM)
            tma_load(k_desc, [off_b, j * BLOCK_N, kv_col], k_ready.index(idx), k_smem.index(idx))
            mbarrier.wait(v_empty.index(idx), phase ^ 1)
            mbarrier.expect(v_ready.index(idx), BLOCK_N * D * ITEM)
            tma_load(v_desc, [off_b, j * BLOCK_N, kv_col], v_ready.index(idx), v_smem.index(idx))
        g += hi - lo
        tc += 1


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, lse_ptr, pid,
              nprog, left, right, qk_scale, turn_mine, turn_other, HQ: gl.constexpr, SEQ: gl.constexpr,
              N_M: gl.constexpr, BH: gl.constexpr, HS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              PP_SYNC: gl.constexpr, HALF: gl.constexpr):
    """One 64-row half (HALF 0: the first to issue) of every tile of this program: the pipelined loop (softmax
    of block j under P_{j-1} V_{j-1}), then the epilogue through this half's Q buffer of the tile."""
    ROWS: gl.constexpr = BLOCK_M // 2
    TURN0: gl.constexpr = 1 if HALF == 0 else 0  # the first consumer's first wait passes at once
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    g = pid * 0  # K/V blocks consumed so far (all tiles of this program): ring stage / phase and turn phase
    tc = pid * 0  # tiles done so far: Q set tc % 2, parity (tc // 2) & 1
    for t in range(pid, N_M * BH, nprog):
        i_m, bh = _tile(t, N_M, BH, HS, CAUSAL)
        off_b = bh // HQ
        off_h = bh % HQ
        lo, hi, f0, f1 = _blocks(i_m * BLOCK_M, left, right, SEQ, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
        q_row0 = i_m * BLOCK_M + HALF * ROWS
        qi = (tc % 2) * 2 + HALF
        q_buf = q_smem.index(qi)
        q_view = q_buf.reshape([ROWS, D])
        m_i = gl.full([ROWS], -float("inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
        n = hi - lo  # >= 1: every row sees its own key (left, right >= 0)
        mbarrier.wait(q_ready.index(qi), (tc // 2) & 1)

        # block lo: S only
        idx = g % NUM_STAGES
        if PP_SYNC:
            mbarrier.wait(turn_mine, (g + TURN0) & 1)
        mbarrier.wait(k_ready.index(idx), (g // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q_view, k_smem.index(idx).reshape([BLOCK_N, D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        if PP_SYNC:
            mbarrier.arrive(turn_other, count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(idx), count=1)
        if (lo < f0) | (f1 <= lo):
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, lo, q_row0, left, right, qk_scale, True, SEQ, CAUSAL,
                                          WINDOW, ROWS, BLOCK_N, s_layout)
        else:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, lo, q_row0, left, right, qk_scale, False, SEQ, CAUSAL,
                                          WINDOW, ROWS, BLOCK_N, s_layout)
        p16 = gl.convert_layout(p.to(dtype), p_layout)

        # block j: issue S_j and P_{j-1} V_{j-1}; the softmax of S_j runs while the second is in flight
        for it in range(1, n):
            j = lo + it
            gi = g + it
            idx = gi % NUM_STAGES
            phase = (gi // NUM_STAGES) & 1
            prev = (gi - 1) % NUM_STAGES
            prev_phase = ((gi - 1) // NUM_STAGES) & 1
            if PP_SYNC:
                mbarrier.wait(turn_mine, (gi + TURN0) & 1)
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
        gl_ = g + n - 1
        last = gl_ % NUM_STAGES
        mbarrier.wait(v_ready.index(last), (gl_ // NUM_STAGES) & 1)
        acc_tok = warpgroup_mma(p16, v_smem.index(last).reshape([BLOCK_N, D]), acc, is_async=True)
        acc, p16 = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p16))
        mbarrier.arrive(v_empty.index(last), count=1)

        # epilogue: O / l through this half's Q buffer (its wgmmas have all retired), lse = (m + log2 l) ln 2
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = (acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)).to(dtype)
        rows = q_row0 + gl.arange(0, ROWS, layout=row_o)
        lse = gl.convert_layout((m_i + gl.log2(l_safe)) * 0.6931471805599453, row_o)
        gl.store(lse_ptr + bh.to(gl.int64) * SEQ + rows, lse, mask=rows < SEQ)
        q_view.store(o)
        fence_async_shared()
        tma_store(o_desc, [off_b, q_row0, off_h * D], q_buf)
        tma.store_wait(0)  # the bulk store has read the buffer (cp.async.bulk.wait_group.read 0)
        cta_barrier()  # every thread past the wait before the (single-thread) release
        mbarrier.arrive(q_empty.index(qi), count=1)  # the producer may load tile tc + 2's Q half here
        g += n
        tc += 1


@gluon.jit
def gluon_persistent_fwd_kernel(Q, K, V, F32, I32, O, LSE, SCRATCH,
                                B: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, SEQ: gl.constexpr,
                                D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                                PP_SYNC: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                HEAD_GROUP: gl.constexpr = 1):
    """Q [B, SEQ, HQ, D], K and V [B, SEQ, HKV, D] -> O like Q, LSE [B, HQ, SEQ] (float32). F32 = [scale, ...],
    I32 = [window left, window right, ...]; SCRATCH: the descriptors' global scratch (unused by the body).
    Grid (P,), P <= number of tiles (`grid`); 4 warps asked, 12 run (two consumers, a producer)."""
    ROWS: gl.constexpr = BLOCK_M // 2
    N_M: gl.constexpr = (SEQ + BLOCK_M - 1) // BLOCK_M
    BH: gl.constexpr = B * HQ
    dtype: gl.constexpr = Q.dtype.element_ty
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
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
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
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
                     nprog, left, right, qk_scale, turn.index(0), turn.index(1), HQ, SEQ, N_M, BH, HEAD_GROUP,
                     BLOCK_M, BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW, PP_SYNC, 0)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, LSE, pid,
                     nprog, left, right, qk_scale, turn.index(1), turn.index(0), HQ, SEQ, N_M, BH, HEAD_GROUP,
                     BLOCK_M, BLOCK_N, D, NUM_STAGES, CAUSAL, WINDOW, PP_SYNC, 1)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                     v_empty, pid, nprog, left, right, HQ, HKV, SEQ, N_M, BH, HEAD_GROUP, BLOCK_M, BLOCK_N, D,
                     NUM_STAGES, CAUSAL, WINDOW, dtype.primitive_bitwidth // 8)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
