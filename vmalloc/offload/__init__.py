"""vmalloc.offload: moving allocations between device and host memory."""

from vmalloc.offload._swap_manager import SwapManager

__all__ = ["SwapManager"]
