"""The Hopper kernel set on what it took over from the generated Triton kernels, one GPU, one process (same-card
A/B): soft caps and sinks (Gemma 2: causal, soft cap 50; Gemma 3 local: causal, window 1024, soft cap 50; gpt-oss:
causal, window 128, a sink a head) and cross-attention (Sq != Sk, no causal: the gluon_cross setting), with plain
causal for scale; bf16, D 128. Each case runs the generated kernels (the gluon setting off), the Hopper set, with a
soft cap also the hardware's approximate tanh (the fast_tanh setting, kernels "-fast"), and cuDNN where it has the
features (no soft cap, no sinks); each call is checked against the generated one (max abs difference of the output,
and for fwd+bwd of each of dq, dk, dv: the timed backward computes all three).

    python3 benchmarks/hopper_features.py [--cases gemma2,cross-1x1024x8192x16] [--fast-tanh off|on|both] [--out DIR]

A case is a name below or cross-BxSqxSkxH. Prints ms per call (median of interleaved rounds, 4 calls a sample) for
each case, pass (fwd, fwd+bwd) and kernel set, TFLOP/s (4 B H Sq Sk D over the visible pairs, x 3.5 fwd+bwd) and
generated / this; writes <out>/hopper_features.json. `--cpu-smoke` runs the plumbing on tiny shapes in Triton's
interpreter (the Hopper kernels do not run there: their rows show the generated kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

FEATURES = {  # name: flash_attention's keyword arguments (sinks: one logit a head), on B 1, S 8192, H 16
    "causal": dict(causal=True),
    "gemma2": dict(causal=True, logits_soft_cap=50.0),
    "gemma3": dict(causal=True, sliding_window=(1023, 0), logits_soft_cap=50.0),
    "gpt_oss": dict(causal=True, sliding_window=(127, 0), sinks=True),
    # narrow windows alone (where the Hopper set's 128 x 128 tiles waste most): gpt-oss's width, then wider
    "window128": dict(causal=True, sliding_window=(127, 0)),
    "window512": dict(causal=True, sliding_window=(511, 0)),
    "window2048": dict(causal=True, sliding_window=(2047, 0)),
}
CROSS = ("cross-1x1024x8192x16", "cross-4x4096x1024x16", "cross-2x2048x16384x16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join((*FEATURES, *CROSS)))
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fast-tanh", choices=("off", "on", "both"), default="both")
    p.add_argument("--cross-backward", action="store_true",
                   help="cross cases also with the generated backward (gluon.host.CROSS_BACKWARD off), impl "
                        "hopper-gen-bwd")
    p.add_argument("--out", default="bench-out/hopper_features")
    p.add_argument("--cpu-smoke", action="store_true")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_smoke:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ejgen.ops import explain, flash_attention, settings  # noqa: E402
from ejgen.runtime.attention.gluon import host as gluon_host  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402


def case_of(name: str) -> tuple:
    """(flash_attention's keyword arguments, (B, Sq, Sk, H)) of a case name."""
    if name.startswith("cross-"):
        return {}, tuple(int(x) for x in name[len("cross-"):].split("x"))
    return FEATURES[name], (1, 8192, 8192, 16)


def visible_pairs(kw: dict, sq: int, sk: int) -> float:
    """Query-key pairs a call computes (causal: half; a window: its width)."""
    if "sliding_window" in kw:
        return sq * min(sk, kw["sliding_window"][0] + 1)
    return sq * sk / 2 if kw.get("causal") else sq * sk


def impls(kw: dict, aux):
    """{label: (fn of q, k, v, its options for `configured`: None for cuDNN)}: the generated kernels, the Hopper set
    (with a soft cap also with the fast tanh; cross cases with --cross-backward also with the generated backward), and
    cuDNN where it has the case's features."""
    extra = {n: x for n, x in kw.items() if n != "sinks"}
    if kw.get("sinks"):
        extra["softmax_aux"] = aux

    def ejgen(q, k, v):
        return flash_attention(q, k, v, platform="triton", **extra)

    out = {"generated": (ejgen, dict(gluon=False)), "hopper": (ejgen, dict(gluon=True))}
    if "logits_soft_cap" in kw and ARGS.fast_tanh in ("on", "both"):
        out["hopper-fast"] = (ejgen, dict(gluon=True, fast_tanh=True))
        if ARGS.fast_tanh == "on":
            del out["hopper"]
    if not kw and ARGS.cross_backward:  # Sq != Sk: the generated backward too (gluon.host.CROSS_BACKWARD off)
        out["hopper-gen-bwd"] = (ejgen, dict(gluon=True, cross_backward=False))
    if "logits_soft_cap" not in kw and not kw.get("sinks"):
        def cudnn(q, k, v):
            window = kw.get("sliding_window")
            return jax.nn.dot_product_attention(q, k, v, is_causal=kw.get("causal", False), implementation="cudnn",
                                                local_window_size=window)
        out["cudnn"] = (cudnn, None)
    return out


@contextlib.contextmanager
def configured(opts: dict | None):
    """ejgen's settings (gluon, fast_tanh) and gluon.host.CROSS_BACKWARD (``cross_backward``) as ``opts`` asks, while
    a call is traced or explained (both passes: the kernels and their tanh are chosen at the forward's trace)."""
    opts = dict(opts or {})
    cross = opts.pop("cross_backward", gluon_host.CROSS_BACKWARD)
    before, gluon_host.CROSS_BACKWARD = gluon_host.CROSS_BACKWARD, cross
    try:
        with settings(**opts):
            yield
    finally:
        gluon_host.CROSS_BACKWARD = before


def compiled_passes(fn, opts: dict | None, args):
    """(fwd, fwd+bwd) compiled under ``configured(opts)``."""
    def fwdbwd(q, k, v):  # every gradient: a dq alone would let XLA drop a separate dK/dV kernel
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(jnp.ones_like(out))

    with configured(opts):
        return jax.jit(fn).lower(*args).compile(), jax.jit(fwdbwd).lower(*args).compile()


def run_case(name: str) -> list[dict]:
    kw, (b, sq, sk, h) = case_of(name)
    d = 128
    if ARGS.cpu_smoke:
        b, sq, sk, h, d = 1, 64, (96 if name.startswith("cross-") else 64), 2, 16
    keys = jax.random.split(jax.random.PRNGKey(sq * 7 + sk), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(keys[i], (b, sk, h, d), jnp.bfloat16) for i in (1, 2))
    aux = jax.random.normal(keys[3], (h,), jnp.float32)
    flops = 4 * b * h * visible_pairs(kw, sq, sk) * d
    rows, compiled, ref = [], {}, {}
    for label, (fn, opts) in impls(kw, aux).items():
        sets = "cudnn"
        if opts is not None:
            with configured(opts):
                choice = explain(flash_attention, q, k, v, platform="triton",
                                 **{n: x for n, x in kw.items() if n != "sinks"},
                                 **({"softmax_aux": aux} if kw.get("sinks") else {}))
            sets = f"{choice.forward}/{choice.backward}" + ("-fast" if choice.fast_tanh else "")
        try:
            fns = compiled_passes(fn, opts, (q, k, v))
        except Exception as e:  # noqa: BLE001 (cuDNN off a GPU)
            rows.append(dict(case=name, impl=label, kernels=sets, error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        for pass_, fn in zip(("fwd", "fwd+bwd"), fns):
            res = jax.block_until_ready(fn(q, k, v))
            first = [(res if pass_ == "fwd" else res[0]).astype(jnp.float32)]
            if pass_ != "fwd":
                first += [g.astype(jnp.float32) for g in res[1]]  # dq, dk, dv
            ref.setdefault(pass_, first)  # the generated kernels' (the first impl)
            compiled[(label, pass_)] = (fn, sets, max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(first, ref[pass_])))
    times = {key: [] for key in compiled}
    for r in range(ARGS.rounds):
        for key, (fn, _, _) in compiled.items():
            times[key].append(median_seconds(fn, (q, k, v), ARGS.reps, warmup=1,
                                             warm_seconds=0.3 if r == 0 else 0.05, batch=4))
    for (label, pass_), (_, sets, diff) in compiled.items():
        sec = statistics.median(times[(label, pass_)])
        base = statistics.median(times[("generated", pass_)]) if ("generated", pass_) in times else None
        row = dict(case=name, impl=label, pass_=pass_, kernels=sets, ms=round(sec * 1e3, 3),
                   tflops=round(flops * (3.5 if pass_ == "fwd+bwd" else 1) / sec / 1e12, 1), max_diff=diff,
                   x_generated=round(base / sec, 2) if base else None)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> int:
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{jax.devices()[0].device_kind}; bf16", flush=True)
    rows = []
    for name in [c for c in ARGS.cases.split(",") if c]:
        rows += run_case(name)
    (out_dir / "hopper_features.json").write_text(json.dumps(rows, indent=1))
    print("| case | impl | pass | kernels (fwd/bwd) | ms | TFLOP/s | generated / this | max diff vs generated | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['impl']} | {r.get('pass_', '')} | {r['kernels']} | {r.get('ms', '')} | "
              f"{r.get('tflops', '')} | {r.get('x_generated', '')} | {r.get('max_diff', '')} | {r.get('error', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
