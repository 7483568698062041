"""The swap manager: allocations moved between device memory and pinned host staging memory
on dedicated transfer streams (compiled, ``_swap_manager.pyx``); on the virtual allocator the
pointer never changes. The lowest of the offload folders: it knows nothing of sequences or
schedules (docs/architecture.rst, "The offload package"). ``staging`` (compiled,
``_staging.pyx``) lends the manager's pinned staging blocks to page streams."""

from vmalloc.offload.swap import _staging as staging
from vmalloc.offload.swap._swap_manager import SwapManager

__all__ = ["SwapManager", "staging"]
