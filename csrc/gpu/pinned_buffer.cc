#include "gpu/pinned_buffer.h"

#include "core/log.h"

namespace reccl {

PinnedBuffer::PinnedBuffer(std::shared_ptr<CudaApi> cuda, int device, size_t bytes)
    : cuda_(std::move(cuda)), device_(device), size_(bytes) {
  if (bytes > 0) data_ = static_cast<uint8_t*>(cuda_->pinnedAlloc(device, bytes));
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ == nullptr) return;
  try {
    cuda_->pinnedFree(device_, data_);
  } catch (const std::exception& error) {
    RECCL_LOG(kWarn, std::string("freeing a staging buffer: ") + error.what());
  }
}

}  // namespace reccl
