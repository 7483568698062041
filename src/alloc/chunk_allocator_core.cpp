#include "vmalloc/alloc/detail/chunk_allocator_core.hpp"

#include "vmalloc/base/detail/format.hpp"
#include "vmalloc/base/detail/saturating_add.hpp"
#include "vmalloc/base/errors.hpp"
#include "vmalloc/chunks/detail/chunk_size.hpp"

namespace vmalloc::detail {

namespace {

const std::shared_ptr<Device>& require_device(const std::shared_ptr<Device>& device,
                                              const char* owner) {
  if (!device) throw InvalidArgument(std::string(owner) + ": device is null");
  return device;
}

int power_of_two_shift(std::size_t n) {
  return n != 0 && (n & (n - 1)) == 0 ? __builtin_ctzll(n) : -1;
}

}  // namespace

const char* const ChunkAllocatorCore::freed_memory =
    "not a live allocation (free memory of this allocator: already freed?)";

ChunkAllocatorCore::ChunkAllocatorCore(const char* owner, std::shared_ptr<Device> device,
                                       const ChunkOptions& options, std::size_t placement_unit,
                                       bool chunk_counts_are_bounds)
    : owner_(owner),
      device_(require_device(device, owner)),
      chunk_size_(resolve_chunk_size(*device_, options.chunk_size, owner, placement_unit)),
      chunk_shift_(power_of_two_shift(chunk_size_)),
      pool_(device_, chunk_size_, options.budget),
      order_(device_),
      chunk_counts_are_bounds_(chunk_counts_are_bounds),
      allocate_caller_(owner_ + ".allocate"),
      deallocate_caller_(owner_ + ".deallocate") {}

bool ChunkAllocatorCore::chunks_available(std::size_t need, std::size_t stealable) const {
  return saturating_add(saturating_add(pool_.chunks_cached(), stealable),
                        pool_.creatable_chunks()) >= need;
}

void ChunkAllocatorCore::require_chunks(std::size_t need, std::size_t stealable,
                                        std::size_t nbytes, device_ptr backing) const {
  const std::size_t in_pool = pool_.chunks_cached();
  const std::size_t creatable = pool_.creatable_chunks();
  if (saturating_add(saturating_add(in_pool, stealable), creatable) >= need) return;
  throw_out_of_memory(nbytes, std::to_string(in_pool + stealable) + " free chunks and " +
                                  std::to_string(creatable) + " creatable" +
                                  (backing != 0 ? " to back " + hex(backing) : std::string()));
}

void ChunkAllocatorCore::throw_out_of_memory(std::size_t nbytes, const std::string& why) const {
  const std::size_t k = (nbytes + chunk_size_ - 1) / chunk_size_;
  const std::string summary = stats_locked().summary();
  throw OutOfMemory(owner_ + ": out of memory allocating " + std::to_string(nbytes) + " bytes (" +
                        (chunk_counts_are_bounds_ ? "at most " : "") + std::to_string(k) +
                        " chunk" + (k == 1 ? "" : "s") + " of " + std::to_string(chunk_size_) +
                        " bytes) on " + device_->name() + ": " + why + "; " + summary,
                    nbytes, summary);
}

void ChunkAllocatorCore::throw_invalid_pointer(device_ptr ptr, const char* operation,
                                               const std::string& why) const {
  throw InvalidPointer(owner_ + "." + operation + ": pointer " + hex(ptr) + " is " + why);
}

std::string ChunkAllocatorCore::interior_pointer(device_ptr ptr, device_ptr allocation,
                                                 std::size_t requested) {
  return "an interior pointer: offset " + std::to_string(ptr - allocation) +
         " into the live allocation at " + hex(allocation) + " of " + std::to_string(requested) +
         " bytes";
}

void ChunkAllocatorCore::throw_request_too_large(std::size_t nbytes) const {
  throw InvalidArgument(allocate_caller_ + ": request of " + std::to_string(nbytes) +
                        " bytes exceeds the limit of 2**56 bytes");
}

void ChunkAllocatorCore::throw_size_mismatch(std::size_t nbytes, std::size_t requested,
                                             device_ptr ptr) const {
  throw InvalidArgument(deallocate_caller_ + ": nbytes " + std::to_string(nbytes) +
                        " differs from the " + std::to_string(requested) +
                        " bytes allocated at " + hex(ptr));
}

Stats ChunkAllocatorCore::current_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_locked();
}

void ChunkAllocatorCore::reset_peaks() {
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.reset_peaks(reserved_bytes());
}

void ChunkAllocatorCore::fill_pool_stats(CommonChunkStats& s, std::size_t small_threshold) const {
  const ChunkPoolStats p = pool_.stats();
  s.chunk_size = chunk_size_;
  s.small_threshold = small_threshold;
  s.budget_bytes = p.budget_bytes;
  s.chunks_held = p.chunks_held;
  s.peak_chunks_held = p.peak_chunks_held;
  s.chunks_in_pool = p.chunks_cached;
  s.chunks_created = p.chunks_created;
  s.chunks_released = p.chunks_released;
  s.chunks_stolen = stolen_;
  s.events_created = order_.events_created();
  s.multi_stream = order_.multi_stream();
}

}  // namespace vmalloc::detail
