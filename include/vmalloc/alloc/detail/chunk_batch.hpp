// ChunkBatch: the physical chunks one placement gathers before mapping them, given back unless
// the placement commits.
//
// Both virtual allocators (chunk and packed placement) back new slots the same way: chunks
// from the pool's cache, chunks stolen from the allocator's own free mapped memory, new chunks,
// in an order set by gather(). A placement that fails part way (a driver call, a steal that
// cannot unmap, a device fuller than it reported) must leave the chunks as it found them: the
// batch's destructor releases the chunks it created to the device and returns the others
// (cached or stolen, now unmapped) to the pool's cache, so reserved bytes are as before.
// Chunks a failed rollback could not unmap stay where they are (leave_mapped).
//
// Not thread-safe: used under the allocator's mutex.
#pragma once

#include <cstddef>
#include <vector>

#include "vmalloc/base/types.hpp"
#include "vmalloc/chunks/physical_chunk_pool.hpp"

namespace vmalloc::detail {

class ChunkBatch {
 public:
  // A batch of up to `want` chunks from `pool`. Room for all of them is reserved here, before
  // any chunk is taken, so that gathering never allocates (a bad_alloc changes nothing).
  ChunkBatch(PhysicalChunkPool& pool, std::size_t want);
  // Unless committed: created chunks are released, the others go back to the pool's cache
  // (failures are swallowed: a destructor cannot report them).
  ~ChunkBatch();
  ChunkBatch(const ChunkBatch&) = delete;
  ChunkBatch& operator=(const ChunkBatch&) = delete;

  // Gathers chunks until `want` are held or no source is left, in this order: the pool's
  // cache; with `steal_first`, chunks stolen without waiting for work (keeping
  // `create_first(missing)` of the missing ones for new chunks); new chunks, as many as the
  // pool says it can create; then chunks stolen after waiting for their work.
  // `steal(need, out, wait)` appends up to `need` chunks it unmapped to `out` (capacity is
  // reserved). Fewer than `want` only when the device refused chunks it reported creatable
  // (full() is false). Throws what `steal` throws; what was gathered is then still held here.
  template <class CreateFirst, class Steal>
  void gather(bool steal_first, CreateFirst&& create_first, Steal&& steal) {
    take_cached();
    if (steal_first && missing() > 0) {
      const std::size_t keep = create_first(missing());
      if (missing() > keep) steal(missing() - keep, chunks_, false);
    }
    create();
    if (missing() > 0) steal(missing(), chunks_, true);
  }

  // Moves the created chunks behind the others (stolen after creating): chunk i maps to the
  // i-th slot, and the packed placement has always mapped reused chunks first, so which
  // chunk a failed rollback leaves mapped (and whether it is released) stays as it was.
  void put_created_last() noexcept;

  std::size_t size() const noexcept { return chunks_.size(); }
  std::size_t missing() const noexcept { return want_ - chunks_.size(); }
  bool full() const noexcept { return chunks_.size() == want_; }
  physical_handle operator[](std::size_t i) const noexcept { return chunks_[i]; }
  const physical_handle* data() const noexcept { return chunks_.data(); }

  // Chunk i is mapped and a failed rollback could not unmap it: it stays where it is, held
  // (the caller keeps it in its books), and the batch no longer gives it back.
  void leave_mapped(std::size_t i) noexcept { chunks_[i] = 0; }
  // Every chunk is in the caller's books now: the destructor gives nothing back.
  void commit() noexcept { committed_ = true; }

 private:
  void take_cached();
  // New chunks, as many as missing and creatable; stops at the first OutOfMemory (the device
  // is fuller than it said: shared with others), so the caller steals instead.
  void create();
  bool created(std::size_t i) const noexcept {
    return i >= created_first_ && i < created_first_ + created_count_;
  }

  PhysicalChunkPool& pool_;
  const std::size_t want_;
  std::vector<physical_handle> chunks_;  // in the order they map; 0: left mapped
  std::size_t created_first_ = 0;        // chunks_[created_first_, + created_count_) are new
  std::size_t created_count_ = 0;
  bool committed_ = false;
};

}  // namespace vmalloc::detail
