// The physical memory of one emulated device: regions of a single memfd.
//
// One file per device (not one per allocation) keeps file descriptors bounded however many
// chunks exist. A region is a page-aligned range of file offsets; the file grows with
// ftruncate, and a freed region's pages go back to the OS at once (FALLOC_FL_PUNCH_HOLE), so
// the sparse file only ever holds the bytes of live regions that were touched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace vmalloc::detail {

// Not thread-safe: HostDevice calls it under its bookkeeping lock.
class MemfdArena {
 public:
  // Throws DeviceError (call "cuMemCreate") when memfd_create fails.
  explicit MemfdArena(const std::string& name);
  ~MemfdArena();
  MemfdArena(const MemfdArena&) = delete;
  MemfdArena& operator=(const MemfdArena&) = delete;

  int fd() const noexcept { return fd_; }

  // The file offset of a new region of `size` bytes (a multiple of the page size): the
  // best-fitting free region, else the end of the file, which grows. Throws DeviceError
  // (code out_of_memory) if the file cannot grow; nothing changes then.
  std::uint64_t allocate(std::size_t size);
  // Gives the region's pages back to the OS and its offsets to the free list (coalesced).
  void deallocate(std::uint64_t offset, std::size_t size) noexcept;

  // Bytes of file offsets in use by regions (for tests: 0 once everything is freed).
  std::uint64_t bytes_in_regions() const noexcept { return in_use_; }
  std::uint64_t file_size() const noexcept { return file_size_; }

 private:
  void take_free(std::multimap<std::size_t, std::uint64_t>::iterator it, std::size_t size,
                 std::uint64_t* offset);

  int fd_ = -1;
  std::uint64_t end_ = 0;        // offsets at and past end_ were never handed out or are free
  std::uint64_t file_size_ = 0;  // current ftruncate length (never shrinks; holes are punched)
  std::uint64_t in_use_ = 0;
  std::map<std::uint64_t, std::size_t> free_by_offset_;         // offset -> size
  std::multimap<std::size_t, std::uint64_t> free_by_size_;      // size -> offset (best fit)
};

}  // namespace vmalloc::detail
