"""Static configuration of one pooling call. Hashable: a ``nondiff_argnames`` argument of ``jax.custom_vjp`` and a
jit cache key."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    kind: str  # "sum" (mean, sum, last) | "max": the accumulation (plan/pooling.py KINDS)
    scaled: bool  # mean: each sequence's sum times 1 / its total weight
    weighted: bool  # a per-token weight w [T] float32 is read (weights and / or a mask; max: the mask as 0 / 1)
    weight_grad: bool  # the call passed weights: their gradient is computed (a mask alone has none)
    ranged: bool  # the pooled range of a sequence is not the whole sequence (last: its last pooled token)
    varlen: bool  # packed tokens and cu_seqlens; else B sequences of seq_len tokens each
    n_seqs: int  # N: rows of the output
    tokens: int  # T: rows of x as the kernels see it ([T, D]; dense: B * S)
    dim: int  # D
    seq_len: int  # dense: S (0 with varlen)
    chunk: int  # chunk_size: the kernels' token tile (rows per load)
