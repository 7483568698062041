#include "vmalloc/alloc/caching_allocator.hpp"

#include <algorithm>
#include <cstdio>
#include <iterator>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"
#include "vmalloc/chunks/detail/stream_order.hpp"

namespace vmalloc {

using detail::hex;

namespace {

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

// Sizes in messages keep their exact count: a user compares them with the bytes they passed.
std::string bytes(std::size_t n) { return detail::human_bytes(n, true); }

const std::shared_ptr<Device>& checked(const std::shared_ptr<Device>& device) {
  if (!device) throw InvalidArgument("CachingAllocator: device must not be null");
  return device;
}

// Whether `key` (a stream key, see detail::stream_key) is another thread's
// CU_STREAM_PER_THREAD: the handle 0x2 names the calling thread's own, so that stream cannot
// be named from here.
bool other_threads_stream(stream_t key) noexcept {
  return detail::stream_handle_of(key) == detail::cu_stream_per_thread &&
         key != detail::stream_key(detail::cu_stream_per_thread);
}

}  // namespace

const char* caching_policy_name(CachingPolicy policy) noexcept {
  switch (policy) {
    case CachingPolicy::pytorch:
      return "pytorch";
    case CachingPolicy::nnabla:
      return "nnabla";
    case CachingPolicy::cupy:
      return "cupy";
  }
  return "?";
}

CachingPolicy parse_caching_policy(const std::string& name) {
  for (CachingPolicy p : {CachingPolicy::pytorch, CachingPolicy::nnabla, CachingPolicy::cupy})
    if (name == caching_policy_name(p)) return p;
  throw InvalidArgument("CachingAllocator: unknown policy '" + name +
                        "'; known policies: 'pytorch', 'nnabla', 'cupy'");
}

CachingAllocator::CachingAllocator(std::shared_ptr<Device> device,
                                   CachingAllocatorOptions options)
    : device_(checked(device)), options_(options), pending_(*device_) {
  const bool pytorch = options_.policy == CachingPolicy::pytorch;
  if (options_.policy != CachingPolicy::pytorch && options_.policy != CachingPolicy::nnabla &&
      options_.policy != CachingPolicy::cupy)
    throw InvalidArgument("CachingAllocator: policy must be pytorch, nnabla or cupy");
  const std::string policy = caching_policy_name(options_.policy);
  if (options_.max_split_size != CachingAllocatorOptions::unlimited) {
    if (!pytorch)
      throw InvalidArgument("CachingAllocator: max_split_size is an option of the 'pytorch' "
                            "policy; the '" + policy + "' policy has none");
    // PyTorch (c10/core/AllocatorConfig.cpp) rejects max_split_size_mb below kLargeBuffer.
    if (options_.max_split_size < kLargeBuffer)
      throw InvalidArgument("CachingAllocator: max_split_size " + bytes(options_.max_split_size) +
                            " is below 20 MiB (kLargeBuffer), PyTorch's minimum");
  }
  if (options_.max_non_split_rounding_size != kLargeBuffer) {
    if (!pytorch)
      throw InvalidArgument("CachingAllocator: max_non_split_rounding_size is an option of the "
                            "'pytorch' policy; the '" + policy + "' policy has none");
    if (options_.max_non_split_rounding_size < kLargeBuffer)
      throw InvalidArgument("CachingAllocator: max_non_split_rounding_size " +
                            bytes(options_.max_non_split_rounding_size) +
                            " is below 20 MiB (kLargeBuffer), PyTorch's minimum");
  }
  if (options_.max_non_split_rounding_size > max_request_bytes ||
      (options_.max_split_size != CachingAllocatorOptions::unlimited &&
       options_.max_split_size > max_request_bytes))
    throw InvalidArgument("CachingAllocator: max_split_size and max_non_split_rounding_size "
                          "must not exceed vmalloc's limit of 2**56 bytes");
  if (options_.expandable_segments && !pytorch)
    throw InvalidArgument("CachingAllocator: expandable_segments is an option of the 'pytorch' "
                          "policy; the '" + policy + "' policy has none");
  if (options_.budget > max_request_bytes)
    throw InvalidArgument("CachingAllocator: budget " + bytes(options_.budget) +
                          " is larger than vmalloc's limit of 2**56 bytes");
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    pending_.synchronize_all([](Block*) {});
  } catch (...) {
  }
  try {
    // Like cudaFree, wait for queued work before the memory goes.
    if (!segments_.empty()) device_->synchronize();
  } catch (...) {
  }
  segments_.clear();  // each SegmentMemory frees itself
  leftovers_.clear();
}

// ---- the policy's rules ----

std::size_t CachingAllocator::round_size(std::size_t nbytes) const noexcept {
  if (options_.policy == CachingPolicy::nnabla && nbytes >= kSmallSize)
    return round_up(nbytes, kNnablaRoundLarge);
  if (nbytes < kMinBlockSize) return kMinBlockSize;
  return round_up(nbytes, kMinBlockSize);
}

bool CachingAllocator::is_small(std::size_t rounded) const noexcept {
  // CuPy keeps one pool (bins of 512 B) for every size.
  return options_.policy != CachingPolicy::cupy && rounded <= kSmallSize;
}

std::size_t CachingAllocator::segment_size(std::size_t rounded) const noexcept {
  std::size_t size = rounded;
  switch (options_.policy) {
    case CachingPolicy::pytorch:  // get_allocation_size
      if (rounded <= kSmallSize)
        size = kSmallBuffer;
      else if (rounded < kMinLargeAlloc)
        size = kLargeBuffer;
      else
        size = round_up(rounded, kRoundLarge);
      break;
    case CachingPolicy::nnabla:  // small misses allocate 1 MiB, large ones the exact size
      size = rounded <= kSmallSize ? kSmallSize : rounded;
      break;
    case CachingPolicy::cupy:  // cudaMalloc of the rounded size
      break;
  }
  return round_up(size, device_->granularity());
}

stream_t CachingAllocator::pool_stream(stream_t stream) const noexcept {
  // nnabla's pools are not stream-aware: every stream shares them.
  return options_.policy == CachingPolicy::nnabla ? 0 : stream;
}

bool CachingAllocator::should_split(const Block& block, std::size_t rounded) const noexcept {
  const std::size_t remaining = block.size - rounded;
  if (block.segment->small || options_.policy == CachingPolicy::cupy ||
      options_.expandable_segments)
    return remaining >= kMinBlockSize;
  if (options_.policy == CachingPolicy::pytorch && rounded >= options_.max_split_size)
    return false;
  return remaining > kSmallSize;
}

// ---- allocate ----

device_ptr CachingAllocator::allocate(std::size_t nbytes, stream_t stream) {
  device_->check_stream_alive(stream, "CachingAllocator.allocate");
  // CU_STREAM_PER_THREAD: one stream per thread, so each thread's blocks are its own pool.
  stream = detail::stream_key(stream);
  if (nbytes == 0) return 0;
  if (nbytes > max_request_bytes)
    throw InvalidArgument("CachingAllocator.allocate: nbytes " + std::to_string(nbytes) +
                          " is larger than vmalloc's limit of 2**56 bytes");
  std::lock_guard<std::mutex> lock(mutex_);
  process_events();

  const std::size_t rounded = round_size(nbytes);
  const bool small = is_small(rounded);
  detail::BlockPool& pool = small ? small_pool_ : large_pool_;
  Block* block = take_free_block(pool, stream, rounded);
  if (block == nullptr) {
    const std::size_t seg_size = segment_size(rounded);
    // PyTorch's alloc_block: a new segment, or with expandable segments more pages mapped.
    auto grow = [&] {
      return options_.expandable_segments ? alloc_expandable(small, stream, rounded, seg_size)
                                          : create_segment(seg_size, small, stream);
    };
    block = grow();
    // PyTorch's order: free cached oversize blocks (only with max_split_size), then every
    // cached segment that is entirely free, retrying after each.
    if (block == nullptr && release_oversize_blocks(pool, stream, rounded)) block = grow();
    if (block == nullptr) {
      ++alloc_retries_;
      release_all_free_segments();
      block = grow();
    }
    if (block == nullptr) {
      ++stats_.out_of_memory_count;
      std::string message = "CachingAllocator: out of memory allocating " + bytes(nbytes) +
                            " (block " + bytes(rounded) + ", new segment " + bytes(seg_size) +
                            ") on " + device_->name();
      if (options_.budget != 0) message += " with a budget of " + bytes(options_.budget);
      const std::string state = current_stats().summary();
      message += " after freeing every unused cached segment; " + state;
      throw OutOfMemory(message, nbytes, state);
    }
  }
  if (should_split(*block, rounded)) {
    try {
      split(block, rounded);  // strongly exception-safe: the block is as it was on a throw
    } catch (...) {
      return_to_pool(block);  // it left the pool above: put it back rather than lose it
      throw;
    }
  }

  block->allocated = true;
  block->requested = nbytes;
  block->stream = stream;
  try {
    live_.emplace(block->ptr, block);
  } catch (...) {
    block->allocated = false;
    block->requested = 0;
    return_to_pool(block);
    throw;
  }
  stats_.requested_bytes += nbytes;
  stats_.allocated_bytes += block->size;
  ++stats_.live_allocations;
  ++stats_.total_allocations;
  note_peaks();
  device_->note_live(block->ptr, nbytes);  // checked mode (HostDevice): may be touched
  return block->ptr;
}

void CachingAllocator::process_events() {
  if (pending_.blocks_waiting() == 0) return;  // the common single-stream case
  pending_.collect_completed([this](Block* b) { return_to_pool(b); });
}

CachingAllocator::Block* CachingAllocator::take_free_block(detail::BlockPool& pool,
                                                          stream_t stream, std::size_t rounded) {
  const stream_t key_stream = pool_stream(stream);
  auto it = pool.lower_bound(detail::BlockOrder::Key{key_stream, rounded, 0});
  if (it == pool.end() || (*it)->pool_stream != key_stream) return nullptr;
  if (options_.expandable_segments) {
    // PyTorch's get_free_block: a block followed by unmapped space counts, for best fit, at
    // the size it can grow to, so a larger block that cannot grow may be preferred.
    auto expandable_size = [](const Block* b) {
      const Block* n = b->segment->next(b);
      return b->size + (n != nullptr && !n->mapped ? n->size : 0);
    };
    for (auto next = std::next(it); next != pool.end() && (*next)->pool_stream == key_stream &&
                                    expandable_size(*next) < expandable_size(*it);
         ++next)
      it = next;
  }
  if (options_.policy == CachingPolicy::pytorch) {
    const std::size_t max_split = options_.max_split_size;
    // Smaller requests never take an oversize block...
    if (rounded < max_split && (*it)->size >= max_split) return nullptr;
    // ...and large ones only one that wastes less than max_non_split_rounding_size.
    if (rounded >= max_split && (*it)->size >= rounded + options_.max_non_split_rounding_size)
      return nullptr;
  }
  Block* block = *it;
  pool.erase(it);
  return block;
}

CachingAllocator::Block* CachingAllocator::create_segment(std::size_t size, bool small,
                                                          stream_t stream) {
  if (options_.budget != 0 && stats_.reserved_bytes + size > options_.budget) return nullptr;
  std::unique_ptr<Segment> segment;
  const std::size_t leftovers_before = leftovers_.size();
  auto count_leftovers = [&]() noexcept {
    for (std::size_t i = leftovers_before; i < leftovers_.size(); ++i)
      if (leftovers_[i]->created()) stats_.reserved_bytes += leftovers_[i]->size();
  };
  try {
    segment = std::make_unique<Segment>(*device_, size, small, stream, &leftovers_);
  } catch (const OutOfMemory&) {
    count_leftovers();
    return nullptr;  // the device is full: the caller frees cache and retries
  } catch (...) {
    count_leftovers();
    throw;
  }
  Segment* s = segment.get();
  const device_ptr ptr = s->ptr();
  s->blocks.emplace_back(ptr, size, stream, pool_stream(stream), s);
  Block* block = &s->blocks.back();
  block->self = std::prev(s->blocks.end());
  segments_.emplace(ptr, std::move(segment));  // on failure the segment frees itself
  ++segments_created_;
  stats_.reserved_bytes += size;
  note_peaks();
  return block;
}

void CachingAllocator::split(Block* block, std::size_t rounded) {
  // The request takes the front; the rest stays cached (PyTorch's alloc_found_block).
  // Allocate first (the list node, the pool's set node), mutate `block` last, so that a
  // bad_alloc leaves everything as it was.
  Segment* s = block->segment;
  auto rest_it = s->blocks.emplace(std::next(block->self), block->ptr + rounded,
                                   block->size - rounded, block->stream, block->pool_stream, s);
  rest_it->self = rest_it;
  try {
    pool_of(*s).insert(&*rest_it);
  } catch (...) {
    s->blocks.erase(rest_it);
    throw;
  }
  block->size = rounded;
}

// ---- expandable segments ----

std::size_t CachingAllocator::expandable_page_size(bool small) const noexcept {
  return round_up(small ? kSmallBuffer : kLargeBuffer, device_->granularity());
}

CachingAllocator::Block* CachingAllocator::alloc_expandable(bool small, stream_t stream,
                                                            std::size_t rounded,
                                                            std::size_t seg_size) {
  // PyTorch's alloc_block checks the memory fraction against the size a fixed segment would
  // have (alloc_size), then maps only what the request needs.
  if (options_.budget != 0 && stats_.reserved_bytes + seg_size > options_.budget) return nullptr;
  detail::BlockPool& pool = small ? small_pool_ : large_pool_;
  Block* candidate = find_expandable_block(small, stream, rounded);
  if (candidate == nullptr) return nullptr;
  // The candidate starts a run of free and unmapped blocks of at least `rounded` bytes; map
  // the unmapped ones in turn, each merging with the free block before it.
  if (!candidate->mapped && !map_block(candidate, std::min(candidate->size, rounded)))
    return nullptr;
  while (candidate->size < rounded) {
    Block* next = candidate->segment->next(candidate);
    if (!map_block(next, std::min(rounded - candidate->size, next->size))) return nullptr;
    candidate = next;  // map_block merged the old candidate into it
  }
  pool.erase(candidate);
  return candidate;
}

CachingAllocator::Block* CachingAllocator::find_expandable_block(bool small, stream_t stream,
                                                                 std::size_t size) {
  detail::UnmappedPool& unmapped = small ? small_unmapped_ : large_unmapped_;
  const stream_t key_stream = pool_stream(stream);
  auto allocatable = [](const Block* b) {
    return b != nullptr && !b->allocated && b->pending_events == 0 && b->stream_uses.empty();
  };
  for (auto it = unmapped.lower_bound(detail::AddressOrder::Key{key_stream, 0});
       it != unmapped.end() && (*it)->pool_stream == key_stream; ++it) {
    Block* c = *it;
    // A free block just before the unmapped space can be used too.
    if (Block* prev = c->segment->prev(c); allocatable(prev)) c = prev;
    std::size_t bytes = 0;
    for (const Block* b = c; bytes < size && allocatable(b); b = b->segment->next(b))
      bytes += b->size;
    if (bytes >= size) return c;
  }
  // No segment of this stream and pool has room: reserve a new one, of 9/8 of the device's
  // memory like PyTorch, in whole pages.
  const std::size_t page = expandable_page_size(small);
  const std::size_t capacity = device_->capacity();
  const std::size_t space =
      capacity == 0 ? kUnlimitedExpandableSpace : capacity + capacity / 8;
  const std::size_t reserve = round_up(space, page);
  if (size > reserve) return nullptr;  // can never be mapped: out of memory at once
  std::unique_ptr<Segment> segment;
  try {
    segment = std::make_unique<Segment>(*device_, reserve, page, small, stream);
  } catch (const OutOfMemory&) {
    return nullptr;
  }
  Segment* s = segment.get();
  s->blocks.emplace_back(s->ptr(), reserve, stream, key_stream, s);
  Block* block = &s->blocks.back();
  block->self = std::prev(s->blocks.end());
  block->mapped = false;
  segments_.emplace(s->ptr(), std::move(segment));
  unmapped.insert(block);
  return block;
}

bool CachingAllocator::map_block(Block* to_map, std::size_t size) {
  Segment* s = to_map->segment;
  detail::ExpandableMemory& memory = *s->expandable;
  const std::size_t page = memory.page_size();
  const std::size_t first = (to_map->ptr - s->ptr()) / page;
  const std::size_t last = (to_map->ptr + size - s->ptr() + page - 1) / page;
  // Pages stuck by a failed rollback hold memory: counted in reserved bytes while stuck.
  const std::size_t stuck_before = memory.stuck_bytes();
  bool ok;
  try {
    ok = memory.map(first, last);
  } catch (...) {
    stats_.reserved_bytes += memory.stuck_bytes() - stuck_before;
    throw;
  }
  if (!ok) {  // the device is out of memory
    stats_.reserved_bytes += memory.stuck_bytes() - stuck_before;
    return false;
  }
  const std::size_t reused = stuck_before - memory.stuck_bytes();  // already counted
  const std::size_t mapped = (last - first) * page;

  unmapped_of(*s).erase(to_map);
  to_map->mapped = true;
  if (mapped < to_map->size) {  // the rest stays unmapped
    auto rest = s->blocks.emplace(std::next(to_map->self), to_map->ptr + mapped,
                                  to_map->size - mapped, to_map->stream, to_map->pool_stream, s);
    rest->self = rest;
    rest->mapped = false;
    unmapped_of(*s).insert(&*rest);
    to_map->size = mapped;
  }
  return_to_pool(to_map);  // merges with free mapped neighbours, into the pool
  stats_.reserved_bytes += mapped - reused;
  ++segments_created_;  // PyTorch counts each map in num_device_alloc
  note_peaks();
  return true;
}

std::size_t CachingAllocator::unmap_block(Block* block) {
  Segment* s = block->segment;
  const std::size_t page = s->expandable->page_size();
  // Only the pages entirely inside the block.
  const std::size_t first = (block->ptr - s->ptr() + page - 1) / page;
  const std::size_t last = (block->ptr + block->size - s->ptr()) / page;
  if (first >= last) return 0;
  // cuMemUnmap does not wait for queued work, so wait first (PyTorch synchronizes too).
  device_->synchronize();
  std::size_t done = 0;
  try {
    s->expandable->unmap(first, last, done);
  } catch (...) {
    if (done > 0) apply_unmap(block, first, first + done);
    throw;
  }
  apply_unmap(block, first, last);
  return (last - first) * page;
}

void CachingAllocator::apply_unmap(Block* block, std::size_t first, std::size_t last) {
  Segment* s = block->segment;
  const std::size_t page = s->expandable->page_size();
  const device_ptr begin = s->ptr() + first * page;
  const std::size_t size = (last - first) * page;
  detail::BlockPool& pool = pool_of(*s);
  detail::UnmappedPool& unmapped = unmapped_of(*s);
  pool.erase(block);
  // The mapped parts before and after the unmapped pages stay free blocks.
  if (begin > block->ptr) {
    auto before = s->blocks.emplace(block->self, block->ptr, begin - block->ptr, block->stream,
                                    block->pool_stream, s);
    before->self = before;
    pool.insert(&*before);
  }
  if (const device_ptr end = block->ptr + block->size; end > begin + size) {
    auto after = s->blocks.emplace(std::next(block->self), begin + size, end - (begin + size),
                                   block->stream, block->pool_stream, s);
    after->self = after;
    pool.insert(&*after);
  }
  block->ptr = begin;
  block->size = size;
  block->mapped = false;
  // Merge with unmapped neighbours.
  if (Block* prev = s->prev(block); prev != nullptr && !prev->mapped) {
    unmapped.erase(prev);
    block->ptr = prev->ptr;
    block->size += prev->size;
    s->blocks.erase(prev->self);
  }
  if (Block* next = s->next(block); next != nullptr && !next->mapped) {
    unmapped.erase(next);
    block->size += next->size;
    s->blocks.erase(next->self);
  }
  unmapped.insert(block);
  stats_.reserved_bytes -= size;
  ++segments_released_;
}

std::size_t CachingAllocator::release_expandable(std::vector<Block*> blocks) {
  std::size_t released = 0;
  for (Block* b : blocks) {
    // Unmapping merges only unmapped blocks, and free mapped blocks are never neighbours, so
    // every gathered block is still alive here.
    released += unmap_block(b);
    Segment* s = b->segment;
    if (!b->mapped && s->unsplit()) {
      // PyTorch's release_expandable_segment: nothing mapped is left; free the reservation.
      const std::size_t stuck = s->expandable->stuck_bytes();
      s->expandable->free();  // may throw DeviceError: the segment then stays, unmapped
      stats_.reserved_bytes -= stuck;
      unmapped_of(*s).erase(b);
      segments_.erase(s->ptr());
    }
  }
  return released;
}

// ---- freeing cache ----

bool CachingAllocator::release_oversize_blocks(detail::BlockPool& pool, stream_t stream,
                                               std::size_t rounded) {
  // PyTorch's release_available_cached_blocks: only meaningful with max_split_size.
  // Not modeled with expandable segments (documented): their blocks are unmapped page by
  // page, never freed as a whole, so this step is skipped.
  if (options_.policy != CachingPolicy::pytorch || options_.expandable_segments ||
      options_.max_split_size == CachingAllocatorOptions::unlimited)
    return false;
  const stream_t key_stream = pool_stream(stream);
  const std::size_t target = std::max(rounded, options_.max_split_size);
  std::vector<Segment*> victims;
  auto it = pool.lower_bound(detail::BlockOrder::Key{key_stream, target, 0});
  // One cached oversize segment large enough: free the smallest such. (Oversize blocks are
  // never split under PyTorch's own limits; a split one cannot be freed, so it is skipped.)
  for (auto j = it; j != pool.end() && (*j)->pool_stream == key_stream; ++j) {
    if ((*j)->segment->unsplit()) {
      victims.push_back((*j)->segment);
      break;
    }
  }
  if (!victims.empty()) {
    release_segments(victims);
    return true;
  }
  // None large enough: free oversize ones from the largest down until target bytes are
  // freed. Like PyTorch, the ones freed stay freed even when they do not add up.
  std::size_t released = 0;
  while (it != pool.begin() && released < target) {
    --it;
    Block* b = *it;
    if (b->pool_stream != key_stream || b->size < options_.max_split_size) break;
    if (!b->segment->unsplit()) continue;
    victims.push_back(b->segment);
    released += b->size;
  }
  release_segments(victims);
  return released >= target;
}

std::size_t CachingAllocator::release_all_free_segments() {
  free_leftovers();
  // PyTorch's release_cached_blocks: first let frees waiting for other streams complete.
  pending_.synchronize_all([this](Block* b) { return_to_pool(b); });
  ++cache_flushes_;
  if (options_.expandable_segments) {
    // PyTorch's release_blocks, large pool first: every free block gives back its whole pages.
    std::vector<Block*> blocks(large_pool_.begin(), large_pool_.end());
    blocks.insert(blocks.end(), small_pool_.begin(), small_pool_.end());
    return release_expandable(std::move(blocks));
  }
  std::vector<Segment*> victims;
  for (auto& [ptr, segment] : segments_)
    if (segment->unsplit() && segment->blocks.front().is_free()) victims.push_back(segment.get());
  return release_segments(victims);
}

std::size_t CachingAllocator::release_segments(const std::vector<Segment*>& segments) {
  if (segments.empty()) return 0;
  // cudaFree waits for the device; unmapping does not, so wait here: work queued before the
  // last free of these blocks may still be using them.
  device_->synchronize();
  std::size_t released = 0;
  for (Segment* s : segments) {
    Block* b = &s->blocks.front();
    leftovers_.reserve(leftovers_.size() + 1);  // may throw bad_alloc: nothing changed
    try {
      s->memory->free();  // may throw DeviceError: the segment then stays cached
    } catch (...) {
      if (s->memory->mapped()) throw;  // nothing freed: still usable, stays cached
      // Partly freed (unmapped): unusable. What is left is kept as a leftover, counted in
      // reserved bytes while its physical allocation is held, freed later.
      const bool created = s->memory->created();
      const std::size_t size = s->memory->size();
      const device_ptr ptr = s->memory->ptr();
      leftovers_.push_back(s->memory->hand_over());
      pool_of(*s).erase(b);
      segments_.erase(ptr);
      if (!created) stats_.reserved_bytes -= size;
      ++segments_released_;
      throw;
    }
    pool_of(*s).erase(b);
    const std::size_t size = s->size();
    segments_.erase(s->ptr());
    stats_.reserved_bytes -= size;
    ++segments_released_;
    released += size;
  }
  return released;
}

std::size_t CachingAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  return release_all_free_segments();
}

void CachingAllocator::free_leftovers() noexcept {
  // Memory left by a failed segment creation whose rollback failed: retry freeing it (it was
  // never handed out, so no work uses it).
  for (auto it = leftovers_.begin(); it != leftovers_.end();) {
    const bool created = (*it)->created();
    try {
      (*it)->free();
    } catch (...) {
      if (created && !(*it)->created()) stats_.reserved_bytes -= (*it)->size();
      ++it;
      continue;
    }
    if (created) stats_.reserved_bytes -= (*it)->size();
    it = leftovers_.erase(it);
  }
}

// ---- deallocate ----

void CachingAllocator::return_to_pool(Block* block) {
  // Merge with free neighbours of the same segment (PyTorch's free_block / try_merge_blocks).
  Segment* s = block->segment;
  detail::BlockPool& pool = pool_of(*s);
  if (Block* prev = s->prev(block); prev != nullptr && prev->is_free() && prev->mapped) {
    pool.erase(prev);
    block->ptr = prev->ptr;
    block->size += prev->size;
    s->blocks.erase(prev->self);
  }
  if (Block* next = s->next(block); next != nullptr && next->is_free() && next->mapped) {
    pool.erase(next);
    block->size += next->size;
    s->blocks.erase(next->self);
  }
  block->requested = 0;
  block->stream_uses.clear();
  pool.insert(block);
}

void CachingAllocator::deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  device_->check_stream_alive(stream, "CachingAllocator.deallocate");
  if (observe_free(ptr, nbytes, stream)) return;  // a SwapManager took it over
  stream = detail::stream_key(stream);
  if (ptr == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end())
    throw InvalidPointer("CachingAllocator.deallocate: " + describe_unknown(ptr));
  Block* block = it->second;
  if (nbytes != unknown_size && nbytes != block->requested)
    throw InvalidArgument("CachingAllocator.deallocate: nbytes " + std::to_string(nbytes) +
                          " does not match the " + std::to_string(block->requested) +
                          " bytes asked for at allocate() of " + hex(ptr));

  // Streams other than the allocation stream that used the block: the freeing stream and
  // those given to record_stream. Reuse waits for their work queued until now.
  std::vector<stream_t> streams;
  bool unnameable = false;
  auto add = [&](stream_t s) {
    if (s == block->stream || std::find(streams.begin(), streams.end(), s) != streams.end())
      return;
    if (other_threads_stream(s))
      unnameable = true;  // no event can be recorded on it from this thread
    else
      streams.push_back(s);
  };
  add(stream);
  for (stream_t s : block->stream_uses) add(s);
  // record_stream(CU_STREAM_PER_THREAD) on another thread: waiting for the whole device
  // covers that stream's work queued before the free.
  if (unnameable) device_->synchronize();  // throws with nothing changed
  if (!streams.empty()) pending_.record(block, streams);  // throws with nothing changed

  live_.erase(it);
  device_->note_freed(ptr);  // checked mode: touching it now faults
  stats_.requested_bytes -= block->requested;
  stats_.allocated_bytes -= block->size;
  --stats_.live_allocations;
  ++stats_.total_deallocations;
  block->allocated = false;
  if (streams.empty()) return_to_pool(block);
}

void CachingAllocator::record_stream(device_ptr ptr, stream_t stream) {
  stream = detail::stream_key(stream);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end())
    throw InvalidPointer("CachingAllocator.record_stream: " + describe_unknown(ptr));
  Block* block = it->second;
  if (stream == block->stream ||
      std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) !=
          block->stream_uses.end())
    return;
  // Refuse an unknown stream now: found only at free time, it would make the block unfreeable.
  pending_.check_stream(stream);
  block->stream_uses.push_back(stream);
}

std::string CachingAllocator::describe_unknown(device_ptr ptr) const {
  const std::string p = hex(ptr);
  auto it = segments_.upper_bound(ptr);
  if (it != segments_.begin()) {
    const Segment& s = *std::prev(it)->second;
    if (ptr < s.ptr() + s.size()) {
      for (const Block& b : s.blocks) {
        if (ptr < b.ptr || ptr >= b.ptr + b.size) continue;
        if (b.ptr == ptr) return p + " is not a live allocation (already freed)";
        if (b.allocated)
          return p + " is an interior pointer, " + std::to_string(ptr - b.ptr) +
                 " bytes into the live allocation at " + hex(b.ptr);
        if (!b.mapped)
          return p + " is in unmapped address space of an expandable segment, not a live "
                     "allocation";
        return p + " is inside a free block of a cached segment, not a live allocation";
      }
    }
  }
  return p + " was never allocated by this allocator";
}

// ---- introspection ----

std::vector<std::pair<device_ptr, std::size_t>> CachingAllocator::live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<device_ptr, std::size_t>> out;
  out.reserve(live_.size());
  for (const auto& e : live_) out.emplace_back(e.first, e.second->requested);
  return out;
}

std::size_t CachingAllocator::allocation_size(device_ptr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end())
    throw InvalidPointer("CachingAllocator.allocation_size: " + describe_unknown(ptr));
  return it->second->requested;
}

Stats CachingAllocator::current_stats() const noexcept {
  Stats s = stats_;
  s.internal_fragmentation_bytes = s.allocated_bytes - s.requested_bytes;
  s.cached_bytes = s.reserved_bytes - s.allocated_bytes;
  return s;
}

void CachingAllocator::note_peaks() noexcept {
  Stats& s = stats_;
  s.internal_fragmentation_bytes = s.allocated_bytes - s.requested_bytes;
  s.peak_requested_bytes = std::max(s.peak_requested_bytes, s.requested_bytes);
  s.peak_reserved_bytes = std::max(s.peak_reserved_bytes, s.reserved_bytes);
  s.peak_allocated_bytes = std::max(s.peak_allocated_bytes, s.allocated_bytes);
  s.peak_internal_fragmentation_bytes =
      std::max(s.peak_internal_fragmentation_bytes, s.internal_fragmentation_bytes);
  s.peak_live_allocations = std::max(s.peak_live_allocations, s.live_allocations);
}

Stats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_stats();
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_ = current_stats();
  Stats& s = stats_;
  s.peak_requested_bytes = s.requested_bytes;
  s.peak_reserved_bytes = s.reserved_bytes;
  s.peak_allocated_bytes = s.allocated_bytes;
  s.peak_internal_fragmentation_bytes = s.internal_fragmentation_bytes;
  s.peak_live_allocations = s.live_allocations;
}

CachingSegmentStats CachingAllocator::segment_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CachingSegmentStats r;
  for (const auto& [ptr, segment] : segments_) {
    const Segment& s = *segment;
    (s.small ? r.small_segments : r.large_segments) += 1;
    // An expandable segment counts its mapped bytes (what it reserves).
    (s.small ? r.small_segment_bytes : r.large_segment_bytes) +=
        s.memory ? s.size() : s.expandable->mapped_bytes();
    for (const Block& b : s.blocks) {
      if (!b.mapped) continue;
      if (s.expandable && b.is_free()) {  // what release_cached() would unmap
        const std::size_t page = s.expandable->page_size();
        const std::size_t first = (b.ptr - s.ptr() + page - 1) / page;
        const std::size_t last = (b.ptr + b.size - s.ptr()) / page;
        if (first < last) ++r.unsplit_free_segments;
      }
      if (b.allocated) {
        ++r.live_blocks;
      } else if (b.pending_events > 0) {
        ++r.waiting_blocks;
        r.waiting_bytes += b.size;
      } else {
        ++r.free_blocks;
        r.free_bytes += b.size;
        r.largest_free_block = std::max(r.largest_free_block, b.size);
      }
    }
    if (s.memory && s.unsplit() && s.blocks.front().is_free()) ++r.unsplit_free_segments;
  }
  r.segments_created = segments_created_;
  r.segments_released = segments_released_;
  r.alloc_retries = alloc_retries_;
  r.cache_flushes = cache_flushes_;
  return r;
}

std::vector<CachingSegmentInfo> CachingAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CachingSegmentInfo> result;
  result.reserve(segments_.size());
  auto block_info = [](const Block& b) -> CachingBlockInfo {
    auto state = b.allocated             ? CachingBlockInfo::State::allocated
                 : b.pending_events > 0 ? CachingBlockInfo::State::waiting
                                        : CachingBlockInfo::State::free;
    // Streams as the caller passed them: a thread's per-thread stream is 0x2.
    return {b.ptr, b.size, b.requested, detail::stream_handle_of(b.stream), state};
  };
  for (const auto& [ptr, segment] : segments_) {
    const stream_t segment_stream = detail::stream_handle_of(segment->stream);
    if (segment->expandable) {
      // Like PyTorch's snapshot: one segment per contiguous mapped range.
      CachingSegmentInfo info{0, 0, segment->small, segment_stream, {}};
      for (const Block& b : segment->blocks) {
        if (!b.mapped) {
          if (!info.blocks.empty()) result.push_back(std::move(info));
          info = CachingSegmentInfo{0, 0, segment->small, segment_stream, {}};
          continue;
        }
        if (info.blocks.empty()) info.ptr = b.ptr;
        info.size += b.size;
        info.blocks.push_back(block_info(b));
      }
      if (!info.blocks.empty()) result.push_back(std::move(info));
      continue;
    }
    CachingSegmentInfo info{ptr, segment->size(), segment->small, segment_stream, {}};
    for (const Block& b : segment->blocks) info.blocks.push_back(block_info(b));
    result.push_back(std::move(info));
  }
  return result;
}

}  // namespace vmalloc
