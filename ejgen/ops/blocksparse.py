"""`blocksparse_attention` with the seed's signature (ejkernel's), on the op generated from
``specs/blocksparse_attention.yaml`` (layout [batch, heads, seq, head_dim], docs/DESIGN.md §3 block masks).

The seed's arguments become the spec op's: segment ids and ``attention_mask`` a `MaskInfo`; ``qkv_layouts``,
``mask_builder`` and ``chunk_size`` conditions of one `BlockMask`; the rest pass through. The backward's
tile lists (the seed's dq / dkdv layouts) are derived from the forward's, so one layout is all it takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.generated import blocksparse_attention as _spec_op
from ejgen.generated import blocksparse_attention_ring as _spec_ring
from ejgen.types import BlockMask, MaskInfo

NAME = "blocksparse_attention"


def blocksparse_attention(
    query,
    key,
    value,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_positions=None,
    kv_positions=None,
    softmax_aux=None,
    bias=None,
    attention_mask=None,
    *,
    mask_info=None,
    block_mask=None,
    logits_soft_cap=None,
    qkv_layouts=None,
    softmax_scale=None,
    mask_builder=None,
    sliding_window=None,
    chunk_size=None,
    causal=True,
    fused_backward=False,
    sequence_parallelism_mesh_axis_name=None,
    deterministic=None,
    platform="auto",
    return_lse=False,
    mesh=None,
    in_specs=None,
    out_specs=None,
):
    """Block-sparse attention: ``query [B, Hq, Sq, D]``, ``key [B, Hkv, Sk, D]``, ``value [B, Hkv, Sk, Dv]`` ->
    ``out [B, Hq, Sq, Dv]`` (and ``lse [B, Hq, Sq]`` with ``return_lse``). Causal by default.

    - ``q_segment_ids [B, Sq]``, ``kv_segment_ids [B, Sk]`` (kv defaults to q; negative = padding) and
      ``attention_mask`` (bool ``[B, Sq, Sk]`` or ``[B, 1|Hq, Sq, Sk]``), or ``mask_info`` holding them.
    - ``qkv_layouts``: the tiles to visit, a `BlockMask` or a bool block layout ``[B|1, Hq|1, nQ, nK]`` (tiles
      of ``ceil(Sq / nQ)`` x ``ceil(Sk / nK)``; ``BlockMask.from_layout`` for any other tiling); the seed's
      ``(fwd, dq, dkdv)`` triple is taken when all three are that one layout (the backward's lists come from
      it; checked where the arrays are concrete). ``mask_builder(q_len, kv_len)``
      returns one instead. ``block_mask``: any other `BlockMask` (a ``mask_fn``, windows), joined to them.
    - ``chunk_size``: chunked attention as in Llama 4: a query sees the keys of its own chunk of
      ``chunk_size`` positions (bottom-right aligned, as causal), with causal and any other mask on top (it
      travels as segment ids: tiles inside a chunk need no element mask).
    - ``sliding_window``, ``logits_soft_cap``, ``softmax_aux`` (sinks), ``bias [B|1, Hq|1, Sq, Sk]`` (with its
      gradient), ``softmax_scale``, ``deterministic``, ``platform``, ``return_lse``: as ``flash_attention``.
    - ``q_positions [B|1, Sq]``, ``kv_positions [B|1, Sk]`` (int; a missing one is its indices): causal and the
      window compare positions (``kv_pos <= q_pos``, ``q_pos - left <= kv_pos <= q_pos + right``), as for tokens
      placed out of order or in chunks; tiles are classified from each tile's least and greatest position.
    - ``mesh``, ``in_specs``, ``out_specs``: run under ``jax.shard_map`` over ``mesh``, query, key and value cut
      as ``in_specs`` say ([batch, heads, seq, head_dim]: batch and heads only; every other tensor, the block
      mask's included, cut as query; ``ejgen.runtime.attention.mesh``).
    - ``fused_backward``: ejgen chooses the backward's kernels itself (``ejgen.ops.explain`` says which);
      only the default False is taken.
    - ``sequence_parallelism_mesh_axis_name``: called inside ``jax.shard_map`` with the sequence cut over that mesh
      axis (contiguous shards), ring attention over it (``blocksparse_attention_ring``, docs/DESIGN.md §3 Ring
      attention): key/value blocks travel the ring. Segment ids (this device's rows), causal, the window, the soft
      cap and sinks are taken; block layouts, ``mask_builder``, ``block_mask``, ``chunk_size``, ``attention_mask``,
      ``bias`` and positions are not (a ValueError), nor the mesh wrapper's arguments.
    """
    if sequence_parallelism_mesh_axis_name is not None:
        given = {"qkv_layouts": qkv_layouts, "mask_builder": mask_builder, "block_mask": block_mask,
                 "chunk_size": chunk_size, "attention_mask": attention_mask, "bias": bias, "q_positions": q_positions,
                 "kv_positions": kv_positions, "mesh": mesh, "in_specs": in_specs, "out_specs": out_specs}
        for arg, given_value in given.items():
            if given_value is not None:
                raise ValueError(f"{NAME}(): {arg} cannot be combined with sequence_parallelism_mesh_axis_name (ring "
                                 f"attention over a cut sequence takes segment ids, causal, sliding_window, "
                                 f"logits_soft_cap and softmax_aux)")
        if fused_backward is not False:
            raise ValueError(f"{NAME}(): fused_backward={fused_backward!r}: leave it False")
        return _spec_ring(query, key, value, axis_name=sequence_parallelism_mesh_axis_name, causal=causal,
                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
                          mask_info=_mask_info(mask_info, q_segment_ids, kv_segment_ids, None),
                          softmax_scale=softmax_scale, deterministic=deterministic, platform=platform,
                          return_lse=return_lse)
    if fused_backward is not False:
        raise ValueError(f"{NAME}(): fused_backward={fused_backward!r}: ejgen chooses the backward kernels itself "
                         f"(ejgen.ops.explain shows which; deterministic=True asks for ones without atomics); "
                         f"leave it False")
    query = jnp.asarray(query)
    key = jnp.asarray(key)
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(f"{NAME}(): query and key must be [batch, heads, seq, head_dim], got "
                         f"{list(query.shape)} and {list(key.shape)}")
    q_len, kv_len = query.shape[2], key.shape[2]
    info = _mask_info(mask_info, q_segment_ids, kv_segment_ids, attention_mask)
    info = _chunks(info, chunk_size, query.shape[0], q_len, kv_len)
    mask = _block_mask(block_mask, qkv_layouts, mask_builder, q_len, kv_len)
    kwargs = dict(causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                  softmax_aux=softmax_aux, bias=bias, mask_info=info, block_mask=mask, q_positions=q_positions,
                  kv_positions=kv_positions, softmax_scale=softmax_scale,
                  deterministic=deterministic, platform=platform, return_lse=return_lse, mesh=mesh,
                  in_specs=in_specs, out_specs=out_specs)
    return _spec_op(query, key, value, **kwargs)


def _mask_info(info, q_ids, kv_ids, mask):
    if info is not None and (q_ids is not None or kv_ids is not None or mask is not None):
        raise ValueError(f"{NAME}(): give segment ids and attention_mask either as arguments or in mask_info, "
                         f"not both")
    if info is not None or (q_ids is None and kv_ids is None and mask is None):
        return info
    if q_ids is None and kv_ids is not None:
        raise ValueError(f"{NAME}(): kv_segment_ids without q_segment_ids")
    ids = MaskInfo.from_segments(q_ids, kv_ids) if q_ids is not None else MaskInfo()
    dense = MaskInfo.from_attention_mask(mask) if mask is not None else MaskInfo()
    return MaskInfo(ids.q_segment_ids, ids.kv_segment_ids, dense.attention_mask)


def _chunks(info, chunk_size, batch, q_len, kv_len):
    """Chunked attention as segment ids (each chunk a document: tiles classified in O(tiles), full tiles inside
    a chunk), folded into the caller's segment ids when there are some (padding stays padding)."""
    if chunk_size is None:
        return info
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{NAME}(): chunk_size must be a positive int, got {chunk_size!r}")
    n_chunks = -(-kv_len // chunk_size)
    q_chunk = (jnp.arange(q_len, dtype=jnp.int32) + (kv_len - q_len)) // chunk_size  # bottom-right aligned
    kv_chunk = jnp.arange(kv_len, dtype=jnp.int32) // chunk_size
    q_chunk, kv_chunk = (jnp.broadcast_to(x[None], (batch, x.shape[0])) for x in (q_chunk, kv_chunk))
    info = info or MaskInfo()
    if info.has_segments:
        fold = lambda seg, chunk: jnp.where(seg >= 0, seg * n_chunks + chunk, -1)  # noqa: E731
        q_chunk, kv_chunk = fold(info.q_segment_ids, q_chunk), fold(info.kv_segment_ids, kv_chunk)
    return MaskInfo(q_chunk, kv_chunk, info.attention_mask)


def _block_mask(mask, layouts, builder, q_len, kv_len):
    parts = [] if mask is None else [("block_mask", mask)]
    if layouts is not None:
        parts.append(("qkv_layouts", _one_layout(layouts)))
    if builder is not None:
        if not callable(builder):
            raise ValueError(f"{NAME}(): mask_builder must be callable as mask_builder(q_len, kv_len), got "
                             f"{type(builder).__name__}")
        parts.append(("mask_builder", builder(q_len, kv_len)))
    joined = None
    for name, part in parts:
        part = _as_block_mask(name, part, q_len, kv_len)
        joined = part if joined is None else joined & part
    return joined


def _one_layout(layouts):
    """One layout, or the seed's (fwd, dq, dkdv) triple of one layout (checked where the arrays are concrete)."""
    if not isinstance(layouts, (tuple, list)):
        return layouts
    fail = ValueError(f"{NAME}(): qkv_layouts: ejgen derives the backward's tile lists from the forward's layout; "
                      f"pass one layout (or the same one three times)")
    if not layouts or len(layouts) > 3:
        raise fail
    for other in layouts[1:]:
        if isinstance(other, BlockMask) or isinstance(layouts[0], BlockMask):
            if other is not layouts[0]:
                raise fail
            continue
        try:
            same = np.array_equal(np.asarray(other), np.asarray(layouts[0]))
        except jax.errors.TracerArrayConversionError:  # traced: taken as given
            continue
        if not same:
            raise fail
    return layouts[0]


def _as_block_mask(name, part, q_len, kv_len):
    if isinstance(part, BlockMask):
        return part
    layout = jnp.asarray(part)
    if layout.dtype != jnp.bool_ or layout.ndim not in (2, 4):
        raise ValueError(f"{NAME}(): {name} must be a BlockMask or a bool block layout [B|1, H|1, nQ, nK], got "
                         f"{layout.dtype}{list(layout.shape)}")
    n_q, n_k = layout.shape[-2:]
    block_q, block_k = -(-q_len // n_q), -(-kv_len // n_k)
    if -(-q_len // block_q) != n_q or -(-kv_len // block_k) != n_k:
        raise ValueError(f"{NAME}(): {name}: a {n_q} x {n_k} layout does not tile {q_len} x {kv_len} in equal blocks; "
                         f"build it with BlockMask.from_layout(layout, q_len, kv_len, block_q, block_k)")
    return BlockMask.from_layout(layout, q_len, kv_len, block_q, block_k)
