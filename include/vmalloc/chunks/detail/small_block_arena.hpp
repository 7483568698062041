// SmallBlockArena: sub-allocation of small requests inside chunk-backed memory.
//
// With 2 MiB chunks a 4 KiB tensor given a whole chunk would waste 99.8 % of it. Requests up
// to the allocator's small threshold are instead carved out of "arena chunks": single chunks
// the VirtualAllocator maps like any other range and hands over. Inside a chunk, blocks are
// multiples of 512 bytes (the alignment CUDA's allocators guarantee), found by best fit over
// all arena chunks, split on allocation and merged with free neighbours on free, so internal
// fragmentation per block is under 512 bytes.
//
// Merging respects streams (see stream_order.hpp): two free neighbours merge if one is idle
// or both were freed on one stream. A chunk whose blocks are all free and merged back into one
// block is reported to the owner, which returns it to its chunk cache; so free small memory
// stays available to large requests. Not thread-safe: used under the allocator's mutex.
#pragma once

#include <cstddef>
#include <cstdint>

#include "vmalloc/base/detail/node_pool.hpp"
#include "vmalloc/base/detail/size_buckets.hpp"
#include "vmalloc/chunks/detail/stream_order.hpp"
#include "vmalloc/base/types.hpp"

namespace vmalloc::detail {

struct ArenaChunk;

struct ArenaBlock {
  ArenaChunk* chunk = nullptr;
  std::size_t offset = 0;     // from the chunk's base, a multiple of block_unit
  std::size_t size = 0;       // a multiple of block_unit
  std::size_t requested = 0;  // live blocks: the size asked for
  bool free = false;
  ArenaBlock* prev = nullptr;  // address order inside the chunk
  ArenaBlock* next = nullptr;
  PendingWork work;            // free blocks: what may still use them
  ArenaBlock* bucket_prev = nullptr;
  ArenaBlock* bucket_next = nullptr;
  std::size_t bucket = 0;

  device_ptr address() const noexcept;
};

struct ArenaChunk {
  device_ptr base = 0;
  std::size_t live_blocks = 0;
  std::size_t free_blocks = 0;
  ArenaBlock* first = nullptr;
  void* owner = nullptr;  // the owner's record of this chunk (a ChunkRange)
  ArenaChunk* prev = nullptr;  // every chunk of the arena
  ArenaChunk* next = nullptr;
};

inline device_ptr ArenaBlock::address() const noexcept { return chunk->base + offset; }

class SmallBlockArena {
 public:
  static constexpr std::size_t block_unit = 512;
  static std::size_t round_up(std::size_t nbytes) noexcept {
    return (nbytes + block_unit - 1) / block_unit * block_unit;
  }
  // The size bucket of a free block of `units` (>= 1): units - 1, so that a whole chunk (a
  // multiple of 64 units from 32 KiB up) sits at the top of a bitmap word, the word of the
  // nearly whole remainders it is split into: a split or merge then rarely empties a word.
  static std::size_t bucket_of(std::size_t units) noexcept { return units - 1; }

  SmallBlockArena(std::size_t chunk_size, StreamOrder& order)
      : chunk_size_(chunk_size), order_(order) {}
  ~SmallBlockArena() = default;  // every node is owned by the node pools
  SmallBlockArena(const SmallBlockArena&) = delete;
  SmallBlockArena& operator=(const SmallBlockArena&) = delete;

  // The best-fit free block for `nbytes` (<= chunk size), split to size and made usable on
  // `stream`; nullptr if no free block is large enough. Throws DeviceError from a stream call
  // or bad_alloc with nothing changed.
  ArenaBlock* allocate(std::size_t nbytes, stream_t stream);
  // Takes a newly mapped chunk at `base` (no pending work) as one free block.
  ArenaChunk* add_chunk(device_ptr base, void* owner);
  // Frees a live block with the pending work of its free; merges it with free neighbours.
  // Returns its chunk if the chunk is now one free block (the owner may take it back).
  ArenaChunk* deallocate(ArenaBlock* block, PendingWork work) noexcept;
  // Makes every free block of a chunk without live blocks idle (blocks the host on pending
  // work), so that it can be removed. Throws DeviceError (blocks done so far stay idle).
  void synchronize_chunk(ArenaChunk* chunk);
  // True if every free block of a chunk without live blocks has its work done (polled, no
  // host wait; see StreamOrder::poll), so synchronize_chunk() will not block. May throw
  // DeviceError (blocks polled so far stay as polled).
  bool poll_chunk(ArenaChunk* chunk);
  // True if the chunk has no live block and remove_chunk() needs no synchronization.
  bool removable_without_sync(const ArenaChunk* chunk) const noexcept;
  // Removes a chunk without live blocks (removable_without_sync, or synchronized); returns
  // the pending work of its memory, owned by the caller.
  PendingWork remove_chunk(ArenaChunk* chunk) noexcept;

  // The block containing `address` inside `chunk`, for error messages.
  const ArenaBlock* block_containing(const ArenaChunk* chunk, device_ptr address) const noexcept;

  std::size_t chunks() const noexcept { return chunks_; }
  std::size_t empty_chunks() const noexcept { return empty_chunks_; }
  std::size_t free_blocks() const noexcept { return free_.count(); }
  std::size_t free_bytes() const noexcept { return free_bytes_; }
  // Calls f(ArenaChunk*) for every chunk without live blocks (f must not remove it).
  template <typename F>
  void for_each_empty_chunk(F&& f) const {
    for (ArenaChunk* c = all_; c != nullptr; c = c->next)
      if (c->live_blocks == 0) f(c);
  }

 private:
  // Candidates examined in the best-fit size list for one on the caller's stream.
  static constexpr int same_stream_scan = 8;

  ArenaBlock* pick(std::size_t units, stream_t stream);
  void insert_free(ArenaBlock* block);
  void remove_free(ArenaBlock* block) noexcept;

  const std::size_t chunk_size_;
  StreamOrder& order_;
  SizeBuckets<ArenaBlock> free_;
  NodePool<ArenaBlock> blocks_;
  NodePool<ArenaChunk> chunk_nodes_;
  ArenaChunk* all_ = nullptr;
  std::size_t chunks_ = 0;
  std::size_t empty_chunks_ = 0;
  std::size_t free_bytes_ = 0;
};


// ---------------------------------------------------------------------------------------------
// The cache-hit path, inline so that the allocator's allocate/deallocate compile into one
// function each (a call per layer cost more than the bookkeeping itself).

inline void SmallBlockArena::insert_free(ArenaBlock* block) {
  free_.insert(block, bucket_of(block->size / block_unit));
  free_bytes_ += block->size;
  ++block->chunk->free_blocks;
}

inline void SmallBlockArena::remove_free(ArenaBlock* block) noexcept {
  free_.remove(block);
  free_bytes_ -= block->size;
  --block->chunk->free_blocks;
}

inline ArenaBlock* SmallBlockArena::pick(std::size_t units, stream_t stream) {
  const std::size_t bucket = free_.best_fit(bucket_of(units));
  if (bucket == free_.npos) return nullptr;
  ArenaBlock* head = free_.head(bucket);
  // Prefer a block the stream may use at once, then one whose free has completed.
  int n = 0;
  for (ArenaBlock* b = head; b != nullptr && n < same_stream_scan; b = b->bucket_next, ++n)
    if (StreamOrder::free_on(b->work, stream)) return b;
  n = 0;
  for (ArenaBlock* b = head; b != nullptr && n < same_stream_scan; b = b->bucket_next, ++n)
    if (order_.completed(b->work)) return b;
  return head;
}

inline ArenaBlock* SmallBlockArena::allocate(std::size_t nbytes, stream_t stream) {
  const std::size_t size = round_up(nbytes);
  ArenaBlock* block = pick(size / block_unit, stream);
  if (block == nullptr) return nullptr;
  order_.make_usable_on(block->work, stream);  // may throw: the block stays free as it was
  if (block->size > size) {
    ArenaBlock* rest = blocks_.acquire();  // may throw bad_alloc: nothing changed
    rest->chunk = block->chunk;
    rest->offset = block->offset + size;
    rest->size = block->size - size;
    rest->requested = 0;
    rest->free = true;
    rest->work = order_.share(block->work);
    rest->prev = block;
    rest->next = block->next;
    if (block->next != nullptr) block->next->prev = rest;
    block->next = rest;
    // The rest joins the buckets before the block leaves them: sizes this close usually share
    // a bitmap word, which then never empties (one level touched instead of all).
    insert_free(rest);  // cannot allocate: the buckets cover a whole chunk (add_chunk)
    remove_free(block);
    block->size = size;
  } else {
    remove_free(block);
  }
  order_.drop(block->work);
  block->free = false;
  if (block->chunk->live_blocks++ == 0) --empty_chunks_;
  return block;
}

inline ArenaChunk* SmallBlockArena::deallocate(ArenaBlock* block, PendingWork work) noexcept {
  ArenaChunk* chunk = block->chunk;
  block->free = true;
  block->requested = 0;
  block->work = work;
  if (--chunk->live_blocks == 0) ++empty_chunks_;
  if (ArenaBlock* left = block->prev;
      left != nullptr && left->free && StreamOrder::can_merge(left->work, block->work)) {
    remove_free(left);
    left->size += block->size;
    order_.merge_into(left->work, block->work);
    left->next = block->next;
    if (block->next != nullptr) block->next->prev = left;
    blocks_.release(block);
    block = left;
  }
  if (ArenaBlock* right = block->next;
      right != nullptr && right->free && StreamOrder::can_merge(block->work, right->work)) {
    block->size += right->size;
    order_.merge_into(block->work, right->work);
    block->next = right->next;
    if (right->next != nullptr) right->next->prev = block;
    insert_free(block);  // before the right block leaves the buckets: see allocate()
    remove_free(right);
    blocks_.release(right);
  } else {
    insert_free(block);
  }
  return block->size == chunk_size_ ? chunk : nullptr;
}

}  // namespace vmalloc::detail
