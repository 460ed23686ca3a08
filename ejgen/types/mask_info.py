"""`MaskInfo`: which keys each query may see beyond causal and window (segment ids or a dense mask)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskInfo:
    """Which keys each query may see, beyond causal/window: segment ids or a dense mask.

    Build it with ``MaskInfo.from_segments`` or ``MaskInfo.from_attention_mask``. A pytree: it
    passes through ``jit``, ``vmap`` and ``shard_map`` like any array.
    """

    q_segment_ids: jax.Array | None = None  # int32 [B, Sq]; negative = padding
    kv_segment_ids: jax.Array | None = None  # int32 [B, Sk]; negative = padding
    attention_mask: jax.Array | None = None  # bool [B, 1|Hq, Sq, Sk]; True = visible

    @classmethod
    def from_segments(cls, q_segment_ids, kv_segment_ids=None) -> "MaskInfo":
        """Query i sees key j when their ids are equal and non-negative. ``kv`` defaults to ``q``."""
        q = jnp.asarray(q_segment_ids)
        kv = q if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
        for name, ids in (("q_segment_ids", q), ("kv_segment_ids", kv)):
            if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(f"MaskInfo.from_segments: {name} must be an integer array [batch, seq], "
                                 f"got {ids.dtype}{list(ids.shape)}")
        if q.shape[0] != kv.shape[0]:
            raise ValueError(f"MaskInfo.from_segments: q_segment_ids and kv_segment_ids have different "
                             f"batch sizes ({q.shape[0]} vs {kv.shape[0]})")
        return cls(q_segment_ids=q.astype(jnp.int32), kv_segment_ids=kv.astype(jnp.int32))

    @classmethod
    def from_attention_mask(cls, mask) -> "MaskInfo":
        """A dense bool mask [B, Sq, Sk] or [B, 1|Hq, Sq, Sk]; True marks a visible key."""
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"MaskInfo.from_attention_mask: mask must be bool, got {mask.dtype}")
        if mask.ndim == 3:
            mask = mask[:, None]
        if mask.ndim != 4:
            raise ValueError(f"MaskInfo.from_attention_mask: mask must be [B, Sq, Sk] or [B, H, Sq, Sk], "
                             f"got shape {list(mask.shape)}")
        return cls(attention_mask=mask)

    @property
    def has_segments(self) -> bool:
        return self.q_segment_ids is not None

    @property
    def has_mask(self) -> bool:
        return self.attention_mask is not None
