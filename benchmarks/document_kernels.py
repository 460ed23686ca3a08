"""Per-kernel GPU times of the document-mask forward (and forward+backward), the Hopper kernels against the generated
ones on the same call, under Nsight Compute (kernel_times.py's method: a marker kernel between calls, `--parse`).

    ncu --clock-control none --cache-control none --profile-from-start off --print-kernel-base demangled --csv \\
        --log-file D.csv --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size \\
        python benchmarks/document_kernels.py --cases 8192:8,32768:64
    python benchmarks/kernel_times.py --parse D.csv --order kernel_times.order
"""

import argparse
import ctypes
import os


def run(cases: str):
    import jax
    import jax.numpy as jnp
    import torch

    from blocksparse import DIM, HEADS, _generated, _static, document_ids
    from ejgen.ops import flash_attention
    from ejgen.types import MaskInfo

    calls = []
    for case in cases.split(","):
        tokens, docs = (int(x) for x in case.split(":"))
        ids = jnp.asarray(document_ids(tokens, docs))
        keys = jax.random.split(jax.random.PRNGKey(tokens + docs), 4)
        q, k, v, do = (jax.random.normal(kk, (1, tokens, HEADS, DIM), jnp.bfloat16) for kk in keys)
        info = MaskInfo.from_segments(ids)
        docs_fn = lambda q, k, v: flash_attention(q, k, v, causal=True, mask_info=info, platform="triton")  # noqa
        causal = lambda q, k, v: flash_attention(q, k, v, causal=True, platform="triton")  # noqa: E731
        for name, f in (("documents gluon", docs_fn), ("documents generated", _generated(docs_fn)),
                        ("documents, static tile order", _static(docs_fn)), ("causal", causal)):
            def loss(q, k, v, f=f):
                return jnp.sum(f(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

            for pass_, fn in (("fwd", f), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)))):
                exe = jax.jit(fn).lower(q, k, v).compile()
                for _ in range(3):
                    jax.block_until_ready(exe(q, k, v))
                calls.append((f"{tokens}/{docs} {name} {pass_}", exe, (q, k, v)))
    marker = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for name, fn, args in calls:
        marker.fill_(1.0)
        torch.cuda.synchronize()
        jax.block_until_ready(fn(*args))
    marker.fill_(1.0)
    torch.cuda.synchronize()
    cuda.cuProfilerStop()
    with open(os.environ.get("EJGEN_KERNEL_TIMES_ORDER", "kernel_times.order"), "w") as f:
        f.write("\n".join(name for name, _, _ in calls))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="8192:8,32768:64")
    run(p.parse_args().cases)
