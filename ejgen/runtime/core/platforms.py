"""Which generated backend a call runs on (docs/DESIGN.md §4): the ``platform=`` argument every op of every family
takes, ``"auto"`` by device, and why an unavailable choice cannot run. ``spec`` is any object with the op's
``name`` and its spec's ``path`` (each family's ``SpecInfo``); ``backends`` maps a backend's name to its generated
module (``available()``)."""

from __future__ import annotations

from ejgen.runtime.core import kernels

PLATFORMS = ("auto", "triton", "pallas", "xla")
_AUTO_ORDER = {"gpu": ("triton", "pallas", "xla"), "tpu": ("pallas", "xla")}


def auto_order(backends: dict) -> list[str]:
    """The generated backends ``platform="auto"`` tries on the target, in order."""
    return [b for b in _AUTO_ORDER.get(kernels.target().platform, ("xla", "pallas", "triton")) if b in backends]


def _available(backends: dict, name: str) -> tuple[bool, str]:
    here = kernels.target()
    if here.simulated:  # explain(target=...): what that machine would have
        if name == "triton" and here.platform != "gpu":
            return False, "no NVIDIA GPU (the CPU runs it only in Triton's interpreter, TRITON_INTERPRET=1)"
        return True, ""
    return backends[name].available()


def choose_platform(spec, platform: str, backends: dict) -> str:
    """The backend to run: ``platform`` when available, else why not; ``auto`` picks by device."""
    if platform not in PLATFORMS:
        raise ValueError(f"{spec.name}(): platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    if platform == "auto":
        reasons = []
        for name in auto_order(backends):
            ok, why = _available(backends, name)
            if ok:
                return name
            reasons.append(f"{name}: {why}")
        raise RuntimeError(f"{spec.name}(): no generated backend can run here ({'; '.join(reasons)})")
    if platform not in backends:
        raise ValueError(f"{spec.name}(): platform '{platform}' was not generated for this spec "
                         f"(backends: {', '.join(backends)}; see {spec.path})")
    ok, why = _available(backends, platform)
    if not ok:
        raise RuntimeError(f"{spec.name}(): platform '{platform}' is not available here: {why}")
    return platform
