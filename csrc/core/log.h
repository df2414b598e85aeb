// Minimal leveled logging to stderr, controlled by RECCL_DEBUG.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "core/clock.h"

namespace reccl {

enum class LogLevel { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

void setLogLevel(LogLevel level);
LogLevel logLevel();
void logLine(LogLevel level, const std::string& message);

#define RECCL_LOG(level, msg)                              \
  do {                                                     \
    if (::reccl::logLevel() >= ::reccl::LogLevel::level) { \
      ::reccl::logLine(::reccl::LogLevel::level, (msg));   \
    }                                                      \
  } while (0)

// At most one line per `interval` for each key, so that whoever can make us log
// (a stranger connecting to a listener, say) cannot flood the log. A key's
// first line goes out at once; the lines of that key within the next interval
// are only counted, and their count goes out as one line when the interval
// ends: "<N> more <what> (<key>) in the last 10.0 s". A key still busy then
// starts a new interval with that line, so a steady flood costs one line per
// interval. Keys must come from a small fixed set (one entry each, dropped once
// quiet). Thread-safe.
class LogLimiter {
 public:
  using Sink = std::function<void(LogLevel, const std::string&)>;
  LogLimiter(LogLevel level, Millis interval, std::string what, Sink sink = logLine);
  // Writes the counts still pending.
  ~LogLimiter();
  LogLimiter(const LogLimiter&) = delete;
  LogLimiter& operator=(const LogLimiter&) = delete;

  // Writes `line` unless `key` wrote a line less than an interval ago; counts it then.
  void log(const std::string& key, const std::string& line, Clock::time_point now = Clock::now());
  // Writes the counts of the intervals that have ended. Returns when the next
  // count is due (time_point::max() when none is pending): a caller that
  // sleeps until then has nothing to do while no line is held back.
  Clock::time_point flushDue(Clock::time_point now = Clock::now());

 private:
  struct Window {
    Clock::time_point start;
    uint64_t suppressed = 0;
  };
  // Writes `window`'s count and starts a new interval at `now`; mutex_ held.
  void summarizeLocked(const std::string& key, Window& window, Clock::time_point now);
  void write(const std::string& text);

  const LogLevel level_;
  const Millis interval_;
  const std::string what_;
  const Sink sink_;
  std::mutex mutex_;
  std::map<std::string, Window> windows_;
};

}  // namespace reccl
