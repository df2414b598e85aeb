#pragma once

#include <chrono>
#include <cstdint>

namespace reccl {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

inline int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// The steady-clock instant of a nowNs() value.
inline Clock::time_point atNs(int64_t ns) {
  return Clock::time_point(
      std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(ns)));
}

// Wall-clock time for events, so users can line them up with their logs.
inline int64_t wallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace reccl
