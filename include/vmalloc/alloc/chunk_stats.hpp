// The chunk-level detail the virtual allocators report beyond Stats: ChunkStats
// (VirtualAllocator.chunk_stats() in Python, for either placement) and the part of it that
// PackedStats shares.
#pragma once

#include <cstddef>

namespace vmalloc {

// What both placements count alike (PackedStats has these too, with the same meaning).
struct CommonChunkStats {
  std::size_t chunk_size = 0;
  std::size_t small_threshold = 0;
  std::size_t budget_bytes = 0;
  std::size_t chunks_held = 0;         // live + free (mapped or in the pool) + in arenas
  std::size_t peak_chunks_held = 0;
  std::size_t chunks_live = 0;         // mapped for live allocations
  std::size_t chunks_in_pool = 0;      // unmapped, in the pool's cache
  std::size_t free_chunks = 0;         // chunks any request may use
  std::size_t reservations = 0;
  std::size_t reserved_address_bytes = 0;
  std::size_t chunks_created = 0;      // since construction
  std::size_t chunks_released = 0;
  std::size_t chunks_stolen = 0;       // unmapped from free mapped memory and remapped elsewhere
  std::size_t events_created = 0;
  bool multi_stream = false;
};

// Detail beyond Stats, in chunks. With packed placement the same fields describe slots:
// chunks_cached are mapped slots no live block overlaps, cached_ranges the free holes,
// live_ranges the live blocks; there are no arenas or small blocks (their fields are 0).
struct ChunkStats : CommonChunkStats {
  std::size_t chunks_cached = 0;       // mapped in cached ranges, reusable without driver calls
  std::size_t chunks_in_arenas = 0;    // mapped arena chunks (sub-allocated)
  std::size_t arena_chunks_empty = 0;  // arena chunks without live blocks
  std::size_t cached_ranges = 0;
  std::size_t live_ranges = 0;
  std::size_t live_blocks = 0;         // live small (sub-allocated) allocations
  std::size_t free_blocks = 0;
  std::size_t arena_free_bytes = 0;
  // Live allocations whose chunks were unmapped (unmap_backing): their ranges stay reserved,
  // they count in Stats.live_allocations but not in requested/allocated bytes, and their
  // chunks are back in the pool (chunks_in_pool).
  std::size_t unbacked_ranges = 0;
  std::size_t chunks_unbacked = 0;     // chunk slots of those ranges, without chunks
  std::size_t unbacked_bytes = 0;      // the sizes asked for of those allocations
};

}  // namespace vmalloc
