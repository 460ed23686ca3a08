"""Quick GPU correctness check of the triton backend against a float32 dense reference (bf16/f16/f32).

    python benchmarks/gpu_check.py [bfloat16 float16 float32] [--autotune]

Run on the GPU host before benchmarks; the full conformance suite is `pytest -m gpu`. `--autotune` runs
the same cases through jax-triton's autotuned call (EJGEN_TRITON_AUTOTUNE=1) and prints how long each
first call took (compiling and timing every candidate config).
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.ops import flash_attention


def reference(q, k, v, causal, window, cap, aux):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], h // k.shape[2]
    k, v = jnp.repeat(k, g, 2), jnp.repeat(v, g, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(d)
    if cap:
        s = cap * jnp.tanh(s / cap)
    i, j = jnp.arange(sq)[:, None], jnp.arange(sk)[None]
    vis = jnp.ones((sq, sk), bool)
    if causal:
        vis &= j <= i + sk - sq
    if window:
        vis &= j >= i + sk - sq - window[0]
        if not causal:
            vis &= j <= i + sk - sq + window[1]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    if aux is not None:
        m = jnp.maximum(m, aux[None, :, None, None])
    m = jnp.where(jnp.isinf(m), 0, m)
    p = jnp.exp(s - m)
    l = p.sum(-1, keepdims=True)
    if aux is not None:
        l = l + jnp.exp(aux[None, :, None, None] - m)
    return jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l == 0, 1, l), v, precision="highest")


def main():
    key = jax.random.PRNGKey(0)
    worst = 0.0
    cases = [
        (2, 1000, 1000, 16, 16, 128, False, None, None, False),
        (2, 1000, 1000, 16, 4, 128, True, None, None, False),
        (1, 777, 1025, 8, 2, 64, True, (100, 0), 30.0, True),
        (2, 513, 513, 4, 4, 96, False, (64, 64), None, False),
    ]
    dtypes = ((jnp.bfloat16, 2e-2), (jnp.float16, 5e-3), (jnp.float32, 2e-5))
    if "--autotune" in sys.argv:
        os.environ["EJGEN_TRITON_AUTOTUNE"] = "1"
    only = [a for a in sys.argv[1:] if not a.startswith("--")]  # e.g. bfloat16
    for dtype, tol in (d for d in dtypes if not only or jnp.dtype(d[0]).name in only):
        for b, sq, sk, h, hk, d, causal, window, cap, sinks in cases:
            ks = jax.random.split(key, 5)
            q = jax.random.normal(ks[0], (b, sq, h, d), dtype)
            k = jax.random.normal(ks[1], (b, sk, hk, d), dtype)
            v = jax.random.normal(ks[2], (b, sk, hk, d), dtype)
            do = jax.random.normal(ks[3], (b, sq, h, d), jnp.float32)
            aux = jax.random.normal(ks[4], (h,)) if sinks else None
            kw = dict(causal=causal, sliding_window=window, logits_soft_cap=cap, softmax_aux=aux)
            f = lambda q, k, v: jnp.sum(flash_attention(q, k, v, platform="triton", **kw).astype(jnp.float32) * do)
            g = lambda q, k, v: jnp.sum(reference(q, k, v, causal, window, cap, aux) * do)
            t0 = time.perf_counter()
            out = jax.block_until_ready(jax.jit(lambda q, k, v: flash_attention(q, k, v, platform="triton", **kw))(q, k, v))
            first = time.perf_counter() - t0
            ref = reference(q, k, v, causal, window, cap, aux)
            errs = [float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))]
            ga = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
            gb = jax.grad(g, (0, 1, 2))(q, k, v)
            errs += [float(jnp.linalg.norm(x.astype(jnp.float32) - y) / jnp.linalg.norm(y)) for x, y in zip(ga, gb)]
            ok = all(e < tol for e in errs) and all(np.isfinite(errs))
            worst = max(worst, max(e / tol for e in errs))
            print(f"{'ok  ' if ok else 'FAIL'} {jnp.dtype(dtype).name:8} B{b} Sq{sq} Sk{sk} H{h}x{hk} D{d} causal={causal} "
                  f"window={window} cap={cap} sinks={sinks}: out/dq/dk/dv rel err " + " ".join(f"{e:.1e}" for e in errs)
                  + f" (first forward call {first:.1f} s)",
                  flush=True)
    print(f"worst error / tolerance: {worst:.2f}")
    return 0 if worst < 1 else 1


if __name__ == "__main__":
    sys.exit(main())
