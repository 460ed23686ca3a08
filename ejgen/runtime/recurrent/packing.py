"""Where each step of a call sits in the chunked kernels' layout (docs/DESIGN.md §3 linear recurrent), shared by
the backends.

Dense calls are B rows of T steps: a row is cut into ceil(T / C) chunks, the last one padded. Packed calls
(``cu_seqlens``, batch 1) are laid out chunk-aligned: sequence n starts at a chunk of its own and takes
ceil(len_n / C) chunks, so no chunk holds two sequences and the kernels need no element mask across sequences; the
layout has at most (T + N (C - 1)) // C chunks (a static bound: the chunks past the last sequence's belong to no
sequence). ``reverse`` places step t of a sequence of length L at position L - 1 - t, so every kernel runs forward
in time. Padded positions hold zeros: k = v = 0 adds nothing to the state and a zero log gate keeps it, so the state
after a sequence's last chunk is its final state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def n_chunks(cfg, chunk: int) -> int:
    """Chunks of the layout: per row for dense calls, in all for packed ones (the static bound)."""
    if cfg.varlen:
        return max(1, (cfg.seq_len + cfg.n_seqs * (chunk - 1)) // chunk)
    return max(1, cdiv(cfg.seq_len, chunk))


@dataclasses.dataclass(frozen=True)
class Packed:
    """A packed call's layout in chunks of ``chunk`` steps (traced int32 arrays, sizes static)."""

    chunk: int
    n_chunks: int  # NC: the static bound
    pos: jax.Array  # [T]: each token's row in the layout [NC * C] (NC * C for tokens past the last sequence)
    chunk_seq: jax.Array  # [NC]: the sequence a chunk belongs to (clipped into [0, N); see chunk_real)
    chunk_first: jax.Array  # [NC] bool: the first chunk of its sequence (the state starts from its h0)
    chunk_last: jax.Array  # [NC] bool: the last chunk of its sequence (the state after it is the final one)
    seq_chunks: jax.Array  # [N + 1]: the first chunk of each sequence (a cumulative count)


def packed(cu, cfg, chunk: int) -> Packed:
    n, tokens = cfg.n_seqs, cfg.seq_len
    nc = n_chunks(cfg, chunk)
    lens = cu[1:] - cu[:-1]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lens + chunk - 1) // chunk)]).astype(jnp.int32)
    t = jnp.arange(tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, n - 1)
    i = t - cu[seq]
    if cfg.reverse:
        i = lens[seq] - 1 - i
    pos = jnp.where(t < cu[n], offsets[seq] * chunk + i, nc * chunk)
    c = jnp.arange(nc, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(offsets, c, side="right").astype(jnp.int32) - 1, 0, n - 1)
    real = c < offsets[n]
    return Packed(chunk, nc, pos, owner, real & (c == offsets[owner]), real & (c == offsets[owner + 1] - 1), offsets)


def to_layout(x, cfg, chunk: int, layout: Packed | None):
    """x [B, T, ...] -> [B, NC * C, ...] (dense) or [1, NC * C, ...] (packed), steps in the order they run."""
    if layout is None:
        if cfg.reverse:
            x = jnp.flip(x, axis=1)
        pad = n_chunks(cfg, chunk) * chunk - cfg.seq_len
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    out = jnp.zeros((1, layout.n_chunks * chunk) + x.shape[2:], x.dtype)
    return out.at[0, layout.pos].set(x[0], mode="drop")


def from_layout(y, cfg, layout: Packed | None):
    """The inverse of ``to_layout`` for an output [B, NC * C, ...]: [B, T, ...] (0 for tokens of no sequence)."""
    if layout is None:
        y = y[:, :cfg.seq_len]
        return jnp.flip(y, axis=1) if cfg.reverse else y
    return y[0].at[layout.pos].get(mode="fill", fill_value=0)[None]
