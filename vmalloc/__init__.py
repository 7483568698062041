"""vmalloc: a virtual-addressing GPU memory allocator.

Physical memory is a pool of fixed-size chunks mapped into contiguous reserved virtual ranges,
so freed memory never fragments physically. Runs on an emulated device (:class:`HostDevice`)
without a GPU, or on a real one through the CUDA driver.
"""

from vmalloc.errors import (
    DeviceError,
    InvalidArgumentError,
    InvalidPointerError,
    OutOfMemoryError,
    TraceFormatError,
    VmallocError,
)
from vmalloc.sizes import format_size, parse_size
from vmalloc._core.stats import Stats

try:
    from vmalloc._core.device import Device
except ImportError as _error:  # pragma: no cover - depends on how vmalloc was installed
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    raise ImportError(
        f"vmalloc's compiled modules are missing from {_here}: this looks like the vmalloc "
        f"source tree (e.g. Python started in the repository root, where ./vmalloc shadows "
        f"the installed package). Run Python from another directory to use the installed "
        f"vmalloc, or build in place: `pip install -e .`, or `scripts/dev-build NAME` then "
        f"PYTHONPATH=build/NAME/python. (Original error: {_error})"
    ) from _error
from vmalloc._core.allocator import Allocator
from vmalloc._core.host_device import HostDevice
from vmalloc._core.cuda_device import CudaDevice
from vmalloc._core.caching_allocator import CachingAllocator
from vmalloc._core.logging_allocator import LoggingAllocator
from vmalloc import traces
from vmalloc._core.current_allocator import (
    get_current_allocator,
    library_path,
    set_current_allocator,
)
from vmalloc._core.physical_chunk_pool import PhysicalChunkPool
from vmalloc._core.virtual_allocator import VirtualAllocator

__version__ = "0.1.0"

__all__ = [
    "Allocator",
    "CachingAllocator",
    "CudaDevice",
    "Device",
    "DeviceError",
    "HostDevice",
    "InvalidArgumentError",
    "InvalidPointerError",
    "LoggingAllocator",
    "OutOfMemoryError",
    "PhysicalChunkPool",
    "Stats",
    "TraceFormatError",
    "VirtualAllocator",
    "VmallocError",
    "format_size",
    "get_current_allocator",
    "library_path",
    "parse_size",
    "set_current_allocator",
    "traces",
]
