#include "vmalloc/alloc/detail/chunk_batch.hpp"

#include <algorithm>
#include <iterator>

#include "vmalloc/base/errors.hpp"

namespace vmalloc::detail {

ChunkBatch::ChunkBatch(PhysicalChunkPool& pool, std::size_t want) : pool_(pool), want_(want) {
  chunks_.reserve(want);
}

ChunkBatch::~ChunkBatch() {
  if (committed_) return;
  for (std::size_t i = 0; i < chunks_.size(); ++i) {
    if (chunks_[i] == 0) continue;
    try {
      if (created(i))
        pool_.release(chunks_[i]);
      else
        pool_.give_back(chunks_[i]);
    } catch (...) {
    }
  }
}

void ChunkBatch::take_cached() {
  pool_.take_cached(chunks_, want_);  // one lock for the batch; capacity reserved
}

void ChunkBatch::create() {
  created_first_ = chunks_.size();
  for (std::size_t n = std::min(missing(), pool_.creatable_chunks()); n > 0; --n) {
    physical_handle h;
    try {
      h = pool_.create();
    } catch (const OutOfMemory&) {
      break;  // the device is fuller than it said (shared with others): steal instead
    }
    chunks_.push_back(h);  // within the reserved capacity: cannot throw
    ++created_count_;
  }
}

void ChunkBatch::put_created_last() noexcept {
  const auto first = chunks_.begin() + static_cast<std::ptrdiff_t>(created_first_);
  const auto last = first + static_cast<std::ptrdiff_t>(created_count_);
  std::rotate(first, last, chunks_.end());
  created_first_ = chunks_.size() - created_count_;
}

}  // namespace vmalloc::detail
