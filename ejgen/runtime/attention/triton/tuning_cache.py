"""A persistent, shape-keyed cache of tuned Triton kernel configs (written by `ejgen tune`).

One JSON file, ``$EJGEN_CACHE_DIR/triton-configs.json`` (default ``~/.cache/ejgen``), mapping
``arch/pass/d<head dim>/<bits>bit/s<sequence bucket>/<causal|full>`` to ``[block_m, block_n,
num_warps, num_stages]``. Read lazily when a kernel is first traced (never at import), re-read
when the file changes; written aside and renamed, merged with what is there.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

_memo: dict = {"stamp": None, "entries": {}}


def path() -> Path:
    root = os.environ.get("EJGEN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ejgen")
    return Path(root) / "triton-configs.json"


def bucket(seq: int) -> int:
    """Sequence lengths share an entry per power of two (at least 128)."""
    b = 128
    while b < seq:
        b *= 2
    return b


def key(arch: str, pass_: str, head_dim: int, dtype_bits: int, seq: int, causal: bool, window: bool = False) -> str:
    """Windowed calls keep entries of their own (their key loops are short); the window's size is a
    run-time value, so one entry serves every window of that shape."""
    mask = ("causal" if causal else "full") + ("-window" if window else "")
    return f"{arch}/{pass_}/d{head_dim}/{dtype_bits}bit/s{bucket(seq)}/{mask}"


def entries() -> dict:
    p = path()
    try:
        mtime = p.stat().st_mtime_ns
    except FileNotFoundError:
        return {}
    if _memo["stamp"] != (p, mtime):
        try:
            _memo["entries"] = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"ejgen: the tuning cache {p} is unreadable ({e}); delete it or rerun `ejgen tune`")
        _memo["stamp"] = (p, mtime)
    return _memo["entries"]


def lookup(k: str):
    return entries().get(k)


def store(new: dict) -> Path:
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    merged = {**entries(), **new}
    fd, tmp = tempfile.mkstemp(prefix=".triton-configs-", dir=p.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(sorted(merged.items())), f, indent=1)
    os.replace(tmp, p)
    return p
