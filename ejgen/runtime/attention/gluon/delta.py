"""The Hopper backward's delta in one Triton launch (docs/DESIGN.md §6, the Hopper kernels: "delta rows"):
delta[b, h, s] = sum over d of dO[b, s, h, d] * O[b, s, h, d] in float32, minus d lse[b, h, s], the rows the backward
kernels read beside lse ([B, HQ, SEQ]), from O and dO in the caller's seq-major layout.

In XLA the same op (a multiply, a reduction and a transpose of the reduced rows) ran at 2.5 TB/s at 8k tokens with
16 heads on an H200 (26.0 us, session 35's trace; 4.1 TB/s at 32k). This kernel took 18.8 us there (3.6 TB/s) and
67.7 us at 32k (4.0 TB/s, session 36). A program reads BLOCK rows of one head of both tensors (two 16-byte loads a
thread a row segment) and writes its BLOCK deltas contiguously; the heads are the grid's fast axis, so the programs
in flight read neighbouring segments of the same rows.

Plain Triton, not Gluon: it runs in Triton's interpreter on the CPU (tests/attention/test_gluon_delta.py).
"""

import triton
import triton.language as tl

BLOCK = 64  # rows a program
WARPS = 4


@triton.jit
def delta_kernel(O, DO, DLSE, DELTA, ZEROS, SEQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                 D_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """DELTA float32 [B, H, SEQ] of O, DO [B, SEQ, H, D] (16-bit or float32) and DLSE float32 [B, H, SEQ]; program
    (b * H + h, row block). ZEROS: an output the kernel leaves alone, which the launch may have zeroed (jax-triton's
    memset before the kernel: ring attention's dQ accumulator, `ring.ZEROS_BY_DELTA`) or not (a placeholder)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D_PAD)
    rows = s < SEQ
    at = ((b * SEQ + s).to(tl.int64) * H + h) * D  # int64: B * SEQ * H * D may pass 2^31
    inside = rows[:, None] & (d < D)[None, :]
    o = tl.load(O + at[:, None] + d[None, :], mask=inside, other=0.0).to(tl.float32)
    do = tl.load(DO + at[:, None] + d[None, :], mask=inside, other=0.0).to(tl.float32)
    row = bh.to(tl.int64) * SEQ + s
    d_lse = tl.load(DLSE + row, mask=rows, other=0.0)
    tl.store(DELTA + row, tl.sum(o * do, axis=1) - d_lse, mask=rows)
