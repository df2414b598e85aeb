// What the ranks of a group agree on at every collective, before any data
// moves: that they all called the same op (the consistency check) and the
// group's fault state (which channels run over a backup NIC somewhere, which
// ranks are degraded). Each rank starts from its own Agreement; recursive
// doubling merges them (recursive_doubling.h), O(log N) messages per rank.
//
// merge() is commutative and associative and its result depends only on the
// set of ranks merged, so every rank ends with the same bytes: a mismatch
// raises the same error on every rank, and DCR switches plans at the same op
// on every rank (rebalance.h) with no coordinator and no store traffic. This is
// the paper's periodic AllGather of (NIC state, ops done), done in-band at
// each op instead of on a timer: it costs nothing while the group is idle.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/descriptor.h"

namespace reccl {

// One rank's fault state as it enters a collective.
struct RankFaults {
  uint64_t opsDone = 0;
  uint64_t backupChannels = 0;  // bit c: a path of channel c runs over a backup NIC
  uint64_t nicsDown = 0;        // bit n: local NIC n is down
  uint64_t deviceOps = 0;       // collectives issued by the group's GPU backend (NCCL)
  uint32_t nics = 0;            // local NICs (0: not known); nicsDown counts against them
  bool degraded() const { return backupChannels != 0 || nicsDown != 0; }
  // Some of its own NICs are unusable: its host carries less (shares.h).
  bool reduced() const { return nicsDown != 0; }
};

struct DegradedRank {
  int rank = 0;
  RankFaults faults;
};

// The degraded ranks an agreement lists by name; the rest are only counted,
// so the state stays O(1) whatever the group size. Ranks with NICs of their
// own unusable (reduced()) are listed before ranks only on backup paths, so
// every reduced rank is known by name while there are at most this many.
constexpr int kListedDegradedRanks = 8;

struct Agreement {
  // Consistency: the lowest rank and its op, and the lowest rank whose op
  // differs from it (-1: none, every rank agrees).
  int firstRank = -1;
  OpDescriptor first;
  int oddRank = -1;
  OpDescriptor odd;
  // all_to_all: sum over ranks of (hashes of what each sends to whom) minus
  // (hashes of what each expects from whom); 0 when every pair agrees.
  uint64_t countsDigest = 0;
  // Set when a rank gave up waiting (its partner never answered): the ranks it
  // found missing. A rank that hears this stops and reports them.
  bool failed = false;
  std::vector<int> missing;  // sorted, at most kListedDegradedRanks
  // Faults of the group.
  uint64_t backupChannels = 0;  // OR over ranks
  uint64_t maxOpsDone = 0;
  uint32_t degradedRanks = 0;
  uint32_t reducedRanks = 0;  // of those, ranks with NICs of their own unusable
  // The reduced ranks by rank, then the other degraded ranks by rank; the
  // first kListedDegradedRanks of that order.
  std::vector<DegradedRank> listed;

  // A rank's own contribution.
  static Agreement of(int rank, const OpDescriptor& op, const RankFaults& faults,
                      uint64_t countsDigest);
  // Adds `other` (a disjoint set of ranks) into this one.
  void merge(const Agreement& other);
  // Throws MismatchError naming both sides, or the lowest rank that rejected
  // its own arguments (the same text on every rank).
  void check(const std::string& group) const;
};

// The all_to_all digest contribution of rank `rank` of `size`.
uint64_t alltoallCountsDigest(int rank, int size, const std::vector<uint64_t>& sendCounts,
                              const std::vector<uint64_t>& recvCounts);

// Fixed-size wire form (the head of every recursive-doubling message).
constexpr size_t kAgreementBytes = 592;
void encodeAgreement(const Agreement& agreement, int groupSize, uint8_t* out);
// Validates every field; throws ProtocolError naming the problem.
Agreement decodeAgreement(const uint8_t* data, size_t bytes, int groupSize);

}  // namespace reccl
