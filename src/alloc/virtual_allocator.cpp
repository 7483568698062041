#include "vmalloc/alloc/virtual_allocator.hpp"

#include <algorithm>
#include <utility>

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/errors.hpp"

namespace vmalloc {

using detail::ArenaBlock;
using detail::ArenaChunk;
using detail::PendingWork;
using detail::RangeState;
using detail::StreamOrder;
using detail::hex;

namespace {

// Live-map values: a ChunkRange* as is, an ArenaBlock* with this bit set (nodes are aligned).
constexpr std::uintptr_t block_tag = 1;
// Cached ranges examined in the best-fit size list for one on the caller's stream.
constexpr int same_stream_scan = 8;

// The size asked for of a live allocation, from its live_ value.
std::size_t requested_of(std::uintptr_t v) noexcept {
  return (v & block_tag) ? reinterpret_cast<const ArenaBlock*>(v & ~block_tag)->requested
                         : reinterpret_cast<const detail::ChunkRange*>(v)->requested;
}

std::size_t resolve_small_threshold(std::size_t chunk_size, std::size_t threshold) {
  if (threshold == VirtualAllocatorOptions::default_small_threshold) return chunk_size / 2;
  if (threshold > chunk_size)
    throw InvalidArgument("VirtualAllocator: small_threshold " + std::to_string(threshold) +
                          " bytes is larger than a chunk (" + std::to_string(chunk_size) +
                          " bytes)");
  return threshold;
}

}  // namespace

VirtualAllocator::VirtualAllocator(std::shared_ptr<Device> device,
                                   const VirtualAllocatorOptions& options)
    : ChunkAllocatorCore("VirtualAllocator", std::move(device), options, /*placement_unit=*/1,
                         /*chunk_counts_are_bounds=*/false),
      small_threshold_(resolve_small_threshold(chunk_size_, options.small_threshold)),
      steal_before_create_(options.steal_before_create),
      arena_(chunk_size_, order_) {}

std::shared_ptr<VirtualAllocator> VirtualAllocator::create(std::shared_ptr<Device> device,
                                                           const VirtualAllocatorOptions& options) {
  return std::make_shared<VirtualAllocator>(std::move(device), options);
}

VirtualAllocator::~VirtualAllocator() { tear_down(reservations_); }

// ---------------------------------------------------------------------------------------------
// allocate

device_ptr VirtualAllocator::allocate(std::size_t nbytes, stream_t stream) {
  if (!admit_allocation(nbytes, stream)) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  live_.reserve_one();  // the only allocation on the hit path, and only while growing
  order_.note_stream(stream);
  const device_ptr p = counting_out_of_memory([&] {
    return nbytes <= small_threshold_ ? allocate_small(nbytes, stream)
                                      : allocate_chunks(nbytes, stream);
  });
  device_->note_live(p, nbytes);  // checked mode (HostDevice): these bytes may be touched
  return p;
}

device_ptr VirtualAllocator::allocate_chunks(std::size_t nbytes, stream_t stream) {
  const std::size_t k = chunks_for(nbytes);
  Range* r = take_cached(k, stream);
  if (r == nullptr) r = map_new_range(k, nbytes, stream);
  r->state = RangeState::live;
  r->requested = nbytes;
  const device_ptr p = address_of(r);
  live_.insert(p, reinterpret_cast<std::uintptr_t>(r));
  live_chunks_ += k;
  ++live_ranges_;
  counters_.count_allocation(nbytes, k * chunk_size_);
  return p;
}

ArenaBlock* VirtualAllocator::grow_arena(std::size_t nbytes, stream_t stream) {
  // No free block is large enough: a chunk joins the arena, taken like a 1-chunk request.
  Range* r = take_cached(1, stream);
  if (r == nullptr) r = map_new_range(1, nbytes, stream);
  ArenaChunk* c;
  try {
    c = arena_.add_chunk(address_of(r), r);
  } catch (...) {
    r->state = RangeState::cached;
    cache_range(r);
    throw;
  }
  r->state = RangeState::arena;
  r->arena = c;
  ArenaBlock* b = arena_.allocate(nbytes, stream);  // fits the new chunk: no pending work
  if (b == nullptr) throw std::logic_error("VirtualAllocator: a new arena chunk did not fit");
  return b;
}

inline device_ptr VirtualAllocator::allocate_small(std::size_t nbytes, stream_t stream) {
  ArenaBlock* b = arena_.allocate(nbytes, stream);
  if (b == nullptr) b = grow_arena(nbytes, stream);
  if (b->chunk == spare_) spare_ = nullptr;
  b->requested = nbytes;
  const device_ptr p = b->address();
  live_.insert(p, reinterpret_cast<std::uintptr_t>(b) | block_tag);
  ++live_blocks_;
  counters_.count_allocation(nbytes, b->size);
  return p;
}

VirtualAllocator::Range* VirtualAllocator::take_cached(std::size_t k, stream_t stream) {
  const std::size_t bucket = cached_.best_fit(k);
  if (bucket == cached_.npos) return nullptr;
  Range* const head = cached_.head(bucket);
  // Best fit by chunk count; within it prefer a range the stream may use at once, then one
  // whose free has completed, else the most recent (the stream then waits on its event).
  Range* c = nullptr;
  int n = 0;
  for (Range* r = head; r != nullptr && n < same_stream_scan; r = r->bucket_next, ++n)
    if (StreamOrder::free_on(r->work, stream)) {
      c = r;
      break;
    }
  if (c == nullptr) {
    n = 0;
    for (Range* r = head; r != nullptr && n < same_stream_scan; r = r->bucket_next, ++n)
      if (order_.completed(r->work)) {
        c = r;
        break;
      }
  }
  if (c == nullptr) c = head;
  order_.make_usable_on(c->work, stream);  // may throw: the range stays cached
  Range* rest = c->count > k ? ranges_.acquire() : nullptr;  // may throw bad_alloc: same
  cached_.remove(c);
  cached_chunks_ -= c->count;
  if (rest != nullptr) {
    // Split at a chunk boundary: every chunk is its own mapping, so no driver call.
    rest->reservation = c->reservation;
    rest->first = c->first + k;
    rest->count = c->count - k;
    rest->state = RangeState::cached;
    rest->requested = 0;
    rest->arena = nullptr;
    rest->work = order_.share(c->work);
    c->count = k;
    c->reservation->set_bounds(c);
    c->reservation->set_bounds(rest);
    cached_.insert(rest, rest->count);  // cannot allocate: sizes up to the reservation's
    cached_chunks_ += rest->count;
  }
  order_.drop(c->work);
  return c;
}

void VirtualAllocator::gather(detail::ChunkBatch& batch) {
  batch.gather(
      steal_before_create_, [](std::size_t) { return std::size_t{0}; },
      [this](std::size_t need, std::vector<physical_handle>& out, bool wait) {
        steal(need, out, wait);
      });
}

VirtualAllocator::Range* VirtualAllocator::map_new_range(std::size_t k, std::size_t nbytes,
                                                         stream_t /*stream*/) {
  // Decide feasibility before tearing anything down: free chunks anywhere count, whatever
  // the address space looks like.
  require_chunks(k, stealable_chunks(), nbytes);

  const std::size_t bytes = k * chunk_size_;
  // Bookkeeping first, so that a bad_alloc changes nothing on the device.
  auto res = std::make_unique<Reservation>();
  res->slots = k;
  res->handles.assign(k, 0);
  res->head.assign(k, nullptr);
  res->tail.assign(k, nullptr);
  cached_.reserve(k);
  detail::ChunkBatch batch(pool_, k);  // gives its chunks back unless committed
  Range* range = ranges_.acquire();

  std::size_t mapped = 0;
  device_ptr base = 0;
  auto undo = [&]() noexcept {
    // What the rollback cannot undo stays tracked: a reservation whose unmap or address free
    // fails is kept (quarantined, with the chunks still mapped in it) so that the books agree
    // with the device and release_cached() or the destructor tear it down later.
    std::size_t still_mapped = 0;
    bool keep = false;
    if (mapped > 0) {
      try {
        device_->unmap(base, mapped * chunk_size_);
      } catch (...) {
        still_mapped = mapped;
        keep = true;
      }
    }
    if (base != 0 && !keep) {
      try {
        device_->free_address(base, bytes);
      } catch (...) {
        keep = true;
      }
    }
    if (keep) {
      for (std::size_t i = 0; i < still_mapped; ++i) res->handles[i] = batch[i];
      res->mapped = still_mapped;
      res->quarantined = true;
      try {
        reservations_.emplace(base, std::move(res));
        // Chunks still mapped stay held (quarantined); the batch gives back the others
        // (created ones to the device): reserved bytes are as before.
        for (std::size_t i = 0; i < still_mapped; ++i) batch.leave_mapped(i);
      } catch (...) {
        // Out of host memory: nothing more can be done; the batch gives every chunk back.
      }
    }
    release_range(range);
  };
  try {
    base = device_->reserve(bytes, device_->granularity());
    res->base = base;
    gather(batch);
    if (!batch.full()) throw_out_of_memory(nbytes, "the device refused chunks it reported free");
    map_run(base, batch, mapped);
    for (std::size_t i = 0; i < k; ++i) res->handles[i] = batch[i];
    res->mapped = k;
    reservations_.emplace(base, std::move(res));  // bad_alloc leaves `res` intact: undone
  } catch (...) {
    undo();
    throw;
  }
  batch.commit();
  Reservation* r = reservations_.find(base)->second.get();
  range->reservation = r;
  range->first = 0;
  range->count = k;
  range->state = RangeState::live;
  range->requested = 0;
  range->arena = nullptr;
  range->work = PendingWork{};
  r->set_bounds(range);
  counters_.note_reserved(reserved_bytes());
  return range;
}

void VirtualAllocator::map_run(device_ptr base, const detail::ChunkBatch& batch,
                               std::size_t& mapped) {
  // One call for the run: the device may do its books once (each chunk is still a cuMemMap).
  device_->map_chunks(base, chunk_size_, batch.data(), batch.size(), mapped);
  device_->set_access(base, batch.size() * chunk_size_);  // one call over the whole run
}

// ---------------------------------------------------------------------------------------------
// stealing and unmapping

void VirtualAllocator::steal(std::size_t need, std::vector<physical_handle>& out, bool wait) {
  struct Candidate {
    Range* range;       // a cached range, or
    ArenaChunk* chunk;  // an arena chunk without live blocks
    std::size_t count;
    bool ready;         // no pending work: unmapping needs no host wait
  };
  std::vector<Candidate> candidates;
  candidates.reserve(cached_.count() + arena_.empty_chunks());
  // Without waiting, a free's work is polled (its event recorded first if it has none), so
  // that single-stream frees can be taken too; with waiting, only queried.
  cached_.for_each([&](Range* r) {
    const bool ready = wait ? order_.completed(r->work) : order_.poll(r->work);
    if (ready || wait) candidates.push_back({r, nullptr, r->count, ready});
  });
  arena_.for_each_empty_chunk([&](ArenaChunk* c) {
    // Stealing first leaves the spare alone: the next small request would take a chunk back.
    const bool ready = !wait && c != spare_ && arena_.poll_chunk(c);
    if (ready || wait) candidates.push_back({nullptr, c, 1, ready});
  });
  // Work already done first (no host blocking), then the largest (fewest cuMemUnmap calls).
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.ready != b.ready) return a.ready;
                     return a.count > b.count;
                   });
  for (const Candidate& c : candidates) {
    if (need == 0) break;
    if (c.chunk != nullptr) {
      arena_.synchronize_chunk(c.chunk);  // may throw: the chunk stays in the arena
      if (spare_ == c.chunk) spare_ = nullptr;
      Range* r = static_cast<Range*>(c.chunk->owner);
      r->work = arena_.remove_chunk(c.chunk);
      r->arena = nullptr;
      r->state = RangeState::cached;
      try {
        unmap_tail(r, 1, out);
      } catch (...) {
        cache_range(r);
        throw;
      }
      --need;
      ++stolen_;
    } else {
      Range* r = c.range;
      order_.synchronize(r->work);  // may throw: the range stays cached
      const std::size_t take = std::min(need, r->count);
      cached_.remove(r);
      cached_chunks_ -= r->count;
      const std::size_t left = r->count - take;
      try {
        unmap_tail(r, take, out);
      } catch (...) {
        cached_.insert(r, r->count);
        cached_chunks_ += r->count;
        throw;
      }
      if (left > 0) {
        cached_.insert(r, r->count);
        cached_chunks_ += r->count;
      }
      need -= take;
      stolen_ += take;
    }
  }
}

void VirtualAllocator::unmap_tail(Range* r, std::size_t take, std::vector<physical_handle>& out) {
  Reservation* res = r->reservation;
  const std::size_t first = r->first + r->count - take;
  device_->unmap(res->base + first * chunk_size_, take * chunk_size_);  // may throw: unchanged
  for (std::size_t i = first; i < first + take; ++i) {
    out.push_back(res->handles[i]);  // capacity reserved by the caller
    res->handles[i] = 0;
    res->head[i] = res->tail[i] = nullptr;
  }
  res->mapped -= take;
  r->count -= take;
  if (r->count == 0) {
    release_range(r);
    drop_reservation_if_empty(res);
  } else {
    res->set_bounds(r);
  }
}

void VirtualAllocator::drop_reservation_if_empty(Reservation* res) {
  if (res->mapped != 0 || res->unbacked != 0) return;  // unbacked live ranges keep it
  try {
    device_->free_address(res->base, res->slots * chunk_size_);
  } catch (...) {
    return;  // kept (empty) and retried by release_cached() and the destructor
  }
  reservations_.erase(res->base);
}

// ---------------------------------------------------------------------------------------------
// deallocate

void VirtualAllocator::deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  const stream_t caller_stream = stream;
  if (!admit_free(ptr, stream)) return;
  if (observe_free(ptr, nbytes, caller_stream)) return;  // a SwapManager took it over
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t slot = live_.find_slot(ptr);  // valid until live_ changes below
  if (slot == live_.npos) throw_invalid_pointer(ptr, "deallocate");
  const std::uintptr_t v = live_.value_at(slot);
  if (v & block_tag) {
    ArenaBlock* b = reinterpret_cast<ArenaBlock*>(v & ~block_tag);
    check_free_size(nbytes, b->requested, ptr);
    const PendingWork work = order_.on_free(stream);  // may throw: nothing changed
    live_.erase_at(slot);
    --live_blocks_;
    device_->note_freed(ptr);  // checked mode: touching it now faults
    counters_.count_deallocation(b->requested, b->size);
    ArenaChunk* c = arena_.deallocate(b, work);
    if (c != nullptr) {
      // Keep one empty arena chunk against alloc/free churn; others rejoin the range cache.
      if (spare_ == nullptr) spare_ = c;
      else retire_arena_chunk(c);
    }
    return;
  }
  Range* r = reinterpret_cast<Range*>(v);
  check_free_size(nbytes, r->requested, ptr);
  if (r->unbacked) {
    // Swapped out (unmap_backing): no chunk to cache, no work to order; its slots become
    // unmapped address space, and the reservation goes once nothing else is in it.
    Reservation* res = r->reservation;
    live_.erase_at(slot);
    --live_ranges_;
    --unbacked_ranges_;
    device_->note_freed(ptr);
    unbacked_chunks_ -= r->count;
    unbacked_bytes_ -= r->requested;
    --res->unbacked;
    counters_.count_deallocation(0, 0);  // its bytes left the counts at unmap_backing
    release_range(r);
    drop_reservation_if_empty(res);
    return;
  }
  const PendingWork work = order_.on_free(stream);  // may throw: nothing changed
  live_.erase_at(slot);
  live_chunks_ -= r->count;
  --live_ranges_;
  device_->note_freed(ptr);
  counters_.count_deallocation(r->requested, r->count * chunk_size_);
  r->requested = 0;
  r->state = RangeState::cached;
  r->work = work;
  cache_range(r);
}

void VirtualAllocator::cache_range(Range* r) noexcept {
  Reservation* res = r->reservation;
  // Merge with cached neighbours of this reservation: their mappings are adjacent, so the
  // union is one contiguous range, for free.
  if (r->first > 0) {
    Range* left = res->range_ending_at(r->first - 1);
    if (left != nullptr && left->state == RangeState::cached &&
        StreamOrder::can_merge(left->work, r->work)) {
      cached_.remove(left);
      cached_chunks_ -= left->count;
      order_.merge_into(r->work, left->work);
      r->first = left->first;
      r->count += left->count;
      release_range(left);
    }
  }
  Range* right = res->range_starting_at(r->first + r->count);
  if (right != nullptr && right->state == RangeState::cached &&
      StreamOrder::can_merge(r->work, right->work)) {
    cached_.remove(right);
    cached_chunks_ -= right->count;
    order_.merge_into(r->work, right->work);
    r->count += right->count;
    release_range(right);
  }
  res->set_bounds(r);
  cached_.insert(r, r->count);  // sizes up to the reservation's were reserved: no allocation
  cached_chunks_ += r->count;
}

void VirtualAllocator::release_range(Range* r) noexcept {
  r->reservation = nullptr;  // stale head/tail entries pointing here no longer validate
  r->count = 0;
  r->unbacked = false;  // nodes are recycled
  ranges_.release(r);
}

void VirtualAllocator::retire_arena_chunk(ArenaChunk* c) noexcept {
  if (spare_ == c) spare_ = nullptr;
  Range* r = static_cast<Range*>(c->owner);
  r->work = arena_.remove_chunk(c);
  r->arena = nullptr;
  r->state = RangeState::cached;
  cache_range(r);
}

// ---------------------------------------------------------------------------------------------
// release_cached

std::size_t VirtualAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Arena chunks without live blocks rejoin the range cache first.
  std::vector<ArenaChunk*> empty;
  arena_.for_each_empty_chunk([&](ArenaChunk* c) { empty.push_back(c); });
  for (ArenaChunk* c : empty) {
    arena_.synchronize_chunk(c);
    retire_arena_chunk(c);
  }
  // Then every cached range: wait for its work, unmap it, chunks to the pool's cache.
  std::vector<Range*> ranges;
  ranges.reserve(cached_.count());
  cached_.for_each([&](Range* r) { ranges.push_back(r); });
  std::vector<physical_handle> handles;
  for (Range* r : ranges) {
    order_.synchronize(r->work);
    cached_.remove(r);
    cached_chunks_ -= r->count;
    handles.clear();
    handles.reserve(r->count);
    try {
      unmap_tail(r, r->count, handles);
    } catch (...) {
      cached_.insert(r, r->count);
      cached_chunks_ += r->count;
      throw;
    }
    pool_.give_back(handles);
  }
  // Reservations quarantined by a failed rollback: unmap their chunks into the pool's cache.
  for (auto& e : reservations_) {
    Reservation* res = e.second.get();
    if (!res->quarantined || res->mapped == 0) continue;
    device_->unmap(res->base, res->mapped * chunk_size_);  // throws: kept, retried later
    for (std::size_t i = 0; i < res->mapped; ++i) {
      pool_.give_back(res->handles[i]);
      res->handles[i] = 0;
    }
    res->mapped = 0;
  }
  // Reservations left empty by an earlier failed cuMemAddressFree.
  std::vector<Reservation*> empties;
  for (auto& e : reservations_)
    if (e.second->mapped == 0) empties.push_back(e.second.get());
  for (Reservation* res : empties) drop_reservation_if_empty(res);
  return pool_.release_cached();
}

// ---------------------------------------------------------------------------------------------
// accounting and introspection

std::uintptr_t VirtualAllocator::live_value(device_ptr ptr, const char* operation) const {
  const std::uintptr_t v = ptr == 0 ? 0 : live_.find(ptr);
  if (v == 0) throw_invalid_pointer(ptr, operation);
  return v;
}

std::size_t VirtualAllocator::allocation_size(device_ptr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return requested_of(live_value(ptr, "allocation_size"));
}

std::vector<std::pair<device_ptr, std::size_t>> VirtualAllocator::live_allocations() const {
  return list_live(requested_of);
}

ChunkStats VirtualAllocator::chunk_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ChunkStats s;
  fill_common_stats(s, small_threshold_, reservations_);
  s.chunks_live = live_chunks_;
  s.chunks_cached = cached_chunks_;
  s.chunks_in_arenas = arena_.chunks();
  s.arena_chunks_empty = arena_.empty_chunks();
  s.free_chunks = s.chunks_cached + s.chunks_in_pool + s.arena_chunks_empty;
  s.cached_ranges = cached_.count();
  s.live_ranges = live_ranges_;
  s.live_blocks = live_blocks_;
  s.free_blocks = arena_.free_blocks();
  s.arena_free_bytes = arena_.free_bytes();
  s.unbacked_ranges = unbacked_ranges_;
  s.chunks_unbacked = unbacked_chunks_;
  s.unbacked_bytes = unbacked_bytes_;
  return s;
}

// ---------------------------------------------------------------------------------------------
// swap primitives: a live chunk-path allocation loses and regains its chunks at one address

VirtualAllocator::Range* VirtualAllocator::live_range(device_ptr ptr, const char* operation) const {
  const std::uintptr_t v = live_value(ptr, operation);
  if (v & block_tag)
    throw InvalidArgument(std::string("VirtualAllocator.") + operation + ": the allocation at " +
                          hex(ptr) + " of " +
                          std::to_string(reinterpret_cast<const ArenaBlock*>(v & ~block_tag)->requested) +
                          " bytes is a small block sharing an arena chunk (at most small_threshold = " +
                          std::to_string(small_threshold_) + " bytes): it owns no chunk of its own");
  return reinterpret_cast<Range*>(v);
}

bool VirtualAllocator::owns_chunks(device_ptr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return (live_value(ptr, "owns_chunks") & block_tag) == 0;
}

bool VirtualAllocator::is_unbacked(device_ptr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uintptr_t v = live_value(ptr, "is_unbacked");
  return (v & block_tag) == 0 && reinterpret_cast<const Range*>(v)->unbacked;
}

void VirtualAllocator::unmap_backing(device_ptr ptr, stream_t stream, bool synchronize) {
  std::lock_guard<std::mutex> lock(mutex_);
  Range* r = live_range(ptr, "unmap_backing");
  if (r->unbacked)
    throw InvalidArgument("VirtualAllocator.unmap_backing: the allocation at " + hex(ptr) +
                          " is already unbacked");
  Reservation* res = r->reservation;
  const std::size_t k = r->count;
  std::vector<physical_handle> handles;
  handles.reserve(k);  // before any device call: a bad_alloc changes nothing
  pool_.reserve_cache(k);
  // cuMemUnmap does not wait for work using the memory: the stream's work must be done.
  if (synchronize) device_->synchronize_stream(stream);  // may throw: nothing changed
  device_->unmap(address_of(r), k * chunk_size_);        // one call over the run; may throw
  for (std::size_t i = r->first; i < r->first + k; ++i) {
    handles.push_back(res->handles[i]);
    res->handles[i] = 0;
  }
  res->mapped -= k;
  ++res->unbacked;
  r->unbacked = true;
  live_chunks_ -= k;
  ++unbacked_ranges_;
  unbacked_chunks_ += k;
  unbacked_bytes_ += r->requested;
  counters_.unback(r->requested, k * chunk_size_);
  pool_.give_back(handles);  // capacity reserved: cannot throw
}

void VirtualAllocator::unmap_leftovers(Range* r) {
  // A map_backing whose mapping failed and whose rollback cuMemUnmap failed too left its
  // first chunks mapped (inaccessible) in the unbacked range's slots. Mapping over them would
  // fail forever ("overlaps the mapping") and the data on host would never come back: unmap
  // them first, and the pool takes them back as unmap_backing gives chunks back.
  Reservation* res = r->reservation;
  std::size_t m = 0;
  while (m < r->count && res->handles[r->first + m] != 0) ++m;
  if (m == 0) return;
  pool_.reserve_cache(m);                                 // give_back below cannot throw
  device_->unmap(address_of(r), m * chunk_size_);         // may throw: nothing changed
  for (std::size_t i = r->first; i < r->first + m; ++i) {
    pool_.give_back(res->handles[i]);
    res->handles[i] = 0;
  }
  res->mapped -= m;
}

void VirtualAllocator::map_backing(device_ptr ptr, stream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Range* r = live_range(ptr, "map_backing");
  if (!r->unbacked)
    throw InvalidArgument("VirtualAllocator.map_backing: the allocation at " + hex(ptr) +
                          " is backed (not swapped out)");
  const std::size_t k = r->count;
  const std::size_t nbytes = r->requested;
  unmap_leftovers(r);  // a double fault in an earlier map_backing; may throw: nothing changed
  counting_out_of_memory([&] {
    // Feasibility first, as allocate() decides it: free chunks anywhere count.
    require_chunks(k, stealable_chunks(), nbytes, /*backing=*/ptr);
    order_.note_stream(stream);
    Reservation* res = r->reservation;
    const device_ptr base = address_of(r);
    detail::ChunkBatch batch(pool_, k);  // gives its chunks back unless committed
    pool_.reserve_cache(k);
    std::size_t mapped = 0;
    auto undo = [&]() noexcept {
      if (mapped == 0) return;
      try {
        device_->unmap(base, mapped * chunk_size_);
      } catch (...) {
        // Double fault: the chunks stay mapped in an unbacked range's slots. Record them
        // there so that teardown unmaps them; the pool forgets them (never reused).
        for (std::size_t i = 0; i < mapped; ++i) {
          res->handles[r->first + i] = batch[i];
          batch.leave_mapped(i);
        }
        res->mapped += mapped;
      }
    };
    try {
      gather(batch);
      if (!batch.full())
        throw_out_of_memory(nbytes, "the device refused chunks it reported free to back " +
                                        hex(ptr));
      map_run(base, batch, mapped);
    } catch (...) {
      undo();
      throw;
    }
    batch.commit();
    for (std::size_t i = 0; i < k; ++i) res->handles[r->first + i] = batch[i];
    res->mapped += k;
    --res->unbacked;
    r->unbacked = false;
    live_chunks_ += k;
    --unbacked_ranges_;
    unbacked_chunks_ -= k;
    unbacked_bytes_ -= nbytes;
    counters_.reback(nbytes, k * chunk_size_);
    counters_.note_reserved(reserved_bytes());
  });
}

void VirtualAllocator::throw_invalid_pointer(device_ptr ptr, const char* operation) const {
  ChunkAllocatorCore::throw_invalid_pointer(
      ptr, operation, reservations_, [&](const Reservation& res, std::size_t offset) -> std::string {
        const Range* r = res.range_covering(offset / chunk_size_);
        if (r == nullptr) return "not a live allocation (unmapped address space of this allocator)";
        if (r->state == RangeState::live) return interior_pointer(ptr, address_of(r), r->requested);
        if (r->state == RangeState::arena) {
          const ArenaBlock* b = arena_.block_containing(r->arena, ptr);
          if (b != nullptr && !b->free) return interior_pointer(ptr, b->address(), b->requested);
        }
        return freed_memory;
      });
}

}  // namespace vmalloc
