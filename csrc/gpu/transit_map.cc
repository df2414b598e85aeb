#include "gpu/transit_map.h"

#include <climits>

#include "core/error.h"

namespace reccl {

TransitMap TransitMap::fromNicGpus(const std::vector<int>& nicGpus, size_t nicCount, int gpuCount,
                                   const PeerAccess& canAccessPeer) {
  if (nicGpus.size() != nicCount) {
    throw ConfigError("RECCL_NIC_GPUS has " + std::to_string(nicGpus.size()) +
                      " entries; expected one GPU index per NIC, " + std::to_string(nicCount) +
                      " in rail order");
  }
  for (size_t n = 0; n < nicGpus.size(); ++n) {
    if (nicGpus[n] < 0 || nicGpus[n] >= gpuCount) {
      throw ConfigError("RECCL_NIC_GPUS names GPU " + std::to_string(nicGpus[n]) + " for NIC " +
                        std::to_string(n) + "; valid GPUs here: 0.." +
                        std::to_string(gpuCount - 1));
    }
  }
  TransitMap map;
  map.nicGpus_ = nicGpus;
  map.transit_.assign(gpuCount, std::vector<int>(nicGpus.size(), -1));
  for (int g = 0; g < gpuCount; ++g) {
    for (size_t n = 0; n < nicGpus.size(); ++n) {
      int t = nicGpus[n];
      if (t != g && canAccessPeer(g, t) && canAccessPeer(t, g)) map.transit_[g][n] = t;
    }
  }
  return map;
}

TransitMap TransitMap::fromPci(const std::vector<PciLocation>& gpus,
                               const std::vector<PciLocation>& nics,
                               const PeerAccess& canAccessPeer) {
  TransitMap map;
  map.nicGpus_.assign(nics.size(), -1);
  map.transit_.assign(gpus.size(), std::vector<int>(nics.size(), -1));
  for (size_t n = 0; n < nics.size(); ++n) {
    int best = INT_MAX;
    for (size_t g = 0; g < gpus.size(); ++g) {
      int cost = pciDistance(gpus[g], nics[n]);
      if (cost >= 0 && cost < best) {
        best = cost;
        map.nicGpus_[n] = static_cast<int>(g);
      }
    }
    const int t = map.nicGpus_[n];
    if (t < 0 || best >= kFarCost) continue;  // no GPU near this NIC: nothing to gain
    for (size_t g = 0; g < gpus.size(); ++g) {
      const int gpu = static_cast<int>(g);
      if (gpu != t && pciDistance(gpus[g], nics[n]) >= kFarCost && canAccessPeer(gpu, t) &&
          canAccessPeer(t, gpu)) {
        map.transit_[g][n] = t;
      }
    }
  }
  return map;
}

int TransitMap::transitGpu(int bufferGpu, int nic) const {
  if (bufferGpu < 0 || bufferGpu >= static_cast<int>(transit_.size())) return -1;
  if (nic < 0 || nic >= static_cast<int>(transit_[bufferGpu].size())) return -1;
  return transit_[bufferGpu][nic];
}

}  // namespace reccl
