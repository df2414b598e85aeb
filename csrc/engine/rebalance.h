// DCR (dynamic channel rebalancing): which channels carry a collective's data.
//
// After a failover the backup NIC carries its own channels plus the failed ones,
// so those channels straggle and the whole collective waits for them. DCR gives
// no data to every channel whose path runs over a backup NIC on *any* rank and
// spreads it over the healthy ones. All ranks must switch at the same collective:
//
//  - The control plane (control_plane.h) decides: its coordinator sees every
//    rank's channels on backup and publishes a PlanProposal {id, startOp, avoid}
//    with startOp = the most advanced rank's ops_done + RECCL_DCR_OFFSET.
//  - Every collective's descriptor carries the newest proposal its rank has
//    heard of, and every rank sees every descriptor before data moves, so each
//    rank computes the same plan for the op from the same inputs (planToAdopt):
//    a rank that learned of a proposal late is carried along by its peers, and
//    if no rank knew it in time it starts at the first op where one does.
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

// The proposal op `seq` must switch to, given the plan in force (`currentId`)
// and the proposals every rank carried: the newest one that is newer than the
// current plan and due (startOp <= seq). Deterministic in its inputs.
std::optional<PlanProposal> planToAdopt(uint64_t currentId,
                                        const std::vector<PlanProposal>& carried, uint64_t seq);

// "channels 1, 3" / "no channel".
std::string describeChannels(uint64_t mask);

}  // namespace reccl
