"""Shared fixtures: the backend list, the jit + vjp harness, a guard against x64 leaking."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

# Each family's helper modules (its oracle) sit next to its tests, and this file is shared by all:
# keep both importable under any pytest import mode.
_HERE = os.path.dirname(os.path.abspath(__file__))
_HELPERS: dict = {}  # module file name -> its folder: one name per family (docs/DESIGN.md §9), never shadowed
for _folder in (_HERE, *(os.path.join(_HERE, d) for d in sorted(os.listdir(_HERE)))):
    if os.path.isdir(_folder) and _folder not in sys.path:
        sys.path.insert(0, _folder)
        for _name in sorted(os.listdir(_folder)):
            if _name.endswith(".py") and not _name.startswith(("__init__", "conftest")):
                if _name in _HELPERS:  # a helper module would shadow the other; a test module fails to collect
                    raise RuntimeError(f"tests/: {_name} is in both {_HELPERS[_name]} and {_folder}; every test folder "
                                       "is on sys.path and test modules are imported by name: prefix it with its family")
                _HELPERS[_name] = _folder


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows ``flag`` (XLA aborts on an unknown one in XLA_FLAGS): one CPU client in a
    process of its own."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = "import jax; jax.numpy.zeros(1).block_until_ready()"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


if not os.path.exists("/dev/nvidiactl"):
    # No NVIDIA driver: every case compiles its own small graphs once on the CPU (the interpreted Pallas
    # kernels, the XLA backend), and XLA's CPU backend optimisations cost more compile time than they save in
    # run time (a quarter of the suite; semantics unchanged, fast math stays off). The CPU's older fusion emitters
    # (LLVM IR, not MLIR) compile the same graphs in a third of the time (a third of the suite). Set before JAX
    # starts, once per run: pytest-xdist's workers and the tests' subprocesses inherit the environment.
    _FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        if _xla_accepts("--xla_cpu_use_fusion_emitters=false"):
            _FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

ON_GPU = jax.default_backend() == "gpu"
if not ON_GPU:
    # Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before the
    # kernels are first imported (Triton decides when a kernel is decorated).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """In each process that runs tests (not pytest-xdist's controller): Triton's interpreter without its nested
    re-patching (``ejgen.testing.interpreter``; the kernels and what they compute are unchanged)."""
    if ON_GPU or (getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput")):
        return
    from ejgen.testing.interpreter import skip_nested_patches

    try:
        skip_nested_patches()
    except ImportError:  # no triton: its tests skip
        pass


BACKENDS = ["xla", "triton", "pallas"]
"""Backends every conformance test runs on."""

ACCELERATOR_BACKENDS = ("triton", "pallas")
"""On a GPU these run natively and carry the `gpu` mark (`pytest -m gpu` on the GPU host); on a
CPU they run in their interpreters."""

@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """The ``platform=`` value of the op under test."""
    return request.param

def pytest_configure(config):
    config.addinivalue_line("markers", "conformance(family): a case of a family's conformance design "
                                       "(tests/conformance.py)")

def pytest_collection_modifyitems(config, items):
    """On a GPU, tests of the accelerator backends are the `gpu` suite."""
    if not ON_GPU:
        return
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend") in ACCELERATOR_BACKENDS:
            item.add_marker(pytest.mark.gpu)

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A conformance case that skips fails: a backend either runs a case of the design or is declared to
    refuse it (tests/conformance.py); nothing in between."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("conformance") is not None:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: a conformance case skipped ({report.longrepr})"

# Test seconds (summed over workers) each family may spend in CI: 15 minutes on 2 cores hold about 1600 (docs/DESIGN.md
# §7: the suite runs at ~0.51 s of wall time per test-second, and CI's other steps take about a minute). A folder of
# tests/ is a family; the attention family is the largest (three backends, the Hopper set). Measured on a quiet 2-core
# machine (2026-11-27, 1747 tests, 529 s of wall time): attention 561, zoo 119, blocksparse 111, compiler 87,
# multidevice 63 (ring 40), recurrent 31, pooling 30, decode 28; 1033 in all. Session 14 (CI's clean clone, 1844
# tests, 551 s): attention 516, zoo 130, blocksparse 101, compiler 92, multidevice 110 (context parallelism, ring
# keys), recurrent 59, pooling 33, decode 30: multidevice 120 -> 160, attention 700 -> 660. Budgets keep about a
# quarter over that,
# more for the families still growing (multidevice, pooling, recurrent, decode); their sum, 1447, leaves room for a
# family to come (NEW_FAMILY_BUDGET).
# Session 16 (CI's clean clone, 1902 tests, 695 s): attention 596, zoo 221 (the spec masks' Hopper kernels compiled for
# sm_90 on both Tritons, tests/zoo/test_zoo_gluon.py), multidevice 146, blocksparse 132, compiler 77, recurrent 73,
# pooling 45, decode 43: zoo 150 -> 240.
# Session 23 (a quiet 2-core machine): attention 855 with multidevice 210 (their two folders alone), recurrent 120 ->
# 113 after trimming (its chunk_products and scalar chunk_sums tests): recurrent 107 -> 125. The sum of the families
# measured in sessions 22-23 (~1600-1670 test-seconds) sits at the 15 minutes' edge: attention is where to trim next.
# Session 24: the interpreted backends run a set cover of their conformance pairs (DESIGN §7), the sm_90 compile checks
# batch their compiles into one process at 64 x 32 tiles: CI's whole `.ci/run` (install included) 1116 s -> 843 s.
# Session 26 (a 2-core machine, load ~2, tests/attention alone, both trees in the same hour): attention 775 -> 696
# (the HEAD tree 748 without its mutation test, ~27): smaller interpreter shapes of the same kind (band, one-loop,
# descriptor, fully masked, large-logit, variant and determinism cases), the autotune lowering at head dim 16, the
# jax-triton lowerings in one process, the band's refusal and fallback traced not run, option defaults on xla only.
# Still over 660: the xla conformance rows (55, ~1.5 s of compile each) and the oracle's compiles are left to trim.
# Session 27: the oracle compiles once per shape (what is visible, scale, cap, bias and sinks passed in): xla rows
# 81 -> 71 s, ring_checks xla 75 -> 65 s, blocksparse 171 -> 152 (A/B, same hour). Whole suite, a quiet 2-core
# machine, warm Triton cache: 781 s, 1835 tests; attention 560, zoo 212, multidevice 189, blocksparse 175, recurrent
# 174, compiler 99, decode 61, pooling 50. With /tmp/ejgen-triton-cache cleared first (as a fresh CI machine; the
# GPU host's 3.6 cache still warm): 1097 s; attention 950, zoo 296, recurrent 239, multidevice 208, blocksparse 178,
# decode 72. The sm_90 Gluon compile tests alone take ~190 test-seconds cold (the launch-budget test 69 s, the list
# kernels 29, the zoo's masks 29, the dynamic queue 23, cross 20, the backward's position terms 14): next to trim.
# Session 28: those 8 tests, each tree alone from empty caches of both Tritons, interleaved, medians of 4 (runs vary
# +-15% here): 235 -> 211 test-seconds; the dynamic queue 21 -> 10 (its static forwards are two of the launch budget's
# kernels, from Triton's cache), position terms 22 -> 17, zoo masks on 3.6 23 -> 20; the others within noise (launch
# budget 72, zoo masks 32, list 26, cross 19, list on 3.6 18: every kernel distinct, 3-7 s each). Warm 21.5 -> 6.6:
# ejgen.testing.aot keeps one compiling process per Triton (~2 s a call saved, every AOT test). Whole suite, both
# caches cold: 1167 s, 1842 passed. Next: test_triton_aot's compile test, 197 s cold under -n 2 (f32 40, d256 30).
# Session 33 (a quiet 2-core machine, warm caches, 1892 tests, 422 s): attention 270, recurrent 126-133 (121-146 over
# sessions 31-33 with the load), zoo 91-118, multidevice 96, blocksparse 84, compiler 54, decode 30, pooling 23:
# recurrent 125 -> 140 from the zoo's room (240 -> 225; its sm_90 compiles took 221 in session 16, 296 cold).
BUDGET_SECONDS = {"attention": 660, "zoo": 225, "blocksparse": 140, "compiler": 110, "multidevice": 160, "pooling": 60,
                  "recurrent": 140, "decode": 60}
NEW_FAMILY_BUDGET = 107  # each family still to come

def pytest_terminal_summary(terminalreporter):
    """Seconds per family against its budget, after every run of more than a few tests."""
    spent = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) and getattr(report, "nodeid", "").startswith("tests/"):
                parts = report.nodeid.split("/")
                family = parts[1] if len(parts) > 2 else "harness"
                spent[family] = spent.get(family, 0.0) + getattr(report, "duration", 0.0)  # not collection reports
    if sum(spent.values()) < 60:
        return
    terminalreporter.write_sep("-", "test seconds per family (budget: docs/DESIGN.md §7)")
    for family, seconds in sorted(spent.items()):
        budget = BUDGET_SECONDS.get(family, NEW_FAMILY_BUDGET)
        flag = "  OVER BUDGET" if seconds > budget else ""
        terminalreporter.write_line(f"{family:>12}: {seconds:6.0f} s of {budget} s{flag}")

def pytest_runtest_logreport(report):
    """With EJGEN_FAILURE_LOG=<file>: each failure's test and message appended to the file the moment it happens, so
    a GPU run cut short by its time limit still says what failed and by how much (benchmarks/gpu_shards.sh)."""
    path = os.environ.get("EJGEN_FAILURE_LOG")
    if path and report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr).strip().splitlines()[-1:]
        with open(path, "a") as f:
            f.write(f"FAILED {report.nodeid} ({report.when}): {' '.join(str(message).split())[:400]}\n")


@pytest.fixture
def x64_stays_off():
    """The oracle enables float64 only inside a context; the op under test must never see it.
    Modules that use the oracle opt in with ``pytestmark = pytest.mark.usefixtures(...)``."""
    assert not jax.config.jax_enable_x64, "jax_enable_x64 is on before the test"
    yield
    assert not jax.config.jax_enable_x64, "jax_enable_x64 leaked out of the test"

def jit_vjp(op, diff: dict, rest: dict, static: dict, d_out, d_lse):
    """Run ``op(query, key, value, **others, **rest, **static, return_lse=True)`` under
    ``jax.jit`` and take its vjp with cotangents ``(d_out, d_lse)`` with respect to every entry of
    ``diff`` (query, key, value, and ``others``: bias, softmax_aux, params, by keyword).

    ``rest`` holds traced non-differentiable arguments (mask_info, cu_seqlens, options); ``static``
    holds Python values closed over (flags, window, cap, scale, platform, max_seqlen).
    Returns ``(out, lse, grads)`` with ``grads`` keyed like ``diff``.
    """
    return jitted_vjp(op, static)(diff, rest, d_out, d_lse)


def jitted_vjp(op, static: dict):
    """``jit_vjp``'s jitted function ``(diff, rest, d_out, d_lse) -> (out, lse, grads)`` for one op and its static
    arguments: calls with arrays of the same shapes (traced options of other values) reuse its compilation."""

    def call(d, r):
        d = dict(d)
        q, k, v = d.pop("query"), d.pop("key"), d.pop("value")
        return op(q, k, v, **d, **r, **static, return_lse=True)

    @jax.jit
    def fwd_bwd(d, r, d_out, d_lse):
        (out, lse), vjp = jax.vjp(lambda d_: call(d_, r), d)
        (grads,) = vjp((d_out, d_lse))
        return out, lse, grads

    return fwd_bwd

@pytest.fixture
def run_vjp():
    """``jit_vjp`` as a fixture, so test modules need not import this conftest."""
    return jit_vjp

@pytest.fixture
def triton_launches(monkeypatch):
    """Every Triton kernel launch of the test, as (pass: 'fwd' | 'dkdv' | 'dq', constexprs): a spy on
    ``triton_call.launch`` that shows which path a call really took (the Hopper path's plain Triton kernels,
    `gluon.host.PLAIN_TRITON`, which feed the Gluon kernels their tile ranges, order and delta, are not listed)."""
    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.runtime.launch import triton_call

    if triton_call.mode()[0] is None:
        pytest.fail("this test needs the triton backend: run it with TRITON_INTERPRET=1 (README)")
    seen = []
    launch = triton_call.launch

    def spy(kernel, grid, inputs, outs, **kw):
        name = kernel.__name__
        if getattr(kernel, "fn", kernel).__module__ not in gluon_attention.PLAIN_TRITON:
            seen.append((name.rsplit("_", 2)[-2] if "bwd" in name else "fwd", kw))
        return launch(kernel, grid, inputs, outs, **kw)

    monkeypatch.setattr(triton_call, "launch", spy)
    return seen

@pytest.fixture
def triton_against_oracle(run_vjp):
    """``check(shape, features, dtype, tag)``: flash_attention on the triton backend (random inputs
    seeded by ``tag``; features may name ``bias=True`` and ``sinks="h"``) against the float64 oracle:
    output, lse and every gradient (``lse_atol``: `oracle.check_attention`'s)."""
    import numpy as np

    import oracle
    from ejgen.testing.shapes import random_cotangents, random_qkv, random_sinks, rng_for

    from ejgen.ops import flash_attention

    def check(shape, features, dtype, tag, lse_atol=None):
        rng = rng_for(f"{tag}-{shape}-{features}-{dtype}")
        diff = random_qkv(shape, dtype, rng)
        features = dict(features)
        if features.pop("bias", False):
            diff["bias"] = jnp.asarray(rng.standard_normal((shape.batch, shape.q_heads, shape.q_len, shape.kv_len)),
                                       dtype)
        sinks = features.pop("sinks", None)
        if sinks:
            diff["softmax_aux"] = random_sinks(sinks, shape.q_heads, rng)
        d_out, d_lse = random_cotangents(shape, dtype, rng)
        out, lse, grads = run_vjp(flash_attention, diff, {}, {**features, "platform": "triton"}, d_out, d_lse)
        ref = oracle.attention(**{n: np.asarray(x) for n, x in diff.items()}, **features, d_out=d_out, d_lse=d_lse)
        oracle.check_attention(out, lse, grads, ref, diff, dtype, lse_atol=lse_atol)

    return check

@contextlib.contextmanager
def on_path(root):
    """``root`` on sys.path inside the block (a package a test built there imports); after it, the folder and
    every module imported from it are gone again."""
    root = str(root)
    before = set(sys.modules)
    sys.path.insert(0, root)
    importlib.invalidate_caches()
    try:
        yield root
    finally:
        sys.path.remove(root)
        for name in set(sys.modules) - before:
            if root in (getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]
