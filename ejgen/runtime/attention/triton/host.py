"""The Triton backend's plumbing, shared by every generated variant: argument packing, grids,
configs, and the reductions that finish the backward pass deterministically.

A generated ``triton_launch.py`` names its kernels module and its runtime scalars (``Layout``);
everything else is here, once.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.runtime.attention import tiles
from ejgen.runtime.attention.api import (SEQ_MAJOR, add_rows, delta_rows, given_delta, given_dkv, given_dq,
                                         given_merge, given_q_rows, given_spans, given_spare, given_wire, join_sinks,
                                         merge_into, sinks_grad)
from ejgen.runtime.attention.gluon import host as gluon_attention
from ejgen.runtime.attention.triton import configs as triton_configs
from ejgen.runtime.core import kernels, settings, sizes
from ejgen.runtime.launch import triton_call

# The kernels index the caller's layout: q [B, Sq, Hkv, G, D], k/v [B, Sk, Hkv, D], out like q;
# lse and delta [B, Hq, Sq]. No transposes before or after the kernels.
TENSOR_LAYOUT = SEQ_MAJOR


def available():
    return triton_call.available()


@dataclasses.dataclass(frozen=True)
class Layout:
    kernel_module: str
    name: str
    f32_options: tuple
    i32_options: tuple
    params: tuple
    grad_params: tuple
    runtime_mask_from_spec: bool
    score_is_identity: bool
    gathers_by_position: bool  # the score reads a param tile by position (a gather in every block)
    builtin_mask_only: bool = False  # no mask of the spec's own (causal / sliding window at most): the Gluon
    #                                  kernels may run (packages rendered before it say nothing: they do not)
    mask_tiles: Callable | None = None  # the spec's mask by tile, (t, ctx) -> kinds (ejgen.emit.attention.intervals)
    gluon_mask: bool = False  # the kernel module's `_spec_mask` / `_spec_options` serve the Hopper kernels too (a
    #                           spec mask of no params: docs/DESIGN.md §6); packages rendered before say nothing
    mask_divides: bool = False  # the mask the Hopper kernels run divides positions by a run-time value
    #                             (`gluon.host.fwd_key_tiles`)
    # the spec mask's costly one-position terms, (seq, ctx) -> int32 [terms, seq rounded up to 256], which the Hopper
    # kernels read from I32[position_terms_at] on (`gluon_scalars`; docs/DESIGN.md §6, position terms)
    position_terms: Callable | None = None
    position_terms_at: int = 0
    position_terms_kv: int = 0  # the key side's terms (table rows 0 .. kv - 1), staged by the Hopper forward (1-4)
    position_terms_q: int = 0  # the query side's (rows q_first .. q_first + q - 1), staged by the Hopper backward
    position_terms_q_first: int = 0  # (1-4); rows below q_first are the key side's alone, the rows between both's

    def spec_mask(self) -> tuple | None:
        """(`_spec_mask`, `_spec_options`) of the kernel module, the Hopper kernels' SPEC_MASK / SPEC_OPTIONS (None
        without a spec mask they can call); with position terms `_spec_mask_terms` and `_spec_options_terms`, which
        read them from the table `gluon_scalars` appends to I32."""
        if not self.gluon_mask:
            return None
        module = self.kernels()
        if self.position_terms is not None:
            return module._spec_mask_terms, module._spec_options_terms
        return module._spec_mask, module._spec_options

    def staged_mask(self) -> tuple | None:
        """The Hopper forward's form of a mask with key-side position terms (`gluon.host.constexprs`' ``staged``):
        (`_spec_mask_staged`, `_spec_q_terms`, the key-side terms, where the table starts in I32), or None."""
        if not self.gluon_mask or self.position_terms is None or not self.position_terms_kv:
            return None
        module = self.kernels()
        return module._spec_mask_staged, module._spec_q_terms, self.position_terms_kv, self.position_terms_at

    def staged_bwd_mask(self) -> tuple | None:
        """The Hopper backward's form of a mask with query-side position terms (`gluon.host.bwd_constexprs`'
        ``staged``): (`_spec_mask_staged`, `_spec_kv_terms`, the query-side terms, where the table starts in I32, the
        row of the first), or None."""
        if self.staged_mask() is None or not self.position_terms_q:
            return None
        module = self.kernels()
        return (module._spec_mask_staged, module._spec_kv_terms, self.position_terms_q, self.position_terms_at,
                self.position_terms_q_first)

    def gluon_scalars(self, scalars: list, ctx, seq: int) -> list:
        """The Hopper kernels' [F32, I32]: with position terms, I32's scalars, zeros up to position_terms_at and the
        terms' table ([terms, seq rounded up to 256], row-major) after them."""
        if self.position_terms is None or not self.gluon_mask:
            return scalars
        f32, i32 = scalars
        table = self.position_terms(seq, ctx)
        pad = jnp.zeros((self.position_terms_at - i32.shape[0], ), jnp.int32)
        return [f32, jnp.concatenate([i32, pad, table.reshape(-1)])]

    def kernels(self):
        return importlib.import_module(self.kernel_module)


def _cdiv(a, b):
    return -(-a // b)


def _pow2(n):
    """A padded head dim (or row count): ``sizes.pow2`` with the tensor cores' floor of 16."""
    return sizes.pow2(n, 16)


def _config(layout: Layout, pass_: str, head_dim: int, bits: int, cfg, deterministic: bool = False, *,
            dims: tuple | None = None) -> triton_configs.KernelConfig:
    """The config of one pass: the table's (or the tuned / pinned one), checked, shrunk to fit shared memory
    when a bias or dense mask streams through. ``dims``: (D, Dv) (default: both ``head_dim``)."""
    d, dv = dims or (head_dim, head_dim)
    seq = max(_longest(cfg, True), _longest(cfg, False))
    conf = triton_configs.pick(_arch(), pass_, head_dim, bits, seq, cfg.causal, cfg.window)
    if deterministic and conf.atomic:
        if triton_configs.pinned(pass_):
            raise ValueError(f"triton config {pass_}={triton_configs.text(conf)!r}: 'atomic' adds dQ in run-time "
                             f"order, which a deterministic call cannot take")
        conf = dataclasses.replace(conf, atomic=False)  # a tuned entry: the two-kernel dQ instead
    for flag, what in (("atomic", "dQ added by the dK/dV kernel"), ("band", "dS stored by the dK/dV kernel")):
        if getattr(conf, flag) and pass_ != "dkdv":
            raise ValueError(f"triton config {triton_configs.text(conf)!r} for the {pass_} kernel: {flag!r} ({what}) "
                             f"is a flag of the dkdv config only")
    if conf.ws and conf.merged:
        raise ValueError(f"triton config {triton_configs.text(conf)!r}: 'ws' warp-specialises the unmasked loop of "
                         f"the three-loop forward; it cannot go with 'merged'")
    if not triton_configs.pinned(pass_):  # a pinned config is the user's word
        conf = triton_configs.fit_shared_memory(conf, pass_, d, dv, bits // 8, cfg.bias, cfg.dense_mask or cfg.layout)
    if layout.gathers_by_position and conf.num_stages > 1:
        # Triton 3.6 multi-buffers the gathered [BLOCK_M, BLOCK_N] float32 tile in shared memory
        # with the K/V tiles (240 KB at 128x128, 3 stages: over the limit): do not pipeline.
        conf = dataclasses.replace(conf, num_stages=1)
    return conf


def _autotune(layout: Layout, pass_: str, conf: triton_configs.KernelConfig):
    """Configs for jax-triton's autotuned call when EJGEN_TRITON_AUTOTUNE=1, else None: the chosen one
    first, then `ejgen tune`'s candidates for the pass with the same descriptor flag (one signature)."""
    if not settings.current().triton_autotune:
        return None
    table = triton_configs.CANDIDATES
    candidates = [triton_configs.parse(t) for t in table.get(_arch(), table["sm90"])[pass_]]
    if layout.gathers_by_position:
        candidates = [dataclasses.replace(c, num_stages=1) for c in candidates]
    if conf.ws:
        raise ValueError("EJGEN_TRITON_AUTOTUNE: a config with 'ws' cannot be autotuned (warp specialisation "
                         "depends on whole blocks, and the blocks vary)")
    same_blocks = lambda c: not conf.band or (c.block_m, c.block_n) == (conf.block_m, conf.block_n)  # the band's shape
    return [conf] + [c for c in dict.fromkeys(candidates)
                     if c.tma == conf.tma and c.atomic == conf.atomic and c.band == conf.band and same_blocks(c)
                     and not c.ws and c != conf]


def _grid(longest: int, block_size, rows: int, tuned, which: str):
    """(grid, its largest extent over the tuned configs): a tuple, or a function of the config's
    blocks when jax-triton picks among `tuned`."""
    of = lambda block: (max(_cdiv(longest, block), 1), rows)
    largest = of(min(getattr(c, which) for c in tuned)) if tuned else of(block_size)
    if tuned:
        key = "BLOCK_M" if which == "block_m" else "BLOCK_N"
        return (lambda meta: of(meta[key])), largest
    return of(block_size), largest


def _arch():
    how, _ = triton_call.mode()
    return "interpret" if how == "interpret" else "sm90"


def _dummy(dtype=jnp.float32):
    return jnp.zeros((1,), dtype)


def scalar_arrays(ctx, f32_options: tuple, i32_options: tuple) -> list:
    """The kernels' F32 = [scale, softcap, float options] and I32 = [window_left, window_right, int and bool options]
    (`ejgen.emit.attention.common.scalar_layout`), as every generated Triton kernel reads them."""
    f32 = [ctx["scale"], ctx.get("softcap", 1.0)] + [ctx[n] for n in f32_options]
    i32 = [ctx.get("window_left", 0), ctx.get("window_right", 0)] + [ctx[n] for n in i32_options]
    return [_packed(f32, jnp.float32), _packed(i32, jnp.int32)]


def _packed(values: list, dtype):
    """One array of the kernels' scalars, and past the last one they read a marker (the first plus one): XLA folds a
    stack of constants into one, and turns a constant whose elements are all equal into a broadcast, a kernel of its
    own launched before every call ([window_left, window_right] = [0, 0], session 21); with the marker the array
    stays a literal."""
    scalars = [jnp.asarray(x, dtype) for x in values]
    return jnp.stack(scalars + [scalars[0] + jnp.asarray(1, dtype)])


def _inputs(layout: Layout, ctx, cfg, hq):
    """(scalar arrays, feature tensors, params) in kernel-signature order."""
    scalars = scalar_arrays(ctx, layout.f32_options, layout.i32_options)
    if cfg.bias:
        bias = ctx["bias"]  # [Bb, Hkv|1, G|1, Sq, Sk]
        bias = bias.reshape(bias.shape[0], -1, bias.shape[3], bias.shape[4])
    else:
        bias = _dummy()
    if cfg.dense_mask or cfg.layout:  # an element mask, or the block layout's blocks (never both: `_masks`)
        mask = ctx["mask" if cfg.dense_mask else "layout"]
        mask = mask.reshape(mask.shape[0], -1, mask.shape[3], mask.shape[4]).astype(jnp.int8)
    else:
        mask = _dummy(jnp.int8)
    qseg = ctx["q_seg"] if cfg.segments else _dummy(jnp.int32)
    kvseg = ctx["kv_seg"] if cfg.segments else _dummy(jnp.int32)
    cu_q = ctx["cu_q"] if cfg.varlen else _dummy(jnp.int32)
    cu_k = ctx["cu_k"] if cfg.varlen else _dummy(jnp.int32)
    aux = ctx["softmax_aux"].reshape(hq, -1) if cfg.sinks else _dummy()
    qpos = ctx["q_pos"] if cfg.positions else _dummy(jnp.int32)  # [B, Sq], shifted (api.prepare)
    kvpos = ctx["kv_pos"] if cfg.positions else _dummy(jnp.int32)
    features = [bias, qseg, kvseg, mask, cu_q, cu_k, qpos, kvpos]
    params = [ctx[f"param_{p}"] for p in layout.params]
    return scalars, features, aux, params


def _tiles(layout: Layout, ctx, cfg, q, k, conf, by_keys: bool):
    """(TILES, constexprs) of one kernel: with segment ids, a dense mask or a block layout (not varlen), their tile
    ranges at the kernel's tiles (docs/DESIGN.md §3 block masks; `ejgen.types.block_mask`): for each query tile
    (the dK/dV kernel: each key tile, over the query heads of its kv head) the key tiles to visit and the run that
    needs no element mask. O(tiles) for segment ids and layouts; a dense mask is reduced per tile. A block layout,
    explicit positions, or a spec mask the analysis cannot bound (classified by tile: `Layout.mask_tiles`) give
    lists instead (scattered tiles: the hull would visit them all). Else a placeholder."""
    # the spec's own mask by tile (`Layout.mask_tiles`): where the analysis leaves an element mask, or lists walk
    spec = layout.mask_tiles is not None and (layout.runtime_mask_from_spec or cfg.layout or cfg.positions)
    if cfg.varlen or not (cfg.segments or cfg.dense_mask or cfg.layout or cfg.positions or spec):
        return _dummy(jnp.int32), {}
    from ejgen.types import block_mask

    batch, sq, hkv, groups = q.shape[:4]
    sk = k.shape[1]
    kinds = tiles.mask_kinds(ctx, cfg, conf.block_m, conf.block_n, sq, sk)
    if spec:
        kinds = jnp.minimum(kinds, tiles.spec_kinds(layout.mask_tiles, ctx, cfg, conf.block_m, conf.block_n, sq, sk,
                                                    batch, hkv * groups))
    # lists where tiles scatter (a layout, a spec mask beyond the analysis) or positions (no index ranges); they
    # replace the analysed ranges, so every condition is in the kinds: causal and the window join them here
    listed = (cfg.layout or cfg.positions or spec) and (layout.builtin_mask_only or spec)
    if listed:
        kinds = jnp.minimum(kinds, tiles.band_kinds(ctx, cfg, conf.block_m, conf.block_n, sq, sk))
        kinds = tiles.edges_partial(kinds, conf.block_m, conf.block_n, sq, sk)
    if by_keys:  # per key tile; a program serves the query heads of one kv head: visit any, full only if all full
        kinds = jnp.swapaxes(kinds, -1, -2)
        if kinds.shape[1] > 1:
            kinds = tiles.union(kinds.reshape(kinds.shape[0], hkv, -1, *kinds.shape[2:]), axis=2)
    if listed:
        lists = block_mask.tile_lists(kinds)
        consts = dict(TILE_RANGES=True, TILE_LISTS=True, TILE_COLS=kinds.shape[-1], TILE_BATCH=lists.shape[0],
                      TILE_HEADS=lists.shape[1], RUNTIME_MASK=False)
        return lists, consts
    ranges = block_mask.tile_ranges(kinds)
    consts = dict(TILE_RANGES=True, TILE_BATCH=ranges.shape[0], TILE_HEADS=ranges.shape[1],
                  RUNTIME_MASK=layout.runtime_mask_from_spec)
    return ranges.astype(jnp.int32), consts


def _constexprs(layout, q, k, v, cfg, conf, bias, mask, aux):
    batch, sq, hkv, groups, d = q.shape
    dv = v.shape[-1]
    n_sinks = aux.shape[-1] if cfg.sinks else 1
    return dict(
        B=batch, HQ=hkv * groups, HKV=hkv, SEQ_Q=sq, SEQ_K=k.shape[1], D=d, DV=dv, D_PAD=_pow2(d), DV_PAD=_pow2(dv),
        BLOCK_M=conf.block_m, BLOCK_N=conf.block_n,
        CAUSAL=cfg.causal, WINDOW=cfg.window, SOFTCAP=cfg.softcap, SINKS=cfg.sinks, N_SINKS=n_sinks,
        SINKS_PAD=_pow2(n_sinks), BIAS_ON=cfg.bias, BIAS_BATCH=bias.shape[0] if cfg.bias else 1,
        BIAS_HEADS=bias.shape[1] if cfg.bias else 1, SEGMENTS=cfg.segments, DENSE=cfg.dense_mask or cfg.layout,
        MASK_BATCH=mask.shape[0] if mask.ndim == 4 else 1, MASK_HEADS=mask.shape[1] if mask.ndim == 4 else 1,
        VARLEN=cfg.varlen,
        MASK_BQ=cfg.layout_block[0] if cfg.layout else 1, MASK_BK=cfg.layout_block[1] if cfg.layout else 1,
        # a mask known only at run time, on every block of the range (varlen needs none: its ranges are per sequence;
        # explicit positions override the ranges themselves, `_other_blocks`)
        RUNTIME_MASK=cfg.segments or cfg.dense_mask or cfg.layout or layout.runtime_mask_from_spec,
        POSITIONS=cfg.positions,
        TILE_RANGES=False, TILE_BATCH=1, TILE_HEADS=1, TILE_LISTS=False, TILE_COLS=1,  # `_tiles`
        PLAIN=layout.score_is_identity and not cfg.softcap and not cfg.bias,
        STAGED=not conf.merged,  # three loops, or one (`merged`)
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
        UPCAST=_arch() == "interpret" and q.dtype == jnp.bfloat16,
        TMA=conf.tma and tma_eligible(q, v, cfg), WS=False,  # WS: the forward's, `_forward`
        ATOMIC_DQ=conf.atomic, BAND=False, BAND_BLOCKS=1, BAND_TMA=False, DQ_DELTA=False,  # `_backward`
    )


def _scratch(grid):
    """Every kernel's last output: global scratch for the tensor descriptors it may build, up to eight of
    128 bytes per program (triton_call checks each compiled kernel against the budget). Sized the
    same whether or not the kernel uses it (2 MB per 2048 programs), so it is never too small."""
    return jax.ShapeDtypeStruct((math.prod(grid) * triton_call.SCRATCH_PER_PROGRAM,), jnp.uint8)


def _check_layout(q, cfg):
    if q.ndim != 5 or q.shape[1] != cfg.seq_q:
        raise RuntimeError(f"the triton backend expects q as [B, Sq, Hkv, G, D] with Sq = {cfg.seq_q}, got "
                           f"{tuple(q.shape)}: a generated package older than this runtime? rebuild it with "
                           f"`ejgen build`")


# Triton releases on which the warp-specialised forward is enabled on a GPU. Triton 3.6 compiles it
# for sm_90 (3.9's pass fails on these kernels), but on an H200 its first timed run did not finish
# within four minutes (a hang or a very long compile: not yet known), so no release is listed until
# one is measured: pinning `ws` on a GPU is an error, and the interpreter still runs the path.
WS_TRITON_RELEASES: tuple = ()


def _warp_specialised(conf, cfg, consts) -> bool:
    """Whether the forward's key loop is warp-specialised: asked for (`ws`), on descriptors, and where
    Triton 3.6's pass handles it, the plain loop over whole blocks (with causal or window masks, or
    ragged sequence ends, it fails to compile). Asking on a GPU whose Triton is not listed is an error."""
    import triton

    if conf.ws and _arch() != "interpret" and not triton.__version__.startswith(WS_TRITON_RELEASES):
        raise ValueError("triton config 'ws': the warp-specialised forward is not enabled on GPUs yet "
                         "(ejgen.runtime.attention.triton.host.WS_TRITON_RELEASES says why)")
    whole_blocks = consts["SEQ_Q"] % consts["BLOCK_M"] == 0 and consts["SEQ_K"] % consts["BLOCK_N"] == 0
    return (conf.ws and consts["TMA"] and whole_blocks and consts["PLAIN"]
            and not (consts["RUNTIME_MASK"] or cfg.causal or cfg.window))


def tma_eligible(q, v, cfg) -> bool:
    """Tensor descriptors need whole power-of-two head dims (a tile must not reach into the next
    head) and one sequence per batch row (zeros past its end): not varlen. 16-bit inputs only (the
    float32 kernels keep the tiles that fit their shared memory)."""
    d, dv, size = q.shape[-1], v.shape[-1], jnp.dtype(q.dtype).itemsize
    return not cfg.varlen and d == _pow2(d) and dv == _pow2(dv) and size == 2


def _longest(cfg, q_side: bool) -> int:
    """The longest query (or key) sequence: the grid's extent along the sequence."""
    if cfg.varlen:
        return cfg.max_seqlen_q if q_side else cfg.max_seqlen_k
    return cfg.seq_q if q_side else cfg.seq_k


def _grid_batch(q, ctx, cfg):
    return ctx["cu_q"].shape[0] - 1 if cfg.varlen else q.shape[0]


def _gluon_segments(ctx, cfg, seq: int, pass_: str, later: bool, block_n: int | None = None):
    """The Gluon kernels' QSEG, KSEG and RANGES inputs: segment ids and their tile ranges (the forward's key blocks of
    ``block_n``), else placeholders; ``later``: RANGES a placeholder the caller replaces (the lists the kernel walks,
    `gluon_attention.fwd_lists` / `bwd_lists`, or the ranges that come with the tiles' order,
    `gluon_attention.segment_plan`)."""
    if not cfg.segments:
        return [_dummy(jnp.int32)] * 3
    ids = [ctx["q_seg"], ctx["kv_seg"]]
    keys = {} if block_n is None else {"block_n": block_n}
    return ids + [_dummy(jnp.int32) if later else gluon_attention.segment_ranges(ctx, cfg, seq, pass_, **keys)]


def _gluon_spec(layout: Layout):
    """(the spec's mask for the Hopper kernels, `Layout.spec_mask`, or None; its tiles, `Layout.mask_tiles`)."""
    spec = layout.spec_mask()
    return spec, layout.mask_tiles if spec is not None else None


def _gluon_walk(layout: Layout, cfg, batch: int, hq: int, sq: int, spare: int = 0) -> tuple:
    """(grid, spec, mask_tiles, listed, key tiles, dynamic) of the Gluon forward of a call: its persistent grid
    (``spare`` SMs left free, `api.SPARE_SMS`), the
    spec's mask and its tiles (`_gluon_spec`), whether it walks lists of blocks (`gluon_attention.listed`), its key
    tiles (`gluon_attention.fwd_key_tiles`), whether its programs take tiles from a zeroed counter (TILE_CTR, the order
    then one list: `gluon_attention.dynamic_tiles`)."""
    grid = gluon_attention.grid(batch, hq, sq, spare=spare)  # persistent: one program per SM
    spec, mask_tiles = _gluon_spec(layout)
    listed = gluon_attention.listed(cfg, spec is not None)
    tiles = gluon_attention.fwd_key_tiles(cfg, spec is not None and layout.mask_divides)
    dynamic = gluon_attention.dynamic_tiles(cfg.causal, cfg.window, cfg.segments or listed,
                                            gluon_attention.fwd_tiles(batch, hq, sq), grid[0])
    return grid, spec, mask_tiles, listed, tiles, dynamic


def _gluon_lists(ctx, cfg, mask_tiles, batch: int, hq: int, sq: int, block_n: int, programs: int) -> tuple:
    """(RANGES int32 [TB, TH, N_M, 1 + N_N (+ N_N)], ORDER int32 [N_M * batch * hq]) of a Gluon forward that walks
    lists: its block lists (`gluon_attention.fwd_lists`) and its tiles by their counts, heaviest first, dealt to
    ``programs`` (`gluon_attention.order_by_work`; 1: the dynamic queue's one list)."""
    table, _, work = gluon_attention.fwd_lists(ctx, cfg, sq, mask_tiles, batch, hq, block_n)
    return table, gluon_attention.order_by_work(jnp.broadcast_to(work, (batch, ) + work.shape[1:]), hq, programs)


def _gluon_forward(layout: Layout, q, k, v, scalars, ctx, cfg, fast_tanh: bool = False, wire=None, merge=None,
                   spare: int = 0, spans: bool = False):
    """The warp-specialised Gluon forward (gluon_attention): (out [B, Sq, Hkv, G, D], lse [B, Hkv, G, Sq]). With
    segment ids (windows aside) its tiles go in the order of their work (`gluon_attention.ordered`, `tile_order`);
    where the queue wins (`gluon_attention.dynamic_tiles`) its programs take them from a counter. With a block
    layout or a spec mask each query tile walks its list of key blocks (`gluon_attention.fwd_lists`; LIST), in the
    order of their counts, the spec's mask on the partial ones (SPEC_MASK). ``fast_tanh``: the call's
    `KernelChoice.fast_tanh` (a soft cap's approximate tanh, `gluon_attention.softcap_constexpr`). ``wire``: k and v
    as the whole block of one 16-bit buffer (`api.KV_WIRE`, `_wire_kv`), which the kernel reads them out of (KV_AT;
    k, v for their shapes).
    ``merge``: (out, lse) of the same rows over other keys (`api.MERGE_INTO`), which the kernel merges its result into
    (MERGE), writing over those buffers (aliased). ``spare``: SMs its grid leaves free (`api.SPARE_SMS`); ``spans``:
    a layout walked by spans where it can (`api.SPANS`)."""
    batch, sq, hkv, groups, d = q.shape
    hq = hkv * groups
    grid, spec, mask_tiles, listed, tiles, dynamic = _gluon_walk(layout, cfg, batch, hq, sq, spare)
    staged = None
    if spec is not None:
        scalars = layout.gluon_scalars(scalars, ctx, sq)
        # key-side position terms staged by the producer next to each K block (segment ids use that buffer)
        staged = None if cfg.segments else layout.staged_mask()
    # a layout of two key columns merged into an earlier result: each tile's span of key blocks (the ring's wide step)
    spans = listed and gluon_attention.spanned(cfg, ctx, spec is not None, merge is not None, spans)
    ordered = (gluon_attention.ordered(cfg) or listed) and not spans
    dynamic = dynamic or spans  # (the queue passes over the tiles that see no key)
    # RANGES: the lists, the spans, or (ordered: segment ids) the plan's with the order
    segments = _gluon_segments(ctx, cfg, sq, "fwd", ordered or spans, tiles["BLOCK_N"])
    if staged is not None:
        segments[1] = scalars[1]  # KSEG: I32 with the terms' table, whose key-side rows the producer stages
    lists = None
    if spans:
        segments[2] = gluon_attention.layout_spans(ctx, cfg, sq, k.shape[1], batch, tiles["BLOCK_N"])
        order = _dummy(jnp.int32)
    elif listed:
        segments[2], order = _gluon_lists(ctx, cfg, mask_tiles, batch, hq, sq, tiles["BLOCK_N"],
                                          1 if dynamic else grid[0])
        lists = gluon_attention.fwd_list_constexprs(segments[2], cfg, tiles["BLOCK_N"])
    elif ordered:
        segments[2], order = gluon_attention.segment_plan(ctx, cfg, sq, "fwd", hq, 1 if dynamic else grid[0],
                                                          block_n=tiles["BLOCK_N"])
    else:
        order = _dummy(jnp.int32)
    kv, kv_at = (k, v), 0
    if wire is not None:
        buffer, kv_at, _, _ = _wire_kv(wire, k, v, "forward")
        kv = (buffer, buffer)
    earlier, aliases = [_dummy(q.dtype), _dummy(jnp.float32)], None
    if merge is not None:  # O_PREV, LSE_PREV: aliased to O and LSE
        want = ((batch, sq, hkv, groups, d), q.dtype), ((batch, hkv, groups, sq), jnp.float32)
        if any((x.shape, x.dtype) != w for x, w in zip(merge, want)):
            raise ValueError(f"the Hopper forward's earlier result must be out {want[0]} and lse {want[1]}, got "
                             f"{[(x.shape, x.dtype) for x in merge]}")
        earlier = [merge[0].reshape(batch, sq, hq, d), merge[1].reshape(batch, hq, sq)]
        aliases = {3 + len(scalars) + len(segments) + 1: 0, 3 + len(scalars) + len(segments) + 2: 1}
    out, lse, *_ = triton_call.launch(
        gluon_attention.kernel(), grid, [q.reshape(batch, sq, hq, d), *kv, *scalars, *segments, order, *earlier],
        [jax.ShapeDtypeStruct((batch, sq, hq, d), q.dtype), jax.ShapeDtypeStruct((batch, hq, sq), jnp.float32),
         jax.ShapeDtypeStruct((1, ), jnp.int32), _scratch(grid)],
        zeroed=(2, ) if dynamic else (), aliases=aliases, num_warps=4, num_stages=1,
        **gluon_attention.constexprs(batch, hq, hkv, sq, d, cfg.causal, cfg.window, cfg.segments, ordered, dynamic,
                                     lists, spec, tiles, seq_k=k.shape[1], softcap=cfg.softcap,
                                     fast_tanh=fast_tanh, staged=staged, kv_at=kv_at, merge=merge is not None,
                                     spans=spans))
    return out.reshape(batch, sq, hkv, groups, d), lse.reshape(batch, hkv, groups, sq)


def _gluon_ineligible(layout: Layout, q, k, v, cfg, pass_: str, deterministic: bool) -> str | None:
    """Why the Hopper kernel set cannot run the forward (pass_ "fwd") or backward ("bwd") of this call
    (None: it can): the settings, the machine, then what the kernels cover (gluon_attention.ineligible)."""
    here, now = kernels.target(), settings.current()
    if not now.gluon:
        return "the gluon setting is off (EJGEN_GLUON=0 or settings(gluon=False))"
    if here.platform != "gpu" or here.arch != "sm90":
        return f"not an sm_90 GPU (target: {here.arch or here.platform})"
    if pass_ == "bwd" and deterministic:
        return "deterministic: its dQ is added by reduce-adds in run-time order"
    pinned = any(triton_configs.pinned(p) for p in (("fwd",) if pass_ == "fwd" else ("dkdv", "dq")))
    return gluon_attention.ineligible(layout, cfg, q, k, v, pinned or now.triton_autotune, pass_)


def choose(layout: Layout, call, deterministic: bool):
    """(forward kernel set, backward kernel set, reasons, {"fast_tanh": ...}) of the triton platform for a prepared
    call: the Hopper set (`gluon`) where it covers the pass, else the kernels generated from the spec; a soft cap's
    tanh the hardware's approximation where the fast_tanh setting asks and both passes are the Hopper set (decided
    here once: the backward, traced later, reads it from the choice)."""
    d, dv = call.q.shape[-1], call.v.shape[-1]
    if max(d, dv) > triton_configs.MAX_HEAD_DIM:
        raise kernels.Unsupported(f"head dims {d}/{dv}: its kernels take head dims up to {triton_configs.MAX_HEAD_DIM}")
    picked, reasons = [], []
    for pass_, name in (("fwd", "forward"), ("bwd", "backward")):
        why_not = _gluon_ineligible(layout, call.q, call.k, call.v, call.cfg, pass_, deterministic)
        picked.append("triton" if why_not else "gluon")
        spec = "; the spec's mask on partial tiles (`_spec_mask`)" if not layout.builtin_mask_only else ""
        if spec and layout.position_terms is not None and layout.gluon_mask:
            spec += ", its costly one-position terms read from a table formed once a call (`_position_terms`)"
        reasons.append(f"{name}: triton (generated), not gluon: {why_not}" if why_not
                       else f"{name}: gluon (the Hopper kernel set covers this call{spec})")
    fast = bool(settings.current().fast_tanh and call.cfg.softcap and picked == ["gluon", "gluon"])
    if fast:
        reasons.append("fast_tanh: the soft cap's tanh is the hardware's approximation, forward and backward")
    return picked[0], picked[1], tuple(reasons), {"fast_tanh": fast}


# The Hopper backward with a spec mask's query-side position terms staged per item by its producer (`Layout.
# staged_bwd_mask`; off: it reads every term from the table in its loop, `_spec_mask_terms`). On since session 26: the
# zoo's Hopper GPU tests of NATTEN 2-D and the sliding tile pass with it, and in one call (H200, 16 calls a sample)
# NATTEN 2-D's fwd+bwd took 1.128 ms against 1.250 read from the table, the sliding tile's 1.139 against 1.104
# (within that call's spread: 1.126 read from the table in the next call). Off is kept for A/B runs.
STAGED_BACKWARD = True


def _gluon_backward(layout: Layout, q4, k, v, do4, lse3, delta3, scalars, ctx, cfg, fast_tanh: bool = False,
                    dq_into=None, wire=None, q_rows=None, dkv_into=None):
    """The warp-specialised Gluon backward (gluon_attention): (dq, dk, dv), dq [B, Sq, Hq, D] added up in float32
    by reduce-adds (not bitwise reproducible run to run, like cuDNN's). Each key block walks a list of query blocks
    where the forward's tiles would (a block layout, a spec mask, whose element mask runs on partial items) and with
    segment ids under a window (`gluon_attention.listed`). ``fast_tanh``: as the forward's (`KernelChoice`).
    ``dq_into``: (acc float32 [B, rows, Hq, D], q0), dq added into acc from row q0 on and acc returned as dq (float32):
    by the per-program kernel itself (DQ_ROWS, DQ_OFF_AT, acc aliased: no zeroed accumulator, no cast), after the
    persistent one. ``wire``: k and v as rows of a block in one 16-bit buffer (`api.KV_WIRE`, `_wire_kv`), which the
    per-program kernel reads them out of (KV_AT, KV_ROWS, KV_OFF_AT; the persistent one takes k and v). ``q_rows``
    (with ``dq_into``, `api.Q_ROWS_FROM`): q and dO of the accumulator's rows [B, rows, Hkv, G, D], whose rows from
    q0 on the per-program kernel reads as the call's (QDO_IN_PLACE; q4 and do4 then only give the shapes).
    ``dkv_into`` (with ``wire``, `api.DKV_INTO`): (buffer, add), dK and dV written by the per-program kernel into one
    16-bit buffer laid out as the wire's k and v (dK then dV of its rows), at the keys' rows, the buffer returned as
    dk (dv a placeholder): ``buffer`` None a new one (rows no call wrote hold garbage), else that one (aliased);
    ``add`` (int32, traced or not; None: 0) nonzero adds to what the rows hold (DKV_AT, DKV_ADD_AT)."""
    batch, sq, hq, d = q4.shape
    hkv = k.shape[2]
    spec, mask_tiles = _gluon_spec(layout)
    staged = None
    if spec is not None:
        scalars = layout.gluon_scalars(scalars, ctx, sq)
        staged = layout.staged_bwd_mask() if STAGED_BACKWARD and not cfg.segments else None
    listed = gluon_attention.listed(cfg, spec is not None, "bwd")
    outs = [jax.ShapeDtypeStruct((batch, sq, hq, d), jnp.float32), jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype)]
    documents = gluon_attention.persistent_segments_bwd(cfg, listed)
    persistent = cfg.window and not listed or documents
    if persistent:  # causal with a window to the left (gluon_attention.ineligible), or
        # packed documents under causal: the persistent kernel, whose tile counter is zeroed like the dQ accumulator
        # (documents: its programs walk the programs' order, most work first)
        kernel, grid = gluon_attention.pbwd_kernel(), gluon_attention.pbwd_grid(batch, hkv, sq)
        outs.append(jax.ShapeDtypeStruct((1, ), jnp.int32))
        segments = _gluon_segments(ctx, cfg, sq, "bwd", documents)  # (RANGES: documents, the plan's)
        order = _dummy(jnp.int32)
        if documents:
            segments[2], order = gluon_attention.segment_plan(ctx, cfg, sq, "bwd", hkv,
                                                              by_work=gluon_attention.ordered(cfg))
        zeroed, consts = (0, 3), gluon_attention.pbwd_constexprs(batch, hq, hkv, sq, d, cfg.softcap, fast_tanh,
                                                                  segments=documents, causal=cfg.causal)
        scalars = [*scalars, *segments, order]
    else:
        sk = k.shape[1]  # Sq != Sk: gluon_cross, no causal, window, segment ids or lists (gluon_attention.ineligible)
        kernel, grid = gluon_attention.bwd_kernel(), (_cdiv(sk, gluon_attention.BWD_TILES["BLOCK_N"]), batch * hkv)
        segments = _gluon_segments(ctx, cfg, sq, "bwd", listed or cfg.segments)  # (RANGES: the lists or plan's)
        lists = None
        if listed:  # each key block walks its list of query blocks, the programs launched most work first
            segments[2], lists, work = gluon_attention.bwd_lists(ctx, cfg, sq, hkv, mask_tiles, batch, hq)
            order = gluon_attention.programs_by_work(jnp.broadcast_to(work, (batch, ) + work.shape[1:]), hkv)
        elif cfg.segments:
            segments[2], order = gluon_attention.segment_plan(ctx, cfg, sq, "bwd", hkv,
                                                              by_work=gluon_attention.ordered(cfg))
        else:
            order = _dummy(jnp.int32)
        zeroed, consts = (0, ), gluon_attention.bwd_constexprs(batch, hq, hkv, sq, d, cfg.causal, cfg.window,
                                                                cfg.segments, lists, spec, cfg.softcap, sk,
                                                                fast_tanh, staged)
        if staged is not None:
            segments[0] = scalars[1]  # QSEG: I32 with the terms' table, whose query-side rows the producer stages
        scalars = [*scalars, *segments, order]
    aliases, kv = None, (k, v)
    if not persistent and wire is not None:
        buffer, kv_at, rows, k0 = _wire_kv(wire, k, v, "backward")
        kv = (buffer, buffer)
        consts.update(KV_AT=kv_at, KV_ROWS=rows)
        if k0 is not None:
            scalars, consts["KV_OFF_AT"] = _with_row(scalars, k0)
    dkv_in = _dummy(jnp.uint16)  # DKV_IN: the dK / dV buffer to write into (aliased to DK), else a placeholder
    if dkv_into is not None:
        buffer, add = dkv_into
        if persistent or wire is None:
            raise ValueError("dK / dV into a wire (`api.DKV_INTO`) take the per-program Hopper backward reading k and "
                             "v out of a K/V wire (`api.KV_WIRE`): its rows are theirs")
        items = 2 * consts["KV_AT"]
        if buffer is not None and (buffer.ndim != 1 or buffer.dtype.itemsize != 2 or buffer.size != items):
            raise ValueError(f"the Hopper backward's dK / dV wire must be 16-bit [{items}] (dK then dV of the K/V "
                             f"wire's {consts['KV_ROWS']} rows), got {buffer.dtype}{list(buffer.shape)}")
        outs[1] = jax.ShapeDtypeStruct((items, ), jnp.uint16 if buffer is None else buffer.dtype)
        outs[2] = jax.ShapeDtypeStruct((1, ), v.dtype)
        dkv_in = dkv_in if buffer is None else buffer
        consts["DKV_AT"] = consts["KV_AT"]
        if add is not None:
            scalars, consts["DKV_ADD_AT"] = _with_row(scalars, add)
    if not persistent:  # DQ_IN: the accumulator to add into (aliased to DQ_ACC), else a placeholder
        dq_in = _dummy(jnp.float32)
        if dq_into is not None:
            dq_in, q0 = dq_into
            if dq_in.shape[0] != batch or dq_in.shape[2:] != (hq, d) or dq_in.dtype != jnp.float32 or (
                    isinstance(q0, int) and not 0 <= q0 <= dq_in.shape[1] - sq):
                raise ValueError(f"the Hopper backward's dQ accumulator must be float32 [{batch}, rows, {hq}, {d}] "
                                 f"holding rows [q0, q0 + {sq}), got {dq_in.dtype}{list(dq_in.shape)} at q0 {q0}")
            outs[0] = jax.ShapeDtypeStruct(dq_in.shape, jnp.float32)
            zeroed, aliases = (), {6 + len(scalars): 0}  # (DQ_IN: scalars' next)
            consts.update(DQ_ROWS=dq_in.shape[1])
            if q_rows is not None:
                q_full, do_full = (x.reshape(x.shape[:2] + (hq, d)) for x in q_rows)
                if any(x.shape != dq_in.shape or x.dtype != q4.dtype for x in (q_full, do_full)):
                    raise ValueError(f"the Hopper backward's q and dO in place must be {q4.dtype}{list(dq_in.shape)} "
                                     f"like its dQ accumulator, got {[(x.dtype, x.shape) for x in q_rows]}")
                q4, do4 = q_full, do_full
                consts.update(QDO_IN_PLACE=True)
            if not (isinstance(q0, int) and q0 == 0):
                scalars, consts["DQ_OFF_AT"] = _with_row(scalars, q0)
        if dkv_into is not None and dkv_into[0] is not None:
            aliases = {**(aliases or {}), 7 + len(scalars): 1}  # (DKV_IN: after DQ_IN)
        scalars = [*scalars, dq_in, dkv_in]
    dq_acc, dk, dv, *_ = triton_call.launch(kernel, grid, [q4, *kv, do4, lse3, delta3, *scalars],
                                            outs + [_scratch(grid)], zeroed=zeroed, aliases=aliases, num_warps=4,
                                            num_stages=1, **consts)
    if dq_into is None:
        return dq_acc.astype(q4.dtype), dk, dv
    return (dq_acc if not persistent else add_rows(dq_into[0], dq_into[1], dq_acc)), dk, dv


def _wire_kv(wire, k, v, pass_: str):
    """(buffer, KV_AT, KV_ROWS, k0) of an `api.KV_WIRE` entry (buffer [items / rows, rows], k0: the call's keys from
    that row of the block on, None from row 0), checked against the call's k and v: 16-bit, k then v first in the
    buffer, V's items 16-byte aligned, the keys inside the block (the forward's: the whole block)."""
    buffer, k0 = wire
    rows = buffer.shape[-1]
    kv_at = k.shape[0] * rows * k.shape[2] * k.shape[3]
    whole = pass_ != "forward" or (k0 is None and rows == k.shape[1])
    if (buffer.ndim != 2 or buffer.dtype.itemsize != 2 or k.dtype != v.dtype or k.shape != v.shape or not whole
            or buffer.size < 2 * kv_at or kv_at % 8 or rows < k.shape[1]
            or isinstance(k0, int) and not 0 <= k0 <= rows - k.shape[1]):
        raise ValueError(f"the Hopper {pass_}'s K/V wire must be 16-bit [items / rows, rows] holding k then v of "
                         f"{rows} rows, the call's {k.shape[1]} keys from row {k0 or 0}"
                         f"{' (all of them)' if pass_ == 'forward' else ''}, got {buffer.dtype}{list(buffer.shape)}")
    return buffer, kv_at, rows, k0


def _with_row(scalars, row):
    """(the scalars with ``row`` appended to I32, scalars[1]; its index there): a run-time row offset a kernel reads
    past the scalars it reads (int32, traced or not)."""
    at = scalars[1].shape[0]
    return [scalars[0], jnp.concatenate([scalars[1], jnp.asarray(row, jnp.int32)[None]]), *scalars[2:]], at


def _masks(ctx, cfg, batch):
    """A block layout travels to the kernels as a mask of its blocks; with an element mask as well, it joins it."""
    return tiles.layout_as_mask(ctx, cfg, batch) if cfg.layout and cfg.dense_mask else (ctx, cfg)


def _forward(layout: Layout, q, k, v, ctx, cfg, choice):
    _check_layout(q, cfg)
    ctx, wire = given_wire(ctx)  # the caller's (ring attention's) K/V buffer: the Hopper forward reads it
    ctx, merge = given_merge(ctx)  # an earlier result of the rows (ring attention's): merged into
    ctx, spare = given_spare(ctx)  # SMs left to the ring's hop
    ctx, spans = given_spans(ctx)  # (the ring's last wide step)
    ctx, cfg = _masks(ctx, cfg, q.shape[0])
    batch, sq, hkv, groups, d = q.shape
    hq, dv = hkv * groups, v.shape[-1]
    scalars, features, aux, params = _inputs(layout, ctx, cfg, hq)
    if choice.forward == "gluon":
        if merge is not None and cfg.sinks:
            raise ValueError("an earlier result to merge into takes the sinks after the merge (ring attention joins "
                             "them once, at the end)")
        out, lse = _gluon_forward(layout, q, k, v, scalars, ctx, cfg, choice.fast_tanh, wire=wire, merge=merge,
                                  spare=spare or 0, spans=bool(spans))
        if cfg.sinks:  # the kernels take none: the sinks join the denominator here (the backward reads this lse)
            out, lse = join_sinks(out, lse, ctx["softmax_aux"])
            out = out.astype(q.dtype)
        return out, lse, None
    conf = _config(layout, "fwd", max(d, dv), jnp.dtype(q.dtype).itemsize * 8, cfg, dims=(d, dv))
    consts = _constexprs(layout, q, k, v, cfg, conf, features[0], features[3], aux)
    tuned = _autotune(layout, "fwd", conf)
    tiles, tile_consts = _tiles(layout, ctx, cfg, q, k, conf, False) if tuned is None else (_dummy(jnp.int32), {})
    consts.update(tile_consts)
    consts["WS"] = _warp_specialised(conf, cfg, consts)
    grid, largest = _grid(_longest(cfg, True), conf.block_m, _grid_batch(q, ctx, cfg) * hq, tuned, "block_m")
    outs = [jax.ShapeDtypeStruct((batch, sq, hq, dv), q.dtype), jax.ShapeDtypeStruct((batch, hq, sq), jnp.float32),
            _scratch(largest)]
    kernel = getattr(layout.kernels(), f"{layout.name}_fwd_kernel")
    out, lse, _ = triton_call.launch(
        kernel, grid, [q.reshape(batch, sq, hq, d), k, v, *scalars, *features, tiles, aux, *params], outs,
        zeroed=(0, 1) if cfg.varlen else (), num_warps=conf.num_warps, num_stages=conf.num_stages, autotune=tuned,
        **consts)
    out, lse = out.reshape(batch, sq, hkv, groups, dv), lse.reshape(batch, hkv, groups, sq)
    if merge is not None:
        out, lse = merge_into(out, lse, merge)
    return out, lse, None


# The dS band (`band` dkdv flag) costs B * Hq * Sq * (its key columns) elements of the input dtype: at most
# this many times q's own size (columns <= BAND_MAX_RATIO * head dim); wider windows recompute dS instead.
BAND_MAX_RATIO = 16


def _band_blocks(conf, cfg, d: int) -> int:
    """Key blocks in a query block's dS band with the `band` flag (0: no band; `triton_configs.band_blocks`). A pinned
    config that cannot use it is an error; the table's falls back."""
    if not conf.band:
        return 0
    pinned = triton_configs.pinned("dkdv")
    problem = None
    if conf.atomic:
        problem = "'band' and 'atomic' are two ways to dQ: pick one"
    elif not cfg.window:
        problem = "'band' needs a sliding window (the band of key blocks a query block visits)"
    elif cfg.positions:  # the band starts at the analysed range's first block, which explicit positions override
        problem = "'band' follows the window's analysed key ranges, which explicit positions replace"
    blocks = triton_configs.band_blocks(conf.block_m, conf.block_n, cfg.window_span, _longest(cfg, False))
    if problem is None and blocks * conf.block_n > BAND_MAX_RATIO * d:
        problem = (f"the window's dS band ({blocks * conf.block_n} columns) is over {BAND_MAX_RATIO}x the head dim "
                   f"({d}): too much memory")
    if problem is None:
        return blocks
    if pinned:
        raise ValueError(f"triton config dkdv={triton_configs.text(conf)!r}: {problem}")
    return 0


def _backward(layout: Layout, q, k, v, out, lse, d_out, d_lse, ctx, cfg, choice):
    _check_layout(q, cfg)
    ctx, into = given_dq(ctx)  # the caller's (ring attention's) dQ accumulator of more rows: added into
    ctx, q_rows = given_q_rows(ctx)  # (with it, the Hopper backward's: q and dO of the accumulator's rows)
    ctx, dkv_into = given_dkv(ctx)  # the caller's (ring attention's) dK / dV wire: the Hopper backward writes into it
    if dkv_into is not None and choice.backward != "gluon":
        raise ValueError("dK / dV into a wire (`api.DKV_INTO`) are the Hopper backward's: this call's backward is "
                         f"{choice.backward}")
    if into is not None and choice.backward != "gluon":
        dq, dk, dv, grads = _backward(layout, q, k, v, out, lse, d_out, d_lse, ctx, cfg, choice)
        return add_rows(into[0], into[1], dq), dk, dv, grads
    ctx, given = given_delta(ctx)  # the caller's (ring attention's), or none: the kernels' or XLA's own
    ctx, wire = given_wire(ctx)  # the caller's (ring attention's) K/V buffer: the Hopper backward reads it
    ctx, cfg = _masks(ctx, cfg, q.shape[0])
    batch, sq, hkv, groups, d = q.shape
    hq, sk, dv = hkv * groups, k.shape[1], v.shape[-1]
    bits = jnp.dtype(q.dtype).itemsize * 8
    scalars, features, aux, params = _inputs(layout, ctx, cfg, hq)
    q4, do4 = q.reshape(batch, sq, hq, d), d_out.reshape(batch, sq, hq, dv)
    lse3 = lse.reshape(batch, hq, sq)
    if choice.backward == "gluon":  # no bias or params here; sinks are in lse (the forward's), their gradient from it
        delta = given if given is not None else gluon_attention.hopper_delta(out, d_out, d_lse)[0]
        if into is not None:
            acc = into[0]
            into = (acc.reshape(acc.shape[:2] + (hq, d)), into[1])
        dq, dk, dv_ = _gluon_backward(layout, q4, k, v, do4, lse3, delta.reshape(batch, hq, sq), scalars, ctx, cfg,
                                      choice.fast_tanh, dq_into=into, wire=wire, q_rows=q_rows, dkv_into=dkv_into)
        dq = dq.reshape(q.shape if into is None else acc.shape)
        return dq, dk, dv_, _ctx_grads(layout, ctx, cfg, lse, delta.reshape(lse.shape), None, ())
    kernels = layout.kernels()
    n_seq = _grid_batch(q, ctx, cfg)

    conf = _config(layout, "dkdv", max(d, dv), bits, cfg, choice.deterministic, dims=(d, dv))
    band = _band_blocks(conf, cfg, d)  # dS tiles stored for a dQ pass of one matmul per tile
    atomic = conf.atomic  # dQ from the dK/dV kernel, added in float32 (zeroed below)
    dq_conf = _config(layout, "dq", max(d, dv), bits, cfg, dims=(d, dv))

    def dq_kernel(consts, block_m, tuned, delta_in, o_fwd, ds_band, tiles):
        """(dq, delta out) from the dQ kernel; DELTA_OUT is written only with DQ_DELTA."""
        grid, largest = _grid(_longest(cfg, True), block_m, n_seq * hq, tuned, "block_m")
        delta_out = (batch, hq, sq) if consts["DQ_DELTA"] else (1,)
        dq, delta, _ = triton_call.launch(
            getattr(kernels, f"{layout.name}_bwd_dq_kernel"), grid,
            [q4, k, v, do4, lse3, delta_in, *scalars, *features, tiles, *params, o_fwd, ds_band],
            [jax.ShapeDtypeStruct((batch, sq, hq, d), q.dtype), jax.ShapeDtypeStruct(delta_out, jnp.float32),
             _scratch(largest)],
            zeroed=(0, 1) if cfg.varlen else (),
            num_warps=dq_conf.num_warps, num_stages=dq_conf.num_stages, autotune=tuned, **consts)
        return dq, delta

    dq = None
    if atomic or band:  # the dK/dV kernel runs first: delta from one pass of XLA over dO and O (or the caller's)
        delta3 = (delta_rows(out, d_out, d_lse) if given is None else given).reshape(batch, hq, sq)
    else:  # the dQ kernel runs first and computes delta on the way (its tiles of dO are loaded anyway)
        dq_consts = dict(_constexprs(layout, q, k, v, cfg, dq_conf, features[0], features[3], aux), DQ_DELTA=True)
        dq_tuned = _autotune(layout, "dq", dq_conf)
        dq_tiles, tile_consts = (_tiles(layout, ctx, cfg, q, k, dq_conf, False) if dq_tuned is None
                                 else (_dummy(jnp.int32), {}))
        dq, delta3 = dq_kernel({**dq_consts, **tile_consts}, dq_conf.block_m, dq_tuned, d_lse.reshape(batch, hq, sq),
                               out.reshape(batch, sq, hq, dv), _dummy(q.dtype), dq_tiles)

    consts = _constexprs(layout, q, k, v, cfg, conf, features[0], features[3], aux)
    tuned = _autotune(layout, "dkdv", conf)
    # tile ranges narrow the dK/dV kernel's query tiles; not with the dS band, whose dQ pass reads back exactly
    # the tiles of the analysed ranges
    tiles, tile_consts = (_tiles(layout, ctx, cfg, q, k, conf, True) if tuned is None and not band
                          else (_dummy(jnp.int32), {}))
    consts.update(tile_consts)
    inputs = [q4, k, v, do4, lse3, delta3, *scalars, *features, tiles, *params]
    grid, largest = _grid(_longest(cfg, False), conf.block_n, n_seq * hkv, tuned, "block_n")
    n_prog = largest[0] * largest[1]  # rows of the param partials: unused rows stay zero
    dbias_shape = (batch, hq, sq, sk) if cfg.bias else (1,)
    # the dS tiles go out as bulk stores through a descriptor where one fits (16-bit, one sequence per row)
    consts.update(BAND=band > 0, BAND_BLOCKS=max(band, 1),
                  BAND_TMA=band > 0 and not cfg.varlen and jnp.dtype(q.dtype).itemsize == 2)
    if atomic and consts["TMA"] and _arch() == "interpret":
        raise ValueError(f"triton config {triton_configs.text(conf)!r}: Triton's interpreter has no tensor-descriptor "
                         f"reductions; drop 'tma' from the dkdv config (the dQ tiles are then added by atomics)")
    outs = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(dbias_shape, jnp.float32),
            jax.ShapeDtypeStruct((batch, sq, hq, d) if atomic else (1,), jnp.float32),
            jax.ShapeDtypeStruct((batch, hq, sq, band * conf.block_n) if band else (1,), q.dtype)]
    outs += [jax.ShapeDtypeStruct((n_prog, ctx[f"param_{p}"].size), jnp.float32) for p in layout.grad_params]
    # the dS band (4) is read only where written: no memset of its B * H * Sq * columns elements
    zeroed = tuple(i for i in (range(len(outs)) if cfg.varlen else range(2, len(outs))) if i != 4)
    outs.append(_scratch(largest))
    dk, dv_, dbias, dq_acc, ds_band, *dparams, _ = triton_call.launch(
        getattr(kernels, f"{layout.name}_bwd_dkdv_kernel"), grid, inputs, outs, zeroed=zeroed,
        num_warps=conf.num_warps, num_stages=conf.num_stages, autotune=tuned, **consts)

    if atomic:
        dq = dq_acc.astype(q.dtype)
    elif band:  # the dQ kernel over the band: the dK/dV kernel's tiles and constexprs, the dq config's warps
        dq, _ = dq_kernel(consts, conf.block_m, None, delta3, _dummy(q.dtype), ds_band, _dummy(jnp.int32))
    delta = delta3.reshape(batch, hkv, groups, sq)

    return dq.reshape(q.shape), dk, dv_, _ctx_grads(layout, ctx, cfg, lse, delta, dbias, dparams)


def _ctx_grads(layout: Layout, ctx, cfg, lse, delta, dbias, dparams) -> dict:
    """The gradients of the call's other inputs, either kernel set's backward: the bias (from the kernels' dbias [B, Hq,
    Sq, Sk]), the sinks (from lse and delta [B, Hkv, G, Sq], `sinks_grad`), the params (the kernels' per-program
    partials, summed)."""
    dctx = {}
    if cfg.bias:
        bias, (batch, hkv, groups, sq) = ctx["bias"], lse.shape
        db = dbias.reshape(batch, hkv, groups, sq, dbias.shape[-1])
        dctx["bias"] = jnp.sum(db, axis=tuple(i for i in range(3) if bias.shape[i] == 1), keepdims=True)
    if cfg.sinks:
        dctx["softmax_aux"] = sinks_grad(ctx["softmax_aux"], lse, delta)
    if layout.grad_params:
        dctx["params"] = {p: jnp.sum(g, axis=0).reshape(ctx[f"param_{p}"].shape)
                          for p, g in zip(layout.grad_params, dparams)}
    return dctx


# Batching: jax-triton's primitive has no vmap rule. Under vmap, a mapped axis is folded into the
# batch axis of every tensor that has one, and the kernels run once; only when a per-call scalar,
# the sinks or a param is mapped (or params need gradients) do the calls run one after another
# with lax.map.

_BATCHED_CTX = ("bias", "mask", "layout", "q_seg", "kv_seg", "delta")
_IGNORED_CTX = ("q_pos", "kv_pos")  # the kernels compute positions themselves


def _foldable(ctx_batched: dict, layout: Layout) -> bool:
    return not layout.grad_params and not any(
        b for key, b in ctx_batched.items() if key not in _BATCHED_CTX + _IGNORED_CTX)


def _fold(x, batched: bool, n: int, batch: int):
    """[n, batch, ...] (or shared [batch|1, ...]) -> [n * batch, ...]."""
    if not batched:
        x = jnp.broadcast_to(x[None], (n,) + x.shape)
    x = jnp.broadcast_to(x, (n, batch) + x.shape[2:])
    return x.reshape((n * batch,) + x.shape[2:])


def _fold_ctx(ctx, ctx_batched, n, batch):
    out = dict(ctx)
    for key in _BATCHED_CTX:
        if key in ctx:
            out[key] = _fold(ctx[key], ctx_batched[key], n, batch)
    for key in _IGNORED_CTX:
        if ctx_batched.get(key):
            out[key] = ctx[key][0]
    return out


def _sequential(fn, n, in_batched, args):
    """Run ``fn`` once per mapped index (lax.map); every output comes back mapped."""
    def one(i):
        pick = lambda x, b: x[i] if b else x
        return fn(*jax.tree.map(pick, args, in_batched))
    return jax.lax.map(one, jnp.arange(n))


def forward(layout: Layout, q, k, v, ctx, cfg, choice):
    fn = jax.custom_batching.custom_vmap(lambda q, k, v, ctx: _forward(layout, q, k, v, ctx, cfg, choice)[:2])

    @fn.def_vmap
    def rule(n, in_batched, q, k, v, ctx):
        if not _foldable(in_batched[3], layout) or cfg.varlen or cfg.positions:
            outs = _sequential(lambda *a: _forward(layout, *a, cfg, choice)[:2], n, in_batched, (q, k, v, ctx))
            return outs, (True, True)
        batch = q.shape[1] if in_batched[0] else q.shape[0]
        qf, kf, vf = (_fold(x, b, n, batch) for x, b in zip((q, k, v), in_batched[:3]))
        out, lse, _ = _forward(layout, qf, kf, vf, _fold_ctx(ctx, in_batched[3], n, batch), cfg, choice)
        return (out.reshape((n, batch) + out.shape[1:]), lse.reshape((n, batch) + lse.shape[1:])), (True, True)

    out, lse = fn(q, k, v, ctx)
    return out, lse, None


def backward(layout: Layout, q, k, v, out, lse, d_out, d_lse, ctx, cfg, choice):
    fn = jax.custom_batching.custom_vmap(
        lambda *a: _backward(layout, *a, cfg, choice))

    @fn.def_vmap
    def rule(n, in_batched, q, k, v, out, lse, d_out, d_lse, ctx):
        args = (q, k, v, out, lse, d_out, d_lse, ctx)
        ctx_batched = in_batched[7]
        if not _foldable(ctx_batched, layout) or cfg.varlen or cfg.positions:
            grads = _sequential(lambda *a: _backward(layout, *a, cfg, choice), n, in_batched, args)
            return grads, jax.tree.map(lambda _: True, grads)
        batch = q.shape[1] if in_batched[0] else q.shape[0]
        folded = [_fold(x, b, n, batch) for x, b in zip(args[:7], in_batched[:7])]
        fctx = _fold_ctx(ctx, ctx_batched, n, batch)
        dq, dk, dv, dctx = _backward(layout, *folded, fctx, cfg, choice)
        unfold = lambda x: x.reshape((n, batch) + x.shape[1:])
        grads = {}
        if "bias" in dctx:
            db = unfold(dctx["bias"])
            shared_batch = (ctx["bias"].shape[1] if ctx_batched["bias"] else ctx["bias"].shape[0]) == 1
            grads["bias"] = jnp.sum(db, axis=1, keepdims=True) if shared_batch else db
        if "softmax_aux" in dctx:
            delta = delta_rows(folded[3], folded[5], folded[6])
            grads["softmax_aux"] = jax.vmap(sinks_grad, in_axes=(None, 0, 0))(
                ctx["softmax_aux"], unfold(folded[4]), unfold(delta))
        result = (unfold(dq), unfold(dk), unfold(dv), grads)
        return result, jax.tree.map(lambda _: True, result)

    return fn(q, k, v, out, lse, d_out, d_lse, ctx)
