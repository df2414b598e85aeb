// Shares of a large all_reduce sized by each host's usable bandwidth.
//
// Every collective waits for its slowest rank, so with equal shares one host
// with 3 of 4 NICs holds the whole job to 3/4. all_reduce's division of work
// is ours to choose: in a reduce-scatter + all-gather with direct transfers
// where rank i reduces a share s_i of S elements, rank i sends (and receives)
// S + (N-2) s_i, so a rank that reduces less carries less and the others
// absorb the rest. The capacities come from the per-op agreement (agreement.h:
// every rank with NICs of its own unusable is listed with its NICs down), so
// every rank derives the same shares at the same op; a plan switches as DCR's
// does (rebalance.h), at once when a capacity falls and only after it has held
// still for kShareRiseHoldOps ops when capacities rise, so a flapping NIC
// cannot make the shares flap. No reduced rank: no shares at all (the equal
// division and the ring, exactly as without this file).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/agreement.h"
#include "engine/channel_plan.h"

namespace reccl {

// A rank's usable bandwidth as a fraction of its fault-free bandwidth, in units
// of 1/kFullCapacity: its usable NICs over its NICs (a NIC down or degraded by
// a grey failure carries nothing: connections spread off it).
constexpr uint32_t kFullCapacity = 4096;

struct RankCapacity {
  int rank = 0;
  uint32_t capacity = kFullCapacity;
  bool operator==(const RankCapacity& other) const {
    return rank == other.rank && capacity == other.capacity;
  }
};

// The ranks whose capacity is below full, by rank, as the agreement says (the
// same on every rank); nullopt when not every one of them is listed by name
// (more than kListedDegradedRanks) or one did not say how many NICs it has.
std::optional<std::vector<RankCapacity>> agreedCapacities(const Agreement& agreement);

// Each rank's share weight for `size` ranks with the `reduced` capacities
// (the others full): the shares that minimise the slowest rank's time
// (S + (N-2) s_i) / capacity_i of a direct reduce-scatter + all-gather, in
// exact integer arithmetic so every rank computes the same weights. Empty for
// equal shares: no rank reduced, every weight equal, or N <= 2 (where each
// rank sends S whatever the shares).
std::vector<uint64_t> shareWeights(int size, const std::vector<RankCapacity>& reduced);

// The shares in force, as DCR's plans are (rebalance.h).
struct SharePlan {
  uint64_t id = 0;       // 0: the initial, equal shares; ids only grow
  uint64_t startOp = 0;  // the first collective it may run
  std::vector<RankCapacity> reduced;
};

struct ShareState {
  SharePlan current;
  std::optional<SharePlan> pending;
  // The last capacities agreed, and the op from which they have held.
  std::vector<RankCapacity> seen;
  uint64_t seenSince = 0;
};

// Ops the agreed capacities must hold still before shares grow back.
constexpr uint64_t kShareRiseHoldOps = 16;

// The share rule at op `seq`, given the capacities agreed at it (`agreed`,
// nullopt when not known by name: equal shares). A fall (some rank's capacity
// below the plan's, or unknown capacities) starts a new plan `offset` ops
// later; capacities that only rise start one once they have held for
// `riseHold` ops (+ `offset`). Returns the plan to switch to at this op, if
// any. Deterministic in its inputs.
std::optional<SharePlan> advanceShares(ShareState& state,
                                       const std::optional<std::vector<RankCapacity>>& agreed,
                                       uint64_t seq, uint64_t offset,
                                       uint64_t riseHold = kShareRiseHoldOps);

// "rank 0 0.100, others 0.300" style summary of shares (for events and logs).
std::string describeShares(const std::vector<uint64_t>& weights);

}  // namespace reccl
