// Spreading (RECCL_SPREAD): while a connection's primary path is down, its
// chunks go over one path per surviving NIC ("lanes") instead of the backup
// alone, so every surviving NIC carries an equal part of the failed NIC's load.
//
// SpreadLanes picks the lane for each chunk: the one whose bytes still waiting
// for their ACK, plus the chunk, take the least time at its weight. A lane's
// weight is its measured goodput (an EWMA of the bytes acknowledged per second
// while it had bytes outstanding; equal at start) times the NIC's
// NicHealth::weight() and a PCI-distance factor. A slower lane acknowledges
// later, so it holds more outstanding bytes and gets fewer new chunks even
// before its goodput is measured.
//
// SpreadTable lists the connections spreading now, for stats().
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/clock.h"

namespace reccl {

class SpreadLanes {
 public:
  // Starts an epoch over `slots` (each with its static weight factor: NIC
  // weight x distance factor): nothing outstanding. Measured goodput is kept
  // per slot across epochs.
  void reset(const std::vector<int>& slots, const std::vector<double>& factors);
  // Adds a lane mid-epoch (a path that came up later).
  void add(int slot, double factor);
  bool has(int slot) const;
  const std::vector<int>& slots() const { return slots_; }
  // The lane for a chunk of `bytes` posted at `now`, counted outstanding there.
  // Needs a lane.
  int pick(uint64_t bytes, Clock::time_point now);
  // `bytes` that `slot` carried were acknowledged at `now`.
  void acked(int slot, uint64_t bytes, Clock::time_point now);
  // Forgets the goodput measured on `slot` (its path was replaced).
  void forget(int slot);

 private:
  struct Lane {
    int slot = -1;
    double factor = 1.0;
    uint64_t outstanding = 0;
  };
  struct Meter {
    double goodput = 0;            // EWMA, bytes/s
    Clock::time_point since{};     // the sample started (busy since then)
    uint64_t bytes = 0;            // acknowledged since `since`
    bool busy = false;
  };
  Lane* find(int slot);
  double weightOf(const Lane& lane) const;

  std::vector<Lane> lanes_;
  std::vector<int> slots_;
  std::map<int, Meter> meters_;
};

// The static weight factor of a lane whose NIC is `cost` away from the primary's
// (core/topology.h nicDistance: +100 across the host bridge, +200 another NUMA
// node): it moves fewer bytes per second for the same buffers.
double spreadDistanceFactor(int cost);

struct SpreadInfo {
  uint64_t connection = 0;
  std::string peer;
  std::vector<std::string> nics;  // the local NICs of the lanes, lane order
};

class SpreadTable {
 public:
  static SpreadTable& instance();
  // `nics` empty: the connection stopped spreading.
  void set(uint64_t connection, const std::string& peer, std::vector<std::string> nics);
  std::vector<SpreadInfo> list() const;

 private:
  mutable std::mutex mutex_;
  std::map<uint64_t, SpreadInfo> spreading_;
};

}  // namespace reccl
