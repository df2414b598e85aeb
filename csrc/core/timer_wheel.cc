#include "core/timer_wheel.h"

#include <algorithm>

namespace reccl {

void TimerWheel::mark(size_t slot, bool occupied) {
  const uint64_t bit = uint64_t{1} << (slot % 64);
  if (occupied) {
    occupied_[slot / 64] |= bit;
  } else {
    occupied_[slot / 64] &= ~bit;
  }
}

void TimerWheel::set(uint64_t id, int64_t dueNs) {
  cancel(id);
  const int64_t tick = std::max(dueNs / kTickNs, cursorTick_ + 1);
  const size_t slot = static_cast<size_t>(tick) % kSlots;
  timers_[id] = Timer{dueNs, slot};
  slots_[slot].insert(id);
  mark(slot, true);
}

void TimerWheel::cancel(uint64_t id) {
  auto it = timers_.find(id);
  if (it == timers_.end()) return;
  auto& slot = slots_[it->second.slot];
  slot.erase(id);
  if (slot.empty()) mark(it->second.slot, false);
  timers_.erase(it);
}

int64_t TimerWheel::deadlineOf(uint64_t id) const {
  auto it = timers_.find(id);
  return it == timers_.end() ? -1 : it->second.dueNs;
}

int64_t TimerWheel::nextWakeNs() const {
  if (timers_.empty()) return -1;
  // Scan the slots after the cursor, in wheel order, for the first occupied one.
  const size_t start = static_cast<size_t>(cursorTick_ + 1) % kSlots;
  for (size_t step = 0; step < kSlots;) {
    const size_t slot = (start + step) % kSlots;
    const uint64_t word = occupied_[slot / 64] >> (slot % 64);
    if (word == 0) {
      step += 64 - slot % 64;  // the rest of this word is empty
      continue;
    }
    const size_t skip = static_cast<size_t>(__builtin_ctzll(word));
    if (step + skip >= kSlots) break;
    // The end of that slot's tick: every deadline of this turn in it is due by then.
    return (cursorTick_ + 2 + static_cast<int64_t>(step + skip)) * kTickNs;
  }
  return (cursorTick_ + 2) * kTickNs;  // unreachable while timers_ is non-empty
}

void TimerWheel::popDue(int64_t nowNs, std::vector<uint64_t>* due) {
  const int64_t nowTick = nowNs / kTickNs;
  if (nowTick <= cursorTick_) return;
  const int64_t ticks = std::min<int64_t>(nowTick - cursorTick_, kSlots);
  for (int64_t i = 1; i <= ticks; ++i) {
    const size_t slot = static_cast<size_t>(cursorTick_ + i) % kSlots;
    if (!(occupied_[slot / 64] >> (slot % 64) & 1)) continue;
    auto& ids = slots_[slot];
    for (auto it = ids.begin(); it != ids.end();) {
      auto timer = timers_.find(*it);
      if (timer->second.dueNs <= nowNs) {
        due->push_back(*it);
        timers_.erase(timer);
        it = ids.erase(it);
      } else {
        ++it;  // later in this tick, or a later turn's deadline
      }
    }
    if (ids.empty()) mark(slot, false);
  }
  // The current tick is not over: its slot is scanned again next time, or a
  // deadline later in this tick would wait a whole turn.
  cursorTick_ = nowTick - 1;
}

}  // namespace reccl
