"""Properties of the GPU a kernel is launched on, asked when an op is traced (never at import)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100 / H200 SXM where jax does not say)."""
    import jax

    try:
        return int(getattr(jax.devices("gpu")[0], "core_count", 0) or 132)
    except RuntimeError:
        return 132
