"""Ring attention: train-mode attention with the sequence cut over a mesh axis (docs/DESIGN.md §3, "Ring
attention"). The runtime of every op's ring form (`<name>_ring`, `ejgen.ops.ring_attention`) and of the mesh
wrapper when it cuts the sequence.

Inside ``jax.shard_map`` each of the N devices of the axis holds n query rows and n key/value rows. Key/value blocks
travel the ring with ``jax.lax.ppermute`` (only the Hkv heads: GQA blocks are never repeated), one hop per step, the
next hop issued before the step's kernels so that the transfer overlaps them (and read only after them: an
optimization barrier, `_after_kernels`); each step runs the op's own per-device kernels on the local queries against
the block it holds and merges the partial result by its lse, in float32. The
backward walks the ring back (from the block each device held last, saved by the forward; blocks go the other way):
dQ stays home, dK/dV accumulators (float32) travel with their blocks, every step's kernels use the global lse, and a
ring that starts at distance 0 ends on each device's own block, its accumulators home without a last transfer.

What a step computes is decided once, statically, per (device, step, pair of query and key chunks) as a *kind*:
- ``SKIP``: no key of the block is visible to the chunk (causal, the window): nothing runs;
- ``FULL``: every pair passes causal and the window: the kernels with neither (segment ids and the spec's own
  mask still apply), so the Hopper set stays eligible;
- ``DIAGONAL``: the chunk against its own keys: the call's causal / window as they are;
- ``PLACED``: anything else (a window that cuts the block, a spec whose score or mask reads q_idx / kv_idx): the
  kernels with explicit positions, the tokens' global ones.
Steps that no device needs are not taken (a window reaches few blocks). Sinks join once, in the final merge.

Token orders (``token_order``): ``contiguous`` (device d holds positions [d n, (d + 1) n)) and ``zigzag`` (the
sequence in 2N chunks of n / 2; device d holds chunks d and 2N - 1 - d, so every device has the same causal work:
the first step is one causal call, and every later step two full, unmasked c x c blocks). ``ring_permute`` /
``ring_unpermute`` lay a global sequence out in an order and back; ``ring_positions`` gives each row's position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ejgen.runtime.attention import api, segment_key
from ejgen.runtime.core import settings, sharding, vma
from ejgen.types import MaskInfo

# The Hopper forward's dynamic tile queue (`gluon.host.dynamic_tiles`) for the ring's per-step kernels: True asks
# for it whatever the gluon_dynamic_tiles setting says. The hop's NCCL kernel holds SMs while the step's kernel
# starts, so some of its persistent programs start late, and a static split of the tiles finishes late with them.
# H200 x 2 (session 15, one run), 32k tokens, 16/16 heads, zigzag: forward 4.91 -> 4.33 ms, forward+backward
# 16.64 -> 16.12 (notes/gluon-persistent-fwd.md, "Dynamic tile queue").
GLUON_DYNAMIC_TILES = True

# Zigzag steps after the first run each device's two full c x c pairs as one call (`_wide`): they always share a
# query chunk (c queries against the whole held block) or a key chunk (every local query against it). One launch, one
# merge and half the per-tile prologues a step instead of two. The call is the same on every device: all 2c local
# rows against the whole held block with a 2 x 2 block layout of c x c blocks, built at run time from the device's
# pairs (`_wide_layout`). Choosing between a c x 2c and a 2c x c call instead needs a `lax.cond` on the device index,
# which XLA's GPU runtime evaluates on the host: it copies the predicate back and waits for the stream, so the host
# cannot run ahead of the device (2 H100s, 32k tokens, session 20: the coalesced ring's calls spent 0.8 ms a call
# idle on that). A stage coalesces where the wide call's forward takes the same kernels as the square ones' (on a
# GPU: the Hopper set walks block layouts). The backward keeps its square pairs: its wide call (the switch
# COALESCE_BACKWARD, removed in session 38) lost three times, on 2 H100s in session 20 (15.3 / 16.1 ms a call against
# 14.7 / 14.9), on 2 H200s in session 34, and in session 37's trace, where its one kernel took 5422 us against
# 2293 + 2295 for the two pairs (+18%: the Hopper backward on the wide call's lists).
COALESCE = True

# SMs the first step's Hopper forward leaves to the hop beside it (`api.SPARE_SMS`; None: HOP_SMS where NCCL's
# kernels launch without clusters, `_hop_sms`). A persistent program holds its SM to the end: where the step's grid
# reaches the SMs before the hop's NCCL kernel does, that kernel starts only as the step's programs drain, ~1.5 ms
# late, and the next step waits for it (session 39). NCCL launches its kernels on Hopper as clusters of 4 CTAs, which
# need 4 idle SMs of one GPC (notes/studies/s39-hop-launch.md): 8 or 16 spared SMs do not give that (session 39, call
# 7), 40 do (session 40, s40a); session 39's spacer between the pack and the step did not (s40a: late on 7-15 of 16
# calls; its sum reached nothing, and JAX likely dropped it: see Q_SPACER), nor does sending the block apart
# (KV_APART) when the wide step walks spans (s40d: 9 and 14 of 16). With `NCCL_CGA_CLUSTER_SIZE=0` (a process's
# setting, read by NCCL when it makes its communicators) 8 do on both devices (16 calls back to back, 0 of 16 hops
# late); 4 do too, but the hop's kernel on 4 SMs takes ~1.9 ms, longer than the step (s40b). 2 H200s, 32k, zigzag,
# 16/16 heads, in turns with one GPU (s40b): 1.81x / 1.78x at 4 / 16 calls a sample with LAYOUT_SPANS against the
# lists' 1.79x / 1.74x.
FIRST_STEP_SPARE_SMS = None
HOP_SMS = 8

# The forward sends the held block as its arrays (one `lax.ppermute` of the dict) rather than packed into one `Wire`
# buffer (None: where XLA makes one collective of them, `_sends_apart`). XLA GPU keeps one collective-permute in flight
# (see `Wire`): sent apart, the arrays serialise, the first on the compute stream. Its CollectivePermuteCombiner makes
# them one collective up to `xla_gpu_collective_permute_combine_threshold_bytes` (XLA_FLAGS; 30 MiB + 7 by default:
# K and V are 64 MiB each at 32k tokens over 2 devices, 16 heads, bf16). Then there is no pack (62 us a call on an
# H200, the forward's only glue), and the hop needs nothing computed before it: its NCCL kernel started 13-16 us
# before the first step on both devices, one collective a call (session 40, s40c, 2 H200s, the threshold at 1 GiB).
# In turns with one GPU: 1.78x / 1.77x at 4 / 16 calls a sample against the packed block's 1.76x / 1.74x (s40c),
# 1.75x / 1.76x against 1.77x / 1.72x (s40d); with NCCL's clusters off and the first step's SMs spared
# (FIRST_STEP_SPARE_SMS), 1.83x / 1.80x (s40c). The backward starts from the packed buffer (packed after the
# forward's last step, where the training step needs it).
KV_APART = None

# A diagnostic (0: off): a kernel summing this many items of q that the first step waits for. It does not read the
# block, so XLA schedules it after the hop's start (session 40, `ring.py --parts schedule`: the start always precedes
# the first step's launch; with lists their small kernels sit between them, with spans nothing does, and the step's
# grid wins the race for the SMs). Session 39's spacer (s40a's too) read the packed block, and JAX dropped it: its sum
# reached nothing. Session 40 (s40h, 2 H200s, 32k, spans, the block packed, no process variable): with 16M items the
# hop started 21-23 us before the first step on both devices (0 of 16 late), spans 3.688 / 3.666 ms a call against
# one GPU's 6.769; 1.80x in turns at 16 calls (5 rounds, 1.70-1.84), not yet against the default in one call, and
# with the sum tied to the whole output then (a pass over it); now to one element. `gpu_round.sh s41a` times it.
Q_SPACER = 0

# The backward's dK/dV accumulators travel in the inputs' dtype (not float32) where they make at most this many hops
# before they are home (a ring of two steps: one; the last add and the cast to the inputs' dtype stay float32). Each
# hop then rounds a partial sum once more; on a 2-device zigzag ring the one travelling partial is a single pair's
# (already rounded by the kernel that made it) on one device, the sum of two on the other. Half the bytes to pack,
# send and read back: 2 H200s, 32k tokens, 16/16 heads, bf16: 256 -> 128 MiB a device, est. -68 us of the backward's
# glue (a helper's study of the ring's HLO, session 33, notes/perf.md; bf16 ring, S 1024: dk's rms error against
# float64 4.35e-3 -> 4.43e-3). Built in session 33, NOT GPU-timed: 0 (always float32) until `ring.py
# --narrow-accumulators` says.
NARROW_ACCUMULATOR_HOPS = 0

# The wide forward reads K and V out of the received buffer (`api.KV_WIRE`: the Hopper forward's KV_AT) instead of
# the slices `Wire.unpack` makes, which XLA GPU copies before a custom call: 2 x 32 MiB a device at 32k tokens over 2
# devices, 16/16 heads, bf16, ~65 us of the forward (a helper's study of the ring's HLO, session 33,
# notes/studies/s33-ring-p2-p3-plan.md, P2a). Session 34 (2 H200s, `ring.py`, each form twice in its own process):
# forward 4.01 / 4.05 ms -> 4.04 / 3.94 (noise: the default's runs alone span 1%), fwd+bwd 15.19 / 15.08 ->
# 15.07 / 15.15; its GPU tests pass. On (with MERGE_IN_KERNEL below).
KV_FROM_WIRE = True
# On a ring of two steps (2 devices from the own block, zigzag), the last step's wide forward merges its result into
# the first step's in its epilogue (the Hopper forward's MERGE over `api.MERGE_INTO`, its outputs written over the
# first step's out and lse): no float32 rows of the first step, no merge and cast after the kernels (~48 us of the
# forward at 32k tokens, 16/16 heads; one bf16 rounding of the output instead of two). P2b of
# notes/studies/s33-ring-p2-p3-plan.md. Session 34 (2 H200s, with KV_FROM_WIRE): forward 4.03 / 3.88 ms against
# the default's 4.01 / 4.05 (1.74x / 1.86x of the one GPU in the same runs), fwd+bwd 15.15 / 15.13 against 15.19 /
# 15.08; its GPU test passes (out, lse and gradients against the oracle). On.
MERGE_IN_KERNEL = True
# The backward's pairs add dQ into one float32 accumulator of every local row, in their kernels (the Hopper backward's
# DQ_ROWS / DQ_OFF_AT over `api.DQ_INTO`, the accumulator aliased from pair to pair) instead of each zeroing its own,
# cast to the inputs' dtype, cast back and added up in XLA: one zero-fill and one cast a backward (R128 W64 MiB a
# device at 32k tokens over 2 devices, 16/16 heads, instead of R256 W64; -67 us model), and dQ rounded once. P3 of
# notes/studies/s33-ring-p2-p3-plan.md. Session 35 (2 H200s, `ring.py`, each form twice in its own process, with
# KV_FROM_WIRE_BWD below): fwd+bwd 15.01 / 14.93 ms -> 14.88 / 15.02 (this alone) -> 14.87 / 14.95 (both), the same
# runs' one GPU 26.34-26.46; its GPU tests pass (out, lse and every gradient against the oracle). On.
DQ_ONCE = True
# The backward's pairs read K and V out of the received buffer (the Hopper backward's KV_AT / KV_ROWS / KV_OFF_AT over
# `api.KV_WIRE`, the pair's keys at a row of the block) instead of slices copied before each call (2 x 32 MiB a
# device at 32k tokens over 2 devices, 16/16 heads: ~34 us model). P1 of notes/studies/s33-ring-p2-p3-plan.md. Built in
# session 34; session 35 (2 H200s, with DQ_ONCE): fwd+bwd 14.87 / 14.95 ms against 14.88 / 15.02 without it (within
# the runs' spread, the model's direction); its GPU tests pass. On.
KV_FROM_WIRE_BWD = True
# The backward's pairs read their query rows of q and dO where they lie in the local tensors (the Hopper backward's
# QDO_IN_PLACE over `api.Q_ROWS_FROM`, from the dQ accumulator's row: with DQ_ONCE) instead of row slices copied before
# each call. Session 36's trace (2 H200s, 32k tokens, 16/16 heads, zigzag): two such copies of 32 MiB, 24.5 us each,
# before the first backward kernel. Session 37 (2 H200s, `ring.py`, each form twice in its own process, 4 calls a
# sample): fwd+bwd 14.99 / 15.19 ms (off) -> 15.01 / 14.99 (this) -> 15.00 / 15.06 (with ZEROS_BY_DELTA), the same
# runs' one GPU 27.02-27.16: within the runs' spread, fewer bytes by construction; its GPU tests pass. On.
Q_IN_PLACE = True
# With DQ_ONCE, the dQ accumulator's zeros by a memset in the delta kernel's launch (`gluon.host.backward_delta`'s
# ``zeros``) instead of XLA's broadcast: session 36's trace (2 H200s, 32k tokens, 16/16 heads, zigzag) had that
# broadcast at 58.3 us for 128 MiB (2.3 TB/s), where jax-triton's memsets of float32 accumulators ran at 4.3-4.6
# TB/s. Session 37: timed with Q_IN_PLACE above (within the spread); its GPU tests pass. On.
ZEROS_BY_DELTA = True
# On a ring of two steps from the own block, the backward's first step's pairs (the received block's) write dK / dV
# straight into the buffer that travels home, in the inputs' dtype (the Hopper backward's DKV_AT / DKV_ADD_AT over
# `api.DKV_INTO`: the first pair makes the buffer, the next writes into it, adding where it holds rows of the same
# keys), instead of bf16 outputs placed, packed into a float32 wire (the 384 MiB `input_concatenate_fusion`, 139 us
# in session 36's trace at 32k tokens over 2 H200s, 16/16 heads) and read back as float32 by the final add (512 ->
# 384 MiB). Rows no pair wrote travel as garbage and are dropped by the receiver (`_Owed`). A device whose pairs
# share a key chunk rounds their sum once in the kernel (round(round(A) + B)), so a key's roundings stay four, as
# with the float32 wire (notes/studies/s36-ring-bwd-glue.md, A2 without its scratch). Session 37 (2 H200s, `ring.py`,
# each form twice in its own process, 4 calls a sample): fwd+bwd 14.70 / 14.63 ms -> 14.55 / 14.57, the same runs' one
# GPU 26.48-26.63; one call's trace: the pack gone, the send 1110 -> 533 us, the final add 123 -> 91 us, the pair
# kernels ~2% slower (+45 us each, not understood), the call's span -145 / -166 us; its GPU tests pass. On.
DKV_INTO = True

TOKEN_ORDERS = ("contiguous", "zigzag")
SKIP, FULL, DIAGONAL, PLACED = 0, 1, 2, 3
KIND_NAMES = ("skip", "full", "diagonal", "placed")
WIDE = len(KIND_NAMES)  # a coalesced step's call (`_wide_forward`): never a slot's kind, only a key of Plan.calls
NEG_INF = float("-inf")

# Arguments of the op that a ring call does not take (yet), and why
_REFUSED = {
    "bias": "a bias [B, H, Sq, Sk] would have to travel with its key columns",
    "block_mask": "block masks are tiled over the whole sequence, not per shard",
    "q_positions": "explicit positions: the ring places tokens itself (token_order)",
    "kv_positions": "explicit positions: the ring places tokens itself (token_order)",
    "cu_seqlens_q": "varlen (cu_seqlens) packs sequences along the axis the ring cuts; use segment ids instead",
    "cu_seqlens_k": "varlen (cu_seqlens) packs sequences along the axis the ring cuts; use segment ids instead",
}


# Token orders --------------------------------------------------------------------------------------------------

def check_order(name: str, order) -> str:
    if order not in TOKEN_ORDERS:
        raise ValueError(f"{name}: token_order must be one of {', '.join(TOKEN_ORDERS)}, got {order!r}")
    return order


def device_positions(order: str, devices: int, n: int, device, xp=np):
    """int32 [n]: the global positions of the n rows a device holds (``device`` an int, or traced with xp=jnp)."""
    i = xp.arange(n, dtype=xp.int32)
    if order == "contiguous":
        return device * n + i
    c = n // 2
    return xp.where(i < c, device * c + i, (2 * devices - 1 - device) * c + i - c).astype(xp.int32)


def ring_positions(length: int, devices: int, token_order: str = "zigzag") -> np.ndarray:
    """int32 [length]: the global position of each row of a sequence laid out in ``token_order`` for ``devices``
    devices (row r of the laid-out sequence holds token ``positions[r]``; device d gets rows [d n, (d + 1) n))."""
    check_order("ring_positions", token_order)
    parts = 2 * devices if token_order == "zigzag" else devices
    if not (isinstance(length, int) and isinstance(devices, int)) or devices < 1 or length % parts:
        raise ValueError(f"ring_positions: a sequence of {length} tokens cannot be cut into {parts} equal "
                         f"{'chunks (zigzag: two per device)' if token_order == 'zigzag' else 'shards'}")
    n = length // devices
    return np.concatenate([device_positions(token_order, devices, n, d) for d in range(devices)])


def ring_permute(x, devices: int, *, token_order: str = "zigzag", axis: int = 1):
    """``x`` with its sequence axis laid out in ``token_order``: cut into ``devices`` contiguous shards (a mesh axis
    over that dim), each device holds its tokens of that order. Inputs, segment ids and targets all go through it;
    ``ring_unpermute`` brings outputs back. An array sharded over explicit mesh axes keeps its sharding."""
    x = jnp.asarray(x)
    return _reorder(x, ring_positions(x.shape[axis], devices, token_order), axis)


def ring_unpermute(x, devices: int, *, token_order: str = "zigzag", axis: int = 1):
    """The inverse of ``ring_permute``: a sequence laid out in ``token_order`` back in position order."""
    x = jnp.asarray(x)
    return _reorder(x, np.argsort(ring_positions(x.shape[axis], devices, token_order)), axis)


def _reorder(x, rows, axis: int):
    """``x``'s rows along ``axis`` in the order ``rows``; cut over explicit mesh axes (``jax.make_mesh``'s), it is
    gathered whole, reordered and cut again as it was (a gather of a cut dim has no sharding of its own)."""
    sharding = getattr(vma.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(spec):
        return jnp.take(x, rows, axis=axis)
    whole = jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, P()))
    return jax.sharding.reshard(jnp.take(whole, rows, axis=axis), sharding)


# The plan: what each step computes ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pair:
    """A query chunk (rows [q0, q1) of the local queries) against a key chunk (rows [k0, k1) of the held block)."""

    q: tuple
    kv: tuple


@dataclasses.dataclass(frozen=True)
class Stage:
    """Consecutive ring steps whose pairs are chunks of ``chunk`` rows (n: whole; n / 2: zigzag's chunks). At each
    step a device runs its non-skipped pairs in ``slots`` (as many as the busiest device needs):
    ``slots[step][slot][device] = (query chunk, key chunk, kind)``, SKIP where a device has fewer pairs."""

    chunk: int
    slots: tuple
    first: int  # its first step's index in the ring

    def kinds(self, slot: int) -> set:
        """The kinds any device takes in ``slot`` at any step of the stage."""
        return {entry[2] for step in self.slots for entry in step[slot]}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one ring call (hashable: the ``custom_vjp``'s static argument)."""

    op: str
    backend: object  # the generated backend module
    axis: object  # the mesh axis name
    devices: int
    order: str
    length: int  # rows per device
    start: int  # ring distance of the first step (< 0: blocks from the devices ahead come first)
    steps: int
    stages: tuple
    calls: tuple  # ((sq, sk, kind), AttentionConfig, KernelChoice)
    sinks: bool
    wide: tuple = ()  # per stage: whether the forward runs its steps' pairs as one call (`_wide`)

    def call(self, sq: int, sk: int, kind: int):
        for key, cfg, choice in self.calls:
            if key == (sq, sk, kind):
                return cfg, choice
        raise KeyError((sq, sk, kind))

    def distance(self, step: int) -> int:
        return self.start + step


def _spans(order: str, devices: int, n: int, device: int, rows: tuple) -> list:
    """The global position spans [(lo, hi)) of local rows [a, b) on ``device``."""
    a, b = rows
    if order == "contiguous":
        return [(device * n + a, device * n + b)]
    c = n // 2
    spans = []
    if a < c:
        spans.append((device * c + a, device * c + min(b, c)))
    if b > c:
        base = (2 * devices - 1 - device) * c
        spans.append((base + max(a, c) - c, base + b - c))
    return spans


def _relation(q_spans, kv_spans, causal: bool, window) -> str:
    """Whether causal and the window leave "none", "all" or "some" of the pairs between two sets of positions
    visible (global lengths are equal: no bottom-right offset). With d = q - kv, visible is lo <= d <= hi."""
    lo, hi = -math.inf, math.inf
    if window is not None:
        hi = window[0]
        lo = -window[1]
    if causal:
        lo = 0
    some, every = False, True
    for a0, a1 in q_spans:
        for b0, b1 in kv_spans:
            d_min, d_max = a0 - (b1 - 1), (a1 - 1) - b0
            some |= d_max >= lo and d_min <= hi
            every &= d_min >= lo and d_max <= hi
    return "all" if every else "some" if some else "none"


def _kind(order, devices, n, r, s, pair, causal, window, reads_positions) -> int:
    q_spans = _spans(order, devices, n, r, pair.q)
    kv_spans = _spans(order, devices, n, s, pair.kv)
    relation = _relation(q_spans, kv_spans, causal, window)
    if relation == "none":
        return SKIP
    if reads_positions:
        return PLACED
    if relation == "all":
        return FULL
    # the call's own rules on local rows hold when both sides are the same rows, one span each (a plain offset), or
    # causal alone (rows in increasing position order keep it whatever the gaps)
    if r == s and pair.q == pair.kv and (len(q_spans) == 1 or window is None):
        return DIAGONAL
    return PLACED


def _interval(needed: set, devices: int) -> tuple:
    """(start, steps): the shortest run of consecutive ring distances (mod devices) holding every needed one."""
    if len(needed) in (0, devices):
        return 0, devices if needed else 1
    d = sorted(needed)
    best = None
    for i in range(len(d)):  # the largest gap between consecutive needed distances ends the run
        nxt = d[(i + 1) % len(d)] + (devices if i + 1 == len(d) else 0)
        gap = nxt - d[i] - 1
        if best is None or gap > best[0]:
            best = (gap, d[(i + 1) % len(d)])
    gap, first = best
    return (first - devices if first > 0 else 0), devices - gap


def _stages(order, devices, n, start, steps, causal, window, reads_positions) -> tuple:
    """The ring's steps as stages: contiguous, one of whole blocks; zigzag, its first step (each device's own
    blocks) one causal call over both chunks where no window cuts the gap between them, the rest in chunks."""

    def stage(chunk, first, count):
        per = n // chunk
        steps_ = []
        for i in range(first, first + count):
            t = start + i
            busy = []  # per device: its non-skipped pairs (query chunk, key chunk, kind)
            for r in range(devices):
                s = (r - t) % devices
                pairs = [(a, b, _kind(order, devices, n, r, s, Pair((a * chunk, (a + 1) * chunk),
                                                                    (b * chunk, (b + 1) * chunk)),
                                      causal, window, reads_positions))
                         for a in range(per) for b in range(per)]
                busy.append([p for p in pairs if p[2] != SKIP])
            width = max(1, max(len(b) for b in busy))
            steps_.append(tuple(tuple(busy[r][j] if j < len(busy[r]) else (0, 0, SKIP) for r in range(devices))
                                for j in range(width)))
        width = max(len(step) for step in steps_)  # one slot count for the whole stage (the scan's body)
        steps_ = [step + ((tuple((0, 0, SKIP) for _ in range(devices)),) * (width - len(step))) for step in steps_]
        return Stage(chunk, tuple(steps_), first)

    if order == "contiguous":
        return (stage(n, 0, steps),)
    if start == 0 and window is None:  # the first step is each device's own blocks: one causal call over both
        return tuple(s for s in (stage(n, 0, 1), stage(n // 2, 1, steps - 1) if steps > 1 else None) if s)
    return (stage(n // 2, 0, steps),)


def _wide(stage: Stage) -> bool:
    """Whether every step of a stage of zigzag chunks gives every device exactly two FULL pairs that share a query
    chunk and take both key chunks or share a key chunk and take both query chunks: they then run as one 2c x 2c
    call with a block layout of the two (COALESCE, `_wide_layout`: the forward's). Causal
    zigzag rings past their first step are so; windows are not."""
    if len(stage.slots[0]) != 2:
        return False
    for step in stage.slots:
        for (qa, ka, kind_a), (qb, kb, kind_b) in zip(*step):
            if kind_a != FULL or kind_b != FULL:
                return False
            if not ((qa == qb and {ka, kb} == {0, 1}) or (ka == kb and {qa, qb} == {0, 1})):
                return False
    return True


def _window_sides(window) -> tuple | None:
    if window is None:
        return None
    if isinstance(window, (int, np.integer)):
        return int(window), int(window)
    return int(window[0]), int(window[1])


# The call ----------------------------------------------------------------------------------------------------

def reject_unsupported(spec: api.SpecInfo, unsupported: dict) -> None:
    """A ring form takes the op's arguments but the mesh wrapper's; anything else is the op's own error."""
    mesh_args = sorted(n for n in unsupported if n in ("mesh", "in_specs", "out_specs"))  # token_order: its own
    if mesh_args:
        raise TypeError(f"{spec.name}_ring() got {mesh_args[0]}=: a ring form runs inside jax.shard_map (or under a "
                        f"mesh context on global arrays); to cut a call over a mesh, pass mesh= and in_specs= to "
                        f"{spec.name}() itself (a cut sequence runs this ring)")
    try:
        api.reject_unsupported(spec, unsupported)
    except TypeError as e:
        raise TypeError(str(e).replace(f"{spec.name}()", f"{spec.name}_ring()", 1)) from None


def refuse(name: str, spec: api.SpecInfo, arguments: dict) -> None:
    """What a ring cannot take, each a ValueError naming it (``arguments``: the op's keyword arguments by name; the
    mesh wrapper asks before it cuts a sequence)."""
    for arg, why in _REFUSED.items():
        if arguments.get(arg) is not None:
            raise ValueError(f"{name}: {arg} cannot be combined with ring attention (a cut sequence): {why}")
    info = arguments.get("mask_info")
    if isinstance(info, MaskInfo) and info.has_mask:
        raise ValueError(f"{name}: mask_info with a dense attention_mask cannot be combined with ring attention (a cut "
                         f"sequence): a [B, Sq, Sk] mask would have to travel with its key columns; use segment ids")
    for param, dims in spec.params.items():
        if any(d in ("q_len", "kv_len") for d in dims):
            raise ValueError(f"{name}: param {param} has a q_len / kv_len dim ({spec.path}): ring attention does not "
                             f"take params shaped by the sequence yet")
    lengths = sorted(set(spec.kernel_reads) & {"q_len", "kv_len"})  # a segment key reads the global ones
    if lengths:
        raise ValueError(f"{name}: the spec's score or mask reads {', '.join(lengths)} ({spec.path}): ring attention "
                         f"does not give the kernels the global lengths yet")


def attention(spec: api.SpecInfo, backends: dict, query, key, value, *, axis_name, token_order, features: dict,
              params: dict, options: dict, deterministic, platform, return_lse):
    """The ring form of an op: ``features`` are the op's built-in arguments as it passes them to ``api.prepare``
    (compiled-in values included), ``params`` and ``options`` the spec's by name (``spec.params`` /
    ``spec.param_dtypes`` / ``spec.options`` say what they are). Inside ``jax.shard_map`` with ``axis_name`` bound,
    query, key and value are this device's shards; outside, global arrays cut over ``axis_name`` of the context mesh."""
    name = f"{spec.name}_ring()"
    check_order(name, token_order)
    refuse(name, spec, features)
    if not isinstance(axis_name, str):
        raise ValueError(f"{name}: axis_name must be the name of one mesh axis (a str), got {axis_name!r}")
    try:
        devices = sharding.axis_size(axis_name)
    except NameError:
        return _on_context_mesh(spec, backends, query, key, value, axis_name, token_order, features, params,
                                options, deterministic, platform, return_lse)
    return _inside(spec, backends, query, key, value, axis_name, devices, token_order, features, params, options,
                   deterministic, platform, return_lse)


def _on_context_mesh(spec, backends, query, key, value, axis_name, token_order, features, params, options,
                     deterministic, platform, return_lse):
    """A ring call on global arrays: run under ``jax.shard_map`` over the context mesh, the sequence (and segment
    ids) cut over ``axis_name``, everything else replicated."""
    name = f"{spec.name}_ring()"
    mesh = sharding.mesh_with_axis(name, axis_name)
    devices = mesh.shape[axis_name]
    seq = 2 if spec.layout == "bhsd" else 1
    tensors = [jnp.asarray(x) for x in (query, key, value)]
    parts, what = ((2 * devices, "chunks (zigzag: two per device") if token_order == "zigzag"
                   else (devices, "shards (one per device"))
    for t, x in zip(("query", "key", "value"), tensors):
        if x.ndim != 4 or x.shape[seq] % parts:
            raise ValueError(f"{name}: {t} {api._shape(x)}: its sequence dim must cut into {parts} equal {what} of "
                             f"mesh axis {axis_name!r}, {devices} devices)")
    cut = P(*([None] * seq + [axis_name]))
    arrays, static = {}, {}
    for group, values in (("features", features), ("params", params), ("options", options)):
        for arg, x in values.items():
            if isinstance(x, MaskInfo):
                arrays[(group, arg)] = (x, MaskInfo(None if x.q_segment_ids is None else P(None, axis_name),
                                                    None if x.kv_segment_ids is None else P(None, axis_name)))
            elif hasattr(x, "shape") and hasattr(x, "dtype"):
                arrays[(group, arg)] = (x, P())
            else:
                static[(group, arg)] = x
    keys = list(arrays)

    def body(q, k, v, values):
        groups = {"features": {}, "params": {}, "options": {}}
        for (group, arg), x in list(static.items()) + list(zip(keys, values)):
            groups[group][arg] = x
        return _inside(spec, backends, q, k, v, axis_name, devices, token_order, groups["features"],
                       groups["params"], groups["options"], deterministic, platform, return_lse)

    out_spec = cut if spec.layout == "bhsd" else P(None, axis_name)
    lse_spec = P(None, None, axis_name)
    run = vma.shard_map(body, mesh=mesh, in_specs=(cut, cut, cut, [arrays[k][1] for k in keys]),
                        out_specs=(out_spec, lse_spec) if return_lse else out_spec)
    return run(*tensors, [arrays[k][0] for k in keys])


def _inside(spec, backends, query, key, value, axis_name, devices, token_order, features, params, options,
            deterministic, platform, return_lse):
    name = f"{spec.name}_ring()"
    if not isinstance(return_lse, bool):
        raise ValueError(f"{name}: return_lse must be a Python bool, got {return_lse!r}")
    backend = api.choose_platform(spec, platform, backends)
    call = api.prepare(spec, query, key, value, **features)
    n = call.cfg.seq_q
    if call.cfg.seq_k != n:
        raise ValueError(f"{name}: query and key/value hold {n} and {call.cfg.seq_k} rows of the sequence on each "
                         f"device; ring attention cuts one sequence (self-attention) the same way for both")
    if token_order == "zigzag" and n % 2:
        raise ValueError(f"{name}: token_order='zigzag' needs an even number of rows per device (two chunks), got {n}")
    ctx = dict(call.ctx)
    for p, x in params.items():
        ctx["param_" + p] = api.check_param(spec, p, x, spec.params[p], jnp.dtype(spec.param_dtypes[p]), call.dims)
    for o, x in options.items():
        ctx["opt_" + o] = api.check_option(spec, o, x, spec.options[o])
    for entry in ("q_pos", "kv_pos"):  # each pair makes its own
        del ctx[entry]
    if spec.segment_key is not None:  # the mask's segment key: ids at the tokens' global positions, travelling as ids
        call = segment_key.lower_on_ring(spec, call, ctx, axis_name, devices,
                                         lambda device: device_positions(token_order, devices, n, device, xp=jnp))
        ctx.update(q_seg=call.ctx["q_seg"], kv_seg=call.ctx["kv_seg"])
    causal = call.cfg.causal
    window = _window_sides(features.get("sliding_window")) if call.cfg.window else None
    reads = bool(set(spec.kernel_reads) & {"q_idx", "kv_idx"})
    needed = {t for t in range(devices) for r in range(devices)
              if _kind(token_order, devices, n, r, (r - t) % devices, Pair((0, n), (0, n)), causal, window,
                       reads) != SKIP}
    start, steps = _interval(needed, devices)
    stages = _stages(token_order, devices, n, start, steps, causal, window, reads)
    det = deterministic
    calls, wide = {}, []
    for stage in stages:
        keys = [(stage.chunk, stage.chunk, kind)
                for kind in sorted({k for j in range(len(stage.slots[0])) for k in stage.kinds(j)} - {SKIP})]
        for key in keys:
            if key not in calls:
                calls[key] = _choose(spec, backends, platform, backend, call, key, det)
        coalesced = COALESCE and token_order == "zigzag" and stage.chunk * 2 == n and _wide(stage)
        if coalesced:  # only where the wide call's forward takes the square ones' kernels (a block layout of c x c
            # blocks, which the Hopper set walks where c covers or divides its tiles: `gluon.host.layout_misfit`)
            square = calls[(stage.chunk, stage.chunk, FULL)][1]
            key = (n, n, WIDE)
            if key not in calls:
                calls[key] = _choose(spec, backends, platform, backend, call, key, det)
            wide_choice = calls[key][1]  # (the same soft-cap tanh as the square pairs, whose backward follows it)
            coalesced = wide_choice.forward == square.forward and wide_choice.fast_tanh == square.fast_tanh
        wide.append(coalesced)
    plan = Plan(spec.name, backends[backend], axis_name, devices, token_order, n, start, steps, stages,
                tuple((k, cfg, choice) for k, (cfg, choice) in calls.items()), call.cfg.sinks, tuple(wide))
    q, k, v, ctx = api.vary_alike(call.q, call.k, call.v, ctx)
    out, lse = _ring(q, k, v, ctx, plan)
    b, _, hkv, g, dv = out.shape
    out = out.reshape(b, n, hkv * g, dv)
    if spec.layout == "bhsd":
        out = out.swapaxes(1, 2)
    lse = lse.reshape(b, hkv * g, n)
    return (out, lse) if return_lse else out


def _choose(spec, backends, platform, backend, call, key, deterministic):
    """The configuration and kernel choice of one kind of pair: sinks never (they join the final merge once), FULL
    without causal and window, PLACED with the tokens' positions, WIDE as FULL with a 2 x 2 block layout of
    sq / 2 x sk / 2 blocks (`_wide_layout`)."""
    sq, sk, kind = key
    flags = dict(seq_q=sq, seq_k=sk, sinks=False)
    if kind in (FULL, WIDE):
        flags.update(causal=False, window=False, window_span=0)
    elif kind == PLACED:
        flags.update(positions=True)
    if kind == WIDE:
        flags.update(layout=True, layout_block=(sq // 2, sk // 2))
    cfg = dataclasses.replace(call.cfg, **flags)
    ctx = {n: x for n, x in call.ctx.items() if n != "softmax_aux"}
    if kind == WIDE:
        ctx["layout"] = jnp.ones((1, 1, 1, 2, 2), bool)
    ctx = {n: (x[:, :sq] if n == "q_seg" else x[:, :sk] if n == "kv_seg" else x) for n, x in ctx.items()}
    one = dataclasses.replace(call, cfg=cfg, q=call.q[:, :sq], k=call.k[:, :sk], v=call.v[:, :sk], ctx=ctx)
    return cfg, api.choose_kernels(spec, backends, platform, backend, one, deterministic)


# Layouts between the ring (seq-major) and a backend's kernels ----------------------------------------------------

def _to_kernel(x, layout: str, rows: int, value):
    """out / d_out [B, S, Hkv, G, Dv] or lse / d_lse [B, Hkv, G, S] padded to ``rows`` in the kernel layout."""
    if x.ndim == 4:
        return jnp.pad(x, [(0, 0)] * 3 + [(0, rows - x.shape[3])], constant_values=value)
    x = jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * 3, constant_values=value)
    return x if layout == api.SEQ_MAJOR else x.transpose(0, 2, 3, 1, 4)


def _from_kernel(x, layout: str, rows: int):
    """Unpadded seq-major: q-like [B, S, Hkv, G, D] (5 dims) or k-like [B, S, Hkv, D] (4 dims) from the kernel's."""
    if layout == api.SEQ_MAJOR:
        return x[:, :rows]
    if x.ndim == 5:
        return x[:, :, :, :rows].transpose(0, 3, 1, 2, 4)
    return x[:, :, :rows].transpose(0, 2, 1, 3)


def _rows(x, start, count: int, axis: int = 1):
    return lax.dynamic_slice_in_dim(x, start, count, axis=axis)


def _pair_ctx(plan: Plan, ctx: dict, chunk: int, kind: int, held: dict, q0, k0, r, s, sk: int, wide_layout=None):
    """The ctx of one pair (query rows [q0, q0 + chunk), held key rows [k0, k0 + sk); offsets traced): the call's
    scalars, params and options, the chunks' segment ids and positions, a WIDE call's block layout."""
    out = {n: x for n, x in ctx.items() if n not in ("q_seg", "kv_seg", "softmax_aux")}
    if kind == WIDE:
        out["layout"] = wide_layout
    batch = held["k"].shape[0]
    if kind == PLACED:
        q_pos = _rows(device_positions(plan.order, plan.devices, plan.length, r, jnp), q0, chunk, 0)
        kv_pos = _rows(device_positions(plan.order, plan.devices, plan.length, s, jnp), k0, sk, 0)
    else:
        q_pos, kv_pos = jnp.arange(chunk, dtype=jnp.int32), jnp.arange(sk, dtype=jnp.int32)
    out["q_pos"] = jnp.broadcast_to(q_pos[None], (batch, chunk))
    out["kv_pos"] = jnp.broadcast_to(kv_pos[None], (batch, sk))
    if "q_seg" in ctx:
        out["q_seg"] = _rows(ctx["q_seg"], q0, chunk)
        out["kv_seg"] = _rows(held["kv_seg"], k0, sk)
    return out


def _pair_call(plan: Plan, kind: int, chunk: int, q, held, ctx, q0, k0, r, s, sk: int, wide_layout=None):
    """(cfg, kernels, the pair's Prepared call) of one kind (query rows ``chunk``, key rows ``sk``)."""
    cfg, choice = plan.call(chunk, sk, kind)
    one = api.Prepared(cfg, _rows(q, q0, chunk), _rows(held["k"], k0, sk), _rows(held["v"], k0, sk),
                       _pair_ctx(plan, ctx, chunk, kind, held, q0, k0, r, s, sk, wide_layout), {}, False, plan.op)
    return cfg, choice, one


def _pair_forward(plan: Plan, kind: int, chunk: int, q, held, ctx, q0, k0, r, s, sk: int | None = None,
                  wide_layout=None, wire=None, earlier=None, spare: int = 0, spans: bool = False):
    """(out [B, chunk, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, chunk]) of one pair of one kind (key rows ``sk``:
    chunk unless given; a WIDE call's ``wide_layout``). ``wire``: the held block's buffer as received,
    for a call over the whole block that the Hopper forward runs to read K and V out of (`api.KV_WIRE`,
    KV_FROM_WIRE); ``earlier``: (out, lse) of the same rows over other keys, which the result is merged into
    (`api.MERGE_INTO`, MERGE_IN_KERNEL: a call of every local row on the triton platform); ``spare``: SMs its Hopper
    forward leaves to a hop beside it (FIRST_STEP_SPARE_SMS, `api.SPARE_SMS`); ``spans``: its Hopper forward walks
    spans where it can (`api.SPANS`)."""
    cfg, choice, one = _pair_call(plan, kind, chunk, q, held, ctx, q0, k0, r, s, sk or chunk, wide_layout)
    backend = plan.backend
    qk, kk, vk, ck = one.padded(*backend.block_sizes(cfg), backend.TENSOR_LAYOUT)
    if choice.forward == "gluon":
        ck = _with_wire(ck, wire, held, None, sk or chunk, kk, backend.TENSOR_LAYOUT)
        ck = {**ck, **({api.SPARE_SMS: spare} if spare else {}), **({api.SPANS: True} if spans else {})}
    if earlier is not None:
        ck = {**ck, api.MERGE_INTO: earlier}
    asked = settings.settings(gluon_dynamic_tiles=True) if GLUON_DYNAMIC_TILES else contextlib.nullcontext()
    with asked:  # read when the kernel's launch is traced
        out, lse, _ = backend.forward(qk, kk, vk, ck, cfg, choice)
    return _from_kernel(out, backend.TENSOR_LAYOUT, chunk), lse[..., :chunk]


def _with_wire(ck, wire, held, k0, sk: int, kk, layout: str) -> dict:
    """``ck`` with `api.KV_WIRE`: the call's ``sk`` keys ``kk`` as rows of the held block's buffer as received,
    ``wire``, from row ``k0`` on (None: from row 0) where it has one and they are its rows as they are (seq-major,
    unpadded)."""
    if wire is None or layout != api.SEQ_MAJOR or kk.shape[1] != sk:
        return ck
    return {**ck, api.KV_WIRE: (wire.reshape(-1, held["k"].shape[1]), k0)}  # (every part of a block: items a row)


def _wide_layout(slots, r):
    """bool [1, 1, 1, 2, 2]: the chunk pairs a coalesced step's call sees (`_wide`): the row of the query chunk both
    pairs share, or the column of their key chunk. Chosen at run time from the device's index: one call for every
    device, no branch (see COALESCE)."""
    (qa, ka), qb = (slots[0, r, 0], slots[0, r, 1]), slots[1, r, 0]
    ids = jnp.arange(2)
    return jnp.where(qa == qb, ids[:, None] == qa, ids[None, :] == ka)[None, None, None]


def _wide_forward(plan: Plan, chunk: int, q, held, ctx, slots, r, s, wire=None, earlier=None, spans=False):
    """(out [B, n, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, n]) of a step's two FULL pairs as one call (`_wide`):
    every local row against the whole held block through `_wide_layout` (rows it leaves out: 0 and -inf);
    ``wire``: that block's buffer as received, ``earlier``: the rows' result so far, ``spans``: walked by spans
    (`_pair_forward`)."""
    n = 2 * chunk
    return _pair_forward(plan, WIDE, n, q, held, ctx, 0, 0, r, s, n, _wide_layout(slots, r), wire, earlier,
                         spans=spans)


def _pair_backward(plan: Plan, kind: int, chunk: int, q, held, ctx, out, lse, d_out, d_lse, delta, q0, k0, r, s,
                   sk: int | None = None, dq_acc=None, wire=None, dkv=None):
    """(dq [B, chunk, Hkv, G, D], dk, dv [B, sk, Hkv, D], param gradients) of one pair of one kind (key rows ``sk``:
    chunk unless given), from the global out and lse of its query rows and their
    delta, computed once per backward (`api.DELTA`: a backend that would compute it in XLA takes it, one pass over dO
    and O instead of one per pair). ``dq_acc``: float32 [B, n, Hkv, G, D], dq of every local row so far, which the
    pair's dq is added into (`api.DQ_INTO`, DQ_ONCE): its dq is then that accumulator, and (Q_IN_PLACE) q and d_out
    the rows the Hopper backward reads (`api.Q_ROWS_FROM`). ``wire``: the held block's buffer as received, which the
    Hopper backward reads the pair's K and V out of (`api.KV_WIRE`, KV_FROM_WIRE_BWD). ``dkv`` (with ``wire``, the
    Hopper backward): (buffer or None, add) of `api.DKV_INTO` (DKV_INTO): dk is then that dK / dV buffer, dv None."""
    sk = sk or chunk
    cfg, choice, one = _pair_call(plan, kind, chunk, q, held, ctx, q0, k0, r, s, sk)
    backend = plan.backend
    layout = backend.TENSOR_LAYOUT
    qk, kk, vk, ck = one.padded(*backend.block_sizes(cfg), layout)
    padded = qk.shape[1 if layout == api.SEQ_MAJOR else 3]
    rows = lambda x, axis=1: _rows(x, q0, chunk, axis)  # noqa: E731
    ck = {**ck, api.DELTA: _to_kernel(rows(delta, 3), layout, padded, 0)}  # padded rows: rowsum(0 * 0) - 0
    into = dq_acc is not None and choice.backward == "gluon"  # (else added here, after the kernels)
    if into:
        assert layout == api.SEQ_MAJOR and padded == chunk, "a dQ accumulator takes the pair's rows as they are"
        ck[api.DQ_INTO] = (dq_acc, q0)
        if Q_IN_PLACE:  # (the same rows of q and dO, read there)
            ck[api.Q_ROWS_FROM] = (q, d_out)
    if choice.backward == "gluon":
        ck = _with_wire(ck, wire, held, k0, sk, kk, layout)
    if dkv is not None:
        assert choice.backward == "gluon" and api.KV_WIRE in ck, "dK / dV into a wire: the Hopper backward's, with K/V"
        ck[api.DKV_INTO] = dkv
    dq, dk, dv, dctx = backend.backward(
        qk, kk, vk, _to_kernel(rows(out), layout, padded, 0), _to_kernel(rows(lse, 3), layout, padded, NEG_INF),
        None, _to_kernel(rows(d_out), layout, padded, 0), _to_kernel(rows(d_lse, 3), layout, padded, 0), ck, cfg,
        choice)
    if dq_acc is not None and not into:
        dq = api.add_rows(dq_acc, q0, _from_kernel(dq, layout, chunk))
    if dkv is not None:
        return dq, dk, None, dctx.get("params", {})
    return (dq if dq_acc is not None else _from_kernel(dq, layout, chunk), _from_kernel(dk, layout, sk),
            _from_kernel(dv, layout, sk), dctx.get("params", {}))


def _switch(stage: Stage, slot: int, kind, run, skip):
    """``run(kind)`` for the slot's kind on this device (traced), among the kinds the stage's devices take there;
    SKIP is ``skip()``. One kind for every device and step: no branch at all."""
    present = sorted(stage.kinds(slot))
    if len(present) == 1:
        return skip() if present[0] == SKIP else run(present[0])
    branches = [skip if k == SKIP else functools.partial(run, k) for k in present]
    index = jnp.asarray(np.array([present.index(k) if k in present else 0 for k in range(len(KIND_NAMES))],
                                 np.int32))[kind]
    return lax.switch(index, branches)


def _combine_threshold() -> int:
    """XLA GPU's `xla_gpu_collective_permute_combine_threshold_bytes` as XLA_FLAGS sets it (its last value), else XLA's
    default (30 MiB + 7)."""
    given = re.findall(r"--xla_gpu_collective_permute_combine_threshold_bytes=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(given[-1]) if given else 30 * 2**20 + 7


def _sends_apart(own: dict) -> bool:
    """Whether the forward sends the held block ``own`` as its arrays (KV_APART; None: on a GPU, where XLA's combiner
    makes one collective of them: their bytes within its threshold)."""
    if KV_APART is not None:
        return KV_APART
    return (len(own) > 1 and jax.default_backend() == "gpu"
            and sum(x.size * x.dtype.itemsize for x in own.values()) <= _combine_threshold())


def _hop_sms() -> int:
    """SMs the first step leaves to the hop (FIRST_STEP_SPARE_SMS; None: HOP_SMS where NCCL's kernels launch without
    clusters, `NCCL_CGA_CLUSTER_SIZE=0`, else none)."""
    if FIRST_STEP_SPARE_SMS is not None:
        return FIRST_STEP_SPARE_SMS
    return HOP_SMS if os.environ.get("NCCL_CGA_CLUSTER_SIZE", "").strip() == "0" else 0


def _shift(plan: Plan, x, hops: int):
    """``x`` (a `Wire` buffer, or with KV_APART the block's dict) sent ``hops`` devices along the ring (device i to
    i + hops)."""
    hops %= plan.devices
    if hops == 0:
        return x
    perm = [(i, (i + hops) % plan.devices) for i in range(plan.devices)]
    return lax.ppermute(x, plan.axis, perm)


@dataclasses.dataclass(frozen=True)
class Wire:
    """How a dict of arrays travels the ring as one buffer. XLA's GPU scheduler keeps one collective-permute in
    flight: two arrays sent apart serialise, the second waiting for the step's kernels to end (two H200s, 32k tokens:
    K and V sent apart left 0.5 of the step's 0.8 ms of transfer exposed); one buffer overlaps whole. Each array is
    bitcast to the unsigned type of the smallest item size among them and flattened; unpacking slices and bitcasts
    back (XLA fuses that into the slices the steps take anyway)."""

    names: tuple
    shapes: tuple
    dtypes: tuple
    unit: object

    @classmethod
    def of(cls, tree: dict, unit=None) -> "Wire":
        """The wire of ``tree``; ``unit``: a narrower unsigned type than its own (to join another wire's buffer)."""
        names = tuple(tree)
        dtypes = tuple(jnp.dtype(tree[n].dtype) for n in names)
        unit = jnp.dtype(unit or f"uint{8 * min(d.itemsize for d in dtypes)}")
        return cls(names, tuple(tuple(tree[n].shape) for n in names), dtypes, unit)

    @property
    def size(self) -> int:
        """The buffer's length (in ``unit`` items)."""
        return sum(math.prod(shape) * (dtype.itemsize // self.unit.itemsize)
                   for shape, dtype in zip(self.shapes, self.dtypes))

    def pack(self, tree: dict):
        parts = [(x if x.dtype == self.unit else lax.bitcast_convert_type(x, self.unit)).reshape(-1)
                 for x in (tree[n] for n in self.names)]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    def unpack(self, buffer) -> dict:
        out, at = {}, 0
        for name, shape, dtype in zip(self.names, self.shapes, self.dtypes):
            ratio = dtype.itemsize // self.unit.itemsize
            size = math.prod(shape) * ratio
            x = lax.slice_in_dim(buffer, at, at + size).reshape(shape + ((ratio,) if ratio > 1 else ()))
            out[name] = x if dtype == self.unit else lax.bitcast_convert_type(x, dtype)
            at += size
        return out


def _step_inputs(plan: Plan, stage: Stage, reverse: bool):
    """The scan's per-step inputs: slots int32 [steps, slots, devices, 3] (query chunk, key chunk, kind) and each
    step's ring distance, in ring order or (``reverse``) from the stage's last step to its first."""
    slots = np.array(stage.slots, np.int32)
    distances = np.arange(stage.first, stage.first + len(stage.slots), dtype=np.int32) + plan.start
    if reverse:
        slots, distances = slots[::-1], distances[::-1]
    return jnp.asarray(slots), jnp.asarray(distances)


def _runs(plan: Plan, reverse: bool = False):
    """The ring's steps as scans: [(stage, per-step inputs, walk index of the run's first step, steps)], walked in
    ring order (the forward) or ``reverse`` (the backward: from the last step to the first). The steps a body treats
    apart are runs of one: the walk's first (the forward's own block when the ring starts at distance 0, not
    unpacked; the backward has no accumulators to send yet) and last (no block sent on), and in reverse the one
    before the last where the ring starts at distance 0 (the device behind holds its own block next: none sent)."""
    special = {1, plan.steps - 1} | ({plan.steps - 2} if reverse and plan.start == 0 else set())
    runs, walked = [], 0
    for stage in reversed(plan.stages) if reverse else plan.stages:
        xs = _step_inputs(plan, stage, reverse)
        steps = len(stage.slots)
        cuts = sorted({0, steps} | {c - walked for c in special if walked < c < walked + steps})
        for lo, hi in zip(cuts, cuts[1:]):
            runs.append((stage, jax.tree_util.tree_map(lambda x, lo=lo, hi=hi: x[lo:hi], xs), walked + lo, hi - lo))
        walked += steps
    return runs


def _after_kernels(received, *results):
    """``received`` (a block in flight) and a step's ``results``, as they are, tied by an optimization barrier: what
    reads the received buffer (the next step's unpacking) cannot be scheduled before the kernels that made
    ``results``. XLA's latency-hiding scheduler takes a custom call for short, and put the next block's wait and
    unpacking before the step's own kernel (two H200s, 32k tokens: the first step's kernel started 0.5 ms late,
    after the whole transfer)."""
    return lax.optimization_barrier((received, *results))


def _steps(body, carry, xs):
    """``lax.scan(body, carry, xs)``'s final carry; a run of one step (every run of a 2-device ring, the first and
    last of any ring) calls ``body`` once instead: no loop, whose carried buffers XLA copies in and out."""
    if jax.tree_util.tree_leaves(xs)[0].shape[0] == 1:
        return body(carry, jax.tree_util.tree_map(lambda x: x[0], xs))[0]
    return lax.scan(body, carry, xs)[0]


def _held(k, v, ctx):
    held = {"k": k, "v": v}
    if "kv_seg" in ctx:
        held["kv_seg"] = ctx["kv_seg"]
    return held


def _forward(q, k, v, ctx, plan: Plan):
    """(out [B, n, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, n] float32, sinks included, the block held at the last
    step as its `Wire` buffer: where the backward's reverse ring starts)."""
    axes = vma.varying_axes(q, k, v, ctx)
    r = lax.axis_index(plan.axis)
    b, n, hkv, g, _ = q.shape
    dv = v.shape[-1]
    acc, lse = vma.vary((jnp.zeros((b, n, hkv, g, dv), jnp.float32),
                         jnp.full((b, hkv, g, n), NEG_INF, jnp.float32)), axes)
    own = _held(k, v, ctx)
    wire = Wire.of(own)
    # the held block as one buffer (see Wire) or, where XLA makes one collective of them, as its arrays (KV_APART); in
    # a batch of calls its hop starts before the first step only where small kernels run ahead of that step's launch
    # or the step leaves SMs to it (FIRST_STEP_SPARE_SMS: docs/DESIGN.md §3, Ring attention, sessions 39-40)
    apart = _sends_apart(own)
    spare = _hop_sms()
    travel = _shift(plan, own if apart else wire.pack(own), plan.start)
    spacer = None
    if Q_SPACER and plan.start == 0:  # (its sum reaches the output, times 0: or JAX would drop it)
        q, spacer = lax.optimization_barrier((q, jnp.sum(q.reshape(-1)[:Q_SPACER].astype(jnp.float32))))
    merging = _merges_in_kernel(plan, n)
    earlier = []  # (merging) the first step's own out and lse, as its kernel gave them
    for stage, xs, at, count in _runs(plan):
        chunk = stage.chunk
        first, last = at == 0, at + count == plan.steps
        wide = bool(plan.wide) and plan.wide[plan.stages.index(stage)] and not first

        def body(carry, xs, stage=stage, chunk=chunk, first=first, last=last, unrolled=count == 1, wide=wide, at=at):
            travel, acc, lse = carry
            held = own if first and plan.start == 0 else travel if apart else wire.unpack(travel)
            ahead = travel if last else _shift(plan, travel, 1)  # the next step's block, in flight meanwhile
            slots, t = xs
            s = (r - t) % plan.devices
            if wide:  # one call for the step's two pairs (COALESCE), merged into every row; by spans where no hop
                # runs beside it and the first step's hop had SMs of its own (`_hop_sms`): then no list-building
                # kernels need run ahead of the first step to let the hop start first (`gluon.host.LAYOUT_SPANS`)
                result = _wide_forward(plan, chunk, q, held, ctx, slots, r, s,
                                       travel if not apart and _wire_readable(wire, KV_FROM_WIRE) and held is not own
                                       else None,
                                       earlier[0] if merging else None, spans=spare > 0 and last)
                if merging:  # (the last step: merged by its kernel)
                    return (ahead, *result), None
                if not last:
                    ahead, result = _after_kernels(ahead, result)
                acc, lse = _merge(acc, lse, *result, 0, 2 * chunk, in_place=not unrolled)
                return (ahead, acc, lse), None
            pairs = []  # per slot: (q0, the pair's out and lse as its kernels give them)
            for j in range(slots.shape[0]):
                q0, k0, kind = slots[j, r, 0] * chunk, slots[j, r, 1] * chunk, slots[j, r, 2]

                def run(kind, q0=q0, k0=k0):  # (a hop beside it: SMs spared for its kernel)
                    return _pair_forward(plan, kind, chunk, q, held, ctx, q0, k0, r, s,
                                         spare=spare if first and not last else 0)

                def skip():
                    return vma.vary((jnp.zeros((b, chunk, hkv, g, dv), q.dtype),
                                     jnp.full((b, hkv, g, chunk), NEG_INF, jnp.float32)), axes)

                pairs.append((q0, _switch(stage, j, kind, run, skip)))
            if not last:  # the barrier ties the kernels' own results (docs/DESIGN.md §3, Ring attention): the float32
                # writes and merges come after it, free to fuse with their readers (the next step's merges, the
                # final cast); tying the merged float32 rows made XLA write them out before the barrier (2 H100s,
                # 32k tokens, zigzag: the first step's 128 MiB float32 rows, a 65 us select between the kernels)
                ahead, results = _after_kernels(ahead, [p[1] for p in pairs])
                pairs = [(q0, res) for (q0, _), res in zip(pairs, results)]
            for j, (q0, (out_p, lse_p)) in enumerate(pairs):
                if merging:  # (the first step: one pair of every row) kept as the kernel gave it for the last
                    earlier.append((out_p, lse_p))
                elif first and _fresh(stage, j):  # the rows' first result: written, not merged into zeros
                    acc, lse = _write(acc, lse, out_p, lse_p, q0, chunk)
                else:  # outside a loop, rows updated by selects (fused with the reader), not in place
                    acc, lse = _merge(acc, lse, out_p, lse_p, q0, chunk, in_place=not unrolled)
            return (ahead, acc, lse), None

        travel, acc, lse = _steps(body, (travel, acc, lse), xs)
    if plan.sinks:
        acc, lse = api.join_sinks(acc, lse, ctx["softmax_aux"])  # aux [Hkv, G, n_sinks]
    if spacer is not None:  # (one element, updated in place: s40h's whole add took a pass over the output)
        acc = acc.at[(0,) * acc.ndim].add((0 * spacer).astype(acc.dtype))
    return acc.astype(q.dtype), lse, wire.pack(travel) if apart else travel


def _merges_in_kernel(plan: Plan, n: int) -> bool:
    """Whether the last step's wide forward merges its result into the first step's in its kernel (MERGE_IN_KERNEL):
    a ring of two steps from the device's own block, the first one call of every local row, the second coalesced,
    both on the Hopper forward, no sinks (they join the merged result after)."""
    if not MERGE_IN_KERNEL or plan.sinks or plan.start != 0:
        return False
    runs = list(_runs(plan))
    if len(runs) != 2 or any(count != 1 for *_, count in runs):
        return False
    (first, _, _, _), (second, _, _, _) = runs
    wide = bool(plan.wide) and plan.wide[plan.stages.index(second)]
    if not wide or first.chunk != n or len(first.slots[0]) != 1:
        return False
    return all(plan.call(sq, sk, kind)[1].forward == "gluon" for sq, sk, kind in ((n, n, WIDE), *(
        (n, n, k) for k in first.kinds(0) if k != SKIP)))


def _hopper_backward(plan: Plan) -> bool:
    """Whether every call the backward runs (its pairs: a coalesced step's wide call is the forward's alone) takes the
    Hopper backward."""
    return all(choice.backward == "gluon" for (_, _, kind), _, choice in plan.calls if kind != WIDE)


def _dq_into(plan: Plan) -> bool:
    """Whether the backward's pairs add dQ into one float32 accumulator of every local row in their kernels
    (DQ_ONCE): every backward call on the Hopper kernels."""
    return bool(DQ_ONCE and _hopper_backward(plan))


def _dkv_into(plan: Plan, kv: "Wire") -> bool:
    """Whether the backward's first step's pairs write dK / dV into the buffer that travels (DKV_INTO): DQ_ONCE's
    conditions (every call the backward runs on the Hopper kernels), a ring of two steps from the device's
    own block (the first backward step holds the received block, whose dK / dV make the one hop home; the second
    keeps its own), that step's pairs reading K and V out of the wire (KV_FROM_WIRE_BWD), none skipped on any device,
    and ``kv`` (the wire of k and v alone, the dK / dV buffer's layout) of one 16-bit dtype and shape."""
    if not (DKV_INTO and _dq_into(plan) and plan.start == 0 and plan.steps == 2 and kv.shapes[0] == kv.shapes[1]
            and _wire_readable(kv, KV_FROM_WIRE_BWD)):
        return False
    runs = _runs(plan, reverse=True)
    stage = runs[0][0]
    return len(runs) == 2 and all(SKIP not in stage.kinds(j) for j in range(len(stage.slots[0])))


class _Owed(typing.NamedTuple):
    """dK / dV of the block held last step as the buffer its pairs wrote (DKV_INTO: the unit items of k then v of the
    block's rows, in the inputs' dtype), and ``cover`` bool [rows]: the rows that the pairs of the device sending it
    here wrote (the rest hold garbage)."""

    buffer: object
    cover: object


def _covered(slots, device, chunk: int, rows: int):
    """bool [rows]: the key rows that ``device``'s pairs of a step (``slots`` [slots, devices, 3]) reach."""
    chunks = jnp.arange(rows // chunk, dtype=jnp.int32)
    hit = functools.reduce(jnp.logical_or, [chunks == slots[j, device, 1] for j in range(slots.shape[0])])
    return jnp.repeat(hit, chunk)


def _wire_readable(wire: "Wire", switch: bool) -> bool:
    """Whether kernels may read K and V out of a received buffer (where ``switch`` says so): k then v first in it, of
    one 16-bit dtype, the buffer's unit."""
    return (switch and wire.names[:2] == ("k", "v") and wire.dtypes[0] == wire.dtypes[1]
            and wire.dtypes[0].itemsize == 2 and wire.unit.itemsize == 2)


def _moved(w):
    """[B, Hkv, G, S] weights as [B, S, Hkv, G, 1], to scale outputs."""
    return jnp.moveaxis(w, 3, 1)[..., None]


def _fresh(stage: Stage, slot: int) -> bool:
    """Whether ``slot`` of the stage's first step, the ring's first, writes query rows that no earlier slot of that
    step wrote, on every device (its result is then the rows' first: nothing to merge with)."""
    step = stage.slots[0]
    return all(step[i][r][2] == SKIP or step[i][r][0] != step[slot][r][0]
               for r in range(len(step[slot])) for i in range(slot))


def _write(acc, lse, out_p, lse_p, q0, chunk: int):
    """The rows' first result, as `_merge` into the zeros and -inf it replaces would give it (bitwise: a weight of
    exp(0) on the pair, 0 where the rows see nothing), without reading those: the ring's first step of 2 devices is
    one pair of all the rows (a 16k x 16k causal block at 32k tokens: 128 MB of float32 not zeroed, read and
    rewritten)."""
    out_p = jnp.where(_moved(lse_p) == NEG_INF, 0.0, out_p.astype(jnp.float32))
    if chunk == acc.shape[1]:
        return out_p, lse_p
    return lax.dynamic_update_slice_in_dim(acc, out_p, q0, 1), lax.dynamic_update_slice_in_dim(lse, lse_p, q0, 3)


def _merge(acc, lse, out_p, lse_p, q0, chunk: int, in_place: bool = True):
    """Merge one pair's normalised output into the running one of its query rows [q0, q0 + chunk), by their lse
    (float32). ``in_place``: the rows updated in place (a loop's carried buffers); else by `_updated`'s selects."""

    def merged(old_acc, old):
        return api.merge_into(out_p, lse_p, (old_acc, old))

    if in_place:
        new_acc, new = merged(_rows(acc, q0, chunk), _rows(lse, q0, chunk, 3))
        return lax.dynamic_update_slice_in_dim(acc, new_acc, q0, 1), lax.dynamic_update_slice_in_dim(lse, new, q0, 3)
    return _updated((acc, lse), (1, 3), q0, chunk, merged)


def _updated(xs: tuple, axes: tuple, start, chunk: int, update):
    """``xs`` with rows [start, start + chunk) along ``axes`` (one per array; ``start`` a traced multiple of
    ``chunk``) replaced by ``update(*those rows)``, bitwise as dynamic_update_slice would write them, by a select per
    chunk of rows instead (docs/DESIGN.md §3, Ring attention): outside a loop XLA fuses that into what reads the
    result (the next merge, the final cast), where an update in place is a buffer written out first."""
    rows = xs[0].shape[axes[0]]
    if chunk == rows:
        return update(*xs)
    parts = [[] for _ in xs]
    for c in range(rows // chunk):
        old = [lax.slice_in_dim(x, c * chunk, (c + 1) * chunk, axis=a) for x, a in zip(xs, axes)]
        for part, o, u in zip(parts, old, update(*old)):
            part.append(jnp.where(start == c * chunk, u, o))
    return tuple(jnp.concatenate(part, axis=a) for part, a in zip(parts, axes))


def _placed(parts, chunk: int, rows: int):
    """float32 [B, rows, ...]: the pairs' results ``parts`` [(start, x [B, chunk, ...])] added up on rows
    [start, start + chunk), slot after slot (starts are multiples of ``chunk``, traced), zeros on rows no pair has:
    per chunk of rows, a sum of selects, which XLA fuses with its readers: the sums, in the order, of adding each
    into zeros in turn (x + 0 is x; a pair that misses a chunk adds +0 there)."""
    chunks = []
    for c in range(rows // chunk):
        total = None
        for start, x in parts:
            x = jnp.where(start == c * chunk, x.astype(jnp.float32), 0.0)
            total = jnp.zeros_like(x) + x if total is None else total + x
        chunks.append(total)
    return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=1)


def _backward(plan: Plan, residuals, cotangents):
    """The forward's ring walked back: each device starts from the block it held at the forward's last step (saved by
    the forward: one more block per device), blocks travel one hop the other way each step (device i to i - 1) with
    their float32 dK/dV accumulators one hop behind, and the ring ends at distance ``plan.start``: a ring that starts
    at 0 (causal) ends on each device's own block, its accumulators home, no transfer after the last step's
    kernels."""
    q, k, v, ctx, out, lse, last_held = residuals
    d_out, d_lse = cotangents
    axes = vma.varying_axes(q, k, v, ctx, d_out, d_lse)
    r = lax.axis_index(plan.axis)
    f32 = jnp.float32
    param_names = [n for n in ctx if n.startswith("param_")]
    zeros = lambda x: jnp.zeros(x.shape, f32)  # noqa: E731
    grads = vma.vary({n[len("param_"):]: zeros(ctx[n]) for n in param_names}, axes)
    into = _dq_into(plan)
    # (into, ZEROS_BY_DELTA: the dQ accumulator's zeros by the delta kernel's launch)
    delta, dq_zeros = _delta(plan, out, d_out, d_lse, q.shape if into and ZEROS_BY_DELTA else None)
    own = _held(k, v, ctx)
    wire = Wire.of(own)
    # the accumulators travel as one buffer where they go alone, and join the block's buffer, in its unit, where that
    # is no wider; in float32, or in the inputs' dtypes where they make few hops (NARROW_ACCUMULATOR_HOPS)
    joined = wire.unit.itemsize <= 4
    narrow = plan.steps - 1 <= NARROW_ACCUMULATOR_HOPS
    carried = {"k": k.dtype if narrow else f32, "v": v.dtype if narrow else f32}
    acc_shapes = {n: jax.ShapeDtypeStruct(x.shape, carried[n]) for n, x in (("k", k), ("v", v))}
    alone, owed = Wire.of(acc_shapes), Wire.of(acc_shapes, unit=wire.unit if joined else None)
    travelling = lambda acc: {n: x.astype(carried[n]) for n, x in acc.items()}  # noqa: E731
    size = wire.size
    # DKV_INTO: the first step's pairs write dK / dV into the buffer that travels (`_Owed`), laid out as this wire
    dkv_wire = Wire.of({"k": k, "v": v})
    dkv = _dkv_into(plan, dkv_wire)
    # travel: the held block's buffer (None: the device's own block, not packed); pending: dK/dV of the block held
    # last step, to pass on (None before the first step); dq None before the first step's pairs, or (DQ_ONCE) the
    # one accumulator every pair's kernel adds into
    travel, pending, dq = last_held, None, vma.vary(zeros(q) if dq_zeros is None else dq_zeros, axes) if into else None
    for stage, xs, at, count in _runs(plan, reverse=True):
        chunk = stage.chunk
        first, last = at == 0, at + count == plan.steps
        # this step's distance where a run of one knows it; keep: no block sent on (the last step, or the one before
        # it where the ring starts at distance 0: the device behind then holds its own block)
        here = plan.distance(plan.steps - 1 - at) if count == 1 else None
        keep = last or (count == 1 and at == plan.steps - 2 and plan.start == 0)

        def body(carry, xs, stage=stage, chunk=chunk, first=first, keep=keep, here=here, unrolled=count == 1):
            travel, pending, dq, grads = carry
            owed_here = isinstance(pending, _Owed)  # (DKV_INTO: the buffer as the pairs wrote it, sent as it is)
            held = own if travel is None or here == 0 else wire.unpack(travel)
            # in flight while this step computes, as one buffer: the block held now, to the device behind for the
            # next step, and the accumulators of the block held last step, which that device holds now
            block = None if keep else wire.pack(own) if travel is None else travel
            received, both = {}, block is not None and not first and joined  # read only after the step's kernels
            if both:
                received["both"] = _shift(plan, jnp.concatenate([block, owed.pack(travelling(pending))]), -1)
            else:
                if block is not None:
                    received["block"] = _shift(plan, block, -1)
                if not first:
                    received["owed"] = _shift(plan, pending.buffer if owed_here else alone.pack(travelling(pending)),
                                              -1)
            slots, t = xs
            s = (r - t) % plan.devices
            pairs = []  # per slot: (q0, k0, the pair's dq, dk, dv, param gradients as its kernels give them)
            acc = dq  # (into) the accumulator as the slot's kernels find it
            from_wire = travel if held is not own and _wire_readable(wire, KV_FROM_WIRE_BWD) else None
            into_wire = dkv and first
            assert not into_wire or (from_wire is not None and not both), "DKV_INTO: the received block's pairs"
            buffer = None  # (into_wire) the dK / dV buffer as the slot's kernels find it (None: they make it)
            for j in range(slots.shape[0]):
                q0, k0, kind = slots[j, r, 0] * chunk, slots[j, r, 1] * chunk, slots[j, r, 2]
                # (into_wire) added into the buffer's rows where an earlier slot wrote those keys
                add = None if j == 0 or not into_wire else functools.reduce(
                    jnp.logical_or, [slots[i, r, 1] == slots[j, r, 1] for i in range(j)]).astype(jnp.int32)

                def run(kind, q0=q0, k0=k0, acc=acc, buffer=buffer, add=add):
                    return _pair_backward(plan, kind, chunk, q, held, ctx, out, lse, d_out, d_lse, delta, q0, k0,
                                          r, s, dq_acc=acc if into else None, wire=from_wire,
                                          dkv=(buffer, add) if into_wire else None)

                def skip(j=j, run=run, acc=acc):  # zeros as the slot's kernels give their results (into: dq as found)
                    kinds = sorted(stage.kinds(j) - {SKIP})
                    like = (jax.eval_shape(functools.partial(run, kinds[0])) if kinds else
                            (jax.ShapeDtypeStruct(q.shape[:1] + (chunk,) + q.shape[2:], q.dtype),
                             jax.ShapeDtypeStruct(k.shape[:1] + (chunk,) + k.shape[2:], k.dtype),
                             jax.ShapeDtypeStruct(v.shape[:1] + (chunk,) + v.shape[2:], v.dtype),
                             {n: jax.ShapeDtypeStruct(ctx["param_" + n].shape, f32) for n in grads}))
                    zeros_like = vma.vary(jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), like), axes)
                    return (acc, *zeros_like[1:]) if into else zeros_like

                pairs.append((q0, k0, _switch(stage, j, kind, run, skip)))
                if into:
                    acc = pairs[-1][2][0]
                if into_wire:
                    buffer = pairs[-1][2][1]
            # (into: each slot's accumulator but the last, and into_wire its dK / dV buffer, is read by the next
            # slot's kernel alone, which writes it in place: tied here, XLA would copy it first)
            results = [p[2] if j == len(pairs) - 1 else (None if into else p[2][0], None if into_wire else p[2][1],
                                                         *p[2][2:]) for j, p in enumerate(pairs)]
            if received:  # the kernels' own outputs: what adds them up is free to fuse with what reads received
                received, results = _after_kernels(received, results)
            # dK / dV of the held block, this step's part: the pairs placed on their key rows (no zeros written and
            # updated in place, no separate concatenation onto the wire: XLA fuses it into what reads it); into_wire:
            # none, the buffer they wrote travels as it is
            part = None if into_wire else {
                n: _placed([(k0, res[i]) for (_, k0, _), res in zip(pairs, results)], chunk, x.shape[1])
                for i, n, x in ((1, "k", k), (2, "v", v))}
            if into:  # dq added up by the kernels: the last slot's accumulator
                dq = results[-1][0]
            for (q0, _, _), res in zip(pairs, results):  # dq adds up at home, one pair after another
                grads = {n: grads[n] + res[3][n].astype(f32) for n in grads}
                if into:
                    continue
                dq_p = res[0].astype(f32)
                if dq is None:
                    dq = _placed([(q0, dq_p)], chunk, q.shape[1])
                elif unrolled:  # outside a loop by selects, which XLA fuses up to the final cast, not a float32 dq
                    # written out between steps (docs/DESIGN.md §3, Ring attention; 2 H100s, 32k tokens, zigzag: the
                    # fusion before the last kernel took 178 us for the 384 MiB of the wire's concatenation, about
                    # what the 192 MiB of dq's float32 rows beside it add)
                    dq = _updated((dq,), (1,), q0, chunk, lambda old, dq_p=dq_p: (old + dq_p,))[0]
                else:
                    dq = lax.dynamic_update_slice_in_dim(dq, _rows(dq, q0, chunk) + dq_p, q0, 1)
            ahead, arrived = _arrived(received, both, size, owed, dkv_wire if owed_here else alone)
            if owed_here:  # (the rows its sender's pairs wrote; garbage elsewhere, dropped by a select)
                arrived = {n: jnp.where(pending.cover[:, None, None], x, 0) for n, x in arrived.items()}
            if into_wire:  # (with the rows that the device ahead, whose buffer arrives here next step, writes)
                pending = _Owed(results[-1][1], _covered(slots, (r + 1) % plan.devices, chunk, k.shape[1]))
            else:
                pending = part if arrived is None else {n: x.astype(f32) + part[n] for n, x in arrived.items()}
            return (ahead, pending, dq, grads), None

        if dq is None and count > 1:  # a scan carries the accumulator from its first step
            dq = vma.vary(zeros(q), axes)
        travel, pending, dq, grads = _steps(body, (travel, pending, dq, grads), xs)
    # each block's accumulators in the inputs' dtypes (the rounding the result gets anyway), sent home from a ring
    # that ends on a device ahead (a window's right side)
    home = {"k": pending["k"].astype(k.dtype), "v": pending["v"].astype(v.dtype)}
    if plan.start:
        back = Wire.of(home)
        home = back.unpack(_shift(plan, back.pack(home), -plan.start))
    dctx = {"params": grads}
    if plan.sinks:
        dctx["softmax_aux"] = api.sinks_grad(ctx["softmax_aux"], lse, delta)
    return dq.astype(q.dtype), home["k"], home["v"], api.ctx_cotangents(ctx, dctx)


def _delta(plan: Plan, out, d_out, d_lse, zeros: tuple | None = None):
    """(delta = rowsum(d_out * out) - d_lse [B, Hkv, G, n] of the local rows, once a backward; float32 zeros of shape
    ``zeros`` or None): the Hopper backward's (`gluon.host.hopper_delta`: its kernel, and the zeros by that launch's
    memset; XLA's fusion took 40 us at 32k tokens over 2 H200s, session 36's trace) where every backward call runs
    the Hopper kernels, else XLA's (`api.delta_rows`; no zeros)."""
    if _hopper_backward(plan):
        from ejgen.runtime.attention.gluon import host as gluon_attention

        return gluon_attention.hopper_delta(out, d_out, d_lse, zeros)
    return api.delta_rows(out, d_out, d_lse), None


def _arrived(received: dict, both: bool, size: int, owed, alone) -> tuple:
    """(the block for the next step or None, the dK/dV accumulators that arrived with it or None) from a backward
    step's transfers (`_backward`: one joined buffer, or the block and the accumulators apart)."""
    if both:
        return received["both"][:size], owed.unpack(received["both"][size:])
    arrived = received.get("owed")
    return received.get("block"), None if arrived is None else alone.unpack(arrived)


@functools.partial(jax.custom_vjp, nondiff_argnames=("plan",))
def _ring(q, k, v, ctx, plan):
    return _forward(q, k, v, ctx, plan)[:2]


def _ring_fwd(q, k, v, ctx, plan):
    """Residuals: the inputs, out and lse, and the block held at the last step where that is not the device's own
    (the backward walks the ring back from it): one more K/V block per device, B n Hkv (D + Dv) items in the inputs'
    dtype (and the block's segment ids), 128 MiB at 32k tokens over 2 devices, 16 kv heads of 128, bf16."""
    out, lse, last_held = _forward(q, k, v, ctx, plan)
    return (out, lse), (q, k, v, ctx, out, lse, last_held if plan.distance(plan.steps - 1) else None)


_ring.defvjp(_ring_fwd, _backward)
