"""The Hopper forward's DOCS form (`gluon.kernels._block_softmax`, segment ids under causal alone): a masked block
compares the ids (padding rows INT_MIN, padding keys and keys past the end INT_MIN + 1) and the causal bound only
where the block reaches past the half's first row. Checked here against the element rule, in numpy, over every
(64-row half, visited block) of random ids: contiguous documents, documents then padding, arbitrary ids."""

import numpy as np
import pytest

from ejgen.runtime.attention.gluon import host as gluon_attention
from ejgen.runtime.attention.config import AttentionConfig

INT_MIN = -2**31


def _visited(ranges, S, i, BM, BN):
    """`kernels._tile_blocks` for causal: (lo, hi, f0, f1) of query tile i."""
    lo_s, hi_s, flo, fhi = ranges[i]
    hi_c = min((i * BM + BM + BN - 1) // BN, -(-S // BN))
    fe = min(S // BN, (i * BM + 1) // BN)
    lo = max(0, lo_s)
    hi = max(min(hi_c, hi_s), lo + 1)
    return lo, hi, max(0, flo), min(max(0, min(fe, hi_c)), fhi)


@pytest.mark.parametrize("kind", ["documents", "padding", "arbitrary"])
def test_the_docs_form_keeps_what_the_element_rule_keeps(kind):
    import jax.numpy as jnp

    rng = np.random.default_rng(len(kind))
    BM, BN, R = gluon_attention.BLOCK_M, gluon_attention.TILES["BLOCK_N"], gluon_attention.BLOCK_M // 2
    for S in (1000, 1024, 1536, 2000):
        if kind == "arbitrary":
            ids = rng.integers(-2, 4, S)
        else:
            cuts = np.sort(rng.choice(np.arange(1, S), size=int(rng.integers(1, 12)), replace=False))
            ids = np.searchsorted(cuts, np.arange(S), side="right")
            if kind == "padding":
                ids[S - int(rng.integers(1, 300)):] = -1
        cfg = AttentionConfig(seq_q=S, seq_k=S, causal=True, segments=True)
        seg = jnp.asarray(ids[None], jnp.int32)
        ranges = np.asarray(gluon_attention.segment_ranges({"q_seg": seg, "kv_seg": seg}, cfg, S, "fwd"))[0]
        keys = np.full(-(-S // BN) * BN, INT_MIN + 1)
        keys[:S] = np.where(ids < 0, INT_MIN + 1, ids)
        for i in range(-(-S // BM)):
            lo, hi, f0, f1 = _visited(ranges, S, i, BM, BN)
            for r0 in (i * BM, i * BM + R):
                rows = np.arange(r0, r0 + R)
                real = rows < S
                q = np.where(real, ids[np.minimum(rows, S - 1)], -1)
                qs = np.where(q < 0, INT_MIN, q)
                for j in range(lo, hi):
                    cols = j * BN + np.arange(BN)
                    ids_k = np.where(cols < S, ids[np.minimum(cols, S - 1)], -3)
                    truth = (cols[None] <= rows[:, None]) & (cols[None] < S) & (q[:, None] == ids_k[None]) \
                        & (q[:, None] >= 0)
                    if f0 <= j < f1:  # unmasked: every pair of the real rows visible
                        assert truth[real].all(), (S, i, r0, j)
                        continue
                    keep = qs[:, None] == keys[cols][None]
                    if (j + 1) * BN > r0 + 1:
                        keep &= cols[None] <= rows[:, None]
                    assert (keep[real] == truth[real]).all(), (kind, S, i, r0, j)
