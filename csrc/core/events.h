// The event log: a bounded lock-free ring that library threads push into and a
// Python thread drains. A full ring drops the newest event and counts it, so a
// slow consumer can never stall a data path.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace reccl {

enum class EventKind : uint8_t {
  kPathDown = 0,
  kPathUp,
  kFailover,
  kFailback,
  kNicDown,
  kNicUp,
  kConnectionFailed,
  kHandshakeRejected,
  kRebalance,  // a process group switched channel plans (DCR)
  kDegraded,   // a NIC is up but far slower than its peers: traffic moves off it
  kRecovered,  // a degraded NIC is back near its peers' goodput, or a stalled connection moves
               // traffic
  kStalled,    // a connection that carried traffic has had no usable path for a while
};

enum class Reason : uint8_t {
  kNone = 0,
  kLinkDown,   // netlink said the interface lost its link
  kLinkUp,
  kError,      // a socket or protocol error
  kTimeout,    // heartbeat silence
  kInjected,   // inject_fault()
  kPeer,       // the peer told us over another path
  kHealed,     // a failed path or NIC came back
  kSlow,       // goodput far below the peer NICs' (grey failure)
};

const char* eventKindName(EventKind kind);
const char* reasonName(Reason reason);

struct Event {
  EventKind kind = EventKind::kPathDown;
  Reason reason = Reason::kNone;
  int64_t wallNs = 0;          // when it happened (system clock)
  int64_t durationNs = -1;     // failover/failback: detection -> traffic resumed
  int64_t bytesReplayed = -1;  // failover: bytes re-sent after resync
  uint64_t connectionId = 0;
  int32_t fromPath = -1;
  int32_t toPath = -1;
  std::string nic;     // local NIC name
  std::string peer;    // remote address, when there is one
  std::string detail;  // human-readable context
  // kRebalance: the group, the collective the new plan starts at and its id.
  std::string group;
  int64_t op = -1;
  int64_t plan = -1;
};

class EventRing {
 public:
  explicit EventRing(size_t capacityPow2 = 4096);
  // Never blocks; returns false (and counts a drop) when the ring is full.
  bool push(Event event);
  // Moves out up to `max` events in order.
  std::vector<Event> drain(size_t max);
  uint64_t dropped() const { return dropped_.load(); }

 private:
  struct Slot {
    std::atomic<uint64_t> sequence{0};
    Event event;
  };
  const size_t mask_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> head_{0};  // next slot to write
  std::atomic<uint64_t> tail_{0};  // next slot to read
  std::atomic<uint64_t> dropped_{0};
  std::mutex drainMutex_;  // drain() has one consumer at a time
};

}  // namespace reccl
