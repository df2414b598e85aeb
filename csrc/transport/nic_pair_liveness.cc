#include "transport/nic_pair_liveness.h"

#include "core/clock.h"

namespace reccl {

void NicPairLiveness::heard(int64_t nowNs) {
  int64_t seen = lastHeardNs_.load(std::memory_order_relaxed);
  while (seen < nowNs &&
         !lastHeardNs_.compare_exchange_weak(seen, nowNs, std::memory_order_relaxed)) {
  }
}

bool NicPairLiveness::claimBeat(int64_t nowNs, int64_t quietNs) {
  int64_t last = lastSentNs_.load(std::memory_order_relaxed);
  while (nowNs - last >= quietNs) {
    if (lastSentNs_.compare_exchange_weak(last, nowNs, std::memory_order_relaxed)) return true;
  }
  return false;
}

std::shared_ptr<NicPairLiveness> NicPairTable::join(int localHealthId, uint64_t peerTransport,
                                                    int remoteNic) {
  const int64_t now = nowNs();
  if (peerTransport == 0) return std::make_shared<NicPairLiveness>(now);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = pairs_.begin(); it != pairs_.end();) {
    it = it->second.expired() ? pairs_.erase(it) : std::next(it);
  }
  auto& slot = pairs_[{localHealthId, peerTransport, remoteNic}];
  std::shared_ptr<NicPairLiveness> pair = slot.lock();
  if (pair) {
    pair->heard(now);  // a path that just connected proves the pair alive
  } else {
    pair = std::make_shared<NicPairLiveness>(now);
    slot = pair;
  }
  return pair;
}

}  // namespace reccl
