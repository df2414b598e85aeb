#include "engine/layout.h"

#include <map>

namespace reccl {

Layout::Layout(const std::vector<uint64_t>& hostIds) {
  const int size = static_cast<int>(hostIds.size());
  std::map<uint64_t, int> hostIndex;  // identity -> host number, in order of lowest rank
  std::vector<std::vector<int>> members;
  hostOf_.resize(size);
  for (int r = 0; r < size; ++r) {
    auto [it, fresh] = hostIndex.emplace(hostIds[r], static_cast<int>(members.size()));
    if (fresh) members.emplace_back();
    members[it->second].push_back(r);
    hostOf_[r] = it->second;
  }
  position_.resize(size);
  hostStarts_.push_back(0);
  for (const std::vector<int>& host : members) {
    for (int r : host) {
      position_[r] = static_cast<int>(order_.size());
      inRankOrder_ = inRankOrder_ && position_[r] == r;
      order_.push_back(r);
    }
    hostStarts_.push_back(static_cast<int>(order_.size()));
    twoLevel_ = twoLevel_ || host.size() > 1;
  }
  twoLevel_ = twoLevel_ && members.size() > 1;
}

}  // namespace reccl
