"""Ahead-of-time compilation of generated Triton kernels (and the Gluon forward) for a GPU target, on any machine.

``compile_attention(module, name, ...)`` compiles the forward, dK/dV and dQ kernels of one
generated variant for ``cuda`` at the given compute capability with a representative constexpr
configuration, and returns ``{kernel name: compiled kernel}``. No GPU is needed: Triton's bundled
ptxas assembles the code, so shapes, layouts and lowering rules are all checked.

Triton chooses between compiler and interpreter when a kernel (its own library included) is
decorated, so a process that runs the interpreter cannot compile: ``compile_in_subprocess`` runs
this module in another interpreter with TRITON_INTERPRET unset, one that stays (`_Server`) for the
process's later compiles with the same Triton and environment.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

from ejgen.runtime.attention.triton.configs import band_blocks

_DTYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


def _signature(kernel, dtype: str, params: dict) -> dict:
    ptr = {"SCRATCH": "*u8", "F32": "*fp32", "I32": "*i32", "BIAS": "*fp32", "QSEG": "*i32", "KVSEG": "*i32", "MASK": "*i8",
           "CU_Q": "*i32", "CU_K": "*i32", "QPOS": "*i32", "KVPOS": "*i32", "TILES": "*i32", "AUX": "*fp32", "LSE": "*fp32", "DELTA": "*fp32", "DBIAS": "*fp32",
           "DQ_ACC": "*fp32", "DELTA_OUT": "*fp32"}
    for name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV_OUT", "DS_BAND", "O_FWD"):
        ptr[name] = _DTYPES[dtype]
    for p, dt in params.items():
        ptr[f"PARAM_{p}"] = "*i32" if dt == "int32" else _DTYPES.get(dt, "*fp32")
        ptr[f"DPARAM_{p}"] = "*fp32"
    return {n: ptr.get(n, "constexpr") for n in kernel.arg_names}


def constexprs(*, batch=2, heads=16, kv_heads=16, seq=4096, head_dim=128, block_m=128, block_n=64, causal=True,
               window=False, softcap=False, sinks=False, bias=False, segments=False, dense=False, varlen=False,
               runtime_mask=False, tile_ranges=False, tma=False, ws=False, staged=True, atomic_dq=False,
               band=False, layout_block=1, tile_lists=False, positions=False, dtype="bfloat16") -> dict:
    pad = max(16, 1 << (head_dim - 1).bit_length())
    return dict(B=batch, HQ=heads, HKV=kv_heads, SEQ_Q=seq, SEQ_K=seq, D=head_dim, DV=head_dim, D_PAD=pad, DV_PAD=pad,
                BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, WINDOW=window, SOFTCAP=softcap, SINKS=sinks,
                N_SINKS=1, SINKS_PAD=16, BIAS_ON=bias, BIAS_BATCH=1, BIAS_HEADS=1, SEGMENTS=segments, DENSE=dense,
                MASK_BATCH=1, MASK_HEADS=1, MASK_BQ=layout_block, MASK_BK=layout_block, VARLEN=varlen,
                RUNTIME_MASK=runtime_mask or ((segments or dense) and not tile_ranges),
                TILE_RANGES=tile_ranges, TILE_BATCH=batch if tile_ranges else 1, TILE_HEADS=1,
                POSITIONS=positions, TILE_LISTS=tile_lists, TILE_COLS=-(-seq // block_n) if tile_lists else 1,
                PLAIN=not (softcap or bias), STAGED=staged,
                PRECISION="ieee" if dtype == "float32" else "tf32", UPCAST=False, TMA=tma, WS=ws, ATOMIC_DQ=atomic_dq,
                BAND=band, BAND_BLOCKS=band_blocks(block_m, block_n, 1024, seq) if band else 1,  # a (1024, 0) window
                BAND_TMA=band and not varlen and dtype != "float32",
                DQ_DELTA=not (atomic_dq or band))


def compile_attention(package: str, name: str, *, capability: int = 90, params: dict | None = None,
                      dtype: str = "bfloat16", num_warps: int = 4, num_stages: int = 2, **config) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module(f"{package}.{name}.triton_kernels")
    consts = constexprs(dtype=dtype, **config)
    compiled = {}
    for suffix in ("fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"):
        kernel = getattr(module, f"{name}_{suffix}")
        sig = _signature(kernel, dtype, params or {})
        # jax-triton promises 16-byte aligned arrays (tt.divisibility 16): without it Triton cannot use
        # cp.async for 16-bit tiles and the compiled loops would not be the ones that run on the GPU.
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
        source = ASTSource(fn=kernel, signature=sig, constexprs={n: consts[n] for n in kernel.arg_names if n in consts},
                           attrs=aligned)
        options = {"num_warps": num_warps, "num_stages": num_stages}
        compiled[suffix] = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    return compiled


def compile_gluon(*, capability: int = 90, dtype: str = "bfloat16", head_dim: int = 128, causal: bool = True,
                  window: bool = False, segments: bool = False, batch: int = 2, heads: int = 8, kv_heads: int = 2,
                  seq: int = 1000, dynamic: bool = False, forward_only: bool = False, layout=None,
                  spec: str | None = None, seq_k: int | None = None, softcap: bool = False,
                  fast_tanh: bool = False, staged_backward: bool | None = None, backward_only: bool = False,
                  docs_masks: bool | None = None, persistent_segments: bool | None = None,
                  kv_wire: bool = False, merge: bool = False, dq_into: bool = False, q_in_place: bool = False,
                  dkv_into: bool | str = False, spans: bool = False) -> dict:
    """The Gluon forward and backward (ejgen.runtime.attention.gluon.host) for one call's constexprs; ``dynamic``:
    the forward's dynamic tile queue; ``forward_only``: the forward alone; ``layout``: a block layout of (block_q,
    block_k, per head) (the kernels walk lists: LIST, `gluon.host.fwd_lists` / `bwd_lists`); ``spec``: a generated
    op's package (``"ejgen.zoo.natten_2d_attention"``) whose mask the kernels evaluate on partial tiles (SPEC_MASK,
    lists shared by the heads unless ``layout`` says otherwise); ``seq_k``: keys of another length than the queries
    (the forward's SEQ_K, `gluon_cross`); ``softcap``: the logits capped (SOFTCAP), with ``fast_tanh`` by the
    hardware's approximate tanh (SOFTCAP 2, `KernelChoice.fast_tanh`); ``docs_masks``: the forward's DOCS form of
    segment ids under causal (default `gluon.host.DOCS_MASKS`); ``persistent_segments``: with segment ids and no
    window, also the persistent backward that takes them (default `gluon.host.PERSISTENT_SEGMENTS_BWD`; compiled as
    "gluon_bwd_persistent_kernel"); ``kv_wire``: the forward reads K and V out of one buffer of unsigned 16-bit items
    (KV_AT: ring attention's received block, `ring.KV_FROM_WIRE`), and the backward its keys out of a block of twice
    the rows from a row read at run time (KV_AT, KV_ROWS, KV_OFF_AT: `ring.KV_FROM_WIRE_BWD`); ``merge``: the forward
    merges its result into an earlier one (MERGE: ring attention's last step, `ring.MERGE_IN_KERNEL`); ``dq_into``:
    the backward adds dQ into an accumulator of twice the rows from a row read at run time (DQ_ROWS, DQ_OFF_AT:
    `ring.DQ_ONCE`); ``q_in_place`` (with ``dq_into``): and reads q and dO from that row of tensors of as many rows
    (QDO_IN_PLACE: `ring.Q_IN_PLACE`); ``dkv_into`` (with ``kv_wire``): and writes dK / dV into a buffer laid out as
    that block's k and v at the keys' row, adding where a run-time flag says (DKV_AT, DKV_ADD_AT: `ring.DKV_INTO`;
    "store": without the add, as the first pair writing a new buffer); ``spans``: the forward walks each query
    tile's span of key blocks (SPANS, `gluon.host.layout_spans`: a layout of two key columns merged into an earlier
    result, the ring's wide step; with ``dynamic`` and without causal)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ejgen.runtime.attention.gluon import host as gluon_attention

    ptr = _DTYPES[dtype]
    args = (batch, heads, kv_heads, seq, head_dim, causal, window, segments)
    compiled = {}
    from ejgen.runtime.attention.config import AttentionConfig

    call = AttentionConfig(seq_q=seq, seq_k=seq, causal=causal, window=window, segments=segments)
    fwd_lists = bwd_lists = mask = staged = staged_bwd = None
    if spec:
        spec_layout = importlib.import_module(f"{spec}.triton_launch").LAYOUT
        mask = spec_layout.spec_mask()  # with position terms, theirs
        staged = spec_layout.staged_mask()  # the forward's key-side terms staged per block
        if staged_backward is None:  # as calls take it (`triton.host.STAGED_BACKWARD`)
            from ejgen.runtime.attention.triton import host as triton_host

            staged_backward = triton_host.STAGED_BACKWARD
        staged_bwd = spec_layout.staged_bwd_mask() if staged_backward else None
        fwd_lists = dict(gluon_attention.NO_LISTS, LIST=True)
        bwd_lists = dict(gluon_attention.NO_LISTS, LIST=1)
    elif window and segments:  # the backward walks lists (`gluon.host.listed`)
        bwd_lists = dict(gluon_attention.NO_LISTS, LIST=1)
    if layout:
        block_q, block_k, per_head = layout
        fwd_lists = dict(LIST=True, LIST_BATCH=1, LIST_HEADS=heads if per_head else 1,
                         **dict(zip(("SUB_Q", "SUB_K"), gluon_attention.sub_blocks((block_q, block_k), "fwd"))))
        bwd_lists = dict(LIST=2 if per_head else 1, LIST_BATCH=1, LIST_HEADS=kv_heads if per_head else 1,
                         **dict(zip(("SUB_Q", "SUB_K"), gluon_attention.sub_blocks((block_q, block_k), "bwd"))))
    divides = bool(spec) and importlib.import_module(f"{spec}.triton_launch").LAYOUT.mask_divides
    tiles = gluon_attention.fwd_key_tiles(call, divides)
    fwd_consts = gluon_attention.constexprs(*args, ordered=(gluon_attention.ordered(call) or bool(fwd_lists))
                                            and not spans,
                                            dynamic=dynamic, lists=fwd_lists, spec=mask, tiles=tiles, seq_k=seq_k,
                                            softcap=softcap, fast_tanh=fast_tanh, staged=staged, docs=docs_masks,
                                            kv_at=batch * (seq_k or seq) * kv_heads * head_dim if kv_wire else 0,
                                            merge=merge, spans=spans)
    kv_ptr = "*u16" if kv_wire else ptr
    segs = dict(QSEG="*i32", KSEG="*i32", RANGES="*i32", ORDER="*i32")
    bwd_pointers = dict(Q=ptr, K=kv_ptr, V=kv_ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", F32="*fp32", I32="*i32",
                        DQ_IN="*fp32", DKV_IN="*u16", DQ_ACC="*fp32", DK="*u16" if dkv_into else ptr, DV=ptr,
                        TILE_CTR="*i32", SCRATCH="*u8", **segs)
    kernels = [("gluon_fwd_kernel", gluon_attention.kernel(), fwd_consts,
                dict(Q=ptr, K=kv_ptr, V=kv_ptr, F32="*fp32", I32="*i32", O_PREV=ptr, LSE_PREV="*fp32", O=ptr,
                     LSE="*fp32", TILE_CTR="*i32",
                     SCRATCH="*u8", **segs)),
               ("gluon_bwd_kernel", gluon_attention.bwd_kernel(),
                gluon_attention.bwd_constexprs(*args, lists=bwd_lists, spec=mask, softcap=softcap, seq_k=seq_k,
                                               dq_rows=2 * seq if dq_into else None, dq_off_at=2 if dq_into else 0,
                                               kv_at=batch * 2 * seq * kv_heads * head_dim if kv_wire else 0,
                                               kv_rows=2 * seq if kv_wire else None, kv_off_at=3 if kv_wire else 0,
                                               q_in_place=q_in_place,
                                               dkv_at=batch * 2 * seq * kv_heads * head_dim if dkv_into else 0,
                                               dkv_add_at=4 if dkv_into and dkv_into != "store" else 0,
                                               fast_tanh=fast_tanh, staged=staged_bwd),
                bwd_pointers)]
    if forward_only:
        kernels = kernels[:1]
    elif backward_only:
        kernels = kernels[1:2]
    documents = gluon_attention.persistent_segments_bwd(call, bool(bwd_lists), persistent_segments)
    if not (forward_only or backward_only) and (causal and window and not bwd_lists or documents):
        # the persistent backward runs causal windows, and packed documents with PERSISTENT_SEGMENTS_BWD
        kernels.append(("gluon_bwd_persistent_kernel", gluon_attention.pbwd_kernel(),
                        gluon_attention.pbwd_constexprs(batch, heads, kv_heads, seq, head_dim, softcap, fast_tanh,
                                                        segments=documents, causal=causal),
                        dict(bwd_pointers, K=ptr, V=ptr)))  # (it reads no wire)
    for name, kernel, consts, pointers in kernels:
        sig = {n: pointers.get(n, "constexpr") for n in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
        source = GluonASTSource(kernel, sig, constexprs=consts, attrs=aligned)
        compiled[name] = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
    return compiled


def compile_plan(*, capability: int = 90, batch: int = 2, seq: int = 32768, heads: int = 16, causal: bool = True,
                 programs: int = 132) -> dict:
    """The documents' plan kernels (`gluon.plan`: ranges and order, each pass) with the options and constexprs
    `gluon.host.segment_plan` gives a call of these shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.runtime.attention.gluon import plan

    compiled = {}
    for pass_ in ("fwd", "bwd"):
        ranges = gluon_attention.plan_constexprs(batch, seq, pass_, causal)
        order = gluon_attention.plan_order_constexprs(ranges["N_O"] * batch, heads, programs, pass_)
        for which, kernel, consts in (("ranges", plan.ranges_kernel, ranges), ("order", plan.order_kernel, order)):
            consts = dict(consts)
            num_warps = consts.pop("num_warps")
            consts.pop("num_stages")
            sig = {n: "*i32" if n not in consts else "constexpr" for n in kernel.arg_names}
            aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in consts}
            source = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=aligned)
            compiled[f"{which}_{pass_}"] = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                                          options={"num_warps": num_warps, "num_stages": 1})
    return compiled


def compile_delta(*, capability: int = 90, seq: int = 32768, heads: int = 16, head_dim: int = 128,
                  dtype: str = "bf16") -> dict:
    """The Hopper backward's delta kernel (`gluon.delta`) with the options and constexprs `gluon.host.backward_delta`
    gives a call of these shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ejgen.runtime.attention.gluon import delta
    from ejgen.runtime.attention.gluon import host as gluon_attention

    consts = gluon_attention.delta_constexprs(seq, heads, head_dim)
    num_warps = consts.pop("num_warps")
    consts.pop("num_stages")
    kernel = delta.delta_kernel
    pointers = dict(O=f"*{dtype}", DO=f"*{dtype}", DLSE="*fp32", DELTA="*fp32", ZEROS="*fp32")
    sig = {n: pointers[n] if n in pointers else "constexpr" for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in pointers}
    source = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=aligned)
    return {"delta": triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                    options={"num_warps": num_warps, "num_stages": 1})}


def compile_decode(package: str, name: str, *, capability: int = 90, dtype: str = "bfloat16", params: dict | None = None,
                   head_dim: int = 128, groups: int = 4, queries: int = 1, paged: bool = False, page: int = 16,
                   causal: bool = True, window: bool = False, softcap: bool = False) -> dict:
    """The split-K decode kernel of one generated variant (`triton_decode.py`) for one call's constexprs (``page``:
    the paged cache's page size; one of the kernel's BLOCK_N or a multiple takes the one-read-a-block path)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ejgen.runtime.attention import split_k
    from ejgen.runtime.attention.triton import decode

    kernel = importlib.import_module(f"{package}.{name}.triton_decode").decode_kernel
    ptr = _DTYPES[dtype]
    pointers = dict(Q=ptr, K=ptr, V=ptr, STARTS="*i32", ENDS="*i32", TABLE="*i32", F32="*fp32", I32="*i32",
                    O_PART="*fp32", M_PART="*fp32", L_PART="*fp32", SCRATCH="*u8")
    for p, dt in (params or {}).items():
        pointers[f"PARAM_{p}"] = "*i32" if dt == "int32" else _DTYPES.get(dt, "*fp32")
    n_splits, per_split = split_k.splits(8, 8, 8192, decode.BLOCK_N, slots=528)
    pad = max(16, 1 << (head_dim - 1).bit_length())
    consts = dict(B=8, HQ=8 * groups, HKV=8, SQ=queries, SEQ_K=8192, D=head_dim, DV=head_dim, D_PAD=pad, DV_PAD=pad,
                  G=groups, M_PAD=max(16, 1 << (groups * queries - 1).bit_length()), BLOCK_N=decode.BLOCK_N,
                  SPLIT=per_split, N_SPLITS=n_splits, CAUSAL=causal, WINDOW=window, SOFTCAP=softcap, PAGED=paged,
                  PAGE=page if paged else 1, MAX_PAGES=8192 // page if paged else 1,
                  POOL_PAGES=8 * 8192 // page if paged else 1, PAGES_AHEAD=decode.PAGES_AHEAD,
                  WHOLE_PAGE=decode.WHOLE_PAGE,
                  PRECISION="ieee" if dtype == "float32" else "tf32", UPCAST=False)
    sig = {n: pointers.get(n, "constexpr") for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
    source = ASTSource(fn=kernel, signature=sig, constexprs={n: consts[n] for n in kernel.arg_names if n in consts},
                       attrs=aligned)
    target = GPUTarget("cuda", capability, 32)
    return {"decode_kernel": triton.compile(source, target=target,
                                            options={"num_warps": 4, "num_stages": decode.NUM_STAGES})}


def compile_pooling(package: str, name: str, *, capability: int = 90, dtype: str = "bfloat16", batch: int = 32,
                    seq: int = 8192, dim: int = 4096, chunk: int = 32, varlen: bool = False, weighted: bool = False,
                    weight_grad: bool = False) -> dict:
    """The forward, combine and backward kernels of one generated pooling spec (`triton_kernels.py`), with the tiles
    `ejgen.runtime.pooling.triton.host.tiles` gives a call of these shapes on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ejgen.runtime.pooling.config import PoolingConfig
    from ejgen.runtime.pooling.triton import host

    module = importlib.import_module(f"{package}.{name}.triton_kernels")
    ptr = _DTYPES[dtype]
    cfg = PoolingConfig(kind="sum", scaled=True, weighted=weighted, weight_grad=weight_grad, ranged=False,
                        varlen=varlen, n_seqs=batch, tokens=batch * seq, dim=dim, seq_len=0 if varlen else seq,
                        chunk=chunk)
    t = host.tiles(cfg, 4 if dtype == "float32" else 2)
    pointers = dict(X=ptr, W="*fp32", ITEMS="*i32", PART="*fp32", PART_DEN="*fp32", PART_TOKEN="*i32", FIRST="*i32",
                    Y=ptr, TOKEN="*i32", SCALE="*fp32", Y32="*fp32", DY=ptr, DX=ptr, DOT="*fp32")
    consts = dict(D=dim, CHUNK=chunk, BLOCK_D=t.block_d, WEIGHTED=weighted, EVEN_D=dim % t.block_d == 0,
                  SAVE=weight_grad, T=batch * seq, WEIGHT_GRAD=weight_grad, ITEM_AXIS=host.ITEM_AXIS,
                  EVICT=host.EVICT, GROUP=host.GROUP, DIRECT=False)
    compiled = {}
    for which in ("fwd", "combine", "bwd"):
        kernel = getattr(module, f"{name}_{which}_kernel")
        sig = {n: pointers.get(n, "constexpr") for n in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
        source = ASTSource(fn=kernel, signature=sig, constexprs={n: consts[n] for n in kernel.arg_names if n in consts},
                           attrs=aligned)
        options = {"num_warps": t.num_warps, "num_stages": 1 if which == "combine" else host.NUM_STAGES}
        compiled[which] = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    return compiled


_GK_ONLY = ("chunk_intra", "chunk_intra_diag", "chunk_grads_intra")


def compile_recurrent(package: str, name: str, *, capability: int = 90, dtype: str = "bfloat16", heads: int = 16,
                      kv_heads: int = 16, dk: int = 128, dv: int = 128, chunk: int = 64, gates=("gk",),
                      h0: bool = True, varlen: bool = False, reverse: bool = False, kernels=None,
                      states: str = "float32", products: str = "tf32", intra_diagonal: str | None = None,
                      intra_pieces: bool | None = None, grads_sums: bool | None = None,
                      state_groups: int = 0, walk_pass: int = 0, after: bool | None = None,
                      fused_bv: int | None = None, fold: bool | None = None,
                      grads_qk_tiles: tuple | None = None, output_ahead: bool | None = None,
                      adjoint_as_loaded: bool | None = None, grads_v_ahead: bool | None = None,
                      blocks_first: bool | None = None, fixed: bool = False, gated_q: bool | None = None,
                      log_grads: bool = True, gamma_total: bool | None = None,
                      output_tiles: tuple | None = None) -> dict:
    """The fused and chunked kernels of one generated recurrent spec (`triton_kernels.py`), forward and backward, with
    the blocks and launch settings `ejgen.runtime.recurrent.triton.host` gives a call of these shapes; ``states``
    "bfloat16": the two-pass forward's stored chunk states in bf16 (the chunk_state_dtype setting; chunk_state and
    chunk_output, the kernels that write and read them: the backward's states stay float32); ``products``
    "bfloat16": the state products' operands in bf16 (the chunk_products setting, SP), else TF32; both: the
    backward's stored states and adjoints in bf16 too, as the host stores them then. ``intra_diagonal``: chunk_intra's
    diagonal blocks "inline" or read from `chunk_intra_diag`'s ("kernel"; default: host.CHUNK_INTRA_DIAGONAL), in
    pieces of 4 steps with ``intra_pieces`` (default: host.CHUNK_INTRA_PIECES); ``grads_sums``: chunk_grads_intra reads
    `chunk_sums`' prefix sums (default: host.GRADS_INTRA_SUMS); ``state_groups``: the state walks in groups of that many
    chunks (the kernels with GROUP, and `chunk_state_groups`; 0: one walk a sequence); ``walk_pass``: the walks' PASS
    with groups (0 relative states; 1, 2 the two walks of host.STATE_GROUP_FORM "rewalk"); ``after``: chunk_sums
    stores the after sums RS and their readers read them (False: formed where read; default: as host.after_stored
    launches these inputs);
    ``fused_bv``: the fused kernels' value block (default host.FUSED_BV; host.FUSED_WIDE_BV: a large decode step's);
    ``fold``: chunk_grads_qk's scalar-gate terms in its [C, C] scan; ``grads_qk_tiles``: its launch (block_k,
    block_v, warps, stages) with a scalar gate (defaults: what host.grads_qk_form gives these inputs on this
    capability); ``output_ahead``: chunk_output's reads ahead of its K loop (default host.OUTPUT_AHEAD);
    ``adjoint_as_loaded``: chunk_state_bwd's scalar-gate walk in the forward's form (default host.ADJOINT_AS_LOADED);
    ``grads_v_ahead``: chunk_grads_v's reads ahead of its K loop (default host.grads_v_ahead's); ``blocks_first``:
    chunk_output's, chunk_grads_v's and chunk_grads_qk's blocks of a chunk side by side in the grid (default
    host.blocks_first's); ``fixed``: no sums (SUMS off), as the forward launches g_gamma alone with
    host.FIXED_DECAY_SUMS (chunk_state and chunk_output then form the fixed decay's sums from γ); ``gated_q``:
    chunk_intra stores q ⊙ e^{P} in bf16 and chunk_output reads it (default: as host.GATED_Q launches these inputs);
    ``log_grads``: chunk_grads_qk forms the log gates' gradient (False: a scalar decay held fixed); ``gamma_total``:
    g_gamma alone, its chunk's whole share of that gradient (default host.GAMMA_TOTAL); ``output_tiles``: chunk_output's
    launch (block_k, block_v, warps, stages; default host.output_launch's for these inputs)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ejgen.runtime.recurrent.triton import host

    module = importlib.import_module(f"{package}.{name}.triton_kernels")
    ptr = _DTYPES[dtype]
    # dq, dk, dv as the host has the chunked gradient kernels write them: in the inputs' dtype where nothing is left
    # to do to them in float32 (host._direct: no head groups, no feature map)
    mapped = getattr(module, "FEATURE_MAP", None)
    mapped = getattr(module._shared, "FEATURE_MAP", False) if mapped is None else mapped
    grad = ptr if heads == kv_heads and not getattr(mapped, "value", mapped) else "*fp32"
    pointers = dict(Q=ptr, K_=ptr, V_=ptr, G="*fp32", GAMMA="*fp32", GK="*fp32", GV="*fp32", H0="*fp32", CU="*i32",
                    FIRST="*i32", CHUNKS="*i32", O=ptr, HT="*fp32", HS="*fp32", DO=ptr, DHT="*fp32", DHS="*fp32",
                    DQ="*fp32", DK="*fp32", DV="*fp32", DH0="*fp32", DLK="*fp32", DLV="*fp32", CK="*fp32",
                    SCR="*fp32", DLOG="*fp32", A=ptr, DA="*fp32", DQI="*fp32", DKI="*fp32", DLI="*fp32", PS="*fp32",
                    RS="*fp32", LS="*fp32", DIAG="*fp32", GE="*fp32", GD="*fp32", DC="*fp32",
                    GS="*fp32", GA="*fp32", DCA="*fp32", QG="*bf16")
    bk = max(16, 1 << (dk - 1).bit_length())
    bvf = max(16, 1 << (dv - 1).bit_length())
    consts = dict(T=0 if varlen else 4096, H=heads, HKV=kv_heads, K=dk, V=dv, BK=bk, SCALE=dk ** -0.5,
                  USE_G="g" in gates, USE_GAMMA="g_gamma" in gates, USE_GK="gk" in gates, USE_GV="gv" in gates,
                  USE_H0=h0, VARLEN=varlen, REVERSE=reverse, ROWS=4 * 4096, C=chunk, BC=host.SUB, MAP=True,
                  BT=host.FUSED_BT, GRADS=True, WITH_A=True,  # chunk_sums' (the default) with a key-side gate:
                  SUMS=bool(set(gates) & set(host.CHUNKED_GATES)) and not fixed,  # (fixed: the forward's, none)
                  DT={"bfloat16": tl.bfloat16, "float16": tl.float16, "float32": tl.float32}[dtype],
                  SP=tl.bfloat16 if products == "bfloat16" else tl.float32,
                  DIAG_IN=(intra_diagonal or host.CHUNK_INTRA_DIAGONAL) == "kernel",
                  PIECES=intra_pieces if intra_pieces is not None else host.CHUNK_INTRA_PIECES,
                  GROUP=state_groups, NG=-(-4096 // chunk // state_groups) if state_groups else 1, BACKWARD=False,
                  PASS=walk_pass, AFTER=host.stores_after(dtype, gates) if after is None else after,
                  AHEAD=host.OUTPUT_AHEAD if output_ahead is None else output_ahead,
                  AS_LOADED=host.ADJOINT_AS_LOADED if adjoint_as_loaded is None else adjoint_as_loaded,
                  GRADS_AHEAD=host.grads_v_ahead(gates) if grads_v_ahead is None else grads_v_ahead,
                  BLOCKS_FIRST=host.blocks_first(gates) if blocks_first is None else blocks_first)
    # (TOTAL as if folded: the kernel takes it with its FOLD alone)
    consts["LOG_GRADS"], consts["TOTAL"] = host.log_grads(gates, log_grads, True, gamma_total)
    consts["GATED_Q"] = host.gated_q(dtype, products, gates, consts["SUMS"]) if gated_q is None else gated_q
    host_fold, qk_blocks, qk_options = host.grads_qk_form(
        dtype, "bfloat16" if products == "bfloat16" else "tf32", gates, dk, dv, arch=f"sm{capability}",
        grouped=state_groups > 0)
    consts["FOLD"] = host_fold if fold is None else fold
    fused = min(fused_bv or host.FUSED_BV, bvf)
    compiled = {}
    for which in ("fused_fwd", "fused_bwd", "chunk_sums", "chunk_state", "chunk_state_groups", "chunk_intra",
                  "chunk_intra_diag", "chunk_state_bwd", "chunk_output", "chunk_fused_fwd", "chunk_grads_intra",
                  "chunk_grads_qk", "chunk_grads_v"):
        if kernels is not None and which not in kernels or which in _GK_ONLY and "gk" not in gates:
            continue  # (the intra-chunk kernels run with gk only; chunk_intra as the backward's, with dA)
        if which == "chunk_state_groups" and not state_groups:
            continue
        if which == "chunk_sums" and not consts["SUMS"]:
            continue  # (no key-side gate, no sums)
        if which.startswith("fused"):
            blocks, options = dict(BV=fused), {"num_warps": host.NUM_WARPS, "num_stages": 1}
        elif which == "chunk_state_groups":
            blocks, options = host.tiles("chunk_state", dk, dv)
        elif which == "chunk_grads_qk":
            blocks, options = (host.tiles(which, dk, dv, host.Tiles(*grads_qk_tiles)) if grads_qk_tiles
                               else (qk_blocks, qk_options))
        elif which == "chunk_output":
            launch = host.output_launch(dtype, "bfloat16" if products == "bfloat16" else "tf32", gates,
                                        arch=f"sm{capability}")
            blocks, options = host.tiles(which, dk, dv, host.Tiles(*output_tiles) if output_tiles else launch)
        else:
            blocks, options = host.tiles(which, dk, dv)
        kernel = getattr(module, f"{name}_{which}_kernel")
        sig = {n: pointers.get(n, "constexpr") for n in kernel.arg_names}
        if which in ("chunk_grads_qk", "chunk_grads_v"):
            sig.update({n: grad for n in ("DQ", "DK", "DV") if n in sig})
        if states == "bfloat16" and which in ("chunk_state", "chunk_output"):
            sig["HS"] = "*bf16"
        if states == "bfloat16" and products == "bfloat16" and which in ("chunk_state_bwd", "chunk_grads_qk",
                                                                          "chunk_grads_v"):
            sig.update({n: "*bf16" for n in ("HS", "DHS") if n in sig})  # the backward's, as the host stores them
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
        kconsts = {**consts, **blocks}
        if which == "chunk_grads_intra":
            kconsts["SUMS"] = consts["SUMS"] and (grads_sums if grads_sums is not None else host.GRADS_INTRA_SUMS)
        if which == "chunk_sums" and "gk" not in gates:
            kconsts.update(K=1, BK=host.scalar_sums_lanes(heads))  # a scalar gate's sums: one a step, every head
        source = ASTSource(fn=kernel, signature=sig, attrs=aligned,
                           constexprs={n: kconsts[n] for n in kernel.arg_names if n in kconsts})
        compiled[which] = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    return compiled


def summary(compiled: dict, with_ptx: bool = False, with_resources: bool = False) -> dict:
    """Per kernel: shared memory, whether there is a cubin and wgmma, the Triton that compiled it; ``with_ptx`` the
    PTX; ``with_resources`` its registers per thread and stack bytes (`resources`)."""
    import triton

    out = {}
    for name, c in compiled.items():
        out[name] = {"shared": c.metadata.shared, "cubin": bool(c.asm.get("cubin")), "wgmma": "wgmma" in c.asm["ptx"],
                     "global_scratch": c.metadata.global_scratch_size, "warps": c.metadata.num_warps,
                     "triton": triton.__version__}
        if with_ptx:
            out[name]["ptx"] = c.asm["ptx"]
        if with_resources:
            out[name].update(resources(c.asm["cubin"]))
    return out


def resources(cubin: bytes) -> dict:
    """{"registers": per thread, "stack": bytes per thread (spilled registers)} of a cubin, from the cuobjdump that
    ships with Triton."""
    import re

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", text).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", text).group(1))}


def compile_in_subprocess(package: str, name: str, **kwargs) -> dict:
    """`summary` of `compile_attention` (kwargs: its arguments, and with_ptx), from a fresh interpreter."""
    return _in_subprocess({"package": package, "name": name, **kwargs})


def compile_decode_in_subprocess(package: str, name: str, **kwargs) -> dict:
    """`summary` of `compile_decode`, from a fresh interpreter."""
    return _in_subprocess({"decode": True, "package": package, "name": name, **kwargs})


def compile_pooling_in_subprocess(package: str, name: str, **kwargs) -> dict:
    """`summary` of `compile_pooling`, from a fresh interpreter."""
    return _in_subprocess({"pooling": True, "package": package, "name": name, **kwargs})


def compile_recurrent_in_subprocess(package: str, name: str, **kwargs) -> dict:
    """`summary` of `compile_recurrent`, from a fresh interpreter."""
    return _in_subprocess({"recurrent": True, "package": package, "name": name, **kwargs})


def compile_gluon_in_subprocess(**kwargs) -> dict:
    """`summary` of `compile_gluon` (kwargs: its arguments, and with_ptx), from a fresh interpreter: forward and
    backward."""
    return _in_subprocess({"gluon": True, **kwargs})


def compile_all_in_subprocess(requests: list, triton: str | None = None) -> list:
    """Several compiles in one fresh interpreter (one start, one import of Triton and the packages): each request
    as ``compile_in_subprocess`` takes its arguments (``{"package": ..., "name": ..., **kwargs}``); each result its
    ``summary``, or ``{"error": <the traceback's end>}`` for a request that failed. ``triton``: a folder holding
    another Triton (``GPU_HOST_TRITON``), imported by the subprocess instead of the environment's."""
    return _in_subprocess(list(requests), triton)


# A folder with the GPU host's Triton (3.6: `pip install --no-deps --target DIR triton==3.6.0`; .ci/run makes one):
# generated code must compile on it as well as on the Triton installed here (README, GPU host)
GPU_HOST_TRITON = os.environ.get("EJGEN_GPU_HOST_TRITON")


def gpu_host_triton() -> str:
    """The folder of the GPU host's Triton, for a test that compiles with it: under CI its absence fails the test
    (.ci/run makes the folder), elsewhere it skips it."""
    import pytest

    if not GPU_HOST_TRITON:
        if os.environ.get("CI"):
            pytest.fail("CI sets EJGEN_GPU_HOST_TRITON to a folder with the GPU host's Triton (.ci/run)")
        pytest.skip("EJGEN_GPU_HOST_TRITON names no folder with the GPU host's Triton (pip install --no-deps "
                    "--target DIR triton==3.6.0)")
    return GPU_HOST_TRITON


def by_gpu_host_triton(compiled: dict) -> bool:
    """Whether a `summary` entry was compiled by another Triton than the one installed here (the GPU host's)."""
    import triton

    return compiled["triton"] != triton.__version__


def _in_subprocess(args, triton: str | None = None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (triton, env.get("PYTHONPATH")) if p)
        env["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "ejgen-triton-cache-gpu-host")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if not env.get("TRITON_CACHE_DIR"):
        # Triton 3.6 on the GPU host found no cache dir of its own in this subprocess: name one
        env["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "ejgen-triton-cache")
    reply = _Server.of(triton, env).ask(args)
    if "failed" in reply:
        what = ("several kernels" if isinstance(args, list) else "the Gluon forward" if args.get("gluon")
                else f"{args['package']}.{args['name']}")
        raise RuntimeError(f"AOT compile of {what} failed:\n{reply['failed']}")
    return reply["result"]


class _Server:
    """One interpreter of this module (``main(["--serve", ...])``) that compiles request after request for this
    process: Python, JAX, Triton and the packages start and import once, not once a call (~2 s a call, with a cold
    Triton cache or a warm one). One per Triton folder (None: the installed one); a new one where the environment or
    the working folder differ from its own (a test's PYTHONPATH or settings), where it died, or after `IDLE` seconds
    without a request (it exits then: its ~350 MB back)."""

    IDLE = 90
    _running: dict = {}  # Triton folder -> _Server

    def __init__(self, triton: str | None, env: dict, key):
        self.triton, self.key = triton, key
        self.log = tempfile.TemporaryFile()  # its stderr: a crash's last words
        self.proc = subprocess.Popen([sys.executable, "-m", "ejgen.testing.aot", "--serve", str(self.IDLE)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.used = time.monotonic()

    @classmethod
    def of(cls, triton: str | None, env: dict) -> "_Server":
        key = (os.getcwd(), sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
        server = cls._running.get(triton)
        # (restarted a little before its own idle limit: it never exits while a request is on its way)
        if (server is None or server.key != key or server.proc.poll() is not None
                or time.monotonic() - server.used > 0.75 * cls.IDLE):
            if server is not None:
                server.close()
            server = cls._running[triton] = cls(triton, env, key)
        return server

    def ask(self, args) -> dict:
        """``{"result": ...}`` as `main` prints it for ``args``, or ``{"failed": <why>}``."""
        try:
            self.proc.stdin.write(json.dumps(args) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        except BaseException:  # (interrupted: its reply would answer the next request)
            self.close()
            raise
        self.used = time.monotonic()
        if line:
            return json.loads(line)
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - 4000))
        last_words = self.log.read().decode(errors="replace")
        self.close()
        return {"failed": f"the compiling process died (exit {self.proc.returncode}):\n{last_words}"}

    def close(self):
        if self._running.get(self.triton) is self:
            del self._running[self.triton]
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@atexit.register
def _close_servers():
    for server in list(_Server._running.values()):
        server.close()


def _compile(args: dict) -> dict:
    args = dict(args)
    with_ptx = args.pop("with_ptx", False)
    with_resources = args.pop("with_resources", False)
    if args.pop("gluon", False):
        compiled = compile_gluon(**args)
    elif args.pop("plan", False):
        compiled = compile_plan(**args)
    elif args.pop("delta", False):
        compiled = compile_delta(**args)
    elif args.pop("decode", False):
        compiled = compile_decode(args.pop("package"), args.pop("name"), **args)
    elif args.pop("pooling", False):
        compiled = compile_pooling(args.pop("package"), args.pop("name"), **args)
    elif args.pop("recurrent", False):
        compiled = compile_recurrent(args.pop("package"), args.pop("name"), **args)
    else:
        compiled = compile_attention(args.pop("package"), args.pop("name"), **args)
    return summary(compiled, with_ptx, with_resources)


def _answer(args):
    """`main`'s answer to ``args``: one request's `summary`, or a list of them (a request that failed:
    ``{"error": <the traceback's end>}``, the others still compiled)."""
    if not isinstance(args, list):
        return _compile(args)
    results = []
    for request in args:
        try:
            results.append(_compile(request))
        except Exception:  # reported with its request; the others still compile
            results.append({"error": traceback.format_exc()[-4000:]})
    return results


def _serve(idle: float) -> int:
    """Requests (JSON, a line each) from stdin until it closes or stays silent ``idle`` seconds; a line of JSON on
    stdout for each, ``{"result": ...}`` or ``{"failed": <the traceback's end>}``."""
    import select

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever Triton or a tool prints goes to stderr, not between the replies
    sys.stdout = sys.stderr
    while select.select([sys.stdin], [], [], idle)[0]:
        line = sys.stdin.readline()
        if not line:
            break
        try:
            reply = {"result": _answer(json.loads(line))}
        except Exception:
            reply = {"failed": traceback.format_exc()[-4000:]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    return 0


def main(argv=None) -> int:
    """``python -m ejgen.testing.aot '<JSON request or list of requests>'``: `_answer`'s JSON on stdout;
    ``--serve IDLE``: `_serve`."""
    argv = argv or sys.argv[1:]
    if argv[0] == "--serve":
        return _serve(float(argv[1]))
    print(json.dumps(_answer(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
