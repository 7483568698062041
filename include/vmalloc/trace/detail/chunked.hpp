// An append-only array in fixed chunks, for the snapshot reader's tables (millions of rows):
// growing never copies nor touches the rows already there, where a std::vector's doubling
// would touch fresh pages for all of them again (page faults, not the parsing, were the larger
// part of reading a 1 M-entry snapshot).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace vmalloc::trace_parse::detail {

template <class T>
class Chunked {
 public:
  static constexpr unsigned shift = 15;  // 32 Ki rows a chunk
  static constexpr std::size_t chunk_rows = std::size_t{1} << shift;

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T& operator[](std::size_t i) { return chunks_[i >> shift][i & (chunk_rows - 1)]; }
  const T& operator[](std::size_t i) const { return chunks_[i >> shift][i & (chunk_rows - 1)]; }
  T& back() { return (*this)[size_ - 1]; }

  void push_back(const T& v) {
    if ((size_ >> shift) == chunks_.size()) chunks_.emplace_back(new T[chunk_rows]);
    (*this)[size_++] = v;
  }
  // Drops the rows from n on (their chunks are kept for the rows pushed next).
  void truncate(std::size_t n) {
    if (n < size_) size_ = n;
  }
  // Grows to n rows, the new ones T() (never shrinks).
  void grow_to(std::size_t n) {
    while (size_ < n) push_back(T());
  }
  // Bytes held.
  std::uint64_t memory() const {
    return chunks_.size() * chunk_rows * sizeof(T) + chunks_.capacity() * sizeof(void*);
  }
  void clear() {
    std::vector<std::unique_ptr<T[]>>().swap(chunks_);
    size_ = 0;
  }

 private:
  std::vector<std::unique_ptr<T[]>> chunks_;
  std::size_t size_ = 0;
};

}  // namespace vmalloc::trace_parse::detail
