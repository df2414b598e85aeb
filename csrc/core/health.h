// The process-global NIC health table: the one deliberate piece of global state.
// A NIC that dies is dead for every connection in the process at once, idle ones
// included, so no connection waits for its own timeout to notice. The table also
// carries the per-NIC counters behind stats() and the event ring.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <array>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/events.h"

namespace reccl {

struct NicCounters {
  std::atomic<uint64_t> bytesSent{0};
  std::atomic<uint64_t> bytesReceived{0};
  std::atomic<uint64_t> failovers{0};   // failovers away from a path on this NIC
  std::atomic<uint64_t> failbacks{0};   // failbacks onto a path on this NIC
  std::atomic<uint64_t> pathsDown{0};
  std::atomic<uint64_t> nvlBytes{0};    // bytes staged through a transit GPU for this NIC
};

// How often a path paused by an injected blackhole (NicHealth::setBlackhole)
// looks again: only while the drill lasts, so an idle path is never polled.
constexpr std::chrono::milliseconds kBlackholeRecheck{10};

class NicHealth {
 public:
  // Called with (nic name, up) after every state change.
  using Listener = std::function<void(const std::string& nic, bool up, Reason reason)>;

  static NicHealth& instance();

  // Registers a NIC (idempotent) and returns its stable slot id.
  // Throws when more than kMaxNics distinct NICs are registered.
  int registerNic(const std::string& name, bool linkUp);
  int idOf(const std::string& name) const;  // -1 if unknown
  std::vector<std::string> names() const;

  // Link state from the kernel (netlink) or a drill. A NIC is usable only when
  // its link is up and no injected fault holds it down.
  void setLinkUp(int id, bool up, Reason reason);
  void setInjectedDown(int id, bool down);
  void setBlackhole(int id, bool on);

  bool usable(int id) const;
  bool blackholed(int id) const;
  // How much of a spread connection's traffic this NIC should carry relative
  // to its peers (1.0: its full share). Spreading multiplies it into each
  // path's weight.
  double weight(int id) const;
  NicCounters& counters(int id);

  uint64_t addListener(Listener listener);
  void removeListener(uint64_t token);

  EventRing& events() { return events_; }
  void emit(Event event);

  // NVL transit GPU memory held now and at most, over all connections.
  void addTransitBytes(int64_t delta);
  int64_t transitBytes() const { return transitBytes_.load(); }
  int64_t transitPeakBytes() const { return transitPeakBytes_.load(); }

  uint64_t rejectedHandshakes() const { return rejectedHandshakes_.load(); }
  void countRejectedHandshake() { rejectedHandshakes_.fetch_add(1); }

 private:
  struct Entry {
    std::string name;
    std::atomic<bool> linkUp{true};
    std::atomic<bool> injectedDown{false};
    std::atomic<bool> blackhole{false};
    NicCounters counters;
  };
  NicHealth() = default;
  void notify(int id, bool wasUsable, Reason reason);

  mutable std::mutex mutex_;
  // Fixed slots, so readers on data paths index them without taking the lock.
  static constexpr size_t kMaxNics = 64;
  std::array<Entry, kMaxNics> entries_;
  std::atomic<size_t> count_{0};
  std::map<uint64_t, Listener> listeners_;
  uint64_t nextToken_ = 1;
  EventRing events_;
  std::atomic<uint64_t> rejectedHandshakes_{0};
  std::atomic<int64_t> transitBytes_{0};
  std::atomic<int64_t> transitPeakBytes_{0};
};

}  // namespace reccl
