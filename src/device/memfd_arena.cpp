#include "vmalloc/device/detail/memfd_arena.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>

#include "vmalloc/base/errors.hpp"

namespace vmalloc::detail {

MemfdArena::MemfdArena(const std::string& name) {
  fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd_ < 0)
    throw DeviceError("memfd_create for the emulated device's physical memory failed: " +
                          std::string(std::strerror(errno)),
                      "cuMemCreate", cu_result::out_of_memory);
}

MemfdArena::~MemfdArena() {
  if (fd_ >= 0) ::close(fd_);
}

void MemfdArena::take_free(std::multimap<std::size_t, std::uint64_t>::iterator it,
                           std::size_t size, std::uint64_t* offset) {
  const std::size_t have = it->first;
  *offset = it->second;
  free_by_size_.erase(it);
  free_by_offset_.erase(*offset);
  if (have > size) {  // the tail stays free
    free_by_offset_.emplace(*offset + size, have - size);
    free_by_size_.emplace(have - size, *offset + size);
  }
}

std::uint64_t MemfdArena::allocate(std::size_t size) {
  std::uint64_t offset = 0;
  auto it = free_by_size_.lower_bound(size);
  if (it != free_by_size_.end()) {
    take_free(it, size, &offset);
  } else {
    offset = end_;
    const std::uint64_t new_end = end_ + size;
    if (new_end > file_size_) {
      if (::ftruncate(fd_, static_cast<off_t>(new_end)) != 0)
        throw DeviceError("growing the emulated device's memfd to " + std::to_string(new_end) +
                              " bytes failed: " + std::strerror(errno),
                          "cuMemCreate", cu_result::out_of_memory);
      file_size_ = new_end;
    }
    end_ = new_end;
  }
  in_use_ += size;
  return offset;
}

void MemfdArena::deallocate(std::uint64_t offset, std::size_t size) noexcept {
  // Punching the hole is what returns the memory; failure (a kernel without hole punching
  // on shmem) only means the pages stay until the file is closed.
  ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
              static_cast<off_t>(size));
  in_use_ -= size;
  auto erase_by_size = [this](std::uint64_t off, std::size_t sz) {
    auto range = free_by_size_.equal_range(sz);
    for (auto i = range.first; i != range.second; ++i)
      if (i->second == off) {
        free_by_size_.erase(i);
        return;
      }
  };
  // Coalesce with free neighbours, so large regions can reuse offsets freed as small ones.
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && next->first == offset + size) {
    size += next->second;
    erase_by_size(next->first, next->second);
    next = free_by_offset_.erase(next);
  }
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      erase_by_size(prev->first, prev->second);
      free_by_offset_.erase(prev);
    }
  }
  if (offset + size == end_) {  // the free tail simply shortens the used part of the file
    end_ = offset;
    return;
  }
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

}  // namespace vmalloc::detail
