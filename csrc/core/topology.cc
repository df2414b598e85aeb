#include "core/topology.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <climits>
#include <cstdlib>
#include <map>

#include "core/error.h"

namespace reccl {

namespace {

// "/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0" -> its components after /sys/devices.
std::vector<std::string> pciComponents(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = path.find("/pci");
  if (start == std::string::npos) return parts;
  size_t pos = start + 1;
  while (pos < path.size()) {
    size_t next = path.find('/', pos);
    if (next == std::string::npos) next = path.size();
    parts.push_back(path.substr(pos, next - pos));
    pos = next + 1;
  }
  return parts;
}

// POSIX reads, not iostreams: this code also runs inside NCCL's dlopen of the
// library, where a libstdc++ stream crashed on its locale facets.
std::string readSysfs(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buffer[256];
  ssize_t got = ::read(fd, buffer, sizeof(buffer) - 1);
  ::close(fd);
  if (got <= 0) return "";
  std::string value(buffer, static_cast<size_t>(got));
  return value.substr(0, value.find('\n'));
}

bool isLoopbackAddress(const std::string& address) {
  in_addr parsed{};
  return inet_pton(AF_INET, address.c_str(), &parsed) == 1 && (ntohl(parsed.s_addr) >> 24) == 127;
}

// The device behind a sysfs link ("/sys/class/net/eth0/device",
// "/sys/bus/pci/devices/0000:3b:00.0"); an empty path when there is none.
PciLocation locationOfLink(const std::string& link) {
  PciLocation location;
  char resolved[PATH_MAX];
  if (realpath(link.c_str(), resolved) == nullptr) return location;
  location.path = resolved;
  std::string numa = readSysfs(link + "/numa_node");
  location.numaNode = numa.empty() ? -1 : std::atoi(numa.c_str());
  return location;
}

void fillSysfsInfo(NicInfo& nic) {
  int speed = std::atoi(readSysfs("/sys/class/net/" + nic.interface + "/speed").c_str());
  if (speed > 0) nic.speedMbps = speed;
  PciLocation location = locationOfLink("/sys/class/net/" + nic.interface + "/device");
  nic.pciPath = location.path;
  nic.numaNode = location.numaNode;
}

// "0000:3B:00.0" or NVML's "00000000:3B:00.0" -> "0000:3b:00.0"; "" when `busId`
// is not a PCI bus id (domain:bus:device.function in hex).
std::string canonicalBusId(const std::string& busId) {
  std::string lower;
  for (char c : busId) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const size_t colon = lower.find(':');
  if (colon != 4 && colon != 8) return "";
  const std::string canonical = lower.substr(colon - 4);  // a 4-digit domain, as sysfs names it
  const char* shape = "xxxx:xx:xx.x";
  if (canonical.size() != 12) return "";
  for (size_t i = 0; i < canonical.size(); ++i) {
    const bool hex = std::isxdigit(static_cast<unsigned char>(canonical[i])) != 0;
    if (shape[i] == 'x' ? !hex : canonical[i] != shape[i]) return "";
  }
  // an 8-digit domain must be a 4-digit one written wide
  for (size_t i = 0; i + 4 < colon; ++i) {
    if (lower[i] != '0') return "";
  }
  return canonical;
}

}  // namespace

NvlinkPairs NvlinkPairs::parse(const std::vector<std::string>& items) {
  NvlinkPairs out;
  if (items.size() == 1 && items[0] == "none") return out;
  for (const std::string& item : items) {
    const size_t dash = item.find('-');
    std::string a = dash == std::string::npos ? "" : canonicalBusId(item.substr(0, dash));
    std::string b = dash == std::string::npos ? "" : canonicalBusId(item.substr(dash + 1));
    if (a.empty() || b.empty() || a == b) {
      throw ConfigError("RECCL_NVLINK_PEERS entry '" + item +
                        "' is not a pair of two GPUs' PCI bus ids; valid: 'none' or a comma list "
                        "like 0000:18:00.0-0000:2a:00.0");
    }
    out.pairs_.insert(a < b ? std::make_pair(a, b) : std::make_pair(b, a));
  }
  return out;
}

bool NvlinkPairs::joined(const std::string& busA, const std::string& busB) const {
  std::string a = canonicalBusId(busA), b = canonicalBusId(busB);
  if (a.empty() || b.empty()) return false;
  return pairs_.count(a < b ? std::make_pair(a, b) : std::make_pair(b, a)) > 0;
}

int nicDistance(const NicInfo& a, const NicInfo& b) {
  return pciDistance({a.pciPath, a.numaNode}, {b.pciPath, b.numaNode});
}

PciLocation pciLocationOfBusId(const std::string& busId) {
  const std::string canonical = canonicalBusId(busId);
  if (canonical.empty()) return {};
  return locationOfLink("/sys/bus/pci/devices/" + canonical);
}

int pciDistance(const PciLocation& a, const PciLocation& b) {
  std::vector<std::string> pa = pciComponents(a.path);
  std::vector<std::string> pb = pciComponents(b.path);
  if (pa.empty() || pb.empty()) return -1;
  int cost = 0;
  if (a.numaNode >= 0 && b.numaNode >= 0 && a.numaNode != b.numaNode) cost += 200;
  size_t common = 0;
  while (common < pa.size() && common < pb.size() && pa[common] == pb[common]) ++common;
  // Components: [root complex, root port, switch ports..., device]. Sharing more
  // than the root complex and root port means a PCIe switch joins them.
  cost += common >= 3 ? 1 : 100;
  return cost;
}

void chooseBackups(std::vector<NicInfo>& nics) {
  const int count = static_cast<int>(nics.size());
  std::vector<int> timesChosen(count, 0);
  for (int i = 0; i < count; ++i) {
    nics[i].backup = -1;
    nics[i].backupCost = -1;
    int bestCost = INT_MAX;
    for (int step = 1; step < count; ++step) {
      int j = (i + step) % count;  // rail order after i breaks the last ties
      int cost = nicDistance(nics[i], nics[j]);
      int key = cost < 0 ? INT_MAX - 1 : cost;
      if (nics[i].backup < 0 || key < bestCost ||
          (key == bestCost && timesChosen[j] < timesChosen[nics[i].backup])) {
        nics[i].backup = j;
        nics[i].backupCost = cost;
        bestCost = key;
      }
    }
    if (nics[i].backup >= 0) ++timesChosen[nics[i].backup];
  }
}

std::vector<NicInfo> discoverNics(const std::vector<std::string>& selection) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) throw Error("getifaddrs failed: cannot list network interfaces");
  std::vector<NicInfo> all;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(entry->ifa_addr)->sin_addr, text,
              sizeof(text));
    NicInfo nic;
    nic.name = entry->ifa_name;
    nic.interface = entry->ifa_name;
    nic.address = text;
    nic.ifindex = static_cast<int>(if_nametoindex(entry->ifa_name));
    nic.linkUp = (entry->ifa_flags & IFF_UP) && (entry->ifa_flags & IFF_RUNNING);
    if (entry->ifa_flags & IFF_LOOPBACK) nic.name = "lo:" + nic.address;
    all.push_back(nic);
  }
  freeifaddrs(list);

  std::vector<NicInfo> chosen;
  if (selection.empty()) {
    for (const auto& nic : all) {
      if (nic.linkUp && !isLoopbackAddress(nic.address)) chosen.push_back(nic);
    }
    if (chosen.empty()) {
      throw ConfigError(
          "no usable NIC: no up, non-loopback IPv4 interface found; set RECCL_NICS to "
          "interface names or local IPv4 addresses (127.0.0.x for a single host)");
    }
  } else {
    for (const auto& wanted : selection) {
      const NicInfo* match = nullptr;
      for (const auto& nic : all) {
        if (nic.interface == wanted || nic.address == wanted) {
          match = &nic;
          break;
        }
      }
      if (match != nullptr) {
        chosen.push_back(*match);
      } else if (isLoopbackAddress(wanted)) {
        // Every 127.x address reaches loopback; lets one host play several NICs.
        NicInfo nic;
        nic.interface = "lo";
        nic.address = wanted;
        nic.name = "lo:" + wanted;
        nic.ifindex = static_cast<int>(if_nametoindex("lo"));
        chosen.push_back(nic);
      } else {
        std::string available;
        for (const auto& nic : all) available += " " + nic.interface + "(" + nic.address + ")";
        throw ConfigError("RECCL_NICS entry '" + wanted +
                          "' matches no local IPv4 interface or address; available:" + available);
      }
    }
  }
  for (size_t i = 0; i < chosen.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (chosen[i].name == chosen[j].name) {
        throw ConfigError("RECCL_NICS lists " + chosen[i].name + " twice");
      }
    }
  }
  for (auto& nic : chosen) fillSysfsInfo(nic);
  chooseBackups(chosen);
  return chosen;
}

std::string hostIdentity(const std::string& override) {
  if (!override.empty()) return "id:" + override;
  char name[256] = {};
  const ssize_t got = ::readlink("/proc/self/ns/net", name, sizeof(name) - 1);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);  // where /proc is missing: the host name alone
  return readSysfs("/proc/sys/kernel/random/boot_id") + "/" + (got > 0 ? name : host);
}

uint64_t hostKeyOf(const std::string& identity) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : identity) hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

void checkNicIndex(int nic, size_t count, const std::string& kind) {
  if (nic < 0 || nic >= static_cast<int>(count)) {
    throw ConfigError("NIC index " + std::to_string(nic) + " out of range; this process has " +
                      std::to_string(count) + " " + kind + " (0.." + std::to_string(count - 1) +
                      ")");
  }
}

}  // namespace reccl
