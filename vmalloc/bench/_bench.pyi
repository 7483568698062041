# vmalloc.bench._bench, compiled: its stub, by scripts/make-stubs (docs in the .pyx).
from typing import Any

from vmalloc.sizes import parse_size as parse_size

def time_alloc_free_pairs(allocator, nbytes, pairs=..., stream=..., warmup=...) -> Any: ...

def time_size_cycle(allocator, sizes, depth=..., pairs=..., stream=...) -> Any: ...
