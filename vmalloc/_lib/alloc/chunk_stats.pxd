# include/vmalloc/alloc/chunk_stats.hpp: what a virtual allocator's chunks are doing (the
# fields of CommonChunkStats are declared on ChunkStats, which inherits them).
from libcpp cimport bool


cdef extern from "vmalloc/alloc/chunk_stats.hpp" namespace "vmalloc" nogil:
    cdef cppclass ChunkStats:
        size_t chunk_size
        size_t small_threshold
        size_t budget_bytes
        size_t chunks_held
        size_t peak_chunks_held
        size_t chunks_live
        size_t chunks_cached
        size_t chunks_in_arenas
        size_t chunks_in_pool
        size_t free_chunks
        size_t arena_chunks_empty
        size_t cached_ranges
        size_t live_ranges
        size_t live_blocks
        size_t free_blocks
        size_t arena_free_bytes
        size_t reservations
        size_t reserved_address_bytes
        size_t chunks_created
        size_t chunks_released
        size_t chunks_stolen
        size_t unbacked_ranges
        size_t chunks_unbacked
        size_t unbacked_bytes
        size_t events_created
        bool multi_stream
