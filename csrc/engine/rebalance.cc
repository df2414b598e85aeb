#include "engine/rebalance.h"

namespace reccl {

uint64_t allChannelsMask(int channels) {
  return channels >= 64 ? ~uint64_t{0} : (uint64_t{1} << channels) - 1;
}

ChannelPlan planOf(const PlanProposal& proposal, int channels) {
  const uint64_t avoid = proposal.avoidMask & allChannelsMask(channels);
  std::vector<uint64_t> weights(channels, 1);
  if (avoid != allChannelsMask(channels)) {
    for (int c = 0; c < channels; ++c) {
      if (avoid & (uint64_t{1} << c)) weights[c] = 0;
    }
  }
  return ChannelPlan(std::move(weights), proposal.id);
}

std::optional<PlanProposal> advancePlan(PlanState& state, uint64_t agreedAvoid, uint64_t seq,
                                        uint64_t offset) {
  if (agreedAvoid == state.current.avoidMask) {
    state.pending.reset();
  } else if (!state.pending || state.pending->avoidMask != agreedAvoid) {
    state.pending = PlanProposal{state.current.id + 1, seq + offset, agreedAvoid};
  }
  if (!state.pending || state.pending->startOp > seq) return std::nullopt;
  state.current = *state.pending;
  state.pending.reset();
  return state.current;
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
