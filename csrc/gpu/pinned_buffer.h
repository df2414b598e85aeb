// Page-locked host memory, freed on destruction. NVL keeps one per registered
// GPU region, allocated when NCCL registers the region (before any kernel of
// that connection runs): allocations while NCCL's kernels wait on the network
// could serialise behind them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gpu/cuda_api.h"

namespace reccl {

class PinnedBuffer {
 public:
  // `bytes` of it for copies by `device`.
  PinnedBuffer(std::shared_ptr<CudaApi> cuda, int device, size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::shared_ptr<CudaApi> cuda_;
  int device_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace reccl
