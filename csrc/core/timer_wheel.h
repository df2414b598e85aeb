// Deadlines of many handles in a hashed wheel of millisecond slots: setting,
// replacing and cancelling a deadline are O(1), and the next slot that may be
// due is found by a bitmap scan, so a loop serving thousands of idle sockets
// sleeps until the earliest one is due and never wakes for the others.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace reccl {

class TimerWheel {
 public:
  static constexpr int64_t kTickNs = 1000000;  // 1 ms: finer than any deadline we keep
  static constexpr size_t kSlots = 1024;       // one turn = 1.024 s; later deadlines take turns

  explicit TimerWheel(int64_t nowNs) : cursorTick_(nowNs / kTickNs - 1) {}

  // Sets (or replaces) the deadline of `id`. A deadline already past is due at
  // the next tick.
  void set(uint64_t id, int64_t dueNs);
  void cancel(uint64_t id);
  // The deadline of `id`, or -1 when it has none.
  int64_t deadlineOf(uint64_t id) const;
  // When to call popDue next, or -1 when no deadline is set: the end of the
  // first occupied slot's tick, at most 1 ms after the earliest deadline. May
  // find nothing due (a slot holds deadlines of later turns too).
  int64_t nextWakeNs() const;
  // Removes and appends to `due` every id whose deadline is at or before `nowNs`.
  void popDue(int64_t nowNs, std::vector<uint64_t>* due);

 private:
  struct Timer {
    int64_t dueNs;
    size_t slot;
  };
  void mark(size_t slot, bool occupied);

  int64_t cursorTick_;  // every tick up to this one is over and has been popped
  std::unordered_map<uint64_t, Timer> timers_;
  std::array<std::unordered_set<uint64_t>, kSlots> slots_;
  std::array<uint64_t, kSlots / 64> occupied_{};
};

}  // namespace reccl
