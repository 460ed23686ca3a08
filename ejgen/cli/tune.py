"""`ejgen tune`: time candidate Triton configs on real random inputs and keep the fastest.

For one shape (sequence length, head dim, dtype, causal or not), each kernel pass is swept alone —
the forward timed forward only, dK/dV and dQ timed as forward+backward with the other passes at
their current configs — and the winners go into the persistent, shape-keyed cache that
``ejgen.runtime.attention.triton.configs.pick`` reads (ejgen/runtime/attention/triton/tuning_cache.py). Inputs are random
arrays on the device, never zero-filled tracers; configs that fail to compile or run are skipped.
"""

from __future__ import annotations

from ejgen.runtime.attention.triton import configs as triton_configs
from ejgen.runtime.attention.triton import host as triton_attention
from ejgen.runtime.attention.triton import tuning_cache
from ejgen.runtime.core.settings import settings
from ejgen.testing.timing import median_seconds

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
    sliding = None if window is None else ((window, 0) if causal else (window, window))
    winners = {}
    for pass_, candidates in triton_configs.CANDIDATES[arch].items():
        best = None
        for text in candidates:
            op = lambda q, k, v: flash_attention(q, k, v, causal=causal, sliding_window=sliding, platform="triton")
            if pass_ == "fwd":
                fn = jax.jit(op)
            else:
                fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(op(q, k, v).astype(jnp.float32) * d_out), (0, 1, 2)))
            try:
                with settings(triton_configs=f"{pass_}={text}"):  # read when fn is traced, inside the block
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
    path = tuning_cache.store(winners)
    log(f"wrote {len(winners)} tuned config(s) to {path}")
    return winners
