"""The packed documents' plan kernels (`ejgen.runtime.attention.gluon.plan`) in Triton's interpreter against the jnp
functions they replace (`gluon.host.segment_ranges`, `tile_order`, `bwd_order`): the same ranges and orders bit for
bit over documents with padding, one-token documents, several batch rows, odd lengths, scattered ids, causal or not,
both passes; and compiled for sm_90 by this Triton and the GPU host's."""

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

from ejgen.runtime.attention.config import AttentionConfig  # noqa: E402
from ejgen.runtime.attention.gluon import host as gluon_attention  # noqa: E402
from ejgen.runtime.launch import triton_call  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter():
    if triton_call.mode()[0] != "interpret":
        pytest.fail("the plan kernels run in Triton's interpreter here: TRITON_INTERPRET=1 (README)")


def _documents(rng, batch: int, seq: int, docs: int, pad: int) -> np.ndarray:
    """int32 [batch, seq]: ``docs`` contiguous documents of random lengths, the last ``pad`` tokens padding (-1)."""
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=docs - 1, replace=False))
        ids = np.searchsorted(cuts, np.arange(seq), side="right").astype(np.int32)
        ids[seq - pad:] = -1
        rows.append(ids)
    return np.stack(rows)


def _scattered(rng, batch: int, seq: int, run: int) -> np.ndarray:
    """int32 [batch, seq]: ids in {-1, 0, 1, 2} in runs of ``run`` tokens (full tiles broken and resumed), or of one."""
    return np.repeat(rng.integers(-1, 3, size=(batch, seq // run + 1)), run, axis=1)[:, :seq].astype(np.int32)


def _plans(ids: np.ndarray, causal: bool, heads: int, programs: int) -> list:
    seq = ids.shape[1]
    ctx = {"q_seg": jnp.asarray(ids), "kv_seg": jnp.asarray(ids)}
    cfg = AttentionConfig(seq_q=seq, seq_k=seq, causal=causal, segments=True)
    return [tuple(np.asarray(x) for x in gluon_attention.segment_plan(ctx, cfg, seq, pass_, heads, programs))
            for pass_ in ("fwd", "bwd")]


CASES = {  # name: (ids from a seeded generator, causal, heads, programs)
    "documents-padding-2-rows": (lambda r: _documents(r, 2, 1000, 5, 7), True, 4, 3),
    "one-token-documents": (lambda r: _documents(r, 1, 300, 300, 0), True, 2, 5),
    "8k-8-documents": (lambda r: _documents(r, 1, 8192, 8, 0), True, 16, 132),
    "not-causal-3-rows": (lambda r: _documents(r, 3, 777, 2, 100), False, 3, 4),
    "one-tile": (lambda r: _documents(r, 1, 64, 1, 0), True, 1, 1),
    "scattered-runs": (lambda r: _scattered(r, 2, 700, 50), True, 3, 4),
    "scattered-tokens": (lambda r: _scattered(r, 1, 260, 1), False, 2, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_kernels_give_what_jnp_gives(name, monkeypatch):
    make, causal, heads, programs = CASES[name]
    ids = make(np.random.default_rng(len(name)))
    monkeypatch.setattr(gluon_attention, "PLAN_KERNELS", True)
    kernels = _plans(ids, causal, heads, programs)
    monkeypatch.setattr(gluon_attention, "PLAN_KERNELS", False)
    reference = _plans(ids, causal, heads, programs)
    for pass_, (ranges, order), (want_ranges, want_order) in zip(("fwd", "bwd"), kernels, reference):
        np.testing.assert_array_equal(ranges, want_ranges, err_msg=f"{pass_} ranges")
        np.testing.assert_array_equal(order, want_order, err_msg=f"{pass_} order")
        assert sorted(order.tolist()) == list(range(order.size)), pass_  # a permutation of the tiles


def test_a_wrong_order_fails_the_comparison(monkeypatch):
    """The comparison above can fail: the plan's order with two places swapped is not jnp's."""
    ids = _documents(np.random.default_rng(0), 1, 1000, 5, 0)
    monkeypatch.setattr(gluon_attention, "PLAN_KERNELS", True)
    (_, order), _ = _plans(ids, True, 2, 3)
    monkeypatch.setattr(gluon_attention, "PLAN_KERNELS", False)
    (_, want), _ = _plans(ids, True, 2, 3)
    swapped = order.copy()
    swapped[[0, -1]] = swapped[[-1, 0]]
    assert np.array_equal(order, want) and not np.array_equal(swapped, want)


@pytest.mark.parametrize("gpu_host", [False, True], ids=["this-triton", "gpu-host-triton"])
def test_the_plan_kernels_compile_for_sm90(gpu_host):
    """Both passes' kernels at 32k tokens, 2 batch rows, compile for sm_90 with no spill and no global scratch."""
    from ejgen.testing.aot import compile_all_in_subprocess, gpu_host_triton

    (result,) = compile_all_in_subprocess([dict(plan=True, with_ptx=True)], gpu_host_triton() if gpu_host else None)
    assert "error" not in result, result.get("error")
    assert set(result) == {"ranges_fwd", "order_fwd", "ranges_bwd", "order_bwd"}
    for name, meta in result.items():
        assert meta["cubin"] and "ld.local" not in meta["ptx"] and meta["global_scratch"] == 0, name
