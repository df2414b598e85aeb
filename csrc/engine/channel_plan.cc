#include "engine/channel_plan.h"

#include <algorithm>

#include "core/error.h"

namespace reccl {

ChannelPlan::ChannelPlan(int channels)
    : ChannelPlan(std::vector<uint64_t>(channels > 0 ? channels : 0, 1), 0) {}

ChannelPlan::ChannelPlan(std::vector<uint64_t> weights, uint64_t id)
    : weights_(std::move(weights)), id_(id) {
  if (weights_.empty()) throw ConfigError("a channel plan needs at least one channel");
  uint64_t total = 0;
  for (uint64_t w : weights_) {
    total += w;
    equal_ = equal_ && w == weights_[0];
  }
  if (total == 0) throw ConfigError("a channel plan needs at least one channel with data");
}

std::vector<Range> ChannelPlan::split(size_t count) const {
  return splitByWeights(count, weights_);
}

std::vector<Range> splitByWeights(size_t count, const std::vector<uint64_t>& weights) {
  uint64_t total = 0;
  for (uint64_t w : weights) total += w;
  std::vector<Range> out(weights.size());
  uint64_t cumulative = 0;
  size_t start = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    cumulative += weights[i];
    // 128-bit product: count * cumulative may exceed 64 bits for huge tensors.
    size_t end = static_cast<size_t>(static_cast<unsigned __int128>(count) * cumulative / total);
    out[i] = Range{start, end - start};
    start = end;
  }
  return out;
}

size_t largestRange(const std::vector<Range>& ranges) {
  size_t largest = 0;
  for (const auto& r : ranges) largest = std::max(largest, r.count);
  return largest;
}

std::vector<Range> splitEvenly(size_t count, int parts) {
  std::vector<Range> out(parts);
  size_t base = count / parts, extra = count % parts, offset = 0;
  for (int i = 0; i < parts; ++i) {
    size_t n = base + (static_cast<size_t>(i) < extra ? 1 : 0);
    out[i] = Range{offset, n};
    offset += n;
  }
  return out;
}

}  // namespace reccl
