// The GPU flush of NCCL's IB transport, for receives the NIC placed directly
// in device memory: an RDMA READ of one byte from that memory, through a QP
// connected to itself on the NIC that wrote it, completes only after the
// NIC's earlier PCIe writes there are visible, so the GPU kernel that reads
// the buffer next sees them. One flusher per device, made on first use; one
// flush at a time. Host memory needs none (the completion already follows
// the data through coherent memory).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/clock.h"
#include "transport/ib/gid_select.h"
#include "transport/ib/verbs_api.h"

namespace reccl {

class IbFlusher {
 public:
  // Throws Error when the loopback QP cannot be set up (port down, no GID).
  IbFlusher(std::shared_ptr<VerbsDevice> device, const GidPolicy& policy, int timeout,
            int retryCount);
  IbFlusher(const IbFlusher&) = delete;
  IbFlusher& operator=(const IbFlusher&) = delete;

  // Reads the byte at `address` (registered with `rkey` on this device) and
  // waits for it, at most `timeout`. Throws Error saying what failed; the QP
  // is then in ERR and this flusher must be replaced.
  void flush(uint64_t address, uint32_t rkey, Millis timeout);

 private:
  static constexpr int kPort = 1;
  std::mutex mutex_;
  const std::shared_ptr<VerbsDevice> device_;
  std::vector<uint8_t> landing_;
  std::unique_ptr<VerbsMemoryRegion> landingMr_;
  std::unique_ptr<VerbsCompletionQueue> cq_;
  std::unique_ptr<VerbsQueuePair> qp_;
  uint64_t nextId_ = 1;
};

}  // namespace reccl
