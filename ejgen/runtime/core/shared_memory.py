"""Shared memory of the GPU attention kernels (Triton's and Pallas' alike): an estimate per kernel and the
rule that shrinks a tile config until it fits one Hopper thread block."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ejgen.runtime.core import sizes

HOPPER = 227 * 1024
"""Shared memory of one Hopper thread block (an H200 refused 320 KB)."""


def estimate(kernel: str, rows: int, cols: int, stages: int, d: int, dv: int, item: int, bias: bool,
             mask: bool) -> int:
    """An upper estimate of one kernel's shared memory ("fwd", "dkdv" or "dq", tiles of ``rows`` queries and
    ``cols`` keys): its loop's tiles per step (K and V in the forward and dQ kernels, Q and dO in the dK/dV
    kernel), a bias (counted as float32) and a dense-mask (int8) tile of [rows, cols] per step when the call
    streams them, all once per pipeline stage; plus the tiles that stay (Q; K and V; Q and dO)."""
    dp, dvp = sizes.pow2(d), sizes.pow2(dv)
    streamed = rows * cols * ((4 if bias else 0) + (1 if mask else 0))
    if kernel == "dkdv":
        step, resident = rows * (dp + dvp) * item, cols * (dp + dvp) * item
    else:
        step = cols * (dp + dvp) * item
        resident = rows * (dp + (dvp if kernel == "dq" else 0)) * item
    return max(stages, 1) * (step + streamed) + resident


def shrink(conf, loop: str, fits: Callable) -> object:
    """``conf`` (a dataclass with ``num_stages`` and the loop's block field ``loop``) shrunk until ``fits(conf)``:
    fewer stages first (down to two), then a halved loop block (not below 32), then one stage."""
    while not fits(conf):
        if conf.num_stages > 2:
            conf = dataclasses.replace(conf, num_stages=conf.num_stages - 1)
        elif getattr(conf, loop) > 32:
            conf = dataclasses.replace(conf, **{loop: getattr(conf, loop) // 2})
        elif conf.num_stages > 1:
            conf = dataclasses.replace(conf, num_stages=1)
        else:
            break
    return conf
