#include "vmalloc/chunks/detail/small_block_arena.hpp"

namespace vmalloc::detail {

ArenaChunk* SmallBlockArena::add_chunk(device_ptr base, void* owner) {
  free_.reserve(bucket_of(chunk_size_ / block_unit));
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

bool SmallBlockArena::poll_chunk(ArenaChunk* chunk) {
  for (ArenaBlock* b = chunk->first; b != nullptr; b = b->next)
    if (!order_.poll(b->work)) return false;
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
