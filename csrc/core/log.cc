#include "core/log.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

namespace reccl {

namespace {
std::atomic<LogLevel> gLevel{LogLevel::kWarn};
}

void setLogLevel(LogLevel level) { gLevel.store(level); }
LogLevel logLevel() { return gLevel.load(std::memory_order_relaxed); }

void logLine(LogLevel level, const std::string& message) {
  static const char* const kNames[] = {"", "WARN", "INFO", "TRACE"};
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[reccl %d %s] %s\n", static_cast<int>(getpid()),
               kNames[static_cast<int>(level)], message.c_str());
}

LogLimiter::LogLimiter(LogLevel level, Millis interval, std::string what, Sink sink)
    : level_(level), interval_(interval), what_(std::move(what)), sink_(std::move(sink)) {}

LogLimiter::~LogLimiter() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Clock::time_point now = Clock::now();
  for (auto& [key, window] : windows_) {
    if (window.suppressed > 0) summarizeLocked(key, window, now);
  }
}

void LogLimiter::write(const std::string& text) {
  if (logLevel() >= level_) sink_(level_, text);
}

void LogLimiter::summarizeLocked(const std::string& key, Window& window, Clock::time_point now) {
  char seconds[32];
  std::snprintf(seconds, sizeof(seconds), "%.1f s",
                std::chrono::duration<double>(now - window.start).count());
  write(std::to_string(window.suppressed) + " more " + what_ + " (" + key + ") in the last " +
        seconds);
  window.start = now;
  window.suppressed = 0;
}

void LogLimiter::log(const std::string& key, const std::string& line, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = windows_.find(key);
  if (it == windows_.end()) {
    windows_[key] = Window{now, 0};
    write(line);
    return;
  }
  Window& window = it->second;
  if (now < window.start + interval_) {
    ++window.suppressed;
    return;
  }
  if (window.suppressed == 0) {  // quiet for an interval: a fresh start
    window.start = now;
    write(line);
    return;
  }
  // The interval ended with lines held back and nobody flushed: this line is
  // counted with them, so the interval still costs one line.
  ++window.suppressed;
  summarizeLocked(key, window, now);
}

Clock::time_point LogLimiter::flushDue(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mutex_);
  Clock::time_point next = Clock::time_point::max();
  for (auto it = windows_.begin(); it != windows_.end();) {
    Window& window = it->second;
    if (now >= window.start + interval_) {
      if (window.suppressed == 0) {
        it = windows_.erase(it);  // quiet: the key's next line goes out at once
        continue;
      }
      summarizeLocked(it->first, window, now);
    }
    if (window.suppressed > 0) next = std::min(next, window.start + interval_);
    ++it;
  }
  return next;
}

}  // namespace reccl
