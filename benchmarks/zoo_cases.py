"""The spec zoo's benchmark cases, shared by `benchmarks/zoo.py` (ejgen, JAX) and `benchmarks/flex_zoo.py`
(FlexAttention, torch): one table of variants with their options at benchmark size, the seeded inputs both sides
convert, and each case's share of visible (query, key) pairs. Plain Python and numpy only, so that either side's
process can import it without the other framework.

Sizes: bf16, B=1, S=8192, Hq = Hkv = 16, D=128 by default (`cases(seq, heads, dim, batch)` scales the options with
the sequence, so a short CPU check keeps every mask non-trivial). At S=8192 the options are:

| case | options | keys a query sees |
|---|---|---|
| causal (flash_attention) | the baseline: `flash_attention(causal=True)` | its prefix |
| causal (zoo spec) | `causal_attention` (causal compiled in) | its prefix |
| chunked local (Llama 4) | chunk 2048, causal within it | up to 2048 |
| dilated window | dilation 2, causal, window (2047, 0) | 1024 |
| T5 relative bias | bidirectional, learnable table [H, 32], max_distance 128 | all |
| NATTEN 1-D | kernel 511 | 511 |
| NATTEN 2-D | 64 x 128 grid (width 128), kernel 13 | 169 |
| StreamingLLM | 4 sink tokens + window 1024, causal | 1028 |
| gpt-oss sliding | causal, window 128 (compiled in), learned sinks | 128 |
| Gemma 2 global | causal, soft cap 50 (compiled in), no window | its prefix |
| Gemma 3 local | causal, window 1024 (compiled in), soft cap 50 passed | 1024 |
| PaliGemma prefix | 1024 image tokens (bidirectional), then causal | its prefix |
| ALiBi | causal, fixed slopes, num_heads 16 | its prefix |
| sliding tile (video) | 128-token tiles, 4 x 4 tiles a frame, 4 frames, radii 1 | up to 27 tiles |
| sliding window | causal, (1023, 0) | 1024 |
| documents | 8 documents of seeded lengths (`document_ids` of benchmarks/blocksparse.py), causal | its document |
| Flamingo cross | 32 images x 256 tokens as keys; latest image per text token | 256 (none before image 0) |
| prefix LM | prefix_len 2048 | the first 2048 and its prefix |

A window "of N tokens" is `(N - 1, 0)`: the query and the N - 1 keys before it (Gemma 3's and gpt-oss's specs
compile theirs in that way). The Gemma cases scale q by 4 (`q_scale`): logits of standard deviation about 4
reach 15-20, where a cap of 50 bends them, so the two sides' outputs differ if one of them drops the cap.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

SEQ, HEADS, DIM, BATCH = 8192, 16, 128, 1
CHECK_ROWS = 32  # rows of the output slice each side saves for the cross-check


@dataclasses.dataclass
class Case:
    """One row of the zoo's table.

    key: short id (the `--cases` filter, the check files' keys); label: the row's name in the table.
    op: the ejgen op, "zoo:<name>" (`ejgen.zoo`), "generated:<name>" (`ejgen.generated`) or "ops:flash_attention".
    kwargs: the ejgen op's keyword arguments at this size (options and runtime features; plain Python values).
    compiled: what the spec compiles in (causal, window, soft cap, sinks): the FlexAttention side needs it too.
    arrays: extra inputs by the ejgen op's argument name (numpy): params, sinks, segment ids.
    learnable: the names in `arrays` that get gradients (fwd+bwd differentiates them with q, k, v).
    mask: numpy predicate (q_idx [n, 1], kv_idx [1, Sk]) -> bool [n, Sk], the pairs a query sees; None: all.
    q_scale: q is multiplied by it (larger logits where a soft cap must matter).
    """
    key: str
    label: str
    op: str
    kwargs: dict
    compiled: dict
    arrays: dict
    learnable: tuple
    mask: Callable | None
    q_scale: float = 1.0
    note: str = ""
    seq: int = SEQ
    heads: int = HEADS
    dim: int = DIM
    batch: int = BATCH

    def describe(self) -> dict:
        """The case as JSON: options, compiled-in features, array shapes."""
        return dict(key=self.key, label=self.label, op=self.op, kwargs=self.kwargs, compiled=self.compiled,
                    arrays={n: [str(a.dtype), list(a.shape)] for n, a in self.arrays.items()},
                    learnable=list(self.learnable), q_scale=self.q_scale, note=self.note, seq=self.seq,
                    heads=self.heads, dim=self.dim, batch=self.batch)


def document_ids(tokens: int, docs: int, seed: int = 0) -> np.ndarray:
    """int32 [1, tokens]: `docs` contiguous documents of random lengths; the rule (and seed) of
    benchmarks/blocksparse.py's `document_ids`, so the documents and their figures agree with that benchmark."""
    rng = np.random.default_rng(seed + tokens + docs)
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=docs - 1, replace=False))
    return np.searchsorted(cuts, np.arange(tokens), side="right").astype(np.int32)[None]


def latest_image(tokens: int, images: int, seed: int = 0) -> np.ndarray:
    """int32 [1, tokens]: Flamingo's latest[] — for each text token the number of the last image placed at or before
    it in the interleaved text (nondecreasing), -1 before the first image. The first image comes after a short
    prompt (tokens // 512 tokens, at least 2); the other images at seeded random positions after it."""
    rng = np.random.default_rng(seed + tokens + images)
    first = max(tokens // 512, 2)
    starts = np.concatenate([[first], np.sort(rng.choice(np.arange(first + 1, tokens), images - 1, replace=False))])
    return (np.searchsorted(starts, np.arange(tokens), side="right") - 1).astype(np.int32)[None]


def _clamp(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


def cases(seq: int = SEQ, heads: int = HEADS, dim: int = DIM, batch: int = BATCH, seed: int = 0) -> list[Case]:
    """Every case at this size. Lengths scale with `seq` (the figures of the module docstring at 8192); `seq` must
    be a multiple of 256 (tiles, grids and images divide it)."""
    if seq % 256:
        raise ValueError(f"seq must be a multiple of 256, got {seq}")
    rng = np.random.default_rng(seed + 1)
    table = (0.5 * rng.standard_normal((heads, 32))).astype(np.float32)  # T5: one bias per head and bucket
    sinks = rng.standard_normal(heads).astype(np.float32)  # gpt-oss: one sink logit per head
    ids = np.repeat(document_ids(seq, 8), batch, axis=0)
    images, image_tokens = 32, seq // 32
    latest = np.repeat(latest_image(seq, images, seed), batch, axis=0)
    chunk, window, prefix = seq // 4, seq // 8, seq // 4
    kernel_1d = seq // 16 - 1  # odd: the query in the middle
    width = 2 ** round(float(np.log2(np.sqrt(2 * seq))))  # 128 at 8192: a 64 x 128 grid
    rows = seq // width
    kernel_2d = min(13, (min(rows, width) // 4) | 1)
    tile = seq // 64  # 4 frames of 4 x 4 tiles
    out = []

    def add(key, label, op, kwargs=None, compiled=None, arrays=None, learnable=(), mask=None, **kw):
        out.append(Case(key, label, op, kwargs or {}, compiled or {}, arrays or {}, learnable, mask, seq=seq,
                        heads=heads, dim=dim, batch=batch, **kw))

    def causal(q, kv):
        return kv <= q
    add("causal", "causal (flash_attention)", "ops:flash_attention", {"causal": True}, mask=causal,
        note="the baseline: ejgen's plain causal kernel")
    add("causal_zoo", "causal (zoo spec)", "zoo:causal_attention", compiled={"causal": True}, mask=causal)
    add("chunked", "chunked local (Llama 4)", "zoo:chunked_local_attention", {"chunk": chunk},
        {"causal": True}, mask=lambda q, kv: (kv <= q) & (q // chunk == kv // chunk))
    add("dilated", "dilated window", "zoo:dilated_window_attention",
        {"dilation": 2, "causal": True, "sliding_window": (seq // 4 - 1, 0)},
        mask=lambda q, kv: (kv <= q) & (q - kv <= seq // 4 - 1) & ((q - kv) % 2 == 0))
    add("t5", "T5 relative bias", "zoo:t5_relative_attention", {"max_distance": 128}, arrays={"table": table},
        learnable=("table",), note="bidirectional (an encoder's), the table learnable")
    add("natten1d", "NATTEN 1-D", "zoo:natten_1d_attention", {"kernel": kernel_1d},
        mask=lambda q, kv: ((kv >= _clamp(q - kernel_1d // 2, 0, seq - kernel_1d))
                            & (kv < _clamp(q - kernel_1d // 2, 0, seq - kernel_1d) + kernel_1d)))

    def natten_2d(q, kv):
        ok = True
        for qa, ka, n in ((q // width, kv // width, seq // width), (q % width, kv % width, width)):
            start = _clamp(qa - kernel_2d // 2, 0, n - kernel_2d)
            ok = ok & (ka >= start) & (ka < start + kernel_2d)
        return ok
    add("natten2d", "NATTEN 2-D", "zoo:natten_2d_attention", {"width": width, "kernel": kernel_2d}, mask=natten_2d,
        note=f"{rows} x {width} grid")
    add("streaming", "StreamingLLM (sinks + window)", "zoo:sink_window_attention",
        {"sink_tokens": 4, "window": window}, {"causal": True},
        mask=lambda q, kv: (kv <= q) & ((kv < 4) | (q - kv < window)))
    add("gpt_oss", "gpt-oss sliding + sinks", "zoo:gpt_oss_attention",
        compiled={"causal": True, "sliding_window": (127, 0), "sinks": True}, arrays={"softmax_aux": sinks},
        learnable=("softmax_aux",), mask=lambda q, kv: (kv <= q) & (q - kv <= 127))
    add("gemma2", "Gemma 2 global (soft cap)", "zoo:gemma2_attention",
        compiled={"causal": True, "logits_soft_cap": 50.0}, mask=causal, q_scale=4.0)
    add("gemma3", "Gemma 3 local (window + cap)", "zoo:gemma3_local_attention", {"logits_soft_cap": 50.0},
        {"causal": True, "sliding_window": (1023, 0)}, mask=lambda q, kv: (kv <= q) & (q - kv <= 1023), q_scale=4.0)
    add("paligemma", "PaliGemma prefix", "zoo:paligemma_prefix_attention", {"image_tokens": window},
        mask=lambda q, kv: (kv <= q) | ((q < window) & (kv < window)))
    add("alibi", "ALiBi (fixed slopes)", "zoo:alibi_fixed_attention", {"num_heads": heads, "causal": True},
        mask=causal)
    stride_f, stride_r = tile * 16, tile * 4

    def sliding_tile(q, kv):
        return ((np.abs(q // stride_f - kv // stride_f) <= 1)
                & (np.abs(q // stride_r % 4 - kv // stride_r % 4) <= 1)
                & (np.abs(q // tile % 4 - kv // tile % 4) <= 1))
    add("sliding_tile", "sliding tile (video)", "zoo:sliding_tile_attention",
        {"tile_tokens": tile, "grid_h": 4, "grid_w": 4, "radius_t": 1, "radius_h": 1, "radius_w": 1},
        mask=sliding_tile, note="4 frames of 4 x 4 tiles")
    add("sliding_window", "sliding window", "zoo:sliding_window_attention", {"sliding_window": (window - 1, 0)},
        {"causal": True}, mask=lambda q, kv: (kv <= q) & (q - kv <= window - 1))
    add("documents", "documents (8, causal)", "zoo:document_attention", compiled={"causal": True},
        arrays={"segment_ids": ids}, mask=lambda q, kv: (kv <= q) & (ids[0][q] == ids[0][kv]),
        note="ejgen: mask_info=MaskInfo.from_segments(segment_ids)")
    add("flamingo", "Flamingo cross-attention", "zoo:flamingo_cross_attention", {"image_tokens": image_tokens},
        arrays={"latest": latest}, mask=lambda q, kv: kv // image_tokens == latest[0][q],
        note=f"{images} images x {image_tokens} tokens as keys")
    add("prefix_lm", "prefix LM", "generated:prefix_lm_attention", {"prefix_len": prefix},
        mask=lambda q, kv: (kv <= q) | (kv < prefix))
    return out


def select(all_cases: list[Case], names: str | None) -> list[Case]:
    """The cases named in a comma-separated list: a name is a case's key, or else a part of keys or labels
    ("gemma" takes both Gemma cases); all cases for None / ""."""
    if not names:
        return all_cases
    wanted = [n.strip().lower() for n in names.split(",") if n.strip()]
    keys = {c.key for c in all_cases}

    def hit(c: Case, w: str) -> bool:
        return w == c.key if w in keys else (w in c.key or w in c.label.lower())
    return [c for c in all_cases if any(hit(c, w) for w in wanted)]


@functools.lru_cache(maxsize=4)
def _inputs(seq: int, heads: int, dim: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((batch, seq, heads, dim), dtype=np.float32) for _ in range(4))


def inputs(case: Case, seed: int = 0) -> dict:
    """Seeded float32 numpy arrays, layout [B, S, H, D] (torch transposes to [B, H, S, D]): q (times the case's
    q_scale), k, v and the cotangent `do` of the fwd+bwd pass; each side casts them to bf16 (both round to nearest
    even, so the two sides see the same bf16 inputs). The same data for every case of one size."""
    q, k, v, do = _inputs(case.seq, case.heads, case.dim, case.batch, seed)
    return dict(q=q * np.float32(case.q_scale) if case.q_scale != 1.0 else q, k=k, v=v, do=do)


def check_rows(seq: int) -> slice:
    """The query rows of the cross-check slice: CHECK_ROWS rows spread over the sequence."""
    return slice(0, seq, max(seq // CHECK_ROWS, 1))


def check_heads(heads: int) -> list[int]:
    """The heads of the cross-check slice: the first and the last (ALiBi's slopes and T5's table differ per head)."""
    return sorted({0, heads - 1})


@functools.lru_cache(maxsize=64)
def _visible(key: str, seq: int, heads: int, dim: int, batch: int) -> float:
    case = next(c for c in cases(seq, heads, dim, batch) if c.key == key)
    if case.mask is None:
        return 1.0
    kv = np.arange(seq)[None, :]
    total, step = 0, max(1, 2 ** 21 // seq)  # about 2M pairs a chunk
    for start in range(0, seq, step):
        q = np.arange(start, min(start + step, seq))[:, None]
        total += int(np.count_nonzero(case.mask(q, kv)))
    return total / float(seq) / float(seq)


def visible_fraction(case: Case) -> float:
    """The exact share of (query, key) pairs the case's mask lets through (rows in chunks: a second or so at 8192).
    Causal is (S + 1) / 2S, about 0.5; the report's ideal is the causal time x (fraction / 0.5)."""
    return _visible(case.key, case.seq, case.heads, case.dim, case.batch)


def order(key: str) -> int:
    """A case's place in the table (for sorting rows that merged runs wrote in another order)."""
    keys = [c.key for c in cases(256, 1, 8)]
    return keys.index(key) if key in keys else len(keys)


def previous(json_path, npz_path, meta: dict, rerun: list[Case]) -> tuple[list, dict]:
    """For `--merge`: the rows and check slices of an earlier run in the same files, less the cases about to run
    again, when that run had the same sizes and device (else nothing): a zoo split over several calls (a call per
    handful of cases, under a time limit) ends up in one file."""
    import json
    from pathlib import Path

    json_path, npz_path = Path(json_path), Path(npz_path)
    if not json_path.exists():
        return [], {}
    old = json.loads(json_path.read_text())
    if any(old.get(k) != meta.get(k) for k in ("seq", "heads", "dim", "device", "platform", "eager", "calls")):
        return [], {}
    again = {c.key for c in rerun}
    rows = [r for r in old.get("rows", []) if r["case"] not in again]
    checks = {}
    if npz_path.exists():
        checks = {n: a for n, a in np.load(npz_path).items() if n.split("/")[0] not in again}
    return rows, checks


if __name__ == "__main__":
    import time

    t0 = time.perf_counter()
    for c in cases():
        print(f"{c.key:15s} {c.label:32s} visible {visible_fraction(c):.4f}  {c.kwargs} {c.compiled}")
    print(f"{time.perf_counter() - t0:.1f} s")
