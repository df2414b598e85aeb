#include "engine/shares.h"

#include <algorithm>
#include <bitset>
#include <cstdio>

namespace reccl {

namespace {

uint32_t capacityOf(const RankFaults& faults) {
  const uint64_t mine = faults.nics >= 64 ? ~uint64_t{0} : (uint64_t{1} << faults.nics) - 1;
  const uint64_t usable = std::bitset<64>(mine & ~faults.nicsDown).count();
  return static_cast<uint32_t>(usable * kFullCapacity / faults.nics);
}

uint32_t capacityIn(const std::vector<RankCapacity>& reduced, int rank) {
  for (const RankCapacity& c : reduced) {
    if (c.rank == rank) return c.capacity;
  }
  return kFullCapacity;
}

}  // namespace

std::optional<std::vector<RankCapacity>> agreedCapacities(const Agreement& agreement) {
  std::vector<RankCapacity> reduced;
  for (const DegradedRank& d : agreement.listed) {
    if (!d.faults.reduced()) break;  // listed first: the rest are only on backup paths
    if (d.faults.nics == 0) return std::nullopt;
    reduced.push_back({d.rank, capacityOf(d.faults)});
  }
  if (reduced.size() != agreement.reducedRanks) return std::nullopt;
  std::sort(reduced.begin(), reduced.end(),
            [](const RankCapacity& a, const RankCapacity& b) { return a.rank < b.rank; });
  return reduced;
}

std::vector<uint64_t> shareWeights(int size, const std::vector<RankCapacity>& reduced) {
  if (size <= 2 || reduced.empty()) return {};
  std::vector<int64_t> capacity(size, kFullCapacity);
  for (const RankCapacity& c : reduced) {
    if (c.rank >= 0 && c.rank < size) capacity[c.rank] = c.capacity;
  }
  // Water-filling: with the ranks of `active` reducing, the common time is
  // T = (N - 2 + |active|) / sum(capacity) and s_i is proportional to
  // T capacity_i - 1, i.e. to (N - 2 + |active|) capacity_i - sum. A rank
  // whose term is not positive reduces nothing; dropping it lowers T, so every
  // such rank drops at once and the rest are recomputed.
  std::vector<bool> active(size, true);
  std::vector<int64_t> term(size, 0);
  for (bool changed = true; changed;) {
    changed = false;
    int64_t count = 0, sum = 0;
    for (int r = 0; r < size; ++r) {
      if (active[r]) {
        ++count;
        sum += capacity[r];
      }
    }
    for (int r = 0; r < size; ++r) {
      if (!active[r]) continue;
      term[r] = (size - 2 + count) * capacity[r] - sum;
      if (term[r] <= 0) {
        active[r] = false;
        term[r] = 0;
        changed = true;
      }
    }
  }
  std::vector<uint64_t> weights(term.begin(), term.end());
  if (std::all_of(weights.begin(), weights.end(), [&](uint64_t w) { return w == weights[0]; })) {
    return {};
  }
  return weights;
}

std::optional<SharePlan> advanceShares(ShareState& state,
                                       const std::optional<std::vector<RankCapacity>>& agreed,
                                       uint64_t seq, uint64_t offset, uint64_t riseHold) {
  const std::vector<RankCapacity> target = agreed ? *agreed : std::vector<RankCapacity>{};
  if (target != state.seen) {
    state.seen = target;
    state.seenSince = seq;
  }
  if (target == state.current.reduced) {
    state.pending.reset();
    return std::nullopt;
  }
  bool falls = !agreed;
  for (const RankCapacity& c : target) {
    falls = falls || c.capacity < capacityIn(state.current.reduced, c.rank);
  }
  const uint64_t start = state.seenSince + (falls ? 0 : riseHold) + offset;
  if (!state.pending || state.pending->reduced != target || state.pending->startOp != start) {
    state.pending = SharePlan{state.current.id + 1, start, target};
  }
  if (state.pending->startOp > seq) return std::nullopt;
  state.current = *state.pending;
  state.pending.reset();
  return state.current;
}

std::string describeShares(const std::vector<uint64_t>& weights) {
  if (weights.empty()) return "equal shares";
  uint64_t total = 0;
  for (uint64_t w : weights) total += w;
  constexpr size_t kShown = 16;  // a summary, not an O(N) line
  std::string out = "shares by rank:";
  for (size_t r = 0; r < std::min(weights.size(), kShown); ++r) {
    char share[32];
    std::snprintf(share, sizeof(share), " %.3f", static_cast<double>(weights[r]) / total);
    out += share;
  }
  return weights.size() > kShown ? out + " ..." : out;
}

}  // namespace reccl
