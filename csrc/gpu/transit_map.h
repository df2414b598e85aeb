// Where NVL stages data: for a buffer on GPU g carried by NIC n, the GPU next to
// n when n is far from g (docs/design.md §3: crossing the root complex, cost >= 100), so
// the data crosses NVLink to that GPU and only its short PCIe hop to the NIC.
// Pure logic over locations and a peer-access predicate: no CUDA calls here.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/topology.h"

namespace reccl {

class TransitMap {
 public:
  using PeerAccess = std::function<bool(int gpu, int peer)>;
  static constexpr int kFarCost = 100;

  // RECCL_NIC_GPUS: `nicGpus[n]` is the GPU next to NIC n (emulated fabrics
  // without PCI paths). Throws ConfigError unless there is one entry per NIC, each
  // in 0..gpuCount-1.
  static TransitMap fromNicGpus(const std::vector<int>& nicGpus, size_t nicCount, int gpuCount,
                                const PeerAccess& canAccessPeer);
  // From PCI locations: a NIC's GPU is the nearest GPU; NIC n is far from GPU g
  // when their distance is >= kFarCost while n's own GPU is nearer than that.
  // NICs or GPUs without a PCI path never get a transit.
  static TransitMap fromPci(const std::vector<PciLocation>& gpus,
                            const std::vector<PciLocation>& nics, const PeerAccess& canAccessPeer);

  // The GPU to stage through, or -1: the buffer's own GPU talks to the NIC.
  int transitGpu(int bufferGpu, int nic) const;
  // The GPU next to each NIC (-1: unknown), for logs and tools.
  const std::vector<int>& nicGpus() const { return nicGpus_; }
  int gpuCount() const { return static_cast<int>(transit_.size()); }

 private:
  std::vector<int> nicGpus_;
  std::vector<std::vector<int>> transit_;  // [buffer GPU][NIC] -> transit GPU or -1
};

}  // namespace reccl
