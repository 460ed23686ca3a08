"""Shape registry for attention tests and benchmarks; ids read like ``B2-Sq63-Sk65-H4x2-D48``.

Test shapes stay small (S <= 130, D <= 72 but for one of 320, B <= 2) so the CPU suite runs in minutes; the
GPU host adds its own (`GPU_SHAPES`). Benchmarks
add their own large shapes here under their own names, with the same classes and ids.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np


class _Heads:
    """What both shape kinds share: heads, head dims and a readable id."""

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    def __str__(self) -> str:
        return self.id

    def _check_heads(self):
        if self.q_heads % self.kv_heads:
            raise ValueError(f"{self.id}: q_heads must be a multiple of kv_heads")

    def _dims_id(self) -> str:
        dv = "" if self.v_head_dim is None else f"-Dv{self.v_head_dim}"
        return f"H{self.q_heads}x{self.kv_heads}-D{self.head_dim}{dv}"


@dataclasses.dataclass(frozen=True)
class AttnShape(_Heads):
    """``query [B, Sq, Hq, D], key [B, Sk, Hkv, D], value [B, Sk, Hkv, Dv]``."""

    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: same as head_dim

    def __post_init__(self):
        self._check_heads()

    @property
    def id(self) -> str:
        return f"B{self.batch}-Sq{self.q_len}-Sk{self.kv_len}-{self._dims_id()}"

    @property
    def odd(self) -> bool:
        return bool(self.q_len % 2 or self.kv_len % 2)

    @property
    def query(self) -> tuple:
        return (self.batch, self.q_len, self.q_heads, self.head_dim)

    @property
    def key(self) -> tuple:
        return (self.batch, self.kv_len, self.kv_heads, self.head_dim)

    @property
    def value(self) -> tuple:
        return (self.batch, self.kv_len, self.kv_heads, self.dv)

    @property
    def out(self) -> tuple:
        return (self.batch, self.q_len, self.q_heads, self.dv)

    @property
    def lse(self) -> tuple:
        return (self.batch, self.q_heads, self.q_len)


@dataclasses.dataclass(frozen=True)
class VarlenShape(_Heads):
    """Packed sequences: ``query [Tq, Hq, D], key [Tk, Hkv, D], value [Tk, Hkv, Dv]``, sequence
    ``n`` holding ``q_lens[n]`` queries and ``kv_lens[n]`` keys."""

    q_lens: tuple
    kv_lens: tuple
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None

    def __post_init__(self):
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError("q_lens and kv_lens must have one entry per sequence")
        self._check_heads()

    @property
    def id(self) -> str:
        q, k = ".".join(map(str, self.q_lens)), ".".join(map(str, self.kv_lens))
        return f"N{len(self.q_lens)}-q{q}-k{k}-{self._dims_id()}"

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def total_kv(self) -> int:
        return sum(self.kv_lens)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.kv_lens)

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)

    @property
    def cu_seqlens_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.kv_lens)]).astype(np.int32)

    @property
    def query(self) -> tuple:
        return (self.total_q, self.q_heads, self.head_dim)

    @property
    def key(self) -> tuple:
        return (self.total_kv, self.kv_heads, self.head_dim)

    @property
    def value(self) -> tuple:
        return (self.total_kv, self.kv_heads, self.dv)

    @property
    def out(self) -> tuple:
        return (self.total_q, self.q_heads, self.dv)

    @property
    def lse(self) -> tuple:
        return (self.q_heads, self.total_q)


# Shapes where Hq != Hkv (GQA, MQA).
GQA_SHAPES = (
    AttnShape(2, 63, 65, 4, 2, 48),  # odd, Sq < Sk
    AttnShape(1, 97, 61, 4, 1, 72),  # odd, Sq > Sk (causal leaves rows empty), MQA, D = 72
    AttnShape(1, 1, 77, 4, 2, 48),  # a single query
    AttnShape(1, 128, 128, 6, 2, 64),  # block aligned, group of 3
)

# Shapes where Hq == Hkv.
MHA_SHAPES = (
    AttnShape(2, 45, 45, 2, 2, 72, 40),  # odd, square, Dv != D
    AttnShape(1, 33, 1, 2, 2, 16),  # a single key, Sq > Sk
    AttnShape(2, 17, 130, 3, 3, 32),  # Sq << Sk
    AttnShape(1, 1, 1, 1, 1, 8),  # one query, one key
)

VARLEN_SHAPES = (
    VarlenShape((5, 0, 17, 1), (7, 0, 21, 4), 4, 2, 48),  # an empty sequence, GQA
    VarlenShape((13, 9, 0, 30), (13, 0, 11, 25), 2, 2, 72, 40),  # queries with no keys; Dv != D
    VarlenShape((31, 2), (3, 40), 4, 1, 32),  # MQA, Sq > Sk and Sq < Sk in one batch
)

# The conformance design's shapes (tests/attention/test_conformance.py), each run with every feature:
# two tiles or more on both axes for the interpreters (Triton's 16 x 16, Pallas' 32 x 16), then the
# degenerate ones.
INTERPRETER_SHAPES = (
    AttnShape(2, 37, 41, 4, 2, 32),  # GQA 4:2, odd, Sq < Sk, two batch rows
    AttnShape(1, 50, 35, 6, 2, 72, 40),  # groups of 3, Sq > Sk (causal leaves rows empty), D 72, Dv != D
    AttnShape(1, 64, 64, 2, 2, 64),  # MHA, square, whole tiles
    AttnShape(1, 1, 77, 4, 1, 48),  # a single query, MQA
    AttnShape(1, 33, 1, 2, 2, 16),  # a single key, Sq > Sk
    AttnShape(1, 1, 1, 1, 1, 8),  # one query, one key
    VarlenShape((5, 0, 17, 1), (7, 0, 21, 4), 4, 2, 48),  # an empty sequence, GQA
    VarlenShape((13, 2, 0, 30), (3, 0, 11, 40), 4, 1, 72, 40),  # queries with no keys, MQA, Dv != D
)

# The XLA backend's tiles reach 64 (`xla.MAX_BLOCK`): two of them on both axes.
XLA_SHAPES = (
    AttnShape(2, 97, 130, 4, 2, 48),  # GQA, odd, Sq < Sk
    AttnShape(1, 130, 80, 3, 3, 32, 16),  # MHA, Sq > Sk, Dv != D
)

WIDE_SHAPE = AttnShape(1, 20, 24, 2, 1, 320)
"""A head dim past the Triton kernels' 256: the triton platform refuses it, xla and pallas run it."""

# On the GPU host: shapes of several GPU tiles (64-128) per axis; 16-bit calls of the first two take the
# Hopper kernels (head dim 64 / 128, Sq = Sk) with more tiles than an H100 has SMs (persistent programs
# take several); head dims 96 to 256 run.
GPU_SHAPES = (
    AttnShape(4, 1024, 1024, 8, 2, 128),
    AttnShape(3, 768, 768, 12, 12, 64),
    AttnShape(1, 520, 700, 4, 1, 96),
    AttnShape(2, 257, 129, 4, 2, 192, 128),
    AttnShape(1, 300, 300, 2, 2, 256),
)

SHAPES = {s.id: s for s in GQA_SHAPES + MHA_SHAPES + VARLEN_SHAPES + INTERPRETER_SHAPES + XLA_SHAPES + GPU_SHAPES
          + (WIDE_SHAPE,)}
"""Every registered shape by id."""

DTYPE_IDS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""How a dtype reads in a test id (``B2-Sq63-Sk65-H4x2-D48-bf16``)."""


def rng_for(*parts) -> np.random.Generator:
    """A generator seeded from readable parts (a test id), the same on every run."""
    return np.random.default_rng(zlib.crc32("/".join(map(str, parts)).encode()))


def random_qkv(shape: AttnShape | VarlenShape, dtype: str, rng: np.random.Generator) -> dict:
    """Standard-normal ``query, key, value`` of ``shape`` in ``dtype``, as jax arrays by name."""
    return {
        name: jnp.asarray(rng.standard_normal(getattr(shape, name)), dtype=dtype)
        for name in ("query", "key", "value")
    }


def random_cotangents(shape: AttnShape | VarlenShape, dtype: str, rng: np.random.Generator):
    """``(d_out, d_lse)``: standard normal in ``dtype``, and float32 uniform in [0.5, 1.5].

    The lse cotangent is positive and away from 0. The gradient of a sink (or of a head's row of
    a param) sums ``p_sink · (d_lse - delta)`` over every query row; with random signs those
    terms cancel (by 400x in one registry case) and the float32 reduction error, relative to the
    small sum, exceeds any sensible tolerance. And for a query with a single visible key the lse
    path alone carries the gradient, which a near-zero draw would reduce to rounding noise.
    """
    d_out = jnp.asarray(rng.standard_normal(shape.out), dtype)
    d_lse = jnp.asarray(rng.uniform(0.5, 1.5, size=shape.lse), jnp.float32)
    return d_out, d_lse


def random_sinks(kind: str, q_heads: int, rng: np.random.Generator):
    """float32 ``softmax_aux`` of one of the three shapes of docs/DESIGN.md §3, around 1.0 so that the
    sinks take a visible share of the mass: ``"h"`` [Hq], ``"hn"`` [Hq, 2], ``"n"`` [Hq + 1]
    (shared by every head; one longer than Hq so that it cannot read as [Hq])."""
    shape = {"h": (q_heads,), "hn": (q_heads, 2), "n": (q_heads + 1,)}[kind]
    return jnp.asarray(rng.standard_normal(shape) + 1.0, jnp.float32)


def packed_segments(batch: int, length: int, rng) -> np.ndarray:
    """int32 [batch, length]: up to three contiguous segments, then -1 padding (when length > 1)."""
    ids = np.full((batch, length), -1, np.int32)
    for b in range(batch):
        pad = int(rng.integers(1, length // 6 + 2)) if length > 1 else 0
        n = length - pad
        cuts = np.arange(1, n)
        cuts = np.sort(rng.choice(cuts, size=min(2, n - 1), replace=False)) if n > 1 else []
        ids[b, :n] = np.searchsorted(cuts, np.arange(n), side="right")
    return ids


def random_mask(shape: tuple, rng) -> np.ndarray:
    """bool mask, True = visible; query 0 sees nothing and the last key is seen by nobody."""
    mask = rng.random(shape) < 0.75
    if shape[-2] > 1:
        mask[..., 0, :] = False
    if shape[-1] > 1:
        mask[..., -1] = False
    return mask
