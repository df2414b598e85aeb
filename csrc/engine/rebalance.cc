#include "engine/rebalance.h"

namespace reccl {

uint64_t allChannelsMask(int channels) {
  return channels >= 64 ? ~uint64_t{0} : (uint64_t{1} << channels) - 1;
}

ChannelPlan planOf(const PlanProposal& proposal, int channels) {
  const uint64_t avoid = proposal.avoidMask & allChannelsMask(channels);
  std::vector<uint32_t> weights(channels, 1);
  if (avoid != allChannelsMask(channels)) {
    for (int c = 0; c < channels; ++c) {
      if (avoid & (uint64_t{1} << c)) weights[c] = 0;
    }
  }
  return ChannelPlan(std::move(weights), proposal.id);
}

std::optional<PlanProposal> planToAdopt(uint64_t currentId,
                                        const std::vector<PlanProposal>& carried, uint64_t seq) {
  std::optional<PlanProposal> best;
  for (const PlanProposal& p : carried) {
    if (p.id <= currentId || p.startOp > seq) continue;
    if (!best || p.id > best->id) best = p;
  }
  return best;
}

std::string describeChannels(uint64_t mask) {
  if (mask == 0) return "no channel";
  std::string out;
  int count = 0;
  for (int c = 0; c < 64; ++c) {
    if (!(mask & (uint64_t{1} << c))) continue;
    out += (out.empty() ? "" : ", ") + std::to_string(c);
    ++count;
  }
  return (count == 1 ? "channel " : "channels ") + out;
}

}  // namespace reccl
