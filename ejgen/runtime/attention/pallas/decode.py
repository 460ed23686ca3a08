"""Pallas decode kernels of every attention spec (docs/DESIGN.md §3, "Decode and paged modes"), on the spec's own
Pallas hooks (`hooks.Hooks`: score, visible, scalars, params; the same definitions the train kernels run), for GPUs
(Triton lowering) and TPUs (Mosaic), chosen per lowering platform as the train kernels are (`common.dispatch`).

Both read the cache in place: ``k, v [B, S, Hkv, D|Dv]`` (decode), or the page pools ``[pages, page, Hkv, D|Dv]``
through ``block_tables`` (paged; token t of sequence b at row t % page of page tables[b, t // page]). Positions in the
sequence as the contract says: query row i at ``L - Sq + i``, key j at ``j - start``, ``q_len = kv_len = L``.

GPU: split-K as the Triton kernel (`split_k`: one split rule and one lse merge for both). Program
(b, kv head, split): the kv head's G query heads times Sq queries packed into the rows of one tile (row r is head
``hk * G + r // Sq``, query ``r % Sq``), so each K / V byte is read once per kv head; its keys in blocks of BLOCK_N;
pages through the table inside the kernel (one scalar read per block when a block lies in one page, else a read per
key). Writes the split's unnormalised output, running max and sum; the splits (and the sinks) merge in XLA.

TPU: program (b, step) over every kv head of sequence b, steps of key blocks along the innermost ("arbitrary") grid
axis; the sequences' bounds and the block table are scalar-prefetched (`PrefetchScalarGridSpec`), and each step's
key block is DMA'd by index (contiguous: the block of the cache row holding the step's keys; paged: up to
``TPU_MAX_PAGES_PER_STEP`` pages, each its own operand whose index map reads the table). A step past the sequence's
end repeats the previous index (no DMA) and computes nothing. Query heads one at a time (a param read by head, such
as alibi's ``slopes[h]``, is a scalar read from SMEM); m, l and the output accumulate in VMEM scratch. The result
(one split) goes through the same merge.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from ejgen.runtime.attention.pallas import common as _rt
from ejgen.runtime.attention.pallas.common import NEG_INF, NN, NT, NUM_LANES, NUM_SUBLANES
from ejgen.runtime.attention.pallas.hooks import Hooks, Tile, logits
from ejgen.runtime.attention import split_k
from ejgen.runtime.core import vma

GPU_BLOCK_N = 64  # keys per step of a GPU program
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 2
INTERPRET_BLOCK_N = 16  # interpreted: small blocks, many steps
TPU_BLOCK_K = 512  # keys per TPU grid step (contiguous: one block; paged: pages fetched together up to this)
TPU_MAX_PAGES_PER_STEP = 16  # paged: at most this many page operands per step (small pages)
INTERPRET_TPU_BLOCK_K = 8  # interpreted: several steps and several pages per step on small shapes
INTERPRET_TPU_MAX_PAGES_PER_STEP = 4


def forward(hooks: Hooks, call, batch_invariant: bool = False):
    """(out [B, Sq, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32), as `decode.xla_forward`: the GPU or the
    TPU kernel per lowering platform, interpreted elsewhere (`common.interpret_kernels` picks which)."""
    if hooks.token_views is not None:
        raise NotImplementedError(
            f"{hooks.name}: platform 'pallas' has no decode kernels for a spec whose params are read by one side's "
            f"positions (token views); platform='triton' or 'xla' run it")
    scalars = hooks.pack_scalars(call.ctx)
    prm = {name: x for name, x in hooks.params_of(call.ctx).items() if name in hooks.in_kernel}
    sinks = call.ctx.get("softmax_aux") if call.cfg.sinks else None
    tables = call.tables if call.tables is not None else jnp.zeros((1, 1), jnp.int32)
    skips = window_skip(call.ctx, call.cfg, call.ends - call.starts, call.q.shape[1])
    gpu = functools.partial(_gpu_forward, hooks, call, batch_invariant)
    tpu = functools.partial(_tpu_forward, hooks, call)
    return _rt.dispatch(gpu, tpu, call.q, call.k, call.v, call.starts, call.ends, skips, tables, scalars, prm, sinks)


# GPU (Triton lowering)


def window_skip(ctx, cfg, lengths, sq: int):
    """[B] the keys before the first one any query row can see (a sliding window's left edge from the first row);
    zeros without a window."""
    if not cfg.window:
        return jnp.zeros_like(lengths)
    return jnp.maximum(lengths - sq - ctx["window_left"], 0)


def _gpu_kernel(*refs, hooks, names, cfg, sq, groups, d, dv, block_n, split, page, precision):
    """One split of one (sequence, kv head): every query row of the group against keys [lo, hi) of the split."""
    r = dict(zip(names, refs))
    o_ref, m_ref, l_ref = refs[len(names):]
    b, hk, i_split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    sc = hooks.scalars(r["f32"], r["i32"])
    prm = {name: r["param_" + name] for name in hooks.in_kernel}
    start, end = r["starts"][b], r["ends"][b]
    length = end - start
    m_pad, dv_pad = o_ref.shape
    rows = lax.broadcasted_iota(jnp.int32, (m_pad, 1), 0)
    q_idx = length - sq + lax.rem(rows, sq)
    h = hk * groups + lax.div(rows, sq)  # each row's query head
    q_valid = jnp.logical_and(rows < groups * sq, q_idx >= 0)
    d_cols = lax.broadcasted_iota(jnp.int32, (1, r["q"].shape[-1]), 1)
    q = plgpu.load(r["q"], mask=d_cols < d, other=0)  # [M_PAD, D_PAD]
    lo = start + lax.div(r["skips"][b], block_n) * block_n + i_split * split  # whole blocks from the window's edge
    hi = jnp.minimum(lo + split, end)
    k_cols = lax.broadcasted_iota(jnp.int32, (1, r["k"].shape[-1]), 1)
    v_cols = lax.broadcasted_iota(jnp.int32, (1, r["v"].shape[-1]), 1)

    def keys(n0):
        """(k [BLOCK_N, D_PAD], v [BLOCK_N, DV_PAD], token positions [1, BLOCK_N], which are keys of the split)."""
        t = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
        ok = t < hi
        k_mask, v_mask = ok[:, None] & (k_cols < d), ok[:, None] & (v_cols < dv)
        if not page or page % block_n == 0:  # the cache row, or a block inside one page (n0: a multiple of BLOCK_N)
            row0 = r["table"][lax.div(n0, page)] * page + lax.rem(n0, page) if page else n0  # one table read
            k = plgpu.load(r["k"].at[pl.ds(row0, block_n), :], mask=k_mask, other=0)
            v = plgpu.load(r["v"].at[pl.ds(row0, block_n), :], mask=v_mask, other=0)
        else:  # a table read per key (clamped: keys past the end are masked)
            at = r["table"][jnp.minimum(lax.div(t, page), r["table"].shape[0] - 1)] * page + lax.rem(t, page)
            k = plgpu.load(r["k"].at[at[:, None], k_cols], mask=k_mask, other=0)
            v = plgpu.load(r["v"].at[at[:, None], v_cols], mask=v_mask, other=0)
        return k, v, t[None, :], ok[None, :]

    def step(j, carry):
        acc, m_i, l_i = carry
        k, v, t, ok = keys(lo + j * block_n)
        s = lax.dot_general(q, k, NT, precision=precision, preferred_element_type=jnp.float32) * sc.scale
        tile = Tile(b=b, h=h, q_idx=q_idx, kv_idx=t - start, q_len=length, kv_len=length, q_valid=q_valid,
                    kv_valid=ok)
        _, _, s = logits(hooks, s, tile, sc, prm, cfg)
        s = jnp.where(hooks.visible(tile, sc, prm, cfg), s, NEG_INF)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
        p = jnp.exp(s - m_use[:, None])  # [M_PAD, BLOCK_N]; hidden keys give exp(-inf) = 0
        alpha = jnp.exp(m_i - m_use)
        pv = lax.dot_general(p.astype(v.dtype), v, NN, precision=precision, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l_i * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((m_pad, dv_pad), jnp.float32), jnp.full((m_pad,), NEG_INF, jnp.float32),
            jnp.zeros((m_pad,), jnp.float32))
    n_blocks = lax.div(jnp.maximum(hi - lo + block_n - 1, 0), block_n)  # a split past the sequence's end: none
    acc, m_i, l_i = lax.fori_loop(0, n_blocks, step, init)
    o_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


def _gpu_forward(hooks, call, batch_invariant, q, k, v, starts, ends, skips, tables, scalars, prm, sinks, *,
                 interpret):
    """The split-K kernel and the merge. q [B, Sq, Hkv, G, D] is laid out as [B, Hkv, M_PAD, D] rows (tiny); the
    cache is only reshaped (paged: pages x rows flattened, no copy)."""
    batch, sq, kv_heads, groups, d = q.shape
    dv = v.shape[-1]
    cfg = call.cfg
    axes = vma.varying_axes(q, k, v, starts, ends, skips, tables, scalars, prm)
    paged = call.tables is not None
    seq = tables.shape[1] * call.page if paged else k.shape[1]
    block_n = INTERPRET_BLOCK_N if interpret else GPU_BLOCK_N
    slots = split_k.slots(block_n, d, dv, q.dtype.itemsize, GPU_NUM_STAGES,
                          sms=split_k.INTERPRET_SMS if interpret else None)
    n_splits, per_split = split_k.splits(batch, kv_heads, split_k.keys_to_visit(seq, cfg, sq, block_n), block_n,
                                         slots, batch_invariant)
    m_pad, d_pad, dv_pad = _rt.pow2(groups * sq), _rt.pow2(d), _rt.pow2(dv)
    rows = q.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, groups * sq, d)  # row g * Sq + i
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, m_pad - groups * sq), (0, 0)))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda b, hk, s: (0,) * x.ndim)

    ops = _rt.Operands()
    ops.add("f32", scalars[0], whole(scalars[0]))
    ops.add("i32", scalars[1], whole(scalars[1]))
    for name, x in prm.items():
        ops.add("param_" + name, x, whole(x))
    ops.add("starts", starts, whole(starts))
    ops.add("ends", ends, whole(ends))
    ops.add("skips", skips, whole(skips))
    ops.add("q", rows, pl.BlockSpec((None, None, m_pad, d_pad), lambda b, hk, s: (b, hk, 0, 0)))
    if paged:
        ops.add("table", tables, pl.BlockSpec((None, tables.shape[1]), lambda b, hk, s: (b, 0)))
        for name, x in (("k", k), ("v", v)):
            pool = x.reshape(x.shape[0] * x.shape[1], kv_heads, x.shape[-1])  # [pages * page, Hkv, X]
            ops.add(name, pool, pl.BlockSpec((pool.shape[0], None, _rt.pow2(x.shape[-1])), lambda b, hk, s: (0, hk, 0)))
    else:
        for name, x in (("k", k), ("v", v)):
            ops.add(name, x, pl.BlockSpec((None, x.shape[1], None, _rt.pow2(x.shape[-1])),
                                          lambda b, hk, s: (b, 0, hk, 0)))
    parts = (batch, kv_heads, n_splits, m_pad)
    kernel = functools.partial(
        _gpu_kernel, hooks=hooks, names=tuple(ops.names), cfg=cfg, sq=sq, groups=groups, d=d, dv=dv,
        block_n=block_n, split=per_split, page=call.page if paged else 0, precision=_rt.precision(q.dtype))
    row_spec = pl.BlockSpec((None, None, None, m_pad), lambda b, hk, s: (b, hk, s, 0))
    o_part, m_part, l_part = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, n_splits),
        in_specs=ops.specs,
        out_specs=[pl.BlockSpec((None, None, None, m_pad, dv_pad), lambda b, hk, s: (b, hk, s, 0, 0)), row_spec,
                   row_spec],
        out_shape=[vma.struct(parts + (dv_pad,), jnp.float32, axes), vma.struct(parts, jnp.float32, axes),
                   vma.struct(parts, jnp.float32, axes)],
        compiler_params=plgpu.CompilerParams(num_warps=GPU_NUM_WARPS, num_stages=GPU_NUM_STAGES),
        interpret=interpret,
        name=f"{hooks.name}_decode",
    )(*ops.arrays)
    return split_k.merge(o_part, m_part, l_part, sinks, groups, sq, dv, q.dtype)


# TPU (Mosaic)


def _tpu_kernel(starts_ref, ends_ref, skips_ref, tables_ref, *refs, hooks, names, cfg, sq, groups, kv_heads, rows,
                pieces, paged, n_steps, precision):
    """Step i of sequence b: its key block (or its ``pieces`` pages) for every query head; m, l, acc in scratch."""
    r = dict(zip(names, refs))
    o_ref, m_ref, l_ref, m_scr, l_scr, acc_scr = refs[len(names):]
    b, i = pl.program_id(0), pl.program_id(1)
    start, end, skip = starts_ref[b], ends_ref[b], skips_ref[b]
    length = end - start
    sq_pad, dv = acc_scr.shape[1:]

    @pl.when(i == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    sc = hooks.scalars(r["f32"], r["i32"])
    prm = {name: r["param_" + name] for name in hooks.in_kernel}
    shape = (sq_pad, rows)
    q_idx = length - sq + lax.broadcasted_iota(jnp.int32, shape, 0)
    q_valid = jnp.logical_and(lax.broadcasted_iota(jnp.int32, shape, 0) < sq, q_idx >= 0)
    for j in range(pieces):
        # position of the piece's first key in the sequence (paged: its token; contiguous: its cache row - start)
        if paged:
            first = (lax.div(skip, rows) + i * pieces + j) * rows
        else:
            first = (lax.div(start + skip, rows) + i) * rows - start

        @pl.when(first < length)
        def _piece(j=j, first=first):
            kv_idx = first + lax.broadcasted_iota(jnp.int32, shape, 1)
            kv_valid = jnp.logical_and(kv_idx >= 0, kv_idx < length)
            in_seq = first + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
            in_seq = jnp.logical_and(in_seq >= 0, in_seq < length)  # [rows, 1]: keys of the sequence
            for hk in range(kv_heads):
                k = r[f"k{j}"][:, hk, :]  # [rows, D]
                v = jnp.where(in_seq, r[f"v{j}"][:, hk, :], 0)  # other tokens of the row never reach the output

                def member(g, carry, hk=hk, k=k, v=v):
                    h = hk * groups + g
                    q = r["q"][hk, g]  # [Sq_pad, D]
                    s = _one_key_dot(q, k, NT, precision) if rows == 1 else lax.dot_general(
                        q, k, NT, precision=precision, preferred_element_type=jnp.float32)
                    s = s * sc.scale
                    tile = Tile(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, q_len=length, kv_len=length, q_valid=q_valid,
                                kv_valid=kv_valid)
                    _, _, s = logits(hooks, s, tile, sc, prm, cfg)
                    s = jnp.where(hooks.visible(tile, sc, prm, cfg), s, NEG_INF)
                    m_prev, l_prev = m_scr[h], l_scr[h]  # [Sq_pad, 128]
                    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                    m_use = jnp.where(m_next == NEG_INF, 0.0, m_next)
                    p = jnp.exp(s - _rt.lanes(m_use, rows))
                    alpha = jnp.exp(m_prev - m_use)
                    l_scr[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
                    m_scr[h] = m_next
                    pv = _one_key_dot(p, v, NN, precision) if rows == 1 else lax.dot_general(
                        p.astype(v.dtype), v, NN, precision=precision, preferred_element_type=jnp.float32)
                    acc_scr[h] = acc_scr[h] * _rt.lanes(alpha, dv) + pv
                    return carry

                lax.fori_loop(0, groups, member, 0)

    @pl.when(i == n_steps - 1)
    def _finish():
        o_ref[...] = acc_scr[...]
        m_ref[...] = m_scr[...]
        l_ref[...] = l_scr[...]


def _one_key_dot(a, b, dims, precision):
    """A product with one key (page size 1) as float32 elementwise arithmetic: Mosaic lowers a 16-bit matrix
    product with a dimension of 1 to a broadcast it mistypes (jax 0.10: bf16 -> f32 verification error)."""
    del precision  # exact float32
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if dims == NT:  # [M, D] x [1, D]^T -> [M, 1]
        return jnp.sum(a * b, axis=1, keepdims=True)
    return a * b  # [M, 1] x [1, Dv] -> [M, Dv]


def _tpu_block(start, end, skip, i, rows, n_blocks):
    """Contiguous: the block of the cache row that step i reads, from the one holding the first key a row sees,
    clamped to the sequence's blocks (a step past them repeats the last one: no DMA)."""
    first = jnp.minimum(lax.div(start + skip, rows), n_blocks - 1)
    last = jnp.maximum(first, jnp.minimum(lax.div(end - 1, rows), n_blocks - 1))  # lax.div: -1 -> 0
    return jnp.minimum(first + i, last)


def _tpu_forward(hooks, call, q, k, v, starts, ends, skips, tables, scalars, prm, sinks, *, interpret):
    """The TPU kernel (one split per sequence) and the merge."""
    batch, sq, kv_heads, groups, d = q.shape
    dv = v.shape[-1]
    heads = kv_heads * groups
    axes = vma.varying_axes(q, k, v, starts, ends, skips, tables, scalars, prm)
    paged = call.tables is not None
    block = INTERPRET_TPU_BLOCK_K if interpret else TPU_BLOCK_K
    max_pieces = INTERPRET_TPU_MAX_PAGES_PER_STEP if interpret else TPU_MAX_PAGES_PER_STEP
    sq_pad = -(-sq // NUM_SUBLANES) * NUM_SUBLANES
    rows_q = jnp.pad(q.transpose(0, 2, 3, 1, 4), ((0, 0),) * 3 + ((0, sq_pad - sq), (0, 0)))  # [B, Hkv, G, Sq_pad, D]
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    ops = _rt.Operands()
    ops.add("f32", scalars[0], smem)
    ops.add("i32", scalars[1], smem)
    for name, x in prm.items():
        ops.add("param_" + name, x, smem)
    ops.add("q", rows_q, pl.BlockSpec((None, kv_heads, groups, sq_pad, d), lambda b, i, *_: (b, 0, 0, 0, 0)))
    if paged:
        page = call.page
        rows, max_pages = page, tables.shape[1]
        pieces = max(1, min(max_pieces, block // page, max_pages))
        n_steps = -(-max_pages // pieces)

        def page_map(j):
            def index(b, i, starts_ref, ends_ref, skips_ref, tables_ref):
                last = jnp.maximum(lax.div(ends_ref[b] - starts_ref[b] + page - 1, page) - 1, 0)
                return tables_ref[b, jnp.minimum(lax.div(skips_ref[b], page) + i * pieces + j, last)], 0, 0, 0
            return index

        for j in range(pieces):
            ops.add(f"k{j}", k, pl.BlockSpec((None, page, kv_heads, d), page_map(j)))
            ops.add(f"v{j}", v, pl.BlockSpec((None, page, kv_heads, dv), page_map(j)))
    else:
        seq = k.shape[1]
        rows, pieces = min(block, seq), 1
        n_blocks = -(-seq // rows)
        n_steps = n_blocks

        def block_map(b, i, starts_ref, ends_ref, skips_ref, tables_ref):
            return b, _tpu_block(starts_ref[b], ends_ref[b], skips_ref[b], i, rows, n_blocks), 0, 0

        ops.add("k0", k, pl.BlockSpec((None, rows, kv_heads, d), block_map))
        ops.add("v0", v, pl.BlockSpec((None, rows, kv_heads, dv), block_map))
    kernel = functools.partial(
        _tpu_kernel, hooks=hooks, names=tuple(ops.names), cfg=call.cfg, sq=sq, groups=groups, kv_heads=kv_heads,
        rows=rows, pieces=pieces, paged=paged, n_steps=n_steps, precision=_rt.precision(q.dtype))
    out_map = lambda b, i, *_: (b, 0, 0, 0)  # noqa: E731
    o, m, l = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, n_steps),
            in_specs=ops.specs,
            out_specs=[pl.BlockSpec((None, heads, sq_pad, dv), out_map),
                       pl.BlockSpec((None, heads, sq_pad, NUM_LANES), out_map),
                       pl.BlockSpec((None, heads, sq_pad, NUM_LANES), out_map)],
            scratch_shapes=[pltpu.VMEM((heads, sq_pad, NUM_LANES), jnp.float32),
                            pltpu.VMEM((heads, sq_pad, NUM_LANES), jnp.float32),
                            pltpu.VMEM((heads, sq_pad, dv), jnp.float32)],
        ),
        out_shape=[vma.struct((batch, heads, sq_pad, dv), jnp.float32, axes),
                   vma.struct((batch, heads, sq_pad, NUM_LANES), jnp.float32, axes),
                   vma.struct((batch, heads, sq_pad, NUM_LANES), jnp.float32, axes)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name=f"{hooks.name}_decode",
    )(starts, ends, skips, tables, *ops.arrays)
    # one split, rows g * Sq + i as the merge reads them
    o_part = o[:, :, :sq].reshape(batch, kv_heads, 1, groups * sq, dv)
    m_part, l_part = (x[:, :, :sq, 0].reshape(batch, kv_heads, 1, groups * sq) for x in (m, l))
    return split_k.merge(o_part, m_part, l_part, sinks, groups, sq, dv, q.dtype)
