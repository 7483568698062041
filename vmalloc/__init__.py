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
from vmalloc.stats import Stats
from vmalloc._device import Device
from vmalloc._allocator import Allocator
from vmalloc._host_device import HostDevice
from vmalloc._cuda_device import CudaDevice
from vmalloc._caching_allocator import CachingAllocator
from vmalloc._logging_adaptor import LoggingAllocator
from vmalloc import traces
from vmalloc._current_allocator import (
    get_current_allocator,
    library_path,
    set_current_allocator,
)
from vmalloc._virtual_allocator import VirtualAllocator

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
