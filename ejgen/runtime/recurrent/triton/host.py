"""The Triton backend of the linear recurrent family, shared by every generated spec: launches, the sums the kernels
leave to XLA (partials over blocks of V, a key / value head's group of query heads), the hooks' derivatives and the
gates' gradients (``gates.gate_grads``, from the log decays' gradients the kernels write). A generated
``triton_launch.py`` names its kernels module and its hooks (``Kernels``); everything else is here, once.

Fused (one pass over time, a program per (block of BV value columns, sequence x head), K whole in registers):
forward ``fused_fwd``; backward ``fused_bwd``, whose dq and dk (and the key side's log decay gradient) are partials per
block of V summed here; with gates it keeps a checkpoint every FUSED_BT steps and a scratch of FUSED_BT states per
program.
Chunked (chunks of C steps; a launch per function, ``CHUNKED`` their blocks and settings, notes/recurrent-perf.md):
forward, with gk ``chunk_intra`` (the intra-chunk matrices A), with a key-side gate ``chunk_sums`` (the gates' sums
over each chunk, read by the kernels after it), then ``chunk_states`` and ``chunk_output``; backward ``chunk_sums`` and
``chunk_states`` again, ``chunk_state_grads``, with gk ``chunk_intra`` (A and dA) and ``chunk_grads_intra`` (the
gradients' parts from the pairs inside each chunk), then ``chunk_grads_qk`` (dq, dk and the key side's log decay
gradient by blocks of K) and ``chunk_grads_v``.
Kernels read the caller's arrays in place ([B, T, H, D], packed sequences by CU, reverse by index); outputs that a
packed call may leave unwritten (tokens past the last sequence) are zeroed.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp

from ejgen.runtime.core import device, settings, sizes
from ejgen.runtime.core import kernels as chooser
from ejgen.runtime.launch import triton_call
from ejgen.runtime.recurrent import gates as gradients
from ejgen.runtime.recurrent import packing
from ejgen.runtime.recurrent.config import SCALAR_LOG_GATES

F32 = jnp.float32
CHUNKED_GATES = ("g", "g_gamma", "gk")  # the gates the chunked kernels take (gv runs on the fused ones)
FUSED_BV = 32  # value columns of a fused program (its state: K x 32 float32 in registers)
# The fused forward's value columns where its grid is large (`_fused_forward_bv`; 0: FUSED_BV always): a decode step
# (gla_decode, float32 state [B, 16, 128, 128], bf16, H200, session 29, loop of 32 steps, % of the 4102 GB/s stream)
# at B128: BV 64 80.1 us a step (83%) against 32's 86.3 (77%); at B32 (1024 programs of 64) 32 wins, 16.6 against
# 18.1 us. Wide where the wide grid still gives every SM FUSED_WIDE_PER_SM programs.
FUSED_WIDE_BV = 64
FUSED_WIDE_PER_SM = 16
FUSED_BT = 16  # steps of a fused backward's block (a checkpoint per block; a block's states in a scratch of its own)
SUB = 16  # steps of a sub-chunk
NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A chunked kernel's launch: its blocks of K and V (0: the whole head dim, padded; else a power of two >= 16, the
    tensor cores' least), warps and software-pipelining stages. A block is a program's share of that head dim, or,
    where the program takes the head dim whole, the block its loop takes at a time (chunk_output's K)."""

    block_k: int
    block_v: int
    num_warps: int = NUM_WARPS
    num_stages: int = 1
    wide_warps: int = 0  # warps where block_k 0 takes a head dim wider than 128 (0: num_warps)

    def __post_init__(self):
        for name in ("block_k", "block_v"):
            b = getattr(self, name)
            if b != 0 and (b < 16 or b & (b - 1)):
                raise ValueError(f"Tiles.{name} must be 0 (the whole head dim) or a power of two >= 16, got {b}")


# The chunked kernels' launches (notes/recurrent-perf.md): the state kernels walk a sequence's chunks in order, so
# their programs are blocks of the state (rows of K decay on their own); the intra-chunk kernels (gk) a program per
# sub-chunk (SUB rows): chunk_intra with the head dim whole (block_k 0) in two warps, chunk_grads_intra per block of
# 32 channels in one warp (its loop sums over steps: one warp needs no barrier; 410 instructions a step against
# 2 x 280 in two, sm_90 SASS); the others a program per chunk (C rows) and block of V or K. The intra-chunk kernels
# hold 217-254 registers a thread, 8-9 warps an SM whatever their warps, and their time follows neither their warps
# nor (chunk_grads_intra, session 18) their instruction count: they wait on latency. chunk_intra in blocks of 32
# channels (its rows' sums gathered in float32) holds 142 registers, 14 warps an SM, for more shuffles in its
# diagonal's row sums: not yet timed (recurrent_kernels.py --sweep).
CHUNKED = {
    "chunk_sums": Tiles(64, 0, 4, 1),
    # the walks: 4 stages, so a step's k / v loads were issued three steps before (at 2 the next step's go out after
    # this one's product and each step opens waiting for them: a DRAM latency a chunk). H200, session 29, same call
    # (this tree and one at 2 stages on the host's two GPUs): B2 T16k chunk_state 0.368 -> 0.282 ms (simple_gla),
    # 0.479 -> 0.398 (gla); chunk_state_bwd 0.373 -> 0.242 (simple_gla), 0.426 -> 0.374 (gla); op fwd / fwd+bwd
    # simple_gla 0.675 / 2.886 -> 0.598 / 2.685, gla 1.734 / 6.143 -> 1.645 / 5.990; B4 T4096 no loss (simple_gla
    # 0.296 / 1.363 -> 0.275 / 1.302). 16-bit inputs only: float32's walks take 112 KB of shared memory at 4 stages,
    # not timed
    "chunk_state": Tiles(64, 64, 8, 4),
    "chunk_state_bwd": Tiles(64, 64, 8, 4),
    # [16, 256] tiles: 440 bytes spilled a thread in 2 warps, 56 in 4, none in 8 (sm_90, Triton 3.9)
    "chunk_intra": Tiles(0, 64, 2, 1, wide_warps=8),
    "chunk_intra_diag": Tiles(0, 0, 2, 1, wide_warps=8),
    "chunk_output": Tiles(64, 64, 8, 2),
    "chunk_fused_fwd": Tiles(0, 32, 8, 1),
    "chunk_grads_intra": Tiles(32, 0, 1, 1),
    "chunk_grads_qk": Tiles(64, 32, 8, 2),
    "chunk_grads_v": Tiles(64, 64, 8, 2),
}


def tiles(which: str, dk: int, dv: int, launch: Tiles | None = None) -> tuple[dict, dict]:
    """({"BK", "BV"}: the blocks of chunked kernel ``which`` for head dims dk, dv; its launch options), from CHUNKED's
    launch or ``launch``."""
    t = launch or CHUNKED[which]
    bk, bv = _pow2(dk), _pow2(dv)
    blocks = dict(BK=min(t.block_k, bk) if t.block_k else bk, BV=min(t.block_v, bv) if t.block_v else bv)
    warps = t.wide_warps if t.wide_warps and not t.block_k and bk > 128 else t.num_warps
    return blocks, dict(num_warps=warps, num_stages=t.num_stages)


def available():
    return triton_call.available()


def choose(cfg):
    """(forward set, backward set, reasons, deterministic): the call's algorithm on its Triton kernels. No atomics:
    every pass is reproducible."""
    name = f"triton_{cfg.algorithm}"
    return name, name, (f"forward and backward: {name} (Triton kernels generated from the spec)",), True


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A spec's kernels (their module and name) and its hooks in jnp (``config.Hooks``) for the host's sums."""

    module: str
    name: str
    hooks: object

    def get(self, which: str):
        return getattr(importlib.import_module(self.module), f"{self.name}_{which}_kernel")


def _pow2(n: int) -> int:
    """A padded head dim or block: ``sizes.pow2`` with the tensor cores' floor of 16."""
    return sizes.pow2(n, 16)


def _dummy(dtype=F32):
    return jnp.zeros((1,), dtype)


H0_INPUT = 4  # h0's place in `_common`'s inputs


def _common(q, k, v, gates, h0, ctx, cfg):
    """The inputs every kernel takes after q, k, v (dummies for what the call lacks) and the shared constexprs."""
    ins = [gates.get("g", _dummy()), gates.get("g_gamma", _dummy()), gates.get("gk", _dummy()),
           gates.get("gv", _dummy()), _dummy() if h0 is None else h0, ctx.get("cu", _dummy(jnp.int32))]
    consts = dict(T=cfg.seq_len, H=cfg.heads, HKV=cfg.kv_heads, K=cfg.dk, V=cfg.dv, BK=_pow2(cfg.dk),
                  SCALE=float(cfg.scale), USE_G=cfg.has("g"), USE_GAMMA=cfg.has("g_gamma"), USE_GK=cfg.has("gk"),
                  USE_GV=cfg.has("gv"), USE_H0=h0 is not None, VARLEN=cfg.varlen, REVERSE=cfg.reverse)
    return ins, consts


def _fused_bv(cfg) -> int:
    return min(FUSED_BV, _pow2(cfg.dv))


def _fused_forward_bv(cfg) -> int:
    """The fused forward's value columns: FUSED_WIDE_BV where that grid still has FUSED_WIDE_PER_SM programs an SM
    (a decode step of a large batch streams its state faster in wider tiles) and the key head dim is at most 128 (at
    256 a [256, 64] state spills: sm_90, Triton 3.6, 56-80 bytes), unless the ``fused_value_blocks`` setting is
    "fixed" (a sequence's output then bitwise the same whatever the batch); else `_fused_bv`."""
    bv, wide = _fused_bv(cfg), min(FUSED_WIDE_BV, _pow2(cfg.dv))
    if (wide > bv and _pow2(cfg.dk) <= 128 and settings.current().fused_value_blocks == "auto"
            and cfg.n_seqs * cfg.heads * packing.cdiv(cfg.dv, wide) >= FUSED_WIDE_PER_SM * device.num_sms()):
        return wide
    return bv


def forward(kernels: Kernels, q, k, v, gates, h0, ctx, cfg, save: bool):
    """(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] float32, residuals). The fused forward writes the final
    state into the initial state's buffer unless a gradient keeps h0 (``save``): decoding updates its state in place
    where the caller donates it or carries it through a loop (else XLA copies it first); each program reads its
    [K, BV] block of H0 before it writes the same block of HT."""
    if cfg.algorithm == "chunked":
        return chunked_forward(kernels, q, k, v, gates, h0, ctx, cfg, save)
    ins, consts = _common(q, k, v, gates, h0, ctx, cfg)
    bv = _fused_forward_bv(cfg)
    sds = jax.ShapeDtypeStruct
    o, ht = triton_call.launch(
        kernels.get("fused_fwd"), (cfg.n_seqs * cfg.heads, packing.cdiv(cfg.dv, bv)), [q, k, v, *ins],
        [sds(q.shape[:3] + (cfg.dv,), q.dtype), sds((cfg.n_seqs, cfg.heads, cfg.dk, cfg.dv), F32)],
        zeroed=(0,) if cfg.varlen else (), num_warps=NUM_WARPS, num_stages=1,
        aliases={3 + H0_INPUT: 1} if h0 is not None and not save else None, BV=bv, **consts)
    return o, ht, {}


def backward(kernels: Kernels, q, k, v, gates, h0, ctx, res, do, dht, cfg):
    """(dq, dk, dv in their inputs' dtypes, dgates, dh0)."""
    if cfg.algorithm == "chunked":
        dphi_q, dphi_k, dv_h, dh0, d_key, d_value = chunked_backward(kernels, q, k, v, gates, h0, ctx, do, dht, cfg,
                                                                     res)
    else:
        dphi_q, dphi_k, dv_h, dh0, d_key, d_value = _fused_backward(kernels, q, k, v, gates, h0, ctx, do, dht, cfg)
    return gradients.finish(kernels.hooks, q, k, v, gates, h0, cfg, dphi_q, dphi_k, dv_h, dh0, d_key, d_value)


def _gated(cfg) -> bool:
    return any(cfg.has(g) for g in ("g", "g_gamma", "gk", "gv"))


def _fused_backward(kernels, q, k, v, gates, h0, ctx, do, dht, cfg):
    """(dq, dk of the mapped q and k, dv; per query head, float32; dh0; the log decays' gradients d_key [B, T, H, K]
    and d_value [B, T, H, V] or None)."""
    ins, consts = _common(q, k, v, gates, h0, ctx, cfg)
    bv = _fused_bv(cfg)
    nv = packing.cdiv(cfg.dv, bv)
    rows = q.shape[0] * q.shape[1]
    sds = jax.ShapeDtypeStruct
    per_head = q.shape[:3]
    gated = _gated(cfg)
    if not gated:
        first, blocks = _dummy(jnp.int32), 0
    elif cfg.varlen:
        layout = packing.packed(ctx["cu"], cfg, FUSED_BT)
        first, blocks = layout.seq_chunks[:-1], layout.n_chunks
    else:
        first, blocks = _dummy(jnp.int32), cfg.batch * packing.cdiv(cfg.seq_len, FUSED_BT)
    key_side = gated and any(cfg.has(g) for g in ("g", "g_gamma", "gk"))
    outs = [sds((nv,) + per_head + (cfg.dk,), F32), sds((nv,) + per_head + (cfg.dk,), F32),
            sds(per_head + (cfg.dv,), F32), sds((cfg.n_seqs, cfg.heads, cfg.dk, cfg.dv), F32),
            sds((nv,) + per_head + (cfg.dk,), F32) if key_side else sds((1,), F32),
            sds(per_head + (cfg.dv,), F32) if cfg.has("gv") else sds((1,), F32),
            sds((max(blocks, 1), cfg.heads, cfg.dk, cfg.dv), F32) if gated else sds((1,), F32),
            sds((cfg.n_seqs * cfg.heads * nv, FUSED_BT, cfg.dk, bv), F32) if gated else sds((1,), F32)]
    zeroed = (0, 1, 2) + ((4,) if key_side else ()) + ((5,) if cfg.has("gv") else ())
    dq, dk, dv, dh0, d_key, d_value, _, _ = triton_call.launch(
        kernels.get("fused_bwd"), (cfg.n_seqs * cfg.heads, nv), [q, k, v, *ins, first, do.astype(q.dtype), dht],
        outs, zeroed=zeroed if cfg.varlen else (), num_warps=NUM_WARPS, num_stages=1, BV=bv, ROWS=rows, BT=FUSED_BT,
        **consts)
    return (jnp.sum(dq, axis=0), jnp.sum(dk, axis=0), dv, dh0, jnp.sum(d_key, axis=0) if key_side else None,
            d_value if cfg.has("gv") else None)


def _layout(ctx, cfg):
    """(CHUNKS [NC, 2] int32 (sequence, chunk within it) or a dummy, FIRST [N] int32 (a sequence's first chunk) or a
    dummy, chunks per grid row, grid rows): dense calls are B rows of cdiv(T, C) chunks, packed ones one row of the
    layout's NC chunks (``packing``; a chunk past the last sequence's is given an index past every sequence's end)."""
    c = cfg.chunk
    if not cfg.varlen:
        return _dummy(jnp.int32), _dummy(jnp.int32), packing.cdiv(cfg.seq_len, c), cfg.batch
    layout = packing.packed(ctx["cu"], cfg, c)
    local = jnp.arange(layout.n_chunks, dtype=jnp.int32) - layout.seq_chunks[layout.chunk_seq]
    real = jnp.arange(layout.n_chunks) < layout.seq_chunks[-1]
    local = jnp.where(real, local, cfg.seq_len // c + 1)
    chunks = jnp.stack([layout.chunk_seq, local], axis=1).reshape(-1)
    return chunks, layout.seq_chunks[:-1], layout.n_chunks, 1


def _chunk_consts(q, cfg, consts):
    c = dict(consts)
    del c["USE_GV"], c["USE_H0"]
    c.update(C=cfg.chunk, MAP=True, DT=_triton_dtype(q.dtype))
    return c


def _products(cfg):
    """SP, the constexpr of the chunk_products setting (``cfg.products``): bf16 operands for the products with a float32
    state or adjoint, or float32 (TF32 for 16-bit inputs, exact for float32 ones)."""
    import triton.language as tl

    return tl.bfloat16 if cfg.products == "bfloat16" else tl.float32


def backward_states_dtype(cfg):
    """The dtype in which the backward stores the states and adjoints its dq / dk and dv kernels read: bf16 where their
    products round them to bf16 anyway (chunk_products; half the bytes written and read, the same products, and S ⊙ S̄
    of the log gates' gradient multiplies the rounded values, 2^-9 each), else float32."""
    return jnp.bfloat16 if cfg.products == "bfloat16" else F32


def _triton_dtype(dtype):
    import triton.language as tl

    return {jnp.dtype(jnp.float32): tl.float32, jnp.dtype(jnp.bfloat16): tl.bfloat16,
            jnp.dtype(jnp.float16): tl.float16}[jnp.dtype(dtype)]


# 16-bit inputs: the sums after each step, R_j = L(j, end], taken where they are read as L_C - P_j from the prefix
# sums and the chunk's whole sum (`_after_at`), not stored by chunk_sums: with gk one [B, T, H, K] float32 array less
# written (chunk_sums, run in each pass) and read (chunk_state, chunk_grads_qk, chunk_grads_v). "always" (the default)
# forms them for every gate, "gk" for per-key gates only, "never" stores them. H200, session 29, one call
# (recurrent_kernels.py, op rows stored -> formed): gla B4 T4096 fwd 0.871 -> 0.814 ms, fwd+bwd 3.046 -> 2.975; gla
# B2 T16k 1.800 -> 1.744, 6.287 -> 6.175; simple_gla then lost (B2 T16k 0.667 -> 0.776 fwd). Session 31 (H200, one
# call; the walks read the sums in the step since session 30): simple_gla B2 T16k fwd 0.515 -> 0.516, fwd+bwd 1.924
# -> 1.845; B4 T4096 0.271 -> 0.267, 0.975 -> 0.940; lightning 0.509 -> 0.522, 1.930 -> 1.851 and 0.266 -> 0.265,
# 0.962 -> 0.936: "always" since. Float32 inputs keep R as a sum of its own steps.
AFTER_FROM_PREFIX = "always"


def after_stored(x, cfg) -> bool:
    """Whether chunk_sums stores the after sums RS for inputs of ``x``'s dtype (else their readers form them)."""
    return stores_after(x.dtype, cfg.gates)


def stores_after(dtype, gates) -> bool:
    """AFTER_FROM_PREFIX's rule for inputs of ``dtype`` and a call with ``gates`` (names, as RecurrentConfig.gates)."""
    if AFTER_FROM_PREFIX not in ("gk", "always", "never"):
        raise ValueError(f"host.AFTER_FROM_PREFIX must be 'gk', 'always' or 'never', got {AFTER_FROM_PREFIX!r}")
    if jnp.dtype(dtype).itemsize != 2 or AFTER_FROM_PREFIX == "never":
        return True
    return AFTER_FROM_PREFIX == "gk" and "gk" not in gates


# A fixed decay alone (g_gamma, no g, no gk: Lightning attention, RetNet): every valid step's log gate is the head's
# γ, so a chunk's sums are P_i = γ (i + 1) and L_C = γ n, which the walk and output kernel form from γ whenever they
# are given no sums (`_fixed_sums`, the kernels' FIXED). FIXED_DECAY_SUMS: a forward that keeps nothing for a backward
# (the op called outside a gradient: inference, evaluation) launches no chunk_sums for such a call; a differentiated
# one keeps chunk_sums' for its backward as before.
# fla's chunk_simple_gla with g_gamma alone forms them so: its forward 0.428 ms at B2 T16384 on an H200 against its
# 0.487 with a g, ours 0.496 for both (session 31). Session 32, H200, one call (lightning, op fwd): B2 T16k 0.491 ->
# 0.489 ms, flat. Session 33, H200, one call (BENCHMARKS.md "Session 33"): chunk_output 0.304 -> 0.264 (B2 T16k),
# 0.160 -> 0.142 (B4 T4096); op fwd 0.489 -> 0.442 and 0.244 -> 0.226; but op fwd+bwd, where the backward then
# forms the sums, 2.027 -> 2.164 and 1.027 -> 1.094: on for the forward outside a gradient alone.
FIXED_DECAY_SUMS = True


def decay_is_fixed(gates) -> bool:
    """Whether a call with ``gates`` (names, as RecurrentConfig.gates) has a fixed decay for its only key-side gate
    (g_gamma alone: the kernels' FIXED without sums)."""
    return "g_gamma" in gates and "g" not in gates and "gk" not in gates


def fixed_decay(cfg, save: bool) -> bool:
    """Whether the forward leaves a fixed decay's sums to its kernels (FIXED_DECAY_SUMS), launching no chunk_sums:
    where it keeps nothing for a backward (not ``save``)."""
    return FIXED_DECAY_SUMS and decay_is_fixed(cfg.gates) and not save


def chunk_sums(kernels, q, gates, ctx, cfg):
    """With a key-side gate (gk, g, g_gamma), where the ``chunk_gate_sums`` setting is "kernel": the sums of the key
    side's log gates over each chunk's steps for the kernels that read them (``SUMS``), (PS, RS [B, T, H, K]: the
    prefix sums L(start, i] and the sums after each step L(j, end] (a dummy where not `after_stored`); LS [chunks, H,
    K]: the chunk's whole sum), float32, with a scalar gate [B, T, H] and [chunks, H] (K = 1: one sum a step); else
    None (the kernels scan the gates themselves)."""
    gk = cfg.has("gk")
    if not any(cfg.has(g) for g in CHUNKED_GATES) or settings.current().chunk_gate_sums != "kernel":  # key-side gates
        return None
    ins, consts = _common(q, q, q, gates, None, ctx, cfg)
    chunks, _, per_row, grid_rows = _layout(ctx, cfg)
    blocks, options = tiles("chunk_sums", cfg.dk, cfg.dv)
    c = {n: x for n, x in _chunk_consts(q, cfg, consts).items() if n not in ("HKV", "V", "SCALE", "MAP", "DT")}
    if gk:  # a program per (chunk, block of K, grid row x head)
        per, grid = (cfg.dk,), (per_row, packing.cdiv(cfg.dk, blocks["BK"]), grid_rows * cfg.heads)
        c.update(K=cfg.dk, BK=blocks["BK"])
    else:  # a scalar gate: one sum a step, a program per (chunk, grid row) with every head (`scalar_sums_lanes`)
        per, grid = (), (per_row, 1, grid_rows)
        c.update(K=1, BK=scalar_sums_lanes(cfg.heads))
    rows = jax.ShapeDtypeStruct(q.shape[:3] + per, F32)
    after = after_stored(q, cfg)
    return tuple(triton_call.launch(
        kernels.get("chunk_sums"), grid, [*ins[:3], ins[5], chunks],
        [rows, rows if after else jax.ShapeDtypeStruct((1,), F32),
         jax.ShapeDtypeStruct((per_row * grid_rows, cfg.heads) + per, F32)], AFTER=after, **options, **c))


def scalar_sums_lanes(heads: int) -> int:
    """``chunk_sums``' lanes with a scalar gate: every head of a chunk in one program (a power of two, at least 16)."""
    return _pow2(heads)


def _sums(sums, *which):
    """The arrays ``which`` ("ps", "rs", "ls") of ``chunk_sums``' result, or dummies where it is None."""
    if sums is None:
        return [_dummy()] * len(which)
    return [sums[("ps", "rs", "ls").index(w)] for w in which]


def chunk_states(kernels, k, v, gates, h0, ctx, cfg, dtype=F32, sums=None):
    """(HS [chunks, H, K, V]: the state at each chunk's start, in ``dtype`` (the kernel carries it in float32 and
    rounds what it stores), final_state [N, H, K, V] float32); ``sums``: ``chunk_sums``' (or None); `_walk`."""
    return _walk(kernels, "chunk_state", h0, cfg, False,
                 lambda start, *walk: _states(kernels, k, v, gates, start, ctx, cfg, dtype, sums, *walk))


def _walk(kernels, which, start, cfg, backward, launch):
    """A state walk's (stored tiles [chunks, H, K, V], its last tile: the final state or d initial_state) from ``start``
    (h0 or None, or d final_state); ``launch(start, group, ng, walk_pass)``: `_states` or `_state_grads` on their
    inputs. Where STATE_GROUP_FORM is "rewalk" and the walk splits (`state_group`), in groups walked twice: the
    groups' ends alone (PASS 1; their kernels ignore ``start``), joined (`_join_groups`), then each group from its
    joined start (PASS 2)."""
    group, ng = state_group(cfg) if STATE_GROUP_FORM == "rewalk" else (0, 1)
    if not group:
        return launch(start, 0, 1, 0)[:2]
    _, _, ge, gd, _ = launch(start, group, ng, 1)
    starts, end = _join_groups(kernels, which, start, ge, gd, cfg, ng, backward)
    return launch(starts, group, ng, 2)[0], end


def _states(kernels, k, v, gates, h0, ctx, cfg, dtype, sums, group, ng, walk_pass=0):
    """`chunk_state`'s launch: (HS, HT, GE, GD, DC), HT a dummy with groups (``group`` > 0), the last three without;
    ``walk_pass`` (with groups, `_group_outputs`): 1 the groups' ends alone, 2 the states from the groups' starts
    (``h0``: `_join_groups`' [N NG, H, K, V])."""
    ins, consts = _common(k, k, v, gates, h0, ctx, cfg)
    _, first, per_row, grid_rows = _layout(ctx, cfg)
    blocks, options = tiles("chunk_state", cfg.dk, cfg.dv)
    c = {**_chunk_consts(k, cfg, consts), **blocks}
    grid = (cfg.n_seqs * cfg.heads, packing.cdiv(cfg.dk, blocks["BK"]) * packing.cdiv(cfg.dv, blocks["BV"]))
    return triton_call.launch(
        kernels.get("chunk_state"), grid + ((ng,) if group else ()),
        [k, v, *ins[:3], *_sums(sums, "ps", "rs", "ls"), ins[4], ins[5], first],
        _group_outputs(cfg, group, ng, per_row * grid_rows, dtype, walk_pass),
        USE_H0=h0 is not None, SUMS=sums is not None, GROUP=group, NG=ng, PASS=walk_pass, AFTER=after_stored(k, cfg),
        **options, **{n: x for n, x in c.items() if n not in ("SCALE",)})


def _group_outputs(cfg, group, ng, chunks, dtype, walk_pass=0):
    """The state walks' outputs: the stored states / adjoints [chunks, H, K, V] in ``dtype``, the final state / d
    initial_state (a dummy with groups), then with groups GE [N NG, H, K, V], GD [N NG, H, K | 1], DC [chunks, H,
    K | 1] (float32), else three dummies. ``walk_pass`` 1 (the groups' ends alone): GE and GD; 2 (from the groups'
    starts): the stored states alone; the rest dummies."""
    sds = jax.ShapeDtypeStruct
    state = (cfg.heads, cfg.dk, cfg.dv)
    none = sds((1,), F32)
    stored = sds((chunks,) + state, dtype)
    if not group:
        return [stored, sds((cfg.n_seqs,) + state, F32)] + [none] * 3
    kd = cfg.dk if cfg.has("gk") else 1
    ends = [sds((cfg.n_seqs * ng,) + state, F32), sds((cfg.n_seqs * ng, cfg.heads, kd), F32)]
    if walk_pass == 1:
        return [none, none, *ends, none]
    if walk_pass == 2:
        return [stored] + [none] * 4
    return [stored, none, *ends, sds((chunks, cfg.heads, kd), F32)]


def _join_groups(kernels, which, start, ge, gd, cfg, ng, backward):
    """`chunk_state_groups` over the groups of walk ``which`` ("chunk_state" / "chunk_state_bwd": its blocks):
    (the groups' start states, or with ``backward`` their end adjoints, [N NG, H, K, V]; the final state, or
    d initial_state) from ``start`` (h0 or None; d final_state)."""
    blocks, options = tiles(which, cfg.dk, cfg.dv)
    state = (cfg.heads, cfg.dk, cfg.dv)
    return triton_call.launch(
        kernels.get("chunk_state_groups"),
        (cfg.n_seqs * cfg.heads, packing.cdiv(cfg.dk, blocks["BK"]) * packing.cdiv(cfg.dv, blocks["BV"])),
        [_dummy() if start is None else start, ge, gd],
        [jax.ShapeDtypeStruct((cfg.n_seqs * ng,) + state, F32), jax.ShapeDtypeStruct((cfg.n_seqs,) + state, F32)],
        H=cfg.heads, K=cfg.dk, V=cfg.dv, BK=blocks["BK"], BV=blocks["BV"], USE_GK=cfg.has("gk"),
        USE_H0=start is not None, NG=ng, BACKWARD=backward, **options)


# The state walks in groups (`chunk_state` / `chunk_state_bwd` GROUP > 0, dense layouts): a walk over a sequence's
# chunks is latency-bound, ~1.6 us a chunk whatever its programs (H200, session 24), and has B x H x (K / 64) x
# (V / 64) programs: 128 at B2 H16, one an SM, 256 steps at T 16k (~0.41 ms of simple_gla's 0.83 ms forward; fla
# 0.50; the backward walks twice more). In groups: every group's walk from the zero state (the adjoints: from the zero
# adjoint at the group's end) in parallel, each chunk's state relative to its group's reference, the group's end
# state and log decay; the groups joined by a walk of NG steps (`chunk_state_groups`); the kernels that read the
# states (chunk_output, chunk_grads_qk) and adjoints (chunk_grads_qk, chunk_grads_v) adding e^{L(...)} ⊙ their
# group's, float32, before their products (`_grouped_state`). Groups of at least MIN_GROUP chunks, as many as reach
# STATE_GROUP_PROGRAMS programs. Session 27: built, checked in the interpreter and compiled for sm_90, NOT GPU-timed
# (`gpu_round.sh state-groups`): off. Session 28 (H200, B2 T16k): simple_gla's chunk_state 0.368 -> 0.248 ms with its
# join, but the op's forward 0.686 -> 0.707 and fwd+bwd 2.942 -> 2.884 (the readers' added group states cost what the
# walk saved); B4 T4096 slower (0.299 -> 0.383 fwd): stays off.
STATE_GROUPS = False
# How the walks in groups give their readers the states: "relative" (above: each chunk's state relative to its group's
# start; the readers add the group's start) or "rewalk": each group walked twice, first for its end state and decay
# alone (no stores a chunk), then, the groups joined, from its true start, storing the true states: the readers
# unchanged, k and v (q and do) read twice. Session 28: built, checked in the interpreter, NOT GPU-timed.
STATE_GROUP_FORM = "relative"
STATE_GROUP_PROGRAMS = 1024
MIN_GROUP = 4


def state_group(cfg) -> tuple[int, int]:
    """(chunks per group, groups per sequence) of the grouped walks, or (0, 1): one walk a sequence (off, a packed
    layout, or too few chunks to split)."""
    if not STATE_GROUPS or cfg.varlen:
        return 0, 1
    blocks, _ = tiles("chunk_state", cfg.dk, cfg.dv)
    n_t = packing.cdiv(cfg.seq_len, cfg.chunk)
    programs = cfg.n_seqs * cfg.heads * packing.cdiv(cfg.dk, blocks["BK"]) * packing.cdiv(cfg.dv, blocks["BV"])
    groups = min(packing.cdiv(STATE_GROUP_PROGRAMS, programs), n_t // MIN_GROUP)
    if groups <= 1:
        return 0, 1
    group = packing.cdiv(n_t, groups)
    return group, packing.cdiv(n_t, group)


def relative_groups(cfg) -> bool:
    """Whether the walks go in groups whose states and adjoints their readers take relative to their group's."""
    return STATE_GROUP_FORM == "relative" and state_group(cfg)[0] > 0


def chunk_states_grouped(kernels, k, v, gates, h0, ctx, cfg, dtype=F32, sums=None):
    """`chunk_states` walked in groups (`state_group`; dense layouts): (HS [chunks, H, K, V] in ``dtype``, each
    chunk's state relative to its group's start, final_state [N, H, K, V] float32, (GS [N NG, H, K, V] float32 the
    groups' start states, DC [chunks, H, K | 1] each chunk's log decay from its group's start, GROUP, NG)) for
    `chunk_output`."""
    group, ng = state_group(cfg)
    hs, _, ge, gd, dc = _states(kernels, k, v, gates, h0, ctx, cfg, dtype, sums, group, ng)
    gs, ht = _join_groups(kernels, "chunk_state", h0, ge, gd, cfg, ng, False)
    return hs, ht, (gs, dc, group, ng)


# Where chunk_intra's diagonal blocks (a sub-chunk with itself: BC steps of row sums over the head dim) are formed:
# "inline", in the program that forms the blocks left of them (254 registers at K 128, 8 warps an SM; 0.70 ms of gla's
# 1.16 ms forward at B4 T4096, H200, session 24), or "kernel": a launch of their own before it (`chunk_intra_diag`,
# holding only their tiles, as flash-linear-attention splits them: its two intra kernels 0.37 ms on the same card),
# whose float32 blocks chunk_intra reads (a quarter of A's elements). The same numbers either way. Session 27, H200,
# gla B4 T4096 (`gpu_round.sh intra-diag`): chunk_intra 0.697 ms inline, 0.711 with the kernel's 16-step diagonal,
# 0.640 inline in pieces, 0.406 the kernel's in pieces (below); the op's forward 1.161 -> 0.877 ms.
CHUNK_INTRA_DIAGONAL = "kernel"
# For 16-bit inputs with the gates' sums, either form: the diagonal in pieces of 4 steps (`_intra_pieces`: three
# [16, K] x [K, 16] products between the pieces and a 4-step loop inside them, against a 16-step loop of row sums;
# A within TF32's rounding of the same numbers). Float32 inputs keep the 16-step loop.
CHUNK_INTRA_PIECES = True


# gk's chunk_output multiplies its state by q ⊙ e^{P} [C, K] a program: read as q (2 bytes a channel) and P (4 bytes,
# the second 16 of each thread's 32 fetched again: twice the ideal L2 sectors on the H200, session 32) and formed by
# both warp groups of each program (an exponential a channel, non-flush-to-zero: 6 instructions). GATED_Q: chunk_intra,
# which reads q and P for its rows anyway, stores q ⊙ e^{P} rounded to bf16 (QG [B, T, H, K]; `gated_q` says when),
# the operand chunk_output's bf16 product would round it to, and chunk_output reads that alone: the same numbers, 2
# bytes a channel written and read against 6 read; chunk_output's registers 102 -> 58 (sm_90, Triton 3.6: 4 programs
# of 8 warps an SM, not 2). Session 32, H200, one call (recurrent_kernels.py, gla, formed in chunk_output -> from
# chunk_intra): B2 T16k chunk_output 0.400 -> 0.223 ms, chunk_intra 0.754 -> 0.768, op fwd 1.642 -> 1.476; B4 T4096
# 0.214 -> 0.129, 0.403 -> 0.412, 0.808 -> 0.720 (fla's chunk_gla forward 1.556 and 0.769 in the call before). On.
GATED_Q = True


def gated_q(dtype, products, gates, sums: bool) -> bool:
    """Whether the two-pass forward's chunk_intra stores q ⊙ e^{P} for chunk_output (GATED_Q), for inputs of
    ``dtype``, the chunk_products setting ``products`` and ``gates`` (names): with gk, 16-bit inputs, the gates' sums
    (``sums``: `chunk_sums` ran) and bf16 products (the operand's rounding)."""
    return GATED_Q and "gk" in gates and sums and jnp.dtype(dtype).itemsize == 2 and products == "bfloat16"


def chunk_intra(kernels, q, k, gates, ctx, cfg, v=None, do=None, with_a=True, sums=None, gated=False):
    """With gk: (A [chunks, H, C, C] in q's dtype, every chunk's intra-chunk matrix (scale included), or None without
    ``with_a``; with v and do (the backward) also dA = scale do vᵀ [chunks, H, C, C] float32, else None; with
    ``gated`` (`gated_q`'s) q ⊙ e^{P} [B, T, H, K] bf16 for chunk_output, else None), a program per (sub-chunk of SUB
    rows, sequence x head); ``sums``: ``chunk_sums``' (or None), whose prefix sums give 16-bit inputs' exponents. The
    diagonal blocks: CHUNK_INTRA_DIAGONAL."""
    ins, consts = _common(q, k, k, gates, None, ctx, cfg)
    chunks, _, per_row, grid_rows = _layout(ctx, cfg)
    blocks, options = tiles("chunk_intra", cfg.dk, cfg.dv)
    grads = do is not None
    square = (per_row * grid_rows, cfg.heads, cfg.chunk, cfg.chunk)
    grid = (per_row * (cfg.chunk // SUB), grid_rows * cfg.heads)
    c = {**_chunk_consts(q, cfg, consts), **blocks}
    diag = with_a and CHUNK_INTRA_DIAGONAL == "kernel"
    diagonal = _dummy()
    if diag:
        d_blocks, d_options = tiles("chunk_intra_diag", cfg.dk, cfg.dv)
        names = set(kernels.get("chunk_intra_diag").arg_names)
        diagonal, = triton_call.launch(
            kernels.get("chunk_intra_diag"), grid, [q, k, *ins[:3], *_sums(sums, "ps"), ins[5], chunks],
            [jax.ShapeDtypeStruct((per_row * grid_rows, cfg.heads, cfg.chunk // SUB, SUB, SUB), F32)],
            BC=SUB, SUMS=sums is not None, PIECES=CHUNK_INTRA_PIECES, **d_options,
            **{n: x for n, x in {**c, **d_blocks}.items() if n in names})
    a, da, qg = triton_call.launch(
        kernels.get("chunk_intra"), grid,
        [q, k, v if grads else _dummy(q.dtype), *ins[:3], *_sums(sums, "ps"), ins[5], chunks, diagonal,
         do if grads else _dummy(q.dtype)],
        [jax.ShapeDtypeStruct(square if with_a else (1,), q.dtype),
         jax.ShapeDtypeStruct(square if grads else (1,), F32),
         jax.ShapeDtypeStruct(q.shape[:3] + (cfg.dk,) if gated else (1,), jnp.bfloat16)],
        BC=SUB, GRADS=grads, WITH_A=with_a, SUMS=sums is not None, DIAG_IN=diag, PIECES=CHUNK_INTRA_PIECES,
        GATED_Q=gated, **options, **c)
    return a if with_a else None, da if grads else None, qg if gated else None


# chunk_output, chunk_grads_v and chunk_grads_qk: a chunk's blocks (of V; of K) side by side in program id 0
# (`_blocks_grid`; the kernels' BLOCKS_FIRST), so the programs that read the same q, k, v / do and the gates' sums
# run together and the later ones read them from L2. By chunks first, a chunk's two blocks of V are a grid row of
# chunks apart (256 programs at B2 T16k): Nsight Compute on chunk_output at B4 T4096 (H200, session 31) showed 32.5% L2
# hits where q and k read once from DRAM would give ~49%. Session 32, H200, one call (recurrent_kernels.py, op fwd /
# fwd+bwd, chunks first -> blocks first): gla B2 T16k 1.648 -> 1.642 / 6.042 -> 5.975 ms, B4 T4096 0.811 -> 0.810 /
# 2.967 -> 2.932 (chunk_grads_qk 1.966 -> 1.902 at T16k); the scalar gates won at B2 T16k (simple_gla 0.497 -> 0.480 /
# 1.798 -> 1.783, lightning 0.491 -> 0.472 / 1.790 -> 1.789) but lost at B4 T4096 (simple_gla 0.248 -> 0.254 / 0.909
# -> 0.910, lightning 0.245 -> 0.251 / 0.902 -> 0.919): "gk" then. Session 33, H200, one call, with chunk_output at
# 4 warps for the scalar gates (OUTPUT_SCALAR_TILES): simple_gla B2 T16k 0.472 -> 0.452 / 1.958 -> 1.924, B4 T4096
# 0.239 -> 0.233 / 1.001 -> 0.990; lightning 0.432 -> 0.424 / 1.884 -> 1.853, 0.220 -> 0.220 / 0.951 -> 0.952
# (chunk_output 0.286 -> 0.274 and 0.253 -> 0.238 at T16k, chunk_grads_v 0.304 -> 0.293 and 0.322 -> 0.291): "always"
# (the default) for every gate since. "gk" takes it with gk alone, "never" for none.
BLOCKS_FIRST = "always"


def blocks_first(gates) -> bool:
    """Whether chunk_output, chunk_grads_v and chunk_grads_qk number a chunk's blocks side by side (their BLOCKS_FIRST)
    for a call with ``gates`` (names, as RecurrentConfig.gates): BLOCKS_FIRST's rule."""
    if BLOCKS_FIRST not in ("gk", "always", "never"):
        raise ValueError(f"host.BLOCKS_FIRST must be 'gk', 'always' or 'never', got {BLOCKS_FIRST!r}")
    return BLOCKS_FIRST == "always" or BLOCKS_FIRST == "gk" and "gk" in gates


def _blocks_grid(per_row: int, blocks: int, rows: int, first: bool) -> tuple[int, int, int]:
    """The grid of a kernel by (chunk, ``blocks`` blocks, ``rows`` grid rows x heads), a chunk's blocks side by side
    where ``first`` (`blocks_first`'s)."""
    return (per_row * blocks, 1, rows) if first else (per_row, blocks, rows)


# chunk_output's reads ahead: v's tile and a scalar gate's prefix sums (gk: chunk_intra's A, in whole rows) read
# before its K loop (after it, sm_90 PTX on Triton 3.6 shows them as plain loads the epilogue waits on: 12 ld.global
# of the sums, v's tile by ld.global + st.shared, A 2 bytes at a time), and with 16-bit inputs and no map on k, kᵀ
# loaded transposed into q kᵀ (in the loop k went to registers and back to shared memory each block of K). The kernel
# is 1.27x fla's chunk_fwd_kernel_o at simple_gla B2 T16k (0.330 against 0.259 ms), gla's 1.67x (0.433 against
# 0.259; session 30). Session 31, H200, one call (recurrent_kernels.py, kernel and op rows after -> ahead): simple_gla
# B2 T16k kernel 0.334 -> 0.310 ms, op fwd 0.515 -> 0.493; B4 T4096 0.172 -> 0.159, 0.271 -> 0.241; lightning 0.335 ->
# 0.315, 0.509 -> 0.501 and 0.181 -> 0.166, 0.266 -> 0.255; gla 0.429 -> 0.416, 1.661 -> 1.652 and 0.221 -> 0.214,
# 0.804 -> 0.788: on for every gate.
OUTPUT_AHEAD = True

# chunk_output's launch with a scalar gate (g, g_gamma; gk keeps CHUNKED's, its q ⊙ e^{P} read whole with GATED_Q),
# 16-bit inputs and bf16 products on sm_90: 4 warps at 2 stages (153 registers, 56 KB on sm_90, no spill on Triton
# 3.6 or 3.9: 3 CTAs an SM against 1-2 at 8 warps). Session 33, H200, one call (kernel, op fwd; 8 warps -> 4): simple_gla B2 T16k
# 0.299 -> 0.285 ms, 0.483 -> 0.471; B4 T4096 0.157 -> 0.145, 0.244 -> 0.241; lightning 0.304 -> 0.290, 0.489 ->
# 0.474 and 0.160 -> 0.148, 0.244 -> 0.241. fla's launch (4 warps, 3 stages, v after the K loop) 0.293 / 0.156 /
# 0.293 / 0.155 in the same call. Float32 inputs keep 8 warps (at 4 they spill 1560 bytes a thread on 3.9, 8152 on
# 3.6, against 304 / 544); TF32 products (f16's auto) were not timed. None: CHUNKED's for every call.
OUTPUT_SCALAR_TILES = Tiles(64, 64, 4, 2)


def _arch(arch: str | None) -> str | None:
    """A launch rule's ``arch``: "here" resolved to the machine calls run on (its arch on a GPU, None: the Triton
    interpreter)."""
    if arch != "here":
        return arch
    target = chooser.target()
    return target.arch if target.platform == "gpu" else None


def _bf16_products_here(dtype, products: str, arch: str | None) -> bool:
    """Whether a call's products run as the scalar gates' tuned launches were timed: 16-bit inputs, bf16 products
    (the chunk_products setting), on sm_90 or in the Triton interpreter (``arch`` as `_arch` takes it)."""
    return jnp.dtype(dtype).itemsize == 2 and products == "bfloat16" and _arch(arch) in (None, "sm90")


def output_launch(dtype, products: str, gates, arch: str | None = "here") -> Tiles:
    """chunk_output's launch for inputs of ``dtype``, the chunk_products setting ``products`` and ``gates`` (names, as
    RecurrentConfig.gates) on ``arch`` ("sm90"; None: the Triton interpreter; default: the machine calls run on):
    OUTPUT_SCALAR_TILES with a scalar gate alone, 16-bit inputs and bf16 products on sm_90 (where it was timed; sm_80
    holds 235-252 registers there) and in the interpreter, else CHUNKED's."""
    scalar = "gk" not in gates and bool(set(gates) & set(SCALAR_LOG_GATES))
    if scalar and _bf16_products_here(dtype, products, arch) and OUTPUT_SCALAR_TILES is not None:
        return OUTPUT_SCALAR_TILES
    return CHUNKED["chunk_output"]


def chunk_output(kernels, q, k, v, gates, ctx, cfg, hs, a=None, sums=None, groups=None, qg=None):
    """o [B, T, H, V] in q's dtype from the states at the chunks' starts (and with gk the intra-chunk matrices A of
    ``chunk_intra``, and its q ⊙ e^{P} ``qg`` with GATED_Q; ``sums``: ``chunk_sums``' or None; ``groups``:
    `chunk_states_grouped`'s, whose HS are relative to their group's start)."""
    ins, consts = _common(q, k, v, gates, None, ctx, cfg)
    chunks, _, per_row, grid_rows = _layout(ctx, cfg)
    blocks, options = tiles("chunk_output", cfg.dk, cfg.dv, output_launch(q.dtype, cfg.products, cfg.gates))
    (o,) = triton_call.launch(
        kernels.get("chunk_output"),
        _blocks_grid(per_row, packing.cdiv(cfg.dv, blocks["BV"]), grid_rows * cfg.heads, blocks_first(cfg.gates)),
        [q, k, v, *ins[:3], *_sums(sums, "ps"), ins[5], chunks, hs, _dummy(q.dtype) if a is None else a,
         *(groups[:2] if groups else (_dummy(), _dummy())), _dummy(jnp.bfloat16) if qg is None else qg],
        [jax.ShapeDtypeStruct(q.shape[:3] + (cfg.dv,), q.dtype)],
        zeroed=(0,) if cfg.varlen else (), BC=SUB, SUMS=sums is not None, SP=_products(cfg),
        GROUP=groups[2] if groups else 0, NG=groups[3] if groups else 1, AHEAD=OUTPUT_AHEAD,
        BLOCKS_FIRST=blocks_first(cfg.gates), GATED_Q=qg is not None, **options,
        **{**_chunk_consts(q, cfg, consts), **blocks})
    return o


# The chunked forward's form is the `chunk_forward` setting (EJGEN_CHUNK_FORWARD): "two_pass" (chunk_state writes
# every chunk's start state, chunk_output reads them; programs per chunk) or "fused" (chunk_fused_fwd: a program per
# sequence x head and block of 32 value columns walks the chunks with its state in registers, no states in memory).
# Not GPU-timed yet (session 17): two_pass stays the default until the benchmark says where fused wins.


def chunk_fused_forward(kernels, q, k, v, gates, h0, ctx, cfg, a=None):
    """(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] float32) in one pass (``chunk_fused_fwd``), with gk from
    the intra-chunk matrices ``a``."""
    ins, consts = _common(q, k, v, gates, h0, ctx, cfg)
    _, first, _, _ = _layout(ctx, cfg)
    blocks, options = tiles("chunk_fused_fwd", cfg.dk, cfg.dv)
    sds = jax.ShapeDtypeStruct
    o, ht = triton_call.launch(
        kernels.get("chunk_fused_fwd"), (cfg.n_seqs * cfg.heads, packing.cdiv(cfg.dv, blocks["BV"])),
        [q, k, v, *ins[:3], ins[4], ins[5], first, _dummy(q.dtype) if a is None else a],
        [sds(q.shape[:3] + (cfg.dv,), q.dtype), sds((cfg.n_seqs, cfg.heads, cfg.dk, cfg.dv), F32)],
        zeroed=(0,) if cfg.varlen else (), BC=SUB, USE_H0=h0 is not None, **options,
        **{**_chunk_consts(q, cfg, consts), **blocks})
    return o, ht


def chunked_forward(kernels, q, k, v, gates, h0, ctx, cfg, save):
    """With gk the intra-chunk matrices A are kept for the backward (``save``; [chunks, H, C, C] in q's dtype, half
    of q's size at K = 128, as fla keeps them): forming them again cost 0.78 of the backward's 0.85 ms intra kernel
    (B4 T4096, H100, session 17); the backward's intra kernel then forms dA alone. A scalar gate's sums are kept too
    (one a step: [B, T, H] twice, an eighth of q's size at K = 128, against gk's two [B, T, H, K], formed again)."""
    fused = settings.current().chunk_forward == "fused"
    # the gates' sums for chunk_intra and the two passes (the one pass reads none)
    sums = chunk_sums(kernels, q, gates, ctx, cfg) if cfg.has("gk") or not (fused or fixed_decay(cfg, save)) else None
    gated = not fused and gated_q(q.dtype, cfg.products, cfg.gates, sums is not None)
    a, _, qg = chunk_intra(kernels, q, k, gates, ctx, cfg, sums=sums, gated=gated) if cfg.has("gk") else (None,) * 3
    res = {}
    if save and a is not None:
        res["a"] = a
    if save and sums is not None and not cfg.has("gk"):
        res["sums"] = sums
    if fused:
        o, ht = chunk_fused_forward(kernels, q, k, v, gates, h0, ctx, cfg, a)
        return o, ht, res
    # the chunk_state_dtype setting: the output kernel's states in bfloat16 (it widens them to float32 for their
    # product, so a stored state is read exactly as rounded), or float32; auto: bfloat16 for 16-bit inputs
    asked = settings.current().chunk_state_dtype
    sixteen = jnp.dtype(q.dtype).itemsize == 2
    stored = jnp.bfloat16 if asked == "bfloat16" or (asked == "auto" and sixteen) else F32
    if relative_groups(cfg):
        hs, ht, groups = chunk_states_grouped(kernels, k, v, gates, h0, ctx, cfg, stored, sums)
        return chunk_output(kernels, q, k, v, gates, ctx, cfg, hs, a, sums, groups, qg), ht, res
    hs, ht = chunk_states(kernels, k, v, gates, h0, ctx, cfg, stored, sums)
    return chunk_output(kernels, q, k, v, gates, ctx, cfg, hs, a, sums, qg=qg), ht, res


def chunk_state_grads(kernels, q, gates, ctx, cfg, do, dht, sums=None, dtype=F32):
    """(DHS [chunks, H, K, V]: the adjoint of the state at each chunk's end, in ``dtype`` (carried in float32, rounded
    where it is stored), d initial_state [N, H, K, V] float32) (do in q's dtype; ``sums``: ``chunk_sums``' or None).
    `_walk`."""
    return _walk(kernels, "chunk_state_bwd", dht, cfg, True,
                 lambda start, *walk: _state_grads(kernels, q, gates, ctx, cfg, do, start, sums, dtype, *walk))


def chunk_state_grads_grouped(kernels, q, gates, ctx, cfg, do, dht, sums=None, dtype=F32):
    """`chunk_state_grads` walked in groups (`state_group`; dense layouts): (DHS in ``dtype``, each chunk's end adjoint
    relative to its group's end, d initial_state, (GA [N NG, H, K, V] float32 the adjoints at the groups' ends, DCA
    [chunks, H, K | 1] each chunk's log decay from its end to its group's, GROUP, NG)) for `chunk_grads_qk` and
    `chunk_grads_v`."""
    group, ng = state_group(cfg)
    dhs, _, ge, gd, dca = _state_grads(kernels, q, gates, ctx, cfg, do, dht, sums, dtype, group, ng)
    ga, dh0 = _join_groups(kernels, "chunk_state_bwd", dht, ge, gd, cfg, ng, True)
    return dhs, dh0, (ga, dca, group, ng)


# chunk_state_bwd with a scalar gate and 16-bit inputs in the forward walk's form (`_retreat_do_gated`: qᵀ fed as
# loaded, e^{P} on do's rows, the sums read in the step; sm_90 PTX on Triton 3.6: the walk's loop held 3 plain loads
# of the sums read a step ahead, as the forward's did before session 30 cut its B2 T16k forward by 12%). The walk is
# 0.244 ms at simple_gla B2 T16k (fla's dh 0.254). Session 31, H200, one call (kernel, op fwd+bwd; registers -> as
# loaded): simple_gla B2 T16k 0.241 -> 0.221 ms, 1.924 -> 1.888; B4 T4096 0.116 -> 0.106, 0.975 -> 0.963; lightning
# 0.244 -> 0.218, 1.930 -> 1.902 and 0.113 -> 0.105, 0.962 -> 0.979 (the one op row that lost; its kernel won): on.
ADJOINT_AS_LOADED = True


def _state_grads(kernels, q, gates, ctx, cfg, do, dht, sums, dtype, group, ng, walk_pass=0):
    """`chunk_state_bwd`'s launch: (DHS, DH0, GE, GD, DC), DH0 a dummy with groups (``group`` > 0), the last three
    without; ``walk_pass`` as `_states`' (2: ``dht`` the adjoints at the groups' ends, `_join_groups`')."""
    ins, consts = _common(q, q, q, gates, None, ctx, cfg)
    _, first, per_row, grid_rows = _layout(ctx, cfg)
    blocks, options = tiles("chunk_state_bwd", cfg.dk, cfg.dv)
    c = {**_chunk_consts(q, cfg, consts), **blocks}
    grid = (cfg.n_seqs * cfg.heads, packing.cdiv(cfg.dk, blocks["BK"]) * packing.cdiv(cfg.dv, blocks["BV"]))
    return triton_call.launch(
        kernels.get("chunk_state_bwd"), grid + ((ng,) if group else ()),
        [q, *ins[:3], *_sums(sums, "ps", "ls"), ins[5], first, do, dht],
        _group_outputs(cfg, group, ng, per_row * grid_rows, dtype, walk_pass),
        SUMS=sums is not None, GROUP=group, NG=ng, PASS=walk_pass, AS_LOADED=ADJOINT_AS_LOADED, **options,
        **{n: x for n, x in c.items() if n != "HKV"})


def _direct(kernels, cfg) -> bool:
    """Whether the chunked kernels write dq, dk and dv in the inputs' dtype: nothing left for the host to do to them
    in float32 (no head groups to sum, no feature map's derivative)."""
    return cfg.groups == 1 and kernels.hooks.feature_map_grad is None


# chunk_grads_intra's exponents between sub-chunks (16-bit inputs with `chunk_sums`): differences of the prefix sums
# (PS) instead of each sub-chunk's gates read, scanned and summed over its steps again, as chunk_intra has taken them
# since session 22 (its blocks left of the diagonal). Session 24's stall samples of chunk_grads_intra (1.8 ms, gla B4
# T4096, H200, the backward's largest kernel): 28% in reductions over steps, ~10% waiting on gate loads. Session 28
# (H200, one call, `gpu_round.sh state-groups`): chunk_grads_intra 1.754 -> 1.087 ms (B4 T4096) and 3.487 -> 2.123
# (B2 T16k); gla op fwd+bwd 3.720 -> 3.104 and 7.693 -> 6.343 ms. The default since; False keeps the scanned gates.
GRADS_INTRA_SUMS = True


def chunk_grads_intra(kernels, q, k, gates, ctx, cfg, da, sums=None):
    """With gk: (DQI, DKI, DLI [B, T, H, K] float32, per query head): what the pairs of steps inside each chunk give dq,
    dk and the key side's log decay gradient, from dA (``chunk_intra``), a program per (sub-chunk of SUB rows, block
    of K, sequence x head); ``sums``: ``chunk_sums``' (or None), read where GRADS_INTRA_SUMS says."""
    ins, consts = _common(q, k, k, gates, None, ctx, cfg)
    chunks, _, per_row, grid_rows = _layout(ctx, cfg)
    blocks, options = tiles("chunk_grads_intra", cfg.dk, cfg.dv)
    out = jax.ShapeDtypeStruct(q.shape[:3] + (cfg.dk,), F32)
    sums = sums if GRADS_INTRA_SUMS else None
    return tuple(triton_call.launch(
        kernels.get("chunk_grads_intra"),
        (per_row * (cfg.chunk // SUB), packing.cdiv(cfg.dk, blocks["BK"]), grid_rows * cfg.heads),
        [q, k, *ins[:3], *_sums(sums, "ps"), ins[5], chunks, da], [out, out, out], BC=SUB, SUMS=sums is not None,
        **options, **{**_chunk_consts(q, cfg, consts), **blocks}))


# chunk_grads_qk with a scalar gate: the log decay gradient's terms from the chunk's states (q ⊙ dq by a reverse
# cumsum, k ⊙ dk by an exclusive one, S ⊙ S̄) placed in the pairs' [C, C] matrix and summed by its one reverse scan
# (`_folded`), not by two [C] scans of their own. sm_90, simple_gla, bf16 states and products: 208 -> 170 registers
# on Triton 3.6 (185 -> 178 on 3.9), the room a program a chunk (block_k 128) needs to run unspilled (session 29's
# study). 16-bit inputs only (`grads_qk_form`): with float32 inputs the fold spills more (sm_90, Triton 3.6, blocks
# of 64: 720 -> 1424 bytes a thread).
GRADS_QK_FOLD = True
# chunk_grads_qk's launch with a scalar gate and 16-bit inputs on sm_90 (and in the interpreter): blocks of 128 and 64
# are a program a chunk (K whole up to 128), so dA = do vᵀ, W and the [C, C] scan run once a chunk instead of once per
# block of 64 channels (~-45% instructions a chunk, session 29's study); with GRADS_QK_FOLD no spill (sm_90: 216
# registers on Triton 3.6, 255 on 3.9; unfolded 3.6 spills 200 bytes), bf16 products only (TF32 ones spill 72
# bytes). Elsewhere CHUNKED's: float32 inputs spill 4016 bytes a thread at 128 (720 by blocks of 64, unfolded),
# sm_80 2208 (560). gk keeps CHUNKED's (at 128 it spills 88-104 bytes). Session 30, H200, simple_gla bf16, both on:
# the kernel 1.796 -> 1.172 ms at B2 T16384 (0.912 -> 0.615 at B4 T4096), op fwd+bwd 2.636 -> 2.013 (1.285 -> 0.979);
# folded by blocks of 64 alone 1.761, a program a chunk unfolded 1.255 (BENCHMARKS.md, "Session 30").
# 3 stages (session 32's helper study: at 2 the second block of V is read after the first's products and waited on at
# once; 3 put both in flight in the prologue: 120 KB of shared memory on sm_90, no spill on Triton 3.6 or 3.9, with or
# without GAMMA_TOTAL). Session 33, H200, one call (kernel, op fwd+bwd; 2 stages -> 3): simple_gla B2 T16k 1.108 ->
# 1.080 ms, 2.008 -> 1.982; B4 T4096 0.580 -> 0.564, 1.022 -> 1.006; lightning 1.107 -> 1.078, 2.027 -> 1.982 and
# 0.584 -> 0.562, 1.027 -> 1.015.
GRADS_QK_SCALAR_TILES = Tiles(128, 64, 8, 3)


def grads_qk_form(dtype, products: str, gates, dk: int, dv: int, arch: str | None = "here",
                  grouped: bool = False) -> tuple[bool, dict, dict]:
    """chunk_grads_qk's (FOLD, {"BK", "BV"}, launch options) for inputs of ``dtype``, the call's ``products``
    ("bfloat16" / "tf32": `RecurrentConfig.products`) and ``gates`` (names) on ``arch`` ("sm90"; None: the Triton
    interpreter; default: the machine calls run on): GRADS_QK_FOLD and GRADS_QK_SCALAR_TILES where they apply (a
    scalar gate, 16-bit inputs; a program a chunk with bf16 products on sm_90 alone: TF32 products spill 72 bytes);
    at most 2 stages where the states and adjoints are ``grouped`` (`relative_groups`: the groups' tiles beside them,
    3 stages ask 248 KB of shared memory, past sm_90's 227)."""
    scalar = "gk" not in gates and bool(gates)  # (gates: of RECURRENT_GATES, as RecurrentConfig.gates)
    sixteen = jnp.dtype(dtype) != jnp.float32
    whole = scalar and _bf16_products_here(dtype, products, arch) and GRADS_QK_SCALAR_TILES is not None
    blocks, options = tiles("chunk_grads_qk", dk, dv, GRADS_QK_SCALAR_TILES if whole else None)
    if grouped:
        options["num_stages"] = min(options["num_stages"], 2)
    return GRADS_QK_FOLD and scalar and sixteen, blocks, options


# g_gamma alone (Lightning attention, RetNet) learned: the host sums its per-step log gradient over every step, so
# chunk_grads_qk can form each chunk's whole share instead (the kernels' TOTAL, `_reading_steps`): each term of the
# folded [C, C] matrix once, times the number of the chunk's steps that read it, no reverse scan and row sums (a
# helper's static study of sm_90 SASS, Triton 3.6, session 32: -16% instructions a warp, shuffles 278 -> 47; the scan
# block was 665 instructions of 2866). Every term a direct sum still (docs/DESIGN.md §3 linear recurrent, "Gates'
# gradients"). Session 33, H200, one call (lightning, kernel and op fwd+bwd, per-step scan -> total): B2 T16k 1.107 ->
# 1.021 ms, 2.027 -> 1.937; B4 T4096 0.584 -> 0.534, 1.027 -> 0.987: on.
GAMMA_TOTAL = True


def log_grads(gates, learned: bool, fold: bool, total: bool | None = None) -> tuple[bool, bool]:
    """chunk_grads_qk's (LOG_GRADS, TOTAL) for a call with ``gates`` (names): the key side's log gates' gradient
    formed where a scalar one is ``learned`` (RecurrentConfig.log_grads) and with gk always; g_gamma alone, ``fold``ed,
    as each chunk's total where ``total`` (default GAMMA_TOTAL) says so."""
    formed = bool(set(gates) & {"g", "g_gamma", "gk"}) and (learned or "gk" in gates)
    return formed, (GAMMA_TOTAL if total is None else total) and fold and formed and decay_is_fixed(gates)


def chunk_grads_qk(kernels, q, k, v, gates, ctx, cfg, hs, dhs, do, intra=None, sums=None, groups=None):
    """(dq, dk of the mapped q and k per query head, float32, or q's dtype where ``_direct``; the key side's log decay
    gradient, DLOG [B, T, H, K] with gk, else a part per block of K [NK, B, T, H, 1], or None) of every chunk from its
    start state and end adjoint, by blocks of K; with gk ``intra`` is ``chunk_grads_intra``'s (``sums``:
    ``chunk_sums``' or None; ``groups``: (`chunk_states_grouped`'s, `chunk_state_grads_grouped`'s) where HS and DHS are
    relative to their groups)."""
    ins, consts = _common(q, k, v, gates, None, ctx, cfg)
    chunks, _, per_row, grid_rows = _layout(ctx, cfg)
    fold, blocks, options = grads_qk_form(q.dtype, cfg.products, cfg.gates, cfg.dk, cfg.dv, grouped=bool(groups))
    sds = jax.ShapeDtypeStruct
    per_head = q.shape[:3]
    gated = _gated(cfg)
    nk = packing.cdiv(cfg.dk, blocks["BK"])
    log = per_head + (cfg.dk,) if cfg.has("gk") else (nk,) + per_head + (1,)
    logs, total = log_grads(cfg.gates, cfg.log_grads, fold)
    out = q.dtype if _direct(kernels, cfg) else F32
    intra = intra if intra is not None else (_dummy(),) * 3
    dq, dk, dlog = triton_call.launch(
        kernels.get("chunk_grads_qk"), _blocks_grid(per_row, nk, grid_rows * cfg.heads, blocks_first(cfg.gates)),
        [q, k, v, *ins[:3], *_sums(sums, "ps", "rs", "ls"), ins[5], chunks, hs, dhs,
         *(groups[0][:2] + groups[1][:2] if groups else [_dummy()] * 4), do, *intra],
        [sds(per_head + (cfg.dk,), out), sds(per_head + (cfg.dk,), out), sds(log if logs else (1,), F32)],
        zeroed=(0, 1) + ((2,) if logs else ()) if cfg.varlen else (), BC=SUB, ROWS=per_head[0] * per_head[1],
        SUMS=sums is not None, SP=_products(cfg), GROUP=groups[0][2] if groups else 0,
        NG=groups[0][3] if groups else 1, AFTER=after_stored(q, cfg), FOLD=fold,
        BLOCKS_FIRST=blocks_first(cfg.gates), LOG_GRADS=logs, TOTAL=total, **options,
        **{**_chunk_consts(q, cfg, consts), **blocks})
    return dq, dk, dlog if logs else None


# chunk_grads_v's reads ahead, as chunk_output's (OUTPUT_AHEAD): do's tile and a scalar gate's R (gk: chunk_intra's A,
# in whole rows, transposed in registers) before its K loop, qᵀ loaded transposed for 16-bit inputs with no map on q
# (sm_90 PTX on Triton 3.6: after the loop gk's Aᵀ was 16 `ld.global.b16` a thread through the triangle's mask, the
# scalar gate's R 12 plain b32 loads, do's tile ld.global + st.shared). "scalar" (the default) reads ahead for scalar
# gates and none, "always" with gk too, "never" not at all. Session 31, H200, one call (kernel, op fwd+bwd; after ->
# ahead): simple_gla B2 T16k 0.391 -> 0.306 ms, 1.924 -> 1.844; B4 T4096 0.209 -> 0.162, 0.975 -> 0.930; lightning
# 0.394 -> 0.309, 1.930 -> 1.843 and 0.204 -> 0.160, 0.962 -> 0.917; but gla 0.378 -> 0.437, 6.006 -> 6.054 and
# 0.204 -> 0.220, 2.940 -> 2.954 (gk's Aᵀ transposed in registers costs more than its plain loads did).
GRADS_V_AHEAD = "scalar"


def grads_v_ahead(gates) -> bool:
    """Whether chunk_grads_v reads ahead of its K loop (GRADS_AHEAD) for a call with ``gates`` (names, as
    RecurrentConfig.gates): GRADS_V_AHEAD's rule."""
    if GRADS_V_AHEAD not in ("scalar", "always", "never"):
        raise ValueError(f"host.GRADS_V_AHEAD must be 'scalar', 'always' or 'never', got {GRADS_V_AHEAD!r}")
    return GRADS_V_AHEAD == "always" or GRADS_V_AHEAD == "scalar" and "gk" not in gates


def chunk_grads_v(kernels, q, k, gates, ctx, cfg, dhs, do, a=None, sums=None, groups=None):
    """dv [B, T, H, V] per query head (float32, or the inputs' dtype where ``_direct``) of every chunk from its end
    adjoint, by blocks of V (with gk from the intra-chunk matrices A of ``chunk_intra``; ``sums``: ``chunk_sums``' or
    None; ``groups``: `chunk_state_grads_grouped`'s, where DHS is relative to its groups)."""
    ins, consts = _common(q, k, k, gates, None, ctx, cfg)
    chunks, _, per_row, grid_rows = _layout(ctx, cfg)
    blocks, options = tiles("chunk_grads_v", cfg.dk, cfg.dv)
    (dv,) = triton_call.launch(
        kernels.get("chunk_grads_v"),
        _blocks_grid(per_row, packing.cdiv(cfg.dv, blocks["BV"]), grid_rows * cfg.heads, blocks_first(cfg.gates)),
        [q, k, *ins[:3], *_sums(sums, "ps", "rs", "ls"), ins[5], chunks, dhs, _dummy(q.dtype) if a is None else a,
         *(groups[:2] if groups else (_dummy(), _dummy())), do],
        [jax.ShapeDtypeStruct(q.shape[:3] + (cfg.dv,), q.dtype if _direct(kernels, cfg) else F32)],
        zeroed=(0,) if cfg.varlen else (), BC=SUB, SUMS=sums is not None, SP=_products(cfg),
        GROUP=groups[2] if groups else 0, NG=groups[3] if groups else 1, AFTER=after_stored(q, cfg),
        GRADS_AHEAD=grads_v_ahead(cfg.gates), BLOCKS_FIRST=blocks_first(cfg.gates), **options,
        **{**_chunk_consts(q, cfg, consts), **blocks})
    return dv


def key_log_grad(dlog, cfg):
    """d_key [B, T, H, K | 1] from ``chunk_grads_qk``'s: as it is with gk, else its parts per block of K summed."""
    return dlog if cfg.has("gk") else jnp.sum(dlog, axis=0)


def chunked_backward(kernels, q, k, v, gates, h0, ctx, do, dht, cfg, res=None):
    """(dq, dk of the mapped q and k, dv; per query head, float32 or the inputs' dtype (``_direct``); dh0; the key
    side's log decay gradient d_key [B, T, H, K | 1] or None; None). ``res``: the forward's residuals (A with gk, a
    scalar gate's sums)."""
    sums = (res or {}).get("sums")
    if sums is None:  # formed again with gk: two [B, T, H, K] float32 arrays not kept
        sums = chunk_sums(kernels, q, gates, ctx, cfg)
    stored = backward_states_dtype(cfg)
    do = do.astype(q.dtype)
    fwd_groups = bwd_groups = None
    if relative_groups(cfg):  # both walks in groups, joined where the states and adjoints are read
        hs, _, fwd_groups = chunk_states_grouped(kernels, k, v, gates, h0, ctx, cfg, stored, sums=sums)
        dhs, dh0, bwd_groups = chunk_state_grads_grouped(kernels, q, gates, ctx, cfg, do, dht, sums, stored)
    else:
        hs, _ = chunk_states(kernels, k, v, gates, h0, ctx, cfg, stored, sums=sums)
        dhs, dh0 = chunk_state_grads(kernels, q, gates, ctx, cfg, do, dht, sums, stored)
    a = intra = None
    if cfg.has("gk"):
        kept = (res or {}).get("a")
        a, da, _ = chunk_intra(kernels, q, k, gates, ctx, cfg, v, do, with_a=kept is None, sums=sums)
        a = kept if kept is not None else a
        intra = chunk_grads_intra(kernels, q, k, gates, ctx, cfg, da, sums)
    dq, dk, dlog = chunk_grads_qk(kernels, q, k, v, gates, ctx, cfg, hs, dhs, do, intra, sums,
                                  (fwd_groups, bwd_groups) if fwd_groups else None)
    dv = chunk_grads_v(kernels, q, k, gates, ctx, cfg, dhs, do, a, sums, bwd_groups)
    return dq, dk, dv, dh0, None if dlog is None else key_log_grad(dlog, cfg), None
