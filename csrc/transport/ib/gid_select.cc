#include "transport/ib/gid_select.h"

#include <arpa/inet.h>

#include <algorithm>

#include "core/error.h"

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

bool usable(const GidEntry& entry, bool ethernet, const AddressRange* range) {
  if (isZero(entry.gid)) return false;
  if (!ethernet) return true;
  if (entry.type != GidType::kRoceV2 || isLinkLocal(entry.gid)) return false;
  const bool ipv4 = isIpv4Mapped(entry.gid);
  if (range == nullptr) return ipv4;
  return range->contains(ipv4 ? entry.gid.data() + 12 : entry.gid.data(), !ipv4);
}

const char* typeName(GidType type) {
  switch (type) {
    case GidType::kIb: return "IB";
    case GidType::kRoceV1: return "RoCEv1";
    case GidType::kRoceV2: return "RoCEv2";
    case GidType::kUnknown: break;
  }
  return "unknown-type";
}

std::string describeTable(const std::vector<GidEntry>& table) {
  std::string out;
  for (const GidEntry& entry : table) {
    if (isZero(entry.gid)) continue;
    char text[INET6_ADDRSTRLEN] = {};
    inet_ntop(AF_INET6, entry.gid.data(), text, sizeof(text));
    out += (out.empty() ? "" : ", ") + std::to_string(entry.index) + " " + text + " " +
           typeName(entry.type);
  }
  return out.empty() ? "(no GIDs)" : out;
}

}  // namespace

int selectGidIndex(const std::vector<GidEntry>& table, bool ethernet, const AddressRange* range) {
  int best = -1;
  for (const GidEntry& entry : table) {
    if (usable(entry, ethernet, range) && (best < 0 || entry.index < best)) best = entry.index;
  }
  return best;
}

std::vector<GidEntry> readGidTable(VerbsDevice& device, int port, int tableLength) {
  std::vector<GidEntry> table;
  std::string why;
  if (!device.queryGidTable(port, &table, &why)) {
    table.clear();
    for (int i = 0; i < tableLength; ++i) table.push_back(device.queryGid(port, i));
  }
  table.erase(std::remove_if(table.begin(), table.end(),
                             [](const GidEntry& e) { return isZero(e.gid); }),
              table.end());
  std::sort(table.begin(), table.end(),
            [](const GidEntry& a, const GidEntry& b) { return a.index < b.index; });
  return table;
}

GidEntry chooseGid(const std::vector<GidEntry>& table, bool ethernet, const GidPolicy& policy,
                   const std::string& device) {
  if (policy.forcedIndex >= 0) {
    for (const GidEntry& entry : table) {
      if (entry.index == policy.forcedIndex) return entry;
    }
    throw Error("RECCL_IB_GID_INDEX=" + std::to_string(policy.forcedIndex) + ": " + device +
                " port 1 has no GID at that index; its GIDs: " + describeTable(table));
  }
  const AddressRange* range = policy.range ? &*policy.range : nullptr;
  const int index = selectGidIndex(table, ethernet, range);
  for (const GidEntry& entry : table) {
    if (entry.index == index) return entry;
  }
  std::string wanted =
      !ethernet ? "non-zero"
      : range != nullptr
          ? "RoCE v2 (not link-local) with an address in RECCL_IB_ADDR_RANGE=" + range->describe()
          : "RoCE v2 IPv4 (::ffff:a.b.c.d)";
  throw Error(device + " has no usable GID: none is " + wanted +
              "; its GIDs: " + describeTable(table) +
              " (is an IP address configured on its netdev? RECCL_IB_GID_INDEX forces one)");
}

}  // namespace reccl
