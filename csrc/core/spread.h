// Spreading (RECCL_SPREAD): while a connection's primary path is down, its
// chunks go over one path per surviving NIC ("lanes") instead of the backup
// alone, so every surviving NIC carries an equal part of the failed NIC's load.
//
// SpreadLanes picks the lane for each piece (below): the one whose bytes still
// waiting for their ACK, plus the piece, take the least time at its weight. A lane's
// weight is its measured goodput (an EWMA of the bytes acknowledged per second
// while it had bytes outstanding; equal at start) times the NIC's
// NicHealth::weight() and a PCI-distance factor. A slower lane acknowledges
// later, so it holds more outstanding bytes and gets fewer new chunks even
// before its goodput is measured.
//
// Pieces: a chunk is the unit of resume (a RESYNC counts whole chunks), but a
// message of a few chunks cannot be split evenly over lanes a chunk at a time
// (4 chunks over 3 lanes load one NIC with 2 of them, and the collective waits
// for it). While spreading, the sender cuts each chunk into one piece per lane;
// pieces start on a multiple of ChunkPieces::unit() inside their chunk, and the
// receiver counts a chunk landed once all its units have.
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

// The piece geometry of a message in `chunkBytes`-byte chunks, the same at
// both ends (the receiver's listen handle carries its chunkBytes).
class ChunkPieces {
 public:
  static constexpr uint64_t kUnitsPerChunk = 64;  // a chunk's landed units fit one mask
  explicit ChunkPieces(uint64_t chunkBytes)
      : chunkBytes_(chunkBytes), unit_((chunkBytes + kUnitsPerChunk - 1) / kUnitsPerChunk) {}
  uint64_t unit() const { return unit_; }
  // The bytes of the chunk holding `offset` in a message of `messageBytes`.
  uint64_t chunkLength(uint64_t offset, uint64_t messageBytes) const;
  // The units of that chunk: its mask when all have landed (a 0-byte message
  // has one chunk of one unit).
  uint64_t fullMask(uint64_t offset, uint64_t messageBytes) const;
  // The units of the piece [offset, +bytes), which must be valid().
  uint64_t maskOf(uint64_t offset, uint64_t bytes) const;
  // A piece may start on any unit of a chunk and run to a later unit boundary
  // or to the chunk's end (a whole chunk is one piece).
  bool valid(uint64_t offset, uint64_t bytes, uint64_t messageBytes) const;
  // The length of the piece at `offset` when a chunk is cut for `lanes` lanes.
  uint64_t pieceLength(uint64_t offset, uint64_t messageBytes, size_t lanes) const;

 private:
  uint64_t chunkBytes_;
  uint64_t unit_;
};

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
