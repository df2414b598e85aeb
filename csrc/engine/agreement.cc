#include "engine/agreement.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace reccl {

namespace {

constexpr uint32_t kAgreementMagic = 0x41434552;  // "RECA" little-endian
constexpr uint8_t kAgreementVersion = 2;
constexpr uint8_t kHasOdd = 1;
constexpr uint8_t kFailed = 2;

#pragma pack(push, 1)
struct WireListed {
  int32_t rank;
  uint32_t nics;
  uint64_t opsDone;
  uint64_t backupChannels;
  uint64_t nicsDown;
  uint64_t deviceOps;
};
struct WireAgreement {
  uint32_t magic;
  uint8_t version;
  uint8_t flags;
  uint8_t listedCount;
  uint8_t missingCount;
  int32_t firstRank;
  int32_t oddRank;
  uint64_t countsDigest;
  uint64_t backupChannels;
  uint64_t maxOpsDone;
  uint32_t degradedRanks;
  uint32_t reducedRanks;
  int32_t missing[kListedDegradedRanks];
  uint8_t first[kDescriptorBytes];
  uint8_t odd[kDescriptorBytes];
  WireListed listed[kListedDegradedRanks];
};
#pragma pack(pop)
static_assert(sizeof(WireListed) == 40, "listed rank wire size");
static_assert(sizeof(WireAgreement) == kAgreementBytes, "agreement wire size");

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t pairHash(int from, int to, int size, uint64_t count) {
  return mix64(
      mix64(static_cast<uint64_t>(from) * static_cast<uint64_t>(size) + static_cast<uint64_t>(to)) ^
      count);
}

// The listing order of degraded ranks: reduced ones first, each kind by rank.
std::pair<bool, int> listingKey(const DegradedRank& d) { return {!d.faults.reduced(), d.rank}; }

// The lowest `limit` of the union of two sorted, disjoint lists.
template <typename T, typename Key>
std::vector<T> lowestOfBoth(const std::vector<T>& a, const std::vector<T>& b, size_t limit,
                            Key key) {
  std::vector<T> out;
  std::merge(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out),
             [&](const T& x, const T& y) { return key(x) < key(y); });
  out.erase(std::unique(out.begin(), out.end(),
                        [&](const T& x, const T& y) { return key(x) == key(y); }),
            out.end());
  if (out.size() > limit) out.resize(limit);
  return out;
}

}  // namespace

Agreement Agreement::of(int rank, const OpDescriptor& op, const RankFaults& faults,
                        uint64_t countsDigest) {
  Agreement a;
  a.firstRank = rank;
  a.first = op;
  a.countsDigest = countsDigest;
  a.backupChannels = faults.backupChannels;
  a.maxOpsDone = faults.opsDone;
  if (faults.degraded()) {
    a.degradedRanks = 1;
    a.reducedRanks = faults.reduced() ? 1 : 0;
    a.listed.push_back({rank, faults});
  }
  return a;
}

void Agreement::merge(const Agreement& other) {
  // The lowest rank of the union and its op; then the lowest rank whose op
  // differs from that one, found from each side's summary alone.
  const bool otherLower = other.firstRank < firstRank;
  const Agreement& low = otherLower ? other : *this;
  const Agreement& high = otherLower ? *this : other;
  int candidateRank = low.oddRank;
  OpDescriptor candidate = low.odd;
  const bool highAgrees = sameOp(high.first, low.first);
  const int highRank = highAgrees ? high.oddRank : high.firstRank;
  if (highRank >= 0 && (candidateRank < 0 || highRank < candidateRank)) {
    candidateRank = highRank;
    candidate = highAgrees ? high.odd : high.first;
  }
  if (otherLower) {  // the union's lowest rank is the other side's
    firstRank = other.firstRank;
    first = other.first;
  }
  oddRank = candidateRank;
  odd = candidateRank >= 0 ? candidate : OpDescriptor{};

  countsDigest += other.countsDigest;  // wraps: a sum modulo 2^64
  failed = failed || other.failed;
  missing = lowestOfBoth(missing, other.missing, kListedDegradedRanks, [](int r) { return r; });
  backupChannels |= other.backupChannels;
  maxOpsDone = std::max(maxOpsDone, other.maxOpsDone);
  degradedRanks += other.degradedRanks;
  reducedRanks += other.reducedRanks;
  listed = lowestOfBoth(listed, other.listed, kListedDegradedRanks, listingKey);
}

void Agreement::check(const std::string& group) const {
  // A rejection of the same op is named as such; a different op is a plain mismatch.
  if (first.rejection) throw MismatchError(rejectionMessage(group, firstRank, first));
  if (oddRank < 0) return;
  if (odd.rejection && odd.seq == first.seq && odd.kind == first.kind) {
    throw MismatchError(rejectionMessage(group, oddRank, odd));
  }
  throw MismatchError(mismatchMessage(group, firstRank, first, oddRank, odd));
}

uint64_t alltoallCountsDigest(int rank, int size, const std::vector<uint64_t>& sendCounts,
                              const std::vector<uint64_t>& recvCounts) {
  uint64_t digest = 0;
  for (int peer = 0; peer < size; ++peer) {
    digest += pairHash(rank, peer, size, sendCounts.at(peer));
    digest -= pairHash(peer, rank, size, recvCounts.at(peer));
  }
  return digest;
}

void encodeAgreement(const Agreement& a, int groupSize, uint8_t* out) {
  WireAgreement wire{};
  wire.magic = kAgreementMagic;
  wire.version = kAgreementVersion;
  wire.flags = static_cast<uint8_t>((a.oddRank >= 0 ? kHasOdd : 0) | (a.failed ? kFailed : 0));
  wire.listedCount = static_cast<uint8_t>(std::min<size_t>(a.listed.size(), kListedDegradedRanks));
  wire.missingCount =
      static_cast<uint8_t>(std::min<size_t>(a.missing.size(), kListedDegradedRanks));
  wire.firstRank = a.firstRank;
  wire.oddRank = a.oddRank;
  wire.countsDigest = a.countsDigest;
  wire.backupChannels = a.backupChannels;
  wire.maxOpsDone = a.maxOpsDone;
  wire.degradedRanks = a.degradedRanks;
  wire.reducedRanks = a.reducedRanks;
  for (int i = 0; i < wire.missingCount; ++i) wire.missing[i] = a.missing[i];
  encodeDescriptor(a.first, a.firstRank, groupSize, wire.first);
  if (a.oddRank >= 0) encodeDescriptor(a.odd, a.oddRank, groupSize, wire.odd);
  for (int i = 0; i < wire.listedCount; ++i) {
    const DegradedRank& d = a.listed[i];
    wire.listed[i] = {d.rank,
                      d.faults.nics,
                      d.faults.opsDone,
                      d.faults.backupChannels,
                      d.faults.nicsDown,
                      d.faults.deviceOps};
  }
  std::memcpy(out, &wire, sizeof(wire));
}

Agreement decodeAgreement(const uint8_t* data, size_t bytes, int groupSize) {
  if (bytes < sizeof(WireAgreement)) {
    throw ProtocolError("collective agreement of " + std::to_string(bytes) +
                        " bytes is truncated (" + std::to_string(kAgreementBytes) + " expected)");
  }
  WireAgreement wire;
  std::memcpy(&wire, data, sizeof(wire));
  if (wire.magic != kAgreementMagic || wire.version != kAgreementVersion) {
    throw ProtocolError(
        "not a collective agreement (bad magic or version); the peer is out of "
        "step or runs another reccl version");
  }
  auto inGroup = [&](int64_t r) { return r >= 0 && r < groupSize; };
  if (wire.listedCount > kListedDegradedRanks || wire.missingCount > kListedDegradedRanks ||
      wire.degradedRanks < wire.listedCount ||
      wire.degradedRanks > static_cast<uint32_t>(groupSize) ||
      wire.reducedRanks > wire.degradedRanks || !inGroup(wire.firstRank) ||
      ((wire.flags & kHasOdd) != 0) != (wire.oddRank >= 0) ||
      (wire.oddRank >= 0 ? !inGroup(wire.oddRank) : wire.oddRank != -1) ||
      (wire.flags & ~(kHasOdd | kFailed)) != 0) {
    throw ProtocolError("collective agreement has counts or ranks outside a group of " +
                        std::to_string(groupSize));
  }
  Agreement a;
  a.firstRank = wire.firstRank;
  a.first = decodeDescriptor(wire.first, kDescriptorBytes, groupSize).desc;
  a.oddRank = wire.oddRank;
  if (a.oddRank >= 0) a.odd = decodeDescriptor(wire.odd, kDescriptorBytes, groupSize).desc;
  a.countsDigest = wire.countsDigest;
  a.failed = (wire.flags & kFailed) != 0;
  for (int i = 0; i < wire.missingCount; ++i) {
    if (!inGroup(wire.missing[i]) || (i > 0 && wire.missing[i] <= wire.missing[i - 1])) {
      throw ProtocolError("collective agreement lists missing ranks out of order or range");
    }
    a.missing.push_back(wire.missing[i]);
  }
  a.backupChannels = wire.backupChannels;
  a.maxOpsDone = wire.maxOpsDone;
  a.degradedRanks = wire.degradedRanks;
  a.reducedRanks = wire.reducedRanks;
  for (int i = 0; i < wire.listedCount; ++i) {
    const WireListed& w = wire.listed[i];
    DegradedRank d{w.rank, {w.opsDone, w.backupChannels, w.nicsDown, w.deviceOps, w.nics}};
    if (!inGroup(w.rank) || w.nics > 64 ||
        (i > 0 && listingKey(d) <= listingKey(a.listed.back()))) {
      throw ProtocolError("collective agreement lists degraded ranks out of order or range");
    }
    a.listed.push_back(d);
  }
  return a;
}

}  // namespace reccl
