// Where the ranks of a group sit: which ranks share a host, and the order the
// rings and the two-level recursive doubling walk them in (their positions).
// Hosts are numbered by their lowest rank; positions run host by host, each
// host's ranks in rank order, so a ring crosses between hosts once per host
// (in rank order, ranks placed round-robin over hosts cross at every hop).
// Every rank builds it from the same host identities (gathered at the group's
// first collective), so every rank holds the same layout.
#pragma once

#include <cstdint>
#include <vector>

namespace reccl {

class Layout {
 public:
  // `hostIds[r]`: rank r's host identity; equal identities share a host.
  explicit Layout(const std::vector<uint64_t>& hostIds);

  int size() const { return static_cast<int>(order_.size()); }
  // On when there are 2 or more hosts and some host holds 2 or more ranks:
  // then the small collectives run in two levels (recursive_doubling.h).
  bool twoLevel() const { return twoLevel_; }
  // Whether every rank's position is its rank (one host, or one rank per host).
  bool inRankOrder() const { return inRankOrder_; }
  int position(int rank) const { return position_.at(rank); }
  int rankAt(int position) const { return order_.at(position); }
  // Position -> rank: the ring order.
  const std::vector<int>& order() const { return order_; }
  int hostOf(int rank) const { return hostOf_.at(rank); }
  // Host h holds positions [hostStarts()[h], hostStarts()[h + 1]).
  const std::vector<int>& hostStarts() const { return hostStarts_; }

 private:
  std::vector<int> order_, position_, hostOf_, hostStarts_;
  bool twoLevel_ = false;
  bool inRankOrder_ = true;
};

}  // namespace reccl
