"""A soft cap and sinks on the Hopper kernel set against the generated Triton kernels, one GPU, one process (same-card
A/B): Gemma 2 (causal, soft cap 50), Gemma 3 local (causal, window 1024, soft cap 50), gpt-oss (causal, window 128,
a sink a head), and plain causal for scale; bf16, B 1, S 8192, H 16, D 128. Each case's Hopper call is checked
against the generated one (max abs difference of the output, and of dq for fwd+bwd).

    python3 benchmarks/hopper_features.py [--cases gemma2,gemma3,gpt_oss] [--fast-tanh off|on|both] [--out DIR]

`--fast-tanh both` also times the Hopper set with the hardware's approximate tanh in the soft cap
(`gluon.host.FAST_TANH`; kernels "gluon-fast").

Prints ms per call (median of interleaved rounds, 4 calls a sample) for each case, pass (fwd, fwd+bwd) and kernel
set, and hopper / generated; writes <out>/hopper_features.json. `--cpu-smoke` runs the plumbing on tiny shapes in
Triton's interpreter (the Hopper kernels do not run there: their rows read n/a).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

CASES = {  # name: flash_attention's keyword arguments (sinks: one logit a head)
    "causal": dict(causal=True),
    "gemma2": dict(causal=True, logits_soft_cap=50.0),
    "gemma3": dict(causal=True, sliding_window=(1023, 0), logits_soft_cap=50.0),
    "gpt_oss": dict(causal=True, sliding_window=(127, 0), sinks=True),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench-out/hopper_features")
    p.add_argument("--fast-tanh", choices=("off", "on", "both"), default="both")
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


def calls(kw: dict, aux, hopper: bool):
    """(fwd, fwd+bwd) jitted for one kernel set (hopper: the gluon setting on, else off: the generated kernels); traced
    here, so gluon_host.FAST_TANH as it is now holds for them."""
    extra = dict(kw)
    if extra.pop("sinks", False):
        extra["softmax_aux"] = aux

    def fwd(q, k, v):
        with settings(gluon=hopper):  # read as the call is traced
            return flash_attention(q, k, v, platform="triton", **extra)

    def fwdbwd(q, k, v):
        with settings(gluon=hopper):
            out, pull = jax.vjp(lambda q: flash_attention(q, k, v, platform="triton", **extra), q)
            return out, pull(jnp.ones_like(out))[0]

    args = tuple(CALL_ARGS)
    return jax.jit(fwd).lower(*args).compile(), jax.jit(fwdbwd).lower(*args).compile()


CALL_ARGS: list = []  # (q, k, v), set by main before the calls are compiled


def main() -> int:
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    b, s, h, d = (1, 64, 2, 16) if ARGS.cpu_smoke else (1, 8192, 16, 128)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(keys[i], (b, s, h, d), jnp.bfloat16) for i in range(3))
    aux = jax.random.normal(keys[3], (h,), jnp.float32)
    print(f"{jax.devices()[0].device_kind}; bf16, B {b}, S {s}, H {h}, D {d}", flush=True)
    CALL_ARGS[:] = [q, k, v]
    rows = []
    variants = [(False, False)] + [(True, fast) for fast in {"off": [False], "on": [True],
                                                            "both": [False, True]}[ARGS.fast_tanh]]
    for name in [c for c in ARGS.cases.split(",") if c]:
        kw = CASES[name]
        compiled, ref = {}, {}
        for hopper, fast in variants:
            if fast and "logits_soft_cap" not in kw:
                continue
            extra = {n: x for n, x in kw.items() if n != "sinks"}
            gluon_host.FAST_TANH = fast
            with settings(gluon=hopper):
                sets = explain(flash_attention, q, k, v, platform="triton",
                               **({"softmax_aux": aux} if kw.get("sinks") else {}), **extra)
            try:
                fns = calls(kw, aux, hopper)
            except Exception as e:  # noqa: BLE001 (the Hopper kernels off an sm_90 GPU)
                rows.append(dict(case=name, pass_="both", kernels=sets.forward, error=str(e).splitlines()[0][:120]))
                continue
            finally:
                gluon_host.FAST_TANH = False
            for pass_, fn in zip(("fwd", "fwd+bwd"), fns):
                label = f"{sets.forward}/{sets.backward}" + ("-fast" if fast else "")
                try:
                    res = jax.block_until_ready(fn(q, k, v))
                except Exception as e:  # noqa: BLE001 (the Hopper kernels off an sm_90 GPU)
                    rows.append(dict(case=name, pass_=pass_, kernels=label, error=str(e).splitlines()[0][:120]))
                    continue
                first = res if pass_ == "fwd" else res[1]
                diff = float(jnp.max(jnp.abs(first.astype(jnp.float32) - ref[pass_]))) if pass_ in ref else 0.0
                ref.setdefault(pass_, first.astype(jnp.float32))
                compiled[(hopper, fast, pass_)] = (fn, label, diff)
        times = {key: [] for key in compiled}
        for r in range(ARGS.rounds):
            for key, (fn, _, _) in compiled.items():
                times[key].append(median_seconds(fn, (q, k, v), ARGS.reps, warmup=1,
                                                 warm_seconds=0.3 if r == 0 else 0.05, batch=4))
        for pass_ in ("fwd", "fwd+bwd"):
            key0 = (False, False, pass_)
            base = statistics.median(times[key0]) if key0 in times else None
            for hopper, fast in variants:
                if (hopper, fast, pass_) not in compiled:
                    continue
                _, label, diff = compiled[(hopper, fast, pass_)]
                ms = statistics.median(times[(hopper, fast, pass_)]) * 1e3
                row = dict(case=name, pass_=pass_, kernels=label, ms=round(ms, 3), max_diff=diff,
                           x_generated=round(base * 1e3 / ms, 2) if base else None)
                rows.append(row)
                print(row, flush=True)
    (out_dir / "hopper_features.json").write_text(json.dumps(rows, indent=1))
    print("| case | pass | kernels (fwd/bwd) | ms | generated / this | max diff vs generated | error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['pass_']} | {r['kernels']} | {r.get('ms', '')} | {r.get('x_generated', '')} | "
              f"{r.get('max_diff', '')} | {r.get('error', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
