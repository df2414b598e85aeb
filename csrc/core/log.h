// Minimal leveled logging to stderr, controlled by RECCL_DEBUG.
#pragma once

#include <string>

namespace reccl {

enum class LogLevel { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

void setLogLevel(LogLevel level);
LogLevel logLevel();
void logLine(LogLevel level, const std::string& message);

#define RECCL_LOG(level, msg)                                   \
  do {                                                          \
    if (::reccl::logLevel() >= ::reccl::LogLevel::level) {      \
      ::reccl::logLine(::reccl::LogLevel::level, (msg));        \
    }                                                           \
  } while (0)

}  // namespace reccl
