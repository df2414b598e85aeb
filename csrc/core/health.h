// The process-global NIC health table: the one deliberate piece of global state.
// A NIC that dies is dead for every connection in the process at once, idle ones
// included, so no connection waits for its own timeout to notice. The table also
// carries the per-NIC counters behind stats() and the event ring.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
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
  std::atomic<uint64_t> sameHostBytes{0};  // received by reading the sender's memory (same host)
  // Grey-failure input: wall time with at least one message in flight from this
  // NIC, and the bytes those messages carried, so goodput while busy can be
  // compared across NICs whatever load each was offered. Both are credited when
  // a message ends, the time being the busy time since the previous end: a
  // sampler then always reads bytes with the time that carried them, however
  // long a message is in flight or however many overlap (a NIC that never
  // goes idle is still measured).
  std::atomic<int64_t> busyNs{0};
  std::atomic<uint64_t> busyBytes{0};
};

// Grey-failure verdict on a NIC (core/grey_detector.h decides it).
enum class GreyState : uint8_t {
  kHealthy = 0,
  kDegraded,   // far slower than its peers: path choice treats it as down
  kProbation,  // degraded, on trial: carries traffic again so it can be measured
};
const char* greyStateName(GreyState state);

// How often a path paused by an injected blackhole (NicHealth::setBlackhole)
// looks again: only while the drill lasts, so an idle path is never polled.
constexpr std::chrono::milliseconds kBlackholeRecheck{10};

// One message in flight from a NIC, for as long as the object lives (see
// NicHealth::beginBusy); complete() credits its bytes. Movable, not copyable.
class NicBusy {
 public:
  NicBusy() = default;
  explicit NicBusy(int healthId);
  NicBusy(NicBusy&& other) noexcept : id_(other.id_) { other.id_ = -1; }
  NicBusy& operator=(NicBusy&& other) noexcept;
  NicBusy(const NicBusy&) = delete;
  NicBusy& operator=(const NicBusy&) = delete;
  ~NicBusy() { end(0); }
  void complete(uint64_t bytes) { end(bytes); }

 private:
  void end(uint64_t bytes);
  int id_ = -1;
};

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

  // Grey failures. A degraded NIC is not usable (connections fail over, DCR
  // plans around it, handshakes on it are declined) until put on trial; the
  // event (degraded / recovered) is emitted only when `announce` is set, so a
  // trial that fails changes path choice without another event.
  void setGrey(int id, GreyState state, double ratio, bool announce, const std::string& detail);
  GreyState grey(int id) const;
  // Share of traffic a NIC should carry relative to a healthy one: 1.0 while
  // healthy, the goodput ratio to its peers' median that condemned it while
  // degraded or on trial. Spreading multiplies it into each path's weight.
  double weight(int id) const;

  // One message in flight from NIC `id` begins / ends (`bytes` carried, 0 if
  // it did not complete here). Feeds NicCounters::busyNs and busyBytes.
  void beginBusy(int id);
  void endBusy(int id, uint64_t bytes);

  // Link up and not held down by a drill; usable() also needs it not degraded.
  bool linkUsable(int id) const;
  bool usable(int id) const;
  bool blackholed(int id) const;
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
    std::atomic<GreyState> grey{GreyState::kHealthy};
    std::atomic<double> greyRatio{1.0};
    NicCounters counters;
    std::mutex busyMutex;     // orders the begin/end of busy intervals
    int inFlight = 0;         // messages in flight, under busyMutex
    int64_t busyMarkNs = 0;   // start of the busy time not yet credited, under busyMutex
  };
  NicHealth() = default;
  // Emits nic_up/nic_down when the link changed, and tells listeners when
  // usable(id) changed (a link change or a grey verdict).
  void notify(int id, bool linkWasUp, bool wasUsable, Reason reason);

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
