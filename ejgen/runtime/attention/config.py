"""Static configuration of one attention call: which features are on. Hashable, so it can be a
``nondiff_argnames`` argument of ``jax.custom_vjp`` and a jit cache key."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    seq_q: int  # true query length (total tokens when varlen)
    seq_k: int  # true key length (total tokens when varlen)
    causal: bool = False
    window: bool = False
    window_span: int = 0  # sliding window: left + right keys (static; bounds the band of visited key blocks)
    softcap: bool = False
    sinks: bool = False
    bias: bool = False
    segments: bool = False
    dense_mask: bool = False
    varlen: bool = False
    layout: bool = False  # a block layout (block_mask=): tiles of layout_block visible whole or not at all
    layout_block: tuple = (0, 0)  # its (block_q, block_k)
    positions: bool = False  # q_positions / kv_positions: causal and the window compare them, not the indices
    max_seqlen_q: int = 0  # varlen: the longest sequence (kernel grids)
    max_seqlen_k: int = 0

    @property
    def runtime_block_mask(self) -> bool:
        """Masks only known at run time: block skipping comes from a block mask computed per call."""
        return self.segments or self.dense_mask or self.varlen or self.layout or self.positions
