"""Block sizes, warps and stages of the Triton attention kernels, per (arch, head dim, dtype, pass).

A heuristic table kept apart from the kernels, overridden by tuned entries (`ejgen tune`,
ejgen/runtime/attention/triton/tuning_cache.py) and by EJGEN_TRITON_CONFIG. The interpreter gets the smallest tiles `tl.dot`
allows, which keeps CPU runs fast and exercises many blocks on small shapes.
"""

from __future__ import annotations

import dataclasses

from ejgen.runtime.attention.triton import tuning_cache
from ejgen.runtime.core import settings, shared_memory


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # the loop's tiles through tensor descriptors (where the shapes allow)
    ws: bool = False  # forward only, with tma: warp-specialised key loop (num_warps is per warp group)
    merged: bool = False  # one loop over masked and unmasked blocks (the mask under a run-time branch)
    atomic: bool = False  # dkdv only: the dK/dV kernel also adds dQ into a float32 buffer (no dQ kernel;
    #                       float32 additions in run-time order: dQ is not bitwise reproducible)
    band: bool = False  # dkdv only, sliding windows: the dK/dV kernel also stores its dS tiles (the window's
    #                     band, input dtype), and dQ = dS @ K is one matmul per tile (no recomputed logits)

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {size}")


MAX_HEAD_DIM = 256  # the table's largest head dim: `choose` refuses larger ones

# The interpreter's tiles; it takes tensor descriptors, the one-loop form and the dS band wherever the
# GPU's table does (see `pick`), so that CI runs the path that runs on the GPU.
INTERPRET = KernelConfig(16, 16, 4, 1)

# (arch, pass) -> [(max head dim, 16-bit config, float32 config)], first match wins.
# D=128 bf16 rows: the best of benchmarks/tune_triton.py on an H200 (notes/perf.md, v2; forward v5:
# tensor descriptors, 555 against 492 TFLOP/s at S=16k).
_TABLE = {
    ("sm90", "fwd"): [
        (64, KernelConfig(128, 128, 8, 3), KernelConfig(64, 64, 4, 2)),
        (128, KernelConfig(128, 128, 8, 3, tma=True), KernelConfig(64, 32, 4, 2)),
        (256, KernelConfig(128, 64, 8, 2), KernelConfig(32, 32, 4, 1)),
    ],
    ("sm90", "dkdv"): [
        (64, KernelConfig(64, 128, 8, 3), KernelConfig(32, 64, 4, 2)),
        (128, KernelConfig(64, 128, 8, 3), KernelConfig(32, 32, 4, 1)),
        (256, KernelConfig(32, 64, 8, 1), KernelConfig(16, 32, 4, 1)),
    ],
    ("sm90", "dq"): [
        (64, KernelConfig(128, 64, 8, 3), KernelConfig(64, 32, 4, 2)),
        (128, KernelConfig(128, 64, 8, 3), KernelConfig(32, 32, 4, 1)),
        (256, KernelConfig(64, 32, 8, 1), KernelConfig(16, 32, 4, 1)),
    ],
}


SHARED_MEMORY = shared_memory.HOPPER
"""Shared memory of one Hopper (and Ampere sm_80: 163 KB, less than this; its table tiles are the same) thread
block: `fit_shared_memory` keeps a config's estimate under it."""


def shared_bytes(conf: KernelConfig, pass_: str, d: int, dv: int, item: int, bias: bool, mask: bool) -> int:
    """`shared_memory.estimate` of one pass at this config's tiles."""
    return shared_memory.estimate(pass_, conf.block_m, conf.block_n, conf.num_stages, d, dv, item, bias, mask)


def fit_shared_memory(conf: KernelConfig, pass_: str, d: int, dv: int, item: int, bias: bool,
                      mask: bool) -> KernelConfig:
    """The config, shrunk (`shared_memory.shrink`) where a streamed bias or dense-mask tile would take its kernel
    past `SHARED_MEMORY` (an H200 refused the 16-bit forward at 128x128, 3 stages, D 96 with both: 320 KB asked)."""
    if not (bias or mask):
        return conf
    return shared_memory.shrink(conf, "block_m" if pass_ == "dkdv" else "block_n",
                                lambda c: shared_bytes(c, pass_, d, dv, item, bias, mask) <= SHARED_MEMORY)


FLAGS = ("tma", "ws", "merged", "atomic", "band")  # KernelConfig's switches, in their text order


def parse(text: str) -> KernelConfig:
    """``"block_m,block_n,warps,stages[,tma][,ws][,merged][,atomic][,band]"`` -> KernelConfig (ValueError when malformed)."""
    fields = [x.strip() for x in text.split(",")]
    flags = set(fields[4:])
    if len(fields) < 4 or flags - set(FLAGS):
        raise ValueError(f"want block_m,block_n,warps,stages[,tma][,ws][,merged][,atomic][,band], got {text!r}")
    return KernelConfig(*(int(x) for x in fields[:4]), **{name: name in flags for name in FLAGS})


def text(conf: KernelConfig) -> str:
    """The inverse of `parse`."""
    flags = [name for name in FLAGS if getattr(conf, name)]
    return ",".join([str(conf.block_m), str(conf.block_n), str(conf.num_warps), str(conf.num_stages)] + flags)


# The configs `ejgen tune` sweeps and jax-triton's autotuner (EJGEN_TRITON_AUTOTUNE=1) chooses among.
CANDIDATES = {
    "sm90": {
        "fwd": ["128,128,8,3,tma", "128,128,8,3,tma,merged", "128,64,4,2,tma,merged", "64,64,4,3,tma,merged",
                "128,64,8,4,tma", "128,128,8,2,tma", "128,64,8,4", "128,128,8,3"],
        "dkdv": ["64,128,8,3", "64,128,8,3,merged", "64,128,8,3,tma", "64,128,8,2,tma", "32,128,8,3", "64,64,4,3"],
        "dq": ["128,64,8,3", "128,64,8,3,merged", "128,64,8,3,tma", "128,128,8,2", "64,64,4,2,merged", "64,64,4,3"],
    },
    "interpret": {
        "fwd": ["16,16,4,1", "16,16,4,1,tma,merged"],
        "dkdv": ["16,16,4,1", "16,32,4,1,tma,merged"],
        "dq": ["16,16,4,1,merged", "32,16,4,1,tma"],
    },
}


def pinned(pass_: str) -> bool:
    """Whether the triton_configs setting (EJGEN_TRITON_CONFIG) pins the pass's config (a pinned config's flags are the user's word)."""
    return _override(pass_) is not None


def _override(pass_: str) -> KernelConfig | None:
    """``EJGEN_TRITON_CONFIG="fwd=128,64,8,3;dkdv=32,128,4,3"`` pins configs (tuning, tests);
    ``fwd=128,128,4,2,tma,ws`` also turns on tensor descriptors and warp specialisation."""
    text = settings.current().triton_configs
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, values = item.partition("=")
        if name.strip() == pass_:
            try:
                return parse(values)
            except (TypeError, ValueError) as e:
                raise ValueError(f"EJGEN_TRITON_CONFIG: bad entry {item!r} "
                                 f"(want pass=block_m,block_n,warps,stages[,tma][,ws][,merged][,atomic][,band]): {e}")
    return None


# Where the loops are short or masked, other 16-bit configs measured better (notes/perf.md, v6-v7; H200):
# "window" (a sliding window) and "short" (causal up to 4k keys: a query block sees ~2k keys on
# average): forward 128x64 tiles with 4 warps fit two programs per SM (98 KB shared, <= 255
# registers), so one program's prologue and epilogue overlap the other's loop, and one merged loop
# pays one pipeline fill; dK/dV 64x64 w4 s2 likewise (99 KB: two per SM; per-kernel times under
# Nsight Compute, v7: window 1057 against 1182 us at 64x128 w8, 4k causal 1927 against 2023 us);
# dQ 64x64 w4 s2 for the window only (788 against 856 us; at 4k causal it is slower, 1580 against 1388).
# The dS band (`band`: dQ as one matmul per stored dS tile) for windows: its dQ kernel takes 385 against 795 us,
# storing the tiles costs the dK/dV kernel 1386 against 1060 us (Nsight Compute, v7), and in wall time, once the
# band was no longer zeroed per call, it wins (session 6, same-run sweep: window (16k, 1024) fwd+bwd 2.90 against
# 3.15 ms, cuDNN 2.89; (4k, 512) 1.80 against 2.05, cuDNN 1.92). Where the band would be wider than
# BAND_MAX_RATIO x the head dim (triton_attention), the dQ kernel recomputes dS instead.
# "causal" (longer): the merged loop at 128x128 (fewer registers than three loops).
# (arch, pass, loops) -> [(min head dim, max head dim, config)]
_SHORT_FWD = KernelConfig(128, 64, 4, 2, tma=True, merged=True)
_SHORT_DKDV = KernelConfig(64, 64, 4, 2, merged=True)
_WINDOW_DKDV = KernelConfig(64, 64, 4, 2, merged=True, band=True)
_SPECIAL = {
    ("sm90", "fwd", "window"): [(65, 128, _SHORT_FWD)],
    ("sm90", "fwd", "short"): [(65, 128, _SHORT_FWD)],
    ("sm90", "fwd", "causal"): [(65, 128, KernelConfig(128, 128, 8, 3, tma=True, merged=True))],
    ("sm90", "dkdv", "window"): [(65, 128, _WINDOW_DKDV)],
    ("sm90", "dkdv", "short"): [(65, 128, _SHORT_DKDV)],
    ("sm90", "dq", "window"): [(65, 128, KernelConfig(64, 64, 4, 2, merged=True))],
}


def loops(seq: int, causal: bool, window: bool) -> str:
    """How long and how masked the key loops are: 'window', 'short' (causal, up to 4k), 'causal' or 'full'."""
    if window:
        return "window"
    if causal and 0 < seq <= 4096:
        return "short"
    return "causal" if causal else "full"


def band_blocks(block_m: int, block_n: int, window_span: int, seq_k: int) -> int:
    """Key blocks a query block of block_m rows can visit under a window of left + right = window_span
    keys: its keys span block_m - 1 + window_span, two more blocks for the alignment of the ends, never
    more than the keys' blocks."""
    return min((block_m - 1 + window_span) // block_n + 2, max(-(-seq_k // block_n), 1))


def pick(arch: str, pass_: str, head_dim: int, dtype_bits: int, seq: int = 0, causal: bool = False,
         window: bool = False) -> KernelConfig:
    """The config of one kernel: pinned (EJGEN_TRITON_CONFIG), else tuned (`ejgen tune`'s cache),
    else the interpreter's, else the heuristic table."""
    pinned = _override(pass_)
    if pinned is not None:
        return pinned
    k = tuning_cache.key(arch, pass_, head_dim, dtype_bits, seq, causal, window)
    tuned = tuning_cache.lookup(k)
    if tuned is not None:  # "128,128,8,3,tma" (or [128, 128, 8, 3] from before the flags)
        try:
            return parse(tuned) if isinstance(tuned, str) else KernelConfig(*tuned)
        except (TypeError, ValueError) as e:
            raise RuntimeError(f"tuning cache {tuning_cache.path()}: bad entry {k!r}: {tuned!r} ({e}); "
                               f"delete it or re-run `ejgen tune`") from e
    if arch == "interpret":
        table_conf = pick("sm90", pass_, head_dim, dtype_bits, seq, causal, window)
        return dataclasses.replace(INTERPRET, tma=table_conf.tma, merged=table_conf.merged, band=table_conf.band)
    if dtype_bits <= 16:
        for lo, hi, conf in _SPECIAL.get((arch, pass_, loops(seq, causal, window)), ()):
            if lo <= head_dim <= hi:
                return conf
    table = _TABLE.get((arch, pass_)) or _TABLE[("sm90", pass_)]
    for max_dim, half, single in table:
        if head_dim <= max_dim:
            return half if dtype_bits <= 16 else single
    raise ValueError(f"head_dim {head_dim} is larger than the triton backend supports ({MAX_HEAD_DIM})")
