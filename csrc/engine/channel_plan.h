// How a collective's data is divided over channels. Every channel of a peer pair
// is its own connection pinned to one NIC (channel c uses NIC c % nics), so the
// plan is also the division over NICs. The initial plan gives every channel an
// equal share; DCR (rebalance.h) installs plans that give no data to channels
// whose path runs over a backup NIC, switching all ranks at the same op (the
// plan id travels in every descriptor and must match).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace reccl {

struct Range {
  size_t offset = 0;
  size_t count = 0;
};

class ChannelPlan {
 public:
  explicit ChannelPlan(int channels);                       // equal shares, id 0
  ChannelPlan(std::vector<uint64_t> weights, uint64_t id);  // a weight of 0 = no data

  int channels() const { return static_cast<int>(weights_.size()); }
  uint64_t id() const { return id_; }
  uint64_t weight(int channel) const { return weights_.at(channel); }
  // Every channel the same share (the fault-free plan's division).
  bool equal() const { return equal_; }

  // [0, count) cut into one contiguous range per channel, in proportion to the
  // weights; the same on every rank for the same count.
  std::vector<Range> split(size_t count) const;

 private:
  std::vector<uint64_t> weights_;
  bool equal_ = true;
  uint64_t id_ = 0;
};

// [0, count) cut into one contiguous range per weight, in proportion to the
// weights (a total above 0), the same on every rank for the same inputs.
std::vector<Range> splitByWeights(size_t count, const std::vector<uint64_t>& weights);

// The longest of `ranges` (a plan's split: it sizes the chunks).
size_t largestRange(const std::vector<Range>& ranges);

// [0, count) cut into `parts` near-equal contiguous ranges (the first ones one
// element longer); the ring segments of a channel.
std::vector<Range> splitEvenly(size_t count, int parts);

}  // namespace reccl
