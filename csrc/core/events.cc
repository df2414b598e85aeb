#include "core/events.h"

#include "core/error.h"

namespace reccl {

const char* eventKindName(EventKind kind) {
  switch (kind) {
    case EventKind::kPathDown: return "path_down";
    case EventKind::kPathUp: return "path_up";
    case EventKind::kFailover: return "failover";
    case EventKind::kFailback: return "failback";
    case EventKind::kNicDown: return "nic_down";
    case EventKind::kNicUp: return "nic_up";
    case EventKind::kConnectionFailed: return "connection_failed";
    case EventKind::kHandshakeRejected: return "handshake_rejected";
    case EventKind::kRebalance: return "rebalance";
    case EventKind::kDegraded: return "degraded";
    case EventKind::kRecovered: return "recovered";
    case EventKind::kStalled: return "stalled";
  }
  return "unknown";
}

const char* reasonName(Reason reason) {
  switch (reason) {
    case Reason::kNone: return "";
    case Reason::kLinkDown: return "link down";
    case Reason::kLinkUp: return "link up";
    case Reason::kError: return "error";
    case Reason::kTimeout: return "timeout";
    case Reason::kInjected: return "injected";
    case Reason::kPeer: return "peer";
    case Reason::kHealed: return "healed";
    case Reason::kSlow: return "slow";
  }
  return "unknown";
}

// A multi-producer ring with a sequence number per slot (Vyukov's bounded queue):
// a producer claims a slot by CAS on head_, fills it, then publishes it by
// bumping the slot's sequence; the single consumer reads slots in order.
EventRing::EventRing(size_t capacityPow2)
    : mask_(capacityPow2 - 1), slots_(new Slot[capacityPow2]) {
  if (capacityPow2 == 0 || (capacityPow2 & mask_) != 0) {
    throw Error("EventRing capacity must be a power of two");
  }
  for (size_t i = 0; i < capacityPow2; ++i) slots_[i].sequence.store(i);
}

bool EventRing::push(Event event) {
  uint64_t pos = head_.load(std::memory_order_relaxed);
  for (;;) {
    Slot& slot = slots_[pos & mask_];
    uint64_t seq = slot.sequence.load(std::memory_order_acquire);
    int64_t diff = static_cast<int64_t>(seq) - static_cast<int64_t>(pos);
    if (diff == 0) {
      if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
        slot.event = std::move(event);
        slot.sequence.store(pos + 1, std::memory_order_release);
        return true;
      }
    } else if (diff < 0) {
      dropped_.fetch_add(1);
      return false;
    } else {
      pos = head_.load(std::memory_order_relaxed);
    }
  }
}

std::vector<Event> EventRing::drain(size_t max) {
  std::lock_guard<std::mutex> lock(drainMutex_);
  std::vector<Event> out;
  uint64_t pos = tail_.load(std::memory_order_relaxed);
  while (out.size() < max) {
    Slot& slot = slots_[pos & mask_];
    uint64_t seq = slot.sequence.load(std::memory_order_acquire);
    if (static_cast<int64_t>(seq) - static_cast<int64_t>(pos + 1) < 0) break;  // not published yet
    out.push_back(std::move(slot.event));
    slot.sequence.store(pos + mask_ + 1, std::memory_order_release);
    ++pos;
  }
  tail_.store(pos, std::memory_order_relaxed);
  return out;
}

}  // namespace reccl
