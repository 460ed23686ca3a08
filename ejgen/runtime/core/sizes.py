"""Sizes of tiles and pads, shared by every family's hosts (one rule each)."""

from __future__ import annotations


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= n, and >= ``least`` (a power of two: a tile's floor, 16 for the tensor cores)."""
    return max(least, 1 << max(int(n) - 1, 0).bit_length())
