// Local NICs and their backups. A NIC is a local interface with an IPv4 address;
// its position in the table is its rail. Each NIC gets the nearest other NIC as
// its backup by the distance cost of docs/design.md §3.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace reccl {

struct NicInfo {
  std::string name;       // "eth0", or "lo:127.0.0.2" for an address on loopback
  std::string interface;  // kernel interface name ("eth0", "lo")
  std::string address;    // dotted IPv4
  int ifindex = 0;
  bool linkUp = true;
  int speedMbps = 10000;  // from sysfs; virtual interfaces report none
  std::string pciPath;    // sysfs device path; empty for virtual interfaces
  int numaNode = -1;
  int backup = -1;        // index of the backup NIC, -1 when there is none
  int backupCost = -1;    // distance cost to the backup; -1 = unknown (no PCI path)
};

// Where a PCI device sits: its sysfs device path and NUMA node.
struct PciLocation {
  std::string path;  // "/sys/devices/pci0000:00/..."; empty when unknown
  int numaNode = -1;
};

// Distance between two PCI devices from their sysfs paths and NUMA nodes:
// +1 for crossing a shared PCIe switch, +100 for crossing the root complex,
// +200 for crossing NUMA nodes. -1 when either has no PCI path.
int pciDistance(const PciLocation& a, const PciLocation& b);
int nicDistance(const NicInfo& a, const NicInfo& b);

// The location of the device with PCI bus id `busId` ("0000:3B:00.0", any case,
// or NVML's 8-digit domain "00000000:3B:00.0");
// an empty path when sysfs does not list it.
PciLocation pciLocationOfBusId(const std::string& busId);

// RECCL_NVLINK_PEERS: the GPU pairs NVML reports joined by NVLink (set by
// `import torch_reccl` through pynvml; the plugin itself does not load NVML).
// NVL (csrc/gpu) only transits between such pairs: over PCIe peer access the
// detour crosses the same root complex it was meant to avoid.
class NvlinkPairs {
 public:
  // From the setting's items: "0000:18:00.0-0000:2a:00.0" per pair (bus ids in
  // any case, 4- or 8-digit domain), or the single item "none". Throws
  // ConfigError naming the malformed item and the valid form.
  static NvlinkPairs parse(const std::vector<std::string>& items);
  // Whether the GPUs at these bus ids (as CUDA reports them) are an NVLink
  // pair; false for a bus id that is not a PCI bus id.
  bool joined(const std::string& busA, const std::string& busB) const;
  size_t size() const { return pairs_.size(); }

 private:
  std::set<std::pair<std::string, std::string>> pairs_;  // canonical ids, first < second
};

// Fills `backup` and `backupCost` for every NIC: the cheapest other NIC; ties go
// to the NIC serving as backup the fewest times so far (spreading load evenly),
// then to the next NIC in rail order. Without PCI paths: the next NIC in order.
void chooseBackups(std::vector<NicInfo>& nics);

// The NICs selected by RECCL_NICS (interface names or local IPv4 addresses; an
// address in 127.0.0.0/8 is allowed for single-host runs) or, when `selection`
// is empty, every up, non-loopback IPv4 interface. Throws ConfigError naming the
// available interfaces when an entry matches none.
std::vector<NicInfo> discoverNics(const std::vector<std::string>& selection);

// This process's host for the CPU engine's two-level layout: `override`
// (RECCL_HOST_ID) when set, else the kernel's boot id and the network
// namespace, so processes that share a network stack share a host (the fabric
// emulator's namespaces are hosts of their own) whatever their NIC selection.
std::string hostIdentity(const std::string& override);
// A 64-bit key for a host identity (FNV-1a), to compare hosts in fixed-size fields.
uint64_t hostKeyOf(const std::string& identity);

// Throws ConfigError unless 0 <= nic < count; `kind` names what is counted
// ("NICs", "RDMA devices").
void checkNicIndex(int nic, size_t count, const std::string& kind);

}  // namespace reccl
