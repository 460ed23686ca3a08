"""The warp-specialised Gluon forward and backward (ejgen.runtime.attention.gluon.host) of the triton backend.

Here (no GPU): the kernels compile ahead of time for sm_90 (bf16 and f16, head dims 64 and 128, mask forms)
within the launch's budget of warps, shared memory and descriptor scratch; which calls they take and why
the others keep the generated Triton kernels. On an H100/H200 (`pytest -m gpu`): forward and backward of
the calls they take against the float64 oracle, with a spy showing which kernels ran.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton", reason="the triton extra is part of the test install (README)")

from ejgen.testing.shapes import AttnShape  # noqa: E402

from ejgen.runtime.attention.config import AttentionConfig  # noqa: E402
from ejgen.runtime.attention.gluon import host as gluon_attention  # noqa: E402
from ejgen.runtime.core import kernels as core_kernels  # noqa: E402
from ejgen.runtime.launch import triton_call  # noqa: E402
from ejgen.testing.aot import compile_gluon_in_subprocess  # noqa: E402

pytestmark = pytest.mark.usefixtures("x64_stays_off")

ON_GPU = jax.default_backend() == "gpu"


def _layout(spec: str):
    import importlib

    return importlib.import_module(f"ejgen.generated.{spec}.triton_launch").LAYOUT


@pytest.mark.parametrize("dtype,d,causal,window,segments", [("bfloat16", 128, True, True, False),
                                                            ("float16", 64, False, False, False),
                                                            ("bfloat16", 128, True, False, True)])
def test_the_kernel_compiles_for_sm90_within_the_launch_budget(dtype, d, causal, window, segments):
    if not gluon_attention.importable()[0]:
        pytest.fail(f"the test install's Triton has no Gluon warp specialisation: {gluon_attention.importable()[1]}")
    compiled = compile_gluon_in_subprocess(dtype=dtype, head_dim=d, causal=causal, window=window, segments=segments,
                                           with_ptx=True)
    persistent_bwd = ("gluon_bwd_persistent_kernel", ) if causal and window else ()
    assert set(compiled) == {"gluon_fwd_kernel", "gluon_bwd_kernel", *persistent_bwd}
    for name in compiled:
        meta = compiled[name]
        assert meta["warps"] == 12, "two consumer warpgroups and a producer warp (padded to a warpgroup)"
        assert 0 < meta["global_scratch"] <= triton_call.SCRATCH_PER_PROGRAM, name  # the descriptors
        assert meta["shared"] <= 227 * 1024, (name, meta["shared"])  # Hopper's shared memory per block
        assert meta["cubin"] and meta["wgmma"]
        assert "setmaxnreg" in meta["ptx"] and "cp.async.bulk.tensor" in meta["ptx"], name
        assert "wgmma.wait_group.sync.aligned 1" in meta["ptx"], f"{name}: an exp under a wgmma in flight"
        assert "ld.local" not in meta["ptx"], f"{name}: registers spilled"
    for name in ("gluon_bwd_kernel", *persistent_bwd):
        assert "cp.reduce.async.bulk.tensor" in compiled[name]["ptx"], f"{name}: dQ by bulk reduce-adds"
    if persistent_bwd:
        assert "atom.global" in compiled["gluon_bwd_persistent_kernel"]["ptx"], "tiles from an atomic counter"


def test_the_dynamic_tile_queue_compiles_like_the_static_split():
    """The forward with DYNAMIC (tiles from a fetch-and-add on TILE_CTR, each index handed to the consumers in its
    Q buffers' tile slots) and without, causal bf16 head dim 128 and f16 64 with segment ids: both compile for
    sm_90 with no spill and the same shared memory but the 16 B of tile slots (padded to 32); only DYNAMIC
    takes tiles by an atomic, publishes them by the arrives (expect-tx on q_ready, plain for the stop index) and
    reads them back from shared memory."""
    from ejgen.testing.aot import compile_all_in_subprocess

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    calls = [dict(dtype="bfloat16", head_dim=128, causal=True), dict(dtype="float16", head_dim=64, causal=False,
                                                                     segments=True)]
    requests = [dict(gluon=True, forward_only=True, with_ptx=True, dynamic=dynamic, **c) for c in calls
                for dynamic in (False, True)]
    results = compile_all_in_subprocess(requests)
    for c, (static, dynamic) in zip(calls, zip(results[::2], results[1::2])):
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
    ("prefix_lm_attention", _cfg(), _qkv(), False, "the spec has a mask of its own"),
    ("alibi_attention", _cfg(causal=True), _qkv(), False, "the spec's score is not the scaled dot product"),
    ("flash_attention", _cfg(softcap=True), _qkv(), False, "soft cap (the Hopper kernels take none of"),
    ("flash_attention", _cfg(varlen=True), _qkv(), False, "varlen (the Hopper kernels take none of"),
    ("flash_attention", _cfg(layout=True, positions=True), _qkv(), False, "a block layout, positions (the Hopper"),
    ("flash_attention", _cfg(), _qkv(dtype=jnp.float32), False, "dtype float32"),
    ("flash_attention", _cfg(), _qkv(d=96), False, "head dims 96/96"),
    ("flash_attention", _cfg(), _qkv(dv=64), False, "head dims 128/64"),
    ("flash_attention", _cfg(seq_k=640), _qkv(sk=640), False, "Sq 512 != Sk 640"),
    ("flash_attention", _cfg(segments=True, dense_mask=True), _qkv(), False, "a dense mask (the Hopper"),
])
def test_calls_the_kernel_does_not_cover_say_why(spec, cfg, arrays, pinned, reason):
    why = gluon_attention.ineligible(_layout(spec), cfg, *arrays, pinned)
    assert why is not None and why.startswith(reason), why


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
    documents = _cfg(causal=True, window=True, window_span=1024, segments=True)
    assert gluon_attention.ineligible(layout, documents, *arrays, False, "bwd").startswith("segment ids with a sliding")


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


GPU_CASES = [  # (id, shape, features, dtype): calls the Gluon forward takes
    ("causal-gqa-d64-ragged", AttnShape(2, 300, 300, 4, 2, 64), dict(causal=True), "bfloat16"),
    ("plain-d128", AttnShape(1, 384, 384, 2, 2, 128), dict(), "bfloat16"),
    ("causal-window-d128-ragged", AttnShape(1, 3000, 3000, 2, 1, 128), dict(causal=True, sliding_window=(2100, 0)),
     "bfloat16"),
    ("two-sided-window-f16", AttnShape(1, 2600, 2600, 2, 2, 64), dict(sliding_window=(1100, 1000)), "float16"),
    ("causal-f16-d128", AttnShape(1, 512, 512, 4, 1, 128), dict(causal=True), "float16"),
]


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
    two_sided = window and not features.get("causal")
    # the Gluon backward: one kernel, the persistent one for causal windows
    assert backward == (["dq", "dkdv"] if two_sided else ["persistent"] if window else ["bwd"]), backward



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

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    seen = []

    def fake_launch(kernel, grid, inputs, outs, **kw):
        seen.append((kernel, grid, inputs, outs, kw))
        return [jnp.zeros(o.shape, o.dtype) for o in outs]

    monkeypatch.setattr(triton_call, "mode", lambda: ("gpu", ""))
    monkeypatch.setattr(triton_call, "launch", fake_launch)
    monkeypatch.setattr(core_kernels, "target", lambda: core_kernels.Target("gpu", "sm90"))
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 7)
    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.delenv("EJGEN_GLUON", raising=False)
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
    launch_options = {"zeroed", "num_warps", "num_stages"}
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


def test_document_masks_reach_the_kernels_with_their_tile_ranges(monkeypatch):
    """Segment ids on a (pretended) Hopper GPU: both Gluon kernels take the ids and their tile ranges (the forward
    per 128-row query tile in key blocks, the backward per key block in 64-row query blocks), SEGMENTS on; the
    ranges are the segment ids' own (`block_mask.tile_ranges`), the kernels join them with causal. A fake launch."""
    import numpy as np

    from ejgen.ops import flash_attention
    from ejgen.types import MaskInfo

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    seen = []

    def fake_launch(kernel, grid, inputs, outs, **kw):
        values = []  # the inputs' values, once the call runs (they are traced here)
        jax.debug.callback(lambda *xs: values.extend(np.asarray(x) for x in xs), *inputs)
        seen.append((kernel, grid, values, outs, kw))
        return [jnp.zeros(o.shape, o.dtype) for o in outs]

    monkeypatch.setattr(triton_call, "mode", lambda: ("gpu", ""))
    monkeypatch.setattr(triton_call, "launch", fake_launch)
    monkeypatch.setattr(core_kernels, "target", lambda: core_kernels.Target("gpu", "sm90"))
    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.delenv("EJGEN_GLUON", raising=False)
    s = 640  # documents [0, 300), [300, 512), padding [512, 640)
    ids = np.where(np.arange(s) < 300, 0, np.where(np.arange(s) < 512, 1, -1)).astype(np.int32)[None]
    q = jnp.ones((1, s, 2, 128), jnp.bfloat16)
    loss = lambda q: flash_attention(q, q, q, causal=True, mask_info=MaskInfo.from_segments(jnp.asarray(ids)),
                                     platform="triton").astype(jnp.float32).sum()
    jax.grad(loss)(q)
    assert [k.__name__ for k, *_ in seen] == ["gluon_attention_fwd_kernel", "gluon_attention_bwd_kernel"]
    for kernel, grid, inputs, outs, kw in seen:
        names = kernel.arg_names
        assert kw["SEGMENTS"] and set(names[len(inputs) + len(outs):]) == set(kw) - {"zeroed", "num_warps", "num_stages"}
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

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    seen = []

    def fake_launch(kernel, grid, inputs, outs, **kw):
        values = []
        jax.debug.callback(lambda *xs: values.extend(np.asarray(x) for x in xs), *inputs)
        seen.append((kernel, grid, values, outs, kw))
        return [jnp.zeros(o.shape, o.dtype) for o in outs]

    monkeypatch.setattr(triton_call, "mode", lambda: ("gpu", ""))
    monkeypatch.setattr(triton_call, "launch", fake_launch)
    monkeypatch.setattr(core_kernels, "target", lambda: core_kernels.Target("gpu", "sm90"))
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 3)
    for var in ("EJGEN_TRITON_CONFIG", "EJGEN_GLUON", "EJGEN_GLUON_DYNAMIC_TILES"):
        monkeypatch.delenv(var, raising=False)
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
        assert set(names[len(inputs) + len(outs):]) == set(kw) - {"zeroed", "num_warps", "num_stages"}
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


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on Hopper GPUs only (compile check above)")
@pytest.mark.gpu
@pytest.mark.parametrize("shape,causal,lengths", [c[1:] for c in DOCUMENT_CASES], ids=[c[0] for c in DOCUMENT_CASES])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gluon_document_masks_match_the_oracle(monkeypatch, triton_launches, run_vjp, shape, causal, lengths, dynamic):
    """Packed documents (one-token ones, documents of exactly one tile, tiles of padding) on the Hopper kernels,
    forward and backward, against the float64 oracle, on few SMs (programs cross tiles); the forward's static split
    and its dynamic tile queue."""
    import numpy as np

    import oracle
    from ejgen.ops import flash_attention
    from ejgen.types import MaskInfo
    from ejgen.testing.shapes import random_cotangents, random_qkv, rng_for

    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    monkeypatch.setattr(gluon_attention, "num_sms", lambda: 7)
    monkeypatch.setenv("EJGEN_GLUON_DYNAMIC_TILES", "1" if dynamic else "0")
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
    kinds = {k for k, _ in triton_launches}
    assert kinds == {"fwd", "bwd"} and all(kw.get("SEGMENTS") for _, kw in triton_launches), triton_launches
    assert all(kw["DYNAMIC"] == dynamic for k, kw in triton_launches if k == "fwd"), triton_launches


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
