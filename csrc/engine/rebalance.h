// DCR (dynamic channel rebalancing): which channels carry a collective's data.
//
// After a failover the backup NIC carries its own channels plus the failed ones,
// so those channels straggle and the whole collective waits for them. DCR gives
// no data to every channel whose path runs over a backup NIC on *any* rank and
// spreads it over the healthy ones. All ranks must switch at the same collective:
// every collective starts with an agreement (agreement.h) that ORs every rank's
// channels on backup, identical on every rank, and every rank applies the same
// rule to it (advancePlan), so all switch at the same op with no coordinator.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/channel_plan.h"

namespace reccl {

struct PlanProposal {
  uint64_t id = 0;         // 0: the initial plan (every channel); ids only grow
  uint64_t startOp = 0;    // the first collective (op sequence number) it may run
  uint64_t avoidMask = 0;  // bit c: channel c carries no data
};

// Channels' bits, for `channels` <= 64.
uint64_t allChannelsMask(int channels);

// The plan of a proposal: weight 0 for avoided channels, 1 for the others;
// equal shares when it would avoid every channel.
ChannelPlan planOf(const PlanProposal& proposal, int channels);

// The plans of one group: the one in force and one agreed but not started yet.
struct PlanState {
  PlanProposal current;
  std::optional<PlanProposal> pending;
};

// DCR's rule at op `seq`, given the channels the ranks agreed run over backup
// NICs: a different set makes a new plan (id + 1) that starts `offset` ops
// later; a set equal to the plan in force drops a pending one. Returns the
// plan to switch to at this op, if any. Deterministic in its inputs.
std::optional<PlanProposal> advancePlan(PlanState& state, uint64_t agreedAvoid, uint64_t seq,
                                        uint64_t offset);

// "channels 1, 3" / "no channel".
std::string describeChannels(uint64_t mask);

}  // namespace reccl
