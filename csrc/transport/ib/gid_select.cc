#include "transport/ib/gid_select.h"

namespace reccl {

namespace {

bool isZero(const Gid& gid) {
  for (uint8_t byte : gid) {
    if (byte != 0) return false;
  }
  return true;
}

bool isIpv4Mapped(const Gid& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid[i] != 0) return false;
  }
  return gid[10] == 0xff && gid[11] == 0xff;
}

bool isLinkLocal(const Gid& gid) { return gid[0] == 0xfe && (gid[1] & 0xc0) == 0x80; }

// Higher is better; 0 = unusable.
int rank(const GidEntry& entry, bool ethernet) {
  if (isZero(entry.gid)) return 0;
  if (!ethernet) return entry.type == GidType::kRoceV1 || entry.type == GidType::kRoceV2 ? 0 : 1;
  switch (entry.type) {
    case GidType::kRoceV2:
      if (isIpv4Mapped(entry.gid)) return 5;
      return isLinkLocal(entry.gid) ? 3 : 4;
    case GidType::kRoceV1: return 2;
    case GidType::kUnknown: return 1;
    case GidType::kIb: return 0;
  }
  return 0;
}

}  // namespace

int selectGidIndex(const std::vector<GidEntry>& table, bool ethernet) {
  int best = -1;
  int bestRank = 0;
  for (size_t i = 0; i < table.size(); ++i) {
    int r = rank(table[i], ethernet);
    if (r > bestRank) {  // ties keep the lowest index
      best = static_cast<int>(i);
      bestRank = r;
    }
  }
  return best;
}

std::vector<GidEntry> readGidTable(VerbsDevice& device, int port) {
  std::vector<GidEntry> table;
  int length = device.queryPort(port).gidTableLength;
  for (int i = 0; i < length; ++i) table.push_back(device.queryGid(port, i));
  return table;
}

}  // namespace reccl
