"""`ejgen tune`: time candidate Triton configs on real random inputs and keep the fastest.

For one shape (sequence length, head dim, dtype, causal or not), each kernel pass is swept alone —
the forward timed forward only, dK/dV and dQ timed as forward+backward with the other passes at
their current configs — and the winners go into the persistent, shape-keyed cache that
``ejgen.runtime.triton_configs.pick`` reads (ejgen/runtime/tuning_cache.py). Inputs are random
arrays on the device, never zero-filled tracers; configs that fail to compile or run are skipped.
"""

from __future__ import annotations

import os

from ejgen.runtime import triton_attention, triton_configs, tuning_cache
from ejgen.testing.timing import median_seconds

CANDIDATES = {
    "sm90": {
        "fwd": ["128,128,8,3,tma", "128,128,8,3,tma,merged", "128,64,4,2,tma,merged", "64,64,4,3,tma,merged",
                "128,64,8,4,tma", "128,128,8,2,tma", "128,64,8,4", "128,128,8,3"],
        "dkdv": ["64,128,8,3", "64,128,8,3,merged", "64,128,8,3,tma", "64,128,8,2,tma", "32,128,8,3", "64,64,4,3"],
        "dq": ["128,64,8,3", "128,64,8,3,merged", "128,64,8,3,tma", "128,128,8,2", "64,64,4,2,merged", "64,64,4,3"],
    },
    "interpret": {
        "fwd": ["16,16,4,1", "16,16,4,1,tma,merged"],
        "dkdv": ["16,16,4,1", "16,32,4,1,tma,merged"],
        "dq": ["16,16,4,1,merged", "32,16,4,1,tma"],
    },
}


def tune(seq: int, head_dim: int, dtype: str = "bfloat16", causal: bool = False, heads: int = 16,
         batch: int = 1, reps: int = 10, window: int | None = None, log=print) -> dict:
    """Sweep, store the winners in the cache and return them ({cache key: "bm,bn,warps,stages[,tma]"})."""
    import jax
    import jax.numpy as jnp

    from ejgen.ops import flash_attention

    arch = triton_attention._arch()
    if triton_attention.available()[0] is False:
        raise RuntimeError(f"ejgen tune needs the triton backend: {triton_attention.available()[1]}")
    keys = jax.random.split(jax.random.PRNGKey(seq * 31 + head_dim), 4)
    shape = (batch, seq, heads, head_dim)
    q, k, v = (jax.random.normal(kk, shape, jnp.dtype(dtype)) for kk in keys[:3])
    d_out = jax.random.normal(keys[3], shape, jnp.float32)
    bits = jnp.dtype(dtype).itemsize * 8
    pinned_before = os.environ.get("EJGEN_TRITON_CONFIG")
    sliding = None if window is None else ((window, 0) if causal else (window, window))
    winners = {}
    try:
        for pass_, candidates in CANDIDATES[arch].items():
            best = None
            for text in candidates:
                os.environ["EJGEN_TRITON_CONFIG"] = f"{pass_}={text}"
                op = lambda q, k, v: flash_attention(q, k, v, causal=causal, sliding_window=sliding, platform="triton")
                if pass_ == "fwd":
                    fn = jax.jit(op)
                else:
                    fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(op(q, k, v).astype(jnp.float32) * d_out), (0, 1, 2)))
                try:
                    sec = median_seconds(fn, (q, k, v), reps, warmup=1)
                except Exception as e:  # a config the card cannot run (shared memory, registers)
                    log(f"  {pass_:5} {text:12} skipped: {str(e).splitlines()[0][:100]}")
                    continue
                log(f"  {pass_:5} {text:12} {sec * 1e3:9.3f} ms")
                if best is None or sec < best[0]:
                    best = (sec, text)
            if best is not None:
                k_ = tuning_cache.key(arch, pass_, head_dim, bits, seq, causal, window is not None)
                winners[k_] = triton_configs.text(triton_configs.parse(best[1]))
    finally:
        if pinned_before is None:
            os.environ.pop("EJGEN_TRITON_CONFIG", None)
        else:
            os.environ["EJGEN_TRITON_CONFIG"] = pinned_before
    path = tuning_cache.store(winners)
    log(f"wrote {len(winners)} tuned config(s) to {path}")
    return winners
