"""What every generated attention op does before and after its kernels: check the arguments,
bring them to the kernel layout, pad to whole blocks, and undo all of it on the way out.

Kernel layout: q [B, Hkv, G, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] with G = Hq // Hkv;
varlen packs all sequences into batch 1. ``ctx`` carries every other tensor the kernels read.
Everything here is plain jnp outside the ``custom_vjp``, so autodiff transposes it for free.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.runtime.attention.config import AttentionConfig
from ejgen.runtime.core import kernels, settings, vma
from ejgen.runtime.core.platforms import PLATFORMS, choose_platform  # noqa: F401 (the generated ops call it here)
from ejgen.runtime.core.platforms import auto_order as _auto_order
from ejgen.types import MaskInfo

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class SpecInfo:
    """What a generated op knows of its spec, for messages and argument checks."""

    name: str
    path: str
    features: dict  # feature name -> "runtime" | "always" | ("value", value)
    arguments: dict  # keyword argument of the op -> the feature (or "param", "option", "call") that brings it
    absent: dict = dataclasses.field(default_factory=dict)  # built-in argument the op does not take -> its feature
    layout: str = "bshd"  # the caller's tensor layout: [B, S, H, D] or "bhsd" [B, H, S, D] (docs/DESIGN.md §2)
    params: dict = dataclasses.field(default_factory=dict)  # param -> its shape's dims (names or ints)
    index_reads: tuple = ()  # "b" / "h" where score or mask read them as numbers (not a param's own index)
    param_dtypes: dict = dataclasses.field(default_factory=dict)  # param -> its dtype's name
    options: dict = dataclasses.field(default_factory=dict)  # option -> its type ("int", "float", "bool")
    position_reads: tuple = ()  # q_idx, kv_idx, q_len, kv_len where score or mask read them (ring attention)
    # the mask's conjunct run as segment ids (`segment_key.SegmentKey`; docs/DESIGN.md §5, Segment keys), and the
    # positions the kernels still read (score and the rest of the mask; None: position_reads)
    segment_key: object = None
    element_reads: tuple | None = None

    @property
    def accepted(self) -> tuple:
        return tuple(self.arguments)

    @property
    def kernel_reads(self) -> tuple:
        """The positions and lengths the kernels read (the segment key's are read before them, by the op)."""
        return self.position_reads if self.element_reads is None else self.element_reads


def reject_unsupported(spec: SpecInfo, unsupported: dict) -> None:
    if not unsupported:
        return
    name = sorted(unsupported)[0]
    if name in spec.absent:
        feature = spec.absent[name]
        setting = spec.features.get(feature.split(" ")[0])
        why = (f"the spec compiles feature '{feature}' in ({_setting_text(setting)})" if setting
               else f"the spec does not enable feature '{feature}'")
    else:
        why = "it is not a feature, param or option of the spec"
    raise TypeError(f"{spec.name}() got an unsupported argument '{name}': {why} ({spec.path}). "
                    f"Accepted keyword arguments: {', '.join(spec.accepted)}")


def _setting_text(setting) -> str:
    if isinstance(setting, tuple):
        return f"{setting[0]} {setting[1]}"
    return str(setting)


def choose_kernels(spec: SpecInfo, backends: dict, platform: str, backend: str, call: "Prepared",
                   deterministic: bool | None) -> kernels.KernelChoice:
    """The kernel sets of a call on ``backend`` (its module's ``choose``), with the reasons; recorded
    (debug log, `explain`) and handed to the kernels as a static argument."""
    det = settings.deterministic(deterministic)
    here = kernels.target()
    if platform == "auto":
        why = f"platform {backend}: auto on {here.arch or here.platform} (order {', '.join(_auto_order(backends))})"
    else:
        why = f"platform {backend}: asked for"
    try:
        forward, backward, reasons, *fields = backends[backend].choose(call, det)  # fields: KernelChoice's others
    except kernels.Unsupported as e:
        others = [b for b in backends if b != backend]
        raise ValueError(f"{spec.name}(): platform '{backend}' cannot run this call: {e} (other platforms: "
                         f"{', '.join(others)})") from None
    if call.segment_key is not None:
        reasons = tuple(reasons) + (f"mask {call.segment_key}: as segment ids (docs/DESIGN.md §5, Segment keys)",)
    if det:
        reasons += ("deterministic: by the call's argument" if deterministic is not None
                    else "deterministic: by the setting (EJGEN_DETERMINISTIC or settings(deterministic=True))",)
    more = fields[0] if fields else {}
    choice = kernels.KernelChoice(backend, forward, backward, det, (why,) + tuple(reasons), **more)
    return kernels.record(choice, spec.name)


def _shape(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _check_float(spec, name, x):
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{spec.name}(): {name} must be float32, bfloat16 or float16, got {_shape(x)}")


HEADS_MAJOR = "heads_major"  # q [B, Hkv, G, Sq, D], k/v [B, Hkv, Sk, D], out [B, Hkv, G, Sq, Dv]
SEQ_MAJOR = "seq_major"  # q [B, Sq, Hkv, G, D], k/v [B, Sk, Hkv, D], out [B, Sq, Hkv, G, Dv]: the caller's own
# A backend backward's ctx entry: delta = rowsum(dO * O) - d lse [B, Hkv, G, Sq] float32 (padded rows 0), computed
# once by a caller that runs the backward on many slices of the same rows (ring attention's pairs); a backward that
# would compute it in XLA takes it instead (`given_delta`), one whose kernels compute it on the way ignores it
DELTA = "delta"


def delta_rows(out, d_out, d_lse):
    """rowsum(d_out * out) - d_lse in float32, [B, Hkv, G, Sq] like lse, of out and d_out [B, Sq, Hkv, G, Dv] (the
    seq-major layout), in XLA (`gluon.host.hopper_delta`: the Hopper path's kernel instead)."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return jnp.moveaxis(delta, -3, -1) - d_lse


def given_delta(ctx: dict):
    """(ctx without the `DELTA` entry, that entry or None)."""
    return _given(ctx, DELTA)


# A backend call's ctx entry: (buffer, k0), a block's K and V in one buffer of 16-bit items of any type (ring
# attention's received block, `ring.Wire`: k [B, rows, Hkv, D] first, v right after), as [items / rows, rows] (a free
# reshape: every part of a block is some items a row; a Python int would be traced on the way to the kernels), the
# call's k and v its rows [k0, k0 + Sk) (k0 None: from row 0). A call whose kernels can read them out of the buffer
# takes it (no copy of the slices before the call: the Hopper forward's KV_AT, the whole block; the backward's KV_AT /
# KV_ROWS / KV_OFF_AT); any other uses k and v, which hold the same values (`given_wire`).
KV_WIRE = "kv_wire"


def given_wire(ctx: dict):
    """(ctx without the `KV_WIRE` entry, that entry or None)."""
    return _given(ctx, KV_WIRE)


# A backend forward's ctx entry: (out [B, Sq, Hkv, G, Dv] in q's dtype, lse [B, Hkv, G, Sq] float32), an earlier
# result of the same query rows over other keys (ring attention's step before its last), which the call's result is
# merged into by the two lse's weights (`merge_into`): the Hopper forward in its epilogue (MERGE, its outputs
# written over these buffers), any other after its kernels (`given_merge`).
MERGE_INTO = "merge_into"


def given_merge(ctx: dict):
    """(ctx without the `MERGE_INTO` entry, that entry or None)."""
    return _given(ctx, MERGE_INTO)


# A backend forward's ctx entry: SMs the Hopper forward's persistent grid leaves free for a kernel that runs beside it
# (ring attention's first step and its hop's NCCL kernel, `ring._hop_sms`): a persistent program holds its SM to the
# end. Any other forward has no use for it (`given_spare`).
SPARE_SMS = "spare_sms"


def given_spare(ctx: dict):
    """(ctx without the `SPARE_SMS` entry, that entry or None)."""
    return _given(ctx, SPARE_SMS)


# A backend forward's ctx entry: True where the Hopper forward over a block layout walks each query tile's span of key
# blocks where it can (`gluon.host.spanned`) whatever LAYOUT_SPANS says (ring attention's last wide step where its
# hop had SMs of its own, `ring._hop_sms`: no list-building kernels need run ahead of the first step). Any other
# forward has no use for it (`given_spans`).
SPANS = "spans"


def given_spans(ctx: dict):
    """(ctx without the `SPANS` entry, that entry or None)."""
    return _given(ctx, SPANS)


def merge_into(out, lse, earlier):
    """(out, lse) merged into ``earlier`` = (out, lse) of the same rows over other keys: the softmax over both key
    sets, in float32, out in ``earlier``'s dtype (rows neither saw: 0 and -inf)."""
    import jax.numpy as jnp

    out0, lse0 = earlier
    top = jnp.maximum(lse0, lse)
    base = jnp.where(top == -jnp.inf, 0.0, top)
    w0, w1 = jnp.exp(lse0 - base), jnp.exp(lse - base)
    den = w0 + w1
    safe = jnp.where(den == 0.0, 1.0, den)
    weight = lambda w: jnp.moveaxis(w / safe, -1, 1)[..., None]  # noqa: E731  [B, Hkv, G, Sq] -> [B, Sq, Hkv, G, 1]
    merged = out0.astype(jnp.float32) * weight(w0) + out.astype(jnp.float32) * weight(w1)
    return merged.astype(out0.dtype), jnp.where(den == 0.0, -jnp.inf, base + jnp.log(safe))


# A backend backward's ctx entry: (acc float32 [B, rows, Hkv, G, D], q0), a dQ accumulator of more rows than the
# call's, which the call's dq is added into from row q0 on (ring attention's pairs: one accumulator of every local
# row, `ring.DQ_ONCE`); the backward then returns that accumulator as its dq. The Hopper backward adds into it in its
# kernel (DQ_ROWS, DQ_OFF_AT, the accumulator aliased), any other after its kernels (`add_rows`).
DQ_INTO = "dq_into"


def given_dq(ctx: dict):
    """(ctx without the `DQ_INTO` entry, that entry or None)."""
    return _given(ctx, DQ_INTO)


# A backend backward's ctx entry beside `DQ_INTO`: (q, d_out) [B, rows, Hkv, G, D] of the accumulator's rows, the
# call's q and d_out being their rows from q0 on. The Hopper backward reads them there (QDO_IN_PLACE: no copies of the
# rows, `ring.Q_IN_PLACE`); ring attention gives it only with `DQ_INTO`, and only to the Hopper backward.
Q_ROWS_FROM = "q_rows_from"


def given_q_rows(ctx: dict):
    """(ctx without the `Q_ROWS_FROM` entry, that entry or None)."""
    return _given(ctx, Q_ROWS_FROM)


# A backend backward's ctx entry beside `KV_WIRE`: (buffer, add), dK and dV of the call written into one buffer of
# 16-bit items laid out as that wire's k and v (dK of its rows, then dV), at the call's keys' rows (ring attention's
# first backward step: its pairs' dK / dV are then the buffer that travels, `ring.DKV_INTO`); ``buffer`` None: a new
# one (rows no call writes hold garbage), else that one, written in place; ``add`` (int32, traced; None: 0) nonzero
# adds to what the rows hold. The call then returns the buffer as its dk. Only the Hopper backward takes it.
DKV_INTO = "dkv_into"


def given_dkv(ctx: dict):
    """(ctx without the `DKV_INTO` entry, that entry or None)."""
    return _given(ctx, DKV_INTO)


def add_rows(acc, q0, x):
    """``acc`` float32 [B, rows, ...] with ``x`` [B, n, ...] added on rows [q0, q0 + n) (``q0`` traced or not)."""
    import jax.numpy as jnp
    from jax import lax

    n = x.shape[1]
    return lax.dynamic_update_slice_in_dim(acc, lax.dynamic_slice_in_dim(acc, q0, n, 1) + x.astype(jnp.float32),
                                           q0, 1)


def _given(ctx: dict, name: str):
    if name not in ctx:
        return ctx, None
    ctx = dict(ctx)
    return ctx, ctx.pop(name)
# layout, so that no transpose is paid before or after the kernels. lse is [B, Hkv, G, Sq] in both.


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Checked inputs in the caller's layout, how to lay them out for a backend, and how to bring
    the outputs back."""

    cfg: AttentionConfig
    q: jax.Array  # [B, Sq, Hkv, G, D]
    k: jax.Array  # [B, Sk, Hkv, D]
    v: jax.Array  # [B, Sk, Hkv, Dv]
    ctx: dict
    dims: dict  # batch, heads, kv_heads, q_len, kv_len, head_dim
    varlen: bool
    op: str = "op"  # the op's name, for messages
    caller_layout: str = "bshd"  # the caller's tensors: [B, S, H, D], or "bhsd" [B, H, S, D] (out goes back so)
    segment_key: str | None = None  # the spec's segment key where it runs as the ids in ctx (`segment_key.lower`)

    def padded(self, block_q: int, block_k: int, layout: str):
        """(q, k, v, ctx) in the backend's layout, padded so that Sq and Sk are whole blocks."""
        if layout == SEQ_MAJOR:
            q, k, v, q_axis, kv_axis = self.q, self.k, self.v, 1, 1
        elif layout == HEADS_MAJOR:
            q, k, v = self.q.transpose(0, 2, 3, 1, 4), self.k.transpose(0, 2, 1, 3), self.v.transpose(0, 2, 1, 3)
            q_axis, kv_axis = 3, 2
        else:
            raise ValueError(f"unknown kernel layout {layout!r}")
        sq, sk = self.q.shape[1], self.k.shape[1]
        pq, pk = -sq % block_q, -sk % block_k
        pad = lambda x, axis, n, value: x if n == 0 else jnp.pad(
            x, [(0, n) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)], constant_values=value)
        q = pad(q, q_axis, pq, 0)
        k, v = pad(k, kv_axis, pk, 0), pad(v, kv_axis, pk, 0)
        ctx = dict(self.ctx)
        for key, axes in _PADDED.items():
            if key in ctx:
                x = ctx[key]
                for axis, which, value in axes:
                    x = pad(x, axis, pq if which == "q" else pk, value)
                ctx[key] = x
        return q, k, v, ctx

    def finish(self, out, lse, return_lse: bool, layout: str):
        """Back to the caller's layout: out [B, Sq, Hq, Dv] (varlen [Tq, Hq, Dv]), lse [B, Hq, Sq]."""
        if not isinstance(return_lse, bool):
            raise ValueError(f"{self.op}(): return_lse must be a Python bool, got {return_lse!r}")
        sq = self.cfg.seq_q
        heads_first = self.caller_layout == "bhsd"
        if layout == SEQ_MAJOR:
            b, _, hkv, g, dv = out.shape
            out = out[:, :sq].reshape(b, sq, hkv * g, dv)
            out = out.transpose(0, 2, 1, 3) if heads_first else out
        else:
            b, hkv, g, _, dv = out.shape
            out = out[:, :, :, :sq].reshape(b, hkv * g, sq, dv)
            out = out if heads_first else out.transpose(0, 2, 1, 3)
        lse = lse[:, :, :, :sq].reshape(b, hkv * g, sq)
        if self.varlen:
            out, lse = out[0], lse[0]
        return (out, lse) if return_lse else out


# ctx entries with sequence axes: (axis, "q" | "k", pad value)
_PADDED = {
    "q_pos": ((1, "q", 0),),
    "kv_pos": ((1, "k", 0),),
    "q_seg": ((1, "q", -1),),
    "kv_seg": ((1, "k", -1),),
    "q_lens": ((1, "q", 0),),
    "kv_lens": ((1, "q", 0),),
    "bias": ((3, "q", 0), (4, "k", 0)),
    "mask": ((3, "q", False), (4, "k", False)),
}


def prepare(spec: SpecInfo, query, key, value, *, causal=False, sliding_window=None, logits_soft_cap=None,
            softmax_aux=None, bias=None, mask_info=None, block_mask=None, q_positions=None, kv_positions=None,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None) -> Prepared:
    """Check the built-in arguments (only those the spec accepts reach here) and lay them out."""
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_float(spec, name, x)
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"{spec.name}(): query, key and value must share a dtype, got "
                         f"{_shape(query)}, {_shape(key)}, {_shape(value)}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    rank = 3 if varlen else 4
    layout = ("[tokens, heads, head_dim]" if varlen else
              "[batch, heads, seq, head_dim]" if spec.layout == "bhsd" else "[batch, seq, heads, head_dim]")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != rank:
            extra = " (varlen: cu_seqlens given)" if varlen else ""
            raise ValueError(f"{spec.name}(): {name} must be {layout}{extra}, got {_shape(x)}")
    if spec.layout == "bhsd":  # to [B, S, H, D]: the backends that index heads first undo it for free under jit
        query, key, value = (x.swapaxes(1, 2) for x in (query, key, value))
    if varlen:
        query, key, value = query[None], key[None], value[None]
    batch, sq, hq, d = query.shape
    _, sk, hkv, _ = key.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(f"{spec.name}(): query, key and value must share the batch size, got "
                         f"{_shape(query)}, {_shape(key)}, {_shape(value)}")
    if key.shape[-1] != d:
        raise ValueError(f"{spec.name}(): key head_dim {key.shape[-1]} differs from query head_dim {d}")
    if value.shape[1] != sk or value.shape[2] != hkv:
        raise ValueError(f"{spec.name}(): value {_shape(value)} must match key {_shape(key)} "
                         f"in sequence length and heads")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{spec.name}(): query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if hkv != hq and "gqa" not in spec.features:
        raise ValueError(f"{spec.name}(): key/value heads ({hkv}) differ from query heads ({hq}), but the "
                         f"spec does not enable feature 'gqa' ({spec.path})")
    groups = hq // hkv
    scale = _softmax_scale(spec, softmax_scale, d)
    ctx = {
        "scale": jnp.asarray(scale, jnp.float32),
        "q_pos": jnp.arange(sq, dtype=jnp.int32)[None],
        "kv_pos": jnp.arange(sk, dtype=jnp.int32)[None],
    }
    flags = {}
    if varlen:
        flags.update(varlen=True, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        ctx.update(_varlen(spec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sq, sk))
    flags["causal"] = _check_bool(spec, "causal", causal)
    if sliding_window is not None:
        left, right = _window(spec, sliding_window)
        flags["window"] = True
        flags["window_span"] = left + right
        left, right = jnp.int32(left), jnp.int32(right)
        ctx["window_left"], ctx["window_right"] = left, right
    if logits_soft_cap is not None:
        flags["softcap"] = True
        ctx["softcap"] = _positive_scalar(spec, "logits_soft_cap", logits_soft_cap)
    if softmax_aux is not None:
        flags["sinks"] = True
        ctx["softmax_aux"] = _sinks(spec, softmax_aux, hq, hkv, groups)
    if bias is not None:
        flags["bias"] = True
        ctx["bias"] = _bias(spec, bias, batch, hq, hkv, groups, sq, sk, varlen)
    if mask_info is not None:
        if not isinstance(mask_info, MaskInfo):
            raise ValueError(f"{spec.name}(): mask_info must be an ejgen.types.MaskInfo, got {type(mask_info).__name__}")
        if varlen:
            raise ValueError(f"{spec.name}(): mask_info cannot be combined with cu_seqlens (varlen already "
                             f"separates sequences)")
        if mask_info.has_segments:
            _require(spec, "segment_ids", "mask_info with segment ids")
            flags["segments"] = True
            ctx["q_seg"], ctx["kv_seg"] = _segments(spec, mask_info, batch, sq, sk)
        if mask_info.has_mask:
            _require(spec, "attention_mask", "mask_info with a dense attention_mask")
            flags["dense_mask"] = True
            ctx["mask"] = _dense_mask(spec, mask_info.attention_mask, batch, hq, hkv, groups, sq, sk)
    if block_mask is not None:
        _block_mask(spec, block_mask, flags, ctx, batch, hq, hkv, groups, sq, sk, varlen)
    if q_positions is not None or kv_positions is not None:
        if varlen:
            raise ValueError(f"{spec.name}(): q_positions / kv_positions cannot be combined with cu_seqlens (varlen "
                             f"places tokens by sequence already)")
        flags["positions"] = True
        q_pos = _positions(spec, "q_positions", q_positions, batch, sq)
        # causal and the window compare positions: shifted so that the kernels' bottom-right aligned rules
        # (kv <= q + kv_len - q_len) read kv_pos <= q_pos (docs/DESIGN.md §3, block masks)
        ctx["q_pos"] = q_pos - jnp.int32(sk - sq)
        ctx["kv_pos"] = _positions(spec, "kv_positions", kv_positions, batch, sk)
    q = query.reshape(batch, sq, hkv, groups, d)
    k, v = key, value
    dims = {"batch": batch, "heads": hq, "kv_heads": hkv, "q_len": sq, "kv_len": sk, "head_dim": d}
    cfg = AttentionConfig(seq_q=sq, seq_k=sk, **flags)
    return Prepared(cfg, q, k, v, ctx, dims, varlen, spec.name, spec.layout)


def _block_mask(spec, mask, flags, ctx, batch, hq, hkv, groups, sq, sk, varlen):
    """Lower a `BlockMask`'s conditions onto the call (docs/DESIGN.md §3, block masks): its band joins causal and
    the window (the tighter bound of each side wins), segment ids and a dense mask join ``mask_info``'s, its
    first block layout travels as one (tile kinds from it, O(tiles); the element rule where kernel tiles cut
    its blocks), and everything else (``mask_fn``, further layouts) becomes part of the dense mask."""
    from ejgen.types import block_mask as bm

    if not isinstance(mask, bm.BlockMask):
        raise ValueError(f"{spec.name}(): block_mask must be an ejgen.types.BlockMask, got {type(mask).__name__}")
    if varlen:
        raise ValueError(f"{spec.name}(): block_mask cannot be combined with cu_seqlens (build the mask over the "
                         f"padded batch instead)")
    if (mask.q_len, mask.kv_len) != (sq, sk):
        raise ValueError(f"{spec.name}(): block_mask was built for q_len {mask.q_len} x kv_len {mask.kv_len}, the "
                         f"call has {sq} x {sk}")
    conditions = mask.conditions or (bm.Layout(mask.kinds() != bm.SKIP, mask.block_q, mask.block_k),)
    dense = []
    for cond in conditions:
        if isinstance(cond, bm.Band):
            _band(spec, cond, flags, ctx, sq, sk)
        elif isinstance(cond, bm.Segments):
            if flags.get("segments"):
                raise ValueError(f"{spec.name}(): segment ids given twice (mask_info and block_mask); pass them once")
            flags["segments"] = True
            ctx["q_seg"], ctx["kv_seg"] = _segments(spec, MaskInfo(cond.q_ids, cond.kv_ids), batch, sq, sk)
        elif isinstance(cond, bm.Layout) and not flags.get("layout"):
            lay = cond.layout
            if lay.shape[0] not in (1, batch) or lay.shape[1] not in (1, hq):
                raise ValueError(f"{spec.name}(): block_mask layout must be [batch|1, heads|1, nQ, nK] = "
                                 f"[{batch}|1, {hq}|1, ...], got {_shape(lay)}")
            flags.update(layout=True, layout_block=(cond.block_q, cond.block_k))
            ctx["layout"] = (lay.reshape(lay.shape[0], hkv, groups, *lay.shape[2:]) if lay.shape[1] == hq
                             else lay[:, :, None])
        else:  # a mask_fn, a dense mask, another layout: element by element
            dense.append(_elements(spec, cond, batch, hq, sq, sk))
    if dense:
        both = dense[0]
        for extra in dense[1:]:
            both = both & extra
        both = _dense_mask(spec, both, batch, hq, hkv, groups, sq, sk)
        ctx["mask"] = both if "mask" not in ctx else ctx["mask"] & both
        flags["dense_mask"] = True


def _elements(spec, cond, batch, hq, sq, sk):
    """bool [batch, 1|hq, sq, sk]: a condition's element rule over the whole call."""
    from ejgen.types import block_mask as bm

    if isinstance(cond, bm.Function):
        sizes = (cond.batch, cond.heads)
    else:
        sizes = (cond.mask if isinstance(cond, bm.Dense) else cond.layout).shape[:2]
    if sizes[0] not in (1, batch) or sizes[1] not in (1, hq):
        raise ValueError(f"{spec.name}(): block_mask's {type(cond).__name__.lower()} condition covers batch "
                         f"{sizes[0]} x heads {sizes[1]}; the call has batch {batch} (or 1) x heads {hq} (or 1)")
    return bm.elements(cond, batch, sizes[1], sq, sk)


def _band(spec, band, flags, ctx, sq, sk):
    """Join a `Band` (bottom-right aligned, as causal and the window) with the call's causal and window."""
    wide = sq + sk  # a bound no (query, key) pair reaches
    causal = flags.get("causal", False)
    left = int(ctx["window_left"]) if flags.get("window") else None
    right = 0 if causal else (int(ctx["window_right"]) if flags.get("window") else None)
    if band.left is not None:
        left = band.left if left is None else min(left, band.left)
    if band.right is not None:
        right = band.right if right is None else min(right, band.right)
    if right == 0 and not causal:
        if "causal" not in spec.features:
            raise TypeError(f"{spec.name}() got a causal block_mask, but the spec does not enable feature 'causal' "
                            f"({spec.path})")
        flags["causal"] = causal = True
    if right is not None and right < 0:
        raise ValueError(f"{spec.name}(): block_mask's band ends {-right} keys before the diagonal; bands end at "
                         f"or after it (causal, sliding windows)")
    if left is not None or (right is not None and not causal):
        if "sliding_window" not in spec.features:
            raise TypeError(f"{spec.name}() got a block_mask with a sliding window, but the spec does not enable "
                            f"feature 'sliding_window' ({spec.path})")
        left = wide if left is None else left
        right = 0 if causal else (wide if right is None else right)
        flags.update(window=True, window_span=left + right)
        ctx["window_left"], ctx["window_right"] = jnp.int32(left), jnp.int32(right)


def _positions(spec, name, pos, batch, n):
    """int32 [batch, n]: the given positions ([batch|1, n]), or the indices where absent."""
    if pos is None:
        return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None], (batch, n))
    pos = jnp.asarray(pos)
    ok = pos.ndim == 2 and pos.shape[0] in (1, batch) and pos.shape[1] == n
    if not ok or not jnp.issubdtype(pos.dtype, jnp.integer):
        length = "q_len" if name.startswith("q") else "kv_len"
        raise ValueError(f"{spec.name}(): {name} must be an integer array [batch|1, {length}] = [{batch}|1, {n}], "
                         f"got {_shape(pos)}")
    return jnp.broadcast_to(pos.astype(jnp.int32), (batch, n))


def _require(spec, feature, what):
    if feature not in spec.features:
        raise TypeError(f"{spec.name}() got {what}, but the spec does not enable feature '{feature}' ({spec.path})")


def _check_bool(spec, name, x) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"{spec.name}(): {name} must be a Python bool, got {x!r}")
    return x


def _window(spec, window):
    whole = lambda w: isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))  # noqa: E731
    pair = (window, window) if whole(window) else window
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(not whole(w) or w < 0 for w in pair)):
        raise ValueError(f"{spec.name}(): sliding_window must be a non-negative int or a (left, right) "
                         f"pair of them, got {window!r}")
    return int(pair[0]), int(pair[1])


def _positive_scalar(spec, name, x):
    """A positive finite float32 scalar: a Python number, or a 0-d float array (checked where
    concrete; a traced one is taken as given)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        value = x
    else:
        x = jnp.asarray(x)
        if x.ndim != 0 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{spec.name}(): {name} must be a positive float scalar, got {_shape(x)}")
        try:
            value = float(np.asarray(x))
        except jax.errors.TracerArrayConversionError:
            return x.astype(jnp.float32)
    if not 0 < np.float32(value) < np.inf:
        raise ValueError(f"{spec.name}(): {name} must be positive and finite, got {value!r}")
    return jnp.asarray(x, jnp.float32)


def _softmax_scale(spec, scale, head_dim):
    """``softmax_scale``: None (1/sqrt(head_dim)), a Python number or a 0-d real array."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if hasattr(scale, "dtype"):
        dtype = jnp.dtype(scale.dtype)
        ok = jnp.ndim(scale) == 0 and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    else:
        ok = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not ok:
        what = _shape(scale) if hasattr(scale, "dtype") else repr(scale)
        raise ValueError(f"{spec.name}(): softmax_scale must be None or a float scalar, got {what}")
    return scale


def _sinks(spec, aux, hq, hkv, groups):
    aux = jnp.asarray(aux)
    ok = jnp.issubdtype(aux.dtype, jnp.floating) and (
        (aux.ndim == 1) or (aux.ndim == 2 and aux.shape[0] == hq))
    if not ok:
        raise ValueError(f"{spec.name}(): softmax_aux must be float [heads={hq}], [heads={hq}, n] or [n], "
                         f"got {_shape(aux)}")
    aux = aux.astype(jnp.float32)
    if aux.ndim == 1:
        # [Hq] means one sink per head; any other length is n sinks shared by all heads
        aux = aux[:, None] if aux.shape[0] == hq else jnp.broadcast_to(aux[None], (hq, aux.shape[0]))
    return aux.reshape(hkv, groups, aux.shape[-1])


def _bias(spec, bias, batch, hq, hkv, groups, sq, sk, varlen):
    bias = jnp.asarray(bias)
    if varlen:
        raise ValueError(f"{spec.name}(): bias cannot be combined with cu_seqlens")
    _check_float(spec, "bias", bias)
    ok = bias.ndim == 4 and bias.shape[0] in (1, batch) and bias.shape[1] in (1, hq) and bias.shape[2:] == (sq, sk)
    if not ok:
        raise ValueError(f"{spec.name}(): bias must be broadcastable as [batch|1, heads|1, q_len, kv_len] = "
                         f"[{batch}|1, {hq}|1, {sq}, {sk}], got {_shape(bias)}")
    if bias.shape[1] == hq:
        return bias.reshape(bias.shape[0], hkv, groups, sq, sk)
    return bias[:, :, None]


def _dense_mask(spec, mask, batch, hq, hkv, groups, sq, sk):
    if mask.shape[0] != batch or mask.shape[1] not in (1, hq) or mask.shape[2:] != (sq, sk):
        raise ValueError(f"{spec.name}(): mask_info.attention_mask must be [batch, 1|heads, q_len, kv_len] = "
                         f"[{batch}, 1|{hq}, {sq}, {sk}], got {_shape(mask)}")
    if mask.shape[1] == hq:
        return mask.reshape(batch, hkv, groups, sq, sk)
    return mask[:, :, None]


def _segments(spec, info, batch, sq, sk):
    q, kv = info.q_segment_ids, info.kv_segment_ids
    if q.shape != (batch, sq):
        raise ValueError(f"{spec.name}(): mask_info.q_segment_ids must be [batch, q_len] = [{batch}, {sq}], got {_shape(q)}")
    if kv.shape != (batch, sk):
        raise ValueError(f"{spec.name}(): mask_info.kv_segment_ids must be [batch, kv_len] = [{batch}, {sk}], got {_shape(kv)}")
    return q.astype(jnp.int32), kv.astype(jnp.int32)


def _varlen(spec, cu_q, cu_k, max_q, max_k, tq, tk):
    if cu_q is None or cu_k is None:
        missing = "cu_seqlens_k" if cu_k is None else "cu_seqlens_q"
        raise ValueError(f"{spec.name}(): varlen needs both cu_seqlens_q and cu_seqlens_k; {missing} is missing")
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.ndim != 1 or cu.dtype != jnp.int32 or cu.shape[0] < 2:
            raise ValueError(f"{spec.name}(): {name} must be int32 [num_seqs + 1], got {_shape(cu)}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"{spec.name}(): cu_seqlens_q {_shape(cu_q)} and cu_seqlens_k {_shape(cu_k)} must "
                         f"describe the same number of sequences")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if m is None or isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{spec.name}(): {name} must be a non-negative Python int with cu_seqlens, got {m!r}")
    _check_concrete_cu_seqlens(spec, cu_q, "cu_seqlens_q", max_q, tq)
    _check_concrete_cu_seqlens(spec, cu_k, "cu_seqlens_k", max_k, tk)
    q_seq, q_pos, q_len = _tokens(cu_q, tq)
    kv_seq, kv_pos, _ = _tokens(cu_k, tk)
    kv_lens = cu_k[1:] - cu_k[:-1]
    kv_len_of_q = jnp.where(q_seq >= 0, kv_lens[jnp.maximum(q_seq, 0)], 0)
    return {
        "cu_q": cu_q, "cu_k": cu_k,
        "q_seg": q_seq[None], "kv_seg": kv_seq[None], "q_pos": q_pos[None], "kv_pos": kv_pos[None],
        "q_lens": q_len[None], "kv_lens": kv_len_of_q[None],
    }


def _check_concrete_cu_seqlens(spec, cu, name, longest, total):
    """Where cu_seqlens is a concrete array (not traced under jit), check it fully: non-decreasing
    from 0, within the tokens, no sequence longer than max_seqlen (the kernels' grid extent)."""
    try:
        values = np.asarray(cu)
    except jax.errors.TracerArrayConversionError:
        return
    max_name = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
    lengths = np.diff(values)
    if values[0] != 0 or np.any(lengths < 0) or values[-1] > total:
        raise ValueError(f"{spec.name}(): {name} must start at 0, never decrease and end at most at the "
                         f"{total} tokens given, got {values.tolist()}")
    if lengths.size and lengths.max() > longest:
        raise ValueError(f"{spec.name}(): {max_name}={longest} is shorter than a sequence of {name} "
                         f"({int(lengths.max())} tokens)")


def _tokens(cu, total):
    """Per token: its sequence (-1 past the last), position in it, and that sequence's length."""
    t = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
    inside = jnp.logical_and(seq >= 0, t < cu[-1])
    seq = jnp.where(inside, jnp.minimum(seq, cu.shape[0] - 2), -1)
    safe = jnp.maximum(seq, 0)
    pos = jnp.where(inside, t - cu[safe], 0)
    length = jnp.where(inside, cu[safe + 1] - cu[safe], 0)
    return seq, pos, length


def check_param(spec: SpecInfo, name: str, x, shape: tuple, dtype, dims: dict):
    """A spec param: its shape resolved against the call's dims, cast to the declared dtype."""
    x = jnp.asarray(x)
    want = tuple(dims[d] if isinstance(d, str) else d for d in shape)
    if x.shape != want:
        described = ", ".join(f"{d}={dims[d]}" if isinstance(d, str) else str(d) for d in shape)
        raise ValueError(f"{spec.name}(): param {name} must have shape [{described}], got {_shape(x)}")
    return x.astype(dtype)


_OPTION_KINDS = {  # kind -> (dtype, Python values taken, array dtypes taken)
    "int": (jnp.int32, lambda x: isinstance(x, int) and not isinstance(x, bool),
            lambda d: jnp.issubdtype(d, jnp.integer)),
    "float": (jnp.float32, lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
              lambda d: jnp.issubdtype(d, jnp.integer) or jnp.issubdtype(d, jnp.floating)),
    "bool": (jnp.bool_, lambda x: isinstance(x, bool), lambda d: d == jnp.bool_),
}


def check_option(spec: SpecInfo, name: str, x, kind: str):
    """A spec option: a runtime scalar (Python value or 0-d array), never a recompile. An int option
    takes ints only (a float would be truncated), a float option ints or floats, a bool option bools."""
    dtype, python_ok, dtype_ok = _OPTION_KINDS[kind]
    article = "an" if kind == "int" else "a"
    if hasattr(x, "dtype"):
        if not dtype_ok(jnp.dtype(x.dtype)):
            raise ValueError(f"{spec.name}(): option {name} must be {article} {kind} scalar, got {_shape(x)}")
    elif not python_ok(x):
        raise ValueError(f"{spec.name}(): option {name} must be {article} {kind}, got {x!r}")
    # a Python value stays a concrete (numpy) scalar while tracing, so host-side choices may read it
    # (segment_key.static_wraps); an array stays what it is (traced under jit)
    x = jnp.asarray(x) if hasattr(x, "dtype") and not isinstance(x, np.ndarray) else np.asarray(x)
    if x.ndim != 0:
        raise ValueError(f"{spec.name}(): option {name} must be a scalar, got {_shape(x)}")
    if kind == "int" and isinstance(x, np.ndarray) and not np.iinfo(np.int32).min <= int(x) <= np.iinfo(np.int32).max:
        raise ValueError(f"{spec.name}(): option {name} does not fit int32, got {int(x)}")
    return x.astype(dtype)


def vary_alike(q, k, v, ctx):
    """The inputs of the op's ``custom_vjp``, each made to vary over every mesh axis any of them varies over
    (inside ``jax.shard_map``; outside, all is returned as it is). The kernels' results and gradients vary so,
    and a backward must give each input a gradient of its own type; the cast's transpose then sums the gradient of
    an input replicated over an axis (a param, the sinks, a shared bias) over that axis."""
    return vma.vary((q, k, v, ctx), vma.varying_axes(q, k, v, ctx))


def ctx_cotangents(ctx: dict, dctx: dict) -> dict:
    """Cotangents for every ``ctx`` entry: gradients where the kernels computed one, else None."""
    params = dctx.get("params", {})
    out = {}
    for key, x in ctx.items():
        grad = dctx.get(key)
        if key.startswith("param_") and key[len("param_"):] in params:
            grad = params[key[len("param_"):]]
        out[key] = None if grad is None else grad.astype(x.dtype)
    return out


def join_sinks(out, lse, aux):
    """(out, lse) of attention without sinks [B, S, Hkv, G, Dv] / [B, Hkv, G, S] -> with the sinks ``aux`` [Hkv, G, n]
    in the denominator (docs/DESIGN.md §3): lse' = logaddexp(lse, logsumexp(aux)), out' = out e^{lse - lse'}; a row
    that saw no key keeps o = 0 and takes the sinks' lse. out in float32 (the caller casts). For kernels that take no
    sinks of their own: the ring's final merge, the Hopper set."""
    total = jnp.logaddexp(lse, jax.nn.logsumexp(aux.astype(jnp.float32), axis=-1)[None, :, :, None])
    weight = jnp.exp(lse - jnp.where(total == -jnp.inf, 0.0, total))  # 0 where the row saw no key
    return out.astype(jnp.float32) * jnp.moveaxis(weight, 3, 1)[..., None], total


def sinks_grad(aux, lse, delta, seq_q: int | None = None):
    """d loss / d softmax_aux [Hkv, G, n] = -sum over batch and rows of p_sink * delta, with
    p_sink = exp(aux - lse) (lse [B, Hkv, G, Sq], delta = rowsum(d_out * out) - d_lse); rows at
    or past ``seq_q`` (padding) are left out. Shared by every backend."""
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    p_sink = jnp.exp(aux[None, :, :, None, :] - lse_safe[..., None])
    if seq_q is not None:
        p_sink = jnp.where((jnp.arange(lse.shape[3]) < seq_q)[None, None, None, :, None], p_sink, 0.0)
    return -jnp.sum(p_sink * delta[..., None], axis=(0, 3))
