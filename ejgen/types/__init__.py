"""Public types shared by the ops: `MaskInfo` (segment ids or a dense mask) and `BlockMask` (which tiles a
kernel visits, and which of them need the element mask). A leaf package: it imports only JAX."""

from ejgen.types.block_mask import BlockMask
from ejgen.types.mask_info import MaskInfo

__all__ = ["BlockMask", "MaskInfo"]
