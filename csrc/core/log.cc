#include "core/log.h"

#include <unistd.h>

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

}  // namespace reccl
