#include "vmalloc/detail/small_block_arena.hpp"

namespace vmalloc::detail {

namespace {
// Candidates examined in the best-fit size list for one on the caller's stream.
constexpr int same_stream_scan = 8;
}  // namespace

void SmallBlockArena::insert_free(ArenaBlock* block) {
  free_.insert(block, block->size / block_unit);
  free_bytes_ += block->size;
  ++block->chunk->free_blocks;
}

void SmallBlockArena::remove_free(ArenaBlock* block) noexcept {
  free_.remove(block);
  free_bytes_ -= block->size;
  --block->chunk->free_blocks;
}

ArenaBlock* SmallBlockArena::pick(std::size_t units, stream_t stream) {
  const std::size_t bucket = free_.best_fit(units);
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

ArenaBlock* SmallBlockArena::allocate(std::size_t nbytes, stream_t stream) {
  const std::size_t size = round_up(nbytes);
  ArenaBlock* block = pick(size / block_unit, stream);
  if (block == nullptr) return nullptr;
  order_.make_usable_on(block->work, stream);  // may throw: the block stays free as it was
  ArenaBlock* rest = nullptr;
  if (block->size > size) rest = blocks_.acquire();  // may throw bad_alloc: nothing changed
  remove_free(block);
  if (rest != nullptr) {
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
    block->size = size;
    insert_free(rest);  // cannot allocate: the buckets cover a whole chunk (add_chunk)
  }
  order_.drop(block->work);
  block->free = false;
  if (block->chunk->live_blocks++ == 0) --empty_chunks_;
  return block;
}

ArenaChunk* SmallBlockArena::add_chunk(device_ptr base, void* owner) {
  free_.reserve(chunk_size_ / block_unit);
  ArenaChunk* chunk = chunk_nodes_.acquire();
  ArenaBlock* block;
  try {
    block = blocks_.acquire();
  } catch (...) {
    chunk_nodes_.release(chunk);
    throw;
  }
  chunk->base = base;
  chunk->owner = owner;
  chunk->live_blocks = 0;
  chunk->free_blocks = 0;
  chunk->first = block;
  chunk->prev = nullptr;
  chunk->next = all_;
  if (all_ != nullptr) all_->prev = chunk;
  all_ = chunk;
  ++chunks_;
  ++empty_chunks_;
  block->chunk = chunk;
  block->offset = 0;
  block->size = chunk_size_;
  block->requested = 0;
  block->free = true;
  block->prev = block->next = nullptr;
  block->work = PendingWork{};  // fresh memory: nothing pending
  insert_free(block);
  return chunk;
}

ArenaChunk* SmallBlockArena::deallocate(ArenaBlock* block, PendingWork work) noexcept {
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
    remove_free(right);
    block->size += right->size;
    order_.merge_into(block->work, right->work);
    block->next = right->next;
    if (right->next != nullptr) right->next->prev = block;
    blocks_.release(right);
  }
  insert_free(block);
  return block->size == chunk_size_ ? chunk : nullptr;
}

bool SmallBlockArena::removable_without_sync(const ArenaChunk* chunk) const noexcept {
  if (chunk->live_blocks != 0) return false;
  const PendingWork* seen = nullptr;
  for (const ArenaBlock* b = chunk->first; b != nullptr; b = b->next) {
    if (b->work.idle) continue;
    if (seen != nullptr && seen->stream != b->work.stream) return false;
    seen = &b->work;
  }
  return true;
}

void SmallBlockArena::synchronize_chunk(ArenaChunk* chunk) {
  for (ArenaBlock* b = chunk->first; b != nullptr; b = b->next) order_.synchronize(b->work);
}

PendingWork SmallBlockArena::remove_chunk(ArenaChunk* chunk) noexcept {
  // Every block is free and their works pairwise mergeable (one stream, or idle).
  PendingWork work;
  for (ArenaBlock* b = chunk->first; b != nullptr;) {
    ArenaBlock* next = b->next;
    remove_free(b);
    order_.merge_into(work, b->work);
    blocks_.release(b);
    b = next;
  }
  if (chunk->prev != nullptr) chunk->prev->next = chunk->next;
  else all_ = chunk->next;
  if (chunk->next != nullptr) chunk->next->prev = chunk->prev;
  --chunks_;
  --empty_chunks_;
  chunk_nodes_.release(chunk);
  return work;
}

const ArenaBlock* SmallBlockArena::block_containing(const ArenaChunk* chunk,
                                                    device_ptr address) const noexcept {
  for (const ArenaBlock* b = chunk->first; b != nullptr; b = b->next)
    if (address >= b->address() && address < b->address() + b->size) return b;
  return nullptr;
}

}  // namespace vmalloc::detail
