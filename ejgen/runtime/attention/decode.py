"""Decode and paged decode of every attention spec (docs/DESIGN.md §3, "Decode and paged modes"): the argument
checks and the XLA kernels, driven by the spec's own XLA hooks (`_visible`, `_score` of its `xla.py`), so an
authored variant decodes with its score, mask, params and options as it trains.

A decode call is train-mode attention of the last ``Sq`` query rows of each sequence over its keys: sequence
``b`` holds the keys ``sequence_start[b] <= j < sequence_end[b]`` of the cache row, its length is ``L_b = end -
start``, query row ``i`` stands at position ``L_b - Sq + i`` and key ``j`` at ``j - start`` (positions in the
sequence, what the DSL's ``q_idx`` and ``kv_idx`` read; ``q_len = kv_len = L_b``). Causal, the window and the
spec's mask apply as in train mode; an empty sequence gives o = 0 and lse = -inf (or the sinks' value). Paged:
token ``t`` of sequence ``b`` is row ``t % page_size`` of page ``block_tables[b, t // page_size]``, visible for
``t < context_lens[b]``; the XLA kernel gathers each sequence's pages first (the Triton and Pallas kernels read
them in place). Forward only: ``jax.grad`` through a decode op is an error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejgen.runtime.attention import api
from ejgen.runtime.attention.config import AttentionConfig
from ejgen.runtime.attention.xla import Block

MAX_QUERIES = 16  # query tokens per sequence (speculative verification, chunked prefill)


class Prepared:
    """A checked decode call: q [B, Sq, Hkv, G, D], k/v [B, S, Hkv, D|Dv], the sequences' bounds, ctx, cfg."""

    def __init__(self, q, k, v, starts, ends, ctx, cfg, dims, squeeze, tables=None, page=0, raw=None):
        self.q, self.k, self.v, self.starts, self.ends = q, k, v, starts, ends
        self.ctx, self.cfg, self.dims, self.squeeze = ctx, cfg, dims, squeeze
        self.tables, self.page = tables, page  # paged: k / v are the page pools, read through the tables
        # paged: (block_tables, context_lens) as given (int32, unclamped) for a kernel that clamps them itself: the
        # clamped tables, lens and zero starts are XLA kernels of their own before the call (issue 16)
        self.raw = raw

    def replace(self, **changes) -> "Prepared":
        fields = dict(q=self.q, k=self.k, v=self.v, starts=self.starts, ends=self.ends, ctx=self.ctx, cfg=self.cfg,
                      dims=self.dims, squeeze=self.squeeze, tables=self.tables, page=self.page, raw=self.raw)
        return Prepared(**{**fields, **changes})


def _queries(spec, query):
    """[B, Sq, Hq, D] from [B, Hq, D] (squeeze on the way out) or [B, Sq, Hq, D] with Sq <= MAX_QUERIES."""
    query = jnp.asarray(query)
    if query.ndim == 3:
        return query[:, None], True
    if query.ndim == 4 and 1 <= query.shape[1] <= MAX_QUERIES:
        return query, False
    raise ValueError(f"{spec.name}: query must be [batch, heads, head_dim] or [batch, queries, heads, head_dim] "
                     f"with 1 <= queries <= {MAX_QUERIES}, got {api._shape(query)}")


def _bounds(spec, name, x, batch):
    x = jnp.asarray(x)
    if x.shape != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{spec.name}: {name} must be int [batch={batch}], got {api._shape(x)}")
    return x.astype(jnp.int32)


def prepare(spec, query, key, value, sequence_start, sequence_end, *, causal=False, sliding_window=None,
            logits_soft_cap=None, softmax_aux=None, softmax_scale=None) -> Prepared:
    """Check a ragged decode call: query [B, Hq, D] or [B, Sq, Hq, D], key/value [B, S, Hkv, D|Dv] (the cache,
    read in place), sequence_start/end int [B]."""
    q, squeeze = _queries(spec, query)
    key, value = (x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x) for x in (key, value))
    for name, x in (("query", q), ("key", key), ("value", value)):
        api._check_float(spec, name, x)
    if key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"{spec.name}: key and value must be [batch, seq, kv_heads, head_dim], got "
                         f"{api._shape(key)}, {api._shape(value)}")
    if not (q.dtype == key.dtype == value.dtype):
        raise ValueError(f"{spec.name}: query, key and value must share a dtype, got {api._shape(q)}, "
                         f"{api._shape(key)}, {api._shape(value)}")
    batch, sq, hq, d = q.shape
    _, s, hkv, _ = key.shape
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"{spec.name}: key {api._shape(key)} and value {api._shape(value)} must match each other "
                         f"and the query's batch {batch}")
    if key.shape[-1] != d:
        raise ValueError(f"{spec.name}: key head_dim {key.shape[-1]} differs from query head_dim {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{spec.name}: query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if hkv != hq and "gqa" not in spec.features:
        raise ValueError(f"{spec.name}: key/value heads ({hkv}) differ from query heads ({hq}), but the spec does "
                         f"not enable feature 'gqa' ({spec.path})")
    starts = _bounds(spec, "sequence_start", sequence_start, batch)
    ends = _bounds(spec, "sequence_end", sequence_end, batch)
    groups = hq // hkv
    ctx = {"scale": jnp.asarray(api._softmax_scale(spec, softmax_scale, d), jnp.float32)}
    flags = {"causal": api._check_bool(spec, "causal", causal)}
    if sliding_window is not None:
        left, right = api._window(spec, sliding_window)
        flags.update(window=True, window_span=left + right)
        ctx["window_left"], ctx["window_right"] = jnp.int32(left), jnp.int32(right)
    if logits_soft_cap is not None:
        flags["softcap"] = True
        ctx["softcap"] = api._positive_scalar(spec, "logits_soft_cap", logits_soft_cap)
    if softmax_aux is not None:
        flags["sinks"] = True
        ctx["softmax_aux"] = api._sinks(spec, softmax_aux, hq, hkv, groups)
    cfg = AttentionConfig(seq_q=sq, seq_k=s, **flags)
    dims = {"batch": batch, "heads": hq, "kv_heads": hkv, "q_len": sq, "kv_len": s, "head_dim": d}
    q = q.reshape(batch, sq, hkv, groups, d)
    return Prepared(q, key, value, starts, ends, ctx, cfg, dims, squeeze)


def prepare_paged(spec, query, key_cache, value_cache, context_lens, block_tables, **features) -> Prepared:
    """Check a paged call: key_cache/value_cache [pages, page_size, Hkv, D|Dv], context_lens int [B], block_tables
    int [B, max_pages] (entries past a sequence's pages are never read; out-of-range ones are clamped)."""
    key_cache, value_cache = jnp.asarray(key_cache), jnp.asarray(value_cache)
    if key_cache.ndim != 4 or value_cache.ndim != 4 or key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(f"{spec.name}: key_cache and value_cache must be [num_pages, page_size, kv_heads, head_dim] "
                         f"alike, got {api._shape(key_cache)}, {api._shape(value_cache)}")
    q, _ = _queries(spec, query)
    batch = q.shape[0]
    tables = jnp.asarray(block_tables)
    if tables.ndim != 2 or tables.shape[0] != batch or not jnp.issubdtype(tables.dtype, jnp.integer):
        raise ValueError(f"{spec.name}: block_tables must be int [batch={batch}, max_pages], got "
                         f"{api._shape(tables)}")
    raw_lens = _bounds(spec, "context_lens", context_lens, batch)
    raw_tables = tables.astype(jnp.int32)
    pages = jnp.clip(raw_tables, 0, key_cache.shape[0] - 1)
    page = key_cache.shape[1]
    lens = jnp.clip(raw_lens, 0, pages.shape[1] * page)
    # checked as the contiguous cache the pages stand for (shapes only), then marked paged
    row = lambda c: jax.ShapeDtypeStruct((batch, pages.shape[1] * page) + c.shape[2:], c.dtype)  # noqa: E731
    call = prepare(spec, query, row(key_cache), row(value_cache), jnp.zeros((batch,), jnp.int32), lens, **features)
    return call.replace(k=key_cache, v=value_cache, tables=pages, page=page, raw=(raw_tables, raw_lens))


def laid_out(call: Prepared) -> Prepared:
    """A paged call as a contiguous one: each sequence's pages gathered in order (the XLA kernel's way)."""
    if call.tables is None:
        return call
    batch, n = call.tables.shape

    def lay_out(cache):  # [B, max_pages * page_size, Hkv, D]
        return cache[call.tables].reshape(batch, n * call.page, *cache.shape[2:])

    return call.replace(k=lay_out(call.k), v=lay_out(call.v), tables=None, page=0, raw=None)


def _block(call: Prepared) -> Block:
    """Index grids of the whole call, broadcastable to [B, Hkv, G, Sq, S] (docstring: positions in the sequence)."""
    batch, sq, hkv, groups, _ = call.q.shape
    s = call.k.shape[1]
    length = (call.ends - call.starts)[:, None, None, None, None]
    start = call.starts[:, None, None, None, None]
    rows, cols = jnp.arange(sq)[None, None, None, :, None], jnp.arange(s)[None, None, None, None, :]
    heads = jnp.arange(hkv)[:, None] * groups + jnp.arange(groups)[None, :]
    return Block(
        b=jnp.arange(batch)[:, None, None, None, None],
        h=heads[None, :, :, None, None],
        q_idx=length - sq + rows,
        kv_idx=cols - start,
        q_len=length,
        kv_len=length,
        q_valid=length - sq + rows >= 0,
        kv_valid=(cols >= start) & (cols < call.ends[:, None, None, None, None]),
        q_rows=jnp.arange(sq),
        kv_rows=jnp.arange(s),
    )


def xla_forward(hooks, call: Prepared):
    """(out [B, Sq, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32): the spec's hooks on the whole cache
    row at once (a decode step is one row of logits per query; float32 throughout)."""
    call = laid_out(call)
    q, k, v, ctx, cfg = call.q, call.k, call.v, call.ctx, call.cfg
    blk = _block(call)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q.astype(jnp.float32), k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * ctx["scale"]
    s = jnp.broadcast_to(hooks.score(s, blk, ctx), s.shape).astype(jnp.float32)
    if cfg.softcap:
        s = ctx["softcap"] * jnp.tanh(s / ctx["softcap"])
    vis = jnp.broadcast_to(hooks.visible(blk, ctx, cfg), s.shape)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if cfg.sinks:
        m = jnp.maximum(m, jnp.max(ctx["softmax_aux"], axis=-1)[None, :, :, None])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
    denom = jnp.sum(p, axis=-1)
    if cfg.sinks:
        denom = denom + jnp.sum(jnp.exp(ctx["softmax_aux"][None, :, :, None, :] - m_safe[..., None]), axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None].transpose(0, 3, 1, 2, 4)
    lse = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.astype(q.dtype), lse


def run(forward, call: Prepared, return_lse: bool, name: str):
    """The op's result from ``forward(call) -> (out [B, Sq, Hkv, G, Dv], lse [B, Hkv, G, Sq])``: out [B, Hq, Dv] (or
    [B, Sq, Hq, Dv]) and, with ``return_lse``, lse [B, Hq] (or [B, Hq, Sq])."""
    out, lse = _forward_only(name, forward, call)
    batch, sq, hkv, groups, dv = out.shape
    out = out.reshape(batch, sq, hkv * groups, dv)
    lse = lse.reshape(batch, hkv * groups, sq)
    if call.squeeze:
        out, lse = out[:, 0], lse[..., 0]
    return (out, lse) if return_lse else out


def _forward_only(name, forward, call):
    @jax.custom_vjp
    def run_forward(q, k, v, ctx):
        return forward(call.replace(q=q, k=k, v=v, ctx=ctx))

    def fwd(q, k, v, ctx):
        return run_forward(q, k, v, ctx), None

    def bwd(_, __):
        raise TypeError(f"{name}: decode ops are forward only (inference); differentiate the train-mode op instead")

    run_forward.defvjp(fwd, bwd)
    return run_forward(call.q, call.k, call.v, call.ctx)


def reject_unsupported(name: str, accepted: tuple, unsupported: dict) -> None:
    """A keyword argument the decode op does not take: the train-only ones (segment ids, masks, bias, varlen,
    positions) and anything else."""
    if unsupported:
        arg = sorted(unsupported)[0]
        raise TypeError(f"{name}() got an unsupported argument '{arg}': decode modes take no train-only feature "
                        f"(segment ids, attention masks, bias, varlen, block masks, positions). Accepted keyword "
                        f"arguments: {', '.join(accepted)}")


def choose(platform: str, backends: tuple, name: str, batch_invariant: bool = False) -> str:
    """The decode kernels a call runs: 'auto' takes Triton on a GPU and Pallas on a TPU where the spec has them,
    else XLA; 'triton' (a GPU, or Triton's interpreter with TRITON_INTERPRET=1), 'pallas' (GPU or TPU kernels,
    interpreted elsewhere) and 'xla' as asked. ``batch_invariant`` needs the Triton or the Pallas kernels (a split
    size fixed by the cache length; XLA's matrix products may pick other algorithms for other batch sizes)."""
    from ejgen.runtime.core import kernels
    from ejgen.runtime.launch import triton_call

    if batch_invariant not in (True, False):
        raise ValueError(f"{name}: batch_invariant must be True or False, got {batch_invariant!r}")
    if platform == "auto":
        on = kernels.target().platform
        if "triton" in backends and triton_call.mode()[0] == "gpu":
            platform = "triton"
        elif "pallas" in backends and on == "tpu":
            platform = "pallas"
        elif batch_invariant and "triton" in backends and triton_call.mode()[0] is not None:
            platform = "triton"
        elif batch_invariant and "pallas" in backends:
            platform = "pallas"
        else:
            platform = "xla"
    if platform == "xla":
        if batch_invariant:
            raise ValueError(f"{name}: batch_invariant=True needs the Triton or the Pallas decode kernels (platform "
                             f"'triton' or 'pallas'); XLA gives no such guarantee")
        return "xla"
    if platform in ("triton", "pallas") and platform not in backends:
        raise ValueError(f"{name}: the spec does not list the {platform} backend")
    if platform == "triton":
        how, why = triton_call.mode()
        if how is None:
            raise RuntimeError(f"{name}: platform 'triton' cannot run here: {why}")
        return "triton"
    if platform == "pallas":
        return "pallas"
    raise ValueError(f"{name}: platform must be 'auto', 'triton', 'pallas' or 'xla', got {platform!r}")
