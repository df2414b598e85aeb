// Liveness per peer NIC pair: every path between one local NIC and one NIC of
// one peer transport shares it. A frame on any of them proves the pair alive,
// and one heartbeat per interval on any of them speaks for all, so the beats
// of an idle process grow with the peers and NICs it talks to, not with its
// paths (a blackhole silences the whole NIC pair anyway).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "core/path.h"

namespace reccl {

class NicPairLiveness final : public PairHeard {
 public:
  explicit NicPairLiveness(int64_t nowNs) : lastHeardNs_(nowNs) {}
  // Something arrived from the peer over the pair.
  void heard(int64_t nowNs);
  int64_t lastHeardNs() const override { return lastHeardNs_.load(std::memory_order_relaxed); }
  void refusedAt(int64_t nowNs) override { lastRefusedNs_.store(nowNs, std::memory_order_relaxed); }
  int64_t lastRefusedNs() const override { return lastRefusedNs_.load(std::memory_order_relaxed); }
  // Something went to the peer over the pair (it proves us alive there).
  void sent(int64_t nowNs) { lastSentNs_.store(nowNs, std::memory_order_relaxed); }
  // True for the one path that should beat now: nothing went over the pair
  // for `quietNs`. That path's beat is then counted as sent.
  bool claimBeat(int64_t nowNs, int64_t quietNs);

 private:
  std::atomic<int64_t> lastHeardNs_;
  std::atomic<int64_t> lastSentNs_{0};
  std::atomic<int64_t> lastRefusedNs_{0};
};

// One transport's pairs. The paths hold them; a pair no path holds is gone.
class NicPairTable {
 public:
  // `peerTransport` 0 (not known) gets a pair of its own.
  std::shared_ptr<NicPairLiveness> join(int localHealthId, uint64_t peerTransport, int remoteNic);

 private:
  std::mutex mutex_;
  std::map<std::tuple<int, uint64_t, int>, std::weak_ptr<NicPairLiveness>> pairs_;
};

}  // namespace reccl
