#include "vmalloc/alloc/packed_virtual_allocator.hpp"

#include <algorithm>
#include <utility>

#include "vmalloc/base/errors.hpp"

namespace vmalloc {

using detail::packed_block_bytes;
using detail::PendingWork;
using detail::StreamOrder;

namespace {

constexpr std::size_t default_reservation_size = std::size_t{1} << 30;
// Stealing first may create chunks, rather than steal, for slots that were stolen and are
// needed again (see back_slots): up to remap_slack above the peak of slots live blocks
// touched in all, and 1/64 of that peak (at least one) per allocation: a loop's remaps are
// spread over many allocations; one huge tensor landing on stolen slots is not a loop settling.
constexpr std::size_t regret_step_divisor = 64;

double resolve_remap_slack(double slack) {
  if (!(slack >= 0.0 && slack <= 1.0))  // also refuses NaN
    throw InvalidArgument("PackedVirtualAllocator: remap_slack must be in [0, 1], got " +
                          std::to_string(slack));
  return slack;
}
// PyTorch's small-pool limit: below it tensors are many, small and often long-lived.
constexpr std::size_t default_small_threshold = std::size_t{1} << 20;
// Holes up to 32 MiB get exact-size buckets (512 KiB of list heads per index).
constexpr std::size_t exact_hole_units = (std::size_t{32} << 20) / packed_block_bytes;

std::size_t resolve_small_threshold(std::size_t threshold) {
  if (threshold == PackedVirtualAllocatorOptions::default_small_threshold)
    return default_small_threshold;
  if (threshold > max_request_bytes)
    throw InvalidArgument("PackedVirtualAllocator: small_threshold " + std::to_string(threshold) +
                          " bytes exceeds the limit of 2**56 bytes");
  return threshold;
}

std::size_t resolve_reservation_size(std::size_t chunk_size, std::size_t bytes) {
  if (bytes == 0) bytes = std::max(default_reservation_size, chunk_size);
  if (bytes > max_request_bytes)
    throw InvalidArgument("PackedVirtualAllocator: reservation_size " + std::to_string(bytes) +
                          " bytes exceeds the limit of 2**56 bytes");
  return (bytes + chunk_size - 1) / chunk_size * chunk_size;
}

}  // namespace

PackedVirtualAllocator::PackedVirtualAllocator(std::shared_ptr<Device> device,
                                               const PackedVirtualAllocatorOptions& options)
    : ChunkAllocatorCore("PackedVirtualAllocator", std::move(device), options,
                         /*placement_unit=*/packed_block_bytes, /*chunk_counts_are_bounds=*/true),
      small_threshold_(resolve_small_threshold(options.small_threshold)),
      reservation_size_(resolve_reservation_size(chunk_size_, options.reservation_size)),
      steal_before_create_(options.steal_before_create),
      remap_slack_(resolve_remap_slack(options.remap_slack)),
      small_holes_(exact_hole_units),
      large_holes_(exact_hole_units) {}

std::shared_ptr<PackedVirtualAllocator> PackedVirtualAllocator::create(
    std::shared_ptr<Device> device, const PackedVirtualAllocatorOptions& options) {
  return std::make_shared<PackedVirtualAllocator>(std::move(device), options);
}

PackedVirtualAllocator::~PackedVirtualAllocator() {
  tear_down(reservations_);  // then the node pool frees the blocks
}

// ---------------------------------------------------------------------------------------------
// allocate

device_ptr PackedVirtualAllocator::allocate(std::size_t nbytes, stream_t stream) {
  if (!admit_allocation(nbytes, stream)) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  live_.reserve_one();  // the only allocations on the hit path, and only while growing
  Block* spare = blocks_.acquire();  // the split's remainder, if any
  order_.note_stream(stream);
  const std::size_t size =
      (nbytes + packed_block_bytes - 1) / packed_block_bytes * packed_block_bytes;
  const HoleKind kind = nbytes <= small_threshold_ ? HoleKind::small : HoleKind::large;

  Reservation* created = nullptr;  // dropped again if this call fails
  auto fail = [&]() noexcept {
    if (created != nullptr) drop_reservation_if_empty(created);
    blocks_.release(spare);
  };

  Block* h = holes(kind).best_fit(size / packed_block_bytes, stream, [&](const Block* b) {
    return unmapped_in(b->reservation, slot_of(b->offset), slot_of(b->offset + size - 1));
  });
  try {
    counting_out_of_memory([&] {
      if (h == nullptr) {
        // A fresh reservation needs ceil(size / mc) chunks: decide before reserving anything.
        require_chunks(chunks_for(size), free_mapped_, nbytes);
        h = new_reservation(std::max(size, reservation_size_), kind);
        created = h->reservation;
      }
      Reservation* res = h->reservation;
      std::size_t first = slot_of(h->offset);
      std::size_t last = slot_of(h->offset + size - 1);
      std::size_t need = unmapped_in(res, first, last);
      if (need > 0 && !chunks_available(need, free_mapped_ - free_mapped_in(res, first, last))) {
        // The best hole needs more chunks than are free (it straddles unmapped slots, or
        // would steal its own): a fresh chunk-aligned spot needs only ceil(size / mc).
        const std::size_t k = chunks_for(size);
        require_chunks(k, free_mapped_, nbytes);
        if (created != nullptr) {  // cannot happen (a fresh hole needs exactly k); be safe
          drop_reservation_if_empty(created);
          created = nullptr;
        }
        h = new_reservation(k * chunk_size_, kind);
        created = res = h->reservation;
        first = 0;
        last = k - 1;
        need = k;
        ++fresh_;
      }
      order_.make_usable_on(h->work, stream);  // may throw: nothing changed
      if (need > 0) back_slots(res, first, last, need, nbytes);
    });
  } catch (...) {
    fail();
    throw;
  }

  // Commit: nothing below throws.
  Reservation* res = h->reservation;
  if (h->size > size) {
    Block* rest = spare;
    spare = nullptr;
    rest->reservation = res;
    rest->offset = h->offset + size;
    rest->size = h->size - size;
    rest->requested = 0;
    rest->free = true;
    rest->work = order_.share(h->work);
    rest->prev = h;
    rest->next = h->next;
    if (h->next != nullptr) h->next->prev = rest;
    h->next = rest;
    h->size = size;
    // Its right neighbour is live or a hole it could not merge with before: no merge now.
    holes(kind).replace(h, rest);
  } else {
    holes(kind).remove(h);
  }
  order_.drop(h->work);
  h->free = false;
  h->requested = nbytes;
  for (std::size_t s = slot_first(h), e = slot_last(h); s <= e; ++s) {
    if (res->live[s]++ == 0) {
      --free_mapped_;
      ++live_slots_;
    }
  }
  peak_live_slots_ = std::max(peak_live_slots_, live_slots_);
  ++res->live_blocks;
  const device_ptr p = res->address_of(h);
  live_.insert(p, reinterpret_cast<std::uintptr_t>(h));
  counters_.count_allocation(nbytes, size);
  if (spare != nullptr) blocks_.release(spare);
  device_->note_live(p, nbytes);  // checked mode (HostDevice): these bytes may be touched
  return p;
}

PackedVirtualAllocator::Block* PackedVirtualAllocator::new_reservation(std::size_t bytes,
                                                                       HoleKind kind) {
  const std::size_t slots = (bytes + chunk_size_ - 1) / chunk_size_;
  auto res = std::make_unique<Reservation>();
  res->slots = slots;
  res->kind = kind;
  res->handles.assign(slots, 0);
  res->live.assign(slots, 0);
  res->robbed.assign(slots, 0);
  Block* b = blocks_.acquire();
  try {
    res->base = device_->reserve(slots * chunk_size_, device_->granularity());
  } catch (...) {
    blocks_.release(b);
    throw;
  }
  Reservation* r = res.get();
  try {
    reservations_.emplace(r->base, std::move(res));
  } catch (...) {
    try {
      device_->free_address(r->base, slots * chunk_size_);
    } catch (...) {
    }
    blocks_.release(b);
    throw;
  }
  // Nodes come back from the pool as they were released: set every field.
  b->reservation = r;
  b->offset = 0;
  b->size = slots * chunk_size_;
  b->requested = 0;
  b->prev = b->next = nullptr;
  b->free = true;
  b->work = PendingWork{};
  r->first = b;
  holes(kind).insert(b);
  return b;
}

void PackedVirtualAllocator::back_slots(Reservation* res, std::size_t first, std::size_t last,
                                        std::size_t need, std::size_t nbytes) {
  detail::ChunkBatch batch(pool_, need);  // gives its chunks back unless committed
  std::vector<std::size_t> newly;  // slots this call mapped, ascending; newly[i] holds batch[i]
  newly.reserve(need);
  auto undo = [&]() noexcept {
    // Unmap what this call mapped; a slot that will not unmap stays mapped, as a free slot.
    for (std::size_t i = 0; i < newly.size(); ++i) {
      const std::size_t s = newly[i];
      try {
        device_->unmap(res->base + s * chunk_size_, chunk_size_);
      } catch (...) {
        batch.leave_mapped(i);
        continue;
      }
      res->handles[s] = 0;
      --res->mapped;
      --free_mapped_;
    }
  };
  // Stealing first: a slot stolen before and needed again gets a new chunk, within the limits
  // above, since stealing for it once more would only move the remap elsewhere (a periodic
  // loop would remap every step).
  auto create_first = [&](std::size_t missing) -> std::size_t {
    if (remap_slack_ <= 0.0) return 0;
    std::size_t regrets = 0;
    for (std::size_t s = first; s <= last; ++s) regrets += res->robbed[s];
    const std::size_t held = pool_.chunks_held();
    const std::size_t cap =
        peak_live_slots_ +
        static_cast<std::size_t>(static_cast<double>(peak_live_slots_) * remap_slack_);
    return std::min({regrets, missing, pool_.creatable_chunks(), cap > held ? cap - held : 0,
                     std::max<std::size_t>(1, peak_live_slots_ / regret_step_divisor)});
  };
  try {
    batch.gather(steal_before_create_, create_first,
                 [&](std::size_t n, std::vector<physical_handle>& out, bool wait) {
                   steal(n, res, first, last, out, wait);
                 });
    batch.put_created_last();
    if (!batch.full())
      throw_out_of_memory(nbytes, "the device refused chunks it reported creatable");
    counters_.note_reserved(reserved_bytes());
    for (std::size_t s = first; s <= last; ++s) {
      if (res->handles[s] != 0) continue;
      const physical_handle h = batch[newly.size()];
      device_->map(res->base + s * chunk_size_, chunk_size_, h);
      res->handles[s] = h;
      ++res->mapped;
      ++free_mapped_;
      newly.push_back(s);
    }
    // One cuMemSetAccess per contiguous run of newly mapped slots.
    for (std::size_t i = 0; i < newly.size();) {
      std::size_t j = i;
      while (j + 1 < newly.size() && newly[j + 1] == newly[j] + 1) ++j;
      device_->set_access(res->base + newly[i] * chunk_size_, (j - i + 1) * chunk_size_);
      i = j + 1;
    }
  } catch (...) {
    undo();
    throw;
  }
  batch.commit();
  for (std::size_t s : newly) res->robbed[s] = 0;
}

// ---------------------------------------------------------------------------------------------
// stealing and unmapping

void PackedVirtualAllocator::steal(std::size_t need, const Reservation* keep,
                                   std::size_t keep_first, std::size_t keep_last,
                                   std::vector<physical_handle>& out, bool wait) {
  auto victim = [&](const Reservation* r, std::size_t s) {
    return r->handles[s] != 0 && r->live[s] == 0 &&
           !(r == keep && s >= keep_first && s <= keep_last);
  };
  std::vector<Reservation*> emptied;
  // Highest addresses first: placement packs low, so the top is the least likely reused.
  for (auto it = reservations_.rbegin(); it != reservations_.rend() && need > 0; ++it) {
    Reservation* r = it->second.get();
    if (r->mapped == 0) continue;
    Block* cursor = nullptr;  // holes_done's walk: slots go down, so do the blocks it visits
    for (std::size_t s = r->slots; s > 0 && need > 0;) {
      --s;
      if (!victim(r, s) || (!wait && !holes_done(r, s, s, cursor))) continue;
      std::size_t lo = s;
      while (lo > 0 && s - lo + 1 < need && victim(r, lo - 1) &&
             (wait || holes_done(r, lo - 1, lo - 1, cursor)))
        --lo;
      if (wait) synchronize_holes(r, lo, s);  // may throw: nothing unmapped for this run
      unmap_slots(r, lo, s, out);   // may throw: same
      std::fill(r->robbed.begin() + static_cast<std::ptrdiff_t>(lo),
                r->robbed.begin() + static_cast<std::ptrdiff_t>(s) + 1, std::uint8_t{1});
      need -= s - lo + 1;
      stolen_ += s - lo + 1;
      s = lo;
    }
    if (r->mapped == 0 && r->live_blocks == 0) emptied.push_back(r);
  }
  for (Reservation* r : emptied) drop_reservation_if_empty(r, keep);
}

void PackedVirtualAllocator::synchronize_holes(Reservation* res, std::size_t first,
                                               std::size_t last) {
  const std::size_t lo = first * chunk_size_, hi = (last + 1) * chunk_size_;
  for (Block* b = res->first; b != nullptr && b->offset < hi; b = b->next)
    if (b->free && b->end() > lo) order_.synchronize(b->work);
}

bool PackedVirtualAllocator::holes_done(Reservation* res, std::size_t first, std::size_t last,
                                        Block*& cursor) {
  const std::size_t lo = first * chunk_size_, hi = (last + 1) * chunk_size_;
  // Start at the block holding byte `lo`, found from `cursor` (the previous call's start):
  // calls for descending slots walk the reservation's blocks once in all, not once each.
  Block* b = cursor != nullptr ? cursor : res->first;
  while (b->prev != nullptr && b->offset > lo) b = b->prev;
  while (b->next != nullptr && b->end() <= lo) b = b->next;
  cursor = b;
  for (; b != nullptr && b->offset < hi; b = b->next)
    if (b->free && b->end() > lo && !order_.poll(b->work)) return false;
  return true;
}

void PackedVirtualAllocator::unmap_slots(Reservation* res, std::size_t first, std::size_t last,
                                         std::vector<physical_handle>& out) {
  const std::size_t n = last - first + 1;
  device_->unmap(res->base + first * chunk_size_, n * chunk_size_);  // may throw: unchanged
  for (std::size_t s = first; s <= last; ++s) {
    out.push_back(res->handles[s]);  // capacity reserved by the caller
    res->handles[s] = 0;
  }
  res->mapped -= n;
  free_mapped_ -= n;
}

void PackedVirtualAllocator::drop_reservation_if_empty(Reservation* res, const Reservation* keep) {
  if (res == keep || res->mapped != 0 || res->live_blocks != 0) return;
  try {
    device_->free_address(res->base, res->slots * chunk_size_);
  } catch (...) {
    return;  // kept (empty) and retried by release_cached() and the destructor
  }
  for (Block* b = res->first; b != nullptr;) {
    Block* next = b->next;
    holes(res->kind).remove(b);
    order_.drop(b->work);
    blocks_.release(b);
    b = next;
  }
  reservations_.erase(res->base);
}

std::size_t PackedVirtualAllocator::free_mapped_in(const Reservation* res, std::size_t first,
                                                   std::size_t last) const noexcept {
  std::size_t n = 0;
  for (std::size_t s = first; s <= last; ++s) n += res->handles[s] != 0 && res->live[s] == 0;
  return n;
}

std::size_t PackedVirtualAllocator::unmapped_in(const Reservation* res, std::size_t first,
                                                std::size_t last) const noexcept {
  std::size_t n = 0;
  for (std::size_t s = first; s <= last; ++s) n += res->handles[s] == 0;
  return n;
}

// ---------------------------------------------------------------------------------------------
// deallocate

void PackedVirtualAllocator::deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) {
  const stream_t caller_stream = stream;
  if (!admit_free(ptr, stream)) return;
  if (observe_free(ptr, nbytes, caller_stream)) return;  // a SwapManager took it over
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t slot = live_.find_slot(ptr);  // one probe: found here, erased below
  if (slot == detail::FlatPtrMap::npos) throw_invalid_pointer(ptr, "deallocate");
  Block* b = reinterpret_cast<Block*>(live_.value_at(slot));
  check_free_size(nbytes, b->requested, ptr);
  const PendingWork work = order_.on_free(stream);  // may throw: nothing changed
  live_.erase_at(slot);  // the map has not changed since find_slot
  device_->note_freed(ptr);  // checked mode: touching it now faults
  counters_.count_deallocation(b->requested, b->size);
  Reservation* res = b->reservation;
  for (std::size_t s = slot_first(b), e = slot_last(b); s <= e; ++s) {
    if (--res->live[s] == 0) {  // the slot stays mapped: a fully free chunk
      --live_slots_;
      ++free_mapped_;
    }
  }
  --res->live_blocks;
  b->free = true;
  b->requested = 0;
  b->work = work;
  insert_hole(b);
}

void PackedVirtualAllocator::insert_hole(Block* b) noexcept {
  Reservation* res = b->reservation;
  detail::HoleIndex& index = holes(res->kind);
  Block* anchor = nullptr;  // a merged neighbour whose place in the index b takes
  Block* left = b->prev;
  if (left != nullptr && left->free && StreamOrder::can_merge(left->work, b->work)) {
    order_.merge_into(b->work, left->work);
    b->offset = left->offset;
    b->size += left->size;
    b->prev = left->prev;
    if (left->prev != nullptr) left->prev->next = b;
    else res->first = b;
    anchor = left;
  }
  Block* right = b->next;
  if (right != nullptr && right->free && StreamOrder::can_merge(b->work, right->work)) {
    order_.merge_into(b->work, right->work);
    b->size += right->size;
    b->next = right->next;
    if (right->next != nullptr) right->next->prev = b;
    if (anchor == nullptr) {
      anchor = right;
    } else {
      index.remove(right);
      blocks_.release(right);
    }
  }
  if (anchor != nullptr) {
    index.replace(anchor, b);
    blocks_.release(anchor);
  } else {
    index.insert(b);
  }
}

// ---------------------------------------------------------------------------------------------
// release_cached

std::size_t PackedVirtualAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<physical_handle> handles;
  std::vector<Reservation*> all;
  for (auto& e : reservations_) all.push_back(e.second.get());
  for (Reservation* r : all) {
    for (std::size_t s = 0; s < r->slots;) {
      if (r->handles[s] == 0 || r->live[s] != 0) {
        ++s;
        continue;
      }
      std::size_t e = s;
      while (e + 1 < r->slots && r->handles[e + 1] != 0 && r->live[e + 1] == 0) ++e;
      synchronize_holes(r, s, e);
      handles.clear();
      handles.reserve(e - s + 1);
      unmap_slots(r, s, e, handles);
      for (physical_handle h : handles) pool_.give_back(h);
      s = e + 1;
    }
  }
  for (Reservation* r : all) drop_reservation_if_empty(r);
  return pool_.release_cached();
}

// ---------------------------------------------------------------------------------------------
// accounting and introspection

std::vector<std::pair<device_ptr, std::size_t>> PackedVirtualAllocator::live_allocations() const {
  return list_live([](std::uintptr_t v) { return reinterpret_cast<const Block*>(v)->requested; });
}

std::size_t PackedVirtualAllocator::allocation_size(device_ptr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::uintptr_t v = ptr == 0 ? 0 : live_.find(ptr);
  if (v == 0) throw_invalid_pointer(ptr, "allocation_size");
  return reinterpret_cast<const Block*>(v)->requested;
}

PackedStats PackedVirtualAllocator::packed_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PackedStats s;
  fill_common_stats(s, small_threshold_, reservations_);
  s.chunks_live = live_slots_;
  s.free_chunks = free_mapped_ + s.chunks_in_pool;
  s.reservation_size = reservation_size_;
  s.steal_before_create = steal_before_create_;
  s.remap_slack = remap_slack_;
  s.chunks_free_mapped = free_mapped_;
  s.live_blocks = counters_.live_allocations();
  s.free_holes = small_holes_.count() + large_holes_.count();
  for (const auto& e : reservations_)
    for (const Block* b = e.second->first; b != nullptr; b = b->next)
      if (b->free) s.hole_bytes += b->size;
  s.fresh_placements = fresh_;
  return s;
}

ChunkStats PackedVirtualAllocator::chunk_stats() const {
  const PackedStats p = packed_stats();
  ChunkStats s;
  static_cast<CommonChunkStats&>(s) = p;
  s.chunks_cached = p.chunks_free_mapped;
  s.cached_ranges = p.free_holes;
  s.live_ranges = p.live_blocks;
  return s;
}

void PackedVirtualAllocator::throw_invalid_pointer(device_ptr ptr, const char* operation) const {
  ChunkAllocatorCore::throw_invalid_pointer(
      ptr, operation, reservations_, [](const Reservation& res, std::size_t offset) -> std::string {
        const Block* b = res.first;
        while (b != nullptr && b->end() <= offset) b = b->next;
        if (b != nullptr && !b->free)
          return interior_pointer(res.base + offset, res.address_of(b), b->requested);
        return freed_memory;
      });
}

}  // namespace vmalloc
