// CachingAllocator: the best-fit caching baseline, faithful to PyTorch's CUDACachingAllocator
// (c10/cuda/CUDACachingAllocator.cpp). vmalloc compares the VirtualAllocator against it.
//
// Requests are rounded, served best-fit from cached blocks of the request's stream (each
// thread's CU_STREAM_PER_THREAD is a stream of its own, as in the virtual allocators), and
// otherwise from a new segment (one device allocation) that is split; freed blocks merge with
// free neighbours of their segment and stay cached until release_cached(). Because a segment
// can only be given back whole, a cache full of partly used segments is memory the device
// cannot use for anything else: the fragmentation the paper's virtual addressing removes.
// Policy presets reproduce nnabla's CachingAllocatorWithBuckets and CuPy's MemoryPool.
// docs/caching_allocator.rst describes every rule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "vmalloc/alloc/allocator.hpp"
#include "vmalloc/alloc/detail/caching_block.hpp"
#include "vmalloc/alloc/detail/pending_frees.hpp"

namespace vmalloc {

enum class CachingPolicy {
  pytorch,  // PyTorch's CUDACachingAllocator (the default)
  nnabla,   // nnabla's CachingAllocatorWithBuckets
  cupy,     // CuPy's MemoryPool
};

// "pytorch", "nnabla", "cupy".
const char* caching_policy_name(CachingPolicy policy) noexcept;
// The inverse of caching_policy_name; throws InvalidArgument naming the known policies.
CachingPolicy parse_caching_policy(const std::string& name);

struct CachingAllocatorOptions {
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();

  CachingPolicy policy = CachingPolicy::pytorch;
  // PyTorch's max_split_size_mb, in bytes: blocks of at least this size are never split, and
  // smaller requests never take them. PyTorch requires >= 20 MiB (kLargeBuffer).
  std::size_t max_split_size = unlimited;
  // PyTorch's max_non_split_rounding_mb, in bytes: a request of at least max_split_size takes
  // a cached oversize block only if the block is smaller than request + this. >= 20 MiB.
  std::size_t max_non_split_rounding_size = std::size_t{20} << 20;
  // Most bytes of segments held at once (PyTorch's per-process memory fraction times the
  // device's memory; CuPy's set_limit); 0 = only the device's capacity limits.
  std::size_t budget = 0;
  // PyTorch's expandable_segments:True (pytorch policy only): instead of one device
  // allocation per segment, one reserved address range per stream and pool, grown and shrunk
  // in pages of 2 MiB (small pool) / 20 MiB (large pool). docs/caching_allocator.rst.
  bool expandable_segments = false;
};

// Per-pool and per-block detail beyond Stats.
struct CachingSegmentStats {
  std::size_t small_segments = 0;
  std::size_t large_segments = 0;
  std::size_t small_segment_bytes = 0;
  std::size_t large_segment_bytes = 0;
  std::size_t live_blocks = 0;       // allocated
  std::size_t free_blocks = 0;       // in a pool, reusable
  std::size_t free_bytes = 0;
  std::size_t largest_free_block = 0;
  std::size_t waiting_blocks = 0;    // freed, waiting for events on other streams
  std::size_t waiting_bytes = 0;
  std::size_t unsplit_free_segments = 0;  // what release_cached() would give back
  std::size_t segments_created = 0;  // since construction (PyTorch's num_device_alloc)
  std::size_t segments_released = 0; // (num_device_free)
  std::size_t alloc_retries = 0;     // allocations that needed the cache freed (num_alloc_retries)
  std::size_t cache_flushes = 0;     // full flushes, by release_cached() or the OOM path
};

// One segment of a snapshot, blocks in address order (like torch.cuda.memory_snapshot()).
struct CachingBlockInfo {
  enum class State { allocated, waiting, free };
  device_ptr ptr;
  std::size_t size;
  std::size_t requested;  // 0 unless allocated
  stream_t stream;
  State state;
};
struct CachingSegmentInfo {
  device_ptr ptr;
  std::size_t size;
  bool small;
  stream_t stream;
  std::vector<CachingBlockInfo> blocks;
};

class CachingAllocator final : public Allocator {
 public:
  // PyTorch's constants (c10/cuda/CUDACachingAllocator.cpp).
  static constexpr std::size_t kMinBlockSize = 512;               // every size rounds to this
  static constexpr std::size_t kSmallSize = std::size_t{1} << 20;  // largest small request
  static constexpr std::size_t kSmallBuffer = std::size_t{2} << 20;    // small segment
  static constexpr std::size_t kMinLargeAlloc = std::size_t{10} << 20; // below: kLargeBuffer
  static constexpr std::size_t kLargeBuffer = std::size_t{20} << 20;   // mid-size segment
  static constexpr std::size_t kRoundLarge = std::size_t{2} << 20;     // large segment rounding
  // Address space of an expandable segment on a device of unlimited capacity (PyTorch
  // reserves 9/8 of the GPU's memory; HostDevice's capacity may be 0 = unlimited).
  static constexpr std::size_t kUnlimitedExpandableSpace = std::size_t{1} << 40;
  // nnabla's CachingAllocatorWithBuckets: requests of 1 MiB and more round to 128 KiB.
  static constexpr std::size_t kNnablaRoundLarge = std::size_t{128} << 10;

  // Throws InvalidArgument for a null device or an invalid option (the message names it).
  explicit CachingAllocator(std::shared_ptr<Device> device, CachingAllocatorOptions options = {});
  // Gives every segment back to the device, live allocations included.
  ~CachingAllocator() override;

  device_ptr allocate(std::size_t nbytes, stream_t stream) override;
  void deallocate(device_ptr ptr, std::size_t nbytes, stream_t stream) override;
  // PyTorch's empty_cache(): waits for pending cross-stream frees, then frees every segment
  // that is entirely free. Returns the bytes given back.
  std::size_t release_cached() override;
  Stats stats() const override;
  void reset_peak_stats() override;
  std::size_t allocation_size(device_ptr ptr) const override;
  std::vector<std::pair<device_ptr, std::size_t>> live_allocations() const override;
  std::string name() const override {
    return options_.expandable_segments ? "expandable-segments" : "caching";
  }
  const std::shared_ptr<Device>& device() const override { return device_; }

  // PyTorch's recordStream: the live allocation at ptr is also used by work on `stream`, so
  // when it is freed it returns to its pool only after that stream's work queued before the
  // free has completed. Throws InvalidPointer for a pointer that is not live, DeviceError for
  // an unknown stream (checked by recording an event on it: one event_record call).
  void record_stream(device_ptr ptr, stream_t stream);

  CachingSegmentStats segment_stats() const;
  std::vector<CachingSegmentInfo> snapshot() const;
  const CachingAllocatorOptions& options() const noexcept { return options_; }

  // The policy's rules, for tests and documentation (no state involved).
  // The block size a request of nbytes (> 0) is rounded to.
  std::size_t round_size(std::size_t nbytes) const noexcept;
  // Whether a rounded size is served from the small pool.
  bool is_small(std::size_t rounded) const noexcept;
  // The segment a miss of this rounded size creates, rounded up to the device granularity.
  std::size_t segment_size(std::size_t rounded) const noexcept;

 private:
  using Block = detail::CachingBlock;
  using Segment = detail::CachingSegment;

  detail::BlockPool& pool_of(const Segment& s) { return s.small ? small_pool_ : large_pool_; }
  detail::UnmappedPool& unmapped_of(const Segment& s) {
    return s.small ? small_unmapped_ : large_unmapped_;
  }
  stream_t pool_stream(stream_t stream) const noexcept;
  bool should_split(const Block& block, std::size_t rounded) const noexcept;

  void process_events();
  Block* take_free_block(detail::BlockPool& pool, stream_t stream, std::size_t rounded);
  Block* create_segment(std::size_t size, bool small, stream_t stream);
  // Expandable segments (PyTorch's try_allocate_expandable_block, find_expandable_block,
  // map_block, unmap_block, release_expandable_segment).
  Block* alloc_expandable(bool small, stream_t stream, std::size_t rounded, std::size_t seg_size);
  Block* find_expandable_block(bool small, stream_t stream, std::size_t size);
  bool map_block(Block* to_map, std::size_t size);
  std::size_t unmap_block(Block* block);
  void apply_unmap(Block* block, std::size_t first, std::size_t last);
  std::size_t release_expandable(std::vector<Block*> blocks);
  std::size_t expandable_page_size(bool small) const noexcept;
  bool release_oversize_blocks(detail::BlockPool& pool, stream_t stream, std::size_t rounded);
  std::size_t release_all_free_segments();
  std::size_t release_segments(const std::vector<Segment*>& segments);
  void split(Block* block, std::size_t rounded);
  void return_to_pool(Block* block);
  std::string describe_unknown(device_ptr ptr) const;
  Stats current_stats() const noexcept;  // stats_ with the derived fields brought up to date
  void note_peaks() noexcept;

  std::shared_ptr<Device> device_;  // first: destroyed last
  CachingAllocatorOptions options_;
  mutable std::mutex mutex_;
  // Address order, so a pointer can be traced to its segment in error messages.
  std::map<device_ptr, std::unique_ptr<Segment>> segments_;
  // Memory of segments whose creation failed and whose rollback failed too: still held on
  // the device (counted in reserved_bytes while created), freed by release_cached() or the
  // destructor.
  std::vector<std::unique_ptr<detail::SegmentMemory>> leftovers_;
  // Retries freeing leftovers_ (those that still fail stay, counted).
  void free_leftovers() noexcept;
  detail::BlockPool small_pool_;
  detail::BlockPool large_pool_;
  detail::UnmappedPool small_unmapped_;  // expandable segments only
  detail::UnmappedPool large_unmapped_;
  std::unordered_map<device_ptr, Block*> live_;
  detail::PendingFrees pending_;
  Stats stats_;
  std::size_t segments_created_ = 0;
  std::size_t segments_released_ = 0;
  std::size_t alloc_retries_ = 0;
  std::size_t cache_flushes_ = 0;
};

}  // namespace vmalloc
