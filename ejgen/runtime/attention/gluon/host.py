"""Warp-specialised forward and backward for Hopper in Triton's Gluon dialect (the FA3 shape), for the plain
attention family. The backward (`bwd_*` below; kernel in gluon_kernels) covers the same calls, sliding windows
only with causal (a window to the left; those take the persistent backward, `pbwd_*`), and adds dQ up in
float32 by bulk reduce-adds: not bitwise reproducible run to run. Measured (H200, session 7, BENCHMARKS.md):
forward+backward 0.95-1.09x cuDNN over head dims 64/128 and S 1k-16k; window (16k, 1024) 1.10-1.11x with the
persistent backward.

The forward:

Where it runs: sm_90 GPUs, 16-bit q/k/v with head dim 64 or 128 (= value head dim), Sq == Sk (the forward also Sq !=
Sk where nothing ties queries to key positions: setting gluon_cross; the backward too with CROSS_BACKWARD), no varlen,
and a spec whose score is the scaled dot product (no bias, dense mask, positions or params; a soft cap is taken,
SOFTCAP: the logits capped before the mask and the softmax, the backward's dS times 1 - tanh^2; sinks join the
kernels' lse and output outside them, `api.join_sinks`, and their gradient comes from that lse; segment
ids are taken: their tile ranges join the band's, the ids are compared on partial blocks only, `segment_ranges`,
`tile_order`; a block layout too, whose blocks cover or divide the tiles: the kernels then walk lists of blocks,
`fwd_lists`, `bwd_lists`, `layout_misfit`; and a mask of the spec's own that reads no params, its tiles listed the
same way and the generated `_spec_mask` called on the partial ones, `listed`, `spec_constexprs`):
the kernel-set contract, docs/DESIGN.md §6
(`ineligible`). `triton_attention` takes it for those calls and keeps the generated Triton kernels for every
other one (a pass the Hopper backward does not cover runs the generated backward, which reads this kernel's O and
lse). The element semantics are docs/DESIGN.md §3's: key j is visible to query i iff (not causal or j <= i) and (no
window or i - left <= j <= i + right) and the ids, the layout and the spec's mask let it through; the kernels' lse is
the natural-log log-sum-exp of the scaled logits (capped with a soft cap; sinks are joined after the kernel, by the
host), -inf on a row that sees no key.

Shape of the kernel (persistent: one program per SM walks tiles of 128 query rows of one head):
  * a producer warp (few registers) issues tensor-memory-accelerator loads: the two 64-row halves of a
    tile's Q (two Q sets: the next tile's Q lands while this one runs), then K and V tiles into a ring of
    NUM_STAGES shared-memory buffers, each with a ready and an empty mbarrier (K and V apart, so Q K^T starts
    before V lands). Its ring counter runs across tiles, so it prefetches the next tile's K/V while the
    consumers finish the current one: short key loops (sliding windows) pay no prologue per tile;
  * two consumer warpgroups, one per 64-row half, run the same loop over the key blocks: S_j = Q K_j^T and
    O += P_{j-1} V_{j-1} are issued asynchronously, the softmax of block j runs while P_{j-1} V_{j-1} is
    still on the tensor cores (one wgmma in flight: what plain Triton cannot express), and each K/V stage
    goes back to the producer once both consumers' wgmmas that read it have completed;
  * the two consumers take turns issuing their matmuls (an mbarrier token passed back and forth, its phase
    from the running block counter): one warpgroup's softmax overlaps the other's matmuls (FA3's ping-pong);
  * only the key blocks that meet the visible band are visited; blocks visible for every row of the tile
    run without the element mask;
  * the epilogue divides by the row sums, writes lse, and stores O through the consumer's Q buffer with a
    bulk store (rows past the sequence end are clipped by the descriptor), then hands that Q buffer back;
  * tile order: sections of HEAD_GROUP (batch, head) pairs whose K/V fit in part of L2 (`head_group`); query
    tiles slow and heads fast inside a section, heaviest tiles first under causal (FA3's LPT order).
Descriptors are made on the device (the launch gives each program SCRATCH bytes for them, triton_call).
The cross-tile barrier protocol (ring, Q sets, turn token) was checked by a CPU model under random
interleavings before it ran (tests/attention/test_gluon_protocol.py; notes/gluon-persistent-fwd.md).

Measured (session 7, H200; bf16, D=128, B*S=32k, H=16, CUDA events):
against the per-tile form it replaced, window (16k, 1024) 0.704 -> 0.505 ms, 4k causal 0.994 -> 0.922,
16k causal 3.374 -> 3.369, 4k 1.682 -> 1.557.
"""

from __future__ import annotations

import functools
import importlib

from ejgen.runtime.core import kernels
from ejgen.runtime.core.device import num_sms

BLOCK_M = 128  # two consumer warpgroups of 64 rows
CONSUMER_REGS = 240
PRODUCER_REGS = 24
HEAD_DIMS = (64, 128)
# 128-key tiles, two K/V stages (standalone sweep, H200: 128x128 s2 ahead of s3, 128x64 and one-warpgroup forms at
# every shape); the kernel's consumers always take turns (turn-taking won at 16k, free-running by < 1% at 4k)
TILES = dict(BLOCK_N=128, NUM_STAGES=2)
# Element masks that keep a row of values per key next to the S, P and O tiles spill the consumers' registers at
# 128-key blocks (sm_90, Triton 3.9, bytes a thread: a spec mask dividing positions by a run-time value,
# `Layout.mask_divides`, NATTEN 2-D 112, sliding tile 1744; segment ids under a window 72, the key ids and the
# window's bounds), at 64-key blocks not (sliding tile 40). Three stages: the ring holds as many keys ahead. Not
# measured against the 128-key tiles yet.
NARROW_TILES = dict(BLOCK_N=64, NUM_STAGES=3)


def windowed_ids(cfg) -> bool:
    """Segment ids under a sliding window on the paths the gluon_spec_masks setting governs (the backward on lists,
    the forward's narrow key tiles): with it off, such calls take the generated backward and the forward's TILES."""
    from ejgen.runtime.core import settings

    return bool(cfg.segments and cfg.window and settings.current().gluon_spec_masks)


def fwd_key_tiles(cfg, divides: bool) -> dict:
    """The forward's key tiles for a call: NARROW_TILES for a spec mask that divides positions (``divides``) or
    segment ids under a window (`windowed_ids`), without a block layout (whose fit is judged at TILES,
    `layout_misfit`); else TILES."""
    return NARROW_TILES if (divides or windowed_ids(cfg)) and not cfg.layout else TILES


@functools.lru_cache(maxsize=None)
def importable() -> tuple[bool, str]:
    """(whether this Triton has Gluon's Hopper warp specialisation, why not)."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
    except ImportError as e:
        return False, f"triton.experimental.gluon is missing or too old ({e})"
    if not hasattr(gl, "warp_specialize"):
        return False, "this Triton's Gluon has no warp_specialize"
    return True, ""


def hopper() -> bool:
    """Whether calls run on a Hopper GPU (sm_90: the kernels' wgmma and warp specialisation)."""
    return kernels.target().arch == "sm90"


# The backward takes Sq != Sk too (SEQ_K, as the forward under gluon_cross): compiled for sm_90 without spills on
# Triton 3.9 and 3.6, its PTX for Sq = Sk unchanged (session 19); `test_gluon_cross_matches_the_oracle` passed on an
# H100 and it timed 1.11-1.25x the generated backward's forward+backward on the cross cases of
# `benchmarks/hopper_features.py` (session 20, BENCHMARKS.md). False sends Sq != Sk backwards to the generated kernels.
CROSS_BACKWARD = True

# Windows narrower than this many keys (left + right + 1) take the generated backward where there are no sinks: the
# Hopper set's 128 x 128 tiles cut a narrow band mostly into partial tiles. H100, session 20 (`benchmarks/
# hopper_features.py`, one process, B 1, S 8192, H 16, D 128; generated / Hopper ms): backward (fwd+bwd less fwd) of a
# causal window of 128 keys 0.245 / 0.320, 512 0.390 / 0.425, 2048 0.858 / 0.731. The forward wins at every width
# measured (128: 0.120 / 0.107). With sinks both passes stay on the Hopper set: gpt-oss (window 128, learnable sinks,
# `benchmarks/zoo.py`) took 0.715 ms forward+backward on the generated kernels against 0.434 on the Hopper set
# (session 20 and 19, H100; its forward alone with sinks closed over: 0.122 / 0.138, `hopper_features.py`).
NARROW_WINDOW = 1024


def narrow_window(cfg) -> bool:
    """Whether the call's window is narrower than NARROW_WINDOW keys."""
    return bool(cfg.window) and cfg.window_span + 1 < NARROW_WINDOW


def ineligible(layout, cfg, q, k, v, pinned: bool, pass_: str = "fwd") -> str | None:
    """Why the Gluon forward (pass_ "fwd") or backward ("bwd") cannot run this call (None: it can). q is
    [B, Sq, Hkv, G, D]."""
    import jax.numpy as jnp

    d, dv = q.shape[-1], v.shape[-1]
    features = [what for on, what in ((cfg.bias, "bias"), (cfg.dense_mask, "a dense mask"),
                                      (cfg.positions, "positions"), (cfg.varlen, "varlen")) if on]
    # (sinks join outside the kernels; a soft cap is the kernels' SOFTCAP)
    from ejgen.runtime.core import settings

    misfit = layout_misfit(cfg) if cfg.layout else None
    spec = not layout.builtin_mask_only
    checks = [
        (pinned, f"a {pass_} config is pinned (EJGEN_TRITON_CONFIG) or autotuned"),
        (spec and not layout.gluon_mask, "the spec has a mask of its own that the Hopper kernels cannot call (it reads "
                                         "params, or raises to a power that is not a constant integer)"),
        (spec and not settings.current().gluon_spec_masks, "the spec has a mask of its own, and the gluon_spec_masks "
                                                            "setting is off (EJGEN_GLUON_SPEC_MASKS=0)"),
        (pass_ == "bwd" and cfg.window and cfg.segments and not windowed_ids(cfg),
         "segment ids with a sliding window (the backward's lists: the gluon_spec_masks setting is off, "
         "EJGEN_GLUON_SPEC_MASKS=0)"),
        (not layout.score_is_identity or layout.params, "the spec's score is not the scaled dot product"),
        (features, f"{', '.join(features)} (the Hopper kernels take none of: bias, a dense mask, positions, "
                   f"varlen)"),
        (misfit, misfit),
        (q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype,
         f"dtype {q.dtype} (16-bit only)"),
        (d != dv or d not in HEAD_DIMS, f"head dims {d}/{dv} (equal, one of {HEAD_DIMS})"),
        (q.shape[1] != k.shape[1] and not (settings.current().gluon_cross and not (
            cfg.causal or cfg.window or cfg.segments or cfg.layout or spec)),
         f"Sq {q.shape[1]} != Sk {k.shape[1]} (the Hopper kernels take it with the gluon_cross setting on, without "
         f"causal, a window, segment ids, a block layout or a spec mask)"),
        (pass_ == "bwd" and q.shape[1] != k.shape[1] and not CROSS_BACKWARD,
         f"Sq {q.shape[1]} != Sk {k.shape[1]} in the backward (gluon.host.CROSS_BACKWARD is off)"),
        (pass_ == "bwd" and narrow_window(cfg) and not cfg.sinks,
         f"a window of {cfg.window_span + 1} keys, narrower than gluon.host.NARROW_WINDOW = {NARROW_WINDOW} (the "
         f"generated backward is faster there)"),
        (pass_ == "bwd" and cfg.softcap and not settings.current().fast_tanh,
         "a soft cap with the exact tanh (the generated backward is faster there: Gemma 2, H100, session 20, 2.65 "
         "against 3.36 ms; the Hopper backward takes it with the fast_tanh setting)"),
        (pass_ == "bwd" and cfg.window and not cfg.causal, "a sliding window without causal (the backward's masks: "
                                                          "causal, with a window to the left)"),
    ]
    for bad, why in checks:
        if bad:
            return why
    ok, why = importable()
    return None if ok else why


def kernel():
    """The Gluon kernel (`gluon_kernels`, imported on first use)."""
    return importlib.import_module("ejgen.runtime.attention.gluon.kernels").gluon_attention_fwd_kernel


L2_KV_BUDGET = 16 << 20  # bytes of K and V per head section (H100 / H200 L2: 50 MB)


def head_group(batch: int, hq: int, hkv: int, seq: int, d: int, item: int = 2) -> int:
    """(batch, head) pairs per section of the persistent tile order: as many kv heads as fit K and V in
    L2_KV_BUDGET, times the query heads sharing each (H200: section of 2 at 16k beat 1 by 4% causal)."""
    kv_heads = max(1, L2_KV_BUDGET // (2 * seq * d * item))
    return max(1, min(batch * hq, kv_heads * (hq // hkv)))


def persistent_grid(tiles: int, sms: int | None = None) -> tuple:
    """A persistent kernel's grid: one program per SM, never more than there are tiles."""
    return (max(1, min(sms or num_sms(), tiles)), )


def fwd_tiles(batch: int, hq: int, seq: int) -> int:
    """The forward's tiles: (BLOCK_M query rows, batch * head) pairs."""
    return -(-seq // BLOCK_M) * batch * hq


def grid(batch: int, hq: int, seq: int, sms: int | None = None, spare: int = 0) -> tuple:
    """The persistent forward's grid over its tiles (`fwd_tiles`), ``spare`` programs fewer than the GPU has SMs
    (`api.SPARE_SMS`: a kernel beside it finds them free)."""
    return persistent_grid(fwd_tiles(batch, hq, seq), (sms or num_sms()) - spare)


NO_LISTS = dict(LIST=False, LIST_BATCH=1, LIST_HEADS=1, SUB_Q=0, SUB_K=0)  # the kernels walk ranges


def spec_constexprs(spec: tuple | None) -> dict:
    """SPEC_MASK, SPEC_OPTIONS: the spec's mask and the loader of the options it reads (`_spec_mask`, `_spec_options`
    of its kernel module: `triton.host.Layout.spec_mask`), which the kernels call on partial tiles; None, None
    without."""
    mask, options = spec or (None, None)
    return dict(SPEC_MASK=mask, SPEC_OPTIONS=options)


# The forward's masked blocks of packed documents (segment ids under causal alone: no window, soft cap, lists or spec
# mask) in the DOCS form (SEGMENTS 2; `kernels._softmax_ids`): padding rows and keys as ids nothing matches, a block
# below the diagonal compares the ids alone (one setp and selp an element, inline PTX), one on it the ids and causal.
# A helper's static study of sm_90 SASS (Triton 3.6, session 33, notes/perf.md): a consumer warp's masked path over
# the unmasked 286 instructions +702 -> +151 below the diagonal, +354 on it; model: 8k with 8 documents -12 to -17 us
# a forward, 32k with 64 -58 to -92. Measured (session 34, one H200, `blocksparse.py --probe`, one process; its GPU
# tests pass): fwd 0.239 -> 0.223 ms at 8k / 8 documents but 0.576 -> 0.600 at 32k / 64 (the default's other rows
# there 0.565-0.576), fwd+bwd 0.756 -> 0.743 and 2.336 -> 2.256. Session 36 (one H200, 16 calls a sample, one process
# each; BENCHMARKS.md), fwd+bwd off -> on: 8k / 8 0.636 -> 0.618 and 0.636 -> 0.613, 32k / 64 2.181 -> 2.135 and
# 2.189 -> 2.124; forward alone 0.176 -> 0.181 and 0.173 -> 0.168, 32k / 64 0.519 -> 0.530 and 0.510 -> 0.516. The
# traces say where: the same forward kernel inside a fwd+bwd program takes 156.7 -> 138.9 us at 8k / 8, 475.3 -> 417.7
# at 32k / 64, and in a forward-only program 146.9 -> 149.4, 470.2 -> 488.8 (a hypothesis, notes/perf.md "Session 36":
# a fwd+bwd program keeps the GPU at its power limit, where fewer instructions clock higher). On: training steps gain
# 2-4%; a forward alone of many documents loses up to 2%.
DOCS_MASKS = True


def constexprs(batch: int, hq: int, hkv: int, seq: int, d: int, causal: bool, window: bool,
               segments: bool = False, ordered: bool = False, dynamic: bool = False, lists: dict | None = None,
               spec: tuple | None = None, tiles: dict | None = None, seq_k: int | None = None,
               softcap: bool = False, fast_tanh: bool = False, staged: tuple | None = None,
               docs: bool | None = None, kv_at: int = 0, merge: bool = False, spans: bool = False) -> dict:
    """The kernel's constexprs for q [batch, seq, hq, d] and k, v [batch, seq_k (default seq), hkv, d] (16-bit).
    ``softcap``: the logits capped (SOFTCAP, `softcap_constexpr`, with ``fast_tanh``; the cap is F32[1]).
    ``dynamic``: the programs take their tiles from the launch's zeroed counter (`dynamic_tiles`); ``lists``: the block
    lists' constexprs (`fwd_lists`), else ranges; ``spec``: the spec's mask (`spec_constexprs`: lists only); ``tiles``:
    the key tiles (`fwd_key_tiles`; default TILES). ``staged``: a spec mask's key-side position terms staged per
    key block (`triton.host.Layout.staged_mask`: its mask, query-side loader, key-side count and table offset; the
    mask replaces ``spec``'s, KSEG is then I32). ``docs`` (default DOCS_MASKS): segment ids under causal alone take
    the DOCS form (SEGMENTS 2). ``kv_at`` > 0: K and V read out of one 16-bit buffer, V from that item on (KV_AT:
    ring attention's received wire). ``merge``: the result merged into the rows' earlier one (MERGE: O_PREV,
    LSE_PREV aliased to O, LSE). ``spans``: RANGES holds each query tile's span of key blocks (SPANS,
    `layout_spans`; with ``dynamic`` and ``merge``)."""
    staged_kw = dict(KV_TERMS=0, TERMS_AT=0, SPEC_QTERMS=None)
    if staged is not None:
        spec = (staged[0], spec[1])
        staged_kw = dict(KV_TERMS=staged[2], TERMS_AT=staged[3], SPEC_QTERMS=staged[1])
    docs = (DOCS_MASKS if docs is None else docs) and segments and causal and not window and not softcap
    docs = docs and lists is None and spec is None and staged is None
    return dict(B=batch, HQ=hq, HKV=hkv, SEQ=seq, SEQ_K=seq_k or seq, D=d, BLOCK_M=BLOCK_M, CAUSAL=causal,
                WINDOW=window, SEGMENTS=2 if docs else segments,
                ORDERED=ordered, **staged_kw,
                CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                HEAD_GROUP=head_group(batch, hq, hkv, seq, d), DYNAMIC=dynamic, **(tiles or TILES),
                **(lists or NO_LISTS), **spec_constexprs(spec),
                SOFTCAP=softcap_constexpr(softcap, fast_tanh), KV_AT=kv_at, MERGE=merge, SPANS=spans)


def softcap_constexpr(softcap: bool, fast: bool = False) -> int:
    """SOFTCAP of the kernels: 0 no soft cap, 1 the exact tanh (from exp2 and an approximate divide: two MUFU
    operations an element, within 1e-7), 2 the hardware's tanh.approx.f32 (one, relative error about 2^-11): ``fast``,
    the call's `KernelChoice.fast_tanh` (the fast_tanh setting where both passes are the Hopper set, decided once with
    the kernels: the backward's P must be of the same logits as the forward's lse, and a generated backward's exact
    tanh against an approximate lse would not sum to 1). With the exact form a soft-cap forward takes 1.9x the plain
    causal one (H100, session 19: three MUFU operations an element against one)."""
    return (2 if fast else 1) if softcap else 0


def listed(cfg, spec: bool, pass_: str = "fwd") -> bool:
    """Whether the pass's kernel walks lists of blocks (LIST, `fwd_lists` / `bwd_lists`) rather than ranges: with a
    block layout, with a spec mask (``spec``: its tiles by interval arithmetic, which scatter), and in the backward
    with segment ids under a window (the per-program kernel on lists: the windows' persistent one takes no ids)."""
    return bool(cfg.layout or spec or (pass_ == "bwd" and windowed_ids(cfg)))


# Where the dynamic tile queue wins (H200, session 15, `benchmarks/gluon_dynamic_tiles.py`, one run, bf16, H 16,
# D 128, 32k tokens a call, static / dynamic ms): 16k causal B 2 4.165 / 3.647 (1.14x), 4k causal B 8 1.052 / 0.998
# (1.05x), 8k with 8 documents 0.243 / 0.222 (1.09x); level: 4k unmasked 1.832 / 1.830, 16k window (1024, 0) 0.602
# / 0.606; lost: 32k with 64 documents 0.553 / 0.588 (0.94x: 31 tiles a program of one to four key blocks each, whose
# counter round trips the queue does not pay back). With 116 of 132 SMs (NCCL's kernel beside it): 16k causal 1.04x.
DYNAMIC_SEGMENT_TILES_PER_PROGRAM = 16  # segment ids: the queue up to this many tiles a program (8k/8 docs: 7.8)


def dynamic_tiles(causal: bool, window: bool, segments: bool, tiles: int, programs: int) -> bool:
    """Whether the forward's programs take their tiles from a shared counter (DYNAMIC: each program's next tile
    is the next one of the order nobody has taken) instead of pid, pid + P, ...: the setting
    ``gluon_dynamic_tiles`` (EJGEN_GLUON_DYNAMIC_TILES) where given, else where it was measured to win (above):
    causal calls without a window, and calls with segment ids (``segments``: or a block layout, tiles of uneven work
    too; not measured apart) of at most DYNAMIC_SEGMENT_TILES_PER_PROGRAM tiles a
    program. It serves tiles of uneven work (causal, documents) and programs that start late (an NCCL kernel beside
    it holds SMs: the ring asks for it on every step); the launch then passes a zeroed int32 counter (TILE_CTR) and
    deals `tile_order` as one list, heaviest first (notes/gluon-persistent-fwd.md, "Dynamic tile queue")."""
    from ejgen.runtime.core import settings

    asked = settings.current().gluon_dynamic_tiles
    if asked is not None:
        return asked
    if window:
        return False
    if segments:
        return tiles <= DYNAMIC_SEGMENT_TILES_PER_PROGRAM * programs
    return causal


# The backward: 64-row query blocks, 128-key programs (two warpgroups of 64 keys), two Q/dO stages (standalone
# sweep, H200: dQ columns split through a slice of K ahead of a second copy of K (+1-3%) and of alternating whole
# tiles (+20-25%); three stages -1%).
BWD_TILES = dict(BLOCK_M=64, BLOCK_N=128, NUM_STAGES=2)


def bwd_kernel():
    """The Gluon backward (`gluon_kernels`, imported on first use)."""
    return importlib.import_module("ejgen.runtime.attention.gluon.kernels").gluon_attention_bwd_kernel


BWD_NO_TERMS = dict(Q_TERMS=0, TERMS_AT=0, Q_FIRST=0, SPEC_KVTERMS=None)  # the backward's staged position terms


def bwd_constexprs(batch: int, hq: int, hkv: int, seq: int, d: int, causal: bool, window: bool,
                   segments: bool = False, lists: dict | None = None, spec: tuple | None = None,
                   softcap: bool = False, seq_k: int | None = None, fast_tanh: bool = False,
                   staged: tuple | None = None, dq_rows: int | None = None, dq_off_at: int = 0, kv_at: int = 0,
                   kv_rows: int | None = None, kv_off_at: int = 0, q_in_place: bool = False, dkv_at: int = 0,
                   dkv_add_at: int = 0) -> dict:
    """The backward's constexprs (window: causal with a window to the left, `ineligible`; ``lists``: the block
    lists' constexprs, `bwd_lists`; ``spec``: the spec's mask, `spec_constexprs`; ``softcap``: SOFTCAP, with
    ``fast_tanh``; ``seq_k``: the keys' count, default seq: another only without causal, a window, segment ids or
    lists, gluon_cross). ``staged``: a spec mask's query-side position terms staged per item
    (`triton.host.Layout.staged_bwd_mask`: its mask, key-side loader, query-side count, table offset and the row of
    the first; the mask replaces ``spec``'s, QSEG is then I32). ``dq_rows``, ``dq_off_at``: dQ added into a larger
    accumulator of that many rows, from the row at I32[dq_off_at] on (0: row 0; DQ_ROWS, DQ_OFF_AT). ``kv_at`` > 0:
    K and V read out of one 16-bit buffer of ``kv_rows`` rows a batch row, V from that item on, the keys from the row
    at I32[kv_off_at] on (KV_AT, KV_ROWS, KV_OFF_AT). ``q_in_place``: q and dO read where they lie in tensors of
    ``dq_rows`` rows, from the dQ accumulator's row on (QDO_IN_PLACE). ``dkv_at`` > 0 (with ``kv_at``): dK and dV
    written into one 16-bit buffer laid out as the K/V wire, dV from that item on, at the keys' row (DKV_AT), and
    with ``dkv_add_at`` added to what is there where I32[dkv_add_at] != 0 (DKV_ADD_AT)."""
    terms = dict(BWD_NO_TERMS)
    if staged is not None:
        spec = (staged[0], spec[1])
        terms = dict(Q_TERMS=staged[2], TERMS_AT=staged[3], Q_FIRST=staged[4], SPEC_KVTERMS=staged[1])
    return dict(B=batch, HQ=hq, HKV=hkv, SEQ=seq, SEQ_K=seq_k or seq, D=d, MASK=2 if window else int(causal),
                DQ_MODE=1 if d == 128 else 0, SEGMENTS=segments,
                CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, **BWD_TILES, **(lists or NO_LISTS),
                **spec_constexprs(spec), SOFTCAP=softcap_constexpr(softcap, fast_tanh), **terms,
                DQ_ROWS=dq_rows or seq, DQ_OFF_AT=dq_off_at, KV_AT=kv_at, KV_ROWS=kv_rows or seq_k or seq,
                KV_OFF_AT=kv_off_at, QDO_IN_PLACE=bool(q_in_place), DKV_AT=dkv_at, DKV_ADD_AT=dkv_add_at)


# The persistent backward (gluon_kernels.gluon_attention_bwd_persistent_kernel) for causal sliding windows: one
# program per SM, tiles from an atomic counter in kv-head order. Three repetitions on an H200, backward kernel
# alone, window (16k, 1024): 1.50-1.56 ms against the per-program kernel's 1.81-1.86; on causal and unmasked calls
# the per-program kernel stayed ahead (notes/gluon-persistent-bwd.md).
SMEM_LIMIT = 232448  # bytes of shared memory one CTA may use on sm_90 (227 KB)
SMEM_RESERVE = 1024  # kept free of tiles: barriers, the column table, warp-specialisation captures


PBWD_K_STAGES = 2  # the persistent backward's K buffers (fixed in the kernel: needed first in a tile, released last)


def pbwd_smem_bytes(d: int, v_stages: int, dq_mode: int, item: int = 2, segments: bool = False) -> int:
    """Shared memory of the persistent backward's tiles (no barriers): K and V buffers, the Q / dO ring, the dS
    double buffer, the two warpgroups' float32 dQ staging buffers, the lse / delta rows (``segments``: and the
    rows' segment ids)."""
    bm, bn, stages = BWD_TILES["BLOCK_M"], BWD_TILES["BLOCK_N"], BWD_TILES["NUM_STAGES"]
    dq_n = d if dq_mode == 0 else d // 2
    return ((PBWD_K_STAGES + v_stages) * bn * d * item + 2 * stages * bm * d * item + 2 * bn * bm * item
            + 2 * bm * dq_n * 4 + (3 if segments else 2) * stages * bm * 4)


def pbwd_v_stages(d: int, dq_mode: int, item: int = 2, segments: bool = False) -> int:
    """V_STAGES: two V buffers where they fit next to the two K buffers (head dim 64), else one (head dim 128)."""
    for vs in (2, 1):
        if pbwd_smem_bytes(d, vs, dq_mode, item, segments) + SMEM_RESERVE <= SMEM_LIMIT:
            return vs
    raise ValueError(f"head dim {d}: the persistent backward's tiles do not fit in shared memory")


def pbwd_grid(batch: int, hkv: int, seq: int, sms: int | None = None) -> tuple:
    """The persistent backward's grid over (key block, batch * kv head) tiles."""
    return persistent_grid(-(-seq // BWD_TILES["BLOCK_N"]) * batch * hkv, sms)


def pbwd_kernel():
    """The persistent Gluon backward (`gluon_kernels`, imported on first use)."""
    return importlib.import_module("ejgen.runtime.attention.gluon.kernels").gluon_attention_bwd_persistent_kernel


def pbwd_constexprs(batch: int, hq: int, hkv: int, seq: int, d: int, softcap: bool = False,
                    fast_tanh: bool = False, segments: bool = False, causal: bool = True) -> dict:
    """The persistent backward's constexprs for a causal sliding window (MASK 2); ``segments``: for segment ids
    without a window instead (MASK 1, 0 without ``causal``; SEGMENTS, `PERSISTENT_SEGMENTS_BWD`); its launch also
    passes a zeroed int32 tile counter (TILE_CTR: the kernel takes its tiles from it)."""
    window = not segments
    base = bwd_constexprs(batch, hq, hkv, seq, d, causal or window, window, segments=segments, softcap=softcap,
                          fast_tanh=fast_tanh)
    # segment ids, layouts and spec masks with a window take the per-program backward over lists (`listed`); keys
    # as many as queries
    for name in ("SEQ_K", *NO_LISTS, *spec_constexprs(None), *BWD_NO_TERMS, "DQ_ROWS", "DQ_OFF_AT", "KV_AT",
                 "KV_ROWS", "KV_OFF_AT", "QDO_IN_PLACE", "DKV_AT", "DKV_ADD_AT"):
        del base[name]
    return dict(base, V_STAGES=pbwd_v_stages(d, base["DQ_MODE"], segments=segments))


# Packed documents' backward on the persistent kernel (session 33, issue 14): causal calls with segment ids and
# no window (no layout or spec mask) take `gluon_attention_bwd_persistent_kernel` with SEGMENTS, whose programs walk
# `bwd_order` (most query blocks first) through the tile counter, instead of one program per key block. Model
# (notes/studies/s33-documents.md, proposal 1): -45..-55 us a fwd+bwd at 8k with 8 documents, -170..-215 at 32k
# with 64. Measured (session 34, one H200, `blocksparse.py --probe`, one process): fwd+bwd 0.756 -> 0.741 ms at 8k /
# 8 documents, 2.336 -> 2.284 at 32k / 64; its GPU tests pass. On.
PERSISTENT_SEGMENTS_BWD = True


def persistent_segments_bwd(cfg, listed: bool, switch: bool | None = None) -> bool:
    """Whether a backward takes the persistent kernel with segment ids (``switch``, default
    `PERSISTENT_SEGMENTS_BWD`): causal, segment ids, no window, and no lists (block layouts, spec masks: `listed`)."""
    on = PERSISTENT_SEGMENTS_BWD if switch is None else switch
    return bool(on and cfg.segments and cfg.causal and not cfg.window and not listed)


def ordered(cfg) -> bool:
    """Whether the forward's tiles go in the order of their work (`tile_order`): with segment ids (no window), whose
    tiles' work the static order cannot know. H200, one run (session 11, B = 1, H = 16, D = 128, 8 / 64 packed
    documents): 8k 0.293 -> 0.243 ms, 32k/64 0.748 -> 0.590, 32k/8 unchanged. Causal alone is not ordered: the
    order deals every head's heaviest tiles first, which keeps far more K / V in flight than the L2 holds where
    B * H is large (H200, B = 8, S = 4k, H = 16: 1.18 ms against the static order's ~1.06, cuDNN 1.06) though it
    won at B = 1 (8k: 0.630 -> 0.502 ms); a section-aware, dynamic order is the next step (notes). A block layout
    always (its lists' counts: `fwd_lists`, `order_by_work`)."""
    return bool(cfg.layout or (cfg.segments and not cfg.window))


def tile_order(ranges, hq: int, causal: bool, programs: int):
    """int32 [N_M * B * hq]: the persistent forward's tiles (i_m * B * hq + bh) in the order its programs take them
    (program p: entries p, p + programs, ...), from each query tile's key blocks (its segment ids' ``ranges``
    [B, N_M, 4], joined with causal): heaviest first, each wave of ``programs`` tiles dealt to the programs in the
    opposite direction of the wave before (a snake), so every program gets a like share of the work. The static
    order (`kernels._tile`) deals query tiles round-robin, heaviest first under causal, which leaves programs 1.7x
    apart with 8 packed documents in 8k tokens (a model of an H100's 132 programs); this order: within 3%. Ties
    keep the heads of a query tile together (their K / V share the L2). Computed on the device in a few fused ops,
    no sort (up to 4096 (query tile, batch row) pairs; past that a sort). ``programs=1``: one list, heaviest first
    (the dynamic tile queue's order: `dynamic_tiles`)."""
    import jax.numpy as jnp

    n_m = ranges.shape[1]
    i_m = jnp.arange(n_m, dtype=jnp.int32)
    lo, hi = ranges[..., 0], ranges[..., 1]
    if causal:
        hi = jnp.minimum(hi, (i_m * BLOCK_M + BLOCK_M + TILES["BLOCK_N"] - 1) // TILES["BLOCK_N"])
    return order_by_work(jnp.maximum(hi - lo, 1)[:, None], hq, programs)  # a tile visits at least one block


def order_by_work(work, hq: int, programs: int):
    """`tile_order` from each tile's work, int [B, 1|hq, N_M] (key blocks; 1: every head alike, whose tiles then
    stay next to each other): heaviest first, dealt as a snake to ``programs`` (1: one list)."""
    import jax.numpy as jnp

    batch, heads, n_m = work.shape
    bh = batch * hq
    entry = jnp.arange(n_m * bh, dtype=jnp.int32)  # i_m * bh + (b * hq + h): heads of a row next to each other
    if heads == 1:
        rank = _rank(work[:, 0].T.reshape(-1))  # per (i_m, b) row
        k = rank[(entry // bh) * batch + (entry % bh) // hq] * hq + entry % hq  # its place, heaviest first
    else:
        k = _rank(jnp.transpose(work, (2, 0, 1)).reshape(-1))  # per (i_m, b, h): the entries' own order
    wave, j = k // programs, k % programs
    full_wave = (wave + 1) * programs <= n_m * bh  # a last, partial wave is dealt forwards: its slots exist
    slot = wave * programs + jnp.where((wave % 2 == 1) & full_wave, programs - 1 - j, j)
    return jnp.zeros_like(entry).at[slot].set(entry)


def _rank(work):
    """int32: each entry's place in decreasing ``work``, ties in index order: by one comparison pass (a sort is
    several kernels) up to 4096 entries, else a sort."""
    import jax.numpy as jnp

    r = jnp.arange(work.shape[0], dtype=jnp.int32)
    if work.shape[0] <= 4096:
        before = (work[None, :] > work[:, None]) | ((work[None, :] == work[:, None]) & (r[None, :] < r[:, None]))
        return jnp.sum(before, axis=1, dtype=jnp.int32)
    return jnp.zeros_like(r).at[jnp.argsort(-work, stable=True)].set(r)


def bwd_order(ranges, hkv: int, seq: int, causal: bool, by_work: bool = True):
    """int32 [N_N * B * hkv]: the backward's programs (n * B * hkv + b * hkv + kv head) in launch order, the most
    query blocks first (from the segment ids' ``ranges`` [B, N_N, 4], joined with causal). The GPU starts programs
    in launch order as SMs free up, so this is the longest-first greedy schedule; the grid's own order (key
    blocks fast) suits causal alone, not packed documents. ``by_work=False``: the grid's own order."""
    import jax.numpy as jnp
    import numpy as np

    n_n = ranges.shape[1]
    if not by_work:
        t = np.arange(n_n * ranges.shape[0] * hkv, dtype=np.int32)
        return jnp.asarray((t % n_n) * (ranges.shape[0] * hkv) + t // n_n)
    n = jnp.arange(n_n, dtype=jnp.int32)
    lo, hi = ranges[..., 0], ranges[..., 1]
    if causal:
        lo = jnp.maximum(lo, n * BWD_TILES["BLOCK_N"] // BWD_TILES["BLOCK_M"])
    return programs_by_work(jnp.maximum(hi - lo, 0)[:, None], hkv)


def programs_by_work(work, hkv: int):
    """`bwd_order` from each program's work, int [B, 1|hkv, N_N] (query blocks; 1: every kv head alike)."""
    import jax.numpy as jnp

    batch, heads, n_n = work.shape
    entry = jnp.arange(n_n * batch * hkv, dtype=jnp.int32)
    if heads == 1:
        rank = _rank(work[:, 0].T.reshape(-1))  # per (n, b) row
        place = rank[entry // hkv] * hkv + entry % hkv  # (n, b) rows in entry order: entry // hkv
    else:
        place = _rank(jnp.transpose(work, (2, 0, 1)).reshape(-1))  # per (n, b, kv head): the entries' own order
    return jnp.zeros_like(entry).at[place].set(entry)


def segment_ranges(ctx, cfg, seq: int, pass_: str = "fwd", block_n: int = TILES["BLOCK_N"]):
    """int32 [B, tiles, 4]: the tile ranges the segment ids leave (`block_mask.tile_ranges`, O(tiles) per batch
    row): per query tile of the forward (BLOCK_M rows) the key blocks (of ``block_n`` keys, `fwd_key_tiles`), per
    key block of the backward (BWD_TILES) the query blocks; each kernel joins them with its causal / window range."""
    import jax.numpy as jnp

    from ejgen.runtime.attention import tiles
    from ejgen.types import block_mask

    bq, bk = (BLOCK_M, block_n) if pass_ == "fwd" else (BWD_TILES["BLOCK_M"], BWD_TILES["BLOCK_N"])
    kinds = tiles.mask_kinds(ctx, cfg, bq, bk, seq, seq)[:, 0]  # [B, nQ, nK]: segment ids only (`ineligible`)
    if pass_ != "fwd":
        kinds = jnp.swapaxes(kinds, -1, -2)
    return block_mask.tile_ranges(kinds, longest=False)  # documents: one run of full tiles per tile


# The Hopper path's kernels in plain Triton (not Gluon; they run in Triton's interpreter on a CPU): the documents'
# plan and the backward's delta. The tests' pretended Hopper GPU runs them and records only the Gluon kernels.
PLAIN_TRITON = ("ejgen.runtime.attention.gluon.plan", "ejgen.runtime.attention.gluon.delta")


# The segment ids' tile ranges and the tiles' order by work in two Triton launches a pass (`plan.ranges_kernel`,
# `plan.order_kernel`) instead of the 8-9 small XLA kernels `segment_ranges` and `tile_order` / `bwd_order` make
# (~1.1 us each on an H200, whatever their size: session 35's trace of 8k tokens with 8 documents, ~21 us of a
# 0.65 ms forward+backward). Bit for bit the same results. Session 35, one H200, 16 calls a sample, one process: the
# four launches 7.6 us at 8k with 8 documents (a first form, whose ranges programs looped over the inner tiles, took
# 24 us); fwd+bwd 0.643 -> 0.635 ms at 8k / 8 (1.30x FlexAttention's 0.826 in the same run), 2.181 -> 2.172 at
# 32k / 64, 9.232 -> 9.321 at 32k / 8 (within that size's 1% spread); forwards alike; the GPU document tests pass. On.
PLAN_KERNELS = True


def segment_plan(ctx, cfg, seq: int, pass_: str, heads: int, programs: int = 1, by_work: bool = True,
                 block_n: int = TILES["BLOCK_N"]) -> tuple:
    """(RANGES, ORDER) of a pass over segment ids: `segment_ranges` and the forward's `tile_order` over ``heads``
    query heads dealt to ``programs`` / the backward's `bwd_order` over ``heads`` kv heads (``by_work``: by their
    work, else the grid's own order), from the plan kernels where `PLAN_KERNELS` and the ids alone mask the call
    (no dense mask or block layout, the forward's key tiles TILES'), else in jnp."""
    import jax
    import jax.numpy as jnp

    q_ids, kv_ids = ctx["q_seg"], ctx["kv_seg"]
    fwd = pass_ == "fwd"
    if not (PLAN_KERNELS and cfg.segments and not (cfg.dense_mask or cfg.layout) and block_n == TILES["BLOCK_N"]
            and q_ids.shape == kv_ids.shape and q_ids.shape[1] == seq and (fwd or by_work)
            and _plan_inner_ids(seq, pass_) <= PLAN_MAX_INNER_IDS):
        keys = {"block_n": block_n} if fwd else {}
        ranges = segment_ranges(ctx, cfg, seq, pass_, **keys)
        if fwd:
            return ranges, tile_order(ranges, heads, cfg.causal, programs)
        return ranges, bwd_order(ranges, heads, seq, cfg.causal, by_work)
    from ejgen.runtime.attention.gluon import plan
    from ejgen.runtime.launch import triton_call

    batch = q_ids.shape[0]
    (bo, bi), (outer, inner) = (((BLOCK_M, block_n), (q_ids, kv_ids)) if fwd else
                                ((BWD_TILES["BLOCK_N"], BWD_TILES["BLOCK_M"]), (kv_ids, q_ids)))
    n_o, n_i = -(-seq // bo), -(-seq // bi)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    ranges, work = triton_call.launch(
        plan.ranges_kernel, (-(-n_o // plan.BR), batch), [outer.astype(jnp.int32), inner.astype(jnp.int32)],
        [i32(batch, n_o, 4), i32(n_o * batch)], **plan_constexprs(batch, seq, pass_, cfg.causal))
    n = n_o * batch
    (order,) = triton_call.launch(plan.order_kernel, (-(-n // plan.BR_ORDER), ), [work], [i32(n * heads)],
                                  **plan_order_constexprs(n, heads, programs, pass_))
    return ranges, order


PLAN_MAX_INNER_IDS = 32768  # the inner tiles' ids one ranges program loads at once (longer sequences: the jnp plan)


def _plan_inner_ids(seq: int, pass_: str) -> int:
    """The ids one ranges program loads: every inner tile's (the forward's key blocks, the backward's query
    blocks), padded to a power of two tiles."""
    bi = TILES["BLOCK_N"] if pass_ == "fwd" else BWD_TILES["BLOCK_M"]
    return (1 << max(-(-seq // bi) - 1, 0).bit_length()) * bi


def plan_constexprs(batch: int, seq: int, pass_: str, causal: bool) -> dict:
    """The launch options and constexprs of `plan.ranges_kernel` for a pass over ``seq`` tokens."""
    from ejgen.runtime.attention.gluon import plan

    bo, bi = (BLOCK_M, TILES["BLOCK_N"]) if pass_ == "fwd" else (BWD_TILES["BLOCK_N"], BWD_TILES["BLOCK_M"])
    n_i = -(-seq // bi)
    return dict(num_warps=plan.WARPS, num_stages=1, B=batch, S=seq, N_O=-(-seq // bo), N_I=n_i,
                N_I_PAD=1 << max(n_i - 1, 0).bit_length(), BLOCK_O=bo, BLOCK_I=bi, BACKWARD=pass_ != "fwd",
                CAUSAL=bool(causal), FWD_BLOCK_N=TILES["BLOCK_N"], BR=plan.BR)


def plan_order_constexprs(entries: int, heads: int, programs: int, pass_: str) -> dict:
    """The launch options and constexprs of `plan.order_kernel` over ``entries`` (tile, batch row) entries of
    ``heads`` heads each (the forward's dealt to ``programs`` as a snake)."""
    from ejgen.runtime.attention.gluon import plan

    return dict(num_warps=4, num_stages=1, N=entries, H=heads, H_PAD=1 << max(heads - 1, 0).bit_length(),
                PROGRAMS=programs, SNAKE=pass_ == "fwd", BR=plan.BR_ORDER, CH=plan.CH)


# The backward's delta (rowsum(dO * O) - d lse) in one Triton launch (`delta.delta_kernel`) instead of XLA's fusion,
# which ran at 2.5 TB/s at 8k tokens with 16 heads (26.0 us of a 0.65 ms documents fwd+bwd, session 35's trace on an
# H200; 4.1 TB/s at 32k). Session 36 (one H200): the kernel 18.8 us at 8k, 67.7 at 32k (trace); fwd+bwd at 16 calls a
# sample within the rows' spread (documents 8k / 8 0.636 against 0.633 off, 32k / 64 2.181 / 2.178; causal 8k 1.947
# / 1.967, 32k 27.07 / 27.11); the GPU document and sinks tests pass. On.
DELTA_KERNEL = True


def backward_delta(out, d_out, d_lse, zeros: tuple | None = None):
    """delta = rowsum(d_out * out) - d_lse in float32, lse's shape [B, Hkv, G, Sq], of out and d_out [B, Sq, Hkv, G,
    Dv] (the seq-major layout), from `delta.delta_kernel`. ``zeros``: a shape; then (delta, float32 zeros of that
    shape), the zeros by the launch's memset (at ~4.5 TB/s on an H200, where XLA's broadcast of a float32 zero ran at
    2.3: ring attention's dQ accumulator, `ring.ZEROS_BY_DELTA`)."""
    import jax
    import jax.numpy as jnp

    from ejgen.runtime.attention.gluon import delta
    from ejgen.runtime.launch import triton_call

    batch, sq, hkv, groups, dv = out.shape
    hq = hkv * groups
    rows, zeroed = triton_call.launch(
        delta.delta_kernel, (batch * hq, -(-sq // delta.BLOCK)), [out, d_out, d_lse.astype(jnp.float32)],
        [jax.ShapeDtypeStruct((batch, hq, sq), jnp.float32), jax.ShapeDtypeStruct(zeros or (1, ), jnp.float32)],
        zeroed=(1, ) if zeros is not None else (), **delta_constexprs(sq, hq, dv))
    rows = rows.reshape(d_lse.shape)
    return rows if zeros is None else (rows, zeroed)


def hopper_delta(out, d_out, d_lse, zeros: tuple | None = None) -> tuple:
    """(delta [B, Hkv, G, Sq], float32 zeros of shape ``zeros`` or None) of the Hopper backward: `backward_delta`'s
    where DELTA_KERNEL (the zeros by its launch's memset), else XLA's (`api.delta_rows`; no zeros)."""
    if DELTA_KERNEL:
        return backward_delta(out, d_out, d_lse, zeros) if zeros is not None else (
            backward_delta(out, d_out, d_lse), None)
    from ejgen.runtime.attention import api

    return api.delta_rows(out, d_out, d_lse), None


def delta_constexprs(seq: int, hq: int, dv: int) -> dict:
    """The launch options and constexprs of `delta.delta_kernel` over ``seq`` rows of ``hq`` heads of ``dv``."""
    from ejgen.runtime.attention.gluon import delta

    return dict(num_warps=delta.WARPS, num_stages=1, SEQ=seq, H=hq, D=dv, D_PAD=1 << max(dv - 1, 0).bit_length(),
                BLOCK=delta.BLOCK)


# -- block layouts: lists of blocks -----------------------------------------------------------------------------
MAX_SUB_BLOCKS = 32  # a list entry's word of visible sub-blocks (a layout finer than the kernel's tiles): int32


def _sub_block(tile: int, block: int) -> int | None:
    """The sub-block of a ``tile`` the layout's ``block`` cuts it into along one axis: the whole tile where the
    block covers whole tiles, the block where whole blocks make the tile, else None (no word can say it)."""
    if block % tile == 0:
        return tile
    return block if tile % block == 0 else None


def sub_blocks(layout_block: tuple, pass_: str = "fwd") -> tuple:
    """(SUB_Q, SUB_K): the sub-blocks of the pass's tiles whose visibility each list entry's word holds, for a layout
    of ``layout_block`` blocks finer than the tiles; (0, 0) where its blocks cover whole tiles (no word)."""
    tq, tk = (BLOCK_M, TILES["BLOCK_N"]) if pass_ == "fwd" else (BWD_TILES["BLOCK_M"], BWD_TILES["BLOCK_N"])
    sq, sk = _sub_block(tq, layout_block[0]), _sub_block(tk, layout_block[1])
    return (0, 0) if (sq, sk) == (tq, tk) else (sq, sk)


def layout_misfit(cfg) -> str | None:
    """Why the Gluon kernels cannot walk the call's block layout (None: they can): per axis its blocks must cover
    whole tiles of both kernels (forward 128 x 128, backward 64 x 128) or whole numbers of them must make a tile,
    at most MAX_SUB_BLOCKS to a tile (each list entry says which are visible in one int32 word)."""
    lq, lk = cfg.layout_block
    for what, (tq, tk) in (("forward", (BLOCK_M, TILES["BLOCK_N"])), ("backward", (BWD_TILES["BLOCK_M"],
                                                                                    BWD_TILES["BLOCK_N"]))):
        sq, sk = _sub_block(tq, lq), _sub_block(tk, lk)
        if sq is None or sk is None:
            return (f"a block layout of {lq} x {lk} blocks (the Hopper kernels' {what} tiles, {tq} x {tk}, must be "
                    f"whole blocks or whole numbers of blocks along each axis)")
        if (tq // sq) * (tk // sk) > MAX_SUB_BLOCKS:
            return (f"a block layout of {lq} x {lk} blocks ({(tq // sq) * (tk // sk)} of them in a {what} tile of "
                    f"{tq} x {tk}; the Hopper kernels' lists say at most {MAX_SUB_BLOCKS})")
    return None


def _list_kinds(ctx, cfg, seq: int, tile_q: int, tile_k: int, mask_tiles=None, batch: int = 1, heads: int = 1):
    """(kinds int8 [TB, TH, nQ, nK], words int32 [LB, LH, nQ, nK] or None, SUB_Q, SUB_K) at tiles of tile_q x
    tile_k over seq x seq: the block layout's tiles where there is one (`block_mask.Layout`'s kinds by coverage: a
    tile inside one of its blocks takes that block's, a tile of several is full, partial or skipped as they are,
    blocks past the sequence not counted), the spec's mask's (``mask_tiles``, the generated interval arithmetic:
    `tiles.spec_kinds` over ``batch`` x ``heads``, axes of 1 where the mask reads no b / h), joined with causal, the
    window and the segment ids' tiles (`tiles.band_kinds`, `block_mask.Segments`), a tile crossing the sequence's
    end partial; with sub-blocks (a layout finer than the tiles) each tile's word: bit (r * (tile_k / SUB_K) + c)
    for its visible sub-block (r, c) (SUB_Q, SUB_K: 0 without). O(tiles x sub-blocks), the layout and the options
    traced."""
    import jax.numpy as jnp

    from ejgen.runtime.attention import tiles
    from ejgen.types import block_mask

    n_q, n_k = -(-seq // tile_q), -(-seq // tile_k)
    kinds = jnp.full((1, 1, n_q, n_k), block_mask.FULL, jnp.int8)
    words, sub_q, sub_k = None, 0, 0
    if cfg.layout:
        kinds, words, sub_q, sub_k = _layout_kinds(ctx, cfg, seq, tile_q, tile_k)
    if mask_tiles is not None:
        kinds = jnp.minimum(kinds, tiles.spec_kinds(mask_tiles, ctx, cfg, tile_q, tile_k, seq, seq, batch, heads))
    kinds = jnp.minimum(kinds, tiles.band_kinds(ctx, cfg, tile_q, tile_k, seq, seq))
    if cfg.segments:
        kinds = jnp.minimum(kinds, block_mask.Segments(ctx["q_seg"], ctx["kv_seg"]).kinds(tile_q, tile_k, seq, seq))
    kinds = tiles.edges_partial(kinds, tile_q, tile_k, seq, seq)
    return kinds, words, sub_q, sub_k


def _layout_kinds(ctx, cfg, seq: int, tile_q: int, tile_k: int):
    """`_list_kinds` of the block layout alone: (kinds, words or None, SUB_Q, SUB_K)."""
    import jax.numpy as jnp
    from jax import lax

    from ejgen.types import block_mask

    lay = ctx["layout"]  # [B|1, Hkv|1, G|1, nQ, nK]
    lay = lay.reshape(lay.shape[0], -1, *lay.shape[3:])
    (lq, lk), n_q, n_k = cfg.layout_block, -(-seq // tile_q), -(-seq // tile_k)
    sub_q, sub_k = _sub_block(tile_q, lq), _sub_block(tile_k, lk)  # `layout_misfit` said they exist
    nr, nc = tile_q // sub_q, tile_k // sub_k
    r0 = jnp.arange(n_q)[:, None] * tile_q + jnp.arange(nr)[None] * sub_q  # [n_q, nr]: each sub-block's first row
    c0 = jnp.arange(n_k)[:, None] * tile_k + jnp.arange(nc)[None] * sub_k
    rows = jnp.minimum(r0 // lq, lay.shape[2] - 1).reshape(-1)
    cols = jnp.minimum(c0 // lk, lay.shape[3] - 1).reshape(-1)
    vis = lay[:, :, rows][:, :, :, cols].reshape(*lay.shape[:2], n_q, nr, n_k, nc)
    valid = (r0 < seq)[:, :, None, None] & (c0 < seq)[None, None]  # [n_q, nr, n_k, nc]: inside the sequence
    seen = vis & valid
    kinds = jnp.where(jnp.all(vis | ~valid, axis=(3, 5)), block_mask.FULL,
                      jnp.where(jnp.any(seen, axis=(3, 5)), block_mask.PARTIAL, block_mask.SKIP)).astype(jnp.int8)
    if nr * nc == 1:
        return kinds, None, 0, 0
    shift = (jnp.arange(nr)[:, None, None] * nc + jnp.arange(nc)[None, None, :]).astype(jnp.uint32)  # [nr, 1, nc]
    bits = jnp.sum(seen.astype(jnp.uint32) << shift, axis=(3, 5), dtype=jnp.uint32)  # distinct bits: an or
    return kinds, lax.bitcast_convert_type(bits, jnp.int32), sub_q, sub_k


def _compact(kinds, words, empty_entry: bool):
    """(count int32 [...], table int32 [..., 1 + n (+ n)]) from tile kinds [..., n] (and words, like kinds): per row
    the count of visited tiles, then their entries in ascending order, tile * 2 + 1 where the tile is partial (the
    element mask on), then (words) their words; slots past the count 0. By one cumulative sum and one scatter per
    row, no sort. ``empty_entry``: a row that visits nothing lists one entry, tile n (past the end, partial: the
    forward's loops take at least one block, whose element mask then hides every key), counted 1."""
    import jax.numpy as jnp

    from ejgen.types import block_mask

    n = kinds.shape[-1]
    visited = kinds != block_mask.SKIP
    slot = jnp.where(visited, jnp.cumsum(visited, axis=-1, dtype=jnp.int32) - 1, n)  # n: a slot thrown away
    entry = jnp.arange(n, dtype=jnp.int32) * 2 + (kinds == block_mask.PARTIAL)
    count = jnp.sum(visited, axis=-1, dtype=jnp.int32)

    def scatter(values):
        out = jnp.zeros(kinds.shape[:-1] + (n + 1,), jnp.int32)
        return jnp.put_along_axis(out, slot, jnp.broadcast_to(values, kinds.shape), axis=-1, inplace=False)[..., :n]

    columns = [scatter(entry)]
    if words is not None:
        columns.append(scatter(words))
    if empty_entry:
        none = count == 0
        columns[0] = columns[0].at[..., 0].set(jnp.where(none, 2 * n + 1, columns[0][..., 0]))
        count = jnp.maximum(count, 1)  # a word of 0 stays 0: nothing visible either
    return count, jnp.concatenate([count[..., None]] + columns, axis=-1)


def fwd_lists(ctx, cfg, seq: int, mask_tiles=None, batch: int = 1, heads: int = 1, block_n: int = TILES["BLOCK_N"]):
    """The forward's block lists (LIST: a block layout, a spec mask, `listed`): (RANGES int32 [TB, TH, N_M, 1 + N_N
    (+ N_N)], its constexprs, each tile's work int32 [TB, TH, N_M]) at the kernel's tiles (BLOCK_M x BLOCK_N): per
    (batch row or 1, query head or 1, query tile) the count and the key blocks to visit (`_list_kinds`: the layout and
    the spec's mask, ``mask_tiles`` over ``batch`` x ``heads``, joined with causal, the window and segment ids;
    `_compact`), under jit with the layout and the options traced. TB / TH: 1 where the kinds are the same for every
    batch row / head; ``block_n``: the kernel's key tiles (`fwd_key_tiles`)."""
    kinds, words, _, _ = _list_kinds(ctx, cfg, seq, BLOCK_M, block_n, mask_tiles, batch, heads)
    if words is not None:
        words = _broadcast_like(words, kinds)
    count, table = _compact(kinds, words, empty_entry=True)
    return table, fwd_list_constexprs(table, cfg, block_n), count


# A block layout of at most two key columns, of whole tiles, merged into an earlier result: each query tile walks the
# span of key blocks its layout row sees (SPANS, `layout_spans`) in `_tile`'s order of head sections, not a list in
# the order of their counts (LIST, ORDERED). That is the ring's wide step on 2 devices (`ring._wide_layout`), which
# then runs as the plain c x 2c or 2c x c call it is, skipping the tiles that see no key. Session 39 (2 H200s): one
# GPU prices the lists at +72 / +65 us against the plain calls (`benchmarks/wide_step.py`: 1579 against 1507 us for
# device 0's 8k x 16k, 1584 against 1519 for device 1's 16k x 8k), and in one ring call's trace the step ran 56 / 75
# us faster with spans (1571 / 1606 against 1627 / 1682). But the ring's forward timed slower, 4.43-4.46 ms at 16
# calls a sample against 4.22-4.25 with lists (calls 5-7): in a batch of calls the hop's NCCL kernel then started
# only near the end of the first step (both devices in call 8; with 8 or 16 SMs spared too) and ran ~580 us alone a
# call, where the lists' small kernels between the pack and that step had kept it first (docs/DESIGN.md §3, Ring
# attention). Why (session 40): which of the two grids reaches the SMs first is a race, and NCCL's 4-CTA clusters
# find no free SMs beside the step's persistent programs. Off here; the ring asks for spans (`api.SPANS`) in its last
# wide step where the first step leaves SMs to the hop (`ring._hop_sms`, with NCCL_CGA_CLUSTER_SIZE=0).
LAYOUT_SPANS = False


def spanned(cfg, ctx, spec: bool, merge: bool, asked: bool = False) -> bool:
    """Whether the forward walks each query tile's span of key blocks (SPANS, `layout_spans`) rather than a list:
    LAYOUT_SPANS (or ``asked``: `api.SPANS`), a block layout (ctx's, [B|1, Hkv|1, G|1, nQ, nK]) the same for every
    head, of at most two key columns (a row's visible ones are then one run) and blocks of whole tiles, alone (no
    causal, window, segment ids or spec mask: ``spec``), and a ``merge`` into an earlier result (the rows of a tile that
    sees no key keep it: the kernel never runs that tile)."""
    if not ((LAYOUT_SPANS or asked) and cfg.layout and merge) or spec or cfg.causal or cfg.window or cfg.segments:
        return False
    shape = ctx["layout"].shape
    return shape[1] * shape[2] == 1 and shape[4] <= 2 and sub_blocks(cfg.layout_block) == (0, 0)


def layout_spans(ctx, cfg, seq: int, seq_k: int, batch: int, block_n: int = TILES["BLOCK_N"]):
    """SPANS' RANGES int32 [batch, N_M, 4] (`spanned`): for each query tile, the key blocks [lo, hi) of the visible
    columns of its layout row (one run), its full blocks the same (whole tiles: the kernel adds the keys' end,
    `_blocks`); lo = hi = 0 where the row sees none."""
    import jax.numpy as jnp

    lay = ctx["layout"]  # [B|1, 1, 1, nQ, nK]
    (lq, lk), cols = cfg.layout_block, lay.shape[4]
    n_m, n_n, per = -(-seq // BLOCK_M), -(-seq_k // block_n), lk // block_n
    rows = jnp.minimum(jnp.arange(n_m) * BLOCK_M // lq, lay.shape[3] - 1)
    vis = lay[:, 0, 0][:, rows].astype(bool)  # [B|1, N_M, nK]
    col = jnp.arange(cols, dtype=jnp.int32)
    first = jnp.min(jnp.where(vis, col, cols), axis=-1)
    end = jnp.max(jnp.where(vis, col + 1, 0), axis=-1)
    lo = jnp.where(end > first, jnp.minimum(first * per, n_n), 0)
    hi = jnp.where(end > first, jnp.minimum(end * per, n_n), 0)
    return jnp.broadcast_to(jnp.stack([lo, hi, lo, hi], axis=-1).astype(jnp.int32), (batch, n_m, 4))


def fwd_list_constexprs(table, cfg, block_n: int = TILES["BLOCK_N"]) -> dict:
    """The forward's list constexprs of its block lists ``table`` (`fwd_lists`' RANGES): LIST_BATCH, LIST_HEADS from
    its shape, SUB_Q, SUB_K from the call's block layout at the kernel's tiles (BLOCK_M x ``block_n``;
    `_layout_kinds`: 0, 0 where its blocks cover whole tiles)."""
    sub_q = sub_k = 0
    if cfg.layout:
        sub_q, sub_k = _sub_block(BLOCK_M, cfg.layout_block[0]), _sub_block(block_n, cfg.layout_block[1])
        if (sub_q, sub_k) == (BLOCK_M, block_n):
            sub_q = sub_k = 0
    return dict(LIST=True, LIST_BATCH=table.shape[0], LIST_HEADS=table.shape[1], SUB_Q=sub_q, SUB_K=sub_k)


def bwd_lists(ctx, cfg, seq: int, hkv: int, mask_tiles=None, batch: int = 1, heads: int = 1):
    """The backward's block lists (LIST, `listed`): (RANGES int32 [TB, TL, N_N, 1 + W (+ W)], its constexprs, each
    program's work int32 [TB, TL, N_N]) at its tiles (BWD_TILES: 64-row query blocks, 128-key blocks): per (batch row
    or 1, kv head or 1, key block) the count and the query blocks to visit (`_list_kinds`, ``mask_tiles`` over
    ``batch`` x ``heads`` query heads). Kinds shared by the heads give one list per key block that each query head of
    the group walks (LIST 1, W = N_MQ); kinds per query head give each kv head the items of its group's heads, each
    entry (hq * N_MQ + m) naming its head (LIST 2, W = GROUP * N_MQ)."""
    import jax.numpy as jnp

    kinds, words, sub_q, sub_k = _list_kinds(ctx, cfg, seq, BWD_TILES["BLOCK_M"], BWD_TILES["BLOCK_N"], mask_tiles,
                                             batch, heads)
    if words is not None:
        words = _broadcast_like(words, kinds)
    per_head = kinds.shape[1] > 1

    def by_keys(x):  # [TB, TH, N_MQ, N_N] -> [TB, TL, N_N, W]
        x = jnp.swapaxes(x, -1, -2)
        if not per_head:
            return x
        tb, hq, n_n, n_mq = x.shape
        x = jnp.swapaxes(x.reshape(tb, hkv, hq // hkv, n_n, n_mq), 2, 3)
        return x.reshape(tb, hkv, n_n, hq // hkv * n_mq)

    count, table = _compact(by_keys(kinds), None if words is None else by_keys(words), empty_entry=False)
    consts = dict(LIST=2 if per_head else 1, LIST_BATCH=table.shape[0], LIST_HEADS=table.shape[1], SUB_Q=sub_q,
                  SUB_K=sub_k)
    return table, consts, count


def _broadcast_like(words, kinds):
    import jax.numpy as jnp

    return jnp.broadcast_to(words, jnp.broadcast_shapes(words.shape, kinds.shape))
