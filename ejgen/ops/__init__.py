"""Public ops. ``flash_attention`` is generated from ``specs/flash_attention.yaml``."""

from ejgen.generated import flash_attention

__all__ = ["flash_attention"]
