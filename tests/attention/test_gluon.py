"""The warp-specialised Gluon forward and backward (ejgen.runtime.attention.gluon.host) of the triton backend.

Here (no GPU): the kernels compile ahead of time for sm_90 (bf16 and f16, head dims 64 and 128, mask forms)
within the launch's budget of warps, shared memory and descriptor scratch; which calls they take and why
the others keep the generated Triton kernels. On an H100/H200 (`pytest -m gpu`): forward and backward of
the calls they take against the float64 oracle, with a spy showing which kernels ran.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

from ejgen.testing.shapes import AttnShape  # noqa: E402

from ejgen.runtime.attention.config import AttentionConfig  # noqa: E402
from ejgen.runtime.attention.gluon import host as gluon_attention  # noqa: E402
from ejgen.runtime.launch import triton_call  # noqa: E402
from hopper_fakes import pretend_hopper  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64_stays_off", "any_window_width")


@pytest.fixture
def any_window_width(monkeypatch):
    """The Hopper kernels on windows of every width here (their cases are narrow: gluon.host.NARROW_WINDOW sends
    those to the generated kernels in use, which test_kernel_choice checks)."""
    monkeypatch.setattr(gluon_attention, "NARROW_WINDOW", 0)

ON_GPU = jax.default_backend() == "gpu"


def _layout(spec: str):
    import importlib

    return importlib.import_module(f"ejgen.generated.{spec}.triton_launch").LAYOUT


SOFTCAP_SPILL_BUDGET = 96  # bytes a thread the soft cap's backwards may spill (sm_90, Triton 3.9: 56-88 measured)


# (dtype, head dim, causal, window, segments, soft cap): each compiled with the others in one process (one start and
# import of Triton and Gluon, not one per configuration: 17 s of 79 from a cold Triton cache, as CI's is)
LAUNCH_BUDGET_CASES = [("bfloat16", 128, True, True, False, False), ("float16", 64, False, False, False, False),
                       ("bfloat16", 128, True, False, True, False), ("bfloat16", 128, True, True, False, True),
                       ("float16", 64, False, False, False, True), ("bfloat16", 128, True, False, True, "fast"),
                       ("bfloat16", 128, True, False, "docs", False)]  # (segments in the DOCS form, host.DOCS_MASKS)


def test_the_kernel_compiles_for_sm90_within_the_launch_budget():
    """Forward and backward (and the persistent backward of causal windows and documents) of each of
    `LAUNCH_BUDGET_CASES`, each checked on its own; SOFTCAP: a soft cap (Gemma 2 / 3), "fast" with the hardware's approximate tanh
    (`host.FAST_TANH`)."""
    from ejgen.testing.aot import compile_all_in_subprocess

    if not gluon_attention.importable()[0]:
        pytest.fail(f"the test install's Triton has no Gluon warp specialisation: {gluon_attention.importable()[1]}")
    requests = [dict(gluon=True, dtype=dtype, head_dim=d, causal=causal, window=window, segments=bool(segments),
                     docs_masks=segments == "docs", softcap=bool(softcap), fast_tanh=softcap == "fast", with_ptx=True,
                     with_resources=True)
                for dtype, d, causal, window, segments, softcap in LAUNCH_BUDGET_CASES]
    for case, compiled in zip(LAUNCH_BUDGET_CASES, compile_all_in_subprocess(requests)):
        assert "error" not in compiled, (case, compiled.get("error"))
        _check_launch_budget(case, compiled)


def _check_launch_budget(case, compiled):
    dtype, d, causal, window, segments, softcap = case
    documents = segments and gluon_attention.PERSISTENT_SEGMENTS_BWD  # (causal packed documents: on by default)
    persistent_bwd = ("gluon_bwd_persistent_kernel", ) if causal and (window or documents) else ()
    assert set(compiled) == {"gluon_fwd_kernel", "gluon_bwd_kernel", *persistent_bwd}, case
    for name in compiled:
        meta = compiled[name]
        assert meta["warps"] == 12, f"{case} {name}: two consumer warpgroups and a producer warp (padded)"
        assert 0 < meta["global_scratch"] <= triton_call.SCRATCH_PER_PROGRAM, (case, name)  # the descriptors
        assert meta["shared"] <= 227 * 1024, (case, name, meta["shared"])  # Hopper's shared memory per block
        assert meta["cubin"] and meta["wgmma"], (case, name)
        assert "setmaxnreg" in meta["ptx"] and "cp.async.bulk.tensor" in meta["ptx"], (case, name)
        assert "wgmma.wait_group.sync.aligned 1" in meta["ptx"], f"{case} {name}: an exp under a wgmma in flight"
        # spills (the cubin's stack): none without a soft cap; with one the backwards' (Triton 3.9; 3.6 spills less)
        # 8-88 B a thread at head dim 128 (session 19), its forward with segment ids none
        budget = SOFTCAP_SPILL_BUDGET if softcap and name != "gluon_fwd_kernel" else 0
        assert meta["stack"] <= budget, f"{case} {name}: {meta['stack']} bytes spilled a thread (budget {budget})"
    for name in ("gluon_bwd_kernel", *persistent_bwd):
        assert "cp.reduce.async.bulk.tensor" in compiled[name]["ptx"], f"{case} {name}: dQ by bulk reduce-adds"
    if persistent_bwd:
        assert "atom.global" in compiled["gluon_bwd_persistent_kernel"]["ptx"], f"{case}: tiles from an atomic counter"
    # the DOCS form's select of the ids alone below the diagonal (one setp and selp an element: inline PTX)
    assert (".reg .pred p;" in compiled["gluon_fwd_kernel"]["ptx"]) == (segments == "docs"), case


def test_the_dynamic_tile_queue_compiles_like_the_static_split():
    """The forward with DYNAMIC (tiles from a fetch-and-add on TILE_CTR, each index handed to the consumers in its
    Q buffers' tile slots) and without, causal bf16 head dim 128 with segment ids and f16 64 without causal: both
    compile for sm_90 with no spill and the same shared memory but the 16 B of tile slots (padded to 32); only
    DYNAMIC takes tiles by an atomic, publishes them by the arrives (expect-tx on q_ready, plain for the stop index)
    and reads them back from shared memory."""
    from ejgen.testing.aot import compile_all_in_subprocess

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    # two of LAUNCH_BUDGET_CASES' calls (without window or soft cap): their static forwards are the launch budget
    # test's kernels, compiled once (Triton's cache), and asked for last
    calls = [dict(dtype=dtype, head_dim=d, causal=causal, segments=segments)
             for dtype, d, causal, _, segments, _ in (LAUNCH_BUDGET_CASES[2], LAUNCH_BUDGET_CASES[1])]
    requests = [dict(gluon=True, forward_only=True, with_ptx=True, dynamic=dynamic, **c) for dynamic in (True, False)
                for c in calls]
    results = compile_all_in_subprocess(requests)
    for c, (dynamic, static) in zip(calls, zip(results[:len(calls)], results[len(calls):])):
        assert "error" not in static and "error" not in dynamic, (static.get("error"), dynamic.get("error"))
        static, dynamic = static["gluon_fwd_kernel"], dynamic["gluon_fwd_kernel"]
        for meta in (static, dynamic):
            assert meta["warps"] == 12 and meta["cubin"] and meta["wgmma"], c
            assert "ld.local" not in meta["ptx"], f"{c}: registers spilled"
            assert meta["shared"] <= 227 * 1024, c
        assert 0 < dynamic["shared"] - static["shared"] <= 32, (c, static["shared"], dynamic["shared"])
        assert "atom.global" not in static["ptx"] and "atom.global.gpu.relaxed.add" in dynamic["ptx"], c
        # the stop index: two plain arrives on q_ready besides the consumers' releases; the static kernel arrives
        # by hand only from the consumers (q_empty, turn token, K / V stages) and, with segment ids, k_ready
        plain = [p["ptx"].count("mbarrier.arrive.shared::cta.b64") for p in (static, dynamic)]
        assert plain[1] == plain[0] + 2, (c, plain)
        assert dynamic["ptx"].count("st.shared.b32") > static["ptx"].count("st.shared.b32"), c  # the tile slots


def _cfg(**kw):
    return AttentionConfig(seq_q=kw.pop("seq_q", 512), seq_k=kw.pop("seq_k", 512), **kw)


def _qkv(sq=512, sk=512, d=128, dv=None, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((2, sq, 2, 4, d), dtype)
    k = jax.ShapeDtypeStruct((2, sk, 2, d), dtype)
    v = jax.ShapeDtypeStruct((2, sk, 2, dv or d), dtype)
    return q, k, v


@pytest.mark.parametrize("spec,cfg,arrays,pinned,reason", [
    ("flash_attention", _cfg(causal=True), _qkv(), True, "a fwd config is pinned"),
    ("alibi_attention", _cfg(causal=True), _qkv(), False, "the spec's score is not the scaled dot product"),
    ("flash_attention", _cfg(bias=True), _qkv(), False, "bias (the Hopper kernels take none of"),
    ("flash_attention", _cfg(varlen=True), _qkv(), False, "varlen (the Hopper kernels take none of"),
    ("flash_attention", _cfg(layout=True, layout_block=(64, 64), positions=True), _qkv(), False, "positions (the Hopper"),
    ("flash_attention", _cfg(), _qkv(dtype=jnp.float32), False, "dtype float32"),
    ("flash_attention", _cfg(), _qkv(d=96), False, "head dims 96/96"),
    ("flash_attention", _cfg(), _qkv(dv=64), False, "head dims 128/64"),
    ("flash_attention", _cfg(causal=True, seq_k=640), _qkv(sk=640), False, "Sq 512 != Sk 640"),
    ("flash_attention", _cfg(segments=True, dense_mask=True), _qkv(), False, "a dense mask (the Hopper"),
])
def test_calls_the_kernel_does_not_cover_say_why(spec, cfg, arrays, pinned, reason):
    why = gluon_attention.ineligible(_layout(spec), cfg, *arrays, pinned)
    assert why is not None and why.startswith(reason), why


def test_keys_of_another_length_take_the_hopper_kernels_with_the_gluon_cross_setting(monkeypatch):
    """Sq != Sk: the Hopper forward and backward (SEQ_K their own constexpr) where nothing ties queries to keys'
    positions (no causal, window, segment ids); on by default (the backward with CROSS_BACKWARD, on), off with
    gluon_cross=False."""
    from ejgen.ops import settings

    layout, cross, arrays = _layout("flash_attention"), _cfg(seq_k=640), _qkv(sk=640)
    for pass_ in ("fwd", "bwd"):
        why = gluon_attention.ineligible(layout, cross, *arrays, False, pass_)
        assert why is None or not gluon_attention.importable()[0], why
    with monkeypatch.context() as m:
        m.setattr(gluon_attention, "CROSS_BACKWARD", False)
        assert gluon_attention.ineligible(layout, cross, *arrays, False, "bwd").startswith(
            "Sq 512 != Sk 640 in the backward (gluon.host.CROSS_BACKWARD")
    causal = gluon_attention.ineligible(layout, _cfg(causal=True, seq_k=640), *arrays, False, "bwd")
    assert causal.startswith("Sq 512 != Sk 640 (the Hopper kernels take it with the gluon_cross setting on, "
                             "without causal"), causal
    with settings(gluon_cross=False):
        for pass_ in ("fwd", "bwd"):
            assert gluon_attention.ineligible(layout, cross, *arrays, False, pass_).startswith("Sq 512 != Sk 640")
    for constexprs in (gluon_attention.constexprs, gluon_attention.bwd_constexprs):
        consts = constexprs(2, 8, 2, 512, 128, False, False, seq_k=640)
        assert (consts["SEQ"], consts["SEQ_K"]) == (512, 640)
        assert constexprs(2, 8, 2, 512, 128, False, False)["SEQ_K"] == 512


def test_the_cross_kernels_compile_for_sm90():
    """The forward and the backward with SEQ_K != SEQ (no causal), more keys and more queries (in one process):
    compiled for sm_90 without spills (the cubin's stack), their loads and products as the square kernels', the
    backward's dQ by bulk reduce-adds."""
    from ejgen.testing.aot import compile_all_in_subprocess

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    lengths = {"more-keys": (1000, 2100), "more-queries": (2100, 700)}
    requests = [dict(gluon=True, causal=False, seq=seq, seq_k=seq_k, with_ptx=True, with_resources=True)
                for seq, seq_k in lengths.values()]
    for case, compiled in zip(lengths, compile_all_in_subprocess(requests)):
        assert "error" not in compiled, (case, compiled.get("error"))
        assert set(compiled) == {"gluon_fwd_kernel", "gluon_bwd_kernel"}, case
        for name, meta in compiled.items():
            assert meta["cubin"] and meta["wgmma"] and "cp.async.bulk.tensor" in meta["ptx"], (case, name)
            assert meta["stack"] == 0, f"{case} {name}: {meta['stack']} bytes spilled a thread"
        assert "cp.reduce.async.bulk.tensor" in compiled["gluon_bwd_kernel"]["ptx"], case


def test_the_backward_covers_short_causal_windows_but_not_two_sided_ones():
    layout, arrays = _layout("flash_attention"), _qkv()
    short = _cfg(causal=True, window=True, window_span=1024)
    assert gluon_attention.ineligible(layout, short, *arrays, False, "bwd") is None or not gluon_attention.importable()[0]
    two_sided = gluon_attention.ineligible(layout, _cfg(window=True, window_span=4096), *arrays, False, "bwd")
    assert two_sided.startswith("a sliding window without causal"), two_sided
    assert gluon_attention.ineligible(layout, short, *arrays, True, "bwd").startswith("a bwd config is pinned")
    consts = gluon_attention.bwd_constexprs(2, 8, 2, 1000, 128, True, True)
    assert (consts["MASK"], consts["DQ_MODE"]) == (2, 1)
    assert gluon_attention.bwd_constexprs(2, 8, 2, 1000, 64, False, False)["DQ_MODE"] == 0  # half of 64: no slice
    documents = _cfg(causal=True, window=True, window_span=1024, segments=True)  # the per-program kernel on lists
    assert gluon_attention.listed(documents, False, "bwd") and not gluon_attention.listed(documents, False)
    why = gluon_attention.ineligible(layout, documents, *arrays, False, "bwd")
    assert why is None or not gluon_attention.importable()[0], why
    from ejgen.ops import settings

    with settings(gluon_spec_masks=False):  # the setting off: the generated backward, saying why
        assert not gluon_attention.listed(documents, False, "bwd")
        why = gluon_attention.ineligible(layout, documents, *arrays, False, "bwd")
    assert why.startswith("segment ids with a sliding window (the backward's lists"), why


@pytest.mark.parametrize("cfg,arrays", [
    (_cfg(), _qkv()), (_cfg(causal=True, window=True, window_span=1024), _qkv(d=64, dtype=jnp.float16)),
    (_cfg(window=True, window_span=64), _qkv()),  # the forward: any window, two-sided ones included
    (_cfg(causal=True, segments=True), _qkv()), (_cfg(segments=True), _qkv(d=64, dtype=jnp.float16)),
])
def test_plain_causal_and_window_calls_are_covered(cfg, arrays):
    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    assert gluon_attention.ineligible(_layout("flash_attention"), cfg, *arrays, False) is None


def test_off_a_hopper_gpu_the_generated_kernels_run(monkeypatch):
    from ejgen.ops import explain, flash_attention

    q = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    if not ON_GPU:  # the interpreter: Gluon kernels do not run there
        choice = explain(flash_attention, q, q, q, causal=True, platform="triton")
        assert (choice.forward, choice.backward) == ("triton", "triton")
        assert "not an sm_90 GPU (target: cpu)" in choice.text()
    assert explain(flash_attention, q, q, q, causal=True, target="sm80").forward == "triton"
    assert explain(flash_attention, q, q, q, causal=True, target="sm90").forward == "gluon"
    monkeypatch.setenv("EJGEN_GLUON", "0")
    choice = explain(flash_attention, q, q, q, causal=True, target="sm90")
    assert (choice.forward, choice.backward) == ("triton", "triton") and "gluon setting is off" in choice.text()


def _stand_in_kernels(monkeypatch):
    """The Gluon forward and backward replaced by plain jnp attention with their signatures (causal or not, no
    sinks of their own, lse in and delta given to the backward as the kernels take them): what the host hands them
    and does with their results, checked off a GPU."""
    from ejgen.runtime.attention.triton import host as triton_host

    def scores(q5, k, cfg, scale):  # q [B, Sq, Hkv, G, D], k [B, Sk, Hkv, D] -> [B, Hkv, G, Sq, Sk] float32
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q5.astype(jnp.float32), k.astype(jnp.float32)) * scale
        if cfg.causal:
            sq, sk = s.shape[-2:]
            s = jnp.where(jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq), s, -jnp.inf)
        return s

    def forward(layout, q, k, v, scalars, ctx, cfg, fast_tanh=False, wire=None, merge=None, spare=0, spans=False):
        # (spare, spans: the grid's size and the tiles' walk, not the result)
        if wire is not None:  # k then v as one 16-bit buffer (`api.KV_WIRE`): read out of it as the kernel does
            buffer = wire[0].reshape(-1)
            k, v = (jax.lax.bitcast_convert_type(buffer[i * k.size:(i + 1) * k.size], k.dtype).reshape(k.shape)
                    for i in range(2))
        s = scores(q, k, cfg, scalars[0][0])
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)[..., None])
        out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32)).astype(q.dtype)
        if merge is not None:  # (MERGE: into the rows' earlier result, as the kernel's epilogue does)
            from ejgen.runtime.attention.api import merge_into

            return merge_into(out, lse, merge)
        return out, lse

    def backward(layout, q4, k, v, do4, lse3, delta3, scalars, ctx, cfg, fast_tanh=False, dq_into=None, wire=None,
                 q_rows=None, dkv_into=None):
        if q_rows is not None:  # (QDO_IN_PLACE: the call's rows of q and dO from the accumulator's row, as read)
            q4, do4 = (jax.lax.dynamic_slice_in_dim(x, dq_into[1], q4.shape[1], 1).reshape(q4.shape)
                       for x in q_rows)
        if wire is not None:  # the keys' rows of k then v in one 16-bit buffer (`api.KV_WIRE`), as the kernel reads
            buffer, k0 = wire
            rows = buffer.shape[-1]
            buffer = buffer.reshape(-1)
            block = (k.shape[0], rows) + k.shape[2:]
            k, v = (jax.lax.dynamic_slice_in_dim(jax.lax.bitcast_convert_type(
                buffer[i * k.size // k.shape[1] * rows:(i + 1) * k.size // k.shape[1] * rows], k.dtype).reshape(block),
                k0, k.shape[1], 1) for i in range(2))
        b, sq, hq, d = q4.shape
        hkv = k.shape[2]
        q5, do5 = q4.reshape(b, sq, hkv, hq // hkv, d), do4.reshape(b, sq, hkv, hq // hkv, -1)
        scale = scalars[0][0]
        lse, delta = lse3.reshape(b, hkv, hq // hkv, sq), delta3.reshape(b, hkv, hq // hkv, sq)
        p = jnp.exp(scores(q5, k, cfg, scale) - lse[..., None])
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", do5.astype(jnp.float32), v.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(jnp.float32)).reshape(q4.shape)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q5.astype(jnp.float32))
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do5.astype(jnp.float32))
        if dkv_into is not None:  # (DKV_AT / DKV_ADD_AT: written into a buffer laid out as the wire, at the keys' rows)
            dk, dv = _into_dkv_wire(dkv_into, wire, dk, dv, k.dtype)
        else:
            dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
        if dq_into is not None:  # (DQ_ROWS / DQ_OFF_AT: added into the accumulator, returned as dq)
            from ejgen.runtime.attention.api import add_rows

            return add_rows(dq_into[0], dq_into[1], dq), dk, dv
        return dq.astype(q4.dtype), dk, dv

    monkeypatch.setattr(triton_host, "_gluon_forward", forward)
    monkeypatch.setattr(triton_host, "_gluon_backward", backward)


def _into_dkv_wire(dkv_into, wire, dk, dv, dtype):
    """(the buffer, None) of a stand-in backward given `api.DKV_INTO` (the kernel's DKV_AT / DKV_ADD_AT): dk and dv
    (float32 [B, Sk, Hkv, D], as the kernel's registers) rounded to ``dtype`` on the K/V wire's rows from its k0 of a
    buffer laid out as its k and v, added to what they hold first where ``add`` is nonzero; a new buffer starts as NaN
    everywhere (the garbage no kernel writes: its reader must drop it)."""
    buffer, add = dkv_into
    rows, k0 = wire[0].shape[-1], wire[1]
    block = (dk.shape[0], rows) + dk.shape[2:]
    unit = jnp.uint16
    if buffer is None:
        nan = jax.lax.bitcast_convert_type(jnp.full((), jnp.nan, dtype), unit)
        buffer = jnp.full((2 * block[0] * block[1] * block[2] * block[3], ), nan, unit)
    halves = [jax.lax.bitcast_convert_type(half, dtype).reshape(block) for half in jnp.split(buffer, 2)]
    new = []
    for half, x in zip(halves, (dk, dv)):
        old = jax.lax.dynamic_slice_in_dim(half, k0, x.shape[1], 1).astype(jnp.float32)
        x = x + jnp.where(jnp.asarray(0 if add is None else add) != 0, old, 0.0)
        new.append(jax.lax.dynamic_update_slice_in_dim(half, x.astype(dtype), k0, 1))
    return jnp.concatenate([jax.lax.bitcast_convert_type(x, unit).reshape(-1) for x in new]), None


@pytest.mark.parametrize("sinks,causal", [("h", True), ("hn", False), ("n", True)])
def test_sinks_join_outside_the_hopper_kernels(monkeypatch, run_vjp, sinks, causal):
    """The Hopper set takes sinks outside its kernels (`api.join_sinks` on the forward's out and lse; the backward
    from that lse, the sinks' gradient from it): with stand-ins for the kernels (`_stand_in_kernels`), the call
    against the oracle (out, lse, every gradient, the sinks' included), every sink form; the Hopper set is chosen."""
    import numpy as np

    import oracle
    from ejgen.ops import explain, flash_attention
    from ejgen.testing.shapes import random_cotangents, random_qkv, random_sinks, rng_for

    pretend_hopper(monkeypatch)
    _stand_in_kernels(monkeypatch)
    shape = AttnShape(2, 40, 40, 4, 2, 64)
    rng = rng_for("gluon-sinks", sinks, causal)
    diff = random_qkv(shape, "float32", rng)
    diff = {n: x.astype(jnp.bfloat16) for n, x in diff.items()}
    diff["softmax_aux"] = random_sinks(sinks, shape.q_heads, rng) + 2.0  # a large share of the mass
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    choice = explain(flash_attention, *(diff[n] for n in ("query", "key", "value")), causal=causal,
                     softmax_aux=diff["softmax_aux"], platform="triton")
    assert (choice.forward, choice.backward) == ("gluon", "gluon"), choice.text()
    out, lse, grads = run_vjp(flash_attention, diff, {}, {"causal": causal, "platform": "triton"}, d_out, d_lse)
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, causal=causal, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, "bfloat16")


@pytest.mark.parametrize("switch", [True, False], ids=["delta-kernel", "xla-delta"])
def test_the_hopper_backward_takes_delta_from_the_delta_kernel_when_switched_on(monkeypatch, run_vjp, switch):
    """`gluon.host.DELTA_KERNEL`: the Hopper backward takes delta from `backward_delta` (the Triton kernel, which the
    pretended Hopper runs in the interpreter) once a call when on, from XLA when off; either way the gradients are the
    oracle's (stand-ins for the Gluon kernels, `_stand_in_kernels`; GQA, odd rows)."""
    import numpy as np

    import oracle
    from ejgen.ops import flash_attention
    from ejgen.testing.shapes import random_cotangents, random_qkv, rng_for

    pretend_hopper(monkeypatch)
    _stand_in_kernels(monkeypatch)
    monkeypatch.setattr(gluon_attention, "DELTA_KERNEL", switch)
    calls, kernel = [], gluon_attention.backward_delta
    monkeypatch.setattr(gluon_attention, "backward_delta", lambda *a: calls.append(a[0].shape) or kernel(*a))
    shape = AttnShape(1, 70, 70, 4, 2, 64)
    rng = rng_for("gluon-delta", switch)
    diff = {n: x.astype(jnp.bfloat16) for n, x in random_qkv(shape, "float32", rng).items()}
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng)
    out, lse, grads = run_vjp(flash_attention, diff, {}, {"causal": True, "platform": "triton"}, d_out, d_lse)
    assert calls == ([(1, 70, 2, 2, 64)] if switch else []), calls
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, causal=True, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, "bfloat16")


GPU_CASES = [  # (id, shape, features, dtype): calls the Gluon forward takes
    ("causal-gqa-d64-ragged", AttnShape(2, 300, 300, 4, 2, 64), dict(causal=True), "bfloat16"),
    ("plain-d128", AttnShape(1, 384, 384, 2, 2, 128), dict(), "bfloat16"),
    ("causal-window-d128-ragged", AttnShape(1, 3000, 3000, 2, 1, 128), dict(causal=True, sliding_window=(2100, 0)),
     "bfloat16"),
    ("two-sided-window-f16", AttnShape(1, 2600, 2600, 2, 2, 64), dict(sliding_window=(1100, 1000)), "float16"),
    ("causal-f16-d128", AttnShape(1, 512, 512, 4, 1, 128), dict(causal=True), "float16"),
    # sinks join outside the kernels: gpt-oss's form (a causal window and a sink a head), and two sinks a head
    ("causal-window-sinks-gqa", AttnShape(1, 1500, 1500, 4, 2, 64), dict(causal=True, sliding_window=(700, 0),
                                                                         sinks="h"), "bfloat16"),
    ("plain-sinks-hn-f16", AttnShape(2, 400, 400, 2, 2, 128), dict(sinks="hn"), "float16"),
    # soft caps (the kernels' SOFTCAP), small enough to bend most logits: Gemma 2's (causal), Gemma 3's (a causal
    # window, with sinks too), and one without causal in f16
    ("causal-softcap-gqa-d64", AttnShape(2, 300, 300, 4, 2, 64), dict(causal=True, logits_soft_cap=2.0), "bfloat16"),
    ("causal-window-softcap-sinks", AttnShape(1, 1500, 1500, 4, 2, 128),
     dict(causal=True, sliding_window=(700, 0), logits_soft_cap=3.0, sinks="h"), "bfloat16"),
    ("plain-softcap-f16", AttnShape(1, 384, 384, 2, 2, 128), dict(logits_soft_cap=1.5), "float16"),
]


def test_the_fast_tanh_only_where_the_backward_is_the_hopper_one_too(monkeypatch, run_vjp):
    """The fast_tanh setting: the forward's SOFTCAP is 2 (tanh.approx) where the backward is the Hopper one too, 1
    (the exact tanh) where it is generated (deterministic): that backward's P would not be of the forward's lse's
    logits; without the setting always 1 (and the backward generated), without a soft cap 0."""
    from ejgen.ops import flash_attention, settings
    from ejgen.testing.shapes import random_cotangents, random_qkv, rng_for

    seen = pretend_hopper(monkeypatch, values=False)
    shape = AttnShape(1, 256, 256, 4, 2, 128)
    diff = {n: x.astype(jnp.bfloat16) for n, x in random_qkv(shape, "float32", rng_for("fast-tanh")).items()}
    d_out, d_lse = random_cotangents(shape, "bfloat16", rng_for("fast-tanh-cot"))

    def forward_softcap(fast, deterministic, **kw):
        seen.clear()
        with settings(deterministic=deterministic, fast_tanh=fast):
            run_vjp(flash_attention, diff, {}, dict(causal=True, platform="triton", **kw), d_out, d_lse)
        names = [kernel.__name__ for kernel, *_ in seen]
        backward = [c["SOFTCAP"] for kernel, *_, c in seen if kernel.__name__.startswith("gluon_attention_bwd")]
        forward = [c["SOFTCAP"] for kernel, *_, c in seen if kernel.__name__ == "gluon_attention_fwd_kernel"]
        assert all(b == forward[0] for b in backward), (forward, backward)  # one tanh for both passes
        return forward, any(n.startswith("gluon_attention_bwd") for n in names)

    assert forward_softcap(True, False, logits_soft_cap=30.0) == ([2], True)
    assert forward_softcap(True, True, logits_soft_cap=30.0) == ([1], False)
    assert forward_softcap(False, False, logits_soft_cap=30.0) == ([1], False)
    assert forward_softcap(True, False) == ([0], True)


def test_the_fast_tanh_is_decided_once_for_both_passes(monkeypatch):
    """The fast_tanh setting read when the kernels are chosen (`KernelChoice.fast_tanh`), not again as each pass is
    traced: a backward traced after the setting's scope has closed (jax.vjp inside it, the pull outside) still takes
    the forward's tanh (SOFTCAP 2 both), and one chosen without it stays exact in both though the pull runs inside a
    scope that asks for it."""
    from ejgen.ops import flash_attention, settings
    from ejgen.testing.shapes import random_qkv, rng_for

    seen = pretend_hopper(monkeypatch, values=False)
    shape = AttnShape(1, 256, 256, 4, 2, 128)
    q, k, v = (x.astype(jnp.bfloat16) for x in random_qkv(shape, "float32", rng_for("fast-tanh-once")).values())

    def softcaps(fast_forward, fast_pull):
        seen.clear()

        def call(q):
            return flash_attention(q, k, v, causal=True, logits_soft_cap=30.0, platform="triton")

        with settings(fast_tanh=fast_forward):
            out, pull = jax.vjp(call, q)
        with settings(fast_tanh=fast_pull):
            jax.block_until_ready(pull(jnp.ones_like(out)))
        return sorted((kernel.__name__, c["SOFTCAP"]) for kernel, *_, c in seen)

    assert softcaps(True, False) == [("gluon_attention_bwd_kernel", 2), ("gluon_attention_fwd_kernel", 2)]
    assert [c for name, c in softcaps(False, True) if name.startswith("gluon_attention_fwd")] == [1]
    assert not any(name.startswith("gluon_attention_bwd") for name, _ in softcaps(False, True))


SOFTCAP_CASES = [c for c in GPU_CASES if "logits_soft_cap" in c[2]]
# Gemma 2's caps with logits that reach them (the scale lifts q.k's spread of ~sqrt(D) to the cap): tanh.approx's
# error is about cap x 2^-11 in a logit, so these are where the fast tanh would first show
LARGE_CAP_CASES = [
    ("causal-softcap30", AttnShape(1, 640, 640, 4, 2, 128), dict(causal=True, logits_soft_cap=30.0, softmax_scale=0.5),
     "bfloat16"),
    ("causal-softcap50-gqa", AttnShape(2, 384, 384, 4, 1, 128),
     dict(causal=True, logits_soft_cap=50.0, softmax_scale=1.0), "bfloat16"),
]


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("shape,features,dtype,fast",
                         [(*c[1:], True) for c in SOFTCAP_CASES + LARGE_CAP_CASES]
                         + [(*c[1:], False) for c in LARGE_CAP_CASES],
                         ids=[f"{c[0]}-fast" for c in SOFTCAP_CASES + LARGE_CAP_CASES]
                         + [f"{c[0]}-exact" for c in LARGE_CAP_CASES])
def test_gluon_soft_cap_with_the_fast_tanh_matches_the_oracle(monkeypatch, triton_launches, triton_against_oracle,
                                                                shape, features, dtype, fast):
    """The fast_tanh setting: the soft-cap cases with the hardware's tanh.approx in the forward and the backward
    (both Hopper), against the oracle: outputs and gradients at the dtype's tolerance, the lse within the error model
    (each capped logit within cap x 2^-10 of the exact one, so the lse too; the exact tanh's lse is held to
    LSE_TOLERANCE); the large caps with the exact tanh too (SOFTCAP 1, its backward generated)."""
    from ejgen.ops import settings

    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    with settings(fast_tanh=fast):
        triton_against_oracle(shape, features, dtype, "gluon-fast-tanh",
                              lse_atol=features["logits_soft_cap"] * 2.0 ** -10 if fast else None)
    forwards = [kw for pass_, kw in triton_launches if pass_ == "fwd"]
    assert forwards and all(kw.get("SOFTCAP") == (2 if fast else 1) for kw in forwards), triton_launches
    backwards = [kw for pass_, kw in triton_launches if pass_ in ("bwd", "persistent")]
    assert fast == bool(backwards), triton_launches
    assert all(kw.get("SOFTCAP") == 2 for kw in backwards), triton_launches  # the forward's tanh


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("shape,features,dtype", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_gluon_forward_matches_the_oracle(monkeypatch, triton_launches, triton_against_oracle, shape, features, dtype):
    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    triton_against_oracle(shape, features, dtype, "gluon")
    forwards = [kw for pass_, kw in triton_launches if pass_ == "fwd"]
    assert forwards and all("HEAD_GROUP" in kw for kw in forwards), triton_launches  # the Gluon forward's tile order
    backward = [pass_ for pass_, _ in triton_launches if pass_ != "fwd"]
    window = "sliding_window" in features
    generated = (window and not features.get("causal")) or "logits_soft_cap" in features  # a two-sided window; a
    # soft cap with the exact tanh (faster there, gluon.host.ineligible)
    # the Gluon backward: one kernel, the persistent one for causal windows
    assert sorted(backward) == (["dkdv", "dq"] if generated else ["persistent"] if window else ["bwd"]), backward



CROSS_GPU_CASES = [  # (id, shape, features, dtype): Sq != Sk, no causal: the Hopper forward with gluon_cross on
    ("cross-gqa-d128-ragged", AttnShape(2, 300, 1100, 4, 2, 128), {}, "bfloat16"),
    ("cross-more-queries-f16-d64", AttnShape(1, 2600, 700, 2, 2, 64), {}, "float16"),
    ("cross-softcap-sinks", AttnShape(1, 500, 900, 4, 2, 128), dict(logits_soft_cap=2.0, sinks="h"), "bfloat16"),
]


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("shape,features,dtype", [c[1:] for c in CROSS_GPU_CASES], ids=[c[0] for c in CROSS_GPU_CASES])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd-bwd"])
def test_gluon_cross_matches_the_oracle(monkeypatch, triton_launches, triton_against_oracle, shape, features, dtype,
                                       backward):
    """gluon_cross (on by default since the forward passed on the GPU host, session 19): the forward on the Hopper
    kernel with its own key count, and the backward too with `host.CROSS_BACKWARD` (on since this passed, session
    20), against the oracle (output, lse, every gradient)."""
    from ejgen.ops import settings

    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    monkeypatch.setattr(gluon_attention, "CROSS_BACKWARD", backward)
    with settings(gluon_cross=True):
        triton_against_oracle(shape, features, dtype, "gluon-cross")
    gluon = [(p, kw) for p, kw in triton_launches if "CONSUMER_REGS" in kw]  # the Hopper kernels' launches
    hopper_backward = backward and "logits_soft_cap" not in features  # (a soft cap's exact tanh: generated)
    assert {p for p, _ in gluon} == ({"fwd", "bwd"} if hopper_backward else {"fwd"}), triton_launches
    assert all(kw["SEQ_K"] == shape.kv_len != kw["SEQ"] for _, kw in gluon), triton_launches


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", ["causal-gqa-d64-ragged", "two-sided-window-f16", "causal-window-d128-ragged"])
def test_the_persistent_kernels_walk_many_tiles_per_program(monkeypatch, triton_launches, triton_against_oracle, case,
                                                            dynamic):
    """Five programs for 24-176 tiles: every program crosses tile boundaries (the forward's K/V ring, Q sets and
    turn token; for the causal window also the persistent backward's K/V buffers, ring and tile counter); static
    split and dynamic tile queue (gluon_dynamic_tiles)."""
    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "1" if dynamic else "0")
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 5)
    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    _, shape, features, dtype = next(c for c in GPU_CASES if c[0] == case)
    triton_against_oracle(shape, features, dtype, "gluon")
    forwards = [kw for pass_, kw in triton_launches if pass_ == "fwd" and "HEAD_GROUP" in kw]
    assert forwards and all(kw["DYNAMIC"] == dynamic for kw in forwards), triton_launches
    if case == "causal-window-d128-ragged":
        assert [pass_ for pass_, _ in triton_launches if pass_ != "fwd"] == ["persistent"], triton_launches


def test_the_launches_match_the_kernels_signatures(monkeypatch):
    """On a (pretended) Hopper GPU the op's forward and backward go to the two Gluon kernels with their
    arguments in signature order (inputs, then outputs, SCRATCH last), every constexpr the kernel declares,
    the persistent forward's grid (one program per SM, at most one per tile), the backward's of 128-key programs
    and the float32 dQ accumulator zeroed. The launch itself is a fake
    (no GPU here): the kernels' numbers are the GPU tests' business."""
    from ejgen.ops import flash_attention

    seen = pretend_hopper(monkeypatch, sms=7, values=False)
    b, s, hq, hkv, d = 2, 300, 4, 2, 128
    q = jnp.ones((b, s, hq, d), jnp.bfloat16)
    kv = jnp.ones((b, s, hkv, d), jnp.bfloat16)
    loss = lambda q, k, v: flash_attention(q, k, v, causal=True, sliding_window=(100, 0),
                                           platform="triton").astype(jnp.float32).sum()
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, kv, kv)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]
    kernels = [kernel.__name__ for kernel, *_ in seen]
    assert kernels == ["gluon_attention_fwd_kernel", "gluon_attention_bwd_persistent_kernel"], kernels
    assert seen[0][1] == (7,) and seen[0][4]["WINDOW"] and seen[0][4]["CAUSAL"]  # 24 tiles on 7 SMs
    assert seen[0][3][-1].shape == (7 * triton_call.SCRATCH_PER_PROGRAM,)
    _, grid, inputs, outs, kw = seen[1]
    names = gluon_attention.pbwd_kernel().arg_names
    assert len(inputs) + len(outs) + len(set(kw) & set(names)) == len(names)
    launch_options = {"zeroed", "aliases", "num_warps", "num_stages"}
    assert set(names[len(inputs) + len(outs):]) == set(kw) - launch_options, "every constexpr given, no other"
    assert grid == (7,) and kw["zeroed"] == (0, 3)  # 12 (key block, batch * kv head) tiles; dQ and the counter
    assert (outs[3].shape, outs[3].dtype) == ((1, ), jnp.int32) and names[len(inputs) + 3] == "TILE_CTR"
    assert kw["V_STAGES"] == 1  # head dim 128: two K buffers and one V buffer fit in shared memory
    assert [tuple(x.shape) for x in inputs[:6]] == [(b, s, hq, d), kv.shape, kv.shape, (b, s, hq, d), (b, hq, s),
                                                    (b, hq, s)]
    assert (outs[0].shape, outs[0].dtype) == ((b, s, hq, d), jnp.float32)
    assert (kw["MASK"], kw["SEQ"], kw["HQ"], kw["HKV"]) == (2, s, hq, hkv)

    seen.clear()
    jax.grad(lambda q: flash_attention(q, q, q, platform="triton").astype(jnp.float32).sum())(q)
    kernel, grid, inputs, outs, kw = seen[0]
    assert kernel.__name__ == "gluon_attention_fwd_kernel" and grid == (7,)
    assert kw["HEAD_GROUP"] == gluon_attention.head_group(b, hq, hq, s, d) == b * hq  # small: one section
    names = kernel.arg_names
    assert names[len(inputs) + len(outs) - 1] == "SCRATCH"
    assert set(names[len(inputs) + len(outs):]) == set(kw) - launch_options
    assert [tuple(o.shape) for o in outs[:2]] == [(b, s, hq, d), (b, hq, s)]
    assert seen[1][0].__name__ == "gluon_attention_bwd_kernel" and seen[1][4]["MASK"] == 0


def test_the_forward_reads_k_and_v_out_of_a_given_wire(monkeypatch):
    """`api.KV_WIRE` (ring attention's received block, `ring.KV_FROM_WIRE`): on a (pretended) Hopper GPU the forward
    launches with that 16-bit buffer ([items / rows, rows]) as both K and V and KV_AT = k's item count (V's items
    right after K's); without one, k and v themselves and KV_AT 0; a buffer that cannot hold k then v, or whose keys
    are not the whole block (a row offset, more rows), is refused. A fake launch."""
    import numpy as np
    from jax import lax

    from ejgen.ops import flash_attention
    from ejgen.runtime.attention.triton import host as triton_host

    seen = pretend_hopper(monkeypatch)
    b, s, h, d = 1, 256, 2, 64
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((b, s, h, d)), jnp.bfloat16) for i in range(3))
    wire = jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint16).reshape(-1) for x in (k, v)]).reshape(-1, s)
    given = {"wire": None}
    monkeypatch.setattr(triton_host, "given_wire", lambda ctx: (ctx, given["wire"]))
    for buffer in (None, wire):
        given["wire"] = None if buffer is None else (buffer, None)
        flash_attention(q, k, v, causal=True, platform="triton")
        kernel, _, inputs, _, kw = seen.pop()
        assert kernel.__name__ == "gluon_attention_fwd_kernel" and not seen
        if buffer is None:
            assert kw["KV_AT"] == 0 and inputs[1].shape == k.shape and inputs[2].shape == v.shape
        else:
            assert kw["KV_AT"] == k.size and kw["KV_AT"] % 8 == 0
            for x in inputs[1:3]:
                assert x.dtype == np.uint16 and np.array_equal(x, np.asarray(wire))
    for short in ((wire[:-1], None), (wire, 0), (wire.reshape(-1, 2 * s), None)):  # short of v's last items; from
        # a row (the forward takes the whole block); a block of more rows
        given["wire"] = short
        with pytest.raises(ValueError, match=re.escape("the Hopper forward's K/V wire must be 16-bit [items / rows, "
                                                       "rows] holding k then v")):
            flash_attention(q, k, v, causal=True, platform="triton")


def _earlier_rows(b: int, s: int, h: int, d: int) -> tuple:
    """q [b, s, h, d] bf16 and an earlier result of its rows, out [b, s, h, 1, d] bf16 and lse [b, h, 1, s] float32:
    random, for the fake launches that take one."""
    import numpy as np

    q = jnp.asarray(np.random.default_rng(0).standard_normal((b, s, h, d)), jnp.bfloat16)
    out0 = jnp.asarray(np.random.default_rng(1).standard_normal((b, s, h, 1, d)), jnp.bfloat16)
    lse0 = jnp.asarray(np.random.default_rng(2).standard_normal((b, h, 1, s)), jnp.float32)
    return q, out0, lse0


def test_the_forward_merges_into_a_given_result(monkeypatch):
    """`api.MERGE_INTO` (ring attention's last step, `ring.MERGE_IN_KERNEL`): on a (pretended) Hopper GPU the forward
    launches with MERGE, the earlier out and lse as O_PREV and LSE_PREV in the kernel's shapes, aliased to its O and
    LSE outputs; without one, placeholders and no aliases. A fake launch."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.runtime.attention.triton import host as triton_host

    seen = pretend_hopper(monkeypatch)
    q, out0, lse0 = _earlier_rows(1, 256, 2, 64)
    given = {"merge": None}
    monkeypatch.setattr(triton_host, "given_merge", lambda ctx: (ctx, given["merge"]))
    for earlier in (None, (out0, lse0)):
        given["merge"] = earlier
        flash_attention(q, q, q, causal=True, platform="triton")
        kernel, _, inputs, outs, kw = seen.pop()
        names = kernel.arg_names
        at = {n: i for i, n in enumerate(names)}
        assert kernel.__name__ == "gluon_attention_fwd_kernel" and len(inputs) == at["O"]
        if earlier is None:
            assert not kw["MERGE"] and not kw["aliases"] and inputs[at["O_PREV"]].shape == (1, )
        else:
            b, s, h, _, d = out0.shape
            assert kw["MERGE"] and kw["aliases"] == {at["O_PREV"]: 0, at["LSE_PREV"]: 1}
            np.testing.assert_array_equal(inputs[at["O_PREV"]], np.asarray(out0).reshape(b, s, h, d))
            np.testing.assert_array_equal(inputs[at["LSE_PREV"]], np.asarray(lse0).reshape(b, h, s))


TWO_COLUMN_LAYOUTS = {"row 1": [[False, False], [True, True]], "column 0": [[True, False], [True, False]],
                      "all but one": [[False, True], [True, True]], "none": [[False, False], [False, False]]}


def test_a_merged_layout_of_two_key_columns_walks_spans(monkeypatch):
    """A block layout of two key columns of whole tiles, merged into an earlier result (`api.MERGE_INTO`: the ring's
    wide step): on a (pretended) Hopper GPU the forward walks each query tile's span of key blocks (SPANS, RANGES
    [B, N_M, 4] from the layout's rows: lo, hi, and the same full; 0, 0 for a row that sees none) in `_tile`'s order
    (no lists, not ORDERED) through the dynamic queue, whatever the setting, the layout per batch row too; without the
    merge, with causal, with a layout per head, or `host.LAYOUT_SPANS` off (its default) where the call does not ask
    for spans (`api.SPANS`), lists. A fake launch."""
    import numpy as np

    from ejgen.ops import blocksparse_attention
    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.runtime.attention.triton import host as triton_host
    from ejgen.types import BlockMask

    seen = pretend_hopper(monkeypatch)
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "0")
    monkeypatch.setattr(gluon_attention, "LAYOUT_SPANS", True)
    b, s, h, d = 2, 512, 2, 64
    q, out0, lse0 = _earlier_rows(b, s, h, d)
    given = {"merge": (out0, lse0)}
    monkeypatch.setattr(triton_host, "given_merge", lambda ctx: (ctx, given["merge"]))
    qt = q.swapaxes(1, 2)  # (blocksparse_attention takes [B, H, S, D])

    def launch(layout, causal=False):
        mask = BlockMask.from_layout(jnp.asarray(layout), s, s, s // 2, s // 2)
        blocksparse_attention(qt, qt, qt, block_mask=mask, causal=causal, platform="triton")
        kernel, _, inputs, _, kw = seen.pop()
        return inputs[kernel.arg_names.index("RANGES")], kw

    for name, layout in TWO_COLUMN_LAYOUTS.items():
        ranges, kw = launch(layout)
        assert kw["SPANS"] and kw["DYNAMIC"] and kw["MERGE"] and not kw["LIST"] and not kw["ORDERED"], (name, kw)
        want = []
        for tile in range(s // 128):  # 128-row tiles, 2 key blocks of 128 a layout column
            cols = [c for c in range(2) if layout[tile // 2][c]]
            span = (2 * min(cols), 2 * max(cols) + 2) if cols else (0, 0)
            want.append(span + span)
        np.testing.assert_array_equal(ranges, np.broadcast_to(np.asarray(want, np.int32), (b, s // 128, 4)), name)
    per_batch = np.stack([TWO_COLUMN_LAYOUTS["row 1"], TWO_COLUMN_LAYOUTS["column 0"]])[:, None]  # [B, 1, 2, 2]
    ranges, kw = launch(per_batch)
    assert kw["SPANS"] and ranges[0, 0].tolist() == [0, 0, 0, 0] and ranges[1, 0].tolist() == [0, 2, 0, 2], ranges
    for why, layout, causal, merge, switch in (("no merge", per_batch, False, None, True),
                                               ("causal", per_batch, True, (out0, lse0), True),
                                               ("per head", np.ones((1, h, 2, 2), bool), False, (out0, lse0), True),
                                               ("switch off", per_batch, False, (out0, lse0), False)):
        given["merge"] = merge
        monkeypatch.setattr(gluon_attention, "LAYOUT_SPANS", switch)
        _, kw = launch(layout, causal)
        assert not kw["SPANS"] and kw["LIST"], (why, kw)
    monkeypatch.setattr(triton_host, "given_spans", lambda ctx: (ctx, True))  # `api.SPANS`: the ring's last wide
    _, kw = launch(per_batch)  # step where its hop has SMs (`ring._hop_sms`)
    assert kw["SPANS"] and not kw["LIST"], kw


def test_layout_spans_are_the_lists_blocks():
    """`layout_spans` of random layouts of one and two key columns (per batch row, longer and shorter key sequences,
    rows past the layout's blocks) visits exactly the key blocks that the block lists (`fwd_lists`) of the same
    layout list, each query tile's in one run."""
    import numpy as np

    from ejgen.runtime.attention.config import AttentionConfig

    rng = np.random.default_rng(5)
    for seq, block, cols in ((1024, 512, 2), (1024, 1024, 1), (768, 512, 2), (2048, 1024, 2)):
        rows = -(-seq // block)
        lay = jnp.asarray(rng.random((3, 1, 1, rows, cols)) < 0.5)
        cfg = AttentionConfig(seq_q=seq, seq_k=seq, layout=True, layout_block=(block, block))
        spans = np.asarray(gluon_attention.layout_spans({"layout": lay}, cfg, seq, seq, 3))
        table, _, count = gluon_attention.fwd_lists({"layout": lay}, cfg, seq, batch=3)
        table, count = np.asarray(table), np.asarray(count)
        for bi in range(3):
            for tile in range(-(-seq // 128)):
                listed = sorted(int(e) >> 1 for e in table[bi, 0, tile, 1:1 + count[bi, 0, tile]])
                if listed == [-(-seq // 128)]:  # (an empty row's one entry, past the end)
                    listed = []
                lo, hi, f0, f1 = spans[bi, tile]
                assert list(range(lo, hi)) == listed and (f0, f1) == (lo, hi), (seq, block, bi, tile, spans[bi, tile])


def test_a_forward_spares_sms_where_asked(monkeypatch):
    """`api.SPARE_SMS` (ring attention's first step beside the hop, `ring.FIRST_STEP_SPARE_SMS`): a forward given it
    launches that many fewer persistent programs than the GPU has SMs; without it, one a SM. A fake launch."""
    from ejgen.ops import flash_attention
    from ejgen.runtime.attention import api
    from ejgen.runtime.attention.triton import host as triton_host

    seen = pretend_hopper(monkeypatch, sms=16)
    q = _earlier_rows(1, 4096, 2, 64)[0]  # 64 tiles of 128 rows
    for spare, programs in ((0, 16), (4, 12)):
        monkeypatch.setattr(triton_host, "given_spare", lambda ctx, spare=spare: (ctx, spare))
        flash_attention(q, q, q, causal=True, platform="triton")
        assert seen.pop()[1] == (programs, ), spare
    monkeypatch.setattr(triton_host, "given_spare", api.given_spare)
    flash_attention(q, q, q, causal=True, platform="triton")
    assert seen.pop()[1] == (16, )


def test_the_backward_adds_dq_into_a_given_accumulator(monkeypatch):
    """`api.DQ_INTO` (ring attention's pairs, `ring.DQ_ONCE`): on a (pretended) Hopper GPU the backward launches with
    the accumulator as DQ_IN aliased to its DQ_ACC output of the accumulator's shape, nothing zeroed, DQ_ROWS its
    rows and the row offset appended to I32 (DQ_OFF_AT its index), and returns the accumulator as dq; without one,
    a placeholder, dQ zeroed, DQ_ROWS the call's rows. With `api.KV_WIRE` (`ring.KV_FROM_WIRE_BWD`) too: K and V
    both the buffer, KV_AT k's items, KV_ROWS the block's rows, the keys' row appended to I32 (KV_OFF_AT). With
    `api.Q_ROWS_FROM` (`ring.Q_IN_PLACE`) too: Q and DO the given tensors of the accumulator's rows, Q_ROWS their
    rows (the op's own: its rows). A fake launch (the call with the accumulator made beside the op's own backward, in
    its trace)."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.runtime.attention import api
    from ejgen.runtime.attention.triton import host as triton_host

    seen = pretend_hopper(monkeypatch)
    b, s, h, d = 1, 256, 2, 64
    q = jnp.asarray(np.random.default_rng(0).standard_normal((b, s, h, d)), jnp.bfloat16)
    acc = jnp.asarray(np.random.default_rng(1).standard_normal((b, 3 * s, h, 1, d)), jnp.float32)
    wire = jnp.arange(2 * 2 * b * s * h * d + 2 * s, dtype=jnp.uint16)  # k, v of 2 s rows, then an item a row
    q_rows = tuple(jnp.asarray(np.random.default_rng(i).standard_normal((b, 3 * s, h, 1, d)), jnp.bfloat16)
                   for i in (2, 3))
    real, shapes = triton_host._backward, []

    def beside(layout, q5, k, v, out, lse, d_out, d_lse, ctx, cfg, choice):
        into = {**ctx, api.DQ_INTO: (acc, jnp.asarray(s, jnp.int32)), api.KV_WIRE: (wire.reshape(-1, 2 * s),
                                                                                     jnp.asarray(s // 2, jnp.int32)),
                api.Q_ROWS_FROM: q_rows}
        dq = real(layout, q5, k, v, out, lse, d_out, d_lse, into, cfg, choice)[0]
        shapes.append((dq.shape, dq.dtype))
        jax.debug.callback(lambda x: None, dq)  # (kept: its launch runs)
        return real(layout, q5, k, v, out, lse, d_out, d_lse, ctx, cfg, choice)

    monkeypatch.setattr(triton_host, "_backward", beside)
    jax.grad(lambda q: flash_attention(q, q, q, causal=True, platform="triton").astype(jnp.float32).sum())(q)
    assert shapes == [(acc.shape, jnp.float32)]
    bwd = [x for x in seen if x[0].__name__ == "gluon_attention_bwd_kernel"]
    assert len(bwd) == 2, [x[0].__name__ for x in seen]
    for kernel, _, inputs, outs, kw in bwd:
        at = {n: i for i, n in enumerate(kernel.arg_names)}
        assert len(inputs) == at["DQ_ACC"]
        if kw["DQ_ROWS"] == s:  # the op's own
            assert kw["zeroed"] == (0, ) and not kw["aliases"] and kw["DQ_OFF_AT"] == 0
            assert inputs[at["DQ_IN"]].shape == (1, ) and outs[0].shape == (b, s, h, d)
            assert kw["KV_AT"] == 0 and kw["KV_ROWS"] == s and inputs[at["K"]].shape == (b, s, h, d)
            assert kw["QDO_IN_PLACE"] is False and inputs[at["Q"]].shape == inputs[at["DO"]].shape == (b, s, h, d)
        else:
            assert kw["zeroed"] == () and kw["aliases"] == {at["DQ_IN"]: 0}
            assert kw["DQ_ROWS"] == 3 * s and outs[0].shape == (b, 3 * s, h, d)
            np.testing.assert_array_equal(inputs[at["DQ_IN"]], np.asarray(acc).reshape(b, 3 * s, h, d))
            i32 = inputs[at["I32"]]  # (the keys' row, then dQ's)
            assert kw["KV_OFF_AT"] == len(i32) - 2 and kw["DQ_OFF_AT"] == len(i32) - 1 and list(i32[-2:]) == [s // 2, s]
            assert kw["KV_AT"] == b * 2 * s * h * d and kw["KV_ROWS"] == 2 * s
            for x in (inputs[at["K"]], inputs[at["V"]]):
                assert x.dtype == np.uint16 and np.array_equal(x, np.asarray(wire).reshape(-1, 2 * s))
            assert kw["QDO_IN_PLACE"] is True and kw["DQ_ROWS"] == 3 * s
            for name, x in zip(("Q", "DO"), q_rows):
                np.testing.assert_array_equal(inputs[at[name]], np.asarray(x).reshape(b, 3 * s, h, d))
    assert {kw["DQ_ROWS"] for *_, kw in bwd} == {s, 3 * s}


def test_the_backward_writes_dk_dv_into_a_given_wire(monkeypatch):
    """`api.DKV_INTO` beside `api.KV_WIRE` (ring attention's first backward step, `ring.DKV_INTO`): on a (pretended)
    Hopper GPU the backward launches with DK the dK / dV buffer laid out as the wire's k and v (16-bit, twice KV_AT
    items), DV a placeholder, DKV_AT = KV_AT; without a buffer a new one (DKV_IN a placeholder, nothing aliased),
    with one that buffer as DKV_IN aliased to DK and the add flag appended to I32 (DKV_ADD_AT its index); the call
    returns the buffer as dk. The op's own launch: DKV_AT 0, DKV_IN a placeholder. A fake launch."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.runtime.attention import api
    from ejgen.runtime.attention.triton import host as triton_host

    seen = pretend_hopper(monkeypatch)
    b, s, h, d = 1, 256, 2, 64
    q = jnp.asarray(np.random.default_rng(0).standard_normal((b, s, h, d)), jnp.bfloat16)
    wire = jnp.arange(2 * 2 * b * s * h * d + 2 * s, dtype=jnp.uint16)  # k, v of 2 s rows, then an item a row
    items = 2 * b * 2 * s * h * d
    given = jnp.arange(items, dtype=jnp.uint16)[::-1]
    real, dks = triton_host._backward, []

    def beside(layout, q5, k, v, out, lse, d_out, d_lse, ctx, cfg, choice):
        kv = {api.KV_WIRE: (wire.reshape(-1, 2 * s), jnp.asarray(s, jnp.int32))}
        for dkv in ((None, None), (given, jnp.asarray(1, jnp.int32))):
            dk, dv = real(layout, q5, k, v, out, lse, d_out, d_lse, {**ctx, **kv, api.DKV_INTO: dkv}, cfg,
                          choice)[1:3]
            dks.append((dk.shape, dk.dtype, dv.shape))
            jax.debug.callback(lambda x: None, dk)  # (kept: its launch runs)
        return real(layout, q5, k, v, out, lse, d_out, d_lse, ctx, cfg, choice)

    monkeypatch.setattr(triton_host, "_backward", beside)
    jax.grad(lambda q: flash_attention(q, q, q, causal=True, platform="triton").astype(jnp.float32).sum())(q)
    assert dks == [((items, ), jnp.uint16, (1, ))] * 2
    bwd = [x for x in seen if x[0].__name__ == "gluon_attention_bwd_kernel"]
    assert len(bwd) == 3, [x[0].__name__ for x in seen]
    own, fresh, into = sorted(bwd, key=lambda x: (x[4]["DKV_AT"], x[4]["DKV_ADD_AT"]))
    for kernel, _, inputs, outs, kw in (own, fresh, into):
        at = {n: i for i, n in enumerate(kernel.arg_names)}
        assert len(inputs) == at["DQ_ACC"]
        i32 = inputs[at["I32"]]
        if kw is own[4]:
            assert kw["DKV_AT"] == 0 and inputs[at["DKV_IN"]].shape == (1, ) and outs[1].shape == (b, s, h, d)
            continue
        assert kw["DKV_AT"] == kw["KV_AT"] == b * 2 * s * h * d and outs[1].shape == (items, )
        assert outs[1].dtype == jnp.uint16 and outs[2].shape == (1, ) and kw["KV_OFF_AT"] > 0
        assert i32[kw["KV_OFF_AT"]] == s
        if kw is fresh[4]:
            assert kw["DKV_ADD_AT"] == 0 and not kw["aliases"] and inputs[at["DKV_IN"]].shape == (1, )
        else:
            assert kw["aliases"] == {at["DKV_IN"]: 1} and kw["DKV_ADD_AT"] == len(i32) - 1 and i32[-1] == 1
            np.testing.assert_array_equal(inputs[at["DKV_IN"]], np.asarray(given))


@pytest.mark.parametrize("triton", ["here", "gpu host"])
def test_the_backward_adding_into_an_accumulator_compiles(triton):
    """The backward adding dQ into a larger accumulator from a row read at run time (DQ_ROWS, DQ_OFF_AT: ring
    attention's pairs, `ring.DQ_ONCE`), causal, and without causal also reading its keys out of a 16-bit buffer of
    twice the rows from a row read at run time (KV_AT, KV_ROWS, KV_OFF_AT: `ring.KV_FROM_WIRE_BWD`), and both again
    reading q and dO from that row of tensors of the accumulator's rows (QDO_IN_PLACE: `ring.Q_IN_PLACE`), and the
    last also writing dK / dV into a buffer laid out as the block's k and v, adding where a run-time flag says
    (DKV_AT, DKV_ADD_AT: `ring.DKV_INTO`), on this machine's Triton and the GPU host's (3.6): each compiles for sm_90
    with the bulk reduce-adds, no spill."""
    from ejgen.testing.aot import by_gpu_host_triton, compile_all_in_subprocess, gpu_host_triton

    results = compile_all_in_subprocess(
        [dict(gluon=True, dtype="bfloat16", head_dim=128, causal=causal, seq=1024, heads=4, kv_heads=4, batch=1,
              dq_into=True, kv_wire=wire, q_in_place=in_place, dkv_into=dkv, backward_only=True, with_ptx=True,
              with_resources=True)
         for causal, wire, in_place, dkv in ((True, False, False, False), (False, True, False, False),
                                             (True, False, True, False), (False, True, True, True))],
        triton=gpu_host_triton() if triton == "gpu host" else None)
    for compiled in results:
        assert "error" not in compiled, compiled.get("error")
        meta = compiled["gluon_bwd_kernel"]
        assert meta["cubin"] and meta["shared"] <= 227 * 1024 and meta["stack"] == 0, meta["stack"]
        assert "cp.reduce.async.bulk.tensor" in meta["ptx"]
        assert triton == "here" or by_gpu_host_triton(meta), meta["triton"]


def test_the_rings_hopper_entries_of_the_wrong_form_are_refused(monkeypatch):
    """An earlier result (`api.MERGE_INTO`) of other rows, a dQ accumulator (`api.DQ_INTO`) of another head count or
    dtype, a backward K/V wire (`api.KV_WIRE`) too short for k then v or whose keys' row runs past its block, and a
    dK / dV wire (`api.DKV_INTO`) without a K/V wire or of another size than its k and v: each refused with one clear
    message, on a (pretended) Hopper GPU."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.runtime.attention import api
    from ejgen.runtime.attention.triton import host as triton_host

    pretend_hopper(monkeypatch, values=False)
    b, s, h, d = 1, 256, 2, 64
    q = jnp.asarray(np.random.default_rng(0).standard_normal((b, s, h, d)), jnp.bfloat16)
    given = {"merge": None}
    monkeypatch.setattr(triton_host, "given_merge", lambda ctx: (ctx, given["merge"]))
    given["merge"] = (jnp.zeros((b, s // 2, h, 1, d), jnp.bfloat16), jnp.zeros((b, h, 1, s // 2), jnp.float32))
    with pytest.raises(ValueError, match="the Hopper forward's earlier result must be out"):
        flash_attention(q, q, q, causal=True, platform="triton")
    given["merge"] = None
    real = triton_host._backward
    entries = [{api.DQ_INTO: (jnp.zeros((b, 2 * s, h, 1, d), jnp.bfloat16), 0)},
               {api.DQ_INTO: (jnp.zeros((b, s, h, 1, d), jnp.float32), s)},
               {api.KV_WIRE: (jnp.zeros((2 * b * s * h * d // (2 * s) - 1, 2 * s), jnp.uint16), 0)},
               {api.KV_WIRE: (jnp.zeros((2 * b * 2 * s * h * d // (2 * s), 2 * s), jnp.uint16), s + 1)}]
    kv = {api.KV_WIRE: (jnp.zeros((2 * b * 2 * s * h * d // (2 * s), 2 * s), jnp.uint16), 0)}
    entries += [{api.DKV_INTO: (None, None)}, {**kv, api.DKV_INTO: (jnp.zeros((2 * b * s * h * d, ), jnp.uint16), 1)}]
    messages = ["dQ accumulator must be float32", "dQ accumulator must be float32", "K/V wire must be 16-bit",
                "K/V wire must be 16-bit", "dK / dV into a wire .* reading k and v out of a K/V wire",
                "dK / dV wire must be 16-bit"]
    for entry, message in zip(entries, messages):
        def backward(layout, q5, k, v, out, lse, d_out, d_lse, ctx, cfg, choice, entry=entry):
            return real(layout, q5, k, v, out, lse, d_out, d_lse, {**ctx, **entry}, cfg, choice)

        monkeypatch.setattr(triton_host, "_backward", backward)
        with pytest.raises(ValueError, match=message):
            jax.grad(lambda q: flash_attention(q, q, q, causal=True, platform="triton").astype(jnp.float32).sum())(q)


def test_a_dk_dv_wire_is_refused_off_the_hopper_backward(monkeypatch):
    """`api.DKV_INTO` given to a call whose backward is not the Hopper one (here the generated Triton kernels: no
    sm_90 GPU): one clear error when the backward is traced, naming the entry and the backward it got."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.runtime.attention import api
    from ejgen.runtime.attention.triton import host as triton_host

    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, 64)), jnp.bfloat16)
    real = triton_host._backward

    def backward(layout, q5, k, v, out, lse, d_out, d_lse, ctx, cfg, choice):
        return real(layout, q5, k, v, out, lse, d_out, d_lse, {**ctx, api.DKV_INTO: (None, None)}, cfg, choice)

    monkeypatch.setattr(triton_host, "_backward", backward)
    loss = lambda q: flash_attention(q, q, q, causal=True, platform="triton").astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"dK / dV into a wire \(`api.DKV_INTO`\) are the Hopper backward's: this "
                                         r"call's backward is triton"):
        jax.jit(jax.grad(loss)).lower(q)


def test_merge_into_is_the_softmax_over_both_key_sets():
    """`api.merge_into` (what the Hopper forward's MERGE epilogue computes, the ring's `_merge` and any other backend
    after its kernels) against a float64 reference of the softmax over both key sets: out and lse, rows only one side
    saw, rows neither saw (0 and -inf); and the ring's `_write` of a first result is bitwise its merge into zeros."""
    import numpy as np

    from ejgen.runtime.attention import api, ring

    rng = np.random.default_rng(3)
    shape, lshape = (1, 8, 2, 2, 16), (1, 2, 2, 8)
    out0, out1 = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    lse0, lse1 = (rng.standard_normal(lshape).astype(np.float32) for _ in range(2))
    lse0[..., 0], lse1[..., 1], lse0[..., 2], lse1[..., 2] = -np.inf, -np.inf, -np.inf, -np.inf
    out0[:, 0], out1[:, 1], out0[:, 2], out1[:, 2] = 0, 0, 0, 0
    got_out, got_lse = api.merge_into(jnp.asarray(out1), jnp.asarray(lse1), (jnp.asarray(out0), jnp.asarray(lse0)))
    w0, w1 = np.exp(lse0.astype(np.float64)), np.exp(lse1.astype(np.float64))
    den = w0 + w1
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = lambda w: np.moveaxis(np.where(den > 0, w / den, 0.0), -1, 1)[..., None]  # noqa: E731
        want_out = out0 * weight(w0) + out1 * weight(w1)
        want_lse = np.log(den)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)
    assert np.all(np.asarray(got_out)[:, 2] == 0) and np.all(np.asarray(got_lse)[..., 2] == -np.inf)
    zeros, none = jnp.zeros(shape), jnp.full(lshape, -jnp.inf)
    for written, merged in zip(ring._write(zeros, none, jnp.asarray(out1), jnp.asarray(lse1), 0, 8),
                               ring._merge(zeros, none, jnp.asarray(out1), jnp.asarray(lse1), 0, 8)):
        np.testing.assert_array_equal(written, merged)


def test_document_masks_reach_the_kernels_with_their_tile_ranges(monkeypatch):
    """Segment ids on a (pretended) Hopper GPU: both Gluon kernels take the ids and their tile ranges (the forward
    per 128-row query tile in key blocks, the backward per key block in 64-row query blocks), SEGMENTS on; the
    ranges are the segment ids' own (`block_mask.tile_ranges`), the kernels join them with causal. A fake launch; the
    backward one program a key block (`host.PERSISTENT_SEGMENTS_BWD` off: the persistent one's launch has its own
    test below)."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.types import MaskInfo

    seen = pretend_hopper(monkeypatch)
    monkeypatch.setattr(gluon_attention, "PERSISTENT_SEGMENTS_BWD", False)
    s = 640  # documents [0, 300), [300, 512), padding [512, 640)
    ids = np.where(np.arange(s) < 300, 0, np.where(np.arange(s) < 512, 1, -1)).astype(np.int32)[None]
    q = jnp.ones((1, s, 2, 128), jnp.bfloat16)
    loss = lambda q: flash_attention(q, q, q, causal=True, mask_info=MaskInfo.from_segments(jnp.asarray(ids)),
                                     platform="triton").astype(jnp.float32).sum()
    jax.grad(loss)(q)
    assert [k.__name__ for k, *_ in seen] == ["gluon_attention_fwd_kernel", "gluon_attention_bwd_kernel"]
    for kernel, grid, inputs, outs, kw in seen:
        names = kernel.arg_names
        assert kw["SEGMENTS"] and set(names[len(inputs) + len(outs):]) == set(kw) - {"zeroed", "aliases", "num_warps", "num_stages"}
        at = {n: x for n, x in zip(names, inputs)}
        assert np.array_equal(at["QSEG"], ids) and np.array_equal(at["KSEG"], ids)
    assert seen[0][4]["ORDERED"]  # documents: the forward's tiles in the order of their work
    assert sorted(dict(zip(seen[0][0].arg_names, seen[0][2]))["ORDER"].tolist()) == list(range(5 * 2))
    fwd = dict(zip(seen[0][0].arg_names, seen[0][2]))["RANGES"]
    # query tile 0 (rows 0-127): block 0 partial (rows see only their own document, cut at 300 -> block 2)
    assert fwd.shape == (1, 5, 4) and fwd[0, 0].tolist() == [0, 3, 0, 2]
    assert fwd[0, 4].tolist() == [0, 0, 0, 0]  # the padding tile: nothing (the kernel still visits one masked block)
    bwd = dict(zip(seen[1][0].arg_names, seen[1][2]))["RANGES"]
    assert sorted(dict(zip(seen[1][0].arg_names, seen[1][2]))["ORDER"].tolist()) == list(range(5 * 2))
    assert bwd.shape == (1, 5, 4) and bwd[0, 4].tolist() == [0, 0, 0, 0]
    assert bwd[0, 1].tolist() == [0, 5, 0, 4]  # keys 128-255 (document 0): query blocks 0-3 full, 4 holds row 300
    assert bwd[0, 2].tolist() == [0, 8, 0, 0]  # keys 256-383 cross into document 1: no full query block


def test_the_dynamic_tile_queue_follows_the_setting_and_its_measured_default(monkeypatch):
    """gluon_dynamic_tiles (EJGEN_GLUON_DYNAMIC_TILES 1 / 0 / auto, default auto): off, the forward's launch is the
    static split (DYNAMIC off, nothing zeroed, segment ids' tiles dealt per program as a snake); on, DYNAMIC with the
    int32 counter TILE_CTR as a zeroed output and the tile order as one list, heaviest first. Auto takes the queue
    for segment ids up to DYNAMIC_SEGMENT_TILES_PER_PROGRAM tiles a program (here 10 tiles on 3 programs). A fake
    launch on a pretended Hopper."""
    import numpy as np

    from ejgen.ops import flash_attention, settings
    from ejgen.runtime.core import settings as core_settings
    from ejgen.types import MaskInfo

    seen = pretend_hopper(monkeypatch, sms=3)
    s = 640  # documents [0, 300), [300, 512), padding [512, 640)
    ids = np.where(np.arange(s) < 300, 0, np.where(np.arange(s) < 512, 1, -1)).astype(np.int32)[None]
    q = jnp.ones((1, s, 2, 128), jnp.bfloat16)
    call = lambda q: flash_attention(q, q, q, causal=True, mask_info=MaskInfo.from_segments(jnp.asarray(ids)),
                                     platform="triton")

    def forward():
        seen.clear()
        jax.block_until_ready(call(q))
        (kernel, grid, inputs, outs, kw), = seen
        names = kernel.arg_names
        assert kernel.__name__ == "gluon_attention_fwd_kernel" and grid == (3, )
        assert names[len(inputs) + len(outs) - 1] == "SCRATCH" and names[len(inputs) + 2] == "TILE_CTR"
        assert (outs[2].shape, outs[2].dtype) == ((1, ), jnp.int32)
        assert set(names[len(inputs) + len(outs):]) == set(kw) - {"zeroed", "aliases", "num_warps", "num_stages"}
        return dict(zip(names, inputs))["ORDER"], kw

    def static(order, kw):
        assert not kw["DYNAMIC"] and kw["zeroed"] == ()
        np.testing.assert_array_equal(order, gluon_attention.tile_order(  # dealt to the 3 programs (a snake)
            gluon_attention.segment_ranges({"q_seg": jnp.asarray(ids), "kv_seg": jnp.asarray(ids)},
                                           AttentionConfig(seq_q=s, seq_k=s, causal=True, segments=True), s),
            2, True, 3))

    def dynamic(order, kw):
        assert kw["DYNAMIC"] and kw["zeroed"] == (2, )  # the counter, zeroed per call
        # one list, heaviest first: query tile i_m of 128 rows joined with causal and its documents' key blocks
        work = np.array([1, 2, 3, 2, 1])[order // 2]  # tiles 0-4: blocks 0, 0-1, 0-2 (row 300: doc 1 from 2), 2-3, pad
        assert sorted(order.tolist()) == list(range(10)) and np.all(np.diff(work) <= 0), (order, work)

    assert core_settings.current().gluon_dynamic_tiles is None
    dynamic(*forward())  # auto: 10 tiles on 3 programs
    monkeypatch.setattr(gluon_attention, "DYNAMIC_SEGMENT_TILES_PER_PROGRAM", 3)
    static(*forward())  # auto: more than 3 tiles a program
    for value, want in (("1", dynamic), ("on", dynamic), ("0", static), ("auto", static)):
        monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", value)
        want(*forward())
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "1")
    with settings(gluon_dynamic_tiles=False):  # a scope overrides the environment
        static(*forward())
    monkeypatch.delenv("EJGEN_GLUON_DYNAMIC_TILES")
    with settings(gluon_dynamic_tiles=True):
        dynamic(*forward())
    static(*forward())  # auto again outside the scope


def test_the_dynamic_tile_queue_default_is_where_it_was_measured_to_win(monkeypatch):
    """Auto (no setting): the queue for causal calls, never with a window, off for unmasked ones; with segment ids
    up to DYNAMIC_SEGMENT_TILES_PER_PROGRAM tiles a program. A malformed variable is one clear error."""
    from ejgen.ops import settings
    from ejgen.runtime.core import settings as core_settings

    monkeypatch.delenv("EJGEN_GLUON_DYNAMIC_TILES", raising=False)
    per = gluon_attention.DYNAMIC_SEGMENT_TILES_PER_PROGRAM
    pick = gluon_attention.dynamic_tiles
    assert pick(True, False, False, 4096, 132) and not pick(False, False, False, 4096, 132)
    assert not pick(True, True, False, 4096, 132) and not pick(True, True, True, 64, 132)
    assert pick(True, False, True, per * 132, 132) and not pick(True, False, True, per * 132 + 1, 132)
    assert pick(False, False, True, 64, 132)  # bidirectional documents too
    with settings(gluon_dynamic_tiles=False):
        assert not pick(True, False, False, 4096, 132)
    with settings(gluon_dynamic_tiles=True):
        assert pick(False, True, False, 4096, 132)
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "maybe")
    with pytest.raises(ValueError, match=r"EJGEN_GLUON_DYNAMIC_TILES='maybe': expected 1, 0 or auto"):
        core_settings.current()
    with pytest.raises(TypeError, match="gluon_dynamic_tiles must be a bool or None"):
        with settings(gluon_dynamic_tiles="on"):
            pass


DOCUMENT_CASES = [  # (id, shape, causal, lengths of the documents, then padding to the end)
    ("causal-8docs-d128", AttnShape(2, 2048, 2048, 4, 2, 128), True, (1, 700, 129, 128, 300, 257, 64, 300)),
    ("causal-gqa-d64-f16", AttnShape(1, 1500, 1500, 8, 2, 64), True, (512, 384, 1, 500)),
    ("bidirectional-docs", AttnShape(1, 1100, 1100, 2, 2, 128), False, (640, 129, 200)),
]


def _documents_match_the_oracle(monkeypatch, run_vjp, shape, causal, lengths):
    """Packed documents of ``lengths`` (then padding; the last batch row cut differently) through flash_attention on
    the Triton platform on 7 SMs (programs cross tiles), forward and backward against the float64 oracle."""
    import numpy as np

    import oracle
    from ejgen.ops import flash_attention
    from ejgen.testing.shapes import random_cotangents, random_qkv, rng_for
    from ejgen.types import MaskInfo

    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 7)
    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    dtype = "float16" if "f16" in str(shape) or shape.head_dim == 64 else "bfloat16"
    ids = np.full((shape.batch, shape.q_len), -1, np.int32)
    starts = np.cumsum((0,) + lengths)
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        ids[:, a:b] = i
    ids[-1, :] = np.roll(ids[-1], 37)  # the last batch row: documents cut differently (a wrapped padding run first)
    rng = rng_for(f"gluon-docs-{shape}-{causal}")
    diff = random_qkv(shape, dtype, rng)
    d_out, d_lse = random_cotangents(shape, dtype, rng)
    rest = {"mask_info": MaskInfo.from_segments(jnp.asarray(ids))}
    out, lse, grads = run_vjp(flash_attention, diff, rest, {"causal": causal, "platform": "triton"}, d_out, d_lse)
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, causal=causal, q_segment_ids=ids,
                           kv_segment_ids=ids, d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, dtype)


DOCUMENT_RUNS = [(c, dynamic, docs) for c in DOCUMENT_CASES for dynamic in (False, True)
                 for docs in ((False, True) if c[2] else (False,))]  # (the DOCS form: causal calls alone)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("shape,causal,lengths,dynamic,docs", [(*c[1:], dyn, docs) for c, dyn, docs in DOCUMENT_RUNS],
                         ids=[f"{c[0]}-{'dynamic' if dyn else 'static'}{'-docs' if docs else ''}"
                              for c, dyn, docs in DOCUMENT_RUNS])
def test_gluon_document_masks_match_the_oracle(monkeypatch, triton_launches, run_vjp, shape, causal, lengths, dynamic,
                                               docs):
    """Packed documents (one-token ones, documents of exactly one tile, tiles of padding) on the Hopper kernels,
    forward and backward, against the float64 oracle, on few SMs (programs cross tiles); the forward's static split
    and its dynamic tile queue; causal ones with the forward's masked blocks in the DOCS form too
    (`host.DOCS_MASKS`: the ids alone below the diagonal, padding as ids nothing matches); the backward one program a
    key block (`host.PERSISTENT_SEGMENTS_BWD` off: the next test takes the default, the persistent one)."""
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "1" if dynamic else "0")
    monkeypatch.setattr(gluon_attention, "DOCS_MASKS", docs)
    monkeypatch.setattr(gluon_attention, "PERSISTENT_SEGMENTS_BWD", False)
    _documents_match_the_oracle(monkeypatch, run_vjp, shape, causal, lengths)
    kinds = {k for k, _ in triton_launches}
    assert kinds == {"fwd", "bwd"} and all(kw.get("SEGMENTS") for _, kw in triton_launches), triton_launches
    assert all(kw["DYNAMIC"] == dynamic for k, kw in triton_launches if k == "fwd"), triton_launches
    assert all((kw["SEGMENTS"] == 2) == docs for k, kw in triton_launches if k == "fwd"), triton_launches


PERSISTENT_DOCUMENT_RUNS = [(c, docs) for c in DOCUMENT_CASES if c[2] for docs in (False, True)]


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check below)")
@pytest.mark.gpu
@pytest.mark.parametrize("shape,lengths,docs", [(c[1], c[3], docs) for c, docs in PERSISTENT_DOCUMENT_RUNS],
                         ids=[f"{c[0]}{'-docs' if docs else ''}" for c, docs in PERSISTENT_DOCUMENT_RUNS])
def test_gluon_document_masks_on_the_persistent_backward_match_the_oracle(monkeypatch, triton_launches, run_vjp,
                                                                          shape, lengths, docs):
    """The default (`host.PERSISTENT_SEGMENTS_BWD` on): the causal document cases' backward on the persistent kernel
    with segment ids (tiles in `bwd_order`'s order through its tile counter; on 7 SMs each program walks many tiles,
    key blocks no query sees among them), forward and backward against the float64 oracle."""
    monkeypatch.setattr(gluon_attention, "DOCS_MASKS", docs)
    assert gluon_attention.PERSISTENT_SEGMENTS_BWD
    _documents_match_the_oracle(monkeypatch, run_vjp, shape, True, lengths)
    kinds = sorted(k for k, _ in triton_launches)
    assert kinds == ["fwd", "persistent"], triton_launches
    assert all(kw.get("SEGMENTS") and kw["MASK"] == 1 for k, kw in triton_launches if k == "persistent"), \
        triton_launches


def test_the_tile_order_deals_the_work_evenly():
    """`tile_order` is a permutation of the forward's tiles; dealt to the programs it gives each a like share of the
    key blocks where the static order does not (packed documents: the heavy tiles are not the last query tiles)."""
    import numpy as np

    from ejgen.runtime.attention.config import AttentionConfig

    seq, hq, programs = 8192, 16, 132
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, seq), size=7, replace=False))
    ids = jnp.asarray(np.searchsorted(cuts, np.arange(seq), side="right").astype(np.int32)[None])
    cfg = AttentionConfig(seq_q=seq, seq_k=seq, causal=True, segments=True)
    ranges = gluon_attention.segment_ranges({"q_seg": ids, "kv_seg": ids}, cfg, seq)
    order = np.asarray(gluon_attention.tile_order(ranges, hq, True, programs))
    n_m = seq // 128
    assert sorted(order.tolist()) == list(range(n_m * hq))
    r = np.asarray(ranges)[0]
    blocks = np.maximum(np.minimum(r[:, 1], np.arange(n_m) + 1) - r[:, 0], 1)  # per query tile, joined with causal
    work = blocks[order // hq]  # batch 1: entry // (B * hq) is the query tile
    per_program = [work[p::programs].sum() for p in range(programs)]
    static = [blocks[n_m - 1 - (t % (4 * n_m)) // 4].sum() for t in range(n_m * hq)]  # `_tile`, sections of 4 heads
    static_per_program = [np.sum(static[p::programs]) for p in range(programs)]
    balanced = work.sum() / programs
    assert max(per_program) <= 1.08 * balanced, (max(per_program), balanced)
    assert max(static_per_program) >= 1.4 * balanced  # what it replaces
    # the backward's programs: the most query blocks first (the GPU starts them in that order)
    bwd_ranges = gluon_attention.segment_ranges({"q_seg": ids, "kv_seg": ids}, cfg, seq, "bwd")
    bwd = np.asarray(gluon_attention.bwd_order(bwd_ranges, 4, seq, True))
    assert sorted(bwd.tolist()) == list(range(64 * 4))
    br = np.asarray(bwd_ranges)[0]
    items = np.maximum(br[:, 1] - np.maximum(br[:, 0], np.arange(64) * 2), 0)  # query blocks of 64 rows, causal
    assert np.all(np.diff(items[bwd // 4]) <= 0) and items[bwd[0] // 4] == items.max()
    # every key block in range (one document each), no causal: every tile alike; 16 tiles on 5 programs
    whole = jnp.broadcast_to(jnp.asarray([0, 8, 0, 8], jnp.int32), (1, 8, 4))
    plain = np.asarray(gluon_attention.tile_order(whole, 2, False, 5))
    assert sorted(plain.tolist()) == list(range(8 * 2))
    # batch 2, 6 heads, causal over one document each: query tile i_m has i_m + 1 blocks
    causal = np.asarray(gluon_attention.tile_order(jnp.broadcast_to(jnp.asarray([0, 32, 0, 32], jnp.int32), (2, 32, 4)),
                                                   6, True, 132))
    assert sorted(causal.tolist()) == list(range(32 * 12))
    work = causal // 12 + 1
    assert max(work[p::132].sum() for p in range(132)) <= 1.12 * work.sum() / 132  # ~3 tiles each: 53 for 48
    assert gluon_attention.ordered(AttentionConfig(seq_q=8, seq_k=8, causal=True, segments=True))
    assert not gluon_attention.ordered(AttentionConfig(seq_q=8, seq_k=8, causal=True, window=True, segments=True))
    assert not gluon_attention.ordered(AttentionConfig(seq_q=8, seq_k=8, causal=True))  # the static order: L2


# -- block layouts: the kernels walk lists of blocks (LIST) -------------------------------------------------------
def _cdiv(a, b):
    return -(-a // b)


def _conditions(lay, lq, lk, seq, causal, ids=None):
    """bool [LB|B, LH|1, seq, seq] each: the element rules of a block layout, causal and segment ids, by hand."""
    import numpy as np

    i = np.arange(seq)
    rules = [lay[:, :, i // lq][:, :, :, i // lk]]
    if causal:
        rules.append((i[:, None] >= i[None, :])[None, None])
    if ids is not None:
        rules.append(((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0))[:, None])
    return rules


def _model_tiles(rules, tile_q, tile_k, transposed=False):
    """{(b, h, tile row): [(tile column, masked)]}: the tiles the conjunction of the rules' tile kinds visits (each
    rule: full where every element of the tile inside the sequence is visible, skipped where none is; the kernels
    join conditions tile by tile), masked unless all are full and the tile is whole."""
    import numpy as np

    rules = [np.swapaxes(r, -1, -2) if transposed else r for r in rules]
    seq = rules[0].shape[-1]
    batch, heads = max(r.shape[0] for r in rules), max(r.shape[1] for r in rules)
    out = {}
    for b in range(batch):
        for h in range(heads):
            for r in range(_cdiv(seq, tile_q)):
                row = []
                for c in range(_cdiv(seq, tile_k)):
                    kinds = []
                    for rule in rules:
                        t = rule[b % rule.shape[0], h % rule.shape[1], r * tile_q:(r + 1) * tile_q,
                                 c * tile_k:(c + 1) * tile_k]
                        kinds.append(2 if t.all() else int(t.any()))
                    if min(kinds):
                        whole = (r + 1) * tile_q <= seq and (c + 1) * tile_k <= seq
                        row.append((c, int(min(kinds) == 1 or not whole)))
                out[b, h, r] = row
    return out


def _words_hold_the_layout(entries, words, el, r, tile_q, tile_k, sub, transposed=False):
    """Each listed tile's word against the layout's own element rule ``el`` over the tile (inside the sequence)."""
    import numpy as np

    sub_q, sub_k = sub
    seq = el.shape[-1]
    for (c, _), word in zip(entries, words):
        rows = np.arange(r * tile_q, min((r + 1) * tile_q, seq))
        cols = np.arange(c * tile_k, min((c + 1) * tile_k, seq))
        if transposed:  # the backward's rows are key blocks, its entries query blocks
            rows, cols = np.arange(c * tile_q, min((c + 1) * tile_q, seq)), np.arange(r * tile_k, min((r + 1) * tile_k, seq))
        bit = ((rows[:, None] % tile_q) // sub_q) * (tile_k // sub_k) + (cols[None, :] % tile_k) // sub_k
        got = (np.uint32(np.int64(word) & 0xFFFFFFFF) >> bit.astype(np.uint32)) & 1
        np.testing.assert_array_equal(got.astype(bool), el[np.ix_(rows, cols)], err_msg=f"tile {r}, {c}")


LAYOUT_TABLE_CASES = [  # (id, seq, (block_q, block_k), per head, causal, segment ids)
    ("finer-64-per-head-causal", 700, (64, 64), True, True, False),
    ("coarser-256-shared", 1000, (256, 256), False, False, False),
    ("rows-32-keys-128-documents-causal", 517, (32, 128), True, True, True),
    ("tiles-128-shared-causal", 640, (128, 128), False, True, False),
    ("rows-256-keys-32", 384, (256, 32), True, False, False),
]


@pytest.mark.parametrize("seq,block,per_head,causal,documents", [c[1:] for c in LAYOUT_TABLE_CASES],
                         ids=[c[0] for c in LAYOUT_TABLE_CASES])
def test_block_layouts_become_the_kernels_lists(seq, block, per_head, causal, documents):
    """`fwd_lists` / `bwd_lists` (under jit, the layout traced) against a model built by hand from the dense element
    rule: per (batch row, head, query tile of 128) the key blocks with a visible element, ascending, masked unless
    every element of a whole tile is visible (a row that sees nothing: one entry past the end); per (batch row, kv
    head, key block of 128) the (query head, query block of 64) items; each entry's word of sub-blocks where the
    layout is finer than the tiles; odd lengths, layouts finer, coarser and mixed, causal, segment ids, GQA."""
    import numpy as np

    rng = np.random.default_rng(seq)
    batch, hq, hkv = 2, 4, 2
    (lq, lk), n_lq, n_lk = block, _cdiv(seq, block[0]), _cdiv(seq, block[1])
    lay = rng.random((1, hq if per_head else 1, n_lq, n_lk)) < 0.3
    lay |= np.arange(n_lq)[:, None] * lq // lk == np.arange(n_lk)[None]  # the diagonal (causal cuts it)
    lay[..., 256 // lq:_cdiv(384, lq), :] = False  # query rows 256-383 see nothing: a forward tile's empty list
    lay[..., :, 256 // lk:_cdiv(384, lk)] = False  # keys 256-383: nobody sees them, the backward's empty lists
    ids = None
    if documents:  # two documents, then padding; the second batch row cut elsewhere
        ids = np.stack([np.repeat([0, 1, -1], [200, seq - 260, 60]), np.repeat([0, 1, -1], [333, seq - 343, 10])])
        ids = ids.astype(np.int32)
    kv_heads, groups = (hkv, hq // hkv) if per_head else (1, 1)
    ctx = {"layout": jnp.asarray(lay.reshape(1, kv_heads, groups, n_lq, n_lk))}  # the op's [B|1, Hkv|1, G|1, ...]
    if documents:
        ctx["q_seg"] = ctx["kv_seg"] = jnp.asarray(ids)
    cfg = AttentionConfig(seq_q=seq, seq_k=seq, causal=causal, segments=documents, layout=True, layout_block=block)
    assert gluon_attention.layout_misfit(cfg) is None
    consts = {}

    def lists(ctx):  # under jit, the layout traced; the constexprs come from the shapes
        (fwd, consts["fwd"], fwd_work), (bwd, consts["bwd"], bwd_work) = (
            gluon_attention.fwd_lists(ctx, cfg, seq), gluon_attention.bwd_lists(ctx, cfg, seq, hkv))
        return fwd, fwd_work, bwd, bwd_work

    fwd, fwd_work, bwd, bwd_work = (np.asarray(x) for x in jax.jit(lists)(ctx))
    fwd_consts, bwd_consts = consts["fwd"], consts["bwd"]
    rules = _conditions(lay, lq, lk, seq, causal, ids)
    el = rules[0]  # the layout alone: what the words hold
    n_n = _cdiv(seq, 128)

    # the forward: per (b, h, query tile of 128)
    assert fwd.shape == (batch if documents else 1, hq if per_head else 1, _cdiv(seq, 128), 1 + n_n * (2 if
                                                                                                       fwd_consts["SUB_Q"] else 1))
    assert (fwd_consts["LIST"], fwd_consts["LIST_BATCH"], fwd_consts["LIST_HEADS"]) == (True, *fwd.shape[:2])
    sub = gluon_attention.sub_blocks(block, "fwd")
    assert (fwd_consts["SUB_Q"], fwd_consts["SUB_K"]) == sub and (sub == (0, 0)) == (lq % 128 == 0 and lk % 128 == 0)
    model = _model_tiles(rules, 128, 128)
    for (b, h, r), want in model.items():
        row = fwd[b, h, r]
        got = [(e >> 1, e & 1) for e in row[1:1 + row[0]]]
        assert got == (want or [(n_n, 1)]), (b, h, r, got, want)  # nothing visible: one entry past the end, masked
        assert fwd_work[b, h, r] == row[0] == max(len(want), 1)
        if sub != (0, 0) and want:
            _words_hold_the_layout(want, row[1 + n_n:1 + n_n + row[0]], el[0, h if per_head else 0], r, 128, 128, sub)
    assert any(not w for w in model.values()) and any(m for w in model.values() for _, m in w)  # both cases seen

    # the backward: per (b, kv head, key block of 128) the (query head, query block of 64) items
    per = bwd_consts["LIST"] == 2
    assert per == per_head and bwd.shape[:3] == (batch if documents else 1, hkv if per_head else 1, n_n)
    n_mq = _cdiv(seq, 64)
    width = (hq // hkv if per_head else 1) * n_mq
    sub = gluon_attention.sub_blocks(block, "bwd")
    assert bwd.shape[3] == 1 + width * (2 if sub != (0, 0) else 1) and (bwd_consts["SUB_Q"], bwd_consts["SUB_K"]) == sub
    model = _model_tiles(rules, 128, 64, transposed=True)  # per key block: query blocks
    empty_columns = 0
    for b in range(bwd.shape[0]):
        for kh in range(bwd.shape[1]):
            for n in range(n_n):
                row = bwd[b, kh, n]
                got = [(e >> 1, e & 1) for e in row[1:1 + row[0]]]
                heads = range(hq // hkv) if per_head else [None]
                want = [(g * n_mq + m if per_head else m, masked) for g in heads
                        for m, masked in model[b, 0 if g is None else kh * (hq // hkv) + g, n]]
                assert got == want and bwd_work[b, kh, n] == row[0], (b, kh, n, got, want)
                empty_columns += not want
                if sub != (0, 0) and per_head:
                    for g in heads:
                        mine = [(v % n_mq, mk) for v, mk in got if v // n_mq == g]
                        words = [w for (v, _), w in zip(got, row[1 + width:1 + width + row[0]]) if v // n_mq == g]
                        _words_hold_the_layout(mine, words, el[0, kh * (hq // hkv) + g], n, 64, 128, sub, True)
                elif sub != (0, 0):
                    _words_hold_the_layout(got, row[1 + width:1 + width + row[0]], el[0, 0], n, 64, 128, sub, True)
    assert empty_columns  # a key block nobody sees: no items (dK = dV = 0)


def _walk(table, consts, seq, b, kh, row, tiles, group, keep, transposed=False):
    """(head in the group, query rows [R, 1], keys [1, C], visible [R, C]) of each item a kernel computes for list
    row ``row`` of batch row b and head (forward) or kv head (backward, ``transposed``: rows are key blocks, entries
    query blocks) kh, as `kernels._list_row` / `_list_entry` / `_bwd_list_item` and the element masks read them;
    ``tiles``: the pass's (query, key) tile; ``keep(rows, keys)``: the mask's rule (causal, window, ids, the end)."""
    import numpy as np

    tile_q, tile_k = tiles
    n_j = (table.shape[-1] - 1) // (2 if consts["SUB_Q"] else 1)
    r = table[b % consts["LIST_BATCH"], kh % consts["LIST_HEADS"], row]
    for it in range(r[0] * (group if consts["LIST"] == 1 else 1)):
        slot = it % r[0] if consts["LIST"] == 1 else it
        e, word = int(r[1 + slot]), int(r[1 + n_j + slot]) if consts["SUB_Q"] else 0
        g, j = (it // r[0], e >> 1) if consts["LIST"] == 1 else divmod(e >> 1, _cdiv(seq, tile_q))
        m, n = (j, row) if transposed else (row, j)
        rows = np.arange(m * tile_q, (m + 1) * tile_q)[:, None]
        keys = np.arange(n * tile_k, (n + 1) * tile_k)[None, :]
        seen = np.ones((tile_q, tile_k), bool)
        if e & 1:  # the element mask
            seen = keep(rows, keys)
            if consts["SUB_Q"]:
                sub_q, sub_k = consts["SUB_Q"], consts["SUB_K"]
                bit = (rows % tile_q) // sub_q * (tile_k // sub_k) + (keys % tile_k) // sub_k
                seen = seen & (((np.uint32(word & 0xFFFFFFFF) >> bit.astype(np.uint32)) & 1) == 1)
        else:  # no mask: the whole tile lies inside the sequence
            assert rows.max() < seq and keys.max() < seq, (b, kh, row, e)
        yield g, rows, keys, seen


@pytest.mark.parametrize("seq,block,per_head,batch_layout,causal,window,documents", [
    (300, (32, 16), True, True, False, (70, 90), False),
    (333, (256, 64), False, True, True, (100, 0), True),
], ids=["finer-per-head-per-row-window", "mixed-shared-per-row-causal-window-documents"])
def test_the_lists_walk_each_visible_pair_once(seq, block, per_head, batch_layout, causal, window, documents):
    """The lists, walked as the kernels walk them (the forward per (batch row, head, query tile), the backward per
    (batch row, kv head, key block) with its items' heads), count every (batch row, head, query, key) pair: each
    visible one exactly once (in a tile without the element mask or under it with the entry's word), no other, in
    both passes, against the dense element rule written by hand (layout, causal, a two-sided window, segment ids);
    a layout per batch row and per head, GQA 4 / 2, odd lengths."""
    import numpy as np

    rng = np.random.default_rng(seq)
    batch, hq, hkv = 2, 4, 2
    (lq, lk), n_lq, n_lk = block, _cdiv(seq, block[0]), _cdiv(seq, block[1])
    lay = rng.random((batch if batch_layout else 1, hq if per_head else 1, n_lq, n_lk)) < 0.4
    ids = np.repeat([[0, 1, -1]], batch, 0)[:, np.arange(seq) * 3 // seq].astype(np.int32) if documents else None
    if documents:
        ids[1] = np.roll(ids[1], 50)
    i = np.arange(seq)
    want = lay[:, :, i // lq][:, :, :, i // lk] & np.ones((batch, hq, 1, 1), bool)
    d = i[None, :] - i[:, None]  # key - query
    want = want & (d <= 0 if causal else True) & (d >= -window[0]) & (d <= window[1])
    if documents:
        want &= ((ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0))[:, None]
    ctx = {"layout": jnp.asarray(lay.reshape(lay.shape[0], hkv, hq // hkv, n_lq, n_lk) if per_head
                                 else lay[:, :, None]),
           "window_left": jnp.int32(window[0]), "window_right": jnp.int32(window[1])}
    if documents:
        ctx["q_seg"] = ctx["kv_seg"] = jnp.asarray(ids)
    cfg = AttentionConfig(seq_q=seq, seq_k=seq, causal=causal, window=True, segments=documents, layout=True,
                          layout_block=block)
    (fwd, fc, _), (bwd, bc, _) = jax.jit(lambda c: (gluon_attention.fwd_lists(c, cfg, seq),
                                                    gluon_attention.bwd_lists(c, cfg, seq, hkv)))(ctx)
    fwd, bwd = np.asarray(fwd), np.asarray(bwd)

    def rule(b):
        def keep(rows, keys):
            out = (rows < seq) & (keys < seq) & (keys - rows >= -window[0]) & (keys - rows <= window[1])
            out = out & (keys <= rows) if causal else out
            if documents:
                qs = np.where(rows < seq, ids[b][np.minimum(rows, seq - 1)], -1)
                ks = np.where(keys < seq, ids[b][np.minimum(keys, seq - 1)], -2)
                out = out & (qs == ks) & (qs >= 0)
            return out
        return keep

    for name, table, consts, tiles, heads in (
            ("forward", fwd, fc, (gluon_attention.BLOCK_M, gluon_attention.TILES["BLOCK_N"]), hq),
            ("backward", bwd, bc, (gluon_attention.BWD_TILES["BLOCK_M"], gluon_attention.BWD_TILES["BLOCK_N"]), hkv)):
        seen = np.zeros(want.shape, np.int32)
        group = 1 if name == "forward" else hq // hkv
        for b in range(batch):
            for kh in range(heads):
                for row in range(_cdiv(seq, 128)):  # query tiles of 128 / key blocks of 128
                    for g, rows, keys, vis in _walk(table, consts, seq, b, kh, row, tiles, group, rule(b),
                                                    transposed=name == "backward"):
                        vis = vis & (rows < seq) & (keys < seq)
                        h = kh * group + g
                        np.add.at(seen[b, h], (np.broadcast_to(rows, vis.shape)[vis],
                                               np.broadcast_to(keys, vis.shape)[vis]), 1)
        assert seen.max() <= 1, f"{name}: a pair visited twice"
        np.testing.assert_array_equal(seen.astype(bool), want, err_msg=name)
    assert fc["SUB_Q"] and fc["LIST_BATCH"] == batch and bc["LIST"] == (2 if per_head else 1)


def test_block_layouts_the_lists_cannot_say_keep_the_generated_kernels():
    """A layout whose blocks neither cover nor divide the tiles, or cut a tile into more than 32 sub-blocks (one
    word per entry), is one clear reason for both passes; blocks that cover or divide the tiles are covered
    (`layout_misfit`), with a word per entry only where they are finer (`sub_blocks`)."""
    layout, arrays = _layout("flash_attention"), _qkv()
    for block, reason in (((48, 128), "a block layout of 48 x 128 blocks (the Hopper kernels' forward tiles"),
                          ((16, 16), "a block layout of 16 x 16 blocks (64 of them in a forward tile")):
        for pass_ in ("fwd", "bwd"):
            why = gluon_attention.ineligible(layout, _cfg(causal=True, layout=True, layout_block=block), *arrays,
                                             False, pass_)
            assert why is not None and why.startswith(reason), why
    for block in ((32, 32), (64, 128), (256, 512), (128, 8)):  # (128, 8): 16 sub-blocks in either pass's tile
        assert gluon_attention.layout_misfit(_cfg(layout=True, layout_block=block)) is None, block
    assert gluon_attention.sub_blocks((256, 512)) == (0, 0) and gluon_attention.sub_blocks((64, 128), "bwd") == (0, 0)
    assert gluon_attention.sub_blocks((64, 128)) == (64, 128) and gluon_attention.sub_blocks((64, 64), "bwd") == (64, 64)


def test_explain_takes_the_hopper_kernels_for_block_layouts():
    """`explain(..., target="sm90")`: a call with a block layout (alone or with causal) goes to the Gluon forward and
    backward; one whose blocks the lists cannot say stays on the generated kernels, saying why."""
    import numpy as np

    from ejgen.ops import explain, flash_attention
    from ejgen.types import BlockMask

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    s = 1024
    q = jax.ShapeDtypeStruct((1, s, 4, 128), jnp.bfloat16)
    lay = np.eye(s // 64, dtype=bool) | (np.arange(s // 64)[None] == 0)
    for causal in (False, True):
        mask = BlockMask.from_layout(lay, s, s, 64, 64)
        choice = explain(flash_attention, q, q, q, causal=causal, block_mask=mask, target="sm90")
        assert (choice.forward, choice.backward) == ("gluon", "gluon"), choice.text()
    odd = BlockMask.from_layout(np.ones((_cdiv(s, 96), _cdiv(s, 96)), bool), s, s, 96, 96)
    choice = explain(flash_attention, q, q, q, block_mask=odd, target="sm90")
    assert choice.forward == "triton" and "a block layout of 96 x 96 blocks" in choice.text(), choice.text()


def test_block_layouts_reach_the_kernels_as_lists(monkeypatch):
    """A layout call on a (pretended) Hopper GPU: the forward gets its lists in RANGES with LIST and its tiles in the
    order of their counts (ORDERED; a permutation), the per-program backward (even for a causal window) its lists of
    (query head, query block) items with LIST 2 (a layout per head) and its programs most work first. A fake launch."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.types import BlockMask

    seen = pretend_hopper(monkeypatch, sms=3)
    s, hq, hkv = 640, 4, 2
    rng = np.random.default_rng(1)
    lay = rng.random((1, hq, s // 64, s // 64)) < 0.4
    mask = BlockMask.from_layout(lay, s, s, 64, 64)
    q = jnp.ones((1, s, hq, 128), jnp.bfloat16)
    kv = jnp.ones((1, s, hkv, 128), jnp.bfloat16)
    for window in (None, (300, 0)):
        seen.clear()
        jax.grad(lambda q: flash_attention(q, kv, kv, causal=True, sliding_window=window, block_mask=mask,
                                           platform="triton").astype(jnp.float32).sum())(q)
        assert [k.__name__ for k, *_ in seen] == ["gluon_attention_fwd_kernel", "gluon_attention_bwd_kernel"]
        (fk, fgrid, fin, fouts, fkw), (bk, bgrid, bin_, bouts, bkw) = seen
        for kernel, inputs, outs, kw in ((fk, fin, fouts, fkw), (bk, bin_, bouts, bkw)):
            names = kernel.arg_names
            assert set(names[len(inputs) + len(outs):]) == set(kw) - {"zeroed", "aliases", "num_warps", "num_stages"}
        f, b = dict(zip(fk.arg_names, fin)), dict(zip(bk.arg_names, bin_))
        assert fkw["LIST"] and fkw["ORDERED"] and (fkw["LIST_BATCH"], fkw["LIST_HEADS"]) == (1, hq)
        assert (fkw["SUB_Q"], fkw["SUB_K"]) == (64, 64) and fkw["WINDOW"] == (window is not None)
        cfg = AttentionConfig(seq_q=s, seq_k=s, causal=True, window=window is not None, layout=True,
                              layout_block=(64, 64))
        ctx = {"layout": jnp.asarray(lay.reshape(1, hkv, hq // hkv, s // 64, s // 64)),
               "window_left": jnp.int32(300), "window_right": jnp.int32(0)}
        np.testing.assert_array_equal(f["RANGES"], gluon_attention.fwd_lists(ctx, cfg, s)[0])
        assert sorted(f["ORDER"].tolist()) == list(range(5 * hq))
        work = np.asarray(gluon_attention.fwd_lists(ctx, cfg, s)[2])[0]  # [hq, N_M]
        if fkw["DYNAMIC"]:  # one list, heaviest first
            assert np.all(np.diff(work[f["ORDER"] % hq, f["ORDER"] // hq]) <= 0)
        assert bkw["LIST"] == 2 and (bkw["LIST_BATCH"], bkw["LIST_HEADS"]) == (1, hkv) and bgrid == (5, hkv)
        assert (bkw["SUB_Q"], bkw["SUB_K"]) == (64, 64) and bkw["MASK"] == (2 if window else 1)
        np.testing.assert_array_equal(b["RANGES"], gluon_attention.bwd_lists(ctx, cfg, s, hkv)[0])
        order = b["ORDER"]
        assert sorted(order.tolist()) == list(range(5 * hkv))
        items = np.asarray(gluon_attention.bwd_lists(ctx, cfg, s, hkv)[2])[0]  # [hkv, N_N]
        assert np.all(np.diff(items[order % hkv, order // hkv]) <= 0)  # most work first


def test_the_list_kernels_compile_for_sm90_without_spills():
    """LIST forward and backward (head-shared and per-head layouts, sub-block words, with causal, segment ids, the
    dynamic tile queue, GQA; bf16 head dim 128 and f16 64) compile for sm_90 with no spill, 12 warps, shared memory
    within Hopper's 227 KB, and read the lists by plain loads; the kernels without lists are unchanged (their PTX:
    benchmarks/ptx_digest.py)."""
    from ejgen.testing.aot import compile_all_in_subprocess

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    results = compile_all_in_subprocess([dict(gluon=True, with_ptx=True, **kw) for kw in LIST_COMPILES])
    _check_list_compiles(results)


LIST_COMPILES = [
    dict(dtype="bfloat16", head_dim=128, causal=False, layout=[64, 64, False], dynamic=True),
    dict(dtype="bfloat16", head_dim=128, causal=True, segments=True, layout=[128, 128, True]),
    dict(dtype="float16", head_dim=64, causal=True, layout=[32, 256, True]),
]


def _check_list_compiles(results):
    for kw, compiled in zip(LIST_COMPILES, results):
        assert "error" not in compiled, (kw, compiled.get("error"))
        assert set(compiled) == {"gluon_fwd_kernel", "gluon_bwd_kernel"}, kw
        for name, meta in compiled.items():
            assert meta["warps"] == 12 and meta["cubin"] and meta["wgmma"], (kw, name)
            assert meta["shared"] <= 227 * 1024, (kw, name, meta["shared"])
            assert "ld.local" not in meta["ptx"], f"{kw} {name}: registers spilled"
            assert "wgmma.wait_group.sync.aligned 1" in meta["ptx"] or name != "gluon_fwd_kernel", kw


def test_the_docs_form_compiles_on_the_gpu_hosts_triton():
    """The forward's DOCS form of packed documents (`host.DOCS_MASKS`) with the GPU host's Triton (3.6): it compiles
    for sm_90 with the ids' one-predicate select, at most one 4-byte slot spilled (3.6 keeps one at kernel entry)."""
    from ejgen.testing.aot import by_gpu_host_triton, compile_all_in_subprocess, gpu_host_triton

    (compiled,) = compile_all_in_subprocess([dict(gluon=True, dtype="bfloat16", head_dim=128, causal=True,
                                                  segments=True, docs_masks=True, forward_only=True, with_ptx=True,
                                                  with_resources=True)], triton=gpu_host_triton())
    assert "error" not in compiled, compiled.get("error")
    meta = compiled["gluon_fwd_kernel"]
    assert by_gpu_host_triton(meta) and meta["cubin"] and meta["wgmma"] and meta["shared"] <= 227 * 1024, meta
    assert ".reg .pred p;" in meta["ptx"] and meta["stack"] <= 8, meta["stack"]


@pytest.mark.parametrize("triton", ["here", "gpu host"])
def test_the_rings_last_forward_compiles(triton):
    """The forward as the ring's coalesced last step launches it (a block layout of 2 x 2 chunks, the dynamic queue):
    with KV_AT (K and V read out of one buffer of unsigned 16-bit items: the received block, `ring.KV_FROM_WIRE`),
    and with MERGE too (its result merged into the first step's in the epilogue, `ring.MERGE_IN_KERNEL`), then
    walking each tile's span of key blocks instead of a list (SPANS, `host.LAYOUT_SPANS`, off by default), on
    this machine's Triton and the GPU host's (3.6): each compiles for sm_90 with TMA loads and no spill; MERGE's
    epilogue reads the earlier rows (global loads the plain one has none of); the spans' queue passes over empty
    tiles by more fetch-and-adds."""
    from ejgen.testing.aot import by_gpu_host_triton, compile_all_in_subprocess, gpu_host_triton

    call = dict(gluon=True, dtype="bfloat16", head_dim=128, causal=False, seq=2048, heads=4, kv_heads=4, batch=1,
                layout=(1024, 1024, False), dynamic=True, kv_wire=True, forward_only=True, with_ptx=True,
                with_resources=True)
    results = compile_all_in_subprocess([call, dict(call, merge=True), dict(call, merge=True, layout=None, spans=True)],
                                        triton=gpu_host_triton() if triton == "gpu host" else None)
    loads, atomics = [], []
    for compiled in results:
        assert "error" not in compiled, compiled.get("error")
        meta = compiled["gluon_fwd_kernel"]
        assert meta["cubin"] and meta["wgmma"] and meta["shared"] <= 227 * 1024 and meta["stack"] <= 8, meta["stack"]
        assert "cp.async.bulk.tensor" in meta["ptx"]
        assert triton == "here" or by_gpu_host_triton(meta), meta["triton"]
        loads.append(meta["ptx"].count("ld.global"))
        atomics.append(meta["ptx"].count("atom.global"))
    assert loads[1] > loads[0] and atomics[2] > atomics[1], (loads, atomics)


def test_the_list_kernels_compile_on_the_gpu_hosts_triton():
    """The same LIST kernels with the GPU host's Triton (EJGEN_GPU_HOST_TRITON: 3.6 where 3.9 is installed)."""
    from ejgen.testing.aot import by_gpu_host_triton, compile_all_in_subprocess, gpu_host_triton

    results = compile_all_in_subprocess([dict(gluon=True, with_ptx=True, **kw) for kw in LIST_COMPILES],
                                        triton=gpu_host_triton())
    _check_list_compiles(results)
    assert all(by_gpu_host_triton(c) for r in results for c in r.values()), [c["triton"] for r in results for c in
                                                                             r.values()]


LAYOUT_GPU_CASES = [  # (id, shape, layout kind, block, per head, causal, dtype, more: documents / a window)
    ("random-128-gqa", AttnShape(2, 1000, 1000, 4, 2, 128), "random", 128, True, False, "bfloat16", {}),
    ("random-64-causal", AttnShape(1, 1536, 1536, 4, 4, 128), "random", 64, False, True, "bfloat16", {}),
    ("local-global-64-d64", AttnShape(1, 2048, 2048, 2, 1, 64), "local+global", 64, False, False, "float16", {}),
    ("local-global-32-causal-gqa", AttnShape(1, 1100, 1100, 8, 2, 128), "local+global", 32, True, True, "bfloat16",
     {}),
    ("random-256-causal-documents", AttnShape(2, 1300, 1300, 4, 2, 128), "random", 256, False, True, "bfloat16",
     {"documents": (500, 1, 640)}),  # then padding
    ("local-global-64-causal-window", AttnShape(1, 1800, 1800, 2, 2, 128), "local+global", 64, True, True, "bfloat16",
     {"sliding_window": (300, 0)}),
]


def _gpu_layout(kind, seq, block, heads, rng):
    import numpy as np

    n = _cdiv(seq, block)
    if kind == "random":  # 20% of the blocks, the diagonal, an empty query row and an empty key column
        lay = (rng.random((1, heads, n, n)) < 0.2) | np.eye(n, dtype=bool)
        lay[..., 2, :] = False
        lay[..., :, 3] = False
    else:  # a window of 4 blocks either side, the first block global
        i, j = np.arange(n)[:, None], np.arange(n)[None]
        lay = np.broadcast_to((np.abs(i - j) <= 4) | (i == 0) | (j == 0), (1, heads, n, n)).copy()
        lay[..., 1:, 1:] &= rng.random((1, heads, n - 1, n - 1)) > 0.1  # holes, per head where given
    return lay


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TWO_COLUMN_LAYOUTS) + ["per batch row"])
def test_gluon_layout_spans_merged_match_the_oracle(monkeypatch, triton_launches, name):
    """A layout of two key columns merged into an earlier result (the ring's wide step: SPANS, `host.LAYOUT_SPANS`)
    on the Hopper forward, on 7 SMs (programs cross many tiles, empty ones passed over in the queue), GQA, keys past
    the last whole tile: out and lse against the float64 softmax over both key sets (the layout's keys and the
    earlier result's); the rows of a layout row that sees nothing keep the earlier result bit for bit."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.runtime.attention.triton import host as triton_host
    from ejgen.types import BlockMask

    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 7)
    monkeypatch.setattr(gluon_attention, "LAYOUT_SPANS", True)
    b, s, hq, hkv, d = 2, 1000, 4, 2, 128
    layout = np.asarray(TWO_COLUMN_LAYOUTS.get(name, [[True, False], [False, True]]))[None, None]
    if name == "per batch row":
        layout = np.stack([TWO_COLUMN_LAYOUTS["row 1"], TWO_COLUMN_LAYOUTS["column 0"]])[:, None]
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((b, s, n, d)).astype(np.float32) for n in (hq, hkv, hkv))
    out0 = rng.standard_normal((b, s, hkv, hq // hkv, d)).astype(np.float32)
    lse0 = rng.standard_normal((b, hkv, hq // hkv, s)).astype(np.float32) + 3.0
    q, k, v, out0 = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, out0))
    monkeypatch.setattr(triton_host, "given_merge", lambda ctx: (ctx, (out0, jnp.asarray(lse0))))
    mask = BlockMask.from_layout(jnp.asarray(layout), s, s, 512, 512)
    out, lse = jax.jit(lambda q, k, v: flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                                       platform="triton"))(q, k, v)
    assert [kw["SPANS"] for _, kw in triton_launches] == [True], triton_launches

    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    qg = f64(q).reshape(b, s, hkv, hq // hkv, d)
    sc = np.einsum("bqhgd,bkhd->bhgqk", qg, f64(k)) / np.sqrt(d)
    seen = np.repeat(np.repeat(np.broadcast_to(layout[:, 0], (b, 2, 2)), 512, axis=1), 512, axis=2)[:, :s, :s]
    sc = np.where(seen[:, None, None], sc, -np.inf)
    top = np.max(sc, axis=-1, keepdims=True)
    e = np.exp(sc - np.where(np.isfinite(top), top, 0.0))
    den1 = e.sum(-1)
    lse1 = np.where(den1 > 0, np.log(np.where(den1 > 0, den1, 1.0)) + top[..., 0], -np.inf)
    out1 = np.einsum("bhgqk,bkhd->bqhgd", e / np.where(den1 > 0, den1, 1.0)[..., None], f64(v))
    lse_all = np.logaddexp(f64(lse0), lse1)
    w0, w1 = np.exp(f64(lse0) - lse_all), np.exp(lse1 - lse_all)
    want = f64(out0) * np.moveaxis(w0, -1, 1)[..., None] + out1 * np.moveaxis(w1, -1, 1)[..., None]
    got_out = f64(out).reshape(want.shape)
    got_lse = f64(lse).reshape(lse_all.shape)
    assert np.abs(got_out - want).max() < 2e-2 * np.abs(want).max(), np.abs(got_out - want).max()
    np.testing.assert_allclose(got_lse, lse_all, atol=2e-3)
    none = ~seen.any(axis=2)  # [b, s]: rows whose layout row sees no key
    assert none.any() == (name in ("row 1", "none", "per batch row")), name
    np.testing.assert_array_equal(np.asarray(out.reshape(out0.shape))[none], np.asarray(out0)[none])
    np.testing.assert_array_equal(got_lse.transpose(0, 3, 1, 2)[none], f64(lse0).transpose(0, 3, 1, 2)[none])


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("shape,kind,block,per_head,causal,dtype,more", [c[1:] for c in LAYOUT_GPU_CASES],
                         ids=[c[0] for c in LAYOUT_GPU_CASES])
def test_gluon_block_layouts_match_the_oracle(monkeypatch, triton_launches, run_vjp, shape, kind, block, per_head,
                                              causal, dtype, more, dynamic):
    """Block layouts (random with an empty query row and key column, local + global; blocks of 256, 128, 64 and 32
    against the kernels' tiles; per head and shared; GQA; causal and not; with packed documents and padding; with a
    causal window) on the Hopper kernels' lists (LIST), forward and backward against the float64 oracle, on 7 SMs
    (programs cross many tiles) with the static split and the dynamic tile queue."""
    import numpy as np

    import oracle
    from ejgen.ops import flash_attention
    from ejgen.testing.shapes import random_cotangents, random_qkv, rng_for
    from ejgen.types import BlockMask, MaskInfo

    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 7)
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "1" if dynamic else "0")
    if not gluon_attention.hopper():
        pytest.skip("not a Hopper GPU")
    rng = rng_for(f"gluon-layout-{shape}-{kind}-{block}")
    lay = _gpu_layout(kind, shape.q_len, block, shape.q_heads if per_head else 1, rng)
    mask = BlockMask.from_layout(lay, shape.q_len, shape.kv_len, block, block)
    diff = random_qkv(shape, dtype, rng)
    d_out, d_lse = random_cotangents(shape, dtype, rng)
    rest, static, ids = {"block_mask": mask}, {"causal": causal, "platform": "triton"}, None
    if "documents" in more:  # documents of these lengths, then padding; the last batch row rolled
        ids = np.full((shape.batch, shape.q_len), -1, np.int32)
        starts = np.cumsum((0,) + more["documents"])
        for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            ids[:, a:b] = i
        ids[-1] = np.roll(ids[-1], 77)
        rest["mask_info"] = MaskInfo.from_segments(jnp.asarray(ids))
    if "sliding_window" in more:
        static["sliding_window"] = more["sliding_window"]
    out, lse, grads = run_vjp(flash_attention, diff, rest, static, d_out, d_lse)
    ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, causal=causal,
                           sliding_window=more.get("sliding_window"), q_segment_ids=ids, kv_segment_ids=ids,
                           attention_mask=np.asarray(mask.dense(shape.batch, shape.q_heads)), d_out=d_out, d_lse=d_lse)
    oracle.check_attention(out, lse, grads, ref, diff, dtype)
    assert {k for k, _ in triton_launches} == {"fwd", "bwd"}, triton_launches
    assert all(kw["LIST"] and kw["SEGMENTS"] == (ids is not None) for _, kw in triton_launches), triton_launches
    assert all(kw["DYNAMIC"] == dynamic for k, kw in triton_launches if k == "fwd"), triton_launches


# (dtype, head dim, soft cap): the persistent backward with segment ids (`host.PERSISTENT_SEGMENTS_BWD`), causal
PERSISTENT_SEGMENTS_COMPILES = [("bfloat16", 128, False), ("float16", 64, False), ("bfloat16", 128, True)]


def _check_persistent_segments(results):
    for (dtype, d, softcap), compiled in zip(PERSISTENT_SEGMENTS_COMPILES, results):
        assert "error" not in compiled, (dtype, d, compiled.get("error"))
        assert set(compiled) == {"gluon_fwd_kernel", "gluon_bwd_kernel", "gluon_bwd_persistent_kernel"}, (dtype, d)
        meta = compiled["gluon_bwd_persistent_kernel"]
        assert meta["warps"] == 12 and meta["cubin"] and meta["wgmma"], (dtype, d)
        assert meta["shared"] <= 227 * 1024, (dtype, d, meta["shared"])  # 512 B of ids more than the window's
        # no spill (as the window's persistent kernel); with a soft cap the backwards' budget (the window's persistent
        # kernel: 88 B on 3.9, 16 on 3.6; this one 64 / 80)
        budget = SOFTCAP_SPILL_BUDGET if softcap else 0
        assert meta["stack"] <= budget, f"{dtype} {d} {softcap}: {meta['stack']} B spilled (budget {budget})"
        assert softcap or "ld.local" not in meta["ptx"], (dtype, d)
        assert "atom.global" in meta["ptx"], f"{dtype} {d}: tiles from an atomic counter"
        assert "cp.reduce.async.bulk.tensor" in meta["ptx"], f"{dtype} {d}: dQ by bulk reduce-adds"
        assert "setmaxnreg" in meta["ptx"] and "cp.async.bulk.tensor" in meta["ptx"], (dtype, d)


def _persistent_segments_requests():
    return [dict(gluon=True, dtype=dtype, head_dim=d, causal=True, segments=True, persistent_segments=True,
                 softcap=softcap, with_ptx=True, with_resources=True)
            for dtype, d, softcap in PERSISTENT_SEGMENTS_COMPILES]


def test_the_persistent_backward_with_segment_ids_compiles_for_sm90():
    """The persistent backward taking segment ids (`gluon_attention_bwd_persistent_kernel` with SEGMENTS, behind
    `host.PERSISTENT_SEGMENTS_BWD`) for causal packed documents, bf16 head dim 128 and f16 64: it compiles for sm_90
    with no spill (as the window's persistent kernel; a soft cap within the backwards' budget), within Hopper's
    shared memory, its tiles from the counter."""
    from ejgen.testing.aot import compile_all_in_subprocess

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    _check_persistent_segments(compile_all_in_subprocess(_persistent_segments_requests()))


def test_the_persistent_backward_with_segment_ids_compiles_on_the_gpu_hosts_triton():
    """The same with the GPU host's Triton (EJGEN_GPU_HOST_TRITON: 3.6 where 3.9 is installed)."""
    from ejgen.testing.aot import by_gpu_host_triton, compile_all_in_subprocess, gpu_host_triton

    results = compile_all_in_subprocess(_persistent_segments_requests(), triton=gpu_host_triton())
    _check_persistent_segments(results)
    assert all(by_gpu_host_triton(r["gluon_bwd_persistent_kernel"]) for r in results), results


def test_the_persistent_backward_takes_segment_ids_only_when_switched_on(monkeypatch):
    """`host.persistent_segments_bwd`: on by default, for causal calls with segment ids and no window, lists or
    spec mask, and never with the switch off; its constexprs: MASK 1 and SEGMENTS, the V buffers that fit next to
    the ids' rows; the window's persistent kernel keeps its constexprs (SEGMENTS False)."""
    call = AttentionConfig(seq_q=1024, seq_k=1024, causal=True, segments=True)
    assert gluon_attention.PERSISTENT_SEGMENTS_BWD and gluon_attention.persistent_segments_bwd(call, False)
    monkeypatch.setattr(gluon_attention, "PERSISTENT_SEGMENTS_BWD", False)
    assert not gluon_attention.persistent_segments_bwd(call, False)
    monkeypatch.setattr(gluon_attention, "PERSISTENT_SEGMENTS_BWD", True)
    assert not gluon_attention.persistent_segments_bwd(call, True)  # lists
    assert not gluon_attention.persistent_segments_bwd(call, gluon_attention.listed(call, True, "bwd"))  # spec mask
    assert not gluon_attention.persistent_segments_bwd(call, False, switch=False)
    assert gluon_attention.persistent_segments_bwd(call, False, switch=True)
    for other in (dict(causal=False, segments=True), dict(causal=True, window=True, segments=True),
                  dict(causal=True)):
        assert not gluon_attention.persistent_segments_bwd(AttentionConfig(seq_q=1024, seq_k=1024, **other), False)
    for d in gluon_attention.HEAD_DIMS:
        consts = gluon_attention.pbwd_constexprs(1, 16, 16, 8192, d, segments=True)
        assert consts["MASK"] == 1 and consts["SEGMENTS"] is True, consts
        assert set(consts) == set(gluon_attention.pbwd_constexprs(1, 16, 16, 8192, d)), consts
        smem = gluon_attention.pbwd_smem_bytes(d, consts["V_STAGES"], consts["DQ_MODE"], segments=True)
        assert smem + gluon_attention.SMEM_RESERVE <= gluon_attention.SMEM_LIMIT, (d, smem)
    window = gluon_attention.pbwd_constexprs(1, 16, 16, 8192, 128)
    assert window["SEGMENTS"] is False and window["MASK"] == 2, window
    assert gluon_attention.pbwd_kernel().arg_names[8:12] == ["QSEG", "KSEG", "RANGES", "ORDER"]


def _pbwd_walk(order, work, programs):
    """The persistent backward's tile counter (numpy): program p takes place p first, then whichever program frees
    first takes the next place (each tile costs its work plus a fixed 1); returns (place -> program, the
    programs' finishing times)."""
    import heapq

    free, owner = [], []
    for place in range(len(order)):
        t, p = (0.0, place) if place < programs else heapq.heappop(free)
        owner.append(p)
        heapq.heappush(free, (t + 1 + work[order[place]], p))
    return owner, sorted(t for t, _ in free)


@pytest.mark.parametrize("seq,batch,hkv,programs", [(2048, 2, 2, 7), (8192, 1, 4, 132), (1500, 1, 2, 5)])
def test_the_persistent_backward_with_segment_ids_visits_the_per_program_kernels_blocks(seq, batch, hkv, programs):
    """numpy model of `gluon_attention_bwd_segments_persistent_kernel`'s walk: the places of `bwd_order` handed out
    by the tile counter reach every (key block, batch * kv head) tile exactly once, decoded as the kernel decodes
    them (n = e // (B * HKV)), and each tile's query blocks (`_qblock_range`'s causal range joined with the ids'
    RANGES, `_pbwd_tile_range`) hold every (key block, query block) pair with a visible (query, key) pair, the ones
    taken without the element mask wholly visible; heaviest first, the programs finish within one tile of each
    other's (longest-processing-time first)."""
    import numpy as np

    bm, bn = gluon_attention.BWD_TILES["BLOCK_M"], gluon_attention.BWD_TILES["BLOCK_N"]
    rng = np.random.default_rng(seq)
    ids = np.full((batch, seq), -1, np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=7, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(seq), side="right")
        ids[b, rng.integers(seq // 2, seq):] = -1  # padding to the end
    ids[-1] = np.roll(ids[-1], 37)  # a padding run first
    cfg = AttentionConfig(seq_q=seq, seq_k=seq, causal=True, segments=True)
    j = jnp.asarray(ids)
    ranges = np.asarray(gluon_attention.segment_ranges({"q_seg": j, "kv_seg": j}, cfg, seq, "bwd"))
    order = np.asarray(gluon_attention.bwd_order(jnp.asarray(ranges), hkv, seq, True))
    n_n, n_m, bh = -(-seq // bn), -(-seq // bm), batch * hkv
    assert sorted(order.tolist()) == list(range(n_n * bh))

    def tile(e):  # _pbwd_tile_range with MASK 1 (_qblock_range's causal part)
        n, b = e // bh, (e % bh) // hkv
        k_lo = n * bn
        m_lo, m_hi = k_lo // bm, n_m
        f0 = min(max(m_lo, (k_lo + bn - 1 + bm - 1) // bm), m_hi)
        f1 = max(f0, min(seq // bm * min((seq - k_lo) // bn, 1), m_hi))
        r = ranges[b, n]
        m_lo = max(m_lo, r[0])
        m_hi = max(min(m_hi, r[1]), m_lo)
        return n, b, m_lo, m_hi, max(f0, r[2]), min(f1, r[3])

    work = {e: tile(e)[3] - tile(e)[2] for e in range(n_n * bh)}
    owner, finish = _pbwd_walk(order, work, programs)
    assert len(owner) == n_n * bh and set(owner) <= set(range(programs))
    assert finish[-1] - finish[0] <= 1 + max(work.values()), finish  # LPT: within one tile
    q = np.arange(seq)
    for e in order:
        n, b, m_lo, m_hi, f0, f1 = tile(int(e))
        keys = np.arange(n * bn, min(n * bn + bn, seq))
        for m in range(n_m):
            rows = q[m * bm:m * bm + bm]
            vis = (ids[b, rows][:, None] == ids[b, keys][None, :]) & (ids[b, rows][:, None] >= 0) & \
                (rows[:, None] >= keys[None, :])
            if vis.any():
                assert m_lo <= m < m_hi, (e, n, b, m, m_lo, m_hi)
            if f0 <= m < f1:  # taken without the element mask: every pair visible, a whole block
                assert vis.all() and len(rows) == bm and len(keys) == bn, (e, n, b, m, f0, f1)
    assert work[order[0]] == max(work.values())


@pytest.mark.parametrize("switch", [False, True])
def test_the_documents_backward_launches_the_persistent_kernel_when_switched_on(monkeypatch, switch):
    """On a (pretended) Hopper GPU, causal packed documents: with `host.PERSISTENT_SEGMENTS_BWD` the backward is
    `gluon_attention_bwd_persistent_kernel` with SEGMENTS, its arguments in signature order (QSEG, KSEG, RANGES,
    ORDER after I32: the ids, `segment_ranges(..., "bwd")` and `bwd_order` of them), the persistent grid and the
    dQ accumulator and tile counter zeroed (the default); off, the per-program kernel."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.types import MaskInfo

    seen = pretend_hopper(monkeypatch, sms=7)
    monkeypatch.setattr(gluon_attention, "PERSISTENT_SEGMENTS_BWD", switch)
    b, s, hq, hkv, d = 2, 600, 4, 2, 128
    ids = np.repeat(np.array([0] * 130 + [1] * 300 + [2] * 100 + [-1] * 70, np.int32)[None], b, 0)
    mask = MaskInfo.from_segments(jnp.asarray(ids))
    q = jnp.ones((b, s, hq, d), jnp.bfloat16)
    kv = jnp.ones((b, s, hkv, d), jnp.bfloat16)
    loss = lambda q, k, v: flash_attention(q, k, v, causal=True, mask_info=mask,
                                           platform="triton").astype(jnp.float32).sum()
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, kv, kv))
    kernels = [kernel.__name__ for kernel, *_ in seen]
    bwd = "gluon_attention_bwd_persistent_kernel" if switch else "gluon_attention_bwd_kernel"
    assert kernels == ["gluon_attention_fwd_kernel", bwd], kernels
    kernel, grid, inputs, outs, kw = seen[1]
    names = kernel.arg_names
    assert len(inputs) + len(outs) + len(set(kw) & set(names)) == len(names)
    assert set(names[len(inputs) + len(outs):]) == set(kw) - {"zeroed", "aliases", "num_warps", "num_stages"}
    assert names[8:12] == ["QSEG", "KSEG", "RANGES", "ORDER"] and kw["SEGMENTS"] and kw["MASK"] == 1
    cfg = AttentionConfig(seq_q=s, seq_k=s, causal=True, segments=True)
    ranges = gluon_attention.segment_ranges({"q_seg": jnp.asarray(ids), "kv_seg": jnp.asarray(ids)}, cfg, s, "bwd")
    order = gluon_attention.bwd_order(ranges, hkv, s, True)
    np.testing.assert_array_equal(inputs[8], ids)
    np.testing.assert_array_equal(inputs[10], np.asarray(ranges))
    np.testing.assert_array_equal(inputs[11], np.asarray(order))
    if switch:
        assert grid == (7,) and kw["zeroed"] == (0, 3)  # 20 (key block, batch * kv head) tiles on 7 SMs
        assert names[len(inputs) + 3] == "TILE_CTR" and (outs[3].shape, outs[3].dtype) == ((1, ), jnp.int32)
    else:
        assert grid == (5, b * hkv) and kw["zeroed"] == (0, )
