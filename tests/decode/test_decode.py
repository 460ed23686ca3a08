"""Decode and paged decode (docs/DESIGN.md §3, "Decode and paged modes") against an oracle derived from the train
oracle: a decode call is train-mode attention over each whole sequence (its keys ``start <= j < end`` of the cache
row), of which the last Sq query rows are kept. Flash spec (GQA 1/4/8, window, soft cap, sinks, empty and
one-token sequences, Sq = 1 and Sq > 1 with sequences shorter than Sq), authored specs with params, options and a
mask (alibi, prefix-LM), paged caches with shuffled and shared pages and lengths that end inside a page; errors.
XLA, the split-K Triton kernel (its interpreter here) and the Pallas kernels, GPU (``pallas``) and TPU
(``pallas-tpu``), interpreted here and lowered for CUDA and TPU."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from conftest import on_path
from ejgen.runtime.attention.pallas import common as pallas_common
from ejgen.testing.shapes import rng_for

pytestmark = pytest.mark.usefixtures("x64_stays_off")


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    seq: int  # the cache row's length
    q_heads: int
    kv_heads: int
    queries: int = 0  # 0: query [B, Hq, D]; else [B, queries, Hq, D]
    dim: int = 16
    window: tuple | None = None
    softcap: float | None = None
    sinks: bool = False
    dtype: str = "float32"

    @property
    def id(self) -> str:
        parts = [f"B{self.batch}", f"S{self.seq}", f"H{self.q_heads}x{self.kv_heads}", f"Sq{self.queries or 1}"]
        parts += [f"w{self.window}"] if self.window else []
        parts += [f"cap{self.softcap:g}"] if self.softcap else []
        parts += ["sinks"] if self.sinks else []
        return "-".join(parts + [self.dtype]).replace(" ", "")


def _ranges(batch, seq, rng):
    """(starts, ends): an empty sequence, a one-token one, one filling the row, the rest random."""
    starts, ends = [], []
    for b in range(batch):
        kind = b % 4
        if kind == 0:
            s, e = 3, 3
        elif kind == 1:
            s = int(rng.integers(0, seq)); e = s + 1
        elif kind == 2:
            s, e = 0, seq
        else:
            s = int(rng.integers(0, seq // 2)); e = int(rng.integers(s + 1, seq + 1))
        starts.append(s), ends.append(e)
    return np.asarray(starts, np.int32), np.asarray(ends, np.int32)


def reference(q, k, v, starts, ends, *, causal=True, sliding_window=None, logits_soft_cap=None, softmax_aux=None,
              score=None, mask=None, params=None, options=None):
    """out [B, Sq, Hq, Dv], lse [B, Hq, Sq] (float64) from the train oracle, one sequence at a time: the query rows
    placed at the sequence's last Sq positions of an otherwise zero query; rows before position 0 see nothing."""
    batch, sq, hq, d = q.shape
    out = np.zeros((batch, sq, hq, v.shape[-1]))
    lse = np.full((batch, hq, sq), -np.inf)
    for b in range(batch):
        length = int(ends[b] - starts[b])
        if length == 0:
            if softmax_aux is not None:  # nothing visible: the sinks alone (one per head here)
                lse[b] = np.log(np.exp(np.asarray(softmax_aux, np.float64).reshape(hq, -1)).sum(-1))[:, None]
            continue
        full_q = np.zeros((1, length, hq, d), np.float32)
        take = min(sq, length)
        full_q[0, length - take:] = np.asarray(q[b, sq - take:], np.float32)
        kb = np.asarray(k[b, starts[b]:ends[b]], np.float32)[None]
        vb = np.asarray(v[b, starts[b]:ends[b]], np.float32)[None]
        ref = oracle.attention(full_q, kb, vb, causal=causal, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, score=score, mask=mask,
                               params=params, options=options)
        out[b, sq - take:] = ref.out[0, length - take:]
        lse[b, :, sq - take:] = ref.lse[0, :, length - take:]
        if softmax_aux is not None and take < sq:  # rows before the sequence: the sinks alone
            aux = np.asarray(softmax_aux, np.float64).reshape(hq, -1)
            lse[b, :, : sq - take] = np.log(np.exp(aux).sum(-1))[:, None]
    return out, lse


def _inputs(case: DecodeCase, rng):
    qshape = (case.batch, case.queries or 1, case.q_heads, case.dim)
    q = rng.standard_normal(qshape).astype(np.float32)
    k = rng.standard_normal((case.batch, case.seq, case.kv_heads, case.dim)).astype(np.float32)
    v = rng.standard_normal((case.batch, case.seq, case.kv_heads, case.dim)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, case.dtype)  # noqa: E731
    q, k, v = cast(q), cast(k), cast(v)
    return q, k, v


def _check(out, lse, ref_out, ref_lse, dtype):
    tol = oracle.tolerance(dtype)
    oracle.assert_close("out", out, ref_out, tol)
    oracle.assert_close("lse", lse, ref_lse, 1e-5)


CASES = [
    DecodeCase(4, 37, 4, 4),
    DecodeCase(4, 37, 8, 2, queries=3),
    DecodeCase(5, 50, 6, 2, window=(9, 0), softcap=5.0),  # GQA 3: not a power of two
    DecodeCase(2, 40, 8, 1, queries=2, dim=24),  # GQA 8, a head dim that is not a power of two
    DecodeCase(4, 29, 4, 2, queries=5, sinks=True),
    DecodeCase(4, 64, 8, 2, queries=2, window=(20, 0), dtype="bfloat16"),
]


DECODE_BACKENDS = ["xla", "triton", "pallas", "pallas-tpu"]
"""``pallas``: the Pallas GPU kernels (interpreted here); ``pallas-tpu``: the Pallas TPU kernels (interpreted)."""
TPU_CASES = CASES[2:]
"""The flash cases the TPU kernels run here (GQA 3 with a window and a soft cap, GQA 8 at D 24, sinks at Sq 5,
bf16): each of their paths at the interpreter's cost; every case runs on the other backends."""


def _on(backend: str):
    """(platform, a context factory) of a backend id: the TPU kernels are platform pallas's under
    `interpret_kernels("tpu")`."""
    if backend == "pallas-tpu":
        return "pallas", lambda: pallas_common.interpret_kernels("tpu")
    return backend, contextlib.nullcontext


@pytest.mark.parametrize("case, backend", [(c, b) for b in DECODE_BACKENDS for c in CASES
                                           if b != "pallas-tpu" or c in TPU_CASES],
                         ids=lambda x: x if isinstance(x, str) else x.id)
def test_flash_decode_matches_the_train_oracle(case, backend):
    from ejgen.ops import ragged_decode_attention

    rng = rng_for("decode", case.id)
    q, k, v = _inputs(case, rng)
    starts, ends = _ranges(case.batch, case.seq, rng)
    aux = jnp.asarray(rng.standard_normal(case.q_heads), jnp.float32) if case.sinks else None
    query = q if case.queries else q[:, 0]
    platform, context = _on(backend)
    with context():
        out, lse = jax.jit(lambda q, k, v, s, e: ragged_decode_attention(
            q, k, v, s, e, sliding_window=case.window, logits_soft_cap=case.softcap, softmax_aux=aux,
            return_lse=True, platform=platform))(query, k, v, starts, ends)
    ref_out, ref_lse = reference(q, k, v, starts, ends, sliding_window=case.window, logits_soft_cap=case.softcap,
                                 softmax_aux=None if aux is None else np.asarray(aux))
    if not case.queries:
        ref_out, ref_lse = ref_out[:, 0], ref_lse[..., 0]
    assert out.dtype == jnp.dtype(case.dtype) and lse.dtype == jnp.float32
    _check(out, lse, ref_out, ref_lse, case.dtype)
    empty = np.asarray(ends == starts)
    assert np.all(np.asarray(out, np.float32)[empty] == 0.0), "an empty sequence gives zeros"


PAGED_CASES = [(page, backend, False, True) for backend in DECODE_BACKENDS for page in (4, 12, 32)] + [
    (12, "triton", True, True), (32, "triton", False, False)]
"""(page, backend, the Triton kernel's PAGES_AHEAD (off by default), its WHOLE_PAGE (on)): its pages smaller than the
key block read in the loop either way, pages of whole blocks read once a block or per key."""


@pytest.mark.parametrize("page, backend, ahead, whole", PAGED_CASES)
def test_paged_decode_reads_the_pages_through_the_table(page, backend, ahead, whole, monkeypatch):
    """Pages shuffled in the pool, two sequences sharing their first pages (a common prefix), lengths that end
    inside a page, an empty sequence, a window that skips pages; equal to ragged decode on the same tokens laid out
    in order. Pages of 4 and 12 (not a power of two) are smaller than the Triton kernel's key block (each block reads
    its own page numbers, or with ``ahead`` the next block's a step ahead), 32 and 64 multiples of it (its page number
    read once a block, or without ``whole`` per key as smaller pages are)."""
    from ejgen.ops import page_attention, ragged_decode_attention
    from ejgen.runtime.attention.triton import decode as triton_decode

    monkeypatch.setattr(triton_decode, "PAGES_AHEAD", ahead)
    monkeypatch.setattr(triton_decode, "WHOLE_PAGE", whole)

    rng = rng_for("paged", page)
    batch, hq, hkv, d, max_pages = 4, 8, 2, 16, 6
    lens = np.asarray([0, 3 * page + 1, 6 * page, 2 * page - 1], np.int32)
    n_pages = 24
    k_cache = jnp.asarray(rng.standard_normal((n_pages, page, hkv, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((n_pages, page, hkv, d)), jnp.float32)
    tables = rng.permutation(n_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    tables[2, :2] = tables[1, :2]  # sequences 1 and 2 share their first two pages
    q = jnp.asarray(rng.standard_normal((batch, 1, hq, d)), jnp.float32)
    window = (40, 0)  # page 32: the longest sequence skips whole pages before its window
    platform, context = _on(backend)
    with context():
        out, lse = page_attention(q, k_cache, v_cache, lens, tables, logits_soft_cap=4.0, sliding_window=window,
                                  return_lse=True, platform=platform)
    keys = np.asarray(k_cache)[tables].reshape(batch, max_pages * page, hkv, d)
    values = np.asarray(v_cache)[tables].reshape(batch, max_pages * page, hkv, d)
    ref_out, ref_lse = reference(np.asarray(q), keys, values, np.zeros(batch, np.int32), lens, logits_soft_cap=4.0,
                                 sliding_window=window)
    assert out.shape == (batch, 1, hq, d) and lse.shape == (batch, hq, 1)
    _check(out, lse, ref_out, ref_lse, "float32")
    direct = ragged_decode_attention(q[:, 0], jnp.asarray(keys), jnp.asarray(values), np.zeros(batch, np.int32),
                                     lens, logits_soft_cap=4.0, sliding_window=window)
    np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(direct), atol=1e-6)


@pytest.mark.parametrize("backend", [b for b in DECODE_BACKENDS if b != "xla"])
def test_paged_decode_clamps_tables_and_lengths_as_xla_does(backend):
    """Page numbers outside the pool (negative, past its end: in the pages a sequence reads and past them) and lengths
    outside [0, capacity] are clamped on every backend alike (the Triton kernel clamps them where it reads them): the
    backend's output and lse equal the XLA backend's on the same call."""
    from ejgen.ops import page_attention

    rng = rng_for("paged-clamp", 0)
    batch, hq, hkv, d, page, max_pages, n_pages = 4, 4, 2, 16, 8, 4, 10
    k_cache = jnp.asarray(rng.standard_normal((n_pages, page, hkv, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((n_pages, page, hkv, d)), jnp.float32)
    tables = rng.integers(0, n_pages, (batch, max_pages)).astype(np.int32)
    tables[0, 1], tables[1, 0], tables[1, 3], tables[3, 2] = -7, n_pages + 5, 2**31 - 1, -(2**31)
    lens = np.asarray([3 * page - 2, 99 * page, -5, 4 * page], np.int32)  # (past the capacity, negative)
    q = jnp.asarray(rng.standard_normal((batch, 1, hq, d)), jnp.float32)
    platform, context = _on(backend)
    with context():
        out, lse = page_attention(q, k_cache, v_cache, lens, tables, return_lse=True, platform=platform)
    ref_out, ref_lse = page_attention(q, k_cache, v_cache, lens, tables, return_lse=True, platform="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5)
    assert np.all(np.asarray(out)[2] == 0.0), "a negative length is an empty sequence"


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
@pytest.mark.parametrize("variant", ["alibi_attention", "prefix_lm_attention"])
def test_authored_specs_decode_with_their_params_and_masks(variant, backend):
    """The spec's score (alibi: learnable slopes, an option) and mask (prefix-LM: an option) at positions in the
    sequence (a sequence starting inside the cache row reads the same as one at its start)."""
    import importlib

    gen = importlib.import_module("ejgen.generated")
    rng = rng_for("decode-variant", variant)
    case = DecodeCase(4, 33, 4, 2, queries=2)
    q, k, v = _inputs(case, rng)
    starts, ends = _ranges(case.batch, case.seq, rng)
    spec = oracle.VARIANTS[variant]
    if variant == "alibi_attention":
        kwargs = {"slopes": jnp.asarray(rng.uniform(0.05, 0.5, case.q_heads), jnp.float32), "max_distance": 7}
        params, options = {"slopes": kwargs["slopes"]}, {"max_distance": 7}
    else:
        kwargs, params, options = {"prefix_len": 4}, {}, {"prefix_len": 4}
    platform, context = _on(backend)
    with context():
        out, lse = getattr(gen, f"{variant}_decode")(q, k, v, starts, ends, return_lse=True, platform=platform,
                                                     **kwargs)
    causal = variant == "alibi_attention"
    ref_out, ref_lse = reference(q, k, v, starts, ends, causal=causal, score=spec.get("score"),
                                 mask=spec.get("mask"), params=params, options=options)
    _check(out, lse, ref_out, ref_lse, "float32")
    paged = getattr(gen, f"{variant}_paged")
    pages = k.reshape(case.batch * case.seq, 1, case.kv_heads, case.dim)  # page size 1: a token per page
    tables = (np.arange(case.batch)[:, None] * case.seq + starts[:, None] + np.arange(case.seq)[None]).clip(
        0, case.batch * case.seq - 1).astype(np.int32)
    with context():
        out_p = paged(q, pages, v.reshape(pages.shape), ends - starts, tables, platform=platform, **kwargs)
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out), atol=1e-5)


def test_decode_errors_name_the_problem():
    from ejgen.ops import ragged_decode_attention
    from ejgen.types import MaskInfo

    q = jnp.zeros((2, 4, 16))
    k = jnp.zeros((2, 10, 2, 16))
    s, e = jnp.zeros(2, jnp.int32), jnp.full(2, 10, jnp.int32)
    with pytest.raises(TypeError, match="forward only"):
        jax.grad(lambda q: ragged_decode_attention(q, k, k, s, e).sum())(q)
    with pytest.raises(ValueError, match=r"sequence_end must be int \[batch=2\]"):
        ragged_decode_attention(q, k, k, s, jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="1 <= queries <= 16"):
        ragged_decode_attention(jnp.zeros((2, 17, 4, 16)), k, k, s, e)
    from ejgen.generated import flash_attention_decode

    with pytest.raises(TypeError, match="unsupported argument 'mask_info': decode modes take no train-only"):
        flash_attention_decode(q, k, k, s, e, mask_info=MaskInfo.from_segments(jnp.zeros((2, 1), jnp.int32)))


@pytest.mark.parametrize("change, message", [
    ("bias: always", "feature 'bias' is compiled in (always), but it has no meaning in mode(s) decode"),
    ("backends: [triton, pallas]", "built on the xla backend so far"),
], ids=["train-only feature", "no xla"])
def test_a_decode_mode_the_spec_cannot_have_is_a_spec_error(tmp_path, capsys, change, message):
    from ejgen.cli import main

    (tmp_path / "specs").mkdir()
    key, value = change.split(": ")
    features = f"  causal: runtime\n  {change}\n" if key == "bias" else "  causal: runtime\n"
    top = f"{change}\n" if key == "backends" else ""
    (tmp_path / "specs" / "d.yaml").write_text(
        f"name: d_attention\nfamily: attention\ndoc: d\nmodes: [train, decode]\n{top}features:\n{features}")
    assert main(["build", str(tmp_path / "specs"), "-o", str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err


DECODE_COMPILES = [  # (name, capability, kwargs)
    ("flash_attention", 90, dict(paged=True, window=True, softcap=True, groups=8, queries=2)),
    ("alibi_attention", 80, dict(params={"slopes": "float32"}, groups=4)),
    ("flash_attention", 90, dict(paged=True, page=64)),  # pages of whole blocks: a block's page read once
]


@pytest.mark.parametrize("triton", ["here", "gpu host"])
def test_decode_kernels_compile_for_the_gpus(triton):
    """The split-K kernel compiles ahead of time (no GPU here: Triton's own ptxas) for an H100 and an A100, on the
    Triton installed here and the GPU host's (EJGEN_GPU_HOST_TRITON), the requests in one process each."""
    from ejgen.testing.aot import compile_all_in_subprocess, gpu_host_triton

    requests = [{"decode": True, "package": "ejgen.generated", "name": name, "capability": capability,
                 "with_ptx": True, **kwargs} for name, capability, kwargs in DECODE_COMPILES]
    folder = gpu_host_triton() if triton == "gpu host" else None
    for request, compiled in zip(requests, compile_all_in_subprocess(requests, triton=folder)):
        assert "error" not in compiled, (request, compiled.get("error"))
        assert compiled["decode_kernel"]["cubin"] and compiled["decode_kernel"]["shared"] <= 163 * 1024, request
        # the key loop software-pipelined: K and V copied a step ahead (a page number carried from step to step
        # instead left no cp.async at all, session 28)
        assert "cp.async" in compiled["decode_kernel"]["ptx"], request
        if request.get("paged"):  # one K / V buffer at 2 stages or 3: the shared memory the splits were counted with
            assert compiled["decode_kernel"]["shared"] < 40 * 1024, (request, compiled["decode_kernel"]["shared"])


def test_splits_fill_the_program_slots():
    """Split-K: B x Hkv x splits fills the GPU's program slots without passing them (B4 S32k, 8 kv heads, 528 slots:
    16 splits of 2048 keys), whole blocks of at least MIN_SPLIT_BLOCKS; a window covers only the keys its rows can
    see; batch_invariant fixes the split size whatever the batch."""
    from ejgen.runtime.attention import split_k
    from ejgen.runtime.attention.config import AttentionConfig

    assert split_k.splits(4, 8, 32768, 64, slots=528) == (16, 2048)
    assert split_k.splits(32, 8, 8192, 64, slots=528) == (2, 4096)
    assert split_k.splits(1, 1, 100, 64, slots=528) == (1, 128)
    for batch, heads, seq in ((8, 8, 8192), (3, 5, 1000), (64, 8, 256)):
        n, per = split_k.splits(batch, heads, seq, 64, slots=528)
        assert per % 64 == 0 and n * per >= seq and (n == 1 or per >= split_k.MIN_SPLIT_BLOCKS * 64)
        assert batch * heads * n <= max(528, batch * heads)
    window = AttentionConfig(seq_q=2, seq_k=32768, window=True, window_span=1000)
    assert split_k.keys_to_visit(32768, window, 2, 64) == 1066
    fixed = {split_k.splits(b, h, 8192, 64, slots=528, batch_invariant=True)[1] for b in (1, 4, 32) for h in (1, 8)}
    assert fixed == {split_k.BATCH_INVARIANT_SPLIT}


def test_triton_decode_merges_many_splits_with_sinks():
    """The Triton kernel's splits merged by `split_k.merge` against the oracle: many splits a sequence, GQA 4 at Sq 2,
    two sinks a head, an empty sequence (o = 0, lse the sinks')."""
    from ejgen.ops import ragged_decode_attention
    from ejgen.runtime.attention import split_k
    from ejgen.runtime.attention.triton import decode

    rng = rng_for("merge")
    batch, hq, hkv, d, seq = 3, 4, 1, 16, 300
    q = jnp.asarray(rng.standard_normal((batch, 2, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, seq, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, seq, hkv, d)), jnp.float32)
    starts, ends = np.asarray([5, 0, 40], np.int32), np.asarray([300, 0, 200], np.int32)
    aux = jnp.asarray(rng.standard_normal((hq, 2)), jnp.float32)
    slots = split_k.slots(decode.INTERPRET_BLOCK_N, d, d, 4, decode.NUM_STAGES, sms=split_k.INTERPRET_SMS)
    assert split_k.splits(batch, hkv, seq, decode.INTERPRET_BLOCK_N, slots)[0] > 1, "the case must split"
    out, lse = ragged_decode_attention(q, k, v, starts, ends, softmax_aux=aux, return_lse=True, platform="triton")
    ref_out, ref_lse = reference(np.asarray(q), np.asarray(k), np.asarray(v), starts, ends, softmax_aux=np.asarray(aux))
    _check(out, lse, ref_out, ref_lse, "float32")


@pytest.mark.parametrize("backend", ["triton", "pallas", "pallas-tpu"])
def test_batch_invariant_results_do_not_depend_on_the_batch(backend):
    """Sequence 0 alone and next to three others: bitwise the same output (each kernel interpreted)."""
    from ejgen.ops import ragged_decode_attention

    rng = rng_for("batch-invariant")
    q = jnp.asarray(rng.standard_normal((4, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 600, 2, 16)), jnp.float32)
    starts, ends = np.asarray([3, 0, 10, 0], np.int32), np.asarray([590, 7, 300, 600], np.int32)
    platform, context = _on(backend)
    with context():
        run = jax.jit(lambda q, k, starts, ends: ragged_decode_attention(q, k, k, starts, ends, platform=platform,
                                                                         batch_invariant=True))
        run_b = lambda b: run(q[:b], k[:b], starts[:b], ends[:b])  # noqa: E731
        np.testing.assert_array_equal(np.asarray(run_b(1))[0], np.asarray(run_b(4))[0])
    with pytest.raises(ValueError, match="batch_invariant=True needs the Triton or the Pallas decode kernels"):
        ragged_decode_attention(q, k, k, starts, ends, platform="xla", batch_invariant=True)


EXPORTS = {
    # (op, query, cache, page or 0 for a contiguous cache, dtype, kwargs): every path of both kernels
    "flash-decode-GQA4-Sq2": ("flash_attention_decode", (4, 2, 8), (4, 256, 2), 0, "bfloat16",
                              dict(sliding_window=(64, 0), logits_soft_cap=30.0, softmax_aux="heads")),
    "flash-decode-GQA8-Sq16": ("flash_attention_decode", (2, 16, 16), (2, 100, 2), 0, "float32", {}),
    "flash-paged-page16": ("flash_attention_paged", (4, 1, 8), (40, 16, 2), 16, "bfloat16",
                           dict(softmax_aux="heads")),
    "flash-paged-page256": ("flash_attention_paged", (2, 1, 4), (8, 256, 4), 256, "bfloat16", {}),
    "alibi-paged-page1": ("alibi_attention_paged", (4, 3, 6), (300, 1, 2), 1, "bfloat16", dict(slopes="heads")),
}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_pallas_decode_lowers_for_gpus_and_tpus(platform):
    """jax.export of the Pallas decode kernels for a platform this machine does not have (the Triton lowering
    for CUDA, Mosaic for TPUs): contiguous and paged, pages of 1, 16 (several per TPU step, a table read per key
    on GPUs) and 256 (a table read per block), Sq 16 with GQA 8, bf16 and f32, sinks, alibi's params."""
    from jax import export

    import ejgen.generated as gen

    sds = jax.ShapeDtypeStruct
    target = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for name, (op, query, cache, page, dtype, kwargs) in EXPORTS.items():
        batch, sq, hq = query
        d = 128
        kwargs = {key: jnp.ones(hq) if val == "heads" else val for key, val in kwargs.items()}
        bounds = (sds((batch,), jnp.int32), sds((batch, 12), jnp.int32) if page else sds((batch,), jnp.int32))
        args = (sds((batch, sq, hq, d), dtype), sds(cache + (d,), dtype), sds(cache + (d,), dtype), *bounds)
        fn = lambda q, k, v, a, b: getattr(gen, op)(q, k, v, a, b, platform="pallas", **kwargs)  # noqa: E731
        exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
        assert exported.mlir_module().count(f"@{target}(") == 1, name


def test_pallas_decode_refuses_a_spec_with_token_views(tmp_path):
    """A param read by one side's positions (a token view) has no Pallas decode kernel yet: one clear error."""
    from ejgen.cli import main

    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "tv.yaml").write_text(
        "name: tv_attention\nfamily: attention\ndoc: tv\nmodes: [train, decode]\nfeatures:\n  causal: runtime\n"
        "params:\n  bonus: {shape: [batch, kv_len], dtype: float32}\nscore: s + bonus[b, kv_idx]\n")
    assert main(["build", str(tmp_path / "specs"), "-o", str(tmp_path / "tvgen")]) == 0
    q, k = jnp.zeros((1, 2, 16)), jnp.zeros((1, 5, 2, 16))
    lens = jnp.full((1,), 5, jnp.int32)
    with on_path(tmp_path):
        module = importlib.import_module("tvgen.tv_attention.decode")
        with pytest.raises(NotImplementedError, match="platform 'pallas' has no decode kernels for a spec whose"):
            module.tv_attention_decode(q, k, k, jnp.zeros((1,), jnp.int32), lens, bonus=jnp.zeros((1, 5)),
                                       platform="pallas")
