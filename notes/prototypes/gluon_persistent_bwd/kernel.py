"""Host helpers of the persistent backward for this folder's harness (run_gpu.py) and compile check (aot.py): the
kernel itself is integrated, ejgen.runtime.attention.gluon.kernels.gluon_attention_bwd_persistent_kernel (ejgen takes it for
causal sliding windows, DYNAMIC=1, HEAD_GROUP=1); these helpers expose its other options (static scheduling,
HEAD_GROUP, EPI_TMA) for timing.

Persistent variant of ejgen.runtime.attention.gluon.kernels.gluon_attention_bwd_kernel (Hopper, sm_90a). The grid is
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

# the repository root is on sys.path (aot.py, run_gpu.py)
from ejgen.runtime.attention.gluon import host as gluon_attention

L2_QDO_BUDGET = 16 << 20  # bytes of Q and dO per head section (H100 / H200 L2: 50 MB)

# shared memory budget and K / V buffer choice: the library's
SMEM_LIMIT = gluon_attention.SMEM_LIMIT
smem_bytes, kv_stages = gluon_attention.pbwd_smem_bytes, gluon_attention.pbwd_kv_stages


# --- host side -------------------------------------------------------------------------------------------------

def head_group(batch: int, hq: int, hkv: int, seq: int, d: int, item: int = 2, budget: int = L2_QDO_BUDGET) -> int:
    """(batch, kv head) pairs per section of the tile order: as many as fit the Q and dO of their query heads (what
    every key block of a kv head reads) in `budget` bytes."""
    per_kv_head = 2 * (hq // hkv) * seq * d * item
    return max(1, min(batch * hkv, budget // per_kv_head))


def num_tiles(batch: int, hkv: int, seq: int) -> int:
    return -(-seq // gluon_attention.BWD_TILES["BLOCK_N"]) * batch * hkv


def grid(batch: int, hkv: int, seq: int, num_sms: int) -> tuple:
    return gluon_attention.pbwd_grid(batch, hkv, seq, num_sms)


def constexprs(batch: int, hq: int, hkv: int, seq: int, d: int, causal: bool, window: bool, *,
               head_group_: int | None = None, epi_tma: bool = False, dynamic: bool = False, item: int = 2) -> dict:
    """ejgen.runtime.attention.gluon.host.bwd_constexprs, plus HEAD_GROUP (`head_group`'s choice unless head_group_ is
    given), K_STAGES, V_STAGES (`kv_stages`), EPI_TMA and DYNAMIC (the tile scheduler: 0 static round-robin, 1 a
    global atomic tile counter; the launch then passes a zeroed int32 TILE_CTR)."""
    base = gluon_attention.bwd_constexprs(batch, hq, hkv, seq, d, causal, window)
    ks, vs = kv_stages(d, base["DQ_MODE"], item)
    hg = head_group(batch, hq, hkv, seq, d, item) if head_group_ is None else head_group_
    return dict(base, HEAD_GROUP=hg, K_STAGES=ks, V_STAGES=vs, EPI_TMA=epi_tma, DYNAMIC=int(dynamic))


# --- device side: the integrated kernel -------------------------------------------------------------------------

from ejgen.runtime.attention.gluon.kernels import gluon_attention_bwd_persistent_kernel as gluon_persistent_bwd_kernel  # noqa
